//! The subscription model: requests as the protocol sends them, the stored record, the views
//! the protocol returns, errors with their protocol codes, stream-path globs and offset order.
//! Uses no other module of the crate.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

/// Lease bounds of a subscription, ms (the reference server's): default 30 s, from 1 s to 10 min.
pub const DEFAULT_LEASE_TTL_MS: u64 = 30_000;
/// Shortest `lease_ttl_ms` accepted.
pub const MIN_LEASE_TTL_MS: u64 = 1_000;
/// Longest `lease_ttl_ms` accepted.
pub const MAX_LEASE_TTL_MS: u64 = 600_000;
/// Longest subscription id, bytes.
pub const MAX_ID_BYTES: usize = 256;
/// Most streams a create or add request may name.
pub const MAX_STREAMS_PER_REQUEST: usize = 1_000;
/// The offset a stream that does not exist is linked at (the start of every stream).
pub const ZERO_OFFSET: &str = "0000000000000000_0000000000000000";
/// The offset a stream first seen through a glob after the subscription was created is linked
/// at: before its first entry (everything in it is pending).
pub const BEFORE_FIRST: &str = "-1";

/// Errors of the subscription API. Each has the protocol's code ([`code`](Self::code)) and HTTP
/// status ([`status`](Self::status)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubscriptionError {
    /// `INVALID_REQUEST` (400): the message says what to fix.
    #[error("{0}")]
    InvalidRequest(String),
    /// `SUBSCRIPTION_NOT_FOUND` (404).
    #[error("subscription not found")]
    NotFound,
    /// `SUBSCRIPTION_ALREADY_EXISTS` (409): the id exists with another configuration.
    #[error("subscription already exists with a different configuration")]
    AlreadyExists,
    /// `WEBHOOK_URL_REJECTED` (400): the message says why.
    #[error("{0}")]
    WebhookUrlRejected(String),
    /// `TOKEN_INVALID` (401): a malformed or unknown callback or claim token; the message says
    /// which kind of token and why.
    #[error("{0}")]
    TokenInvalid(String),
    /// `FENCED` (409): the token, wake id or generation is not the current wake's; the message
    /// says which (an earlier generation's token, a wake that ended, a body naming another wake).
    #[error("{0}")]
    Fenced(String),
    /// `ALREADY_CLAIMED` (409): another worker holds the wake's lease.
    #[error("subscription is claimed by {holder}")]
    AlreadyClaimed { holder: String, generation: u64 },
    /// `NO_PENDING_WORK` (409).
    #[error("subscription has no pending work")]
    NoPendingWork,
    /// `INVALID_OFFSET` (409): the message says which ack and why.
    #[error("{0}")]
    InvalidOffset(String),
    /// The backend failed (Redis unreachable, a script error); 503. The request may be retried.
    #[error("subscriptions backend unavailable: {0}")]
    Unavailable(String),
}

impl SubscriptionError {
    /// The protocol's error code, e.g. `FENCED`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidRequest(_) => "INVALID_REQUEST",
            Self::NotFound => "SUBSCRIPTION_NOT_FOUND",
            Self::AlreadyExists => "SUBSCRIPTION_ALREADY_EXISTS",
            Self::WebhookUrlRejected(_) => "WEBHOOK_URL_REJECTED",
            Self::TokenInvalid(_) => "TOKEN_INVALID",
            Self::Fenced(_) => "FENCED",
            Self::AlreadyClaimed { .. } => "ALREADY_CLAIMED",
            Self::NoPendingWork => "NO_PENDING_WORK",
            Self::InvalidOffset(_) => "INVALID_OFFSET",
            Self::Unavailable(_) => "UNAVAILABLE",
        }
    }

    /// The HTTP status of the error.
    pub fn status(&self) -> u16 {
        match self {
            Self::InvalidRequest(_) | Self::WebhookUrlRejected(_) => 400,
            Self::TokenInvalid(_) => 401,
            Self::NotFound => 404,
            Self::AlreadyExists
            | Self::Fenced(_)
            | Self::AlreadyClaimed { .. }
            | Self::NoPendingWork
            | Self::InvalidOffset(_) => 409,
            Self::Unavailable(_) => 503,
        }
    }

    /// The protocol's error body: `{"error": {"code", "message", ...}}` (`current_holder` and
    /// `generation` for `ALREADY_CLAIMED`).
    pub fn body(&self) -> Value {
        let mut e = Map::new();
        e.insert("code".into(), self.code().into());
        e.insert("message".into(), self.to_string().into());
        if let Self::AlreadyClaimed { holder, generation } = self {
            e.insert("current_holder".into(), holder.clone().into());
            e.insert("generation".into(), (*generation).into());
        }
        json!({ "error": e })
    }

    pub(crate) fn invalid(m: impl Into<String>) -> Self {
        Self::InvalidRequest(m.into())
    }
}

