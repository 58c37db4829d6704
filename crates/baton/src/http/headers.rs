//! The Durable Streams protocol's request headers, stream paths and read queries, parsed (the
//! header names are in [`super::names`], re-exported here), and the response headers its reads
//! share (streams and command event feeds alike).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use baton_streams::{EndReason, Expiry, Offset, ProducerStamp, ReadFrom, RunLimits, StreamPath};

use super::errors::{echo, ApiError};
pub use super::names::*;
use crate::settings::CacheMode;

const MAX_SAFE_INT: u64 = (1 << 53) - 1;

/// A header's value as text; a value that is not visible ASCII is a 400.
pub fn text<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<Option<&'a str>, ApiError> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(|s| Some(s.trim()))
            .map_err(|_| ApiError::bad_request(format!("header {name} must be visible ASCII"))),
    }
}

/// `Stream-Closed: true` (case-insensitive); any other value counts as absent (§4.1).
pub fn closed_flag(headers: &HeaderMap) -> bool {
    headers.get(stream_closed()).and_then(|v| v.to_str().ok()).is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
}

/// A strict non-negative decimal integer: no sign, no leading zeros, no fraction or exponent.
pub fn strict_uint(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0')) {
        return None;
    }
    s.parse().ok()
}

/// `Stream-TTL` / `Stream-Expires-At` (§5.1).
pub fn expiry(headers: &HeaderMap) -> Result<Expiry, ApiError> {
    let ttl = text(headers, &stream_ttl())?;
    let at = text(headers, &stream_expires_at())?;
    match (ttl, at) {
        (Some(_), Some(_)) => Err(ApiError::bad_request("give either Stream-TTL or Stream-Expires-At, not both")),
        (Some(t), None) => strict_uint(t).map(Expiry::TtlSecs).ok_or_else(|| {
            ApiError::bad_request(format!(
                "Stream-TTL must be a whole number of seconds without sign or leading zeros (e.g. 3600), not {}",
                echo(t)
            ))
        }),
        (None, Some(a)) => {
            let t = time::OffsetDateTime::parse(a, &time::format_description::well_known::Rfc3339).map_err(|_| {
                ApiError::bad_request(format!(
                    "Stream-Expires-At must be an RFC 3339 timestamp like 2030-01-01T00:00:00Z, not {}",
                    echo(a)
                ))
            })?;
            let ms = t.unix_timestamp_nanos() / 1_000_000;
            if ms <= 0 {
                return Err(ApiError::bad_request("Stream-Expires-At is in the past"));
            }
            Ok(Expiry::At(ms as u64))
        }
        (None, None) => Ok(Expiry::None),
    }
}

/// RFC 3339 text of a time in ms since the epoch.
pub fn rfc3339(ms: u64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    t.format(&time::format_description::well_known::Rfc3339).unwrap_or_default()
}

/// Idempotent producer headers: all three or none (§5.2.1).
pub fn producer(headers: &HeaderMap) -> Result<Option<ProducerStamp>, ApiError> {
    let id = text(headers, &producer_id())?;
    let epoch = text(headers, &producer_epoch())?;
    let seq = text(headers, &producer_seq())?;
    match (id, epoch, seq) {
        (None, None, None) => Ok(None),
        (Some(id), Some(epoch), Some(seq)) => {
            if id.is_empty() {
                return Err(ApiError::bad_request("Producer-Id must not be empty"));
            }
            let num = |name: &str, v: &str| {
                strict_uint(v).filter(|n| *n <= MAX_SAFE_INT).ok_or_else(|| {
                    ApiError::bad_request(format!("{name} must be an integer from 0 to 2^53-1, not {}", echo(v)))
                })
            };
            Ok(Some(ProducerStamp {
                id: id.to_string(),
                epoch: num("Producer-Epoch", epoch)?,
                seq: num("Producer-Seq", seq)?,
            }))
        }
        _ => Err(ApiError::bad_request(
            "Producer-Id, Producer-Epoch and Producer-Seq must be sent together (or none of them)",
        )),
    }
}

