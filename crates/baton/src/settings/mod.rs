//! Settings of `baton serve` and `baton worker`: their flags and `BATON_*` environment
//! variables, the TOML file, and what they resolve to. Pure data and parsing: nothing here
//! starts, serves or prints anything.
//!
//! Precedence, highest first: command-line flag, `BATON_*` environment variable, the TOML file
//! given with `--config` (or `BATON_CONFIG`), built-in default. Durations are human-readable
//! (`30s`, `15m`, `1h 30m`; `none` or `off` disables an optional limit); sizes accept `KiB`/`MiB`
//! suffixes (`8MiB`).
//!
//! The command queues (`[queues.*]`) are in [`queues`], the bearer tokens (`[[tokens]]`) in
//! [`tokens`].

pub mod queues;
pub mod redis;
pub mod tokens;
pub mod values;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use baton_redis::RedisConfig;
use baton_streams::RunLimits;
use clap::Args;
pub use redis::{RedisArgs, RedisFile};
use serde::Deserialize;

pub use queues::{default_queues, describe_queues, HandlerConfig, QueueConfig, WebhookConfig};
pub use tokens::{Op, TokenConfig};
pub use values::{parse_duration, parse_opt_duration, parse_size, OptDuration};

use queues::QueueFile;
use tokens::TokenFile;

