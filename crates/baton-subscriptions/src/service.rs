//! [`Subscriptions`]: the public service. It validates requests, runs the state machine
//! (`machine.rs`) over records read from and stored to the backend by compare-and-set, learns
//! of appends through the stream store's observer, and drives wakes from the delivery queue:
//! one leased queue message per subscription at a time, so the process that delivers a wake
//! holds a lease on it, and if it dies another process's consumer takes the message over after
//! the queue's claim timeout.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use baton_queue::{Consumer, ConsumerOptions, Decision, Delivery};
use baton_redis::RedisClient;
use baton_streams::{AppendRequest, StreamError, StreamObserver, StreamPath, StreamStore};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, DriveMessage, RegistryOp, QUEUE};
use crate::machine::{self, Change, Step};
use crate::model::*;
use crate::signing::KeyRing;
use crate::webhook_url;

/// How many subscriptions an append's notification updates at once.
const APPEND_FANOUT: usize = 32;

/// First and longest wait between two retries of the notifications that failed.
const MISSED_RETRY: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(2));

/// How many streams a glob subscription links when it is created (or reconciled), at most.
pub const MAX_GLOB_STREAMS: usize = 10_000;

/// Settings of [`Subscriptions`].
#[derive(Clone, Debug)]
pub struct SubscriptionsConfig {
    /// The server's public base URL (`http://127.0.0.1:7700`): `callback_url` and `jwks_url` are
    /// built from it.
    pub base_url: String,
    /// Accept webhook URLs on loopback hosts (`localhost`, 127/8, `::1`), over `http` too. For
    /// local development and tests; off by default.
    pub allow_loopback_webhooks: bool,
    /// The delivery queue's claim timeout: how long after a delivering process dies another
    /// one takes its deliveries over. Default 10 s.
    pub claim_timeout: Duration,
    /// Timeout of one webhook request. Default 10 s.
    pub delivery_timeout: Duration,
    /// Deliveries in flight per process. Default 64.
    pub concurrency: usize,
    /// How often a process looks for subscriptions created, changed or deleted by other
    /// processes (one `GET` of the registry version). Default 200 ms.
    pub registry_poll: Duration,
}

impl Default for SubscriptionsConfig {
    fn default() -> Self {
        Self {
            base_url: "http://127.0.0.1:7700".into(),
            allow_loopback_webhooks: false,
            claim_timeout: Duration::from_secs(10),
            delivery_timeout: Duration::from_secs(10),
            concurrency: 64,
            registry_poll: Duration::from_millis(200),
        }
    }
}

#[derive(Default)]
struct Cache {
    version: u64,
    entries: HashMap<String, Entry>,
}

impl Cache {
    fn set(&mut self, version: u64, entries: Vec<Entry>) {
        self.version = version;
        self.entries = entries.into_iter().map(|e| (e.id.clone(), e)).collect();
    }
}

struct Inner {
    backend: Arc<dyn Backend>,
    streams: StreamStore,
    cfg: SubscriptionsConfig,
    cache: RwLock<Cache>,
    keys: RwLock<KeyRing>,
    http: reqwest::Client,
    consumer: tokio::sync::Mutex<Option<Consumer>>,
    stop: CancellationToken,
    /// Appends a subscription could not be told of (the backend failed, e.g. its Redis master
    /// failing over while the stream's master took the append): (subscription id, stream path),
    /// retried by `retry_missed` with the stream's tail at the time of the retry.
    missed: std::sync::Mutex<HashSet<(String, String)>>,
    /// Wakes `retry_missed` when `missed` gains an entry.
    missed_added: Arc<tokio::sync::Notify>,
}

/// Durable Streams subscriptions (webhook and pull-wake) over a [`StreamStore`]. Cheap to clone.
///
/// Create one per process with [`Subscriptions::memory`] or [`Subscriptions::redis`] (it
/// installs itself as the store's [`StreamObserver`]); call [`Subscriptions::start_delivery`]
/// in processes that should deliver wakes; [`Subscriptions::close`] at the end.
#[derive(Clone)]
pub struct Subscriptions {
    inner: Arc<Inner>,
}

