//! "One current run per engineer": a pointer from an engineer to the run id they are running.
//!
//! * Redis: one string key per engineer, `<prefix>:triage:current:{<engineer>}` (its own hash
//!   tag, so it works on Cluster too), value = run id, with a safety TTL.
//!   - claim: `SET key run NX PX ttl`;
//!   - release: a compare-and-delete script (`DEL` only while the value is still this run);
//!   - take over: a compare-and-set script (`SET` only while the value is still the old run),
//!     used once the old run has ended (the caller checks that).
//! * Memory: one map under a mutex with the same three operations and the same outcomes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_redis::redis;
use baton_redis::{RedisClient, RedisConn};

const RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#;

const TAKE_OVER: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"#;

/// The pointer store (cheap to clone).
#[derive(Clone)]
pub enum Pointers {
    /// In this process only; entries expire after the TTL like the Redis keys.
    Memory(Arc<Mutex<HashMap<String, (String, Instant)>>>, Duration),
    /// Shared by every process on the Redis deployment.
    Redis { conn: RedisConn, prefix: String, ttl: Duration },
}

impl Pointers {
    /// An in-memory pointer store; a pointer expires `ttl` after it was set.
    pub fn memory(ttl: Duration) -> Self {
        Pointers::Memory(Arc::new(Mutex::new(HashMap::new())), ttl)
    }

    /// A Redis pointer store under key prefix `prefix` (e.g. `baton`).
    pub async fn redis(client: &RedisClient, prefix: &str, ttl: Duration) -> Result<Self, baton_redis::ConnectError> {
        Ok(Pointers::Redis { conn: client.shared().await?, prefix: prefix.to_string(), ttl })
    }

    /// The Redis key of `engineer`'s pointer.
    pub fn key(prefix: &str, engineer: &str) -> String {
        format!("{prefix}:triage:current:{{{engineer}}}")
    }

    /// Points `engineer` at `run` unless a pointer exists. `true` when claimed.
    pub async fn claim(&self, engineer: &str, run: &str) -> Result<bool, redis::RedisError> {
        match self {
            Pointers::Memory(m, ttl) => {
                let mut m = m.lock().unwrap();
                let now = Instant::now();
                match m.get(engineer) {
                    Some((_, exp)) if *exp > now => Ok(false),
                    _ => {
                        m.insert(engineer.to_string(), (run.to_string(), now + *ttl));
                        Ok(true)
                    }
                }
            }
            Pointers::Redis { conn, prefix, ttl } => {
                let r: Option<String> = redis::cmd("SET")
                    .arg(Self::key(prefix, engineer))
                    .arg(run)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl.as_millis() as u64)
                    .query_async(&mut conn.clone())
                    .await?;
                Ok(r.is_some())
            }
        }
    }

    /// The run `engineer` points at, if any.
    pub async fn get(&self, engineer: &str) -> Result<Option<String>, redis::RedisError> {
        match self {
            Pointers::Memory(m, _) => {
                let m = m.lock().unwrap();
                Ok(m.get(engineer).filter(|(_, exp)| *exp > Instant::now()).map(|(r, _)| r.clone()))
            }
            Pointers::Redis { conn, prefix, .. } => {
                redis::cmd("GET").arg(Self::key(prefix, engineer)).query_async(&mut conn.clone()).await
            }
        }
    }

    /// Deletes the pointer while it still names `run` (compare-and-delete). `true` when deleted.
    pub async fn release(&self, engineer: &str, run: &str) -> Result<bool, redis::RedisError> {
        match self {
            Pointers::Memory(m, _) => {
                let mut m = m.lock().unwrap();
                if m.get(engineer).is_some_and(|(r, _)| r == run) {
                    m.remove(engineer);
                    return Ok(true);
                }
                Ok(false)
            }
            Pointers::Redis { conn, prefix, .. } => {
                let n: i64 = redis::Script::new(RELEASE)
                    .key(Self::key(prefix, engineer))
                    .arg(run)
                    .invoke_async(&mut conn.clone())
                    .await?;
                Ok(n == 1)
            }
        }
    }

    /// Re-points `engineer` from `old` to `new` while it still names `old` (compare-and-set).
    /// `true` when taken over.
    pub async fn take_over(&self, engineer: &str, old: &str, new: &str) -> Result<bool, redis::RedisError> {
        match self {
            Pointers::Memory(m, ttl) => {
                let mut m = m.lock().unwrap();
                if m.get(engineer).is_some_and(|(r, _)| r == old) {
                    m.insert(engineer.to_string(), (new.to_string(), Instant::now() + *ttl));
                    return Ok(true);
                }
                Ok(false)
            }
            Pointers::Redis { conn, prefix, ttl } => {
                let n: i64 = redis::Script::new(TAKE_OVER)
                    .key(Self::key(prefix, engineer))
                    .arg(old)
                    .arg(new)
                    .arg(ttl.as_millis() as u64)
                    .invoke_async(&mut conn.clone())
                    .await?;
                Ok(n == 1)
            }
        }
    }
}
