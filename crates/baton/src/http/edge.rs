//! The outermost layer of every request: the request header size limit (431), browser security
//! headers (PROTOCOL.md §12.7) and the request counter (static label values, no allocation per
//! request). CORS is tower-http's `CorsLayer`, just inside this layer (see `super::cors_layer`).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::errors::ApiError;
use crate::settings::ServeConfig;

/// The per-server setting of [`layer`]; its header values are the constants below, built at
/// compile time.
pub struct Edge {
    max_header_bytes: usize,
}

const NOSNIFF: (HeaderName, HeaderValue) =
    (HeaderName::from_static("x-content-type-options"), HeaderValue::from_static("nosniff"));
const CORP: (HeaderName, HeaderValue) =
    (HeaderName::from_static("cross-origin-resource-policy"), HeaderValue::from_static("cross-origin"));

impl Edge {
    pub fn new(cfg: &ServeConfig) -> Arc<Edge> {
        Arc::new(Edge { max_header_bytes: cfg.max_header_bytes })
    }
}

/// Method and status as static label values (no allocation per request).
pub(crate) fn method_label(m: &Method) -> metrics::SharedString {
    let name = match *m {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::PUT => "PUT",
        Method::POST => "POST",
        Method::DELETE => "DELETE",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        _ => return m.as_str().to_string().into(),
    };
    name.into()
}

/// The status code as a label value (static for the codes this server sends).
pub(crate) fn status_label(s: StatusCode) -> metrics::SharedString {
    let code = match s.as_u16() {
        200 => "200",
        201 => "201",
        204 => "204",
        206 => "206",
        304 => "304",
        400 => "400",
        401 => "401",
        403 => "403",
        404 => "404",
        405 => "405",
        409 => "409",
        410 => "410",
        412 => "412",
        413 => "413",
        415 => "415",
        429 => "429",
        431 => "431",
        500 => "500",
        502 => "502",
        503 => "503",
        n => return n.to_string().into(),
    };
    code.into()
}

/// The span of one request (`http.request`, target `baton::trace`), in the request's extensions
/// when spans are exported, so that the auth layer (a route layer, which knows the matched route)
/// can name it before it enters it. A request no route matches (404) or refused here (431) keeps
/// the name `<METHOD>`.
#[derive(Clone)]
pub struct RequestSpan(pub tracing::Span);

impl RequestSpan {
    /// Records the route template (`/v1/queues/{queue}/commands`) as `http.route` and names the
    /// span `<METHOD> <route>`.
    pub fn route(&self, method: &axum::http::Method, route: &str) {
        self.0.record("http.route", route);
        self.0.record("otel.name", format!("{method} {route}"));
    }
}

pub async fn layer(State(edge): State<Arc<Edge>>, mut req: Request, next: Next) -> Response {
    let header_bytes: usize = req.headers().iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum();
    let method = method_label(req.method());
    // Disabled (and free) unless spans are exported (`--otlp-endpoint`).
    let span = tracing::info_span!(
        target: baton_commands::trace::SPAN_TARGET,
        "http.request",
        otel.name = %req.method(),
        otel.kind = "server",
        http.request.method = %req.method(),
        url.path = %req.uri().path(),
        http.route = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    if !span.is_disabled() {
        let cx = super::headers::trace_context(req.headers());
        baton_commands::trace::set_parent(&span, cx.as_ref());
        req.extensions_mut().insert(RequestSpan(span.clone()));
    }
    let mut res = if header_bytes > edge.max_header_bytes {
        ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            format!("request headers take {header_bytes} bytes; this server accepts at most {}", edge.max_header_bytes),
        )
        .into_response()
    } else {
        // Entered by the auth layer once the route is known (a span's name is fixed when it is
        // first entered).
        next.run(req).await
    };
    if !span.is_disabled() {
        span.record("http.response.status_code", res.status().as_u16());
        if res.status().is_server_error() {
            span.record("otel.status_code", "ERROR");
        }
    }
    let h = res.headers_mut();
    h.insert(NOSNIFF.0, NOSNIFF.1);
    h.insert(CORP.0, CORP.1);
    metrics::counter!("baton_http_requests_total", "method" => method, "status" => status_label(res.status()))
        .increment(1);
    res
}
