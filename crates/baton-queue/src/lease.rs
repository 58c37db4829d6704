//! Leases: the registry of deliveries a consumer holds, and the handle a handler settles with.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, Notify, OwnedSemaphorePermit};
use tokio_util::sync::CancellationToken;

use crate::backend::ConsumerBackend;
use crate::{ConsumerCounters, Decision, MessageId, QueueError};

pub(crate) type AckRequest = (MessageId, oneshot::Sender<Result<bool, String>>);

struct Slot {
    started: Instant,
    lost: CancellationToken,
    /// Renewal stopped: lost to another consumer, or past `max_processing_time`.
    stopped: bool,
    abort: Option<tokio::task::AbortHandle>,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub delivered: AtomicU64,
    pub reclaimed: AtomicU64,
    pub acked: AtomicU64,
    pub retried: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub renewals: AtomicU64,
    pub renewal_failures: AtomicU64,
    pub leases_lost: AtomicU64,
    pub leases_expired: AtomicU64,
}

impl Counters {
    pub fn snapshot(&self) -> ConsumerCounters {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConsumerCounters {
            delivered: g(&self.delivered),
            reclaimed: g(&self.reclaimed),
            acked: g(&self.acked),
            retried: g(&self.retried),
            dead_lettered: g(&self.dead_lettered),
            renewals: g(&self.renewals),
            renewal_failures: g(&self.renewal_failures),
            leases_lost: g(&self.leases_lost),
            leases_expired: g(&self.leases_expired),
        }
    }
}

/// State shared by a consumer's dispatcher, handler tasks, heartbeat thread and leases.
pub(crate) struct Shared {
    pub queue: String,
    pub consumer: String,
    pub backend: Arc<dyn ConsumerBackend>,
    pub ack_tx: mpsc::UnboundedSender<AckRequest>,
    pub counters: Counters,
    /// Signalled whenever a lease is settled (a concurrency slot frees up).
    pub settled: Notify,
    pub max_processing_time: Duration,
    slots: Mutex<HashMap<MessageId, Slot>>,
}

impl Shared {
    pub fn new(
        queue: String,
        consumer: String,
        backend: Arc<dyn ConsumerBackend>,
        ack_tx: mpsc::UnboundedSender<AckRequest>,
        max_processing_time: Duration,
    ) -> Self {
        Self {
            queue,
            consumer,
            backend,
            ack_tx,
            counters: Counters::default(),
            settled: Notify::new(),
            max_processing_time,
            slots: Mutex::new(HashMap::new()),
        }
    }

    pub fn register(&self, id: MessageId, lost: CancellationToken) {
        self.slots
            .lock()
            .unwrap()
            .insert(id, Slot { started: Instant::now(), lost, stopped: false, abort: None });
    }

    pub fn set_abort(&self, id: MessageId, abort: tokio::task::AbortHandle) {
        if let Some(s) = self.slots.lock().unwrap().get_mut(&id) {
            s.abort = Some(abort);
        }
    }

    fn finish(&self, id: MessageId) {
        self.slots.lock().unwrap().remove(&id);
        self.settled.notify_one();
        self.settled.notify_waiters();
    }

    /// Ids held right now (handlers running, or deferred leases not yet settled).
    pub fn in_flight(&self) -> Vec<MessageId> {
        let mut v: Vec<MessageId> = self.slots.lock().unwrap().keys().copied().collect();
        v.sort();
        v
    }

    /// Ids whose renewal stopped (lost or past `max_processing_time`) while their handler still
    /// runs here: reclaim must leave them to a peer.
    pub fn released(&self) -> Vec<MessageId> {
        self.slots.lock().unwrap().iter().filter(|(_, s)| s.stopped).map(|(id, _)| *id).collect()
    }

    /// Aborts every running handler task (used when a consumer is aborted).
    pub fn abort_all(&self) {
        for s in self.slots.lock().unwrap().values_mut() {
            if let Some(a) = s.abort.take() {
                a.abort();
            }
        }
    }

    /// For one heartbeat tick: the ids to renew, and the ids past `max_processing_time` to
    /// release (their renewal stops now; their handlers are told through the lost-lease signal).
    pub fn heartbeat_snapshot(&self) -> (Vec<MessageId>, Vec<MessageId>) {
        let mut renew = Vec::new();
        let mut release = Vec::new();
        let mut slots = self.slots.lock().unwrap();
        for (id, s) in slots.iter_mut() {
            if s.stopped {
                continue;
            }
            if s.started.elapsed() > self.max_processing_time {
                s.stopped = true;
                // Count before signalling, so whoever observes the signal sees the count.
                self.counters.leases_expired.fetch_add(1, Ordering::Relaxed);
                s.lost.cancel();
                release.push(*id);
            } else {
                renew.push(*id);
            }
        }
        drop(slots);
        for id in &release {
            metrics::counter!("baton_queue_leases_expired_total", "queue" => self.queue.clone()).increment(1);
            tracing::warn!(
                queue = %self.queue,
                message_id = %id,
                max_processing_time = ?self.max_processing_time,
                "handler exceeded max_processing_time: lease released, the message can be taken by another consumer"
            );
        }
        (renew, release)
    }

