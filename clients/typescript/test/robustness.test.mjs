// The worker's error paths against real servers: a settlement whose answer is lost in transit
// (retried; the server's 409 means the first one was applied), a claim refused with 503 and
// Retry-After (no live-reader slot), a queue the server does not have, bearer tokens.
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { after, before, test } from "node:test";
import { BatonClient, BatonError, Failed, HandOff, Worker } from "../dist/index.js";
import { collectErrors, forEachBackend, sleep, uid, until } from "./helpers.mjs";

const QUEUE = `[queues.jobs]\nclaim_timeout = "1s"\n`;
const WORK_TOKEN = "work-token-0123456789abcdef";
const CLIENT_TOKEN = "client-token-0123456789abcdef";
const TOKENS = `${QUEUE}
[[tokens]]
name = "worker"
token_env = "TEST_WORK_TOKEN"
operations = ["work"]
queues = ["jobs"]

[[tokens]]
name = "client"
token_env = "TEST_CLIENT_TOKEN"
operations = ["read", "write"]
queues = ["jobs"]
`;

/**
 * An HTTP proxy to `upstream` that forwards every request; when `dropSettle` is set, the next
 * settle is forwarded (so the server applies it) and then its connection is destroyed before the
 * answer reaches the worker. Records what the server answered to each settlement (`"applied"`,
 * or the item's error code; the status when the request was refused) in `settles`, and the
 * settlements of each settle request in `settleRequests`.
 */
