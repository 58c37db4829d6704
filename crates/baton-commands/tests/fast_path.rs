//! The hot path's shortcuts keep their guarantees (every backend):
//! * a terminal write acks its queue message in the same atomic step (Redis): once a waiter sees
//!   the terminal state, nothing is pending any more;
//! * only terminal writes are announced on the queue's channel, tagged with their origin, and a
//!   command going SUBMITTED → RUNNING → SUCCEEDED is announced exactly once;
//! * submits prune the indexes of expired states every few calls (Redis), so the indexes stay
//!   bounded even when nobody lists or counts;
//! * state reads started together are one `MGET` per home queue (Redis), each caller still
//!   getting its own command's state;
//! * submits started together are group-committed per home queue (Redis: few script calls), each
//!   decided as alone: of equal submits of one id one stores it and the others find it; a
//!   different body conflicts; the same id on another queue conflicts;
//! * transitions started together are group-committed per home queue (Redis: few script calls),
//!   each decided exactly as alone: of two racing cancels one wins, the other is refused; indexes,
//!   acks and announcements (one message per batch, read by another process) stay exact;
//! * a transition that names the consumer which must own its delivery (a remote worker's
//!   settle) writes nothing when another consumer owns it or nothing does (`transition.lua` and
//!   `transitions.lua`), and writes (and acks) when it does.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_commands::{Command, CommandResult, CommandService, CommandStatus};
use baton_redis::redis;
use baton_testkit::TestBackend;
use common::*;
use futures::StreamExt;
use serde_json::json;

baton_testkit::on_every_backend!(
    terminal_write_acks_atomically,
    only_terminal_writes_are_announced,
    submits_prune_expired_index_entries,
    concurrent_reads_are_batched_per_queue,
    concurrent_transitions_are_group_committed,
    concurrent_submits_are_group_committed,
    two_transitions_of_one_command_in_one_batch,
    owner_checked_transitions
);

