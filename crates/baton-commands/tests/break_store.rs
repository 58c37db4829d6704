//! Adversarial tests of the Redis command state layout (one string per command with a header,
//! merged per-status listing, background pruning, unowned acks, `submit_and_wait`).

use crate::common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_commands::{
    Command, CommandError, CommandResult, CommandService, CommandStatus, CommandStoreSettings, ListQuery,
};
use baton_redis::redis;
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    background_prune_reaches_every_queue_of_a_store,
    ids_spelling_index_keys_do_not_break_the_queue,
    resubmit_after_each_transition_is_idempotent,
    large_and_unicode_params_round_trip,
    list_pages_merge_statuses_with_equal_created_ms,
    counts_stay_exact_when_stores_have_different_lifetimes,
    counts_stay_exact_after_a_live_entry_was_rescored,
    submit_and_wait_conflicts_and_timeouts,
    stale_consumer_completion_leaves_nothing_pending,
);

async fn zcard(b: &TestBackend, key: String) -> u64 {
    let conn = baton_redis::RedisClient::new(b.redis_config().unwrap()).unwrap().shared().await.unwrap();
    redis::cmd("ZCARD").arg(key).query_async::<u64>(&mut conn.clone()).await.unwrap()
}

/// Pruning runs on every 64th submit *of the store*, for the queue of that submit only. With two
/// queues whose submits alternate, one queue never gets the 64th submit: its indexes of expired
/// states grow without bound although the crate docs say submits keep them bounded.
async fn background_prune_reaches_every_queue_of_a_store(b: TestBackend) {
    if b.redis_config().is_none() {
        return; // memory has no index keys
    }
    let settings = CommandStoreSettings {
        state_ttl: Duration::from_secs(60),
        retention: Duration::from_secs(1),
        ..Default::default()
    };
    let store = store_with(&b, settings).await;
    let qa = queue_name("prune-a");
    let qb = queue_name("prune-b");
    // 5 expired-to-be commands in B (store submits #0..#4).
    for i in 0..5 {
        store.submit(&qb, Command::with_id(format!("old-{i}"), "t", json!(i))).await.unwrap();
        store.cancel(&format!("old-{i}")).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1300)).await; // retention passes
                                                           // Submits #5..#63 to A, then A and B alternate: every 64th submit of the store is A's.
    let mut n = 0;
    for _ in 5..64 {
        store.submit(&qa, Command::with_id(format!("a-{n}"), "t", json!(n))).await.unwrap();
        n += 1;
    }
    for i in 0..200 {
        store.submit(&qa, Command::with_id(format!("a-{n}"), "t", json!(n))).await.unwrap();
        n += 1;
        store.submit(&qb, Command::with_id(format!("b-{i}"), "t", json!(i))).await.unwrap();
    }
    let cancelled_b = format!("baton:cmd:{{{qb}}}:s:CANCELLED");
    let mut left = 0;
    for _ in 0..50 {
        left = zcard(&b, cancelled_b.clone()).await;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert_eq!(left, 0, "queue B got 200 submits and its expired index entries were never pruned");
}

/// A state key was `p:cmd:{q}:<id>` and the indexes are `p:cmd:{q}:exp` and `p:cmd:{q}:s:<STATUS>`:
/// an id may contain ':' so a client-chosen id can name an index key.
async fn ids_spelling_index_keys_do_not_break_the_queue(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("ids");
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "t",
            on_execute(|_c| async { Ok(CommandResult::running_after(Duration::from_millis(20))) })
                .on_check(|_c, _s| async { Ok(CommandResult::succeeded(json!("ok"))) }),
        )
        .start()
        .await
        .unwrap();
    // The first command of a fresh queue is named like the RUNNING index, the second like the
    // expiry index. Either may be refused as an invalid id, but must not break other commands.
    for evil in ["s:RUNNING", "exp", "s:SUCCEEDED"] {
        match store.submit(&q, Command::with_id(evil, "t", json!(null))).await {
            Ok(_) | Err(CommandError::InvalidId(_)) => {}
            Err(e) => panic!("submit of id {evil:?}: {e}"),
        }
    }
    let st = store.submit(&q, Command::with_id("normal", "t", json!(1))).await.unwrap();
    assert_eq!(st.status, CommandStatus::Submitted);
    let st = store.wait("normal", Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded, "{st:?}");
    let counts = store.counts(&q).await.unwrap();
    assert!(counts.succeeded >= 1, "{counts:?}");
    let page = store.list(&q, ListQuery::default()).await.unwrap();
    assert!(page.items.iter().any(|s| s.id == "normal"));
    drop(svc);
}

