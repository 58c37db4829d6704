//! The state store: one versioned JSON state per command, written only by compare-and-set, with
//! per-queue status indexes, counts, and change notifications. Two backends side by side:
//! `memory.rs` and `redis.rs` (key layout in the crate docs).

mod batch;
mod commit;
mod memory;
mod redis;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::model::{canonical_body, new_token, CommandMsg, Cursor};
use crate::{
    validate_id, validate_queue, validate_type, Command, CommandError, CommandHandler, CommandPage, CommandState,
    CommandStatus, ListQuery, StatusCounts, Timestamp,
};

pub use self::redis::RedisCommandStoreOptions;

/// Lifetimes of stored command states: the settings of a [`CommandStore`] (given to
/// [`CommandStore::memory_with`], or as [`RedisCommandStoreOptions::settings`]).
#[derive(Clone, Debug)]
pub struct CommandStoreSettings {
    /// A non-terminal state expires this long after its last write. Default 7 days; at least 1 s.
    pub state_ttl: Duration,
    /// A terminal state is kept this long after completion. Default 24 h; at least 1 s.
    pub retention: Duration,
}

impl Default for CommandStoreSettings {
    fn default() -> Self {
        Self { state_ttl: Duration::from_secs(7 * 24 * 3600), retention: Duration::from_secs(24 * 3600) }
    }
}

impl CommandStoreSettings {
    fn validate(&self) -> Result<(), CommandError> {
        if self.state_ttl < Duration::from_secs(1) || self.retention < Duration::from_secs(1) {
            return Err(CommandError::InvalidSettings("state_ttl and retention must be at least 1s".into()));
        }
        Ok(())
    }
    /// The TTL a state gets when written with `status`.
    pub(crate) fn ttl_for(&self, status: CommandStatus) -> Duration {
        if status.is_terminal() {
            self.retention
        } else {
            self.state_ttl
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

/// What a compare-and-set found.
pub(crate) enum Cas {
    /// Written; the state as stored.
    Done(CommandState),
    /// The version moved on (the current state attached) or the state is gone (`None`).
    Conflict(Option<CommandState>),
}

/// A state backend. Writes are compare-and-set on `version`; a backend publishes each successful
/// write to the hub (locally) and, on Redis, to the home queue's channel.
#[async_trait]
pub(crate) trait StateBackend: Send + Sync + 'static {
    /// Stores `state` (version 1) and enqueues `msg` on its queue, atomically (see crate docs).
    async fn submit(&self, state: &CommandState, body: &str, msg: &CommandMsg) -> Result<SubmitOutcome, CommandError>;
    /// The state of `id` in `home`'s storage.
    async fn load(&self, home: &str, id: &str) -> Result<Option<CommandState>, CommandError>;
    /// Version and status of `id`'s state, its document decoded only when asked for (waiters
    /// look at many non-terminal states and return only one). Default: [`StateBackend::load`].
    async fn peek(&self, home: &str, id: &str) -> Result<Option<Peeked>, CommandError> {
        Ok(self.load(home, id).await?.map(Peeked::from))
    }
    /// The home queue of `id`, if known.
    async fn home_of(&self, id: &str) -> Result<Option<String>, CommandError>;
    /// CAS: replaces the state at version `new.version - 1` (whose status was `old`) by `new`.
    /// With `enqueue`, also enqueues the message on that queue in the same atomic step; only
    /// allowed when [`StateBackend::atomic_enqueue`] says so. With `ack` (only when
    /// [`StateBackend::can_fold_ack`] says so), a successful write also acks that delivery in the
    /// same atomic step if its consumer still owns it; the `bool` tells whether it did (the
    /// caller then settles the lease with `mark_acked`).
    async fn transition(
        &self,
        old: CommandStatus,
        new: CommandState,
        enqueue: Option<(&str, &CommandMsg)>,
        ack: Option<&baton_queue::Lease>,
    ) -> Result<(Cas, bool), CommandError>;
    /// True when a transition of a state homed in `home` can enqueue on `target` atomically.
    fn atomic_enqueue(&self, home: &str, target: &str) -> bool;
    /// True when a transition of a state homed in `home` can ack a delivery of `queue` in the
    /// same atomic step (Redis: same slot; memory acks are immediate anyway: never).
    fn can_fold_ack(&self, home: &str, queue: &str) -> bool;
    /// Enqueues a message on `queue` (non-atomic path).
    async fn enqueue(&self, queue: &str, msg: &CommandMsg) -> Result<(), CommandError>;
    /// Ids of `queue`'s commands, newest first, after `cursor`, at most `limit`, and the cursor
    /// of the last returned item when more may follow.
    async fn list(
        &self,
        queue: &str,
        status: Option<CommandStatus>,
        limit: usize,
        cursor: Option<Cursor>,
    ) -> Result<(Vec<CommandState>, Option<Cursor>), CommandError>;
    async fn counts(&self, queue: &str) -> Result<StatusCounts, CommandError>;
    /// Makes sure remote writes to `home`'s commands reach the hub (Redis pub/sub).
    async fn watch_home(&self, home: &str) -> Result<(), CommandError>;
}

/// A state seen by [`StateBackend::peek`].
/// A service's id and the handlers it runs.
type ServiceHandlers = (u64, Arc<Handlers>);

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
    running: Mutex<HashMap<String, CancellationToken>>,
    /// Ids cancelled lately, so a handler that registers *after* the cancel (its dispatch read
    /// the state just before the cancel was written) is signalled at once.
    recent_cancels: Mutex<HashMap<String, std::time::Instant>>,
}

/// How long a cancel is remembered for handlers that register late.
const RECENT_CANCEL_TTL: Duration = Duration::from_secs(600);
/// Remembered cancels above which old ones are pruned.
const RECENT_CANCEL_PRUNE_AT: usize = 10_000;

impl Hub {
    /// A write made by this process.
    pub fn local(&self, state: &CommandState) {
        if state.status == CommandStatus::Cancelled {
            self.cancel_running(&state.id);
        }
        if let Some(tx) = self.waiters.lock().unwrap().get(&state.id) {
            tx.send_replace(Some(state.clone()));
        }
    }

