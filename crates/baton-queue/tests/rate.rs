//! Rate limits: the queue's rate limit (GCRA, `ConsumerOptions::rate_limit`) and a handler's
//! "rate limited, back off d" (`Decision::RateLimited`), both gates of the read of new entries.
//! Memory, Redis standalone and Cluster; the long measurement (1,000/s across three processes
//! for ~30 s) on standalone.

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_queue::{ConsumerOptions, Decision, Delivery, MessageStream, RateLimit, RedisQueueOptions, RemoteOptions};
use baton_redis::{redis, RedisClient, RedisConfig};
use baton_testkit::{require_redis, RedisServer, TestBackend};
use bytes::Bytes;
use common::*;

baton_testkit::on_every_backend!(
    claims_take_the_burst_then_one_per_interval,
    three_consumers_stay_within_the_rate,
    rate_limited_answer_backs_off_every_consumer,
    a_remote_workers_rate_limited_answer_backs_off_the_queue,
    a_deferred_lease_answers_rate_limited,
);

/// `Lease::rate_limited` from a deferred handler: settled, the queue backs off, the message comes
/// back after the delay with the same delivery count.
async fn a_deferred_lease_answers_rate_limited(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("rate-deferred");
    s.offer(&q, "x").await.unwrap();
    // (deliveries, when, what `Lease::rate_limited` returned: first delivery only)
    type Seen = Vec<(u32, Instant, Option<Result<(), String>>)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let h = {
        let seen = seen.clone();
        move |d: Delivery| {
            let seen = seen.clone();
            async move {
                let first = seen.lock().unwrap().is_empty();
                if !first {
                    seen.lock().unwrap().push((d.deliveries, Instant::now(), None));
                    return Decision::Ack;
                }
                let lease = d.lease.clone();
                let at = Instant::now();
                let r = lease.rate_limited(Duration::from_millis(800)).await.map_err(|e| e.to_string());
                seen.lock().unwrap().push((d.deliveries, at, Some(r)));
                Decision::Deferred
            }
        }
    };
    let c = s.consume(&q, h, fast(3_000).with_poll_interval(Duration::from_millis(100))).await.unwrap();
    eventually(Duration::from_secs(10), || {
        let n = seen.lock().unwrap().len();
        async move { (n == 2).then_some(()) }
    })
    .await
    .expect("delivered twice");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen[0].2, Some(Ok(())));
    assert_eq!((seen[0].0, seen[1].0), (1, 1));
    assert!(seen[1].1 >= seen[0].1 + Duration::from_millis(800), "redelivered after the back-off");
    assert_eq!(c.counters().rate_limited, 1);
    c.close().await;
}

/// Streams for `n` consumers: on Redis each its own client (its own connections), in memory one
/// shared backend.
async fn streams(b: &TestBackend, n: usize) -> Vec<MessageStream> {
    match b.redis_config() {
        None => vec![MessageStream::memory(); n],
        Some(_) => {
            let mut v = Vec::new();
            for _ in 0..n {
                v.push(stream_for(b).await);
            }
            v
        }
    }
}

async fn offer_n(s: &MessageStream, q: &str, n: usize) {
    let payloads: Vec<Bytes> = (0..n).map(|i| Bytes::from(format!("m{i}"))).collect();
    for chunk in payloads.chunks(1000) {
        s.offer_batch(q, chunk.to_vec()).await.unwrap();
    }
}