/// The body hash lives in the header only; every write rebuilds the header, so it must survive
/// SUBMITTED → RUNNING → SUCCEEDED, a cancel and a hand-off.
async fn resubmit_after_each_transition_is_idempotent(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("resub");
    let q2 = queue_name("resub-target");
    let gate = Arc::new(tokio::sync::Notify::new());
    let g2 = gate.clone();
    let _svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "t",
            on_execute(|_c| async { Ok(CommandResult::running_after(Duration::from_millis(20))) }).on_check(
                move |c, _s| {
                    let g = g2.clone();
                    async move {
                        if c.id.starts_with("h-") {
                            return Ok(CommandResult::handed_off(
                                c.id.trim_start_matches("h-").split('|').next().unwrap(),
                            ));
                        }
                        g.notified().await;
                        Ok(CommandResult::succeeded(json!("done")))
                    }
                },
            ),
        )
        .start()
        .await
        .unwrap();
    let _svc2 = CommandService::builder(store.clone(), &q2)
        .settings(fast())
        .handler(
            "t",
            on_execute(|_c| async { Ok(CommandResult::failed("not here")) })
                .on_check(|_c, _s| async { Ok(CommandResult::running_after(Duration::from_millis(50))) }),
        )
        .start()
        .await
        .unwrap();
    let params = json!({"b": "x y ü ✓", "a": [1, {"z": null, "y": "\u{0}"}]});
    let same = json!({"a": [1, {"y": "\u{0}", "z": null}], "b": "x y ü ✓"});
    let other = json!({"a": [1, {"y": "\u{0}", "z": null}], "b": "x y ü ✓ "});
    let id = "ü-ñ-✓:1/é";
    let check = |want: CommandStatus| {
        let (store, q, same, other) = (store.clone(), q.clone(), same.clone(), other.clone());
        async move {
            let (st, created) = store.submit_created(&q, Command::with_id(id, "t", same)).await.unwrap();
            assert!(!created);
            assert_eq!(st.status, want);
            match store.submit(&q, Command::with_id(id, "t", other)).await {
                Err(CommandError::Conflict { what: "type or params", .. }) => {}
                r => panic!("other params after {want}: {r:?}"),
            }
            match store.submit(&q, Command::with_id(id, "u", json!(null))).await {
                Err(CommandError::Conflict { .. }) => {}
                r => panic!("other type after {want}: {r:?}"),
            }
        }
    };
    store.submit(&q, Command::with_id(id, "t", params.clone())).await.unwrap();
    let running = eventually(Duration::from_secs(10), || {
        let s = store.clone();
        async move { s.get(id).await.unwrap().filter(|s| s.status == CommandStatus::Running) }
    })
    .await;
    assert!(running.is_some());
    check(CommandStatus::Running).await;
    gate.notify_one();
    let st = store.wait(id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    check(CommandStatus::Succeeded).await;

    // Cancelled.
    store.submit(&q, Command::with_id("c-1", "t", json!({"k": 1}))).await.unwrap();
    store.cancel("c-1").await.unwrap();
    let (st, created) = store.submit_created(&q, Command::with_id("c-1", "t", json!({"k": 1}))).await.unwrap();
    assert!(!created);
    assert_eq!(st.status, CommandStatus::Cancelled);
    assert!(matches!(
        store.submit(&q, Command::with_id("c-1", "t", json!({"k": 2}))).await,
        Err(CommandError::Conflict { .. })
    ));

    // Handed off (the state stays home, its header rebuilt by the hand-off write).
    let hid = format!("h-{q2}");
    store.submit(&q, Command::with_id(&hid, "t", json!([1, 2]))).await.unwrap();
    let handed = eventually(Duration::from_secs(10), || {
        let (s, hid) = (store.clone(), hid.clone());
        async move { s.get(&hid).await.unwrap().filter(|s| s.handed_off_to.is_some()) }
    })
    .await;
    assert!(handed.is_some());
    let (st, created) = store.submit_created(&q, Command::with_id(&hid, "t", json!([1, 2]))).await.unwrap();
    assert!(!created);
    assert_eq!(st.handed_off_to.as_deref(), Some(q2.as_str()));
    assert!(matches!(
        store.submit(&q, Command::with_id(&hid, "t", json!([2, 1]))).await,
        Err(CommandError::Conflict { .. })
    ));
    // On the target queue the id conflicts (another home).
    assert!(matches!(
        store.submit(&q2, Command::with_id(&hid, "t", json!([1, 2]))).await,
        Err(CommandError::Conflict { what: "queue", .. })
    ));
    store.cancel(&hid).await.unwrap();
    let (st, _) = store.submit_created(&q, Command::with_id(&hid, "t", json!([1, 2]))).await.unwrap();
    assert_eq!(st.status, CommandStatus::Cancelled);
}