async function startProxy(upstream) {
  const proxy = { dropSettle: false, settles: [], settleRequests: [] };
  const server = createServer(async (req, res) => {
    const chunks = [];
    for await (const c of req) chunks.push(c);
    const headers = {};
    for (const h of ["content-type", "authorization", "accept"]) if (req.headers[h]) headers[h] = req.headers[h];
    let answer;
    try {
      answer = await fetch(upstream + req.url, {
        method: req.method,
        headers,
        body: chunks.length ? Buffer.concat(chunks) : undefined,
      });
    } catch {
      req.socket.destroy();
      return;
    }
    const text = await answer.text();
    if (req.url.endsWith("/settle")) {
      const sent = JSON.parse(Buffer.concat(chunks).toString());
      proxy.settleRequests.push(sent.settlements ? sent.settlements.length : 1);
      const got = answer.status === 200 ? JSON.parse(text) : undefined;
      if (got?.settlements) for (const item of got.settlements) proxy.settles.push("applied" in item ? "applied" : item.error);
      else proxy.settles.push(answer.status === 200 ? "applied" : answer.status);
      if (proxy.dropSettle) {
        proxy.dropSettle = false;
        req.socket.destroy();
        return;
      }
    }
    const out = { "content-type": answer.headers.get("content-type") ?? "application/json" };
    const retryAfter = answer.headers.get("retry-after");
    if (retryAfter) out["retry-after"] = retryAfter;
    res.writeHead(answer.status, out);
    res.end(text);
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  proxy.url = `http://127.0.0.1:${server.address().port}`;
  proxy.close = () =>
    new Promise((resolve) => {
      server.closeAllConnections();
      server.close(resolve);
    });
  return proxy;
}

forEachBackend("Worker robustness", { config: QUEUE }, (ctx) => {
  let proxy;
  before(async () => (proxy = await startProxy(ctx.url)));
  after(async () => proxy?.close());

  test("a settlement whose answer is lost is retried; the server's 409 means it was applied", async () => {
    const baton = new BatonClient({ url: ctx.url });
    const { errors, onError } = collectErrors();
    let calls = 0;
    const worker = new Worker({
      url: proxy.url,
      queue: "jobs",
      claimWaitMs: 2_000,
      onError,
      handler: () => {
        calls++;
        return { ok: true };
      },
    });
    proxy.dropSettle = true;
    proxy.settles.length = 0;
    const running = worker.run();
    try {
      const id = uid("settle-lost");
      await baton.submit("jobs", "t", {}, { id });
      const state = await baton.wait(id, { timeoutMs: 10_000 });
      assert.equal(state.status, "SUCCEEDED");
      assert.deepEqual(state.result, { ok: true });
      await until(() => proxy.settles.length === 2, 5_000, "the retried settle");
      assert.deepEqual(proxy.settles, ["applied", "lease_lost"]);
      await sleep(1_500); // no redelivery after the claim timeout
      assert.equal(calls, 1);
      assert.equal(errors.length, 1, errors.join("\n"));
      assert.match(errors[0], /^settle succeeded of command .* \(retrying in 100 ms\): .*no answer/);
      assert.equal((await baton.get(id)).attempts, 1);
    } finally {
      await worker.stop({ graceMs: 0 });
      await running;
    }
  });

  test("settlements ready together go in one request, each applied as alone; a refused hand-off fails only its command", async () => {
    const baton = new BatonClient({ url: ctx.url });
    const { errors, onError } = collectErrors();
    const n = 40;
    let started = 0;
    let open;
    const gate = new Promise((resolve) => (open = resolve));
    const worker = new Worker({
      url: proxy.url,
      queue: "jobs",
      concurrency: n,
      claimWaitMs: 2_000,
      onError,
      handler: async (job) => {
        if (++started === n) open();
        await gate;
        if (job.params.i % 10 === 0) throw new Failed(`no ${job.params.i}`);
        if (job.params.i === 7) return new HandOff("no-such-queue");
        return { i: job.params.i };
      },
    });
    proxy.settles.length = 0;
    proxy.settleRequests.length = 0;
    const ids = [];
    for (let i = 0; i < n; i++) {
      const id = uid("together");
      ids.push(id);
      await baton.submit("jobs", "t", { i }, { id });
    }
    const running = worker.run();
    try {
      const states = await Promise.all(ids.map((id) => baton.wait(id, { timeoutMs: 20_000 })));
      states.forEach((state, i) => {
        if (i % 10 === 0) {
          assert.equal(state.status, "FAILED");
          assert.equal(state.error, `no ${i}`);
        } else if (i === 7) {
          assert.equal(state.status, "FAILED");
          assert.match(state.error, /off to queue "no-such-queue", which the server refused/);
        } else {
          assert.equal(state.status, "SUCCEEDED");
          assert.deepEqual(state.result, { i });
        }
        assert.equal(state.attempts, 1);
      });
      // The request with the hand-off was refused whole (400 naming it); its others went again.
      assert.ok(proxy.settleRequests.reduce((a, b) => a + b, 0) > n, JSON.stringify(proxy.settleRequests));
      assert.ok(proxy.settleRequests.length < n / 4, JSON.stringify(proxy.settleRequests));
      assert.deepEqual([...proxy.settles].sort(), [...Array(n).fill("applied"), 400].sort());
      assert.equal(errors.length, 1, errors.join("\n"));
      assert.match(errors[0], /refused the hand-off to queue "no-such-queue"/);
    } finally {
      await worker.stop({ graceMs: 0 });
      await running;
    }
  });

  test("a worker of a queue the server does not have: run() rejects with 404 unknown_queue", async () => {
    const { errors, onError } = collectErrors();
    const worker = new Worker({ url: ctx.url, queue: "nope", handler: () => 1, onError });
    await assert.rejects(worker.run(), (err) => {
      assert.ok(err instanceof BatonError);
      assert.equal(err.status, 404);
      assert.equal(err.code, "unknown_queue");
      return true;
    });
    assert.equal(errors.length, 1);
  });
});

forEachBackend("Worker claim 503 (max-live-readers 1)", { config: QUEUE, args: ["--max-live-readers", "1"] }, (ctx) => {
  test("a claim refused with 503 is retried after Retry-After", async () => {
    const baton = new BatonClient({ url: ctx.url });
    const id = uid("busy-slot");
    await baton.submit("jobs", "t", { n: 1 }, { id });
    // Hold the only live-reader slot for 1.5 s with a long-poll of another command.
    const holder = uid("holder");
    await baton.submit("jobs", "other", null, { id: holder });
    const held = fetch(`${ctx.url}/v1/commands/${holder}?wait=1500ms`).then((r) => r.text());
    await sleep(200);
    const { errors, onError } = collectErrors();
    const worker = new Worker({ url: ctx.url, queue: "jobs", claimWaitMs: 1_000, onError, handler: (job) => job.params });
    const t0 = Date.now();
    const running = worker.run();
    try {
      await until(async () => (await baton.get(id)).status === "SUCCEEDED", 10_000, "SUCCEEDED");
      assert.ok(Date.now() - t0 >= 1_500, "claimed before Retry-After passed");
      assert.ok(errors.some((e) => /retrying in 2000 ms/.test(e)), errors.join("\n"));
      assert.deepEqual((await baton.get(id)).result, { n: 1 });
    } finally {
      await held;
      await worker.stop({ graceMs: 0 });
      await running;
    }
  });
});

forEachBackend("Worker vs a short --long-poll-timeout", { config: QUEUE, args: ["--long-poll-timeout", "2s"] }, (ctx) => {
  test("a claim wait above the server's long-poll timeout is cut to it by the server, not refused", async () => {
    const baton = new BatonClient({ url: ctx.url });
    const t0 = Date.now();
    const res = await fetch(`${ctx.url}/v1/queues/jobs/workers/probe/claim`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ wait: "20s" }),
    });
    assert.equal(res.status, 200);
    assert.deepEqual(await res.json(), { leases: [] });
    const waited = Date.now() - t0;
    assert.ok(waited >= 1_800 && waited < 10_000, `an empty claim answered after ${waited} ms`);

    const { errors, onError } = collectErrors();
    const worker = new Worker({ url: ctx.url, queue: "jobs", onError, handler: () => "ok" }); // claimWaitMs 20000
    const running = worker.run();
    try {
      await sleep(2_500); // a claim came back empty meanwhile
      const id = uid("short-poll");
      await baton.submit("jobs", "t", null, { id });
      const state = await baton.wait(id, { timeoutMs: 10_000 });
      assert.equal(state.status, "SUCCEEDED");
      assert.equal(state.result, "ok");
      assert.deepEqual(errors, []);
    } finally {
      await worker.stop({ graceMs: 0 });
      await running;
    }
  });
});

