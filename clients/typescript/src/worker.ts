import { hostname } from "node:os";
import { randomBytes } from "node:crypto";
import { Worker as LeaseThread } from "node:worker_threads";
import { BatonError } from "./errors.js";
import { describe, duration, requestJson, sleep, type Endpoint } from "./http.js";
import { Failed, HandOff, JobAborted, Release, Running, type AbortKind } from "./outcomes.js";
import type { ClaimedLease, FromLeaseThread, LeaseThreadConfig, ToLeaseThread } from "./protocol.js";
import { jsonText, type CommandState, type JsonValue } from "./types.js";

/** One delivery of a command to this worker. */
export interface Job {
  /** The command's id. */
  id: string;
  /** The command's type. */
  type: string;
  /** The command's params, parsed (`command.params`). */
  params: JsonValue;
  /**
   * `"execute"`: the command is `SUBMITTED`, run it. `"check_status"`: it is `RUNNING` (an earlier
   * call returned {@link Running}, or it was handed off to this queue): check on the work.
   */
  call: "execute" | "check_status";
  /** The command's state when it was claimed. */
  command: CommandState;
  /** Deliveries of this command's message, this one included (2 or more: an earlier worker went silent or released it). */
  deliveries: number;
  /** The lease token (opaque). */
  lease: string;
  /** The queue's claim timeout, in milliseconds (the lease is renewed every third of it). */
  leaseTimeoutMs: number;
  /** The queue it was claimed from. */
  queue: string;
}

/**
 * Runs one delivery. Return a result (any JSON value) to succeed, or an outcome
 * ({@link Running}, {@link HandOff}, {@link Release}); throw {@link Failed} to fail for good; any
 * other throw is a handler error, retried by the server with backoff.
 *
 * `signal` aborts when the work should stop; `signal.reason` is a {@link JobAborted} whose `kind`
 * says why (`"cancelled"`, `"lease_lost"`, `"shutdown"`).
 */
export type Handler = (job: Job, signal: AbortSignal) => unknown;

/** Options of {@link Worker}. */
export interface WorkerOptions {
  /** Base URL of `baton serve`, e.g. `http://127.0.0.1:7700`. */
  url: string;
  /** The queue to work on (configured on the server). */
  queue: string;
  /**
   * One handler for every command type, or a map type → handler (a command whose type has no
   * handler here is settled `failed`, naming the types this worker handles).
   */
  handler: Handler | Record<string, Handler>;
  /** Handlers at once (default 1; 1 – 10000). */
  concurrency?: number;
  /** The worker's name, 1 – 128 bytes (default `<hostname>-<pid>-<random>`). Use one per process. */
  name?: string;
  /** Bearer token with the `work` operation on the queue. */
  token?: string;
  /** Long-poll wait of one claim, in milliseconds (default 20000; the server cuts a longer wait than its `--long-poll-timeout`, 30 s by default, to it). */
  claimWaitMs?: number;
  /** Default grace period of {@link Worker.stop}, in milliseconds (default 10000). */
  shutdownGraceMs?: number;
  /** Call {@link Worker.stop} on `SIGTERM` and `SIGINT` while running (default false). */
  handleSignals?: boolean;
  /**
   * Called with problems the worker works around (a failed claim or renewal that is retried, a
   * settlement refused, a lost lease). Default: `console.warn`.
   */
  onError?: (error: Error, context: string) => void;
}

interface Running_ {
  job: Job;
  controller: AbortController;
  /** Set when the signal aborted. */
  aborted: AbortKind | undefined;
  /** The renewer said lost/gone/expired: never settle. */
  lost: boolean;
  /** Released at the end of the grace period: never settle again. */
  abandoned: boolean;
  /** The handler has ended: its settlement is being sent. */
  settling: boolean;
  /** Resolves when the handler has ended and its settlement is done. */
  done: Promise<void>;
  /** When released at shutdown (or claimed while stopping): resolves when the release is settled. */
  release: Promise<void> | undefined;
}

type SettleBody = Record<string, unknown> & { outcome: string };

/** One settlement on its way (see Worker#settle). */
interface Settlement {
  r: Running_;
  body: SettleBody;
  /** The item's JSON text. */
  item: string;
  giveUpAt: number;
  budgetMs: number;
  /** Next delay after an item-level backend error, ms. */
  backoff: number;
  /** Refused as part of a batch without the item at fault named (413): sent on its own. */
  alone: boolean;
  finish: () => void;
}

