//! Real failure tests on Redis (standalone and Cluster): consumers in separate processes (this
//! test binary re-executed as a worker), killed with SIGKILL; Redis restarted; a connection cut
//! by a TCP proxy.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_queue::{keys, ConsumerOptions, Decision, Delivery, MessageStream, QueueError, RedisQueueOptions};
use baton_redis::{redis, RedisClient, RedisConfig, RedisConn, RedisServers};
use baton_testkit::{require_redis, RedisCluster, RedisServer, ServerOptions, TcpProxy};
use common::*;

fn events_key(queue: &str) -> String {
    format!("events:{{{queue}}}")
}

/// The worker side: runs only when re-executed by a test with `BATON_CHILD=1`.
#[test]
#[ignore = "worker process entry point, started by the tests in this file"]
fn child_worker() {
    if std::env::var("BATON_CHILD").is_err() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let cfg = match std::env::var("BATON_REDIS_CLUSTER") {
            Ok(urls) => RedisConfig::cluster(urls.split(',')),
            Err(_) => RedisConfig::standalone(std::env::var("BATON_REDIS_URL").unwrap()),
        };
        let queue = std::env::var("BATON_QUEUE").unwrap();
        let sleep_ms: u64 = std::env::var("BATON_SLEEP_MS").unwrap().parse().unwrap();
        let client = RedisClient::new(cfg).unwrap();
        let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
        let conn = client.shared().await.unwrap();
        let key = events_key(&queue);
        let pid = std::process::id();
        let _c = s
            .consume(
                &queue,
                move |d: Delivery| {
                    let (mut conn, key) = (conn.clone(), key.clone());
                    async move {
                        let _: () = redis::cmd("RPUSH")
                            .arg(&key)
                            .arg(format!("start:{pid}:{}", d.id))
                            .query_async(&mut conn)
                            .await
                            .unwrap();
                        tokio::time::sleep(Duration::from_millis(sleep_ms)).await;
                        let _: () = redis::cmd("RPUSH")
                            .arg(&key)
                            .arg(format!("end:{pid}:{}", d.id))
                            .query_async(&mut conn)
                            .await
                            .unwrap();
                        Decision::Ack
                    }
                },
                ConsumerOptions::new()
                    .with_claim_timeout(Duration::from_millis(1_000))
                    .with_reap_idle_consumers_after(None),
            )
            .await
            .unwrap();
        println!("READY {pid}");
        tokio::time::sleep(Duration::from_secs(600)).await;
    });
}

struct Worker {
    child: Child,
    pid: u32,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_worker(cfg: &RedisConfig, queue: &str, sleep_ms: u64) -> Worker {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "processes::child_worker", "--include-ignored", "--nocapture", "--test-threads=1"])
        .env("BATON_CHILD", "1")
        .env("BATON_QUEUE", queue)
        .env("BATON_SLEEP_MS", sleep_ms.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    match &cfg.servers {
        RedisServers::Standalone(url) => cmd.env("BATON_REDIS_URL", url),
        RedisServers::Cluster(urls) => cmd.env("BATON_REDIS_CLUSTER", urls.join(",")),
        RedisServers::Sentinel { .. } => unreachable!("these tests run standalone and Cluster"),
    };
    let mut child = cmd.spawn().expect("spawn worker");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let pid = loop {
        let line = lines.next().expect("worker exited before READY").unwrap();
        // libtest may print "test child_worker ... " on the same line first.
        if let Some((_, p)) = line.split_once("READY ") {
            break p.trim().parse().unwrap();
        }
    };
    // Keep draining its stdout so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Worker { child, pid }
}

async fn events(conn: &mut RedisConn, queue: &str) -> Vec<String> {
    redis::cmd("LRANGE").arg(events_key(queue)).arg(0).arg(-1).query_async(conn).await.unwrap()
}

macro_rules! on_redis {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn standalone() {
                require_redis();
                let s = RedisServer::start();
                super::$name(s.config()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cluster() {
                require_redis();
                let c = RedisCluster::start();
                super::$name(c.config()).await
            }
        }
    )*};
}

on_redis!(
    long_handler_in_two_processes_runs_once,
    sigkilled_consumer_fails_over_to_other_process,
    paused_queue_across_three_processes,
    sigkill_in_priority_mode_across_three_processes_loses_nothing
);

