//! Attacks on the per-key rate limit's line (`ConsumerOptions::with_rate_limit_per_key`): each
//! entry runs once, a key's entries start in offer order and at its rate, other keys are not held
//! back, nothing is stranded — under retries, key caps, priorities, dead consumers, pauses,
//! remote claims, rate changes and Redis restarts. Memory, Redis standalone and Cluster.

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_queue::{ConsumerOptions, Decision, Delivery, MessageStream, OfferOptions, RateLimit, RemoteOptions};
use baton_testkit::TestBackend;
use common::*;

baton_testkit::on_every_backend!(
    with_a_key_cap_of_two_and_retries_each_entry_runs_once_in_order_at_its_keys_rate,
    priority_entries_of_a_parked_key_keep_its_rate_and_run_once,
    a_consumer_aborted_mid_line_leaves_the_line_to_the_next_consumer,
    a_pause_while_a_line_is_parked_keeps_order_and_spacing,
    one_slot_for_many_keys_holds_no_key_back,
    concurrent_remote_claims_keep_each_keys_order_and_rate,
    a_faster_rate_after_a_restart_strands_nothing,
    a_slower_rate_after_a_restart_spaces_at_the_new_rate,
    a_head_read_while_its_consumer_closes_keeps_its_place_in_the_line,
    a_head_handed_back_by_a_remote_worker_keeps_its_place_in_the_line,
    consumers_with_and_without_the_limit_side_by_side_strand_nothing,
    a_head_run_without_the_limit_leaves_no_phantom_that_strands_later_entries,
    consumers_with_different_rates_side_by_side_run_each_entry_once_in_order,
);

fn keyed(k: &str) -> OfferOptions {
    OfferOptions { concurrency_key: Some(k.to_string()), ..Default::default() }
}

fn keyed_pr(k: &str, priority: i8) -> OfferOptions {
    OfferOptions { concurrency_key: Some(k.to_string()), priority }
}

/// Handler starts: (payload, when, delivery count).
type Starts = Arc<Mutex<Vec<(String, Instant, u32)>>>;
/// Acks (handler returned Ack): payload → how many.
type Acks = Arc<Mutex<HashMap<String, usize>>>;

fn record(starts: &Starts, d: &Delivery) -> String {
    let p = String::from_utf8_lossy(&d.payload).into_owned();
    starts.lock().unwrap().push((p.clone(), Instant::now(), d.deliveries));
    p
}

fn ack(acks: &Acks, p: &str) -> Decision {
    *acks.lock().unwrap().entry(p.to_string()).or_default() += 1;
    Decision::Ack
}

/// First starts (first time each payload was seen) of payloads beginning with `prefix`.
fn firsts(starts: &Starts, prefix: &str) -> Vec<(String, Instant)> {
    let mut seen = std::collections::HashSet::new();
    starts
        .lock()
        .unwrap()
        .iter()
        .filter(|(p, _, _)| p.starts_with(prefix) && seen.insert(p.clone()))
        .map(|(p, at, _)| (p.clone(), *at))
        .collect()
}

fn opts(rate: RateLimit) -> ConsumerOptions {
    fast(10_000).with_poll_interval(Duration::from_secs(2)).with_concurrency(8).with_rate_limit_per_key(Some(rate))
}

