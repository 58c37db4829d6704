//! The consumer: a dispatcher task (reads, reclaims, runs handlers under a concurrency limit), a
//! heartbeat thread (renews leases, one backend call per tick), and an ack batcher. Backend
//! independent: the same code drives the memory and the Redis backends.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use tokio::sync::{mpsc, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, ConsumerSpec, RawDelivery};
use crate::lease::{AckRequest, Shared};
use crate::{ConsumerCounters, ConsumerOptions, Decision, Delivery, DrainReport, Lease, MessageId};

/// Handles deliveries. Implemented for any `Fn(Delivery) -> impl Future<Output = Decision>`.
///
/// A panic in `handle` is caught and treated as [`Decision::Retry`].
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    async fn handle(&self, delivery: Delivery) -> Decision;
}

#[async_trait]
impl<F, Fut> Handler for F
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Decision> + Send + 'static,
{
    async fn handle(&self, delivery: Delivery) -> Decision {
        (self)(delivery).await
    }
}

/// Ack requests batched into one backend call, at most this many.
const ACK_BATCH: usize = 512;
/// Ack batches in flight at once per consumer.
const ACK_PIPELINE: usize = 4;

/// A running consumer of one queue. Stop it with [`Consumer::drain`] or [`Consumer::close`];
/// dropping it stops it like [`Consumer::abort`] without aborting running handlers.
pub struct Consumer {
    shared: Arc<Shared>,
    stop: CancellationToken,
    heartbeat_stop: CancellationToken,
    dispatcher: Option<tokio::task::JoinHandle<()>>,
}

impl Consumer {
    pub(crate) async fn start(
        backend: Arc<dyn Backend>,
        queue: &str,
        handler: Arc<dyn Handler>,
        options: ConsumerOptions,
    ) -> Result<Consumer, crate::QueueError> {
        options.validate()?;
        crate::validate_queue_name(queue)?;
        let consumer = format!("{}-{}", options.consumer_prefix, uuid::Uuid::now_v7());
        let spec = ConsumerSpec {
            queue: queue.to_string(),
            consumer: consumer.clone(),
            claim_timeout: options.claim_timeout,
            max_deliveries: options.max_deliveries,
        };
        let cb = backend.open_consumer(spec.clone()).await?;
        let (ack_tx, ack_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared::new(
            queue.to_string(),
            consumer,
            cb,
            ack_tx,
            options.max_processing_time,
        ));
        let stop = CancellationToken::new();
        let heartbeat_stop = CancellationToken::new();
        spawn_heartbeat(shared.clone(), backend, spec, options.heartbeat(), heartbeat_stop.clone());
        tokio::spawn(ack_batcher(shared.clone(), ack_rx));
        let dispatcher = tokio::spawn(dispatch(shared.clone(), handler, options, stop.clone()));
        tracing::info!(queue, consumer = %shared.consumer, "consumer started");
        Ok(Consumer { shared, stop, heartbeat_stop, dispatcher: Some(dispatcher) })
    }

    /// The consumer's name in the group: `<prefix>-<uuid v7>`, unique per incarnation.
    pub fn name(&self) -> &str {
        &self.shared.consumer
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.shared.queue
    }

    /// Counters since start.
    pub fn counters(&self) -> ConsumerCounters {
        self.shared.counters.snapshot()
    }

    /// Ids currently held (handlers running, deferred leases unsettled), ascending.
    pub fn in_flight(&self) -> Vec<MessageId> {
        self.shared.in_flight()
    }

    /// Stops reading new work, lets running handlers finish within `budget`, then stops renewing
    /// leases. Work still in flight is reported; its leases expire and another consumer takes it
    /// after `claim_timeout` (nothing is lost).
    pub async fn drain(mut self, budget: Duration) -> DrainReport {
        self.stop.cancel();
        if let Some(d) = self.dispatcher.take() {
            let _ = d.await;
        }
        let before = self.shared.counters.snapshot();
        let deadline = Instant::now() + budget;
        loop {
            let notified = self.shared.settled.notified();
            if self.shared.in_flight().is_empty() {
                break;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                break;
            }
        }
        self.heartbeat_stop.cancel();
        let after = self.shared.counters.snapshot();
        let completed = (after.acked + after.retried + after.dead_lettered)
            .saturating_sub(before.acked + before.retried + before.dead_lettered) as usize;
        let in_flight = self.shared.in_flight();
        if !in_flight.is_empty() {
            tracing::warn!(queue = %self.shared.queue, in_flight = in_flight.len(), "drain budget ran out; leases left to expire");
        }
        DrainReport { completed, in_flight }
    }

    /// [`Consumer::drain`] with no budget.
    pub async fn close(self) -> DrainReport {
        self.drain(Duration::ZERO).await
    }

