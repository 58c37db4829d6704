//! [`ClusterConn`]: the redis crate's Cluster connection, replaced when it is wedged.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};
use tokio::sync::Notify;

/// Longest a call waits for a replacement under way before it is sent on the current
/// connection: 2 s ([`crate::CONNECTION_TIMEOUT`]; a replacement on a healthy cluster takes
/// milliseconds).
const REPLACEMENT_WAIT: Duration = crate::CONNECTION_TIMEOUT;

/// Longest the `CLUSTER SLOTS` and each `PING` of the check of a fresh connection may take
/// ([`better_than`]): 2 s ([`crate::CONNECTION_TIMEOUT`]; milliseconds on a healthy cluster).
const REPLACEMENT_CHECK: Duration = crate::CONNECTION_TIMEOUT;

/// The low bit of `Shared::state`: a replacement is under way.
const REPLACING: u64 = 1;

/// A connection to a Redis Cluster: the redis crate's `ClusterConnection` (which reconnects to
/// nodes and refreshes the slot map by itself), replaced by a fresh one when it is wedged.
///
/// Why: in redis 1.8 the `ClusterConnection`'s task can deadlock for good. Its slot refresh (or
/// reconnect to the seed nodes) waits for the write lock of its map of node connections while it
/// stops polling the calls in flight and the node reconnects; one of those may hold that lock's
/// permits without being polled again (tokio hands permits to a queued waiter on release, and an
/// acquire whose task ran out of its cooperative budget keeps the permits it took and yields), so
/// the refresh never gets the lock. From then on no call is even sent: every call fails with the
/// response timeout, for ever, while a new connection works. A storm of `CLIENT KILL`s on the
/// nodes (hundreds of node connections dropped while calls are in flight) gets it there within
/// seconds.
///
/// Detection: a call that fails with a timeout while *no* call on the connection got any answer
/// (a reply, a server error or a connection error) since it started means the connection's task
/// delivered nothing for a whole response timeout; so does an error saying that task is gone.
/// A call failed with "No connections found" while no call got an answer since it started is
/// taken the same way: the connection has lost every node connection and, in redis 1.8, may never
/// make one again (see `no_connections` below). Such a failure is immediate, so the test is weaker
/// than for a timeout; a replacement of a connection that would have recovered by itself costs
/// one background connect and at most [`crate::CONNECTION_TIMEOUT`] of waiting for the calls
/// started meanwhile.
/// Then a fresh `ClusterConnection` is made in the background (one at a time) and, once it has
/// connected, read the slot map and answered a `PING` on every master, or on more masters than
/// the current one (by address, within [`crate::CONNECTION_TIMEOUT`]), it replaces the wedged
/// one for every clone: each clone picks it up on its next call. Calls started while the replacement is being made wait for it (at
/// most [`crate::CONNECTION_TIMEOUT`]); calls already waiting on the wedged connection still end
/// with their timeout. If the fresh connection cannot be made (the cluster is down) or is no
/// better (e.g. a node frozen: a lone caller's calls to it look like a wedge, while the current
/// connection answers on the other masters), the current one stays: a connection made while a
/// node does not answer lacks that node and, in redis 1.8, fails its slots for one more response
/// timeout after the node is back. So a wedged connection answers again about one response
/// timeout after it wedged.
///
/// Hot path: one atomic load of the generation per call (the mutex is taken only by a clone whose
/// generation is behind), one more load and one atomic add. Clones share the connection.
#[derive(Clone)]
pub struct ClusterConn {
    shared: Arc<Shared>,
    /// This clone's copy of the connection of generation `generation`.
    conn: ClusterConnection,
    generation: u64,
}

struct Shared {
    /// Makes the replacements (same nodes, credentials, TLS, timeouts and retries).
    client: ClusterClient,
    /// The generation of `current` shifted left by one, and [`REPLACING`]: read on every call,
    /// written (after `current`) when a replacement starts and ends.
    state: AtomicU64,
    /// The connection in use and its generation (bumped on every replacement).
    current: Mutex<(u64, ClusterConnection)>,
    /// Woken when a replacement ends (made or not).
    replacement_ended: Notify,
    /// Calls answered (a reply, a server error or a connection error: anything but a timeout)
    /// since the start; only ever compared with itself.
    answered: AtomicU64,
    /// Replacements made so far.
    replaced: AtomicU64,
}

