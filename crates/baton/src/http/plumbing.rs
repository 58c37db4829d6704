//! Request plumbing shared by the handlers: reading a body within a limit, the query rules of
//! the command and queue API, path parameters, and the caller left by the auth layer.
//!
//! Handlers list their extractors in this order (axum runs them in argument order, so the
//! first failing check answers): [`QueueName`] or [`IdParam`], then [`Query`].

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::ops::Deref;

use axum::body::Body;
use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::Request;
use axum::extract::{FromRequestParts, RawPathParams};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use baton_commands::CommandStatus;
use bytes::{Bytes, BytesMut};
use futures::StreamExt;

use super::errors::{cut, echo, ApiError};
use super::state::AppState;
use crate::auth::Principal;

// ------------------------------------------------------------------------------------------------
// Bodies
// ------------------------------------------------------------------------------------------------

/// Bodies up to this far past the limit are read and discarded (not kept) before the 413, so a
/// client still sending gets the status instead of a broken pipe.
const DRAIN_CAP: usize = 64 << 20;

/// The error a request body gives when it stops arriving: the server's connection loop wraps
/// every request body so that a wait of `after` for its next bytes ends it with this error
/// (the HTTP layer answers it `408 body_timeout` and closes the connection).
#[derive(Debug)]
pub struct BodyTimeout {
    /// How long the body had sent nothing.
    pub after: std::time::Duration,
}

impl std::fmt::Display for BodyTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the request body stopped arriving: no bytes for {:?}", self.after)
    }
}

impl std::error::Error for BodyTimeout {}

/// The `408` of a body that stopped arriving (`e` is the body's error, if it is that).
fn body_timeout(e: &axum::Error) -> Option<ApiError> {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(t) = c.downcast_ref::<BodyTimeout>() {
            let msg = format!(
                "{t} (the server's --header-timeout also bounds each wait for more of a request body); send the whole body (as Content-Length announces) without pausing"
            );
            return Some(
                ApiError::new(StatusCode::REQUEST_TIMEOUT, "body_timeout", msg)
                    .with_header(header::CONNECTION, "close"),
            );
        }
        cause = c.source();
    }
    None
}

/// How a route limits its request bodies.
pub struct BodyLimit {
    /// The largest body, in bytes.
    pub limit: usize,
    /// The message of the `413 body_too_large`: given the body's size as text (`"2048"`, or
    /// `"more than 70000000"` when reading stopped) and the limit.
    pub too_large: fn(&str, usize) -> String,
    /// The `400` code when the body cannot be read.
    pub unreadable: &'static str,
}

/// Reads the whole body, refusing more than `rules.limit` bytes with `413 body_too_large`. A
/// body declared (`Content-Length`) or found to be far over the limit is refused with
/// `Connection: close`, and so is one that stopped arriving ([`BodyTimeout`]: `408
/// body_timeout`).
pub async fn read_body(body: Body, headers: &HeaderMap, rules: &BodyLimit) -> Result<Bytes, ApiError> {
    let limit = rules.limit;
    let too_large = |n: String, close: bool| {
        let e = ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", (rules.too_large)(&n, limit));
        if close {
            e.with_header(header::CONNECTION, "close")
        } else {
            e
        }
    };
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok());
    if let Some(n) = declared.filter(|n| *n > limit.saturating_add(DRAIN_CAP)) {
        return Err(too_large(n.to_string(), true));
    }
    let mut stream = body.into_data_stream();
    let mut buf = BytesMut::new();
    let mut total = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            body_timeout(&e)
                .unwrap_or_else(|| ApiError::invalid(rules.unreadable, format!("could not read the request body: {e}")))
        })?;
        total = total.saturating_add(chunk.len());
        if total > limit.saturating_add(DRAIN_CAP) {
            return Err(too_large(format!("more than {total}"), true));
        }
        if total <= limit {
            buf.extend_from_slice(&chunk);
        }
    }
    if total > limit {
        return Err(too_large(total.to_string(), false));
    }
    // Copied, never kept as received: a frame is a slice of the connection's read buffer, and
    // keeping it (the memory backend stores appends) would pin that whole buffer.
    Ok(buf.freeze())
}

