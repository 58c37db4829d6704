//! Redis connectivity for Baton, in one place.
//!
//! * [`RedisConfig`] names the deployment: one standalone server (`redis://host:port/db`) or the
//!   seed nodes of a Redis Cluster.
//! * [`RedisClient`] hands out connections to it:
//!   - [`RedisClient::shared`]: a multiplexed connection that reconnects by itself after a Redis
//!     restart ([`StandaloneConn`] standalone, [`ClusterConn`] in Cluster, [`SentinelConn`] with
//!     Sentinel), with a response timeout of [`DEFAULT_RESPONSE_TIMEOUT`]. Cheap to clone; use it
//!     for every non-blocking command.
//!   - [`RedisClient::dedicated`]: a connection of its own with **no** response timeout, for
//!     commands that `BLOCK` (XREADGROUP … BLOCK, XREAD … BLOCK). The redis crate's default 500 ms
//!     response timeout would otherwise cut every block longer than that. Callers bound their own
//!     waits (e.g. `tokio::time::timeout(block + margin)`).
//! * [`RedisConn`] is either kind of connection and implements `redis::aio::ConnectionLike`, so
//!   `redis::cmd(..).query_async(&mut conn)` and `redis::Script::invoke_async` work on both.
//! * [`LuaScript`] wraps `redis::Script` for scripts kept as `.lua` files next to the code that
//!   uses them (`include_str!`). Every script call goes through it: [`LuaScript::evalsha_cmd`]
//!   (or [`LuaScript::evalsha_cmd_with_capacity`]) starts the `EVALSHA`, the caller writes keys
//!   and arguments straight into it, and [`LuaScript::query`] sends it, loading the script and
//!   retrying once on `NOSCRIPT`. [`LuaScript::run`] does all three for small calls.
//!
//! Cluster rule (Redis Cluster spec, "Keys hash tags"): every key a script touches is passed in
//! KEYS and all of them share one `{…}` hash tag, so the script runs on one node.
//!
//! [`RedisConn::scan_match`] ([`KeyScan`]) is `SCAN … MATCH` over every key of the deployment:
//! the one server, or every master of a Cluster.
//!
//! [`group_commit`] is the one mechanism for "one call in flight per key, the rest go in the
//! next call" (command submits and transitions, stream writes).
//!
//! [`resend`] guards a script call against the Cluster client's re-sent copies (a write that
//! must not apply twice).
//!
//! ```no_run
//! use baton_redis::{redis, LuaScript, RedisClient, RedisConfig};
//!
//! // In a crate: `LuaScript::new("incr_by", include_str!("../scripts/incr_by.lua"))`.
//! static INCR_BY: LuaScript = LuaScript::new("incr_by", "return redis.call('INCRBY', KEYS[1], ARGV[1])");
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let client = RedisClient::new(RedisConfig::standalone("redis://127.0.0.1:6379"))?;
//! let mut conn = client.shared().await?;
//! let _: () = redis::cmd("SET").arg("{app}:n").arg(1).query_async(&mut conn).await?;
//! // Small calls: keys and arguments as slices.
//! let n: i64 = INCR_BY.run(&mut conn, &["{app}:n"], &[&2]).await?;
//! assert_eq!(n, 3);
//! // Hot paths: keys and arguments written straight into one command, then sent.
//! let mut cmd = INCR_BY.evalsha_cmd(1);
//! cmd.arg("{app}:n").arg(4);
//! let n: i64 = INCR_BY.query(&mut conn, &cmd).await?;
//! assert_eq!(n, 7);
//! # Ok(())
//! # }
//! ```

mod cluster;
mod config;
pub mod group_commit;
pub mod resend;
mod scan;
pub mod sentinel;

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
use redis::{ClientTlsConfig, Cmd, IntoConnectionInfo, Pipeline, RedisFuture, TlsCertificates, Value};

pub use cluster::ClusterConn;
pub use redis;
pub use scan::KeyScan;

/// Response timeout of shared connections: 5 s. A command on a shared connection that gets no
/// reply within it fails with an I/O timeout error (and the connection manager reconnects).
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Retries of a Cluster call (redirections, a node being failed over): 40.
const CLUSTER_RETRIES: u32 = 40;
/// Least and most wait between retries of a Cluster call, ms.
const CLUSTER_RETRY_WAIT_MS: (u64, u64) = (100, 500);

/// Time allowed to open one TCP connection to a Redis node: 2 s.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);

/// Errors from connecting to Redis.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL could not be parsed (`redis://[user:pass@]host:port[/db]` or `rediss://…`).
    #[error(
        "invalid Redis URL {url:?} (the form is redis://[user[:password]@]host:port[/db], or rediss:// for \
         TLS; percent-encode any of / ? # @ % in a password, or give the password apart from the URL): \
         {source}"
    )]
    InvalidUrl {
        /// The URL, its password replaced by `***`.
        url: String,
        #[source]
        source: redis::RedisError,
    },
    /// A cluster configuration with no node URL, or a Sentinel one with no sentinel.
    #[error("a Redis Cluster configuration needs at least one node URL")]
    NoClusterNodes,
    /// A Sentinel configuration without sentinel URLs or without a master name.
    #[error("a Redis Sentinel configuration needs at least one sentinel URL and the master's name")]
    IncompleteSentinel,
    /// The TLS files could not be used: unreadable, not PEM, a certificate without its key, or
    /// TLS files given for `redis://` (not `rediss://`) URLs.
    #[error("TLS configuration: {0}")]
    TlsConfig(String),
    /// A [`Durability`] out of bounds.
    #[error("Redis durability: {0}")]
    Durability(String),
    /// The TLS handshake failed: the server's certificate is not trusted or does not name the
    /// host, or the server wants a client certificate. `hint` says what to check.
    #[error("TLS handshake with {target} failed: {source}; {hint}")]
    Tls {
        target: String,
        #[source]
        source: redis::RedisError,
        hint: String,
    },
    /// The server could not be reached or refused the connection (or the login).
    #[error("cannot connect to {target}: {source}")]
    Unreachable {
        /// What could not be reached, e.g. `Redis at redis://127.0.0.1:6379` or
        /// `Redis Cluster at redis://127.0.0.1:7000,redis://127.0.0.1:7001`.
        target: String,
        #[source]
        source: redis::RedisError,
    },
}

