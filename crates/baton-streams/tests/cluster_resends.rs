//! Appends on Redis Cluster while every node's client connections are killed again and again
//! (`CLIENT KILL TYPE normal` every 5 ms for 4 s, 16 appenders on one stream): the redis crate's
//! Cluster connection re-sends a command whose connection was killed after it ran, so a write
//! may be applied twice while its caller is answered once.
//!
//! * With a producer stamp the stream keeps each append once (the producer's sequence check
//!   answers the re-sent copy as a duplicate): every append answered OK is in the stream exactly
//!   once.
//! * Without one, the re-send guard of `write.lua` on Cluster (`scripts/write_guard.lua`, kept in
//!   the stream's metadata hash) answers the re-sent copy with the first copy's reply: every
//!   append answered OK is in the stream exactly once. (Before the guard: 975 of 30,940 appends
//!   answered OK were written twice.)
//! * A delete keeps the guard's fields in the stream's tombstone and a create carries them over
//!   (`scripts/bury.lua`; the tombstone is in the scripts' KEYS, in the stream's slot).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_streams::*;
use bytes::Bytes;

/// Per append (its unique body): whether it was answered OK; and how many times each body is
/// in the stream afterwards.
async fn appends_under_a_kill_storm(
    cluster: &baton_testkit::RedisCluster,
    stamped: bool,
) -> (HashMap<String, bool>, HashMap<String, usize>) {
    let settings = StreamStoreSettings { default_limits: RunLimits::unlimited(), ..StreamStoreSettings::default() };
    let store = StreamStore::redis(cluster.config(), settings).await.unwrap();
    let ct = Some("text/plain".to_string());
    let p = StreamPath::new("t/resends").unwrap();
    store.create(&p, CreateOptions { content_type: ct.clone(), ..Default::default() }).await.unwrap();
    let storm = baton_testkit::KillStorm::start(cluster.urls(), Duration::from_millis(5)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let answers: Arc<Mutex<HashMap<String, bool>>> = Arc::default();
    let mut appenders = Vec::new();
    for w in 0..16 {
        let (store, p, ct, stop, answers) = (store.clone(), p.clone(), ct.clone(), stop.clone(), answers.clone());
        appenders.push(tokio::spawn(async move {
            let mut seq = 0;
            while !stop.load(Ordering::Relaxed) {
                let data = format!("w{w}-{seq}");
                let producer = stamped.then(|| ProducerStamp { id: format!("w{w}"), epoch: 0, seq });
                seq += 1;
                let req = AppendRequest {
                    data: Bytes::from(format!("{data}\n")),
                    content_type: ct.clone(),
                    producer,
                    ..Default::default()
                };
                let ok = store.append(&p, req).await.is_ok();
                answers.lock().unwrap().insert(data, ok);
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    storm.stop().await;
    for a in appenders {
        a.await.unwrap();
    }
    // Re-sent copies still in flight land meanwhile.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut body = String::new();
    let mut from = ReadFrom::Start;
    loop {
        let chunk = store.read(&p, from).await.unwrap();
        body.push_str(&String::from_utf8_lossy(&chunk.body()));
        if chunk.up_to_date {
            break;
        }
        from = ReadFrom::At(chunk.next_offset);
    }
    let mut written: HashMap<String, usize> = HashMap::new();
    for line in body.lines() {
        *written.entry(line.to_string()).or_default() += 1;
    }
    let answers = answers.lock().unwrap().clone();
    (answers, written)
}

/// The appends answered OK that are not in the stream exactly once: (body, times written).
fn not_once(answers: &HashMap<String, bool>, written: &HashMap<String, usize>) -> Vec<(String, usize)> {
    let mut out: Vec<(String, usize)> = answers
        .iter()
        .filter(|(_, ok)| **ok)
        .map(|(data, _)| (data.clone(), written.get(data).copied().unwrap_or(0)))
        .filter(|(_, n)| *n != 1)
        .collect();
    out.sort();
    out
}

/// Appends under a kill storm on a fresh Cluster: more than 100 answered OK, and every one of
/// them in the stream exactly once.
async fn assert_answered_ok_written_once(stamped: bool) {
    baton_testkit::require_redis();
    let cluster = baton_testkit::RedisCluster::start();
    let (answers, written) = appends_under_a_kill_storm(&cluster, stamped).await;
    let oks = answers.values().filter(|ok| **ok).count();
    assert!(oks > 100, "only {oks} appends answered OK");
    let wrong = not_once(&answers, &written);
    assert!(
        wrong.is_empty(),
        "{} of {oks} OK appends not written once: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stamped_appends_answered_ok_are_written_once() {
    assert_answered_ok_written_once(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unstamped_appends_answered_ok_are_written_once() {
    assert_answered_ok_written_once(false).await;
}

/// On Cluster, a delete keeps the guard's fields of the stream in its tombstone
/// `baton:s:{path}:gone` and a create carries them over (`scripts/bury.lua`): the scripts declare
/// the tombstone in KEYS, in the stream's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_keeps_the_guard_in_a_tombstone_that_a_create_carries_over() {
    use baton_redis::redis;
    baton_testkit::require_redis();
    let cluster = baton_testkit::RedisCluster::start();
    let settings = StreamStoreSettings { default_limits: RunLimits::unlimited(), ..StreamStoreSettings::default() };
    let store = StreamStore::redis(cluster.config(), settings).await.unwrap();
    let mut conn = baton_redis::RedisClient::new(cluster.config()).unwrap().shared().await.unwrap();
    let ct = Some("text/plain".to_string());
    let p = StreamPath::new("t/gone").unwrap();
    let create = || CreateOptions { content_type: ct.clone(), ..Default::default() };
    store.create(&p, create()).await.unwrap();
    let req = || AppendRequest { data: Bytes::from("x"), content_type: ct.clone(), ..Default::default() };
    store.append(&p, req()).await.unwrap();
    store.delete(&p).await.unwrap();
    let (kt, km) = ("baton:s:{t/gone}:gone", "baton:s:{t/gone}:m");
    let kept: Vec<String> = redis::cmd("HKEYS").arg(kt).query_async(&mut conn).await.unwrap();
    assert_eq!(kept.len(), 2, "this process's r: field and r~ (the deleted stream's incarnation): {kept:?}");
    store.create(&p, create()).await.unwrap();
    let exists: bool = redis::cmd("EXISTS").arg(kt).query_async(&mut conn).await.unwrap();
    assert!(!exists);
    for f in &kept {
        let v: Option<Vec<u8>> = redis::cmd("HGET").arg(km).arg(f).query_async(&mut conn).await.unwrap();
        assert!(v.is_some(), "{f} carried");
    }
    // This process's next append is written to the new stream.
    store.append(&p, req()).await.unwrap();
    assert_eq!(store.read(&p, ReadFrom::Start).await.unwrap().records.len(), 1);
}