/// Very large params and unicode: the header is read with GETRANGE 0 99, the JSON follows.
async fn large_and_unicode_params_round_trip(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("big");
    let big: String = "ü ✓ {} \" \\ ".repeat(200_000); // ~3 MB of JSON text
    let params = json!({"blob": big, "n": u64::MAX, "f": 1.5e300});
    let st = store.submit(&q, Command::with_id("big-1", "t", params.clone())).await.unwrap();
    assert_eq!(st.params, params);
    let got = store.get("big-1").await.unwrap().unwrap();
    assert_eq!(got.params, params);
    let (_, created) = store.submit_created(&q, Command::with_id("big-1", "t", params.clone())).await.unwrap();
    assert!(!created);
    let mut p2 = params.clone();
    p2["blob"] = json!(format!("{big}!"));
    assert!(matches!(store.submit(&q, Command::with_id("big-1", "t", p2)).await, Err(CommandError::Conflict { .. })));
    let c = store.cancel("big-1").await.unwrap();
    assert_eq!(c.params, params);
    let w = store.wait("big-1", Duration::from_secs(1)).await.unwrap();
    assert_eq!((w.status, w.version), (CommandStatus::Cancelled, 2));
    let page = store.list(&q, ListQuery::default()).await.unwrap();
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].params, params);
    // A type with spaces and unicode, the longest id allowed.
    let id = "é".repeat(100); // 200 bytes
    let t = "a type with spaces ✓";
    store.submit(&q, Command::with_id(&id, t, json!("x"))).await.unwrap();
    let (st, created) = store.submit_created(&q, Command::with_id(&id, t, json!("x"))).await.unwrap();
    assert!(!created);
    assert_eq!(st.command_type, t);
    let c = store.cancel(&id).await.unwrap();
    assert_eq!(c.status, CommandStatus::Cancelled);
}

