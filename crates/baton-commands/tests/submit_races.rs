//! Submits under races and failures (store/commit.rs `Submit`, scripts/submits.lua, the id →
//! queue lookup): the same id from two stores (same body, other body, other queues), a stale
//! lookup taken over by racing submits to three queues (exactly one creates), submits racing
//! cancels, 1 MB params in batches, many queues, a Redis restart mid-burst, a script-cache
//! flush; counts, listings and queue lengths must agree.

use crate::common;

use std::time::{Duration, Instant};

use baton_commands::{Command, CommandError, CommandStatus, CommandStore, CommandStoreSettings, ListQuery};
use baton_redis::redis;
use baton_testkit::{require_redis, RedisServer, TestBackend};
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    same_id_same_body_two_stores,
    same_id_different_body_two_stores,
    same_id_two_queues_two_stores,
    submit_racing_cancel,
    huge_params_in_batch,
    many_queues,
);

baton_testkit::on_every_backend!(stale_lookup_takeover_race);

async fn stream_len(store: &CommandStore, q: &str) -> u64 {
    store.messages().stats(q).await.map(|s| s.length).unwrap_or(0)
}

async fn listed(store: &CommandStore, q: &str) -> usize {
    let mut n = 0;
    let mut cursor = None;
    loop {
        let page = store.list(q, ListQuery { status: None, limit: 1000, cursor, ..Default::default() }).await.unwrap();
        n += page.items.len();
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return n,
        }
    }
}

/// Same id + same body from two stores (and several submits per store): exactly one created.
async fn same_id_same_body_two_stores(b: TestBackend) {
    let a = store_for(&b).await;
    let c = other_store(&b, &a).await;
    let q = queue_name("idem");
    let k = 300;
    let mut futs = Vec::new();
    for i in 0..k {
        for s in [&a, &c, &a, &c] {
            let s = s.clone();
            let q = q.clone();
            futs.push(async move {
                (i, s.submit_created(&q, Command::with_id(format!("i{i}-{q}"), "t", json!({"n": i}))).await)
            });
        }
    }
    let res = futures::future::join_all(futs).await;
    let mut created = vec![0usize; k];
    for (i, r) in res {
        let (st, c) = r.unwrap_or_else(|e| panic!("submit {i}: {e:?}"));
        assert_eq!(st.status, CommandStatus::Submitted);
        assert_eq!(st.params, json!({"n": i}));
        assert_eq!(st.queue, q);
        if c {
            created[i] += 1;
        }
    }
    let bad: Vec<_> = created.iter().enumerate().filter(|(_, c)| **c != 1).collect();
    assert!(bad.is_empty(), "ids not created exactly once: {bad:?}");
    assert_eq!(stream_len(&a, &q).await, k as u64, "stream length");
    let counts = a.counts(&q).await.unwrap();
    assert_eq!(counts.submitted, k as u64);
    assert_eq!(listed(&a, &q).await, k);
}

/// Same id, different bodies from two stores: exactly one wins, the other conflicts.
async fn same_id_different_body_two_stores(b: TestBackend) {
    let a = store_for(&b).await;
    let c = other_store(&b, &a).await;
    let q = queue_name("diff");
    let k = 300;
    let mut futs = Vec::new();
    for i in 0..k {
        for (j, s) in [&a, &c].into_iter().enumerate() {
            let s = s.clone();
            let q = q.clone();
            futs.push(async move {
                (
                    i,
                    j,
                    s.submit_created(&q, Command::with_id(format!("d{i}-{q}"), "t", json!({"n": i, "who": j}))).await,
                )
            });
        }
    }
    let res = futures::future::join_all(futs).await;
    let mut ok = vec![Vec::new(); k];
    for (i, j, r) in res {
        match r {
            Ok((st, created)) => {
                assert!(created, "{i}/{j}: existing with another body?");
                assert_eq!(st.params.parse::<serde_json::Value>().unwrap()["who"], json!(j));
                ok[i].push(j);
            }
            Err(CommandError::Conflict { what, .. }) => assert_eq!(what, "type or params"),
            Err(e) => panic!("{i}/{j}: {e:?}"),
        }
    }
    for (i, o) in ok.iter().enumerate() {
        assert_eq!(o.len(), 1, "id {i}: winners {o:?}");
        let st = a.get(&format!("d{i}-{q}")).await.unwrap().unwrap();
        assert_eq!(st.params.parse::<serde_json::Value>().unwrap()["who"], json!(o[0]));
    }
    assert_eq!(stream_len(&a, &q).await, k as u64);
    assert_eq!(a.counts(&q).await.unwrap().submitted, k as u64);
}

