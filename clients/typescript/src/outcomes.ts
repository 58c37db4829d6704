/**
 * What a handler returns or throws to choose a command's outcome (docs/workers.md, "Settle").
 *
 * | handler does | outcome | command |
 * | --- | --- | --- |
 * | returns a value `v` (or {@link RawJson}) | `succeeded`, `result: v` (`undefined` → `null`) | `SUCCEEDED` |
 * | throws (or returns) `new Failed(msg)` | `failed`, `error: msg` | `FAILED`, not retried |
 * | throws anything else | `error`, `error: message` | retried with the queue's backoff, then `FAILED` |
 * | returns `new Running({ nextCheckMs })` | `running` | `RUNNING`; a `check_status` call comes after `nextCheckMs` |
 * | returns `new HandOff(queue)` | `handed_off` | `RUNNING` on `queue`, whose worker gets `check_status` calls |
 * | returns `new Release()` | `release` | handed back unrun: another worker gets it after the claim timeout |
 *
 * @packageDocumentation
 */

/** Throw (or return) to fail the command for good: `FAILED` with `message`, no retry. */
export class Failed extends Error {
  constructor(message: string) {
    super(message);
    this.name = "Failed";
  }
}

/** Return to say the work goes on elsewhere: the command is `RUNNING` and polled with `check_status` calls. */
export class Running {
  /** Milliseconds until the `check_status` call; undefined: the queue's `check_status_interval`. */
  readonly nextCheckMs: number | undefined;
  constructor(options: { nextCheckMs?: number } = {}) {
    if (options.nextCheckMs !== undefined && !(options.nextCheckMs >= 0)) {
      throw new RangeError("Running: nextCheckMs must be >= 0");
    }
    this.nextCheckMs = options.nextCheckMs;
  }
}

/** Return to hand the command to another queue: `RUNNING` there; that queue's worker gets `check_status` calls. */
export class HandOff {
  /** A queue configured on the server. */
  readonly queue: string;
  constructor(queue: string) {
    if (typeof queue !== "string" || queue === "") throw new TypeError("HandOff: a queue name is required");
    this.queue = queue;
  }
}

/** Return to hand the command back unrun: another worker gets it after the claim timeout (a delivery, not an attempt). */
export class Release {}

/** Why a handler's signal aborted: `signal.reason` is one of these. */
export type AbortKind = "cancelled" | "lease_lost" | "shutdown";

/**
 * `signal.reason` of an aborted handler. `kind`:
 * - `"cancelled"`: the command was cancelled (`POST /v1/commands/{id}/cancel`); the worker settles
 *   `cancelled` when the handler ends, whatever it returns.
 * - `"lease_lost"`: the server said the lease is no longer this worker's (a renewal answered
 *   `lost`: another worker took the command over after this one was silent for the claim timeout,
 *   or it ran past `max_processing_time`; or `gone`); nothing the handler returns is settled.
 *   Renewals that fail (no answer, a timeout, `5xx`) never abort a handler, however long: the
 *   worker keeps renewing, and settles when the handler ends.
 * - `"shutdown"`: {@link Worker.stop}'s grace period ended; the lease is released (another worker
 *   runs the command) and nothing the handler returns is settled.
 */
export class JobAborted extends Error {
  readonly kind: AbortKind;
  constructor(kind: AbortKind, message: string) {
    super(message);
    this.name = "AbortError";
    this.kind = kind;
  }
}