/** The server's limit of settlements in one request. */
const MAX_SETTLE = 1000;
/** A batch's body stays well under the server's `--max-command-body` (1 MiB by default). */
const SETTLE_BATCH_BYTES = 256 * 1024;
/** Settle requests in flight at once. */
const SETTLES_IN_FLIGHT = 2;

/** One settlement's JSON text (`result` is already JSON text). */
function settleItem(lease: string, body: SettleBody): string {
  let text = `{"lease":${JSON.stringify(lease)}`;
  for (const [key, value] of Object.entries(body)) {
    text += `,${JSON.stringify(key)}:${key === "result" ? (value as string) : JSON.stringify(value)}`;
  }
  return text + "}";
}

/** Default worker name: host, pid and a random suffix. */
function defaultName(): string {
  return `${hostname()}-${process.pid}-${randomBytes(3).toString("hex")}`;
}

function errorMessage(err: unknown): string {
  if (err instanceof Error) {
    const name = err.name && err.name !== "Error" ? `${err.name}: ` : "";
    return `${name}${err.message || "(no message)"}`;
  }
  return String(err);
}

/**
 * A remote worker of one queue (docs/workers.md): claims commands from `baton serve`, runs the
 * handler for each, keeps their leases renewed from a separate thread (so a handler that blocks
 * the main thread keeps its lease) and settles the outcome.
 *
 * ```ts
 * const worker = new Worker({ url, queue: "jobs", handler: async (job, signal) => ({ done: job.id }) });
 * const running = worker.run();   // resolves after stop()
 * await worker.stop();
 * ```
 */
export class Worker {
  /** The worker's name (sent in every claim, renew and settle URL). */
  readonly name: string;
  readonly #endpoint: Endpoint;
  readonly #queue: string;
  readonly #handler: Handler | Record<string, Handler>;
  readonly #concurrency: number;
  readonly #claimWaitMs: number;
  readonly #graceMs: number;
  readonly #handleSignals: boolean;
  readonly #onError: (error: Error, context: string) => void;
  readonly #jobs = new Map<string, Running_>();
  #thread: LeaseThread | undefined;
  #state: "idle" | "running" | "stopping" | "stopped" = "idle";
  #fatal: Error | undefined;
  #stopPromise: Promise<void> | undefined;
  #runPromise: Promise<void> | undefined;
  #finish: (() => void) | undefined;
  #claimingStopped: Promise<void> | undefined;
  #onClaimingStopped: (() => void) | undefined;

  constructor(options: WorkerOptions) {
    if (!options || typeof options.url !== "string" || options.url === "") throw new TypeError("Worker: `url` is required");
    if (typeof options.queue !== "string" || options.queue === "") throw new TypeError("Worker: `queue` is required");
    if (typeof options.handler !== "function" && (typeof options.handler !== "object" || options.handler === null)) {
      throw new TypeError("Worker: `handler` must be a function or a map of command type to function");
    }
    const concurrency = options.concurrency ?? 1;
    if (!Number.isInteger(concurrency) || concurrency < 1 || concurrency > 10_000) {
      throw new RangeError("Worker: concurrency must be an integer in 1 – 10000");
    }
    const claimWaitMs = options.claimWaitMs ?? 20_000;
    if (!(claimWaitMs >= 0)) throw new RangeError("Worker: claimWaitMs must be >= 0");
    this.name = options.name ?? defaultName();
    this.#endpoint = { url: options.url, token: options.token };
    this.#queue = options.queue;
    this.#handler = options.handler;
    this.#concurrency = concurrency;
    this.#claimWaitMs = claimWaitMs;
    this.#graceMs = options.shutdownGraceMs ?? 10_000;
    this.#handleSignals = options.handleSignals ?? false;
    this.#onError =
      options.onError ?? ((error, context) => console.warn(`[baton worker ${this.name}] ${context}: ${error.message}`));
  }

