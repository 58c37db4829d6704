//! Dispatch: one [`CommandService`] per queue consumes its work queue and drives each command
//! from its persisted state (crate docs, "Rules").
//!
//! For one delivery of message `(id, home, token)`:
//! 1. load the state; missing or terminal → ack;
//! 2. the message's token is not the state's → it is not the live message: if it is the source
//!    message of the state's last hand-off (`_prev_token`) the hand-off is finished (enqueue on the
//!    target under a fresh token, then ack); otherwise it is a stale duplicate → ack;
//! 3. `SUBMITTED` → `execute`, `RUNNING` → `check_status` (with the command's cancellation signal);
//! 4. the outcome is written by compare-and-set; on a conflict the state is re-read and the
//!    outcome dropped if the command moved on (terminal, other status, other token).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use baton_queue::{ConsumerOptions, Decision, Delivery, DrainReport, Lease};
use futures::FutureExt;

use crate::model::{new_token, CommandMsg};
use crate::output::FencedEnd;
pub(crate) use crate::output::OutputFence;
use crate::store::DeliveryRef;
use crate::{
    backoff, validate_queue, Command, CommandError, CommandHandler, CommandResult, CommandState, CommandStatus,
    CommandStore, EventKind, Execution, ExecutionCall, HandlerError, RemoteReport, Timestamp,
};

/// Retries of handler errors (`Err` or panic) with exponential backoff.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// Consecutive handler errors after which the command ends `FAILED` with the last error.
    /// Default 5; at least 1 (1: the first error fails the command).
    pub max_attempts: u32,
    /// Delay before the first retry. Default 1 s; above zero.
    pub initial_backoff: Duration,
    /// Growth per further error. Default 2.0; at least 1.0.
    pub backoff_factor: f64,
    /// Longest delay. Default 5 min; at least `initial_backoff`.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            initial_backoff: Duration::from_secs(1),
            backoff_factor: 2.0,
            max_backoff: Duration::from_secs(300),
        }
    }
}

/// Settings of one command queue.
#[derive(Clone, Debug)]
pub struct QueueSettings {
    /// Commands handled at once. Default 16.
    pub concurrency: usize,
    /// A message whose consumer died is taken over after this long (the work queue's claim
    /// timeout). A handler whose process lives is never reclaimed, however long it runs: its
    /// lease is renewed every heartbeat. Default 30 s; at least 100 ms.
    pub claim_timeout: Duration,
    /// Delay before the next `check_status` when the result names none. Default 10 s; at least
    /// 10 ms. Independent of `claim_timeout`.
    pub check_status_interval: Duration,
    /// Handler error retries.
    pub retry: RetryPolicy,
    /// The work queue's poll interval (reclaim cadence). Default: the queue's default.
    pub poll_interval: Option<Duration>,
    /// A handler running longer loses its lease: renewal stops and the message becomes
    /// reclaimable at once (the work queue's `max_processing_time`; the handler is not stopped).
    /// Default 15 min.
    pub max_processing_time: Duration,
    /// Prefix of the queue consumer's name. Default `baton-cmd`.
    pub consumer_prefix: String,
    /// Other consumers of the queue's group (processes that stopped or died) idle this long with
    /// no pending entry are removed from it by this service's consumer (the work queue's
    /// `reap_idle_consumers_after`). `None`: never.
    /// Default `Some(1 h)`, the work queue's default; at least twice `claim_timeout`, so that a
    /// live consumer is never taken for a dead one.
    pub reap_idle_consumers_after: Option<Duration>,
    /// The queue's rate limit: commands (their messages: executes and `check_status` calls
    /// alike) are started at most at this rate by all of the queue's workers together (the work
    /// queue's [`RateLimit`](baton_queue::RateLimit), in-process and remote workers). `None`
    /// (default): no limit. Every process serving the queue should say the same.
    pub rate_limit: Option<baton_queue::RateLimit>,
    /// A rate limit per concurrency key ([`Command::with_concurrency_key`]): commands of one key
    /// are started at most at this rate by all of the queue's workers together (the work queue's
    /// [`rate_limit_per_key`](baton_queue::ConsumerOptions::rate_limit_per_key)); a command over
    /// its key's rate waits in the queue's delayed set, not in front of other keys' commands.
    /// Commands without a key are not limited by it. `None` (default): no limit.
    pub rate_limit_per_key: Option<baton_queue::RateLimit>,
    /// The most commands of this queue running at once across every process (the work queue's
    /// `max_concurrency`: messages pending in its group, commands waiting for a `check_status`
    /// re-poll shorter than `claim_timeout` included). `None`: no cap (default); at least 1.
    pub max_concurrency: Option<u32>,
    /// The most commands of one concurrency key ([`Command::with_concurrency_key`]) running at
    /// once across every process (the work queue's `concurrency_per_key`); the others start in
    /// submit order as those end. `None`: no cap (default); at least 1.
    pub concurrency_per_key: Option<u32>,
    #[doc(hidden)]
    pub fail_points: FailPoints,
}

/// Test hooks that simulate a crash at a point of a hand-off: the delivery is left unacked
/// (redelivered after `claim_timeout`) and nothing after that point runs.
#[doc(hidden)]
#[derive(Clone, Debug, Default)]
pub struct FailPoints {
    /// After the hand-off's state write (and its enqueue, when atomic).
    pub crash_after_handoff_state: bool,
    /// After the hand-off's enqueue on the target, before the source ack.
    pub crash_after_handoff_enqueue: bool,
}

impl Default for QueueSettings {
    fn default() -> Self {
        Self {
            concurrency: 16,
            claim_timeout: Duration::from_secs(30),
            check_status_interval: Duration::from_secs(10),
            retry: RetryPolicy::default(),
            poll_interval: None,
            max_processing_time: Duration::from_secs(15 * 60),
            consumer_prefix: "baton-cmd".into(),
            reap_idle_consumers_after: ConsumerOptions::default().reap_idle_consumers_after,
            rate_limit: None,
            rate_limit_per_key: None,
            max_concurrency: None,
            concurrency_per_key: None,
            fail_points: FailPoints::default(),
        }
    }
}

