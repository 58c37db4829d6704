//! Breaker attacks on the gated read's wake-ups: with a poll interval far longer than the test
//! (10 s) only a wake-up can start an entry, so a lost one shows as a stall.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_testkit::TestBackend;
use common::*;

baton_testkit::on_every_backend!(
    no_wake_up_is_lost_across_pause_resume_races,
    an_entry_taken_by_a_read_whose_reply_is_lost_still_runs
);

/// Pause, offer, resume (with no gap, or a tiny one) in a loop, racing the consumers' reads and
/// waits: every offer must start within 2 s, never at the next poll (10 s).
async fn no_wake_up_is_lost_across_pause_resume_races(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("pause-wake");
    let started = Arc::new(AtomicUsize::new(0));
    let opts = fast(60_000).with_poll_interval(Duration::from_secs(10));
    let mut consumers = Vec::new();
    for _ in 0..3 {
        let h = acking_counter(started.clone());
        consumers.push(s.consume(&q, h, opts.clone()).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut worst = Duration::ZERO;
    let mut slowest_ops = Duration::ZERO;
    const ROUNDS: usize = 150;
    for i in 0..ROUNDS {
        let t0 = Instant::now();
        match i % 3 {
            0 => {
                s.pause(&q).await.unwrap();
                s.offer(&q, "x").await.unwrap();
                s.resume(&q).await.unwrap();
            }
            1 => {
                s.pause(&q).await.unwrap();
                s.offer(&q, "x").await.unwrap();
                tokio::time::sleep(Duration::from_micros(300 * (i as u64 % 7))).await;
                s.resume(&q).await.unwrap();
            }
            _ => {
                s.offer(&q, "x").await.unwrap();
                s.pause(&q).await.unwrap();
                s.resume(&q).await.unwrap();
            }
        }
        slowest_ops = slowest_ops.max(t0.elapsed());
        let t = Instant::now();
        let want = i + 1;
        eventually(Duration::from_secs(2), || {
            let n = started.load(Ordering::SeqCst);
            async move { (n >= want).then_some(()) }
        })
        .await
        .unwrap_or_else(|| {
            panic!("round {i}: offer not started within 2 s ({} started)", started.load(Ordering::SeqCst))
        });
        worst = worst.max(t.elapsed());
    }
    assert_eq!(started.load(Ordering::SeqCst), ROUNDS);
    eprintln!("{ROUNDS} rounds, worst start after resume {worst:?}, slowest pause/offer/resume {slowest_ops:?}");
    futures::future::join_all(consumers.into_iter().map(|c| c.drain(Duration::from_secs(1)))).await;
}

/// A gated read whose reply is lost (connection cut after Redis ran it; here its effect is made
/// directly: the flag deleted and the entry read into the consumer's name in one script, no
/// wake-up): the entry is pending under a live consumer that does not hold it. It must still run,
/// exactly once, within a few claim timeouts (the heartbeat hands it over as an orphan).
async fn an_entry_taken_by_a_read_whose_reply_is_lost_still_runs(b: TestBackend) {
    use baton_redis::redis;
    let Some(mut conn) = conn_for(&b).await else { return };
    let s = stream_for(&b).await;
    let q = queue_name("pause-lost");
    let started = Arc::new(AtomicUsize::new(0));
    let h = acking_counter(started.clone());
    let c = s.consume(&q, h, fast(1_000).with_heartbeat_interval(Duration::from_millis(200))).await.unwrap();
    s.pause(&q).await.unwrap();
    s.offer(&q, "x").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let name = consumer_names(&mut conn, &q).await.into_iter().next().expect("the consumer joined");
    let stream = baton_queue::keys::stream(baton_queue::keys::DEFAULT_PREFIX, &q);
    let paused = baton_queue::keys::paused(baton_queue::keys::DEFAULT_PREFIX, &q);
    let n: i64 = redis::cmd("EVAL")
        .arg("redis.call('DEL', KEYS[2]) local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', KEYS[1], '>') return #r[1][2]")
        .arg(2)
        .arg(&stream)
        .arg(&paused)
        .arg(baton_queue::keys::DEFAULT_GROUP)
        .arg(&name)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, 1);
    let t = Instant::now();
    count_is(&started, 1, Duration::from_secs(6)).await.expect("the entry whose read reply was lost never ran");
    eprintln!("recovered after {:?}", t.elapsed());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(started.load(Ordering::SeqCst), 1);
    c.drain(Duration::from_secs(1)).await;
}

/// The pause survives a Redis restart with AOF (SIGKILL, consumers waiting on the control
/// stream) and a Redis frozen (SIGSTOP) past the wait's bound: nothing starts while paused, and
/// the resume after them starts every waiting entry promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_survives_an_aof_restart_and_a_frozen_redis() {
    use baton_queue::{MessageStream, RedisQueueOptions};
    use baton_redis::RedisClient;
    use baton_testkit::{require_redis, RedisServer, ServerOptions};
    require_redis();
    let mut server = RedisServer::start_with(ServerOptions { appendonly: true });
    let s =
        MessageStream::redis(RedisClient::new(server.config()).unwrap(), RedisQueueOptions::default()).await.unwrap();
    let q = queue_name("pause-aof");
    let started = Arc::new(AtomicUsize::new(0));
    let mut consumers = Vec::new();
    for _ in 0..2 {
        let h = acking_counter(started.clone());
        consumers.push(s.consume(&q, h, fast(3_000).with_poll_interval(Duration::from_millis(500))).await.unwrap());
    }
    s.pause(&q).await.unwrap();
    s.offer(&q, "before").await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart();
    let mut offered = 1;
    eventually(Duration::from_secs(10), || async { s.offer(&q, "after").await.ok() })
        .await
        .expect("offer after restart");
    offered += 1;
    assert!(s.is_paused(&q).await.unwrap(), "the pause was lost in the restart");
    // Frozen past the wait's bound (poll + 5 s).
    server.pause();
    tokio::time::sleep(Duration::from_secs(7)).await;
    server.resume();
    s.offer(&q, "thawed").await.unwrap();
    offered += 1;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(started.load(Ordering::SeqCst), 0, "started while paused");
    assert!(s.resume(&q).await.unwrap());
    let t = Instant::now();
    count_is(&started, offered, Duration::from_secs(3))
        .await
        .unwrap_or_else(|| panic!("{} of {offered} started after the resume", started.load(Ordering::SeqCst)));
    eprintln!("all {offered} started {:?} after the resume", t.elapsed());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(started.load(Ordering::SeqCst), offered);
    futures::future::join_all(consumers.into_iter().map(|c| c.drain(Duration::from_secs(1)))).await;
}