    /// A write announced by Redis (only terminal ones are). `own`: written by this store, so
    /// [`Hub::local`] has already told (or is about to tell) the waiters, with the state; they
    /// are not woken a second time to re-read it. A cancel still signals (idempotent), in case
    /// the writer's reply was lost.
    pub fn remote(&self, id: &str, status: CommandStatus, own: bool) {
        if status == CommandStatus::Cancelled {
            self.cancel_running(id);
        }
        if own {
            return;
        }
        if let Some(tx) = self.waiters.lock().unwrap().get(id) {
            // No state attached: the waiter re-reads.
            tx.send_replace(None);
        }
    }

    fn cancel_running(&self, id: &str) {
        {
            // Remember first, then look for a running handler; `running` does the reverse, so
            // one of the two always sees the other.
            let mut recent = self.recent_cancels.lock().unwrap();
            if recent.len() >= RECENT_CANCEL_PRUNE_AT {
                recent.retain(|_, at| at.elapsed() < RECENT_CANCEL_TTL);
            }
            recent.insert(id.to_string(), std::time::Instant::now());
        }
        if let Some(t) = self.running.lock().unwrap().get(id) {
            t.cancel();
        }
    }

    fn subscribe(&self, id: &str) -> watch::Receiver<Option<CommandState>> {
        self.waiters.lock().unwrap().entry(id.to_string()).or_insert_with(|| watch::channel(None).0).subscribe()
    }

    fn unsubscribe(&self, id: &str) {
        let mut w = self.waiters.lock().unwrap();
        if w.get(id).is_some_and(|tx| tx.receiver_count() == 0) {
            w.remove(id);
        }
    }

