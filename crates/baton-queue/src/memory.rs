//! In-memory backend: the same model as Redis Streams consumer groups (an append-only log per
//! queue, a last-delivered id, a pending entries list with owner, delivery time and count), held
//! in process memory. Leases expire by idle time exactly as on Redis, so a consumer that stops
//! renewing (closed, aborted, or hung past `max_processing_time`) fails over after
//! `claim_timeout`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::Notify;

use crate::backend::{
    Beat, ConsumerBackend, ConsumerSpec, Owned, QueueBackend, RawDelivery, Reclaimed, ScheduleOp, ScheduleReply,
    Settle, SettleOp, Throttle, PARKED,
};
use crate::{DeadLetter, MessageId, QueueError, QueueStats};

#[derive(Default)]
pub(crate) struct MemoryQueueBackend {
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
    /// Its concurrency key, if any (boxed: most entries have none, and the log's entries stay
    /// small).
    key: Option<Box<EntryKey>>,
    /// Its priority ([`crate::OfferOptions::priority`]).
    priority: i8,
}

struct EntryKey {
    key: Arc<str>,
    /// Promoted from its key's waiting line (or requeued) holding a slot of its key already.
    holds: bool,
    /// Delayed by the per-key rate limit as its key's head and not read back yet: when read, it
    /// is charged and the next of its key's line becomes the head (Redis: the field `kr`).
    rated: bool,
    /// A requeued copy: charged for its key's rate when first taken, so the next read takes it
    /// past the per-key rate gate (Redis: the field `kc`).
    charged: bool,
}

impl Entry {
    fn keyed(payload: Bytes, prior: u32, key: Option<Arc<str>>) -> Self {
        Entry {
            payload,
            prior,
            key: key.map(|key| Box::new(EntryKey { key, holds: false, rated: false, charged: false })),
            priority: 0,
        }
    }

    /// The same entry, of priority `priority`.
    fn with_priority(mut self, priority: i8) -> Self {
        self.priority = priority;
        self
    }

    /// The same entry, not marked as charged by the per-key rate limit (a redelivery is charged
    /// again when read, as on Redis).
    fn unrated(mut self) -> Self {
        if let Some(k) = &mut self.key {
            k.rated = false;
            k.charged = false;
        }
        self
    }

    /// The same entry marked as charged for its key's rate already (a requeued copy).
    fn charged(mut self) -> Self {
        if let Some(k) = &mut self.key {
            k.rated = false;
            k.charged = true;
        }
        self
    }

    /// The same entry, holding a slot of its key (or not).
    fn holding(mut self, holds: bool) -> Self {
        if let Some(k) = &mut self.key {
            k.holds = holds;
        }
        self
    }
}

struct Pel {
    /// The owner: a consumer name or [`PARKED`] (shared, not copied per delivery).
    consumer: Arc<str>,
    delivered_at: Instant,
    deliveries: u32,
    /// The fence of the latest delivery: 0 for a read, raised by each reclaim (`backend` docs).
    fence: u64,
}

/// A consumer's liveness record: its last heartbeat (`None`: it stopped while owning entries, and
/// leaves once they are taken) and its claim timeout.
struct Live {
    seen: Option<Instant>,
    claim: Duration,
}

impl Live {
    fn now(claim: Duration) -> Self {
        Live { seen: Some(Instant::now()), claim }
    }

    /// Silent for at least `d` (always, once stopped).
    fn silent_for(&self, now: Instant, d: Duration) -> bool {
        self.seen.is_none_or(|seen| now.duration_since(seen) >= d)
    }
}

#[derive(Default)]
struct QState {
    last_id: MessageId,
    entries: BTreeMap<MessageId, Entry>,
    last_delivered: MessageId,
    pending: BTreeMap<MessageId, Pel>,
    /// Registered consumers and their liveness record.
    consumers: HashMap<String, Live>,
    delayed: BTreeMap<(Instant, MessageId), Entry>,
    /// Scheduled entries (`MessageStream::offer_at`): name -> their key in `delayed`, and back.
    /// (Their due time in ms is kept as given, for counts.)
    scheduled: HashMap<String, ((Instant, MessageId), u64)>,
    scheduled_names: HashMap<MessageId, String>,
    /// Keys of scheduled entries in `delayed` (never a stream id: stream ids are drawn from
    /// `last_id`, these from here, with `seq` offset by 2^63).
    last_scheduled: MessageId,
    dead: BTreeMap<MessageId, DeadLetter>,
    last_dead_id: MessageId,
    /// Paused since (ms since the Unix epoch): the gate of [`MemConsumer::take_new`].
    paused_since: Option<u64>,
    /// The back-off's end (a handler answered `RateLimited`): a timed gate of `take_new`.
    backoff_until: Option<Instant>,
    /// The rate limit's GCRA theoretical arrival time: a timed gate of `take_new`.
    rate_tat: Option<Instant>,
    /// Concurrency caps (as the Redis keys of `keys::key_held` etc.): entries holding a slot of
    /// each key, the holders, and each key's waiting line (entries taken out of the log).
    key_held: HashMap<Arc<str>, u32>,
    key_ids: HashMap<MessageId, Arc<str>>,
    key_wait: HashMap<Arc<str>, VecDeque<Entry>>,
    /// The per-key rate limit's state of each key (Redis: `keys::key_rate`), and the size at
    /// which stale states are removed next.
    key_rate: HashMap<Arc<str>, KeyRate>,
    key_rate_clean_at: usize,
    /// A read found `max_concurrency` reached: the next removal from the pending list wakes.
    slot_waiting: bool,
    /// Waiters must be woken (a slot freed, an entry promoted) once the lock is released.
    wake: bool,
    /// The priorities' ready set (as `read.lua`'s): new entries taken out of the log, by
    /// (-priority, arrival id), while the queue holds new entries of a priority other than 0.
    ready: BTreeMap<(i8, MessageId), Entry>,
    /// An entry of a priority other than 0 was appended to the log since the last gated read
    /// (`~new` on Redis): the next read orders new entries by priority.
    prio_new: bool,
}

