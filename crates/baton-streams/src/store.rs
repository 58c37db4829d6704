//! [`StreamStore`]: the public entry point, one type over every backend. It validates and
//! resolves each request (defaults, fork snapshots, body preparation) and hands it to its
//! [`StreamBackend`] (`backend.rs`); it constructs the backends (`memory.rs`, `redis/`). It also
//! tells its [`StreamObserver`], if any, of the writes it made.

use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use baton_redis::RedisConfig;
use bytes::Bytes;

use crate::backend::{CreateSpec, Deleted, StreamBackend, WriteSpec};
use crate::end::{EndReason, Ended};
use crate::error::{Result, StreamError};
use crate::limits::RunLimits;
use crate::offset::{Offset, OffsetTag, ReadFrom};
use crate::settings::StreamStoreSettings;
use crate::types::*;

/// A durable stream store: the in-memory backend or Redis (standalone or Cluster). Cheap to
/// clone; share one per process (live readers of a stream share one tail loop per store).
#[derive(Clone)]
pub struct StreamStore {
    pub(crate) backend: Arc<dyn StreamBackend>,
    pub(crate) settings: Arc<StreamStoreSettings>,
    /// Shared by every clone ([`StreamStore::set_observer`]).
    observer: Arc<RwLock<Option<Arc<dyn StreamObserver>>>>,
}

/// Told of the writes a [`StreamStore`] (this process, through this store or any of its clones)
/// makes, after they are committed; installed with [`StreamStore::set_observer`].
///
/// Each call is awaited by the store method that made the write, before that method returns: a
/// write acknowledged to a client has been observed (so keep the calls short, e.g. hand the event
/// to a channel). Calls for concurrent writes, to one stream or several, may overlap and arrive
/// in any order (the tail tokens of one stream incarnation order its writes).
///
/// Not observed: failed writes, producer duplicates (`Appended::duplicate`), writes that changed
/// nothing (an idempotent re-create, a close of a stream already ended), and what a backend does
/// without a store call: the end of a silent run (`producer_lost`, by the sweeper or by whatever
/// call notices it), expiry, the collection of a soft-deleted fork source, and writes of other
/// processes (other stores on the same Redis).
///
/// ```
/// use std::sync::{Arc, Mutex};
///
/// use baton_streams::{CreateOptions, StreamObserver, StreamPath, StreamStore, StreamStoreSettings};
///
/// #[derive(Default)]
/// struct Log(Mutex<Vec<String>>);
///
/// #[async_trait::async_trait]
/// impl StreamObserver for Log {
///     async fn appended(&self, path: &StreamPath, tail: &str) {
///         self.0.lock().unwrap().push(format!("{path} {tail}"));
///     }
///     async fn deleted(&self, path: &StreamPath) {
///         self.0.lock().unwrap().push(format!("{path} deleted"));
///     }
/// }
///
/// # #[tokio::main]
/// # async fn main() -> baton_streams::Result<()> {
/// let store = StreamStore::memory(StreamStoreSettings::default());
/// let log = Arc::new(Log::default());
/// store.set_observer(log.clone());
/// let path = StreamPath::new("acme/orders")?;
/// let created = store.create(&path, CreateOptions { initial: Some("hello".into()), ..Default::default() }).await?;
/// store.delete(&path).await?;
/// let tail = created.info.tail.token(&created.info.incarnation);
/// assert_eq!(*log.0.lock().unwrap(), [format!("acme/orders {tail}"), "acme/orders deleted".to_string()]);
/// assert!(store.list("acme/", 100).await?.is_empty());
/// # Ok(())
/// # }
/// ```
#[async_trait::async_trait]
pub trait StreamObserver: Send + Sync + 'static {
    /// After a create (with or without initial data; forks; a run open that created its stream), an
    /// append, or a close that was accepted and was not a producer duplicate: the stream's path and
    /// its tail as the offset token clients see in `Stream-Next-Offset`
    /// ([`Offset::token`] of the stream's incarnation, e.g.
    /// `0001732934123456_0000000000000000_3fa8c2d1e0b4`; the untagged
    /// `0001732934123456_0000000000000000` when the incarnation is unknown).
    async fn appended(&self, path: &StreamPath, tail: &str);
    /// After a delete (hard or soft) of the stream at `path` by [`StreamStore::delete`].
    async fn deleted(&self, path: &StreamPath);
}

