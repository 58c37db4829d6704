//! `http`: a webhook handler. `execute` POSTs the command to a configured URL and the JSON reply
//! decides the outcome; `check_status` polls the reply's status URL. Every request carries the
//! W3C `traceparent` (and `tracestate`) of the call when the command has a trace context
//! ([`crate::trace`]).

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{redirect, Client, RequestBuilder, Url};
use serde_json::Value;

use crate::{Command, CommandHandler, CommandResult, CommandState, HandlerError, RawJson};

/// Default request timeout of the `http` handler: 10 s.
pub const DEFAULT_HTTP_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest allowed `timeout`: 1 h.
pub const MAX_HTTP_TIMEOUT: Duration = Duration::from_secs(3600);
/// Redirects followed per request (each to the same origin only).
pub const MAX_REDIRECTS: usize = 5;
/// Largest reply body read, in bytes (1 MiB); a larger reply is a handler error.
pub const MAX_REPLY_BYTES: usize = 1 << 20;
/// Largest `retry_after_ms` accepted in a `running` reply: 24 h in milliseconds.
pub const MAX_RETRY_AFTER_MS: u64 = 24 * 60 * 60 * 1000;
/// Status URLs remembered per handler (oldest forgotten first; see [`HttpHandler`]).
const STATUS_URL_CACHE: usize = 10_000;

/// Back-off of a `429` reply without a usable `Retry-After` (delay-seconds).
const DEFAULT_RATE_LIMITED: Duration = Duration::from_secs(1);
/// Longest back-off a `429` reply's `Retry-After` is taken for.
const MAX_RATE_LIMITED: Duration = Duration::from_secs(3600);

/// The back-off a `429 Too Many Requests` reply asks for: its `Retry-After` in delay-seconds
/// (between 1 s and 1 h), else [`DEFAULT_RATE_LIMITED`] (also for the HTTP-date form).
fn rate_limited_for(headers: &HeaderMap) -> Duration {
    headers
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|s| Duration::from_secs(s).clamp(Duration::from_secs(1), MAX_RATE_LIMITED))
        .unwrap_or(DEFAULT_RATE_LIMITED)
}

/// Configuration of an [`HttpHandler`]. Checked by [`HttpHandler::new`].
#[derive(Clone, Debug)]
pub struct HttpHandlerConfig {
    /// The webhook: an absolute `http://` or `https://` URL with a host and no user info
    /// (put credentials in `headers`).
    pub url: String,
    /// Limit of each request, connect to last byte, redirects included. Default 10 s; from 1 ms
    /// to 1 h.
    pub timeout: Duration,
    /// Allow link-local (`169.254.0.0/16`, `fe80::/10`) and cloud-metadata (`169.254.169.254`,
    /// `fd00:ec2::254`, `100.100.100.200`) addresses, as URL literals and as DNS answers.
    /// Default `false`: refused.
    pub allow_link_local: bool,
    /// Extra request headers `(name, value)`, e.g. `("Authorization", "Bearer …")`. Values are
    /// never logged. `Content-Type`, `Accept`, `Host`, `Content-Length` and
    /// `Transfer-Encoding` are set by the handler and refused here.
    pub headers: Vec<(String, String)>,
}

impl Default for HttpHandlerConfig {
    /// An empty `url` (must be set), 10 s timeout, link-local refused, no headers.
    fn default() -> Self {
        Self { url: String::new(), timeout: DEFAULT_HTTP_TIMEOUT, allow_link_local: false, headers: Vec::new() }
    }
}

impl HttpHandlerConfig {
    /// The defaults with `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self { url: url.into(), ..Self::default() }
    }
}

/// True for the addresses the `http` handler refuses unless `allow_link_local`: IPv4 link-local
/// `169.254.0.0/16` (which holds the AWS/GCP/Azure metadata address `169.254.169.254`), IPv6
/// link-local `fe80::/10`, AWS's IPv6 metadata address `fd00:ec2::254`, Alibaba Cloud's
/// `100.100.100.200`; and those IPv4 addresses written as IPv4-mapped (`::ffff:a.b.c.d`),
/// IPv4-compatible, NAT64 (`64:ff9b::/96`) or 6to4 (`2002::/16`) IPv6 addresses.
pub fn is_link_local_or_metadata(ip: IpAddr) -> bool {
    fn v4(a: Ipv4Addr) -> bool {
        a.is_link_local() || a == Ipv4Addr::new(100, 100, 100, 200)
    }
    match ip {
        IpAddr::V4(a) => v4(a),
        IpAddr::V6(a) => {
            let s = a.segments();
            let embedded = |hi: u16, lo: u16| Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8);
            (s[0] & 0xffc0) == 0xfe80
                || a == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)
                || a.to_ipv4().is_some_and(v4) // ::ffff:a.b.c.d and ::a.b.c.d
                || (s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] && v4(embedded(s[6], s[7])))
                || (s[0] == 0x2002 && v4(embedded(s[1], s[2])))
        }
    }
}

