// examples/worker.mjs as a user runs it: a separate node process against `baton serve`; SIGTERM
// stops it and the process exits by itself (the lease thread does not keep it alive).
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { test } from "node:test";
import { BatonClient } from "../dist/index.js";
import { forEachBackend, uid, until } from "./helpers.mjs";

const example = join(dirname(fileURLToPath(import.meta.url)), "..", "examples", "worker.mjs");

forEachBackend("examples/worker.mjs", { config: `[queues.jobs]\nclaim_timeout = "1s"\n` }, (ctx) => {
  test("runs greet, sum, fails bad params; exits 0 soon after SIGTERM", async () => {
    let out = "";
    const child = spawn(process.execPath, [example], {
      env: { ...process.env, BATON_URL: ctx.url, BATON_QUEUE: "jobs" },
      stdio: ["ignore", "pipe", "pipe"],
    });
    child.stdout.on("data", (d) => (out += d));
    child.stderr.on("data", (d) => (out += d));
    const exited = new Promise((resolve) => child.on("exit", (code, signal) => resolve({ code, signal })));
    try {
      const baton = new BatonClient({ url: ctx.url });
      const [greet, sum, bad] = [uid("greet"), uid("sum"), uid("bad")];
      await baton.submit("jobs", "greet", { name: "Ada" }, { id: greet });
      await baton.submit("jobs", "sum", { numbers: [1, 2, 3.5] }, { id: sum });
      await baton.submit("jobs", "greet", { nom: "Ada" }, { id: bad });
      assert.deepEqual((await baton.wait(greet, { timeoutMs: 10_000 })).result, { greeting: "hello, Ada" });
      assert.equal((await baton.wait(sum, { timeoutMs: 10_000 })).result, 6.5);
      const failed = await baton.wait(bad, { timeoutMs: 10_000 });
      assert.equal(failed.status, "FAILED");
      assert.equal(failed.error, 'params must be {"name": string}');
      await until(() => out.includes("worker "), 5_000, "the banner");
      const t0 = Date.now();
      child.kill("SIGTERM");
      const { code } = await exited;
      assert.equal(code, 0, out);
      assert.ok(Date.now() - t0 < 4_000, `exited ${Date.now() - t0} ms after SIGTERM`);
      assert.match(out, /worker stopped/);
    } finally {
      child.kill("SIGKILL");
    }
  });
});
