//! Cron schedules of a queue: a command submitted at each due time of a cron pattern, exactly
//! once per due time across every process running the schedule.
//!
//! A [`Schedule`] is a name (unique per queue), a cron pattern, an IANA time zone, the command
//! to submit (type and params), an [`Overlap`] policy and a [`Missed`] policy. A [`Scheduler`]
//! runs a queue's schedules in one task; every process that runs the queue's workers runs one.
//!
//! ## Patterns
//!
//! Standard 5 fields (`minute hour day-of-month month day-of-week`), or 6 with a leading seconds
//! field (`*/10 * * * * *`: every 10 s). Parsed by the `croner` crate (the Open Cron Pattern
//! Specification: ranges, steps, lists, names, `L`, `#`, `W`, `@daily` and the like); a year field
//! is refused. Day-of-month and day-of-week both restricted match either (vixie cron).
//!
//! ## Daylight-saving time
//!
//! Due times are wall-clock times in the schedule's time zone (`jiff`, with its own copy of the
//! tz database), as `croner` evaluates them:
//! * **Spring forward** (a local time that does not exist): a pattern with fixed second, minute
//!   and hour (`30 2 * * *`) fires once, at the first instant after the gap on that day (03:00
//!   in Europe/Berlin); a pattern with anything else in one of those fields (a wildcard, step,
//!   range or list: `*/15 * * * *`, `0,30 2 * * *`, `0 1-3 * * *`) has no fires inside the gap.
//! * **Fall back** (a local hour that happens twice): a fixed-time pattern fires once, at the
//!   first occurrence; any other (wildcard, step, range, list) fires in both passes
//!   (`*/30 * * * *` and `0,30 2 * * *` fire at 02:00 and 02:30 CEST, then again at 02:00 and
//!   02:30 CET). Each fire is a distinct instant,
//!   so its command id (which carries the instant) is distinct too.
//!
//! ## Exactly once per due time
//!
//! Each schedule has one record per queue, in the queue's hash slot on Redis
//! (`<prefix>:cmd:{<queue>}:sched:<name>`, no expiry): the last decided due time (the cursor),
//! the last fire, the last command and whether that command's submit is still to be done. Every
//! decision (fire, skip, missed) advances the cursor by a compare-and-set of the whole record
//! (`scripts/schedule_cas.lua`), so of all processes deciding a due time one wins; a process
//! that read an old record (paused, late) loses its compare-and-set and fires nothing.
//! A won fire is recorded *pending* first, then its command is submitted with the id
//! `sched-<queue>.<name>-<due time, ms since the Unix epoch>` (submit is idempotent on id;
//! command ids are global, so the queue is part of it), then the
//! record is marked submitted. A process that dies in between leaves the record pending: the
//! next process to read it (any) submits the same id — finding or making the same command — and
//! marks it. Left open: a process paused between winning a fire and its submit for longer than
//! the command's whole lifetime (until its state expired after `retention`) would make it again.
//!
//! `missed_total` and a `missed` decision's count add at most 100,000 due times per decision
//! (a longer downtime of a frequent schedule is counted that far).
//!
//! Clocks: due times are decided by the backend's clock, on Redis the `TIME` of the node that
//! holds the record (read in the same script as the record), so processes with skewed clocks
//! agree; a process's own clock only decides when it wakes to look.
//!
//! A schedule seen for the first time (no record) starts then: due times before it are not
//! fired.
//!
//! ## Missed fires
//!
//! A due time decided more than `missed_after` (default 10 s) after it is *late*: nothing ran
//! the schedule then (every process down or stalled). Late due times follow [`Missed`]:
//! `skip` records them missed (no command), `run_once` submits the newest of them and records
//! the others missed, `run_all` submits each of them, the newest `max_catch_up` (default 10),
//! older ones missed. A late fire that is submitted is a catch-up (result `caught_up`): the
//! overlap policy is not applied to it. Because each decision is a compare-and-set of the one
//! record, the policy applies once, however many processes start after the downtime.
//!
//! ## Overlap
//!
//! When a due time fires and the previous fire's command is not terminal: `skip` (default)
//! records the fire `skipped` and submits nothing; `allow` submits anyway (`overlapped`);
//! `cancel_previous` cancels the previous command, then submits (`replaced`). A previous command
//! no longer found (expired) counts as terminal.

use std::sync::Arc;
use std::time::Duration;

use croner::parser::{CronParser, Seconds, Year};
use croner::Cron;
use jiff::tz::TimeZone;
use jiff::{Timestamp, Zoned};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::{Command, CommandError, CommandStore, RawJson};

/// What a fire does when the previous fire's command is still running (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Record the fire `skipped`; submit nothing.
    #[default]
    Skip,
    /// Submit anyway.
    Allow,
    /// Cancel the previous command, then submit.
    CancelPrevious,
}

