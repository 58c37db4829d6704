//! # baton-commands — the command service
//!
//! Every command has one persisted state; `execute` runs once per live attempt; `check_status`
//! polls long work; a command can be handed off to another queue.
//!
//! * [`CommandStore`] — the state store shared by every queue of a process, on Redis (standalone
//!   or Cluster) or in memory ([`CommandStore::memory`], same semantics). It submits, reads,
//!   cancels, waits for, lists and counts commands.
//! * [`CommandService`] — one per queue, each with its own [`QueueSettings`] (claim timeout,
//!   concurrency, `check_status_interval`, [`RetryPolicy`]); handlers are registered by type.
//! * [`CommandHandler`] — `execute(command)` and `check_status(command, state)`, returning a
//!   [`CommandResult`]: `succeeded`, `failed`, `cancelled`, `running` (optionally with the delay
//!   before the next check) or `handed_off(queue)`.
//!
//! ## In your application
//!
//! This crate is the whole command service; `baton serve` is one program built on it. Its
//! `Cargo.toml` lines (the crates of this repository, here checked out next to your project;
//! with a git dependency the same names take `git = "…"` instead of `path`):
//!
//! ```toml
//! [dependencies]
//! baton-commands = { path = "../baton/crates/baton-commands" }
//! tokio = { version = "1", features = ["macros", "rt-multi-thread"] }
//! serde_json = "1"
//! ```
//!
//! A handler is an `impl CommandHandler` under the `#[async_trait]` attribute, re-exported here
//! ([`async_trait`](macro@async_trait)): no `async-trait` dependency of your own is needed. The
//! Redis backend ([`CommandStore::redis`]) takes a [`RedisClient`] of the `baton-redis` crate, whose
//! [`RedisClient`], [`RedisConfig`] and [`ConnectError`] are re-exported here too; add
//! `baton-redis = { path = "../baton/crates/baton-redis" }` (the same checkout) only to use more
//! of it. Standalone Redis or a Cluster, with the queues' default key prefix and group:
//!
//! ```no_run
//! use baton_commands::{CommandStore, RedisClient, RedisCommandStoreOptions, RedisConfig};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), baton_commands::CommandError> {
//! let client = RedisClient::new(RedisConfig::standalone("redis://127.0.0.1:6379"))?;
//! // A Cluster: RedisConfig::cluster(["redis://127.0.0.1:7000", …]), any seed nodes;
//! // Sentinel: RedisConfig::sentinel(["redis://127.0.0.1:26379"], "mymaster").
//! let store = CommandStore::redis(client, RedisCommandStoreOptions::default()).await?;
//! # let _ = store;
//! # Ok(())
//! # }
//! ```
//!
//! Params and results are [`RawJson`]: the JSON text exactly as given (numbers of any size and
//! precision, escapes, key order), built from text or from a `serde_json::Value` (`json!(…)`).
//!
//! A handler that starts long work and reports it done at its first status check, on a service
//! of queue `builds`, in memory:
//!
//! ```
//! use std::time::Duration;
//!
//! use baton_commands::{
//!     async_trait, Command, CommandHandler, CommandResult, CommandService, CommandState, CommandStatus, CommandStore,
//!     HandlerError,
//! };
//! use serde_json::json;
//!
//! struct Build;
//!
//! #[async_trait]
//! impl CommandHandler for Build {
//!     async fn execute(&self, _command: Command) -> Result<CommandResult, HandlerError> {
//!         // Start the work elsewhere; `RUNNING` is persisted, `check_status` comes in 10 ms.
//!         Ok(CommandResult::running_after(Duration::from_millis(10)))
//!     }
//!
//!     async fn check_status(&self, command: Command, _state: CommandState) -> Result<CommandResult, HandlerError> {
//!         // Params are kept as their JSON text (`RawJson`); decode them as a type or a `Value`.
//!         let params: serde_json::Value = command.params_as()?;
//!         let name = params["name"].as_str().unwrap_or("out");
//!         Ok(CommandResult::succeeded(json!({ "artifact": format!("{name}.tar") })))
//!     }
//! }
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), baton_commands::CommandError> {
//! let store = CommandStore::memory();
//! let service = CommandService::builder(store.clone(), "builds").handler("build", Build).start().await?;
//!
//! let build = Command::with_id("build-1", "build", json!({ "name": "app" }));
//! let state = store.submit_and_wait("builds", build, Duration::from_secs(5)).await?;
//! assert_eq!(state.status, CommandStatus::Succeeded);
//! assert_eq!(state.result_as::<serde_json::Value>()?, json!({ "artifact": "app.tar" }));
//! service.close().await;
//! # Ok(())
//! # }
//! ```
//!
//! ## Rules
//!
//! * **Dispatch from the persisted status**: `SUBMITTED` → `execute`; `RUNNING` → `check_status`;
//!   terminal or missing → ack. `RUNNING` (with `started_at`) is written when a handler says the
//!   work continues, *before* the message is re-polled, so a redelivery never runs `execute`
//!   after it returned. The next `check_status` is scheduled with the queue's `RetryAfter`, after
//!   the result's delay or `check_status_interval`, independent of the claim timeout.
//! * **Compare-and-set**: every write is a CAS on the state's `version` (a Lua script on Redis),
//!   so the first terminal write wins; a cancel and a completion never mix.
//! * **Handler errors** (`Err`, panic) are not terminal: recorded in `errors_count` and `error`,
//!   retried after an exponential backoff up to `max_attempts`, then `FAILED` with the last error.
//! * **Message fencing**: each state names the one queue message that drives it (an internal
//!   token carried in the message). A message whose token is not the state's — a duplicate left
//!   by a crash during a hand-off — is acked without running anything.
//! * **What runs now, progress and checkpoints**: a handler call that runs for a second or more
//!   ([`REPORT_INTERVAL`]) shows in its state's [`CommandState::execution`] (worker, call, since,
//!   delivery, deadline) until its outcome is written. A handler reports with
//!   [`Command::progress`] and [`Command::checkpoint`]; the latest report is written about once
//!   a second in the queue's batched writes (a compare-and-set keeping the status, while the
//!   lease is held) and goes with the outcome; the next delivery of the command gets the last
//!   checkpoint as [`Command::details`], so the work resumes:
//!
//! ```
//! # use baton_commands::{Command, CommandResult, HandlerError};
//! # use serde_json::json;
//! async fn execute(command: Command) -> Result<CommandResult, HandlerError> {
//!     let first = command.details().and_then(|d| d.parse::<u64>().ok()).unwrap_or(0);
//!     for page in first..10 {
//!         // … fetch and store `page` …
//!         command.progress(Some(page as f64 / 10.0), Some(&format!("page {page} of 10")))?;
//!         command.checkpoint(&(page + 1))?;
//!     }
//!     Ok(CommandResult::succeeded(json!({ "pages": 10 })))
//! }
//! ```
//!
//! * **The event feed**: every transition of a command (submitted, started, progress, running,
//!   retry scheduled, handed off, succeeded, failed, cancelled) is appended to its home queue's
//!   feed in the same atomic step as the write ([`CommandEvent`]; the rules: [`feed`]), read per queue ([`CommandStore::events`]) or per command
//!   ([`CommandStore::command_events`]) from any [`EventOffset`], or waited for
//!   ([`CommandStore::events_wait`]); bounded per queue and off per queue ([`FeedSettings`]).
//! * **Cron schedules**: [`schedules::Schedule`] (a cron pattern in a time zone, the command to
//!   submit, overlap and missed-fire policies) run by a [`schedules::Scheduler`] in every process
//!   of the queue; each due time is decided once across processes by a compare-and-set of the
//!   schedule's record and fires a command with the id `sched-<queue>.<name>-<due ms>` (rules, DST:
//!   [`schedules`]).
//! * **Completion hooks**: a queue with a hook ([`CommandStore::set_hook`]) gets one delivery
//!   message per terminal transition of its commands on [`CommandStore::hooks`], enqueued in the
//!   same atomic step as the transition; whoever consumes it delivers it (the `baton` binary
//!   POSTs signed webhooks). Body and layout: [`hooks`].
//!
//! ```
//! # use std::time::Duration;
//! # use baton_commands::{Command, CommandStore, EventFrom, EventKind};
//! # #[tokio::main]
//! # async fn main() -> Result<(), baton_commands::CommandError> {
//! let store = CommandStore::memory();
//! let st = store.submit("builds", Command::new("build", serde_json::json!({}))).await?;
//! let page = store.command_events(&st.id, EventFrom::Start, 100).await?;
//! assert_eq!(page.events[0].event, EventKind::Submitted);
//! // Resume after the last one seen; wait up to 10 ms for more.
//! let next = store.events_wait("builds", EventFrom::After(page.next_offset), 100, Duration::from_millis(10)).await?;
//! assert!(next.events.is_empty() && next.up_to_date);
//! # Ok(())
//! # }
//! ```
//!
//! ## Scheduled commands
//!
//! [`Command::with_run_at`] / [`Command::with_delay`] store a command at submit (`SUBMITTED`, its
//! [`CommandState::run_at`] set) without calling its handler before that time. Its message waits
//! in its queue's delayed set as `c:<id>` (the set a long `RetryAfter` waits in, written by the
//! submit's own atomic step), never in the stream, so it is never pending and never redelivered
//! while it waits; any running [`CommandService`] of the queue enqueues it within a few ms of
//! its due time (promotion needs one). [`CommandStore::reschedule`] moves the due time (one
//! atomic step with the state's compare-and-set), [`CommandStore::cancel`] removes the message,
//! [`CommandStore::scheduled`] counts the waiting ones, [`ListQuery::scheduled`] lists them.
//!
//! ```
//! # use std::time::Duration;
//! # use baton_commands::{Command, CommandStore};
//! # #[tokio::main]
//! # async fn main() -> Result<(), baton_commands::CommandError> {
//! let store = CommandStore::memory();
//! store.declare_queue("reports")?;
//! let st = store.submit("reports", Command::new("daily", serde_json::json!({})).with_delay(Duration::from_secs(3600))).await?;
//! assert!(st.is_scheduled());
//! assert_eq!(store.scheduled("reports").await?.scheduled, 1);
//! # Ok(())
//! # }
//! ```
//!
//! ## Output streams
//!
//! A command can own a durable stream of `baton-streams` ([`Command::with_output`] at submit,
//! on a store given a [`StreamStore`](baton_streams::StreamStore) with
//! [`CommandStore::set_outputs`]): its state's [`CommandState::output`] links it
//! ([`OutputLink`]: path, default `commands/<id>`, run, content type, limits), it is created at
//! submit before the command is stored and enqueued (so a delivery, and any reader, finds it; a
//! path where another stream exists is refused with [`CommandError::OutputInUse`], nothing
//! stored; a submit refused otherwise deletes the stream it made), its handler writes to it ([`Command::output`],
//! [`Output::open`]: producer `command`, a new epoch per delivery fencing an earlier one), and
//! it ends with the command. The stream's end is the arbiter: whoever ends it first decides,
//! and the command's status always agrees with it. Every terminal write ends the output
//! *before* it writes the state: a cancel ends it `cancelled`, a handler's outcome ends it
//! `finished` (`SUCCEEDED`) or with an error entry then `finished` (`FAILED`), in one atomic
//! step fenced to the delivery (it takes place only while the delivery's epoch of producer
//! [`OUTPUT_PRODUCER`] is the stream's current one: the one current when an in-process delivery
//! began or the latest its [`Output::open`] claimed, the one a remote claim claimed; so a stale
//! delivery cannot end the stream of a later one that has opened it, and its outcome is refused);
//! the state is written only after that end took place. After a crash between the two, the
//! redelivered call's outcome is decided by that end (below). The other way, an output that ended first decides the command:
//! `cancelled` → `CANCELLED`, `producer_lost` → `FAILED`, `finished` → `FAILED` when its last
//! entry is an error entry, else `SUCCEEDED`; the handler's result or error text fills it in
//! where it agrees (its `SUCCEEDED` result, its `FAILED` text), else the result is `null` (the
//! error the entry's text) — so a handler may spawn the producer and return `running`, and the
//! command ends at the first `check_status` that begins after the stream ended. A call during
//! which the stream finished and that says `running` does not decide: the handler is asked again
//! at its next check, and a result it returns then is the command's (a producer may finish the
//! stream a moment before the handler has its result).
//! A re-run writes a new stream, `<path>/run-<n>`. The output is part of the submit's request:
//! a resubmit of the id asking for another output (or none) is a [`CommandError::Conflict`]. The stream is deleted `state_ttl` after its
//! creation and `retention` after its end (the home queue's [`Lifetimes`]).
//!
//! ```
//! # use std::time::Duration;
//! # use baton_commands::{Command, CommandResult, CommandService, CommandStatus, CommandStore, OutputSpec};
//! # use baton_streams::{EndReason, StreamStore, StreamStoreSettings};
//! # use serde_json::json;
//! # struct Write;
//! # #[baton_commands::async_trait]
//! # impl baton_commands::CommandHandler for Write {
//! async fn execute(&self, command: Command) -> Result<CommandResult, baton_commands::HandlerError> {
//!     let out = command.output().expect("submitted with an output").open().await?;
//!     out.append_json(&json!({ "line": "compiling" })).await?;
//!     Ok(CommandResult::succeeded(json!("built")))
//! }
//! # }
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = CommandStore::memory();
//! let streams = StreamStore::memory(StreamStoreSettings::default());
//! store.set_outputs(streams.clone())?;
//! let svc = CommandService::builder(store.clone(), "builds").handler("build", Write).start().await?;
//! let cmd = Command::new("build", json!({})).with_output(OutputSpec::default());
//! let done = store.submit_and_wait("builds", cmd, Duration::from_secs(5)).await?;
//! assert_eq!(done.status, CommandStatus::Succeeded);
//! let info = streams.head(&done.output.unwrap().path()).await?;
//! assert_eq!(info.end.map(|e| e.reason), Some(EndReason::Finished));
//! # svc.close().await;
//! # Ok(())
//! # }
//! ```
//!
//! ## Redis key layout and hash slots
//!
//! With key prefix `p` (default `baton`, the same as the work queue's), a command `id` submitted
//! to queue `q` (its *home* queue) lives in the hash slot of `{q}`, the slot of the queue's stream:
//!
//! | key                        | type   | holds                                                          |
//! |----------------------------|--------|----------------------------------------------------------------|
//! | `p:q:{q}`                  | stream | the queue's messages ([`baton_queue::keys::stream`]), field `p` ([`baton_queue::keys::PAYLOAD_FIELD`]) = message JSON |
//! | `p:cmd:{q}:id:<id>`        | string | `<version> <STATUS> <created ms> <SHA-1 of the submitted body> <state JSON>` (the hash of the body's canonical form, see [`RawJson`]; `id:`: no id can name an index key) |
//! | `p:cmd:{q}:s:<STATUS>`     | zset   | id → created ms, per status (listing every status merges the five) |
//! | `p:cmd:{q}:exp`            | zset   | id → a lower bound of its state's expiry ms (index pruning: every 64th submit to `q` by a store, and every list and count) |
//! | `p:cmdid:{<id>}`           | string | the home queue of `id` (lookup by id alone)                    |
//! | `p:cmd:{q}:feed`           | stream | the queue's event feed: `i <id> e <event JSON>` per transition, `XADD MAXLEN ~` (see [`FeedSettings`]) |
//! | `p:hook:q:{q}`             | stream | completion hook deliveries of `q` (only with a hook, [`CommandStore::set_hook`]): a work queue under the prefix [`hook_prefix`] (its other keys: [`baton_queue::keys`]), one entry `p <body>` per terminal transition, XADDed by the transition's script |
//! | `p:cmd:{q}:minutes`        | hash   | per-minute aggregates, a ring of 120 minutes (see [`minutes`]): counts and duration buckets written by the transition scripts, depth and oldest age sampled once a minute |
//! | `p:cmd:{q}:resend:<writer>` | string | Cluster only: a store's re-send guard of its batched submits or transitions of `q`, or one of its pool's guards lent to single calls (a transition with an enqueue or an ack on another queue's stream, a reschedule, a schedule record's compare-and-set; as many as such calls were in flight at once) ([`baton_redis::resend`]: the Cluster client may send a call again after a dropped connection; the copy gets the first one's reply), expiring 300 s after the writer's last call |
//! | channel `p:cmd:{q}:events` | pubsub | `<id> <STATUS> <version> <origin>` per terminal write          |
//!
//! **Why the queue's slot.** Submit is then ONE script (state + indexes + `XADD` to the queue's
//! stream), and every transition updates the state, its status index and (through the index
//! sizes) the counts atomically. A command must also be findable by id alone (`cancel`, `wait`,
//! `get`), so a small lookup key `p:cmdid:{<id>}` (its own slot) maps id → home queue. On
//! standalone Redis it is written by the submit script itself. On Cluster it is written first
//! (`SET NX`), then the submit script runs: a crash between the two leaves a lookup key with no
//! state, which reads as "not found" and is taken over by a later submit — no command is ever
//! stored without its message. The lookup key's TTL always exceeds the state's (`_lookup_exp`
//! in the state records it; it is extended before any write that would outlive it).
//!
//! **One home per id.** A submit whose id's lookup names another queue is refused (a conflict)
//! while the command exists there. A lookup without its state (expired, or a crashed Cluster
//! submit) is stale and taken over, so that of submits racing for it exactly one creates: on
//! standalone inside the submit script, in the same step as the create; on Cluster by a
//! compare-and-set (`lookup_takeover.lua`) after waiting up to 2 s for that queue's state to
//! appear (its submit writes the lookup before its script, so a lookup without state may be a
//! submit in flight). Re-using an expired command's id on another queue therefore costs up to 2 s
//! on Cluster.
//!
//! **Hand-off across slots.** A handed-off command keeps its home (state, index, counts); its
//! messages move to the target queue's stream. On standalone Redis, and on Cluster when both
//! queues' tags hash to one slot, the `RUNNING` write and the `XADD` to the target are one script.
//! Otherwise the order is: CAS the state (`RUNNING`, new token, `handed_off_to`), then enqueue on
//! the target, then ack the source. A crash before the ack redelivers the source message; its
//! token is the state's `_prev_token`, so dispatch re-enqueues on the target under a fresh token
//! (fencing off a possible earlier copy) and acks — `execute` is never called again.
//!
//! **Acks.** A write that ends a delivery (a terminal state, or a hand-off whose enqueue is in the
//! same script) also acks the delivery in that script when the state's slot is the consumed
//! queue's (always on standalone), then `Lease::mark_acked`. Unlike the work queue's own ack it
//! does not check the entry's owner: the version compare-and-set already made this write the
//! command's next step, and dispatch is state-driven, so a copy of the message that another
//! consumer holds has nothing left to do. One round trip instead of
//! two, and a waiter that sees the terminal state never finds its message still pending.
//!
//! **Notifications.** Each *terminal* write `PUBLISH`es on its home queue's channel (in Cluster a
//! plain PUBLISH is broadcast to every node, so one subscription on any node sees all); waiters
//! only return on a terminal state and a cancel is one, so other writes are not announced. The
//! `origin` names the writing store: a store ignores its own announcements for waiters (it told
//! them already, with the state) but still signals a cancel. A process subscribes to the channels
//! of the queues it waits on or runs handlers for; [`CommandStore::wait`] subscribes, reads once,
//! then wakes on local writes and on those events, with a bounded fallback re-read every second.
//!
//! **Expiry.** Non-terminal states expire `state_ttl` (default 7 days) after their last write,
//! terminal ones `retention` (default 24 h) after completion; the TTL is refreshed on every write.
//! Index entries of expired states are pruned (bounded batches) before listing and counting. The
//! `exp` score is kept at or below the state's real expiry (submit: now + the shorter of the two
//! lifetimes; every write: `ZADD LT` with its own expiry), so most writes leave it alone; pruning
//! checks each entry whose score has passed and re-scores live ones to their `PEXPIRETIME`.

pub mod builtin;
pub mod feed;
pub mod hooks;
mod json;
pub mod minutes;
mod model;
mod output;
mod remote;
pub mod schedules;
mod service;
mod store;
pub mod trace;

use std::time::Duration;

/// The attribute every `impl CommandHandler` needs (`#[async_trait]`), re-exported from the
/// `async-trait` crate so an application needs no dependency on it.
pub use async_trait::async_trait;
/// The Redis connection of [`CommandStore::redis`], re-exported from `baton-redis`.
pub use baton_redis::{ConnectError, RedisClient, RedisConfig};
pub use feed::{CommandEvent, EventFrom, EventKind, EventOffset, EventPage, FeedSettings, READ_MAX, SCAN_MAX};
pub use hooks::{hook_prefix, CompletionHook};
pub use json::{RawJson, MAX_PARAMS_NESTING};
pub use model::{
    due_after, BulkAction, BulkReport, Command, CommandPage, CommandResult, CommandState, CommandStatus, Execution,
    ExecutionCall, ListQuery, Progress, ScheduledCounts, StatusCounts, Timestamp, Worker,
};
pub use output::{Output, OutputLink, OutputSpec, OutputWriter, OUTPUT_PRODUCER};
pub use remote::{
    RemoteCall, RemoteClaim, RemoteOutcome, RemoteRenewal, RemoteReport, RemoteSettled, RemoteWorkers, MAX_WORKER_NAME,
};
pub use service::{CommandService, CommandServiceBuilder, QueueSettings, RetryPolicy, REPORT_INTERVAL};
pub use store::{CommandStore, CommandStoreSettings, Lifetimes, RedisCommandStoreOptions};

/// The error a handler returns for a *transient* problem (retried with backoff); a real failure
/// is `Ok(CommandResult::failed(..))`.
pub type HandlerError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Runs commands of one or more types on a queue. Which method runs follows the persisted status
/// (crate docs, "Rules"): `execute` for a `SUBMITTED` command, `check_status` for a `RUNNING` one.
///
/// Implement it under the [`async_trait`](macro@async_trait) attribute re-exported by this crate
/// (`#[baton_commands::async_trait] impl CommandHandler for MyHandler { … }`).
#[async_trait]
pub trait CommandHandler: Send + Sync + 'static {
    /// Starts (or does) the work of a `SUBMITTED` command. Called once per live attempt: after it
    /// returned, only `check_status` is called for the command.
    async fn execute(&self, command: Command) -> Result<CommandResult, HandlerError>;

    /// Polls a `RUNNING` command. Default: still running (next check after the queue's
    /// `check_status_interval`).
    async fn check_status(&self, command: Command, state: CommandState) -> Result<CommandResult, HandlerError> {
        let _ = (command, state);
        Ok(CommandResult::running())
    }

    /// Checks params at submit time, before anything is stored; an `Err` rejects the submit with
    /// [`CommandError::InvalidParams`]. Default: any params. See [`validate_params`].
    fn validate(&self, params: &RawJson) -> Result<(), String> {
        let _ = params;
        Ok(())
    }
}