/// Both transition scripts with an owner check: `{'lost'}` and nothing written (state, indexes,
/// the pending entry) unless the named consumer owns the delivery, of the fence given (if one
/// is); with it, written and acked, and the entry's fence removed.
async fn owner_checked_transitions(b: TestBackend) {
    let Some(config) = b.redis_config() else { return }; // Redis scripts
    let mut conn = baton_redis::RedisClient::new(config).unwrap().shared().await.unwrap();
    let one = redis::Script::new(
        &[include_str!("../scripts/lib.lua"), baton_queue::keys::CAPS_LUA, include_str!("../scripts/transition.lua")]
            .concat(),
    );
    let many = redis::Script::new(
        &[include_str!("../scripts/lib.lua"), baton_queue::keys::CAPS_LUA, include_str!("../scripts/transitions.lua")]
            .concat(),
    );
    let q = queue_name("owned");
    let base = format!("t:cmd:{{{q}}}");
    let idx = |s: &str| format!("{base}:s:{s}");
    let stream = format!("t:q:{{{q}}}");
    let hooks = format!("t:hook:q:{{{q}}}");
    let sha = "0".repeat(40);
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg("g")
        .arg("0")
        .arg("MKSTREAM")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut entries = Vec::new();
    for (i, id) in ["A", "B", "C", "D"].iter().enumerate() {
        let state = format!("{base}:id:{id}");
        let _: () = redis::cmd("SET")
            .arg(&state)
            .arg(format!("1 SUBMITTED 1000 {sha} {{}}"))
            .query_async(&mut conn)
            .await
            .unwrap();
        let _: () = redis::cmd("ZADD").arg(idx("SUBMITTED")).arg(1000).arg(*id).query_async(&mut conn).await.unwrap();
        let e: String = redis::cmd("XADD").arg(&stream).arg("*").arg("p").arg(i).query_async(&mut conn).await.unwrap();
        entries.push(e);
    }
    // w1 reads A, B and C; D stays unread (not pending).
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("g")
        .arg("w1")
        .arg("COUNT")
        .arg(3)
        .arg("STREAMS")
        .arg(&stream)
        .arg(">")
        .query_async(&mut conn)
        .await
        .unwrap();
    let succeeded = format!("2 SUCCEEDED 1000 {sha} {{}}");
    // A and C were delivered again by reclaims (fences 1 and 2).
    let fences = format!("t:q:{{{q}}}:fences");
    // The queue's concurrency-cap keys (both scripts free an acked entry's slots).
    let caps = baton_queue::keys::caps("t", &q);
    let _: () = redis::cmd("HSET")
        .arg(&fences)
        .arg(&entries[0])
        .arg(1)
        .arg(&entries[2])
        .arg(2)
        .query_async(&mut conn)
        .await
        .unwrap();
    // transition.lua: A checked for w2 (w1 owns it): lost; for w1's first delivery (fence 0, an
    // earlier one): lost; for w1's latest: written and acked.
    for (owner, fence, want) in [("w2", "1", "lost"), ("w1", "0", "lost"), ("w1", "1", "ok")] {
        let mut inv = one.prepare_invoke();
        inv.key(format!("{base}:exp"))
            .key(idx("SUBMITTED"))
            .key(idx("SUCCEEDED"))
            .key(format!("{base}:id:A"))
            .key(format!("{base}:feed"))
            .key(&hooks)
            .key(format!("{base}:minutes"))
            .key(&stream)
            .key(&fences);
        for k in &caps {
            inv.key(k);
        }
        inv.arg("1 SUBMITTED ")
            .arg(&succeeded)
            .arg(60_000)
            .arg(format!("{base}:events"))
            .arg("A")
            .arg("")
            .arg(&entries[0])
            .arg("g")
            .arg("")
            .arg(owner)
            .arg("1")
            .arg(fence)
            .arg("event-A")
            .arg(100)
            .arg("")
            .arg("hook-A")
            .arg("")
            .arg("");
        let reply: Vec<redis::Value> = inv.invoke_async(&mut conn).await.unwrap();
        assert_eq!(reply.first(), Some(&redis::Value::BulkString(want.as_bytes().to_vec())), "A for {owner} {fence}");
    }
    // transitions.lua: B for w2 (lost), C for w1 (ok, acked; of fence 2, the latest), D for w1
    // (not pending: lost).
    let mut inv = many.prepare_invoke();
    inv.key(format!("{base}:exp"));
    for s in ["SUBMITTED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"] {
        inv.key(idx(s));
    }
    inv.key(&stream).key(&fences).key(format!("{base}:feed")).key(&hooks).key(format!("{base}:minutes"));
    for id in ["B", "C", "D"] {
        inv.key(format!("{base}:id:{id}"));
    }
    for k in &caps {
        inv.key(k);
    }
    inv.arg(3).arg(format!("{base}:events")).arg("g");
    for (n, (id, owner, fence)) in [("B", "w2", ""), ("C", "w1", "2"), ("D", "w1", "")].into_iter().enumerate() {
        inv.arg("1 SUBMITTED ")
            .arg(&succeeded)
            .arg(60_000)
            .arg(id)
            .arg(2)
            .arg(4)
            .arg(&entries[n + 1])
            .arg("")
            .arg(owner)
            .arg("1")
            .arg(fence)
            .arg(format!("event-{id}"))
            .arg(100)
            .arg(format!("hook-{id}"))
            .arg("")
            .arg("");
    }
    let replies: Vec<Vec<redis::Value>> = inv.invoke_async(&mut conn).await.unwrap();
    let heads: Vec<String> = replies
        .iter()
        .map(|r| match &r[0] {
            redis::Value::BulkString(b) => String::from_utf8(b.clone()).unwrap(),
            v => format!("{v:?}"),
        })
        .collect();
    assert_eq!(heads, ["lost", "ok", "lost"]);
    for (id, want) in [("A", "2 SUCCEEDED"), ("B", "1 SUBMITTED"), ("C", "2 SUCCEEDED"), ("D", "1 SUBMITTED")] {
        let stored: String = redis::cmd("GET").arg(format!("{base}:id:{id}")).query_async(&mut conn).await.unwrap();
        assert!(stored.starts_with(want), "{id}: {stored}");
    }
    for (s, n) in [("SUBMITTED", 2), ("SUCCEEDED", 2)] {
        let card: u64 = redis::cmd("ZCARD").arg(idx(s)).query_async(&mut conn).await.unwrap();
        assert_eq!(card, n, "{s} index");
    }
    // A and C acked; B still pending for w1.
    let pending: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg(&stream).arg("g").arg("-").arg("+").arg(10).query_async(&mut conn).await.unwrap();
    assert_eq!(
        pending.iter().map(|p| (p.0.clone(), p.1.clone())).collect::<Vec<_>>(),
        [(entries[1].clone(), "w1".to_string())]
    );
    let left: u64 = redis::cmd("HLEN").arg(&fences).query_async(&mut conn).await.unwrap();
    assert_eq!(left, 0, "the acked entries' fences are removed");
    // Only the writes that happened appended their events (A once of three tries, then C).
    let feed: Vec<(String, Vec<String>)> =
        redis::cmd("XRANGE").arg(format!("{base}:feed")).arg("-").arg("+").query_async(&mut conn).await.unwrap();
    let appended: Vec<Vec<String>> = feed.into_iter().map(|(_, f)| f).collect();
    assert_eq!(appended, [["i", "A", "e", "event-A"], ["i", "C", "e", "event-C"]]);
    // And only they enqueued their completion hook deliveries.
    let hooked: Vec<(String, Vec<String>)> =
        redis::cmd("XRANGE").arg(&hooks).arg("-").arg("+").query_async(&mut conn).await.unwrap();
    let hooked: Vec<Vec<String>> = hooked.into_iter().map(|(_, f)| f).collect();
    assert_eq!(hooked, [["p", "hook-A"], ["p", "hook-C"]]);
}