/// Flags of `baton serve`. Every flag has a `BATON_*` environment variable and a key of the same
/// name (with `_` instead of `-`) in the TOML file.
#[derive(Args, Debug, Default, Clone)]
pub struct ServeArgs {
    /// TOML configuration file (keys as the flags, e.g. `listen = "0.0.0.0:7700"`).
    #[arg(long, env = "BATON_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:7700].
    #[arg(long, env = "BATON_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Where Redis is and how to log in.
    #[command(flatten)]
    pub redis: RedisArgs,
    /// How long a long-poll read waits for data before answering 204 [default: 30s].
    #[arg(long, env = "BATON_LONG_POLL_TIMEOUT", value_parser = parse_duration)]
    pub long_poll_timeout: Option<Duration>,
    /// An SSE connection is closed after about this long so clients reconnect [default: 60s].
    #[arg(long, env = "BATON_SSE_CYCLE", value_parser = parse_duration)]
    pub sse_cycle: Option<Duration>,
    /// Idle SSE connections get a comment heartbeat this often [default: 15s].
    #[arg(long, env = "BATON_SSE_HEARTBEAT", value_parser = parse_duration)]
    pub sse_heartbeat: Option<Duration>,
    /// Largest request body; larger appends get 413 [default: 8MiB].
    #[arg(long, env = "BATON_MAX_BODY", value_parser = parse_size)]
    pub max_body: Option<usize>,
    /// Largest total size of request headers; larger requests get 431 [default: 16KiB].
    #[arg(long, env = "BATON_MAX_HEADER_BYTES", value_parser = parse_size)]
    pub max_header_bytes: Option<usize>,
    /// How long a connection may take to send a request's head (request line and headers),
    /// counted from when it connects or, on a kept-alive connection, from the first byte of the
    /// request; slower connections are closed. A request body that stops arriving for this long
    /// is answered 408 and its connection closed [default: 30s].
    #[arg(long, env = "BATON_HEADER_TIMEOUT", value_parser = parse_duration)]
    pub header_timeout: Option<Duration>,
    /// A kept-alive connection with no request in flight is closed after this long without a
    /// new request (a response in progress, however long, is never cut) [default: 60s].
    #[arg(long, env = "BATON_IDLE_TIMEOUT", value_parser = parse_duration)]
    pub idle_timeout: Option<Duration>,
    /// Open connections at most; more are closed as soon as they are accepted and counted in
    /// `baton_http_connections_rejected_total` [default: from the descriptor limit, see
    /// docs/operations.md].
    #[arg(long, env = "BATON_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Concurrent live readers (long-poll and SSE); more get 503 with Retry-After [default: 20000].
    #[arg(long, env = "BATON_MAX_LIVE_READERS")]
    pub max_live_readers: Option<usize>,
    /// Allowed CORS origins, comma separated, or `*` [default: *].
    #[arg(long, env = "BATON_CORS_ORIGINS", value_delimiter = ',')]
    pub cors_origins: Option<Vec<String>>,
    /// `Cache-Control` of catch-up and long-poll reads: `private` or `public` [default: private].
    #[arg(long, env = "BATON_CACHE", value_parser = ["private", "public"])]
    pub cache: Option<String>,
    /// Default silence timeout of new streams (ended as `producer_lost` after this long without
    /// an append or keepalive); `none` disables, `0` is refused [default: none].
    #[arg(long, env = "BATON_SILENCE_TIMEOUT", value_parser = parse_opt_duration)]
    pub silence_timeout: Option<OptDuration>,
    /// Default hard lifetime of new streams; `none` disables, `0` is refused [default: none].
    #[arg(long, env = "BATON_MAX_RUN", value_parser = parse_opt_duration)]
    pub max_run: Option<OptDuration>,
    /// Default replay window of new streams after they end; `none` keeps them [default: none].
    #[arg(long, env = "BATON_DONE_TTL", value_parser = parse_opt_duration)]
    pub done_ttl: Option<OptDuration>,
    /// Default maximum number of messages per stream (one per append; each JSON value on
    /// `application/json` streams); `0` disables [default: 0].
    #[arg(long, env = "BATON_MAX_LEN")]
    pub max_len: Option<u64>,
    /// Grace period for in-flight requests at shutdown [default: 10s].
    #[arg(long, env = "BATON_SHUTDOWN_GRACE", value_parser = parse_duration)]
    pub shutdown_grace: Option<Duration>,
    /// Largest body of a command submit; larger ones get 413 [default: 1MiB].
    #[arg(long, env = "BATON_MAX_COMMAND_BODY", value_parser = parse_size)]
    pub max_command_body: Option<usize>,
    /// Serve the command API without running the queues' workers here (they run in
    /// `baton worker` processes).
    #[arg(long, env = "BATON_NO_WORKERS")]
    pub no_workers: bool,
    /// The URL clients reach this server at (`https://baton.example.com`): subscriptions'
    /// `callback_url` and `jwks_url` are built from it (default: `http://<bound address>`).
    #[arg(long, env = "BATON_PUBLIC_URL")]
    pub public_url: Option<String>,
    /// Accept subscription webhook URLs on loopback hosts (`localhost`, 127/8, `::1`), over
    /// `http` too; for local development and tests.
    #[arg(long, env = "BATON_ALLOW_LOOPBACK_WEBHOOKS")]
    pub allow_loopback_webhooks: bool,
    /// How long after a process delivering a subscription's wake dies another process takes
    /// the delivery over [default: 10s].
    #[arg(long, env = "BATON_SUBSCRIPTION_CLAIM_TIMEOUT", value_parser = parse_duration)]
    pub subscription_claim_timeout: Option<Duration>,
    /// Export trace spans over OTLP/HTTP (protobuf) to this collector, e.g.
    /// `http://127.0.0.1:4318` (spans are POSTed to `<url>/v1/traces`); off when unset
    /// (docs/operations.md, "Tracing").
    #[arg(long, env = "BATON_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// With --otlp-endpoint: the `service.name` of the exported spans [default: baton].
    #[arg(long, env = "BATON_OTLP_SERVICE_NAME")]
    pub otlp_service_name: Option<String>,
    /// A bearer token with every operation on every stream and queue (environment only; more
    /// tokens with scopes in the TOML file's [[tokens]]).
    #[arg(long = "admin-token", env = "BATON_ADMIN_TOKEN", hide = true, hide_env_values = true)]
    pub admin_token: Option<String>,
}

