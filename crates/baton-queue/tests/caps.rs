//! Concurrency caps: `max_concurrency` (entries pending in the group, across consumers) and
//! `concurrency_per_key` (entries of one concurrency key holding a slot). Every backend (memory,
//! Redis standalone, Redis Cluster); three consumers, each with its own connections.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_queue::{keys, ConsumerOptions, Decision, Delivery, MessageStream, OfferOptions, QueueError, RemoteOptions};
use baton_redis::redis;
use baton_testkit::TestBackend;
use common::*;

baton_testkit::on_every_backend!(
    max_concurrency_holds_across_three_consumers,
    one_per_key_runs_each_keys_entries_alone_and_in_order,
    a_dead_holders_entry_fails_over_then_its_key_waiter_runs,
    waiting_entries_are_not_pending,
    bad_caps_and_keys_are_refused,
    remote_workers_claim_through_the_same_caps,
);

/// Three streams (connections) on one backend; memory has one process-wide store, so it is shared.
async fn three(b: &TestBackend) -> Vec<MessageStream> {
    let first = stream_for(b).await;
    if b.redis_config().is_none() {
        return vec![first.clone(), first.clone(), first];
    }
    vec![first, stream_for(b).await, stream_for(b).await]
}

fn keyed(k: &str) -> OfferOptions {
    OfferOptions { concurrency_key: Some(k.to_string()), ..Default::default() }
}

/// Running handlers, now and at most.
#[derive(Default)]
struct Gauge {
    now: AtomicUsize,
    max: AtomicUsize,
}

impl Gauge {
    fn enter(&self) {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(n, Ordering::SeqCst);
    }
    fn leave(&self) {
        self.now.fetch_sub(1, Ordering::SeqCst);
    }
}

fn opts() -> ConsumerOptions {
    // A long poll interval: a freed slot must wake the waiting reads (not the next poll) for the
    // run to end in time.
    fast(10_000).with_poll_interval(Duration::from_secs(3)).with_concurrency(8)
}

async fn max_concurrency_holds_across_three_consumers(b: TestBackend) {
    let streams = three(&b).await;
    let q = queue_name("caps-max");
    let gauge = Arc::new(Gauge::default());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut consumers = Vec::new();
    for s in &streams {
        let (gauge, seen) = (gauge.clone(), seen.clone());
        let h = move |d: Delivery| {
            let (gauge, seen) = (gauge.clone(), seen.clone());
            async move {
                gauge.enter();
                tokio::time::sleep(Duration::from_millis(40)).await;
                seen.lock().unwrap().push(d.payload.clone());
                gauge.leave();
                Decision::Ack
            }
        };
        consumers.push(s.consume(&q, h, opts().with_max_concurrency(Some(3))).await.unwrap());
    }
    let started = Instant::now();
    streams[0].offer_batch(&q, (0..60).map(|i| bytes::Bytes::from(format!("m{i}"))).collect()).await.unwrap();
    eventually(Duration::from_secs(60), || {
        let n = seen.lock().unwrap().len();
        async move { (n >= 60).then_some(()) }
    })
    .await
    .expect("all 60 ran");
    let took = started.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut got: Vec<String> = seen.lock().unwrap().iter().map(|p| String::from_utf8_lossy(p).into_owned()).collect();
    got.sort();
    let mut want: Vec<String> = (0..60).map(|i| format!("m{i}")).collect();
    want.sort();
    assert_eq!(got, want, "each exactly once");
    assert_eq!(gauge.max.load(Ordering::SeqCst), 3, "never more than 3 running, and the cap is reached");
    // 20 rounds of 40 ms; without the wake-up on a freed slot each round would wait for a poll (3 s).
    assert!(took < Duration::from_secs(30), "took {took:?}");
    for c in consumers {
        c.drain(Duration::from_secs(2)).await;
    }
    let st = streams[0].stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending), (0, 0));
}

