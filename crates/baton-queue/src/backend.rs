//! The seam between the backend-independent consumer (`consumer.rs`, `engine.rs`, `lease.rs`) and
//! a storage backend (`memory.rs`, `redis.rs`). Both backends implement the same model, described
//! on each method:
//!
//! * Every pending entry has an owner: a consumer that holds its lease, or [`PARKED`], the
//!   group's reserved owner of entries that nobody holds (a `Retry`, a short `RetryAfter` handed
//!   back, a lease released past `max_processing_time`, an orphan). An entry is *reclaimable*
//!   once it has been idle for `claim_timeout` and its owner is [`PARKED`] or a consumer whose
//!   liveness record (written by its heartbeat, in backend time) is at least `claim_timeout` old.
//! * A consumer never reclaims its own entries: everything it owns is a lease it holds (renewed
//!   every heartbeat), so a live consumer's work is never delivered twice by itself or a peer.
//! * Every delivery of an entry has a *fence*: 0 for its first (a read), raised by one by every
//!   reclaim that delivers it again. An entry can come back to the consumer that held it (parked
//!   as its orphan, a re-poll, or taken by a peer that died since), so the owner alone does not
//!   tell one delivery from another; a caller that keeps a delivery outside the process (a remote
//!   worker's lease token) gives its fence back with each operation (`Some(fence)`), and the
//!   operation applies only if the entry's fence is still that one ([`Owned::Other`] otherwise:
//!   a later delivery holds it). `None` checks the owner only. On Redis the fences are a hash in
//!   the queue's slot ([`crate::keys::fences`]); the field goes with the entry.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::{DeadLetter, MessageId, QueueError, QueueStats};

/// The reserved owner of pending entries that no consumer holds. No consumer name can be equal
/// to it: consumer names are `<prefix>-<uuid v7>`.
pub const PARKED: &str = "~parked";

/// A message handed to the consumer by a read or a reclaim.
#[derive(Debug, Clone)]
pub(crate) struct RawDelivery {
    pub id: MessageId,
    /// `None` when the entry is malformed (no payload field): the consumer dead-letters it.
    pub payload: Option<Bytes>,
    /// Deliveries including this one.
    pub deliveries: u32,
    /// This delivery's fence (module docs): 0 for a read, raised by each reclaim.
    pub fence: u64,
}

/// Which timed gate held a read back (the `reason` of `baton_queue_throttled_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Throttle {
    /// A handler answered `RateLimited`: the queue backs off.
    Backoff,
    /// The queue's rate limit.
    RateLimit,
}

impl Throttle {
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Throttle::Backoff => "backoff",
            Throttle::RateLimit => "rate_limit",
        }
    }
}

/// Result of one reclaim call.
#[derive(Debug, Default)]
pub(crate) struct Reclaimed {
    pub deliveries: Vec<RawDelivery>,
    /// Entries moved to dead letters by this call because they exceeded `max_deliveries`.
    pub dead_lettered: u64,
    /// Pending entries whose stream entry was deleted (removed from the pending list).
    pub deleted: u64,
    /// Delayed entries promoted back into the stream.
    pub promoted: u64,
    /// More reclaimable entries exist than this call took (or, with `count = 0`, any exist).
    pub more: bool,
    /// Time until the earliest delayed entry is due, if any remain.
    pub next_due: Option<Duration>,
}

/// Per-consumer settings a backend needs.
#[derive(Debug, Clone)]
pub(crate) struct ConsumerSpec {
    pub queue: String,
    pub consumer: String,
    pub claim_timeout: Duration,
    pub heartbeat: Duration,
    pub max_deliveries: Option<u32>,
    /// The queue's rate limit as this consumer applies it (the gated read's gate).
    pub rate_limit: Option<crate::RateLimit>,
    /// [`crate::ConsumerOptions::max_concurrency`].
    pub max_concurrency: Option<u32>,
    /// [`crate::ConsumerOptions::concurrency_per_key`].
    pub concurrency_per_key: Option<u32>,
}

/// What a backend found for one id of a settlement or renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Owned {
    /// Applied: the entry was this consumer's (or [`PARKED`] where allowed), of the fence
    /// given, if one was.
    Done,
    /// Not pending at all: acknowledged (possibly by an earlier attempt of this very call) or
    /// deleted.
    Gone,
    /// Another consumer owns the entry now, or a later delivery of it (another fence).
    Other,
}

/// One settlement of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SettleOp {
    /// XACK + XDEL.
    Ack,
    /// Hand the entry to [`PARKED`] with idle 0: reclaimable by any consumer after `claim_timeout`.
    Park,
}

/// One settlement: `released` allows the entry to be owned by [`PARKED`] instead of this
/// consumer (its lease was released past `max_processing_time`, nobody took it since).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Settle {
    pub id: MessageId,
    pub op: SettleOp,
    pub released: bool,
    /// The delivery's fence, when the settlement is for that delivery only (module docs).
    pub fence: Option<u64>,
}