/// What happens to due times that passed while nothing ran the schedule (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Missed {
    /// Record them missed; submit nothing for them.
    #[default]
    Skip,
    /// Submit one command, for the newest of them.
    RunOnce,
    /// Submit one per due time, the newest `max_catch_up` of them.
    RunAll,
}

impl Overlap {
    /// The configuration name: `skip`, `allow` or `cancel_previous`.
    pub fn as_str(self) -> &'static str {
        match self {
            Overlap::Skip => "skip",
            Overlap::Allow => "allow",
            Overlap::CancelPrevious => "cancel_previous",
        }
    }
}

impl Missed {
    /// The configuration name: `skip`, `run_once` or `run_all`.
    pub fn as_str(self) -> &'static str {
        match self {
            Missed::Skip => "skip",
            Missed::RunOnce => "run_once",
            Missed::RunAll => "run_all",
        }
    }
}

/// Default of [`Schedule::missed_after`]: 10 s.
pub const DEFAULT_MISSED_AFTER: Duration = Duration::from_secs(10);
/// Default of [`Schedule::max_catch_up`]: 10.
pub const DEFAULT_MAX_CATCH_UP: u32 = 10;
/// The most [`Schedule::max_catch_up`] may be: 1000.
pub const MAX_CATCH_UP: u32 = 1000;
/// The latest due time whose command id [`CommandStore::schedule_tick`] checks (13 digits of ms,
/// the year 2286): the longest id a schedule fires for centuries.
pub const LATEST_DUE_MS: i64 = 9_999_999_999_999;
/// Late due times counted per decision at most (the `missed` count of one decision).
const COUNT_MAX: u64 = 100_000;

/// One cron schedule of a queue. Build with [`Schedule::new`], then the `with_*` setters.
#[derive(Clone, Debug)]
pub struct Schedule {
    name: String,
    cron: String,
    timezone: String,
    command_type: String,
    params: RawJson,
    overlap: Overlap,
    missed: Missed,
    max_catch_up: u32,
    missed_after: Duration,
    parsed: Cron,
    tz: TimeZone,
}

/// A refused schedule: which part and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// `name`: 1 to 64 of `A-Z a-z 0-9 _ -`.
    #[error("name {0:?}: use 1 to 64 letters, digits, '_' or '-'")]
    Name(String),
    /// `cron`: not a pattern (the parser's reason), or one no date matches (`0 0 30 2 *`).
    #[error("cron {0:?}: {1}; use 5 fields (minute hour day-of-month month day-of-week) or 6 with seconds first")]
    Cron(String, String),
    /// `timezone`: not an IANA zone name.
    #[error("timezone {0:?} is not a known IANA time zone (e.g. \"UTC\", \"Europe/Berlin\")")]
    TimeZone(String),
    /// `type`: empty, over 200 bytes or with control characters.
    #[error("type {0:?}: give the command type (1 to 200 characters, no control characters)")]
    Type(String),
    /// `max_catch_up` out of 1 – [`MAX_CATCH_UP`].
    #[error("max_catch_up {0} is out of range 1 – 1000 (default 10)")]
    MaxCatchUp(u32),
    /// `missed_after` under 1 s.
    #[error("missed_after must be at least 1s (default 10s)")]
    MissedAfter,
}