impl QueueSettings {
    /// Checks every rule of the fields above, those the work queue's consumer applies included
    /// (as [`CommandServiceBuilder::start`] does first), e.g. to refuse a configuration before
    /// any service starts.
    ///
    /// Errors: [`CommandError::InvalidSettings`] or [`CommandError::Queue`], naming the setting
    /// and its rule.
    pub fn validate(&self) -> Result<(), CommandError> {
        self.consumer_options().map(|_| ())
    }

    /// The work queue consumer's options, once every rule is checked.
    pub(crate) fn consumer_options(&self) -> Result<ConsumerOptions, CommandError> {
        let bad = |m: String| Err(CommandError::InvalidSettings(m));
        let r = &self.retry;
        if r.max_attempts == 0 {
            return bad("retry.max_attempts must be at least 1".into());
        }
        if r.initial_backoff.is_zero() || r.max_backoff < r.initial_backoff {
            return bad("retry.initial_backoff must be above zero and at most retry.max_backoff".into());
        }
        if !(r.backoff_factor >= 1.0 && r.backoff_factor.is_finite()) {
            return bad(format!("retry.backoff_factor must be at least 1.0 (got {})", r.backoff_factor));
        }
        if self.check_status_interval < Duration::from_millis(10) {
            return bad(format!("check_status_interval must be at least 10ms (got {:?})", self.check_status_interval));
        }
        if let Some(r) = self.reap_idle_consumers_after {
            if r < self.claim_timeout.saturating_mul(2) {
                return bad(format!(
                    "reap_idle_consumers_after ({r:?}) must be at least twice claim_timeout ({:?}), or None to never \
                     remove idle consumers",
                    self.claim_timeout
                ));
            }
        }
        let mut o = ConsumerOptions::new()
            .with_concurrency(self.concurrency)
            .with_claim_timeout(self.claim_timeout)
            .with_max_processing_time(self.max_processing_time)
            // The command service counts attempts itself (`max_attempts`) and must end a command
            // in a persisted state, never leave it in the queue's dead letters.
            .with_max_deliveries(None)
            .with_reap_idle_consumers_after(self.reap_idle_consumers_after)
            .with_consumer_prefix(self.consumer_prefix.clone())
            .with_rate_limit(self.rate_limit)
            .with_rate_limit_per_key(self.rate_limit_per_key)
            .with_max_concurrency(self.max_concurrency)
            .with_concurrency_per_key(self.concurrency_per_key);
        if let Some(p) = self.poll_interval {
            o = o.with_poll_interval(p);
        }
        o.validate()?;
        Ok(o)
    }
}

type Handlers = HashMap<String, Arc<dyn CommandHandler>>;

pub(crate) struct Ctx {
    pub(crate) store: CommandStore,
    pub(crate) queue: String,
    pub(crate) settings: QueueSettings,
    pub(crate) handlers: Arc<Handlers>,
}

/// Builds a [`CommandService`]: `CommandService::builder(store, "queue").handler("type", h)...start()`.
pub struct CommandServiceBuilder {
    store: CommandStore,
    queue: String,
    settings: QueueSettings,
    handlers: Handlers,
}

impl CommandServiceBuilder {
    /// The queue's settings (default [`QueueSettings::default`]).
    pub fn settings(mut self, settings: QueueSettings) -> Self {
        self.settings = settings;
        self
    }

    /// Registers `handler` for commands of `command_type` (replacing an earlier one).
    pub fn handler(mut self, command_type: impl Into<String>, handler: impl CommandHandler) -> Self {
        self.handlers.insert(command_type.into(), Arc::new(handler));
        self
    }

    /// Registers a shared handler for `command_type`.
    pub fn handler_arc(mut self, command_type: impl Into<String>, handler: Arc<dyn CommandHandler>) -> Self {
        self.handlers.insert(command_type.into(), handler);
        self
    }

    /// Validates the settings, registers the queue in the store and starts consuming.
    ///
    /// Several services (instances) may serve one queue, in one process or many.
    ///
    /// Errors: [`CommandError::InvalidSettings`] / [`CommandError::Queue`] naming the bad setting.
    pub async fn start(self) -> Result<CommandService, CommandError> {
        validate_queue(&self.queue)?;
        for t in self.handlers.keys() {
            crate::validate_type(t)?;
        }
        let options = self.settings.consumer_options()?;
        let handlers = Arc::new(self.handlers);
        let registration = self.store.register_service(&self.queue, handlers.clone());
        let ctx =
            Arc::new(Ctx { store: self.store.clone(), queue: self.queue.clone(), settings: self.settings, handlers });
        let c2 = ctx.clone();
        let consumer =
            self.store.messages().consume(&self.queue, move |d: Delivery| dispatch(c2.clone(), d), options).await;
        let consumer = match consumer {
            Ok(c) => c,
            Err(e) => {
                self.store.unregister_service(&self.queue, registration);
                return Err(e.into());
            }
        };
        let sampler = self.store.minute_sampler(&self.queue)?;
        Ok(CommandService { ctx, registration, consumer: std::sync::Mutex::new(Some(consumer)), sampler })
    }
}

/// The command service of one queue: consumes the queue and runs its handlers (crate docs).
/// Stop it with [`CommandService::drain`], [`CommandService::close`] or [`CommandService::abort`].
pub struct CommandService {
    ctx: Arc<Ctx>,
    registration: u64,
    consumer: std::sync::Mutex<Option<baton_queue::Consumer>>,
    /// The queue's per-minute depth sampler.
    sampler: crate::minutes::MinuteSampler,
}

impl CommandService {
    /// A builder for a service of `queue` on `store`.
    pub fn builder(store: CommandStore, queue: impl Into<String>) -> CommandServiceBuilder {
        CommandServiceBuilder {
            store,
            queue: queue.into(),
            settings: QueueSettings::default(),
            handlers: HashMap::new(),
        }
    }

