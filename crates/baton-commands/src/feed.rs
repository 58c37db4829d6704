//! The durable event feed: every transition of a command appended, in the same atomic step as
//! the transition itself, to its home queue's feed, readable from any offset (the whole queue,
//! or one command's events).
//!
//! * **What is appended**: one [`CommandEvent`] per state write that changes what a watcher
//!   sees ([`EventKind`]): `submitted`; `started` (an `execute` call that has run
//!   [`REPORT_INTERVAL`](crate::REPORT_INTERVAL), when its [`Execution`](crate::Execution) is
//!   written: shorter calls show only as their outcome, whose `started_at` is in the state);
//!   `progress` (a report written while the call runs); `running` (the state became `RUNNING`,
//!   or is `RUNNING` again after an error); `retry_scheduled` (a handler error, retried after
//!   `retry_in_ms`); `handed_off`; `succeeded`; `failed`; `cancelled`; `rerun` (a `FAILED` or
//!   `CANCELLED` command submitted again, [`CommandStore::retry`](crate::CommandStore::retry));
//!   `rescheduled` (a scheduled command's due time moved, its new `run_at` in the event,
//!   [`CommandStore::reschedule`](crate::CommandStore::reschedule); the `submitted` event of a
//!   scheduled command carries its `run_at` too).
//!   Command messages are never dead-lettered (command queues run without `max_deliveries`; a
//!   command that keeps failing ends `failed` after its retries), so there is no such kind. A write the
//!   compare-and-set refuses appends nothing; nor does a `check_status` poll that changes nothing,
//!   nor a write a watcher has nothing to see in (a `RUNNING` state's lifetime refreshed, an
//!   interrupted hand-off finished): the versions of a command's events may skip.
//! * **Atomic**: on Redis the append is an `XADD` in the script that writes the state (same hash
//!   slot: the feed key `<prefix>:cmd:{<queue>}:feed`); in memory, under the store's lock.
//! * **Offsets** ([`EventOffset`]) are opaque, strictly increasing strings that sort as text
//!   (`<ms, 15 digits>_<seq, 10 digits>`, from the Redis stream entry id). Reads resume after any
//!   offset; [`EventFrom::Start`] is the oldest retained event, [`EventFrom::Now`] the tail.
//! * **Retention**: per queue, the newest [`FeedSettings::max_len`] events (default 100,000;
//!   Redis trims with `XADD MAXLEN ~`, so a little more may be kept); a read from an offset older
//!   than the oldest kept continues at the oldest kept. [`FeedSettings::enabled`] `false`
//!   appends nothing for that queue (reads answer what was kept).
//! * **One command's events** are its home queue's events filtered by id, read from the
//!   command's creation on ([`CommandStore::command_events`](crate::CommandStore::command_events)),
//!   so their cost is that of the queue's events since then (bounded by retention; one request
//!   scans at most [`SCAN_MAX`] and says where it stopped).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{CommandError, CommandState, CommandStatus, Progress, Timestamp};

/// Most feed entries one read of a command's events looks at (then it returns what it found,
/// with the offset it reached; the next read goes on from there).
pub const SCAN_MAX: usize = 10_000;

/// Most events one read returns.
pub const READ_MAX: usize = 1_000;

/// A queue's feed settings ([`CommandStore::set_feed`](crate::CommandStore::set_feed); the
/// store's default is [`CommandStoreSettings::feed`](crate::CommandStoreSettings::feed)). Every
/// process writing a queue's commands should use the same (each applies its own to its writes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeedSettings {
    /// Append events for this queue. Default `true`.
    pub enabled: bool,
    /// Events kept per queue, the newest (Redis: about this many, `MAXLEN ~`). Default 100,000;
    /// at least 1.
    pub max_len: u64,
}

impl FeedSettings {
    /// The default number of events kept per queue.
    pub const DEFAULT_MAX_LEN: u64 = 100_000;
    /// No events appended.
    pub const OFF: FeedSettings = FeedSettings { enabled: false, max_len: Self::DEFAULT_MAX_LEN };

    pub(crate) fn validate(&self) -> Result<(), CommandError> {
        if self.max_len == 0 {
            return Err(CommandError::InvalidSettings("the event feed's max_len must be at least 1".into()));
        }
        Ok(())
    }
}

impl Default for FeedSettings {
    fn default() -> Self {
        Self { enabled: true, max_len: Self::DEFAULT_MAX_LEN }
    }
}

/// What happened to a command (see the module docs for when each is appended). JSON: the
/// snake_case name (`"retry_scheduled"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    Submitted,
    Started,
    Progress,
    Running,
    RetryScheduled,
    HandedOff,
    Succeeded,
    Failed,
    Cancelled,
    Rerun,
    Rescheduled,
}