impl Schedule {
    /// A schedule `name` of `cron` in `timezone` (IANA name, `"UTC"`), submitting commands of
    /// `command_type` with `params`; overlap and missed `skip`, `max_catch_up` 10, `missed_after`
    /// 10 s. Errors: [`ScheduleError`] naming the refused part.
    pub fn new(
        name: &str,
        cron: &str,
        timezone: &str,
        command_type: &str,
        params: impl Into<RawJson>,
    ) -> Result<Self, ScheduleError> {
        if name.is_empty()
            || name.len() > 64
            || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(ScheduleError::Name(name.to_string()));
        }
        crate::validate_type(command_type).map_err(|_| ScheduleError::Type(command_type.to_string()))?;
        let parsed = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build()
            .parse(cron)
            .map_err(|e| ScheduleError::Cron(cron.to_string(), e.to_string()))?;
        let tz = TimeZone::get(timezone).map_err(|_| ScheduleError::TimeZone(timezone.to_string()))?;
        // A pattern no date matches (`0 0 30 2 *`) would never fire (and cost a search up to the
        // year 5000 on every look): refused here.
        if parsed.find_next_occurrence(&Timestamp::now().to_zoned(tz.clone()), false).is_err() {
            return Err(ScheduleError::Cron(cron.to_string(), "no date matches it".to_string()));
        }
        Ok(Self {
            name: name.to_string(),
            cron: cron.to_string(),
            timezone: timezone.to_string(),
            command_type: command_type.to_string(),
            params: params.into(),
            overlap: Overlap::default(),
            missed: Missed::default(),
            max_catch_up: DEFAULT_MAX_CATCH_UP,
            missed_after: DEFAULT_MISSED_AFTER,
            parsed,
            tz,
        })
    }

    /// With overlap policy `overlap`.
    pub fn with_overlap(mut self, overlap: Overlap) -> Self {
        self.overlap = overlap;
        self
    }

    /// With missed policy `missed` and, for `run_all`, at most `max_catch_up` (1 – 1000) late
    /// fires submitted. Errors: [`ScheduleError::MaxCatchUp`].
    pub fn with_missed(mut self, missed: Missed, max_catch_up: u32) -> Result<Self, ScheduleError> {
        if !(1..=MAX_CATCH_UP).contains(&max_catch_up) {
            return Err(ScheduleError::MaxCatchUp(max_catch_up));
        }
        self.missed = missed;
        self.max_catch_up = max_catch_up;
        Ok(self)
    }

    /// A due time decided more than `missed_after` (at least 1 s) after it is late (module
    /// docs). Errors: [`ScheduleError::MissedAfter`].
    pub fn with_missed_after(mut self, missed_after: Duration) -> Result<Self, ScheduleError> {
        if missed_after < Duration::from_secs(1) {
            return Err(ScheduleError::MissedAfter);
        }
        self.missed_after = missed_after;
        Ok(self)
    }

    /// The schedule's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The cron pattern as given.
    pub fn cron(&self) -> &str {
        &self.cron
    }
    /// The IANA time zone name as given.
    pub fn timezone(&self) -> &str {
        &self.timezone
    }
    /// The type of the commands submitted.
    pub fn command_type(&self) -> &str {
        &self.command_type
    }
    /// The params of the commands submitted.
    pub fn params(&self) -> &RawJson {
        &self.params
    }
    /// The overlap policy.
    pub fn overlap(&self) -> Overlap {
        self.overlap
    }
    /// The missed policy.
    pub fn missed(&self) -> Missed {
        self.missed
    }
    /// Most late fires `run_all` submits.
    pub fn max_catch_up(&self) -> u32 {
        self.max_catch_up
    }
    /// How late a due time is when it counts as missed.
    pub fn missed_after(&self) -> Duration {
        self.missed_after
    }

    /// The id of the command fired in `queue` for due time `due_ms` (ms since the Unix epoch):
    /// `sched-<queue>.<name>-<due_ms>`. Command ids are global (not per queue), so the queue is
    /// part of it: schedules of one name in two queues fire distinct commands. The id is one to
    /// one with (queue, name, due time): a name has no `.` and a due time no `-`; in the queue
    /// `%` and whitespace (not allowed in ids) are written `%XX` (UTF-8 bytes, hex).
    pub fn command_id(&self, queue: &str, due_ms: i64) -> String {
        let mut q = String::with_capacity(queue.len());
        for c in queue.chars() {
            if c == '%' || c.is_whitespace() {
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    q.push_str(&format!("%{b:02X}"));
                }
            } else {
                q.push(c);
            }
        }
        format!("sched-{q}.{}-{due_ms}", self.name)
    }

    fn zoned(&self, ms: i64) -> Option<Zoned> {
        Some(Timestamp::from_millisecond(ms).ok()?.to_zoned(self.tz.clone()))
    }

    /// The first due time strictly after `after_ms` (ms since the Unix epoch), in ms; `None`
    /// when there is none (a pattern that never matches, or past the year 5000).
    pub fn next_due_after(&self, after_ms: i64) -> Option<i64> {
        let z = self.zoned(after_ms)?;
        let next = self.parsed.find_next_occurrence(&z, false).ok()?;
        Some(next.timestamp().as_millisecond())
    }

    /// Due times in `(after_ms, upto_ms]`, oldest first, at most `limit` (the oldest ones).
    pub fn due_times(&self, after_ms: i64, upto_ms: i64, limit: usize) -> Vec<i64> {
        let mut out = Vec::new();
        let mut t = after_ms;
        while out.len() < limit {
            match self.next_due_after(t) {
                Some(n) if n <= upto_ms => {
                    out.push(n);
                    t = n;
                }
                _ => break,
            }
        }
        out
    }

    /// The newest `n` due times in `(after_ms, upto_ms]`, oldest first.
    fn newest_due_times(&self, after_ms: i64, upto_ms: i64, n: usize) -> Vec<i64> {
        let mut out = Vec::new();
        // `find_previous_occurrence` with `inclusive` gives `upto_ms` itself when it is due.
        let Some(mut z) = self.zoned(upto_ms) else { return out };
        let mut inclusive = true;
        while out.len() < n {
            match self.parsed.find_previous_occurrence(&z, inclusive) {
                Ok(p) if p.timestamp().as_millisecond() > after_ms => {
                    out.push(p.timestamp().as_millisecond());
                    z = p;
                    inclusive = false;
                }
                _ => break,
            }
        }
        out.reverse();
        out
    }

    /// How many due times are in `(after_ms, upto_ms]`, counted up to [`COUNT_MAX`].
    fn count_due(&self, after_ms: i64, upto_ms: i64) -> u64 {
        self.due_times(after_ms, upto_ms, COUNT_MAX as usize).len() as u64
    }
}

