//! Command queues from configuration (`[queues.*]`): their settings and built-in handlers.
//!
//! A queue is a TOML table `[queues.<name>]` (every key optional):
//!
//! ```toml
//! [queues.default]
//! concurrency = 16                 # handlers at once, 1 – 100000
//! claim_timeout = "30s"            # a dead worker's command is taken over after this long
//! check_status_interval = "10s"    # delay between check_status calls of RUNNING commands
//! max_processing_time = "15m"      # a handler running longer loses its lease (it is signalled)
//! poll_interval = "1s"             # reclaim cadence (default: the work queue's)
//! reap_idle_consumers_after = "1h" # dead group members (no heartbeat this long, nothing pending) are removed, or "never"
//! max_concurrency = 50             # commands running at once across every process (default: no cap)
//! concurrency_per_key = 1          # commands of one concurrency_key running at once (default: no cap)
//! retry = { max_attempts = 5, initial_backoff = "1s", backoff_factor = 2.0, max_backoff = "5m" }
//! rate_limit = { limit = 1000, per = "1s", burst = 50 }  # commands started at most 1000/s by all workers; burst default = limit
//! events = { enabled = true, max_len = 100000 }  # the queue's event feed: on, the newest 100,000 kept
//! state_ttl = "7d"                 # an unfinished command's state expires this long after its last write
//! retention = "24h"                # a finished command's state is kept this long
//!
//! [queues.default.webhook]         # completion webhook (optional; see docs/workers.md)
//! url = "https://hooks.example.com/baton"
//! events = ["succeeded", "failed", "cancelled"]  # default: every terminal status
//! timeout = "10s"                  # one attempt's limit
//! max_deliveries = 10              # attempts before the delivery becomes a dead letter
//! claim_timeout = "30s"            # failover of a delivery in flight; delay before a retry
//!
//! [queues.default.handlers]        # command type → built-in handler
//! sleep = "sleep"                  # shorthand: the kind alone
//! echo = { kind = "echo" }
//! deploy = { kind = "http", url = "https://ci.example.com/hook", timeout = "30s" }
//!
//! [[queues.default.schedules]]     # cron schedules (see docs/configuration.md)
//! name = "hourly-echo"             # unique in the queue
//! cron = "0 * * * *"               # 5 fields, or 6 with seconds first
//! timezone = "UTC"                 # IANA name (default UTC)
//! type = "echo"                    # the command submitted, with `params`
//! params = { hello = "world" }
//! overlap = "skip"                 # "skip" | "allow" | "cancel_previous"
//! missed = "skip"                  # "skip" | "run_once" | "run_all" (max_catch_up, missed_after)
//! ```
//!
//! With no `[queues]` at all, one queue `default` with `sleep`, `echo` and `fail` is configured
//! ([`default_queues`]) so a fresh `baton serve` can run commands out of the box.
//!
//! `events` is the queue's durable event feed (`GET /v1/queues/<name>/events`, and its commands'
//! `GET /v1/commands/{id}/events`): `enabled` (default true) appends its commands' transitions,
//! `max_len` (default 100,000, at least 1) is how many of the newest are kept (on Redis about that
//! many: `XADD MAXLEN ~`). Every process writing the queue's commands (`baton serve`, `baton
//! worker`) should say the same: each applies its own to its writes.
//!
//! `state_ttl` and `retention` (each at least 1 s; defaults 7 days and 24 hours) are the lifetimes
//! of the queue's command states: every process writing them should say the same, as for `events`.
//!
//! The `workers` module runs them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use baton_commands::schedules::{Missed, Overlap, Schedule, ScheduleError};
use baton_commands::{
    builtin, CommandHandler, CommandStatus, CommandStoreSettings, FeedSettings, Lifetimes, QueueSettings, RetryPolicy,
};
use serde::Deserialize;
use serde_json::Value;

use super::values::parse_duration;

/// `[queues.<name>]` as written in TOML (durations as strings).
#[derive(Deserialize, Debug, Default, Clone)]
#[serde(deny_unknown_fields)]
pub struct QueueFile {
    pub concurrency: Option<usize>,
    pub claim_timeout: Option<String>,
    pub check_status_interval: Option<String>,
    pub max_processing_time: Option<String>,
    pub poll_interval: Option<String>,
    /// A duration, or `"never"` (also `"none"`, `"off"`).
    pub reap_idle_consumers_after: Option<String>,
    /// Signed, so that a negative value is refused with the key named (not as a TOML type error).
    pub max_concurrency: Option<i64>,
    pub concurrency_per_key: Option<i64>,
    pub retry: Option<RetryFile>,
    /// `rate_limit = { limit, per, burst }`: the queue's rate limit.
    pub rate_limit: Option<RateLimitFile>,
    /// `rate_limit_per_key = { limit, per, burst }`: the rate limit of each concurrency key.
    pub rate_limit_per_key: Option<RateLimitFile>,
    /// `events = { … }`: the queue's event feed.
    pub events: Option<EventsFile>,
    /// Lifetimes of the queue's command states (durations).
    pub state_ttl: Option<String>,
    pub retention: Option<String>,
    /// `[queues.<name>.webhook]`: its completion webhook.
    pub webhook: Option<WebhookFile>,
    /// Command type → kind name (`"sleep"`) or a table with `kind` and the kind's options.
    #[serde(default)]
    pub handlers: BTreeMap<String, toml::Value>,
    /// `[[queues.<name>.schedules]]`: its cron schedules.
    #[serde(default)]
    pub schedules: Vec<ScheduleFile>,
}

/// `rate_limit = { limit = 1000, per = "1s", burst = 50 }` as written in TOML.
#[derive(Deserialize, Debug, Default, Clone)]
#[serde(deny_unknown_fields)]
pub struct RateLimitFile {
    pub limit: Option<u32>,
    /// A duration; default `"1s"`.
    pub per: Option<String>,
    /// Default: `limit`.
    pub burst: Option<u32>,
}

