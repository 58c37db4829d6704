//! `/v1/stream/{path}`: PUT create (and fork), POST append / close / keepalive, DELETE, HEAD,
//! GET catch-up and long-poll (SSE is in [`super::sse`]); and `GET /v1/streams`, the listing of
//! streams by prefix ([`list`]), outside the protocol's namespace.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use baton_streams::{AppendRequest, CreateOptions, Expiry, ForkFrom, ReadChunk, ReadFrom, StreamInfo, StreamPath};

use super::errors::{echo, ApiError};
use super::headers::{self as h, set, set_static, Live, ReadQuery};
use super::plumbing::{limit_param, principal, read_body, BodyLimit, Query, QuerySpec};
use super::state::AppState;

/// Every method of `/v1/stream/{*path}` (those it does not serve get a 405).
pub async fn handle(State(st): State<AppState>, req: Request) -> Response {
    match dispatch(st, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// `?prefix=&limit=&cursor=` of `GET /v1/streams`.
pub struct StreamListQuery;
impl QuerySpec for StreamListQuery {
    const ALLOWED: &'static [&'static str] = &["prefix", "limit", "cursor"];
}

/// `GET /v1/streams?prefix=&limit=100&cursor=`: `200 {"streams": [stream…], "next_cursor": path or
/// null}`, the streams whose path starts with `prefix` (a plain string prefix, a leading `/`
/// ignored; all when absent)
/// that the caller may read, in path order, at most `limit` (1 to 1000, default 100) after
/// `cursor` (a page's `next_cursor`). A stream: `{"path", "content_type", "next_offset" (its
/// tail, as `Stream-Next-Offset`), "length" (messages or appends, as `max_len` counts), "closed",
/// "end_reason" (`finished`, `cancelled`, `producer_lost`, or null), "ended_at", "created_at",
/// "last_write_at", "expires_at" (RFC 3339 in UTC with milliseconds, `2025-01-31T12:00:00.000Z`, as
/// every time in the JSON API; null when none), "forked_from" (path or null)}`.
/// Errors: `400 invalid_query` (unknown parameter), `invalid_limit`, `invalid_cursor` (not a
/// stream path); `503` backend.
pub async fn list(State(st): State<AppState>, q: Query<StreamListQuery>, req: Request) -> Result<Response, ApiError> {
    let who = principal(req.extensions())?;
    let limit = limit_param(&q, 100, 1000)?;
    // Paths have no leading `/` (`StreamPath::new` drops one): neither does a prefix of them.
    let prefix = q.get("prefix").map(|p| p.trim_start_matches('/')).unwrap_or("");
    let after = match q.get("cursor").filter(|c| !c.is_empty()) {
        None => None,
        Some(c) => Some(StreamPath::new(c).map_err(|_| {
            ApiError::invalid(
                "invalid_cursor",
                format!("cursor {} is not a stream path; give a page's next_cursor as it came", echo(c)),
            )
        })?),
    };
    let may_read = move |p: &StreamPath| who.can_stream(crate::settings::Op::Read, p.as_str());
    let page = st.store.list_page(prefix, after.as_ref(), limit, &may_read).await?;
    // The fixed-width millisecond form of every time in the JSON API (as a command's).
    let at = |ms: u64| baton_commands::Timestamp::from_millis(ms).to_string();
    let time = |ms: Option<u64>| ms.map(at);
    let streams: Vec<serde_json::Value> = page
        .streams
        .iter()
        .map(|i| {
            serde_json::json!({
                "path": i.path.as_str(),
                "content_type": i.content_type,
                "next_offset": i.tail.token(&i.incarnation),
                "length": i.len,
                "closed": i.end.is_some(),
                "end_reason": i.end.map(|e| e.reason.as_str()),
                "ended_at": time(i.ended_at),
                "created_at": at(i.created_at),
                "last_write_at": at(i.last_write_at),
                "expires_at": time(i.deadline),
                "forked_from": i.fork.as_ref().map(|f| f.source.as_str()),
            })
        })
        .collect();
    let next = page.next.as_ref().map(StreamPath::as_str);
    Ok(super::json::json_response(serde_json::json!({ "streams": streams, "next_cursor": next })))
}

/// Every method of `/v1/stream` and `/v1/stream/`: a 400.
pub async fn no_path() -> Response {
    ApiError::bad_request("a stream URL needs a path after /v1/stream/, e.g. /v1/stream/acme/run-1").into_response()
}

async fn dispatch(st: AppState, req: Request) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let raw = parts.uri.path().strip_prefix(h::STREAM_PREFIX).unwrap_or("");
    let path = h::stream_path(raw)?;
    match parts.method {
        Method::PUT => create(&st, &parts, path, body).await,
        Method::POST => append(&st, &parts, path, body).await,
        Method::DELETE => {
            st.store.delete(&path).await?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        Method::HEAD => head(&st, path).await,
        Method::GET => {
            let q = h::read_query(parts.uri.query())?;
            match q.live {
                Live::No => catch_up(&st, &parts, path, q).await,
                Live::LongPoll => long_poll(&st, path, q).await,
                Live::Sse => {
                    let last = super::sse::last_event_id(&parts.headers)?;
                    super::sse::serve(st.clone(), path, q, last).await
                }
            }
        }
        _ => Err(ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("{} is not a stream operation; use PUT, POST, GET, HEAD or DELETE", parts.method),
        )
        .with_header(header::ALLOW, "GET, HEAD, PUT, POST, DELETE, OPTIONS")),
    }
}

