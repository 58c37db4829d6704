//! Leases: the registry of entries a consumer holds, and the handle a handler settles with.
//!
//! The registry is written by the lease thread the moment a read or a reclaim reply is parsed,
//! before any handler is involved: from then until the entry is settled or handed back, every
//! heartbeat renews it (see `engine.rs`). A slot is keyed by message id; one delivery per id per
//! process (a slot's `seq` tells deliveries of one id apart: a lease handle of an earlier
//! delivery cannot settle a later one).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio_util::sync::CancellationToken;

use crate::api::{ConsumerCounters, Decision, MessageId, QueueError, RedisAckTarget};
use crate::backend::{ConsumerBackend, Owned};

/// A settlement sent to the lease thread; `reply` is `None` for a lease dropped unsettled.
pub(crate) struct SettleReq {
    pub id: MessageId,
    pub seq: u64,
    pub decision: Decision,
    pub reply: Option<oneshot::Sender<Result<(), QueueError>>>,
    /// The queue, when the outcome is to be counted (`baton_queue_outcomes_total`): every
    /// settlement but a lease dropped unsettled.
    pub queue: Option<String>,
}

/// A delivery whose handler is to start.
pub(crate) struct Job {
    pub id: MessageId,
    pub seq: u64,
    pub payload: Bytes,
    pub deliveries: u32,
    pub lost: CancellationToken,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Another consumer owns the entry: the handler was told.
    Lost,
    /// Past `max_processing_time`: handed to the parked owner, the handler was told.
    Released,
    /// Not pending any more (acked by a settlement whose reply is still on its way, or deleted):
    /// nothing left to renew, nothing to tell.
    Gone,
    /// The consumer stopped renewing (drain budget over, or the consumer ended): the handler was
    /// told; the entry is still this consumer's until someone takes it.
    Unrenewed,
}

pub(crate) enum Phase {
    /// Its handler task is started: it runs (or waits for a runtime thread). Holds a
    /// concurrency slot.
    Running,
    /// A settlement is being applied. Holds its concurrency slot until applied.
    Settling,
    /// A short `RetryAfter` kept here: redelivered from this process at `due`. Holds no
    /// concurrency slot. Also an entry whose acquisition was answered a claim timeout or more
    /// after it was asked for (due at once, started once a renewal confirms it, see
    /// [`Shared::register_all`]).
    Waiting { due: Instant },
}

pub(crate) struct Slot {
    pub seq: u64,
    pub phase: Phase,
    pub payload: Bytes,
    pub deliveries: u32,
    /// When this delivery began (for `max_processing_time`).
    pub started: Instant,
    /// When the last renewal that found the entry ours was sent (or the entry acquired): the lease
    /// cannot have expired before this + `claim_timeout`.
    pub renewed_at: Instant,
    pub stopped: Option<Stop>,
    pub lost: CancellationToken,
    pub abort: Option<tokio::task::AbortHandle>,
}

impl Slot {
    fn busy(&self) -> bool {
        !matches!(self.phase, Phase::Waiting { .. })
    }
}

#[derive(Default)]
pub(crate) struct Registry {
    /// Keyed with FxHash: ids are small integers the process does not take from strangers
    /// (the backend assigns them), and the map is on every delivery's path.
    pub slots: rustc_hash::FxHashMap<MessageId, Slot>,
    /// Slots holding a concurrency slot (running or settling).
    pub busy: usize,
    /// Concurrency slots promised to the read in flight (its COUNT).
    pub promised: usize,
    pub next_seq: u64,
    /// Acquisition stopped: short `RetryAfter`s are no longer kept here.
    pub closing: bool,
    /// The consumer was aborted ([`Shared::abort_all`]): no handler starts any more.
    pub aborted: bool,
    /// The waiting slots by due time (a waiting slot is never stopped: a lost or gone one is
    /// removed).
    pub dues: std::collections::BTreeSet<(Instant, MessageId)>,
}

impl Registry {
    /// A new slot holding a concurrency slot (`Running` or `Settling`) with no handler task;
    /// returns its `seq`.
    fn insert(&mut self, id: MessageId, phase: Phase, payload: Bytes, deliveries: u32, acquired_at: Instant) -> u64 {
        let seq = self.new_seq();
        self.insert_slot(id, seq, phase, payload, deliveries, acquired_at, CancellationToken::new(), None);
        seq
    }

