//! Optional bearer tokens (TOML `[[tokens]]`): each token is allowed a set of operations on
//! stream path prefixes (scopes) and on queues.
//!
//! ```toml
//! [[tokens]]
//! name = "ci"                  # shown in logs and 403 messages; never the secret
//! token_env = "BATON_CI_TOKEN" # or token = "…" (at least 16 characters)
//! operations = ["read", "write"]   # read, write, admin (admin also allows read and write)
//! streams = ["acme", "ci/runs"]    # stream path prefixes, segment-wise; "*" = every stream
//! queues = ["default"]             # queue names; "*" = every queue
//! ```
//!
//! `BATON_ADMIN_TOKEN` adds one token named `admin` with every operation everywhere.
//!
//! What each request needs: reading streams (GET, HEAD) and commands, queues and dead letters
//! (GET) is `read`; creating, appending to, closing and deleting streams, submitting and
//! cancelling commands is `write`; replaying and purging dead letters is `admin`. `/`, `/healthz`,
//! `/readyz`, `/metrics` and `/openapi.json` are public. Forking a stream (`PUT` with
//! `Stream-Forked-From`) also needs `read` on the source stream. A request without a valid token is `401`
//! with `WWW-Authenticate: Bearer`; a valid token outside its scope is `403`.
//!
//! The token is read from `Authorization: Bearer <token>`, or from the query parameter
//! `access_token` (for browser `EventSource`, which cannot set headers). The query parameter is
//! removed from the request before any handler (or anything that might log the URL) sees it.
//! Tokens are compared in constant time (`subtle`), against every configured token. With no
//! tokens configured every request is allowed (announced at startup).

use std::fmt;
use std::sync::Arc;

use axum::extract::{MatchedPath, RawPathParams, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use subtle::ConstantTimeEq;

use crate::http::commands::JsonError;
use crate::http::AppState;

/// Shortest accepted token, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;

/// An operation a token may be allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Admin,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Admin => "admin",
        }
    }
}

/// `[[tokens]]` as written in TOML.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct TokenFile {
    pub name: String,
    pub token: Option<String>,
    pub token_env: Option<String>,
    pub operations: Vec<String>,
    #[serde(default)]
    pub streams: Vec<String>,
    #[serde(default)]
    pub queues: Vec<String>,
}

/// A resolved token. `Debug` never shows the secret.
#[derive(Clone)]
pub struct TokenConfig {
    pub name: String,
    secret: Vec<u8>,
    read: bool,
    write: bool,
    admin: bool,
    /// Stream path prefixes without surrounding `/`; `""` matches every stream.
    pub streams: Vec<String>,
    /// Queue names; `"*"` matches every queue.
    pub queues: Vec<String>,
}

impl fmt::Debug for TokenConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenConfig")
            .field("name", &self.name)
            .field("secret", &"<redacted>")
            .field("operations", &self.operations())
            .field("streams", &self.streams)
            .field("queues", &self.queues)
            .finish()
    }
}

impl TokenConfig {
    /// A token with every operation on every stream and queue.
    pub fn admin(name: &str, secret: &str) -> Result<Self, String> {
        Self::new(name, secret, &["admin"], &["*"], &["*"])
    }

    /// A token from its parts. Errors: a secret shorter than [`MIN_TOKEN_LEN`], an unknown
    /// operation, no operation.
    pub fn new(name: &str, secret: &str, ops: &[&str], streams: &[&str], queues: &[&str]) -> Result<Self, String> {
        if secret.len() < MIN_TOKEN_LEN {
            return Err(format!("token {name:?} is shorter than {MIN_TOKEN_LEN} characters; use a long random secret"));
        }
        if ops.is_empty() {
            return Err(format!("token {name:?} has no operations; give some of read, write, admin"));
        }
        let mut t = TokenConfig {
            name: name.to_string(),
            secret: secret.as_bytes().to_vec(),
            read: false,
            write: false,
            admin: false,
            streams: streams
                .iter()
                .map(|p| if p.trim() == "*" { String::new() } else { p.trim().trim_matches('/').to_string() })
                .collect(),
            queues: queues.iter().map(|q| q.trim().to_string()).collect(),
        };
        for op in ops {
            match op.trim().to_ascii_lowercase().as_str() {
                "read" => t.read = true,
                "write" => t.write = true,
                "admin" => t.admin = true,
                other => return Err(format!("token {name:?}: unknown operation {other:?}; use read, write or admin")),
            }
        }
        Ok(t)
    }

