// A remote worker for `baton serve`: handles `greet`, `sum` and `sleep` commands on one queue.
//
//   cat > baton.toml <<'TOML'
//   [queues.jobs]
//   claim_timeout = "30s"
//   TOML
//   baton serve --config baton.toml --no-workers &
//   (cd clients/typescript && npm ci && npm run build)
//   node clients/typescript/examples/worker.mjs            # BATON_URL, BATON_QUEUE, BATON_TOKEN
//   curl -s localhost:7700/v1/queues/jobs/commands -H 'Content-Type: application/json' \
//     -d '{"id": "hi-1", "type": "greet", "params": {"name": "Ada"}}'
//   curl -s 'localhost:7700/v1/commands/hi-1?wait=10s'
//
// Ctrl-C or SIGTERM stops it gracefully: no more claims, running handlers get 10 s, the rest are
// released to another worker.
import { Failed, Worker } from "@baton/client";

const url = process.env.BATON_URL ?? "http://127.0.0.1:7700";
const queue = process.env.BATON_QUEUE ?? "jobs";

const worker = new Worker({
  url,
  queue,
  token: process.env.BATON_TOKEN,
  concurrency: 4,
  handleSignals: true,
  handler: {
    // {"name": "Ada"} → {"greeting": "hello, Ada"}
    greet: (job) => {
      if (typeof job.params?.name !== "string") throw new Failed('params must be {"name": string}');
      return { greeting: `hello, ${job.params.name}` };
    },
    // {"numbers": [1, 2, 3]} → 6
    sum: (job) => (job.params?.numbers ?? []).reduce((a, b) => a + b, 0),
    // {"ms": 5000}: sleeps, stopping early when cancelled (the worker then settles `cancelled`).
    sleep: (job, signal) =>
      new Promise((resolve, reject) => {
        const timer = setTimeout(() => resolve({ slept_ms: job.params.ms }), job.params.ms);
        signal.addEventListener("abort", () => {
          clearTimeout(timer);
          reject(signal.reason);
        });
      }),
  },
});

console.log(`worker ${worker.name} on ${url}, queue ${queue}`);
await worker.run();
console.log("worker stopped");