    /// The queue served.
    pub fn queue(&self) -> &str {
        &self.ctx.queue
    }

    /// The shared store.
    pub fn store(&self) -> &CommandStore {
        &self.ctx.store
    }

    /// Submits `command` to this service's queue (see [`CommandStore::submit`]).
    pub async fn submit(&self, command: Command) -> Result<CommandState, CommandError> {
        self.ctx.store.submit(&self.ctx.queue, command).await
    }

    /// Stops taking work, lets running handlers finish within `budget` (see the work queue's
    /// `drain`). Unfinished commands are taken over by another instance after `claim_timeout`.
    pub async fn drain(&self, budget: Duration) -> DrainReport {
        let c = self.consumer.lock().unwrap().take();
        self.sampler.stop();
        self.ctx.store.unregister_service(&self.ctx.queue, self.registration);
        match c {
            Some(c) => c.drain(budget).await,
            None => DrainReport::default(),
        }
    }

    /// [`CommandService::drain`] with no budget.
    pub async fn close(&self) -> DrainReport {
        self.drain(Duration::ZERO).await
    }

    /// Stops at once as if the process died: running handlers are aborted, their commands are
    /// taken over elsewhere after `claim_timeout`.
    pub fn abort(&self) {
        if let Some(c) = self.consumer.lock().unwrap().take() {
            c.abort();
        }
        self.sampler.stop();
        self.ctx.store.unregister_service(&self.ctx.queue, self.registration);
    }
}

impl Drop for CommandService {
    fn drop(&mut self) {
        self.sampler.stop();
        if self.consumer.lock().unwrap().is_some() {
            self.ctx.store.unregister_service(&self.ctx.queue, self.registration);
        }
    }
}

/// Delay before redelivery when the store could not be reached.
const STORE_RETRY: Duration = Duration::from_secs(1);

async fn dispatch(ctx: Arc<Ctx>, d: Delivery) -> Decision {
    let msg: CommandMsg = match serde_json::from_slice(&d.payload) {
        Ok(m) => m,
        Err(e) => return Decision::DeadLetter(format!("not a command message: {e}")),
    };
    match run(&ctx, &msg, &d.lease, d.deliveries).await {
        Ok(decision) => decision,
        Err(e) => {
            tracing::warn!(queue = %ctx.queue, command = %msg.id, error = %e, "command store unavailable; retrying the delivery");
            Decision::RetryAfter(STORE_RETRY)
        }
    }
}

/// What a handler call gave: a result, or an error (retried with backoff).
pub(crate) enum Outcome {
    Result(CommandResult),
    Error(String),
}

/// What a delivery of a command message calls for, from the command's persisted state.
pub(crate) enum Prepared {
    /// Nothing to call: settle the delivery with this decision (missing, terminal, stale or
    /// moved-on command, an interrupted hand-off finished).
    Settle(Decision),
    /// Call the handler: `execute` when the state is `SUBMITTED`, else `check_status`.
    Call { st: Box<CommandState>, is_execute: bool },
}

/// Steps 1 and 2 of the module docs, and the choice of step 3, for a delivery of `msg` on
/// `ctx.queue`.
pub(crate) async fn prepare(ctx: &Ctx, msg: &CommandMsg) -> Result<Prepared, CommandError> {
    let backend = &ctx.store.inner.backend;
    let Some(st) = backend.load(&msg.home, &msg.id).await? else { return Ok(Prepared::Settle(Decision::Ack)) };
    if st.status.is_terminal() {
        return Ok(Prepared::Settle(Decision::Ack));
    }
    if st.token != msg.token {
        if st.prev_token.as_deref() == Some(msg.token.as_str()) && st.current_queue() != ctx.queue {
            return Ok(Prepared::Settle(finish_handoff(ctx, st).await?));
        }
        tracing::debug!(queue = %ctx.queue, command = %msg.id, "stale message for the command; acked");
        return Ok(Prepared::Settle(Decision::Ack));
    }
    if st.current_queue() != ctx.queue {
        return Ok(Prepared::Settle(Decision::Ack));
    }
    let is_execute = st.status == CommandStatus::Submitted;
    Ok(Prepared::Call { st: Box::new(st), is_execute })
}

async fn run(ctx: &Arc<Ctx>, msg: &CommandMsg, lease: &Lease, deliveries: u32) -> Result<Decision, CommandError> {
    let (st, is_execute) = match prepare(ctx, msg).await? {
        Prepared::Settle(d) => return Ok(d),
        Prepared::Call { st, is_execute } => (st, is_execute),
    };
    // A child of the submit's span (the state's trace context), in whichever process this runs.
    let span = tracing::info_span!(
        target: crate::trace::SPAN_TARGET,
        "baton.dispatch",
        baton.queue = %ctx.queue,
        baton.command.id = %st.id,
        baton.command.type = %st.command_type,
        baton.deliveries = deliveries,
        baton.worker = %lease.consumer(),
    );
    crate::trace::set_parent(&span, st.trace.as_deref());
    tracing::Instrument::instrument(call_handler(ctx, msg, lease, deliveries, st, is_execute), span).await
}

