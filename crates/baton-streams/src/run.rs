//! Runs (seed `001`; over HTTP: docs/http-api.md, "Extensions: run semantics"): a producer that
//! opens a stream, appends idempotently, keeps it alive, and ends it exactly once (`finished`,
//! `cancelled` or `producer_lost`).

use std::fmt::Display;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::end::{EndReason, Ended};
use crate::error::{Result, StreamError};
use crate::limits::RunLimits;
use crate::offset::Offset;
use crate::store::StreamStore;
use crate::types::*;

/// How to open a run.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// Content type (default `application/octet-stream`).
    pub content_type: Option<String>,
    /// Protocol expiry (§5.1); usually `None` for runs (the run limits bound the lifetime).
    pub expiry: Expiry,
    /// Run limits; `None` = the store's defaults.
    pub limits: Option<RunLimits>,
    /// Producer id (default: a new UUIDv7). Re-opening with the same id bumps the epoch, which
    /// fences the previous holder (§5.2.1 "Zombie fencing").
    pub producer_id: Option<String>,
}

/// Attempts per append on backend errors (same producer sequence each time: no duplicates).
const ATTEMPTS: u32 = 5;

struct Inner {
    store: StreamStore,
    path: StreamPath,
    id: String,
    epoch: u64,
    content_type: String,
    incarnation: String,
    created: bool,
    next_seq: tokio::sync::Mutex<u64>,
    last_write: AtomicU64,
}

/// The producer of one run. Cheap to clone; appends from clones are serialized (one in flight),
/// so a retry is never overtaken.
#[derive(Clone)]
pub struct Producer(Arc<Inner>);

impl StreamStore {
    /// Opens a run: creates the stream (idempotent: an identical existing stream is joined, never
    /// reset) and claims a new producer epoch in the same call, fencing older holders of the
    /// producer id. Errors: `Conflict` (different config), `Closed` (the run already ended),
    /// `InvalidJson`, backend errors.
    pub async fn open(&self, path: &StreamPath, opts: OpenOptions) -> Result<Producer> {
        let id = opts.producer_id.clone().unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
        if id.is_empty() {
            return Err(StreamError::invalid("a producer id must not be empty"));
        }
        let create = CreateOptions {
            content_type: opts.content_type.clone(),
            expiry: opts.expiry,
            limits: opts.limits,
            ..Default::default()
        };
        let (created, epoch) = self.create_inner(path, create, Some(id.clone())).await?;
        let epoch = epoch.ok_or_else(|| StreamError::Backend("no epoch claimed".into()))?;
        Ok(Producer(Arc::new(Inner {
            store: self.clone(),
            path: path.clone(),
            id,
            epoch,
            content_type: created.info.content_type.clone(),
            incarnation: created.info.incarnation.clone(),
            created: created.created,
            next_seq: tokio::sync::Mutex::new(0),
            last_write: AtomicU64::new(now_ms()),
        })))
    }

    /// Ends a run from anywhere (e.g. a cancel button): exactly one end wins; the returned
    /// [`Ended`] tells the actual end. Errors: `NotFound`, `Gone`.
    pub async fn end(&self, path: &StreamPath, reason: EndReason) -> Result<Ended> {
        let a = self.close(path, reason).await?;
        let end = a.end.ok_or_else(|| StreamError::Backend("close without an end".into()))?;
        Ok(Ended { end, ended_now: a.ended_now })
    }

    /// Runs `task` as the producer of a run: opens it, keeps it alive (a keepalive after half the
    /// silence timeout without a write), and ends it when the task returns `Ok` (`finished`),
    /// returns `Err` (an error entry appended and `finished` atomically), or is cancelled through
    /// [`RunHandle::cancel`] (`cancelled`). When the run is ended elsewhere (cancel in another
    /// process, `producer_lost`), the task is stopped at its next keepalive and the handle reports
    /// that end.
    pub fn spawn<F, Fut, E>(&self, path: StreamPath, opts: OpenOptions, task: F) -> RunHandle
    where
        F: FnOnce(Producer) -> Fut + Send + 'static,
        Fut: Future<Output = std::result::Result<(), E>> + Send + 'static,
        E: Display + Send + 'static,
    {
        let cancel = CancellationToken::new();
        let store = self.clone();
        let token = cancel.clone();
        let join = tokio::spawn(async move {
            let producer = store.open(&path, opts).await?;
            let ended_elsewhere = CancellationToken::new();
            let ka = tokio::spawn(keepalive_loop(producer.clone(), ended_elsewhere.clone()));
            let outcome = tokio::select! {
                r = task(producer.clone()) => Some(r),
                _ = token.cancelled() => None,
                _ = ended_elsewhere.cancelled() => None,
            };
            ka.abort();
            match outcome {
                Some(Ok(())) => producer.finish().await,
                Some(Err(e)) => producer.fail(&e.to_string()).await,
                None => producer.cancel().await,
            }
        });
        RunHandle { cancel, join }
    }
}