/// Listings at most per [`StreamStore::list_page`].
const LIST_ROUNDS: usize = 4;

/// One page of [`StreamStore::list_page`].
#[derive(Clone, Debug)]
pub struct StreamPage {
    /// The streams, in path order.
    pub streams: Vec<StreamInfo>,
    /// Where the next page starts (`after`), `None` on the last page.
    pub next: Option<StreamPath>,
}

const MAX_SAFE_INT: u64 = (1 << 53) - 1;

impl StreamStore {
    /// The in-memory backend (embedded default; same semantics as Redis, data lost on exit).
    /// Must be called inside a Tokio runtime (it starts a sweeper task for expiry and silence).
    pub fn memory(settings: StreamStoreSettings) -> Self {
        let settings = Arc::new(settings);
        Self::with_backend(crate::memory::MemoryStreamBackend::new(settings.clone()), settings)
    }

    pub(crate) fn with_backend(backend: Arc<dyn StreamBackend>, settings: Arc<StreamStoreSettings>) -> Self {
        Self { backend, settings, observer: Arc::new(RwLock::new(None)) }
    }

    /// The Redis backend (standalone or Cluster). Connects once (shared connection); tail loops
    /// open one dedicated connection per live-read stream. Errors: [`StreamError::Backend`].
    pub async fn redis(config: RedisConfig, settings: StreamStoreSettings) -> Result<Self> {
        let settings = Arc::new(settings);
        let backend = crate::redis::RedisStreamBackend::connect(config, settings.clone()).await?;
        Ok(Self::with_backend(backend, settings))
    }

    /// Settings of this store.
    pub fn settings(&self) -> &StreamStoreSettings {
        &self.settings
    }

    /// Installs `observer` for this store and all its clones, made before or after (replaces a
    /// previous one). Writes in flight while it is installed may be told to either.
    pub fn set_observer(&self, observer: Arc<dyn StreamObserver>) {
        *self.observer.write().unwrap_or_else(PoisonError::into_inner) = Some(observer);
    }

