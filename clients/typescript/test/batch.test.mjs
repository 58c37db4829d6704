// BatonClient.submitMany against a real `baton serve` (memory and Redis): per-item outcomes in
// order, splitting over 1000 items, whole-request errors, and the created commands run by a worker.
import assert from "node:assert/strict";
import { afterEach, test } from "node:test";
import { BatonClient, BatonError, MAX_BATCH } from "../dist/index.js";
import { forEachBackend, uid, workerPool } from "./helpers.mjs";

// Queue "batch" has the built-in echo handler configured: the server knows its types and answers
// an item of another type 400 unknown_type. The server runs with --no-workers, so the SDK's Worker
// runs the commands.
const CONFIG = `
[queues.jobs]
claim_timeout = "1s"

[queues.batch]
claim_timeout = "1s"

[queues.batch.handlers]
echo = "echo"
`;

/** Runs `fn` with the global fetch counting the commands of each batch request; returns the counts. */
async function countingBatches(fn) {
  const sizes = [];
  const original = globalThis.fetch;
  globalThis.fetch = (url, init) => {
    if (String(url).endsWith("/commands/batch")) sizes.push(JSON.parse(init.body).commands.length);
    return original(url, init);
  };
  try {
    await fn();
  } finally {
    globalThis.fetch = original;
  }
  return sizes;
}

