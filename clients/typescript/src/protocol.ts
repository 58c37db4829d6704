// Messages between a Worker (main thread) and its lease thread (renewer.ts). Internal.
import type { CommandState } from "./types.js";

/** One lease of a claim answer, as the server sends it. */
export interface ClaimedLease {
  lease: string;
  call: "execute" | "check_status";
  command: CommandState;
  deliveries: number;
  lease_timeout_ms: number;
  output?: JobOutput;
}

/**
 * A claimed command's output stream, opened for this delivery (the lease's `output`). Append
 * with `POST <server><url>`, `Content-Type: <content_type>`, `Producer-Id: <producer_id>`,
 * `Producer-Epoch: <producer_epoch>` and `Producer-Seq` 0, 1, 2… (idempotent appends; the epoch
 * fences the writer of an earlier delivery). Do not close it: it ends with the command.
 */
export interface JobOutput {
  stream: string;
  url: string;
  content_type: string;
  /** `"command"`; absent when the stream had already ended at the claim. */
  producer_id?: string;
  /** This delivery's producer epoch; absent as `producer_id`. */
  producer_epoch?: number;
}

/** `workerData` of the lease thread. */
export interface LeaseThreadConfig {
  url: string;
  token: string | undefined;
  queue: string;
  name: string;
  concurrency: number;
  claimWaitMs: number;
}

/** Main thread → lease thread. */
export type ToLeaseThread =
  /** The handler of this lease ended and its settlement is done (or given up): stop renewing it, free its slot. */
  | { t: "remove"; lease: string }
  /** Claim no more (an in-flight claim is abandoned). */
  | { t: "stop-claiming" }
  /**
   * The handler reported progress and/or a checkpoint (JSON text, checked): merged into what
   * this lease has not had written yet (latest wins per part) and sent with its next renewal.
   */
  | { t: "report"; lease: string; progress?: string; details?: string }
  /**
   * The handler ended: send what this lease has not had written yet now (a renewal of every
   * lease at once) and answer "flushed" (at once when there is nothing to send).
   */
  | { t: "flush"; lease: string };

/** Lease thread → main thread. */
export type FromLeaseThread =
  /** Newly claimed leases, already renewed from now on. */
  | { t: "leases"; leases: ClaimedLease[] }
  /** A renewal said `cancelled: true` (sent once per lease). */
  | { t: "cancelled"; lease: string }
  /**
   * A renewal's answer said the lease is not held any more (`lost`: another worker owns it, or it
   * ran past max_processing_time; `gone`: settled, or unknown to the server). No longer renewed.
   * Only the server's answer ends a lease: renewals that fail in transit or with an error answer
   * never do.
   */
  | { t: "lost"; lease: string; why: "lost" | "gone" }
  /** A claim failed for good (e.g. 404 unknown_queue, 401, 403): the worker cannot work. */
  | { t: "fatal"; status: number; code: string; message: string }
  /** A transient problem (a claim or renewal that failed and is retried), for the worker's `onError`. */
  | { t: "warn"; context: string; message: string }
  /** The claim loop ended (after stop-claiming or fatal). */
  | { t: "claiming-stopped" }
  /** Answer to "flush": the renewal carrying the lease's report was answered or failed (or there was nothing to send). */
  | { t: "flushed"; lease: string };
