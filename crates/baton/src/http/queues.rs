//! Queue statistics and dead letters.
//!
//! | Route | Success | Errors |
//! |---|---|---|
//! | `GET /v1/queues` | `200` `{"queues": [queue…]}` (those the caller may read) | `503` backend |
//! | `GET /v1/queues/{queue}` | `200` queue | `404` unknown queue |
//! | `GET /v1/queues/{queue}/minutes?last=60` | `200` `{"minutes": [minute…], "bounds_ms": [bucket bound…]}`, oldest first, the current minute last | `400` bad last, `404` |
//! | `GET /v1/queues/{queue}/schedules` | `200` `{"schedules": [schedule…]}`, in configuration order | `404` |
//! | `GET /v1/queues/{queue}/dead-letters?limit=100` | `200` `{"items": [dead letter…]}`, oldest first | `400` bad limit, `404` |
//! | `POST /v1/queues/{queue}/dead-letters/{id}/replay` | `200` `{"replayed": id, "id": new id}` | `400` bad id, `404` unknown queue or dead letter |
//! | `POST /v1/queues/{queue}/dead-letters/replay?limit=1000` | `200` `{"replayed": n}` (oldest first) | `400` bad limit, `404` |
//! | `DELETE /v1/queues/{queue}/dead-letters` | `200` `{"purged": n}` | `404` |
//! | `POST /v1/queues/{queue}/pause` | `200` queue (now paused) with `"changed"`: false when it already was | `404` |
//! | `POST /v1/queues/{queue}/resume` | `200` queue (now running) with `"changed"`: false when it already was | `404` |
//!
//! Each dead-letter route takes `?of=webhook` to work on the queue's completion webhook
//! deliveries instead of its commands (`of=commands`, the default; see `crate::webhooks`): a
//! webhook dead letter's payload is the webhook body, and a replay delivers it again.
//!
//! A queue: `{"name", "paused", "paused_since" (RFC 3339 or null), "backoff_ms" (or null),
//! "rate_limit" ({"limit", "per_ms", "burst"} or null), "length", "pending",
//! "consumers", "lag", "delayed", "dead_letters",
//! "commands": {"submitted", "running", "succeeded", "failed", "cancelled", "total", "scheduled",
//! "next_due"}, "handlers": [command type…], "workers": bool}` — counts are exact at the time of
//! the call (`scheduled`: the SUBMITTED commands still waiting for their due time, `next_due`
//! the earliest of those times, RFC 3339 with ms, or null);
//! `workers` says whether this process runs the queue's workers. A dead letter: `{"id",
//! "original_id", "payload" (text), "command_id" (string or null), "deliveries", "reason",
//! "dead_lettered_at" (RFC 3339), "concurrency_key" (string or null), "priority"}` — a replay
//! offers it again with its concurrency key and priority.

use axum::extract::{Request, State};
use axum::response::Response;
use baton_commands::Timestamp;
use baton_queue::{DeadLetter, MessageId};
use serde_json::{json, Value};

use super::errors::{echo, ApiError};
use super::json::json_response;
use super::plumbing::{limit_param, principal, DeadLetterQuery, IdParam, LastQuery, OfQuery, Query, QueueName};
use super::state::{AppState, CommandsApi};
use crate::settings::Op;

/// Stats of one configured queue as JSON (module docs); also the dashboard's queue rows.
pub async fn queue_json(api: &CommandsApi, name: &str) -> Result<Value, ApiError> {
    let entry = api.queue(name)?;
    let stats = api.store().messages().stats(name).await?;
    let c = api.store().counts(name).await?;
    let sched = api.store().scheduled(name).await?;
    let handlers: Vec<&String> = entry.handlers.keys().collect();
    Ok(json!({
        "name": name,
        "paused": stats.paused,
        "paused_since": stats.paused_since_ms.map(|ms| baton_commands::Timestamp::from_millis(ms).to_string()),
        "length": stats.length,
        "pending": stats.pending,
        "consumers": stats.consumers,
        "dead_consumers": stats.dead_consumers,
        "lag": stats.lag,
        "delayed": stats.delayed,
        "dead_letters": stats.dead_letters,
        "backoff_ms": stats.backoff_ms,
        "rate_limit": entry.remote.rate_limit().map(rate_json),
        "rate_limit_per_key": entry.remote.rate_limit_per_key().map(rate_json),
        "key_waiting": stats.key_waiting,
        "key_rate_delayed": stats.key_rate_delayed,
        "keys": stats.keys.iter().map(|k| json!({
            "key": k.key, "active": k.active, "waiting": k.waiting, "rate_delayed": k.rate_delayed,
        })).collect::<Vec<_>>(),
        "commands": {
            "submitted": c.submitted, "running": c.running, "succeeded": c.succeeded,
            "failed": c.failed, "cancelled": c.cancelled, "total": c.total(),
            "scheduled": sched.scheduled, "next_due": sched.next_due,
        },
        "handlers": handlers,
        "workers": api.workers_here() && !entry.handlers.is_empty(),
    }))
}

