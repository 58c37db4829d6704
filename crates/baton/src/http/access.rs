//! The auth layer of every route: strips `access_token` from the URL, authenticates the bearer
//! token, asks the policy ([`crate::auth`]) for what the route declares it needs
//! ([`super::routes`]), and leaves the [`Principal`] in the request extensions for handlers.
//!
//! The token is read from `Authorization: Bearer <token>`, or from the query parameter
//! `access_token` (for browser `EventSource`, which cannot set headers). The query parameter is
//! removed from the request before any handler (or anything that might log the URL) sees it.
//! A request without a valid token is `401` with `WWW-Authenticate: Bearer`; a valid token
//! outside its scope is `403`. A request that presents more than one credential (two
//! `Authorization` headers, `access_token` twice, or both) is `400 duplicate_credentials`: none of
//! them is silently preferred.

use std::sync::Arc;

use axum::extract::{RawPathParams, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::errors::{cut_values, ApiError};
use super::headers::{fork_source, stream_forked_from, stream_path, STREAM_PREFIX};
use super::state::AppState;
use crate::auth::{Access, Principal, Target};

/// What one route's methods need: by method (`HEAD` as `GET` unless listed), and for the
/// methods it does not serve (they are checked before being answered 405).
#[derive(Clone, Debug)]
pub struct Rules {
    pub by_method: Vec<(Method, Access)>,
    pub unserved: Access,
}

impl Rules {
    /// What a request with `method` needs.
    pub fn access(&self, method: &Method) -> Access {
        let find = |m: &Method| self.by_method.iter().find(|(k, _)| k == m).map(|(_, a)| *a);
        find(method)
            .or_else(|| if *method == Method::HEAD { find(&Method::GET) } else { None })
            .unwrap_or(self.unserved)
    }
}

/// The state of one route's auth layer.
#[derive(Clone)]
pub struct Guard {
    pub state: AppState,
    pub rules: Arc<Rules>,
}

/// Removes every `access_token` from the query; returns their values and the cleaned URI.
fn take_query_token(uri: &Uri) -> (Vec<String>, Option<Uri>) {
    let Some(q) = uri.query() else { return (Vec::new(), None) };
    if !q.split('&').any(|p| p == "access_token" || p.starts_with("access_token=")) {
        return (Vec::new(), None);
    }
    let mut token = Vec::new();
    let mut kept = Vec::new();
    for (k, v) in url::form_urlencoded::parse(q.as_bytes()) {
        if k == "access_token" {
            token.push(v.into_owned());
        } else {
            kept.push((k.into_owned(), v.into_owned()));
        }
    }
    let mut s = uri.path().to_string();
    if !kept.is_empty() {
        s.push('?');
        s.push_str(&url::form_urlencoded::Serializer::new(String::new()).extend_pairs(kept).finish());
    }
    (token, s.parse().ok())
}

fn unauthorized(message: &str, invalid: bool) -> Response {
    metrics::counter!("baton_auth_failures_total", "reason" => if invalid { "invalid" } else { "missing" })
        .increment(1);
    let challenge = if invalid { "Bearer realm=\"baton\", error=\"invalid_token\"" } else { "Bearer realm=\"baton\"" };
    let mut res = ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message).into_response();
    res.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    res
}

fn duplicate(message: &str) -> Response {
    ApiError::invalid("duplicate_credentials", message).into_response()
}

fn forbidden(message: String) -> Response {
    metrics::counter!("baton_auth_failures_total", "reason" => "forbidden").increment(1);
    ApiError::forbidden(message).into_response()
}

/// The layer (module docs).
///
/// When spans are exported, the request's span (made by the edge layer, not entered yet) learns
/// its route here and the rest of the request runs in it.
pub async fn layer(State(guard): State<Guard>, req: Request, next: Next) -> Response {
    let span = req.extensions().get::<super::edge::RequestSpan>().cloned();
    match span {
        None => checked(guard, req, next).await,
        Some(span) => {
            if let Some(route) = req.extensions().get::<axum::extract::MatchedPath>() {
                span.route(req.method(), route.as_str());
            }
            tracing::Instrument::instrument(checked(guard, req, next), span.0).await
        }
    }
}

