//! Breaker tests: attempts to break the lease guarantee with real parts (redis-server processes,
//! SIGSTOP/SIGCONT of Redis, TCP cuts through `TcpProxy`). Each test is bounded (< 60 s).

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_queue::{Decision, Delivery, Lease, MessageId, MessageStream, QueueError, RedisQueueOptions};
use baton_redis::{redis, RedisClient, RedisConfig};
use baton_testkit::{require_redis, RedisServer, ServerOptions, TcpProxy, TestBackend};
use common::*;
use tokio::sync::mpsc;

fn init_tracing() {
    // The binary's one subscriber (warnings captured, shared with the other files).
    captured_logs();
}

async fn redis_stream(cfg: RedisConfig) -> MessageStream {
    MessageStream::redis(RedisClient::new(cfg).unwrap(), RedisQueueOptions::default()).await.unwrap()
}

/// A handler that hands every lease to the test and keeps it (Deferred).
fn lease_sink(
) -> (impl Fn(Delivery) -> futures::future::Ready<Decision> + Send + Sync + 'static, mpsc::UnboundedReceiver<Lease>) {
    let (tx, rx) = mpsc::unbounded_channel::<Lease>();
    let h = move |d: Delivery| {
        let _ = tx.send(d.lease.clone());
        futures::future::ready(Decision::Deferred)
    };
    (h, rx)
}

async fn xlen(conn: &mut baton_redis::RedisConn, queue: &str) -> u64 {
    redis::cmd("XLEN")
        .arg(baton_queue::keys::stream(baton_queue::keys::DEFAULT_PREFIX, queue))
        .query_async(conn)
        .await
        .unwrap()
}

// ------------------------------------------------------------------------------------------------
// 1. An ack whose first attempt applied during a Redis pause (its reply lost to the 5 s response
//    timeout) is reported as a failure.
// ------------------------------------------------------------------------------------------------

/// Redis is paused (SIGSTOP) for longer than the shared connections' 5 s response timeout while a
/// consumer acks. The first attempt is in Redis's socket buffer and applies on SIGCONT; the retry
/// finds the entry gone. The ack applied and nobody else ever had the message, so the ack must be
/// reported Ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_applied_during_redis_pause_is_not_reported_failed() {
    require_redis();
    init_tracing();
    let server = RedisServer::start();
    let queue = queue_name("brk-pause-ack");
    let ms = redis_stream(server.config()).await;
    let mut conn = RedisClient::new(server.config()).unwrap().shared().await.unwrap();
    let id = ms.offer(&queue, "x").await.unwrap();
    let (h, mut leases) = lease_sink();
    let c = ms.consume(&queue, h, fast(2_000).with_concurrency(4)).await.unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(10), leases.recv()).await.unwrap().unwrap();
    assert_eq!(lease.id(), id);

    server.pause();
    let l2 = lease.clone();
    let ack = tokio::spawn(async move { l2.ack().await });
    tokio::time::sleep(Duration::from_millis(6_500)).await;
    server.resume();
    let r = tokio::time::timeout(Duration::from_secs(20), ack).await.expect("ack never answered").unwrap();
    // Give Redis a moment, then look at what really happened.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let len = xlen(&mut conn, &queue).await;
    let owners = pending_owners(&mut conn, &queue).await;
    let counters = c.counters();
    eprintln!("ack result: {r:?}; XLEN {len}; pending {owners:?}; counters {counters:?}");
    assert_eq!(len, 0, "the ack did apply (entry deleted)");
    assert!(owners.is_empty());
    assert_eq!(counters.reclaimed, 0, "nobody else had the message");
    assert!(r.is_ok(), "an ack that applied (and whose message nobody else ever had) was reported failed: {r:?}");
    c.close().await;
}

