//! The command event feeds: `GET /v1/queues/{queue}/events` (a queue's commands' transitions)
//! and `GET /v1/commands/{id}/events` (one command's), read with the Durable Streams read
//! protocol as `/v1/stream/{path}` is (catch-up, `live=long-poll`, `live=sse`), over the
//! store's feed ([`baton_commands::CommandEvent`]).
//!
//! | Query | Meaning |
//! |---|---|
//! | `offset` | `-1` (the oldest event kept; the default of a catch-up read), `now` (the tail), or an offset returned before (`Stream-Next-Offset`, an event's `offset`, SSE `streamNextOffset`); live reads need one |
//! | `live` | absent (catch-up), `long-poll` or `sse` |
//! | `limit` | most events per response (per SSE `data` event), 1 to [`READ_MAX`] (default 100) |
//! | `cursor` | the last `Stream-Cursor` (CDN collapsing, as on streams) |
//!
//! * **Catch-up**: `200`, `Content-Type: application/json`, a JSON array of events, oldest
//!   first; `Stream-Next-Offset` says where to read next, `Stream-Up-To-Date: true` that the read
//!   reached the feed's tail. `Cache-Control` as on streams: a page with events may be cached for
//!   a minute, a read at the tail (`offset=now`, or no events) is `no-store`.
//! * **Long-poll**: waits up to `--long-poll-timeout` for an event (any process's); events →
//!   `200` as catch-up, none → `204` with `Stream-Next-Offset` (and `Stream-Up-To-Date: true`
//!   once the tail is reached); both carry `Stream-Cursor`. Holds a live-reader slot.
//! * **SSE**: `event: data` (the JSON array) then `event: control`
//!   (`{"streamNextOffset", "streamCursor", "upToDate"?}`, with `id:` its offset, so a browser
//!   `EventSource` resumes with `Last-Event-ID`, which wins over `offset`); the rest (retry,
//!   heartbeats, cycling, shutdown, one `event: error` when the command expires under the
//!   connection) is [`super::sse`]'s.
//!
//! Errors: `400 invalid_offset` (an offset that is not `-1`, `now` or one returned), `400` a bad
//! `live`, `limit` (`invalid_limit`) or unknown query parameter (`invalid_query`), a live read
//! without `offset`; `404 unknown_queue`, `404 not_found` (no such command now); `503` all
//! live-reader slots taken. One request looks at most at [`baton_commands::SCAN_MAX`] entries
//! of the home queue's feed for a command's events (then `Stream-Up-To-Date` is absent: read on).

use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use baton_commands::{validate_id, CommandError, EventFrom, EventPage, READ_MAX};
use bytes::{Bytes, BytesMut};
use tokio::sync::mpsc;

use super::errors::{echo, ApiError};
use super::headers::{self as h, set, set_static, Live};
use super::json::serialized_response;
use super::plumbing::{limit_param, principal, IdParam, Query, QuerySpec, QueueName};
use super::sse::{self, Next, Tail};
use super::state::AppState;
use crate::settings::Op;

/// `?offset=&live=&limit=&cursor=`.
pub struct FeedQuery;
impl QuerySpec for FeedQuery {
    const ALLOWED: &'static [&'static str] = &["offset", "live", "limit", "cursor"];
}

/// Whose events a request reads.
#[derive(Clone)]
enum Feed {
    Queue(String),
    Command(String),
}

/// A read's parsed query.
struct FeedRead {
    from: EventFrom,
    live: Live,
    limit: usize,
    cursor: Option<u64>,
}

fn feed_read(q: &Query<FeedQuery>) -> Result<FeedRead, ApiError> {
    let live = h::live_param(q.get("live").map_or("", String::as_str))?;
    let offset = q.get("offset");
    h::live_needs_offset(live, offset.is_some())?;
    let from = EventFrom::parse(offset.map_or("-1", String::as_str))?;
    Ok(FeedRead {
        from,
        live,
        limit: limit_param(q, 100, READ_MAX)?,
        cursor: q.get("cursor").and_then(|c| h::cursor_param(c)),
    })
}

impl Feed {
    async fn read(&self, st: &AppState, from: EventFrom, limit: usize) -> Result<EventPage, CommandError> {
        let store = st.commands.store();
        match self {
            Feed::Queue(q) => store.events(q, from, limit).await,
            Feed::Command(id) => store.command_events(id, from, limit).await,
        }
    }

    async fn wait(&self, st: &AppState, from: EventFrom, limit: usize, d: Duration) -> Result<EventPage, CommandError> {
        let store = st.commands.store();
        match self {
            Feed::Queue(q) => store.events_wait(q, from, limit, d).await,
            Feed::Command(id) => store.command_events_wait(id, from, limit, d).await,
        }
    }
}

/// `GET /v1/queues/{queue}/events`.
pub async fn queue_events(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    q: Query<FeedQuery>,
    req: Request,
) -> Result<Response, ApiError> {
    let read = feed_read(&q)?;
    serve(st, Feed::Queue(queue), read, req.headers()).await
}

