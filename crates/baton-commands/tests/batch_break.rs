//! Attacks on the batch submit (`CommandStore::submit_many`): duplicates across the 128-item
//! call boundary, mixed kinds of commands, racing stores, submits and cancels, cut
//! connections mid-batch, stale lookups of other queues. Each checks that every command is
//! decided as alone and that nothing is lost or stored twice (state, counts, listing, stream).

use crate::common;

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use baton_commands::{Command, CommandError, CommandStatus, CommandStore, CommandStoreSettings, ListQuery, OutputSpec};
use baton_redis::redis;
use baton_streams::{StreamStore, StreamStoreSettings};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    duplicates_across_the_128_boundary_are_decided_in_order,
    mixed_kinds_are_each_stored_as_alone_and_resubmit_changes_nothing,
    two_stores_racing_overlapping_batches_create_each_id_once,
    a_batch_racing_single_submits_and_cancels,
    a_batch_takes_over_stale_lookups_of_another_queue,
    racing_batches_with_output_streams,
);

/// Every id listed in `q` (all pages).
async fn listed(store: &CommandStore, q: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cursor = None;
    loop {
        let page =
            store.list(q, ListQuery { limit: 1000, cursor: cursor.clone(), ..Default::default() }).await.unwrap();
        out.extend(page.items.iter().map(|c| c.id.clone()));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    out
}

async fn duplicates_across_the_128_boundary_are_decided_in_order(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("edge");
    let id = |s: &str| format!("{s}-{q}");
    store.submit(&q, Command::with_id(id("old"), "t", json!({"v": "old"}))).await.unwrap();
    let mut batch: Vec<Command> =
        (0..300).map(|i| Command::with_id(id(&format!("p{i}")), "t", json!({"i": i}))).collect();
    // Index 127 (last of the first call): body A; 128 (first of the second): A again; 129: B.
    batch[127] = Command::with_id(id("dup"), "t", json!({"v": "A"}));
    batch[128] = Command::with_id(id("dup"), "t", json!({"v": "A"}));
    batch[129] = Command::with_id(id("dup"), "t", json!({"v": "B"}));
    // A conflict with a stored command at 255/256 (the next boundary), and its twin alike.
    batch[255] = Command::with_id(id("old"), "t", json!({"v": "new"}));
    batch[256] = Command::with_id(id("old"), "t", json!({"v": "old"}));
    let out = store.submit_many(&q, batch).await;
    assert_eq!(out.len(), 300);
    let created = |i: usize| out[i].as_ref().map(|(_, c)| *c).map_err(|e| e.to_string());
    assert_eq!(created(127), Ok(true));
    assert_eq!(created(128), Ok(false));
    assert!(matches!(&out[129], Err(CommandError::Conflict { what: "type or params", .. })), "{:?}", out[129]);
    assert!(matches!(&out[255], Err(CommandError::Conflict { what: "type or params", .. })), "{:?}", out[255]);
    assert_eq!(created(256), Ok(false));
    for i in (0..300).filter(|i| ![127, 128, 129, 255, 256].contains(i)) {
        assert_eq!(created(i), Ok(true), "item {i}");
    }
    assert_eq!(store.get(&id("dup")).await.unwrap().unwrap().params, json!({"v": "A"}));
    // 295 plain + dup + old.
    assert_eq!(store.counts(&q).await.unwrap().submitted, 297);
    assert_eq!(store.messages().stats(&q).await.unwrap().length, 297);
    let l = listed(&store, &q).await;
    assert_eq!((l.len(), l.iter().collect::<HashSet<_>>().len()), (297, 297));
}

async fn mixed_kinds_are_each_stored_as_alone_and_resubmit_changes_nothing(b: TestBackend) {
    let store = store_for(&b).await;
    let streams = match b.redis_config() {
        None => StreamStore::memory(StreamStoreSettings::default()),
        Some(cfg) => StreamStore::redis(cfg, StreamStoreSettings::default()).await.unwrap(),
    };
    store.set_outputs(streams.clone()).unwrap();
    let q = queue_name("mixed");
    let later = SystemTime::now() + Duration::from_secs(3600);
    let make = |i: usize| -> Command {
        let c = Command::with_id(format!("m{i}-{q}"), "t", json!({"i": i}));
        match i % 6 {
            0 => c,
            1 => c.with_output(OutputSpec::default()),
            2 => c.with_run_at(later),
            3 => c.with_priority(5),
            4 => c.with_concurrency_key(format!("k{}", i % 3)),
            _ => c.with_priority(-3).with_concurrency_key("kk").with_output(OutputSpec::default()),
        }
    };
    let n = 300;
    let out = store.submit_many(&q, (0..n).map(make).collect()).await;
    for (i, r) in out.iter().enumerate() {
        let (st, created) = r.as_ref().unwrap_or_else(|e| panic!("item {i}: {e}"));
        assert!(*created, "item {i}");
        assert_eq!(st.id, format!("m{i}-{q}"));
        assert_eq!(st.output.is_some(), i % 6 == 1 || i % 6 == 5, "item {i}");
        assert_eq!(st.run_at.is_some(), i % 6 == 2, "item {i}");
        // As stored: read back.
        let got = store.get(&st.id).await.unwrap().unwrap();
        assert_eq!(
            (got.priority, got.concurrency_key.clone(), got.run_at, got.version),
            (st.priority, st.concurrency_key.clone(), st.run_at, 1)
        );
        if let Some(link) = &got.output {
            assert!(streams.head(&link.path()).await.is_ok(), "item {i}: its output stream exists");
        }
    }
    let scheduled = (0..n).filter(|i| i % 6 == 2).count() as u64;
    let counts = store.counts(&q).await.unwrap();
    assert_eq!(counts.submitted, n as u64, "{counts:?}");
    let stats = store.messages().stats(&q).await.unwrap();
    assert_eq!(stats.length, n as u64 - scheduled, "{stats:?}");
    assert_eq!(listed(&store, &q).await.len(), n);
    // The same batch again (a delay-free retry): every item its stored state, nothing new.
    let again = store.submit_many(&q, (0..n).map(make).collect()).await;
    for (i, r) in again.iter().enumerate() {
        let (st, created) = r.as_ref().unwrap_or_else(|e| panic!("again item {i}: {e}"));
        assert!(!created, "again item {i}");
        assert_eq!(st.created_at, out[i].as_ref().unwrap().0.created_at, "again item {i}");
    }
    assert_eq!(store.counts(&q).await.unwrap().submitted, n as u64);
    assert_eq!(store.messages().stats(&q).await.unwrap().length, n as u64 - scheduled);
    // A changed output on a stored id: the conflict a submit alone gets.
    let other = store
        .submit_many(
            &q,
            vec![
                Command::with_id(format!("m0-{q}"), "t", json!({"i": 0})).with_output(OutputSpec::default()),
                Command::with_id(format!("m2-{q}"), "t", json!({"i": 2})),
            ],
        )
        .await;
    assert!(matches!(&other[0], Err(CommandError::Conflict { what: "output", .. })), "{:?}", other[0]);
    assert!(matches!(&other[1], Err(CommandError::Conflict { what: "run_at", .. })), "{:?}", other[1]);
}

async fn two_stores_racing_overlapping_batches_create_each_id_once(b: TestBackend) {
    let a = store_for(&b).await;
    let c = other_store(&b, &a).await;
    let q = queue_name("race2");
    for round in 0..3 {
        // a: ids 0..600 body {"i"}; c: ids 300..900, the same body for even ids, another for odd.
        let ids = |r: std::ops::Range<usize>, other: bool| -> Vec<Command> {
            r.map(|i| {
                let body = if other && i % 2 == 1 { json!({"i": i, "c": true}) } else { json!({ "i": i }) };
                Command::with_id(format!("r{round}-{i}-{q}"), "t", body)
            })
            .collect()
        };
        let (ra, rc) = tokio::join!(a.submit_many(&q, ids(0..600, false)), c.submit_many(&q, ids(300..900, true)));
        let mut made = vec![0u32; 900];
        for (i, r) in ra.iter().enumerate() {
            match r {
                Ok((_, true)) => made[i] += 1,
                Ok((_, false)) => {}
                Err(CommandError::Conflict { .. }) => assert!(i >= 300 && i % 2 == 1, "a {i}: {r:?}"),
                Err(e) => panic!("a {i}: {e}"),
            }
        }
        for (j, r) in rc.iter().enumerate() {
            let i = j + 300;
            match r {
                Ok((_, true)) => made[i] += 1,
                Ok((_, false)) => assert!(i < 600, "c {i}"),
                Err(CommandError::Conflict { .. }) => assert!(i < 600 && i % 2 == 1, "c {i}: {r:?}"),
                Err(e) => panic!("c {i}: {e}"),
            }
        }
        let bad: Vec<usize> = (0..900).filter(|&i| made[i] != 1).collect();
        assert!(bad.is_empty(), "round {round}: ids not created exactly once: {bad:?}");
    }
    assert_eq!(a.counts(&q).await.unwrap().submitted, 2700);
    assert_eq!(a.messages().stats(&q).await.unwrap().length, 2700);
}

async fn a_batch_racing_single_submits_and_cancels(b: TestBackend) {
    let a = store_for(&b).await;
    let c = other_store(&b, &a).await;
    let q = queue_name("rsc");
    let n = 400;
    let cmd = |i: usize| Command::with_id(format!("x{i}-{q}"), "t", json!({ "i": i }));
    let batch = a.submit_many(&q, (0..n).map(cmd).collect());
    let singles = async {
        let mut futs = Vec::new();
        for i in 0..n {
            let (c, q) = (c.clone(), q.clone());
            futs.push(async move {
                let s = c.submit_created(&q, cmd(i)).await;
                let x = if i % 2 == 0 { Some(c.cancel(&format!("x{i}-{q}")).await) } else { None };
                (s, x)
            });
        }
        futures::future::join_all(futs).await
    };
    let (rb, rs) = tokio::join!(batch, singles);
    for i in 0..n {
        let by_batch = rb[i].as_ref().unwrap_or_else(|e| panic!("batch {i}: {e}")).1;
        let by_single = rs[i].0.as_ref().unwrap_or_else(|e| panic!("single {i}: {e}")).1;
        assert!(by_batch ^ by_single, "{i}: created by batch {by_batch}, by single {by_single}");
        if let Some(x) = &rs[i].1 {
            let st = x.as_ref().unwrap_or_else(|e| panic!("cancel {i}: {e}"));
            assert_eq!(st.status, CommandStatus::Cancelled, "{i}");
        }
    }
    let counts = a.counts(&q).await.unwrap();
    assert_eq!((counts.submitted, counts.cancelled), (n as u64 / 2, n as u64 / 2), "{counts:?}");
    assert_eq!(listed(&a, &q).await.len(), n);
}

async fn a_batch_takes_over_stale_lookups_of_another_queue(b: TestBackend) {
    if b.redis_config().is_none() {
        return;
    }
    let settings = CommandStoreSettings {
        state_ttl: Duration::from_secs(1),
        retention: Duration::from_secs(1),
        ..Default::default()
    };
    let a = store_with(&b, settings.clone()).await;
    let c = store_with(&b, settings.clone()).await;
    let run = uuid::Uuid::now_v7().simple().to_string();
    let (q0, q1, q2) = (format!("t0-{run}"), format!("t1-{run}"), format!("t2-{run}"));
    let k = 200;
    let old: Vec<Command> = (0..k).map(|i| Command::with_id(format!("z{i}-{run}"), "t", json!({ "i": i }))).collect();
    assert!(a.submit_many(&q0, old.clone()).await.iter().all(|r| matches!(r, Ok((_, true)))));
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert!(a.get(&format!("z0-{run}")).await.unwrap().is_none(), "state should have expired");
    // Two batches of the same ids to two other queues, from two stores, plus duplicates.
    let mut twice = old.clone();
    twice.extend(old.iter().take(50).cloned());
    let (r1, r2) = tokio::join!(a.submit_many(&q1, twice.clone()), c.submit_many(&q2, twice));
    let mut made = vec![Vec::new(); k];
    for (q, rs) in [(&q1, &r1), (&q2, &r2)] {
        for (j, r) in rs.iter().enumerate() {
            match r {
                Ok((_, true)) => made[j % k].push(q.clone()),
                Ok((st, false)) => assert_eq!(&st.queue, q, "{j}"),
                Err(CommandError::Conflict { what: "queue", .. }) => {}
                Err(e) => panic!("{q} {j}: {e}"),
            }
        }
    }
    let bad: Vec<usize> = (0..k).filter(|&i| made[i].len() != 1).collect();
    assert!(bad.is_empty(), "{} ids not created exactly once: {bad:?}", bad.len());
    let total = a.messages().stats(&q1).await.unwrap().length + a.messages().stats(&q2).await.unwrap().length;
    assert_eq!(total, k as u64);
}

/// The batch of `cut_*` tests: 1000 commands; at each 128-call boundary an id given twice,
/// body A before the boundary, body B after it (A must win: the batch decides in order).
fn cut_batch(run: &str) -> Vec<Command> {
    let mut batch: Vec<Command> =
        (0..1000).map(|i| Command::with_id(format!("k{i}-{run}"), "t", json!({ "i": i }))).collect();
    for j in 0..7 {
        let id = format!("d{j}-{run}");
        batch[j * 128 + 100] = Command::with_id(id.clone(), "t", json!({"v": "A"}));
        batch[j * 128 + 130] = Command::with_id(id, "t", json!({"v": "B"}));
    }
    batch
}

/// Item `i` of [`cut_batch`] is a B copy (a conflict with its A copy).
fn is_b(i: usize) -> bool {
    i >= 130 && (i - 130).is_multiple_of(128) && (i - 130) / 128 < 7
}

/// After a batch cut by connection kills or a restart: resubmitting it (until no item fails
/// on the connection) ends with every id stored once, in the stream once, and each runs once.
/// The copies of an id are decided in order: in one batch, a B copy is never created while its
/// A copy gets the conflict (A is decided first: created, found, or failed on the connection).
async fn resubmit_until_whole(
    store: &CommandStore,
    q: &str,
    run: &str,
    first: Vec<Result<(baton_commands::CommandState, bool), CommandError>>,
) {
    let batch = cut_batch(run);
    let mut created: std::collections::HashMap<String, u32> = std::collections::HashMap::new();
    // Ids that failed on the connection in some round: their write may have happened all the
    // same (the reply was lost); a later round then finds them stored (200, as alone).
    let mut errored: HashSet<String> = HashSet::new();
    let mut note = |out: &[Result<(baton_commands::CommandState, bool), CommandError>]| -> usize {
        let mut failed = 0;
        for (i, r) in out.iter().enumerate() {
            match r {
                Ok((_, true)) => *created.entry(batch[i].id.clone()).or_default() += 1,
                Ok((_, false)) => {}
                Err(CommandError::Conflict { .. }) if is_b(i) || is_b(i + 30) => {}
                Err(e) => {
                    errored.insert(batch[i].id.clone());
                    if failed < 3 {
                        eprintln!("item {i}: {e:?}");
                    }
                    failed += 1
                }
            }
            if is_b(i) {
                let a = &out[i - 30];
                assert!(
                    !(matches!(r, Ok((_, true))) && matches!(a, Err(CommandError::Conflict { .. }))),
                    "item {i}: the later copy B was created and the earlier copy A got the conflict"
                );
            }
        }
        failed
    };
    let mut failed = note(&first);
    let mut rounds = 0;
    while failed > 0 {
        rounds += 1;
        assert!(rounds < 10, "the batch keeps failing: {failed} items");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let again = store.submit_many(q, cut_batch(run)).await;
        failed = note(&again);
    }
    let unseen: Vec<&String> =
        batch.iter().map(|c| &c.id).filter(|id| !created.contains_key(*id) && !errored.contains(*id)).collect();
    assert!(unseen.is_empty(), "stored but never answered created (nor failed first): {unseen:?}");
    let many: Vec<_> = created.iter().filter(|(_, n)| **n != 1).collect();
    assert!(many.is_empty(), "ids created more than once: {many:?}");
    let counts = store.counts(q).await.unwrap();
    assert_eq!(counts.submitted, 993, "{counts:?}");
    assert_eq!(store.messages().stats(q).await.unwrap().length, 993);
    let l = listed(store, q).await;
    assert_eq!((l.len(), l.iter().collect::<HashSet<_>>().len()), (993, 993));
    // Each runs once.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashMap::<String, u32>::new()));
    let s2 = seen.clone();
    let svc = baton_commands::CommandService::builder(store.clone(), q)
        .settings(fast())
        .handler(
            "t",
            on_execute(move |c: Command| {
                let s2 = s2.clone();
                async move {
                    *s2.lock().unwrap().entry(c.id.clone()).or_default() += 1;
                    Ok(baton_commands::CommandResult::succeeded(json!({})))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs(20);
    while store.counts(q).await.unwrap().succeeded < 993 {
        assert!(tokio::time::Instant::now() < until, "not all ran: {:?}", store.counts(q).await.unwrap());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    svc.close().await;
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 993);
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "ran more than once: {twice:?}");
}

/// `CLIENT KILL` of the store's connections, again and again, while a batch of 1000 is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_client_kill_mid_batch_then_resubmit() {
    baton_testkit::require_redis();
    cut_client_kill(TestBackend::Standalone(baton_testkit::RedisServer::start())).await;
}

/// The same on Cluster (every node's normal clients killed, every 3 ms while the batch runs).
///
/// Such a storm (hundreds of connections killed) can wedge the redis crate's `ClusterConnection`
/// for good (every later call timing out); the store's shared connection (`baton_redis::ClusterConn`)
/// then replaces it, and the resubmits go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_client_kill_mid_batch_then_resubmit_cluster() {
    baton_testkit::require_redis();
    cut_client_kill(TestBackend::Cluster(baton_testkit::RedisCluster::start())).await;
}

async fn cut_client_kill(b: TestBackend) {
    let store = store_for(&b).await;
    let run = uuid::Uuid::now_v7().simple().to_string();
    let q = format!("ck-{run}");
    let urls = match &b {
        TestBackend::Standalone(s) => vec![s.url()],
        TestBackend::Cluster(c) => c.urls(),
        TestBackend::Memory => unreachable!(),
    };
    let kills = baton_testkit::KillStorm::start(urls, Duration::from_millis(3)).await;
    let first = store.submit_many(&q, cut_batch(&run)).await;
    let n = kills.stop().await;
    let failed = first.iter().filter(|r| matches!(r, Err(e) if !matches!(e, CommandError::Conflict { .. }))).count();
    eprintln!("{n} connections killed; {failed} items failed in the first batch");
    resubmit_until_whole(&store, &q, &run, first).await;
}

/// A SIGKILL and restart of Redis (AOF, fsync always) while a batch of 1000 is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_redis_restart_mid_batch_then_resubmit() {
    baton_testkit::require_redis();
    let server = baton_testkit::RedisServer::start_with(baton_testkit::ServerOptions { appendonly: true });
    let b = TestBackend::Standalone(server);
    let store = store_for(&b).await;
    let TestBackend::Standalone(mut server) = b else { unreachable!() };
    let run = uuid::Uuid::now_v7().simple().to_string();
    let q = format!("rr-{run}");
    let restart = tokio::task::spawn_blocking(move || {
        std::thread::sleep(Duration::from_millis(3));
        let killed = std::time::Instant::now();
        server.restart();
        (server, killed)
    });
    let t0 = std::time::Instant::now();
    let first = store.submit_many(&q, cut_batch(&run)).await;
    let done = std::time::Instant::now();
    let (_server, killed) = restart.await.unwrap();
    eprintln!("first batch took {:?}; Redis killed after {:?}", done - t0, killed - t0);
    assert!(killed < done, "Redis was killed after the batch ended: not a test of a cut batch");
    let failed = first.iter().filter(|r| matches!(r, Err(e) if !matches!(e, CommandError::Conflict { .. }))).count();
    eprintln!("{failed} items failed in the first batch");
    resubmit_until_whole(&store, &q, &run, first).await;
}

/// Two stores (Redis: two processes' worth) race batches of the same ids with output streams,
/// each id twice in each batch; store c asks another content type for odd ids. Each id is
/// created once, and its stored output stream exists with the stored content type (no loser
/// deleted the winner's stream).
async fn racing_batches_with_output_streams(b: TestBackend) {
    let a = store_for(&b).await;
    let c = other_store(&b, &a).await;
    let streams = |_: ()| async {
        match b.redis_config() {
            None => StreamStore::memory(StreamStoreSettings::default()),
            Some(cfg) => StreamStore::redis(cfg, StreamStoreSettings::default()).await.unwrap(),
        }
    };
    let sa = streams(()).await;
    a.set_outputs(sa.clone()).unwrap();
    if !matches!(b, TestBackend::Memory) {
        c.set_outputs(streams(()).await).unwrap();
    }
    let q = queue_name("outrace");
    let n = 100;
    let batch = |other: bool| -> Vec<Command> {
        let mut v = Vec::new();
        for i in 0..n {
            let spec = OutputSpec {
                content_type: Some(if other && i % 2 == 1 { "text/plain".into() } else { "application/json".into() }),
                ..Default::default()
            };
            let cmd = Command::with_id(format!("o{i}-{q}"), "t", json!({ "i": i })).with_output(spec);
            v.push(cmd.clone());
            v.push(cmd);
        }
        v
    };
    let (ra, rc) = tokio::join!(a.submit_many(&q, batch(false)), c.submit_many(&q, batch(true)));
    let mut made = vec![0; n];
    for (who, rs) in [("a", &ra), ("c", &rc)] {
        for (j, r) in rs.iter().enumerate() {
            match r {
                Ok((_, true)) => made[j / 2] += 1,
                Ok((_, false)) => {}
                Err(CommandError::Conflict { .. }) => assert_eq!(j / 2 % 2, 1, "{who} {j}: {r:?}"),
                Err(e) => panic!("{who} {j}: {e}"),
            }
        }
    }
    let bad: Vec<usize> = (0..n).filter(|&i| made[i] != 1).collect();
    assert!(bad.is_empty(), "ids not created exactly once: {bad:?}");
    for i in 0..n {
        let st = a.get(&format!("o{i}-{q}")).await.unwrap().unwrap();
        let link = st.output.clone().unwrap();
        let info = sa.head(&link.path()).await.unwrap_or_else(|e| panic!("o{i}: its output stream is gone: {e}"));
        assert_eq!(info.content_type, link.content_type, "o{i}");
    }
}

/// A batch whose script ran but whose reply was lost (the connection cut while Redis was busy:
/// the command sat in Redis's socket and ran before Redis saw the close): the store's retry
/// finds the states it wrote itself, and answers created, as the first attempt would have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_of_a_batch_that_ran_is_still_created() {
    baton_testkit::require_redis();
    let server = baton_testkit::RedisServer::start();
    let target: std::net::SocketAddr = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let proxy = baton_testkit::TcpProxy::start(target).await;
    let store = baton_commands::CommandStore::redis(
        baton_redis::RedisClient::new(baton_redis::RedisConfig::standalone(format!("redis://{}", proxy.addr())))
            .unwrap(),
        Default::default(),
    )
    .await
    .unwrap();
    let run = uuid::Uuid::now_v7().simple().to_string();
    let q = format!("lost-{run}");
    store.submit(&q, Command::new("warm", json!({}))).await.unwrap();
    // Redis busy for 600 ms (a script spinning on its clock), from a connection of its own.
    let mut busy = redis::Client::open(server.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let spin = tokio::spawn(async move {
        let script = "local t = redis.call('TIME') local s = t[1] * 1000 + t[2] / 1000 \
                      while true do local n = redis.call('TIME') if n[1] * 1000 + n[2] / 1000 - s > 600 then break end end return 1";
        // (This client may give up waiting first: Redis runs the script to its end anyway.)
        let _: redis::RedisResult<i64> = redis::cmd("EVAL").arg(script).arg(0).query_async(&mut busy).await;
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let batch: Vec<Command> = (0..3).map(|i| Command::with_id(format!("l{i}-{run}"), "t", json!({ "i": i }))).collect();
    let submit = {
        let (store, q) = (store.clone(), q.clone());
        tokio::spawn(async move { store.submit_many(&q, batch).await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    proxy.drop_connections();
    spin.await.unwrap();
    let out = submit.await.unwrap();
    let got: Vec<Result<bool, String>> =
        out.iter().map(|r| r.as_ref().map(|(_, c)| *c).map_err(|e| e.to_string())).collect();
    assert_eq!(got, vec![Ok(true), Ok(true), Ok(true)], "the batch's own writes answered as found");
    assert_eq!(store.counts(&q).await.unwrap().submitted, 4);
}
