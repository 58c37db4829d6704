//! The data model shared by every backend.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};

use crate::end::{EndReason, EndState};
use crate::error::StreamError;
use crate::limits::RunLimits;
use crate::offset::Offset;

/// Milliseconds since the Unix epoch.
pub type EpochMs = u64;

pub(crate) fn now_ms() -> EpochMs {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A stream's address: `scope/rest/...` (no leading `/`). The first segment is the scope (the
/// tenant or user the stream belongs to). Non-empty segments, at most 1,024 bytes, no control
/// characters, no `.`/`..` segments (PROTOCOL.md §12.2 path traversal).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamPath(String);

impl StreamPath {
    /// Validates a path. A leading `/` is removed. Errors: [`StreamError::InvalidRequest`].
    pub fn new(path: impl AsRef<str>) -> Result<Self, StreamError> {
        let p = path.as_ref().trim_start_matches('/');
        if p.is_empty() || p.len() > 1024 {
            return Err(StreamError::invalid("a stream path needs 1 to 1024 bytes"));
        }
        if p.chars().any(|c| c.is_control()) {
            return Err(StreamError::invalid("a stream path cannot contain control characters"));
        }
        if p.split('/').any(|s| s.is_empty() || s == "." || s == "..") {
            return Err(StreamError::invalid("a stream path has empty, `.` or `..` segments"));
        }
        Ok(Self(p.to_string()))
    }

    /// The path text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first segment: the stream's scope (tenant or user).
    pub fn scope(&self) -> &str {
        self.0.split('/').next().unwrap_or("")
    }
}

impl fmt::Display for StreamPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Protocol expiry of a stream (PROTOCOL.md §5.1 `Stream-TTL` / `Stream-Expires-At`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Expiry {
    /// No protocol expiry (run limits still apply).
    #[default]
    None,
    /// Sliding window in whole seconds: every read or write (not a metadata read) restarts it.
    TtlSecs(u64),
    /// Absolute expiry, milliseconds since the Unix epoch.
    At(EpochMs),
}

/// Fork creation parameters (PROTOCOL.md §4.2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForkFrom {
    /// The source stream.
    pub source: StreamPath,
    /// Divergence point; `None` = the source's current tail.
    pub offset: Option<Offset>,
    /// Bytes (binary) or flattened messages (JSON) of the next append to inherit past `offset`.
    pub sub_offset: u64,
}

/// How to create a stream (PROTOCOL.md §5.1).
#[derive(Clone, Debug, Default)]
pub struct CreateOptions {
    /// Content type; `None` = `application/octet-stream`, or the source's for a fork.
    pub content_type: Option<String>,
    /// Protocol TTL or absolute expiry; for a fork, `Expiry::None` inherits the source's (§4.2).
    pub expiry: Expiry,
    /// Create already closed (`finished`), with `initial` as the whole content.
    pub closed: bool,
    /// Initial body (JSON: one level of array flattening; `[]` allowed).
    pub initial: Option<Bytes>,
    /// Run limits; `None` = the store's defaults (and, for an existing stream, not compared).
    pub limits: Option<RunLimits>,
    /// Create as a fork of another stream.
    pub fork: Option<ForkFrom>,
    /// Marks a new (not forked) stream as made for `owner`, a token of ASCII letters and digits:
    /// its incarnation is `<id>-<owner>`, so [`StreamInfo::created_for`] tells, for as long as
    /// the stream lives, that it was created for this owner and not by anyone else at that path.
    /// Ignored for an existing stream (a create is still idempotent on the configuration).
    pub owner: Option<String>,
    /// The silence timeout of a new (not forked) stream counts from its first producer's open
    /// ([`StreamStore::open`](crate::StreamStore::open)), not from its creation: a stream made
    /// ahead of its producer (the output of a command still waiting in its queue) is not ended
    /// `producer_lost` while nobody was meant to write yet. Until then its
    /// [`StreamInfo::limits`] show no silence timeout (and a [`StreamStore::create`]
    /// asking for one is a conflict; [`StreamStore::open`](crate::StreamStore::open) joins it).
    ///
    /// [`StreamStore::create`]: crate::StreamStore::create
    pub silence_from_open: bool,
}

/// Outcome of a create.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Created {
    /// `true` when this call created the stream (201), `false` when an identical one existed (200).
    pub created: bool,
    pub info: StreamInfo,
}

/// Idempotent producer identity of one request (PROTOCOL.md §5.2.1).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProducerStamp {
    /// Non-empty producer id.
    pub id: String,
    /// Epoch, ≤ 2^53-1.
    pub epoch: u64,
    /// Sequence within the epoch, ≤ 2^53-1.
    pub seq: u64,
}

