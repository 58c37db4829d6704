//! The Redis layout of a queue: its key names, consumer group and entry field, owned by this
//! crate. The Redis backend builds every key from these functions, and so must any code outside
//! it that touches a queue's keys (the command service enqueues and acks in its own scripts;
//! tests inspect the stream), so that the layout is written down once.
//!
//! All keys of queue `q` under prefix `p` share the hash tag `{q}`, so every script of a queue
//! runs on one Cluster node and receives all its keys in KEYS:
//!
//! | key                  | function               | type   | holds                                  |
//! |----------------------|------------------------|--------|----------------------------------------|
//! | `p:q:{q}`            | [`stream`]             | stream | the entries; consumer group [`DEFAULT_GROUP`] unless configured |
//! | `p:q:{q}:dead`       | [`dead`]               | stream | dead letters                           |
//! | `p:q:{q}:delayed`    | [`delayed`]            | zset   | entries of a long `RetryAfter`, by due time |
//! | `p:q:{q}:delayed:p`  | [`delayed_payloads`]   | hash   | their payloads and prior deliveries    |
//! | `p:q:{q}:consumers`  | [`consumers`]          | hash   | each consumer's liveness record        |
//! | `p:q:{q}:fences`     | [`fences`]             | hash   | the fence of each entry delivered again by a reclaim |
//! | `p:q:{q}:paused`     | [`paused`]             | string | present while the queue is paused: when it was paused (ms, Redis time) |
//! | `p:q:{q}:control`    | [`control`]            | stream | the latest gate change (one entry, written by each resume and by each freed slot while [`slot_waiters`] is set): consumers behind a shut gate wait on it |
//! | `p:q:{q}:slotwait`   | [`slot_waiters`]       | string | present while a read found `max_concurrency` reached |
//! | `p:q:{q}:keys:held`  | [`key_held`]           | hash   | concurrency key → entries holding one of its slots |
//! | `p:q:{q}:keys:ids`   | [`key_holders`]        | hash   | entry id → concurrency key, for each entry holding a slot of its key |
//! | `p:q:{q}:keys:wait`  | [`key_waiting`]        | zset   | each key's waiting line: members `<key>\0<16-digit seq>`, score 0 |
//! | `p:q:{q}:keys:wait:p`| [`key_waiting_entries`]| hash   | member → `<prior deliveries>:<payload>`; `~seq` the last seq |
//! | `p:q:{q}:rate`       | [`rate`]               | string | the rate limit's state: its theoretical arrival time (µs, Redis time) |
//! | `p:q:{q}:krate`      | [`key_rate`]           | hash   | the per-key rate limit's state: key → `<tat µs>:<entries waiting for the rate>:<head's due µs>` |
//! | `p:q:{q}:krate:exp`  | [`key_rate_expiry`]    | zset   | key → ms after which its `krate` field may be stale (cleanup) |
//! | `p:q:{q}:krate:line` | [`key_rate_line`]      | zset   | each key's rate line: members `<key>\0<16-digit seq>\0<entry id>`, score 0 |
//! | `p:q:{q}:backoff`    | [`backoff`]            | string | present while the queue backs off (a handler answered `RateLimited`); expires when it ends |
//! | `p:q:{q}:resend:<writer>` | `baton_redis::resend::ResendGuard::key` of [`stream`] | string | Cluster only: one offering process's re-send guard (an offer re-sent by the Cluster client is answered, not appended twice), or one guard of a consumer's pool for its settle, retry-after and dead-letter calls (a re-sent ack, retry or dead-letter is answered as its first copy was, not "not pending") |
//!
//! What each key holds in detail: the `redis` module of this crate and `docs/architecture.md`
//! ("Redis keys"). The prefix and the group are [`RedisQueueOptions`](crate::RedisQueueOptions)
//! (defaults [`DEFAULT_PREFIX`], [`DEFAULT_GROUP`]); the prefix must not contain braces.
//!
//! ```
//! use baton_queue::keys;
//!
//! assert_eq!(keys::stream(keys::DEFAULT_PREFIX, "orders"), "baton:q:{orders}");
//! assert_eq!(keys::consumers("app", "orders"), "app:q:{orders}:consumers");
//! ```

/// Prefix of every key unless [`RedisQueueOptions::key_prefix`](crate::RedisQueueOptions::key_prefix)
/// says otherwise: `baton`.
pub const DEFAULT_PREFIX: &str = "baton";

/// Consumer group of every queue unless [`RedisQueueOptions::group`](crate::RedisQueueOptions::group)
/// says otherwise: `baton`.
pub const DEFAULT_GROUP: &str = "baton";

/// The field of a stream entry that holds its payload: `p`. An entry added by other code (an
/// `XADD` in a script) needs this one field to be delivered.
pub const PAYLOAD_FIELD: &str = "p";

/// The group's reserved consumer that owns pending entries nobody holds (`~parked`); it is not a
/// consumer and is never counted as one.
pub use crate::backend::PARKED;

/// The queue's stream, `<prefix>:q:{<queue>}`: its entries and its consumer group.
pub fn stream(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}")
}