    fn operations(&self) -> Vec<&'static str> {
        [(self.read, "read"), (self.write, "write"), (self.admin, "admin")]
            .into_iter()
            .filter_map(|(on, n)| on.then_some(n))
            .collect()
    }

    fn allows(&self, op: Op) -> bool {
        self.admin
            || match op {
                Op::Read => self.read,
                Op::Write => self.write,
                Op::Admin => false,
            }
    }

    fn covers_stream(&self, path: &str) -> bool {
        self.streams.iter().any(|p| {
            p.is_empty() || path == p || (path.starts_with(p.as_str()) && path.as_bytes().get(p.len()) == Some(&b'/'))
        })
    }

    fn covers_queue(&self, queue: &str) -> bool {
        self.queues.iter().any(|q| q == "*" || q == queue)
    }
}

/// Resolves `[[tokens]]` (reading `token_env` variables) plus an optional admin token.
/// Errors name the token: both or neither of `token`/`token_env`, an unset variable, a short
/// secret, an unknown operation, two tokens with one name or one secret.
pub fn resolve_tokens(files: Vec<TokenFile>, admin_token: Option<String>) -> Result<Vec<TokenConfig>, String> {
    let mut out: Vec<TokenConfig> = Vec::new();
    for f in files {
        let secret = match (&f.token, &f.token_env) {
            (Some(s), None) => s.clone(),
            (None, Some(var)) => {
                std::env::var(var).map_err(|_| format!("token {:?}: environment variable {var} is not set", f.name))?
            }
            _ => return Err(format!("token {:?}: give exactly one of token or token_env", f.name)),
        };
        let ops: Vec<&str> = f.operations.iter().map(String::as_str).collect();
        let streams: Vec<&str> = f.streams.iter().map(String::as_str).collect();
        let queues: Vec<&str> = f.queues.iter().map(String::as_str).collect();
        out.push(TokenConfig::new(&f.name, &secret, &ops, &streams, &queues)?);
    }
    if let Some(s) = admin_token.filter(|s| !s.is_empty()) {
        out.push(TokenConfig::admin("admin", &s).map_err(|e| format!("BATON_ADMIN_TOKEN: {e}"))?);
    }
    for (i, a) in out.iter().enumerate() {
        for b in &out[..i] {
            if a.name == b.name {
                return Err(format!("two tokens are named {:?}; names must be unique", a.name));
            }
            if a.secret == b.secret {
                return Err(format!("tokens {:?} and {:?} have the same secret", b.name, a.name));
            }
        }
    }
    Ok(out)
}

/// Who is calling: anyone (no tokens configured) or the holder of one token.
#[derive(Clone, Debug)]
pub enum Principal {
    Open,
    Token(Arc<TokenConfig>),
}

impl Principal {
    /// `Ok` when `op` on the stream `path` is allowed; else the 403 message.
    pub fn check_stream(&self, op: Op, path: &str) -> Result<(), String> {
        match self {
            Principal::Open => Ok(()),
            Principal::Token(t) if t.allows(op) && t.covers_stream(path) => Ok(()),
            Principal::Token(t) => Err(format!(
                "token {:?} may not {} stream {path:?} (operations: {}; stream prefixes: {})",
                t.name,
                op.as_str(),
                t.operations().join(", "),
                list(&t.streams.iter().map(|p| if p.is_empty() { "*" } else { p }).collect::<Vec<_>>())
            )),
        }
    }

    /// `Ok` when `op` on `queue` is allowed; else the 403 message.
    pub fn check_queue(&self, op: Op, queue: &str) -> Result<(), String> {
        match self {
            Principal::Open => Ok(()),
            Principal::Token(t) if t.allows(op) && t.covers_queue(queue) => Ok(()),
            Principal::Token(t) => Err(format!(
                "token {:?} may not {} queue {queue:?} (operations: {}; queues: {})",
                t.name,
                op.as_str(),
                t.operations().join(", "),
                list(&t.queues.iter().map(String::as_str).collect::<Vec<_>>())
            )),
        }
    }

    /// True when `op` on `queue` is allowed (for filtering listings).
    pub fn can_queue(&self, op: Op, queue: &str) -> bool {
        self.check_queue(op, queue).is_ok()
    }

    /// `Ok` for the open server and admin tokens.
    fn check_admin(&self) -> Result<(), String> {
        match self {
            Principal::Open => Ok(()),
            Principal::Token(t) if t.admin => Ok(()),
            Principal::Token(t) => Err(format!("token {:?} may not use this endpoint (it needs admin)", t.name)),
        }
    }
}

