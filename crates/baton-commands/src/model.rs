//! The command model: commands, results, persisted statuses and states, timestamps.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::{CommandError, RawJson};

/// A command: what to do (`type`), with which parameters (`params`, any JSON value, kept as its
/// text: [`RawJson`]), under a
/// client-supplied id or a generated one (a UUID v7, [`Command::new`]). One id is one command,
/// with one persisted state ([`CommandState`]) in its home queue.
///
/// Handlers receive the command with a cancellation signal attached: [`Command::is_cancelled`] /
/// [`Command::cancelled`] fire when the command is cancelled ([`crate::CommandStore::cancel`],
/// from this process or, on Redis, from any process) while the handler runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Command {
    /// 1 to 200 bytes, no `{`, `}`, whitespace or control characters. [`Command::new`] generates
    /// a UUIDv7.
    pub id: String,
    /// The command type a handler is registered for: 1 to 200 bytes, no control characters.
    #[serde(rename = "type")]
    pub command_type: String,
    /// Parameters, any JSON value (`null` when absent), exactly as given: stored and returned
    /// byte for byte ([`RawJson`]).
    #[serde(default)]
    pub params: RawJson,
    #[serde(skip)]
    pub(crate) cancel: CancellationToken,
    /// The last checkpoint of the command's handler (see [`Command::details`]).
    #[serde(skip)]
    pub(crate) details: Option<RawJson>,
    /// Where [`Command::report`] puts reports (a handler's delivery only).
    #[serde(skip)]
    pub(crate) reports: Option<std::sync::Arc<crate::service::Reports>>,
    /// What the submit asks of an output stream ([`Command::with_output`]).
    #[serde(skip)]
    pub(crate) output_spec: Option<crate::OutputSpec>,
    /// The output stream (a handler's delivery of a command that has one).
    #[serde(skip)]
    pub(crate) output: Option<crate::Output>,
    /// When the command is due ([`Command::with_run_at`], [`Command::with_delay`]); `None`: at once.
    #[serde(skip)]
    pub(crate) run_at: Option<Timestamp>,
    /// `run_at` came from [`Command::with_delay`].
    #[serde(skip)]
    pub(crate) run_at_from_delay: bool,
    /// [`Command::with_concurrency_key`].
    #[serde(skip)]
    pub(crate) concurrency_key: Option<String>,
    /// [`Command::with_priority`].
    #[serde(skip)]
    pub(crate) priority: i8,
    /// [`Command::with_trace_context`].
    #[serde(skip)]
    pub(crate) trace: Option<Box<crate::trace::TraceContext>>,
}

/// The time `delay` from now, as [`Command::with_delay`] schedules it: a delay too large for the
/// clock (e.g. `u64::MAX` seconds, which `SystemTime + Duration` panics on) gives a time far
/// enough ahead that the store refuses it ([`CommandStore::SCHEDULE_MAX`](crate::CommandStore::SCHEDULE_MAX))
/// instead of a panic.
pub fn due_after(delay: Duration) -> SystemTime {
    // Any delay beyond twice the longest schedule is refused the same way, so it is capped there.
    let cap = crate::CommandStore::SCHEDULE_MAX * 2;
    SystemTime::now() + delay.min(cap)
}

impl Command {
    /// A command with a generated UUIDv7 id. `params`: a [`RawJson`] (exact text) or a
    /// [`serde_json::Value`] (e.g. `json!({…})`).
    pub fn new(command_type: impl Into<String>, params: impl Into<RawJson>) -> Self {
        Self::with_id(uuid::Uuid::now_v7().to_string(), command_type, params)
    }

    /// A command with a client-supplied id.
    pub fn with_id(id: impl Into<String>, command_type: impl Into<String>, params: impl Into<RawJson>) -> Self {
        Self {
            id: id.into(),
            command_type: command_type.into(),
            params: params.into(),
            cancel: CancellationToken::new(),
            details: None,
            reports: None,
            output_spec: None,
            output: None,
            run_at: None,
            run_at_from_delay: false,
            concurrency_key: None,
            priority: 0,
            trace: None,
        }
    }

    /// The W3C trace context the command is submitted under (e.g. the submit request's
    /// `traceparent`): stored with its state ([`CommandState::trace`]) so that its handler
    /// calls, in any process, are traced as children of it ([`crate::trace`]), and handed to
    /// its handlers ([`Command::trace_context`]). Not part of the idempotent body.
    pub fn with_trace_context(mut self, trace: crate::trace::TraceContext) -> Self {
        self.trace = Some(Box::new(trace));
        self
    }

    /// The command's trace context ([`Command::with_trace_context`]; on a handler's delivery,
    /// the stored one), if any.
    pub fn trace_context(&self) -> Option<&crate::trace::TraceContext> {
        self.trace.as_deref()
    }

    /// The command's concurrency key: on a queue whose workers run with `concurrency_per_key`
    /// (`baton_queue::ConsumerOptions::concurrency_per_key`), at most that many commands of one
    /// key run at once, the others starting in submit order as they end. Stored in the state
    /// ([`CommandState::concurrency_key`]). 1 to 256 bytes without control characters
    /// ([`CommandError::InvalidConcurrencyKey`] otherwise). Not part of the idempotent body: a
    /// resubmit of the same id returns the stored command, whatever key it asks. A re-run or a
    /// hand-off enqueues the command without its key.
    pub fn with_concurrency_key(mut self, key: impl Into<String>) -> Self {
        self.concurrency_key = Some(key.into());
        self
    }