impl Subscriptions {
    /// In memory, for the memory stream store of this process.
    pub async fn memory(streams: StreamStore, cfg: SubscriptionsConfig) -> Result<Self> {
        Self::start(Arc::new(crate::memory::MemoryBackend::new()), streams, cfg, false).await
    }

    /// On Redis (standalone or Cluster), shared by every process using the same Redis.
    /// Errors: `Unavailable` when Redis cannot be reached.
    pub async fn redis(client: RedisClient, streams: StreamStore, cfg: SubscriptionsConfig) -> Result<Self> {
        let backend = crate::redis::RedisBackend::connect(client).await?;
        Self::start(Arc::new(backend), streams, cfg, true).await
    }

    async fn start(
        backend: Arc<dyn Backend>,
        streams: StreamStore,
        cfg: SubscriptionsConfig,
        shared: bool,
    ) -> Result<Self> {
        let now = backend.now_ms().await?;
        let keys = backend.keys(now).await?;
        let (version, entries) = backend.registry().await?;
        let mut cache = Cache::default();
        cache.set(version, entries.clone());
        let http = webhook_url::client(cfg.allow_loopback_webhooks, cfg.delivery_timeout);
        let inner = Arc::new(Inner {
            backend,
            streams: streams.clone(),
            cfg,
            cache: RwLock::new(cache),
            keys: RwLock::new(keys),
            http,
            consumer: tokio::sync::Mutex::new(None),
            stop: CancellationToken::new(),
            missed: Default::default(),
            missed_added: Arc::new(tokio::sync::Notify::new()),
        });
        streams.set_observer(Arc::new(Hook(Arc::downgrade(&inner))));
        tokio::spawn(retry_missed(Arc::downgrade(&inner), inner.missed_added.clone()));
        if shared {
            tokio::spawn(poll_registry(Arc::downgrade(&inner)));
            // Appends made while no process was watching (or lost with a process between its
            // append and its notification) are found by comparing every stream with its tail.
            let weak = Arc::downgrade(&inner);
            tokio::spawn(async move {
                for e in entries {
                    let Some(inner) = weak.upgrade() else { return };
                    inner.reconcile(&e).await;
                }
            });
        }
        Ok(Self { inner })
    }

    /// Starts delivering wakes from this process (a consumer of the delivery queue). Idempotent.
    pub async fn start_delivery(&self) -> Result<()> {
        let mut slot = self.inner.consumer.lock().await;
        if slot.is_some() {
            return Ok(());
        }
        let opts = ConsumerOptions::new()
            .with_concurrency(self.inner.cfg.concurrency)
            .with_claim_timeout(self.inner.cfg.claim_timeout)
            .with_max_deliveries(None)
            .with_consumer_prefix("subscriptions");
        let consumer = self
            .inner
            .backend
            .queue()
            .consume(QUEUE, Driver(Arc::downgrade(&self.inner)), opts)
            .await
            .map_err(|e| SubscriptionError::Unavailable(e.to_string()))?;
        *slot = Some(consumer);
        Ok(())
    }

    /// Stops delivering (deliveries in flight get `grace`, then are left to another process)
    /// and stops watching the registry.
    pub async fn close(&self, grace: Duration) {
        self.inner.stop.cancel();
        if let Some(c) = self.inner.consumer.lock().await.take() {
            c.drain(grace).await;
        }
    }

    /// `PUT __ds/subscriptions/{id}`: creates the subscription (`true`) or confirms an identical
    /// one (`false`), and returns its view. Errors: `InvalidRequest`, `WebhookUrlRejected`,
    /// `AlreadyExists` (same id, other configuration), `Unavailable`.
    pub async fn create(&self, id: &str, body: &Value) -> Result<(bool, Value)> {
        check_id(id)?;
        let spec = Spec::from_json(body)?;
        if let Some(u) = &spec.webhook_url {
            webhook_url::check_url(u, self.inner.cfg.allow_loopback_webhooks)?;
        }
        if let Some(w) = spec.wake_stream.as_deref().filter(|_| spec.kind == Kind::PullWake) {
            self.inner.check_wake_stream(w).await?;
        }
        let hash = spec.config_hash();
        loop {
            let l = self.inner.backend.load(id).await?;
            if let Some(rec) = l.record {
                if rec.config_hash != hash {
                    return Err(SubscriptionError::AlreadyExists);
                }
                return Ok((false, self.inner.view(&rec)));
            }
            let mut explicit = Vec::new();
            for p in &spec.streams {
                explicit.push((p.clone(), self.inner.tail(p).await?.unwrap_or_else(|| ZERO_OFFSET.to_string())));
            }
            let mut globbed = Vec::new();
            if let Some(pattern) = &spec.pattern {
                for p in self.inner.glob_candidates(pattern).await? {
                    if let Some(t) = self.inner.tail(&p).await? {
                        globbed.push((p, t));
                    }
                }
            }
            let created_at = rfc3339(l.now_ms);
            let rec = machine::create(id, spec.clone(), created_at, &explicit, &globbed);
            let entry = Entry::of(&rec);
            if self.inner.backend.store(id, l.version, Some(&rec), RegistryOp::Put(entry.clone()), None).await? {
                self.inner.cache_put(entry);
                return Ok((true, self.inner.view(&rec)));
            }
        }
    }

