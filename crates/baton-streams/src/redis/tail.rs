//! Shared tail loops (fan-out): one per stream with live readers in this process.
//!
//! A tail loop owns one dedicated connection. It alternates `XREAD BLOCK <slice> COUNT 1` on the
//! stream key (a wake-up only; it also wakes on the hidden end entry) with one `read.lua` call
//! that fetches the new records together with the metadata, so every batch is checked against the
//! incarnation (deletion and re-creation), expiry and silence (the script ends a silent run as
//! `producer_lost`). A blocking read does not wake on deletion or expiry, hence the bounded slice.
//! Records go into an in-memory window that every waiter reads; waiters behind the window fall
//! back to one `read.lua` call of their own.
//!
//! Appends made by this process skip that round trip: the write scripts reply with the stream's
//! incarnation and its tail before the call, and when that tail is exactly where the window ends
//! (nothing written elsewhere in between) the writer pushes its records into the window at once
//! ([`TailHub::push`]); the loop's next read starts after them and skips what it already has.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use baton_redis::redis::aio::ConnectionManagerConfig;
use baton_redis::redis::{self, Value};
use baton_redis::{RedisConn, CONNECTION_TIMEOUT};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{keys, RedisStreamBackend};
use crate::end::EndState;
use crate::error::{Result, StreamError};
use crate::offset::{Offset, ReadFrom};
use crate::types::*;

/// Idle time after which a tail loop without waiters stops and releases its connection.
const LINGER: Duration = Duration::from_secs(3);
/// Records fetched per `read.lua` call by a tail loop.
const BATCH: usize = 512;
/// How long a woken tail loop waits for this process's write in flight before it reads anyway.
const WRITE_WAIT: Duration = Duration::from_millis(100);

pub(crate) struct TailHub {
    store: Weak<RedisStreamBackend>,
    tails: Mutex<HashMap<StreamPath, Arc<Tail>>>,
    /// Times a tail loop gave up waiting ([`WRITE_WAIT`]) for a write of this process in flight
    /// (a write whose reply never came back within it).
    write_waits_timed_out: AtomicU64,
}

/// A write call in flight, counted by its stream's tail loop (see [`TailHub::before_write`]).
pub(crate) struct WriteInFlight(Option<Arc<Tail>>);

impl Drop for WriteInFlight {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.writes.fetch_sub(1, Ordering::SeqCst);
            t.written.notify_waiters();
        }
    }
}

struct Tail {
    path: StreamPath,
    incarnation: String,
    state: Mutex<TailState>,
    notify: Notify,
    /// Woken after each write call of this process to the stream ([`TailHub::after_write`]).
    written: Notify,
    /// Write calls of this process to the stream between [`TailHub::before_write`] and
    /// [`TailHub::after_write`]: sent, their records not yet handed over.
    writes: AtomicUsize,
    waiters: AtomicUsize,
}

struct TailState {
    /// Records after `base` are in `window`.
    base: Offset,
    window: VecDeque<Record>,
    /// The window holds every record up to here (the next read starts after it).
    read_to: Offset,
    tail: Offset,
    end: Option<EndState>,
    content_type: String,
    error: Option<StreamError>,
    stopped: bool,
    ready: bool,
}

impl TailState {
    /// Appends the records after `read_to` (older ones are already in), keeping at most `cap`.
    fn extend(&mut self, records: impl IntoIterator<Item = Record>, cap: usize) {
        for r in records {
            if r.offset > self.read_to {
                self.read_to = r.offset;
                self.tail = self.tail.max(r.offset);
                self.window.push_back(r);
            }
        }
        while self.window.len() > cap {
            if let Some(r) = self.window.pop_front() {
                self.base = r.offset;
            }
        }
    }
}

struct WaiterGuard(Arc<Tail>);

impl Drop for WaiterGuard {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

impl TailHub {
    pub(crate) fn new(store: Weak<RedisStreamBackend>) -> Self {
        Self { store, tails: Mutex::new(HashMap::new()), write_waits_timed_out: AtomicU64::new(0) }
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
                read_to: start,
                tail: start,
                end: None,
                content_type: String::new(),
                error: None,
                stopped: false,
                ready: false,
            }),
            notify: Notify::new(),
            written: Notify::new(),
            writes: AtomicUsize::new(0),
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