/// Flags of `baton worker`.
#[derive(Args, Debug, Default, Clone)]
pub struct WorkerArgs {
    /// TOML configuration file: its [queues.*] tables (and redis / redis_cluster) are used.
    #[arg(long, env = "BATON_CONFIG")]
    pub config: Option<PathBuf>,
    /// Where Redis is and how to log in.
    #[command(flatten)]
    pub redis: RedisArgs,
    /// Only these configured queues, comma separated [default: all].
    #[arg(long, value_delimiter = ',')]
    pub queues: Option<Vec<String>>,
    /// Serve /healthz, /readyz and /metrics on this address (none by default).
    #[arg(long, env = "BATON_WORKER_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// With --listen: as `baton serve --header-timeout` [default: 30s].
    #[arg(long, env = "BATON_HEADER_TIMEOUT", value_parser = parse_duration)]
    pub header_timeout: Option<Duration>,
    /// With --listen: as `baton serve --idle-timeout` [default: 60s].
    #[arg(long, env = "BATON_IDLE_TIMEOUT", value_parser = parse_duration)]
    pub idle_timeout: Option<Duration>,
    /// With --listen: as `baton serve --max-connections` [default: from the descriptor limit].
    #[arg(long, env = "BATON_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// How long running handlers get to finish at shutdown [default: 10s].
    #[arg(long, env = "BATON_SHUTDOWN_GRACE", value_parser = parse_duration)]
    pub shutdown_grace: Option<Duration>,
    /// Accept completion webhook URLs (`[queues.<name>.webhook]`) on loopback hosts
    /// (`localhost`, 127/8, `::1`), over `http` too; for local development and tests.
    #[arg(long, env = "BATON_ALLOW_LOOPBACK_WEBHOOKS")]
    pub allow_loopback_webhooks: bool,
    /// Export trace spans over OTLP/HTTP (protobuf) to this collector, e.g.
    /// `http://127.0.0.1:4318` (spans are POSTed to `<url>/v1/traces`); off when unset
    /// (docs/operations.md, "Tracing").
    #[arg(long, env = "BATON_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// With --otlp-endpoint: the `service.name` of the exported spans [default: baton].
    #[arg(long, env = "BATON_OTLP_SERVICE_NAME")]
    pub otlp_service_name: Option<String>,
}

/// The same keys in a TOML file.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    redis: Option<String>,
    redis_cluster: Option<StringOrList>,
    redis_sentinel: Option<StringOrList>,
    redis_sentinel_master: Option<String>,
    redis_ca: Option<PathBuf>,
    redis_client_cert: Option<PathBuf>,
    redis_client_key: Option<PathBuf>,
    redis_username: Option<String>,
    redis_password_file: Option<PathBuf>,
    redis_wait_replicas: Option<u32>,
    redis_wait_timeout: Option<String>,
    long_poll_timeout: Option<String>,
    sse_cycle: Option<String>,
    sse_heartbeat: Option<String>,
    max_body: Option<SizeValue>,
    max_header_bytes: Option<SizeValue>,
    header_timeout: Option<String>,
    idle_timeout: Option<String>,
    max_connections: Option<usize>,
    max_live_readers: Option<usize>,
    cors_origins: Option<StringOrList>,
    cache: Option<String>,
    silence_timeout: Option<String>,
    max_run: Option<String>,
    done_ttl: Option<String>,
    max_len: Option<u64>,
    shutdown_grace: Option<String>,
    max_command_body: Option<SizeValue>,
    no_workers: Option<bool>,
    public_url: Option<String>,
    allow_loopback_webhooks: Option<bool>,
    subscription_claim_timeout: Option<String>,
    otlp_endpoint: Option<String>,
    otlp_service_name: Option<String>,
    queues: Option<BTreeMap<String, QueueFile>>,
    tokens: Option<Vec<TokenFile>>,
}

/// A `public_url` checked: an absolute `http` or `https` URL with a host, returned without a
/// trailing `/`. The error names the flag and the file key and shows the value.
fn public_url(u: &str) -> Result<String, String> {
    let ok = url::Url::parse(u.trim())
        .is_ok_and(|p| matches!(p.scheme(), "http" | "https") && p.host_str().is_some_and(|h| !h.is_empty()));
    if !ok {
        return Err(format!(
            "--public-url (public_url) must be an absolute http(s) URL such as https://baton.example.com (got {u:?})"
        ));
    }
    Ok(u.trim().trim_end_matches('/').to_string())
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => s.split(',').map(|p| p.trim().to_string()).filter(|p| !p.is_empty()).collect(),
            StringOrList::Many(v) => v,
        }
    }
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl SizeValue {
    fn resolve(self) -> Result<usize, String> {
        match self {
            SizeValue::Bytes(n) => Ok(n as usize),
            SizeValue::Text(s) => parse_size(&s),
        }
    }
}

/// Where Baton keeps its state (streams, commands, queues): in process memory or in Redis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Storage {
    Memory,
    Redis(RedisConfig),
}

impl Storage {
    /// One line describing the backend, for logs, the CLI and `/`.
    pub fn describe(&self) -> String {
        match self {
            Storage::Memory => "in-memory (nothing survives a restart)".to_string(),
            Storage::Redis(c) => c.to_string(),
        }
    }
}

