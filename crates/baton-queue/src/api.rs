//! Public types of the work queue: ids, handler decisions, deliveries, stats, errors.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// The id of a message in a queue: `<ms>-<seq>`, the Redis Stream entry id format
/// (Redis docs, "Streams: entry IDs"). Ordered by time of offer, then by sequence.
///
/// A message redelivered through [`Decision::RetryAfter`] with a delay longer than the claim
/// timeout is re-offered under a new id (its delivery count is carried over). While a queue holds
/// new entries of a priority other than 0 ([`OfferOptions::priority`]), its new entries, of any
/// priority, are delivered under a later id than the one their offer returned (on Redis: the
/// gated read appends them again in priority order; the memory backend does the same).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MessageId {
    pub ms: u64,
    pub seq: u64,
}

impl MessageId {
    pub const ZERO: MessageId = MessageId { ms: 0, seq: 0 };
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

impl FromStr for MessageId {
    type Err = QueueError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || QueueError::InvalidMessageId(s.to_string());
        let (ms, seq) = s.split_once('-').ok_or_else(bad)?;
        Ok(MessageId { ms: ms.parse().map_err(|_| bad())?, seq: seq.parse().map_err(|_| bad())? })
    }
}

impl Serialize for MessageId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MessageId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The longest delay a [`Decision::RetryAfter`] or [`Decision::RateLimited`] (and
/// [`RemoteConsumer::retry_after`](crate::RemoteConsumer::retry_after) /
/// [`RemoteConsumer::rate_limited`](crate::RemoteConsumer::rate_limited)) takes: 10 years
/// (315,360,000 s). A longer one (say `Duration::MAX`, from a `Retry-After` parsed into a huge
/// number) is taken as this one, which every backend can keep: Redis `SET … PX` and the delayed
/// set's ms scores, the process's monotonic clock.
pub const MAX_DELAY: Duration = Duration::from_secs(315_360_000);

/// The longest [`ConsumerOptions::claim_timeout`](crate::ConsumerOptions::claim_timeout) (and
/// [`RemoteOptions::claim_timeout`](crate::RemoteOptions::claim_timeout)): 1 day. The claim
/// timeout is the failover window of a dead consumer, not a bound on a handler's run (a live
/// consumer's leases are renewed whatever its handlers do); a longer one (say `Duration::MAX`)
/// would overflow the process's clock arithmetic.
pub const MAX_CLAIM_TIMEOUT: Duration = Duration::from_secs(86_400);

/// What a handler decided about a delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Done: the entry is acknowledged and deleted in one atomic step (XACK + XDEL in a script).
    /// Refused if this consumer no longer owns the entry.
    Ack,
    /// Not done: hand the entry back, unleased (to the group's reserved `~parked` owner). Any
    /// consumer of the queue takes it once it has been idle for `claim_timeout` (counts as a
    /// delivery towards `max_deliveries`).
    Retry,
    /// Not done yet, by plan: deliver again after this delay, whatever the claim timeout. A
    /// scheduled re-poll, not a failure: it does not count toward `max_deliveries` (the next
    /// [`Delivery::deliveries`](crate::Delivery::deliveries) is the same number). At most
    /// [`MAX_DELAY`] (a longer delay is taken as that). Below `claim_timeout` the entry stays leased
    /// by this consumer (renewed, no concurrency slot taken) and is redelivered here from a local
    /// timer, with no Redis call (if the consumer stops first it hands the entry back, due at the
    /// same time; if it dies, another consumer takes it after `claim_timeout`). From
    /// `claim_timeout` up, the entry waits in the queue's delayed set and is re-offered under a
    /// new id when due (promoted at its due time by any consumer of the queue).
    RetryAfter(Duration),
    /// The handler's task keeps the [`Lease`](crate::Lease) and settles it later with
    /// [`Lease::ack`](crate::Lease::ack), [`Lease::retry`](crate::Lease::retry) or
    /// [`Lease::retry_after`](crate::Lease::retry_after). The lease keeps renewing (and the
    /// concurrency slot stays taken) until then. Dropping the lease unsettled is a `Retry`.
    Deferred,
    /// Poison: move the entry to the queue's dead-letter stream now, with this reason.
    DeadLetter(String),
    /// Rate limited downstream (say, an HTTP 429 with `Retry-After`): back off this long. Every
    /// consumer of the queue stops taking new entries until then (the queue's back-off, shared
    /// through the backend and only ever extended: a shorter answer does not shorten it), and
    /// this entry is redelivered after the delay exactly as with [`Decision::RetryAfter`]. Not a
    /// failure: it does not count toward `max_deliveries` (the next
    /// [`Delivery::deliveries`](crate::Delivery::deliveries) is the same number) nor as a retry. At
    /// most [`MAX_DELAY`] (a longer delay is taken as that), for the back-off too
    /// ([`ConsumerCounters::rate_limited`], not `retried`). The back-off gates new entries only:
    /// handlers already running, reclaims of dead consumers' entries and due re-polls go on.
    RateLimited(Duration),
}

