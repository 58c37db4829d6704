//! The HTTP face of Baton: the Durable Streams protocol under `/v1/stream/{path}`, plus
//! `/healthz`, `/readyz`, `/metrics` and a small index at `/`. Handlers only translate between
//! HTTP and the engine ([`baton_streams::StreamStore`]).

// Errors are on cold paths; boxing them buys nothing measurable.
#![allow(clippy::result_large_err)]

pub mod commands;
mod dashboard;
mod edge;
pub mod errors;
pub mod headers;
pub mod queues;
mod sse;
mod streams;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, MethodRouter};
use axum::Router;
use baton_streams::{StreamError, StreamPath, StreamStore};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

use crate::config::{Backend, ServeConfig};
use errors::ApiError;

/// Shared state of every handler: one `Arc`, so the per-request clones (each middleware layer
/// and extractor takes one) are a single reference-count increment.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl AppState {
    pub fn new(shared: Shared) -> Self {
        AppState(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// What [`AppState`] holds.
pub struct Shared {
    pub store: StreamStore,
    pub cfg: Arc<ServeConfig>,
    /// One permit per live reader (long-poll or SSE).
    pub live: Arc<Semaphore>,
    /// Cancelled when the server shuts down: live reads end cleanly.
    pub shutdown: CancellationToken,
    /// The command API (store and configured queues).
    pub commands: commands::CommandsApi,
    /// Bearer tokens (none: open server).
    pub auth: Arc<crate::auth::Auth>,
}

impl AppState {
    /// A live-reader slot, or 503 with `Retry-After` when all are taken.
    pub fn live_permit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.live.clone().try_acquire_owned().map_err(|_| {
            metrics::counter!("baton_live_readers_refused_total").increment(1);
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "too_many_live_readers",
                format!(
                    "this server already has {} live readers (long-poll and SSE); retry later or read without live=",
                    self.cfg.max_live_readers
                ),
            )
            .with_header(header::RETRY_AFTER, 2)
        })
    }
}

/// The process-wide Prometheus recorder (installed once; later servers in the same process share it).
/// Histograms are exported with these buckets (seconds).
pub(crate) fn prometheus() -> Option<&'static PrometheusHandle> {
    const BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| PrometheusBuilder::new().set_buckets(BUCKETS).and_then(|b| b.install_recorder()).ok())
        .as_ref()
}

/// A route of the API: its path template (axum syntax) and the methods it serves. The router
/// is built from [`route_table`]; `/openapi.json` must describe exactly these (tests/openapi.rs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteDef {
    pub path: &'static str,
    pub methods: &'static [&'static str],
}

