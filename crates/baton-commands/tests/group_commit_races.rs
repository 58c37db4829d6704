//! Group-committed transitions and submits (store/commit.rs, transitions.lua, submits.lua) under
//! races and failures: two stores (processes) racing cancels and completions, many queues with
//! waiters in another process, Redis killed / paused / a Cluster master restarted mid-batch;
//! counts, listings and states must agree afterwards and no caller may hang.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_commands::{Command, CommandError, CommandResult, CommandService, CommandStatus, CommandStore, ListQuery};
use baton_testkit::{require_redis, RedisCluster, RedisServer, ServerOptions, TestBackend};
use common::*;
use serde_json::json;

async fn all_listed(store: &CommandStore, q: &str, status: Option<CommandStatus>) -> Vec<(String, CommandStatus)> {
    let mut out = Vec::new();
    let mut cursor = None;
    loop {
        let page = store.list(q, ListQuery { status, limit: 1000, cursor, ..Default::default() }).await.unwrap();
        out.extend(page.items.into_iter().map(|s| (s.id, s.status)));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return out,
        }
    }
}

/// Counts, list (all and per status) and per-id states must all agree.
async fn check_consistent(store: &CommandStore, q: &str, ids: &[String]) -> HashMap<String, CommandStatus> {
    let mut truth = HashMap::new();
    for id in ids {
        let st = store.get(id).await.unwrap().unwrap_or_else(|| panic!("{id} missing"));
        truth.insert(id.clone(), st.status);
    }
    let c = store.counts(q).await.unwrap();
    let count = |s: CommandStatus| truth.values().filter(|v| **v == s).count() as u64;
    let expect = (
        count(CommandStatus::Submitted),
        count(CommandStatus::Running),
        count(CommandStatus::Succeeded),
        count(CommandStatus::Failed),
        count(CommandStatus::Cancelled),
    );
    assert_eq!((c.submitted, c.running, c.succeeded, c.failed, c.cancelled), expect, "counts of {q} vs states");
    let listed = all_listed(store, q, None).await;
    assert_eq!(listed.len(), ids.len(), "list of {q}");
    for (id, s) in &listed {
        assert_eq!(truth.get(id), Some(s), "listed status of {id}");
    }
    for s in [
        CommandStatus::Submitted,
        CommandStatus::Running,
        CommandStatus::Succeeded,
        CommandStatus::Failed,
        CommandStatus::Cancelled,
    ] {
        let l = all_listed(store, q, Some(s)).await;
        assert_eq!(l.len() as u64, count(s), "list by {s:?} of {q}");
        assert!(l.iter().all(|(id, st)| *st == s && truth.get(id) == Some(&s)), "list by {s:?}: {l:?}");
    }
    truth
}

