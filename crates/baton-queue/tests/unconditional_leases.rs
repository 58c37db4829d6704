//! Leases that hold whatever the handlers do to their runtime, failover that new work cannot
//! starve, `RetryAfter` below the poll interval, consumers that leave the group and close their
//! connections when stopped, and reaping that never removes a live consumer.
//!
//! Public API and Redis only (`XINFO CONSUMERS`, `XPENDING`, `CLIENT LIST`); real `redis-server`
//! processes; worker processes are this test binary re-executed (`lease_child_worker`).
//!
//! Tests that burn CPU or spawn many processes take `HEAVY.write()` and never run beside another
//! test of this file, so that the timing bounds of the others (`HEAVY.read()`) hold on a 2-core
//! machine.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use baton_queue::{ConsumerCounters, ConsumerOptions, Decision, Delivery, MessageId, MessageStream, RedisQueueOptions};
use baton_redis::{redis, RedisClient, RedisConfig, RedisConn, RedisServers};
use baton_testkit::{require_redis, RedisServer, TestBackend};
use bytes::Bytes;
use common::*;

static HEAVY: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"))
}

fn events_key(queue: &str) -> String {
    format!("lease-events:{{{queue}}}")
}

/// Blocks the calling thread for `d`: a synchronous sleep, or a busy loop on the CPU.
fn block_thread(d: Duration, spin: bool) {
    if spin {
        let t0 = Instant::now();
        let mut x = 0u64;
        while t0.elapsed() < d {
            for i in 0..1_000u64 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
            }
        }
        std::hint::black_box(x);
    } else {
        std::thread::sleep(d);
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

fn counters_line(c: &ConsumerCounters) -> String {
    format!(
        "delivered={} reclaimed={} acked={} retried={} dead_lettered={} renewals={} renewal_failures={} leases_lost={} leases_expired={}",
        c.delivered,
        c.reclaimed,
        c.acked,
        c.retried,
        c.dead_lettered,
        c.renewals,
        c.renewal_failures,
        c.leases_lost,
        c.leases_expired
    )
}

fn parse_kv(line: &str) -> HashMap<String, u64> {
    line.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect()
}

// ------------------------------------------------------------------------------------------------
// Worker processes
// ------------------------------------------------------------------------------------------------

/// The worker side: runs only when re-executed by a test of this file with `BATON_LEASE_CHILD`.
#[test]
#[ignore = "worker process entry point, started by the tests in this file"]
fn lease_child_worker() {
    let Ok(mode) = std::env::var("BATON_LEASE_CHILD") else { return };
    match mode.as_str() {
        "blocking" => child_blocking(),
        "restart" => child_restart(),
        other => panic!("unknown BATON_LEASE_CHILD mode {other:?}"),
    }
}

fn child_config() -> RedisConfig {
    match std::env::var("BATON_REDIS_CLUSTER") {
        Ok(urls) => RedisConfig::cluster(urls.split(',')),
        Err(_) => RedisConfig::standalone(env("BATON_REDIS_URL")),
    }
}

/// A consumer on a 2-worker runtime, concurrency 8, whose handlers block their thread (sleep or
/// spin, as the payload says) for `BATON_BLOCK_MS`, then ack (through `Decision::Ack` or through
/// `Lease::ack`, as the payload says). Every run's start and end goes to a Redis list, with the
/// ack's result and whether the lease was reported lost. On SIGTERM it lets running handlers
/// finish, prints its counters (`COUNTERS …`) and closes its consumer.
fn child_blocking() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let queue = env("BATON_QUEUE");
        let claim = Duration::from_millis(env("BATON_CLAIM_MS").parse().unwrap());
        let block = Duration::from_millis(env("BATON_BLOCK_MS").parse().unwrap());
        let client = RedisClient::new(child_config()).unwrap();
        let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
        let conn = client.shared().await.unwrap();
        let key = events_key(&queue);
        let pid = std::process::id();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
        let c = s
            .consume(
                &queue,
                move |d: Delivery| {
                    let (mut conn, key) = (conn.clone(), key.clone());
                    async move {
                        let tag = String::from_utf8_lossy(&d.payload).into_owned();
                        let _: redis::RedisResult<()> = redis::cmd("RPUSH")
                            .arg(&key)
                            .arg(format!("start {pid} {} {tag} at={} deliveries={}", d.id, now_ms(), d.deliveries))
                            .query_async(&mut conn)
                            .await;
                        block_thread(block, tag.contains("spin"));
                        if tag.contains("lease") {
                            let r = d.lease.ack().await;
                            let outcome = match r {
                                Ok(()) => "ok".to_string(),
                                Err(e) => format!("err:{}", e.to_string().replace(' ', "_")),
                            };
                            let _: redis::RedisResult<()> = redis::cmd("RPUSH")
                                .arg(&key)
                                .arg(format!(
                                    "end {pid} {} {tag} ack={outcome} lost={} at={}",
                                    d.id,
                                    d.lease.is_lost(),
                                    now_ms()
                                ))
                                .query_async(&mut conn)
                                .await;
                            Decision::Deferred
                        } else {
                            let _: redis::RedisResult<()> = redis::cmd("RPUSH")
                                .arg(&key)
                                .arg(format!(
                                    "end {pid} {} {tag} ack=decision lost={} at={}",
                                    d.id,
                                    d.lease.is_lost(),
                                    now_ms()
                                ))
                                .query_async(&mut conn)
                                .await;
                            Decision::Ack
                        }
                    }
                },
                ConsumerOptions::new()
                    .with_claim_timeout(claim)
                    .with_concurrency(8)
                    .with_reap_idle_consumers_after(None),
            )
            .await
            .unwrap();
        println!("READY {pid} {}", c.name());
        term.recv().await;
        // Let running handlers finish and settle, then report (drain consumes the consumer).
        let t0 = Instant::now();
        while !c.in_flight().is_empty() && t0.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let in_flight = c.in_flight().len();
        let counters = c.counters();
        c.close().await;
        println!("COUNTERS pid={pid} in_flight_at_exit={in_flight} {}", counters_line(&counters));
    });
}

