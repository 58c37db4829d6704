//! [`RemoteConsumer`]: a consumer of a queue whose handlers run somewhere else (a worker in
//! another language speaking HTTP), driven by that worker's requests instead of a lease thread.
//!
//! It is a member of the queue's consumer group like any other, under the same rules
//! (`backend.rs`): what it owns is a lease it holds, renewed by [`RemoteConsumer::renew`]
//! (which writes its liveness record, in backend time, and renews the ids it names, ownership
//! checked); when its worker falls silent for `claim_timeout`, it is a dead consumer and any live
//! consumer of the queue (in-process or remote) takes its entries over. A claim writes the
//! liveness record too, unless this process wrote it for the worker less than
//! `claim_timeout / 10` ago (a worker claiming in a tight loop would otherwise pay a heartbeat
//! per claim; entries a claim reads start idle, so they are safe for a claim timeout anyway).
//! Entries it owns but its worker no longer renews (say, the reply of a claim was lost) are
//! handed to the parked owner after `claim_timeout / 2` by the next renewal or heartbeating
//! claim, as a lease thread's heartbeat does. Nothing is held in the process that serves the
//! requests but that time: any process on the same backend can serve any request of the
//! worker.
//!
//! The same message can come back to the same worker: a lease it let lapse is parked by its own
//! next renewal (or taken by a peer that died since) and a later claim delivers it again. Each
//! delivery therefore carries a *fence* ([`RemoteDelivery::fence`], raised by every redelivery),
//! and every operation on a delivery names it with its fence: one of an earlier delivery is
//! refused as another consumer's ([`LeaseState::Lost`], [`QueueError::LeaseLost`]), never
//! applied to the later one.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::backend::{ConsumerBackend, ConsumerSpec, Owned, QueueBackend, Settle, SettleOp, PARKED};
use crate::{validate_queue_name, MessageId, QueueError};

/// Settings of a [`RemoteConsumer`].
#[derive(Clone, Debug)]
pub struct RemoteOptions {
    /// How long the worker may stay silent (no claim, no renewal) before its leases are taken
    /// over. The worker should renew at a third of it. Default 30 s; at least 1 s.
    pub claim_timeout: Duration,
    /// Deliveries after which a message is dead-lettered instead of delivered again (`None`:
    /// never). Default 5, as [`ConsumerOptions`](crate::ConsumerOptions).
    pub max_deliveries: Option<u32>,
    /// The queue's rate limit, applied to this worker's claims of new entries as to every
    /// consumer's reads ([`ConsumerOptions::rate_limit`](crate::ConsumerOptions::rate_limit)).
    /// Default `None`.
    pub rate_limit: Option<crate::RateLimit>,
    /// As [`ConsumerOptions::rate_limit_per_key`](crate::ConsumerOptions::rate_limit_per_key).
    /// Default `None`.
    pub rate_limit_per_key: Option<crate::RateLimit>,
    /// As [`ConsumerOptions::max_concurrency`](crate::ConsumerOptions::max_concurrency): the gated
    /// reads of this worker take new entries only while fewer are pending in the group. Default
    /// `None`.
    pub max_concurrency: Option<u32>,
    /// As [`ConsumerOptions::concurrency_per_key`](crate::ConsumerOptions::concurrency_per_key).
    /// Default `None`.
    pub concurrency_per_key: Option<u32>,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        Self {
            claim_timeout: Duration::from_secs(30),
            max_deliveries: Some(5),
            rate_limit: None,
            rate_limit_per_key: None,
            max_concurrency: None,
            concurrency_per_key: None,
        }
    }
}

/// A message handed to a remote worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteDelivery {
    pub id: MessageId,
    pub payload: Bytes,
    /// Deliveries including this one (as [`Delivery::deliveries`](crate::Delivery::deliveries)).
    pub deliveries: u32,
    /// This delivery's fence (module docs): 0 for a first delivery, raised by one by each
    /// redelivery of the same message. Give it back with every operation on the delivery.
    pub fence: u64,
}

/// What a renewal found for one id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
    /// Renewed: the worker still holds it, for another `claim_timeout`.
    Held,
    /// Another consumer owns it now, or a later delivery of it does (another fence, possibly to
    /// this very worker): the worker must stop (its settlement would be refused).
    Lost,
    /// Not pending any more (settled, or handed back): the worker holds nothing.
    Gone,
}