/// True unless the request declares a body of another type than JSON: no `Content-Type` (the
/// body is read as JSON), `application/json` or any `…/…+json` type, with or without parameters,
/// in any case.
pub fn may_be_json(headers: &HeaderMap) -> bool {
    let Some(ct) = headers.get(header::CONTENT_TYPE) else { return true };
    let media = String::from_utf8_lossy(ct.as_bytes()).split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    media == "application/json" || (media.contains('/') && media.ends_with("+json"))
}

/// Route layer of the endpoints that take a JSON body: a `Content-Type` that is not JSON (a
/// form, `text/plain`, …) is `415 unsupported_media_type`, before the handler reads anything;
/// without a `Content-Type` the body is read as JSON.
pub async fn require_json(req: Request, next: Next) -> Response {
    if may_be_json(req.headers()) {
        return next.run(req).await;
    }
    let got = echo(&String::from_utf8_lossy(req.headers()[header::CONTENT_TYPE].as_bytes()));
    ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
        format!("this endpoint takes a JSON body, and this request's Content-Type is {got}; send the body as JSON with `Content-Type: application/json`"),
    )
    .into_response()
}

// ------------------------------------------------------------------------------------------------
// Query strings of the command and queue API (the streams protocol has its own: `headers`)
// ------------------------------------------------------------------------------------------------

/// Query parameters as (key, value), refusing keys outside `allowed` and repeated keys.
pub fn query_params(query: Option<&str>, allowed: &[&str]) -> Result<BTreeMap<String, String>, ApiError> {
    let mut out = BTreeMap::new();
    for (k, v) in url::form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        if !allowed.contains(&k.as_ref()) {
            let takes = if allowed.is_empty() { "no query parameters".to_string() } else { allowed.join(", ") };
            return Err(ApiError::invalid(
                "invalid_query",
                format!("unknown query parameter {}; this endpoint takes {takes}", echo(&k)),
            ));
        }
        if out.insert(k.to_string(), v.into_owned()).is_some() {
            return Err(ApiError::invalid("invalid_query", format!("give the query parameter {} once", cut(&k))));
        }
    }
    Ok(out)
}

/// A `1..=max` integer query parameter (default `default`).
pub fn limit_param(q: &BTreeMap<String, String>, default: usize, max: usize) -> Result<usize, ApiError> {
    match q.get("limit") {
        None => Ok(default),
        Some(s) => match s.trim().parse::<usize>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ => Err(ApiError::invalid(
                "invalid_limit",
                format!("limit must be an integer from 1 to {max}; got {}", echo(s)),
            )),
        },
    }
}

/// The `status` query parameter: a command status (any case), or none when absent or empty.
pub fn status_param(q: &BTreeMap<String, String>) -> Result<Option<CommandStatus>, ApiError> {
    match q.get("status").map(|s| s.trim()).filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(s) => s.parse::<CommandStatus>().map(Some).map_err(|_| {
            ApiError::invalid(
                "invalid_status",
                format!("status {} is not one of SUBMITTED, RUNNING, SUCCEEDED, FAILED, CANCELLED (any case)", echo(s)),
            )
        }),
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

/// A queue's dead letters: `?limit=&of=` (`of`: `commands`, the default, or `webhook`).
pub struct DeadLetterQuery;
impl QuerySpec for DeadLetterQuery {
    const ALLOWED: &'static [&'static str] = &["limit", "of"];
}

/// One dead letter, or a purge: `?of=`.
pub struct OfQuery;
impl QuerySpec for OfQuery {
    const ALLOWED: &'static [&'static str] = &["of"];
}

/// `?last=`.
pub struct LastQuery;
impl QuerySpec for LastQuery {
    const ALLOWED: &'static [&'static str] = &["last"];
}

/// `?status=&cursor=&limit=`.
pub struct ListQueryParams;
impl QuerySpec for ListQueryParams {
    const ALLOWED: &'static [&'static str] =
        &["status", "cursor", "limit", "type", "id_prefix", "created_after", "created_before", "scheduled"];
}