/// `transitions.lua` given two successive transitions of one command in one call (SUBMITTED →
/// RUNNING → SUCCEEDED): the state ends SUCCEEDED and the command is in the SUCCEEDED index
/// only, as with two separate calls. (Callers cannot build the second before the first is
/// committed today; the script must not depend on that.)
async fn two_transitions_of_one_command_in_one_batch(b: TestBackend) {
    let Some(config) = b.redis_config() else { return }; // a Redis script
    let mut conn = baton_redis::RedisClient::new(config).unwrap().shared().await.unwrap();
    let script = redis::Script::new(
        &[include_str!("../scripts/lib.lua"), baton_queue::keys::CAPS_LUA, include_str!("../scripts/transitions.lua")]
            .concat(),
    );
    let q = queue_name("twice");
    let base = format!("t:cmd:{{{q}}}");
    let idx = |s: &str| format!("{base}:s:{s}");
    let state = format!("{base}:id:X");
    let sha = "0".repeat(40);
    let _: () =
        redis::cmd("SET").arg(&state).arg(format!("1 SUBMITTED 1000 {sha} {{}}")).query_async(&mut conn).await.unwrap();
    let _: () = redis::cmd("ZADD").arg(idx("SUBMITTED")).arg(1000).arg("X").query_async(&mut conn).await.unwrap();
    let mut inv = script.prepare_invoke();
    inv.key(format!("{base}:exp"));
    for s in ["SUBMITTED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"] {
        inv.key(idx(s));
    }
    inv.key(format!("t:q:{{{q}}}"))
        .key(format!("t:q:{{{q}}}:fences"))
        .key(format!("{base}:feed"))
        .key(format!("t:hook:q:{{{q}}}"))
        .key(format!("{base}:minutes"))
        .key(&state)
        .key(&state);
    inv.arg(2).arg(format!("{base}:events")).arg("g");
    inv.arg("1 SUBMITTED ")
        .arg(format!("2 RUNNING 1000 {sha} {{}}"))
        .arg(60_000)
        .arg("X")
        .arg(2)
        .arg(3)
        .arg("")
        .arg("")
        .arg("")
        .arg("")
        .arg("")
        .arg("")
        .arg("")
        .arg("")
        .arg("")
        .arg("");
    inv.arg("2 RUNNING ")
        .arg(format!("3 SUCCEEDED 1000 {sha} {{}}"))
        .arg(60_000)
        .arg("X")
        .arg(3)
        .arg(4)
        .arg("")
        .arg("X SUCCEEDED 3 o")
        .arg("")
        .arg("")
        .arg("")
        .arg("")
        .arg("")
        .arg("")
        .arg("")
        .arg("");
    let replies: Vec<Vec<redis::Value>> = inv.invoke_async(&mut conn).await.unwrap();
    assert_eq!(replies.len(), 2);
    let stored: String = redis::cmd("GET").arg(&state).query_async(&mut conn).await.unwrap();
    assert!(stored.starts_with("3 SUCCEEDED "), "{stored}");
    for (s, n) in [("SUBMITTED", 0), ("RUNNING", 0), ("SUCCEEDED", 1)] {
        let card: u64 = redis::cmd("ZCARD").arg(idx(s)).query_async(&mut conn).await.unwrap();
        assert_eq!(card, n, "{s} index");
    }
}