/// One append (and/or close) request (PROTOCOL.md §5.2, §5.3).
#[derive(Clone, Debug, Default)]
pub struct AppendRequest {
    /// Body. Empty only with `close`.
    pub data: Bytes,
    /// Content type of the body; checked against the stream's when `Some` and the body is not empty.
    pub content_type: Option<String>,
    /// `Stream-Seq` (bytewise strictly increasing, per stream).
    pub stream_seq: Option<String>,
    /// Idempotent producer headers.
    pub producer: Option<ProducerStamp>,
    /// Close the stream atomically after the append, with this reason.
    pub close: Option<EndReason>,
    /// Internal: refuse unless the stream is this incarnation (used by [`crate::Producer`]).
    pub incarnation: Option<String>,
}

/// Outcome of an accepted append/close.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Appended {
    /// The stream's tail after the request.
    pub tail: Offset,
    /// `true` when the producer stamp was a duplicate: nothing was written (§5.2.1 → 204).
    pub duplicate: bool,
    /// Producer epoch and highest accepted sequence (the `Producer-Epoch`/`Producer-Seq` echo).
    pub producer: Option<(u64, u64)>,
    /// Offset of the producer's last accepted write (for a duplicate: where its data is).
    pub producer_offset: Option<Offset>,
    /// Set when the stream is closed after this request (by it or earlier).
    pub end: Option<EndState>,
    /// `true` when this very request ended the stream.
    pub ended_now: bool,
    /// Incarnation of the stream written (for offset tokens, [`Offset::token`]); empty when not
    /// known.
    pub incarnation: String,
}

/// One stored append: an offset and its bytes. For `application/json` streams `data` holds
/// `messages` JSON values joined by `,` (so a read body is `[` + records joined by `,` + `]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub offset: Offset,
    pub data: Bytes,
    pub messages: u32,
}

/// Result of a read (PROTOCOL.md §5.6–§5.8).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadChunk {
    pub records: Vec<Record>,
    /// Where the next read starts (`Stream-Next-Offset`).
    pub next_offset: Offset,
    /// All data available when the read ran was returned (`Stream-Up-To-Date`).
    pub up_to_date: bool,
    /// The stream is closed and `next_offset` is its final offset (EOF, `Stream-Closed`).
    pub end: Option<EndState>,
    /// The stream's content type.
    pub content_type: String,
    /// Incarnation of the stream that was read (see [`StreamInfo::incarnation`]).
    pub incarnation: String,
}

impl ReadChunk {
    /// The HTTP body: records concatenated (binary) or wrapped in one JSON array (§9.1.5).
    pub fn body(&self) -> Bytes {
        join_body(&self.records, is_json(&self.content_type))
    }

    /// True at the end of an ended stream (EOF).
    pub fn is_eof(&self) -> bool {
        self.end.is_some()
    }
}

pub(crate) fn join_body(records: &[Record], json: bool) -> Bytes {
    let mut out = BytesMut::new();
    if json {
        out.extend_from_slice(b"[");
        let mut first = true;
        for r in records.iter().filter(|r| r.messages > 0) {
            if !first {
                out.extend_from_slice(b",");
            }
            first = false;
            out.extend_from_slice(&r.data);
        }
        out.extend_from_slice(b"]");
    } else {
        for r in records {
            out.extend_from_slice(&r.data);
        }
    }
    out.freeze()
}

/// Metadata of a stream (PROTOCOL.md §5.5 HEAD).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamInfo {
    pub path: StreamPath,
    pub content_type: String,
    /// Tail offset (`Stream-Next-Offset`).
    pub tail: Offset,
    /// As configured (TTL window in seconds, or absolute expiry).
    pub expiry: Expiry,
    /// Absolute time the stream will disappear if nothing changes, ms since the Unix epoch.
    pub deadline: Option<EpochMs>,
    /// The end, when closed.
    pub end: Option<EndState>,
    /// When the stream ended (ms since the Unix epoch, server clock), when closed.
    pub ended_at: Option<EpochMs>,
    /// Earliest offset still readable (after a trim); `Offset::ZERO` otherwise.
    pub earliest: Offset,
    /// Messages stored, as `max_len` counts them: JSON values of an `application/json` stream,
    /// appends of any other.
    pub len: u64,
    pub created_at: EpochMs,
    /// Last append or keepalive, ms since the Unix epoch.
    pub last_write_at: EpochMs,
    pub limits: RunLimits,
    /// Identity of this incarnation (a stream deleted and re-created at the same path gets a new one).
    pub incarnation: String,
    /// Fork origin, when the stream is a fork.
    pub fork: Option<ForkFrom>,
}