/// `Result` of this crate.
pub type Result<T, E = SubscriptionError> = std::result::Result<T, E>;

/// The two kinds of subscription.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    /// Wakes are POSTed, signed, to a webhook URL; the receiver answers through the callback.
    #[serde(rename = "webhook")]
    Webhook,
    /// Wakes are appended to a wake stream; workers `claim`, `ack` and `release` them.
    #[serde(rename = "pull-wake")]
    PullWake,
}

impl Kind {
    /// `webhook` or `pull-wake`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Webhook => "webhook",
            Kind::PullWake => "pull-wake",
        }
    }
}

/// A subscription's configuration, as created (`PUT __ds/subscriptions/{id}`), normalized:
/// paths without leading or trailing `/`, `streams` sorted without duplicates.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Spec {
    pub kind: Kind,
    /// A glob over stream paths (`*` one segment, `**` any number of segments).
    pub pattern: Option<String>,
    /// Streams named explicitly at creation.
    pub streams: Vec<String>,
    /// The webhook URL (webhook subscriptions).
    pub webhook_url: Option<String>,
    /// The stream wake events are appended to (pull-wake subscriptions).
    pub wake_stream: Option<String>,
    /// How long a wake's lease lasts without a callback, ack or claim renewing it, ms.
    pub lease_ttl_ms: u64,
    pub description: Option<String>,
}

impl Spec {
    /// Parses a create request body. Errors: `InvalidRequest` naming the field.
    pub fn from_json(v: &Value) -> Result<Spec> {
        let o = v.as_object().ok_or_else(|| SubscriptionError::invalid("request body must be a JSON object"))?;
        let kind = match o.get("type").and_then(Value::as_str) {
            Some("webhook") => Kind::Webhook,
            Some("pull-wake") => Kind::PullWake,
            _ => return Err(SubscriptionError::invalid("type must be \"webhook\" or \"pull-wake\"")),
        };
        let pattern = match o.get("pattern") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.is_empty() => None,
            Some(Value::String(s)) => Some(normalize_path(s)),
            Some(_) => return Err(SubscriptionError::invalid("pattern must be a string")),
        };
        if let Some(p) = &pattern {
            check_path(p, "pattern")?;
        }
        let streams = match o.get("streams") {
            None | Some(Value::Null) => vec![],
            Some(v) => parse_streams(v)?,
        };
        if pattern.is_none() && streams.is_empty() {
            return Err(SubscriptionError::invalid("at least one of pattern or streams is required"));
        }
        let lease_ttl_ms = match o.get("lease_ttl_ms") {
            None | Some(Value::Null) => DEFAULT_LEASE_TTL_MS,
            Some(v) => match v.as_u64() {
                Some(n) if (MIN_LEASE_TTL_MS..=MAX_LEASE_TTL_MS).contains(&n) => n,
                _ => return Err(SubscriptionError::invalid("lease_ttl_ms must be an integer from 1000 to 600000")),
            },
        };
        let webhook_url = match kind {
            Kind::Webhook => match o.get("webhook").and_then(|w| w.get("url")).and_then(Value::as_str) {
                Some(u) if !u.is_empty() => Some(u.to_string()),
                _ => return Err(SubscriptionError::invalid("webhook subscriptions require webhook.url")),
            },
            Kind::PullWake => None,
        };
        let wake_stream = match o.get("wake_stream") {
            Some(Value::String(s)) if !s.is_empty() => Some(normalize_path(s)),
            None | Some(Value::Null) => None,
            Some(Value::String(_)) => None,
            Some(_) => return Err(SubscriptionError::invalid("wake_stream must be a string")),
        };
        if let Some(w) = &wake_stream {
            check_path(w, "wake_stream")?;
        }
        // A webhook subscription has no wake stream: one given is ignored (kept, it would make
        // every subscription blind to appends to that stream, wake streams never being matched).
        let wake_stream = if kind == Kind::Webhook { None } else { wake_stream };
        if kind == Kind::PullWake && wake_stream.is_none() {
            return Err(SubscriptionError::invalid("pull-wake subscriptions require wake_stream"));
        }
        let description = match o.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(SubscriptionError::invalid("description must be a string")),
        };
        Ok(Spec { kind, pattern, streams, webhook_url, wake_stream, lease_ttl_ms, description })
    }

    /// SHA-256 (hex) of the canonical configuration: a re-`PUT` with the same hash confirms
    /// (200), another is `SUBSCRIPTION_ALREADY_EXISTS`.
    pub fn config_hash(&self) -> String {
        let canonical = serde_json::to_vec(self).expect("a spec serializes");
        hex(&Sha256::digest(canonical))
    }
}