    /// `GET __ds/subscriptions/{id}`. Errors: `NotFound`, `Unavailable`.
    pub async fn get(&self, id: &str) -> Result<Value> {
        let l = self.inner.backend.load(id).await?;
        l.record.map(|r| self.inner.view(&r)).ok_or(SubscriptionError::NotFound)
    }

    /// `DELETE __ds/subscriptions/{id}`: deletes it (its current wake ends; a late callback
    /// gets `SUBSCRIPTION_NOT_FOUND`). Deleting an unknown id succeeds. Errors: `Unavailable`.
    pub async fn delete(&self, id: &str) -> Result<()> {
        loop {
            let l = self.inner.backend.load(id).await?;
            if l.record.is_none() {
                self.inner.cache_remove(id);
                return Ok(());
            }
            if self.inner.backend.store(id, l.version, None, RegistryOp::Remove, None).await? {
                self.inner.cache_remove(id);
                return Ok(());
            }
        }
    }

    /// `POST __ds/subscriptions/{id}/streams` with `{"streams": [...]}`: links streams
    /// explicitly (at their current tails). Errors: `InvalidRequest`, `NotFound`, `Unavailable`.
    pub async fn add_streams(&self, id: &str, body: &Value) -> Result<()> {
        let streams = match body.get("streams") {
            Some(v) => parse_streams(v)?,
            None => return Err(SubscriptionError::invalid("streams must be a non-empty array of strings")),
        };
        if streams.is_empty() {
            return Err(SubscriptionError::invalid("streams must be a non-empty array of strings"));
        }
        let mut tails = Vec::new();
        for p in &streams {
            tails.push((p.clone(), self.inner.tail(p).await?.unwrap_or_else(|| ZERO_OFFSET.to_string())));
        }
        self.inner
            .update(id, |rec, _| {
                for (p, t) in &tails {
                    machine::link(rec, p, true, t, t);
                }
                Ok(((), true, Change::default()))
            })
            .await
    }

    /// `DELETE __ds/subscriptions/{id}/streams/{path}`: removes an explicit link (a stream the
    /// glob matches stays). Errors: `NotFound`, `Unavailable`.
    pub async fn remove_stream(&self, id: &str, path: &str) -> Result<()> {
        let path = normalize_path(path);
        self.inner
            .update(id, |rec, _| {
                let changed = machine::unlink_explicit(rec, &path);
                Ok(((), changed, Change::default()))
            })
            .await
    }

    /// `POST __ds/subscriptions/{id}/callback` (webhook) with the bearer callback token.
    /// Returns `{"ok": true, "next_wake": bool}`. Errors: `NotFound`, `TokenInvalid`, `Fenced`,
    /// `InvalidOffset`, `InvalidRequest`, `Unavailable`.
    pub async fn callback(&self, id: &str, token: &str, body: &Value) -> Result<Value> {
        self.ack_kind(id, token, body, Kind::Webhook).await
    }

    /// `POST __ds/subscriptions/{id}/ack` (pull-wake) with the bearer claim token: as
    /// [`callback`](Self::callback).
    pub async fn ack(&self, id: &str, token: &str, body: &Value) -> Result<Value> {
        self.ack_kind(id, token, body, Kind::PullWake).await
    }

