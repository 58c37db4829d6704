//! The per-key rate limit (`ConsumerOptions::rate_limit_per_key`): GCRA per concurrency key, an
//! entry over its key's rate waits in the delayed set (never pending, never in front of other
//! keys' entries) and comes back at the time reserved for it. Memory, Redis standalone and
//! Cluster.

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_queue::{keys, ConsumerOptions, Decision, Delivery, KeyStats, OfferOptions, RateLimit, RemoteOptions};
use baton_queue::{MessageStream, RedisQueueOptions};
use baton_redis::{redis, RedisClient, RedisConfig};
use baton_testkit::TestBackend;
use baton_testkit::{require_redis, RedisServer};
use common::*;

baton_testkit::on_every_backend!(
    each_key_is_spaced_by_its_rate_and_other_keys_are_not_held_back,
    a_burst_starts_at_once_then_one_per_interval,
    with_concurrency_per_key_keys_run_alone_in_order_and_at_their_rate,
    bad_per_key_rate_limits_are_refused,
    stats_count_each_keys_active_waiting_and_rate_delayed_entries,
    a_remote_workers_claims_keep_each_keys_rate,
    an_entry_delayed_for_its_keys_rate_keeps_its_priority,
    entries_that_came_due_while_every_slot_was_busy_start_at_the_keys_rate,
    a_removed_per_key_rate_limit_strands_no_parked_entry,
);

fn keyed(k: &str) -> OfferOptions {
    OfferOptions { concurrency_key: Some(k.to_string()), ..Default::default() }
}

/// Handler starts: payload → when it started.
type Starts = Arc<Mutex<Vec<(String, Instant)>>>;

fn recorder(starts: &Starts, work: Duration) -> impl Fn(Delivery) -> std::future::Ready<Decision> + Clone {
    let starts = starts.clone();
    move |d: Delivery| {
        starts.lock().unwrap().push((String::from_utf8_lossy(&d.payload).into_owned(), Instant::now()));
        if !work.is_zero() {
            std::thread::sleep(work);
        }
        std::future::ready(Decision::Ack)
    }
}

/// The starts of the payloads beginning with `prefix`, in start order.
fn of(starts: &Starts, prefix: &str) -> Vec<(String, Instant)> {
    starts.lock().unwrap().iter().filter(|(p, _)| p.starts_with(prefix)).cloned().collect()
}

fn opts(rate: RateLimit) -> ConsumerOptions {
    // A poll interval longer than the key's interval: entries delayed for their key's rate must
    // be promoted at their due time, not at the next poll.
    fast(10_000).with_poll_interval(Duration::from_secs(2)).with_concurrency(8).with_rate_limit_per_key(Some(rate))
}

/// Every start of one key at least `gap` after the one before (less `tol`), the i-th at least
/// i·gap after the first (less `tol`), in offer order.
fn assert_spaced(name: &str, got: &[(String, Instant)], n: usize, gap: Duration, tol: Duration) {
    let order: Vec<&str> = got.iter().map(|(p, _)| p.as_str()).collect();
    let want: Vec<String> = (0..n).map(|i| format!("{name}{i}")).collect();
    assert_eq!(order, want, "key {name}: each once, in offer order");
    let t0 = got[0].1;
    for i in 1..n {
        let d = got[i].1 - got[i - 1].1;
        assert!(d + tol >= gap, "key {name}: start {i} only {d:?} after start {}", i - 1);
        let since = got[i].1 - t0;
        assert!(since + tol >= gap * i as u32, "key {name}: start {i} at {since:?} after the first");
    }
}

