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
//! * the sentinels announcing a new master (`+switch-master`, which a task of the client
//!   follows on one sentinel at a time): after a manual failover (`SENTINEL FAILOVER`) the old
//!   master stays a master, taking writes that are lost when the sentinels turn it into a
//!   replica about 8 s later; the next call goes to the announced master instead.
//!
//! The call that sees the failure returns its error (the caller decides whether to retry: a
//! write may or may not have been applied); the next call goes to the new master. Sentinel's
//! own reconfiguration also closes the old master's clients (`CLIENT KILL TYPE normal`), which
//! this notices as a dropped connection.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};

/// Longest time asking the sentinels for the master and connecting to it may take: 5 s.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Builds a client for the data node at `host:port` (scheme, credentials and TLS of the
/// configuration).
pub(crate) type NodeClientFn = dyn Fn(&str, u16) -> RedisResult<redis::Client> + Send + Sync;

/// The sentinels, asked for the current master. Shared by every connection of one client.
pub(crate) struct Resolver {
    client: tokio::sync::Mutex<SentinelClient>,
    /// The master's name (`sentinel monitor <name> …`).
    master: String,
    /// One client per sentinel, for the `+switch-master` subscription.
    sentinels: Vec<redis::Client>,
    node_client: Box<NodeClientFn>,
    switches: Arc<Switches>,
    /// The task following `+switch-master` (started by the first connection, in its runtime).
    watcher: Mutex<Option<tokio::task::AbortHandle>>,
}

/// What the sentinels announced: how many switches of the master so far, and the last address.
#[derive(Default)]
struct Switches {
    count: AtomicU64,
    /// The master the last `+switch-master` named, until a connection has used it.
    announced: Mutex<Option<(String, u16)>>,
}

impl Resolver {
    pub(crate) fn new(
        client: SentinelClient,
        master: String,
        sentinels: Vec<redis::Client>,
        node_client: Box<NodeClientFn>,
    ) -> Self {
        Self {
            client: tokio::sync::Mutex::new(client),
            master,
            sentinels,
            node_client,
            switches: Arc::new(Switches::default()),
            watcher: Mutex::new(None),
        }
    }

    /// How many `+switch-master` events for this master were seen so far.
    fn switches(&self) -> u64 {
        self.switches.count.load(Ordering::SeqCst)
    }

    /// Starts the `+switch-master` task in the current Tokio runtime unless one is running.
    pub(crate) fn watch(&self) {
        let mut watcher = self.watcher.lock().unwrap_or_else(|p| p.into_inner());
        if watcher.as_ref().is_some_and(|w| !w.is_finished()) || self.sentinels.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let task = follow_switches(self.sentinels.clone(), self.master.clone(), self.switches.clone());
        *watcher = Some(runtime.spawn(task).abort_handle());
    }

    /// A client for the current master: the one the sentinels last announced (`+switch-master`)
    /// if it answers `ROLE` as a master, else the one the sentinels name now (checked with
    /// `ROLE` by the redis crate).
    pub(crate) async fn master(&self) -> RedisResult<redis::Client> {
        let announced = self.switches.announced.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some((host, port)) = announced {
            match self.announced_master(&host, port).await {
                Ok(client) => return Ok(client),
                Err(e) => {
                    tracing::info!(%host, port, "the announced Sentinel master is not usable ({e}); asking the sentinels")
                }
            }
        }
        // Boxed as a trait object: the redis crate's Sentinel futures nest deeply, and every
        // async caller up to `main` would otherwise need a higher `recursion_limit`.
        let ask: std::pin::Pin<Box<dyn std::future::Future<Output = RedisResult<redis::Client>> + Send + '_>> =
            Box::pin(async { self.client.lock().await.async_get_client().await });
        match tokio::time::timeout(RESOLVE_TIMEOUT, ask).await {
            // The crate's words ("master with given name not found") read as a wrong name;
            // during a failover the sentinels name a master that does not answer as one.
            Ok(Err(e)) if e.kind() == redis::ErrorKind::MasterNameNotFoundBySentinel => Err(RedisError::from((
                redis::ErrorKind::MasterNameNotFoundBySentinel,
                "no reachable master",
                format!(
                    "the sentinels name no reachable master {:?} (a failover in progress, or a wrong master \
                     name): {e}",
                    self.master
                ),
            ))),
            Ok(r) => r,
            Err(_) => Err(timed_out("asking the sentinels for the master")),
        }
    }