/// The queue's dead letters (a stream), `<prefix>:q:{<queue>}:dead`.
pub fn dead(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:dead")
}

/// Entries waiting for a `RetryAfter` longer than the claim timeout (a sorted set by due time),
/// `<prefix>:q:{<queue>}:delayed`.
pub fn delayed(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:delayed")
}

/// The payloads and prior delivery counts of the delayed entries (a hash),
/// `<prefix>:q:{<queue>}:delayed:p`.
pub fn delayed_payloads(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:delayed:p")
}

/// The liveness records of the queue's consumers and its outage stamps (a hash),
/// `<prefix>:q:{<queue>}:consumers`.
pub fn consumers(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:consumers")
}

/// The fences of the queue's pending entries that a reclaim delivered again (a hash, entry id →
/// how many times reclaims delivered it), `<prefix>:q:{<queue>}:fences`. A first delivery's fence
/// is 0 (no field); acks, dead letters and requeues remove the field with the entry.
pub fn fences(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:fences")
}

/// The queue's pause flag (a string), `<prefix>:q:{<queue>}:paused`: present while the queue is
/// paused ([`MessageStream::pause`](crate::MessageStream::pause)), holding when it was paused
/// (ms since the Unix epoch, Redis's clock). The gated read of new entries checks it in the same
/// script that takes them, so nothing new is taken while it is set.
pub fn paused(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:paused")
}

/// The queue's control stream, `<prefix>:q:{<queue>}:control`: each resume appends one entry
/// (the stream is trimmed to its latest one), which wakes the consumers of a paused queue that
/// wait on it with `XREAD BLOCK`.
pub fn control(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:control")
}

/// The queue's rate limit state (a string), `<prefix>:q:{<queue>}:rate`: the GCRA theoretical
/// arrival time, µs since the Unix epoch (Redis's clock), written by the gated read when a
/// [`RateLimit`](crate::RateLimit) is set; it expires once it lies in the past.
pub fn rate(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:rate")
}

/// The per-key rate limit's state (a hash), `<prefix>:q:{<queue>}:krate`: concurrency key →
/// `<tat>:<n>:<due>`, the key's GCRA theoretical arrival time (µs since the Unix epoch, Redis's
/// clock; it moves on as the key's entries are taken), how many of its entries wait for the rate
/// (its head, in the delayed set or promoted and not read yet, and those parked behind it in its
/// [`key_rate_line`]), and the head's due time (µs). Field `\0n`: the sum of the counts; `\0s`:
/// the last line sequence. Written by the gated read when a
/// [`ConsumerOptions::rate_limit_per_key`](crate::ConsumerOptions::rate_limit_per_key) is set; a
/// field whose tat has passed with nothing waiting is removed by a later read ([`key_rate_expiry`]).
pub fn key_rate(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:krate")
}

/// When each [`key_rate`] field may be stale (a sorted set, key → ms since the Unix epoch),
/// `<prefix>:q:{<queue>}:krate:exp`: each gated read with a per-key rate limit looks at up to 8
/// due members and removes the stale fields.
pub fn key_rate_expiry(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:krate:exp")
}

/// The keys' rate lines (a sorted set, all scores 0, members `<key>\0<16-digit sequence>\0<entry
/// id>`), `<prefix>:q:{<queue>}:krate:line`: the entries of each key waiting behind its head for
/// the per-key rate limit, in offer order. Each is parked in the [`delayed`] set (score 9·10¹⁵,
/// never due, payload in [`delayed_payloads`]) until it becomes its key's head.
pub fn key_rate_line(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:krate:line")
}

/// The queue's back-off (a string), `<prefix>:q:{<queue>}:backoff`: present while no consumer
/// takes new entries because a handler answered [`Decision::RateLimited`](crate::Decision::RateLimited);
/// its time to live is the back-off left (only ever extended).
pub fn backoff(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:backoff")
}

/// The queue's slot-waiter flag (a string), `<prefix>:q:{<queue>}:slotwait`: set by a read that
/// found `max_concurrency` entries pending; the next script that takes an entry out of the
/// pending list deletes it and appends `op=slot` to the [`control`] stream, which wakes the
/// waiting consumers.
pub fn slot_waiters(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:slotwait")
}

/// How many entries hold a slot of each concurrency key (a hash, key → count),
/// `<prefix>:q:{<queue>}:keys:held`.
pub fn key_held(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:keys:held")
}

/// The entries holding a slot of their concurrency key (a hash, entry id → key),
/// `<prefix>:q:{<queue>}:keys:ids`: pending, or promoted from the waiting line and not read yet.
pub fn key_holders(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:keys:ids")
}

/// The waiting lines of the concurrency keys (a sorted set, all scores 0, members
/// `<key>\0<16-digit sequence>`, so a key's head is found by `ZRANGEBYLEX` in O(log n)),
/// `<prefix>:q:{<queue>}:keys:wait`.
pub fn key_waiting(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:keys:wait")
}

/// The entries of the waiting lines (a hash, member → `<prior deliveries>:<payload>`; field
/// `~seq` the last sequence number), `<prefix>:q:{<queue>}:keys:wait:p`.
pub fn key_waiting_entries(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:keys:wait:p")
}