/// Parses a `streams` array (create, `POST …/streams`): non-empty strings, normalized, sorted,
/// without duplicates. Errors: `InvalidRequest`.
pub fn parse_streams(v: &Value) -> Result<Vec<String>> {
    let bad = || SubscriptionError::invalid("streams must be an array of non-empty strings");
    let arr = v.as_array().ok_or_else(bad)?;
    if arr.len() > MAX_STREAMS_PER_REQUEST {
        return Err(SubscriptionError::invalid(format!("at most {MAX_STREAMS_PER_REQUEST} streams per request")));
    }
    let mut out = Vec::with_capacity(arr.len());
    for s in arr {
        let s = s.as_str().filter(|s| !s.is_empty()).ok_or_else(bad)?;
        let p = normalize_path(s);
        check_path(&p, "streams")?;
        out.push(p);
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// Validates a subscription id: 1 to 256 bytes, no control characters, no `/`, not `.` or
/// `..` (a URL path segment that clients resolve away: its callback URL would name another
/// route).
pub fn check_id(id: &str) -> Result<()> {
    if id.is_empty()
        || id.len() > MAX_ID_BYTES
        || id == "."
        || id == ".."
        || id.chars().any(|c| c.is_control() || c == '/')
    {
        return Err(SubscriptionError::invalid(
            "a subscription id needs 1 to 256 bytes without `/` or control characters, and is not `.` or `..`",
        ));
    }
    Ok(())
}

fn check_path(p: &str, field: &str) -> Result<()> {
    if p.is_empty() || p.len() > 1024 || p.chars().any(char::is_control) {
        return Err(SubscriptionError::invalid(format!(
            "{field}: a stream path needs 1 to 1024 bytes without control characters"
        )));
    }
    if p == "__ds" || p.starts_with("__ds/") {
        return Err(SubscriptionError::invalid(format!("{field}: paths under __ds/ are reserved")));
    }
    Ok(())
}

/// A stream path without leading or trailing `/`.
pub fn normalize_path(p: &str) -> String {
    p.trim_matches('/').to_string()
}

/// Matches a stream path against a glob: segments split on `/`; `*` matches exactly one
/// segment, `**` zero or more, any other segment literally (`%2A` in a pattern stands for a
/// literal `*`). Leading and trailing `/` are ignored.
pub fn glob_match(pattern: &str, path: &str) -> bool {
    let pat: Vec<&str> = pattern.split('/').filter(|s| !s.is_empty()).collect();
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    glob_from(&pat, &segs)
}

fn glob_from(pat: &[&str], segs: &[&str]) -> bool {
    match pat.split_first() {
        None => segs.is_empty(),
        Some((&"**", rest)) => (0..=segs.len()).any(|i| glob_from(rest, &segs[i..])),
        Some((&"*", rest)) => !segs.is_empty() && glob_from(rest, &segs[1..]),
        Some((lit, rest)) => match segs.split_first() {
            Some((s, more)) => literal_eq(lit, s) && glob_from(rest, more),
            None => false,
        },
    }
}

fn literal_eq(lit: &str, seg: &str) -> bool {
    if lit.contains('%') {
        lit.replace("%2A", "*").replace("%2a", "*") == seg
    } else {
        lit == seg
    }
}

/// The literal path prefix of a glob before its first wildcard segment (`events/` for
/// `events/*`), for listing candidate streams.
pub fn glob_prefix(pattern: &str) -> String {
    let mut out = String::new();
    for seg in pattern.split('/').filter(|s| !s.is_empty()) {
        if seg == "*" || seg == "**" {
            break;
        }
        out.push_str(seg);
        out.push('/');
    }
    out
}

/// The position an offset token names, for ordering: `None` for `-1` (before every entry, the
/// same position as the start), `(ms, seq)` for `MMMM_SSSS` with or without an incarnation tag.
/// `Err` for anything else.
pub fn position(offset: &str) -> std::result::Result<(u64, u64), ()> {
    if offset == BEFORE_FIRST {
        return Ok((0, 0));
    }
    let mut parts = offset.split('_');
    let ms = parts.next().filter(|p| p.len() == 16).and_then(|p| p.parse().ok()).ok_or(())?;
    let seq = parts.next().filter(|p| p.len() == 16).and_then(|p| p.parse().ok()).ok_or(())?;
    match parts.next() {
        None => {}
        Some(tag) if tag.len() == 12 && tag.bytes().all(|b| b.is_ascii_hexdigit()) => {}
        Some(_) => return Err(()),
    }
    if parts.next().is_some() {
        return Err(());
    }
    Ok((ms, seq))
}

fn pos(offset: &str) -> (u64, u64) {
    position(offset).unwrap_or((0, 0))
}

/// One stream of a subscription: how it is linked and how far it is acknowledged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Link {
    /// Named explicitly (at creation or with `POST …/streams`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub explicit: bool,
    /// Matched by the subscription's glob.
    #[serde(default, skip_serializing_if = "is_false")]
    pub glob: bool,
    /// The acknowledged offset (everything up to it is done).
    pub acked: String,
    /// The stream's tail as last seen (an append's, or a read of the stream's metadata).
    pub tail: String,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl Link {
    /// `explicit` when named explicitly, else `glob`.
    pub fn link_type(&self) -> &'static str {
        if self.explicit {
            "explicit"
        } else {
            "glob"
        }
    }

    /// Whether the tail is past the acknowledged offset.
    pub fn has_pending(&self) -> bool {
        pos(&self.tail) > pos(&self.acked)
    }
}

/// The current wake of a subscription.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wake {
    /// `w_` and 24 hex digits.
    pub id: String,
    /// The subscription's generation this wake belongs to.
    pub generation: u64,
    /// Each stream's tail when the wake was created (what a synchronous `done` acknowledges).
    pub snapshot: BTreeMap<String, String>,
    /// The stream whose append caused the wake.
    pub triggered_by: String,
    /// Pull-wake: the worker holding the wake's lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// When the wake's lease ends without renewal, ms since the Unix epoch (Redis clock on Redis).
    /// Webhook: from creation, renewed by a successful delivery and every callback; pull-wake:
    /// from `claim`, renewed by every ack; `None` while a pull-wake is not claimed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
    /// Webhook: the receiver answered 2xx.
    #[serde(default, skip_serializing_if = "is_false")]
    pub delivered: bool,
    /// Pull-wake: the wake event is in the wake stream (or the wake was created by a claim).
    #[serde(default, skip_serializing_if = "is_false")]
    pub announced: bool,
    /// Webhook: the wake's callback token (sent with every delivery attempt of this wake).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// Delivery health of a webhook subscription.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Deliveries succeed (or none was tried).
    #[default]
    Active,
    /// The last delivery failed; it is retried with backoff.
    Failed,
}

