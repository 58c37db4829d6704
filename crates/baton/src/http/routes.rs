//! Every route of `baton serve` in one table ([`table`]): its path, and for each method it
//! serves the handler, what the caller must be allowed ([`Access`], [`crate::auth`]) and its
//! OpenAPI operation; and what the methods it does not serve need before they are answered 405.
//! The router ([`super::router`]), the auth layer (`access.rs`) and `/openapi.json`
//! ([`spec`]) are all built from it.

use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post, MethodRouter};
use serde_json::{json, Value};

use super::access::{self, Guard, Rules};
use super::errors::ApiError;
use super::json::json_response;
use super::openapi::{
    bare, document, ds_err, ds_public_op, err_resp, json_resp, link, map, op, path_param, protected, public_op, query,
    r, text_resp, with_body, with_links, Docs,
};
use super::state::AppState;
use super::{commands, dashboard, edge, feed, ops, plumbing, queues, remote, streams, subscriptions};
use crate::auth::Access;
use crate::settings::Op::{Admin, Read, Work, Write};

/// One route of the table.
pub struct Route {
    /// The path template (axum syntax).
    pub path: &'static str,
    /// The methods it serves, each with what it needs and its OpenAPI operation.
    pub endpoints: Vec<Endpoint>,
    /// What a method it does not serve needs (checked before the 405).
    pub unserved: Access,
    service: Service,
}

/// One method of a route.
pub struct Endpoint {
    pub method: Method,
    pub access: Access,
    /// Its OpenAPI operation object (the `operationId` is added by [`spec`]).
    pub doc: Value,
}

/// How a route's handlers answer.
enum Service {
    /// A handler per served method; other methods get `405 method_not_allowed` (JSON, `Allow`).
    Json(MethodRouter<AppState>),
    /// One handler for every method: it answers those it does not serve itself.
    Any(MethodRouter<AppState>),
}

impl Route {
    /// A route whose methods are added with [`Route::on`]; the others answer a JSON 405.
    fn json(path: &'static str, unserved: Access) -> Self {
        Route { path, endpoints: Vec::new(), unserved, service: Service::Json(MethodRouter::new()) }
    }

    /// A route served by one handler for every method; the methods it serves are listed with
    /// [`Route::serves`].
    fn any(path: &'static str, unserved: Access, handler: MethodRouter<AppState>) -> Self {
        Route { path, endpoints: Vec::new(), unserved, service: Service::Any(handler) }
    }

    /// Serves `method` with `handler` (a method router for that method alone).
    fn on(mut self, method: Method, access: Access, doc: Value, handler: MethodRouter<AppState>) -> Self {
        self.service = match self.service {
            Service::Json(mr) => Service::Json(mr.merge(handler)),
            Service::Any(_) => unreachable!("an `any` route lists its methods with `serves`"),
        };
        self.endpoints.push(Endpoint { method, access, doc });
        self
    }

    /// Lists `method` as served by the route's one handler.
    fn serves(mut self, method: Method, access: Access, doc: Value) -> Self {
        assert!(matches!(self.service, Service::Any(_)), "`serves` is for `any` routes");
        self.endpoints.push(Endpoint { method, access, doc });
        self
    }

    /// The methods it serves, in table order.
    pub fn methods(&self) -> Vec<&'static str> {
        self.endpoints.iter().map(|e| method_name(&e.method)).collect()
    }

    /// What a request with `method` needs (`HEAD` as `GET` unless listed).
    pub fn access(&self, method: &Method) -> Access {
        self.rules().access(method)
    }

    fn rules(&self) -> Rules {
        Rules {
            by_method: self.endpoints.iter().map(|e| (e.method.clone(), e.access)).collect(),
            unserved: self.unserved,
        }
    }

    /// The route's method router, with its auth layer and request timing.
    pub fn into_method_router(self, state: &AppState) -> MethodRouter<AppState> {
        let guard = Guard { state: state.clone(), rules: std::sync::Arc::new(self.rules()) };
        let methods = self.methods();
        let mr = match self.service {
            Service::Json(mr) => json_405(mr, methods),
            Service::Any(mr) => mr,
        };
        mr.layer(middleware::from_fn_with_state(guard, access::layer))
            .layer(middleware::from_fn_with_state(self.path, track))
    }
}

fn method_name(m: &Method) -> &'static str {
    match *m {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::PUT => "PUT",
        Method::POST => "POST",
        Method::DELETE => "DELETE",
        _ => unreachable!("the table uses GET, HEAD, PUT, POST and DELETE"),
    }
}

/// Answers methods a route does not serve with a JSON `405 method_not_allowed` and `Allow`.
fn json_405(mr: MethodRouter<AppState>, methods: Vec<&'static str>) -> MethodRouter<AppState> {
    mr.fallback(move |req: Request| {
        let mut allow = methods.clone();
        async move {
            if allow.contains(&"GET") {
                allow.push("HEAD");
            }
            let mut e = ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("{} is not served here; use {}", req.method(), allow.join(" or ")),
            );
            if let Ok(v) = HeaderValue::from_str(&allow.join(", ")) {
                e.headers.insert(header::ALLOW, v);
            }
            e.into_response()
        }
    })
}

/// Route layer: `baton_http_request_duration_seconds{route,method,status}` (histogram; `route`
/// is the route's template such as `/v1/commands/{id}`, never the raw path; the time is until
/// the response head, so a live read counts its wait, not its streaming). Labels are static
/// strings: no allocation per request.
async fn track(State(route): State<&'static str>, req: Request, next: Next) -> Response {
    let method = edge::method_label(req.method());
    let t = Instant::now();
    let res = next.run(req).await;
    let status = edge::status_label(res.status());
    metrics::histogram!(
        "baton_http_request_duration_seconds",
        "route" => route, "method" => method, "status" => status
    )
    .record(t.elapsed().as_secs_f64());
    res
}

/// `GET /openapi.json`.
async fn openapi(State(st): State<AppState>) -> Response {
    json_response(spec(&st.commands.queue_names()))
}

/// The OpenAPI document of the table; `queues` are the `queue` parameter's examples.
pub fn spec(queues: &[String]) -> Value {
    let ops = table(&Docs { queues }).into_iter().flat_map(|r| {
        let path = r.path;
        r.endpoints.into_iter().map(move |e| (path, lower(&e.method), e.doc))
    });
    document(ops)
}

fn lower(m: &Method) -> &'static str {
    match *m {
        Method::GET => "get",
        Method::HEAD => "head",
        Method::PUT => "put",
        Method::POST => "post",
        Method::DELETE => "delete",
        _ => unreachable!("the table uses GET, HEAD, PUT, POST and DELETE"),
    }
}

