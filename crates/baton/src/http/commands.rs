//! The command API (JSON). Errors are `{"error": "<code>", "message": "<what to fix>"}` with the
//! status below (a refused cancel also carries `"state"`).
//!
//! | Route | Success | Errors |
//! |---|---|---|
//! | `POST /v1/queues/{queue}/commands` body `{"id"?: string, "type": string, "params"?: any}` | `202` + state (new), `200` + state (same id and body) | `400` bad JSON / body shape / id / type / params, `404` unknown queue, `409` same id with another body, `413` body over `max_command_body` |
//! | `GET /v1/commands/{id}?wait=30s` | `200` + state (after at most `wait`, earlier once terminal) | `400` bad id or wait, `404` unknown id, `503` all live-reader slots taken (a wait holds one) |
//! | `POST /v1/commands/{id}/cancel` | `200` + state (`CANCELLED`) | `400` bad id, `404` unknown id, `409` already terminal (with `state`) |
//! | `GET /v1/queues/{queue}/commands?status=&cursor=&limit=` | `200` `{"items": [state…], "next_cursor": string\|null}`, newest first | `400` bad status / cursor / limit, `404` unknown queue |
//!
//! A state is the command service's JSON (`id, queue, type, params, status, result, error,
//! attempts, errors_count, created_at, started_at, modified_at, completed_at, version,
//! handed_off_to`; times RFC 3339 UTC with milliseconds). Backend failures are `503` with
//! `Retry-After: 1`. Queue statistics and dead letters are in [`super::queues`].

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::{FromRequestParts, RawPathParams, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, MethodRouter};
use baton_commands::{
    validate_id, Command, CommandError, CommandHandler, CommandState, CommandStatus, CommandStore, ListQuery,
};
use serde_json::{json, Map, Value};

use super::{AppState, RouteDef};
use crate::auth::{Op, Principal};
use crate::workers::QueueConfig;

/// Longest `?wait=` of `GET /v1/commands/{id}`.
pub const MAX_WAIT: Duration = Duration::from_secs(300);

/// An error of the command and queue API: `{"error": code, "message": text}` (plus extra fields).
#[derive(Debug)]
pub struct JsonError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub extra: Map<String, Value>,
    pub headers: HeaderMap,
}

impl JsonError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), extra: Map::new(), headers: HeaderMap::new() }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }

    fn unavailable(message: impl std::fmt::Display) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "backend_unavailable",
            format!("the backend did not answer ({message}); retry later"),
        );
        e.headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        e
    }
}

impl IntoResponse for JsonError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, code = self.code, message = %self.message, "request failed");
        } else {
            tracing::debug!(status = %self.status, code = self.code, message = %self.message, "request refused");
        }
        let mut body = Map::new();
        body.insert("error".into(), Value::from(self.code));
        body.insert("message".into(), Value::from(self.message));
        body.extend(self.extra);
        let mut res = (self.status, json_response(Value::Object(body))).into_response();
        res.headers_mut().extend(self.headers);
        res
    }
}

impl From<CommandError> for JsonError {
    fn from(e: CommandError) -> Self {
        use CommandError::*;
        let msg = e.to_string();
        match e {
            InvalidId(_) => JsonError::bad_request("invalid_id", msg),
            InvalidType(_) => JsonError::bad_request("invalid_type", msg),
            InvalidParams(_) => JsonError::bad_request("invalid_params", msg),
            InvalidStatus(_) => JsonError::bad_request("invalid_status", msg),
            InvalidCursor(_) => JsonError::bad_request(
                "invalid_cursor",
                format!("{msg}: pass a next_cursor returned by this endpoint, or omit cursor to start from the newest"),
            ),
            InvalidSettings(_) => JsonError::bad_request("invalid_request", msg),
            Conflict { .. } => JsonError::new(
                StatusCode::CONFLICT,
                "conflict",
                format!("{msg}; resubmit the same body, or use a new id"),
            ),
            NotFound(_) => JsonError::not_found("not_found", format!("{msg} (never submitted, or expired)")),
            AlreadyTerminal(st) => {
                let mut err = JsonError::new(StatusCode::CONFLICT, "already_terminal", msg);
                err.extra.insert("state".into(), state_json(&st));
                err
            }
            Queue(baton_queue::QueueError::InvalidQueueName(_)) => JsonError::bad_request("invalid_queue", msg),
            Corrupt { .. } => JsonError::new(StatusCode::INTERNAL_SERVER_ERROR, "corrupt_state", msg),
            Queue(_) | Redis(_) | Connect(_) => JsonError::unavailable(msg),
        }
    }
}

