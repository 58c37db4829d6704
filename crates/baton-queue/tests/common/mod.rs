//! Helpers shared by the queue test files.
#![allow(dead_code)]

use std::time::Duration;

use baton_queue::{ConsumerOptions, MessageStream, RedisQueueOptions};
use baton_redis::redis;
use baton_redis::{RedisClient, RedisConn};
use baton_testkit::TestBackend;

pub async fn stream_for(b: &TestBackend) -> MessageStream {
    match b.redis_config() {
        None => MessageStream::memory(),
        Some(cfg) => MessageStream::redis(RedisClient::new(cfg).unwrap(), RedisQueueOptions::default())
            .await
            .unwrap(),
    }
}

pub async fn conn_for(b: &TestBackend) -> Option<RedisConn> {
    Some(RedisClient::new(b.redis_config()?).unwrap().shared().await.unwrap())
}

/// Owners of the pending entries of `queue` (Redis only), via XPENDING.
pub async fn pending_owners(conn: &mut RedisConn, queue: &str) -> Vec<(String, String, u64)> {
    let v: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(format!("baton:q:{{{queue}}}"))
        .arg("baton")
        .arg("-")
        .arg("+")
        .arg(1000)
        .query_async(conn)
        .await
        .unwrap_or_default();
    v.into_iter().map(|(id, owner, _idle, n)| (id, owner, n)).collect()
}

pub use baton_testkit::eventually;

pub fn queue_name(tag: &str) -> String {
    format!("{tag}-{}", uuid::Uuid::now_v7())
}

pub fn fast(ct_ms: u64) -> ConsumerOptions {
    ConsumerOptions::new()
        .with_claim_timeout(Duration::from_millis(ct_ms))
        .with_reap_idle_consumers_after(None)
}
