// BullMQ side of scripts/bench-bullmq.sh: the open-loop shape of `baton bench commands
// --open-loop`, with BullMQ.
//
//   node bench.mjs --port PORT [--count 20000] [--concurrency 64] [--batch 100]
//
// 1. add: COUNT jobs with Queue.addBulk, BATCH per call, one call in flight, no worker running
//    (jobs wait in the queue; default job options: completed jobs are kept, as Baton keeps
//    SUCCEEDED states);
// 2. drain: a Worker with CONCURRENCY and a no-op processor, timed from its construction until
//    its 'completed' event has fired COUNT times (emitted once the job is moved to completed in
//    Redis), then checked: getJobCounts() must be exactly COUNT completed and nothing else.
//
// Prints one JSON line: {"side": "bullmq", "count", "concurrency", "batch", "add_seconds",
// "add_per_second", "drain_seconds", "drain_per_second", "add_calls_per_job",
// "drain_calls_per_job"}; the calls are Redis calls per job by command name from
// INFO commandstats (all clients of that Redis, INFO left out, under 0.005 left out).
import { Queue, Worker } from 'bullmq';
import IORedis from 'ioredis';

function arg(name, dflt) {
  const i = process.argv.indexOf(`--${name}`);
  if (i < 0) return dflt;
  const v = Number(process.argv[i + 1]);
  if (!Number.isInteger(v) || v < 1) {
    console.error(`bench.mjs: --${name} wants a positive integer, got ${process.argv[i + 1]}`);
    process.exit(2);
  }
  return v;
}

const port = arg('port', 0);
if (!port) {
  console.error('bench.mjs: --port PORT (the redis-server to use) is required');
  process.exit(2);
}
const count = arg('count', 20000);
const concurrency = arg('concurrency', 64);
const batch = arg('batch', 100);
const connection = { host: '127.0.0.1', port, maxRetriesPerRequest: null };

const stats = new IORedis(connection);
async function commandstats() {
  const info = await stats.info('commandstats');
  const calls = new Map();
  for (const line of info.split(/\r?\n/)) {
    const m = /^cmdstat_([^:]+):calls=(\d+)/.exec(line);
    if (m) calls.set(m[1], Number(m[2]));
  }
  return calls;
}
function perJob(before, after) {
  const out = {};
  for (const [name, n] of after) {
    if (name === 'info') continue;
    const d = (n - (before.get(name) ?? 0)) / count;
    if (d >= 0.005) out[name] = Math.round(d * 1000) / 1000;
  }
  return out;
}

const name = `bench-${Date.now()}-${process.pid}`;
const queue = new Queue(name, { connection });
await queue.waitUntilReady();

// Add.
let calls0 = await commandstats();
let t0 = process.hrtime.bigint();
for (let n = 0; n < count; n += batch) {
  const jobs = [];
  for (let i = n; i < Math.min(count, n + batch); i++) jobs.push({ name: 'noop', data: {} });
  await queue.addBulk(jobs);
}
const addSeconds = Number(process.hrtime.bigint() - t0) / 1e9;
let calls1 = await commandstats();
const addCalls = perJob(calls0, calls1);

// Drain.
let completed = 0;
let failed = 0;
let done;
const allDone = new Promise((resolve) => (done = resolve));
calls0 = await commandstats();
t0 = process.hrtime.bigint();
const worker = new Worker(name, async () => null, { connection, concurrency });
worker.on('completed', () => {
  if (++completed === count) done();
});
worker.on('failed', () => {
  failed++;
  done();
});
worker.on('error', (e) => console.error(`bench.mjs: worker error: ${e}`));
const stall = setInterval(() => {
  if (Number(process.hrtime.bigint() - t0) / 1e9 > 300) {
    console.error(`bench.mjs: drain stuck at ${completed} of ${count} completed after 300 s`);
    process.exit(1);
  }
}, 1000);
await allDone;
const drainSeconds = Number(process.hrtime.bigint() - t0) / 1e9;
clearInterval(stall);
calls1 = await commandstats();
await worker.close();
const counts = await queue.getJobCounts();
const others = Object.entries(counts).filter(([k, v]) => k !== 'completed' && v !== 0);
if (failed || counts.completed !== count || others.length) {
  console.error(`bench.mjs: expected exactly ${count} completed and nothing else, got ${JSON.stringify(counts)}`);
  process.exit(1);
}
await queue.obliterate({ force: true });
await queue.close();
stats.disconnect();

console.log(
  JSON.stringify({
    side: 'bullmq',
    count,
    concurrency,
    batch,
    add_seconds: addSeconds,
    add_per_second: count / addSeconds,
    drain_seconds: drainSeconds,
    drain_per_second: count / drainSeconds,
    add_calls_per_job: addCalls,
    drain_calls_per_job: perJob(calls0, calls1),
  }),
);