// ------------------------------------------------------------------------------------------------
// 2. An ack in flight while the consumer is cut off from Redis; a peer takes the message over and
//    acks it; when the consumer reconnects its ack is reported Ok (silent double run).
// ------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_in_flight_across_partition_after_peer_acked_is_refused() {
    require_redis();
    init_tracing();
    let server = RedisServer::start();
    let target: std::net::SocketAddr = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let proxy = TcpProxy::start(target).await;
    let queue = queue_name("brk-part-ack");
    let via_proxy = redis_stream(RedisConfig::standalone(format!("redis://{}", proxy.addr()))).await;
    let direct = redis_stream(server.config()).await;
    let id = direct.offer(&queue, "x").await.unwrap();
    let (h, mut leases) = lease_sink();
    let a = via_proxy
        .consume(&queue, h, fast(1_000).with_concurrency(4).with_heartbeat_interval(Duration::from_millis(100)))
        .await
        .unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(10), leases.recv()).await.unwrap().unwrap();
    assert_eq!(lease.id(), id);

    // Cut A off, then let its handler ack (the settlement retries until Redis answers).
    proxy.set_refuse(true);
    proxy.drop_connections();
    let l2 = lease.clone();
    let ack = tokio::spawn(async move { l2.ack().await });

    // A peer with a direct connection takes the message over after claim_timeout and acks it.
    let ran: Arc<Mutex<Vec<MessageId>>> = Arc::default();
    let ran2 = ran.clone();
    let b = direct
        .consume(
            &queue,
            move |d: Delivery| {
                ran2.lock().unwrap().push(d.id);
                futures::future::ready(Decision::Ack)
            },
            fast(1_000).with_concurrency(4),
        )
        .await
        .unwrap();
    let took = eventually(Duration::from_secs(10), || async { (!ran.lock().unwrap().is_empty()).then_some(()) }).await;
    assert!(took.is_some(), "peer never took the message over");
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.set_refuse(false);
    let r = tokio::time::timeout(Duration::from_secs(20), ack).await.expect("ack never answered").unwrap();
    let ca = a.counters();
    let cb = b.counters();
    eprintln!(
        "A's ack: {r:?}; lease lost signal: {}; A {ca:?}; B ran {:?} {cb:?}",
        lease.is_lost(),
        ran.lock().unwrap()
    );
    assert!(
        matches!(r, Err(QueueError::LeaseLost(_))),
        "the message ran on the peer (which acked it), yet A's ack was reported {r:?} and A never saw a lost lease (leases_lost={})",
        ca.leases_lost
    );
    a.close().await;
    b.close().await;
}

// ------------------------------------------------------------------------------------------------
// 3. A short Redis restart (AOF, every write fsynced) while a live consumer holds a lease: a peer
//    must never take the live consumer's message.
// ------------------------------------------------------------------------------------------------