async fn each_key_is_spaced_by_its_rate_and_other_keys_are_not_held_back(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krate-spacing");
    let starts: Starts = Arc::default();
    // 5 per second per key, burst 1: a key's entries start 200 ms apart.
    let rate = RateLimit::new(5, Duration::from_secs(1)).with_burst(1);
    let c = s.consume(&q, recorder(&starts, Duration::ZERO), opts(rate)).await.unwrap();
    for i in 0..20 {
        s.offer_with(&q, format!("a{i}"), keyed("a")).await.unwrap();
    }
    let b_offered = Instant::now();
    for i in 0..20 {
        s.offer_with(&q, format!("b{i}"), keyed("b")).await.unwrap();
    }
    let free_offered = Instant::now();
    for i in 0..5 {
        s.offer(&q, format!("n{i}")).await.unwrap();
    }
    // Key a's backlog waits in the delayed set, not pending and not in front of anything.
    eventually(Duration::from_secs(5), || {
        let n = of(&starts, "n").len();
        async move { (n == 5).then_some(()) }
    })
    .await
    .expect("the entries without a key ran");
    let st = s.stats(&q).await.unwrap();
    assert!(st.delayed >= 30, "a's and b's backlogs wait in the delayed set: {st:?}");
    assert!(st.pending <= 2, "delayed entries are not pending: {st:?}");
    eventually(Duration::from_secs(15), || {
        let n = starts.lock().unwrap().len();
        async move { (n >= 45).then_some(()) }
    })
    .await
    .expect("all 45 ran");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(starts.lock().unwrap().len(), 45, "each entry runs once");
    let (a, bb, n) = (of(&starts, "a"), of(&starts, "b"), of(&starts, "n"));
    let tol = Duration::from_millis(30);
    assert_spaced("a", &a, 20, Duration::from_millis(200), tol);
    assert_spaced("b", &bb, 20, Duration::from_millis(200), tol);
    // Key b is not held back by a's backlog: its first entry starts at once, and it is done about
    // when a is (19 intervals after its first start), not 20 intervals after a.
    assert!(
        bb[0].1 - b_offered < Duration::from_millis(500),
        "b's first started {:?} after its offer",
        bb[0].1 - b_offered
    );
    let last_gap = bb[19].1.saturating_duration_since(a[19].1);
    assert!(last_gap < Duration::from_secs(1), "b finished {last_gap:?} after a");
    // Entries without a key are not limited by it.
    for (p, at) in &n {
        assert!(
            *at - free_offered < Duration::from_millis(500),
            "{p} started {:?} after its offer",
            *at - free_offered
        );
    }
    // Promoted on time: a's 20 starts span 19 intervals, plus at most a few promotion delays
    // (not a poll interval each).
    let span = a[19].1 - a[0].1;
    assert!(span < Duration::from_millis(3800 + 1000), "a's starts spanned {span:?}");
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.delayed, st.key_rate_delayed), (0, 0, 0, 0), "{st:?}");
    // Redis: the keys' rate states are removed by later reads once their tat has passed (only the
    // total's field, 0, and the line's sequence stay).
    if let Some(conn) = conn_for(&b).await {
        let krate = keys::key_rate(keys::DEFAULT_PREFIX, &q);
        let exp = keys::key_rate_expiry(keys::DEFAULT_PREFIX, &q);
        let left = eventually(Duration::from_secs(8), || {
            let mut conn = conn.clone();
            let (krate, exp) = (krate.clone(), exp.clone());
            async move {
                let mut fields: HashMap<String, String> =
                    redis::cmd("HGETALL").arg(&krate).query_async(&mut conn).await.unwrap();
                // The line's sequence counter stays (it only ever grows).
                fields.remove("\0s");
                let n: u64 = redis::cmd("ZCARD").arg(&exp).query_async(&mut conn).await.unwrap();
                (fields.len() == 1 && n == 0).then_some(fields)
            }
        })
        .await;
        let want: HashMap<String, String> = [("\0n".to_string(), "0".to_string())].into();
        assert_eq!(left, Some(want), "stale per-key rate states removed");
    }
    c.drain(Duration::from_secs(2)).await;
}