    /// Marks leases the heartbeat found lost: renewal stops and the handler is signalled.
    pub fn mark_lost(&self, lost: &[MessageId]) {
        let mut slots = self.slots.lock().unwrap();
        for id in lost {
            if let Some(s) = slots.get_mut(id) {
                if !s.stopped {
                    s.stopped = true;
                    // Count before signalling, so whoever observes the signal sees the count.
                    self.counters.leases_lost.fetch_add(1, Ordering::Relaxed);
                    s.lost.cancel();
                    metrics::counter!("baton_queue_leases_lost_total", "queue" => self.queue.clone()).increment(1);
                    tracing::warn!(queue = %self.queue, message_id = %id, "lease lost: another consumer owns the message now");
                }
            }
        }
    }
}

/// Where a Redis delivery lives: see [`Lease::redis_target`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisAckTarget {
    /// The queue's stream key, e.g. `baton:q:{orders}`.
    pub stream: String,
    /// The consumer group.
    pub group: String,
    /// This consumer's name in the group (the owner an ack must check).
    pub consumer: String,
}

/// The lease on one delivery. Clone it freely; settle it once.
///
/// While unsettled, the consumer's heartbeat renews it every `heartbeat_interval`. It is *lost*
/// when another consumer took the message (after a renewal could not run for `claim_timeout`) or
/// when the handler ran past `max_processing_time`; [`Lease::lost`] then resolves, and an ack
/// through it is refused. Dropping every clone unsettled counts as [`Decision::Retry`].
#[derive(Clone)]
pub struct Lease {
    inner: Arc<LeaseInner>,
}

struct LeaseInner {
    id: MessageId,
    deliveries: u32,
    shared: Arc<Shared>,
    lost: CancellationToken,
    settled: AtomicBool,
    permit: Mutex<Option<OwnedSemaphorePermit>>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("id", &self.inner.id)
            .field("lost", &self.inner.lost.is_cancelled())
            .field("settled", &self.inner.settled.load(Ordering::Relaxed))
            .finish()
    }
}

impl Lease {
    pub(crate) fn new(
        id: MessageId,
        deliveries: u32,
        shared: Arc<Shared>,
        lost: CancellationToken,
        permit: OwnedSemaphorePermit,
    ) -> Self {
        Self {
            inner: Arc::new(LeaseInner {
                id,
                deliveries,
                shared,
                lost,
                settled: AtomicBool::new(false),
                permit: Mutex::new(Some(permit)),
            }),
        }
    }

    /// The leased message's id.
    pub fn id(&self) -> MessageId {
        self.inner.id
    }

    /// True once the lease is lost (see the type's docs).
    pub fn is_lost(&self) -> bool {
        self.inner.lost.is_cancelled()
    }

    /// Resolves when the lease is lost. Cooperative: the handler decides to stop.
    pub async fn lost(&self) {
        self.inner.lost.cancelled().await
    }

    /// A token cancelled when the lease is lost, to pass to code that takes one.
    pub fn lost_token(&self) -> CancellationToken {
        self.inner.lost.clone()
    }

    /// Acks (XACK + XDEL atomically). Errors: [`QueueError::LeaseLost`] if another consumer
    /// owns the message now, [`QueueError::AlreadySettled`].
    pub async fn ack(&self) -> Result<(), QueueError> {
        self.settle(Decision::Ack).await
    }

    /// Leaves the message for redelivery after `claim_timeout`. Errors: [`QueueError::AlreadySettled`].
    pub async fn retry(&self) -> Result<(), QueueError> {
        self.settle(Decision::Retry).await
    }

    /// Redelivers after about `delay`. Errors: [`QueueError::LeaseLost`], [`QueueError::AlreadySettled`].
    pub async fn retry_after(&self, delay: Duration) -> Result<(), QueueError> {
        self.settle(Decision::RetryAfter(delay)).await
    }

    /// Moves the message to dead letters. Errors: [`QueueError::LeaseLost`], [`QueueError::AlreadySettled`].
    pub async fn dead_letter(&self, reason: impl Into<String>) -> Result<(), QueueError> {
        self.settle(Decision::DeadLetter(reason.into())).await
    }

