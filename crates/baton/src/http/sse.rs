//! `GET /v1/stream/{path}?offset=…&live=sse` (PROTOCOL.md §5.8).
//!
//! Each batch of data is one `event: data` (JSON streams: one JSON array; UTF-8 text as lines;
//! everything else base64, with `stream-sse-data-encoding: base64`) followed by one
//! `event: control` carrying `streamNextOffset`, `streamCursor` (while open), `upToDate` and
//! `streamClosed`. A connection carries text when the stream is `text/*` or `application/json`
//! with no charset or a UTF-8 (or US-ASCII) one and the first batch it sends is valid UTF-8;
//! otherwise base64. A text connection that reaches a batch that is not valid UTF-8 ends before
//! it, so the client reconnects from the last control event and gets that batch base64 (nothing
//! is lost or replaced). Every control event also has an `id:` equal to its offset (the final
//! control event's is `<offset>.end`), so a browser `EventSource` that reconnects sends
//! `Last-Event-ID` and resumes exactly after the last event it saw, and one that saw the end is
//! answered 204, which stops it. Each response starts with `retry: 500` so browsers reconnect
//! quickly when a connection is cycled. Idle connections get a `:` comment heartbeat; connections
//! are closed after about `--sse-cycle` (clients reconnect from the last offset), at EOF, and at
//! server shutdown. A stream deleted (or expired) under a connection gets one
//! `event: error` with `data:{"error": "<what happened>"}`, then the connection closes.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue};
use axum::response::Response;
use base64::Engine as _;
use baton_streams::{is_json, normalize_content_type, OffsetTag, ReadChunk, ReadFrom, StreamPath};
use bytes::{BufMut, Bytes, BytesMut};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use super::errors::{echo, ApiError};
use super::headers::{self as h, ReadQuery};
use super::state::AppState;

/// `text/*` and `application/json` whose charset (if given) is UTF-8 or US-ASCII may travel as
/// text; everything else as base64.
fn is_text(content_type: &str) -> bool {
    let ct = normalize_content_type(content_type);
    if !(ct.starts_with("text/") || is_json(&ct)) {
        return false;
    }
    let charset = content_type.split(';').skip(1).find_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim().eq_ignore_ascii_case("charset").then(|| v.trim().trim_matches('"').to_ascii_lowercase())
    });
    charset.is_none_or(|c| matches!(c.as_str(), "utf-8" | "utf8" | "us-ascii" | "ascii"))
}

/// Whether a chunk can go on a text connection: its data, as one body, is valid UTF-8 (a
/// character split over two appends of one batch is fine; one split over two batches makes the
/// first batch invalid, and the reconnect then reads both halves together).
fn is_utf8(chunk: &ReadChunk) -> bool {
    chunk.records.iter().all(|r| r.data.is_ascii()) || std::str::from_utf8(&chunk.body()).is_ok()
}

/// The `Last-Event-ID` of a reconnecting `EventSource` (trimmed; empty counts as absent): the
/// last event id it saw, which wins over the URL's offset.
pub fn last_event_id(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    Ok(h::text(headers, &HeaderName::from_static("last-event-id"))?.filter(|s| !s.is_empty()))
}

/// `GET /v1/stream/{path}?live=sse`; `last_event_id` as [`last_event_id`] reads it.
pub async fn serve(
    st: AppState,
    path: StreamPath,
    q: ReadQuery,
    last_event_id: Option<&str>,
) -> Result<Response, ApiError> {
    let permit = st.live_permit()?;
    let resumed = last_event_id;
    let (resumed, saw_end) = match resumed.map(|id| id.strip_suffix(END_ID_SUFFIX)) {
        Some(Some(id)) => (Some(id), true),
        Some(None) => (resumed, false),
        None => (None, false),
    };
    let from = match resumed {
        Some(id) => ReadFrom::parse(id).map_err(|_| {
            ApiError::bad_request(format!("Last-Event-ID {} is not an offset returned by this server", echo(id)))
        })?,
        None => q.from,
    };
    if saw_end {
        // The reconnecting EventSource saw the final control event at this offset: when the
        // stream did end there, 204 tells it to stop reconnecting (HTML Living Standard,
        // "Server-sent events": a 204 fails the connection). Anything else (a stream that has
        // not ended, or ended elsewhere, or was re-created) is read normally from that offset.
        let info = st.store.head(&path).await?;
        let ended_here = match (info.end, from) {
            (Some(end), ReadFrom::At(o)) => end.final_offset == o,
            (Some(end), ReadFrom::Tagged(o, tag)) => end.final_offset == o && OffsetTag::of(&info.incarnation) == tag,
            _ => false,
        };
        if ended_here {
            let mut res = Response::new(Body::empty());
            *res.status_mut() = axum::http::StatusCode::NO_CONTENT;
            return Ok(res);
        }
    }
    // Validate (404, 400, 410) and take the first chunk before committing to a 200. A client
    // that reconnects at the final offset without having seen the end gets the final control
    // event now.
    let first = st.store.read(&path, from).await?;
    let text = is_text(&first.content_type) && is_utf8(&first);
    let cursor = q.cursor;
    let mut res = open(permit, move |tx| run(st, path, first, text, cursor, tx));
    if !text {
        res.headers_mut().insert(h::stream_sse_data_encoding(), HeaderValue::from_static("base64"));
    }
    Ok(res)
}