/// Two stores ("processes") each run a service on the same queue and both cancel every command
/// while the handlers complete them; claim timeouts are short so deliveries get reclaimed by the
/// other consumer (acks of already-acked / claimed deliveries in batches).
async fn two_stores_race_cancel_and_complete(b: TestBackend) {
    let a = store_for(&b).await;
    let bb = other_store(&b, &a).await;
    let q = queue_name("race");
    let mut settings = fast();
    settings.concurrency = 32;
    settings.claim_timeout = Duration::from_millis(300);
    let runs = Arc::new(AtomicUsize::new(0));
    let mk = |store: CommandStore, runs: Arc<AtomicUsize>| {
        let settings = settings.clone();
        let q = q.clone();
        async move {
            CommandService::builder(store, &q)
                .settings(settings)
                .handler(
                    "t",
                    on_execute(move |c: Command| {
                        let runs = runs.clone();
                        async move {
                            runs.fetch_add(1, Ordering::Relaxed);
                            let n = c.params.parse::<serde_json::Value>().unwrap()["n"].as_u64().unwrap();
                            // Some run longer than the claim timeout (reclaimed elsewhere).
                            let ms = if n.is_multiple_of(7) { 450 } else { n % 5 };
                            tokio::time::sleep(Duration::from_millis(ms)).await;
                            if n.is_multiple_of(3) {
                                Ok(CommandResult::failed(format!("n{n}")))
                            } else {
                                Ok(CommandResult::succeeded(json!({"n": n})))
                            }
                        }
                    }),
                )
                .start()
                .await
                .unwrap()
        }
    };
    let sa = mk(a.clone(), runs.clone()).await;
    let sb = mk(bb.clone(), runs.clone()).await;
    let n = 400;
    let mut ids = Vec::new();
    let subs = (0..n).map(|i| a.submit(&q, Command::with_id(format!("r{i}-{q}"), "t", json!({"n": i}))));
    for st in futures::future::join_all(subs).await {
        ids.push(st.unwrap().id);
    }
    // Waiters in both processes.
    let waits = {
        let (a, bb, ids) = (a.clone(), bb.clone(), ids.clone());
        tokio::spawn(async move {
            let waits_b = futures::future::join_all(ids.iter().map(|id| bb.wait(id, Duration::from_secs(20))));
            let waits_a = futures::future::join_all(ids.iter().map(|id| a.wait(id, Duration::from_secs(20))));
            futures::future::join(waits_a, waits_b).await
        })
    };
    // Cancels from both stores, two each, at staggered moments.
    let mut cancels = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        for s in [a.clone(), bb.clone(), a.clone(), bb.clone()] {
            let id = id.clone();
            cancels.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis((i % 13) as u64)).await;
                (id.clone(), s.cancel(&id).await)
            }));
        }
    }
    let mut cancel_won: HashMap<String, Vec<u64>> = HashMap::new();
    for c in cancels {
        let (id, r) = c.await.unwrap();
        match r {
            Ok(st) => {
                assert_eq!(st.status, CommandStatus::Cancelled);
                cancel_won.entry(id).or_default().push(st.version);
            }
            Err(CommandError::AlreadyTerminal(_)) => {}
            Err(e) => panic!("cancel {id}: {e:?}"),
        }
    }
    let (wa, wb) = tokio::time::timeout(Duration::from_secs(30), waits).await.expect("waits hang").unwrap();
    for (id, (ra, rb)) in ids.iter().zip(wa.into_iter().zip(wb)) {
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        assert!(ra.status.is_terminal() && rb.status.is_terminal(), "{id}: {:?} {:?}", ra.status, rb.status);
        assert_eq!((ra.status, ra.version), (rb.status, rb.version), "{id}: both processes see the same end");
    }
    for (id, v) in &cancel_won {
        assert_eq!(v.len(), 1, "{id}: more than one cancel won: {v:?}");
        let st = a.get(id).await.unwrap().unwrap();
        assert_eq!((st.status, st.version), (CommandStatus::Cancelled, v[0]), "{id}");
    }
    // A drain with a budget, not `close` (which leaves running handlers' leases to expire): a
    // cancel can win while a handler still sleeps (it ignores cancellation), so a handler may
    // still run for a command that is already terminal; its ack comes when it returns.
    for s in [&sa, &sb] {
        let report = s.drain(Duration::from_secs(10)).await;
        assert!(report.in_flight.is_empty(), "handlers still running after 10 s: {report:?}");
    }
    let truth = check_consistent(&a, &q, &ids).await;
    let truth_b = check_consistent(&bb, &q, &ids).await;
    assert_eq!(truth, truth_b);
    for (id, s) in &truth {
        assert!(s.is_terminal(), "{id}: {s:?}");
        assert_eq!(*s == CommandStatus::Cancelled, cancel_won.contains_key(id), "{id}: {s:?}");
    }
    if b.redis_config().is_some() {
        let stats = eventually(Duration::from_secs(10), || async {
            let s = a.messages().stats(&q).await.unwrap();
            (s.length == 0 && s.pending == 0).then_some(s)
        })
        .await;
        assert!(stats.is_some(), "queue not drained: {:?}", a.messages().stats(&q).await.unwrap());
    }
    eprintln!(
        "race: {} cancels won, {} handler runs, statuses {:?}",
        cancel_won.len(),
        runs.load(Ordering::Relaxed),
        truth.values().fold(HashMap::new(), |mut m: HashMap<CommandStatus, usize>, s| {
            *m.entry(*s).or_default() += 1;
            m
        })
    );
}