impl EventKind {
    /// Every kind, in lifecycle order.
    pub const ALL: [EventKind; 11] = [
        EventKind::Submitted,
        EventKind::Started,
        EventKind::Progress,
        EventKind::Running,
        EventKind::RetryScheduled,
        EventKind::HandedOff,
        EventKind::Succeeded,
        EventKind::Failed,
        EventKind::Cancelled,
        EventKind::Rerun,
        EventKind::Rescheduled,
    ];

    /// The JSON name (`"retry_scheduled"`).
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Submitted => "submitted",
            EventKind::Started => "started",
            EventKind::Progress => "progress",
            EventKind::Running => "running",
            EventKind::RetryScheduled => "retry_scheduled",
            EventKind::HandedOff => "handed_off",
            EventKind::Succeeded => "succeeded",
            EventKind::Failed => "failed",
            EventKind::Cancelled => "cancelled",
            EventKind::Rerun => "rerun",
            EventKind::Rescheduled => "rescheduled",
        }
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One event of a queue's feed. JSON (fields in this order; absent options left out):
/// `{"offset", "event", "id", "type", "status", "version", "at", "attempts", "worker",
/// "progress", "error", "retry_in_ms", "handed_off_to"}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CommandEvent {
    /// Where this event is in its queue's feed (read after it to get the next ones).
    #[serde(default)]
    pub offset: EventOffset,
    /// What happened.
    pub event: EventKind,
    /// The command.
    pub id: String,
    /// Its command type.
    #[serde(rename = "type")]
    pub command_type: String,
    /// Its status after the event.
    pub status: CommandStatus,
    /// Its state's version after the event.
    pub version: u64,
    /// When it happened (writer's clock; for `started`, when the call began).
    pub at: Timestamp,
    /// `execute` calls that returned so far.
    pub attempts: u32,
    /// `started`, `progress`: the consumer running the call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// `progress` (and the outcome events, the last reported progress).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// `retry_scheduled`, `failed`: the error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// `retry_scheduled`: the delay before the next attempt, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_in_ms: Option<u64>,
    /// `handed_off`: the queue the command went to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handed_off_to: Option<String>,
    /// `submitted` of a scheduled command, `rescheduled`: when it is due.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_at: Option<Timestamp>,
}

impl CommandEvent {
    /// The stored JSON (without the offset: that is where it is stored) of the event `kind` of
    /// the write that stores `st`, serialized straight from the state (no copies).
    pub(crate) fn stored_json_of(kind: EventKind, st: &CommandState, retry_in_ms: Option<u64>) -> String {
        #[derive(Serialize)]
        struct Stored<'a> {
            event: EventKind,
            id: &'a str,
            #[serde(rename = "type")]
            command_type: &'a str,
            status: CommandStatus,
            version: u64,
            at: Timestamp,
            attempts: u32,
            #[serde(skip_serializing_if = "Option::is_none")]
            worker: Option<&'a str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            progress: Option<&'a Progress>,
            #[serde(skip_serializing_if = "Option::is_none")]
            error: Option<&'a str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            retry_in_ms: Option<u64>,
            #[serde(skip_serializing_if = "Option::is_none")]
            handed_off_to: Option<&'a str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            run_at: Option<Timestamp>,
        }
        let running = matches!(kind, EventKind::Started | EventKind::Progress);
        let at = match (kind, &st.execution) {
            (EventKind::Started, Some(e)) => e.since,
            _ => st.modified_at,
        };
        let errs = matches!(kind, EventKind::RetryScheduled | EventKind::Failed);
        serde_json::to_string(&Stored {
            event: kind,
            id: &st.id,
            command_type: &st.command_type,
            status: st.status,
            version: st.version,
            at,
            attempts: st.attempts,
            worker: st.execution.as_ref().filter(|_| running).map(|e| e.worker.as_str()),
            progress: st.progress.as_ref(),
            error: st.error.as_deref().filter(|_| errs),
            retry_in_ms,
            handed_off_to: st.handed_off_to.as_deref().filter(|_| kind == EventKind::HandedOff),
            run_at: st.run_at.filter(|_| matches!(kind, EventKind::Submitted | EventKind::Rescheduled)),
        })
        .expect("an event serializes")
    }

    /// An event read back: its stored JSON at `offset`.
    pub(crate) fn parse(offset: EventOffset, json: &[u8]) -> Result<Self, CommandError> {
        let mut e: CommandEvent = serde_json::from_slice(json)
            .map_err(|e| CommandError::Corrupt { id: offset.to_string(), reason: format!("feed event: {e}") })?;
        e.offset = offset;
        Ok(e)
    }
}

