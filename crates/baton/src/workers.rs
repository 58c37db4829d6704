//! Command queues from configuration, and the workers that run their built-in handlers.
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
//! retry = { max_attempts = 5, initial_backoff = "1s", backoff_factor = 2.0, max_backoff = "5m" }
//!
//! [queues.default.handlers]        # command type → built-in handler
//! sleep = "sleep"                  # shorthand: the kind alone
//! echo = { kind = "echo" }
//! deploy = { kind = "http", url = "https://ci.example.com/hook", timeout = "30s" }
//! ```
//!
//! With no `[queues]` at all, one queue `default` with `sleep`, `echo` and `fail` is configured
//! ([`default_queues`]) so a fresh `baton serve` can run commands out of the box.
//!
//! Every handler is wrapped to record `baton_command_handler_seconds{queue,type,call}`
//! (histogram; `call` = `execute` or `check_status`) and
//! `baton_command_outcomes_total{queue,type,outcome}` (`outcome` = `succeeded`, `failed`,
//! `cancelled`, `running`, `handed_off` or `error`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use baton_commands::{
    builtin, Command, CommandHandler, CommandResult, CommandService, CommandState, CommandStore, HandlerError,
    QueueSettings, RetryPolicy,
};
use serde::Deserialize;
use serde_json::Value;

use crate::config::{parse_duration, Backend};

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
    pub retry: Option<RetryFile>,
    /// Command type → kind name (`"sleep"`) or a table with `kind` and the kind's options.
    #[serde(default)]
    pub handlers: BTreeMap<String, toml::Value>,
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
    pub handlers: Vec<HandlerConfig>,
}

