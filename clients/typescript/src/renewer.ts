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
import { parentPort, workerData } from "node:worker_threads";
import { BatonError } from "./errors.js";
import { describe, duration, requestJson, sleep, type Endpoint } from "./http.js";
import type { ClaimedLease, FromLeaseThread, LeaseThreadConfig, ToLeaseThread } from "./protocol.js";

interface Held {
  /** Still renewed (false once the server said lost or gone; the slot stays taken until "remove"). */
  renew: boolean;
  timeoutMs: number;
  cancelledSent: boolean;
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

const RENEW_BATCH = 1000;
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
      wakeClaim();
      break;
    case "stop-claiming":
      claiming = false;
      claimAbort?.abort();
      wakeClaim();
      break;
  }
});

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
      });
    }
    post({ t: "leases", leases });
    wakeRenew();
  }
  post({ t: "claiming-stopped" });
}

/**
 * Renews every lease still renewed; false when a request failed (no answer, or an error answer):
 * its leases are kept as they are, to be renewed again soon.
 */
async function renewOnce(interval: number, retryMs: number): Promise<boolean> {
  const leases = [...held].filter(([, h]) => h.renew).map(([lease]) => lease);
  if (leases.length === 0) return true;
  let ok = true;
  for (let i = 0; i < leases.length; i += RENEW_BATCH) {
    const batch = leases.slice(i, i + RENEW_BATCH);
    try {
      const res = await requestJson(endpoint, "POST", `${base}/renew`, {
        body: JSON.stringify({ leases: batch }),
        timeoutMs: Math.max(2 * interval, 500),
      });
      const answers = (res.body as { leases?: { lease: string; state: string; cancelled: boolean }[] }).leases ?? [];
      for (const answer of answers) {
        const h = held.get(answer.lease);
        if (!h || !h.renew) continue;
        if (answer.state === "held") {
          if (answer.cancelled && !h.cancelledSent) {
            h.cancelledSent = true;
            post({ t: "cancelled", lease: answer.lease });
          }
        } else if (answer.state === "lost" || answer.state === "gone") {
          h.renew = false;
          post({ t: "lost", lease: answer.lease, why: answer.state });
        }
        // (Another state, from a newer server: not a definite end; renewed again.)
      }
    } catch (err) {
      // No answer, or an error answer: nothing is known about these leases. They stay held.
      ok = false;
      post({
        t: "warn",
        context: "renew",
        message: `${describe(err)}; the ${batch.length === 1 ? "lease is" : `${batch.length} leases are`} kept (only the server's answer ends a lease), renewing again in ${Math.round(retryMs)} ms`,
      });
    }
  }
  return ok;
}

async function renewLoop(): Promise<void> {
  let retrying = false;
  for (;;) {
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
    const retryMs = Math.max(interval / 3, MIN_RETRY_MS);
    await sleep(retrying ? retryMs : interval);
    retrying = !(await renewOnce(interval, retryMs));
  }
}

void claimLoop();
void renewLoop();