    /// [`Command::with_concurrency_key`].
    pub fn concurrency_key(&self) -> Option<&str> {
        self.concurrency_key.as_deref()
    }

    /// The command's priority, -10 to 10 (`baton_queue::MIN_PRIORITY`..=`MAX_PRIORITY`),
    /// default 0: its message is taken before every waiting message of a lower priority on its
    /// queue, in submit order among equal ones (`baton_queue::OfferOptions::priority`; strict: a
    /// flood of higher-priority commands holds lower ones back until it drains). Stored in the
    /// state ([`CommandState::priority`]); kept while the command is scheduled and while it
    /// waits for its concurrency key. Out of range: [`CommandError::InvalidPriority`] at submit.
    /// Not part of the idempotent body (as the concurrency key). A re-run or a hand-off enqueues
    /// the command with priority 0.
    pub fn with_priority(mut self, priority: i8) -> Self {
        self.priority = priority;
        self
    }

    /// [`Command::with_priority`].
    pub fn priority(&self) -> i8 {
        self.priority
    }

    /// Schedules the command: it is stored at submit (`SUBMITTED`, its state's `run_at` set to
    /// `at`, truncated to ms) but its handler is not called before `at` (the submitting
    /// process's clock). Until then its message waits in the queue's delayed set (never in the
    /// stream, never pending, so never redelivered however long it waits); a running consumer
    /// of the queue enqueues it within a few milliseconds of `at`. A time not in the future
    /// runs at once. Part of the idempotent body: a resubmit asking another due time is a
    /// [`CommandError::Conflict`] (`what` = `"run_at"`), and so is a resubmit without one of a
    /// scheduled command or the reverse. The store refuses a due time further ahead than
    /// [`CommandStore::SCHEDULE_MAX`](crate::CommandStore::SCHEDULE_MAX). See also
    /// [`CommandStore::reschedule`](crate::CommandStore::reschedule).
    pub fn with_run_at(mut self, at: SystemTime) -> Self {
        self.run_at = Some(Timestamp::from_millis(Timestamp(at).millis()));
        self
    }

    /// [`Command::with_run_at`] `delay` from now. A resubmit with a delay matches a scheduled
    /// command whatever its due time (a delay names no time of its own). A delay past what the
    /// clock can represent is not a panic: the submit refuses it as any due time further than
    /// [`CommandStore::SCHEDULE_MAX`](crate::CommandStore::SCHEDULE_MAX) ahead.
    pub fn with_delay(self, delay: Duration) -> Self {
        self.with_run_at(due_after(delay)).delay_asked()
    }

    fn delay_asked(mut self) -> Self {
        self.run_at_from_delay = true;
        self
    }

    /// When the command is due, if it is scheduled ([`Command::with_run_at`]).
    pub fn run_at(&self) -> Option<SystemTime> {
        self.run_at.map(|t| t.0)
    }

    /// Asks the submit for an output stream owned by the command (crate docs, "Output
    /// streams"): created at submit, written by the handler ([`Command::output`]), ended with the
    /// command. Needs a store with output streams ([`crate::CommandStore::set_outputs`]). Part of
    /// what makes a resubmit of the same id idempotent: a resubmit asking for another output (or
    /// none, where the first asked for one, or the reverse) is a [`crate::CommandError::Conflict`]
    /// (`what` = `"output"`), as other params are.
    pub fn with_output(mut self, spec: crate::OutputSpec) -> Self {
        self.output_spec = Some(spec);
        self
    }

    /// What this command asks of an output stream at submit ([`Command::with_output`]), if anything.
    pub fn output_spec(&self) -> Option<&crate::OutputSpec> {
        self.output_spec.as_ref()
    }

    /// The command's output stream, on a handler's delivery of a command submitted with one
    /// ([`Command::with_output`]); `None` otherwise.
    pub fn output(&self) -> Option<&crate::Output> {
        self.output.as_ref()
    }

    /// A command whose params are `params` serialized to JSON (generated id).
    ///
    /// Errors: [`CommandError::InvalidParams`] when `params` does not serialize.
    pub fn typed<P: Serialize>(command_type: impl Into<String>, params: &P) -> Result<Self, CommandError> {
        let v = RawJson::to_json(params).map_err(|e| CommandError::InvalidParams(e.to_string()))?;
        Ok(Self::new(command_type, v))
    }

    /// The params decoded as `P` (from their text, see [`RawJson::parse`]). Errors:
    /// [`CommandError::InvalidParams`] naming the decode error.
    pub fn params_as<P: DeserializeOwned>(&self) -> Result<P, CommandError> {
        self.params.parse().map_err(|e| CommandError::InvalidParams(e.to_string()))
    }

    /// True once the command was cancelled while its handler runs.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Resolves when the command is cancelled (cooperative: the handler decides to stop).
    pub async fn cancelled(&self) {
        self.cancel.cancelled().await
    }

    /// The last checkpoint a handler of this command reported ([`Command::checkpoint`], or a
    /// remote worker's renewal), handed to every later delivery (after a crash, a takeover or a
    /// `RUNNING` re-poll) so the work resumes where it was instead of starting over. `None` when
    /// none was reported, and on a command that is not a handler's delivery.
    pub fn details(&self) -> Option<&RawJson> {
        self.details.as_ref()
    }

