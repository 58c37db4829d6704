//! The HTTP worker protocol: a queue's commands claimed, renewed and settled by workers in other
//! processes or languages, over [`baton_commands::RemoteWorkers`] (one per configured queue, in
//! [`super::state::QueueEntry`]). Bodies are JSON; errors are the API's `{"error", "message"}`.
//! Every route needs `work` on the queue (`admin` too allows it). docs/workers.md tells the
//! protocol and its guarantees.
//!
//! | Route | Body | Success | Errors |
//! |---|---|---|---|
//! | `POST /v1/queues/{queue}/workers/{worker}/claim` | `{"max"?: 1..=100 (1), "wait"?: duration ("0s"), cut to the long-poll timeout}` | `200 {"leases": [{"lease", "call": "execute"\|"check_status", "command": state, "deliveries", "lease_timeout_ms", "output"?: {"stream", "url", "content_type", "producer_id"?, "producer_epoch"?}, "traceparent"?, "tracestate"?}]}` (empty when nothing came within `wait`, or the server shuts down) | `400` body / worker name, `404` queue, `503` all live-reader slots taken (a `wait` holds one) |
//! | `POST /v1/queues/{queue}/workers/{worker}/renew` | `{"leases": [lease or {"lease", "progress"?: {"fraction"?: 0..=1, "message"?: string ≤ 1 KiB}, "details"?: any JSON ≤ 64 KiB}…]}` (at most 1000; a report is written into the command's state while the lease is held) | `200 {"leases": [{"lease", "state": "held"\|"lost"\|"gone", "cancelled": bool}]}`, in the request's order | `400`, `404` |
//! | `POST /v1/queues/{queue}/workers/{worker}/settle` | `{"lease", "outcome", "result"?, "error"?, "next_check"?, "queue"?}`, or `{"settlements": [that…]}` (1..=1000) | `200 {"applied": bool, "command": state\|null}`; many: `200 {"settlements": [{"lease", "applied", "command"} \| {"lease", "error", "message"}]}` | `400` body (naming the item) / lease token / hand-off target, `404`, `409 lease_lost` (one settlement) |
//!
//! `outcome` is `succeeded` (`result`: any JSON, kept byte for byte; default `null`), `failed`
//! (`error`), `cancelled`, `running` (`next_check`: a duration; default the queue's
//! `check_status_interval`), `handed_off` (`queue`, required), `error` (`error`: retried with
//! backoff up to the queue's `max_attempts`) or `release` (handed back unrun). A field that does
//! not belong to the outcome is refused (400 naming it). `applied` is false when the command had
//! already ended or moved on (cancelled, say): nothing of the outcome was written.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::{RawPathParams, Request, State};
use axum::http::StatusCode;
use axum::response::Response;
use baton_commands::{
    CommandError, CommandResult, CommandState, Progress, RawJson, RemoteCall, RemoteOutcome, RemoteReport,
    RemoteSettled, RemoteWorkers,
};
use baton_queue::{LeaseState, QueueError};
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::errors::{cut_values, echo, ApiError};
use super::json::{kind_of, serialized_response};
use super::plumbing::{path_param, read_body, BodyLimit, Query, QueueName};
use super::state::AppState;

/// Most commands one claim hands out.
pub const MAX_CLAIM: usize = 100;

/// The longest single claim call of a long-poll: the claim task notices an abandoned request
/// within this long.
const CLAIM_SLICE: Duration = Duration::from_millis(250);

/// Most leases one renewal names.
pub const MAX_RENEW: usize = 1000;

/// The body rules of the worker routes: `max_command_body` (a settlement carries a result).
fn body_limit(limit: usize) -> BodyLimit {
    BodyLimit {
        limit,
        too_large: |n, limit| {
            format!(
                "request body is {n} bytes; worker requests take at most {limit} bytes (max_command_body); keep large results elsewhere and return a reference"
            )
        },
        unreadable: "invalid_body",
    }
}