/// `Baton-End-Reason` on a close: `finished` (default) or `cancelled`.
pub fn end_reason(headers: &HeaderMap) -> Result<EndReason, ApiError> {
    match text(headers, &baton_end_reason())?.map(|s| s.to_ascii_lowercase()) {
        None => Ok(EndReason::Finished),
        Some(r) if r == "finished" => Ok(EndReason::Finished),
        Some(r) if r == "cancelled" || r == "canceled" => Ok(EndReason::Cancelled),
        Some(r) => {
            Err(ApiError::bad_request(format!("Baton-End-Reason must be `finished` or `cancelled`, not {}", echo(&r))))
        }
    }
}

/// Per-stream run limits from `Baton-*` headers on create; `None` when none is given.
pub fn limits(headers: &HeaderMap, defaults: RunLimits) -> Result<Option<RunLimits>, ApiError> {
    let mut l = defaults;
    let mut any = false;
    let dur = |name: HeaderName| -> Result<Option<Option<Duration>>, ApiError> {
        let Some(v) = text(headers, &name)? else { return Ok(None) };
        crate::settings::parse_opt_duration(v)
            .map(|d| Some(d.0))
            .map_err(|e| ApiError::bad_request(format!("{name}: {e} (or `none`)")))
    };
    if let Some(d) = dur(baton_silence_timeout())? {
        if d.is_some_and(|d| d.is_zero()) {
            return Err(ApiError::bad_request(
                "Baton-Silence-Timeout: 0 would end the stream at once; give a positive duration like 60s, or `none` to disable it",
            ));
        }
        l.silence_timeout = d;
        any = true;
    }
    if let Some(d) = dur(baton_max_run())? {
        if d.is_some_and(|d| d.is_zero()) {
            return Err(ApiError::bad_request(
                "Baton-Max-Run: 0 would delete the stream as soon as it is created; give a positive duration like 1h, or `none` for no limit",
            ));
        }
        l.max_run = d;
        any = true;
    }
    if let Some(d) = dur(baton_done_ttl())? {
        l.done_ttl = d;
        any = true;
    }
    if let Some(v) = text(headers, &baton_max_len())? {
        let n = strict_uint(v).ok_or_else(|| {
            ApiError::bad_request(format!("Baton-Max-Len must be a whole number (0 = no limit), not {}", echo(v)))
        })?;
        l.max_len = (n > 0).then_some(n);
        any = true;
    }
    Ok(any.then_some(l))
}

/// A stream path from the raw (still percent-encoded) URL path after the stream prefix. Each
/// segment is percent-decoded on its own; a decoded segment may not contain `/`, `\` or NUL (an
/// encoded separator would alias another path), nor be `.`/`..`; the first segment (the scope)
/// may not be the reserved `__ds` control namespace.
pub fn stream_path(raw: &str) -> Result<StreamPath, ApiError> {
    let raw = raw.trim_start_matches('/');
    if raw.is_empty() {
        return Err(ApiError::bad_request("a stream URL needs a path after /v1/stream/, e.g. /v1/stream/acme/run-1"));
    }
    let mut segments = Vec::new();
    for seg in raw.split('/') {
        let decoded = percent_decode(seg).ok_or_else(|| {
            ApiError::bad_request(format!("stream path segment {} is not valid percent-encoded UTF-8", echo(seg)))
        })?;
        if decoded.contains(['/', '\\', '\0']) {
            return Err(ApiError::bad_request(format!(
                "stream path segment {} encodes a separator (/, \\ or NUL); use plain / between segments",
                echo(seg)
            )));
        }
        segments.push(decoded);
    }
    if segments.first().is_some_and(|s| s == "__ds") {
        return Err(ApiError::bad_request("the path prefix __ds is reserved for Durable Streams control APIs"));
    }
    StreamPath::new(segments.join("/")).map_err(|e| {
        let why = match e {
            baton_streams::StreamError::InvalidRequest { reason } => reason,
            e => e.to_string(),
        };
        ApiError::bad_request(format!("invalid stream path: {why}"))
    })
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3)?;
            let v = u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?;
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The live mode of a read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Live {
    No,
    LongPoll,
    Sse,
}

