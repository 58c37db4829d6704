//! Remote workers: the commands of a queue run by workers in other processes or languages,
//! which claim them, renew their leases and settle them by request (the HTTP worker protocol of
//! `baton serve` is this API over HTTP).
//!
//! Each worker is a [`RemoteConsumer`](baton_queue::RemoteConsumer) of the queue, named
//! `remote-<worker>`: it holds what it claimed for as long as it renews (at a third of the claim
//! timeout); a worker silent for the claim timeout is a dead consumer, and its commands go to
//! another consumer of the queue, remote or in-process. A claim runs the same dispatch rules as
//! an in-process service (crate docs, "Rules"): a message whose command is missing, finished,
//! stale or moved on is settled at once and never handed to the worker; `SUBMITTED` is an
//! `execute` call, `RUNNING` a `check_status` call. A settlement is written exactly as a
//! handler's result would be (compare-and-set; retries with backoff for errors; `running`
//! re-delivers after its delay; hand-offs), only while the worker holds its lease (another
//! owner, or settled already → [`QueueError::LeaseLost`], nothing written): on Redis the state
//! write checks it in the same atomic step (same slot), elsewhere (memory, a command homed in
//! another slot of a Cluster) one heartbeat checks a request's leases first. Nothing is kept in the serving process but a cache
//! of consumers: any process on the same store can serve any request of any worker.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use baton_queue::{Decision, LeaseState, MessageId, QueueError, RemoteConsumer, RemoteOptions};
use serde::{Deserialize, Serialize};

use crate::model::CommandMsg;
use crate::service::{apply, prepare, Ctx, Holder, Outcome, OutputFence, Prepared};
use crate::{
    validate_queue, CommandError, CommandResult, CommandState, CommandStore, Execution, ExecutionCall, Progress,
    QueueSettings, RawJson, Timestamp,
};

/// Which handler call a claimed command is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteCall {
    /// The command is `SUBMITTED`: run it.
    Execute,
    /// The command is `RUNNING` (an earlier call answered `running`, or it was handed off here):
    /// check on it.
    CheckStatus,
}

/// A command claimed by a worker.
#[derive(Clone, Debug)]
pub struct RemoteClaim {
    /// The lease's token: names the delivery, the command and its message; give it back to
    /// renew and settle. Opaque (base64url).
    pub lease: String,
    pub call: RemoteCall,
    /// The command's state when claimed (its id, type, params, attempts, errors, …).
    pub command: CommandState,
    /// Deliveries of this message, this one included.
    pub deliveries: u32,
    /// The command's output stream (`command.output`), opened for this delivery: the epoch of
    /// producer [`OUTPUT_PRODUCER`](crate::OUTPUT_PRODUCER) the claim claimed, which fences the
    /// writer of an earlier delivery (appends as `Producer-Id: command`, this
    /// `Producer-Epoch`, `Producer-Seq` from 0). The settlement's end of the output is fenced to
    /// it: once a later claim took the command, this one cannot end its output. `None`: no
    /// output, or it could not be opened (it ended already).
    pub output_epoch: Option<u64>,
}

/// What a renewal found for one lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteRenewal {
    /// `Held`: renewed. `Lost`: another consumer owns it (stop; the settlement would be
    /// refused). `Gone`: nothing held any more (settled, or the lease is malformed).
    pub state: LeaseState,
    /// The command was cancelled (or ended otherwise) meanwhile: stop the work; settling it
    /// changes nothing.
    pub finished: bool,
}

/// What a worker reports with a renewal about a command it works on (see
/// [`RemoteWorkers::renew_reporting`]): its progress and/or a checkpoint of its own.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RemoteReport {
    /// Replaces the state's `progress` (when given).
    pub progress: Option<Progress>,
    /// Replaces the state's `details` (when given).
    pub details: Option<RawJson>,
}

impl RemoteReport {
    /// Longest `details`, bytes of JSON.
    pub const MAX_DETAILS: usize = 64 * 1024;

    /// Checks `progress` ([`Progress::validate`]) and the size of `details`. Errors: a text
    /// that says what to fix.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(p) = &self.progress {
            p.validate()?;
        }
        if let Some(d) = &self.details {
            // What the next delivery's handler must decode: a lone surrogate escape or nesting
            // past serde_json's limit would make the command undeliverable.
            if let Err(e) = serde_json::from_str::<serde_json::Value>(d.get()) {
                return Err(format!(
                    "details do not decode ({e}); send JSON without lone surrogate escapes, nested at most 127 deep"
                ));
            }
            if d.get().len() > Self::MAX_DETAILS {
                return Err(format!(
                    "details are {} bytes of JSON; at most {} are kept (keep a checkpoint small, or store it elsewhere and keep its address)",
                    d.get().len(),
                    Self::MAX_DETAILS
                ));
            }
        }
        Ok(())
    }
}

/// How a worker settles a claimed command.
#[derive(Clone, Debug, PartialEq)]
pub enum RemoteOutcome {
    /// As a handler's `Ok(result)`.
    Result(CommandResult),
    /// As a handler's `Err`: recorded, retried with backoff until the queue's `max_attempts`.
    Error(String),
    /// Hand the command back unrun: another worker gets it after the claim timeout (counts as a
    /// delivery, not as an attempt).
    Release,
}

/// What a settlement did.
#[derive(Clone, Debug, PartialEq)]
pub enum RemoteSettled {
    /// Written (for [`RemoteOutcome::Release`]: handed back); the command's state after it.
    Applied(CommandState),
    /// The command had already ended or moved on (cancelled, say): nothing of the outcome was
    /// written; the state as it is.
    Finished(Option<CommandState>),
}

