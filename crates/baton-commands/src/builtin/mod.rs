//! Built-in command handlers an operator can enable per queue (issue 6; how `baton serve` enables
//! them: docs/configuration.md, "Command queues"):
//!
//! | kind    | handler            | params                 | outcome |
//! |---------|--------------------|------------------------|---------|
//! | `sleep` | [`SleepHandler`]   | `{"ms": n}`, 0 ≤ n ≤ 86 400 000 | `SUCCEEDED` with `{"slept_ms": n}` after `n` ms; `CANCELLED` at once when cancelled; progress reported every second |
//! | `echo`  | [`EchoHandler`]    | any JSON               | `SUCCEEDED` with the params |
//! | `fail`  | [`FailHandler`]    | `{"error": text}`      | `FAILED` with `text` |
//! | `http`  | [`HttpHandler`]    | any JSON               | POSTs the command to a webhook; its reply decides (see [`HttpHandler`]) |
//!
//! Bad params of `sleep` and `fail` are refused at submit (`validate`), with a message saying
//! what to fix.
//!
//! ## Configuration
//!
//! [`from_config`]`(kind, options)` builds a handler from a kind name and its options (a JSON
//! value; a TOML table converts with `serde_json::to_value(&table)`), and [`register`] adds it to
//! a [`CommandServiceBuilder`] under a command type. `sleep`, `echo` and `fail` take no options
//! (`null` or `{}`); `http` takes a table:
//!
//! ```toml
//! # e.g. in baton.toml, one table per command type of a queue (the binary decides the layout)
//! [queues.hooks.handlers.deploy]
//! kind = "http"
//! url = "https://ci.example.com/baton/deploy"  # required; http or https
//! timeout = "30s"                              # optional, human duration, default "10s", at most "1h"
//! allow_link_local = false                     # optional, default false
//! headers = { Authorization = "Bearer s3cr3t" } # optional, name → value
//! ```
//!
//! (The options passed to `from_config` are the table without its `kind`; a `kind` key inside the
//! options is ignored when it names the same kind.) Unknown option keys are refused.

mod echo;
mod fail;
mod http;
mod sleep;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value};

pub use echo::EchoHandler;
pub use fail::{fail_error, FailHandler};
pub use http::{
    is_link_local_or_metadata, HttpHandler, HttpHandlerConfig, DEFAULT_HTTP_TIMEOUT, MAX_HTTP_TIMEOUT, MAX_REDIRECTS,
    MAX_REPLY_BYTES, MAX_RETRY_AFTER_MS,
};
pub use sleep::{sleep_ms, SleepHandler, MAX_SLEEP_MS};

/// The DNS hook of [`HttpHandler::with_resolver`] (reqwest's).
pub use reqwest::dns::{Addrs, Name, Resolve, Resolving};

use crate::{CommandHandler, CommandServiceBuilder, RawJson};

/// Params read as a `Value`, for the built-ins that look inside them (error: what serde_json
/// refused, e.g. a number beyond the `f64` range).
fn value_of(params: &RawJson) -> Result<Value, String> {
    params.parse().map_err(|e| format!("params do not read as JSON values ({e})"))
}

/// The kinds of built-in handler, by config name (`sleep`, `echo`, `fail`, `http`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BuiltinKind {
    Sleep,
    Echo,
    Fail,
    Http,
}

impl BuiltinKind {
    /// Every kind.
    pub const ALL: [BuiltinKind; 4] = [BuiltinKind::Sleep, BuiltinKind::Echo, BuiltinKind::Fail, BuiltinKind::Http];

    /// The config name, e.g. `"sleep"`.
    pub fn as_str(self) -> &'static str {
        match self {
            BuiltinKind::Sleep => "sleep",
            BuiltinKind::Echo => "echo",
            BuiltinKind::Fail => "fail",
            BuiltinKind::Http => "http",
        }
    }
}

impl fmt::Display for BuiltinKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for BuiltinKind {
    type Err = String;
    /// Case-insensitive, surrounding whitespace ignored. Error: `unknown built-in handler "x":
    /// use one of sleep, echo, fail, http`.
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        BuiltinKind::ALL
            .into_iter()
            .find(|k| k.as_str().eq_ignore_ascii_case(t))
            .ok_or_else(|| format!("unknown built-in handler {s:?}: use one of sleep, echo, fail, http"))
    }
}

/// Builds the built-in handler `kind` (`sleep`, `echo`, `fail` or `http`) from its `options`
/// (formats in the module docs).
///
/// Errors, one message saying what to fix: an unknown kind; options for `sleep`/`echo`/`fail`
/// other than `null` or `{}`; for `http`, options that are not an object, a missing `url`, an
/// unknown key, a wrong type, a `timeout` that is not a human duration (`"500ms"`, `"10s"`,
/// `"2m"`), or anything [`HttpHandler::new`] refuses.
pub fn from_config(kind: &str, options: &Value) -> Result<Arc<dyn CommandHandler>, String> {
    let k: BuiltinKind = kind.parse()?;
    let opts = options_map(k, options)?;
    match k {
        BuiltinKind::Sleep | BuiltinKind::Echo | BuiltinKind::Fail => {
            if let Some(key) = opts.keys().next() {
                return Err(format!("built-in handler {k} takes no options (got {key:?})"));
            }
            Ok(match k {
                BuiltinKind::Sleep => Arc::new(SleepHandler),
                BuiltinKind::Echo => Arc::new(EchoHandler),
                _ => Arc::new(FailHandler),
            })
        }
        BuiltinKind::Http => Ok(Arc::new(HttpHandler::new(http_config(&opts)?)?)),
    }
}

