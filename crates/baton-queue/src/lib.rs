//! # baton-queue — the leased work queue (`MessageStream`)
//!
//! A queue is a Redis Stream read through one consumer group (or its in-memory equivalent).
//! What sets it apart from queues that only know idle time: a handler that runs long is never
//! reclaimed while its process lives.
//!
//! ## The lease guarantee
//!
//! From the moment the backend assigns an entry to a consumer until that consumer settles it
//! (or hands it back), the consumer's process renews the entry's lease every
//! `heartbeat_interval`, whatever its handlers do — block their threads, spin the CPU, panic,
//! starve the application's runtime — for as long as the process runs and reaches Redis:
//!
//! * Each consumer has a **lease thread**: an OS thread with its own single-threaded runtime and
//!   its own Redis connections, on which every read (`XREADGROUP`), reclaim, renewal and
//!   settlement runs. An entry is registered as leased the moment its reply is parsed there,
//!   before any handler sees it; handlers run on the application's runtime and never on that
//!   thread.
//! * All leases of a consumer are renewed in ONE ownership-checked script call per tick
//!   (`XCLAIM … 0 <ids…> JUSTID`), which also writes the consumer's liveness record (Redis time).
//!   A lease another consumer took is never taken back.
//! * A reclaim never takes entries of a live consumer, its own included: only entries idle for
//!   `claim_timeout` owned by the reserved `~parked` owner (work nobody holds: `Retry`, hand-backs)
//!   or by a consumer whose liveness record is `claim_timeout` old. One delivery per message id
//!   per process.
//!
//! **Bounds.** A dead consumer's entries start on a live consumer within `claim_timeout` + one
//! poll interval after its last renewal, plus, when every live consumer is saturated, the time
//! until one of their handlers settles (the next free slot goes to a reclaim before new work).
//! After Redis was unreachable for the whole queue (paused, restarted, failed over) reclaims hold
//! off one more `claim_timeout`, in which every live consumer renews. `RetryAfter(d)` shorter
//! than `claim_timeout` is kept as a renewed lease and redelivered from a local timer after `d`
//! (a few ms late at most); longer ones wait in a delayed set promoted at their due time.
//!
//! **What it cannot cover.** A process that is stopped (SIGSTOP, a VM paused) or cut off from
//! Redis for `claim_timeout` is indistinguishable from a dead one: its work is taken over. When it
//! resumes, the next renewal tells its handlers that their lease is lost ([`Lease::lost`]) and
//! their acks are refused ([`QueueError::LeaseLost`]), but a handler that ignores the signal keeps
//! running. Those are the only cases in which one message runs twice at once.
//!
//! ## The rest
//!
//! * **Bounded hangs.** Past `max_processing_time` (default 15 min) renewal stops, the entry is
//!   made reclaimable at once, the lost-lease signal fires, a warning and a metric are emitted.
//! * **Decisions.** A handler returns [`Decision::Ack`] (XACK + XDEL atomically, refused if no
//!   longer owned), [`Decision::Retry`] (redelivered after `claim_timeout`, not heartbeated),
//!   [`Decision::RetryAfter`], [`Decision::Deferred`] (settle later through the [`Lease`]),
//!   [`Decision::DeadLetter`] or [`Decision::RateLimited`] (the whole queue backs off; the entry
//!   comes back after it, not counted as a delivery). Settlements are retried until Redis answers: an error is a real
//!   refusal, never an ack that applied unseen.
//! * **Pause** ([`MessageStream::pause`], [`MessageStream::resume`]): a paused queue accepts
//!   offers and no consumer (in-process or remote) takes a new entry until it is resumed; leases,
//!   settlements, reclaims of dead consumers' entries and short `RetryAfter` re-polls go on. Every
//!   read of new entries is a *gated read*: the gates are checked atomically with taking the
//!   entries (on Redis in one script, `read.lua`), and a consumer that finds a gate shut waits
//!   for it to open without polling. The gates: pause, the back-off of
//!   [`Decision::RateLimited`], the queue's rate limit ([`RateLimit`], GCRA, all consumers
//!   together), the concurrency caps and the rate limit per concurrency key
//!   ([`ConsumerOptions::rate_limit_per_key`]: an entry over its key's rate waits in the delayed
//!   set, not in front of other keys); decisions about taking new work (priorities) belong there
//!   too (`docs/architecture.md`, "Gates on new work").
//! * **Poison messages** go to a dead-letter stream after `max_deliveries` (atomically with their
//!   removal); list, replay and purge them through [`MessageStream`].
//! * **Hygiene.** A consumer that stops gracefully ([`Consumer::drain`], [`Consumer::close`],
//!   drop) leaves the group when it owns nothing, and closes its connections; consumers with no
//!   pending entry whose liveness record is older than `reap_idle_consumers_after` are removed.
//!
//! Backends: [`MessageStream::memory`] (in-process, same semantics) and [`MessageStream::redis`]
//! (standalone or Cluster; key layout: [`keys`]). Metrics (through the `metrics`
//! crate, label `queue`): `baton_queue_leases_expired_total`, `baton_queue_leases_lost_total`,
//! `baton_queue_lease_renewals_total`, `baton_queue_lease_renewal_failures_total`,
//! `baton_queue_renewal_seconds`, `baton_queue_reclaims_total`, `baton_queue_dead_letters_total`,
//! `baton_queue_outcomes_total{decision,result}`, `baton_queue_handler_seconds`,
//! `baton_queue_throttled_total{reason}` (`rate_limit`, `backoff`: reads held back by a timed gate).
//!
//! ## In your application
//!
//! `Cargo.toml` lines (the crates of this repository, here checked out next to your project;
//! with a git dependency the same names take `git = "…"` instead of `path`):
//!
//! ```toml
//! [dependencies]
//! baton-queue = { path = "../baton/crates/baton-queue" }
//! tokio = { version = "1", features = ["macros", "rt-multi-thread"] }
//! ```
//!
//! A handler is any `Fn(Delivery) -> impl Future<Output = Decision>` (below); a type of your own
//! implements [`Handler`] under `#[async_trait]`, re-exported here
//! ([`async_trait`](macro@async_trait)). The Redis backend ([`MessageStream::redis`]) takes a [`RedisClient`] of the `baton-redis` crate, whose
//! [`RedisClient`], [`RedisConfig`] and [`ConnectError`] are re-exported here; add
//! `baton-redis = { path = "../baton/crates/baton-redis" }` (the same checkout) only to use more
//! of it:
//!
//! ```no_run
//! use baton_queue::{MessageStream, RedisClient, RedisConfig, RedisQueueOptions};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), baton_queue::QueueError> {
//! let client = RedisClient::new(RedisConfig::standalone("redis://127.0.0.1:6379"))?;
//! let queue = MessageStream::redis(client, RedisQueueOptions::default()).await?;
//! queue.offer("emails", "hello").await?;
//! # Ok(())
//! # }
//! ```
//!
//! In memory:
//!
//! ```
//! use std::time::Duration;
//! use baton_queue::{ConsumerOptions, Decision, Delivery, MessageStream};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), baton_queue::QueueError> {
//! let queue = MessageStream::memory();
//! queue.offer("emails", "hello").await?;
//! let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
//! let consumer = queue
//!     .consume(
//!         "emails",
//!         move |d: Delivery| {
//!             let tx = tx.clone();
//!             async move {
//!                 // Long or blocking work is fine here: the lease is renewed meanwhile.
//!                 tx.send(d.payload.clone()).unwrap();
//!                 Decision::Ack
//!             }
//!         },
//!         ConsumerOptions::new().with_claim_timeout(Duration::from_secs(30)),
//!     )
//!     .await?;
//! assert_eq!(&rx.recv().await.unwrap()[..], b"hello");
//! let report = consumer.drain(Duration::from_secs(5)).await;
//! assert!(report.in_flight.is_empty());
//! # Ok(()) }
//! ```