#[derive(Serialize, Deserialize)]
struct LeaseToken {
    /// The message id.
    m: String,
    /// The command message.
    i: String,
    h: String,
    t: String,
    /// When it was claimed, ms since the Unix epoch (the `execute` call's start).
    s: u64,
    /// The delivery's fence ([`baton_queue::RemoteDelivery::fence`]; absent in tokens signed
    /// before fences existed: 0, a first delivery's).
    #[serde(default, skip_serializing_if = "crate::model::is_zero")]
    f: u64,
    /// The call: 0 `execute`, 1 `check_status`, and the delivery count of the claim (both absent
    /// in tokens signed before the state showed remote calls: then nothing is shown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    c: Option<u8>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    d: Option<u32>,
    /// The output producer's epoch the claim claimed (absent: no output, not opened, or a token
    /// signed before claims carried it: the settlement's end is fenced to the epoch current
    /// then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    o: Option<u64>,
}

/// What a lease token names: the delivery (message id and fence), its command message and when
/// it was claimed (ms since the Unix epoch).
struct Decoded {
    mid: MessageId,
    fence: u64,
    msg: CommandMsg,
    claimed_ms: u64,
    /// The call and the claim's delivery count, when the token says.
    call: Option<(ExecutionCall, u32)>,
    /// The output producer's epoch the claim claimed.
    output_epoch: Option<u64>,
}

impl Decoded {
    fn delivery(&self) -> (MessageId, u64) {
        (self.mid, self.fence)
    }
}

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// The name of the store's shared secret that signs lease tokens.
const LEASE_SECRET: &str = "remote-leases";

impl LeaseToken {
    /// `<base64url JSON>.<base64url HMAC-SHA256 of the JSON under key>`: a worker can give back
    /// only what a server of this backend handed out (a forged or altered token does not decode).
    fn encode(&self, key: &[u8]) -> String {
        use hmac::Mac;
        let body = serde_json::to_vec(self).expect("serializes");
        let mut mac = HmacSha256::new_from_slice(key).expect("any key length");
        mac.update(&body);
        format!("{}.{}", B64.encode(&body), B64.encode(mac.finalize().into_bytes()))
    }

    fn decode(s: &str, key: &[u8]) -> Option<Decoded> {
        use hmac::Mac;
        let (body, sig) = s.split_once('.')?;
        let body = B64.decode(body).ok()?;
        let mut mac = HmacSha256::new_from_slice(key).expect("any key length");
        mac.update(&body);
        mac.verify_slice(&B64.decode(sig).ok()?).ok()?;
        let t: LeaseToken = serde_json::from_slice(&body).ok()?;
        let m: MessageId = t.m.parse().ok()?;
        let call = match (t.c, t.d) {
            (Some(0), Some(d)) => Some((ExecutionCall::Execute, d)),
            (Some(1), Some(d)) => Some((ExecutionCall::CheckStatus, d)),
            _ => None,
        };
        Some(Decoded {
            mid: m,
            fence: t.f,
            msg: CommandMsg { id: t.i, home: t.h, token: t.t },
            claimed_ms: t.s,
            call,
            output_epoch: t.o,
        })
    }
}

/// The remote workers of one queue (see the module docs). Cheap to share (`Arc`); one per queue
/// per process.
pub struct RemoteWorkers {
    ctx: Arc<Ctx>,
    options: RemoteOptions,
    consumers: std::sync::Mutex<HashMap<String, (RemoteConsumer, Instant)>>,
    /// When a claim of this process last looked for reclaimable entries, and how often one does.
    reclaimed: Turn,
    reclaim_every: Duration,
    /// The key that signs lease tokens (the store's shared secret: the same in every process on
    /// the backend), read at first use and again when a token does not verify.
    key: tokio::sync::RwLock<Option<Arc<[u8]>>>,
    /// When the key was last read again for a token that did not verify.
    key_reread: Turn,
    /// When a claim of this process last removed dead group members (workers that stopped:
    /// each worker name is a member), so a queue served only by remote workers does not
    /// collect them forever.
    reaped: Turn,
    /// The states this process's claims read, until their leases are settled.
    claimed: Claimed,
    /// When idle consumers were last forgotten.
    swept: Turn,
}

/// The states claims of this process read, by delivery, so that a settle served by the same
/// process writes without reading the state again (a settle elsewhere, or after an eviction,
/// reads it). Safe to be stale: the write is a compare-and-set on the state's version, as an
/// in-process handler's is on the state it read at dispatch; a command that moved on meanwhile
/// (cancelled, say) refuses the write and is answered with its current state.
#[derive(Default)]
struct Claimed(std::sync::Mutex<ClaimedMap>);

#[derive(Default)]
struct ClaimedMap {
    /// Claim time (ms since the Unix epoch) and the state read, by delivery.
    states: HashMap<MessageId, (u64, Box<CommandState>)>,
    /// Their [`weight`]s, summed.
    bytes: usize,
}

/// Bytes of remembered states at most, per queue and process (about 16,000 commands of small
/// params): past it, states of leases already past `max_processing_time` (never settled here:
/// their worker died, or settled through another process) are dropped, and if that is not
/// enough, new claims are not remembered (their settles read the state).
const CLAIMED_BYTES: usize = 16 << 20;

/// What a remembered state counts against [`CLAIMED_BYTES`]: its JSON parts and an allowance
/// for the rest.
fn weight(st: &CommandState) -> usize {
    st.params.get().len()
        + st.details.as_ref().map_or(0, |d| d.get().len())
        + st.result.as_ref().map_or(0, |r| r.get().len())
        + st.id.len()
        + 1024
}

impl ClaimedMap {
    fn insert(&mut self, mid: MessageId, claimed_ms: u64, st: Box<CommandState>) {
        self.bytes += weight(&st);
        if let Some((_, old)) = self.states.insert(mid, (claimed_ms, st)) {
            self.bytes -= weight(&old);
        }
    }