impl Decision {
    /// The same decision with its delay at most [`MAX_DELAY`].
    pub(crate) fn bounded(self) -> Self {
        match self {
            Decision::RetryAfter(d) => Decision::RetryAfter(d.min(MAX_DELAY)),
            Decision::RateLimited(d) => Decision::RateLimited(d.min(MAX_DELAY)),
            d => d,
        }
    }
}

/// Queue statistics, all exact counts at the time of the call.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueStats {
    /// Entries in the queue's stream (pending ones included; acked ones are deleted), and new
    /// entries waiting to be taken by priority (the ready set, see
    /// [`OfferOptions::priority`]).
    pub length: u64,
    /// Entries delivered and not yet acknowledged (the group's pending entries list).
    pub pending: u64,
    /// Live consumers: group members whose last heartbeat is younger than their claim timeout
    /// (the reserved `~parked` owner is not counted).
    pub consumers: u64,
    /// Entries never delivered to the group yet (Redis `XINFO GROUPS` lag, plus the entries of
    /// the priorities' ready set).
    pub lag: u64,
    /// Entries waiting in the delayed set (from `RetryAfter` longer than the claim timeout).
    pub delayed: u64,
    /// Entries in the dead-letter stream.
    pub dead_letters: u64,
    /// Dead consumers: group members silent for their claim timeout or more (crashed, or stopped
    /// while owning entries), not reaped yet. Their entries are reclaimed by live ones.
    #[serde(default)]
    pub dead_consumers: u64,
    /// The queue is paused ([`MessageStream::pause`](crate::MessageStream::pause)): no consumer
    /// takes new entries until it is resumed.
    #[serde(default)]
    pub paused: bool,
    /// When it was paused, ms since the Unix epoch (Redis's clock on Redis); `None` when running.
    #[serde(default)]
    pub paused_since_ms: Option<u64>,
    /// The queue backs off ([`Decision::RateLimited`]): no consumer takes new entries for this
    /// many more ms; `None` when it does not.
    #[serde(default)]
    pub backoff_ms: Option<u64>,
    /// Entries waiting in their concurrency key's waiting line
    /// ([`ConsumerOptions::concurrency_per_key`](crate::ConsumerOptions::concurrency_per_key)):
    /// not in the stream, not pending.
    #[serde(default)]
    pub key_waiting: u64,
    /// Entries waiting in the delayed set for their key's rate
    /// ([`ConsumerOptions::rate_limit_per_key`](crate::ConsumerOptions::rate_limit_per_key);
    /// counted in [`QueueStats::delayed`] too), or promoted and not read yet.
    #[serde(default)]
    pub key_rate_delayed: u64,
    /// The busiest concurrency keys: at most [`QueueStats::MAX_KEYS`], most
    /// `active + waiting + rate_delayed` first (then by key), among the keys holding a slot and
    /// the keys with entries delayed for their rate (on Redis up to 1,000 of each looked at). Empty
    /// without per-key gates.
    #[serde(default)]
    pub keys: Vec<KeyStats>,
}

impl QueueStats {
    /// The most keys [`QueueStats::keys`] lists: 50.
    pub const MAX_KEYS: usize = 50;
}

/// One concurrency key's counts ([`QueueStats::keys`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyStats {
    /// The concurrency key.
    pub key: String,
    /// Entries holding one of its slots (`concurrency_per_key`): running, or on their way to a
    /// consumer (promoted from the waiting line, or waiting for the key's rate with a slot).
    pub active: u64,
    /// Entries in its waiting line.
    pub waiting: u64,
    /// Entries waiting in the delayed set for its rate (`rate_limit_per_key`).
    pub rate_delayed: u64,
}