    /// Reports the handler's progress (a fraction done, 0 to 1, and/or a short message, at most
    /// [`Progress::MAX_MESSAGE`] bytes). Not written at once: the latest report of each command
    /// is written into its state about once a second
    /// ([`REPORT_INTERVAL`](crate::REPORT_INTERVAL)), in the queue's batched state writes, while
    /// the handler holds the command's lease; the last one also goes with the handler's outcome.
    /// A no-op on a command that is not a handler's delivery. Errors:
    /// [`CommandError::InvalidParams`] saying what to fix (nothing is kept).
    pub fn progress(&self, fraction: Option<f64>, message: Option<&str>) -> Result<(), CommandError> {
        let p = Progress { fraction, message: message.map(str::to_string) };
        self.report(Some(p), None)
    }

    /// Reports a checkpoint of the handler's own (any JSON value, at most
    /// [`RemoteReport::MAX_DETAILS`](crate::RemoteReport::MAX_DETAILS) bytes), written as
    /// [`Command::progress`] is and handed to later deliveries as [`Command::details`]. Errors:
    /// [`CommandError::InvalidParams`] (a value that does not serialize, or too large).
    pub fn checkpoint<T: Serialize + ?Sized>(&self, details: &T) -> Result<(), CommandError> {
        let v = RawJson::to_json(details).map_err(|e| CommandError::InvalidParams(e.to_string()))?;
        self.report(None, Some(v))
    }

    /// [`Command::progress`] and [`Command::checkpoint`] together (each `None` keeps what was
    /// reported before). Errors: [`CommandError::InvalidParams`].
    pub fn report(&self, progress: Option<Progress>, details: Option<RawJson>) -> Result<(), CommandError> {
        let report = crate::RemoteReport { progress, details };
        report.validate().map_err(CommandError::InvalidParams)?;
        if let Some(r) = &self.reports {
            r.put(report);
        }
        Ok(())
    }

    /// The cancellation token itself, to hand to code that takes one.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.cancel.clone()
    }
}

/// The persisted status of a command: `SUBMITTED` until a handler says its work continues or
/// hands it off (`RUNNING`), and, once it ends, one terminal status (`SUCCEEDED`, `FAILED`,
/// `CANCELLED`) that never changes: the first terminal write wins (crate docs, "Rules").
/// Serialized in upper case (`SUBMITTED`, …);
/// `PENDING` (= `Submitted`) and `PROCESSING` (= `Running`) are accepted as aliases when reading.
/// The hand-off marker is a [`CommandResult`] only and never a status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CommandStatus {
    /// Stored and enqueued; `execute` has not returned yet.
    Submitted,
    /// `execute` returned and the work continues; progress is polled through `check_status`.
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl CommandStatus {
    /// Every status, in lifecycle order.
    pub const ALL: [CommandStatus; 5] = [
        CommandStatus::Submitted,
        CommandStatus::Running,
        CommandStatus::Succeeded,
        CommandStatus::Failed,
        CommandStatus::Cancelled,
    ];

    /// `SUCCEEDED`, `FAILED` and `CANCELLED` are terminal: no transition leaves them.
    pub fn is_terminal(self) -> bool {
        matches!(self, CommandStatus::Succeeded | CommandStatus::Failed | CommandStatus::Cancelled)
    }

    /// The serialized name, e.g. `"RUNNING"`.
    pub fn as_str(self) -> &'static str {
        match self {
            CommandStatus::Submitted => "SUBMITTED",
            CommandStatus::Running => "RUNNING",
            CommandStatus::Succeeded => "SUCCEEDED",
            CommandStatus::Failed => "FAILED",
            CommandStatus::Cancelled => "CANCELLED",
        }
    }

    /// Position in [`CommandStatus::ALL`].
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for CommandStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CommandStatus {
    type Err = CommandError;
    /// Case-insensitive; accepts the aliases `PENDING` and `PROCESSING`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.to_ascii_uppercase().as_str() {
            "SUBMITTED" | "PENDING" => CommandStatus::Submitted,
            "RUNNING" | "PROCESSING" => CommandStatus::Running,
            "SUCCEEDED" => CommandStatus::Succeeded,
            "FAILED" => CommandStatus::Failed,
            "CANCELLED" => CommandStatus::Cancelled,
            _ => return Err(CommandError::InvalidStatus(s.to_string())),
        })
    }
}

