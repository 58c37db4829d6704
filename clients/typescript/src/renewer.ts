// The lease thread of a Worker: a `worker_threads` Worker with its own event loop and its own
// fetch. It claims commands (so a lease is renewed from the moment the server hands it out, even
// while the main thread is blocked) and renews every held lease in one `renew` request every
// `lease_timeout_ms / 3`. It tells the main thread about new leases, cancellations and lost leases;
// the main thread runs the handlers and settles.
//
// Only the server's answer ends a lease: a renewal item saying `lost` or `gone`. A renewal that
// gets no answer (connection refused or reset, a timeout) or an error answer (`5xx`, `429`, …)
// says nothing about the leases: they are kept and renewed again soon, however long that lasts
// (the server, not this thread, decides when a silent worker's lease is over; a renewal that
// comes late is `held` unless another worker took the command meanwhile).
//
// Progress and checkpoints (docs/workers.md, "Progress and checkpoints") ride on the renewals:
// the main thread posts each report (already checked, as JSON text); the latest of each lease,
// progress and details merged (latest wins per part), goes with the lease's next renewal as
// `{"lease", "progress"?, "details"?}`, and is done once that renewal answers `held` (a part
// reported again meanwhile is kept for the next one). A renewal that fails keeps it for the next
// try. When a handler ends, "flush" renews at once so that its last report is written before the
// settlement.
import { parentPort, workerData } from "node:worker_threads";
import { BatonError } from "./errors.js";
import { describe, duration, requestJson, type Endpoint } from "./http.js";
import type { ClaimedLease, FromLeaseThread, LeaseThreadConfig, ToLeaseThread } from "./protocol.js";

interface Held {
  /** Still renewed (false once the server said lost or gone; the slot stays taken until "remove"). */
  renew: boolean;
  timeoutMs: number;
  cancelledSent: boolean;
  /** The command's id (for messages). */
  id: string;
  /** Progress reported and not written yet (JSON text). */
  progress: string | undefined;
  /** Details (a checkpoint) reported and not written yet (JSON text). */
  details: string | undefined;
}

/** What one renewal carried for a lease. */
interface Sent {
  progress: string | undefined;
  details: string | undefined;
}

const config = workerData as LeaseThreadConfig;
const port = parentPort!;
const endpoint: Endpoint = { url: config.url, token: config.token };
const base = `/v1/queues/${encodeURIComponent(config.queue)}/workers/${encodeURIComponent(config.name)}`;
const held = new Map<string, Held>();
let claiming = true;
let claimAbort: AbortController | undefined;
/** Wakes the claim loop (a slot freed, or stop) and the renew loop (a lease added). */
let wakeClaim: () => void = () => {};
let wakeRenew: () => void = () => {};
/** Wakes the renew loop for a renewal now (a "flush"). */
let wakeFlush: () => void = () => {};
/** Leases whose handler ended with a report not written yet: renewed at once, then "flushed". */
const flushWanted = new Set<string>();

const RENEW_BATCH = 1000;
/**
 * A renew request's body stays under this many UTF-16 units of JSON (at most 3 bytes of UTF-8
 * each: well under the server's `--max-command-body`, 1 MiB by default), reports included.
 */
const RENEW_BATCH_CHARS = 256 * 1024;
const DEFAULT_INTERVAL_MS = 10_000;
/** After a failed renewal, the next one comes after a third of the interval, at least this. */
const MIN_RETRY_MS = 100;

function post(message: FromLeaseThread): void {
  port.postMessage(message);
}

port.on("message", (message: ToLeaseThread) => {
  switch (message.t) {
    case "remove":
      held.delete(message.lease);
      if (flushWanted.delete(message.lease)) post({ t: "flushed", lease: message.lease });
      wakeClaim();
      break;
    case "report": {
      const h = held.get(message.lease);
      if (!h || !h.renew) break; // the lease is over: nothing can be written any more
      if (message.progress !== undefined) h.progress = message.progress;
      if (message.details !== undefined) h.details = message.details;
      break;
    }
    case "flush": {
      const h = held.get(message.lease);
      if (h && h.renew && hasReport(h)) {
        flushWanted.add(message.lease);
        wakeFlush();
      } else post({ t: "flushed", lease: message.lease });
      break;
    }
    case "stop-claiming":
      claiming = false;
      claimAbort?.abort();
      wakeClaim();
      break;
  }
});

