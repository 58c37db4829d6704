//! The hot path's shortcuts keep their guarantees (every backend):
//! * a terminal write acks its queue message in the same atomic step (Redis): once a waiter sees
//!   the terminal state, nothing is pending any more;
//! * only terminal writes are announced on the queue's channel, tagged with their origin, and a
//!   command going SUBMITTED → RUNNING → SUCCEEDED is announced exactly once;
//! * submits prune the indexes of expired states every few calls (Redis), so the indexes stay
//!   bounded even when nobody lists or counts;
//! * state reads started together are one `MGET` per home queue (Redis), each caller still
//!   getting its own command's state.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_commands::{Command, CommandResult, CommandService, CommandStatus};
use baton_redis::redis;
use baton_redis::RedisConfig;
use baton_testkit::TestBackend;
use common::*;
use futures::StreamExt;
use serde_json::json;

baton_testkit::on_every_backend!(
    terminal_write_acks_atomically,
    only_terminal_writes_are_announced,
    submits_prune_expired_index_entries,
    concurrent_reads_are_batched_per_queue
);

async fn concurrent_reads_are_batched_per_queue(b: TestBackend) {
    let store = store_for(&b).await;
    let (qa, qb) = (queue_name("batch-a"), queue_name("batch-b"));
    let mut ids = Vec::new();
    for i in 0..40 {
        let q = if i % 2 == 0 { &qa } else { &qb };
        ids.push((store.submit(q, Command::with_id(format!("rb-{i}"), "t", json!(i))).await.unwrap().id, i));
    }
    let stats = |conn: baton_redis::RedisConn| async move {
        let mut conn = conn;
        let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap();
        let calls = |name: &str| -> u64 {
            info.lines()
                .find(|l| l.starts_with(&format!("cmdstat_{name}:")))
                .and_then(|l| l.split("calls=").nth(1))
                .and_then(|v| v.split(',').next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        (calls("get"), calls("mget"))
    };
    let standalone = match b.redis_config() {
        Some(RedisConfig::Standalone(url)) => {
            let conn = baton_redis::RedisClient::new(RedisConfig::Standalone(url)).unwrap().shared().await.unwrap();
            let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut conn.clone()).await.unwrap();
            Some(conn)
        }
        _ => None,
    };
    // 40 reads started in one turn (the ids are cached: no lookup reads).
    let reads = ids.iter().map(|(id, _)| store.get(id));
    let states = futures::future::join_all(reads).await;
    for ((id, i), st) in ids.iter().zip(states) {
        let st = st.unwrap().expect("stored");
        assert_eq!((&st.id, &st.params), (id, &json!(i)));
    }
    if let Some(conn) = standalone {
        let (gets, mgets) = stats(conn).await;
        // One MGET per queue when all 40 land in one batch; never a GET per read.
        assert_eq!(gets, 0, "state reads went one by one");
        assert!((2..=8).contains(&mgets), "{mgets} MGETs for 40 reads of 2 queues");
    }
    assert_eq!(store.get("rb-missing").await.unwrap(), None);
}

async fn submits_prune_expired_index_entries(b: TestBackend) {
    let Some(config) = b.redis_config() else { return }; // memory has no index keys
    let settings = baton_commands::StoreSettings { state_ttl: Duration::from_secs(60), retention: Duration::from_secs(1) };
    let store = store_with(&b, settings).await;
    let q = queue_name("prune");
    for i in 0..5 {
        store.submit(&q, Command::with_id(format!("old-{i}"), "t", json!(i))).await.unwrap();
        store.cancel(&format!("old-{i}")).await.unwrap();
    }
    let conn = baton_redis::RedisClient::new(config).unwrap().shared().await.unwrap();
    let zcard = |key: String| {
        let mut conn = conn.clone();
        async move { redis::cmd("ZCARD").arg(key).query_async::<u64>(&mut conn).await.unwrap() }
    };
    let cancelled = format!("baton:cmd:{{{q}}}:s:CANCELLED");
    let exp = format!("baton:cmd:{{{q}}}:exp");
    assert_eq!((zcard(cancelled.clone()).await, zcard(exp.clone()).await), (5, 5));
    tokio::time::sleep(Duration::from_millis(1300)).await; // retention passes; the states expire
    // One store prunes on every 64th submit (its first included): 64 submits prune once.
    for i in 0..64 {
        store.submit(&q, Command::with_id(format!("new-{i}"), "t", json!(i))).await.unwrap();
    }
    assert_eq!(zcard(cancelled).await, 0);
    assert_eq!(zcard(exp).await, 64);
    assert_eq!(zcard(format!("baton:cmd:{{{q}}}:s:SUBMITTED")).await, 64);
}

async fn terminal_write_acks_atomically(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("fastack");
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler("noop", on_execute(|_c| async { Ok(CommandResult::succeeded(json!(null))) }))
        .start()
        .await
        .unwrap();
    for _ in 0..30 {
        let id = svc.submit(Command::new("noop", json!({}))).await.unwrap().id;
        let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
        assert_eq!(st.status, CommandStatus::Succeeded);
        let stats = store.messages().stats(&q).await.unwrap();
        if b.redis_config().is_some() {
            // The same script wrote SUCCEEDED and acked: no window with the message pending.
            assert_eq!((stats.length, stats.pending), (0, 0), "{stats:?}");
        } else {
            // Memory acks right after the write, without a round trip.
            let s2 = store.clone();
            let q2 = q.clone();
            eventually(Duration::from_secs(2), || {
                let (s2, q2) = (s2.clone(), q2.clone());
                async move { s2.messages().stats(&q2).await.ok().filter(|s| s.length == 0 && s.pending == 0) }
            })
            .await
            .expect("acked");
        }
    }
    svc.close().await;
}

async fn only_terminal_writes_are_announced(b: TestBackend) {
    let url = match b.redis_config() {
        None => return, // memory has no channel
        Some(RedisConfig::Standalone(u)) => u,
        Some(RedisConfig::Cluster(us)) => us[0].clone(),
    };
    let store = store_for(&b).await;
    let q = queue_name("announce");
    let mut ps = redis::Client::open(url.as_str()).unwrap().get_async_pubsub().await.unwrap();
    ps.subscribe(format!("baton:cmd:{{{q}}}:events")).await.unwrap();
    let got: Arc<Mutex<Vec<String>>> = Arc::default();
    let g2 = got.clone();
    let reader = tokio::spawn(async move {
        let mut s = ps.on_message();
        while let Some(m) = s.next().await {
            g2.lock().unwrap().push(String::from_utf8_lossy(m.get_payload_bytes()).into_owned());
        }
    });
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "slow",
            on_execute(|_c| async { Ok(CommandResult::running_after(Duration::from_millis(50))) })
                .on_check(|_c, _s| async { Ok(CommandResult::succeeded(json!("done"))) }),
        )
        .start()
        .await
        .unwrap();
    let id = svc.submit(Command::new("slow", json!({}))).await.unwrap().id;
    let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((st.status, st.version), (CommandStatus::Succeeded, 3), "SUBMITTED → RUNNING → SUCCEEDED");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let msgs = got.lock().unwrap().clone();
    assert_eq!(msgs.len(), 1, "one announcement, for the terminal write only: {msgs:?}");
    let parts: Vec<&str> = msgs[0].split(' ').collect();
    assert_eq!(parts.len(), 4, "<id> <STATUS> <version> <origin>: {msgs:?}");
    assert_eq!((parts[0], parts[1], parts[2]), (id.as_str(), "SUCCEEDED", "3"));
    assert!(!parts[3].is_empty());
    reader.abort();
    svc.close().await;
}
