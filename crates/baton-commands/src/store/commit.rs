//! Group commit of the Redis store's hot writes: per home queue and kind (state transitions,
//! submits), at most one script call is in flight from this store; writes started meanwhile
//! queue up and go together in the next call (at most [`Batch::MAX`]), where the script decides
//! each one exactly as it would alone and merges the writes they share (index, expiry, ack and
//! announcement writes). Under load a call carries many writes (fewer script calls and Redis
//! commands per command); a lone write is sent at once. All keys of a batch are in the home
//! queue's hash slot (see the crate docs), so a batch is valid on Redis Cluster.
//!
//! The mechanism is [`baton_redis::group_commit`]; the calls are sent from a spawned task, so a
//! caller that stops waiting never strands the writes queued behind it. On Redis Cluster each
//! call is guarded against the client's re-sent copies ([`baton_redis::resend`]: one guard per
//! kind, whose one call in flight per queue is what the guard needs): a transition applied and
//! then re-sent would otherwise answer its own write as a conflict.

use std::sync::Arc;

use baton_redis::group_commit::{self, Committer, GroupCommitOptions};
use baton_redis::redis::{self, RedisError, Value};
use baton_redis::resend::{ResendGuard, RESEND_HEAD, RESEND_TAIL};
use baton_redis::{DurableWriter, LuaScript, RedisConn};

static TRANSITIONS: LuaScript = LuaScript::from_parts(
    "transitions",
    &[
        include_str!("../../scripts/lib.lua"),
        baton_queue::keys::CAPS_LUA,
        include_str!("../../scripts/transitions.lua"),
    ],
);
static SUBMITS: LuaScript = LuaScript::new(
    "submits",
    concat!(include_str!("../../scripts/lib.lua"), include_str!("../../scripts/submits.lua")),
);
/// [`TRANSITIONS`] and [`SUBMITS`] under a re-send guard: what Cluster deployments send.
static TRANSITIONS_GUARDED: LuaScript = LuaScript::from_parts(
    "transitions",
    &[
        RESEND_HEAD,
        include_str!("../../scripts/lib.lua"),
        baton_queue::keys::CAPS_LUA,
        include_str!("../../scripts/transitions.lua"),
        RESEND_TAIL,
    ],
);
static SUBMITS_GUARDED: LuaScript = LuaScript::from_parts(
    "submits",
    &[RESEND_HEAD, include_str!("../../scripts/lib.lua"), include_str!("../../scripts/submits.lua"), RESEND_TAIL],
);

/// A kind of batched write: how a batch becomes one script call.
pub(crate) trait Batch: Sized + Send + 'static {
    /// Writes per call at most.
    const MAX: usize;
    /// The script, unguarded (what standalone and Sentinel deployments send).
    const SCRIPT: &'static LuaScript;
    /// The same script under a re-send guard ([`baton_redis::resend`]: what Cluster sends).
    const GUARDED: &'static LuaScript;
    /// [`Batch::GUARDED`] when `guarded`, else [`Batch::SCRIPT`].
    fn script(guarded: bool) -> &'static LuaScript {
        if guarded {
            Self::GUARDED
        } else {
            Self::SCRIPT
        }
    }
    /// The `EVALSHA` command for `items` (all of one home queue, whose keys are `keys`), started
    /// with [`LuaScript::evalsha_cmd_with_capacity`] on [`Batch::script`]; with `guard`, of the
    /// guarded script, with the guard's key and arguments ([`baton_redis::resend`]).
    fn command(keys: &BatchKeys, items: &[Self], guard: Option<&ResendGuard>) -> redis::Cmd;
}