/// Waiters in another process, many queues at once: every wait must return as soon as the
/// (batched) announcement arrives, well before the 1 s fallback re-read.
async fn many_queues_remote_waiters_wake_promptly(b: TestBackend) {
    let a = store_for(&b).await;
    let other = other_store(&b, &a).await;
    let queues: Vec<String> = (0..24).map(|i| queue_name(&format!("mq{i}"))).collect();
    let mut ids = Vec::new();
    for (qi, q) in queues.iter().enumerate() {
        for i in 0..25 {
            ids.push(a.submit(q, Command::with_id(format!("m{qi}-{i}-{q}"), "t", json!(i))).await.unwrap().id);
        }
    }
    let waits: Vec<_> = ids
        .iter()
        .map(|id| {
            let (o, id) = (other.clone(), id.clone());
            tokio::spawn(async move {
                let r = o.wait(&id, Duration::from_secs(10)).await;
                (r, Instant::now())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for round in 0..3 {
        let start = Instant::now();
        // Cancel a third of them per round, all at once.
        let batch: Vec<_> = ids.iter().skip(round).step_by(3).collect();
        let rs = futures::future::join_all(batch.iter().map(|id| a.cancel(id))).await;
        for r in rs {
            r.unwrap();
        }
        eprintln!("round {round}: {} cancels in {:?}", batch.len(), start.elapsed());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let done = Instant::now();
    let mut worst = Duration::ZERO;
    for w in waits {
        let (r, at) = w.await.unwrap();
        assert_eq!(r.unwrap().status, CommandStatus::Cancelled);
        worst = worst.max(at.saturating_duration_since(done));
    }
    eprintln!("worst remote wake after the last round: {worst:?}");
    assert!(worst < Duration::from_millis(700), "a remote waiter woke late ({worst:?}): announcement missed?");
    for q in &queues {
        let c = other.counts(q).await.unwrap();
        assert_eq!((c.submitted, c.cancelled), (0, 25), "{q}");
    }
}

/// Redis SIGKILLed while many batched transitions are in flight: every caller gets an answer
/// (an error or a result) in bounded time, and after a restart (AOF, so the data survives) the
/// store works again and its indexes match the states.
async fn kill_or_pause_mid_batch(pause_instead: bool) {
    require_redis();
    let mut server = RedisServer::start_with(ServerOptions { appendonly: true });
    let cfg = server.config();
    let store = CommandStore::redis(
        baton_redis::RedisClient::new(cfg.clone()).unwrap(),
        baton_commands::RedisCommandStoreOptions::default(),
    )
    .await
    .unwrap();
    let queues: Vec<String> = (0..4).map(|i| queue_name(&format!("kill{i}"))).collect();
    let mut ids = Vec::new();
    for q in &queues {
        for i in 0..300 {
            ids.push((
                q.clone(),
                store.submit(q, Command::with_id(format!("k{i}-{q}"), "t", json!(i))).await.unwrap().id,
            ));
        }
    }
    // Warm the script cache.
    let warm = store.submit(&queues[0], Command::with_id(format!("warm-{}", queues[0]), "t", json!(0))).await.unwrap();
    store.cancel(&warm.id).await.unwrap();
    let warm_id = (queues[0].clone(), warm.id.clone());
    let mut tasks = Vec::new();
    for (_, id) in &ids {
        for _ in 0..2 {
            let (s, id) = (store.clone(), id.clone());
            tasks.push(tokio::spawn(async move {
                let t0 = Instant::now();
                let r = tokio::time::timeout(Duration::from_secs(30), s.cancel(&id)).await;
                (id, r, t0.elapsed())
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(3)).await;
    if pause_instead {
        server.pause();
        tokio::time::sleep(Duration::from_secs(7)).await;
        server.resume();
    } else {
        server.kill();
        tokio::time::sleep(Duration::from_millis(500)).await;
        server.restart();
    }
    let (mut ok, mut err, mut refused) = (0, 0, 0);
    let mut slowest = Duration::ZERO;
    for t in tasks {
        let (id, r, took) = t.await.unwrap();
        slowest = slowest.max(took);
        match r {
            Err(_) => panic!("cancel of {id} hung for 30 s"),
            Ok(Ok(_)) => ok += 1,
            Ok(Err(CommandError::AlreadyTerminal(_))) => refused += 1,
            Ok(Err(_)) => err += 1,
        }
    }
    eprintln!("kill/pause: {ok} ok, {refused} refused, {err} errors, slowest {slowest:?}");
    // The service works again: cancel whatever is left, then everything must be consistent.
    let deadline = Instant::now() + Duration::from_secs(20);
    for (_, id) in &ids {
        loop {
            match store.cancel(id).await {
                Ok(_) | Err(CommandError::AlreadyTerminal(_)) => break,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("after restart: {id}: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("store did not recover: {e:?}"),
            }
        }
    }
    ids.push(warm_id);
    for q in &queues {
        let qids: Vec<String> = ids.iter().filter(|(qq, _)| qq == q).map(|(_, id)| id.clone()).collect();
        let truth = check_consistent(&store, q, &qids).await;
        assert!(truth.values().all(|s| *s == CommandStatus::Cancelled));
    }
    // And a service on a fresh queue completes commands.
    let q = queue_name("after");
    let mut tries = 0;
    let svc = loop {
        // (The queue's own connection may report the restart once: broken pipe.)
        match CommandService::builder(store.clone(), &q)
            .settings(fast())
            .handler("noop", on_execute(|_c| async { Ok(CommandResult::succeeded(json!(1))) }))
            .start()
            .await
        {
            Ok(s) => break s,
            Err(e) if tries < 3 => {
                eprintln!("service start after restart: {e:?}");
                tries += 1;
            }
            Err(e) => panic!("{e:?}"),
        }
    };
    let st = store.submit_and_wait(&q, Command::new("noop", json!({})), Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    svc.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_batch() {
    kill_or_pause_mid_batch(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_mid_batch() {
    kill_or_pause_mid_batch(true).await;
}

baton_testkit::on_every_backend!(two_stores_race_cancel_and_complete, many_queues_remote_waiters_wake_promptly);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_node_restart_mid_batch() {
    require_redis();
    let mut cluster = RedisCluster::start();
    let b_cfg = cluster.config();
    let store = CommandStore::redis(
        baton_redis::RedisClient::new(b_cfg).unwrap(),
        baton_commands::RedisCommandStoreOptions::default(),
    )
    .await
    .unwrap();
    let queues: Vec<String> = (0..9).map(|i| queue_name(&format!("cl{i}"))).collect();
    let mut ids = Vec::new();
    for q in &queues {
        for i in 0..60 {
            ids.push(store.submit(q, Command::with_id(format!("c{i}-{q}"), "t", json!(i))).await.unwrap().id);
        }
    }
    let mut tasks = Vec::new();
    for id in &ids {
        let (s, id) = (store.clone(), id.clone());
        tasks.push(tokio::spawn(async move {
            (id.clone(), tokio::time::timeout(Duration::from_secs(30), s.cancel(&id)).await)
        }));
    }
    tokio::time::sleep(Duration::from_millis(2)).await;
    // Restart one master without persistence: its script cache is empty afterwards (NOSCRIPT).
    cluster.nodes()[0].restart();
    for t in tasks {
        let (id, r) = t.await.unwrap();
        assert!(r.is_ok(), "cancel of {id} hung");
    }
    // Commands on the other two masters: their cancel must end up applied, indexes consistent.
    let deadline = Instant::now() + Duration::from_secs(30);
    for id in &ids {
        loop {
            match store.cancel(id).await {
                Ok(_) | Err(CommandError::AlreadyTerminal(_)) | Err(CommandError::NotFound(_)) => break,
                Err(e) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let _ = e;
                }
                Err(e) => panic!("did not recover: {e:?}"),
            }
        }
    }
    for q in &queues {
        let c = store.counts(q).await.unwrap();
        eprintln!("{q}: {c:?}");
        assert_eq!((c.submitted, c.running), (0, 0), "{q}: {c:?}");
    }
}