/// Every route (module docs).
pub fn table(d: &Docs) -> Vec<Route> {
    let mut t = stream_routes();
    t.extend(subscription_routes());
    t.extend(operation_routes());
    t.extend(command_routes(d));
    t.extend(queue_routes(d));
    t.extend(worker_routes(d));
    t.push(
        Route::json("/v1/dashboard/events", Access::Token).on(
            Method::GET,
            Access::Token,
            op(
                "Dashboard snapshots (server-sent events, one a second)",
                "operations",
                json!([
                    query("queue", "Only this queue.", json!({ "type": "string" })),
                    query("status", "Only commands with this status.", statuses()),
                    query(
                        "limit",
                        "Commands per snapshot, 1 to 500 (default 50).",
                        json!({ "type": "integer", "minimum": 1, "maximum": 500 })
                    ),
                ]),
                protected(map(vec![
                    (
                        "200",
                        json!({ "description": "`event: snapshot` with queues, commands and dead letters (JSON), every second.",
                        "content": { "text/event-stream": { "schema": {
                            "description": "One event (OpenAPI 3.1 reading: the schema of each event).",
                            "type": "object", "required": ["data"],
                            "properties": { "event": { "type": "string", "enum": ["snapshot"] },
                                            "data": { "type": "string", "contentMediaType": "application/json" } } } } } }),
                    ),
                    ("400", err_resp("Bad queue, status or limit.")),
                    ("404", err_resp("Unknown queue.")),
                    ("503", err_resp("Too many live readers.")),
                ])),
            ),
            get(dashboard::events),
        ),
    );
    t
}

fn statuses() -> Value {
    json!({ "type": "string", "enum": ["SUBMITTED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"] })
}

/// `/v1/stream/{path}`: the Durable Streams protocol; `/v1/stream` and `/v1/stream/` only say
/// that a path is missing.
fn stream_routes() -> Vec<Route> {
    let p = || json!([path_param("path", "Stream path: one or more `/`-separated segments; the first is the scope.")]);
    let body = || {
        json!({ "required": false, "description": "Stream data in the stream's content type.",
        "content": { "application/octet-stream": { "schema": { "type": "string", "format": "binary" } },
                     "application/json": {}, "text/plain": { "schema": { "type": "string" } } } })
    };
    let mut get_params = p();
    get_params.as_array_mut().expect("an array").extend([
        query(
            "offset",
            "`-1` (start), `now` (tail) or an offset returned by the server (`Stream-Next-Offset`, SSE \
             `streamNextOffset`): 46 characters, the position and the stream incarnation's tag.",
            json!({ "type": "string" }),
        ),
        query("live", "`long-poll` or `sse`.", json!({ "type": "string", "enum": ["long-poll", "sse"] })),
        query("cursor", "The last `Stream-Cursor` (CDN collapsing).", json!({ "type": "string" })),
    ]);
    let stream = Route::any("/v1/stream/{*path}", Access::Stream(Write), any(streams::handle))
        .serves(
            Method::GET,
            Access::Stream(Read),
            op(
                "Read: catch-up, long-poll or SSE",
                "streams",
                get_params,
                protected(map(vec![
                    (
                        "200",
                        bare(
                            "Data in the stream's content type, or an SSE stream (`text/event-stream`: `data` \
                             and `control` events; `stream-sse-data-encoding: base64` unless the data is UTF-8 \
                             text; a stream deleted or expired under the connection gets one `event: error` \
                             with `data: {\"error\": \"...\"}`, then the connection closes).",
                        ),
                    ),
                    (
                        "204",
                        bare(
                            "Long-poll timed out, or SSE `Last-Event-ID: <offset>.end` of a stream that ended at \
                             that offset.",
                        ),
                    ),
                    ("304", bare("Not modified (If-None-Match).")),
                    ("400", err_resp("Malformed offset or query, or an offset ahead of the tail (`offset_ahead`).")),
                    (
                        "404",
                        err_resp(
                            "No such stream (`not_found`); also a long-poll whose stream is deleted or expires \
                             while it waits.",
                        ),
                    ),
                    (
                        "410",
                        err_resp(
                            "Offset before retained history (`offset_gone`); an offset of a stream since deleted \
                             and re-created at this path (`offset_incarnation`: read from `-1`); the stream is \
                             soft-deleted (`gone`), also while a long-poll waits.",
                        ),
                    ),
                    ("503", err_resp("Too many live readers (Retry-After) or backend unavailable.")),
                ])),
            ),
        )
        .serves(
            Method::HEAD,
            Access::Stream(Read),
            op(
                "Stream metadata",
                "streams",
                p(),
                protected(map(vec![
                    ("200", bare("Metadata in headers.")),
                    ("400", bare("Bad path.")),
                    ("404", bare("No such stream.")),
                ])),
            ),
        )
        .serves(
            Method::PUT,
            Access::StreamCreate,
            with_body(
                op(
                    "Create a stream (or fork one with Stream-Forked-From)",
                    "streams",
                    p(),
                    protected(map(vec![
                        ("200", bare("An identical stream exists.")),
                        ("201", bare("Created; `Location` names it.")),
                        ("400", err_resp("Bad path, header or body (e.g. `Baton-Silence-Timeout: 0s` or `Baton-Max-Run: 0s`: use `none`).")),
                        ("404", err_resp("Fork source not found.")),
                        (
                            "409",
                            err_resp(
                                "A different stream exists at this path: content type, TTL / expiry, closed \
                                 state, fork origin, or (when a Baton-* header is given) run limits; the message \
                                 names what differs.",
                            ),
                        ),
                        ("410", err_resp("Fork source gone.")),
                        ("413", err_resp("Body too large.")),
                    ])),
                ),
                body(),
            ),
        )
        .serves(
            Method::POST,
            Access::Stream(Write),
            with_body(
                op(
                    "Append, close (Stream-Closed: true) or keepalive",
                    "streams",
                    p(),
                    protected(map(vec![
                        ("200", bare("Appended (idempotent producer, new).")),
                        (
                            "204",
                            bare(
                                "Appended, duplicate, closed or keepalive (a close of a stream that had ended: \
                                 `Baton-Already-Ended: true` and the kept `Baton-End-Reason`).",
                            ),
                        ),
                        ("400", err_resp("Bad header or body.")),
                        ("404", err_resp("No such stream.")),
                        ("409", err_resp("Closed, conflict, or producer fenced.")),
                        ("410", err_resp("Stream gone.")),
                        ("413", err_resp("Body too large, or `Baton-Max-Len` messages reached (`max_len`).")),
                    ])),
                ),
                body(),
            ),
        )
        .serves(
            Method::DELETE,
            Access::Stream(Write),
            op(
                "Delete a stream",
                "streams",
                p(),
                protected(map(vec![
                    ("204", bare("Deleted.")),
                    ("400", err_resp("Bad path.")),
                    ("404", err_resp("No such stream.")),
                    ("410", err_resp("Gone.")),
                ])),
            ),
        );
    let no_path = |path: &'static str| {
        let doc = || {
            op(
                "Always 400: no stream path",
                "streams",
                json!([]),
                protected(map(vec![("400", err_resp("A stream URL needs a path after /v1/stream/."))])),
            )
        };
        let head =
            op("Always 400: no stream path", "streams", json!([]), protected(map(vec![("400", bare("No path."))])));
        Route::any(path, Access::Token, any(streams::no_path))
            .serves(Method::GET, Access::Token, doc())
            .serves(Method::HEAD, Access::Token, head)
            .serves(Method::PUT, Access::Token, doc())
            .serves(Method::POST, Access::Token, doc())
            .serves(Method::DELETE, Access::Token, doc())
    };
    let list = Route::json("/v1/streams", Access::Token).on(
        Method::GET,
        Access::Token,
        op(
            "Streams by path prefix (those the caller may read), in path order",
            "streams",
            json!([
                query(
                    "prefix",
                    "Only paths that start with this text (a plain string prefix: `acme/run` matches `acme/run-1`); all when absent.",
                    json!({ "type": "string" })
                ),
                query(
                    "limit",
                    "Streams per page, 1 to 1000 (default 100).",
                    json!({ "type": "integer", "minimum": 1, "maximum": 1000 })
                ),
                query("cursor", "A page's `next_cursor`: the page after it.", json!({ "type": "string" })),
            ]),
            protected(map(vec![
                (
                    "200",
                    json_resp(
                        "A page of streams; `next_cursor` is null on the last page (a page may hold fewer than `limit` and still have one).",
                        json!({ "type": "object", "required": ["streams", "next_cursor"], "properties": {
                            "streams": { "type": "array", "items": r("StreamSummary") },
                            "next_cursor": { "type": ["string", "null"] } } }),
                    ),
                ),
                ("400", err_resp("Unknown query parameter (`invalid_query`), bad limit (`invalid_limit`) or cursor (`invalid_cursor`).")),
                ("503", err_resp("Backend unavailable.")),
            ])),
        ),
        get(streams::list),
    );
    vec![stream, no_path("/v1/stream"), no_path("/v1/stream/"), list]
}