/// Same id to two queues concurrently from two stores: one queue owns it, one message in total.
async fn same_id_two_queues_two_stores(b: TestBackend) {
    let a = store_for(&b).await;
    let c = other_store(&b, &a).await;
    let run = uuid::Uuid::now_v7().simple().to_string();
    let (qa, qb) = (format!("qa-{run}"), format!("qb-{run}"));
    let k = 400;
    let mut futs = Vec::new();
    for i in 0..k {
        for (s, q) in [(&a, &qa), (&c, &qb), (&c, &qa), (&a, &qb)] {
            let (s, q) = (s.clone(), q.clone());
            let id = format!("x{i}-{run}");
            futs.push(
                async move { (i, q.clone(), s.submit_created(&q, Command::with_id(id, "t", json!({"n": i}))).await) },
            );
        }
    }
    let res = futures::future::join_all(futs).await;
    let mut created: Vec<Vec<String>> = vec![Vec::new(); k];
    let mut oks: Vec<Vec<String>> = vec![Vec::new(); k];
    for (i, q, r) in res {
        match r {
            Ok((st, c)) => {
                assert_eq!(st.queue, q);
                oks[i].push(q.clone());
                if c {
                    created[i].push(q);
                }
            }
            Err(CommandError::Conflict { what: "queue", .. }) => {}
            Err(e) => panic!("{i}: {e:?}"),
        }
    }
    let mut problems = Vec::new();
    for i in 0..k {
        let mut qs = oks[i].clone();
        qs.dedup();
        qs.sort();
        qs.dedup();
        if created[i].len() != 1 || qs.len() != 1 {
            problems.push((i, created[i].clone(), oks[i].clone()));
        }
    }
    let (la, lb) = (stream_len(&a, &qa).await, stream_len(&a, &qb).await);
    let (ca, cb) = (a.counts(&qa).await.unwrap(), a.counts(&qb).await.unwrap());
    assert!(
        problems.is_empty() && la + lb == k as u64 && ca.submitted + cb.submitted == k as u64,
        "{} ids owned by two queues / created twice (first: {:?}); stream lengths {la}+{lb}, counts {}+{} for {k} ids",
        problems.len(),
        problems.iter().take(3).collect::<Vec<_>>(),
        ca.submitted,
        cb.submitted
    );
}