impl Serialize for CommandStatus {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for CommandStatus {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// What a handler call ended with: a terminal outcome, `running` (check its status again later)
/// or a hand-off to another queue; dispatch persists it. A handler *error* (`Err`, or a panic) is
/// not a result: it is recorded and retried with backoff (see [`crate::RetryPolicy`]).
#[derive(Clone, Debug, PartialEq)]
pub enum CommandResult {
    /// Done; the JSON result is persisted exactly as given ([`RawJson`]). Terminal.
    Succeeded(RawJson),
    /// A real failure; the message is persisted as `error`. Terminal.
    Failed(String),
    /// The handler gave up because the command was cancelled. Terminal.
    Cancelled,
    /// The work continues: the command is (or stays) `RUNNING` and `check_status` is called after
    /// `next_check`, or the queue's `check_status_interval` when `None`.
    Running { next_check: Option<Duration> },
    /// The command continues on `queue` (marker `HANDED_OFF`, never persisted): it becomes
    /// `RUNNING`, a message for it is enqueued on `queue`, whose consumer calls `check_status`.
    HandedOff { queue: String },
    /// The handler was rate limited downstream (say, an HTTP 429): the call is not made now and
    /// not counted — no attempt, no error, the state unchanged (its in-flight `execution`
    /// cleared) — every worker of the queue stops starting commands for `retry_after` (the work
    /// queue's back-off, [`baton_queue::Decision::RateLimited`]), and the same call (`execute`,
    /// or `check_status` for a `RUNNING` command) is made again after it.
    RateLimited { retry_after: Duration },
}

impl CommandResult {
    /// [`CommandResult::Succeeded`]; `result` a [`RawJson`] (exact text) or a
    /// [`serde_json::Value`].
    pub fn succeeded(result: impl Into<RawJson>) -> Self {
        CommandResult::Succeeded(result.into())
    }
    /// [`CommandResult::Succeeded`] with `result` serialized to JSON; a result that does not
    /// serialize becomes [`CommandResult::Failed`] naming the error.
    pub fn succeeded_as<T: Serialize>(result: &T) -> Self {
        match RawJson::to_json(result) {
            Ok(v) => CommandResult::Succeeded(v),
            Err(e) => CommandResult::Failed(format!("result not serializable: {e}")),
        }
    }
    /// [`CommandResult::Failed`].
    pub fn failed(error: impl Into<String>) -> Self {
        CommandResult::Failed(error.into())
    }
    /// [`CommandResult::Cancelled`].
    pub fn cancelled() -> Self {
        CommandResult::Cancelled
    }
    /// [`CommandResult::Running`] with the queue's `check_status_interval`.
    pub fn running() -> Self {
        CommandResult::Running { next_check: None }
    }
    /// [`CommandResult::Running`], next `check_status` after `delay`.
    pub fn running_after(delay: Duration) -> Self {
        CommandResult::Running { next_check: Some(delay) }
    }
    /// [`CommandResult::RateLimited`]: back off `retry_after`, then call again.
    pub fn rate_limited(retry_after: Duration) -> Self {
        CommandResult::RateLimited { retry_after }
    }
    /// [`CommandResult::HandedOff`] to `queue`.
    pub fn handed_off(queue: impl Into<String>) -> Self {
        CommandResult::HandedOff { queue: queue.into() }
    }
    /// The result's marker: a terminal status name, `RUNNING`, `HANDED_OFF` or `RATE_LIMITED`.
    pub fn marker(&self) -> &'static str {
        match self {
            CommandResult::Succeeded(_) => "SUCCEEDED",
            CommandResult::Failed(_) => "FAILED",
            CommandResult::Cancelled => "CANCELLED",
            CommandResult::Running { .. } => "RUNNING",
            CommandResult::HandedOff { .. } => "HANDED_OFF",
            CommandResult::RateLimited { .. } => "RATE_LIMITED",
        }
    }
    /// True for `Succeeded`, `Failed` and `Cancelled`.
    pub fn is_terminal(&self) -> bool {
        matches!(self, CommandResult::Succeeded(_) | CommandResult::Failed(_) | CommandResult::Cancelled)
    }
}

/// A point in time, serialized as RFC 3339 UTC with milliseconds (`2025-01-31T12:00:00.123Z`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub SystemTime);

impl Timestamp {
    /// Now, truncated to milliseconds.
    pub fn now() -> Self {
        Timestamp::from_millis(Timestamp(SystemTime::now()).millis())
    }
    /// From milliseconds since the Unix epoch.
    pub fn from_millis(ms: u64) -> Self {
        Timestamp(SystemTime::UNIX_EPOCH + Duration::from_millis(ms))
    }
    /// Milliseconds since the Unix epoch.
    pub fn millis(self) -> u64 {
        self.0.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_rfc3339_millis(self.0))
    }
}

impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_rfc3339_weak(&s).map(Timestamp).map_err(serde::de::Error::custom)
    }
}

