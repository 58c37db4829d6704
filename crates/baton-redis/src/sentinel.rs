//! Connections to the master of a Redis Sentinel deployment that follow it across failovers.
//!
//! A [`SentinelConn`] holds one multiplexed connection to the master the sentinels named when it
//! connected. It drops that connection, and asks the sentinels again on the next call, when the
//! connection fails in a way a failover causes:
//! * I/O errors, a dropped connection, a response timeout (a master that died, or hangs: a
//!   SIGSTOPped master is failed over by the sentinels while its socket stays open);
//! * `READONLY` (the node was demoted to a replica), `MASTERDOWN`, `UNBLOCKED` (a blocked command
//!   cut short by the demotion);
//! * a call abandoned by its caller before the reply came (e.g. a blocking read bounded by the
//!   caller's own timeout): the node did not answer in time.
//!
//! The call that sees the failure returns its error (the caller decides whether to retry: a
//! write may or may not have been applied); the next call goes to the new master. Sentinel's
//! own reconfiguration also closes the old master's clients (`CLIENT KILL TYPE normal`), which
//! this notices as a dropped connection.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};

/// Longest time asking the sentinels for the master and connecting to it may take: 5 s.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// The sentinels, asked for the current master. Shared by every connection of one client.
pub(crate) struct Resolver {
    client: tokio::sync::Mutex<SentinelClient>,
}

impl Resolver {
    pub(crate) fn new(client: SentinelClient) -> Self {
        Self { client: tokio::sync::Mutex::new(client) }
    }

    /// A client for the current master (checked with `ROLE` by the redis crate).
    pub(crate) async fn master(&self) -> RedisResult<redis::Client> {
        // Boxed as a trait object: the redis crate's Sentinel futures nest deeply, and every
        // async caller up to `main` would otherwise need a higher `recursion_limit`.
        let ask: std::pin::Pin<Box<dyn std::future::Future<Output = RedisResult<redis::Client>> + Send + '_>> =
            Box::pin(async { self.client.lock().await.async_get_client().await });
        match tokio::time::timeout(RESOLVE_TIMEOUT, ask).await {
            Ok(r) => r,
            Err(_) => Err(timed_out("asking the sentinels for the master")),
        }
    }
}

fn timed_out(what: &str) -> RedisError {
    RedisError::from(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{what} took over {RESOLVE_TIMEOUT:?}")))
}

/// A connection to the current master of a Sentinel deployment; see the module docs. Clones
/// share the connection.
#[derive(Clone)]
pub struct SentinelConn {
    resolver: Arc<Resolver>,
    config: AsyncConnectionConfig,
    state: Arc<State>,
}

struct State {
    /// The connection in use and its generation (bumped on every new connection).
    current: Mutex<(u64, Option<MultiplexedConnection>)>,
    /// Held while connecting, so that callers who find no connection make one between them.
    connecting: tokio::sync::Mutex<()>,
}

impl SentinelConn {
    /// Connects to the current master now (so that a wrong configuration shows at startup).
    pub(crate) async fn connect(resolver: Arc<Resolver>, config: AsyncConnectionConfig) -> RedisResult<Self> {
        let conn = Self {
            resolver,
            config,
            state: Arc::new(State { current: Mutex::new((0, None)), connecting: tokio::sync::Mutex::new(()) }),
        };
        conn.get().await?;
        Ok(conn)
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        let cur = self.state.current.lock().unwrap_or_else(|p| p.into_inner());
        cur.1.clone().map(|c| (cur.0, c))
    }

    async fn get(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let _one = self.state.connecting.lock().await;
        if let Some(c) = self.current() {
            return Ok(c);
        }
        let client = self.resolver.master().await?;
        let conn = match tokio::time::timeout(
            RESOLVE_TIMEOUT,
            client.get_multiplexed_async_connection_with_config(&self.config),
        )
        .await
        {
            Ok(r) => r?,
            Err(_) => return Err(timed_out("connecting to the master")),
        };
        let mut cur = self.state.current.lock().unwrap_or_else(|p| p.into_inner());
        cur.0 += 1;
        cur.1 = Some(conn.clone());
        tracing::debug!(generation = cur.0, "connected to the Sentinel master");
        Ok((cur.0, conn))
    }

    /// Forgets connection `generation` (if still the current one): the next call reconnects.
    fn drop_connection(&self, generation: u64) {
        let mut cur = self.state.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur.0 == generation && cur.1.is_some() {
            cur.1 = None;
            tracing::info!("connection to the Sentinel master lost; asking the sentinels again on the next call");
        }
    }

    /// Notes the outcome of a call on connection `generation`: errors that mean a failover
    /// drop it.
    fn settle<T>(&self, generation: u64, r: &RedisResult<T>) {
        if let Err(e) = r {
            if means_failover(e) {
                self.drop_connection(generation);
            }
        }
    }
}

/// Drops the connection when a call is abandoned before its reply arrived.
struct Abandoned<'a> {
    conn: &'a SentinelConn,
    generation: u64,
    armed: bool,
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.conn.drop_connection(self.generation);
        }
    }
}

/// True for the errors that a master's failover, death or demotion causes.
pub(crate) fn means_failover(e: &RedisError) -> bool {
    if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() || e.is_connection_refusal() {
        return true;
    }
    if matches!(e.code(), Some("READONLY" | "MASTERDOWN" | "UNBLOCKED")) {
        return true;
    }
    // A write inside a script on a replica: the code is in the message.
    let text = e.to_string();
    text.contains("READONLY") || text.contains("UNBLOCKED")
}

impl ConnectionLike for SentinelConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut conn) = self.get().await?;
            let mut guard = Abandoned { conn: self, generation, armed: true };
            let r = conn.req_packed_command(cmd).await;
            guard.armed = false;
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
            let (generation, mut conn) = self.get().await?;
            let mut guard = Abandoned { conn: self, generation, armed: true };
            let r = conn.req_packed_commands(pipeline, offset, count).await;
            guard.armed = false;
            self.settle(generation, &r);
            r
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}
