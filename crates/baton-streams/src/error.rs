//! Errors of the streams engine. Each variant names the HTTP status the protocol gives it
//! (PROTOCOL.md section in brackets) so the HTTP layer can map it with [`StreamError::status`].
//!
//! Below every module but `offset.rs`, `end.rs`, `limits.rs` (whose values errors carry) and
//! `settings.rs`. The
//! parsers of offset tokens are here (they fail with [`StreamError::MalformedOffset`]).

use std::str::FromStr;

use crate::end::EndState;
use crate::limits::LimitScope;
use crate::offset::{parse_read_from, parse_token, Offset, ReadFrom};

/// Result alias of this crate.
pub type Result<T, E = StreamError> = std::result::Result<T, E>;

/// Everything that can go wrong in a stream operation.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum StreamError {
    /// 404: no stream at this path, or it expired (TTL, `Expires-At`, `max_run`, `done_ttl`), or
    /// it was deleted (a [`crate::Producer`] whose stream was deleted and re-created at the same
    /// path also gets this: the new stream is a different stream). [§5.4, §5.6]
    #[error("stream {path:?} not found")]
    NotFound { path: String },
    /// 410: the stream was deleted while forks still reference it (soft-deleted). [§4.2, §5.4]
    #[error("stream {path:?} is deleted (soft-deleted, forks still reference it)")]
    Gone { path: String },
    /// 410: the requested offset is before the earliest retained data (after a trim). [§5.6]
    #[error("offset {offset} is before the earliest retained offset {earliest}")]
    OffsetGone { offset: Offset, earliest: Offset },
    /// 410: the offset token does not belong to the stream now at this path: it was read from an
    /// earlier stream there (deleted and re-created since), or from another stream (see
    /// [`crate::OffsetTag`]). Read the stream from `-1`. [Baton: offsets of deleted streams]
    #[error(
        "offset {offset} does not belong to the stream now at this path (it is from an earlier stream here, deleted and re-created since, or from another stream)"
    )]
    OffsetIncarnation { offset: String },
    /// 400: the offset is not `-1`, `now`, nor an offset token this server mints. [§8]
    #[error("malformed offset {input:?}")]
    MalformedOffset { input: String },
    /// 400: the offset is well formed but beyond the stream's tail. [§5.6, §4.2 fork offset]
    #[error("offset {offset} is ahead of the tail {tail}")]
    OffsetAhead { offset: Offset, tail: Offset },
    /// 400: a malformed request (bad TTL, both TTL and `Expires-At`, bad sub-offset, empty
    /// producer id, empty body without close, ...). [§5.1, §5.2, §5.2.1]
    #[error("invalid request: {reason}")]
    InvalidRequest { reason: String },
    /// 400: an `application/json` append whose body is not valid JSON. [§9.1.4]
    #[error("invalid JSON: {detail}")]
    InvalidJson { detail: String },
    /// 400: an `application/json` append whose body is `[]`. [§9.1.3]
    #[error("empty JSON array in an append")]
    EmptyArray,
    /// 409: the stream exists with another configuration, or the path belongs to a soft-deleted
    /// stream, or the content type of an append does not match. [§5.1, §5.2, §4.2]
    #[error("conflict: {reason}")]
    Conflict { reason: String },
    /// 409: a `Stream-Seq` that is not strictly greater (bytewise) than the last one. [§5.2]
    #[error("Stream-Seq {received:?} is not greater than the last one {last:?}")]
    StreamSeqRegression { last: String, received: String },
    /// 403: the producer's epoch is older than the stream's current epoch for that producer id
    /// (a zombie after a restart bumped the epoch). [§5.2.1]
    #[error("producer epoch {epoch} is fenced; current epoch is {current_epoch}")]
    Fenced { epoch: u64, current_epoch: u64 },
    /// 400: a new epoch whose first sequence is not 0. [§5.2.1]
    #[error("a new producer epoch must start at sequence 0 (got {seq})")]
    EpochMustStartAtZero { seq: u64 },
    /// 409: a producer sequence that skips ahead. [§5.2.1]
    #[error("producer sequence gap: expected {expected}, received {received}")]
    SequenceGap { expected: u64, received: u64 },
    /// 409 with `Stream-Closed: true`: the stream has ended; nothing more can be written.
    /// Carries the final offset and the end reason, and the incarnation of the ended stream the
    /// backend found (so `end.final_offset.token(&incarnation)` is that stream's offset token,
    /// even when the path was deleted and re-created since; empty: unknown). [§4.1, §5.2]
    #[error("stream is closed ({}) at offset {}", end.reason, end.final_offset)]
    Closed { end: EndState, incarnation: String },
    /// 413: `max_len` would be passed (messages per stream or per writer: JSON values of an
    /// `application/json` stream, appends of any other). [Baton run semantics]
    #[error("max_len reached: at most {limit} messages per {scope}; continue in a new stream")]
    TooLong { limit: u64, scope: LimitScope },
    /// 503: the backend failed (Redis unreachable, timeout, script error).
    #[error("backend error: {0}")]
    Backend(String),
}

