//! Queue statistics, dead letters, queue gauges for `/metrics`, and HTTP request timing.
//!
//! | Route | Success | Errors |
//! |---|---|---|
//! | `GET /v1/queues` | `200` `{"queues": [queue…]}` (those the caller may read) | `503` backend |
//! | `GET /v1/queues/{queue}` | `200` queue | `404` unknown queue |
//! | `GET /v1/queues/{queue}/dead-letters?limit=100` | `200` `{"items": [dead letter…]}`, oldest first | `400` bad limit, `404` |
//! | `POST /v1/queues/{queue}/dead-letters/{id}/replay` | `200` `{"replayed": id, "id": new id}` | `400` bad id, `404` unknown queue or dead letter |
//! | `POST /v1/queues/{queue}/dead-letters/replay?limit=1000` | `200` `{"replayed": n}` (oldest first) | `400` bad limit, `404` |
//! | `DELETE /v1/queues/{queue}/dead-letters` | `200` `{"purged": n}` | `404` |
//!
//! A queue: `{"name", "length", "pending", "consumers", "lag", "delayed", "dead_letters",
//! "commands": {"submitted", "running", "succeeded", "failed", "cancelled", "total"},
//! "handlers": [command type…], "workers": bool}` — counts are exact at the time of the call;
//! `workers` says whether this process runs the queue's workers. A dead letter: `{"id",
//! "original_id", "payload" (text), "command_id" (string or null), "deliveries", "reason",
//! "dead_lettered_at" (RFC 3339)}`.

use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{delete, get, post, MethodRouter};
use baton_queue::{MessageId, QueueError};
use serde_json::{json, Value};

use super::commands::{
    json_response, limit_param, principal, CommandsApi, IdParam, JsonError, LimitQuery, Query, QueueName,
};
use super::{AppState, RouteDef};
use crate::auth::Op;

/// The queue routes.
pub fn routes() -> Vec<(RouteDef, MethodRouter<AppState>)> {
    vec![
        (RouteDef::new("/v1/queues", &["GET"]), get(list_queues)),
        (RouteDef::new("/v1/queues/{queue}", &["GET"]), get(one_queue)),
        (RouteDef::new("/v1/queues/{queue}/dead-letters", &["GET", "DELETE"]), get(dead_letters).merge(delete(purge))),
        (RouteDef::new("/v1/queues/{queue}/dead-letters/replay", &["POST"]), post(replay_all)),
        (RouteDef::new("/v1/queues/{queue}/dead-letters/{id}/replay", &["POST"]), post(replay_one)),
    ]
    .into_iter()
    .map(|(d, mr)| (d.clone(), super::commands::json_405(mr, d.methods)))
    .collect()
}

fn queue_error(e: QueueError) -> JsonError {
    match e {
        QueueError::InvalidMessageId(_) => JsonError::bad_request("invalid_id", e.to_string()),
        QueueError::DeadLetterNotFound(_) => JsonError::not_found("not_found", e.to_string()),
        QueueError::InvalidQueueName(_) => JsonError::bad_request("invalid_queue", e.to_string()),
        other => baton_commands::CommandError::Queue(other).into(),
    }
}

/// Stats of one configured queue as JSON (module docs); also the dashboard's queue rows.
pub(super) async fn queue_json(api: &CommandsApi, name: &str) -> Result<Value, JsonError> {
    let entry = api.queue(name)?;
    let stats = api.store().messages().stats(name).await.map_err(queue_error)?;
    let c = api.store().counts(name).await?;
    let handlers: Vec<&String> = entry.handlers.keys().collect();
    Ok(json!({
        "name": name,
        "length": stats.length,
        "pending": stats.pending,
        "consumers": stats.consumers,
        "lag": stats.lag,
        "delayed": stats.delayed,
        "dead_letters": stats.dead_letters,
        "commands": {
            "submitted": c.submitted, "running": c.running, "succeeded": c.succeeded,
            "failed": c.failed, "cancelled": c.cancelled, "total": c.total(),
        },
        "handlers": handlers,
        "workers": api.workers_here(),
    }))
}

async fn list_queues(State(st): State<AppState>, _: Query, req: Request) -> Result<Response, JsonError> {
    let who = principal(req.extensions())?;
    let mut out = Vec::new();
    for name in st.commands.queue_names() {
        if who.can_queue(Op::Read, &name) {
            out.push(queue_json(&st.commands, &name).await?);
        }
    }
    Ok(json_response(json!({ "queues": out })))
}

async fn one_queue(State(st): State<AppState>, QueueName(queue): QueueName, _: Query) -> Result<Response, JsonError> {
    Ok(json_response(queue_json(&st.commands, &queue).await?))
}

async fn dead_letters(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    q: Query<LimitQuery>,
) -> Result<Response, JsonError> {
    let limit = limit_param(&q, 100, 1000)?;
    let items = st.commands.store().messages().dead_letters(&queue, limit).await.map_err(queue_error)?;
    let items: Vec<Value> = items
        .iter()
        .map(|d| {
            let command_id = serde_json::from_slice::<Value>(&d.payload)
                .ok()
                .and_then(|v| v.get("id").and_then(Value::as_str).map(str::to_string));
            json!({
                "id": d.id.to_string(),
                "original_id": d.original_id.to_string(),
                "payload": String::from_utf8_lossy(&d.payload),
                "command_id": command_id,
                "deliveries": d.deliveries,
                "reason": d.reason,
                "dead_lettered_at": baton_commands::Timestamp::from_millis(d.dead_lettered_at_ms).to_string(),
            })
        })
        .collect();
    Ok(json_response(json!({ "items": items })))
}