/// What a settlement found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    /// Applied.
    Done,
    /// The entry was not pending any more (already settled, e.g. by an earlier attempt of the
    /// same request whose reply was lost): nothing applied now.
    Gone,
}

/// A consumer whose worker is elsewhere: see the module docs. Cheap to clone; keep one per
/// worker in a process (each holds one connection of its own for blocking reads on Redis).
#[derive(Clone)]
pub struct RemoteConsumer {
    backend: Arc<dyn ConsumerBackend>,
    name: String,
    queue: String,
    claim_timeout: Duration,
    /// When this process last wrote the worker's liveness record (shared by the clones).
    last_beat: Arc<Mutex<Option<Instant>>>,
    /// When the earliest entry this worker's claims delayed for its key's rate is due (shared by
    /// the clones): a claim then promotes it.
    promote_at: Arc<Mutex<crate::lease::PromoteTimes>>,
}

fn owned(id: MessageId, o: Owned) -> Result<Settled, QueueError> {
    match o {
        Owned::Done => Ok(Settled::Done),
        Owned::Gone => Ok(Settled::Gone),
        Owned::Other => Err(QueueError::LeaseLost(id)),
    }
}

impl RemoteConsumer {
    pub(crate) async fn open(
        backend: &Arc<dyn QueueBackend>,
        queue: &str,
        name: &str,
        opts: RemoteOptions,
    ) -> Result<RemoteConsumer, QueueError> {
        validate_queue_name(queue)?;
        if name.is_empty() || name.len() > 200 || name == PARKED || name.chars().any(|c| c.is_control()) {
            return Err(QueueError::InvalidSettings(format!(
                "remote consumer name {name:?}: use 1 to 200 bytes without control characters, not {PARKED:?}"
            )));
        }
        if opts.claim_timeout < Duration::from_secs(1) {
            return Err(QueueError::InvalidSettings("claim_timeout must be at least 1s".into()));
        }
        if opts.claim_timeout > crate::MAX_CLAIM_TIMEOUT {
            return Err(QueueError::InvalidSettings(format!(
                "claim_timeout must be at most 1 day (got {:?})",
                opts.claim_timeout
            )));
        }
        if let Some(r) = &opts.rate_limit {
            r.validate()?;
        }
        if let Some(r) = &opts.rate_limit_per_key {
            r.validate_as("rate_limit_per_key")?;
        }
        if opts.max_deliveries == Some(0) {
            return Err(QueueError::InvalidSettings("max_deliveries must be at least 1 (or none)".into()));
        }
        crate::settings::validate_caps(opts.max_concurrency, opts.concurrency_per_key)?;
        let spec = ConsumerSpec {
            queue: queue.to_string(),
            consumer: name.to_string(),
            claim_timeout: opts.claim_timeout,
            heartbeat: opts.claim_timeout / 3,
            max_deliveries: opts.max_deliveries,
            rate_limit: opts.rate_limit,
            rate_limit_per_key: opts.rate_limit_per_key,
            max_concurrency: opts.max_concurrency,
            concurrency_per_key: opts.concurrency_per_key,
        };
        let backend = backend.open_consumer(spec).await?;
        Ok(RemoteConsumer {
            backend,
            name: name.to_string(),
            queue: queue.to_string(),
            claim_timeout: opts.claim_timeout,
            last_beat: Arc::default(),
            promote_at: Arc::default(),
        })
    }

    /// The consumer's name in the group.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// Keeps the earliest due time of the entries the last read delayed.
    fn note_promote_hint(&self) {
        if let Some(due) = self.backend.take_promote_hint() {
            self.promote_at.lock().expect("lock").add(due);
        }
    }

    /// Takes up to `max` messages for the worker (at least 1): entries of dead consumers and
    /// parked entries first (dead-lettering those past `max_deliveries`), then new ones, waiting
    /// up to `wait` for the first when none is ready. Writes the liveness record first (the
    /// worker is alive) unless this process wrote it less than `claim_timeout / 10` ago, without
    /// renewing anything. Malformed entries are dead-lettered, never returned. A claim answered a
    /// claim timeout or more after it was asked (this process stopped meanwhile) returns only the
    /// entries a renewal then finds still this consumer's: a peer may have taken the others over.
    pub async fn claim(&self, max: usize, wait: Duration) -> Result<Vec<RemoteDelivery>, QueueError> {
        self.claim_with(max, wait, true).await
    }