/// The `http` built-in handler (a webhook).
///
/// **`execute`** POSTs `{"id": …, "type": …, "params": …}` (JSON, `Content-Type:
/// application/json`; `params` exactly as submitted, byte for byte) to the configured URL. **`check_status`** (for a command that is
/// `RUNNING`) GETs the last `status_url` the webhook named for the command; when this process
/// knows none it POSTs `{"id": …, "type": …, "params": …, "check": true}` to the configured URL
/// instead (see "Status URLs" below).
///
/// **Replies.** A `2xx` reply whose body is one JSON object decides, `status` compared without
/// case:
///
/// | reply                                                                  | outcome |
/// |------------------------------------------------------------------------|---------|
/// | `{"status": "succeeded", "result": any}` (`result` absent: `null`)      | `SUCCEEDED` with `result` (its text as the webhook sent it) |
/// | `{"status": "failed", "error": text}` (`text` a non-empty string)       | `FAILED` with `text` (a real failure, not retried) |
/// | `{"status": "running", "status_url"?: url, "retry_after_ms"?: n}`       | `RUNNING`; next `check_status` after `n` ms (0 to 86 400 000), else the queue's `check_status_interval` |
///
/// A `429 Too Many Requests` reply is [`CommandResult::RateLimited`]: every worker of the queue
/// backs off for its `Retry-After` (delay-seconds, 1 s to 1 h; 1 s when absent or an HTTP-date)
/// and the same call is made again after it, not counted as an attempt.
///
/// Anything else is a [`HandlerError`] (retried with the queue's backoff up to `max_attempts`,
/// then `FAILED` with the message): a non-2xx status (`POST <url>: HTTP 503 Service
/// Unavailable: <start of the body>`), a timeout (`POST <url>: timed out after 10s`), a
/// connection or TLS error, a body over 1 MiB, a body that is not a JSON object, an unknown
/// `status`, a `failed` reply without an `error` text, a bad `status_url` or `retry_after_ms`.
/// URLs in messages carry no query string.
///
/// **Status URLs.** `status_url` is resolved against the configured URL (so `"/jobs/7"` and
/// `"jobs/7"` work) and must have the configured URL's origin (scheme, host and port). The
/// command service persists no handler data between `execute` and `check_status`, so the URL is
/// remembered in this handler's memory (the 10 000 latest commands), and a `running` reply
/// without `status_url` keeps the previous one. After a restart, or when another process polls
/// the command, the URL is unknown and `check_status` falls back to the check POST: a webhook
/// that returns status URLs should answer check POSTs too (simplest: the same reply as the
/// status URL would give).
///
/// **Cancellation.** When the command is cancelled during a request, the request is dropped and
/// the call returns [`CommandResult::cancelled`]; the webhook is not told.
///
/// **Security.**
/// * Only `http` and `https` (rustls, Mozilla's root certificates); no user info in URLs.
/// * Redirects: at most 5, each to the configured URL's origin (scheme + host + port); a
///   redirect elsewhere fails the request (a handler error).
/// * Link-local and cloud-metadata addresses ([`is_link_local_or_metadata`]) are refused unless
///   `allow_link_local`: IP-literal URLs at construction (and for status URLs), and every
///   address a host name resolves to, checked in the resolver the connection uses — when any
///   resolved address is refused the request fails, so DNS rebinding cannot slip through.
/// * Proxy settings of the environment (`HTTP_PROXY`, …) are ignored: a proxy would resolve
///   names itself, out of reach of the address check.
pub struct HttpHandler {
    url: Url,
    timeout: Duration,
    allow_link_local: bool,
    client: Client,
    status_urls: Mutex<StatusUrls>,
}