/// A configured rate limit as JSON: `{"limit", "per_ms", "burst"}`.
fn rate_json(r: baton_queue::RateLimit) -> Value {
    json!({ "limit": r.limit, "per_ms": r.per.as_millis() as u64, "burst": r.burst })
}

pub async fn list_queues(State(st): State<AppState>, _: Query, req: Request) -> Result<Response, ApiError> {
    let who = principal(req.extensions())?;
    let mut out = Vec::new();
    for name in st.commands.queue_names() {
        if who.can_queue(Op::Read, &name) {
            out.push(queue_json(&st.commands, &name).await?);
        }
    }
    Ok(json_response(json!({ "queues": out })))
}

pub async fn one_queue(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    _: Query,
) -> Result<Response, ApiError> {
    Ok(json_response(queue_json(&st.commands, &queue).await?))
}

/// `POST /v1/queues/{queue}/pause`: no worker starts a new command of the queue until it is
/// resumed ([`baton_commands::CommandStore::pause`]); answers the queue.
pub async fn pause(State(st): State<AppState>, QueueName(queue): QueueName, _: Query) -> Result<Response, ApiError> {
    set_paused(&st, &queue, true).await
}

/// `POST /v1/queues/{queue}/resume`: the queue's waiting commands start again; answers the queue.
pub async fn resume(State(st): State<AppState>, QueueName(queue): QueueName, _: Query) -> Result<Response, ApiError> {
    set_paused(&st, &queue, false).await
}

async fn set_paused(st: &AppState, queue: &str, paused: bool) -> Result<Response, ApiError> {
    st.commands.queue(queue)?;
    let store = st.commands.store();
    let changed = if paused { store.pause(queue).await? } else { store.resume(queue).await? };
    if changed {
        tracing::info!(queue = %queue, paused, "queue {}", if paused { "paused" } else { "resumed" });
    }
    let mut body = queue_json(&st.commands, queue).await?;
    body["changed"] = Value::Bool(changed);
    Ok(json_response(body))
}

/// `GET /v1/queues/{queue}/workers`: its workers (the consumers of its group), live and dead,
/// with the commands they hold.
pub async fn workers(State(st): State<AppState>, QueueName(queue): QueueName, _: Query) -> Result<Response, ApiError> {
    let workers = st.commands.store().workers(&queue).await?;
    let alive = workers.iter().filter(|w| w.alive).count();
    Ok(json_response(json!({ "workers": workers, "alive": alive, "dead": workers.len() - alive })))
}

/// `GET /v1/queues/{queue}/schedules`: the queue's cron schedules as configured on this server,
/// each with its shared record: the next due time (by this server's clock, after the last
/// decided one) and the last decision (`last_fire`, null before the first).
pub async fn schedules(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    _: Query,
) -> Result<Response, ApiError> {
    let entry = st.commands.queue(&queue)?;
    let store = st.commands.store();
    let now = Timestamp::now().millis() as i64;
    let mut out = Vec::new();
    for s in &entry.schedules {
        let rec = store.schedule_record(&queue, s.name()).await?;
        let after = rec.as_ref().map_or(now, |r| r.cursor_ms.max(now));
        let ts = |ms: i64| Timestamp::from_millis(ms.max(0) as u64);
        let last = rec.as_ref().and_then(|r| r.last.as_ref()).map(|l| {
            json!({
                "due": ts(l.due_ms),
                "command_id": l.command_id,
                "result": l.result.as_str(),
                "decided_at": ts(l.decided_ms),
            })
        });
        out.push(json!({
            "name": s.name(),
            "cron": s.cron(),
            "timezone": s.timezone(),
            "type": s.command_type(),
            "params": s.params(),
            "overlap": s.overlap().as_str(),
            "missed": s.missed().as_str(),
            "max_catch_up": s.max_catch_up(),
            "missed_after_ms": u64::try_from(s.missed_after().as_millis()).unwrap_or(u64::MAX),
            "next_due": s.next_due_after(after).map(ts),
            "last_fire": last,
            "last_command": rec.as_ref().and_then(|r| r.last_command.clone()),
            "pending": rec.as_ref().is_some_and(|r| r.pending),
            "missed_total": rec.as_ref().map_or(0, |r| r.missed_total),
        }));
    }
    Ok(json_response(json!({ "schedules": out })))
}