/// The outcome of one decided due time, as recorded and counted
/// (`baton_schedule_fires_total{result}` in the `baton` binary).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FireResult {
    /// Submitted; the previous fire's command was terminal (or there was none).
    Fired,
    /// Submitted while the previous command was not terminal (`overlap = "allow"`).
    Overlapped,
    /// The previous command was cancelled, then this one submitted (`overlap = "cancel_previous"`).
    Replaced,
    /// Not submitted: the previous command was not terminal (`overlap = "skip"`).
    Skipped,
    /// A late due time submitted (`missed = "run_once"` / `"run_all"`).
    CaughtUp,
    /// A late due time not submitted (by the missed policy).
    Missed,
}

impl FireResult {
    /// The snake_case name (`fired`, `overlapped`, `replaced`, `skipped`, `caught_up`, `missed`).
    pub fn as_str(self) -> &'static str {
        match self {
            FireResult::Fired => "fired",
            FireResult::Overlapped => "overlapped",
            FireResult::Replaced => "replaced",
            FireResult::Skipped => "skipped",
            FireResult::CaughtUp => "caught_up",
            FireResult::Missed => "missed",
        }
    }
}

/// The last decided due time of a schedule.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastFire {
    /// The due time, ms since the Unix epoch.
    pub due_ms: i64,
    /// The command submitted for it (`None` when skipped or missed).
    pub command_id: Option<String>,
    pub result: FireResult,
    /// When it was decided (the backend's clock), ms since the Unix epoch.
    pub decided_ms: i64,
}

/// A schedule's stored record (module docs): shared by every process running it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleRecord {
    /// The last decided due time (or, before any, when the schedule started), ms since the epoch.
    pub cursor_ms: i64,
    /// The last decision, if any.
    pub last: Option<LastFire>,
    /// The last command submitted (the one the overlap policy looks at).
    pub last_command: Option<String>,
    /// The last command's submit is still to be done (its decider may have died).
    pub pending: bool,
    /// With `pending`: the command to cancel first (`cancel_previous`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel: Option<String>,
    /// Due times recorded missed so far.
    pub missed_total: u64,
}

/// One decision made by this process (for metrics and logs; each decision is made by exactly
/// one process).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FireEvent {
    pub queue: String,
    pub schedule: String,
    pub due_ms: i64,
    pub result: FireResult,
    /// How many due times this decision covers (more than 1 only for `missed`).
    pub count: u64,
    pub command_id: Option<String>,
}

/// Called with each decision this process makes.
pub type FireObserver = Arc<dyn Fn(&FireEvent) + Send + Sync>;

impl CommandStore {
    /// The record of `queue`'s schedule `name`, `None` before the schedule first ran.
    /// Errors: [`CommandError::Queue`] (bad queue name), backend errors, a record that is not a
    /// schedule record ([`CommandError::InvalidSettings`]).
    pub async fn schedule_record(&self, queue: &str, name: &str) -> Result<Option<ScheduleRecord>, CommandError> {
        baton_queue::validate_queue_name(queue)?;
        let (raw, _) = self.inner.backend.schedule_read(queue, name).await?;
        raw.map(|r| parse_record(&r)).transpose()
    }

