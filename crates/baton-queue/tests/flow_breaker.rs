//! Breaker tests of the queue's flow control (issue 17): concurrency caps (`max_concurrency`,
//! `concurrency_per_key` and its waiting lines), back-off, pause, scheduled entries, under the
//! decisions and faults that move entries out of the pending list while they hold a key slot
//! (long and short `RetryAfter`, `RateLimited`, dead letters by decision and by
//! `max_deliveries`, panics), a pause while entries wait for their key, and unschedule racing
//! promotion. Every backend; each test checks at the end that no slot or waiter is left behind.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_queue::{keys, ConsumerOptions, Decision, Delivery, MessageStream, OfferOptions};
use baton_redis::{redis, RedisClient};
use baton_testkit::{require_redis, RedisServer, ServerOptions, TestBackend};
use common::*;

baton_testkit::on_every_backend!(
    long_retry_after_of_a_key_holder_lets_its_waiter_run_then_rejoins,
    rate_limited_key_holder_keeps_its_slot_until_it_ran_again,
    dead_lettered_key_holders_pass_their_slots_on,
    panicking_key_holder_is_dead_lettered_and_its_waiter_runs,
    paused_queue_starts_no_promoted_waiter,
    disagreeing_max_concurrency_never_exceeds_the_larger,
    unschedule_racing_promotion_runs_a_keyed_entry_at_most_once,
    huge_retry_after_of_a_key_holder_frees_its_slot_and_keeps_the_consumer_working,
    huge_rate_limited_answer_keeps_the_consumer_working,
    a_key_holder_blocking_its_thread_keeps_its_slot_and_runs_once,
    prioritized_keyed_entries_with_retries_and_dead_letters_leave_nothing_behind,
);

fn keyed(k: &str) -> OfferOptions {
    OfferOptions { concurrency_key: Some(k.to_string()), ..Default::default() }
}

/// (held keys, holders, waiting entries) in Redis; memory: `None`.
async fn cap_state(b: &TestBackend, q: &str) -> Option<(u64, u64, u64)> {
    let mut conn = conn_for(b).await?;
    Some(caps_of(&mut conn, q).await)
}

async fn caps_of(conn: &mut baton_redis::RedisConn, q: &str) -> (u64, u64, u64) {
    let p = keys::DEFAULT_PREFIX;
    let held: u64 = redis::cmd("HLEN").arg(keys::key_held(p, q)).query_async(conn).await.unwrap();
    let ids: u64 = redis::cmd("HLEN").arg(keys::key_holders(p, q)).query_async(conn).await.unwrap();
    let waiting: u64 = redis::cmd("ZCARD").arg(keys::key_waiting(p, q)).query_async(conn).await.unwrap();
    (held, ids, waiting)
}

/// What ran: (payload, deliveries) in start order, and the most handlers of one key at once.
#[derive(Default)]
struct Runs {
    log: Mutex<Vec<(String, u32)>>,
    running: Mutex<HashMap<String, usize>>,
    max_per_key: AtomicUsize,
}

impl Runs {
    /// The key is the payload's part before '/'.
    fn enter(&self, d: &Delivery) -> String {
        let p = String::from_utf8_lossy(&d.payload).into_owned();
        let k = p.split('/').next().unwrap().to_string();
        let mut r = self.running.lock().unwrap();
        let n = r.entry(k).or_default();
        *n += 1;
        self.max_per_key.fetch_max(*n, Ordering::SeqCst);
        self.log.lock().unwrap().push((p.clone(), d.deliveries));
        p
    }
    fn leave(&self, p: &str) {
        let k = p.split('/').next().unwrap();
        *self.running.lock().unwrap().get_mut(k).unwrap() -= 1;
    }
    fn log(&self) -> Vec<(String, u32)> {
        self.log.lock().unwrap().clone()
    }
    async fn wait_len(&self, n: usize, within: Duration) -> Vec<(String, u32)> {
        let got = eventually(within, || {
            let l = self.log.lock().unwrap().len();
            async move { (l >= n).then_some(()) }
        })
        .await;
        let log = self.log();
        assert!(got.is_some(), "expected {n} runs, got {log:?}");
        log
    }
}

fn opts() -> ConsumerOptions {
    fast(1_000).with_concurrency(8).with_concurrency_per_key(Some(1)).with_poll_interval(Duration::from_millis(900))
}

async fn settled(s: &MessageStream, q: &str) {
    let st = s.stats(q).await.unwrap();
    assert_eq!((st.length, st.pending, st.delayed), (0, 0, 0), "{st:?}");
}

