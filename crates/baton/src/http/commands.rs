//! The command API (JSON). Errors are `{"error": "<code>", "message": "<what to fix>"}` with the
//! status below (a refused cancel also carries `"state"`).
//!
//! | Route | Success | Errors |
//! |---|---|---|
//! | `POST /v1/queues/{queue}/commands` body `{"id"?: string, "type": string, "params"?: any, "output"?: true \| {"path"?, "content_type"?, "silence_timeout"?}, "run_at"?: RFC 3339, "delay"?: "30s" \| ms, "concurrency_key"?: string, "priority"?: integer -10..=10}` | `202` + state (new), `200` + state (same id, body, output and due time) | `400` bad JSON / body shape / id / type / params / output / run_at / delay (both given) / concurrency_key (not a string of 1 – 256 bytes), `403` an output stream the token may not write, `404` unknown queue, `409` same id with another body or output, `413` body over `max_command_body` |
//! | `GET /v1/commands/{id}?wait=30s` | `200` + state (after at most `wait`, earlier once terminal) | `400` bad id or wait, `404` unknown id, `503` all live-reader slots taken (a wait holds one) |
//! | `POST /v1/commands/{id}/cancel` | `200` + state (`CANCELLED`) | `400` bad id, `404` unknown id, `409` already terminal (with `state`) |
//! | `POST /v1/commands/{id}/schedule` body `{"run_at": RFC 3339}` or `{"delay": "30s" \| ms}` | `200` + state (new `run_at`) | `400` bad body, `404` unknown id, `409` not waiting for a due time (`not_scheduled`, with `state`) |
//! | `POST /v1/commands/{id}/retry` | `200` + state (`SUBMITTED` again) | `400` bad id, `404` unknown id, `409` not FAILED or CANCELLED (`not_retryable`, with `state`) |
//! | `GET /v1/queues/{queue}/commands?status=&type=&id_prefix=&created_after=&created_before=&scheduled=&cursor=&limit=` | `200` `{"items": [state…], "next_cursor": string\|null}`, newest first (`scheduled=true`: only scheduled commands still waiting for their due time; `false`: the others) | `400` bad status / cursor / limit / time / scheduled, `404` unknown queue |
//!
//! A state is the command service's JSON (`id, queue, type, params, status, result, error,
//! attempts, errors_count, created_at, started_at, modified_at, completed_at, version,
//! handed_off_to`, and `output` `{stream, url, run, content_type, …}` for a command submitted with
//! one; times RFC 3339 UTC with milliseconds). `params` come back exactly as
//! submitted (byte for byte: numbers of any size and precision, escapes, key order) and `result`
//! exactly as the handler wrote it. Backend failures are `503` with
//! `Retry-After: 1`. Queue statistics and dead letters are in [`super::queues`], the routes in
//! [`super::routes`].

use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use std::collections::BTreeMap;

use baton_commands::{
    validate_id, Command, CommandError, CommandState, CommandStore, ListQuery, OutputSpec, RawJson, Timestamp,
};
use serde_json::value::RawValue;
use serde_json::Value;

use super::errors::{echo, ApiError};
use super::json::{kind_of, serialized_response};
use super::plumbing::{
    limit_param, principal, read_body, status_param, BodyLimit, IdParam, ListQueryParams, Query, QueueName, WaitQuery,
};
use super::state::{AppState, QueueEntry};
use crate::settings::Op;

/// Longest `?wait=` of `GET /v1/commands/{id}`.
pub const MAX_WAIT: Duration = Duration::from_secs(300);

/// The body rules of a submit: `max_command_body`.
fn body_limit(limit: usize) -> BodyLimit {
    BodyLimit {
        limit,
        too_large: |n, limit| {
            format!(
                "request body is {n} bytes; commands take at most {limit} bytes (max_command_body); keep large data elsewhere and pass a reference in params"
            )
        },
        unreadable: "invalid_body",
    }
}

const SUBMIT_SHAPE: &str = "{\"type\": \"echo\", \"params\": {…}} (optional \"id\": a string)";