    /// Stops at once, as if the process died: no more reads, renewals stop, running handler
    /// tasks are aborted. Their messages are taken by another consumer after `claim_timeout`.
    pub fn abort(self) {
        self.shared.abort_all();
        // Drop does the rest.
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.stop.cancel();
        self.heartbeat_stop.cancel();
        if let Some(d) = self.dispatcher.take() {
            d.abort();
        }
    }
}

/// The heartbeat runs on its own OS thread with its own runtime and backend connection, so
/// handlers that block every worker thread of the application's runtime cannot starve it.
fn spawn_heartbeat(
    shared: Arc<Shared>,
    backend: Arc<dyn Backend>,
    spec: ConsumerSpec,
    interval: Duration,
    stop: CancellationToken,
) {
    let name = format!("baton-heartbeat-{}", spec.queue);
    let spawned = std::thread::Builder::new().name(name).spawn(move || {
        let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                tracing::error!(error = %e, "cannot start the heartbeat runtime; leases will not renew");
                return;
            }
        };
        rt.block_on(async move {
            let q = spec.queue.clone();
            let mut renewer = loop {
                match backend.renewer(spec.clone()).await {
                    Ok(r) => break r,
                    Err(e) => {
                        tracing::warn!(queue = %q, error = %e, "heartbeat cannot connect yet");
                        tokio::select! {
                            _ = tokio::time::sleep(interval) => {},
                            _ = stop.cancelled() => return,
                        }
                    }
                }
            };
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                tokio::select! {
                    _ = ticker.tick() => {},
                    _ = stop.cancelled() => return,
                }
                let (renew, release) = shared.heartbeat_snapshot();
                if renew.is_empty() && release.is_empty() {
                    continue;
                }
                let started = std::time::Instant::now();
                match tokio::time::timeout(interval, renewer.renew(&renew, &release)).await {
                    Ok(Ok(lost)) => {
                        shared.counters.renewals.fetch_add(renew.len() as u64, Ordering::Relaxed);
                        metrics::counter!("baton_queue_lease_renewals_total", "queue" => q.clone())
                            .increment(renew.len() as u64);
                        metrics::histogram!("baton_queue_renewal_seconds", "queue" => q.clone())
                            .record(started.elapsed().as_secs_f64());
                        shared.mark_lost(&lost);
                    }
                    Ok(Err(e)) => {
                        shared.counters.renewal_failures.fetch_add(1, Ordering::Relaxed);
                        metrics::counter!("baton_queue_lease_renewal_failures_total", "queue" => q.clone()).increment(1);
                        tracing::warn!(queue = %q, error = %e, leases = renew.len(), "lease renewal failed; retrying next tick");
                    }
                    Err(_) => {
                        shared.counters.renewal_failures.fetch_add(1, Ordering::Relaxed);
                        metrics::counter!("baton_queue_lease_renewal_failures_total", "queue" => q.clone()).increment(1);
                        tracing::warn!(queue = %q, leases = renew.len(), "lease renewal timed out; retrying next tick");
                    }
                }
            }
        });
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot spawn the heartbeat thread; leases will not renew");
    }
}

