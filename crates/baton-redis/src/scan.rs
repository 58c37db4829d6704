//! [`KeyScan`]: `SCAN … MATCH … COUNT …` over a whole deployment, standalone or Cluster.

use std::collections::VecDeque;

use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::{RedisResult, Value};

use crate::RedisConn;

/// Where one `SCAN` cursor lives.
enum Target {
    /// The standalone server.
    Server,
    /// One Cluster master, by the address the cluster client knows it under.
    Node { host: String, port: u16 },
}

/// A `SCAN cursor MATCH pattern COUNT count` iteration over every key of a deployment, one page
/// per [`KeyScan::next_page`]. Made by [`RedisConn::scan_match`].
///
/// Standalone: one cursor on the server. Cluster: the first page sends `SCAN 0` to every master at
/// once (the cluster client's own routing to all primaries, `MultipleNodeRoutingInfo::AllMasters`),
/// and each master's cursor is then continued on that master (`SingleNodeRoutingInfo::ByAddress`,
/// the address that reply came from), one master per page. No node discovery of its own: the
/// masters are those of the cluster client's slot map.
///
/// What `SCAN` guarantees holds per server: a key present for the whole iteration is returned at
/// least once (possibly more: callers deduplicate), a key added or removed meanwhile may or may not
/// be. In Cluster a key whose slot moves between masters during the iteration (resharding) may be
/// missed or returned twice.
pub struct KeyScan {
    conn: RedisConn,
    pattern: Vec<u8>,
    count: usize,
    started: bool,
    /// Cursors still to continue (non-zero).
    pending: VecDeque<(Target, u64)>,
}

impl RedisConn {
    /// A [`KeyScan`] of the keys matching the glob `pattern` (`SCAN`'s `MATCH`; escape `*?[]\` in
    /// literal parts with `\`), asking each server for about `count` keys per call (`COUNT`, at
    /// least 1). Sends nothing until the first [`KeyScan::next_page`].
    pub fn scan_match(&self, pattern: impl Into<Vec<u8>>, count: usize) -> KeyScan {
        KeyScan {
            conn: self.clone(),
            pattern: pattern.into(),
            count: count.max(1),
            started: false,
            pending: VecDeque::new(),
        }
    }
}

impl KeyScan {
    /// The next page of matching keys (possibly empty: `SCAN` may return no key for a cursor that
    /// is not done), or `None` once every cursor is back at 0. Errors: the `SCAN` call's (connection,
    /// timeout, a server error from any master); the iteration may be resumed by calling again (the
    /// failed cursor is retried).
    pub async fn next_page(&mut self) -> RedisResult<Option<Vec<Vec<u8>>>> {
        if !self.started {
            return self.first_page().await.map(Some);
        }
        let Some((target, cursor)) = self.pending.pop_front() else { return Ok(None) };
        let cmd = self.cmd(cursor);
        let reply = match (&target, &mut self.conn) {
            (Target::Node { host, port }, RedisConn::Cluster(c)) => {
                let routing =
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host: host.clone(), port: *port });
                c.route_command(cmd, routing).await
            }
            (_, conn) => cmd.query_async::<Value>(conn).await,
        };
        let reply = match reply {
            Ok(v) => v,
            Err(e) => {
                self.pending.push_front((target, cursor));
                return Err(e);
            }
        };
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::from_redis_value(reply)?;
        if next != 0 {
            self.pending.push_back((target, next));
        }
        Ok(Some(keys))
    }

    fn cmd(&self, cursor: u64) -> redis::Cmd {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor).arg("MATCH").arg(self.pattern.as_slice()).arg("COUNT").arg(self.count);
        cmd
    }

    async fn first_page(&mut self) -> RedisResult<Vec<Vec<u8>>> {
        let cmd = self.cmd(0);
        let replies: Vec<(Target, Value)> = match &mut self.conn {
            RedisConn::Standalone(_) | RedisConn::Sentinel(_) => {
                vec![(Target::Server, cmd.query_async::<Value>(&mut self.conn).await?)]
            }
            RedisConn::Cluster(c) => {
                // No response policy: the reply is a map of node address → that node's reply.
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                let Value::Map(per_node) = c.route_command(cmd, routing).await? else {
                    return Err(redis::RedisError::from((
                        redis::ErrorKind::Client,
                        "SCAN on all masters: the reply is not a map of node replies",
                    )));
                };
                let mut out = Vec::with_capacity(per_node.len());
                for (addr, reply) in per_node {
                    let addr: String = redis::from_redis_value(addr)?;
                    let Some((host, port)) = addr.rsplit_once(':').and_then(|(h, p)| Some((h, p.parse().ok()?))) else {
                        return Err(redis::RedisError::from((
                            redis::ErrorKind::Client,
                            "SCAN on all masters: a node address is not host:port",
                            addr,
                        )));
                    };
                    if let Value::ServerError(e) = reply {
                        return Err(e.into());
                    }
                    out.push((Target::Node { host: host.to_string(), port }, reply));
                }
                out
            }
        };
        let mut keys = Vec::new();
        for (target, reply) in replies {
            let (next, page): (u64, Vec<Vec<u8>>) = redis::from_redis_value(reply)?;
            keys.extend(page);
            if next != 0 {
                self.pending.push_back((target, next));
            }
        }
        self.started = true;
        Ok(keys)
    }
}
