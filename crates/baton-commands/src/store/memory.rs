//! In-memory state store: the same semantics as the Redis store (versioned CAS, first terminal
//! write wins, TTL from the last write, retention after terminal, per-queue status indexes),
//! held in process memory. Submit holds the store lock while it enqueues, so no reader ever sees
//! a command without its message.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;

use super::backend::{status_slot, Cas, CommandStoreSettings, FeedAppend, Rescheduled, StateBackend, SubmitOutcome};
use crate::feed::{CommandEvent, EventFrom, EventOffset, EventPage};
use crate::model::{CommandMsg, Cursor};
use crate::{CommandError, CommandState, CommandStatus, StatusCounts};

struct Entry {
    /// Boxed: the map's slots stay small, so growing it moves pointers, not states.
    state: Box<CommandState>,
    body: String,
    expires: Instant,
}

#[derive(Default)]
struct QueueIndex {
    /// `[0]` every status, `[1..=5]` per status: (created ms, id).
    by_status: [BTreeSet<(u64, String)>; 6],
}

#[derive(Default)]
struct Inner {
    /// id → entry (ids are unique across queues).
    states: HashMap<String, Entry>,
    queues: HashMap<String, QueueIndex>,
    /// `shared_secret`s by name.
    secrets: HashMap<String, Vec<u8>>,
    /// Per queue: its feed, oldest first (offset, command id, stored JSON), and the last offset
    /// given out (offsets never go back, even when the feed is emptied by trimming).
    feeds: HashMap<String, Feed>,
    /// Per queue: its per-minute aggregates.
    minutes: HashMap<String, crate::minutes::MemoryMinutes>,
}

#[derive(Default)]
struct Feed {
    events: VecDeque<(EventOffset, String, String)>,
    last: EventOffset,
}

impl Feed {
    /// Appends `e` for `id` at the next offset (as Redis makes stream ids: the clock's ms, or
    /// the last ms with the next seq), keeping the newest `max_len`.
    fn append(&mut self, id: &str, e: &FeedAppend) {
        let ms = crate::Timestamp::now().millis();
        self.last =
            if ms > self.last.ms { EventOffset::new(ms, 0) } else { EventOffset::new(self.last.ms, self.last.seq + 1) };
        self.events.push_back((self.last, id.to_string(), e.json.clone()));
        while self.events.len() as u64 > e.max_len {
            self.events.pop_front();
        }
    }
}

impl Inner {
    fn live(&mut self, id: &str) -> Option<&mut Entry> {
        let now = Instant::now();
        if self.states.get(id).is_some_and(|e| e.expires <= now) {
            self.remove(id);
        }
        self.states.get_mut(id)
    }

    fn remove(&mut self, id: &str) {
        if let Some(e) = self.states.remove(id) {
            if let Some(q) = self.queues.get_mut(&e.state.queue) {
                let k = (e.state.created_at.millis(), id.to_string());
                q.by_status[0].remove(&k);
                q.by_status[status_slot(Some(e.state.status))].remove(&k);
            }
        }
    }

    fn prune(&mut self) {
        let now = Instant::now();
        let dead: Vec<String> = self.states.iter().filter(|(_, e)| e.expires <= now).map(|(k, _)| k.clone()).collect();
        for id in dead {
            self.remove(&id);
        }
    }
}

/// A memory queue operation, which never waits (it takes the queue's lock and returns), done in
/// one poll, under our lock.
fn now<T>(f: impl std::future::Future<Output = Result<T, baton_queue::QueueError>>) -> Result<T, CommandError> {
    use futures::FutureExt;
    match f.now_or_never() {
        Some(r) => r.map_err(CommandError::from),
        None => Err(CommandError::InvalidSettings("memory queue operation did not complete at once".into())),
    }
}

/// Offers on the memory queue without yielding: its `offer` never waits (it takes the queue's
/// lock and returns), so it completes in one poll, under our lock: state and message together.
fn offer_now(stream: &baton_queue::MessageStream, queue: &str, payload: Vec<u8>) -> Result<(), CommandError> {
    offer_now_keyed(stream, queue, payload, baton_queue::OfferOptions::default())
}

