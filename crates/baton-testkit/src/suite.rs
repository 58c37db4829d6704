//! Helpers shared by the conformance suites: [`eventually`], [`on_every_backend!`](crate::on_every_backend)
//! and [`on_memory_and_standalone!`](crate::on_memory_and_standalone).

use std::time::{Duration, Instant};

// ------------------------------------------------------------------------------------------------
// Shared suite helpers
// ------------------------------------------------------------------------------------------------

/// Polls `f` every 20 ms until it returns `Some`, or `timeout` passes (then `None`).
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

/// Instantiates each listed `async fn name(backend: TestBackend)` (in scope at the call site) as
/// three tests in a module `name`: `memory`, `standalone` (a fresh `redis-server`) and `cluster`
/// (a fresh 3-master Redis Cluster), each on a 2-worker multi-thread Tokio runtime.
#[macro_export]
macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use $crate::{require_redis, RedisCluster, RedisServer, TestBackend};
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

/// Like [`on_every_backend!`](crate::on_every_backend) without the cluster: instantiates each
/// listed `async fn name(backend: TestBackend)` (in scope at the call site) as two tests in a
/// module `name`: `memory` and `standalone` (a fresh `redis-server`), each on a 2-worker
/// multi-thread Tokio runtime. For suites whose subject does not depend on key slots.
#[macro_export]
macro_rules! on_memory_and_standalone {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use $crate::{require_redis, RedisServer, TestBackend};
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::$name(TestBackend::Memory).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn standalone() {
                require_redis();
                super::$name(TestBackend::Standalone(RedisServer::start())).await
            }
        }
    )*};
}

/// Like [`on_every_backend!`](crate::on_every_backend) without memory: instantiates each listed
/// `async fn name(backend: TestBackend)` as two tests in a module `name`: `standalone` (a fresh
/// `redis-server`) and `cluster` (a fresh 3-master Redis Cluster), each on a 2-worker
/// multi-thread Tokio runtime. For what only a Redis backend can show (other processes, Redis's
/// own view of the group).
#[macro_export]
macro_rules! on_redis {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use $crate::{require_redis, RedisCluster, RedisServer, TestBackend};
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