    /// Runs `queue`'s `schedule` once: decides every due time up to now (by the backend's
    /// clock), submitting what fires and finishing a pending submit; returns the next due time
    /// (ms) and the backend's clock when it was read. [`Scheduler`] calls it.
    pub async fn schedule_tick(
        &self,
        queue: &str,
        schedule: &Schedule,
        observe: Option<&FireObserver>,
    ) -> Result<(Option<i64>, i64), CommandError> {
        baton_queue::validate_queue_name(queue)?;
        // Its command ids must be ids (200 characters at most) before any fire is decided, or a
        // won fire could never be submitted.
        crate::validate_id(&schedule.command_id(queue, LATEST_DUE_MS))?;
        let backend = &self.inner.backend;
        let name = schedule.name();
        loop {
            let (raw, now) = backend.schedule_read(queue, name).await?;
            let Some(raw) = raw else {
                let rec = ScheduleRecord {
                    cursor_ms: now,
                    last: None,
                    last_command: None,
                    pending: false,
                    cancel: None,
                    missed_total: 0,
                };
                backend.schedule_cas(queue, name, None, &to_json(&rec)).await?;
                continue;
            };
            let rec = parse_record(&raw)?;
            if rec.pending {
                self.finish_pending(queue, schedule, &raw, rec).await?;
                continue;
            }
            let Some(first) = schedule.next_due_after(rec.cursor_ms).filter(|&t| t <= now) else {
                return Ok((schedule.next_due_after(rec.cursor_ms.max(now)), now));
            };
            // Saturating: a `missed_after` of more ms than an i64 holds means never late.
            let late_before = now.saturating_sub(i64::try_from(schedule.missed_after.as_millis()).unwrap_or(i64::MAX));
            if first < late_before {
                // Late due times: the newest of them decides what runs.
                let keep = match schedule.missed {
                    Missed::Skip => 0,
                    Missed::RunOnce => 1,
                    Missed::RunAll => schedule.max_catch_up as usize,
                };
                let late_newest = schedule.newest_due_times(rec.cursor_ms, late_before - 1, keep.max(1));
                let last_late = *late_newest.last().unwrap_or(&first);
                let runs: Vec<i64> = if keep == 0 { Vec::new() } else { late_newest.clone() };
                // Everything late before the first one run is missed, decided in one step.
                let missed_upto = match runs.first() {
                    Some(&r) => schedule.newest_due_times(rec.cursor_ms, r - 1, 1).first().copied(),
                    None => Some(last_late),
                };
                if let Some(upto) = missed_upto {
                    let count = schedule.count_due(rec.cursor_ms, upto);
                    let next = ScheduleRecord {
                        cursor_ms: upto,
                        last: Some(LastFire {
                            due_ms: upto,
                            command_id: None,
                            result: FireResult::Missed,
                            decided_ms: now,
                        }),
                        missed_total: rec.missed_total + count,
                        ..rec.clone()
                    };
                    if backend.schedule_cas(queue, name, Some(&raw), &to_json(&next)).await? {
                        tracing::warn!(
                            queue,
                            schedule = name,
                            due_ms = upto,
                            count,
                            "missed cron fires (nothing ran the schedule then)"
                        );
                        emit(observe, queue, name, upto, FireResult::Missed, count, None);
                    }
                    continue;
                }
                // The oldest late one still to run: a catch-up fire.
                self.fire(queue, schedule, &raw, &rec, first, now, true, observe).await?;
                continue;
            }
            self.fire(queue, schedule, &raw, &rec, first, now, false, observe).await?;
        }
    }

    /// Decides due time `due` (compare-and-set against `raw`), then submits its command.
    #[allow(clippy::too_many_arguments)]
    async fn fire(
        &self,
        queue: &str,
        schedule: &Schedule,
        raw: &str,
        rec: &ScheduleRecord,
        due: i64,
        now: i64,
        catch_up: bool,
        observe: Option<&FireObserver>,
    ) -> Result<(), CommandError> {
        let previous_live = match (&rec.last_command, catch_up) {
            (Some(id), false) => self.get(id).await?.is_some_and(|st| !st.status.is_terminal()),
            _ => false,
        };
        let result = match (catch_up, previous_live, schedule.overlap) {
            (true, _, _) => FireResult::CaughtUp,
            (false, false, _) => FireResult::Fired,
            (false, true, Overlap::Skip) => FireResult::Skipped,
            (false, true, Overlap::Allow) => FireResult::Overlapped,
            (false, true, Overlap::CancelPrevious) => FireResult::Replaced,
        };
        let command_id = (result != FireResult::Skipped).then(|| schedule.command_id(queue, due));
        let next = ScheduleRecord {
            cursor_ms: due,
            last: Some(LastFire { due_ms: due, command_id: command_id.clone(), result, decided_ms: now }),
            last_command: command_id.clone().or_else(|| rec.last_command.clone()),
            pending: command_id.is_some(),
            cancel: if result == FireResult::Replaced { rec.last_command.clone() } else { None },
            missed_total: rec.missed_total,
        };
        let next_raw = to_json(&next);
        if !self.inner.backend.schedule_cas(queue, schedule.name(), Some(raw), &next_raw).await? {
            return Ok(()); // Another process decided it.
        }
        match result {
            FireResult::Fired | FireResult::Overlapped => {
                tracing::debug!(queue, schedule = schedule.name(), due_ms = due, result = result.as_str(), command = ?command_id, "cron fire")
            }
            _ => {
                tracing::info!(queue, schedule = schedule.name(), due_ms = due, result = result.as_str(), command = ?command_id, "cron fire")
            }
        }
        emit(observe, queue, schedule.name(), due, result, 1, command_id);
        if next.pending {
            self.finish_pending(queue, schedule, &next_raw, next).await?;
        }
        Ok(())
    }

