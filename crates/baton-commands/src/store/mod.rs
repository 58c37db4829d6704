//! The state store: one versioned JSON state per command, written only by compare-and-set, with
//! per-queue status indexes, counts, and change notifications. Two backends side by side:
//! `memory.rs` and `redis.rs` (key layout in the crate docs).

mod backend;
mod batch;
mod commit;
mod memory;
mod redis;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::feed::{CommandEvent, EventFrom, EventKind, EventOffset, EventPage, FeedSettings, READ_MAX, SCAN_MAX};
use crate::json::canonical_body;
use crate::model::{new_token, CommandMsg, Cursor};
use crate::{
    validate_id, validate_queue, validate_type, BulkAction, BulkReport, Command, CommandError, CommandHandler,
    CommandPage, CommandState, CommandStatus, ListQuery, RawJson, ScheduledCounts, StatusCounts, Timestamp, Worker,
};

pub(crate) use self::backend::{
    Cas, DeliveryRef, FeedAppend, Hub, Peeked, Rescheduled, StateBackend, SubmitItem, SubmitOutcome, Unsub,
};
pub use self::backend::{CommandStoreSettings, Lifetimes};
pub use self::redis::RedisCommandStoreOptions;

/// A submit checked and built, ready for the backend's write (see `CommandStore::submit_many`).
struct PreparedSubmit {
    /// The `baton.submit` span, held (not entered) until the submit's end.
    span: tracing::Span,
    command: Command,
    state: CommandState,
    body: String,
    msg: CommandMsg,
    /// This submit created the command's output stream.
    made: bool,
    event: Option<FeedAppend>,
}

/// A service's id and the handlers it runs.
type ServiceHandlers = (u64, Arc<Handlers>);

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
    /// Feed settings of queues set apart from the default ([`CommandStore::set_feed`]).
    feeds: std::sync::RwLock<HashMap<String, FeedSettings>>,
    /// Where commands' output streams live ([`CommandStore::set_outputs`]).
    outputs: std::sync::OnceLock<baton_streams::StreamStore>,
    /// The delivery queue of completion hooks ([`CommandStore::hooks`]): the memory backend's
    /// from the start; on Redis connected at first use (its scripts enqueue without it).
    hooks: tokio::sync::OnceCell<baton_queue::MessageStream>,
    /// Redis: how to connect it.
    hooks_redis: Option<(baton_redis::RedisClient, baton_queue::RedisQueueOptions)>,
    /// Completion hooks by queue ([`CommandStore::set_hook`]).
    hook_settings: std::sync::RwLock<HashMap<String, crate::CompletionHook>>,
}

const HOME_CACHE_MAX: usize = 100_000;

/// The completion hooks' delivery queue given to [`CommandStore::assemble`].
enum Hooks {
    Ready(baton_queue::MessageStream),
    Redis(Box<(baton_redis::RedisClient, baton_queue::RedisQueueOptions)>),
}

/// How far ahead of this process's clock an event offset may be (clocks apart) before a read
/// refuses it as never handed out: 5 minutes.
pub(crate) const FUTURE_MAX: Duration = Duration::from_secs(300);