/// Parsed read query (§5.6–§5.8).
#[derive(Debug)]
pub struct ReadQuery {
    /// The offset as given (`-1` when absent), for the ETag.
    pub offset_text: String,
    pub from: ReadFrom,
    pub live: Live,
    pub cursor: Option<u64>,
}

/// Parses `offset`, `live` and `cursor`; unknown parameters are ignored. A repeated or empty
/// `offset` is a 400; live modes require an explicit `offset`.
pub fn read_query(query: Option<&str>) -> Result<ReadQuery, ApiError> {
    let mut offset: Option<String> = None;
    let mut live = Live::No;
    let mut cursor = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(&v.replace('+', " "))
            .ok_or_else(|| ApiError::bad_request(format!("query parameter {k} is not valid percent-encoded UTF-8")))?;
        match k {
            "offset" => {
                if offset.is_some() {
                    return Err(ApiError::bad_request("give the offset parameter once"));
                }
                offset = Some(v);
            }
            "live" => live = live_param(&v)?,
            "cursor" => cursor = cursor_param(&v),
            _ => {}
        }
    }
    live_needs_offset(live, offset.is_some())?;
    let offset_text = offset.unwrap_or_else(|| "-1".to_string());
    let from = ReadFrom::parse(&offset_text).map_err(ApiError::from)?;
    Ok(ReadQuery { offset_text, from, live, cursor })
}

/// The `live` query parameter: `long-poll`, `sse`, or catch-up (empty or `false`).
pub fn live_param(v: &str) -> Result<Live, ApiError> {
    match v {
        "long-poll" => Ok(Live::LongPoll),
        "sse" => Ok(Live::Sse),
        "" | "false" => Ok(Live::No),
        other => Err(ApiError::bad_request(format!("live must be `long-poll` or `sse`, not {}", echo(other)))),
    }
}

/// The `cursor` query parameter (§10.1): the client's echo of `Stream-Cursor`; anything that is
/// not a number counts as absent.
pub fn cursor_param(v: &str) -> Option<u64> {
    v.parse::<u64>().ok()
}

/// Live reads need an explicit `offset` (a 400 otherwise).
pub fn live_needs_offset(live: Live, has_offset: bool) -> Result<(), ApiError> {
    if live != Live::No && !has_offset {
        return Err(ApiError::bad_request(
            "live reads need an offset: use offset=-1 (start), offset=now (tail) or a returned offset",
        ));
    }
    Ok(())
}

/// Sets a response header from any displayable value: the text is formatted once and becomes
/// the header value without another copy. Values that are not valid header text are skipped.
pub fn set(headers: &mut HeaderMap, name: HeaderName, value: impl std::fmt::Display) {
    use std::fmt::Write;
    let mut text = String::with_capacity(40);
    let _ = write!(text, "{value}");
    if let Ok(v) = HeaderValue::from_maybe_shared(bytes::Bytes::from(text)) {
        headers.insert(name, v);
    }
}

/// Sets a response header to a constant.
pub fn set_static(headers: &mut HeaderMap, name: HeaderName, value: &'static str) {
    headers.insert(name, HeaderValue::from_static(value));
}

/// `Cache-Control` of a read: `no-store` for a read at the tail (`offset=now`) or one that
/// returned nothing, else cacheable for a minute (`--cache private|public`).
pub fn read_cache_control(cache: CacheMode, tail_or_empty: bool) -> &'static str {
    if tail_or_empty {
        return "no-store";
    }
    match cache {
        CacheMode::Private => "private, max-age=60, stale-while-revalidate=300",
        CacheMode::Public => "public, max-age=60, stale-while-revalidate=300",
    }
}