    /// Submits the pending command of `rec` (cancelling the one it replaces first), then marks
    /// the record submitted. Done by the decider, or by whichever process finds it pending.
    async fn finish_pending(
        &self,
        queue: &str,
        schedule: &Schedule,
        raw: &str,
        rec: ScheduleRecord,
    ) -> Result<(), CommandError> {
        if let Some(prev) = &rec.cancel {
            match self.cancel(prev).await {
                Ok(_) | Err(CommandError::NotFound(_)) | Err(CommandError::AlreadyTerminal(_)) => {}
                Err(e) => return Err(e),
            }
        }
        if let Some(id) = rec.last_command.clone() {
            let cmd = Command::with_id(id.clone(), schedule.command_type(), schedule.params().clone());
            match self.submit(queue, cmd).await {
                Ok(_) => {}
                // Another process's config (other params) made it: the due time did fire.
                Err(e @ (CommandError::Conflict { .. } | CommandError::InvalidParams(_))) => {
                    tracing::error!(queue, schedule = schedule.name(), command = %id, error = %e, "cron fire's submit refused");
                }
                Err(e) => return Err(e),
            }
        }
        let done = ScheduleRecord { pending: false, cancel: None, ..rec };
        self.inner.backend.schedule_cas(queue, schedule.name(), Some(raw), &to_json(&done)).await?;
        Ok(())
    }
}

fn emit(
    observe: Option<&FireObserver>,
    queue: &str,
    schedule: &str,
    due_ms: i64,
    result: FireResult,
    count: u64,
    command_id: Option<String>,
) {
    if let Some(f) = observe {
        f(&FireEvent { queue: queue.to_string(), schedule: schedule.to_string(), due_ms, result, count, command_id });
    }
}

fn to_json(rec: &ScheduleRecord) -> String {
    serde_json::to_string(rec).expect("a schedule record serializes")
}

fn parse_record(raw: &str) -> Result<ScheduleRecord, CommandError> {
    serde_json::from_str(raw).map_err(|e| CommandError::InvalidSettings(format!("unreadable schedule record: {e}")))
}

/// Runs a queue's schedules in one task until stopped (or dropped): wakes at each due time (by
/// the backend's clock) and at least once a second (to finish a fire another process left
/// pending), and calls [`CommandStore::schedule_tick`] for each schedule. Errors are logged and
/// retried a second later.
pub struct Scheduler {
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Ticks every schedule of `queue` once; returns how long to sleep before the next look.
async fn tick_all(
    store: &CommandStore,
    queue: &str,
    schedules: &[Schedule],
    observe: Option<&FireObserver>,
) -> Duration {
    let mut wait = SCHEDULER_MAX_SLEEP;
    for s in schedules {
        match store.schedule_tick(queue, s, observe).await {
            Ok((Some(next), now)) => {
                // A few ms past the due time, so the backend's clock has reached it.
                wait = wait.min(Duration::from_millis((next - now).max(0) as u64 + 3));
            }
            Ok((None, _)) => {}
            Err(e) => tracing::warn!(queue, schedule = s.name(), error = %e, "cron schedule tick failed; retrying"),
        }
    }
    wait
}

/// How long [`Scheduler::stop`] lets a tick in progress finish: 5 s.
pub const SCHEDULER_STOP_GRACE: Duration = Duration::from_secs(5);

/// The longest a scheduler sleeps between two looks.
const SCHEDULER_MAX_SLEEP: Duration = Duration::from_secs(1);

impl Scheduler {
    /// Starts running `schedules` of `queue` on `store`, calling `observe` with each decision
    /// this process makes. Needs a Tokio runtime.
    pub fn start(store: CommandStore, queue: String, schedules: Vec<Schedule>, observe: Option<FireObserver>) -> Self {
        let stop = CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            loop {
                // A tick in progress is finished (see `stop`).
                let wait = tick_all(&store, &queue, &schedules, observe.as_ref()).await;
                tokio::select! {
                    _ = token.cancelled() => return,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        });
        Self { stop, task: Some(task) }
    }