async fn concurrent_submits_are_group_committed(b: TestBackend) {
    let store = store_for(&b).await;
    let (qa, qb) = (queue_name("sub-a"), queue_name("sub-b"));
    let tag = queue_name("s");
    let standalone = standalone_conn(&b).await;
    // 60 distinct commands on two queues, started together: all stored, each once.
    let before = calls(&standalone, "evalsha").await;
    let subs = (0..60).map(|i| {
        let q = if i % 2 == 0 { &qa } else { &qb };
        store.submit_created(q, Command::with_id(format!("{tag}-{i}"), "t", json!(i)))
    });
    for (i, r) in futures::future::join_all(subs).await.into_iter().enumerate() {
        let (st, created) = r.unwrap();
        assert_eq!(
            (st.id, st.params, st.status, created),
            (format!("{tag}-{i}"), json!(i).into(), CommandStatus::Submitted, true)
        );
    }
    let after = calls(&standalone, "evalsha").await;
    if let (Some(before), Some(after)) = (before, after) {
        assert!(after - before <= 30, "{} script calls for 60 submits to 2 queues", after - before);
    }
    for q in [&qa, &qb] {
        assert_eq!(store.counts(q).await.unwrap().submitted, 30);
        assert_eq!(store.messages().stats(q).await.unwrap().length, 30);
    }
    // The same id, started together: 5 equal submits to queue C (with 2 of another body) and 2
    // equal ones to queue A. The queues race: the first to store the id owns it; there, one
    // submit stores it, the other equal ones find it and another body conflicts; every submit
    // to the other queue conflicts. One message is enqueued, on the owner's queue.
    let id = format!("{tag}-dup");
    let same = || Command::with_id(id.clone(), "t", json!({"v": 1}));
    let other = || Command::with_id(id.clone(), "t", json!({"v": 2}));
    let qc = queue_name("sub-c");
    let calls = vec![
        store.submit_created(&qc, same()),
        store.submit_created(&qc, other()),
        store.submit_created(&qc, same()),
        store.submit_created(&qa, same()),
        store.submit_created(&qc, same()),
        store.submit_created(&qc, other()),
        store.submit_created(&qa, same()),
        store.submit_created(&qc, same()),
    ];
    let results = futures::future::join_all(calls).await;
    let created = results.iter().filter(|r| matches!(r, Ok((_, true)))).count();
    let found = results.iter().filter(|r| matches!(r, Ok((_, false)))).count();
    let conflicts = results.iter().filter(|r| matches!(r, Err(baton_commands::CommandError::Conflict { .. }))).count();
    let stored = store.get(&id).await.unwrap().unwrap();
    assert_eq!(stored.params, json!({"v": 1}));
    let (owner, loser, expected) = if stored.queue == qc { (&qc, &qa, (1, 3, 4)) } else { (&qa, &qc, (1, 1, 6)) };
    assert_eq!((created, found, conflicts), expected, "owner {owner}: {results:?}");
    assert_eq!(store.messages().stats(owner).await.unwrap().length, if owner == &qa { 31 } else { 1 });
    assert_eq!(store.messages().stats(loser).await.unwrap().length, if loser == &qa { 30 } else { 0 });
}