impl std::fmt::Debug for HttpHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpHandler")
            .field("url", &redact(&self.url))
            .field("timeout", &self.timeout)
            .field("allow_link_local", &self.allow_link_local)
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct StatusUrls {
    map: HashMap<String, Url>,
    order: VecDeque<String>,
}

impl StatusUrls {
    fn set(&mut self, id: &str, url: Url) {
        if self.map.insert(id.to_string(), url).is_none() {
            self.order.push_back(id.to_string());
            while self.order.len() > STATUS_URL_CACHE {
                if let Some(old) = self.order.pop_front() {
                    self.map.remove(&old);
                }
            }
        }
    }
    fn remove(&mut self, id: &str) {
        if self.map.remove(id).is_some() {
            self.order.retain(|x| x != id);
        }
    }
}

impl HttpHandler {
    /// Checks `config` and builds the handler (its HTTP client resolves names with the system
    /// resolver, `getaddrinfo`).
    ///
    /// Errors (one message naming the field and what to fix): `url` empty, not absolute, not
    /// `http`/`https`, without host, with user info, or an IP literal that is link-local or
    /// cloud-metadata while `allow_link_local` is false; `timeout` zero or above 1 h; a header
    /// name or value that is not valid HTTP, or one the handler sets itself.
    pub fn new(config: HttpHandlerConfig) -> Result<Self, String> {
        Self::build(config, None)
    }

    /// [`HttpHandler::new`] resolving host names with `resolver` instead of the system's (a
    /// custom DNS, or a fixed table in tests). Its answers are checked like the system's.
    pub fn with_resolver(config: HttpHandlerConfig, resolver: Arc<dyn Resolve>) -> Result<Self, String> {
        Self::build(config, Some(resolver))
    }

    /// The configured webhook URL.
    pub fn url(&self) -> &Url {
        &self.url
    }

