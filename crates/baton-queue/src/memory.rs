//! In-memory backend: the same model as Redis Streams consumer groups (an append-only log per
//! queue, a last-delivered id, a pending entries list with owner, delivery time and count), held
//! in process memory. Leases expire by idle time exactly as on Redis, so a consumer that stops
//! renewing (closed, aborted, or hung past `max_processing_time`) fails over after
//! `claim_timeout`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::Notify;

use crate::backend::{Backend, ConsumerBackend, ConsumerSpec, RawDelivery, Reclaimed, Renewer};
use crate::{DeadLetter, MessageId, QueueError, QueueStats};

#[derive(Default)]
pub(crate) struct MemoryBackend {
    queues: Mutex<HashMap<String, Arc<MemQueue>>>,
}

#[derive(Default)]
struct MemQueue {
    state: Mutex<QState>,
    notify: Notify,
}

struct Entry {
    payload: Bytes,
    /// Deliveries made before the entry was (re-)offered (from a long RetryAfter).
    prior: u32,
}

struct Pel {
    consumer: String,
    delivered_at: Instant,
    deliveries: u32,
}

#[derive(Default)]
struct QState {
    last_id: MessageId,
    entries: BTreeMap<MessageId, Entry>,
    last_delivered: MessageId,
    pending: BTreeMap<MessageId, Pel>,
    consumers: HashMap<String, Instant>,
    delayed: BTreeMap<(Instant, MessageId), Entry>,
    dead: BTreeMap<MessageId, DeadLetter>,
    last_dead_id: MessageId,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The next id after `last`, like Redis: current ms, sequence bumped within the same ms.
fn next_id(last: &mut MessageId) -> MessageId {
    let ms = now_ms();
    let id = if ms > last.ms { MessageId { ms, seq: 0 } } else { MessageId { ms: last.ms, seq: last.seq + 1 } };
    *last = id;
    id
}

impl QState {
    fn append(&mut self, payload: Bytes, prior: u32) -> MessageId {
        let id = next_id(&mut self.last_id);
        self.entries.insert(id, Entry { payload, prior });
        id
    }

    fn owned_by(&self, id: &MessageId, consumer: &str) -> bool {
        self.pending.get(id).is_some_and(|p| p.consumer == consumer)
    }

    fn remove(&mut self, id: &MessageId) -> Option<Entry> {
        self.pending.remove(id);
        self.entries.remove(id)
    }