/// The `{queue}`'s remote workers, the `{worker}` name and the body (within the limit).
async fn parts(
    st: &AppState,
    queue: &str,
    req: Request,
) -> Result<(std::sync::Arc<RemoteWorkers>, String, bytes::Bytes), ApiError> {
    let api = &st.commands;
    let remote = api.queue(queue)?.remote.clone();
    let (mut parts, body) = req.into_parts();
    let params = <RawPathParams as axum::extract::FromRequestParts<()>>::from_request_parts(&mut parts, &()).await;
    let worker = path_param(&params, "worker")?;
    let body = read_body(body, &parts.headers, &body_limit(api.max_body())).await?;
    Ok((remote, worker, body))
}

/// The body's fields as their JSON text, refusing fields outside `allowed`; an empty body is
/// no fields. Errors name what to fix; `shape` is an example body.
fn fields<'a>(body: &'a [u8], allowed: &[&str], shape: &str) -> Result<BTreeMap<String, &'a RawValue>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(BTreeMap::new());
    }
    let Ok(m) = serde_json::from_slice::<BTreeMap<String, &RawValue>>(body) else {
        return Err(match serde_json::from_slice::<Value>(body) {
            Err(e) => ApiError::invalid("invalid_json", format!("request body is not valid JSON ({e}); send {shape}")),
            Ok(v) => ApiError::invalid(
                "invalid_body",
                format!("request body must be a JSON object like {shape}; got {}", kind_of(&v)),
            ),
        });
    };
    if let Some(k) = m.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(ApiError::invalid(
            "invalid_body",
            format!("unknown field {}; this body has only {}", echo(k), allowed.join(", ")),
        ));
    }
    Ok(m)
}

fn bad_field(name: &str, what: &str, got: &Value) -> ApiError {
    ApiError::invalid("invalid_body", format!("\"{name}\" must be {what}; got {}", kind_of(got)))
}

/// A field as a `Value` (`None` when absent or `null`).
fn value(m: &BTreeMap<String, &RawValue>, name: &str) -> Option<Value> {
    m.get(name).and_then(|r| serde_json::from_str::<Value>(r.get()).ok()).filter(|v| !v.is_null())
}

fn string_field(m: &BTreeMap<String, &RawValue>, name: &str, what: &str) -> Result<Option<String>, ApiError> {
    let Some(raw) = m.get(name).filter(|r| r.get() != "null") else { return Ok(None) };
    match serde_json::from_str::<Value>(raw.get()) {
        Ok(Value::String(s)) => Ok(Some(s)),
        Ok(other) => Err(bad_field(name, what, &other)),
        // Valid JSON that does not decode: a string with a lone surrogate escape.
        Err(e) => Err(ApiError::invalid("invalid_body", format!("\"{name}\" does not decode ({e}); send {what}"))),
    }
}

/// A duration field (`"30s"`, `"500ms"`, `"2m"`).
fn duration_field(m: &BTreeMap<String, &RawValue>, name: &str) -> Result<Option<Duration>, ApiError> {
    let Some(s) = string_field(m, name, "a duration string like \"30s\" or \"500ms\"")? else { return Ok(None) };
    humantime::parse_duration(s.trim()).map(Some).map_err(|e| {
        ApiError::invalid(
            "invalid_body",
            format!("\"{name}\" must be a duration like \"30s\" or \"500ms\"; {}: {e}", echo(&s)),
        )
    })
}

/// The engine's errors: a bad worker name or lease token is 400, a lost lease 409.
fn engine_error(e: CommandError, worker: &str) -> ApiError {
    match e {
        CommandError::InvalidSettings(m) => ApiError::invalid("invalid_request", cut_values(m, &[worker])),
        CommandError::Queue(QueueError::LeaseLost(_)) => ApiError::new(
            StatusCode::CONFLICT,
            "lease_lost",
            "this lease is not this worker's any more (it was silent for longer than the queue's claim timeout and the command went to another worker, or it was settled already); nothing was changed: stop working on the command and do not retry this settlement",
        ),
        other => other.into(),
    }
}