/// `GET /v1/commands/{id}/events`: checked against the command's (home) queue, as
/// `GET /v1/commands/{id}` is.
pub async fn command_events(
    State(st): State<AppState>,
    IdParam(id): IdParam,
    q: Query<FeedQuery>,
    req: Request,
) -> Result<Response, ApiError> {
    let read = feed_read(&q)?;
    validate_id(&id)?;
    let who = principal(req.extensions())?;
    let state = st.commands.store().get(&id).await?.ok_or_else(|| CommandError::NotFound(id.clone()))?;
    who.check_queue(Op::Read, &state.queue).map_err(ApiError::forbidden)?;
    serve(st, Feed::Command(id), read, req.headers()).await
}

async fn serve(st: AppState, feed: Feed, read: FeedRead, headers: &HeaderMap) -> Result<Response, ApiError> {
    match read.live {
        Live::No => {
            let page = feed.read(&st, read.from, read.limit).await?;
            Ok(page_response(&st, &page, &read, false))
        }
        Live::LongPoll => {
            let _permit = st.live_permit()?;
            let timeout = st.cfg.long_poll_timeout;
            let page = tokio::select! {
                r = feed.wait(&st, read.from, read.limit, timeout) => r?,
                _ = st.shutdown.cancelled() => feed.read(&st, read.from, read.limit).await?,
            };
            Ok(page_response(&st, &page, &read, true))
        }
        Live::Sse => serve_sse(st, feed, read, sse::last_event_id(headers)?).await,
    }
}

/// The response of a catch-up or long-poll read (module docs).
fn page_response(st: &AppState, page: &EventPage, read: &FeedRead, live: bool) -> Response {
    let empty = page.events.is_empty();
    let mut res =
        if live && empty { StatusCode::NO_CONTENT.into_response() } else { serialized_response(&page.events) };
    let out = res.headers_mut();
    set(out, h::stream_next_offset(), page.next_offset);
    if page.up_to_date {
        set_static(out, h::stream_up_to_date(), "true");
    }
    let tail = matches!(read.from, EventFrom::Now) || empty;
    set_static(out, header::CACHE_CONTROL, h::read_cache_control(st.cfg.cache, tail));
    if live {
        set(out, h::stream_cursor(), h::next_cursor(read.cursor));
    }
    res
}

async fn serve_sse(st: AppState, feed: Feed, read: FeedRead, last: Option<&str>) -> Result<Response, ApiError> {
    let permit = st.live_permit()?;
    let from = match last {
        Some(id) => EventFrom::parse(id).map_err(|_| {
            ApiError::bad_request(format!("Last-Event-ID {} is not an offset returned by this server", echo(id)))
        })?,
        None => read.from,
    };
    // Validate (404) and take the first page before committing to a 200.
    let first = feed.read(&st, from, read.limit).await?;
    let (limit, cursor) = (read.limit, read.cursor);
    Ok(sse::open(permit, move |tx| run(st, feed, first, limit, cursor, tx)))
}

/// Writes a connection's events: catch-up page by page, then live (module docs).
async fn run(st: AppState, feed: Feed, first: EventPage, limit: usize, cursor: Option<u64>, tx: mpsc::Sender<Bytes>) {
    let deadline = sse::cycle_end(&st);
    if !sse::start(&tx).await {
        return;
    }
    let mut page = first;
    loop {
        if tx.send(frame(&page, cursor)).await.is_err() {
            return;
        }
        if page.up_to_date {
            break;
        }
        page = match feed.read(&st, EventFrom::After(page.next_offset), limit).await {
            Ok(p) => p,
            Err(e) => return sse::send_error(&tx, &e.to_string()).await,
        };
    }
    let tail = FeedTail { st: st.clone(), feed, from: page.next_offset, limit, cursor };
    sse::live(&st, &tx, deadline, tail).await
}

/// The live phase of a feed's connection: long-polls of the store from the last offset sent.
struct FeedTail {
    st: AppState,
    feed: Feed,
    from: baton_commands::EventOffset,
    limit: usize,
    cursor: Option<u64>,
}

impl Tail for FeedTail {
    async fn next(&mut self, wait: Duration) -> Next {
        match self.feed.wait(&self.st, EventFrom::After(self.from), self.limit, wait).await {
            Ok(page) if page.events.is_empty() && page.next_offset == self.from => Next::Idle,
            Ok(page) => {
                self.from = page.next_offset;
                Next::Frame(frame(&page, self.cursor), false)
            }
            Err(e) => Next::Error(e.to_string()),
        }
    }
}

/// A page as SSE: `event: data` with the events' JSON array (when there are any), then
/// `event: control` with `id:` its next offset.
fn frame(page: &EventPage, cursor: Option<u64>) -> Bytes {
    let mut out = BytesMut::new();
    if !page.events.is_empty() {
        out.extend_from_slice(b"event: data\n");
        sse::data_lines(&mut out, &serde_json::to_string(&page.events).expect("events serialize"));
        out.extend_from_slice(b"\n");
    }
    let id = page.next_offset.to_string();
    let mut control = serde_json::Map::new();
    control.insert("streamNextOffset".into(), id.clone().into());
    control.insert("streamCursor".into(), h::next_cursor(cursor).to_string().into());
    if page.up_to_date {
        control.insert("upToDate".into(), true.into());
    }
    sse::control_event(&mut out, control, &id);
    out.freeze()
}
