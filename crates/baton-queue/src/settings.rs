//! Consumer settings and their validation.

use std::time::Duration;

use crate::QueueError;

/// Settings of one consumer (one `consume` call). Build with [`ConsumerOptions::new`] and the
/// `with_*` methods; [`ConsumerOptions::validate`] runs when the consumer starts.
#[derive(Clone, Debug)]
pub struct ConsumerOptions {
    /// Handlers running at once (≥ 1). Default 16.
    pub concurrency: usize,
    /// The failover window: an entry whose consumer has not renewed it (nor written its liveness
    /// record) for this long — a dead, stopped or partitioned consumer — is taken over by another
    /// one. A live consumer renews every `heartbeat_interval`, whatever its handlers do. Default
    /// 30 s; at least 100 ms, at most [`MAX_CLAIM_TIMEOUT`](crate::MAX_CLAIM_TIMEOUT) (1 day).
    pub claim_timeout: Duration,
    /// How often running handlers' leases are renewed. Default `claim_timeout / 3`; must be at
    /// most `claim_timeout / 2` so one late tick does not lose a lease.
    pub heartbeat_interval: Option<Duration>,
    /// A handler running longer loses its lease: renewal stops, the entry is made reclaimable at
    /// once, the handler's lost-lease signal fires, a warning and the metric
    /// `baton_queue_leases_expired_total` are emitted. The handler is not killed. Default 15 min.
    pub max_processing_time: Duration,
    /// Deliveries after which a message goes to the dead-letter stream instead of its handler.
    /// `None`: unlimited. Default `Some(10)`.
    pub max_deliveries: Option<u32>,
    /// Cadence of reclaiming idle entries and of promoting due delayed ones; also the longest
    /// BLOCK of one read. Default `min(heartbeat_interval, 1 s)`.
    pub poll_interval: Option<Duration>,
    /// Other consumers of the group that own no pending entry and whose liveness record (their
    /// heartbeat, not `XINFO`'s idle time) is this old are removed (checked atomically by a
    /// script, every quarter of this). `None`: never. Default 1 h; at least twice
    /// `claim_timeout`.
    pub reap_idle_consumers_after: Option<Duration>,
    /// Prefix of the consumer name; the name is `<prefix>-<uuid v7>`, unique per incarnation.
    /// Default `baton`.
    pub consumer_prefix: String,
    /// The most entries pending in the queue's group at once, across every consumer and process
    /// (≥ 1): a consumer's gated read takes new entries only while fewer are pending. Pending
    /// means running, handed back and waiting for a reclaim, or waiting for a short `RetryAfter`
    /// re-poll: all of them count. Decided atomically with the take (in `read.lua` on Redis). The
    /// cap is the reading consumer's: consumers of one queue should agree on it. `None`: no cap
    /// (default).
    pub max_concurrency: Option<u32>,
    /// The most entries of one concurrency key (offered with
    /// [`OfferOptions::concurrency_key`](crate::OfferOptions::concurrency_key)) holding a slot at
    /// once, across every consumer and process (≥ 1). Other entries of the key wait in the key's
    /// waiting line (not pending, not in the stream) and start in offer order as slots free.
    /// Entries without a key are not limited by it. `None`: no cap (default).
    pub concurrency_per_key: Option<u32>,
    /// The queue's rate limit: new entries are taken at most at this rate by all of the queue's
    /// consumers together (checked in the same atomic step that takes them). `None` (default):
    /// no limit. Every consumer of a queue should be given the same limit: each read applies its
    /// consumer's to the queue's one shared state. See [`RateLimit`].
    pub rate_limit: Option<RateLimit>,
    /// A rate limit per concurrency key (the key offered with
    /// [`OfferOptions::concurrency_key`](crate::OfferOptions::concurrency_key)): new entries of
    /// one key are taken at most at this rate by all of the queue's consumers together, each key
    /// with a bucket of its own (GCRA, as [`RateLimit`]). An entry over its key's rate does not
    /// hold back other keys' entries and is never pending while it waits: it moves to the queue's
    /// delayed set (the first as the key's head, due when its key's bucket admits it; later ones
    /// parked behind it, in offer order), and is promoted when due; a key's entries start in
    /// offer order. Charged when taken, so it spaces starts, even after a spell in which every
    /// consumer was busy. Checked after [`ConsumerOptions::concurrency_per_key`]: an entry
    /// waiting for a slot of its key is not charged, and one that got a slot but not its rate
    /// keeps the slot while it waits. Entries without a key are not limited by it. `None` (default): no limit. Every consumer
    /// of a queue should be given the same limit.
    pub rate_limit_per_key: Option<RateLimit>,
}