impl QueueConfig {
    /// A queue with default settings and the built-in handlers `kinds`, each under its own name
    /// as command type (e.g. `sleep` runs `sleep`).
    pub fn with_builtins(name: &str, kinds: &[&str]) -> Self {
        QueueConfig {
            name: name.to_string(),
            settings: QueueSettings::default(),
            handlers: kinds
                .iter()
                .map(|k| HandlerConfig { command_type: k.to_string(), kind: k.to_string(), options: Value::Null })
                .collect(),
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
/// ([`Workers::start`], `queue <name>: invalid setting: …`); `reap_idle_consumers_after` is
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
        let settings = QueueSettings {
            concurrency: f.concurrency.unwrap_or(d.concurrency),
            claim_timeout: settings_claim,
            check_status_interval: dur(&f.check_status_interval, "check_status_interval")?
                .unwrap_or(d.check_status_interval),
            max_processing_time: dur(&f.max_processing_time, "max_processing_time")?.unwrap_or(d.max_processing_time),
            poll_interval: dur(&f.poll_interval, "poll_interval")?,
            reap_idle_consumers_after: match f.reap_idle_consumers_after.as_deref() {
                // The default window grows with a long claim timeout (it must be at least twice it).
                None => d.reap_idle_consumers_after.map(|w| w.max(settings_claim.saturating_mul(2))),
                Some(v) => parse_reap(v).map_err(|e| format!("{}: {e}", key("reap_idle_consumers_after")))?,
            },
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
        let q = QueueConfig { name: name.clone(), settings, handlers };
        q.build_handlers()?;
        out.push(q);
    }
    Ok(out)
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

/// The command store of a backend (the same Redis as the streams, or a new in-memory store).
/// Errors: Redis cannot be reached.
pub async fn command_store(backend: &Backend) -> Result<CommandStore, String> {
    match backend {
        Backend::Memory => Ok(CommandStore::memory()),
        Backend::Redis(rc) => {
            let client = baton_redis::RedisClient::new(rc.clone()).map_err(|e| format!("cannot use {rc}: {e}"))?;
            CommandStore::redis(client, Default::default()).await.map_err(|e| format!("cannot use {rc}: {e}"))
        }
    }
}

/// The running command services of a process, one per queue.
pub struct Workers {
    services: Vec<CommandService>,
}

impl Workers {
    /// Starts one command service per queue on `store`, each with its configured handlers
    /// (wrapped for metrics). Every queue's settings and handlers are checked before the first
    /// service starts; should a later start still fail (Redis), the services already started are
    /// closed before the error is returned.
    ///
    /// Errors: a refused setting or handler, or the backend's error, named by queue
    /// (`queue <name>: …`).
    pub async fn start(store: &CommandStore, queues: &[QueueConfig]) -> Result<Workers, String> {
        let mut builders = Vec::new();
        for q in queues {
            q.settings.validate().map_err(|e| format!("queue {}: {e}", q.name))?;
            let mut b = CommandService::builder(store.clone(), q.name.clone()).settings(q.settings.clone());
            for (t, h) in q.build_handlers()? {
                let metered = Metered { inner: h, queue: q.name.clone(), command_type: t.clone() };
                b = b.handler(t, metered);
            }
            builders.push((q.name.as_str(), b));
        }
        let mut services = Vec::new();
        for (name, b) in builders {
            match b.start().await {
                Ok(s) => services.push(s),
                Err(e) => {
                    futures::future::join_all(services.iter().map(|s| s.close())).await;
                    return Err(format!("queue {name}: {e}"));
                }
            }
        }
        Ok(Workers { services })
    }

    /// Names of the queues being worked.
    pub fn queues(&self) -> Vec<String> {
        self.services.iter().map(|s| s.queue().to_string()).collect()
    }

    /// Stops taking work and lets running handlers finish within `budget` (shared by all
    /// queues); unfinished commands are taken over by another worker after `claim_timeout`.
    pub async fn drain(self, budget: Duration) {
        let drains = self.services.iter().map(|s| s.drain(budget));
        for (s, report) in self.services.iter().zip(futures::future::join_all(drains).await) {
            if !report.in_flight.is_empty() {
                tracing::warn!(
                    queue = s.queue(),
                    in_flight = report.in_flight.len(),
                    "handlers still running at shutdown; their commands will be taken over after claim_timeout"
                );
            }
        }
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
            format!("{} ({})", q.name, types.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Resolved settings of `baton worker`.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub backend: Backend,
    pub queues: Vec<QueueConfig>,
    pub queues_defaulted: bool,
    /// Where to serve `/healthz`, `/readyz` and `/metrics`, if anywhere.
    pub listen: Option<std::net::SocketAddr>,
    pub shutdown_grace: Duration,
}

impl crate::config::WorkerArgs {
    /// Reads the same TOML file as `baton serve` (its `[queues.*]`, `redis`, `redis_cluster`
    /// and `shutdown_grace`). Errors: the in-memory backend (a worker must share Redis with the
    /// server), an unknown queue in `--queues`, and every error of `baton serve`'s configuration.
    pub fn resolve(self) -> Result<WorkerConfig, String> {
        let serve = crate::config::ServeArgs {
            config: self.config,
            redis: self.redis,
            redis_cluster: self.redis_cluster,
            shutdown_grace: self.shutdown_grace,
            ..Default::default()
        }
        .resolve()?;
        if serve.backend == Backend::Memory {
            return Err(
                "baton worker needs --redis or --redis-cluster (or redis / redis_cluster in the config file); \
                        with the in-memory backend the workers run inside baton serve"
                    .into(),
            );
        }
        let mut queues = serve.queues;
        if let Some(only) = self.queues {
            for name in &only {
                if !queues.iter().any(|q| &q.name == name) {
                    let known: Vec<&str> = queues.iter().map(|q| q.name.as_str()).collect();
                    return Err(format!(
                        "--queues names {name:?}, which is not configured; configured: {}",
                        known.join(", ")
                    ));
                }
            }
            queues.retain(|q| only.contains(&q.name));
        }
        Ok(WorkerConfig {
            backend: serve.backend,
            queues,
            queues_defaulted: serve.queues_defaulted,
            listen: self.listen,
            shutdown_grace: serve.shutdown_grace,
        })
    }
}

/// `baton worker`: runs the configured queues' workers until ctrl-c or SIGTERM, then drains them
/// within the shutdown grace (every queue's service is drained, which also closes it). With
/// `--listen`, serves `/healthz`, `/readyz` and `/metrics`.
///
/// Everything that can fail is done before the first service starts (signal handlers, the
/// command store, the health API and its listener), so an error never leaves a started service
/// behind; a signal during startup is kept and shuts the worker down once started.
pub async fn run_worker(args: crate::config::WorkerArgs) -> Result<(), String> {
    let cfg = args.resolve()?;
    let mut signal = crate::server::ShutdownSignal::listen()?;
    let store = command_store(&cfg.backend).await?;
    let health = match cfg.listen {
        None => None,
        Some(addr) => {
            let api = crate::http::commands::CommandsApi::new(store.clone(), &cfg.queues, 0, true)?;
            let listener =
                tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            Some((addr, listener, crate::http::queues::worker_router(api)))
        }
    };
    let workers = Workers::start(&store, &cfg.queues).await?;
    let default_note = if cfg.queues_defaulted { " (the built-in default: no [queues] configured)" } else { "" };
    tracing::info!(backend = %crate::http::describe_backend(&cfg.backend), queues = %describe_queues(&cfg.queues), "baton worker: running{default_note}");
    println!(
        "baton worker: working queues {}{default_note} on {}",
        describe_queues(&cfg.queues),
        crate::http::describe_backend(&cfg.backend)
    );
    let shutdown = tokio_util::sync::CancellationToken::new();
    let http = health.map(|(addr, listener, app)| {
        println!("baton worker: health at http://{addr}/healthz, metrics at http://{addr}/metrics");
        let token = shutdown.clone();
        tokio::spawn(async move { axum::serve(listener, app).with_graceful_shutdown(token.cancelled_owned()).await })
    });
    signal.recv().await;
    println!(
        "baton worker: shutting down (up to {} for running handlers)",
        humantime::format_duration(cfg.shutdown_grace)
    );
    workers.drain(cfg.shutdown_grace).await;
    shutdown.cancel();
    if let Some(h) = http {
        let _ = h.await;
    }
    Ok(())
}

/// A handler wrapper that records durations and outcomes (module docs).
struct Metered {
    inner: Arc<dyn CommandHandler>,
    queue: String,
    command_type: String,
}

impl Metered {
    fn record(&self, call: &'static str, started: Instant, r: &Result<CommandResult, HandlerError>) {
        metrics::histogram!("baton_command_handler_seconds", "queue" => self.queue.clone(), "type" => self.command_type.clone(), "call" => call)
            .record(started.elapsed().as_secs_f64());
        let outcome = match r {
            Ok(CommandResult::Succeeded(_)) => "succeeded",
            Ok(CommandResult::Failed(_)) => "failed",
            Ok(CommandResult::Cancelled) => "cancelled",
            Ok(CommandResult::Running { .. }) => "running",
            Ok(CommandResult::HandedOff { .. }) => "handed_off",
            Err(_) => "error",
        };
        metrics::counter!("baton_command_outcomes_total", "queue" => self.queue.clone(), "type" => self.command_type.clone(), "outcome" => outcome)
            .increment(1);
    }
}

#[async_trait]
impl CommandHandler for Metered {
    async fn execute(&self, command: Command) -> Result<CommandResult, HandlerError> {
        let t = Instant::now();
        let r = self.inner.execute(command).await;
        self.record("execute", t, &r);
        r
    }

    async fn check_status(&self, command: Command, state: CommandState) -> Result<CommandResult, HandlerError> {
        let t = Instant::now();
        let r = self.inner.check_status(command, state).await;
        self.record("check_status", t, &r);
        r
    }

    fn validate(&self, params: &Value) -> Result<(), String> {
        self.inner.validate(params)
    }
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
        assert_eq!(describe_queues(&q), "lifecycle (hook=http, nap=sleep); quick ()");
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
        let docs = block(include_str!("../../../docs/configuration.md"), "[queues.lifecycle]");
        let q = parse(&docs).unwrap();
        assert_eq!(q[0].settings.reap_idle_consumers_after, Some(Duration::from_secs(3600)));
        assert_eq!(q[0].settings.claim_timeout, Duration::from_secs(120));
        let module: String = include_str!("workers.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("//! ").or(l.strip_prefix("//!")))
            .collect::<Vec<_>>()
            .join("\n");
        let q = parse(&block(&module, "[queues.default]")).unwrap();
        assert_eq!(q[0].settings.reap_idle_consumers_after, Some(Duration::from_secs(3600)));
        assert_eq!(q[0].handlers.len(), 3);
    }

    #[tokio::test]
    async fn reap_idle_consumers_after_is_checked_again_at_start() {
        let mut q = parse("[queues.a]\nclaim_timeout = \"1s\"\nreap_idle_consumers_after = \"2s\"\n").unwrap();
        q[0].settings.claim_timeout = Duration::from_millis(1500);
        let e = Workers::start(&CommandStore::memory(), &q).await.err().expect("refused");
        assert_eq!(
            e,
            "queue a: invalid setting: reap_idle_consumers_after (2s) must be at least twice claim_timeout (1.5s), or \
             None to never remove idle consumers"
        );
    }

    /// A refused queue is found before any service starts: the queues before it (in name order)
    /// never join their groups.
    #[tokio::test]
    async fn a_refused_queue_starts_no_other_queue() {
        let q = parse("[queues.a.handlers]\ne = \"echo\"\n[queues.b]\nconcurrency = 0\n").unwrap();
        let store = CommandStore::memory();
        let e = Workers::start(&store, &q).await.err().expect("refused");
        assert!(e.starts_with("queue b: ") && e.contains("concurrency"), "{e}");
        assert_eq!(store.messages().stats("a").await.unwrap().consumers, 0);
    }

    #[tokio::test]
    async fn out_of_range_settings_are_refused_at_start() {
        let mut q = parse("[queues.a]\nconcurrency = 0\n[queues.a.handlers]\ne = \"echo\"\n").unwrap();
        let e = Workers::start(&CommandStore::memory(), &q).await.err().expect("refused");
        assert!(e.starts_with("queue a: ") && e.contains("concurrency"), "{e}");
        q[0].settings.concurrency = 1;
        q[0].settings.retry.backoff_factor = 0.5;
        let e = Workers::start(&CommandStore::memory(), &q).await.err().expect("refused");
        assert_eq!(e, "queue a: invalid setting: retry.backoff_factor must be at least 1.0 (got 0.5)");
        q[0].settings.retry.backoff_factor = 2.0;
        let w = Workers::start(&CommandStore::memory(), &q).await.unwrap();
        assert_eq!(w.queues(), ["a"]);
        w.drain(Duration::from_secs(1)).await;
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
}