/// One key's per-key rate limit state (as `read.lua`'s): its GCRA theoretical arrival time
/// (moved on as its entries are taken), its entries waiting for the rate (its head, in the
/// delayed set or promoted and not read yet, and its line), and its line: the entries behind the
/// head, in offer order, out of the delayed set until each becomes the head.
struct KeyRate {
    tat: Instant,
    delayed: u32,
    line: VecDeque<(MessageId, Entry)>,
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
    fn append_entry(&mut self, e: Entry) -> MessageId {
        if e.priority != 0 {
            self.prio_new = true;
        }
        let id = next_id(&mut self.last_id);
        self.entries.insert(id, e);
        id
    }

    /// `id` left the pending list: its key slot (if it held one) goes to the key's oldest waiter
    /// (appended holding it) or is freed; a read waiting for a `max_concurrency` slot is woken.
    fn release(&mut self, id: &MessageId) {
        if std::mem::take(&mut self.slot_waiting) {
            self.wake = true;
        }
        if self.key_ids.is_empty() {
            return;
        }
        let Some(k) = self.key_ids.remove(id) else { return };
        match self.key_wait.get_mut(&k).and_then(|w| w.pop_front()) {
            Some(e) => {
                if self.key_wait.get(&k).is_some_and(|w| w.is_empty()) {
                    self.key_wait.remove(&k);
                }
                let nid = self.append_entry(e.holding(true));
                self.key_ids.insert(nid, k);
                self.wake = true;
            }
            None => {
                if let Some(n) = self.key_held.get_mut(&k) {
                    *n -= 1;
                    if *n == 0 {
                        self.key_held.remove(&k);
                    }
                }
            }
        }
    }

    /// Who owns `id` from the point of view of `me` (see [`Settle::released`]); a delivery of
    /// another fence than `fence` (when given) counts as another owner's.
    fn owner(&self, id: &MessageId, me: &str, released: bool, fence: Option<u64>) -> Owned {
        match self.pending.get(id) {
            None => Owned::Gone,
            Some(p) if fence.is_some_and(|f| f != p.fence) => Owned::Other,
            Some(p) if &*p.consumer == me || (released && &*p.consumer == PARKED) => Owned::Done,
            Some(_) => Owned::Other,
        }
    }

    fn remove(&mut self, id: &MessageId) -> Option<Entry> {
        let e = self.take_out(id);
        self.release(id);
        e
    }

    /// Out of the pending list and the log, its key slot kept (see [`QState::release`]).
    fn take_out(&mut self, id: &MessageId) -> Option<Entry> {
        self.pending.remove(id);
        self.entries.remove(id)
    }

    /// Entry `e` (id `id`) to the dead letters, with its key and priority.
    fn bury(&mut self, id: MessageId, e: Entry, deliveries: u32, reason: &str) {
        let dead_id = next_id(&mut self.last_dead_id);
        self.dead.insert(
            dead_id,
            DeadLetter {
                id: dead_id,
                original_id: id,
                payload: e.payload,
                deliveries,
                reason: reason.to_string(),
                dead_lettered_at_ms: now_ms(),
                concurrency_key: e.key.map(|k| k.key.to_string()),
                priority: e.priority,
            },
        );
    }

    /// A dead letter offered again (a new id at the tail), with its key and priority.
    fn replay(&mut self, d: DeadLetter) -> MessageId {
        let e = Entry::keyed(d.payload, 0, d.concurrency_key.map(Arc::from)).with_priority(d.priority);
        self.append_entry(e)
    }
}

/// An instant for a wall-clock time in ms (now for a time in the past).
fn instant_of(due_ms: u64) -> Instant {
    let now = now_ms();
    Instant::now() + Duration::from_millis(due_ms.saturating_sub(now))
}

impl MemoryQueueBackend {
    fn queue(&self, name: &str) -> Arc<MemQueue> {
        self.queues.lock().unwrap().entry(name.to_string()).or_default().clone()
    }
}