pub use config::{read_secret_file, redact_url, Durability, RedisConfig, RedisServers, TlsFiles};
pub use sentinel::SentinelConn;

#[derive(Clone)]
enum ClientKind {
    Standalone(Box<redis::Client>),
    Cluster { client: Box<ClusterClient>, blocking: Box<ClusterClient> },
    Sentinel(std::sync::Arc<sentinel::Resolver>),
}

/// A handle on a Redis deployment (standalone, Cluster or Sentinel). Cheap to clone.
#[derive(Clone)]
pub struct RedisClient {
    kind: ClientKind,
    config: RedisConfig,
    /// The certificates read from the TLS files (`None` without TLS).
    certs: Option<TlsCertificates>,
}

impl RedisClient {
    /// Validates the configuration, reads the TLS files and builds a client. Does not connect yet.
    ///
    /// Errors: [`ConnectError::InvalidUrl`], [`ConnectError::NoClusterNodes`],
    /// [`ConnectError::IncompleteSentinel`], [`ConnectError::TlsConfig`].
    pub fn new(config: RedisConfig) -> Result<Self, ConnectError> {
        let urls = config.urls();
        let tls = config.uses_tls();
        if tls && urls.iter().any(|u| !u.starts_with("rediss://")) {
            return Err(ConnectError::TlsConfig(
                "mix of rediss:// and redis:// URLs; use rediss:// for every node or for none".into(),
            ));
        }
        let files = &config.tls;
        if !tls && (files.ca.is_some() || files.client_cert.is_some() || files.client_key.is_some()) {
            return Err(ConnectError::TlsConfig(
                "a CA or client certificate is set but the URLs use redis://; use rediss:// URLs for TLS".into(),
            ));
        }
        if tls {
            install_crypto_provider();
        }
        let certs = if tls { Some(read_certificates(files)?) } else { None };
        if let Some(d) = &config.durability {
            d.check().map_err(ConnectError::Durability)?;
        }
        let invalid = |url: &str| {
            let url = redact_url(url);
            move |source| ConnectError::InvalidUrl { url, source }
        };
        let kind = match &config.servers {
            RedisServers::Standalone(url) => ClientKind::Standalone(Box::new(node_client(url, &config, &certs)?)),
            RedisServers::Cluster(urls) => {
                if urls.is_empty() {
                    return Err(ConnectError::NoClusterNodes);
                }
                for url in urls {
                    node_client(url, &config, &certs)?;
                }
                let build = |timeout: Option<Duration>| {
                    // Retries after a failover every 100–500 ms (the crate's default waits
                    // 1.28 s and more between them, which measured up to 1.3 s of extra
                    // recovery after a replica's promotion); 40 retries outlast a failover of
                    // the default cluster-node-timeout (15 s), and the response timeout bounds
                    // each call anyway.
                    let mut b = ClusterClient::builder(urls.clone())
                        .connection_timeout(CONNECTION_TIMEOUT)
                        .retries(CLUSTER_RETRIES)
                        .min_retry_wait(CLUSTER_RETRY_WAIT_MS.0)
                        .max_retry_wait(CLUSTER_RETRY_WAIT_MS.1);
                    if let Some(t) = timeout {
                        b = b.response_timeout(t);
                    }
                    if let Some(u) = &config.username {
                        b = b.username(u);
                    }
                    if let Some(p) = &config.password {
                        b = b.password(p);
                    }
                    if let Some(c) = &certs {
                        b = b.certs(c.clone());
                    }
                    b.build().map_err(invalid(&urls.join(",")))
                };
                ClientKind::Cluster {
                    client: Box::new(build(Some(DEFAULT_RESPONSE_TIMEOUT))?),
                    blocking: Box::new(build(None)?),
                }
            }
            RedisServers::Sentinel { sentinels, master } => {
                if sentinels.is_empty() || master.is_empty() {
                    return Err(ConnectError::IncompleteSentinel);
                }
                let mut addrs: Vec<redis::ConnectionAddr> = Vec::new();
                let mut sentinel_user = None;
                let mut sentinel_password = None;
                for url in sentinels {
                    let info = url.as_str().into_connection_info().map_err(invalid(url))?;
                    sentinel_user = sentinel_user.or(info.redis_settings().username().map(str::to_string));
                    sentinel_password = sentinel_password.or(info.redis_settings().password().map(str::to_string));
                    addrs.push(info.addr().clone());
                }
                let mut b = SentinelClientBuilder::new(addrs, master, SentinelServerType::Master)
                    .map_err(invalid(&sentinels.join(",")))?;
                if let Some(u) = sentinel_user {
                    b = b.set_client_to_sentinel_username(u);
                }
                if let Some(p) = sentinel_password {
                    b = b.set_client_to_sentinel_password(p);
                }
                if let Some(u) = &config.username {
                    b = b.set_client_to_redis_username(u);
                }
                if let Some(p) = &config.password {
                    b = b.set_client_to_redis_password(p);
                }
                if let Some(c) = &certs {
                    b = b
                        .set_client_to_sentinel_certificates(c.clone())
                        .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
                        .set_client_to_redis_certificates(c.clone());
                }
                let client = b.build().map_err(invalid(&sentinels.join(",")))?;
                // The sentinels themselves (their URLs carry their own credentials), for the
                // +switch-master subscription.
                let sentinel_clients = sentinels
                    .iter()
                    .map(|url| match &certs {
                        Some(c) => redis::Client::build_with_tls(url.as_str(), c.clone()),
                        None => redis::Client::open(url.as_str()),
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(invalid(&sentinels.join(",")))?;
                let scheme = if tls { "rediss" } else { "redis" };
                let (node_config, node_certs) = (config.clone(), certs.clone());
                let node = move |host: &str, port: u16| {
                    let url = node_url(&format!("{scheme}://localhost:1"), host, port);
                    node_client(&url, &node_config, &node_certs).map_err(|e| match e {
                        ConnectError::InvalidUrl { source, .. } => source,
                        other => redis::RedisError::from(std::io::Error::other(other.to_string())),
                    })
                };
                ClientKind::Sentinel(std::sync::Arc::new(sentinel::Resolver::new(
                    client,
                    master.clone(),
                    sentinel_clients,
                    Box::new(node),
                )))
            }
        };
        Ok(Self { kind, config, certs })
    }

    /// The configuration this client was built from.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// The opt-in durability of acknowledged writes ([`RedisConfig::durability`]), for
    /// [`LuaScript::query_durable`].
    pub fn durability(&self) -> Option<Durability> {
        self.config.durability
    }

    /// The connections for writes that wait for replicas, when the configuration asks for
    /// [`Durability`] (`None` otherwise). See [`DurableWriter`].
    ///
    /// Errors: as [`RedisClient::shared`].
    pub async fn durable_writer(&self) -> Result<Option<DurableWriter>, ConnectError> {
        let Some(durability) = self.config.durability else { return Ok(None) };
        let mut conns: Vec<RedisConn> = Vec::with_capacity(DurableWriter::CONNECTIONS);
        // A write may queue behind other writes' WAITs on its connection: room for two.
        let response_timeout = DEFAULT_RESPONSE_TIMEOUT + 2 * durability.timeout;
        for _ in 0..DurableWriter::CONNECTIONS {
            conns.push(self.connect(Some(response_timeout)).await?);
        }
        Ok(Some(DurableWriter { conns: conns.into(), durability }))
    }

    /// True for a Redis Cluster deployment.
    pub fn is_cluster(&self) -> bool {
        matches!(self.kind, ClientKind::Cluster { .. })
    }

    /// A shared, auto-reconnecting, multiplexed connection with a response timeout of
    /// [`DEFAULT_RESPONSE_TIMEOUT`]. Never use it for BLOCK commands.
    ///
    /// Errors: [`ConnectError::Unreachable`] or [`ConnectError::Tls`] when the first connection
    /// fails or refuses a first command (`NOAUTH`: the server wants a password).
    pub async fn shared(&self) -> Result<RedisConn, ConnectError> {
        self.connect(Some(DEFAULT_RESPONSE_TIMEOUT)).await
    }

    /// A connection of its own with no response timeout, for BLOCK commands. It reconnects by
    /// itself after a Redis restart (and, with Sentinel, after a failover); callers bound each
    /// wait themselves.
    ///
    /// Errors: [`ConnectError::Unreachable`] or [`ConnectError::Tls`] when the first connection
    /// fails or refuses a first command (`NOAUTH`: the server wants a password).
    pub async fn dedicated(&self) -> Result<RedisConn, ConnectError> {
        self.connect(None).await
    }

    /// `what` in error messages: `Redis at <url>`, `Redis Cluster at <urls>` or
    /// `the master "<name>" of Redis Sentinel <urls>`, passwords redacted.
    fn target(&self) -> String {
        let join = |urls: &[String]| urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>().join(",");
        match &self.config.servers {
            RedisServers::Standalone(url) => format!("Redis at {}", redact_url(url)),
            RedisServers::Cluster(urls) => format!("Redis Cluster at {}", join(urls)),
            RedisServers::Sentinel { sentinels, master } => {
                format!("the master {master:?} of Redis Sentinel {}", join(sentinels))
            }
        }
    }

    /// Turns a failed first connection into [`ConnectError::Tls`] (a TLS failure, with what to
    /// check) or [`ConnectError::Unreachable`].
    fn connect_error(&self, source: redis::RedisError) -> ConnectError {
        let target = self.target();
        if self.certs.is_none() {
            return ConnectError::Unreachable { target, source };
        }
        let text = source.to_string();
        let lower = text.to_ascii_lowercase();
        let hint =
            if lower.contains("unknownissuer") || lower.contains("unknown issuer") || lower.contains("badsignature") {
                match &self.config.tls.ca {
                    Some(ca) => format!("the server's certificate is not signed by the CA in {}", ca.display()),
                    None => "the server's certificate is not signed by a CA the system trusts; give the CA's \
                         certificate (baton: --redis-ca FILE or BATON_REDIS_CA)"
                        .to_string(),
                }
            } else if lower.contains("notvalidforname") || lower.contains("not valid for name") {
                "the server's certificate does not name the host in the URL (connect by a name or IP address \
             in its subjectAltName)"
                    .to_string()
            } else if lower.contains("expired") || lower.contains("notyetvalid") {
                "the server's certificate is outside its validity period".to_string()
            } else if lower.contains("certificaterequired") || lower.contains("certificate required") {
                "the server requires a client certificate (baton: --redis-client-cert and --redis-client-key)"
                    .to_string()
            } else if lower.contains("certificate") || lower.contains("handshake") || lower.contains("tls") {
                "check the CA and client certificate files".to_string()
            } else {
                return ConnectError::Unreachable { target, source };
            };
        ConnectError::Tls { target, source, hint }
    }

    async fn connect(&self, response_timeout: Option<Duration>) -> Result<RedisConn, ConnectError> {
        match &self.kind {
            ClientKind::Standalone(client) => {
                let cfg = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(CONNECTION_TIMEOUT))
                    .set_response_timeout(response_timeout)
                    .set_number_of_retries(3)
                    .set_max_delay(Duration::from_secs(1));
                let mut mgr =
                    StandaloneConn::connect((**client).clone(), cfg).await.map_err(|e| self.connect_error(e))?;
                // The connection opens without a password on a server that wants one (only
                // commands get NOAUTH): a PING makes a wrong setup fail here, at startup.
                // (Cluster and Sentinel connections already ran CLUSTER SLOTS / ROLE.)
                redis::cmd("PING").query_async::<()>(&mut mgr).await.map_err(|e| self.connect_error(e))?;
                Ok(RedisConn::Standalone(mgr))
            }
            ClientKind::Cluster { client, blocking } => {
                let c = if response_timeout.is_some() { client } else { blocking };
                let conn = ClusterConn::connect((**c).clone()).await.map_err(|e| self.connect_error(e))?;
                Ok(RedisConn::Cluster(conn))
            }
            ClientKind::Sentinel(resolver) => {
                let cfg = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(CONNECTION_TIMEOUT))
                    .set_response_timeout(response_timeout);
                let conn = SentinelConn::connect(resolver.clone(), cfg).await.map_err(|e| self.connect_error(e))?;
                Ok(RedisConn::Sentinel(conn))
            }
        }
    }

