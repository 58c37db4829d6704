//! The seam between the [`CommandStore`](super::CommandStore) and its backends: the
//! [`StateBackend`] trait, what its calls take and return, the change hub both backends feed,
//! and the store's settings. `memory.rs` and `redis.rs` import this module, never `mod.rs`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::feed::{EventFrom, EventOffset, EventPage, FeedSettings};
use crate::model::{CommandMsg, Cursor};
use crate::{CommandError, CommandState, CommandStatus, StatusCounts};

/// An event to append to the home queue's feed with a write (see `feed.rs`): its stored JSON
/// and the queue's retention.
#[derive(Clone, Debug)]
pub(crate) struct FeedAppend {
    pub json: String,
    pub max_len: u64,
}

/// Lifetimes of stored command states: the settings of a [`CommandStore`](crate::CommandStore) (given to
/// [`CommandStore::memory_with`](crate::CommandStore::memory_with), or as [`RedisCommandStoreOptions::settings`](crate::RedisCommandStoreOptions::settings)).
#[derive(Clone, Debug)]
pub struct CommandStoreSettings {
    /// A non-terminal state expires this long after its last write. Default 7 days; at least 1 s.
    pub state_ttl: Duration,
    /// A terminal state is kept this long after completion. Default 24 h; at least 1 s.
    pub retention: Duration,
    /// The event feed of every queue without its own ([`CommandStore::set_feed`](crate::CommandStore::set_feed)).
    /// Default: on, the newest 100,000 events per queue.
    pub feed: FeedSettings,
    /// Per home queue: its states' lifetimes in place of `state_ttl` and `retention` (every
    /// process writing the queue's commands should have the same). Default: none.
    pub lifetimes: HashMap<String, Lifetimes>,
}

/// The lifetimes of one queue's command states ([`CommandStoreSettings::lifetimes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetimes {
    /// A non-terminal state expires this long after its last write; at least 1 s.
    pub state_ttl: Duration,
    /// A terminal state is kept this long after completion; at least 1 s.
    pub retention: Duration,
}

impl Default for CommandStoreSettings {
    fn default() -> Self {
        Self {
            state_ttl: Duration::from_secs(7 * 24 * 3600),
            retention: Duration::from_secs(24 * 3600),
            feed: FeedSettings::default(),
            lifetimes: HashMap::new(),
        }
    }
}

impl CommandStoreSettings {
    pub(crate) fn validate(&self) -> Result<(), CommandError> {
        let short = |l: &Lifetimes| l.state_ttl < Duration::from_secs(1) || l.retention < Duration::from_secs(1);
        if short(&Lifetimes { state_ttl: self.state_ttl, retention: self.retention }) {
            return Err(CommandError::InvalidSettings("state_ttl and retention must be at least 1s".into()));
        }
        if let Some((q, _)) = self.lifetimes.iter().find(|(_, l)| short(l)) {
            return Err(CommandError::InvalidSettings(format!(
                "queue {q:?}: state_ttl and retention must be at least 1s"
            )));
        }
        self.feed.validate()
    }

    /// The lifetimes of `queue`'s states.
    pub fn lifetimes_of(&self, queue: &str) -> Lifetimes {
        self.lifetimes.get(queue).copied().unwrap_or(Lifetimes { state_ttl: self.state_ttl, retention: self.retention })
    }

    /// The TTL a state of home queue `queue` gets when written with `status`.
    pub(crate) fn ttl_for(&self, queue: &str, status: CommandStatus) -> Duration {
        let l = self.lifetimes_of(queue);
        if status.is_terminal() {
            l.retention
        } else {
            l.state_ttl
        }
    }
}

/// What a submit found.
pub(crate) enum SubmitOutcome {
    /// Stored as given (with backend bookkeeping filled in).
    Created(CommandState),
    /// Same id and body: the stored state.
    Existing(CommandState),
    /// Same id, other body.
    Conflict,
    /// Same id on another queue.
    OtherQueue,
}