    /// Records this process has just appended to `path` (incarnation `inc`), directly after the
    /// entry `prev` (`pushed`): they go into the live window (and its waiters are woken) when the window
    /// ends exactly at `prev`, is up to date and its stream is not ended; otherwise nothing
    /// happens and the tail loop reads them from Redis as usual.
    ///
    /// Called after every write call of this process to `path` with the guard
    /// [`TailHub::before_write`] returned for it (`pushed` is `None` when it added nothing that
    /// can be handed over): a tail loop woken by that write waits for this call before it reads
    /// (see `tail_loop`).
    pub(crate) fn after_write(
        &self,
        path: &StreamPath,
        started: WriteInFlight,
        pushed: Option<(&str, Offset, Vec<Record>)>,
    ) {
        let t = match &started.0 {
            Some(t) => t.clone(),
            None => match self.tails.lock().unwrap().get(path).cloned() {
                Some(t) => t,
                None => return,
            },
        };
        if let Some((inc, prev, records)) = pushed {
            self.push(&t, inc, prev, records);
        }
        // Ends the count (and wakes the loop) after the push, so that the loop reads after it.
        drop(started);
        t.written.notify_waiters();
    }

    /// Called before a write call of this process to `path` is sent: until the guard is passed
    /// to [`TailHub::after_write`] (or dropped, if the call is abandoned), the stream's tail loop
    /// (if any) waits for that write's records instead of reading them from Redis.
    pub(crate) fn before_write(&self, path: &StreamPath) -> WriteInFlight {
        let t = self.tails.lock().unwrap().get(path).cloned();
        if let Some(t) = &t {
            t.writes.fetch_add(1, Ordering::SeqCst);
        }
        WriteInFlight(t)
    }

