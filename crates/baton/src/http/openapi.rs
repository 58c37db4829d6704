//! The OpenAPI 3.1 document of `GET /openapi.json`: the builders the route table
//! ([`super::routes`]) describes each operation with, the shared schemas, and the document
//! assembled from the table's operations (tests/openapi.rs checks it against the table both
//! ways, and probes each route).
//!
//! Path templates use OpenAPI syntax: the router's `/v1/stream/{*path}` is `/v1/stream/{path}`
//! here (a path of one or more `/`-separated segments).

use serde_json::{json, Map, Value};

/// What an operation's description may depend on: the configured queue names (the `queue`
/// parameter's examples).
pub struct Docs<'a> {
    pub queues: &'a [String],
}

impl Docs<'_> {
    /// The `{queue}` path parameter.
    pub fn queue(&self) -> Value {
        let mut p = path_param("queue", "A configured queue name (GET /v1/queues lists them).");
        p["schema"]["examples"] = json!(self.queues);
        p
    }
}

/// The `operationId` of `method` on `path`: `get_v1_commands_id` for `GET /v1/commands/{id}`.
pub fn operation_id(method: &str, path: &str) -> String {
    let mut id = method.to_ascii_lowercase();
    for part in path.split(|c: char| !c.is_ascii_alphanumeric()).filter(|p| !p.is_empty()) {
        id.push('_');
        id.push_str(part);
    }
    if path.ends_with('/') && path.len() > 1 {
        id.push_str("_slash");
    }
    if path == "/" {
        id.push_str("_root");
    }
    id
}

/// A response link to the operation `method` `path`.
pub fn link(method: &str, path: &str, params: Value) -> Value {
    json!({ "operationId": operation_id(method, path), "parameters": params })
}

/// The router's path template in OpenAPI syntax (`{*path}` → `{path}`).
pub fn openapi_path(route: &str) -> String {
    route.replace("{*", "{")
}

/// A reference to a shared schema.
pub fn r(s: &str) -> Value {
    json!({ "$ref": format!("#/components/schemas/{s}") })
}

/// `{"description": d, "content": {"application/json": {"schema": schema}}}`.
pub fn json_resp(d: &str, schema: Value) -> Value {
    json!({ "description": d, "content": { "application/json": { "schema": schema } } })
}

/// An error response: the `Error` schema, the one shape of every error of every route.
pub fn err_resp(d: &str) -> Value {
    json_resp(d, r("Error"))
}

/// An error of the subscription API (`/v1/stream/__ds/…`): the protocol's
/// `SubscriptionError` schema, `{"error": {"code", "message"}}`.
pub fn ds_err(d: &str) -> Value {
    json_resp(d, r("SubscriptionError"))
}

/// An operation of the subscription API that Baton's tokens do not guard (it authenticates
/// with the subscription's own token, or needs none).
pub fn ds_public_op(summary: &str, params: Value, mut responses: Value) -> Value {
    responses["431"] = headers_too_large();
    responses["default"] = ds_err("Another error.");
    json!({ "summary": summary, "tags": ["subscriptions"], "parameters": params, "security": [],
            "responses": responses })
}

/// A `text/plain` response.
pub fn text_resp(d: &str) -> Value {
    json!({ "description": d, "content": { "text/plain": { "schema": { "type": "string" } } } })
}

/// A response without a documented body.
pub fn bare(d: &str) -> Value {
    json!({ "description": d })
}

/// The `400` of duplicate credentials, said by every protected route.
const DUPLICATE_CREDENTIALS: &str =
    "`duplicate_credentials`: more than one credential (two `Authorization` headers, `access_token` twice, or both).";

/// The `431` of every route.
fn headers_too_large() -> Value {
    err_resp("`headers_too_large`: the request headers take more than max_header_bytes.")
}

/// Responses every protected route may give (auth, and the error formats of the outer layers).
pub fn protected(mut responses: Map<String, Value>) -> Value {
    match responses.get_mut("400") {
        Some(r) => {
            let d = r["description"].as_str().unwrap_or("").to_string();
            r["description"] = Value::from(format!("{d} Or {DUPLICATE_CREDENTIALS}"));
        }
        None => {
            responses.insert("400".into(), err_resp(&format!("Bad request: {DUPLICATE_CREDENTIALS}")));
        }
    }
    responses.insert("431".into(), headers_too_large());
    responses
        .insert("401".into(), err_resp("No valid bearer token (tokens are configured). `WWW-Authenticate: Bearer`."));
    responses.insert("403".into(), err_resp("The token's operations or scopes do not cover this request."));
    responses.insert("default".into(), err_resp("Another error."));
    Value::Object(responses)
}