/// A JSON body with `Content-Type: application/json`.
pub fn json_response(v: Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// A command state as the API shows it (internal `_…` fields removed).
pub fn state_json(s: &CommandState) -> Value {
    let mut v = serde_json::to_value(s).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        m.retain(|k, _| !k.starts_with('_'));
    }
    v
}

/// One configured queue as the API knows it.
pub struct QueueEntry {
    /// Command type → handler (for type checks and `validate` at submit).
    pub handlers: BTreeMap<String, Arc<dyn CommandHandler>>,
}

/// The command API's state: the store and the configured queues.
#[derive(Clone)]
pub struct CommandsApi {
    inner: Arc<ApiInner>,
}

struct ApiInner {
    store: CommandStore,
    queues: BTreeMap<String, QueueEntry>,
    max_body: usize,
    workers_here: bool,
}

impl CommandsApi {
    /// The API over `store` for `queues`; `workers_here` says whether this process runs their
    /// workers (shown in queue stats). Errors: a queue whose handlers cannot be built.
    pub fn new(
        store: CommandStore,
        queues: &[QueueConfig],
        max_body: usize,
        workers_here: bool,
    ) -> Result<Self, String> {
        let mut map = BTreeMap::new();
        for q in queues {
            store.declare_queue(&q.name).map_err(|e| format!("queue {}: {e}", q.name))?;
            map.insert(q.name.clone(), QueueEntry { handlers: q.build_handlers()? });
        }
        Ok(Self { inner: Arc::new(ApiInner { store, queues: map, max_body, workers_here }) })
    }

    /// The command store.
    pub fn store(&self) -> &CommandStore {
        &self.inner.store
    }

    /// Configured queue names, sorted.
    pub fn queue_names(&self) -> Vec<String> {
        self.inner.queues.keys().cloned().collect()
    }

    /// True when this process runs the queues' workers.
    pub fn workers_here(&self) -> bool {
        self.inner.workers_here
    }

    /// The entry of `queue`, or `404 unknown_queue` naming the configured queues.
    pub fn queue(&self, queue: &str) -> Result<&QueueEntry, JsonError> {
        self.inner.queues.get(queue).ok_or_else(|| {
            JsonError::not_found(
                "unknown_queue",
                format!("no queue {queue:?} on this server; configured queues: {}", self.queue_names().join(", ")),
            )
        })
    }

    /// A quick backend round trip (for `/readyz`).
    pub async fn probe(&self) -> Result<(), String> {
        match self.inner.store.get("__baton_readyz").await {
            Ok(_) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// The command routes (the queue routes are in [`super::queues::routes`]).
pub fn routes() -> Vec<(RouteDef, MethodRouter<AppState>)> {
    vec![
        (RouteDef::new("/v1/queues/{queue}/commands", &["GET", "POST"]), get(list).post(submit)),
        (RouteDef::new("/v1/commands/{id}", &["GET"]), get(get_command)),
        (RouteDef::new("/v1/commands/{id}/cancel", &["POST"]), post(cancel)),
    ]
    .into_iter()
    .map(|(d, mr)| (d.clone(), json_405(mr, d.methods)))
    .collect()
}

/// Answers methods a route does not serve with a JSON `405 method_not_allowed` and `Allow`.
pub fn json_405(mr: MethodRouter<AppState>, methods: &'static [&'static str]) -> MethodRouter<AppState> {
    mr.fallback(move |req: Request| async move {
        let mut allow: Vec<&str> = methods.to_vec();
        if allow.contains(&"GET") {
            allow.push("HEAD");
        }
        let mut e = JsonError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("{} is not served here; use {}", req.method(), allow.join(" or ")),
        );
        if let Ok(v) = HeaderValue::from_str(&allow.join(", ")) {
            e.headers.insert(header::ALLOW, v);
        }
        e.into_response()
    })
}

/// The named path parameter, percent-decoded.
pub fn path_param(params: &Result<RawPathParams, RawPathParamsRejection>, name: &str) -> Result<String, JsonError> {
    let params =
        params.as_ref().map_err(|e| JsonError::bad_request("invalid_path", format!("{e}; percent-encode UTF-8")))?;
    params
        .iter()
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
        .ok_or_else(|| JsonError::bad_request("invalid_path", format!("missing path parameter {name}")))
}

/// Query parameters as (key, value), refusing keys outside `allowed` and repeated keys.
pub fn query_params(query: Option<&str>, allowed: &[&str]) -> Result<BTreeMap<String, String>, JsonError> {
    let mut out = BTreeMap::new();
    for (k, v) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        if !allowed.contains(&k.as_ref()) {
            let takes = if allowed.is_empty() { "no query parameters".to_string() } else { allowed.join(", ") };
            return Err(JsonError::bad_request(
                "invalid_query",
                format!("unknown query parameter {k:?}; this endpoint takes {takes}"),
            ));
        }
        if out.insert(k.to_string(), v.into_owned()).is_some() {
            return Err(JsonError::bad_request("invalid_query", format!("give the query parameter {k} once")));
        }
    }
    Ok(out)
}