    /// A `redis::Client` for one node at `host:port`, with the scheme, credentials and TLS
    /// material of this configuration: for connections a [`RedisConn`] does not cover, such as
    /// pub/sub or a blocking read on the Cluster node that owns a key. An empty `host` keeps
    /// the first URL's host (a Cluster node that does not know its own address).
    ///
    /// Errors: the redis crate's, for a host it cannot parse.
    pub fn node_client(&self, host: &str, port: u16) -> redis::RedisResult<redis::Client> {
        let seed = &self.config.urls()[0];
        let url = node_url(seed, host, port);
        node_client(&url, &self.config, &self.certs).map_err(|e| match e {
            ConnectError::InvalidUrl { source, .. } => source,
            other => redis::RedisError::from(std::io::Error::other(other.to_string())),
        })
    }

    /// A `redis::Client` for the node to subscribe on: the server (standalone), the
    /// `attempt`-th seed node round robin (Cluster: a plain `PUBLISH` reaches every node), or
    /// the current master (Sentinel: asked of the sentinels).
    ///
    /// Errors: the redis crate's; with Sentinel, no sentinel answering within
    /// [`sentinel::RESOLVE_TIMEOUT`].
    pub async fn pubsub_client(&self, attempt: usize) -> redis::RedisResult<redis::Client> {
        match &self.kind {
            ClientKind::Standalone(client) => Ok((**client).clone()),
            ClientKind::Cluster { .. } => {
                let urls = self.config.urls();
                let url = &urls[attempt % urls.len()];
                node_client(url, &self.config, &self.certs).map_err(|e| match e {
                    ConnectError::InvalidUrl { source, .. } => source,
                    other => redis::RedisError::from(std::io::Error::other(other.to_string())),
                })
            }
            ClientKind::Sentinel(resolver) => resolver.master().await,
        }
    }
}

