//! Concurrency caps on command queues (`QueueSettings::concurrency_per_key`,
//! `Command::with_concurrency_key`): commands of one key run one after the other (cap 1), across
//! two processes (two stores on Redis), scheduled ones included; on memory, Redis standalone and
//! Redis Cluster.

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_commands::{Command, CommandError, CommandResult, CommandService, CommandStatus, CommandStore};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(commands_of_one_key_run_one_after_the_other);

/// (command id, started, ended) of each handler call.
type Runs = Arc<Mutex<Vec<(String, Instant, Instant)>>>;

async fn service(store: &CommandStore, q: &str, runs: &Runs) -> CommandService {
    let runs = runs.clone();
    CommandService::builder(store.clone(), q)
        .settings(baton_commands::QueueSettings { concurrency_per_key: Some(1), ..fast() })
        .handler(
            "job",
            on_execute(move |c: Command| {
                let runs = runs.clone();
                async move {
                    let start = Instant::now();
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    runs.lock().unwrap().push((c.id.clone(), start, Instant::now()));
                    Ok(CommandResult::succeeded(json!("done")))
                }
            }),
        )
        .start()
        .await
        .unwrap()
}

async fn commands_of_one_key_run_one_after_the_other(b: TestBackend) {
    let store = store_for(&b).await;
    let other = other_store(&b, &store).await;
    let q = queue_name("caps");
    let runs: Runs = Arc::default();
    let s1 = service(&store, &q, &runs).await;
    let s2 = service(&other, &q, &runs).await;
    let k = |id: &str, key: &str| Command::with_id(id, "job", json!({})).with_concurrency_key(key);
    let a1 = store.submit(&q, k("a1", "tenant-a")).await.unwrap();
    assert_eq!(a1.concurrency_key.as_deref(), Some("tenant-a"));
    assert_eq!(serde_json::to_value(&a1).unwrap()["concurrency_key"], json!("tenant-a"));
    other.submit(&q, k("a2", "tenant-a")).await.unwrap();
    store.submit(&q, k("b1", "tenant-b")).await.unwrap();
    // Scheduled: due while a1 or a2 still runs, so it must wait for its key's slot.
    other.submit(&q, k("a3", "tenant-a").with_delay(Duration::from_millis(200))).await.unwrap();
    let plain = store.submit(&q, Command::with_id("free", "job", json!({}))).await.unwrap();
    assert_eq!(plain.concurrency_key, None);
    assert!(serde_json::to_value(&plain).unwrap().get("concurrency_key").is_none());
    for id in ["a1", "a2", "a3", "b1", "free"] {
        let st = store.wait(id, Duration::from_secs(30)).await.unwrap();
        assert_eq!(st.status, CommandStatus::Succeeded, "{id}");
    }
    // Read back from the store: the key is kept.
    assert_eq!(other.get("a3").await.unwrap().unwrap().concurrency_key.as_deref(), Some("tenant-a"));
    let runs = runs.lock().unwrap().clone();
    let by_id: HashMap<&str, (Instant, Instant)> = runs.iter().map(|(id, s, e)| (id.as_str(), (*s, *e))).collect();
    assert_eq!(runs.len(), 5, "each ran once: {runs:?}");
    // tenant-a: a1, a2 (submit order), then a3 (due later); none overlaps the one before.
    let (a1, a2, a3) = (by_id["a1"], by_id["a2"], by_id["a3"]);
    assert!(a2.0 >= a1.1, "a2 started before a1 ended");
    assert!(a3.0 >= a2.1, "a3 started before a2 ended");
    // Other keys do not wait for tenant-a.
    let b1 = by_id["b1"];
    assert!(b1.0 < a1.1, "b1 ran beside a1");
    let too_long = "x".repeat(257);
    for bad in ["", too_long.as_str(), "a\tb"] {
        let err = store.submit(&q, k("bad", bad)).await.unwrap_err();
        assert!(matches!(err, CommandError::InvalidConcurrencyKey(_)), "{err:?}");
        assert!(err.to_string().starts_with("invalid concurrency_key: use 1 to 256 bytes"), "{err}");
    }
    assert!(store.get("bad").await.unwrap().is_none(), "nothing stored");
    s1.drain(Duration::from_secs(2)).await;
    s2.drain(Duration::from_secs(2)).await;
}
