//! Redis backend: one Redis Stream per queue with one consumer group (Redis docs, "Redis Streams
//! consumer groups"). Keys of queue `q` under prefix `p` all share the hash tag `{q}`, so every
//! script runs on one Cluster node and receives all its keys in KEYS (their names come from the
//! public [`keys`] module, the one place the layout is written):
//!
//! | key                      | type   | holds                                                  |
//! |--------------------------|--------|--------------------------------------------------------|
//! | `p:q:{q}`                | stream | the entries, field `p` = payload, `dc` = prior deliveries, `k` = concurrency key, `kh` = holds its key slot already, `pr` = priority (absent: 0) |
//! | `p:q:{q}:dead`           | stream | dead letters: `id`, `p`, `dc`, `reason`, `at`          |
//! | `p:q:{q}:delayed`        | zset   | original id → due time (ms) of a long `RetryAfter`     |
//! | `p:q:{q}:delayed:p`      | hash   | original id → payload, `<id>:dc` → prior deliveries, `<id>:k` / `<id>:pr` → key, priority |
//! | `p:q:{q}:consumers`      | hash   | consumer → `<ms of its last heartbeat>:<its claim timeout ms>` (server time; `0:…` stopped with entries); `~clock`, `~hold`: the queue's outage stamps |
//! | `p:q:{q}:fences`         | hash   | entry id → fence of its latest delivery, for entries a reclaim delivered again (none: 0) |
//! | `p:q:{q}:paused`         | string | present while paused: ms (Redis time) since when   |
//! | `p:q:{q}:control`        | stream | the latest resume or freed slot (trimmed to one entry): consumers behind a shut gate wait on it |
//! | `p:q:{q}:slotwait`       | string | present while a read found `max_concurrency` reached   |
//! | `p:q:{q}:keys:held`      | hash   | concurrency key → entries holding one of its slots     |
//! | `p:q:{q}:keys:ids`       | hash   | entry id → concurrency key of each slot holder         |
//! | `p:q:{q}:keys:wait`      | zset   | the keys' waiting lines, `<key>\0<seq>`, score 0        |
//! | `p:q:{q}:keys:wait:p`    | hash   | waiting member → `<prior deliveries>[/<priority>]:<payload>` |
//! | `p:q:{q}:ready`          | zset   | the priorities' ready set: new entries by `-priority`, member the arrival id padded (`read.lua`) |
//! | `p:q:{q}:ready:p`        | hash   | ready member → the entry's fields (cmsgpack); `~new` while unread entries of a priority other than 0 may be in the stream |
//! | `p:q:{q}:rate`           | string | the rate limit's GCRA theoretical arrival time (µs, Redis time); expires once past |
//! | `p:q:{q}:backoff`        | string | present while the queue backs off (`RateLimited`); its TTL is the back-off left |
//! | `p:q:{q}:krate`          | hash   | per-key rate limit: key → `<tat µs>:<delayed entries>:<latest due µs>` |
//! | `p:q:{q}:krate:exp`      | zset   | key → ms after which its `krate` field may be stale (a read removes up to 8) |
//! | `p:q:{q}:resend:<writer>` | string | Cluster only: one process's re-send guard of its `offer_batch` calls ([`ClusterOffers`]), or one guard of a consumer's pool for its `settle`, `retry_after` and `dead_letter` calls ([`SETTLE_GUARDED`], [`RETRY_AFTER_GUARDED`], [`DEAD_LETTER_GUARDED`]: as many guards as such calls were in flight at once) |
//!
//! Pending entries nobody holds belong to the group's reserved consumer `~parked` (see the
//! `backend` module). Scripts (in `scripts/`): `join`, `heartbeat`, `settle`, `reclaim`,
//! `retry_after`, `dead_letter`, `requeue`, `replay`, `reap`, `leave`, `stats`, `read`, `pause`, `offer` (entries of a priority other than 0),
//! `offer_batch` (every offer on Cluster: [`ClusterOffers`]); every time they compare is Redis's own (`TIME`).
//! On Cluster `settle`, `retry_after` and `dead_letter` run under a re-send guard lent per call
//! ([`SETTLE_GUARDED`], [`RETRY_AFTER_GUARDED`], [`DEAD_LETTER_GUARDED`]).
//!
//! **The gated read.** New entries are taken only by `read.lua`: it checks the queue's gates (the
//! pause flag) and takes up to `count` entries with a non-blocking `XREADGROUP … COUNT n` in one
//! atomic step, so nothing new is taken while a gate is shut, whatever races it. A blocked
//! `XREADGROUP` could not check a gate, so waiting is separate and takes nothing: when the script
//! took nothing, the consumer waits on a dedicated connection with no response timeout, each wait
//! bounded by the consumer. When the queue runs it waits with `XREADGROUP … NOACK BLOCK` on the
//! group's doorbell group (`<group>~bell`, [`keys::doorbell_group`], no pending entries), which
//! the script has set to where the group stands: each later offer wakes one waiter only, as the
//! blocked `XREADGROUP` did (an `XREAD BLOCK` would wake every idle consumer for every entry).
//! When paused it waits with `XREAD BLOCK` on the control stream after its last entry (a resume
//! appends to it and wakes every waiter; offers to a paused queue wake nobody). Both come from the
//! script, atomically with its decision, so no wake-up is lost in between. The wait is pipelined
//! with the next gated read on the same connection, so Redis
//! runs the read the moment the wait ends: one round trip per wait, as a blocked `XREADGROUP`
//! was, and none added while entries are there.
//! The concurrency caps (`max_concurrency`, `concurrency_per_key`) are gates of the same read
//! (`read.lua`, with `caps.lua` prepended to it and to every script that takes entries out of the
//! pending list: they free the slots and wake the reads waiting for one; `docs/architecture.md`,
//! "Gates on new work"). The back-off and the rate limit are timed gates: the script says in how
//! many ms the gate opens (back-off: the key's TTL; rate limit: GCRA over the theoretical arrival
//! time kept in the queue's slot, in Redis time, moved on only by the entries actually taken), and
//! the consumer sleeps that long (within its wait) before reading again: nothing to watch, no
//! polling. Priorities are decided there too: while the queue holds new entries of a priority
//! other than 0 the read takes them through the ready set (`read.lua`, `docs/architecture.md`,
//! "Priorities"). Every connection of a consumer is opened on its
//! lease thread and closed when that thread ends.
//!
//! **The per-key rate limit** (`rate_limit_per_key`) is a gate of the per-key step of the same
//! read, after `concurrency_per_key` (an entry is charged when it may start, not while it waits
//! in its key's line), and not a timed gate: one key over its rate must not hold back the others
//! (no head-of-line blocking). Each key has a GCRA bucket (`krate`: its theoretical arrival time,
//! Redis time), charged when one of its entries is taken, so the rate spaces starts. An entry of
//! a key that does not conform is taken out of the stream (`XACK` + `XDEL`, never pending while it
//! waits) into the delayed set (the one of long `RetryAfter`s and scheduled entries): the first as
//! the key's head, due when its key's bucket admits it; the ones behind it parked there (a score
//! that is never due) and listed in the key's rate line (`krate:line`), in offer order. Each keeps
//! the key slot it got (its holder id stays its id, a delayed member, which the caps backstop
//! knows). `reclaim.lua` promotes the head at its due time with the mark `kr` (and `kh` with its
//! slot, the holder id moving to the new entry). When the read takes it, it is charged and the
//! next of the line becomes the head, due when the bucket admits it again; a head whose start came
//! so late that it no longer conforms (it sat in the stream while every slot was busy) goes back
//! as the head. So a key's entries start in offer order and never faster than its rate. The read
//! tells the consumer when a head it scheduled is due, and the consumer's promoter (a remote
//! worker: its next claim) promotes it then (any consumer's reclaim tick would too). The
//! queue-wide rate limit counts entries taken, so a delayed entry counts when it is taken after
//! its promotion. Stale `krate` fields (tat past, nothing waiting) are removed by later reads, a
//! few per read (`krate:exp`, no per-field expiry on Redis 7.0). A read of a consumer without a
//! per-key rate limit releases the parked entries (due at once) and drops the keys' rate states
//! (a head it reads back is not counted off), so removing the setting strands nothing. A head lost to something other than the queue's scripts (its delayed member or
//! promoted entry removed by hand, or a write lost in a failover) leaves its key's line parked:
//! later entries of the key wait behind it.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use baton_redis::group_commit::{Committer, GroupCommit, GroupCommitOptions};
use baton_redis::redis::{self, Value};
use baton_redis::resend::{ResendGuard, ResendPool, RESEND_HEAD, RESEND_TAIL};
use baton_redis::{is_nogroup, LuaScript, RedisClient, RedisConn};
use bytes::Bytes;
use tokio::sync::Mutex as AsyncMutex;