/// A subscription as stored: one JSON document per subscription.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    pub spec: Spec,
    pub config_hash: String,
    /// RFC 3339, UTC.
    pub created_at: String,
    #[serde(default)]
    pub status: Status,
    /// The subscription's streams by path.
    #[serde(default)]
    pub links: BTreeMap<String, Link>,
    /// Incremented by every new wake.
    #[serde(default)]
    pub generation: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wake: Option<Wake>,
    /// Generation and SHA-256 (hex) of the last callback token issued (kept after its wake ends,
    /// so that a late callback is told `FENCED`, not `TOKEN_INVALID`).
    #[serde(default)]
    pub token_generation: u64,
    #[serde(default)]
    pub token_sha256: String,
    /// Failed webhook deliveries in a row.
    #[serde(default)]
    pub retry_count: u32,
    /// Earliest time of the next webhook delivery attempt, ms since the Unix epoch.
    #[serde(default)]
    pub next_attempt_ms: u64,
    /// The token of the delivery message that drives this subscription (one at a time; an
    /// older message finds another token here and ends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
}

impl Record {
    /// Whether any stream has entries past its acknowledged offset.
    pub fn has_pending(&self) -> bool {
        self.links.values().any(Link::has_pending)
    }

    /// The first stream (by path) with pending entries.
    pub fn first_pending(&self) -> Option<&str> {
        self.links.iter().find(|(_, l)| l.has_pending()).map(|(p, _)| p.as_str())
    }

