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
//! ```no_run
//! use baton_redis::{redis, LuaScript, RedisClient, RedisConfig};
//!
//! // In a crate: `LuaScript::new("incr_by", include_str!("../scripts/incr_by.lua"))`.
//! static INCR_BY: LuaScript = LuaScript::new("incr_by", "return redis.call('INCRBY', KEYS[1], ARGV[1])");
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let client = RedisClient::new(RedisConfig::Standalone("redis://127.0.0.1:6379".into()))?;
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

pub mod group_commit;
mod scan;

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

pub use redis;
pub use scan::KeyScan;

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
    #[error("cannot connect to {target}: {source}")]
    Unreachable {
        /// What could not be reached, e.g. `Redis at redis://127.0.0.1:6379` or
        /// `Redis Cluster at redis://127.0.0.1:7000,redis://127.0.0.1:7001`.
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
                    let mut b = ClusterClient::builder(urls.clone()).connection_timeout(CONNECTION_TIMEOUT);
                    if let Some(t) = timeout {
                        b = b.response_timeout(t);
                    }
                    b.build().map_err(|source| ConnectError::InvalidUrl { url: urls.join(","), source })
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
        let target = match &self.config {
            RedisConfig::Standalone(url) => format!("Redis at {url}"),
            RedisConfig::Cluster(urls) => format!("Redis Cluster at {}", urls.join(",")),
        };
        let unreachable = |source| ConnectError::Unreachable { target: target.clone(), source };
        match &self.kind {
            ClientKind::Standalone(client) => {
                let cfg = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(CONNECTION_TIMEOUT))
                    .set_response_timeout(response_timeout)
                    .set_number_of_retries(3)
                    .set_max_delay(Duration::from_secs(1));
                let mgr = ConnectionManager::new_with_config(client.clone(), cfg).await.map_err(unreachable)?;
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
    /// The script runs at most once per call: a `NOSCRIPT` reply means it did not run.
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
