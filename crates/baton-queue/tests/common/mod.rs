//! Helpers shared by the queue test files.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use baton_queue::{MessageStream, RedisQueueOptions};
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

/// Polls `f` every 20 ms until it returns Some or `timeout` passes.
pub async fn eventually<T, F, Fut>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Instantiates each listed `async fn name(backend: TestBackend)` on memory, Redis standalone and
/// a 3-master Redis Cluster.
#[macro_export]
macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use baton_testkit::{require_redis, RedisCluster, RedisServer, TestBackend};
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::$name(TestBackend::Memory).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn standalone() {
                require_redis();
                super::$name(TestBackend::Standalone(RedisServer::start())).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cluster() {
                require_redis();
                super::$name(TestBackend::Cluster(RedisCluster::start())).await
            }
        }
    )*};
}