/// Makes ring the process's rustls crypto provider unless one is installed already. rustls picks
/// one by itself only when exactly one provider feature is built in; when another crate of the
/// binary enables a second one (aws-lc-rs), every TLS connection would panic without this.
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Err: another thread installed one meanwhile, which is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// Reads the TLS files into the redis crate's certificates, checking what can be checked
/// before connecting.
fn read_certificates(files: &TlsFiles) -> Result<TlsCertificates, ConnectError> {
    let read = |path: &std::path::Path, what: &str, marker: &str| -> Result<Vec<u8>, ConnectError> {
        let bytes = std::fs::read(path)
            .map_err(|e| ConnectError::TlsConfig(format!("cannot read the {what} file {}: {e}", path.display())))?;
        if !String::from_utf8_lossy(&bytes).contains(marker) {
            return Err(ConnectError::TlsConfig(format!(
                "{} holds no PEM {what} (expected a \"-----BEGIN {marker}\" block)",
                path.display()
            )));
        }
        Ok(bytes)
    };
    // Each file is parsed on its own (the redis crate parses on connect, and its messages name
    // no file): bad PEM is a configuration error that says which file.
    let parse = |certs: TlsCertificates| redis::Client::build_with_tls("rediss://localhost", certs).map(|_| ());
    let root_cert = match &files.ca {
        Some(path) => {
            let pem = read(path, "CA certificate", "CERTIFICATE-----")?;
            parse(TlsCertificates { client_tls: None, root_cert: Some(pem.clone()) }).map_err(|e| {
                ConnectError::TlsConfig(format!("the CA certificate file {} cannot be parsed: {e}", path.display()))
            })?;
            Some(pem)
        }
        None => None,
    };
    let client_tls = match (&files.client_cert, &files.client_key) {
        (Some(cert), Some(key)) => {
            let tls = ClientTlsConfig {
                client_cert: read(cert, "client certificate", "CERTIFICATE-----")?,
                client_key: read(key, "private key", "PRIVATE KEY-----")?,
            };
            parse(TlsCertificates { client_tls: Some(tls.clone()), root_cert: None }).map_err(|e| {
                // The redis crate's message says which of the two it could not use.
                let (what, path) = if e.to_string().contains("private key") {
                    ("private key file", key)
                } else {
                    ("client certificate file", cert)
                };
                ConnectError::TlsConfig(format!("the {what} {} cannot be parsed: {e}", path.display()))
            })?;
            Some(tls)
        }
        (None, None) => None,
        (Some(cert), None) => {
            return Err(ConnectError::TlsConfig(format!(
                "the client certificate {} is given without its private key file",
                cert.display()
            )))
        }
        (None, Some(key)) => {
            return Err(ConnectError::TlsConfig(format!(
                "the private key {} is given without its client certificate file",
                key.display()
            )))
        }
    };
    let certs = TlsCertificates { client_tls, root_cert };
    Ok(certs)
}