async fn replay_one(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    IdParam(id): IdParam,
    _: Query,
) -> Result<Response, JsonError> {
    let msg_id: MessageId = id.parse().map_err(|_| {
        JsonError::bad_request(
            "invalid_id",
            format!("{id:?} is not a dead-letter id; use an id from GET …/dead-letters (like 1700000000000-0)"),
        )
    })?;
    let new_id = st.commands.store().messages().replay_dead_letter(&queue, msg_id).await.map_err(queue_error)?;
    Ok(json_response(json!({ "replayed": msg_id.to_string(), "id": new_id.to_string() })))
}

async fn replay_all(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    q: Query<LimitQuery>,
) -> Result<Response, JsonError> {
    let limit = limit_param(&q, 1000, 100_000)?;
    let n = st.commands.store().messages().replay_dead_letters(&queue, limit).await.map_err(queue_error)?;
    Ok(json_response(json!({ "replayed": n })))
}

async fn purge(State(st): State<AppState>, QueueName(queue): QueueName, _: Query) -> Result<Response, JsonError> {
    let n = st.commands.store().messages().purge_dead_letters(&queue).await.map_err(queue_error)?;
    Ok(json_response(json!({ "purged": n })))
}

/// Sets the sampled queue gauges (for each configured queue, at most 2 s in all):
/// `baton_queue_length`, `baton_queue_pending`, `baton_queue_consumers`, `baton_queue_lag`,
/// `baton_queue_delayed`, `baton_queue_dead_letter_entries` (label `queue`) and
/// `baton_commands{queue,status}` (status lower case). A failed sample counts
/// `baton_queue_sample_failures_total` and leaves the previous values.
pub async fn sample_metrics(api: &CommandsApi) {
    let work = async {
        for q in api.queue_names() {
            let stats = api.store().messages().stats(&q).await;
            let counts = api.store().counts(&q).await;
            match (stats, counts) {
                (Ok(s), Ok(c)) => {
                    let g = |name: &'static str, v: u64| metrics::gauge!(name, "queue" => q.clone()).set(v as f64);
                    g("baton_queue_length", s.length);
                    g("baton_queue_pending", s.pending);
                    g("baton_queue_consumers", s.consumers);
                    g("baton_queue_lag", s.lag);
                    g("baton_queue_delayed", s.delayed);
                    g("baton_queue_dead_letter_entries", s.dead_letters);
                    for (status, v) in [
                        ("submitted", c.submitted),
                        ("running", c.running),
                        ("succeeded", c.succeeded),
                        ("failed", c.failed),
                        ("cancelled", c.cancelled),
                    ] {
                        metrics::gauge!("baton_commands", "queue" => q.clone(), "status" => status).set(v as f64);
                    }
                }
                _ => metrics::counter!("baton_queue_sample_failures_total", "queue" => q.clone()).increment(1),
            }
        }
    };
    if tokio::time::timeout(Duration::from_secs(2), work).await.is_err() {
        metrics::counter!("baton_queue_sample_failures_total", "queue" => "*").increment(1);
    }
}

/// Route layer: `baton_http_request_duration_seconds{route,method,status}` (histogram; `route`
/// is the matched template such as `/v1/commands/{id}`, never the raw path; the time is until
/// the response head, so a live read counts its wait, not its streaming). Labels are static
/// strings: no allocation per request.
pub async fn track(req: Request, next: Next) -> Response {
    let route = route_label(req.extensions().get::<MatchedPath>());
    let method = super::edge::method_label(req.method());
    let t = Instant::now();
    let res = next.run(req).await;
    let status = super::edge::status_label(res.status());
    metrics::histogram!(
        "baton_http_request_duration_seconds",
        "route" => route, "method" => method, "status" => status
    )
    .record(t.elapsed().as_secs_f64());
    res
}

/// The route template as a static string (from the route table).
fn route_label(m: Option<&MatchedPath>) -> metrics::SharedString {
    static ROUTES: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    let Some(m) = m else { return "other".into() };
    let routes = ROUTES.get_or_init(|| super::route_table().into_iter().map(|d| d.path).collect());
    match routes.iter().find(|r| **r == m.as_str()) {
        Some(r) => (*r).into(),
        None => m.as_str().to_string().into(),
    }
}

/// The HTTP face of `baton worker --listen`: `/healthz`, `/readyz` (the backend answers within
/// 3 s) and `/metrics` (with the sampled queue gauges).
pub fn worker_router(api: CommandsApi) -> axum::Router {
    let _ = super::prometheus();
    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(worker_ready))
        .route("/metrics", get(worker_metrics))
        .with_state(api)
}

async fn worker_ready(State(api): State<CommandsApi>) -> Response {
    use axum::response::IntoResponse;
    match tokio::time::timeout(Duration::from_secs(3), api.probe()).await {
        Ok(Ok(())) => "ready\n".into_response(),
        Ok(Err(e)) => (StatusCode::SERVICE_UNAVAILABLE, format!("command store not reachable: {e}\n")).into_response(),
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "command store did not answer within 3s\n").into_response(),
    }
}

async fn worker_metrics(State(api): State<CommandsApi>) -> Response {
    use axum::response::IntoResponse;
    sample_metrics(&api).await;
    match super::prometheus() {
        Some(h) => ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], h.render()).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "metrics recorder not installed\n").into_response(),
    }
}