use crate::backend::{
    Beat, ConsumerBackend, ConsumerSpec, Owned, QueueBackend, RawDelivery, Reclaimed, ScheduleOp, ScheduleReply,
    Settle, SettleOp, Throttle, PARKED,
};
use crate::keys::{self, PAYLOAD_FIELD};
use crate::{DeadLetter, MessageId, QueueError, QueueStats};

static JOIN: LuaScript = LuaScript::new("join", include_str!("../scripts/join.lua"));
static SETTLE: LuaScript =
    LuaScript::new("settle", concat!(include_str!("../scripts/caps.lua"), include_str!("../scripts/settle.lua")));
/// [`SETTLE`] under a re-send guard ([`baton_redis::resend`]): what Cluster deployments send. The
/// redis crate's Cluster connection sends a call again when its connection dropped after it was
/// sent; a second copy of a settle that ran would find its entries no longer pending and answer
/// 0 ("not pending", `Owned::Gone`) for each although the first copy acked them. Calls are not
/// serialized (the engine keeps up to four in flight, a remote worker's acks any number), so each
/// call borrows a guard from its consumer's [`ResendPool`] (`RedisConsumer::resend`) until its
/// reply; its key is `p:q:{q}:resend:<guard id>`, in the queue's slot. A re-sent copy is answered
/// with the first copy's reply and changes nothing.
static SETTLE_GUARDED: LuaScript = LuaScript::from_parts(
    "settle",
    &[RESEND_HEAD, include_str!("../scripts/caps.lua"), include_str!("../scripts/settle.lua"), RESEND_TAIL],
);
static HEARTBEAT: LuaScript = LuaScript::new("heartbeat", include_str!("../scripts/heartbeat.lua"));
static REQUEUE: LuaScript =
    LuaScript::new("requeue", concat!(include_str!("../scripts/caps.lua"), include_str!("../scripts/requeue.lua")));
static LEAVE: LuaScript = LuaScript::new("leave", include_str!("../scripts/leave.lua"));
static RECLAIM: LuaScript =
    LuaScript::new("reclaim", concat!(include_str!("../scripts/caps.lua"), include_str!("../scripts/reclaim.lua")));
static RETRY_AFTER: LuaScript = LuaScript::new(
    "retry_after",
    concat!(include_str!("../scripts/caps.lua"), include_str!("../scripts/retry_after.lua")),
);
/// [`RETRY_AFTER`] under a re-send guard lent per call, as [`SETTLE_GUARDED`]: what Cluster
/// deployments send. A second copy of a retry that ran would find the entry handed to the parked
/// owner (a short delay: answers -1, `LeaseLost`) or moved to the delayed set (a long one:
/// answers 0, `Settled::Gone`); the guard answers it 1, as the first copy was.
static RETRY_AFTER_GUARDED: LuaScript = LuaScript::from_parts(
    "retry_after",
    &[RESEND_HEAD, include_str!("../scripts/caps.lua"), include_str!("../scripts/retry_after.lua"), RESEND_TAIL],
);
static DEAD_LETTER: LuaScript = LuaScript::new(
    "dead_letter",
    concat!(include_str!("../scripts/caps.lua"), include_str!("../scripts/dead_letter.lua")),
);
/// [`DEAD_LETTER`] under a re-send guard lent per call, as [`SETTLE_GUARDED`]: what Cluster
/// deployments send. A second copy of a dead-letter that ran would find the entry no longer
/// pending (answers 0, `Settled::Gone`; it writes no second dead letter either way); the guard
/// answers it 1, as the first copy was.
static DEAD_LETTER_GUARDED: LuaScript = LuaScript::from_parts(
    "dead_letter",
    &[RESEND_HEAD, include_str!("../scripts/caps.lua"), include_str!("../scripts/dead_letter.lua"), RESEND_TAIL],
);
static REPLAY: LuaScript =
    LuaScript::new("replay", concat!(include_str!("../scripts/caps.lua"), include_str!("../scripts/replay.lua")));
static REAP: LuaScript = LuaScript::new("reap", include_str!("../scripts/reap.lua"));
static STATS: LuaScript = LuaScript::new("stats", include_str!("../scripts/stats.lua"));
static SCHEDULE: LuaScript = LuaScript::new("schedule", include_str!("../scripts/schedule.lua"));
static CONSUMERS: LuaScript = LuaScript::new("consumers", include_str!("../scripts/consumers.lua"));
static READ: LuaScript =
    LuaScript::new("read", concat!(include_str!("../scripts/caps.lua"), include_str!("../scripts/read.lua")));
static OFFER: LuaScript =
    LuaScript::new("offer", concat!(include_str!("../scripts/caps.lua"), include_str!("../scripts/offer.lua")));
/// The offers of one queue's group commit in one call, under a re-send guard
/// ([`baton_redis::resend`]): what Cluster deployments send for every offer ([`ClusterOffers`]).
static OFFER_BATCH: LuaScript = LuaScript::from_parts(
    "offer_batch",
    &[RESEND_HEAD, include_str!("../scripts/caps.lua"), include_str!("../scripts/offer_batch.lua"), RESEND_TAIL],
);
static PAUSE: LuaScript = LuaScript::new("pause", include_str!("../scripts/pause.lua"));
static BACKOFF: LuaScript = LuaScript::new("backoff", include_str!("../scripts/backoff.lua"));

/// Delayed entries promoted per reclaim tick at most.
const PROMOTE_PER_TICK: u32 = 1000;

/// Options of the Redis backend.
#[derive(Clone, Debug)]
pub struct RedisQueueOptions {
    /// Prefix of every key ([`keys`]). Default [`keys::DEFAULT_PREFIX`] (`baton`).
    pub key_prefix: String,
    /// Consumer group name. Default [`keys::DEFAULT_GROUP`] (`baton`).
    pub group: String,
}

impl Default for RedisQueueOptions {
    fn default() -> Self {
        Self { key_prefix: keys::DEFAULT_PREFIX.into(), group: keys::DEFAULT_GROUP.into() }
    }
}