    /// `streams` of a webhook body or claim reply: path, link type, acked and tail offsets, and
    /// whether entries are pending.
    pub fn stream_infos(&self) -> Vec<Value> {
        self.links
            .iter()
            .map(|(p, l)| {
                json!({
                    "path": p,
                    "link_type": l.link_type(),
                    "acked_offset": l.acked,
                    "tail_offset": l.tail,
                    "has_pending": l.has_pending(),
                })
            })
            .collect()
    }
}

/// A registry entry: what every process needs to match appends against a subscription.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// Explicit streams (those of the creation request and those added since).
    #[serde(default)]
    pub streams: Vec<String>,
    /// The wake stream of a pull-wake subscription (never matched: appends to it are Baton's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wake_stream: Option<String>,
}

impl Entry {
    /// The entry of a record.
    pub fn of(rec: &Record) -> Entry {
        Entry {
            id: rec.id.clone(),
            pattern: rec.spec.pattern.clone(),
            streams: rec.links.iter().filter(|(_, l)| l.explicit).map(|(p, _)| p.clone()).collect(),
            wake_stream: rec.spec.wake_stream.clone(),
        }
    }

    /// Whether appends to `path` concern this subscription.
    pub fn matches(&self, path: &str) -> bool {
        self.pattern.as_deref().is_some_and(|p| glob_match(p, path))
            || self.streams.binary_search_by(|s| s.as_str().cmp(path)).is_ok()
    }
}

/// The body of a callback, ack or release: `wake_id` and `generation` (required: the wake being
/// acknowledged), `acks` (optional; each `stream` or `path`, and `offset`), `done` (optional,
/// default `false`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AckRequest {
    pub wake_id: String,
    pub generation: u64,
    pub acks: Vec<(String, String)>,
    pub done: bool,
}

impl AckRequest {
    /// Parses the body. Errors: `InvalidRequest` naming the field (a missing `wake_id` or
    /// `generation` too: whether they are the current wake's is checked later, `Fenced`).
    pub fn from_json(v: &Value) -> Result<AckRequest> {
        let o = v.as_object().ok_or_else(|| SubscriptionError::invalid("request body must be a JSON object"))?;
        let wake_id = match o.get("wake_id") {
            None | Some(Value::Null) => {
                return Err(SubscriptionError::invalid(
                    "wake_id is required: the wake_id of the wake being acknowledged",
                ))
            }
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(SubscriptionError::invalid("wake_id must be a string")),
        };
        let generation = match o.get("generation") {
            None | Some(Value::Null) => {
                return Err(SubscriptionError::invalid(
                    "generation is required: the generation of the wake being acknowledged",
                ))
            }
            Some(v) => {
                v.as_u64().ok_or_else(|| SubscriptionError::invalid("generation must be a non-negative integer"))?
            }
        };
        let mut acks = vec![];
        match o.get("acks") {
            None | Some(Value::Null) => {}
            Some(Value::Array(items)) => {
                for a in items {
                    let stream = a.get("stream").or_else(|| a.get("path")).and_then(Value::as_str);
                    let offset = a.get("offset").and_then(Value::as_str);
                    match (stream, offset) {
                        (Some(s), Some(off)) => acks.push((normalize_path(s), off.to_string())),
                        _ => {
                            return Err(SubscriptionError::invalid(
                                "each ack needs a stream (or path) and an offset, both strings",
                            ))
                        }
                    }
                }
            }
            Some(_) => return Err(SubscriptionError::invalid("acks must be an array")),
        }
        let done = match o.get("done") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(SubscriptionError::invalid("done must be a boolean")),
        };
        Ok(AckRequest { wake_id, generation, acks, done })
    }
}

