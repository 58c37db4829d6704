//! In-memory backend: the embedded default, with the same semantics as the Redis scripts
//! (`scripts/*.lua`); each operation runs under the stream's lock, as a script runs atomically.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::{found_end, CreateSpec, Deleted, PathFilter, Smallest, Snapshot, StreamBackend, WriteSpec};
use crate::end::{EndReason, EndState};
use crate::error::{Result, StreamError};
use crate::limits::{LimitScope, RunLimits};
use crate::offset::{Offset, ReadFrom};
use crate::settings::StreamStoreSettings;
use crate::types::*;

pub(crate) struct MemoryStreamBackend {
    streams: Mutex<HashMap<StreamPath, Arc<MemStream>>>,
}

struct MemStream {
    st: Mutex<State>,
    notify: Notify,
}

struct PState {
    epoch: u64,
    /// -1 after a claim, before any write in the epoch.
    last: i64,
    count: u64,
    off: Offset,
}

struct State {
    removed: bool,
    inc: String,
    ct: String,
    ctn: String,
    ttl_ms: Option<u64>,
    exp: Option<u64>,
    dl: Option<u64>,
    limits: RunLimits,
    tail: Offset,
    first: Offset,
    last_id: Offset,
    records: Vec<Record>,
    cnt: u64,
    lw: u64,
    ta: u64,
    ca: u64,
    end: Option<(EndState, u64, Option<ProducerStamp>)>,
    sq: Option<String>,
    producers: HashMap<String, PState>,
    refs: u64,
    deleted: bool,
    fork: Option<ForkFrom>,
    /// A silence timeout kept aside until the first producer's open arms it
    /// ([`crate::CreateOptions::silence_from_open`]).
    silence_later: Option<Duration>,
}

fn ms(d: Option<Duration>) -> Option<u64> {
    d.map(|d| d.as_millis() as u64)
}

impl State {
    fn deadline(&self) -> Option<u64> {
        let mut d: Option<u64> = None;
        let mut low = |x: Option<u64>| {
            if let Some(x) = x {
                d = Some(d.map_or(x, |d| d.min(x)));
            }
        };
        low(self.dl);
        low(self.ttl_ms.map(|t| self.ta + t));
        if let Some((_, ea, _)) = &self.end {
            low(ms(self.limits.done_ttl).map(|t| ea + t));
        }
        d
    }

    fn expired(&self, now: u64) -> bool {
        self.deadline().is_some_and(|d| now >= d)
    }

    fn next_id(&mut self, now: u64) -> Offset {
        let id = if now > self.last_id.ms {
            Offset::new(now, 0)
        } else {
            Offset::new(self.last_id.ms, self.last_id.seq + 1)
        };
        self.last_id = id;
        id
    }

    fn do_end(&mut self, now: u64, reason: EndReason, closer: Option<ProducerStamp>) -> EndState {
        self.next_id(now); // the hidden end entry of the Redis layout
        let end = EndState { reason, final_offset: self.tail };
        self.end = Some((end, now, closer));
        end
    }

    /// `silence_timeout`: true when this call ended the stream as `producer_lost`.
    fn check_silence(&mut self, now: u64) -> bool {
        if self.end.is_none() {
            if let Some(sil) = ms(self.limits.silence_timeout) {
                if now.saturating_sub(self.lw) > sil {
                    self.do_end(now, EndReason::ProducerLost, None);
                    return true;
                }
            }
        }
        false
    }

    /// Time until the silence timeout or expiry fires, whichever is first.
    fn next_event_in(&self, now: u64) -> Option<u64> {
        let mut t = self.deadline().map(|d| d.saturating_sub(now));
        if self.end.is_none() {
            if let Some(sil) = ms(self.limits.silence_timeout) {
                let s = (self.lw + sil + 1).saturating_sub(now);
                t = Some(t.map_or(s, |t| t.min(s)));
            }
        }
        t
    }