    fn build(config: HttpHandlerConfig, resolver: Option<Arc<dyn Resolve>>) -> Result<Self, String> {
        let url = Url::parse(config.url.trim())
            .map_err(|e| format!("http handler: url {:?} is not an absolute URL ({e})", config.url))?;
        check_url(&url, config.allow_link_local).map_err(|e| format!("http handler: url: {e}"))?;
        if config.timeout.is_zero() || config.timeout > MAX_HTTP_TIMEOUT {
            return Err(format!(
                "http handler: timeout must be from 1ms to 1h (got {})",
                humantime::format_duration(config.timeout)
            ));
        }
        let mut headers = HeaderMap::new();
        for (name, value) in &config.headers {
            let n = HeaderName::from_bytes(name.trim().as_bytes())
                .map_err(|_| format!("http handler: header name {name:?} is not a valid HTTP header name"))?;
            if ["content-type", "accept", "host", "content-length", "transfer-encoding"].contains(&n.as_str()) {
                return Err(format!("http handler: header {name:?} is set by the handler; remove it"));
            }
            let mut v = HeaderValue::from_str(value)
                .map_err(|_| format!("http handler: the value of header {name:?} is not a valid HTTP header value"))?;
            v.set_sensitive(true);
            headers.append(n, v);
        }
        let origin = url.origin();
        let policy = redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() > MAX_REDIRECTS {
                let e = format!("more than {MAX_REDIRECTS} redirects");
                attempt.error(e)
            } else if attempt.url().origin() != origin {
                let e = format!(
                    "redirect to {} refused: only redirects to the webhook's origin ({}) are followed",
                    redact(attempt.url()),
                    origin.ascii_serialization()
                );
                attempt.error(e)
            } else {
                attempt.follow()
            }
        });
        let client = Client::builder()
            .redirect(policy)
            .no_proxy()
            .timeout(config.timeout)
            .connect_timeout(config.timeout)
            .default_headers(headers)
            .user_agent(concat!("baton/", env!("CARGO_PKG_VERSION")))
            .dns_resolver(Arc::new(GuardedResolver { inner: resolver, allow_link_local: config.allow_link_local }))
            .build()
            .map_err(|e| format!("http handler: cannot build the HTTP client: {}", error_chain(&e)))?;
        Ok(Self {
            url,
            timeout: config.timeout,
            allow_link_local: config.allow_link_local,
            client,
            status_urls: Mutex::new(StatusUrls::default()),
        })
    }

    /// Sends `req`, reads a 2xx JSON reply and maps it to a result (see the type's docs).
    async fn call(&self, command: &Command, req: RequestBuilder, what: &str) -> Result<CommandResult, HandlerError> {
        // W3C trace context: the handler call's span when spans are exported, else the
        // command's own as submitted (`crate::trace::outgoing`); no header without either.
        let req = match crate::trace::outgoing(command.trace_context()) {
            Some(cx) => {
                let req = req.header("traceparent", cx.traceparent);
                match cx.tracestate {
                    Some(ts) => req.header("tracestate", ts),
                    None => req,
                }
            }
            None => req,
        };
        let work = async {
            let mut resp = req.send().await.map_err(|e| self.request_error(what, e))?;
            let status = resp.status();
            if status == reqwest::StatusCode::TOO_MANY_REQUESTS {
                // Rate limited downstream: not an error; the queue backs off and calls again.
                return Ok(CommandResult::rate_limited(rate_limited_for(resp.headers())));
            }
            let mut body = Vec::new();
            let mut too_big = false;
            while let Some(chunk) = resp.chunk().await.map_err(|e| self.request_error(what, e))? {
                if body.len() + chunk.len() > MAX_REPLY_BYTES {
                    too_big = true;
                    break;
                }
                body.extend_from_slice(&chunk);
            }
            if !status.is_success() {
                let text = String::from_utf8_lossy(&body);
                let snippet: String = text.trim().chars().take(200).collect();
                let reason = status.canonical_reason().map(|r| format!(" {r}")).unwrap_or_default();
                let sep = if snippet.is_empty() { "" } else { ": " };
                return Err(format!("{what}: HTTP {}{reason}{sep}{snippet}", status.as_u16()).into());
            }
            if too_big {
                return Err(format!("{what}: reply larger than {MAX_REPLY_BYTES} bytes").into());
            }
            let reply: Value = serde_json::from_slice(&body)
                .map_err(|e| format!("{what}: reply is not valid JSON ({e}); expected {REPLY_SHAPE}"))?;
            let decided = self.decide(command, &reply).map_err(|e| HandlerError::from(format!("{what}: {e}")))?;
            Ok(match decided {
                // The reply's `result` exactly as the webhook wrote it (the `Value` above rounds
                // numbers and reorders keys).
                CommandResult::Succeeded(_) => CommandResult::Succeeded(raw_result(&body)),
                other => other,
            })
        };
        tokio::select! {
            r = work => r,
            _ = command.cancelled() => Ok(CommandResult::cancelled()),
        }
    }

    fn request_error(&self, what: &str, e: reqwest::Error) -> HandlerError {
        if e.is_timeout() {
            format!("{what}: timed out after {}", humantime::format_duration(self.timeout)).into()
        } else {
            format!("{what}: {}", error_chain(&e.without_url())).into()
        }
    }

    /// Maps a reply object to a result, remembering or forgetting the command's status URL.
    fn decide(&self, command: &Command, reply: &Value) -> Result<CommandResult, String> {
        let obj = reply.as_object().ok_or_else(|| format!("reply is not a JSON object; expected {REPLY_SHAPE}"))?;
        let status = match obj.get("status") {
            Some(Value::String(s)) => s.to_ascii_lowercase(),
            Some(v) => return Err(format!("reply \"status\" is not a string (got {v}); expected {REPLY_SHAPE}")),
            None => return Err(format!("reply has no \"status\"; expected {REPLY_SHAPE}")),
        };
        let r = match status.as_str() {
            "succeeded" => CommandResult::succeeded(obj.get("result").cloned().unwrap_or(Value::Null)),
            "failed" => match obj.get("error") {
                Some(Value::String(e)) if !e.trim().is_empty() => CommandResult::failed(e.clone()),
                _ => return Err("a \"failed\" reply needs a non-empty \"error\" string".into()),
            },
            "running" => {
                let delay = match obj.get("retry_after_ms") {
                    None | Some(Value::Null) => None,
                    Some(v) => match v.as_u64() {
                        Some(ms) if ms <= MAX_RETRY_AFTER_MS => Some(Duration::from_millis(ms)),
                        _ => {
                            return Err(format!(
                                "\"retry_after_ms\" must be an integer from 0 to {MAX_RETRY_AFTER_MS}; got {v}"
                            ))
                        }
                    },
                };
                match obj.get("status_url") {
                    None | Some(Value::Null) => {}
                    Some(Value::String(s)) => {
                        let u = self.status_url(s)?;
                        self.status_urls.lock().unwrap().set(&command.id, u);
                    }
                    Some(v) => return Err(format!("\"status_url\" must be a string; got {v}")),
                }
                return Ok(match delay {
                    Some(d) => CommandResult::running_after(d),
                    None => CommandResult::running(),
                });
            }
            other => return Err(format!("unknown status {other:?} in reply; expected succeeded, failed or running")),
        };
        self.status_urls.lock().unwrap().remove(&command.id);
        Ok(r)
    }

    /// Resolves a reply's `status_url` against the configured URL and checks it.
    fn status_url(&self, s: &str) -> Result<Url, String> {
        let u = self.url.join(s).map_err(|e| format!("\"status_url\" {s:?} is not a URL ({e})"))?;
        if u.origin() != self.url.origin() {
            return Err(format!(
                "\"status_url\" {} refused: it must have the webhook's origin ({})",
                redact(&u),
                self.url.origin().ascii_serialization()
            ));
        }
        check_url(&u, self.allow_link_local).map_err(|e| format!("\"status_url\": {e}"))?;
        Ok(u)
    }
}