#[derive(Clone)]
struct Keys {
    stream: String,
    dead: String,
    delayed: String,
    delayed_payloads: String,
    liveness: String,
    fences: String,
    paused: String,
    control: String,
    rate: String,
    backoff: String,
    /// The per-key rate limit's state and its cleanup zset.
    key_rate: String,
    key_rate_expiry: String,
    key_rate_line: String,
    /// The concurrency caps' and priorities' keys, in the order of `caps.lua`'s `caps_keys`:
    /// control stream, slot waiter flag, key hold counts, key holders, key waiting line, waiting
    /// entries, ready set, ready entries.
    caps: [String; crate::keys::CAPS_KEYS],
}

impl Keys {
    /// `head` followed by the eight concurrency-cap and priority keys: the KEYS of a script that takes entries
    /// out of the pending list with `caps.lua` prepended (its `caps_keys(#head + 1)`).
    fn with_caps<'a>(&'a self, head: &[&'a str]) -> Vec<&'a str> {
        head.iter().copied().chain(self.caps.iter().map(String::as_str)).collect()
    }

    fn new(prefix: &str, queue: &str) -> Self {
        Self {
            stream: keys::stream(prefix, queue),
            dead: keys::dead(prefix, queue),
            delayed: keys::delayed(prefix, queue),
            delayed_payloads: keys::delayed_payloads(prefix, queue),
            liveness: keys::consumers(prefix, queue),
            fences: keys::fences(prefix, queue),
            paused: keys::paused(prefix, queue),
            control: keys::control(prefix, queue),
            rate: keys::rate(prefix, queue),
            backoff: keys::backoff(prefix, queue),
            key_rate: keys::key_rate(prefix, queue),
            key_rate_expiry: keys::key_rate_expiry(prefix, queue),
            key_rate_line: keys::key_rate_line(prefix, queue),
            caps: keys::caps(prefix, queue),
        }
    }
}

pub(crate) struct RedisQueueBackend {
    client: RedisClient,
    conn: RedisConn,
    opts: RedisQueueOptions,
    /// On Cluster: the offers' group commit and re-send guard ([`ClusterOffers`]).
    offers: Option<ClusterOffers>,
}

/// Offers on Redis Cluster. The redis crate's Cluster connection sends a command again when its
/// connection dropped after it was sent, so an offer's `XADD` (or `offer.lua`) could append its
/// entries twice while its caller is answered once. On Cluster every offer therefore goes through
/// a group commit keyed by queue ([`baton_redis::group_commit`]: one call per queue in flight from
/// this process, the offers queued meanwhile going together in the next call) and each call is
/// one `offer_batch.lua` under this process's re-send guard ([`baton_redis::resend`], whose rule
/// of one guarded call in flight per guard and key the group commit keeps): a re-sent copy is
/// answered with the first copy's ids and appends nothing. Standalone and Sentinel connections
/// do not re-send, and offer as before (a pipelined `XADD`, or `offer.lua`).
struct ClusterOffers {
    commit: GroupCommit<String, OfferItem, OfferReply>,
    guard: Arc<ResendGuard>,
}

/// Offers per `offer_batch.lua` call at most.
const OFFER_BATCH_ITEMS: usize = 128;
/// Payload bytes per `offer_batch.lua` call at most (a bigger single offer still goes alone).
const OFFER_BATCH_BYTES: usize = 4 << 20;

/// One offer of a batch: its payloads, concurrency key and priority.
struct OfferItem {
    payloads: Vec<Bytes>,
    key: Option<String>,
    priority: i8,
}

type OfferReply = Result<Vec<MessageId>, QueueError>;

/// Sends one queue's batches of offers: one guarded `offer_batch.lua` call each.
struct OfferCall {
    conn: RedisConn,
    prefix: String,
    guard: Arc<ResendGuard>,
}

impl Committer<String, OfferItem, OfferReply> for OfferCall {
    async fn commit(&mut self, queue: &String, batch: Vec<OfferItem>) -> Vec<OfferReply> {
        let keys = Keys::new(&self.prefix, queue);
        let ks = keys.with_caps(&[&keys.stream]);
        let guard_key = self.guard.key(&keys.stream);
        let payloads: usize = batch.iter().map(|o| o.payloads.len()).sum();
        let args = 3 + ks.len() + 1 + 1 + batch.len() * 3 + payloads + 2;
        let bytes = 128
            + ks.iter().map(|k| k.len()).sum::<usize>()
            + guard_key.len()
            + batch.iter().map(|o| 16 + o.key.as_ref().map_or(0, String::len) + weight(o)).sum::<usize>();
        let mut cmd = OFFER_BATCH.evalsha_cmd_with_capacity(ks.len() + 1, args, bytes);
        for k in &ks {
            cmd.arg(*k);
        }
        cmd.arg(guard_key.as_str());
        cmd.arg(batch.len());
        for o in &batch {
            cmd.arg(o.priority).arg(o.key.as_deref().unwrap_or("")).arg(o.payloads.len());
            for p in &o.payloads {
                cmd.arg(p.as_ref());
            }
        }
        self.guard.push_args(&mut cmd);
        let ids: Vec<String> = match OFFER_BATCH.query(&mut self.conn, &cmd).await {
            Ok(ids) => ids,
            Err(e) => return batch.iter().map(|_| Err(QueueError::Redis(e.clone()))).collect(),
        };
        if ids.len() != payloads {
            let v = Value::Array(ids.into_iter().map(|s| Value::BulkString(s.into_bytes())).collect());
            return batch.iter().map(|_| Err(unexpected("offer_batch", &v))).collect();
        }
        let mut ids = ids.iter();
        batch.iter().map(|o| ids.by_ref().take(o.payloads.len()).map(|s| parse_id(s)).collect()).collect()
    }