/// Listing every status merges the five per-status indexes. Submitted concurrently, many
/// commands share a created ms; pages must then follow (created desc, id desc) exactly, with
/// no duplicates and no gaps, whatever the page size.
async fn list_pages_merge_statuses_with_equal_created_ms(b: TestBackend) {
    let settings = CommandStoreSettings {
        state_ttl: Duration::from_secs(60),
        retention: Duration::from_secs(1),
        ..Default::default()
    };
    let store = store_with(&b, settings).await;
    let q = queue_name("list");
    let subs = (0..90).map(|i| {
        let (s, q) = (store.clone(), q.clone());
        async move { s.submit(&q, Command::with_id(format!("c-{:03}", (i * 37) % 90), "t", json!(i))).await.unwrap() }
    });
    futures::future::join_all(subs).await;
    // Some expire (cancelled with a 1 s retention), some stay cancelled... in another status:
    // cancel every 3rd now (they expire), and every 5th later (they stay).
    for i in (0..90).step_by(3) {
        store.cancel(&format!("c-{i:03}")).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1300)).await;
    for i in (1..90).step_by(5) {
        if i % 3 != 0 {
            store.cancel(&format!("c-{i:03}")).await.unwrap();
        }
    }
    let mut all: Vec<(u64, String)> = Vec::new();
    for i in 0..90 {
        if i % 3 == 0 {
            continue;
        }
        let st = store.get(&format!("c-{i:03}")).await.unwrap().expect("live");
        all.push((st.created_at.millis(), st.id));
    }
    all.sort_by(|a, b| b.cmp(a));
    let expected: Vec<String> = all.iter().map(|(_, id)| id.clone()).collect();
    let distinct_ms: std::collections::HashSet<u64> = all.iter().map(|(ms, _)| *ms).collect();
    assert!(distinct_ms.len() < all.len(), "no created ms shared: the test proves less");
    for limit in [1usize, 2, 3, 7, 1000] {
        let mut got: Vec<String> = Vec::new();
        let mut cursor = None;
        let mut pages = 0;
        loop {
            let page = store
                .list(&q, ListQuery { status: None, limit, cursor: cursor.clone(), ..Default::default() })
                .await
                .unwrap();
            got.extend(page.items.iter().map(|s| s.id.clone()));
            pages += 1;
            assert!(pages < 500);
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        assert_eq!(got, expected, "limit {limit}");
    }
    // One status at a time, paged.
    for status in [CommandStatus::Submitted, CommandStatus::Cancelled] {
        let want: Vec<String> = {
            let mut v = Vec::new();
            for id in &expected {
                if store.get(id).await.unwrap().unwrap().status == status {
                    v.push(id.clone());
                }
            }
            v
        };
        let mut got = Vec::new();
        let mut cursor = None;
        loop {
            let page = store
                .list(&q, ListQuery { status: Some(status), limit: 4, cursor, ..Default::default() })
                .await
                .unwrap();
            got.extend(page.items.iter().map(|s| s.id.clone()));
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        assert_eq!(got, want, "{status}");
    }
    let counts = store.counts(&q).await.unwrap();
    assert_eq!(counts.total() as usize, expected.len(), "{counts:?}");
    assert_eq!(counts.cancelled, 12);
}

/// Two processes on one Redis with different lifetimes: the submitter's expiry score assumed
/// its own (long) lifetime; a terminal write by a store with a short retention must keep the
/// score a lower bound, or counts include an expired command until the old bound passes.
async fn counts_stay_exact_when_stores_have_different_lifetimes(b: TestBackend) {
    if b.redis_config().is_none() {
        return; // one store per memory backend
    }
    let submitter = store_for(&b).await; // 7 days / 24 h
    let short = CommandStoreSettings {
        state_ttl: Duration::from_secs(60),
        retention: Duration::from_secs(1),
        ..Default::default()
    };
    let worker = store_with(&b, short).await;
    let q = queue_name("mixed");
    submitter.submit(&q, Command::with_id("m-1", "t", json!(1))).await.unwrap();
    worker.cancel("m-1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(worker.get("m-1").await.unwrap().is_none(), "expired");
    let counts = worker.counts(&q).await.unwrap();
    assert_eq!(counts.total(), 0, "an expired command is still counted: {counts:?}");
    let counts = submitter.counts(&q).await.unwrap();
    assert_eq!(counts.total(), 0, "{counts:?}");
}

/// One store, one setting: the submit scores the expiry index at now + retention (the shorter
/// lifetime). A command still SUBMITTED when that passes is re-scored by a prune to its real
/// expiry (now + state_ttl). A cancel then gives it `retention` only: the score must come down,
/// or the expired command is counted until the state_ttl-based score passes.
async fn counts_stay_exact_after_a_live_entry_was_rescored(b: TestBackend) {
    let settings = CommandStoreSettings {
        state_ttl: Duration::from_secs(4),
        retention: Duration::from_secs(1),
        ..Default::default()
    };
    let store = store_with(&b, settings).await;
    let q = queue_name("rescore");
    store.submit(&q, Command::with_id("r-1", "t", json!(1))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await; // the submit's score (now + 1 s) passed
    assert_eq!(store.counts(&q).await.unwrap().submitted, 1); // prunes: re-scored to now + ~3 s
    store.cancel("r-1").await.unwrap(); // expires in 1 s
    tokio::time::sleep(Duration::from_millis(1400)).await;
    assert!(store.get("r-1").await.unwrap().is_none(), "expired");
    let counts = store.counts(&q).await.unwrap();
    assert_eq!(counts.total(), 0, "an expired command is still counted: {counts:?}");
    assert!(store.list(&q, ListQuery::default()).await.unwrap().items.is_empty());
}

async fn submit_and_wait_conflicts_and_timeouts(b: TestBackend) {
    let store = store_for(&b).await;
    let other = other_store(&b, &store).await;
    let q1 = queue_name("sw1");
    let q2 = queue_name("sw2");
    store.submit(&q1, Command::with_id("sw-x", "t", json!(1))).await.unwrap();
    // Another queue: a conflict, nothing stored there, and the command untouched.
    match other.submit_and_wait(&q2, Command::with_id("sw-x", "t", json!(1)), Duration::from_secs(5)).await {
        Err(CommandError::Conflict { what: "queue", .. }) => {}
        r => panic!("{r:?}"),
    }
    assert_eq!(other.counts(&q2).await.unwrap().total(), 0);
    match other.submit_and_wait(&q1, Command::with_id("sw-x", "t", json!(2)), Duration::from_secs(5)).await {
        Err(CommandError::Conflict { what: "type or params", .. }) => {}
        r => panic!("{r:?}"),
    }
    // Same body, nobody works on it: returns the non-terminal state at the timeout.
    let t0 = std::time::Instant::now();
    let st =
        other.submit_and_wait(&q1, Command::with_id("sw-x", "t", json!(1)), Duration::from_millis(300)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Submitted);
    assert!(t0.elapsed() >= Duration::from_millis(290) && t0.elapsed() < Duration::from_secs(3));
    // Zero timeout: the submitted state at once.
    let st = other.submit_and_wait(&q1, Command::with_id("sw-y", "t", json!(1)), Duration::ZERO).await.unwrap();
    assert_eq!((st.status, st.version), (CommandStatus::Submitted, 1));
    // A cancel from another store wakes it (notification, not the 1 s fallback).
    let s2 = store.clone();
    let h = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        s2.cancel("sw-x").await.unwrap();
    });
    let t0 = std::time::Instant::now();
    let st =
        other.submit_and_wait(&q1, Command::with_id("sw-x", "t", json!(1)), Duration::from_secs(10)).await.unwrap();
    h.await.unwrap();
    assert_eq!(st.status, CommandStatus::Cancelled);
    assert!(t0.elapsed() < Duration::from_millis(900), "{:?}", t0.elapsed());
    // Terminal already: at once.
    let st =
        store.submit_and_wait(&q1, Command::with_id("sw-x", "t", json!(1)), Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Cancelled);
    // Invalid type refused before anything is stored.
    assert!(matches!(
        store.submit_and_wait(&q1, Command::with_id("sw-z", "", json!(1)), Duration::from_secs(1)).await,
        Err(CommandError::InvalidType(_))
    ));
    assert!(store.get("sw-z").await.unwrap().is_none());
}

/// A consumer whose lease was taken over (its handler outlived `max_processing_time`) completes
/// the command: its terminal write acks the entry another consumer now holds. The command ends
/// terminal once, and nothing is left pending or re-run.
async fn stale_consumer_completion_leaves_nothing_pending(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("stale");
    let checks = Arc::new(AtomicU32::new(0));
    let mut s = fast();
    s.claim_timeout = Duration::from_millis(300);
    s.max_processing_time = Duration::from_millis(400);
    s.poll_interval = Some(Duration::from_millis(50));
    s.check_status_interval = Duration::from_millis(50);
    let mk = |checks: Arc<AtomicU32>| {
        on_execute(|_c| async { Ok(CommandResult::running_after(Duration::from_millis(10))) }).on_check(
            move |_c, _s| {
                let n = checks.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n == 0 {
                        // The first check outlives its lease; the others keep polling meanwhile.
                        tokio::time::sleep(Duration::from_millis(1500)).await;
                        Ok(CommandResult::succeeded(json!("stale")))
                    } else {
                        Ok(CommandResult::running_after(Duration::from_millis(30)))
                    }
                }
            },
        )
    };
    let _a = CommandService::builder(store.clone(), &q)
        .settings(s.clone())
        .handler("t", mk(checks.clone()))
        .start()
        .await
        .unwrap();
    let _b = CommandService::builder(store.clone(), &q)
        .settings(s.clone())
        .handler("t", mk(checks.clone()))
        .start()
        .await
        .unwrap();
    store.submit(&q, Command::with_id("st-1", "t", json!(null))).await.unwrap();
    let st = store.wait("st-1", Duration::from_secs(15)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded, "{st:?}");
    assert_eq!(st.result, Some(json!("stale").into()));
    let ok = eventually(Duration::from_secs(3), || {
        let s = store.clone();
        let q = q.clone();
        async move { s.messages().stats(&q).await.ok().filter(|s| s.length == 0 && s.pending == 0 && s.delayed == 0) }
    })
    .await;
    assert!(ok.is_some(), "{:?}", store.messages().stats(&q).await);
    let after = checks.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(checks.load(Ordering::SeqCst), after, "no check after the terminal state");
    assert!(after >= 2, "the entry was taken over meanwhile ({after} checks)");
}