mod api;
mod backend;
mod consumer;
mod engine;
pub mod keys;
mod lease;
mod memory;
mod redis;
mod remote;
mod settings;

use std::sync::Arc;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// The attribute an `impl Handler` of your own needs, re-exported from the `async-trait` crate.
pub use async_trait::async_trait;
/// The Redis connection of [`MessageStream::redis`], re-exported from `baton-redis`.
pub use baton_redis::{ConnectError, RedisClient, RedisConfig};

pub use api::*;
pub use consumer::{Consumer, Handler};
pub use lease::{Delivery, Lease};
pub use redis::RedisQueueOptions;
pub use remote::{LeaseState, RemoteConsumer, RemoteDelivery, RemoteOptions, Settled};
pub use settings::{ConsumerOptions, RateLimit};

use backend::QueueBackend;

/// Work queues on one backend. Cheap to clone; one instance serves any number of named queues.
#[derive(Clone)]
pub struct MessageStream {
    backend: Arc<dyn QueueBackend>,
    /// The consumers started by this instance and its clones, per queue: told at once of a due
    /// time set through it ([`MessageStream::due_hint`]).
    local: Arc<LocalConsumers>,
}

/// Consumers of this process per queue (weak: a stopped consumer is dropped at the next look).
#[derive(Default)]
struct LocalConsumers(std::sync::Mutex<std::collections::HashMap<String, Vec<std::sync::Weak<lease::Shared>>>>);