impl StreamError {
    /// The HTTP status the protocol gives this error.
    pub fn status(&self) -> u16 {
        use StreamError::*;
        match self {
            NotFound { .. } => 404,
            Gone { .. } | OffsetGone { .. } | OffsetIncarnation { .. } => 410,
            MalformedOffset { .. }
            | OffsetAhead { .. }
            | InvalidRequest { .. }
            | InvalidJson { .. }
            | EmptyArray
            | EpochMustStartAtZero { .. } => 400,
            Conflict { .. } | StreamSeqRegression { .. } | SequenceGap { .. } | Closed { .. } => 409,
            Fenced { .. } => 403,
            TooLong { .. } => 413,
            Backend(_) => 503,
        }
    }

    pub(crate) fn invalid(reason: impl Into<String>) -> Self {
        StreamError::InvalidRequest { reason: reason.into() }
    }

    pub(crate) fn conflict(reason: impl Into<String>) -> Self {
        StreamError::Conflict { reason: reason.into() }
    }

    /// The refusal of an append whose content type is not the stream's (§5.2: `409`): names the
    /// stream's type, the one the append was sent with (`sent`: normalized, `None` when it had
    /// none) and what to send instead.
    pub(crate) fn content_type_differs(stream_ct: &str, sent: Option<&str>) -> Self {
        let sent = match sent {
            Some(ct) => format!("this append was sent as {ct}"),
            None => "this append has no content type".to_string(),
        };
        StreamError::conflict(format!(
            "content type differs from the stream's ({stream_ct}): {sent}; send it with Content-Type: {stream_ct}"
        ))
    }
}

impl From<baton_redis::redis::RedisError> for StreamError {
    fn from(e: baton_redis::redis::RedisError) -> Self {
        StreamError::Backend(e.to_string())
    }
}

impl From<baton_redis::ConnectError> for StreamError {
    fn from(e: baton_redis::ConnectError) -> Self {
        StreamError::Backend(e.to_string())
    }
}

impl Offset {
    /// Parses the protocol token. Errors: [`StreamError::MalformedOffset`] for anything that is
    /// not exactly `\d{16}_\d{16}`.
    pub fn parse(input: &str) -> Result<Offset> {
        parse_token(input).ok_or_else(|| malformed(input))
    }
}

impl FromStr for Offset {
    type Err = StreamError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Offset::parse(s)
    }
}

impl ReadFrom {
    /// Parses `-1`, `now` or an offset token. Errors: [`StreamError::MalformedOffset`] (an empty
    /// string included, §5.6 "should reject empty offset parameter").
    pub fn parse(input: &str) -> Result<ReadFrom> {
        parse_read_from(input).ok_or_else(|| malformed(input))
    }
}

fn malformed(input: &str) -> StreamError {
    StreamError::MalformedOffset { input: input.chars().take(80).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_offsets() {
        for bad in ["", "0,1", "1_1", "000000000000000a_0000000000000000"] {
            assert!(matches!(ReadFrom::parse(bad), Err(StreamError::MalformedOffset { .. })), "{bad}");
            assert!(matches!(bad.parse::<Offset>(), Err(StreamError::MalformedOffset { .. })), "{bad}");
        }
        let long = "x".repeat(100);
        assert_eq!(Offset::parse(&long), Err(StreamError::MalformedOffset { input: "x".repeat(80) }));
        assert_eq!(ReadFrom::parse("-1"), Ok(ReadFrom::Start));
        assert_eq!(ReadFrom::parse("now"), Ok(ReadFrom::Now));
        let b = Offset::new(1_732_934_123_456, 1);
        assert_eq!(Offset::parse(&b.to_string()), Ok(b));
        assert_eq!(ReadFrom::parse(&b.to_string()), Ok(ReadFrom::At(b)));
    }
}
