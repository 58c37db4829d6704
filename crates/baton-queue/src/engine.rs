//! The lease thread of one consumer: an OS thread with its own single-threaded tokio runtime and
//! its own backend connections (opened on it), that does everything a lease depends on, so that
//! no handler behaviour (blocking threads, spinning the CPU, panicking, starving the
//! application's runtime) can delay it:
//!
//! * **acquire** (for Redis; in memory, where an entry is assigned and registered in one
//!   synchronous step, it runs on the application's runtime): reads new entries through the queue's gates (the gated read, see [`ConsumerBackend::read_new`](crate::backend::ConsumerBackend::read_new): on Redis `read.lua`, then `XREAD BLOCK` when nothing is new; COUNT = free concurrency slots) and
//!   reclaims idle ones; each entry is registered in the lease registry the moment its reply is
//!   parsed, and its handler task is started on the application's runtime under the same lock. Reclaimed entries come
//!   first: when a tick finds reclaimable entries it could not take (no free slot), the next
//!   freed slot goes to a reclaim before any read.
//! * **redeliver**: short `RetryAfter`s are kept as waiting leases (renewed, no slot taken) and
//!   started again when due, from a local timer: no Redis call per re-poll.
//! * **heartbeat**: every `heartbeat_interval`, ONE backend call renews every held lease,
//!   writes the consumer's liveness record and hands back orphans; lost leases are signalled.
//!   Reaping of dead consumers runs on the same task.
//! * **settle**: acks and retries from handlers, batched (one call per batch, a few batches in
//!   flight); a transient failure is retried until the backend answers, so a reported failure
//!   is a real refusal and a success really applied. The lease keeps renewing meanwhile.
//!
//! Stopping: acquisition stops first (the read in flight completes; what it returned runs within
//! the drain budget, or without one is requeued at the stream's tail at once), waiting leases are handed back with the time they had left, handlers finish
//! within the drain budget, then the heartbeat stops; settlements of handlers that finish later
//! are still applied for one claim timeout; then the consumer leaves the group if it owns
//! nothing, and the thread ends, closing its connections.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::{ConsumerSpec, Owned, QueueBackend, RawDelivery, Settle, SettleOp};
use crate::lease::{SettleReq, Shared, Starter};
use crate::{ConsumerOptions, Decision, QueueError};

/// Settlements batched into one backend call, at most this many.
const SETTLE_BATCH: usize = 512;
/// Settlement batches in flight at once per consumer.
const SETTLE_PIPELINE: usize = 4;
/// Shortest gap between two promotions of due delayed entries.
const MIN_PROMOTE_GAP: Duration = Duration::from_millis(10);
/// How long before a waiting lease is due its slot is kept from reads: more than one Redis server
/// tick (100 ms at the default `hz 10`), by which a BLOCK may end after its timeout.
const NEAR: Duration = Duration::from_millis(120);

/// The handles `Consumer` keeps on its lease thread.
pub(crate) struct Control {
    /// Stop acquiring (drain, close, drop).
    pub stop_acquiring: CancellationToken,
    /// Cancelled by the thread once acquisition has stopped and waiting leases are handed back.
    pub acquiring_done: CancellationToken,
    /// Stop heartbeats, leave the group if nothing is owned, end the thread.
    pub finish: CancellationToken,
    /// End the thread now, as if the process died (abort).
    pub kill: CancellationToken,
    /// Cancelled by the thread when it has ended (its connections are closed).
    pub exited: CancellationToken,
}

type Ready = Result<Arc<Shared>, QueueError>;