#[derive(Serialize)]
struct Lease<'a> {
    lease: &'a str,
    call: &'static str,
    command: &'a CommandState,
    deliveries: u32,
    lease_timeout_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    output: Option<LeaseOutput>,
    /// The W3C trace context the worker continues (docs/operations.md, "Tracing"): with span
    /// export on, this claim's `baton.dispatch` span's; else the command's as submitted. Absent
    /// when the command has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    traceparent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tracestate: Option<String>,
}

/// The trace context handed to the worker of a claim: a `baton.dispatch` span (child of the
/// command's trace context, ended at once: the worker's own spans continue it) when spans are
/// exported, else the command's own.
fn claim_trace(
    queue: &str,
    worker: &str,
    c: &baton_commands::RemoteClaim,
) -> Option<baton_commands::trace::TraceContext> {
    let stored = c.command.trace.as_deref();
    if !baton_commands::trace::propagation_installed() {
        return stored.cloned();
    }
    let span = tracing::info_span!(
        target: baton_commands::trace::SPAN_TARGET,
        "baton.dispatch",
        baton.queue = %queue,
        baton.command.id = %c.command.id,
        baton.command.type = %c.command.command_type,
        baton.deliveries = c.deliveries,
        baton.worker = %worker,
        baton.remote = true,
    );
    baton_commands::trace::set_parent(&span, stored);
    let _in = span.enter();
    baton_commands::trace::outgoing(stored)
}

/// A claimed command's output stream, for its worker to append to: the link, and the producer
/// epoch this delivery claimed (as an in-process handler's `Output::open` does), which fences
/// the writer of an earlier delivery of the command.
#[derive(Serialize)]
struct LeaseOutput {
    stream: String,
    url: String,
    content_type: String,
    /// `command`; with `producer_epoch`, the `Producer-Id` and `Producer-Epoch` of the appends
    /// (`Producer-Seq` from 0). Absent when the stream could not be opened (it ended already:
    /// an append then answers `409` with its end).
    #[serde(skip_serializing_if = "Option::is_none")]
    producer_id: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    producer_epoch: Option<u64>,
}

/// The [`LeaseOutput`] of a claimed command that has an output stream (opened as its writer by
/// the claim: [`baton_commands::RemoteClaim::output_epoch`]).
fn lease_output(claim: &baton_commands::RemoteClaim) -> Option<LeaseOutput> {
    let link = claim.command.output.as_ref()?;
    let epoch = claim.output_epoch;
    Some(LeaseOutput {
        stream: link.stream.clone(),
        url: link.url(),
        content_type: link.content_type.clone(),
        producer_id: epoch.map(|_| baton_commands::OUTPUT_PRODUCER),
        producer_epoch: epoch,
    })
}

const CLAIM_SHAPE: &str = "{\"max\": 10, \"wait\": \"30s\"} (both optional)";