/// A read's event limit: 0 means 100; at most [`READ_MAX`].
fn read_limit(limit: usize) -> usize {
    match limit {
        0 => 100,
        n => n.min(READ_MAX),
    }
}

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
        let hooks = baton_queue::MessageStream::memory();
        let backend = Arc::new(memory::MemoryStateBackend::new(stream.clone(), hooks.clone(), settings.clone()));
        Ok(Self::assemble(backend, stream, Hooks::Ready(hooks), hub, settings))
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
        let hooks = Hooks::Redis(Box::new((
            client.clone(),
            baton_queue::RedisQueueOptions {
                key_prefix: crate::hook_prefix(&options.key_prefix),
                group: options.group.clone(),
            },
        )));
        let settings = options.settings.clone();
        let backend = Arc::new(redis::RedisStateBackend::connect(client, options, stream.clone(), hub.clone()).await?);
        Ok(Self::assemble(backend, stream, hooks, hub, settings))
    }

    fn assemble(
        backend: Arc<dyn StateBackend>,
        stream: baton_queue::MessageStream,
        hooks: Hooks,
        hub: Arc<Hub>,
        settings: CommandStoreSettings,
    ) -> Self {
        let (hooks, hooks_redis) = match hooks {
            Hooks::Ready(h) => (tokio::sync::OnceCell::new_with(Some(h)), None),
            Hooks::Redis(redis) => (tokio::sync::OnceCell::new(), Some(*redis)),
        };
        Self {
            inner: Arc::new(StoreInner {
                backend,
                stream,
                hub,
                settings,
                queues: Mutex::new(HashMap::new()),
                next_service: std::sync::atomic::AtomicU64::new(1),
                homes: Mutex::new(HashMap::new()),
                feeds: std::sync::RwLock::new(HashMap::new()),
                outputs: std::sync::OnceLock::new(),
                hooks,
                hooks_redis,
                hook_settings: std::sync::RwLock::new(HashMap::new()),
            }),
        }
    }

    /// The work queues under this store (for queue stats, dead letters).
    pub fn messages(&self) -> &baton_queue::MessageStream {
        &self.inner.stream
    }

    /// The delivery queue of completion hooks ([`crate::hooks`]): queue `q`'s deliveries are
    /// the messages of its queue named `q` (consume them there; their dead letters are that
    /// queue's). On Redis its keys have the prefix [`crate::hook_prefix`] of the store's, and
    /// its connection is made by the first call (a process that never asks, like one with no
    /// hooks, has none). Errors: [`CommandError::Queue`] (Redis unreachable).
    pub async fn hooks(&self) -> Result<&baton_queue::MessageStream, CommandError> {
        self.inner
            .hooks
            .get_or_try_init(|| async {
                let (client, options) = self.inner.hooks_redis.clone().expect("a store without hooks is Redis's");
                Ok(baton_queue::MessageStream::redis(client, options).await?)
            })
            .await
    }

    /// Sets (or with `None` removes) `queue`'s completion hook ([`crate::hooks`]) for this
    /// store's writes from now on: every terminal transition of its commands to one of
    /// `hook.statuses` enqueues one delivery message on [`CommandStore::hooks`], atomically with
    /// the transition. Every process writing the queue's commands should set the same.
    /// Errors: [`CommandError::Queue`] (bad name), [`CommandError::InvalidSettings`] (no status,
    /// or a status that is not terminal).
    pub fn set_hook(&self, queue: &str, hook: Option<crate::CompletionHook>) -> Result<(), CommandError> {
        validate_queue(queue)?;
        let mut m = self.inner.hook_settings.write().unwrap();
        match hook {
            None => {
                m.remove(queue);
            }
            Some(h) => {
                if h.statuses.is_empty() || h.statuses.iter().any(|s| !s.is_terminal()) {
                    return Err(CommandError::InvalidSettings(format!(
                        "queue {queue:?}: a completion hook takes one or more of SUCCEEDED, FAILED, CANCELLED"
                    )));
                }
                m.insert(queue.to_string(), h);
            }
        }
        Ok(())
    }

    /// The completion hook this store writes `queue`'s commands with, if any.
    pub fn hook(&self, queue: &str) -> Option<crate::CompletionHook> {
        self.inner.hook_settings.read().unwrap().get(queue).cloned()
    }

    /// The hook delivery of the write storing `st` (terminal, and its queue has a hook for its
    /// status), if any.
    fn hook_delivery(&self, st: &CommandState) -> Option<String> {
        if !st.status.is_terminal() {
            return None;
        }
        let m = self.inner.hook_settings.read().unwrap();
        if m.is_empty() {
            return None;
        }
        m.get(&st.queue).filter(|h| h.statuses.contains(&st.status)).map(|_| crate::hooks::body(st))
    }

    /// Lets commands own output streams ([`Command::with_output`], crate docs "Output streams"),
    /// kept in `streams` (on Redis, usually the same server). Once per store: every process
    /// serving or submitting such commands sets the same one. Errors:
    /// [`CommandError::InvalidSettings`] when it was set already.
    pub fn set_outputs(&self, streams: baton_streams::StreamStore) -> Result<(), CommandError> {
        self.inner
            .outputs
            .set(streams)
            .map_err(|_| CommandError::InvalidSettings("the store's output streams are set already".into()))
    }

    /// The stream store of commands' output streams, once set ([`CommandStore::set_outputs`]).
    pub fn outputs(&self) -> Option<&baton_streams::StreamStore> {
        self.inner.outputs.get()
    }

    /// Declares a queue consumed by another process, so hand-offs to it are accepted here.
    pub fn declare_queue(&self, queue: &str) -> Result<(), CommandError> {
        validate_queue(queue)?;
        self.inner.queues.lock().unwrap().entry(queue.to_string()).or_default();
        Ok(())
    }

    /// Sets `queue`'s event feed (see [`feed`](crate::feed)), in place of the
    /// store's default [`CommandStoreSettings::feed`], for this store's writes from now on.
    /// Errors: [`CommandError::Queue`] (bad name), [`CommandError::InvalidSettings`] (`max_len` 0).
    pub fn set_feed(&self, queue: &str, feed: FeedSettings) -> Result<(), CommandError> {
        validate_queue(queue)?;
        feed.validate()?;
        self.inner.feeds.write().unwrap().insert(queue.to_string(), feed);
        Ok(())
    }

    /// The event feed settings this store writes `queue`'s commands with.
    pub fn feed_settings(&self, queue: &str) -> FeedSettings {
        self.inner.feeds.read().unwrap().get(queue).copied().unwrap_or(self.inner.settings.feed)
    }

    /// The feed append of an event `kind` of the write storing `st` (none when its home queue's
    /// feed is off).
    fn feed_append(&self, kind: Option<(EventKind, Option<u64>)>, st: &CommandState) -> Option<FeedAppend> {
        let (kind, retry_in_ms) = kind?;
        let feed = self.feed_settings(&st.queue);
        feed.enabled
            .then(|| FeedAppend { json: CommandEvent::stored_json_of(kind, st, retry_in_ms), max_len: feed.max_len })
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
    /// atomically (see the crate docs). Idempotent on id: the same id with the same type,
    /// params and output ([`Command::with_output`]; a re-run's run aside) returns the stored state (whatever its status now). "The same params" means the
    /// same JSON meaning, not the same text: whitespace, key order and string escapes do not
    /// matter, numbers compare by exact decimal value and kind (`0.1` = `0.10`, `1` ≠ `1.0`; the
    /// full rule: [`RawJson`]). The stored params stay the text of the first submit.
    ///
    /// Params are checked first by the `validate` of the handler registered for the type on
    /// `queue` in this process, if any; nothing is stored when they are refused.
    ///
    /// Errors: [`CommandError::InvalidId`], [`CommandError::InvalidType`],
    /// [`CommandError::InvalidParams`] (refused by `validate`, or a string with a lone UTF-16
    /// surrogate escape, or arrays and objects nested more than [`crate::MAX_PARAMS_NESTING`]
    /// deep), [`CommandError::Queue`] (bad queue name),
    /// [`CommandError::Conflict`] (same id, other type/params, other output or other queue),
    /// [`CommandError::Output`] (an output asked of a store without output streams), backend
    /// errors.
    pub async fn submit(&self, queue: &str, command: Command) -> Result<CommandState, CommandError> {
        self.submit_created(queue, command).await.map(|(state, _)| state)
    }

    /// [`CommandStore::submit`], also telling whether this call stored the command (`true`) or
    /// found it already stored with the same body (`false`), e.g. to answer 202 or 200 over HTTP.
    /// Errors: those of [`CommandStore::submit`].
    ///
    /// Runs in a `baton.submit` span ([`crate::trace`]; a child of the current span, or else of
    /// the command's trace context). The state keeps the submit span's context when spans are
    /// exported, else the command's own ([`Command::with_trace_context`]).
    ///
    /// (The span is not entered: it has no spans of ours below it, and it is held, not wrapped
    /// around the future, so nothing is copied or grows when spans are off.)
    pub async fn submit_created(&self, queue: &str, command: Command) -> Result<(CommandState, bool), CommandError> {
        let p = self.prepare_submit(queue, command).await?;
        let outcome = self.inner.backend.submit(&p.state, &p.body, &p.msg, p.event.as_ref()).await;
        self.finish_submit(p, outcome).await
    }

    /// Submits `commands` to `queue` together: each is decided exactly as
    /// [`CommandStore::submit_created`] would decide it alone (validation, idempotency on id,
    /// conflicts), and the reply holds one outcome per command, in order. Two commands of one
    /// call with the same id are decided in order: the second finds the first (the same body:
    /// `Ok((state, false))`; another: [`CommandError::Conflict`]).
    ///
    /// On Redis the commands of one call go to Redis together: one script call for up to 128
    /// of them (more are sent in calls of 128), plus, on Cluster, one id-lookup write each
    /// (their own hash slots). A second copy of an id goes in a call after the first copy is
    /// decided (so that a call retried after a dropped connection cannot store a later copy
    /// first); on Cluster an id whose lookup names another queue goes on its own once its
    /// lookup is claimed. Commands with an output stream create it first, each on its own.
    /// The memory backend decides them one after the other.
    ///
    /// An empty `commands` returns an empty vector. Errors are per command: those of
    /// [`CommandStore::submit`].
    pub async fn submit_many(
        &self,
        queue: &str,
        commands: Vec<Command>,
    ) -> Vec<Result<(CommandState, bool), CommandError>> {
        let prepared = futures::future::join_all(commands.into_iter().map(|c| self.prepare_submit(queue, c))).await;
        let items: Vec<SubmitItem<'_>> = prepared
            .iter()
            .filter_map(|p| p.as_ref().ok())
            .map(|p| SubmitItem { state: &p.state, body: &p.body, msg: &p.msg, event: p.event.as_ref() })
            .collect();
        let mut outcomes = self.inner.backend.submit_many(&items).await.into_iter();
        drop(items);
        let finishing = prepared.into_iter().map(|p| {
            let outcome = p.as_ref().ok().map(|p| {
                outcomes.next().unwrap_or_else(|| {
                    Err(CommandError::Corrupt {
                        id: p.state.id.clone(),
                        reason: "the backend's batch submit returned fewer outcomes than commands".into(),
                    })
                })
            });
            async move {
                match (p, outcome) {
                    (Ok(p), Some(outcome)) => self.finish_submit(p, outcome).await,
                    (Err(e), _) => Err(e),
                    (Ok(_), None) => unreachable!("an outcome is taken for every prepared command"),
                }
            }
        });
        futures::future::join_all(finishing).await
    }

    /// Checks `command`, builds its first state and creates its output stream (if it has one):
    /// everything of a submit before the backend's write.
    async fn prepare_submit(&self, queue: &str, command: Command) -> Result<PreparedSubmit, CommandError> {
        let span = tracing::info_span!(
            target: crate::trace::SPAN_TARGET,
            "baton.submit",
            baton.queue = %queue,
            baton.command.id = %command.id,
            baton.command.type = %command.command_type,
        );
        if !span.is_disabled() && crate::trace::current().is_none() {
            crate::trace::set_parent(&span, command.trace.as_deref());
        }
        validate_queue(queue)?;
        validate_id(&command.id)?;
        validate_type(&command.command_type)?;
        let body = canonical_body(&command.command_type, &command.params)
            .map_err(|e| CommandError::InvalidParams(e.to_string()))?;
        if let Some(h) = self.handler_for(queue, &command.command_type) {
            h.validate(&command.params).map_err(CommandError::InvalidParams)?;
        }
        let output = match &command.output_spec {
            None => None,
            Some(spec) => {
                if self.outputs().is_none() {
                    return Err(CommandError::Output(
                        "this store keeps no output streams (CommandStore::set_outputs)".into(),
                    ));
                }
                let lifetimes = self.inner.settings.lifetimes_of(queue);
                Some(crate::OutputLink::new(&command.id, spec, lifetimes)?)
            }
        };
        let now = Timestamp::now();
        if let Some(at) = command.run_at {
            Self::within_schedule_max(at, now)?;
        }
        if let Some(k) = &command.concurrency_key {
            baton_queue::validate_concurrency_key(k).map_err(|_| {
                CommandError::InvalidConcurrencyKey(format!(
                    "use 1 to {} bytes without control characters (got {} bytes)",
                    baton_queue::MAX_CONCURRENCY_KEY_LEN,
                    k.len()
                ))
            })?;
        }
        if baton_queue::validate_priority(command.priority).is_err() {
            return Err(CommandError::InvalidPriority(format!(
                "use an integer from {} to {} (got {})",
                baton_queue::MIN_PRIORITY,
                baton_queue::MAX_PRIORITY,
                command.priority
            )));
        }
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
            progress: None,
            details: None,
            execution: None,
            output,
            run_at: command.run_at,
            concurrency_key: command.concurrency_key.clone(),
            priority: command.priority,
            trace: crate::trace::context_of(&span).map(Box::new).or_else(|| command.trace.clone()),
            token: token.clone(),
            prev_token: None,
            lookup_expires_ms: 0,
            body_sha: Default::default(),
            attempt_start: Default::default(),
        };
        let msg = CommandMsg { id: command.id.clone(), home: queue.to_string(), token };
        // The output stream exists before the message that delivers the command is enqueued:
        // a handler (or a reader) never finds it missing.
        let made = match &state.output {
            Some(link) => self.prepare_output(&command.id, link, false).await?,
            None => false,
        };
        let event = self.feed_append(Some((EventKind::Submitted, None)), &state);
        Ok(PreparedSubmit { span, command, state, body, msg, made, event })
    }

    /// A submit's end, after the backend's write: answers from `outcome`, dropping an output
    /// stream made for a command this call did not store.
    async fn finish_submit(
        &self,
        p: PreparedSubmit,
        outcome: Result<SubmitOutcome, CommandError>,
    ) -> Result<(CommandState, bool), CommandError> {
        let PreparedSubmit { span: _span, command, state, made, event, .. } = p;
        let queue = state.queue.as_str();
        let remember = |s: &CommandState| {
            let mut h = self.inner.homes.lock().unwrap();
            if h.len() >= HOME_CACHE_MAX {
                h.clear();
            }
            h.insert(s.id.clone(), s.queue.clone());
        };
        let outcome = outcome?;
        // Not stored by this call: a stream this call made for it is nobody's, unless the stored
        // command links it (the command's own, when it had gone).
        let drop_made = |stored: Option<&CommandState>| {
            let keep = match (stored.and_then(|s| s.output.as_ref()), &state.output) {
                (Some(theirs), Some(ours)) => theirs.stream == ours.stream,
                _ => false,
            };
            made && !keep
        };
        match outcome {
            SubmitOutcome::Created(s) => {
                remember(&s);
                if event.is_some() {
                    self.inner.hub.feed_appended(queue);
                }
                // A scheduled command: this process's consumers of its queue promote it on time.
                if let Some(at) = s.run_at {
                    self.inner.stream.due_hint(queue, at.0);
                }
                Ok((s, true))
            }
            SubmitOutcome::Existing(s) => {
                remember(&s);
                if drop_made(Some(&s)) {
                    self.drop_output(&state).await;
                }
                // The output is part of the request (Command::with_output): asked the same (the
                // run aside: a re-run moves it to <path>/run-<n>) or a conflict, as params are.
                let same_output = match (&s.output, &state.output) {
                    (None, None) => true,
                    (Some(stored), Some(asked)) => stored.same_request(asked),
                    _ => false,
                };
                if !same_output {
                    return Err(CommandError::Conflict { id: command.id, what: "output" });
                }
                // The due time is part of the request too; a delay names none of its own, so it
                // matches any scheduled command.
                let same_run_at = match (s.run_at, command.run_at) {
                    (None, None) => true,
                    (Some(_), Some(_)) if command.run_at_from_delay => true,
                    (Some(stored), Some(asked)) => stored == asked,
                    _ => false,
                };
                if !same_run_at {
                    return Err(CommandError::Conflict { id: command.id, what: "run_at" });
                }
                Ok((s, false))
            }
            SubmitOutcome::Conflict | SubmitOutcome::OtherQueue => {
                if made {
                    let stored = self.get(&command.id).await.ok().flatten();
                    if drop_made(stored.as_ref()) {
                        self.drop_output(&state).await;
                    }
                }
                let what = if matches!(outcome, SubmitOutcome::Conflict) { "type or params" } else { "queue" };
                Err(CommandError::Conflict { id: command.id, what })
            }
        }
    }

    /// Creates the output stream `link` of command `id` before the command is stored (or, with
    /// `rerun`, re-run), marked as made for it
    /// ([`CreateOptions::owner`](baton_streams::CreateOptions::owner)). `Ok(true)`: this call
    /// created it. When a stream is there already: a submit of an id already stored leaves it to
    /// the backend's answer (the stored state, or a conflict); else a stream bearing the
    /// command's mark (made by an earlier submit of the id whose store failed after it, or by a
    /// concurrent one) is used if it has the same configuration (else
    /// [`CommandError::Conflict`]), except an ended one at a submit (left from an earlier life
    /// of the id), which is replaced. Any other stream is someone else's:
    /// [`CommandError::OutputInUse`], nothing written. Errors: also [`CommandError::Output`]
    /// (the stream store failed).
    async fn prepare_output(&self, id: &str, link: &crate::OutputLink, rerun: bool) -> Result<bool, CommandError> {
        use baton_streams::StreamError;
        let Some(streams) = self.outputs() else {
            return Err(CommandError::Output("this store keeps no output streams (CommandStore::set_outputs)".into()));
        };
        let mark = crate::output::owner_mark(id);
        let path = link.path();
        let failed = |e: StreamError| CommandError::Output(format!("creating {}: {e}", link.stream));
        for _ in 0..3 {
            let existing = match streams.create(&path, crate::output::create_options(link, &mark)).await {
                Ok(c) if c.created => return Ok(true),
                Ok(c) => c.info,
                Err(StreamError::Conflict { .. }) => match streams.head(&path).await {
                    Ok(info) => info,
                    // Gone meanwhile: create again.
                    Err(StreamError::NotFound { .. }) => continue,
                    Err(e @ StreamError::Gone { .. }) => {
                        return Err(CommandError::OutputInUse { path: link.stream.clone(), why: e.to_string() })
                    }
                    Err(e) => return Err(failed(e)),
                },
                Err(e @ StreamError::Gone { .. }) => {
                    return Err(CommandError::OutputInUse { path: link.stream.clone(), why: e.to_string() })
                }
                Err(e) => return Err(failed(e)),
            };
            // A stream that was there: whose is it? A resubmit of a stored command is answered
            // by the backend (its state, or a conflict) and leaves every stream as it is.
            if !rerun && self.get(id).await?.is_some() {
                return Ok(false);
            }
            if !existing.created_for(&mark) {
                return Err(CommandError::OutputInUse {
                    path: link.stream.clone(),
                    why: "another stream exists at this path".into(),
                });
            }
            if rerun || existing.end.is_none() {
                // Made for this id by a submit (or re-run) not stored (yet): a concurrent one,
                // or one whose store failed. Used if it is the same stream, else a conflict.
                // (Its silence timeout shows once a producer opened it.)
                let wanted = link.limits();
                let limits = baton_streams::RunLimits {
                    silence_timeout: existing.limits.silence_timeout.or(wanted.silence_timeout),
                    ..existing.limits
                };
                let same = existing.content_type == link.content_type && limits == wanted;
                if same {
                    return Ok(false);
                }
                return Err(CommandError::Conflict { id: id.to_string(), what: "output" });
            }
            // Ended and linked by no command: left from an earlier life of the id.
            match streams.delete(&path).await {
                Ok(()) | Err(StreamError::NotFound { .. }) => {}
                Err(e) => return Err(failed(e)),
            }
        }
        Err(CommandError::Output(format!("creating {}: the path kept changing meanwhile", link.stream)))
    }

    /// Deletes the output stream this call made for a command it did not store (best effort).
    async fn drop_output(&self, st: &CommandState) {
        if let (Some(link), Some(streams)) = (&st.output, self.outputs()) {
            if let Err(e) = streams.delete(&link.path()).await {
                tracing::debug!(command = %st.id, stream = %link.stream, error = %e, "could not delete an unused output stream");
            }
        }
    }

    /// Submits a command whose params are raw JSON bytes (e.g. an HTTP body), kept byte for byte
    /// (surrounding whitespace dropped; empty means `null`). Malformed JSON is refused with
    /// [`CommandError::InvalidParams`] before anything is stored.
    pub async fn submit_json(
        &self,
        queue: &str,
        id: Option<String>,
        command_type: &str,
        params: &[u8],
    ) -> Result<CommandState, CommandError> {
        let params = if params.is_empty() {
            RawJson::null()
        } else {
            RawJson::from_slice(params).map_err(|e| CommandError::InvalidParams(e.to_string()))?
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
    /// queue) is signalled through [`Command::cancelled`]; its later result is refused. A command
    /// with an output ([`Command::with_output`]) has the output ended `cancelled` first: the
    /// stream's end is the arbiter, so when it had ended otherwise already (`finished`,
    /// `producer_lost`) that end decides the command (its handler's result, waited for up to 2 s,
    /// else `SUCCEEDED` with result `null` or `FAILED`) and the cancel is refused with that
    /// terminal state.
    ///
    /// Errors: [`CommandError::NotFound`], [`CommandError::AlreadyTerminal`] (the state attached:
    /// the refusal leaves it unchanged, or it is the state its output's earlier end decided),
    /// [`CommandError::Output`] (the output could not be ended; nothing written).
    pub async fn cancel(&self, id: &str) -> Result<CommandState, CommandError> {
        validate_id(id)?;
        let mut current = self.locate(id).await?.map(|(_, st)| st);
        loop {
            let Some(st) = current else { return Err(CommandError::NotFound(id.to_string())) };
            if st.status.is_terminal() {
                return Err(CommandError::AlreadyTerminal(Box::new(st)));
            }
            // The output's end is the arbiter: ended `cancelled` first, then the command. An
            // output that ended otherwise first decides the command instead.
            if let (Some(link), Some(streams)) = (&st.output, self.outputs()) {
                match streams.end(&link.path(), baton_streams::EndReason::Cancelled).await {
                    Ok(e) if e.end.reason != baton_streams::EndReason::Cancelled => {
                        return Err(CommandError::AlreadyTerminal(Box::new(self.settle_by_output(st).await?)));
                    }
                    Ok(_)
                    | Err(baton_streams::StreamError::NotFound { .. } | baton_streams::StreamError::Gone { .. }) => {}
                    Err(e) => return Err(CommandError::Output(format!("ending {}: {e}", link.stream))),
                }
            }
            let now = Timestamp::now();
            let mut next = st.clone();
            next.status = CommandStatus::Cancelled;
            next.execution = None;
            next.completed_at = Some(now);
            next.modified_at = now;
            next.version += 1;
            let waiting = st.status == CommandStatus::Submitted && st.run_at.is_some();
            match self.write_for(st.status, next, None, None, Some((EventKind::Cancelled, None))).await?.0 {
                Ok(done) => {
                    if waiting {
                        self.unschedule(&done).await;
                    }
                    return Ok(done);
                }
                Err(latest) => current = latest,
            }
        }
    }

    /// Removes a cancelled scheduled command's message from its queue's delayed set, so that no
    /// far-future entry is left behind. Best effort: an entry left (this call failed, or the
    /// process died before it) is promoted when due and acked unrun, the command being ended.
    async fn unschedule(&self, st: &CommandState) {
        let name = crate::model::schedule_name(&st.id);
        if let Err(e) = self.inner.stream.unschedule(&st.queue, &name).await {
            tracing::debug!(command = %st.id, error = %e, "could not remove a cancelled command's scheduled message; it is acked unrun when due");
        }
    }

    /// How far ahead a command can be scheduled ([`Command::with_run_at`]): 366 days.
    pub const SCHEDULE_MAX: Duration = Duration::from_secs(366 * 86_400);

    /// A due time `at` at most [`CommandStore::SCHEDULE_MAX`] after `now` (a submit's and a
    /// reschedule's check); a later one is [`CommandError::InvalidSchedule`] saying how far
    /// ahead a schedule may be.
    fn within_schedule_max(at: Timestamp, now: Timestamp) -> Result<(), CommandError> {
        if at.millis() > now.millis() + Self::SCHEDULE_MAX.as_millis() as u64 {
            return Err(CommandError::InvalidSchedule(format!(
                "{at} is more than {} days ahead; schedule at most that far",
                Self::SCHEDULE_MAX.as_secs() / 86_400
            )));
        }
        Ok(())
    }

    /// Moves the due time of `id`, a scheduled command still waiting for it
    /// ([`Command::with_run_at`]; its message not enqueued yet), to `at` (a time not in the
    /// future: at once): one compare-and-set of its state (`run_at`, version + 1, its TTL
    /// counted from the new due time) that moves its message in the queue's delayed set in the
    /// same atomic step, with a `rescheduled` event in its queue's feed.
    ///
    /// Errors: [`CommandError::NotFound`], [`CommandError::NotScheduled`] (it was not
    /// scheduled, its message was enqueued already (due, or rescheduled to now), or it
    /// ended or started; the state attached, unchanged), [`CommandError::InvalidSchedule`]
    /// (`at` further than [`CommandStore::SCHEDULE_MAX`] ahead), backend errors.
    pub async fn reschedule(&self, id: &str, at: std::time::SystemTime) -> Result<CommandState, CommandError> {
        validate_id(id)?;
        let at = Timestamp::from_millis(Timestamp(at).millis());
        Self::within_schedule_max(at, Timestamp::now())?;
        let mut current = self.locate(id).await?.map(|(_, st)| st);
        loop {
            let Some(st) = current else { return Err(CommandError::NotFound(id.to_string())) };
            if st.status != CommandStatus::Submitted || st.run_at.is_none() || st.started_at.is_some() {
                return Err(CommandError::NotScheduled(Box::new(st)));
            }
            let mut next = st.clone();
            next.run_at = Some(at);
            next.modified_at = Timestamp::now();
            next.version += 1;
            let append = self.feed_append(Some((EventKind::Rescheduled, None)), &next);
            match self.inner.backend.reschedule(next, append.as_ref()).await? {
                Rescheduled::Done(stored) => {
                    if append.is_some() {
                        self.inner.hub.feed_appended(&stored.queue);
                    }
                    self.inner.stream.due_hint(&stored.queue, at.0);
                    self.inner.hub.local(&stored);
                    return Ok(stored);
                }
                Rescheduled::Conflict(latest) => current = latest,
                Rescheduled::NotWaiting(latest) => return Err(CommandError::NotScheduled(Box::new(latest))),
            }
        }
    }

    /// A cancel found `st`'s output ended `finished` or `producer_lost` before it: that end
    /// decides the command. Its handler's result is waited for a moment (it usually follows its
    /// producer's finish); without one, the end's outcome is written as a handler call that
    /// returned nothing would have it (`SUCCEEDED` with result `null`, `FAILED` after an error
    /// entry or `producer_lost`). Returns the terminal state.
    async fn settle_by_output(&self, st: CommandState) -> Result<CommandState, CommandError> {
        let id = st.id.clone();
        let latest = self.wait(&id, Duration::from_secs(2)).await?;
        if latest.status.is_terminal() {
            return Ok(latest);
        }
        let mut current = Some(latest);
        loop {
            let Some(st) = current else { return Err(CommandError::NotFound(id)) };
            if st.status.is_terminal() {
                return Ok(st);
            }
            let (Some(link), Some(streams)) = (&st.output, self.outputs()) else { return Ok(st) };
            let Some(outcome) = crate::output::decide(streams, link, None, 0).await else { return Ok(st) };
            let now = Timestamp::now();
            let mut next = st.clone();
            next.execution = None;
            next.completed_at = Some(now);
            next.modified_at = now;
            next.version += 1;
            let event = match outcome {
                crate::CommandResult::Succeeded(r) => {
                    next.status = CommandStatus::Succeeded;
                    next.result = Some(r);
                    EventKind::Succeeded
                }
                crate::CommandResult::Failed(e) => {
                    next.status = CommandStatus::Failed;
                    next.error = Some(e);
                    EventKind::Failed
                }
                _ => {
                    next.status = CommandStatus::Cancelled;
                    EventKind::Cancelled
                }
            };
            match self.write_for(st.status, next, None, None, Some((event, None))).await?.0 {
                Ok(done) => return Ok(done),
                Err(latest) => current = latest,
            }
        }
    }

    /// Re-runs `id`, a `FAILED` or `CANCELLED` command: one compare-and-set back to `SUBMITTED`
    /// (result, error, completion, progress and hand-off cleared; `attempts` and the last
    /// checkpoint ([`Command::details`]) kept) that enqueues a new message on its home
    /// queue in the same atomic step, so `execute` runs again from the start of the command's
    /// life. The history stays in the event feed (a `rerun` event follows the old outcome).
    /// Concurrent re-runs of one command: one wins, the others see it `SUBMITTED` and are refused.
    ///
    /// Errors: [`CommandError::NotFound`], [`CommandError::NotRetryable`] (not FAILED or
    /// CANCELLED; the state attached, unchanged), backend errors.
    pub async fn retry(&self, id: &str) -> Result<CommandState, CommandError> {
        validate_id(id)?;
        let mut current = self.locate(id).await?.map(|(_, st)| st);
        loop {
            let Some(st) = current else { return Err(CommandError::NotFound(id.to_string())) };
            if !matches!(st.status, CommandStatus::Failed | CommandStatus::Cancelled) {
                return Err(CommandError::NotRetryable(Box::new(st)));
            }
            let now = Timestamp::now();
            let mut next = st.clone();
            next.status = CommandStatus::Submitted;
            next.result = None;
            next.error = None;
            next.errors_count = 0;
            next.completed_at = None;
            next.started_at = None;
            next.execution = None;
            next.progress = None;
            next.handed_off_to = None;
            next.prev_token = None;
            next.token = new_token();
            next.modified_at = now;
            next.version += 1;
            next.output = st.output.as_ref().map(crate::OutputLink::next_run);
            // A re-run runs at once.
            next.run_at = None;
            // The new run's stream exists before its message is enqueued (as at submit).
            if let Some(link) = &next.output {
                self.prepare_output(&st.id, link, true).await?;
            }
            let msg = CommandMsg { id: st.id.clone(), home: st.queue.clone(), token: next.token.clone() };
            let home = st.queue.clone();
            match self.write_for(st.status, next, Some((&home, &msg)), None, Some((EventKind::Rerun, None))).await?.0 {
                Ok(done) => return Ok(done),
                Err(latest) => current = latest,
            }
        }
    }

    /// Cancels or re-runs ([`BulkAction`]) `queue`'s commands that `query` selects (its filters
    /// and cursor; its limit is ignored), looking at most at `max` of them (1 to
    /// [`CommandStore::BULK_MAX`]; 0 means 1,000): each eligible one by its own compare-and-set,
    /// as [`CommandStore::cancel`] / [`CommandStore::retry`] alone (32 at a time), or with
    /// `dry_run` only counted. Not one atomic step: commands that change meanwhile are counted as
    /// `refused`; a command re-run here is not selected again by the same call.
    ///
    /// Errors: those of [`CommandStore::list`]; backend errors (some commands may have been
    /// acted on already).
    pub async fn bulk(
        &self,
        queue: &str,
        action: BulkAction,
        query: ListQuery,
        dry_run: bool,
        max: usize,
    ) -> Result<BulkReport, CommandError> {
        use futures::StreamExt;
        let max = match max {
            0 => 1_000,
            n => n.min(Self::BULK_MAX),
        };
        let mut report = BulkReport::default();
        let mut query = ListQuery { limit: 500, ..query };
        loop {
            query.limit = 500.min(max - report.looked_at as usize);
            let page = self.list(queue, query.clone()).await?;
            report.looked_at += page.items.len() as u64;
            let ids: Vec<String> =
                page.items.iter().filter(|st| action.applies_to(st.status)).map(|st| st.id.clone()).collect();
            report.eligible += ids.len() as u64;
            if !dry_run {
                let mut acts = futures::stream::iter(ids)
                    .map(|id| async move {
                        match action {
                            BulkAction::Cancel => self.cancel(&id).await,
                            BulkAction::Retry => self.retry(&id).await,
                        }
                    })
                    .buffer_unordered(32);
                while let Some(r) = acts.next().await {
                    match r {
                        Ok(_) => report.applied += 1,
                        Err(
                            CommandError::AlreadyTerminal(_)
                            | CommandError::NotRetryable(_)
                            | CommandError::NotFound(_),
                        ) => report.refused += 1,
                        Err(e) => return Err(e),
                    }
                }
            }
            match page.next_cursor {
                None => return Ok(report),
                Some(c) if report.looked_at as usize >= max => {
                    report.next_cursor = Some(c);
                    return Ok(report);
                }
                Some(c) => query.cursor = Some(c),
            }
        }
    }

    /// Most commands one [`CommandStore::bulk`] call looks at.
    pub const BULK_MAX: usize = 10_000;

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

    /// Lists `queue`'s commands (by home queue) newest first, one page at a time, with the
    /// filters of `query` (see [`ListQuery`]).
    ///
    /// Errors: [`CommandError::InvalidCursor`], [`CommandError::Queue`] (bad queue name).
    pub async fn list(&self, queue: &str, query: ListQuery) -> Result<CommandPage, CommandError> {
        validate_queue(queue)?;
        let limit = match query.limit {
            0 => 100,
            n => n.min(1000),
        };
        let mut cursor = query.cursor.as_deref().map(Cursor::decode).transpose()?;
        if let (None, Some(before)) = (&cursor, query.created_before) {
            // Every id created at `before` ms or later is "after" this position.
            cursor = Some(Cursor { created_ms: before.millis(), id: String::new() });
        }
        let min_ms = query.created_after.map_or(0, |t| t.millis());
        let backend = &self.inner.backend;
        if query.command_type.is_none() && query.id_prefix.is_none() && query.scheduled.is_none() {
            let (items, next) = backend.list(queue, query.status, limit, cursor, min_ms).await?;
            return Ok(CommandPage { items, next_cursor: next.map(|c| c.encode()) });
        }
        let wanted = |st: &CommandState| {
            query.command_type.as_ref().is_none_or(|t| &st.command_type == t)
                && query.id_prefix.as_ref().is_none_or(|p| st.id.starts_with(p.as_str()))
                && query.scheduled.is_none_or(|s| st.is_scheduled() == s)
        };
        let mut items = Vec::new();
        let mut looked = 0;
        loop {
            let batch = (ListQuery::SCAN_MAX - looked).min(500);
            let (page, next) = backend.list(queue, query.status, batch, cursor.clone(), min_ms).await?;
            looked += batch;
            for st in page {
                let at = Cursor { created_ms: st.created_at.millis(), id: st.id.clone() };
                if wanted(&st) {
                    items.push(st);
                    if items.len() == limit {
                        return Ok(CommandPage { items, next_cursor: Some(at.encode()) });
                    }
                }
            }
            match next {
                None => return Ok(CommandPage { items, next_cursor: None }),
                Some(c) if looked >= ListQuery::SCAN_MAX => {
                    return Ok(CommandPage { items, next_cursor: Some(c.encode()) })
                }
                Some(c) => cursor = Some(c),
            }
        }
    }

    /// Events of `queue`'s feed (its commands' transitions, see [`CommandEvent`]) from `from`,
    /// oldest first, at most `limit` (0: 100; at most [`READ_MAX`]).
    ///
    /// Errors: [`CommandError::Queue`] (bad queue name), backend errors.
    pub async fn events(&self, queue: &str, from: EventFrom, limit: usize) -> Result<EventPage, CommandError> {
        validate_queue(queue)?;
        Self::not_ahead(from)?;
        self.inner.backend.feed_read(queue, from, None, read_limit(limit), SCAN_MAX).await
    }

    /// An offset more than [`FUTURE_MAX`] ahead of this process's clock was never handed out
    /// (offsets are the milliseconds of their append, Redis's clock): refused, so a reader does
    /// not wait there forever. (A feed reset under a reader, by a Redis without persistence
    /// restarting, goes on with later offsets: the reader sees them.)
    fn not_ahead(from: EventFrom) -> Result<(), CommandError> {
        let EventFrom::After(o) = from else { return Ok(()) };
        if o.ms > Timestamp::now().millis() + FUTURE_MAX.as_millis() as u64 {
            return Err(CommandError::InvalidOffset(o.to_string()));
        }
        Ok(())
    }

    /// [`CommandStore::events`], waiting up to `timeout` for an event when there is none yet
    /// (a long poll): returns as soon as one is appended by any process, or an empty page at
    /// the timeout (its `next_offset` the tail).
    pub async fn events_wait(
        &self,
        queue: &str,
        from: EventFrom,
        limit: usize,
        timeout: Duration,
    ) -> Result<EventPage, CommandError> {
        validate_queue(queue)?;
        Self::not_ahead(from)?;
        self.feed_wait(queue, from, None, read_limit(limit), timeout).await
    }

    /// The events of command `id` (from its home queue's feed) from `from`, oldest first, at most
    /// `limit` (0: 100; at most [`READ_MAX`]). One call looks at most at [`SCAN_MAX`] entries of
    /// the queue's feed; `up_to_date` false then says to read on from `next_offset`. From
    /// [`EventFrom::Start`], the scan begins at the command's creation (less 2 s, for clocks
    /// apart), not at the feed's start.
    ///
    /// Errors: [`CommandError::NotFound`] (no such command now: never submitted, or expired;
    /// its events may still be in its queue's feed), [`CommandError::InvalidId`], backend errors.
    pub async fn command_events(&self, id: &str, from: EventFrom, limit: usize) -> Result<EventPage, CommandError> {
        Self::not_ahead(from)?;
        let (home, start) = self.command_feed(id, from).await?;
        self.inner.backend.feed_read(&home, start, Some(id), read_limit(limit), SCAN_MAX).await
    }

    /// [`CommandStore::command_events`], waiting up to `timeout` for one of its events when there
    /// is none yet (see [`CommandStore::events_wait`]).
    pub async fn command_events_wait(
        &self,
        id: &str,
        from: EventFrom,
        limit: usize,
        timeout: Duration,
    ) -> Result<EventPage, CommandError> {
        Self::not_ahead(from)?;
        let (home, start) = self.command_feed(id, from).await?;
        self.feed_wait(&home, start, Some(id), read_limit(limit), timeout).await
    }

    /// The home queue of `id` and where its events start.
    async fn command_feed(&self, id: &str, from: EventFrom) -> Result<(String, EventFrom), CommandError> {
        validate_id(id)?;
        let Some((home, st)) = self.locate(id).await? else { return Err(CommandError::NotFound(id.to_string())) };
        let from = match from {
            EventFrom::Start => EventFrom::After(EventOffset::new(st.created_at.millis().saturating_sub(2_000), 0)),
            other => other,
        };
        Ok((home, from))
    }

    async fn feed_wait(
        &self,
        queue: &str,
        mut from: EventFrom,
        id: Option<&str>,
        limit: usize,
        timeout: Duration,
    ) -> Result<EventPage, CommandError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let waiters = self.inner.hub.feed(queue);
        waiters.waiting.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        struct Waiting<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let _waiting = Waiting(&waiters.waiting);
        let mut watched = false;
        loop {
            // Armed before the read: an append after the read wakes this wait.
            let woken = waiters.notify.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let page = self.inner.backend.feed_read(queue, from, id, limit, SCAN_MAX).await?;
            if !page.events.is_empty() || !page.up_to_date || tokio::time::Instant::now() >= deadline {
                return Ok(page);
            }
            from = EventFrom::After(page.next_offset);
            if !watched {
                self.inner.backend.feed_watch(queue, page.next_offset).await?;
                watched = true;
            }
            // A fallback re-read every second, in case a wake-up was missed (a reconnect).
            let fallback = (tokio::time::Instant::now() + WAIT_FALLBACK).min(deadline);
            tokio::select! {
                _ = woken => {}
                _ = tokio::time::sleep_until(fallback) => {}
            }
        }
    }

    /// The workers of `queue` (the consumers of its group, live and dead, see [`Worker`]) with
    /// the commands they hold.
    ///
    /// Errors: [`CommandError::Queue`] (bad name, backend errors).
    pub async fn workers(&self, queue: &str) -> Result<Vec<Worker>, CommandError> {
        let consumers = self.inner.stream.consumers(queue, Worker::COMMANDS_MAX).await?;
        Ok(consumers
            .into_iter()
            .map(|c| Worker {
                commands: c
                    .leases
                    .iter()
                    .filter_map(|l| serde_json::from_slice::<CommandMsg>(l.payload.as_deref()?).ok())
                    .map(|m| m.id)
                    .collect(),
                name: c.name,
                alive: c.alive,
                last_heartbeat: c.last_heartbeat_ms.map(Timestamp::from_millis),
                claim_timeout_ms: c.claim_timeout_ms,
                leases: c.pending,
            })
            .collect())
    }

    /// Pauses `queue` ([`baton_queue::MessageStream::pause`]): submits are accepted and stay
    /// SUBMITTED, and no worker of any process (in-process or remote, over HTTP) starts a new
    /// command of the queue until [`CommandStore::resume`]. Commands already running go on:
    /// their leases renew, their outcomes apply, a dead worker's commands are taken over, and
    /// their `check_status` re-polls shorter than the claim timeout go on. The state is the
    /// queue's in the backend (every process sees it). Returns `true` when the queue was
    /// running. Errors: [`CommandError::Queue`] (bad name, backend unreachable).
    pub async fn pause(&self, queue: &str) -> Result<bool, CommandError> {
        validate_queue(queue)?;
        Ok(self.inner.stream.pause(queue).await?)
    }

    /// Resumes a paused `queue`: its waiting commands start at once, oldest first. Returns
    /// `true` when it was paused. Errors as [`CommandStore::pause`].
    pub async fn resume(&self, queue: &str) -> Result<bool, CommandError> {
        validate_queue(queue)?;
        Ok(self.inner.stream.resume(queue).await?)
    }

    /// Exact counts of `queue`'s commands (by home queue) per status.
    pub async fn counts(&self, queue: &str) -> Result<StatusCounts, CommandError> {
        validate_queue(queue)?;
        self.inner.backend.counts(queue).await
    }

    /// `queue`'s scheduled commands still waiting for their due time (a subset of its
    /// `SUBMITTED` ones, [`Command::with_run_at`]; by the queue the message waits in, which is
    /// the home queue), and the earliest due time among them (`None`: none waits).
    /// Errors: [`CommandError::Queue`] (bad name, backend errors).
    pub async fn scheduled(&self, queue: &str) -> Result<ScheduledCounts, CommandError> {
        validate_queue(queue)?;
        let (waiting, next) = self.inner.stream.scheduled(queue).await?;
        Ok(ScheduledCounts {
            scheduled: waiting,
            next_due: next.map(|t| Timestamp::from_millis(Timestamp(t).millis())),
        })
    }

    /// `queue`'s per-minute aggregates ([`crate::minutes`]) of the last `last` minutes, the
    /// current one (by the backend's clock) included, oldest first; minutes without records are
    /// zeros (depth and oldest age `None`). Errors: [`CommandError::Queue`] (bad name),
    /// [`CommandError::InvalidSettings`] (`last` not 1 to [`MINUTES_KEPT`](crate::minutes::MINUTES_KEPT)).
    pub async fn minutes(&self, queue: &str, last: usize) -> Result<Vec<crate::minutes::MinuteStats>, CommandError> {
        validate_queue(queue)?;
        let max = crate::minutes::MINUTES_KEPT;
        if !(1..=max).contains(&last) {
            return Err(CommandError::InvalidSettings(format!("last must be 1 to {max} (minutes), not {last}")));
        }
        self.inner.backend.minutes(queue, last).await
    }

    /// Samples `queue`'s depth and the age of its oldest waiting command into the current
    /// minute's record ([`crate::minutes`]) unless a process (any, on Redis) sampled this minute
    /// already; true when this call's sample was kept. Every [`crate::CommandService`] calls it
    /// about once a minute. Errors: [`CommandError::Queue`] (bad name), backend errors.
    pub async fn sample_minute(&self, queue: &str) -> Result<bool, CommandError> {
        validate_queue(queue)?;
        self.inner.backend.sample_minute(queue).await
    }

    /// Starts sampling `queue`'s depth and oldest age ([`CommandStore::sample_minute`]) about
    /// once a minute, until the sampler is stopped or dropped. Every [`crate::CommandService`]
    /// runs one for its queue; a process serving a queue without one (HTTP workers only) starts
    /// its own. Needs a Tokio runtime. Errors: [`CommandError::Queue`] (bad name).
    pub fn minute_sampler(&self, queue: &str) -> Result<crate::minutes::MinuteSampler, CommandError> {
        validate_queue(queue)?;
        Ok(crate::minutes::MinuteSampler::spawn(self.clone(), queue.to_string()))
    }

    /// One CAS write (see [`StateBackend::transition`]), for `delivery` when given: checking
    /// that its consumer owns it and acking it in the same atomic step as it asks and the backend
    /// can; the `bool` tells whether it was acked. A failed owner check is
    /// [`QueueError::LeaseLost`](baton_queue::QueueError::LeaseLost) (nothing written). With
    /// `event` (its kind, and for `retry_scheduled` the delay in ms), a successful write appends
    /// it to the home queue's feed in the same step, unless that feed is off. On success the
    /// hub hears of it; `Err(latest)` on a conflict.
    pub(crate) async fn write_for(
        &self,
        old: CommandStatus,
        new: CommandState,
        enqueue: Option<(&str, &CommandMsg)>,
        delivery: Option<&DeliveryRef>,
        event: Option<(EventKind, Option<u64>)>,
    ) -> Result<(Result<CommandState, Option<CommandState>>, bool), CommandError> {
        // Held, not entered (no spans of ours below it): nothing is copied or grows when spans
        // are off. It ends when this returns.
        let _span = tracing::info_span!(
            target: crate::trace::SPAN_TARGET,
            "baton.transition",
            baton.queue = %new.queue,
            baton.command.id = %new.id,
            baton.status.from = %old,
            baton.status.to = %new.status,
            baton.version = new.version,
        );
        let append = self.feed_append(event, &new);
        let home = append.as_ref().map(|_| new.queue.clone());
        let hook = self.hook_delivery(&new);
        match self.inner.backend.transition(old, new, enqueue, delivery, append.as_ref(), hook.as_deref()).await? {
            (Cas::Done(stored), acked) => {
                // A terminal write of a command with an output comes after the output's end
                // (every terminal writer ends it first: the stream's end is the arbiter).
                if let Some(home) = home {
                    self.inner.hub.feed_appended(&home);
                }
                self.inner.hub.local(&stored);
                Ok((Ok(stored), acked))
            }
            (Cas::Conflict(latest), _) => Ok((Err(latest), false)),
            (Cas::Lost, _) => {
                let id = delivery.map(|d| d.id.as_str()).unwrap_or_default();
                let mid = id.parse().map_err(|_| CommandError::Corrupt {
                    id: id.to_string(),
                    reason: "the lost delivery's id is not a stream entry id".into(),
                })?;
                Err(CommandError::Queue(baton_queue::QueueError::LeaseLost(mid)))
            }
        }
    }
}