    fn info(&self, path: &StreamPath) -> StreamInfo {
        StreamInfo {
            path: path.clone(),
            content_type: self.ct.clone(),
            tail: self.tail,
            expiry: match (self.ttl_ms, self.exp) {
                (Some(t), _) => Expiry::TtlSecs(t / 1000),
                (None, Some(e)) => Expiry::At(e),
                _ => Expiry::None,
            },
            deadline: self.deadline(),
            end: self.end.as_ref().map(|e| e.0),
            ended_at: self.end.as_ref().map(|e| e.1),
            earliest: self.first,
            len: self.cnt,
            created_at: self.ca,
            last_write_at: self.lw,
            limits: self.limits,
            incarnation: self.inc.clone(),
            fork: self.fork.clone(),
        }
    }

    fn chunk(&self, from: ReadFrom, max_records: usize, max_bytes: usize) -> Result<ReadChunk> {
        let from = match from {
            ReadFrom::Start => self.first,
            ReadFrom::Now => self.tail,
            ReadFrom::At(o) | ReadFrom::Tagged(o, _) => {
                if o > self.tail {
                    return Err(StreamError::OffsetAhead { offset: o, tail: self.tail });
                }
                if o < self.first {
                    return Err(StreamError::OffsetGone { offset: o, earliest: self.first });
                }
                o
            }
        };
        let mut records = Vec::new();
        if max_records > 0 && from < self.tail {
            let start = self.records.partition_point(|r| r.offset <= from);
            let mut bytes = 0usize;
            for r in &self.records[start..] {
                if r.offset > self.tail || records.len() >= max_records {
                    break;
                }
                if !records.is_empty() && bytes + r.data.len() > max_bytes {
                    break;
                }
                bytes += r.data.len();
                records.push(r.clone());
            }
        }
        let next = records.last().map_or(from, |r| r.offset);
        let up_to_date = next == self.tail;
        Ok(ReadChunk {
            records,
            next_offset: next,
            up_to_date,
            end: self.end.as_ref().filter(|_| up_to_date).map(|e| e.0),
            content_type: self.ct.clone(),
            incarnation: self.inc.clone(),
        })
    }
}

fn not_found(path: &StreamPath) -> StreamError {
    StreamError::NotFound { path: path.to_string() }
}

impl MemoryStreamBackend {
    pub(crate) fn new(settings: Arc<StreamStoreSettings>) -> Arc<Self> {
        let store = Arc::new(Self { streams: Mutex::new(HashMap::new()) });
        let weak = Arc::downgrade(&store);
        let every = settings.sweep_interval.clamp(Duration::from_millis(10), Duration::from_millis(200));
        tokio::spawn(sweeper(weak, every));
        store
    }

    /// The live stream at `path` (expired ones are dropped here).
    fn lookup(&self, path: &StreamPath) -> Option<Arc<MemStream>> {
        let mut map = self.streams.lock().unwrap();
        let s = map.get(path)?.clone();
        let mut st = s.st.lock().unwrap();
        if st.removed || st.expired(now_ms()) {
            st.removed = true;
            drop(st);
            map.remove(path);
            s.notify.notify_waiters();
            return None;
        }
        drop(st);
        Some(s)
    }

    /// Runs `f` on the live, not soft-deleted stream; wakes waiters afterwards when `mutates` (or
    /// when the silence check ended the stream).
    fn with<T>(&self, path: &StreamPath, mutates: bool, f: impl FnOnce(&mut State, u64) -> Result<T>) -> Result<T> {
        let s = self.lookup(path).ok_or_else(|| not_found(path))?;
        let (out, wake) = {
            let mut st = s.st.lock().unwrap();
            if st.removed {
                return Err(not_found(path));
            }
            if st.deleted {
                return Err(StreamError::Gone { path: path.to_string() });
            }
            let now = now_ms();
            let ended = st.check_silence(now);
            (f(&mut st, now), ended || mutates)
        };
        if wake {
            s.notify.notify_waiters();
        }
        out
    }

    fn sweep(&self) {
        let now = now_ms();
        let mut map = self.streams.lock().unwrap();
        map.retain(|_, s| {
            let mut st = s.st.lock().unwrap();
            let ended = st.check_silence(now);
            let expired = st.removed || st.expired(now);
            if expired {
                st.removed = true;
            }
            drop(st);
            if ended || expired {
                s.notify.notify_waiters();
            }
            !expired
        });
    }
}