impl LocalConsumers {
    fn add(&self, queue: &str, shared: &Arc<lease::Shared>) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let list = m.entry(queue.to_string()).or_default();
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(shared));
    }

    fn live(&self, queue: &str) -> Vec<Arc<lease::Shared>> {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let Some(list) = m.get_mut(queue) else { return Vec::new() };
        list.retain(|w| w.strong_count() > 0);
        let live: Vec<_> = list.iter().filter_map(std::sync::Weak::upgrade).collect();
        if list.is_empty() {
            m.remove(queue);
        }
        live
    }
}

impl MessageStream {
    /// The in-memory backend: queues live in this process only.
    pub fn memory() -> Self {
        Self { backend: Arc::new(memory::MemoryQueueBackend::default()), local: Arc::default() }
    }

    /// The Redis backend (standalone or Cluster, as `client` says). Connects now.
    ///
    /// Errors: [`QueueError::Connect`] when Redis is unreachable, [`QueueError::InvalidSettings`].
    pub async fn redis(client: baton_redis::RedisClient, options: RedisQueueOptions) -> Result<Self, QueueError> {
        Ok(Self { backend: Arc::new(redis::RedisQueueBackend::connect(client, options).await?), local: Arc::default() })
    }

    /// Appends one message to `queue`; returns its id.
    pub async fn offer(&self, queue: &str, payload: impl Into<Bytes>) -> Result<MessageId, QueueError> {
        validate_queue_name(queue)?;
        let ids = self.backend.offer(queue, &[payload.into()], None, 0).await?;
        Ok(ids[0])
    }

    /// Appends one message to `queue` with `options` (its concurrency key and priority); returns
    /// its id. An entry of a priority other than 0 is taken before every new entry of a lower
    /// priority ([`OfferOptions::priority`]); it may be delivered under a later id than the one
    /// returned (the gated read re-appends new entries in priority order).
    ///
    /// Errors: [`QueueError::InvalidQueueName`], [`QueueError::InvalidSettings`] for a bad
    /// concurrency key ([`validate_concurrency_key`]) or priority ([`validate_priority`]).
    pub async fn offer_with(
        &self,
        queue: &str,
        payload: impl Into<Bytes>,
        options: OfferOptions,
    ) -> Result<MessageId, QueueError> {
        validate_queue_name(queue)?;
        if let Some(k) = &options.concurrency_key {
            validate_concurrency_key(k)?;
        }
        validate_priority(options.priority)?;
        let ids =
            self.backend.offer(queue, &[payload.into()], options.concurrency_key.as_deref(), options.priority).await?;
        Ok(ids[0])
    }

