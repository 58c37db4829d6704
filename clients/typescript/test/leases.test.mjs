// Leases hold whatever the handler does: they are renewed from the worker's lease thread, so a
// handler that blocks the main thread (a busy loop, Atomics.wait) for 5x the claim timeout keeps
// its lease and runs exactly once. A second Worker in the same process competes for the queue:
// its lease thread would claim the command if the lease were lost (it is not blocked either).
// (Renewals and settlements failing in transit: transport.test.mjs.)
import assert from "node:assert/strict";
import { afterEach, test } from "node:test";
import { BatonClient } from "../dist/index.js";
import { forEachBackend, uid, workerPool } from "./helpers.mjs";

const CONFIG = `
[queues.busy]
claim_timeout = "1s"

[queues.atomics]
claim_timeout = "1s"
`;
const BLOCK_MS = 5_000; // 5x the claim timeout

forEachBackend("Leases", { config: CONFIG }, (ctx) => {
  const pool = workerPool(ctx);
  const startWorker = (options) => pool.start(options);
  afterEach(async () => {
    await pool.stopAll();
  });

  for (const [queue, block] of [
    [
      "busy",
      () => {
        const end = Date.now() + BLOCK_MS;
        let spins = 0;
        while (Date.now() < end) spins++;
        return spins;
      },
    ],
    [
      "atomics",
      () => {
        Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, BLOCK_MS);
        return 1;
      },
    ],
  ]) {
    test(`a handler blocking the main thread for 5x the claim timeout (${queue}) runs once and SUCCEEDS`, async () => {
      const baton = new BatonClient({ url: ctx.url });
      const calls = [];
      const handler = (name) => (job) => {
        calls.push({ worker: name, id: job.id, deliveries: job.deliveries });
        const t0 = Date.now();
        block();
        return { blocked_ms: Date.now() - t0 >= BLOCK_MS, by: name };
      };
      const a = startWorker({ queue, handler: handler("a"), name: `a-${queue}` });
      const b = startWorker({ queue, handler: handler("b"), name: `b-${queue}` });
      const id = uid(queue);
      await baton.submit(queue, "block", {}, { id });
      const state = await baton.wait(id, { timeoutMs: 20_000 });
      assert.equal(state.status, "SUCCEEDED");
      assert.equal(state.result.blocked_ms, true);
      assert.equal(state.attempts, 1);
      // Give a stolen delivery time to show up.
      await new Promise((r) => setTimeout(r, 1_500));
      assert.equal(calls.length, 1, JSON.stringify(calls));
      assert.equal(calls[0].deliveries, 1);
      assert.equal(calls[0].id, id);
      assert.equal(state.result.by, calls[0].worker);
      assert.deepEqual([...a.errors, ...b.errors], []);
    });
  }
});
