//! Shared tail loops (fan-out): one per stream with live readers in this process.
//!
//! A tail loop owns one dedicated connection. It alternates `XREAD BLOCK <slice> COUNT 1` on the
//! stream key (a wake-up only; it also wakes on the hidden end entry) with one `read.lua` call
//! that fetches the new records together with the metadata, so every batch is checked against the
//! incarnation (deletion and re-creation), expiry and silence (the script ends a silent run as
//! `producer_lost`). A blocking read does not wake on deletion or expiry, hence the bounded slice.
//! Records go into an in-memory window that every waiter reads; waiters behind the window fall
//! back to one `read.lua` call of their own.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use baton_redis::redis::{self, Value};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{keys, RedisStore};
use crate::error::StreamError;
use crate::types::*;
use crate::{Offset, ReadFrom, Result};

/// Idle time after which a tail loop without waiters stops and releases its connection.
const LINGER: Duration = Duration::from_secs(3);
/// Records fetched per `read.lua` call by a tail loop.
const BATCH: usize = 512;

pub(crate) struct TailHub {
    store: Weak<RedisStore>,
    tails: Mutex<HashMap<StreamPath, Arc<Tail>>>,
}

struct Tail {
    path: StreamPath,
    incarnation: String,
    state: Mutex<TailState>,
    notify: Notify,
    waiters: AtomicUsize,
}

struct TailState {
    /// Records after `base` are in `window`.
    base: Offset,
    window: VecDeque<Record>,
    tail: Offset,
    end: Option<EndState>,
    content_type: String,
    error: Option<StreamError>,
    stopped: bool,
    ready: bool,
}

struct WaiterGuard(Arc<Tail>);

impl Drop for WaiterGuard {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

impl TailHub {
    pub(crate) fn new(store: Weak<RedisStore>) -> Self {
        Self { store, tails: Mutex::new(HashMap::new()) }
    }

    /// The live tail loop of `path` for `incarnation`, started if needed; counts a waiter.
    fn attach(&self, path: &StreamPath, incarnation: &str, start: Offset) -> WaiterGuard {
        let mut tails = self.tails.lock().unwrap();
        if let Some(t) = tails.get(path) {
            let st = t.state.lock().unwrap();
            let usable = !st.stopped && t.incarnation == incarnation;
            drop(st);
            if usable {
                t.waiters.fetch_add(1, Ordering::SeqCst);
                return WaiterGuard(t.clone());
            }
        }
        let tail = Arc::new(Tail {
            path: path.clone(),
            incarnation: incarnation.to_string(),
            state: Mutex::new(TailState {
                base: start,
                window: VecDeque::new(),
                tail: start,
                end: None,
                content_type: String::new(),
                error: None,
                stopped: false,
                ready: false,
            }),
            notify: Notify::new(),
            waiters: AtomicUsize::new(1),
        });
        if let Some(old) = tails.insert(path.clone(), tail.clone()) {
            // A loop for another incarnation: it notices by itself; stop it early.
            old.state.lock().unwrap().stopped = true;
        }
        tokio::spawn(run(self.store.clone(), tail.clone()));
        WaiterGuard(tail)
    }

    /// Removes `tail` if it is idle (no waiters); true when removed.
    fn detach_if_idle(&self, tail: &Arc<Tail>) -> bool {
        let mut tails = self.tails.lock().unwrap();
        if tail.waiters.load(Ordering::SeqCst) > 0 {
            return false;
        }
        tail.state.lock().unwrap().stopped = true;
        if tails.get(&tail.path).is_some_and(|t| Arc::ptr_eq(t, tail)) {
            tails.remove(&tail.path);
        }
        true
    }

    fn forget(&self, tail: &Arc<Tail>) {
        let mut tails = self.tails.lock().unwrap();
        tail.state.lock().unwrap().stopped = true;
        if tails.get(&tail.path).is_some_and(|t| Arc::ptr_eq(t, tail)) {
            tails.remove(&tail.path);
        }
    }