/// The persisted state of one command: one JSON document, only ever written by a compare-and-set
/// on its `version` (key layout: the crate docs), e.g.
///
/// ```json
/// {"id":"…","queue":"lifecycle","type":"launch","params":{…},"status":"RUNNING","result":null,
///  "error":null,"attempts":1,"errors_count":0,"created_at":"2025-01-31T12:00:00.123Z",
///  "started_at":"…","modified_at":"…","completed_at":null,"version":2,"handed_off_to":"monitor"}
/// ```
///
/// Every write is a compare-and-set on `version` (+1 per write), so of two racing terminal
/// writes (a cancel and a completion) exactly the first is kept.
///
/// Serialized (`Serialize`, the HTTP API's state), its fields come in alphabetical order and
/// without the store's internal `_…` fields; `params` and `result` are written as their exact
/// text ([`RawJson`]).
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct CommandState {
    pub id: String,
    /// The queue the command was submitted to. It stays its home after a hand-off: the state's
    /// storage, the status index and the counts are those of this queue.
    pub queue: String,
    #[serde(rename = "type")]
    pub command_type: String,
    /// The params exactly as submitted.
    pub params: RawJson,
    pub status: CommandStatus,
    /// The handler's result once `SUCCEEDED`, exactly as the handler gave it.
    pub result: Option<RawJson>,
    /// The failure (`FAILED`), or the last handler error while retrying.
    pub error: Option<String>,
    /// `execute` calls that returned or errored (a call lost with its process is not counted).
    pub attempts: u32,
    /// Consecutive handler errors (`Err` or panic, from `execute` or `check_status`); cleared by
    /// the next call that returns a result. Reaching `max_attempts` ends the command `FAILED`.
    pub errors_count: u32,
    pub created_at: Timestamp,
    /// When a handler first started on the command: the start of the first `execute` call whose
    /// outcome was written (a result, `RUNNING`, a hand-off, or an error to retry). `null` until
    /// then, and for a command that ended without running (cancelled first, no handler for its
    /// type).
    pub started_at: Option<Timestamp>,
    pub modified_at: Timestamp,
    /// When a terminal status was written.
    pub completed_at: Option<Timestamp>,
    /// 1 on submit, +1 per write.
    pub version: u64,
    /// The queue the command was last handed off to (where `check_status` runs now), if any.
    #[serde(default)]
    pub handed_off_to: Option<String>,
    /// Token of the one message that drives the command now (internal fencing, see `service`).
    #[serde(rename = "_token", default)]
    pub(crate) token: String,
    /// Token of the message a hand-off came from (lets a replayed source message finish it).
    #[serde(rename = "_prev_token", default)]
    pub(crate) prev_token: Option<String>,
    /// Redis: expiry (ms) of the id → queue lookup key, so it always outlives the state.
    #[serde(rename = "_lookup_exp", default)]
    pub(crate) lookup_expires_ms: u64,
    /// What the handler last reported of its work in progress (a remote worker's renewal), kept
    /// through later writes; `None` until it reports (and then absent from the public form).
    #[serde(default)]
    pub progress: Option<Progress>,
    /// The handler's last checkpoint (a remote worker's renewal): any JSON of its own, handed to
    /// the next delivery of the command (after a crash, a takeover or a `RUNNING` re-poll) so the
    /// work resumes instead of starting over. `None` until reported (absent from the public form).
    #[serde(default)]
    pub details: Option<RawJson>,
    /// The handler call working on the command now, if one has run for a second or more
    /// ([`Execution`]); `None` otherwise (absent from the public form).
    #[serde(default)]
    pub execution: Option<Execution>,
    /// The command's output stream, if it was submitted with one ([`Command::with_output`]);
    /// absent from the public form otherwise.
    #[serde(default)]
    pub output: Option<crate::OutputLink>,
    /// When a scheduled command is (or was) due ([`Command::with_run_at`],
    /// [`CommandStore::reschedule`](crate::CommandStore::reschedule)); absent from the public
    /// form for a command submitted to run at once. It stays after the command ran.
    #[serde(default)]
    pub run_at: Option<Timestamp>,
    /// The concurrency key it was submitted with ([`Command::with_concurrency_key`]); absent
    /// from the public form without one.
    #[serde(default)]
    pub concurrency_key: Option<String>,
    /// The priority it was submitted with ([`Command::with_priority`]); absent from the public
    /// form when 0.
    #[serde(default)]
    pub priority: i8,
    /// The W3C trace context it was submitted under ([`Command::with_trace_context`]; with span
    /// export on, the `baton.submit` span's); stored as `trace`, absent without one, and not in
    /// the public form.
    /// (Boxed: a state without one, the common case, stays one pointer larger.)
    #[serde(default)]
    pub trace: Option<Box<crate::trace::TraceContext>>,
    /// Redis: SHA-1 (hex) of the canonical submitted body, kept in the stored header (not in
    /// the JSON) for idempotent resubmits; carried here so a write can rebuild the header.
    #[serde(skip)]
    pub(crate) body_sha: BodySha,
    /// Set on a state written as a handler call's outcome: when the call (or the work) started,
    /// for the per-minute duration histogram ([`crate::minutes`]); not stored.
    #[serde(skip)]
    pub(crate) attempt_start: crate::minutes::AttemptStart,
}

/// What a handler reports of its work in progress: a fraction done and/or a short message
/// (at least one of them).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Done so far, 0.0 to 1.0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fraction: Option<f64>,
    /// A short status line, at most [`Progress::MAX_MESSAGE`] bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl Progress {
    /// Longest `message`, bytes.
    pub const MAX_MESSAGE: usize = 1024;

    /// Checks the ranges. Errors: a text that says what to fix.
    pub fn validate(&self) -> Result<(), String> {
        if self.fraction.is_none() && self.message.is_none() {
            return Err("progress needs \"fraction\" (0 to 1) and/or \"message\" (a string)".into());
        }
        if let Some(f) = self.fraction {
            if !(0.0..=1.0).contains(&f) {
                return Err(format!("progress fraction {f} is outside 0 to 1"));
            }
        }
        if let Some(m) = &self.message {
            if m.len() > Self::MAX_MESSAGE {
                return Err(format!("progress message is {} bytes; at most {} are kept", m.len(), Self::MAX_MESSAGE));
            }
        }
        Ok(())
    }
}

/// Which handler call is running.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionCall {
    /// `execute` of a `SUBMITTED` command.
    Execute,
    /// `check_status` of a `RUNNING` one.
    CheckStatus,
}

/// A handler call working on a command now (the state's `execution`): written about a second
/// after the call starts ([`REPORT_INTERVAL`](crate::REPORT_INTERVAL); shorter calls never
/// show one), kept while the call runs, removed by the call's outcome (and by any other write
/// that ends or moves the command: cancel, hand-off). A call whose process died leaves it until
/// the next delivery's call replaces it; `deadline` says until when it can be believed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Execution {
    /// The queue consumer that holds the delivery's lease: an in-process consumer's name, or
    /// `remote-<worker>` for a remote worker.
    pub worker: String,
    pub call: ExecutionCall,
    /// When the call started.
    pub since: Timestamp,
    /// Deliveries of the command's message, this one included.
    pub deliveries: u32,
    /// `since` + the queue's `max_processing_time`: the latest the call can hold its lease.
    pub deadline: Timestamp,
}