/// A key's holder answers `RetryAfter` longer than the claim timeout: it leaves the pending list
/// through the delayed set, its slot goes to the key's waiter, and it passes the gate again when
/// due. Never two of the key at once; nothing left behind.
async fn long_retry_after_of_a_key_holder_lets_its_waiter_run_then_rejoins(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("fb-long-ra");
    let runs = Arc::new(Runs::default());
    let r2 = runs.clone();
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let runs = r2.clone();
                async move {
                    let p = runs.enter(&d);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    runs.leave(&p);
                    let first = runs.log().iter().filter(|(x, _)| *x == p).count() == 1;
                    if p == "k/a" && first {
                        Decision::RetryAfter(Duration::from_millis(1_500))
                    } else {
                        Decision::Ack
                    }
                }
            },
            opts(),
        )
        .await
        .unwrap();
    s.offer_with(&q, "k/a", keyed("k")).await.unwrap();
    s.offer_with(&q, "k/b", keyed("k")).await.unwrap();
    let log = runs.wait_len(3, Duration::from_secs(15)).await;
    assert_eq!(log, [("k/a".to_string(), 1), ("k/b".to_string(), 1), ("k/a".to_string(), 1)]);
    assert_eq!(runs.max_per_key.load(Ordering::SeqCst), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.drain(Duration::from_secs(2)).await;
    settled(&s, &q).await;
    assert_eq!(runs.log().len(), 3);
    if let Some(st) = cap_state(&b, &q).await {
        assert_eq!(st, (0, 0, 0));
    }
}

/// A key's holder answers `RateLimited` shorter than the claim timeout: it keeps its slot (the
/// entry stays pending), the queue backs off, the entry runs again, and only then its waiter.
async fn rate_limited_key_holder_keeps_its_slot_until_it_ran_again(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("fb-rl");
    let runs = Arc::new(Runs::default());
    let r2 = runs.clone();
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let runs = r2.clone();
                async move {
                    let p = runs.enter(&d);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    runs.leave(&p);
                    let first = runs.log().iter().filter(|(x, _)| *x == p).count() == 1;
                    if p == "k/a" && first {
                        Decision::RateLimited(Duration::from_millis(400))
                    } else {
                        Decision::Ack
                    }
                }
            },
            opts(),
        )
        .await
        .unwrap();
    s.offer_with(&q, "k/a", keyed("k")).await.unwrap();
    s.offer_with(&q, "k/b", keyed("k")).await.unwrap();
    s.offer_with(&q, "j/c", keyed("j")).await.unwrap();
    let log = runs.wait_len(4, Duration::from_secs(15)).await;
    let ks: Vec<&(String, u32)> = log.iter().filter(|(p, _)| p.starts_with("k/")).collect();
    assert_eq!(ks, [&("k/a".to_string(), 1), &("k/a".to_string(), 1), &("k/b".to_string(), 1)], "{log:?}");
    assert_eq!(runs.max_per_key.load(Ordering::SeqCst), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.drain(Duration::from_secs(2)).await;
    settled(&s, &q).await;
    assert_eq!(runs.log().len(), 4);
    if let Some(st) = cap_state(&b, &q).await {
        assert_eq!(st, (0, 0, 0));
    }
}

/// Key holders dead-lettered by decision and by `max_deliveries` (found over it by a reclaim):
/// each passes its slot to the key's next waiter, in order.
async fn dead_lettered_key_holders_pass_their_slots_on(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("fb-dead");
    let runs = Arc::new(Runs::default());
    let r2 = runs.clone();
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let runs = r2.clone();
                async move {
                    let p = runs.enter(&d);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    runs.leave(&p);
                    match p.as_str() {
                        "k/a" => Decision::Retry,
                        "k/b" => Decision::DeadLetter("poison".into()),
                        _ => Decision::Ack,
                    }
                }
            },
            opts().with_max_deliveries(Some(1)),
        )
        .await
        .unwrap();
    for p in ["k/a", "k/b", "k/c", "k/d"] {
        s.offer_with(&q, p, keyed("k")).await.unwrap();
    }
    let log = runs.wait_len(4, Duration::from_secs(15)).await;
    let want: Vec<(String, u32)> = ["k/a", "k/b", "k/c", "k/d"].iter().map(|p| (p.to_string(), 1)).collect();
    assert_eq!(log, want);
    assert_eq!(runs.max_per_key.load(Ordering::SeqCst), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.drain(Duration::from_secs(2)).await;
    settled(&s, &q).await;
    assert_eq!(s.stats(&q).await.unwrap().dead_letters, 2);
    if let Some(st) = cap_state(&b, &q).await {
        assert_eq!(st, (0, 0, 0));
    }
}