/// A client for `url` with the configuration's credentials and TLS material.
fn node_client(
    url: &str,
    config: &RedisConfig,
    certs: &Option<TlsCertificates>,
) -> Result<redis::Client, ConnectError> {
    let invalid = |source| ConnectError::InvalidUrl { url: redact_url(url), source };
    let info = url.into_connection_info().map_err(invalid)?;
    let mut settings = info.redis_settings().clone();
    if let Some(u) = &config.username {
        settings = settings.set_username(u);
    }
    if let Some(p) = &config.password {
        settings = settings.set_password(p);
    }
    let info = info.set_redis_settings(settings);
    match certs {
        Some(c) => redis::Client::build_with_tls(info, c.clone()).map_err(invalid),
        None => redis::Client::open(info).map_err(invalid),
    }
}

/// `seed` (`redis[s]://[user:pass@]host:port[/db]`) with its host and port replaced (scheme and
/// credentials kept, the database dropped: Cluster nodes have only database 0). An empty `host`
/// or `?` (a Cluster node that does not know its own address) keeps the seed's host.
pub fn node_url(seed: &str, host: &str, port: u16) -> String {
    let (scheme, rest) = seed.split_once("://").unwrap_or(("redis", seed));
    let authority = rest.split('/').next().unwrap_or("");
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), authority),
    };
    let host = if host.is_empty() || host == "?" {
        match hostport.rsplit_once(':') {
            Some((h, _)) => h.to_string(),
            None => hostport.to_string(),
        }
    } else if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    format!("{scheme}://{userinfo}{host}:{port}")
}

#[cfg(test)]
mod node_url_tests {
    use super::node_url;

    #[test]
    fn node_urls() {
        assert_eq!(node_url("redis://127.0.0.1:7000", "127.0.0.1", 7001), "redis://127.0.0.1:7001");
        assert_eq!(node_url("redis://u:p@h:1/0", "", 7002), "redis://u:p@h:7002");
        assert_eq!(node_url("rediss://u:p@h:1", "?", 7003), "rediss://u:p@h:7003");
        assert_eq!(node_url("rediss://h:1", "::1", 7004), "rediss://[::1]:7004");
    }
}

/// Connections of their own for writes acknowledged only once replicas hold them
/// ([`Durability`]). `WAIT` blocks the connection it is sent on until the replicas confirm (up
/// to its timeout): on the shared connection it would hold up every other command of the
/// process behind it. These [`DurableWriter::CONNECTIONS`] connections carry only such writes,
/// each followed by its `WAIT` in one pipeline; the writes of one script under one key (a
/// queue's submits, a stream's appends) always use the same connection. Cheap to clone.
#[derive(Clone)]
pub struct DurableWriter {
    conns: std::sync::Arc<[RedisConn]>,
    durability: Durability,
}

impl DurableWriter {
    /// Connections per client: 8 (at most this many writes wait for replicas at once; the
    /// group commits put many writes of one key in each).
    pub const CONNECTIONS: usize = 8;

    /// The durability the writes wait for.
    pub fn durability(&self) -> Durability {
        self.durability
    }