    /// The installed observer (one uncontended read lock; nothing else without one).
    fn observer(&self) -> Option<Arc<dyn StreamObserver>> {
        self.observer.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    async fn observe_append(&self, path: &StreamPath, tail: Offset, incarnation: &str) {
        if let Some(o) = self.observer() {
            o.appended(path, &tail.token(incarnation)).await;
        }
    }

    /// The paths of the streams that exist (not soft-deleted, not expired), in no particular
    /// order, whose path starts with `prefix` (`""` for all; a plain string prefix, not a glob nor
    /// a segment boundary: `"acme/run"` matches `acme/run-1`). At most `limit` paths, each once.
    ///
    /// `keep` is called with no lock of the store held (other operations go on meanwhile).
    /// Memory: the paths of the prefix taken from the map (under its lock, briefly), then
    /// filtered. Redis: `SCAN … MATCH baton:s:{<prefix>*}:m COUNT 1000` over the
    /// stream metadata keys (on every master of a Cluster), then one `HMGET` per match (soft-deleted
    /// streams keep their metadata key); it stops once it has `limit` paths. The cost grows with
    /// the whole keyspace of each node (SCAN visits every key), not with the matches: meant for
    /// occasional listings, not per request. A stream created or deleted during the call may or may
    /// not be listed; in Cluster, one whose slot migrates meanwhile may be missed.
    ///
    /// Errors: [`StreamError::Backend`].
    pub async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<StreamPath>> {
        self.backend.list(prefix, limit).await
    }

    /// One page of the streams whose path starts with `prefix` (a plain string prefix, as
    /// [`StreamStore::list`]), in path order (bytewise), after the path `after` when given, and
    /// only those `keep` accepts (e.g. what a caller may read): each stream's metadata as
    /// [`StreamStore::head`] gives it (so a silent run found past its silence timeout is ended
    /// as `producer_lost`). At most `limit` streams (`limit` from 1); `next` is the path to pass
    /// as `after` for the next page, `None` on the last. Streams found gone when read (deleted,
    /// expired, soft-deleted: on Redis their metadata stays until their forks go) are left out
    /// and the page is filled from further listings, at most 4 in all: a page may then hold
    /// fewer than `limit` streams and still have a `next`.
    ///
    /// `keep` is called with no lock of the store held (other operations go on meanwhile).
    /// Memory: the paths of the prefix taken from the map (under its lock, briefly), then
    /// filtered. Redis: `SCAN … MATCH` over the stream metadata keys of the
    /// prefix on every master of a Cluster (the whole keyspace of each node for every page, since
    /// SCAN has no order; only the `limit + 1` smallest paths are held), then one metadata read
    /// per listed stream (16 at a time). Meant for an operator's browsing, not per request. A
    /// stream created or deleted meanwhile may or may not be listed.
    ///
    /// Errors: [`StreamError::InvalidRequest`] (`limit` 0), [`StreamError::Backend`].
    pub async fn list_page(
        &self,
        prefix: &str,
        after: Option<&StreamPath>,
        limit: usize,
        keep: &crate::backend::PathFilter,
    ) -> Result<StreamPage> {
        use futures::StreamExt;
        if limit == 0 {
            return Err(StreamError::invalid("a stream listing needs a limit of at least 1"));
        }
        let mut streams = Vec::new();
        let mut after = after.cloned();
        // Streams found gone when read leave room: a few more listings fill it.
        for _ in 0..LIST_ROUNDS {
            let (paths, more) = self.backend.list_sorted(prefix, after.as_ref(), limit - streams.len(), keep).await?;
            after = if more { paths.last().cloned() } else { None };
            let mut heads = futures::stream::iter(paths).map(|p| async move { self.head(&p).await }).buffered(16);
            while let Some(head) = heads.next().await {
                match head {
                    Ok(info) => streams.push(info),
                    Err(StreamError::NotFound { .. } | StreamError::Gone { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            if after.is_none() || streams.len() == limit {
                break;
            }
        }
        Ok(StreamPage { streams, next: after })
    }

    /// Creates a stream, or confirms an identical one (PROTOCOL.md §5.1): `created == false` when
    /// a stream with the same content type (normalized), expiry, closed state and fork origin
    /// exists, and, when `opts.limits` is `Some`, the same run limits (fixed at creation; with
    /// `None` they are not compared). Forks (§4.2): data up to the fork offset (plus `sub_offset`) is copied; the fork
    /// gets the source's content type and expiry unless given.
    ///
    /// Errors: [`StreamError::Conflict`] (different config, the reason naming what differs; other
    /// run limits, naming the limit with both values; soft-deleted path; fork content type
    /// differs; soft-deleted source), `InvalidRequest` (a zero silence timeout: `None` disables it), [`StreamError::NotFound`] (fork source), `InvalidRequest`
    /// (expiry in the past, sub-offset overshoot), `OffsetAhead` (fork offset past the source's
    /// tail), `OffsetGone`, `InvalidJson`.
    pub async fn create(&self, path: &StreamPath, opts: CreateOptions) -> Result<Created> {
        let wanted = opts.limits;
        let created = self.create_inner(path, opts, None).await?.0;
        if let (false, Some(wanted)) = (created.created, wanted) {
            // The run limits of a stream are fixed at creation: a re-create asking for others
            // is not the same stream.
            if let Some(reason) = limits_differ(&created.info.limits, &wanted) {
                return Err(StreamError::conflict(reason));
            }
        }
        Ok(created)
    }

    pub(crate) async fn create_inner(
        &self,
        path: &StreamPath,
        opts: CreateOptions,
        claim: Option<String>,
    ) -> Result<(Created, Option<u64>)> {
        if let Expiry::At(t) = opts.expiry {
            if t <= now_ms() {
                return Err(StreamError::invalid("Stream-Expires-At is in the past"));
            }
        }
        let limits = opts.limits.unwrap_or(self.settings.default_limits);
        if limits.silence_timeout.is_some_and(|d| d.is_zero()) {
            return Err(StreamError::invalid(
                "a silence timeout of 0 would end the stream at once; give a positive duration, or none to disable it",
            ));
        }
        if limits.max_run.is_some_and(|d| d.is_zero()) {
            return Err(StreamError::invalid(
                "a max run of 0 would delete the stream as soon as it is created; give a positive duration, or none for no limit",
            ));
        }
        let incarnation = uuid::Uuid::now_v7().simple().to_string();
        let Some(fork) = opts.fork.clone() else {
            let incarnation = match &opts.owner {
                Some(o) if o.is_empty() || !o.bytes().all(|b| b.is_ascii_alphanumeric()) => {
                    return Err(StreamError::invalid("a stream's owner mark is ASCII letters and digits"))
                }
                Some(o) => format!("{incarnation}-{o}"),
                None => incarnation,
            };
            let ct = opts.content_type.clone().unwrap_or_else(|| DEFAULT_CONTENT_TYPE.to_string());
            let mut records = Vec::new();
            if let Some(body) = &opts.initial {
                if let Some((data, n)) = prepare_body(&ct, body, true)? {
                    records.push((None, data, n));
                }
            }
            let spec = CreateSpec {
                incarnation,
                content_type: ct,
                expiry: opts.expiry,
                limits,
                closed: opts.closed,
                records,
                base: Offset::ZERO,
                fork: None,
                claim,
                silence_from_open: opts.silence_from_open,
            };
            let out = self.backend.create(path, spec).await?;
            if out.0.created {
                self.observe_append(path, out.0.info.tail, &out.0.info.incarnation).await;
            }
            return Ok(out);
        };
        // Fork: snapshot the source, create the fork with copied records, reference the source.
        let snap = match self.backend.snapshot(&fork.source, fork.offset).await {
            Err(StreamError::Gone { .. }) => {
                return Err(StreamError::conflict("the fork source is deleted (soft-deleted)"))
            }
            other => other?,
        };
        let ct = match &opts.content_type {
            Some(ct) if normalize_content_type(ct) != normalize_content_type(&snap.info.content_type) => {
                return Err(StreamError::conflict("fork content type differs from the source's"))
            }
            Some(ct) => ct.clone(),
            None => snap.info.content_type.clone(),
        };
        let mut records: Vec<(Option<Offset>, Bytes, u32)> =
            snap.inherited.iter().map(|r| (Some(r.offset), r.data.clone(), r.messages)).collect();
        if fork.sub_offset > 0 {
            let next = snap.next.as_ref().ok_or_else(|| {
                StreamError::invalid("Stream-Fork-Sub-Offset names a position past the next data boundary")
            })?;
            let (data, n) = if is_json(&ct) {
                let d = json_prefix(&next.data, fork.sub_offset).ok_or_else(|| {
                    StreamError::invalid("Stream-Fork-Sub-Offset overshoots the next append's message count")
                })?;
                (d, fork.sub_offset as u32)
            } else {
                if fork.sub_offset as usize > next.data.len() {
                    return Err(StreamError::invalid("Stream-Fork-Sub-Offset overshoots the next append's length"));
                }
                (next.data.slice(..fork.sub_offset as usize), 0)
            };
            records.push((None, data, n));
        }
        if let Some(body) = &opts.initial {
            if let Some((data, n)) = prepare_body(&ct, body, true)? {
                records.push((None, data, n));
            }
        }
        // §4.2 expiry table: no expiry requested ⇒ inherit the source's TTL or Expires-At.
        let expiry = match opts.expiry {
            Expiry::None => snap.info.expiry,
            e => e,
        };
        let spec = CreateSpec {
            // A fork carries its source's offset tag: the source's offsets up to the fork point
            // are the fork's too (see `OffsetTag::of`).
            incarnation: format!("{}.{incarnation}", OffsetTag::of(&snap.info.incarnation)),
            content_type: ct,
            expiry,
            limits,
            closed: opts.closed,
            records,
            base: snap.offset,
            fork: Some(ForkFrom {
                source: fork.source.clone(),
                offset: Some(snap.offset),
                sub_offset: fork.sub_offset,
            }),
            claim,
            silence_from_open: false,
        };
        let out = self.backend.create(path, spec).await?;
        if out.0.created {
            // Best effort: a source deleted meanwhile needs no reference (data was copied).
            let _ = self.backend.refs(&fork.source, true).await;
            self.observe_append(path, out.0.info.tail, &out.0.info.incarnation).await;
        }
        Ok(out)
    }

    /// Appends (and/or closes) (PROTOCOL.md §5.2, §5.2.1, §5.3). Validation order follows §5.2
    /// "Error Precedence": not found / soft-deleted, stale producer epoch, producer duplicate (→
    /// `Appended { duplicate: true }`, nothing written), closed, content type, producer epoch and
    /// sequence, `Stream-Seq`, `max_len`. A close-only request (empty body, `close` set, no producer)
    /// on an already-closed stream succeeds with the existing end (§5.3 idempotent).
    ///
    /// Errors: `NotFound`, `Gone`, `Fenced`, `Closed` (final offset and reason), `Conflict`
    /// (content type), `EpochMustStartAtZero`, `SequenceGap`, `StreamSeqRegression`, `TooLong`,
    /// `InvalidRequest` (empty body without close, bad producer stamp), `InvalidJson`, `EmptyArray`.
    pub async fn append(&self, path: &StreamPath, req: AppendRequest) -> Result<Appended> {
        self.write(path, req, None).await
    }

    /// [`StreamStore::append`], with a [`WriteSpec::fence`] when given, in a
    /// `baton.stream.append` span (target `baton::trace`: exported only when the program
    /// exports spans, next to free otherwise).
    async fn write(
        &self,
        path: &StreamPath,
        req: AppendRequest,
        fence: Option<(String, Option<u64>)>,
    ) -> Result<Appended> {
        // Held, not entered (no spans of ours below it): nothing is copied or grows when spans
        // are off. It ends when this returns.
        let _span = tracing::info_span!(
            target: "baton::trace",
            "baton.stream.append",
            baton.stream = %path.as_str(),
            baton.append.bytes = req.data.len(),
            baton.append.close = req.close.is_some(),
        );
        if let Some(p) = &req.producer {
            if p.id.is_empty() {
                return Err(StreamError::invalid("Producer-Id must not be empty"));
            }
            if p.epoch > MAX_SAFE_INT || p.seq > MAX_SAFE_INT {
                return Err(StreamError::invalid("Producer-Epoch and Producer-Seq must be ≤ 2^53-1"));
            }
        }
        if req.data.is_empty() && req.close.is_none() {
            return Err(StreamError::invalid("an append needs a non-empty body (or a close)"));
        }
        let (ctn, records) = match &req.content_type {
            Some(ct) => {
                let recs = prepare_body(ct, &req.data, false)?;
                (Some(normalize_content_type(ct)), recs.into_iter().collect::<Vec<_>>())
            }
            None => (None, if req.data.is_empty() { vec![] } else { vec![(req.data.clone(), 0)] }),
        };
        let close_only = records.is_empty();
        let spec = WriteSpec {
            incarnation: req.incarnation.clone(),
            ctn,
            stream_seq: req.stream_seq.clone(),
            producer: req.producer.clone(),
            close: req.close,
            records,
            fence,
        };
        // A close-only or fenced close that finds the stream ended is answered with that end,
        // with the incarnation of the stream the backend found ended, and writes nothing.
        let found_end = spec.answers_found_end();
        let a = self.backend.write(path, spec).await?;
        // Observed: a write that wrote something (records, or the end it set).
        if !a.duplicate && (a.ended_now || !(close_only || found_end)) {
            self.observe_append(path, a.tail, &a.incarnation).await;
        }
        Ok(a)
    }

    /// Ends a stream with `reason` (close-only, §5.3; run `finish`/`cancel`). Idempotent: on an
    /// ended stream returns the existing end with `ended_now == false`. Every caller racing here is
    /// told the same end. Errors: `NotFound`, `Gone`.
    pub async fn close(&self, path: &StreamPath, reason: EndReason) -> Result<Appended> {
        self.append(path, AppendRequest { close: Some(reason), ..Default::default() }).await
    }

    /// Ends the stream with `reason`, after appending `entry` (a body of `content_type`) when
    /// given, in one atomic step, only while producer `producer`'s current epoch is `epoch`
    /// (`None`: no epoch of it was ever claimed, [`StreamStore::open`]): an end fenced to the
    /// holder of that epoch, so that a writer fenced by a newer open cannot end the newer
    /// holder's stream (Baton's command outputs: a delivery's terminal write).
    ///
    /// Returns the stream's one end: `ended_now` when this call ended it; an end found in place
    /// (the stream had ended already, by anyone) is returned with `ended_now == false` and
    /// nothing written (that check comes first). Errors: `Fenced` (the producer's epoch is
    /// another: `current_epoch`, 0 when none was claimed; nothing written), `NotFound`, `Gone`,
    /// and the errors of an append of `entry` (`Conflict` for the content type, `InvalidJson`,
    /// `EmptyArray`). `entry` is part of the end: `max_len` does not count it (a full stream
    /// still ends this way, its count then one past the limit).
    pub async fn end_fenced(
        &self,
        path: &StreamPath,
        reason: EndReason,
        entry: Option<(Bytes, String)>,
        producer: &str,
        epoch: Option<u64>,
    ) -> Result<Ended> {
        if producer.is_empty() {
            return Err(StreamError::invalid("a producer id must not be empty"));
        }
        let (data, content_type) = match entry {
            Some((d, ct)) => (d, Some(ct)),
            None => (Bytes::new(), None),
        };
        let req = AppendRequest { data, content_type, close: Some(reason), ..Default::default() };
        let a = match self.write(path, req, Some((producer.to_string(), epoch))).await {
            Err(StreamError::Fenced { current_epoch, .. }) => {
                return Err(StreamError::Fenced { epoch: epoch.unwrap_or(0), current_epoch })
            }
            other => other?,
        };
        let end = a.end.ok_or_else(|| StreamError::Backend("close without an end".into()))?;
        Ok(Ended { end, ended_now: a.ended_now })
    }

    /// The current epoch of producer `id` of the stream (the last one an open claimed), `None`
    /// when none was claimed. Errors: `NotFound`, `Gone`.
    pub async fn producer_epoch(&self, path: &StreamPath, id: &str) -> Result<Option<u64>> {
        self.backend.producer_epoch(path, id).await
    }

    /// Deletes a stream (§5.4). With live forks it is soft-deleted (410 afterwards, path blocked).
    /// Deleting a fork releases its source (cascading garbage collection of soft-deleted sources).
    /// Errors: `NotFound`, `Gone` (already soft-deleted).
    pub async fn delete(&self, path: &StreamPath) -> Result<()> {
        let deleted = self.backend.delete(path).await?;
        if let Some(o) = self.observer() {
            o.deleted(path).await;
        }
        if let Deleted::Hard { fork_source: Some(mut src) } = deleted {
            while let Some(next) = self.backend.refs(&src, false).await? {
                src = next;
            }
        }
        Ok(())
    }

    /// Metadata (§5.5). Does not restart a sliding TTL. Ends a silent run as `producer_lost`.
    /// Errors: `NotFound`, `Gone`.
    pub async fn head(&self, path: &StreamPath) -> Result<StreamInfo> {
        Ok(self.backend.read(path, ReadFrom::Now, 0, 0, false, None).await?.1)
    }

    /// Catch-up read (§5.6) of at most [`StreamStoreSettings::max_read_bytes`] (at least one record).
    /// Restarts a sliding TTL. `ReadFrom::Now` returns no data and the tail.
    ///
    /// Errors: `NotFound`, `Gone`, `OffsetAhead` (offset past the tail), `OffsetGone` (before the
    /// earliest retained offset).
    pub async fn read(&self, path: &StreamPath, from: ReadFrom) -> Result<ReadChunk> {
        let max = self.settings.max_read_bytes;
        let (plain, tag) = from.untagged();
        let read = self.backend.read(path, plain, 10_000, max, true, None).await;
        let Some(tag) = tag else { return Ok(read?.0) };
        let refused = || match from {
            ReadFrom::Tagged(o, t) => StreamError::OffsetIncarnation { offset: format!("{o}_{t}") },
            _ => unreachable!("tagged"),
        };
        match read {
            // The data read is checked against the incarnation that served it.
            Ok((chunk, _)) if OffsetTag::of(&chunk.incarnation) != tag => Err(refused()),
            Ok((chunk, _)) => Ok(chunk),
            // An offset of another incarnation is usually ahead of (or behind) this one's data:
            // say which incarnation it belongs to rather than where it is.
            Err(e @ (StreamError::OffsetAhead { .. } | StreamError::OffsetGone { .. })) => {
                match self.head(path).await {
                    Ok(info) if OffsetTag::of(&info.incarnation) != tag => Err(refused()),
                    _ => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    /// Long-poll read (§5.7): returns at once when data exists after `from` or the stream is at its
    /// end (EOF); otherwise waits up to `timeout` for new data, the end, or deletion. An empty,
    /// up-to-date chunk means the timeout passed. Errors: as [`StreamStore::read`]; `NotFound` when
    /// the stream is deleted or expires while waiting.
    pub async fn read_live(&self, path: &StreamPath, from: ReadFrom, timeout: Duration) -> Result<ReadChunk> {
        let first = self.read(path, from).await?;
        if !first.records.is_empty() || first.end.is_some() || timeout.is_zero() {
            return Ok(first);
        }
        self.backend.wait(path, first.next_offset, &first.incarnation, self.settings.max_read_bytes, timeout).await
    }

    /// A live subscription (SSE, §5.8): yields chunks from `from` onward, then waits for more.
    /// Validation errors surface on the first [`Subscription::next`].
    pub fn subscribe(&self, path: &StreamPath, from: ReadFrom) -> Subscription {
        Subscription { store: self.clone(), path: path.clone(), from, state: None, done: false }
    }

    /// Drops data up to and including `through` (§4 retention); reads from earlier offsets then
    /// fail with `OffsetGone`. Returns the earliest readable offset. Errors: `NotFound`, `Gone`,
    /// `OffsetAhead`.
    pub async fn trim(&self, path: &StreamPath, through: Offset) -> Result<Offset> {
        self.backend.trim(path, through).await
    }

    /// Refreshes the silence clock without writing anything readers see (run semantics).
    /// Errors: `NotFound`, `Gone`, `Closed`.
    pub async fn keepalive(&self, path: &StreamPath) -> Result<StreamInfo> {
        self.backend.keepalive(path, None, None).await
    }
}

/// The first run limit in which `have` (an existing stream's) and `want` (a re-create's) differ,
/// as a conflict reason naming it with both values (durations compared in whole milliseconds, as
/// stored).
fn limits_differ(have: &RunLimits, want: &RunLimits) -> Option<String> {
    let ms = |d: Option<Duration>| d.map(|d| d.as_millis());
    let dur = |d: Option<Duration>| d.map_or("none".to_string(), |d| format!("{d:?}"));
    let num = |n: Option<u64>| n.map_or("none".to_string(), |n| n.to_string());
    let differ = |name: &str, have: String, want: String| {
        Some(format!(
            "{name} differs from the existing stream's: it has {have}, the request asks for {want} \
             (run limits are fixed at creation; delete the stream or use another path)"
        ))
    };
    if ms(have.silence_timeout) != ms(want.silence_timeout) {
        return differ("silence timeout (Baton-Silence-Timeout)", dur(have.silence_timeout), dur(want.silence_timeout));
    }
    if ms(have.max_run) != ms(want.max_run) {
        return differ("max run (Baton-Max-Run)", dur(have.max_run), dur(want.max_run));
    }
    if ms(have.done_ttl) != ms(want.done_ttl) {
        return differ("done TTL (Baton-Done-TTL)", dur(have.done_ttl), dur(want.done_ttl));
    }
    if have.max_len != want.max_len {
        return differ("max len (Baton-Max-Len)", num(have.max_len), num(want.max_len));
    }
    if have.max_len_per_writer != want.max_len_per_writer {
        return differ("max len per writer", num(have.max_len_per_writer), num(want.max_len_per_writer));
    }
    None
}

/// A live read position (SSE). Not `Clone`; one per reader.
pub struct Subscription {
    store: StreamStore,
    path: StreamPath,
    from: ReadFrom,
    state: Option<(Offset, String)>,
    done: bool,
}

impl Subscription {
    /// The next chunk: data, or an empty up-to-date chunk after `timeout` with nothing new, or the
    /// EOF chunk (`end` set) once; `Ok(None)` after EOF was delivered. Errors: as
    /// [`StreamStore::read`]; `NotFound` when the stream is deleted, re-created or expires.
    pub async fn next(&mut self, timeout: Duration) -> Result<Option<ReadChunk>> {
        if self.done {
            return Ok(None);
        }
        let chunk = match &self.state {
            None => {
                let c = self.store.read(&self.path, self.from).await?;
                if c.records.is_empty() && c.end.is_none() {
                    // Nothing yet: wait on the shared tail.
                    self.state = Some((c.next_offset, c.incarnation.clone()));
                    return self.wait(timeout).await.map(Some);
                }
                c
            }
            Some(_) => return self.wait(timeout).await.map(Some),
        };
        self.advance(&chunk);
        Ok(Some(chunk))
    }

    async fn wait(&mut self, timeout: Duration) -> Result<ReadChunk> {
        let (at, inc) = self.state.clone().expect("position known");
        let c = self.store.backend.wait(&self.path, at, &inc, self.store.settings.max_read_bytes, timeout).await?;
        self.advance(&c);
        Ok(c)
    }

    fn advance(&mut self, c: &ReadChunk) {
        self.state = Some((c.next_offset, c.incarnation.clone()));
        if c.end.is_some() {
            self.done = true;
        }
    }

    /// The offset the next chunk starts after (known after the first chunk).
    pub fn position(&self) -> Option<Offset> {
        self.state.as_ref().map(|s| s.0)
    }
}