/// Decodes a submit body into a command; `params` keep their text byte for byte. Errors say what
/// to fix (module docs).
pub fn parse_submit(body: &[u8]) -> Result<Command, ApiError> {
    // The body's fields as their JSON text (a key given twice: the last, as a `Value` reads it).
    let Ok(mut m) = serde_json::from_slice::<BTreeMap<String, &RawValue>>(body) else {
        return Err(body_error(body));
    };
    if let Some(k) = m.keys().find(|k| {
        !matches!(k.as_str(), "id" | "type" | "params" | "output" | "run_at" | "delay" | "concurrency_key" | "priority")
    }) {
        return Err(ApiError::invalid(
            "invalid_body",
            format!(
                "unknown field {}; a command body has only id, type, params, output, run_at, delay, concurrency_key and priority",
                echo(k)
            ),
        ));
    }
    let field = |raw: Option<&RawValue>| -> Result<Option<Value>, ApiError> {
        raw.map(|r| serde_json::from_str::<Value>(r.get()).map_err(|_| body_error(body))).transpose()
    };
    let command_type = match field(m.remove("type"))? {
        Some(Value::String(t)) => t,
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("invalid_body", format!("missing field \"type\"; send {SUBMIT_SHAPE}")))
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "invalid_body",
                format!("\"type\" must be a string naming a handler; got {}", kind_of(&other)),
            ))
        }
    };
    let params = m.remove("params").map(|r| RawJson::from(r.to_owned())).unwrap_or_default();
    let output = output_spec(field(m.remove("output"))?)?;
    let due = parse_due(field(m.remove("run_at"))?, field(m.remove("delay"))?, false)?;
    let command = match field(m.remove("id"))? {
        None | Some(Value::Null) => Command::new(command_type, params),
        Some(Value::String(id)) => Command::with_id(id, command_type, params),
        Some(other) => {
            return Err(ApiError::invalid(
                "invalid_body",
                format!("\"id\" must be a string (1 to 200 bytes, no braces or whitespace); got {}", kind_of(&other)),
            ))
        }
    };
    let command = match due {
        Some(Due::At(at)) => command.with_run_at(at),
        Some(Due::After(d)) => command.with_delay(d),
        None => command,
    };
    let command = match field(m.remove("concurrency_key"))? {
        None | Some(Value::Null) => command,
        Some(Value::String(k)) => {
            baton_queue::validate_concurrency_key(&k).map_err(|_| {
                ApiError::invalid(
                    "invalid_body",
                    format!(
                        "\"concurrency_key\" must be 1 to {} bytes without control characters; got {} bytes",
                        baton_queue::MAX_CONCURRENCY_KEY_LEN,
                        k.len()
                    ),
                )
            })?;
            command.with_concurrency_key(k)
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "invalid_body",
                format!("\"concurrency_key\" must be a string (1 to 256 bytes); got {}", kind_of(&other)),
            ))
        }
    };
    let command = match field(m.remove("priority"))? {
        None | Some(Value::Null) => command,
        Some(Value::Number(n))
            if n.as_i64().is_some_and(|p| {
                (baton_queue::MIN_PRIORITY as i64..=baton_queue::MAX_PRIORITY as i64).contains(&p)
            }) =>
        {
            command.with_priority(n.as_i64().unwrap_or_default() as i8)
        }
        Some(other) => {
            let got = match &other {
                Value::Number(n) => n.to_string(),
                v => kind_of(v).to_string(),
            };
            return Err(ApiError::invalid(
                "invalid_body",
                format!(
                    "\"priority\" must be an integer from {} to {}; got {got}",
                    baton_queue::MIN_PRIORITY,
                    baton_queue::MAX_PRIORITY
                ),
            ));
        }
    };
    Ok(match output {
        Some(spec) => command.with_output(spec),
        None => command,
    })
}

/// When a scheduled command is due: the body's `run_at` or `delay`.
#[derive(Debug, PartialEq)]
pub enum Due {
    /// `run_at`: an RFC 3339 time.
    At(std::time::SystemTime),
    /// `delay`: from now.
    After(Duration),
}

