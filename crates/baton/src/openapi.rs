//! `GET /openapi.json`: an OpenAPI 3.1 description of every route in
//! [`crate::http::route_table`] (tests/openapi.rs checks both ways, and probes each route).
//!
//! Path templates use OpenAPI syntax: the router's `/v1/stream/{*path}` is `/v1/stream/{path}`
//! here (a path of one or more `/`-separated segments).

use axum::extract::State;
use axum::response::Response;
use serde_json::{json, Map, Value};

use crate::http::commands::json_response;
use crate::http::AppState;

/// `GET /openapi.json` (the configured queue names are the `queue` parameter's examples).
pub async fn serve(State(st): State<AppState>) -> Response {
    json_response(spec(&st.commands.queue_names()))
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

fn link(method: &str, path: &str, params: Value) -> Value {
    json!({ "operationId": operation_id(method, path), "parameters": params })
}

/// The router's path template in OpenAPI syntax (`{*path}` → `{path}`).
pub fn openapi_path(route: &str) -> String {
    route.replace("{*", "{")
}

fn r(s: &str) -> Value {
    json!({ "$ref": format!("#/components/schemas/{s}") })
}

/// `{"description": d, "content": {"application/json": {"schema": schema}}}`.
fn json_resp(d: &str, schema: Value) -> Value {
    json!({ "description": d, "content": { "application/json": { "schema": schema } } })
}

fn err_resp(d: &str) -> Value {
    json_resp(d, r("Error"))
}

fn stream_err(d: &str) -> Value {
    err_resp(d)
}

/// Responses every protected route may give (auth, and the error formats of the outer layers).
fn protected(mut responses: Map<String, Value>) -> Value {
    responses
        .insert("401".into(), err_resp("No valid bearer token (tokens are configured). `WWW-Authenticate: Bearer`."));
    responses.insert("403".into(), err_resp("The token's operations or scopes do not cover this request."));
    responses.insert("default".into(), err_resp("Another error."));
    Value::Object(responses)
}

fn op(summary: &str, tag: &str, params: Value, responses: Value) -> Value {
    json!({ "summary": summary, "tags": [tag], "parameters": params, "responses": responses,
            "security": [{}, { "bearer": [] }] })
}

fn with_body(mut op: Value, body: Value) -> Value {
    op["requestBody"] = body;
    op
}

fn path_param(name: &str, description: &str) -> Value {
    json!({ "name": name, "in": "path", "required": true, "description": description,
            "schema": { "type": "string", "minLength": 1 } })
}

fn query(name: &str, description: &str, schema: Value) -> Value {
    json!({ "name": name, "in": "query", "required": false, "description": description, "schema": schema })
}

fn map(pairs: Vec<(&str, Value)>) -> Map<String, Value> {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

fn stream_ops() -> Value {
    let p = || json!([path_param("path", "Stream path: one or more `/`-separated segments; the first is the scope.")]);
    let body = json!({ "required": false, "description": "Stream data in the stream's content type.",
        "content": { "application/octet-stream": { "schema": { "type": "string", "format": "binary" } },
                     "application/json": {}, "text/plain": { "schema": { "type": "string" } } } });
    let mut get_params = p();
    get_params.as_array_mut().unwrap().extend([
        query("offset", "`-1` (start), `now` (tail) or an offset returned by the server.", json!({ "type": "string" })),
        query("live", "`long-poll` or `sse`.", json!({ "type": "string", "enum": ["long-poll", "sse"] })),
        query("cursor", "The last `Stream-Cursor` (CDN collapsing).", json!({ "type": "string" })),
    ]);
    let e = stream_err;
    json!({
        "put": with_body(op("Create a stream (or fork one with Stream-Forked-From)", "streams", p(), protected(map(vec![
            ("200", json!({ "description": "An identical stream exists." })),
            ("201", json!({ "description": "Created; `Location` names it." })),
            ("400", e("Bad path, header or body.")), ("404", e("Fork source not found.")),
            ("409", e("A different stream exists at this path.")), ("410", e("Fork source gone.")),
            ("413", e("Body too large.")),
        ]))), body.clone()),
        "post": with_body(op("Append, close (Stream-Closed: true) or keepalive", "streams", p(), protected(map(vec![
            ("200", json!({ "description": "Appended (idempotent producer, new)." })),
            ("204", json!({ "description": "Appended, duplicate, closed or keepalive." })),
            ("400", e("Bad header or body.")), ("403", err_resp("Token scope.")), ("404", e("No such stream.")),
            ("409", e("Closed, conflict, or producer fenced.")), ("410", e("Stream gone.")),
            ("413", e("Body too large or max length reached.")),
        ]))), body),
        "get": op("Read: catch-up, long-poll or SSE", "streams", get_params, protected(map(vec![
            ("200", json!({ "description": "Data in the stream's content type, or an SSE stream." })),
            ("204", json!({ "description": "Long-poll timed out, or SSE resumed at the end." })),
            ("304", json!({ "description": "Not modified (If-None-Match)." })),
            ("400", e("Malformed offset or query.")), ("404", e("No such stream.")),
            ("410", e("Offset before retained history, or stream gone.")),
            ("503", e("Too many live readers (Retry-After) or backend unavailable.")),
        ]))),
        "head": op("Stream metadata", "streams", p(), protected(map(vec![
            ("200", json!({ "description": "Metadata in headers." })),
            ("400", json!({ "description": "Bad path." })), ("404", json!({ "description": "No such stream." })),
        ]))),
        "delete": op("Delete a stream", "streams", p(), protected(map(vec![
            ("204", json!({ "description": "Deleted." })),
            ("400", e("Bad path.")), ("404", e("No such stream.")), ("410", e("Gone.")),
        ]))),
    })
}

fn no_path_ops() -> Value {
    let resp = || protected(map(vec![("400", stream_err("A stream URL needs a path after /v1/stream/."))]));
    let mut m = Map::new();
    for method in ["get", "put", "post", "delete"] {
        m.insert(method.into(), op("Always 400: no stream path", "streams", json!([]), resp()));
    }
    m.insert(
        "head".into(),
        op(
            "Always 400: no stream path",
            "streams",
            json!([]),
            protected(map(vec![("400", json!({ "description": "No path." }))])),
        ),
    );
    Value::Object(m)
}

fn command_ops(queues: &[String]) -> Map<String, Value> {
    let queue = || {
        let mut p = path_param("queue", "A configured queue name (GET /v1/queues lists them).");
        p["schema"]["examples"] = json!(queues);
        p
    };
    let id = || path_param("id", "Command id.");
    let state = || json_resp("The command state.", r("CommandState"));
    let submit_body = json!({ "required": true,
        "content": { "application/json": { "schema": r("SubmitRequest"),
            "examples": { "echo": { "value": { "type": "echo", "params": { "hello": "world" } } },
                          "sleep": { "value": { "id": "nap-1", "type": "sleep", "params": { "ms": 100 } } } } } } });
    let by_id = || {
        json!({
            "GetCommand": link("get", "/v1/commands/{id}", json!({ "id": "$response.body#/id" })),
            "CancelCommand": link("post", "/v1/commands/{id}/cancel", json!({ "id": "$response.body#/id" })),
        })
    };
    let with_links = |mut resp: Value, links: Value| {
        resp["links"] = links;
        resp
    };
    let mut m = Map::new();
    m.insert("/v1/queues/{queue}/commands".into(), json!({
        "post": with_body(op("Submit a command", "commands", json!([
            queue(),
            query("wait", "Hold the response until the command is terminal or this long passes (`30s`, `500ms`, `2m`; at most 5m); the status still says whether this request created it.",
                  json!({ "type": "string" })),
        ]), protected(map(vec![
            ("200", with_links(json_resp("Same id and body as an existing command: its state.", r("CommandState")), by_id())),
            ("202", with_links(json_resp("Accepted: the new command's state (`Location` names it).", r("CommandState")), by_id())),
            ("400", err_resp("Malformed JSON, wrong field types, bad id, unknown type, params the handler refuses, or a bad wait.")),
            ("404", err_resp("Unknown queue.")),
            ("409", err_resp("The id exists with another body.")),
            ("413", err_resp("Body over max_command_body.")),
            ("503", err_resp("Backend unavailable, or a wait found every live-reader slot taken (Retry-After).")),
        ]))), submit_body),
        "get": op("List a queue's commands, newest first", "commands", json!([
            queue(),
            query("status", "Only this status (any case; PENDING and PROCESSING are aliases).",
                  json!({ "type": "string", "enum": ["SUBMITTED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"] })),
            query("cursor", "`next_cursor` of the previous page.", json!({ "type": "string" })),
            query("limit", "Page size, 1 to 1000 (default 100).", json!({ "type": "integer", "minimum": 1, "maximum": 1000 })),
        ]), protected(map(vec![
            ("200", json_resp("One page.", r("CommandPage"))),
            ("400", err_resp("Bad status, cursor or limit.")), ("404", err_resp("Unknown queue.")),
        ]))),
    }));
    m.insert("/v1/commands/{id}".into(), json!({
        "get": op("A command's state", "commands", json!([
            id(),
            query("wait", "Hold the request until the command is terminal or this long passes (`30s`, `500ms`, `2m`; at most 5m).",
                  json!({ "type": "string" })),
        ]), protected(map(vec![
            ("200", state()), ("400", err_resp("Bad id or wait.")), ("404", err_resp("Unknown command.")),
            ("503", err_resp("A wait holds a live-reader slot; all are taken (Retry-After).")),
        ]))),
    }));
    m.insert(
        "/v1/commands/{id}/cancel".into(),
        json!({
            "post": op("Cancel a command", "commands", json!([id()]), protected(map(vec![
                ("200", json_resp("Cancelled: the state.", r("CommandState"))),
                ("400", err_resp("Bad id.")), ("404", err_resp("Unknown command.")),
                ("409", err_resp("Already terminal; `state` holds it.")),
            ]))),
        }),
    );
    m.insert("/v1/queues".into(), json!({
        "get": op("Queues and their statistics", "queues", json!([]), protected(map(vec![
            ("200", with_links(json_resp("Every queue the caller may read.", json!({ "type": "object", "required": ["queues"],
                "properties": { "queues": { "type": "array", "items": r("Queue") } } })), json!({
                "GetQueue": link("get", "/v1/queues/{queue}", json!({ "queue": "$response.body#/queues/0/name" })),
                "ListCommands": link("get", "/v1/queues/{queue}/commands", json!({ "queue": "$response.body#/queues/0/name" })),
                "SubmitCommand": link("post", "/v1/queues/{queue}/commands", json!({ "queue": "$response.body#/queues/0/name" })),
                "ListDeadLetters": link("get", "/v1/queues/{queue}/dead-letters", json!({ "queue": "$response.body#/queues/0/name" })),
            }))),
        ]))),
    }));
    m.insert(
        "/v1/queues/{queue}".into(),
        json!({
            "get": op("One queue's statistics", "queues", json!([queue()]), protected(map(vec![
                ("200", json_resp("The queue.", r("Queue"))), ("404", err_resp("Unknown queue.")),
            ]))),
        }),
    );
    m.insert("/v1/queues/{queue}/dead-letters".into(), json!({
        "get": op("Dead letters, oldest first", "queues", json!([
            queue(), query("limit", "At most this many, 1 to 1000 (default 100).", json!({ "type": "integer", "minimum": 1, "maximum": 1000 })),
        ]), protected(map(vec![
            ("200", with_links(json_resp("Dead letters.", json!({ "type": "object", "required": ["items"],
                "properties": { "items": { "type": "array", "items": r("DeadLetter") } } })), json!({
                "ReplayOne": link("post", "/v1/queues/{queue}/dead-letters/{id}/replay",
                    json!({ "queue": "$request.path.queue", "id": "$response.body#/items/0/id" })),
            }))),
            ("400", err_resp("Bad limit.")), ("404", err_resp("Unknown queue.")),
        ]))),
        "delete": op("Purge every dead letter (admin)", "queues", json!([queue()]), protected(map(vec![
            ("200", json_resp("How many were deleted.", json!({ "type": "object", "required": ["purged"],
                "properties": { "purged": { "type": "integer", "minimum": 0 } } }))),
            ("404", err_resp("Unknown queue.")),
        ]))),
    }));
    m.insert("/v1/queues/{queue}/dead-letters/replay".into(), json!({
        "post": op("Replay dead letters, oldest first (admin)", "queues", json!([
            queue(), query("limit", "At most this many, 1 to 100000 (default 1000).", json!({ "type": "integer", "minimum": 1, "maximum": 100000 })),
        ]), protected(map(vec![
            ("200", json_resp("How many were put back.", json!({ "type": "object", "required": ["replayed"],
                "properties": { "replayed": { "type": "integer", "minimum": 0 } } }))),
            ("400", err_resp("Bad limit.")), ("404", err_resp("Unknown queue.")),
        ]))),
    }));
    m.insert("/v1/queues/{queue}/dead-letters/{id}/replay".into(), json!({
        "post": op("Replay one dead letter (admin)", "queues", json!([queue(), path_param("id", "Dead-letter id (`<ms>-<seq>`).")]),
            protected(map(vec![
                ("200", json_resp("Put back at the queue's tail.", json!({ "type": "object", "required": ["replayed", "id"],
                    "properties": { "replayed": { "type": "string" }, "id": { "type": "string" } } }))),
                ("400", err_resp("Bad id.")), ("404", err_resp("Unknown queue or dead letter.")),
            ]))),
    }));
    m
}

fn plain_op(summary: &str, responses: Value) -> Value {
    json!({ "get": { "summary": summary, "tags": ["operations"], "security": [], "responses": responses } })
}

fn schemas() -> Value {
    let ts = || json!({ "type": "string", "format": "date-time" });
    let opt_ts = || json!({ "type": ["string", "null"], "format": "date-time" });
    let count = || json!({ "type": "integer", "minimum": 0 });
    json!({
        "Error": { "type": "object", "required": ["error", "message"], "properties": {
            "error": { "type": "string", "description": "A stable code, e.g. `invalid_json`, `unknown_queue`." },
            "message": { "type": "string", "description": "What went wrong and what to fix." },
            "state": r("CommandState") } },
        "SubmitRequest": { "type": "object", "required": ["type"], "additionalProperties": false, "properties": {
            "id": { "type": "string", "minLength": 1, "maxLength": 200, "pattern": "^[^{}\\s]+$",
                    "description": "Client-chosen id (idempotency key); a UUIDv7 when absent." },
            "type": { "type": "string", "minLength": 1, "description": "A command type the queue has a handler for." },
            "params": { "description": "Any JSON; the handler may refuse it (400)." } } },
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
                "handed_off_to": { "type": ["string", "null"] } } },
        "CommandPage": { "type": "object", "required": ["items", "next_cursor"], "properties": {
            "items": { "type": "array", "items": r("CommandState") },
            "next_cursor": { "type": ["string", "null"] } } },
        "Queue": { "type": "object",
            "required": ["name", "length", "pending", "consumers", "lag", "delayed", "dead_letters", "commands", "handlers", "workers"],
            "properties": {
                "name": { "type": "string" }, "length": count(), "pending": count(), "consumers": count(),
                "lag": count(), "delayed": count(), "dead_letters": count(),
                "commands": { "type": "object",
                    "required": ["submitted", "running", "succeeded", "failed", "cancelled", "total"],
                    "properties": { "submitted": count(), "running": count(), "succeeded": count(),
                                    "failed": count(), "cancelled": count(), "total": count() } },
                "handlers": { "type": "array", "items": { "type": "string" } },
                "workers": { "type": "boolean" } } },
        "DeadLetter": { "type": "object",
            "required": ["id", "original_id", "payload", "command_id", "deliveries", "reason", "dead_lettered_at"],
            "properties": {
                "id": { "type": "string" }, "original_id": { "type": "string" }, "payload": { "type": "string" },
                "command_id": { "type": ["string", "null"] }, "deliveries": count(), "reason": { "type": "string" },
                "dead_lettered_at": ts() } },
    })
}