async fn sweeper(store: Weak<MemoryStreamBackend>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    loop {
        tick.tick().await;
        let Some(store) = store.upgrade() else { return };
        store.sweep();
    }
}

#[async_trait]
impl StreamBackend for MemoryStreamBackend {
    async fn create(&self, path: &StreamPath, spec: CreateSpec) -> Result<(Created, Option<u64>)> {
        let now = now_ms();
        let claim = |st: &mut State| -> Option<u64> {
            let pid = spec.claim.as_ref()?;
            let (epoch, count, off) = match st.producers.get(pid) {
                Some(p) => (p.epoch + 1, p.count, p.off),
                None => (0, 0, Offset::ZERO),
            };
            st.producers.insert(pid.clone(), PState { epoch, last: -1, count, off });
            st.lw = now;
            if let Some(d) = st.silence_later.take() {
                st.limits.silence_timeout = Some(d);
            }
            Some(epoch)
        };
        let _ = self.lookup(path); // drops an expired stream
        let mut map = self.streams.lock().unwrap();
        if let Some(s) = map.get(path).cloned() {
            let mut st = s.st.lock().unwrap();
            if st.deleted {
                return Err(StreamError::conflict("the path belongs to a deleted stream that forks still reference"));
            }
            if st.check_silence(now) {
                s.notify.notify_waiters();
            }
            if spec.claim.is_some() {
                if let Some((end, _, _)) = st.end {
                    return Err(StreamError::Closed { end, incarnation: st.inc.clone() });
                }
            }
            let (ttl, exp) = expiry_fields(spec.expiry);
            let fork_eq = st.fork == spec.fork;
            let reason = if st.ctn != normalize_content_type(&spec.content_type) {
                Some(format!("content type differs from the existing stream's ({})", st.ct))
            } else if st.ttl_ms != ttl || st.exp != exp {
                Some("TTL or expiry differs".to_string())
            } else if st.end.is_some() != spec.closed {
                Some("closed state differs".to_string())
            } else if !fork_eq {
                Some("fork origin differs".to_string())
            } else {
                None
            };
            if let Some(r) = reason {
                return Err(StreamError::conflict(r));
            }
            let e = claim(&mut st);
            return Ok((Created { created: false, info: st.info(path) }, e));
        }
        let (ttl_ms, exp) = expiry_fields(spec.expiry);
        let mr = ms(spec.limits.max_run).map(|m| now + m);
        let dl = match (exp, mr) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let mut st = State {
            removed: false,
            inc: spec.incarnation.clone(),
            ct: spec.content_type.clone(),
            ctn: normalize_content_type(&spec.content_type),
            ttl_ms,
            exp,
            dl,
            limits: RunLimits {
                silence_timeout: spec.limits.silence_timeout.filter(|_| !spec.silence_from_open),
                ..spec.limits
            },
            tail: Offset::ZERO,
            first: Offset::ZERO,
            last_id: Offset::ZERO,
            records: Vec::new(),
            cnt: 0,
            lw: now,
            ta: now,
            ca: now,
            end: None,
            sq: None,
            producers: HashMap::new(),
            refs: 0,
            deleted: false,
            fork: spec.fork.clone(),
            silence_later: spec.limits.silence_timeout.filter(|_| spec.silence_from_open),
        };
        let mut based = spec.base == Offset::ZERO;
        for (id, data, n) in &spec.records {
            let off = match id {
                Some(o) => {
                    st.last_id = *o;
                    *o
                }
                None => {
                    if !based {
                        based = true;
                        st.last_id = st.last_id.max(spec.base);
                        st.tail = spec.base;
                    }
                    st.next_id(now)
                }
            };
            st.records.push(Record { offset: off, data: data.clone(), messages: *n });
            st.tail = off;
            st.cnt += u64::from((*n).max(1));
        }
        if !based {
            st.last_id = st.last_id.max(spec.base);
            st.tail = spec.base;
        }
        if spec.closed {
            st.do_end(now, EndReason::Finished, None);
        }
        let e = claim(&mut st);
        let info = st.info(path);
        map.insert(path.clone(), Arc::new(MemStream { st: Mutex::new(st), notify: Notify::new() }));
        Ok((Created { created: true, info }, e))
    }

