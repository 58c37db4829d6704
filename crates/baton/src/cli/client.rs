//! The HTTP side of the client subcommands: one `reqwest` client, the bearer token, and the
//! mapping of HTTP answers and transport failures to exit codes.

use std::time::Duration;

use reqwest::{Method, RequestBuilder, Response, StatusCode};
use serde_json::Value;

use super::args::Conn;
use super::exit;

/// An error that ends a subcommand: its message (for stderr) and exit code.
#[derive(Debug)]
pub struct CliError {
    pub code: u8,
    pub message: String,
}

impl CliError {
    pub fn usage(m: impl Into<String>) -> Self {
        CliError { code: exit::USAGE, message: m.into() }
    }
    pub fn server(m: impl Into<String>) -> Self {
        CliError { code: exit::SERVER, message: m.into() }
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        CliError { code: exit::NOT_FOUND, message: m.into() }
    }
}

/// The exit code for an HTTP error status.
pub fn code_for(status: StatusCode) -> u8 {
    match status.as_u16() {
        404 | 410 => exit::NOT_FOUND,
        401 | 403 | 409 | 412 => exit::REFUSED,
        400 | 405 | 413 | 415 | 422 | 431 => exit::USAGE,
        _ => exit::SERVER,
    }
}

/// A client of one server.
pub struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
    pub json: bool,
}

impl Client {
    pub fn new(conn: &Conn) -> Result<Self, CliError> {
        let base = conn.server.trim().trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(CliError::usage(format!(
                "--server {base:?} is not an http:// or https:// URL (e.g. http://127.0.0.1:7700)"
            )));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .user_agent(concat!("baton-cli/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| CliError::server(format!("cannot build an HTTP client: {e}")))?;
        let token = conn.token.clone().filter(|t| !t.trim().is_empty());
        Ok(Client { http, base, token, json: conn.json })
    }

    /// The server's base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// A request to `{base}{path_and_query}` with the token attached.
    pub fn request(&self, method: Method, path_and_query: &str) -> RequestBuilder {
        let rb = self.http.request(method, format!("{}{}", self.base, path_and_query));
        match &self.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    /// Sends; a transport failure is exit code 5.
    pub async fn send(&self, rb: RequestBuilder) -> Result<Response, CliError> {
        rb.send().await.map_err(|e| self.transport(e))
    }

    /// Sends and requires a 2xx (or 304); any other status becomes a [`CliError`] carrying the
    /// server's message.
    pub async fn send_ok(&self, rb: RequestBuilder) -> Result<Response, CliError> {
        let res = self.send(rb).await?;
        if res.status().is_success() || res.status() == StatusCode::NOT_MODIFIED {
            Ok(res)
        } else {
            Err(error_from(res).await)
        }
    }

    /// Sends, requires a 2xx and decodes a JSON body.
    pub async fn json_ok(&self, rb: RequestBuilder) -> Result<Value, CliError> {
        let res = self.send_ok(rb).await?;
        read_json(res).await
    }

    pub fn transport(&self, e: reqwest::Error) -> CliError {
        let what = if e.is_connect() {
            format!("cannot connect to {} (is `baton serve` running there? set --server or BATON_SERVER)", self.base)
        } else if e.is_timeout() {
            format!("{} did not answer in time", self.base)
        } else {
            format!("request to {} failed: {}", self.base, full_error(&e))
        };
        CliError::server(what)
    }
}

fn full_error(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

/// Decodes a JSON body; an unreadable one is a server error.
pub async fn read_json(res: Response) -> Result<Value, CliError> {
    read_json_text(res).await.map(|(_, v)| v)
}

/// [`read_json`], also returning the body's text (to print values exactly as the server sent
/// them).
pub async fn read_json_text(res: Response) -> Result<(String, Value), CliError> {
    let bytes = res.bytes().await.map_err(|e| CliError::server(format!("reading the reply failed: {e}")))?;
    let v = serde_json::from_slice(&bytes).map_err(|e| {
        CliError::server(format!(
            "the server's reply is not JSON ({e}): {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        ))
    })?;
    Ok((String::from_utf8_lossy(&bytes).into_owned(), v))
}

/// The error of a non-2xx answer. The message is the server's (`{"error": code, "message"}`, or
/// the subscription API's `{"error": {"code", "message"}}`), else the body text.
pub async fn error_from(res: Response) -> CliError {
    let status = res.status();
    let body = res.text().await.unwrap_or_default();
    let (code, message) = match serde_json::from_str::<Value>(&body) {
        Ok(v) => match (v.get("error"), v.get("message")) {
            (Some(Value::String(c)), Some(Value::String(m))) => (Some(c.clone()), m.clone()),
            // The Durable Streams subscription API's `{"error": {"code", "message"}}`.
            (Some(Value::Object(e)), None) => match (e.get("code"), e.get("message")) {
                (Some(Value::String(c)), Some(Value::String(m))) => (Some(c.clone()), m.clone()),
                _ => (None, body.trim().to_string()),
            },
            _ => (None, body.trim().to_string()),
        },
        Err(_) => (None, body.trim().to_string()),
    };
    let reason = status.canonical_reason().unwrap_or("");
    let head = match code {
        Some(c) => format!("{} {reason} ({c})", status.as_u16()),
        None => format!("{} {reason}", status.as_u16()),
    };
    // The server's advice is for HTTP clients; say it the CLI's way.
    let message = message.replace("; create it with PUT first", "; create it with `baton streams create`");
    let message = if status == StatusCode::UNAUTHORIZED {
        format!("{message}; with the CLI: --token TOKEN or BATON_TOKEN")
    } else {
        message
    };
    let message = if message.is_empty() { head } else { format!("{message} [{head}]") };
    CliError { code: code_for(status), message }
}

/// Percent-encodes one path segment (everything but unreserved characters).
pub fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Percent-encodes a query value.
pub fn encode_query(s: &str) -> String {
    encode_segment(s)
}

/// `/v1/stream/<segments…>` for a stream path like `acme/run-1` (each segment encoded).
pub fn stream_url_path(path: &str) -> Result<String, CliError> {
    let p = path.trim().trim_start_matches('/');
    let p = p.strip_prefix("v1/stream/").unwrap_or(p);
    if p.is_empty() || p.split('/').any(str::is_empty) {
        return Err(CliError::usage(format!(
            "{path:?} is not a stream path; use segments separated by /, e.g. acme/run-1"
        )));
    }
    let segs: Vec<String> = p.split('/').map(encode_segment).collect();
    Ok(format!("/v1/stream/{}", segs.join("/")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_encoded() {
        assert_eq!(stream_url_path("acme/run 1").unwrap(), "/v1/stream/acme/run%201");
        assert_eq!(stream_url_path("/v1/stream/a/b").unwrap(), "/v1/stream/a/b");
        assert!(stream_url_path("a//b").is_err());
        assert!(stream_url_path("").is_err());
        assert_eq!(encode_segment("a?b#c%"), "a%3Fb%23c%25");
    }

    #[test]
    fn statuses_map_to_codes() {
        assert_eq!(code_for(StatusCode::NOT_FOUND), exit::NOT_FOUND);
        assert_eq!(code_for(StatusCode::CONFLICT), exit::REFUSED);
        assert_eq!(code_for(StatusCode::BAD_REQUEST), exit::USAGE);
        assert_eq!(code_for(StatusCode::SERVICE_UNAVAILABLE), exit::SERVER);
    }
}