/// Step 3 of the module docs for a prepared delivery: the handler call and the write of its
/// outcome (inside `baton.dispatch`).
async fn call_handler(
    ctx: &Arc<Ctx>,
    msg: &CommandMsg,
    lease: &Lease,
    deliveries: u32,
    st: Box<CommandState>,
    is_execute: bool,
) -> Result<Decision, CommandError> {
    // Boxed into this call: a state held by value would take its room in this future for the
    // whole call (an argument's place is never reused).
    let st = *st;
    let backend = &ctx.store.inner.backend;
    let Some(handler) = ctx.handlers.get(&st.command_type).cloned() else {
        let err = format!("no handler for command type {:?} on queue {:?}", st.command_type, ctx.queue);
        let failed = Outcome::Result(CommandResult::Failed(err));
        let holder = Some(Holder::Lease(lease));
        return Ok(apply(ctx, st, msg, holder, false, Timestamp::now(), failed, OutputFence::Unknown).await?.decision);
    };
    // Remote cancels reach this process through the home queue's notifications.
    backend.watch_home(&msg.home).await?;
    let mut command: Command = st.command();
    // The delivery's epoch of the output's producer: the current one, until its handler claims
    // a newer one (`Output::open`); its terminal write's end is fenced to it.
    let mut output_epoch = None;
    if let (Some(link), Some(streams)) = (&st.output, ctx.store.outputs()) {
        let current = match streams.producer_epoch(&link.path(), crate::OUTPUT_PRODUCER).await {
            Ok(e) => e,
            Err(baton_streams::StreamError::NotFound { .. } | baton_streams::StreamError::Gone { .. }) => None,
            Err(e) => return Err(CommandError::Output(format!("reading {}: {e}", link.stream))),
        };
        let epoch = Arc::new(std::sync::Mutex::new(current));
        output_epoch = Some(epoch.clone());
        command.output =
            Some(crate::Output { streams: streams.clone(), link: link.clone(), cancel: command.cancel.clone(), epoch });
    }
    let reports = Arc::new(Reports::default());
    command.reports = Some(reports.clone());
    let _running = ctx.store.inner.hub.running(&st.id, st.version, command.cancel.clone());
    // When this call starts (an `execute`'s: the command's `started_at` unless an earlier call
    // set it).
    let now = Timestamp::now();
    let check_state = (!is_execute).then(|| st.clone());
    let latest = Arc::new(std::sync::Mutex::new(st));
    let stop = tokio_util::sync::CancellationToken::new();
    // Also when this future is dropped mid-call: the writer never outlives the call.
    let _stop_on_drop = stop.clone().drop_guard();
    let call_span = if is_execute {
        tracing::info_span!(target: crate::trace::SPAN_TARGET, "baton.execute", baton.command.id = %msg.id, baton.command.type = %command.command_type)
    } else {
        tracing::info_span!(target: crate::trace::SPAN_TARGET, "baton.check_status", baton.command.id = %msg.id, baton.command.type = %command.command_type)
    };
    let call = tracing::Instrument::instrument(
        async {
            if is_execute {
                handler.execute(command).await
            } else {
                handler.check_status(command, check_state.expect("a check_status call")).await
            }
        },
        call_span,
    );
    let call = std::panic::AssertUnwindSafe(call).catch_unwind();
    tokio::pin!(call);
    // Most calls end within the first interval: they never start a writer (one timer each).
    let mut writer = None;
    let result = match tokio::time::timeout(REPORT_INTERVAL, &mut call).await {
        Ok(r) => r,
        Err(_) => {
            let execution = Execution {
                worker: lease.consumer().to_string(),
                call: if is_execute { ExecutionCall::Execute } else { ExecutionCall::CheckStatus },
                since: now,
                deliveries,
                deadline: Timestamp::from_millis(now.millis() + ctx.settings.max_processing_time.as_millis() as u64),
            };
            writer = Some(tokio::spawn(write_reports(
                ctx.clone(),
                msg.clone(),
                lease.clone(),
                execution,
                reports.clone(),
                latest.clone(),
                stop.clone(),
            )));
            call.await
        }
    };
    let outcome = match result {
        Ok(Ok(r)) => Outcome::Result(r),
        Ok(Err(e)) => Outcome::Error(error_text(&e)),
        Err(p) => Outcome::Error(format!("handler panicked: {}", panic_text(&*p))),
    };
    tracing::debug!(
        queue = %ctx.queue,
        command = %msg.id,
        call = if is_execute { "execute" } else { "check_status" },
        returned = matches!(outcome, Outcome::Result(_)),
        "handler call ended"
    );
    drop(_running);
    // The report writer ends after its write in flight (if any), so that the outcome is written
    // on the latest state, with the last report.
    stop.cancel();
    if let Some(w) = writer {
        let _ = w.await;
    }
    let mut st = match Arc::try_unwrap(latest) {
        Ok(m) => m.into_inner().expect("lock"),
        Err(shared) => shared.lock().expect("lock").clone(),
    };
    if let Some(r) = reports.take() {
        r.apply_to(&mut st);
    }
    let fence = output_epoch.map_or(OutputFence::Unknown, |e| OutputFence::Delivery(*e.lock().expect("lock")));
    Ok(apply(ctx, st, msg, Some(Holder::Lease(lease)), is_execute, now, outcome, fence).await?.decision)
}

/// How often a running in-process handler's reports ([`Command::progress`],
/// [`Command::checkpoint`]) are written into its command's state, and how long a call runs
/// before its [`Execution`] is written: about once a second, in the queue's batched state
/// writes (one script call per home queue for all the commands written together, not one per
/// command). Calls shorter than this write nothing before their outcome.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(1);

/// A running handler's reports not written yet: the latest progress and the latest details.
#[derive(Debug, Default)]
pub(crate) struct Reports(std::sync::Mutex<Option<RemoteReport>>);

impl Reports {
    /// Keeps `r`'s parts over the ones not written yet.
    pub(crate) fn put(&self, r: RemoteReport) {
        let mut g = self.0.lock().expect("lock");
        let p = g.get_or_insert(RemoteReport { progress: None, details: None });
        p.progress = r.progress.or(p.progress.take());
        p.details = r.details.or(p.details.take());
    }

    /// Puts back the parts of a report whose write failed, under any reported since.
    fn restore(&self, r: RemoteReport) {
        let mut g = self.0.lock().expect("lock");
        let p = g.get_or_insert(RemoteReport { progress: None, details: None });
        p.progress = p.progress.take().or(r.progress);
        p.details = p.details.take().or(r.details);
    }

    fn take(&self) -> Option<RemoteReport> {
        self.0.lock().expect("lock").take()
    }
}