async fn a_burst_starts_at_once_then_one_per_interval(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krate-burst");
    let starts: Starts = Arc::default();
    // 10 per second per key, burst 3: three at once, then 100 ms apart.
    let rate = RateLimit::new(10, Duration::from_secs(1)).with_burst(3);
    let c = s.consume(&q, recorder(&starts, Duration::ZERO), opts(rate)).await.unwrap();
    for i in 0..8 {
        s.offer_with(&q, format!("k{i}"), keyed("k")).await.unwrap();
    }
    eventually(Duration::from_secs(10), || {
        let n = starts.lock().unwrap().len();
        async move { (n >= 8).then_some(()) }
    })
    .await
    .expect("all 8 ran");
    let k = of(&starts, "k");
    // The burst's three run at once (their handlers start in any order), then one at a time.
    let mut order: Vec<&str> = k.iter().map(|(p, _)| p.as_str()).collect();
    order[..3].sort();
    assert_eq!(order, ["k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7"]);
    let t0 = k[0].1;
    let tol = Duration::from_millis(30);
    // The burst: k0..k2 at once (well within one interval).
    assert!(k[2].1 - t0 < Duration::from_millis(60), "the burst took {:?}", k[2].1 - t0);
    // Then one per 100 ms: k3 one interval after the burst, k7 five.
    for (i, (p, at)) in k.iter().enumerate().skip(3) {
        let want = Duration::from_millis(100 * (i as u64 - 2));
        assert!(*at - t0 + tol >= want, "{p} at {:?}, expected ≥ {want:?}", *at - t0);
    }
    assert!(k[7].1 - t0 < Duration::from_millis(500 + 700), "k7 at {:?}", k[7].1 - t0);
    c.drain(Duration::from_secs(2)).await;
}

async fn with_concurrency_per_key_keys_run_alone_in_order_and_at_their_rate(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krate-caps");
    let starts: Starts = Arc::default();
    let running: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let overlaps = Arc::new(Mutex::new(0usize));
    // 10 per second per key, burst 1, one at a time per key; each handler runs 150 ms, longer
    // than the interval: the cap spaces them then, and the rate when they are quick.
    let rate = RateLimit::new(10, Duration::from_secs(1)).with_burst(1);
    let h = {
        let (starts, running, overlaps) = (starts.clone(), running.clone(), overlaps.clone());
        move |d: Delivery| {
            let (starts, running, overlaps) = (starts.clone(), running.clone(), overlaps.clone());
            async move {
                let p = String::from_utf8_lossy(&d.payload).into_owned();
                let key = p[..1].to_string();
                {
                    let mut r = running.lock().unwrap();
                    let n = r.entry(key.clone()).or_default();
                    *n += 1;
                    if *n > 1 {
                        *overlaps.lock().unwrap() += 1;
                    }
                }
                starts.lock().unwrap().push((p.clone(), Instant::now()));
                let work = if p.ends_with('0') || p.ends_with('1') { 150 } else { 5 };
                tokio::time::sleep(Duration::from_millis(work)).await;
                *running.lock().unwrap().get_mut(&key).unwrap() -= 1;
                Decision::Ack
            }
        }
    };
    let c = s.consume(&q, h, opts(rate).with_concurrency_per_key(Some(1))).await.unwrap();
    for i in 0..6 {
        s.offer_with(&q, format!("x{i}"), keyed("x")).await.unwrap();
        s.offer_with(&q, format!("y{i}"), keyed("y")).await.unwrap();
    }
    eventually(Duration::from_secs(10), || {
        let n = starts.lock().unwrap().len();
        async move { (n >= 12).then_some(()) }
    })
    .await
    .expect("all 12 ran");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(*overlaps.lock().unwrap(), 0, "never two entries of one key at once");
    for key in ["x", "y"] {
        let got = of(&starts, key);
        let order: Vec<String> = got.iter().map(|(p, _)| p.clone()).collect();
        let want: Vec<String> = (0..6).map(|i| format!("{key}{i}")).collect();
        assert_eq!(order, want, "key {key} in offer order");
        // x0 and x1 run 150 ms each (the cap spaces x1 and x2 by that); from x2 on 5 ms each:
        // the rate spaces them 100 ms apart. The rate is charged when an entry may start (after
        // its key's slot), so entries that waited in the key's line do not start in a bunch.
        for i in 1..6 {
            let d = got[i].1 - got[i - 1].1;
            assert!(d + Duration::from_millis(30) >= Duration::from_millis(100), "{key}{i} {d:?} after the one before");
        }
    }
    c.drain(Duration::from_secs(2)).await;
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.delayed), (0, 0, 0), "{st:?}");
}