    /// Registers a running handler's cancellation token (removed by the guard's drop).
    pub fn running(self: &Arc<Self>, id: &str, token: CancellationToken) -> RunningGuard {
        self.running.lock().unwrap().insert(id.to_string(), token.clone());
        if self.recent_cancels.lock().unwrap().get(id).is_some_and(|at| at.elapsed() < RECENT_CANCEL_TTL) {
            token.cancel();
        }
        RunningGuard { hub: self.clone(), id: id.to_string() }
    }
}

pub(crate) struct RunningGuard {
    hub: Arc<Hub>,
    id: String,
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.hub.running.lock().unwrap().remove(&self.id);
    }
}

/// Unsubscribes a waiter from the hub when dropped.
struct Unsub<'a>(&'a Hub, &'a str);

impl Drop for Unsub<'_> {
    fn drop(&mut self) {
        self.0.unsubscribe(self.1);
    }
}

type Handlers = HashMap<String, Arc<dyn CommandHandler>>;

pub(crate) struct StoreInner {
    pub backend: Arc<dyn StateBackend>,
    pub stream: baton_queue::MessageStream,
    pub hub: Arc<Hub>,
    pub settings: CommandStoreSettings,
    /// Queues known to this store (declared, or with services: (service id, handlers)).
    queues: Mutex<HashMap<String, Vec<ServiceHandlers>>>,
    next_service: std::sync::atomic::AtomicU64,
    /// id → home queue of commands submitted through this store (saves the lookup round trip;
    /// bounded: cleared past [`HOME_CACHE_MAX`] entries; a miss or a stale entry falls back to
    /// the backend's lookup).
    homes: Mutex<HashMap<String, String>>,
}

const HOME_CACHE_MAX: usize = 100_000;

/// The command state store shared by every [`crate::CommandService`] of a process (one per
/// backend). Cheap to clone. Submits, reads, cancels, waits for, lists and counts commands.
#[derive(Clone)]
pub struct CommandStore {
    pub(crate) inner: Arc<StoreInner>,
}

/// Fallback re-read period of [`CommandStore::wait`] (in case a notification was lost): 1 s.
const WAIT_FALLBACK: Duration = Duration::from_secs(1);

impl CommandStore {
    /// The in-memory backend (states and queues live in this process) with default settings.
    pub fn memory() -> Self {
        Self::memory_with(CommandStoreSettings::default()).expect("default settings are valid")
    }

    /// The in-memory backend with `settings`. Errors: [`CommandError::InvalidSettings`].
    pub fn memory_with(settings: CommandStoreSettings) -> Result<Self, CommandError> {
        settings.validate()?;
        let hub = Arc::new(Hub::default());
        let stream = baton_queue::MessageStream::memory();
        let backend = Arc::new(memory::MemoryStateBackend::new(stream.clone(), hub.clone(), settings.clone()));
        Ok(Self::assemble(backend, stream, hub, settings))
    }

    /// The Redis backend (standalone or Cluster, as `client` says). Connects now; queues use
    /// `options.key_prefix` and `options.group` (the work queue's defaults:
    /// [`baton_queue::keys::DEFAULT_PREFIX`], [`baton_queue::keys::DEFAULT_GROUP`]).
    ///
    /// Errors: [`CommandError::Connect`], [`CommandError::InvalidSettings`].
    pub async fn redis(
        client: baton_redis::RedisClient,
        options: RedisCommandStoreOptions,
    ) -> Result<Self, CommandError> {
        options.settings.validate()?;
        let hub = Arc::new(Hub::default());
        let stream = baton_queue::MessageStream::redis(
            client.clone(),
            baton_queue::RedisQueueOptions { key_prefix: options.key_prefix.clone(), group: options.group.clone() },
        )
        .await?;
        let settings = options.settings.clone();
        let backend = Arc::new(redis::RedisStateBackend::connect(client, options, stream.clone(), hub.clone()).await?);
        Ok(Self::assemble(backend, stream, hub, settings))
    }