/// The body rules of create and append: `--max-body`.
fn body_limit(st: &AppState) -> BodyLimit {
    BodyLimit {
        limit: st.cfg.max_body,
        too_large: |n, limit| {
            format!(
                "request body is {n} bytes; this server accepts at most {limit} bytes per request (split the append)"
            )
        },
        unreadable: "bad_request",
    }
}

/// `Stream-Closed` and the Baton end reason, when the chunk or stream is at its end.
fn set_end(headers: &mut HeaderMap, end: Option<baton_streams::EndState>) {
    if let Some(end) = end {
        set_static(headers, h::stream_closed(), "true");
        set(headers, h::baton_end_reason(), end.reason);
    }
}

fn content_type(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    Ok(h::text(headers, &header::CONTENT_TYPE)?.filter(|s| !s.is_empty()).map(str::to_string))
}

async fn create(st: &AppState, parts: &Parts, path: StreamPath, body: Body) -> Result<Response, ApiError> {
    let hm = &parts.headers;
    let expiry = h::expiry(hm)?;
    let closed = h::closed_flag(hm);
    let fork_offset = h::text(hm, &h::stream_fork_offset())?;
    let sub_offset = h::text(hm, &h::stream_fork_sub_offset())?;
    let fork = match h::text(hm, &h::stream_forked_from())? {
        Some(src) => Some(ForkFrom {
            source: h::fork_source(src)?,
            offset: fork_offset.map(h::fork_offset).transpose()?,
            sub_offset: match sub_offset {
                None => 0,
                Some(s) => h::strict_uint(s).ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "Stream-Fork-Sub-Offset must be a non-negative integer, not {}",
                        echo(s)
                    ))
                })?,
            },
        }),
        None if fork_offset.is_some() || sub_offset.is_some() => {
            return Err(ApiError::bad_request("Stream-Fork-Offset and Stream-Fork-Sub-Offset need Stream-Forked-From"))
        }
        None => None,
    };
    let limits = h::limits(hm, st.cfg.default_limits)?;
    let ct = content_type(hm)?;
    let data = read_body(body, hm, &body_limit(st)).await?;
    let opts = CreateOptions {
        content_type: ct,
        expiry,
        closed,
        initial: (!data.is_empty()).then_some(data),
        limits,
        fork,
        owner: None,
        silence_from_open: false,
    };
    let created = st.store.create(&path, opts).await?;
    let info = &created.info;
    let mut res = if created.created { StatusCode::CREATED } else { StatusCode::OK }.into_response();
    let out = res.headers_mut();
    set(out, header::CONTENT_TYPE, &info.content_type);
    set(out, h::stream_next_offset(), info.tail.token(&info.incarnation));
    set_end(out, info.end);
    if created.created {
        let host = hm
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .unwrap_or_else(|| st.cfg.listen.to_string());
        set(out, header::LOCATION, format!("http://{host}{}", parts.uri.path()));
        metrics::counter!("baton_streams_created_total").increment(1);
    }
    Ok(res)
}

async fn append(st: &AppState, parts: &Parts, path: StreamPath, body: Body) -> Result<Response, ApiError> {
    let hm = &parts.headers;
    let closed = h::closed_flag(hm);
    let producer = h::producer(hm)?;
    let stream_seq = h::text(hm, &h::stream_seq())?.map(str::to_string);
    let keepalive = hm
        .get(h::baton_keepalive())
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    let data = read_body(body, hm, &body_limit(st)).await?;
    if keepalive && data.is_empty() && !closed {
        let info = st.store.keepalive(&path).await?;
        let mut res = StatusCode::NO_CONTENT.into_response();
        set(res.headers_mut(), h::stream_next_offset(), info.tail.token(&info.incarnation));
        return Ok(res);
    }
    if data.is_empty() && !closed {
        return Err(ApiError::bad_request(
            "an append needs a non-empty body; to close the stream send an empty body with Stream-Closed: true",
        ));
    }
    let ct = if data.is_empty() {
        None
    } else {
        Some(content_type(hm)?.ok_or_else(|| {
            ApiError::bad_request("an append needs a Content-Type header matching the stream's content type")
        })?)
    };
    let close = if closed { Some(h::end_reason(hm)?) } else { None };
    let has_data = !data.is_empty();
    let req =
        AppendRequest { data, content_type: ct, stream_seq, producer: producer.clone(), close, incarnation: None };
    let a = st.store.append(&path, req).await?;
    let status = if producer.is_some() && has_data && !a.duplicate { StatusCode::OK } else { StatusCode::NO_CONTENT };
    let mut res = status.into_response();
    let out = res.headers_mut();
    set(out, h::stream_next_offset(), a.tail.token(&a.incarnation));
    if let Some((epoch, seq)) = a.producer {
        set(out, h::producer_epoch(), epoch);
        set(out, h::producer_seq(), seq);
    }
    set_end(out, a.end);
    if closed && a.end.is_some() && !a.ended_now {
        // The stream had ended before this close: `Baton-End-Reason` is the end that was kept.
        set_static(out, h::baton_already_ended(), "true");
    }
    if has_data && !a.duplicate {
        metrics::counter!("baton_stream_appends_total").increment(1);
    }
    Ok(res)
}

