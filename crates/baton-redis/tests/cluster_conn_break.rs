//! Attacks on [`ClusterConn`] (the shared Cluster connection that replaces a wedged redis-crate
//! connection) with real redis-server processes: frozen nodes (SIGSTOP/SIGCONT), `CLIENT PAUSE`,
//! a failover racing a `CLIENT KILL` storm, the whole cluster down and restarted, hundreds of
//! clones calling through a replacement. Each `INCR` counter has one writer, so a counter must
//! end at or above the writer's `OK`s (no `INCR` answered OK lost); see [`check_no_ok_lost`] and
//! the ignored [`an_incr_answered_ok_under_a_client_kill_storm_is_applied_once`] for the redis
//! crate's re-sent calls that put some counters above `OK`s plus failures.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_redis::{key_slot, redis, ClusterConn, RedisClient, RedisConn, CONNECTION_TIMEOUT, DEFAULT_RESPONSE_TIMEOUT};
use baton_testkit::{require_redis, KillStorm, RedisCluster, RedisServer};

/// Longest a call may take through a replacement: the wait for the replacement
/// ([`CONNECTION_TIMEOUT`]) plus the response timeout, plus 2 s of slack for a loaded 2-core CI.
fn call_bound() -> Duration {
    CONNECTION_TIMEOUT + DEFAULT_RESPONSE_TIMEOUT + Duration::from_secs(2)
}

/// When the first test started (for `BREAK_TRACE` output).
fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn cluster_conn(conn: &RedisConn) -> &ClusterConn {
    let RedisConn::Cluster(c) = conn else { unreachable!("a Cluster configuration gives a Cluster connection") };
    c
}

/// The slot ranges each master serves, from `CLUSTER NODES` of `node`: (port, ranges).
fn masters(node: &RedisServer) -> Vec<(u16, Vec<(u16, u16)>)> {
    let text = node.cli(&["CLUSTER", "NODES"]);
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
            continue;
        }
        let port: u16 = f[1].split('@').next().unwrap().rsplit(':').next().unwrap().parse().unwrap();
        let ranges = f[8..]
            .iter()
            .filter(|s| !s.starts_with('['))
            .map(|s| match s.split_once('-') {
                Some((a, b)) => (a.parse().unwrap(), b.parse().unwrap()),
                None => (s.parse().unwrap(), s.parse().unwrap()),
            })
            .collect();
        out.push((port, ranges));
    }
    out
}

/// `n` distinct keys (prefix `prefix`) served by the master on `port`.
fn keys_on(masters: &[(u16, Vec<(u16, u16)>)], port: u16, prefix: &str, n: usize) -> Vec<String> {
    let ranges = &masters.iter().find(|(p, _)| *p == port).expect("a master on that port").1;
    (0..)
        .map(|i| format!("{prefix}{i}"))
        .filter(|k| {
            let s = key_slot(k.as_bytes());
            ranges.iter().any(|&(a, b)| a <= s && s <= b)
        })
        .take(n)
        .collect()
}

/// Normal clients connected to `node`, not counting the `redis-cli` that asks.
fn normal_clients(node: &RedisServer) -> usize {
    node.cli(&["CLIENT", "LIST", "TYPE", "normal"]).lines().count() - 1
}

/// One writer's tally: `INCR`s answered OK and failed, the longest call, and the number of
/// calls (and the longest) that ended while `watch` was set.
#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
    longest_ms: AtomicU64,
    ok_watched: AtomicU64,
    errors: Mutex<Vec<String>>,
}