/// Whether catch-up reads may be cached by shared caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheMode {
    Private,
    Public,
}

/// How the HTTP server treats connections (`baton serve`, and `baton worker --listen`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Connections {
    /// Longest time to receive a request's head: from the connection's start for its first
    /// request, from the request's first byte on a kept-alive connection.
    pub header_timeout: Duration,
    /// Longest time a kept-alive connection waits, with no request in flight, for the first byte
    /// of its next request.
    pub idle_timeout: Duration,
    /// Most open connections; `None`: derived from the descriptor limit when the server starts.
    pub max_connections: Option<usize>,
}

impl Default for Connections {
    fn default() -> Self {
        Connections {
            header_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: None,
        }
    }
}

/// Fully resolved settings of `baton serve`.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub listen: SocketAddr,
    pub backend: Storage,
    pub long_poll_timeout: Duration,
    pub sse_cycle: Duration,
    pub sse_heartbeat: Duration,
    pub max_body: usize,
    pub max_header_bytes: usize,
    /// Connection timeouts and limit.
    pub connections: Connections,
    pub max_live_readers: usize,
    /// `None` = any origin (`*`).
    pub cors_origins: Option<Vec<String>>,
    pub cache: CacheMode,
    /// Run limits of streams created without `Baton-*` limit headers.
    pub default_limits: RunLimits,
    pub shutdown_grace: Duration,
    /// Command queues (API and workers). Empty here by default; [`ServeArgs::resolve`] puts the
    /// `default` queue ([`default_queues`]) when the configuration names none.
    pub queues: Vec<QueueConfig>,
    /// True when `queues` are the built-in default (none were configured).
    pub queues_defaulted: bool,
    /// Run the queues' workers in this process.
    pub run_workers: bool,
    /// Largest command submit body, bytes.
    pub max_command_body: usize,
    /// Bearer tokens; empty = open server.
    pub tokens: Vec<TokenConfig>,
    /// The public base URL without a trailing `/` (`None`: `http://<bound address>`).
    pub public_url: Option<String>,
    /// Accept loopback webhook URLs for subscriptions.
    pub allow_loopback_webhooks: bool,
    /// Claim timeout of the subscription delivery queue.
    pub subscription_claim_timeout: Duration,
    /// Where trace spans are exported, if anywhere (`--otlp-endpoint`).
    pub otlp: Option<OtlpConfig>,
}

/// Where and as what trace spans are exported over OTLP/HTTP (`--otlp-endpoint`,
/// `--otlp-service-name`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtlpConfig {
    /// The full URL spans are POSTed to: the endpoint without a trailing `/`, plus `/v1/traces`.
    pub traces_url: String,
    /// The `service.name` resource attribute (default `baton`).
    pub service_name: String,
}

/// The OTLP settings from a flag (or its variable) over the file's key; `None` when no endpoint
/// is set. Errors: an endpoint that is not an absolute `http(s)` URL with a host, or an empty
/// service name; the message names the flag and the key.
fn otlp_config(
    endpoint: Option<String>,
    service_name: Option<String>,
    file: &FileConfig,
) -> Result<Option<OtlpConfig>, String> {
    let Some(ep) = endpoint.or_else(|| file.otlp_endpoint.clone()) else { return Ok(None) };
    let ep = ep.trim();
    let ok = url::Url::parse(ep)
        .is_ok_and(|p| matches!(p.scheme(), "http" | "https") && p.host_str().is_some_and(|h| !h.is_empty()));
    if !ok {
        return Err(format!(
            "--otlp-endpoint (otlp_endpoint) must be an absolute http(s) URL such as http://127.0.0.1:4318 (got {ep:?})"
        ));
    }
    let service_name = service_name.or_else(|| file.otlp_service_name.clone()).unwrap_or_else(|| "baton".into());
    if service_name.trim().is_empty() {
        return Err("--otlp-service-name (otlp_service_name) must not be empty".into());
    }
    let base = ep.trim_end_matches('/');
    let traces_url = if base.ends_with("/v1/traces") { base.to_string() } else { format!("{base}/v1/traces") };
    Ok(Some(OtlpConfig { traces_url, service_name: service_name.trim().to_string() }))
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7700)),
            backend: Storage::Memory,
            long_poll_timeout: Duration::from_secs(30),
            sse_cycle: Duration::from_secs(60),
            sse_heartbeat: Duration::from_secs(15),
            max_body: 8 << 20,
            max_header_bytes: 16 << 10,
            connections: Connections::default(),
            max_live_readers: 20_000,
            cors_origins: None,
            cache: CacheMode::Private,
            default_limits: RunLimits::unlimited(),
            shutdown_grace: Duration::from_secs(10),
            queues: Vec::new(),
            queues_defaulted: false,
            run_workers: true,
            max_command_body: 1 << 20,
            tokens: Vec::new(),
            public_url: None,
            allow_loopback_webhooks: false,
            subscription_claim_timeout: Duration::from_secs(10),
            otlp: None,
        }
    }
}

