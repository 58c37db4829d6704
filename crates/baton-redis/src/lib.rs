//! Redis connectivity for Baton, in one place.
//!
//! * [`RedisConfig`] names the deployment: one standalone server (`redis://host:port/db`) or the
//!   seed nodes of a Redis Cluster.
//! * [`RedisClient`] hands out connections to it:
//!   - [`RedisClient::shared`]: a multiplexed connection that reconnects by itself after a Redis
//!     restart (`ConnectionManager` standalone, `ClusterConnection` in Cluster), with a response
//!     timeout of [`DEFAULT_RESPONSE_TIMEOUT`]. Cheap to clone; use it for every non-blocking command.
//!   - [`RedisClient::dedicated`]: a connection of its own with **no** response timeout, for
//!     commands that `BLOCK` (XREADGROUP … BLOCK, XREAD … BLOCK). The redis crate's default 500 ms
//!     response timeout would otherwise cut every block longer than that. Callers bound their own
//!     waits (e.g. `tokio::time::timeout(block + margin)`).
//! * [`RedisConn`] is either kind of connection and implements `redis::aio::ConnectionLike`, so
//!   `redis::cmd(..).query_async(&mut conn)` and `redis::Script::invoke_async` work on both.
//! * [`LuaScript`] wraps `redis::Script` (EVALSHA, falling back to SCRIPT LOAD on NOSCRIPT) for
//!   scripts kept as `.lua` files next to the code that uses them (`include_str!`).
//!
//! Cluster rule (Redis Cluster spec, "Keys hash tags"): every key a script touches is passed in
//! KEYS and all of them share one `{…}` hash tag, so the script runs on one node.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

pub use redis;

/// Response timeout of shared connections: 5 s. A command on a shared connection that gets no
/// reply within it fails with an I/O timeout error (and the connection manager reconnects).
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Time allowed to open one TCP connection to a Redis node: 2 s.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);

/// Errors from connecting to Redis.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL could not be parsed (`redis://[user:pass@]host:port[/db]` expected).
    #[error("invalid Redis URL {url:?}: {source}")]
    InvalidUrl {
        url: String,
        #[source]
        source: redis::RedisError,
    },
    /// A cluster configuration with no node URL.
    #[error("a Redis Cluster configuration needs at least one node URL")]
    NoClusterNodes,
    /// The server could not be reached or refused the connection.
    #[error("cannot connect to Redis at {target}: {source}")]
    Unreachable {
        target: String,
        #[source]
        source: redis::RedisError,
    },
}

/// Where Redis is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RedisConfig {
    /// One standalone server, e.g. `redis://127.0.0.1:6379`.
    Standalone(String),
    /// Seed nodes of a Redis Cluster, e.g. `["redis://127.0.0.1:7000", …]`; the client discovers
    /// the rest of the topology from any of them.
    Cluster(Vec<String>),
}

impl std::fmt::Display for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RedisConfig::Standalone(url) => write!(f, "Redis {url}"),
            RedisConfig::Cluster(urls) => write!(f, "Redis Cluster {}", urls.join(",")),
        }
    }
}

#[derive(Clone)]
enum ClientKind {
    Standalone(redis::Client),
    Cluster { client: Box<ClusterClient>, blocking: Box<ClusterClient> },
}

/// A handle on a Redis deployment (standalone or Cluster). Cheap to clone.
#[derive(Clone)]
pub struct RedisClient {
    kind: ClientKind,
    config: RedisConfig,
}

impl RedisClient {
    /// Validates the configuration and builds a client. Does not connect yet.
    ///
    /// Errors: [`ConnectError::InvalidUrl`], [`ConnectError::NoClusterNodes`].
    pub fn new(config: RedisConfig) -> Result<Self, ConnectError> {
        let kind = match &config {
            RedisConfig::Standalone(url) => ClientKind::Standalone(
                redis::Client::open(url.as_str())
                    .map_err(|source| ConnectError::InvalidUrl { url: url.clone(), source })?,
            ),
            RedisConfig::Cluster(urls) => {
                if urls.is_empty() {
                    return Err(ConnectError::NoClusterNodes);
                }
                for url in urls {
                    redis::Client::open(url.as_str())
                        .map_err(|source| ConnectError::InvalidUrl { url: url.clone(), source })?;
                }
                let build = |timeout: Option<Duration>| {
                    let mut b = ClusterClient::builder(urls.clone())
                        .connection_timeout(CONNECTION_TIMEOUT);
                    if let Some(t) = timeout {
                        b = b.response_timeout(t);
                    }
                    b.build().map_err(|source| ConnectError::InvalidUrl {
                        url: urls.join(","),
                        source,
                    })
                };
                ClientKind::Cluster {
                    client: Box::new(build(Some(DEFAULT_RESPONSE_TIMEOUT))?),
                    blocking: Box::new(build(None)?),
                }
            }
        };
        Ok(Self { kind, config })
    }

