//! Per-minute aggregates of a queue's work, kept in the backend (on Redis, shared by every
//! process: each one's work counts in every one's console), for the last
//! [`MINUTES_KEPT`] minutes. Read with [`CommandStore::minutes`](crate::CommandStore::minutes).
//!
//! Per home queue and UTC minute (by the backend's clock: Redis's `TIME` in the scripts):
//!
//! * **counts**, written by the same atomic step as the transition they count: `succeeded`,
//!   `failed`, `cancelled` (a command's first terminal write, whoever made it: a handler's
//!   result, a cancel, a bulk action; a re-run's later end counts again), `retried` (a handler
//!   error with a retry scheduled);
//! * **handler durations**: a histogram ([`BOUNDS_MS`]) of the handler calls whose outcome was
//!   counted: from the start of the `execute` call to its outcome; for work that ended in a
//!   `check_status` call (long work polled while `RUNNING`), from the command's `started_at`
//!   (the work's start) to that outcome. A cancel from outside (no handler returned it) has no
//!   duration. Percentiles ([`MinuteStats::duration_p50_ms`]…) are computed from the buckets, so
//!   minutes merge exactly;
//! * **depth** and **oldest age**, sampled once a minute by the first process that samples
//!   (every [`CommandService`](crate::CommandService) samples its queue about once a minute, as
//!   does a [`MinuteSampler`]; later samples of the same minute are ignored): depth is the number of the queue's
//!   commands *waiting*, i.e. with status `SUBMITTED` (accepted, no handler outcome written yet:
//!   not delivered, waiting for a free handler, or in their first `execute` call); oldest age is
//!   the time since the oldest of them was submitted (its `created_at`), ms. Minutes no process
//!   sampled have none (`null`).
//!
//! Storage (Redis): one hash per home queue, `<prefix>:cmd:{<queue>}:minutes`, a ring of
//! [`MINUTES_KEPT`] slots (`minute mod MINUTES_KEPT`), fields `<slot>:<name>`: `m` the minute
//! the slot holds (ms since the epoch / 60,000), `s`, `f`, `c`, `r` the counts, `d0`…`d21` the
//! duration buckets, `q` the depth and `a` the oldest age. The first write of a new minute to a
//! slot clears it (and sets the hash's expiry to the ring's span, so an idle queue's hash goes
//! away). A terminal write costs one `HGET` and two `HINCRBY` (a batch of writes: one `HGET` and
//! one `HINCRBY` per distinct field).

use serde::Serialize;

use crate::{CommandState, CommandStatus, Timestamp};

/// Upper bounds (exclusive, ms) of the handler-duration buckets: a 1-2-5 series, three buckets
/// per decade, from 1 ms to 5,000 s. Bucket `i` counts durations `d` with
/// `BOUNDS_MS[i - 1] <= d < BOUNDS_MS[i]` (`0 <= d < 1` for bucket 0); the last bucket
/// (index [`BOUNDS_MS`]`.len()`) counts durations of 5,000 s and more. `scripts/lib.lua` holds
/// the same list (a test checks).
pub const BOUNDS_MS: [u64; 21] = [
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000,
    1_000_000, 2_000_000, 5_000_000,
];

/// Number of duration buckets: [`BOUNDS_MS`] and one for longer durations.
pub const BUCKETS: usize = BOUNDS_MS.len() + 1;

/// Minutes kept per queue (the ring's slots, `scripts/lib.lua`'s `MIN_SLOTS`): the most
/// [`CommandStore::minutes`](crate::CommandStore::minutes) returns.
pub const MINUTES_KEPT: usize = 120;