/// The Durable Streams subscription API under `/v1/stream/__ds/` (`subscriptions.rs`): static
/// segments, so they win over `/v1/stream/{*path}`. Management and claim need an admin token;
/// callback, ack and release authenticate with the subscription's token in their handlers, so
/// Baton's bearer check does not run on them; `jwks.json` and unknown control paths are public.
fn subscription_routes() -> Vec<Route> {
    const BASE: &str = "/v1/stream/__ds/subscriptions/{id}";
    let id = || path_param("id", "Subscription id (at most 256 bytes).");
    let json_body = |d: &str, example: Value| {
        json!({ "required": false, "description": d,
                "content": { "application/json": { "schema": { "type": "object" }, "example": example } } })
    };
    let view = |d: &str| json_resp(d, json!({ "type": "object" }));
    let admin = |summary: &str, params: Value, responses: Vec<(&str, Value)>| {
        let mut o = op(summary, "subscriptions", params, protected(map(responses)));
        o["responses"]["default"] = ds_err("Another error (`503 UNAVAILABLE`: backend unavailable, Retry-After).");
        o
    };
    let bad_json = "`INVALID_REQUEST`: invalid JSON body or fields (the message says which).";
    let bad_ack = "`INVALID_REQUEST`: invalid JSON body, a missing `wake_id` or `generation`, or a field of the \
                   wrong type (the message says which).";
    let token_ops = |summary: &str, ok: (&str, Value)| {
        with_body(
            ds_public_op(
                summary,
                json!([id()]),
                Value::Object(map(vec![
                    ok,
                    ("400", ds_err(bad_ack)),
                    (
                        "401",
                        ds_err("`TOKEN_INVALID`: no `Authorization: Bearer <token>`, or not the subscription's token."),
                    ),
                    ("404", ds_err("`SUBSCRIPTION_NOT_FOUND`.")),
                    (
                        "409",
                        ds_err(
                            "`FENCED` (a token of an earlier generation or of a wake that ended, or a `wake_id` / \
                             `generation` not the current wake's; the message says which) or `INVALID_OFFSET`.",
                        ),
                    ),
                ])),
            ),
            json_body(
                "`{\"wake_id\", \"generation\", \"acks\"?: [{\"stream\", \"offset\"}], \"done\"?}`.",
                json!({ "wake_id": "w_1", "generation": 1, "acks": [{ "stream": "events/a", "offset": "…" }], "done": true }),
            ),
        )
    };
    let ack_ok = || {
        json_resp(
            "Acknowledged: `{\"ok\": true, \"next_wake\": bool}` (`next_wake`: entries are still pending).",
            json!({ "type": "object", "required": ["ok", "next_wake"],
                "properties": { "ok": { "type": "boolean" }, "next_wake": { "type": "boolean" } } }),
        )
    };
    let unknown_doc = || {
        ds_public_op(
            "Always 404: not a control route",
            json!([]),
            json!({ "404": ds_err("`SUBSCRIPTION_NOT_FOUND`: Durable Streams control route not found.") }),
        )
    };
    let unknown = |path: &'static str| {
        let mut r = Route::any(path, Access::Public, any(subscriptions::unknown));
        for m in [Method::GET, Method::PUT, Method::POST, Method::DELETE] {
            r = r.serves(m, Access::Public, unknown_doc());
        }
        r
    };
    let mut unknown_rest = unknown_doc();
    unknown_rest["parameters"] = json!([path_param("rest", "Anything.")]);
    let mut rest = Route::any("/v1/stream/__ds/{*rest}", Access::Public, any(subscriptions::unknown));
    for m in [Method::GET, Method::PUT, Method::POST, Method::DELETE] {
        rest = rest.serves(m, Access::Public, unknown_rest.clone());
    }
    vec![
        Route::json(BASE, Access::Admin)
            .on(
                Method::PUT,
                Access::Admin,
                with_body(
                    admin(
                        "Create a subscription (admin)",
                        json!([id()]),
                        vec![
                            ("200", view("An identical subscription exists: its view.")),
                            ("201", view("Created: its view.")),
                            ("400", ds_err(&format!("{bad_json} Or `WEBHOOK_URL_REJECTED`: the webhook URL is not allowed (private or loopback address, not https)."))),
                            ("409", ds_err("`SUBSCRIPTION_ALREADY_EXISTS`: the id exists with another configuration.")),
                        ],
                    ),
                    json_body(
                        "`{\"type\": \"webhook\"|\"pull-wake\", \"pattern\"?, \"streams\"?, \"webhook\": {\"url\"}, \"wake_stream\", \"lease_ttl_ms\"?, \"description\"?}`.",
                        json!({ "type": "webhook", "pattern": "events/*", "webhook": { "url": "https://hooks.example.com/wake" } }),
                    ),
                ),
                axum::routing::put(subscriptions::create),
            )
            .on(
                Method::GET,
                Access::Admin,
                admin(
                    "A subscription (admin)",
                    json!([id()]),
                    vec![("200", view("Its view.")), ("404", ds_err("`SUBSCRIPTION_NOT_FOUND`."))],
                ),
                get(subscriptions::get),
            )
            .on(
                Method::DELETE,
                Access::Admin,
                admin("Delete a subscription (admin)", json!([id()]), vec![("204", bare("Deleted (or none existed)."))]),
                delete(subscriptions::delete),
            ),
        Route::json("/v1/stream/__ds/subscriptions/{id}/streams", Access::Admin).on(
            Method::POST,
            Access::Admin,
            with_body(
                admin(
                    "Link streams explicitly (admin)",
                    json!([id()]),
                    vec![
                        ("204", bare("Linked at their current tails.")),
                        ("400", ds_err("`INVALID_REQUEST`: `streams` must be a non-empty array of strings.")),
                        ("404", ds_err("`SUBSCRIPTION_NOT_FOUND`.")),
                    ],
                ),
                json_body("`{\"streams\": [path, ...]}`.", json!({ "streams": ["events/a"] })),
            ),
            post(subscriptions::add_streams),
        ),
        Route::json("/v1/stream/__ds/subscriptions/{id}/streams/{*path}", Access::Admin).on(
            Method::DELETE,
            Access::Admin,
            admin(
                "Unlink an explicit stream (admin)",
                json!([id(), path_param("path", "Stream path (percent-decoded; `/` may be sent as `%2F`).")]),
                vec![("204", bare("Unlinked (a stream the pattern matches stays).")), ("404", ds_err("`SUBSCRIPTION_NOT_FOUND`."))],
            ),
            delete(subscriptions::remove_stream),
        ),
        Route::json("/v1/stream/__ds/subscriptions/{id}/callback", Access::Public).on(
            Method::POST,
            Access::Public,
            token_ops("Webhook callback: acknowledge a wake (bearer callback token)", ("200", ack_ok())),
            post(subscriptions::callback),
        ),
        Route::json("/v1/stream/__ds/subscriptions/{id}/ack", Access::Public).on(
            Method::POST,
            Access::Public,
            token_ops("Pull-wake: acknowledge offsets of a claimed wake (bearer claim token)", ("200", ack_ok())),
            post(subscriptions::ack),
        ),
        Route::json("/v1/stream/__ds/subscriptions/{id}/release", Access::Public).on(
            Method::POST,
            Access::Public,
            token_ops("Pull-wake: release a claimed wake (bearer claim token)", ("204", bare("Released."))),
            post(subscriptions::release),
        ),
        Route::json("/v1/stream/__ds/subscriptions/{id}/claim", Access::Admin).on(
            Method::POST,
            Access::Admin,
            with_body(
                admin(
                    "Pull-wake: claim the pending wake (admin)",
                    json!([id()]),
                    vec![
                        (
                            "200",
                            json_resp(
                                "Claimed: `wake_id`, `generation`, `token`, `streams` (`path`, `offset`, `tail_offset`), `lease_ttl_ms`.",
                                json!({ "type": "object", "required": ["wake_id", "generation", "token", "streams"] }),
                            ),
                        ),
                        ("400", ds_err("`INVALID_REQUEST`: `worker` must be a non-empty string.")),
                        ("404", ds_err("`SUBSCRIPTION_NOT_FOUND`.")),
                        ("409", ds_err("`ALREADY_CLAIMED` (with `current_holder`, `generation`) or `NO_PENDING_WORK`.")),
                    ],
                ),
                json_body("`{\"worker\": name}`.", json!({ "worker": "w1" })),
            ),
            post(subscriptions::claim),
        ),
        Route::json("/v1/stream/__ds/jwks.json", Access::Public).on(
            Method::GET,
            Access::Public,
            ds_public_op(
                "Webhook signing keys (JWKS)",
                json!([]),
                json!({ "200": { "description": "`{\"keys\": [Ed25519 JWK, ...]}`; `Cache-Control: public, max-age=300`.",
                                 "content": { "application/jwk-set+json": { "schema": { "type": "object", "required": ["keys"] } } } } }),
            ),
            get(subscriptions::jwks),
        ),
        unknown("/v1/stream/__ds"),
        unknown("/v1/stream/__ds/"),
        rest,
        rotate_route(),
    ]
}