/// Lowercase hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("events/*", "events/a"));
        assert!(!glob_match("events/*", "events/a/b"));
        assert!(!glob_match("events/*", "events"));
        assert!(glob_match("events/**", "events"));
        assert!(glob_match("events/**", "events/a/b"));
        assert!(glob_match("**/x", "a/b/x"));
        assert!(glob_match("/events/*/", "events/a"));
        assert!(glob_match("a/%2A", "a/*"));
        assert!(!glob_match("a/%2A", "a/b"));
        assert_eq!(glob_prefix("events/*/x"), "events/");
        assert_eq!(glob_prefix("**"), "");
    }

    #[test]
    fn positions() {
        assert_eq!(position("-1"), Ok((0, 0)));
        assert_eq!(position("0000000000000005_0000000000000002"), Ok((5, 2)));
        assert_eq!(position("0000000000000005_0000000000000002_3fa8c2d1e0b4"), Ok((5, 2)));
        assert!(position("5_2").is_err());
        assert!(position("0000000000000005_0000000000000002_zz").is_err());
        let l = Link { explicit: false, glob: true, acked: "-1".into(), tail: ZERO_OFFSET.into() };
        assert!(!l.has_pending(), "an empty stream has nothing pending");
    }

    #[test]
    fn odd_specs_and_ids() {
        let s = Spec::from_json(
            &json!({"type": "webhook", "pattern": "a/*", "webhook": {"url": "https://x"}, "wake_stream": "events/a"}),
        )
        .unwrap();
        assert_eq!(s.wake_stream, None, "a webhook subscription has no wake stream");
        for bad in [".", "..", "", "a/b", "a\nb"] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
        for ok in ["...", "{x}", "é", "%2F", ".a"] {
            assert!(check_id(ok).is_ok(), "{ok:?}");
        }
    }

    #[test]
    fn spec_parsing() {
        let s = Spec::from_json(&json!({"type": "webhook", "pattern": "/events/*", "webhook": {"url": "https://x"}}))
            .unwrap();
        assert_eq!(s.pattern.as_deref(), Some("events/*"));
        assert_eq!(s.lease_ttl_ms, DEFAULT_LEASE_TTL_MS);
        let e = Spec::from_json(&json!({"type": "webhook", "pattern": "a"})).unwrap_err();
        assert_eq!(e.to_string(), "webhook subscriptions require webhook.url");
        let e = Spec::from_json(&json!({"type": "pull-wake", "pattern": "a", "lease_ttl_ms": 10})).unwrap_err();
        assert_eq!(e.code(), "INVALID_REQUEST");
        let a = Spec::from_json(&json!({"type": "pull-wake", "streams": ["b", "a", "b"], "wake_stream": "w"})).unwrap();
        assert_eq!(a.streams, vec!["a", "b"]);
    }

    #[test]
    fn ack_bodies_need_wake_id_and_generation() {
        let msg = |v: Value| AckRequest::from_json(&v).map_err(|e| (e.code(), e.to_string()));
        assert_eq!(
            msg(json!({"generation": 1, "done": true})),
            Err(("INVALID_REQUEST", "wake_id is required: the wake_id of the wake being acknowledged".into()))
        );
        assert_eq!(
            msg(json!({"wake_id": "w_1", "generation": null})),
            Err(("INVALID_REQUEST", "generation is required: the generation of the wake being acknowledged".into()))
        );
        assert_eq!(msg(json!({})).unwrap_err().1, "wake_id is required: the wake_id of the wake being acknowledged");
        assert_eq!(msg(json!({"wake_id": 1, "generation": 1})).unwrap_err().1, "wake_id must be a string");
        assert_eq!(
            msg(json!({"wake_id": "w", "generation": -1})).unwrap_err().1,
            "generation must be a non-negative integer"
        );
        let ok = AckRequest::from_json(&json!({"wake_id": "w_1", "generation": 2})).unwrap();
        assert_eq!(ok, AckRequest { wake_id: "w_1".into(), generation: 2, acks: vec![], done: false }, "acks optional");
    }
}