/// A `1..=max` integer query parameter (default `default`).
pub fn limit_param(q: &BTreeMap<String, String>, default: usize, max: usize) -> Result<usize, JsonError> {
    match q.get("limit") {
        None => Ok(default),
        Some(s) => match s.trim().parse::<usize>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ => Err(JsonError::bad_request(
                "invalid_limit",
                format!("limit must be an integer from 1 to {max}; got {s:?}"),
            )),
        },
    }
}

/// The caller, as left by the auth layer (a missing one is refused, never treated as open).
pub fn principal(req_ext: &axum::http::Extensions) -> Result<Principal, JsonError> {
    req_ext
        .get::<Principal>()
        .cloned()
        .ok_or_else(|| JsonError::new(StatusCode::FORBIDDEN, "forbidden", "request was not authenticated"))
}

fn forbidden(m: String) -> JsonError {
    JsonError::new(StatusCode::FORBIDDEN, "forbidden", m)
}

// ------------------------------------------------------------------------------------------------
// Extractors: the checks every command and queue handler starts with. Handlers list them in this
// order (axum runs them in argument order, so the first failing check answers): `QueueName` or
// `IdParam`, then `Query`.
// ------------------------------------------------------------------------------------------------

/// The `{queue}` path parameter, percent-decoded, naming a configured queue: `400 invalid_path`
/// or `404 unknown_queue` ([`CommandsApi::queue`]) otherwise.
pub struct QueueName(pub String);

impl FromRequestParts<AppState> for QueueName {
    type Rejection = JsonError;

    async fn from_request_parts(parts: &mut Parts, st: &AppState) -> Result<Self, JsonError> {
        let queue = path_param(&RawPathParams::from_request_parts(parts, st).await, "queue")?;
        st.commands.queue(&queue)?;
        Ok(QueueName(queue))
    }
}

/// The `{id}` path parameter, percent-decoded (`400 invalid_path`); the handler validates it.
pub struct IdParam(pub String);

impl<S: Send + Sync> FromRequestParts<S> for IdParam {
    type Rejection = JsonError;

    async fn from_request_parts(parts: &mut Parts, st: &S) -> Result<Self, JsonError> {
        Ok(IdParam(path_param(&RawPathParams::from_request_parts(parts, st).await, "id")?))
    }
}

/// The query parameters an endpoint takes (see [`Query`]).
pub trait QuerySpec {
    const ALLOWED: &'static [&'static str];
}

/// No query parameters.
pub struct NoQuery;
impl QuerySpec for NoQuery {
    const ALLOWED: &'static [&'static str] = &[];
}

/// `?wait=`.
pub struct WaitQuery;
impl QuerySpec for WaitQuery {
    const ALLOWED: &'static [&'static str] = &["wait"];
}

/// `?limit=`.
pub struct LimitQuery;
impl QuerySpec for LimitQuery {
    const ALLOWED: &'static [&'static str] = &["limit"];
}

/// `?status=&cursor=&limit=`.
pub struct ListQueryParams;
impl QuerySpec for ListQueryParams {
    const ALLOWED: &'static [&'static str] = &["status", "cursor", "limit"];
}

/// The query parameters of the request as [`query_params`] reads them, refusing any outside
/// `Q::ALLOWED` (`400 invalid_query`); `Query` alone refuses every one. Derefs to the map.
pub struct Query<Q: QuerySpec = NoQuery>(BTreeMap<String, String>, PhantomData<Q>);