    fn weight(&self, item: &OfferItem) -> usize {
        weight(item)
    }
}

/// An offer's payload bytes, against [`OFFER_BATCH_BYTES`].
fn weight(item: &OfferItem) -> usize {
    item.payloads.iter().map(Bytes::len).sum()
}

fn parse_id(s: &str) -> Result<MessageId, QueueError> {
    s.parse()
}

fn as_string(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn as_u64(v: &Value) -> u64 {
    match v {
        Value::Int(i) => (*i).max(0) as u64,
        other => as_string(other).and_then(|s| s.parse().ok()).unwrap_or(0),
    }
}

fn unexpected(what: &str, v: &Value) -> QueueError {
    QueueError::Redis(redis::RedisError::from((redis::ErrorKind::Parse, "unexpected reply", format!("{what}: {v:?}"))))
}

/// Fields of a stream entry as (name, raw value) pairs.
fn fields(v: &Value) -> Vec<(String, Value)> {
    match v {
        Value::Array(items) => items.chunks(2).filter_map(|c| Some((as_string(&c[0])?, c.get(1)?.clone()))).collect(),
        Value::Map(pairs) => pairs.iter().filter_map(|(k, v)| Some((as_string(k)?, v.clone()))).collect(),
        _ => Vec::new(),
    }
}

fn bytes_of(v: &Value) -> Option<Bytes> {
    match v {
        Value::BulkString(b) => Some(Bytes::copy_from_slice(b)),
        Value::SimpleString(s) => Some(Bytes::from(s.clone())),
        _ => None,
    }
}

/// The consumer group (created with its stream when missing), `consumer` in it and its first
/// liveness record (`join.lua`).
async fn join(conn: &mut RedisConn, keys: &Keys, group: &str, spec: &ConsumerSpec) -> Result<(), QueueError> {
    let claim_ms = spec.claim_timeout.as_millis() as u64;
    let _: i64 =
        JOIN.run(conn, &[&keys.stream, &keys.liveness, &keys.fences], &[&group, &spec.consumer, &claim_ms]).await?;
    Ok(())
}

/// A fence argument of the scripts: the number, or `''` for any delivery this consumer owns.
fn fence_arg(fence: Option<u64>) -> String {
    fence.map(|f| f.to_string()).unwrap_or_default()
}

/// What the settle, retry_after and dead_letter scripts reply for one id.
fn owned(code: i64) -> Owned {
    match code {
        1 => Owned::Done,
        0 => Owned::Gone,
        _ => Owned::Other,
    }
}

impl RedisQueueBackend {
    pub(crate) async fn connect(client: RedisClient, opts: RedisQueueOptions) -> Result<Self, QueueError> {
        if opts.group.is_empty() || opts.key_prefix.contains(['{', '}']) {
            return Err(QueueError::InvalidSettings(
                "group must not be empty and key_prefix must not contain braces".into(),
            ));
        }
        let conn = client.shared().await?;
        let offers = client.is_cluster().then(|| ClusterOffers {
            commit: GroupCommit::new(GroupCommitOptions {
                max_items: OFFER_BATCH_ITEMS,
                max_weight: OFFER_BATCH_BYTES,
                lead_sends: true,
            }),
            guard: Arc::new(ResendGuard::new()),
        });
        Ok(Self { client, conn, opts, offers })
    }

    fn keys(&self, queue: &str) -> Keys {
        Keys::new(&self.opts.key_prefix, queue)
    }
}

#[async_trait]
impl QueueBackend for RedisQueueBackend {
    async fn offer(
        &self,
        queue: &str,
        payloads: &[Bytes],
        key: Option<&str>,
        priority: i8,
    ) -> Result<Vec<MessageId>, QueueError> {
        if let Some(offers) = &self.offers {
            if payloads.is_empty() {
                return Ok(Vec::new());
            }
            let item = OfferItem { payloads: payloads.to_vec(), key: key.map(str::to_string), priority };
            let call = || OfferCall {
                conn: self.conn.clone(),
                prefix: self.opts.key_prefix.clone(),
                guard: offers.guard.clone(),
            };
            let queue = queue.to_string();
            return offers.commit.submit(&queue, item, call).await.unwrap_or_else(|_| {
                Err(QueueError::Unavailable("the offer's call ended without a reply (abandoned)".into()))
            });
        }
        let keys = self.keys(queue);
        if priority != 0 {
            // An entry of another priority marks the queue for the gated read (offer.lua).
            let ks = keys.with_caps(&[&keys.stream]);
            let mut cmd = OFFER.evalsha_cmd(ks.len());
            for k in ks {
                cmd.arg(k);
            }
            cmd.arg(priority).arg(key.unwrap_or(""));
            for p in payloads {
                cmd.arg(p.as_ref());
            }
            let ids: Vec<String> = OFFER.query(&mut self.conn.clone(), &cmd).await?;
            return ids.iter().map(|s| parse_id(s)).collect();
        }
        let mut pipe = redis::pipe();
        for p in payloads {
            let xadd = pipe.cmd("XADD").arg(&keys.stream).arg("*").arg(PAYLOAD_FIELD).arg(p.as_ref());
            if let Some(k) = key {
                xadd.arg(keys::KEY_FIELD).arg(k);
            }
        }
        let ids: Vec<String> = pipe.query_async(&mut self.conn.clone()).await?;
        ids.iter().map(|s| parse_id(s)).collect()
    }

    async fn schedule(&self, queue: &str, op: ScheduleOp<'_>) -> Result<ScheduleReply, QueueError> {
        let keys = self.keys(queue);
        let mut cmd = SCHEDULE.evalsha_cmd(2);
        cmd.arg(&keys.delayed).arg(&keys.delayed_payloads);
        match op {
            ScheduleOp::Add { name, due_ms, payload, key, priority } => {
                cmd.arg("add").arg(name).arg(due_ms).arg(payload).arg(key.unwrap_or("")).arg(priority)
            }
            ScheduleOp::Move { name, due_ms } => cmd.arg("move").arg(name).arg(due_ms),
            ScheduleOp::Remove { name } => cmd.arg("remove").arg(name),
            ScheduleOp::Count => cmd.arg("count").arg(1000),
        };
        let v: Value = SCHEDULE.query(&mut self.conn.clone(), &cmd).await?;
        match &v {
            Value::Int(n) => Ok(ScheduleReply::Done(*n == 1)),
            Value::Array(p) if p.len() == 2 => {
                let first = match &p[1] {
                    Value::Int(ms) if *ms >= 0 => Some(*ms as u64),
                    _ => None,
                };
                Ok(ScheduleReply::Count(as_u64(&p[0]), first))
            }
            _ => Err(unexpected("schedule", &v)),
        }
    }

    async fn open_consumer(&self, spec: ConsumerSpec) -> Result<Arc<dyn ConsumerBackend>, QueueError> {
        let keys = self.keys(&spec.queue);
        let spec_rate = spec.rate_limit;
        let spec_key_rate = spec.rate_limit_per_key;
        let mut conn = self.client.shared().await?;
        // Both setup commands are idempotent, so they are sent once more after a dropped
        // connection: the first command over a connection whose server restarted fails (the
        // connection manager reconnects for the next one), and a consumer should not fail to
        // start for that.
        let mut retried = false;
        loop {
            match join(&mut conn, &keys, &self.opts.group, &spec).await {
                Err(QueueError::Redis(e)) if !retried && (e.is_io_error() || e.is_connection_dropped()) => {
                    tracing::debug!(queue = %spec.queue, error = %e, "consumer setup failed on a dropped connection; retrying once");
                    retried = true;
                }
                r => break r?,
            }
        }
        // Connections of the consumer's own, opened on the caller's (lease thread's) runtime, so
        // that their I/O runs there, whatever the application's runtime is doing.
        let blocking = self.client.dedicated().await?;
        Ok(Arc::new(RedisConsumer {
            client: self.client.clone(),
            keys,
            group: self.opts.group.clone(),
            spec,
            conn,
            blocking: AsyncMutex::new(blocking),
            bell: keys::doorbell_group(&self.opts.group),
            rate: rate_args(spec_rate),
            key_rate: rate_args(spec_key_rate),
            promote_hint: std::sync::Mutex::new(None),
            resend: self.client.is_cluster().then(ResendPool::new),
        }))
    }

    async fn stats(&self, queue: &str) -> Result<QueueStats, QueueError> {
        let keys = self.keys(queue);
        let v: Value = STATS
            .run_read(
                &mut self.conn.clone(),
                &[
                    &keys.stream,
                    &keys.dead,
                    &keys.delayed,
                    &keys.liveness,
                    &keys.paused,
                    &keys.backoff,
                    &keys.caps[6],
                    &keys.caps[2],
                    &keys.caps[4],
                    &keys.key_rate,
                ],
                &[&self.opts.group, &PARKED, &QueueStats::MAX_KEYS, &1000],
            )
            .await?;
        let Value::Array(parts) = &v else { return Err(unexpected("stats", &v)) };
        if parts.len() != 12 {
            return Err(unexpected("stats", &v));
        }
        let n: Vec<u64> = parts[..11].iter().map(as_u64).collect();
        let [length, pending, consumers, lag, delayed, dead_letters, dead_consumers, paused_since, backoff, key_waiting, key_rate_delayed] =
            n[..]
        else {
            return Err(unexpected("stats", &v));
        };
        let mut per_key = Vec::new();
        if let Value::Array(list) = &parts[11] {
            for e in list {
                let Value::Array(f) = e else { return Err(unexpected("stats", &v)) };
                if f.len() != 4 {
                    return Err(unexpected("stats", &v));
                }
                per_key.push(crate::KeyStats {
                    key: as_string(&f[0]).unwrap_or_default(),
                    active: as_u64(&f[1]),
                    waiting: as_u64(&f[2]),
                    rate_delayed: as_u64(&f[3]),
                });
            }
        }
        let paused_since_ms = (paused_since > 0).then_some(paused_since);
        Ok(QueueStats {
            length,
            pending,
            consumers,
            lag,
            delayed,
            dead_letters,
            dead_consumers,
            paused: paused_since_ms.is_some(),
            paused_since_ms,
            backoff_ms: (backoff > 0).then_some(backoff),
            key_waiting,
            key_rate_delayed,
            keys: per_key,
        })
    }

    async fn set_paused(&self, queue: &str, paused: bool) -> Result<bool, QueueError> {
        let keys = self.keys(queue);
        let changed: i64 = PAUSE
            .run(&mut self.conn.clone(), &[&keys.paused, &keys.control], &[&(if paused { "1" } else { "0" })])
            .await?;
        Ok(changed == 1)
    }

    async fn consumers(&self, queue: &str, max_leases: usize) -> Result<Vec<crate::ConsumerInfo>, QueueError> {
        let keys = self.keys(queue);
        let v: Value = CONSUMERS
            .run_read(
                &mut self.conn.clone(),
                &[&keys.stream, &keys.liveness],
                &[&self.opts.group, &PARKED, &max_leases],
            )
            .await?;
        let Value::Array(parts) = &v else { return Err(unexpected("consumers", &v)) };
        let bad = || unexpected("consumers", &v);
        let int = |x: &Value| match x {
            Value::Int(i) => Some(*i as u64),
            other => as_string(other)?.parse().ok(),
        };
        let mut it = parts.iter();
        let now = it.next().and_then(int).ok_or_else(bad)?;
        let mut out = Vec::new();
        while let Some(name) = it.next() {
            let name = as_string(name).ok_or_else(bad)?;
            let pending = it.next().and_then(int).ok_or_else(bad)?;
            let record = it.next().and_then(as_string).ok_or_else(bad)?;
            let (seen, claim) = match record.split_once(':') {
                Some((s, c)) => (s.parse::<u64>().ok(), c.parse::<u64>().ok()),
                None => (None, None),
            };
            let n = it.next().and_then(int).ok_or_else(bad)?;
            let mut leases = Vec::with_capacity(n as usize);
            for _ in 0..n {
                let id = parse_id(&it.next().and_then(as_string).ok_or_else(bad)?)?;
                let idle_ms = it.next().and_then(int).ok_or_else(bad)?;
                let deliveries = it.next().and_then(int).ok_or_else(bad)? as u32;
                let payload = match it.next().ok_or_else(bad)? {
                    Value::BulkString(b) if !b.is_empty() => Some(Bytes::from(b.clone())),
                    _ => None,
                };
                leases.push(crate::LeaseInfo { id, idle_ms, deliveries, payload });
            }
            let alive = matches!((seen, claim), (Some(s), Some(c)) if now.saturating_sub(s) < c);
            out.push(crate::ConsumerInfo {
                name,
                alive,
                last_heartbeat_ms: seen,
                claim_timeout_ms: claim,
                pending,
                leases,
            });
        }
        Ok(out)
    }

    async fn dead_letters(&self, queue: &str, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        let keys = self.keys(queue);
        let v: Value = redis::cmd("XRANGE")
            .arg(&keys.dead)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(limit.max(1))
            .query_async(&mut self.conn.clone())
            .await?;
        let Value::Array(entries) = v else { return Err(unexpected("XRANGE", &v)) };
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let Value::Array(parts) = &e else { return Err(unexpected("XRANGE entry", &e)) };
            let id = parse_id(&as_string(&parts[0]).unwrap_or_default())?;
            let mut d = DeadLetter {
                id,
                original_id: MessageId::ZERO,
                payload: Bytes::new(),
                deliveries: 0,
                reason: String::new(),
                dead_lettered_at_ms: 0,
                concurrency_key: None,
                priority: 0,
            };
            for (k, v) in fields(&parts[1]) {
                match k.as_str() {
                    "id" => d.original_id = parse_id(&as_string(&v).unwrap_or_default())?,
                    PAYLOAD_FIELD => d.payload = bytes_of(&v).unwrap_or_default(),
                    "dc" => d.deliveries = as_u64(&v) as u32,
                    "reason" => d.reason = as_string(&v).unwrap_or_default(),
                    "at" => d.dead_lettered_at_ms = as_u64(&v),
                    keys::KEY_FIELD => d.concurrency_key = as_string(&v),
                    keys::PRIORITY_FIELD => d.priority = as_string(&v).and_then(|p| p.parse().ok()).unwrap_or(0),
                    _ => {}
                }
            }
            out.push(d);
        }
        Ok(out)
    }

    async fn replay_dead_letter(&self, queue: &str, id: MessageId) -> Result<MessageId, QueueError> {
        let keys = self.keys(queue);
        let r: Option<String> = REPLAY
            .run(&mut self.conn.clone(), &keys.with_caps(&[&keys.stream, &keys.dead]), &[&"one", &id.to_string()])
            .await?;
        match r {
            Some(s) => parse_id(&s),
            None => Err(QueueError::DeadLetterNotFound(id)),
        }
    }

    async fn replay_dead_letters(&self, queue: &str, limit: usize) -> Result<u64, QueueError> {
        let keys = self.keys(queue);
        Ok(REPLAY.run(&mut self.conn.clone(), &keys.with_caps(&[&keys.stream, &keys.dead]), &[&"all", &limit]).await?)
    }

    async fn purge_dead_letters(&self, queue: &str) -> Result<u64, QueueError> {
        let keys = self.keys(queue);
        let mut conn = self.conn.clone();
        let (n, _): (u64, i64) = redis::pipe()
            .atomic()
            .cmd("XLEN")
            .arg(&keys.dead)
            .cmd("DEL")
            .arg(&keys.dead)
            .query_async(&mut conn)
            .await?;
        Ok(n)
    }
}

/// What one gated read (`read.lua`) found.
struct Gated {
    /// The queue is paused: nothing was taken; wait on the control stream.
    paused: bool,
    /// When paused: the id to wait after in the control stream (running: empty, the wait is on
    /// the doorbell group).
    after: String,
    entries: Vec<RawDelivery>,
    /// A timed gate is shut (back-off or rate limit): it opens by itself after this long.
    wait: Option<(Duration, Throttle)>,
    /// Nothing was taken, but new entries are left to look at (`read.lua`'s `{4, ''}`): read
    /// again at once.
    again: bool,
}

/// `read.lua`'s rate limit arguments: the emission interval and burst tolerance in µs (with
/// their fraction), or `''` for none.
fn rate_args(r: Option<crate::RateLimit>) -> (String, String) {
    match r {
        Some(r) => {
            let us = |d: Duration| (d.as_nanos() as f64 / 1000.0).to_string();
            (us(r.interval()), us(r.tolerance()))
        }
        None => (String::new(), String::new()),
    }
}

struct RedisConsumer {
    client: RedisClient,
    keys: Keys,
    group: String,
    spec: ConsumerSpec,
    /// Scripts and non-blocking commands (opened on the lease thread).
    conn: RedisConn,
    /// The dedicated BLOCK connection; one read at a time.
    blocking: AsyncMutex<RedisConn>,
    /// The group's doorbell group ([`keys::doorbell_group`]).
    bell: String,
    /// The rate limit's arguments of `read.lua` ([`rate_args`]).
    rate: (String, String),
    /// The per-key rate limit's arguments of `read.lua` ([`rate_args`]).
    key_rate: (String, String),
    /// The earliest due time of the entries this consumer's reads delayed for the per-key rate
    /// limit, not handed to the engine yet ([`ConsumerBackend::take_promote_hint`]).
    promote_hint: std::sync::Mutex<Option<std::time::Instant>>,
    /// On Cluster: the re-send guards of this consumer's settle, retry_after and dead_letter
    /// calls, one lent per call ([`SETTLE_GUARDED`], [`RedisConsumer::run_guarded`]).
    resend: Option<ResendPool>,
}

impl RedisConsumer {
    /// Runs `plain` with `keys` and `args` on the consumer's shared connection: on standalone and
    /// Sentinel exactly [`LuaScript::run`]; on Cluster `guarded` instead (`plain` between
    /// [`RESEND_HEAD`] and [`RESEND_TAIL`]) under a guard lent from [`RedisConsumer::resend`] for
    /// the call (until its reply), its key (`p:q:{q}:resend:<guard id>`) last in KEYS and its
    /// token and lifetime last in ARGV, so that a copy the Cluster client re-sends is answered
    /// with the first copy's reply. For the single-entry writes (`retry_after`, `dead_letter`);
    /// `settle` builds its command itself (sized to its batch) with the same guard.
    async fn run_guarded<T: redis::FromRedisValue>(
        &self,
        plain: &LuaScript,
        guarded: &LuaScript,
        keys: &[&str],
        args: &[&dyn baton_redis::ArgLike],
    ) -> redis::RedisResult<T> {
        let Some(pool) = &self.resend else { return plain.run(&mut self.conn.clone(), keys, args).await };
        let guard = pool.acquire();
        let mut cmd = guarded.evalsha_cmd(keys.len() + 1);
        for k in keys {
            cmd.arg(*k);
        }
        cmd.arg(guard.key(&self.keys.stream));
        for a in args {
            baton_redis::ArgLike::push(*a, &mut cmd);
        }
        guard.push_args(&mut cmd);
        let r = guarded.query(&mut self.conn.clone(), &cmd).await;
        drop(guard);
        r
    }

