// Worker against a real `baton serve` (memory and Redis): outcomes, cancellation, concurrency,
// graceful shutdown. Every queue has claim_timeout 1s, so leases are renewed every ~333 ms.
import assert from "node:assert/strict";
import { afterEach, test } from "node:test";
import { BatonClient, Failed, HandOff, RawJson, Release, Running } from "../dist/index.js";
import { forEachBackend, sleep, uid, until, workerPool } from "./helpers.mjs";

const queues = [
  "result",
  "failed",
  "retry",
  "retry-out",
  "running",
  "handoff-a",
  "handoff-b",
  "types",
  "cancel",
  "concurrency",
  "graceful",
  "release",
  "give-back",
  "handoff-bad",
];
const CONFIG = queues
  .map(
    (q) => `[queues.${q}]
claim_timeout = "1s"
check_status_interval = "5s"
retry = { max_attempts = 3, initial_backoff = "50ms", backoff_factor = 1.0, max_backoff = "50ms" }
`,
  )
  .join("\n")
  .concat(`
[queues.keyed]
claim_timeout = "2s"
check_status_interval = "200ms"
concurrency_per_key = 1
`);

/** Raw GET of a command: the exact text of the answer. */
async function rawState(url, id) {
  const res = await fetch(`${url}/v1/commands/${encodeURIComponent(id)}`);
  assert.equal(res.status, 200);
  return res.text();
}