async fn checked(guard: Guard, req: Request, next: Next) -> Response {
    let (mut parts, body) = req.into_parts();
    let (mut query_token, cleaned) = take_query_token(&parts.uri);
    if let Some(u) = cleaned {
        parts.uri = u;
    }
    if !guard.state.auth.enabled() {
        // An open server: every check passes for `Principal::Open`.
        parts.extensions.insert(Principal::Open);
        return next.run(Request::from_parts(parts, body)).await;
    }
    let access = guard.rules.access(&parts.method);
    let principal = if access == Access::Public {
        Principal::Open
    } else {
        let mut headers = parts.headers.get_all(header::AUTHORIZATION).iter();
        let (first, second) = (headers.next(), headers.next());
        if second.is_some() {
            return duplicate(
                "this request has more than one Authorization header; send one, `Authorization: Bearer <token>`",
            );
        }
        if query_token.len() > 1 {
            return duplicate("access_token is given more than once in the query; give it once");
        }
        if first.is_some() && !query_token.is_empty() {
            return duplicate(
                "this request has both an Authorization header and ?access_token=; send the token one way only",
            );
        }
        let header_token = match first {
            None => None,
            Some(v) => {
                let v = v.to_str().unwrap_or("");
                match v.split_once(' ') {
                    Some((scheme, t)) if scheme.eq_ignore_ascii_case("bearer") => Some(t.trim().to_string()),
                    _ => return unauthorized("the Authorization header must be `Bearer <token>`", true),
                }
            }
        };
        let Some(presented) = header_token.or(query_token.pop()) else {
            return unauthorized(
                "this server needs a token: send `Authorization: Bearer <token>` (or ?access_token= for EventSource)",
                false,
            );
        };
        match guard.state.auth.find(presented.as_bytes()) {
            Some(t) => Principal::Token(t),
            None => return unauthorized("the token is not valid on this server", true),
        }
    };
    let target = match access {
        Access::Stream(_) | Access::StreamCreate => {
            let raw = parts.uri.path().strip_prefix(STREAM_PREFIX).unwrap_or("");
            // Malformed paths are refused by the handler with 400; nothing is touched.
            let stream = stream_path(raw).ok().map(|p| p.as_str().to_string());
            let fork_source = match access {
                Access::StreamCreate => parts
                    .headers
                    .get(stream_forked_from())
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| fork_source(v.trim()).ok())
                    .map(|p| p.as_str().to_string()),
                _ => None,
            };
            Target { stream, fork_source, queue: None }
        }
        Access::Queue(_) => {
            let params =
                <RawPathParams as axum::extract::FromRequestParts<()>>::from_request_parts(&mut parts, &()).await;
            let queue = params.ok().and_then(|p| p.iter().find(|(k, _)| *k == "queue").map(|(_, v)| v.to_string()));
            Target { queue, ..Target::default() }
        }
        Access::Public | Access::Token | Access::Admin => Target::default(),
    };
    if let Err(m) = principal.authorize(access, &target) {
        let asked = [&target.stream, &target.fork_source, &target.queue];
        let asked: Vec<&str> = asked.into_iter().flatten().map(String::as_str).collect();
        return forbidden(cut_values(m, &asked));
    }
    parts.extensions.insert(principal);
    next.run(Request::from_parts(parts, body)).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::Op;

    #[test]
    fn query_token_is_removed() {
        let u: Uri = "/v1/stream/a/b?offset=-1&access_token=s3cr%2Bt&live=sse".parse().unwrap();
        let (t, cleaned) = take_query_token(&u);
        assert_eq!(t, ["s3cr+t"]);
        assert_eq!(cleaned.unwrap().to_string(), "/v1/stream/a/b?offset=-1&live=sse");
        let (t, cleaned) = take_query_token(&"/x?a=1".parse().unwrap());
        assert!(t.is_empty() && cleaned.is_none());
        let (t, cleaned) = take_query_token(&"/x?access_token=a&access_token=b".parse().unwrap());
        assert_eq!((t, cleaned.unwrap().to_string()), (vec!["a".to_string(), "b".to_string()], "/x".to_string()));
    }

    #[test]
    fn head_is_read_as_get_and_unserved_methods_get_their_rule() {
        let rules = Rules {
            by_method: vec![(Method::GET, Access::Queue(Op::Read)), (Method::DELETE, Access::Queue(Op::Admin))],
            unserved: Access::Queue(Op::Write),
        };
        assert_eq!(rules.access(&Method::HEAD), Access::Queue(Op::Read));
        assert_eq!(rules.access(&Method::DELETE), Access::Queue(Op::Admin));
        assert_eq!(rules.access(&Method::PATCH), Access::Queue(Op::Write));
    }
}