/// A consumer of a queue's group ([`MessageStream::consumers`](crate::MessageStream::consumers)).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ConsumerInfo {
    /// Its name in the group (an in-process consumer: `<consumer_prefix>-<uuid v7>`, one per
    /// process incarnation; a remote worker: the name it connected with).
    pub name: String,
    /// Its last heartbeat is younger than its claim timeout.
    pub alive: bool,
    /// Its last heartbeat, ms since the Unix epoch (Redis's clock), if it has a liveness record.
    pub last_heartbeat_ms: Option<u64>,
    /// The claim timeout it heartbeats with, ms (with its record).
    pub claim_timeout_ms: Option<u64>,
    /// Entries it owns (delivered to it, not settled).
    pub pending: u64,
    /// Its oldest owned entries, at most the number asked for.
    pub leases: Vec<LeaseInfo>,
}

/// An entry a consumer owns ([`ConsumerInfo::leases`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LeaseInfo {
    pub id: MessageId,
    /// Since its last delivery or renewal, ms.
    pub idle_ms: u64,
    /// Deliveries so far.
    pub deliveries: u32,
    /// Its payload (`None`: the entry is gone, e.g. acked meanwhile).
    #[serde(skip)]
    pub payload: Option<Bytes>,
}

/// An entry of a queue's dead-letter stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// Id of the entry in the dead-letter stream (use it to replay).
    pub id: MessageId,
    /// Id the message had in the queue.
    pub original_id: MessageId,
    /// The payload bytes.
    #[serde(with = "payload_serde")]
    pub payload: Bytes,
    /// Deliveries made before it was dead-lettered.
    pub deliveries: u32,
    /// Why: `max deliveries exceeded`, `malformed entry`, or the handler's reason.
    pub reason: String,
    /// When it was dead-lettered, ms since the Unix epoch.
    pub dead_lettered_at_ms: u64,
    /// Its concurrency key ([`OfferOptions::concurrency_key`]), if it had one: a replay offers
    /// it with the same key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency_key: Option<String>,
    /// Its priority ([`OfferOptions::priority`], 0 if it had none): a replay offers it with the
    /// same priority.
    #[serde(default)]
    pub priority: i8,
}

mod payload_serde {
    use bytes::Bytes;
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(b: &Bytes, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&String::from_utf8_lossy(b))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        Ok(Bytes::from(String::deserialize(d)?))
    }
}

/// What [`crate::Consumer::drain`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Deliveries whose handler finished (and settled) within the budget.
    pub completed: usize,
    /// Ids still in flight when the budget ran out; their leases are left to expire, so another
    /// consumer takes them after `claim_timeout`.
    pub in_flight: Vec<MessageId>,
}

/// Counters of one consumer since it started (also exported as `metrics`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConsumerCounters {
    pub delivered: u64,
    pub reclaimed: u64,
    pub acked: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    pub renewals: u64,
    pub renewal_failures: u64,
    pub leases_lost: u64,
    pub leases_expired: u64,
    /// Deliveries its handlers answered with [`Decision::RateLimited`].
    pub rate_limited: u64,
}