async fn keepalive_loop(p: Producer, ended: CancellationToken) {
    let silence = p.0.store.head(&p.0.path).await.ok().and_then(|i| i.limits.silence_timeout);
    let Some(silence) = silence else { return };
    let tick = (silence / 4).max(Duration::from_millis(50));
    loop {
        tokio::time::sleep(tick).await;
        let idle = now_ms().saturating_sub(p.0.last_write.load(Ordering::Relaxed));
        if idle < (silence / 2).as_millis() as u64 {
            continue;
        }
        match p.keepalive().await {
            Ok(()) => {}
            Err(StreamError::Backend(_)) => {}
            Err(_) => {
                ended.cancel();
                return;
            }
        }
    }
}

/// Handle on a spawned run.
pub struct RunHandle {
    cancel: CancellationToken,
    join: JoinHandle<Result<Ended>>,
}

impl RunHandle {
    /// Cancels the run in this process: the task is dropped and the run ends as `cancelled`
    /// (unless it already ended).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Waits for the run to end; returns its one end. Errors: the open's errors, backend errors.
    pub async fn join(self) -> Result<Ended> {
        self.join.await.map_err(|e| StreamError::Backend(format!("run task failed: {e}")))?
    }
}

impl Producer {
    /// The stream path.
    pub fn path(&self) -> &StreamPath {
        &self.0.path
    }

    /// Producer id.
    pub fn id(&self) -> &str {
        &self.0.id
    }

    /// The epoch claimed at open.
    pub fn epoch(&self) -> u64 {
        self.0.epoch
    }

    /// `true` when the open created the stream (`false`: an existing one was joined).
    pub fn created(&self) -> bool {
        self.0.created
    }

    /// Appends one event (JSON streams: one JSON value, or an array flattened one level).
    /// Retries backend errors with the same producer sequence (a lost reply never duplicates).
    /// Returns the event's offset. Errors: `Closed` (with the final offset and end reason),
    /// `Fenced` (another open claimed a newer epoch), `NotFound` (deleted or re-created stream),
    /// `TooLong`, `InvalidJson`, `EmptyArray`, backend errors after the retries.
    pub async fn append(&self, data: impl Into<Bytes>) -> Result<Offset> {
        let a = self.send(data.into(), None).await?;
        Ok(a.producer_offset.unwrap_or(a.tail))
    }

    /// Ends the run as `finished`. Returns the actual end (someone else's, if they were first).
    pub async fn finish(&self) -> Result<Ended> {
        self.end_with(Bytes::new(), EndReason::Finished).await
    }

    /// Ends the run as `cancelled`. Returns the actual end.
    pub async fn cancel(&self) -> Result<Ended> {
        self.end_with(Bytes::new(), EndReason::Cancelled).await
    }

    /// Appends an error entry and ends the run as `finished`, atomically. The entry is
    /// `{"error": message}` on JSON streams, `error: message` otherwise.
    pub async fn fail(&self, message: &str) -> Result<Ended> {
        let entry = if is_json(&self.0.content_type) {
            serde_json::json!({ "error": message }).to_string()
        } else {
            format!("error: {message}")
        };
        self.end_with(Bytes::from(entry), EndReason::Finished).await
    }

    /// Refreshes the silence clock; invisible to readers. Errors: `Closed`, `Fenced`, `NotFound`.
    pub async fn keepalive(&self) -> Result<()> {
        let i = &self.0;
        i.store.backend.keepalive(&i.path, Some(&i.incarnation), Some((&i.id, i.epoch))).await?;
        i.last_write.store(now_ms(), Ordering::Relaxed);
        Ok(())
    }

    async fn end_with(&self, data: Bytes, reason: EndReason) -> Result<Ended> {
        match self.send(data, Some(reason)).await {
            Ok(a) => Ok(Ended {
                end: a.end.ok_or_else(|| StreamError::Backend("close without an end".into()))?,
                ended_now: a.ended_now,
            }),
            Err(StreamError::Closed { end, .. }) => Ok(Ended { end, ended_now: false }),
            Err(e) => Err(e),
        }
    }

    async fn send(&self, data: Bytes, close: Option<EndReason>) -> Result<Appended> {
        let i = &self.0;
        let mut next = i.next_seq.lock().await;
        let mut seq = *next;
        *next += 1; // reserved before sending: a failed send never lets a later one reuse it
        let mut attempt = 0;
        loop {
            let req = AppendRequest {
                data: data.clone(),
                content_type: Some(i.content_type.clone()),
                stream_seq: None,
                producer: Some(ProducerStamp { id: i.id.clone(), epoch: i.epoch, seq }),
                close,
                incarnation: Some(i.incarnation.clone()),
            };
            match i.store.append(&i.path, req).await {
                Ok(a) => {
                    i.last_write.store(now_ms(), Ordering::Relaxed);
                    return Ok(a);
                }
                Err(StreamError::Backend(e)) if attempt + 1 < ATTEMPTS => {
                    attempt += 1;
                    tracing::debug!(path = %i.path, seq, error = %e, "append failed; retrying with the same sequence");
                    tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                }
                Err(StreamError::SequenceGap { expected, .. }) if expected < seq && attempt == 0 => {
                    // An earlier append failed for good (its caller got the error): reuse its slot.
                    seq = expected;
                    *next = expected + 1;
                    attempt = 1;
                }
                Err(e) => return Err(e),
            }
        }
    }
}
