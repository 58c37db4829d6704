//! The dashboard: `GET /` serves one HTML page (CSS and JavaScript from `src/dashboard/`,
//! embedded at build time; no external assets) to browsers, and the JSON index to everything
//! else; `GET /v1/dashboard/events` feeds it.
//!
//! `GET /v1/dashboard/events?queue=&status=&limit=` is a server-sent event stream: an
//! `event: snapshot` right away and then every second, whose data is
//!
//! ```json
//! {"time": "…", "server": {"version", "backend", "auth"},
//!  "queues": [{"name", "paused", "paused_since", "backoff_ms", "rate_limit", "rate_limit_per_key", "key_waiting", "key_rate_delayed", "keys",
//!              "length", "pending", "consumers", "lag", "delayed", "dead_letters",
//!              "commands": {"submitted", …, "total"}, "handlers": […], "workers"}],
//!  "commands": [state…],        // newest first over the readable queues (or `queue`), `status` only, at most `limit` (default 50, ≤ 500)
//!  "dead_letters": [{"queue", "id", "original_id", "payload", "command_id", "deliveries", "reason", "dead_lettered_at", "concurrency_key", "priority"}]}
//! ```
//!
//! Only queues the caller may read are included (a token passed as `?access_token=`, which
//! `EventSource` needs, is taken off the URL by the auth layer before anything sees it). The
//! connection counts as a live reader, is closed after the server's SSE cycle (the browser
//! reconnects) and at shutdown. A queue whose stats fail is reported with `"error"`.

use std::convert::Infallible;
use std::sync::OnceLock;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use baton_commands::{CommandStatus, ListQuery};
use bytes::Bytes;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::errors::ApiError;
use super::json::state_json;
use super::plumbing::{limit_param, principal, status_param, DashboardQuery, Query};
use super::queues::dead_letter_json;
use super::state::{AppState, CommandsApi};
use crate::auth::Principal;
use crate::settings::Op;

/// How often a snapshot is sent.
const PERIOD: Duration = Duration::from_secs(1);
/// Dead letters listed per queue.
const DEAD_PER_QUEUE: usize = 50;

/// The page: `index.html` with `style.css` and `app.js` inlined.
fn page() -> &'static str {
    static PAGE: OnceLock<String> = OnceLock::new();
    PAGE.get_or_init(|| {
        include_str!("../dashboard/index.html")
            .replace("/*BATON_STYLE*/", include_str!("../dashboard/style.css"))
            .replace("/*BATON_SCRIPT*/", include_str!("../dashboard/app.js"))
    })
}

/// `GET /`: the dashboard for browsers (`Accept: text/html`), the JSON index otherwise.
pub async fn index_or_page(state: State<AppState>, headers: HeaderMap) -> Response {
    let wants_html = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.split(',').any(|t| t.trim().starts_with("text/html")));
    if !wants_html {
        // The same URL answers HTML or JSON by Accept: caches must key on it (RFC 9110 §12.5.5).
        let mut res = index(state).await;
        res.headers_mut().insert(header::VARY, HeaderValue::from_static("accept"));
        return res;
    }
    let mut res = page().into_response();
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        ),
    );
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::VARY, HeaderValue::from_static("accept"));
    res
}