/// Start of the cursor epoch (2024-10-09T00:00:00Z) and its interval (§10.1).
const CURSOR_EPOCH_SECS: u64 = 1_728_432_000;
const CURSOR_INTERVAL_SECS: u64 = 20;

/// A cursor for a live response: the current 20-second interval number, or, when the client's
/// cursor is not behind it, the client's cursor plus 1–180 intervals of jitter (strictly greater).
pub fn next_cursor(client: Option<u64>) -> u64 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let current = now.saturating_sub(CURSOR_EPOCH_SECS) / CURSOR_INTERVAL_SECS;
    match client {
        Some(c) if c >= current => {
            let jitter_secs: u64 = rand::random_range(1..=3600);
            c + jitter_secs.div_ceil(CURSOR_INTERVAL_SECS).max(1)
        }
        _ => current,
    }
}

/// The `Stream-Forked-From` value: a stream URL path (`/v1/stream/src`) or a bare stream path.
pub fn fork_source(value: &str) -> Result<StreamPath, ApiError> {
    let path = value.split(['?', '#']).next().unwrap_or("");
    let rel = path.strip_prefix(STREAM_PREFIX).or_else(|| path.strip_prefix(&STREAM_PREFIX[1..])).unwrap_or(path);
    stream_path(rel)
}

/// `Stream-Fork-Offset`: an offset token returned by this server (its incarnation tag, if any,
/// is not checked against the source).
pub fn fork_offset(value: &str) -> Result<Offset, ApiError> {
    match ReadFrom::parse(value) {
        Ok(ReadFrom::At(o) | ReadFrom::Tagged(o, _)) => Ok(o),
        Ok(_) => {
            Err(ApiError::from(baton_streams::StreamError::MalformedOffset { input: value.chars().take(80).collect() }))
        }
        Err(e) => Err(ApiError::from(e)),
    }
}

/// The W3C trace context of a request: its `traceparent` (and `tracestate`) headers, when the
/// `traceparent` is well formed ([`baton_commands::trace::TraceContext::parse`]); `None`
/// otherwise (a malformed one is ignored, as the W3C recommends).
pub fn trace_context(headers: &axum::http::HeaderMap) -> Option<baton_commands::trace::TraceContext> {
    let tp = headers.get("traceparent")?.to_str().ok()?;
    let ts = headers.get("tracestate").and_then(|v| v.to_str().ok());
    baton_commands::trace::TraceContext::parse(tp, ts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_integers() {
        assert_eq!(strict_uint("0"), Some(0));
        assert_eq!(strict_uint("3600"), Some(3600));
        for bad in ["", "00060", "+60", "60.5", "1e3", "-1", "abc"] {
            assert_eq!(strict_uint(bad), None, "{bad}");
        }
    }

    #[test]
    fn paths() {
        assert_eq!(stream_path("acme/run-1").unwrap().as_str(), "acme/run-1");
        assert_eq!(stream_path("acme/a%20b").unwrap().as_str(), "acme/a b");
        for bad in ["", "a/%2e%2e/b", "a/%2F/b", "a/..", "a//b", "__ds/subscriptions/x", "a/%5c", "a/%zz"] {
            assert!(stream_path(bad).is_err(), "{bad}");
        }
        assert_eq!(fork_source("/v1/stream/acme/src").unwrap().as_str(), "acme/src");
    }

    #[test]
    fn queries() {
        assert!(read_query(Some("offset=a&offset=b")).is_err());
        assert!(read_query(Some("offset=")).is_err());
        assert!(read_query(Some("live=sse")).is_err());
        let q = read_query(Some("offset=now&live=long-poll&foo=bar")).unwrap();
        assert_eq!((q.from, q.live), (ReadFrom::Now, Live::LongPoll));
        assert_eq!(read_query(None).unwrap().from, ReadFrom::Start);
    }

    #[test]
    fn cursors_advance() {
        let c = next_cursor(None);
        assert!(next_cursor(Some(c)) > c);
        assert!(next_cursor(Some(c + 1000)) > c + 1000);
        assert_eq!(next_cursor(Some(0)), c);
    }
}
