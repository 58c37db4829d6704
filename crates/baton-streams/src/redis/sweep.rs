//! The silence sweeper of the Redis backend: ends streams whose producer fell silent even when
//! nobody reads them (see the crate docs, "Silence sweeper").
//!
//! Streams with a `silence_timeout` are registered in one of [`SHARDS`] sorted sets
//! `baton:s:deadlines:{N}` (N = hash of the path; each shard is its own hash tag, so its own slot),
//! member `<incarnation> <path>`, score = the earliest time the stream may turn silent. Appends and
//! keepalives never touch the shards (a stream's script cannot reach another slot in Cluster, and
//! appends stay one call): a score is only a lower bound. Every `sweep_interval` each process
//! claims the due members of every shard (`sweep.lua`, a lease against concurrent sweepers) and
//! runs the stream's own `read.lua` metadata read on each, which ends a silent stream as
//! `producer_lost` with the same code (`check_silence`/`do_end`) every other script uses, so a
//! race with finish/cancel still leaves exactly one end. A stream that is still alive is
//! re-scored at `last write + silence_timeout`; an ended, deleted, expired or re-created one is
//! removed from its shard.

use std::sync::Weak;
use std::time::Duration;

use baton_redis::redis::{self, Value};
use baton_redis::LuaScript;
use futures::StreamExt;

use super::RedisStreamBackend;
use crate::error::{Result, StreamError};
use crate::offset::ReadFrom;
use crate::types::*;

/// Number of deadline shards.
pub(crate) const SHARDS: u64 = 16;
/// Members claimed per shard and call.
const CLAIM: usize = 256;
/// How long a claimed member is left to its sweeper before another may take it.
const LEASE_MS: u64 = 10_000;
/// Streams checked concurrently per shard.
const PARALLEL: usize = 32;

static SWEEP: LuaScript = LuaScript::new("streams.sweep", include_str!("../../scripts/sweep.lua"));

/// FNV-1a of the path: the deadline shard of a stream.
pub(crate) fn shard_key(path: &StreamPath) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in path.as_str().bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("baton:s:deadlines:{{{}}}", h % SHARDS)
}

pub(crate) fn member(incarnation: &str, path: &StreamPath) -> String {
    format!("{incarnation} {}", path.as_str())
}

impl RedisStreamBackend {
    /// Registers (or re-scores) a stream in its deadline shard (`at_ms`), and removes `stale`
    /// (another incarnation's member, e.g. the one registered for a create that found an existing
    /// stream) in the same round trip (same shard key).
    pub(crate) async fn register_deadline(
        &self,
        path: &StreamPath,
        incarnation: &str,
        at_ms: Option<u64>,
        stale: Option<&str>,
    ) -> Result<()> {
        let key = shard_key(path);
        let mut pipe = redis::pipe();
        if let Some(at) = at_ms {
            pipe.cmd("ZADD").arg(&key).arg(at).arg(member(incarnation, path)).ignore();
        }
        if let Some(inc) = stale.filter(|s| *s != incarnation) {
            pipe.cmd("ZREM").arg(&key).arg(member(inc, path)).ignore();
        }
        if at_ms.is_none() && stale.is_none_or(|s| s == incarnation) {
            return Ok(());
        }
        let mut conn = self.conn.clone();
        let _: () = pipe.query_async(&mut conn).await?;
        Ok(())
    }
}

pub(crate) async fn sweeper(store: Weak<RedisStreamBackend>, every: Duration) {
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(s) = store.upgrade() else { return };
        futures::future::join_all((0..SHARDS).map(|n| sweep_shard(&s, n))).await;
    }
}

async fn sweep_shard(s: &RedisStreamBackend, n: u64) {
    let key = format!("baton:s:deadlines:{{{n}}}");
    loop {
        let mut conn = s.conn.clone();
        let due: Vec<String> = match SWEEP.run(&mut conn, &[&key], &[&CLAIM, &LEASE_MS]).await {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(shard = n, error = %e, "sweep claim failed");
                return;
            }
        };
        let full = due.len() == CLAIM;
        let key = key.as_str();
        futures::stream::iter(due)
            .for_each_concurrent(PARALLEL, |m| async move {
                if let Err(e) = sweep_one(s, key, &m).await {
                    tracing::debug!(member = %m, error = %e, "sweep check failed (retried after the lease)");
                }
            })
            .await;
        if !full {
            return;
        }
    }
}

async fn sweep_one(s: &RedisStreamBackend, key: &str, m: &str) -> Result<()> {
    let mut conn = s.conn.clone();
    let parsed = m.split_once(' ').and_then(|(inc, p)| Some((inc, StreamPath::new(p).ok()?)));
    let Some((inc, path)) = parsed else {
        let _: Value = redis::cmd("ZREM").arg(key).arg(m).query_async(&mut conn).await?;
        return Ok(());
    };
    let next = match s.read_raw(&path, ReadFrom::Now, 0, 0, false, Some(inc)).await {
        Ok((_, info)) => match (info.end, info.limits.silence_timeout) {
            (None, Some(sil)) => Some(info.last_write_at + sil.as_millis() as u64 + 1),
            _ => None,
        },
        Err(StreamError::NotFound { .. } | StreamError::Gone { .. }) => None,
        Err(e) => return Err(e),
    };
    let _: Value = match next {
        Some(at) => redis::cmd("ZADD").arg(key).arg(at).arg(m).query_async(&mut conn).await?,
        None => redis::cmd("ZREM").arg(key).arg(m).query_async(&mut conn).await?,
    };
    Ok(())
}