    fn assemble(
        backend: Arc<dyn StateBackend>,
        stream: baton_queue::MessageStream,
        hub: Arc<Hub>,
        settings: CommandStoreSettings,
    ) -> Self {
        Self {
            inner: Arc::new(StoreInner {
                backend,
                stream,
                hub,
                settings,
                queues: Mutex::new(HashMap::new()),
                next_service: std::sync::atomic::AtomicU64::new(1),
                homes: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The work queues under this store (for queue stats, dead letters).
    pub fn messages(&self) -> &baton_queue::MessageStream {
        &self.inner.stream
    }

    /// Declares a queue consumed by another process, so hand-offs to it are accepted here.
    pub fn declare_queue(&self, queue: &str) -> Result<(), CommandError> {
        validate_queue(queue)?;
        self.inner.queues.lock().unwrap().entry(queue.to_string()).or_default();
        Ok(())
    }

    /// True when `queue` has (or had) a service in this store, or was declared.
    pub fn knows_queue(&self, queue: &str) -> bool {
        self.inner.queues.lock().unwrap().contains_key(queue)
    }

    /// Registers a service's handlers for `queue`; returns the registration id. Several
    /// services (instances) may serve one queue; the queue stays known after they stop.
    pub(crate) fn register_service(&self, queue: &str, handlers: Arc<Handlers>) -> u64 {
        let id = self.inner.next_service.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.queues.lock().unwrap().entry(queue.to_string()).or_default().push((id, handlers));
        id
    }

    pub(crate) fn unregister_service(&self, queue: &str, id: u64) {
        if let Some(v) = self.inner.queues.lock().unwrap().get_mut(queue) {
            v.retain(|(i, _)| *i != id);
        }
    }

    fn handler_for(&self, queue: &str, command_type: &str) -> Option<Arc<dyn CommandHandler>> {
        let q = self.inner.queues.lock().unwrap();
        q.get(queue)?.iter().find_map(|(_, h)| h.get(command_type).cloned())
    }

    /// Submits `command` to `queue`: stores its state (`SUBMITTED`, version 1) and enqueues it,
    /// atomically (see the crate docs). Idempotent on id: the same id with the same type and
    /// params returns the stored state (whatever its status now).
    ///
    /// Params are checked first by the `validate` of the handler registered for the type on
    /// `queue` in this process, if any; nothing is stored when they are refused.
    ///
    /// Errors: [`CommandError::InvalidId`], [`CommandError::InvalidType`],
    /// [`CommandError::InvalidParams`], [`CommandError::Queue`] (bad queue name),
    /// [`CommandError::Conflict`] (same id, other type/params or other queue), backend errors.
    pub async fn submit(&self, queue: &str, command: Command) -> Result<CommandState, CommandError> {
        self.submit_created(queue, command).await.map(|(state, _)| state)
    }

    /// [`CommandStore::submit`], also telling whether this call stored the command (`true`) or
    /// found it already stored with the same body (`false`), e.g. to answer 202 or 200 over HTTP.
    /// Errors: those of [`CommandStore::submit`].
    pub async fn submit_created(&self, queue: &str, command: Command) -> Result<(CommandState, bool), CommandError> {
        validate_queue(queue)?;
        validate_id(&command.id)?;
        validate_type(&command.command_type)?;
        if let Some(h) = self.handler_for(queue, &command.command_type) {
            h.validate(&command.params).map_err(CommandError::InvalidParams)?;
        }
        let now = Timestamp::now();
        let token = new_token();
        let state = CommandState {
            id: command.id.clone(),
            queue: queue.to_string(),
            command_type: command.command_type.clone(),
            params: command.params.clone(),
            status: CommandStatus::Submitted,
            result: None,
            error: None,
            attempts: 0,
            errors_count: 0,
            created_at: now,
            started_at: None,
            modified_at: now,
            completed_at: None,
            version: 1,
            handed_off_to: None,
            token: token.clone(),
            prev_token: None,
            lookup_expires_ms: 0,
            body_sha: Default::default(),
        };
        let body = canonical_body(&command.command_type, &command.params);
        let msg = CommandMsg { id: command.id.clone(), home: queue.to_string(), token };
        let remember = |s: &CommandState| {
            let mut h = self.inner.homes.lock().unwrap();
            if h.len() >= HOME_CACHE_MAX {
                h.clear();
            }
            h.insert(s.id.clone(), s.queue.clone());
        };
        match self.inner.backend.submit(&state, &body, &msg).await? {
            SubmitOutcome::Created(s) => {
                remember(&s);
                Ok((s, true))
            }
            SubmitOutcome::Existing(s) => {
                remember(&s);
                Ok((s, false))
            }
            SubmitOutcome::Conflict => Err(CommandError::Conflict { id: command.id, what: "type or params" }),
            SubmitOutcome::OtherQueue => Err(CommandError::Conflict { id: command.id, what: "queue" }),
        }
    }

    /// Submits a command whose params are raw JSON bytes (e.g. an HTTP body). Malformed JSON is
    /// refused with [`CommandError::InvalidParams`] before anything is stored.
    pub async fn submit_json(
        &self,
        queue: &str,
        id: Option<String>,
        command_type: &str,
        params: &[u8],
    ) -> Result<CommandState, CommandError> {
        let params: Value = if params.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(params).map_err(|e| CommandError::InvalidParams(e.to_string()))?
        };
        let command = match id {
            Some(id) => Command::with_id(id, command_type, params),
            None => Command::new(command_type, params),
        };
        self.submit(queue, command).await
    }

    /// Finds `id`: its home queue and current state.
    async fn locate(&self, id: &str) -> Result<Option<(String, CommandState)>, CommandError> {
        let cached = self.inner.homes.lock().unwrap().get(id).cloned();
        if let Some(home) = cached {
            if let Some(st) = self.inner.backend.load(&home, id).await? {
                return Ok(Some((home, st)));
            }
            self.inner.homes.lock().unwrap().remove(id);
        }
        let Some(home) = self.inner.backend.home_of(id).await? else { return Ok(None) };
        Ok(self.inner.backend.load(&home, id).await?.map(|st| (home, st)))
    }

    /// The state of `id`, or `None` (never submitted, or expired).
    pub async fn get(&self, id: &str) -> Result<Option<CommandState>, CommandError> {
        validate_id(id)?;
        Ok(self.locate(id).await?.map(|(_, st)| st))
    }

    /// Cancels `id`: a compare-and-set to `CANCELLED` (with `completed_at`) unless it is terminal.
    /// A handler running it in this process (or, on Redis, in any process subscribed to its
    /// queue) is signalled through [`Command::cancelled`]; its later result is refused.
    ///
    /// Errors: [`CommandError::NotFound`], [`CommandError::AlreadyTerminal`] (the state attached:
    /// the refusal leaves it unchanged).
    pub async fn cancel(&self, id: &str) -> Result<CommandState, CommandError> {
        validate_id(id)?;
        let mut current = self.locate(id).await?.map(|(_, st)| st);
        loop {
            let Some(st) = current else { return Err(CommandError::NotFound(id.to_string())) };
            if st.status.is_terminal() {
                return Err(CommandError::AlreadyTerminal(Box::new(st)));
            }
            let now = Timestamp::now();
            let mut next = st.clone();
            next.status = CommandStatus::Cancelled;
            next.completed_at = Some(now);
            next.modified_at = now;
            next.version += 1;
            match self.write(st.status, next, None).await? {
                Ok(done) => return Ok(done),
                Err(latest) => current = latest,
            }
        }
    }

    /// Waits until `id` is terminal or `timeout` passes, and returns its state then (check
    /// `status.is_terminal()`). Wakes on this process's writes and on Redis notifications; no
    /// polling except a fallback re-read every second. Errors: [`CommandError::NotFound`].
    pub async fn wait(&self, id: &str, timeout: Duration) -> Result<CommandState, CommandError> {
        validate_id(id)?;
        let deadline = tokio::time::Instant::now() + timeout;
        let not_found = || CommandError::NotFound(id.to_string());
        let hub = &self.inner.hub;
        // Subscribe first, then read: no write between the read and the wait is missed, and one
        // read suffices when the home queue is known (submitted through this store).
        let cached = self.inner.homes.lock().unwrap().get(id).cloned();
        let rx = hub.subscribe(id);
        let _unsub = Unsub(hub, id);
        let (home, seen) = match cached {
            Some(home) => {
                self.inner.backend.watch_home(&home).await?;
                match self.inner.backend.peek(&home, id).await? {
                    Some(p) => (home, p),
                    None => {
                        self.inner.homes.lock().unwrap().remove(id);
                        self.wait_locate(id).await?.ok_or_else(not_found)?
                    }
                }
            }
            None => self.wait_locate(id).await?.ok_or_else(not_found)?,
        };
        self.wait_subscribed(&home, id, seen, rx, deadline).await
    }

    /// Submits `command` to `queue` and waits until it is terminal or `timeout` passes, returning
    /// its state then (check `status.is_terminal()`): [`CommandStore::submit`] then
    /// [`CommandStore::wait`] in one call, one Redis read cheaper, because the waiter and the
    /// queue's notifications are subscribed *before* the submit, so the submitted state is the
    /// starting point and no write after it can be missed. An idempotent resubmit starts from
    /// the stored state (returned at once if terminal).
    ///
    /// Errors: those of [`CommandStore::submit`].
    pub async fn submit_and_wait(
        &self,
        queue: &str,
        command: Command,
        timeout: Duration,
    ) -> Result<CommandState, CommandError> {
        validate_queue(queue)?;
        validate_id(&command.id)?;
        let deadline = tokio::time::Instant::now() + timeout;
        let id = command.id.clone();
        let hub = &self.inner.hub;
        let rx = hub.subscribe(&id);
        let _unsub = Unsub(hub, &id);
        self.inner.backend.watch_home(queue).await?;
        let (state, _) = self.submit_created(queue, command).await?;
        // An existing command keeps its own home queue.
        let home = state.queue.clone();
        self.wait_subscribed(&home, &id, Peeked::from(state), rx, deadline).await
    }

    /// The rest of a wait, already subscribed (`rx`) and having seen `seen`.
    async fn wait_subscribed(
        &self,
        home: &str,
        id: &str,
        mut seen: Peeked,
        mut rx: watch::Receiver<Option<CommandState>>,
        deadline: tokio::time::Instant,
    ) -> Result<CommandState, CommandError> {
        loop {
            if seen.status.is_terminal() || tokio::time::Instant::now() >= deadline {
                return seen.into_state();
            }
            let fallback = (tokio::time::Instant::now() + WAIT_FALLBACK).min(deadline);
            let pushed = tokio::select! {
                r = rx.changed() => match r { Ok(()) => rx.borrow_and_update().clone(), Err(_) => None },
                _ = tokio::time::sleep_until(fallback) => None,
            };
            seen = match pushed {
                Some(s) if s.version >= seen.version => Peeked::from(s),
                _ => match self.inner.backend.peek(home, id).await? {
                    Some(p) => p,
                    None => return Err(CommandError::NotFound(id.to_string())),
                },
            };
        }
    }

    /// For [`CommandStore::wait`], already subscribed: the home by lookup, its notifications
    /// watched, then the state read.
    async fn wait_locate(&self, id: &str) -> Result<Option<(String, Peeked)>, CommandError> {
        let Some(home) = self.inner.backend.home_of(id).await? else { return Ok(None) };
        self.inner.backend.watch_home(&home).await?;
        Ok(self.inner.backend.peek(&home, id).await?.map(|p| (home, p)))
    }

    /// Lists `queue`'s commands (by home queue) newest first, one page at a time.
    ///
    /// Errors: [`CommandError::InvalidCursor`], [`CommandError::Queue`] (bad queue name).
    pub async fn list(&self, queue: &str, query: ListQuery) -> Result<CommandPage, CommandError> {
        validate_queue(queue)?;
        let limit = match query.limit {
            0 => 100,
            n => n.min(1000),
        };
        let cursor = query.cursor.as_deref().map(Cursor::decode).transpose()?;
        let (items, next) = self.inner.backend.list(queue, query.status, limit, cursor).await?;
        Ok(CommandPage { items, next_cursor: next.map(|c| c.encode()) })
    }

    /// Exact counts of `queue`'s commands (by home queue) per status.
    pub async fn counts(&self, queue: &str) -> Result<StatusCounts, CommandError> {
        validate_queue(queue)?;
        self.inner.backend.counts(queue).await
    }

    /// One CAS write; on success the hub hears of it. `Err(latest)` on a conflict.
    pub(crate) async fn write(
        &self,
        old: CommandStatus,
        new: CommandState,
        enqueue: Option<(&str, &CommandMsg)>,
    ) -> Result<Result<CommandState, Option<CommandState>>, CommandError> {
        Ok(self.write_acking(old, new, enqueue, None).await?.0)
    }

    /// [`CommandStore::write`], also acking `ack`'s delivery in the same atomic step when the
    /// backend can (see [`StateBackend::transition`]); the `bool` tells whether it did.
    pub(crate) async fn write_acking(
        &self,
        old: CommandStatus,
        new: CommandState,
        enqueue: Option<(&str, &CommandMsg)>,
        ack: Option<&baton_queue::Lease>,
    ) -> Result<(Result<CommandState, Option<CommandState>>, bool), CommandError> {
        match self.inner.backend.transition(old, new, enqueue, ack).await? {
            (Cas::Done(stored), acked) => {
                self.inner.hub.local(&stored);
                Ok((Ok(stored), acked))
            }
            (Cas::Conflict(latest), _) => Ok((Err(latest), false)),
        }
    }
}

/// Index keys/ordering shared by the backends: the index a status lives in.
pub(crate) fn status_slot(s: Option<CommandStatus>) -> usize {
    s.map(|s| s.index() + 1).unwrap_or(0)
}

#[cfg(test)]
mod hub_tests {
    use super::*;

    /// Dispatch read the state just before a cancel was written, so its handler registers after
    /// the cancel: it must still be signalled (a lost signal let the handler run to the end).
    #[test]
    fn a_handler_registering_after_its_cancel_is_signalled() {
        let hub = Arc::new(Hub::default());
        hub.remote("cmd-1", CommandStatus::Cancelled, false);
        let token = CancellationToken::new();
        let _guard = hub.running("cmd-1", token.clone());
        assert!(token.is_cancelled());
        // Another command is not affected.
        let other = CancellationToken::new();
        let _g2 = hub.running("cmd-2", other.clone());
        assert!(!other.is_cancelled());
        // The usual order still works, also for this store's own (echoed) cancel.
        hub.remote("cmd-2", CommandStatus::Cancelled, true);
        assert!(other.is_cancelled());
    }

    /// A waiter is woken to re-read by another process's terminal write, not by the echo of this
    /// store's own write (which `local` already delivered with the state).
    #[test]
    fn own_announcements_do_not_wake_waiters() {
        let hub = Hub::default();
        let mut rx = hub.subscribe("cmd-3");
        hub.remote("cmd-3", CommandStatus::Succeeded, true);
        assert!(!rx.has_changed().unwrap(), "own echo ignored");
        hub.remote("cmd-3", CommandStatus::Succeeded, false);
        assert!(rx.has_changed().unwrap(), "another process's write wakes the waiter");
        assert!(rx.borrow_and_update().is_none(), "with no state: the waiter re-reads");
    }
}