/// Starts the lease thread of a consumer and waits until it has joined the group. `start` starts
/// a delivery's handler on the application's runtime (see [`Starter`]).
pub(crate) async fn start(
    backend: Arc<dyn QueueBackend>,
    spec: ConsumerSpec,
    options: ConsumerOptions,
    start: Starter,
) -> Result<(Arc<Shared>, Control), QueueError> {
    let control = Control {
        stop_acquiring: CancellationToken::new(),
        acquiring_done: CancellationToken::new(),
        finish: CancellationToken::new(),
        kill: CancellationToken::new(),
        exited: CancellationToken::new(),
    };
    let (ready_tx, ready_rx) = oneshot::channel::<Ready>();
    let app = tokio::runtime::Handle::current();
    let tokens = (
        control.stop_acquiring.clone(),
        control.acquiring_done.clone(),
        control.finish.clone(),
        control.kill.clone(),
        control.exited.clone(),
    );
    let name = format!("baton-lease-{}", spec.queue.chars().take(40).collect::<String>());
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            let (stop_acquiring, acquiring_done, finish, kill, exited) = tokens;
            match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => {
                    rt.block_on(run(
                        app,
                        backend,
                        spec,
                        options,
                        start,
                        ready_tx,
                        stop_acquiring,
                        acquiring_done,
                        finish,
                        kill,
                    ));
                    // Dropping the runtime ends every task of the thread and closes its connections.
                    drop(rt);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(QueueError::Unavailable(format!("cannot start the lease runtime: {e}"))));
                }
            }
            exited.cancel();
        })
        .map_err(|e| QueueError::Unavailable(format!("cannot spawn the lease thread: {e}")))?;
    let shared = ready_rx.await.unwrap_or(Err(QueueError::Closed))?;
    Ok((shared, control))
}