/// The body's `run_at` (an RFC 3339 time, e.g. `"2025-01-31T12:00:00Z"`) or `delay` (a duration
/// like `"30s"`, `"1m"`, `"500ms"`, or a number of milliseconds), at most one of them
/// (`required`: exactly one). Errors: `invalid_body` naming the field and what to send.
pub fn parse_due(run_at: Option<Value>, delay: Option<Value>, required: bool) -> Result<Option<Due>, ApiError> {
    let bad = |f: &str, why: String| ApiError::invalid("invalid_body", format!("\"{f}\" {why}"));
    let run_at = run_at.filter(|v| !v.is_null());
    let delay = delay.filter(|v| !v.is_null());
    match (run_at, delay) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "invalid_body",
            "give \"run_at\" (an RFC 3339 time) or \"delay\" (a duration like \"30s\"), not both".to_string(),
        )),
        (None, None) if required => Err(ApiError::invalid(
            "invalid_body",
            "missing \"run_at\" (an RFC 3339 time like \"2025-01-31T12:00:00Z\") or \"delay\" (a duration like \"30s\", or ms)"
                .to_string(),
        )),
        (None, None) => Ok(None),
        (Some(Value::String(t)), None) => time::OffsetDateTime::parse(t.trim(), &time::format_description::well_known::Rfc3339)
            .map(|at| Some(Due::At(at.into())))
            .map_err(|e| bad("run_at", format!("{}: {e}; send an RFC 3339 time like \"2025-01-31T12:00:00Z\"", echo(&t)))),
        (Some(other), None) => {
            Err(bad("run_at", format!("must be an RFC 3339 time like \"2025-01-31T12:00:00Z\"; got {}", kind_of(&other))))
        }
        (None, Some(Value::String(d))) => humantime::parse_duration(d.trim())
            .map_err(|e| bad("delay", format!("{}: {e}; send a duration like \"30s\", \"1m\" or \"500ms\"", echo(&d))))
            .and_then(|after| within_schedule_max(after, echo(&d))),
        (None, Some(Value::Number(n))) => match n.as_u64() {
            Some(ms) => within_schedule_max(Duration::from_millis(ms), format!("{n} ms")),
            None => Err(bad("delay", format!("{n} is not a whole number of milliseconds (0 or more)"))),
        },
        (None, Some(other)) => Err(bad(
            "delay",
            format!("must be a duration like \"30s\" or a number of milliseconds; got {}", kind_of(&other)),
        )),
    }
}

/// A `delay` no longer than [`CommandStore::SCHEDULE_MAX`] (its error names the field; a longer
/// one would only be refused later as a due time too far ahead, or overflow the clock).
fn within_schedule_max(after: Duration, shown: String) -> Result<Option<Due>, ApiError> {
    if after > CommandStore::SCHEDULE_MAX {
        return Err(ApiError::invalid(
            "invalid_body",
            format!(
                "\"delay\" {shown} is more than {} days; schedule at most that far ahead",
                CommandStore::SCHEDULE_MAX.as_secs() / 86_400
            ),
        ));
    }
    Ok(Some(Due::After(after)))
}

/// Longest `silence_timeout` of a submit's `output`.
pub const MAX_SILENCE_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

const OUTPUT_SHAPE: &str =
    "true, or {\"path\"?: \"a/stream/path\", \"content_type\"?: \"application/json\", \"silence_timeout\"?: \"60s\"}";

/// The submit body's `output`: `true` or an object asks for an output stream, `false` or `null`
/// (or no field) for none. Errors (`invalid_body`) say which part to fix: another kind of
/// value, an unknown field, a path that is not a stream path, a content type that cannot be a
/// header, a silence timeout that is not a positive duration.
fn output_spec(v: Option<Value>) -> Result<Option<OutputSpec>, ApiError> {
    let bad = |why: String| ApiError::invalid("invalid_body", format!("\"output\" must be {OUTPUT_SHAPE}; {why}"));
    let mut o = match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => return Ok(None),
        Some(Value::Bool(true)) => return Ok(Some(OutputSpec::default())),
        Some(Value::Object(o)) => o,
        Some(other) => return Err(bad(format!("got {}", kind_of(&other)))),
    };
    let mut text = |k: &str| -> Result<Option<String>, ApiError> {
        match o.remove(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(bad(format!("\"{k}\" must be a string; got {}", kind_of(&other)))),
        }
    };
    let path = text("path")?;
    if let Some(p) = &path {
        baton_streams::StreamPath::new(p).map_err(|e| bad(format!("\"path\" {}: {e}", echo(p))))?;
    }
    let content_type = text("content_type")?;
    if let Some(ct) = &content_type {
        if ct.trim().is_empty() || ct.parse::<HeaderValue>().is_err() {
            return Err(bad(format!("\"content_type\" {} is not a media type like text/plain", echo(ct))));
        }
    }
    let silence = text("silence_timeout")?;
    if let Some(k) = o.keys().next() {
        return Err(bad(format!("unknown field {}", echo(k))));
    }
    let silence_timeout = match silence {
        None => None,
        Some(s) => {
            let d = humantime::parse_duration(s.trim())
                .map_err(|e| bad(format!("\"silence_timeout\" {}: {e}", echo(&s))))?;
            if d < Duration::from_millis(1) {
                return Err(bad(format!(
                    "\"silence_timeout\" {} would end the stream at once; give a duration of at least 1ms",
                    echo(&s)
                )));
            }
            if d > MAX_SILENCE_TIMEOUT {
                return Err(bad(format!("\"silence_timeout\" {} is over the most, 365d", echo(&s))));
            }
            Some(d)
        }
    };
    Ok(Some(OutputSpec { path, content_type, silence_timeout }))
}