/// [`offer_now`] with the entry's concurrency key and priority.
fn offer_now_keyed(
    stream: &baton_queue::MessageStream,
    queue: &str,
    payload: Vec<u8>,
    opts: baton_queue::OfferOptions,
) -> Result<(), CommandError> {
    use futures::FutureExt;
    match stream.offer_with(queue, payload, opts).now_or_never() {
        Some(r) => r.map(|_| ()).map_err(CommandError::from),
        None => Err(CommandError::InvalidSettings("memory queue offer did not complete at once".into())),
    }
}

pub(crate) struct MemoryStateBackend {
    inner: Mutex<Inner>,
    stream: baton_queue::MessageStream,
    /// The completion hooks' delivery queue (see `hooks.rs`).
    hooks: baton_queue::MessageStream,
    settings: CommandStoreSettings,
    /// Cron schedule records by (queue, schedule name) (see `schedules.rs`).
    schedules: Mutex<HashMap<(String, String), String>>,
}

impl MemoryStateBackend {
    pub fn new(
        stream: baton_queue::MessageStream,
        hooks: baton_queue::MessageStream,
        settings: CommandStoreSettings,
    ) -> Self {
        Self { inner: Mutex::new(Inner::default()), stream, hooks, settings, schedules: Mutex::default() }
    }
}