    /// The configuration this client was built from.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// True for a Redis Cluster deployment.
    pub fn is_cluster(&self) -> bool {
        matches!(self.kind, ClientKind::Cluster { .. })
    }

    /// A shared, auto-reconnecting, multiplexed connection with a response timeout of
    /// [`DEFAULT_RESPONSE_TIMEOUT`]. Never use it for BLOCK commands.
    ///
    /// Errors: [`ConnectError::Unreachable`] when the first connection fails.
    pub async fn shared(&self) -> Result<RedisConn, ConnectError> {
        self.connect(Some(DEFAULT_RESPONSE_TIMEOUT)).await
    }

    /// A connection of its own with no response timeout, for BLOCK commands. It reconnects by
    /// itself after a Redis restart; callers bound each wait themselves.
    ///
    /// Errors: [`ConnectError::Unreachable`] when the first connection fails.
    pub async fn dedicated(&self) -> Result<RedisConn, ConnectError> {
        self.connect(None).await
    }

    async fn connect(&self, response_timeout: Option<Duration>) -> Result<RedisConn, ConnectError> {
        let unreachable = |source| ConnectError::Unreachable { target: self.config.to_string(), source };
        match &self.kind {
            ClientKind::Standalone(client) => {
                let cfg = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(CONNECTION_TIMEOUT))
                    .set_response_timeout(response_timeout)
                    .set_number_of_retries(3)
                    .set_max_delay(Duration::from_secs(1));
                let mgr = ConnectionManager::new_with_config(client.clone(), cfg)
                    .await
                    .map_err(unreachable)?;
                Ok(RedisConn::Standalone(mgr))
            }
            ClientKind::Cluster { client, blocking } => {
                let c = if response_timeout.is_some() { client } else { blocking };
                let conn = c.get_async_connection().await.map_err(unreachable)?;
                Ok(RedisConn::Cluster(conn))
            }
        }
    }
}

/// One connection to Redis: standalone (`ConnectionManager`) or Cluster (`ClusterConnection`).
/// Both reconnect after a server restart. Implements `redis::aio::ConnectionLike`.
#[derive(Clone)]
pub enum RedisConn {
    Standalone(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Standalone(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
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
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Standalone(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
        }
    }
}

/// A Lua script kept in a `.lua` file and run with EVALSHA (SCRIPT LOAD and retry on NOSCRIPT,
/// e.g. after a Redis restart flushed the script cache).
///
/// ```ignore
/// static ACK: LuaScript = LuaScript::new("ack", include_str!("../scripts/ack.lua"));
/// ```
pub struct LuaScript {
    name: &'static str,
    source: &'static str,
    script: std::sync::OnceLock<redis::Script>,
}

impl LuaScript {
    /// `name` is used in error messages; `source` is the script text.
    pub const fn new(name: &'static str, source: &'static str) -> Self {
        Self { name, source, script: std::sync::OnceLock::new() }
    }

    /// The script's name as given to [`LuaScript::new`].
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The `redis::Script` (computes the SHA1 once).
    pub fn script(&self) -> &redis::Script {
        self.script.get_or_init(|| redis::Script::new(self.source))
    }

    /// Runs the script with `keys` and `args` on `conn` and converts the reply.
    pub async fn run<T: redis::FromRedisValue>(
        &self,
        conn: &mut RedisConn,
        keys: &[&str],
        args: &[&dyn ArgLike],
    ) -> redis::RedisResult<T> {
        let script = self.script();
        let mut inv = script.prepare_invoke();
        for k in keys {
            inv.key(*k);
        }
        for a in args {
            a.push(&mut inv);
        }
        inv.invoke_async(conn).await
    }
}

/// Something that can be passed as one ARGV element to [`LuaScript::run`].
pub trait ArgLike: Sync {
    fn push(&self, inv: &mut redis::ScriptInvocation<'_>);
}

impl<T: redis::ToRedisArgs + Sync> ArgLike for T {
    fn push(&self, inv: &mut redis::ScriptInvocation<'_>) {
        inv.arg(self);
    }
}

/// True when a Redis error is the `NOGROUP` error (the stream key or its consumer group is
/// missing, e.g. after a restart without persistence).
pub fn is_nogroup(err: &redis::RedisError) -> bool {
    err.code() == Some("NOGROUP") || err.to_string().contains("NOGROUP")
}

/// True when a Redis error means "try again soon": connection dropped or refused, timeout,
/// Cluster resharding (`TRYAGAIN`, `CLUSTERDOWN`), or the server still loading its data.
pub fn is_transient(err: &redis::RedisError) -> bool {
    err.is_io_error()
        || err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
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
