//! The HTTP face of Baton: the Durable Streams protocol under `/v1/stream/{path}`, the command
//! and queue API, the dashboard, `/healthz`, `/readyz`, `/metrics` and `/openapi.json`. Handlers
//! only translate between HTTP and the engines. `PROTOCOL.md` in this layer's docs is the Durable
//! Streams protocol document (github.com/durable-streams/durable-streams), not a file of Baton.
//!
//! Every route is declared once, in [`routes::table`]: its handlers, what each method needs
//! (auth) and its OpenAPI operation. Inside this module too, a module uses only those listed
//! before it (tests/layers.rs):
//!
//! `json` → `names` → `errors` → `headers` → `state` → `plumbing` → `openapi` → `edge` →
//! `sse` → `streams` → `subscriptions` → `commands` → `remote` → `queues` → `feed` → `dashboard` → `ops` →
//! `access` → `routes` → this file ([`router`]).

// Errors are on cold paths; boxing them buys nothing measurable.
#![allow(clippy::result_large_err)]

mod access;
mod commands;
mod dashboard;
mod edge;
pub mod errors;
mod feed;
pub mod headers;
mod json;
pub mod names;
pub mod openapi;
pub mod ops;
mod plumbing;
mod queues;
mod remote;
pub mod routes;
mod sse;
mod state;
mod streams;
mod subscriptions;

use std::time::Duration;

use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::Router;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

use crate::settings::ServeConfig;
pub use errors::ApiError;
pub use plumbing::BodyTimeout;
pub use state::{AppState, CommandsApi, Shared};

/// Builds the router of `baton serve` from the route table, inside the CORS layer and the edge
/// layer (`edge.rs`); paths outside the table get `404 no_route`.
pub fn router(state: AppState) -> Router {
    let _ = ops::prometheus();
    let cors = cors_layer(&state.cfg);
    let edge = edge::Edge::new(&state.cfg);
    let queues = state.commands.queue_names();
    let mut r = Router::new();
    for route in routes::table(&openapi::Docs { queues: &queues }) {
        let path = route.path;
        r = r.route(path, route.into_method_router(&state));
    }
    r.fallback(not_found).layer(cors).layer(middleware::from_fn_with_state(edge, edge::layer)).with_state(state)
}

fn cors_layer(cfg: &ServeConfig) -> CorsLayer {
    let origin = match &cfg.cors_origins {
        None => AllowOrigin::any(),
        Some(list) => AllowOrigin::list(list.iter().filter_map(|o| HeaderValue::from_str(o).ok())),
    };
    let mut expose: Vec<HeaderName> = names::ALL.iter().map(|h| HeaderName::from_static(h)).collect();
    expose.extend([header::ETAG, header::LOCATION, header::RETRY_AFTER]);
    CorsLayer::new()
        .allow_origin(origin)
        .allow_methods([Method::GET, Method::HEAD, Method::PUT, Method::POST, Method::DELETE, Method::OPTIONS])
        .allow_headers(AllowHeaders::mirror_request())
        .expose_headers(expose)
        .max_age(Duration::from_secs(86_400))
}

async fn not_found() -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "no_route",
        "no such endpoint; streams live under /v1/stream/{path}, commands under /v1/queues and /v1/commands (see /openapi.json)",
    )
    .into_response()
}
