//! The Durable Streams reserved subscription API under `/v1/stream/__ds/` (as the reference
//! server `@durable-streams/server` 0.3.7 serves it), over [`baton_subscriptions::Subscriptions`].
//!
//! | Route | Success | Errors |
//! |---|---|---|
//! | `PUT subscriptions/{id}` (JSON body) | `201` + view (created), `200` + view (identical) | `400 INVALID_REQUEST` / `WEBHOOK_URL_REJECTED`, `409 SUBSCRIPTION_ALREADY_EXISTS` |
//! | `GET subscriptions/{id}` | `200` + view | `404 SUBSCRIPTION_NOT_FOUND` |
//! | `DELETE subscriptions/{id}` | `204` (also for an unknown id) | |
//! | `POST subscriptions/{id}/streams` `{"streams": [...]}` | `204` | `400`, `404` |
//! | `DELETE subscriptions/{id}/streams/{path}` (path percent-decoded) | `204` | `404` |
//! | `POST subscriptions/{id}/callback` / `ack` (bearer callback / claim token) `{"wake_id", "generation", "acks"?, "done"?}` | `200` `{"ok": true, "next_wake": bool}` | `400 INVALID_REQUEST` (`wake_id` or `generation` missing, a bad field), `401 TOKEN_INVALID`, `404`, `409 FENCED` / `INVALID_OFFSET` |
//! | `POST subscriptions/{id}/claim` `{"worker": "..."}` | `200` claim | `400`, `404`, `409 ALREADY_CLAIMED` / `NO_PENDING_WORK` |
//! | `POST subscriptions/{id}/release` (bearer claim token) | `204` | as `ack` |
//! | `GET jwks.json` | `200` `application/jwk-set+json`, `Cache-Control: public, max-age=300` | |
//! | anything else under `__ds` | | `404 SUBSCRIPTION_NOT_FOUND` "Durable Streams control route not found" |
//!
//! Every error of these routes is the protocol's body `{"error": {"code": "...", "message":
//! "..."}}` (not Baton's `{"error": code, "message": text}`), except those of Baton's outer
//! layers (auth `401`/`403`, `405`, `431`). An empty body is `{}`; a body that is not JSON is
//! `400 INVALID_REQUEST` "Invalid JSON body". Backend failures are `503 UNAVAILABLE` with
//! `Retry-After: 1`.
//!
//! Baton's own route over the same service, [`rotate_signing_key`] (`POST
//! /v1/subscriptions/signing-keys/rotate`, admin), answers Baton's error shape instead.

use std::collections::HashMap;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use baton_subscriptions::SubscriptionError;
use serde_json::{json, Value};

use super::errors::ApiError;
use super::json::json_response;
use super::plumbing::{read_body, BodyLimit};
use super::state::AppState;

type Params = Result<Path<HashMap<String, String>>, axum::extract::rejection::PathRejection>;

/// A protocol error response: `status` with `{"error": {"code", "message"}}`.
fn protocol_error(status: StatusCode, code: &str, message: &str) -> Response {
    json_status(status, json!({ "error": { "code": code, "message": message } }))
}