/// One minute of a queue's work ([`CommandStore::minutes`](crate::CommandStore::minutes)).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MinuteStats {
    /// The minute's start (UTC, a whole minute).
    pub minute: Timestamp,
    /// Commands that ended `SUCCEEDED` in this minute.
    pub succeeded: u64,
    /// Commands that ended `FAILED`.
    pub failed: u64,
    /// Commands that ended `CANCELLED`.
    pub cancelled: u64,
    /// Handler errors with a retry scheduled.
    pub retried: u64,
    /// Handler durations per bucket ([`BUCKETS`] counts, bounds [`BOUNDS_MS`]).
    pub durations: Vec<u64>,
    /// Median handler duration, ms, interpolated within its bucket; `null` without durations.
    pub duration_p50_ms: Option<f64>,
    /// 90th percentile, ms (as `duration_p50_ms`).
    pub duration_p90_ms: Option<f64>,
    /// 99th percentile, ms (as `duration_p50_ms`).
    pub duration_p99_ms: Option<f64>,
    /// Commands waiting (`SUBMITTED`) at the minute's sample; `null` when none was taken.
    pub depth: Option<u64>,
    /// Age of the oldest waiting command at the sample, ms (0 with none waiting); `null` when no
    /// sample was taken.
    pub oldest_age_ms: Option<u64>,
}

impl MinuteStats {
    /// A minute with nothing recorded, starting at `minute` (minutes since the epoch).
    pub fn empty(minute: u64) -> Self {
        MinuteStats {
            minute: Timestamp::from_millis(minute * 60_000),
            succeeded: 0,
            failed: 0,
            cancelled: 0,
            retried: 0,
            durations: vec![0; BUCKETS],
            duration_p50_ms: None,
            duration_p90_ms: None,
            duration_p99_ms: None,
            depth: None,
            oldest_age_ms: None,
        }
    }

    /// Fills in the percentiles from `durations`.
    pub(crate) fn finish(mut self) -> Self {
        self.duration_p50_ms = percentile(&self.durations, 0.5);
        self.duration_p90_ms = percentile(&self.durations, 0.9);
        self.duration_p99_ms = percentile(&self.durations, 0.99);
        self
    }
}

/// The `q` quantile (0 to 1) of the durations counted in `buckets` (bounds [`BOUNDS_MS`]), ms:
/// linear within the bucket it falls in; the lower bound for the last (open) bucket; `None`
/// when nothing was counted.
pub fn percentile(buckets: &[u64], q: f64) -> Option<f64> {
    let total: u64 = buckets.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut before = 0u64;
    for (i, &c) in buckets.iter().enumerate() {
        if c > 0 && (before + c) as f64 >= rank {
            let lo = if i == 0 { 0.0 } else { BOUNDS_MS[i - 1] as f64 };
            let Some(&hi) = BOUNDS_MS.get(i) else { return Some(lo) };
            return Some(lo + (hi as f64 - lo) * ((rank - before as f64) / c as f64).clamp(0.0, 1.0));
        }
        before += c;
    }
    None
}

/// The bucket of a duration of `ms`.
pub fn bucket_of(ms: u64) -> usize {
    BOUNDS_MS.iter().position(|&b| ms < b).unwrap_or(BOUNDS_MS.len())
}

/// What a transition counts: the counter's field (`s`, `f`, `c`, `r`) and the start of the
/// handler call it is the outcome of (ms), if a handler's.
pub(crate) fn mark_of(old: CommandStatus, new: &CommandState) -> Option<(&'static str, Option<u64>)> {
    let start = new.attempt_start.0;
    let field = match new.status {
        _ if old.is_terminal() => return None,
        CommandStatus::Succeeded => "s",
        CommandStatus::Failed => "f",
        CommandStatus::Cancelled => "c",
        _ if start.is_some() && new.errors_count > 0 => "r",
        _ => return None,
    };
    Some((field, start))
}

/// Storage bookkeeping of a state being written by a handler call's outcome: when the call (or
/// the work, for `check_status`) started, ms. Not stored; any two compare equal.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AttemptStart(pub Option<u64>);

impl PartialEq for AttemptStart {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Samples a queue's depth and oldest age into its per-minute aggregates about once a minute
/// ([`CommandStore::minute_sampler`](crate::CommandStore::minute_sampler)) until stopped or
/// dropped.
pub struct MinuteSampler(tokio::task::AbortHandle);

impl MinuteSampler {
    /// How often the sampler looks whether the minute changed since its last sample.
    pub const CHECK_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

    pub(crate) fn spawn(store: crate::CommandStore, queue: String) -> Self {
        MinuteSampler(tokio::spawn(sample_minutes(store, queue)).abort_handle())
    }