/// Three worker processes; the queue is paused while one runs a job, then that process is
/// SIGKILLed: another process takes the job over during the pause, while the jobs offered during
/// the pause start nowhere; after the resume they start at once.
async fn paused_queue_across_three_processes(cfg: RedisConfig) {
    let q = queue_name("procs-pause");
    let mut workers: Vec<Worker> = (0..3).map(|_| spawn_worker(&cfg, &q, 30_000)).collect();
    let client = RedisClient::new(cfg).unwrap();
    let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let mut conn = client.shared().await.unwrap();
    let job = s.offer(&q, "job").await.unwrap();
    let first = eventually(Duration::from_secs(5), || {
        let mut conn = conn.clone();
        let q = q.clone();
        async move { events(&mut conn, &q).await.into_iter().next() }
    })
    .await
    .expect("a worker started the job");
    assert!(s.pause(&q).await.unwrap());
    let waiting = s.offer_batch(&q, vec!["w1".into(), "w2".into(), "w3".into()]).await.unwrap();
    let pid: u32 = first.split(':').nth(1).unwrap().parse().unwrap();
    let idx = workers.iter().position(|w| w.pid == pid).expect("known worker");
    let mut victim = workers.remove(idx);
    victim.child.kill().unwrap(); // SIGKILL
    victim.child.wait().unwrap();
    let second = eventually(Duration::from_secs(5), || {
        let mut conn = conn.clone();
        let q = q.clone();
        async move { events(&mut conn, &q).await.into_iter().nth(1) }
    })
    .await
    .expect("another worker took the job over during the pause");
    assert!(second.ends_with(&format!(":{job}")) && !second.contains(&format!(":{pid}:")), "{second}");
    // Two more claim timeouts: the jobs offered during the pause start nowhere.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let ev = events(&mut conn, &q).await;
    assert_eq!(ev.len(), 2, "only the first job ran: {ev:?}");
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.paused, st.lag, st.pending, st.consumers), (true, 3, 1, 2), "{st:?}");
    let resumed = Instant::now();
    assert!(s.resume(&q).await.unwrap());
    let ev = eventually(Duration::from_secs(5), || {
        let mut conn = conn.clone();
        let q = q.clone();
        async move { Some(events(&mut conn, &q).await).filter(|e| e.len() >= 5) }
    })
    .await
    .expect("the waiting jobs started after the resume");
    assert!(resumed.elapsed() < Duration::from_secs(2), "started {:?} after the resume", resumed.elapsed());
    for id in waiting {
        assert_eq!(ev.iter().filter(|e| e.ends_with(&format!(":{id}"))).count(), 1, "{id} once: {ev:?}");
    }
}

