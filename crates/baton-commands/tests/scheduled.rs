//! Scheduled commands (`Command::with_run_at` / `with_delay`): stored at submit, run when due and
//! not before, never pending (so never redelivered) while they wait, rescheduled, cancelled,
//! counted, idempotent on resubmit; on memory, Redis standalone and Redis Cluster.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use baton_commands::{
    Command, CommandError, CommandResult, CommandService, CommandStatus, CommandStore, QueueSettings,
};
use baton_testkit::{RedisCluster, RedisServer, TestBackend};
use common::*;
use serde_json::json;

/// Each call of the handler: (command id, when it started).
type Runs = Arc<Mutex<Vec<(String, SystemTime)>>>;

/// A claim timeout shorter than every delay below: a message that waited in the pending list
/// would be redelivered (and run twice) long before it is due.
fn settings() -> QueueSettings {
    QueueSettings { claim_timeout: Duration::from_millis(400), ..fast() }
}

async fn service(store: &CommandStore, q: &str, runs: &Runs) -> CommandService {
    service_with(store, q, runs, settings()).await
}

async fn service_with(store: &CommandStore, q: &str, runs: &Runs, settings: QueueSettings) -> CommandService {
    let runs = runs.clone();
    CommandService::builder(store.clone(), q)
        .settings(settings)
        .handler(
            "job",
            on_execute(move |c: Command| {
                let runs = runs.clone();
                async move {
                    runs.lock().unwrap().push((c.id.clone(), SystemTime::now()));
                    Ok(CommandResult::succeeded(json!("done")))
                }
            }),
        )
        .start()
        .await
        .unwrap()
}

fn runs_of(runs: &Runs, id: &str) -> Vec<SystemTime> {
    runs.lock().unwrap().iter().filter(|(i, _)| i == id).map(|(_, t)| *t).collect()
}

/// How late after its due time a command may start: the promotion wakes at the due time (Redis
/// sees it a few ms late at most), then a read and a dispatch.
const LATE_MAX: Duration = Duration::from_millis(400);

async fn due_time_is_kept(b: &TestBackend) {
    let store = store_for(b).await;
    let q = queue_name("sched");
    let runs: Runs = Arc::default();
    let svc = service(&store, &q, &runs).await;

    let before = SystemTime::now();
    let st = svc.submit(Command::new("job", json!(1)).with_delay(Duration::from_millis(1500))).await.unwrap();
    let run_at = st.run_at.expect("the state shows its due time").0;
    assert!(run_at + Duration::from_millis(1) > before + Duration::from_millis(1500), "{}", b.name());
    assert_eq!(st.status, CommandStatus::Submitted);
    assert!(st.is_scheduled());
    // The public form shows `run_at` (RFC 3339 with ms).
    let v = serde_json::to_value(&st).unwrap();
    assert_eq!(v["run_at"], json!(st.run_at.unwrap().to_string()));

    // Waiting: not in the stream, not pending; counted with its due time.
    let stats = store.messages().stats(&q).await.unwrap();
    assert_eq!((stats.length, stats.pending, stats.delayed), (0, 0, 1), "{}: {stats:?}", b.name());
    let sc = store.scheduled(&q).await.unwrap();
    assert_eq!((sc.scheduled, sc.next_due), (1, st.run_at), "{}", b.name());

    // Not run before due (more than three claim timeouts), run once within LATE_MAX after.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(runs_of(&runs, &st.id).is_empty(), "{}: ran before due", b.name());
    assert_eq!(store.messages().stats(&q).await.unwrap().pending, 0, "{}", b.name());
    let done = store.wait(&st.id, Duration::from_secs(5)).await.unwrap();
    assert_eq!(done.status, CommandStatus::Succeeded, "{}", b.name());
    let ran = runs_of(&runs, &st.id);
    assert_eq!(ran.len(), 1, "{}: ran {} times", b.name(), ran.len());
    assert!(ran[0] >= run_at, "{}: ran {:?} before due", b.name(), run_at.duration_since(ran[0]));
    let late = ran[0].duration_since(run_at).unwrap();
    assert!(late <= LATE_MAX, "{}: ran {late:?} after due", b.name());
    assert_eq!(done.run_at, st.run_at, "the due time stays in the state");
    assert_eq!(store.scheduled(&q).await.unwrap().scheduled, 0);

    // A due time in the past runs at once.
    let past = SystemTime::now() - Duration::from_secs(60);
    let st = svc.submit(Command::new("job", json!(2)).with_run_at(past)).await.unwrap();
    assert!(!st.is_scheduled());
    let done = store.wait(&st.id, Duration::from_secs(5)).await.unwrap();
    assert_eq!(done.status, CommandStatus::Succeeded, "{}", b.name());
    svc.close().await;
}