    pub(crate) async fn wait(
        &self,
        path: &StreamPath,
        after: Offset,
        incarnation: &str,
        max_bytes: usize,
        timeout: Duration,
    ) -> Result<ReadChunk> {
        let until = Instant::now() + timeout;
        let mut guard = self.attach(path, incarnation, after);
        loop {
            let t = guard.0.clone();
            let notified = t.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let behind = {
                let st = t.state.lock().unwrap();
                if let Some(e) = &st.error {
                    return Err(e.clone());
                }
                if st.ready {
                    if after < st.base {
                        true
                    } else {
                        let mut records = Vec::new();
                        let mut bytes = 0;
                        for r in st.window.iter().filter(|r| r.offset > after) {
                            if !records.is_empty() && bytes + r.data.len() > max_bytes {
                                break;
                            }
                            bytes += r.data.len();
                            records.push(r.clone());
                        }
                        let next = records.last().map_or(after, |r| r.offset);
                        let up_to_date = next >= st.tail;
                        if !records.is_empty() || (st.end.is_some() && up_to_date) {
                            return Ok(ReadChunk {
                                records,
                                next_offset: next,
                                up_to_date,
                                end: st.end.filter(|_| up_to_date),
                                content_type: st.content_type.clone(),
                                incarnation: t.incarnation.clone(),
                            });
                        }
                        false
                    }
                } else {
                    false
                }
            };
            if behind {
                // Older than the window: one read of our own.
                let store = self.store.upgrade().ok_or_else(|| StreamError::Backend("store dropped".into()))?;
                let max = store.settings().max_read_bytes.min(max_bytes);
                let (c, _) = store.read_raw(path, ReadFrom::At(after), 10_000, max, false, Some(incarnation)).await?;
                return Ok(c);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let st = t.state.lock().unwrap();
                return Ok(ReadChunk {
                    records: vec![],
                    next_offset: after,
                    up_to_date: true,
                    end: None,
                    content_type: st.content_type.clone(),
                    incarnation: t.incarnation.clone(),
                });
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep(left) => {}
            }
            if t.state.lock().unwrap().stopped && t.state.lock().unwrap().error.is_none() {
                // Replaced (linger race): attach again.
                guard = self.attach(path, incarnation, after);
            }
        }
    }
}

async fn run(store: Weak<RedisStore>, t: Arc<Tail>) {
    let result = tail_loop(&store, &t).await;
    if let Err(e) = result {
        let mut st = t.state.lock().unwrap();
        st.error = Some(e);
        st.stopped = true;
    }
    t.notify.notify_waiters();
    if let Some(s) = store.upgrade() {
        s.hub.forget(&t);
    }
}

async fn tail_loop(store: &Weak<RedisStore>, t: &Arc<Tail>) -> Result<()> {
    let (ks, _) = keys(&t.path);
    let (mut conn, slice) = {
        let s = store.upgrade().ok_or_else(|| StreamError::Backend("store dropped".into()))?;
        (s.client().dedicated().await?, s.settings().live_slice)
    };
    let mut idle_since: Option<Instant> = None;
    let mut at: Option<Offset> = None;
    loop {
        if t.state.lock().unwrap().stopped {
            return Ok(());
        }
        let s = store.upgrade().ok_or_else(|| StreamError::Backend("store dropped".into()))?;
        if t.waiters.load(Ordering::SeqCst) == 0 {
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= LINGER && s.hub.detach_if_idle(t) {
                return Ok(());
            }
        } else {
            idle_since = None;
        }
        let from = match at {
            None => ReadFrom::Now,
            Some(o) => ReadFrom::At(o),
        };
        let (chunk, info) = match s.read_raw(&t.path, from, BATCH, usize::MAX / 2, false, Some(&t.incarnation)).await {
            Ok(v) => v,
            Err(StreamError::Backend(e)) => {
                tracing::debug!(path = %t.path, error = %e, "tail read failed; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        {
            let mut st = t.state.lock().unwrap();
            if !st.ready {
                st.ready = true;
                st.base = info.tail;
                st.content_type = info.content_type.clone();
            }
            for r in chunk.records.iter() {
                st.window.push_back(r.clone());
            }
            let cap = s.settings().live_window.max(1);
            while st.window.len() > cap {
                if let Some(r) = st.window.pop_front() {
                    st.base = r.offset;
                }
            }
            st.tail = info.tail;
            st.end = info.end;
        }
        t.notify.notify_waiters();
        at = Some(chunk.next_offset);
        if !chunk.up_to_date {
            continue;
        }
        if info.end.is_some() {
            // Ended: waiters are served from the window until they leave.
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                if t.state.lock().unwrap().stopped {
                    return Ok(());
                }
                if t.waiters.load(Ordering::SeqCst) == 0 {
                    let since = *idle_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= LINGER && s.hub.detach_if_idle(t) {
                        return Ok(());
                    }
                } else {
                    idle_since = None;
                }
            }
        }
        drop(s);
        let block_ms = slice.as_millis().max(1) as u64;
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("BLOCK").arg(block_ms).arg("COUNT").arg(1).arg("STREAMS").arg(&ks).arg(chunk.next_offset.to_redis_id());
        let r: Result<redis::RedisResult<Value>, _> =
            tokio::time::timeout(slice + Duration::from_secs(3), cmd.query_async(&mut conn)).await;
        match r {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::debug!(path = %t.path, error = %e, "tail XREAD failed; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => {
                // Stuck connection: replace it.
                if let Some(s) = store.upgrade() {
                    conn = s.client().dedicated().await?;
                }
            }
        }
    }
}