/// `rate_limit` (or `rate_limit_per_key`, the setting named `setting`) resolved: `limit` is
/// required (1 – 1,000,000 per second), `per` defaults to 1 s (at least 1 ms), `burst` to `limit`
/// (at least 1). Errors name the key (`queues.<q>.<setting>.<key>: <what to fix>`).
fn rate_limit(name: &str, setting: &str, f: &RateLimitFile) -> Result<baton_queue::RateLimit, String> {
    let key = |k: &str| format!("queues.{name}.{setting}.{k}");
    let limit = f
        .limit
        .ok_or_else(|| format!("{}: missing; e.g. {setting} = {{ limit = 100, per = \"1s\" }}", key("limit")))?;
    if limit == 0 {
        return Err(format!("{}: must be at least 1", key("limit")));
    }
    let per = match &f.per {
        Some(p) => parse_duration(p).map_err(|e| format!("{}: {e}", key("per")))?,
        None => Duration::from_secs(1),
    };
    if per < Duration::from_millis(1) {
        return Err(format!("{}: {} is under the least period, 1ms", key("per"), humantime::format_duration(per)));
    }
    let burst = f.burst.unwrap_or(limit);
    if burst == 0 {
        return Err(format!("{}: must be at least 1 (default: limit)", key("burst")));
    }
    let r = baton_queue::RateLimit::new(limit, per).with_burst(burst);
    r.validate_as(setting).map_err(|e| format!("queues.{name}.{setting}: {e}"))?;
    Ok(r)
}

/// One `[[queues.<name>.schedules]]` as written in TOML.
#[derive(Deserialize, Debug, Default, Clone)]
#[serde(deny_unknown_fields)]
pub struct ScheduleFile {
    pub name: Option<String>,
    pub cron: Option<String>,
    pub timezone: Option<String>,
    #[serde(rename = "type")]
    pub command_type: Option<String>,
    pub params: Option<toml::Value>,
    pub overlap: Option<String>,
    pub missed: Option<String>,
    pub max_catch_up: Option<u32>,
    pub missed_after: Option<String>,
}

/// `[queues.<name>.webhook]` as written in TOML.
#[derive(Deserialize, Debug, Default, Clone)]
#[serde(deny_unknown_fields)]
pub struct WebhookFile {
    pub url: Option<String>,
    pub events: Option<Vec<String>>,
    pub timeout: Option<String>,
    pub max_deliveries: Option<u32>,
    pub claim_timeout: Option<String>,
}

/// A queue's completion webhook (`[queues.<name>.webhook]`): every terminal transition of its
/// commands to one of `statuses` is POSTed to `url` (see `crate::webhooks`).
#[derive(Clone, Debug, PartialEq)]
pub struct WebhookConfig {
    pub url: String,
    /// `events`: the terminal statuses delivered (default all three).
    pub statuses: std::collections::BTreeSet<CommandStatus>,
    /// One attempt's time limit (default 10 s, at most 24 h).
    pub timeout: Duration,
    /// Attempts before a delivery becomes a dead letter (default 10, 1 – 1000).
    pub max_deliveries: u32,
    /// The failover window of a delivery in flight (a process that dies mid-delivery), and the
    /// delay before a failed attempt is made again (default 30 s, 100 ms – 24 h).
    pub claim_timeout: Duration,
}

impl WebhookConfig {
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
    pub const DEFAULT_MAX_DELIVERIES: u32 = 10;
    pub const DEFAULT_CLAIM_TIMEOUT: Duration = Duration::from_secs(30);
    /// The most `timeout` and `claim_timeout` may be: 24 h.
    pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);
}

/// `retry = { … }` of a queue.
#[derive(Deserialize, Debug, Default, Clone)]
#[serde(deny_unknown_fields)]
pub struct RetryFile {
    pub max_attempts: Option<u32>,
    pub initial_backoff: Option<String>,
    pub backoff_factor: Option<f64>,
    pub max_backoff: Option<String>,
}

/// `events = { … }` of a queue: its event feed ([`FeedSettings`]; absent keys are its defaults).
#[derive(Deserialize, Debug, Default, Clone)]
#[serde(deny_unknown_fields)]
pub struct EventsFile {
    pub enabled: Option<bool>,
    pub max_len: Option<u64>,
}

/// One handler of a queue: commands of `command_type` run the built-in `kind` with `options`.
#[derive(Clone, Debug, PartialEq)]
pub struct HandlerConfig {
    pub command_type: String,
    /// `sleep`, `echo`, `fail` or `http`.
    pub kind: String,
    /// The kind's options (JSON object; `null` when none).
    pub options: Value,
}

/// A resolved queue: its name, settings and handlers (sorted by command type).
#[derive(Clone, Debug)]
pub struct QueueConfig {
    pub name: String,
    pub settings: QueueSettings,
    /// Its event feed (`events = { … }`).
    pub feed: FeedSettings,
    /// Its states' lifetimes (`state_ttl`, `retention`), when either is set.
    pub lifetimes: Option<Lifetimes>,
    /// Its completion webhook, if any (`[queues.<name>.webhook]`).
    pub webhook: Option<WebhookConfig>,
    pub handlers: Vec<HandlerConfig>,
    /// Its cron schedules (`[[queues.<name>.schedules]]`), in the order written.
    pub schedules: Vec<Schedule>,
}

impl QueueConfig {
    /// A queue with default settings and the built-in handlers `kinds`, each under its own name
    /// as command type (e.g. `sleep` runs `sleep`).
    pub fn with_builtins(name: &str, kinds: &[&str]) -> Self {
        QueueConfig {
            name: name.to_string(),
            settings: QueueSettings::default(),
            feed: FeedSettings::default(),
            lifetimes: None,
            webhook: None,
            handlers: kinds
                .iter()
                .map(|k| HandlerConfig { command_type: k.to_string(), kind: k.to_string(), options: Value::Null })
                .collect(),
            schedules: Vec::new(),
        }
    }

    /// Builds this queue's handlers. Errors: the first handler whose kind or options are refused,
    /// as `queues.<name>.handlers.<type>: <reason>`.
    pub fn build_handlers(&self) -> Result<BTreeMap<String, Arc<dyn CommandHandler>>, String> {
        let mut out = BTreeMap::new();
        for h in &self.handlers {
            let built = builtin::from_config(&h.kind, &h.options)
                .map_err(|e| format!("queues.{}.handlers.{}: {e}", self.name, h.command_type))?;
            out.insert(h.command_type.clone(), built);
        }
        Ok(out)
    }
}

/// The queues used when the configuration names none: `default` with `sleep`, `echo` and `fail`.
pub fn default_queues() -> Vec<QueueConfig> {
    vec![QueueConfig::with_builtins("default", &["sleep", "echo", "fail"])]
}