async fn concurrent_reads_are_batched_per_queue(b: TestBackend) {
    let store = store_for(&b).await;
    let (qa, qb) = (queue_name("batch-a"), queue_name("batch-b"));
    let mut ids = Vec::new();
    for i in 0..40 {
        let q = if i % 2 == 0 { &qa } else { &qb };
        ids.push((store.submit(q, Command::with_id(format!("rb-{i}"), "t", json!(i))).await.unwrap().id, i));
    }
    let standalone = standalone_conn(&b).await;
    if let Some(conn) = &standalone {
        let _: () = redis::cmd("CONFIG").arg("RESETSTAT").query_async(&mut conn.clone()).await.unwrap();
    }
    // 40 reads started in one turn (the ids are cached: no lookup reads), on a current-thread
    // runtime of their own: there the batcher's flush task runs only once every read is queued,
    // as on a busy worker. (On the test's two-worker runtime an idle second worker may run the
    // flush between two reads: under load that gave up to one MGET per read.)
    let (reader, to_read) = (store.clone(), ids.clone());
    let states = tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(futures::future::join_all(to_read.iter().map(|(id, _)| reader.get(id))))
    })
    .await
    .unwrap();
    for ((id, i), st) in ids.iter().zip(states) {
        let st = st.unwrap().expect("stored");
        assert_eq!((&st.id, &st.params), (id, &json!(i).into()));
    }
    if standalone.is_some() {
        let (gets, mgets) =
            (calls(&standalone, "get").await.unwrap_or(0), calls(&standalone, "mget").await.unwrap_or(0));
        // One MGET per queue when all 40 land in one batch; never a GET per read.
        assert_eq!(gets, 0, "state reads went one by one");
        assert_eq!(mgets, 2, "MGETs for 40 reads of 2 queues");
    }
    assert_eq!(store.get("rb-missing").await.unwrap(), None);
}