async fn bad_per_key_rate_limits_are_refused(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krate-bad");
    let err = |r: RateLimit| {
        let s = s.clone();
        let q = q.clone();
        async move {
            let h = |_d: Delivery| async { Decision::Ack };
            match s.consume(&q, h, ConsumerOptions::new().with_rate_limit_per_key(Some(r))).await {
                Ok(_) => panic!("{r:?} accepted"),
                Err(e) => e.to_string(),
            }
        }
    };
    assert_eq!(
        err(RateLimit::new(0, Duration::from_secs(1))).await,
        "invalid queue setting: rate_limit_per_key.limit must be at least 1"
    );
    assert_eq!(
        err(RateLimit::new(5, Duration::from_secs(1)).with_burst(0)).await,
        "invalid queue setting: rate_limit_per_key.burst must be at least 1"
    );
    assert_eq!(
        err(RateLimit::new(1, Duration::from_micros(10))).await,
        "invalid queue setting: rate_limit_per_key.per must be at least 1ms (got 10µs)"
    );
    assert_eq!(
        err(RateLimit::new(2_000_000, Duration::from_secs(1))).await,
        "invalid queue setting: rate_limit_per_key 2000000 per 1s is above 1000000 per second, the highest rate allowed"
    );
    let remote = s
        .remote_consumer(
            &q,
            "w",
            RemoteOptions {
                rate_limit_per_key: Some(RateLimit::new(0, Duration::from_secs(1))),
                ..RemoteOptions::default()
            },
        )
        .await;
    assert_eq!(
        remote.err().map(|e| e.to_string()).as_deref(),
        Some("invalid queue setting: rate_limit_per_key.limit must be at least 1")
    );
}

fn ks(key: &str, active: u64, waiting: u64, rate_delayed: u64) -> KeyStats {
    KeyStats { key: key.to_string(), active, waiting, rate_delayed }
}