impl ServeArgs {
    /// Merges flags/environment with the TOML file (if any) and the defaults.
    pub fn resolve(self) -> Result<ServeConfig, String> {
        let file: FileConfig = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read config file {}: {e}", path.display()))?;
                toml::from_str(&text).map_err(|e| format!("config file {}: {e}", path.display()))?
            }
            None => FileConfig::default(),
        };
        let d = ServeConfig::default();
        let otlp = otlp_config(self.otlp_endpoint, self.otlp_service_name, &file)?;
        let dur =
            |flag: Option<Duration>, file: Option<String>, key: &str, def: Duration| -> Result<Duration, String> {
                match (flag, file) {
                    (Some(v), _) => Ok(v),
                    (None, Some(s)) => parse_duration(&s).map_err(|e| format!("config key {key}: {e}")),
                    (None, None) => Ok(def),
                }
            };
        let opt_dur = |flag: Option<OptDuration>,
                       file: Option<String>,
                       key: &str|
         -> Result<Option<Duration>, String> {
            match (flag, file) {
                (Some(v), _) => Ok(v.0),
                (None, Some(s)) => parse_opt_duration(&s).map(|o| o.0).map_err(|e| format!("config key {key}: {e}")),
                (None, None) => Ok(None),
            }
        };
        let listen = match (self.listen, file.listen) {
            (Some(a), _) => a,
            (None, Some(s)) => s.parse().map_err(|e| format!("config key listen: {s:?}: {e}"))?,
            (None, None) => d.listen,
        };
        let redis_file = RedisFile {
            redis: file.redis,
            redis_cluster: file.redis_cluster.map(StringOrList::into_vec),
            redis_sentinel: file.redis_sentinel.map(StringOrList::into_vec),
            redis_sentinel_master: file.redis_sentinel_master,
            redis_ca: file.redis_ca,
            redis_client_cert: file.redis_client_cert,
            redis_client_key: file.redis_client_key,
            redis_username: file.redis_username,
            redis_password_file: file.redis_password_file,
            redis_wait_replicas: file.redis_wait_replicas,
            redis_wait_timeout: file.redis_wait_timeout,
        };
        let backend = match self.redis.resolve(redis_file)? {
            Some(config) => Storage::Redis(config),
            None => Storage::Memory,
        };
        let size = |flag: Option<usize>, file: Option<SizeValue>, key: &str, def: usize| -> Result<usize, String> {
            match (flag, file) {
                (Some(v), _) => Ok(v),
                (None, Some(v)) => v.resolve().map_err(|e| format!("config key {key}: {e}")),
                (None, None) => Ok(def),
            }
        };
        let cors = self.cors_origins.or(file.cors_origins.map(StringOrList::into_vec));
        let cors_origins = match cors {
            None => None,
            Some(v) if v.iter().any(|o| o.trim() == "*") => None,
            Some(v) => Some(v.into_iter().map(|o| o.trim().to_string()).filter(|o| !o.is_empty()).collect()),
        };
        let cache = match self.cache.or(file.cache).as_deref() {
            None | Some("private") => CacheMode::Private,
            Some("public") => CacheMode::Public,
            Some(other) => return Err(format!("cache must be `private` or `public`, not {other:?}")),
        };
        let max_len = self.max_len.or(file.max_len).filter(|n| *n > 0);
        let cfg = ServeConfig {
            listen,
            backend,
            long_poll_timeout: dur(
                self.long_poll_timeout,
                file.long_poll_timeout,
                "long_poll_timeout",
                d.long_poll_timeout,
            )?,
            sse_cycle: dur(self.sse_cycle, file.sse_cycle, "sse_cycle", d.sse_cycle)?,
            sse_heartbeat: dur(self.sse_heartbeat, file.sse_heartbeat, "sse_heartbeat", d.sse_heartbeat)?,
            max_body: size(self.max_body, file.max_body, "max_body", d.max_body)?,
            max_header_bytes: size(
                self.max_header_bytes,
                file.max_header_bytes,
                "max_header_bytes",
                d.max_header_bytes,
            )?,
            connections: Connections {
                header_timeout: dur(
                    self.header_timeout,
                    file.header_timeout,
                    "header_timeout",
                    d.connections.header_timeout,
                )?,
                idle_timeout: dur(self.idle_timeout, file.idle_timeout, "idle_timeout", d.connections.idle_timeout)?,
                max_connections: self.max_connections.or(file.max_connections),
            },
            max_live_readers: self.max_live_readers.or(file.max_live_readers).unwrap_or(d.max_live_readers),
            cors_origins,
            cache,
            default_limits: RunLimits {
                silence_timeout: opt_dur(self.silence_timeout, file.silence_timeout, "silence_timeout")?,
                max_run: opt_dur(self.max_run, file.max_run, "max_run")?,
                done_ttl: opt_dur(self.done_ttl, file.done_ttl, "done_ttl")?,
                max_len,
                max_len_per_writer: None,
            },
            shutdown_grace: dur(self.shutdown_grace, file.shutdown_grace, "shutdown_grace", d.shutdown_grace)?,
            max_command_body: size(
                self.max_command_body,
                file.max_command_body,
                "max_command_body",
                d.max_command_body,
            )?,
            run_workers: !(self.no_workers || file.no_workers.unwrap_or(false)),
            queues_defaulted: file.queues.as_ref().is_none_or(|q| q.is_empty()),
            queues: match file.queues {
                Some(q) if !q.is_empty() => queues::resolve_queues(q)?,
                _ => default_queues(),
            },
            tokens: tokens::resolve_tokens(file.tokens.unwrap_or_default(), self.admin_token)?,
            public_url: match self.public_url.or(file.public_url) {
                None => None,
                Some(u) => Some(public_url(&u)?),
            },
            allow_loopback_webhooks: self.allow_loopback_webhooks || file.allow_loopback_webhooks.unwrap_or(false),
            subscription_claim_timeout: dur(
                self.subscription_claim_timeout,
                file.subscription_claim_timeout,
                "subscription_claim_timeout",
                d.subscription_claim_timeout,
            )?,
            otlp,
        };
        if cfg.subscription_claim_timeout.is_zero() {
            return Err(
                "--subscription-claim-timeout (subscription_claim_timeout) must be greater than zero, e.g. 10s".into(),
            );
        }
        for (zero, name) in [
            (cfg.sse_heartbeat.is_zero(), "--sse-heartbeat (sse_heartbeat)"),
            (cfg.sse_cycle.is_zero(), "--sse-cycle (sse_cycle)"),
            (cfg.connections.header_timeout.is_zero(), "--header-timeout (header_timeout)"),
            (cfg.connections.idle_timeout.is_zero(), "--idle-timeout (idle_timeout)"),
        ] {
            if zero {
                return Err(format!("{name} must be greater than zero, e.g. 30s"));
            }
        }
        if cfg.connections.max_connections == Some(0) {
            return Err(
                "--max-connections (max_connections) must be at least 1 (leave it out to derive it from the descriptor limit)"
                    .into()
            );
        }
        if cfg.default_limits.silence_timeout.is_some_and(|d| d.is_zero()) {
            return Err(
                "silence_timeout 0 would end every new stream at once; give a positive duration, or `none`".into()
            );
        }
        if cfg.default_limits.max_run.is_some_and(|d| d.is_zero()) {
            return Err(
                "max_run 0 would delete every new stream as soon as it is created; give a positive duration, or `none`"
                    .into(),
            );
        }
        Ok(cfg)
    }
}