/// The `result` of a (valid JSON object) reply as its text (a key given twice: the last, as the
/// `Value` that decided reads it); `null` when absent.
fn raw_result(body: &[u8]) -> RawJson {
    serde_json::from_slice::<HashMap<String, &serde_json::value::RawValue>>(body)
        .ok()
        .and_then(|m| m.get("result").map(|r| RawJson::from((*r).to_owned())))
        .unwrap_or_default()
}

/// A request body of the webhook: the command's id, type and params (as submitted, byte for
/// byte), and `check: true` for a status check.
#[derive(serde::Serialize)]
struct Outgoing<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    command_type: &'a str,
    params: &'a RawJson,
    #[serde(skip_serializing_if = "Option::is_none")]
    check: Option<bool>,
}

impl<'a> Outgoing<'a> {
    fn of(command: &'a Command, check: bool) -> Self {
        Outgoing {
            id: &command.id,
            command_type: &command.command_type,
            params: &command.params,
            check: check.then_some(true),
        }
    }
}

const REPLY_SHAPE: &str = "{\"status\": \"succeeded\"|\"failed\"|\"running\", …}";

#[async_trait]
impl CommandHandler for HttpHandler {
    async fn execute(&self, command: Command) -> Result<CommandResult, HandlerError> {
        let req = self.post(&Outgoing::of(&command, false))?;
        self.call(&command, req, &format!("POST {}", redact(&self.url))).await
    }

    async fn check_status(&self, command: Command, _state: CommandState) -> Result<CommandResult, HandlerError> {
        let known = self.status_urls.lock().unwrap().map.get(&command.id).cloned();
        match known {
            Some(u) => {
                let what = format!("GET {}", redact(&u));
                let req = self.client.get(u).header(reqwest::header::ACCEPT, "application/json");
                self.call(&command, req, &what).await
            }
            None => {
                let req = self.post(&Outgoing::of(&command, true))?;
                self.call(&command, req, &format!("POST {} (check)", redact(&self.url))).await
            }
        }
    }
}

impl HttpHandler {
    fn post(&self, body: &Outgoing<'_>) -> Result<RequestBuilder, HandlerError> {
        let bytes = serde_json::to_vec(body)?;
        Ok(self
            .client
            .post(self.url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(reqwest::header::ACCEPT, "application/json")
            .body(bytes))
    }
}

/// Scheme, host, user info and IP-literal checks of a URL.
fn check_url(url: &Url, allow_link_local: bool) -> Result<(), String> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("scheme {:?} is not supported: use http or https", url.scheme()));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("user info (user:password@) is not allowed in the URL: put credentials in headers".into());
    }
    let ip = match url.host() {
        None => return Err("the URL has no host".into()),
        Some(url::Host::Domain(_)) => None,
        Some(url::Host::Ipv4(a)) => Some(IpAddr::V4(a)),
        Some(url::Host::Ipv6(a)) => Some(IpAddr::V6(a)),
    };
    if let Some(ip) = ip {
        if !allow_link_local && is_link_local_or_metadata(ip) {
            return Err(format!(
                "address {ip} is link-local or cloud-metadata and is refused (set allow_link_local = true to allow it)"
            ));
        }
    }
    Ok(())
}