pub async fn claim(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    _: Query,
    req: Request,
) -> Result<Response, ApiError> {
    let (remote, worker, body) = parts(&st, &queue, req).await?;
    let m = fields(&body, &["max", "wait"], CLAIM_SHAPE)?;
    let max = match value(&m, "max") {
        None => 1,
        Some(v) => match v.as_u64() {
            Some(n) if (1..=MAX_CLAIM as u64).contains(&n) => n as usize,
            _ => {
                return Err(ApiError::invalid(
                    "invalid_body",
                    format!("\"max\" must be an integer from 1 to {MAX_CLAIM}; got {v}"),
                ))
            }
        },
    };
    // Longer waits are cut to this server's long-poll timeout (a long-poll's bound).
    let wait = duration_field(&m, "wait")?.unwrap_or_default().min(st.cfg.long_poll_timeout);
    // A held claim is a live reader (bounded by --max-live-readers like other long-polls).
    let _permit = (!wait.is_zero()).then(|| st.live_permit()).transpose()?;
    // The claim runs on a task of its own: when this request is abandoned (the worker hung up,
    // or the server shuts down), what it claimed after that is handed back at once for another
    // worker, instead of waiting a claim timeout under a worker that never saw it.
    let (tx, rx) = tokio::sync::oneshot::channel();
    {
        let (remote, worker) = (remote.clone(), worker.clone());
        tokio::spawn(async move {
            // In slices, each run to its end (a read cut off midway would still be delivered to
            // the worker's consumer, unseen): it stops within a slice of the request going away.
            let deadline = tokio::time::Instant::now() + wait;
            let r = loop {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                let r = remote.claim(&worker, max, left.min(CLAIM_SLICE)).await;
                match &r {
                    Ok(got) if got.is_empty() && !left.is_zero() && left > CLAIM_SLICE && !tx.is_closed() => continue,
                    _ => break r,
                }
            };
            if let Err(Ok(claims)) = tx.send(r) {
                let leases: Vec<String> = claims.into_iter().map(|c| c.lease).collect();
                if !leases.is_empty() {
                    if let Err(e) = remote.hand_back(&worker, &leases).await {
                        tracing::warn!(queue = %remote.queue(), worker, error = %e, "claim abandoned by its request: handing its commands back failed; they are taken over after the claim timeout");
                    }
                }
            }
        });
    }
    let claims = tokio::select! {
        r = rx => match r {
            Ok(r) => r.map_err(|e| engine_error(e, &worker))?,
            Err(_) => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "the claim task ended without an answer")),
        },
        // Shutting down: nothing (the claim task hands back what it still gets).
        _ = st.shutdown.cancelled() => Vec::new(),
    };
    let timeout_ms = remote.claim_timeout().as_millis() as u64;
    let leases: Vec<Lease> = claims
        .iter()
        .map(|c| (c, claim_trace(&queue, &worker, c)))
        .map(|(c, cx)| Lease {
            lease: &c.lease,
            call: match c.call {
                RemoteCall::Execute => "execute",
                RemoteCall::CheckStatus => "check_status",
            },
            command: &c.command,
            deliveries: c.deliveries,
            lease_timeout_ms: timeout_ms,
            output: lease_output(c),
            traceparent: cx.as_ref().map(|cx| cx.traceparent.clone()),
            tracestate: cx.and_then(|cx| cx.tracestate),
        })
        .collect();
    if !leases.is_empty() {
        metrics::counter!("baton_remote_claims_total", "queue" => queue.clone()).increment(leases.len() as u64);
    }
    #[derive(Serialize)]
    struct Out<'a> {
        leases: Vec<Lease<'a>>,
    }
    Ok(serialized_response(&Out { leases }))
}

const RENEW_SHAPE: &str = "{\"leases\": [\"<lease>\" or {\"lease\": \"<lease>\", \"progress\"?: {\"fraction\"?: 0.5, \"message\"?: \"…\"}, \"details\"?: any}, …]}";

