//! Who may do what: the configured bearer tokens ([`crate::settings::tokens`]), the caller of a
//! request ([`Principal`]) and what a route needs ([`Access`]); the decisions and their 403
//! messages. No HTTP here: the HTTP layer reads the credentials and the request's target and
//! asks [`Principal::authorize`].
//!
//! What each request needs (declared per route in the HTTP route table): reading streams (GET,
//! HEAD) and commands, queues and dead letters (GET) is `read`; creating, appending to, closing
//! and deleting streams, submitting and cancelling commands is `write`; replaying and purging
//! dead letters is `admin`; claiming, renewing and settling a queue's commands (the HTTP worker
//! protocol) is `work`, which allows nothing else (an admin token may do it too). `/`,
//! `/healthz`, `/readyz`, `/metrics` and `/openapi.json` are public. Forking a stream (`PUT` with `Stream-Forked-From`) also needs `read` on the source
//! stream. A request without a valid token is `401` with `WWW-Authenticate: Bearer`; a valid
//! token outside its scope is `403`.
//!
//! Tokens are compared in constant time (`subtle`), against every configured token. With no
//! tokens configured every request is allowed (announced at startup).

use std::sync::Arc;

use subtle::ConstantTimeEq;

use crate::settings::{Op, TokenConfig};

/// What a route needs of its caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Anyone, with or without a token.
    Public,
    /// Any valid token: the handler checks the queue (known only after loading the command), or
    /// filters what it lists.
    Token,
    /// `op` on the stream of the request's path.
    Stream(Op),
    /// `write` on the stream of the request's path, and `read` on the `Stream-Forked-From`
    /// source when there is one (a fork copies its source).
    StreamCreate,
    /// `op` on the request's `{queue}`.
    Queue(Op),
    /// An admin token.
    Admin,
}

/// What a request is about, as far as [`Access`] cares: read from the request by the HTTP
/// layer, `None` where absent or malformed (the handler refuses malformed input itself).
#[derive(Clone, Debug, Default)]
pub struct Target {
    /// The stream path (for [`Access::Stream`] and [`Access::StreamCreate`]).
    pub stream: Option<String>,
    /// The fork source stream path (for [`Access::StreamCreate`]).
    pub fork_source: Option<String>,
    /// The `{queue}` (for [`Access::Queue`]).
    pub queue: Option<String>,
}

/// Who is calling: anyone (no tokens configured, or a public route) or the holder of one token.
#[derive(Clone, Debug)]
pub enum Principal {
    Open,
    Token(Arc<TokenConfig>),
}

impl Principal {
    /// `Ok` when `access` is granted for `target`; else the 403 message.
    pub fn authorize(&self, access: Access, target: &Target) -> Result<(), String> {
        match access {
            Access::Public | Access::Token => Ok(()),
            Access::Admin => self.check_admin(),
            Access::Stream(op) => match &target.stream {
                Some(path) => self.check_stream(op, path),
                None => Ok(()),
            },
            Access::StreamCreate => {
                let on_target = match &target.stream {
                    Some(path) => self.check_stream(Op::Write, path),
                    None => Ok(()),
                };
                match (on_target, &target.fork_source) {
                    (Ok(()), Some(src)) => self.check_stream(Op::Read, src),
                    (t, _) => t,
                }
            }
            Access::Queue(op) => match &target.queue {
                Some(q) => self.check_queue(op, q),
                None => Ok(()),
            },
        }
    }

    /// True when `op` on the stream `path` is allowed, without building a refusal (for
    /// filtering listings: `GET /v1/streams` asks it of every stream of the prefix).
    pub fn can_stream(&self, op: Op, path: &str) -> bool {
        match self {
            Principal::Open => true,
            Principal::Token(t) => t.allows(op) && t.covers_stream(path),
        }
    }

    /// `Ok` when `op` on the stream `path` is allowed; else the 403 message.
    pub fn check_stream(&self, op: Op, path: &str) -> Result<(), String> {
        match self {
            _ if self.can_stream(op, path) => Ok(()),
            Principal::Open => Ok(()),
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
            _ if self.can_queue(op, queue) => Ok(()),
            Principal::Open => Ok(()),
            Principal::Token(t) => Err(format!(
                "token {:?} may not {} queue {queue:?} (operations: {}; queues: {})",
                t.name,
                op.as_str(),
                t.operations().join(", "),
                list(&t.queues.iter().map(String::as_str).collect::<Vec<_>>())
            )),
        }
    }