forEachBackend(
  "Tokens",
  { config: TOKENS, env: { TEST_WORK_TOKEN: WORK_TOKEN, TEST_CLIENT_TOKEN: CLIENT_TOKEN } },
  (ctx) => {
    test("client and worker send their bearer tokens; missing or wrong ones are 401 / 403", async () => {
      const baton = new BatonClient({ url: ctx.url, token: CLIENT_TOKEN });
      const anonymous = new BatonClient({ url: ctx.url });
      await assert.rejects(anonymous.submit("jobs", "t", {}), (err) => err instanceof BatonError && err.status === 401);

      // A worker with the client's token may not work the queue: run() rejects with 403.
      const wrong = new Worker({ url: ctx.url, queue: "jobs", token: CLIENT_TOKEN, handler: () => 1, onError: () => {} });
      await assert.rejects(wrong.run(), (err) => err instanceof BatonError && err.status === 403 && err.code === "forbidden");

      const worker = new Worker({
        url: ctx.url,
        queue: "jobs",
        token: WORK_TOKEN,
        claimWaitMs: 2_000,
        onError: collectErrors().onError,
        handler: (job) => ({ hello: job.params.name }),
      });
      const running = worker.run();
      try {
        const id = uid("token");
        await baton.submit("jobs", "greet", { name: "Ada" }, { id });
        const state = await baton.wait(id, { timeoutMs: 10_000 });
        assert.equal(state.status, "SUCCEEDED");
        assert.deepEqual(state.result, { hello: "Ada" });
      } finally {
        await worker.stop({ graceMs: 0 });
        await running;
      }
    });
  },
);