    async fn write(&self, path: &StreamPath, spec: WriteSpec) -> Result<Appended> {
        self.with(path, true, |st, now| {
            if spec.incarnation.as_ref().is_some_and(|i| *i != st.inc) {
                return Err(not_found(path));
            }
            let n = spec.records.len() as u64;
            // What `max_len` counts: messages (JSON array elements; one per binary append).
            let units: u64 = spec.records.iter().map(|(_, m)| u64::from((*m).max(1))).sum();
            if let Some(p) = &spec.producer {
                if let Some(ps) = st.producers.get(&p.id) {
                    if p.epoch < ps.epoch {
                        return Err(StreamError::Fenced { epoch: p.epoch, current_epoch: ps.epoch });
                    }
                    if p.epoch == ps.epoch && (p.seq as i64) <= ps.last {
                        return Ok(Appended {
                            tail: st.tail,
                            duplicate: true,
                            producer: Some((ps.epoch, ps.last as u64)),
                            producer_offset: Some(ps.off),
                            end: st.end.as_ref().map(|e| e.0),
                            ended_now: false,
                            incarnation: st.inc.clone(),
                        });
                    }
                }
            }
            if let Some((end, _, closer)) = &st.end {
                if let Some(p) = spec.producer.as_ref().filter(|p| closer.as_ref() == Some(*p)) {
                    return Ok(Appended {
                        tail: st.tail,
                        duplicate: true,
                        producer: Some((p.epoch, p.seq)),
                        producer_offset: Some(end.final_offset),
                        end: Some(*end),
                        ended_now: false,
                        incarnation: st.inc.clone(),
                    });
                }
                if spec.answers_found_end() {
                    return Ok(found_end(*end, st.inc.clone()));
                }
                return Err(StreamError::Closed { end: *end, incarnation: st.inc.clone() });
            }
            if let Some((id, epoch)) = &spec.fence {
                let current = st.producers.get(id).map(|p| p.epoch);
                if current != *epoch {
                    return Err(StreamError::Fenced { epoch: epoch.unwrap_or(0), current_epoch: current.unwrap_or(0) });
                }
            }
            if n > 0 {
                let mismatch = match &spec.ctn {
                    Some(c) => *c != st.ctn,
                    None => st.ctn == "application/json",
                };
                if mismatch {
                    return Err(StreamError::content_type_differs(&st.ct, spec.ctn.as_deref()));
                }
            }
            let mut count = 0;
            if let Some(p) = &spec.producer {
                match st.producers.get(&p.id) {
                    Some(ps) => {
                        count = ps.count;
                        if p.epoch > ps.epoch {
                            if p.seq != 0 {
                                return Err(StreamError::EpochMustStartAtZero { seq: p.seq });
                            }
                        } else if p.seq as i64 != ps.last + 1 {
                            return Err(StreamError::SequenceGap { expected: (ps.last + 1) as u64, received: p.seq });
                        }
                    }
                    None if p.seq != 0 => return Err(StreamError::SequenceGap { expected: 0, received: p.seq }),
                    None => {}
                }
            }
            if let (Some(s), Some(last)) = (&spec.stream_seq, &st.sq) {
                if s.as_bytes() <= last.as_bytes() {
                    return Err(StreamError::StreamSeqRegression { last: last.clone(), received: s.clone() });
                }
            }
            // A fenced end's entry is part of the end, which `max_len` never counts.
            if n > 0 && spec.fence.is_none() {
                if let Some(ml) = st.limits.max_len {
                    if st.cnt + units > ml {
                        return Err(StreamError::TooLong { limit: ml, scope: LimitScope::Stream });
                    }
                }
                if let (Some(mlw), Some(_)) = (st.limits.max_len_per_writer, &spec.producer) {
                    if count + units > mlw {
                        return Err(StreamError::TooLong { limit: mlw, scope: LimitScope::Writer });
                    }
                }
            }
            st.lw = now;
            st.ta = now;
            for (data, m) in &spec.records {
                let off = st.next_id(now);
                st.records.push(Record { offset: off, data: data.clone(), messages: *m });
                st.tail = off;
            }
            st.cnt += units;
            if let Some(s) = &spec.stream_seq {
                st.sq = Some(s.clone());
            }
            let tail = st.tail;
            if let Some(p) = &spec.producer {
                st.producers.insert(
                    p.id.clone(),
                    PState { epoch: p.epoch, last: p.seq as i64, count: count + units, off: tail },
                );
            }
            let mut ended_now = false;
            if let Some(reason) = spec.close {
                st.do_end(now, reason, spec.producer.clone());
                ended_now = true;
            }
            Ok(Appended {
                tail,
                duplicate: false,
                producer: spec.producer.as_ref().map(|p| (p.epoch, p.seq)),
                producer_offset: spec.producer.as_ref().map(|_| tail),
                end: st.end.as_ref().map(|e| e.0),
                ended_now,
                incarnation: st.inc.clone(),
            })
        })
    }

