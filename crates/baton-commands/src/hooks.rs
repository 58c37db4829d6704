//! Completion hooks: a queue with a hook gets one *delivery message* per terminal transition of
//! its commands (for the statuses it asks for), enqueued on the store's delivery queue
//! ([`CommandStore::hooks`](crate::CommandStore::hooks)) under the queue's own name, in the same
//! atomic step as the transition (Redis: the same script, in the queue's hash slot; memory: under
//! the store's lock). Whoever consumes that queue delivers them (the `baton` binary POSTs them to
//! a webhook); a delivery in flight is a lease like any other message's, so a delivering process
//! that dies hands it to another after the claim timeout, and a message that keeps failing ends
//! in the delivery queue's dead letters.
//!
//! A queue without a hook pays nothing: no message, no extra key, no extra argument work.
//!
//! The message's payload is the hook body, JSON with exactly these fields, in this order:
//!
//! | field          | value |
//! |----------------|-------|
//! | `delivery_id`  | `<command id>:<version>` — the same in every attempt of this delivery, distinct for every terminal transition (a re-run's second end has its own) |
//! | `event`        | `succeeded`, `failed` or `cancelled` |
//! | `id`           | the command id |
//! | `queue`        | its home queue |
//! | `type`         | its type |
//! | `status`       | `SUCCEEDED`, `FAILED` or `CANCELLED` |
//! | `result`       | the handler's result (its exact JSON text), or `null` |
//! | `error`        | the failure, or `null` |
//! | `attempts`     | `execute` calls made |
//! | `version`      | the version of the terminal state |
//! | `created_at`, `started_at`, `completed_at` | RFC 3339 times (`started_at` `null` when no handler ran) |
//!
//! Redis keys: the delivery queue is a [`baton_queue::MessageStream`] with key prefix
//! `<p>:hook` ([`hook_prefix`]), so queue `q`'s deliveries are `<p>:hook:q:{q}` (and that
//! queue's other keys, [`baton_queue::keys`]), in the slot of `{q}` like the command's state.

use std::collections::BTreeSet;

use serde::Serialize;

use crate::{CommandState, CommandStatus, RawJson, Timestamp};

/// A queue's completion hook ([`CommandStore::set_hook`](crate::CommandStore::set_hook)): the
/// terminal statuses that get a delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompletionHook {
    /// Terminal statuses that get a delivery (others are refused by `set_hook`). Default: all
    /// three.
    pub statuses: BTreeSet<CommandStatus>,
}

impl Default for CompletionHook {
    fn default() -> Self {
        Self { statuses: [CommandStatus::Succeeded, CommandStatus::Failed, CommandStatus::Cancelled].into() }
    }
}

/// The key prefix of the delivery queue's [`baton_queue::MessageStream`] on Redis, for the
/// command store's prefix `prefix`: `<prefix>:hook`.
pub fn hook_prefix(prefix: &str) -> String {
    format!("{prefix}:hook")
}

/// The hook body of terminal state `st` (module docs).
pub(crate) fn body(st: &CommandState) -> String {
    #[derive(Serialize)]
    struct Body<'a> {
        delivery_id: String,
        event: &'a str,
        id: &'a str,
        queue: &'a str,
        #[serde(rename = "type")]
        command_type: &'a str,
        status: CommandStatus,
        result: Option<&'a RawJson>,
        error: Option<&'a str>,
        attempts: u32,
        version: u64,
        created_at: Timestamp,
        started_at: Option<Timestamp>,
        completed_at: Option<Timestamp>,
    }
    let event = match st.status {
        CommandStatus::Succeeded => "succeeded",
        CommandStatus::Failed => "failed",
        _ => "cancelled",
    };
    serde_json::to_string(&Body {
        delivery_id: format!("{}:{}", st.id, st.version),
        event,
        id: &st.id,
        queue: &st.queue,
        command_type: &st.command_type,
        status: st.status,
        result: st.result.as_ref(),
        error: st.error.as_deref(),
        attempts: st.attempts,
        version: st.version,
        created_at: st.created_at,
        started_at: st.started_at,
        completed_at: st.completed_at,
    })
    .expect("a hook body serializes")
}