/// The response of an SSE connection whose events `run` writes into its sender (it ends the
/// connection by returning); `run` runs in a task of its own holding the live-reader `permit`.
pub fn open<F, Fut>(permit: OwnedSemaphorePermit, run: F) -> Response
where
    F: FnOnce(mpsc::Sender<Bytes>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, mut rx) = mpsc::channel::<Bytes>(16);
    let task = run(tx);
    tokio::spawn(async move {
        let _permit = permit;
        metrics::gauge!("baton_sse_connections").increment(1.0);
        task.await;
        metrics::gauge!("baton_sse_connections").decrement(1.0);
    });
    let stream = futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|o| o.map(Ok::<_, Infallible>)));
    let mut res = Response::new(Body::from_stream(stream));
    let out = res.headers_mut();
    out.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    out.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    out.insert("x-accel-buffering", HeaderValue::from_static("no"));
    res
}

/// Appended to the event id of the final control event (`<offset>.end`), so that a browser
/// reconnecting after it (`Last-Event-ID: <offset>.end`) is told with 204 to stop, while one that
/// reconnects at the final offset without having seen the end still gets the final event.
const END_ID_SUFFIX: &str = ".end";

/// The reconnection delay asked of `EventSource` clients: 500 ms (HTML Living Standard,
/// "Server-sent events", the `retry` field). A block with no `data` dispatches no event.
const SSE_RETRY: &[u8] = b"retry: 500\n\n";

/// Writes events until EOF, the cycle ends, the client leaves, an error, or shutdown.
async fn run(
    st: AppState,
    path: StreamPath,
    first: ReadChunk,
    text: bool,
    cursor: Option<u64>,
    tx: mpsc::Sender<Bytes>,
) {
    let deadline = cycle_end(&st);
    if !start(&tx).await {
        return;
    }
    // Catch-up: keep reading while the store says there is more.
    let mut chunk = first;
    loop {
        let (frame, done) = events(&chunk, text, cursor);
        if tx.send(frame).await.is_err() || done {
            return;
        }
        if chunk.up_to_date || chunk.records.is_empty() {
            break;
        }
        chunk = match st.store.read(&path, ReadFrom::At(chunk.next_offset)).await {
            Ok(c) => c,
            Err(e) => return send_error(&tx, &e.to_string()).await,
        };
        if text && !is_utf8(&chunk) {
            return; // the client reconnects from the last control event and gets it base64
        }
    }
    // Live: wait on the shared tail from where catch-up stopped.
    let sub = st.store.subscribe(&path, ReadFrom::At(chunk.next_offset));
    live(&st, &tx, deadline, StreamTail { sub, text, cursor }).await
}

/// The live phase of a stream's connection: its shared tail.
struct StreamTail {
    sub: baton_streams::Subscription,
    text: bool,
    cursor: Option<u64>,
}

impl Tail for StreamTail {
    async fn next(&mut self, wait: Duration) -> Next {
        match self.sub.next(wait).await {
            Ok(Some(c)) if !c.records.is_empty() || c.end.is_some() => {
                if self.text && !is_utf8(&c) {
                    return Next::End; // as in catch-up: the next connection carries it base64
                }
                let (frame, done) = events(&c, self.text, self.cursor);
                Next::Frame(frame, done)
            }
            Ok(Some(_)) => Next::Idle,
            Ok(None) => Next::End,
            Err(e) => Next::Error(e.to_string()),
        }
    }
}

/// When a connection opened now is cycled: `--sse-cycle` from now.
pub fn cycle_end(st: &AppState) -> tokio::time::Instant {
    tokio::time::Instant::now() + st.cfg.sse_cycle
}

/// Starts a connection's body: `retry: 500` (browsers wait about 3 s before reconnecting an
/// EventSource unless told otherwise, and connections are cycled every `--sse-cycle`). False
/// when the client has left.
pub async fn start(tx: &mpsc::Sender<Bytes>) -> bool {
    tx.send(Bytes::from_static(SSE_RETRY)).await.is_ok()
}