/// A queue's rate limit: at most `limit` new entries per `per`, with bursts of up to `burst`
/// entries after an idle spell, enforced with GCRA (the generic cell rate algorithm: a token
/// bucket of `burst` tokens refilled at `limit / per`) over all consumers of the queue together.
///
/// Entries are taken one emission interval `T = per / limit` apart on average; up to `burst`
/// may be taken at once when the queue was under its rate before (burst tolerance
/// `(burst − 1) · T`). Over any window `w` at most `w / T + burst` entries are taken. State:
/// one key in the queue's slot on Redis ([`crate::keys::rate`], Redis time), under the queue's
/// lock in memory. It gates NEW entries only: reclaims of dead consumers' entries and
/// redeliveries (`Retry`, `RetryAfter`, `RateLimited`) do not pass it and are not counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    /// Entries per `per`, at least 1.
    pub limit: u32,
    /// The period, at least 1 ms; `per / limit` must be at least 1 µs (1,000,000 entries per s).
    pub per: Duration,
    /// Entries that may be taken at once (the bucket's size), at least 1. [`RateLimit::new`]
    /// sets it to `limit` (a full period's worth).
    pub burst: u32,
}

impl RateLimit {
    /// `limit` entries per `per`, with a burst of `limit`.
    pub fn new(limit: u32, per: Duration) -> Self {
        Self { limit, per, burst: limit }
    }

    /// The same limit with another burst.
    pub fn with_burst(mut self, burst: u32) -> Self {
        self.burst = burst;
        self
    }

    /// The emission interval `per / limit`.
    pub fn interval(&self) -> Duration {
        self.per / self.limit.max(1)
    }

    /// The burst tolerance `(burst − 1) · per / limit`.
    pub fn tolerance(&self) -> Duration {
        self.interval() * self.burst.saturating_sub(1)
    }

    /// Checks the ranges above; the error says which field (of `rate_limit`) and what is
    /// allowed.
    pub fn validate(&self) -> Result<(), QueueError> {
        self.validate_as("rate_limit")
    }

    /// [`RateLimit::validate`] of the setting named `name` (`rate_limit`, `rate_limit_per_key`):
    /// the errors start with it.
    pub fn validate_as(&self, name: &str) -> Result<(), QueueError> {
        let bad = |m: String| Err(QueueError::InvalidSettings(m));
        if self.limit == 0 {
            return bad(format!("{name}.limit must be at least 1"));
        }
        if self.per < Duration::from_millis(1) {
            return bad(format!("{name}.per must be at least 1ms (got {:?})", self.per));
        }
        if self.interval() < Duration::from_micros(1) {
            return bad(format!(
                "{name} {} per {:?} is above 1000000 per second, the highest rate allowed",
                self.limit, self.per
            ));
        }
        if self.burst == 0 {
            return bad(format!("{name}.burst must be at least 1"));
        }
        Ok(())
    }
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        Self {
            concurrency: 16,
            claim_timeout: Duration::from_secs(30),
            heartbeat_interval: None,
            max_processing_time: Duration::from_secs(15 * 60),
            max_deliveries: Some(10),
            poll_interval: None,
            reap_idle_consumers_after: Some(Duration::from_secs(3600)),
            consumer_prefix: "baton".to_string(),
            rate_limit: None,
            rate_limit_per_key: None,
            max_concurrency: None,
            concurrency_per_key: None,
        }
    }
}