    fn remove(&mut self, mid: MessageId) -> Option<(u64, Box<CommandState>)> {
        let old = self.states.remove(&mid)?;
        self.bytes -= weight(&old.1);
        Some(old)
    }
}

impl Claimed {
    /// Remembers the state a claim at `claimed_ms` read for `mid`.
    fn put(&self, mid: MessageId, claimed_ms: u64, st: &CommandState, max_processing_time: Duration) {
        let mut map = self.0.lock().expect("lock");
        let w = weight(st);
        if map.bytes + w > CLAIMED_BYTES {
            let oldest = Timestamp::now().millis().saturating_sub(max_processing_time.as_millis() as u64);
            let stale: Vec<MessageId> =
                map.states.iter().filter(|(_, (at, _))| *at < oldest).map(|(m, _)| *m).collect();
            for m in stale {
                map.remove(m);
            }
            if map.bytes + w > CLAIMED_BYTES {
                return;
            }
        }
        map.insert(mid, claimed_ms, Box::new(st.clone()));
    }

    /// The state the claim at `claimed_ms` of `mid` read, if remembered (forgotten now).
    fn take(&self, mid: MessageId, claimed_ms: u64) -> Option<Box<CommandState>> {
        let mut map = self.0.lock().expect("lock");
        match map.states.get(&mid) {
            Some((at, _)) if *at == claimed_ms => map.remove(mid).map(|(_, st)| st),
            _ => None,
        }
    }

    /// A copy of the remembered state of the claim at `claimed_ms` of `mid` (kept).
    fn peek(&self, mid: MessageId, claimed_ms: u64) -> Option<CommandState> {
        let map = self.0.lock().expect("lock");
        map.states.get(&mid).filter(|(at, _)| *at == claimed_ms).map(|(_, st)| (**st).clone())
    }

    /// Replaces the remembered state of the claim at `claimed_ms` of `mid` (if remembered) by
    /// one written since.
    fn replace(&self, mid: MessageId, claimed_ms: u64, st: &CommandState) {
        let mut map = self.0.lock().expect("lock");
        if map.states.get(&mid).is_some_and(|(at, _)| *at == claimed_ms) {
            map.insert(mid, claimed_ms, Box::new(st.clone()));
        }
    }

    fn forget(&self, mid: MessageId) {
        self.0.lock().expect("lock").remove(mid);
    }
}

#[cfg(test)]
mod consumer_cache_tests {
    use super::*;

    /// However many worker names claim, a process keeps at most MAX_CONSUMERS consumers (each
    /// with connections of its own) of a queue open; the most recent ones stay.
    #[tokio::test]
    async fn open_consumers_are_bounded() {
        let store = CommandStore::memory();
        let w = RemoteWorkers::new(store, "bounded", QueueSettings::default()).unwrap();
        for i in 0..MAX_CONSUMERS + 200 {
            w.claim(&format!("worker-{i}"), 1, Duration::ZERO).await.unwrap();
        }
        let map = w.consumers.lock().unwrap();
        assert_eq!(map.len(), MAX_CONSUMERS);
        assert!(map.contains_key(&format!("worker-{}", MAX_CONSUMERS + 199)));
        assert!(!map.contains_key("worker-0"));
    }
}

#[cfg(test)]
mod claimed_tests {
    use super::*;

    fn state(id: &str, params_len: usize) -> CommandState {
        serde_json::from_value(serde_json::json!({
            "id": id, "queue": "q", "type": "t", "params": "x".repeat(params_len), "status": "SUBMITTED",
            "result": null, "error": null, "attempts": 0, "errors_count": 0,
            "created_at": "2026-12-02T00:00:00.000Z", "started_at": null,
            "modified_at": "2026-12-02T00:00:00.000Z", "completed_at": null, "version": 1
        }))
        .unwrap()
    }

    /// The byte budget holds: stale entries (claimed past max_processing_time) make room, live
    /// ones are never dropped (new claims are not remembered instead), and the count stays exact
    /// through replace, take and forget.
    #[test]
    fn the_byte_budget_holds() {
        let c = Claimed::default();
        let now = Timestamp::now().millis();
        let big = 1 << 20; // about 1 MiB of params each
        let hour = Duration::from_secs(3600);
        for i in 0..15u64 {
            c.put(MessageId { ms: i, seq: 0 }, now - 7_200_000, &state("old", big), hour);
        }
        assert_eq!(c.0.lock().unwrap().states.len(), 15);
        // Over the budget: the two-hour-old claims go, the new one is kept.
        for i in 100..110u64 {
            c.put(MessageId { ms: i, seq: 0 }, now, &state("new", big), hour);
        }
        let (n, bytes) = {
            let m = c.0.lock().unwrap();
            (m.states.len(), m.bytes)
        };
        assert!(bytes <= CLAIMED_BYTES, "{bytes}");
        assert_eq!(n, 10, "the 15 stale claims made room for the 10 new ones");
        // Full of live claims: a new one is not remembered; none is dropped.
        for i in 200..220u64 {
            c.put(MessageId { ms: i, seq: 0 }, now, &state("more", big), hour);
        }
        let m = c.0.lock().unwrap().states.len();
        assert!((10..=16).contains(&m), "{m}");
        assert!(c.0.lock().unwrap().bytes <= CLAIMED_BYTES);
        for i in 100..110u64 {
            assert!(c.peek(MessageId { ms: i, seq: 0 }, now).is_some(), "live claim {i} kept");
        }
        // Exact accounting.
        c.replace(MessageId { ms: 100, seq: 0 }, now, &state("new", 10));
        assert!(c.take(MessageId { ms: 101, seq: 0 }, now + 1).is_none(), "another claim of the delivery");
        assert!(c.take(MessageId { ms: 101, seq: 0 }, now).is_some());
        c.forget(MessageId { ms: 102, seq: 0 });
        let expected: usize = c.0.lock().unwrap().states.values().map(|(_, st)| weight(st)).sum();
        assert_eq!(c.0.lock().unwrap().bytes, expected);
    }
}