    /// [`RemoteConsumer::claim`], looking for reclaimable entries only when `reclaim` is true.
    /// A reclaim reads every group member's liveness (its cost grows with the number of
    /// consumers of the queue), so a process serving many workers of one queue runs it at a
    /// poll interval shared by them all, as one in-process consumer does, instead of at every
    /// claim; the other claims only read new entries.
    pub async fn claim_with(
        &self,
        max: usize,
        wait: Duration,
        reclaim: bool,
    ) -> Result<Vec<RemoteDelivery>, QueueError> {
        let max = max.max(1);
        let asked = Instant::now();
        let recent = self.last_beat.lock().expect("lock").is_some_and(|t| t.elapsed() < self.claim_timeout / 10);
        if !recent {
            self.beat(&[], &[]).await?;
        }
        let mut out = Vec::with_capacity(max);
        let mut raw = if reclaim { self.backend.reclaim(max, &[]).await?.deliveries } else { Vec::new() };
        // Entries this worker's reads moved to the delayed set (the per-key rate limit) are
        // promoted at their due time by its own claims (it has no promoter of its own): a claim
        // that finds one due promotes it first, and a waiting claim waits no longer than until the
        // earliest is due.
        let deadline = Instant::now() + wait;
        loop {
            self.note_promote_hint();
            let now = Instant::now();
            let due = self.promote_at.lock().expect("lock").first();
            if due.is_some_and(|d| d <= now) {
                // Taken before the call: a time learnt meanwhile (by a concurrent claim) stays.
                self.promote_at.lock().expect("lock").take_due(now);
                let r = self.backend.reclaim(0, &[]).await?;
                if let Some(n) = r.next_due {
                    self.promote_at.lock().expect("lock").add(Instant::now() + n.max(Duration::from_millis(10)));
                }
                continue;
            }
            if raw.len() >= max {
                break;
            }
            let until = due.map_or(deadline, |d| d.min(deadline));
            let block = if raw.is_empty() { until.saturating_duration_since(now) } else { Duration::ZERO };
            raw.extend(self.backend.read_new(max - raw.len(), block.max(Duration::from_millis(1))).await?);
            self.note_promote_hint();
            if !raw.is_empty() || Instant::now() >= deadline {
                break;
            }
        }
        // Answered a claim timeout or more after it was asked (this process was stopped, or
        // starved, while Redis answered a read pipelined behind its wait): a peer may have taken
        // the entries over since, and run them. Only those a renewal finds still this
        // consumer's, of this delivery, are handed to the worker (as a lease thread holds such
        // entries back until its heartbeat confirms them).
        if !raw.is_empty() && asked.elapsed() >= self.claim_timeout {
            let ids: Vec<MessageId> = raw.iter().map(|d| d.id).collect();
            let fences: Vec<u64> = raw.iter().map(|d| d.fence).collect();
            let beat = self.beat(&ids, &fences).await?;
            let mut i = 0;
            raw.retain(|d| {
                let keep = !(beat.stale.contains(&i) || beat.lost.contains(&d.id) || beat.gone.contains(&d.id));
                i += 1;
                keep
            });
        }
        for d in raw {
            match d.payload {
                Some(payload) => {
                    out.push(RemoteDelivery { id: d.id, payload, deliveries: d.deliveries, fence: d.fence })
                }
                None => {
                    self.backend.dead_letter(d.id, d.deliveries, "malformed entry", false, Some(d.fence)).await?;
                }
            }
        }
        Ok(out)
    }

    async fn beat(&self, renew: &[MessageId], fences: &[u64]) -> Result<crate::backend::Beat, QueueError> {
        let limit = renew.len() + 1_000;
        let started = Instant::now();
        let beat = self.backend.heartbeat(renew, fences, &[], &[], self.claim_timeout / 2, limit).await?;
        *self.last_beat.lock().expect("lock") = Some(started);
        Ok(beat)
    }