  /** Handlers running now. */
  get inFlight(): number {
    let n = 0;
    for (const r of this.#jobs.values()) if (!r.abandoned) n++;
    return n;
  }

  /**
   * Claims and runs commands until {@link Worker.stop} (or a signal with `handleSignals`); resolves
   * once every handler has ended (or been released) and the lease thread has exited.
   *
   * @throws {BatonError} when claiming fails for good (`404 unknown_queue`, `401`, `403`, `400`):
   *   the worker stops (as `stop()` does) and `run()` rejects with that error.
   */
  run(): Promise<void> {
    if (this.#state !== "idle") throw new Error("Worker.run: this worker was already started or stopped (a Worker runs once)");
    this.#state = "running";
    const config: LeaseThreadConfig = {
      url: this.#endpoint.url,
      token: this.#endpoint.token,
      queue: this.#queue,
      name: this.name,
      concurrency: this.#concurrency,
      claimWaitMs: this.#claimWaitMs,
    };
    const thread = new LeaseThread(new URL("./renewer.js", import.meta.url), { workerData: config });
    this.#thread = thread;
    this.#claimingStopped = new Promise((resolve) => (this.#onClaimingStopped = resolve));
    thread.on("message", (message: FromLeaseThread) => this.#onMessage(message));
    thread.on("error", (err) => {
      // The lease thread died: no lease can be renewed any more.
      this.#fatal ??= new Error(`the lease thread failed: ${describe(err)}`, { cause: err });
      for (const r of this.#jobs.values()) this.#markLost(r, "the lease thread failed");
      this.#onClaimingStopped?.();
      void this.stop({ graceMs: 0 });
    });
    thread.on("exit", () => this.#onClaimingStopped?.());

    const onSignal = () => void this.stop();
    if (this.#handleSignals) {
      process.on("SIGTERM", onSignal);
      process.on("SIGINT", onSignal);
    }
    this.#runPromise = new Promise<void>((resolve, reject) => {
      this.#finish = () => {
        if (this.#handleSignals) {
          process.off("SIGTERM", onSignal);
          process.off("SIGINT", onSignal);
        }
        if (this.#fatal) reject(this.#fatal);
        else resolve();
      };
    });
    return this.#runPromise;
  }

  /**
   * Stops: claims no more, lets running handlers finish for `graceMs` (default the
   * `shutdownGraceMs` option, 10 s), then aborts the rest (`signal.reason.kind === "shutdown"`)
   * and releases their leases (another worker gets them after the claim timeout). Resolves when
   * {@link Worker.run} has resolved (it may reject: `stop()` does not).
   */
  stop(options: { graceMs?: number } = {}): Promise<void> {
    if (this.#state === "idle") {
      this.#state = "stopped";
      return Promise.resolve();
    }
    this.#stopPromise ??= this.#shutdown(options.graceMs ?? this.#graceMs);
    return this.#stopPromise;
  }

  async #shutdown(graceMs: number): Promise<void> {
    this.#state = "stopping";
    this.#post({ t: "stop-claiming" });
    // Leases of a claim answered meanwhile are released as they arrive (#onMessage).
    const all = () => Promise.all([...this.#jobs.values()].map((r) => r.done));
    let timer: NodeJS.Timeout | undefined;
    const graceOver = new Promise<"grace">((resolve) => (timer = setTimeout(() => resolve("grace"), graceMs)));
    const first = await Promise.race([all().then(() => "done" as const), graceOver]);
    clearTimeout(timer);
    if (first === "grace") {
      for (const r of this.#jobs.values()) {
        if (r.abandoned) continue;
        // A handler that has ended is being settled: let that settlement finish (a release
        // racing it could win and throw the result away).
        r.release = r.settling ? r.done : this.#abandon(r);
      }
    }
    // The claim loop ends promptly once told (its claim is aborted); wait for it so that no
    // lease is claimed unseen, then for the releases (a handler that ignores its signal is not
    // waited for).
    await Promise.race([this.#claimingStopped, sleep(2_000)]);
    await Promise.all([...this.#jobs.values()].map((r) => r.release));
    const thread = this.#thread;
    this.#thread = undefined;
    if (thread) {
      thread.unref();
      await thread.terminate();
    }
    this.#state = "stopped";
    this.#finish?.();
    await this.#runPromise?.catch(() => {});
  }

  /** Grace is over for this job: abort it, release its lease, never settle it otherwise. */
  async #abandon(r: Running_): Promise<void> {
    r.abandoned = true;
    this.#abort(r, "shutdown", "the worker is shutting down and the grace period is over");
    // A release is a courtesy (without it the command goes elsewhere after the claim timeout
    // anyway): a short budget keeps a shutdown short when the server is unreachable.
    if (!r.lost) await this.#settle(r, { outcome: "release" }, 3_000);
    this.#post({ t: "remove", lease: r.job.lease });
  }

  #post(message: ToLeaseThread): void {
    this.#thread?.postMessage(message);
  }

  #onMessage(message: FromLeaseThread): void {
    switch (message.t) {
      case "leases":
        for (const lease of message.leases) this.#start(lease);
        break;
      case "cancelled": {
        const r = this.#jobs.get(message.lease);
        if (r) this.#abort(r, "cancelled", `command ${r.job.id} was cancelled`);
        break;
      }
      case "lost": {
        const r = this.#jobs.get(message.lease);
        if (r) this.#markLost(r, `renewal said ${message.why}`);
        break;
      }
      case "fatal":
        this.#fatal ??= new BatonError(message.status, message.code, message.message);
        this.#onError(this.#fatal, "claim failed for good; stopping");
        void this.stop();
        break;
      case "warn":
        this.#onError(new Error(message.message), message.context);
        break;
      case "claiming-stopped":
        this.#onClaimingStopped?.();
        break;
    }
  }

  #markLost(r: Running_, why: string): void {
    if (r.lost) return;
    r.lost = true;
    // A renewal that crossed this worker's own settlement says `gone`: expected, not a loss
    // (a settlement still being retried stops: the lease is not held any more either way).
    if (r.settling || r.abandoned) return;
    this.#abort(r, "lease_lost", `the lease of command ${r.job.id} was lost (${why})`);
    this.#onError(new Error(`command ${r.job.id}: lease lost (${why}); not settling it`), "lease");
  }

  #abort(r: Running_, kind: AbortKind, message: string): void {
    if (r.controller.signal.aborted) return;
    r.aborted = kind;
    r.controller.abort(new JobAborted(kind, message));
  }

  #handlerFor(type: string): Handler {
    if (typeof this.#handler === "function") return this.#handler;
    const map = this.#handler;
    if (Object.prototype.hasOwnProperty.call(map, type) && typeof map[type] === "function") return map[type]!;
    const known = Object.keys(map).sort().join(", ") || "none";
    return () => {
      throw new Failed(`no handler for command type "${type}" in worker ${this.name} (it handles: ${known})`);
    };
  }

  #start(lease: ClaimedLease): void {
    const job: Job = {
      id: lease.command.id,
      type: lease.command.type,
      params: lease.command.params,
      call: lease.call,
      command: lease.command,
      deliveries: lease.deliveries,
      lease: lease.lease,
      leaseTimeoutMs: lease.lease_timeout_ms,
      queue: this.#queue,
    };
    const r: Running_ = {
      job,
      controller: new AbortController(),
      aborted: undefined,
      lost: false,
      abandoned: false,
      settling: false,
      done: Promise.resolve(),
      release: undefined,
    };
    this.#jobs.set(lease.lease, r);
    if (this.#state !== "running") {
      // Claimed while stopping: hand it back unrun.
      r.abandoned = true;
      r.release = r.done = this.#settle(r, { outcome: "release" }, 3_000).finally(() => this.#finishJob(r));
      return;
    }
    r.done = this.#runJob(r).finally(() => this.#finishJob(r));
  }

  #finishJob(r: Running_): void {
    if (this.#jobs.get(r.job.lease) === r) this.#jobs.delete(r.job.lease);
    this.#post({ t: "remove", lease: r.job.lease });
  }

  async #runJob(r: Running_): Promise<void> {
    let body: SettleBody;
    try {
      const value = await this.#handlerFor(r.job.type)(r.job, r.controller.signal);
      body = this.#outcomeOf(value);
    } catch (err) {
      body = err instanceof Failed ? { outcome: "failed", error: err.message } : { outcome: "error", error: errorMessage(err) };
    }
    if (r.lost || r.abandoned) return;
    if (r.aborted === "cancelled") body = { outcome: "cancelled" };
    r.settling = true;
    await this.#settle(r, body);
  }

  #outcomeOf(value: unknown): SettleBody {
    if (value instanceof Failed) return { outcome: "failed", error: value.message };
    if (value instanceof Running) {
      return value.nextCheckMs === undefined
        ? { outcome: "running" }
        : { outcome: "running", next_check: duration(value.nextCheckMs) };
    }
    if (value instanceof HandOff) return { outcome: "handed_off", queue: value.queue };
    if (value instanceof Release) return { outcome: "release" };
    try {
      return { outcome: "succeeded", result: jsonText(value) };
    } catch (err) {
      return { outcome: "error", error: `the handler's result is not JSON: ${errorMessage(err)}` };
    }
  }