/// A consumer (claim timeout 250 ms, reap after 500 ms) with 50 ms handlers; on SIGTERM it closes
/// its consumer gracefully, prints `CLOSED` and exits.
fn child_restart() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let queue = env("BATON_QUEUE");
        let client = RedisClient::new(child_config()).unwrap();
        let s = MessageStream::redis(client, RedisQueueOptions::default()).await.unwrap();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
        let c = s
            .consume(
                &queue,
                |_d: Delivery| async {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Decision::Ack
                },
                ConsumerOptions::new()
                    .with_claim_timeout(RESTART_CLAIM)
                    .with_concurrency(2)
                    .with_reap_idle_consumers_after(Some(RESTART_REAP)),
            )
            .await
            .unwrap();
        println!("READY {} {}", std::process::id(), c.name());
        term.recv().await;
        let report = c.close().await;
        println!("CLOSED in_flight={}", report.in_flight.len());
    });
}

struct Worker {
    child: Child,
    pid: u32,
    name: String,
    lines: mpsc::Receiver<String>,
}

impl Worker {
    fn sigterm(&self) {
        baton_testkit::sigterm(self.pid);
    }

    /// The first line of its stdout starting with `prefix` (libtest may print `test … ` before
    /// it on the same line), within `timeout`.
    fn line(&self, prefix: &str, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    if let Some(i) = l.find(prefix) {
                        return Some(l[i..].to_string());
                    }
                }
                Err(_) => return None,
            }
        }
    }

    /// Waits for the process to exit, up to `timeout`; kills it after that.
    fn wait_exit(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                return true;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_worker(mode: &str, cfg: &RedisConfig, queue: &str, vars: &[(&str, String)]) -> Worker {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "lease_child_worker", "--include-ignored", "--nocapture", "--test-threads=1"])
        .env("BATON_LEASE_CHILD", mode)
        .env("BATON_QUEUE", queue)
        .env_remove("BATON_REDIS_URL")
        .env_remove("BATON_REDIS_CLUSTER")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    match &cfg.servers {
        RedisServers::Standalone(url) => cmd.env("BATON_REDIS_URL", url),
        RedisServers::Cluster(urls) => cmd.env("BATON_REDIS_CLUSTER", urls.join(",")),
        RedisServers::Sentinel { .. } => unreachable!("these tests run standalone and Cluster"),
    };
    let mut child = cmd.spawn().expect("spawn worker");
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let mut w = Worker { child, pid: 0, name: String::new(), lines: rx };
    let ready = w.line("READY ", Duration::from_secs(30)).expect("worker exited before READY");
    let mut parts = ready.split_whitespace().skip(1);
    w.pid = parts.next().unwrap().parse().unwrap();
    w.name = parts.next().unwrap().to_string();
    w
}

// ------------------------------------------------------------------------------------------------
// 1. Blocking and spinning handlers never run twice (two worker processes)
// ------------------------------------------------------------------------------------------------

/// Claim timeout of the blocking tests; handlers block 5x as long. The report used 1 s and
/// 5 s; the ratio is what matters, and the smaller values fit more rounds into the time budget.
/// The heartbeat (claim timeout / 3 = 100 ms) still has 200 ms of slack before a lease expires.
const BLOCK_CLAIM: Duration = Duration::from_millis(300);
const BLOCK_FOR: Duration = Duration::from_millis(1_500);
/// Messages per round, offered one every `TRICKLE` so reads return work while the runtimes are
/// blocked.
const PER_ROUND: usize = 8;
const TRICKLE: Duration = Duration::from_millis(300);
/// Rounds per backend: 6 on each Redis backend (the report ran 20 rounds, 160 messages;
/// each round here takes 5–11 s, and these tests run one at a time, so they set this binary's
/// time in CI) and 2 on memory (`blocking_and_spinning_handlers_never_run_twice_in_one_process`).
/// The code before the lease thread ran some message twice in every Redis round of this shape.
const REDIS_ROUNDS: usize = 6;
const MEMORY_ROUNDS: usize = 2;

fn round_payload(round: usize, i: usize) -> String {
    // (MSRV 1.85: no `is_multiple_of`.)
    let how = if i % 2 == 1 { "spin" } else { "sleep" };
    let settle = if (i / 2) % 2 == 1 { "lease" } else { "decision" };
    format!("r{round}-m{i}-{how}-{settle}")
}

#[derive(Debug, Clone)]
struct Run {
    start: bool,
    pid: String,
    id: String,
    rest: String,
}

fn parse_runs(events: &[String]) -> Vec<Run> {
    events
        .iter()
        .map(|e| {
            let mut p = e.splitn(4, ' ');
            let kind = p.next().unwrap_or_default();
            Run {
                start: kind == "start",
                pid: p.next().unwrap_or_default().to_string(),
                id: p.next().unwrap_or_default().to_string(),
                rest: p.next().unwrap_or_default().to_string(),
            }
        })
        .collect()
}

/// Problems in the recorded runs: messages that ran other than once, runs that ended with a
/// refused ack or a lost-lease signal.
fn run_problems(runs: &[Run], expected: &[MessageId]) -> Vec<String> {
    let mut by_id: BTreeMap<String, Vec<&Run>> = BTreeMap::new();
    for r in runs.iter().filter(|r| r.start) {
        by_id.entry(r.id.clone()).or_default().push(r);
    }
    let mut out = Vec::new();
    for id in expected {
        let n = by_id.get(&id.to_string()).map_or(0, Vec::len);
        if n != 1 {
            let pids: Vec<&str> =
                by_id.get(&id.to_string()).map(|v| v.iter().map(|r| r.pid.as_str()).collect()).unwrap_or_default();
            out.push(format!("message {id} ran {n} times (pids {pids:?})"));
        }
    }
    for r in runs.iter().filter(|r| !r.start) {
        if r.rest.contains("ack=err") || r.rest.contains("lost=true") {
            out.push(format!("run of {} in pid {} ended with {}", r.id, r.pid, r.rest));
        }
    }
    out
}

async fn lrange(conn: &mut RedisConn, key: &str) -> Vec<String> {
    redis::cmd("LRANGE").arg(key).arg(0).arg(-1).query_async(conn).await.unwrap()
}