/// `POST /v1/subscriptions/signing-keys/rotate`: Baton's own admin route over the subscription
/// service (Baton's error shape, not the protocol's).
fn rotate_route() -> Route {
    Route::json("/v1/subscriptions/signing-keys/rotate", Access::Admin).on(
        Method::POST,
        Access::Admin,
        op(
            "Rotate the webhook signing key (admin)",
            "subscriptions",
            json!([]),
            protected(map(vec![
                (
                    "200",
                    json_resp(
                        "A new key is current: its `kid`, and the JWKS URL (`<public url>/v1/stream/__ds/jwks.json`), \
                         which now lists it first and keeps the retired key for 7 days. Deliveries from this \
                         process are signed with it at once; other processes on the same Redis from their next \
                         registry poll (200 ms).",
                        json!({ "type": "object", "required": ["kid", "jwks_url"],
                                "properties": { "kid": { "type": "string" }, "jwks_url": { "type": "string" } } }),
                    ),
                ),
                (
                    "503",
                    err_resp(
                        "`backend_unavailable`: the backend did not answer (`Retry-After: 1`); retry (a retry \
                         that rotates once more is harmless).",
                    ),
                ),
            ])),
        ),
        post(subscriptions::rotate_signing_key),
    )
}

/// `/healthz`, `/readyz`, `/metrics`, `/openapi.json` and `/` (the dashboard or the JSON index).
fn operation_routes() -> Vec<Route> {
    let public = |path: &'static str, doc: Value, handler: MethodRouter<AppState>| {
        Route::json(path, Access::Public).on(Method::GET, Access::Public, doc, handler)
    };
    vec![
        public("/healthz", public_op("The process is up", json!({ "200": text_resp("`ok`") })), get(ops::healthz)),
        public(
            "/readyz",
            public_op(
                "The backend answers",
                json!({ "200": text_resp("`ready`"),
                        "503": err_resp("`not_ready`: a backend did not answer within 3 s; the message names it (`Retry-After: 1`).") }),
            ),
            get(ops::readyz),
        ),
        public(
            "/metrics",
            public_op(
                "Prometheus metrics",
                json!({ "200": text_resp("Prometheus text format 0.0.4."), "503": err_resp("`metrics_unavailable`: no recorder.") }),
            ),
            get(ops::metrics),
        ),
        public(
            "/openapi.json",
            public_op(
                "This document",
                json!({ "200": { "description": "OpenAPI 3.1", "content": { "application/json": { "schema": { "type": "object" } } } } }),
            ),
            get(openapi),
        ),
        public(
            "/",
            public_op(
                "The dashboard (Accept: text/html), else a JSON server description",
                json!({ "200": {
            "description": "The dashboard page for browsers; service, version, backend and queues as JSON otherwise.",
            "content": { "application/json": { "schema": { "type": "object" } }, "text/html": { "schema": { "type": "string" } } } } }),
            ),
            get(dashboard::index_or_page),
        ),
    ]
}

