//! Batch submit (`CommandStore::submit_many`): every command decided as alone (per-item
//! outcomes in order, idempotency and conflicts, duplicates inside one batch), one script call
//! per queue per batch of up to 128 on Redis (`INFO commandstats`), and every created command
//! runs.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use baton_commands::{Command, CommandError, CommandResult, CommandService, CommandStatus};
use baton_redis::redis;
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    each_command_is_decided_as_alone_in_order,
    a_batch_is_one_script_call_per_128_commands,
    every_created_command_runs,
);

/// Sum of `INFO commandstats` calls of `name` over every node of the backend (`None` in memory).
async fn calls(b: &TestBackend, name: &str) -> Option<u64> {
    let urls = match b {
        TestBackend::Memory => return None,
        TestBackend::Standalone(s) => vec![s.url()],
        TestBackend::Cluster(c) => c.urls(),
    };
    let mut total = 0;
    for url in urls {
        let mut conn = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
        let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap();
        total += info
            .lines()
            .find(|l| l.starts_with(&format!("cmdstat_{name}:")))
            .and_then(|l| l.split("calls=").nth(1)?.split(',').next()?.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Some(total)
}

async fn each_command_is_decided_as_alone_in_order(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("many");
    let id = |s: &str| format!("{s}-{q}");
    store.submit(&q, Command::with_id(id("known"), "t", json!({"n": 1}))).await.unwrap();
    store.submit(&q, Command::with_id(id("taken"), "t", json!({"n": 1}))).await.unwrap();
    let batch = vec![
        Command::with_id(id("a"), "t", json!({"n": 1})),
        Command::with_id(id("known"), "t", json!({ "n": 1 })),
        Command::with_id(id("taken"), "t", json!({"n": 2})),
        Command::with_id("", "t", json!({})),
        Command::with_id(id("twice"), "t", json!({"n": 3})),
        Command::with_id(id("twice"), "t", json!({"n": 3})),
        Command::with_id(id("clash"), "t", json!({"n": 4})),
        Command::with_id(id("clash"), "t", json!({"n": 5})),
        Command::with_id(id("badtype"), "", json!({})),
        Command::with_id(id("z"), "u", json!([1, 2])).with_priority(3),
    ];
    let out = store.submit_many(&q, batch).await;
    assert_eq!(out.len(), 10);
    let created: Vec<Option<bool>> = out.iter().map(|r| r.as_ref().ok().map(|(_, c)| *c)).collect();
    assert_eq!(
        created,
        [Some(true), Some(false), None, None, Some(true), Some(false), Some(true), None, None, Some(true)]
    );
    let ids: Vec<String> = out.iter().filter_map(|r| r.as_ref().ok()).map(|(s, _)| s.id.clone()).collect();
    assert_eq!(ids, [id("a"), id("known"), id("twice"), id("twice"), id("clash"), id("z")]);
    assert!(matches!(&out[2], Err(CommandError::Conflict { what: "type or params", .. })), "{:?}", out[2]);
    assert!(matches!(&out[3], Err(CommandError::InvalidId(_))), "{:?}", out[3]);
    assert!(matches!(&out[7], Err(CommandError::Conflict { what: "type or params", .. })), "{:?}", out[7]);
    assert!(matches!(&out[8], Err(CommandError::InvalidType(_))), "{:?}", out[8]);
    // The second "twice" is the first's stored state.
    let (first, second) = (&out[4].as_ref().unwrap().0, &out[5].as_ref().unwrap().0);
    assert_eq!((first.version, second.version, &first.created_at), (1, 1, &second.created_at));
    let z = &out[9].as_ref().unwrap().0;
    assert_eq!((z.status, z.priority, z.command_type.as_str()), (CommandStatus::Submitted, 3, "u"));
    // Stored exactly as submitted alone: 5 new (a, twice, clash, z) plus the 2 known = 6.
    let counts = store.counts(&q).await.unwrap();
    assert_eq!(counts.submitted, 6, "{counts:?}");
    assert_eq!(store.messages().stats(&q).await.unwrap().length, 6);
    assert_eq!(store.get(&id("clash")).await.unwrap().unwrap().params, json!({"n": 4}));
    assert_eq!(store.get(&id("taken")).await.unwrap().unwrap().params, json!({"n": 1}));
    // The same batch again: nothing new, every valid item answers its stored state.
    assert!(store.submit_many(&q, vec![]).await.is_empty());
    let again = store
        .submit_many(
            &q,
            vec![
                Command::with_id(id("a"), "t", json!({"n": 1})),
                Command::with_id(id("z"), "u", json!([1, 2])).with_priority(3),
            ],
        )
        .await;
    assert_eq!(
        again.iter().map(|r| r.as_ref().map(|(s, c)| (s.id.clone(), *c)).unwrap()).collect::<Vec<_>>(),
        [(id("a"), false), (id("z"), false)]
    );
    assert_eq!(store.counts(&q).await.unwrap().submitted, 6);
}

async fn a_batch_is_one_script_call_per_128_commands(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("calls");
    // Warm up (script load, connections) outside the count.
    store.submit(&q, Command::new("t", json!({}))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut submitted = 1u64;
    for (n, want_calls) in [(100u64, 1u64), (128, 1), (300, 3)] {
        let (evalsha, set) = (calls(&b, "evalsha").await, calls(&b, "set").await);
        let batch: Vec<Command> = (0..n).map(|i| Command::new("t", json!({ "i": i }))).collect();
        let out = store.submit_many(&q, batch).await;
        assert_eq!(out.iter().filter(|r| matches!(r, Ok((_, true)))).count() as u64, n);
        // Every 64th submit of a queue also prunes its indexes (a script call of its own, in
        // the background): once for a batch that holds one or more such submits.
        let prunes = ((submitted + n).div_ceil(64) - submitted.div_ceil(64)).min(1);
        submitted += n;
        tokio::time::sleep(Duration::from_millis(300)).await;
        if let (Some(before), Some(after)) = (evalsha, calls(&b, "evalsha").await) {
            assert_eq!(after - before, want_calls + prunes, "{n} commands: script calls ({prunes} prunes)");
        }
        if let (Some(before), Some(after)) = (set, calls(&b, "set").await) {
            // `INFO commandstats` counts the calls inside scripts too: per command, its state
            // and its id lookup (standalone: in the script; Cluster: before it, in its own slot);
            // on Cluster also one per script call, its re-send guard's (`baton_redis::resend`).
            let guards = if matches!(b, TestBackend::Cluster(_)) { want_calls } else { 0 };
            assert_eq!(after - before, 2 * n + guards, "{n} commands: SETs");
        }
    }
    assert_eq!(store.counts(&q).await.unwrap().submitted, 1 + 100 + 128 + 300);
}

async fn every_created_command_runs(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("runs");
    let batch: Vec<Command> =
        (0..200).map(|i| Command::with_id(format!("r{i}-{q}"), "echo", json!({ "i": i }))).collect();
    let out = store.submit_many(&q, batch).await;
    assert!(out.iter().all(|r| matches!(r, Ok((_, true)))));
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler("echo", on_execute(|c: Command| async move { Ok(CommandResult::succeeded(c.params)) }))
        .start()
        .await
        .unwrap();
    let mut results = HashMap::new();
    for i in 0..200 {
        let st = store.wait(&format!("r{i}-{q}"), Duration::from_secs(20)).await.unwrap();
        assert_eq!(st.status, CommandStatus::Succeeded, "r{i}: {st:?}");
        results.insert(i, st.result.clone().unwrap());
    }
    assert_eq!(results.len(), 200);
    assert!(results.iter().all(|(i, r)| *r == json!({ "i": i })));
    svc.close().await;
}
