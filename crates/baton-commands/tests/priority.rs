//! Priorities of commands (`Command::with_priority`): kept in the state (JSON `priority`, absent
//! when 0) and read back from the store; the queue's worker takes the waiting commands by
//! priority, then submit order; out of range is refused at submit. On memory, Redis standalone
//! and Redis Cluster.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_commands::{Command, CommandError, CommandResult, CommandService, CommandStatus};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(commands_run_by_priority_then_submit_order);

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
