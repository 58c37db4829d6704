//! The seam between the backend-independent dispatcher (`consumer.rs`) and a storage backend
//! (`memory.rs`, `redis/`). Both backends implement the same semantics, described on each method.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::{DeadLetter, MessageId, QueueError, QueueStats};

/// A message handed to the dispatcher by a read or a reclaim.
#[derive(Debug, Clone)]
pub(crate) struct RawDelivery {
    pub id: MessageId,
    /// `None` when the entry is malformed (no payload field): the dispatcher dead-letters it.
    pub payload: Option<Bytes>,
    /// Deliveries including this one.
    pub deliveries: u32,
}

/// Result of one reclaim tick.
#[derive(Debug, Default)]
pub(crate) struct Reclaimed {
    pub deliveries: Vec<RawDelivery>,
    /// Entries moved to dead letters by this tick because they exceeded `max_deliveries`.
    pub dead_lettered: u64,
    /// Ids XAUTOCLAIM reported as deleted from the stream (and removed from the pending list).
    pub deleted: u64,
    /// Delayed entries promoted back into the stream.
    pub promoted: u64,
}

/// Per-consumer settings a backend needs.
#[derive(Debug, Clone)]
pub(crate) struct ConsumerSpec {
    pub queue: String,
    pub consumer: String,
    pub claim_timeout: Duration,
    pub max_deliveries: Option<u32>,
}

/// Queue-level operations of a backend.
#[async_trait]
pub(crate) trait Backend: Send + Sync + 'static {
    /// Appends payloads at the tail, in order, in one round trip; returns their ids.
    async fn offer(&self, queue: &str, payloads: &[Bytes]) -> Result<Vec<MessageId>, QueueError>;
    /// Creates the consumer group if missing and registers a consumer.
    async fn open_consumer(&self, spec: ConsumerSpec) -> Result<Arc<dyn ConsumerBackend>, QueueError>;
    /// A renewer for `spec`'s leases. Called on the heartbeat thread, so that its connection
    /// lives on that thread's runtime.
    async fn renewer(&self, spec: ConsumerSpec) -> Result<Box<dyn Renewer>, QueueError>;
    async fn stats(&self, queue: &str) -> Result<QueueStats, QueueError>;
    /// Oldest first, at most `limit`.
    async fn dead_letters(&self, queue: &str, limit: usize) -> Result<Vec<DeadLetter>, QueueError>;
    /// Moves one dead letter back to the queue's tail (fresh delivery count); returns the new id.
    async fn replay_dead_letter(&self, queue: &str, id: MessageId) -> Result<MessageId, QueueError>;
    /// Moves up to `limit` dead letters back; returns how many.
    async fn replay_dead_letters(&self, queue: &str, limit: usize) -> Result<u64, QueueError>;
    /// Deletes all dead letters; returns how many there were.
    async fn purge_dead_letters(&self, queue: &str) -> Result<u64, QueueError>;
}

/// Operations of one registered consumer.
#[async_trait]
pub(crate) trait ConsumerBackend: Send + Sync {
    /// Reads up to `count` never-delivered entries, waiting up to `block` for the first.
    /// Recreates the group when it is missing (NOGROUP).
    async fn read_new(&self, count: usize, block: Duration) -> Result<Vec<RawDelivery>, QueueError>;
    /// Promotes due delayed entries, then takes over up to `count` entries idle for at least
    /// `claim_timeout` (continuing the previous tick's cursor), dead-lettering those past
    /// `max_deliveries` in the same atomic step. Ids in `exclude` (released leases whose handler
    /// still runs here) are left reclaimable for a peer, their delivery count unchanged.
    async fn reclaim(&self, count: usize, exclude: &[MessageId]) -> Result<Reclaimed, QueueError>;
    /// Acks and deletes each id this consumer still owns; `true` per id acked, `false` refused.
    async fn ack(&self, ids: &[MessageId]) -> Result<Vec<bool>, QueueError>;
    /// The same as [`ConsumerBackend::ack`] for one id, done at once without waiting, when the
    /// backend can (memory: one lock); `None` sends the ack through the batcher.
    fn ack_now(&self, id: MessageId) -> Option<bool> {
        let _ = id;
        None
    }
    /// Redis only: where this consumer's entries live, for acks done in a caller's script.
    fn redis_target(&self) -> Option<crate::RedisAckTarget> {
        None
    }
    /// Schedules redelivery after `delay`; `false` if no longer owned.
    async fn retry_after(&self, id: MessageId, delay: Duration) -> Result<bool, QueueError>;
    /// Moves an owned entry to dead letters; `false` if no longer owned.
    async fn dead_letter(&self, id: MessageId, deliveries: u32, reason: &str) -> Result<bool, QueueError>;
    /// Removes other consumers idle at least `idle` with no pending entry; returns how many.
    async fn reap_idle_consumers(&self, idle: Duration) -> Result<u64, QueueError>;
}

/// Renews leases; lives on the heartbeat thread.
#[async_trait]
pub(crate) trait Renewer: Send {
    /// Resets the idle time of each id in `renew` still owned by this consumer, and makes each id
    /// in `release` reclaimable at once (idle = claim timeout), in ONE atomic round trip. Returns
    /// the ids of `renew` that this consumer no longer owns (lost leases).
    async fn renew(&mut self, renew: &[MessageId], release: &[MessageId]) -> Result<Vec<MessageId>, QueueError>;
}