    async fn ack_kind(&self, id: &str, token: &str, body: &Value, kind: Kind) -> Result<Value> {
        let req = AckRequest::from_json(body)?;
        self.inner
            .update(id, |rec, now| {
                let (next, change) = machine::ack(rec, kind, token, &req, now)?;
                Ok((json!({"ok": true, "next_wake": next}), true, change))
            })
            .await
    }

    /// `POST __ds/subscriptions/{id}/claim` with `{"worker": "…"}` (pull-wake). Returns
    /// `wake_id`, `generation`, `token`, `streams`, `lease_ttl_ms`. Errors: `InvalidRequest`,
    /// `NotFound`, `AlreadyClaimed`, `NoPendingWork`, `Unavailable`.
    pub async fn claim(&self, id: &str, body: &Value) -> Result<Value> {
        let worker = body
            .get("worker")
            .and_then(Value::as_str)
            .filter(|w| !w.is_empty() && w.len() <= 256)
            .ok_or_else(|| SubscriptionError::invalid("worker must be a non-empty string of at most 256 bytes"))?
            .to_string();
        self.inner
            .update(id, |rec, now| {
                let (reply, change) = machine::claim(rec, &worker, now)?;
                Ok((reply, true, change))
            })
            .await
    }

    /// `POST __ds/subscriptions/{id}/release` with the bearer claim token (pull-wake): ends the
    /// wake without acknowledging. Errors: as [`ack`](Self::ack).
    pub async fn release(&self, id: &str, token: &str, body: &Value) -> Result<()> {
        let req = AckRequest::from_json(body)?;
        self.inner
            .update(id, |rec, now| {
                let change = machine::release(rec, token, &req, now)?;
                Ok(((), true, change))
            })
            .await
    }

    /// `GET __ds/jwks.json`: the webhook signing keys (`{"keys": [...]}`).
    pub async fn jwks(&self) -> Result<Value> {
        let now = self.inner.backend.now_ms().await?;
        Ok(self.inner.keys.read().expect("lock").jwks(now))
    }

    /// Makes a new signing key current in the backend (every process signs with it from its next
    /// registry poll); the previous key stays in the JWKS for its grace. Returns the new kid.
    pub async fn rotate_signing_key(&self) -> Result<String> {
        let now = self.inner.backend.now_ms().await?;
        let ring = self.inner.backend.rotate(now).await?;
        let kid = ring.current().map(|k| k.kid.clone()).unwrap_or_default();
        *self.inner.keys.write().expect("lock") = ring;
        Ok(kid)
    }

    /// The `Webhook-Signature` header value for `body` signed now with the current key (the
    /// format of the subscription webhooks; keys in [`Subscriptions::jwks`]), for other webhooks
    /// Baton sends (the command queues' completion webhooks). `None` when there is no usable key.
    pub fn sign(&self, body: &[u8]) -> Option<String> {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        self.inner.keys.read().expect("lock").sign(body, now)
    }

    /// The number of subscriptions this process knows of.
    pub fn count(&self) -> usize {
        self.inner.cache.read().expect("lock").entries.len()
    }
}

fn rfc3339(ms: u64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    t.format(&time::format_description::well_known::Rfc3339).unwrap_or_default()
}

fn encode_segment(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>().replace('+', "%20")
}

impl Inner {
    fn control_url(&self, rest: &str) -> String {
        format!("{}/v1/stream/__ds/{rest}", self.cfg.base_url.trim_end_matches('/'))
    }

    fn callback_url(&self, id: &str) -> String {
        self.control_url(&format!("subscriptions/{}/callback", encode_segment(id)))
    }