#[async_trait]
impl StateBackend for MemoryStateBackend {
    async fn schedule_read(&self, queue: &str, name: &str) -> Result<(Option<String>, i64), CommandError> {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0);
        Ok((self.schedules.lock().unwrap().get(&(queue.to_string(), name.to_string())).cloned(), now))
    }

    async fn schedule_cas(
        &self,
        queue: &str,
        name: &str,
        expected: Option<&str>,
        new: &str,
    ) -> Result<bool, CommandError> {
        let mut g = self.schedules.lock().unwrap();
        let key = (queue.to_string(), name.to_string());
        if g.get(&key).map(String::as_str) != expected {
            return Ok(false);
        }
        g.insert(key, new.to_string());
        Ok(true)
    }

    async fn submit(
        &self,
        state: &CommandState,
        body: &str,
        msg: &CommandMsg,
        event: Option<&FeedAppend>,
    ) -> Result<SubmitOutcome, CommandError> {
        {
            let mut g = self.inner.lock().unwrap();
            if let Some(e) = g.live(&state.id) {
                return Ok(if e.state.queue != state.queue {
                    SubmitOutcome::OtherQueue
                } else if e.body == body {
                    SubmitOutcome::Existing((*e.state).clone())
                } else {
                    SubmitOutcome::Conflict
                });
            }
            let k = (state.created_at.millis(), state.id.clone());
            let q = g.queues.entry(state.queue.clone()).or_default();
            q.by_status[0].insert(k.clone());
            q.by_status[status_slot(Some(state.status))].insert(k);
            g.states.insert(
                state.id.clone(),
                Entry {
                    state: Box::new(state.clone()),
                    body: body.to_string(),
                    expires: Instant::now()
                        + self.settings.ttl_for(&state.queue, state.status)
                        + state.scheduled_delay(),
                },
            );
            let opts =
                baton_queue::OfferOptions { concurrency_key: state.concurrency_key.clone(), priority: state.priority };
            match state.run_at.filter(|_| !state.scheduled_delay().is_zero()) {
                // Scheduled: waits in the queue's delayed set, as on Redis.
                Some(at) => {
                    let name = crate::model::schedule_name(&state.id);
                    now(self.stream.offer_at_with(&state.queue, &name, msg.to_bytes(), at.0, opts))?;
                }
                None => offer_now_keyed(&self.stream, &state.queue, msg.to_bytes(), opts)?,
            }
            if let Some(e) = event {
                g.feeds.entry(state.queue.clone()).or_default().append(&state.id, e);
            }
        }
        Ok(SubmitOutcome::Created(state.clone()))
    }

    async fn load(&self, _home: &str, id: &str) -> Result<Option<CommandState>, CommandError> {
        Ok(self.inner.lock().unwrap().live(id).map(|e| (*e.state).clone()))
    }

    async fn home_of(&self, id: &str) -> Result<Option<String>, CommandError> {
        Ok(self.inner.lock().unwrap().live(id).map(|e| e.state.queue.clone()))
    }

    async fn shared_secret(&self, name: &str) -> Result<Vec<u8>, CommandError> {
        let mut g = self.inner.lock().unwrap();
        Ok(g.secrets.entry(name.to_string()).or_insert_with(|| rand::random::<[u8; 32]>().to_vec()).clone())
    }

    async fn transition(
        &self,
        old: CommandStatus,
        new: CommandState,
        enqueue: Option<(&str, &CommandMsg)>,
        _delivery: Option<&super::backend::DeliveryRef>,
        event: Option<&FeedAppend>,
        hook: Option<&str>,
    ) -> Result<(Cas, bool), CommandError> {
        {
            let mut g = self.inner.lock().unwrap();
            let Some(e) = g.live(&new.id) else { return Ok((Cas::Conflict(None), false)) };
            let rerun = old.is_terminal() && !new.status.is_terminal() && enqueue.is_some();
            if e.state.version + 1 != new.version || (e.state.status.is_terminal() && !rerun) || e.state.status != old {
                return Ok((Cas::Conflict(Some((*e.state).clone())), false));
            }
            *e.state = new.clone();
            e.expires = Instant::now() + self.settings.ttl_for(&new.queue, new.status);
            if let Some((field, start)) = crate::minutes::mark_of(old, &new) {
                let now = crate::Timestamp::now().millis();
                g.minutes.entry(new.queue.clone()).or_default().count(now, field, start);
            }
            if old != new.status {
                let k = (new.created_at.millis(), new.id.clone());
                if let Some(q) = g.queues.get_mut(&new.queue) {
                    q.by_status[status_slot(Some(old))].remove(&k);
                    q.by_status[status_slot(Some(new.status))].insert(k);
                }
            }
            if let Some((queue, msg)) = enqueue {
                offer_now(&self.stream, queue, msg.to_bytes())?;
            }
            if let Some(h) = hook {
                offer_now(&self.hooks, &new.queue, h.as_bytes().to_vec())?;
            }
            if let Some(e) = event {
                g.feeds.entry(new.queue.clone()).or_default().append(&new.id, e);
            }
        }
        Ok((Cas::Done(new), false))
    }

    async fn reschedule(&self, new: CommandState, event: Option<&FeedAppend>) -> Result<Rescheduled, CommandError> {
        let mut g = self.inner.lock().unwrap();
        let Some(e) = g.live(&new.id) else { return Ok(Rescheduled::Conflict(None)) };
        if e.state.version + 1 != new.version || e.state.status != CommandStatus::Submitted {
            return Ok(Rescheduled::Conflict(Some((*e.state).clone())));
        }
        let at = new.run_at.expect("a reschedule sets run_at");
        let name = crate::model::schedule_name(&new.id);
        if !now(self.stream.reschedule(&new.queue, &name, at.0))? {
            return Ok(Rescheduled::NotWaiting((*e.state).clone()));
        }
        *e.state = new.clone();
        e.expires = Instant::now() + self.settings.ttl_for(&new.queue, new.status) + new.scheduled_delay();
        if let Some(ev) = event {
            g.feeds.entry(new.queue.clone()).or_default().append(&new.id, ev);
        }
        Ok(Rescheduled::Done(new))
    }

    fn atomic_enqueue(&self, _home: &str, _target: &str) -> bool {
        true
    }

    fn can_fold_ack(&self, _home: &str, _queue: &str) -> bool {
        false
    }

    async fn enqueue(&self, queue: &str, msg: &CommandMsg) -> Result<(), CommandError> {
        self.stream.offer(queue, msg.to_bytes()).await?;
        Ok(())
    }

    async fn list(
        &self,
        queue: &str,
        status: Option<CommandStatus>,
        limit: usize,
        cursor: Option<Cursor>,
        min_ms: u64,
    ) -> Result<(Vec<CommandState>, Option<Cursor>), CommandError> {
        let mut g = self.inner.lock().unwrap();
        g.prune();
        let Some(q) = g.queues.get(queue) else { return Ok((Vec::new(), None)) };
        let set = &q.by_status[status_slot(status)];
        let from = (min_ms, String::new());
        let keys: Vec<(u64, String)> = match &cursor {
            Some(c) if (c.created_ms, c.id.as_str()) <= (min_ms, "") => Vec::new(),
            Some(c) => set.range(from..(c.created_ms, c.id.clone())).rev().take(limit + 1).cloned().collect(),
            None => set.range(from..).rev().take(limit + 1).cloned().collect(),
        };
        let more = keys.len() > limit;
        let keys = &keys[..keys.len().min(limit)];
        let items = keys.iter().filter_map(|(_, id)| g.states.get(id).map(|e| (*e.state).clone())).collect();
        let next = if more { keys.last().map(|(ms, id)| Cursor { created_ms: *ms, id: id.clone() }) } else { None };
        Ok((items, next))
    }

    async fn counts(&self, queue: &str) -> Result<StatusCounts, CommandError> {
        let mut g = self.inner.lock().unwrap();
        g.prune();
        let Some(q) = g.queues.get(queue) else { return Ok(StatusCounts::default()) };
        let v: Vec<u64> = (1..=5).map(|i| q.by_status[i].len() as u64).collect();
        Ok(StatusCounts::from_slice(&v))
    }

    async fn minutes(&self, queue: &str, last: usize) -> Result<Vec<crate::minutes::MinuteStats>, CommandError> {
        let g = self.inner.lock().unwrap();
        let now = crate::Timestamp::now().millis();
        Ok(match g.minutes.get(queue) {
            Some(m) => m.read(now, last),
            None => crate::minutes::MemoryMinutes::default().read(now, last),
        })
    }

    async fn sample_minute(&self, queue: &str) -> Result<bool, CommandError> {
        let mut g = self.inner.lock().unwrap();
        let now = crate::Timestamp::now().millis();
        if g.minutes.get(queue).is_some_and(|m| m.sampled(now)) {
            return Ok(false);
        }
        g.prune();
        let (depth, age) = match g.queues.get(queue) {
            Some(q) => {
                let waiting = &q.by_status[status_slot(Some(CommandStatus::Submitted))];
                (waiting.len() as u64, waiting.first().map_or(0, |(ms, _)| now.saturating_sub(*ms)))
            }
            None => (0, 0),
        };
        Ok(g.minutes.entry(queue.to_string()).or_default().sample(now, depth, age))
    }

    async fn watch_home(&self, _home: &str) -> Result<(), CommandError> {
        Ok(())
    }

    async fn feed_read(
        &self,
        queue: &str,
        from: EventFrom,
        id: Option<&str>,
        limit: usize,
        scan: usize,
    ) -> Result<EventPage, CommandError> {
        let g = self.inner.lock().unwrap();
        let Some(feed) = g.feeds.get(queue) else {
            let next_offset = match from {
                EventFrom::After(o) => o,
                _ => EventOffset::ZERO,
            };
            return Ok(EventPage { events: Vec::new(), next_offset, up_to_date: true });
        };
        let after = match from {
            EventFrom::Start => None,
            EventFrom::Now => return Ok(EventPage { events: Vec::new(), next_offset: feed.last, up_to_date: true }),
            EventFrom::After(o) => Some(o),
        };
        let first = after.map_or(0, |o| feed.events.partition_point(|(at, ..)| *at <= o));
        let mut events = Vec::new();
        let mut next_offset = after.unwrap_or(EventOffset::ZERO);
        let mut up_to_date = true;
        for (looked, (at, of, json)) in feed.events.range(first..).enumerate() {
            if events.len() >= limit || looked >= scan {
                up_to_date = false;
                break;
            }
            next_offset = *at;
            if id.is_none_or(|id| id == of) {
                events.push(CommandEvent::parse(*at, json.as_bytes())?);
            }
        }
        Ok(EventPage { events, next_offset, up_to_date })
    }

    async fn feed_watch(&self, _queue: &str, _after: EventOffset) -> Result<(), CommandError> {
        Ok(())
    }
}