/// A turn taken at most once per interval by whichever caller finds it due (shared by every
/// worker a process serves).
#[derive(Default)]
struct Turn(std::sync::Mutex<Option<Instant>>);

impl Turn {
    /// True (and the turn is taken) when the last turn is at least `every` ago, or there was none.
    fn take(&self, every: Duration) -> bool {
        let now = Instant::now();
        let mut last = self.0.lock().expect("lock");
        match *last {
            Some(t) if now.duration_since(t) < every => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }
}

/// Longest slice of a long-poll claim between two looks for reclaimable messages.
const POLL: Duration = Duration::from_millis(250);

/// Longest worker name, bytes.
pub const MAX_WORKER_NAME: usize = 128;

/// Workers of a queue whose consumers (each with Redis connections of its own) one process keeps
/// open at most; past it the least recently heard of is closed (and opened again on its next
/// request).
const MAX_CONSUMERS: usize = 1024;

impl RemoteWorkers {
    /// Serves `queue` of `store` to remote workers, with the queue's `settings` (its claim
    /// timeout, retry policy, `check_status_interval`). The queue becomes known to the store
    /// (a hand-off target). Errors: [`CommandError::InvalidSettings`], an invalid queue name.
    pub fn new(store: CommandStore, queue: &str, settings: QueueSettings) -> Result<RemoteWorkers, CommandError> {
        validate_queue(queue)?;
        settings.validate()?;
        store.declare_queue(queue)?;
        let options = RemoteOptions {
            claim_timeout: settings.claim_timeout.max(Duration::from_secs(1)),
            max_deliveries: None,
            rate_limit: settings.rate_limit,
            rate_limit_per_key: settings.rate_limit_per_key,
            // The queue's concurrency caps gate remote workers' claims as they gate in-process
            // consumers' reads (the same gated read).
            max_concurrency: settings.max_concurrency,
            concurrency_per_key: settings.concurrency_per_key,
        };
        // As an in-process consumer's poll interval: the queue's, else a third of the claim
        // timeout, at most 1 s.
        let reclaim_every =
            settings.poll_interval.unwrap_or_else(|| (options.claim_timeout / 3).min(Duration::from_secs(1)));
        let ctx = Arc::new(Ctx { store, queue: queue.to_string(), settings, handlers: Arc::default() });
        Ok(RemoteWorkers {
            ctx,
            options,
            consumers: std::sync::Mutex::new(HashMap::new()),
            reclaimed: Turn::default(),
            reclaim_every,
            key: tokio::sync::RwLock::new(None),
            key_reread: Turn::default(),
            reaped: Turn::default(),
            claimed: Claimed::default(),
            swept: Turn::default(),
        })
    }

    /// The key that signs lease tokens.
    async fn key(&self) -> Result<Arc<[u8]>, CommandError> {
        if let Some(k) = self.key.read().await.as_ref() {
            return Ok(k.clone());
        }
        self.read_key().await
    }

    async fn read_key(&self) -> Result<Arc<[u8]>, CommandError> {
        let k: Arc<[u8]> = self.ctx.store.inner.backend.shared_secret(LEASE_SECRET).await?.into();
        *self.key.write().await = Some(k.clone());
        Ok(k)
    }

    /// Decodes each lease token. When one does not verify, the key is read again (at most once
    /// a second) and that token tried with it: a Redis that lost its data (restarted without
    /// persistence, failed over before the key was replicated) makes the next process to start
    /// create another key, which the processes running since then learn here.
    async fn decode_all(&self, leases: &[String]) -> Result<Vec<Option<Decoded>>, CommandError> {
        let key = self.key().await?;
        let mut out: Vec<_> = leases.iter().map(|l| LeaseToken::decode(l, &key)).collect();
        if out.iter().any(Option::is_none) && self.key_reread.take(Duration::from_secs(1)) {
            let fresh = self.read_key().await?;
            if fresh != key {
                tracing::warn!(queue = %self.ctx.queue, "the lease signing key changed in the backend (its data was lost?): leases signed before are no longer accepted");
                for (o, l) in out.iter_mut().zip(leases) {
                    if o.is_none() {
                        *o = LeaseToken::decode(l, &fresh);
                    }
                }
            }
        }
        Ok(out)
    }

    /// The queue served.
    pub fn queue(&self) -> &str {
        &self.ctx.queue
    }

    /// The queue's rate limit ([`QueueSettings::rate_limit`]), applied to its workers' claims.
    pub fn rate_limit(&self) -> Option<baton_queue::RateLimit> {
        self.ctx.settings.rate_limit
    }

    /// The queue's rate limit per concurrency key ([`QueueSettings::rate_limit_per_key`]).
    pub fn rate_limit_per_key(&self) -> Option<baton_queue::RateLimit> {
        self.ctx.settings.rate_limit_per_key
    }

    /// The claim timeout: a worker silent this long loses its leases.
    pub fn claim_timeout(&self) -> Duration {
        self.options.claim_timeout
    }