async fn reschedule_and_cancel(b: &TestBackend) {
    let store = store_for(b).await;
    let q = queue_name("sched");
    let runs: Runs = Arc::default();
    let svc = service(&store, &q, &runs).await;

    // Earlier: from 30 s to 600 ms from now.
    let a = svc.submit(Command::new("job", json!("a")).with_delay(Duration::from_secs(30))).await.unwrap();
    let at = SystemTime::now() + Duration::from_millis(600);
    let moved = store.reschedule(&a.id, at).await.unwrap();
    assert_eq!(moved.version, a.version + 1);
    assert_eq!(
        moved.run_at.unwrap().0,
        baton_commands::Timestamp::from_millis(baton_commands::Timestamp(at).millis()).0
    );
    assert_eq!(store.get(&a.id).await.unwrap().unwrap().run_at, moved.run_at);
    // Later: from 300 ms to 1.5 s from now.
    let b_st = svc.submit(Command::new("job", json!("b")).with_delay(Duration::from_millis(300))).await.unwrap();
    let later = SystemTime::now() + Duration::from_millis(1500);
    store.reschedule(&b_st.id, later).await.unwrap();
    // Cancelled while waiting: never runs, and its message leaves the delayed set.
    let c = svc.submit(Command::new("job", json!("c")).with_delay(Duration::from_millis(500))).await.unwrap();
    assert_eq!(store.scheduled(&q).await.unwrap().scheduled, 3, "{}", b.name());
    let cancelled = store.cancel(&c.id).await.unwrap();
    assert_eq!(cancelled.status, CommandStatus::Cancelled);
    assert_eq!(store.scheduled(&q).await.unwrap().scheduled, 2, "{}", b.name());
    match store.reschedule(&c.id, later).await {
        Err(CommandError::NotScheduled(st)) => assert_eq!(st.status, CommandStatus::Cancelled),
        other => panic!("{}: reschedule of a cancelled command: {other:?}", b.name()),
    }

    let done = store.wait(&a.id, Duration::from_secs(5)).await.unwrap();
    assert_eq!(done.status, CommandStatus::Succeeded, "{}", b.name());
    let ran = runs_of(&runs, &a.id);
    assert!(ran[0] >= at && ran[0].duration_since(at).unwrap() <= LATE_MAX, "{}", b.name());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(runs_of(&runs, &b_st.id).is_empty(), "{}: ran at its old due time", b.name());
    let done = store.wait(&b_st.id, Duration::from_secs(5)).await.unwrap();
    assert_eq!(done.status, CommandStatus::Succeeded);
    let ran = runs_of(&runs, &b_st.id);
    assert_eq!(ran.len(), 1);
    assert!(ran[0] >= later, "{}: ran before its new due time", b.name());
    assert!(runs_of(&runs, &c.id).is_empty(), "{}: a cancelled command ran", b.name());
    assert_eq!(store.get(&c.id).await.unwrap().unwrap().status, CommandStatus::Cancelled);
    // Its due time passed: not waiting any more.
    match store.reschedule(&a.id, later).await {
        Err(CommandError::NotScheduled(st)) => assert_eq!(st.status, CommandStatus::Succeeded),
        other => panic!("{}: reschedule of a command that ran: {other:?}", b.name()),
    }
    // Not scheduled at all.
    let now = svc.submit(Command::new("job", json!("now"))).await.unwrap();
    assert!(matches!(store.reschedule(&now.id, later).await, Err(CommandError::NotScheduled(_))));
    assert_eq!(store.scheduled(&q).await.unwrap(), Default::default(), "{}", b.name());
    svc.close().await;
}