async fn one_per_key_runs_each_keys_entries_alone_and_in_order(b: TestBackend) {
    let streams = three(&b).await;
    let q = queue_name("caps-key");
    let running: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let violations = Arc::new(AtomicUsize::new(0));
    let order: Arc<Mutex<HashMap<String, Vec<u32>>>> = Arc::default();
    let gauge = Arc::new(Gauge::default());
    let mut consumers = Vec::new();
    for s in &streams {
        let (running, violations, order, gauge) = (running.clone(), violations.clone(), order.clone(), gauge.clone());
        let h = move |d: Delivery| {
            let (running, violations, order, gauge) =
                (running.clone(), violations.clone(), order.clone(), gauge.clone());
            async move {
                let text = String::from_utf8_lossy(&d.payload).into_owned();
                let (k, n) = text.split_once(':').unwrap();
                let (k, n) = (k.to_string(), n.parse::<u32>().unwrap());
                {
                    let mut r = running.lock().unwrap();
                    let c = r.entry(k.clone()).or_default();
                    *c += 1;
                    if *c > 1 {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                }
                order.lock().unwrap().entry(k.clone()).or_default().push(n);
                gauge.enter();
                tokio::time::sleep(Duration::from_millis(30)).await;
                gauge.leave();
                *running.lock().unwrap().get_mut(&k).unwrap() -= 1;
                Decision::Ack
            }
        };
        consumers.push(s.consume(&q, h, opts().with_concurrency_per_key(Some(1))).await.unwrap());
    }
    for n in 0..10u32 {
        for k in ["a", "b", "c"] {
            streams[(n as usize) % 3].offer_with(&q, format!("{k}:{n}"), keyed(k)).await.unwrap();
        }
    }
    eventually(Duration::from_secs(60), || {
        let n: usize = order.lock().unwrap().values().map(Vec::len).sum();
        async move { (n >= 30).then_some(()) }
    })
    .await
    .expect("all 30 ran");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(violations.load(Ordering::SeqCst), 0, "two entries of one key ran at once");
    let order = order.lock().unwrap().clone();
    for k in ["a", "b", "c"] {
        assert_eq!(order[k], (0..10).collect::<Vec<u32>>(), "key {k} in offer order");
    }
    assert!(gauge.max.load(Ordering::SeqCst) >= 2, "keys run side by side");
    for c in consumers {
        c.drain(Duration::from_secs(2)).await;
    }
    let st = streams[0].stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending), (0, 0));
    if let Some(mut conn) = conn_for(&b).await {
        assert_eq!(cap_state(&mut conn, &q).await, (0, 0, 0), "no slot or waiter left behind");
    }
}

/// (held keys, holders, waiting entries) in Redis.
async fn cap_state(conn: &mut baton_redis::RedisConn, q: &str) -> (u64, u64, u64) {
    let p = keys::DEFAULT_PREFIX;
    let held: u64 = redis::cmd("HLEN").arg(keys::key_held(p, q)).query_async(conn).await.unwrap();
    let ids: u64 = redis::cmd("HLEN").arg(keys::key_holders(p, q)).query_async(conn).await.unwrap();
    let waiting: u64 = redis::cmd("ZCARD").arg(keys::key_waiting(p, q)).query_async(conn).await.unwrap();
    (held, ids, waiting)
}