    async fn read(
        &self,
        path: &StreamPath,
        from: ReadFrom,
        max_records: usize,
        max_bytes: usize,
        touch: bool,
        incarnation: Option<&str>,
    ) -> Result<(ReadChunk, StreamInfo)> {
        self.with(path, false, |st, now| {
            if incarnation.is_some_and(|i| i != st.inc) {
                return Err(not_found(path));
            }
            if touch && st.ttl_ms.is_some() {
                st.ta = now;
            }
            Ok((st.chunk(from, max_records, max_bytes)?, st.info(path)))
        })
    }

    async fn snapshot(&self, path: &StreamPath, offset: Option<Offset>) -> Result<Snapshot> {
        self.with(path, false, |st, _| {
            let at = offset.unwrap_or(st.tail);
            if at > st.tail {
                return Err(StreamError::OffsetAhead { offset: at, tail: st.tail });
            }
            if at < st.first {
                return Err(StreamError::OffsetGone { offset: at, earliest: st.first });
            }
            let inherited: Vec<Record> = st.records.iter().filter(|r| r.offset <= at).cloned().collect();
            let next = st.records.iter().find(|r| r.offset > at && r.offset <= st.tail).cloned();
            Ok(Snapshot { info: st.info(path), inherited, next, offset: at })
        })
    }

    async fn delete(&self, path: &StreamPath) -> Result<Deleted> {
        let s = self.lookup(path).ok_or_else(|| not_found(path))?;
        let mut map = self.streams.lock().unwrap();
        let mut st = s.st.lock().unwrap();
        if st.removed {
            return Err(not_found(path));
        }
        if st.deleted {
            return Err(StreamError::Gone { path: path.to_string() });
        }
        let out = if st.refs > 0 {
            st.deleted = true;
            st.records.clear();
            Deleted::Soft
        } else {
            st.removed = true;
            map.remove(path);
            Deleted::Hard { fork_source: st.fork.as_ref().map(|f| f.source.clone()) }
        };
        drop(st);
        s.notify.notify_waiters();
        Ok(out)
    }

    async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<StreamPath>> {
        let now = now_ms();
        let map = self.streams.lock().unwrap();
        let mut out = Vec::new();
        for (path, s) in map.iter() {
            if out.len() >= limit {
                break;
            }
            if !path.as_str().starts_with(prefix) {
                continue;
            }
            let st = s.st.lock().unwrap();
            if !st.removed && !st.deleted && !st.expired(now) {
                out.push(path.clone());
            }
        }
        Ok(out)
    }