impl<Q: QuerySpec> Deref for Query<Q> {
    type Target = BTreeMap<String, String>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<Q: QuerySpec, S: Send + Sync> FromRequestParts<S> for Query<Q> {
    type Rejection = JsonError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, JsonError> {
        Ok(Query(query_params(parts.uri.query(), Q::ALLOWED)?, PhantomData))
    }
}

/// Bodies up to this far past the limit are read and discarded (not kept) before the 413, so a
/// client still sending gets the status instead of a broken pipe.
const DRAIN_CAP: usize = 64 << 20;

async fn read_body(limit: usize, headers: &HeaderMap, body: Body) -> Result<bytes::Bytes, JsonError> {
    use futures::StreamExt;
    let too_large = |n: String, close: bool| {
        let mut e = JsonError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("request body is {n} bytes; commands take at most {limit} bytes (max_command_body); keep large data elsewhere and pass a reference in params"),
        );
        if close {
            e.headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        e
    };
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok());
    if let Some(n) = declared.filter(|n| *n > limit.saturating_add(DRAIN_CAP)) {
        return Err(too_large(n.to_string(), true));
    }
    let mut stream = body.into_data_stream();
    let mut buf = bytes::BytesMut::new();
    let mut total = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk
            .map_err(|e| JsonError::bad_request("invalid_body", format!("could not read the request body: {e}")))?;
        total = total.saturating_add(chunk.len());
        if total <= limit {
            buf.extend_from_slice(&chunk);
        } else if total > limit.saturating_add(DRAIN_CAP) {
            return Err(too_large(format!("more than {total}"), true));
        }
    }
    if total > limit {
        return Err(too_large(total.to_string(), false));
    }
    Ok(buf.freeze())
}

const SUBMIT_SHAPE: &str = "{\"type\": \"echo\", \"params\": {…}} (optional \"id\": a string)";

/// Decodes a submit body into a command. Errors say what to fix (module docs).
pub fn parse_submit(body: &[u8]) -> Result<Command, JsonError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        JsonError::bad_request("invalid_json", format!("request body is not valid JSON ({e}); send {SUBMIT_SHAPE}"))
    })?;
    let Value::Object(mut m) = v else {
        return Err(JsonError::bad_request(
            "invalid_body",
            format!("request body must be a JSON object like {SUBMIT_SHAPE}; got {}", kind_of(&v)),
        ));
    };
    if let Some(k) = m.keys().find(|k| !matches!(k.as_str(), "id" | "type" | "params")) {
        return Err(JsonError::bad_request(
            "invalid_body",
            format!("unknown field {k:?}; a command body has only id, type and params"),
        ));
    }
    let command_type = match m.remove("type") {
        Some(Value::String(t)) => t,
        None | Some(Value::Null) => {
            return Err(JsonError::bad_request("invalid_body", format!("missing field \"type\"; send {SUBMIT_SHAPE}")))
        }
        Some(other) => {
            return Err(JsonError::bad_request(
                "invalid_body",
                format!("\"type\" must be a string naming a handler; got {}", kind_of(&other)),
            ))
        }
    };
    let params = m.remove("params").unwrap_or(Value::Null);
    match m.remove("id") {
        None | Some(Value::Null) => Ok(Command::new(command_type, params)),
        Some(Value::String(id)) => Ok(Command::with_id(id, command_type, params)),
        Some(other) => Err(JsonError::bad_request(
            "invalid_body",
            format!("\"id\" must be a string (1 to 200 bytes, no braces or whitespace); got {}", kind_of(&other)),
        )),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

async fn submit(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    q: Query<WaitQuery>,
    req: Request,
) -> Result<Response, JsonError> {
    let wait = q.get("wait").map(|s| parse_wait(s)).transpose()?.filter(|d| !d.is_zero());
    let api = &st.commands;
    let entry = api.queue(&queue)?;
    let (parts, body) = req.into_parts();
    let body = read_body(api.inner.max_body, &parts.headers, body).await?;
    let command = parse_submit(&body)?;
    validate_id(&command.id)?;
    if !entry.handlers.is_empty() {
        let Some(h) = entry.handlers.get(&command.command_type) else {
            let types: Vec<&str> = entry.handlers.keys().map(String::as_str).collect();
            return Err(JsonError::bad_request(
                "unknown_type",
                format!(
                    "queue {queue:?} has no handler for type {:?}; use one of {}",
                    command.command_type,
                    types.join(", ")
                ),
            ));
        };
        h.validate(&command.params)
            .map_err(|e| JsonError::bad_request("invalid_params", format!("invalid params: {e}")))?;
    }
    // A held request is a live reader (bounded by --max-live-readers like GET …?wait=): its
    // slot is taken before anything is stored, so a refusal stores nothing.
    let permit = wait.map(|_| st.live_permit().map_err(live_refused)).transpose()?;
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
    let mut res = json_response(state_json(&state));
    if created {
        *res.status_mut() = StatusCode::ACCEPTED;
        metrics::counter!("baton_commands_submitted_total", "queue" => queue.clone()).increment(1);
    }
    if let Ok(loc) = HeaderValue::from_str(&format!("/v1/commands/{}", urlencode(&state.id))) {
        res.headers_mut().insert(header::LOCATION, loc);
    }
    Ok(res)
}

/// The refusal of a live-reader slot (`503` with `Retry-After`) as this module's error.
fn live_refused(e: super::errors::ApiError) -> JsonError {
    let mut j = JsonError::new(e.status, e.code, e.message);
    j.headers = e.headers;
    j
}

fn urlencode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>().replace('+', "%20")
}

