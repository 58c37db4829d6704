//! Priorities under stress (breaker tests): key slot holders (`kh`) moving through the ready set
//! leave no slot behind; delivery counts and dead letters of priority entries match priority 0;
//! a backlog of more than one read's move with three consumers runs every entry exactly once;
//! a consumer dying with priority entries taken hands them over. Every backend.

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_queue::{keys, Decision, Delivery, MessageStream, OfferOptions};
use baton_redis::redis;
use baton_testkit::{eventually, TestBackend};
use bytes::Bytes;
use common::*;

baton_testkit::on_every_backend!(
    key_slot_holders_pass_the_ready_set_without_leaking_slots,
    priority_entries_count_deliveries_like_priority_zero,
    a_big_backlog_with_three_consumers_runs_each_entry_once,
    a_dead_consumers_priority_entries_fail_over,
    keys_and_priorities_run_in_one_order_on_every_backend,
    rate_limit_and_max_concurrency_take_by_priority_exactly_once,
    binary_and_empty_payloads_pass_the_ready_set_unchanged,
    idle_consumers_wake_at_once_for_priority_offers,
    a_pause_with_entries_in_the_ready_set_takes_nothing_until_resumed,
    mixed_decisions_keys_and_caps_across_three_consumers_settle_each_entry_once,
);

fn opts(p: i8, key: Option<&str>) -> OfferOptions {
    OfferOptions { priority: p, concurrency_key: key.map(str::to_string) }
}

async fn three(b: &TestBackend) -> Vec<MessageStream> {
    let first = stream_for(b).await;
    if b.redis_config().is_none() {
        return vec![first.clone(), first.clone(), first];
    }
    vec![first, stream_for(b).await, stream_for(b).await]
}

/// (held keys, holders, waiting entries, ready set, ready entries hash fields) in Redis.
async fn leftovers(conn: &mut baton_redis::RedisConn, q: &str) -> (u64, u64, u64, u64, u64) {
    let p = keys::DEFAULT_PREFIX;
    let held: u64 = redis::cmd("HLEN").arg(keys::key_held(p, q)).query_async(conn).await.unwrap();
    let ids: u64 = redis::cmd("HLEN").arg(keys::key_holders(p, q)).query_async(conn).await.unwrap();
    let waiting: u64 = redis::cmd("ZCARD").arg(keys::key_waiting(p, q)).query_async(conn).await.unwrap();
    let ready: u64 = redis::cmd("ZCARD").arg(keys::ready(p, q)).query_async(conn).await.unwrap();
    let readyp: u64 = redis::cmd("HLEN").arg(keys::ready_entries(p, q)).query_async(conn).await.unwrap();
    (held, ids, waiting, ready, readyp)
}

type Counts = Arc<Mutex<BTreeMap<String, usize>>>;

async fn wait_total(counts: &Counts, n: usize, within: Duration) {
    eventually(within, || {
        let got: usize = counts.lock().unwrap().values().sum();
        async move { (got >= n).then_some(()) }
    })
    .await
    .unwrap_or_else(|| panic!("{n} runs expected, got {:?}", counts.lock().unwrap().values().sum::<usize>()));
}