    async fn list_sorted(
        &self,
        prefix: &str,
        after: Option<&StreamPath>,
        limit: usize,
        keep: &PathFilter,
    ) -> Result<(Vec<StreamPath>, bool)> {
        let now = now_ms();
        // The map's lock is held only to take the candidates: the caller's filter (e.g. a
        // token's scopes, for every stream of the prefix) runs with no lock held, so other
        // stream operations go on meanwhile.
        let candidates: Vec<(StreamPath, Arc<MemStream>)> = {
            let map = self.streams.lock().unwrap();
            map.iter()
                .filter(|(path, _)| path.as_str().starts_with(prefix) && after.is_none_or(|a| *path > a))
                .map(|(path, s)| (path.clone(), s.clone()))
                .collect()
        };
        let mut smallest = Smallest::new(limit.saturating_add(1));
        for (path, s) in candidates {
            if !keep(&path) {
                continue;
            }
            let st = s.st.lock().unwrap();
            if !st.removed && !st.deleted && !st.expired(now) {
                drop(st);
                smallest.offer(path);
            }
        }
        Ok(smallest.page(limit))
    }

    async fn refs(&self, path: &StreamPath, add: bool) -> Result<Option<StreamPath>> {
        let Some(s) = self.lookup(path) else { return Ok(None) };
        let mut map = self.streams.lock().unwrap();
        let mut st = s.st.lock().unwrap();
        if st.removed {
            return Ok(None);
        }
        if add {
            if !st.deleted {
                st.refs += 1;
            }
            return Ok(None);
        }
        st.refs = st.refs.saturating_sub(1);
        if st.refs == 0 && st.deleted {
            st.removed = true;
            map.remove(path);
            return Ok(st.fork.as_ref().map(|f| f.source.clone()));
        }
        Ok(None)
    }

    async fn producer_epoch(&self, path: &StreamPath, id: &str) -> Result<Option<u64>> {
        self.with(path, false, |st, _| Ok(st.producers.get(id).map(|p| p.epoch)))
    }

    async fn keepalive(
        &self,
        path: &StreamPath,
        incarnation: Option<&str>,
        producer: Option<(&str, u64)>,
    ) -> Result<StreamInfo> {
        self.with(path, false, |st, now| {
            if incarnation.is_some_and(|i| i != st.inc) {
                return Err(not_found(path));
            }
            if let Some((pid, epoch)) = producer {
                if let Some(ps) = st.producers.get(pid) {
                    if epoch < ps.epoch {
                        return Err(StreamError::Fenced { epoch, current_epoch: ps.epoch });
                    }
                }
            }
            if let Some((end, _, _)) = st.end {
                return Err(StreamError::Closed { end, incarnation: st.inc.clone() });
            }
            st.lw = now;
            st.ta = now;
            Ok(st.info(path))
        })
    }

    async fn trim(&self, path: &StreamPath, through: Offset) -> Result<Offset> {
        self.with(path, true, |st, _| {
            if through > st.tail {
                return Err(StreamError::OffsetAhead { offset: through, tail: st.tail });
            }
            if through > st.first {
                st.records.retain(|r| r.offset > through);
                st.first = through;
            }
            Ok(st.first)
        })
    }

    async fn wait(
        &self,
        path: &StreamPath,
        after: Offset,
        incarnation: &str,
        max_bytes: usize,
        timeout: Duration,
    ) -> Result<ReadChunk> {
        let until = Instant::now() + timeout;
        loop {
            let s = self.lookup(path).ok_or_else(|| not_found(path))?;
            let notified = s.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (chunk, next_event) = {
                let mut st = s.st.lock().unwrap();
                if st.removed || st.inc != incarnation {
                    return Err(not_found(path));
                }
                if st.deleted {
                    return Err(StreamError::Gone { path: path.to_string() });
                }
                let now = now_ms();
                if st.check_silence(now) {
                    s.notify.notify_waiters();
                }
                let c = st.chunk(ReadFrom::At(after), 10_000, max_bytes)?;
                (c, st.next_event_in(now))
            };
            if !chunk.records.is_empty() || chunk.end.is_some() {
                return Ok(chunk);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(chunk);
            }
            let nap = next_event.map_or(left, |ms| left.min(Duration::from_millis(ms.max(1))));
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep(nap) => {}
            }
        }
    }
}

fn expiry_fields(e: Expiry) -> (Option<u64>, Option<u64>) {
    match e {
        Expiry::None => (None, None),
        Expiry::TtlSecs(s) => (Some(s * 1000), None),
        Expiry::At(t) => (None, Some(t)),
    }
}