/// `?queue=&status=&limit=`.
pub struct DashboardQuery;
impl QuerySpec for DashboardQuery {
    const ALLOWED: &'static [&'static str] = &["queue", "status", "limit"];
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
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        Ok(Query(query_params(parts.uri.query(), Q::ALLOWED)?, PhantomData))
    }
}

// ------------------------------------------------------------------------------------------------
// Path parameters and the caller
// ------------------------------------------------------------------------------------------------

/// The named path parameter, percent-decoded.
pub fn path_param(params: &Result<RawPathParams, RawPathParamsRejection>, name: &str) -> Result<String, ApiError> {
    let params =
        params.as_ref().map_err(|e| ApiError::invalid("invalid_path", format!("{e}; percent-encode UTF-8")))?;
    params
        .iter()
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
        .ok_or_else(|| ApiError::invalid("invalid_path", format!("missing path parameter {name}")))
}

/// The `{queue}` path parameter, percent-decoded, naming a configured queue: `400 invalid_path`
/// or `404 unknown_queue` ([`super::state::CommandsApi::queue`]) otherwise.
pub struct QueueName(pub String);

impl FromRequestParts<AppState> for QueueName {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, st: &AppState) -> Result<Self, ApiError> {
        let queue = path_param(&RawPathParams::from_request_parts(parts, st).await, "queue")?;
        st.commands.queue(&queue)?;
        Ok(QueueName(queue))
    }
}

/// The `{id}` path parameter, percent-decoded (`400 invalid_path`); the handler validates it.
pub struct IdParam(pub String);

impl<S: Send + Sync> FromRequestParts<S> for IdParam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, st: &S) -> Result<Self, ApiError> {
        Ok(IdParam(path_param(&RawPathParams::from_request_parts(parts, st).await, "id")?))
    }
}

/// The caller, as left by the auth layer (a missing one is refused, never treated as open).
pub fn principal(req_ext: &axum::http::Extensions) -> Result<Principal, ApiError> {
    req_ext.get::<Principal>().cloned().ok_or_else(|| ApiError::forbidden("request was not authenticated"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries() {
        assert_eq!(
            query_params(Some("wiat=3s"), &["wait"]).unwrap_err().message,
            "unknown query parameter \"wiat\"; this endpoint takes wait"
        );
        assert_eq!(
            query_params(Some("x=1"), &[]).unwrap_err().message,
            "unknown query parameter \"x\"; this endpoint takes no query parameters"
        );
        assert_eq!(
            query_params(Some("wait=1s&wait=2s"), &["wait"]).unwrap_err().message,
            "give the query parameter wait once"
        );
        let q = query_params(Some("limit=0&status=running"), &["limit", "status"]).unwrap();
        assert_eq!(
            limit_param(&q, 100, 1000).unwrap_err().message,
            "limit must be an integer from 1 to 1000; got \"0\""
        );
        assert_eq!(status_param(&q).unwrap(), Some(CommandStatus::Running));
        let q = query_params(Some("status=&limit=7"), &["limit", "status"]).unwrap();
        assert_eq!((status_param(&q).unwrap(), limit_param(&q, 100, 1000).unwrap()), (None, 7));
        assert_eq!(limit_param(&BTreeMap::new(), 100, 1000).unwrap(), 100);
    }

    #[tokio::test]
    async fn bodies_within_their_limit() {
        let rules = BodyLimit { limit: 4, too_large: |n, limit| format!("{n} > {limit}"), unreadable: "x" };
        let read = |b: &'static str, declared: Option<&str>| {
            let mut h = HeaderMap::new();
            if let Some(d) = declared {
                h.insert(header::CONTENT_LENGTH, d.parse().unwrap());
            }
            let rules = &rules;
            async move { read_body(Body::from(b), &h, rules).await }
        };
        assert_eq!(read("abcd", None).await.unwrap(), "abcd");
        let e = read("abcde", None).await.unwrap_err();
        assert_eq!((e.status, e.code, e.message.as_str()), (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", "5 > 4"));
        assert!(e.headers.get(header::CONNECTION).is_none());
        let e = read("", Some("999999999")).await.unwrap_err();
        assert_eq!(e.message, "999999999 > 4");
        assert_eq!(e.headers.get(header::CONNECTION).unwrap(), "close");
    }
}