pub async fn renew(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    _: Query,
    req: Request,
) -> Result<Response, ApiError> {
    let (remote, worker, body) = parts(&st, &queue, req).await?;
    let m = fields(&body, &["leases"], RENEW_SHAPE)?;
    let what = "an array of leases (the strings from claim, or {\"lease\", \"progress\"?, \"details\"?} objects), at most 1000";
    let Some(raw) = m.get("leases").filter(|r| r.get() != "null") else {
        return Err(ApiError::invalid("invalid_body", format!("missing field \"leases\"; send {RENEW_SHAPE}")));
    };
    let Ok(raw_items) = serde_json::from_str::<Vec<&RawValue>>(raw.get()) else {
        let got = serde_json::from_str::<Value>(raw.get()).unwrap_or(Value::Null);
        return Err(bad_field("leases", what, &got));
    };
    if raw_items.len() > MAX_RENEW {
        return Err(ApiError::invalid(
            "invalid_body",
            format!("\"leases\" names {} leases; renew at most {MAX_RENEW} per request", raw_items.len()),
        ));
    }
    let mut items: Vec<(String, Option<RemoteReport>)> = Vec::with_capacity(raw_items.len());
    for (i, item) in raw_items.iter().enumerate() {
        let at = |mut e: ApiError| {
            e.message = format!("leases[{i}]: {}", e.message);
            e.with_field("index", serde_json::json!(i))
        };
        items.push(parse_renewal(item).map_err(at)?);
    }
    let leases: Vec<String> = items.iter().map(|(l, _)| l.clone()).collect();
    let renewed = remote.renew_reporting(&worker, &items).await.map_err(|e| engine_error(e, &worker))?;
    let items: Vec<Value> = leases
        .iter()
        .zip(renewed)
        .map(|(l, r)| {
            let state = match r.state {
                LeaseState::Held => "held",
                LeaseState::Lost => "lost",
                LeaseState::Gone => "gone",
            };
            serde_json::json!({ "lease": l, "state": state, "cancelled": r.finished })
        })
        .collect();
    Ok(super::json::json_response(serde_json::json!({ "leases": items })))
}

const SETTLE_SHAPE: &str = "{\"lease\": \"<lease>\", \"outcome\": \"succeeded\", \"result\": {…}}";

/// The outcomes and the fields each takes besides `lease` and `outcome`.
const OUTCOMES: &[(&str, &[&str])] = &[
    ("succeeded", &["result"]),
    ("failed", &["error"]),
    ("cancelled", &[]),
    ("running", &["next_check"]),
    ("handed_off", &["queue"]),
    ("rate_limited", &["retry_after"]),
    ("error", &["error"]),
    ("release", &[]),
];

/// Decodes a settle body into the lease and the outcome. Errors name the field.
/// One item of a renewal: a lease string, or `{"lease", "progress"?, "details"?}`.
fn parse_renewal(item: &RawValue) -> Result<(String, Option<RemoteReport>), ApiError> {
    const ITEM: &str =
        "{\"lease\": \"<lease>\", \"progress\"?: {\"fraction\"?: 0.5, \"message\"?: \"…\"}, \"details\"?: any}";
    if let Ok(lease) = serde_json::from_str::<String>(item.get()) {
        return Ok((lease, None));
    }
    if !item.get().trim_start().starts_with('{') {
        let got = serde_json::from_str::<Value>(item.get()).unwrap_or(Value::Null);
        return Err(bad_field(
            "lease",
            "a lease string (from claim) or an object like {\"lease\", \"progress\"?, \"details\"?}",
            &got,
        ));
    }
    let m = fields(item.get().as_bytes(), &["lease", "progress", "details"], ITEM)?;
    let Some(lease) = string_field(&m, "lease", "the lease string from claim")? else {
        return Err(ApiError::invalid("invalid_body", format!("missing field \"lease\"; send {ITEM}")));
    };
    let progress = match m.get("progress").filter(|r| r.get() != "null") {
        None => None,
        Some(p) => {
            const PROGRESS: &str = "{\"fraction\"?: 0.5, \"message\"?: \"…\"}";
            if !p.get().trim_start().starts_with('{') {
                let got = serde_json::from_str::<Value>(p.get()).unwrap_or(Value::Null);
                return Err(bad_field("progress", &format!("an object like {PROGRESS}"), &got));
            }
            let pm = fields(p.get().as_bytes(), &["fraction", "message"], PROGRESS).map_err(|mut e| {
                e.message = format!("progress: {}", e.message);
                e
            })?;
            let fraction = match pm.get("fraction").filter(|r| r.get() != "null") {
                None => None,
                Some(raw) => match serde_json::from_str::<Value>(raw.get()) {
                    // -0 is 0.
                    Ok(Value::Number(n)) => n.as_f64().map(|f| if f == 0.0 { 0.0 } else { f }),
                    Ok(other) => return Err(bad_field("fraction", "a number from 0 to 1", &other)),
                    // A number past f64's range (1e400).
                    Err(_) => {
                        return Err(ApiError::invalid(
                            "invalid_body",
                            format!("progress fraction {} is outside 0 to 1", raw.get()),
                        ))
                    }
                },
            };
            let message = string_field(&pm, "message", "a string")?;
            Some(Progress { fraction, message })
        }
    };
    let details = m.get("details").filter(|r| r.get() != "null").map(|r| RawJson::from((*r).to_owned()));
    if progress.is_none() && details.is_none() {
        return Ok((lease, None));
    }
    let report = RemoteReport { progress, details };
    report.validate().map_err(|e| ApiError::invalid("invalid_body", e))?;
    Ok((lease, Some(report)))
}