  /**
   * Settles `r` with `body`; resolves when that is done or given up. Settlements ready at the
   * same time go out together in one request (`{"settlements": [...]}`, see #pumpSettlements).
   * Transient failures (no answer, `408`/`429`/`5xx`, an item's backend error) are retried with
   * backoff (100 ms doubling to 5 s) while the lease is held, for at most `budgetMs` (then the
   * lease is dropped and the command goes to another worker after the claim timeout); an item's
   * `lease_lost` ends it (taken over, or an earlier try was applied). A body the server refuses
   * (`400`) is replaced: a hand-off to a queue the server does not have (or to the command's
   * own) by `failed` naming the queue, a refused result (`400`/`413`) or another refused
   * outcome by `error`.
   */
  #settle(r: Running_, body: SettleBody, budgetMs = 60_000): Promise<void> {
    return new Promise<void>((resolve) => {
      this.#ready.push({
        r,
        body,
        item: settleItem(r.job.lease, body),
        giveUpAt: Date.now() + budgetMs,
        budgetMs,
        backoff: 100,
        alone: false,
        finish: resolve,
      });
      this.#schedulePump();
    });
  }

  readonly #ready: Settlement[] = [];
  #settlesInFlight = 0;
  #pumpScheduled = false;
  #requestBackoff = 100;

  /** Pumps on the next turn, so that the settlements of handlers ending together share a request. */
  #schedulePump(): void {
    if (this.#pumpScheduled) return;
    this.#pumpScheduled = true;
    setImmediate(() => {
      this.#pumpScheduled = false;
      this.#pumpSettlements();
    });
  }

  /** Sends what is ready, at most SETTLES_IN_FLIGHT requests at once; what becomes ready meanwhile waits for the next. */
  #pumpSettlements(): void {
    while (this.#settlesInFlight < SETTLES_IN_FLIGHT && this.#ready.length > 0) {
      const batch = this.#takeBatch();
      if (batch.length === 0) continue;
      this.#settlesInFlight++;
      this.#sendSettlements(batch)
        .catch((err) => {
          // A bug: do not leave the handlers' settlements hanging.
          this.#onError(err instanceof Error ? err : new Error(String(err)), "settle (internal error)");
          for (const s of batch) s.finish();
        })
        .finally(() => {
          this.#settlesInFlight--;
          this.#pumpSettlements();
        });
    }
  }

  #takeBatch(): Settlement[] {
    const batch: Settlement[] = [];
    let bytes = 0;
    while (this.#ready.length > 0 && batch.length < MAX_SETTLE) {
      const s = this.#ready[0]!;
      if (s.r.lost) {
        // Not ours any more (or the renewal crossed our own settlement): nothing to send.
        this.#ready.shift();
        s.finish();
        continue;
      }
      if (batch.length > 0 && (s.alone || bytes + s.item.length > SETTLE_BATCH_BYTES)) break;
      this.#ready.shift();
      batch.push(s);
      bytes += s.item.length + 1;
      if (s.alone) break;
    }
    return batch;
  }

  /** Back in line now (at the front), or after `delay` ms: those past their budget are given up. */
  #again(items: Settlement[], delay = 0, err?: Error): void {
    if (items.length === 0) return;
    if (delay <= 0) {
      this.#ready.unshift(...items);
      this.#schedulePump();
      return;
    }
    const now = Date.now();
    const keep: Settlement[] = [];
    for (const s of items) {
      if (now + delay > s.giveUpAt) {
        this.#onError(
          err ?? new Error("settle failed"),
          `settle ${s.body.outcome} of command ${s.r.job.id}: giving up after ${s.budgetMs} ms (the command goes to another worker after the claim timeout)`,
        );
        s.finish();
      } else keep.push(s);
    }
    if (keep.length === 0) return;
    if (err) {
      const what = keep.length === 1 ? `settle ${keep[0]!.body.outcome} of command ${keep[0]!.r.job.id}` : `settle of ${keep.length} commands`;
      this.#onError(err, `${what} (retrying in ${delay} ms)`);
    }
    setTimeout(() => {
      this.#ready.push(...keep);
      this.#schedulePump();
    }, delay);
  }

  async #sendSettlements(batch: Settlement[]): Promise<void> {
    let answers: unknown;
    try {
      const res = await requestJson(
        this.#endpoint,
        "POST",
        `/v1/queues/${encodeURIComponent(this.#queue)}/workers/${encodeURIComponent(this.name)}/settle`,
        { body: `{"settlements":[${batch.map((s) => s.item).join(",")}]}`, timeoutMs: 30_000 },
      );
      answers = (res.body as { settlements?: unknown } | null)?.settlements;
    } catch (err) {
      if (!(err instanceof BatonError)) throw err;
      if (err.transient || err.status >= 500) {
        const delay = err.retryAfterMs ?? this.#requestBackoff;
        this.#requestBackoff = Math.min(this.#requestBackoff * 2, 5_000);
        this.#again(batch, delay, err);
        return;
      }
      if (err.status === 400 || err.status === 413) {
        // The whole request is refused, nothing settled. A 400 names the item at fault; without
        // that (413: too big together), each is sent on its own.
        const m = /^settlements\[(\d+)\]: ?/.exec(err.message);
        const index = m && err.status === 400 ? Number(m[1]) : batch.length === 1 ? 0 : undefined;
        if (index === undefined || index >= batch.length) {
          for (const s of batch) s.alone = true;
          this.#again(batch);
          return;
        }
        const bad = batch[index]!;
        const rest = batch.filter((_, i) => i !== index);
        const message = m ? err.message.slice(m[0].length) : err.message;
        if (this.#refused(bad, err, message)) {
          bad.finish();
          this.#again(rest);
        } else this.#again([bad, ...rest]);
        return;
      }
      for (const s of batch) {
        this.#onError(err, `settle ${s.body.outcome} of command ${s.r.job.id} refused`);
        s.finish();
      }
      return;
    }
    this.#requestBackoff = 100;
    if (!Array.isArray(answers) || answers.length !== batch.length) {
      this.#again(batch, 1_000, new Error(`settle answered something unexpected: ${JSON.stringify(answers)?.slice(0, 200)}`));
      return;
    }
    const retry: Settlement[] = [];
    let delay = 0;
    let why: Error | undefined;
    batch.forEach((s, i) => {
      const a = answers[i] as { applied?: boolean; error?: string; message?: string } | null;
      if (a === null || typeof a !== "object" || "applied" in a || a.error === "lease_lost" || typeof a.error !== "string") {
        s.finish(); // settled; or not ours any more, or an earlier try was applied
        return;
      }
      // A backend failure for this one: retry it.
      delay = Math.max(delay, s.backoff);
      s.backoff = Math.min(s.backoff * 2, 5_000);
      why = new BatonError(503, a.error, a.message ?? a.error);
      retry.push(s);
    });
    this.#again(retry, delay, why);
  }

  /**
   * The server refused this settlement's body: put one it takes in its place (`false`: send it
   * again), or give up (`true`).
   */
  #refused(s: Settlement, err: BatonError, message: string): boolean {
    const { outcome } = s.body;
    const id = s.r.job.id;
    s.alone = false;
    let body: SettleBody | undefined;
    if (outcome === "handed_off" && err.status === 400) {
      const queue = s.body.queue as string;
      this.#onError(err, `command ${id}: the server refused the hand-off to queue ${JSON.stringify(queue)}; settling it failed`);
      body = {
        outcome: "failed",
        error: `the handler handed the command off to queue ${JSON.stringify(queue)}, which the server refused: ${message}`,
      };
    } else if (outcome === "succeeded" && (err.status === 400 || err.status === 413)) {
      this.#onError(err, `command ${id}: the server refused the result; settling it as an error`);
      body = { outcome: "error", error: `the server refused the handler's result: ${message}` };
    } else if (err.status === 400 && outcome !== "error" && outcome !== "release") {
      this.#onError(err, `settle ${outcome} of command ${id} refused`);
      body = { outcome: "error", error: `settling ${outcome} was refused: ${message}` };
    }
    if (body === undefined) {
      this.#onError(err, `settle ${outcome} of command ${id} refused`);
      return true;
    }
    s.body = body;
    s.item = settleItem(s.r.job.lease, body);
    return false;
  }
}