/// Two worker processes, a handler running 5× the 1 s claim timeout: exactly one run, one owner.
async fn long_handler_in_two_processes_runs_once(cfg: RedisConfig) {
    let q = queue_name("procs-long");
    let _w1 = spawn_worker(&cfg, &q, 5_000);
    let _w2 = spawn_worker(&cfg, &q, 5_000);
    let client = RedisClient::new(cfg).unwrap();
    let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let mut conn = client.shared().await.unwrap();
    s.offer(&q, "job").await.unwrap();
    let mut owners = std::collections::BTreeSet::new();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(5_600) {
        for (_, owner, deliveries) in pending_owners(&mut conn, &q).await {
            assert_eq!(deliveries, 1, "never redelivered");
            owners.insert(owner);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ev = eventually(Duration::from_secs(3), || {
        let mut conn = conn.clone();
        let q = q.clone();
        async move { Some(events(&mut conn, &q).await).filter(|e| e.len() >= 2) }
    })
    .await
    .expect("start and end recorded");
    assert_eq!(ev.len(), 2, "{ev:?}");
    assert!(ev[0].starts_with("start:") && ev[1].starts_with("end:"), "{ev:?}");
    assert_eq!(owners.len(), 1, "one owner throughout: {owners:?}");
    assert_eq!(s.stats(&q).await.unwrap().length, 0);
}

/// The process running the handler is killed with SIGKILL: the other process gets the message
/// within claim_timeout + 1 s.
async fn sigkilled_consumer_fails_over_to_other_process(cfg: RedisConfig) {
    let q = queue_name("procs-kill");
    let mut workers = vec![spawn_worker(&cfg, &q, 30_000), spawn_worker(&cfg, &q, 30_000)];
    let client = RedisClient::new(cfg).unwrap();
    let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let mut conn = client.shared().await.unwrap();
    s.offer(&q, "job").await.unwrap();
    let first = eventually(Duration::from_secs(5), || {
        let mut conn = conn.clone();
        let q = q.clone();
        async move { events(&mut conn, &q).await.into_iter().next() }
    })
    .await
    .expect("a worker started the job");
    let pid: u32 = first.split(':').nth(1).unwrap().parse().unwrap();
    let idx = workers.iter().position(|w| w.pid == pid).expect("known worker");
    let mut victim = workers.remove(idx);
    victim.child.kill().unwrap(); // SIGKILL
    victim.child.wait().unwrap();
    let killed_at = Instant::now();
    let second = eventually(Duration::from_secs(5), || {
        let mut conn = conn.clone();
        let q = q.clone();
        async move { events(&mut conn, &q).await.into_iter().nth(1) }
    })
    .await
    .expect("the other worker took over");
    let after = killed_at.elapsed();
    let other_pid = workers[0].pid;
    assert!(second.starts_with(&format!("start:{other_pid}:")), "{second}");
    assert!(after <= Duration::from_millis(2_000), "taken over {after:?} after SIGKILL (claim timeout 1 s)");
    let owners = pending_owners(&mut conn, &q).await;
    assert_eq!(owners.len(), 1);
    assert_eq!(owners[0].2, 2, "second delivery");
}

/// Offers "after" once the producer's connection has reconnected (retrying for up to 10 s).
async fn offer_after_restart(s: &MessageStream, q: &str) {
    let t0 = Instant::now();
    loop {
        match s.offer(q, "after").await {
            Ok(_) => return,
            Err(e) => {
                assert!(t0.elapsed() < Duration::from_secs(10), "offer never recovered: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Redis restarted with no persistence: the group is recreated and new work flows, with no
/// restart of the consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_without_persistence_recreates_the_group() {
    require_redis();
    let mut server = RedisServer::start();
    let s =
        MessageStream::redis(RedisClient::new(server.config()).unwrap(), RedisQueueOptions::default()).await.unwrap();
    let q = queue_name("restart");
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let s2 = seen.clone();
    let _c = s
        .consume(
            &q,
            move |d: Delivery| {
                let seen = s2.clone();
                async move {
                    seen.lock().unwrap().push(String::from_utf8_lossy(&d.payload).into_owned());
                    Decision::Ack
                }
            },
            ConsumerOptions::new().with_claim_timeout(Duration::from_secs(2)).with_reap_idle_consumers_after(None),
        )
        .await
        .unwrap();
    s.offer(&q, "before").await.unwrap();
    eventually(Duration::from_secs(5), || {
        let n = seen.lock().unwrap().len();
        async move { (n == 1).then_some(()) }
    })
    .await
    .expect("processed before the restart");
    server.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart();
    offer_after_restart(&s, &q).await;
    eventually(Duration::from_secs(10), || {
        let v = seen.lock().unwrap().clone();
        async move { (v == ["before", "after"]).then_some(()) }
    })
    .await
    .unwrap_or_else(|| panic!("new work after the restart: {:?}", seen.lock().unwrap()));
}

/// Redis restarted with AOF (appendfsync always) while a handler runs: the pending entry
/// survives, the handler's ack after the restart succeeds, new work flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_with_aof_keeps_pending_work() {
    require_redis();
    let mut server = RedisServer::start_with(ServerOptions { appendonly: true });
    let client = RedisClient::new(server.config()).unwrap();
    let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let q = queue_name("aof");
    let runs = Arc::new(Mutex::new(Vec::<(String, Result<(), String>)>::new()));
    let r2 = runs.clone();
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let (runs, started_tx) = (r2.clone(), started_tx.clone());
                async move {
                    let p = String::from_utf8_lossy(&d.payload).into_owned();
                    if p == "long" {
                        started_tx.send(()).unwrap();
                        tokio::time::sleep(Duration::from_secs(3)).await;
                    }
                    let r = d.lease.ack().await.map_err(|e| e.to_string());
                    runs.lock().unwrap().push((p, r));
                    Decision::Deferred
                }
            },
            ConsumerOptions::new().with_claim_timeout(Duration::from_secs(3)).with_reap_idle_consumers_after(None),
        )
        .await
        .unwrap();
    s.offer(&q, "long").await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), started_rx.recv()).await.unwrap();
    server.kill();
    server.restart();
    offer_after_restart(&s, &q).await;
    eventually(Duration::from_secs(10), || {
        let n = runs.lock().unwrap().len();
        async move { (n == 2).then_some(()) }
    })
    .await
    .unwrap_or_else(|| panic!("both done: {:?}", runs.lock().unwrap()));
    let mut got = runs.lock().unwrap().clone();
    got.sort();
    assert_eq!(got, vec![("after".to_string(), Ok(())), ("long".to_string(), Ok(()))]);
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending), (0, 0));
    assert_eq!(c.counters().reclaimed, 0, "the surviving lease was never reclaimed");
}

