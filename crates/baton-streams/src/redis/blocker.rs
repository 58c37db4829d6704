//! Standalone Redis: one blocking connection for every tailed stream of a store.
//!
//! Each tail loop *arms* a watch (its stream key and the last id it has read) and waits to be
//! woken. One blocker task issues `XREAD BLOCK <slice> COUNT 1 STREAMS k1 … kn id1 … idn` over
//! every armed watch on one dedicated connection; a stream that gets an entry is disarmed and its
//! tail loop woken (it then reads with `read.lua` and re-arms). A watch armed while the `XREAD` is
//! in flight interrupts it (`CLIENT UNBLOCK` from the shared connection) so that it is included at
//! once. In Cluster a multi-key `XREAD` must stay within one slot, so there each tail loop keeps
//! its own connection to the node owning its slot (see `tail.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use baton_redis::redis::{self, Value};
use baton_redis::RedisConn;
use tokio::sync::Notify;

use super::RedisStreamBackend;

/// Idle time after which a blocker without watches stops and releases its connection.
const LINGER: Duration = Duration::from_secs(3);

struct Watch {
    after: String,
    wake: Arc<Notify>,
    armed: bool,
}

#[derive(Default)]
struct State {
    watches: HashMap<String, Watch>,
    /// (key, after) of the `XREAD` in flight.
    inflight: HashMap<String, String>,
    running: bool,
}

#[derive(Default)]
pub(crate) struct Blocker {
    state: Mutex<State>,
    kick: Notify,
}

impl Blocker {
    /// Arms `key` after `after` and returns once an entry past it may exist, or after `slice`.
    pub(crate) async fn wait(
        &self,
        store: &Arc<RedisStreamBackend>,
        key: &str,
        after: String,
        wake: &Arc<Notify>,
        slice: Duration,
    ) {
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let (start, kick) = {
            let mut st = self.state.lock().unwrap();
            let kick = st.inflight.get(key) != Some(&after);
            st.watches.insert(key.to_string(), Watch { after, wake: wake.clone(), armed: true });
            let start = !st.running;
            st.running = true;
            (start, kick)
        };
        if start {
            tokio::spawn(run(Arc::downgrade(store)));
        } else if kick {
            self.kick.notify_one();
        }
        let _ = tokio::time::timeout(slice, notified).await;
    }

    /// Removes the watch of `key` if it is `wake`'s (a tail loop that stops).
    pub(crate) fn forget(&self, key: &str, wake: &Arc<Notify>) {
        let mut st = self.state.lock().unwrap();
        if st.watches.get(key).is_some_and(|w| Arc::ptr_eq(&w.wake, wake)) {
            st.watches.remove(key);
        }
    }
}

async fn run(store: Weak<RedisStreamBackend>) {
    let mut conn: Option<(RedisConn, i64)> = None;
    let mut idle_since: Option<tokio::time::Instant> = None;
    loop {
        let Some(s) = store.upgrade() else { return };
        let b = &s.blocker;
        let batch: Vec<(String, String)> = {
            let mut st = b.state.lock().unwrap();
            let batch: Vec<(String, String)> =
                st.watches.iter().filter(|(_, w)| w.armed).map(|(k, w)| (k.clone(), w.after.clone())).collect();
            if batch.is_empty() {
                let since = *idle_since.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() >= LINGER && st.watches.is_empty() {
                    st.running = false;
                    st.inflight.clear();
                    return;
                }
            } else {
                idle_since = None;
            }
            st.inflight = batch.iter().cloned().collect();
            batch
        };
        if batch.is_empty() {
            let _ = tokio::time::timeout(Duration::from_millis(100), b.kick.notified()).await;
            continue;
        }
        if conn.is_none() {
            match open(&s).await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    tracing::debug!(error = %e, "blocker connection failed; retrying");
                    wake_all(b);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            }
        }
        let (c, id) = conn.as_mut().expect("opened above");
        let slice = s.settings().live_slice;
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("BLOCK").arg(slice.as_millis().max(1) as u64).arg("COUNT").arg(1).arg("STREAMS");
        for (k, _) in &batch {
            cmd.arg(k);
        }
        for (_, a) in &batch {
            cmd.arg(a);
        }
        let mut shared = s.conn.clone();
        let id = *id;
        let r = {
            let xread = tokio::time::timeout(slice + Duration::from_secs(3), cmd.query_async::<Value>(c));
            tokio::pin!(xread);
            // A watch armed meanwhile interrupts the block so that it is included; if the XREAD has
            // not reached Redis yet (UNBLOCK answers 0), try again every millisecond a few times.
            let mut retries = 0u32;
            loop {
                tokio::select! {
                    r = &mut xread => break r,
                    _ = b.kick.notified() => retries = 5,
                    _ = tokio::time::sleep(Duration::from_millis(1)), if retries > 0 => {}
                }
                if retries > 0 {
                    let n: redis::RedisResult<i64> =
                        redis::cmd("CLIENT").arg("UNBLOCK").arg(id).query_async(&mut shared).await;
                    retries = if matches!(n, Ok(0)) { retries - 1 } else { 0 };
                }
            }
        };
        match r {
            Ok(Ok(v)) => {
                let keys = reply_keys(&v);
                let mut st = b.state.lock().unwrap();
                for k in keys {
                    if let Some(w) = st.watches.get_mut(&k) {
                        w.armed = false;
                        w.wake.notify_one();
                    }
                }
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "blocker XREAD failed; reconnecting");
                conn = None;
                wake_all(b);
            }
            Err(_) => {
                conn = None; // stuck connection
                wake_all(b);
            }
        }
    }
}

/// Wakes every armed watch (after an error: each tail loop re-reads and re-arms).
fn wake_all(b: &Blocker) {
    let mut st = b.state.lock().unwrap();
    for w in st.watches.values_mut().filter(|w| w.armed) {
        w.armed = false;
        w.wake.notify_one();
    }
}

async fn open(s: &RedisStreamBackend) -> redis::RedisResult<(RedisConn, i64)> {
    let mut c = s
        .client()
        .dedicated()
        .await
        .map_err(|e| redis::RedisError::from((redis::ErrorKind::Io, "connect", e.to_string())))?;
    let id: i64 = redis::cmd("CLIENT").arg("ID").query_async(&mut c).await?;
    Ok((c, id))
}

/// Stream keys present in an `XREAD` reply (RESP2 array of [key, entries] or RESP3 map).
fn reply_keys(v: &Value) -> Vec<String> {
    let name = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    match v {
        Value::Array(items) => items
            .iter()
            .filter_map(|i| match i {
                Value::Array(kv) => kv.first().and_then(name),
                _ => None,
            })
            .collect(),
        Value::Map(kvs) => kvs.iter().filter_map(|(k, _)| name(k)).collect(),
        _ => vec![],
    }
}