/// Consecutive starts of one key at least `gap` apart (less `tol`), in the order `want`.
fn assert_order_and_gaps(key: &str, got: &[(String, Instant)], want: &[String], gap: Duration, tol: Duration) {
    let order: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(order, want, "key {key}: each once, in order");
    for i in 1..got.len() {
        let d = got[i].1 - got[i - 1].1;
        assert!(d + tol >= gap, "key {key}: {} only {d:?} after {}", got[i].0, got[i - 1].0);
    }
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

async fn wait_acks(acks: &Acks, n: usize, within: Duration) {
    let got = eventually(within, || {
        let n2 = acks.lock().unwrap().len();
        async move { (n2 >= n).then_some(()) }
    })
    .await;
    assert!(got.is_some(), "only {} of {n} acked: {:?}", acks.lock().unwrap().len(), acks.lock().unwrap());
}

async fn assert_nothing_left(s: &MessageStream, q: &str) {
    let (s2, q2) = (s.clone(), q.to_string());
    let st = eventually(Duration::from_secs(5), || {
        let (s, q) = (s2.clone(), q2.clone());
        async move {
            let st = s.stats(&q).await.ok()?;
            (st.length == 0 && st.pending == 0 && st.delayed == 0 && st.key_rate_delayed == 0).then_some(st)
        }
    })
    .await;
    assert!(st.is_some(), "stranded: {:?}", s.stats(q).await.unwrap());
}

fn assert_each_acked_once(acks: &Acks, want: usize) {
    let a = acks.lock().unwrap();
    assert_eq!(a.len(), want, "{a:?}");
    for (p, n) in a.iter() {
        assert_eq!(*n, 1, "{p} acked {n} times");
    }
}

/// Attack 1: two slots per key, blocking handlers, short and long RetryAfter and RateLimited on
/// first deliveries. First starts of each key in offer order, one interval apart; each acked once.
async fn with_a_key_cap_of_two_and_retries_each_entry_runs_once_in_order_at_its_keys_rate(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krb-cap2");
    let (starts, acks): (Starts, Acks) = Default::default();
    let h = {
        let (starts, acks) = (starts.clone(), acks.clone());
        move |d: Delivery| {
            let p = record(&starts, &d);
            std::thread::sleep(Duration::from_millis(30));
            let i: u32 = p[1..].parse().unwrap();
            let first = starts.lock().unwrap().iter().filter(|(x, _, _)| *x == p).count() == 1;
            let dec = match (first, i, &p[..1]) {
                (true, 1, _) => Decision::RetryAfter(Duration::from_millis(50)),
                (true, 3, _) => Decision::RetryAfter(Duration::from_millis(900)),
                (true, 4, "b") => Decision::RateLimited(Duration::from_millis(150)),
                _ => ack(&acks, &p),
            };
            std::future::ready(dec)
        }
    };
    let rate = RateLimit::new(10, Duration::from_secs(1)).with_burst(1);
    let o = fast(600)
        .with_poll_interval(Duration::from_millis(600))
        .with_concurrency(4)
        .with_concurrency_per_key(Some(2))
        .with_rate_limit_per_key(Some(rate));
    let c = s.consume(&q, h, o).await.unwrap();
    for i in 0..6 {
        for k in ["a", "b", "c"] {
            s.offer_with(&q, format!("{k}{i}"), keyed(k)).await.unwrap();
        }
    }
    wait_acks(&acks, 18, Duration::from_secs(12)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_each_acked_once(&acks, 18);
    // A handler blocks its runtime thread for 30 ms: the next handler handed to that thread
    // (entries are spaced when the consumer takes them) may be invoked up to that much late.
    for k in ["a", "b", "c"] {
        let got = firsts(&starts, k);
        assert_order_and_gaps(k, &got, &names(k, 6), Duration::from_millis(100), Duration::from_millis(15 + 30));
    }
    c.drain(Duration::from_secs(2)).await;
    assert_nothing_left(&s, &q).await;
}

/// Attack 2: entries of other priorities offered to a key whose line is parked: they join the
/// line in arrival order (spaced, once each); entries queued before the first read start by
/// priority, then arrival.
async fn priority_entries_of_a_parked_key_keep_its_rate_and_run_once(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krb-prio");
    let (starts, acks): (Starts, Acks) = Default::default();
    let h = {
        let (starts, acks) = (starts.clone(), acks.clone());
        move |d: Delivery| {
            let p = record(&starts, &d);
            std::future::ready(ack(&acks, &p))
        }
    };
    // Queued before any consumer: x0 (0), x1 (5), x2 (-3), x3 (9), x4 (0).
    let prios = [0i8, 5, -3, 9, 0];
    for (i, pr) in prios.iter().enumerate() {
        s.offer_with(&q, format!("x{i}"), keyed_pr("x", *pr)).await.unwrap();
    }
    let rate = RateLimit::new(5, Duration::from_secs(1)).with_burst(1);
    let c = s.consume(&q, h, opts(rate).with_concurrency(2)).await.unwrap();
    eventually(Duration::from_secs(5), || {
        let n = firsts(&starts, "y").len() + firsts(&starts, "x").len();
        async move { (n >= 1).then_some(()) }
    })
    .await
    .unwrap();
    // Offered one at a time while x's line is parked: y's of mixed priorities, and free entries.
    let yprios = [0i8, 7, -2, 3, 0];
    for (i, pr) in yprios.iter().enumerate() {
        s.offer_with(&q, format!("y{i}"), keyed_pr("y", *pr)).await.unwrap();
        s.offer_with(&q, format!("z{i}"), OfferOptions { priority: -*pr, ..Default::default() }).await.unwrap();
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    wait_acks(&acks, 15, Duration::from_secs(8)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_each_acked_once(&acks, 15);
    let gap = Duration::from_millis(200);
    let tol = Duration::from_millis(15);
    let want_x: Vec<String> = ["x3", "x1", "x0", "x4", "x2"].map(String::from).into();
    assert_order_and_gaps("x", &firsts(&starts, "x"), &want_x, gap, tol);
    // y0 started at once; y1..y4 arrived one at a time behind it: offer order.
    assert_order_and_gaps("y", &firsts(&starts, "y"), &names("y", 5), gap, tol);
    c.drain(Duration::from_secs(2)).await;
    assert_nothing_left(&s, &q).await;
}

/// Attack 3: a consumer aborted (no drain) with one of the key's entries running and its next
/// head promoted but unread (its only slot busy): a new consumer takes the line over; the dead
/// consumer's entry after claim_timeout; each entry done once, nothing stranded.
async fn a_consumer_aborted_mid_line_leaves_the_line_to_the_next_consumer(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krb-abort");
    let (starts, acks): (Starts, Acks) = Default::default();
    let rate = RateLimit::new(10, Duration::from_secs(1)).with_burst(1);
    let a_started: Starts = Arc::default();
    let h_a = {
        let (starts, acks) = (a_started.clone(), acks.clone());
        move |d: Delivery| {
            let (starts, acks) = (starts.clone(), acks.clone());
            async move {
                let p = record(&starts, &d);
                if p == "k1" {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                ack(&acks, &p)
            }
        }
    };
    let a = s.consume(&q, h_a, fast(500).with_concurrency(1).with_rate_limit_per_key(Some(rate))).await.unwrap();
    for i in 0..6 {
        s.offer_with(&q, format!("k{i}"), keyed("k")).await.unwrap();
    }
    s.offer_with(&q, "j0", keyed("j")).await.unwrap();
    eventually(Duration::from_secs(5), || {
        let n = firsts(&a_started, "k1").len();
        async move { (n == 1).then_some(()) }
    })
    .await
    .expect("k1 started in the first consumer");
    // k2 comes due 100 ms after k1 (promoted, unread: the only slot is busy).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let st = s.stats(&q).await.unwrap();
    a.abort();
    let h_b = {
        let (starts, acks) = (starts.clone(), acks.clone());
        move |d: Delivery| {
            let p = record(&starts, &d);
            std::future::ready(ack(&acks, &p))
        }
    };
    let c = s.consume(&q, h_b, fast(500).with_concurrency(4).with_rate_limit_per_key(Some(rate))).await.unwrap();
    wait_acks(&acks, 7, Duration::from_secs(8)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_each_acked_once(&acks, 7);
    let a_firsts: Vec<String> = firsts(&a_started, "k").into_iter().map(|(p, _)| p).collect();
    assert!(a_firsts.starts_with(&["k0".to_string(), "k1".to_string()]), "{a_firsts:?} (stats at abort {st:?})");
    // The second consumer: k1 (the dead consumer's) once, the rest of k's line in offer order at
    // the key's rate.
    let b_k: Vec<(String, Instant)> = firsts(&starts, "k").into_iter().filter(|(p, _)| p != "k1").collect();
    let want: Vec<String> = names("k", 6).into_iter().filter(|p| !a_firsts.contains(p)).collect();
    assert_order_and_gaps("k", &b_k, &want, Duration::from_millis(100), Duration::from_millis(15));
    assert_eq!(firsts(&starts, "k1").len(), 1, "k1 redelivered to the second consumer");
    c.drain(Duration::from_secs(2)).await;
    assert_nothing_left(&s, &q).await;
}

/// Attack 5a: the queue paused while a key's line is parked (its head coming due meanwhile), then
/// resumed: offer order and spacing hold, the other key is not held back, nothing stranded.
async fn a_pause_while_a_line_is_parked_keeps_order_and_spacing(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krb-pause");
    let (starts, acks): (Starts, Acks) = Default::default();
    let h = {
        let (starts, acks) = (starts.clone(), acks.clone());
        move |d: Delivery| {
            let p = record(&starts, &d);
            std::future::ready(ack(&acks, &p))
        }
    };
    let rate = RateLimit::new(5, Duration::from_secs(1)).with_burst(1);
    let c = s.consume(&q, h, opts(rate)).await.unwrap();
    for i in 0..5 {
        s.offer_with(&q, format!("k{i}"), keyed("k")).await.unwrap();
        s.offer_with(&q, format!("m{i}"), keyed("m")).await.unwrap();
    }
    eventually(Duration::from_secs(5), || {
        let n = acks.lock().unwrap().len();
        async move { (n >= 2).then_some(()) }
    })
    .await
    .unwrap();
    s.pause(&q).await.unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    let paused_starts = starts.lock().unwrap().len();
    s.offer_with(&q, "k5", keyed("k")).await.unwrap();
    s.resume(&q).await.unwrap();
    wait_acks(&acks, 11, Duration::from_secs(8)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_each_acked_once(&acks, 11);
    assert!(paused_starts <= 4, "{paused_starts} started around the pause");
    let gap = Duration::from_millis(200);
    let tol = Duration::from_millis(15);
    assert_order_and_gaps("k", &firsts(&starts, "k"), &names("k", 6), gap, tol);
    assert_order_and_gaps("m", &firsts(&starts, "m"), &names("m", 5), gap, tol);
    c.drain(Duration::from_secs(2)).await;
    assert_nothing_left(&s, &q).await;
}

/// Attack 5b: max_concurrency 1 and 10 keys × 3 entries at 5 per second per key: the keys go
/// side by side (all done in about 2 intervals, not 10 × 2), each key spaced and in order.
async fn one_slot_for_many_keys_holds_no_key_back(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krb-maxc1");
    let (starts, acks): (Starts, Acks) = Default::default();
    let h = {
        let (starts, acks) = (starts.clone(), acks.clone());
        move |d: Delivery| {
            let p = record(&starts, &d);
            std::thread::sleep(Duration::from_millis(3));
            std::future::ready(ack(&acks, &p))
        }
    };
    let rate = RateLimit::new(5, Duration::from_secs(1)).with_burst(1);
    let c = s.consume(&q, h, opts(rate).with_max_concurrency(Some(1))).await.unwrap();
    let t0 = Instant::now();
    for i in 0..3 {
        for k in 0..10 {
            s.offer_with(&q, format!("k{k}-{i}"), keyed(&format!("k{k}"))).await.unwrap();
        }
    }
    wait_acks(&acks, 30, Duration::from_secs(8)).await;
    let took = t0.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_each_acked_once(&acks, 30);
    for k in 0..10 {
        let key = format!("k{k}-");
        let want: Vec<String> = (0..3).map(|i| format!("k{k}-{i}")).collect();
        assert_order_and_gaps(
            &key,
            &firsts(&starts, &key),
            &want,
            Duration::from_millis(200),
            Duration::from_millis(15),
        );
    }
    assert!(took < Duration::from_millis(400 + 1200), "30 entries took {took:?}");
    c.drain(Duration::from_secs(2)).await;
    assert_nothing_left(&s, &q).await;
}

/// Attack 6: two remote workers long-poll claiming at once: each key's claims in offer order, an
/// interval apart, each entry once.
async fn concurrent_remote_claims_keep_each_keys_order_and_rate(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krb-remote");
    let ro = RemoteOptions {
        claim_timeout: Duration::from_secs(30),
        max_deliveries: None,
        rate_limit_per_key: Some(RateLimit::new(5, Duration::from_secs(1)).with_burst(1)),
        ..Default::default()
    };
    let (starts, acks): (Starts, Acks) = Default::default();
    for i in 0..4 {
        for k in ["a", "b", "c"] {
            s.offer_with(&q, format!("{k}{i}"), keyed(k)).await.unwrap();
        }
    }
    let mut tasks = Vec::new();
    for w in 0..2 {
        let worker = s.remote_consumer(&q, &format!("w{w}"), ro.clone()).await.unwrap();
        let (starts, acks) = (starts.clone(), acks.clone());
        tasks.push(tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(8);
            while acks.lock().unwrap().len() < 12 && Instant::now() < deadline {
                let got = worker.claim(3, Duration::from_millis(500)).await.unwrap();
                for d in got {
                    let p = String::from_utf8_lossy(&d.payload).into_owned();
                    starts.lock().unwrap().push((p.clone(), Instant::now(), d.deliveries));
                    worker.ack(d.id, d.fence).await.unwrap();
                    ack(&acks, &p);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_each_acked_once(&acks, 12);
    for k in ["a", "b", "c"] {
        // Claim times are taken after the claim returns: a little more tolerance.
        assert_order_and_gaps(
            k,
            &firsts(&starts, k),
            &names(k, 4),
            Duration::from_millis(200),
            Duration::from_millis(40),
        );
    }
    assert_nothing_left(&s, &q).await;
}

/// Attack 7a: the line parked at 1 per second, then the consumer restarted at 20 per second:
/// the head keeps its due time, the rest follow at the new rate; nothing stranded.
async fn a_faster_rate_after_a_restart_strands_nothing(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krb-faster");
    let (starts, acks): (Starts, Acks) = Default::default();
    let mk = || {
        let (starts, acks) = (starts.clone(), acks.clone());
        move |d: Delivery| {
            let p = record(&starts, &d);
            std::future::ready(ack(&acks, &p))
        }
    };
    let slow = RateLimit::new(1, Duration::from_secs(1)).with_burst(1);
    // A short poll interval: the drain does not wait long for the read in flight.
    let c = s.consume(&q, mk(), opts(slow).with_poll_interval(Duration::from_millis(200))).await.unwrap();
    for i in 0..6 {
        s.offer_with(&q, format!("k{i}"), keyed("k")).await.unwrap();
    }
    eventually(Duration::from_secs(5), || {
        let n = acks.lock().unwrap().len();
        async move { (n >= 1).then_some(()) }
    })
    .await
    .unwrap();
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.drain(Duration::from_secs(2)).await;
    let fast_rate = RateLimit::new(20, Duration::from_secs(1)).with_burst(1);
    assert!(t0.elapsed() < Duration::from_millis(800), "the first consumer took {:?} to drain", t0.elapsed());
    let c = s.consume(&q, mk(), opts(fast_rate)).await.unwrap();
    wait_acks(&acks, 6, Duration::from_secs(6)).await;
    let took = t0.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_each_acked_once(&acks, 6);
    let got = firsts(&starts, "k");
    assert_order_and_gaps("k", &got, &names("k", 6), Duration::from_millis(50), Duration::from_millis(15));
    assert!(took < Duration::from_millis(1000 + 4 * 50 + 800), "took {took:?}");
    c.drain(Duration::from_secs(2)).await;
    assert_nothing_left(&s, &q).await;
}

/// Attack 7b: the line parked at 20 per second, the consumer restarted at 2 per second: from the
/// restart, starts are 500 ms apart.
async fn a_slower_rate_after_a_restart_spaces_at_the_new_rate(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krb-slower");
    let (starts, acks): (Starts, Acks) = Default::default();
    let gate = Arc::new(tokio::sync::Notify::new());
    let mk = |block: bool| {
        let (starts, acks, gate) = (starts.clone(), acks.clone(), gate.clone());
        move |d: Delivery| {
            let (starts, acks, gate) = (starts.clone(), acks.clone(), gate.clone());
            async move {
                let p = record(&starts, &d);
                if block && p == "k0" {
                    gate.notified().await;
                }
                ack(&acks, &p)
            }
        }
    };
    let quick = RateLimit::new(20, Duration::from_secs(1)).with_burst(1);
    let c = s.consume(&q, mk(false), opts(quick).with_concurrency(1)).await.unwrap();
    for i in 0..5 {
        s.offer_with(&q, format!("k{i}"), keyed("k")).await.unwrap();
    }
    eventually(Duration::from_secs(5), || {
        let n = acks.lock().unwrap().len();
        async move { (n >= 1).then_some(()) }
    })
    .await
    .unwrap();
    c.drain(Duration::from_secs(2)).await;
    let n_before = acks.lock().unwrap().len();
    let slow = RateLimit::new(2, Duration::from_secs(1)).with_burst(1);
    let c = s.consume(&q, mk(false), opts(slow)).await.unwrap();
    wait_acks(&acks, 5, Duration::from_secs(6)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_each_acked_once(&acks, 5);
    let got = firsts(&starts, "k");
    let order: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(order, names("k", 5), "in offer order");
    // Starts by the second consumer (after the first ones): 500 ms apart.
    let second = &got[n_before..];
    for w in second.windows(2) {
        let d = w[1].1 - w[0].1;
        assert!(d + Duration::from_millis(15) >= Duration::from_millis(500), "{} only {d:?} after {}", w[1].0, w[0].0);
    }
    c.drain(Duration::from_secs(2)).await;
    assert_nothing_left(&s, &q).await;
}

/// Attack 4: Redis restarts (AOF, every write fsynced) while 3 keys' lines are parked: every
/// entry runs (at least once; only one running at the kill may run again), each key's first
/// starts in offer order, nothing stranded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_mid_line_strands_nothing() {
    baton_testkit::require_redis();
    let server =
        Arc::new(Mutex::new(baton_testkit::RedisServer::start_with(baton_testkit::ServerOptions { appendonly: true })));
    let cfg = server.lock().unwrap().config();
    let s =
        MessageStream::redis(baton_redis::RedisClient::new(cfg).unwrap(), baton_queue::RedisQueueOptions::default())
            .await
            .unwrap();
    let q = queue_name("krb-restart");
    let (starts, acks): (Starts, Acks) = Default::default();
    let h = {
        let (starts, acks) = (starts.clone(), acks.clone());
        move |d: Delivery| {
            let p = record(&starts, &d);
            std::future::ready(ack(&acks, &p))
        }
    };
    let rate = RateLimit::new(10, Duration::from_secs(1)).with_burst(1);
    let c = s
        .consume(
            &q,
            h,
            fast(1_000)
                .with_poll_interval(Duration::from_millis(500))
                .with_concurrency(4)
                .with_rate_limit_per_key(Some(rate)),
        )
        .await
        .unwrap();
    for i in 0..10 {
        for k in ["a", "b", "c"] {
            s.offer_with(&q, format!("{k}{i}"), keyed(k)).await.unwrap();
        }
    }
    eventually(Duration::from_secs(5), || {
        let n = acks.lock().unwrap().len();
        async move { (n >= 9).then_some(()) }
    })
    .await
    .unwrap();
    let srv = server.clone();
    tokio::task::spawn_blocking(move || {
        let mut g = srv.lock().unwrap();
        g.kill();
        std::thread::sleep(Duration::from_millis(300));
        g.restart();
    })
    .await
    .unwrap();
    wait_acks(&acks, 30, Duration::from_secs(12)).await;
    for k in ["a", "b", "c"] {
        let order: Vec<String> = firsts(&starts, k).into_iter().map(|(p, _)| p).collect();
        assert_eq!(order, names(k, 10), "key {k} in offer order");
    }
    assert_nothing_left(&s, &q).await;
    c.drain(Duration::from_secs(2)).await;
}

/// Attack 3b: a consumer closed without a drain budget while its read is blocked; the key's head
/// comes due (promoted by another consumer's tick), the blocked read takes it and, stopping,
/// requeues it at the stream's tail. The head was charged when read and the next of the line
/// became the head; the requeued copy must still start before the rest of its key's line.
async fn a_head_read_while_its_consumer_closes_keeps_its_place_in_the_line(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krb-requeue");
    let (starts, acks): (Starts, Acks) = Default::default();
    let mk = || {
        let (starts, acks) = (starts.clone(), acks.clone());
        move |d: Delivery| {
            let (starts, acks) = (starts.clone(), acks.clone());
            async move {
                let p = record(&starts, &d);
                if p == "blocker" {
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                }
                ack(&acks, &p)
            }
        }
    };
    let rate = RateLimit::new(2, Duration::from_secs(1)).with_burst(1);
    // B: one slot, busy with the blocker; its poll ticks (200 ms) promote due delayed entries.
    let cb = s
        .consume(
            &q,
            mk(),
            fast(1_000)
                .with_concurrency(1)
                .with_poll_interval(Duration::from_millis(200))
                .with_rate_limit_per_key(Some(rate)),
        )
        .await
        .unwrap();
    s.offer(&q, "blocker").await.unwrap();
    eventually(Duration::from_secs(5), || {
        let n = starts.lock().unwrap().len();
        async move { (n == 1).then_some(()) }
    })
    .await
    .expect("the blocker started");
    // A: k0 starts, k1 is the head (due in 500 ms), k2 and k3 are parked; A's read then blocks.
    let ca = s.consume(&q, mk(), opts(rate)).await.unwrap();
    for i in 0..4 {
        s.offer_with(&q, format!("k{i}"), keyed("k")).await.unwrap();
    }
    eventually(Duration::from_secs(5), || {
        let n = firsts(&starts, "k0").len();
        async move { (n == 1).then_some(()) }
    })
    .await
    .expect("k0 started");
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Closed (no budget): its blocked read returns when k1 is promoted, with k1, requeued.
    let t = Instant::now();
    ca.close().await;
    let closed_after = t.elapsed();
    let st = s.stats(&q).await.unwrap();
    wait_acks(&acks, 5, Duration::from_secs(8)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_each_acked_once(&acks, 5);
    let got = firsts(&starts, "k");
    let order: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(order, names("k", 4), "k's entries in offer order (closed after {closed_after:?}, then {st:?})");
    cb.drain(Duration::from_secs(2)).await;
    assert_nothing_left(&s, &q).await;
}

/// Attack 6b: the same through `RemoteConsumer::hand_back` (a claim whose answer did not reach
/// the worker): the key's head, claimed (charged; the next of the line became the head) and
/// handed back, must still be claimed before the rest of its key's line.
async fn a_head_handed_back_by_a_remote_worker_keeps_its_place_in_the_line(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krb-handback");
    let ro = RemoteOptions {
        claim_timeout: Duration::from_secs(30),
        max_deliveries: None,
        rate_limit_per_key: Some(RateLimit::new(5, Duration::from_secs(1)).with_burst(1)),
        ..Default::default()
    };
    let w = s.remote_consumer(&q, "w", ro).await.unwrap();
    for i in 0..4 {
        s.offer_with(&q, format!("k{i}"), keyed("k")).await.unwrap();
    }
    let mut order = Vec::new();
    let mut handed_back = false;
    let deadline = Instant::now() + Duration::from_secs(8);
    while order.len() < 4 && Instant::now() < deadline {
        for d in w.claim(10, Duration::from_millis(500)).await.unwrap() {
            let p = String::from_utf8_lossy(&d.payload).into_owned();
            if p == "k1" && !handed_back {
                // The answer "did not reach the worker": back at once.
                handed_back = true;
                assert_eq!(w.hand_back(&[(d.id, d.fence)]).await.unwrap(), 1);
                continue;
            }
            w.ack(d.id, d.fence).await.unwrap();
            order.push(p);
        }
    }
    let st = s.stats(&q).await.unwrap();
    assert_eq!(order, names("k", 4), "k's entries in offer order ({st:?})");
    assert_nothing_left(&s, &q).await;
}

/// Attack 7c: a rolling change of settings: a consumer with the per-key rate limit and one
/// without it, side by side while entries keep coming (the one without releases the parked
/// entries, the other parks new ones): each entry runs once and nothing is stranded, the stats'
/// counts included.
async fn consumers_with_and_without_the_limit_side_by_side_strand_nothing(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krb-mixed");
    let (starts, acks): (Starts, Acks) = Default::default();
    let mk = || {
        let (starts, acks) = (starts.clone(), acks.clone());
        move |d: Delivery| {
            let (starts, acks) = (starts.clone(), acks.clone());
            async move {
                let p = record(&starts, &d);
                tokio::time::sleep(Duration::from_millis(20)).await;
                ack(&acks, &p)
            }
        }
    };
    let rate = RateLimit::new(5, Duration::from_secs(1)).with_burst(1);
    let with = s.consume(&q, mk(), opts(rate).with_poll_interval(Duration::from_millis(300))).await.unwrap();
    for i in 0..10 {
        for k in ["a", "b"] {
            s.offer_with(&q, format!("{k}{i}"), keyed(k)).await.unwrap();
        }
    }
    tokio::time::sleep(Duration::from_millis(250)).await;
    let without = s
        .consume(&q, mk(), fast(10_000).with_poll_interval(Duration::from_millis(300)).with_concurrency(2))
        .await
        .unwrap();
    for i in 10..20 {
        for k in ["a", "b"] {
            s.offer_with(&q, format!("{k}{i}"), keyed(k)).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    wait_acks(&acks, 40, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_each_acked_once(&acks, 40);
    without.drain(Duration::from_secs(2)).await;
    // Later entries with only the limited consumer left: still at the key's rate, nothing left.
    for i in 20..23 {
        s.offer_with(&q, format!("a{i}"), keyed("a")).await.unwrap();
    }
    wait_acks(&acks, 43, Duration::from_secs(5)).await;
    let late: Vec<(String, Instant)> =
        firsts(&starts, "a").into_iter().filter(|(p, _)| p[1..].parse::<u32>().unwrap() >= 20).collect();
    assert_order_and_gaps("a", &late, &names("a", 23)[20..], Duration::from_millis(200), Duration::from_millis(15));
    with.drain(Duration::from_secs(2)).await;
    assert_nothing_left(&s, &q).await;
    let st = s.stats(&q).await.unwrap();
    assert!(st.keys.iter().all(|k| k.rate_delayed == 0), "{st:?}");
}

/// Attack 7d: the limit removed while a key has a head in the delayed set and nothing parked
/// behind it (no line): the head runs (promoted when due) under a consumer without the limit.
/// Its key's count must not stay behind: once the limit is back, the key's new entries must not
/// be parked behind a head that is gone (never promoted: stranded).
async fn a_head_run_without_the_limit_leaves_no_phantom_that_strands_later_entries(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krb-phantom");
    let (starts, acks): (Starts, Acks) = Default::default();
    let mk = || {
        let (starts, acks) = (starts.clone(), acks.clone());
        move |d: Delivery| {
            let p = record(&starts, &d);
            std::future::ready(ack(&acks, &p))
        }
    };
    let rate = RateLimit::new(2, Duration::from_secs(1)).with_burst(1);
    let short = |o: ConsumerOptions| o.with_poll_interval(Duration::from_millis(200));
    // k0 starts, k1 is the head (due in 500 ms), nothing parked.
    let c = s.consume(&q, mk(), short(opts(rate))).await.unwrap();
    s.offer_with(&q, "k0", keyed("k")).await.unwrap();
    s.offer_with(&q, "k1", keyed("k")).await.unwrap();
    wait_acks(&acks, 1, Duration::from_secs(5)).await;
    c.drain(Duration::from_secs(2)).await;
    // Without the limit: k1 runs when due.
    let c = s.consume(&q, mk(), short(fast(10_000))).await.unwrap();
    wait_acks(&acks, 2, Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    c.drain(Duration::from_secs(2)).await;
    let st = s.stats(&q).await.unwrap();
    // The limit back: k2 and k3 run (k3 500 ms after k2).
    let c = s.consume(&q, mk(), short(opts(rate))).await.unwrap();
    s.offer_with(&q, "k2", keyed("k")).await.unwrap();
    s.offer_with(&q, "k3", keyed("k")).await.unwrap();
    let done = eventually(Duration::from_secs(4), || {
        let n = acks.lock().unwrap().len();
        async move { (n >= 4).then_some(()) }
    })
    .await;
    let st2 = s.stats(&q).await.unwrap();
    assert!(done.is_some(), "k2 and k3 stranded: {:?}; after k1 ran without the limit: {st:?}", st2);
    assert_eq!(st.key_rate_delayed, 0, "nothing delayed after k1 ran: {st:?}");
    assert_each_acked_once(&acks, 4);
    assert_order_and_gaps(
        "k",
        &firsts(&starts, "k")[2..],
        &names("k", 4)[2..],
        Duration::from_millis(500),
        Duration::from_millis(15),
    );
    c.drain(Duration::from_secs(2)).await;
    assert_nothing_left(&s, &q).await;
}

/// Attack 7e: a rolling change of the rate's value: consumers at 10 and at 4 per second per key
/// side by side. Each entry runs once, each key's in offer order, at least the faster rate's
/// interval apart, nothing stranded.
async fn consumers_with_different_rates_side_by_side_run_each_entry_once_in_order(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krb-two-rates");
    let (starts, acks): (Starts, Acks) = Default::default();
    let mk = || {
        let (starts, acks) = (starts.clone(), acks.clone());
        move |d: Delivery| {
            let p = record(&starts, &d);
            std::future::ready(ack(&acks, &p))
        }
    };
    let fast_rate = RateLimit::new(10, Duration::from_secs(1)).with_burst(1);
    let slow_rate = RateLimit::new(4, Duration::from_secs(1)).with_burst(1);
    let short = |o: ConsumerOptions| o.with_poll_interval(Duration::from_millis(300));
    let c1 = s.consume(&q, mk(), short(opts(fast_rate))).await.unwrap();
    let c2 = s.consume(&q, mk(), short(opts(slow_rate))).await.unwrap();
    for i in 0..8 {
        for k in ["a", "b"] {
            s.offer_with(&q, format!("{k}{i}"), keyed(k)).await.unwrap();
        }
    }
    wait_acks(&acks, 16, Duration::from_secs(8)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_each_acked_once(&acks, 16);
    for k in ["a", "b"] {
        assert_order_and_gaps(
            k,
            &firsts(&starts, k),
            &names(k, 8),
            Duration::from_millis(100),
            Duration::from_millis(15),
        );
    }
    c1.drain(Duration::from_secs(2)).await;
    c2.drain(Duration::from_secs(2)).await;
    assert_nothing_left(&s, &q).await;
}
