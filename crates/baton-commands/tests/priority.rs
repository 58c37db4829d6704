//! Priorities of commands (`Command::with_priority`): kept in the state (JSON `priority`, absent
//! when 0) and read back from the store; the queue's worker takes the waiting commands by
//! priority, then submit order; out of range is refused at submit. On memory, Redis standalone
//! and Redis Cluster.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_commands::{Command, CommandError, CommandResult, CommandService, CommandStatus};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    commands_run_by_priority_then_submit_order,
    a_command_cancelled_while_waiting_by_priority_does_not_run,
);

async fn commands_run_by_priority_then_submit_order(b: TestBackend) {
    let store = store_for(&b).await;
    let other = other_store(&b, &store).await;
    let q = queue_name("prio");
    let order = [("a", 0), ("b", 5), ("c", -3), ("d", 5), ("e", 0), ("f", 10)];
    // Submitted before any worker runs: all of them wait in the queue.
    for (id, p) in order {
        let st = store.submit(&q, Command::with_id(id, "job", json!({})).with_priority(p)).await.unwrap();
        assert_eq!(st.priority, p);
        let v = serde_json::to_value(&st).unwrap();
        if p == 0 {
            assert!(v.get("priority").is_none(), "{v}");
        } else {
            assert_eq!(v["priority"], json!(p));
        }
    }
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let r = runs.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(baton_commands::QueueSettings { concurrency: 1, ..fast() })
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
    for (id, _) in order {
        let st = store.wait(id, Duration::from_secs(30)).await.unwrap();
        assert_eq!(st.status, CommandStatus::Succeeded, "{id}");
    }
    assert_eq!(*runs.lock().unwrap(), ["f", "b", "d", "a", "e", "c"]);
    // Read back from the store (another store on Redis): the priority is kept.
    assert_eq!(other.get("d").await.unwrap().unwrap().priority, 5);
    assert_eq!(other.get("c").await.unwrap().unwrap().priority, -3);
    for bad in [11, -11, i8::MIN] {
        let err = store.submit(&q, Command::with_id("bad", "job", json!({})).with_priority(bad)).await.unwrap_err();
        assert!(matches!(err, CommandError::InvalidPriority(_)), "{err:?}");
        assert_eq!(err.to_string(), format!("invalid priority: use an integer from -10 to 10 (got {bad})"));
    }
    assert!(store.get("bad").await.unwrap().is_none(), "nothing stored");
    svc.drain(Duration::from_secs(2)).await;
}

/// Commands waiting to be taken by priority (the first one's handler holds the only slot): one is
/// cancelled there and never runs; a scheduled one rescheduled to now keeps its priority and
/// overtakes the lower ones; the rest run by priority, then submit order.
async fn a_command_cancelled_while_waiting_by_priority_does_not_run(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("prio-cancel");
    let hour = std::time::SystemTime::now() + Duration::from_secs(3_600);
    store.submit(&q, Command::with_id("s", "job", json!({})).with_priority(9).with_run_at(hour)).await.unwrap();
    let order = [("first", 10), ("a", 0), ("b", 5), ("c", 3), ("d", 0)];
    for (id, p) in order {
        store.submit(&q, Command::with_id(id, "job", json!({})).with_priority(p)).await.unwrap();
    }
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (r, g) = (runs.clone(), gate.clone());
    let svc = CommandService::builder(store.clone(), &q)
        .settings(baton_commands::QueueSettings { concurrency: 1, ..fast() })
        .handler(
            "job",
            on_execute(move |c: Command| {
                let (r, g) = (r.clone(), g.clone());
                async move {
                    r.lock().unwrap().push(c.id.clone());
                    if c.id == "first" {
                        g.acquire().await.unwrap().forget();
                    }
                    Ok(CommandResult::succeeded(json!("done")))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    for _ in 0..100 {
        if !runs.lock().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(*runs.lock().unwrap(), ["first"]);
    let st = store.cancel("c").await.unwrap();
    assert_eq!(st.status, CommandStatus::Cancelled);
    let st = store.reschedule("s", std::time::SystemTime::now()).await.unwrap();
    assert_eq!(st.priority, 9);
    // The rescheduled one is enqueued by the reclaim tick: let it be, then free the slot.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    gate.add_permits(1);
    for id in ["first", "s", "a", "b", "d"] {
        let st = store.wait(id, Duration::from_secs(30)).await.unwrap();
        assert_eq!(st.status, CommandStatus::Succeeded, "{id}");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(*runs.lock().unwrap(), ["first", "s", "b", "a", "d"]);
    assert_eq!(store.get("c").await.unwrap().unwrap().status, CommandStatus::Cancelled);
    svc.drain(Duration::from_secs(2)).await;
}