/// The work queue whose dead letters a request means (`?of=`, module docs).
async fn dead_of<'a>(st: &'a AppState, of: Option<&String>) -> Result<&'a baton_queue::MessageStream, ApiError> {
    match of.map(String::as_str) {
        None | Some("commands") => Ok(st.commands.store().messages()),
        Some("webhook") => Ok(st.commands.store().hooks().await?),
        Some(other) => Err(ApiError::invalid(
            "invalid_query",
            format!("of={} is neither commands (the default) nor webhook", echo(other)),
        )),
    }
}

/// `GET /v1/queues/{queue}/minutes?last=60`: the queue's per-minute aggregates
/// ([`baton_commands::minutes`]), oldest first, with the duration buckets' bounds.
pub async fn minutes(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    q: Query<LastQuery>,
) -> Result<Response, ApiError> {
    let max = baton_commands::minutes::MINUTES_KEPT;
    let last = match q.get("last") {
        None => 60,
        Some(s) => match s.trim().parse::<usize>() {
            Ok(n) if (1..=max).contains(&n) => n,
            _ => {
                return Err(ApiError::invalid(
                    "invalid_last",
                    format!("last must be a number of minutes from 1 to {max}; got {}", echo(s)),
                ))
            }
        },
    };
    let minutes = st.commands.store().minutes(&queue, last).await?;
    Ok(json_response(json!({ "minutes": minutes, "bounds_ms": baton_commands::minutes::BOUNDS_MS })))
}

pub async fn dead_letters(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    q: Query<DeadLetterQuery>,
) -> Result<Response, ApiError> {
    let limit = limit_param(&q, 100, 1000)?;
    let items = dead_of(&st, q.get("of")).await?.dead_letters(&queue, limit).await?;
    let items: Vec<Value> = items.iter().map(dead_letter_json).collect();
    Ok(json_response(json!({ "items": items })))
}

pub async fn replay_one(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    IdParam(id): IdParam,
    q: Query<OfQuery>,
) -> Result<Response, ApiError> {
    let msg_id: MessageId = id.parse().map_err(|_| {
        ApiError::invalid(
            "invalid_id",
            format!("{} is not a dead-letter id; use an id from GET …/dead-letters (like 1700000000000-0)", echo(&id)),
        )
    })?;
    let new_id = dead_of(&st, q.get("of")).await?.replay_dead_letter(&queue, msg_id).await?;
    Ok(json_response(json!({ "replayed": msg_id.to_string(), "id": new_id.to_string() })))
}

pub async fn replay_all(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    q: Query<DeadLetterQuery>,
) -> Result<Response, ApiError> {
    let limit = limit_param(&q, 1000, 100_000)?;
    let n = dead_of(&st, q.get("of")).await?.replay_dead_letters(&queue, limit).await?;
    Ok(json_response(json!({ "replayed": n })))
}

pub async fn purge(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    q: Query<OfQuery>,
) -> Result<Response, ApiError> {
    let n = dead_of(&st, q.get("of")).await?.purge_dead_letters(&queue).await?;
    Ok(json_response(json!({ "purged": n })))
}

/// A dead letter as JSON (module docs); also the dashboard's, with its queue added.
pub fn dead_letter_json(d: &DeadLetter) -> Value {
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
        "concurrency_key": d.concurrency_key,
        "priority": d.priority,
    })
}