fn parse_settle(body: &[u8]) -> Result<(String, RemoteOutcome), ApiError> {
    let m = fields(body, &["lease", "outcome", "result", "error", "next_check", "queue", "retry_after"], SETTLE_SHAPE)?;
    let Some(lease) = string_field(&m, "lease", "the lease string from claim")? else {
        return Err(ApiError::invalid("invalid_body", format!("missing field \"lease\"; send {SETTLE_SHAPE}")));
    };
    let names: Vec<&str> = OUTCOMES.iter().map(|(n, _)| *n).collect();
    let Some(outcome) = string_field(&m, "outcome", "a string")? else {
        return Err(ApiError::invalid(
            "invalid_body",
            format!("missing field \"outcome\"; use one of {}", names.join(", ")),
        ));
    };
    let Some((_, takes)) = OUTCOMES.iter().find(|(n, _)| *n == outcome) else {
        return Err(ApiError::invalid(
            "invalid_body",
            format!("\"outcome\" {} is not one of {}", echo(&outcome), names.join(", ")),
        ));
    };
    if let Some(k) = m.keys().find(|k| !matches!(k.as_str(), "lease" | "outcome") && !takes.contains(&k.as_str())) {
        let hint = if takes.is_empty() { "no other field".to_string() } else { takes.join(", ") };
        return Err(ApiError::invalid(
            "invalid_body",
            format!("field {} does not go with outcome {outcome:?} (it takes {hint})", echo(k)),
        ));
    }
    let error = || string_field(&m, "error", "a string (the error message)");
    let out = match outcome.as_str() {
        "succeeded" => {
            let result = m.get("result").map(|r| RawJson::from((*r).to_owned())).unwrap_or_default();
            RemoteOutcome::Result(CommandResult::Succeeded(result))
        }
        "failed" => RemoteOutcome::Result(CommandResult::Failed(
            error()?.filter(|e| !e.is_empty()).unwrap_or_else(|| "failed (the worker gave no error)".into()),
        )),
        "cancelled" => RemoteOutcome::Result(CommandResult::Cancelled),
        "running" => RemoteOutcome::Result(CommandResult::Running { next_check: duration_field(&m, "next_check")? }),
        "handed_off" => {
            let Some(queue) = string_field(&m, "queue", "a queue name")? else {
                return Err(ApiError::invalid(
                    "invalid_body",
                    "outcome \"handed_off\" needs \"queue\": the queue the command continues on",
                ));
            };
            RemoteOutcome::Result(CommandResult::HandedOff { queue })
        }
        "rate_limited" => {
            let Some(d) = duration_field(&m, "retry_after")? else {
                return Err(ApiError::invalid(
                    "invalid_body",
                    "outcome \"rate_limited\" needs \"retry_after\": how long the queue backs off, a duration like \"2s\"",
                ));
            };
            if d.is_zero() || d > MAX_RATE_LIMITED {
                return Err(ApiError::invalid(
                    "invalid_body",
                    format!("\"retry_after\" must be above 0 and at most 1h; got {}", humantime::format_duration(d)),
                ));
            }
            RemoteOutcome::Result(CommandResult::RateLimited { retry_after: d })
        }
        "error" => RemoteOutcome::Error(error()?.unwrap_or_default()),
        _ => RemoteOutcome::Release,
    };
    Ok((lease, out))
}

