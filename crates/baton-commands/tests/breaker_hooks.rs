//! Breaker tests for completion hooks: exactly one delivery message per terminal transition
//! when terminal writes race (a worker's settle on one store, cancels and bulk cancels and
//! re-runs on another, as two processes would), and when a terminal write's reply is lost and
//! the write is retried.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use baton_commands::{
    BulkAction, Command, CommandResult, CommandService, CommandStatus, CommandStore, CompletionHook, EventFrom,
    EventKind, ListQuery,
};
use baton_queue::{ConsumerOptions, Decision, Delivery};
use baton_testkit::{eventually, TestBackend};
use common::*;
use serde_json::{json, Value};
use tokio::sync::mpsc;

baton_testkit::on_every_backend!(
    racing_terminal_writes_enqueue_one_message_per_terminal_transition,
    handed_off_commands_ending_while_cancelled_elsewhere_enqueue_one_message_each,
);

/// CRC16/XMODEM mod 16384: the Cluster slot of a hash tag.
fn slot(tag: &str) -> u16 {
    let mut crc: u16 = 0;
    for &b in tag.as_bytes() {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc % 16384
}

/// 40 commands homed in a hooked queue are handed off to a queue in another slot, where
/// `check_status` ends them (succeeded or failed) after a short, varied time, while another
/// store cancels them: each command's terminal transitions (one, as the feed says) have exactly
/// one message on the home queue's delivery queue, none on the target's.
async fn handed_off_commands_ending_while_cancelled_elsewhere_enqueue_one_message_each(b: TestBackend) {
    let store = store_for(&b).await;
    let other = other_store(&b, &store).await;
    let home = queue_name("home");
    let target = (0..).map(|i| format!("{home}-t{i}")).find(|m| slot(m) != slot(&home)).unwrap();
    store.set_hook(&home, Some(CompletionHook::default())).unwrap();
    other.set_hook(&home, Some(CompletionHook::default())).unwrap();
    let h = CommandService::builder(store.clone(), home.as_str())
        .settings(fast())
        .handler(
            "go",
            on_execute(|c| async move { Ok(CommandResult::handed_off(c.params.get().trim_matches('"').to_string())) }),
        )
        .start()
        .await
        .unwrap();
    let t = CommandService::builder(store.clone(), target.as_str())
        .settings(QueueSettings { check_status_interval: Duration::from_millis(10), ..fast() })
        .handler(
            "go",
            on_execute(|_| async { Ok(CommandResult::failed("not here")) }).on_check(|c, _| async move {
                let n = c.id.len() as u64 + c.id.bytes().last().unwrap_or(0) as u64;
                tokio::time::sleep(Duration::from_millis(n % 5 * 2)).await;
                Ok(if n.is_multiple_of(2) {
                    CommandResult::succeeded(json!("checked"))
                } else {
                    CommandResult::failed("no")
                })
            }),
        )
        .start()
        .await
        .unwrap();
    let (consumer, mut rx) = collect(&store, &home).await;
    let ids: Vec<String> = (0..40).map(|i| format!("{home}-{i}")).collect();
    for id in &ids {
        store.submit(&home, Command::with_id(id.clone(), "go", json!(target))).await.unwrap();
    }
    for id in ids.iter().rev() {
        let _ = other.cancel(id).await;
    }
    for id in &ids {
        eventually(Duration::from_secs(15), || async {
            store.get(id).await.unwrap().filter(|s| s.status.is_terminal())
        })
        .await
        .unwrap_or_else(|| panic!("{id} did not end"));
    }
    let msgs = drain(&mut rx, Duration::from_millis(1500)).await;
    let mut per_id: BTreeMap<String, usize> = BTreeMap::new();
    for m in &msgs {
        let v: Value = serde_json::from_str(m).unwrap();
        *per_id.entry(v["id"].as_str().unwrap().to_string()).or_default() += 1;
    }
    let events = terminal_events(&store, &ids).await;
    for id in &ids {
        assert_eq!(events[id].len(), 1, "{id}: {:?}", events[id]);
        assert_eq!(per_id.get(id).copied().unwrap_or(0), 1, "{id}: one message");
    }
    assert_eq!(store.hooks().await.unwrap().stats(&target).await.unwrap().length, 0);
    consumer.close().await;
    h.close().await;
    t.close().await;
}

/// Every hook message of `queue` from now on, acked as read.
async fn collect(store: &CommandStore, queue: &str) -> (baton_queue::Consumer, mpsc::UnboundedReceiver<String>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let c = store
        .hooks()
        .await
        .unwrap()
        .consume(
            queue,
            move |d: Delivery| {
                let tx = tx.clone();
                async move {
                    let _ = tx.send(String::from_utf8(d.payload.to_vec()).unwrap());
                    Decision::Ack
                }
            },
            ConsumerOptions::new().with_claim_timeout(Duration::from_secs(2)),
        )
        .await
        .unwrap();
    (c, rx)
}

/// Drains `rx` until it has been quiet for `quiet`.
async fn drain(rx: &mut mpsc::UnboundedReceiver<String>, quiet: Duration) -> Vec<String> {
    let mut out = Vec::new();
    while let Ok(Some(m)) = tokio::time::timeout(quiet, rx.recv()).await {
        out.push(m);
    }
    out
}

/// The terminal events of each command in `ids` (from its event feed), as `(id, kind)` counts.
async fn terminal_events(store: &CommandStore, ids: &[String]) -> BTreeMap<String, Vec<EventKind>> {
    let mut out = BTreeMap::new();
    for id in ids {
        let ev = store.command_events(id, EventFrom::Start, 1000).await.unwrap().events;
        let kinds: Vec<EventKind> = ev
            .iter()
            .map(|e| e.event)
            .filter(|k| matches!(k, EventKind::Succeeded | EventKind::Failed | EventKind::Cancelled))
            .collect();
        out.insert(id.clone(), kinds);
    }
    out
}

/// 60 commands run by a worker on store A (they end by themselves after a short, varied time,
/// some failing), while store B cancels each one by one, a bulk cancel runs on A, and both
/// stores re-run the failed and cancelled ones a few rounds. Every terminal transition that
/// happened (one terminal event in the feed) has exactly one hook message, with a distinct
/// delivery id, and nothing else is enqueued.
async fn racing_terminal_writes_enqueue_one_message_per_terminal_transition(b: TestBackend) {
    let a = store_for(&b).await;
    let other = other_store(&b, &a).await;
    let q = queue_name("hook-race");
    a.set_hook(&q, Some(CompletionHook::default())).unwrap();
    other.set_hook(&q, Some(CompletionHook::default())).unwrap();
    let svc = CommandService::builder(a.clone(), &q)
        .settings(QueueSettings { concurrency: 16, ..fast() })
        .handler(
            "race",
            on_execute(|c: Command| async move {
                let n: u64 = c.params.get().parse().unwrap_or(0);
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(n % 7 * 3)) => {}
                    _ = c.cancelled() => {}
                }
                Ok(if n.is_multiple_of(3) { CommandResult::failed("no") } else { CommandResult::succeeded(json!(n)) })
            }),
        )
        .start()
        .await
        .unwrap();
    let (consumer, mut rx) = collect(&a, &q).await;
    let ids: Vec<String> = (0..60).map(|i| format!("{q}-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        a.submit(&q, Command::with_id(id.clone(), "race", json!(i))).await.unwrap();
    }
    for round in 0..3 {
        let cancels = {
            let (other, ids) = (other.clone(), ids.clone());
            tokio::spawn(async move {
                for id in ids.iter().rev() {
                    let _ = other.cancel(id).await;
                }
            })
        };
        let bulk = {
            let (a, q) = (a.clone(), q.clone());
            tokio::spawn(async move { a.bulk(&q, BulkAction::Cancel, ListQuery::default(), false, 0).await })
        };
        cancels.await.unwrap();
        bulk.await.unwrap().unwrap();
        // Every command terminal before the next round's re-runs.
        for id in &ids {
            eventually(Duration::from_secs(15), || async {
                a.get(id).await.unwrap().filter(|s| s.status.is_terminal())
            })
            .await
            .unwrap_or_else(|| panic!("round {round}: {id} did not end"));
        }
        if round < 2 {
            let rerun_a = {
                let (a, ids) = (a.clone(), ids.clone());
                tokio::spawn(async move {
                    for id in &ids {
                        let _ = a.retry(id).await;
                    }
                })
            };
            for id in ids.iter().rev() {
                let _ = other.retry(id).await;
            }
            rerun_a.await.unwrap();
        }
    }
    let msgs = drain(&mut rx, Duration::from_millis(1500)).await;
    let mut per_id: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut delivery_ids = BTreeSet::new();
    for m in &msgs {
        let v: Value = serde_json::from_str(m).unwrap();
        assert!(delivery_ids.insert(v["delivery_id"].as_str().unwrap().to_string()), "a duplicate: {m}");
        per_id.entry(v["id"].as_str().unwrap().to_string()).or_default().push(v["version"].as_u64().unwrap());
    }
    let events = terminal_events(&a, &ids).await;
    for id in &ids {
        let want = events[id].len();
        let got = per_id.get(id).map_or(0, |v| v.len());
        assert_eq!(got, want, "{id}: {want} terminal transitions (feed: {:?}), {got} hook messages", events[id]);
        let last = a.get(id).await.unwrap().unwrap();
        assert!(last.status.is_terminal());
        assert!(per_id[id].contains(&last.version), "{id}: the last end ({}) has its message", last.version);
    }
    assert_eq!(a.hooks().await.unwrap().stats(&q).await.unwrap().pending, 0);
    consumer.close().await;
    svc.close().await;
}