    fn view(&self, rec: &Record) -> Value {
        let kid = self.keys.read().expect("lock").current().map(|k| k.kid.clone()).unwrap_or_default();
        let streams: Vec<Value> = rec
            .links
            .iter()
            .map(|(p, l)| json!({"path": p, "link_type": l.link_type(), "acked_offset": l.acked}))
            .collect();
        let mut v = json!({
            "id": rec.id,
            "subscription_id": rec.id,
            "type": rec.spec.kind.as_str(),
            "streams": streams,
            "lease_ttl_ms": rec.spec.lease_ttl_ms,
            "created_at": rec.created_at,
            "status": match rec.status { Status::Active => "active", Status::Failed => "failed" },
            "generation": rec.generation,
        });
        let o = v.as_object_mut().expect("an object");
        if let Some(p) = &rec.spec.pattern {
            o.insert("pattern".into(), p.clone().into());
        }
        if let Some(u) = &rec.spec.webhook_url {
            o.insert(
                "webhook".into(),
                json!({"url": u, "signing": {"alg": "ed25519", "kid": kid, "jwks_url": self.control_url("jwks.json")}}),
            );
        }
        if let Some(w) = &rec.spec.wake_stream {
            o.insert("wake_stream".into(), w.clone().into());
        }
        if let Some(d) = &rec.spec.description {
            o.insert("description".into(), d.clone().into());
        }
        v
    }

    /// The tail token of a stream, `None` when it does not exist.
    async fn tail(&self, path: &str) -> Result<Option<String>> {
        let Ok(p) = StreamPath::new(path) else { return Ok(None) };
        match self.streams.head(&p).await {
            Ok(info) => Ok(Some(info.tail.token(&info.incarnation))),
            Err(StreamError::NotFound { .. } | StreamError::Gone { .. }) => Ok(None),
            Err(e) => Err(SubscriptionError::Unavailable(e.to_string())),
        }
    }

    /// A pull-wake's wake stream must exist and take JSON (wake events are JSON messages).
    async fn check_wake_stream(&self, w: &str) -> Result<()> {
        let missing = || {
            SubscriptionError::invalid(format!(
                "wake_stream {w:?} does not exist: create it first (PUT /v1/stream/{w} with Content-Type: application/json)"
            ))
        };
        let p = StreamPath::new(w).map_err(|_| missing())?;
        match self.streams.head(&p).await {
            Ok(info) if baton_streams::is_json(&info.content_type) => Ok(()),
            Ok(info) => Err(SubscriptionError::invalid(format!(
                "wake_stream {w:?} is {}, not application/json: wake events are JSON messages",
                info.content_type
            ))),
            Err(StreamError::NotFound { .. } | StreamError::Gone { .. }) => Err(missing()),
            Err(e) => Err(SubscriptionError::Unavailable(e.to_string())),
        }
    }

    /// The existing streams a glob matches (never under `__ds/`).
    async fn glob_candidates(&self, pattern: &str) -> Result<Vec<String>> {
        let prefix = glob_prefix(pattern);
        let paths = self
            .streams
            .list(&prefix, MAX_GLOB_STREAMS)
            .await
            .map_err(|e| SubscriptionError::Unavailable(e.to_string()))?;
        Ok(paths
            .into_iter()
            .map(|p| p.as_str().to_string())
            .filter(|p| glob_match(pattern, p) && !p.starts_with("__ds/"))
            .collect())
    }

    fn cache_put(&self, e: Entry) {
        let mut c = self.cache.write().expect("lock");
        c.entries.insert(e.id.clone(), e);
    }

    fn cache_remove(&self, id: &str) {
        let mut c = self.cache.write().expect("lock");
        c.entries.remove(id);
    }

    /// Reads a record, applies `f` (which returns its result, whether the record changed, and
    /// the change's delivery message), stores it by compare-and-set, and repeats on a conflict.
    /// A record change that alters the explicit streams updates the registry too.
    async fn update<T>(&self, id: &str, mut f: impl FnMut(&mut Record, u64) -> Result<(T, bool, Change)>) -> Result<T> {
        loop {
            let l = self.backend.load(id).await?;
            let Some(mut rec) = l.record else { return Err(SubscriptionError::NotFound) };
            let before = Entry::of(&rec);
            let (out, changed, change) = f(&mut rec, l.now_ms)?;
            if !changed {
                return Ok(out);
            }
            let after = Entry::of(&rec);
            let reg = if after != before { RegistryOp::Put(after.clone()) } else { RegistryOp::Keep };
            let put = matches!(reg, RegistryOp::Put(_));
            if self.backend.store(id, l.version, Some(&rec), reg, change.drive.as_deref()).await? {
                if put {
                    self.cache_put(after);
                }
                return Ok(out);
            }
        }
    }