/// A position in a queue's feed: after the event it names. Opaque; strictly increasing; two
/// offsets compare as text as they compare as positions. Made from and shown as
/// `<ms, 15 digits>_<seq, 10 digits>`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventOffset {
    pub(crate) ms: u64,
    pub(crate) seq: u64,
}

impl EventOffset {
    /// Before every event (`000000000000000_0000000000`).
    pub const ZERO: EventOffset = EventOffset { ms: 0, seq: 0 };

    pub(crate) fn new(ms: u64, seq: u64) -> Self {
        EventOffset { ms, seq }
    }

    /// From a Redis stream entry id (`<ms>-<seq>`).
    pub(crate) fn from_entry_id(id: &str) -> Option<Self> {
        let (ms, seq) = id.split_once('-')?;
        Some(EventOffset { ms: ms.parse().ok()?, seq: seq.parse().ok()? })
    }

    /// As a Redis stream entry id (`<ms>-<seq>`).
    pub(crate) fn entry_id(self) -> String {
        format!("{}-{}", self.ms, self.seq)
    }

    /// Parses an offset as [`fmt::Display`] shows it: exactly 15 digits, `_`, then 10 digits (up
    /// to 20 past 10^10 appends in one millisecond). Errors: [`CommandError::InvalidOffset`].
    pub fn parse(s: &str) -> Result<Self, CommandError> {
        let bad = || CommandError::InvalidOffset(s.to_string());
        let (ms, seq) = s.split_once('_').ok_or_else(bad)?;
        let digits = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
        if ms.len() != 15 || !(10..=20).contains(&seq.len()) || !digits(ms) || !digits(seq) {
            return Err(bad());
        }
        Ok(EventOffset { ms: ms.parse().map_err(|_| bad())?, seq: seq.parse().map_err(|_| bad())? })
    }
}

impl fmt::Display for EventOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:015}_{:010}", self.ms, self.seq)
    }
}

impl Serialize for EventOffset {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for EventOffset {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        EventOffset::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Where a read starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventFrom {
    /// The oldest event kept (the Durable Streams protocol's offset `-1`).
    Start,
    /// The tail: only events appended from now on (offset `now`).
    Now,
    /// The events after this offset.
    After(EventOffset),
}

impl EventFrom {
    /// `-1` → [`EventFrom::Start`], `now` → [`EventFrom::Now`], else an [`EventOffset`].
    /// Errors: [`CommandError::InvalidOffset`].
    pub fn parse(s: &str) -> Result<Self, CommandError> {
        match s {
            "-1" => Ok(EventFrom::Start),
            "now" => Ok(EventFrom::Now),
            _ => EventOffset::parse(s).map(EventFrom::After),
        }
    }
}

/// One read of a feed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EventPage {
    /// The events, oldest first.
    pub events: Vec<CommandEvent>,
    /// Where to read next: after the last event returned, or further when a read of a command's
    /// events looked at entries of other commands (never before the offset read from).
    pub next_offset: EventOffset,
    /// True when the read reached the feed's tail (nothing more to read now).
    pub up_to_date: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_sort_as_text_as_they_sort_as_positions() {
        let a = EventOffset::new(999, 12);
        let b = EventOffset::new(1000, 3);
        let c = EventOffset::new(1000, 10);
        assert!(a < b && b < c);
        assert!(a.to_string() < b.to_string() && b.to_string() < c.to_string());
        assert_eq!(b.to_string(), "000000000001000_0000000003");
        assert_eq!(EventOffset::parse(&c.to_string()).unwrap(), c);
        assert_eq!(EventOffset::from_entry_id("1000-10"), Some(c));
        assert_eq!(c.entry_id(), "1000-10");
    }

    #[test]
    fn bad_offsets_are_refused() {
        for s in [
            "",
            "_",
            "1_",
            "_1",
            "1-2",
            "x_1",
            "1_2_3",
            "-1_2",
            "1_1",
            "001796354733501_000000000",
            "1796354733501_0000000000",
            "000000000000001_0000000000_",
            "000000000000001_123456789012345678901",
        ] {
            assert!(matches!(EventOffset::parse(s), Err(CommandError::InvalidOffset(_))), "{s:?}");
        }
        assert_eq!(EventFrom::parse("-1").unwrap(), EventFrom::Start);
        assert_eq!(EventFrom::parse("now").unwrap(), EventFrom::Now);
        assert_eq!(EventOffset::parse("000000000000001_0000000002").unwrap(), EventOffset::new(1, 2));
    }

    #[test]
    fn kinds_have_their_json_names() {
        for k in EventKind::ALL {
            assert_eq!(serde_json::to_value(k).unwrap(), serde_json::Value::String(k.as_str().into()));
        }
    }
}