/// A consumer cut off from Redis (its connections dropped and refused by a proxy) for longer
/// than the claim timeout: a peer takes the message; when the link heals, the stale owner's
/// renewal finds the lease lost (it never takes it back) and its ack is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_owner_can_neither_renew_nor_ack() {
    require_redis();
    let server = RedisServer::start();
    let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let proxy = TcpProxy::start(target).await;
    let via_proxy = RedisConfig::standalone(format!("redis://{}", proxy.addr()));
    let sa = MessageStream::redis(RedisClient::new(via_proxy).unwrap(), RedisQueueOptions::default()).await.unwrap();
    let sb =
        MessageStream::redis(RedisClient::new(server.config()).unwrap(), RedisQueueOptions::default()).await.unwrap();
    let q = queue_name("partition");
    let opts =
        || ConsumerOptions::new().with_claim_timeout(Duration::from_millis(1_000)).with_reap_idle_consumers_after(None);
    let (atx, mut arx) = tokio::sync::mpsc::unbounded_channel();
    let a = sa
        .consume(
            &q,
            move |d: Delivery| {
                let atx = atx.clone();
                async move {
                    atx.send(d.lease.clone()).unwrap();
                    Decision::Deferred
                }
            },
            opts(),
        )
        .await
        .unwrap();
    sb.offer(&q, "x").await.unwrap();
    let a_lease = tokio::time::timeout(Duration::from_secs(5), arx.recv()).await.unwrap().unwrap();
    let (btx, mut brx) = tokio::sync::mpsc::unbounded_channel();
    let _b = sb
        .consume(
            &q,
            move |d: Delivery| {
                let btx = btx.clone();
                async move {
                    btx.send(d.lease.clone()).unwrap();
                    Decision::Deferred
                }
            },
            opts(),
        )
        .await
        .unwrap();
    proxy.set_refuse(true);
    proxy.drop_connections();
    let b_lease = tokio::time::timeout(Duration::from_secs(5), brx.recv()).await.expect("B took over").unwrap();
    assert_eq!(b_lease.id(), a_lease.id());
    proxy.set_refuse(false);
    // A's heartbeat reconnects, finds the entry owned by B, and signals the loss.
    tokio::time::timeout(Duration::from_secs(10), a_lease.lost()).await.expect("A told its lease is lost");
    assert!(a.counters().leases_lost >= 1);
    let mut conn = RedisClient::new(server.config()).unwrap().shared().await.unwrap();
    let owners = pending_owners(&mut conn, &q).await;
    assert_eq!(owners.len(), 1);
    assert_ne!(owners[0].1, a.name(), "the stale owner never took it back");
    // Give A's command connection time to reconnect too (its lease thread keeps using it).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let r = a_lease.ack().await;
    assert!(matches!(r, Err(QueueError::LeaseLost(_))), "{r:?}");
    b_lease.ack().await.unwrap();
    assert_eq!(sb.stats(&q).await.unwrap().length, 0);
}