/// Parses `?wait=`: a human duration up to [`MAX_WAIT`].
pub fn parse_wait(s: &str) -> Result<Duration, JsonError> {
    let bad = |why: String| {
        JsonError::bad_request(
            "invalid_wait",
            format!(
                "wait must be a duration like 30s, 500ms or 2m, at most {}; {why}",
                humantime::format_duration(MAX_WAIT)
            ),
        )
    };
    let d = humantime::parse_duration(s.trim()).map_err(|e| bad(format!("{s:?}: {e}")))?;
    if d > MAX_WAIT {
        return Err(bad(format!("got {s:?}")));
    }
    Ok(d)
}

async fn get_command(
    State(st): State<AppState>,
    IdParam(id): IdParam,
    q: Query<WaitQuery>,
    req: Request,
) -> Result<Response, JsonError> {
    let wait = q.get("wait").map(|s| parse_wait(s)).transpose()?;
    validate_id(&id)?;
    let who = principal(req.extensions())?;
    let store = st.commands.store();
    let state = store.get(&id).await?.ok_or_else(|| CommandError::NotFound(id.clone()))?;
    who.check_queue(Op::Read, &state.queue).map_err(forbidden)?;
    let state = match wait {
        Some(d) if !d.is_zero() && !state.status.is_terminal() => {
            // A held request is a live reader: bounded by --max-live-readers like long-polls.
            let _permit = st.live_permit().map_err(live_refused)?;
            tokio::select! {
                r = store.wait(&id, d) => r?,
                _ = st.shutdown.cancelled() => store.get(&id).await?.unwrap_or(state),
            }
        }
        _ => state,
    };
    Ok(json_response(state_json(&state)))
}

async fn cancel(
    State(st): State<AppState>,
    IdParam(id): IdParam,
    _: Query,
    req: Request,
) -> Result<Response, JsonError> {
    validate_id(&id)?;
    let who = principal(req.extensions())?;
    let store = st.commands.store();
    let state = store.get(&id).await?.ok_or_else(|| CommandError::NotFound(id.clone()))?;
    who.check_queue(Op::Write, &state.queue).map_err(forbidden)?;
    let state = store.cancel(&id).await?;
    metrics::counter!("baton_commands_cancelled_total", "queue" => state.queue.clone()).increment(1);
    Ok(json_response(state_json(&state)))
}

async fn list(
    State(st): State<AppState>,
    QueueName(queue): QueueName,
    q: Query<ListQueryParams>,
) -> Result<Response, JsonError> {
    let status = match q.get("status").map(|s| s.trim()).filter(|s| !s.is_empty()) {
        None => None,
        Some(s) => Some(s.parse::<CommandStatus>().map_err(|_| {
            JsonError::bad_request(
                "invalid_status",
                format!("status {s:?} is not one of SUBMITTED, RUNNING, SUCCEEDED, FAILED, CANCELLED (any case)"),
            )
        })?),
    };
    let limit = limit_param(&q, 100, 1000)?;
    let cursor = q.get("cursor").filter(|c| !c.is_empty()).cloned();
    let page = st.commands.store().list(&queue, ListQuery { status, limit, cursor }).await?;
    let items: Vec<Value> = page.items.iter().map(state_json).collect();
    Ok(json_response(json!({ "items": items, "next_cursor": page.next_cursor })))
}

#[cfg(test)]
mod tests {
    use super::*;

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
            "unknown field \"prams\"; a command body has only id, type and params"
        );
    }

    #[test]
    fn waits_and_queries() {
        assert_eq!(parse_wait("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_wait("250ms").unwrap(), Duration::from_millis(250));
        let e = parse_wait("soon").unwrap_err();
        assert!(
            e.message.starts_with("wait must be a duration like 30s, 500ms or 2m, at most 5m; \"soon\""),
            "{}",
            e.message
        );
        assert!(parse_wait("6m").is_err());
        assert_eq!(
            query_params(Some("wiat=3s"), &["wait"]).unwrap_err().message,
            "unknown query parameter \"wiat\"; this endpoint takes wait"
        );
        assert!(query_params(Some("wait=1s&wait=2s"), &["wait"]).is_err());
        let q = query_params(Some("limit=0"), &["limit"]).unwrap();
        assert_eq!(
            limit_param(&q, 100, 1000).unwrap_err().message,
            "limit must be an integer from 1 to 1000; got \"0\""
        );
    }
}
