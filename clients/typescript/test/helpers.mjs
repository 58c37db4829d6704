// Test helpers: real `baton serve` processes (memory or Redis backend) and real redis-server
// processes on free ports. No mocks.
//
// BATON_BIN: the `baton` binary (default: <repo root>/target/debug/baton).
// BATON_TEST_BACKENDS: comma-separated subset of "memory,redis" (default both).
import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { after, before, describe } from "node:test";
import { Worker } from "../dist/index.js";

const here = dirname(fileURLToPath(import.meta.url));
export const REPO_ROOT = resolve(here, "../../..");

/** The baton binary, or a clear error. */
export function batonBin() {
  const bin = process.env.BATON_BIN || join(REPO_ROOT, "target", "debug", "baton");
  if (!existsSync(bin)) {
    throw new Error(
      `baton binary not found at ${bin}: build it (cargo build -p baton) or set BATON_BIN to a built baton binary`,
    );
  }
  return bin;
}

export const BACKENDS = (process.env.BATON_TEST_BACKENDS || "memory,redis").split(",").map((s) => s.trim()).filter(Boolean);

const children = new Set();
process.on("exit", () => {
  for (const child of children) child.kill("SIGKILL");
});

/** A TCP port on 127.0.0.1 that nobody listens on (now). */
export function freePort() {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.unref();
    server.on("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Resolves once `pred()` (maybe async) is truthy, checked every 20 ms; rejects after `ms`. */
export async function until(pred, ms = 10_000, what = "condition") {
  const deadline = Date.now() + ms;
  for (;;) {
    if (await pred()) return;
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await sleep(20);
  }
}

function cleanEnv(extra = {}) {
  const env = {};
  for (const [k, v] of Object.entries(process.env)) if (!k.startsWith("BATON_")) env[k] = v;
  return { ...env, ...extra };
}

function startProcess(cmd, args, options) {
  const child = spawn(cmd, args, { stdio: ["ignore", "pipe", "pipe"], ...options });
  children.add(child);
  let log = "";
  child.stdout.on("data", (d) => (log = (log + d).slice(-20_000)));
  child.stderr.on("data", (d) => (log = (log + d).slice(-20_000)));
  const exited = new Promise((resolve) => child.on("exit", (code, signal) => resolve({ code, signal })));
  exited.then(() => children.delete(child));
  return {
    child,
    exited,
    log: () => log,
    async stop() {
      if (child.exitCode !== null || child.signalCode !== null) return;
      child.kill("SIGTERM");
      const timer = setTimeout(() => child.kill("SIGKILL"), 5_000);
      await exited;
      clearTimeout(timer);
    },
  };
}

/** A redis-server on a free port, no persistence. */
export async function startRedis() {
  for (let attempt = 0; ; attempt++) {
    const port = await freePort();
    const dir = mkdtempSync(join(tmpdir(), "baton-ts-redis-"));
    const p = startProcess(
      "redis-server",
      ["--port", String(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir],
      {},
    );
    try {
      await waitListening(port, p, "redis-server");
    } catch (err) {
      await p.stop();
      rmSync(dir, { recursive: true, force: true });
      if (attempt < 3) continue;
      throw err;
    }
    return {
      url: `redis://127.0.0.1:${port}`,
      async stop() {
        await p.stop();
        rmSync(dir, { recursive: true, force: true });
      },
    };
  }
}

async function waitListening(port, p, what) {
  const { connect } = await import("node:net");
  const deadline = Date.now() + 10_000;
  while (Date.now() < deadline) {
    if (p.child.exitCode !== null) throw new Error(`${what} exited: ${p.log()}`);
    const ok = await new Promise((resolve) => {
      const s = connect(port, "127.0.0.1");
      s.on("connect", () => (s.destroy(), resolve(true)));
      s.on("error", () => resolve(false));
    });
    if (ok) return;
    await sleep(30);
  }
  throw new Error(`${what} did not listen on port ${port}: ${p.log()}`);
}

/**
 * Starts `baton serve` with `config` (TOML text) on a free port.
 * @param {{config: string, redis?: string, workers?: boolean, args?: string[], env?: Record<string,string>}} o
 */
export async function startBaton({ config, redis, workers = false, args = [], env = {} }) {
  const bin = batonBin();
  const dir = mkdtempSync(join(tmpdir(), "baton-ts-"));
  const configPath = join(dir, "baton.toml");
  writeFileSync(configPath, config);
  for (let attempt = 0; ; attempt++) {
    const port = await freePort();
    const argv = ["serve", "--listen", `127.0.0.1:${port}`, "--config", configPath, "--shutdown-grace", "1s"];
    if (redis) argv.push("--redis", redis);
    if (!workers) argv.push("--no-workers");
    argv.push(...args);
    const p = startProcess(bin, argv, { env: cleanEnv(env) });
    const url = `http://127.0.0.1:${port}`;
    try {
      const deadline = Date.now() + 20_000;
      for (;;) {
        if (p.child.exitCode !== null) throw new Error(`baton serve exited (${p.child.exitCode}): ${p.log()}`);
        try {
          const res = await fetch(`${url}/healthz`);
          if (res.ok) break;
        } catch {
          // not listening yet
        }
        if (Date.now() > deadline) throw new Error(`baton serve did not answer /healthz: ${p.log()}`);
        await sleep(30);
      }
    } catch (err) {
      await p.stop();
      if (attempt < 2 && /address|in use|taken/i.test(p.log())) continue;
      rmSync(dir, { recursive: true, force: true });
      throw err;
    }
    return {
      url,
      log: p.log,
      async stop() {
        await p.stop();
        rmSync(dir, { recursive: true, force: true });
      },
    };
  }
}

/**
 * Defines `describe(`${name} (${backend})`)` for each backend, with a fresh redis-server (Redis
 * backend) and `baton serve` started before and stopped after. `fn(ctx)` defines the tests;
 * `ctx.url`, `ctx.backend`, `ctx.server` are set once the server is up.
 */
export function forEachBackend(name, serverOptions, fn) {
  for (const backend of BACKENDS) {
    describe(`${name} (${backend})`, () => {
      const ctx = { backend, url: undefined, server: undefined, redis: undefined };
      before(async () => {
        if (backend === "redis") ctx.redis = await startRedis();
        else if (backend !== "memory") throw new Error(`unknown backend ${backend}`);
        ctx.server = await startBaton({ ...serverOptions, redis: ctx.redis?.url });
        ctx.url = ctx.server.url;
      });
      after(async () => {
        await ctx.server?.stop();
        await ctx.redis?.stop();
      });
      fn(ctx);
    });
  }
}

let counter = 0;
/** A unique command id. */
export function uid(prefix = "cmd") {
  return `${prefix}-${process.pid}-${Date.now().toString(36)}-${(counter++).toString(36)}`;
}

/** An onError for workers under test: collects instead of printing. */
/**
 * Workers a test file starts against `ctx.url`: `start(options)` runs one (5 s claim waits,
 * errors collected) and returns `{ worker, running, errors }`; `stopAll()` (call it in
 * `afterEach`) stops every one started since, at once (grace 0).
 */
export function workerPool(ctx) {
  const started = [];
  return {
    start(options) {
      const { errors, onError } = collectErrors();
      const worker = new Worker({ url: ctx.url, claimWaitMs: 5_000, onError, ...options });
      const running = worker.run();
      const entry = { worker, running, errors };
      started.push(entry);
      return entry;
    },
    async stopAll() {
      for (const { worker, running } of started.splice(0)) {
        await worker.stop({ graceMs: 0 });
        await running.catch(() => {});
      }
    },
  };
}

export function collectErrors() {
  const errors = [];
  const onError = (error, context) => errors.push(`${context}: ${error.message}`);
  return { errors, onError };
}

/**
 * An HTTP proxy to `upstream` for injecting transport failures. `proxy.fault(path)` (settable;
 * default none) chooses, per request, what happens to it: `undefined` forwards it, `"503"`
 * answers `503 backend_unavailable` without forwarding, `"drop"` destroys the connection without
 * forwarding. `proxy.seen` records `{path, fault, status}` of every request (`status` as
 * forwarded, `0` when not).
 */
export async function startFaultProxy(upstream) {
  const { createServer } = await import("node:http");
  const proxy = { fault: () => undefined, seen: [] };
  const server = createServer(async (req, res) => {
    const chunks = [];
    for await (const c of req) chunks.push(c);
    const path = req.url;
    const fault = proxy.fault(path);
    if (fault === "503") {
      proxy.seen.push({ path, fault, status: 0 });
      res.writeHead(503, { "content-type": "application/json" });
      res.end(JSON.stringify({ error: "backend_unavailable", message: "injected by the test proxy" }));
      return;
    }
    if (fault === "drop") {
      proxy.seen.push({ path, fault, status: 0 });
      req.socket.destroy();
      return;
    }
    const headers = {};
    for (const h of ["content-type", "authorization", "accept"]) if (req.headers[h]) headers[h] = req.headers[h];
    let answer;
    try {
      answer = await fetch(upstream + path, {
        method: req.method,
        headers,
        body: chunks.length ? Buffer.concat(chunks) : undefined,
      });
    } catch {
      req.socket.destroy();
      return;
    }
    const text = await answer.text();
    proxy.seen.push({ path, fault: undefined, status: answer.status });
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