#[async_trait]
impl QueueBackend for MemoryQueueBackend {
    async fn offer(
        &self,
        queue: &str,
        payloads: &[Bytes],
        key: Option<&str>,
        priority: i8,
    ) -> Result<Vec<MessageId>, QueueError> {
        let q = self.queue(queue);
        let key: Option<Arc<str>> = key.map(Into::into);
        let ids = {
            let mut st = q.state.lock().unwrap();
            payloads
                .iter()
                .map(|p| st.append_entry(Entry::keyed(p.clone(), 0, key.clone()).with_priority(priority)))
                .collect()
        };
        q.notify.notify_waiters();
        Ok(ids)
    }

    async fn schedule(&self, queue: &str, op: ScheduleOp<'_>) -> Result<ScheduleReply, QueueError> {
        let q = self.queue(queue);
        let mut st = q.state.lock().unwrap();
        let st = &mut *st;
        Ok(match op {
            ScheduleOp::Add { name, due_ms, payload, key, priority } => {
                let old = st.scheduled.remove(name);
                let entry =
                    Entry::keyed(Bytes::copy_from_slice(payload), 0, key.map(Into::into)).with_priority(priority);
                let key = match old {
                    Some((k, _)) => {
                        st.delayed.remove(&k);
                        k.1
                    }
                    None => {
                        let mut id = next_id(&mut st.last_scheduled);
                        id.seq |= 1 << 63;
                        st.scheduled_names.insert(id, name.to_string());
                        id
                    }
                };
                let at = (instant_of(due_ms), key);
                st.delayed.insert(at, entry);
                st.scheduled.insert(name.to_string(), (at, due_ms));
                ScheduleReply::Done(old.is_none())
            }
            ScheduleOp::Move { name, due_ms } => match st.scheduled.get_mut(name) {
                None => ScheduleReply::Done(false),
                Some((at, ms)) => {
                    let e = st.delayed.remove(at).expect("a scheduled entry is delayed");
                    at.0 = instant_of(due_ms);
                    *ms = due_ms;
                    st.delayed.insert(*at, e);
                    ScheduleReply::Done(true)
                }
            },
            ScheduleOp::Remove { name } => match st.scheduled.remove(name) {
                None => ScheduleReply::Done(false),
                Some((at, _)) => {
                    st.delayed.remove(&at);
                    st.scheduled_names.remove(&at.1);
                    ScheduleReply::Done(true)
                }
            },
            ScheduleOp::Count => {
                let first = st.scheduled.values().min().map(|(_, ms)| *ms);
                ScheduleReply::Count(st.scheduled.len() as u64, first)
            }
        })
    }

    async fn open_consumer(&self, spec: ConsumerSpec) -> Result<Arc<dyn ConsumerBackend>, QueueError> {
        let q = self.queue(&spec.queue);
        q.state.lock().unwrap().consumers.insert(spec.consumer.clone(), Live::now(spec.claim_timeout));
        let me: Arc<str> = spec.consumer.as_str().into();
        Ok(Arc::new(MemConsumer { q, spec, me, parked: PARKED.into(), promote_hint: Mutex::new(None) }))
    }

    async fn stats(&self, queue: &str) -> Result<QueueStats, QueueError> {
        let q = self.queue(queue);
        let st = q.state.lock().unwrap();
        let now = Instant::now();
        let live = st.consumers.values().filter(|l| !l.silent_for(now, l.claim)).count() as u64;
        Ok(QueueStats {
            length: (st.entries.len() + st.ready.len()) as u64,
            pending: st.pending.len() as u64,
            consumers: live,
            dead_consumers: st.consumers.len() as u64 - live,
            lag: (st.entries.range(next_after(st.last_delivered)..).count() + st.ready.len()) as u64,
            delayed: (st.delayed.len() + st.key_rate.values().map(|r| r.line.len()).sum::<usize>()) as u64,
            dead_letters: st.dead.len() as u64,
            paused: st.paused_since.is_some(),
            paused_since_ms: st.paused_since,
            backoff_ms: st
                .backoff_until
                .map(|u| u.saturating_duration_since(now).as_millis() as u64)
                .filter(|ms| *ms > 0),
            key_waiting: st.key_wait.values().map(|w| w.len() as u64).sum(),
            key_rate_delayed: st.key_rate.values().map(|r| r.delayed as u64).sum(),
            keys: key_stats(&st),
        })
    }

    async fn set_paused(&self, queue: &str, paused: bool) -> Result<bool, QueueError> {
        let q = self.queue(queue);
        let changed = {
            let mut st = q.state.lock().unwrap();
            let changed = st.paused_since.is_some() != paused;
            if changed {
                st.paused_since = paused.then(now_ms);
            }
            changed
        };
        if changed && !paused {
            q.notify.notify_waiters();
        }
        Ok(changed)
    }