/// Exact GCRA arithmetic through the claims of a remote worker (which pass the same gate):
/// a burst of 3 at once, then nothing until an interval has passed, then one.
async fn claims_take_the_burst_then_one_per_interval(b: TestBackend) {
    metrics_recorder();
    let s = stream_for(&b).await;
    let q = queue_name("rate-claims");
    offer_n(&s, &q, 10).await;
    let opts = RemoteOptions {
        claim_timeout: Duration::from_secs(30),
        max_deliveries: None,
        rate_limit: Some(RateLimit::new(1, Duration::from_secs(2)).with_burst(3)),
        ..Default::default()
    };
    let w = s.remote_consumer(&q, "worker-1", opts).await.unwrap();
    let first = w.claim(10, Duration::ZERO).await.unwrap();
    assert_eq!(first.len(), 3, "the burst");
    let at = Instant::now();
    assert_eq!(w.claim(10, Duration::ZERO).await.unwrap().len(), 0, "the bucket is empty");
    // Waiting less than the interval (2 s) inside the claim takes nothing either.
    assert_eq!(w.claim(10, Duration::from_millis(300)).await.unwrap().len(), 0);
    // A claim that may wait past the interval gets exactly one, at its time (not before).
    let next = w.claim(10, Duration::from_secs(5)).await.unwrap();
    assert_eq!(next.len(), 1);
    assert!(at.elapsed() >= Duration::from_millis(1_800), "one interval after the burst: {:?}", at.elapsed());
    assert_eq!(s.stats(&q).await.unwrap().lag, 6);
    // Each claim the gate held back is counted (the first took the burst).
    assert_eq!(throttled(&q, "rate_limit"), 3);
    assert_eq!(throttled(&q, "backoff"), 0);
}

/// `baton_queue_throttled_total{queue, reason}` so far.
fn throttled(queue: &str, reason: &str) -> u64 {
    counter_total("baton_queue_throttled_total", &[("queue", queue), ("reason", reason)])
}

/// Limit 50 per s with a burst of 1, three consumers, a backlog of 200: within 2 s of the first
/// start at most 50·2 + 1 entries start (and not far fewer).
async fn three_consumers_stay_within_the_rate(b: TestBackend) {
    let ss = streams(&b, 3).await;
    let q = queue_name("rate-three");
    offer_n(&ss[0], &q, 200).await;
    let starts: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let opts =
        fast(3_000).with_concurrency(8).with_rate_limit(Some(RateLimit::new(50, Duration::from_secs(1)).with_burst(1)));
    let mut cs = Vec::new();
    for s in &ss {
        let starts = starts.clone();
        let h = move |_d: Delivery| {
            let starts = starts.clone();
            async move {
                starts.lock().unwrap().push(Instant::now());
                Decision::Ack
            }
        };
        cs.push(s.consume(&q, h, opts.clone()).await.unwrap());
    }
    let first = eventually(Duration::from_secs(10), || {
        let f = starts.lock().unwrap().first().copied();
        async move { f }
    })
    .await
    .expect("started");
    tokio::time::sleep_until((first + Duration::from_millis(2_300)).into()).await;
    // The window ends 40 ms short of 2 s: a first start up to 40 ms later after its grant than
    // the others (a loaded machine) cannot let one more in.
    let window = starts.lock().unwrap().iter().filter(|t| **t < first + Duration::from_millis(1_960)).count();
    assert!(window <= 101, "{window} entries started within 2 s at 50/s with a burst of 1");
    // With a burst of 1 a read that comes late (timer granularity, round trips, a loaded
    // machine) loses its lateness: GCRA banks nothing beyond the burst. So only a loose floor
    // here; the rate itself is measured with a burst in the long test.
    assert!(window >= 60, "only {window} entries started within 2 s at 50/s");
    for c in cs {
        c.close().await;
    }
}

