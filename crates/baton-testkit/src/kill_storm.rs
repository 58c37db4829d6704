//! [`KillStorm`]: `CLIENT KILL TYPE normal` on Redis nodes, again and again.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_redis::redis;

// ------------------------------------------------------------------------------------------------
// KillStorm
// ------------------------------------------------------------------------------------------------

/// A storm of `CLIENT KILL`s: one killer connection per node sends
/// `CLIENT KILL TYPE normal SKIPME yes` to it, node after node, then sleeps for the interval, and
/// again, until [`KillStorm::stop`]. Each round kills every normal client connection a node has
/// at that moment (so reconnects are killed again the next round), except the killers' own
/// (`SKIPME yes`); replication and pub/sub connections and the cluster bus are spared
/// (`TYPE normal`). A failed `CLIENT KILL` (a node
/// down or restarting) counts as no kill and the storm goes on. Must be started inside a Tokio
/// runtime. Dropping it without [`KillStorm::stop`] aborts the storm without waiting.
pub struct KillStorm {
    stop: Arc<AtomicBool>,
    task: Option<tokio::task::JoinHandle<u64>>,
}

impl KillStorm {
    /// Connects a killer to each of `urls` (`redis://…` of each node; panics when one cannot
    /// connect), then starts the storm: a round on every node, then a sleep of `interval`.
    pub async fn start(urls: impl IntoIterator<Item = String>, interval: Duration) -> KillStorm {
        let mut killers = Vec::new();
        for url in urls {
            let client = redis::Client::open(url.as_str()).unwrap_or_else(|e| panic!("KillStorm: bad URL {url}: {e}"));
            let conn = client
                .get_multiplexed_async_connection()
                .await
                .unwrap_or_else(|e| panic!("KillStorm: cannot connect to {url}: {e}"));
            killers.push(conn);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut killed = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for k in killers.iter_mut() {
                        let r: redis::RedisResult<i64> =
                            redis::cmd("CLIENT").arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"]).query_async(k).await;
                        killed += r.unwrap_or(0).max(0) as u64;
                    }
                    tokio::time::sleep(interval).await;
                }
                killed
            })
        };
        KillStorm { stop, task: Some(task) }
    }

    /// Ends the storm (the round under way finishes) and waits for it: the number of connections
    /// it killed (the sum of the `CLIENT KILL` replies).
    pub async fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let task = self.task.take().expect("KillStorm: a task until stopped");
        task.await.expect("KillStorm: the storm task panicked")
    }
}

impl Drop for KillStorm {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

impl fmt::Debug for KillStorm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KillStorm").field("stopped", &self.stop.load(Ordering::Relaxed)).finish()
    }
}
