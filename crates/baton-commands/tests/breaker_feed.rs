//! Breaker tests for the feed / re-run / list-filter features.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_commands::{Command, CommandResult, CommandService, CommandStatus};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    a_cancel_of_a_rerun_reaches_its_handler_after_the_old_run_ends,
    control_a_cancel_of_a_rerun_reaches_its_handler_while_the_old_run_still_runs,
    a_rerun_of_a_handed_off_command_runs_at_home,
    filtered_listing_pages_through_everything_once_under_concurrent_writes,
    concurrent_reruns_and_cancels_one_wins_and_counts_agree
);

async fn a_cancel_of_a_rerun_reaches_its_handler_after_the_old_run_ends(b: TestBackend) {
    rerun_cancel(b, true).await
}

/// Control (passes): the same, with the old run still blocked when the re-run is cancelled; so
/// the failure above comes from the old run's end (its running-handler guard removing the
/// re-run's registration, keyed by id alone).
async fn control_a_cancel_of_a_rerun_reaches_its_handler_while_the_old_run_still_runs(b: TestBackend) {
    rerun_cancel(b, false).await
}

/// The first run ignores its cancel for a while (a handler that does not watch its token, or
/// blocks), the command is re-run meanwhile and the re-run's handler starts in the same process.
/// When the old run finally returns, the re-run's handler must still be cancellable: a cancel
/// of the re-run has to reach it.
async fn rerun_cancel(b: TestBackend, end_old_run_first: bool) {
    let store = store_for(&b).await;
    let q = queue_name("rerun-guard");
    let calls = Arc::new(AtomicU32::new(0));
    let release = Arc::new(tokio::sync::Notify::new());
    let old_done = Arc::new(AtomicBool::new(false));
    let rerun_signalled = Arc::new(AtomicBool::new(false));
    let (c2, r2, d2, s2) = (calls.clone(), release.clone(), old_done.clone(), rerun_signalled.clone());
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "stubborn",
            on_execute(move |c: Command| {
                let n = c2.fetch_add(1, Ordering::SeqCst);
                let (release, old_done, signalled) = (r2.clone(), d2.clone(), s2.clone());
                async move {
                    if n == 0 {
                        // Ignores its cancel until released.
                        release.notified().await;
                        old_done.store(true, Ordering::SeqCst);
                        Ok(CommandResult::succeeded(json!("late")))
                    } else {
                        match tokio::time::timeout(Duration::from_secs(8), c.cancelled()).await {
                            Ok(()) => {
                                signalled.store(true, Ordering::SeqCst);
                                Ok(CommandResult::cancelled())
                            }
                            Err(_) => Ok(CommandResult::failed("never signalled")),
                        }
                    }
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let st = store.submit(&q, Command::new("stubborn", json!({}))).await.unwrap();
    eventually(Duration::from_secs(5), || async { (calls.load(Ordering::SeqCst) == 1).then_some(()) })
        .await
        .expect("first run starts");
    store.cancel(&st.id).await.unwrap();
    store.retry(&st.id).await.unwrap();
    eventually(Duration::from_secs(5), || async { (calls.load(Ordering::SeqCst) == 2).then_some(()) })
        .await
        .expect("the re-run starts while the old run still runs");
    // The old run ends now (its outcome is refused: it was cancelled).
    if end_old_run_first {
        release.notify_one();
        eventually(Duration::from_secs(5), || async { old_done.load(Ordering::SeqCst).then_some(()) }).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Cancel the re-run: its handler must be signalled.
    let cancelled = store.cancel(&st.id).await.unwrap();
    assert_eq!(cancelled.status, CommandStatus::Cancelled);
    let got =
        eventually(Duration::from_secs(3), || async { rerun_signalled.load(Ordering::SeqCst).then_some(()) }).await;
    assert!(got.is_some(), "the re-run's handler was never signalled by the cancel of the re-run");
    release.notify_one();
    svc.close().await;
}

/// Keeps Redis busy for `ms` (a script spinning on TIME), so requests sent meanwhile wait in
/// their sockets, unanswered.
async fn busy(conn: &mut baton_redis::RedisConn, ms: u64) {
    let spin = "local s = redis.call('TIME') \
        while true do local t = redis.call('TIME') \
        if (t[1] - s[1]) * 1000000 + (t[2] - s[2]) > tonumber(ARGV[1]) * 1000 then return 1 end end";
    let _: i64 = baton_redis::redis::cmd("EVAL").arg(spin).arg(0).arg(ms).query_async(conn).await.unwrap();
}

/// A handler error's `retry_scheduled` write reaches Redis but its reply is lost (the connection
/// is cut while Redis is busy). The write is retried, finds its own write as a "conflict" with
/// the same status and token, and must recognise it: one handler error is one
/// `retry_scheduled` event and one attempt, not two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_of_a_retry_scheduled_write_is_applied_once() {
    use baton_commands::{CommandStore, EventFrom, EventKind, RedisCommandStoreOptions};
    use baton_redis::{RedisClient, RedisConfig};
    use baton_testkit::{RedisServer, TcpProxy};
    use std::collections::HashMap;
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
    let q = queue_name("lost-reply");
    let calls: Arc<std::sync::Mutex<HashMap<String, u32>>> = Arc::default();
    let go = Arc::new(tokio::sync::Notify::new());
    let (c2, g2) = (calls.clone(), go.clone());
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "once-failing",
            on_execute(move |c: Command| {
                let n = {
                    let mut m = c2.lock().unwrap();
                    let n = m.entry(c.id.clone()).or_insert(0);
                    *n += 1;
                    *n
                };
                let go = g2.clone();
                async move {
                    match (c.id.as_str(), n) {
                        ("warm", 1) => Err("warm-up error".into()),
                        ("t", 1) => {
                            go.notified().await;
                            Err("boom".into())
                        }
                        _ => Ok(CommandResult::succeeded(json!(n))),
                    }
                }
            }),
        )
        .start()
        .await
        .unwrap();
    // Every script loaded (the retry_scheduled write included).
    let warm = store.submit(&q, Command::with_id("warm", "once-failing", json!({}))).await.unwrap();
    assert_eq!(store.wait(&warm.id, Duration::from_secs(10)).await.unwrap().status, CommandStatus::Succeeded);

    let st = store.submit(&q, Command::with_id("t", "once-failing", json!({}))).await.unwrap();
    eventually(Duration::from_secs(5), || async { (calls.lock().unwrap().get("t") == Some(&1)).then_some(()) })
        .await
        .expect("the first call starts");
    let mut d = direct.clone();
    let hold = tokio::spawn(async move { busy(&mut d, 600).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    go.notify_one(); // the handler errs now; its write waits in Redis's socket buffer
    tokio::time::sleep(Duration::from_millis(150)).await;
    proxy.drop_connections();
    hold.await.unwrap();
    let done = eventually(Duration::from_secs(20), || async {
        reader.get(&st.id).await.ok().flatten().filter(|s| s.status.is_terminal())
    })
    .await
    .expect("the command ends");
    let events = reader.command_events(&st.id, EventFrom::Start, 100).await.unwrap().events;
    let kinds: Vec<EventKind> = events.iter().map(|e| e.event).collect();
    let n_calls = *calls.lock().unwrap().get("t").unwrap();
    assert_eq!(
        (done.status, done.attempts, n_calls, kinds),
        (CommandStatus::Succeeded, 2, 2, vec![EventKind::Submitted, EventKind::RetryScheduled, EventKind::Succeeded]),
        "one handler error, one retry_scheduled: {events:#?}"
    );
    svc.close().await;
}

/// A command handed off from its home queue to another, failed there, re-run: back at home,
/// `execute` runs again (and may succeed there); its events tell the whole story in order.
async fn a_rerun_of_a_handed_off_command_runs_at_home(b: TestBackend) {
    use baton_commands::{EventFrom, EventKind::*};
    let store = store_for(&b).await;
    let home = queue_name("home");
    let target = queue_name("target");
    let home_calls = Arc::new(AtomicU32::new(0));
    let target_calls = Arc::new(AtomicU32::new(0));
    let (h2, t2, to) = (home_calls.clone(), target_calls.clone(), target.clone());
    let away = CommandService::builder(store.clone(), &target)
        .settings(fast())
        .handler(
            "hop",
            on_execute(|_c| async { Ok(CommandResult::failed("execute must not run on the target")) }).on_check(
                move |_c, _s| {
                    t2.fetch_add(1, Ordering::SeqCst);
                    async { Ok(CommandResult::failed("failed away")) }
                },
            ),
        )
        .start()
        .await
        .unwrap();
    let at_home = CommandService::builder(store.clone(), &home)
        .settings(fast())
        .handler(
            "hop",
            on_execute(move |_c| {
                let n = h2.fetch_add(1, Ordering::SeqCst);
                let to = to.clone();
                async move {
                    if n == 0 {
                        Ok(CommandResult::handed_off(to))
                    } else {
                        Ok(CommandResult::succeeded(json!("home again")))
                    }
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let st = store.submit(&home, Command::new("hop", json!({}))).await.unwrap();
    let failed = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((failed.status, failed.error.as_deref()), (CommandStatus::Failed, Some("failed away")));
    let rerun = store.retry(&st.id).await.unwrap();
    assert_eq!(
        (rerun.status, rerun.queue.as_str(), rerun.handed_off_to.as_deref()),
        (CommandStatus::Submitted, home.as_str(), None)
    );
    let done = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(
        (
            done.status,
            done.result.as_ref().map(|r| r.get().to_string()),
            home_calls.load(Ordering::SeqCst),
            target_calls.load(Ordering::SeqCst)
        ),
        (CommandStatus::Succeeded, Some(r#""home again""#.to_string()), 2, 1)
    );
    let events = store.command_events(&st.id, EventFrom::Start, 100).await.unwrap();
    let kinds: Vec<_> = events.events.iter().map(|e| e.event).collect();
    assert_eq!(kinds, [Submitted, HandedOff, Failed, Rerun, Succeeded]);
    let versions: Vec<u64> = events.events.iter().map(|e| e.version).collect();
    assert!(versions.windows(2).all(|w| w[0] < w[1]), "{versions:?}");
    // Counts agree with the listing.
    let counts = store.counts(&home).await.unwrap();
    let listed = store.list(&home, Default::default()).await.unwrap().items;
    assert_eq!(
        (listed.len(), counts.submitted, counts.running, counts.succeeded, counts.failed, counts.cancelled),
        (1, 0, 0, 1, 0, 0)
    );
    at_home.close().await;
    away.close().await;
}

/// Filtered listing (type + id prefix, and a time window) in small pages, while commands are
/// created and cancelled: every command that matched before the listing began is listed exactly
/// once.
///
/// Each pass has its own churn: up to `CHURN` new matching commands and cancels of `CHURN` old
/// ones (a slice of its own), stopped when the pass ends. (One unbounded churn across all passes
/// piled up matching commands for as long as the listing ran, which every later unwindowed pass
/// had to page through: 41,449 in the last one, a minute or two, more the slower the machine.)
async fn filtered_listing_pages_through_everything_once_under_concurrent_writes(b: TestBackend) {
    use baton_commands::{ListQuery, Timestamp};
    use std::collections::HashSet;
    let store = store_for(&b).await;
    let q = queue_name("list");
    let before_all = Timestamp::now();
    let mut expected = HashSet::new();
    let mut all = Vec::new();
    for i in 0..400u32 {
        let (t, p) = (if i % 2 == 0 { "a" } else { "b" }, if i % 3 == 0 { "p" } else { "q" });
        let id = format!("{p}-{i:04}-{}", uuid::Uuid::now_v7().simple());
        store.submit(&q, Command::with_id(id.clone(), t, json!({}))).await.unwrap();
        if t == "a" && p == "p" {
            expected.insert(id.clone());
        }
        all.push(id);
    }
    tokio::time::sleep(Duration::from_millis(5)).await;
    let after_all = Timestamp::now();
    const CHURN: usize = 50;
    let mut pass = 0usize;
    for limit in [1usize, 3, 7, 50] {
        for windowed in [false, true] {
            let stop = Arc::new(AtomicBool::new(false));
            let churn = {
                let (store, q, stop, all) = (store.clone(), q.clone(), stop.clone(), all.clone());
                tokio::spawn(async move {
                    // 8 passes of 50: each cancels old commands no other pass cancels (7 is prime to 400).
                    for i in pass * CHURN..(pass + 1) * CHURN {
                        if stop.load(Ordering::SeqCst) {
                            break;
                        }
                        let id = format!("p-new-{i}-{}", uuid::Uuid::now_v7().simple());
                        store.submit(&q, Command::with_id(id, "a", json!({}))).await.unwrap();
                        let _ = store.cancel(&all[(i * 7) % all.len()]).await;
                    }
                })
            };
            pass += 1;
            let mut seen = Vec::new();
            let mut cursor = None;
            loop {
                let page = store
                    .list(
                        &q,
                        ListQuery {
                            limit,
                            cursor: cursor.clone(),
                            command_type: Some("a".into()),
                            id_prefix: Some("p-".into()),
                            created_after: windowed.then_some(before_all),
                            created_before: windowed.then_some(after_all),
                            ..Default::default()
                        },
                    )
                    .await
                    .unwrap();
                seen.extend(page.items.iter().map(|s| s.id.clone()));
                match page.next_cursor {
                    Some(c) => cursor = Some(c),
                    None => break,
                }
            }
            let uniq: HashSet<_> = seen.iter().cloned().collect();
            assert_eq!(uniq.len(), seen.len(), "duplicates with limit {limit}, windowed {windowed}");
            let old: HashSet<_> = uniq.iter().filter(|id| !id.starts_with("p-new-")).cloned().collect();
            assert_eq!(old, expected, "limit {limit}, windowed {windowed}");
            if windowed {
                assert_eq!(uniq.len(), expected.len(), "only the window's commands");
            }
            stop.store(true, Ordering::SeqCst);
            churn.await.unwrap();
        }
    }
}

/// The first report write of a long `execute` call (its `started` event) reaches Redis but its
/// reply is lost: the call must still show one `started` event, not one per attempt to write it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_of_a_started_write_appends_one_started_event() {
    use baton_commands::{CommandStore, EventFrom, EventKind, RedisCommandStoreOptions};
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
    let q = queue_name("lost-started");
    let started = Arc::new(std::sync::Mutex::new(None::<std::time::Instant>));
    let s2 = started.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "long",
            on_execute(move |c: Command| {
                let s2 = s2.clone();
                async move {
                    if c.id != "warm" {
                        *s2.lock().unwrap() = Some(std::time::Instant::now());
                    }
                    let ms = if c.id == "warm" { 1_300 } else { 4_000 };
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    Ok(CommandResult::succeeded(json!(1)))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    // Scripts loaded (a started write included).
    let warm = store.submit(&q, Command::with_id("warm", "long", json!({}))).await.unwrap();
    assert_eq!(store.wait(&warm.id, Duration::from_secs(10)).await.unwrap().status, CommandStatus::Succeeded);
    let st = store.submit(&q, Command::with_id("t", "long", json!({}))).await.unwrap();
    let t0 = eventually(Duration::from_secs(5), || async { *started.lock().unwrap() }).await.unwrap();
    // Redis busy from 0.8 s to 1.4 s into the call; the started write (at 1 s) waits; cut at 1.15 s.
    tokio::time::sleep((t0 + Duration::from_millis(800)).saturating_duration_since(std::time::Instant::now())).await;
    let mut d = direct.clone();
    let hold = tokio::spawn(async move { busy(&mut d, 600).await });
    tokio::time::sleep((t0 + Duration::from_millis(1150)).saturating_duration_since(std::time::Instant::now())).await;
    proxy.drop_connections();
    hold.await.unwrap();
    let done = eventually(Duration::from_secs(20), || async {
        reader.get(&st.id).await.ok().flatten().filter(|s| s.status.is_terminal())
    })
    .await
    .expect("the command ends");
    let events = reader.command_events(&st.id, EventFrom::Start, 100).await.unwrap().events;
    let kinds: Vec<EventKind> = events.iter().map(|e| e.event).collect();
    assert_eq!(
        (done.status, kinds),
        (CommandStatus::Succeeded, vec![EventKind::Submitted, EventKind::Started, EventKind::Succeeded]),
        "one call, one started event"
    );
    svc.close().await;
}

/// Concurrent re-runs (two stores) of each of many FAILED/CANCELLED commands, racing cancels:
/// exactly one re-run wins per command, one `rerun` event each, and the counts equal the listing.
async fn concurrent_reruns_and_cancels_one_wins_and_counts_agree(b: TestBackend) {
    use baton_commands::{CommandError, EventFrom, EventKind, ListQuery};
    let store = store_for(&b).await;
    let other = other_store(&b, &store).await;
    let q = queue_name("rerun-race");
    let mut ids = Vec::new();
    for _ in 0..30 {
        let st = store.submit(&q, Command::new("none", json!({}))).await.unwrap();
        store.cancel(&st.id).await.unwrap();
        ids.push(st.id);
    }
    for id in &ids {
        let mut tasks = Vec::new();
        for i in 0..6 {
            let (s, id) = (if i % 2 == 0 { store.clone() } else { other.clone() }, id.clone());
            tasks.push(tokio::spawn(async move { s.retry(&id).await.map(|_| ()) }));
        }
        let (s, id2) = (other.clone(), id.clone());
        let cancel = tokio::spawn(async move { s.cancel(&id2).await.map(|_| ()) });
        let mut wins = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(()) => wins += 1,
                Err(CommandError::NotRetryable(_)) => {}
                Err(e) => panic!("{e:?}"),
            }
        }
        let _ = cancel.await.unwrap();
        assert!(wins == 1 || wins == 2, "{id}: {wins} wins");
        let events = store.command_events(id, EventFrom::Start, 100).await.unwrap().events;
        let reruns = events.iter().filter(|e| e.event == EventKind::Rerun).count();
        assert_eq!(reruns, wins, "{id}");
        let versions: Vec<u64> = events.iter().map(|e| e.version).collect();
        assert!(versions.windows(2).all(|w| w[1] == w[0] + 1), "{id}: {versions:?}");
    }
    let c = store.counts(&q).await.unwrap();
    let listed = store.list(&q, ListQuery { limit: 1000, ..Default::default() }).await.unwrap().items;
    let count = |s: CommandStatus| listed.iter().filter(|x| x.status == s).count() as u64;
    assert_eq!(
        (c.submitted, c.running, c.succeeded, c.failed, c.cancelled),
        (
            count(CommandStatus::Submitted),
            count(CommandStatus::Running),
            count(CommandStatus::Succeeded),
            count(CommandStatus::Failed),
            count(CommandStatus::Cancelled)
        )
    );
    assert_eq!(listed.len(), 30);
}