/// A writer: `INCR key` on its own clone of `conn` until `stop`, tallied in `t`.
fn writer(
    conn: &RedisConn,
    key: String,
    stop: Arc<AtomicBool>,
    watch: Arc<AtomicBool>,
    t: Arc<Tally>,
) -> tokio::task::JoinHandle<()> {
    let mut conn = conn.clone();
    tokio::spawn(async move {
        while !stop.load(Ordering::Relaxed) {
            let started = Instant::now();
            let r: redis::RedisResult<i64> = redis::cmd("INCR").arg(&key).query_async(&mut conn).await;
            t.longest_ms.fetch_max(started.elapsed().as_millis() as u64, Ordering::Relaxed);
            match r {
                Ok(_) => {
                    if std::env::var_os("BREAK_TRACE").is_some() && started.elapsed() > Duration::from_millis(500) {
                        eprintln!(
                            "{key}: call started at {:?} OK after {:?}",
                            started.duration_since(epoch()),
                            started.elapsed()
                        );
                    }
                    t.ok.fetch_add(1, Ordering::Relaxed);
                    if watch.load(Ordering::Relaxed) {
                        t.ok_watched.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(e) => {
                    if std::env::var_os("BREAK_TRACE").is_some() {
                        eprintln!(
                            "{key}: call started at {:?} failed after {:?}: {e}",
                            started.duration_since(epoch()),
                            started.elapsed()
                        );
                    }
                    t.failed.fetch_add(1, Ordering::Relaxed);
                    let e = e.to_string();
                    let mut errors = t.errors.lock().unwrap();
                    if errors.len() < 4 && !errors.contains(&e) {
                        errors.push(e);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
}

/// A [`writer`] per key, each tallied apart: the tallies and the tasks, in the keys' order.
fn writers(
    conn: &RedisConn,
    keys: &[String],
    stop: &Arc<AtomicBool>,
    watch: &Arc<AtomicBool>,
) -> (Vec<Arc<Tally>>, Vec<tokio::task::JoinHandle<()>>) {
    let tallies: Vec<Arc<Tally>> = keys.iter().map(|_| Arc::new(Tally::default())).collect();
    let tasks = keys
        .iter()
        .zip(&tallies)
        .map(|(k, t)| writer(conn, k.clone(), stop.clone(), watch.clone(), t.clone()))
        .collect();
    (tallies, tasks)
}

/// `n` keys on each master of `masters`, named `<prefix><port>:…`.
fn keys_on_every_master(masters: &[(u16, Vec<(u16, u16)>)], prefix: &str, n: usize) -> Vec<String> {
    masters.iter().flat_map(|(port, _)| keys_on(masters, *port, &format!("{prefix}{port}:"), n)).collect()
}

/// `GET key` on `conn`, retried until it answers (panics after `limit`).
async fn get_within(conn: &RedisConn, key: &str, limit: Duration) -> u64 {
    let start = Instant::now();
    let mut c = conn.clone();
    loop {
        let r: redis::RedisResult<Option<u64>> = redis::cmd("GET").arg(key).query_async(&mut c).await;
        match r {
            Ok(v) => return v.unwrap_or(0),
            Err(e) => {
                if std::env::var_os("BREAK_TRACE").is_some() {
                    eprintln!("GET {key} failed {:?} into get_within: {e}", start.elapsed());
                }
                assert!(start.elapsed() < limit, "GET {key} still fails after {limit:?}: {e}")
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every counter ends between its writer's OKs and OKs plus failures: each `INCR` answered OK
/// applied exactly once, each failed one at most once.
async fn check_counters(conn: &RedisConn, keys: &[String], tallies: &[Arc<Tally>], limit: Duration) {
    for (k, t) in keys.iter().zip(tallies) {
        let v = get_within(conn, k, limit).await;
        let (ok, failed) = (t.ok.load(Ordering::Relaxed), t.failed.load(Ordering::Relaxed));
        assert!(
            ok <= v && v <= ok + failed,
            "{k} = {v} after {ok} INCRs answered OK and {failed} failed ({:?})",
            t.errors.lock().unwrap()
        );
    }
}

/// No counter lost an `INCR` answered OK (counter ≥ OKs). Through a freeze or a `CLIENT PAUSE`
/// a *timed-out* `INCR` may run more than once: the redis crate (1.8) re-sends a call whose node
/// connection timed out (`RetryMethod::Reconnect`, up to the 40 retries) even after its caller
/// got the timeout, and the first copy, queued on the frozen or paused node, runs too (measured:
/// counters 2 above OKs plus failures). Returns how many counters ended above OKs plus failures.
async fn check_no_ok_lost(conn: &RedisConn, keys: &[String], tallies: &[Arc<Tally>], limit: Duration) -> usize {
    let mut above = 0;
    for (k, t) in keys.iter().zip(tallies) {
        let v = get_within(conn, k, limit).await;
        let (ok, failed) = (t.ok.load(Ordering::Relaxed), t.failed.load(Ordering::Relaxed));
        assert!(ok <= v, "{k} = {v} after {ok} INCRs answered OK and {failed} failed");
        if v > ok + failed {
            eprintln!("{k} = {v} after {ok} INCRs answered OK and {failed} failed: a timed-out INCR ran twice");
            above += 1;
        }
    }
    above
}

/// A master frozen (SIGSTOP) for 8 s while 12 writers (4 per master) `INCR`: the writers on the
/// other masters keep getting answers (all but a stall of the redis crate's, below), so the
/// connection is never replaced; after SIGCONT every key answers within two response timeouts,
/// and no `INCR` answered OK is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_frozen_for_8s_is_no_wedge_and_the_others_keep_answering() {
    require_redis();
    epoch();
    let mut cluster = RedisCluster::start();
    let conn = RedisClient::new(cluster.config()).unwrap().shared().await.unwrap();
    let ms = masters(&cluster.nodes()[0]);
    let frozen = cluster.nodes()[0].port();
    let (stop, watch) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let keys = keys_on_every_master(&ms, "f", 4);
    let (tallies, writers) = writers(&conn, &keys, &stop, &watch);
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.nodes()[0].pause();
    eprintln!("froze {frozen} at {:?}", epoch().elapsed());
    watch.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(8)).await;
    watch.store(false, Ordering::Relaxed);
    let replaced_while_frozen = cluster_conn(&conn).replacements();
    cluster.nodes()[0].resume();
    eprintln!("thawed at {:?}", epoch().elapsed());
    let thawed = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    for (k, t) in keys.iter().zip(&tallies) {
        let on_frozen = keys_on(&ms, frozen, &format!("f{frozen}:"), 4).contains(k);
        eprintln!(
            "{k} (frozen node: {on_frozen}): ok {} (during the freeze {}), failed {}, longest call {} ms, errors {:?}",
            t.ok.load(Ordering::Relaxed),
            t.ok_watched.load(Ordering::Relaxed),
            t.failed.load(Ordering::Relaxed),
            t.longest_ms.load(Ordering::Relaxed),
            t.errors.lock().unwrap()
        );
    }
    assert_eq!(replaced_while_frozen, 0, "a frozen master while the others answer is no wedge");
    for (k, t) in keys.iter().zip(&tallies) {
        let on_frozen = keys_on(&ms, frozen, &format!("f{frozen}:"), 4).contains(k);
        if !on_frozen {
            assert!(
                t.ok_watched.load(Ordering::Relaxed) > 0,
                "{k} on a running master got no answer during the freeze"
            );
            // The redis crate (1.8) stalls every call while it refreshes the slot map after the
            // frozen node's timeouts (its refresh asks the frozen node and does not poll the
            // calls in flight meanwhile): measured, each writer on a running master lost one call
            // to a response timeout, started 6.4 s into the freeze and ending 3.4 s after SIGCONT.
            // That is the crate's, not a wedge: the connection is not replaced meanwhile.
            assert!(t.failed.load(Ordering::Relaxed) <= 2, "{k} on a running master: {:?}", t.errors.lock().unwrap());
        }
        assert!(t.longest_ms.load(Ordering::Relaxed) <= call_bound().as_millis() as u64);
    }
    // After SIGCONT the crate's slot refresh may go on stalling every call (measured: up to
    // 9.8 s after SIGCONT, until a call timed out with no answer and the connection was
    // replaced): every key answers within two response timeouts plus the replacement.
    let limit = 2 * DEFAULT_RESPONSE_TIMEOUT + CONNECTION_TIMEOUT + Duration::from_secs(2);
    let above = check_no_ok_lost(&conn, &keys, &tallies, limit).await;
    eprintln!(
        "{above} of {} counters above OKs plus failures; all counters read {:?} after SIGCONT; replaced {} time(s) \
         after SIGCONT",
        keys.len(),
        thawed.elapsed(),
        cluster_conn(&conn).replacements()
    );
}

/// One caller alone, on a key of a master frozen for 12 s: its call times out with no answer on
/// the connection, which then looks wedged; a fresh connection made while that master is frozen
/// must not replace it (it has no connection to the frozen master and answers on no more masters
/// than the current one). After SIGCONT the first call answers at once (as on the redis crate's
/// own connection).
/// Before the fix, the fresh connection replaced the current one and failed the first call after
/// SIGCONT with a response timeout (measured: answered 5.05 s after SIGCONT, 2 replacements).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_caller_on_a_frozen_master_answers_at_once_after_sigcont() {
    require_redis();
    epoch();
    let mut cluster = RedisCluster::start();
    let conn = RedisClient::new(cluster.config()).unwrap().shared().await.unwrap();
    let ms = masters(&cluster.nodes()[0]);
    let frozen = cluster.nodes()[0].port();
    let key = keys_on(&ms, frozen, "lone:", 1).remove(0);
    let (mut ok, mut failed) = (0u64, 0u64);
    let mut c = conn.clone();
    cluster.nodes()[0].pause();
    let frozen_at = Instant::now();
    // The first call times out (5 s) and starts a replacement; the second waits for it (2 s) and
    // times out on the frozen master too (5 s more).
    for _ in 0..2 {
        let started = Instant::now();
        let r: redis::RedisResult<i64> = redis::cmd("INCR").arg(&key).query_async(&mut c).await;
        eprintln!(
            "lone INCR started {:?} into the freeze: {r:?} after {:?}; replaced {} time(s)",
            started.duration_since(frozen_at),
            started.elapsed(),
            cluster_conn(&conn).replacements()
        );
        assert!(started.elapsed() <= call_bound(), "an INCR took {:?}", started.elapsed());
        if r.is_ok() {
            ok += 1
        } else {
            failed += 1
        }
    }
    assert_eq!((ok, failed), (0, 2), "a call to a frozen master fails");
    let replaced_while_frozen = cluster_conn(&conn).replacements();
    cluster.nodes()[0].resume();
    let thawed = Instant::now();
    let r: redis::RedisResult<i64> = redis::cmd("INCR").arg(&key).query_async(&mut c).await;
    let first = thawed.elapsed();
    eprintln!("lone caller: first INCR after SIGCONT: {r:?} after {first:?}; replaced {replaced_while_frozen} time(s) while frozen");
    assert_eq!(replaced_while_frozen, 0, "a connection made while a master is frozen replaced the current one");
    // The timed-out INCRs may have run (queued on the frozen master) or not: 1 answered OK,
    // 2 failed, so the counter is 1 to 3 (measured: 3).
    let v = r.unwrap();
    assert!((1..=3).contains(&v), "counter {v} after 1 INCR answered OK and 2 failed");
    assert!(first < Duration::from_secs(1), "the first call after SIGCONT took {first:?}");
}

/// `CLIENT PAUSE 7000 WRITE` on every master while 12 writers `INCR`: every write waits longer
/// than the response timeout with no call answered (the connection looks wedged and may be
/// replaced, harmlessly); once the pause ends every write succeeds again within the bound, no
/// `INCR` answered OK is lost, and a replaced connection's node connections are closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_pause_write_on_every_node_then_unpause() {
    require_redis();
    epoch();
    let mut cluster = RedisCluster::start();
    let conn = RedisClient::new(cluster.config()).unwrap().shared().await.unwrap();
    let ms = masters(&cluster.nodes()[0]);
    let (stop, watch) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let keys = keys_on_every_master(&ms, "p", 4);
    let (tallies, writers) = writers(&conn, &keys, &stop, &watch);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let baseline = normal_clients(&cluster.nodes()[1]);
    for n in cluster.nodes().iter() {
        assert_eq!(n.cli(&["CLIENT", "PAUSE", "7000", "WRITE"]), "OK");
    }
    let paused = Instant::now();
    tokio::time::sleep(Duration::from_secs(7)).await;
    // Past the pause: every writer must get OKs again.
    watch.store(true, Ordering::Relaxed);
    let deadline = paused + Duration::from_secs(7) + call_bound();
    while tallies.iter().any(|t| t.ok_watched.load(Ordering::Relaxed) == 0) {
        assert!(Instant::now() < deadline, "a writer got no OK {:?} after the pause began", paused.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let recovered = paused.elapsed();
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let failed: u64 = tallies.iter().map(|t| t.failed.load(Ordering::Relaxed)).sum();
    let longest = tallies.iter().map(|t| t.longest_ms.load(Ordering::Relaxed)).max().unwrap();
    eprintln!(
        "CLIENT PAUSE: every writer answered {recovered:?} after the pause began; {failed} INCRs failed; longest call \
         {longest} ms; replaced {} time(s); errors {:?}",
        cluster_conn(&conn).replacements(),
        tallies[0].errors.lock().unwrap()
    );
    assert!(longest <= call_bound().as_millis() as u64);
    let above = check_no_ok_lost(&conn, &keys, &tallies, Duration::from_secs(5)).await;
    eprintln!("{above} of {} counters above OKs plus failures", keys.len());
    // Every clone moved on (the writers' are dropped; `conn` makes one call): a replaced
    // connection's task ends and closes its node connections, so a node ends with as many
    // client connections as before.
    let mut conn = conn;
    let _: () = redis::cmd("SET").arg("p:last").arg(1).query_async(&mut conn).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let now = normal_clients(&cluster.nodes()[1]);
        if now == baseline {
            break;
        }
        assert!(Instant::now() < deadline, "{now} client connections on a node, {baseline} before the pause");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// 300 clones `INCR` while every node is frozen for 6 s: no call lasts past the replacement wait
/// plus the response timeout (a replacement attempt made while the seeds are frozen fails or is
/// late, and the connection must stay usable); after SIGCONT every clone answers within the
/// bound and no `INCR` answered OK is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_clones_through_a_whole_cluster_freeze() {
    require_redis();
    epoch();
    let mut cluster = RedisCluster::start();
    let conn = RedisClient::new(cluster.config()).unwrap().shared().await.unwrap();
    let (stop, watch) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let keys: Vec<String> = (0..300).map(|i| format!("many:{i}")).collect();
    let (tallies, writers) = writers(&conn, &keys, &stop, &watch);
    tokio::time::sleep(Duration::from_millis(300)).await;
    for n in cluster.nodes().iter() {
        n.pause();
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    for n in cluster.nodes().iter() {
        n.resume();
    }
    let thawed = Instant::now();
    watch.store(true, Ordering::Relaxed);
    let deadline = thawed + call_bound();
    while tallies.iter().any(|t| t.ok_watched.load(Ordering::Relaxed) == 0) {
        let silent = tallies.iter().filter(|t| t.ok_watched.load(Ordering::Relaxed) == 0).count();
        assert!(Instant::now() < deadline, "{silent} of 300 clones got no OK {:?} after SIGCONT", thawed.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let recovered = thawed.elapsed();
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        tokio::time::timeout(call_bound(), w).await.expect("a writer hangs").unwrap();
    }
    let failed: u64 = tallies.iter().map(|t| t.failed.load(Ordering::Relaxed)).sum();
    let longest = tallies.iter().map(|t| t.longest_ms.load(Ordering::Relaxed)).max().unwrap();
    eprintln!(
        "300 clones: all answered {recovered:?} after SIGCONT; {failed} INCRs failed; longest call {longest} ms; \
         replaced {} time(s); errors {:?}",
        cluster_conn(&conn).replacements(),
        tallies[0].errors.lock().unwrap()
    );
    assert!(longest <= call_bound().as_millis() as u64, "a call took {longest} ms");
    let above = check_no_ok_lost(&conn, &keys, &tallies, Duration::from_secs(5)).await;
    eprintln!("{above} of {} counters above OKs plus failures", keys.len());
}

/// The whole cluster killed for 10 s, then restarted on the same ports (each node keeps its
/// `nodes.conf`, so the cluster forms again; the data is gone, no persistence): a caller looping
/// all along on the shared connection gets answers again soon after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_cluster_down_for_10s_then_restarted() {
    require_redis();
    epoch();
    let mut cluster = RedisCluster::start();
    let conn = RedisClient::new(cluster.config()).unwrap().shared().await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let t = Arc::new(Tally::default());
    let w = writer(&conn, "down:1".into(), stop.clone(), Arc::new(AtomicBool::new(false)), t.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    for n in cluster.nodes().iter_mut() {
        n.kill();
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let ok_before = t.ok.load(Ordering::Relaxed);
    for n in cluster.nodes().iter_mut() {
        n.restart();
    }
    let restarted = Instant::now();
    let limit = Duration::from_secs(15);
    while t.ok.load(Ordering::Relaxed) == ok_before {
        assert!(
            restarted.elapsed() < limit,
            "no OK {limit:?} after the restart: {:?}; replaced {} time(s)",
            t.errors.lock().unwrap(),
            cluster_conn(&conn).replacements()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let recovered = restarted.elapsed();
    stop.store(true, Ordering::Relaxed);
    tokio::time::timeout(call_bound(), w).await.expect("the writer hangs").unwrap();
    eprintln!(
        "cluster down 10 s: answered {recovered:?} after the restart; failed {}; longest call {} ms; replaced {} \
         time(s); errors {:?}",
        t.failed.load(Ordering::Relaxed),
        t.longest_ms.load(Ordering::Relaxed),
        cluster_conn(&conn).replacements(),
        t.errors.lock().unwrap()
    );
    // Every clone answers, each call within 1 s.
    for i in 0..20 {
        let mut c = conn.clone();
        let n: i64 = tokio::time::timeout(
            Duration::from_secs(1),
            redis::cmd("INCR").arg(format!("after:{i}")).query_async(&mut c),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(n, 1);
    }
}

/// A master with a replica killed while a `CLIENT KILL` storm runs on every node (replacements
/// may race the failover): after the replica took over, every key answers within two response
/// timeouts, and no `INCR` answered OK is lost on the surviving masters (those on the
/// failed-over master may lose acknowledged writes to asynchronous replication, which no client
/// can help).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_during_a_client_kill_storm() {
    require_redis();
    epoch();
    let mut cluster = RedisCluster::start_with_replicas(1);
    let conn = RedisClient::new(cluster.config()).unwrap().shared().await.unwrap();
    let ms = masters(&cluster.nodes()[0]);
    let victim = ms[0].0;
    let storm = KillStorm::start(cluster.urls(), Duration::from_millis(5)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let keys = keys_on_every_master(&ms, "fo", 4);
    let watch = Arc::new(AtomicBool::new(false));
    let (tallies, writers) = writers(&conn, &keys, &stop, &watch);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let killed_at = Instant::now();
    cluster.kill_master(victim);
    // The storm goes on through the failover.
    let new_master = tokio::task::block_in_place(|| cluster.wait_for_failover(victim, Duration::from_secs(30)));
    let failed_over = killed_at.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let killed = storm.stop().await;
    let calm = Instant::now();
    for w in writers {
        tokio::time::timeout(call_bound(), w).await.expect("a writer hangs").unwrap();
    }
    let mut probe = conn.clone();
    for k in &keys {
        let limit = 2 * DEFAULT_RESPONSE_TIMEOUT;
        loop {
            let r: redis::RedisResult<Option<u64>> = redis::cmd("GET").arg(k).query_async(&mut probe).await;
            match r {
                Ok(_) => break,
                Err(e) => assert!(calm.elapsed() < limit, "GET {k} fails {limit:?} after the storm: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    eprintln!(
        "failover to {new_master} {failed_over:?} after the kill; {killed} connections killed; all keys answer {:?} \
         after the storm; replaced {} time(s)",
        calm.elapsed(),
        cluster_conn(&conn).replacements()
    );
    let surviving: Vec<(String, Arc<Tally>)> = keys
        .iter()
        .zip(&tallies)
        .filter(|(k, _)| !k.starts_with(&format!("fo{victim}:")))
        .map(|(k, t)| (k.clone(), t.clone()))
        .collect();
    // No INCR answered OK is lost on the surviving masters. (Some may be applied twice: see
    // `an_incr_answered_ok_under_a_client_kill_storm_is_applied_once`.)
    assert_eq!(surviving.len(), 8);
    for (k, t) in &surviving {
        let v = get_within(&conn, k, Duration::from_secs(5)).await;
        let ok = t.ok.load(Ordering::Relaxed);
        eprintln!("{k}: {v} after {ok} OK and {} failed INCRs", t.failed.load(Ordering::Relaxed));
        assert!(ok <= v, "{k} = {v} after {ok} INCRs answered OK");
    }
}

/// 12 writers `INCR` their own counters through a 3 s `CLIENT KILL` storm: every counter should
/// end between its OKs and OKs plus failures. It does not: the redis crate (1.8) re-sends a
/// command whose node connection broke (an I/O error, `RetryMethod::Reconnect`) even when the
/// command had run before the connection was killed, so an `INCR` answered OK may be applied
/// twice (measured: 215 after 212 OKs and 0 failures on one counter). Not `ClusterConn`'s doing
/// (it never re-sends), and no setting of the crate turns that retry off for I/O errors alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fails: the redis crate re-sends a command whose connection was killed after it ran (an INCR answered OK applied twice)"]
async fn an_incr_answered_ok_under_a_client_kill_storm_is_applied_once() {
    require_redis();
    epoch();
    let cluster = RedisCluster::start();
    let conn = RedisClient::new(cluster.config()).unwrap().shared().await.unwrap();
    let storm = KillStorm::start(cluster.urls(), Duration::from_millis(5)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let keys: Vec<String> = (0..12).map(|i| format!("storm:{i}")).collect();
    let watch = Arc::new(AtomicBool::new(false));
    let (tallies, writers) = writers(&conn, &keys, &stop, &watch);
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    storm.stop().await;
    for w in writers {
        tokio::time::timeout(call_bound(), w).await.expect("a writer hangs").unwrap();
    }
    check_counters(&conn, &keys, &tallies, 2 * DEFAULT_RESPONSE_TIMEOUT).await;
}

/// Connections of [`every_connection_answers_after_a_client_kill_storm`].
const N_CONNS: usize = 64;

/// [`N_CONNS`] connections of their own (each a `ClusterConn`), each with a writer, through a 3 s
/// `CLIENT KILL` storm: afterwards every one answers again within the response timeout plus a
/// replacement. Found with the command service's consumer on Cluster: the redis crate (1.8) can
/// lose every node connection in a slot refresh (the ones it re-makes are killed while it checks
/// them, and it keeps only those that pass), and from then on its recovery retries that refresh
/// for good, which with no connection left can only fail: every call fails at once with
/// "No connections found" (`ClusterConnectionNotFound`), and the refresh that would reconnect to
/// the seed nodes is never started. Such a connection is replaced like a wedged one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_answers_after_a_client_kill_storm() {
    require_redis();
    epoch();
    let cluster = RedisCluster::start();
    let client = RedisClient::new(cluster.config()).unwrap();
    let mut conns = Vec::new();
    for _ in 0..N_CONNS {
        conns.push(client.shared().await.unwrap());
    }
    let storm = KillStorm::start(cluster.urls(), Duration::from_millis(5)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let watch = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    let mut tallies = Vec::new();
    for (i, c) in conns.iter().enumerate() {
        let (t, w) = writers(c, &[format!("each:{i}")], &stop, &watch);
        tallies.extend(t);
        tasks.extend(w);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let killed = storm.stop().await;
    let calm = Instant::now();
    for w in tasks {
        tokio::time::timeout(call_bound(), w).await.expect("a writer hangs").unwrap();
    }
    // Every connection answers, each within a response timeout plus a replacement.
    let limit = call_bound();
    let mut dead = Vec::new();
    for (i, c) in conns.iter().enumerate() {
        let start = Instant::now();
        let mut c = c.clone();
        let mut last = None;
        let answered = loop {
            let r: redis::RedisResult<Option<u64>> =
                redis::cmd("GET").arg(format!("each:{i}")).query_async(&mut c).await;
            match r {
                Ok(_) => break true,
                Err(e) => last = Some(e.to_string()),
            }
            if start.elapsed() > limit {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if !answered {
            dead.push((i, last));
        }
    }
    let replaced: u64 = conns.iter().map(|c| cluster_conn(c).replacements()).sum();
    eprintln!(
        "{killed} connections killed; all checked {:?} after the storm; replaced {replaced} time(s); not answering: {dead:?}",
        calm.elapsed()
    );
    assert!(dead.is_empty(), "{} of {N_CONNS} connections still fail {limit:?} after the storm: {dead:?}", dead.len());
    check_no_ok_lost(&conns[0], &(0..N_CONNS).map(|i| format!("each:{i}")).collect::<Vec<_>>(), &tallies, limit).await;
}
