//! What the consumer's re-send guard pool leaves behind on Redis Cluster under a kill storm
//! (`CLIENT KILL TYPE normal` every 5 ms), checked in the queue's keys rather than in the answers
//! (those are `cluster_resends.rs`): each applied `dead_letter` writes exactly one dead-letter
//! entry, each applied long `retry_after` exactly one delayed entry, and calls whose caller gave
//! up mid-call (future dropped, so its guard went back to the pool at once, while its copies may
//! still be re-sent) never make a later call on the same guard answer wrongly nor write twice.
//! On standalone the plain scripts run: no guard key is ever written.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::queue_name;
use baton_queue::{keys, MessageId, MessageStream, QueueError, RedisQueueOptions, RemoteOptions, Settled};
use baton_redis::{redis, RedisClient};

#[derive(Clone, Copy)]
enum How {
    DeadLetter,
    /// `retry_after` 20 min (above the claim timeout): the entry moves to the delayed set.
    LongRetry,
    /// `dead_letter` under a timeout of 0 to 7 ms (the future is dropped mid-call most of the
    /// time), then again without one until answered.
    DroppedDeadLetter,
}

/// Per message id (`<ms>-<seq>`): the answers its settles got (`done`, `gone`, `lost`, or the
/// error text).
type Answers = HashMap<String, Vec<String>>;

fn id_text(id: MessageId) -> String {
    format!("{}-{}", id.ms, id.seq)
}

fn answer(r: &Result<Settled, QueueError>) -> String {
    match r {
        Ok(Settled::Done) => "done".into(),
        Ok(Settled::Gone) => "gone".into(),
        Err(QueueError::LeaseLost(_)) => "lost".into(),
        Err(e) => e.to_string(),
    }
}