/// An operation of the API (bearer token optional: it depends on the server).
pub fn op(summary: &str, tag: &str, params: Value, responses: Value) -> Value {
    json!({ "summary": summary, "tags": [tag], "parameters": params, "responses": responses,
            "security": [{}, { "bearer": [] }] })
}

/// An operation of the public `operations` routes.
pub fn public_op(summary: &str, mut responses: Value) -> Value {
    responses["431"] = headers_too_large();
    json!({ "summary": summary, "tags": ["operations"], "security": [], "responses": responses })
}

/// `op` with a request body.
pub fn with_body(mut op: Value, body: Value) -> Value {
    op["requestBody"] = body;
    op["responses"]["408"] = err_resp(
        "`body_timeout`: the request body stopped arriving (nothing for the server's header timeout); the connection is closed.",
    );
    op
}

/// A response with links.
pub fn with_links(mut resp: Value, links: Value) -> Value {
    resp["links"] = links;
    resp
}

pub fn path_param(name: &str, description: &str) -> Value {
    json!({ "name": name, "in": "path", "required": true, "description": description,
            "schema": { "type": "string", "minLength": 1 } })
}

pub fn query(name: &str, description: &str, schema: Value) -> Value {
    json!({ "name": name, "in": "query", "required": false, "description": description, "schema": schema })
}