function hasReport(h: Held): boolean {
  return h.progress !== undefined || h.details !== undefined;
}

function waitFor(set: (wake: () => void) => void, ms?: number): Promise<void> {
  return new Promise((resolve) => {
    let timer: NodeJS.Timeout | undefined;
    const done = () => {
      if (timer) clearTimeout(timer);
      set(() => {});
      resolve();
    };
    set(done);
    if (ms !== undefined) timer = setTimeout(done, Math.max(0, ms));
  });
}

async function claimLoop(): Promise<void> {
  let backoff = 0;
  // A wait beyond the server's --long-poll-timeout is cut to it by the server.
  const claimWaitMs = config.claimWaitMs;
  while (claiming) {
    const free = config.concurrency - held.size;
    if (free <= 0) {
      await waitFor((w) => (wakeClaim = w));
      continue;
    }
    const abort = new AbortController();
    claimAbort = abort;
    let leases: ClaimedLease[];
    try {
      const res = await requestJson(endpoint, "POST", `${base}/claim`, {
        body: JSON.stringify({ max: Math.min(free, 100), wait: duration(claimWaitMs) }),
        signal: abort.signal,
        timeoutMs: claimWaitMs + 30_000,
      });
      leases = ((res.body as { leases?: ClaimedLease[] }).leases ?? []) as ClaimedLease[];
      backoff = 0;
    } catch (err) {
      if (!claiming) break;
      if (err instanceof BatonError && !err.transient && err.status !== 500) {
        post({ t: "fatal", status: err.status, code: err.code, message: err.message });
        break;
      }
      backoff = Math.min(backoff === 0 ? 250 : backoff * 2, 10_000);
      const delay = err instanceof BatonError && err.retryAfterMs !== undefined ? err.retryAfterMs : backoff;
      post({ t: "warn", context: "claim", message: `${describe(err)}; retrying in ${delay} ms` });
      await waitFor((w) => (wakeClaim = w), delay);
      continue;
    } finally {
      claimAbort = undefined;
    }
    if (leases.length === 0) continue;
    for (const lease of leases) {
      held.set(lease.lease, {
        renew: true,
        timeoutMs: lease.lease_timeout_ms,
        cancelledSent: false,
        id: lease.command?.id ?? "?",
        progress: undefined,
        details: undefined,
      });
    }
    post({ t: "leases", leases });
    wakeRenew();
  }
  post({ t: "claiming-stopped" });
}

/** A renewal item: the lease string, or `{"lease", "progress"?, "details"?}` with its report. */
function renewItem(lease: string, h: Held | undefined): string {
  if (!h || !hasReport(h)) return JSON.stringify(lease);
  let text = `{"lease":${JSON.stringify(lease)}`;
  if (h.progress !== undefined) text += `,"progress":${h.progress}`;
  if (h.details !== undefined) text += `,"details":${h.details}`;
  return text + "}";
}

/**
 * Renews every lease still renewed; false when a request failed (no answer, or an error answer):
 * its leases are kept as they are (reports too), to be renewed again soon.
 */
async function renewOnce(interval: number, retryMs: number): Promise<boolean> {
  const leases = [...held].filter(([, h]) => h.renew).map(([lease]) => lease);
  let ok = true;
  let i = 0;
  while (i < leases.length) {
    const batch: string[] = [];
    let chars = 0;
    while (i < leases.length && batch.length < RENEW_BATCH) {
      const lease = leases[i]!;
      const h = held.get(lease);
      const size = lease.length + 4 + (h ? (h.progress?.length ?? 0) + (h.details?.length ?? 0) + 30 : 0);
      if (batch.length > 0 && chars + size > RENEW_BATCH_CHARS) break;
      batch.push(lease);
      chars += size;
      i++;
    }
    if (!(await renewBatch(batch, interval, retryMs))) ok = false;
  }
  return ok;
}

/** The item a `400` names (`"index"`, or `leases[i]: …` in the message). */
function refusedIndex(err: BatonError): number | undefined {
  const index = (err.body as { index?: unknown } | null)?.index;
  if (typeof index === "number" && Number.isInteger(index)) return index;
  const m = /^leases\[(\d+)\]/.exec(err.message);
  return m ? Number(m[1]) : undefined;
}