    /// True when `op` on `queue` is allowed, without building a refusal (for filtering listings).
    pub fn can_queue(&self, op: Op, queue: &str) -> bool {
        match self {
            Principal::Open => true,
            Principal::Token(t) => t.allows(op) && t.covers_queue(queue),
        }
    }

    /// `Ok` for the open server and admin tokens.
    fn check_admin(&self) -> Result<(), String> {
        match self {
            Principal::Open => Ok(()),
            Principal::Token(t) if t.is_admin() => Ok(()),
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
    pub fn find(&self, presented: &[u8]) -> Option<Arc<TokenConfig>> {
        let mut found = None;
        for t in &self.tokens {
            // `ct_eq` of slices is constant-time for equal lengths and false otherwise.
            if bool::from(t.secret().ct_eq(presented)) {
                found = Some(t.clone());
            }
        }
        found
    }
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

    /// The listings' filters (`can_*`, no message built) agree with the 403 checks everywhere.
    #[test]
    fn filters_agree_with_checks() {
        let ps = [
            Principal::Open,
            Principal::Token(Arc::new(
                TokenConfig::new("t", "0123456789abcdef", &["read"], &["acme", "ci/runs"], &["q1"]).unwrap(),
            )),
            Principal::Token(Arc::new(TokenConfig::new("w", "0123456789abcdef", &["write"], &["*"], &["*"]).unwrap())),
            Principal::Token(Arc::new(TokenConfig::admin("a", "0123456789abcdef0").unwrap())),
        ];
        for p in &ps {
            for op in [Op::Read, Op::Write, Op::Work, Op::Admin] {
                for path in ["acme", "acme/x", "acmeco/x", "ci/runs", "ci/runs/1", "ci/other", "x/y"] {
                    assert_eq!(p.can_stream(op, path), p.check_stream(op, path).is_ok(), "{p:?} {op:?} {path}");
                }
                for q in ["q1", "q2", "*"] {
                    assert_eq!(p.can_queue(op, q), p.check_queue(op, q).is_ok(), "{p:?} {op:?} {q}");
                }
            }
        }
    }

    #[test]
    fn accesses() {
        let w = TokenConfig::new("w", "0123456789abcdef", &["read", "write"], &["acme"], &["q1"]).unwrap();
        let p = Principal::Token(Arc::new(w));
        let on = |stream: &str, fork: Option<&str>| Target {
            stream: Some(stream.into()),
            fork_source: fork.map(str::to_string),
            queue: None,
        };
        assert_eq!(p.authorize(Access::StreamCreate, &on("acme/a", None)), Ok(()));
        assert_eq!(
            p.authorize(Access::StreamCreate, &on("acme/a", Some("other/src"))).unwrap_err(),
            "token \"w\" may not read stream \"other/src\" (operations: read, write; stream prefixes: acme)"
        );
        assert_eq!(
            p.authorize(Access::StreamCreate, &on("other/a", Some("acme/src"))).unwrap_err(),
            "token \"w\" may not write stream \"other/a\" (operations: read, write; stream prefixes: acme)"
        );
        assert_eq!(p.authorize(Access::Stream(Op::Write), &on("acme/a", Some("other/src"))), Ok(()));
        assert_eq!(p.authorize(Access::Stream(Op::Write), &Target::default()), Ok(()), "malformed: the handler's");
        let q = |name: &str| Target { queue: Some(name.into()), ..Target::default() };
        assert_eq!(p.authorize(Access::Queue(Op::Write), &q("q1")), Ok(()));
        assert_eq!(
            p.authorize(Access::Queue(Op::Admin), &q("q1")).unwrap_err(),
            "token \"w\" may not admin queue \"q1\" (operations: read, write; queues: q1)"
        );
        assert_eq!(
            p.authorize(Access::Admin, &Target::default()).unwrap_err(),
            "token \"w\" may not use this endpoint (it needs admin)"
        );
        assert_eq!(p.authorize(Access::Token, &q("elsewhere")), Ok(()));
        assert_eq!(Principal::Open.authorize(Access::Admin, &Target::default()), Ok(()));
    }
}