/// A key's holder panics on every delivery: each panic hands it back, it is redelivered after the
/// claim timeout until `max_deliveries`, dead-lettered, and then the key's waiter runs.
async fn panicking_key_holder_is_dead_lettered_and_its_waiter_runs(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("fb-panic");
    let runs = Arc::new(Runs::default());
    let r2 = runs.clone();
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let runs = r2.clone();
                async move {
                    let p = runs.enter(&d);
                    runs.leave(&p);
                    if p == "k/a" {
                        panic!("handler panics holding k's slot");
                    }
                    Decision::Ack
                }
            },
            opts().with_max_deliveries(Some(2)),
        )
        .await
        .unwrap();
    s.offer_with(&q, "k/a", keyed("k")).await.unwrap();
    s.offer_with(&q, "k/b", keyed("k")).await.unwrap();
    let log = runs.wait_len(3, Duration::from_secs(20)).await;
    assert_eq!(log, [("k/a".to_string(), 1), ("k/a".to_string(), 2), ("k/b".to_string(), 1)]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.drain(Duration::from_secs(2)).await;
    settled(&s, &q).await;
    assert_eq!(s.stats(&q).await.unwrap().dead_letters, 1);
    if let Some(st) = cap_state(&b, &q).await {
        assert_eq!(st, (0, 0, 0));
    }
}

/// Paused while a key's entries wait: the holder's ack promotes the next waiter into the stream
/// (holding the slot), but a paused queue starts nothing new: it starts only after the resume.
async fn paused_queue_starts_no_promoted_waiter(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("fb-pause");
    let runs = Arc::new(Runs::default());
    let leases = Arc::new(Mutex::new(Vec::new()));
    let (r2, l2) = (runs.clone(), leases.clone());
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let (runs, leases) = (r2.clone(), l2.clone());
                async move {
                    let p = runs.enter(&d);
                    runs.leave(&p);
                    if p == "k/a" {
                        leases.lock().unwrap().push(d.lease.clone());
                        Decision::Deferred
                    } else {
                        Decision::Ack
                    }
                }
            },
            opts(),
        )
        .await
        .unwrap();
    for p in ["k/a", "k/b", "k/c"] {
        s.offer_with(&q, p, keyed("k")).await.unwrap();
    }
    runs.wait_len(1, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(s.pause(&q).await.unwrap());
    let lease = leases.lock().unwrap().pop().expect("a's lease");
    lease.ack().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(runs.log(), [("k/a".to_string(), 1)], "nothing new starts while paused");
    let st = s.stats(&q).await.unwrap();
    assert_eq!(
        (st.length, st.pending, st.key_waiting),
        (1, 0, 1),
        "b promoted into the stream, not taken; c waits: {st:?}"
    );
    if let Some(st) = cap_state(&b, &q).await {
        assert_eq!(st, (1, 1, 1));
    }
    assert!(s.resume(&q).await.unwrap());
    let log = runs.wait_len(3, Duration::from_secs(10)).await;
    assert_eq!(log, [("k/a".to_string(), 1), ("k/b".to_string(), 1), ("k/c".to_string(), 1)]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.drain(Duration::from_secs(2)).await;
    settled(&s, &q).await;
    if let Some(st) = cap_state(&b, &q).await {
        assert_eq!(st, (0, 0, 0));
    }
}

/// Two consumers disagreeing on `max_concurrency` (2 and 5): every read applies the reader's, so
/// at no moment do more than 5 run, and all entries run once.
async fn disagreeing_max_concurrency_never_exceeds_the_larger(b: TestBackend) {
    let s1 = stream_for(&b).await;
    let s2 = if b.redis_config().is_some() { stream_for(&b).await } else { s1.clone() };
    let q = queue_name("fb-maxmix");
    let now = Arc::new(AtomicUsize::new(0));
    let max = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let mut cs = Vec::new();
    for (s, m) in [(&s1, 2), (&s2, 5)] {
        let (now, max, done) = (now.clone(), max.clone(), done.clone());
        let h = move |_d: Delivery| {
            let (now, max, done) = (now.clone(), max.clone(), done.clone());
            async move {
                let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                max.fetch_max(n, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(30)).await;
                now.fetch_sub(1, Ordering::SeqCst);
                done.fetch_add(1, Ordering::SeqCst);
                Decision::Ack
            }
        };
        cs.push(s.consume(&q, h, opts().with_concurrency_per_key(None).with_max_concurrency(Some(m))).await.unwrap());
    }
    s1.offer_batch(&q, (0..60).map(|i| bytes::Bytes::from(format!("m{i}"))).collect()).await.unwrap();
    count_is(&done, 60, Duration::from_secs(20)).await.expect("all ran");
    assert!(max.load(Ordering::SeqCst) <= 5, "{} at once", max.load(Ordering::SeqCst));
    for c in cs {
        c.drain(Duration::from_secs(2)).await;
    }
    assert_eq!(done.load(Ordering::SeqCst), 60);
    settled(&s1, &q).await;
}

/// Unschedule racing the promotion of keyed scheduled entries: an entry whose unschedule said
/// `true` never runs; one whose unschedule said `false` runs exactly once.
async fn unschedule_racing_promotion_runs_a_keyed_entry_at_most_once(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("fb-unsched");
    let runs = Arc::new(Runs::default());
    let r2 = runs.clone();
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let runs = r2.clone();
                async move {
                    let p = runs.enter(&d);
                    runs.leave(&p);
                    Decision::Ack
                }
            },
            opts(),
        )
        .await
        .unwrap();
    let mut removed = Vec::new();
    for i in 0..20u64 {
        let name = format!("s:{i}");
        let due = std::time::SystemTime::now() + Duration::from_millis(20 + (i % 5) * 10);
        assert!(s
            .offer_at_with(&q, &name, format!("k{}/e{i}", i % 3), due, keyed(&format!("k{}", i % 3)))
            .await
            .unwrap());
        tokio::time::sleep(Duration::from_millis(20 + (i % 7) * 5)).await;
        removed.push(s.unschedule(&q, &name).await.unwrap());
    }
    let ran_want = removed.iter().filter(|r| !**r).count();
    runs.wait_len(ran_want, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let log = runs.log();
    for (i, r) in removed.iter().enumerate() {
        let n = log.iter().filter(|(p, _)| *p == format!("k{}/e{i}", i % 3)).count();
        assert_eq!(n, usize::from(!*r), "entry {i}: unscheduled {r}, ran {n} times");
    }
    c.drain(Duration::from_secs(2)).await;
    settled(&s, &q).await;
    assert_eq!(s.scheduled(&q).await.unwrap().0, 0);
    if let Some(st) = cap_state(&b, &q).await {
        assert_eq!(st, (0, 0, 0));
    }
}

