//! The shared Cluster connection after a storm of `CLIENT KILL`s, against a real 3-master
//! Redis Cluster: it must answer again soon after the storm ends.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_redis::{redis, RedisClient, RedisConn, DEFAULT_RESPONSE_TIMEOUT};
use baton_testkit::{require_redis, KillStorm, RedisCluster};

/// Concurrent writers on the shared connection while the storm lasts.
const WRITERS: usize = 64;
/// How long the storm lasts.
const STORM: Duration = Duration::from_secs(3);

/// `SET` of one key of a writer (keys spread over every master).
async fn set(conn: &mut RedisConn, writer: usize, n: u64) -> redis::RedisResult<()> {
    redis::cmd("SET").arg(format!("w{writer}:{}", n % 16)).arg(n).query_async(conn).await
}

/// `CLIENT KILL TYPE normal` on every node every 3 ms (hundreds of the shared connection's node
/// connections killed, each reconnect killed again) while `WRITERS` tasks send `SET`s on clones
/// of one shared connection. After the storm, a `SET` on that connection (and on its clones) must
/// succeed within two response timeouts: the redis crate's `ClusterConnection` may stay wedged
/// for good after such a storm (every call timing out), and the shared connection must then
/// replace it (one response timeout to notice, the rest to connect afresh). Measured: the
/// connection wedged early in the storm, was replaced about one response timeout later, and the
/// first call after the writers' last ones succeeded (about 2 s after the storm).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_cluster_connection_answers_again_after_a_client_kill_storm() {
    require_redis();
    let cluster = RedisCluster::start();
    let client = RedisClient::new(cluster.config()).unwrap();
    let conn = client.shared().await.unwrap();
    let storm = KillStorm::start(cluster.urls(), Duration::from_millis(3)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (mut conn, stop, ok, failed) = (conn.clone(), stop.clone(), ok.clone(), failed.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    match set(&mut conn, w, n).await {
                        Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                        Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    tokio::time::sleep(STORM).await;
    stop.store(true, Ordering::Relaxed);
    let calm = Instant::now();
    let killed = storm.stop().await;
    eprintln!(
        "{killed} connections killed; {} SETs succeeded and {} failed during the storm",
        ok.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );
    assert!(killed > 0, "the storm killed no connection");
    // The writers' last calls end within the response timeout.
    for w in writers {
        w.await.unwrap();
    }
    let limit = 2 * DEFAULT_RESPONSE_TIMEOUT;
    let mut errors: Vec<String> = Vec::new();
    let mut probe = conn.clone();
    let recovered = loop {
        match set(&mut probe, 0, 1).await {
            Ok(()) => break calm.elapsed(),
            Err(e) => {
                let e = e.to_string();
                if !errors.contains(&e) {
                    errors.push(e);
                }
            }
        }
        assert!(
            calm.elapsed() < limit,
            "the shared Cluster connection still fails {limit:?} after the storm: {errors:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let RedisConn::Cluster(c) = &conn else { unreachable!("a Cluster configuration gives a Cluster connection") };
    eprintln!(
        "answers again {recovered:?} after the storm; errors on the way: {errors:?}; connection replaced {} time(s)",
        c.replacements()
    );
    // Every clone, old or new, answers: 100 SETs on each of 8 clones, each within 1 s.
    for w in 0..8 {
        let mut c = conn.clone();
        for n in 0..100u64 {
            tokio::time::timeout(Duration::from_secs(1), set(&mut c, w, n)).await.unwrap().unwrap();
        }
    }
    let got: String = redis::cmd("GET").arg("w7:3").query_async(&mut conn.clone()).await.unwrap();
    assert_eq!(got, "99");
}
