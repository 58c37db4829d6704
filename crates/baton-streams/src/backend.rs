//! The seam between [`StreamStore`](crate::StreamStore) (`store.rs`: validation, forks, body
//! preparation, live subscriptions) and a storage backend (`memory.rs`, `redis/`). A backend
//! implements [`StreamBackend`] with the requests below, already validated and resolved by the
//! store. Both backends give every call the same semantics: the Redis backend runs each call but
//! `wait` as one script call, the memory backend runs it under the stream's lock.
//!
//! Backends import this module and the lower ones (`types`, `settings`, `error`, `offset`, `end`,
//! `limits`), never `store.rs`; `store.rs` builds on this module and constructs the backends.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::end::{EndReason, EndState};
use crate::error::Result;
use crate::limits::RunLimits;
use crate::offset::{Offset, ReadFrom};
use crate::types::*;

/// Fully resolved creation request handed to a backend.
#[derive(Clone, Debug)]
pub(crate) struct CreateSpec {
    pub incarnation: String,
    pub content_type: String,
    pub expiry: Expiry,
    pub limits: RunLimits,
    pub closed: bool,
    /// (explicit offset for copied fork records, bytes, JSON messages)
    pub records: Vec<(Option<Offset>, Bytes, u32)>,
    /// Fork base: the fork's tail before its own records.
    pub base: Offset,
    pub fork: Option<ForkFrom>,
    /// Run open: claim a new epoch for this producer id.
    pub claim: Option<String>,
    /// [`crate::CreateOptions::silence_from_open`] (a new stream only).
    pub silence_from_open: bool,
}

/// Append/close request handed to a backend.
#[derive(Clone, Debug)]
pub(crate) struct WriteSpec {
    pub incarnation: Option<String>,
    /// Normalized content type of the body; `None` = binary body.
    pub ctn: Option<String>,
    pub stream_seq: Option<String>,
    pub producer: Option<ProducerStamp>,
    pub close: Option<EndReason>,
    pub records: Vec<(Bytes, u32)>,
    /// [`crate::StreamStore::end_fenced`]: refused (`Fenced`) unless this producer's current
    /// epoch is this one (`None`: no epoch was claimed); checked after the end (an ended stream
    /// answers `Closed`). Never with `producer`. Its records are part of the end: `max_len`
    /// does not count them.
    pub fence: Option<(String, Option<u64>)>,
}

impl WriteSpec {
    /// A close without a producer stamp that is close-only or fenced
    /// ([`crate::StreamStore::close`], [`crate::StreamStore::end_fenced`]): on a stream that had
    /// ended already it is answered with that end ([`found_end`]), not `Closed`. The backend
    /// answers so, as only it knows the incarnation of the stream it found ended (a later read
    /// may find a stream created again since).
    pub(crate) fn answers_found_end(&self) -> bool {
        self.producer.is_none() && self.close.is_some() && (self.records.is_empty() || self.fence.is_some())
    }
}

/// The answer to a close that found the stream of `incarnation` ended with `end`
/// ([`WriteSpec::answers_found_end`]): nothing written, `ended_now == false`.
pub(crate) fn found_end(end: EndState, incarnation: String) -> Appended {
    Appended {
        tail: end.final_offset,
        duplicate: false,
        producer: None,
        producer_offset: None,
        end: Some(end),
        ended_now: false,
        incarnation,
    }
}

/// Source state for a fork.
#[derive(Clone, Debug)]
pub(crate) struct Snapshot {
    pub info: StreamInfo,
    pub inherited: Vec<Record>,
    pub next: Option<Record>,
    pub offset: Offset,
}

pub(crate) enum Deleted {
    Hard { fork_source: Option<StreamPath> },
    Soft,
}

#[async_trait]
pub(crate) trait StreamBackend: Send + Sync + 'static {
    /// Returns the outcome and the claimed epoch (when `spec.claim`).
    async fn create(&self, path: &StreamPath, spec: CreateSpec) -> Result<(Created, Option<u64>)>;
    async fn write(&self, path: &StreamPath, spec: WriteSpec) -> Result<Appended>;
    /// `touch` restarts a sliding TTL; `max_records == 0` reads metadata only.
    async fn read(
        &self,
        path: &StreamPath,
        from: ReadFrom,
        max_records: usize,
        max_bytes: usize,
        touch: bool,
        incarnation: Option<&str>,
    ) -> Result<(ReadChunk, StreamInfo)>;
    async fn snapshot(&self, path: &StreamPath, offset: Option<Offset>) -> Result<Snapshot>;
    async fn delete(&self, path: &StreamPath) -> Result<Deleted>;
    /// `+1`/`-1` on the fork reference count; `Some(source)` when a `-1` collected a soft-deleted
    /// fork that itself has a source (cascade).
    async fn refs(&self, path: &StreamPath, add: bool) -> Result<Option<StreamPath>>;
    /// The current epoch of producer `id` (`None`: none claimed).
    async fn producer_epoch(&self, path: &StreamPath, id: &str) -> Result<Option<u64>>;
    async fn keepalive(
        &self,
        path: &StreamPath,
        incarnation: Option<&str>,
        producer: Option<(&str, u64)>,
    ) -> Result<StreamInfo>;
    async fn trim(&self, path: &StreamPath, through: Offset) -> Result<Offset>;
    /// Up to `limit` paths of existing streams (not soft-deleted, not expired) starting with
    /// `prefix`, in no particular order, each once.
    async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<StreamPath>>;
    /// The first `limit` paths in path order (byte order) that start with `prefix`, come after
    /// `after` (when given) and that `keep` accepts, and whether more such paths exist. The
    /// memory backend leaves out streams that do not exist (soft-deleted, expired); the Redis
    /// backend may include soft-deleted ones (their metadata key stays): the caller reads each.
    async fn list_sorted(
        &self,
        prefix: &str,
        after: Option<&StreamPath>,
        limit: usize,
        keep: &PathFilter,
    ) -> Result<(Vec<StreamPath>, bool)>;
    /// Waits up to `timeout` for records after `after` (or the end, or deletion).
    async fn wait(
        &self,
        path: &StreamPath,
        after: Offset,
        incarnation: &str,
        max_bytes: usize,
        timeout: Duration,
    ) -> Result<ReadChunk>;
}

/// Which paths a listing keeps (e.g. those a caller may read).
pub type PathFilter = dyn Fn(&StreamPath) -> bool + Send + Sync;

/// The smallest paths offered, at most `cap` of them (a bounded selection in path order).
pub(crate) struct Smallest {
    set: std::collections::BTreeSet<StreamPath>,
    cap: usize,
}

impl Smallest {
    pub(crate) fn new(cap: usize) -> Self {
        Smallest { set: std::collections::BTreeSet::new(), cap }
    }

    /// Keeps `p` if it is among the `cap` smallest offered so far.
    pub(crate) fn offer(&mut self, p: StreamPath) {
        if self.set.len() < self.cap {
            self.set.insert(p);
        } else if self.set.last().is_some_and(|last| p < *last) && self.set.insert(p) {
            self.set.pop_last();
        }
    }

    /// The first `limit` in path order, and whether more than `limit` were kept.
    pub(crate) fn page(self, limit: usize) -> (Vec<StreamPath>, bool) {
        let more = self.set.len() > limit;
        (self.set.into_iter().take(limit).collect(), more)
    }
}