    /// Sends `cmd`, an `EVALSHA` of `script` writing under `key`, on `key`'s connection and waits
    /// for the replicas ([`LuaScript::query_durable`]). Errors: as that function.
    pub async fn query<T: redis::FromRedisValue>(
        &self,
        script: &LuaScript,
        key: &str,
        cmd: &Cmd,
    ) -> redis::RedisResult<T> {
        // One connection per script and key: a key's writes of one kind keep their order, and
        // different kinds (a queue's submits and its transitions) do not wait behind each
        // other's WAIT.
        let i = script
            .name()
            .bytes()
            .chain([0])
            .chain(key.bytes())
            .fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize))
            % self.conns.len();
        let mut conn = self.conns[i].clone();
        script.query_durable(&mut conn, cmd, Some(self.durability)).await
    }
}

/// A connection to a standalone server: the redis crate's `ConnectionManager` (which reconnects
/// after I/O errors), replaced by a fresh one when its reconnect was refused at login
/// (`WRONGPASS`, e.g. while a password is being rotated on the server): the manager itself
/// keeps returning that failed reconnect forever, even once the login works again. With the
/// new manager the next call connects afresh. Clones share the connection.
#[derive(Clone)]
pub struct StandaloneConn {
    inner: std::sync::Arc<StandaloneInner>,
}

struct StandaloneInner {
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// The manager in use and its generation (bumped on every replacement).
    current: std::sync::Mutex<(u64, ConnectionManager)>,
}

impl StandaloneConn {
    /// Connects to the server of `client` now (a `ConnectionManager` with `config`).
    ///
    /// Errors: the redis crate's, when the first connection fails.
    pub async fn connect(client: redis::Client, config: ConnectionManagerConfig) -> redis::RedisResult<Self> {
        let mgr = ConnectionManager::new_with_config(client.clone(), config.clone()).await?;
        Ok(Self {
            inner: std::sync::Arc::new(StandaloneInner { client, config, current: std::sync::Mutex::new((0, mgr)) }),
        })
    }

    fn current(&self) -> (u64, ConnectionManager) {
        let cur = self.inner.current.lock().unwrap_or_else(|p| p.into_inner());
        (cur.0, cur.1.clone())
    }

    /// After an error on manager `generation`: a refused login replaces it (once per generation).
    fn settle<T>(&self, generation: u64, r: &redis::RedisResult<T>) {
        let Err(e) = r else { return };
        if !(e.kind() == redis::ErrorKind::AuthenticationFailed || e.code() == Some("WRONGPASS")) {
            return;
        }
        let mut cur = self.inner.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur.0 != generation {
            return;
        }
        match ConnectionManager::new_lazy_with_config(self.inner.client.clone(), self.inner.config.clone()) {
            Ok(mgr) => {
                *cur = (generation + 1, mgr);
                tracing::info!("Redis refused the login ({e}); the next call connects again");
            }
            Err(e2) => tracing::warn!("cannot make a new Redis connection manager: {e2}"),
        }
    }
}

impl ConnectionLike for StandaloneConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut mgr) = self.current();
            let r = mgr.req_packed_command(cmd).await;
            self.settle(generation, &r);
            r
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, mut mgr) = self.current();
            let r = mgr.req_packed_commands(pipeline, offset, count).await;
            self.settle(generation, &r);
            r
        })
    }

    fn get_db(&self) -> i64 {
        self.current().1.get_db()
    }
}

/// One connection to Redis: standalone ([`StandaloneConn`]), Cluster ([`ClusterConn`]) or the
/// master of a Sentinel deployment ([`SentinelConn`]). All reconnect after a server restart
/// (Cluster and Sentinel: also after a failover). Implements `redis::aio::ConnectionLike`.
#[derive(Clone)]
pub enum RedisConn {
    Standalone(StandaloneConn),
    Cluster(ClusterConn),
    Sentinel(SentinelConn),
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Standalone(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
            RedisConn::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Standalone(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConn::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Standalone(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
            RedisConn::Sentinel(c) => c.get_db(),
        }
    }
}

/// A Lua script kept in a `.lua` file and run with EVALSHA (SCRIPT LOAD and retry on NOSCRIPT,
/// e.g. after a Redis restart flushed the script cache).
///
/// See the crate docs for an example.
pub struct LuaScript {
    name: &'static str,
    parts: Parts,
    script: std::sync::OnceLock<redis::Script>,
}

/// A script's text: one piece, or pieces run as one script in this order (e.g. another crate's
/// shared functions, given as its public constant, then the script itself).
enum Parts {
    One(&'static str),
    Many(&'static [&'static str]),
}

impl LuaScript {
    /// `name` is used in error messages; `source` is the script text.
    pub const fn new(name: &'static str, source: &'static str) -> Self {
        Self { name, parts: Parts::One(source), script: std::sync::OnceLock::new() }
    }

    /// A script whose text is `parts` joined in order: shared Lua functions first (such as
    /// `baton_queue::keys::CAPS_LUA`, without reaching into another crate's files), then the
    /// script. `name` is used in error messages.
    pub const fn from_parts(name: &'static str, parts: &'static [&'static str]) -> Self {
        Self { name, parts: Parts::Many(parts), script: std::sync::OnceLock::new() }
    }

    /// The script's name as given to [`LuaScript::new`].
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The `redis::Script` (computes the SHA1 once).
    pub fn script(&self) -> &redis::Script {
        self.script.get_or_init(|| match self.parts {
            Parts::One(source) => redis::Script::new(source),
            Parts::Many(parts) => redis::Script::new(&parts.concat()),
        })
    }

    /// Starts `EVALSHA <sha1> <numkeys>` for this script. The caller then writes exactly
    /// `numkeys` keys (`KEYS`), then the arguments (`ARGV`), with `Cmd::arg`, and sends the
    /// command with [`LuaScript::query`] (which handles `NOSCRIPT`). Nothing is copied on the way:
    /// keys and arguments go straight into the command's one buffer.
    pub fn evalsha_cmd(&self, numkeys: usize) -> Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.script().get_hash()).arg(numkeys);
        cmd
    }