/// One submit of a [`StateBackend::submit_many`]: the arguments of [`StateBackend::submit`].
#[derive(Clone, Copy)]
pub(crate) struct SubmitItem<'a> {
    pub state: &'a CommandState,
    pub body: &'a str,
    pub msg: &'a CommandMsg,
    pub event: Option<&'a FeedAppend>,
}

/// What a reschedule found.
pub(crate) enum Rescheduled {
    /// Written and moved; the state as stored.
    Done(CommandState),
    /// The version moved on (the current state attached) or the state is gone (`None`).
    Conflict(Option<CommandState>),
    /// The message does not wait in the delayed set any more (enqueued); the current state.
    NotWaiting(CommandState),
}

/// What a compare-and-set found.
pub(crate) enum Cas {
    /// Written; the state as stored.
    Done(CommandState),
    /// The version moved on (the current state attached) or the state is gone (`None`).
    Conflict(Option<CommandState>),
    /// Nothing written: the write required its delivery's consumer to own the delivery
    /// ([`DeliveryRef::owned`]) and it does not any more (taken over, settled or handed back).
    Lost,
}

/// A state backend. Writes are compare-and-set on `version`; a backend publishes each successful
/// write to the hub (locally) and, on Redis, to the home queue's channel.
#[async_trait]
pub(crate) trait StateBackend: Send + Sync + 'static {
    /// Stores `state` (version 1) and enqueues `msg` on its queue, atomically (see crate docs);
    /// a created state also appends `event` to the queue's feed in the same step.
    async fn submit(
        &self,
        state: &CommandState,
        body: &str,
        msg: &CommandMsg,
        event: Option<&FeedAppend>,
    ) -> Result<SubmitOutcome, CommandError>;
    /// [`StateBackend::submit`] of each item, decided in order as alone; one outcome per item.
    /// Default: one submit after the other. Redis: together (see `CommandStore::submit_many`).
    async fn submit_many(&self, items: &[SubmitItem<'_>]) -> Vec<Result<SubmitOutcome, CommandError>> {
        let mut out = Vec::with_capacity(items.len());
        for it in items {
            out.push(self.submit(it.state, it.body, it.msg, it.event).await);
        }
        out
    }
    /// The state of `id` in `home`'s storage.
    async fn load(&self, home: &str, id: &str) -> Result<Option<CommandState>, CommandError>;
    /// Version and status of `id`'s state, its document decoded only when asked for (waiters
    /// look at many non-terminal states and return only one). Default: [`StateBackend::load`].
    async fn peek(&self, home: &str, id: &str) -> Result<Option<Peeked>, CommandError> {
        Ok(self.load(home, id).await?.map(Peeked::from))
    }
    /// The home queue of `id`, if known.
    async fn home_of(&self, id: &str) -> Result<Option<String>, CommandError>;
    /// A random secret named `name` (32 bytes), the same for every store on this backend (every
    /// process on the same Redis): created by the first that asks, kept forever.
    async fn shared_secret(&self, name: &str) -> Result<Vec<u8>, CommandError>;
    /// CAS: replaces the state at version `new.version - 1` (whose status was `old`) by `new`.
    /// A terminal state is replaced only by a re-run: `old` terminal, `new` not, with `enqueue`
    /// (every other write to a terminal state is a conflict: the first terminal write wins).
    /// With `enqueue`, also enqueues the message on that queue in the same atomic step; only
    /// allowed when [`StateBackend::atomic_enqueue`] says so. With `delivery` (only when
    /// [`StateBackend::can_fold_ack`] says so): its `owned` check in the same atomic step
    /// ([`Cas::Lost`] when it fails), and with its `ack`, a successful write also acks it; the
    /// `bool` tells whether it did (the caller then settles the lease with `mark_acked`, or
    /// skips the remote worker's ack). A successful write appends `event` to the home queue's
    /// feed in the same atomic step, and with `hook` (a completion hook body, see
    /// [`crate::hooks`]), enqueues it on the home queue's delivery queue in that step too.
    async fn transition(
        &self,
        old: CommandStatus,
        new: CommandState,
        enqueue: Option<(&str, &CommandMsg)>,
        delivery: Option<&DeliveryRef>,
        event: Option<&FeedAppend>,
        hook: Option<&str>,
    ) -> Result<(Cas, bool), CommandError>;
    /// CAS of a scheduled `SUBMITTED` state to `new` (its new `run_at`), moving its message in
    /// its home queue's delayed set to the new due time in the same atomic step, only while the
    /// message still waits there; appends `event` with a successful write.
    async fn reschedule(&self, new: CommandState, event: Option<&FeedAppend>) -> Result<Rescheduled, CommandError>;
    /// True when a transition of a state homed in `home` can enqueue on `target` atomically.
    fn atomic_enqueue(&self, home: &str, target: &str) -> bool;
    /// True when a transition of a state homed in `home` can ack (or check the owner of) a
    /// delivery of `queue` in the same atomic step (Redis: same slot; memory: never, its acks
    /// and owner checks are immediate anyway).
    fn can_fold_ack(&self, home: &str, queue: &str) -> bool;
    /// Enqueues a message on `queue` (non-atomic path).
    async fn enqueue(&self, queue: &str, msg: &CommandMsg) -> Result<(), CommandError>;
    /// `queue`'s commands, newest first, after `cursor`, created at `min_ms` or later, at most
    /// `limit`, and the cursor of the last id looked at when more may follow (states gone
    /// meanwhile are skipped, the cursor still passes them).
    async fn list(
        &self,
        queue: &str,
        status: Option<CommandStatus>,
        limit: usize,
        cursor: Option<Cursor>,
        min_ms: u64,
    ) -> Result<(Vec<CommandState>, Option<Cursor>), CommandError>;
    async fn counts(&self, queue: &str) -> Result<StatusCounts, CommandError>;
    /// `queue`'s per-minute aggregates ([`crate::minutes`]): the last `last` minutes (1 to
    /// [`crate::minutes::MINUTES_KEPT`]) up to the backend clock's current one, oldest first.
    async fn minutes(&self, queue: &str, last: usize) -> Result<Vec<crate::minutes::MinuteStats>, CommandError>;
    /// Samples `queue`'s depth and oldest age into the current minute unless it has a sample;
    /// true when this call's sample was kept.
    async fn sample_minute(&self, queue: &str) -> Result<bool, CommandError>;
    /// Makes sure remote writes to `home`'s commands reach the hub (Redis pub/sub).
    async fn watch_home(&self, home: &str) -> Result<(), CommandError>;
    /// Events of `queue`'s feed from `from`, at most `limit`; with `id`, only that command's,
    /// looking at most at `scan` entries. `next_offset` is after the last entry looked at (the
    /// tail for an empty read from [`EventFrom::Now`]).
    async fn feed_read(
        &self,
        queue: &str,
        from: EventFrom,
        id: Option<&str>,
        limit: usize,
        scan: usize,
    ) -> Result<EventPage, CommandError>;
    /// Makes sure appends after `after` to `queue`'s feed by any process wake the hub's feed
    /// waiters of `queue` ([`Hub::feed`]); the memory backend's appends wake them directly.
    async fn feed_watch(&self, queue: &str, after: EventOffset) -> Result<(), CommandError>;

    /// The stored record (JSON) of `queue`'s cron schedule `name` (see `schedules.rs`), `None`
    /// when absent, and the backend's clock in ms since the Unix epoch (on Redis the time of the
    /// node holding the record: every process decides due times by that one clock).
    async fn schedule_read(&self, queue: &str, name: &str) -> Result<(Option<String>, i64), CommandError>;

    /// Replaces the record of `queue`'s schedule `name` with `new` if it is still `expected`
    /// (`None`: absent), atomically; true when written.
    async fn schedule_cas(
        &self,
        queue: &str,
        name: &str,
        expected: Option<&str>,
        new: &str,
    ) -> Result<bool, CommandError>;
}