    /// Stops sampling.
    pub fn stop(&self) {
        self.0.abort();
    }
}

impl Drop for MinuteSampler {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Samples once per minute of this process's clock (the first process to sample a minute is
/// kept); a failed sample is tried again at the next check.
async fn sample_minutes(store: crate::CommandStore, queue: String) {
    let mut done = None;
    loop {
        let minute = minute_of(Timestamp::now().millis());
        if done != Some(minute) {
            match store.sample_minute(&queue).await {
                Ok(_) => done = Some(minute),
                Err(e) => tracing::debug!(queue = %queue, error = %e, "per-minute depth sample failed"),
            }
        }
        tokio::time::sleep(MinuteSampler::CHECK_EVERY).await;
    }
}

/// The current minute (since the epoch) at `ms`.
pub(crate) fn minute_of(ms: u64) -> u64 {
    ms / 60_000
}

/// The last `last` minutes ending with the one of `now_ms`, oldest first, from `get`: a minute's
/// record if one is kept (missing minutes: [`MinuteStats::empty`]).
fn window(now_ms: u64, last: usize, mut get: impl FnMut(u64) -> Option<MinuteStats>) -> Vec<MinuteStats> {
    let now = minute_of(now_ms);
    let first = now.saturating_sub(last.saturating_sub(1) as u64);
    (first..=now).map(|m| get(m).unwrap_or_else(|| MinuteStats::empty(m)).finish()).collect()
}

/// The memory backend's aggregates of one queue: minute → its record.
#[derive(Default)]
pub(crate) struct MemoryMinutes {
    by_minute: std::collections::BTreeMap<u64, MinuteStats>,
}

impl MemoryMinutes {
    fn at(&mut self, now_ms: u64) -> &mut MinuteStats {
        let m = minute_of(now_ms);
        let keep_from = m.saturating_sub(MINUTES_KEPT as u64 - 1);
        while self.by_minute.first_key_value().is_some_and(|(k, _)| *k < keep_from) {
            self.by_minute.pop_first();
        }
        self.by_minute.entry(m).or_insert_with(|| MinuteStats::empty(m))
    }

    /// Counts a transition ([`mark_of`]) at `now_ms`.
    pub fn count(&mut self, now_ms: u64, field: &str, start: Option<u64>) {
        let r = self.at(now_ms);
        match field {
            "s" => r.succeeded += 1,
            "f" => r.failed += 1,
            "c" => r.cancelled += 1,
            _ => r.retried += 1,
        }
        if let Some(start) = start {
            r.durations[bucket_of(now_ms.saturating_sub(start))] += 1;
        }
    }

    /// Whether the minute of `now_ms` has its sample.
    pub fn sampled(&self, now_ms: u64) -> bool {
        self.by_minute.get(&minute_of(now_ms)).is_some_and(|r| r.depth.is_some())
    }

    /// Keeps the sample unless the minute has one; true when kept.
    pub fn sample(&mut self, now_ms: u64, depth: u64, oldest_age_ms: u64) -> bool {
        let r = self.at(now_ms);
        if r.depth.is_some() {
            return false;
        }
        r.depth = Some(depth);
        r.oldest_age_ms = Some(oldest_age_ms);
        true
    }

    pub fn read(&self, now_ms: u64, last: usize) -> Vec<MinuteStats> {
        window(now_ms, last, |m| self.by_minute.get(&m).cloned())
    }
}

/// The records of the Redis hash's fields (`HGETALL`, see the module docs) for the last `last`
/// minutes ending with the one of `now_ms`.
pub(crate) fn from_hash(
    now_ms: u64,
    last: usize,
    fields: &std::collections::HashMap<String, String>,
) -> Vec<MinuteStats> {
    let num = |slot: u64, name: &str| fields.get(&format!("{slot}:{name}")).and_then(|v| v.parse::<u64>().ok());
    window(now_ms, last, |m| {
        let slot = m % MINUTES_KEPT as u64;
        if num(slot, "m") != Some(m) {
            return None;
        }
        let mut r = MinuteStats::empty(m);
        r.succeeded = num(slot, "s").unwrap_or(0);
        r.failed = num(slot, "f").unwrap_or(0);
        r.cancelled = num(slot, "c").unwrap_or(0);
        r.retried = num(slot, "r").unwrap_or(0);
        for (i, d) in r.durations.iter_mut().enumerate() {
            *d = num(slot, &format!("d{i}")).unwrap_or(0);
        }
        r.depth = num(slot, "q");
        r.oldest_age_ms = num(slot, "a");
        Some(r)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_where_the_docs_say() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1), 1);
        assert_eq!(bucket_of(4), 2);
        assert_eq!(bucket_of(5), 3);
        assert_eq!(bucket_of(3_000), 11);
        assert_eq!(bucket_of(4_999_999), 20);
        assert_eq!(bucket_of(5_000_000), 21);
        assert_eq!(bucket_of(u64::MAX), 21);
    }