impl ConsumerOptions {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn with_concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }
    pub fn with_claim_timeout(mut self, d: Duration) -> Self {
        self.claim_timeout = d;
        self
    }
    pub fn with_heartbeat_interval(mut self, d: Duration) -> Self {
        self.heartbeat_interval = Some(d);
        self
    }
    pub fn with_max_processing_time(mut self, d: Duration) -> Self {
        self.max_processing_time = d;
        self
    }
    pub fn with_max_deliveries(mut self, n: Option<u32>) -> Self {
        self.max_deliveries = n;
        self
    }
    pub fn with_poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = Some(d);
        self
    }
    pub fn with_reap_idle_consumers_after(mut self, d: Option<Duration>) -> Self {
        self.reap_idle_consumers_after = d;
        self
    }
    pub fn with_max_concurrency(mut self, n: Option<u32>) -> Self {
        self.max_concurrency = n;
        self
    }
    pub fn with_concurrency_per_key(mut self, n: Option<u32>) -> Self {
        self.concurrency_per_key = n;
        self
    }
    pub fn with_consumer_prefix(mut self, p: impl Into<String>) -> Self {
        self.consumer_prefix = p.into();
        self
    }

    /// Sets (or, with `None`, removes) the queue's rate limit ([`RateLimit`]).
    pub fn with_rate_limit(mut self, r: Option<RateLimit>) -> Self {
        self.rate_limit = r;
        self
    }

    /// Sets (or, with `None`, removes) the queue's rate limit per concurrency key
    /// ([`ConsumerOptions::rate_limit_per_key`]).
    pub fn with_rate_limit_per_key(mut self, r: Option<RateLimit>) -> Self {
        self.rate_limit_per_key = r;
        self
    }

    /// The effective heartbeat interval.
    pub fn heartbeat(&self) -> Duration {
        self.heartbeat_interval.unwrap_or(self.claim_timeout / 3)
    }

    /// The effective poll interval.
    pub fn poll(&self) -> Duration {
        self.poll_interval.unwrap_or_else(|| self.heartbeat().min(Duration::from_secs(1)))
    }

    /// Checks every rule above; the error names the setting and the allowed range.
    pub fn validate(&self) -> Result<(), QueueError> {
        let bad = |m: String| Err(QueueError::InvalidSettings(m));
        if self.concurrency == 0 {
            return bad("concurrency must be at least 1".into());
        }
        if self.concurrency > 100_000 {
            return bad(format!("concurrency {} is above the limit of 100000", self.concurrency));
        }
        if self.claim_timeout < Duration::from_millis(100) {
            return bad(format!("claim_timeout must be at least 100ms (got {:?})", self.claim_timeout));
        }
        if self.claim_timeout > crate::MAX_CLAIM_TIMEOUT {
            return bad(format!("claim_timeout must be at most 1 day (got {:?})", self.claim_timeout));
        }
        let hb = self.heartbeat();
        if hb.is_zero() {
            return bad("heartbeat_interval must be above zero".into());
        }
        if hb > self.claim_timeout / 2 {
            return bad(format!(
                "heartbeat_interval ({hb:?}) must be at most half of claim_timeout ({:?}); the default is a third",
                self.claim_timeout
            ));
        }
        if self.max_processing_time <= hb {
            return bad(format!(
                "max_processing_time ({:?}) must be longer than heartbeat_interval ({hb:?})",
                self.max_processing_time
            ));
        }
        if self.max_deliveries == Some(0) {
            return bad("max_deliveries must be at least 1 (or None for unlimited)".into());
        }
        let poll = self.poll();
        if poll < Duration::from_millis(10) {
            return bad(format!("poll_interval must be at least 10ms (got {poll:?})"));
        }
        if poll > self.claim_timeout {
            return bad(format!("poll_interval ({poll:?}) must not exceed claim_timeout ({:?})", self.claim_timeout));
        }
        if let Some(r) = self.reap_idle_consumers_after {
            if r < self.claim_timeout * 2 {
                return bad(format!(
                    "reap_idle_consumers_after ({r:?}) must be at least twice claim_timeout ({:?})",
                    self.claim_timeout
                ));
            }
        }
        validate_caps(self.max_concurrency, self.concurrency_per_key)?;
        if self.consumer_prefix.is_empty()
            || self.consumer_prefix.len() > 100
            || self.consumer_prefix.chars().any(|c| c.is_control() || c.is_whitespace())
        {
            return bad(format!(
                "consumer_prefix {:?} must be 1 to 100 characters without spaces",
                self.consumer_prefix
            ));
        }
        if let Some(r) = &self.rate_limit {
            r.validate()?;
        }
        if let Some(r) = &self.rate_limit_per_key {
            r.validate_as("rate_limit_per_key")?;
        }
        Ok(())
    }
}