impl RemoteReport {
    /// Replaces `st`'s progress and/or details by this report's.
    pub(crate) fn apply_to(self, st: &mut CommandState) {
        st.progress = self.progress.or(st.progress.take());
        st.details = self.details.or(st.details.take());
    }
}

/// Writes a running in-process handler's [`Execution`] (at once: it is started once the call
/// has run [`REPORT_INTERVAL`]) and its reports (then every [`REPORT_INTERVAL`] when there are
/// new ones) into its command's state, until
/// `stop`: compare-and-sets that keep the status, owner-checked in the same step where the
/// backend can (Redis, the delivery in the home queue's slot), never after the lease is lost or
/// the command moved on. `latest` holds the state last written (the outcome is written on it).
async fn write_reports(
    ctx: Arc<Ctx>,
    msg: CommandMsg,
    lease: Lease,
    execution: Execution,
    reports: Arc<Reports>,
    latest: Arc<std::sync::Mutex<CommandState>>,
    stop: tokio_util::sync::CancellationToken,
) {
    let backend = &ctx.store.inner.backend;
    let delivery = lease
        .redis_target()
        .filter(|_| backend.can_fold_ack(&msg.home, &ctx.queue))
        .map(|target| DeliveryRef { id: lease.id().to_string(), target, ack: false, owned: true, fence: None });
    let mut shown = false;
    let mut wait = false;
    loop {
        if wait {
            tokio::select! {
                _ = tokio::time::sleep(REPORT_INTERVAL) => {}
                _ = stop.cancelled() => return,
            }
        }
        wait = true;
        if stop.is_cancelled() || lease.is_lost() {
            return;
        }
        let report = reports.take();
        if shown && report.is_none() {
            continue;
        }
        let cur = latest.lock().expect("lock").clone();
        // Shown already (also by a write whose reply was lost, found by the conflict it causes).
        shown = shown || cur.execution.as_ref() == Some(&execution);
        if shown && report.is_none() {
            continue;
        }
        let mut next = cur.clone();
        next.version += 1;
        next.modified_at = Timestamp::now();
        next.execution = Some(execution.clone());
        // The first write of an `execute` call is its start; later ones (and a long
        // `check_status` call's) are its reports.
        let event = if !shown && execution.call == ExecutionCall::Execute {
            Some((EventKind::Started, None))
        } else {
            report.is_some().then_some((EventKind::Progress, None))
        };
        if let Some(r) = report.clone() {
            r.apply_to(&mut next);
        }
        match ctx.store.write_for(cur.status, next, None, delivery.as_ref(), event).await {
            Ok((Ok(written), _)) => {
                *latest.lock().expect("lock") = written;
                shown = true;
            }
            // Another write kept the status (a cancel or an outcome would not): write again on it.
            Ok((Err(Some(l)), _)) if !l.status.is_terminal() && l.token == msg.token && l.status == cur.status => {
                *latest.lock().expect("lock") = l;
                if let Some(r) = report {
                    reports.restore(r);
                }
            }
            Ok((Err(_), _)) | Err(CommandError::Queue(baton_queue::QueueError::LeaseLost(_))) => return,
            Err(e) => {
                tracing::warn!(queue = %ctx.queue, command = %msg.id, error = %e, "writing a handler's progress failed; tried again in a second");
                if let Some(r) = report {
                    reports.restore(r);
                }
            }
        }
    }
}

fn error_text(e: &HandlerError) -> String {
    let s = e.to_string();
    if s.is_empty() {
        "handler error".into()
    } else {
        s
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".into()
    }
}

/// What to do with an outcome, given the current state.
struct Plan {
    /// The state to write; `None`: nothing to write.
    next: Option<CommandState>,
    /// The feed event of the write (and a retry's delay, ms).
    event: Option<(EventKind, Option<u64>)>,
    decision: Decision,
    /// A hand-off: (target queue, message).
    handoff: Option<(String, CommandMsg)>,
}

