//! # baton-queue — the leased work queue (`MessageStream`)
//!
//! A queue is a Redis Stream read through one consumer group (or its in-memory equivalent).
//! What sets it apart from queues that only know idle time: a handler that runs long is never
//! reclaimed while its process lives.
//!
//! * **Heartbeat lease.** While a handler runs, its entry is re-claimed to its own consumer
//!   (`XCLAIM … 0 <ids…> JUSTID`) every `heartbeat_interval` (default `claim_timeout / 3`), for all
//!   leases of a queue in ONE ownership-checked script call per tick, from a dedicated thread with
//!   its own connection. A lease another consumer took is never taken back; the handler is told
//!   through [`Lease::lost`].
//! * **Failover.** When a process dies its renewals stop; another consumer takes the entry once it
//!   has been idle for `claim_timeout` (paged `XAUTOCLAIM`, never a full pending-list scan).
//! * **Bounded hangs.** Past `max_processing_time` (default 15 min) renewal stops, the entry is
//!   made reclaimable at once, the lost-lease signal fires, a warning and a metric are emitted.
//! * **Decisions.** A handler returns [`Decision::Ack`] (XACK + XDEL atomically, refused if no
//!   longer owned), [`Decision::Retry`] (redelivered after `claim_timeout`, not heartbeated),
//!   [`Decision::RetryAfter`], [`Decision::Deferred`] (settle later through the [`Lease`]) or
//!   [`Decision::DeadLetter`].
//! * **Poison messages** go to a dead-letter stream after `max_deliveries` (atomically with their
//!   removal); list, replay and purge them through [`MessageStream`].
//!
//! Backends: [`MessageStream::memory`] (in-process, same semantics) and [`MessageStream::redis`]
//! (standalone or Cluster; key layout in the `redis` module docs). Metrics (through the `metrics`
//! crate, label `queue`): `baton_queue_leases_expired_total`, `baton_queue_leases_lost_total`,
//! `baton_queue_lease_renewals_total`, `baton_queue_lease_renewal_failures_total`,
//! `baton_queue_renewal_seconds`, `baton_queue_reclaims_total`, `baton_queue_dead_letters_total`,
//! `baton_queue_outcomes_total{decision,result}`, `baton_queue_handler_seconds`.

mod api;
mod backend;
mod consumer;
mod engine;
mod lease;
mod memory;
mod redis;
mod settings;

use std::sync::Arc;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

pub use api::*;
pub use consumer::{Consumer, Handler};
pub use lease::{Lease, RedisAckTarget};
pub use redis::RedisQueueOptions;
pub use settings::ConsumerOptions;

use backend::Backend;

/// Work queues on one backend. Cheap to clone; one instance serves any number of named queues.
#[derive(Clone)]
pub struct MessageStream {
    backend: Arc<dyn Backend>,
}

impl MessageStream {
    /// The in-memory backend: queues live in this process only.
    pub fn memory() -> Self {
        Self { backend: Arc::new(memory::MemoryBackend::default()) }
    }

    /// The Redis backend (standalone or Cluster, as `client` says). Connects now.
    ///
    /// Errors: [`QueueError::Connect`] when Redis is unreachable, [`QueueError::InvalidSettings`].
    pub async fn redis(client: baton_redis::RedisClient, options: RedisQueueOptions) -> Result<Self, QueueError> {
        Ok(Self { backend: Arc::new(redis::RedisBackend::connect(client, options).await?) })
    }

    /// Appends one message to `queue`; returns its id.
    pub async fn offer(&self, queue: &str, payload: impl Into<Bytes>) -> Result<MessageId, QueueError> {
        validate_queue_name(queue)?;
        let ids = self.backend.offer(queue, &[payload.into()]).await?;
        Ok(ids[0])
    }

    /// Appends messages in order, in one round trip; returns their ids in the same order.
    pub async fn offer_batch(&self, queue: &str, payloads: Vec<Bytes>) -> Result<Vec<MessageId>, QueueError> {
        validate_queue_name(queue)?;
        if payloads.is_empty() {
            return Ok(Vec::new());
        }
        self.backend.offer(queue, &payloads).await
    }

    /// Appends `value` serialized as JSON.
    pub async fn offer_json<T: Serialize>(&self, queue: &str, value: &T) -> Result<MessageId, QueueError> {
        let bytes = serde_json::to_vec(value).map_err(|e| QueueError::InvalidSettings(format!("payload not serializable: {e}")))?;
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
        Consumer::start(self.backend.clone(), queue, Arc::new(handler), options).await
    }

    /// Exact counts for `queue` (see [`QueueStats`]).
    pub async fn stats(&self, queue: &str) -> Result<QueueStats, QueueError> {
        validate_queue_name(queue)?;
        self.backend.stats(queue).await
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

    /// Deletes every dead letter of `queue`; returns how many there were.
    pub async fn purge_dead_letters(&self, queue: &str) -> Result<u64, QueueError> {
        validate_queue_name(queue)?;
        self.backend.purge_dead_letters(queue).await
    }
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