/// The error of a body that is not a JSON object of fields: invalid JSON (as serde_json names
/// it), or what the body is instead of an object.
fn body_error(body: &[u8]) -> ApiError {
    match serde_json::from_slice::<Value>(body) {
        Err(e) => {
            ApiError::invalid("invalid_json", format!("request body is not valid JSON ({e}); send {SUBMIT_SHAPE}"))
        }
        Ok(v) => ApiError::invalid(
            "invalid_body",
            format!("request body must be a JSON object like {SUBMIT_SHAPE}; got {}", kind_of(&v)),
        ),
    }
}

pub async fn submit(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    q: Query<WaitQuery>,
    req: Request,
) -> Result<Response, ApiError> {
    let wait = q.get("wait").map(|s| parse_wait(s)).transpose()?.filter(|d| !d.is_zero());
    let api = &st.commands;
    let entry = api.queue(&queue)?;
    let (parts, body) = req.into_parts();
    let body = read_body(body, &parts.headers, &body_limit(api.max_body())).await?;
    let command = check_submit(entry, &queue, &parts, &body)?;
    // A held request is a live reader (bounded by --max-live-readers like GET …?wait=): its
    // slot is taken before anything is stored, so a refusal stores nothing.
    let permit = wait.map(|_| st.live_permit()).transpose()?;
    let (mut state, created) = api.store().submit_created(&queue, command).await?;
    if let (Some(d), Some(_permit)) = (wait, permit) {
        if !state.status.is_terminal() {
            let store = api.store();
            state = tokio::select! {
                r = store.wait(&state.id, d) => r?,
                _ = st.shutdown.cancelled() => store.get(&state.id).await?.unwrap_or(state),
            };
        }
    }
    let mut res = serialized_response(&state);
    if created {
        *res.status_mut() = StatusCode::ACCEPTED;
        metrics::counter!("baton_commands_submitted_total", "queue" => queue.clone()).increment(1);
    }
    if let Ok(loc) = HeaderValue::from_str(&format!("/v1/commands/{}", urlencode(&state.id))) {
        res.headers_mut().insert(header::LOCATION, loc);
    }
    Ok(res)
}

/// The checks of one submit body before anything is stored, the same for a submit alone and
/// for each item of a batch: its shape ([`parse_submit`]), its id, a type the queue has a
/// handler for (`400 unknown_type`) with params that handler accepts (`400 invalid_params`),
/// and write access to the output stream it asks for (`403`). The request's W3C trace context
/// goes with the command (docs/operations.md, "Tracing").
fn check_submit(entry: &QueueEntry, queue: &str, parts: &Parts, body: &[u8]) -> Result<Command, ApiError> {
    let mut command = parse_submit(body)?;
    validate_id(&command.id)?;
    if let Some(cx) = super::headers::trace_context(&parts.headers) {
        command = command.with_trace_context(cx);
    }
    if !entry.handlers.is_empty() {
        let Some(h) = entry.handlers.get(&command.command_type) else {
            let types: Vec<&str> = entry.handlers.keys().map(String::as_str).collect();
            return Err(ApiError::invalid(
                "unknown_type",
                format!(
                    "queue {queue:?} has no handler for type {}; use one of {}",
                    echo(&command.command_type),
                    types.join(", ")
                ),
            ));
        };
        h.validate(&command.params).map_err(|e| ApiError::invalid("invalid_params", format!("invalid params: {e}")))?;
    }
    if let Some(spec) = command.output_spec() {
        // The command creates its output stream: the caller must be allowed to write it.
        let who = principal(&parts.extensions)?;
        who.check_stream(Op::Write, &spec.stream_for(&command.id)).map_err(ApiError::forbidden)?;
    }
    Ok(command)
}

/// The most commands of one `POST /v1/queues/{queue}/commands/batch`.
pub const MAX_BATCH: usize = 1000;

/// The largest batch body, in bytes: 16 MiB, or `max_command_body` when that is larger (so one
/// command of the largest size always fits). Each item is also held to `max_command_body`, as
/// a submit alone (`413 body_too_large` for that item).
pub const MAX_BATCH_BODY: usize = 16 << 20;

/// The body rules of a batch: [`MAX_BATCH_BODY`].
fn batch_body_limit(max_command_body: usize) -> BodyLimit {
    BodyLimit {
        limit: MAX_BATCH_BODY.max(max_command_body),
        too_large: |n, limit| {
            format!(
                "request body is {n} bytes; a batch takes at most {limit} bytes; send the commands in smaller batches"
            )
        },
        unreadable: "invalid_body",
    }
}

const BATCH_SHAPE: &str = "{\"commands\": [{\"type\": \"echo\", \"params\": {…}}, …]}";