/// An entry deleted from the stream while pending (e.g. by an operator's XDEL) is cleaned from
/// the pending list by the next reclaim tick (XAUTOCLAIM, Redis 7: deleted entries are dropped
/// before the idle check, so this happens well before the 2 s claim timeout) and never delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_pending_entries_are_cleaned() {
    require_redis();
    let server = RedisServer::start();
    let client = RedisClient::new(server.config()).unwrap();
    let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let q = queue_name("deleted");
    let calls = Arc::new(Mutex::new(0u32));
    let c2 = calls.clone();
    let _c = s
        .consume(
            &q,
            move |_d: Delivery| {
                let calls = c2.clone();
                async move {
                    *calls.lock().unwrap() += 1;
                    Decision::Retry
                }
            },
            ConsumerOptions::new()
                .with_claim_timeout(Duration::from_millis(2_000))
                .with_reap_idle_consumers_after(None),
        )
        .await
        .unwrap();
    let id = s.offer(&q, "x").await.unwrap();
    eventually(Duration::from_secs(3), || {
        let n = *calls.lock().unwrap();
        async move { (n == 1).then_some(()) }
    })
    .await
    .expect("delivered once");
    // Pending before the delete (checked before it: after it, a reclaim tick may already have
    // dropped the entry, which is what this test waits for).
    assert_eq!(s.stats(&q).await.unwrap().pending, 1, "in the pending list");
    let mut conn = client.shared().await.unwrap();
    let deleted: i64 = redis::cmd("XDEL")
        .arg(keys::stream(keys::DEFAULT_PREFIX, &q))
        .arg(id.to_string())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(deleted, 1, "the entry was in the stream");
    eventually(Duration::from_secs(3), || {
        let s = s.clone();
        let q = q.clone();
        async move { s.stats(&q).await.ok().filter(|st| st.pending == 0) }
    })
    .await
    .expect("cleaned by the reclaim tick");
    assert_eq!(*calls.lock().unwrap(), 1, "never delivered again");
}

/// Three worker processes take 60 entries of mixed priorities (through the ready set); the one
/// that started first is SIGKILLed right after its read: every entry ends exactly once (the
/// victim's in another process after the claim timeout), and nothing is left in the stream, the
/// pending list or the ready set.
async fn sigkill_in_priority_mode_across_three_processes_loses_nothing(cfg: RedisConfig) {
    let q = queue_name("procs-prio");
    let mut workers: Vec<Worker> = (0..3).map(|_| spawn_worker(&cfg, &q, 300)).collect();
    let client = RedisClient::new(cfg).unwrap();
    let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let mut conn = client.shared().await.unwrap();
    assert!(s.pause(&q).await.unwrap());
    for i in 0..60 {
        let o = baton_queue::OfferOptions { priority: (i % 5) as i8 - 2, ..Default::default() };
        s.offer_with(&q, format!("e{i}"), o).await.unwrap();
    }
    assert!(s.resume(&q).await.unwrap());
    let first = eventually(Duration::from_secs(5), || {
        let mut conn = conn.clone();
        let q = q.clone();
        async move { events(&mut conn, &q).await.into_iter().next() }
    })
    .await
    .expect("a worker started");
    let pid: u32 = first.split(':').nth(1).unwrap().parse().unwrap();
    let idx = workers.iter().position(|w| w.pid == pid).expect("known worker");
    let mut victim = workers.remove(idx);
    victim.child.kill().unwrap(); // SIGKILL
    victim.child.wait().unwrap();
    let ends = |ev: &[String]| ev.iter().filter(|e| e.starts_with("end:")).count();
    let ev = eventually(Duration::from_secs(20), || {
        let mut conn = conn.clone();
        let q = q.clone();
        async move { Some(events(&mut conn, &q).await).filter(|e| ends(e) >= 60) }
    })
    .await
    .unwrap_or_else(|| panic!("60 ends expected"));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let ev2 = events(&mut conn, &q).await;
    assert_eq!(ends(&ev2), 60, "no entry ran twice to its end: {ev:?}");
    let mut ids: Vec<&str> =
        ev2.iter().filter(|e| e.starts_with("end:")).map(|e| e.rsplit(':').next().unwrap()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 60, "60 distinct entries ended");
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.lag), (0, 0, 0), "{st:?}");
    let ready: u64 =
        redis::cmd("ZCARD").arg(keys::ready(keys::DEFAULT_PREFIX, &q)).query_async(&mut conn).await.unwrap();
    assert_eq!(ready, 0);
}