/// The holder of key k's only slot dies (abort: as if its process was killed): its entry stays
/// pending and holds the slot, a live consumer takes it over after the claim timeout, and only
/// once that entry is done does k's waiter run.
async fn a_dead_holders_entry_fails_over_then_its_key_waiter_runs(b: TestBackend) {
    let streams = three(&b).await;
    let q = queue_name("caps-dead");
    let started = Arc::new(tokio::sync::Notify::new());
    let st2 = started.clone();
    let o = || fast(1_000).with_concurrency_per_key(Some(1));
    let a = streams[0]
        .consume(
            &q,
            move |_d: Delivery| {
                let st = st2.clone();
                async move {
                    st.notify_one();
                    tokio::time::sleep(Duration::from_secs(120)).await;
                    Decision::Ack
                }
            },
            o(),
        )
        .await
        .unwrap();
    streams[0].offer_with(&q, "first", keyed("k")).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), started.notified()).await.expect("A started the first");
    streams[1].offer_with(&q, "second", keyed("k")).await.unwrap();
    let got = Arc::new(Mutex::new(Vec::new()));
    let got2 = got.clone();
    let bc = streams[1]
        .consume(
            &q,
            move |d: Delivery| {
                let got = got2.clone();
                async move {
                    got.lock().unwrap().push((String::from_utf8_lossy(&d.payload).into_owned(), d.deliveries));
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Decision::Ack
                }
            },
            o(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    assert!(
        got.lock().unwrap().is_empty(),
        "the waiter must not run while A holds the slot: {:?}",
        got.lock().unwrap()
    );
    a.abort();
    eventually(Duration::from_secs(15), || {
        let n = got.lock().unwrap().len();
        async move { (n == 2).then_some(()) }
    })
    .await
    .expect("both ran on B");
    assert_eq!(*got.lock().unwrap(), [("first".to_string(), 2), ("second".to_string(), 1)]);
    bc.drain(Duration::from_secs(2)).await;
    if let Some(mut conn) = conn_for(&b).await {
        assert_eq!(cap_state(&mut conn, &q).await, (0, 0, 0));
    }
}

/// Entries waiting for their key are out of the stream and not pending: with 20 entries of one
/// key and a cap of 1, exactly one is pending at a time.
async fn waiting_entries_are_not_pending(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("caps-wait");
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let (g2, d2) = (gate.clone(), done.clone());
    let c = s
        .consume(
            &q,
            move |_d: Delivery| {
                let (gate, done) = (g2.clone(), d2.clone());
                async move {
                    gate.acquire().await.unwrap().forget();
                    done.fetch_add(1, Ordering::SeqCst);
                    Decision::Ack
                }
            },
            opts().with_concurrency_per_key(Some(1)),
        )
        .await
        .unwrap();
    for i in 0..20 {
        s.offer_with(&q, format!("x{i}"), keyed("x")).await.unwrap();
    }
    s.offer(&q, "free").await.unwrap();
    // The keyless entry and the key's head run; the other 19 wait outside the stream.
    eventually(Duration::from_secs(10), || {
        let s = s.clone();
        let q = q.clone();
        async move {
            let st = s.stats(&q).await.unwrap();
            (st.pending == 2 && st.length == 2).then_some(())
        }
    })
    .await
    .expect("two pending, the rest waiting");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.pending, st.length, st.lag), (2, 2, 0));
    if let Some(mut conn) = conn_for(&b).await {
        assert_eq!(pending_owners(&mut conn, &q).await.len(), 2);
        assert_eq!(cap_state(&mut conn, &q).await, (1, 1, 19));
    }
    gate.add_permits(21);
    eventually(Duration::from_secs(20), || {
        let n = done.load(Ordering::SeqCst);
        async move { (n == 21).then_some(()) }
    })
    .await
    .expect("all ran");
    c.drain(Duration::from_secs(2)).await;
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.pending, st.length), (0, 0));
    if let Some(mut conn) = conn_for(&b).await {
        assert_eq!(cap_state(&mut conn, &q).await, (0, 0, 0));
    }
}

async fn bad_caps_and_keys_are_refused(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("caps-bad");
    for (o, needle) in [
        (ConsumerOptions::new().with_max_concurrency(Some(0)), "max_concurrency must be at least 1"),
        (ConsumerOptions::new().with_concurrency_per_key(Some(0)), "concurrency_per_key must be at least 1"),
    ] {
        let err = s.consume(&q, |_d: Delivery| async { Decision::Ack }, o).await.err().expect("refused");
        assert!(matches!(err, QueueError::InvalidSettings(_)), "{err:?}");
        assert!(err.to_string().contains(needle), "{err}");
    }
    for bad in [String::new(), "x".repeat(257), "a\nb".to_string()] {
        let err = s.offer_with(&q, "p", keyed(&bad)).await.unwrap_err();
        assert!(err.to_string().contains("concurrency_key must be 1 to 256 bytes"), "{err}");
    }
    s.offer_with(&q, "p", keyed(&"x".repeat(256))).await.unwrap();
    assert_eq!(s.stats(&q).await.unwrap().length, 1, "only the valid offer was added");
}