/// The items of a batch body `{"commands": [item, …]}`, each as its JSON text (1 to
/// [`MAX_BATCH`] of them). Errors (the whole request): `invalid_json`, `invalid_body`.
fn parse_batch(body: &[u8]) -> Result<Vec<&RawValue>, ApiError> {
    let bad = |why: String| ApiError::invalid("invalid_body", format!("{why}; send {BATCH_SHAPE}"));
    let Ok(m) = serde_json::from_slice::<BTreeMap<&str, &RawValue>>(body) else {
        return Err(match serde_json::from_slice::<Value>(body) {
            Err(e) => {
                ApiError::invalid("invalid_json", format!("request body is not valid JSON ({e}); send {BATCH_SHAPE}"))
            }
            Ok(v) => bad(format!("request body must be a JSON object; got {}", kind_of(&v))),
        });
    };
    if let Some(k) = m.keys().find(|k| **k != "commands") {
        return Err(bad(format!("unknown field {}; a batch body has only \"commands\"", echo(k))));
    }
    let Some(commands) = m.get("commands") else {
        return Err(bad("missing field \"commands\"".to_string()));
    };
    let Ok(items) = serde_json::from_str::<Vec<&RawValue>>(commands.get()) else {
        let v: Value = serde_json::from_str(commands.get()).unwrap_or(Value::Null);
        return Err(bad(format!("\"commands\" must be an array of submit bodies; got {}", kind_of(&v))));
    };
    if items.is_empty() {
        return Err(bad(format!("\"commands\" is empty; give 1 to {MAX_BATCH} submit bodies")));
    }
    if items.len() > MAX_BATCH {
        return Err(bad(format!(
            "\"commands\" has {} items; a batch takes at most {MAX_BATCH}: send the rest in another request",
            items.len()
        )));
    }
    Ok(items)
}

/// `POST /v1/queues/{queue}/commands/batch` body `{"commands": [submit body, …]}`: each item
/// submitted as `POST /v1/queues/{queue}/commands` would submit it alone (same checks, same
/// outcome), all of them with one [`CommandStore::submit_many`]. The answer (`200`) is
/// `{"results": [item, …]}` in the order of the items: `{"status": 202 (created) or 200 (stored
/// already, same body), "state": state}`, or the error the item would get alone as
/// `{"status", "error", "message", …}` ([`ApiError::item_json`]). No `?wait=`.
pub async fn batch(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    _: Query,
    req: Request,
) -> Result<Response, ApiError> {
    let api = &st.commands;
    let entry = api.queue(&queue)?;
    let (parts, body) = req.into_parts();
    let body = read_body(body, &parts.headers, &batch_body_limit(api.max_body())).await?;
    let items = parse_batch(&body)?;
    let one = body_limit(api.max_body());
    // Each item checked as a submit alone; those that pass are stored together.
    let checked: Vec<Result<Command, ApiError>> = items
        .iter()
        .map(|raw| {
            let text = raw.get().as_bytes();
            if text.len() > one.limit {
                return Err(ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body_too_large",
                    (one.too_large)(&text.len().to_string(), one.limit),
                ));
            }
            check_submit(entry, &queue, &parts, text)
        })
        .collect();
    let mut commands = Vec::with_capacity(checked.len());
    let mut results: Vec<Option<Result<(CommandState, bool), ApiError>>> = Vec::with_capacity(checked.len());
    for c in checked {
        match c {
            Ok(c) => {
                commands.push(c);
                results.push(None);
            }
            Err(e) => results.push(Some(Err(e))),
        }
    }
    let mut stored = api.store().submit_many(&queue, commands).await.into_iter();
    let mut text = String::from("{\"results\":[");
    let mut created_n = 0u64;
    for (i, r) in results.into_iter().enumerate() {
        let r = r.unwrap_or_else(|| match stored.next() {
            Some(outcome) => outcome.map_err(ApiError::from),
            None => Err(CommandError::Corrupt {
                id: String::new(),
                reason: "the batch submit returned fewer outcomes than commands".into(),
            }
            .into()),
        });
        if i > 0 {
            text.push(',');
        }
        match r {
            Ok((state, created)) => {
                created_n += u64::from(created);
                let status = if created { 202 } else { 200 };
                let state = serde_json::to_string(&state).unwrap_or_else(|_| "null".into());
                text.push_str(&format!("{{\"status\":{status},\"state\":{state}}}"));
            }
            Err(e) => text.push_str(&e.item_json()),
        }
    }
    text.push_str("]}");
    if created_n > 0 {
        metrics::counter!("baton_commands_submitted_total", "queue" => queue.clone()).increment(created_n);
    }
    Ok(([(header::CONTENT_TYPE, "application/json")], text).into_response())
}