    /// [`LuaScript::evalsha_cmd`] on a command sized up front (`Cmd::with_capacity`), so that
    /// writing the keys and arguments never regrows it. `arg_count` and `size_of_data` are the
    /// capacities of the whole command, the `EVALSHA <sha1> <numkeys>` head included (3
    /// arguments, at most 7 + 40 + 20 bytes).
    pub fn evalsha_cmd_with_capacity(&self, numkeys: usize, arg_count: usize, size_of_data: usize) -> Cmd {
        let mut cmd = Cmd::with_capacity(arg_count, size_of_data);
        cmd.arg("EVALSHA").arg(self.script().get_hash()).arg(numkeys);
        cmd
    }

    /// Sends `cmd`, an `EVALSHA` of this script built with [`LuaScript::evalsha_cmd`] (or
    /// [`LuaScript::evalsha_cmd_with_capacity`]), on `conn` and converts the reply. On `NOSCRIPT`
    /// (the server's script cache does not hold the script, e.g. after a restart or a Cluster
    /// failover) it loads the script (`SCRIPT LOAD`) on `conn` and sends `cmd` once more; any
    /// other error, including one from the load or the retry, is returned as is.
    ///
    /// The script runs at most once per call here: a `NOSCRIPT` reply means it did not run. (On
    /// Cluster the redis crate itself may send a call again after a dropped connection; a
    /// script that must not apply twice is guarded, [`resend`].)
    pub async fn query<T, C>(&self, conn: &mut C, cmd: &Cmd) -> redis::RedisResult<T>
    where
        T: redis::FromRedisValue,
        C: ConnectionLike,
    {
        debug_assert!(
            matches!(cmd.args_iter().nth(1), Some(redis::Arg::Simple(sha)) if sha == self.script().get_hash().as_bytes()),
            "LuaScript::query({}): the command is not an EVALSHA of this script",
            self.name
        );
        match cmd.query_async(conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.script().load_async(conn).await?;
                cmd.query_async(conn).await
            }
            r => r,
        }
    }

    /// [`LuaScript::query`] for a write that must reach `durability.replicas` replicas before it
    /// is acknowledged: `cmd` and `WAIT replicas timeout_ms` go together in one pipeline (one
    /// round trip, on the connection, and in Cluster the node, that runs `cmd`). Without
    /// `durability` it is [`LuaScript::query`].
    ///
    /// Errors: as [`LuaScript::query`]; and when fewer replicas confirm in time, an error of
    /// kind `Client` saying the write was applied on the master but is not known to be on
    /// enough replicas ([`is_not_replicated`]).
    pub async fn query_durable<T, C>(
        &self,
        conn: &mut C,
        cmd: &Cmd,
        durability: Option<Durability>,
    ) -> redis::RedisResult<T>
    where
        T: redis::FromRedisValue,
        C: ConnectionLike,
    {
        let Some(d) = durability else { return self.query(conn, cmd).await };
        let mut pipe = redis::pipe();
        pipe.add_command(cmd.clone());
        pipe.cmd("WAIT").arg(d.replicas).arg(d.timeout.as_millis() as u64);
        let mut loaded = false;
        loop {
            let mut replies = conn.req_packed_commands(&pipe, 0, 2).await?;
            let (reply, waited) = match (replies.pop(), replies.pop()) {
                (Some(waited), Some(reply)) => (reply, waited),
                _ => {
                    return Err(redis::RedisError::from((
                        redis::ErrorKind::Parse,
                        "a write and its WAIT: expected two replies",
                    )))
                }
            };
            let reply = match reply {
                Value::ServerError(e) => {
                    let e: redis::RedisError = e.into();
                    if !loaded && e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) {
                        self.script().load_async(conn).await?;
                        loaded = true;
                        continue;
                    }
                    return Err(e);
                }
                v => v,
            };
            let confirmed = match waited {
                Value::Int(n) => n,
                Value::ServerError(e) => return Err(e.into()),
                other => {
                    return Err(redis::RedisError::from((
                        redis::ErrorKind::Parse,
                        "WAIT: unexpected reply",
                        format!("{other:?}"),
                    )))
                }
            };
            if confirmed < d.replicas as i64 {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Client,
                    NOT_REPLICATED,
                    format!(
                        "{} of {} replica(s) confirmed within {:?}; the write was applied on the master and may be \
                         lost if it fails over now (retrying is safe for idempotent writes)",
                        confirmed, d.replicas, d.timeout
                    ),
                )));
            }
            return Ok(redis::from_redis_value(reply)?);
        }
    }

    /// Runs the script with `keys` and `args` on `conn` and converts the reply: an
    /// [`LuaScript::evalsha_cmd`] holding `keys` then `args`, sent with [`LuaScript::query`].
    pub async fn run<T: redis::FromRedisValue>(
        &self,
        conn: &mut RedisConn,
        keys: &[&str],
        args: &[&dyn ArgLike],
    ) -> redis::RedisResult<T> {
        let mut cmd = self.evalsha_cmd(keys.len());
        for k in keys {
            cmd.arg(*k);
        }
        for a in args {
            a.push(&mut cmd);
        }
        self.query(conn, &cmd).await
    }
}