/// `max_concurrency` and `concurrency_per_key`: at least 1 when set.
pub(crate) fn validate_caps(max_concurrency: Option<u32>, per_key: Option<u32>) -> Result<(), QueueError> {
    if max_concurrency == Some(0) {
        return Err(QueueError::InvalidSettings("max_concurrency must be at least 1 (or None for no cap)".into()));
    }
    if per_key == Some(0) {
        return Err(QueueError::InvalidSettings("concurrency_per_key must be at least 1 (or None for no cap)".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        let o = ConsumerOptions::new();
        o.validate().unwrap();
        assert_eq!(o.heartbeat(), Duration::from_secs(10));
        assert_eq!(o.poll(), Duration::from_secs(1));
        assert_eq!(o.rate_limit, None);
    }

    #[test]
    fn rate_limit_interval_and_tolerance() {
        let r = RateLimit::new(1000, Duration::from_secs(1));
        assert_eq!(r.burst, 1000);
        assert_eq!(r.interval(), Duration::from_millis(1));
        assert_eq!(r.tolerance(), Duration::from_millis(999));
        let r = RateLimit::new(50, Duration::from_secs(1)).with_burst(1);
        assert_eq!(r.interval(), Duration::from_millis(20));
        assert_eq!(r.tolerance(), Duration::ZERO);
        r.validate().unwrap();
    }

    #[test]
    fn rejects_bad_settings_with_clear_messages() {
        let cases: Vec<(ConsumerOptions, &str)> = vec![
            (ConsumerOptions::new().with_concurrency(0), "concurrency must be at least 1"),
            (ConsumerOptions::new().with_claim_timeout(Duration::ZERO), "claim_timeout must be at least 100ms"),
            (ConsumerOptions::new().with_claim_timeout(Duration::MAX), "claim_timeout must be at most 1 day"),
            (
                ConsumerOptions::new().with_claim_timeout(Duration::from_secs(86_401)),
                "claim_timeout must be at most 1 day (got 86401s)",
            ),
            (
                ConsumerOptions::new().with_heartbeat_interval(Duration::from_secs(20)),
                "must be at most half of claim_timeout",
            ),
            (ConsumerOptions::new().with_heartbeat_interval(Duration::ZERO), "above zero"),
            (ConsumerOptions::new().with_max_processing_time(Duration::from_secs(1)), "max_processing_time"),
            (ConsumerOptions::new().with_max_deliveries(Some(0)), "max_deliveries"),
            (ConsumerOptions::new().with_poll_interval(Duration::from_millis(1)), "poll_interval"),
            (ConsumerOptions::new().with_consumer_prefix("a b"), "consumer_prefix"),
            (ConsumerOptions::new().with_max_concurrency(Some(0)), "max_concurrency must be at least 1"),
            (ConsumerOptions::new().with_concurrency_per_key(Some(0)), "concurrency_per_key must be at least 1"),
            (
                ConsumerOptions::new().with_reap_idle_consumers_after(Some(Duration::from_secs(1))),
                "reap_idle_consumers_after",
            ),
            (
                ConsumerOptions::new().with_rate_limit(Some(RateLimit::new(0, Duration::from_secs(1)))),
                "rate_limit.limit must be at least 1",
            ),
            (
                ConsumerOptions::new().with_rate_limit(Some(RateLimit::new(1, Duration::ZERO))),
                "rate_limit.per must be at least 1ms",
            ),
            (
                ConsumerOptions::new().with_rate_limit(Some(RateLimit::new(2_000_000, Duration::from_secs(1)))),
                "above 1000000 per second",
            ),
            (
                ConsumerOptions::new().with_rate_limit(Some(RateLimit::new(5, Duration::from_secs(1)).with_burst(0))),
                "rate_limit.burst must be at least 1",
            ),
            (
                ConsumerOptions::new().with_rate_limit_per_key(Some(RateLimit::new(0, Duration::from_secs(1)))),
                "rate_limit_per_key.limit must be at least 1",
            ),
            (
                ConsumerOptions::new().with_rate_limit_per_key(Some(RateLimit::new(1, Duration::ZERO))),
                "rate_limit_per_key.per must be at least 1ms (got 0ns)",
            ),
            (
                ConsumerOptions::new().with_rate_limit_per_key(Some(RateLimit::new(2_000_000, Duration::from_secs(1)))),
                "rate_limit_per_key 2000000 per 1s is above 1000000 per second, the highest rate allowed",
            ),
            (
                ConsumerOptions::new()
                    .with_rate_limit_per_key(Some(RateLimit::new(5, Duration::from_secs(1)).with_burst(0))),
                "rate_limit_per_key.burst must be at least 1",
            ),
        ];
        for (o, needle) in cases {
            let err = o.validate().unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
    }
}