/// Resolved settings of `baton worker`.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub backend: Storage,
    pub queues: Vec<QueueConfig>,
    pub queues_defaulted: bool,
    /// Where to serve `/healthz`, `/readyz` and `/metrics`, if anywhere.
    pub listen: Option<SocketAddr>,
    /// Connection timeouts and limit of the `--listen` server.
    pub connections: Connections,
    pub shutdown_grace: Duration,
    /// Accept loopback completion webhook URLs.
    pub allow_loopback_webhooks: bool,
    /// Where trace spans are exported, if anywhere (`--otlp-endpoint`).
    pub otlp: Option<OtlpConfig>,
    /// The completion webhook of every configured queue that has one, `--queues` or not: this
    /// process's terminal writes of their commands (a hand-off to a queue worked here ends a
    /// command homed in another) enqueue their deliveries.
    pub webhooks: Vec<(String, WebhookConfig)>,
}

impl WorkerArgs {
    /// Reads the same TOML file as `baton serve` (its `[queues.*]`, `redis`, `redis_cluster`,
    /// `shutdown_grace`, `header_timeout`, `idle_timeout` and `max_connections`). Errors: the in-memory backend (a worker must share Redis with the
    /// server), an unknown queue in `--queues`, and every error of `baton serve`'s configuration.
    pub fn resolve(self) -> Result<WorkerConfig, String> {
        let serve = ServeArgs {
            config: self.config,
            redis: self.redis,
            shutdown_grace: self.shutdown_grace,
            header_timeout: self.header_timeout,
            idle_timeout: self.idle_timeout,
            max_connections: self.max_connections,
            allow_loopback_webhooks: self.allow_loopback_webhooks,
            otlp_endpoint: self.otlp_endpoint,
            otlp_service_name: self.otlp_service_name,
            ..Default::default()
        }
        .resolve()?;
        if serve.backend == Storage::Memory {
            return Err("it needs --redis, --redis-cluster or --redis-sentinel (or redis / redis_cluster / \
                        redis_sentinel in the config file); \
                        with the in-memory backend the workers run inside baton serve"
                .into());
        }
        let mut queues = serve.queues;
        let webhooks = queues.iter().filter_map(|q| Some((q.name.clone(), q.webhook.clone()?))).collect();
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
            connections: serve.connections,
            shutdown_grace: serve.shutdown_grace,
            allow_loopback_webhooks: serve.allow_loopback_webhooks,
            otlp: serve.otlp,
            webhooks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_silence_timeout_is_refused() {
        let args = ServeArgs { silence_timeout: Some(OptDuration(Some(Duration::ZERO))), ..Default::default() };
        let e = args.resolve().unwrap_err();
        assert!(e.contains("silence_timeout 0") && e.contains("`none`"), "{e}");
        let none = ServeArgs { silence_timeout: Some(OptDuration(None)), ..Default::default() };
        assert_eq!(none.resolve().unwrap().default_limits.silence_timeout, None);
    }

    #[test]
    fn zero_max_run_is_refused() {
        let args = ServeArgs { max_run: Some(OptDuration(Some(Duration::ZERO))), ..Default::default() };
        let e = args.resolve().unwrap_err();
        assert!(e.contains("max_run 0") && e.contains("`none`"), "{e}");
    }

    #[test]
    fn a_bad_public_url_says_what_is_expected() {
        for bad in ["foo", "ftp://baton.example.com", "http://", "/relative"] {
            let args = ServeArgs { public_url: Some(bad.into()), ..Default::default() };
            assert_eq!(
                args.resolve().unwrap_err(),
                format!(
                    "--public-url (public_url) must be an absolute http(s) URL such as https://baton.example.com (got {bad:?})"
                )
            );
        }
        let args = ServeArgs { public_url: Some("https://baton.example.com/".into()), ..Default::default() };
        assert_eq!(args.resolve().unwrap().public_url.as_deref(), Some("https://baton.example.com"));
    }

    #[test]
    fn otlp_endpoint_is_checked_and_gets_the_traces_path() {
        assert_eq!(ServeArgs::default().resolve().unwrap().otlp, None, "off by default");
        let args = ServeArgs { otlp_endpoint: Some("http://127.0.0.1:4318/".into()), ..Default::default() };
        let want = OtlpConfig { traces_url: "http://127.0.0.1:4318/v1/traces".into(), service_name: "baton".into() };
        assert_eq!(args.resolve().unwrap().otlp, Some(want));
        let args = ServeArgs {
            otlp_endpoint: Some("https://otel.example.com/v1/traces".into()),
            otlp_service_name: Some("edge".into()),
            ..Default::default()
        };
        let otlp = args.resolve().unwrap().otlp.unwrap();
        assert_eq!(
            (otlp.traces_url.as_str(), otlp.service_name.as_str()),
            ("https://otel.example.com/v1/traces", "edge")
        );
        let args = ServeArgs { otlp_endpoint: Some("127.0.0.1:4318".into()), ..Default::default() };
        assert!(args.resolve().unwrap_err().starts_with("--otlp-endpoint (otlp_endpoint) must be"));
    }

    #[test]
    fn a_short_admin_token_names_its_variable() {
        let args = ServeArgs { admin_token: Some("adm".into()), ..Default::default() };
        assert_eq!(
            args.resolve().unwrap_err(),
            "BATON_ADMIN_TOKEN is shorter than 16 characters; use a long random secret"
        );
    }

    #[test]
    fn a_zero_connection_timeout_names_its_flag() {
        let args = ServeArgs { idle_timeout: Some(Duration::ZERO), ..Default::default() };
        assert_eq!(args.resolve().unwrap_err(), "--idle-timeout (idle_timeout) must be greater than zero, e.g. 30s");
        let args = ServeArgs { header_timeout: Some(Duration::ZERO), ..Default::default() };
        assert_eq!(
            args.resolve().unwrap_err(),
            "--header-timeout (header_timeout) must be greater than zero, e.g. 30s"
        );
    }

    #[test]
    fn precedence_flag_over_file_over_default() {
        let dir = std::env::temp_dir().join(format!("baton-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("baton.toml");
        std::fs::write(&path, "listen = \"127.0.0.1:9000\"\nlong_poll_timeout = \"5s\"\nmax_body = \"1MiB\"\nredis_cluster = \"redis://a:1,redis://b:2\"\n").unwrap();
        let args = ServeArgs {
            config: Some(path.clone()),
            long_poll_timeout: Some(Duration::from_secs(2)),
            ..Default::default()
        };
        let cfg = args.resolve().unwrap();
        assert_eq!(cfg.listen.port(), 9000);
        assert_eq!(cfg.long_poll_timeout, Duration::from_secs(2));
        assert_eq!(cfg.max_body, 1 << 20);
        assert_eq!(cfg.sse_cycle, Duration::from_secs(60));
        assert_eq!(cfg.backend, Storage::Redis(RedisConfig::cluster(["redis://a:1", "redis://b:2"])));
        std::fs::write(&path, "header_timeout = \"5s\"\nmax_connections = 100\nredis = \"redis://a:1\"\n").unwrap();
        let cfg =
            ServeArgs { config: Some(path.clone()), idle_timeout: Some(Duration::from_secs(9)), ..Default::default() }
                .resolve()
                .unwrap();
        let want = Connections {
            header_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(9),
            max_connections: Some(100),
        };
        assert_eq!(cfg.connections, want);
        let worker =
            WorkerArgs { config: Some(path.clone()), idle_timeout: Some(Duration::from_secs(9)), ..Default::default() };
        assert_eq!(worker.resolve().unwrap().connections, want, "baton worker --listen reads the same keys");
        std::fs::write(&path, "max_connections = 0\n").unwrap();
        let err = ServeArgs { config: Some(path.clone()), ..Default::default() }.resolve().unwrap_err();
        assert_eq!(
            err,
            "--max-connections (max_connections) must be at least 1 (leave it out to derive it from the descriptor limit)"
        );
        std::fs::write(&path, "bogus_key = 1\n").unwrap();
        let err = ServeArgs { config: Some(path.clone()), ..Default::default() }.resolve().unwrap_err();
        assert!(err.contains("bogus_key"), "{err}");
        // `baton worker --queues b` keeps every queue's webhook (a command homed in `a`, handed
        // off to `b`, ends in this worker) and the loopback flag.
        std::fs::write(
            &path,
            "redis = \"redis://a:1\"\n[queues.a.webhook]\nurl = \"http://127.0.0.1:1/h\"\n[queues.b.handlers]\ne = \"echo\"\n",
        )
        .unwrap();
        let worker = WorkerArgs {
            config: Some(path),
            queues: Some(vec!["b".into()]),
            allow_loopback_webhooks: true,
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(worker.queues.iter().map(|q| q.name.as_str()).collect::<Vec<_>>(), ["b"]);
        assert_eq!(
            worker.webhooks.iter().map(|(q, w)| (q.as_str(), w.url.as_str())).collect::<Vec<_>>(),
            [("a", "http://127.0.0.1:1/h")]
        );
        assert!(worker.allow_loopback_webhooks);
    }
}