/// 1,000 messages, one remote consumer (10 min claim timeout: nothing is reclaimed behind its
/// back), 6 workers settling every claimed delivery with `how` for 3 s under the storm.
async fn storm(how: How) -> (Answers, RedisClient, String, baton_testkit::RedisCluster) {
    let super::Held { cluster, client, queue: q, consumer } =
        super::Held::start("guard-break", "breaker", 4, 250).await;
    let storm = baton_testkit::KillStorm::start(cluster.urls(), Duration::from_millis(5)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let answers: Arc<Mutex<Answers>> = Arc::default();
    let mut workers = Vec::new();
    for w in 0..6u64 {
        let (consumer, stop, answers) = (consumer.clone(), stop.clone(), answers.clone());
        workers.push(tokio::spawn(async move {
            let mut n = w;
            while !stop.load(Ordering::Relaxed) {
                let Ok(claimed) = consumer.claim_with(4, Duration::from_millis(100), false).await else { continue };
                for d in claimed {
                    n += 1;
                    let mut got = Vec::new();
                    match how {
                        How::DeadLetter => {
                            got.push(answer(&consumer.dead_letter(d.id, d.fence, d.deliveries, "x").await))
                        }
                        How::LongRetry => {
                            got.push(answer(&consumer.retry_after(d.id, d.fence, Duration::from_secs(1200)).await))
                        }
                        How::DroppedDeadLetter => {
                            let call = consumer.dead_letter(d.id, d.fence, d.deliveries, "x");
                            match tokio::time::timeout(Duration::from_millis(n % 8), call).await {
                                Ok(r) => got.push(answer(&r)),
                                Err(_) => got.push("dropped".into()),
                            }
                            // Again until answered (an error is a lost reply: try again).
                            for _ in 0..20 {
                                if got.last().is_some_and(|a| a == "done" || a == "gone" || a == "lost") {
                                    break;
                                }
                                got.push(answer(&consumer.dead_letter(d.id, d.fence, d.deliveries, "x").await));
                            }
                        }
                    }
                    answers.lock().unwrap().entry(id_text(d.id)).or_default().extend(got);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let killed = storm.stop().await;
    for w in workers {
        w.await.unwrap();
    }
    // Re-sent copies still in flight land meanwhile.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let a = std::mem::take(&mut *answers.lock().unwrap());
    eprintln!("{} messages settled, {killed} connections killed", a.len());
    (a, client, q, cluster)
}

/// How many times each message id is the `id` field of an entry of the stream `key`.
async fn ids_in_stream(client: &RedisClient, key: &str) -> HashMap<String, usize> {
    let mut conn = client.shared().await.unwrap();
    let page: Vec<(String, Vec<String>)> =
        redis::cmd("XRANGE").arg(key).arg("-").arg("+").query_async(&mut conn).await.unwrap();
    let mut out: HashMap<String, usize> = HashMap::new();
    for (_, fields) in page {
        let id = fields.chunks(2).find(|f| f[0] == "id").map(|f| f[1].clone()).unwrap();
        *out.entry(id).or_default() += 1;
    }
    out
}

fn summary(a: &Answers) -> HashMap<String, usize> {
    let mut out: HashMap<String, usize> = HashMap::new();
    for v in a.values().flatten() {
        *out.entry(v.clone()).or_default() += 1;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_dead_letter_answered_done_is_one_dead_entry() {
    baton_testkit::require_redis();
    let (answers, client, q, _cluster) = storm(How::DeadLetter).await;
    let dead = ids_in_stream(&client, &keys::dead(keys::DEFAULT_PREFIX, &q)).await;
    eprintln!("answers {:?}; {} dead entries", summary(&answers), dead.values().sum::<usize>());
    assert!(answers.len() > 50, "only {} settled", answers.len());
    let twice: Vec<_> = dead.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "dead-lettered more than once: {twice:?}");
    for (id, got) in &answers {
        if got.iter().any(|a| a == "done") {
            assert_eq!(dead.get(id), Some(&1), "{id} answered {got:?}");
        }
        assert!(!got.iter().any(|a| a == "gone" || a == "lost"), "{id} answered {got:?}");
    }
    // Nothing dead-lettered that no call was made for.
    assert!(dead.keys().all(|id| answers.contains_key(id)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_long_retry_answered_done_is_one_delayed_entry() {
    baton_testkit::require_redis();
    let (answers, client, q, _cluster) = storm(How::LongRetry).await;
    let mut conn = client.shared().await.unwrap();
    let delayed: Vec<String> = redis::cmd("ZRANGE")
        .arg(keys::delayed(keys::DEFAULT_PREFIX, &q))
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .unwrap();
    let payloads: HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
        .arg(keys::delayed_payloads(keys::DEFAULT_PREFIX, &q))
        .query_async(&mut conn)
        .await
        .unwrap();
    eprintln!("answers {:?}; {} delayed", summary(&answers), delayed.len());
    assert!(answers.len() > 50, "only {} settled", answers.len());
    for (id, got) in &answers {
        assert!(!got.iter().any(|a| a == "gone" || a == "lost"), "{id} answered {got:?}");
        if got.iter().any(|a| a == "done") {
            assert!(delayed.contains(id), "{id} answered {got:?} but not delayed");
            // Delivery count carried: one delivery, not counted as a failure (0), once.
            assert_eq!(payloads.get(&format!("{id}:dc")).map(|v| v.as_slice()), Some(&b"0"[..]), "{id}");
        }
    }
    // Each delayed entry's payload is there; the queue's stream no longer holds it.
    for id in &delayed {
        assert!(payloads.contains_key(id), "{id}");
    }
    let left: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
        .arg(keys::stream(keys::DEFAULT_PREFIX, &q))
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    let delayed_still_in_stream = left.iter().filter(|(id, _)| delayed.contains(id)).count();
    assert_eq!(delayed_still_in_stream, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_dropped_mid_call_then_repeated_write_once() {
    baton_testkit::require_redis();
    let (answers, client, q, _cluster) = storm(How::DroppedDeadLetter).await;
    let dead = ids_in_stream(&client, &keys::dead(keys::DEFAULT_PREFIX, &q)).await;
    let s = summary(&answers);
    eprintln!("answers {s:?}; {} dead entries", dead.values().sum::<usize>());
    assert!(s.get("dropped").copied().unwrap_or(0) > 20, "few calls dropped: {s:?}");
    let twice: Vec<_> = dead.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "dead-lettered more than once: {twice:?}");
    for (id, got) in &answers {
        // A guard lent again while a dropped call's copies are in flight: never a stale-resend
        // error for the later call, never another owner.
        assert!(!got.iter().any(|a| a.contains("BATON_STALE_RESEND") || a == "lost"), "{id}: {got:?}");
        // Answered (done, or gone after a dropped copy applied): dead-lettered exactly once.
        if got.iter().any(|a| a == "done" || a == "gone") {
            assert_eq!(dead.get(id), Some(&1), "{id} answered {got:?}");
        }
        // Gone only after an earlier call that may have applied.
        if let Some(i) = got.iter().position(|a| a == "gone") {
            assert!(got[..i].iter().any(|a| a != "done"), "{id}: {got:?}");
        }
    }
}

/// Standalone sends the plain scripts: no re-send guard key is ever written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_retry_and_dead_letter_write_no_guard_key() {
    baton_testkit::require_redis();
    let server = baton_testkit::RedisServer::start();
    let client = RedisClient::new(server.config()).unwrap();
    let stream = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let q = queue_name("guard-standalone");
    stream.offer_batch(&q, (0..4).map(|i| bytes::Bytes::from(format!("m{i}"))).collect()).await.unwrap();
    let options = RemoteOptions { claim_timeout: Duration::from_secs(600), max_deliveries: None, ..Default::default() };
    let consumer = stream.remote_consumer(&q, "plain", options).await.unwrap();
    let claimed = consumer.claim_with(4, Duration::from_millis(100), false).await.unwrap();
    assert_eq!(claimed.len(), 4);
    let d = &claimed;
    assert_eq!(consumer.retry_after(d[0].id, d[0].fence, Duration::from_secs(1)).await.unwrap(), Settled::Done);
    assert_eq!(consumer.retry_after(d[1].id, d[1].fence, Duration::from_secs(1200)).await.unwrap(), Settled::Done);
    assert_eq!(consumer.dead_letter(d[2].id, d[2].fence, d[2].deliveries, "x").await.unwrap(), Settled::Done);
    assert_eq!(consumer.ack(d[3].id, d[3].fence).await.unwrap(), Settled::Done);
    // A second call is answered by the script's state (unguarded): gone / another owner.
    assert_eq!(consumer.dead_letter(d[2].id, d[2].fence, d[2].deliveries, "x").await.unwrap(), Settled::Gone);
    assert_eq!(consumer.retry_after(d[1].id, d[1].fence, Duration::from_secs(1200)).await.unwrap(), Settled::Gone);
    let mut conn = client.shared().await.unwrap();
    let guards: Vec<String> = redis::cmd("KEYS").arg("*resend*").query_async(&mut conn).await.unwrap();
    assert!(guards.is_empty(), "{guards:?}");
    let dead = ids_in_stream(&client, &keys::dead(keys::DEFAULT_PREFIX, &q)).await;
    assert_eq!(dead.get(&id_text(d[2].id)), Some(&1));
}