async fn restart_never_fails_over_live_work(hb: Option<Duration>, restarts: usize, down: &'static [u64]) {
    require_redis();
    init_tracing();
    let server = Arc::new(Mutex::new(RedisServer::start_with(ServerOptions { appendonly: true })));
    let cfg = server.lock().unwrap().config();
    let queue = queue_name("brk-restart");
    let ms = redis_stream(cfg.clone()).await;
    let mut opts = fast(1_000).with_concurrency(4);
    if let Some(hb) = hb {
        opts = opts.with_heartbeat_interval(hb);
    }
    let id = ms.offer(&queue, "held").await.unwrap();
    let (h, mut leases) = lease_sink();
    let a = ms.consume(&queue, h, opts.clone()).await.unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(10), leases.recv()).await.unwrap().unwrap();
    assert_eq!(lease.id(), id);
    let ran: Arc<Mutex<Vec<(MessageId, Instant)>>> = Arc::default();
    let ran2 = ran.clone();
    let b = ms
        .consume(
            &queue,
            move |d: Delivery| {
                ran2.lock().unwrap().push((d.id, Instant::now()));
                futures::future::ready(Decision::Ack)
            },
            opts.clone(),
        )
        .await
        .unwrap();
    let t0 = Instant::now();
    for i in 0..restarts {
        let s = server.clone();
        let took = tokio::task::spawn_blocking(move || {
            let t = Instant::now();
            let mut g = s.lock().unwrap();
            g.kill();
            std::thread::sleep(Duration::from_millis(down[i % down.len()]));
            g.restart();
            t.elapsed()
        })
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(1_500 + 97 * (i as u64 % 5))).await;
        let runs = ran.lock().unwrap().clone();
        eprintln!(
            "restart {i} took {took:?}; lost signal {}; A {:?}; B ran {:?}",
            lease.is_lost(),
            a.counters(),
            runs.iter().map(|(id, at)| (*id, at.duration_since(t0))).collect::<Vec<_>>()
        );
        assert!(
            runs.is_empty() && !lease.is_lost(),
            "after restart {i} (down {took:?}) the peer ran the message that a live consumer holds (lost signal on the holder: {}); A {:?}",
            lease.is_lost(),
            a.counters()
        );
    }
    drop(lease);
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_never_fails_over_live_work_heartbeat_half() {
    restart_never_fails_over_live_work(Some(Duration::from_millis(500)), 12, &[0, 150, 300, 400, 450, 250]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_never_fails_over_live_work_default_heartbeat() {
    restart_never_fails_over_live_work(None, 12, &[0, 300, 500, 600, 650, 400]).await
}

// ------------------------------------------------------------------------------------------------
// 4. A short RetryAfter kept as a waiting lease is redelivered from the local timer while the
//    consumer has been cut off for longer than claim_timeout: new runs start on a lease that a
//    peer already owns (no handler ignored any signal; the lease is not marked lost).
// ------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_lease_not_redelivered_after_it_may_have_expired() {
    require_redis();
    init_tracing();
    let server = RedisServer::start();
    let target: std::net::SocketAddr = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let proxy = TcpProxy::start(target).await;
    let queue = queue_name("brk-waiting");
    let via_proxy = redis_stream(RedisConfig::standalone(format!("redis://{}", proxy.addr()))).await;
    let direct = redis_stream(server.config()).await;
    direct.offer(&queue, "x").await.unwrap();
    // (who, start, lost at start)
    type Runs = Vec<(&'static str, Instant, bool)>;
    let runs: Arc<Mutex<Runs>> = Arc::default();
    let r1 = runs.clone();
    let a = via_proxy
        .consume(
            &queue,
            move |d: Delivery| {
                r1.lock().unwrap().push(("A", Instant::now(), d.lease.is_lost()));
                futures::future::ready(Decision::RetryAfter(Duration::from_millis(200)))
            },
            fast(1_000).with_concurrency(2),
        )
        .await
        .unwrap();
    let first = eventually(Duration::from_secs(5), || async { (!runs.lock().unwrap().is_empty()).then_some(()) }).await;
    assert!(first.is_some());
    // Cut A off for 2.5 claim timeouts.
    let cut_at = Instant::now();
    proxy.set_refuse(true);
    proxy.drop_connections();
    let r2 = runs.clone();
    let b = direct
        .consume(
            &queue,
            move |d: Delivery| {
                r2.lock().unwrap().push(("B", Instant::now(), d.lease.is_lost()));
                async move {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    Decision::Ack
                }
            },
            fast(1_000).with_concurrency(2),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let snapshot = runs.lock().unwrap().clone();
    let b_start = snapshot.iter().find(|r| r.0 == "B").map(|r| r.1);
    let a_after: Vec<_> = snapshot
        .iter()
        .filter(|r| r.0 == "A" && r.1 >= cut_at + Duration::from_millis(1_000))
        .map(|r| (r.1.duration_since(cut_at), r.2))
        .collect();
    let a_during_b: usize = b_start.map_or(0, |bs| snapshot.iter().filter(|r| r.0 == "A" && r.1 > bs).count());
    eprintln!(
        "B started at {:?} after the cut; A runs started later than claim_timeout after its last contact (offset, lost-at-start): {a_after:?}; A runs started while B ran: {a_during_b}",
        b_start.map(|t| t.duration_since(cut_at))
    );
    proxy.set_refuse(false);
    assert!(b_start.is_some(), "peer never took over");
    assert!(
        a_during_b == 0,
        "A started {a_during_b} new runs of a message that the peer was running (A's waiting lease was redelivered locally after it could have expired)"
    );
    drop(a);
    b.close().await;
}

// ------------------------------------------------------------------------------------------------
// 5. drain() whose budget runs out: the handler keeps running unrenewed; a peer takes the message
//    over. Is the running handler ever told (Lease::lost)? What does its late ack say?
// ------------------------------------------------------------------------------------------------

async fn drained_handler_is_told_when_a_peer_takes_over(b: TestBackend) {
    init_tracing();
    let ms = stream_for(&b).await;
    let queue = queue_name("brk-drain");
    ms.offer(&queue, "x").await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel::<(bool, Result<(), QueueError>)>();
    let started = Arc::new(tokio::sync::Notify::new());
    let st = started.clone();
    let a = ms
        .consume(
            &queue,
            move |d: Delivery| {
                let tx = tx.clone();
                let st = st.clone();
                async move {
                    st.notify_one();
                    let lost = tokio::time::timeout(Duration::from_secs(3), d.lease.lost()).await.is_ok();
                    let r = d.lease.ack().await;
                    let _ = tx.send((lost, r));
                    Decision::Deferred
                }
            },
            fast(500).with_concurrency(2),
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), started.notified()).await.unwrap();
    let report = a.drain(Duration::from_millis(100)).await;
    assert_eq!(report.in_flight.len(), 1);
    let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let ran2 = ran.clone();
    let peer = ms
        .consume(
            &queue,
            move |_d: Delivery| {
                ran2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                futures::future::ready(Decision::Ack)
            },
            fast(500).with_concurrency(2),
        )
        .await
        .unwrap();
    let (lost, r) = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.unwrap().unwrap();
    let peer_ran = ran.load(std::sync::atomic::Ordering::SeqCst);
    eprintln!("[{}] peer ran it {peer_ran} time(s); drained handler told lost: {lost}; its late ack: {r:?}", b.name());
    peer.close().await;
    // The drained handler is told at once that its lease is no longer renewed; its ack within one
    // claim timeout applies (the peer then never runs it), or, if the peer took it first, is
    // refused. Never both runs acked.
    assert!(
        lost,
        "[{}] the drained consumer's handler was never told (Lease::lost never resolved); late ack {r:?}",
        b.name()
    );
    match (&r, peer_ran) {
        (Ok(()), 0) | (Err(QueueError::LeaseLost(_)), 1) => {}
        _ => panic!("[{}] peer ran it {peer_ran} time(s) and the drained handler's ack said {r:?}", b.name()),
    }
}

baton_testkit::on_memory_and_standalone!(drained_handler_is_told_when_a_peer_takes_over);

// ------------------------------------------------------------------------------------------------
// 6. More pending entries owned but not held (Lease::mark_acked without an ack, documented as
//    handed back by the heartbeat) than the heartbeat's XPENDING window: a held lease with a
//    higher id is reported lost although this consumer still owns it.
// ------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_lease_not_reported_lost_when_unheld_entries_fill_the_window() {
    require_redis();
    init_tracing();
    let server = RedisServer::start();
    let queue = queue_name("brk-window");
    let ms = redis_stream(server.config()).await;
    let mut conn = RedisClient::new(server.config()).unwrap().shared().await.unwrap();
    let junk: Vec<bytes::Bytes> = (0..200).map(|i| bytes::Bytes::from(format!("junk-{i}"))).collect();
    ms.offer_batch(&queue, junk).await.unwrap();
    let target = ms.offer(&queue, "target").await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel::<bool>();
    let c = ms
        .consume(
            &queue,
            move |d: Delivery| {
                let tx = tx.clone();
                async move {
                    if d.payload.starts_with(b"junk") {
                        // Documented: the entry stays pending here unheld; the heartbeat hands it back.
                        d.lease.mark_acked().unwrap();
                        return Decision::Deferred;
                    }
                    let lost = tokio::time::timeout(Duration::from_millis(1_500), d.lease.lost()).await.is_ok();
                    let _ = tx.send(lost);
                    let _ = d.lease.ack().await;
                    Decision::Deferred
                }
            },
            fast(4_000).with_concurrency(4).with_heartbeat_interval(Duration::from_millis(200)),
        )
        .await
        .unwrap();
    let lost = tokio::time::timeout(Duration::from_secs(20), rx.recv()).await.unwrap().unwrap();
    let owners = pending_owners(&mut conn, &queue).await;
    let target_owner = owners.iter().find(|o| o.0 == target.to_string()).map(|o| o.1.clone());
    eprintln!(
        "target lease reported lost: {lost}; counters {:?}; target's owner now {target_owner:?} (consumer {}); {} pending",
        c.counters(),
        c.name(),
        owners.len()
    );
    assert!(
        !lost && c.counters().leases_lost == 0,
        "a lease this consumer still owns was reported lost (leases_lost={})",
        c.counters().leases_lost
    );
    drop(c);
}

// ------------------------------------------------------------------------------------------------
// 7. Redis SIGSTOP for 3 claim timeouts while a live consumer holds a lease, with a peer: the hold
//    must keep the peer off; a waiting (short RetryAfter) lease too.
// ------------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_pause_longer_than_claim_timeout_never_fails_over_live_work() {
    require_redis();
    init_tracing();
    let server = RedisServer::start();
    let queue = queue_name("brk-rpause");
    let ms = redis_stream(server.config()).await;
    let held = ms.offer(&queue, "held").await.unwrap();
    let waiting = ms.offer(&queue, "waiting").await.unwrap();
    let runs: Arc<Mutex<Vec<(&'static str, MessageId)>>> = Arc::default();
    let leases: Arc<Mutex<Vec<Lease>>> = Arc::default();
    let (r1, l1) = (runs.clone(), leases.clone());
    let a = ms
        .consume(
            &queue,
            move |d: Delivery| {
                r1.lock().unwrap().push(("A", d.id));
                if d.payload.as_ref() == b"held" {
                    l1.lock().unwrap().push(d.lease.clone());
                    futures::future::ready(Decision::Deferred)
                } else {
                    futures::future::ready(Decision::RetryAfter(Duration::from_millis(300)))
                }
            },
            fast(1_000).with_concurrency(4),
        )
        .await
        .unwrap();
    let both = eventually(Duration::from_secs(5), || async { (runs.lock().unwrap().len() >= 2).then_some(()) }).await;
    assert!(both.is_some());
    let r2 = runs.clone();
    let b = ms
        .consume(
            &queue,
            move |d: Delivery| {
                r2.lock().unwrap().push(("B", d.id));
                futures::future::ready(Decision::Ack)
            },
            fast(1_000).with_concurrency(4),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.pause();
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    server.resume();
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let rs = runs.lock().unwrap().clone();
    let b_runs: Vec<_> = rs.iter().filter(|r| r.0 == "B").collect();
    let lost = leases.lock().unwrap().iter().any(|l| l.is_lost());
    eprintln!("B ran {b_runs:?}; held lease lost: {lost}; A {:?}; B {:?}", a.counters(), b.counters());
    assert!(b_runs.is_empty(), "peer ran live work after a Redis pause: {b_runs:?} (held {held}, waiting {waiting})");
    assert!(!lost && a.counters().leases_lost == 0);
    leases.lock().unwrap().clear();
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_processing_time_release_races_peer() {
    require_redis();
    init_tracing();
    let server = RedisServer::start();
    let queue = queue_name("brk-mpt");
    let ms = redis_stream(server.config()).await;
    ms.offer(&queue, "x").await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel::<(bool, Result<(), QueueError>)>();
    let a = ms
        .consume(
            &queue,
            move |d: Delivery| {
                let tx = tx.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(1_500)).await;
                    let lost = d.lease.is_lost();
                    let r = d.lease.ack().await;
                    let _ = tx.send((lost, r));
                    Decision::Deferred
                }
            },
            fast(1_000).with_concurrency(2).with_max_processing_time(Duration::from_millis(600)),
        )
        .await
        .unwrap();
    let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let ran2 = ran.clone();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let b = ms
        .consume(
            &queue,
            move |_d: Delivery| {
                ran2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                futures::future::ready(Decision::Ack)
            },
            fast(1_000).with_concurrency(2),
        )
        .await
        .unwrap();
    let (lost, r) = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.unwrap().unwrap();
    eprintln!(
        "peer ran {}; A lost signal {lost}; A ack {r:?}; A {:?}",
        ran.load(std::sync::atomic::Ordering::SeqCst),
        a.counters()
    );
    assert_eq!(ran.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(lost && matches!(r, Err(QueueError::LeaseLost(_))));
    assert_eq!(a.counters().leases_expired, 1);
    a.close().await;
    b.close().await;
}

/// Past max_processing_time the lease is released; a peer takes the message at once and acks it;
/// the released handler acks right after: the ack must be refused (another consumer ran it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_lease_ack_after_peer_acked_is_refused() {
    require_redis();
    init_tracing();
    let server = RedisServer::start();
    let queue = queue_name("brk-mpt2");
    let ms = redis_stream(server.config()).await;
    ms.offer(&queue, "x").await.unwrap();
    let peer_done = Arc::new(tokio::sync::Notify::new());
    let (tx, mut rx) = mpsc::unbounded_channel::<Result<(), QueueError>>();
    let pd = peer_done.clone();
    let a = ms
        .consume(
            &queue,
            move |d: Delivery| {
                let (tx, pd) = (tx.clone(), pd.clone());
                async move {
                    d.lease.lost().await;
                    pd.notified().await;
                    let _ = tx.send(d.lease.ack().await);
                    Decision::Deferred
                }
            },
            fast(3_000).with_concurrency(2).with_max_processing_time(Duration::from_millis(1_200)),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let pd = peer_done.clone();
    let b = ms
        .consume(
            &queue,
            move |d: Delivery| {
                let pd = pd.clone();
                async move {
                    let r = d.lease.ack().await;
                    assert!(r.is_ok());
                    pd.notify_one();
                    Decision::Deferred
                }
            },
            fast(3_000).with_concurrency(2).with_poll_interval(Duration::from_millis(50)),
        )
        .await
        .unwrap();
    let r = tokio::time::timeout(Duration::from_secs(15), rx.recv()).await.unwrap().unwrap();
    eprintln!("released handler's ack after the peer acked: {r:?}; A {:?}; B {:?}", a.counters(), b.counters());
    assert!(
        matches!(r, Err(QueueError::LeaseLost(_))),
        "peer ran and acked the message, yet the released handler's ack returned {r:?}"
    );
    a.close().await;
    b.close().await;
}
