// Leases hold whatever the network or Redis does: only the server's answer ends one (a renewal
// saying `lost`/`gone`, a settlement `lease_lost`). Renewals and settlements that fail (a paused
// Redis; 503s and dropped connections, injected by a proxy between worker and server) for longer
// than the claim timeout leave the handler running (its signal not aborted) and its outcome
// settled, once. A definite answer still ends the lease: a renewal's `lost` aborts the handler,
// a settlement's `lease_lost` is told to onError and the worker goes on.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { afterEach, test } from "node:test";
import { BatonClient } from "../dist/index.js";
import { forEachBackend, sleep, startFaultProxy, uid, until, workerPool } from "./helpers.mjs";

const CONFIG = ["paused:2s", "flaky:1s", "takeover:1s", "late:1s", "stopping:1s"]
  .map((q) => {
    const [name, timeout] = q.split(":");
    return `[queues.${name}]\nclaim_timeout = "${timeout}"\n`;
  })
  .join("\n");

forEachBackend("Leases vs transport failures", { config: CONFIG }, (ctx) => {
  const pool = workerPool(ctx);
  const startWorker = (options) => pool.start(options);
  const proxies = [];
  /** A fault-injecting proxy to this backend's server (closed after the test). */
  async function proxy() {
    const p = await startFaultProxy(ctx.url);
    proxies.push(p);
    return p;
  }
  afterEach(async () => {
    await pool.stopAll();
    for (const p of proxies.splice(0)) await p.close();
  });
  const isRenewOrSettle = (path) => /\/(renew|settle)$/.test(path);

  if (ctx.backend === "redis") {
    test("Redis paused (CLIENT PAUSE ALL) for 2x the claim timeout: the handler is not aborted, runs once, SUCCEEDS after the pause", async () => {
      const PAUSE_MS = 4_000; // claim timeout 2 s
      const baton = new BatonClient({ url: ctx.url });
      const calls = [];
      let abortedWith;
      let pausedAt = 0;
      let handlerEnded = 0;
      const { errors } = startWorker({
        queue: "paused",
        name: "paused-a",
        handler: async (job, signal) => {
          calls.push({ id: job.id, deliveries: job.deliveries });
          signal.addEventListener("abort", () => (abortedWith = signal.reason));
          await until(() => pausedAt > 0, 5_000, "the pause");
          // End 3 s into the pause (1.5x the claim timeout): the settlement goes out while Redis
          // is still paused, and is retried until it gets an answer.
          await sleep(3_000);
          handlerEnded = Date.now();
          return { aborted: signal.aborted };
        },
      });
      const id = uid("paused");
      await baton.submit("paused", "t", {}, { id });
      await until(() => calls.length === 1, 10_000, "the handler's start");
      await sleep(300); // a renewal or two went through
      const port = new URL(ctx.redis.url).port;
      assert.equal(execFileSync("redis-cli", ["-p", port, "CLIENT", "PAUSE", String(PAUSE_MS), "ALL"]).toString().trim(), "OK");
      pausedAt = Date.now();
      await until(() => handlerEnded > 0, 10_000, "the handler's end");
      const state = await baton.wait(id, { timeoutMs: 15_000 });
      assert.ok(Date.now() - pausedAt >= PAUSE_MS - 100, "settled during the pause?");
      assert.equal(state.status, "SUCCEEDED", JSON.stringify(state));
      assert.deepEqual(state.result, { aborted: false });
      assert.equal(state.attempts, 1);
      assert.equal(abortedWith, undefined);
      await sleep(1_000); // a second delivery would show up by now (claim timeout 2 s after the last renewal)
      assert.deepEqual(calls, [{ id, deliveries: 1 }]);
      assert.ok(!errors.some((e) => /lease lost|giving up/.test(e)), errors.join("\n"));
    });
  }

  test("renewals and the settlement failing in transit (503, dropped connections) for 3x the claim timeout: not aborted, runs once, SUCCEEDS", async () => {
    const p = await proxy();
    let failing = false;
    let n = 0;
    p.fault = (path) => (failing && isRenewOrSettle(path) ? (n++ % 2 ? "drop" : "503") : undefined);
    const baton = new BatonClient({ url: ctx.url });
    const calls = [];
    let abortedWith;
    const { errors } = startWorker({
      url: p.url,
      queue: "flaky",
      name: "flaky-a",
      handler: async (job, signal) => {
        calls.push({ id: job.id, deliveries: job.deliveries });
        signal.addEventListener("abort", () => (abortedWith = signal.reason));
        failing = true;
        await sleep(2_500); // its settlement fails too, at first
        return { aborted: signal.aborted };
      },
    });
    const id = uid("flaky");
    await baton.submit("flaky", "t", {}, { id });
    await until(() => calls.length === 1, 10_000, "the handler's start");
    const failedSince = Date.now();
    await until(() => p.seen.some((r) => r.fault && r.path.endsWith("/settle")), 10_000, "a failed settle");
    await sleep(Math.max(0, 3_000 - (Date.now() - failedSince)));
    failing = false;
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.equal(state.status, "SUCCEEDED", JSON.stringify(state));
    assert.deepEqual(state.result, { aborted: false });
    assert.equal(state.attempts, 1);
    assert.equal(abortedWith, undefined);
    await sleep(1_200); // a second delivery would show up by now
    assert.deepEqual(calls, [{ id, deliveries: 1 }]);
    const failedRenewals = p.seen.filter((r) => r.fault && r.path.endsWith("/renew")).length;
    assert.ok(failedRenewals >= 4, `only ${failedRenewals} renewals failed`);
    assert.ok(errors.some((e) => /^renew: .*kept/.test(e)), errors.join("\n"));
    assert.ok(errors.some((e) => /^settle succeeded of command .* \(retrying in/.test(e)), errors.join("\n"));
    assert.ok(!errors.some((e) => /lease lost|giving up/.test(e)), errors.join("\n"));
  });

  test("a renewal answered lost (taken over while renewals failed) aborts the handler with lease_lost; its outcome is not settled", async () => {
    const p = await proxy();
    let failing = false;
    p.fault = (path) => (failing && path.endsWith("/renew") ? "503" : undefined);
    const baton = new BatonClient({ url: ctx.url });
    let reasonA;
    let openB;
    const gateB = new Promise((resolve) => (openB = resolve));
    let bDeliveries = 0;
    const a = startWorker({
      url: p.url,
      queue: "takeover",
      name: "takeover-a",
      handler: (job, signal) => {
        failing = true;
        return new Promise((resolve) =>
          signal.addEventListener("abort", () => {
            reasonA = signal.reason;
            resolve("a");
          }),
        );
      },
    });
    const id = uid("takeover");
    await baton.submit("takeover", "t", {}, { id });
    await until(() => failing, 10_000, "A's handler start");
    const b = startWorker({
      queue: "takeover",
      name: "takeover-b",
      claimWaitMs: 500,
      handler: async (job) => {
        bDeliveries = job.deliveries;
        await gateB;
        return "b";
      },
    });
    await until(() => bDeliveries > 0, 10_000, "B's takeover");
    assert.equal(bDeliveries, 2);
    assert.equal(reasonA, undefined); // renewals failing did not abort A
    failing = false; // A's next renewal gets the server's answer: lost
    await until(() => reasonA !== undefined, 5_000, "A's abort");
    assert.equal(reasonA.kind, "lease_lost");
    openB();
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.equal(state.status, "SUCCEEDED");
    assert.equal(state.result, "b");
    await sleep(300);
    assert.ok(!p.seen.some((r) => r.path.endsWith("/settle")), "A sent a settlement");
    assert.ok(a.errors.some((e) => /^lease: command .*: lease lost \(renewal said lost\); not settling it/.test(e)), a.errors.join("\n"));
    assert.deepEqual(b.errors, []);
  });

  test("a settlement answered lease_lost (taken over while renewals failed) is reported to onError; the worker goes on", async () => {
    const p = await proxy();
    let failing = false;
    p.fault = (path) => (failing && path.endsWith("/renew") ? "503" : undefined);
    const baton = new BatonClient({ url: ctx.url });
    let openA;
    const gateA = new Promise((resolve) => (openA = resolve));
    const callsA = [];
    const a = startWorker({
      url: p.url,
      queue: "late",
      name: "late-a",
      handler: async (job) => {
        callsA.push(job.id);
        failing = true;
        await gateA;
        return "a";
      },
    });
    const id = uid("late");
    await baton.submit("late", "t", {}, { id });
    await until(() => failing, 10_000, "A's handler start");
    const b = startWorker({ queue: "late", name: "late-b", claimWaitMs: 500, handler: () => "b" });
    const state = await baton.wait(id, { timeoutMs: 10_000 }); // B took it over and settled
    assert.equal(state.result, "b");
    await b.worker.stop();
    openA(); // A settles: the server answers lease_lost
    await until(() => a.errors.some((e) => /lease lost before its settlement/.test(e)), 5_000, "A's report");
    assert.ok(
      a.errors.some((e) =>
        /^command .*: lease lost before its settlement \(succeeded\) got through; the outcome was not written: /.test(e),
      ),
      a.errors.join("\n"),
    );
    assert.deepEqual(await baton.get(id).then((s) => [s.status, s.result]), ["SUCCEEDED", "b"]);
    // The worker goes on: the next command is A's.
    failing = false;
    const next = uid("late");
    await baton.submit("late", "t", {}, { id: next });
    const after = await baton.wait(next, { timeoutMs: 10_000 });
    assert.equal(after.status, "SUCCEEDED");
    assert.equal(after.result, "a");
    assert.deepEqual(callsA, [id, next]);
  });

  if (ctx.backend === "memory") {
    test("stop() while a settlement is retried (503 forever): given up 3 s after the grace period", async () => {
      const p = await proxy();
      p.fault = (path) => (path.endsWith("/settle") ? "503" : undefined);
      const baton = new BatonClient({ url: ctx.url });
      const { worker, running, errors } = startWorker({ url: p.url, queue: "stopping", name: "stopping-a", handler: () => "done" });
      const id = uid("stopping");
      await baton.submit("stopping", "t", {}, { id });
      await until(() => p.seen.filter((r) => r.fault).length >= 2, 10_000, "failed settles");
      assert.equal(worker.inFlight, 1); // retried, the slot held
      const t0 = Date.now();
      await worker.stop({ graceMs: 200 });
      await running;
      const took = Date.now() - t0;
      assert.ok(took >= 3_000 && took < 4_500, `stop() took ${took} ms`);
      assert.ok(errors.some((e) => /^settle succeeded of command .*: giving up/.test(e)), errors.join("\n"));
      assert.notEqual((await baton.get(id)).status, "SUCCEEDED");
    });
  }
});