    /// No stamp of the queue's clock for this long means an outage (see `reclaim.lua`): the claim
    /// timeout less one heartbeat interval, the longest a live consumer's lease can go unrenewed
    /// without being at risk; never below the heartbeat interval (the normal gap between stamps).
    fn outage_gap_ms(&self) -> u64 {
        let claim = self.spec.claim_timeout;
        claim.saturating_sub(self.spec.heartbeat).max(self.spec.heartbeat).as_millis() as u64
    }

    async fn recreate_group(&self) -> Result<(), QueueError> {
        tracing::warn!(queue = %self.spec.queue, "consumer group missing (NOGROUP); recreating it");
        join(&mut self.conn.clone(), &self.keys, &self.group, &self.spec).await
    }

    fn parse_read(&self, v: Value) -> Result<Vec<RawDelivery>, QueueError> {
        let streams = match v {
            Value::Nil => return Ok(Vec::new()),
            Value::Array(s) => s,
            Value::Map(m) => m.into_iter().map(|(k, v)| Value::Array(vec![k, v])).collect(),
            other => return Err(unexpected("XREADGROUP", &other)),
        };
        let mut out = Vec::new();
        for s in streams {
            let Value::Array(kv) = s else { continue };
            let Some(Value::Array(entries)) = kv.get(1) else { continue };
            for e in entries {
                let Value::Array(parts) = e else { continue };
                let id = parse_id(&as_string(&parts[0]).unwrap_or_default())?;
                let mut payload = None;
                let mut prior = 0u32;
                for (k, v) in fields(parts.get(1).unwrap_or(&Value::Nil)) {
                    match k.as_str() {
                        PAYLOAD_FIELD => payload = bytes_of(&v),
                        "dc" => prior = as_u64(&v) as u32,
                        _ => {}
                    }
                }
                out.push(RawDelivery { id, payload, deliveries: prior + 1, fence: 0 });
            }
        }
        Ok(out)
    }