    /// Stops the task: a tick in progress may finish (its fires submitted) for up to
    /// [`SCHEDULER_STOP_GRACE`], then it is dropped wherever it is (a fire it had decided is
    /// finished by the next process to look: the record stays `pending`).
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(mut task) = self.task.take() {
            if tokio::time::timeout(SCHEDULER_STOP_GRACE, &mut task).await.is_err() {
                task.abort();
            }
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(s: &str) -> i64 {
        s.parse::<Timestamp>().unwrap().as_millisecond()
    }

    fn utc(ms: i64) -> String {
        Timestamp::from_millisecond(ms).unwrap().to_string()
    }

    fn sched(cron: &str, tz: &str) -> Schedule {
        Schedule::new("s", cron, tz, "t", serde_json::json!({})).unwrap()
    }

    fn dues(s: &Schedule, from: &str, to: &str) -> Vec<String> {
        s.due_times(ms(from), ms(to), 100).into_iter().map(utc).collect()
    }

    /// Berlin springs forward on 2026-03-29 at 02:00 CET to 03:00 CEST (01:00 UTC): a fixed
    /// 02:30 fires once, at 03:00 CEST; an every-30-minutes pattern has no fire in the gap.
    #[test]
    fn spring_forward_in_berlin() {
        let fixed = sched("30 2 * * *", "Europe/Berlin");
        assert_eq!(
            dues(&fixed, "2026-03-27T12:00:00Z", "2026-03-30T12:00:00Z"),
            ["2026-03-28T01:30:00Z", "2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"]
        );
        let every = sched("*/30 * * * *", "Europe/Berlin");
        assert_eq!(
            dues(&every, "2026-03-29T00:00:00Z", "2026-03-29T01:30:00Z"),
            ["2026-03-29T00:30:00Z", "2026-03-29T01:00:00Z", "2026-03-29T01:30:00Z"]
        );
    }

    /// Berlin falls back on 2026-10-25 at 03:00 CEST to 02:00 CET (01:00 UTC): a fixed 02:30
    /// fires once (the first pass, CEST); every 30 minutes fires in both passes.
    #[test]
    fn fall_back_in_berlin() {
        let fixed = sched("30 2 * * *", "Europe/Berlin");
        assert_eq!(
            dues(&fixed, "2026-10-24T12:00:00Z", "2026-10-26T12:00:00Z"),
            ["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]
        );
        let every = sched("*/30 * * * *", "Europe/Berlin");
        assert_eq!(
            dues(&every, "2026-10-24T23:45:00Z", "2026-10-25T02:00:00Z"),
            [
                "2026-10-25T00:00:00Z",
                "2026-10-25T00:30:00Z",
                "2026-10-25T01:00:00Z",
                "2026-10-25T01:30:00Z",
                "2026-10-25T02:00:00Z"
            ]
        );
        // A list or range in the hour/minute fields is not a fixed time: no fire in the gap,
        // fires in both passes of the repeated hour.
        let list = sched("0,30 2 * * *", "Europe/Berlin");
        assert_eq!(dues(&list, "2026-03-28T23:00:00Z", "2026-03-29T03:00:00Z"), [] as [&str; 0]);
        assert_eq!(
            dues(&list, "2026-10-24T23:00:00Z", "2026-10-25T03:00:00Z"),
            ["2026-10-25T00:00:00Z", "2026-10-25T00:30:00Z", "2026-10-25T01:00:00Z", "2026-10-25T01:30:00Z"]
        );
        let range = sched("0 2-3 * * *", "Europe/Berlin");
        assert_eq!(
            dues(&range, "2026-10-24T23:00:00Z", "2026-10-25T03:00:00Z"),
            ["2026-10-25T00:00:00Z", "2026-10-25T01:00:00Z", "2026-10-25T02:00:00Z"]
        );
    }

    /// New York falls back on 2026-11-01 at 02:00 EDT to 01:00 EST: a fixed 01:30 fires once,
    /// at 01:30 EDT (05:30 UTC); springs forward on 2026-03-08 at 02:00 EST to 03:00 EDT: a
    /// fixed 02:15 fires at 03:00 EDT (07:00 UTC).
    #[test]
    fn dst_in_new_york() {
        let fall = sched("30 1 * * *", "America/New_York");
        assert_eq!(
            dues(&fall, "2026-10-31T12:00:00Z", "2026-11-02T12:00:00Z"),
            ["2026-11-01T05:30:00Z", "2026-11-02T06:30:00Z"]
        );
        let spring = sched("15 2 * * *", "America/New_York");
        assert_eq!(
            dues(&spring, "2026-03-07T12:00:00Z", "2026-03-09T12:00:00Z"),
            ["2026-03-08T07:00:00Z", "2026-03-09T06:15:00Z"]
        );
    }

    #[test]
    fn seconds_field_and_utc() {
        let s = sched("*/2 * * * * *", "UTC");
        assert_eq!(
            dues(&s, "2026-01-01T00:00:00Z", "2026-01-01T00:00:05Z"),
            ["2026-01-01T00:00:02Z", "2026-01-01T00:00:04Z"]
        );
        assert_eq!(s.command_id("q", ms("2026-01-01T00:00:02Z")), "sched-q.s-1767225602000");
        assert_eq!(s.command_id("a b%.c", 1), "sched-a%20b%25.c.s-1");
        let s = sched("0 9 * * MON", "UTC");
        assert_eq!(
            dues(&s, "2026-01-01T00:00:00Z", "2026-01-13T00:00:00Z"),
            ["2026-01-05T09:00:00Z", "2026-01-12T09:00:00Z"]
        );
        assert_eq!(
            s.newest_due_times(ms("2026-01-01T00:00:00Z"), ms("2026-01-12T09:00:00Z"), 5)
                .into_iter()
                .map(utc)
                .collect::<Vec<_>>(),
            ["2026-01-05T09:00:00Z", "2026-01-12T09:00:00Z"]
        );
    }

    #[test]
    fn bad_parts_are_refused_by_name() {
        let e = |r: Result<Schedule, ScheduleError>| r.unwrap_err().to_string();
        assert_eq!(
            e(Schedule::new("a b", "* * * * *", "UTC", "t", serde_json::json!(null))),
            "name \"a b\": use 1 to 64 letters, digits, '_' or '-'"
        );
        assert!(e(Schedule::new("a", "61 * * * *", "UTC", "t", serde_json::json!(null)))
            .starts_with("cron \"61 * * * *\": "));
        assert!(e(Schedule::new("a", "* * * * * * 2030", "UTC", "t", serde_json::json!(null))).starts_with("cron "));
        // A pattern no date matches (30 February) would never fire: refused, not run silently.
        assert_eq!(
            e(Schedule::new("a", "0 0 30 2 *", "UTC", "t", serde_json::json!(null))),
            "cron \"0 0 30 2 *\": no date matches it; use 5 fields (minute hour day-of-month month day-of-week) or 6 with seconds first"
        );
        assert_eq!(
            e(Schedule::new("a", "* * * * *", "Mars/Olympus", "t", serde_json::json!(null))),
            "timezone \"Mars/Olympus\" is not a known IANA time zone (e.g. \"UTC\", \"Europe/Berlin\")"
        );
        let s = sched("* * * * *", "UTC");
        assert_eq!(s.clone().with_missed(Missed::RunAll, 0).unwrap_err(), ScheduleError::MaxCatchUp(0));
        assert_eq!(s.with_missed_after(Duration::from_millis(999)).unwrap_err(), ScheduleError::MissedAfter);
    }

    /// A `missed_after` of more ms than an i64 holds (1e16 s: humantime takes it) means nothing
    /// is ever late: an on-time due time fires (it was recorded missed: the ms wrapped negative).
    /// (CI once saw `[Fired, Skipped]` here: the sleep spanned two due times.)
    #[tokio::test]
    async fn a_huge_missed_after_never_makes_a_fire_late() {
        let store = CommandStore::memory();
        let s = sched("* * * * * *", "UTC").with_missed_after(Duration::from_secs(10_000_000_000_000_000)).unwrap();
        store.schedule_tick("q", &s, None).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let seen: Arc<std::sync::Mutex<Vec<FireResult>>> = Arc::default();
        let l = seen.clone();
        let obs: FireObserver = Arc::new(move |e: &FireEvent| l.lock().unwrap().push(e.result));
        store.schedule_tick("q", &s, Some(&obs)).await.unwrap();
        // 1.1 s holds one or two whole seconds (two when the first tick ran late in its
        // second): the first due time fires; a second finds that command still queued (no
        // consumer here) and is skipped by the default overlap rule. None is missed.
        let seen = seen.lock().unwrap().clone();
        assert!(seen == [FireResult::Fired] || seen == [FireResult::Fired, FireResult::Skipped], "{seen:?}");
    }

    /// A queue and name whose command ids would not be ids: refused before any decision.
    #[tokio::test]
    async fn a_tick_refuses_command_ids_over_200_characters() {
        let store = CommandStore::memory();
        let q = "q".repeat(130);
        let s = Schedule::new(&"n".repeat(64), "* * * * * *", "UTC", "t", serde_json::json!({})).unwrap();
        let e = store.schedule_tick(&q, &s, None).await.unwrap_err();
        assert!(matches!(e, CommandError::InvalidId(_)), "{e:?}");
        assert_eq!(store.schedule_record(&q, s.name()).await.unwrap(), None);
    }

    /// Two deciders that read the same record: only the first compare-and-set writes (the
    /// memory backend; the Redis script is exercised by the schedule tests in tests/).
    #[tokio::test]
    async fn memory_compare_and_set_lets_one_decider_win() {
        let store = CommandStore::memory();
        let b = &store.inner.backend;
        assert!(b.schedule_cas("q", "s", None, "a").await.unwrap());
        assert!(!b.schedule_cas("q", "s", None, "b").await.unwrap());
        let (seen, _) = b.schedule_read("q", "s").await.unwrap();
        assert_eq!(seen.as_deref(), Some("a"));
        assert!(b.schedule_cas("q", "s", Some("a"), "c").await.unwrap());
        assert!(!b.schedule_cas("q", "s", Some("a"), "d").await.unwrap());
        assert_eq!(b.schedule_read("q", "s").await.unwrap().0.as_deref(), Some("c"));
        assert_eq!(b.schedule_read("q", "other").await.unwrap().0, None);
    }
}