    async fn appended(&self, path: &str, tail: &str) {
        if path == "__ds" || path.starts_with("__ds/") {
            return;
        }
        let ids: Vec<String> = {
            let c = self.cache.read().expect("lock");
            if c.entries.is_empty() {
                return;
            }
            c.entries.values().filter(|e| e.matches(path)).map(|e| e.id.clone()).collect()
        };
        // Each subscription is its own record: tell them concurrently (an append matched by a
        // thousand subscriptions took a thousand sequential compare-and-sets, ~0.6 s).
        futures::stream::iter(ids)
            .for_each_concurrent(APPEND_FANOUT, |id| async move {
                match self.tell(&id, path, tail).await {
                    Ok(()) | Err(SubscriptionError::NotFound) => {}
                    Err(e) => {
                        // The append is committed: the subscription must still learn of it.
                        tracing::warn!(subscription = %id, stream = %path, error = %e, "subscription not told of an append yet; retrying");
                        self.missed.lock().expect("lock").insert((id, path.to_string()));
                        self.missed_added.notify_one();
                    }
                }
            })
            .await;
    }

    /// Tells subscription `id` that stream `path`'s tail is now `tail` (links it when its glob
    /// matches, wakes it when entries are pending). Errors: `NotFound`, `Unavailable`.
    async fn tell(&self, id: &str, path: &str, tail: &str) -> Result<()> {
        self.update(id, |rec, now| match machine::appended(rec, path, tail, now) {
            Some(change) => Ok(((), true, change)),
            None => Ok(((), false, Change::default())),
        })
        .await
    }

    /// One retry of every notification in `missed`, with each stream's current tail (which
    /// covers the append that was missed). Those that fail again are kept. Returns whether
    /// any is left.
    async fn retry_missed_once(&self) -> bool {
        let batch: Vec<(String, String)> = self.missed.lock().expect("lock").drain().collect();
        for (id, path) in batch {
            let r = match self.tail(&path).await {
                Ok(Some(t)) => self.tell(&id, &path, &t).await,
                // Deleted since: nothing left to wake for.
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            };
            match r {
                Ok(()) | Err(SubscriptionError::NotFound) => {
                    tracing::info!(subscription = %id, stream = %path, "subscription told of an append after a retry")
                }
                Err(_) => {
                    self.missed.lock().expect("lock").insert((id, path));
                }
            }
        }
        !self.missed.lock().expect("lock").is_empty()
    }

    async fn deleted(&self, path: &str) {
        let ids: Vec<String> = {
            let c = self.cache.read().expect("lock");
            c.entries.values().filter(|e| e.matches(path)).map(|e| e.id.clone()).collect()
        };
        for id in ids {
            let r = self.update(&id, |rec, _| Ok(((), machine::stream_deleted(rec, path), Change::default()))).await;
            if let Err(e) = r {
                if e != SubscriptionError::NotFound {
                    tracing::warn!(subscription = %id, stream = %path, error = %e, "subscription not told of a delete");
                }
            }
        }
    }

    /// Compares every stream of a subscription with its tail (appends nobody told it of).
    async fn reconcile(&self, e: &Entry) {
        let mut paths: Vec<String> = e.streams.clone();
        if let Some(p) = &e.pattern {
            match self.glob_candidates(p).await {
                Ok(more) => paths.extend(more),
                Err(err) => tracing::warn!(subscription = %e.id, error = %err, "cannot list streams to reconcile"),
            }
        }
        for p in paths {
            let r = match self.tail(&p).await {
                Ok(Some(t)) => self.tell(&e.id, &p, &t).await,
                Ok(None) => Ok(()),
                Err(err) => Err(err),
            };
            match r {
                Ok(()) | Err(SubscriptionError::NotFound) => {}
                Err(err) => {
                    tracing::warn!(subscription = %e.id, stream = %p, error = %err, "reconcile failed; retrying");
                    self.missed.lock().expect("lock").insert((e.id.clone(), p));
                    self.missed_added.notify_one();
                }
            }
        }
    }