/// Redis: a slot holder whose pending entry is removed behind the queue's back (here `XACK` +
/// `XDEL` from outside, as a manual cleanup would) never releases its slot through a script; the
/// reclaim tick's backstop finds it (neither pending nor in the stream) and the key's waiter runs.
async fn a_lost_release_is_found_by_the_backstop(b: TestBackend) {
    let s = stream_for(&b).await;
    let mut conn = conn_for(&b).await.expect("redis");
    let q = queue_name("caps-lost");
    let got = Arc::new(Mutex::new(Vec::new()));
    let got2 = got.clone();
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let got = got2.clone();
                async move {
                    let p = String::from_utf8_lossy(&d.payload).into_owned();
                    got.lock().unwrap().push(p.clone());
                    if p == "first" {
                        tokio::time::sleep(Duration::from_secs(120)).await;
                    }
                    Decision::Ack
                }
            },
            fast(1_000).with_concurrency_per_key(Some(1)),
        )
        .await
        .unwrap();
    let first = s.offer_with(&q, "first", keyed("k")).await.unwrap();
    s.offer_with(&q, "second", keyed("k")).await.unwrap();
    eventually(Duration::from_secs(5), || {
        let n = got.lock().unwrap().len();
        async move { (n == 1).then_some(()) }
    })
    .await
    .expect("first started");
    // The second is read and goes to the key's waiting line.
    let c2 = conn.clone();
    let q2 = q.clone();
    eventually(Duration::from_secs(5), move || {
        let (mut c2, q2) = (c2.clone(), q2.clone());
        async move { (cap_state(&mut c2, &q2).await == (1, 1, 1)).then_some(()) }
    })
    .await
    .expect("one holder, one waiting");
    let stream = keys::stream(keys::DEFAULT_PREFIX, &q);
    let _: i64 = redis::cmd("XACK")
        .arg(&stream)
        .arg(keys::DEFAULT_GROUP)
        .arg(first.to_string())
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: i64 = redis::cmd("XDEL").arg(&stream).arg(first.to_string()).query_async(&mut conn).await.unwrap();
    eventually(Duration::from_secs(10), || {
        let v = got.lock().unwrap().clone();
        async move { (v.len() == 2).then_some(()) }
    })
    .await
    .expect("the waiter ran once the lost slot was found");
    assert_eq!(*got.lock().unwrap(), ["first", "second"]);
    c.abort();
}

mod a_lost_release_is_found_by_the_backstop {
    use baton_testkit::{require_redis, RedisCluster, RedisServer, TestBackend};
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn standalone() {
        require_redis();
        super::a_lost_release_is_found_by_the_backstop(TestBackend::Standalone(RedisServer::start())).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cluster() {
        require_redis();
        super::a_lost_release_is_found_by_the_backstop(TestBackend::Cluster(RedisCluster::start())).await
    }
}

/// Remote workers (`RemoteConsumer::claim`) take new work through the same gated read: with
/// `max_concurrency = 2` and `concurrency_per_key = 1`, claims across two workers never hold more
/// than 2, a key's second entry waits for its first, and a claim waiting at the cap is woken by
/// the ack that frees a slot.
async fn remote_workers_claim_through_the_same_caps(b: TestBackend) {
    let streams = three(&b).await;
    let q = queue_name("caps-remote");
    let opts = RemoteOptions {
        claim_timeout: Duration::from_secs(30),
        max_deliveries: None,
        max_concurrency: Some(2),
        concurrency_per_key: Some(1),
        ..Default::default()
    };
    let a = streams[0].remote_consumer(&q, "worker-a", opts.clone()).await.unwrap();
    let wb = streams[1].remote_consumer(&q, "worker-b", opts).await.unwrap();
    streams[0].offer_with(&q, "x1", keyed("x")).await.unwrap();
    streams[0].offer_with(&q, "x2", keyed("x")).await.unwrap();
    streams[0].offer_with(&q, "y1", keyed("y")).await.unwrap();
    streams[0].offer(&q, "z").await.unwrap();
    let text = |v: &[baton_queue::RemoteDelivery]| -> Vec<String> {
        v.iter().map(|d| String::from_utf8_lossy(&d.payload).into_owned()).collect()
    };
    let got_a = a.claim(10, Duration::ZERO).await.unwrap();
    assert_eq!(text(&got_a), ["x1", "y1"], "x2 waits for x1; the cap stops at 2");
    assert!(wb.claim(10, Duration::ZERO).await.unwrap().is_empty(), "2 pending: nothing more");
    let waiter = tokio::spawn(async move {
        let got = wb.claim(10, Duration::from_secs(20)).await.unwrap();
        (wb, got)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.ack(got_a[0].id, got_a[0].fence).await.unwrap();
    let (wb, got_b) = waiter.await.unwrap();
    // x1's slot went to x2 (appended after z), the freed group slot to the first entry: z.
    assert_eq!(text(&got_b), ["z"]);
    a.ack(got_a[1].id, got_a[1].fence).await.unwrap();
    let got = wb.claim(10, Duration::from_secs(5)).await.unwrap();
    assert_eq!(text(&got), ["x2"]);
    assert_eq!(streams[0].stats(&q).await.unwrap().pending, 2);
}