/// A `validate` body for handlers taking typed params: `Ok` when `params` decodes as `P` (from
/// their text, see [`RawJson::parse`]).
pub fn validate_params<P: serde::de::DeserializeOwned>(params: &RawJson) -> Result<(), String> {
    params.parse::<P>().map(|_| ()).map_err(|e| e.to_string())
}

/// Errors of the command service.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// An id that is empty, longer than 200 bytes, or holds `{`, `}`, whitespace or control
    /// characters.
    #[error("invalid command id {0:?}: use 1 to 200 bytes without braces, whitespace or control characters")]
    InvalidId(String),
    /// A command type that is empty, longer than 200 bytes or holds control characters.
    #[error("invalid command type {0:?}: use 1 to 200 bytes without control characters")]
    InvalidType(String),
    /// Params (or a result) that are not valid JSON (a string with a lone UTF-16 surrogate escape
    /// included), params nested more than [`MAX_PARAMS_NESTING`] deep, or params refused by the
    /// handler's `validate`.
    #[error("invalid params: {0}")]
    InvalidParams(String),
    /// A status name that is not one of SUBMITTED, RUNNING, SUCCEEDED, FAILED, CANCELLED (or the
    /// aliases PENDING, PROCESSING).
    #[error("invalid status {0:?}")]
    InvalidStatus(String),
    /// A listing cursor not returned by a previous page.
    #[error("invalid cursor {0:?}")]
    InvalidCursor(String),
    /// An event feed offset that is not `-1`, `now` or one returned by a read.
    #[error("invalid offset {0:?}: use -1 (the start), now (the tail) or an offset returned by a read")]
    InvalidOffset(String),
    /// A setting out of range; the message names it.
    #[error("invalid setting: {0}")]
    InvalidSettings(String),
    /// The id exists with a different body (type or params) or on another queue.
    #[error("command {id} already exists with a different {what}")]
    Conflict { id: String, what: &'static str },
    /// No command with this id (never submitted, or expired).
    #[error("no command {0}")]
    NotFound(String),
    /// The command is already terminal, so the cancel was refused; its state is attached.
    #[error("command {} is already {}", .0.id, .0.status)]
    AlreadyTerminal(Box<CommandState>),
    /// The command has not ended `FAILED` or `CANCELLED`, so the re-run was refused; its state
    /// is attached ([`CommandStore::retry`]).
    #[error("command {} is {}: only FAILED or CANCELLED commands can be re-run", .0.id, .0.status)]
    NotRetryable(Box<CommandState>),
    /// A due time that cannot be scheduled ([`Command::with_run_at`]); the message says why.
    #[error("invalid run_at: {0}")]
    InvalidSchedule(String),
    /// A concurrency key that cannot be used ([`Command::with_concurrency_key`]); the message
    /// says why.
    #[error("invalid concurrency_key: {0}")]
    InvalidConcurrencyKey(String),
    /// A priority out of range ([`Command::with_priority`]); the message says the range.
    #[error("invalid priority: {0}")]
    InvalidPriority(String),
    /// The command does not wait for a due time any more (it was not scheduled, or its message
    /// was enqueued already, or it ended), so the reschedule was refused; its state is attached
    /// ([`CommandStore::reschedule`]).
    #[error("command {} is {} and no longer waits for a due time: only a scheduled command that has not started can be rescheduled", .0.id, .0.status)]
    NotScheduled(Box<CommandState>),
    /// A stored state that does not decode (corrupt or foreign data).
    #[error("corrupt state for command {id}: {reason}")]
    Corrupt { id: String, reason: String },
    /// The work queue failed (see [`baton_queue::QueueError`]).
    #[error(transparent)]
    Queue(#[from] baton_queue::QueueError),
    /// Redis failed (connection lost, timeout, script error); usually transient.
    #[error("redis: {0}")]
    Redis(#[from] baton_redis::redis::RedisError),
    /// Could not connect to Redis.
    #[error(transparent)]
    Connect(#[from] baton_redis::ConnectError),
    /// A command's output stream could not be created (see [`OutputSpec`]), or the store has no
    /// output streams ([`CommandStore::set_outputs`]).
    #[error("output stream: {0}")]
    Output(String),
    /// The output path names a stream that is not this command's (someone else's, or one
    /// soft-deleted there): nothing was stored. Choose another path.
    #[error("output path {path} is in use: {why}")]
    OutputInUse { path: String, why: String },
}

/// Validates a command id (rules on [`CommandError::InvalidId`]).
pub fn validate_id(id: &str) -> Result<(), CommandError> {
    if id.is_empty()
        || id.len() > 200
        || id.chars().any(|c| c == '{' || c == '}' || c.is_whitespace() || c.is_control())
    {
        return Err(CommandError::InvalidId(id.to_string()));
    }
    Ok(())
}

pub(crate) fn validate_type(t: &str) -> Result<(), CommandError> {
    if t.is_empty() || t.len() > 200 || t.chars().any(|c| c.is_control()) {
        return Err(CommandError::InvalidType(t.to_string()));
    }
    Ok(())
}

pub(crate) fn validate_queue(q: &str) -> Result<(), CommandError> {
    baton_queue::validate_queue_name(q).map_err(CommandError::Queue)
}

/// Exponential backoff delay before retry number `errors` (1-based).
pub(crate) fn backoff(policy: &RetryPolicy, errors: u32) -> Duration {
    let exp = policy.backoff_factor.powi(errors.saturating_sub(1).min(60) as i32);
    let ms = (policy.initial_backoff.as_secs_f64() * 1000.0 * exp).min(policy.max_backoff.as_secs_f64() * 1000.0);
    Duration::from_millis(ms.max(0.0) as u64)
}
