//! Breaker tests of the concurrency caps across real processes (Redis standalone and Cluster):
//! worker processes (this test binary re-executed) with `concurrency_per_key = 1` and
//! `max_concurrency`, SIGKILLed or SIGSTOPped while they hold key slots, one of them running
//! handlers that block their thread. Each key's entries must run one at a time and in order,
//! every entry must end once, and no slot or waiter may be left behind.

use crate::common;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use baton_queue::{
    keys, ConsumerOptions, Decision, Delivery, MessageStream, OfferOptions, RedisQueueOptions, RemoteOptions,
};
use baton_redis::{redis, RedisClient, RedisConfig, RedisConn, RedisServers};
use baton_testkit::{require_redis, RedisCluster, RedisServer};
use common::*;

fn events_key(queue: &str) -> String {
    format!("events:{{{queue}}}")
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// The worker side: runs only when re-executed by a test with `BATON_CHILD=1`.
#[test]
#[ignore = "worker process entry point, started by the tests in this file"]
fn flow_child_worker() {
    if std::env::var("BATON_CHILD").is_err() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let cfg = match std::env::var("BATON_REDIS_CLUSTER") {
            Ok(urls) => RedisConfig::cluster(urls.split(',')),
            Err(_) => RedisConfig::standalone(std::env::var("BATON_REDIS_URL").unwrap()),
        };
        let env = |k: &str| std::env::var(k).unwrap().parse::<u64>().unwrap();
        let queue = std::env::var("BATON_QUEUE").unwrap();
        let (sleep_ms, perkey, maxc, block) =
            (env("BATON_SLEEP_MS"), env("BATON_PERKEY"), env("BATON_MAXC"), env("BATON_BLOCK"));
        let (claim_ms, poll_ms) = (env("BATON_CLAIM_MS"), env("BATON_POLL_MS"));
        let client = RedisClient::new(cfg).unwrap();
        let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
        let conn = client.shared().await.unwrap();
        let key = events_key(&queue);
        let pid = std::process::id();
        if std::env::var("BATON_REMOTE").is_ok() {
            // A remote worker's serving process: claims in a loop, records what it hands out.
            let rc = s
                .remote_consumer(
                    &queue,
                    "remote-w",
                    RemoteOptions {
                        claim_timeout: Duration::from_millis(claim_ms),
                        max_concurrency: (maxc > 0).then_some(maxc as u32),
                        ..RemoteOptions::default()
                    },
                )
                .await
                .unwrap();
            println!("READY {pid}");
            let mut conn = conn.clone();
            loop {
                for d in rc.claim(1, Duration::from_millis(poll_ms)).await.unwrap_or_default() {
                    let p = String::from_utf8_lossy(&d.payload).into_owned();
                    let _: () = redis::cmd("RPUSH")
                        .arg(&key)
                        .arg(format!("start {pid} {p} {}", now_ms()))
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    let _: () = redis::cmd("RPUSH")
                        .arg(&key)
                        .arg(format!("end {pid} {p} {}", now_ms()))
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    let _ = rc.ack(d.id, d.fence).await;
                }
            }
        }
        let _c = s
            .consume(
                &queue,
                move |d: Delivery| {
                    let (mut conn, key) = (conn.clone(), key.clone());
                    async move {
                        let p = String::from_utf8_lossy(&d.payload).into_owned();
                        let _: () = redis::cmd("RPUSH")
                            .arg(&key)
                            .arg(format!("start {pid} {p} {}", now_ms()))
                            .query_async(&mut conn)
                            .await
                            .unwrap();
                        if block == 1 {
                            std::thread::sleep(Duration::from_millis(sleep_ms));
                        } else {
                            tokio::time::sleep(Duration::from_millis(sleep_ms)).await;
                        }
                        let _: () = redis::cmd("RPUSH")
                            .arg(&key)
                            .arg(format!("end {pid} {p} {}", now_ms()))
                            .query_async(&mut conn)
                            .await
                            .unwrap();
                        Decision::Ack
                    }
                },
                {
                    let o = ConsumerOptions::new()
                        .with_claim_timeout(Duration::from_millis(claim_ms))
                        .with_reap_idle_consumers_after(None)
                        .with_concurrency(4)
                        .with_concurrency_per_key((perkey > 0).then_some(perkey as u32))
                        .with_max_concurrency((maxc > 0).then_some(maxc as u32));
                    if poll_ms > 0 {
                        o.with_poll_interval(Duration::from_millis(poll_ms))
                    } else {
                        o
                    }
                },
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

fn spawn_worker(cfg: &RedisConfig, queue: &str, sleep_ms: u64, perkey: u32, maxc: u32, block: bool) -> Worker {
    spawn_worker_with(cfg, queue, sleep_ms, perkey, maxc, block, 1_000, 0, false)
}

/// A remote worker's serving process (claim loop) instead of an in-process consumer.
fn spawn_remote_worker(cfg: &RedisConfig, queue: &str, maxc: u32, claim_ms: u64, wait_ms: u64) -> Worker {
    spawn_worker_with(cfg, queue, 0, 0, maxc, false, claim_ms, wait_ms, true)
}

#[allow(clippy::too_many_arguments)]
fn spawn_worker_with(
    cfg: &RedisConfig,
    queue: &str,
    sleep_ms: u64,
    perkey: u32,
    maxc: u32,
    block: bool,
    claim_ms: u64,
    poll_ms: u64,
    remote: bool,
) -> Worker {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    if remote {
        cmd.env("BATON_REMOTE", "1");
    }
    cmd.args(["--exact", "flow_processes::flow_child_worker", "--include-ignored", "--nocapture", "--test-threads=1"])
        .env("BATON_CHILD", "1")
        .env("BATON_QUEUE", queue)
        .env("BATON_SLEEP_MS", sleep_ms.to_string())
        .env("BATON_PERKEY", perkey.to_string())
        .env("BATON_MAXC", maxc.to_string())
        .env("BATON_BLOCK", if block { "1" } else { "0" })
        .env("BATON_CLAIM_MS", claim_ms.to_string())
        .env("BATON_POLL_MS", poll_ms.to_string())
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
        if let Some((_, p)) = line.split_once("READY ") {
            break p.trim().parse().unwrap();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Worker { child, pid }
}

/// One handler run: (pid, payload, start ms, end ms or None).
type Run = (u32, String, u64, Option<u64>);

async fn runs(conn: &mut RedisConn, queue: &str) -> Vec<Run> {
    let ev: Vec<String> = redis::cmd("LRANGE").arg(events_key(queue)).arg(0).arg(-1).query_async(conn).await.unwrap();
    let mut out: Vec<Run> = Vec::new();
    for e in ev {
        let f: Vec<&str> = e.split(' ').collect();
        let (pid, p, t): (u32, &str, u64) = (f[1].parse().unwrap(), f[2], f[3].parse().unwrap());
        if f[0] == "start" {
            out.push((pid, p.to_string(), t, None));
        } else {
            let r = out.iter_mut().find(|r| r.0 == pid && r.1 == p && r.3.is_none()).expect("a start before its end");
            r.3 = Some(t);
        }
    }
    out
}

async fn cap_state(conn: &mut RedisConn, q: &str) -> (u64, u64, u64) {
    let p = keys::DEFAULT_PREFIX;
    let held: u64 = redis::cmd("HLEN").arg(keys::key_held(p, q)).query_async(conn).await.unwrap();
    let ids: u64 = redis::cmd("HLEN").arg(keys::key_holders(p, q)).query_async(conn).await.unwrap();
    let waiting: u64 = redis::cmd("ZCARD").arg(keys::key_waiting(p, q)).query_async(conn).await.unwrap();
    (held, ids, waiting)
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
    key_lines_survive_sigkill_of_a_slot_holder,
    key_lines_survive_sigstop_of_a_slot_holder,
    a_read_answered_while_its_process_was_stopped_does_not_run,
    a_remote_claim_answered_while_its_process_was_stopped_hands_out_nothing_taken_over,
);

const KEYS: usize = 4;
const PER_KEY: usize = 5;

/// Offers KEYS × PER_KEY entries (payload `k<key>/<seq>`), interleaved.
async fn offer_all(s: &MessageStream, q: &str) {
    for i in 0..PER_KEY {
        for k in 0..KEYS {
            let key = format!("k{k}");
            s.offer_with(
                q,
                format!("{key}/{i}"),
                OfferOptions { concurrency_key: Some(key.clone()), ..Default::default() },
            )
            .await
            .unwrap();
        }
    }
}

/// Every entry ended; per key no two runs overlap (a run cut by `cut` ends at that time) and the
/// first runs start in offer order; at most `maxc` at once. Runs in `skip` are left out of the
/// overlap checks (a SIGSTOPped process's run of an entry taken over while it was stopped).
fn check(all: &[Run], cut: Option<(u32, u64)>, skip: &[(u32, String)], maxc: usize) {
    let end_of = |r: &Run| r.3.or(cut.filter(|c| c.0 == r.0).map(|c| c.1));
    for k in 0..KEYS {
        for i in 0..PER_KEY {
            let p = format!("k{k}/{i}");
            let ended = all.iter().filter(|r| r.1 == p && r.3.is_some()).count();
            assert!(ended >= 1, "{p} never ended: {all:?}");
        }
    }
    let live: Vec<&Run> = all.iter().filter(|r| !skip.iter().any(|s| s.0 == r.0 && s.1 == r.1)).collect();
    let mut by_key: BTreeMap<String, Vec<&Run>> = BTreeMap::new();
    for r in &live {
        by_key.entry(r.1.split('/').next().unwrap().to_string()).or_default().push(r);
    }
    for (k, rs) in &by_key {
        let mut rs = rs.clone();
        rs.sort_by_key(|r| r.2);
        for w in rs.windows(2) {
            let end = end_of(w[0]).unwrap_or_else(|| panic!("run never ended and not cut: {:?}", w[0]));
            assert!(w[1].2 >= end, "key {k}: {:?} started before {:?} ended", w[1], w[0]);
        }
        let mut firsts: Vec<usize> = Vec::new();
        for r in &rs {
            let seq: usize = r.1.split('/').nth(1).unwrap().parse().unwrap();
            if !firsts.contains(&seq) {
                firsts.push(seq);
            }
        }
        assert_eq!(firsts, (0..PER_KEY).collect::<Vec<_>>(), "key {k} out of order");
    }
    let mut edges: Vec<(u64, i32)> = Vec::new();
    for r in &live {
        edges.push((r.2, 1));
        edges.push((end_of(r).unwrap_or_else(|| panic!("run never ended: {r:?} in {all:?}")), -1));
    }
    edges.sort_by_key(|e| (e.0, e.1));
    let (mut n, mut most) = (0, 0);
    for (_, d) in edges {
        n += d;
        most = most.max(n);
    }
    assert!(most as usize <= maxc, "{most} ran at once (max_concurrency {maxc})");
}

async fn wait_all_ended(conn: &mut RedisConn, q: &str, within: Duration) -> Vec<Run> {
    let got = eventually(within, || {
        let mut conn = conn.clone();
        let q = q.to_string();
        async move {
            let rs = runs(&mut conn, &q).await;
            let ended: std::collections::HashSet<&String> = rs.iter().filter(|r| r.3.is_some()).map(|r| &r.1).collect();
            (ended.len() == KEYS * PER_KEY).then_some(())
        }
    })
    .await;
    let rs = runs(conn, q).await;
    assert!(got.is_some(), "not every entry ended: {rs:?}");
    rs
}

async fn settled(s: &MessageStream, conn: &mut RedisConn, q: &str) {
    let ok = eventually(Duration::from_secs(5), || {
        let (s, mut conn, q) = (s.clone(), conn.clone(), q.to_string());
        async move {
            let st = s.stats(&q).await.unwrap();
            ((st.length, st.pending) == (0, 0) && cap_state(&mut conn, &q).await == (0, 0, 0)).then_some(())
        }
    })
    .await;
    let st = s.stats(q).await.unwrap();
    assert!(ok.is_some(), "left behind: {st:?}, caps {:?}", cap_state(conn, q).await);
}

/// Three workers (one blocking its threads in handlers) with `concurrency_per_key = 1` and
/// `max_concurrency = 3`; the process that started first is SIGKILLed mid-run.
async fn key_lines_survive_sigkill_of_a_slot_holder(cfg: RedisConfig) {
    let q = queue_name("flow-kill");
    let mut workers = vec![
        spawn_worker(&cfg, &q, 250, 1, 3, false),
        spawn_worker(&cfg, &q, 250, 1, 3, true),
        spawn_worker(&cfg, &q, 250, 1, 3, false),
    ];
    let client = RedisClient::new(cfg).unwrap();
    let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let mut conn = client.shared().await.unwrap();
    offer_all(&s, &q).await;
    let first = eventually(Duration::from_secs(5), || {
        let mut conn = conn.clone();
        let q = q.clone();
        async move { runs(&mut conn, &q).await.into_iter().next() }
    })
    .await
    .expect("a worker started");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let idx = workers.iter().position(|w| w.pid == first.0).expect("known worker");
    let mut victim = workers.remove(idx);
    victim.child.kill().unwrap();
    victim.child.wait().unwrap();
    let cut = now_ms();
    let all = wait_all_ended(&mut conn, &q, Duration::from_secs(25)).await;
    // No entry completes twice: the killed process's runs never ended.
    let mut ends: HashMap<&String, usize> = HashMap::new();
    for r in all.iter().filter(|r| r.3.is_some()) {
        *ends.entry(&r.1).or_default() += 1;
    }
    assert!(ends.values().all(|n| *n == 1), "an entry ended twice: {all:?}");
    check(&all, Some((first.0, cut)), &[], 3);
    settled(&s, &mut conn, &q).await;
}

/// The same with the first process SIGSTOPped for 3 claim timeouts, then resumed: its entry is
/// taken over; its own run of it resumes and ends (a lost lease: its ack is refused), and every
/// slot passes on.
async fn key_lines_survive_sigstop_of_a_slot_holder(cfg: RedisConfig) {
    let q = queue_name("flow-stop");
    let workers = [
        spawn_worker(&cfg, &q, 250, 1, 3, false),
        spawn_worker(&cfg, &q, 250, 1, 3, true),
        spawn_worker(&cfg, &q, 250, 1, 3, false),
    ];
    let client = RedisClient::new(cfg).unwrap();
    let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let mut conn = client.shared().await.unwrap();
    offer_all(&s, &q).await;
    let first = eventually(Duration::from_secs(5), || {
        let mut conn = conn.clone();
        let q = q.clone();
        async move { runs(&mut conn, &q).await.into_iter().next() }
    })
    .await
    .expect("a worker started");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let victim = workers.iter().find(|w| w.pid == first.0).expect("known worker");
    let pid = victim.pid.to_string();
    assert!(Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    let stopped_at = now_ms();
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    assert!(Command::new("kill").args(["-CONT", &pid]).status().unwrap().success());
    let resumed_at = now_ms();
    let all = wait_all_ended(&mut conn, &q, Duration::from_secs(25)).await;
    // The stopped process's runs in flight while it was stopped were taken over: leave them out.
    let skip: Vec<(u32, String)> =
        all.iter().filter(|r| r.0 == victim.pid && r.2 <= stopped_at + 50).map(|r| (r.0, r.1.clone())).collect();
    let _ = resumed_at;
    check(&all, None, &skip, 3 + skip.len());
    settled(&s, &mut conn, &q).await;
}

/// A worker blocked in its gated read (`max_concurrency` reached: waiting on the control stream,
/// its read pipelined behind the wait) is SIGSTOPped; a slot frees; Redis runs the pipelined read
/// and assigns the next entry to the stopped worker. A live consumer takes it over after the claim
/// timeout and acks it. When the worker resumes, the read's reply (3 s old, older than the claim
/// timeout) must not start a handler: the entry is done, another consumer ran it.
async fn a_read_answered_while_its_process_was_stopped_does_not_run(cfg: RedisConfig) {
    late_answer(cfg, false).await
}

/// The same for a remote worker's serving process blocked in a claim: the claim answered after
/// the resume must not hand the worker the entry a peer took over and acked.
async fn a_remote_claim_answered_while_its_process_was_stopped_hands_out_nothing_taken_over(cfg: RedisConfig) {
    late_answer(cfg, true).await
}

async fn late_answer(cfg: RedisConfig, remote: bool) {
    let q = queue_name("flow-late");
    let client = RedisClient::new(cfg.clone()).unwrap();
    let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let mut conn = client.shared().await.unwrap();
    let p = keys::DEFAULT_PREFIX;
    let stream = keys::stream(p, &q);
    // The slot holder: a raw group member that looks alive forever (no consumer takes its entry).
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg(keys::DEFAULT_GROUP)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(&mut conn)
        .await
        .unwrap();
    let first = s.offer(&q, "first").await.unwrap().to_string();
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(keys::DEFAULT_GROUP)
        .arg("holder")
        .arg("COUNT")
        .arg(1)
        .arg("STREAMS")
        .arg(&stream)
        .arg(">")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(keys::consumers(p, &q))
        .arg("holder")
        .arg("99999999999999:600000")
        .query_async(&mut conn)
        .await
        .unwrap();
    // The worker: max_concurrency 1 (reached), claim timeout 2 s, its read blocking up to 2 s.
    let w = if remote {
        spawn_remote_worker(&cfg, &q, 1, 2_000, 2_000)
    } else {
        spawn_worker_with(&cfg, &q, 100, 0, 1, false, 2_000, 2_000, false)
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    s.offer(&q, "second").await.unwrap();
    assert!(Command::new("kill").args(["-STOP", &w.pid.to_string()]).status().unwrap().success());
    // Free the slot as caps.lua does (ack, then wake the reads waiting for a slot).
    let _: () = redis::pipe()
        .cmd("XACK")
        .arg(&stream)
        .arg(keys::DEFAULT_GROUP)
        .arg(&first)
        .ignore()
        .cmd("XDEL")
        .arg(&stream)
        .arg(&first)
        .ignore()
        .cmd("DEL")
        .arg(keys::slot_waiters(p, &q))
        .ignore()
        .cmd("XADD")
        .arg(keys::control(p, &q))
        .arg("MAXLEN")
        .arg(1)
        .arg("*")
        .arg("op")
        .arg("slot")
        .ignore()
        .query_async(&mut conn)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let owners = pending_owners(&mut conn, &q).await;
    assert_eq!(owners.len(), 1, "the stopped worker's pipelined read took the second entry: {owners:?}");
    assert_ne!(owners[0].1, "holder");
    // A live consumer takes it over after the claim timeout and runs it.
    let ran = Arc::new(Mutex::new(Vec::new()));
    let r2 = ran.clone();
    let t = s
        .consume(
            &q,
            move |d: Delivery| {
                r2.lock().unwrap().push(String::from_utf8_lossy(&d.payload).into_owned());
                futures::future::ready(Decision::Ack)
            },
            ConsumerOptions::new()
                .with_claim_timeout(Duration::from_millis(2_000))
                .with_reap_idle_consumers_after(None)
                .with_max_concurrency(Some(1)),
        )
        .await
        .unwrap();
    eventually(Duration::from_secs(8), || {
        let n = ran.lock().unwrap().len();
        async move { (n == 1).then_some(()) }
    })
    .await
    .expect("the live consumer took the entry over");
    assert!(Command::new("kill").args(["-CONT", &w.pid.to_string()]).status().unwrap().success());
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let all = runs(&mut conn, &q).await;
    assert!(all.is_empty(), "the resumed worker ran an entry another consumer had taken over and acked: {all:?}");
    assert_eq!(*ran.lock().unwrap(), ["second"]);
    t.drain(Duration::from_secs(2)).await;
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending), (0, 0));
}