    async fn deliver(&self, id: &str, url: &str, body: String) -> machine::Delivery {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let sig = self.keys.read().expect("lock").sign(body.as_bytes(), now);
        let mut req = self.http.post(url).header("content-type", "application/json").body(body);
        if let Some(s) = sig {
            req = req.header("webhook-signature", s);
        }
        match req.send().await {
            Ok(resp) if resp.status().is_success() => {
                let done = resp
                    .bytes()
                    .await
                    .ok()
                    .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                    .and_then(|v| v.get("done").and_then(Value::as_bool))
                    == Some(true);
                metrics::counter!("baton_subscription_deliveries_total", "result" => "accepted").increment(1);
                machine::Delivery::Accepted { done }
            }
            Ok(resp) => {
                tracing::warn!(subscription = id, url, status = %resp.status(), "webhook delivery refused (not 2xx); retried with backoff");
                metrics::counter!("baton_subscription_deliveries_total", "result" => "refused").increment(1);
                machine::Delivery::Failed
            }
            Err(e) => {
                // The whole cause chain: reqwest's own text does not say "connection refused".
                let mut why = e.to_string();
                let mut src = std::error::Error::source(&e);
                while let Some(c) = src {
                    why.push_str(": ");
                    why.push_str(&c.to_string());
                    src = c.source();
                }
                tracing::warn!(subscription = id, url, error = %why, "webhook delivery failed; retried with backoff");
                metrics::counter!("baton_subscription_deliveries_total", "result" => "failed").increment(1);
                machine::Delivery::Failed
            }
        }
    }

    async fn announce(&self, wake_stream: &str, event: String) -> std::result::Result<(), String> {
        let Ok(path) = StreamPath::new(wake_stream) else { return Ok(()) };
        let req = AppendRequest {
            data: Bytes::from(event),
            content_type: Some("application/json".into()),
            ..Default::default()
        };
        // Appended as Baton's own: not an append any subscription is told of (so a pattern that
        // matches a wake stream cannot wake on wake events, and no wake can feed itself).
        match OWN_WAKE_EVENT.scope((), self.streams.append(&path, req)).await {
            Ok(_) => Ok(()),
            // A wake stream that is gone, closed or not JSON cannot take wake events: the wake
            // stays claimable (a worker that claims finds it), nothing is retried forever.
            Err(
                e @ (StreamError::NotFound { .. }
                | StreamError::Gone { .. }
                | StreamError::Closed { .. }
                | StreamError::Conflict { .. }),
            ) => {
                tracing::warn!(stream = wake_stream, error = %e, "wake event not appended");
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// One step-and-act round of the driver for message `msg`, delivered under `lease`. Returns
    /// the queue decision. A lease that is lost (this process was stopped or cut off from the
    /// backend for the claim timeout, and another process took the message over) ends the
    /// round before its next webhook delivery or wake event: the other process acts now.
    async fn drive(&self, msg: &DriveMessage, lease: &baton_queue::Lease) -> Decision {
        loop {
            if lease.is_lost() {
                tracing::warn!(subscription = %msg.id, "delivery lease lost; another process delivers");
                return Decision::Retry;
            }
            let l = match self.backend.load(&msg.id).await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(subscription = %msg.id, error = %e, "cannot read subscription; retrying");
                    return Decision::RetryAfter(Duration::from_secs(1));
                }
            };
            let Some(mut rec) = l.record else { return Decision::Ack };
            let (step, changed) = machine::drive(&mut rec, &msg.driver, l.now_ms, &self.callback_url(&msg.id));
            if changed {
                match self.backend.store(&msg.id, l.version, Some(&rec), RegistryOp::Keep, None).await {
                    Ok(true) => {}
                    Ok(false) => continue,
                    Err(_) => return Decision::RetryAfter(Duration::from_secs(1)),
                }
            }
            match step {
                Step::Superseded | Step::Idle => return Decision::Ack,
                Step::Sleep(ms) => return Decision::RetryAfter(Duration::from_millis(ms.max(1))),
                Step::Deliver { generation: _, wake_id, body } => {
                    let url = rec.spec.webhook_url.clone().unwrap_or_default();
                    if lease.is_lost() {
                        continue;
                    }
                    let outcome = self.deliver(&msg.id, &url, body).await;
                    if let Err(e) = self
                        .update(&msg.id, |rec, now| {
                            let changed = machine::delivered(rec, &msg.driver, &wake_id, outcome, now);
                            Ok(((), changed, Change::default()))
                        })
                        .await
                    {
                        if e == SubscriptionError::NotFound {
                            return Decision::Ack;
                        }
                        return Decision::RetryAfter(Duration::from_secs(1));
                    }
                }
                Step::Announce { generation: _, wake_id, wake_stream, event } => {
                    if lease.is_lost() {
                        continue;
                    }
                    if let Err(e) = self.announce(&wake_stream, event).await {
                        tracing::warn!(stream = %wake_stream, error = %e, "wake event not appended; retrying");
                        return Decision::RetryAfter(Duration::from_secs(1));
                    }
                    metrics::counter!("baton_subscription_wake_events_total").increment(1);
                    if let Err(e) = self
                        .update(&msg.id, |rec, _| {
                            let changed = machine::announced(rec, &wake_id);
                            Ok(((), changed, Change::default()))
                        })
                        .await
                    {
                        if e == SubscriptionError::NotFound {
                            return Decision::Ack;
                        }
                        return Decision::RetryAfter(Duration::from_secs(1));
                    }
                }
            }
        }
    }
}

tokio::task_local! {
    /// Set while the driver appends a wake event: the observer ignores that append.
    static OWN_WAKE_EVENT: ();
}

struct Hook(Weak<Inner>);

#[async_trait]
impl StreamObserver for Hook {
    async fn appended(&self, path: &StreamPath, tail: &str) {
        if OWN_WAKE_EVENT.try_with(|_| ()).is_ok() {
            return;
        }
        if let Some(inner) = self.0.upgrade() {
            inner.appended(path.as_str(), tail).await;
        }
    }