/// `QueueStats::key_waiting`, `key_rate_delayed` and `keys` with both per-key gates: exact counts
/// while handlers hold their slots.
async fn stats_count_each_keys_active_waiting_and_rate_delayed_entries(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krate-stats");
    let done: Arc<Mutex<Vec<String>>> = Arc::default();
    let started: Starts = Arc::default();
    let h = {
        let (done, started) = (done.clone(), started.clone());
        move |d: Delivery| {
            let (done, started) = (done.clone(), started.clone());
            async move {
                let p = String::from_utf8_lossy(&d.payload).into_owned();
                started.lock().unwrap().push((p.clone(), Instant::now()));
                while !done.lock().unwrap().contains(&p) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Decision::Ack
            }
        }
    };
    // One per key at a time; one start per key per 10 s.
    let rate = RateLimit::new(1, Duration::from_secs(10)).with_burst(1);
    let c = s.consume(&q, h, opts(rate).with_concurrency_per_key(Some(1))).await.unwrap();
    for p in ["a0", "a1", "a2"] {
        s.offer_with(&q, p, keyed("a")).await.unwrap();
    }
    s.offer_with(&q, "b0", keyed("b")).await.unwrap();
    s.offer(&q, "n0").await.unwrap();
    eventually(Duration::from_secs(5), || {
        let n = started.lock().unwrap().len();
        async move { (n == 3).then_some(()) }
    })
    .await
    .expect("a0, b0 and n0 started");
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.key_waiting, st.key_rate_delayed, st.delayed, st.pending), (2, 0, 0, 3), "{st:?}");
    assert_eq!(st.keys, vec![ks("a", 1, 2, 0), ks("b", 1, 0, 0)]);
    // a0 ends: a1 gets a's slot, but not a's rate (10 s): it waits in the delayed set, keeping
    // the slot; a2 still waits for the slot.
    done.lock().unwrap().push("a0".into());
    eventually(Duration::from_secs(5), || {
        let s = s.clone();
        let q = q.clone();
        async move {
            let st = s.stats(&q).await.unwrap();
            (st.key_rate_delayed == 1).then_some(st)
        }
    })
    .await
    .map(|st| {
        assert_eq!((st.key_waiting, st.key_rate_delayed, st.delayed, st.pending), (1, 1, 1, 2), "{st:?}");
        assert_eq!(st.keys, vec![ks("a", 1, 1, 1), ks("b", 1, 0, 0)]);
    })
    .expect("a1 waits for a's rate");
    assert_eq!(started.lock().unwrap().len(), 3, "a1 did not start");
    done.lock().unwrap().extend(["b0".to_string(), "n0".to_string()]);
    eventually(Duration::from_secs(5), || {
        let s = s.clone();
        let q = q.clone();
        async move {
            let st = s.stats(&q).await.unwrap();
            (st.pending == 0).then_some(st)
        }
    })
    .await
    .map(|st| assert_eq!(st.keys, vec![ks("a", 1, 1, 1)], "{st:?}"))
    .expect("b0 and n0 ended");
    c.abort();
}

/// A remote worker's claims pass the same per-key rate: a claim that only delayed entries waits
/// (within its `wait`) for the earliest, promotes it and takes it; other keys are not held back.
async fn a_remote_workers_claims_keep_each_keys_rate(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krate-remote");
    let opts = RemoteOptions {
        claim_timeout: Duration::from_secs(30),
        max_deliveries: None,
        rate_limit_per_key: Some(RateLimit::new(4, Duration::from_secs(1)).with_burst(1)),
        ..Default::default()
    };
    let w = s.remote_consumer(&q, "worker-1", opts).await.unwrap();
    for i in 0..3 {
        s.offer_with(&q, format!("a{i}"), keyed("a")).await.unwrap();
    }
    s.offer_with(&q, "b0", keyed("b")).await.unwrap();
    // One claim: a0 and b0 (a1, a2 over a's rate, delayed; b0 not held back by them).
    let t0 = Instant::now();
    let got: Vec<String> = w
        .claim(10, Duration::ZERO)
        .await
        .unwrap()
        .into_iter()
        .map(|d| String::from_utf8_lossy(&d.payload).into_owned())
        .collect();
    assert_eq!(got, ["a0", "b0"]);
    assert_eq!(s.stats(&q).await.unwrap().key_rate_delayed, 2);
    // Long-poll claims: a1 one interval (250 ms) after a0, a2 one more.
    let mut at = Vec::new();
    for want in ["a1", "a2"] {
        let d = w.claim(10, Duration::from_secs(3)).await.unwrap();
        let got: Vec<String> = d.iter().map(|d| String::from_utf8_lossy(&d.payload).into_owned()).collect();
        assert_eq!(got, [want]);
        at.push(t0.elapsed());
        w.ack(d[0].id, d[0].fence).await.unwrap();
    }
    let tol = Duration::from_millis(30);
    assert!(at[0] + tol >= Duration::from_millis(250) && at[0] < Duration::from_millis(1000), "a1 at {:?}", at[0]);
    assert!(at[1] + tol >= Duration::from_millis(500) && at[1] < Duration::from_millis(1500), "a2 at {:?}", at[1]);
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.key_rate_delayed, st.delayed), (0, 0), "{st:?}");
}