/// The responses of an operation, by status.
pub fn map(pairs: Vec<(&str, Value)>) -> Map<String, Value> {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

fn schemas() -> Value {
    let ts = || json!({ "type": "string", "format": "date-time" });
    let opt_ts = || json!({ "type": ["string", "null"], "format": "date-time" });
    let count = || json!({ "type": "integer", "minimum": 0 });
    let mut all = json!({
        "Error": { "type": "object", "required": ["error", "message"], "properties": {
            "error": { "type": "string", "description": "A stable code, e.g. `invalid_json`, `unknown_queue`." },
            "message": { "type": "string", "description": "What went wrong and what to fix." },
            "state": r("CommandState") } },
        "SubscriptionError": { "type": "object", "required": ["error"], "properties": {
            "error": { "type": "object", "required": ["code", "message"], "properties": {
                "code": { "type": "string", "description": "The protocol's code, e.g. `SUBSCRIPTION_NOT_FOUND`, `FENCED`." },
                "message": { "type": "string" },
                "current_holder": { "type": "string", "description": "`ALREADY_CLAIMED`: the worker holding the wake." },
                "generation": { "type": "integer", "description": "`ALREADY_CLAIMED`: the held wake's generation." } } } } },
        "SubmitRequest": { "type": "object", "required": ["type"], "additionalProperties": false, "properties": {
            "id": { "type": "string", "minLength": 1, "maxLength": 200, "pattern": "^[^{}\\s]+$",
                    "description": "Client-chosen id (idempotency key); a UUIDv7 when absent." },
            "type": { "type": "string", "minLength": 1, "description": "A command type the queue has a handler for." },
            "params": { "description": "Any JSON; the handler may refuse it (400)." },
            "output": { "description": "An output stream owned by the command (`true`: defaults; `false`, `null` or absent: none): created at submit, written by its handler, ended with the command. Part of the request: a resubmit of the id with another `output` is a 409.",
                "oneOf": [
                    { "type": ["boolean", "null"] },
                    { "type": "object", "additionalProperties": false, "properties": {
                        "path": { "type": "string", "minLength": 1, "maxLength": 1024, "description": "Stream path (default `commands/<id>`); the token needs `write` on it. A re-run writes `<path>/run-<n>`." },
                        "content_type": { "type": "string", "minLength": 1, "description": "The stream's content type (default `application/json`)." },
                        "silence_timeout": { "type": "string", "description": "No append nor keepalive for this long (`30s`, `5m`; 1ms to 365d) ends the stream `producer_lost` and the command FAILED. Default: never." } } }
                ] },
            "run_at": { "type": "string", "format": "date-time", "description": "Schedule the command: stored now (SUBMITTED, its `run_at` shown), its handler not called before this time (a time not in the future: at once; at most 366 days ahead). Its message waits in the queue's delayed set, never pending, and is enqueued within a few ms of the due time by a running consumer of the queue. Not with `delay`. Part of the request: a resubmit of the id with another `run_at` (or none) is a 409." },
            "delay": { "description": "Schedule the command this long from now (`30s`, `1m`, `500ms`, or a number of milliseconds); as `run_at`, not with it. A resubmit of a scheduled id with a `delay` matches whatever its due time.",
                "oneOf": [ { "type": "string" }, { "type": "integer", "minimum": 0 } ] },
            "concurrency_key": { "type": "string", "minLength": 1, "maxLength": 256, "description": "The command's concurrency key (1 to 256 bytes, no control characters): on a queue with `concurrency_per_key` (configuration), at most that many commands of one key run at once across every process, the others starting in submit order as those end. Stored and shown in the state. Not part of the idempotent body. A re-run or a hand-off enqueues the command without it." },
            "priority": { "type": "integer", "minimum": -10, "maximum": 10, "default": 0, "description": "The command's priority, -10 to 10 (default 0): its message is taken before every waiting message of a lower priority on its queue, in submit order among equal ones. Strict, no aging: a flood of higher-priority commands holds lower ones back until it drains. Shown in the state (absent when 0); kept while scheduled and while waiting for its concurrency key. Not part of the idempotent body. A re-run or a hand-off enqueues the command with priority 0." } } },
        "ScheduleRequest": { "type": "object", "additionalProperties": false, "minProperties": 1, "maxProperties": 1,
            "description": "The new due time: `run_at` or `delay`, exactly one.",
            "properties": {
                "run_at": { "type": "string", "format": "date-time", "description": "An RFC 3339 time (not in the future: at once)." },
                "delay": { "description": "From now: `30s`, `1m`, `500ms`, or a number of milliseconds.", "oneOf": [ { "type": "string" }, { "type": "integer", "minimum": 0 } ] } } },
        "OutputLink": { "type": "object", "required": ["stream", "url", "run", "content_type", "max_run_ms", "done_ttl_ms"], "additionalProperties": false,
            "description": "The command's output stream (submitted with `output`); absent otherwise.",
            "properties": {
                "stream": { "type": "string", "description": "The stream path." },
                "url": { "type": "string", "description": "Where to read it: `/v1/stream/<stream>` (segments percent-encoded)." },
                "run": { "type": "integer", "minimum": 1, "description": "1 for the submit, +1 per re-run (each run writes `<path>/run-<n>`)." },
                "content_type": { "type": "string" },
                "silence_timeout_ms": { "type": "integer", "minimum": 1, "description": "Absent: no silence timeout." },
                "max_run_ms": { "type": "integer", "minimum": 0, "description": "The stream is deleted this long after its creation (the queue's `state_ttl`)." },
                "done_ttl_ms": { "type": "integer", "minimum": 0, "description": "The stream is kept this long after its end (the queue's `retention`)." } } },
        "CommandStatus": { "type": "string", "enum": ["SUBMITTED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"] },
        "CommandState": { "type": "object",
            "required": ["id", "queue", "type", "params", "status", "result", "error", "attempts", "errors_count",
                         "created_at", "started_at", "modified_at", "completed_at", "version"],
            "properties": {
                "id": { "type": "string" }, "queue": { "type": "string" }, "type": { "type": "string" },
                "params": {}, "status": r("CommandStatus"), "result": {},
                "error": { "type": ["string", "null"] },
                "attempts": count(), "errors_count": count(),
                "created_at": ts(), "started_at": opt_ts(), "modified_at": ts(), "completed_at": opt_ts(),
                "version": { "type": "integer", "minimum": 1 },
                "handed_off_to": { "type": ["string", "null"] },
                "progress": r("Progress"),
                "details": { "description": "The handler's last checkpoint (any JSON; an HTTP worker's renewal, or `Command::checkpoint` of an in-process handler): handed to the next delivery. Absent until reported." },
                "execution": r("Execution"),
                "output": r("OutputLink"),
                "run_at": { "allOf": [ts()], "description": "A scheduled command's due time (submitted with `run_at` or `delay`, or rescheduled); it waits for it while SUBMITTED with `run_at` in the future. Stays after the command ran. Absent for a command submitted to run at once." },
                "concurrency_key": { "type": "string", "description": "The concurrency key it was submitted with; absent without one." },
                "priority": { "type": "integer", "minimum": -10, "maximum": 10, "description": "The priority it was submitted with; absent when 0." } } },
        "Execution": { "type": "object", "required": ["worker", "call", "since", "deliveries", "deadline"], "additionalProperties": false,
            "description": "The in-process handler call working on the command now, written about a second after it started (shorter calls never show one) and removed by its outcome. Absent otherwise.",
            "properties": {
                "worker": { "type": "string", "description": "The queue consumer holding the delivery's lease." },
                "call": { "type": "string", "enum": ["execute", "check_status"] },
                "since": ts(),
                "deliveries": { "type": "integer", "minimum": 1, "description": "Deliveries of the command's message, this one included." },
                "deadline": { "allOf": [ts()], "description": "`since` + the queue's `max_processing_time`: the latest the call can hold its lease." } } },
        "Progress": { "type": "object", "minProperties": 1, "additionalProperties": false,
            "description": "What the handler last reported of its work (an HTTP worker's renewal, or `Command::progress` of an in-process handler). Absent from a state until reported.",
            "properties": {
                "fraction": { "type": "number", "minimum": 0, "maximum": 1 },
                "message": { "type": "string", "description": "At most 1 KiB (UTF-8 bytes)." } } },
        "CommandEvent": { "type": "object",
            "required": ["offset", "event", "id", "type", "status", "version", "at", "attempts"], "additionalProperties": false,
            "description": "One transition of a command, from its home queue's event feed.",
            "properties": {
                "offset": { "type": "string", "description": "Where the event is in its queue's feed (`<ms, 15 digits>_<seq, 10 digits>`): read after it for the next ones." },
                "event": { "type": "string", "enum": ["submitted", "started", "progress", "running", "retry_scheduled", "handed_off", "succeeded", "failed", "cancelled", "rerun", "rescheduled"] },
                "id": { "type": "string" }, "type": { "type": "string" }, "status": r("CommandStatus"),
                "version": { "type": "integer", "minimum": 1, "description": "The state's version after the event." },
                "at": { "allOf": [ts()], "description": "When it happened (for `started`, when the call began)." },
                "attempts": count(),
                "worker": { "type": "string", "description": "`started`, `progress`: the consumer running the call." },
                "progress": r("Progress"),
                "error": { "type": "string", "description": "`retry_scheduled`, `failed`: the error." },
                "retry_in_ms": { "type": "integer", "minimum": 0, "description": "`retry_scheduled`: the delay before the next attempt." },
                "handed_off_to": { "type": "string", "description": "`handed_off`: the queue the command went to." },
                "run_at": { "allOf": [ts()], "description": "`submitted` of a scheduled command, `rescheduled`: when it is due." } } },
        "BulkRequest": { "type": "object", "required": ["action"], "additionalProperties": false, "properties": {
            "action": { "type": "string", "enum": ["cancel", "retry"], "description": "Cancel the selected commands not ended yet, or re-run the FAILED and CANCELLED ones." },
            "dry_run": { "type": "boolean", "description": "Only count (default false)." },
            "max": { "type": "integer", "minimum": 0, "maximum": 10000, "description": "Most commands looked at (0 or absent: 1,000); `next_cursor` goes on." },
            "status": { "type": "string" }, "type": { "type": "string" }, "id_prefix": { "type": "string" },
            "created_after": { "type": "string", "format": "date-time" }, "created_before": { "type": "string", "format": "date-time" },
            "cursor": { "type": "string", "description": "`next_cursor` of an earlier call with the same filters." } } },
        "BulkReport": { "type": "object", "required": ["looked_at", "eligible", "applied", "refused", "next_cursor"], "properties": {
            "looked_at": count(), "eligible": count(), "applied": count(), "refused": count(),
            "next_cursor": { "type": ["string", "null"] } } },
        "BatchSubmitRequest": { "type": "object", "required": ["commands"], "additionalProperties": false, "properties": {
            "commands": { "type": "array", "minItems": 1, "maxItems": 1000, "items": r("SubmitRequest"),
                          "description": "1 to 1000 submit bodies, each as `POST /v1/queues/{queue}/commands` takes it (and held to `max_command_body`)." } } },
        "BatchSubmitReport": { "type": "object", "required": ["results"], "additionalProperties": false, "properties": {
            "results": { "type": "array", "description": "One per item, in the order of the items.", "items": { "oneOf": [
                { "type": "object", "required": ["status", "state"], "additionalProperties": false, "properties": {
                    "status": { "type": "integer", "enum": [200, 202], "description": "202: created by this request; 200: stored already with the same body." },
                    "state": r("CommandState") } },
                { "type": "object", "required": ["status", "error", "message"], "properties": {
                    "status": { "type": "integer", "minimum": 400, "maximum": 599, "description": "The status a submit of this item alone would answer." },
                    "error": { "type": "string", "description": "Its code, as a submit alone (`invalid_body`, `unknown_type`, `conflict`, …)." },
                    "message": { "type": "string" } } } ] } } } },
        "CommandPage": { "type": "object", "required": ["items", "next_cursor"], "properties": {
            "items": { "type": "array", "items": r("CommandState") },
            "next_cursor": { "type": ["string", "null"] } } },
    });
    let rest = json!({
        "Queue": { "type": "object",
            "required": ["name", "paused", "paused_since", "length", "pending", "consumers", "dead_consumers", "lag", "delayed", "dead_letters", "backoff_ms", "rate_limit", "rate_limit_per_key", "key_waiting", "key_rate_delayed", "keys", "commands", "handlers", "workers"],
            "properties": {
                "name": { "type": "string" },
                "paused": { "type": "boolean", "description": "Paused (`POST /v1/queues/{queue}/pause`): submits are accepted, no worker starts a new command; running ones go on." },
                "paused_since": { "type": ["string", "null"], "format": "date-time", "description": "When it was paused; null while running." },
                "length": count(), "pending": count(),
                "consumers": { "type": "integer", "minimum": 0, "description": "Live consumers (heartbeat younger than their claim timeout)." },
                "dead_consumers": { "type": "integer", "minimum": 0, "description": "Group members silent past their claim timeout, not reaped yet (their commands are taken over)." },
                "lag": count(), "delayed": count(), "dead_letters": count(),
                "key_waiting": { "type": "integer", "minimum": 0, "description": "Commands waiting out of the queue's stream for a slot of their concurrency_key (concurrency_per_key): in neither length nor pending; they start in submit order as their key's slots free." },
                "backoff_ms": { "type": ["integer", "null"], "minimum": 0, "description": "The queue backs off (a handler or worker answered rate limited): no worker starts a new command for this many more ms; null when it does not." },
                "rate_limit": { "oneOf": [{ "type": "null" }, { "type": "object", "required": ["limit", "per_ms", "burst"], "properties": {
                    "limit": { "type": "integer", "minimum": 1 }, "per_ms": { "type": "integer", "minimum": 1 }, "burst": { "type": "integer", "minimum": 1 } } }],
                    "description": "The queue's rate_limit as this server is configured: at most `limit` commands started per `per_ms` by all workers together, bursts of `burst`; null: none." },
                "rate_limit_per_key": { "oneOf": [{ "type": "null" }, { "type": "object", "required": ["limit", "per_ms", "burst"], "properties": {
                    "limit": { "type": "integer", "minimum": 1 }, "per_ms": { "type": "integer", "minimum": 1 }, "burst": { "type": "integer", "minimum": 1 } } }],
                    "description": "The queue's rate_limit_per_key as this server is configured: at most `limit` commands of one concurrency key started per `per_ms`, bursts of `burst`, each key its own bucket; null: none." },
                "key_rate_delayed": { "type": "integer", "minimum": 0, "description": "Commands waiting in the delayed set for their concurrency key's rate (rate_limit_per_key); counted in `delayed` too." },
                "keys": { "type": "array", "maxItems": 50, "description": "The busiest concurrency keys, at most 50, most active + waiting + rate_delayed first (then by key), among the keys holding a slot and those with commands delayed for their rate (on Redis up to 1,000 of each looked at); empty without per-key settings.",
                    "items": { "type": "object", "required": ["key", "active", "waiting", "rate_delayed"], "properties": {
                        "key": { "type": "string" },
                        "active": { "type": "integer", "minimum": 0, "description": "Commands holding one of the key's slots (running, or about to)." },
                        "waiting": { "type": "integer", "minimum": 0, "description": "Commands in the key's waiting line." },
                        "rate_delayed": { "type": "integer", "minimum": 0, "description": "Commands waiting for the key's rate." } } } },
                "commands": { "type": "object",
                    "required": ["submitted", "running", "succeeded", "failed", "cancelled", "total", "scheduled", "next_due"],
                    "properties": { "submitted": count(), "running": count(), "succeeded": count(),
                                    "failed": count(), "cancelled": count(), "total": count(),
                                    "scheduled": { "type": "integer", "minimum": 0, "description": "Of the SUBMITTED ones: scheduled commands still waiting for their due time." },
                                    "next_due": { "allOf": [opt_ts()], "description": "The earliest due time of those; null when none waits." } } },
                "handlers": { "type": "array", "items": { "type": "string" } },
                "workers": { "type": "boolean" } } },
        "QueueChange": { "allOf": [r("Queue"), { "type": "object", "required": ["changed"], "properties": {
            "changed": { "type": "boolean", "description": "The state changed (false: the queue already was paused, or running)." } } }] },
        "Minute": { "type": "object",
            "required": ["minute", "succeeded", "failed", "cancelled", "retried", "durations", "duration_p50_ms",
                         "duration_p90_ms", "duration_p99_ms", "depth", "oldest_age_ms"],
            "properties": {
                "minute": { "type": "string", "format": "date-time", "description": "The minute's start (UTC)." },
                "succeeded": count(), "failed": count(), "cancelled": count(),
                "retried": { "type": "integer", "minimum": 0, "description": "Handler errors with a retry scheduled." },
                "durations": { "type": "array", "items": count(), "minItems": 22, "maxItems": 22,
                    "description": "Handler durations per bucket: bucket i counts bounds_ms[i-1] <= d < bounds_ms[i] (0 below the first bound; the last bucket: the last bound and more)." },
                "duration_p50_ms": { "type": ["number", "null"], "minimum": 0 },
                "duration_p90_ms": { "type": ["number", "null"], "minimum": 0 },
                "duration_p99_ms": { "type": ["number", "null"], "minimum": 0 },
                "depth": { "type": ["integer", "null"], "minimum": 0, "description": "Commands waiting (SUBMITTED) at the minute's sample; null when none was taken." },
                "oldest_age_ms": { "type": ["integer", "null"], "minimum": 0, "description": "Age of the oldest waiting command at the sample, ms; null when none was taken." } } },
        "Schedule": { "type": "object",
            "required": ["name", "cron", "timezone", "type", "params", "overlap", "missed", "max_catch_up", "missed_after_ms",
                         "next_due", "last_fire", "last_command", "pending", "missed_total"],
            "properties": {
                "name": { "type": "string", "description": "Unique in the queue; fired commands have ids `sched-<queue>.<name>-<due time, ms since the Unix epoch>` (in the queue `%` and whitespace are written `%XX`)." },
                "cron": { "type": "string", "description": "5 fields, or 6 with seconds first." },
                "timezone": { "type": "string", "description": "IANA time zone the pattern is read in." },
                "type": { "type": "string", "description": "Type of the commands submitted." },
                "params": { "description": "Params of the commands submitted (any JSON)." },
                "overlap": { "type": "string", "enum": ["skip", "allow", "cancel_previous"] },
                "missed": { "type": "string", "enum": ["skip", "run_once", "run_all"] },
                "max_catch_up": { "type": "integer", "minimum": 1, "maximum": 1000, "description": "Most late fires `run_all` submits." },
                "missed_after_ms": { "type": "integer", "minimum": 1000, "description": "A due time decided later than this after it is missed." },
                "next_due": { "type": ["string", "null"], "format": "date-time", "description": "The next due time after the last decided one and now (this server's clock); null when the pattern has none." },
                "last_fire": { "type": ["object", "null"], "required": ["due", "command_id", "result", "decided_at"], "properties": {
                    "due": { "type": "string", "format": "date-time" },
                    "command_id": { "type": ["string", "null"], "description": "The command submitted; null when skipped or missed." },
                    "result": { "type": "string", "enum": ["fired", "overlapped", "replaced", "skipped", "caught_up", "missed"] },
                    "decided_at": { "type": "string", "format": "date-time" } } },
                "last_command": { "type": ["string", "null"], "description": "The last command submitted (the one the overlap policy looks at)." },
                "pending": { "type": "boolean", "description": "The last fire's submit is not confirmed yet (the next scheduler to look finishes it)." },
                "missed_total": count() } },
        "Worker": { "type": "object", "required": ["name", "alive", "last_heartbeat", "claim_timeout_ms", "leases", "commands"], "properties": {
            "name": { "type": "string", "description": "The consumer: `<prefix>-<uuid v7>` per process (baton serve, baton worker), `remote-<name>` for an HTTP worker." },
            "alive": { "type": "boolean", "description": "Its last heartbeat is younger than its claim timeout." },
            "last_heartbeat": { "type": ["string", "null"], "format": "date-time" },
            "claim_timeout_ms": { "type": ["integer", "null"], "minimum": 0 },
            "leases": count(),
            "commands": { "type": "array", "items": { "type": "string" }, "description": "Ids of the commands of its oldest leases (at most 100)." } } },
        "StreamSummary": { "type": "object",
            "required": ["path", "content_type", "next_offset", "length", "closed", "end_reason", "ended_at", "created_at", "last_write_at", "expires_at", "forked_from"],
            "properties": {
                "path": { "type": "string" },
                "content_type": { "type": "string" },
                "next_offset": { "type": "string", "description": "The tail, as `Stream-Next-Offset` gives it (read from here to follow new data)." },
                "length": { "type": "integer", "minimum": 0, "description": "Messages stored as `max_len` counts them: JSON values of an `application/json` stream, appends of any other." },
                "closed": { "type": "boolean" },
                "end_reason": { "type": ["string", "null"], "enum": ["finished", "cancelled", "producer_lost", null] },
                "ended_at": { "type": ["string", "null"], "format": "date-time" },
                "created_at": ts(),
                "last_write_at": { "type": "string", "format": "date-time", "description": "Last append or keepalive." },
                "expires_at": { "type": ["string", "null"], "format": "date-time", "description": "When it disappears if nothing changes (TTL, expiry, run limits)." },
                "forked_from": { "type": ["string", "null"], "description": "The source stream of a fork." } } },
        "DeadLetter": { "type": "object",
            "required": ["id", "original_id", "payload", "command_id", "deliveries", "reason", "dead_lettered_at", "concurrency_key", "priority"],
            "properties": {
                "id": { "type": "string" }, "original_id": { "type": "string" }, "payload": { "type": "string" },
                "command_id": { "type": ["string", "null"] }, "deliveries": count(), "reason": { "type": "string" },
                "dead_lettered_at": ts(),
                "concurrency_key": { "type": ["string", "null"], "description": "The message's concurrency key; a replay keeps it." },
                "priority": { "type": "integer", "minimum": -10, "maximum": 10, "description": "The message's priority; a replay keeps it." } } },
    });
    // Two literals: one is past `json!`'s recursion limit.
    if let (Some(a), Value::Object(b)) = (all.as_object_mut(), rest) {
        a.extend(b);
    }
    all
}

/// The OpenAPI 3.1 document of `operations`: (router path template, lower-case method, the
/// operation object); each operation gets its `operationId`.
pub fn document(operations: impl IntoIterator<Item = (&'static str, &'static str, Value)>) -> Value {
    let mut paths = Map::new();
    for (route, method, mut op) in operations {
        let path = openapi_path(route);
        op["operationId"] = Value::from(operation_id(method, &path));
        let item = paths.entry(path).or_insert_with(|| Value::Object(Map::new()));
        item.as_object_mut().expect("a path item").insert(method.to_string(), op);
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Baton",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Durable streams (the Durable Streams protocol) and durable commands. Errors of every route are `{\"error\": code, \"message\": text}` (the `Error` schema; a refused cancel adds `state`), except the subscription routes under `/v1/stream/__ds/`, whose handlers answer the protocol's `{\"error\": {\"code\", \"message\"}}` (`SubscriptionError`). See docs/http-api.md.",
        },
        "servers": [{ "url": "/" }],
        "tags": [
            { "name": "streams", "description": "Durable Streams protocol." },
            { "name": "commands", "description": "Submit, read, wait for and cancel commands." },
            { "name": "queues", "description": "Queue statistics and dead letters." },
            { "name": "workers", "description": "The HTTP worker protocol: claim, renew and settle a queue's commands (docs/workers.md)." },
            { "name": "operations", "description": "Health, readiness, metrics." },
            { "name": "subscriptions", "description": "Durable Streams subscriptions (`/v1/stream/__ds/…`): webhook and pull-wake." },
        ],
        "paths": paths,
        "components": {
            "schemas": schemas(),
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer",
                "description": "A configured token; `?access_token=` also works (for EventSource)." } },
        },
    })
}