    async fn consumer(&self, worker: &str) -> Result<RemoteConsumer, CommandError> {
        if worker.is_empty() || worker.len() > MAX_WORKER_NAME || worker.chars().any(|c| c.is_control()) {
            return Err(CommandError::InvalidSettings(format!(
                "worker name {worker:?}: use 1 to {MAX_WORKER_NAME} bytes without control characters"
            )));
        }
        let now = Instant::now();
        {
            // Never held across an await: opening a consumer (a Redis round trip and a connection)
            // must not hold up the requests of every other worker.
            let mut map = self.consumers.lock().expect("lock");
            // Forget consumers of workers not heard of for two claim timeouts (a working worker
            // renews every third of one; forgotten ones are opened again on demand): each holds
            // Redis connections of its own.
            if self.swept.take(Duration::from_secs(1)) {
                let idle = self.options.claim_timeout * 2;
                map.retain(|_, (_, last)| now.duration_since(*last) < idle);
            }
            if let Some((c, last)) = map.get_mut(worker) {
                *last = now;
                return Ok(c.clone());
            }
        }
        let c = self
            .ctx
            .store
            .messages()
            .remote_consumer(&self.ctx.queue, &format!("remote-{worker}"), self.options.clone())
            .await?;
        // Two first requests of one worker may both open it: the same group member either way
        // (opening is idempotent); the first one stored is kept.
        let mut map = self.consumers.lock().expect("lock");
        if !map.contains_key(worker) && map.len() >= MAX_CONSUMERS {
            // Full (many worker names at once): the least recently heard of is forgotten, so the
            // connections a process holds stay bounded whatever names workers choose.
            if let Some(oldest) = map.iter().min_by_key(|(_, (_, last))| *last).map(|(k, _)| k.clone()) {
                map.remove(&oldest);
            }
        }
        Ok(map.entry(worker.to_string()).or_insert((c, now)).0.clone())
    }

    /// Claims up to `max` commands for `worker`, waiting up to `wait` for the first when none is
    /// ready (long-poll). Errors: [`CommandError::InvalidSettings`] (worker name), store errors.
    pub async fn claim(&self, worker: &str, max: usize, wait: Duration) -> Result<Vec<RemoteClaim>, CommandError> {
        let c = self.consumer(worker).await?;
        let key = self.key().await?;
        if let Some(window) = self.reap_due() {
            match c.reap_idle_consumers(window).await {
                Ok(n) if n > 0 => {
                    tracing::info!(queue = %self.ctx.queue, removed = n, "dead consumers removed from the queue's group")
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(queue = %self.ctx.queue, error = %e, "removing dead consumers failed; tried again later")
                }
            }
        }
        let deadline = tokio::time::Instant::now() + wait;
        let max = max.max(1);
        let mut out = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            // A blocking read sees only new messages: wait in slices, so that one handed back
            // (or a dead worker's, or a re-poll that fell due) is found by the next reclaim.
            let block = if out.is_empty() { left.min(POLL) } else { Duration::from_millis(1) };
            let got = c.claim_with(max - out.len(), block, self.reclaim_due()).await?;
            let empty = got.is_empty();
            let mut msgs = Vec::with_capacity(got.len());
            for d in got {
                match serde_json::from_slice::<CommandMsg>(&d.payload) {
                    Ok(m) => msgs.push((d, m)),
                    Err(e) => {
                        c.dead_letter(d.id, d.fence, d.deliveries, &format!("not a command message: {e}")).await?;
                    }
                }
            }
            // The states are read concurrently: the store coalesces them into one read per home
            // queue (store/batch.rs), not one round trip per command.
            let prepared = futures::future::join_all(msgs.iter().map(|(_, m)| prepare(&self.ctx, m))).await;
            // The outputs of the commands to call, opened for their worker (concurrently).
            let epochs = futures::future::join_all(prepared.iter().map(|p| async move {
                match p {
                    Ok(Prepared::Call { st, .. }) => self.open_output(st).await,
                    _ => None,
                }
            }))
            .await;
            for (((d, msg), prepared), output_epoch) in msgs.into_iter().zip(prepared).zip(epochs) {
                match prepared? {
                    Prepared::Settle(decision) => {
                        settle_message(&c, (d.id, d.fence), d.deliveries, decision).await?;
                    }
                    Prepared::Call { st, is_execute } => {
                        let claimed_ms = Timestamp::now().millis();
                        self.claimed.put(d.id, claimed_ms, &st, self.ctx.settings.max_processing_time);
                        let lease = LeaseToken {
                            m: d.id.to_string(),
                            i: msg.id.clone(),
                            h: msg.home.clone(),
                            t: msg.token.clone(),
                            s: claimed_ms,
                            f: d.fence,
                            c: Some(if is_execute { 0 } else { 1 }),
                            d: Some(d.deliveries),
                            o: output_epoch,
                        };
                        out.push(RemoteClaim {
                            lease: lease.encode(&key),
                            call: if is_execute { RemoteCall::Execute } else { RemoteCall::CheckStatus },
                            command: *st,
                            deliveries: d.deliveries,
                            output_epoch,
                        });
                    }
                }
            }
            if !out.is_empty() || (empty && tokio::time::Instant::now() >= deadline) {
                return Ok(out);
            }
        }
    }

    /// Opens `st`'s output (if any) as its writer for a claimed delivery: the producer epoch
    /// claimed, `None` when it has none or it could not be opened (ended already, or the
    /// stream store failed: then the settlement's end is fenced to the epoch current then).
    async fn open_output(&self, st: &CommandState) -> Option<u64> {
        let (link, streams) = (st.output.as_ref()?, self.ctx.store.outputs()?);
        match streams.open(&link.path(), link.open_options()).await {
            Ok(p) => Some(p.epoch()),
            Err(e) => {
                tracing::debug!(command = %st.id, stream = %link.stream, error = %e, "claim: the output stream could not be opened for its worker");
                None
            }
        }
    }

    /// The queue's `reap_idle_consumers_after` when this claim should remove dead group members:
    /// at most once per half of it (and at least once a minute) for all the workers this
    /// process serves.
    fn reap_due(&self) -> Option<Duration> {
        let window = self.ctx.settings.reap_idle_consumers_after?;
        self.reaped.take((window / 2).min(Duration::from_secs(60))).then_some(window)
    }