    /// Renews the leases of `leases` (id and fence of each delivery) in one call (and writes the
    /// liveness record); one state per lease, in order.
    pub async fn renew(&self, leases: &[(MessageId, u64)]) -> Result<Vec<LeaseState>, QueueError> {
        let (ids, fences): (Vec<MessageId>, Vec<u64>) = leases.iter().copied().unzip();
        let beat = self.beat(&ids, &fences).await?;
        Ok(ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                if beat.stale.contains(&i) || beat.lost.contains(id) {
                    LeaseState::Lost
                } else if beat.gone.contains(id) {
                    LeaseState::Gone
                } else {
                    LeaseState::Held
                }
            })
            .collect())
    }

    /// Redis only (`None` in memory): the stream key, group and this consumer's name, for a caller
    /// that acks a message it holds inside its own Lua script, atomically with its own writes
    /// (as [`Lease::redis_target`](crate::Lease::redis_target), whose rules apply).
    pub fn redis_target(&self) -> Option<crate::RedisAckTarget> {
        self.backend.redis_target()
    }

    /// Puts messages the worker never saw back at the queue's tail at once (any consumer's
    /// read takes them now, not after the claim timeout), in one atomic call; the delivery that
    /// did not reach the worker is not counted. Those this consumer does not own are left
    /// alone, and so are those of another delivery than the fence given (id and fence of each).
    /// For a claim whose answer could not reach the worker. Returns how many went back.
    pub async fn hand_back(&self, leases: &[(MessageId, u64)]) -> Result<u64, QueueError> {
        let (ids, fences): (Vec<MessageId>, Vec<u64>) = leases.iter().copied().unzip();
        self.backend.requeue(&ids, &fences).await
    }

    /// Removes the queue's group members that own no pending entry and whose liveness record is
    /// at least `window` old (dead consumers, remote or in-process; as an in-process consumer's
    /// `reap_idle_consumers_after` does); returns how many. `window` should be at least twice
    /// the longest claim timeout of the queue's consumers.
    pub async fn reap_idle_consumers(&self, window: Duration) -> Result<u64, QueueError> {
        self.backend.reap_idle_consumers(window).await
    }

    /// Acknowledges (deletes) the delivery `id` of fence `fence`. Errors:
    /// [`QueueError::LeaseLost`] when another consumer, or a later delivery, owns it now.
    pub async fn ack(&self, id: MessageId, fence: u64) -> Result<Settled, QueueError> {
        let r = self.backend.settle(&[Settle { id, op: SettleOp::Ack, released: false, fence: Some(fence) }]).await?;
        owned(id, r.first().copied().unwrap_or(Owned::Gone))
    }

    /// Hands a message back: any consumer takes it after `claim_timeout` (counts as a delivery).
    /// Errors: [`QueueError::LeaseLost`].
    pub async fn release(&self, id: MessageId, fence: u64) -> Result<Settled, QueueError> {
        let r = self.backend.settle(&[Settle { id, op: SettleOp::Park, released: false, fence: Some(fence) }]).await?;
        owned(id, r.first().copied().unwrap_or(Owned::Gone))
    }

    /// Delivers the message again after `delay`, not counted as a delivery
    /// ([`Decision::RetryAfter`](crate::Decision::RetryAfter); at most
    /// [`MAX_DELAY`](crate::MAX_DELAY)). Errors: [`QueueError::LeaseLost`].
    pub async fn retry_after(&self, id: MessageId, fence: u64, delay: Duration) -> Result<Settled, QueueError> {
        let delay = delay.min(crate::MAX_DELAY);
        owned(id, self.backend.retry_after(id, delay, false, Some(fence)).await?)
    }

    /// The worker was rate limited downstream ([`Decision::RateLimited`](crate::Decision::RateLimited)):
    /// every consumer of the queue stops taking new entries for `delay` (the queue's back-off,
    /// only ever extended; set even when the delivery is no longer this worker's), and the
    /// message is delivered again after `delay`, not counted as a delivery (`delay` at most
    /// [`MAX_DELAY`](crate::MAX_DELAY)). Errors: [`QueueError::LeaseLost`].
    pub async fn rate_limited(&self, id: MessageId, fence: u64, delay: Duration) -> Result<Settled, QueueError> {
        let delay = delay.min(crate::MAX_DELAY);
        self.backend.back_off(delay).await?;
        owned(id, self.backend.retry_after(id, delay, false, Some(fence)).await?)
    }

    /// Moves the message to dead letters with `reason` (`deliveries`: as claimed). Errors:
    /// [`QueueError::LeaseLost`].
    pub async fn dead_letter(
        &self,
        id: MessageId,
        fence: u64,
        deliveries: u32,
        reason: &str,
    ) -> Result<Settled, QueueError> {
        owned(id, self.backend.dead_letter(id, deliveries, reason, false, Some(fence)).await?)
    }
}