/// A state seen by [`StateBackend::peek`].
pub(crate) struct Peeked {
    pub version: u64,
    pub status: CommandStatus,
    raw: PeekedDoc,
}

enum PeekedDoc {
    State(Box<CommandState>),
    /// The stored JSON document, decoded by [`Peeked::into_state`].
    Json(String, Vec<u8>),
}

impl Peeked {
    pub fn json(id: &str, version: u64, status: CommandStatus, doc: Vec<u8>) -> Self {
        Peeked { version, status, raw: PeekedDoc::Json(id.to_string(), doc) }
    }

    pub fn into_state(self) -> Result<CommandState, CommandError> {
        match self.raw {
            PeekedDoc::State(s) => Ok(*s),
            PeekedDoc::Json(id, doc) => {
                serde_json::from_slice(&doc).map_err(|e| CommandError::Corrupt { id, reason: e.to_string() })
            }
        }
    }
}

impl From<CommandState> for Peeked {
    fn from(s: CommandState) -> Self {
        Peeked { version: s.version, status: s.status, raw: PeekedDoc::State(Box::new(s)) }
    }
}

/// In-process fan-out of state changes: waiters by id, and cancellation tokens of running handlers.
#[derive(Default)]
pub(crate) struct Hub {
    waiters: Mutex<HashMap<String, watch::Sender<Option<CommandState>>>>,
    /// Running handlers: id → (version of the state they run, cancellation token).
    running: Mutex<HashMap<String, (u64, CancellationToken)>>,
    /// Ids cancelled lately (when, at which version), so a handler that registers *after* the
    /// cancel (its dispatch read the state just before the cancel was written) is signalled at
    /// once.
    recent_cancels: Mutex<HashMap<String, (std::time::Instant, u64)>>,
    /// Per queue: woken on every append to its feed seen by this process.
    feeds: std::sync::RwLock<HashMap<String, Arc<FeedWaiters>>>,
}