/// Collects acks from handler tasks and sends them to the backend in batches: whatever is queued
/// when a batch starts goes in one call, up to [`ACK_PIPELINE`] calls in flight.
async fn ack_batcher(shared: Arc<Shared>, mut rx: mpsc::UnboundedReceiver<AckRequest>) {
    let pipeline = Arc::new(Semaphore::new(ACK_PIPELINE));
    while let Some(first) = rx.recv().await {
        let permit = pipeline.clone().acquire_owned().await.expect("never closed");
        let mut batch = vec![first];
        while batch.len() < ACK_BATCH {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        let backend = shared.backend.clone();
        tokio::spawn(async move {
            let ids: Vec<MessageId> = batch.iter().map(|(id, _)| *id).collect();
            match backend.ack(&ids).await {
                Ok(results) => {
                    for ((_, tx), ok) in batch.into_iter().zip(results) {
                        let _ = tx.send(Ok(ok));
                    }
                }
                Err(e) => {
                    let msg = e.to_string();
                    for (_, tx) in batch {
                        let _ = tx.send(Err(msg.clone()));
                    }
                }
            }
            drop(permit);
        });
    }
}

async fn dispatch(
    shared: Arc<Shared>,
    handler: Arc<dyn Handler>,
    options: ConsumerOptions,
    stop: CancellationToken,
) {
    let sem = Arc::new(Semaphore::new(options.concurrency));
    let poll = options.poll();
    let q = shared.queue.clone();
    let mut next_reclaim = Instant::now();
    let reap_every = options.reap_idle_consumers_after.map(|d| d / 4);
    let mut next_reap = reap_every.map(|e| Instant::now() + e);
    let mut failures: u32 = 0;

    let backoff = |failures: u32| Duration::from_millis(100u64 << failures.min(4)).min(poll.max(Duration::from_millis(100)));

    while !stop.is_cancelled() {
        if Instant::now() >= next_reclaim {
            next_reclaim = Instant::now() + poll;
            match shared.backend.reclaim(sem.available_permits(), &shared.released()).await {
                Ok(r) => {
                    failures = 0;
                    if r.dead_lettered > 0 {
                        shared.counters.dead_lettered.fetch_add(r.dead_lettered, Ordering::Relaxed);
                        metrics::counter!("baton_queue_dead_letters_total", "queue" => q.clone()).increment(r.dead_lettered);
                        tracing::warn!(queue = %q, count = r.dead_lettered, "messages moved to dead letters after max_deliveries");
                    }
                    if r.deleted > 0 {
                        tracing::debug!(queue = %q, count = r.deleted, "pending entries of deleted messages cleaned");
                    }
                    let n = r.deliveries.len() as u64;
                    if n > 0 {
                        shared.counters.reclaimed.fetch_add(n, Ordering::Relaxed);
                        metrics::counter!("baton_queue_reclaims_total", "queue" => q.clone()).increment(n);
                    }
                    for d in r.deliveries {
                        start_delivery(&shared, &handler, &sem, &options, d).await;
                    }
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(queue = %q, error = %e, "reclaim failed");
                }
            }
        }
        if let (Some(at), Some(every), Some(idle)) = (next_reap, reap_every, options.reap_idle_consumers_after) {
            if Instant::now() >= at {
                next_reap = Some(Instant::now() + every);
                match shared.backend.reap_idle_consumers(idle).await {
                    Ok(n) if n > 0 => tracing::info!(queue = %q, removed = n, "idle consumers with no pending entries removed"),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(queue = %q, error = %e, "consumer reaping failed"),
                }
            }
        }
        let free = sem.available_permits();
        if free == 0 {
            tokio::select! {
                _ = shared.settled.notified() => {},
                _ = tokio::time::sleep_until(next_reclaim) => {},
                _ = stop.cancelled() => break,
            }
            continue;
        }
        let block = next_reclaim.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
        tokio::select! {
            r = shared.backend.read_new(free, block) => match r {
                Ok(ds) => {
                    failures = 0;
                    for d in ds {
                        start_delivery(&shared, &handler, &sem, &options, d).await;
                    }
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(queue = %q, error = %e, "read failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff(failures)) => {},
                        _ = stop.cancelled() => break,
                    }
                }
            },
            _ = stop.cancelled() => break,
        }
    }
    tracing::info!(queue = %q, consumer = %shared.consumer, "consumer stopped reading");
}

async fn start_delivery(
    shared: &Arc<Shared>,
    handler: &Arc<dyn Handler>,
    sem: &Arc<Semaphore>,
    options: &ConsumerOptions,
    raw: RawDelivery,
) {
    let Ok(permit) = sem.clone().try_acquire_owned() else {
        // Cannot happen: reads ask for at most the free permits. Leave the entry pending.
        tracing::error!(queue = %shared.queue, message_id = %raw.id, "no free slot for a delivery; it will be redelivered");
        return;
    };
    let id = raw.id;
    let lost = CancellationToken::new();
    shared.register(id, lost.clone());
    let lease = Lease::new(id, raw.deliveries, shared.clone(), lost, permit);
    shared.counters.delivered.fetch_add(1, Ordering::Relaxed);
    let over = options.max_deliveries.is_some_and(|m| raw.deliveries > m);
    let Some(payload) = raw.payload.filter(|_| !over) else {
        let reason = if over { "max deliveries exceeded" } else { "malformed entry: no payload field" };
        if let Err(e) = lease.dead_letter(reason).await {
            tracing::warn!(queue = %shared.queue, message_id = %id, error = %e, "dead-lettering failed");
        }
        return;
    };
    let delivery = Delivery { id, payload, deliveries: raw.deliveries, lease: lease.clone() };
    let handler = handler.clone();
    let q = shared.queue.clone();
    let task = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let decision = match std::panic::AssertUnwindSafe(handler.handle(delivery)).catch_unwind().await {
            Ok(d) => d,
            Err(_) => {
                tracing::error!(queue = %q, message_id = %id, "handler panicked; the message will be redelivered");
                Decision::Retry
            }
        };
        metrics::histogram!("baton_queue_handler_seconds", "queue" => q.clone()).record(started.elapsed().as_secs_f64());
        if let Err(e) = lease.settle(decision).await {
            tracing::warn!(queue = %q, message_id = %id, error = %e, "settling the delivery failed");
        }
    });
    shared.set_abort(id, task.abort_handle());
}
