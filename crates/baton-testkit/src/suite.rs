//! Helpers shared by the conformance suites: [`eventually`] and [`on_every_backend!`](crate::on_every_backend).

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