/// The readers of a queue's feed waiting for its next event (see [`StateBackend::feed_watch`]).
#[derive(Default)]
pub(crate) struct FeedWaiters {
    /// Woken (`notify_waiters`) on every append this process sees.
    pub notify: tokio::sync::Notify,
    /// Readers waiting now (a Redis tail watcher stops when there are none).
    pub waiting: std::sync::atomic::AtomicUsize,
}

/// How long a cancel is remembered for handlers that register late.
const RECENT_CANCEL_TTL: Duration = Duration::from_secs(600);
/// Remembered cancels above which old ones are pruned.
const RECENT_CANCEL_PRUNE_AT: usize = 10_000;

impl Hub {
    /// A write made by this process.
    pub fn local(&self, state: &CommandState) {
        if state.status == CommandStatus::Cancelled {
            self.cancel_running(&state.id, state.version);
        }
        if let Some(tx) = self.waiters.lock().unwrap().get(&state.id) {
            tx.send_replace(Some(state.clone()));
        }
    }

    /// A write announced by Redis (only terminal ones are), at `version`. `own`: written by this
    /// store, so [`Hub::local`] has already told (or is about to tell) the waiters, with the
    /// state; they are not woken a second time to re-read it. A cancel still signals
    /// (idempotent), in case the writer's reply was lost.
    pub fn remote(&self, id: &str, status: CommandStatus, version: u64, own: bool) {
        if status == CommandStatus::Cancelled {
            self.cancel_running(id, version);
        }
        if own {
            return;
        }
        if let Some(tx) = self.waiters.lock().unwrap().get(id) {
            // No state attached: the waiter re-reads.
            tx.send_replace(None);
        }
    }

    /// A cancel of `id` written at `version`: signals a handler running a state read before it
    /// (a lower version), now or when it registers later. A handler of a later state (the
    /// command re-run after the cancel, [`CommandStore::retry`](crate::CommandStore::retry)) is
    /// not signalled, however late the announcement comes.
    pub(crate) fn cancel_running(&self, id: &str, version: u64) {
        {
            // Remember first, then look for a running handler; `running` does the reverse, so
            // one of the two always sees the other.
            let mut recent = self.recent_cancels.lock().unwrap();
            if recent.len() >= RECENT_CANCEL_PRUNE_AT {
                recent.retain(|_, (at, _)| at.elapsed() < RECENT_CANCEL_TTL);
            }
            let e = recent.entry(id.to_string()).or_insert((std::time::Instant::now(), version));
            if e.1 <= version {
                *e = (std::time::Instant::now(), version);
            }
        }
        if let Some((read, t)) = self.running.lock().unwrap().get(id) {
            if *read < version {
                t.cancel();
            }
        }
    }