#[allow(clippy::too_many_arguments)]
async fn run(
    app: tokio::runtime::Handle,
    backend: Arc<dyn QueueBackend>,
    spec: ConsumerSpec,
    options: ConsumerOptions,
    start: Starter,
    ready: oneshot::Sender<Ready>,
    stop_acquiring: CancellationToken,
    acquiring_done: CancellationToken,
    finish: CancellationToken,
    kill: CancellationToken,
) {
    let cb = match backend.open_consumer(spec.clone()).await {
        Ok(cb) => cb,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let (settle_tx, settle_rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared::new(spec.queue.clone(), spec.consumer.clone(), cb, settle_tx, &options, start));
    if ready.send(Ok(shared.clone())).is_err() {
        return;
    }
    tokio::spawn(settler(shared.clone(), settle_rx));
    let beat = tokio::spawn(heartbeat(shared.clone(), options.clone(), finish.clone()));
    let acquisition = {
        let (shared, options, stop) = (shared.clone(), options.clone(), stop_acquiring.clone());
        async move {
            let redeliver = tokio::spawn(redeliverer(shared.clone(), stop.clone()));
            acquire(&shared, &options, &stop).await;
            let _ = redeliver.await;
            // Waiting leases go back to the backend, due when they would have been here.
            for (id, left) in shared.take_waiting() {
                if let Err(e) = shared.backend.retry_after(id, left, false, None).await {
                    tracing::warn!(queue = %shared.queue, message_id = %id, error = %e, "handing back a waiting lease failed; it fails over after claim_timeout");
                }
            }
        }
    };
    let work = async {
        if shared.backend.in_process() {
            // In memory an entry is assigned and registered in one synchronous step (no reply to
            // wait for), so acquisition runs beside the handlers, on the application's runtime,
            // and starts them without a thread hop; renewals and settlements stay here.
            let _ = app.spawn(acquisition).await;
        } else {
            acquisition.await;
        }
        acquiring_done.cancel();
        finish.cancelled().await;
        let _ = beat.await;
        shared.stop_renewing();
        // Handlers still running past the drain budget are no longer renewed, but what they
        // settle within one claim timeout (while their leases cannot have expired) is applied.
        let linger = Instant::now() + options.claim_timeout;
        loop {
            let changed = shared.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if shared.in_flight().is_empty() || tokio::time::timeout_at(linger, changed).await.is_err() {
                break;
            }
        }
        // Leaves now if it owns nothing; else it is marked stopped and leaves when a peer takes
        // its last entry.
        match shared.backend.leave().await {
            Ok(true) => tracing::info!(queue = %shared.queue, consumer = %shared.consumer, "consumer left the group"),
            Ok(false) => {
                tracing::info!(queue = %shared.queue, consumer = %shared.consumer, "consumer still owns entries; it leaves the group when they fail over")
            }
            Err(e) => {
                tracing::warn!(queue = %shared.queue, error = %e, "leaving the group failed; the consumer is reaped later")
            }
        }
    };
    tokio::select! {
        _ = work => {}
        _ = kill.cancelled() => {}
    }
    acquiring_done.cancel();
    shared.stop_renewing();
    shared.closed.store(true, Ordering::Release);
    tracing::info!(queue = %shared.queue, consumer = %shared.consumer, "consumer stopped");
}

fn min_instant(a: Instant, b: Option<Instant>) -> Instant {
    b.map_or(a, |b| a.min(b))
}

/// Records what a reclaim call found (flags, counters, metrics, logs).
fn note_reclaimed(sh: &Shared, r: &crate::backend::Reclaimed) {
    let q = &sh.queue;
    {
        let mut st = sh.reclaim_state.lock().unwrap_or_else(|p| p.into_inner());
        st.reclaim_first = r.more;
        // A backlog of due entries (more than one call promotes) is promoted call after call;
        // otherwise at least MIN_PROMOTE_GAP apart.
        let backlog = r.promoted > 0 && r.next_due.is_some_and(|d| d.is_zero());
        let gap = if backlog { Duration::ZERO } else { MIN_PROMOTE_GAP };
        // Added to the times learnt meanwhile (a read that ran while this call was in flight may
        // have scheduled a key's next rate head, which this reply predates).
        let next = r.next_due.map(|d| std::time::Instant::now() + d.max(gap));
        let earlier = next.is_some_and(|n| st.next_promote.add(n));
        drop(st);
        // A due time learnt here (an entry scheduled by another process) wakes the redeliverer,
        // which may be sleeping until a later one: it promotes on time, not at the next tick.
        if earlier {
            sh.waiting_added.notify_one();
        }
    }
    if r.dead_lettered > 0 {
        sh.counters.dead_lettered.fetch_add(r.dead_lettered, Ordering::Relaxed);
        metrics::counter!("baton_queue_dead_letters_total", "queue" => q.clone()).increment(r.dead_lettered);
        tracing::warn!(queue = %q, count = r.dead_lettered, "messages moved to dead letters after max_deliveries");
    }
    if r.deleted > 0 {
        tracing::debug!(queue = %q, count = r.deleted, "pending entries of deleted messages cleaned");
    }
    let n = r.deliveries.len() as u64;
    if n > 0 {
        sh.counters.reclaimed.fetch_add(n, Ordering::Relaxed);
        metrics::counter!("baton_queue_reclaims_total", "queue" => q.clone()).increment(n);
    }
}

/// Reads and reclaims; see the module docs.
async fn acquire(sh: &Arc<Shared>, options: &ConsumerOptions, stop: &CancellationToken) {
    let poll = options.poll();
    let q = sh.queue.clone();
    let mut next_tick = Instant::now();
    let mut failures: u32 = 0;
    let backoff =
        |failures: u32| Duration::from_millis(100u64 << failures.min(4)).min(poll.max(Duration::from_millis(100)));

    while !stop.is_cancelled() {
        let changed = sh.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let now = Instant::now();
        // Due waiting leases first (the redeliverer takes them while a read is in flight).
        let view = sh.acquire_view(now.into_std(), (now + NEAR).into_std());
        if view.due > 0 {
            sh.counters.delivered.fetch_add(view.due as u64, Ordering::Relaxed);
        }
        let free = view.free;
        let reclaim_first = sh.reclaim_state.lock().unwrap_or_else(|p| p.into_inner()).reclaim_first;
        if now >= next_tick || (reclaim_first && free > 0) {
            let tick = now >= next_tick;
            let acquired_at = std::time::Instant::now();
            sh.promise(free);
            match sh.backend.reclaim(free, &sh.stopped_ids()).await {
                Ok(r) => {
                    failures = 0;
                    if tick {
                        next_tick = Instant::now() + poll;
                    }
                    note_reclaimed(sh, &r);
                    accept(sh, options, r.deliveries, acquired_at, stop).await;
                }
                Err(e) => {
                    sh.promise(0);
                    failures += 1;
                    sh.reclaim_state.lock().unwrap_or_else(|p| p.into_inner()).reclaim_first = false;
                    next_tick = Instant::now() + backoff(failures);
                    tracing::warn!(queue = %q, error = %e, "reclaim failed");
                }
            }
            continue;
        }
        // Waiting leases due within NEAR keep their slots: the redeliverer starts them on time
        // whatever the read does. A read's BLOCK ends NEAR before the next later one is due, so
        // that it can be kept too (Redis ends a BLOCK up to one server tick late).
        let next_due = view.next_due.map(Instant::from_std);
        let count = free.saturating_sub(view.reserved);
        let later = next_due.filter(|t| *t > now + NEAR).map(|t| t - NEAR);
        let wake = min_instant(next_tick, later);
        let block = wake.saturating_duration_since(now);
        if count > 0 && block >= Duration::from_millis(1) {
            let acquired_at = std::time::Instant::now();
            sh.promise(count);
            // Never cancelled once sent: Redis may already have assigned the entries.
            let read = sh.backend.read_new(count, block).await;
            // Entries the read moved to the delayed set (the per-key rate limit): promote them
            // at their due time.
            if let Some(due) = sh.backend.take_promote_hint() {
                let mut st = sh.reclaim_state.lock().unwrap_or_else(|p| p.into_inner());
                let earlier = st.next_promote.add(due);
                drop(st);
                if earlier {
                    sh.waiting_added.notify_one();
                }
            }
            match read {
                Ok(ds) => {
                    failures = 0;
                    accept(sh, options, ds, acquired_at, stop).await;
                }
                Err(e) => {
                    sh.promise(0);
                    failures += 1;
                    tracing::warn!(queue = %q, error = %e, "read failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff(failures)) => {},
                        _ = stop.cancelled() => {},
                    }
                }
            }
            continue;
        }
        // Saturated (or every free slot kept for a due re-poll): wait for a slot or the next tick.
        let wake = min_instant(wake, next_due.filter(|t| *t > now)).max(now + Duration::from_millis(1));
        tokio::select! {
            _ = &mut changed => {
                // In memory the handlers share this runtime: let the ones woken with this slot
                // finish first, so that the next read takes every slot freed meanwhile (one read
                // per freed slot otherwise).
                if sh.backend.in_process() {
                    tokio::task::yield_now().await;
                }
            },
            _ = tokio::time::sleep_until(wake) => {},
            _ = stop.cancelled() => {},
        }
    }
}

/// Registers what a read or a reclaim returned and starts its handlers (or, once the
/// consumer stops without a drain budget, requeues it at the stream's tail: any consumer's read
/// takes it at once; with a budget it runs within it like the work already running).
async fn accept(
    sh: &Arc<Shared>,
    options: &ConsumerOptions,
    ds: Vec<RawDelivery>,
    acquired_at: std::time::Instant,
    stop: &CancellationToken,
) {
    let mut take = Vec::with_capacity(ds.len());
    let mut hand_back = Vec::new();
    let mut bury = Vec::new();
    let requeue = stop.is_cancelled() && sh.requeue_late.load(Ordering::Acquire);
    for d in ds {
        if requeue {
            hand_back.push(d.id);
            continue;
        }
        let over = options.max_deliveries.is_some_and(|m| d.deliveries > m);
        match d.payload.filter(|_| !over) {
            Some(p) => take.push((d.id, p, d.deliveries)),
            None => {
                let reason = if over { "max deliveries exceeded" } else { "malformed entry: no payload field" };
                if let Some(seq) = sh.register_settling(d.id, d.deliveries, acquired_at) {
                    bury.push((d.id, seq, d.deliveries, reason));
                }
            }
        }
    }
    let started = sh.register_all(take, acquired_at);
    if started > 0 {
        sh.counters.delivered.fetch_add(started as u64, Ordering::Relaxed);
    }
    for (id, seq, deliveries, reason) in bury {
        let sh = sh.clone();
        tokio::spawn(async move {
            let decision = Decision::DeadLetter(reason.to_string());
            match sh.backend.dead_letter(id, deliveries, reason, false, None).await {
                Ok(found) => {
                    if sh.finish(id, seq, &decision, Some(found)).is_ok() {
                        sh.counters.dead_lettered.fetch_add(1, Ordering::Relaxed);
                        metrics::counter!("baton_queue_dead_letters_total", "queue" => sh.queue.clone()).increment(1);
                    }
                }
                Err(e) => {
                    tracing::warn!(queue = %sh.queue, message_id = %id, error = %e, "dead-lettering failed; the entry is handed back by the heartbeat");
                    sh.abandon(id, seq);
                }
            }
        });
    }
    if !hand_back.is_empty() {
        if let Err(e) = sh.backend.requeue(&hand_back, &[]).await {
            tracing::warn!(queue = %sh.queue, count = hand_back.len(), error = %e, "requeueing entries read while stopping failed; they fail over after claim_timeout");
        }
    }
}

/// Starts waiting leases again when due, and promotes the queue's delayed entries at
/// their due time (a promote-only reclaim: it takes no entry, so it may run beside a read).
async fn redeliverer(sh: Arc<Shared>, stop: CancellationToken) {
    while !stop.is_cancelled() {
        let changed = sh.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let now = Instant::now();
        let due = sh.take_due(now.into_std());
        if due > 0 {
            sh.counters.delivered.fetch_add(due as u64, Ordering::Relaxed);
            continue;
        }
        let promote =
            sh.reclaim_state.lock().unwrap_or_else(|p| p.into_inner()).next_promote.first().map(Instant::from_std);
        if promote.is_some_and(|t| t <= now) {
            // The times due now are taken before the call: a time learnt while it is in flight
            // stays.
            sh.reclaim_state.lock().unwrap_or_else(|p| p.into_inner()).next_promote.take_due(now.into_std());
            match sh.backend.reclaim(0, &[]).await {
                Ok(r) => note_reclaimed(&sh, &r),
                Err(e) => {
                    tracing::warn!(queue = %sh.queue, error = %e, "promoting delayed entries failed; the next tick retries");
                }
            }
            continue;
        }
        // Due entries without a free slot wait for one (`changed`); otherwise only a new waiting
        // entry, the next due time or a promotion wakes this task (not every settlement).
        let next_due = sh.next_due().map(Instant::from_std);
        let blocked = next_due.is_some_and(|t| t <= now);
        let next = min_instant(now + Duration::from_secs(3600), next_due.filter(|t| *t > now));
        let next = min_instant(next, promote);
        tokio::select! {
            _ = &mut changed, if blocked => {},
            _ = sh.waiting_added.notified() => {},
            _ = tokio::time::sleep_until(next) => {},
            _ = stop.cancelled() => {},
        }
    }
}

/// Renews every held lease once per `heartbeat_interval`, in one backend call; reaps.
async fn heartbeat(sh: Arc<Shared>, options: ConsumerOptions, stop: CancellationToken) {
    let q = sh.queue.clone();
    let interval = options.heartbeat();
    let orphan_idle = options.claim_timeout / 2;
    let reap = options.reap_idle_consumers_after.map(|w| (w, w / 4));
    let mut next_reap = reap.map(|(_, every)| Instant::now() + every);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        tokio::select! {
            _ = ticker.tick() => {},
            _ = stop.cancelled() => return,
        }
        let plan = sh.beat_plan();
        let limit = plan.renew.len() + plan.quiet.len() + plan.release.len() + sh.concurrency + 100;
        let sent = std::time::Instant::now();
        let call = sh.backend.heartbeat(&plan.renew, &[], &plan.quiet, &plan.release, orphan_idle, limit);
        match tokio::time::timeout(interval, call).await {
            Ok(Ok(beat)) => {
                sh.apply_beat(&plan, &beat, sent);
                metrics::histogram!("baton_queue_renewal_seconds", "queue" => q.clone())
                    .record(sent.elapsed().as_secs_f64());
                if beat.orphans > 0 {
                    tracing::warn!(queue = %q, count = beat.orphans, "entries owned but not held (orphans) handed back; they are redelivered after claim_timeout");
                }
            }
            Ok(Err(e)) => {
                sh.counters.renewal_failures.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("baton_queue_lease_renewal_failures_total", "queue" => q.clone()).increment(1);
                tracing::warn!(queue = %q, error = %e, leases = plan.renew.len(), "lease renewal failed; retrying next tick");
            }
            Err(_) => {
                sh.counters.renewal_failures.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("baton_queue_lease_renewal_failures_total", "queue" => q.clone()).increment(1);
                tracing::warn!(queue = %q, leases = plan.renew.len(), "lease renewal timed out; retrying next tick");
            }
        }
        if let (Some((window, every)), Some(at)) = (reap, next_reap) {
            if Instant::now() >= at {
                next_reap = Some(Instant::now() + every);
                match sh.backend.reap_idle_consumers(window).await {
                    Ok(n) if n > 0 => {
                        tracing::info!(queue = %q, removed = n, "dead consumers with no pending entries removed")
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!(queue = %q, error = %e, "consumer reaping failed"),
                }
            }
        }
    }
}

fn transient(e: &QueueError) -> bool {
    match e {
        QueueError::Redis(e) => baton_redis::is_transient(e),
        QueueError::Unavailable(_) | QueueError::Connect(_) => true,
        _ => false,
    }
}

/// Delay before the `attempt`-th retry of a settlement (50 ms doubling, at most 1 s).
fn settle_backoff(attempt: u32) -> Duration {
    Duration::from_millis(50u64 << attempt.min(5)).min(Duration::from_secs(1))
}

/// Answers a settlement: to the caller awaiting it, or (a handler's returned decision, a lease
/// dropped unsettled: nobody awaits it) in the log when it failed. Counts the outcome.
fn reply(req: SettleReq, r: Result<(), QueueError>) {
    if let Some(q) = &req.queue {
        let result = if r.is_ok() { "ok" } else { "refused" };
        metrics::counter!("baton_queue_outcomes_total", "queue" => q.clone(), "decision" => crate::lease::decision_name(&req.decision), "result" => result)
            .increment(1);
    }
    match req.reply {
        Some(tx) => {
            let _ = tx.send(r);
        }
        None => {
            if let Err(e) = r {
                tracing::warn!(queue = req.queue.as_deref().unwrap_or(""), message_id = %req.id, error = %e, "settling the delivery failed");
            }
        }
    }
}

/// Applies settlements; see the module docs.
async fn settler(sh: Arc<Shared>, mut rx: mpsc::UnboundedReceiver<SettleReq>) {
    let pipeline = Arc::new(Semaphore::new(SETTLE_PIPELINE));
    while let Some(first) = rx.recv().await {
        let mut reqs = vec![first];
        while reqs.len() < SETTLE_BATCH {
            match rx.try_recv() {
                Ok(r) => reqs.push(r),
                Err(_) => break,
            }
        }
        let mut batch = Vec::new();
        for mut req in reqs {
            // Every decision passes here: a delay longer than MAX_DELAY is taken as MAX_DELAY.
            req.decision = req.decision.bounded();
            let ctx = match sh.begin_settle(req.id, req.seq) {
                Ok(c) => c,
                Err(e) => {
                    reply(req, Err(e));
                    continue;
                }
            };
            match &req.decision {
                Decision::Retry if ctx.stopped == Some(crate::lease::Stop::Lost) => {
                    // Another consumer owns it: nothing to hand back.
                    sh.counters.retried.fetch_add(1, Ordering::Relaxed);
                    let r = sh.finish(req.id, req.seq, &req.decision, None);
                    reply(req, r);
                }
                Decision::Ack | Decision::Retry => {
                    let op = if matches!(req.decision, Decision::Ack) { SettleOp::Ack } else { SettleOp::Park };
                    batch.push((Settle { id: req.id, op, released: ctx.released, fence: None }, req));
                }
                Decision::RetryAfter(d)
                    if *d < sh.claim_timeout && ctx.stopped.is_none() && sh.make_waiting(req.id, req.seq, *d) =>
                {
                    sh.counters.retried.fetch_add(1, Ordering::Relaxed);
                    reply(req, Ok(()));
                }
                Decision::RetryAfter(_) | Decision::DeadLetter(_) => {
                    let sh = sh.clone();
                    let released = ctx.released;
                    tokio::spawn(async move { settle_one(&sh, req, released).await });
                }
                Decision::RateLimited(d) => {
                    let (sh, d) = (sh.clone(), *d);
                    tokio::spawn(async move { rate_limited(&sh, req, ctx, d).await });
                }
                Decision::Deferred => {
                    // Not sent by leases; settle nothing.
                    let r = sh.finish(req.id, req.seq, &Decision::Retry, None);
                    reply(req, r);
                }
            }
        }
        if batch.is_empty() {
            continue;
        }
        let permit = pipeline.clone().acquire_owned().await.expect("never closed");
        let sh = sh.clone();
        tokio::spawn(async move {
            let items: Vec<Settle> = batch.iter().map(|(s, _)| *s).collect();
            let mut attempt = 0;
            let found = loop {
                match sh.backend.settle(&items).await {
                    Ok(found) => break Ok(found),
                    Err(e) if transient(&e) => {
                        tracing::warn!(queue = %sh.queue, error = %e, settlements = items.len(), "settling failed; retrying (the leases keep renewing)");
                        tokio::time::sleep(settle_backoff(attempt)).await;
                        attempt += 1;
                    }
                    Err(e) => break Err(e),
                }
            };
            drop(permit);
            match found {
                Ok(found) => {
                    for ((_, req), f) in batch.into_iter().zip(found) {
                        let r = sh.finish(req.id, req.seq, &req.decision, Some(f));
                        match req.decision {
                            Decision::Ack if r.is_ok() => {
                                sh.counters.acked.fetch_add(1, Ordering::Relaxed);
                            }
                            Decision::Retry => {
                                sh.counters.retried.fetch_add(1, Ordering::Relaxed);
                            }
                            _ => {}
                        }
                        reply(req, r);
                    }
                }
                Err(e) => {
                    let msg = e.to_string();
                    for (_, req) in batch {
                        sh.abandon(req.id, req.seq);
                        reply(req, Err(QueueError::Unavailable(msg.clone())));
                    }
                }
            }
        });
    }
}

/// A `RateLimited(d)`: shuts the queue's back-off gate for `d` (retried until the backend
/// answers), then hands the entry back for redelivery after `d` as a `RetryAfter(d)` does (kept
/// here as a waiting lease when shorter than the claim timeout), counted as rate limited, not as
/// a retry.
async fn rate_limited(sh: &Arc<Shared>, req: SettleReq, ctx: crate::lease::SettleCtx, d: Duration) {
    let mut attempt = 0;
    loop {
        match sh.backend.back_off(d).await {
            Ok(()) => break,
            Err(e) if transient(&e) => {
                tracing::warn!(queue = %sh.queue, error = %e, "setting the queue's back-off failed; retrying (the lease keeps renewing)");
                tokio::time::sleep(settle_backoff(attempt)).await;
                attempt += 1;
            }
            Err(e) => {
                // The entry is still handed back below; only the back-off is missing.
                tracing::warn!(queue = %sh.queue, error = %e, "setting the queue's back-off failed");
                break;
            }
        }
    }
    if d < sh.claim_timeout && ctx.stopped.is_none() && sh.make_waiting(req.id, req.seq, d) {
        sh.counters.rate_limited.fetch_add(1, Ordering::Relaxed);
        reply(req, Ok(()));
        return;
    }
    settle_one(sh, req, ctx.released).await;
}

/// A `RetryAfter` or `RateLimited` through the backend, or a `DeadLetter`.
async fn settle_one(sh: &Arc<Shared>, req: SettleReq, released: bool) {
    let mut attempt = 0;
    let found = loop {
        let r = match &req.decision {
            Decision::RetryAfter(d) | Decision::RateLimited(d) => {
                sh.backend.retry_after(req.id, *d, released, None).await
            }
            Decision::DeadLetter(reason) => {
                let deliveries = sh.lock().slots.get(&req.id).map_or(1, |s| s.deliveries);
                sh.backend.dead_letter(req.id, deliveries, reason, released, None).await
            }
            _ => Ok(Owned::Done),
        };
        match r {
            Ok(f) => break Ok(f),
            Err(e) if transient(&e) => {
                tracing::warn!(queue = %sh.queue, message_id = %req.id, error = %e, "settling failed; retrying (the lease keeps renewing)");
                tokio::time::sleep(settle_backoff(attempt)).await;
                attempt += 1;
            }
            Err(e) => break Err(e),
        }
    };
    match found {
        Ok(f) => {
            let r = sh.finish(req.id, req.seq, &req.decision, Some(f));
            match &req.decision {
                Decision::RetryAfter(d) | Decision::RateLimited(d) => {
                    if matches!(req.decision, Decision::RateLimited(_)) {
                        sh.counters.rate_limited.fetch_add(1, Ordering::Relaxed);
                    } else {
                        sh.counters.retried.fetch_add(1, Ordering::Relaxed);
                    }
                    if f == Owned::Done && *d >= sh.claim_timeout {
                        // In the delayed set now: promote it at its due time.
                        let due = std::time::Instant::now() + *d;
                        let mut st = sh.reclaim_state.lock().unwrap_or_else(|p| p.into_inner());
                        st.next_promote.add(due);
                        drop(st);
                        sh.changed.notify_waiters();
                    }
                }
                Decision::DeadLetter(_) if r.is_ok() => {
                    sh.counters.dead_lettered.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("baton_queue_dead_letters_total", "queue" => sh.queue.clone()).increment(1);
                }
                _ => {}
            }
            reply(req, r);
        }
        Err(e) => {
            sh.abandon(req.id, req.seq);
            reply(req, Err(e));
        }
    }
}