/// Storage bookkeeping that is not part of a state's value: any two compare equal (a state read
/// back from Redis equals the one that was written, whether or not the reader saw the header).
#[derive(Clone, Debug, Default)]
pub(crate) struct BodySha(pub String);

impl PartialEq for BodySha {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

pub(crate) fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn is_zero_i8(v: &i8) -> bool {
    *v == 0
}

/// The public form of a state (the HTTP API's): fields in alphabetical order, no `_…` fields.
#[derive(Serialize)]
struct PublicState<'a> {
    attempts: u32,
    completed_at: &'a Option<Timestamp>,
    #[serde(skip_serializing_if = "Option::is_none")]
    concurrency_key: &'a Option<String>,
    created_at: &'a Timestamp,
    #[serde(skip_serializing_if = "Option::is_none")]
    details: &'a Option<RawJson>,
    error: &'a Option<String>,
    errors_count: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    execution: &'a Option<Execution>,
    handed_off_to: &'a Option<String>,
    id: &'a str,
    modified_at: &'a Timestamp,
    #[serde(skip_serializing_if = "Option::is_none")]
    output: Option<crate::output::PublicOutput<'a>>,
    params: &'a RawJson,
    #[serde(skip_serializing_if = "is_zero_i8")]
    priority: i8,
    #[serde(skip_serializing_if = "Option::is_none")]
    progress: &'a Option<Progress>,
    queue: &'a str,
    result: &'a Option<RawJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    run_at: &'a Option<Timestamp>,
    started_at: &'a Option<Timestamp>,
    status: CommandStatus,
    #[serde(rename = "type")]
    command_type: &'a str,
    version: u64,
}

impl Serialize for CommandState {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        PublicState {
            attempts: self.attempts,
            completed_at: &self.completed_at,
            concurrency_key: &self.concurrency_key,
            created_at: &self.created_at,
            details: &self.details,
            error: &self.error,
            errors_count: self.errors_count,
            execution: &self.execution,
            handed_off_to: &self.handed_off_to,
            id: &self.id,
            modified_at: &self.modified_at,
            output: self.output.as_ref().map(|link| crate::output::PublicOutput { link, url: link.url() }),
            params: &self.params,
            priority: self.priority,
            progress: &self.progress,
            queue: &self.queue,
            result: &self.result,
            run_at: &self.run_at,
            started_at: &self.started_at,
            status: self.status,
            command_type: &self.command_type,
            version: self.version,
        }
        .serialize(s)
    }
}

/// The stored form of a state (the store's JSON document, read back by `CommandState`'s
/// `Deserialize`): the public fields and the internal `_…` ones.
#[derive(Serialize)]
pub(crate) struct StoredState<'a> {
    id: &'a str,
    queue: &'a str,
    #[serde(rename = "type")]
    command_type: &'a str,
    params: &'a RawJson,
    status: CommandStatus,
    result: &'a Option<RawJson>,
    error: &'a Option<String>,
    attempts: u32,
    errors_count: u32,
    created_at: &'a Timestamp,
    started_at: &'a Option<Timestamp>,
    modified_at: &'a Timestamp,
    completed_at: &'a Option<Timestamp>,
    version: u64,
    handed_off_to: &'a Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    progress: &'a Option<Progress>,
    #[serde(skip_serializing_if = "Option::is_none")]
    details: &'a Option<RawJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    execution: &'a Option<Execution>,
    #[serde(skip_serializing_if = "Option::is_none")]
    output: &'a Option<crate::OutputLink>,
    #[serde(skip_serializing_if = "Option::is_none")]
    run_at: &'a Option<Timestamp>,
    #[serde(skip_serializing_if = "Option::is_none")]
    concurrency_key: &'a Option<String>,
    #[serde(skip_serializing_if = "is_zero_i8")]
    priority: i8,
    #[serde(skip_serializing_if = "Option::is_none")]
    trace: &'a Option<Box<crate::trace::TraceContext>>,
    #[serde(rename = "_token")]
    token: &'a str,
    #[serde(rename = "_prev_token", skip_serializing_if = "Option::is_none")]
    prev_token: Option<&'a str>,
    #[serde(rename = "_lookup_exp", skip_serializing_if = "is_zero")]
    lookup_expires_ms: u64,
}

impl<'a> From<&'a CommandState> for StoredState<'a> {
    fn from(st: &'a CommandState) -> Self {
        StoredState {
            id: &st.id,
            queue: &st.queue,
            command_type: &st.command_type,
            params: &st.params,
            status: st.status,
            result: &st.result,
            error: &st.error,
            attempts: st.attempts,
            errors_count: st.errors_count,
            created_at: &st.created_at,
            started_at: &st.started_at,
            modified_at: &st.modified_at,
            completed_at: &st.completed_at,
            version: st.version,
            handed_off_to: &st.handed_off_to,
            progress: &st.progress,
            details: &st.details,
            execution: &st.execution,
            output: &st.output,
            run_at: &st.run_at,
            concurrency_key: &st.concurrency_key,
            priority: st.priority,
            trace: &st.trace,
            token: &st.token,
            prev_token: st.prev_token.as_deref(),
            lookup_expires_ms: st.lookup_expires_ms,
        }
    }
}

