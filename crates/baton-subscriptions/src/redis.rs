//! The Redis backend (standalone or Cluster): every key under the delivery queue's hash tag
//! `{__ds-subscriptions}`, so a record, the registry and the queue's stream change in one script
//! on one node.
//!
//! | key                                             | type   | holds |
//! |-------------------------------------------------|--------|-------|
//! | `baton:q:{__ds-subscriptions}:sub:<id>`         | hash   | `v` version, `s` record JSON (`''` once deleted, kept a day) |
//! | `baton:q:{__ds-subscriptions}:registry`         | hash   | id → registry entry JSON |
//! | `baton:q:{__ds-subscriptions}:registry:v`       | string | registry version counter |
//! | `baton:q:{__ds-subscriptions}:keys`             | hash   | kid → signing key JSON, `current` → kid |
//! | `baton:q:{__ds-subscriptions}` (and the rest of `baton_queue::keys`) | stream | delivery messages |

use async_trait::async_trait;
use baton_queue::{keys, MessageStream, RedisQueueOptions};
use baton_redis::{LuaScript, RedisClient, RedisConn};

use crate::backend::{Backend, DriveMessage, Loaded, RegistryOp, QUEUE};
use crate::model::{Entry, Record, Result, SubscriptionError};
use crate::signing::{KeyRing, StoredKey};

static LOAD: LuaScript = LuaScript::new("subscriptions/load", include_str!("../scripts/load.lua"));
static STORE: LuaScript = LuaScript::new("subscriptions/store", include_str!("../scripts/store.lua"));
static KEYS: LuaScript = LuaScript::new("subscriptions/keys", include_str!("../scripts/keys.lua"));

fn unavailable(e: impl std::fmt::Display) -> SubscriptionError {
    SubscriptionError::Unavailable(e.to_string())
}

fn base() -> String {
    keys::stream(keys::DEFAULT_PREFIX, QUEUE)
}

/// The state key of subscription `id`.
pub fn state_key(id: &str) -> String {
    format!("{}:sub:{id}", base())
}

pub struct RedisBackend {
    conn: RedisConn,
    queue: MessageStream,
    stream: String,
    registry: String,
    registry_v: String,
    keys: String,
}

impl RedisBackend {
    pub async fn connect(client: RedisClient) -> Result<Self> {
        let conn = client.shared().await.map_err(unavailable)?;
        let queue = MessageStream::redis(client, RedisQueueOptions::default()).await.map_err(unavailable)?;
        let b = base();
        Ok(Self {
            conn,
            queue,
            stream: b.clone(),
            registry: format!("{b}:registry"),
            registry_v: format!("{b}:registry:v"),
            keys: format!("{b}:keys"),
        })
    }

    fn ring(fields: Vec<String>) -> Result<KeyRing> {
        let mut ring = KeyRing::default();
        let mut current = None;
        for pair in fields.chunks(2) {
            let [k, v] = pair else { continue };
            if k == "current" {
                current = Some(v.clone());
                continue;
            }
            let key: StoredKey = serde_json::from_str(v).map_err(unavailable)?;
            ring.keys.push(key);
        }
        // The `current` field decides, whatever two racing rotations left in retired_ms.
        if let Some(c) = current {
            for k in ring.keys.iter_mut() {
                if k.kid == c {
                    k.retired_ms = None;
                } else if k.retired_ms.is_none() {
                    k.retired_ms = Some(k.created_ms);
                }
            }
        }
        Ok(ring)
    }
}

#[async_trait]
impl Backend for RedisBackend {
    async fn load(&self, id: &str) -> Result<Loaded> {
        let mut c = self.conn.clone();
        let (v, s, secs, micros): (u64, String, u64, u64) =
            LOAD.run(&mut c, &[&state_key(id)], &[]).await.map_err(unavailable)?;
        let record = if s.is_empty() { None } else { Some(serde_json::from_str(&s).map_err(unavailable)?) };
        Ok(Loaded { record, version: v, now_ms: secs * 1000 + micros / 1000 })
    }

    async fn store(
        &self,
        id: &str,
        version: u64,
        record: Option<&Record>,
        registry: RegistryOp,
        driver: Option<&str>,
    ) -> Result<bool> {
        let mut c = self.conn.clone();
        let json = match record {
            Some(r) => serde_json::to_string(r).expect("a record serializes"),
            None => String::new(),
        };
        let (op, entry) = match registry {
            RegistryOp::Keep => ("", String::new()),
            RegistryOp::Put(e) => ("put", serde_json::to_string(&e).expect("an entry serializes")),
            RegistryOp::Remove => ("del", String::new()),
        };
        let payload = driver.map(|d| DriveMessage::payload(id, d)).unwrap_or_default();
        let ok: i64 = STORE
            .run(
                &mut c,
                &[&state_key(id), &self.registry, &self.registry_v, &self.stream],
                &[&version, &json, &op, &entry, &payload, &id, &keys::PAYLOAD_FIELD],
            )
            .await
            .map_err(unavailable)?;
        Ok(ok == 1)
    }

    async fn registry_version(&self) -> Result<u64> {
        let mut c = self.conn.clone();
        let v: Option<u64> =
            baton_redis::redis::cmd("GET").arg(&self.registry_v).query_async(&mut c).await.map_err(unavailable)?;
        Ok(v.unwrap_or(0))
    }

    async fn registry(&self) -> Result<(u64, Vec<Entry>)> {
        let mut c = self.conn.clone();
        // Version first: a change between the two reads shows as a newer version next time.
        let v = self.registry_version().await?;
        let all: Vec<(String, String)> =
            baton_redis::redis::cmd("HGETALL").arg(&self.registry).query_async(&mut c).await.map_err(unavailable)?;
        let mut out = Vec::with_capacity(all.len());
        for (_, e) in all {
            out.push(serde_json::from_str(&e).map_err(unavailable)?);
        }
        Ok((v, out))
    }

    async fn keys(&self, now_ms: u64) -> Result<KeyRing> {
        let mut c = self.conn.clone();
        let k = StoredKey::generate(now_ms);
        let json = serde_json::to_string(&k).expect("serializes");
        let fields: Vec<String> = KEYS
            .run(&mut c, &[&self.keys, &self.registry_v], &[&"init", &k.kid, &json, &"", &""])
            .await
            .map_err(unavailable)?;
        Self::ring(fields)
    }

    async fn rotate(&self, now_ms: u64) -> Result<KeyRing> {
        let ring = self.keys(now_ms).await?;
        let (old_json, old_kid) = match ring.current() {
            Some(cur) => {
                let mut old = cur.clone();
                old.retired_ms = Some(now_ms);
                (serde_json::to_string(&old).expect("serializes"), old.kid)
            }
            None => (String::new(), String::new()),
        };
        let k = StoredKey::generate(now_ms);
        let json = serde_json::to_string(&k).expect("serializes");
        let mut c = self.conn.clone();
        let fields: Vec<String> = KEYS
            .run(&mut c, &[&self.keys, &self.registry_v], &[&"rotate", &k.kid, &json, &old_json, &old_kid])
            .await
            .map_err(unavailable)?;
        Self::ring(fields)
    }

    async fn now_ms(&self) -> Result<u64> {
        let mut c = self.conn.clone();
        let (secs, micros): (u64, u64) =
            baton_redis::redis::cmd("TIME").query_async(&mut c).await.map_err(unavailable)?;
        Ok(secs * 1000 + micros / 1000)
    }

    fn queue(&self) -> &MessageStream {
        &self.queue
    }
}