fn json_status(status: StatusCode, v: Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

fn service_error(e: SubscriptionError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut res = json_status(status, e.body());
    if status.is_server_error() {
        tracing::warn!(code = e.code(), error = %e, "subscription request failed");
        res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    res
}

/// A Baton error of the body reader (`413`, `408`, unreadable) in the protocol's shape, keeping
/// its status and headers.
fn from_api(e: ApiError) -> Response {
    let mut res = protocol_error(e.status, "INVALID_REQUEST", &e.message);
    res.headers_mut().extend(e.headers);
    res
}

/// The path parameter `name`, or a protocol 400 (a path that is not UTF-8 once decoded).
fn param(params: &Params, name: &str) -> Result<String, Response> {
    match params {
        Ok(Path(m)) => m.get(name).cloned().ok_or_else(|| {
            protocol_error(StatusCode::BAD_REQUEST, "INVALID_REQUEST", &format!("missing path parameter {name}"))
        }),
        Err(e) => Err(protocol_error(StatusCode::BAD_REQUEST, "INVALID_REQUEST", &format!("bad path: {e}"))),
    }
}

/// The JSON body: empty is `{}`; not JSON is `400 INVALID_REQUEST` "Invalid JSON body".
async fn json_body(st: &AppState, headers: &HeaderMap, body: Body) -> Result<Value, Response> {
    let rules = BodyLimit {
        limit: st.commands.max_body().max(64 << 10),
        too_large: |n, limit| format!("request body is {n} bytes; subscription requests take at most {limit} bytes"),
        unreadable: "invalid_body",
    };
    let bytes = read_body(body, headers, &rules).await.map_err(from_api)?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    serde_json::from_slice(&bytes)
        .map_err(|_| protocol_error(StatusCode::BAD_REQUEST, "INVALID_REQUEST", "Invalid JSON body"))
}

/// The callback or claim token of `Authorization: Bearer <token>`, or `401 TOKEN_INVALID`.
fn bearer(headers: &HeaderMap) -> Result<String, Response> {
    let missing =
        || protocol_error(StatusCode::UNAUTHORIZED, "TOKEN_INVALID", "Missing or malformed Authorization header");
    let v = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).ok_or_else(missing)?;
    match v.split_once(' ') {
        Some((scheme, t)) if scheme.eq_ignore_ascii_case("bearer") && !t.trim().is_empty() => Ok(t.trim().to_string()),
        _ => Err(missing()),
    }
}

fn no_content() -> Response {
    StatusCode::NO_CONTENT.into_response()
}

fn done(r: Result<Response, Response>) -> Response {
    r.unwrap_or_else(|e| e)
}

/// `PUT subscriptions/{id}`.
pub async fn create(State(st): State<AppState>, params: Params, headers: HeaderMap, body: Body) -> Response {
    done(
        async {
            let id = param(&params, "id")?;
            let body = json_body(&st, &headers, body).await?;
            let (created, view) = st.subscriptions.create(&id, &body).await.map_err(service_error)?;
            Ok(json_status(if created { StatusCode::CREATED } else { StatusCode::OK }, view))
        }
        .await,
    )
}

/// `GET subscriptions/{id}`.
pub async fn get(State(st): State<AppState>, params: Params) -> Response {
    done(
        async {
            let id = param(&params, "id")?;
            let view = st.subscriptions.get(&id).await.map_err(service_error)?;
            Ok(json_status(StatusCode::OK, view))
        }
        .await,
    )
}

/// `DELETE subscriptions/{id}`.
pub async fn delete(State(st): State<AppState>, params: Params) -> Response {
    done(
        async {
            let id = param(&params, "id")?;
            st.subscriptions.delete(&id).await.map_err(service_error)?;
            Ok(no_content())
        }
        .await,
    )
}

/// `POST subscriptions/{id}/streams`.
pub async fn add_streams(State(st): State<AppState>, params: Params, headers: HeaderMap, body: Body) -> Response {
    done(
        async {
            let id = param(&params, "id")?;
            let body = json_body(&st, &headers, body).await?;
            st.subscriptions.add_streams(&id, &body).await.map_err(service_error)?;
            Ok(no_content())
        }
        .await,
    )
}

/// `DELETE subscriptions/{id}/streams/{*path}`.
pub async fn remove_stream(State(st): State<AppState>, params: Params) -> Response {
    done(
        async {
            let id = param(&params, "id")?;
            let path = param(&params, "path")?;
            st.subscriptions.remove_stream(&id, &path).await.map_err(service_error)?;
            Ok(no_content())
        }
        .await,
    )
}

/// `POST subscriptions/{id}/callback` (webhook).
pub async fn callback(State(st): State<AppState>, params: Params, headers: HeaderMap, body: Body) -> Response {
    done(
        async {
            let id = param(&params, "id")?;
            let token = bearer(&headers)?;
            let body = json_body(&st, &headers, body).await?;
            let reply = st.subscriptions.callback(&id, &token, &body).await.map_err(service_error)?;
            Ok(json_status(StatusCode::OK, reply))
        }
        .await,
    )
}

/// `POST subscriptions/{id}/ack` (pull-wake).
pub async fn ack(State(st): State<AppState>, params: Params, headers: HeaderMap, body: Body) -> Response {
    done(
        async {
            let id = param(&params, "id")?;
            let token = bearer(&headers)?;
            let body = json_body(&st, &headers, body).await?;
            let reply = st.subscriptions.ack(&id, &token, &body).await.map_err(service_error)?;
            Ok(json_status(StatusCode::OK, reply))
        }
        .await,
    )
}

/// `POST subscriptions/{id}/release` (pull-wake).
pub async fn release(State(st): State<AppState>, params: Params, headers: HeaderMap, body: Body) -> Response {
    done(
        async {
            let id = param(&params, "id")?;
            let token = bearer(&headers)?;
            let body = json_body(&st, &headers, body).await?;
            st.subscriptions.release(&id, &token, &body).await.map_err(service_error)?;
            Ok(no_content())
        }
        .await,
    )
}

/// `POST subscriptions/{id}/claim` (pull-wake).
pub async fn claim(State(st): State<AppState>, params: Params, headers: HeaderMap, body: Body) -> Response {
    done(
        async {
            let id = param(&params, "id")?;
            let body = json_body(&st, &headers, body).await?;
            let reply = st.subscriptions.claim(&id, &body).await.map_err(service_error)?;
            Ok(json_status(StatusCode::OK, reply))
        }
        .await,
    )
}

/// `GET jwks.json`.
pub async fn jwks(State(st): State<AppState>) -> Response {
    match st.subscriptions.jwks().await {
        Ok(keys) => (
            [(header::CONTENT_TYPE, "application/jwk-set+json"), (header::CACHE_CONTROL, "public, max-age=300")],
            keys.to_string(),
        )
            .into_response(),
        Err(e) => service_error(e),
    }
}

/// `POST /v1/subscriptions/signing-keys/rotate` (admin; Baton's API, not the protocol's): makes a
/// new webhook signing key current and answers `200` `{"kid": "<new kid>", "jwks_url":
/// "<public url>/v1/stream/__ds/jwks.json"}`. The JWKS then lists the new key first and keeps the
/// retired one for 7 days; other processes on the same Redis sign with the new key from their
/// next registry poll (the rotation bumps the registry version). Errors (Baton's
/// `{"error", "message"}`): `503 backend_unavailable` with `Retry-After: 1`.
pub async fn rotate_signing_key(State(st): State<AppState>) -> Response {
    match st.subscriptions.rotate_signing_key().await {
        Ok(kid) => {
            tracing::info!(kid = %kid, "webhook signing key rotated");
            let jwks_url = format!("{}/v1/stream/__ds/jwks.json", st.public_url.trim_end_matches('/'));
            json_response(json!({ "kid": kid, "jwks_url": jwks_url }))
        }
        Err(e) => ApiError::unavailable(e).into_response(),
    }
}

/// Any other path under `/v1/stream/__ds`, any method.
pub async fn unknown() -> Response {
    protocol_error(StatusCode::NOT_FOUND, "SUBSCRIPTION_NOT_FOUND", "Durable Streams control route not found")
}