    /// A client for `host:port` if that node says it is a master (`ROLE`).
    async fn announced_master(&self, host: &str, port: u16) -> RedisResult<redis::Client> {
        let client = (self.node_client)(host, port)?;
        let check = async {
            let mut conn = client.get_multiplexed_async_connection().await?;
            let role: Vec<Value> = redis::cmd("ROLE").query_async(&mut conn).await?;
            match role.first() {
                Some(Value::BulkString(r)) if r == b"master" => Ok(()),
                other => Err(RedisError::from(std::io::Error::other(format!("ROLE is {other:?}")))),
            }
        };
        match tokio::time::timeout(RESOLVE_TIMEOUT, check).await {
            Ok(r) => r.map(|()| client),
            Err(_) => Err(timed_out("checking the announced master")),
        }
    }
}

impl Drop for Resolver {
    fn drop(&mut self) {
        if let Some(w) = self.watcher.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            w.abort();
        }
    }
}

/// Pause before subscribing again after a sentinel was lost: 500 ms.
const RESUBSCRIBE_DELAY: Duration = Duration::from_millis(500);
/// How often the subscription is checked with a PING (a sentinel that hangs sends nothing): 5 s.
const SUBSCRIPTION_PING: Duration = Duration::from_secs(5);

/// Subscribes to `+switch-master` on the sentinels, one at a time (the next one when the
/// current one is lost or does not answer a PING within 2 s), and notes every switch of
/// `master` in `switches`. Runs until aborted.
async fn follow_switches(sentinels: Vec<redis::Client>, master: String, switches: Arc<Switches>) {
    use futures::StreamExt;
    for i in 0.. {
        let sentinel = &sentinels[i % sentinels.len()];
        let subscribed = tokio::time::timeout(RESOLVE_TIMEOUT, async {
            let mut pubsub = sentinel.get_async_pubsub().await?;
            pubsub.subscribe("+switch-master").await?;
            RedisResult::Ok(pubsub.split())
        })
        .await;
        let (mut sink, mut stream) = match subscribed {
            Ok(Ok(parts)) => parts,
            Ok(Err(e)) => {
                tracing::debug!(sentinel = i % sentinels.len(), "cannot subscribe to +switch-master: {e}");
                tokio::time::sleep(RESUBSCRIBE_DELAY).await;
                continue;
            }
            Err(_) => continue,
        };
        let mut ping = tokio::time::interval(SUBSCRIPTION_PING);
        ping.tick().await;
        loop {
            tokio::select! {
                msg = stream.next() => {
                    let Some(msg) = msg else { break };
                    // "<name> <old ip> <old port> <new ip> <new port>"
                    let payload: String = msg.get_payload().unwrap_or_default();
                    let f: Vec<&str> = payload.split(' ').collect();
                    if f.len() == 5 && f[0] == master {
                        if let Ok(port) = f[4].parse::<u16>() {
                            *switches.announced.lock().unwrap_or_else(|p| p.into_inner()) = Some((f[3].to_string(), port));
                            switches.count.fetch_add(1, Ordering::SeqCst);
                            tracing::info!(master = %master, "the sentinels switched the master to {}:{port}", f[3]);
                        }
                    }
                }
                _ = ping.tick() => {
                    let pong = tokio::time::timeout(Duration::from_secs(2), sink.ping::<Value>()).await;
                    if !matches!(pong, Ok(Ok(_))) {
                        break;
                    }
                }
            }
        }
        tokio::time::sleep(RESUBSCRIBE_DELAY).await;
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
    /// The connection in use, its generation (bumped on every new connection) and the
    /// resolver's switch count when it was made (a newer count drops it).
    current: Mutex<(u64, Option<MultiplexedConnection>, u64)>,
    /// Held while connecting, so that callers who find no connection make one between them.
    connecting: tokio::sync::Mutex<()>,
}

impl SentinelConn {
    /// Connects to the current master now (so that a wrong configuration shows at startup).
    pub(crate) async fn connect(resolver: Arc<Resolver>, config: AsyncConnectionConfig) -> RedisResult<Self> {
        let conn = Self {
            resolver,
            config,
            state: Arc::new(State { current: Mutex::new((0, None, 0)), connecting: tokio::sync::Mutex::new(()) }),
        };
        conn.resolver.watch();
        conn.get().await?;
        Ok(conn)
    }

    fn current(&self) -> Option<(u64, MultiplexedConnection)> {
        let mut cur = self.state.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur.2 != self.resolver.switches() && cur.1.take().is_some() {
            tracing::info!("the sentinels switched the master; reconnecting");
        }
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
        let switches = self.resolver.switches();
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
        cur.2 = switches;
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