    /// Redis only (`None` in memory): the stream key, group and consumer name that hold this
    /// delivery, for a caller that acks it inside its own Lua script, atomically with its own
    /// writes (e.g. the command service's terminal state write). Such a script must ack exactly
    /// like the queue's `ack` script: only when `XPENDING <stream> <group> <id> <id> 1` names
    /// `consumer` as the owner, then `XACK <stream> <group> <id>` and `XDEL <stream> <id>`; and
    /// then tell the lease with [`Lease::mark_acked`]. The script's keys must share the stream's
    /// hash slot on Cluster (the stream key holds the queue's `{queue}` tag).
    pub fn redis_target(&self) -> Option<RedisAckTarget> {
        self.inner.shared.backend.redis_target()
    }

    /// Settles the lease as acked *without* a backend call: the caller acked the entry itself,
    /// atomically and ownership-checked (see [`Lease::redis_target`]). Counts as an ack and frees
    /// the concurrency slot; the handler then returns [`Decision::Deferred`] (or anything: the
    /// lease is settled, a later decision is ignored). Calling it when the entry was *not* acked
    /// leaves the entry pending: it is redelivered after `claim_timeout`.
    ///
    /// Errors: [`QueueError::AlreadySettled`].
    pub fn mark_acked(&self) -> Result<(), QueueError> {
        let inner = &self.inner;
        if inner.settled.swap(true, Ordering::AcqRel) {
            return Err(QueueError::AlreadySettled(inner.id));
        }
        let shared = &inner.shared;
        shared.counters.acked.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("baton_queue_outcomes_total", "queue" => shared.queue.clone(), "decision" => "ack", "result" => "ok")
            .increment(1);
        self.release();
        Ok(())
    }

    /// Applies a decision. `Deferred` is a no-op (the lease stays held).
    pub(crate) async fn settle(&self, decision: Decision) -> Result<(), QueueError> {
        if matches!(decision, Decision::Deferred) {
            return Ok(());
        }
        let inner = &self.inner;
        let id = inner.id;
        if inner.settled.swap(true, Ordering::AcqRel) {
            return Err(QueueError::AlreadySettled(id));
        }
        let shared = &inner.shared;
        let q = shared.queue.clone();
        let outcome = match decision {
            Decision::Ack => {
                let r = if let Some(owned) = shared.backend.ack_now(id) {
                    // Memory: acked at once under the queue's lock, no batcher round trip.
                    if owned {
                        Ok(())
                    } else {
                        Err(QueueError::LeaseLost(id))
                    }
                } else {
                    let (tx, rx) = oneshot::channel();
                    if shared.ack_tx.send((id, tx)).is_err() {
                        Err(QueueError::Closed)
                    } else {
                        match rx.await {
                            Ok(Ok(true)) => Ok(()),
                            Ok(Ok(false)) => Err(QueueError::LeaseLost(id)),
                            Ok(Err(e)) => Err(QueueError::Unavailable(e)),
                            Err(_) => Err(QueueError::Closed),
                        }
                    }
                };
                if r.is_ok() {
                    shared.counters.acked.fetch_add(1, Ordering::Relaxed);
                }
                ("ack", r)
            }
            Decision::Retry => {
                shared.counters.retried.fetch_add(1, Ordering::Relaxed);
                ("retry", Ok(()))
            }
            Decision::RetryAfter(d) => {
                shared.counters.retried.fetch_add(1, Ordering::Relaxed);
                let r = match shared.backend.retry_after(id, d).await {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(QueueError::LeaseLost(id)),
                    Err(e) => Err(e),
                };
                ("retry_after", r)
            }
            Decision::DeadLetter(reason) => {
                let r = match shared.backend.dead_letter(id, inner.deliveries, &reason).await {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(QueueError::LeaseLost(id)),
                    Err(e) => Err(e),
                };
                if r.is_ok() {
                    shared.counters.dead_lettered.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!("baton_queue_dead_letters_total", "queue" => q.clone()).increment(1);
                }
                ("dead_letter", r)
            }
            Decision::Deferred => unreachable!("handled above"),
        };
        let result = if outcome.1.is_ok() { "ok" } else { "refused" };
        metrics::counter!("baton_queue_outcomes_total", "queue" => q, "decision" => outcome.0, "result" => result)
            .increment(1);
        self.release();
        outcome.1
    }

    fn release(&self) {
        self.inner.permit.lock().unwrap().take();
        self.inner.shared.finish(self.inner.id);
    }
}

impl Drop for LeaseInner {
    fn drop(&mut self) {
        if !self.settled.swap(true, Ordering::AcqRel) {
            // Dropped unsettled: a Retry (the entry stays pending and is redelivered).
            self.shared.counters.retried.fetch_add(1, Ordering::Relaxed);
            self.permit.lock().unwrap().take();
            self.shared.finish(self.id);
        }
    }
}