/// The OpenAPI operation of an event feed read (`feed.rs`): `first` is its path parameter.
fn feed_op(summary: &str, first: Value, missing: &str) -> Value {
    op(
        summary,
        "commands",
        json!([
            first,
            query(
                "offset",
                "`-1` (the oldest event kept; the default of a catch-up read), `now` (the tail) or an offset \
                 returned before (`Stream-Next-Offset`, an event's `offset`, SSE `streamNextOffset`). Live reads \
                 need one.",
                json!({ "type": "string" })
            ),
            query("live", "`long-poll` or `sse` (absent: catch-up).", json!({ "type": "string", "enum": ["long-poll", "sse"] })),
            query(
                "limit",
                "Most events per response (per SSE `data` event), 1 to 1000 (default 100).",
                json!({ "type": "integer", "minimum": 1, "maximum": 1000 })
            ),
            query("cursor", "The last `Stream-Cursor` (CDN collapsing).", json!({ "type": "string" })),
        ]),
        protected(map(vec![
            (
                "200",
                json!({ "description": "Events, oldest first (`Stream-Next-Offset`: where to read next; \
                         `Stream-Up-To-Date: true` once the tail is reached), or an SSE stream (`text/event-stream`: \
                         `event: data` with the events' JSON array, then `event: control` with `streamNextOffset`, \
                         `streamCursor` and `upToDate`, its `id:` the offset; `event: error` when the command \
                         expires under the connection).",
                    "content": { "application/json": { "schema": { "type": "array", "items": r("CommandEvent") } },
                                 "text/event-stream": { "schema": {
                                     "description": "One event (OpenAPI 3.1 reading: the schema of each event).",
                                     "type": "object", "required": ["data"],
                                     "properties": { "event": { "type": "string", "enum": ["data", "control", "error"] },
                                                     "data": { "type": "string", "contentMediaType": "application/json" },
                                                     "id": { "type": "string" } } } } } }),
            ),
            ("204", bare("Long-poll: no event within the server's long-poll timeout (`Stream-Next-Offset`).")),
            (
                "400",
                err_resp("Bad offset (`invalid_offset`) or Last-Event-ID, live, limit (`invalid_limit`) or query parameter (`invalid_query`); a live read without offset."),
            ),
            ("404", err_resp(missing)),
            ("503", err_resp("Too many live readers (Retry-After), or backend unavailable.")),
        ])),
    )
}

/// Submit, list, read (and wait for) and cancel commands.
fn command_routes(d: &Docs) -> Vec<Route> {
    let id = || path_param("id", "Command id.");
    let by_id = || {
        json!({
            "GetCommand": link("get", "/v1/commands/{id}", json!({ "id": "$response.body#/id" })),
            "CancelCommand": link("post", "/v1/commands/{id}/cancel", json!({ "id": "$response.body#/id" })),
        })
    };
    let submit_body = json!({ "required": true,
        "content": { "application/json": { "schema": r("SubmitRequest"),
            "examples": { "echo": { "value": { "type": "echo", "params": { "hello": "world" } } },
                          "sleep": { "value": { "id": "nap-1", "type": "sleep", "params": { "ms": 100 } } },
                          "output": { "value": { "type": "echo", "params": { "hello": "world" }, "output": true } } } } } });
    vec![
        Route::json("/v1/queues/{queue}/commands", Access::Queue(Write))
            .on(
                Method::GET,
                Access::Queue(Read),
                op(
                    "List a queue's commands, newest first",
                    "commands",
                    json!([
                        d.queue(),
                        query(
                            "status",
                            "Only this status (any case; PENDING and PROCESSING are aliases).",
                            statuses()
                        ),
                        query("cursor", "`next_cursor` of the previous page.", json!({ "type": "string" })),
                        query(
                            "limit",
                            "Page size, 1 to 1000 (default 100).",
                            json!({ "type": "integer", "minimum": 1, "maximum": 1000 })
                        ),
                        query("type", "Only commands of this type.", json!({ "type": "string" })),
                        query("id_prefix", "Only ids starting with this.", json!({ "type": "string" })),
                        query(
                            "created_after",
                            "Only commands created at this time or later (RFC 3339).",
                            json!({ "type": "string", "format": "date-time" })
                        ),
                        query(
                            "created_before",
                            "Only commands created before this time (RFC 3339).",
                            json!({ "type": "string", "format": "date-time" })
                        ),
                        query(
                            "scheduled",
                            "`true`: only scheduled commands still waiting for their due time; `false`: the others (a filter like `type`).",
                            json!({ "type": "boolean" })
                        ),
                    ]),
                    protected(map(vec![
                        (
                            "200",
                            json_resp(
                                "One page. With `type` or `id_prefix`, a page looks at most at 5,000 commands: it may hold fewer than `limit` (even none) and still have a `next_cursor`.",
                                r("CommandPage"),
                            ),
                        ),
                        ("400", err_resp("Bad status, cursor, limit or time.")),
                        ("404", err_resp("Unknown queue.")),
                    ])),
                ),
                get(commands::list),
            )
            .on(
                Method::POST,
                Access::Queue(Write),
                with_body(
                    op(
                        "Submit a command",
                        "commands",
                        json!([
                            d.queue(),
                            query("wait", "Hold the response until the command is terminal or this long passes (`30s`, `500ms`, `2m`; at most 5m); the status still says whether this request created it.",
                                  json!({ "type": "string" })),
                        ]),
                        protected(map(vec![
                            (
                                "200",
                                with_links(
                                    json_resp("Same id, body and output as an existing command: its state.", r("CommandState")),
                                    by_id(),
                                ),
                            ),
                            (
                                "202",
                                with_links(
                                    json_resp(
                                        "Accepted: the new command's state (`Location` names it).",
                                        r("CommandState"),
                                    ),
                                    by_id(),
                                ),
                            ),
                            ("400", err_resp("Malformed JSON, wrong field types, bad id, unknown type, params the handler refuses, a bad output, or a bad wait.")),
                            ("404", err_resp("Unknown queue.")),
                            ("409", err_resp("The id exists with another body or output.")),
                            ("413", err_resp("Body over max_command_body.")),
                            ("415", err_resp("`unsupported_media_type`: the Content-Type is not JSON; send `application/json` (a `+json` type, or no Content-Type, is read as JSON too).")),
                            ("503", err_resp("Backend unavailable, or a wait found every live-reader slot taken (Retry-After).")),
                        ])),
                    ),
                    submit_body,
                ),
                post(commands::submit).route_layer(middleware::from_fn(plumbing::require_json)),
            ),
        Route::json("/v1/commands/{id}", Access::Token).on(
            Method::GET,
            Access::Token,
            op(
                "A command's state",
                "commands",
                json!([
                    id(),
                    query("wait", "Hold the request until the command is terminal or this long passes (`30s`, `500ms`, `2m`; at most 5m).",
                          json!({ "type": "string" })),
                ]),
                protected(map(vec![
                    ("200", json_resp("The command state.", r("CommandState"))),
                    ("400", err_resp("Bad id or wait.")),
                    ("404", err_resp("Unknown command.")),
                    ("503", err_resp("A wait holds a live-reader slot; all are taken (Retry-After).")),
                ])),
            ),
            get(commands::get_command),
        ),
        Route::json("/v1/commands/{id}/cancel", Access::Token).on(
            Method::POST,
            Access::Token,
            op(
                "Cancel a command",
                "commands",
                json!([id()]),
                protected(map(vec![
                    ("200", json_resp("Cancelled: the state.", r("CommandState"))),
                    ("400", err_resp("Bad id.")),
                    ("404", err_resp("Unknown command.")),
                    ("409", err_resp("Already terminal; `state` holds it.")),
                ])),
            ),
            post(commands::cancel),
        ),
        Route::json("/v1/queues/{queue}/commands/batch", Access::Queue(Write)).on(
            Method::POST,
            Access::Queue(Write),
            with_body(
                op(
                    "Submit up to 1000 commands in one request",
                    "commands",
                    json!([d.queue()]),
                    protected(map(vec![
                        (
                            "200",
                            json_resp(
                                "One result per item, in the order of the items: each the status and body a submit of that item alone would answer (`202` created, `200` stored already with the same body: `state`; else `error`, `message`). No `?wait=`.",
                                r("BatchSubmitReport"),
                            ),
                        ),
                        ("400", err_resp("Malformed JSON (`invalid_json`), or a body that is not `{\"commands\": [1 to 1000 items]}` (`invalid_body`). A bad item is refused in its own result.")),
                        ("404", err_resp("Unknown queue.")),
                        ("413", err_resp("Body over 16 MiB (or over max_command_body when that is larger).")),
                        ("415", err_resp("`unsupported_media_type`: the Content-Type is not JSON; send `application/json` (a `+json` type, or no Content-Type, is read as JSON too).")),
                    ])),
                ),
                json!({ "required": true, "content": { "application/json": { "schema": r("BatchSubmitRequest"),
                    "examples": { "two": { "value": { "commands": [
                        { "type": "echo", "params": { "n": 1 } },
                        { "id": "nap-1", "type": "sleep", "params": { "ms": 100 } } ] } } } } } }),
            ),
            post(commands::batch).route_layer(middleware::from_fn(plumbing::require_json)),
        ),
        Route::json("/v1/queues/{queue}/commands/bulk", Access::Queue(Write)).on(
            Method::POST,
            Access::Queue(Write),
            with_body(
                op(
                    "Cancel or re-run the commands a filter selects (or count them: dry_run)",
                    "commands",
                    json!([d.queue()]),
                    protected(map(vec![
                        ("200", json_resp("What was done.", r("BulkReport"))),
                        ("400", err_resp("Bad body (`invalid_body`), status, time or cursor.")),
                        ("404", err_resp("Unknown queue.")),
                    ])),
                ),
                json!({ "required": true, "content": { "application/json": { "schema": r("BulkRequest") } } }),
            ),
            post(commands::bulk),
        ),
        Route::json("/v1/commands/{id}/schedule", Access::Token).on(
            Method::POST,
            Access::Token,
            with_body(
                op(
                    "Move a scheduled command's due time",
                    "commands",
                    json!([id()]),
                    protected(map(vec![
                        ("200", json_resp("Rescheduled: the state (its new `run_at`; a `rescheduled` event in its queue's feed).", r("CommandState"))),
                        ("400", err_resp("Bad id or body (`run_at` or `delay`, exactly one).")),
                        ("404", err_resp("Unknown command.")),
                        ("409", err_resp("Not waiting for a due time any more (`not_scheduled`: not scheduled, enqueued already, started or ended); `state` holds it.")),
                    ])),
                ),
                json!({ "required": true, "content": { "application/json": { "schema": r("ScheduleRequest") } } }),
            ),
            post(commands::reschedule),
        ),
        Route::json("/v1/commands/{id}/retry", Access::Token).on(
            Method::POST,
            Access::Token,
            op(
                "Re-run a FAILED or CANCELLED command",
                "commands",
                json!([id()]),
                protected(map(vec![
                    ("200", json_resp("Submitted again: the state (`SUBMITTED`; its history is in its events).", r("CommandState"))),
                    ("400", err_resp("Bad id.")),
                    ("404", err_resp("Unknown command.")),
                    ("409", err_resp("Not FAILED or CANCELLED (`not_retryable`); `state` holds it.")),
                ])),
            ),
            post(commands::retry),
        ),
        Route::json("/v1/commands/{id}/events", Access::Token).on(
            Method::GET,
            Access::Token,
            feed_op(
                "A command's events (Durable Streams read: catch-up, long-poll or SSE)",
                id(),
                "Unknown or expired command (`not_found`).",
            ),
            get(feed::command_events),
        ),
    ]
}