    /// Appends messages in order, in one round trip; returns their ids in the same order.
    pub async fn offer_batch(&self, queue: &str, payloads: Vec<Bytes>) -> Result<Vec<MessageId>, QueueError> {
        validate_queue_name(queue)?;
        if payloads.is_empty() {
            return Ok(Vec::new());
        }
        self.backend.offer(queue, &payloads, None, 0).await
    }

    /// Appends `value` serialized as JSON.
    pub async fn offer_json<T: Serialize>(&self, queue: &str, value: &T) -> Result<MessageId, QueueError> {
        let bytes = serde_json::to_vec(value)
            .map_err(|e| QueueError::InvalidSettings(format!("payload not serializable: {e}")))?;
        self.offer(queue, bytes).await
    }

    /// Starts consuming `queue` with `handler`. Validates `options` first
    /// ([`QueueError::InvalidSettings`] names the bad setting).
    pub async fn consume<H: Handler>(
        &self,
        queue: &str,
        handler: H,
        options: ConsumerOptions,
    ) -> Result<Consumer, QueueError> {
        let consumer = Consumer::start(self.backend.clone(), queue, Arc::new(handler), options).await?;
        self.local.add(queue, consumer.shared());
        Ok(consumer)
    }

    /// Tells this process's consumers of `queue` (those started through this instance or a
    /// clone of it) that a scheduled entry is due at `due`, so that they promote it then. A
    /// consumer otherwise learns due times at its reclaim poll (every `poll_interval`), which
    /// for a due time set after the last poll and before the next one means up to one
    /// `poll_interval` late; consumers of other processes still learn it there.
    /// [`MessageStream::offer_at`] and [`MessageStream::reschedule`] call this themselves; a
    /// write that schedules an entry by other means (a script of its own, e.g. a scheduled
    /// command's submit) calls it after the write.
    pub fn due_hint(&self, queue: &str, due: std::time::SystemTime) {
        let consumers = self.local.live(queue);
        if consumers.is_empty() {
            return;
        }
        let at = std::time::Instant::now() + due.duration_since(std::time::SystemTime::now()).unwrap_or_default();
        for sh in consumers {
            let earlier = sh.reclaim_state.lock().unwrap_or_else(|p| p.into_inner()).next_promote.add(at);
            if earlier {
                sh.waiting_added.notify_one();
            }
        }
    }

    /// A consumer of `queue` named `name` whose worker runs elsewhere and drives it by request
    /// (claim, renew, settle): for workers in other processes or languages, e.g. over HTTP. See
    /// [`RemoteConsumer`]. Joins the group (idempotent: opening the same name again, in this or
    /// another process, is the same consumer). Errors: [`QueueError::InvalidSettings`],
    /// [`QueueError::InvalidQueueName`], backend errors.
    pub async fn remote_consumer(
        &self,
        queue: &str,
        name: &str,
        options: RemoteOptions,
    ) -> Result<RemoteConsumer, QueueError> {
        RemoteConsumer::open(&self.backend, queue, name, options).await
    }

    /// Exact counts for `queue` (see [`QueueStats`]).
    pub async fn stats(&self, queue: &str) -> Result<QueueStats, QueueError> {
        validate_queue_name(queue)?;
        self.backend.stats(queue).await
    }

    /// Pauses `queue`: from now on no consumer of any process takes a new entry of it (the check
    /// and the read are one atomic step, see [`keys::paused`]), while offers are accepted and
    /// wait. What already runs goes on: leases keep renewing, settlements apply, a dead
    /// consumer's entries are still reclaimed by live ones after `claim_timeout`, and short
    /// `RetryAfter` re-polls kept by a consumer are still redelivered. Returns `true` when the
    /// queue was running, `false` when it already was paused (nothing changed). The state is
    /// the queue's, in its backend: it outlives the consumers and this process (on Redis).
    /// Errors: [`QueueError::InvalidQueueName`], backend errors.
    pub async fn pause(&self, queue: &str) -> Result<bool, QueueError> {
        validate_queue_name(queue)?;
        self.backend.set_paused(queue, true).await
    }

