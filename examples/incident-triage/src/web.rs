//! The web app: the page (embedded assets) and a small JSON + SSE API.
//!
//! | method and path                              | what                                                            |
//! |----------------------------------------------|-----------------------------------------------------------------|
//! | `GET /`, `/app.js`, `/style.css`             | the page                                                        |
//! | `GET /api/config`                            | backend, log directories, silence timeout (ms), worker          |
//! | `GET /api/logs`                              | readable files under the log directories: `[{path, size}]`     |
//! | `POST /api/runs`                             | `{"engineer","source":{"kind":"path","path"}\|{"kind":"text","name","text"}}` → 201 run, 409 `{error, current}` |
//! | `GET /api/engineers/{engineer}/current`      | the engineer's current run (200) or 404                         |
//! | `GET /api/runs/{engineer}/{run}`             | a run: command status and error, stream end, event count        |
//! | `POST /api/runs/{engineer}/{run}/stop`       | Stop: the run, as it is after the cancel                        |
//! | `GET /api/runs/{engineer}/{run}/events`      | SSE (below)                                                     |
//! | `GET /healthz`                               | `ok`                                                            |
//!
//! SSE: `?offset=-1` (default: from the start) or an offset; a reconnecting `EventSource`'s
//! `Last-Event-ID` wins over the URL. Each stream event is one `event: triage` whose `id:` is its
//! offset (resume point) and whose `data:` is the event's JSON. When the stream has ended, one
//! `event: end` with `{"reason": "finished"|"cancelled"|"producer_lost", "offset"}` and the
//! connection closes. `:` heartbeats every 15 s; connections are recycled after `sse_cycle`
//! (the browser reconnects with `Last-Event-ID` after the `retry: 250` ms the stream sets). A run whose stream does not exist yet is waited
//! for (up to 15 s) while its command is pending.

use std::convert::Infallible;
use std::path::Path as FsPath;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use baton_streams::{ReadChunk, ReadFrom, StreamError};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;

use crate::producer::LogSource;
use crate::triage::{stream_path, Triage, TriageError, MAX_UPLOAD_BYTES};

const INDEX: &str = include_str!("../assets/index.html");
const APP_JS: &str = include_str!("../assets/app.js");
const STYLE: &str = include_str!("../assets/style.css");

/// Web settings.
#[derive(Clone, Debug)]
pub struct WebConfig {
    /// An SSE connection is closed after about this long (the browser resumes). Default 60 s.
    pub sse_cycle: Duration,
}

impl Default for WebConfig {
    fn default() -> Self {
        Self { sse_cycle: Duration::from_secs(60) }
    }
}

#[derive(Clone)]
struct App {
    triage: Triage,
    web: WebConfig,
}

/// The app's router.
pub fn router(triage: Triage, web: WebConfig) -> Router {
    let asset = |body: &'static str, ct: &'static str| {
        get(move || async move { ([(header::CONTENT_TYPE, ct), (header::CACHE_CONTROL, "no-cache")], body) })
    };
    Router::new()
        .route("/", asset(INDEX, "text/html; charset=utf-8"))
        .route("/app.js", asset(APP_JS, "text/javascript; charset=utf-8"))
        .route("/style.css", asset(STYLE, "text/css; charset=utf-8"))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/api/config", get(config))
        .route("/api/logs", get(logs))
        .route("/api/runs", post(start))
        .route("/api/engineers/{engineer}/current", get(current))
        .route("/api/runs/{engineer}/{run}", get(run_info))
        .route("/api/runs/{engineer}/{run}/stop", post(stop))
        .route("/api/runs/{engineer}/{run}/events", get(events))
        .layer(DefaultBodyLimit::max(MAX_UPLOAD_BYTES + 64 * 1024))
        .with_state(App { triage, web })
}

fn error(status: StatusCode, msg: impl std::fmt::Display) -> Response {
    (status, Json(json!({ "error": msg.to_string() }))).into_response()
}

async fn fail(t: &Triage, e: TriageError) -> Response {
    match e {
        TriageError::Invalid(m) => error(StatusCode::BAD_REQUEST, m),
        TriageError::NotFound => error(StatusCode::NOT_FOUND, "no such run"),
        TriageError::Busy { ref engineer, ref run } => {
            let current = t.run_info(engineer, run).await.ok().flatten();
            (StatusCode::CONFLICT, Json(json!({ "error": e.to_string(), "current": current }))).into_response()
        }
        other => error(StatusCode::SERVICE_UNAVAILABLE, other),
    }
}

async fn config(State(app): State<App>) -> Response {
    let c = app.triage.config();
    Json(json!({
        "backend": if c.redis.is_some() { "redis" } else { "memory" },
        "log_dirs": c.log_dirs,
        "silence_timeout_ms": c.silence_timeout.as_millis() as u64,
        "worker": c.worker,
    }))
    .into_response()
}

/// Regular files under the log directories (two levels deep, at most 300, newest first).
async fn logs(State(app): State<App>) -> Response {
    let dirs = app.triage.config().log_dirs.clone();
    let list = tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        fn walk(dir: &FsPath, depth: u32, out: &mut Vec<(String, u64, std::time::SystemTime)>) {
            let Ok(rd) = std::fs::read_dir(dir) else { return };
            for e in rd.flatten() {
                let Ok(md) = e.metadata() else { continue };
                if md.is_dir() && depth > 0 {
                    walk(&e.path(), depth - 1, out);
                } else if md.is_file() && std::fs::File::open(e.path()).is_ok() && out.len() < 300 {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if name.ends_with(".gz") || name.ends_with(".xz") || name.ends_with(".journal") {
                        continue;
                    }
                    out.push((
                        e.path().display().to_string(),
                        md.len(),
                        md.modified().unwrap_or(std::time::UNIX_EPOCH),
                    ));
                }
            }
        }
        for d in &dirs {
            walk(d, 1, &mut out);
        }
        out.sort_by_key(|e| std::cmp::Reverse(e.2));
        out.into_iter().map(|(path, size, _)| json!({"path": path, "size": size})).collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    Json(list).into_response()
}