/// The OpenAPI 3.1 document; `queues` (the configured queue names) are the `queue` parameter's
/// examples.
pub fn spec(queues: &[String]) -> Value {
    let mut paths = Map::new();
    paths.insert("/v1/stream/{path}".into(), stream_ops());
    paths.insert("/v1/stream".into(), no_path_ops());
    paths.insert("/v1/stream/".into(), no_path_ops());
    paths.extend(command_ops(queues));
    let text = |d: &str| json!({ "description": d, "content": { "text/plain": { "schema": { "type": "string" } } } });
    paths.insert("/healthz".into(), plain_op("The process is up", json!({ "200": text("`ok`") })));
    paths.insert(
        "/readyz".into(),
        plain_op("The backend answers", json!({ "200": text("`ready`"), "503": text("What is not reachable.") })),
    );
    paths.insert(
        "/metrics".into(),
        plain_op(
            "Prometheus metrics",
            json!({ "200": text("Prometheus text format 0.0.4."), "503": text("No recorder.") }),
        ),
    );
    paths.insert(
        "/openapi.json".into(),
        plain_op("This document", json!({ "200": { "description": "OpenAPI 3.1", "content": { "application/json": { "schema": { "type": "object" } } } } })),
    );
    paths.insert(
        "/".into(),
        plain_op("The dashboard (Accept: text/html), else a JSON server description", json!({ "200": {
            "description": "The dashboard page for browsers; service, version, backend and queues as JSON otherwise.",
            "content": { "application/json": { "schema": { "type": "object" } }, "text/html": { "schema": { "type": "string" } } } } })),
    );
    paths.insert("/v1/dashboard/events".into(), json!({ "get": op("Dashboard snapshots (server-sent events, one a second)", "operations", json!([
        query("queue", "Only this queue.", json!({ "type": "string" })),
        query("status", "Only commands with this status.", json!({ "type": "string", "enum": ["SUBMITTED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"] })),
        query("limit", "Commands per snapshot, 1 to 500 (default 50).", json!({ "type": "integer", "minimum": 1, "maximum": 500 })),
    ]), protected(map(vec![
        ("200", json!({ "description": "`event: snapshot` with queues, commands and dead letters (JSON), every second.",
                        "content": { "text/event-stream": { "schema": {
                            "description": "One event (OpenAPI 3.1 reading: the schema of each event).",
                            "type": "object", "required": ["data"],
                            "properties": { "event": { "type": "string", "enum": ["snapshot"] },
                                            "data": { "type": "string", "contentMediaType": "application/json" } } } } } })),
        ("400", err_resp("Bad queue, status or limit.")), ("404", err_resp("Unknown queue.")),
        ("503", err_resp("Too many live readers.")),
    ]))) }));
    for (path, item) in paths.iter_mut() {
        for (method, op) in item.as_object_mut().expect("path item").iter_mut() {
            op["operationId"] = Value::from(operation_id(method, path));
        }
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Baton",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Durable streams (the Durable Streams protocol) and durable commands. Errors of the command and queue API are `{\"error\": code, \"message\": text}`; stream errors are `{\"error\": {\"code\", \"message\"}}`. See docs/http-api.md.",
        },
        "servers": [{ "url": "/" }],
        "tags": [
            { "name": "streams", "description": "Durable Streams protocol." },
            { "name": "commands", "description": "Submit, read, wait for and cancel commands." },
            { "name": "queues", "description": "Queue statistics and dead letters." },
            { "name": "operations", "description": "Health, readiness, metrics." },
        ],
        "paths": paths,
        "components": {
            "schemas": schemas(),
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer",
                "description": "A configured token; `?access_token=` also works (for EventSource)." } },
        },
    })
}