/// 12 entries of key k (one slot) of priorities -3, 0, 3 and 6 keyless ones, offered paused, then
/// resumed with 4 handler slots: each runs exactly once, never two of k at once, and no slot,
/// holder, waiter or ready entry is left.
async fn key_slot_holders_pass_the_ready_set_without_leaking_slots(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("prio-kh");
    s.pause(&q).await.unwrap();
    let counts: Counts = Arc::default();
    let running_k = Arc::new(AtomicUsize::new(0));
    let violations = Arc::new(AtomicUsize::new(0));
    let (c2, r2, v2) = (counts.clone(), running_k.clone(), violations.clone());
    let h = move |d: Delivery| {
        let (counts, running, violations) = (c2.clone(), r2.clone(), v2.clone());
        async move {
            let p = String::from_utf8_lossy(&d.payload).into_owned();
            let keyed = p.starts_with('k');
            if keyed && running.fetch_add(1, Ordering::SeqCst) != 0 {
                violations.fetch_add(1, Ordering::SeqCst);
            }
            tokio::time::sleep(Duration::from_millis(15)).await;
            if keyed {
                running.fetch_sub(1, Ordering::SeqCst);
            }
            *counts.lock().unwrap().entry(p).or_default() += 1;
            Decision::Ack
        }
    };
    let c = s.consume(&q, h, fast(5_000).with_concurrency(4).with_concurrency_per_key(Some(1))).await.unwrap();
    for i in 0..12 {
        s.offer_with(&q, format!("k{i}"), opts((i % 3) as i8 * 3 - 3, Some("k"))).await.unwrap();
    }
    for i in 0..6 {
        s.offer_with(&q, format!("f{i}"), opts((i % 2) as i8 * 5, None)).await.unwrap();
    }
    s.resume(&q).await.unwrap();
    wait_total(&counts, 18, Duration::from_secs(20)).await;
    // More k entries while slots are being handed on, of both priorities.
    for i in 12..20 {
        s.offer_with(&q, format!("k{i}"), opts((i % 2) as i8 * 4, Some("k"))).await.unwrap();
    }
    wait_total(&counts, 26, Duration::from_secs(20)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let counts = counts.lock().unwrap().clone();
    assert_eq!(counts.len(), 26, "{counts:?}");
    assert!(counts.values().all(|n| *n == 1), "each exactly once: {counts:?}");
    assert_eq!(violations.load(Ordering::SeqCst), 0, "two entries of k ran at once");
    c.drain(Duration::from_secs(2)).await;
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.lag), (0, 0, 0), "{st:?}");
    if let Some(mut conn) = conn_for(&b).await {
        assert_eq!(leftovers(&mut conn, &q).await, (0, 0, 0, 0, 0), "nothing left behind");
    }
}

/// An entry of priority 5 and one of priority 0 with max_deliveries 3, retried (counted), once
/// retried after longer than the claim timeout (through the delayed set, then the ready set, its
/// count carried): both see the same deliveries and end as dead letters with the same count.
async fn priority_entries_count_deliveries_like_priority_zero(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("prio-dc");
    let seen: Arc<Mutex<Vec<(String, u32)>>> = Arc::default();
    let s2 = seen.clone();
    let h = move |d: Delivery| {
        let seen = s2.clone();
        async move {
            let p = String::from_utf8_lossy(&d.payload).into_owned();
            let mut seen = seen.lock().unwrap();
            let waited = seen.iter().any(|(n, dc)| *n == p && *dc == 2);
            seen.push((p, d.deliveries));
            // Delivery 2 waits once in the delayed set (then passes the ready set again).
            if d.deliveries == 2 && !waited {
                Decision::RetryAfter(Duration::from_millis(1_200))
            } else {
                Decision::Retry
            }
        }
    };
    let c = s.consume(&q, h, fast(1_000).with_max_deliveries(Some(3))).await.unwrap();
    s.offer_with(&q, "p5", opts(5, None)).await.unwrap();
    s.offer_with(&q, "p0", opts(0, None)).await.unwrap();
    let (s3, q3) = (s.clone(), q.clone());
    eventually(Duration::from_secs(25), || {
        let (s, q) = (s3.clone(), q3.clone());
        async move { (s.dead_letters(&q, 10).await.unwrap().len() == 2).then_some(()) }
    })
    .await
    .unwrap_or_else(|| panic!("both dead-lettered; seen {:?}", seen.lock().unwrap()));
    c.drain(Duration::from_secs(2)).await;
    let seen = seen.lock().unwrap().clone();
    let of = |p: &str| seen.iter().filter(|(n, _)| n == p).map(|(_, d)| *d).collect::<Vec<u32>>();
    assert_eq!(of("p5"), [1, 2, 2, 3], "{seen:?}");
    assert_eq!(of("p0"), [1, 2, 2, 3], "{seen:?}");
    let mut dead: Vec<(String, u32)> = s
        .dead_letters(&q, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|d| (String::from_utf8_lossy(&d.payload).into_owned(), d.deliveries))
        .collect();
    dead.sort();
    assert_eq!(dead, [("p0".to_string(), 3), ("p5".to_string(), 3)]);
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.lag, st.delayed), (0, 0, 0, 0), "{st:?}");
}