    /// The gated read's `EVALSHA` (`read.lua`, module docs).
    fn read_cmd(&self, count: usize) -> redis::Cmd {
        let mut cmd = READ.evalsha_cmd(9 + keys::CAPS_KEYS);
        cmd.arg(&self.keys.stream).arg(&self.keys.paused);
        for k in &self.keys.caps {
            cmd.arg(k);
        }
        cmd.arg(&self.keys.rate)
            .arg(&self.keys.backoff)
            .arg(&self.keys.delayed)
            .arg(&self.keys.delayed_payloads)
            .arg(&self.keys.key_rate)
            .arg(&self.keys.key_rate_expiry)
            .arg(&self.keys.key_rate_line)
            .arg(&self.group)
            .arg(&self.spec.consumer)
            .arg(count.max(1))
            .arg(&self.bell)
            .arg(self.spec.max_concurrency.unwrap_or(0))
            .arg(self.spec.concurrency_per_key.unwrap_or(0))
            .arg(&self.rate.0)
            .arg(&self.rate.1)
            .arg(&self.key_rate.0)
            .arg(&self.key_rate.1);
        cmd
    }

    /// What `read.lua` replied.
    fn parse_gated(&self, v: Value) -> Result<Gated, QueueError> {
        let Value::Array(mut parts) = v else { return Err(unexpected("read", &v)) };
        if parts.len() < 2 {
            return Err(unexpected("read", &Value::Array(parts)));
        }
        let code = as_u64(&parts[0]);
        let paused = code == 1;
        let wait = match code {
            2 => Some((Duration::from_millis(as_u64(&parts[1]).max(1)), Throttle::Backoff)),
            3 => Some((Duration::from_millis(as_u64(&parts[1]).max(1)), Throttle::RateLimit)),
            _ => None,
        };
        let after = if wait.is_some() { String::new() } else { as_string(&parts[1]).unwrap_or_default() };
        let entries = match parts.get_mut(2) {
            // The entry list of one stream, as XREADGROUP replies it inside its stream pair.
            Some(list) => self.parse_read(Value::Array(vec![Value::Array(vec![Value::Nil, std::mem::take(list)])]))?,
            None => Vec::new(),
        };
        // Entries moved to the delayed set by the per-key rate limit: ms until the earliest is due.
        if let Some(Value::Int(ms)) = parts.get(3) {
            if *ms >= 0 {
                let due = std::time::Instant::now() + Duration::from_millis(*ms as u64);
                let mut hint = self.promote_hint.lock().unwrap_or_else(|p| p.into_inner());
                *hint = Some(hint.map_or(due, |h| h.min(due)));
            }
        }
        Ok(Gated { paused, after, entries, wait, again: code == 4 })
    }

    /// One gated read, not waiting, on the shared connection.
    async fn gated_read(&self, count: usize) -> Result<Gated, QueueError> {
        let v: Value = READ.query(&mut self.conn.clone(), &self.read_cmd(count)).await?;
        self.parse_gated(v)
    }