    /// Whether this claim should look for reclaimable entries (a dead worker's, handed back,
    /// due re-polls): once per reclaim interval for all the workers this process serves; the
    /// claim that finds it due takes the turn.
    fn reclaim_due(&self) -> bool {
        self.reclaimed.take(self.reclaim_every)
    }

    /// Hands the commands of `leases` (claimed by `worker`, never worked on: the claim's answer
    /// did not reach it) back at once, in one call: any worker of the queue may claim them now,
    /// and the delivery is not counted. Malformed leases and leases `worker` does not hold are
    /// skipped.
    pub async fn hand_back(&self, worker: &str, leases: &[String]) -> Result<(), CommandError> {
        let c = self.consumer(worker).await?;
        let ids: Vec<(MessageId, u64)> =
            self.decode_all(leases).await?.into_iter().flatten().map(|d| d.delivery()).collect();
        if ids.is_empty() {
            return Ok(());
        }
        for (id, _) in &ids {
            self.claimed.forget(*id);
        }
        c.hand_back(&ids).await?;
        Ok(())
    }

    /// Renews `worker`'s leases (one call for all) and tells, for each, whether its command has
    /// ended meanwhile (cancelled). A malformed lease token is `Gone`. A lease claimed more than
    /// the queue's `max_processing_time` ago is not renewed but handed back (any consumer takes
    /// it after the claim timeout, as an in-process handler's past that bound): `Lost`.
    pub async fn renew(&self, worker: &str, leases: &[String]) -> Result<Vec<RemoteRenewal>, CommandError> {
        let items: Vec<(String, Option<RemoteReport>)> = leases.iter().map(|l| (l.clone(), None)).collect();
        self.renew_reporting(worker, &items).await
    }

    /// [`RemoteWorkers::renew`], writing each held lease's report (if any) into its command's
    /// state: its `progress` and/or `details` replaced, the status and everything else kept, one
    /// compare-and-set (`version` + 1) that happens only while the worker holds the lease (on
    /// Redis checked in the same atomic step) and never on a finished command (that lease says
    /// `finished`). The writes of one renewal are group-committed (one script call per home
    /// queue, not one round trip per command). Reports are checked first
    /// ([`RemoteReport::validate`]): a bad one is [`CommandError::InvalidParams`] and nothing is
    /// renewed.
    pub async fn renew_reporting(
        &self,
        worker: &str,
        items: &[(String, Option<RemoteReport>)],
    ) -> Result<Vec<RemoteRenewal>, CommandError> {
        for (i, (_, report)) in items.iter().enumerate() {
            if let Some(r) = report {
                r.validate().map_err(|e| CommandError::InvalidParams(format!("leases[{i}]: {e}")))?;
            }
        }
        let leases: Vec<String> = items.iter().map(|(l, _)| l.clone()).collect();
        let c = self.consumer(worker).await?;
        let now = Timestamp::now().millis();
        let decoded = self.decode_all(&leases).await?;
        // Leases past max_processing_time are handed back, not renewed (as an in-process
        // handler's): the worker is told `Lost`; any consumer may take the command after the
        // claim timeout.
        let mut expired = Vec::new();
        for d in decoded.iter().flatten() {
            if self.expired(d.claimed_ms, now) && !expired.contains(&d.delivery()) {
                expired.push(d.delivery());
            }
        }
        for delivery in &expired {
            self.hand_back_expired(&c, *delivery).await?;
        }
        let ids: Vec<(MessageId, u64)> =
            decoded.iter().flatten().map(Decoded::delivery).filter(|d| !expired.contains(d)).collect();
        let states = if ids.is_empty() { Vec::new() } else { c.renew(&ids).await? };
        let renewed: HashMap<(MessageId, u64), LeaseState> = ids.into_iter().zip(states).collect();
        for ((mid, _), state) in &renewed {
            if *state != LeaseState::Held {
                self.claimed.forget(*mid);
            }
        }
        // Delivery, claim time and what the call shows (its `execution`) of each lease.
        let max = self.ctx.settings.max_processing_time.as_millis() as u64;
        type Held = ((MessageId, u64), u64, Option<Execution>);
        let decoded_ids: Vec<Option<Held>> = decoded
            .iter()
            .map(|d| {
                d.as_ref().map(|d| {
                    let execution = d.call.map(|(call, deliveries)| Execution {
                        worker: c.name().to_string(),
                        call,
                        since: Timestamp::from_millis(d.claimed_ms),
                        deliveries,
                        deadline: Timestamp::from_millis(d.claimed_ms + max),
                    });
                    (d.delivery(), d.claimed_ms, execution)
                })
            })
            .collect();
        let with_state: Vec<(LeaseState, Option<CommandMsg>)> = decoded
            .into_iter()
            .map(|d| match d {
                None => (LeaseState::Gone, None),
                Some(d) => match renewed.get(&d.delivery()) {
                    Some(state) => (*state, Some(d.msg)),
                    None => (LeaseState::Lost, Some(d.msg)),
                },
            })
            .collect();
        // The held leases' states, read concurrently: the store coalesces them into one read
        // per home queue (store/batch.rs), not one round trip per lease; and the reports
        // written, group-committed the same way.
        let reads = with_state.iter().zip(&decoded_ids).zip(items).map(|(((state, msg), ids), (_, report))| {
            let c = &c;
            async move {
                match (state, msg, ids) {
                    (LeaseState::Held, Some(msg), Some((delivery, claimed_ms, execution))) => {
                        self.write_report(c, *delivery, *claimed_ms, msg, report.as_ref(), execution.as_ref()).await
                    }
                    _ => Ok::<_, CommandError>(false),
                }
            }
        });
        let finished = futures::future::join_all(reads).await;
        with_state
            .iter()
            .zip(finished)
            .map(|((state, _), finished)| match finished {
                // The report's write found the lease taken over since the heartbeat.
                Err(CommandError::Queue(QueueError::LeaseLost(_))) => {
                    Ok(RemoteRenewal { state: LeaseState::Lost, finished: false })
                }
                finished => Ok(RemoteRenewal { state: *state, finished: finished? }),
            })
            .collect()
    }