    fn bury(&mut self, id: MessageId, payload: Bytes, deliveries: u32, reason: &str) {
        let dead_id = next_id(&mut self.last_dead_id);
        self.dead.insert(
            dead_id,
            DeadLetter {
                id: dead_id,
                original_id: id,
                payload,
                deliveries,
                reason: reason.to_string(),
                dead_lettered_at_ms: now_ms(),
            },
        );
    }
}

impl MemoryBackend {
    fn queue(&self, name: &str) -> Arc<MemQueue> {
        self.queues.lock().unwrap().entry(name.to_string()).or_default().clone()
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    async fn offer(&self, queue: &str, payloads: &[Bytes]) -> Result<Vec<MessageId>, QueueError> {
        let q = self.queue(queue);
        let ids = {
            let mut st = q.state.lock().unwrap();
            payloads.iter().map(|p| st.append(p.clone(), 0)).collect()
        };
        q.notify.notify_waiters();
        Ok(ids)
    }

    async fn open_consumer(&self, spec: ConsumerSpec) -> Result<Arc<dyn ConsumerBackend>, QueueError> {
        let q = self.queue(&spec.queue);
        q.state.lock().unwrap().consumers.insert(spec.consumer.clone(), Instant::now());
        Ok(Arc::new(MemConsumer { q, spec, cursor: Mutex::new(MessageId::ZERO) }))
    }

    async fn renewer(&self, spec: ConsumerSpec) -> Result<Box<dyn Renewer>, QueueError> {
        Ok(Box::new(MemRenewer { q: self.queue(&spec.queue), spec }))
    }

    async fn stats(&self, queue: &str) -> Result<QueueStats, QueueError> {
        let q = self.queue(queue);
        let st = q.state.lock().unwrap();
        Ok(QueueStats {
            length: st.entries.len() as u64,
            pending: st.pending.len() as u64,
            consumers: st.consumers.len() as u64,
            lag: st.entries.range(next_after(st.last_delivered)..).count() as u64,
            delayed: st.delayed.len() as u64,
            dead_letters: st.dead.len() as u64,
        })
    }

    async fn dead_letters(&self, queue: &str, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        let q = self.queue(queue);
        let st = q.state.lock().unwrap();
        Ok(st.dead.values().take(limit).cloned().collect())
    }

    async fn replay_dead_letter(&self, queue: &str, id: MessageId) -> Result<MessageId, QueueError> {
        let q = self.queue(queue);
        let new_id = {
            let mut st = q.state.lock().unwrap();
            let d = st.dead.remove(&id).ok_or(QueueError::DeadLetterNotFound(id))?;
            st.append(d.payload, 0)
        };
        q.notify.notify_waiters();
        Ok(new_id)
    }

    async fn replay_dead_letters(&self, queue: &str, limit: usize) -> Result<u64, QueueError> {
        let q = self.queue(queue);
        let n = {
            let mut st = q.state.lock().unwrap();
            let ids: Vec<MessageId> = st.dead.keys().take(limit).copied().collect();
            for id in &ids {
                let d = st.dead.remove(id).expect("listed");
                st.append(d.payload, 0);
            }
            ids.len() as u64
        };
        q.notify.notify_waiters();
        Ok(n)
    }

    async fn purge_dead_letters(&self, queue: &str) -> Result<u64, QueueError> {
        let q = self.queue(queue);
        let mut st = q.state.lock().unwrap();
        let n = st.dead.len() as u64;
        st.dead.clear();
        Ok(n)
    }
}

fn next_after(id: MessageId) -> MessageId {
    MessageId { ms: id.ms, seq: id.seq + 1 }
}

struct MemConsumer {
    q: Arc<MemQueue>,
    spec: ConsumerSpec,
    cursor: Mutex<MessageId>,
}

impl MemConsumer {
    fn take_new(&self, count: usize) -> Vec<RawDelivery> {
        let mut st = self.q.state.lock().unwrap();
        st.consumers.insert(self.spec.consumer.clone(), Instant::now());
        let start = next_after(st.last_delivered);
        let picked: Vec<(MessageId, Bytes, u32)> = st
            .entries
            .range(start..)
            .take(count)
            .map(|(id, e)| (*id, e.payload.clone(), e.prior + 1))
            .collect();
        let now = Instant::now();
        for (id, _, _) in &picked {
            st.last_delivered = *id;
            st.pending.insert(
                *id,
                Pel { consumer: self.spec.consumer.clone(), delivered_at: now, deliveries: 1 },
            );
        }
        picked
            .into_iter()
            .map(|(id, payload, deliveries)| RawDelivery { id, payload: Some(payload), deliveries })
            .collect()
    }
}

#[async_trait]
impl ConsumerBackend for MemConsumer {
    async fn read_new(&self, count: usize, block: Duration) -> Result<Vec<RawDelivery>, QueueError> {
        let deadline = tokio::time::Instant::now() + block;
        loop {
            let notified = self.q.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let got = self.take_new(count);
            if !got.is_empty() {
                return Ok(got);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Ok(Vec::new());
            }
        }
    }

    async fn reclaim(&self, count: usize, exclude: &[MessageId]) -> Result<Reclaimed, QueueError> {
        let mut out = Reclaimed::default();
        let promoted_any;
        {
            let mut st = self.q.state.lock().unwrap();
            let now = Instant::now();
            // Promote due delayed entries (new ids at the tail).
            while let Some(((due, _), _)) = st.delayed.first_key_value() {
                if *due > now {
                    break;
                }
                let (_, e) = st.delayed.pop_first().expect("peeked");
                st.append(e.payload, e.prior);
                out.promoted += 1;
            }
            promoted_any = out.promoted > 0;
            // Take over idle pending entries, paging with a cursor like XAUTOCLAIM.
            let mut cursor = *self.cursor.lock().unwrap();
            let limit_scan = count.saturating_mul(10).max(100);
            let mut next_cursor = MessageId::ZERO;
            let candidates: Vec<MessageId> =
                st.pending.range(cursor..).map(|(id, _)| *id).take(limit_scan + 1).collect();
            for (scanned, id) in candidates.into_iter().enumerate() {
                if out.deliveries.len() >= count || scanned >= limit_scan {
                    next_cursor = id;
                    break;
                }
                let p = st.pending.get(&id).expect("listed");
                if now.duration_since(p.delivered_at) < self.spec.claim_timeout || exclude.contains(&id) {
                    continue;
                }
                let deliveries_in_pel = p.deliveries + 1;
                let Some(entry) = st.entries.get(&id) else {
                    st.pending.remove(&id);
                    out.deleted += 1;
                    continue;
                };
                let total = deliveries_in_pel + entry.prior;
                if self.spec.max_deliveries.is_some_and(|m| total > m) {
                    let e = st.remove(&id).expect("present");
                    st.bury(id, e.payload, total - 1, "max deliveries exceeded");
                    out.dead_lettered += 1;
                    continue;
                }
                let payload = entry.payload.clone();
                let p = st.pending.get_mut(&id).expect("listed");
                p.consumer = self.spec.consumer.clone();
                p.delivered_at = now;
                p.deliveries = deliveries_in_pel;
                out.deliveries.push(RawDelivery { id, payload: Some(payload), deliveries: total });
            }
            if count > 0 {
                cursor = next_cursor;
                *self.cursor.lock().unwrap() = cursor;
            }
            st.consumers.insert(self.spec.consumer.clone(), now);
        }
        if promoted_any {
            self.q.notify.notify_waiters();
        }
        Ok(out)
    }

