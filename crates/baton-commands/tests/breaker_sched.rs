//! Breaker: a reschedule to an earlier time (the consumer asleep until the due time it learnt)
//! starts the command on time when this process rescheduled it (its consumers are told at
//! once), and within one reclaim poll of its new due time when another process did (the poll
//! is where a consumer learns a due time another process set: 1 s by default); never at the old
//! due time. The same for a command submitted with a short delay.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use baton_commands::{Command, CommandResult, CommandService, CommandStore, QueueSettings};
use baton_testkit::{RedisServer, TestBackend};
use common::*;
use serde_json::json;

/// Settings for `other`: a reschedule by this process must wake the consumer, so the reclaim
/// poll (which would find the due time too) is pushed 20 s out; by another process it is the
/// poll that finds it (the default, 1 s).
fn sched_settings(other: bool) -> QueueSettings {
    if other {
        QueueSettings::default()
    } else {
        QueueSettings { poll_interval: Some(Duration::from_secs(20)), ..QueueSettings::default() }
    }
}

/// How late a start may be: this process's writes wake the consumer (the bound is slack for a
/// loaded machine, far below the 20 s poll); another process's wait for the poll (1 s after the
/// consumer started, about 400 ms after the due time) plus that slack.
fn sched_bound(other: bool) -> Duration {
    if other {
        let poll = QueueSettings::default().poll_interval.unwrap_or(Duration::from_secs(1));
        poll + Duration::from_millis(500)
    } else {
        Duration::from_millis(1000)
    }
}

/// Waits (up to 5 s) for the first run and returns how long after `at` it started.
async fn first_run_after(b: &TestBackend, runs: &Arc<Mutex<Vec<SystemTime>>>, at: SystemTime) -> Duration {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while runs.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let got = runs.lock().unwrap().clone();
    assert_eq!(got.len(), 1, "{}: not run within 5 s of its due time", b.name());
    got[0].duration_since(at).unwrap_or_default()
}

async fn recording_service(
    store: &CommandStore,
    q: &str,
    other: bool,
) -> (CommandService, Arc<Mutex<Vec<SystemTime>>>) {
    let runs: Arc<Mutex<Vec<SystemTime>>> = Arc::default();
    let r = runs.clone();
    let svc = CommandService::builder(store.clone(), q)
        .settings(sched_settings(other))
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
    (svc, runs)
}

async fn earlier_reschedule_runs_on_time(b: TestBackend, other: bool) {
    let store: CommandStore = store_for(&b).await;
    let q = queue_name("brk");
    let (_svc, runs) = recording_service(&store, &q, other).await;
    let a = store.submit(&q, Command::new("job", json!(1)).with_delay(Duration::from_secs(3600))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await; // the consumer learns the 1 h due time
    let at = SystemTime::now() + Duration::from_millis(300);
    // `other`: by another process's store (no local hint to this process's consumer).
    let by = if other { store_for(&b).await } else { store.clone() };
    by.reschedule(&a.id, at).await.unwrap();
    let late = first_run_after(&b, &runs, at).await;
    assert!(late < sched_bound(other), "{}: started {late:?} after its new due time", b.name());
}

/// A command submitted by this process with a 300 ms delay, its consumer polling every 20 s,
/// starts on time.
async fn short_delay_runs_on_time(b: TestBackend) {
    let store: CommandStore = store_for(&b).await;
    let q = queue_name("brkd");
    let (_svc, runs) = recording_service(&store, &q, false).await;
    tokio::time::sleep(Duration::from_millis(300)).await; // past the consumer's first poll
    let at = SystemTime::now() + Duration::from_millis(300);
    store.submit(&q, Command::new("job", json!(1)).with_run_at(at)).await.unwrap();
    let late = first_run_after(&b, &runs, at).await;
    assert!(late < sched_bound(false), "{}: started {late:?} after its due time", b.name());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_delay_memory() {
    short_delay_runs_on_time(TestBackend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_delay_standalone() {
    baton_testkit::require_redis();
    short_delay_runs_on_time(TestBackend::Standalone(RedisServer::start())).await;
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