/// `scheme://host:port/path`, without user info, query or fragment (for messages and logs).
fn redact(url: &Url) -> String {
    let mut u = url.clone();
    let _ = u.set_username("");
    let _ = u.set_password(None);
    u.set_query(None);
    u.set_fragment(None);
    u.to_string()
}

/// An error and its sources, joined with `: ` (repeats dropped).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(s) = cur {
        let t = s.to_string();
        if !parts.iter().any(|p| p.contains(&t)) {
            parts.push(t);
        }
        cur = s.source();
    }
    parts.join(": ")
}

/// The resolver of the handler's client: resolves with the inner resolver (or the system's) and
/// refuses the whole answer when any address is link-local or cloud-metadata.
struct GuardedResolver {
    inner: Option<Arc<dyn Resolve>>,
    allow_link_local: bool,
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_string();
        let inner = self.inner.clone();
        let allow = self.allow_link_local;
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = match inner {
                Some(r) => r.resolve(name).await?.collect(),
                None => tokio::net::lookup_host((host.as_str(), 0)).await?.collect(),
            };
            if addrs.is_empty() {
                return Err(format!("host {host} resolved to no address").into());
            }
            if !allow {
                if let Some(bad) = addrs.iter().find(|a| is_link_local_or_metadata(a.ip())) {
                    return Err(format!(
                        "host {host} resolves to {}, a link-local or cloud-metadata address; refused (set allow_link_local = true to allow it)",
                        bad.ip()
                    )
                    .into());
                }
            }
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_addresses() {
        for a in [
            "169.254.169.254",
            "169.254.0.1",
            "100.100.100.200",
            "fe80::1",
            "febf::1",
            "fd00:ec2::254",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "2002:a9fe:a9fe::1",
        ] {
            assert!(is_link_local_or_metadata(a.parse().unwrap()), "{a} allowed");
        }
        for a in ["127.0.0.1", "10.0.0.1", "100.100.100.201", "::1", "fec0::1", "fd00:ec2::253", "2002:7f00:1::1"] {
            assert!(!is_link_local_or_metadata(a.parse().unwrap()), "{a} refused");
        }
    }

    #[test]
    fn config_is_checked() {
        let err = |c: HttpHandlerConfig| HttpHandler::new(c).unwrap_err();
        assert!(err(HttpHandlerConfig::new("")).contains("is not an absolute URL"));
        assert!(err(HttpHandlerConfig::new("ftp://x/")).contains("scheme \"ftp\" is not supported"));
        assert!(err(HttpHandlerConfig::new("http://u:p@x/")).contains("user info"));
        assert!(err(HttpHandlerConfig::new("http://169.254.169.254/latest")).contains("link-local or cloud-metadata"));
        assert!(err(HttpHandlerConfig::new("http://[fe80::1]/")).contains("link-local or cloud-metadata"));
        assert!(err(HttpHandlerConfig::new("http://[::ffff:169.254.169.254]/")).contains("link-local"));
        assert!(err(HttpHandlerConfig::new("http://2852039166/")).contains("169.254.169.254"));
        assert!(err(HttpHandlerConfig::new("http://100.100.100.200/")).contains("cloud-metadata"));
        let mut c = HttpHandlerConfig::new("http://169.254.169.254/");
        c.allow_link_local = true;
        assert!(HttpHandler::new(c).is_ok());
        let mut c = HttpHandlerConfig::new("http://x/");
        c.timeout = Duration::ZERO;
        assert_eq!(err(c), "http handler: timeout must be from 1ms to 1h (got 0s)");
        let mut c = HttpHandlerConfig::new("http://x/");
        c.headers = vec![("Content-Type".into(), "text/plain".into())];
        assert_eq!(err(c), "http handler: header \"Content-Type\" is set by the handler; remove it");
        let mut c = HttpHandlerConfig::new("http://x/");
        c.headers = vec![("bad name".into(), "v".into())];
        assert!(err(c).contains("not a valid HTTP header name"));
        let mut c = HttpHandlerConfig::new("https://example.test/hook?k=secret");
        c.headers = vec![("Authorization".into(), "Bearer t".into())];
        let h = HttpHandler::new(c).unwrap();
        assert_eq!(redact(h.url()), "https://example.test/hook");
    }
}