impl CommandState {
    /// The stored JSON document of this state (internal fields included).
    pub(crate) fn stored_json(&self) -> Vec<u8> {
        serde_json::to_vec(&StoredState::from(self)).expect("serializable")
    }
}

impl CommandState {
    /// The result decoded as `R`. Errors: [`CommandError::InvalidParams`] when there is no result
    /// or it does not decode.
    pub fn result_as<R: DeserializeOwned>(&self) -> Result<R, CommandError> {
        let v = self.result.as_ref().ok_or_else(|| CommandError::InvalidParams("no result".into()))?;
        v.parse().map_err(|e| CommandError::InvalidParams(e.to_string()))
    }

    /// How long from now until a `SUBMITTED` scheduled command is due (zero when it is not
    /// scheduled, not `SUBMITTED`, or due already).
    pub(crate) fn scheduled_delay(&self) -> Duration {
        match (self.status, self.run_at) {
            (CommandStatus::Submitted, Some(at)) => at.0.duration_since(SystemTime::now()).unwrap_or_default(),
            _ => Duration::ZERO,
        }
    }

    /// True while the command waits for its due time: `SUBMITTED`, with a `run_at` in the future
    /// (by this process's clock), so no handler has been called yet.
    pub fn is_scheduled(&self) -> bool {
        !self.scheduled_delay().is_zero()
    }

    /// The queue whose consumer drives the command now: the hand-off target, else `queue`.
    pub fn current_queue(&self) -> &str {
        self.handed_off_to.as_deref().unwrap_or(&self.queue)
    }

    /// The command this state was created from (with its last checkpoint, [`Command::details`]).
    pub fn command(&self) -> Command {
        let mut c = Command::with_id(self.id.clone(), self.command_type.clone(), self.params.clone());
        c.details = self.details.clone();
        c.trace = self.trace.clone();
        c
    }
}

/// Exact counts of a queue's commands by status (expired states excluded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusCounts {
    pub submitted: u64,
    pub running: u64,
    pub succeeded: u64,
    pub failed: u64,
    pub cancelled: u64,
}

impl StatusCounts {
    pub(crate) fn from_slice(v: &[u64]) -> Self {
        StatusCounts { submitted: v[0], running: v[1], succeeded: v[2], failed: v[3], cancelled: v[4] }
    }
    /// The count of one status.
    pub fn get(&self, s: CommandStatus) -> u64 {
        [self.submitted, self.running, self.succeeded, self.failed, self.cancelled][s.index()]
    }
    /// Sum over all statuses.
    pub fn total(&self) -> u64 {
        self.submitted + self.running + self.succeeded + self.failed + self.cancelled
    }
}

/// A queue's scheduled commands ([`CommandStore::scheduled`](crate::CommandStore::scheduled)).
/// JSON: `{"scheduled": 3, "next_due": "2025-01-31T12:00:00.000Z"}` (`next_due` null when none
/// waits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduledCounts {
    /// Scheduled commands waiting for their due time (their message not enqueued yet).
    pub scheduled: u64,
    /// The earliest due time among them.
    pub next_due: Option<Timestamp>,
}

/// A listing request: newest first (by `created_at`, then id descending), every filter given
/// applied (all of them). With `command_type` or `id_prefix`, one page looks at most at
/// [`ListQuery::SCAN_MAX`] commands: a page can then hold fewer than `limit` items (even none)
/// and still have a `next_cursor` to read on from.
#[derive(Clone, Debug, Default)]
pub struct ListQuery {
    /// Only this status; `None`: every status.
    pub status: Option<CommandStatus>,
    /// Page size, 1 to 1000 (0 means 100).
    pub limit: usize,
    /// `next_cursor` of the previous page; `None` for the first.
    pub cursor: Option<String>,
    /// Only commands of this type.
    pub command_type: Option<String>,
    /// Only ids that start with this.
    pub id_prefix: Option<String>,
    /// Only commands created at this time or later.
    pub created_after: Option<Timestamp>,
    /// Only commands created before this time.
    pub created_before: Option<Timestamp>,
    /// `Some(true)`: only scheduled commands still waiting for their due time
    /// ([`CommandState::is_scheduled`]; a filter like `command_type`, see the type docs);
    /// `Some(false)`: only the others.
    pub scheduled: Option<bool>,
}

impl ListQuery {
    /// Most commands one filtered page looks at (see the type docs).
    pub const SCAN_MAX: usize = 5_000;
}

/// A worker of a command queue: one consumer of its group (an in-process service: one per
/// process and queue, named `<consumer prefix>-<uuid v7>`; an HTTP worker: `remote-<its name>`), live or
/// dead, and the commands it holds ([`CommandStore::workers`](crate::CommandStore::workers)).
/// JSON: `{"name", "alive", "last_heartbeat", "claim_timeout_ms", "leases", "commands"}`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Worker {
    pub name: String,
    /// Its last heartbeat is younger than its claim timeout. A dead worker's commands are taken
    /// over by live ones once they have been silent for the claim timeout.
    pub alive: bool,
    /// Its last heartbeat (Redis's clock), when it has a liveness record.
    pub last_heartbeat: Option<Timestamp>,
    /// The claim timeout it heartbeats with, ms.
    pub claim_timeout_ms: Option<u64>,
    /// Deliveries it holds (owned, not settled).
    pub leases: u64,
    /// The commands of its oldest leases (at most [`Worker::COMMANDS_MAX`]), oldest first.
    pub commands: Vec<String>,
}