async function renewBatch(batch: string[], interval: number, retryMs: number): Promise<boolean> {
  for (;;) {
    const sent = new Map<string, Sent>();
    const items = batch.map((lease) => {
      const h = held.get(lease);
      if (h && h.renew && hasReport(h)) sent.set(lease, { progress: h.progress, details: h.details });
      return renewItem(lease, h && h.renew ? h : undefined);
    });
    try {
      const res = await requestJson(endpoint, "POST", `${base}/renew`, {
        body: `{"leases":[${items.join(",")}]}`,
        timeoutMs: Math.max(2 * interval, 500),
      });
      const answers = (res.body as { leases?: { lease: string; state: string; cancelled: boolean }[] }).leases ?? [];
      for (const answer of answers) {
        const h = held.get(answer.lease);
        if (!h || !h.renew) continue;
        if (answer.state === "held") {
          // Its report is written (or, cancelled, never will be): done, but for a part reported
          // again since.
          const s = sent.get(answer.lease);
          if (s && h.progress === s.progress) h.progress = undefined;
          if (s && h.details === s.details) h.details = undefined;
          if (answer.cancelled && !h.cancelledSent) {
            h.cancelledSent = true;
            post({ t: "cancelled", lease: answer.lease });
          }
        } else if (answer.state === "lost" || answer.state === "gone") {
          h.renew = false;
          h.progress = h.details = undefined;
          post({ t: "lost", lease: answer.lease, why: answer.state });
        }
        // (Another state, from a newer server: not a definite end; renewed again, report kept.)
      }
      return true;
    } catch (err) {
      if (err instanceof BatonError && (err.status === 400 || err.status === 413) && sent.size > 0) {
        // Refused whole, nothing renewed. Reports are checked when made, so this is a server
        // that disagrees with those checks (or has a smaller body limit): drop the report it
        // names (all of this request's when it names none) and renew again at once, so that
        // the leases do not pay for it. Ends: every try has one report fewer.
        const index = refusedIndex(err);
        const named = index !== undefined ? batch[index] : undefined;
        const dropped = named !== undefined && sent.has(named) ? [named] : [...sent.keys()];
        for (const lease of dropped) {
          const h = held.get(lease);
          if (h) h.progress = h.details = undefined;
        }
        const ids = dropped.map((lease) => held.get(lease)?.id ?? "?").join(", ");
        post({
          t: "warn",
          context: "renew",
          message: `${describe(err)}; dropped the progress/details report of command ${ids}, renewing without it`,
        });
        continue;
      }
      // No answer, or an error answer: nothing is known about these leases. They stay held.
      post({
        t: "warn",
        context: "renew",
        message: `${describe(err)}; the ${batch.length === 1 ? "lease is" : `${batch.length} leases are`} kept (only the server's answer ends a lease), renewing again in ${Math.round(retryMs)} ms`,
      });
      return false;
    }
  }
}

async function renewLoop(): Promise<void> {
  let retrying = false;
  for (;;) {
    // (A lease lost or written meanwhile has nothing more to send.)
    for (const lease of flushWanted) {
      const h = held.get(lease);
      if (!h || !h.renew || !hasReport(h)) {
        flushWanted.delete(lease);
        post({ t: "flushed", lease });
      }
    }
    let interval = DEFAULT_INTERVAL_MS;
    let any = false;
    for (const h of held.values()) {
      if (!h.renew) continue;
      any = true;
      interval = Math.min(interval, h.timeoutMs / 3);
    }
    if (!any) {
      retrying = false;
      await waitFor((w) => (wakeRenew = w));
      continue;
    }
    // After a failure, try again sooner: the server may be back before the claim timeout passes.
    // A "flush" renews at once.
    const retryMs = Math.max(interval / 3, MIN_RETRY_MS);
    if (flushWanted.size === 0) await waitFor((w) => (wakeFlush = w), retrying ? retryMs : interval);
    const flushing = [...flushWanted];
    flushWanted.clear();
    retrying = !(await renewOnce(interval, retryMs));
    for (const lease of flushing) post({ t: "flushed", lease });
  }
}

void claimLoop();
void renewLoop();