impl LuaScript {
    /// [`LuaScript::run`] for a script that only reads: when the connection turns out to be
    /// dead (a dropped connection, e.g. after a Redis restart: the shared connection notices it
    /// only when it sends), the call is sent once more on the reconnected connection. Safe only
    /// for scripts that write nothing (they may have run before the connection dropped);
    /// anything else is returned as is.
    pub async fn run_read<T: redis::FromRedisValue>(
        &self,
        conn: &mut RedisConn,
        keys: &[&str],
        args: &[&dyn ArgLike],
    ) -> redis::RedisResult<T> {
        match self.run(conn, keys, args).await {
            Err(e) if e.is_connection_dropped() || e.is_io_error() => self.run(conn, keys, args).await,
            r => r,
        }
    }
}

/// Something that can be passed as one ARGV element to [`LuaScript::run`].
pub trait ArgLike: Sync {
    /// Writes the value into `cmd` (as `Cmd::arg` does).
    fn push(&self, cmd: &mut Cmd);
}

impl<T: redis::ToRedisArgs + Sync> ArgLike for T {
    fn push(&self, cmd: &mut Cmd) {
        cmd.arg(self);
    }
}

#[cfg(test)]
mod lua_script_tests {
    use super::LuaScript;

    static DUMMY: LuaScript = LuaScript::new("dummy", "return KEYS[1]");

    #[test]
    fn evalsha_cmd_packs_what_redis_script_invocation_packs() {
        // The bytes of `redis::Script::new("return KEYS[1]").key("dummy")` (from the redis
        // crate's own test of `ScriptInvocation`).
        let expected =
            "*4\r\n$7\r\nEVALSHA\r\n$40\r\n4a2267357833227dd98abdedb8cf24b15a986445\r\n$1\r\n1\r\n$5\r\ndummy\r\n";
        let mut cmd = DUMMY.evalsha_cmd(1);
        cmd.arg("dummy");
        assert_eq!(std::str::from_utf8(&cmd.get_packed_command()).unwrap(), expected);
        let mut sized = DUMMY.evalsha_cmd_with_capacity(1, 4, 128);
        sized.arg("dummy");
        assert_eq!(sized.get_packed_command(), cmd.get_packed_command());
    }
}

const NOT_REPLICATED: &str = "write not confirmed by enough replicas";

/// True for the error of [`LuaScript::query_durable`] when too few replicas confirmed a write.
pub fn is_not_replicated(err: &redis::RedisError) -> bool {
    err.kind() == redis::ErrorKind::Client && err.to_string().contains(NOT_REPLICATED)
}

/// True when a Redis error is the `NOGROUP` error (the stream key or its consumer group is
/// missing, e.g. after a restart without persistence).
pub fn is_nogroup(err: &redis::RedisError) -> bool {
    err.code() == Some("NOGROUP") || err.to_string().contains("NOGROUP")
}

/// True when a Redis error means "try again soon": connection dropped or refused, timeout,
/// Cluster resharding (`TRYAGAIN`, `CLUSTERDOWN`), the server still loading its data, or a
/// Cluster connection that has no connection to the slot's node for now (the redis crate's
/// `ClusterConnectionNotFound`, "No connections found": it reconnects, and a connection that
/// stays so is replaced, see `ClusterConn`).
pub fn is_transient(err: &redis::RedisError) -> bool {
    err.is_io_error()
        || err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.kind() == redis::ErrorKind::ClusterConnectionNotFound
        || matches!(err.code(), Some("TRYAGAIN" | "CLUSTERDOWN" | "LOADING" | "MASTERDOWN"))
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag (or of the whole key when it
/// has no non-empty `{…}`) mod 16384 (Cluster specification, "Keys distribution model").
pub fn key_slot(key: &[u8]) -> u16 {
    let mut k = key;
    if let Some(open) = key.iter().position(|&b| b == b'{') {
        if let Some(len) = key[open + 1..].iter().position(|&b| b == b'}') {
            if len > 0 {
                k = &key[open + 1..open + 1 + len];
            }
        }
    }
    let mut crc: u16 = 0;
    for &b in k {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc % 16384
}

#[cfg(test)]
mod is_transient_tests {
    use super::is_transient;
    use redis::{ErrorKind, RedisError};

    #[test]
    fn a_cluster_connection_not_found_is_transient() {
        // What the redis crate's Cluster connection answers when it holds no connection to the
        // slot's node (`cluster_handling/async_connection`).
        let e = RedisError::from((ErrorKind::ClusterConnectionNotFound, "No connections found"));
        assert!(is_transient(&e), "{e}");
        assert!(is_transient(&RedisError::from((ErrorKind::Io, "dropped"))));
        assert!(!is_transient(&RedisError::from((ErrorKind::Client, "bad call"))));
    }
}

#[cfg(test)]
mod key_slot_tests {
    use super::key_slot;

    #[test]
    fn matches_the_cluster_specification() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(key_slot(b"123456789"), 0x31C3); // CRC16/XMODEM check value
        assert_eq!(key_slot(b"somekey"), 11058);
        assert_eq!(key_slot(b"foo{hash_tag}"), 2515);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo"), 12182);
    }
}