/// SIGTERMs the workers and collects their `COUNTERS` lines.
fn stop_and_collect(workers: &mut [Worker]) -> Vec<(u32, HashMap<String, u64>, String)> {
    for w in workers.iter() {
        w.sigterm();
    }
    workers
        .iter_mut()
        .map(|w| {
            let line = w.line("COUNTERS ", Duration::from_secs(20)).unwrap_or_else(|| "COUNTERS missing".into());
            w.wait_exit(Duration::from_secs(5));
            (w.pid, parse_kv(&line), line)
        })
        .collect()
}

baton_testkit::on_redis!(blocking_and_spinning_handlers_never_run_twice);

/// Two worker processes, each a 2-worker runtime with concurrency 8 (so more handlers than
/// threads), whose handlers alternately `std::thread::sleep` and busy-spin for 5x the claim
/// timeout, then ack. Every message must run exactly once; no lease may be reported lost (no
/// other consumer ever ran the message) and no ack may be refused.
async fn blocking_and_spinning_handlers_never_run_twice(b: TestBackend) {
    let _heavy = HEAVY.write().await;
    let cfg = b.redis_config().unwrap();
    let q = queue_name("blocking");
    let vars = [
        ("BATON_CLAIM_MS", BLOCK_CLAIM.as_millis().to_string()),
        ("BATON_BLOCK_MS", BLOCK_FOR.as_millis().to_string()),
    ];
    let mut workers = vec![spawn_worker("blocking", &cfg, &q, &vars), spawn_worker("blocking", &cfg, &q, &vars)];
    let client = RedisClient::new(cfg).unwrap();
    let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let mut conn = client.shared().await.unwrap();
    let key = events_key(&q);
    let mut all_ids = Vec::new();
    let mut problems = Vec::new();
    let t0 = Instant::now();
    for round in 0..REDIS_ROUNDS {
        for i in 0..PER_ROUND {
            all_ids.push(s.offer(&q, round_payload(round, i)).await.unwrap());
            tokio::time::sleep(TRICKLE).await;
        }
        // The round is over when everything is acked and every run that started has ended.
        let done = eventually(Duration::from_secs(30), || {
            let (s, q, key, mut conn) = (s.clone(), q.clone(), key.clone(), conn.clone());
            let ids = all_ids.clone();
            async move {
                let st = s.stats(&q).await.ok()?;
                let runs = parse_runs(&lrange(&mut conn, &key).await);
                let started: HashSet<&str> = runs.iter().filter(|r| r.start).map(|r| r.id.as_str()).collect();
                let ends = runs.iter().filter(|r| !r.start).count();
                let all_started = ids.iter().all(|id| started.contains(id.to_string().as_str()));
                (st.length == 0 && st.pending == 0 && all_started && ends == runs.len() - ends).then_some(())
            }
        })
        .await;
        if done.is_none() {
            let runs = parse_runs(&lrange(&mut conn, &key).await);
            problems.push(format!("round {round} did not finish within 30 s: {:?}, runs {runs:?}", s.stats(&q).await));
        }
        eprintln!("[{}] round {round} done at {:?}", b.name(), t0.elapsed());
        if done.is_none() {
            break;
        }
    }
    // A run that starts late (from a read whose reply was processed late) shows up here too.
    tokio::time::sleep(BLOCK_FOR + BLOCK_CLAIM * 2).await;
    let runs = parse_runs(&lrange(&mut conn, &key).await);
    problems.extend(run_problems(&runs, &all_ids));
    let reports = stop_and_collect(&mut workers);
    let acked: u64 = reports.iter().map(|(_, kv, _)| kv.get("acked").copied().unwrap_or(0)).sum();
    for (pid, kv, line) in &reports {
        if kv.is_empty() {
            problems.push(format!("pid {pid} did not report its counters"));
        } else if kv.get("leases_lost") != Some(&0) {
            problems.push(format!("pid {pid} reported lost leases: {line}"));
        }
    }
    if problems.is_empty() && acked != all_ids.len() as u64 {
        problems.push(format!("{acked} acks counted for {} messages", all_ids.len()));
    }
    assert!(
        problems.is_empty(),
        "[{}] handlers blocking their runtime for 5x the claim timeout:\n  {}\nworker counters:\n  {}",
        b.name(),
        problems.join("\n  "),
        reports.iter().map(|r| r.2.clone()).collect::<Vec<_>>().join("\n  ")
    );
}

// ------------------------------------------------------------------------------------------------
// 2. The same in one process, on the memory backend
// ------------------------------------------------------------------------------------------------

