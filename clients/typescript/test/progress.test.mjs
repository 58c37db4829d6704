// Progress and checkpoints (docs/workers.md, "Progress and checkpoints"): job.progress(),
// job.checkpoint() and job.report() go out with the lease's next renewal and show in the
// command's state; the last checkpoint comes back as job.details on the next delivery (after a
// release, a retried error, a Running re-poll, a worker killed hard); bad reports throw
// TypeError in the handler and never reach the server, whose renewals go on for every lease.
// Every queue has claim_timeout 1s (renewals every ~333 ms) unless said otherwise.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createServer } from "node:http";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { afterEach, test } from "node:test";
import { BatonClient, RawJson, Release, Running } from "../dist/index.js";
import { forEachBackend, sleep, startFaultProxy, uid, until, workerPool } from "./helpers.mjs";

const CONFIG = ["report", "resume", "killed", "stopped", "bad", "transit:2s", "refused"]
  .map((q) => {
    const [name, timeout = "1s"] = q.split(":");
    return `[queues.${name}]
claim_timeout = "${timeout}"
check_status_interval = "5s"
retry = { max_attempts = 3, initial_backoff = "50ms", backoff_factor = 1.0, max_backoff = "50ms" }
`;
  })
  .join("\n");
const INTERVAL_MS = 1_000 / 3;
const DIST = pathToFileURL(join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "index.js")).href;

/** A gate a handler waits on and the test opens. */
function gate() {
  let open;
  const opened = new Promise((resolve) => (open = resolve));
  return { open, opened };
}