/// Queue statistics and dead letters.
fn queue_routes(d: &Docs) -> Vec<Route> {
    let first_queue = || json!({ "queue": "$response.body#/queues/0/name" });
    vec![
        Route::json("/v1/queues", Access::Token).on(
            Method::GET,
            Access::Token,
            op(
                "Queues and their statistics",
                "queues",
                json!([]),
                protected(map(vec![(
                    "200",
                    with_links(
                        json_resp(
                            "Every queue the caller may read.",
                            json!({ "type": "object", "required": ["queues"],
                                    "properties": { "queues": { "type": "array", "items": r("Queue") } } }),
                        ),
                        json!({
                            "GetQueue": link("get", "/v1/queues/{queue}", first_queue()),
                            "ListCommands": link("get", "/v1/queues/{queue}/commands", first_queue()),
                            "SubmitCommand": link("post", "/v1/queues/{queue}/commands", first_queue()),
                            "ListDeadLetters": link("get", "/v1/queues/{queue}/dead-letters", first_queue()),
                        }),
                    ),
                )])),
            ),
            get(queues::list_queues),
        ),
        Route::json("/v1/queues/{queue}", Access::Queue(Write)).on(
            Method::GET,
            Access::Queue(Read),
            op(
                "One queue's statistics",
                "queues",
                json!([d.queue()]),
                protected(map(vec![("200", json_resp("The queue.", r("Queue"))), ("404", err_resp("Unknown queue."))])),
            ),
            get(queues::one_queue),
        ),
        Route::json("/v1/queues/{queue}/events", Access::Queue(Write)).on(
            Method::GET,
            Access::Queue(Read),
            feed_op(
                "A queue's command events (Durable Streams read: catch-up, long-poll or SSE)",
                d.queue(),
                "Unknown queue (`unknown_queue`).",
            ),
            get(feed::queue_events),
        ),
        Route::json("/v1/queues/{queue}/minutes", Access::Queue(Read)).on(
            Method::GET,
            Access::Queue(Read),
            op(
                "A queue's per-minute work: outcomes, handler durations, depth and oldest age",
                "queues",
                json!([
                    d.queue(),
                    query(
                        "last",
                        "This many minutes, the current one last, 1 to 120 (default 60).",
                        json!({ "type": "integer", "minimum": 1, "maximum": 120 })
                    ),
                ]),
                protected(map(vec![
                    (
                        "200",
                        json_resp(
                            "The minutes, oldest first (minutes without work are zeros), and the duration buckets' upper bounds (ms).",
                            json!({ "type": "object", "required": ["minutes", "bounds_ms"], "properties": {
                                "minutes": { "type": "array", "items": r("Minute") },
                                "bounds_ms": { "type": "array", "items": { "type": "integer", "minimum": 1 } } } }),
                        ),
                    ),
                    ("400", err_resp("Bad last.")),
                    ("404", err_resp("Unknown queue.")),
                ])),
            ),
            get(queues::minutes),
        ),
        Route::json("/v1/queues/{queue}/schedules", Access::Queue(Read)).on(
            Method::GET,
            Access::Queue(Read),
            op(
                "A queue's cron schedules: their settings, next due time and last fire",
                "queues",
                json!([d.queue()]),
                protected(map(vec![
                    (
                        "200",
                        json_resp(
                            "The queue's schedules as configured on this server, in configuration order.",
                            json!({ "type": "object", "required": ["schedules"], "properties": {
                                "schedules": { "type": "array", "items": r("Schedule") } } }),
                        ),
                    ),
                    ("404", err_resp("Unknown queue.")),
                ])),
            ),
            get(queues::schedules),
        ),
        Route::json("/v1/queues/{queue}/pause", Access::Queue(Write)).on(
            Method::POST,
            Access::Queue(Write),
            op(
                "Pause a queue: submits are accepted, no worker starts a new command until it is resumed",
                "queues",
                json!([d.queue()]),
                protected(map(vec![
                    ("200", json_resp("The queue, now paused; `changed` is false when it already was.", r("QueueChange"))),
                    ("404", err_resp("Unknown queue.")),
                ])),
            ),
            post(queues::pause),
        ),
        Route::json("/v1/queues/{queue}/resume", Access::Queue(Write)).on(
            Method::POST,
            Access::Queue(Write),
            op(
                "Resume a paused queue: its waiting commands start at once, oldest first",
                "queues",
                json!([d.queue()]),
                protected(map(vec![
                    ("200", json_resp("The queue, now running; `changed` is false when it already was.", r("QueueChange"))),
                    ("404", err_resp("Unknown queue.")),
                ])),
            ),
            post(queues::resume),
        ),
        Route::json("/v1/queues/{queue}/workers", Access::Queue(Read)).on(
            Method::GET,
            Access::Queue(Read),
            op(
                "A queue's workers, live and dead, with the commands they hold",
                "queues",
                json!([d.queue()]),
                protected(map(vec![
                    (
                        "200",
                        json_resp(
                            "Every consumer of the queue's group, in name order.",
                            json!({ "type": "object", "required": ["workers", "alive", "dead"], "properties": {
                                "workers": { "type": "array", "items": r("Worker") },
                                "alive": { "type": "integer", "minimum": 0 }, "dead": { "type": "integer", "minimum": 0 } } }),
                        ),
                    ),
                    ("404", err_resp("Unknown queue.")),
                ])),
            ),
            get(queues::workers),
        ),
        Route::json("/v1/queues/{queue}/dead-letters", Access::Queue(Admin))
            .on(
                Method::GET,
                Access::Queue(Read),
                op(
                    "Dead letters, oldest first",
                    "queues",
                    json!([
                        d.queue(),
                        query(
                            "limit",
                            "At most this many, 1 to 1000 (default 100).",
                            json!({ "type": "integer", "minimum": 1, "maximum": 1000 })
                        ),
                        query("of", "`commands` (default): the commands' dead letters; `webhook`: the completion webhook deliveries'.", json!({ "type": "string", "enum": ["commands", "webhook"] })),
                    ]),
                    protected(map(vec![
                        (
                            "200",
                            with_links(
                                json_resp(
                                    "Dead letters.",
                                    json!({ "type": "object", "required": ["items"],
                                            "properties": { "items": { "type": "array", "items": r("DeadLetter") } } }),
                                ),
                                json!({
                                    "ReplayOne": link("post", "/v1/queues/{queue}/dead-letters/{id}/replay",
                                        json!({ "queue": "$request.path.queue", "id": "$response.body#/items/0/id" })),
                                }),
                            ),
                        ),
                        ("400", err_resp("Bad limit.")),
                        ("404", err_resp("Unknown queue.")),
                    ])),
                ),
                get(queues::dead_letters),
            )
            .on(
                Method::DELETE,
                Access::Queue(Admin),
                op(
                    "Purge every dead letter (admin)",
                    "queues",
                    json!([d.queue(), query("of", "`commands` (default): the commands' dead letters; `webhook`: the completion webhook deliveries'.", json!({ "type": "string", "enum": ["commands", "webhook"] }))]),
                    protected(map(vec![
                        (
                            "200",
                            json_resp(
                                "How many were deleted.",
                                json!({ "type": "object", "required": ["purged"],
                                        "properties": { "purged": { "type": "integer", "minimum": 0 } } }),
                            ),
                        ),
                        ("404", err_resp("Unknown queue.")),
                    ])),
                ),
                delete(queues::purge),
            ),
        Route::json("/v1/queues/{queue}/dead-letters/replay", Access::Queue(Admin)).on(
            Method::POST,
            Access::Queue(Admin),
            op(
                "Replay dead letters, oldest first (admin)",
                "queues",
                json!([
                    d.queue(),
                    query(
                        "limit",
                        "At most this many, 1 to 100000 (default 1000).",
                        json!({ "type": "integer", "minimum": 1, "maximum": 100000 })
                    ),
                    query("of", "`commands` (default): the commands' dead letters; `webhook`: the completion webhook deliveries'.", json!({ "type": "string", "enum": ["commands", "webhook"] })),
                ]),
                protected(map(vec![
                    (
                        "200",
                        json_resp(
                            "How many were put back.",
                            json!({ "type": "object", "required": ["replayed"],
                                    "properties": { "replayed": { "type": "integer", "minimum": 0 } } }),
                        ),
                    ),
                    ("400", err_resp("Bad limit.")),
                    ("404", err_resp("Unknown queue.")),
                ])),
            ),
            post(queues::replay_all),
        ),
        Route::json("/v1/queues/{queue}/dead-letters/{id}/replay", Access::Queue(Admin)).on(
            Method::POST,
            Access::Queue(Admin),
            op(
                "Replay one dead letter (admin)",
                "queues",
                json!([d.queue(), path_param("id", "Dead-letter id (`<ms>-<seq>`)."), query("of", "`commands` (default): the commands' dead letters; `webhook`: the completion webhook deliveries'.", json!({ "type": "string", "enum": ["commands", "webhook"] }))]),
                protected(map(vec![
                    (
                        "200",
                        json_resp(
                            "Put back at the queue's tail.",
                            json!({ "type": "object", "required": ["replayed", "id"],
                                    "properties": { "replayed": { "type": "string" }, "id": { "type": "string" } } }),
                        ),
                    ),
                    ("400", err_resp("Bad id.")),
                    ("404", err_resp("Unknown queue or dead letter.")),
                ])),
            ),
            post(queues::replay_one),
        ),
    ]
}