/// `started`: when the `execute` call that gave `outcome` began (`None` for `check_status` or
/// when no handler ran).
fn plan(
    ctx: &Ctx,
    cur: &CommandState,
    msg: &CommandMsg,
    is_execute: bool,
    started: Option<Timestamp>,
    outcome: &Outcome,
) -> Plan {
    let now = Timestamp::now();
    let mut next = cur.clone();
    next.version += 1;
    next.modified_at = now;
    // The call is over: whatever comes next, it is not working on the command any more.
    next.execution = None;
    if is_execute {
        next.attempts += 1;
    }
    next.started_at = next.started_at.or(started);
    // The handler call's start for the per-minute durations: this `execute` call's, or for a
    // `check_status` outcome the work's (see `minutes`).
    // (No handler ran: `started` is `None` for `execute`, so no duration.)
    next.attempt_start.0 = if is_execute { started } else { cur.started_at }.map(|t| t.millis());
    let terminal = |mut n: CommandState, status: CommandStatus| {
        n.status = status;
        n.completed_at = Some(now);
        n.errors_count = 0;
        let kind = match status {
            CommandStatus::Succeeded => EventKind::Succeeded,
            CommandStatus::Cancelled => EventKind::Cancelled,
            _ => EventKind::Failed,
        };
        Plan { next: Some(n), event: Some((kind, None)), decision: Decision::Ack, handoff: None }
    };
    match outcome {
        Outcome::Result(CommandResult::Succeeded(v)) => {
            next.result = Some(v.clone());
            next.error = None;
            terminal(next, CommandStatus::Succeeded)
        }
        Outcome::Result(CommandResult::Failed(e)) => {
            next.error = Some(e.clone());
            terminal(next, CommandStatus::Failed)
        }
        Outcome::Result(CommandResult::Cancelled) => terminal(next, CommandStatus::Cancelled),
        Outcome::Result(CommandResult::Running { next_check }) => {
            let delay = next_check.unwrap_or(ctx.settings.check_status_interval);
            let refresh_due = now.millis().saturating_sub(cur.modified_at.millis())
                > (ctx.store.inner.settings.lifetimes_of(&cur.queue).state_ttl / 2).as_millis() as u64;
            let unchanged = cur.status == CommandStatus::Running && cur.errors_count == 0;
            if unchanged && !refresh_due {
                return Plan { next: None, event: None, decision: Decision::RetryAfter(delay), handoff: None };
            }
            next.status = CommandStatus::Running;
            next.started_at = next.started_at.or(Some(now));
            next.errors_count = 0;
            next.error = None;
            // A refresh of the state's lifetime is not an event.
            let event = (!unchanged).then_some((EventKind::Running, None));
            Plan { next: Some(next), event, decision: Decision::RetryAfter(delay), handoff: None }
        }
        Outcome::Result(CommandResult::RateLimited { retry_after }) => {
            // Not a call that counts: no attempt, no error, the status as it was; only the
            // in-flight marker of this call goes (when it was written). The queue backs off and
            // the same message is delivered again after it.
            let decision = Decision::RateLimited(*retry_after);
            if cur.execution.is_none() {
                return Plan { next: None, event: None, decision, handoff: None };
            }
            let mut n = cur.clone();
            n.version += 1;
            n.modified_at = now;
            n.execution = None;
            Plan { next: Some(n), event: None, decision, handoff: None }
        }
        Outcome::Result(CommandResult::HandedOff { queue: target }) => {
            let refuse = if target == &ctx.queue {
                Some(format!("cannot hand off command to its own queue {target:?}"))
            } else if validate_queue(target).is_err() || !ctx.store.knows_queue(target) {
                Some(format!("hand-off to unknown queue {target:?}: no command service or declared queue of that name"))
            } else {
                None
            };
            if let Some(err) = refuse {
                next.error = Some(err);
                return terminal(next, CommandStatus::Failed);
            }
            let token = new_token();
            next.status = CommandStatus::Running;
            next.started_at = next.started_at.or(Some(now));
            next.errors_count = 0;
            next.error = None;
            next.handed_off_to = Some(target.clone());
            next.prev_token = Some(msg.token.clone());
            next.token = token.clone();
            let m = CommandMsg { id: cur.id.clone(), home: cur.queue.clone(), token };
            Plan {
                next: Some(next),
                event: Some((EventKind::HandedOff, None)),
                decision: Decision::Ack,
                handoff: Some((target.clone(), m)),
            }
        }
        Outcome::Error(e) => {
            let errors = cur.errors_count + 1;
            next.errors_count = errors;
            next.error = Some(e.clone());
            if errors >= ctx.settings.retry.max_attempts {
                let mut n = terminal(next, CommandStatus::Failed);
                if let Some(s) = n.next.as_mut() {
                    s.errors_count = errors;
                }
                return n;
            }
            let delay = backoff(&ctx.settings.retry, errors);
            Plan {
                next: Some(next),
                event: Some((EventKind::RetryScheduled, Some(delay.as_millis() as u64))),
                decision: Decision::RetryAfter(delay),
                handoff: None,
            }
        }
    }
}