impl ClusterConn {
    /// Connects to the cluster of `client` now (its seed nodes, then the slot map).
    ///
    /// Errors: the redis crate's, when no seed node can be reached or none gives the slot map.
    pub async fn connect(client: ClusterClient) -> RedisResult<Self> {
        let conn = client.get_async_connection().await?;
        Ok(Self {
            shared: Arc::new(Shared {
                client,
                state: AtomicU64::new(0),
                current: Mutex::new((0, conn.clone())),
                replacement_ended: Notify::new(),
                answered: AtomicU64::new(0),
                replaced: AtomicU64::new(0),
            }),
            conn,
            generation: 0,
        })
    }

    /// How many times the connection was replaced because it was wedged (shared by all clones).
    pub fn replacements(&self) -> u64 {
        self.shared.replaced.load(Ordering::Relaxed)
    }

    /// [`ClusterConnection::route_command`]: `cmd` sent where `routing` says (e.g. one node by
    /// address, or every master), with the same wedge detection as every other call.
    pub async fn route_command(&mut self, cmd: Cmd, routing: RoutingInfo) -> RedisResult<Value> {
        let start = self.begin().await;
        let r = self.conn.route_command(cmd, routing).await;
        self.end(start, &r);
        r
    }

    /// Waits for a replacement under way (at most [`REPLACEMENT_WAIT`]) and catches up with the
    /// current generation; returns the `answered` count at the call's start.
    async fn begin(&mut self) -> u64 {
        let s = &*self.shared;
        let mut state = s.state.load(Ordering::Acquire);
        if state & REPLACING != 0 {
            let ended = s.replacement_ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if s.state.load(Ordering::Acquire) & REPLACING != 0 {
                let _ = tokio::time::timeout(REPLACEMENT_WAIT, ended).await;
            }
            state = s.state.load(Ordering::Acquire);
        }
        if state >> 1 != self.generation {
            let cur = s.current.lock().unwrap_or_else(|p| p.into_inner());
            (self.generation, self.conn) = (cur.0, cur.1.clone());
        }
        s.answered.load(Ordering::Relaxed)
    }