/// What a connection's live phase got from one wait of its [`Tail`].
pub enum Next {
    /// Events to send; `true` when the connection must end after them.
    Frame(Bytes, bool),
    /// Nothing new within the wait (a heartbeat is sent).
    Idle,
    /// The connection ends cleanly (the client reconnects from its last control event).
    End,
    /// The source is gone: one `event: error` with this message, then the connection ends.
    Error(String),
}

/// The source a connection's live phase waits on.
pub trait Tail: Send {
    /// Waits up to `wait` for what comes next.
    fn next(&mut self, wait: Duration) -> impl Future<Output = Next> + Send;
}

/// The live phase of every SSE connection: waits on `tail` in steps of at most
/// `--sse-heartbeat`, sends what it gives, a `:` comment heartbeat after each idle step (so
/// proxies keep the connection), and ends at `deadline` (the cycle: the client resumes from its
/// last control event), when the client leaves, or at server shutdown.
pub async fn live(st: &AppState, tx: &mpsc::Sender<Bytes>, deadline: tokio::time::Instant, mut tail: impl Tail) {
    let heartbeat = st.cfg.sse_heartbeat;
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return;
        }
        let wait = heartbeat.min(deadline - now);
        let next = tokio::select! {
            n = tail.next(wait) => n,
            _ = tx.closed() => return,
            _ = st.shutdown.cancelled() => return,
        };
        match next {
            Next::Frame(frame, done) => {
                if tx.send(frame).await.is_err() || done {
                    return;
                }
            }
            Next::Idle => {
                if tx.send(Bytes::from_static(b":\n\n")).await.is_err() {
                    return;
                }
            }
            Next::End => return,
            Next::Error(message) => return send_error(tx, &message).await,
        }
    }
}

/// A source that disappears mid-connection: one `event: error` then the connection closes.
pub async fn send_error(tx: &mpsc::Sender<Bytes>, message: &str) {
    let payload = serde_json::json!({ "error": message }).to_string();
    let _ = tx.send(Bytes::from(format!("event: error\ndata:{payload}\n\n"))).await;
}

/// The `data` event (when there are records) and its `control` event; `true` when the stream
/// is closed and the connection must end. With `text`, the data must be valid UTF-8 (see
/// [`is_utf8`]; anything else would be replaced by U+FFFD).
pub fn events(chunk: &ReadChunk, text: bool, cursor: Option<u64>) -> (Bytes, bool) {
    let mut out = BytesMut::new();
    let id = chunk.next_offset.token(&chunk.incarnation);
    if !chunk.records.is_empty() {
        out.put_slice(b"event: data\n");
        let body = chunk.body();
        if text {
            data_lines(&mut out, &String::from_utf8_lossy(&body));
        } else {
            out.put_slice(b"data:");
            out.put_slice(base64::engine::general_purpose::STANDARD.encode(&body).as_bytes());
            out.put_u8(b'\n');
        }
        out.put_u8(b'\n');
    }
    let mut control = serde_json::Map::new();
    control.insert("streamNextOffset".into(), id.clone().into());
    let closed = chunk.end.is_some();
    if closed {
        control.insert("streamClosed".into(), true.into());
        control.insert("upToDate".into(), true.into());
        if let Some(end) = chunk.end {
            control.insert("batonEndReason".into(), end.reason.as_str().into());
        }
    } else {
        control.insert("streamCursor".into(), h::next_cursor(cursor).to_string().into());
        if chunk.up_to_date {
            control.insert("upToDate".into(), true.into());
        }
    }
    let id = if closed { format!("{id}{END_ID_SUFFIX}") } else { id };
    control_event(&mut out, control, &id);
    (out.freeze(), closed)
}

/// `text` as `data:` lines, split at every `\r\n`, `\r` or `\n` (so data can never inject
/// fields or events).
pub fn data_lines(out: &mut BytesMut, text: &str) {
    for line in text.split("\r\n").flat_map(|l| l.split(['\r', '\n'])) {
        out.put_slice(b"data:");
        out.put_slice(line.as_bytes());
        out.put_u8(b'\n');
    }
}

/// One `event: control` with `control` as its JSON data and `id` as its event id (what a
/// reconnecting `EventSource` sends back as `Last-Event-ID`).
pub fn control_event(out: &mut BytesMut, control: serde_json::Map<String, serde_json::Value>, id: &str) {
    out.put_slice(b"event: control\ndata:");
    out.put_slice(serde_json::Value::Object(control).to_string().as_bytes());
    out.put_slice(b"\nid:");
    out.put_slice(id.as_bytes());
    out.put_slice(b"\n\n");
    metrics::counter!("baton_sse_events_total").increment(1);
}