/// A handler answers `RetryAfter(Duration::MAX)` (say, a `Retry-After` header parsed into a
/// huge number) while holding its key's slot: the entry waits in the delayed set, its slot goes
/// to the key's waiter, and the consumer goes on working.
async fn huge_retry_after_of_a_key_holder_frees_its_slot_and_keeps_the_consumer_working(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("fb-huge-ra");
    let runs = Arc::new(Runs::default());
    let r2 = runs.clone();
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let runs = r2.clone();
                async move {
                    let p = runs.enter(&d);
                    runs.leave(&p);
                    if p == "k/a" {
                        Decision::RetryAfter(Duration::MAX)
                    } else {
                        Decision::Ack
                    }
                }
            },
            opts(),
        )
        .await
        .unwrap();
    s.offer_with(&q, "k/a", keyed("k")).await.unwrap();
    s.offer_with(&q, "k/b", keyed("k")).await.unwrap();
    let log = runs.wait_len(2, Duration::from_secs(10)).await;
    assert_eq!(log, [("k/a".to_string(), 1), ("k/b".to_string(), 1)]);
    s.offer_with(&q, "k/c", keyed("k")).await.unwrap();
    runs.wait_len(3, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.delayed), (0, 0, 1), "{st:?}");
    c.drain(Duration::from_secs(2)).await;
    if let Some(st) = cap_state(&b, &q).await {
        assert_eq!(st, (0, 0, 0));
    }
}