    #[test]
    fn percentiles_interpolate_within_buckets() {
        let mut b = vec![0; BUCKETS];
        assert_eq!(percentile(&b, 0.5), None);
        // 10 durations in [100, 200): the median is half way.
        b[bucket_of(150)] = 10;
        assert_eq!(percentile(&b, 0.5), Some(150.0));
        assert_eq!(percentile(&b, 0.9), Some(190.0));
        // One more, open-ended: the 99th percentile falls in it and is its lower bound.
        b[BUCKETS - 1] = 1;
        assert_eq!(percentile(&b, 0.99), Some(5_000_000.0));
    }

    #[test]
    fn memory_keeps_the_last_120_minutes() {
        let m0 = 29_000_000u64; // a minute since the epoch
        let at = |m: u64, s: u64| m * 60_000 + s * 1_000;
        let mut mem = MemoryMinutes::default();
        mem.count(at(m0, 10), "s", Some(at(m0, 10) - 300));
        mem.count(at(m0, 50), "f", None);
        assert!(mem.sample(at(m0, 55), 4, 9_000));
        assert!(!mem.sample(at(m0, 59), 5, 1));
        let r = mem.read(at(m0, 59), 2);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0], MinuteStats::empty(m0 - 1));
        let mut want = MinuteStats::empty(m0);
        (want.succeeded, want.failed, want.depth, want.oldest_age_ms) = (1, 1, Some(4), Some(9_000));
        want.durations[bucket_of(300)] = 1;
        assert_eq!(r[1], want.clone().finish());
        // 119 minutes later it is still kept; one more and it is gone.
        let last = MINUTES_KEPT as u64 - 1;
        mem.count(at(m0 + last, 0), "c", None);
        assert_eq!(mem.read(at(m0 + last, 1), MINUTES_KEPT)[0], want.clone().finish());
        mem.count(at(m0 + last + 1, 0), "c", None);
        assert!(mem.by_minute.keys().all(|&k| k > m0), "minute {m0} dropped");
    }

    #[test]
    fn a_redis_slot_holding_another_minute_reads_as_zeros() {
        let m = 29_000_000u64;
        let slot = m % MINUTES_KEPT as u64;
        let mut fields: std::collections::HashMap<String, String> =
            [("m", m - MINUTES_KEPT as u64), ("s", 5), ("d3", 2), ("q", 7)]
                .into_iter()
                .map(|(k, v)| (format!("{slot}:{k}"), v.to_string()))
                .collect();
        assert_eq!(from_hash(m * 60_000, 1, &fields), vec![MinuteStats::empty(m)]);
        fields.insert(format!("{slot}:m"), m.to_string());
        let mut want = MinuteStats::empty(m);
        (want.succeeded, want.depth) = (5, Some(7));
        want.durations[3] = 2;
        assert_eq!(from_hash(m * 60_000 + 59_999, 1, &fields), vec![want.finish()]);
    }

    #[test]
    fn lib_lua_has_the_same_bounds_and_slots() {
        let lib = include_str!("../scripts/lib.lua");
        let bounds = BOUNDS_MS.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(", ");
        assert!(lib.contains(&format!("local MIN_BOUNDS = {{ {bounds} }}")), "scripts/lib.lua's MIN_BOUNDS differ");
        assert!(lib.contains(&format!("local MIN_SLOTS = {MINUTES_KEPT}\n")), "scripts/lib.lua's MIN_SLOTS differ");
    }
}
