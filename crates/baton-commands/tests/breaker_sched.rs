//! Breaker: a reschedule to an earlier time, with the queue's default settings (the consumer
//! asleep until the due time it learnt), starts the command within one reclaim poll of its new
//! due time (the poll is where a consumer learns a due time another write set: 1 s by default),
//! not at the old due time.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use baton_commands::{Command, CommandResult, CommandService, CommandStore, QueueSettings};
use baton_testkit::{RedisServer, TestBackend};
use common::*;
use serde_json::json;

async fn earlier_reschedule_runs_on_time(b: TestBackend, other: bool) {
    let store: CommandStore = store_for(&b).await;
    let q = queue_name("brk");
    let runs: Arc<Mutex<Vec<SystemTime>>> = Arc::default();
    let r = runs.clone();
    let _svc = CommandService::builder(store.clone(), &q)
        .settings(QueueSettings::default())
        .handler(
            "job",
            on_execute(move |_c: Command| {
                let r = r.clone();
                async move {
                    r.lock().unwrap().push(SystemTime::now());
                    Ok(CommandResult::succeeded(json!("done")))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let a = store.submit(&q, Command::new("job", json!(1)).with_delay(Duration::from_secs(3600))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await; // the consumer learns the 1 h due time
    let at = SystemTime::now() + Duration::from_millis(300);
    // `other`: by another process's store (no local hint to this process's consumer).
    let by = if other { store_for(&b).await } else { store.clone() };
    by.reschedule(&a.id, at).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while runs.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let got = runs.lock().unwrap().clone();
    assert_eq!(got.len(), 1, "{}: not run within 15 s of its new due time", b.name());
    // The consumer polls 1 s after it started, about 400 ms after `at`; what the bound allows
    // beyond that poll is scheduling slack on a loaded machine (a run of CI was 500.6 ms late),
    // and the old due time is an hour away.
    let poll = QueueSettings::default().poll_interval.unwrap_or(Duration::from_secs(1));
    let late = got[0].duration_since(at).unwrap_or_default();
    assert!(late < poll + Duration::from_millis(500), "{}: started {late:?} after its new due time", b.name());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn earlier_reschedule_memory() {
    earlier_reschedule_runs_on_time(TestBackend::Memory, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn earlier_reschedule_standalone() {
    baton_testkit::require_redis();
    earlier_reschedule_runs_on_time(TestBackend::Standalone(RedisServer::start()), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn earlier_reschedule_by_another_process_standalone() {
    baton_testkit::require_redis();
    earlier_reschedule_runs_on_time(TestBackend::Standalone(RedisServer::start()), true).await;
}

/// 300 scheduled then cancelled leave nothing in the delayed set or its payload hash, and the
/// count is 0; and cancels racing the promotion (due in 0..20 ms, 100 rounds) all stand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_leaves_no_garbage_and_beats_promotion_standalone() {
    baton_testkit::require_redis();
    let b = TestBackend::Standalone(RedisServer::start());
    let TestBackend::Standalone(server) = &b else { unreachable!() };
    let store: CommandStore = store_for(&b).await;
    let q = queue_name("brkc");
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let r = runs.clone();
    let _svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "job",
            on_execute(move |c: Command| {
                let r = r.clone();
                async move {
                    r.lock().unwrap().push(c.id.clone());
                    Ok(CommandResult::succeeded(json!("done")))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let mut ids = Vec::new();
    for i in 0..300 {
        let st = store.submit(&q, Command::new("job", json!(i)).with_delay(Duration::from_secs(3600))).await.unwrap();
        ids.push(st.id);
    }
    assert_eq!(store.scheduled(&q).await.unwrap().scheduled, 300);
    for id in &ids {
        store.cancel(id).await.unwrap();
    }
    assert_eq!(store.scheduled(&q).await.unwrap().scheduled, 0);
    let keys = server.cli(&["KEYS", &format!("*{{{q}}}:delayed*")]);
    for k in keys.lines().filter(|l| !l.is_empty()) {
        match server.cli(&["TYPE", k]).as_str() {
            "zset" => assert_eq!(server.cli(&["ZCARD", k]), "0", "{k}"),
            "hash" => {
                let fields = server.cli(&["HKEYS", k]);
                assert!(fields.lines().all(|f| f == "~scheduled"), "{k}: {fields}");
            }
            t => panic!("{k}: {t}"),
        }
    }
    // Racing: due in 0..20 ms, cancelled at once.
    let mut cancelled = Vec::new();
    for i in 0..100u64 {
        let st =
            store.submit(&q, Command::new("job", json!(i)).with_delay(Duration::from_millis(i % 20))).await.unwrap();
        // A handler may already be called while the state is still SUBMITTED (the service
        // writes RUNNING only for calls longer than REPORT_INTERVAL): the cancel signals it and
        // its result is refused, so every cancel stands.
        if store.cancel(&st.id).await.is_ok() {
            cancelled.push(st.id);
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ran = runs.lock().unwrap().clone();
    for id in &cancelled {
        let st = store.get(id).await.unwrap().unwrap();
        assert_eq!(st.status, baton_commands::CommandStatus::Cancelled, "{id}");
        assert!(st.result.is_none(), "{id}: a result was accepted after the cancel");
    }
    assert_eq!(store.scheduled(&q).await.unwrap().scheduled, 0);
    eprintln!("race: {} of 100 cancelled, {} handler calls", cancelled.len(), ran.len());
}
