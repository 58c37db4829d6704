//! Run limits: how long a run may stay silent, live and replayable, and how many appends it may
//! hold ([`RunLimits`]), and what a `max_len` counts ([`LimitScope`]). Below `error.rs`, which
//! names a [`LimitScope`] in `StreamError::TooLong`.

use std::fmt;
use std::time::Duration;

/// Run limits (Baton run semantics; over HTTP the `Baton-*` headers of docs/http-api.md,
/// "Extensions: run semantics"). `None` disables a limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunLimits {
    /// No append and no keepalive for this long ⇒ ended as `producer_lost`. Default 60 s.
    pub silence_timeout: Option<Duration>,
    /// Hard lifetime from creation; the stream is deleted (404) past it. Default 24 h.
    pub max_run: Option<Duration>,
    /// Replay window after the end; ending only ever shortens the lifetime. Default 1 h.
    pub done_ttl: Option<Duration>,
    /// Messages per stream; an append that would pass it is refused whole
    /// ([`StreamError::TooLong`](crate::StreamError::TooLong)). A message is one JSON value of an
    /// `application/json` stream (an append of an array of `n` counts `n`), or one append of any
    /// other content type. Keepalives and the end never count, nor the entry an end fenced to a
    /// producer appends with it ([`StreamStore::end_fenced`](crate::StreamStore::end_fenced)), so
    /// a full stream can still end that way. Default 1,000,000.
    pub max_len: Option<u64>,
    /// Messages per writer (producer id, across epochs), counted as `max_len`. Default none.
    pub max_len_per_writer: Option<u64>,
}

impl Default for RunLimits {
    fn default() -> Self {
        Self {
            silence_timeout: Some(Duration::from_secs(60)),
            max_run: Some(Duration::from_secs(24 * 3600)),
            done_ttl: Some(Duration::from_secs(3600)),
            max_len: Some(1_000_000),
            max_len_per_writer: None,
        }
    }
}

impl RunLimits {
    /// No limit at all (plain protocol streams: never auto-ended, never auto-expired).
    pub fn unlimited() -> Self {
        Self { silence_timeout: None, max_run: None, done_ttl: None, max_len: None, max_len_per_writer: None }
    }
}

/// Whether `max_len` counts messages per stream or per writer (producer id).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitScope {
    Stream,
    Writer,
}

impl fmt::Display for LimitScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LimitScope::Stream => "stream",
            LimitScope::Writer => "writer",
        })
    }
}