async fn resubmits_are_idempotent(b: &TestBackend) {
    let store = store_for(b).await;
    let q = queue_name("sched");
    store.declare_queue(&q).unwrap();
    let at = SystemTime::now() + Duration::from_secs(60);
    let cmd = || Command::with_id(format!("s-{}", uuid::Uuid::now_v7()), "job", json!({"n": 1}));
    let first = cmd();
    let id = first.id.clone();
    let again = |c: Command| Command::with_id(id.clone(), "job", json!({"n": 1})).with_run_at(c.run_at().unwrap());
    let (st, created) = store.submit_created(&q, first.with_run_at(at)).await.unwrap();
    assert!(created);
    let (st2, created) = store.submit_created(&q, again(Command::new("x", json!(0)).with_run_at(at))).await.unwrap();
    assert!(!created, "{}", b.name());
    assert_eq!(st2, st);
    // A delay matches any scheduled command.
    let with_delay = Command::with_id(id.clone(), "job", json!({"n": 1})).with_delay(Duration::from_secs(5));
    assert!(!store.submit_created(&q, with_delay).await.unwrap().1);
    // Another due time, or none: a conflict naming run_at.
    let other = again(Command::new("x", json!(0)).with_run_at(at + Duration::from_secs(1)));
    match store.submit(&q, other).await {
        Err(CommandError::Conflict { what, .. }) => assert_eq!(what, "run_at"),
        r => panic!("{}: {r:?}", b.name()),
    }
    match store.submit(&q, Command::with_id(id.clone(), "job", json!({"n": 1}))).await {
        Err(CommandError::Conflict { what, .. }) => assert_eq!(what, "run_at"),
        r => panic!("{}: {r:?}", b.name()),
    }
    // The reverse: a command not scheduled, resubmitted with a due time.
    let plain = cmd();
    let plain_id = plain.id.clone();
    store.submit(&q, plain).await.unwrap();
    let resub = Command::with_id(plain_id, "job", json!({"n": 1})).with_run_at(at);
    assert!(matches!(store.submit(&q, resub).await, Err(CommandError::Conflict { what: "run_at", .. })));
    // Still one scheduled message.
    assert_eq!(store.scheduled(&q).await.unwrap().scheduled, 1, "{}", b.name());
    // Too far ahead.
    let far = cmd().with_run_at(SystemTime::now() + CommandStore::SCHEDULE_MAX + Duration::from_secs(60));
    assert!(matches!(store.submit(&q, far).await, Err(CommandError::InvalidSchedule(_))));
}

async fn all(b: TestBackend) {
    due_time_is_kept(&b).await;
    reschedule_and_cancel(&b).await;
    resubmits_are_idempotent(&b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory() {
    all(TestBackend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone() {
    baton_testkit::require_redis();
    all(TestBackend::Standalone(RedisServer::start())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster() {
    baton_testkit::require_redis();
    all(TestBackend::Cluster(RedisCluster::start())).await;
}

/// A command scheduled by one process and due while no consumer runs (the process that would
/// run it was killed) still runs, by the next consumer of its queue, once it starts; one
/// scheduled by another process (no local hint of its due time) is started on time by a
/// running consumer, which learns the due time from its reclaim tick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_processes() {
    baton_testkit::require_redis();
    let b = TestBackend::Standalone(RedisServer::start());
    let q = queue_name("sched");
    let runs: Runs = Arc::default();
    let submitter = store_for(&b).await;
    submitter.declare_queue(&q).unwrap();
    let first =
        submitter.submit(&q, Command::new("job", json!(1)).with_delay(Duration::from_millis(300))).await.unwrap();
    drop(submitter);
    tokio::time::sleep(Duration::from_millis(600)).await;
    // Due, no consumer: still waiting in Redis.
    let worker = store_for(&b).await;
    assert_eq!(worker.get(&first.id).await.unwrap().unwrap().status, CommandStatus::Submitted);
    let svc = service(&worker, &q, &runs).await;
    let done = worker.wait(&first.id, Duration::from_secs(5)).await.unwrap();
    assert_eq!(done.status, CommandStatus::Succeeded);

    svc.close().await;

    // Another process schedules while a consumer runs: the consumer learns each due time at its
    // next reclaim tick (every second with the default 30 s claim timeout) and promotes at the
    // due time, not at the tick after it. Three due times a third of a tick apart: promoting at
    // ticks would start at least one of them 600 ms late or more.
    let slow = QueueSettings { claim_timeout: Duration::from_secs(30), ..fast() };
    let svc = service_with(&worker, &q, &runs, slow).await;
    let other = store_for(&b).await;
    let mut ids = Vec::new();
    for i in 0..3u64 {
        let delay = Duration::from_millis(2500 + 333 * i);
        ids.push(other.submit(&q, Command::new("job", json!(i)).with_delay(delay)).await.unwrap());
    }
    for st in ids {
        let run_at = st.run_at.unwrap().0;
        let done = worker.wait(&st.id, Duration::from_secs(8)).await.unwrap();
        assert_eq!(done.status, CommandStatus::Succeeded);
        let ran = runs_of(&runs, &st.id);
        assert_eq!(ran.len(), 1);
        let late = ran[0].duration_since(run_at).expect("not before due");
        assert!(late <= Duration::from_millis(150), "{}: started {late:?} after due", st.id);
    }
    svc.close().await;
}