async fn concurrent_transitions_are_group_committed(b: TestBackend) {
    let store = store_for(&b).await;
    let other = other_store(&b, &store).await;
    let (qa, qb) = (queue_name("commit-a"), queue_name("commit-b"));
    let n = 60;
    let mut ids = Vec::new();
    for i in 0..n {
        let q = if i % 2 == 0 { &qa } else { &qb };
        ids.push(
            store.submit(q, Command::with_id(format!("gc-{i}-{}", queue_name("x")), "t", json!(i))).await.unwrap().id,
        );
    }
    // Another process waits for every command (it learns of them from the batch announcements).
    let waits: Vec<_> = ids
        .iter()
        .map(|id| {
            let (other, id) = (other.clone(), id.clone());
            async move { other.wait(&id, Duration::from_secs(10)).await }
        })
        .collect();
    let waits = tokio::spawn(futures::future::join_all(waits));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let standalone = standalone_conn(&b).await;
    let before = calls(&standalone, "evalsha").await;
    // Two cancels per command, all started together.
    let cancels = ids.iter().flat_map(|id| [store.cancel(id), store.cancel(id)]);
    let results = futures::future::join_all(cancels).await;
    let after = calls(&standalone, "evalsha").await;
    for (pair, id) in results.chunks(2).zip(&ids) {
        let won: Vec<_> = pair.iter().filter(|r| r.is_ok()).collect();
        assert_eq!(won.len(), 1, "{id}: exactly one cancel wins: {pair:?}");
        let st = won[0].as_ref().unwrap();
        assert_eq!((st.status, st.version), (CommandStatus::Cancelled, 2), "{id}");
        let lost = pair.iter().find(|r| r.is_err()).unwrap();
        assert!(
            matches!(lost, Err(baton_commands::CommandError::AlreadyTerminal(s)) if s.status == CommandStatus::Cancelled),
            "{id}: the other cancel is refused with the winner's state: {lost:?}"
        );
    }
    if let (Some(before), Some(after)) = (before, after) {
        // 60 winning writes (and 60 refused ones, which may re-read and retry) in a few calls.
        assert!(after - before <= 60, "{} script calls for 120 cancels of 60 commands", after - before);
    }
    for st in waits.await.unwrap() {
        assert_eq!(st.unwrap().status, CommandStatus::Cancelled);
    }
    for q in [&qa, &qb] {
        let c = store.counts(q).await.unwrap();
        assert_eq!((c.submitted, c.running, c.cancelled), (0, 0, n as u64 / 2), "{q}: {c:?}");
    }
    // Group-committed terminal writes ack their deliveries: 40 no-op commands, 16 at a time.
    let q = queue_name("commit-ack");
    let mut settings = fast();
    settings.concurrency = 16;
    let svc = CommandService::builder(store.clone(), &q)
        .settings(settings)
        .handler("noop", on_execute(|_c| async { Ok(CommandResult::succeeded(json!(null))) }))
        .start()
        .await
        .unwrap();
    let subs = (0..40).map(|_| store.submit_and_wait(&q, Command::new("noop", json!({})), Duration::from_secs(10)));
    for st in futures::future::join_all(subs).await {
        assert_eq!(st.unwrap().status, CommandStatus::Succeeded);
    }
    if b.redis_config().is_some() {
        let stats = store.messages().stats(&q).await.unwrap();
        assert_eq!((stats.length, stats.pending), (0, 0), "{stats:?}");
    }
    assert_eq!(store.counts(&q).await.unwrap().succeeded, 40);
    svc.close().await;
}

async fn submits_prune_expired_index_entries(b: TestBackend) {
    let Some(config) = b.redis_config() else { return }; // memory has no index keys
    let settings = baton_commands::CommandStoreSettings {
        state_ttl: Duration::from_secs(60),
        retention: Duration::from_secs(1),
        ..Default::default()
    };
    let store = store_with(&b, settings).await;
    let q = queue_name("prune");
    for i in 0..5 {
        store.submit(&q, Command::with_id(format!("old-{i}"), "t", json!(i))).await.unwrap();
        store.cancel(&format!("old-{i}")).await.unwrap();
    }
    let conn = baton_redis::RedisClient::new(config).unwrap().shared().await.unwrap();
    let zcard = |key: String| {
        let mut conn = conn.clone();
        async move { redis::cmd("ZCARD").arg(key).query_async::<u64>(&mut conn).await.unwrap() }
    };
    let cancelled = format!("baton:cmd:{{{q}}}:s:CANCELLED");
    let exp = format!("baton:cmd:{{{q}}}:exp");
    assert_eq!((zcard(cancelled.clone()).await, zcard(exp.clone()).await), (5, 5));
    tokio::time::sleep(Duration::from_millis(1300)).await; // retention passes; the states expire
                                                           // One store prunes on every 64th submit (its first included): 64 submits prune once.
    for i in 0..64 {
        store.submit(&q, Command::with_id(format!("new-{i}"), "t", json!(i))).await.unwrap();
    }
    assert_eq!(zcard(cancelled).await, 0);
    assert_eq!(zcard(exp).await, 64);
    assert_eq!(zcard(format!("baton:cmd:{{{q}}}:s:SUBMITTED")).await, 64);
}

