//! Breaker tests of the feed's long-polls against a real redis-server (connections, restarts).

use crate::common;

use std::time::Duration;

use baton_commands::{Command, CommandStore, EventFrom, RedisCommandStoreOptions};
use baton_redis::RedisClient;
use baton_testkit::RedisServer;
use common::*;
use serde_json::json;

fn clients(server: &RedisServer) -> usize {
    server.cli(&["CLIENT", "LIST"]).lines().filter(|l| !l.contains("cmd=client|list")).count()
}

/// Many long-polls of a queue's feed, aborted (clients gone): no connection is left behind, and
/// while they wait they share one tail watcher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_long_polls_leave_no_connections() {
    baton_testkit::require_redis();
    let server = RedisServer::start();
    let store = CommandStore::redis(RedisClient::new(server.config()).unwrap(), RedisCommandStoreOptions::default())
        .await
        .unwrap();
    let q = queue_name("leak");
    store.submit(&q, Command::new("x", json!({}))).await.unwrap();
    // Warm up lazily made connections.
    let _ = store.events_wait(&q, EventFrom::Now, 10, Duration::from_millis(200)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let baseline = clients(&server);
    let mut during = Vec::new();
    for _ in 0..3 {
        let tasks: Vec<_> = (0..40)
            .map(|i| {
                let (s, q) = (store.clone(), q.clone());
                tokio::spawn(async move {
                    if i % 2 == 0 {
                        s.events_wait(&q, EventFrom::Now, 10, Duration::from_secs(30)).await
                    } else {
                        s.events_wait(&q, EventFrom::Start, 10, Duration::from_secs(30)).await
                    }
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(500)).await;
        during.push(clients(&server));
        for t in &tasks {
            t.abort();
        }
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = clients(&server);
    assert!(during.iter().all(|&d| d <= baseline + 1), "baseline {baseline}, during {during:?}");
    assert_eq!(after, baseline, "baseline {baseline}, during {during:?}, after {after}");
}

/// A long-poll in flight across a redis-server restart (AOF on) wakes on an append made after it
/// by another process's store, with exactly the new event; offsets go on increasing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_poll_across_a_redis_restart_wakes_on_the_next_append() {
    use baton_testkit::ServerOptions;
    baton_testkit::require_redis();
    let mut server = RedisServer::start_with(ServerOptions { appendonly: true });
    let a = CommandStore::redis(RedisClient::new(server.config()).unwrap(), RedisCommandStoreOptions::default())
        .await
        .unwrap();
    let b = CommandStore::redis(RedisClient::new(server.config()).unwrap(), RedisCommandStoreOptions::default())
        .await
        .unwrap();
    let q = queue_name("restart");
    let c1 = a.submit(&q, Command::new("x", json!({}))).await.unwrap();
    let first = a.events(&q, EventFrom::Start, 10).await.unwrap();
    assert_eq!(first.events.len(), 1);
    let o1 = first.next_offset;
    let (a2, q2) = (a.clone(), q.clone());
    let poll = tokio::spawn(async move {
        loop {
            match a2.events_wait(&q2, EventFrom::After(o1), 10, Duration::from_secs(20)).await {
                Ok(p) if !p.events.is_empty() => return (std::time::Instant::now(), p),
                Ok(_) => {}
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let c2 = loop {
        match b.submit(&q, Command::new("x", json!({}))).await {
            Ok(s) => break s,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let submitted = std::time::Instant::now();
    let (woke, page) =
        tokio::time::timeout(Duration::from_secs(20), poll).await.expect("the long-poll returns").unwrap();
    let ids: Vec<&str> = page.events.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, [c2.id.as_str()]);
    assert!(woke.saturating_duration_since(submitted) < Duration::from_millis(2500), "{:?}", woke - submitted);
    let all = a.events(&q, EventFrom::Start, 10).await.unwrap();
    let ids: Vec<&str> = all.events.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, [c1.id.as_str(), c2.id.as_str()]);
    assert!(all.events[0].offset < all.events[1].offset);
}