/// Where the worker processes record each start: `<payload> <µs, Redis time>`.
fn starts_key(queue: &str) -> String {
    format!("krate-test:{{{queue}}}:starts")
}

fn child_options() -> ConsumerOptions {
    ConsumerOptions::new()
        .with_concurrency(8)
        .with_reap_idle_consumers_after(None)
        .with_poll_interval(Duration::from_secs(2))
        .with_rate_limit_per_key(Some(RateLimit::new(10, Duration::from_secs(1)).with_burst(1)))
}

/// The worker side of the three-process test: runs only when re-executed with
/// `BATON_KRATE_CHILD=1`.
#[test]
#[ignore = "worker process entry point, started by the tests in this file"]
fn key_rate_child_worker() {
    if std::env::var("BATON_KRATE_CHILD").is_err() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let cfg = RedisConfig::standalone(std::env::var("BATON_REDIS_URL").unwrap());
        let queue = std::env::var("BATON_QUEUE").unwrap();
        let client = RedisClient::new(cfg).unwrap();
        let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
        let conn = client.shared().await.unwrap();
        let key = starts_key(&queue);
        let _c = s
            .consume(
                &queue,
                move |d: Delivery| {
                    let (mut conn, key) = (conn.clone(), key.clone());
                    async move {
                        let _: i64 = redis::cmd("EVAL")
                            .arg("local t = redis.call('TIME') return redis.call('RPUSH', KEYS[1], ARGV[1] .. ' ' .. t[1] .. string.format('%06d', tonumber(t[2])))")
                            .arg(1)
                            .arg(&key)
                            .arg(d.payload.as_ref())
                            .query_async(&mut conn)
                            .await
                            .unwrap();
                        Decision::Ack
                    }
                },
                child_options(),
            )
            .await
            .unwrap();
        println!("READY {}", std::process::id());
        tokio::time::sleep(Duration::from_secs(600)).await;
    });
}

fn spawn_worker(url: &str, queue: &str) -> ChildWorker {
    spawn_child_worker(
        "key_rate::key_rate_child_worker",
        &[("BATON_KRATE_CHILD", "1"), ("BATON_QUEUE", queue), ("BATON_REDIS_URL", url)],
    )
}

/// Three consumer processes share each key's bucket: 5 keys × 12 entries at 10 per second per
/// key (burst 1): each key's starts (Redis time) at least 100 ms apart and in offer order, the
/// keys side by side (all done in about 1.1 s, not 5 × 1.1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_share_each_keys_rate() {
    require_redis();
    let server = RedisServer::start();
    let client = RedisClient::new(server.config()).unwrap();
    let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let q = queue_name("krate-3p");
    let workers: Vec<ChildWorker> = (0..3).map(|_| spawn_worker(&server.url(), &q)).collect();
    for i in 0..12 {
        for k in 0..5 {
            s.offer_with(&q, format!("k{k}-{i}"), keyed(&format!("k{k}"))).await.unwrap();
        }
    }
    let conn = client.shared().await.unwrap();
    let key = starts_key(&q);
    let all: Vec<String> = eventually(Duration::from_secs(20), || {
        let (mut conn, key) = (conn.clone(), key.clone());
        async move {
            let v: Vec<String> = redis::cmd("LRANGE").arg(&key).arg(0).arg(-1).query_async(&mut conn).await.unwrap();
            (v.len() >= 60).then_some(v)
        }
    })
    .await
    .expect("all 60 started");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut per: HashMap<String, Vec<(u32, u64)>> = HashMap::new();
    for line in &all {
        let (p, us) = line.split_once(' ').unwrap();
        let (k, i) = p.split_once('-').unwrap();
        per.entry(k.to_string()).or_default().push((i.parse().unwrap(), us.parse().unwrap()));
    }
    let (mut first, mut last) = (u64::MAX, 0);
    for (k, mut v) in per {
        v.sort_by_key(|(_, us)| *us);
        let order: Vec<u32> = v.iter().map(|(i, _)| *i).collect();
        assert_eq!(order, (0..12).collect::<Vec<u32>>(), "key {k}: each once, in offer order");
        for w in v.windows(2) {
            let gap = w[1].1 - w[0].1;
            assert!(gap + 15_000 >= 100_000, "key {k}: starts {} and {} only {gap} µs apart", w[0].0, w[1].0);
        }
        first = first.min(v[0].1);
        last = last.max(v[11].1);
    }
    let span = Duration::from_micros(last - first);
    println!("60 entries of 5 keys across 3 processes in {span:?}");
    assert!(span < Duration::from_millis(1100 + 1000), "took {span:?}");
    drop(workers);
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.delayed, st.key_rate_delayed), (0, 0, 0), "{st:?}");
}