/// 600 entries of priority 0, then 3 of priority 7, then three consumers (8 slots each) while 40
/// more of priority 3 arrive mid-run: every one of the 643 runs exactly once, the 3 of priority
/// 7 among the first starts, and nothing is left.
async fn a_big_backlog_with_three_consumers_runs_each_entry_once(b: TestBackend) {
    let streams = three(&b).await;
    let q = queue_name("prio-backlog");
    let payloads: Vec<Bytes> = (0..600).map(|i| Bytes::from(format!("z{i}"))).collect();
    for chunk in payloads.chunks(100) {
        streams[0].offer_batch(&q, chunk.to_vec()).await.unwrap();
    }
    for i in 0..3 {
        streams[0].offer_with(&q, format!("h{i}"), opts(7, None)).await.unwrap();
    }
    let counts: Counts = Arc::default();
    let order: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut consumers = Vec::new();
    for s in &streams {
        let (c2, o2) = (counts.clone(), order.clone());
        let h = move |d: Delivery| {
            let (counts, order) = (c2.clone(), o2.clone());
            async move {
                let p = String::from_utf8_lossy(&d.payload).into_owned();
                order.lock().unwrap().push(p.clone());
                tokio::time::sleep(Duration::from_millis(1)).await;
                *counts.lock().unwrap().entry(p).or_default() += 1;
                Decision::Ack
            }
        };
        consumers.push(s.consume(&q, h, fast(5_000).with_concurrency(8)).await.unwrap());
    }
    wait_total(&counts, 100, Duration::from_secs(20)).await;
    for i in 0..40 {
        streams[i % 3].offer_with(&q, format!("m{i}"), opts(3, None)).await.unwrap();
    }
    wait_total(&counts, 643, Duration::from_secs(25)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for c in consumers {
        c.drain(Duration::from_secs(2)).await;
    }
    let counts = counts.lock().unwrap().clone();
    assert_eq!(counts.len(), 643);
    let dup: Vec<_> = counts.iter().filter(|(_, n)| **n != 1).collect();
    assert!(dup.is_empty(), "each exactly once: {dup:?}");
    let order = order.lock().unwrap().clone();
    let first: Vec<&String> = order.iter().take(24).collect();
    for i in 0..3 {
        assert!(first.contains(&&format!("h{i}")), "h{i} among the first starts: {first:?}");
    }
    let st = streams[0].stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.lag), (0, 0, 0), "{st:?}");
    if let Some(mut conn) = conn_for(&b).await {
        assert_eq!(leftovers(&mut conn, &q).await, (0, 0, 0, 0, 0), "nothing left behind");
    }
}

/// A consumer takes 3 of 10 mixed-priority entries and dies (abort: as if killed); another one
/// runs all 10 exactly once (the 3 after the claim timeout).
async fn a_dead_consumers_priority_entries_fail_over(b: TestBackend) {
    let streams = three(&b).await;
    let q = queue_name("prio-dead");
    streams[0].pause(&q).await.unwrap();
    let (a, _started) = hanging_consumer(&streams[0], &q, fast(1_000).with_concurrency(3)).await;
    for i in 0..10 {
        streams[0].offer_with(&q, format!("e{i}"), opts((i % 4) as i8 - 1, None)).await.unwrap();
    }
    streams[0].resume(&q).await.unwrap();
    let (s0, q0) = (streams[0].clone(), q.clone());
    eventually(Duration::from_secs(5), || {
        let (s, q) = (s0.clone(), q0.clone());
        async move { (s.stats(&q).await.unwrap().pending == 3).then_some(()) }
    })
    .await
    .expect("A took 3");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let st = streams[0].stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.lag), (10, 3, 7), "{st:?}");
    a.abort();
    let counts: Counts = Arc::default();
    let c2 = counts.clone();
    let h = move |d: Delivery| {
        let counts = c2.clone();
        async move {
            *counts.lock().unwrap().entry(String::from_utf8_lossy(&d.payload).into_owned()).or_default() += 1;
            Decision::Ack
        }
    };
    let c = streams[1].consume(&q, h, fast(1_000).with_concurrency(2)).await.unwrap();
    wait_total(&counts, 10, Duration::from_secs(20)).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    c.drain(Duration::from_secs(2)).await;
    let counts = counts.lock().unwrap().clone();
    assert_eq!(counts.len(), 10, "{counts:?}");
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
    let st = streams[0].stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.lag), (0, 0, 0), "{st:?}");
    if let Some(mut conn) = conn_for(&b).await {
        assert_eq!(leftovers(&mut conn, &q).await, (0, 0, 0, 0, 0), "nothing left behind");
    }
}