fn urlencode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>().replace('+', "%20")
}

/// Parses `?wait=`: a human duration up to [`MAX_WAIT`].
pub fn parse_wait(s: &str) -> Result<Duration, ApiError> {
    let bad = |why: String| {
        ApiError::invalid(
            "invalid_wait",
            format!(
                "wait must be a duration like 30s, 500ms or 2m, at most {}; {why}",
                humantime::format_duration(MAX_WAIT)
            ),
        )
    };
    let d = humantime::parse_duration(s.trim()).map_err(|e| bad(format!("{}: {e}", echo(s))))?;
    if d > MAX_WAIT {
        return Err(bad(format!("got {}", echo(s))));
    }
    Ok(d)
}

pub async fn get_command(
    State(st): State<AppState>,
    IdParam(id): IdParam,
    q: Query<WaitQuery>,
    req: Request,
) -> Result<Response, ApiError> {
    let wait = q.get("wait").map(|s| parse_wait(s)).transpose()?;
    validate_id(&id)?;
    let who = principal(req.extensions())?;
    let store = st.commands.store();
    let state = store.get(&id).await?.ok_or_else(|| CommandError::NotFound(id.clone()))?;
    who.check_queue(Op::Read, &state.queue).map_err(ApiError::forbidden)?;
    let state = match wait {
        Some(d) if !d.is_zero() && !state.status.is_terminal() => {
            // A held request is a live reader: bounded by --max-live-readers like long-polls.
            let _permit = st.live_permit()?;
            tokio::select! {
                r = store.wait(&id, d) => r?,
                _ = st.shutdown.cancelled() => store.get(&id).await?.unwrap_or(state),
            }
        }
        _ => state,
    };
    Ok(serialized_response(&state))
}

pub async fn cancel(
    State(st): State<AppState>,
    IdParam(id): IdParam,
    _: Query,
    req: Request,
) -> Result<Response, ApiError> {
    let who = principal(req.extensions())?;
    let state = act(&st, &id, who, |store, id| Box::pin(store.cancel(id))).await?;
    metrics::counter!("baton_commands_cancelled_total", "queue" => state.queue.clone()).increment(1);
    Ok(serialized_response(&state))
}

/// `POST /v1/commands/{id}/retry`: re-runs a FAILED or CANCELLED command (write access to its
/// home queue, as a cancel).
pub async fn retry(
    State(st): State<AppState>,
    IdParam(id): IdParam,
    _: Query,
    req: Request,
) -> Result<Response, ApiError> {
    let who = principal(req.extensions())?;
    let state = act(&st, &id, who, |store, id| Box::pin(store.retry(id))).await?;
    metrics::counter!("baton_commands_retried_total", "queue" => state.queue.clone()).increment(1);
    Ok(serialized_response(&state))
}

/// `POST /v1/commands/{id}/schedule` body `{"run_at": "…"}` or `{"delay": "30s"}`: moves the due
/// time of a scheduled command still waiting for it (write access to its home queue, as a
/// cancel).
pub async fn reschedule(
    State(st): State<AppState>,
    IdParam(id): IdParam,
    _: Query,
    req: Request,
) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let body = read_body(body, &parts.headers, &body_limit(st.commands.max_body())).await?;
    const SHAPE: &str = "{\"run_at\": \"2025-01-31T12:00:00Z\"} or {\"delay\": \"30s\"}";
    let Ok(mut m) = serde_json::from_slice::<serde_json::Map<String, Value>>(&body) else {
        return Err(ApiError::invalid("invalid_body", format!("request body must be a JSON object like {SHAPE}")));
    };
    if let Some(k) = m.keys().find(|k| !matches!(k.as_str(), "run_at" | "delay")) {
        return Err(ApiError::invalid("invalid_body", format!("unknown field {}; send {SHAPE}", echo(k))));
    }
    let at = match parse_due(m.remove("run_at"), m.remove("delay"), true)? {
        Some(Due::At(at)) => at,
        Some(Due::After(d)) => baton_commands::due_after(d),
        None => unreachable!("required"),
    };
    let who = principal(&parts.extensions)?;
    let state = act(&st, &id, who, move |store, id| Box::pin(store.reschedule(id, at))).await?;
    Ok(serialized_response(&state))
}

type Acted<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<CommandState, CommandError>> + Send + 'a>>;