    /// Resumes a paused `queue`: consumers waiting on its gate wake at once (no poll interval)
    /// and take the entries that waited, oldest first. Returns `true` when it was paused,
    /// `false` when it was running (nothing changed). Errors as [`MessageStream::pause`].
    pub async fn resume(&self, queue: &str) -> Result<bool, QueueError> {
        validate_queue_name(queue)?;
        self.backend.set_paused(queue, false).await
    }

    /// Whether `queue` is paused ([`QueueStats::paused`] without the counts).
    pub async fn is_paused(&self, queue: &str) -> Result<bool, QueueError> {
        Ok(self.stats(queue).await?.paused)
    }

    /// The consumers of `queue`'s group, live and dead ([`ConsumerInfo::alive`]), each with at
    /// most `max_leases` (up to 1,000) of its oldest owned entries, in the group's order.
    /// Errors: [`QueueError::InvalidQueueName`], backend errors.
    pub async fn consumers(&self, queue: &str, max_leases: usize) -> Result<Vec<ConsumerInfo>, QueueError> {
        validate_queue_name(queue)?;
        self.backend.consumers(queue, max_leases.min(1000)).await
    }

    /// Dead letters of `queue`, oldest first, at most `limit`.
    pub async fn dead_letters(&self, queue: &str, limit: usize) -> Result<Vec<DeadLetter>, QueueError> {
        validate_queue_name(queue)?;
        self.backend.dead_letters(queue, limit).await
    }

    /// Puts one dead letter back at the tail of `queue` with a fresh delivery count; returns its
    /// new id. Errors: [`QueueError::DeadLetterNotFound`].
    pub async fn replay_dead_letter(&self, queue: &str, id: MessageId) -> Result<MessageId, QueueError> {
        validate_queue_name(queue)?;
        self.backend.replay_dead_letter(queue, id).await
    }

    /// Puts up to `limit` dead letters back (oldest first); returns how many.
    pub async fn replay_dead_letters(&self, queue: &str, limit: usize) -> Result<u64, QueueError> {
        validate_queue_name(queue)?;
        self.backend.replay_dead_letters(queue, limit).await
    }

    /// Schedules `payload` on `queue` under `name`, to be appended to the queue (as a new entry,
    /// as [`MessageStream::offer`] would) at `due` (by the backend's clock: Redis's on Redis),
    /// atomically with nothing else; a later call with the same name replaces the entry (its
    /// payload and due time). A scheduled entry waits in the queue's delayed set, not in the
    /// stream: it is never delivered, pending or redelivered before it is due. It is promoted by
    /// any running consumer of the queue within a few milliseconds of `due` (a due time in the
    /// past: at once), so promotion needs a consumer. Returns `true` when the name was new.
    ///
    /// `name`: 1 to 400 bytes with at least one `:` (so that it never reads as an entry id).
    /// Errors: [`QueueError::InvalidSettings`] (bad name), [`QueueError::InvalidQueueName`],
    /// backend errors.
    pub async fn offer_at(
        &self,
        queue: &str,
        name: &str,
        payload: impl Into<Bytes>,
        due: std::time::SystemTime,
    ) -> Result<bool, QueueError> {
        self.offer_at_with(queue, name, payload, due, OfferOptions::default()).await
    }

    /// [`MessageStream::offer_at`] with `options` (the entry's concurrency key and priority,
    /// which it keeps while it waits and carries into the stream when due).
    ///
    /// Errors: those of [`MessageStream::offer_at`], [`QueueError::InvalidSettings`] for a bad
    /// concurrency key ([`validate_concurrency_key`]) or priority ([`validate_priority`]).
    pub async fn offer_at_with(
        &self,
        queue: &str,
        name: &str,
        payload: impl Into<Bytes>,
        due: std::time::SystemTime,
        options: OfferOptions,
    ) -> Result<bool, QueueError> {
        validate_queue_name(queue)?;
        validate_schedule_name(name)?;
        if let Some(k) = &options.concurrency_key {
            validate_concurrency_key(k)?;
        }
        validate_priority(options.priority)?;
        let payload = payload.into();
        let op = backend::ScheduleOp::Add {
            name,
            due_ms: epoch_ms(due),
            payload: &payload,
            key: options.concurrency_key.as_deref(),
            priority: options.priority,
        };
        let reply = self.backend.schedule(queue, op).await?;
        // New or replaced, the entry waits for `due` now.
        self.due_hint(queue, due);
        Ok(matches!(reply, backend::ScheduleReply::Done(true)))
    }