/// Two consumers in this process on one 2-worker runtime (concurrency 8 each), handlers that
/// alternately sleep and spin for 5x the claim timeout: every message runs exactly once, no lost
/// lease, no refused ack.
#[test]
fn blocking_and_spinning_handlers_never_run_twice_in_one_process() {
    let _heavy = HEAVY.blocking_write();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let s = MessageStream::memory();
    let q = queue_name("blocking-mem");
    #[derive(Debug, Clone)]
    struct MemRun {
        start: bool,
        consumer: usize,
        id: MessageId,
        outcome: String,
    }
    let runs: Arc<Mutex<Vec<MemRun>>> = Arc::default();
    let mk = |consumer: usize| {
        let runs = runs.clone();
        move |d: Delivery| {
            let runs = runs.clone();
            async move {
                let tag = String::from_utf8_lossy(&d.payload).into_owned();
                runs.lock().unwrap().push(MemRun { start: true, consumer, id: d.id, outcome: String::new() });
                block_thread(BLOCK_FOR, tag.contains("spin"));
                let (outcome, decision) = if tag.contains("lease") {
                    let r = d.lease.ack().await;
                    (format!("ack={r:?} lost={}", d.lease.is_lost()), Decision::Deferred)
                } else {
                    (format!("ack=decision lost={}", d.lease.is_lost()), Decision::Ack)
                };
                runs.lock().unwrap().push(MemRun { start: false, consumer, id: d.id, outcome });
                decision
            }
        }
    };
    let opts = || fast(BLOCK_CLAIM.as_millis() as u64).with_concurrency(8);
    let (ca, cb) = rt
        .block_on(async { (s.consume(&q, mk(0), opts()).await.unwrap(), s.consume(&q, mk(1), opts()).await.unwrap()) });
    let mut ids = Vec::new();
    let mut problems = Vec::new();
    for round in 0..MEMORY_ROUNDS {
        for i in 0..PER_ROUND {
            // Offered from this thread (not a runtime worker): the memory backend needs no I/O.
            ids.push(futures::executor::block_on(s.offer(&q, round_payload(round, i))).unwrap());
            std::thread::sleep(TRICKLE);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let st = futures::executor::block_on(s.stats(&q)).unwrap();
            let r = runs.lock().unwrap().clone();
            let starts = r.iter().filter(|x| x.start).count();
            if st.length == 0 && st.pending == 0 && starts * 2 == r.len() && starts >= ids.len() {
                break;
            }
            if Instant::now() >= deadline {
                problems.push(format!("round {round} did not finish within 30 s: {st:?}"));
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if !problems.is_empty() {
            break;
        }
    }
    std::thread::sleep(BLOCK_FOR + BLOCK_CLAIM * 2);
    let r = runs.lock().unwrap().clone();
    let mut count: HashMap<MessageId, Vec<usize>> = HashMap::new();
    for x in r.iter().filter(|x| x.start) {
        count.entry(x.id).or_default().push(x.consumer);
    }
    for id in &ids {
        let by = count.get(id).cloned().unwrap_or_default();
        if by.len() != 1 {
            problems.push(format!("message {id} ran {} times (consumers {by:?})", by.len()));
        }
    }
    for x in r.iter().filter(|x| !x.start) {
        if !(x.outcome.contains("ack=Ok") || x.outcome.contains("ack=decision")) || x.outcome.contains("lost=true") {
            problems.push(format!("run of {} on consumer {} ended with {}", x.id, x.consumer, x.outcome));
        }
    }
    let (ka, kb) = (ca.counters(), cb.counters());
    for (n, k) in [("A", &ka), ("B", &kb)] {
        if k.leases_lost != 0 {
            problems.push(format!("consumer {n} reported {} lost leases", k.leases_lost));
        }
    }
    if problems.is_empty() && ka.acked + kb.acked != ids.len() as u64 {
        problems.push(format!("{} acks counted for {} messages", ka.acked + kb.acked, ids.len()));
    }
    drop(ca);
    drop(cb);
    assert!(
        problems.is_empty(),
        "[memory] handlers blocking their runtime for 5x the claim timeout:\n  {}\ncounters A: {}\ncounters B: {}",
        problems.join("\n  "),
        counters_line(&ka),
        counters_line(&kb)
    );
}

// ------------------------------------------------------------------------------------------------
// 3. A saturated survivor still takes over a dead consumer's work in time
// ------------------------------------------------------------------------------------------------

baton_testkit::on_every_backend!(saturated_survivor_takes_over_within_bound);

/// Messages the dead consumer holds: as many as the survivor's concurrency, so the survivor can
/// start them all at once.
const HELD: usize = 4;

/// Consumer A holds four messages and is aborted; consumer B (concurrency 4, ~50 ms handlers) is
/// kept saturated by a producer that keeps new work waiting. A's messages must start on B within
/// claim_timeout + one poll interval + 1.5 s of slack for scheduling on a loaded 2-core machine
/// (the issue's own example of slack). Today's reclaim asks for as many entries as there are free
/// slots, 0 while saturated, and the issue saw waits of 23-38 s.
async fn saturated_survivor_takes_over_within_bound(b: TestBackend) {
    let _shared = HEAVY.read().await;
    let s = stream_for(&b).await;
    let q = queue_name("saturated");
    let claim = Duration::from_millis(1_000);
    let opts = || fast(claim.as_millis() as u64);
    let poll = opts().poll();
    let held = s.offer_batch(&q, (0..HELD).map(|i| Bytes::from(format!("held-{i}"))).collect()).await.unwrap();
    let a = s
        .consume(
            &q,
            |_d: Delivery| async {
                tokio::time::sleep(Duration::from_secs(60)).await;
                Decision::Ack
            },
            opts().with_concurrency(HELD),
        )
        .await
        .unwrap();
    eventually(Duration::from_secs(5), || {
        let n = a.in_flight().len();
        async move { (n == HELD).then_some(()) }
    })
    .await
    .expect("A holds its messages");
    assert_eq!(a.in_flight(), held);

    let started: Arc<Mutex<HashMap<MessageId, Instant>>> = Arc::default();
    let st2 = started.clone();
    let runs = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let bc = s
        .consume(
            &q,
            move |d: Delivery| {
                let (started, runs) = (st2.clone(), runs.clone());
                async move {
                    started.lock().unwrap().entry(d.id).or_insert_with(Instant::now);
                    // 40-60 ms, so that B's slots do not all free up at the same instant.
                    let n = runs.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(40 + (n * 7) % 21)).await;
                    Decision::Ack
                }
            },
            opts().with_concurrency(4),
        )
        .await
        .unwrap();
    // A steady inflow: at least 40 new messages waiting at all times.
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (s, q, stop) = (s.clone(), q.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if s.stats(&q).await.map(|st| st.lag < 40).unwrap_or(false) {
                    s.offer_batch(&q, (0..40).map(|_| Bytes::from_static(b"new")).collect()).await.unwrap();
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    eventually(Duration::from_secs(5), || {
        let n = bc.in_flight().len();
        async move { (n == 4).then_some(()) }
    })
    .await
    .expect("B saturated");
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Saturated: every slot busy while work waits (sampled; a slot is free for the round trip
    // between an ack and the next read).
    let saturated = eventually(Duration::from_secs(2), || {
        let (s, q, busy) = (s.clone(), q.clone(), bc.in_flight().len());
        async move { s.stats(&q).await.ok().filter(|st| st.lag > 0 && busy == 4) }
    })
    .await;
    assert!(saturated.is_some(), "B is saturated with work waiting: {:?}", s.stats(&q).await);

    let aborted = Instant::now();
    a.abort();
    let bound = claim + poll + Duration::from_millis(1_500);
    eventually(bound + Duration::from_millis(300), || {
        let n = held.iter().filter(|id| started.lock().unwrap().contains_key(id)).count();
        let all = n == held.len();
        async move { all.then_some(()) }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    producer.await.unwrap();
    let got = started.lock().unwrap().clone();
    let report: Vec<String> = held
        .iter()
        .map(|id| match got.get(id) {
            Some(at) => format!("{id} after {:?}", at.duration_since(aborted)),
            None => format!("{id} not started after {:?}", aborted.elapsed()),
        })
        .collect();
    let late = held.iter().any(|id| got.get(id).is_none_or(|at| at.duration_since(aborted) > bound));
    assert!(
        !late,
        "[{}] a dead consumer's messages must start on the saturated survivor within {bound:?} \
         (claim timeout {claim:?} + poll {poll:?} + 1.5 s slack): {report:?}; survivor counters: {}",
        b.name(),
        counters_line(&bc.counters())
    );
}

// ------------------------------------------------------------------------------------------------
// 4. RetryAfter below the poll interval
// ------------------------------------------------------------------------------------------------

baton_testkit::on_every_backend!(retry_after_cadence_below_the_poll_interval);

/// Re-polls asked for by this many `RetryAfter(200 ms)` in a row (then Ack).
const REPOLLS: usize = 10;

/// A handler returns `RetryAfter(200 ms)` ten times, with the default claim timeout (30 s) and
/// (a) the default poll interval (1 s), (b) a poll interval of 50 ms. The gaps between deliveries
/// must be 200 ms within ±20 ms (the issue: ±20 ms or ±10 %, whichever is larger). A single gap
/// can be stretched by scheduling on a loaded 2-core machine, so the median is held to ±20 ms,
/// no gap may come early (below 180 ms), and the longest gap may be up to +60 ms. Today the
/// re-poll waits for the reclaim tick: about 1 s with the default poll interval.
async fn retry_after_cadence_below_the_poll_interval(b: TestBackend) {
    let _shared = HEAVY.read().await;
    let s = stream_for(&b).await;
    let delay = Duration::from_millis(200);
    let variants = [
        ("default poll interval", ConsumerOptions::new().with_reap_idle_consumers_after(None)),
        (
            "poll interval 50 ms",
            ConsumerOptions::new().with_reap_idle_consumers_after(None).with_poll_interval(Duration::from_millis(50)),
        ),
    ];
    let mut running = Vec::new();
    for (label, opts) in variants {
        let q = queue_name("cadence");
        let times: Arc<Mutex<Vec<Instant>>> = Arc::default();
        let t2 = times.clone();
        let c = s
            .consume(
                &q,
                move |_d: Delivery| {
                    let times = t2.clone();
                    async move {
                        let n = {
                            let mut t = times.lock().unwrap();
                            t.push(Instant::now());
                            t.len()
                        };
                        if n <= REPOLLS {
                            Decision::RetryAfter(delay)
                        } else {
                            Decision::Ack
                        }
                    }
                },
                opts,
            )
            .await
            .unwrap();
        s.offer(&q, "poll me").await.unwrap();
        running.push((label, c, times));
    }
    // Enough for every re-poll at +60 ms each, plus a second.
    let wait = (delay + Duration::from_millis(60)) * REPOLLS as u32 + Duration::from_secs(1);
    eventually(wait, || {
        let done = running.iter().all(|(_, _, t)| t.lock().unwrap().len() > REPOLLS);
        async move { done.then_some(()) }
    })
    .await;
    let lo = delay - Duration::from_millis(20);
    let hi = delay + Duration::from_millis(20);
    let max_hi = delay + Duration::from_millis(60);
    let mut problems = Vec::new();
    for (label, _c, times) in &running {
        let t = times.lock().unwrap().clone();
        let mut gaps: Vec<Duration> = t.windows(2).map(|w| w[1] - w[0]).collect();
        let shown: Vec<u128> = gaps.iter().map(|g| g.as_millis()).collect();
        if gaps.len() < REPOLLS {
            problems.push(format!(
                "{label}: only {} of {REPOLLS} re-polls within {wait:?}; gaps (ms) {shown:?}",
                gaps.len()
            ));
        }
        if gaps.is_empty() {
            continue;
        }
        gaps.sort();
        let median = gaps[gaps.len() / 2];
        let (min, max) = (gaps[0], gaps[gaps.len() - 1]);
        if median < lo || median > hi || min < lo || max > max_hi {
            problems.push(format!(
                "{label}: RetryAfter({delay:?}) redelivered after gaps (ms) {shown:?}: median {median:?}, min {min:?}, \
                 max {max:?}; expected median within {lo:?}..={hi:?}, none below {lo:?}, none above {max_hi:?}"
            ));
        }
    }
    assert!(problems.is_empty(), "[{}] {}", b.name(), problems.join("\n"));
}

// ------------------------------------------------------------------------------------------------
// 5. A consumer stopped gracefully while holding nothing leaves the group
// ------------------------------------------------------------------------------------------------

baton_testkit::on_every_backend!(graceful_close_leaves_the_group);

/// `close()` and `drain()` of a consumer that holds nothing remove it from the group at once
/// (`XINFO CONSUMERS` no longer lists it, `stats().consumers` drops); a consumer stopped while a
/// handler still holds an entry stays listed, as the owner of that entry.
async fn graceful_close_leaves_the_group(b: TestBackend) {
    let _shared = HEAVY.read().await;
    let s = stream_for(&b).await;
    let mut conn = conn_for(&b).await;
    let q = queue_name("leave");
    let quick = |_d: Delivery| async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        Decision::Ack
    };
    let mut problems = Vec::new();

    // close() of an idle consumer.
    let c1 = s.consume(&q, quick, fast(1_000)).await.unwrap();
    let n1 = c1.name().to_string();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(s.stats(&q).await.unwrap().consumers, 1);
    if let Some(conn) = conn.as_mut() {
        assert_eq!(consumer_names(conn, &q).await, vec![n1.clone()]);
    }
    let report = c1.close().await;
    assert!(report.in_flight.is_empty());
    let consumers = s.stats(&q).await.unwrap().consumers;
    if consumers != 0 {
        problems.push(format!("after close(): stats().consumers = {consumers}, expected 0"));
    }
    if let Some(conn) = conn.as_mut() {
        let names = consumer_names(conn, &q).await;
        if names.contains(&n1) {
            problems.push(format!("after close(): XINFO CONSUMERS still lists {n1}: {names:?}"));
        }
    }

    // drain(budget) of a consumer whose work is done.
    let c2 = s.consume(&q, quick, fast(1_000)).await.unwrap();
    let n2 = c2.name().to_string();
    s.offer_batch(&q, vec![Bytes::from("a"), Bytes::from("b")]).await.unwrap();
    eventually(Duration::from_secs(5), || {
        let s = s.clone();
        let q = q.clone();
        async move { s.stats(&q).await.ok().filter(|st| st.length == 0) }
    })
    .await
    .expect("both acked");
    let report = c2.drain(Duration::from_secs(1)).await;
    assert!(report.in_flight.is_empty());
    let consumers = s.stats(&q).await.unwrap().consumers;
    // c1 may still be listed (reported above); c2 must be gone too.
    let expected = if problems.is_empty() { 0 } else { 1 };
    if consumers != expected {
        problems.push(format!("after drain(): stats().consumers = {consumers}, expected {expected}"));
    }
    if let Some(conn) = conn.as_mut() {
        let names = consumer_names(conn, &q).await;
        if names.contains(&n2) {
            problems.push(format!("after drain(): XINFO CONSUMERS still lists {n2}: {names:?}"));
        }
    }

    // Stopped while a handler holds an entry: still listed, as its owner.
    let before = s.stats(&q).await.unwrap().consumers;
    let c3 = s
        .consume(
            &q,
            |_d: Delivery| async {
                tokio::time::sleep(Duration::from_secs(30)).await;
                Decision::Ack
            },
            fast(10_000),
        )
        .await
        .unwrap();
    let n3 = c3.name().to_string();
    let id = s.offer(&q, "held").await.unwrap();
    let held = eventually(Duration::from_secs(2), || {
        let n = c3.in_flight().len();
        async move { (n == 1).then_some(()) }
    })
    .await;
    if held.is_none() {
        // Someone else took it: a consumer stopped above whose blocking read is still waiting on
        // the server.
        let owners = match conn.as_mut() {
            Some(conn) => format!("{:?}", pending_owners(conn, &q).await),
            None => "?".into(),
        };
        problems.push(format!(
            "a new entry went to a consumer stopped earlier, not to the live {n3} (stopped: {n1}, {n2}; pending: {owners})"
        ));
        panic!("[{}] {}", b.name(), problems.join("\n"));
    }
    let report = c3.drain(Duration::ZERO).await;
    assert_eq!(report.in_flight, vec![id]);
    let consumers = s.stats(&q).await.unwrap().consumers;
    if consumers != before + 1 {
        problems.push(format!(
            "a consumer stopped while holding an entry must stay: consumers {consumers}, expected {}",
            before + 1
        ));
    }
    if let Some(conn) = conn.as_mut() {
        let listed = xinfo_consumers(conn, &q).await;
        if !listed.iter().any(|c| c.name == n3 && c.pending == 1) {
            problems.push(format!("{n3} stopped while holding {id} must stay listed as its owner: {listed:?}"));
        }
    }
    assert!(problems.is_empty(), "[{}] {}", b.name(), problems.join("\n"));
}

// ------------------------------------------------------------------------------------------------
// 6. Live idle consumers are never reaped
// ------------------------------------------------------------------------------------------------

baton_testkit::on_redis!(live_idle_consumers_are_never_reaped);

/// Two live consumers on an empty stream with a short reap window (claim timeout 200 ms, reap
/// after 400 ms) for 3 s (7 reap windows): `XINFO CONSUMERS` lists both at every look (every
/// ~50 ms), and both still consume afterwards.
async fn live_idle_consumers_are_never_reaped(b: TestBackend) {
    let _shared = HEAVY.read().await;
    let s = stream_for(&b).await;
    let mut conn = conn_for(&b).await.unwrap();
    let q = queue_name("live-idle");
    let opts = || {
        ConsumerOptions::new()
            .with_claim_timeout(Duration::from_millis(200))
            .with_reap_idle_consumers_after(Some(Duration::from_millis(400)))
            .with_concurrency(1)
    };
    let handler = |_d: Delivery| async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        Decision::Ack
    };
    let a = s.consume(&q, handler, opts()).await.unwrap();
    let c = s.consume(&q, handler, opts()).await.unwrap();
    let names = [a.name().to_string(), c.name().to_string()];
    let t0 = Instant::now();
    let mut absences: Vec<String> = Vec::new();
    let mut looks = 0;
    while t0.elapsed() < Duration::from_secs(3) {
        let listed = consumer_names(&mut conn, &q).await;
        looks += 1;
        for n in &names {
            if !listed.contains(n) {
                absences.push(format!("{n} missing at {:?}", t0.elapsed()));
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Both still consume: one message at a time, while the other consumer is busy.
    for i in 0..6 {
        s.offer(&q, format!("m{i}")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    eventually(Duration::from_secs(5), || {
        let s = s.clone();
        let q = q.clone();
        async move { s.stats(&q).await.ok().filter(|st| st.length == 0) }
    })
    .await
    .expect("all acked");
    let (ka, kc) = (a.counters(), c.counters());
    assert!(
        absences.is_empty(),
        "[{}] live idle consumers were removed from the group ({} absences in {looks} looks): {:?}",
        b.name(),
        absences.len(),
        &absences[..absences.len().min(10)]
    );
    assert!(ka.delivered > 0 && kc.delivered > 0, "both still consume: {ka:?} {kc:?}");
    assert_eq!(consumer_names(&mut conn, &q).await, {
        let mut n = names.to_vec();
        n.sort();
        n
    });
}

// ------------------------------------------------------------------------------------------------
// 7. Stopped consumers release their connections
// ------------------------------------------------------------------------------------------------

baton_testkit::on_redis!(stopped_consumers_release_their_connections);

/// 30 consumers started and stopped (a mix of drop, close, drain and abort): the number of client
/// connections on the Redis nodes is back to what it was before, exactly (within a 3 s settle).
async fn stopped_consumers_release_their_connections(b: TestBackend) {
    let _shared = HEAVY.read().await;
    let ports = redis_ports(&b);
    let s = stream_for(&b).await;
    let q = queue_name("conns");
    // The baseline is taken after one consumer has come and gone, so that whatever the stream
    // itself keeps open for consumers (its own connections, opened on first use) is in it; only
    // what each consumer leaves behind counts.
    let warm_up = s.consume(&q, |_d: Delivery| async { Decision::Ack }, fast(1_000)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    warm_up.close().await;
    s.stats(&q).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let baseline = client_connections(&ports);
    let mut consumers = Vec::new();
    for _ in 0..30 {
        consumers.push(
            s.consume(
                &q,
                |_d: Delivery| async {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Decision::Ack
                },
                fast(1_000),
            )
            .await
            .unwrap(),
        );
    }
    s.offer_batch(&q, (0..60).map(|i| Bytes::from(format!("m{i}"))).collect()).await.unwrap();
    eventually(Duration::from_secs(10), || {
        let s = s.clone();
        let q = q.clone();
        async move { s.stats(&q).await.ok().filter(|st| st.length == 0) }
    })
    .await
    .expect("all acked");
    let during = client_connections(&ports);
    let mut how = BTreeMap::new();
    for (i, c) in consumers.into_iter().enumerate() {
        let kind = ["drop", "close", "drain", "abort"][i % 4];
        *how.entry(kind).or_insert(0) += 1;
        match kind {
            "drop" => drop(c),
            "close" => {
                c.close().await;
            }
            "drain" => {
                c.drain(Duration::from_millis(100)).await;
            }
            _ => c.abort(),
        }
    }
    let settled = eventually(Duration::from_secs(3), || {
        let n = client_connections(&ports);
        async move { (n == baseline).then_some(n) }
    })
    .await;
    let after = client_connections(&ports);
    assert!(
        settled.is_some(),
        "[{}] client connections: {baseline} before, {during} with 30 consumers, {after} 3 s after stopping them \
         ({how:?}); expected {baseline}",
        b.name()
    );
}

// ------------------------------------------------------------------------------------------------
// 8. A restart loop leaves only live and recent consumers
// ------------------------------------------------------------------------------------------------

const RESTART_CLAIM: Duration = Duration::from_millis(250);
/// The shortest reap window allowed: twice the claim timeout.
const RESTART_REAP: Duration = Duration::from_millis(500);
const RESTARTS: usize = 100;

/// A worker process restarted 100 times (SIGTERM: it closes its consumer gracefully and exits;
/// every fifth time SIGKILL instead), two live at a time, with work flowing. Right after the loop
/// the group may list only: the live consumers, consumers still holding entries, and SIGKILLed
/// ones younger than the reap window (plus 500 ms for the reaper's own cadence and scheduling;
/// a consumer closed while it still held entries counts as SIGKILLed when it closed). A consumer
/// closed gracefully while holding nothing must be gone at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_leave_only_live_and_recent_consumers() {
    require_redis();
    let _heavy = HEAVY.write().await;
    let server = RedisServer::start();
    let cfg = server.config();
    let client = RedisClient::new(cfg.clone()).unwrap();
    let s = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let mut conn = client.shared().await.unwrap();
    let q = queue_name("restarts");
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (s, q, stop) = (s.clone(), q.clone(), stop.clone());
        tokio::spawn(async move {
            // Sparse work: most workers hold nothing when stopped, some hold an entry.
            while !stop.load(Ordering::Relaxed) {
                s.offer(&q, "w").await.unwrap();
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
        })
    };
    let spawn = |cfg: RedisConfig, q: String| async move {
        tokio::task::spawn_blocking(move || spawn_worker("restart", &cfg, &q, &[])).await.unwrap()
    };
    let mut live = std::collections::VecDeque::new();
    live.push_back(spawn(cfg.clone(), q.clone()).await);
    live.push_back(spawn(cfg.clone(), q.clone()).await);
    let mut closed: HashSet<String> = HashSet::new();
    let mut killed: Vec<(String, Instant)> = Vec::new();
    let t0 = Instant::now();
    for i in 0..RESTARTS {
        let mut old: Worker = live.pop_front().unwrap();
        let name = old.name.clone();
        if i % 5 == 4 {
            old = tokio::task::spawn_blocking(move || {
                let _ = old.child.kill();
                let _ = old.child.wait();
                old
            })
            .await
            .unwrap();
            killed.push((name, Instant::now()));
        } else {
            old.sigterm();
            let (w, line) = tokio::task::spawn_blocking(move || {
                let line = old.line("CLOSED ", Duration::from_secs(10));
                assert!(old.wait_exit(Duration::from_secs(10)), "worker did not exit within 10 s of SIGTERM");
                (old, line)
            })
            .await
            .unwrap();
            old = w;
            let line = line.expect("a SIGTERMed worker reports CLOSED");
            if parse_kv(&line).get("in_flight").copied().unwrap_or(0) > 0 {
                // Its entries are reclaimed after the claim timeout; until then and for a reap
                // window after, it may stay, like a SIGKILLed one.
                killed.push((name.clone(), Instant::now()));
            }
            closed.insert(name);
        }
        drop(old);
        live.push_back(spawn(cfg.clone(), q.clone()).await);
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    let loop_took = t0.elapsed();
    let listed = xinfo_consumers(&mut conn, &q).await;
    let now = Instant::now();
    let live_names: HashSet<String> = live.iter().map(|w| w.name.clone()).collect();
    // Stopped while holding entries (SIGKILL, or closed with work in flight) within the last reap
    // window, plus 500 ms for the reaper's own cadence and scheduling.
    let recent = RESTART_REAP + Duration::from_millis(500);
    let young_killed: HashSet<&str> =
        killed.iter().filter(|(_, at)| now.duration_since(*at) < recent).map(|(n, _)| n.as_str()).collect();
    let extra: Vec<String> = listed
        .iter()
        // `~parked` is the group's reserved owner of entries nobody holds, not a consumer.
        .filter(|c| c.name != baton_queue::keys::PARKED)
        .filter(|c| !live_names.contains(&c.name) && c.pending == 0 && !young_killed.contains(c.name.as_str()))
        .map(|c| {
            let stopped = killed.iter().find(|(n, _)| *n == c.name).map(|(_, at)| now.duration_since(*at));
            let what = if closed.contains(&c.name) {
                match stopped {
                    Some(ago) => format!("closed holding entries {ago:?} ago"),
                    None => "closed gracefully holding nothing".to_string(),
                }
            } else if let Some(ago) = stopped {
                format!("SIGKILLed {ago:?} ago")
            } else {
                "unknown".to_string()
            };
            format!("{} ({what}, idle {} ms)", c.name, c.idle_ms)
        })
        .collect();
    let allowed = live_names.len()
        + listed.iter().filter(|c| c.pending > 0 && !live_names.contains(&c.name)).count()
        + young_killed.len();
    let missing_live: Vec<&String> = live_names.iter().filter(|n| !listed.iter().any(|c| &c.name == *n)).collect();
    stop.store(true, Ordering::Relaxed);
    producer.await.unwrap();
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for e in &extra {
        let kind = if e.contains("holding nothing") {
            "closed holding nothing"
        } else if e.contains("closed holding entries") {
            "closed holding entries, long ago"
        } else if e.contains("SIGKILLed") {
            "SIGKILLed long ago"
        } else {
            "unknown"
        };
        *kinds.entry(kind).or_default() += 1;
    }
    assert!(
        extra.is_empty(),
        "after {RESTARTS} restarts ({loop_took:?}): {} consumers listed, at most {allowed} allowed \
         ({} live, holders of entries, {} stopped holding entries or SIGKILLed within {recent:?}); \
         {} not allowed: {kinds:?}; the first: {:?}",
        listed.len(),
        live_names.len(),
        young_killed.len(),
        extra.len(),
        &extra[..extra.len().min(5)]
    );
    assert!(missing_live.is_empty(), "live consumers missing from the group: {missing_live:?}");
    drop(live);
}

// ------------------------------------------------------------------------------------------------
// 9. Processes configured with different claim timeouts never take each other's live work or
//    reap each other; a consumer stopped while holding work leaves once that work is taken
// ------------------------------------------------------------------------------------------------

baton_testkit::on_every_backend!(
    mixed_claim_timeouts_never_take_live_work,
    stopped_holder_leaves_once_its_work_is_taken
);

/// Consumer L (claim timeout 3 s, heartbeat 1 s) runs one handler for 2.5 s; consumer S (claim
/// timeout 200 ms, reaping after 400 ms, reclaim ticks every ~67 ms) shares the queue. S must
/// never run L's message (L's entries go unrenewed for up to 1 s, five times S's claim timeout),
/// and S's reaper must never remove L (L holds nothing after its handler; its heartbeats are 1 s
/// apart, more than S's reap window).
async fn mixed_claim_timeouts_never_take_live_work(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("mixed");
    let runs = Arc::new(Mutex::new(Vec::<&'static str>::new()));
    let (rl, rs) = (runs.clone(), runs.clone());
    let long = s
        .consume(
            &q,
            move |_d: Delivery| {
                let runs = rl.clone();
                async move {
                    runs.lock().unwrap().push("L");
                    tokio::time::sleep(Duration::from_millis(2_500)).await;
                    Decision::Ack
                }
            },
            fast(3_000).with_concurrency(1),
        )
        .await
        .unwrap();
    s.offer(&q, "long").await.unwrap();
    eventually(Duration::from_secs(5), || {
        let n = long.in_flight().len();
        async move { (n == 1).then_some(()) }
    })
    .await
    .expect("L took it");
    let short = s
        .consume(
            &q,
            move |_d: Delivery| {
                let runs = rs.clone();
                async move {
                    runs.lock().unwrap().push("S");
                    Decision::Ack
                }
            },
            fast(200).with_reap_idle_consumers_after(Some(Duration::from_millis(400))),
        )
        .await
        .unwrap();
    // Through L's handler and two more of L's heartbeat intervals: both stay in the group.
    let t0 = Instant::now();
    let mut fewer = Vec::new();
    while t0.elapsed() < Duration::from_millis(4_500) {
        let n = s.stats(&q).await.unwrap().consumers;
        if n != 2 {
            fewer.push(format!("{n} consumers at {:?}", t0.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs, vec!["L"], "[{}] L's live message ran on S too", b.name());
    assert!(fewer.is_empty(), "[{}] a live consumer was reaped: {fewer:?}", b.name());
    assert_eq!(long.counters().leases_lost, 0);
    drop(short);
    long.close().await;
}

/// A consumer closed while its handler holds a message stays in the group (it owns the entry),
/// and leaves it as soon as a peer has taken that entry over, not a reap window later.
async fn stopped_holder_leaves_once_its_work_is_taken(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("stopped-holder");
    let a = s
        .consume(
            &q,
            |_d: Delivery| async {
                tokio::time::sleep(Duration::from_secs(30)).await;
                Decision::Ack
            },
            fast(500).with_concurrency(1),
        )
        .await
        .unwrap();
    s.offer(&q, "held").await.unwrap();
    eventually(Duration::from_secs(5), || {
        let n = a.in_flight().len();
        async move { (n == 1).then_some(()) }
    })
    .await
    .expect("A took it");
    let report = a.close().await;
    assert_eq!(report.in_flight.len(), 1);
    assert_eq!(s.stats(&q).await.unwrap().consumers, 1, "A owns an entry: it stays");
    let took = Arc::new(AtomicBool::new(false));
    let t2 = took.clone();
    let peer = s
        .consume(
            &q,
            move |_d: Delivery| {
                let took = t2.clone();
                async move {
                    took.store(true, Ordering::SeqCst);
                    Decision::Ack
                }
            },
            // Reaping never: only the takeover itself may remove A.
            fast(500),
        )
        .await
        .unwrap();
    eventually(Duration::from_secs(5), || {
        let t = took.load(Ordering::SeqCst);
        async move { t.then_some(()) }
    })
    .await
    .expect("the peer took A's message");
    let left = eventually(Duration::from_secs(2), || {
        let (s, q) = (s.clone(), q.clone());
        async move { s.stats(&q).await.ok().filter(|st| st.consumers == 1 && st.pending == 0) }
    })
    .await;
    assert!(left.is_some(), "[{}] A is still in the group after its work was taken: {:?}", b.name(), s.stats(&q).await);
    peer.close().await;
}