use baton_commands::QueueSettings;

/// Keeps Redis busy for `ms` (a script spinning on TIME), so requests sent meanwhile wait in
/// their sockets, unanswered.
async fn busy(conn: &mut baton_redis::RedisConn, ms: u64) {
    let spin = "local s = redis.call('TIME') \
        while true do local t = redis.call('TIME') \
        if (t[1] - s[1]) * 1000000 + (t[2] - s[2]) > tonumber(ARGV[1]) * 1000 then return 1 end end";
    let _: i64 = baton_redis::redis::cmd("EVAL").arg(spin).arg(0).arg(ms).query_async(conn).await.unwrap();
}

/// A handler's terminal write (SUCCEEDED), and a cancel's, reach Redis but their replies are
/// lost (the connection is cut while Redis is busy); the writers retry. Each command has
/// exactly one hook message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_of_a_terminal_write_enqueues_one_message() {
    use baton_commands::RedisCommandStoreOptions;
    use baton_redis::{RedisClient, RedisConfig};
    use baton_testkit::{RedisServer, TcpProxy};
    baton_testkit::require_redis();
    let server = RedisServer::start();
    let proxy = TcpProxy::start(format!("127.0.0.1:{}", server.port()).parse().unwrap()).await;
    let store = CommandStore::redis(
        RedisClient::new(RedisConfig::standalone(format!("redis://{}", proxy.addr()))).unwrap(),
        RedisCommandStoreOptions::default(),
    )
    .await
    .unwrap();
    let reader = CommandStore::redis(RedisClient::new(server.config()).unwrap(), RedisCommandStoreOptions::default())
        .await
        .unwrap();
    let direct = RedisClient::new(server.config()).unwrap().shared().await.unwrap();
    let q = queue_name("hook-lost");
    store.set_hook(&q, Some(CompletionHook::default())).unwrap();
    let go = Arc::new(tokio::sync::Notify::new());
    let called: Arc<std::sync::Mutex<BTreeSet<String>>> = Arc::default();
    let (g2, c2) = (go.clone(), called.clone());
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "gated",
            on_execute(move |c: Command| {
                let go = g2.clone();
                c2.lock().unwrap().insert(c.id.clone());
                async move {
                    if c.id.ends_with("-t") {
                        go.notified().await;
                    } else if c.id.ends_with("-c") {
                        c.cancelled().await;
                    }
                    Ok(CommandResult::succeeded(json!("done")))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let (consumer, mut rx) = collect(&reader, &q).await;
    // Scripts loaded.
    let warm = store.submit(&q, Command::with_id(format!("{q}-warm"), "gated", json!({}))).await.unwrap();
    assert_eq!(store.wait(&warm.id, Duration::from_secs(10)).await.unwrap().status, CommandStatus::Succeeded);
    let held = store.submit(&q, Command::with_id(format!("{q}-c"), "gated", json!({}))).await.unwrap();
    let st = store.submit(&q, Command::with_id(format!("{q}-t"), "gated", json!({}))).await.unwrap();
    eventually(Duration::from_secs(5), || async { (called.lock().unwrap().len() == 3).then_some(()) })
        .await
        .expect("both handlers run");
    let mut d = direct.clone();
    let hold = tokio::spawn(async move { busy(&mut d, 600).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    go.notify_one(); // the handler succeeds now; its write waits in Redis's socket buffer
    let cancel = {
        let store = store.clone();
        let id = held.id.clone();
        tokio::spawn(async move { store.cancel(&id).await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    proxy.drop_connections();
    hold.await.unwrap();
    // A caller whose cancel failed (its reply lost) cancels again, as an HTTP client would.
    let first_cancel = cancel.await.unwrap();
    if first_cancel.is_err() {
        let again = store.cancel(&held.id).await;
        assert!(
            matches!(&again, Ok(_) | Err(baton_commands::CommandError::AlreadyTerminal(_))),
            "the second cancel: {again:?} (the first: {first_cancel:?})"
        );
    }
    let done = eventually(Duration::from_secs(20), || async {
        reader.get(&st.id).await.ok().flatten().filter(|s| s.status.is_terminal())
    })
    .await
    .expect("the command ends");
    assert_eq!(done.status, CommandStatus::Succeeded);
    let c = eventually(Duration::from_secs(20), || async {
        reader.get(&held.id).await.ok().flatten().filter(|s| s.status.is_terminal())
    })
    .await
    .expect("the cancel lands");
    assert_eq!(c.status, CommandStatus::Cancelled);
    let msgs = drain(&mut rx, Duration::from_secs(2)).await;
    let mut ids: Vec<String> = msgs
        .iter()
        .map(|m| serde_json::from_str::<Value>(m).unwrap()["delivery_id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    let mut want = vec![
        format!("{}:{}", warm.id, reader.get(&warm.id).await.unwrap().unwrap().version),
        format!("{}:{}", c.id, c.version),
        format!("{}:{}", done.id, done.version),
    ];
    want.sort();
    assert_eq!(ids, want, "one message per terminal transition");
    consumer.close().await;
    svc.close().await;
}
