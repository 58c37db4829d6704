import { hostname } from "node:os";
import { randomBytes } from "node:crypto";
import { Worker as LeaseThread } from "node:worker_threads";
import { BatonError } from "./errors.js";
import { describe, duration, requestJson, sleep, type Endpoint } from "./http.js";
import { Failed, HandOff, JobAborted, Release, Running, type AbortKind } from "./outcomes.js";
import type { ClaimedLease, FromLeaseThread, JobOutput, LeaseThreadConfig, ToLeaseThread } from "./protocol.js";
import { encodeDetails, encodeProgress, encodeReport, type EncodedReport } from "./report.js";
import { jsonText, type CommandProgress, type CommandState, type JsonValue } from "./types.js";

/** What {@link Job.report} takes: progress and/or a checkpoint. */
export interface JobReport {
  /** Work in progress: `fraction` (0 to 1) and/or `message` (at most 1024 bytes of UTF-8). */
  progress?: CommandProgress;
  /**
   * A checkpoint: any JSON value but `null` (or a {@link RawJson}), at most 64 KiB serialised;
   * handed to the next delivery as {@link Job.details}.
   */
  details?: unknown;
}

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
  /**
   * The command's output stream, opened for this delivery (see {@link JobOutput}: append to it
   * with its producer headers), when the command has one; else `undefined`.
   */
  output: JobOutput | undefined;
  /**
   * The last checkpoint reported for this command before this delivery (by an earlier delivery,
   * on this worker or another: one that crashed, was taken over, released, retried after an
   * error, or returned {@link Running}), parsed (`command.details`); `undefined` when there is
   * none. Resume from it instead of starting over. (It does not change when this delivery
   * reports a checkpoint.)
   */
  details: JsonValue | undefined;
  /**
   * Reports work in progress and/or a checkpoint (see {@link Job.progress} and
   * {@link Job.checkpoint}); `report({ progress, details })` is both in one.
   *
   * @throws {TypeError} for a report the server would refuse (see the two methods), checked
   *   here so that it never reaches the renewal, which carries every lease of the worker.
   */
  report(report: JobReport): void;
  /**
   * Reports work in progress: written into the command's state (`progress`, shown by
   * `GET /v1/commands/{id}` and kept in the final state) with the lease's next renewal, at most
   * `leaseTimeoutMs / 3` from now (the renewal interval). Only the latest report of each kind
   * goes out: a newer progress replaces an unsent one whole (fraction and message together).
   * A report that has not been written when the handler ends is sent before the settlement.
   * Nothing is written once the lease is over (lost, cancelled, or the handler ended): then the
   * call does nothing.
   *
   * @param progress `fraction` from 0 to 1 and/or `message` (at most 1024 bytes of UTF-8).
   * @throws {TypeError} when neither is given, `fraction` is not a finite number from 0 to 1,
   *   `message` is not a string, is longer, or has a lone surrogate, or another field is given.
   */
  progress(progress: CommandProgress): void;
  /**
   * Records a checkpoint: `details` is written into the command's state (`details`) with the
   * lease's next renewal, as {@link Job.progress} is, and handed to the next delivery of the
   * command as {@link Job.details} (after a crash, a takeover, a release, a retried error or a
   * {@link Running} re-poll), so the work resumes where it was. Serialised now: changing the
   * object afterwards changes nothing. Only the latest unsent checkpoint goes out.
   *
   * @param details any JSON value but `null` (or {@link RawJson}, kept byte for byte), at most
   *   64 KiB serialised.
   * @throws {TypeError} when it is `undefined` or `null`, not representable as JSON (a BigInt,
   *   a cycle, a function), or larger.
   */
  checkpoint(details: unknown): void;
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
   * Called with problems the worker works around (a failed claim, renewal or settlement that is
   * retried, a settlement refused, a lease the server said was lost). Default: `console.warn`.
   * What it throws is ignored.
   */
  onError?: (error: Error, context: string) => void;
}