/// The JSON answer of `GET /`: what this server is and where its APIs are.
async fn index(State(state): State<AppState>) -> Response {
    let backend = state.cfg.backend.describe();
    let body = serde_json::json!({
        "service": "baton",
        "version": env!("CARGO_PKG_VERSION"),
        "backend": backend,
        "streams": "/v1/stream/{path}",
        "protocol": "Durable Streams (PROTOCOL.md); extensions in docs/http-api.md",
        "commands": ["/v1/queues", "/v1/queues/{queue}/commands", "/v1/commands/{id}"],
        "subscriptions": ["/v1/stream/__ds/subscriptions/{id}", "/v1/stream/__ds/jwks.json"],
        "queues": state.commands.queue_names(),
        "auth": if state.auth.enabled() { "bearer" } else { "none" },
        "endpoints": ["/healthz", "/readyz", "/metrics", "/openapi.json"],
    });
    ([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// What one connection asked for.
struct Filter {
    queue: Option<String>,
    status: Option<CommandStatus>,
    limit: usize,
}

/// `GET /v1/dashboard/events` (module docs).
pub async fn events(State(st): State<AppState>, q: Query<DashboardQuery>, req: Request) -> Result<Response, ApiError> {
    let who = principal(req.extensions())?;
    let queue = q.get("queue").map(|s| s.trim().to_string()).filter(|s| !s.is_empty());
    if let Some(name) = &queue {
        st.commands.queue(name)?;
        who.check_queue(Op::Read, name).map_err(ApiError::forbidden)?;
    }
    let status = status_param(&q)?;
    let limit = limit_param(&q, 50, 500)?;
    let permit = st.live_permit()?;
    let filter = Filter { queue, status, limit };
    let (tx, mut rx) = mpsc::channel::<Bytes>(4);
    tokio::spawn(async move {
        let _permit = permit;
        let deadline = tokio::time::Instant::now() + st.cfg.sse_cycle;
        let mut tick = tokio::time::interval(PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Reconnect quickly after a cycle or a restart.
        if tx.send(Bytes::from_static(b"retry: 1000\n\n")).await.is_err() {
            return;
        }
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = tx.closed() => return,
                _ = st.shutdown.cancelled() => return,
            }
            if tokio::time::Instant::now() >= deadline {
                return;
            }
            let snap = snapshot(&st, &who, &filter).await;
            let frame = format!("event: snapshot\ndata: {snap}\n\n");
            if tx.send(Bytes::from(frame)).await.is_err() {
                return;
            }
        }
    });
    let stream = futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|o| o.map(Ok::<_, Infallible>)));
    let mut res = Response::new(Body::from_stream(stream));
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(res)
}

/// One snapshot (module docs). Never fails as a whole: a failing part carries `"error"`.
async fn snapshot(st: &AppState, who: &Principal, f: &Filter) -> Value {
    let api = &st.commands;
    let names: Vec<String> = api.queue_names().into_iter().filter(|n| who.can_queue(Op::Read, n)).collect();
    let mut queues = Vec::new();
    let mut dead = Vec::new();
    let mut commands: Vec<Value> = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    for name in &names {
        queues.push(queue_json(api, name).await);
        match api.store().messages().dead_letters(name, DEAD_PER_QUEUE).await {
            Ok(items) => dead.extend(items.iter().map(|d| {
                let mut v = dead_letter_json(d);
                v["queue"] = Value::from(name.as_str());
                v
            })),
            Err(e) => errors.push(format!("dead letters of {name}: {e}")),
        }
        if f.queue.as_deref().is_some_and(|q| q != name) {
            continue;
        }
        match api
            .store()
            .list(name, ListQuery { status: f.status, limit: f.limit, cursor: None, ..Default::default() })
            .await
        {
            Ok(page) => commands.extend(page.items.iter().map(state_json)),
            Err(e) => errors.push(format!("commands of {name}: {e}")),
        }
    }
    let key = |v: &Value| {
        (
            v.get("created_at").and_then(Value::as_str).unwrap_or("").to_string(),
            v.get("id").and_then(Value::as_str).unwrap_or("").to_string(),
        )
    };
    commands.sort_by_key(|v| std::cmp::Reverse(key(v)));
    commands.truncate(f.limit);
    json!({
        "time": baton_commands::Timestamp::now().to_string(),
        "server": {
            "version": env!("CARGO_PKG_VERSION"),
            "backend": st.cfg.backend.describe(),
            "auth": if st.auth.enabled() { "bearer" } else { "none" },
        },
        "filter": {
            "queue": f.queue,
            "status": f.status.map(|s| s.as_str()),
            "limit": f.limit,
        },
        "queues": queues,
        "commands": commands,
        "dead_letters": dead,
        "errors": errors,
    })
}

/// A queue's stats and counts: the body of `GET /v1/queues/{queue}`, or `{name, handlers,
/// error}` when the backend could not answer (the dashboard shows the error in the row).
async fn queue_json(api: &CommandsApi, name: &str) -> Value {
    match super::queues::queue_json(api, name).await {
        Ok(v) => v,
        Err(e) => {
            let handlers: Vec<String> =
                api.queue(name).map(|q| q.handlers.keys().cloned().collect()).unwrap_or_default();
            json!({ "name": name, "handlers": handlers, "error": e.message })
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn page_inlines_its_assets() {
        let p = super::page();
        assert!(p.starts_with("<!doctype html>"));
        assert!(!p.contains("/*BATON_STYLE*/") && !p.contains("/*BATON_SCRIPT*/"));
        assert!(!p.contains("http://") && !p.contains("https://"), "no external assets");
    }
}