    async fn consumers(&self, queue: &str, max_leases: usize) -> Result<Vec<crate::ConsumerInfo>, QueueError> {
        let q = self.queue(queue);
        let st = q.state.lock().unwrap();
        let (now, now_wall) = (Instant::now(), now_ms());
        let mut names: Vec<&String> = st.consumers.keys().collect();
        names.sort();
        Ok(names
            .into_iter()
            .map(|name| {
                let l = &st.consumers[name];
                let owned = st.pending.iter().filter(|(_, p)| &*p.consumer == name.as_str());
                let pending = owned.clone().count() as u64;
                let leases = owned
                    .take(max_leases)
                    .map(|(id, p)| crate::LeaseInfo {
                        id: *id,
                        idle_ms: now.duration_since(p.delivered_at).as_millis() as u64,
                        deliveries: p.deliveries,
                        payload: st.entries.get(id).map(|e| e.payload.clone()),
                    })
                    .collect();
                let seen = l.seen.map(|s| now_wall.saturating_sub(now.duration_since(s).as_millis() as u64));
                crate::ConsumerInfo {
                    name: name.clone(),
                    alive: !l.silent_for(now, l.claim),
                    last_heartbeat_ms: seen,
                    claim_timeout_ms: Some(l.claim.as_millis() as u64),
                    pending,
                    leases,
                }
            })
            .collect())
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
            st.replay(d)
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
                st.replay(d);
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

/// [`QueueStats::keys`]: the busiest keys (as stats.lua).
fn key_stats(st: &QState) -> Vec<crate::KeyStats> {
    let mut list: Vec<crate::KeyStats> = Vec::new();
    let mut index: HashMap<Arc<str>, usize> = HashMap::new();
    let mut slot = |k: &Arc<str>, list: &mut Vec<crate::KeyStats>| -> usize {
        *index.entry(k.clone()).or_insert_with(|| {
            list.push(crate::KeyStats { key: k.to_string(), ..Default::default() });
            list.len() - 1
        })
    };
    for (k, n) in &st.key_held {
        let i = slot(k, &mut list);
        list[i].active = *n as u64;
    }
    for (k, w) in &st.key_wait {
        let i = slot(k, &mut list);
        list[i].waiting = w.len() as u64;
    }
    for (k, r) in st.key_rate.iter().filter(|(_, r)| r.delayed > 0) {
        let i = slot(k, &mut list);
        list[i].rate_delayed = r.delayed as u64;
    }
    list.sort_by(|a, b| {
        (b.active + b.waiting + b.rate_delayed).cmp(&(a.active + a.waiting + a.rate_delayed)).then(a.key.cmp(&b.key))
    });
    list.truncate(QueueStats::MAX_KEYS);
    list
}

fn next_after(id: MessageId) -> MessageId {
    MessageId { ms: id.ms, seq: id.seq + 1 }
}

struct MemConsumer {
    q: Arc<MemQueue>,
    spec: ConsumerSpec,
    /// `spec.consumer` and [`PARKED`], shared by the pending entries they own.
    me: Arc<str>,
    parked: Arc<str>,
    /// [`ConsumerBackend::take_promote_hint`].
    promote_hint: Mutex<Option<Instant>>,
}

impl MemConsumer {
    fn me(&self) -> &str {
        &self.spec.consumer
    }

    /// The gated read (see [`ConsumerBackend::read_new`]): the gates are checked under the same
    /// lock that assigns the entries, as `read.lua` does. `Ok((entries, more))`, `more`: nothing
    /// was taken but entries are left to look at (the bound on entries moved to waiting lines per
    /// call was reached): call again at once. `Err`: a timed gate (back-off, rate limit) is shut
    /// and opens by itself after that long.
    fn take_new(&self, count: usize) -> Result<(Vec<RawDelivery>, bool), (Duration, Throttle)> {
        let mut st = self.q.state.lock().unwrap();
        let st = &mut *st;
        if st.paused_since.is_some() {
            return Ok((Vec::new(), false));
        }
        let now = Instant::now();
        let mut count = count;
        // The gates in read.lua's order: back-off, max_concurrency, rate limit, per key.
        if let Some(until) = st.backoff_until.filter(|u| *u > now) {
            return Err((until - now, Throttle::Backoff));
        }
        if let Some(max) = self.spec.max_concurrency {
            let held = st.pending.len();
            if held >= max as usize {
                st.slot_waiting = true;
                return Ok((Vec::new(), false));
            }
            count = count.min(max as usize - held);
        }
        let mut rate = None;
        if let Some(r) = &self.spec.rate_limit {
            let (t, tau) = (r.interval(), r.tolerance());
            let tat = st.rate_tat.map_or(now, |x| x.max(now));
            if tat > now + tau {
                return Err((tat - (now + tau), Throttle::RateLimit));
            }
            let k = ((now + tau - tat).as_nanos() / t.as_nanos()) as usize + 1;
            count = count.min(k);
            rate = Some((tat, t));
        }
        let key_rate = self.spec.rate_limit_per_key;
        let (picked, more, due) = if st.ready.is_empty() && !st.prio_new {
            Self::pick(st, count, self.spec.concurrency_per_key, key_rate)
        } else {
            Self::pick_by_priority(st, count, self.spec.concurrency_per_key, key_rate)
        };
        if let Some(due) = due {
            let mut hint = self.promote_hint.lock().unwrap();
            *hint = Some(hint.map_or(due, |h| h.min(due)));
        }
        // The rate limit's tat moves on by the entries taken.
        if let Some((tat, t)) = rate.filter(|_| !picked.is_empty()) {
            st.rate_tat = Some(tat + t * picked.len() as u32);
        }
        Ok((self.assign(st, picked), more))
    }

    /// The entries a gated read takes (up to `count`, in order), past the per-key cap `cap` and
    /// then the per-key rate limit `rate`, as read.lua: an entry whose key is at its cap, or has
    /// waiters, moves to the end of the key's waiting line; an entry over its key's rate moves
    /// to the delayed set as its key's head (keeping its key slot), due when its key's bucket
    /// admits it, or, behind the key's head, to the end of the key's rate line. `more` as in [`MemConsumer::take_new`]; the last element: when the
    /// earliest entry moved to the delayed set is due.
    #[allow(clippy::type_complexity)]
    fn pick(
        st: &mut QState,
        count: usize,
        cap: Option<u32>,
        rate: Option<crate::RateLimit>,
    ) -> (Vec<(MessageId, Bytes, u32)>, bool, Option<Instant>) {
        let start = next_after(st.last_delivered);
        if rate.is_none() && !st.key_rate.is_empty() {
            // No per-key rate limit (any more): the entries parked in the keys' lines are due now,
            // as read.lua releases them.
            let now = Instant::now();
            for (_, r) in std::mem::take(&mut st.key_rate) {
                for (id, e) in r.line {
                    st.delayed.insert((now, id), e);
                }
            }
        }
        if cap.is_none() && rate.is_none() {
            // No per-key gate: the entries in order, as they are.
            let picked: Vec<(MessageId, Bytes, u32)> =
                st.entries.range(start..).take(count).map(|(id, e)| (*id, e.payload.clone(), e.prior + 1)).collect();
            if let Some((last, _, _)) = picked.last() {
                st.last_delivered = *last;
            }
            return (picked, false, None);
        }
        let now = Instant::now();
        if rate.is_some() && st.key_rate.len() >= st.key_rate_clean_at {
            // Stale states (tat past, nothing delayed) go; amortized over the reads.
            st.key_rate.retain(|_, r| r.delayed > 0 || r.tat > now);
            st.key_rate_clean_at = (st.key_rate.len() * 2).max(1024);
        }
        let mut picked: Vec<(MessageId, Bytes, u32)> = Vec::with_capacity(count);
        let mut first_due: Option<Instant> = None;
        // Bounded, as in read.lua: what is left waits for the next read (woken at once).
        let mut looked = 0;
        while picked.len() < count && looked < 10_000 {
            let Some((&id, e)) = st.entries.range(next_after(st.last_delivered)..).next() else { break };
            looked += 1;
            st.last_delivered = id;
            let Some(ek) = e.key.as_ref() else {
                picked.push((id, e.payload.clone(), e.prior + 1));
                continue;
            };
            let (k, mut holds, rated, charged) = (ek.key.clone(), ek.holds, ek.rated, ek.charged);
            if rated || charged {
                if let Some(ek) = st.entries.get_mut(&id).and_then(|e| e.key.as_mut()) {
                    ek.rated = false;
                    ek.charged = false;
                }
            }
            // concurrency_per_key first: a slot of its key, or the end of the key's waiting line.
            if let Some(cap) = cap.filter(|_| !holds) {
                let held = st.key_held.get(&k).copied().unwrap_or(0);
                if held < cap && !st.key_wait.contains_key(&k) {
                    *st.key_held.entry(k.clone()).or_default() += 1;
                    st.key_ids.insert(id, k.clone());
                    holds = true;
                } else {
                    let e = st.entries.remove(&id).expect("listed");
                    st.key_wait.entry(k).or_default().push_back(e);
                    continue;
                }
            }
            // Then the key's rate: charged when taken, so that it spaces starts (a requeued copy
            // was charged when first taken).
            if let Some(r) = rate.as_ref().filter(|_| !charged) {
                let (t, tau) = (r.interval(), r.tolerance());
                let kr =
                    st.key_rate.entry(k.clone()).or_insert(KeyRate { tat: now, delayed: 0, line: VecDeque::new() });
                if rated {
                    // The key's head, read back.
                    kr.delayed = kr.delayed.saturating_sub(1);
                }
                let base = kr.tat.max(now);
                if base <= now + tau && (rated || kr.delayed == 0) {
                    // Starts; the next of the key's line (if any) becomes its head.
                    kr.tat = base + t;
                    if kr.delayed > 0 {
                        match kr.line.pop_front() {
                            Some((lid, le)) => {
                                let due = kr.tat.checked_sub(tau).unwrap_or(now).max(now);
                                st.delayed.insert((due, lid), le);
                                first_due = Some(first_due.map_or(due, |d| d.min(due)));
                            }
                            None => kr.delayed = 0,
                        }
                    }
                } else {
                    // Over its key's rate, or behind its key's head: out of the log, keeping its
                    // key slot if it holds one (under its id).
                    let mut e = st.entries.remove(&id).expect("listed");
                    if let Some(ek) = e.key.as_mut() {
                        ek.rated = true;
                        ek.holds = holds;
                    }
                    if rated || kr.delayed == 0 {
                        // The key's head: due when the key's bucket admits it.
                        let due = base.checked_sub(tau).unwrap_or(now).max(now);
                        st.delayed.insert((due, id), e);
                        first_due = Some(first_due.map_or(due, |d| d.min(due)));
                    } else {
                        kr.line.push_back((id, e));
                    }
                    kr.delayed += 1;
                    continue;
                }
            }
            let e = &st.entries[&id];
            picked.push((id, e.payload.clone(), e.prior + 1));
        }
        let more = picked.is_empty() && st.entries.range(next_after(st.last_delivered)..).next().is_some();
        (picked, more, first_due)
    }

    /// [`MemConsumer::pick`] by priority, as `read.lua` does: every unread entry of the log moves
    /// to the ready set (by -priority, arrival id); then the best ones are appended to the log
    /// again (a new id each; an entry holding its key slot keeps it) and picked as usual.
    #[allow(clippy::type_complexity)]
    fn pick_by_priority(
        st: &mut QState,
        count: usize,
        cap: Option<u32>,
        rate: Option<crate::RateLimit>,
    ) -> (Vec<(MessageId, Bytes, u32)>, bool, Option<Instant>) {
        let unread: Vec<MessageId> = st.entries.range(next_after(st.last_delivered)..).map(|(id, _)| *id).collect();
        for id in unread {
            let e = st.entries.remove(&id).expect("listed");
            st.key_ids.remove(&id);
            st.ready.insert((-e.priority, id), e);
        }
        let mut picked = Vec::with_capacity(count);
        let mut first_due: Option<Instant> = None;
        for _ in 0..16 {
            for _ in picked.len()..count {
                let Some((_, e)) = st.ready.pop_first() else { break };
                let holder = e.key.as_ref().filter(|k| k.holds).map(|k| k.key.clone());
                let nid = st.append_entry(e);
                if let Some(k) = holder {
                    st.key_ids.insert(nid, k);
                }
            }
            let (more, _, due) = Self::pick(st, count - picked.len(), cap, rate);
            picked.extend(more);
            if let Some(due) = due {
                first_due = Some(first_due.map_or(due, |d| d.min(due)));
            }
            if picked.len() >= count || st.ready.is_empty() {
                break;
            }
        }
        st.prio_new = false;
        let more = picked.is_empty() && !st.ready.is_empty();
        (picked, more, first_due)
    }

    /// Makes `picked` (taken by [`MemConsumer::take_new`]) pending under this consumer.
    fn assign(&self, st: &mut QState, picked: Vec<(MessageId, Bytes, u32)>) -> Vec<RawDelivery> {
        let now = Instant::now();
        for (id, _, _) in &picked {
            st.pending.insert(*id, Pel { consumer: self.me.clone(), delivered_at: now, deliveries: 1, fence: 0 });
        }
        picked
            .into_iter()
            .map(|(id, payload, deliveries)| RawDelivery { id, payload: Some(payload), deliveries, fence: 0 })
            .collect()
    }

    /// Wakes the waiting reads if a change under the lock asked for it ([`QState::wake`]).
    fn wake(&self, st: &mut QState) {
        if std::mem::take(&mut st.wake) {
            self.q.notify.notify_waiters();
        }
    }

    fn ack_locked(&self, st: &mut QState, id: &MessageId, released: bool, fence: Option<u64>) -> Owned {
        let o = st.owner(id, self.me(), released, fence);
        if o == Owned::Done {
            st.remove(id);
        }
        o
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
            match self.take_new(count) {
                Ok((got, _)) if !got.is_empty() => return Ok(got),
                Ok((_, true)) => continue,
                // Entries delayed by the per-key rate limit: back to the engine at once, which
                // promotes them at their due time.
                Ok((_, false)) if self.promote_hint.lock().unwrap().is_some() => return Ok(Vec::new()),
                Ok((_, false)) => {
                    if tokio::time::timeout_at(deadline, notified).await.is_err() {
                        return Ok(Vec::new());
                    }
                }
                Err((wait, why)) => {
                    // A timed gate: it opens by itself; sleep until then (within this wait).
                    metrics::counter!("baton_queue_throttled_total", "queue" => self.spec.queue.clone(), "reason" => why.reason())
                        .increment(1);
                    let at = tokio::time::Instant::now() + wait;
                    if at >= deadline {
                        tokio::time::sleep_until(deadline).await;
                        return Ok(Vec::new());
                    }
                    tokio::time::sleep_until(at).await;
                }
            }
        }
    }

    fn take_promote_hint(&self) -> Option<Instant> {
        self.promote_hint.lock().unwrap().take()
    }

    async fn back_off(&self, delay: Duration) -> Result<(), QueueError> {
        let mut st = self.q.state.lock().unwrap();
        let until = Instant::now() + delay;
        if st.backoff_until.is_none_or(|u| u < until) {
            st.backoff_until = Some(until);
        }
        Ok(())
    }

    async fn reclaim(&self, count: usize, exclude: &[MessageId]) -> Result<Reclaimed, QueueError> {
        let mut out = Reclaimed::default();
        {
            let mut st = self.q.state.lock().unwrap();
            let now = Instant::now();
            // Promote due delayed entries (new ids at the tail).
            while let Some(((due, _), _)) = st.delayed.first_key_value() {
                if *due > now {
                    break;
                }
                let ((_, key), e) = st.delayed.pop_first().expect("peeked");
                if let Some(name) = st.scheduled_names.remove(&key) {
                    st.scheduled.remove(&name);
                }
                // Delayed by the per-key rate limit holding a slot of its key: the slot moves to
                // the new entry. Anything else comes back without one.
                let held = e.key.as_ref().is_some_and(|k| k.rated && k.holds);
                let holder = if held { st.key_ids.remove(&key) } else { None };
                let nid = st.append_entry(e.holding(holder.is_some()));
                if let Some(k) = holder {
                    st.key_ids.insert(nid, k);
                }
                out.promoted += 1;
            }
            out.next_due = st.delayed.first_key_value().map(|((due, _), _)| due.saturating_duration_since(now));
            // Reclaimable: owned by PARKED and idle for claim_timeout, or owned by a consumer
            // whose liveness record is gone or silent, and idle, for the longer of the two claim
            // timeouts; never our own; never excluded.
            let claim = self.spec.claim_timeout;
            let wait = |st: &QState, owner: &str| -> Option<Duration> {
                if owner == PARKED {
                    return Some(claim);
                }
                match st.consumers.get(owner) {
                    None => Some(claim),
                    Some(l) => {
                        let w = claim.max(l.claim);
                        l.silent_for(now, w).then_some(w)
                    }
                }
            };
            let candidates: Vec<MessageId> = st
                .pending
                .iter()
                .filter(|(id, p)| *p.consumer != *self.spec.consumer && !exclude.contains(id))
                .filter(|(_, p)| wait(&st, &p.consumer).is_some_and(|w| now.duration_since(p.delivered_at) >= w))
                .map(|(id, _)| *id)
                .take(count + 1)
                .collect();
            out.more = candidates.len() > count;
            for id in candidates.into_iter().take(count) {
                let deliveries_in_pel = st.pending[&id].deliveries + 1;
                let Some(entry) = st.entries.get(&id) else {
                    st.pending.remove(&id);
                    st.release(&id);
                    out.deleted += 1;
                    continue;
                };
                let total = deliveries_in_pel + entry.prior;
                if self.spec.max_deliveries.is_some_and(|m| total > m) {
                    let e = st.remove(&id).expect("present");
                    st.bury(id, e, total - 1, "max deliveries exceeded");
                    out.dead_lettered += 1;
                    continue;
                }
                let payload = entry.payload.clone();
                let p = st.pending.get_mut(&id).expect("listed");
                p.consumer = self.me.clone();
                p.delivered_at = now;
                p.deliveries = deliveries_in_pel;
                p.fence += 1;
                let fence = p.fence;
                out.deliveries.push(RawDelivery { id, payload: Some(payload), deliveries: total, fence });
            }
        }
        {
            // Stopped consumers whose last entries were taken leave the group.
            let mut st = self.q.state.lock().unwrap();
            let owners: std::collections::HashSet<Arc<str>> = st.pending.values().map(|p| p.consumer.clone()).collect();
            st.consumers.retain(|name, l| l.seen.is_some() || owners.contains(name.as_str()));
        }
        if out.promoted > 0 {
            self.q.notify.notify_waiters();
        }
        self.wake(&mut self.q.state.lock().unwrap());
        Ok(out)
    }

    async fn settle(&self, items: &[Settle]) -> Result<Vec<Owned>, QueueError> {
        let mut st = self.q.state.lock().unwrap();
        let now = Instant::now();
        let out = items
            .iter()
            .map(|s| match s.op {
                SettleOp::Ack => self.ack_locked(&mut st, &s.id, s.released, s.fence),
                SettleOp::Park => {
                    let o = st.owner(&s.id, self.me(), s.released, s.fence);
                    if o == Owned::Done {
                        let p = st.pending.get_mut(&s.id).expect("owned");
                        if &*p.consumer != PARKED {
                            p.consumer = self.parked.clone();
                            p.delivered_at = now;
                        }
                    }
                    o
                }
            })
            .collect();
        self.wake(&mut st);
        Ok(out)
    }

    fn in_process(&self) -> bool {
        true
    }

    fn ack_now(&self, id: MessageId, released: bool) -> Option<Owned> {
        let mut st = self.q.state.lock().unwrap();
        let o = self.ack_locked(&mut st, &id, released, None);
        self.wake(&mut st);
        Some(o)
    }

    async fn retry_after(
        &self,
        id: MessageId,
        delay: Duration,
        released: bool,
        fence: Option<u64>,
    ) -> Result<Owned, QueueError> {
        let mut st = self.q.state.lock().unwrap();
        let o = st.owner(&id, self.me(), released, fence);
        if o != Owned::Done {
            return Ok(o);
        }
        let now = Instant::now();
        if delay < self.spec.claim_timeout {
            let idle = self.spec.claim_timeout - delay;
            let p = st.pending.get_mut(&id).expect("owned");
            p.consumer = self.parked.clone();
            p.delivered_at = now.checked_sub(idle).unwrap_or(now);
            // A scheduled re-poll, not a failure: does not count toward max_deliveries.
            p.deliveries = p.deliveries.saturating_sub(1);
        } else {
            let deliveries = st.pending[&id].deliveries;
            if let Some(e) = st.remove(&id) {
                let prior = e.prior + deliveries.saturating_sub(1);
                st.delayed.insert((now + delay, id), Entry { prior, ..e }.holding(false).unrated());
            }
            self.wake(&mut st);
        }
        Ok(Owned::Done)
    }

    async fn dead_letter(
        &self,
        id: MessageId,
        deliveries: u32,
        reason: &str,
        released: bool,
        fence: Option<u64>,
    ) -> Result<Owned, QueueError> {
        let mut st = self.q.state.lock().unwrap();
        let o = st.owner(&id, self.me(), released, fence);
        if o == Owned::Done {
            let e = st.remove(&id).expect("owned entries exist");
            st.bury(id, e, deliveries, reason);
            self.wake(&mut st);
        }
        Ok(o)
    }

    async fn heartbeat(
        &self,
        renew: &[MessageId],
        fences: &[u64],
        quiet: &[MessageId],
        release: &[MessageId],
        orphan_idle: Duration,
        _pel_limit: usize,
    ) -> Result<Beat, QueueError> {
        let mut st = self.q.state.lock().unwrap();
        let now = Instant::now();
        let me = self.spec.consumer.clone();
        st.consumers.insert(me.clone(), Live { seen: Some(now), claim: self.spec.claim_timeout });
        let mut beat = Beat::default();
        // A renewal of another delivery than the entry's latest is stale: it does not hold it.
        for (i, id) in renew.iter().chain(quiet).enumerate() {
            let fence = if i < renew.len() { fences.get(i).copied() } else { None };
            match st.pending.get_mut(id) {
                Some(p) if *p.consumer == *me && fence.is_some_and(|f| f != p.fence) => beat.stale.push(i),
                Some(p) if *p.consumer == *me => p.delivered_at = now,
                Some(p) if &*p.consumer != PARKED => beat.lost.push(*id),
                _ => beat.gone.push(*id),
            }
        }
        let claim = self.spec.claim_timeout;
        for id in release {
            if let Some(p) = st.pending.get_mut(id).filter(|p| *p.consumer == *me) {
                p.consumer = self.parked.clone();
                p.delivered_at = now.checked_sub(claim).unwrap_or(now);
            }
        }
        let held: std::collections::HashSet<&MessageId> = renew
            .iter()
            .enumerate()
            .filter(|(i, _)| !beat.stale.contains(i))
            .map(|(_, id)| id)
            .chain(quiet)
            .chain(release)
            .collect();
        for (id, p) in st.pending.iter_mut() {
            if *p.consumer == *me && !held.contains(id) && now.duration_since(p.delivered_at) >= orphan_idle {
                p.consumer = self.parked.clone();
                beat.orphans += 1;
            }
        }
        Ok(beat)
    }

    async fn reap_idle_consumers(&self, window: Duration) -> Result<u64, QueueError> {
        let mut st = self.q.state.lock().unwrap();
        let now = Instant::now();
        let busy: std::collections::HashSet<Arc<str>> = st.pending.values().map(|p| p.consumer.clone()).collect();
        let me = self.spec.consumer.clone();
        let before = st.consumers.len();
        st.consumers.retain(|name, l| {
            *name == me || busy.contains(name.as_str()) || !l.silent_for(now, window.max(2 * l.claim))
        });
        Ok((before - st.consumers.len()) as u64)
    }

    async fn requeue(&self, ids: &[MessageId], fences: &[u64]) -> Result<u64, QueueError> {
        let n = {
            let mut st = self.q.state.lock().unwrap();
            let mut n = 0;
            for (i, id) in ids.iter().enumerate() {
                if st.owner(id, self.me(), false, fences.get(i).copied()) != Owned::Done {
                    continue;
                }
                let deliveries = st.pending[id].deliveries;
                // A key slot goes with the copy (it holds it), so no entry of the key overtakes it.
                let holder = st.key_ids.remove(id);
                match st.take_out(id) {
                    Some(e) => {
                        let prior = e.prior + deliveries.saturating_sub(1);
                        let nid = st.append_entry(Entry { prior, ..e }.holding(holder.is_some()).charged());
                        if let Some(k) = holder {
                            st.key_ids.insert(nid, k);
                        }
                    }
                    None => {
                        if let Some(k) = holder {
                            st.key_ids.insert(*id, k);
                            st.release(id);
                        }
                    }
                }
                if std::mem::take(&mut st.slot_waiting) {
                    st.wake = true;
                }
                n += 1;
            }
            n
        };
        self.q.notify.notify_waiters();
        Ok(n)
    }

    async fn leave(&self) -> Result<bool, QueueError> {
        let mut st = self.q.state.lock().unwrap();
        let me = self.spec.consumer.as_str();
        if st.pending.values().any(|p| &*p.consumer == me) {
            if let Some(l) = st.consumers.get_mut(me) {
                l.seen = None;
            }
            return Ok(false);
        }
        st.consumers.remove(me);
        Ok(true)
    }
}
