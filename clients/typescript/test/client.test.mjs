// BatonClient against a real `baton serve` (memory and Redis): submit, get, wait, cancel, errors.
import assert from "node:assert/strict";
import { test } from "node:test";
import { BatonClient, BatonError, RawJson, isTerminal } from "../dist/index.js";
import { forEachBackend, uid } from "./helpers.mjs";

const CONFIG = `
[queues.jobs]
claim_timeout = "1s"

[queues.other]
claim_timeout = "1s"
`;

/** Asserts that `promise` rejects with a BatonError of this status and code; returns it. */
async function rejectsWith(promise, status, code) {
  let error;
  try {
    await promise;
  } catch (err) {
    error = err;
  }
  assert.ok(error instanceof BatonError, `expected a BatonError, got ${error}`);
  assert.equal(error.status, status, error.message);
  assert.equal(error.code, code, error.message);
  assert.equal(typeof error.message, "string");
  assert.ok(error.message.length > 0);
  return error;
}

forEachBackend("BatonClient", { config: CONFIG }, (ctx) => {
  const client = () => new BatonClient({ url: ctx.url });

  test("submit: 202 and SUBMITTED, then the same id again is 200 with the stored state", async () => {
    const baton = client();
    const id = uid("submit");
    const first = await baton.submitDetailed("jobs", "resize", { image: "a.png", width: 640 }, { id });
    assert.equal(first.created, true);
    assert.equal(first.state.id, id);
    assert.equal(first.state.queue, "jobs");
    assert.equal(first.state.type, "resize");
    assert.deepEqual(first.state.params, { image: "a.png", width: 640 });
    assert.equal(first.state.status, "SUBMITTED");
    assert.equal(first.state.result, null);
    assert.equal(first.state.attempts, 0);

    // Same meaning, other key order: idempotent.
    const again = await baton.submitDetailed("jobs", "resize", { width: 640, image: "a.png" }, { id });
    assert.equal(again.created, false);
    assert.equal(again.state.id, id);
    assert.equal(again.state.created_at, first.state.created_at);
    assert.deepEqual(again.state.params, { image: "a.png", width: 640 });

    // submit() gives the state; without an id the server makes one.
    const generated = await baton.submit("jobs", "resize");
    assert.equal(typeof generated.id, "string");
    assert.ok(generated.id.length > 0);
    assert.notEqual(generated.id, id);
    assert.equal(generated.params, null);
  });

  test("submit with a priority: shown in the state (absent when 0); out of range is 400", async () => {
    const baton = client();
    const high = await baton.submit("jobs", "resize", { image: "p.png" }, { priority: 7 });
    assert.equal(high.priority, 7);
    const plain = await baton.submit("jobs", "resize", { image: "q.png" });
    assert.equal(plain.priority, undefined);
    const err = await rejectsWith(baton.submit("jobs", "resize", {}, { priority: 11 }), 400, "invalid_body");
    assert.equal(err.message, '"priority" must be an integer from -10 to 10; got 11');
  });

  test("submit with a concurrencyKey: sent as concurrency_key, shown in the state; a bad key is 400", async () => {
    const baton = client();
    const id = uid("ck");
    const keyed = await baton.submitDetailed("jobs", "resize", { image: "k.png" }, { id, concurrencyKey: "tenant-7" });
    assert.equal(keyed.created, true);
    assert.equal(keyed.state.concurrency_key, "tenant-7");
    assert.equal((await baton.get(id)).concurrency_key, "tenant-7");
    // 256 bytes of UTF-8 (128 two-byte characters) is the longest key.
    const longest = await baton.submit("jobs", "resize", undefined, { concurrencyKey: "é".repeat(128) });
    assert.equal(longest.concurrency_key, "é".repeat(128));
    const plain = await baton.submit("jobs", "resize", { image: "q.png" });
    assert.equal("concurrency_key" in plain, false);
    const badId = uid("ck-bad");
    for (const [key, n] of [["", 0], ["k".repeat(257), 257], ["é".repeat(129), 258]]) {
      const err = await rejectsWith(baton.submit("jobs", "resize", {}, { id: badId, concurrencyKey: key }), 400, "invalid_body");
      assert.equal(err.message, `"concurrency_key" must be 1 to 256 bytes without control characters; got ${n} bytes`);
    }
    await rejectsWith(baton.get(badId), 404, "not_found");
  });

  test("get: the stored state; params sent as RawJson come back with the same values", async () => {
    const baton = client();
    const id = uid("get");
    await baton.submit("jobs", "t", new RawJson('{"b": 1, "a": [true, null, "\\u00e9"]}'), { id });
    const state = await baton.get(id);
    assert.equal(state.id, id);
    assert.equal(state.status, "SUBMITTED");
    assert.deepEqual(state.params, { b: 1, a: [true, null, "é"] });
    assert.deepEqual(Object.keys(state.params), ["b", "a"]);
    await rejectsWith(baton.get(uid("missing")), 404, "not_found");
  });

  test("wait: returns the terminal state as soon as it is terminal", async () => {
    const baton = client();
    const id = uid("wait");
    await baton.submit("jobs", "t", {}, { id });
    const started = Date.now();
    setTimeout(() => baton.cancel(id), 300);
    const state = await baton.wait(id, { timeoutMs: 20_000 });
    const took = Date.now() - started;
    assert.equal(state.status, "CANCELLED");
    assert.ok(isTerminal(state));
    assert.ok(took >= 250 && took < 5_000, `took ${took} ms`);
  });

  test("wait: after timeoutMs, the latest non-terminal state; long-polls in chunks", async () => {
    const baton = new BatonClient({ url: ctx.url, maxWaitChunkMs: 300 });
    const id = uid("wait-timeout");
    await baton.submit("jobs", "t", {}, { id });
    const started = Date.now();
    const state = await baton.wait(id, { timeoutMs: 1_000 });
    const took = Date.now() - started;
    assert.equal(state.status, "SUBMITTED");
    assert.equal(isTerminal(state), false);
    assert.ok(took >= 950 && took < 3_000, `took ${took} ms`);

    // Terminal while a later chunk waits.
    setTimeout(() => baton.cancel(id), 700);
    const t0 = Date.now();
    const done = await baton.wait(id, { timeoutMs: 10_000 });
    assert.equal(done.status, "CANCELLED");
    assert.ok(Date.now() - t0 < 3_000);
  });

  test("wait: an aborted signal rejects with its reason", async () => {
    const baton = client();
    const id = uid("wait-abort");
    await baton.submit("jobs", "t", {}, { id });
    const reason = new Error("enough");
    const signal = AbortSignal.timeout(200);
    const controller = new AbortController();
    signal.addEventListener("abort", () => controller.abort(reason));
    await assert.rejects(baton.wait(id, { timeoutMs: 10_000, signal: controller.signal }), (err) => err === reason);
  });

  test("cancel: CANCELLED; again is 409 already_terminal with the unchanged state", async () => {
    const baton = client();
    const id = uid("cancel");
    await baton.submit("jobs", "t", { x: 1 }, { id });
    const cancelled = await baton.cancel(id);
    assert.equal(cancelled.id, id);
    assert.equal(cancelled.status, "CANCELLED");
    assert.notEqual(cancelled.completed_at, null);
    const again = await rejectsWith(baton.cancel(id), 409, "already_terminal");
    assert.equal(again.state?.id, id);
    assert.equal(again.state?.status, "CANCELLED");
    assert.equal(again.state?.version, cancelled.version);
    await rejectsWith(baton.cancel(uid("missing")), 404, "not_found");
  });

  test("errors: unknown queue is 404 unknown_queue; same id, other params or queue is 409 conflict", async () => {
    const baton = client();
    const err = await rejectsWith(baton.submit("no-such-queue", "t", {}), 404, "unknown_queue");
    assert.match(err.message, /jobs/); // lists the queues
    const id = uid("conflict");
    await baton.submit("jobs", "t", { n: 1 }, { id });
    await rejectsWith(baton.submit("jobs", "t", { n: 2 }, { id }), 409, "conflict");
    await rejectsWith(baton.submit("jobs", "other-type", { n: 1 }, { id }), 409, "conflict");
    await rejectsWith(baton.submit("other", "t", { n: 1 }, { id }), 409, "conflict");
    // Integer 1 and 1.0 are different params.
    await rejectsWith(baton.submit("jobs", "t", new RawJson('{"n": 1.0}'), { id }), 409, "conflict");
    await rejectsWith(baton.submit("jobs", "t", {}, { id: "" }), 400, "invalid_id");
  });

  test("errors: no server is a BatonError with status 0 (network_error)", async () => {
    const baton = new BatonClient({ url: "http://127.0.0.1:9" });
    const err = await rejectsWith(baton.get("x"), 0, "network_error");
    assert.equal(err.transient, true);
  });
});