/// One handler answers `RateLimited(1 s)`: no consumer (three of them) starts anything for about
/// a second; the entry is redelivered after it with the same delivery count; it counts as rate
/// limited, not as a retry, and nothing is dead-lettered.
async fn rate_limited_answer_backs_off_every_consumer(b: TestBackend) {
    let ss = streams(&b, 3).await;
    let q = queue_name("rate-backoff");
    ss[0].offer(&q, "limit").await.unwrap();
    offer_n(&ss[0], &q, 60).await;
    let log: Arc<Mutex<Vec<(String, u32, Instant)>>> = Arc::default();
    let answered: Arc<Mutex<Option<Instant>>> = Arc::default();
    let once = Arc::new(AtomicBool::new(false));
    let opts = fast(3_000).with_concurrency(2).with_poll_interval(Duration::from_millis(100));
    let mut cs = Vec::new();
    for s in &ss {
        let (log, answered, once) = (log.clone(), answered.clone(), once.clone());
        let h = move |d: Delivery| {
            let (log, answered, once) = (log.clone(), answered.clone(), once.clone());
            async move {
                let p = String::from_utf8_lossy(&d.payload).into_owned();
                log.lock().unwrap().push((p.clone(), d.deliveries, Instant::now()));
                if p == "limit" && !once.swap(true, Ordering::SeqCst) {
                    *answered.lock().unwrap() = Some(Instant::now());
                    return Decision::RateLimited(Duration::from_secs(1));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                Decision::Ack
            }
        };
        cs.push(s.consume(&q, h, opts.clone()).await.unwrap());
    }
    eventually(Duration::from_secs(20), || {
        let n = log.lock().unwrap().len();
        async move { (n == 62).then_some(()) }
    })
    .await
    .expect("every entry ran, the rate limited one twice");
    let t = answered.lock().unwrap().expect("answered");
    let log = log.lock().unwrap().clone();
    let quiet: Vec<_> = log
        .iter()
        .filter(|(_, _, at)| *at > t + Duration::from_millis(200) && *at < t + Duration::from_millis(900))
        .collect();
    assert!(quiet.is_empty(), "entries started during the back-off: {quiet:?}");
    let again: Vec<_> = log.iter().filter(|(p, _, _)| p == "limit").collect();
    assert_eq!(again.len(), 2);
    assert_eq!((again[0].1, again[1].1), (1, 1), "a rate limited answer is not a delivery");
    assert!(again[1].2 >= t + Duration::from_secs(1), "redelivered after the back-off");
    // The others resumed after it.
    assert!(log.iter().any(|(_, _, at)| *at >= t + Duration::from_secs(1)));
    eventually(Duration::from_secs(10), || {
        let s = ss[0].clone();
        let q = q.clone();
        async move { (s.stats(&q).await.unwrap().length == 0).then_some(()) }
    })
    .await
    .expect("all acked");
    let mut total = baton_queue::ConsumerCounters::default();
    for c in cs {
        let k = c.counters();
        total.rate_limited += k.rate_limited;
        total.retried += k.retried;
        total.dead_lettered += k.dead_lettered;
        total.acked += k.acked;
        c.close().await;
    }
    assert_eq!((total.rate_limited, total.retried, total.dead_lettered, total.acked), (1, 0, 0, 61));
    assert_eq!(ss[0].stats(&q).await.unwrap().dead_letters, 0);
}

/// A remote worker's `rate_limited` backs off every consumer of the queue (its own next claims
/// and an in-process consumer's reads) and hands the entry back with its delivery count.
async fn a_remote_workers_rate_limited_answer_backs_off_the_queue(b: TestBackend) {
    metrics_recorder();
    let s = stream_for(&b).await;
    let q = queue_name("rate-remote");
    offer_n(&s, &q, 3).await;
    // The same claim timeout as the consumer below: a parked re-poll's idle time is reckoned
    // with it.
    let opts = RemoteOptions { claim_timeout: Duration::from_secs(2), ..RemoteOptions::default() };
    let w = s.remote_consumer(&q, "worker-1", opts).await.unwrap();
    let got = w.claim(1, Duration::ZERO).await.unwrap();
    assert_eq!(got.len(), 1);
    let at = Instant::now();
    w.rate_limited(got[0].id, got[0].fence, Duration::from_millis(1_500)).await.unwrap();
    assert_eq!(w.claim(5, Duration::ZERO).await.unwrap().len(), 0, "backing off");
    assert_eq!(throttled(&q, "backoff"), 1);
    let left = s.stats(&q).await.unwrap().backoff_ms.expect("backing off");
    assert!(left > 0 && left <= 1_500, "{left} ms left of a 1500 ms back-off");
    let starts: Arc<Mutex<Vec<(String, u32, Instant)>>> = Arc::default();
    let h = {
        let starts = starts.clone();
        move |d: Delivery| {
            let starts = starts.clone();
            async move {
                starts.lock().unwrap().push((
                    String::from_utf8_lossy(&d.payload).into_owned(),
                    d.deliveries,
                    Instant::now(),
                ));
                Decision::Ack
            }
        }
    };
    let c = s.consume(&q, h, fast(2_000).with_poll_interval(Duration::from_millis(100))).await.unwrap();
    eventually(Duration::from_secs(10), || {
        let n = starts.lock().unwrap().len();
        async move { (n == 3).then_some(()) }
    })
    .await
    .expect("all three ran");
    for (p, n, t) in starts.lock().unwrap().iter() {
        assert!(*t >= at + Duration::from_millis(1_400), "{p} started during the back-off");
        assert_eq!(*n, 1, "{p}");
    }
    assert_eq!(s.stats(&q).await.unwrap().backoff_ms, None, "over");
    c.close().await;
}

const STARTED: &str = "started";

fn started_key(queue: &str) -> String {
    format!("rate-test:{{{queue}}}:{STARTED}")
}

/// The worker side of the long measurement: runs only when re-executed with `BATON_RATE_CHILD=1`.
#[test]
#[ignore = "worker process entry point, started by the tests in this file"]
fn rate_child_worker() {
    if std::env::var("BATON_RATE_CHILD").is_err() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let cfg = RedisConfig::standalone(std::env::var("BATON_REDIS_URL").unwrap());
        let queue = std::env::var("BATON_QUEUE").unwrap();
        let client = RedisClient::new(cfg).unwrap();
        let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
        let conn = client.shared().await.unwrap();
        let key = started_key(&queue);
        let _c = s
            .consume(
                &queue,
                move |_d: Delivery| {
                    let (mut conn, key) = (conn.clone(), key.clone());
                    async move {
                        let _: i64 = redis::cmd("INCR").arg(&key).query_async(&mut conn).await.unwrap();
                        Decision::Ack
                    }
                },
                ConsumerOptions::new()
                    .with_concurrency(16)
                    .with_reap_idle_consumers_after(None)
                    .with_rate_limit(Some(RateLimit::new(1000, Duration::from_secs(1)).with_burst(50))),
            )
            .await
            .unwrap();
        println!("READY {}", std::process::id());
        tokio::time::sleep(Duration::from_secs(600)).await;
    });
}

