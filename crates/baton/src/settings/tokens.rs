//! Bearer tokens from configuration (TOML `[[tokens]]`): each token is allowed a set of
//! operations on stream path prefixes (scopes) and on queues.
//!
//! ```toml
//! [[tokens]]
//! name = "ci"                  # shown in logs and 403 messages; never the secret
//! token_env = "BATON_CI_TOKEN" # or token = "…" (at least 16 characters)
//! operations = ["read", "write"]   # read, write, work, admin (admin allows every operation)
//! streams = ["acme", "ci/runs"]    # stream path prefixes, segment-wise; "*" = every stream
//! queues = ["default"]             # queue names; "*" = every queue
//! ```
//!
//! `BATON_ADMIN_TOKEN` adds one token named `admin` with every operation everywhere. What each
//! request needs is the `auth` module's.

use std::fmt;

use serde::Deserialize;

/// Shortest accepted token, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;

/// An operation a token may be allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    /// The HTTP worker protocol of a queue (claim, renew, settle its commands), nothing else.
    Work,
    Admin,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Work => "work",
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
    work: bool,
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
            return Err(format!("token {name:?} has no operations; give some of read, write, work, admin"));
        }
        let mut t = TokenConfig {
            name: name.to_string(),
            secret: secret.as_bytes().to_vec(),
            read: false,
            write: false,
            work: false,
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
                "work" => t.work = true,
                "admin" => t.admin = true,
                other => {
                    return Err(format!("token {name:?}: unknown operation {other:?}; use read, write, work or admin"))
                }
            }
        }
        Ok(t)
    }

    /// The secret, to compare with a presented token.
    pub fn secret(&self) -> &[u8] {
        &self.secret
    }

    /// The operations it is allowed, in the order read, write, work, admin.
    pub fn operations(&self) -> Vec<&'static str> {
        [(self.read, "read"), (self.write, "write"), (self.work, "work"), (self.admin, "admin")]
            .into_iter()
            .filter_map(|(on, n)| on.then_some(n))
            .collect()
    }

    /// True for an admin token (every operation).
    pub fn is_admin(&self) -> bool {
        self.admin
    }

    /// True when it is allowed `op` (admin allows every operation).
    pub fn allows(&self, op: Op) -> bool {
        self.admin
            || match op {
                Op::Read => self.read,
                Op::Write => self.write,
                Op::Work => self.work,
                Op::Admin => false,
            }
    }

    /// True when one of its stream prefixes covers `path` (whole segments).
    pub fn covers_stream(&self, path: &str) -> bool {
        self.streams.iter().any(|p| {
            p.is_empty() || path == p || (path.starts_with(p.as_str()) && path.as_bytes().get(p.len()) == Some(&b'/'))
        })
    }

    /// True when its queues include `queue`.
    pub fn covers_queue(&self, queue: &str) -> bool {
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
        if s.len() < MIN_TOKEN_LEN {
            return Err(format!(
                "BATON_ADMIN_TOKEN is shorter than {MIN_TOKEN_LEN} characters; use a long random secret"
            ));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn scopes_match_whole_segments() {
        let t = TokenConfig::new("t", "0123456789abcdef", &["read"], &["acme/", "ci/runs"], &["q1"]).unwrap();
        assert!(t.covers_stream("acme") && t.covers_stream("acme/x/y") && t.covers_stream("ci/runs/1"));
        assert!(!t.covers_stream("acmeco/x") && !t.covers_stream("ci/other"));
        assert!(t.covers_queue("q1") && !t.covers_queue("q2"));
        assert!(t.allows(Op::Read) && !t.allows(Op::Write) && !t.allows(Op::Admin));
        assert_eq!(t.operations(), ["read"]);
        let w = TokenConfig::new("w", "0123456789abcdef", &["work"], &[], &["q1"]).unwrap();
        assert!(w.allows(Op::Work) && !w.allows(Op::Read) && !w.allows(Op::Write) && !w.allows(Op::Admin));
        assert_eq!(w.operations(), ["work"]);
        let a = TokenConfig::admin("a", "0123456789abcdef").unwrap();
        assert!(a.allows(Op::Work));
    }
}