#[cfg(test)]
mod hub_tests {
    use super::*;
    use tokio_util::sync::CancellationToken;

    /// Dispatch read the state just before a cancel was written, so its handler registers after
    /// the cancel: it must still be signalled (a lost signal let the handler run to the end).
    #[test]
    fn a_handler_registering_after_its_cancel_is_signalled() {
        let hub = Arc::new(Hub::default());
        hub.remote("cmd-1", CommandStatus::Cancelled, 4, false);
        let token = CancellationToken::new();
        let _guard = hub.running("cmd-1", 3, token.clone());
        assert!(token.is_cancelled());
        // Another command is not affected.
        let other = CancellationToken::new();
        let _g2 = hub.running("cmd-2", 1, other.clone());
        assert!(!other.is_cancelled());
        // The usual order still works, also for this store's own (echoed) cancel.
        hub.remote("cmd-2", CommandStatus::Cancelled, 2, true);
        assert!(other.is_cancelled());
    }

    /// A command re-run after a cancel (a later version) is not signalled by that cancel, whether
    /// its announcement comes before the re-run's handler registers or while it runs.
    #[test]
    fn a_cancel_does_not_reach_a_later_run() {
        let hub = Arc::new(Hub::default());
        hub.remote("cmd-1", CommandStatus::Cancelled, 4, false);
        let rerun = CancellationToken::new();
        let _guard = hub.running("cmd-1", 5, rerun.clone());
        assert!(!rerun.is_cancelled(), "remembered cancel of version 4, run of version 5");
        hub.remote("cmd-1", CommandStatus::Cancelled, 4, false);
        assert!(!rerun.is_cancelled(), "a late echo of the old cancel");
        hub.remote("cmd-1", CommandStatus::Cancelled, 7, false);
        assert!(rerun.is_cancelled(), "a cancel of the re-run itself");
    }

    /// A waiter is woken to re-read by another process's terminal write, not by the echo of this
    /// store's own write (which `local` already delivered with the state).
    #[test]
    fn own_announcements_do_not_wake_waiters() {
        let hub = Hub::default();
        let mut rx = hub.subscribe("cmd-3");
        hub.remote("cmd-3", CommandStatus::Succeeded, 2, true);
        assert!(!rx.has_changed().unwrap(), "own echo ignored");
        hub.remote("cmd-3", CommandStatus::Succeeded, 2, false);
        assert!(rx.has_changed().unwrap(), "another process's write wakes the waiter");
        assert!(rx.borrow_and_update().is_none(), "with no state: the waiter re-reads");
    }
}