/// Registers the built-in handler `kind` (built by [`from_config`]) for commands of
/// `command_type` on `builder`. Errors: those of [`from_config`].
pub fn register(
    builder: CommandServiceBuilder,
    command_type: impl Into<String>,
    kind: &str,
    options: &Value,
) -> Result<CommandServiceBuilder, String> {
    Ok(builder.handler_arc(command_type, from_config(kind, options)?))
}

/// `null` → empty; an object → itself without a `kind` key naming `k`.
fn options_map(k: BuiltinKind, options: &Value) -> Result<Map<String, Value>, String> {
    let mut m = match options {
        Value::Null => Map::new(),
        Value::Object(m) => m.clone(),
        other => return Err(format!("options of built-in handler {k} must be a table/object, got {other}")),
    };
    if let Some(v) = m.get("kind") {
        match v.as_str().map(str::parse::<BuiltinKind>) {
            Some(Ok(same)) if same == k => {
                m.remove("kind");
            }
            _ => return Err(format!("options of built-in handler {k} hold a different \"kind\": {v}")),
        }
    }
    Ok(m)
}

fn http_config(opts: &Map<String, Value>) -> Result<HttpHandlerConfig, String> {
    let mut c = HttpHandlerConfig::default();
    let mut url = None;
    for (key, v) in opts {
        match key.as_str() {
            "url" => {
                url = Some(v.as_str().ok_or_else(|| format!("http: \"url\" must be a string, got {v}"))?.to_string())
            }
            "timeout" => {
                let s = v
                    .as_str()
                    .ok_or_else(|| format!("http: \"timeout\" must be a duration string like \"10s\", got {v}"))?;
                c.timeout = parse_duration(s).map_err(|e| format!("http: \"timeout\" {s:?}: {e}"))?;
            }
            "allow_link_local" => {
                c.allow_link_local =
                    v.as_bool().ok_or_else(|| format!("http: \"allow_link_local\" must be true or false, got {v}"))?
            }
            "headers" => {
                let m = v
                    .as_object()
                    .ok_or_else(|| format!("http: \"headers\" must be a table of name = \"value\", got {v}"))?;
                for (name, value) in m {
                    let value =
                        value.as_str().ok_or_else(|| format!("http: header {name:?} must have a string value"))?;
                    c.headers.push((name.clone(), value.to_string()));
                }
            }
            other => {
                return Err(format!("http: unknown option {other:?}; use url, timeout, allow_link_local, headers"))
            }
        }
    }
    c.url = url.ok_or("http: missing option \"url\" (the webhook URL, http:// or https://)")?;
    Ok(c)
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim())
        .map_err(|e| format!("not a duration ({e}); use e.g. \"500ms\", \"10s\", \"2m\""))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn kinds_parse() {
        assert_eq!("Sleep".parse::<BuiltinKind>(), Ok(BuiltinKind::Sleep));
        assert_eq!(
            "nap".parse::<BuiltinKind>().unwrap_err(),
            "unknown built-in handler \"nap\": use one of sleep, echo, fail, http"
        );
        for k in BuiltinKind::ALL {
            assert_eq!(k.as_str().parse::<BuiltinKind>(), Ok(k));
        }
    }

    #[test]
    fn from_config_checks_options() {
        assert!(from_config("echo", &Value::Null).is_ok());
        assert!(from_config("sleep", &json!({})).is_ok());
        assert!(from_config("fail", &json!({"kind": "fail"})).is_ok());
        let err = |k: &str, o: Value| from_config(k, &o).err().expect("refused");
        assert_eq!(err("echo", json!({"x": 1})), "built-in handler echo takes no options (got \"x\")");
        assert_eq!(
            err("echo", json!({"kind": "http"})),
            "options of built-in handler echo hold a different \"kind\": \"http\""
        );
        assert_eq!(err("http", json!({})), "http: missing option \"url\" (the webhook URL, http:// or https://)");
        assert_eq!(
            err("http", json!({"url": "http://x/", "retries": 3})),
            "http: unknown option \"retries\"; use url, timeout, allow_link_local, headers"
        );
        assert!(err("http", json!({"url": "http://x/", "timeout": "soon"}))
            .starts_with("http: \"timeout\" \"soon\": not a duration"));
        assert_eq!(
            err("http", json!({"url": "http://x/", "timeout": 5})),
            "http: \"timeout\" must be a duration string like \"10s\", got 5"
        );
        assert!(err("http", json!({"url": "http://169.254.169.254/"})).contains("link-local"));
        assert!(from_config(
            "http",
            &json!({"url": "http://169.254.169.254/", "allow_link_local": true, "timeout": "1s",
                    "headers": {"Authorization": "Bearer x"}})
        )
        .is_ok());
        assert_eq!(
            err("http", json!({"url": "http://x/", "headers": {"A": 1}})),
            "http: header \"A\" must have a string value"
        );
    }
}