    async fn deleted(&self, path: &StreamPath) {
        if let Some(inner) = self.0.upgrade() {
            inner.deleted(path.as_str()).await;
        }
    }
}

struct Driver(Weak<Inner>);

#[async_trait]
impl baton_queue::Handler for Driver {
    async fn handle(&self, d: Delivery) -> Decision {
        let Some(inner) = self.0.upgrade() else { return Decision::Retry };
        let Ok(msg) = serde_json::from_slice::<DriveMessage>(&d.payload) else {
            return Decision::DeadLetter("not a subscription delivery message".into());
        };
        inner.drive(&msg, &d.lease).await
    }
}

/// Retries the notifications of appends that failed ([`Inner::retry_missed_once`]), 100 ms
/// after the first failure, then doubling up to 2 s while the backend still fails; idle while
/// none is missed. Ends when the service is closed or dropped.
async fn retry_missed(weak: Weak<Inner>, added: Arc<tokio::sync::Notify>) {
    loop {
        let stop = match weak.upgrade() {
            Some(i) => i.stop.clone(),
            None => return,
        };
        // Woken by a notification that failed (a permit is kept if none was waiting); every
        // second anyway, to end once the service is dropped.
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = added.notified() => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        let mut wait = MISSED_RETRY.0;
        loop {
            match weak.upgrade() {
                Some(i) if !i.missed.lock().expect("lock").is_empty() => {}
                Some(_) => break,
                None => return,
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            let Some(inner) = weak.upgrade() else { return };
            if !inner.retry_missed_once().await {
                break;
            }
            wait = (wait * 2).min(MISSED_RETRY.1);
        }
    }
}

/// Reloads the registry (and the key ring) when another process changed it, and reconciles the
/// subscriptions this process had not seen.
async fn poll_registry(weak: Weak<Inner>) {
    loop {
        let (period, stop) = match weak.upgrade() {
            Some(i) => (i.cfg.registry_poll, i.stop.clone()),
            None => return,
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(period) => {}
        }
        let Some(inner) = weak.upgrade() else { return };
        let Ok(v) = inner.backend.registry_version().await else { continue };
        if v == inner.cache.read().expect("lock").version {
            continue;
        }
        let Ok((v, entries)) = inner.backend.registry().await else { continue };
        let fresh: Vec<Entry> = {
            let mut c = inner.cache.write().expect("lock");
            let fresh = entries.iter().filter(|e| c.entries.get(&e.id) != Some(*e)).cloned().collect();
            c.set(v, entries);
            fresh
        };
        if let Ok(now) = inner.backend.now_ms().await {
            if let Ok(ring) = inner.backend.keys(now).await {
                *inner.keys.write().expect("lock") = ring;
            }
        }
        for e in fresh {
            inner.reconcile(&e).await;
        }
    }
}