    /// Waits up to `wait` for a new entry (or, paused, for a resume: an entry after `g.after` in
    /// the control stream) without taking anything, and then reads again through the gate — both
    /// pipelined on the dedicated connection, so that Redis runs the gated read the moment the
    /// wait ends, without a round trip in between. Running, the wait is an `XREADGROUP … NOACK
    /// BLOCK` on the doorbell group, which hands each new entry to one waiter only; paused, an
    /// `XREAD BLOCK` on the control stream, which wakes every waiter. `None`: no reply in time.
    async fn wait_then_read(&self, g: &Gated, wait: Duration, count: usize) -> Result<Option<Gated>, QueueError> {
        let block = wait.as_millis().max(1) as u64;
        let mut xread = if g.paused { redis::cmd("XREAD") } else { redis::cmd("XREADGROUP") };
        if !g.paused {
            xread.arg("GROUP").arg(&self.bell).arg(keys::DOORBELL_WAITER);
        }
        xread.arg("COUNT").arg(1);
        if !g.paused {
            xread.arg("NOACK");
        }
        xread.arg("BLOCK").arg(block).arg("STREAMS");
        if g.paused {
            xread.arg(&self.keys.control).arg(&g.after);
        } else {
            xread.arg(&self.keys.stream).arg(">");
        }
        let mut pipe = redis::pipe();
        pipe.add_command(xread).ignore().add_command(self.read_cmd(count));
        let mut conn = self.blocking.lock().await;
        // The connection has no response timeout: bound the wait ourselves.
        let bound = wait + Duration::from_secs(5);
        match tokio::time::timeout(bound, pipe.query_async::<(Value,)>(&mut *conn)).await {
            Ok(Ok((v,))) => Ok(Some(self.parse_gated(v)?)),
            // The script cache was flushed (Redis restarted, failed over): the read on the shared
            // connection loads it.
            Ok(Err(e)) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                drop(conn);
                Ok(Some(self.gated_read(count).await?))
            }
            Ok(Err(e)) => Err(e.into()),
            Err(_) => {
                // No reply in time: open a fresh connection so a late reply cannot be misread.
                // Entries the pipelined read may have taken stay pending under this consumer
                // without being held: the next heartbeat hands them to the parked owner as
                // orphans.
                if let Ok(fresh) = self.client.dedicated().await {
                    *conn = fresh;
                }
                Ok(None)
            }
        }
    }

    fn ids_of(v: &Value) -> Result<Vec<MessageId>, QueueError> {
        match v {
            Value::Array(items) => items.iter().map(|i| parse_id(&as_string(i).unwrap_or_default())).collect(),
            Value::Nil => Ok(Vec::new()),
            other => Err(unexpected("id list", other)),
        }
    }
}