/// What one heartbeat found.
#[derive(Debug, Default)]
pub(crate) struct Beat {
    /// Ids to renew (or quiet) that another consumer owns now (or a later delivery of: another
    /// fence).
    pub lost: Vec<MessageId>,
    /// Ids to renew (or quiet) that are not pending any more (acked or deleted) or belong to
    /// [`PARKED`] (handed back): nobody took them.
    pub gone: Vec<MessageId>,
    /// Entries this consumer owned without holding them (idle past the orphan threshold), now
    /// handed to [`PARKED`] with their idle time kept.
    pub orphans: u64,
    /// Positions in the renew list of ids this consumer owns under another fence than the one
    /// given (a later delivery of the entry): not renewed, and not counted as held.
    pub stale: Vec<usize>,
}

/// Queue-level operations of a backend.
#[async_trait]
pub(crate) trait QueueBackend: Send + Sync + 'static {
    /// Appends payloads at the tail, in order, in one round trip; returns their ids.
    /// `key`: the concurrency key of every entry (field `k` on Redis), if any; `priority` their
    /// priority ([`crate::OfferOptions::priority`], validated; field `pr` on Redis when not 0).
    async fn offer(
        &self,
        queue: &str,
        payloads: &[Bytes],
        key: Option<&str>,
        priority: i8,
    ) -> Result<Vec<MessageId>, QueueError>;
    /// Creates the consumer group if missing, registers the consumer and writes its first
    /// liveness record. Called on the consumer's lease thread: connections it opens live there.
    async fn open_consumer(&self, spec: ConsumerSpec) -> Result<Arc<dyn ConsumerBackend>, QueueError>;
    async fn stats(&self, queue: &str) -> Result<QueueStats, QueueError>;
    /// Shuts (`paused = true`) or opens the queue's pause gate, the gate every read of new
    /// entries ([`ConsumerBackend::read_new`]) checks atomically with taking them; an open wakes
    /// the consumers waiting on it at once. Returns `true` when the state changed.
    async fn set_paused(&self, queue: &str, paused: bool) -> Result<bool, QueueError>;
    /// The group's consumers (the parked owner left out), each with at most `max_leases` of its
    /// oldest owned entries.
    async fn consumers(&self, queue: &str, max_leases: usize) -> Result<Vec<crate::ConsumerInfo>, QueueError>;
    /// Oldest first, at most `limit`.
    async fn dead_letters(&self, queue: &str, limit: usize) -> Result<Vec<DeadLetter>, QueueError>;
    /// Moves one dead letter back to the queue's tail (fresh delivery count); returns the new id.
    async fn replay_dead_letter(&self, queue: &str, id: MessageId) -> Result<MessageId, QueueError>;
    /// Moves up to `limit` dead letters back; returns how many.
    async fn replay_dead_letters(&self, queue: &str, limit: usize) -> Result<u64, QueueError>;
    /// Deletes all dead letters; returns how many there were.
    async fn purge_dead_letters(&self, queue: &str) -> Result<u64, QueueError>;
    /// Adds, moves or removes a scheduled entry, or counts them (see [`ScheduleOp`]).
    async fn schedule(&self, queue: &str, op: ScheduleOp<'_>) -> Result<ScheduleReply, QueueError>;
}