    fn new_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    #[allow(clippy::too_many_arguments)]
    fn insert_slot(
        &mut self,
        id: MessageId,
        seq: u64,
        phase: Phase,
        payload: Bytes,
        deliveries: u32,
        acquired_at: Instant,
        lost: CancellationToken,
        abort: Option<tokio::task::AbortHandle>,
    ) {
        let slot = Slot {
            seq,
            phase,
            payload,
            deliveries,
            started: acquired_at,
            renewed_at: acquired_at,
            stopped: None,
            lost,
            abort,
        };
        self.slots.insert(id, slot);
        self.busy += 1;
    }
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
    pub rate_limited: AtomicU64,
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
            rate_limited: g(&self.rate_limited),
        }
    }
}

/// What one heartbeat sends: see `ConsumerBackend::heartbeat`.
pub(crate) struct BeatPlan {
    pub renew: Vec<MessageId>,
    pub quiet: Vec<MessageId>,
    pub release: Vec<MessageId>,
}

/// Starts a delivery's handler task on the application's runtime and returns its abort handle.
/// Called under the registry lock, the moment the delivery is registered (so that no second
/// lock is taken per delivery): it must not take that lock.
pub(crate) type Starter = Box<dyn Fn(&Arc<Shared>, Job) -> tokio::task::AbortHandle + Send + Sync>;

/// State shared by a consumer's lease thread, acquirer, handler tasks and leases.
pub(crate) struct Shared {
    pub queue: String,
    pub consumer: String,
    pub backend: Arc<dyn ConsumerBackend>,
    pub settle_tx: mpsc::UnboundedSender<SettleReq>,
    pub counters: Counters,
    pub concurrency: usize,
    pub claim_timeout: Duration,
    pub max_processing_time: Duration,
    /// Signalled (all waiters) whenever a concurrency slot frees or a waiting entry is added:
    /// wakes the acquirer, the redeliverer and `drain`. Waiters enable their `notified()` before
    /// looking at the registry.
    pub changed: Notify,
    /// Signalled (one permit) when a waiting entry is added: wakes the redeliverer.
    pub waiting_added: Notify,
    /// What the last reclaim call said: see [`ReclaimState`].
    pub reclaim_state: Mutex<ReclaimState>,
    reg: Mutex<Registry>,
    /// The lease thread has ended: settlements are refused with [`QueueError::Closed`].
    pub closed: AtomicBool,
    /// Entries a read returns after acquisition stopped are requeued (`close`, drop) instead of
    /// run within the drain budget (`drain` with a budget).
    pub requeue_late: AtomicBool,
    /// Starts handlers; see [`Starter`].
    start: Starter,
}

/// Shared by the acquirer and the redeliverer (which promotes delayed entries at their due time).
#[derive(Default)]
pub(crate) struct ReclaimState {
    /// Reclaimable entries exist that no free slot could take: the next free slot reclaims.
    pub reclaim_first: bool,
    /// When delayed entries of the queue are due (learnt from reclaim replies, reads and
    /// `RetryAfter`s).
    pub next_promote: PromoteTimes,
}

/// The times at which the redeliverer promotes delayed entries: a small ordered set, so that a
/// due time learnt from a read is never lost to a reclaim reply that predates it (each time costs
/// at most one promotion call). At most [`PromoteTimes::MAX`] are kept (the latest dropped: the
/// poll tick's reclaim promotes anything due regardless).
#[derive(Default)]
pub(crate) struct PromoteTimes(std::collections::BTreeSet<Instant>);

impl PromoteTimes {
    pub const MAX: usize = 64;

    /// Adds `t`; returns whether it is now the earliest.
    pub fn add(&mut self, t: Instant) -> bool {
        let earliest = self.0.first().is_none_or(|f| t < *f);
        self.0.insert(t);
        if self.0.len() > Self::MAX {
            self.0.pop_last();
        }
        earliest
    }

    /// The earliest time.
    pub fn first(&self) -> Option<Instant> {
        self.0.first().copied()
    }

    /// Removes the times at or before `now`.
    pub fn take_due(&mut self, now: Instant) {
        while self.0.first().is_some_and(|t| *t <= now) {
            self.0.pop_first();
        }
    }
}