/// An entry delayed for its key's rate keeps its priority: promoted while lower-priority entries
/// wait, it starts before them.
async fn an_entry_delayed_for_its_keys_rate_keeps_its_priority(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krate-prio");
    let starts: Starts = Arc::default();
    let h = {
        let starts = starts.clone();
        move |d: Delivery| {
            let starts = starts.clone();
            async move {
                let p = String::from_utf8_lossy(&d.payload).into_owned();
                starts.lock().unwrap().push((p, Instant::now()));
                tokio::time::sleep(Duration::from_millis(60)).await;
                Decision::Ack
            }
        }
    };
    // 2 per second per key: k1 is due 500 ms after k0.
    let rate = RateLimit::new(2, Duration::from_secs(1)).with_burst(1);
    let c = s.consume(&q, h, opts(rate).with_concurrency(1)).await.unwrap();
    s.offer_with(&q, "k0", keyed("k")).await.unwrap();
    eventually(Duration::from_secs(5), || {
        let n = starts.lock().unwrap().len();
        async move { (n == 1).then_some(()) }
    })
    .await
    .expect("k0 started");
    s.offer_with(&q, "k1", OfferOptions { concurrency_key: Some("k".into()), priority: 5 }).await.unwrap();
    // Ten entries of priority 0 (60 ms each, one at a time: 600 ms of work) queue behind k0.
    for i in 0..10 {
        s.offer(&q, format!("n{i}")).await.unwrap();
    }
    eventually(Duration::from_secs(5), || {
        let n = starts.lock().unwrap().len();
        async move { (n >= 12).then_some(()) }
    })
    .await
    .expect("all 12 ran");
    let order: Vec<String> = starts.lock().unwrap().iter().map(|(p, _)| p.clone()).collect();
    let at = |p: &str| order.iter().position(|x| x == p).unwrap();
    assert_eq!(at("k0"), 0, "{order:?}");
    // k1 comes back about 500 ms in, with about 3 of the n entries still waiting: it goes first.
    assert!(at("k1") < at("n9"), "k1 kept its priority: {order:?}");
    assert!(at("k1") > at("n2"), "k1 waited for its key's rate: {order:?}");
    c.drain(Duration::from_secs(2)).await;
}