#[async_trait]
impl ConsumerBackend for RedisConsumer {
    async fn read_new(&self, count: usize, block: Duration) -> Result<Vec<RawDelivery>, QueueError> {
        let deadline = tokio::time::Instant::now() + block;
        let mut g = self.gated_read(count).await;
        loop {
            let got = match g {
                Ok(got) => got,
                Err(QueueError::Redis(e)) if is_nogroup(&e) => {
                    self.recreate_group().await?;
                    return Ok(Vec::new());
                }
                Err(e) => return Err(e),
            };
            if let Some((_, why)) = got.wait {
                metrics::counter!("baton_queue_throttled_total", "queue" => self.spec.queue.clone(), "reason" => why.reason())
                    .increment(1);
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            // Entries delayed by the per-key rate limit: back to the engine at once, which
            // promotes them at their due time.
            let delayed = self.promote_hint.lock().unwrap_or_else(|p| p.into_inner()).is_some();
            if !got.entries.is_empty() || delayed || left < Duration::from_millis(1) {
                return Ok(got.entries);
            }
            if got.again {
                g = self.gated_read(count).await;
                continue;
            }
            if let Some((wait, _)) = got.wait {
                // A timed gate: it opens by itself; sleep until then (within this wait) and read
                // again. Nothing is taken meanwhile.
                if wait > left {
                    tokio::time::sleep(left).await;
                    return Ok(Vec::new());
                }
                tokio::time::sleep(wait).await;
                g = self.gated_read(count).await;
                continue;
            }
            // Nothing taken: wait (taking nothing) for an offer, or for a resume when paused.
            g = match self.wait_then_read(&got, left, count).await {
                Ok(Some(next)) => Ok(next),
                Ok(None) => return Ok(Vec::new()),
                Err(e) => Err(e),
            };
        }
    }

    fn take_promote_hint(&self) -> Option<std::time::Instant> {
        self.promote_hint.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    async fn back_off(&self, delay: Duration) -> Result<(), QueueError> {
        let ms = delay.as_nanos().div_ceil(1_000_000).clamp(1, u64::MAX as u128) as u64;
        let _: i64 = BACKOFF.run(&mut self.conn.clone(), &[&self.keys.backoff], &[&ms]).await?;
        Ok(())
    }

    async fn reclaim(&self, count: usize, exclude: &[MessageId]) -> Result<Reclaimed, QueueError> {
        let max = self.spec.max_deliveries.unwrap_or(0);
        let claim_ms = self.spec.claim_timeout.as_millis() as u64;
        let mut cmd = RECLAIM.evalsha_cmd(6 + keys::CAPS_KEYS);
        cmd.arg(&self.keys.stream)
            .arg(&self.keys.dead)
            .arg(&self.keys.delayed)
            .arg(&self.keys.delayed_payloads)
            .arg(&self.keys.liveness)
            .arg(&self.keys.fences);
        for k in &self.keys.caps {
            cmd.arg(k);
        }
        cmd.arg(&self.group)
            .arg(&self.spec.consumer)
            .arg(PARKED)
            .arg(claim_ms)
            .arg(count)
            .arg(max)
            .arg(PROMOTE_PER_TICK)
            .arg(self.outage_gap_ms());
        for id in exclude {
            cmd.arg(id.to_string());
        }
        let v: Value = match RECLAIM.query(&mut self.conn.clone(), &cmd).await {
            Ok(v) => v,
            Err(e) if is_nogroup(&e) => {
                self.recreate_group().await?;
                return Ok(Reclaimed::default());
            }
            Err(e) => return Err(e.into()),
        };
        let Value::Array(parts) = &v else { return Err(unexpected("reclaim", &v)) };
        if parts.len() != 6 {
            return Err(unexpected("reclaim", &v));
        }
        let next_due = match &parts[5] {
            Value::Int(ms) if *ms >= 0 => Some(Duration::from_millis(*ms as u64)),
            _ => None,
        };
        let mut out = Reclaimed {
            dead_lettered: as_u64(&parts[1]),
            deleted: as_u64(&parts[2]),
            promoted: as_u64(&parts[3]),
            more: as_u64(&parts[4]) == 1,
            next_due,
            ..Default::default()
        };
        if let Value::Array(items) = &parts[0] {
            for it in items {
                let Value::Array(t) = it else { return Err(unexpected("reclaim entry", it)) };
                if t.len() != 4 {
                    return Err(unexpected("reclaim entry", it));
                }
                let id = parse_id(&as_string(&t[0]).unwrap_or_default())?;
                let payload = bytes_of(&t[1]);
                out.deliveries.push(RawDelivery {
                    id,
                    payload,
                    deliveries: as_u64(&t[2]) as u32,
                    fence: as_u64(&t[3]),
                });
            }
        }
        Ok(out)
    }

    async fn settle(&self, items: &[Settle]) -> Result<Vec<Owned>, QueueError> {
        // On Cluster a guard lent for this call (held until its reply), its key last.
        let guard = self.resend.as_ref().map(ResendPool::acquire);
        let (script, extra) = if guard.is_some() { (&SETTLE_GUARDED, 1) } else { (&SETTLE, 0) };
        let mut cmd = script.evalsha_cmd_with_capacity(
            2 + keys::CAPS_KEYS + extra,
            14 + 3 * extra + 3 * items.len(),
            256 + 128 * extra + 40 * items.len(),
        );
        cmd.arg(&self.keys.stream).arg(&self.keys.fences);
        for k in &self.keys.caps {
            cmd.arg(k);
        }
        if let Some(g) = &guard {
            cmd.arg(g.key(&self.keys.stream));
        }
        cmd.arg(&self.group).arg(&self.spec.consumer).arg(PARKED);
        for s in items {
            let op = match (s.op, s.released) {
                (SettleOp::Ack, false) => "a",
                (SettleOp::Ack, true) => "A",
                (SettleOp::Park, false) => "p",
                (SettleOp::Park, true) => "P",
            };
            cmd.arg(op).arg(s.id.to_string()).arg(fence_arg(s.fence));
        }
        if let Some(g) = &guard {
            g.push_args(&mut cmd);
        }
        let r = script.query::<Vec<i64>, _>(&mut self.conn.clone(), &cmd).await;
        drop(guard);
        match r {
            Ok(v) => Ok(v.into_iter().map(owned).collect()),
            // The group is gone (Redis restarted without persistence): nothing is pending.
            Err(e) if is_nogroup(&e) => Ok(vec![Owned::Gone; items.len()]),
            Err(e) => Err(e.into()),
        }
    }

    fn redis_target(&self) -> Option<crate::RedisAckTarget> {
        Some(crate::RedisAckTarget {
            stream: self.keys.stream.clone(),
            group: self.group.clone(),
            consumer: self.spec.consumer.clone(),
            fences: self.keys.fences.clone(),
            caps: self.keys.caps.clone(),
        })
    }

    async fn retry_after(
        &self,
        id: MessageId,
        delay: Duration,
        released: bool,
        fence: Option<u64>,
    ) -> Result<Owned, QueueError> {
        let r: redis::RedisResult<i64> = self
            .run_guarded(
                &RETRY_AFTER,
                &RETRY_AFTER_GUARDED,
                &self.keys.with_caps(&[
                    &self.keys.stream,
                    &self.keys.delayed,
                    &self.keys.delayed_payloads,
                    &self.keys.fences,
                ]),
                &[
                    &self.group,
                    &self.spec.consumer,
                    &PARKED,
                    &id.to_string(),
                    &(self.spec.claim_timeout.as_millis() as u64),
                    &(delay.as_millis() as u64),
                    &(if released { "1" } else { "0" }),
                    &fence_arg(fence),
                ],
            )
            .await;
        match r {
            Ok(v) => Ok(owned(v)),
            Err(e) if is_nogroup(&e) => Ok(Owned::Gone),
            Err(e) => Err(e.into()),
        }
    }

    async fn dead_letter(
        &self,
        id: MessageId,
        deliveries: u32,
        reason: &str,
        released: bool,
        fence: Option<u64>,
    ) -> Result<Owned, QueueError> {
        let r: redis::RedisResult<i64> = self
            .run_guarded(
                &DEAD_LETTER,
                &DEAD_LETTER_GUARDED,
                &self.keys.with_caps(&[&self.keys.stream, &self.keys.dead, &self.keys.fences]),
                &[
                    &self.group,
                    &self.spec.consumer,
                    &PARKED,
                    &id.to_string(),
                    &deliveries,
                    &reason,
                    &(if released { "1" } else { "0" }),
                    &fence_arg(fence),
                ],
            )
            .await;
        match r {
            Ok(v) => Ok(owned(v)),
            Err(e) if is_nogroup(&e) => Ok(Owned::Gone),
            Err(e) => Err(e.into()),
        }
    }

    async fn heartbeat(
        &self,
        renew: &[MessageId],
        fences: &[u64],
        quiet: &[MessageId],
        release: &[MessageId],
        orphan_idle: Duration,
        pel_limit: usize,
    ) -> Result<Beat, QueueError> {
        debug_assert!(fences.is_empty() || fences.len() == renew.len());
        let fences = if fences.len() == renew.len() { fences } else { &[] };
        let n = renew.len() + fences.len() + quiet.len() + release.len();
        let mut cmd = HEARTBEAT.evalsha_cmd_with_capacity(3, 16 + n, 256 + 24 * n);
        cmd.arg(&self.keys.stream)
            .arg(&self.keys.liveness)
            .arg(&self.keys.fences)
            .arg(&self.group)
            .arg(&self.spec.consumer)
            .arg(PARKED)
            .arg(self.spec.claim_timeout.as_millis() as u64)
            .arg(orphan_idle.as_millis() as u64)
            .arg(pel_limit.max(1))
            .arg(self.outage_gap_ms())
            .arg(renew.len());
        for id in renew {
            cmd.arg(id.to_string());
        }
        cmd.arg(fences.len());
        for f in fences {
            cmd.arg(*f);
        }
        cmd.arg(quiet.len());
        for id in quiet {
            cmd.arg(id.to_string());
        }
        for id in release {
            cmd.arg(id.to_string());
        }
        let v: Value = match HEARTBEAT.query(&mut self.conn.clone(), &cmd).await {
            Ok(v) => v,
            // The group is gone (Redis restarted without persistence): nothing is pending; the
            // group is recreated by the next read.
            Err(e) if is_nogroup(&e) => return Ok(Beat { gone: renew.to_vec(), ..Default::default() }),
            Err(e) => return Err(e.into()),
        };
        let Value::Array(parts) = &v else { return Err(unexpected("heartbeat", &v)) };
        if parts.len() != 4 {
            return Err(unexpected("heartbeat", &v));
        }
        let stale = match &parts[3] {
            Value::Array(p) => p.iter().map(|i| (as_u64(i) as usize).saturating_sub(1)).collect(),
            _ => Vec::new(),
        };
        Ok(Beat { lost: Self::ids_of(&parts[0])?, gone: Self::ids_of(&parts[1])?, orphans: as_u64(&parts[2]), stale })
    }

    async fn reap_idle_consumers(&self, window: Duration) -> Result<u64, QueueError> {
        let r: redis::RedisResult<u64> = REAP
            .run(
                &mut self.conn.clone(),
                &[&self.keys.stream, &self.keys.liveness],
                &[&self.group, &self.spec.consumer, &PARKED, &(window.as_millis() as u64)],
            )
            .await;
        match r {
            Ok(n) => Ok(n),
            Err(e) if is_nogroup(&e) => Ok(0),
            Err(e) => Err(e.into()),
        }
    }

    async fn requeue(&self, ids: &[MessageId], fences: &[u64]) -> Result<u64, QueueError> {
        debug_assert!(fences.is_empty() || fences.len() == ids.len());
        let mut cmd = REQUEUE.evalsha_cmd(2 + keys::CAPS_KEYS);
        cmd.arg(&self.keys.stream).arg(&self.keys.fences);
        for k in &self.keys.caps {
            cmd.arg(k);
        }
        cmd.arg(&self.group).arg(&self.spec.consumer);
        for (i, id) in ids.iter().enumerate() {
            cmd.arg(id.to_string()).arg(fence_arg(fences.get(i).copied()));
        }
        match REQUEUE.query::<u64, _>(&mut self.conn.clone(), &cmd).await {
            Ok(n) => Ok(n),
            Err(e) if is_nogroup(&e) => Ok(0),
            Err(e) => Err(e.into()),
        }
    }

    async fn leave(&self) -> Result<bool, QueueError> {
        let r: redis::RedisResult<i64> = LEAVE
            .run(
                &mut self.conn.clone(),
                &[&self.keys.stream, &self.keys.liveness],
                &[&self.group, &self.spec.consumer, &(self.spec.claim_timeout.as_millis() as u64)],
            )
            .await;
        match r {
            Ok(v) => Ok(v == 1),
            Err(e) if is_nogroup(&e) => Ok(true),
            Err(e) => Err(e.into()),
        }
    }
}