impl Shared {
    pub fn new(
        queue: String,
        consumer: String,
        backend: Arc<dyn ConsumerBackend>,
        settle_tx: mpsc::UnboundedSender<SettleReq>,
        options: &crate::ConsumerOptions,
        start: Starter,
    ) -> Self {
        Self {
            queue,
            consumer,
            backend,
            settle_tx,
            counters: Counters::default(),
            concurrency: options.concurrency,
            claim_timeout: options.claim_timeout,
            max_processing_time: options.max_processing_time,
            changed: Notify::new(),
            waiting_added: Notify::new(),
            reclaim_state: Mutex::new(ReclaimState::default()),
            closed: AtomicBool::new(false),
            requeue_late: AtomicBool::new(true),
            reg: Mutex::new(Registry::default()),
            start,
        }
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.reg.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Promises `n` slots to a read about to be sent (0: the read returned; call after
    /// registering what it returned).
    pub fn promise(&self, n: usize) {
        let released = {
            let mut reg = self.lock();
            let released = n < reg.promised;
            reg.promised = n;
            released
        };
        if released {
            self.notify();
        }
    }

    fn notify(&self) {
        self.changed.notify_waiters();
    }

    /// Registers an acquired entry that no handler will see (dead-lettered by the lease thread
    /// at once): settling, in the concurrency slot the read counted it in.
    pub fn register_settling(&self, id: MessageId, deliveries: u32, acquired_at: Instant) -> Option<u64> {
        let mut reg = self.lock();
        if reg.slots.contains_key(&id) {
            return None;
        }
        Some(reg.insert(id, Phase::Settling, Bytes::new(), deliveries, acquired_at))
    }

    /// Moves waiting entries that are due into running, as far as concurrency allows, and starts
    /// their handlers; returns how many. Each is a new delivery of the same message (new `seq`),
    /// same delivery count.
    pub fn take_due(self: &Arc<Self>, now: Instant) -> usize {
        let mut reg = self.lock();
        self.take_due_locked(&mut reg, now)
    }

    fn take_due_locked(self: &Arc<Self>, reg: &mut Registry, now: Instant) -> usize {
        if reg.aborted {
            return 0;
        }
        let mut free = self.concurrency.saturating_sub(reg.busy + reg.promised);
        let mut started = 0;
        while free > 0 {
            let Some(&(due, id)) = reg.dues.first() else { break };
            if due > now {
                break;
            }
            // A lease that may have expired (no renewal confirmed it for a claim timeout, e.g.
            // Redis unreachable or the process stopped) is not run again until a heartbeat
            // confirms it (or finds it lost).
            if reg.slots.get(&id).is_some_and(|s| s.renewed_at.elapsed() >= self.claim_timeout) {
                break;
            }
            reg.dues.pop_first();
            let seq = reg.new_seq();
            let Some(s) = reg.slots.get_mut(&id) else { continue };
            s.seq = seq;
            s.phase = Phase::Running;
            s.started = Instant::now();
            s.lost = CancellationToken::new();
            let job = Job { id, seq, payload: s.payload.clone(), deliveries: s.deliveries, lost: s.lost.clone() };
            s.abort = Some((self.start)(self, job));
            reg.busy += 1;
            free -= 1;
            started += 1;
        }
        started
    }

    /// One look for the acquirer, under one lock: the due waiting leases it can start now, the
    /// free slots left, the earliest due time, and how many waiting leases are due by `near`.
    pub fn acquire_view(self: &Arc<Self>, now: Instant, near: Instant) -> AcquireView {
        let mut reg = self.lock();
        let due = self.take_due_locked(&mut reg, now);
        AcquireView {
            due,
            free: self.concurrency.saturating_sub(reg.busy + reg.promised),
            next_due: reg.dues.first().map(|(d, _)| *d),
            reserved: reg.dues.iter().take_while(|(d, _)| *d <= near).count(),
        }
    }

    /// Registers what one read or reclaim acquired and starts their handlers, under one lock, and
    /// ends the read's promise. Returns how many started; ids this process already holds are
    /// skipped (never delivered twice; the entry stays under the existing slot).
    ///
    /// `acquired_at` is when the request was sent. A reply parsed a claim timeout or more after
    /// that (the process was stopped, or its runtime starved, while the reply waited; or Redis
    /// assigned the entries to a read pipelined behind a blocking wait and the process could not
    /// take the reply in time) may hold entries another consumer has taken over since, and even
    /// finished: they are not started but kept as waiting leases due now, which
    /// [`Shared::take_due`] starts only once a heartbeat confirms they are still this
    /// consumer's (a lost or gone one is dropped by [`Shared::apply_beat`]).
    pub fn register_all(self: &Arc<Self>, items: Vec<(MessageId, Bytes, u32)>, acquired_at: Instant) -> usize {
        let mut started = 0;
        let mut held_back = 0;
        let late = acquired_at.elapsed() >= self.claim_timeout;
        let released = {
            let mut reg = self.lock();
            let items = if reg.aborted { Vec::new() } else { items };
            for (id, payload, deliveries) in items {
                if reg.slots.contains_key(&id) {
                    tracing::error!(queue = %self.queue, message_id = %id, "entry acquired while this process holds it; not delivered twice");
                    continue;
                }
                if late {
                    let seq = reg.new_seq();
                    let due = Instant::now();
                    let slot = Slot {
                        seq,
                        phase: Phase::Waiting { due },
                        payload,
                        deliveries,
                        started: acquired_at,
                        renewed_at: acquired_at,
                        stopped: None,
                        lost: CancellationToken::new(),
                        abort: None,
                    };
                    reg.slots.insert(id, slot);
                    reg.dues.insert((due, id));
                    held_back += 1;
                    continue;
                }
                // Started before its slot is inserted, under the same lock: its settlement (which
                // takes the lock) finds the slot.
                let seq = reg.new_seq();
                let lost = CancellationToken::new();
                let job = Job { id, seq, payload: payload.clone(), deliveries, lost: lost.clone() };
                let abort = (self.start)(self, job);
                reg.insert_slot(id, seq, Phase::Running, payload, deliveries, acquired_at, lost, Some(abort));
                started += 1;
            }
            let released = reg.promised > 0;
            reg.promised = 0;
            released
        };
        if held_back > 0 {
            tracing::warn!(
                queue = %self.queue,
                count = held_back,
                after = ?acquired_at.elapsed(),
                claim_timeout = ?self.claim_timeout,
                "entries acquired by a request answered a claim timeout or more after it was sent: held until a renewal confirms they are still this consumer's"
            );
            self.waiting_added.notify_one();
        }
        if released || held_back > 0 {
            self.notify();
        }
        started
    }

    /// The earliest due time of a waiting entry.
    pub fn next_due(&self) -> Option<Instant> {
        self.lock().dues.first().map(|(due, _)| *due)
    }

    /// Stops keeping short `RetryAfter`s here and takes the waiting entries, with the time left
    /// until each is due (to hand them back on stop).
    pub fn take_waiting(&self) -> Vec<(MessageId, Duration)> {
        let mut reg = self.lock();
        reg.closing = true;
        reg.dues.clear();
        let now = Instant::now();
        let ids: Vec<(MessageId, Duration)> = reg
            .slots
            .iter()
            .filter_map(|(id, s)| match s.phase {
                Phase::Waiting { due } => Some((*id, due.saturating_duration_since(now))),
                _ => None,
            })
            .collect();
        for (id, _) in &ids {
            reg.slots.remove(id);
        }
        ids
    }

    /// Ids held with a handler (running, deferred, or settling), ascending.
    pub fn in_flight(&self) -> Vec<MessageId> {
        let mut v: Vec<MessageId> = self.lock().slots.iter().filter(|(_, s)| s.busy()).map(|(id, _)| *id).collect();
        v.sort();
        v
    }

    /// Ids whose lease stopped while their handler still runs here: a reclaim must leave them.
    pub fn stopped_ids(&self) -> Vec<MessageId> {
        self.lock().slots.iter().filter(|(_, s)| s.stopped.is_some()).map(|(id, _)| *id).collect()
    }

    /// Aborts every running handler task (a consumer aborted).
    pub fn abort_all(&self) {
        let mut reg = self.lock();
        // Under the same lock as every start: a read that returns after this starts nothing
        // (its entries stay this consumer's and fail over after the claim timeout).
        reg.aborted = true;
        for s in reg.slots.values_mut() {
            if let Some(a) = s.abort.take() {
                a.abort();
            }
        }
    }

    /// For one heartbeat: what to renew, renew quietly and release. Handlers past
    /// `max_processing_time` are released now (renewal stops; they are told through the
    /// lost-lease signal).
    pub fn beat_plan(&self) -> BeatPlan {
        let mut plan = BeatPlan { renew: Vec::new(), quiet: Vec::new(), release: Vec::new() };
        let mut reg = self.lock();
        for (id, s) in reg.slots.iter_mut() {
            if s.stopped.is_some() {
                continue;
            }
            match s.phase {
                Phase::Settling => plan.quiet.push(*id),
                Phase::Waiting { .. } => plan.renew.push(*id),
                Phase::Running if s.started.elapsed() > self.max_processing_time => {
                    s.stopped = Some(Stop::Released);
                    // Count before signalling, so whoever observes the signal sees the count.
                    self.counters.leases_expired.fetch_add(1, Ordering::Relaxed);
                    s.lost.cancel();
                    plan.release.push(*id);
                }
                Phase::Running => plan.renew.push(*id),
            }
        }
        drop(reg);
        for id in &plan.release {
            metrics::counter!("baton_queue_leases_expired_total", "queue" => self.queue.clone()).increment(1);
            tracing::warn!(
                queue = %self.queue,
                message_id = %id,
                max_processing_time = ?self.max_processing_time,
                "handler exceeded max_processing_time: lease released, the message can be taken by another consumer"
            );
        }
        plan.renew.sort();
        plan
    }

    /// Applies what a heartbeat sent at `sent` found.
    pub fn apply_beat(&self, plan: &BeatPlan, beat: &crate::backend::Beat, sent: Instant) {
        let mut reg = self.lock();
        let lost: std::collections::HashSet<&MessageId> = beat.lost.iter().collect();
        let gone: std::collections::HashSet<&MessageId> = beat.gone.iter().collect();
        let mut renewed = 0u64;
        let mut remove = Vec::new();
        for id in plan.renew.iter().chain(&plan.quiet) {
            let Some(s) = reg.slots.get_mut(id) else { continue };
            let was_lost = lost.contains(id)
                || (gone.contains(id) && sent.saturating_duration_since(s.renewed_at) >= self.claim_timeout);
            if was_lost {
                if s.stopped.is_none() {
                    s.stopped = Some(Stop::Lost);
                    self.counters.leases_lost.fetch_add(1, Ordering::Relaxed);
                    s.lost.cancel();
                    metrics::counter!("baton_queue_leases_lost_total", "queue" => self.queue.clone()).increment(1);
                    tracing::warn!(queue = %self.queue, message_id = %id, "lease lost: another consumer owns the message now");
                }
                if matches!(s.phase, Phase::Waiting { .. }) {
                    remove.push(*id);
                }
            } else if gone.contains(id) {
                // Acked by a settlement whose reply is on its way, or deleted: nothing to renew.
                if s.stopped.is_none() {
                    s.stopped = Some(Stop::Gone);
                }
                if matches!(s.phase, Phase::Waiting { .. }) {
                    remove.push(*id);
                }
            } else {
                s.renewed_at = sent;
                // Settlements in flight (quiet) are kept alive, not counted as renewals.
                if !matches!(s.phase, Phase::Settling) {
                    renewed += 1;
                }
            }
        }
        for id in remove {
            if let Some(Slot { phase: Phase::Waiting { due }, .. }) = reg.slots.remove(&id) {
                reg.dues.remove(&(due, id));
            }
        }
        let waiting = !reg.dues.is_empty();
        drop(reg);
        if waiting {
            // Waiting leases held back for want of a confirmed renewal may run now.
            self.notify();
            self.waiting_added.notify_one();
        }
        self.counters.renewals.fetch_add(renewed, Ordering::Relaxed);
        metrics::counter!("baton_queue_lease_renewals_total", "queue" => self.queue.clone()).increment(renewed);
    }

    /// The heartbeat stopped (drain budget over): tells every handler still holding a lease that
    /// it is no longer renewed.
    pub fn stop_renewing(&self) {
        for s in self.lock().slots.values_mut() {
            if s.stopped.is_none() {
                s.stopped = Some(Stop::Unrenewed);
                s.lost.cancel();
            }
        }
    }

    /// Marks a slot lost because a settlement found another owner.
    fn mark_lost_locked(&self, s: &mut Slot, id: MessageId) {
        if s.stopped != Some(Stop::Lost) {
            s.stopped = Some(Stop::Lost);
            self.counters.leases_lost.fetch_add(1, Ordering::Relaxed);
            s.lost.cancel();
            metrics::counter!("baton_queue_leases_lost_total", "queue" => self.queue.clone()).increment(1);
            tracing::warn!(queue = %self.queue, message_id = %id, "lease lost: another consumer owns the message now");
        }
    }

    /// Starts settling delivery `(id, seq)`: the slot must be running. Returns whether its lease
    /// was released (past `max_processing_time`), or `AlreadySettled`.
    pub fn begin_settle(&self, id: MessageId, seq: u64) -> Result<SettleCtx, QueueError> {
        let mut reg = self.lock();
        match reg.slots.get_mut(&id) {
            Some(s) if s.seq == seq && matches!(s.phase, Phase::Running) => {
                s.phase = Phase::Settling;
                Ok(SettleCtx { released: s.stopped == Some(Stop::Released), stopped: s.stopped })
            }
            _ => Err(QueueError::AlreadySettled(id)),
        }
    }

    /// Turns a settling slot into a waiting one (a short `RetryAfter` kept here); `false` when
    /// the consumer is closing (the caller then hands the entry back through the backend).
    pub fn make_waiting(&self, id: MessageId, seq: u64, delay: Duration) -> bool {
        let mut reg = self.lock();
        if reg.closing {
            return false;
        }
        if let Some(s) = reg.slots.get_mut(&id).filter(|s| s.seq == seq) {
            let due = Instant::now() + delay;
            s.phase = Phase::Waiting { due };
            s.abort = None;
            reg.busy -= 1;
            reg.dues.insert((due, id));
        }
        drop(reg);
        self.notify();
        self.waiting_added.notify_one();
        true
    }

    /// Finishes settling `(id, seq)` with what the backend found (or `None`: settled without a
    /// backend answer, e.g. `mark_acked`); frees its slot. Returns the settlement's result.
    pub fn finish(&self, id: MessageId, seq: u64, decision: &Decision, found: Option<Owned>) -> Result<(), QueueError> {
        let mut reg = self.lock();
        let result = self.finish_locked(&mut reg, id, seq, decision, found);
        drop(reg);
        self.notify();
        result
    }

    /// An ack settled on the caller's thread (memory: [`ConsumerBackend::ack_now`]), in one pass
    /// over the registry: begin, ack, finish.
    pub fn ack_inline(&self, id: MessageId, seq: u64) -> Result<(), QueueError> {
        let mut reg = self.lock();
        let released = match reg.slots.get(&id) {
            Some(s) if s.seq == seq && matches!(s.phase, Phase::Running) => s.stopped == Some(Stop::Released),
            _ => return Err(QueueError::AlreadySettled(id)),
        };
        let found = self.backend.ack_now(id, released);
        let result = self.finish_locked(&mut reg, id, seq, &Decision::Ack, found);
        drop(reg);
        self.notify();
        result
    }

    fn finish_locked(
        &self,
        reg: &mut Registry,
        id: MessageId,
        seq: u64,
        decision: &Decision,
        found: Option<Owned>,
    ) -> Result<(), QueueError> {
        let Some(s) = reg.slots.get_mut(&id).filter(|s| s.seq == seq) else {
            return Err(QueueError::Closed);
        };
        // A lease that cannot have expired before this answer: `Gone` means acked by an earlier
        // attempt of this settlement (or deleted), not taken and finished elsewhere.
        // A released (or no longer renewed) lease may have been taken and finished at once:
        // `Gone` proves nothing for it.
        let unexpired = s.renewed_at.elapsed() < self.claim_timeout && matches!(s.stopped, None | Some(Stop::Gone));
        let result = match (decision, found) {
            (_, None) | (_, Some(Owned::Done)) => Ok(()),
            (Decision::Retry, _) => Ok(()),
            (_, Some(Owned::Gone)) if unexpired => Ok(()),
            (_, Some(Owned::Gone)) => Err(QueueError::LeaseLost(id)),
            (_, Some(Owned::Other)) => {
                self.mark_lost_locked(s, id);
                Err(QueueError::LeaseLost(id))
            }
        };
        let busy = s.busy();
        reg.slots.remove(&id);
        if busy {
            reg.busy -= 1;
        }
        result
    }

    /// Drops the slot of `(id, seq)` after a settlement that failed for good.
    pub fn abandon(&self, id: MessageId, seq: u64) {
        let mut reg = self.lock();
        if let Some(s) = reg.slots.get(&id).filter(|s| s.seq == seq) {
            let busy = s.busy();
            reg.slots.remove(&id);
            if busy {
                reg.busy -= 1;
            }
        }
        drop(reg);
        self.notify();
    }
}

/// See [`Shared::acquire_view`].
pub(crate) struct AcquireView {
    /// Due waiting leases whose handlers it started.
    pub due: usize,
    pub free: usize,
    pub next_due: Option<Instant>,
    pub reserved: usize,
}

/// What `begin_settle` found about the lease.
pub(crate) struct SettleCtx {
    pub released: bool,
    pub stopped: Option<Stop>,
}

/// One delivery of a message to a handler.
#[derive(Debug)]
pub struct Delivery {
    /// The message id.
    pub id: MessageId,
    /// The payload bytes as offered.
    pub payload: Bytes,
    /// How many times this message has been delivered, this delivery included (1 on first),
    /// not counting redeliveries the handler asked for with [`Decision::RetryAfter`]. Compared
    /// with `max_deliveries`.
    pub deliveries: u32,
    /// The lease on this delivery: a lost-lease signal, and settlement for [`Decision::Deferred`].
    pub lease: Lease,
}

/// The lease on one delivery. Clone it freely; settle it once.
///
/// It began when the backend assigned the entry to this consumer (before the handler started)
/// and is renewed every `heartbeat_interval` by the consumer's lease thread until settled,
/// whatever the handler does. It is *lost* only when another consumer owns the message (after
/// renewals could not reach the backend for `claim_timeout`, e.g. a stopped or partitioned
/// process), *released* when the handler ran past `max_processing_time`, or *no longer renewed*
/// when the consumer stopped (drain budget over); [`Lease::lost`] then resolves. An ack of a lost
/// lease is refused; once the consumer has ended, every settlement is refused with
/// [`QueueError::Closed`]. Dropping every clone unsettled counts as
/// [`Decision::Retry`].
#[derive(Clone)]
pub struct Lease {
    inner: Arc<LeaseInner>,
}

struct LeaseInner {
    id: MessageId,
    seq: u64,
    shared: Arc<Shared>,
    lost: CancellationToken,
    settled: AtomicBool,
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
    /// The lease of `job` (its lost-lease token moves here).
    pub(crate) fn new(shared: Arc<Shared>, id: MessageId, seq: u64, lost: CancellationToken) -> Self {
        Self { inner: Arc::new(LeaseInner { id, seq, shared, lost, settled: AtomicBool::new(false) }) }
    }

    /// The leased message's id.
    pub fn id(&self) -> MessageId {
        self.inner.id
    }

    /// The name of the consumer holding the lease (its member name in the queue's consumer
    /// group on Redis: the consumer prefix and a unique suffix, see
    /// [`ConsumerOptions::with_consumer_prefix`](crate::ConsumerOptions::with_consumer_prefix)).
    pub fn consumer(&self) -> &str {
        &self.inner.shared.consumer
    }

    /// True once the lease is lost, released or no longer renewed (see the type's docs).
    pub fn is_lost(&self) -> bool {
        self.inner.lost.is_cancelled()
    }

    /// Resolves when the lease is lost, released or no longer renewed. Cooperative: the handler
    /// decides to stop.
    pub async fn lost(&self) {
        self.inner.lost.cancelled().await
    }

    /// A token cancelled when [`Lease::lost`] resolves, to pass to code that takes one.
    pub fn lost_token(&self) -> CancellationToken {
        self.inner.lost.clone()
    }

    /// Acks (XACK + XDEL atomically). Errors: [`QueueError::LeaseLost`] if another consumer
    /// owns the message now, [`QueueError::AlreadySettled`], [`QueueError::Closed`] when the
    /// consumer has stopped.
    pub async fn ack(&self) -> Result<(), QueueError> {
        self.settle(Decision::Ack).await
    }

    /// Hands the message back for redelivery after `claim_timeout` (to any consumer of the
    /// queue). Errors: [`QueueError::AlreadySettled`], [`QueueError::Closed`].
    pub async fn retry(&self) -> Result<(), QueueError> {
        self.settle(Decision::Retry).await
    }

    /// Redelivers after `delay`. Errors: [`QueueError::LeaseLost`], [`QueueError::AlreadySettled`],
    /// [`QueueError::Closed`].
    pub async fn retry_after(&self, delay: Duration) -> Result<(), QueueError> {
        self.settle(Decision::RetryAfter(delay)).await
    }

    /// Rate limited downstream ([`Decision::RateLimited`]): every consumer of the queue backs
    /// off for `delay` and the message is redelivered after it, not counted as a delivery.
    /// Errors: [`QueueError::LeaseLost`], [`QueueError::AlreadySettled`], [`QueueError::Closed`].
    pub async fn rate_limited(&self, delay: Duration) -> Result<(), QueueError> {
        self.settle(Decision::RateLimited(delay)).await
    }

    /// Moves the message to dead letters. Errors: [`QueueError::LeaseLost`],
    /// [`QueueError::AlreadySettled`], [`QueueError::Closed`].
    pub async fn dead_letter(&self, reason: impl Into<String>) -> Result<(), QueueError> {
        self.settle(Decision::DeadLetter(reason.into())).await
    }

    /// Redis only (`None` in memory): the stream key, group and consumer name that hold this
    /// delivery, for a caller that acks it inside its own Lua script, atomically with its own
    /// writes (e.g. the command service's terminal state write). Such a script must ack exactly
    /// like the queue's `settle` script: only when `XPENDING <stream> <group> <id> <id> 1` names
    /// `consumer` as the owner, then `XACK <stream> <group> <id>`, `XDEL <stream> <id>` and
    /// `HDEL <fences> <id>` (the entry's fence goes with it), free its concurrency slots (prepend
    /// [`keys::CAPS_LUA`](crate::keys::CAPS_LUA), pass [`RedisAckTarget::caps`] as keys, call
    /// `caps_release` for the id and `caps_wake`); and then tell the lease with
    /// [`Lease::mark_acked`]. The script's keys must share the stream's
    /// hash slot on Cluster (the stream key holds the queue's `{queue}` tag).
    pub fn redis_target(&self) -> Option<RedisAckTarget> {
        self.inner.shared.backend.redis_target()
    }

    /// Settles the lease as acked *without* a backend call: the caller acked the entry itself,
    /// atomically and ownership-checked (see [`Lease::redis_target`]). Counts as an ack and frees
    /// the concurrency slot; the handler then returns [`Decision::Deferred`] (or anything: the
    /// lease is settled, a later decision is ignored). Calling it when the entry was *not* acked
    /// leaves the entry pending under this consumer, not held: the next heartbeat hands it back
    /// (as an orphan) and it is redelivered after `claim_timeout`.
    ///
    /// Errors: [`QueueError::AlreadySettled`].
    pub fn mark_acked(&self) -> Result<(), QueueError> {
        let inner = &self.inner;
        if inner.settled.swap(true, Ordering::AcqRel) {
            return Err(QueueError::AlreadySettled(inner.id));
        }
        let shared = &inner.shared;
        shared.begin_settle(inner.id, inner.seq)?;
        let _ = shared.finish(inner.id, inner.seq, &Decision::Ack, None);
        shared.counters.acked.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("baton_queue_outcomes_total", "queue" => shared.queue.clone(), "decision" => "ack", "result" => "ok")
            .increment(1);
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
        let name = decision_name(&decision);
        let r = if shared.closed.load(Ordering::Acquire) {
            Err(QueueError::Closed)
        } else if !matches!(decision, Decision::Ack) || !shared.backend.in_process() {
            // Through the lease thread, which counts the outcome.
            let (tx, rx) = oneshot::channel();
            let req = SettleReq { id, seq: inner.seq, decision, reply: Some(tx), queue: Some(shared.queue.clone()) };
            return if shared.settle_tx.send(req).is_err() {
                Err(QueueError::Closed)
            } else {
                rx.await.unwrap_or(Err(QueueError::Closed))
            };
        } else {
            // Memory: acked at once under the queue's lock, no trip to the lease thread.
            let r = shared.ack_inline(id, inner.seq);
            if r.is_ok() {
                shared.counters.acked.fetch_add(1, Ordering::Relaxed);
            }
            r
        };
        let result = if r.is_ok() { "ok" } else { "refused" };
        metrics::counter!("baton_queue_outcomes_total", "queue" => shared.queue.clone(), "decision" => name, "result" => result)
            .increment(1);
        r
    }
}

impl Lease {
    /// Settles with the handler's returned decision without waiting for the outcome (the lease
    /// thread logs a failure and counts the outcome): the handler's task ends at once instead of
    /// waiting for a reply from another thread. A lease already settled (e.g. `mark_acked`, or
    /// settled by the handler through the lease) ignores the decision.
    pub(crate) fn settle_detached(self, decision: Decision) {
        let inner = &self.inner;
        if matches!(decision, Decision::Deferred) {
            return;
        }
        if matches!(decision, Decision::Ack) && inner.shared.backend.in_process() {
            // In memory the ack is a lock away: settle it here.
            let shared = inner.shared.clone();
            let id = inner.id;
            let fut = self.settle(decision);
            // `settle` completes without awaiting anything on this path.
            if let Some(Err(e)) = futures::FutureExt::now_or_never(fut) {
                if !matches!(e, QueueError::AlreadySettled(_)) {
                    tracing::warn!(queue = %shared.queue, message_id = %id, error = %e, "settling the delivery failed");
                }
            }
            return;
        }
        if inner.settled.swap(true, Ordering::AcqRel) {
            return;
        }
        let shared = &inner.shared;
        let req = SettleReq { id: inner.id, seq: inner.seq, decision, reply: None, queue: Some(shared.queue.clone()) };
        if shared.settle_tx.send(req).is_err() {
            tracing::warn!(queue = %shared.queue, message_id = %inner.id, "settling the delivery failed: the consumer has stopped");
        }
    }
}

pub(crate) fn decision_name(d: &Decision) -> &'static str {
    match d {
        Decision::Ack => "ack",
        Decision::Retry => "retry",
        Decision::RetryAfter(_) => "retry_after",
        Decision::Deferred => "deferred",
        Decision::DeadLetter(_) => "dead_letter",
        Decision::RateLimited(_) => "rate_limited",
    }
}

impl Drop for LeaseInner {
    fn drop(&mut self) {
        if !self.settled.swap(true, Ordering::AcqRel) {
            // Dropped unsettled: a Retry (handed back, redelivered after claim_timeout).
            let _ = self.shared.settle_tx.send(SettleReq {
                id: self.id,
                seq: self.seq,
                decision: Decision::Retry,
                reply: None,
                queue: None,
            });
        }
    }
}