impl RouteDef {
    pub const fn new(path: &'static str, methods: &'static [&'static str]) -> Self {
        Self { path, methods }
    }
}

fn routes() -> Vec<(RouteDef, MethodRouter<AppState>)> {
    const STREAM: &[&str] = &["GET", "HEAD", "PUT", "POST", "DELETE"];
    let mut v = vec![
        (RouteDef::new("/v1/stream/{*path}", STREAM), any(streams::handle)),
        (RouteDef::new("/v1/stream", STREAM), any(no_path)),
        (RouteDef::new("/v1/stream/", STREAM), any(no_path)),
        (RouteDef::new("/healthz", &["GET"]), get(healthz)),
        (RouteDef::new("/readyz", &["GET"]), get(readyz)),
        (RouteDef::new("/metrics", &["GET"]), get(metrics_text)),
        (RouteDef::new("/openapi.json", &["GET"]), get(crate::openapi::serve)),
        (RouteDef::new("/", &["GET"]), get(dashboard::index_or_page)),
    ];
    v.extend(commands::routes());
    v.extend(queues::routes());
    v.extend(dashboard::routes());
    v
}

/// Every route the router serves (see [`RouteDef`]).
pub fn route_table() -> Vec<RouteDef> {
    routes().into_iter().map(|(d, _)| d).collect()
}

/// Builds the router.
pub fn router(state: AppState) -> Router {
    let _ = prometheus();
    let cors = cors_layer(&state.cfg);
    let edge = edge::Edge::new(&state.cfg);
    let mut r = Router::new();
    for (def, method_router) in routes() {
        r = r.route(def.path, method_router);
    }
    r.route_layer(middleware::from_fn_with_state(state.clone(), crate::auth::layer))
        .route_layer(middleware::from_fn(queues::track))
        .fallback(not_found)
        .layer(cors)
        .layer(middleware::from_fn_with_state(edge, edge::layer))
        .with_state(state)
}

fn cors_layer(cfg: &ServeConfig) -> CorsLayer {
    let origin = match &cfg.cors_origins {
        None => AllowOrigin::any(),
        Some(list) => AllowOrigin::list(list.iter().filter_map(|o| HeaderValue::from_str(o).ok())),
    };
    let mut expose: Vec<HeaderName> = headers::ALL.iter().map(|h| HeaderName::from_static(h)).collect();
    expose.extend([header::ETAG, header::LOCATION, header::RETRY_AFTER]);
    CorsLayer::new()
        .allow_origin(origin)
        .allow_methods([Method::GET, Method::HEAD, Method::PUT, Method::POST, Method::DELETE, Method::OPTIONS])
        .allow_headers(AllowHeaders::mirror_request())
        .expose_headers(expose)
        .max_age(Duration::from_secs(86_400))
}

async fn no_path() -> Response {
    ApiError::bad_request("a stream URL needs a path after /v1/stream/, e.g. /v1/stream/acme/run-1").into_response()
}

async fn not_found() -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "no_route",
        "no such endpoint; streams live under /v1/stream/{path}, commands under /v1/queues and /v1/commands (see /openapi.json)",
    )
        .into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// 200 when the backend answers, 503 otherwise.
async fn readyz(State(state): State<AppState>) -> Response {
    let probe = StreamPath::new("__baton/readyz").expect("valid probe path");
    let fut = state.store.head(&probe);
    match tokio::time::timeout(Duration::from_secs(3), fut).await {
        Ok(Ok(_)) | Ok(Err(StreamError::NotFound { .. })) | Ok(Err(StreamError::Gone { .. })) => {
            match tokio::time::timeout(Duration::from_secs(3), state.commands.probe()).await {
                Ok(Ok(())) => "ready\n".into_response(),
                Ok(Err(e)) => {
                    (StatusCode::SERVICE_UNAVAILABLE, format!("command store not reachable: {e}\n")).into_response()
                }
                Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "command store did not answer within 3s\n").into_response(),
            }
        }
        Ok(Err(e)) => (StatusCode::SERVICE_UNAVAILABLE, format!("stream store not reachable: {e}\n")).into_response(),
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "stream store did not answer within 3s\n").into_response(),
    }
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    queues::sample_metrics(&state.commands).await;
    metrics::gauge!("baton_live_readers").set((state.cfg.max_live_readers - state.live.available_permits()) as f64);
    match prometheus() {
        Some(h) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], h.render()).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "metrics recorder not installed\n").into_response(),
    }
}

async fn index(State(state): State<AppState>) -> Response {
    let backend = describe_backend(&state.cfg.backend);
    let body = serde_json::json!({
        "service": "baton",
        "version": env!("CARGO_PKG_VERSION"),
        "backend": backend,
        "streams": "/v1/stream/{path}",
        "protocol": "Durable Streams (PROTOCOL.md); extensions in docs/http-api.md",
        "commands": ["/v1/queues", "/v1/queues/{queue}/commands", "/v1/commands/{id}"],
        "queues": state.commands.queue_names(),
        "auth": if state.auth.enabled() { "bearer" } else { "none" },
        "endpoints": ["/healthz", "/readyz", "/metrics", "/openapi.json"],
    });
    ([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// One line describing the backend, for logs and `/`.
pub fn describe_backend(b: &Backend) -> String {
    match b {
        Backend::Memory => "in-memory (nothing survives a restart)".to_string(),
        Backend::Redis(c) => c.to_string(),
    }
}