    /// Counts an answer, or, on a sign of a wedged connection, starts its replacement.
    fn end<T>(&self, answered_at_start: u64, r: &RedisResult<T>) {
        let s = &*self.shared;
        match r {
            // A timeout, or "No connections found" (see [`no_connections`]): not an answer.
            Err(e) if e.is_timeout() || no_connections(e) => {
                if s.answered.load(Ordering::Relaxed) == answered_at_start {
                    self.replace(e);
                }
            }
            // The connection's task is gone (`ClusterConnection::route_command`'s errors when it
            // cannot hand a call to it or get the answer back).
            Err(e) if e.to_string().contains("redis_cluster: Unable to") => self.replace(e),
            _ => {
                s.answered.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Makes a fresh connection in the background and installs it as the next generation, unless
    /// a replacement is under way or this clone's generation was replaced already.
    fn replace(&self, why: &redis::RedisError) {
        let generation = self.generation;
        let idle = generation << 1;
        if self.shared.state.compare_exchange(idle, idle | REPLACING, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return;
        }
        tracing::warn!(
            generation,
            "the Redis Cluster connection looks wedged (a call failed with \"{why}\" while no call got an \
             answer); connecting afresh"
        );
        let ending = Ending { shared: self.shared.clone(), generation, made: None };
        tokio::spawn(async move {
            let mut ending = ending;
            match ending.shared.client.get_async_connection().await {
                Ok(conn) => {
                    let current = ending.shared.current.lock().unwrap_or_else(|p| p.into_inner()).1.clone();
                    match better_than(&conn, &current).await {
                        (true, _) => ending.made = Some(conn),
                        (false, why) => tracing::warn!(
                            "the fresh Redis Cluster connection is no better than the current one ({why}); the \
                             current connection stays"
                        ),
                    }
                }
                Err(e) => {
                    tracing::warn!("cannot connect afresh to the Redis Cluster ({e}); the current connection stays")
                }
            }
            // `ending` dropped: installs the connection (if made) and wakes the waiting calls.
        });
    }
}

/// Whether `e` says the connection has no node connection left at all ("No connections found",
/// `ClusterConnectionNotFound`; not "Requested connection not found", a call routed to one node by
/// address). In redis 1.8 that state can last for good: a slot refresh drops every node
/// connection it cannot check (a `CLIENT KILL` storm kills the re-made ones while they are being
/// checked), and when the refresh then fails the crate's recovery retries only the refresh, which
/// with no connection left fails at once, again and again; the reconnect to the seed nodes that
/// these errors ask for is never started while that recovery runs. Every call then fails at once
/// with this error (measured: 40 s after the storm, until the process ended), while a fresh
/// connection works.
fn no_connections(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::ClusterConnectionNotFound && e.to_string().contains("No connections found")
}

/// The masters (host, port) of `conn`'s `CLUSTER SLOTS` (asked of a random node). A master whose
/// address is not given (`?` or empty host) is left out.
///
/// Errors: the call's, or an unexpected `CLUSTER SLOTS` reply.
async fn masters_of(conn: &ClusterConnection) -> RedisResult<Vec<(String, u16)>> {
    let slots = conn
        .clone()
        .route_command(
            redis::cmd("CLUSTER").arg("SLOTS").clone(),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
        )
        .await?;
    let mut masters: Vec<(String, u16)> = Vec::new();
    for range in redis::from_redis_value::<Vec<Vec<Value>>>(slots)? {
        let Some(master) = range.into_iter().nth(2) else { continue };
        let mut node = redis::from_redis_value::<Vec<Value>>(master)?.into_iter();
        let (Some(host), Some(port)) = (node.next(), node.next()) else { continue };
        let (host, port) = (redis::from_redis_value::<String>(host)?, redis::from_redis_value::<u16>(port)?);
        if !host.is_empty() && host != "?" && !masters.contains(&(host.clone(), port)) {
            masters.push((host, port));
        }
    }
    Ok(masters)
}

/// How many of `masters` answer a `PING` sent to each by address on `conn` within
/// [`REPLACEMENT_CHECK`]. A master `conn` has no connection to does not answer ("Requested
/// connection not found"); nor does any on a wedged connection.
async fn answering(conn: &ClusterConnection, masters: &[(String, u16)]) -> usize {
    let pings = masters.iter().map(|(host, port)| {
        let mut conn = conn.clone();
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host: host.clone(), port: *port });
        async move { tokio::time::timeout(REPLACEMENT_CHECK, conn.route_command(redis::cmd("PING"), routing)).await }
    });
    futures::future::join_all(pings).await.into_iter().filter(|r| matches!(r, Ok(Ok(_)))).count()
}

/// Whether the fresh connection `fresh` is better than `current`: it answers on every master
/// of its `CLUSTER SLOTS`, or on more of them than `current` does. A fresh connection made while
/// a node does not answer (e.g. frozen) has no connection to that node, and in redis 1.8 it then
/// fails the calls on that node's slots for one more response timeout after the node answers
/// again (measured: 5 s), while the current connection answers at once: when the current one
/// answers on every other master (a lone caller's calls to a frozen master looked like a wedge)
/// it must stay. A wedged one answers on none, so any fresh one that answers somewhere replaces
/// it (also while a master is down). (A `PING` routed to all masters would not tell: the crate
/// skips the masters it has no connection to.) Takes milliseconds on a healthy cluster; up to
/// 3 × [`REPLACEMENT_CHECK`] when a master does not answer (`current` is asked only then).
async fn better_than(fresh: &ClusterConnection, current: &ClusterConnection) -> (bool, String) {
    let masters = match tokio::time::timeout(REPLACEMENT_CHECK, masters_of(fresh)).await {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => return (false, format!("CLUSTER SLOTS failed: {e}")),
        Err(_) => return (false, "CLUSTER SLOTS timed out".into()),
    };
    let (n, f) = (masters.len(), answering(fresh, &masters).await);
    if f == n {
        return (true, format!("all {n} masters answer it"));
    }
    let c = answering(current, &masters).await;
    (f > c, format!("{f} of {n} masters answer it, {c} the current one"))
}

/// Ends a replacement when dropped (also if its task is dropped or panics): installs the new
/// connection, if one was made, as the next generation, clears [`REPLACING`], wakes the waiters.
struct Ending {
    shared: Arc<Shared>,
    generation: u64,
    made: Option<ClusterConnection>,
}

impl Drop for Ending {
    fn drop(&mut self) {
        let s = &*self.shared;
        let mut next = self.generation;
        if let Some(conn) = self.made.take() {
            next += 1;
            *s.current.lock().unwrap_or_else(|p| p.into_inner()) = (next, conn);
            s.replaced.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(generation = next, "replaced the wedged Redis Cluster connection");
        }
        s.state.store(next << 1, Ordering::Release);
        s.replacement_ended.notify_waiters();
    }
}

impl ConnectionLike for ClusterConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let start = self.begin().await;
            let r = self.conn.req_packed_command(cmd).await;
            self.end(start, &r);
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
            let start = self.begin().await;
            let r = self.conn.req_packed_commands(pipeline, offset, count).await;
            self.end(start, &r);
            r
        })
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}