/// An operation on one command (cancel, retry) by a caller with write access to its home queue.
async fn act(
    st: &AppState,
    id: &str,
    who: crate::auth::Principal,
    op: impl for<'a> FnOnce(&'a CommandStore, &'a str) -> Acted<'a>,
) -> Result<CommandState, ApiError> {
    validate_id(id)?;
    let store = st.commands.store();
    let state = store.get(id).await?.ok_or_else(|| CommandError::NotFound(id.to_string()))?;
    who.check_queue(Op::Write, &state.queue).map_err(ApiError::forbidden)?;
    Ok(op(store, id).await?)
}

/// The body of `POST /v1/queues/{queue}/commands/bulk`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkBody {
    action: baton_commands::BulkAction,
    #[serde(default)]
    dry_run: bool,
    #[serde(default)]
    max: usize,
    status: Option<String>,
    #[serde(rename = "type")]
    command_type: Option<String>,
    id_prefix: Option<String>,
    created_after: Option<String>,
    created_before: Option<String>,
    cursor: Option<String>,
}

/// `POST /v1/queues/{queue}/commands/bulk`: cancel or re-run the queue's commands a filter
/// selects (or, with `dry_run`, count them): [`CommandStore::bulk`].
pub async fn bulk(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    _: Query,
    req: Request,
) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let body = read_body(body, &parts.headers, &body_limit(st.commands.max_body())).await?;
    let b: BulkBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid(
            "invalid_body",
            format!("{e}; a bulk body is {{\"action\": \"cancel\" or \"retry\", and optionally \"dry_run\", \"max\" (1 to 10000), \"status\", \"type\", \"id_prefix\", \"created_after\", \"created_before\", \"cursor\"}}"),
        )
    })?;
    if b.max > CommandStore::BULK_MAX {
        return Err(ApiError::invalid("invalid_body", format!("max {} is above {}", b.max, CommandStore::BULK_MAX)));
    }
    let mut filters = std::collections::BTreeMap::new();
    for (k, v) in [("status", &b.status), ("created_after", &b.created_after), ("created_before", &b.created_before)] {
        if let Some(v) = v {
            filters.insert(k.to_string(), v.clone());
        }
    }
    let query = ListQuery {
        status: status_param(&filters)?,
        limit: 0,
        cursor: b.cursor.filter(|c| !c.is_empty()),
        command_type: b.command_type.filter(|t| !t.is_empty()),
        id_prefix: b.id_prefix.filter(|p| !p.is_empty()),
        created_after: time_param(&filters, "created_after")?,
        created_before: time_param(&filters, "created_before")?,
        scheduled: None,
    };
    let report = st.commands.store().bulk(&queue, b.action, query, b.dry_run, b.max).await?;
    Ok(serialized_response(&report))
}

/// A `true` / `false` filter of a list query (`scheduled`); empty or absent: none.
fn bool_param(q: &std::collections::BTreeMap<String, String>, name: &str) -> Result<Option<bool>, ApiError> {
    match q.get(name).map(|s| s.trim()).filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some("true") => Ok(Some(true)),
        Some("false") => Ok(Some(false)),
        Some(v) => Err(ApiError::invalid("invalid_query", format!("{name} must be true or false, not {}", echo(v)))),
    }
}

/// An RFC 3339 time of a list query (`created_after`, `created_before`).
fn time_param(q: &std::collections::BTreeMap<String, String>, name: &str) -> Result<Option<Timestamp>, ApiError> {
    match q.get(name).map(|s| s.trim()).filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(s) => {
            let bad = || {
                ApiError::invalid(
                    "invalid_query",
                    format!(
                        "{name} {} is not an RFC 3339 time such as 2026-12-04T10:00:00Z or 2026-12-04T11:00:00+01:00 (a + in a URL is written %2B)",
                        echo(s)
                    ),
                )
            };
            let t =
                time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).map_err(|_| bad())?;
            let ms = u64::try_from(t.unix_timestamp_nanos() / 1_000_000).map_err(|_| bad())?;
            Ok(Some(Timestamp::from_millis(ms)))
        }
    }
}

