//! Redis state store (standalone or Cluster). Key layout and slot choice: see the crate docs.
//! Scripts (in `scripts/`, each prefixed with `lib.lua`): `submits` and `transitions`
//! (group-committed, see `commit.rs`), `transition` (hand-offs and acks on another queue's
//! stream), `list`, `counts`, `prune`. On Cluster the state writes are guarded against the
//! client's re-sent copies (`baton_redis::resend`): the group-committed ones by their committer's guard,
//! the single ones (`transition`, `reschedule`, `schedule_cas`) by a guard lent per call from
//! [`RedisStateBackend::resend`].

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use baton_redis::redis::{self, Value};
use baton_redis::resend::{ResendPool, RESEND_HEAD, RESEND_TAIL};
use baton_redis::{LuaScript, RedisClient, RedisConn};
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};

use super::backend::{
    status_slot, Cas, CommandStoreSettings, FeedAppend, Hub, Peeked, Rescheduled, StateBackend, SubmitItem,
    SubmitOutcome,
};
use super::commit::{BatchKeys, GroupCommit, Submit, Transition};
use crate::feed::{CommandEvent, EventFrom, EventOffset, EventPage};
use crate::model::{CommandMsg, Cursor};
use crate::{CommandError, CommandState, CommandStatus, StatusCounts};

static TRANSITION: LuaScript = LuaScript::from_parts(
    "transition",
    &[include_str!("../../scripts/lib.lua"), baton_queue::keys::CAPS_LUA, include_str!("../../scripts/transition.lua")],
);
/// [`TRANSITION`], [`RESCHEDULE`] and [`SCHEDULE_CAS`] under a re-send guard
/// ([`baton_redis::resend`], a guard from [`RedisStateBackend::resend`] per call): what Cluster
/// deployments send.
static TRANSITION_GUARDED: LuaScript = LuaScript::from_parts(
    "transition",
    &[
        RESEND_HEAD,
        include_str!("../../scripts/lib.lua"),
        baton_queue::keys::CAPS_LUA,
        include_str!("../../scripts/transition.lua"),
        RESEND_TAIL,
    ],
);
static RESCHEDULE_GUARDED: LuaScript = LuaScript::from_parts(
    "reschedule",
    &[RESEND_HEAD, include_str!("../../scripts/lib.lua"), include_str!("../../scripts/reschedule.lua"), RESEND_TAIL],
);
static SCHEDULE_CAS_GUARDED: LuaScript =
    LuaScript::from_parts("schedule_cas", &[RESEND_HEAD, include_str!("../../scripts/schedule_cas.lua"), RESEND_TAIL]);
static LOOKUP_TAKEOVER: LuaScript =
    LuaScript::new("lookup_takeover", include_str!("../../scripts/lookup_takeover.lua"));
static LIST: LuaScript =
    LuaScript::new("list", concat!(include_str!("../../scripts/lib.lua"), include_str!("../../scripts/list.lua")));
static SCHEDULE_READ: LuaScript = LuaScript::new("schedule_read", include_str!("../../scripts/schedule_read.lua"));
static SCHEDULE_CAS: LuaScript = LuaScript::new("schedule_cas", include_str!("../../scripts/schedule_cas.lua"));
static PRUNE: LuaScript =
    LuaScript::new("prune", concat!(include_str!("../../scripts/lib.lua"), include_str!("../../scripts/prune.lua")));
static MINUTES_READ: LuaScript = LuaScript::new(
    "minutes_read",
    concat!(include_str!("../../scripts/lib.lua"), include_str!("../../scripts/minutes_read.lua")),
);
static MINUTES_SAMPLE: LuaScript = LuaScript::new(
    "minutes_sample",
    concat!(include_str!("../../scripts/lib.lua"), include_str!("../../scripts/minutes_sample.lua")),
);
static FEED_READ: LuaScript = LuaScript::new("feed_read", include_str!("../../scripts/feed_read.lua"));
static RESCHEDULE: LuaScript = LuaScript::new(
    "reschedule",
    concat!(include_str!("../../scripts/lib.lua"), include_str!("../../scripts/reschedule.lua")),
);
static COUNTS: LuaScript =
    LuaScript::new("counts", concat!(include_str!("../../scripts/lib.lua"), include_str!("../../scripts/counts.lua")));

/// Last byte of a stored state that a header read (`GETRANGE <key> 0 HEAD_MAX`) covers: the
/// header is `<version> <STATUS> <created ms> <body sha1> ` (20 + 9 + 14 + 40 characters and 4
/// spaces at most). The scripts' copy is `local HEAD_MAX` in `scripts/lib.lua`; the two must
/// stay equal (checked by a test).
const HEAD_MAX: usize = 99;

/// The id → queue lookup key outlives the state by this much.
const LOOKUP_MARGIN: Duration = Duration::from_secs(3600);
/// Cluster: how long a submit waits for the state of another queue's lookup to appear before it
/// takes the lookup over as stale (that queue's submit writes its lookup, then its script).
const CLAIM_GRACE: Duration = Duration::from_secs(2);

/// Options of the Redis command store.
#[derive(Clone, Debug)]
pub struct RedisCommandStoreOptions {
    /// Prefix of every key; also the work queue's prefix. Default
    /// [`baton_queue::keys::DEFAULT_PREFIX`] (`baton`). No braces.
    pub key_prefix: String,
    /// Consumer group of the command queues. Default [`baton_queue::keys::DEFAULT_GROUP`] (`baton`).
    pub group: String,
    /// State lifetimes.
    pub settings: CommandStoreSettings,
}