/// The priority ready set (a sorted set), `<prefix>:q:{<queue>}:ready`: new entries waiting to
/// be taken once the queue holds entries of a priority other than 0 (see `scripts/read.lua`),
/// score `-priority`, member the entry's arrival id as `<16-digit ms>-<16-digit seq>` (so equal
/// priorities are taken in arrival order).
pub fn ready(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:ready")
}

/// The entries of the [`ready`] set (a hash, member → the entry's stream fields packed with
/// MessagePack; field `~new`: present while the stream may hold unread entries of a priority
/// other than 0), `<prefix>:q:{<queue>}:ready:p`.
pub fn ready_entries(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{{{queue}}}:ready:p")
}

/// The concurrency caps' and priorities' keys of a queue in the order its scripts take them
/// (`scripts/caps.lua`'s `caps_keys`): [`control`], [`slot_waiters`], [`key_held`],
/// [`key_holders`], [`key_waiting`], [`key_waiting_entries`], [`ready`], [`ready_entries`]. A
/// script of other code that takes entries out of the pending list (see
/// [`crate::Lease::redis_target`]) or adds entries passes them and runs [`CAPS_LUA`]'s functions.
pub fn caps(prefix: &str, queue: &str) -> [String; CAPS_KEYS] {
    [
        control(prefix, queue),
        slot_waiters(prefix, queue),
        key_held(prefix, queue),
        key_holders(prefix, queue),
        key_waiting(prefix, queue),
        key_waiting_entries(prefix, queue),
        ready(prefix, queue),
        ready_entries(prefix, queue),
    ]
}

/// How many keys [`caps`] returns: 8.
pub const CAPS_KEYS: usize = 8;

/// The stream field of an entry's priority (absent: 0), see
/// [`OfferOptions::priority`](crate::OfferOptions::priority).
pub const PRIORITY_FIELD: &str = "pr";

/// The Lua functions (`scripts/caps.lua`) that every script removing entries from a queue's
/// pending list prepends: `caps_keys(n)` (the eight [`caps`] keys at `KEYS[n..n+7]`),
/// `caps_release(C, stream, id)` for each entry taken out (frees or hands on its key slot),
/// `caps_wake(C)` once (wakes reads waiting for a `max_concurrency` slot) and
/// `caps_add(C, stream, fields, priority)` to append an entry (an entry of a priority other than
/// 0 marks the queue so that the gated read orders new entries by priority).
pub const CAPS_LUA: &str = include_str!("../scripts/caps.lua");

/// The field of a stream entry holding its concurrency key: `k`.
pub const KEY_FIELD: &str = "k";

/// The doorbell group of consumer group `group` on each queue stream, `<group>~bell`: consumers
/// that found nothing new wait on it with `XREADGROUP … NOACK BLOCK`, so that each new entry wakes
/// one waiter (not all of them); the gated read sets it to where `group` stands whenever it found
/// nothing new. It holds no pending entries.
pub fn doorbell_group(group: &str) -> String {
    format!("{group}~bell")
}

/// The one consumer name every waiter uses in the [`doorbell_group`]: `~waiter`.
pub const DOORBELL_WAITER: &str = "~waiter";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        assert_eq!(stream("p", "q"), "p:q:{q}");
        assert_eq!(dead("p", "q"), "p:q:{q}:dead");
        assert_eq!(delayed("p", "q"), "p:q:{q}:delayed");
        assert_eq!(delayed_payloads("p", "q"), "p:q:{q}:delayed:p");
        assert_eq!(consumers("p", "q"), "p:q:{q}:consumers");
        assert_eq!(fences("p", "q"), "p:q:{q}:fences");
        assert_eq!(paused("p", "q"), "p:q:{q}:paused");
        assert_eq!(control("p", "q"), "p:q:{q}:control");
        assert_eq!(rate("p", "q"), "p:q:{q}:rate");
        assert_eq!(backoff("p", "q"), "p:q:{q}:backoff");
        assert_eq!(key_rate("p", "q"), "p:q:{q}:krate");
        assert_eq!(key_rate_expiry("p", "q"), "p:q:{q}:krate:exp");
        assert_eq!(key_rate_line("p", "q"), "p:q:{q}:krate:line");
        // One hash tag for all of a queue's keys: one Cluster slot.
        let slot = baton_redis::key_slot(stream("p", "orders").as_bytes());
        for k in [
            dead("p", "orders"),
            delayed("p", "orders"),
            delayed_payloads("p", "orders"),
            consumers("p", "orders"),
            fences("p", "orders"),
            paused("p", "orders"),
            control("p", "orders"),
            rate("p", "orders"),
            backoff("p", "orders"),
            key_rate("p", "orders"),
            key_rate_expiry("p", "orders"),
            key_rate_line("p", "orders"),
            slot_waiters("p", "orders"),
            key_held("p", "orders"),
            key_holders("p", "orders"),
            key_waiting("p", "orders"),
            key_waiting_entries("p", "orders"),
        ] {
            assert_eq!(baton_redis::key_slot(k.as_bytes()), slot, "{k}");
        }
    }
}