/// A handler answers `RateLimited(Duration::MAX)`: the queue backs off (for as long as the
/// backend can keep it), the entry waits, and the consumer and the queue's stats keep working.
async fn huge_rate_limited_answer_keeps_the_consumer_working(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("fb-huge-rl");
    let runs = Arc::new(Runs::default());
    let r2 = runs.clone();
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let runs = r2.clone();
                async move {
                    let p = runs.enter(&d);
                    runs.leave(&p);
                    Decision::RateLimited(Duration::MAX)
                }
            },
            opts(),
        )
        .await
        .unwrap();
    s.offer(&q, "x/a").await.unwrap();
    runs.wait_len(1, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = s.stats(&q).await.unwrap();
    assert!(st.backoff_ms.is_some_and(|ms| ms > 86_400_000), "{st:?}");
    assert_eq!(st.length + st.delayed, 1, "{st:?}");
    assert_eq!(c.counters().rate_limited, 1);
    s.offer(&q, "x/b").await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(runs.log().len(), 1, "nothing new starts while backing off");
    c.drain(Duration::from_secs(2)).await;
}

/// Redis (AOF, every write fsynced) is killed and restarted twice while two consumers work
/// through three keys' lines (`concurrency_per_key = 1`, `max_concurrency = 3`): every entry
/// runs, a key's entries never overlap, and no slot or waiter is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_lines_survive_redis_restarts() {
    require_redis();
    let server = Arc::new(Mutex::new(RedisServer::start_with(ServerOptions { appendonly: true })));
    let cfg = server.lock().unwrap().config();
    let client = RedisClient::new(cfg.clone()).unwrap();
    let s = MessageStream::redis(RedisClient::new(cfg.clone()).unwrap(), Default::default()).await.unwrap();
    let s2 = MessageStream::redis(RedisClient::new(cfg).unwrap(), Default::default()).await.unwrap();
    let q = queue_name("fb-restart");
    let runs = Arc::new(Runs::default());
    let ended = Arc::new(Mutex::new(std::collections::HashSet::new()));
    let mut cs = Vec::new();
    for st in [&s, &s2] {
        let (runs, ended) = (runs.clone(), ended.clone());
        let h = move |d: Delivery| {
            let (runs, ended) = (runs.clone(), ended.clone());
            async move {
                let p = runs.enter(&d);
                tokio::time::sleep(Duration::from_millis(300)).await;
                runs.leave(&p);
                ended.lock().unwrap().insert(p);
                Decision::Ack
            }
        };
        cs.push(st.consume(&q, h, opts().with_max_concurrency(Some(3))).await.unwrap());
    }
    for i in 0..6 {
        for k in 0..3 {
            s.offer_with(&q, format!("k{k}/{i}"), keyed(&format!("k{k}"))).await.unwrap();
        }
    }
    for down in [300u64, 700] {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let sv = server.clone();
        tokio::task::spawn_blocking(move || {
            let mut g = sv.lock().unwrap();
            g.kill();
            std::thread::sleep(Duration::from_millis(down));
            g.restart();
        })
        .await
        .unwrap();
    }
    let done = eventually(Duration::from_secs(25), || {
        let n = ended.lock().unwrap().len();
        async move { (n == 18).then_some(()) }
    })
    .await;
    assert!(done.is_some(), "not every entry ran: {:?}", runs.log());
    assert_eq!(runs.max_per_key.load(Ordering::SeqCst), 1, "{:?}", runs.log());
    tokio::time::sleep(Duration::from_millis(500)).await;
    for c in cs {
        c.drain(Duration::from_secs(2)).await;
    }
    // The first call on a connection cut by the restart may fail (it reconnects then).
    let _ = s.stats(&q).await;
    settled(&s, &q).await;
    let mut conn = client.shared().await.unwrap();
    assert_eq!(caps_of(&mut conn, &q).await, (0, 0, 0));
    eprintln!("runs: {} for 18 entries", runs.log().len());
}