/// A lookup left by an expired state (the lookup outlives the state by an hour) and then the
/// same id submitted to two other queues concurrently from two stores: still one owner.
async fn stale_lookup_takeover_race(b: TestBackend) {
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
    let d = store_with(&b, settings).await;
    let run = uuid::Uuid::now_v7().simple().to_string();
    let (q0, q1, q2, q3) = (format!("s0-{run}"), format!("s1-{run}"), format!("s2-{run}"), format!("s3-{run}"));
    let k = 200;
    for i in 0..k {
        a.submit(&q0, Command::with_id(format!("z{i}-{run}"), "t", json!({"n": i}))).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert!(a.get(&format!("z0-{run}")).await.unwrap().is_none(), "state should have expired");
    let mut futs = Vec::new();
    for i in 0..k {
        for (s, q) in [(&a, &q1), (&c, &q2), (&d, &q3)] {
            let (s, q) = (s.clone(), q.clone());
            let id = format!("z{i}-{run}");
            futs.push(
                async move { (i, q.clone(), s.submit_created(&q, Command::with_id(id, "t", json!({"n": i}))).await) },
            );
        }
    }
    let res = futures::future::join_all(futs).await;
    let mut created: Vec<Vec<String>> = vec![Vec::new(); k];
    for (i, q, r) in res {
        match r {
            Ok((_, true)) => created[i].push(q),
            Ok((_, false)) => {}
            Err(CommandError::Conflict { what: "queue", .. }) => {}
            Err(e) => panic!("{i}: {e:?}"),
        }
    }
    let bad: Vec<_> = created.iter().enumerate().filter(|(_, c)| c.len() != 1).collect();
    let total = stream_len(&a, &q1).await + stream_len(&a, &q2).await + stream_len(&a, &q3).await;
    assert!(
        bad.is_empty() && total == k as u64,
        "{} ids created not exactly once (first {:?}); {total} messages for {k} ids",
        bad.len(),
        bad.iter().take(3).collect::<Vec<_>>()
    );
}

/// Submits racing a cancel of the same id (other store): every id ends SUBMITTED or CANCELLED,
/// counts/list agree, one message per created command.
async fn submit_racing_cancel(b: TestBackend) {
    let a = store_for(&b).await;
    let c = other_store(&b, &a).await;
    let q = queue_name("rc");
    let k = 300;
    let mut futs = Vec::new();
    for i in 0..k {
        let (a, c, q) = (a.clone(), c.clone(), q.clone());
        futs.push(tokio::spawn(async move {
            let id = format!("c{i}-{q}");
            let sub = a.submit(&q, Command::with_id(id.clone(), "t", json!({"n": i})));
            let can = async {
                if i % 2 == 0 {
                    tokio::task::yield_now().await;
                }
                // Retry cancel until found (bounded).
                for _ in 0..50 {
                    match c.cancel(&id).await {
                        Err(CommandError::NotFound(_)) => tokio::time::sleep(Duration::from_millis(5)).await,
                        other => return other,
                    }
                }
                Err(CommandError::NotFound(id.clone()))
            };
            let (s, cc) = tokio::join!(sub, can);
            (i, s, cc)
        }));
    }
    let res = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(futs)).await.expect("hang");
    for r in res {
        let (i, s, cc) = r.unwrap();
        s.unwrap_or_else(|e| panic!("submit {i}: {e:?}"));
        let cs = cc.unwrap_or_else(|e| panic!("cancel {i}: {e:?}"));
        assert_eq!(cs.status, CommandStatus::Cancelled);
    }
    let counts = a.counts(&q).await.unwrap();
    assert_eq!(counts.cancelled, k as u64, "{counts:?}");
    assert_eq!(counts.submitted, 0, "{counts:?}");
    assert_eq!(listed(&a, &q).await, k);
    for i in 0..k {
        assert_eq!(c.get(&format!("c{i}-{q}")).await.unwrap().unwrap().status, CommandStatus::Cancelled);
    }
    let len = stream_len(&a, &q).await;
    assert!(len <= k as u64, "stream length {len} > {k}");
}

/// A 1 MB params submit in a batch with small ones: all succeed, data intact.
async fn huge_params_in_batch(b: TestBackend) {
    let a = store_for(&b).await;
    let c = other_store(&b, &a).await;
    let q = queue_name("huge");
    let big = "x".repeat(1 << 20);
    let mut futs = Vec::new();
    for i in 0..300usize {
        let s = if i % 2 == 0 { a.clone() } else { c.clone() };
        let q = q.clone();
        let params = if i % 50 == 7 { json!({"n": i, "big": big.clone()}) } else { json!({"n": i}) };
        futs.push(async move { (i, s.submit(&q, Command::with_id(format!("h{i}-{q}"), "t", params)).await) });
    }
    let t = Instant::now();
    let res = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(futs)).await.expect("hang");
    for (i, r) in res {
        r.unwrap_or_else(|e| panic!("submit {i}: {e:?}"));
    }
    eprintln!("huge batch took {:?}", t.elapsed());
    for i in 0..300usize {
        let st = a.get(&format!("h{i}-{q}")).await.unwrap().unwrap();
        assert_eq!(st.params.parse::<serde_json::Value>().unwrap()["n"], json!(i));
        if i % 50 == 7 {
            assert_eq!(st.params.parse::<serde_json::Value>().unwrap()["big"].as_str().unwrap().len(), 1 << 20);
        }
    }
    // Resubmit of the big ones: existing.
    for i in (0..300usize).filter(|i| i % 50 == 7) {
        let (_, created) = c
            .submit_created(&q, Command::with_id(format!("h{i}-{q}"), "t", json!({"n": i, "big": big.clone()})))
            .await
            .unwrap();
        assert!(!created);
    }
    assert_eq!(stream_len(&a, &q).await, 300);
    assert_eq!(a.counts(&q).await.unwrap().submitted, 300);
}