fn info_headers(out: &mut HeaderMap, info: &StreamInfo) {
    set(out, header::CONTENT_TYPE, &info.content_type);
    set(out, h::stream_next_offset(), info.tail.token(&info.incarnation));
    match info.expiry {
        Expiry::TtlSecs(s) => set(out, h::stream_ttl(), s),
        Expiry::At(ms) => set(out, h::stream_expires_at(), h::rfc3339(ms)),
        Expiry::None => {}
    }
    set_end(out, info.end);
    let d =
        |d: Option<std::time::Duration>| d.map_or("none".to_string(), |d| humantime::format_duration(d).to_string());
    set(out, h::baton_silence_timeout(), d(info.limits.silence_timeout));
    set(out, h::baton_max_run(), d(info.limits.max_run));
    set(out, h::baton_done_ttl(), d(info.limits.done_ttl));
    set(out, h::baton_max_len(), info.limits.max_len.unwrap_or(0));
}

async fn head(st: &AppState, path: StreamPath) -> Result<Response, ApiError> {
    let info = st.store.head(&path).await?;
    let mut res = StatusCode::OK.into_response();
    let out = res.headers_mut();
    info_headers(out, &info);
    set_static(out, header::CACHE_CONTROL, "no-store");
    Ok(res)
}

/// ETag of a read: `"{incarnation}:{start}:{end}"`, with `:c` once the stream is closed.
fn etag(chunk: &ReadChunk, start: &str) -> String {
    let closed = if chunk.end.is_some() { ":c" } else { "" };
    format!("\"{}:{}:{}{}\"", chunk.incarnation, start, chunk.next_offset, closed)
}

fn cache_control(st: &AppState, chunk: &ReadChunk, from: ReadFrom) -> &'static str {
    h::read_cache_control(st.cfg.cache, matches!(from, ReadFrom::Now) || chunk.records.is_empty())
}

/// Headers shared by catch-up and long-poll responses.
fn read_headers(st: &AppState, out: &mut HeaderMap, chunk: &ReadChunk, q: &ReadQuery) {
    set(out, header::CONTENT_TYPE, &chunk.content_type);
    set(out, h::stream_next_offset(), chunk.next_offset.token(&chunk.incarnation));
    if chunk.up_to_date || chunk.end.is_some() {
        set_static(out, h::stream_up_to_date(), "true");
    }
    set_end(out, chunk.end);
    set_static(out, header::CACHE_CONTROL, cache_control(st, chunk, q.from));
    if !matches!(q.from, ReadFrom::Now) {
        set(out, header::ETAG, etag(chunk, &q.offset_text));
    }
}

async fn catch_up(st: &AppState, parts: &Parts, path: StreamPath, q: ReadQuery) -> Result<Response, ApiError> {
    let chunk = st.store.read(&path, q.from).await?;
    if !matches!(q.from, ReadFrom::Now) {
        let tag = etag(&chunk, &q.offset_text);
        let matches = parts
            .headers
            .get_all(header::IF_NONE_MATCH)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim() == tag || t.trim() == "*");
        if matches {
            let mut res = StatusCode::NOT_MODIFIED.into_response();
            let out = res.headers_mut();
            set(out, header::ETAG, tag);
            set_static(out, header::CACHE_CONTROL, cache_control(st, &chunk, q.from));
            set(out, h::stream_next_offset(), chunk.next_offset.token(&chunk.incarnation));
            return Ok(res);
        }
    }
    let mut res = Response::new(Body::from(chunk.body()));
    read_headers(st, res.headers_mut(), &chunk, &q);
    Ok(res)
}

async fn long_poll(st: &AppState, path: StreamPath, q: ReadQuery) -> Result<Response, ApiError> {
    let _permit = st.live_permit()?;
    let timeout = st.cfg.long_poll_timeout;
    let chunk = tokio::select! {
        r = st.store.read_live(&path, q.from, timeout) => r?,
        _ = st.shutdown.cancelled() => st.store.read(&path, q.from).await?,
    };
    let cursor = h::next_cursor(q.cursor);
    let mut res = if chunk.records.is_empty() {
        StatusCode::NO_CONTENT.into_response()
    } else {
        Response::new(Body::from(chunk.body()))
    };
    let out = res.headers_mut();
    read_headers(st, out, &chunk, &q);
    if chunk.records.is_empty() {
        out.remove(header::ETAG);
        out.remove(header::CONTENT_TYPE);
    }
    if chunk.end.is_none() {
        set(out, h::stream_cursor(), cursor);
    }
    Ok(res)
}