/// Writes the outcome by CAS, re-reading on conflicts.
///
/// When the outcome acks the delivery (a terminal state, or an atomic hand-off), `lease` is
/// given (an in-process delivery) and the backend can, the ack is done by the same atomic write (ownership-checked, see baton-queue's
/// `Lease::mark_acked`): one round trip instead of two, and no window in which the state is
/// terminal while its message still waits for an ack.
///
/// `called_at`: when the handler call that gave `outcome` began (for an `execute`, also the
/// command's `started_at` unless an earlier call set it).
///
/// A command with an output (crate docs, "Output streams"): a terminal outcome ends the output
/// first, fenced to the delivery's epoch of its producer (`fence`), and is written only if that
/// end took place; an output that had ended first decides the outcome instead
/// ([`crate::output::decide`]); a fenced end (a later delivery holds the output) writes nothing:
/// [`QueueError::LeaseLost`](baton_queue::QueueError::LeaseLost), unless an in-process holder
/// still holds its lease (then the newer epoch is its own handler's, claimed outside
/// [`crate::Output::open`], and the end is fenced to it). A non-terminal outcome reads the
/// output's end first, as it may decide.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn apply(
    ctx: &Ctx,
    mut cur: CommandState,
    msg: &CommandMsg,
    holder: Option<Holder<'_>>,
    is_execute: bool,
    called_at: Timestamp,
    outcome: Outcome,
    mut fence: OutputFence,
) -> Result<Applied, CommandError> {
    let backend = &ctx.store.inner.backend;
    let started = is_execute.then_some(called_at);
    let output = match (&cur.output, ctx.store.outputs()) {
        (Some(link), Some(streams)) => Some((link.clone(), streams.clone())),
        _ => None,
    };
    let result_of = |o: &Outcome| match o {
        Outcome::Result(r) => Some(r.clone()),
        Outcome::Error(_) => None,
    };
    let mut outcome = outcome;
    // The output's end is settled: ended by this write, or found ended (and decided by).
    let mut ended = false;
    // An output stream that ended first decides (crate docs, "Output streams"); a terminal
    // result learns of it from its own (fenced) end below.
    if let Some((link, streams)) = &output {
        if !matches!(&outcome, Outcome::Result(r) if r.is_terminal()) {
            let result = result_of(&outcome);
            if let Some(r) = crate::output::decide(streams, link, result.as_ref(), called_at.millis()).await {
                outcome = Outcome::Result(r);
                ended = true;
            }
        }
    }
    let mut refenced = false;
    let fp = &ctx.settings.fail_points;
    let no_crash_test = !fp.crash_after_handoff_state && !fp.crash_after_handoff_enqueue;
    loop {
        let p = plan(ctx, &cur, msg, is_execute, started, &outcome);
        let Some(next) = p.next else { return Ok(Applied { decision: p.decision, written: true, state: Some(cur) }) };
        if let (Some((link, streams)), true, false) = (&output, next.status.is_terminal(), ended) {
            match crate::output::end_fenced(streams, link, next.status, next.error.as_deref(), fence).await? {
                FencedEnd::Ended => ended = true,
                FencedEnd::EndedBefore => {
                    ended = true;
                    let result = result_of(&outcome);
                    if let Some(r) = crate::output::decide(streams, link, result.as_ref(), 0).await {
                        outcome = Outcome::Result(r);
                    }
                    continue;
                }
                FencedEnd::Fenced(current) => match &holder {
                    Some(Holder::Lease(l)) if !l.is_lost() && !refenced => {
                        refenced = true;
                        fence = OutputFence::Delivery(Some(current));
                        continue;
                    }
                    Some(Holder::Lease(l)) => {
                        return Err(CommandError::Queue(baton_queue::QueueError::LeaseLost(l.id())))
                    }
                    Some(Holder::Remote(_, id, _)) => {
                        return Err(CommandError::Queue(baton_queue::QueueError::LeaseLost(*id)))
                    }
                    None => return Ok(Applied { decision: Decision::Ack, written: false, state: None }),
                },
            }
        }
        let atomic = p.handoff.as_ref().is_some_and(|(t, _)| backend.atomic_enqueue(&cur.queue, t));
        let enqueue = if atomic { p.handoff.as_ref().map(|(t, m)| (t.as_str(), m)) } else { None };
        let fold = p.decision == Decision::Ack
            && (p.handoff.is_none() || atomic)
            && no_crash_test
            && backend.can_fold_ack(&cur.queue, &ctx.queue);
        let same_slot = backend.can_fold_ack(&cur.queue, &ctx.queue);
        let delivery = holder.as_ref().and_then(|h| h.delivery_ref(fold, same_slot));
        let (written, acked) = write_retrying(ctx, cur.status, next, enqueue, delivery.as_ref(), p.event).await?;
        if acked {
            if let Some((target, m)) = &p.handoff {
                tracing::debug!(queue = %ctx.queue, command = %m.id, target, atomic, "command handed off");
            }
            let decision = match holder.as_ref().map(Holder::mark_acked) {
                Some(true) => Decision::Deferred,
                _ => Decision::Ack,
            };
            return Ok(Applied { decision, written: true, state: written.ok() });
        }
        match written {
            Ok(state) => {
                if let Some((target, m)) = &p.handoff {
                    let decision = handoff_tail(ctx, target, m, atomic).await?;
                    return Ok(Applied { decision, written: true, state: Some(state) });
                }
                return Ok(Applied { decision: p.decision, written: true, state: Some(state) });
            }
            Err(None) => return Ok(Applied { decision: Decision::Ack, written: false, state: None }),
            Err(Some(latest)) => {
                if latest.status.is_terminal() || latest.token != msg.token || latest.status != cur.status {
                    tracing::debug!(queue = %ctx.queue, command = %latest.id, status = %latest.status, "outcome refused: the command moved on");
                    return Ok(Applied { decision: Decision::Ack, written: false, state: Some(latest) });
                }
                cur = latest;
            }
        }
    }
}

/// What [`apply`] did: the delivery's decision (`Deferred`: the write acked it already), whether
/// the outcome was written, and the command's state after it (the written one, or the one that
/// refused it; `None` when the command is gone).
pub(crate) struct Applied {
    pub decision: Decision,
    pub written: bool,
    pub state: Option<CommandState>,
}

/// Who holds the delivery an outcome settles: an in-process lease, or a remote worker's
/// consumer with the message id and the delivery's fence. A terminal write may ack it in the
/// same atomic step.
pub(crate) enum Holder<'a> {
    Lease(&'a Lease),
    Remote(&'a baton_queue::RemoteConsumer, baton_queue::MessageId, u64),
}

impl Holder<'_> {
    /// The delivery a write is for (Redis only), when the write acks it (`ack`) or must check
    /// that the holder still owns it: a remote worker's writes do wherever the backend can
    /// (`same_slot`), so that a worker whose lease was taken over writes nothing (an in-process
    /// lease's handler is told by its own heartbeat instead).
    pub(crate) fn delivery_ref(&self, ack: bool, same_slot: bool) -> Option<DeliveryRef> {
        let (id, target, owned, fence) = match self {
            Holder::Lease(l) => (l.id().to_string(), l.redis_target(), false, None),
            Holder::Remote(c, id, fence) => (id.to_string(), c.redis_target(), same_slot, Some(*fence)),
        };
        (ack || owned).then_some(())?;
        target.map(|target| DeliveryRef { id, target, ack, owned, fence })
    }

    /// Whether a write for this holder checks its ownership in the same atomic step (see
    /// [`Holder::delivery_ref`]).
    pub(crate) fn checked_in_write(&self, backend: &dyn crate::store::StateBackend, home: &str, queue: &str) -> bool {
        matches!(self, Holder::Remote(c, ..) if c.redis_target().is_some()) && backend.can_fold_ack(home, queue)
    }

    /// Tells the holder its delivery was acked by the write; false when a lease was already
    /// settled (then the caller acks as usual, which finds it settled).
    fn mark_acked(&self) -> bool {
        match self {
            Holder::Lease(l) => l.mark_acked().is_ok(),
            Holder::Remote(..) => true,
        }
    }
}

/// After a hand-off's state write: enqueue on the target (unless done atomically), then ack.
async fn handoff_tail(ctx: &Ctx, target: &str, m: &CommandMsg, atomic: bool) -> Result<Decision, CommandError> {
    // Held, not entered (no spans of ours below it); it ends when this returns.
    let _span = tracing::info_span!(
        target: crate::trace::SPAN_TARGET,
        "baton.handoff",
        baton.queue = %ctx.queue,
        baton.command.id = %m.id,
        baton.handoff.target = %target,
    );
    let fp = &ctx.settings.fail_points;
    if fp.crash_after_handoff_state {
        return Ok(Decision::Retry);
    }
    if !atomic {
        ctx.store.inner.backend.enqueue(target, m).await?;
    }
    if fp.crash_after_handoff_enqueue {
        return Ok(Decision::Retry);
    }
    tracing::debug!(queue = %ctx.queue, command = %m.id, target, atomic, "command handed off");
    Ok(Decision::Ack)
}

