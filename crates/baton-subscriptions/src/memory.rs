//! The in-memory backend: records, registry and keys in one mutex, delivery messages on an
//! in-memory `MessageStream`. Same semantics as Redis; gone when the process exits.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use baton_queue::MessageStream;

use crate::backend::{Backend, DriveMessage, Loaded, RegistryOp, QUEUE};
use crate::model::{Entry, Record, Result, SubscriptionError};
use crate::signing::{KeyRing, StoredKey};

#[derive(Default)]
struct State {
    records: HashMap<String, (u64, Option<Record>)>,
    registry: BTreeMap<String, Entry>,
    registry_version: u64,
    keys: KeyRing,
}

pub struct MemoryBackend {
    state: Mutex<State>,
    queue: MessageStream,
}

impl MemoryBackend {
    pub fn new() -> Self {
        Self { state: Mutex::new(State::default()), queue: MessageStream::memory() }
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[async_trait]
impl Backend for MemoryBackend {
    async fn load(&self, id: &str) -> Result<Loaded> {
        let s = self.state.lock().expect("lock");
        let (version, record) = s.records.get(id).cloned().unwrap_or((0, None));
        Ok(Loaded { record, version, now_ms: now() })
    }

    async fn store(
        &self,
        id: &str,
        version: u64,
        record: Option<&Record>,
        registry: RegistryOp,
        driver: Option<&str>,
    ) -> Result<bool> {
        {
            let mut s = self.state.lock().expect("lock");
            let cur = s.records.get(id).map(|(v, _)| *v).unwrap_or(0);
            if cur != version {
                return Ok(false);
            }
            s.records.insert(id.to_string(), (version + 1, record.cloned()));
            match registry {
                RegistryOp::Keep => {}
                RegistryOp::Put(e) => {
                    s.registry.insert(id.to_string(), e);
                    s.registry_version += 1;
                }
                RegistryOp::Remove => {
                    s.registry.remove(id);
                    s.registry_version += 1;
                }
            }
        }
        if let Some(d) = driver {
            // One process: nothing can come between the store above and this offer.
            self.queue
                .offer(QUEUE, DriveMessage::payload(id, d))
                .await
                .map_err(|e| SubscriptionError::Unavailable(e.to_string()))?;
        }
        Ok(true)
    }

    async fn registry_version(&self) -> Result<u64> {
        Ok(self.state.lock().expect("lock").registry_version)
    }

    async fn registry(&self) -> Result<(u64, Vec<Entry>)> {
        let s = self.state.lock().expect("lock");
        Ok((s.registry_version, s.registry.values().cloned().collect()))
    }

    async fn keys(&self, now_ms: u64) -> Result<KeyRing> {
        let mut s = self.state.lock().expect("lock");
        if s.keys.current().is_none() {
            s.keys.keys.push(StoredKey::generate(now_ms));
        }
        Ok(s.keys.clone())
    }

    async fn rotate(&self, now_ms: u64) -> Result<KeyRing> {
        let mut s = self.state.lock().expect("lock");
        for k in s.keys.keys.iter_mut().filter(|k| k.retired_ms.is_none()) {
            k.retired_ms = Some(now_ms);
        }
        s.keys.keys.push(StoredKey::generate(now_ms));
        s.registry_version += 1;
        Ok(s.keys.clone())
    }

    async fn now_ms(&self) -> Result<u64> {
        Ok(now())
    }

    fn queue(&self) -> &MessageStream {
        &self.queue
    }
}