/// One compare-and-set (the arguments of `transitions.lua`, see there).
pub(crate) struct Transition {
    pub state_key: String,
    /// `<version - 1> <OLD STATUS> `.
    pub expected: String,
    /// The new stored state (header and JSON).
    pub value: Vec<u8>,
    pub ttl_ms: u64,
    pub id: String,
    /// KEYS positions (2..=6) of the old and new status indexes.
    pub old_index: usize,
    pub new_index: usize,
    /// Entry id of the delivery (on the home queue's stream) to check or ack, or empty.
    pub entry: String,
    /// The announcement (terminal writes), or empty.
    pub announce: String,
    /// The consumer that must own `entry` for the write to happen, or empty (no check).
    pub owner: String,
    /// Ack `entry` with a successful write.
    pub ack: bool,
    /// With `owner`: the fence `entry`'s delivery must still have (its number), or empty (any).
    pub fence: String,
    /// The event to append to the feed with the write (stored JSON), or empty; the feed's length.
    pub event: String,
    pub feed_max: u64,
    /// The completion hook body to enqueue on the delivery queue with the write, or empty.
    pub hook: String,
    /// The per-minute counter a successful write adds one to (`s`, `f`, `c`, `r`) or empty, and
    /// the start (ms) of the handler call whose outcome it is, or empty (see `minutes.rs`).
    pub minute_field: &'static str,
    pub minute_start: String,
}

impl Batch for Transition {
    const MAX: usize = 128;
    const SCRIPT: &'static LuaScript = &TRANSITIONS;
    const GUARDED: &'static LuaScript = &TRANSITIONS_GUARDED;
    fn command(keys: &BatchKeys, batch: &[Self], guard: Option<&ResendGuard>) -> redis::Cmd {
        let n = batch.len();
        let bytes = 256
            + batch
                .iter()
                .map(|t| {
                    t.state_key.len()
                        + t.value.len()
                        + t.expected.len()
                        + t.id.len()
                        + t.announce.len()
                        + t.owner.len()
                        + t.event.len()
                        + t.hook.len()
                        + 112
                })
                .sum::<usize>();
        let g = usize::from(guard.is_some());
        let mut cmd = Self::script(guard.is_some()).evalsha_cmd_with_capacity(
            11 + baton_queue::keys::CAPS_KEYS + n + g,
            6 + 17 + n * 17 + 3 * g,
            bytes + 384,
        );
        for k in &keys.index {
            cmd.arg(k);
        }
        cmd.arg(&keys.stream).arg(&keys.fences).arg(&keys.feed).arg(&keys.hooks).arg(&keys.minutes);
        for t in batch {
            cmd.arg(&t.state_key);
        }
        for k in &keys.caps {
            cmd.arg(k);
        }
        if let Some(g) = guard {
            cmd.arg(g.key(&keys.base));
        }
        cmd.arg(n).arg(&keys.channel).arg(&keys.group);
        for t in batch {
            cmd.arg(&t.expected)
                .arg(&t.value)
                .arg(t.ttl_ms)
                .arg(&t.id)
                .arg(t.old_index)
                .arg(t.new_index)
                .arg(&t.entry)
                .arg(&t.announce)
                .arg(&t.owner)
                .arg(if t.ack { "1" } else { "" })
                .arg(&t.fence)
                .arg(&t.event)
                .arg(t.feed_max)
                .arg(&t.hook)
                .arg(t.minute_field)
                .arg(&t.minute_start);
        }
        if let Some(g) = guard {
            g.push_args(&mut cmd);
        }
        cmd
    }
}

/// One submit (the arguments of `submits.lua`, see there).
pub(crate) struct Submit {
    pub state_key: String,
    /// The id → queue lookup key, written by the script (standalone) or `None` (Cluster: written
    /// before, in its own slot).
    pub lookup_key: Option<String>,
    /// The stored state (header and JSON).
    pub value: Arc<[u8]>,
    pub body_sha: String,
    pub created_ms: u64,
    pub msg: Arc<[u8]>,
    pub id: String,
    /// Standalone: the queue whose stale lookup this submit may take over (empty: none).
    pub takeover: String,
    pub ttl_ms: u64,
    pub lookup_ttl_ms: u64,
    /// The shortest lifetime a state of this store can have (ms).
    pub min_lifetime_ms: u64,
    /// The `submitted` event to append to the feed when created (stored JSON), or empty; the
    /// feed's length.
    pub event: Arc<str>,
    pub feed_max: u64,
    /// A scheduled command's due time (ms since the epoch), or `None` to enqueue at once.
    pub due_ms: Option<u64>,
    /// The entry's concurrency key (`baton_queue::keys::KEY_FIELD`), if any.
    pub concurrency_key: Option<String>,
    /// The entry's priority (`baton_queue::keys::PRIORITY_FIELD` when not 0).
    pub priority: i8,
}