/// Resolves `[queues.*]` tables. Errors name the key: `queues.<name>.<key>: <reason>`.
///
/// Durations are parsed here and most ranges are checked when the queue's service starts
/// (`queue <name>: invalid setting: …`); `reap_idle_consumers_after` is
/// checked here against the queue's `claim_timeout` (at least twice it), so that `baton serve
/// --no-workers` refuses it too.
pub fn resolve_queues(tables: BTreeMap<String, QueueFile>) -> Result<Vec<QueueConfig>, String> {
    let mut out = Vec::new();
    for (name, f) in tables {
        baton_queue::validate_queue_name(&name).map_err(|e| format!("queues.{name}: {e}"))?;
        let key = |k: &str| format!("queues.{name}.{k}");
        let dur = |v: &Option<String>, k: &str| -> Result<Option<Duration>, String> {
            v.as_deref().map(parse_duration).transpose().map_err(|e| format!("{}: {e}", key(k)))
        };
        let d = QueueSettings::default();
        let r = f.retry.clone().unwrap_or_default();
        let dr = RetryPolicy::default();
        let settings_claim = dur(&f.claim_timeout, "claim_timeout")?.unwrap_or(d.claim_timeout);
        let cap = |v: Option<i64>, k: &str| -> Result<Option<u32>, String> {
            match v {
                None => Ok(None),
                Some(n) if (1..=u32::MAX as i64).contains(&n) => Ok(Some(n as u32)),
                Some(n) => Err(format!("{}: must be at least 1 (got {n}); leave it out for no cap", key(k))),
            }
        };
        let settings = QueueSettings {
            concurrency: f.concurrency.unwrap_or(d.concurrency),
            claim_timeout: settings_claim,
            check_status_interval: dur(&f.check_status_interval, "check_status_interval")?
                .unwrap_or(d.check_status_interval),
            max_processing_time: dur(&f.max_processing_time, "max_processing_time")?.unwrap_or(d.max_processing_time),
            poll_interval: dur(&f.poll_interval, "poll_interval")?,
            rate_limit: f.rate_limit.as_ref().map(|r| rate_limit(&name, "rate_limit", r)).transpose()?,
            rate_limit_per_key: f
                .rate_limit_per_key
                .as_ref()
                .map(|r| rate_limit(&name, "rate_limit_per_key", r))
                .transpose()?,
            reap_idle_consumers_after: match f.reap_idle_consumers_after.as_deref() {
                // The default window grows with a long claim timeout (it must be at least twice it).
                None => d.reap_idle_consumers_after.map(|w| w.max(settings_claim.saturating_mul(2))),
                Some(v) => parse_reap(v).map_err(|e| format!("{}: {e}", key("reap_idle_consumers_after")))?,
            },
            max_concurrency: cap(f.max_concurrency, "max_concurrency")?,
            concurrency_per_key: cap(f.concurrency_per_key, "concurrency_per_key")?,
            retry: RetryPolicy {
                max_attempts: r.max_attempts.unwrap_or(dr.max_attempts),
                initial_backoff: dur(&r.initial_backoff, "retry.initial_backoff")?.unwrap_or(dr.initial_backoff),
                backoff_factor: r.backoff_factor.unwrap_or(dr.backoff_factor),
                max_backoff: dur(&r.max_backoff, "retry.max_backoff")?.unwrap_or(dr.max_backoff),
            },
            ..d
        };
        if let Some(r) = settings.reap_idle_consumers_after {
            if r < settings.claim_timeout.saturating_mul(2) {
                return Err(format!(
                    "{}: {} must be at least twice claim_timeout ({}), or \"never\"",
                    key("reap_idle_consumers_after"),
                    humantime::format_duration(r),
                    humantime::format_duration(settings.claim_timeout)
                ));
            }
        }
        let feed = feed_settings(f.events.as_ref()).map_err(|e| format!("{}: {e}", key("events.max_len")))?;
        let defaults = CommandStoreSettings::default();
        let life = |v: &Option<String>, name: &str, default: Duration| -> Result<Duration, String> {
            let d = dur(v, name)?.unwrap_or(default);
            if d < Duration::from_secs(1) {
                return Err(format!(
                    "{}: {} is under the least lifetime, 1s",
                    key(name),
                    humantime::format_duration(d)
                ));
            }
            Ok(d)
        };
        let lifetimes = (f.state_ttl.is_some() || f.retention.is_some())
            .then(|| -> Result<Lifetimes, String> {
                Ok(Lifetimes {
                    state_ttl: life(&f.state_ttl, "state_ttl", defaults.state_ttl)?,
                    retention: life(&f.retention, "retention", defaults.retention)?,
                })
            })
            .transpose()?;
        let mut handlers = Vec::new();
        for (command_type, v) in f.handlers {
            let hkey = key(&format!("handlers.{command_type}"));
            let (kind, options) = match v {
                toml::Value::String(kind) => (kind, Value::Null),
                toml::Value::Table(mut t) => {
                    let kind = match t.remove("kind") {
                        Some(toml::Value::String(k)) => k,
                        _ => return Err(format!("{hkey}: needs kind = \"sleep\", \"echo\", \"fail\" or \"http\"")),
                    };
                    let options = serde_json::to_value(&t).map_err(|e| format!("{hkey}: {e}"))?;
                    (kind, if t.is_empty() { Value::Null } else { options })
                }
                other => {
                    return Err(format!(
                        "{hkey}: expected a kind name (\"echo\") or a table with kind and options, got {}",
                        other.type_str()
                    ))
                }
            };
            handlers.push(HandlerConfig { command_type, kind, options });
        }
        let webhook = f.webhook.as_ref().map(|w| webhook_config(&name, w)).transpose()?;
        let schedules = resolve_schedules(&name, &f.schedules, &handlers)?;
        let q = QueueConfig { name: name.clone(), settings, feed, lifetimes, webhook, handlers, schedules };
        q.build_handlers()?;
        out.push(q);
    }
    Ok(out)
}