/// A key's holder blocks its thread for 3 claim timeouts (a synchronous call in an async
/// handler) while a second consumer waits: the holder's lease holds, the entry runs once, and the
/// key's waiter starts only after it returned.
async fn a_key_holder_blocking_its_thread_keeps_its_slot_and_runs_once(b: TestBackend) {
    let s1 = stream_for(&b).await;
    let s2 = if b.redis_config().is_some() { stream_for(&b).await } else { s1.clone() };
    let q = queue_name("fb-block");
    let runs = Arc::new(Runs::default());
    let ends = Arc::new(Mutex::new(Vec::new()));
    let mut cs = Vec::new();
    for s in [&s1, &s2] {
        let (runs, ends) = (runs.clone(), ends.clone());
        let h = move |d: Delivery| {
            let (runs, ends) = (runs.clone(), ends.clone());
            async move {
                let p = runs.enter(&d);
                if p == "k/a" {
                    std::thread::sleep(Duration::from_millis(3_000));
                }
                runs.leave(&p);
                ends.lock().unwrap().push((p, std::time::Instant::now(), d.lease.is_lost()));
                Decision::Ack
            }
        };
        cs.push(s.consume(&q, h, opts().with_concurrency(2)).await.unwrap());
    }
    s1.offer_with(&q, "k/a", keyed("k")).await.unwrap();
    runs.wait_len(1, Duration::from_secs(5)).await;
    s1.offer_with(&q, "k/b", keyed("k")).await.unwrap();
    let log = runs.wait_len(2, Duration::from_secs(15)).await;
    assert_eq!(log, [("k/a".to_string(), 1), ("k/b".to_string(), 1)]);
    assert_eq!(runs.max_per_key.load(Ordering::SeqCst), 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let e = ends.lock().unwrap().clone();
    assert_eq!(e.iter().map(|x| (x.0.as_str(), x.2)).collect::<Vec<_>>(), [("k/a", false), ("k/b", false)]);
    for c in cs {
        c.drain(Duration::from_secs(2)).await;
    }
    settled(&s1, &q).await;
    if let Some(st) = cap_state(&b, &q).await {
        assert_eq!(st, (0, 0, 0));
    }
}

/// Keyed entries of mixed priorities (the ready set on Redis) through three consumers, with key
/// holders answering a long `RetryAfter`, a short one, and dead letters, while a pause comes and
/// goes: every entry ends (acked or dead-lettered) once, a key never runs two at once, and no
/// slot, waiter or ready entry is left behind.
async fn prioritized_keyed_entries_with_retries_and_dead_letters_leave_nothing_behind(b: TestBackend) {
    let s1 = stream_for(&b).await;
    let (s2, s3) = if b.redis_config().is_some() {
        (stream_for(&b).await, stream_for(&b).await)
    } else {
        (s1.clone(), s1.clone())
    };
    let q = queue_name("fb-prio");
    let runs = Arc::new(Runs::default());
    let ended = Arc::new(Mutex::new(Vec::new()));
    let mut cs = Vec::new();
    for s in [&s1, &s2, &s3] {
        let (runs, ended) = (runs.clone(), ended.clone());
        let h = move |d: Delivery| {
            let (runs, ended) = (runs.clone(), ended.clone());
            async move {
                let p = runs.enter(&d);
                tokio::time::sleep(Duration::from_millis(20)).await;
                runs.leave(&p);
                let n: usize = p.split('/').nth(1).unwrap().parse().unwrap();
                let first = runs.log().iter().filter(|(x, _)| *x == p).count() == 1;
                let decision = match n % 7 {
                    1 if first => Decision::RetryAfter(Duration::from_millis(1_200)),
                    2 if first => Decision::RetryAfter(Duration::from_millis(150)),
                    3 => Decision::DeadLetter("poison".into()),
                    _ => Decision::Ack,
                };
                if matches!(decision, Decision::Ack | Decision::DeadLetter(_)) {
                    ended.lock().unwrap().push(p);
                }
                decision
            }
        };
        cs.push(s.consume(&q, h, opts().with_max_concurrency(Some(4))).await.unwrap());
    }
    let total = 42;
    for n in 0..total {
        let k = format!("k{}", n % 3);
        let o = OfferOptions { concurrency_key: Some(k.clone()), priority: ((n * 5) % 7) as i8 - 3 };
        s1.offer_with(&q, format!("{k}/{n}"), o).await.unwrap();
        if n == 20 {
            s1.pause(&q).await.unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            s1.resume(&q).await.unwrap();
        }
    }
    let done = eventually(Duration::from_secs(25), || {
        let n = ended.lock().unwrap().len();
        async move { (n >= total).then_some(()) }
    })
    .await;
    assert!(done.is_some(), "{} of {total} ended: {:?}", ended.lock().unwrap().len(), runs.log());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut e = ended.lock().unwrap().clone();
    e.sort();
    e.dedup();
    assert_eq!(e.len(), total, "each ended once");
    assert_eq!(ended.lock().unwrap().len(), total, "none ended twice");
    assert_eq!(runs.max_per_key.load(Ordering::SeqCst), 1);
    for c in cs {
        c.drain(Duration::from_secs(2)).await;
    }
    let st = s1.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.delayed, st.key_waiting, st.dead_letters), (0, 0, 0, 0, 6), "{st:?}");
    if let Some(st) = cap_state(&b, &q).await {
        assert_eq!(st, (0, 0, 0));
    }
}