impl Batch for Submit {
    const MAX: usize = 128;
    const SCRIPT: &'static LuaScript = &SUBMITS;
    const GUARDED: &'static LuaScript = &SUBMITS_GUARDED;
    fn command(keys: &BatchKeys, batch: &[Self], guard: Option<&ResendGuard>) -> redis::Cmd {
        let n = batch.len();
        let lookups = batch.iter().all(|s| s.lookup_key.is_some());
        let bytes = 256
            + batch
                .iter()
                .map(|s| 2 * s.state_key.len() + s.value.len() + s.msg.len() + 2 * s.id.len() + s.event.len() + 112)
                .sum::<usize>();
        let per = if lookups { 2 } else { 1 };
        let g = usize::from(guard.is_some());
        let mut cmd = Self::script(guard.is_some()).evalsha_cmd_with_capacity(
            7 + per * n + g,
            16 + n * 15 + 3 * g,
            bytes + 264 * n + 128,
        );
        cmd.arg(&keys.index[0])
            .arg(&keys.index[1])
            .arg(&keys.stream)
            .arg(&keys.feed)
            .arg(&keys.delayed)
            .arg(&keys.delayed_payloads)
            // The queue's ready entries hash (`baton_queue::keys::ready_entries`): its `~new` mark.
            .arg(&keys.caps[7]);
        for s in batch {
            cmd.arg(&s.state_key);
            if let (true, Some(l)) = (lookups, &s.lookup_key) {
                cmd.arg(l);
            }
        }
        if let Some(g) = guard {
            cmd.arg(g.key(&keys.base));
        }
        // Lifetimes are the store's: the same for every submit of a batch.
        let first = &batch[0];
        cmd.arg(n)
            .arg(if lookups { "1" } else { "" })
            .arg(&keys.queue)
            .arg(first.ttl_ms)
            .arg(first.lookup_ttl_ms)
            .arg(first.min_lifetime_ms);
        for s in batch {
            cmd.arg(&*s.value)
                .arg(&s.body_sha)
                .arg(s.created_ms)
                .arg(&*s.msg)
                .arg(&s.id)
                .arg(&s.takeover)
                .arg(&*s.event)
                .arg(s.feed_max);
            match s.due_ms {
                Some(ms) => cmd.arg(ms).arg(s.ttl_ms).arg(s.lookup_ttl_ms),
                None => cmd.arg("").arg("").arg(""),
            };
            cmd.arg(s.concurrency_key.as_deref().unwrap_or("")).arg(s.priority);
        }
        if let Some(g) = guard {
            g.push_args(&mut cmd);
        }
        cmd
    }
}

/// The keys shared by a home queue's batched writes.
#[derive(Clone)]
pub(crate) struct BatchKeys {
    pub queue: String,
    /// `<prefix>:cmd:{<queue>}`: the prefix of the home queue's keys (its hash tag).
    pub base: String,
    /// The expiry zset, then the five status indexes.
    pub index: [String; 6],
    /// The home queue's stream.
    pub stream: String,
    /// Its fence hash (`baton_queue::keys::fences`).
    pub fences: String,
    /// Its concurrency-cap keys (`baton_queue::keys::caps`).
    pub caps: [String; baton_queue::keys::CAPS_KEYS],
    /// Its delayed set and their payloads (`baton_queue::keys::delayed`, `delayed_payloads`):
    /// where scheduled commands wait.
    pub delayed: String,
    pub delayed_payloads: String,
    /// Its event feed (see `feed.rs`).
    pub feed: String,
    /// Its completion hooks' delivery stream (see `hooks.rs`).
    pub hooks: String,
    /// Its per-minute aggregates (see `minutes.rs`).
    pub minutes: String,
    pub channel: String,
    pub group: String,
}