    fn push(&self, t: &Tail, inc: &str, prev: Offset, records: Vec<Record>) {
        let Some(cap) = self.store.upgrade().map(|s| s.settings().live_window.max(1)) else { return };
        if t.incarnation != inc {
            return;
        }
        {
            let mut st = t.state.lock().unwrap();
            if !st.ready
                || st.stopped
                || st.error.is_some()
                || st.end.is_some()
                || st.read_to != prev
                || st.tail != prev
            {
                return;
            }
            st.extend(records, cap);
        }
        t.notify.notify_waiters();
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
                        // The window is in offset order: start after `after` (binary search, so a
                        // wake-up costs each waiter O(log window + new records)).
                        let start = st.window.partition_point(|r| r.offset <= after);
                        for r in st.window.range(start..) {
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

async fn run(store: Weak<RedisStreamBackend>, t: Arc<Tail>) {
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

async fn tail_loop(store: &Weak<RedisStreamBackend>, t: &Arc<Tail>) -> Result<()> {
    let (ks, _) = keys(&t.path);
    let slice = {
        let s = store.upgrade().ok_or_else(|| StreamError::Backend("store dropped".into()))?;
        s.settings().live_slice
    };
    // The blocking connection: opened on first use, replaced after an error or a stuck wait (in
    // Cluster that also re-resolves the node owning the key's slot, e.g. after MOVED).
    let mut conn: Option<RedisConn> = None;
    // Standalone: this loop's watch in the store's blocker (removed when the loop ends).
    let wake = Arc::new(Notify::new());
    let _unwatch = Unwatch { store: store.clone(), key: ks.clone(), wake: wake.clone() };
    let mut idle_since: Option<Instant> = None;
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
        // A write of this process in flight may be what woke this loop: its records are handed
        // over when its reply comes (see `TailHub::after_write`), so wait for that (bounded)
        // rather than read them from Redis a second time.
        if t.writes.load(Ordering::SeqCst) > 0 {
            let written = t.written.notified();
            tokio::pin!(written);
            written.as_mut().enable();
            if t.writes.load(Ordering::SeqCst) > 0 && tokio::time::timeout(WRITE_WAIT, written).await.is_err() {
                s.hub.write_waits_timed_out.fetch_add(1, Ordering::Relaxed);
            }
        }
        let from = {
            let st = t.state.lock().unwrap();
            if st.ready {
                ReadFrom::At(st.read_to)
            } else {
                ReadFrom::Now
            }
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
        let read_to = {
            let mut st = t.state.lock().unwrap();
            if !st.ready {
                st.ready = true;
                st.base = info.tail;
                st.read_to = info.tail;
                st.content_type = info.content_type.clone();
            }
            // Records pushed by this process's writes meanwhile are skipped (already in).
            st.extend(chunk.records, s.settings().live_window.max(1));
            st.read_to = st.read_to.max(chunk.next_offset);
            st.tail = st.tail.max(info.tail);
            st.end = info.end;
            st.read_to
        };
        t.notify.notify_waiters();
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
        if !s.client().is_cluster() {
            // Standalone: the store's one blocking connection watches every tailed stream.
            s.blocker.wait(&s, &ks, read_to.to_redis_id(), &wake, slice).await;
            continue;
        }
        drop(s);
        let block_ms = slice.as_millis().max(1) as u64;
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("BLOCK").arg(block_ms).arg("COUNT").arg(1).arg("STREAMS").arg(&ks).arg(read_to.to_redis_id());
        if conn.is_none() {
            let opened = match store.upgrade() {
                Some(s) => blocking_conn(&s, &ks).await,
                None => return Ok(()),
            };
            match opened {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    tracing::debug!(path = %t.path, error = %e, "tail connection failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            }
        }
        let c = conn.as_mut().expect("connection opened above");
        let r: Result<redis::RedisResult<Value>, _> =
            tokio::time::timeout(slice + Duration::from_secs(3), cmd.query_async(c)).await;
        match r {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::debug!(path = %t.path, error = %e, "tail XREAD failed; retrying");
                conn = None;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(_) => conn = None, // stuck connection: replace it
        }
    }
}

struct Unwatch {
    store: Weak<RedisStreamBackend>,
    key: String,
    wake: Arc<Notify>,
}

impl Drop for Unwatch {
    fn drop(&mut self) {
        if let Some(s) = self.store.upgrade() {
            s.blocker.forget(&self.key, &self.wake);
        }
    }
}

/// The connection a tail loop blocks on. Standalone: a dedicated connection. Cluster: one plain
/// connection to the master that owns the stream key's slot (resolved with `CLUSTER SLOTS`), not
/// a cluster connection (which would open a socket to every master): the tail loop's only other
/// traffic goes over the store's shared connection.
async fn blocking_conn(s: &RedisStreamBackend, key: &str) -> Result<RedisConn> {
    if !s.client().is_cluster() {
        return Ok(s.client().dedicated().await?);
    }
    let slot = baton_redis::key_slot(key.as_bytes());
    let mut shared = s.conn.clone();
    let slots: Value = redis::cmd("CLUSTER").arg("SLOTS").query_async(&mut shared).await?;
    let (host, port) =
        slot_owner(&slots, slot).ok_or_else(|| StreamError::Backend(format!("no node owns slot {slot}")))?;
    let client = s.client().node_client(&host, port).map_err(|e| StreamError::Backend(e.to_string()))?;
    let cfg = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(CONNECTION_TIMEOUT))
        .set_response_timeout(None)
        .set_number_of_retries(1);
    Ok(RedisConn::Standalone(baton_redis::StandaloneConn::connect(client, cfg).await?))
}

/// Host and port of the master serving `slot` in a `CLUSTER SLOTS` reply.
fn slot_owner(v: &Value, slot: u16) -> Option<(String, u16)> {
    let Value::Array(ranges) = v else { return None };
    for r in ranges {
        let Value::Array(f) = r else { continue };
        let (Some(Value::Int(lo)), Some(Value::Int(hi)), Some(Value::Array(master))) = (f.first(), f.get(1), f.get(2))
        else {
            continue;
        };
        if (*lo..=*hi).contains(&(slot as i64)) {
            let host = match master.first() {
                Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                Some(Value::SimpleString(s)) => s.clone(),
                _ => String::new(),
            };
            let Some(Value::Int(port)) = master.get(1) else { return None };
            return Some((host, *port as u16));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AppendRequest, CreateOptions, StreamStore, StreamStoreSettings};

    /// Appends of this process while a reader waits: the tail loop woken by each one waits for
    /// that write's reply and never times out waiting for one already handed over (the old
    /// check, "the group commit of this path is busy", stayed true while replies were being
    /// handed out after the last `after_write`, and the loop then waited `WRITE_WAIT` for
    /// nothing).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tail_loop_never_waits_for_a_write_already_handed_over() {
        let server = baton_testkit::RedisServer::start();
        let settings = Arc::new(StreamStoreSettings::default());
        let backend = RedisStreamBackend::connect(server.config(), settings.clone()).await.unwrap();
        let store = StreamStore::with_backend(backend.clone(), settings);
        let path = StreamPath::new("t/handover").unwrap();
        let opts = CreateOptions { content_type: Some("text/plain".into()), ..Default::default() };
        let mut at = store.create(&path, opts).await.unwrap().info.tail;
        for i in 0..1000u32 {
            let reader = {
                let (store, path) = (store.clone(), path.clone());
                tokio::spawn(async move { store.read_live(&path, ReadFrom::At(at), Duration::from_secs(5)).await })
            };
            if i % 2 == 0 {
                tokio::task::yield_now().await;
            }
            let req = AppendRequest { data: format!("m{i}").into(), ..Default::default() };
            let appended = store.append(&path, req).await.unwrap();
            let chunk = reader.await.unwrap().unwrap();
            assert!(!chunk.records.is_empty(), "append {i} reached the waiting reader");
            at = appended.tail;
        }
        // Let the loop handle the last wake-up.
        tokio::time::sleep(WRITE_WAIT * 2).await;
        assert_eq!(backend.hub.write_waits_timed_out.load(Ordering::Relaxed), 0);
    }
}