    /// The notifier of `queue`'s feed appends (see [`StateBackend::feed_watch`]).
    pub(crate) fn feed(&self, queue: &str) -> Arc<FeedWaiters> {
        if let Some(w) = self.feeds.read().unwrap().get(queue) {
            return w.clone();
        }
        self.feeds.write().unwrap().entry(queue.to_string()).or_default().clone()
    }

    /// Wakes the waiters of `queue`'s feed, if any (a read lock and an atomic load when there
    /// are none: every write with an event calls it).
    pub(crate) fn feed_appended(&self, queue: &str) {
        if let Some(w) = self.feeds.read().unwrap().get(queue) {
            if w.waiting.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                w.notify.notify_waiters();
            }
        }
    }

    pub(crate) fn subscribe(&self, id: &str) -> watch::Receiver<Option<CommandState>> {
        self.waiters.lock().unwrap().entry(id.to_string()).or_insert_with(|| watch::channel(None).0).subscribe()
    }

    pub(crate) fn unsubscribe(&self, id: &str) {
        let mut w = self.waiters.lock().unwrap();
        if w.get(id).is_some_and(|tx| tx.receiver_count() == 0) {
            w.remove(id);
        }
    }

    /// Registers the cancellation token of a handler running `id`'s state of `version`
    /// (removed by the guard's drop).
    pub fn running(self: &Arc<Self>, id: &str, version: u64, token: CancellationToken) -> RunningGuard {
        {
            // The latest run's registration wins (an older run still ending keeps its token, and
            // its guard leaves this one in place).
            let mut running = self.running.lock().unwrap();
            let e = running.entry(id.to_string()).or_insert((version, token.clone()));
            if e.0 <= version {
                *e = (version, token.clone());
            }
        }
        let cancelled = self.recent_cancels.lock().unwrap().get(id).copied();
        if cancelled.is_some_and(|(at, v)| at.elapsed() < RECENT_CANCEL_TTL && v > version) {
            token.cancel();
        }
        RunningGuard { hub: self.clone(), id: id.to_string(), version }
    }
}

pub(crate) struct RunningGuard {
    hub: Arc<Hub>,
    id: String,
    version: u64,
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        // Only its own registration: a later run of the command (a re-run) may have replaced it.
        let mut running = self.hub.running.lock().unwrap();
        if running.get(&self.id).is_some_and(|(v, _)| *v == self.version) {
            running.remove(&self.id);
        }
    }
}

/// Unsubscribes a waiter from the hub when dropped.
pub(crate) struct Unsub<'a>(pub &'a Hub, pub &'a str);

impl Drop for Unsub<'_> {
    fn drop(&mut self) {
        self.0.unsubscribe(self.1);
    }
}

/// Index keys/ordering shared by the backends: the index a status lives in.
pub(crate) fn status_slot(s: Option<CommandStatus>) -> usize {
    s.map(|s| s.index() + 1).unwrap_or(0)
}

/// The delivery a transition is written for (Redis): its message id and where it lives
/// ([`baton_queue::Lease::redis_target`] or [`baton_queue::RemoteConsumer::redis_target`]); with
/// `ack`, a successful write acks it in the same atomic step; with `owned`, the write happens only
/// while the target's consumer owns the delivery ([`Cas::Lost`] otherwise), and, with `fence`,
/// while the entry's fence is still that delivery's ([`baton_queue::RemoteDelivery::fence`]: a
/// later delivery to the same consumer is not this writer's), checked in the same atomic step.
#[derive(Clone, Debug)]
pub(crate) struct DeliveryRef {
    pub id: String,
    pub target: baton_queue::RedisAckTarget,
    pub ack: bool,
    pub owned: bool,
    pub fence: Option<u64>,
}