/// `[[queues.<name>.schedules]]` resolved. Errors name the key:
/// `queues.<queue>.schedules.<name>.<key>: <what to fix>` (`schedules[<i>]` before the name
/// is known).
fn resolve_schedules(queue: &str, files: &[ScheduleFile], handlers: &[HandlerConfig]) -> Result<Vec<Schedule>, String> {
    let mut out: Vec<Schedule> = Vec::new();
    for (i, f) in files.iter().enumerate() {
        let Some(name) = f.name.as_deref() else {
            return Err(format!(
                "queues.{queue}.schedules[{i}].name: missing; give each schedule a name unique in the queue (name = \"nightly\")"
            ));
        };
        let key = |k: &str| format!("queues.{queue}.schedules.{name}.{k}");
        if out.iter().any(|s| s.name() == name) {
            return Err(format!(
                "{}: {name:?} is used by another schedule of the queue; names must be unique",
                key("name")
            ));
        }
        let Some(cron) = f.cron.as_deref() else {
            return Err(format!(
                "{}: missing; give a cron pattern (cron = \"0 3 * * *\": 03:00 every day)",
                key("cron")
            ));
        };
        let Some(command_type) = f.command_type.as_deref() else {
            return Err(format!(
                "{}: missing; give the type of the command to submit (type = \"report\")",
                key("type")
            ));
        };
        if !handlers.is_empty() && !handlers.iter().any(|h| h.command_type == command_type) {
            let known: Vec<&str> = handlers.iter().map(|h| h.command_type.as_str()).collect();
            return Err(format!(
                "{}: {command_type:?} has no handler on queue {queue} (its handlers: {}); add one or name one of them",
                key("type"),
                known.join(", ")
            ));
        }
        let params = match &f.params {
            None => serde_json::json!({}),
            Some(v) => toml_to_json(v).map_err(|e| format!("{}: {e}", key("params")))?,
        };
        let timezone = f.timezone.as_deref().unwrap_or("UTC");
        let s = Schedule::new(name, cron, timezone, command_type, params).map_err(|e| {
            let part = match e {
                ScheduleError::Name(_) => "name",
                ScheduleError::Cron(..) => "cron",
                ScheduleError::TimeZone(_) => "timezone",
                ScheduleError::Type(_) => "type",
                ScheduleError::MaxCatchUp(_) => "max_catch_up",
                ScheduleError::MissedAfter => "missed_after",
            };
            let k = if part == "name" { format!("queues.{queue}.schedules[{i}].name") } else { key(part) };
            format!("{k}: {e}")
        })?;
        let overlap = match f.overlap.as_deref() {
            None | Some("skip") => Overlap::Skip,
            Some("allow") => Overlap::Allow,
            Some("cancel_previous") => Overlap::CancelPrevious,
            Some(other) => {
                return Err(format!(
                    "{}: {other:?} is not a policy; use \"skip\" (default), \"allow\" or \"cancel_previous\"",
                    key("overlap")
                ))
            }
        };
        let missed = match f.missed.as_deref() {
            None | Some("skip") => Missed::Skip,
            Some("run_once") => Missed::RunOnce,
            Some("run_all") => Missed::RunAll,
            Some(other) => {
                return Err(format!(
                    "{}: {other:?} is not a policy; use \"skip\" (default), \"run_once\" or \"run_all\"",
                    key("missed")
                ))
            }
        };
        let max = f.max_catch_up.unwrap_or(baton_commands::schedules::DEFAULT_MAX_CATCH_UP);
        let s =
            s.with_overlap(overlap).with_missed(missed, max).map_err(|e| format!("{}: {e}", key("max_catch_up")))?;
        let s = match &f.missed_after {
            None => s,
            Some(v) => {
                let d = parse_duration(v).map_err(|e| format!("{}: {e}", key("missed_after")))?;
                s.with_missed_after(d).map_err(|e| format!("{}: {e}", key("missed_after")))?
            }
        };
        let longest = s.command_id(queue, baton_commands::schedules::LATEST_DUE_MS);
        if baton_commands::validate_id(&longest).is_err() {
            return Err(format!(
                "{}: its command ids (`{longest}`, {} characters) would be over 200 characters; use a shorter schedule name (or queue name)",
                key("name"),
                longest.len()
            ));
        }
        out.push(s);
    }
    Ok(out)
}

/// A TOML value as JSON: dates and times become strings in their TOML (RFC 3339) form (serde
/// would give the `toml` crate's private `{"$__toml_private_datetime": ...}` wrapper). Errors: a
/// float JSON cannot hold (`nan`, `inf`).
fn toml_to_json(v: &toml::Value) -> Result<Value, String> {
    Ok(match v {
        toml::Value::String(s) => Value::String(s.clone()),
        toml::Value::Integer(i) => Value::from(*i),
        toml::Value::Float(f) => serde_json::Number::from_f64(*f)
            .map(Value::Number)
            .ok_or_else(|| format!("{f} is not a number JSON can hold"))?,
        toml::Value::Boolean(b) => Value::Bool(*b),
        toml::Value::Datetime(d) => Value::String(d.to_string()),
        toml::Value::Array(a) => Value::Array(a.iter().map(toml_to_json).collect::<Result<_, _>>()?),
        toml::Value::Table(t) => {
            Value::Object(t.iter().map(|(k, v)| Ok((k.clone(), toml_to_json(v)?))).collect::<Result<_, String>>()?)
        }
    })
}

/// `[queues.<name>.webhook]` resolved. The URL's address rules are checked again when the
/// delivery starts (`--allow-loopback-webhooks` decides about loopback hosts there); here its form.
fn webhook_config(name: &str, w: &WebhookFile) -> Result<WebhookConfig, String> {
    let key = |k: &str| format!("queues.{name}.webhook.{k}");
    let Some(url) = w.url.clone() else {
        return Err(format!("{}: missing; give the URL to POST completions to (url = \"https://…\")", key("url")));
    };
    baton_subscriptions::check_url(&url, true).map_err(|e| format!("{}: {e}", key("url")))?;
    let statuses = match &w.events {
        None => baton_commands::CompletionHook::default().statuses,
        Some(events) => {
            let mut set = std::collections::BTreeSet::new();
            for e in events {
                let s = match e.as_str() {
                    "succeeded" => CommandStatus::Succeeded,
                    "failed" => CommandStatus::Failed,
                    "cancelled" => CommandStatus::Cancelled,
                    other => {
                        return Err(format!(
                            "{}: {other:?} is not a terminal event; use \"succeeded\", \"failed\" or \"cancelled\"",
                            key("events")
                        ))
                    }
                };
                set.insert(s);
            }
            if set.is_empty() {
                return Err(format!(
                    "{}: empty; name one or more of \"succeeded\", \"failed\", \"cancelled\" (or remove the webhook)",
                    key("events")
                ));
            }
            set
        }
    };
    let dur = |v: &Option<String>, k: &str, d: Duration| -> Result<Duration, String> {
        Ok(v.as_deref().map(parse_duration).transpose().map_err(|e| format!("{}: {e}", key(k)))?.unwrap_or(d))
    };
    let timeout = dur(&w.timeout, "timeout", WebhookConfig::DEFAULT_TIMEOUT)?;
    if timeout.is_zero() {
        return Err(format!("{}: must be more than 0 (default 10s)", key("timeout")));
    }
    let most = |d: Duration, k: &str, default: &str| -> Result<(), String> {
        if d > WebhookConfig::MAX_DURATION {
            return Err(format!(
                "{}: {} is over the most, {} (default {default})",
                key(k),
                humantime::format_duration(d),
                humantime::format_duration(WebhookConfig::MAX_DURATION)
            ));
        }
        Ok(())
    };
    most(timeout, "timeout", "10s")?;
    let claim_timeout = dur(&w.claim_timeout, "claim_timeout", WebhookConfig::DEFAULT_CLAIM_TIMEOUT)?;
    most(claim_timeout, "claim_timeout", "30s")?;
    if claim_timeout < Duration::from_millis(100) {
        return Err(format!(
            "{}: {} is under the least, 100ms (default 30s)",
            key("claim_timeout"),
            humantime::format_duration(claim_timeout)
        ));
    }
    let max_deliveries = w.max_deliveries.unwrap_or(WebhookConfig::DEFAULT_MAX_DELIVERIES);
    if !(1..=1000).contains(&max_deliveries) {
        return Err(format!("{}: {max_deliveries} is out of range 1 – 1000 (default 10)", key("max_deliveries")));
    }
    Ok(WebhookConfig { url, statuses, timeout, max_deliveries, claim_timeout })
}