forEachBackend("Progress and checkpoints", { config: CONFIG }, (ctx) => {
  const pool = workerPool(ctx);
  const startWorker = (options) => pool.start(options);
  const cleanups = [];
  afterEach(async () => {
    await pool.stopAll();
    for (const f of cleanups.splice(0)) await f();
  });
  const client = () => new BatonClient({ url: ctx.url });

  test("progress and a checkpoint show in the state within a renewal interval while SUBMITTED; the final state keeps them", async () => {
    const baton = client();
    const report = gate();
    const finish = gate();
    const seen = [];
    const { errors } = startWorker({
      queue: "report",
      handler: async (job) => {
        seen.push({ details: job.details, hasDetails: "details" in job.command, hasProgress: "progress" in job.command });
        await report.opened;
        // Coalesced: only the latest of each kind goes out with the next renewal.
        job.progress({ fraction: 0.1 });
        job.checkpoint({ step: 1 });
        job.progress({ fraction: 0.5, message: "half way: é ✓" });
        job.checkpoint({ step: 2, done: ["a.png", "b.png"], ratio: 0.25 });
        await finish.opened;
        return { ok: true };
      },
    });
    const id = uid("report");
    await baton.submit("report", "t", { n: 2 }, { id });
    await until(() => seen.length === 1, 10_000, "the handler's start");
    const before = await baton.get(id);
    assert.equal(before.status, "SUBMITTED");
    assert.ok(!("progress" in before) && !("details" in before), JSON.stringify(before)); // absent until reported
    report.open();
    await sleep(1.5 * INTERVAL_MS);
    const during = await baton.get(id);
    assert.equal(during.status, "SUBMITTED");
    assert.deepEqual(during.progress, { fraction: 0.5, message: "half way: é ✓" });
    assert.deepEqual(during.details, { step: 2, done: ["a.png", "b.png"], ratio: 0.25 });
    assert.ok(during.version > before.version);
    // Written once: later renewals carry nothing more (the state's version stays).
    await sleep(3 * INTERVAL_MS);
    assert.equal((await baton.get(id)).version, during.version);
    finish.open();
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.equal(state.status, "SUCCEEDED");
    assert.deepEqual(state.result, { ok: true });
    assert.deepEqual(state.progress, { fraction: 0.5, message: "half way: é ✓" });
    assert.deepEqual(state.details, { step: 2, done: ["a.png", "b.png"], ratio: 0.25 });
    assert.deepEqual(seen, [{ details: undefined, hasDetails: false, hasProgress: false }]);
    assert.deepEqual(errors, []);
  });

  test("a command submitted with output: the state links it, job.output is opened for the delivery and its appends end with the command", async () => {
    const baton = client();
    const seen = [];
    const { errors } = startWorker({
      queue: "report",
      handler: async (job) => {
        const o = job.output;
        seen.push({ stream: o.stream, url: o.url, content_type: o.content_type, producer_id: o.producer_id });
        for (const [seq, line] of ["one", "two"].entries()) {
          const res = await fetch(`${ctx.url}${o.url}`, {
            method: "POST",
            headers: {
              "content-type": o.content_type,
              "producer-id": o.producer_id,
              "producer-epoch": String(o.producer_epoch),
              "producer-seq": String(seq),
            },
            body: JSON.stringify({ line }),
          });
          assert.equal(res.status, 200, await res.text());
        }
        return "written";
      },
    });
    const id = uid("out");
    const { state: submitted } = await baton.submitDetailed("report", "t", null, { id, output: true });
    assert.deepEqual(
      [submitted.output.stream, submitted.output.url, submitted.output.run, submitted.output.content_type],
      [`commands/${id}`, `/v1/stream/commands/${id}`, 1, "application/json"],
    );
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.equal(state.status, "SUCCEEDED");
    assert.deepEqual(state.output, submitted.output);
    assert.deepEqual(seen, [{ stream: `commands/${id}`, url: `/v1/stream/commands/${id}`, content_type: "application/json", producer_id: "command" }]);
    const res = await fetch(`${ctx.url}/v1/stream/commands/${id}?offset=-1`);
    assert.equal(res.headers.get("stream-closed"), "true");
    assert.deepEqual(await res.json(), [{ line: "one" }, { line: "two" }]);
    // Another output for the same id is a conflict.
    await assert.rejects(baton.submit("report", "t", null, { id, output: { path: "x/y" } }), (e) => e.status === 409);
    assert.deepEqual(errors, []);
  });

  test("the last checkpoint is the next delivery's job.details: after an error (retried), a Running re-poll and a Release, each reported just before returning", async () => {
    const baton = client();
    const calls = [];
    const { errors } = startWorker({
      queue: "resume",
      handler: (job) => {
        calls.push({ call: job.call, deliveries: job.deliveries, details: job.details, commandDetails: job.command.details });
        switch (calls.length) {
          case 1:
            job.checkpoint({ step: 1 });
            throw new Error("transient");
          case 2:
            job.report({ progress: { fraction: 0.66 }, details: { step: 2 } });
            return new Running({ nextCheckMs: 100 });
          case 3:
            job.checkpoint(new RawJson('{"step": 3, "big": 18446744073709551615}'));
            return new Release();
          default:
            job.progress({ fraction: 1, message: "done" });
            return { resumed_from: job.details };
        }
      },
    });
    const id = uid("resume");
    await baton.submit("resume", "t", {}, { id });
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.equal(state.status, "SUCCEEDED", JSON.stringify(state));
    assert.deepEqual(state.result, { resumed_from: { step: 3, big: 18446744073709551615 } });
    assert.deepEqual(state.progress, { fraction: 1, message: "done" });
    assert.deepEqual(state.details, { step: 3, big: 18446744073709551615 });
    assert.equal(state.attempts, 2); // execute calls (check_status calls are not attempts)
    const raw = await (await fetch(`${ctx.url}/v1/commands/${encodeURIComponent(id)}`)).text();
    assert.ok(raw.includes('"details":{"step": 3, "big": 18446744073709551615}'), raw); // byte for byte
    assert.deepEqual(
      calls.map(({ call, details }) => ({ call, details })),
      [
        { call: "execute", details: undefined },
        { call: "execute", details: { step: 1 } },
        { call: "check_status", details: { step: 2 } },
        { call: "check_status", details: { step: 3, big: 18446744073709551615 } },
      ],
    );
    for (const c of calls) assert.deepEqual(c.commandDetails, c.details);
    assert.deepEqual(errors, []);
  });

  test("a worker killed hard (SIGKILL) after a checkpoint: the next worker's delivery resumes from it", async () => {
    const baton = client();
    const id = uid("killed");
    await baton.submit("killed", "t", { items: 4 }, { id });
    // The first worker runs in a process of its own, killed once its checkpoint shows.
    const code = `
      import { Worker } from ${JSON.stringify(DIST)};
      const worker = new Worker({
        url: ${JSON.stringify(ctx.url)}, queue: "killed", claimWaitMs: 5000, onError: () => {},
        handler: async (job) => {
          job.progress({ fraction: 0.5, message: "2 of 4" });
          job.checkpoint({ step: 2 });
          console.log("reported " + job.deliveries);
          await new Promise(() => {});
        },
      });
      await worker.run();
    `;
    const child = spawn(process.execPath, ["--input-type=module", "-e", code], { stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    child.stdout.on("data", (d) => (out += d));
    child.stderr.on("data", (d) => (out += d));
    const exited = new Promise((resolve) => child.on("exit", resolve));
    cleanups.push(async () => {
      child.kill("SIGKILL");
      await exited;
    });
    await until(async () => (await baton.get(id)).details !== undefined, 10_000, `the checkpoint (child: ${out})`);
    assert.match(out, /reported 1/);
    child.kill("SIGKILL");
    await exited;
    const killedAt = Date.now();
    const seen = [];
    startWorker({
      queue: "killed",
      handler: (job) => {
        seen.push({ deliveries: job.deliveries, details: job.details, progress: job.command.progress, at: Date.now() - killedAt });
        return { from: job.details.step };
      },
    });
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.equal(state.status, "SUCCEEDED", JSON.stringify(state));
    assert.deepEqual(state.result, { from: 2 });
    assert.equal(seen.length, 1);
    assert.deepEqual(
      { deliveries: seen[0].deliveries, details: seen[0].details, progress: seen[0].progress },
      { deliveries: 2, details: { step: 2 }, progress: { fraction: 0.5, message: "2 of 4" } },
    );
    assert.ok(seen[0].at >= 500, `redelivered ${seen[0].at} ms after the kill (claim timeout 1 s)`);
  });

  test("stop() with the grace over: the checkpoint made just before goes out before the release; the next delivery resumes from it", async () => {
    const baton = client();
    let reason;
    let checkpointed = false;
    const first = startWorker({
      queue: "stopped",
      handler: (job, signal) =>
        new Promise((_, reject) => {
          job.checkpoint({ step: "before stop" });
          checkpointed = true;
          signal.addEventListener("abort", () => {
            reason = signal.reason;
            reject(signal.reason);
          });
        }),
    });
    const id = uid("stopped");
    await baton.submit("stopped", "t", {}, { id });
    await until(() => checkpointed, 10_000, "the checkpoint");
    await first.worker.stop({ graceMs: 0 }); // at once: no renewal went out since the checkpoint
    await first.running;
    assert.equal(reason?.kind, "shutdown");
    const released = await baton.get(id);
    assert.deepEqual([released.status, released.details], ["SUBMITTED", { step: "before stop" }]);
    const seen = [];
    startWorker({
      queue: "stopped",
      handler: (job) => {
        seen.push({ deliveries: job.deliveries, details: job.details });
        return "resumed";
      },
    });
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.deepEqual([state.status, state.result], ["SUCCEEDED", "resumed"]);
    assert.deepEqual(seen, [{ deliveries: 2, details: { step: "before stop" } }]);
  });

  test("bad reports throw TypeError in the handler and send nothing; every lease stays renewed (no takeover) and good reports are written", async () => {
    const baton = client();
    const outcomes = [];
    const bad = [
      ["progress fraction 1.5", (j) => j.progress({ fraction: 1.5 }), /job\.progress: progress fraction must be a number from 0 to 1/],
      ["progress fraction -0.1", (j) => j.progress({ fraction: -0.1 }), /from 0 to 1/],
      ["progress fraction NaN", (j) => j.progress({ fraction: NaN }), /from 0 to 1/],
      ["progress fraction Infinity", (j) => j.progress({ fraction: Infinity }), /from 0 to 1/],
      ["progress fraction string", (j) => j.progress({ fraction: "0.5" }), /from 0 to 1/],
      ["progress empty", (j) => j.progress({}), /needs fraction .* and\/or message/],
      ["progress null", (j) => j.progress(null), /must be an object/],
      ["progress unknown field", (j) => j.progress({ percent: 50 }), /unknown progress field "percent"/],
      ["message 1025 bytes", (j) => j.progress({ message: "x".repeat(1025) }), /1025 bytes of UTF-8; at most 1024/],
      ["message 1026 bytes (é)", (j) => j.progress({ message: "é".repeat(513) }), /1026 bytes of UTF-8; at most 1024/],
      ["message lone surrogate", (j) => j.progress({ message: "a\ud800b" }), /lone surrogate/],
      ["message number", (j) => j.progress({ message: 5 }), /message must be a string/],
      ["checkpoint undefined", (j) => j.checkpoint(undefined), /job\.checkpoint: details are required/],
      ["checkpoint null", (j) => j.checkpoint(null), /other than null/],
      ["checkpoint BigInt", (j) => j.checkpoint({ n: 1n }), /not representable as JSON/],
      ["checkpoint cycle", (j) => { const o = {}; o.o = o; j.checkpoint(o); }, /not representable as JSON/],
      ["checkpoint function", (j) => j.checkpoint(() => 1), /not representable as JSON/],
      ["checkpoint 65537 bytes", (j) => j.checkpoint("x".repeat(65_535)), /65537 bytes of JSON; at most 65536/],
      ["checkpoint invalid RawJson", (j) => j.checkpoint(new RawJson("{bad")), /RawJson text is not valid JSON/],
      ["report empty", (j) => j.report({}), /job\.report: a report needs progress and\/or details/],
      ["report unknown field", (j) => j.report({ detail: 1 }), /unknown report field "detail"/],
      ["report with bad progress", (j) => j.report({ progress: { fraction: 2 }, details: { ok: 1 } }), /from 0 to 1/],
    ];
    const handler = async (job) => {
      outcomes.push({ id: job.id, deliveries: job.deliveries, thrown: [] });
      const mine = outcomes.at(-1);
      if (job.params.bad) {
        for (const [what, f, message] of bad) {
          try {
            f(job);
            mine.thrown.push(`${what}: did not throw`);
          } catch (err) {
            mine.thrown.push(err instanceof TypeError && message.test(err.message) ? what : `${what}: ${err}`);
          }
        }
        // The largest that fit: exactly 1024 bytes of message, 65536 of details.
        job.progress({ fraction: 0, message: "é".repeat(512) });
        job.checkpoint("x".repeat(65_534));
      } else {
        job.report({ progress: { fraction: 1 }, details: { other: true } });
      }
      await sleep(5 * 1_000); // 5x the claim timeout: a lost lease would be taken over
      return { bad: job.params.bad };
    };
    const a = startWorker({ queue: "bad", concurrency: 2, name: "bad-a", handler });
    const badId = uid("bad");
    const goodId = uid("good");
    await baton.submit("bad", "t", { bad: true }, { id: badId });
    await baton.submit("bad", "t", { bad: false }, { id: goodId });
    await until(() => outcomes.length === 2, 10_000, "both handlers' start");
    // A second worker takes over any lease that is not renewed.
    const b = startWorker({ queue: "bad", concurrency: 2, name: "bad-b", handler });
    const [badState, goodState] = await Promise.all([baton.wait(badId, { timeoutMs: 15_000 }), baton.wait(goodId, { timeoutMs: 15_000 })]);
    assert.equal(badState.status, "SUCCEEDED");
    assert.equal(goodState.status, "SUCCEEDED");
    assert.deepEqual(badState.progress, { fraction: 0, message: "é".repeat(512) });
    assert.equal(badState.details, "x".repeat(65_534));
    assert.deepEqual(goodState.progress, { fraction: 1 });
    assert.deepEqual(goodState.details, { other: true });
    const badRun = outcomes.find((o) => o.id === badId);
    assert.deepEqual(badRun.thrown, bad.map(([what]) => what));
    assert.deepEqual(
      outcomes.map((o) => o.deliveries),
      [1, 1],
    );
    assert.deepEqual([...a.errors, ...b.errors], []);
  });

  test("a report whose renewal fails in transit is kept and written by a later renewal", async () => {
    const p = await startFaultProxy(ctx.url);
    cleanups.push(() => p.close());
    let failing = false;
    p.fault = (path) => (failing && path.endsWith("/renew") ? "drop" : undefined);
    const baton = client();
    const report = gate();
    const finish = gate();
    let startedAt = 0;
    const { errors } = startWorker({
      url: p.url,
      queue: "transit",
      handler: async (job) => {
        startedAt = Date.now();
        await report.opened;
        job.progress({ fraction: 0.25, message: "kept" });
        job.checkpoint({ step: "kept" });
        await finish.opened;
        return "ok";
      },
    });
    const id = uid("transit");
    await baton.submit("transit", "t", {}, { id });
    await until(() => startedAt > 0, 10_000, "the handler's start");
    failing = true;
    report.open();
    const reportedAt = Date.now();
    // Claim timeout 2 s: a renewal every ~667 ms, every ~222 ms while they fail.
    await until(() => p.seen.filter((r) => r.fault && r.path.endsWith("/renew")).length >= 3, 5_000, "failed renewals");
    const during = await baton.get(id);
    assert.ok(!("progress" in during) && !("details" in during), JSON.stringify(during));
    failing = false;
    await until(async () => (await baton.get(id)).details !== undefined, 3_000, "the report written");
    const after = await baton.get(id);
    assert.deepEqual([after.status, after.progress, after.details], ["SUBMITTED", { fraction: 0.25, message: "kept" }, { step: "kept" }]);
    assert.ok(Date.now() - reportedAt < 4_000);
    finish.open();
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.deepEqual([state.status, state.progress, state.details], ["SUCCEEDED", { fraction: 0.25, message: "kept" }, { step: "kept" }]);
    assert.ok(errors.some((e) => /^renew: .*kept/.test(e)), errors.join("\n"));
  });

  test("a renewal refused with 400 for a report (a server that disagrees with the SDK's checks): the report is dropped, the leases renewed at once", async () => {
    // A proxy that refuses, as the server would, every renewal carrying a report of command `bad`.
    const seen = [];
    const server = createServer(async (req, res) => {
      const chunks = [];
      for await (const c of req) chunks.push(c);
      const body = Buffer.concat(chunks).toString();
      if (req.url.endsWith("/renew")) {
        const items = JSON.parse(body).leases;
        const index = items.findIndex((it) => typeof it === "object" && it.details?.refuse === true);
        seen.push(items.map((it) => (typeof it === "string" ? "lease" : Object.keys(it).sort().join("+"))).join(","));
        if (index >= 0) {
          res.writeHead(400, { "content-type": "application/json" });
          res.end(JSON.stringify({ error: "invalid_body", message: `leases[${index}]: injected by the test`, index }));
          return;
        }
      }
      const answer = await fetch(ctx.url + req.url, {
        method: req.method,
        headers: { "content-type": "application/json" },
        body: chunks.length ? body : undefined,
      });
      res.writeHead(answer.status, { "content-type": "application/json" });
      res.end(await answer.text());
    });
    await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
    cleanups.push(() => new Promise((resolve) => (server.closeAllConnections(), server.close(resolve))));
    const url = `http://127.0.0.1:${server.address().port}`;
    const baton = client();
    const calls = [];
    const handler = async (job) => {
      calls.push({ id: job.id, deliveries: job.deliveries });
      await sleep(200);
      job.report({ progress: { message: job.params.name }, details: { refuse: job.params.name === "bad" } });
      await sleep(2_500); // 2.5x the claim timeout
      return job.params.name;
    };
    const { errors } = startWorker({ url, queue: "refused", concurrency: 2, handler });
    const [badId, goodId] = [uid("refused"), uid("refused")];
    await baton.submit("refused", "t", { name: "bad" }, { id: badId });
    await baton.submit("refused", "t", { name: "good" }, { id: goodId });
    await until(() => calls.length === 2, 10_000, "both handlers' start");
    const b = startWorker({ queue: "refused", concurrency: 2, name: "refused-b", handler }); // would take over a lost lease
    const [badState, goodState] = await Promise.all([baton.wait(badId, { timeoutMs: 15_000 }), baton.wait(goodId, { timeoutMs: 15_000 })]);
    assert.deepEqual([badState.status, badState.result, badState.details], ["SUCCEEDED", "bad", undefined]);
    assert.deepEqual([goodState.status, goodState.result, goodState.details], ["SUCCEEDED", "good", { refuse: false }]);
    assert.deepEqual(goodState.progress, { message: "good" });
    assert.deepEqual(calls.map((c) => c.deliveries), [1, 1]);
    assert.equal(errors.length, 1, errors.join("\n"));
    assert.match(errors[0], /^renew: .*dropped the progress\/details report of command /);
    assert.ok(errors[0].includes(badId), errors[0]);
    assert.ok(seen.length >= 2, seen.join("\n"));
    assert.deepEqual(b.errors, []);
  });
});