impl Default for RedisCommandStoreOptions {
    fn default() -> Self {
        Self {
            key_prefix: baton_queue::keys::DEFAULT_PREFIX.into(),
            group: baton_queue::keys::DEFAULT_GROUP.into(),
            settings: CommandStoreSettings::default(),
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Submits to one queue between two that also prune its expired index entries (`scripts/prune.lua`).
const PRUNE_EVERY: u64 = 64;
/// Most index candidates one such prune visits (more than [`PRUNE_EVERY`], so pruning keeps up
/// with states expiring as fast as they are submitted).
const PRUNE_MAX: u64 = 300;

/// The prefix of every key of `queue`'s command records that lives in the queue's hash slot:
/// `<prefix>:cmd:{<queue>}` (state keys `:id:<id>`, indexes, cron schedules, re-send guards).
fn queue_base(prefix: &str, queue: &str) -> String {
    format!("{prefix}:cmd:{{{queue}}}")
}

/// Keys of one home queue.
struct QKeys {
    /// The index keys (exp, then the 5 status zsets, see `scripts/lib.lua`), the queue's stream
    /// (named by `baton_queue::keys`) and channel:
    /// also what this queue's batched writes need (see `commit.rs`).
    batch: BatchKeys,
    state_prefix: String,
    /// Submits to this queue so far; every [`PRUNE_EVERY`]th one prunes its indexes (per queue:
    /// a store-wide count could always land on the same queue and never prune the others).
    submits: std::sync::atomic::AtomicU64,
}

impl QKeys {
    fn new(prefix: &str, group: &str, queue: &str) -> Self {
        let base = queue_base(prefix, queue);
        let index = [
            format!("{base}:exp"),
            format!("{base}:s:SUBMITTED"),
            format!("{base}:s:RUNNING"),
            format!("{base}:s:SUCCEEDED"),
            format!("{base}:s:FAILED"),
            format!("{base}:s:CANCELLED"),
        ];
        let batch = BatchKeys {
            queue: queue.to_string(),
            base: base.clone(),
            index,
            stream: baton_queue::keys::stream(prefix, queue),
            fences: baton_queue::keys::fences(prefix, queue),
            caps: baton_queue::keys::caps(prefix, queue),
            delayed: baton_queue::keys::delayed(prefix, queue),
            delayed_payloads: baton_queue::keys::delayed_payloads(prefix, queue),
            feed: format!("{base}:feed"),
            hooks: baton_queue::keys::stream(&crate::hook_prefix(prefix), queue),
            minutes: format!("{base}:minutes"),
            channel: format!("{base}:events"),
            group: group.to_string(),
        };
        Self {
            batch,
            // `:id:` keeps every state key apart from the index keys (`:exp`, `:s:<STATUS>`),
            // whatever the id (ids may hold ':').
            state_prefix: format!("{base}:id:"),
            submits: std::sync::atomic::AtomicU64::new(0),
        }
    }
    fn state(&self, id: &str) -> String {
        format!("{}{id}", self.state_prefix)
    }
    fn exp(&self) -> &str {
        &self.batch.index[0]
    }
    /// The index of `status`.
    fn status_index(&self, status: CommandStatus) -> &str {
        &self.batch.index[status.index() + 1]
    }
}

pub(crate) struct RedisStateBackend {
    conn: RedisConn,
    cluster: bool,
    prefix: String,
    settings: CommandStoreSettings,
    stream: baton_queue::MessageStream,
    pubsub: PubSubHandle,
    /// Key names per home queue, built once (bounded: cleared past [`QKEYS_MAX`] queues).
    qkeys: Mutex<HashMap<String, Arc<QKeys>>>,
    /// Tag of this store in its notifications, so it can tell its own writes (already
    /// delivered locally) from other processes' ones.
    origin: Arc<str>,
    /// State reads (`load`, `peek`), coalesced into one `MGET` per home queue per turn.
    reads: super::batch::ReadBatcher,
    /// Consumer group of the command queues.
    group: String,
    /// Transitions and submits, group-committed per home queue (see `commit.rs`).
    transitions: GroupCommit<Transition>,
    submits: GroupCommit<Submit>,
    /// With opt-in durability: the connections of writes that wait for replicas.
    durable: Option<baton_redis::DurableWriter>,
    /// On Cluster: the re-send guards of the single (not group-committed) writes, one lent per
    /// call: transitions with an enqueue or an ack on another queue's stream, reschedules and
    /// schedule compare-and-sets (`baton_redis::resend`).
    resend: Option<ResendPool>,
    client: RedisClient,
    hub: Arc<Hub>,
    /// Queues whose feed a tail watcher follows now (see [`StateBackend::feed_watch`]).
    tails: Arc<Mutex<HashSet<String>>>,
}

/// A tail watcher's `XREAD BLOCK` slice, ms.
const TAIL_BLOCK_MS: u64 = 2_000;

const QKEYS_MAX: usize = 10_000;

fn parse_state(id: &str, raw: &[u8]) -> Result<CommandState, CommandError> {
    serde_json::from_slice(raw).map_err(|e| CommandError::Corrupt { id: id.to_string(), reason: e.to_string() })
}

/// A stored state string split: `<version> <STATUS> <created ms> <body sha1> <JSON>` (written by
/// `scripts/submits.lua`, `scripts/transitions.lua` and `scripts/transition.lua`) → version,
/// status, JSON.
fn split_stored<'a>(id: &str, raw: &'a [u8]) -> Result<(u64, CommandStatus, &'a [u8]), CommandError> {
    let corrupt = |why: &str| CommandError::Corrupt { id: id.to_string(), reason: format!("stored state: {why}") };
    let mut parts = raw.splitn(5, |b| *b == b' ');
    let (Some(v), Some(s), Some(_created), Some(_sha), Some(json)) =
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(corrupt("no header"));
    };
    let version = std::str::from_utf8(v).ok().and_then(|v| v.parse().ok()).ok_or_else(|| corrupt("bad version"))?;
    let status = std::str::from_utf8(s).map_err(|_| corrupt("bad status"))?.parse()?;
    Ok((version, status, json))
}

/// The state in a stored state string, with its body hash from the header.
fn parse_stored(id: &str, raw: &[u8]) -> Result<CommandState, CommandError> {
    let mut st = parse_state(id, split_stored(id, raw)?.2)?;
    st.body_sha.0 = body_sha_of(raw).to_string();
    Ok(st)
}

/// The body hash field of a stored state's header (empty if malformed).
fn body_sha_of(raw: &[u8]) -> &str {
    let sha = raw.split(|b| *b == b' ').nth(3).unwrap_or_default();
    std::str::from_utf8(sha).unwrap_or_default()
}

/// A stored state string (see `scripts/lib.lua`): header, then `json`.
fn stored(st: &CommandState, json: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(json.len() + 96);
    out.extend_from_slice(
        format!("{} {} {} {} ", st.version, st.status.as_str(), st.created_at.millis(), st.body_sha.0).as_bytes(),
    );
    out.extend_from_slice(json);
    out
}

fn bytes(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

fn string(v: &Value) -> Option<String> {
    match v {
        Value::Int(i) => Some(i.to_string()),
        other => bytes(other).map(|b| String::from_utf8_lossy(b).into_owned()),
    }
}

fn unexpected(what: &str, v: &Value) -> CommandError {
    CommandError::Redis(redis::RedisError::from((
        redis::ErrorKind::Parse,
        "unexpected reply",
        format!("{what}: {v:?}"),
    )))
}

impl RedisStateBackend {
    pub async fn connect(
        client: RedisClient,
        options: RedisCommandStoreOptions,
        stream: baton_queue::MessageStream,
        hub: Arc<Hub>,
    ) -> Result<Self, CommandError> {
        if options.key_prefix.is_empty() || options.key_prefix.contains(['{', '}']) {
            return Err(CommandError::InvalidSettings("key_prefix must be non-empty and hold no braces".into()));
        }
        let conn = client.shared().await?;
        let reads = super::batch::ReadBatcher::new(conn.clone());
        let durable = client.durable_writer().await?;
        let cluster = client.is_cluster();
        let (transitions, submits) = (
            GroupCommit::new(conn.clone(), durable.clone(), cluster),
            GroupCommit::new(conn.clone(), durable.clone(), cluster),
        );
        let origin: Arc<str> = uuid::Uuid::now_v7().simple().to_string().into();
        let pubsub = PubSubHandle::start(client.clone(), hub.clone(), origin.clone());
        Ok(Self {
            conn,
            cluster: client.is_cluster(),
            prefix: options.key_prefix,
            settings: options.settings,
            stream,
            pubsub,
            qkeys: Mutex::new(HashMap::new()),
            origin,
            reads,
            group: options.group,
            transitions,
            submits,
            durable,
            resend: cluster.then(ResendPool::new),
            client,
            hub,
            tails: Arc::default(),
        })
    }

    fn keys(&self, queue: &str) -> Arc<QKeys> {
        if let Some(k) = self.qkeys.lock().unwrap().get(queue) {
            return k.clone();
        }
        let k = Arc::new(QKeys::new(&self.prefix, &self.group, queue));
        let mut m = self.qkeys.lock().unwrap();
        if m.len() >= QKEYS_MAX {
            m.clear();
        }
        m.insert(queue.to_string(), k.clone());
        k
    }

    /// The shortest lifetime a state written by this store can have: its expiry-index score at
    /// submit (a lower bound of every later expiry, see `scripts/lib.lua`).
    fn min_lifetime_ms(&self, queue: &str) -> u64 {
        let l = self.settings.lifetimes_of(queue);
        l.state_ttl.min(l.retention).as_millis() as u64
    }

    /// The record of `queue`'s cron schedule `name`: in the queue's hash slot, apart from its
    /// state keys (`:id:`) and indexes.
    fn schedule_key(&self, queue: &str, name: &str) -> String {
        format!("{}:sched:{name}", queue_base(&self.prefix, queue))
    }

    fn lookup_key(&self, id: &str) -> String {
        format!("{}:cmdid:{{{id}}}", self.prefix)
    }

    /// Readies `st` for a write that gives its state key `ttl`: extends the lookup key first
    /// where the state would otherwise outlive it (by up to 10 minutes; the key then gets `ttl` +
    /// [`LOOKUP_MARGIN`] and `st.lookup_expires_ms` says so), and fills in `st.body_sha` from the
    /// stored state's header where it is empty (a state not read from Redis; never the case in
    /// the service). Used by a transition and a reschedule, each with its own `ttl`.
    async fn prepare_write(
        &self,
        conn: &mut RedisConn,
        k: &QKeys,
        st: &mut CommandState,
        ttl: Duration,
    ) -> Result<(), CommandError> {
        let now = now_ms();
        if st.lookup_expires_ms < now + (ttl + Duration::from_secs(600)).as_millis() as u64 {
            let lookup_ttl = ttl + LOOKUP_MARGIN;
            let _: i64 = redis::cmd("PEXPIRE")
                .arg(self.lookup_key(&st.id))
                .arg(lookup_ttl.as_millis() as u64)
                .query_async(conn)
                .await?;
            st.lookup_expires_ms = now + lookup_ttl.as_millis() as u64;
        }
        if st.body_sha.0.is_empty() {
            let head: Vec<u8> =
                redis::cmd("GETRANGE").arg(k.state(&st.id)).arg(0).arg(HEAD_MAX).query_async(conn).await?;
            st.body_sha.0 = body_sha_of(&head).to_string();
        }
        Ok(())
    }

    /// Submits `items`, all homed in `home`, together (see `CommandStore::submit_many`): on
    /// Cluster each id's lookup first (its own slot, all at once), then one `submits.lua` call
    /// for up to 128 of them through the group commit; each reply decided as alone. A submit
    /// that finds a stale lookup of another queue goes again with leave to take it over (at
    /// most 3 rounds).
    ///
    /// Cluster: a submit whose lookup names another queue (which may be a submit there in
    /// flight: [`CLAIM_GRACE`]) is sent on its own as soon as its lookup is claimed, not with
    /// the batch: a claimed lookup without its state reads as stale to another store after
    /// `CLAIM_GRACE`, so its script must follow the claim at once, as a submit alone does,
    /// not wait for the slowest claim of the batch (the two queues would then both create
    /// the id). Every copy of such an id in the batch goes with it, in order.
    async fn submit_home(&self, home: &str, items: &[SubmitItem<'_>]) -> Vec<Result<SubmitOutcome, CommandError>> {
        let n = items.len();
        let k = self.keys(home);
        let min_lifetime_ms = self.min_lifetime_ms(home);
        let preps: Vec<Prepared> = items
            .iter()
            .map(|it| {
                let state = it.state;
                // A scheduled command's state lives its delay longer (it waits that long first).
                let ttl = self.settings.ttl_for(home, state.status) + state.scheduled_delay();
                let lookup_ttl = ttl + LOOKUP_MARGIN;
                let mut st = state.clone();
                st.lookup_expires_ms = now_ms() + lookup_ttl.as_millis() as u64;
                st.body_sha.0 = sha1_smol::Sha1::from(it.body).digest().to_string();
                let value = stored(&st, &st.stored_json());
                let (event, feed_max): (Arc<str>, u64) = match it.event {
                    Some(e) => (e.json.as_str().into(), e.max_len),
                    None => ("".into(), 0),
                };
                Prepared {
                    state_key: k.state(&state.id),
                    lookup: self.lookup_key(&state.id),
                    // Shared, so that a retried submit does not copy them again.
                    value: value.into(),
                    msg: it.msg.to_bytes().into(),
                    event,
                    feed_max,
                    ttl,
                    lookup_ttl,
                    st,
                }
            })
            .collect();
        let before = k.submits.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        if before.div_ceil(PRUNE_EVERY) < (before + n as u64).div_ceil(PRUNE_EVERY) {
            // Every PRUNE_EVERY-th submit of the queue, in the background: no submit waits for it.
            let (mut conn, k) = (self.conn.clone(), k.clone());
            tokio::spawn(async move {
                let keys: Vec<&str> = k.batch.index.iter().map(|s| s.as_str()).collect();
                if let Err(e) = PRUNE.run::<i64>(&mut conn, &keys, &[&PRUNE_MAX]).await {
                    tracing::debug!(error = %e, "pruning the command indexes failed; the next prune retries");
                }
            });
        }
        let mut out: Vec<Option<Result<Option<SubmitOutcome>, CommandError>>> = (0..n).map(|_| None).collect();
        if !self.cluster {
            let all: Vec<usize> = (0..n).collect();
            for (i, r) in all.iter().zip(self.send(home, &k, &preps, &all, min_lifetime_ms).await) {
                out[*i] = Some(r);
            }
        } else {
            // Lookup keys first (their own slots); a crash before the script leaves one without
            // a state, which reads as "not found" and is taken over by a later submit.
            let first =
                futures::future::join_all(preps.iter().map(|p| self.claim_at_once(&p.lookup, home, p.lookup_ttl)))
                    .await;
            let mut slow: Vec<(&str, Vec<usize>)> = Vec::new();
            for (i, r) in first.into_iter().enumerate() {
                let id = preps[i].st.id.as_str();
                match r {
                    Ok(None) => {}
                    Ok(Some(_)) => {
                        if !slow.iter().any(|(s, _)| *s == id) {
                            slow.push((id, Vec::new()));
                        }
                    }
                    Err(e) => out[i] = Some(Err(e)),
                }
            }
            for i in 0..n {
                if let Some((_, at)) = slow.iter_mut().find(|(s, _)| *s == preps[i].st.id) {
                    out[i] = None;
                    at.push(i);
                }
            }
            let fast: Vec<usize> =
                (0..n).filter(|&i| out[i].is_none() && !slow.iter().any(|(_, at)| at.contains(&i))).collect();
            let slow_runs = slow.iter().map(|(_, at)| {
                let (k, preps) = (&k, &preps);
                async move {
                    let p = &preps[at[0]];
                    match self.claim_lookup(&p.lookup, home, &p.st.id, p.lookup_ttl).await {
                        Ok(true) => self.send(home, k, preps, at, min_lifetime_ms).await,
                        Ok(false) => at.iter().map(|_| Ok(Some(SubmitOutcome::OtherQueue))).collect(),
                        Err(e) => {
                            // The first copy gets the error; the others the same, rebuilt.
                            let text = e.to_string();
                            let mut first = Some(e);
                            at.iter()
                                .map(|_| {
                                    Err(first.take().unwrap_or_else(|| {
                                        CommandError::Redis(redis::RedisError::from((
                                            redis::ErrorKind::Io,
                                            "claiming the id lookup failed",
                                            text.clone(),
                                        )))
                                    }))
                                })
                                .collect()
                        }
                    }
                }
            });
            let (fast_out, slow_out) = futures::future::join(
                self.send(home, &k, &preps, &fast, min_lifetime_ms),
                futures::future::join_all(slow_runs),
            )
            .await;
            for (i, r) in fast.iter().zip(fast_out) {
                out[*i] = Some(r);
            }
            for ((_, at), rs) in slow.iter().zip(slow_out) {
                for (i, r) in at.iter().zip(rs) {
                    out[*i] = Some(r);
                }
            }
        }
        out.into_iter()
            .zip(preps)
            .map(|(r, p)| match r {
                Some(Ok(None)) => Ok(SubmitOutcome::Created(p.st)),
                Some(Ok(Some(o))) => Ok(o),
                Some(Err(e)) => Err(e),
                None => Ok(SubmitOutcome::OtherQueue),
            })
            .collect()
    }

    /// Sends the submits `at` of `preps` (their lookups claimed on Cluster), as
    /// [`Self::send_wave`]: the first copy of each id first, then (when one id is given more than
    /// once) the second copies once the first are decided, and so on. Copies of an id in one
    /// wave could be in two script calls, and a call cut by a dropped connection is sent again
    /// after the calls behind it: a later copy could then be stored before an earlier one
    /// (body B before body A of the same id: A would get the conflict).
    async fn send(
        &self,
        home: &str,
        k: &QKeys,
        preps: &[Prepared],
        at: &[usize],
        min_lifetime_ms: u64,
    ) -> Vec<Result<Option<SubmitOutcome>, CommandError>> {
        if at.len() <= 1 {
            return self.send_wave(home, k, preps, at, min_lifetime_ms).await;
        }
        let mut seen: HashMap<&str, usize> = HashMap::new();
        let rank: Vec<usize> = at
            .iter()
            .map(|&i| {
                let r = seen.entry(preps[i].st.id.as_str()).or_default();
                *r += 1;
                *r - 1
            })
            .collect();
        let waves = rank.iter().copied().max().map_or(0, |m| m + 1);
        if waves <= 1 {
            return self.send_wave(home, k, preps, at, min_lifetime_ms).await;
        }
        let mut out: Vec<Option<Result<Option<SubmitOutcome>, CommandError>>> = at.iter().map(|_| None).collect();
        for w in 0..waves {
            let js: Vec<usize> = (0..at.len()).filter(|&j| rank[j] == w).collect();
            let wave: Vec<usize> = js.iter().map(|&j| at[j]).collect();
            for (j, r) in js.into_iter().zip(self.send_wave(home, k, preps, &wave, min_lifetime_ms).await) {
                out[j] = Some(r);
            }
        }
        out.into_iter().map(|r| r.unwrap_or(Ok(Some(SubmitOutcome::OtherQueue)))).collect()
    }

    /// Sends the submits `at` of `preps` (their lookups claimed on Cluster): one `submits.lua`
    /// call for up to 128 through the group commit, in order; a call cut by a dropped
    /// connection is sent once more (a submit is idempotent), and (standalone) a submit that
    /// found a stale lookup of another queue goes again with leave to take it over (at most 3
    /// rounds). Per submit: `Ok(None)` created by this call, else its outcome.
    async fn send_wave(
        &self,
        home: &str,
        k: &QKeys,
        preps: &[Prepared],
        at: &[usize],
        min_lifetime_ms: u64,
    ) -> Vec<Result<Option<SubmitOutcome>, CommandError>> {
        let n = at.len();
        let mut out: Vec<Option<Result<Option<SubmitOutcome>, CommandError>>> = (0..n).map(|_| None).collect();
        let mut takeover: Vec<String> = vec![String::new(); n];
        for _ in 0..3 {
            let pending: Vec<usize> = (0..n).filter(|&j| out[j].is_none()).collect();
            if pending.is_empty() {
                break;
            }
            let item = |j: usize| {
                let p = &preps[at[j]];
                let st = &p.st;
                Submit {
                    state_key: p.state_key.clone(),
                    lookup_key: (!self.cluster).then(|| p.lookup.clone()),
                    value: p.value.clone(),
                    body_sha: st.body_sha.0.clone(),
                    created_ms: st.created_at.millis(),
                    msg: p.msg.clone(),
                    id: st.id.clone(),
                    takeover: takeover[j].clone(),
                    ttl_ms: p.ttl.as_millis() as u64,
                    lookup_ttl_ms: p.lookup_ttl.as_millis() as u64,
                    min_lifetime_ms,
                    event: p.event.clone(),
                    feed_max: p.feed_max,
                    due_ms: st.run_at.map(|t| t.millis()),
                    concurrency_key: st.concurrency_key.clone(),
                    priority: st.priority,
                }
            };
            let mut replies = self.run_submits(&k.batch, pending.iter().map(|&j| item(j)).collect()).await;
            // A submit is idempotent (same id and body: the stored state), so one cut by a
            // dropped connection (e.g. the first call after a Redis restart) is sent once more;
            // if the first attempt did run, the second finds its state.
            let cut: Vec<usize> = (0..pending.len())
                .filter(|&c| matches!(&replies[c], Err(e) if e.is_io_error() || e.is_connection_dropped()))
                .collect();
            if !cut.is_empty() {
                tracing::debug!(queue = %home, submits = cut.len(), "submits failed on a dropped connection; retrying once");
                let again = self.run_submits(&k.batch, cut.iter().map(|&c| item(pending[c])).collect()).await;
                for (c, r) in cut.into_iter().zip(again) {
                    replies[c] = r;
                }
            }
            for (j, r) in pending.into_iter().zip(replies) {
                let decided = match r {
                    Ok(v) => self.submit_reply(&preps[at[j]].st, &v).await,
                    Err(e) => Ok(Decided::Outcome(Box::new(Err(e.into())))),
                };
                match decided {
                    Ok(Decided::Created) => out[j] = Some(Ok(None)),
                    Ok(Decided::Outcome(r)) => out[j] = Some((*r).map(Some)),
                    Ok(Decided::TakeOver(home)) => takeover[j] = home,
                    Err(e) => out[j] = Some(Err(e)),
                }
            }
        }
        out.into_iter().map(|r| r.unwrap_or(Ok(Some(SubmitOutcome::OtherQueue)))).collect()
    }

    /// What `submits.lua` answered for the submit of `st`.
    async fn submit_reply(&self, st: &CommandState, v: &Value) -> Result<Decided, CommandError> {
        let Value::Array(parts) = v else { return Err(unexpected("submit", v)) };
        Ok(match parts.first().and_then(string).as_deref() {
            Some("created") => Decided::Created,
            Some("existing") => {
                let raw = parts.get(1).and_then(bytes).ok_or_else(|| unexpected("submit", v))?;
                let stored = parse_stored(&st.id, raw)?;
                // Our own token: this submit's first attempt stored it (its reply was cut by a
                // dropped connection, and this is the retry): created by this call.
                if stored.token == st.token {
                    Decided::Outcome(Box::new(Ok(SubmitOutcome::Created(stored))))
                } else {
                    Decided::Outcome(Box::new(Ok(SubmitOutcome::Existing(stored))))
                }
            }
            Some("conflict") => {
                // A state stored by a version before the exact-params store carries the hash
                // of its canonical body: same meaning by that rule is the same command.
                let prior = parts.get(1).and_then(bytes);
                let legacy = crate::json::legacy_canonical_body(&st.command_type, &st.params)
                    .map(|b| sha1_smol::Sha1::from(b).digest().to_string());
                match (prior, legacy) {
                    (Some(raw), Some(sha)) if body_sha_of(raw) == sha => {
                        Decided::Outcome(Box::new(Ok(SubmitOutcome::Existing(parse_stored(&st.id, raw)?))))
                    }
                    _ => Decided::Outcome(Box::new(Ok(SubmitOutcome::Conflict))),
                }
            }
            Some("other_queue") => {
                // Standalone: the lookup names another queue; a real conflict only if the
                // command still exists there (else the lookup outlived an expired state).
                // The script writes state and lookup together, so a lookup without its state
                // is never a submit in flight here. Retried with leave to take over that
                // queue's lookup, in the script, in the same step as the create: of submits
                // racing for it one wins, the others then see its queue (and its state).
                let home = parts.get(1).and_then(string).unwrap_or_default();
                if self.load(&home, &st.id).await?.is_some() {
                    Decided::Outcome(Box::new(Ok(SubmitOutcome::OtherQueue)))
                } else {
                    Decided::TakeOver(home)
                }
            }
            _ => return Err(unexpected("submit", v)),
        })
    }

    /// Cluster: one try of [`Self::claim_lookup`] that never waits: `Ok(None)` when the lookup
    /// was free or named `queue` already (now `queue`'s, its lifetime extended),
    /// `Ok(Some(other))` when it names another queue (left as it is, for
    /// [`Self::claim_lookup`]).
    async fn claim_at_once(
        &self,
        lookup: &str,
        queue: &str,
        lookup_ttl: Duration,
    ) -> Result<Option<String>, CommandError> {
        let mut conn = self.conn.clone();
        let prior: Option<String> = redis::cmd("SET")
            .arg(lookup)
            .arg(queue)
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(lookup_ttl.as_millis() as u64)
            .query_async(&mut conn)
            .await?;
        match prior {
            None => Ok(None),
            Some(home) if home == queue => {
                let _: () = redis::cmd("PEXPIRE")
                    .arg(lookup)
                    .arg(lookup_ttl.as_millis() as u64)
                    .arg("GT")
                    .query_async(&mut conn)
                    .await?;
                Ok(None)
            }
            Some(other) => Ok(Some(other)),
        }
    }

    /// Cluster: points the lookup of `id` at `queue` before its state is written (`SET NX
    /// GET`). `Ok(false)`: it names another queue where the command exists (or appears within
    /// [`CLAIM_GRACE`], a submit there in flight), or it could not be taken over in 3 tries.
    async fn claim_lookup(
        &self,
        lookup: &str,
        queue: &str,
        id: &str,
        lookup_ttl: Duration,
    ) -> Result<bool, CommandError> {
        for _ in 0..3 {
            let Some(home) = self.claim_at_once(lookup, queue, lookup_ttl).await? else { return Ok(true) };
            // Another queue's lookup without its state may be a submit of that queue still in
            // flight (its script runs after its lookup write): give it `CLAIM_GRACE` to appear
            // before calling the lookup stale.
            if self.appears(&home, id, CLAIM_GRACE).await? {
                return Ok(false);
            }
            if self.take_over(lookup, &home, queue, lookup_ttl).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// `items` through the submits' group commit: one call for up to 128 (a lone one as
    /// [`GroupCommit::run`]).
    async fn run_submits(&self, keys: &BatchKeys, mut items: Vec<Submit>) -> Vec<Result<Value, redis::RedisError>> {
        if items.len() == 1 {
            let one = items.pop().expect("one item");
            return vec![self.submits.run(keys, one).await];
        }
        self.submits.run_many(keys, items).await
    }

    /// Whether the state of `id` exists on `home`, or appears there within `grace` (polled).
    async fn appears(&self, home: &str, id: &str, grace: Duration) -> Result<bool, CommandError> {
        let until = tokio::time::Instant::now() + grace;
        loop {
            if self.load(home, id).await?.is_some() {
                return Ok(true);
            }
            if tokio::time::Instant::now() >= until {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Points `lookup` at `queue` if it still names `stale` (`lookup_takeover.lua`).
    async fn take_over(&self, lookup: &str, stale: &str, queue: &str, ttl: Duration) -> Result<bool, CommandError> {
        let took: i64 = LOOKUP_TAKEOVER
            .run(&mut self.conn.clone(), &[lookup], &[&stale, &queue, &(ttl.as_millis() as u64)])
            .await?;
        Ok(took == 1)
    }
}

/// One submit of a batch, built once for every round it is sent in.
struct Prepared {
    state_key: String,
    lookup: String,
    value: Arc<[u8]>,
    msg: Arc<[u8]>,
    event: Arc<str>,
    feed_max: u64,
    ttl: Duration,
    lookup_ttl: Duration,
    /// The state as stored when created (the outcome's when created).
    st: CommandState,
}

/// How a submit's reply decides it.
enum Decided {
    /// Stored by this call.
    Created,
    Outcome(Box<Result<SubmitOutcome, CommandError>>),
    /// Standalone: another queue's lookup without its state; send again with leave to take it over.
    TakeOver(String),
}

#[async_trait]
impl StateBackend for RedisStateBackend {
    async fn schedule_read(&self, queue: &str, name: &str) -> Result<(Option<String>, i64), CommandError> {
        let key = self.schedule_key(queue, name);
        let (raw, now): (String, i64) = SCHEDULE_READ.run(&mut self.conn.clone(), &[&key], &[]).await?;
        Ok(((!raw.is_empty()).then_some(raw), now))
    }

    async fn schedule_cas(
        &self,
        queue: &str,
        name: &str,
        expected: Option<&str>,
        new: &str,
    ) -> Result<bool, CommandError> {
        let key = self.schedule_key(queue, name);
        let written: i64 = match &self.resend {
            Some(pool) => {
                // The guard key next to the record: `<prefix>:cmd:{<queue>}:resend:<id>`.
                let guard = pool.acquire();
                let mut cmd = SCHEDULE_CAS_GUARDED.evalsha_cmd(2);
                cmd.arg(&key).arg(guard.key(&queue_base(&self.prefix, queue)));
                cmd.arg(expected.unwrap_or("")).arg(new);
                guard.push_args(&mut cmd);
                SCHEDULE_CAS_GUARDED.query(&mut self.conn.clone(), &cmd).await?
            }
            None => SCHEDULE_CAS.run(&mut self.conn.clone(), &[&key], &[&expected.unwrap_or(""), &new]).await?,
        };
        Ok(written == 1)
    }

    async fn submit(
        &self,
        state: &CommandState,
        body: &str,
        msg: &CommandMsg,
        event: Option<&FeedAppend>,
    ) -> Result<SubmitOutcome, CommandError> {
        let item = SubmitItem { state, body, msg, event };
        let mut out = self.submit_home(&state.queue, std::slice::from_ref(&item)).await;
        out.pop()
            .unwrap_or_else(|| Err(CommandError::Corrupt { id: state.id.clone(), reason: "no submit outcome".into() }))
    }

    async fn submit_many(&self, items: &[SubmitItem<'_>]) -> Vec<Result<SubmitOutcome, CommandError>> {
        let mut homes: Vec<&str> = items.iter().map(|it| it.state.queue.as_str()).collect();
        homes.sort_unstable();
        homes.dedup();
        if homes.len() <= 1 {
            return match homes.first() {
                Some(home) => self.submit_home(home, items).await,
                None => Vec::new(),
            };
        }
        let mut out: Vec<Option<Result<SubmitOutcome, CommandError>>> = (0..items.len()).map(|_| None).collect();
        for home in homes {
            let at: Vec<usize> = (0..items.len()).filter(|&i| items[i].state.queue == home).collect();
            let mine: Vec<SubmitItem<'_>> = at.iter().map(|&i| items[i]).collect();
            for (i, r) in at.into_iter().zip(self.submit_home(home, &mine).await) {
                out[i] = Some(r);
            }
        }
        out.into_iter()
            .zip(items)
            .map(|(r, it)| {
                r.unwrap_or_else(|| {
                    Err(CommandError::Corrupt { id: it.state.id.clone(), reason: "no submit outcome".into() })
                })
            })
            .collect()
    }

    async fn load(&self, home: &str, id: &str) -> Result<Option<CommandState>, CommandError> {
        let raw = self.reads.get(home, self.keys(home).state(id)).await?;
        raw.map(|r| parse_stored(id, &r)).transpose()
    }

    async fn peek(&self, home: &str, id: &str) -> Result<Option<Peeked>, CommandError> {
        let raw = self.reads.get(home, self.keys(home).state(id)).await?;
        let Some(raw) = raw else { return Ok(None) };
        let (version, status, json) = split_stored(id, &raw)?;
        Ok(Some(Peeked::json(id, version, status, json.to_vec())))
    }

    async fn home_of(&self, id: &str) -> Result<Option<String>, CommandError> {
        Ok(redis::cmd("GET").arg(self.lookup_key(id)).query_async(&mut self.conn.clone()).await?)
    }

    async fn shared_secret(&self, name: &str) -> Result<Vec<u8>, CommandError> {
        // `SET NX` then `GET`: whoever sets first decides; every later reader sees that value.
        let key = format!("{}:secret:{name}", self.prefix);
        let mine = rand::random::<[u8; 32]>().to_vec();
        let mut conn = self.conn.clone();
        let _: Option<String> = redis::cmd("SET").arg(&key).arg(&mine).arg("NX").query_async(&mut conn).await?;
        let v: Option<Vec<u8>> = redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
        v.filter(|v| v.len() == 32).ok_or_else(|| CommandError::Corrupt {
            id: key.clone(),
            reason: "a shared secret that is not 32 bytes".into(),
        })
    }

    async fn transition(
        &self,
        old: CommandStatus,
        new: CommandState,
        enqueue: Option<(&str, &CommandMsg)>,
        delivery: Option<&super::backend::DeliveryRef>,
        event: Option<&FeedAppend>,
        hook: Option<&str>,
    ) -> Result<(Cas, bool), CommandError> {
        let k = self.keys(&new.queue);
        let hook = hook.unwrap_or_default();
        let (feed_event, feed_max) = event.map_or(("", 0), |e| (e.json.as_str(), e.max_len));
        let ttl = self.settings.ttl_for(&new.queue, new.status);
        let mut conn = self.conn.clone();
        let mut st = new;
        self.prepare_write(&mut conn, &k, &mut st, ttl).await?;
        let value = stored(&st, &st.stored_json());
        let state_key = k.state(&st.id);
        let target = delivery.map(|a| (a.id.clone(), a.target.clone()));
        let owner = delivery.filter(|d| d.owned).map(|d| d.target.consumer.clone()).unwrap_or_default();
        let ack = delivery.is_some_and(|d| d.ack);
        let fence = delivery.filter(|d| d.owned).and_then(|d| d.fence).map(|f| f.to_string()).unwrap_or_default();
        // Only terminal writes are announced: waiters wait for one, and a cancel is one.
        // `<id> <STATUS> <version> <origin>`, read by `pubsub_task`.
        let announce = if st.status.is_terminal() {
            format!("{} {} {} {}", st.id, st.status.as_str(), st.version, self.origin)
        } else {
            String::new()
        };
        let expected = format!("{} {} ", st.version - 1, old.as_str());
        let (minute_field, minute_start) = match crate::minutes::mark_of(old, &st) {
            Some((f, start)) => (f, start.map(|s| s.to_string()).unwrap_or_default()),
            None => ("", String::new()),
        };
        let rerun = old.is_terminal() && !st.status.is_terminal() && enqueue.is_some();
        // No hand-off enqueue and no ack on another queue's stream: group-committed.
        let batched = enqueue.is_none()
            && target.as_ref().is_none_or(|(_, t)| t.stream == k.batch.stream && t.group == self.group);
        let v: Value = if batched {
            let t = Transition {
                state_key,
                expected,
                value,
                ttl_ms: ttl.as_millis() as u64,
                id: st.id.clone(),
                old_index: old.index() + 2,
                new_index: st.status.index() + 2,
                entry: target.map(|(id, _)| id).unwrap_or_default(),
                announce,
                owner,
                ack,
                fence,
                event: feed_event.to_string(),
                feed_max,
                hook: hook.to_string(),
                minute_field,
                minute_start,
            };
            self.transitions.run(&k.batch, t).await?
        } else {
            let mut keys: Vec<&str> = vec![
                k.exp(),
                k.status_index(old),
                k.status_index(st.status),
                &state_key,
                &k.batch.feed,
                &k.batch.hooks,
                &k.batch.minutes,
            ];
            let target_stream;
            let mut msg_arg: Vec<u8> = Vec::new();
            if let Some((queue, msg)) = enqueue {
                target_stream = self.keys(queue);
                keys.push(&target_stream.batch.stream);
                msg_arg = msg.to_bytes();
            }
            let (ack_id, ack_group) = match &target {
                Some((id, t)) => {
                    keys.push(&t.stream);
                    keys.push(&t.fences);
                    keys.extend(t.caps.iter().map(String::as_str));
                    (id.as_str(), t.group.as_str())
                }
                None => ("", ""),
            };
            // On Cluster a guard lent for this call (held until its reply), its key last.
            let guard = self.resend.as_ref().map(ResendPool::acquire);
            let script = if guard.is_some() { &TRANSITION_GUARDED } else { &TRANSITION };
            let mut cmd = script.evalsha_cmd(keys.len() + usize::from(guard.is_some()));
            for key in &keys {
                cmd.arg(*key);
            }
            if let Some(g) = &guard {
                cmd.arg(g.key(&k.batch.base));
            }
            cmd.arg(&expected)
                .arg(&value)
                .arg(ttl.as_millis() as u64)
                .arg(&k.batch.channel)
                .arg(&st.id)
                .arg(&msg_arg)
                .arg(ack_id)
                .arg(ack_group)
                .arg(&announce)
                .arg(&owner)
                .arg(if ack { "1" } else { "" })
                .arg(&fence)
                .arg(feed_event)
                .arg(feed_max)
                .arg(if rerun { "1" } else { "" })
                .arg(hook)
                .arg(minute_field)
                .arg(&minute_start);
            if let Some(g) = &guard {
                g.push_args(&mut cmd);
            }
            match &self.durable {
                Some(w) => w.query(script, &k.batch.queue, &cmd).await?,
                None => script.query(&mut conn, &cmd).await?,
            }
        };
        let Value::Array(parts) = &v else { return Err(unexpected("transition", &v)) };
        match parts.first().and_then(string).as_deref() {
            Some("ok") => {
                let acked = matches!(parts.get(1), Some(Value::Int(1)));
                Ok((Cas::Done(st), acked))
            }
            Some("missing") => Ok((Cas::Conflict(None), false)),
            Some("lost") => Ok((Cas::Lost, false)),
            Some("conflict") => {
                let raw = parts.get(1).and_then(bytes).ok_or_else(|| unexpected("transition", &v))?;
                Ok((Cas::Conflict(Some(parse_stored(&st.id, raw)?)), false))
            }
            _ => Err(unexpected("transition", &v)),
        }
    }

    fn can_fold_ack(&self, home: &str, queue: &str) -> bool {
        self.atomic_enqueue(home, queue)
    }

    async fn reschedule(&self, new: CommandState, event: Option<&FeedAppend>) -> Result<Rescheduled, CommandError> {
        let k = self.keys(&new.queue);
        let mut conn = self.conn.clone();
        let mut st = new;
        let ttl = self.settings.ttl_for(&st.queue, st.status) + st.scheduled_delay();
        self.prepare_write(&mut conn, &k, &mut st, ttl).await?;
        let value = stored(&st, &st.stored_json());
        let state_key = k.state(&st.id);
        let (feed_event, feed_max) = event.map_or(("", 0), |e| (e.json.as_str(), e.max_len));
        let due = st.run_at.map(|t| t.millis()).unwrap_or(0);
        // On Cluster a guard lent for this call (held until its reply), its key last.
        let guard = self.resend.as_ref().map(ResendPool::acquire);
        let script = if guard.is_some() { &RESCHEDULE_GUARDED } else { &RESCHEDULE };
        let mut cmd = script.evalsha_cmd(4 + usize::from(guard.is_some()));
        cmd.arg(k.exp()).arg(&state_key).arg(&k.batch.delayed).arg(&k.batch.feed);
        if let Some(g) = &guard {
            cmd.arg(g.key(&k.batch.base));
        }
        cmd.arg(format!("{} {} ", st.version - 1, CommandStatus::Submitted.as_str()))
            .arg(&value)
            .arg(ttl.as_millis() as u64)
            .arg(&st.id)
            .arg(due)
            .arg(feed_event)
            .arg(feed_max);
        if let Some(g) = &guard {
            g.push_args(&mut cmd);
        }
        let v: Value = script.query(&mut conn, &cmd).await?;
        drop(guard);
        let Value::Array(parts) = &v else { return Err(unexpected("reschedule", &v)) };
        let current = || -> Result<CommandState, CommandError> {
            let raw = parts.get(1).and_then(bytes).ok_or_else(|| unexpected("reschedule", &v))?;
            parse_stored(&st.id, raw)
        };
        match parts.first().and_then(string).as_deref() {
            Some("ok") => Ok(Rescheduled::Done(st.clone())),
            Some("missing") => Ok(Rescheduled::Conflict(None)),
            Some("conflict") => Ok(Rescheduled::Conflict(Some(current()?))),
            Some("not_waiting") => Ok(Rescheduled::NotWaiting(current()?)),
            _ => Err(unexpected("reschedule", &v)),
        }
    }

    fn atomic_enqueue(&self, home: &str, target: &str) -> bool {
        // The queues' stream keys (`baton_queue::keys::stream`): their slots are their tags'.
        !self.cluster
            || baton_redis::key_slot(self.keys(home).batch.stream.as_bytes())
                == baton_redis::key_slot(self.keys(target).batch.stream.as_bytes())
    }

    async fn enqueue(&self, queue: &str, msg: &CommandMsg) -> Result<(), CommandError> {
        self.stream.offer(queue, msg.to_bytes()).await?;
        Ok(())
    }

    async fn list(
        &self,
        queue: &str,
        status: Option<CommandStatus>,
        limit: usize,
        cursor: Option<Cursor>,
        min_ms: u64,
    ) -> Result<(Vec<CommandState>, Option<Cursor>), CommandError> {
        let k = self.keys(queue);
        let keys: Vec<&str> = k.batch.index.iter().map(|s| s.as_str()).collect();
        let (cs, cid) = match &cursor {
            Some(c) => (c.created_ms.to_string(), c.id.clone()),
            None => (String::new(), String::new()),
        };
        // KEYS position of the status index (2..6), or 0: every status, merged by the script.
        let which = if status.is_some() { status_slot(status) + 1 } else { 0 };
        let args: [&dyn baton_redis::ArgLike; 5] = [&which, &(limit + 1), &cs, &cid, &min_ms];
        let flat: Vec<String> = LIST.run(&mut self.conn.clone(), &keys, &args).await?;
        let mut ids: Vec<(u64, String)> =
            flat.chunks(2).filter_map(|c| Some((c.get(1)?.parse::<f64>().ok()? as u64, c[0].clone()))).collect();
        let more = ids.len() > limit;
        ids.truncate(limit);
        let next = if more { ids.last().map(|(ms, id)| Cursor { created_ms: *ms, id: id.clone() }) } else { None };
        if ids.is_empty() {
            return Ok((Vec::new(), next));
        }
        let mut pipe = redis::pipe();
        for (_, id) in &ids {
            pipe.cmd("GET").arg(k.state(id));
        }
        let docs: Vec<Option<Vec<u8>>> = pipe.query_async(&mut self.conn.clone()).await?;
        let mut items = Vec::with_capacity(docs.len());
        for ((_, id), d) in ids.iter().zip(docs) {
            if let Some(d) = d {
                items.push(parse_stored(id, &d)?);
            }
        }
        Ok((items, next))
    }

    async fn counts(&self, queue: &str) -> Result<StatusCounts, CommandError> {
        let k = self.keys(queue);
        let keys: Vec<&str> = k.batch.index.iter().map(|s| s.as_str()).collect();
        let v: Vec<u64> = COUNTS.run(&mut self.conn.clone(), &keys, &[]).await?;
        if v.len() != 5 {
            return Err(CommandError::Corrupt { id: queue.to_string(), reason: format!("counts reply {v:?}") });
        }
        Ok(StatusCounts::from_slice(&v))
    }

    async fn minutes(&self, queue: &str, last: usize) -> Result<Vec<crate::minutes::MinuteStats>, CommandError> {
        let k = self.keys(queue);
        let (now, flat): (u64, Vec<String>) =
            MINUTES_READ.run(&mut self.conn.clone(), &[k.batch.minutes.as_str()], &[]).await?;
        let fields = flat.chunks(2).filter_map(|c| Some((c[0].clone(), c.get(1)?.clone()))).collect();
        Ok(crate::minutes::from_hash(now, last, &fields))
    }

    async fn sample_minute(&self, queue: &str) -> Result<bool, CommandError> {
        let k = self.keys(queue);
        let mut keys: Vec<&str> = k.batch.index.iter().map(|s| s.as_str()).collect();
        keys.push(&k.batch.minutes);
        let kept: i64 = MINUTES_SAMPLE.run(&mut self.conn.clone(), &keys, &[]).await?;
        Ok(kept == 1)
    }

    async fn watch_home(&self, home: &str) -> Result<(), CommandError> {
        self.pubsub.ensure(&self.keys(home).batch.channel).await;
        Ok(())
    }

    async fn feed_read(
        &self,
        queue: &str,
        from: EventFrom,
        id: Option<&str>,
        limit: usize,
        scan: usize,
    ) -> Result<EventPage, CommandError> {
        let k = self.keys(queue);
        let mut conn = self.conn.clone();
        let after = match from {
            EventFrom::Start => None,
            EventFrom::After(o) => Some(o),
            EventFrom::Now => {
                let last: Vec<(String, HashMap<String, Value>)> = redis::cmd("XREVRANGE")
                    .arg(&k.batch.feed)
                    .arg("+")
                    .arg("-")
                    .arg("COUNT")
                    .arg(1)
                    .query_async(&mut conn)
                    .await?;
                let next_offset =
                    last.first().and_then(|(entry, _)| EventOffset::from_entry_id(entry)).unwrap_or(EventOffset::ZERO);
                return Ok(EventPage { events: Vec::new(), next_offset, up_to_date: true });
            }
        };
        let start = after.map_or_else(|| "-".to_string(), |o| o.entry_id());
        let v: Value = FEED_READ.run(&mut conn, &[&k.batch.feed], &[&start, &id.unwrap_or(""), &limit, &scan]).await?;
        let Value::Array(parts) = &v else { return Err(unexpected("feed_read", &v)) };
        let bad = || unexpected("feed_read", &v);
        let last = parts.first().and_then(string).ok_or_else(bad)?;
        let up_to_date = matches!(parts.get(1), Some(Value::Int(1)));
        let next_offset = match last.as_str() {
            "" => after.unwrap_or(EventOffset::ZERO),
            entry => EventOffset::from_entry_id(entry).ok_or_else(bad)?,
        };
        let mut events = Vec::with_capacity(parts.len().saturating_sub(2) / 2);
        for pair in parts[2..].chunks(2) {
            let [entry, json] = pair else { return Err(bad()) };
            let offset = string(entry).as_deref().and_then(EventOffset::from_entry_id).ok_or_else(bad)?;
            events.push(CommandEvent::parse(offset, bytes(json).ok_or_else(bad)?)?);
        }
        Ok(EventPage { events, next_offset, up_to_date })
    }

    async fn feed_watch(&self, queue: &str, after: EventOffset) -> Result<(), CommandError> {
        if !self.tails.lock().unwrap().insert(queue.to_string()) {
            return Ok(());
        }
        let key = self.keys(queue).batch.feed.clone();
        let (client, hub, tails, queue) =
            (self.client.clone(), self.hub.clone(), self.tails.clone(), queue.to_string());
        tokio::spawn(tail_feed(client, hub, tails, queue, key, after));
        Ok(())
    }
}

/// Follows `queue`'s feed (stream `key`) from `after` while readers wait for it, on a
/// connection of its own (`XREAD BLOCK`), and wakes them on every append by any process. Stops
/// (and leaves `tails`) at a slice's end with no reader waiting; the decision and the removal are
/// made under `tails`' lock, after which a new waiter starts a new watcher
/// ([`StateBackend::feed_watch`] inserts under the same lock).
async fn tail_feed(
    client: RedisClient,
    hub: Arc<Hub>,
    tails: Arc<Mutex<HashSet<String>>>,
    queue: String,
    key: String,
    after: EventOffset,
) {
    let waiters = hub.feed(&queue);
    let mut last = after.entry_id();
    let mut conn = None;
    loop {
        if conn.is_none() {
            match client.dedicated().await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    tracing::debug!(queue = %queue, error = %e, "feed watcher cannot connect; waiters re-read every second");
                }
            }
        }
        let read: Result<Option<redis::streams::StreamReadReply>, CommandError> = match conn.as_mut() {
            Some(c) => redis::cmd("XREAD")
                .arg("BLOCK")
                .arg(TAIL_BLOCK_MS)
                .arg("COUNT")
                .arg(100)
                .arg("STREAMS")
                .arg(&key)
                .arg(&last)
                .query_async(c)
                .await
                .map_err(CommandError::from),
            None => {
                tokio::time::sleep(Duration::from_millis(TAIL_BLOCK_MS)).await;
                Ok(None)
            }
        };
        match read {
            Ok(Some(reply)) => {
                if let Some(id) = reply.keys.iter().flat_map(|k| k.ids.last()).next_back() {
                    last = id.id.clone();
                }
                waiters.notify.notify_waiters();
            }
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(queue = %queue, error = %e, "feed watcher read failed; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        let mut t = tails.lock().unwrap();
        if waiters.waiting.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            t.remove(&queue);
            return;
        }
    }
}

/// Front of the pub/sub task: subscribes channels (once each) and waits for the confirmation.
struct PubSubHandle {
    tx: mpsc::UnboundedSender<(String, oneshot::Sender<()>)>,
    subscribed: Mutex<HashSet<String>>,
}

/// How long [`PubSubHandle::ensure`] waits for a subscription (waiters fall back to re-reads).
const SUBSCRIBE_WAIT: Duration = Duration::from_secs(2);

impl PubSubHandle {
    fn start(client: RedisClient, hub: Arc<Hub>, origin: Arc<str>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(pubsub_task(client, hub, origin, rx));
        Self { tx, subscribed: Mutex::new(HashSet::new()) }
    }

    async fn ensure(&self, channel: &str) {
        if self.subscribed.lock().unwrap().contains(channel) {
            return;
        }
        let (ack, done) = oneshot::channel();
        if self.tx.send((channel.to_string(), ack)).is_err() {
            return;
        }
        if let Ok(Ok(())) = tokio::time::timeout(SUBSCRIBE_WAIT, done).await {
            self.subscribed.lock().unwrap().insert(channel.to_string());
        }
    }
}

/// Keeps one pub/sub connection (standalone: the server; Cluster: any node, since a plain
/// PUBLISH reaches every node), resubscribes after reconnecting, and forwards events to the hub.
/// Ends when the store is dropped.
async fn pubsub_task(
    client: RedisClient,
    hub: Arc<Hub>,
    origin: Arc<str>,
    mut rx: mpsc::UnboundedReceiver<(String, oneshot::Sender<()>)>,
) {
    let mut channels: HashSet<String> = HashSet::new();
    let mut waiting: Vec<oneshot::Sender<()>> = Vec::new();
    let mut attempt = 0usize;
    let suffix = ":events";
    loop {
        let target = client.pubsub_client(attempt);
        attempt += 1;
        let ps = match tokio::time::timeout(Duration::from_secs(6), target)
            .await
            .unwrap_or_else(|_| Err(redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut))))
        {
            Ok(c) => match tokio::time::timeout(Duration::from_secs(2), c.get_async_pubsub()).await {
                Ok(Ok(ps)) => Some(ps),
                _ => None,
            },
            Err(_) => None,
        };
        let Some(ps) = ps else {
            // Keep accepting requests while disconnected; retry soon.
            let sleep = tokio::time::sleep(Duration::from_millis(200));
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    _ = &mut sleep => break,
                    r = rx.recv() => match r {
                        Some((ch, ack)) => { channels.insert(ch); waiting.push(ack); }
                        None => return,
                    },
                }
            }
            continue;
        };
        let (mut sink, mut stream) = ps.split();
        let mut ok = true;
        for ch in &channels {
            if sink.subscribe(ch).await.is_err() {
                ok = false;
                break;
            }
        }
        if !ok {
            continue;
        }
        for ack in waiting.drain(..) {
            let _ = ack.send(());
        }
        loop {
            tokio::select! {
                m = stream.next() => match m {
                    Some(msg) => {
                        if !msg.get_channel_name().ends_with(suffix) { continue; }
                        // Lines of `<id> <STATUS> <version> <origin>` (see `transition`; a
                        // batch of transitions publishes one message).
                        let payload = String::from_utf8_lossy(msg.get_payload_bytes());
                        for line in payload.split('\n') {
                            let mut it = line.split(' ');
                            if let (Some(id), Some(status), Some(version)) = (it.next(), it.next(), it.next()) {
                                let own = it.next() == Some(&*origin);
                                if let (Ok(s), Ok(v)) = (status.parse::<CommandStatus>(), version.parse::<u64>()) {
                                    hub.remote(id, s, v, own);
                                }
                            }
                        }
                    }
                    None => break,
                },
                r = rx.recv() => match r {
                    Some((ch, ack)) => {
                        if sink.subscribe(&ch).await.is_ok() {
                            channels.insert(ch);
                            let _ = ack.send(());
                        } else {
                            channels.insert(ch);
                            waiting.push(ack);
                            break;
                        }
                    }
                    None => return,
                },
            }
        }
        tracing::warn!(redis = %client.config(), "command events subscription lost; reconnecting");
    }
}

#[cfg(test)]
mod tests {
    use super::HEAD_MAX;

    /// The scripts enqueue on a work queue (the command queues and the completion hooks' delivery
    /// queues) with a literal field name; it must be the queue's.
    #[test]
    fn enqueues_use_the_queue_payload_field() {
        let field = format!("'*', '{}', ", baton_queue::keys::PAYLOAD_FIELD);
        let scripts = [
            include_str!("../../scripts/submits.lua"),
            include_str!("../../scripts/transition.lua"),
            include_str!("../../scripts/transitions.lua"),
        ];
        // (Feed appends, `'i', id, 'e', …`, are not work queue messages.)
        let xadds: Vec<&str> = scripts
            .iter()
            .flat_map(|s| s.lines())
            .filter(|l| l.contains("'XADD'") && !l.contains("'i', id, 'e'"))
            .collect();
        assert_eq!(xadds.len(), 4, "{xadds:?}");
        // submits.lua builds its entry's field list first (`local f = {'p', …}`, then the key and
        // the priority): its XADD appends `unpack(f)`.
        let list = format!("local f = {{'{}', ", baton_queue::keys::PAYLOAD_FIELD);
        let submits = scripts[0];
        for line in xadds {
            let from_list = line.contains("'*', unpack(f))") && submits.contains(line) && submits.contains(&list);
            assert!(
                line.contains(&field) || from_list,
                "{line:?} does not write the work queue's payload field {field:?}"
            );
        }
    }

    #[test]
    fn head_max_matches_lib_lua() {
        let lib = include_str!("../../scripts/lib.lua");
        let decl = format!("local HEAD_MAX = {HEAD_MAX}");
        assert_eq!(
            lib.lines().filter(|l| l.trim_start().starts_with("local HEAD_MAX")).count(),
            1,
            "scripts/lib.lua must declare HEAD_MAX once"
        );
        let line = lib.lines().find(|l| l.trim_start().starts_with("local HEAD_MAX")).unwrap();
        // `local HEAD_MAX = 99 -- comment`: the declaration without its comment, exactly.
        let value = line.split("--").next().unwrap().trim();
        assert_eq!(value, decl, "scripts/lib.lua's HEAD_MAX differs from the store's (store/redis.rs)");
    }
}