/// Longest back-off a `rate_limited` settlement may ask for.
const MAX_RATE_LIMITED: Duration = Duration::from_secs(3600);

/// Most settlements one request carries.
pub const MAX_SETTLE: usize = 1000;

const BATCH_SHAPE: &str =
    "{\"settlements\": [{\"lease\": \"<lease>\", \"outcome\": \"succeeded\", \"result\": {…}}, …]}";

/// A hand-off's target must be a queue of this server (and not the command's own).
fn check_handoff(st: &AppState, own: &str, outcome: &RemoteOutcome) -> Result<(), ApiError> {
    if let RemoteOutcome::Result(CommandResult::HandedOff { queue }) = outcome {
        if queue == own {
            return Err(ApiError::invalid(
                "invalid_body",
                format!(
                    "outcome \"handed_off\" names {}, the command's own queue; hand off to another queue",
                    echo(queue)
                ),
            ));
        }
        if let Err(mut e) = st.commands.queue(queue) {
            e.status = StatusCode::BAD_REQUEST;
            e.message = format!("outcome \"handed_off\": {}; nothing was changed", e.message);
            return Err(e);
        }
    }
    Ok(())
}

#[derive(Serialize)]
struct Settled<'a> {
    applied: bool,
    command: Option<&'a CommandState>,
}

fn settled_view(s: &RemoteSettled) -> Settled<'_> {
    match s {
        RemoteSettled::Applied(s) => Settled { applied: true, command: Some(s) },
        RemoteSettled::Finished(s) => Settled { applied: false, command: s.as_ref() },
    }
}

pub async fn settle(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    _: Query,
    req: Request,
) -> Result<Response, ApiError> {
    let (remote, worker, body) = parts(&st, &queue, req).await?;
    if let Some(items) = batch_items(&body)? {
        return settle_many(&st, &queue, &remote, &worker, items).await;
    }
    let (lease, outcome) = parse_settle(&body)?;
    check_handoff(&st, &queue, &outcome)?;
    let settled = remote.settle(&worker, &lease, outcome).await.map_err(|e| engine_error(e, &worker))?;
    Ok(serialized_response(&settled_view(&settled)))
}

/// The items of a batch body `{"settlements": [...]}`, or `None` for a single settlement.
fn batch_items(body: &[u8]) -> Result<Option<Vec<&RawValue>>, ApiError> {
    #[derive(serde::Deserialize)]
    struct Probe<'a> {
        #[serde(borrow)]
        settlements: Option<&'a RawValue>,
    }
    let Ok(Probe { settlements: Some(raw) }) = serde_json::from_slice::<Probe>(body) else { return Ok(None) };
    fields(body, &["settlements"], BATCH_SHAPE)?;
    match serde_json::from_str::<Vec<&RawValue>>(raw.get()) {
        Ok(items) if items.is_empty() => {
            Err(ApiError::invalid("invalid_body", format!("\"settlements\" is empty; send {BATCH_SHAPE}")))
        }
        Ok(items) if items.len() > MAX_SETTLE => Err(ApiError::invalid(
            "invalid_body",
            format!("\"settlements\" has {} items; settle at most {MAX_SETTLE} per request", items.len()),
        )),
        Ok(items) => Ok(Some(items)),
        Err(_) => Err(ApiError::invalid(
            "invalid_body",
            format!("\"settlements\" must be an array of settlements like {BATCH_SHAPE}"),
        )),
    }
}