#[derive(Deserialize)]
struct StartBody {
    engineer: String,
    source: LogSource,
}

async fn start(State(app): State<App>, Json(body): Json<StartBody>) -> Response {
    match app.triage.start_run(&body.engineer, body.source).await {
        Ok(info) => (StatusCode::CREATED, Json(info)).into_response(),
        Err(e) => fail(&app.triage, e).await,
    }
}

async fn current(State(app): State<App>, Path(engineer): Path<String>) -> Response {
    match app.triage.current_run(&engineer).await {
        Ok(Some(info)) => Json(info).into_response(),
        Ok(None) => error(StatusCode::NOT_FOUND, format!("{engineer} has no current run")),
        Err(e) => fail(&app.triage, e).await,
    }
}

async fn run_info(State(app): State<App>, Path((engineer, run)): Path<(String, String)>) -> Response {
    match app.triage.run_info(&engineer, &run).await {
        Ok(Some(info)) => Json(info).into_response(),
        Ok(None) => error(StatusCode::NOT_FOUND, "no such run"),
        Err(e) => fail(&app.triage, e).await,
    }
}

async fn stop(State(app): State<App>, Path((engineer, run)): Path<(String, String)>) -> Response {
    match app.triage.stop_run(&engineer, &run).await {
        Ok(info) => Json(info).into_response(),
        Err(e) => fail(&app.triage, e).await,
    }
}

#[derive(Deserialize)]
struct EventsQuery {
    offset: Option<String>,
}

async fn events(
    State(app): State<App>,
    Path((engineer, run)): Path<(String, String)>,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
) -> Response {
    let Ok(Some(_)) = app.triage.run_info(&engineer, &run).await else {
        return error(StatusCode::NOT_FOUND, "no such run");
    };
    let path = stream_path(&engineer, &run);
    let resume = headers.get("last-event-id").and_then(|v| v.to_str().ok()).map(str::trim).filter(|s| !s.is_empty());
    let from = match ReadFrom::parse(resume.or(q.offset.as_deref()).unwrap_or("-1")) {
        Ok(f) => f,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    // Wait for the stream while the command has not created it yet.
    let mut waited = Duration::ZERO;
    let first = loop {
        match app.triage.streams().read(&path, from).await {
            Ok(c) => break c,
            Err(StreamError::NotFound { .. }) if waited < Duration::from_secs(15) => {
                let info = app.triage.run_info(&engineer, &run).await.ok().flatten();
                if info.and_then(|i| i.status).is_none_or(|s| s.is_terminal()) {
                    return error(StatusCode::NOT_FOUND, "the run has no stream (it ended before starting)");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                waited += Duration::from_millis(100);
            }
            Err(e) => return error(StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST), e),
        }
    };
    if resume.is_some() && first.records.is_empty() && first.end.is_some() {
        // The browser already saw everything including the end: 204 stops its reconnects.
        return StatusCode::NO_CONTENT.into_response();
    }
    let (tx, mut rx) = mpsc::channel::<Bytes>(16);
    let streams = app.triage.streams().clone();
    let cycle = app.web.sse_cycle;
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + cycle;
        let mut chunk = first;
        let mut sub = None;
        // Reconnect quickly after a recycled connection (browsers default to about 3 s).
        if tx.send(Bytes::from_static(b"retry: 250\n\n")).await.is_err() {
            return;
        }
        loop {
            let done = chunk.end.is_some();
            if tx.send(frame(&chunk)).await.is_err() || done {
                return;
            }
            let sub = sub.get_or_insert_with(|| streams.subscribe(&path, ReadFrom::At(chunk.next_offset)));
            loop {
                let now = tokio::time::Instant::now();
                if now >= deadline {
                    return;
                }
                let wait = Duration::from_secs(15).min(deadline - now);
                let next = tokio::select! {
                    r = sub.next(wait) => r,
                    _ = tx.closed() => return,
                };
                match next {
                    Ok(Some(c)) if !c.records.is_empty() || c.end.is_some() => {
                        chunk = c;
                        break;
                    }
                    Ok(Some(_)) => {
                        if tx.send(Bytes::from_static(b":\n\n")).await.is_err() {
                            return;
                        }
                    }
                    Ok(None) => return,
                    Err(e) => {
                        let msg = json!({ "error": e.to_string() }).to_string();
                        let _ = tx.send(Bytes::from(format!("event: failure\ndata: {msg}\n\n"))).await;
                        return;
                    }
                }
            }
        }
    });
    let body =
        Body::from_stream(futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|o| o.map(Ok::<_, Infallible>))));
    let mut res = Response::new(body);
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    res
}

/// One `triage` event per record (id = its offset), then `end` when the stream ended.
fn frame(chunk: &ReadChunk) -> Bytes {
    let mut out = String::new();
    for r in &chunk.records {
        out.push_str("event: triage\nid: ");
        out.push_str(&r.offset.to_string());
        out.push_str("\ndata: ");
        // Events are single-line JSON objects (serde_json never writes raw newlines).
        out.push_str(&String::from_utf8_lossy(&r.data));
        out.push_str("\n\n");
    }
    if let Some(end) = chunk.end {
        let body = json!({ "reason": end.reason.as_str(), "offset": end.final_offset.to_string() });
        out.push_str(&format!("event: end\nid: {}\ndata: {body}\n\n", chunk.next_offset));
    }
    Bytes::from(out)
}