    /// Writes a held lease's report (if any) into its command's state (see
    /// [`RemoteWorkers::renew_reporting`]), and `execution` (what the call shows, see
    /// [`CommandState::execution`]) when the state does not show it yet: so the first renewal of
    /// a call writes it, later ones write only reports. True when the command has finished
    /// instead (nothing written). A lease lost meanwhile is [`QueueError::LeaseLost`].
    async fn write_report(
        &self,
        c: &RemoteConsumer,
        (mid, fence): (MessageId, u64),
        claimed_ms: u64,
        msg: &CommandMsg,
        report: Option<&RemoteReport>,
        execution: Option<&Execution>,
    ) -> Result<bool, CommandError> {
        let backend = &self.ctx.store.inner.backend;
        let holder = Holder::Remote(c, mid, fence);
        let same_slot = backend.can_fold_ack(&msg.home, &self.ctx.queue);
        let delivery = holder.delivery_ref(false, same_slot);
        let mut cur = match self.claimed.peek(mid, claimed_ms) {
            Some(st) => Some(st),
            None => backend.load(&msg.home, &msg.id).await?,
        };
        // A conflict with a write that kept the status (another report of this lease, sent
        // concurrently) is retried on the latest state: only the lease's holder writes a
        // claimed command's state without finishing it, so this ends.
        loop {
            let Some(st) = cur else { return Ok(true) };
            if st.status.is_terminal() || st.token != msg.token {
                return Ok(true);
            }
            let show = execution.filter(|e| st.execution.as_ref() != Some(*e));
            if report.is_none() && show.is_none() {
                return Ok(false);
            }
            let mut next = st.clone();
            next.version += 1;
            next.modified_at = Timestamp::now();
            if let Some(r) = report {
                r.clone().apply_to(&mut next);
            }
            if let Some(e) = show {
                next.execution = Some(e.clone());
            }
            // The first write of an `execute` call is its start; later ones are its reports.
            let event = match show {
                Some(e) if e.call == ExecutionCall::Execute => Some((crate::EventKind::Started, None)),
                _ => report.map(|_| (crate::EventKind::Progress, None)),
            };
            match self.ctx.store.write_for(st.status, next, None, delivery.as_ref(), event).await? {
                (Ok(written), _) => {
                    self.claimed.replace(mid, claimed_ms, &written);
                    return Ok(false);
                }
                (Err(latest), _) => cur = latest,
            }
        }
    }

    /// Settles one claimed command of `worker`. Errors: [`QueueError::LeaseLost`] (as
    /// `CommandError::Queue`) when the lease is not the worker's any more (taken over after a
    /// silence, settled, or past `max_processing_time`: then it is handed back as by
    /// [`RemoteWorkers::renew`]); [`CommandError::InvalidSettings`] for a malformed lease token;
    /// store errors.
    pub async fn settle(
        &self,
        worker: &str,
        lease: &str,
        outcome: RemoteOutcome,
    ) -> Result<RemoteSettled, CommandError> {
        let mut all = self.settle_many(worker, vec![(lease.to_string(), outcome)]).await?;
        all.pop().expect("one answer per settlement")
    }

    /// Settles many claimed commands of `worker`, each as [`RemoteWorkers::settle`] would alone
    /// (its own answer, in order), with one ownership check for them all and the writes run
    /// concurrently (the store batches them). The outer error is a failure of the ownership
    /// check (nothing was settled).
    pub async fn settle_many(
        &self,
        worker: &str,
        items: Vec<(String, RemoteOutcome)>,
    ) -> Result<Vec<Result<RemoteSettled, CommandError>>, CommandError> {
        let c = self.consumer(worker).await?;
        let now = Timestamp::now().millis();
        let leases: Vec<String> = items.iter().map(|(l, _)| l.clone()).collect();
        let mut checks: Vec<Result<Decoded, CommandError>> = Vec::with_capacity(items.len());
        for decoded in self.decode_all(&leases).await? {
            checks.push(match decoded {
                None => Err(CommandError::InvalidSettings("lease: not a lease token of this server".into())),
                Some(d) if self.expired(d.claimed_ms, now) => {
                    self.hand_back_expired(&c, d.delivery()).await?;
                    Err(CommandError::Queue(QueueError::LeaseLost(d.mid)))
                }
                Some(d) => Ok(d),
            });
        }
        // Every write and settle of the queue's stream below checks that the worker owns the
        // delivery in the same atomic step, except a state write that cannot (memory; Redis
        // Cluster, a command homed in another slot: handed off to this queue): one heartbeat
        // checks (and renews) those leases first.
        let backend = &self.ctx.store.inner.backend;
        let ids: Vec<(MessageId, u64)> = checks
            .iter()
            .flatten()
            .filter(|d| !Holder::Remote(&c, d.mid, d.fence).checked_in_write(&**backend, &d.msg.home, &self.ctx.queue))
            .map(Decoded::delivery)
            .collect();
        let states = if ids.is_empty() { Vec::new() } else { c.renew(&ids).await? };
        let unheld: Vec<(MessageId, u64)> =
            ids.into_iter().zip(states).filter(|(_, s)| *s != LeaseState::Held).map(|(d, _)| d).collect();
        let settles = checks.into_iter().zip(items).map(|(check, (_, outcome))| {
            let c = &c;
            let unheld = &unheld;
            async move {
                let d = check?;
                if unheld.contains(&d.delivery()) {
                    return Err(CommandError::Queue(QueueError::LeaseLost(d.mid)));
                }
                let fence = match d.output_epoch {
                    Some(e) => OutputFence::Delivery(Some(e)),
                    None => OutputFence::Unknown,
                };
                self.settle_held(c, d.delivery(), d.msg, d.claimed_ms, outcome, fence).await
            }
        });
        Ok(futures::future::join_all(settles).await)
    }