    fn ack_now(&self, id: MessageId) -> Option<bool> {
        let mut st = self.q.state.lock().unwrap();
        let owned = st.owned_by(&id, &self.spec.consumer);
        if owned {
            st.remove(&id);
        }
        Some(owned)
    }

    async fn ack(&self, ids: &[MessageId]) -> Result<Vec<bool>, QueueError> {
        let mut st = self.q.state.lock().unwrap();
        Ok(ids
            .iter()
            .map(|id| {
                if st.owned_by(id, &self.spec.consumer) {
                    st.remove(id);
                    true
                } else {
                    false
                }
            })
            .collect())
    }

    async fn retry_after(&self, id: MessageId, delay: Duration) -> Result<bool, QueueError> {
        let mut st = self.q.state.lock().unwrap();
        if !st.owned_by(&id, &self.spec.consumer) {
            return Ok(false);
        }
        let now = Instant::now();
        if delay < self.spec.claim_timeout {
            let idle = self.spec.claim_timeout - delay;
            let p = st.pending.get_mut(&id).expect("owned");
            p.delivered_at = now.checked_sub(idle).unwrap_or(now);
            // A scheduled re-poll, not a failure: does not count toward max_deliveries.
            p.deliveries = p.deliveries.saturating_sub(1);
        } else {
            let deliveries = st.pending.get(&id).expect("owned").deliveries;
            if let Some(e) = st.remove(&id) {
                let prior = e.prior + deliveries.saturating_sub(1);
                st.delayed.insert((now + delay, id), Entry { payload: e.payload, prior });
            }
        }
        Ok(true)
    }

    async fn dead_letter(&self, id: MessageId, deliveries: u32, reason: &str) -> Result<bool, QueueError> {
        let mut st = self.q.state.lock().unwrap();
        if !st.owned_by(&id, &self.spec.consumer) {
            return Ok(false);
        }
        let e = st.remove(&id).expect("owned entries exist");
        st.bury(id, e.payload, deliveries, reason);
        Ok(true)
    }

    async fn reap_idle_consumers(&self, idle: Duration) -> Result<u64, QueueError> {
        let mut st = self.q.state.lock().unwrap();
        let now = Instant::now();
        let busy: std::collections::HashSet<String> = st.pending.values().map(|p| p.consumer.clone()).collect();
        let me = self.spec.consumer.clone();
        let before = st.consumers.len();
        st.consumers
            .retain(|name, seen| *name == me || busy.contains(name) || now.duration_since(*seen) < idle);
        Ok((before - st.consumers.len()) as u64)
    }
}

struct MemRenewer {
    q: Arc<MemQueue>,
    spec: ConsumerSpec,
}

#[async_trait]
impl Renewer for MemRenewer {
    async fn renew(&mut self, renew: &[MessageId], release: &[MessageId]) -> Result<Vec<MessageId>, QueueError> {
        let mut st = self.q.state.lock().unwrap();
        let now = Instant::now();
        let mut lost = Vec::new();
        for id in renew {
            match st.pending.get_mut(id) {
                Some(p) if p.consumer == self.spec.consumer => p.delivered_at = now,
                _ => lost.push(*id),
            }
        }
        for id in release {
            if let Some(p) = st.pending.get_mut(id) {
                if p.consumer == self.spec.consumer {
                    p.delivered_at = now.checked_sub(self.spec.claim_timeout).unwrap_or(now);
                }
            }
        }
        st.consumers.insert(self.spec.consumer.clone(), now);
        Ok(lost)
    }
}