/// The HTTP worker protocol: claim, renew and settle a queue's commands (`work`).
fn worker_routes(d: &Docs) -> Vec<Route> {
    let params = || {
        json!([
            d.queue(),
            path_param(
                "worker",
                "The worker's name: 1 to 128 bytes, no control characters; one name per worker process."
            )
        ])
    };
    let body = |schema: Value, example: Value| json!({ "required": true, "content": { "application/json": { "schema": schema, "examples": { "example": { "value": example } } } } });
    let lease_states = json!({ "type": "string", "enum": ["held", "lost", "gone"] });
    let settlement = json!({ "type": "object", "required": ["lease", "outcome"], "additionalProperties": false, "properties": {
        "lease": { "type": "string" },
        "outcome": { "type": "string", "enum": ["succeeded", "failed", "cancelled", "running", "handed_off", "rate_limited", "error", "release"] },
        "result": { "description": "`succeeded`: the result, any JSON, kept byte for byte (default null)." },
        "error": { "type": "string", "description": "`failed` / `error`: the message." },
        "next_check": { "type": "string", "description": "`running`: when to call check_status (`10s`; default the queue's check_status_interval)." },
        "queue": { "type": "string", "description": "`handed_off`: the queue the command continues on (one of this server's, not the command's own)." },
        "retry_after": { "type": "string", "description": "`rate_limited` (required): how long every worker of the queue backs off before the command is handed out again (`2s`; above 0, at most 1h)." } } });
    let settled = json!({ "type": "object", "required": ["applied", "command"], "properties": {
        "applied": { "type": "boolean" },
        "command": { "oneOf": [r("CommandState"), { "type": "null" }] } } });
    let route = |path: &'static str,
                 summary: &str,
                 doc_body: Value,
                 ok: Value,
                 errors: Vec<(&str, Value)>,
                 handler: MethodRouter<AppState>| {
        let mut responses = vec![
            ("200", ok),
            ("404", err_resp("Unknown queue.")),
            ("413", err_resp("Body over max_command_body.")),
            ("415", err_resp("`unsupported_media_type`: the Content-Type is not JSON.")),
        ];
        responses.extend(errors);
        Route::json(path, Access::Queue(Work)).on(
            Method::POST,
            Access::Queue(Work),
            with_body(op(summary, "workers", params(), protected(map(responses))), doc_body),
            handler.route_layer(middleware::from_fn(plumbing::require_json)),
        )
    };
    vec![
        route(
            "/v1/queues/{queue}/workers/{worker}/claim",
            "Claim commands (long-poll)",
            body(
                json!({ "type": "object", "additionalProperties": false, "properties": {
                    "max": { "type": "integer", "minimum": 1, "maximum": 100, "description": "At most this many commands (default 1)." },
                    "wait": { "type": "string", "description": "Wait this long for the first command when none is ready (`30s`, `500ms`; default `0s`; a longer wait is cut to the server's long-poll timeout)." } } }),
                json!({ "max": 10, "wait": "30s" }),
            ),
            json_resp(
                "The claimed commands (an empty list when none came within `wait`, or the server is shutting down).",
                json!({ "type": "object", "required": ["leases"], "properties": { "leases": { "type": "array", "items": {
                    "type": "object", "required": ["lease", "call", "command", "deliveries", "lease_timeout_ms"],
                    "properties": {
                        "lease": { "type": "string", "description": "Opaque token: give it to renew and settle." },
                        "call": { "type": "string", "enum": ["execute", "check_status"] },
                        "command": r("CommandState"),
                        "deliveries": { "type": "integer", "minimum": 1, "description": "Deliveries of this command's message, this one included." },
                        "lease_timeout_ms": { "type": "integer", "minimum": 1, "description": "The queue's claim timeout: renew at a third of it." },
                        "output": { "type": "object", "required": ["stream", "url", "content_type"], "additionalProperties": false,
                            "description": "The command's output stream (submitted with `output`), opened for this delivery: append to `url` with `Producer-Id`/`Producer-Epoch` as given and `Producer-Seq` from 0 (this fences the writer of an earlier delivery). Absent for a command without one.",
                            "properties": {
                                "stream": { "type": "string" }, "url": { "type": "string" }, "content_type": { "type": "string" },
                                "producer_id": { "type": "string", "description": "Absent when the stream could not be opened (it had ended)." },
                                "producer_epoch": { "type": "integer", "minimum": 0 } } } } } } } }),
            ),
            vec![
                ("400", err_resp("Malformed body (`max`, `wait`) or worker name.")),
                ("503", err_resp("A wait found every live-reader slot taken (Retry-After), or the backend is unavailable.")),
            ],
            post(remote::claim),
        ),
        route(
            "/v1/queues/{queue}/workers/{worker}/renew",
            "Renew leases; see cancellations",
            body(
                json!({ "type": "object", "required": ["leases"], "additionalProperties": false, "properties": {
                    "leases": { "type": "array", "maxItems": 1000, "items": { "oneOf": [
                        { "type": "string", "description": "A lease from claim." },
                        { "type": "object", "required": ["lease"], "additionalProperties": false,
                          "description": "A lease with a report, written into the command's state (`progress`, `details`) while the lease is held.",
                          "properties": {
                            "lease": { "type": "string" },
                            "progress": r("Progress"),
                            "details": { "description": "A checkpoint of the worker's own (any JSON, at most 64 KiB): handed to the command's next delivery." } } }] } } } }),
                json!({ "leases": ["<lease>", { "lease": "<lease>", "progress": { "fraction": 0.5, "message": "page 3 of 6" }, "details": { "page": 3 } }] }),
            ),
            json_resp(
                "One entry per lease, in the request's order.",
                json!({ "type": "object", "required": ["leases"], "properties": { "leases": { "type": "array", "items": {
                    "type": "object", "required": ["lease", "state", "cancelled"],
                    "properties": {
                        "lease": { "type": "string" },
                        "state": lease_states,
                        "cancelled": { "type": "boolean", "description": "The command was cancelled (or ended otherwise): stop; a settlement changes nothing." } } } } } }),
            ),
            vec![("400", err_resp("Malformed body (the message names the item: `leases[2]: …`, with its `index` in the body; nothing was renewed) or worker name."))],
            post(remote::renew),
        ),
        route(
            "/v1/queues/{queue}/workers/{worker}/settle",
            "Settle claimed commands (one, or many at once)",
            body(
                json!({ "oneOf": [settlement.clone(), { "type": "object", "required": ["settlements"], "additionalProperties": false, "properties": {
                    "settlements": { "type": "array", "minItems": 1, "maxItems": 1000, "items": settlement } } }] }),
                json!({ "lease": "<lease>", "outcome": "succeeded", "result": { "ok": true } }),
            ),
            json_resp(
                "Settled. One settlement: `applied` is false when the command had already ended or moved on (cancelled): nothing was written. Many: one entry per settlement, in order, each as one settlement's answer with its `lease`, or `error` and `message` (`lease_lost`: stop, do not retry it; another code: retry that one).",
                json!({ "oneOf": [settled.clone(), { "type": "object", "required": ["settlements"], "properties": {
                    "settlements": { "type": "array", "items": { "oneOf": [
                        { "type": "object", "required": ["lease", "applied", "command"], "properties": {
                            "lease": { "type": "string" }, "applied": { "type": "boolean" },
                            "command": { "oneOf": [r("CommandState"), { "type": "null" }] } } },
                        { "type": "object", "required": ["lease", "error", "message"], "properties": {
                            "lease": { "type": "string" }, "error": { "type": "string" }, "message": { "type": "string" } } }] } } } }] }),
            ),
            vec![
                ("400", err_resp("Malformed body (the message names the field, and for many settlements the item: `settlements[2]: …`, with its `index` in the body; nothing was settled), lease token, worker name, or a hand-off to a queue this server does not have (`unknown_queue`) or to the command's own.")),
                ("409", err_resp("`lease_lost` (one settlement): the lease is not this worker's any more; nothing changed. Stop; do not retry.")),
            ],
            post(remote::settle),
        ),
    ]
}