impl StreamInfo {
    /// True when this incarnation of the stream was created for `owner`
    /// ([`CreateOptions::owner`]).
    pub fn created_for(&self, owner: &str) -> bool {
        !owner.is_empty() && self.incarnation.rsplit_once('-').is_some_and(|(_, o)| o == owner)
    }
}

/// Normalized media type: lowercased, parameters removed (`application/json; charset=utf-8` →
/// `application/json`).
pub fn normalize_content_type(ct: &str) -> String {
    ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase()
}

/// True for `application/json` streams (JSON mode, §9.1).
pub fn is_json(ct: &str) -> bool {
    ct.split(';').next().unwrap_or("").trim().eq_ignore_ascii_case("application/json")
}

/// Default content type (§5.1).
pub const DEFAULT_CONTENT_TYPE: &str = "application/octet-stream";

/// Splits a body into stored records (§9.1.2): binary → one record; JSON → one record holding the
/// flattened messages, or none for `[]` on create. Errors: [`StreamError::InvalidJson`],
/// [`StreamError::EmptyArray`] (appends only).
pub(crate) fn prepare_body(ct: &str, body: &Bytes, create: bool) -> Result<Option<(Bytes, u32)>, StreamError> {
    if body.is_empty() {
        return Ok(None);
    }
    if !is_json(ct) {
        return Ok(Some((body.clone(), 0)));
    }
    let text = std::str::from_utf8(body).map_err(|e| StreamError::InvalidJson { detail: e.to_string() })?;
    let value: &serde_json::value::RawValue =
        serde_json::from_str(text).map_err(|e| StreamError::InvalidJson { detail: e.to_string() })?;
    let raw = value.get().trim();
    if raw.starts_with('[') {
        let items: Vec<&serde_json::value::RawValue> =
            serde_json::from_str(raw).map_err(|e| StreamError::InvalidJson { detail: e.to_string() })?;
        if items.is_empty() {
            return if create { Ok(None) } else { Err(StreamError::EmptyArray) };
        }
        let joined: Vec<&str> = items.iter().map(|r| r.get().trim()).collect();
        Ok(Some((Bytes::from(joined.join(",")), items.len() as u32)))
    } else {
        Ok(Some((Bytes::copy_from_slice(raw.as_bytes()), 1)))
    }
}

/// The first `n` flattened messages of a JSON record (fork sub-offsets, §4.2).
pub(crate) fn json_prefix(data: &[u8], n: u64) -> Option<Bytes> {
    let text = std::str::from_utf8(data).ok()?;
    let wrapped = format!("[{text}]");
    let items: Vec<&serde_json::value::RawValue> = serde_json::from_str(&wrapped).ok()?;
    if n as usize > items.len() {
        return None;
    }
    let joined: Vec<&str> = items[..n as usize].iter().map(|r| r.get().trim()).collect();
    Some(Bytes::from(joined.join(",")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_flattening() {
        let ct = "application/json; charset=utf-8";
        let p = |s: &str| prepare_body(ct, &Bytes::from(s.to_string()), false);
        assert_eq!(p(r#"{"a":1}"#).unwrap(), Some((Bytes::from(r#"{"a":1}"#), 1)));
        assert_eq!(p(r#"[{"a":1}, {"b":2}]"#).unwrap(), Some((Bytes::from(r#"{"a":1},{"b":2}"#), 2)));
        assert_eq!(p("[[1,2],[3,4]]").unwrap(), Some((Bytes::from("[1,2],[3,4]"), 2)));
        assert_eq!(p("[[[1,2,3]]]").unwrap(), Some((Bytes::from("[[1,2,3]]"), 1)));
        assert_eq!(p("[]"), Err(StreamError::EmptyArray));
        assert!(matches!(p("{nope"), Err(StreamError::InvalidJson { .. })));
        assert_eq!(prepare_body(ct, &Bytes::from("[]"), true).unwrap(), None);
        assert_eq!(json_prefix(br#"{"a":1},{"b":2},{"c":3}"#, 2), Some(Bytes::from(r#"{"a":1},{"b":2}"#)));
        assert_eq!(json_prefix(br#"{"a":1}"#, 2), None);
    }

    #[test]
    fn paths() {
        assert_eq!(StreamPath::new("/acme/runs/1").unwrap().scope(), "acme");
        assert!(StreamPath::new("a//b").is_err());
        assert!(StreamPath::new("a/../b").is_err());
        assert!(StreamPath::new("").is_err());
    }
}