impl Worker {
    /// Most command ids listed per worker.
    pub const COMMANDS_MAX: usize = 100;
}

/// What [`CommandStore::bulk`](crate::CommandStore::bulk) does to each command it selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BulkAction {
    /// Cancel every selected command not ended yet ([`CommandStore::cancel`](crate::CommandStore::cancel)).
    Cancel,
    /// Re-run every selected FAILED or CANCELLED command ([`CommandStore::retry`](crate::CommandStore::retry)).
    Retry,
}

impl BulkAction {
    /// Whether a command in `status` is one this action applies to.
    pub fn applies_to(self, status: CommandStatus) -> bool {
        match self {
            BulkAction::Cancel => !status.is_terminal(),
            BulkAction::Retry => matches!(status, CommandStatus::Failed | CommandStatus::Cancelled),
        }
    }
}

/// What a [`CommandStore::bulk`](crate::CommandStore::bulk) call did. JSON:
/// `{"looked_at", "eligible", "applied", "refused", "next_cursor"}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct BulkReport {
    /// Commands the filter selected and this call looked at.
    pub looked_at: u64,
    /// Of those, the ones the action applies to (their status when listed).
    pub eligible: u64,
    /// Acted on (0 for a dry run).
    pub applied: u64,
    /// Eligible when listed, refused when acted on: their status changed meanwhile (a command
    /// that ended before its cancel, one re-run by someone else), or they expired.
    pub refused: u64,
    /// Where this call stopped at its `max` (pass it as the query's cursor to go on); `None`
    /// when every selected command was looked at.
    pub next_cursor: Option<String>,
}

/// One page of a listing.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CommandPage {
    pub items: Vec<CommandState>,
    /// Pass it in [`ListQuery::cursor`] for the next page; `None` when this page is the last.
    pub next_cursor: Option<String>,
}

/// A listing position: (created ms, id), exclusive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Cursor {
    pub created_ms: u64,
    pub id: String,
}

impl Cursor {
    pub fn encode(&self) -> String {
        format!("{}:{}", self.created_ms, self.id)
    }
    pub fn decode(s: &str) -> Result<Self, CommandError> {
        let bad = || CommandError::InvalidCursor(s.to_string());
        let (ms, id) = s.split_once(':').ok_or_else(bad)?;
        if id.is_empty() {
            return Err(bad());
        }
        Ok(Cursor { created_ms: ms.parse().map_err(|_| bad())?, id: id.to_string() })
    }
}

/// The message a command queue carries: which command (and where its state lives), and the
/// fencing token of this message.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct CommandMsg {
    pub id: String,
    pub home: String,
    pub token: String,
}

impl CommandMsg {
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("serializable")
    }
}

/// The name of a scheduled command's message in its queue's delayed set
/// ([`baton_queue::MessageStream::offer_at`]): `c:<id>`.
pub(crate) fn schedule_name(id: &str) -> String {
    format!("c:{id}")
}

/// A fresh message token: unique per process (a random 64-bit prefix drawn once, from a UUIDv4-
/// grade source) and per call (a counter), without a system call per token.
pub(crate) fn new_token() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static PREFIX: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let prefix = *PREFIX.get_or_init(|| {
        let u = uuid::Uuid::now_v7();
        let b = u.as_bytes();
        // The random tail of a UUIDv7 (bytes 8..16, 62 random bits).
        u64::from_be_bytes(b[8..16].try_into().expect("8 bytes"))
    });
    format!("{prefix:016x}{:016x}", NEXT.fetch_add(1, Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_and_aliases() {
        assert_eq!(serde_json::to_string(&CommandStatus::Running).unwrap(), "\"RUNNING\"");
        let s: CommandStatus = serde_json::from_str("\"PENDING\"").unwrap();
        assert_eq!(s, CommandStatus::Submitted);
        let s: CommandStatus = serde_json::from_str("\"PROCESSING\"").unwrap();
        assert_eq!(s, CommandStatus::Running);
        assert!(serde_json::from_str::<CommandStatus>("\"HANDED_OFF\"").is_err());
        assert_eq!(CommandResult::handed_off("m").marker(), "HANDED_OFF");
        assert!(!CommandResult::handed_off("m").is_terminal());
    }

    #[test]
    fn timestamps_round_trip_rfc3339() {
        let t = Timestamp::from_millis(1_700_000_000_123);
        let s = serde_json::to_string(&t).unwrap();
        assert_eq!(s, "\"2023-11-14T22:13:20.123Z\"");
        assert_eq!(serde_json::from_str::<Timestamp>(&s).unwrap(), t);
    }

    #[test]
    fn tokens_are_unique_and_fixed_width() {
        let a: Vec<String> = (0..1000).map(|_| new_token()).collect();
        let set: std::collections::HashSet<&String> = a.iter().collect();
        assert_eq!(set.len(), a.len());
        assert!(a.iter().all(|t| t.len() == 32 && t.chars().all(|c| c.is_ascii_hexdigit())));
    }

    #[test]
    fn cursor_round_trip() {
        let c = Cursor { created_ms: 12, id: "a:b".into() };
        assert_eq!(Cursor::decode(&c.encode()).unwrap(), c);
        assert!(Cursor::decode("x").is_err());
    }
}
