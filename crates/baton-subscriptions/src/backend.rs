//! The seam between the service and its storage: a subscription's record read with the
//! backend's clock, stored by compare-and-set on its version together with the registry change
//! and the delivery message it implies, the registry every process matches appends against,
//! and the signing keys. `memory.rs` and `redis.rs` implement it; every decision is made above
//! it, in `machine.rs`.

use async_trait::async_trait;
use baton_queue::MessageStream;

use crate::model::{Entry, Record, Result};
use crate::signing::KeyRing;

/// The delivery queue (a `baton-queue` queue) whose messages drive subscriptions.
pub const QUEUE: &str = "__ds-subscriptions";

/// A record as read.
#[derive(Debug)]
pub struct Loaded {
    /// `None`: no such subscription (never created, or deleted).
    pub record: Option<Record>,
    /// The version to pass to [`Backend::store`] (0 when it never existed).
    pub version: u64,
    /// The backend's clock, ms since the Unix epoch (Redis `TIME` on Redis).
    pub now_ms: u64,
}

/// What a store does to the registry.
#[derive(Debug)]
pub enum RegistryOp {
    Keep,
    Put(Entry),
    Remove,
}

#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Reads a subscription.
    async fn load(&self, id: &str) -> Result<Loaded>;
    /// Stores `record` (`None` deletes) if its version is still `version`, applies `registry`,
    /// and enqueues a delivery message `{"id", "driver"}` when `driver` is set, all in one
    /// atomic step. `Ok(false)`: the version changed (read again and redo the change).
    async fn store(
        &self,
        id: &str,
        version: u64,
        record: Option<&Record>,
        registry: RegistryOp,
        driver: Option<&str>,
    ) -> Result<bool>;
    /// The registry's version (changes with every create, delete, explicit stream change and key rotation).
    async fn registry_version(&self) -> Result<u64>;
    /// The registry and its version.
    async fn registry(&self) -> Result<(u64, Vec<Entry>)>;
    /// The signing keys, the first one made when there is none.
    async fn keys(&self, now_ms: u64) -> Result<KeyRing>;
    /// Makes a new key current; the previous one is retired (kept in the JWKS for its grace).
    async fn rotate(&self, now_ms: u64) -> Result<KeyRing>;
    /// The backend's clock, ms since the Unix epoch.
    async fn now_ms(&self) -> Result<u64>;
    /// The queue the delivery messages are in.
    fn queue(&self) -> &MessageStream;
}

/// The payload of a delivery message.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct DriveMessage {
    pub id: String,
    pub driver: String,
}

impl DriveMessage {
    pub fn payload(id: &str, driver: &str) -> String {
        serde_json::to_string(&DriveMessage { id: id.to_string(), driver: driver.to_string() }).expect("serializes")
    }
}