/// The rate spaces starts, not admissions: a key's entries delayed for its rate that come due
/// while every slot of the consumer is busy start one interval apart once a slot frees, not
/// together (before the key's line, all five that had come due started within a few ms).
async fn entries_that_came_due_while_every_slot_was_busy_start_at_the_keys_rate(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krate-busy");
    let starts: Starts = Arc::default();
    let h = {
        let starts = starts.clone();
        move |d: Delivery| {
            let starts = starts.clone();
            async move {
                let p = String::from_utf8_lossy(&d.payload).into_owned();
                starts.lock().unwrap().push((p.clone(), Instant::now()));
                if p.starts_with("slow") {
                    tokio::time::sleep(Duration::from_millis(1200)).await;
                }
                Decision::Ack
            }
        }
    };
    // 10 per second per key, burst 1; two slots. k0 starts, k1..k5 wait for the key's rate (k1 is
    // due 100 ms later); the two slow entries then hold both slots for 1.2 s, while k1..k5 would
    // all have come due.
    let rate = RateLimit::new(10, Duration::from_secs(1)).with_burst(1);
    let c = s.consume(&q, h, opts(rate).with_concurrency(2)).await.unwrap();
    for i in 0..6 {
        s.offer_with(&q, format!("k{i}"), keyed("k")).await.unwrap();
    }
    s.offer(&q, "slow0").await.unwrap();
    s.offer(&q, "slow1").await.unwrap();
    eventually(Duration::from_secs(10), || {
        let n = starts.lock().unwrap().len();
        async move { (n >= 8).then_some(()) }
    })
    .await
    .expect("all 8 ran");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(starts.lock().unwrap().len(), 8, "each entry runs once");
    let slow = of(&starts, "slow");
    let k = of(&starts, "k");
    assert_spaced("k", &k, 6, Duration::from_millis(100), Duration::from_millis(15));
    // k1 started only after a slow entry finished (the slots were busy): the scenario happened.
    assert!(k[1].1 >= slow[0].1 + Duration::from_millis(1100), "k1 at {:?} after slow0", k[1].1 - slow[0].1);
    c.drain(Duration::from_secs(2)).await;
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.delayed, st.key_rate_delayed), (0, 0, 0, 0), "{st:?}");
}

/// A key's entries parked behind its head wait for nothing but their turn: when the per-key rate
/// limit is removed from the consumers' settings, the next read releases them (each runs once).
async fn a_removed_per_key_rate_limit_strands_no_parked_entry(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("krate-removed");
    let starts: Starts = Arc::default();
    // 1 per 10 s per key: k0 starts, k1 is the key's head (due in 10 s), k2..k4 are parked.
    let rate = RateLimit::new(1, Duration::from_secs(10)).with_burst(1);
    let c = s.consume(&q, recorder(&starts, Duration::ZERO), opts(rate)).await.unwrap();
    for i in 0..5 {
        s.offer_with(&q, format!("k{i}"), keyed("k")).await.unwrap();
    }
    eventually(Duration::from_secs(5), || {
        let n = starts.lock().unwrap().len();
        async move { (n == 1).then_some(()) }
    })
    .await
    .expect("k0 started");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.delayed, st.key_rate_delayed), (0, 0, 4, 4), "{st:?}");
    c.drain(Duration::from_secs(2)).await;
    // The same queue without a per-key rate limit: the parked entries are released at once and
    // the head (due in about 10 s) when due; k1 to k4 all run, each once.
    let c = s
        .consume(&q, recorder(&starts, Duration::ZERO), fast(10_000).with_poll_interval(Duration::from_millis(200)))
        .await
        .unwrap();
    eventually(Duration::from_secs(4), || {
        let n = starts.lock().unwrap().len();
        async move { (n == 4).then_some(()) }
    })
    .await
    .expect("the three parked entries ran without waiting for the head's due time");
    let mut got: Vec<String> = starts.lock().unwrap().iter().map(|(p, _)| p.clone()).collect();
    got.sort();
    assert_eq!(got, ["k0", "k2", "k3", "k4"]);
    eventually(Duration::from_secs(15), || {
        let n = starts.lock().unwrap().len();
        async move { (n == 5).then_some(()) }
    })
    .await
    .expect("the head ran at its due time");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(starts.lock().unwrap().len(), 5, "each entry runs once");
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.delayed, st.key_rate_delayed), (0, 0, 0, 0), "{st:?}");
    c.drain(Duration::from_secs(2)).await;
}