/// A Redis restart (AOF, every write fsynced) twice mid-run while 300 entries of mixed priorities
/// go through the ready set: none is lost (each runs at least once; only entries running at a
/// kill may run again), and nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarts_mid_run_lose_no_priority_entry() {
    baton_testkit::require_redis();
    let server =
        Arc::new(Mutex::new(baton_testkit::RedisServer::start_with(baton_testkit::ServerOptions { appendonly: true })));
    let cfg = server.lock().unwrap().config();
    let s =
        MessageStream::redis(baton_redis::RedisClient::new(cfg).unwrap(), baton_queue::RedisQueueOptions::default())
            .await
            .unwrap();
    let q = queue_name("prio-restart");
    s.pause(&q).await.unwrap();
    for i in 0..300 {
        s.offer_with(&q, format!("e{i}"), opts((i % 7) as i8 - 3, None)).await.unwrap();
    }
    let counts: Counts = Arc::default();
    let c2 = counts.clone();
    let h = move |d: Delivery| {
        let counts = c2.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            *counts.lock().unwrap().entry(String::from_utf8_lossy(&d.payload).into_owned()).or_default() += 1;
            Decision::Ack
        }
    };
    let c = s.consume(&q, h, fast(1_000).with_concurrency(2)).await.unwrap();
    s.resume(&q).await.unwrap();
    for _ in 0..2 {
        let n: usize = counts.lock().unwrap().values().sum();
        wait_total(&counts, n + 40, Duration::from_secs(20)).await;
        let srv = server.clone();
        tokio::task::spawn_blocking(move || {
            let mut g = srv.lock().unwrap();
            g.kill();
            std::thread::sleep(Duration::from_millis(200));
            g.restart();
        })
        .await
        .unwrap();
    }
    eventually(Duration::from_secs(25), || {
        let n = counts.lock().unwrap().len();
        async move { (n == 300).then_some(()) }
    })
    .await
    .unwrap_or_else(|| panic!("all 300 ran; got {}", counts.lock().unwrap().len()));
    let (s2, q2) = (s.clone(), q.clone());
    let st = eventually(Duration::from_secs(10), || {
        let (s, q) = (s2.clone(), q2.clone());
        async move {
            let st = s.stats(&q).await.ok()?;
            (st.length == 0 && st.pending == 0).then_some(st)
        }
    })
    .await;
    c.drain(Duration::from_secs(2)).await;
    assert!(st.is_some(), "queue empty after the run: {:?}", s.stats(&q).await);
    let again: Vec<_> = counts.lock().unwrap().iter().filter(|(_, n)| **n > 1).map(|(p, n)| (p.clone(), *n)).collect();
    assert!(again.len() <= 4, "at most the entries running at the two kills run again: {again:?}");
    let cfg = server.lock().unwrap().config();
    let mut conn = baton_redis::RedisClient::new(cfg).unwrap().shared().await.unwrap();
    assert_eq!(leftovers(&mut conn, &q).await, (0, 0, 0, 0, 0));
}