/// Many queues at once, from two stores.
async fn many_queues(b: TestBackend) {
    let a = store_for(&b).await;
    let c = other_store(&b, &a).await;
    let run = uuid::Uuid::now_v7().simple().to_string();
    let nq = 200;
    let per = 6;
    let mut futs = Vec::new();
    for qi in 0..nq {
        for j in 0..per {
            for s in [&a, &c] {
                let s = s.clone();
                let q = format!("m{qi}-{run}");
                futs.push(async move {
                    s.submit_created(&q, Command::with_id(format!("m{qi}.{j}-{q}"), "t", json!({"j": j}))).await
                });
            }
        }
    }
    let res = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(futs)).await.expect("hang");
    let created = res.into_iter().map(|r| r.unwrap()).filter(|(_, c)| *c).count();
    assert_eq!(created, nq * per);
    for qi in 0..nq {
        let q = format!("m{qi}-{run}");
        assert_eq!(a.counts(&q).await.unwrap().submitted, per as u64, "{q}");
        assert_eq!(stream_len(&a, &q).await, per as u64, "{q}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_mid_burst_standalone() {
    require_redis();
    let server = RedisServer::start();
    let b = TestBackend::Standalone(server);
    let a = store_for(&b).await;
    let c = other_store(&b, &a).await;
    let TestBackend::Standalone(mut server) = b else { unreachable!() };
    let run = uuid::Uuid::now_v7().simple().to_string();
    // Warm the script cache.
    a.submit(&format!("r0-{run}"), Command::with_id(format!("warm-{run}"), "t", json!({}))).await.unwrap();
    c.submit(&format!("r0-{run}"), Command::with_id(format!("warm2-{run}"), "t", json!({}))).await.unwrap();
    let mut futs = Vec::new();
    let t0 = Instant::now();
    for i in 0..4000usize {
        let s = if i % 2 == 0 { a.clone() } else { c.clone() };
        let q = format!("r{}-{run}", i % 5);
        let run = run.clone();
        futs.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = tokio::time::timeout(
                Duration::from_secs(20),
                s.submit_created(&q, Command::with_id(format!("b{i}-{run}"), "t", json!({"i": i}))),
            )
            .await;
            (i, r.map(|r| r.map(|(_, c)| c).map_err(|e| e.to_string())), t.elapsed())
        }));
        if i % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if i == 1500 {
            server = tokio::task::spawn_blocking(move || {
                server.restart();
                server
            })
            .await
            .unwrap();
            eprintln!("restarted at {:?}", t0.elapsed());
        }
    }
    let res = futures::future::join_all(futs).await;
    let (mut ok, mut err, mut hung) = (0, 0, 0);
    let mut max = Duration::ZERO;
    for r in res {
        let (i, r, el) = r.unwrap();
        max = max.max(el);
        match r {
            Ok(Ok(_)) => ok += 1,
            Ok(Err(e)) => {
                if err < 3 {
                    eprintln!("submit {i}: {e}");
                }
                err += 1
            }
            Err(_) => hung += 1,
        }
    }
    eprintln!("ok {ok} err {err} hung {hung} max {max:?}");
    assert_eq!(hung, 0, "callers hung");
    // Afterwards: fresh submits on every queue work, from both stores.
    for qi in 0..5 {
        for (j, s) in [&a, &c].into_iter().enumerate() {
            let q = format!("r{qi}-{run}");
            let r = tokio::time::timeout(
                Duration::from_secs(10),
                s.submit_created(&q, Command::with_id(format!("after{qi}.{j}-{run}"), "t", json!({}))),
            )
            .await
            .expect("hang after restart");
            let (_, created) = r.unwrap_or_else(|e| panic!("after restart {qi}/{j}: {e:?}"));
            assert!(created);
        }
    }
    drop(server);
}

baton_testkit::on_every_backend!(single_script_flush_then_burst, same_id_two_queues_minimal);