interface Running_ {
  job: Job;
  controller: AbortController;
  /** Set when the signal aborted. */
  aborted: AbortKind | undefined;
  /**
   * The server said the lease is over (a renewal answered `lost` or `gone`, or a settlement
   * `lease_lost`): never settle (again). Nothing else ends a lease: not renewals or
   * settlements failing in transit or with `5xx`, however long.
   */
  lost: boolean;
  /** A settle request with this job's settlement was sent (its renewals may cross it). */
  settleSent: boolean;
  /** Released at the end of the grace period: never settle again. */
  abandoned: boolean;
  /** The handler has ended: its settlement is being sent. */
  settling: boolean;
  /** The handler has ended (or the job was abandoned): reports are ignored from then on. */
  ended: boolean;
  /** A report was passed to the lease thread: flushed before settling. */
  reported: boolean;
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
  /** Given up after this (ms since epoch): `Infinity` but for releases and at the end of a shutdown. */
  giveUpAt: number;
  budgetMs: number;
  /**
   * An earlier try got no definite answer (no answer, `5xx`, an item's backend error): it may have
   * been applied, so a `lease_lost` now most likely means that it was.
   */
  uncertain: boolean;
  /** Finished (settled, refused, lost or given up): `finish` does nothing more. */
  finished: boolean;
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
/**
 * At shutdown, once the grace period is over, settlements still being retried (the server
 * unreachable or failing) get this much longer; so does a release. Then they are given up: the
 * worker is going away, and the command goes to another worker after the claim timeout.
 */
const SHUTDOWN_SETTLE_MS = 3_000;

/**
 * When a handler ends with a report not written yet, the settlement waits at most this long for
 * the renewal carrying it (it is normally one round trip).
 */
const FLUSH_WAIT_MS = 5_000;

/** One settlement's JSON text (`result` is already JSON text). */
function settleItem(lease: string, body: SettleBody): string {
  let text = `{"lease":${JSON.stringify(lease)}`;
  for (const [key, value] of Object.entries(body)) {
    text += `,${JSON.stringify(key)}:${key === "result" ? (value as string) : JSON.stringify(value)}`;
  }
  return text + "}";
}

/**
 * The process's Node options for the lease thread, but `--input-type` (a script run with
 * `node --input-type=module -e …`): a thread inherits it and then cannot load its own file.
 */
function leaseThreadExecArgv(): string[] {
  const out: string[] = [];
  const argv = process.execArgv;
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--input-type") i++; // and its value
    else if (!argv[i]!.startsWith("--input-type=")) out.push(argv[i]!);
  }
  return out;
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
 * the main thread keeps its lease) and settles the outcome. Only the server's answer ends a lease
 * (a renewal saying `lost` or `gone`, a settlement `lease_lost`): while renewals or settlements
 * fail in transit or with `5xx` (the server or its Redis unreachable or paused), handlers keep
 * running and both are retried until the server answers.
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
    const onError =
      options.onError ?? ((error, context) => console.warn(`[baton worker ${this.name}] ${context}: ${error.message}`));
    this.#onError = (error, context) => {
      try {
        onError(error, context);
      } catch {
        // A throwing onError must not break the worker's loops.
      }
    };
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
    const thread = new LeaseThread(new URL("./renewer.js", import.meta.url), { workerData: config, execArgv: leaseThreadExecArgv() });
    this.#thread = thread;
    this.#claimingStopped = new Promise((resolve) => (this.#onClaimingStopped = resolve));
    thread.on("message", (message: FromLeaseThread) => this.#onMessage(message));
    thread.on("error", (err) => {
      // The lease thread died (a bug): no lease can be renewed any more. Stop at once: running
      // handlers are aborted (`shutdown`) and released; settlements under way are still sent
      // (the server says whether the lease is still held).
      this.#fatal ??= new Error(`the lease thread failed: ${describe(err)}`, { cause: err });
      this.#onError(this.#fatal, "lease thread; stopping");
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
    let giveUp: NodeJS.Timeout | undefined;
    if (first === "grace") {
      // Settlements still being retried (the server unreachable or failing: they are retried
      // until a definite answer while the worker runs) get a last SHUTDOWN_SETTLE_MS.
      const deadline = Date.now() + SHUTDOWN_SETTLE_MS;
      for (const s of this.#live) s.giveUpAt = Math.min(s.giveUpAt, deadline);
      giveUp = setTimeout(() => this.#giveUpSettlements(), SHUTDOWN_SETTLE_MS);
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
    clearTimeout(giveUp);
    const thread = this.#thread;
    this.#thread = undefined;
    if (thread) {
      thread.unref();
      await thread.terminate();
    }
    for (const done of [...this.#flushing.values()]) done();
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
    if (!r.lost) {
      // Its last checkpoint first, for the worker that gets the command next (briefly: one
      // renewal round trip when the server answers).
      await this.#flush(r, 1_000);
      await this.#settle(r, { outcome: "release" }, SHUTDOWN_SETTLE_MS);
    }
    this.#post({ t: "remove", lease: r.job.lease });
  }

  #post(message: ToLeaseThread): void {
    this.#thread?.postMessage(message);
  }

  /** Flushes waiting for the lease thread's "flushed", by lease. */
  readonly #flushing = new Map<string, () => void>();

  /**
   * Has the lease thread send `r`'s report not written yet (if any) now, with a renewal;
   * resolves when that renewal is answered or failed, after at most `maxMs`.
   */
  #flush(r: Running_, maxMs = FLUSH_WAIT_MS): Promise<void> {
    if (!r.reported || r.lost || !this.#thread) return Promise.resolve();
    const lease = r.job.lease;
    return new Promise<void>((resolve) => {
      const previous = this.#flushing.get(lease);
      const done = () => {
        clearTimeout(timer);
        if (this.#flushing.get(lease) === done) this.#flushing.delete(lease);
        previous?.();
        resolve();
      };
      const timer = setTimeout(done, maxMs);
      this.#flushing.set(lease, done);
      this.#post({ t: "flush", lease });
    });
  }

  /** A report of `r`'s handler: checked (throws), then passed to the lease thread. */
  #report(r: Running_, report: EncodedReport): void {
    if (r.ended || r.lost || r.abandoned || !this.#thread) return;
    r.reported = true;
    this.#post({ t: "report", lease: r.job.lease, ...report });
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
        if (r) this.#markLost(r, message.why);
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
      case "flushed":
        this.#flushing.get(message.lease)?.();
        break;
    }
  }

  /** A renewal answered `lost` or `gone`: the lease is over, said the server. */
  #markLost(r: Running_, why: "lost" | "gone"): void {
    if (r.lost) return;
    r.lost = true;
    if (r.abandoned) return;
    if (r.settling) {
      // A settlement still being sent or retried stops: the lease is not held any more either
      // way. A renewal that crossed this worker's own settlement (or an earlier try of it whose
      // answer was lost) says `gone`: expected, not a loss.
      if (why === "gone" && r.settleSent) return;
      this.#onError(
        new Error(`command ${r.job.id}: lease lost (renewal said ${why}) before its settlement got through; not settling it`),
        "lease",
      );
      return;
    }
    this.#abort(r, "lease_lost", `the lease of command ${r.job.id} was lost (renewal said ${why})`);
    this.#onError(new Error(`command ${r.job.id}: lease lost (renewal said ${why}); not settling it`), "lease");
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
    // (Reports are checked in the handler's call, so that a bad one throws there.)
    const report = (encoded: EncodedReport) => this.#report(r, encoded);
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
      output: lease.output,
      details: lease.command.details,
      report: (value) => report(encodeReport(value, "job.report")),
      progress: (value) => report({ progress: encodeProgress(value, "job.progress") }),
      checkpoint: (value) => {
        if (value === undefined) throw new TypeError("job.checkpoint: details are required (any JSON value but null)");
        report({ details: encodeDetails(value, "job.checkpoint") });
      },
    };
    const r: Running_ = {
      job,
      controller: new AbortController(),
      aborted: undefined,
      lost: false,
      settleSent: false,
      abandoned: false,
      settling: false,
      ended: false,
      reported: false,
      done: Promise.resolve(),
      release: undefined,
    };
    this.#jobs.set(lease.lease, r);
    if (this.#state !== "running") {
      // Claimed while stopping: hand it back unrun.
      r.abandoned = true;
      r.release = r.done = this.#settle(r, { outcome: "release" }, SHUTDOWN_SETTLE_MS).finally(() => this.#finishJob(r));
      return;
    }
    // (A job released at shutdown is finished once its release is: until then its lease is
    // renewed, its last report can go out first, and stop() waits for it.)
    r.done = this.#runJob(r).finally(() => (r.abandoned && r.release ? r.release.finally(() => this.#finishJob(r)) : this.#finishJob(r)));
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
    r.ended = true;
    if (r.lost || r.abandoned) return;
    if (r.aborted === "cancelled") body = { outcome: "cancelled" };
    r.settling = true;
    // The handler's last report first (a final progress, or the checkpoint a retry or a
    // check_status call resumes from): it goes with a renewal, which must come before the
    // settlement ends the lease.
    if (r.aborted !== "cancelled") await this.#flush(r);
    if (r.lost || r.abandoned) return;
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
   * Only a definite answer ends a settlement: failures that say nothing about it (no answer, a
   * timeout, `408`/`429`/`5xx`, an item's backend error) are retried with backoff (100 ms
   * doubling to 5 s) until one comes, the lease renewed meanwhile; only a release (`budgetMs`)
   * and, at shutdown, what is left once the grace period is over (SHUTDOWN_SETTLE_MS) are given
   * up. An item's `lease_lost` ends it: the lease was lost (taken over after a silence, or past
   * max_processing_time), told to `onError`; or, after a try whose answer never came, that try
   * was applied. A renewal saying `lost`/`gone` meanwhile ends it too. A body the server refuses
   * (`400`) is replaced: a hand-off to a queue the server does not have (or to the command's
   * own) by `failed` naming the queue, a refused result (`400`/`413`) or another refused
   * outcome by `error`.
   */
  #settle(r: Running_, body: SettleBody, budgetMs = Infinity): Promise<void> {
    return new Promise<void>((resolve) => {
      const s: Settlement = {
        r,
        body,
        item: settleItem(r.job.lease, body),
        giveUpAt: Date.now() + budgetMs,
        budgetMs,
        uncertain: false,
        finished: false,
        backoff: 100,
        alone: false,
        finish: () => {
          if (s.finished) return;
          s.finished = true;
          this.#live.delete(s);
          resolve();
        },
      };
      this.#live.add(s);
      this.#ready.push(s);
      this.#schedulePump();
    });
  }

  /** Settlements not finished yet (ready, in flight, or waiting to be retried). */
  readonly #live = new Set<Settlement>();
  /** One per settle request in flight: aborted when the shutdown gives them up. */
  readonly #settleRequests = new Set<AbortController>();

  /** The shutdown's last SHUTDOWN_SETTLE_MS are over: give up what is still being settled. */
  #giveUpSettlements(): void {
    for (const s of [...this.#live]) {
      this.#onError(
        new Error("the worker is stopping"),
        `settle ${s.body.outcome} of command ${s.r.job.id}: giving up (no definite answer from the server; the command goes to another worker after the claim timeout)`,
      );
      s.finish();
    }
    for (const c of this.#settleRequests) c.abort(new Error("given up at shutdown"));
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
      if (s.r.lost || s.finished) {
        // Not ours any more (or the renewal crossed our own settlement), or given up: nothing to send.
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

  /**
   * Back in line now (at the front), or after `delay` ms (cut to the earliest give-up time):
   * those past their give-up time are given up.
   */
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
      if (s.finished) continue;
      if (now >= s.giveUpAt) {
        this.#onError(
          err ?? new Error("settle failed"),
          `settle ${s.body.outcome} of command ${s.r.job.id}: giving up ${
            s.body.outcome === "release" ? `after ${s.budgetMs} ms` : "(the worker is stopping)"
          } (the command goes to another worker after the claim timeout)`,
        );
        s.finish();
      } else keep.push(s);
    }
    if (keep.length === 0) return;
    const wait = Math.max(0, Math.min(delay, ...keep.map((s) => s.giveUpAt - now)));
    if (err) {
      const what = keep.length === 1 ? `settle ${keep[0]!.body.outcome} of command ${keep[0]!.r.job.id}` : `settle of ${keep.length} commands`;
      this.#onError(err, `${what} (retrying in ${Math.round(wait)} ms)`);
    }
    // (Unref'd: while the worker runs, its lease thread keeps the process alive.)
    setTimeout(() => {
      this.#ready.push(...keep);
      this.#schedulePump();
    }, wait).unref();
  }

  async #sendSettlements(batch: Settlement[]): Promise<void> {
    let answers: unknown;
    const abort = new AbortController();
    this.#settleRequests.add(abort);
    for (const s of batch) s.r.settleSent = true;
    try {
      const res = await requestJson(
        this.#endpoint,
        "POST",
        `/v1/queues/${encodeURIComponent(this.#queue)}/workers/${encodeURIComponent(this.name)}/settle`,
        {
          body: `{"settlements":[${batch.map((s) => s.item).join(",")}]}`,
          // (A release's short budget bounds its request too.)
          timeoutMs: Math.min(30_000, Math.max(1_000, Math.min(...batch.map((s) => s.giveUpAt)) - Date.now())),
          signal: abort.signal,
        },
      );
      answers = (res.body as { settlements?: unknown } | null)?.settlements;
    } catch (err) {
      if (abort.signal.aborted) {
        // Given up at the end of a shutdown (#giveUpSettlements).
        for (const s of batch) s.finish();
        return;
      }
      if (!(err instanceof BatonError)) throw err;
      if (err.transient || err.status >= 500) {
        // No definite answer: the request may or may not have been applied. Retried (until a
        // definite answer; the lease is renewed meanwhile).
        for (const s of batch) s.uncertain = true;
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
    } finally {
      this.#settleRequests.delete(abort);
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
      if (s.finished) return; // given up meanwhile (shutdown)
      if (a !== null && typeof a === "object" && a.error === "lease_lost") {
        // Definite: the lease is not this worker's (taken over after a silence, or past
        // max_processing_time), and nothing was written. Unless an earlier try got no answer:
        // then that try was most likely applied (the server answers a repeated settle so).
        if (!s.uncertain && !s.r.lost && s.body.outcome !== "release") {
          this.#onError(
            new BatonError(409, "lease_lost", a.message ?? "lease lost"),
            `command ${s.r.job.id}: lease lost before its settlement (${s.body.outcome}) got through; the outcome was not written`,
          );
        }
        s.r.lost = true;
        s.finish();
        return;
      }
      if (a === null || typeof a !== "object" || "applied" in a || typeof a.error !== "string") {
        s.finish(); // settled
        return;
      }
      // A backend failure for this one (it may have been applied): retry it.
      s.uncertain = true;
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
