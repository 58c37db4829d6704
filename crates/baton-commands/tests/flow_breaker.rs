//! Breaker tests of command queues' concurrency keys (`concurrency_per_key = 1`): a cancel of a
//! command waiting in its key's line, a cancel of the running holder whose handler ignores the
//! signal, a holder that fails and is retried, a holder that reports `RUNNING` and is polled
//! with `check_status`. Each key's commands must run one at a time, a cancelled waiter never,
//! and the line must move on. Memory, Redis standalone and Cluster.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_commands::{Command, CommandResult, CommandService, CommandStatus, CommandStore, HandlerError};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    a_cancelled_waiter_never_runs_and_the_line_moves_on,
    a_cancelled_holder_ignoring_the_signal_keeps_its_slot_until_it_returns,
    a_failing_holder_keeps_its_slot_through_its_retries,
    a_running_holder_keeps_its_slot_between_check_status_calls,
);

/// (command id, call, started, ended) of each handler call.
type Runs = Arc<Mutex<Vec<(String, &'static str, Instant, Instant)>>>;

fn keyed(id: &str) -> Command {
    Command::with_id(id, "job", json!({})).with_concurrency_key("k")
}

/// A service whose `job` handler sleeps `ms`, fails the first `fails` calls of `a1`, and answers
/// `RUNNING` to `a1`'s execute when `poll` (then succeeds on the third check_status).
async fn service(store: &CommandStore, q: &str, runs: &Runs, ms: u64, fails: usize, poll: bool) -> CommandService {
    let (r1, r2) = (runs.clone(), runs.clone());
    let checks = Arc::new(Mutex::new(0usize));
    CommandService::builder(store.clone(), q)
        .settings(baton_commands::QueueSettings { concurrency_per_key: Some(1), ..fast() })
        .handler(
            "job",
            on_execute(move |c: Command| {
                let runs = r1.clone();
                async move {
                    let start = Instant::now();
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    let mut r = runs.lock().unwrap();
                    let before = r.iter().filter(|x| x.0 == c.id).count();
                    r.push((c.id.clone(), "execute", start, Instant::now()));
                    if c.id == "a1" && before < fails {
                        return Err(HandlerError::from("transient"));
                    }
                    if c.id == "a1" && poll {
                        return Ok(CommandResult::running());
                    }
                    Ok(CommandResult::succeeded(json!("done")))
                }
            })
            .on_check(move |c: Command, _st| {
                let (runs, checks) = (r2.clone(), checks.clone());
                async move {
                    let start = Instant::now();
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    runs.lock().unwrap().push((c.id.clone(), "check", start, Instant::now()));
                    let mut n = checks.lock().unwrap();
                    *n += 1;
                    if *n >= 3 {
                        Ok(CommandResult::succeeded(json!("polled")))
                    } else {
                        Ok(CommandResult::running())
                    }
                }
            }),
        )
        .start()
        .await
        .unwrap()
}

fn calls(runs: &Runs, id: &str) -> Vec<(Instant, Instant)> {
    runs.lock().unwrap().iter().filter(|r| r.0 == id).map(|r| (r.2, r.3)).collect()
}

async fn a_cancelled_waiter_never_runs_and_the_line_moves_on(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("fbc-cancel-w");
    let runs: Runs = Arc::default();
    let s = service(&store, &q, &runs, 800, 0, false).await;
    store.submit(&q, keyed("a1")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    store.submit(&q, keyed("a2")).await.unwrap();
    store.submit(&q, keyed("a3")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(store.cancel("a2").await.unwrap().status, CommandStatus::Cancelled);
    for id in ["a1", "a3"] {
        assert_eq!(store.wait(id, Duration::from_secs(15)).await.unwrap().status, CommandStatus::Succeeded, "{id}");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(calls(&runs, "a2").is_empty(), "the cancelled waiter ran");
    assert_eq!(store.get("a2").await.unwrap().unwrap().status, CommandStatus::Cancelled);
    let (a1, a3) = (calls(&runs, "a1"), calls(&runs, "a3"));
    assert_eq!((a1.len(), a3.len()), (1, 1));
    assert!(a3[0].0 >= a1[0].1, "a3 started before a1 ended");
    s.drain(Duration::from_secs(2)).await;
}

async fn a_cancelled_holder_ignoring_the_signal_keeps_its_slot_until_it_returns(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("fbc-cancel-h");
    let runs: Runs = Arc::default();
    let s = service(&store, &q, &runs, 1_500, 0, false).await;
    store.submit(&q, keyed("a1")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    store.submit(&q, keyed("a2")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(store.cancel("a1").await.unwrap().status, CommandStatus::Cancelled);
    assert_eq!(store.wait("a2", Duration::from_secs(15)).await.unwrap().status, CommandStatus::Succeeded);
    let (a1, a2) = (calls(&runs, "a1"), calls(&runs, "a2"));
    assert_eq!((a1.len(), a2.len()), (1, 1), "{a1:?} {a2:?}");
    assert!(a2[0].0 >= a1[0].1, "a2 started while the cancelled a1's handler still ran");
    assert_eq!(store.get("a1").await.unwrap().unwrap().status, CommandStatus::Cancelled);
    s.drain(Duration::from_secs(2)).await;
}

async fn a_failing_holder_keeps_its_slot_through_its_retries(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("fbc-retry");
    let runs: Runs = Arc::default();
    let s = service(&store, &q, &runs, 100, 2, false).await;
    store.submit(&q, keyed("a1")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    store.submit(&q, keyed("a2")).await.unwrap();
    for id in ["a1", "a2"] {
        assert_eq!(store.wait(id, Duration::from_secs(15)).await.unwrap().status, CommandStatus::Succeeded, "{id}");
    }
    let (a1, a2) = (calls(&runs, "a1"), calls(&runs, "a2"));
    assert_eq!((a1.len(), a2.len()), (3, 1), "{a1:?} {a2:?}");
    assert!(a2[0].0 >= a1[2].1, "a2 started before a1's last attempt ended");
    s.drain(Duration::from_secs(2)).await;
}

async fn a_running_holder_keeps_its_slot_between_check_status_calls(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("fbc-poll");
    let runs: Runs = Arc::default();
    let s = service(&store, &q, &runs, 50, 0, true).await;
    store.submit(&q, keyed("a1")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    store.submit(&q, keyed("a2")).await.unwrap();
    for id in ["a1", "a2"] {
        assert_eq!(store.wait(id, Duration::from_secs(15)).await.unwrap().status, CommandStatus::Succeeded, "{id}");
    }
    let r = runs.lock().unwrap().clone();
    let a1_last = r.iter().filter(|x| x.0 == "a1").map(|x| x.3).max().unwrap();
    let a2 = calls(&runs, "a2");
    assert_eq!(r.iter().filter(|x| x.0 == "a1").count(), 4, "execute + 3 check_status: {r:?}");
    assert_eq!(a2.len(), 1);
    assert!(a2[0].0 >= a1_last, "a2 started while a1 was RUNNING: {r:?}");
    s.drain(Duration::from_secs(2)).await;
}