/// One SCRIPT FLUSH on every node (as a restart / failover empties the cache), then a burst of
/// concurrent submits over several queues: NOSCRIPT must be absorbed (no caller sees it).
async fn single_script_flush_then_burst(b: TestBackend) {
    let urls = match &b {
        TestBackend::Memory => return,
        TestBackend::Standalone(s) => vec![s.url()],
        TestBackend::Cluster(c) => c.urls(),
    };
    let a = store_for(&b).await;
    let c = other_store(&b, &a).await;
    let run = uuid::Uuid::now_v7().simple().to_string();
    for qi in 0..8 {
        a.submit(&format!("g{qi}-{run}"), Command::with_id(format!("w{qi}a-{run}"), "t", json!({}))).await.unwrap();
        c.submit(&format!("g{qi}-{run}"), Command::with_id(format!("w{qi}c-{run}"), "t", json!({}))).await.unwrap();
    }
    for u in &urls {
        let mut cn = redis::Client::open(u.as_str()).unwrap().get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut cn).await.unwrap();
    }
    let mut futs = Vec::new();
    for i in 0..2000usize {
        let s = if i % 2 == 0 { a.clone() } else { c.clone() };
        let q = format!("g{}-{run}", i % 8);
        let id = format!("g{i}-{run}");
        futs.push(async move { (i, s.submit_created(&q, Command::with_id(id, "t", json!({"i": i}))).await) });
    }
    let res = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(futs)).await.expect("hang");
    let errs: Vec<_> = res.iter().filter_map(|(i, r)| r.as_ref().err().map(|e| (*i, e.to_string()))).collect();
    assert!(errs.is_empty(), "{} submits failed after one SCRIPT FLUSH, e.g. {:?}", errs.len(), errs.first());
}

/// The minimal form: per id, one submit to qa from store A and one to qb from store B.
async fn same_id_two_queues_minimal(b: TestBackend) {
    let a = store_for(&b).await;
    let c = other_store(&b, &a).await;
    let run = uuid::Uuid::now_v7().simple().to_string();
    let (qa, qb) = (format!("na-{run}"), format!("nb-{run}"));
    let k = 200;
    let futs = (0..k).map(|i| {
        let (a, c, qa, qb) = (a.clone(), c.clone(), qa.clone(), qb.clone());
        let id = format!("n{i}-{run}");
        async move {
            let (x, y) = tokio::join!(
                a.submit_created(&qa, Command::with_id(id.clone(), "t", json!({"n": i}))),
                c.submit_created(&qb, Command::with_id(id.clone(), "t", json!({"n": i})))
            );
            (x.is_ok(), y.is_ok())
        }
    });
    let res = futures::future::join_all(futs).await;
    let both = res.iter().filter(|(x, y)| *x && *y).count();
    let none = res.iter().filter(|(x, y)| !*x && !*y).count();
    let (la, lb) = (stream_len(&a, &qa).await, stream_len(&a, &qb).await);
    let (ca, cb) = (a.counts(&qa).await.unwrap().submitted, a.counts(&qb).await.unwrap().submitted);
    assert!(
        both == 0 && none == 0 && la + lb == k as u64 && ca + cb == k as u64,
        "of {k} ids: {both} accepted by both queues, {none} by neither; messages {la}+{lb}, counts {ca}+{cb}"
    );
}

baton_testkit::on_memory_and_standalone!(many_huge_in_one_batch);

/// 160 submits of 1 MB params to one queue at once (batches of up to 128 MB).
async fn many_huge_in_one_batch(b: TestBackend) {
    let a = store_for(&b).await;
    let q = queue_name("hugeall");
    let big = "y".repeat(1 << 20);
    let t = Instant::now();
    let futs = (0..160usize).map(|i| {
        let (a, q) = (a.clone(), q.clone());
        let params = json!({"n": i, "big": big.clone()});
        async move { (i, a.submit(&q, Command::with_id(format!("H{i}-{q}"), "t", params)).await) }
    });
    // A hang, not a slow machine: an unoptimised build on two shared cores spends about a minute
    // escaping the 160 MB of params.
    let res = tokio::time::timeout(Duration::from_secs(300), futures::future::join_all(futs)).await.expect("hang");
    eprintln!("160 x 1MB took {:?}", t.elapsed());
    let errs: Vec<_> = res.iter().filter_map(|(i, r)| r.as_ref().err().map(|e| (*i, e.to_string()))).collect();
    let len = stream_len(&a, &q).await;
    assert!(errs.is_empty(), "{} of 160 failed (stream length {len}), e.g. {:?}", errs.len(), errs.first());
    assert_eq!(len, 160);
}