fn spawn_worker(url: &str, queue: &str) -> ChildWorker {
    spawn_child_worker(
        "rate::rate_child_worker",
        &[("BATON_RATE_CHILD", "1"), ("BATON_QUEUE", queue), ("BATON_REDIS_URL", url)],
    )
}

/// The measurement: 1,000/s configured, three consumer processes, ~30 s: the rate of
/// starts over 28 s (after the first second, which holds the burst of 50) is within ±2 %.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_per_second_across_three_processes_for_30s() {
    require_redis();
    let server = RedisServer::start();
    let client = RedisClient::new(server.config()).unwrap();
    let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let q = queue_name("rate-1000");
    offer_n(&s, &q, 36_000).await;
    let mut conn = client.shared().await.unwrap();
    let key = started_key(&q);
    let workers: Vec<ChildWorker> = (0..3).map(|_| spawn_worker(&server.url(), &q)).collect();
    let count = |mut conn: baton_redis::RedisConn, key: String| async move {
        let n: Option<u64> = redis::cmd("GET").arg(&key).query_async(&mut conn).await.unwrap();
        n.unwrap_or(0)
    };
    eventually(Duration::from_secs(20), || {
        let f = count(conn.clone(), key.clone());
        async move { (f.await > 0).then_some(()) }
    })
    .await
    .expect("the workers started");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (a, ta) = (count(conn.clone(), key.clone()).await, Instant::now());
    tokio::time::sleep(Duration::from_secs(28)).await;
    let (z, tz) = (count(conn.clone(), key.clone()).await, Instant::now());
    let rate = (z - a) as f64 / (tz - ta).as_secs_f64();
    println!("measured {rate:.1}/s over {:?} ({} entries)", tz - ta, z - a);
    assert!((980.0..=1020.0).contains(&rate), "rate {rate:.1}/s, configured 1000/s");
    let lag: u64 = s.stats(&q).await.unwrap().lag;
    assert!(lag > 0, "the backlog ran out: the measurement is not of the limit");
    drop(workers);
    let _: () = redis::cmd("DEL").arg(&key).query_async(&mut conn).await.unwrap();
}