async fn terminal_write_acks_atomically(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("fastack");
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler("noop", on_execute(|_c| async { Ok(CommandResult::succeeded(json!(null))) }))
        .start()
        .await
        .unwrap();
    for _ in 0..30 {
        let id = svc.submit(Command::new("noop", json!({}))).await.unwrap().id;
        let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
        assert_eq!(st.status, CommandStatus::Succeeded);
        let stats = store.messages().stats(&q).await.unwrap();
        if b.redis_config().is_some() {
            // The same script wrote SUCCEEDED and acked: no window with the message pending.
            assert_eq!((stats.length, stats.pending), (0, 0), "{stats:?}");
        } else {
            // Memory acks right after the write, without a round trip.
            let s2 = store.clone();
            let q2 = q.clone();
            eventually(Duration::from_secs(2), || {
                let (s2, q2) = (s2.clone(), q2.clone());
                async move { s2.messages().stats(&q2).await.ok().filter(|s| s.length == 0 && s.pending == 0) }
            })
            .await
            .expect("acked");
        }
    }
    svc.close().await;
}

async fn only_terminal_writes_are_announced(b: TestBackend) {
    let url = match b.redis_config() {
        None => return, // memory has no channel
        Some(cfg) => cfg.urls()[0].clone(),
    };
    let store = store_for(&b).await;
    let q = queue_name("announce");
    let mut ps = redis::Client::open(url.as_str()).unwrap().get_async_pubsub().await.unwrap();
    ps.subscribe(format!("baton:cmd:{{{q}}}:events")).await.unwrap();
    let got: Arc<Mutex<Vec<String>>> = Arc::default();
    let g2 = got.clone();
    let reader = tokio::spawn(async move {
        let mut s = ps.on_message();
        while let Some(m) = s.next().await {
            g2.lock().unwrap().push(String::from_utf8_lossy(m.get_payload_bytes()).into_owned());
        }
    });
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "slow",
            on_execute(|_c| async { Ok(CommandResult::running_after(Duration::from_millis(50))) })
                .on_check(|_c, _s| async { Ok(CommandResult::succeeded(json!("done"))) }),
        )
        .start()
        .await
        .unwrap();
    let id = svc.submit(Command::new("slow", json!({}))).await.unwrap().id;
    let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((st.status, st.version), (CommandStatus::Succeeded, 3), "SUBMITTED → RUNNING → SUCCEEDED");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let msgs = got.lock().unwrap().clone();
    assert_eq!(msgs.len(), 1, "one announcement, for the terminal write only: {msgs:?}");
    let parts: Vec<&str> = msgs[0].split(' ').collect();
    assert_eq!(parts.len(), 4, "<id> <STATUS> <version> <origin>: {msgs:?}");
    assert_eq!((parts[0], parts[1], parts[2]), (id.as_str(), "SUCCEEDED", "3"));
    assert!(!parts[3].is_empty());
    reader.abort();
    svc.close().await;
}

/// A connection to the backend's server when it is Redis standalone (one node's statistics).
async fn standalone_conn(b: &TestBackend) -> Option<baton_redis::RedisConn> {
    match b.redis_config() {
        Some(cfg) if b.name() == "standalone" => {
            Some(baton_redis::RedisClient::new(cfg).unwrap().shared().await.unwrap())
        }
        _ => None,
    }
}

/// Calls of Redis command `name` so far (`INFO commandstats`; 0 if never called), or `None`
/// without a connection.
async fn calls(conn: &Option<baton_redis::RedisConn>, name: &str) -> Option<u64> {
    let mut conn = conn.clone()?;
    let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap();
    Some(
        info.lines()
            .find(|l| l.starts_with(&format!("cmdstat_{name}:")))
            .and_then(|l| l.split("calls=").nth(1)?.split(',').next()?.parse().ok())
            .unwrap_or(0),
    )
}