/// Many settlements in one request, each decided as alone (concurrently): every item is checked
/// first (a bad one refuses the request, naming its index, and nothing is settled), then each
/// answers in order `{"lease", "applied", "command"}` or `{"lease", "error", "message"}`
/// (`lease_lost`, or a backend failure: retry that item).
async fn settle_many(
    st: &AppState,
    queue: &str,
    remote: &RemoteWorkers,
    worker: &str,
    items: Vec<&RawValue>,
) -> Result<Response, ApiError> {
    let mut parsed = Vec::with_capacity(items.len());
    let mut seen = std::collections::HashSet::new();
    for (i, item) in items.iter().enumerate() {
        let at = |mut e: ApiError| {
            e.message = format!("settlements[{i}]: {}", e.message);
            e.with_field("index", serde_json::json!(i))
        };
        let (lease, outcome) = parse_settle(item.get().as_bytes()).map_err(at)?;
        check_handoff(st, queue, &outcome).map_err(at)?;
        if !seen.insert(lease.clone()) {
            return Err(at(ApiError::invalid(
                "invalid_body",
                "this lease is settled by an earlier item of the request",
            )));
        }
        parsed.push((lease, outcome));
    }
    let leases: Vec<String> = parsed.iter().map(|(l, _)| l.clone()).collect();
    let settled = remote.settle_many(worker, parsed).await.map_err(|e| engine_error(e, worker))?;
    let results: Vec<(String, Result<RemoteSettled, ApiError>)> =
        leases.into_iter().zip(settled).map(|(l, r)| (l, r.map_err(|e| engine_error(e, worker)))).collect();
    #[derive(Serialize)]
    #[serde(untagged)]
    enum Item<'a> {
        Done {
            lease: &'a str,
            #[serde(flatten)]
            settled: Settled<'a>,
        },
        Refused {
            lease: &'a str,
            error: &'static str,
            message: String,
        },
    }
    let out: Vec<Item> = results
        .iter()
        .map(|(lease, r)| match r {
            Ok(s) => Item::Done { lease, settled: settled_view(s) },
            Err(e) => Item::Refused { lease, error: e.code, message: e.message.clone() },
        })
        .collect();
    #[derive(Serialize)]
    struct Out<'a> {
        settlements: Vec<Item<'a>>,
    }
    Ok(serialized_response(&Out { settlements: out }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> String {
        parse_settle(body.as_bytes()).unwrap_err().message
    }

    #[test]
    fn settle_bodies() {
        let (l, o) =
            parse_settle(br#"{"lease":"x","outcome":"succeeded","result":{"b":1.50,"a":[18446744073709551616]}}"#)
                .unwrap();
        assert_eq!(l, "x");
        match o {
            RemoteOutcome::Result(CommandResult::Succeeded(r)) => {
                assert_eq!(r.get(), r#"{"b":1.50,"a":[18446744073709551616]}"#)
            }
            other => panic!("{other:?}"),
        }
        let (_, o) = parse_settle(br#"{"lease":"x","outcome":"running","next_check":"2s"}"#).unwrap();
        assert_eq!(o, RemoteOutcome::Result(CommandResult::Running { next_check: Some(Duration::from_secs(2)) }));
        let (_, o) = parse_settle(br#"{"lease":"x","outcome":"release"}"#).unwrap();
        assert_eq!(o, RemoteOutcome::Release);
        assert!(err(r#"{"outcome":"release"}"#).starts_with("missing field \"lease\""));
        assert!(err(r#"{"lease":"x","outcome":"done"}"#).starts_with("\"outcome\" \"done\" is not one of succeeded"));
        assert_eq!(
            err(r#"{"lease":"x","outcome":"failed","result":1}"#),
            "field \"result\" does not go with outcome \"failed\" (it takes error)"
        );
        assert!(err(r#"{"lease":"x","outcome":"handed_off"}"#).contains("needs \"queue\""));
        assert!(err(r#"{"lease":"x","outcome":"running","next_check":"soon"}"#)
            .starts_with("\"next_check\" must be a duration"));
        assert!(err(r#"{"lease":7,"outcome":"release"}"#).starts_with("\"lease\" must be the lease string"));
        assert!(err("[1]").starts_with("request body must be a JSON object"));
    }
}