/// `events = { enabled, max_len }` over the defaults; a `max_len` of 0 is refused.
fn feed_settings(f: Option<&EventsFile>) -> Result<FeedSettings, String> {
    let d = FeedSettings::default();
    let Some(f) = f else { return Ok(d) };
    let feed = FeedSettings { enabled: f.enabled.unwrap_or(d.enabled), max_len: f.max_len.unwrap_or(d.max_len) };
    if feed.max_len == 0 {
        return Err("0 would keep no events; give at least 1 (default 100000), or enabled = false for no feed".into());
    }
    Ok(feed)
}

/// `reap_idle_consumers_after`: a duration (`"2h"`), or `"never"` / `"none"` / `"off"` for `None`.
fn parse_reap(v: &str) -> Result<Option<Duration>, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "never" | "none" | "off" => Ok(None),
        _ => humantime::parse_duration(v.trim())
            .map(Some)
            .map_err(|e| format!("{v:?} is neither a duration like `2h` or `90m` nor \"never\": {e}")),
    }
}

/// Describes queues for a startup log line: `default (echo, fail, sleep)`.
pub fn describe_queues(queues: &[QueueConfig]) -> String {
    queues
        .iter()
        .map(|q| {
            let types: Vec<String> =
                q.handlers
                    .iter()
                    .map(|h| {
                        if h.kind == h.command_type {
                            h.kind.clone()
                        } else {
                            format!("{}={}", h.command_type, h.kind)
                        }
                    })
                    .collect();
            if types.is_empty() {
                format!("{} (no handlers: its workers run elsewhere)", q.name)
            } else {
                format!("{} ({})", q.name, types.join(", "))
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<QueueConfig>, String> {
        #[derive(Deserialize)]
        struct F {
            queues: BTreeMap<String, QueueFile>,
        }
        let f: F = toml::from_str(text).map_err(|e| e.to_string())?;
        resolve_queues(f.queues)
    }

    #[test]
    fn queues_from_toml() {
        let q = parse(
            r#"
            [queues.lifecycle]
            concurrency = 4
            claim_timeout = "2m"
            retry = { max_attempts = 3, initial_backoff = "250ms" }
            [queues.lifecycle.handlers]
            nap = "sleep"
            hook = { kind = "http", url = "http://127.0.0.1:9/x", timeout = "2s" }
            [queues.quick]
            "#,
        )
        .unwrap();
        assert_eq!(q.len(), 2);
        assert_eq!(q[0].name, "lifecycle");
        assert_eq!(q[0].settings.concurrency, 4);
        assert_eq!(q[0].settings.claim_timeout, Duration::from_secs(120));
        assert_eq!(q[0].settings.retry.max_attempts, 3);
        assert_eq!(q[0].settings.retry.initial_backoff, Duration::from_millis(250));
        assert_eq!(q[0].settings.retry.max_backoff, Duration::from_secs(300));
        assert_eq!(q[0].handlers[0].command_type, "hook");
        assert_eq!(q[0].handlers[0].kind, "http");
        assert_eq!(q[0].handlers[0].options, serde_json::json!({"url": "http://127.0.0.1:9/x", "timeout": "2s"}));
        assert_eq!(
            q[0].handlers[1],
            HandlerConfig { command_type: "nap".into(), kind: "sleep".into(), options: Value::Null }
        );
        assert!(q[1].handlers.is_empty());
        assert_eq!(
            describe_queues(&q),
            "lifecycle (hook=http, nap=sleep); quick (no handlers: its workers run elsewhere)"
        );
    }

    #[test]
    fn concurrency_caps_from_toml() {
        let q = parse(
            r#"
            [queues.a]
            max_concurrency = 50
            concurrency_per_key = 1
            [queues.b]
            "#,
        )
        .unwrap();
        assert_eq!((q[0].settings.max_concurrency, q[0].settings.concurrency_per_key), (Some(50), Some(1)));
        assert_eq!((q[1].settings.max_concurrency, q[1].settings.concurrency_per_key), (None, None));
        for (text, want) in [
            ("[queues.a]\nmax_concurrency = 0", "queues.a.max_concurrency: must be at least 1 (got 0)"),
            ("[queues.a]\nconcurrency_per_key = -2", "queues.a.concurrency_per_key: must be at least 1 (got -2)"),
        ] {
            assert_eq!(parse(text).unwrap_err(), format!("{want}; leave it out for no cap"));
        }
    }

    #[test]
    fn reap_idle_consumers_after_from_toml() {
        let q = parse(
            r#"
            [queues.a]
            reap_idle_consumers_after = "2h"
            [queues.b]
            reap_idle_consumers_after = "never"
            [queues.c]
            [queues.d]
            claim_timeout = "1s"
            reap_idle_consumers_after = "2s"
            [queues.e]
            reap_idle_consumers_after = " Off "
            [queues.f]
            reap_idle_consumers_after = "none"
            "#,
        )
        .unwrap();
        let got: Vec<(&str, Option<Duration>)> =
            q.iter().map(|q| (q.name.as_str(), q.settings.reap_idle_consumers_after)).collect();
        assert_eq!(
            got,
            [
                ("a", Some(Duration::from_secs(7200))),
                ("b", None),
                ("c", Some(Duration::from_secs(3600))),
                ("d", Some(Duration::from_secs(2))),
                ("e", None),
                ("f", None),
            ]
        );
    }

    #[test]
    fn default_reap_window_grows_with_a_long_claim_timeout() {
        let q = parse("[queues.a]\nclaim_timeout = \"45m\"\n[queues.b]\nclaim_timeout = \"10m\"\n").unwrap();
        assert_eq!(q[0].settings.reap_idle_consumers_after, Some(Duration::from_secs(90 * 60)));
        assert_eq!(q[1].settings.reap_idle_consumers_after, Some(Duration::from_secs(3600)));
    }

    #[test]
    fn bad_reap_idle_consumers_after_names_the_key_and_the_rule() {
        let e = parse("[queues.a]\nreap_idle_consumers_after = \"59s\"\n").unwrap_err();
        assert_eq!(
            e,
            "queues.a.reap_idle_consumers_after: 59s must be at least twice claim_timeout (30s), or \"never\""
        );
        let e = parse("[queues.a]\nclaim_timeout = \"2m\"\nreap_idle_consumers_after = \"3m 59s\"\n").unwrap_err();
        assert_eq!(
            e,
            "queues.a.reap_idle_consumers_after: 3m 59s must be at least twice claim_timeout (2m), or \"never\""
        );
        let e = parse("[queues.a]\nreap_idle_consumers_after = \"0s\"\n").unwrap_err();
        assert_eq!(
            e,
            "queues.a.reap_idle_consumers_after: 0s must be at least twice claim_timeout (30s), or \"never\""
        );
        let e = parse("[queues.a]\nreap_idle_consumers_after = \"soon\"\n").unwrap_err();
        assert!(
            e.starts_with(
                "queues.a.reap_idle_consumers_after: \"soon\" is neither a duration like `2h` or `90m` nor \"never\": "
            ),
            "{e}"
        );
        let e = parse("[queues.a]\nreap_idle_consumers_after = false\n").unwrap_err();
        assert!(
            e.contains("invalid type: boolean `false`, expected a string") && e.contains("reap_idle_consumers_after"),
            "{e}"
        );
    }

    /// The TOML blocks of docs/configuration.md and of this module's docs are valid queue
    /// configurations with the values their comments state.
    #[test]
    fn documented_examples_parse() {
        let block = |text: &str, marker: &str| -> String {
            let start = text.find(marker).expect("example present");
            let from = &text[start..];
            from[..from.find("```").expect("closed")].to_string()
        };
        let docs = block(include_str!("../../../../docs/configuration.md"), "[queues.lifecycle]");
        let q = parse(&docs).unwrap();
        assert_eq!(q[0].settings.reap_idle_consumers_after, Some(Duration::from_secs(3600)));
        assert_eq!(q[0].feed, FeedSettings { enabled: true, max_len: 50_000 });
        assert_eq!(q[0].settings.claim_timeout, Duration::from_secs(120));
        let module: String = include_str!("queues.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("//! ").or(l.strip_prefix("//!")))
            .collect::<Vec<_>>()
            .join("\n");
        let q = parse(&block(&module, "[queues.default]")).unwrap();
        assert_eq!(q[0].settings.reap_idle_consumers_after, Some(Duration::from_secs(3600)));
        assert_eq!(q[0].handlers.len(), 3);
        assert_eq!(q[0].feed, FeedSettings { enabled: true, max_len: 100_000 });
        let week = Duration::from_secs(7 * 24 * 3600);
        assert_eq!(q[0].lifetimes, Some(Lifetimes { state_ttl: week, retention: Duration::from_secs(24 * 3600) }));
        let s = &parse(&docs).unwrap()[0].schedules;
        assert_eq!((s.len(), s[0].name(), s[0].missed()), (1, "nightly-report", Missed::RunOnce));
    }

    #[test]
    fn rate_limits_from_toml_and_their_errors() {
        let q = parse(
            "[queues.a]\nrate_limit = { limit = 1000, per = \"1s\", burst = 50 }\n[queues.b]\nrate_limit = { limit = 5 }\n[queues.c]\n",
        )
        .unwrap();
        let rl = |n: usize| q[n].settings.rate_limit;
        assert_eq!(rl(0), Some(baton_queue::RateLimit { limit: 1000, per: Duration::from_secs(1), burst: 50 }));
        assert_eq!(rl(1), Some(baton_queue::RateLimit { limit: 5, per: Duration::from_secs(1), burst: 5 }));
        assert_eq!(rl(2), None);
        let err = |body: &str| parse(&format!("[queues.q]\nrate_limit = {body}\n")).unwrap_err();
        assert_eq!(
            err("{ per = \"1s\" }"),
            "queues.q.rate_limit.limit: missing; e.g. rate_limit = { limit = 100, per = \"1s\" }"
        );
        assert_eq!(err("{ limit = 0 }"), "queues.q.rate_limit.limit: must be at least 1");
        assert_eq!(err("{ limit = 1, burst = 0 }"), "queues.q.rate_limit.burst: must be at least 1 (default: limit)");
        assert_eq!(err("{ limit = 1, per = \"0s\" }"), "queues.q.rate_limit.per: 0s is under the least period, 1ms");
        assert!(err("{ limit = 1, per = \"soon\" }").starts_with("queues.q.rate_limit.per: "));
        assert_eq!(
            err("{ limit = 2000000 }"),
            "queues.q.rate_limit: invalid queue setting: rate_limit 2000000 per 1s is above 1000000 per second, the highest rate allowed"
        );
        assert!(err("{ limit = 1, every = \"1s\" }").contains("unknown field `every`"));
    }

    #[test]
    fn per_key_rate_limits_from_toml_and_their_errors() {
        let q = parse(
            "[queues.a]\nrate_limit_per_key = { limit = 5, per = \"1s\", burst = 1 }\nconcurrency_per_key = 2\n[queues.b]\nrate_limit_per_key = { limit = 60, per = \"1m\" }\n[queues.c]\n",
        )
        .unwrap();
        let rl = |n: usize| q[n].settings.rate_limit_per_key;
        assert_eq!(rl(0), Some(baton_queue::RateLimit { limit: 5, per: Duration::from_secs(1), burst: 1 }));
        assert_eq!(q[0].settings.rate_limit, None);
        assert_eq!(rl(1), Some(baton_queue::RateLimit { limit: 60, per: Duration::from_secs(60), burst: 60 }));
        assert_eq!(rl(2), None);
        let err = |body: &str| parse(&format!("[queues.q]\nrate_limit_per_key = {body}\n")).unwrap_err();
        assert_eq!(
            err("{ per = \"1s\" }"),
            "queues.q.rate_limit_per_key.limit: missing; e.g. rate_limit_per_key = { limit = 100, per = \"1s\" }"
        );
        assert_eq!(err("{ limit = 0 }"), "queues.q.rate_limit_per_key.limit: must be at least 1");
        assert_eq!(
            err("{ limit = 1, burst = 0 }"),
            "queues.q.rate_limit_per_key.burst: must be at least 1 (default: limit)"
        );
        assert_eq!(
            err("{ limit = 1, per = \"0s\" }"),
            "queues.q.rate_limit_per_key.per: 0s is under the least period, 1ms"
        );
        assert_eq!(
            err("{ limit = 2000000 }"),
            "queues.q.rate_limit_per_key: invalid queue setting: rate_limit_per_key 2000000 per 1s is above 1000000 per second, the highest rate allowed"
        );
        assert!(err("{ limit = 1, every = \"1s\" }").contains("unknown field `every`"));
    }

    #[test]
    fn lifetimes_from_toml() {
        let q = parse("[queues.a]\nretention = \"1h\"\n[queues.b]\n").unwrap();
        let week = Duration::from_secs(7 * 24 * 3600);
        assert_eq!(q[0].lifetimes, Some(Lifetimes { state_ttl: week, retention: Duration::from_secs(3600) }));
        assert_eq!(q[1].lifetimes, None);
        let e = parse("[queues.a]\nretention = \"500ms\"\n").unwrap_err();
        assert_eq!(e, "queues.a.retention: 500ms is under the least lifetime, 1s");
    }

    #[test]
    fn events_from_toml() {
        let q = parse("[queues.a]\nevents = { enabled = false }\n[queues.b]\nevents = { max_len = 7 }\n[queues.c]\n")
            .unwrap();
        let got: Vec<(&str, FeedSettings)> = q.iter().map(|q| (q.name.as_str(), q.feed)).collect();
        assert_eq!(
            got,
            [
                ("a", FeedSettings { enabled: false, max_len: 100_000 }),
                ("b", FeedSettings { enabled: true, max_len: 7 }),
                ("c", FeedSettings { enabled: true, max_len: 100_000 }),
            ]
        );
        let e = parse("[queues.a]\nevents = { max_len = 0 }\n").unwrap_err();
        assert_eq!(
            e,
            "queues.a.events.max_len: 0 would keep no events; give at least 1 (default 100000), or enabled = false \
             for no feed"
        );
        let e = parse("[queues.a]\nevents = { max_len = -1 }\n").unwrap_err();
        assert!(e.contains("invalid value: integer `-1`, expected u64") && e.contains("max_len"), "{e}");
        let e = parse("[queues.a]\nevents = { keep = 3 }\n").unwrap_err();
        assert!(e.contains("unknown field `keep`, expected `enabled` or `max_len`"), "{e}");
    }

    #[test]
    fn bad_queue_config_names_the_key() {
        let e = parse("[queues.a]\nclaim_timeout = \"soon\"\n").unwrap_err();
        assert!(e.starts_with("queues.a.claim_timeout: \"soon\" is not a duration"), "{e}");
        let e = parse("[queues.a.handlers]\nx = \"nap\"\n").unwrap_err();
        assert_eq!(e, "queues.a.handlers.x: unknown built-in handler \"nap\": use one of sleep, echo, fail, http");
        let e = parse("[queues.a.handlers]\nx = { url = \"http://h/\" }\n").unwrap_err();
        assert_eq!(e, "queues.a.handlers.x: needs kind = \"sleep\", \"echo\", \"fail\" or \"http\"");
        let e = parse("[queues.a]\nconcurency = 3\n").unwrap_err();
        assert!(e.contains("unknown field `concurency`"), "{e}");
        let e = parse("[queues.\"a{b}\"]\n").unwrap_err();
        assert!(e.starts_with("queues.a{b}: invalid queue name"), "{e}");
    }

    #[test]
    fn webhooks_from_toml_and_their_errors() {
        let q = parse(
            "[queues.a.webhook]\nurl = \"https://hooks.example.com/x\"\n[queues.b.webhook]\nurl = \"http://127.0.0.1:9/h\"\n\
             events = [\"failed\", \"cancelled\"]\ntimeout = \"2s\"\nmax_deliveries = 3\nclaim_timeout = \"500ms\"\n[queues.c]\n",
        )
        .unwrap();
        let all = baton_commands::CompletionHook::default().statuses;
        assert_eq!(
            q[0].webhook,
            Some(WebhookConfig {
                url: "https://hooks.example.com/x".into(),
                statuses: all,
                timeout: Duration::from_secs(10),
                max_deliveries: 10,
                claim_timeout: Duration::from_secs(30),
            })
        );
        assert_eq!(
            q[1].webhook,
            Some(WebhookConfig {
                url: "http://127.0.0.1:9/h".into(),
                statuses: [CommandStatus::Failed, CommandStatus::Cancelled].into(),
                timeout: Duration::from_secs(2),
                max_deliveries: 3,
                claim_timeout: Duration::from_millis(500),
            })
        );
        assert_eq!(q[2].webhook, None);
        let err = |t: &str| parse(&format!("[queues.q.webhook]\n{t}\n")).unwrap_err();
        assert_eq!(
            err("events = [\"done\"]"),
            "queues.q.webhook.url: missing; give the URL to POST completions to (url = \"https://…\")"
        );
        let u = "url = \"https://h.example.com/\"\n";
        assert_eq!(
            err(&format!("{u}events = [\"done\"]")),
            "queues.q.webhook.events: \"done\" is not a terminal event; use \"succeeded\", \"failed\" or \"cancelled\""
        );
        assert_eq!(
            err(&format!("{u}events = []")),
            "queues.q.webhook.events: empty; name one or more of \"succeeded\", \"failed\", \"cancelled\" (or remove \
             the webhook)"
        );
        assert_eq!(
            err(&format!("{u}max_deliveries = 0")),
            "queues.q.webhook.max_deliveries: 0 is out of range 1 – 1000 (default 10)"
        );
        assert_eq!(
            err(&format!("{u}claim_timeout = \"10ms\"")),
            "queues.q.webhook.claim_timeout: 10ms is under the least, 100ms (default 30s)"
        );
        assert_eq!(err(&format!("{u}timeout = \"0s\"")), "queues.q.webhook.timeout: must be more than 0 (default 10s)");
        assert_eq!(
            err("url = \"http://10.0.0.1/\""),
            "queues.q.webhook.url: webhook.url must use https (http only for loopback hosts, with --allow-loopback-webhooks); webhook.url \
             must not target 10.0.0.1: private addresses are refused"
        );
        assert!(err(&format!("{u}secret = 1")).contains("unknown field `secret`"));
    }

    #[test]
    fn schedules_resolve_with_defaults_and_policies() {
        let q = parse(
            "[queues.a.handlers]\nreport = \"echo\"\n\
             [[queues.a.schedules]]\nname = \"nightly\"\ncron = \"30 2 * * *\"\ntimezone = \"Europe/Berlin\"\n\
             type = \"report\"\nparams = { day = \"yesterday\", n = 3 }\noverlap = \"cancel_previous\"\n\
             missed = \"run_all\"\nmax_catch_up = 5\nmissed_after = \"1m\"\n\
             [[queues.a.schedules]]\nname = \"often\"\ncron = \"*/10 * * * * *\"\ntype = \"report\"\n",
        )
        .unwrap();
        let s = &q[0].schedules;
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].name(), s[0].cron(), s[0].timezone()), ("nightly", "30 2 * * *", "Europe/Berlin"));
        assert_eq!(s[0].params().get(), r#"{"day":"yesterday","n":3}"#);
        assert_eq!((s[0].overlap(), s[0].missed(), s[0].max_catch_up()), (Overlap::CancelPrevious, Missed::RunAll, 5));
        assert_eq!(s[0].missed_after(), Duration::from_secs(60));
        assert_eq!(
            (s[1].timezone(), s[1].overlap(), s[1].missed(), s[1].max_catch_up()),
            ("UTC", Overlap::Skip, Missed::Skip, 10)
        );
        assert_eq!(s[1].params().get(), "{}");
        assert_eq!(s[1].missed_after(), Duration::from_secs(10));
    }

    /// TOML dates and times in `params` become JSON strings in their TOML (RFC 3339) form.
    #[test]
    fn schedule_params_with_toml_datetimes_are_strings() {
        let q = parse(
            "[[queues.b.schedules]]\nname = \"n\"\ncron = \"* * * * *\"\ntype = \"t\"\n\
             params = { at = 1979-05-27T07:32:00Z, day = 1979-05-27, list = [07:32:00, 1], n = 1.5 }\n",
        )
        .unwrap();
        assert_eq!(
            q[0].schedules[0].params().get(),
            r#"{"at":"1979-05-27T07:32:00Z","day":"1979-05-27","list":["07:32:00",1],"n":1.5}"#
        );
    }

    #[test]
    fn bad_schedules_name_the_key() {
        let head = "[queues.a.handlers]\nreport = \"echo\"\n[[queues.a.schedules]]\n";
        let err = |body: &str| parse(&format!("{head}{body}")).unwrap_err();
        assert_eq!(
            err("cron = \"* * * * *\"\ntype = \"report\"\n"),
            "queues.a.schedules[0].name: missing; give each schedule a name unique in the queue (name = \"nightly\")"
        );
        assert_eq!(
            err("name = \"n\"\ntype = \"report\"\n"),
            "queues.a.schedules.n.cron: missing; give a cron pattern (cron = \"0 3 * * *\": 03:00 every day)"
        );
        assert!(err("name = \"n\"\ncron = \"every day\"\ntype = \"report\"\n")
            .starts_with("queues.a.schedules.n.cron: cron \"every day\": "));
        assert_eq!(
            err("name = \"n\"\ncron = \"* * * * *\"\ntype = \"other\"\n"),
            "queues.a.schedules.n.type: \"other\" has no handler on queue a (its handlers: report); add one or name one of them"
        );
        assert_eq!(
            err("name = \"n\"\ncron = \"* * * * *\"\ntype = \"report\"\ntimezone = \"Berlin\"\n"),
            "queues.a.schedules.n.timezone: timezone \"Berlin\" is not a known IANA time zone (e.g. \"UTC\", \"Europe/Berlin\")"
        );
        assert_eq!(
            err("name = \"n\"\ncron = \"* * * * *\"\ntype = \"report\"\noverlap = \"queue\"\n"),
            "queues.a.schedules.n.overlap: \"queue\" is not a policy; use \"skip\" (default), \"allow\" or \"cancel_previous\""
        );
        assert_eq!(
            err("name = \"n\"\ncron = \"* * * * *\"\ntype = \"report\"\nmissed = \"all\"\n"),
            "queues.a.schedules.n.missed: \"all\" is not a policy; use \"skip\" (default), \"run_once\" or \"run_all\""
        );
        assert_eq!(
            err("name = \"n\"\ncron = \"* * * * *\"\ntype = \"report\"\nmissed = \"run_all\"\nmax_catch_up = 0\n"),
            "queues.a.schedules.n.max_catch_up: max_catch_up 0 is out of range 1 – 1000 (default 10)"
        );
        assert_eq!(
            err("name = \"n\"\ncron = \"* * * * *\"\ntype = \"report\"\nmissed_after = \"10ms\"\n"),
            "queues.a.schedules.n.missed_after: missed_after must be at least 1s (default 10s)"
        );
        assert_eq!(
            err("name = \"n\"\ncron = \"* * * * *\"\ntype = \"report\"\n[[queues.a.schedules]]\nname = \"n\"\ncron = \"* * * * *\"\ntype = \"report\"\n"),
            "queues.a.schedules.n.name: \"n\" is used by another schedule of the queue; names must be unique"
        );
        assert!(
            err("name = \"n\"\ncron = \"* * * * *\"\ntype = \"report\"\nevery = 1\n").contains("unknown field `every`")
        );
        assert_eq!(
            err("name = \"n\"\ncron = \"* * * * *\"\ntype = \"report\"\nparams = { x = [nan] }\n"),
            "queues.a.schedules.n.params: NaN is not a number JSON can hold"
        );
        // The queue is part of the command ids (global): queue and name must fit in 200.
        let long = "q".repeat(130);
        let name = "n".repeat(64);
        let e = parse(&format!("[[queues.{long}.schedules]]\nname = \"{name}\"\ncron = \"* * * * *\"\ntype = \"t\"\n"))
            .unwrap_err();
        assert_eq!(
            e,
            format!("queues.{long}.schedules.{name}.name: its command ids (`sched-{long}.{name}-9999999999999`, 215 characters) would be over 200 characters; use a shorter schedule name (or queue name)")
        );
        // A queue without handlers here (its workers run elsewhere) takes any type.
        let q = parse("[[queues.b.schedules]]\nname = \"n\"\ncron = \"* * * * *\"\ntype = \"anything\"\n").unwrap();
        assert_eq!(q[0].schedules[0].command_type(), "anything");
    }
}