/// Errors of the work queue.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// A setting is out of range; the message says which and what is allowed.
    #[error("invalid queue setting: {0}")]
    InvalidSettings(String),
    /// A queue name that is empty, too long (> 200 bytes) or holds `{`, `}` or control characters.
    #[error("invalid queue name {0:?}: use 1 to 200 bytes without braces or control characters")]
    InvalidQueueName(String),
    /// Not a `<ms>-<seq>` id.
    #[error("invalid message id {0:?}: expected <ms>-<seq>, e.g. 1700000000000-0")]
    InvalidMessageId(String),
    /// The consumer no longer owns the entry (its lease was lost to another consumer, or the
    /// entry was already settled), so the ack or retry was refused.
    #[error("lease lost: message {0} is no longer owned by this consumer")]
    LeaseLost(MessageId),
    /// The lease was already settled (ack, retry) through this handle.
    #[error("lease for message {0} was already settled")]
    AlreadySettled(MessageId),
    /// No dead letter with this id.
    #[error("no dead letter {0} in this queue")]
    DeadLetterNotFound(MessageId),
    /// The backend failed to answer (e.g. Redis unreachable); the operation may be retried.
    #[error("queue backend unavailable: {0}")]
    Unavailable(String),
    /// The consumer is closed.
    #[error("consumer is closed")]
    Closed,
    /// Redis failed (connection lost, timeout, script error); usually transient.
    #[error("redis: {0}")]
    Redis(#[from] baton_redis::redis::RedisError),
    /// Could not connect to Redis.
    #[error(transparent)]
    Connect(#[from] baton_redis::ConnectError),
}

/// Validates a queue name: 1..=200 bytes, no `{` `}` (they would change the Cluster hash tag), no
/// control characters.
pub fn validate_queue_name(name: &str) -> Result<(), QueueError> {
    if name.is_empty() || name.len() > 200 || name.chars().any(|c| c == '{' || c == '}' || c.is_control()) {
        return Err(QueueError::InvalidQueueName(name.to_string()));
    }
    Ok(())
}

/// Options of one offer ([`MessageStream::offer_with`](crate::MessageStream::offer_with)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OfferOptions {
    /// The entry's concurrency key: a consumer with
    /// [`ConsumerOptions::concurrency_per_key`](crate::ConsumerOptions::concurrency_per_key) runs
    /// at most that many entries of one key at once, in offer order. 1 to 256 bytes, no control
    /// characters ([`validate_concurrency_key`]). `None`: not limited per key.
    pub concurrency_key: Option<String>,
    /// The entry's priority, [`MIN_PRIORITY`] to [`MAX_PRIORITY`] ([`validate_priority`]),
    /// default 0. Higher runs first: a consumer's gated read takes new entries by priority, then
    /// in offer order (FIFO among equal priorities). Strict, with no aging: while entries of a
    /// higher priority keep arriving, no new entry of a lower one is taken — a flood of
    /// high-priority work starves lower priorities until it drains. Priorities order new
    /// entries only: reclaims and redeliveries of started work are not reordered. The priority
    /// is kept through scheduling ([`MessageStream::offer_at_with`](crate::MessageStream::offer_at_with)),
    /// a long [`Decision::RetryAfter`], a concurrency key's waiting line, requeues and dead
    /// letters (a replay offers the entry with its priority and concurrency key).
    pub priority: i8,
}

/// Lowest priority of an entry: -10.
pub const MIN_PRIORITY: i8 = -10;
/// Highest priority of an entry: 10.
pub const MAX_PRIORITY: i8 = 10;

/// A priority is [`MIN_PRIORITY`] to [`MAX_PRIORITY`] (-10 to 10); otherwise
/// [`QueueError::InvalidSettings`] says so.
pub fn validate_priority(priority: i8) -> Result<(), QueueError> {
    if !(MIN_PRIORITY..=MAX_PRIORITY).contains(&priority) {
        return Err(QueueError::InvalidSettings(format!(
            "priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY} (got {priority})"
        )));
    }
    Ok(())
}

/// Longest concurrency key, in bytes: 256.
pub const MAX_CONCURRENCY_KEY_LEN: usize = 256;

/// A concurrency key is 1 to [`MAX_CONCURRENCY_KEY_LEN`] bytes without control characters;
/// otherwise [`QueueError::InvalidSettings`] says so.
pub fn validate_concurrency_key(key: &str) -> Result<(), QueueError> {
    if key.is_empty() || key.len() > MAX_CONCURRENCY_KEY_LEN || key.chars().any(|c| c.is_control()) {
        return Err(QueueError::InvalidSettings(format!(
            "concurrency_key must be 1 to {MAX_CONCURRENCY_KEY_LEN} bytes without control characters (got {} bytes)",
            key.len()
        )));
    }
    Ok(())
}

/// Where a Redis delivery lives: see [`Lease::redis_target`](crate::Lease::redis_target).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisAckTarget {
    /// The queue's stream key, e.g. `baton:q:{orders}`.
    pub stream: String,
    /// The consumer group.
    pub group: String,
    /// This consumer's name in the group (the owner an ack must check).
    pub consumer: String,
    /// The queue's fence hash ([`crate::keys::fences`], e.g. `baton:q:{orders}:fences`): an ack
    /// of a delivery whose fence is known checks that the entry's fence (its field, absent = 0)
    /// is still that one, and removes the field with the entry.
    pub fences: String,
    /// The queue's concurrency-cap keys ([`crate::keys::caps`]): a script that acks must also
    /// free the entry's slots with [`crate::keys::CAPS_LUA`]'s `caps_release` and `caps_wake`.
    pub caps: [String; crate::keys::CAPS_KEYS],
}
