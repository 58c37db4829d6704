// A TypeScript worker and the Rust in-process worker of `baton serve` (run WITHOUT --no-workers)
// share one queue whose type `echo` has the built-in `echo` handler (it returns the params). The
// TS worker handles `echo` too but returns {"by": "ts", ...params}, so results tell who ran each
// command. Every command must SUCCEED exactly once.
import assert from "node:assert/strict";
import { test } from "node:test";
import { BatonClient, Worker } from "../dist/index.js";
import { collectErrors, forEachBackend, uid } from "./helpers.mjs";

const CONFIG = `
[queues.shared]
claim_timeout = "1s"
concurrency = 4

[queues.shared.handlers]
echo = "echo"
`;
const N = 200;

forEachBackend("Shared queue: TS worker + Rust in-process worker", { config: CONFIG, workers: true }, (ctx) => {
  test(`${N} echo commands: each SUCCEEDED exactly once, both workers ran some`, async () => {
    const baton = new BatonClient({ url: ctx.url });
    const calls = new Map();
    const deliveries = [];
    const { errors, onError } = collectErrors();
    const worker = new Worker({
      url: ctx.url,
      queue: "shared",
      concurrency: 4,
      claimWaitMs: 5_000,
      onError,
      handler: {
        echo: async (job) => {
          calls.set(job.id, (calls.get(job.id) ?? 0) + 1);
          deliveries.push(job.deliveries);
          await new Promise((r) => setTimeout(r, 2));
          return { by: "ts", ...job.params };
        },
      },
    });
    const running = worker.run();
    try {
      const ids = Array.from({ length: N }, (_, i) => uid(`shared-${i}`));
      for (let i = 0; i < N; i += 20) {
        await Promise.all(ids.slice(i, i + 20).map((id, j) => baton.submit("shared", "echo", { n: i + j }, { id })));
      }
      const states = await Promise.all(ids.map((id) => baton.wait(id, { timeoutMs: 30_000 })));
      let ts = 0;
      let rust = 0;
      states.forEach((state, n) => {
        assert.equal(state.status, "SUCCEEDED", `${state.id}: ${state.status} ${state.error}`);
        assert.equal(state.attempts, 1, state.id);
        if (state.result.by === "ts") {
          assert.deepEqual(state.result, { by: "ts", n });
          assert.equal(calls.get(state.id), 1, state.id);
          ts++;
        } else {
          assert.deepEqual(state.result, { n });
          assert.equal(calls.get(state.id), undefined, `${state.id} ran in TS too`);
          rust++;
        }
      });
      assert.equal(ts + rust, N);
      assert.ok(ts > 0, `the TS worker ran none (rust ${rust})`);
      assert.ok(rust > 0, `the Rust worker ran none (ts ${ts})`);
      assert.equal(calls.size, ts);
      assert.ok(
        deliveries.every((d) => d === 1),
        `deliveries ${deliveries.filter((d) => d !== 1)}`,
      );
      assert.deepEqual(errors, []);
      console.log(`# ${ctx.backend}: TS ran ${ts}, Rust ran ${rust}`);
    } finally {
      await worker.stop({ graceMs: 1_000 });
      await running;
    }
  });
});