    /// Settles a delivery of the worker: every step checks that it still holds it (a state write
    /// atomically where it can, else the caller's heartbeat just did; each settle of the
    /// delivery atomically, a delivery no longer pending counting as lost).
    async fn settle_held(
        &self,
        c: &RemoteConsumer,
        delivery: (MessageId, u64),
        msg: CommandMsg,
        claimed_ms: u64,
        outcome: RemoteOutcome,
        output_fence: OutputFence,
    ) -> Result<RemoteSettled, CommandError> {
        let backend = &self.ctx.store.inner.backend;
        let (mid, fence) = delivery;
        let remembered = self.claimed.take(mid, claimed_ms);
        if outcome == RemoteOutcome::Release {
            settle_strict(c, delivery, Decision::Retry).await?;
            // Handed back: applied, unless the command is gone or ended meanwhile.
            return Ok(match backend.load(&msg.home, &msg.id).await? {
                Some(s) if !s.status.is_terminal() && s.token == msg.token => RemoteSettled::Applied(s),
                other => RemoteSettled::Finished(other),
            });
        }
        let prepared = match remembered {
            // The claim's checks held for this state; if it moved on since, the write's
            // compare-and-set refuses it (and answers with the current state).
            Some(st) => {
                let is_execute = st.status == crate::CommandStatus::Submitted;
                Prepared::Call { st, is_execute }
            }
            None => prepare(&self.ctx, &msg).await?,
        };
        let (st, is_execute) = match prepared {
            Prepared::Settle(decision) => {
                settle_strict(c, delivery, decision).await?;
                return Ok(RemoteSettled::Finished(backend.load(&msg.home, &msg.id).await?));
            }
            Prepared::Call { st, is_execute } => (*st, is_execute),
        };
        let outcome = match outcome {
            RemoteOutcome::Result(r) => Outcome::Result(r),
            RemoteOutcome::Error(e) => Outcome::Error(if e.is_empty() { "handler error".into() } else { e }),
            RemoteOutcome::Release => unreachable!("handled above"),
        };
        // A terminal write acks the delivery in the same atomic step where the backend can
        // (Redis: same slot); the ownership check made it this worker's to ack.
        let holder = Holder::Remote(c, mid, fence);
        let called_at = Timestamp::from_millis(claimed_ms);
        let done = apply(&self.ctx, st, &msg, Some(holder), is_execute, called_at, outcome, output_fence).await?;
        settle_strict(c, delivery, done.decision).await?;
        Ok(match done.state {
            Some(s) if done.written => RemoteSettled::Applied(s),
            other => RemoteSettled::Finished(other),
        })
    }
}

impl RemoteWorkers {
    /// Whether a lease claimed at `claimed_ms` has run past the queue's `max_processing_time`
    /// at `now_ms` (both ms since the Unix epoch).
    fn expired(&self, claimed_ms: u64, now_ms: u64) -> bool {
        now_ms.saturating_sub(claimed_ms) > self.ctx.settings.max_processing_time.as_millis() as u64
    }

    /// Hands an expired lease's message back (reclaimable by any consumer after the claim
    /// timeout), if the worker still owns it.
    async fn hand_back_expired(&self, c: &RemoteConsumer, (mid, fence): (MessageId, u64)) -> Result<(), CommandError> {
        self.claimed.forget(mid);
        match c.release(mid, fence).await {
            Ok(baton_queue::Settled::Done) => {
                tracing::warn!(
                    queue = %self.ctx.queue,
                    worker = %c.name(),
                    message_id = %mid,
                    max_processing_time = ?self.ctx.settings.max_processing_time,
                    "remote worker's lease exceeded max_processing_time: handed back, another consumer may take it after the claim timeout"
                );
                Ok(())
            }
            Ok(baton_queue::Settled::Gone) | Err(QueueError::LeaseLost(_)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

/// [`settle_message`] for a worker's settle: a delivery no longer pending (settled already,
/// deleted) is [`QueueError::LeaseLost`] too: the worker's lease is gone.
async fn settle_strict(c: &RemoteConsumer, delivery: (MessageId, u64), d: Decision) -> Result<(), CommandError> {
    let id = delivery.0;
    match settle_message(c, delivery, 0, d).await? {
        baton_queue::Settled::Done => Ok(()),
        baton_queue::Settled::Gone => Err(CommandError::Queue(QueueError::LeaseLost(id))),
    }
}

/// What it found: `Gone` when the delivery (message id and fence) was not pending any more.
async fn settle_message(
    c: &RemoteConsumer,
    (id, fence): (MessageId, u64),
    deliveries: u32,
    d: Decision,
) -> Result<baton_queue::Settled, CommandError> {
    let r = match d {
        // Deferred: the state write acked it already.
        Decision::Deferred => return Ok(baton_queue::Settled::Done),
        Decision::Ack => c.ack(id, fence).await,
        Decision::Retry => c.release(id, fence).await,
        Decision::RetryAfter(delay) => c.retry_after(id, fence, delay).await,
        Decision::RateLimited(delay) => c.rate_limited(id, fence, delay).await,
        Decision::DeadLetter(reason) => c.dead_letter(id, fence, deliveries, &reason).await,
    };
    match r {
        Ok(settled) => Ok(settled),
        Err(QueueError::LeaseLost(_)) => Err(CommandError::Queue(QueueError::LeaseLost(id))),
        Err(e) => Err(e.into()),
    }
}