forEachBackend("BatonClient.submitMany", { config: CONFIG }, (ctx) => {
  const pool = workerPool(ctx);
  afterEach(() => pool.stopAll());
  const client = () => new BatonClient({ url: ctx.url });

  test("a mixed batch: one outcome per item in order, errors returned in place; the new ones run", async () => {
    const baton = client();
    const [a, b, pre] = [uid("b-a"), uid("b-b"), uid("b-pre")];
    const unknownId = uid("b-unknown");
    const badId = uid("b-bad");
    const before = await baton.submitDetailed("batch", "echo", { n: "pre" }, { id: pre });
    assert.equal(before.created, true);

    const out = await baton.submitMany("batch", [
      { type: "echo", params: { n: 0 }, id: a }, // new
      { type: "echo", params: { n: 1 } }, // new, the server makes the id
      { type: "echo", params: { n: 0 }, id: a }, // the same id and body again: 200
      { type: "echo", params: { n: 99 }, id: a }, // the same id, other params: 409
      { type: "resize", params: { n: 4 }, id: unknownId }, // no such type on this queue: 400
      { type: "echo", params: { n: 5 }, id: b, priority: 3 }, // new
      { type: "echo", params: { n: "pre" }, id: pre }, // stored before: 200
      { type: "echo", id: badId, priority: 11 }, // out of range: 400
    ]);
    assert.equal(out.length, 8);

    assert.ok(!(out[0] instanceof BatonError), String(out[0]));
    assert.equal(out[0].created, true);
    assert.equal(out[0].state.id, a);
    assert.equal(out[0].state.queue, "batch");
    assert.equal(out[0].state.type, "echo");
    assert.deepEqual(out[0].state.params, { n: 0 });
    assert.equal(out[0].state.status, "SUBMITTED");
    assert.equal(out[0].state.version, 1);

    assert.ok(!(out[1] instanceof BatonError), String(out[1]));
    assert.equal(out[1].created, true);
    assert.deepEqual(out[1].state.params, { n: 1 });
    const anon = out[1].state.id;
    assert.ok(typeof anon === "string" && anon.length > 0 && ![a, b, pre, unknownId, badId].includes(anon), anon);

    assert.ok(!(out[2] instanceof BatonError), String(out[2]));
    assert.equal(out[2].created, false);
    assert.equal(out[2].state.id, a);
    assert.equal(out[2].state.created_at, out[0].state.created_at);

    assert.ok(out[3] instanceof BatonError, `expected a BatonError, got ${JSON.stringify(out[3])}`);
    assert.equal(out[3].status, 409);
    assert.equal(out[3].code, "conflict");
    assert.ok(out[3].message.includes(a), out[3].message);
    assert.equal(out[3].body.error, "conflict");

    assert.ok(out[4] instanceof BatonError, `expected a BatonError, got ${JSON.stringify(out[4])}`);
    assert.equal(out[4].status, 400);
    assert.equal(out[4].code, "unknown_type");
    assert.ok(out[4].message.includes("echo"), out[4].message); // it names the queue's types

    assert.ok(!(out[5] instanceof BatonError), String(out[5]));
    assert.equal(out[5].created, true);
    assert.equal(out[5].state.id, b);
    assert.equal(out[5].state.priority, 3);

    assert.ok(!(out[6] instanceof BatonError), String(out[6]));
    assert.equal(out[6].created, false);
    assert.equal(out[6].state.id, pre);
    assert.equal(out[6].state.created_at, before.state.created_at);

    assert.ok(out[7] instanceof BatonError, `expected a BatonError, got ${JSON.stringify(out[7])}`);
    assert.equal(out[7].status, 400);
    assert.equal(out[7].code, "invalid_body");
    assert.equal(out[7].message, '"priority" must be an integer from -10 to 10; got 11');

    // The refused items stored nothing; the stored id kept its first params.
    for (const refused of [unknownId, badId]) {
      await assert.rejects(baton.get(refused), (err) => err instanceof BatonError && err.code === "not_found");
    }
    assert.deepEqual((await baton.get(a)).params, { n: 0 });

    const { errors } = pool.start({ queue: "batch", handler: { echo: (job) => ({ echo: job.params }) } });
    const created = [
      [pre, { n: "pre" }],
      [a, { n: 0 }],
      [anon, { n: 1 }],
      [b, { n: 5 }],
    ];
    for (const [id, params] of created) {
      const done = await baton.wait(id, { timeoutMs: 15_000 });
      assert.equal(done.status, "SUCCEEDED", `${id}: ${done.status} ${done.error}`);
      assert.deepEqual(done.result, { echo: params });
      assert.equal(done.attempts, 1);
    }
    assert.deepEqual(errors, []);
  });

  test("1500 items: two requests (1000 + 500), all 202 in order; again all 200; an error keeps its place", async () => {
    const baton = client();
    const prefix = uid("split");
    const items = Array.from({ length: 1500 }, (_, i) => ({ type: "t", params: { i }, id: `${prefix}-${i}` }));
    let out;
    const sizes = await countingBatches(async () => {
      out = await baton.submitMany("jobs", items);
    });
    assert.equal(MAX_BATCH, 1000);
    assert.deepEqual(sizes, [1000, 500]);
    assert.equal(out.length, 1500);
    out.forEach((o, i) => {
      assert.ok(!(o instanceof BatonError), `${i}: ${o}`);
      assert.equal(o.created, true, String(i));
      assert.equal(o.state.id, `${prefix}-${i}`);
      assert.deepEqual(o.state.params, { i });
    });

    const again = await baton.submitMany("jobs", items);
    again.forEach((o, i) => {
      assert.ok(!(o instanceof BatonError), `${i}: ${o}`);
      assert.equal(o.created, false, String(i));
      assert.equal(o.state.id, `${prefix}-${i}`);
      assert.equal(o.state.created_at, out[i].state.created_at);
    });

    items[1200] = { type: "t", params: { i: "other" }, id: `${prefix}-1200` };
    const mixed = await baton.submitMany("jobs", items);
    assert.deepEqual(
      mixed.flatMap((o, i) => (o instanceof BatonError ? [[i, o.status, o.code]] : [])),
      [[1200, 409, "conflict"]],
    );
  });

  test("items with a concurrencyKey: stored and shown; an empty or 257-byte key is 400 in place", async () => {
    const baton = client();
    const [k1, k2, k3, k4, k5] = ["bk-1", "bk-2", "bk-3", "bk-4", "bk-5"].map((p) => uid(p));
    const out = await baton.submitMany("jobs", [
      { type: "t", id: k1, concurrencyKey: "tenant-a" },
      { type: "t", id: k2, concurrencyKey: "" }, // 400 in place
      { type: "t", id: k3 },
      { type: "t", id: k4, concurrencyKey: "k".repeat(257) }, // 400 in place
      { type: "t", id: k5, concurrencyKey: "tenant-a", priority: 2 },
    ]);
    assert.equal(out.length, 5);
    for (const i of [0, 2, 4]) assert.ok(!(out[i] instanceof BatonError), `${i}: ${out[i]}`);
    assert.deepEqual([out[0].created, out[0].state.id, out[0].state.concurrency_key], [true, k1, "tenant-a"]);
    assert.equal(out[2].state.id, k3);
    assert.equal("concurrency_key" in out[2].state, false);
    assert.deepEqual([out[4].state.id, out[4].state.concurrency_key, out[4].state.priority], [k5, "tenant-a", 2]);
    for (const [i, n] of [[1, 0], [3, 257]]) {
      assert.ok(out[i] instanceof BatonError, `${i}: ${JSON.stringify(out[i])}`);
      assert.deepEqual([out[i].status, out[i].code], [400, "invalid_body"]);
      assert.equal(out[i].message, `"concurrency_key" must be 1 to 256 bytes without control characters; got ${n} bytes`);
    }
    assert.equal((await baton.get(k5)).concurrency_key, "tenant-a");
    for (const id of [k2, k4]) {
      await assert.rejects(baton.get(id), (e) => e instanceof BatonError && e.code === "not_found");
    }
  });

  test("an empty list answers [] without a request; a refused item throws before any request", async () => {
    const baton = client();
    const sizes = await countingBatches(async () => {
      assert.deepEqual(await baton.submitMany("jobs", []), []);
      await assert.rejects(baton.submitMany("jobs", [{ type: "t" }, { type: "t", prams: {} }]), {
        name: "TypeError",
        message:
          "submitMany: items[1] has unknown key(s) prams; an item has only type, params, id, output, runAt, delay, concurrencyKey, priority",
      });
      await assert.rejects(baton.submitMany("jobs", [{ type: "t", runAt: new Date(), delay: 5 }]), {
        name: "TypeError",
        message: "submitMany: items[0]: give runAt or delay, not both",
      });
      await assert.rejects(baton.submitMany("jobs", [{ type: "t" }, { type: "t" }, { params: 1 }]), {
        name: "TypeError",
        message: "submitMany: items[2] needs a string type, got undefined",
      });
    });
    assert.deepEqual(sizes, []);
  });

  test("whole-request errors throw: unknown queue is 404 unknown_queue and stores nothing", async () => {
    const baton = client();
    const id = uid("b-nq");
    const err = await baton.submitMany("nope", [{ type: "t", id }]).then(
      () => assert.fail("submitMany to an unknown queue resolved"),
      (e) => e,
    );
    assert.ok(err instanceof BatonError, String(err));
    assert.equal(err.status, 404);
    assert.equal(err.code, "unknown_queue");
    assert.ok(err.message.includes("jobs"), err.message);
    await assert.rejects(baton.get(id), (e) => e instanceof BatonError && e.code === "not_found");
  });
});