forEachBackend("Worker", { config: CONFIG }, (ctx) => {
  const pool = workerPool(ctx);
  /** Starts a worker (stopped after the test unless the test stopped it). */
  const startWorker = (options) => pool.start(options);
  afterEach(() => pool.stopAll());
  const client = () => new BatonClient({ url: ctx.url });

  test("a returned value is stored as the result, exactly", async () => {
    const baton = client();
    const calls = [];
    startWorker({
      queue: "result",
      handler: (job) => {
        calls.push({ id: job.id, call: job.call, deliveries: job.deliveries, type: job.type });
        if (job.type === "raw") return new RawJson('{"big": 18446744073709551615, "z": 1, "a": 0.10}');
        return { echo: job.params, n: 1.5, s: "é", list: [1, null, true] };
      },
    });
    const id = uid("result");
    await baton.submit("result", "plain", { image: "a.png" }, { id });
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.equal(state.status, "SUCCEEDED");
    assert.deepEqual(state.result, { echo: { image: "a.png" }, n: 1.5, s: "é", list: [1, null, true] });
    assert.equal(state.attempts, 1);
    assert.equal(state.error, null);

    const rawId = uid("raw");
    await baton.submit("result", "raw", null, { id: rawId });
    assert.equal((await baton.wait(rawId, { timeoutMs: 10_000 })).status, "SUCCEEDED");
    const text = await rawState(ctx.url, rawId);
    assert.ok(text.includes('"result":{"big": 18446744073709551615, "z": 1, "a": 0.10}'), text);
    assert.deepEqual(calls, [
      { id, call: "execute", deliveries: 1, type: "plain" },
      { id: rawId, call: "execute", deliveries: 1, type: "raw" },
    ]);
  });

  test("throwing Failed makes the command FAILED with the message, not retried", async () => {
    const baton = client();
    let calls = 0;
    startWorker({
      queue: "failed",
      handler: () => {
        calls++;
        throw new Failed("the image is too large: 9000 x 9000");
      },
    });
    const id = uid("failed");
    await baton.submit("failed", "resize", {}, { id });
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.equal(state.status, "FAILED");
    assert.equal(state.error, "the image is too large: 9000 x 9000");
    assert.equal(state.attempts, 1);
    await sleep(300);
    assert.equal(calls, 1);
  });

  test("another thrown error is retried by the server (attempts counted)", async () => {
    const baton = client();
    const calls = [];
    startWorker({
      queue: "retry",
      handler: (job) => {
        calls.push(job.call);
        if (calls.length < 3) throw new Error(`transient ${calls.length}`);
        return { ok: calls.length };
      },
    });
    const id = uid("retry");
    await baton.submit("retry", "flaky", {}, { id });
    const state = await baton.wait(id, { timeoutMs: 15_000 });
    assert.equal(state.status, "SUCCEEDED");
    assert.deepEqual(state.result, { ok: 3 });
    assert.equal(state.attempts, 3);
    assert.equal(state.errors_count, 0);
    assert.deepEqual(calls, ["execute", "execute", "execute"]);
  });

  test("an error every time ends FAILED after retry.max_attempts with the last message", async () => {
    const baton = client();
    let calls = 0;
    startWorker({
      queue: "retry-out",
      handler: () => {
        calls++;
        throw new TypeError(`broken ${calls}`);
      },
    });
    const id = uid("retry-out");
    await baton.submit("retry-out", "broken", {}, { id });
    const state = await baton.wait(id, { timeoutMs: 15_000 });
    assert.equal(state.status, "FAILED");
    assert.equal(state.attempts, 3);
    assert.equal(calls, 3);
    assert.match(state.error, /TypeError: broken 3/);
  });

  test("Running, then check_status calls until one returns a result", async () => {
    const baton = client();
    const calls = [];
    const statuses = [];
    startWorker({
      queue: "running",
      handler: async (job) => {
        calls.push(job.call);
        statuses.push(job.command.status);
        if (calls.length < 3) return new Running({ nextCheckMs: 200 });
        return { finished_after: calls.length };
      },
    });
    const id = uid("running");
    await baton.submit("running", "long", { n: 1 }, { id });
    await until(async () => (await baton.get(id)).status === "RUNNING", 5_000, "RUNNING");
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.equal(state.status, "SUCCEEDED");
    assert.deepEqual(state.result, { finished_after: 3 });
    assert.deepEqual(calls, ["execute", "check_status", "check_status"]);
    assert.deepEqual(statuses, ["SUBMITTED", "RUNNING", "RUNNING"]);
  });

  test("HandOff: the second queue's worker gets check_status and finishes it", async () => {
    const baton = client();
    const seenA = [];
    const seenB = [];
    startWorker({
      queue: "handoff-a",
      handler: (job) => {
        seenA.push(job.call);
        return new HandOff("handoff-b");
      },
    });
    startWorker({
      queue: "handoff-b",
      handler: (job) => {
        seenB.push({ call: job.call, queue: job.queue, params: job.params });
        return { finished_by: "b" };
      },
    });
    const id = uid("handoff");
    await baton.submit("handoff-a", "move", { x: 1 }, { id });
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.equal(state.status, "SUCCEEDED");
    assert.deepEqual(state.result, { finished_by: "b" });
    assert.equal(state.handed_off_to, "handoff-b");
    assert.deepEqual(seenA, ["execute"]);
    assert.deepEqual(seenB, [{ call: "check_status", queue: "handoff-b", params: { x: 1 } }]);
  });

  test("Release hands the command back unrun: the next delivery runs it (deliveries 2, attempts 1)", async () => {
    const baton = client();
    const seen = [];
    startWorker({
      queue: "give-back",
      handler: (job) => {
        seen.push(job.deliveries);
        return job.deliveries === 1 ? new Release() : { second: true };
      },
    });
    const id = uid("give-back");
    await baton.submit("give-back", "t", {}, { id });
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.equal(state.status, "SUCCEEDED");
    assert.deepEqual(state.result, { second: true });
    assert.equal(state.attempts, 1);
    assert.deepEqual(seen, [1, 2]);
  });

  for (const [what, target] of [
    ["a queue the server does not have", "no-such-queue"],
    ["the command's own queue", "handoff-bad"],
  ]) {
    test(`HandOff to ${what}: the server refuses it, the worker settles FAILED naming the queue`, async () => {
      const baton = client();
      let calls = 0;
      const { errors } = startWorker({
        queue: "handoff-bad",
        handler: () => {
          calls++;
          return new HandOff(target);
        },
      });
      const id = uid("handoff-bad");
      await baton.submit("handoff-bad", "t", {}, { id });
      const state = await baton.wait(id, { timeoutMs: 10_000 });
      assert.equal(state.status, "FAILED");
      assert.equal(state.attempts, 1);
      assert.equal(state.handed_off_to, null);
      assert.ok(
        state.error.startsWith(`the handler handed the command off to queue "${target}", which the server refused: `),
        state.error,
      );
      await sleep(1_500); // no redelivery after the claim timeout
      assert.equal(calls, 1);
      assert.equal(errors.length, 1, errors.join("\n"));
      assert.ok(errors[0].includes(`refused the hand-off to queue "${target}"`), errors[0]);
    });
  }

  test("a map of handlers: a type without one is FAILED, naming the types handled", async () => {
    const baton = client();
    startWorker({ queue: "types", handler: { add: (job) => job.params.a + job.params.b, noop: () => undefined } });
    const [add, noop, other] = [uid("add"), uid("noop"), uid("other")];
    await baton.submit("types", "add", { a: 2, b: 3 }, { id: add });
    await baton.submit("types", "noop", null, { id: noop });
    await baton.submit("types", "zzz", {}, { id: other });
    assert.deepEqual((await baton.wait(add, { timeoutMs: 10_000 })).result, 5);
    const n = await baton.wait(noop, { timeoutMs: 10_000 });
    assert.equal(n.status, "SUCCEEDED");
    assert.equal(n.result, null);
    const o = await baton.wait(other, { timeoutMs: 10_000 });
    assert.equal(o.status, "FAILED");
    assert.match(o.error, /no handler for command type "zzz" .*\(it handles: add, noop\)/);
  });

  test("cancel: the handler's signal aborts within about a renewal interval; CANCELLED", async () => {
    const baton = client();
    let startedAt = 0;
    let abortedAt = 0;
    let reason;
    let calls = 0;
    const { errors } = startWorker({
      queue: "cancel",
      handler: (job, signal) => {
        calls++;
        startedAt = Date.now();
        return new Promise((resolve) => {
          signal.addEventListener("abort", () => {
            abortedAt = Date.now();
            reason = signal.reason;
            resolve({ stopped: true }); // ignored: a cancelled command settles `cancelled`
          });
        });
      },
    });
    const id = uid("cancel");
    await baton.submit("cancel", "long", {}, { id });
    await until(() => startedAt > 0, 5_000, "handler start");
    await sleep(100);
    const cancelledAt = Date.now();
    const cancelled = await baton.cancel(id);
    assert.equal(cancelled.status, "CANCELLED");
    await until(() => abortedAt > 0, 3_000, "abort");
    const delay = abortedAt - cancelledAt;
    assert.ok(delay <= 1_000, `aborted ${delay} ms after the cancel (renewal interval 333 ms)`);
    assert.equal(reason.kind, "cancelled");
    assert.equal(reason.name, "AbortError");
    await sleep(500);
    const state = await baton.get(id);
    assert.equal(state.status, "CANCELLED");
    assert.equal(state.result, null);
    assert.equal(calls, 1);
    assert.deepEqual(errors, []);
  });

  test("concurrency k: at most k handlers at once, every command once", async () => {
    const baton = client();
    const k = 3;
    const n = 12;
    let current = 0;
    let max = 0;
    const counts = new Map();
    startWorker({
      queue: "concurrency",
      concurrency: k,
      handler: async (job) => {
        counts.set(job.id, (counts.get(job.id) ?? 0) + 1);
        current++;
        max = Math.max(max, current);
        await sleep(150);
        current--;
        return { i: job.params.i };
      },
    });
    const ids = [];
    for (let i = 0; i < n; i++) {
      const id = uid("conc");
      ids.push(id);
      await baton.submit("concurrency", "work", { i }, { id });
    }
    const states = await Promise.all(ids.map((id) => baton.wait(id, { timeoutMs: 20_000 })));
    states.forEach((s, i) => {
      assert.equal(s.status, "SUCCEEDED");
      assert.deepEqual(s.result, { i });
    });
    assert.equal(max, k);
    assert.equal(counts.size, n);
    for (const id of ids) assert.equal(counts.get(id), 1, id);
  });

  test("concurrency_per_key = 1: one key's commands do not overlap, another key's runs beside them", async () => {
    const baton = client();
    const spans = new Map();
    startWorker({
      queue: "keyed",
      concurrency: 3,
      handler: async (job) => {
        const span = [performance.now()];
        spans.set(job.id, span);
        await sleep(600);
        span.push(performance.now());
        return job.id;
      },
    });
    const [keyA, keyB] = [uid("tenant-a"), uid("tenant-b")];
    const [a1, a2, b1] = [uid("ka-1"), uid("ka-2"), uid("kb-1")];
    for (const [id, key] of [[a1, keyA], [a2, keyA], [b1, keyB]]) {
      const state = await baton.submit("keyed", "t", undefined, { id, concurrencyKey: key });
      assert.equal(state.concurrency_key, key);
    }
    const states = [];
    for (const id of [a1, a2, b1]) states.push(await baton.wait(id, { timeoutMs: 20_000 }));
    assert.deepEqual(
      states.map((s) => [s.id, s.status, s.concurrency_key]),
      [[a1, "SUCCEEDED", keyA], [a2, "SUCCEEDED", keyA], [b1, "SUCCEEDED", keyB]],
    );
    const [[a1Start, a1End], [a2Start], [b1Start]] = [spans.get(a1), spans.get(a2), spans.get(b1)];
    assert.ok(a2Start >= a1End, `${a2} started ${(a1End - a2Start).toFixed(0)} ms before ${a1} ended`);
    assert.ok(b1Start < a1End, `${b1} waited for ${keyA}: ${JSON.stringify([...spans])}`);
  });

  test("stop(): claims no more, lets the running handler finish, run() resolves", async () => {
    const baton = client();
    let aborted = false;
    let finished = false;
    const entry = startWorker({
      queue: "graceful",
      handler: async (job, signal) => {
        signal.addEventListener("abort", () => (aborted = true));
        await sleep(800);
        finished = true;
        return { done: job.id };
      },
    });
    const id = uid("graceful");
    await baton.submit("graceful", "slow", {}, { id });
    await until(() => entry.worker.inFlight === 1, 5_000, "handler start");
    const t0 = Date.now();
    const stopped = entry.worker.stop({ graceMs: 5_000 });
    const later = uid("later");
    await baton.submit("graceful", "slow", {}, { id: later });
    await stopped;
    await entry.running;
    assert.equal(finished, true);
    assert.equal(aborted, false);
    assert.ok(Date.now() - t0 < 3_000);
    const state = await baton.get(id);
    assert.equal(state.status, "SUCCEEDED");
    assert.deepEqual(state.result, { done: id });
    await sleep(300);
    assert.equal((await baton.get(later)).status, "SUBMITTED"); // not claimed after stop()
  });

  test("stop() with a short grace aborts and releases; another worker gets it after the claim timeout", async () => {
    const baton = client();
    let reason;
    const first = startWorker({
      queue: "release",
      handler: (job, signal) =>
        new Promise((_, reject) =>
          signal.addEventListener("abort", () => {
            reason = signal.reason;
            reject(signal.reason);
          }),
        ),
    });
    const id = uid("release");
    await baton.submit("release", "slow", { v: 1 }, { id });
    await until(() => first.worker.inFlight === 1, 5_000, "handler start");
    await first.worker.stop({ graceMs: 200 });
    await first.running;
    const releasedAt = Date.now();
    assert.equal(reason?.kind, "shutdown");
    const after = await baton.get(id);
    assert.equal(after.status, "SUBMITTED");
    assert.equal(after.attempts, 0);

    const seen = [];
    startWorker({
      queue: "release",
      handler: (job) => {
        seen.push({ deliveries: job.deliveries, call: job.call, at: Date.now() - releasedAt });
        return { by: "second" };
      },
    });
    const state = await baton.wait(id, { timeoutMs: 10_000 });
    assert.equal(state.status, "SUCCEEDED");
    assert.deepEqual(state.result, { by: "second" });
    assert.equal(seen.length, 1);
    assert.equal(seen[0].deliveries, 2);
    assert.equal(seen[0].call, "execute");
    assert.ok(seen[0].at >= 500, `picked up ${seen[0].at} ms after the release (claim timeout 1 s)`);
  });
});