/// Moves `slot` from the node that serves it to another master (IMPORTING/MIGRATING, MIGRATE
/// of its keys, SETSLOT NODE on every master): a resharding as `redis-cli --cluster reshard`
/// does it.
fn move_slot(cluster: &mut baton_testkit::RedisCluster, slot: u16) {
    let nodes = cluster.nodes();
    let ids: Vec<String> = nodes.iter().map(|n| n.cli(&["CLUSTER", "MYID"])).collect();
    let table = nodes[0].cli(&["CLUSTER", "NODES"]);
    let mut src = None;
    for line in table.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        for r in &f[8..] {
            let (a, b) = r.split_once('-').unwrap_or((r, r));
            if let (Ok(a), Ok(b)) = (a.parse::<u16>(), b.parse::<u16>()) {
                if (a..=b).contains(&slot) {
                    src = ids.iter().position(|id| id == f[0]);
                }
            }
        }
    }
    let src = src.expect("slot owner");
    let dst = (src + 1) % nodes.len();
    let s = slot.to_string();
    nodes[dst].cli(&["CLUSTER", "SETSLOT", &s, "IMPORTING", &ids[src]]);
    nodes[src].cli(&["CLUSTER", "SETSLOT", &s, "MIGRATING", &ids[dst]]);
    let keys = nodes[src].cli(&["CLUSTER", "GETKEYSINSLOT", &s, "1000"]);
    let keys: Vec<&str> = keys.lines().map(str::trim).filter(|k| !k.is_empty()).collect();
    if !keys.is_empty() {
        let port = nodes[dst].port().to_string();
        let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
        args.extend(keys.iter().copied());
        nodes[src].cli(&args);
    }
    for i in [dst, src, (dst + 1) % nodes.len()] {
        nodes[i].cli(&["CLUSTER", "SETSLOT", &s, "NODE", &ids[dst]]);
    }
    assert_eq!(nodes[src].cli(&["CLUSTER", "COUNTKEYSINSLOT", &s]), "0");
    assert_ne!(nodes[dst].cli(&["CLUSTER", "COUNTKEYSINSLOT", &s]), "0");
    eprintln!("slot {slot} moved from node {src} to node {dst} with {} keys", keys.len());
}