fn list(v: &[&str]) -> String {
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

/// The configured tokens.
#[derive(Debug, Default)]
pub struct Auth {
    tokens: Vec<Arc<TokenConfig>>,
}

impl Auth {
    pub fn new(tokens: Vec<TokenConfig>) -> Self {
        Auth { tokens: tokens.into_iter().map(Arc::new).collect() }
    }

    /// True when tokens are configured (requests need one).
    pub fn enabled(&self) -> bool {
        !self.tokens.is_empty()
    }

    /// The token matching `presented`, compared in constant time against every token (no early
    /// exit; only the lengths of secrets are not hidden).
    fn find(&self, presented: &[u8]) -> Option<Arc<TokenConfig>> {
        let mut found = None;
        for t in &self.tokens {
            // `ct_eq` of slices is constant-time for equal lengths and false otherwise.
            if bool::from(t.secret.as_slice().ct_eq(presented)) {
                found = Some(t.clone());
            }
        }
        found
    }
}

/// What a route needs.
enum Need {
    Public,
    Stream(Op),
    Queue(Op),
    /// The handler checks (the queue is known only after loading the command), or the listing
    /// is filtered: any valid token passes here.
    Token,
    Admin,
}

fn need(route: &str, method: &Method) -> Need {
    let read = matches!(*method, Method::GET | Method::HEAD);
    let rw = if read { Op::Read } else { Op::Write };
    match route {
        "/" | "/healthz" | "/readyz" | "/metrics" | "/openapi.json" => Need::Public,
        "/v1/stream/{*path}" => Need::Stream(rw),
        "/v1/stream" | "/v1/stream/" => Need::Token,
        "/v1/queues" | "/v1/commands/{id}" | "/v1/commands/{id}/cancel" | "/v1/dashboard/events" => Need::Token,
        "/v1/queues/{queue}" | "/v1/queues/{queue}/commands" => Need::Queue(rw),
        "/v1/queues/{queue}/dead-letters" => Need::Queue(if read { Op::Read } else { Op::Admin }),
        "/v1/queues/{queue}/dead-letters/replay" | "/v1/queues/{queue}/dead-letters/{id}/replay" => {
            Need::Queue(Op::Admin)
        }
        // A route this table does not know yet: only admin tokens, until it is classified.
        _ => Need::Admin,
    }
}

/// Removes `access_token` from the query; returns it and the cleaned URI.
fn take_query_token(uri: &Uri) -> (Option<String>, Option<Uri>) {
    let Some(q) = uri.query() else { return (None, None) };
    if !q.split('&').any(|p| p == "access_token" || p.starts_with("access_token=")) {
        return (None, None);
    }
    let mut token = None;
    let mut kept = Vec::new();
    for (k, v) in url::form_urlencoded::parse(q.as_bytes()) {
        if k == "access_token" {
            token = Some(v.into_owned());
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
    let mut res = JsonError::new(StatusCode::UNAUTHORIZED, "unauthorized", message).into_response();
    res.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    res
}

fn forbidden(message: String) -> Response {
    metrics::counter!("baton_auth_failures_total", "reason" => "forbidden").increment(1);
    JsonError::new(StatusCode::FORBIDDEN, "forbidden", message).into_response()
}

/// The route layer: strips `access_token` from the URL, authenticates, checks what the route
/// needs (module docs) and leaves the [`Principal`] in the request extensions for handlers.
pub async fn layer(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let (mut parts, body) = req.into_parts();
    let (query_token, cleaned) = take_query_token(&parts.uri);
    if let Some(u) = cleaned {
        parts.uri = u;
    }
    if !st.auth.enabled() {
        // An open server: every check passes for `Principal::Open`.
        parts.extensions.insert(Principal::Open);
        return next.run(Request::from_parts(parts, body)).await;
    }
    let need = need(parts.extensions.get::<MatchedPath>().map_or("", |m| m.as_str()), &parts.method);
    let principal = if matches!(need, Need::Public) {
        Principal::Open
    } else {
        let header_token = match parts.headers.get(header::AUTHORIZATION) {
            None => None,
            Some(v) => {
                let v = v.to_str().unwrap_or("");
                match v.split_once(' ') {
                    Some((scheme, t)) if scheme.eq_ignore_ascii_case("bearer") => Some(t.trim().to_string()),
                    _ => return unauthorized("the Authorization header must be `Bearer <token>`", true),
                }
            }
        };
        let Some(presented) = header_token.or(query_token) else {
            return unauthorized(
                "this server needs a token: send `Authorization: Bearer <token>` (or ?access_token= for EventSource)",
                false,
            );
        };
        match st.auth.find(presented.as_bytes()) {
            Some(t) => Principal::Token(t),
            None => return unauthorized("the token is not valid on this server", true),
        }
    };
    let verdict = match need {
        Need::Public | Need::Token => Ok(()),
        Need::Admin => principal.check_admin(),
        Need::Stream(op) => {
            let raw = parts.uri.path().strip_prefix(crate::http::headers::STREAM_PREFIX).unwrap_or("");
            let target = match crate::http::headers::stream_path(raw) {
                Ok(p) => principal.check_stream(op, p.as_str()),
                // Malformed paths are refused by the handler with 400; nothing is touched.
                Err(_) => Ok(()),
            };
            // A fork copies its source: creating one needs `read` on the source too.
            let source = parts
                .headers
                .get("stream-forked-from")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| crate::http::headers::fork_source(v.trim()).ok());
            match (target, source) {
                (Ok(()), Some(src)) if parts.method == Method::PUT => principal.check_stream(Op::Read, src.as_str()),
                (t, _) => t,
            }
        }
        Need::Queue(op) => {
            let params =
                <RawPathParams as axum::extract::FromRequestParts<()>>::from_request_parts(&mut parts, &()).await;
            let queue = params.ok().and_then(|p| p.iter().find(|(k, _)| *k == "queue").map(|(_, v)| v.to_string()));
            match queue {
                Some(q) => principal.check_queue(op, &q),
                None => Ok(()),
            }
        }
    };
    if let Err(m) = verdict {
        return forbidden(m);
    }
    parts.extensions.insert(principal);
    next.run(Request::from_parts(parts, body)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes() {
        let t = TokenConfig::new("t", "0123456789abcdef", &["read"], &["acme/", "ci/runs"], &["q1"]).unwrap();
        let p = Principal::Token(Arc::new(t));
        assert!(p.check_stream(Op::Read, "acme").is_ok());
        assert!(p.check_stream(Op::Read, "acme/x/y").is_ok());
        assert!(p.check_stream(Op::Read, "acmeco/x").is_err());
        assert!(p.check_stream(Op::Read, "ci/runs/1").is_ok());
        assert!(p.check_stream(Op::Read, "ci/other").is_err());
        assert_eq!(
            p.check_stream(Op::Write, "acme/x").unwrap_err(),
            "token \"t\" may not write stream \"acme/x\" (operations: read; stream prefixes: acme, ci/runs)"
        );
        assert!(p.check_queue(Op::Read, "q1").is_ok());
        assert!(p.check_queue(Op::Read, "q2").is_err());
        let a = Principal::Token(Arc::new(TokenConfig::admin("a", "0123456789abcdef0").unwrap()));
        assert!(a.check_queue(Op::Write, "any").is_ok() && a.check_stream(Op::Write, "x/y").is_ok());
    }

    #[test]
    fn token_config_errors() {
        assert!(TokenConfig::new("t", "short", &["read"], &[], &[]).unwrap_err().contains("shorter than 16"));
        assert!(TokenConfig::new("t", "0123456789abcdef", &["peek"], &[], &[])
            .unwrap_err()
            .contains("unknown operation \"peek\""));
        let f = |n: &str, s: &str| TokenFile {
            name: n.into(),
            token: Some(s.into()),
            token_env: None,
            operations: vec!["read".into()],
            streams: vec![],
            queues: vec![],
        };
        let e = resolve_tokens(vec![f("a", "0123456789abcdef"), f("b", "0123456789abcdef")], None).unwrap_err();
        assert_eq!(e, "tokens \"a\" and \"b\" have the same secret");
        let dbg = format!("{:?}", resolve_tokens(vec![f("a", "0123456789abcdef")], None).unwrap());
        assert!(!dbg.contains("0123456789abcdef") && dbg.contains("<redacted>"), "{dbg}");
    }

    #[test]
    fn query_token_is_removed() {
        let u: Uri = "/v1/stream/a/b?offset=-1&access_token=s3cr%2Bt&live=sse".parse().unwrap();
        let (t, cleaned) = take_query_token(&u);
        assert_eq!(t.as_deref(), Some("s3cr+t"));
        assert_eq!(cleaned.unwrap().to_string(), "/v1/stream/a/b?offset=-1&live=sse");
        let (t, cleaned) = take_query_token(&"/x?a=1".parse().unwrap());
        assert!(t.is_none() && cleaned.is_none());
    }
}