    /// Sets the due time of `queue`'s scheduled entry `name` ([`MessageStream::offer_at`]);
    /// `false` when it does not wait any more (promoted, removed, or never scheduled).
    /// Errors: as [`MessageStream::offer_at`].
    pub async fn reschedule(&self, queue: &str, name: &str, due: std::time::SystemTime) -> Result<bool, QueueError> {
        validate_queue_name(queue)?;
        validate_schedule_name(name)?;
        let op = backend::ScheduleOp::Move { name, due_ms: epoch_ms(due) };
        let moved = matches!(self.backend.schedule(queue, op).await?, backend::ScheduleReply::Done(true));
        if moved {
            self.due_hint(queue, due);
        }
        Ok(moved)
    }

    /// Removes `queue`'s scheduled entry `name` ([`MessageStream::offer_at`]) unpromoted;
    /// `false` when it does not wait any more. Errors: as [`MessageStream::offer_at`].
    pub async fn unschedule(&self, queue: &str, name: &str) -> Result<bool, QueueError> {
        validate_queue_name(queue)?;
        validate_schedule_name(name)?;
        let op = backend::ScheduleOp::Remove { name };
        Ok(matches!(self.backend.schedule(queue, op).await?, backend::ScheduleReply::Done(true)))
    }

    /// How many scheduled entries of `queue` ([`MessageStream::offer_at`]) wait, and the due
    /// time of the earliest (`None` when none waits, or when it is not among the first 1,000
    /// members of the delayed set, `RetryAfter` entries included). Errors:
    /// [`QueueError::InvalidQueueName`], backend errors.
    pub async fn scheduled(&self, queue: &str) -> Result<(u64, Option<std::time::SystemTime>), QueueError> {
        validate_queue_name(queue)?;
        match self.backend.schedule(queue, backend::ScheduleOp::Count).await? {
            backend::ScheduleReply::Count(n, first) => {
                Ok((n, first.map(|ms| std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))))
            }
            backend::ScheduleReply::Done(_) => Ok((0, None)),
        }
    }

    /// Deletes every dead letter of `queue`; returns how many there were.
    pub async fn purge_dead_letters(&self, queue: &str) -> Result<u64, QueueError> {
        validate_queue_name(queue)?;
        self.backend.purge_dead_letters(queue).await
    }
}

/// Milliseconds since the Unix epoch (0 before it).
fn epoch_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A scheduled entry's name: 1 to 400 bytes, with a `:`.
fn validate_schedule_name(name: &str) -> Result<(), QueueError> {
    if name.is_empty() || name.len() > 400 || !name.contains(':') {
        return Err(QueueError::InvalidSettings(format!(
            "a scheduled entry's name is 1 to 400 bytes with a ':', not {name:?}"
        )));
    }
    Ok(())
}

/// A handler for JSON payloads: decodes each payload into `T` and calls `f`. A payload that does
/// not decode is moved to dead letters (reason `undecodable payload: …`) instead of looping.
pub fn json_handler<T, F, Fut>(f: F) -> impl Handler
where
    T: DeserializeOwned + Send + 'static,
    F: Fn(T, Delivery) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Decision> + Send + 'static,
{
    let f = Arc::new(f);
    move |d: Delivery| {
        let f = f.clone();
        async move {
            match serde_json::from_slice::<T>(&d.payload) {
                Ok(v) => f(v, d).await,
                Err(e) => Decision::DeadLetter(format!("undecodable payload: {e}")),
            }
        }
    }
}