type Reply = Result<Value, (redis::ErrorKind, String)>;

/// See the module docs: [`baton_redis::group_commit`] per home queue, sent from a spawned task.
pub(crate) struct GroupCommit<T: Batch> {
    conn: RedisConn,
    /// With opt-in durability: the connections whose batches wait for replicas (`WAIT`).
    durable: Option<DurableWriter>,
    /// On Cluster: the guard of this kind's calls (see the module docs).
    guard: Option<Arc<ResendGuard>>,
    calls: group_commit::GroupCommit<String, T, Reply>,
}

impl<T: Batch> GroupCommit<T> {
    /// `cluster`: guard every call against the Cluster client's re-sent copies.
    pub fn new(conn: RedisConn, durable: Option<DurableWriter>, cluster: bool) -> Self {
        let options = GroupCommitOptions { max_items: T::MAX, ..GroupCommitOptions::default() };
        let guard = cluster.then(|| Arc::new(ResendGuard::new()));
        Self { conn, durable, guard, calls: group_commit::GroupCommit::new(options) }
    }

    fn sender(&self, keys: &BatchKeys) -> ScriptCall {
        ScriptCall {
            conn: self.conn.clone(),
            keys: keys.clone(),
            durable: self.durable.clone(),
            guard: self.guard.clone(),
        }
    }

    /// Runs `item` (a write of home queue `keys.queue`) in the next call for that queue.
    /// Returns the script's reply for it. Errors: the Redis error of the call that carried it.
    pub async fn run(&self, keys: &BatchKeys, item: T) -> Result<Value, RedisError> {
        reply(self.calls.submit(&keys.queue, item, || self.sender(keys)).await)
    }
}

impl<T: Batch> GroupCommit<T> {
    /// Runs `items` (writes of home queue `keys.queue`) together: one call for up to
    /// [`Batch::MAX`] of them (behind a call in flight), no other write between them. Returns
    /// the script's reply for each, in order.
    pub async fn run_many(&self, keys: &BatchKeys, items: Vec<T>) -> Vec<Result<Value, RedisError>> {
        self.calls.submit_many(&keys.queue, items, || self.sender(keys)).await.into_iter().map(reply).collect()
    }
}

fn reply(r: Result<Reply, group_commit::Abandoned>) -> Result<Value, RedisError> {
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err((kind, detail))) => Err(RedisError::from((kind, "batched write failed", detail))),
        Err(group_commit::Abandoned) => Err(RedisError::from((redis::ErrorKind::Io, "batched write dropped"))),
    }
}

/// Sends the batches of one home queue: one [`Batch::script`] call each.
struct ScriptCall {
    conn: RedisConn,
    keys: BatchKeys,
    durable: Option<DurableWriter>,
    guard: Option<Arc<ResendGuard>>,
}

impl<T: Batch> Committer<String, T, Reply> for ScriptCall {
    async fn commit(&mut self, _queue: &String, items: Vec<T>) -> Vec<Reply> {
        let n = items.len();
        let cmd = T::command(&self.keys, &items, self.guard.as_deref());
        drop(items);
        let script = T::script(self.guard.is_some());
        let r: redis::RedisResult<Value> = match &self.durable {
            Some(w) => w.query(script, &self.keys.queue, &cmd).await,
            None => script.query(&mut self.conn, &cmd).await,
        };
        match r {
            Ok(Value::Array(replies)) if replies.len() == n => replies.into_iter().map(Ok).collect(),
            Ok(other) => {
                let detail = format!("{}: unexpected reply {other:?}", script.name());
                vec![Err((redis::ErrorKind::Parse, detail)); n]
            }
            Err(e) => vec![Err((e.kind(), e.to_string())); n],
        }
    }
}