/// One handler slot, one slot per key: entries of key k and keyless ones of mixed priorities,
/// offered paused, run in one exact order on every backend (by priority; a keyed entry whose key
/// is busy waits in its key's line and keeps its priority when its slot comes).
async fn keys_and_priorities_run_in_one_order_on_every_backend(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("prio-keys-order");
    s.pause(&q).await.unwrap();
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let r2 = runs.clone();
    let h = move |d: Delivery| {
        let runs = r2.clone();
        async move {
            runs.lock().unwrap().push(String::from_utf8_lossy(&d.payload).into_owned());
            tokio::time::sleep(Duration::from_millis(20)).await;
            Decision::Ack
        }
    };
    let c = s.consume(&q, h, fast(5_000).with_concurrency(1).with_concurrency_per_key(Some(1))).await.unwrap();
    let plan: [(&str, i8, Option<&str>); 8] = [
        ("a", 0, Some("k")),
        ("b", 5, Some("k")),
        ("c", 9, Some("k")),
        ("x", 1, None),
        ("y", -2, Some("k")),
        ("z", 9, None),
        ("m", 5, Some("m")),
        ("n", 0, Some("m")),
    ];
    for (name, p, k) in plan {
        s.offer_with(&q, name, opts(p, k)).await.unwrap();
    }
    s.resume(&q).await.unwrap();
    eventually(Duration::from_secs(20), || {
        let n = runs.lock().unwrap().len();
        async move { (n >= 8).then_some(()) }
    })
    .await
    .unwrap_or_else(|| panic!("8 runs; got {:?}", runs.lock().unwrap()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.drain(Duration::from_secs(2)).await;
    assert_eq!(*runs.lock().unwrap(), ["c", "z", "b", "m", "x", "a", "n", "y"], "{}", b.name());
}

/// A rate limit of one entry per 40 ms (burst 1) and max_concurrency 2 over 4 handler slots: 14
/// entries of mixed priorities, offered paused, start one by one in priority order (FIFO within),
/// never more than 2 at once, each exactly once, while 6 more of priority 8 arrive mid-run and
/// start before every waiting lower one.
async fn rate_limit_and_max_concurrency_take_by_priority_exactly_once(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("prio-rate");
    s.pause(&q).await.unwrap();
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (r2, n2, m2) = (runs.clone(), running.clone(), most.clone());
    let h = move |d: Delivery| {
        let (runs, running, most) = (r2.clone(), n2.clone(), m2.clone());
        async move {
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            runs.lock().unwrap().push(String::from_utf8_lossy(&d.payload).into_owned());
            tokio::time::sleep(Duration::from_millis(30)).await;
            running.fetch_sub(1, Ordering::SeqCst);
            Decision::Ack
        }
    };
    let rate = baton_queue::RateLimit::new(1, Duration::from_millis(40)).with_burst(1);
    let o = fast(5_000).with_concurrency(4).with_max_concurrency(Some(2)).with_rate_limit(Some(rate));
    let c = s.consume(&q, h, o).await.unwrap();
    let prios: [i8; 14] = [0, 3, -1, 3, 7, 0, -1, 7, 2, 0, 3, -5, 2, 7];
    for (i, p) in prios.iter().enumerate() {
        s.offer_with(&q, format!("{p}/{i}"), opts(*p, None)).await.unwrap();
    }
    s.resume(&q).await.unwrap();
    eventually(Duration::from_secs(10), || {
        let n = runs.lock().unwrap().len();
        async move { (n >= 3).then_some(()) }
    })
    .await
    .expect("3 started");
    for i in 0..6 {
        s.offer_with(&q, format!("8/x{i}"), opts(8, None)).await.unwrap();
    }
    eventually(Duration::from_secs(15), || {
        let n = runs.lock().unwrap().len();
        async move { (n >= 20).then_some(()) }
    })
    .await
    .unwrap_or_else(|| panic!("20 runs; got {:?}", runs.lock().unwrap()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.drain(Duration::from_secs(2)).await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 20, "{runs:?}");
    let mut sorted = runs.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 20, "each exactly once: {runs:?}");
    assert!(most.load(Ordering::SeqCst) <= 2, "max_concurrency 2 held: {}", most.load(Ordering::SeqCst));
    // Before the 8s arrived: the best three, in order.
    assert_eq!(runs[..3], ["7/4", "7/7", "7/13"], "{runs:?}");
    // The 8s start before every lower one still waiting, in offer order.
    let x: Vec<usize> = (0..6).map(|i| runs.iter().position(|r| *r == format!("8/x{i}")).unwrap()).collect();
    assert!(x.windows(2).all(|w| w[0] < w[1]), "{runs:?}");
    // Everything after the first 8 (but the 8s) is in priority, then offer, order.
    let rest: Vec<&String> = runs[x[0]..].iter().filter(|r| !r.starts_with("8/")).collect();
    let mut want = rest.clone();
    want.sort_by_key(|r| {
        let (p, i) = r.split_once('/').unwrap();
        (-p.parse::<i32>().unwrap(), i.parse::<u32>().unwrap())
    });
    assert_eq!(rest, want, "{runs:?}");
    assert!(x[5] < x[0] + 8, "the 8s are not held back behind lower ones: {runs:?}");
}

/// Payloads of every byte value (NUL, invalid UTF-8), an empty one and a 1 MiB one pass the
/// ready set (packed and unpacked) byte for byte, in priority order.
async fn binary_and_empty_payloads_pass_the_ready_set_unchanged(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("prio-bytes");
    s.pause(&q).await.unwrap();
    let all: Vec<u8> = (0..=255u8).rev().chain(0..=255u8).collect();
    let big: Vec<u8> = (0..1_048_576u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    let plan: Vec<(Vec<u8>, i8)> =
        vec![(b"low".to_vec(), -1), (all.clone(), 4), (Vec::new(), 2), (big.clone(), 3), (b"0".to_vec(), 0)];
    for (p, pr) in &plan {
        s.offer_with(&q, Bytes::from(p.clone()), opts(*pr, None)).await.unwrap();
    }
    let got: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let g2 = got.clone();
    let h = move |d: Delivery| {
        let got = g2.clone();
        async move {
            got.lock().unwrap().push(d.payload.to_vec());
            Decision::Ack
        }
    };
    let c = s.consume(&q, h, fast(5_000).with_concurrency(1)).await.unwrap();
    s.resume(&q).await.unwrap();
    eventually(Duration::from_secs(15), || {
        let n = got.lock().unwrap().len();
        async move { (n >= 5).then_some(()) }
    })
    .await
    .expect("5 runs");
    c.drain(Duration::from_secs(2)).await;
    let got = got.lock().unwrap().clone();
    let want: Vec<Vec<u8>> = vec![all, big, Vec::new(), b"0".to_vec(), b"low".to_vec()];
    assert_eq!(got.len(), 5);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(g == w, "run {i}: {} bytes, want {} bytes", g.len(), w.len());
    }
}

/// Three idle consumers (one slot each, long claim timeout and poll interval: no tick near)
/// blocked waiting: each of three priority offers in a row starts at once on an idle one (its
/// doorbell rings), not at a poll; then, with all three busy, the next offers wait in the ready set and start as the slots
/// free one by one, by priority.
async fn idle_consumers_wake_at_once_for_priority_offers(b: TestBackend) {
    let streams = three(&b).await;
    let q = queue_name("prio-bell");
    type Starts = Arc<Mutex<Vec<(String, std::time::Instant)>>>;
    let starts: Starts = Arc::default();
    let mut consumers = Vec::new();
    for s in &streams {
        let st = starts.clone();
        let h = move |d: Delivery| {
            let st = st.clone();
            async move {
                let p = String::from_utf8_lossy(&d.payload).into_owned();
                st.lock().unwrap().push((p.clone(), std::time::Instant::now()));
                // The three first ones end 400 ms apart.
                let ms = match p.as_str() {
                    "a2" => 1_200,
                    "a5" => 1_600,
                    "a1" => 2_000,
                    _ => 100,
                };
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Decision::Ack
            }
        };
        // A read blocks up to poll_interval: 10 s, so only the doorbell can wake one sooner.
        let o = fast(30_000).with_concurrency(1).with_poll_interval(Duration::from_secs(10));
        consumers.push(s.consume(&q, h, o).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for (i, p) in [2i8, 5, 1].into_iter().enumerate() {
        let t0 = std::time::Instant::now();
        streams[i].offer_with(&q, format!("a{p}"), opts(p, None)).await.unwrap();
        let st = starts.clone();
        let at = eventually(Duration::from_secs(5), || {
            let st = st.clone();
            async move { st.lock().unwrap().get(i).map(|(_, at)| *at) }
        })
        .await
        .unwrap_or_else(|| panic!("a{p} started"));
        let took = at.duration_since(t0);
        assert!(
            took < Duration::from_millis(2_000),
            "a{p} started {took:?} after its offer on an idle consumer (no tick near: the doorbell must wake it)"
        );
    }
    for (i, p) in [0i8, 7, -1].into_iter().enumerate() {
        streams[i].offer_with(&q, format!("b{p}"), opts(p, None)).await.unwrap();
    }
    eventually(Duration::from_secs(10), || {
        let n = starts.lock().unwrap().len();
        async move { (n >= 6).then_some(()) }
    })
    .await
    .unwrap_or_else(|| panic!("6 starts; got {:?}", starts.lock().unwrap()));
    let got: Vec<String> = starts.lock().unwrap().iter().map(|(p, _)| p.clone()).collect();
    assert_eq!(got, ["a2", "a5", "a1", "b7", "b0", "b-1"]);
    for c in consumers {
        c.drain(Duration::from_secs(1)).await;
    }
}

/// One slot; 10 entries of mixed priorities; paused after 3 have started (the other 7 wait in
/// the ready set): nothing more starts while paused, stats count the 7 as length and lag; after
/// the resume the 7 (and 2 offered while paused) run in priority order.
async fn a_pause_with_entries_in_the_ready_set_takes_nothing_until_resumed(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("prio-pause");
    s.pause(&q).await.unwrap();
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let r2 = runs.clone();
    let h = move |d: Delivery| {
        let runs = r2.clone();
        async move {
            runs.lock().unwrap().push(String::from_utf8_lossy(&d.payload).into_owned());
            tokio::time::sleep(Duration::from_millis(150)).await;
            Decision::Ack
        }
    };
    let c = s.consume(&q, h, fast(5_000).with_concurrency(1)).await.unwrap();
    let prios: [i8; 10] = [0, 4, -2, 4, 9, 1, 0, -2, 6, 1];
    for (i, p) in prios.iter().enumerate() {
        s.offer_with(&q, format!("{p}/{i}"), opts(*p, None)).await.unwrap();
    }
    s.resume(&q).await.unwrap();
    eventually(Duration::from_secs(10), || {
        let n = runs.lock().unwrap().len();
        async move { (n >= 3).then_some(()) }
    })
    .await
    .expect("3 started");
    s.pause(&q).await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let during = runs.lock().unwrap().len();
    assert!(during <= 4, "at most the one taken before the pause started: {:?}", runs.lock().unwrap());
    s.offer_with(&q, "5/x", opts(5, None)).await.unwrap();
    s.offer(&q, "0/y").await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(runs.lock().unwrap().len(), during, "nothing starts while paused");
    let st = s.stats(&q).await.unwrap();
    let left = 12 - during as u64;
    assert_eq!((st.length, st.lag, st.pending), (left, left, 0), "{st:?}");
    s.resume(&q).await.unwrap();
    eventually(Duration::from_secs(10), || {
        let n = runs.lock().unwrap().len();
        async move { (n >= 12).then_some(()) }
    })
    .await
    .unwrap_or_else(|| panic!("12 runs; got {:?}", runs.lock().unwrap()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.drain(Duration::from_secs(2)).await;
    let runs = runs.lock().unwrap().clone();
    let before: Vec<&str> = runs[..during].iter().map(String::as_str).collect();
    assert_eq!(before, ["9/4", "6/8", "4/1", "4/3"][..during], "{runs:?}");
    let mut want: Vec<String> = runs[during..].to_vec();
    want.sort_by_key(|r| {
        let (p, i) = r.split_once('/').unwrap();
        (-p.parse::<i32>().unwrap(), i.parse::<u32>().unwrap_or(100 + i.len() as u32 + (i == "y") as u32))
    });
    assert_eq!(runs[during..], want[..], "{runs:?}");
    assert_eq!(runs.len(), 12);
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.lag, st.pending), (0, 0, 0), "{st:?}");
}

/// Three consumers (max_concurrency 3, one slot per key, 3 handler slots each) over 80 entries of
/// 4 keys and none, priorities -3..=3, while handlers answer Retry (first delivery of 15, 45 and
/// 75: each holds key a's slot until reclaimed), a long RetryAfter (once for every 7th),
/// DeadLetter (every 11th) or Ack: each entry is acked or dead-lettered exactly once, never two
/// of one key or more than 3 run at once, and no slot, holder, waiter or ready entry is left.
async fn mixed_decisions_keys_and_caps_across_three_consumers_settle_each_entry_once(b: TestBackend) {
    let streams = three(&b).await;
    let q = queue_name("prio-mixed");
    let acked: Counts = Arc::default();
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let per_key: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let violations = Arc::new(AtomicUsize::new(0));
    let waited: Arc<Mutex<std::collections::BTreeSet<u32>>> = Arc::default();
    let mut consumers = Vec::new();
    for s in &streams {
        let (a2, r2, m2, k2, v2) = (acked.clone(), running.clone(), most.clone(), per_key.clone(), violations.clone());
        let w2 = waited.clone();
        let h = move |d: Delivery| {
            let (acked, running, most, per_key, violations) =
                (a2.clone(), r2.clone(), m2.clone(), k2.clone(), v2.clone());
            let waited = w2.clone();
            async move {
                let p = String::from_utf8_lossy(&d.payload).into_owned();
                let (i, key) = p.split_once('/').unwrap();
                let i: u32 = i.parse().unwrap();
                let key = key.to_string();
                most.fetch_max(running.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                if key != "-" {
                    let mut pk = per_key.lock().unwrap();
                    let n = pk.entry(key.clone()).or_default();
                    *n += 1;
                    if *n > 1 {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                }
                tokio::time::sleep(Duration::from_millis(5 + (i as u64 * 7) % 20)).await;
                if key != "-" {
                    *per_key.lock().unwrap().get_mut(&key).unwrap() -= 1;
                }
                running.fetch_sub(1, Ordering::SeqCst);
                if i.is_multiple_of(11) {
                    *acked.lock().unwrap().entry(p).or_default() += 1;
                    return Decision::DeadLetter("poison".into());
                }
                if d.deliveries == 1 && i % 30 == 15 {
                    return Decision::Retry;
                }
                // RetryAfter does not count as a delivery: once per entry.
                if i.is_multiple_of(7) && waited.lock().unwrap().insert(i) {
                    return Decision::RetryAfter(Duration::from_millis(1_200));
                }
                *acked.lock().unwrap().entry(p).or_default() += 1;
                Decision::Ack
            }
        };
        let o = fast(1_000).with_concurrency(3).with_max_concurrency(Some(3)).with_concurrency_per_key(Some(1));
        consumers.push(s.consume(&q, h, o).await.unwrap());
    }
    let keys = ["a", "b", "c", "d", "-"];
    for i in 0..80u32 {
        let key = keys[(i % 5) as usize];
        let k = (key != "-").then_some(key);
        streams[(i % 3) as usize].offer_with(&q, format!("{i}/{key}"), opts((i % 7) as i8 - 3, k)).await.unwrap();
    }
    let a2 = acked.clone();
    eventually(Duration::from_secs(25), || {
        let n: usize = a2.lock().unwrap().values().sum();
        async move { (n >= 80).then_some(()) }
    })
    .await
    .unwrap_or_else(|| {
        let got = acked.lock().unwrap();
        let missing: Vec<u32> =
            (0..80).filter(|i| !got.keys().any(|k| k.split('/').next() == Some(&i.to_string()))).collect();
        panic!("80 settled; missing {missing:?}")
    });
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for c in consumers {
        c.drain(Duration::from_secs(2)).await;
    }
    let acked = acked.lock().unwrap().clone();
    assert_eq!(acked.len(), 80, "{acked:?}");
    let twice: Vec<_> = acked.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "settled more than once: {twice:?}");
    assert_eq!(violations.load(Ordering::SeqCst), 0, "two of one key at once");
    assert!(most.load(Ordering::SeqCst) <= 3, "max_concurrency 3: {}", most.load(Ordering::SeqCst));
    let dead = streams[0].dead_letters(&q, 100).await.unwrap();
    assert_eq!(dead.len(), 8, "0, 11, …, 77");
    let st = streams[0].stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.lag, st.delayed), (0, 0, 0, 0), "{st:?}");
    if let Some(mut conn) = conn_for(&b).await {
        assert_eq!(leftovers(&mut conn, &q).await, (0, 0, 0, 0, 0), "nothing left behind");
    }
}