pub async fn list(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    q: Query<ListQueryParams>,
) -> Result<Response, ApiError> {
    let status = status_param(&q)?;
    let limit = limit_param(&q, 100, 1000)?;
    let cursor = q.get("cursor").filter(|c| !c.is_empty()).cloned();
    let text = |name: &str| q.get(name).filter(|v| !v.is_empty()).cloned();
    let query = ListQuery {
        status,
        limit,
        cursor,
        command_type: text("type"),
        id_prefix: text("id_prefix"),
        created_after: time_param(&q, "created_after")?,
        created_before: time_param(&q, "created_before")?,
        scheduled: bool_param(&q, "scheduled")?,
    };
    let page = st.commands.store().list(&queue, query).await?;
    // `{"items": [state…], "next_cursor": …}`, the states written exactly (see `serialized_response`).
    Ok(serialized_response(&page))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(body: &str) -> (StatusCode, String) {
        let e = parse_submit(body.as_bytes()).unwrap_err();
        (e.status, e.message)
    }

    #[test]
    fn submit_bodies() {
        let c = parse_submit(br#"{"id":"a","type":"echo","params":{"x":1}}"#).unwrap();
        assert_eq!((c.id.as_str(), c.command_type.as_str()), ("a", "echo"));
        assert_eq!(c.params, json!({"x": 1}));
        let c = parse_submit(br#"{"type":"echo"}"#).unwrap();
        assert_eq!(c.params, Value::Null);
        // Params keep their text: numbers, escapes, key order, inner whitespace.
        let params = r#"{"z": 0.42451918914251396, "a": [18446744073709551615, 1e400], "\u00e9": "\ud83d\ude00"}"#;
        let c = parse_submit(format!(r#"{{"params": {params} , "type":"echo"}}"#).as_bytes()).unwrap();
        assert_eq!(c.params.get(), params);
        assert_eq!(c.id.len(), 36);
        assert!(err("{")
            .1
            .starts_with("request body is not valid JSON (EOF while parsing an object at line 1 column 1)"));
        assert_eq!(err("[1]").1, format!("request body must be a JSON object like {SUBMIT_SHAPE}; got an array"));
        assert_eq!(err(r#"{"type":3}"#).1, "\"type\" must be a string naming a handler; got a number");
        assert_eq!(err(r#"{"params":{}}"#).1, format!("missing field \"type\"; send {SUBMIT_SHAPE}"));
        assert_eq!(
            err(r#"{"type":"e","id":7}"#).1,
            "\"id\" must be a string (1 to 200 bytes, no braces or whitespace); got a number"
        );
        assert_eq!(
            err(r#"{"type":"e","prams":1}"#).1,
            "unknown field \"prams\"; a command body has only id, type, params, output, run_at, delay, concurrency_key and priority"
        );
        let c = parse_submit(br#"{"type":"echo","priority":-10}"#).unwrap();
        assert_eq!(c.priority(), -10);
        assert_eq!(parse_submit(br#"{"type":"echo","priority":10}"#).unwrap().priority(), 10);
        assert_eq!(parse_submit(br#"{"type":"echo","priority":null}"#).unwrap().priority(), 0);
        assert_eq!(parse_submit(br#"{"type":"echo"}"#).unwrap().priority(), 0);
        for (body, got) in [
            (r#"{"type":"e","priority":11}"#, "11"),
            (r#"{"type":"e","priority":-11}"#, "-11"),
            (r#"{"type":"e","priority":1.5}"#, "1.5"),
            (r#"{"type":"e","priority":300}"#, "300"),
            (r#"{"type":"e","priority":"5"}"#, "a string"),
            (r#"{"type":"e","priority":true}"#, "a boolean"),
        ] {
            assert_eq!(
                err(body),
                (StatusCode::BAD_REQUEST, format!("\"priority\" must be an integer from -10 to 10; got {got}"))
            );
        }
        let c = parse_submit(br#"{"type":"echo","concurrency_key":"tenant-7"}"#).unwrap();
        assert_eq!(c.concurrency_key(), Some("tenant-7"));
        assert_eq!(parse_submit(br#"{"type":"echo","concurrency_key":null}"#).unwrap().concurrency_key(), None);
        assert_eq!(
            err(r#"{"type":"e","concurrency_key":5}"#),
            (StatusCode::BAD_REQUEST, "\"concurrency_key\" must be a string (1 to 256 bytes); got a number".into())
        );
        let long = format!(r#"{{"type":"e","concurrency_key":"{}"}}"#, "k".repeat(257));
        assert_eq!(
            err(&long),
            (
                StatusCode::BAD_REQUEST,
                "\"concurrency_key\" must be 1 to 256 bytes without control characters; got 257 bytes".into()
            )
        );
        assert_eq!(
            err(r#"{"type":"e","concurrency_key":""}"#).1,
            "\"concurrency_key\" must be 1 to 256 bytes without control characters; got 0 bytes"
        );
    }

    #[test]
    fn waits() {
        assert_eq!(parse_wait("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_wait("250ms").unwrap(), Duration::from_millis(250));
        let e = parse_wait("soon").unwrap_err();
        assert!(
            e.message.starts_with("wait must be a duration like 30s, 500ms or 2m, at most 5m; \"soon\""),
            "{}",
            e.message
        );
        assert_eq!(
            parse_wait("6m").unwrap_err().message,
            "wait must be a duration like 30s, 500ms or 2m, at most 5m; got \"6m\""
        );
    }
}