/// A replayed source message of a hand-off whose ack did not happen (crash): the enqueue on the
/// target may or may not have happened, so enqueue again under a fresh token (an earlier copy is
/// then stale and acked unrun), then ack the source. `execute` is not called.
async fn finish_handoff(ctx: &Ctx, st: CommandState) -> Result<Decision, CommandError> {
    let target = st.current_queue().to_string();
    let mut next = st.clone();
    next.version += 1;
    next.modified_at = Timestamp::now();
    next.token = new_token();
    next.execution = None;
    let m = CommandMsg { id: st.id.clone(), home: st.queue.clone(), token: next.token.clone() };
    let atomic = ctx.store.inner.backend.atomic_enqueue(&st.queue, &target);
    let enqueue = if atomic { Some((target.as_str(), &m)) } else { None };
    match write_retrying(ctx, st.status, next, enqueue, None, None).await?.0 {
        Ok(_) => {
            if !atomic {
                ctx.store.inner.backend.enqueue(&target, &m).await?;
            }
            tracing::info!(queue = %ctx.queue, command = %st.id, target = %target, "interrupted hand-off finished");
            Ok(Decision::Ack)
        }
        Err(None) => Ok(Decision::Ack),
        Err(Some(latest)) if latest.status.is_terminal() => Ok(Decision::Ack),
        Err(Some(_)) => Ok(Decision::RetryAfter(Duration::from_millis(100))),
    }
}

/// One CAS write, retried a few times on store errors (so a returned `execute` is recorded even
/// through a short Redis hiccup). A write whose reply was lost may have happened: a retry that
/// then finds it (a conflict with `next` itself, or, for a write that also acked, the delivery
/// gone) takes it as done instead of as another writer's step, so it is neither applied twice
/// nor reported lost.
#[allow(clippy::type_complexity)]
async fn write_retrying(
    ctx: &Ctx,
    old: CommandStatus,
    next: CommandState,
    enqueue: Option<(&str, &CommandMsg)>,
    delivery: Option<&DeliveryRef>,
    event: Option<(EventKind, Option<u64>)>,
) -> Result<(Result<CommandState, Option<CommandState>>, bool), CommandError> {
    let mut delay = Duration::from_millis(100);
    let mut tries = 0;
    loop {
        match ctx.store.write_for(old, next.clone(), enqueue, delivery, event).await {
            Ok((Err(Some(latest)), _)) if tries > 0 && same_write(&latest, &next) => return Ok((Ok(latest), false)),
            Err(e @ CommandError::Queue(baton_queue::QueueError::LeaseLost(_))) => {
                if tries > 0 {
                    if let Some(st) = ctx.store.inner.backend.load(&next.queue, &next.id).await? {
                        if same_write(&st, &next) {
                            return Ok((Ok(st), true));
                        }
                    }
                }
                return Err(e);
            }
            Ok(r) => return Ok(r),
            Err(e) if tries < 5 => {
                tracing::warn!(queue = %ctx.queue, command = %next.id, error = %e, "state write failed; retrying");
                tries += 1;
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Whether `stored` is the write of `next` (its version, written at the same millisecond with
/// the same token, status and counts): a retry's own earlier attempt, not another writer's.
pub(crate) fn same_write(stored: &CommandState, next: &CommandState) -> bool {
    stored.version == next.version
        && stored.modified_at == next.modified_at
        && stored.token == next.token
        && stored.status == next.status
        && stored.attempts == next.attempts
        && stored.errors_count == next.errors_count
        && stored.execution == next.execution
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reap_idle_consumers_after_reaches_the_consumer_options() {
        let d = QueueSettings::default();
        assert_eq!(d.reap_idle_consumers_after, Some(Duration::from_secs(3600)));
        assert_eq!(d.consumer_options().unwrap().reap_idle_consumers_after, Some(Duration::from_secs(3600)));
        let s = QueueSettings { reap_idle_consumers_after: Some(Duration::from_secs(60)), ..QueueSettings::default() };
        assert_eq!(s.consumer_options().unwrap().reap_idle_consumers_after, Some(Duration::from_secs(60)));
        let never = QueueSettings { reap_idle_consumers_after: None, ..QueueSettings::default() };
        assert_eq!(never.consumer_options().unwrap().reap_idle_consumers_after, None);
        // Exactly twice the claim timeout is the smallest accepted value.
        let s = QueueSettings {
            claim_timeout: Duration::from_secs(1),
            reap_idle_consumers_after: Some(Duration::from_secs(2)),
            ..QueueSettings::default()
        };
        assert_eq!(s.consumer_options().unwrap().reap_idle_consumers_after, Some(Duration::from_secs(2)));
    }

    #[test]
    fn reap_idle_consumers_after_below_twice_the_claim_timeout_is_refused() {
        let s = QueueSettings { reap_idle_consumers_after: Some(Duration::from_secs(59)), ..QueueSettings::default() };
        let e = s.validate().unwrap_err();
        assert!(matches!(e, CommandError::InvalidSettings(_)), "{e:?}");
        assert_eq!(
            e.to_string(),
            "invalid setting: reap_idle_consumers_after (59s) must be at least twice claim_timeout (30s), or None to \
             never remove idle consumers"
        );
        let s = QueueSettings {
            claim_timeout: Duration::from_millis(1500),
            reap_idle_consumers_after: Some(Duration::from_millis(2999)),
            ..QueueSettings::default()
        };
        assert_eq!(
            s.validate().unwrap_err().to_string(),
            "invalid setting: reap_idle_consumers_after (2.999s) must be at least twice claim_timeout (1.5s), or None \
             to never remove idle consumers"
        );
    }
}