/// After the queue's slot moves to another node (resharding), a waiting consumer must still be
/// woken by an offer at once (its wait redirected like any command), not find new entries only
/// by polling after failed reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_wakes_a_consumer_after_its_slot_moved() {
    use baton_queue::{MessageStream, RedisQueueOptions};
    use baton_redis::RedisClient;
    use baton_testkit::{require_redis, RedisCluster};
    require_redis();
    captured_logs();
    let mut cluster = RedisCluster::start();
    let s =
        MessageStream::redis(RedisClient::new(cluster.config()).unwrap(), RedisQueueOptions::default()).await.unwrap();
    let q = queue_name("pause-moved");
    let started = Arc::new(AtomicUsize::new(0));
    let h = acking_counter(started.clone());
    let c = s.consume(&q, h, fast(10_000).with_poll_interval(Duration::from_secs(3))).await.unwrap();
    s.offer(&q, "first").await.unwrap();
    count_is(&started, 1, Duration::from_secs(5)).await.expect("first ran");
    let stream = baton_queue::keys::stream(baton_queue::keys::DEFAULT_PREFIX, &q);
    let slot: u16 = cluster.nodes()[0].cli(&["CLUSTER", "KEYSLOT", &stream]).parse().unwrap();
    move_slot(&mut cluster, slot);
    // Past the wait that was blocked when the slot moved.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut worst = Duration::ZERO;
    for i in 0..6 {
        let t = Instant::now();
        s.offer(&q, "after").await.unwrap();
        let want = 2 + i;
        count_is(&started, want, Duration::from_secs(10)).await.expect("offer after the move ran");
        worst = worst.max(t.elapsed());
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    eprintln!("worst start after the slot moved: {worst:?}");
    assert!(worst < Duration::from_millis(300), "an offer waited {worst:?} to start after the slot moved");
    c.drain(Duration::from_secs(1)).await;
}

/// An offer to a queue with many idle consumers wakes one of them, not all: each woken waiter
/// runs a gated read, so a wake-up of every waiter per entry costs Redis O(consumers) per offer
/// (with `XREAD BLOCK` on the stream: 32 idle consumers, 32 wake-ups and 32 scripts per offer).
/// Counted with `INFO commandstats`: gated reads (`EVALSHA`) per offer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_wakes_one_idle_consumer_not_all() {
    use baton_queue::{MessageStream, RedisQueueOptions};
    use baton_redis::RedisClient;
    use baton_testkit::{require_redis, RedisServer};
    require_redis();
    let server = RedisServer::start();
    let s =
        MessageStream::redis(RedisClient::new(server.config()).unwrap(), RedisQueueOptions::default()).await.unwrap();
    let q = queue_name("herd");
    let started = Arc::new(AtomicUsize::new(0));
    const IDLE: usize = 16;
    let mut cs = Vec::new();
    for _ in 0..IDLE {
        let h = acking_counter(started.clone());
        cs.push(s.consume(&q, h, fast(30_000).with_poll_interval(Duration::from_secs(10))).await.unwrap());
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let calls = |name: &str| -> u64 {
        let stats = server.cli(&["INFO", "commandstats"]);
        let prefix = format!("cmdstat_{name}:calls=");
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&prefix).and_then(|r| r.split(',').next()).and_then(|n| n.parse().ok()))
            .unwrap_or(0)
    };
    let before = calls("evalsha");
    const OFFERS: usize = 100;
    let mut worst = Duration::ZERO;
    for i in 0..OFFERS {
        let t = Instant::now();
        s.offer(&q, "x").await.unwrap();
        let want = i + 1;
        eventually(Duration::from_secs(5), || {
            let n = started.load(Ordering::SeqCst);
            async move { (n >= want).then_some(()) }
        })
        .await
        .unwrap_or_else(|| panic!("offer {i} not started"));
        worst = worst.max(t.elapsed());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Per offer: the woken consumer's gated read, its read after the handler, and settlements
    // and heartbeats (scripts too); never one per idle consumer.
    let per_offer = (calls("evalsha") - before) as f64 / OFFERS as f64;
    eprintln!("{IDLE} idle consumers: {per_offer:.1} scripts per offer, worst start {worst:?}");
    assert!(per_offer < 6.0, "{per_offer:.1} scripts per offer with {IDLE} idle consumers: every one was woken");
    assert_eq!(started.load(Ordering::SeqCst), OFFERS);
    futures::future::join_all(cs.into_iter().map(|c| c.drain(Duration::from_secs(1)))).await;
}