/// An operation on a queue's scheduled entries (named members of its delayed set).
pub(crate) enum ScheduleOp<'a> {
    /// Adds (or replaces) entry `name`, due at `due_ms` (ms since the epoch).
    Add { name: &'a str, due_ms: u64, payload: &'a [u8], key: Option<&'a str>, priority: i8 },
    /// Sets the due time of entry `name` if it still waits.
    Move { name: &'a str, due_ms: u64 },
    /// Removes entry `name` if it still waits.
    Remove { name: &'a str },
    /// Counts them.
    Count,
}

/// What a [`ScheduleOp`] did.
pub(crate) enum ScheduleReply {
    /// Add: a new entry (`true`) or a replaced one; Move / Remove: the entry was waiting.
    Done(bool),
    /// Count: how many wait, and the due time (ms) of the earliest.
    Count(u64, Option<u64>),
}

/// Operations of one registered consumer, all called on its lease thread (except
/// [`ConsumerBackend::ack_now`] and [`ConsumerBackend::redis_target`]).
#[async_trait]
pub(crate) trait ConsumerBackend: Send + Sync {
    /// Reads up to `count` never-delivered entries, waiting up to `block` for the first.
    /// Recreates the group when it is missing (NOGROUP).
    ///
    /// The gated read: the queue's gates (the pause flag, `max_concurrency`,
    /// `concurrency_per_key` of [`ConsumerSpec`]) are checked atomically with taking the
    /// entries, so nothing new is taken while one is shut; a shut gate is waited on (until it
    /// opens or `block` ends) without polling. An entry whose key is at its cap (or has waiters)
    /// goes to its key's waiting line instead of being taken. The only way new work enters a
    /// consumer (in-process and remote): later gates (priorities, rate limits) go here too.
    /// Reclaims and redeliveries do not pass here.
    async fn read_new(&self, count: usize, block: Duration) -> Result<Vec<RawDelivery>, QueueError>;
    /// Promotes due delayed entries, then takes over up to `count` reclaimable entries (see the
    /// module docs; never this consumer's own, never an id in `exclude`), dead-lettering those
    /// past `max_deliveries` in the same atomic step. `count = 0` only promotes and tells
    /// whether reclaimable entries exist ([`Reclaimed::more`]).
    async fn reclaim(&self, count: usize, exclude: &[MessageId]) -> Result<Reclaimed, QueueError>;
    /// Applies acks and parks in one atomic call; one [`Owned`] per item, in order.
    async fn settle(&self, items: &[Settle]) -> Result<Vec<Owned>, QueueError>;
    /// [`ConsumerBackend::settle`] of one ack, done at once on the caller's thread without a
    /// round trip, when the backend can (memory: one lock). `None`: go through the lease thread.
    fn ack_now(&self, id: MessageId, released: bool) -> Option<Owned> {
        let _ = (id, released);
        None
    }
    /// True when the backend lives in this process: its operations complete without I/O, and
    /// [`ConsumerBackend::ack_now`] answers.
    fn in_process(&self) -> bool {
        false
    }
    /// Redis only: where this consumer's entries live, for acks done in a caller's script.
    fn redis_target(&self) -> Option<crate::api::RedisAckTarget> {
        None
    }
    /// Schedules redelivery after `delay` (ownership as for [`Settle::released`]): below
    /// `claim_timeout` the entry goes to [`PARKED`] with idle `claim_timeout - delay`, else to the
    /// delayed set. The delivery count is set back by one: a scheduled re-poll is not a delivery.
    /// `fence`: as [`Settle::fence`].
    async fn retry_after(
        &self,
        id: MessageId,
        delay: Duration,
        released: bool,
        fence: Option<u64>,
    ) -> Result<Owned, QueueError>;
    /// Shuts the queue's back-off gate for `delay` from now (backend time): no consumer of the
    /// queue takes new entries ([`ConsumerBackend::read_new`]) until then. Only ever extends a
    /// back-off in force, atomically.
    async fn back_off(&self, delay: Duration) -> Result<(), QueueError>;
    /// Moves the entry to dead letters (ownership as for [`Settle::released`], `fence` as
    /// [`Settle::fence`]).
    async fn dead_letter(
        &self,
        id: MessageId,
        deliveries: u32,
        reason: &str,
        released: bool,
        fence: Option<u64>,
    ) -> Result<Owned, QueueError>;
    /// One heartbeat, atomically: writes this consumer's liveness record; renews each id of
    /// `renew` and of `quiet` (settlements in flight) this consumer owns (idle 0); reports the
    /// others: owned by another consumer (lost), or by [`PARKED`] or not pending (gone); hands each id of `release` it
    /// owns to [`PARKED`] reclaimable at once (idle = claim timeout); hands every other entry it
    /// owns idle at least `orphan_idle` to [`PARKED`], idle kept. `pel_limit` bounds how many of
    /// its pending entries are looked at. `fences`: empty, or the fence of each id of `renew`
    /// (in order): an id this consumer owns under another fence is [`Beat::stale`] (not
    /// renewed, not held).
    #[allow(clippy::too_many_arguments)]
    async fn heartbeat(
        &self,
        renew: &[MessageId],
        fences: &[u64],
        quiet: &[MessageId],
        release: &[MessageId],
        orphan_idle: Duration,
        pel_limit: usize,
    ) -> Result<Beat, QueueError>;
    /// Removes other consumers that own no pending entry and whose liveness record is at least
    /// `window` old (or, without a record, idle at least `window`); returns how many.
    async fn reap_idle_consumers(&self, window: Duration) -> Result<u64, QueueError>;
    /// Puts entries this consumer owns back at the stream's tail as new entries (new ids, the
    /// delivery that did not run not counted), for entries acquired while stopping; returns how
    /// many. `fences`: empty, or the fence of each id (in order): those of another fence are left
    /// alone.
    async fn requeue(&self, ids: &[MessageId], fences: &[u64]) -> Result<u64, QueueError>;
    /// Leaves the group if this consumer owns no pending entry (checked atomically); `true` if it
    /// left. Otherwise marks its liveness record stopped: the reclaim that takes its last entry
    /// removes it.
    async fn leave(&self) -> Result<bool, QueueError>;
}
