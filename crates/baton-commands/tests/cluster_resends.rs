//! Commands run to completion on Redis Cluster while every node's client connections are killed
//! again and again (`CLIENT KILL TYPE normal` every 5 ms): the redis crate's Cluster connection
//! re-sends a command whose connection was killed after it ran (see
//! `baton-streams/tests/cluster_replays.rs`), so a write may be applied and then applied again,
//! its caller answered by the second copy.
//!
//! Submits are idempotent by id and every transition is a compare-and-set on the state's
//! version, so a re-sent copy finds its own write and answers "exists" / "conflict". What that
//! does to the callers is what this measures: each command is submitted (retried on an error,
//! as a caller would) and run by a service whose handlers count their calls; afterwards each
//! command must have succeeded with its handler's result, its `execute` called exactly once, one
//! `succeeded` event in the feed and no failure; a first submit answered OK must say "created".
//!
//! Measured: no handler runs twice and no command ends FAILED or with a wrong result, but some
//! polled commands stay RUNNING for good. `execute` returns `running()`; the SUBMITTED -> RUNNING
//! write is applied, its connection killed, and the re-sent copy answers `conflict` with the
//! write itself as the current state. `write_retrying` takes a conflict with its own write as
//! done only after a retry of its own (`tries > 0`), so `apply` sees RUNNING where it expected
//! SUBMITTED, logs "outcome refused: the command moved on" and acks the message: nothing is left
//! to call `check_status` (queue length 0, pending 0, delayed 0 afterwards). A terminal write
//! re-sent the same way is refused alike, but its state is already the right one.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_commands::{Command, CommandResult, CommandService, CommandStatus, EventFrom, EventKind, QueueSettings};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

const N: usize = 400;

/// Handler calls per command id: (`execute`, `check_status`).
type Calls = Arc<Mutex<HashMap<String, (u32, u32)>>>;

fn counting_service(
    store: baton_commands::CommandStore,
    q: &str,
    calls: &Calls,
) -> baton_commands::CommandServiceBuilder {
    let (c1, c2, c3) = (calls.clone(), calls.clone(), calls.clone());
    CommandService::builder(store, q)
        .settings(QueueSettings { concurrency: 16, ..fast() })
        .handler(
            "quick",
            on_execute(move |c: Command| {
                c1.lock().unwrap().entry(c.id.clone()).or_default().0 += 1;
                async move { Ok(CommandResult::succeeded(json!({ "id": c.id }))) }
            }),
        )
        .handler(
            "poll",
            on_execute(move |c: Command| {
                c2.lock().unwrap().entry(c.id.clone()).or_default().0 += 1;
                async move { Ok(CommandResult::running()) }
            })
            .on_check(move |c: Command, _| {
                c3.lock().unwrap().entry(c.id.clone()).or_default().1 += 1;
                async move { Ok(CommandResult::succeeded(json!({ "id": c.id }))) }
            }),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fails: a re-sent SUBMITTED -> RUNNING write conflicts with itself, is taken for another writer's step \
            (\"the command moved on\") and its message acked: 10, 3, 7, 11, 23 of 400 commands (200 of them polled) \
            left RUNNING for good, check_status never called, queue empty (5 runs); none ran twice or ended wrong"]
async fn commands_run_under_a_kill_storm_succeed_once() {
    baton_testkit::require_redis();
    let cluster = baton_testkit::RedisCluster::start();
    let urls = cluster.urls();
    let b = TestBackend::Cluster(cluster);
    let store = store_for(&b).await;
    let q = queue_name("resends");
    let calls: Calls = Arc::default();
    let svc = counting_service(store.clone(), &q, &calls).start().await.unwrap();
    let storm = baton_testkit::KillStorm::start(urls, Duration::from_millis(5)).await;

    // 8 submitters, each retrying a submit until it is answered OK (idempotent by id).
    // Per id: (attempts until OK, the OK answer's `created`).
    let submits: Arc<Mutex<HashMap<String, (u32, bool)>>> = Arc::default();
    let ids: Vec<String> = (0..N).map(|i| format!("c{i}-{q}")).collect();
    let mut submitters = Vec::new();
    for w in 0..8 {
        let (store, q, submits) = (store.clone(), q.clone(), submits.clone());
        let mine: Vec<String> = ids.iter().skip(w).step_by(8).cloned().collect();
        submitters.push(tokio::spawn(async move {
            for (i, id) in mine.into_iter().enumerate() {
                let ty = if i % 2 == 0 { "quick" } else { "poll" };
                let mut tries = 0;
                loop {
                    tries += 1;
                    assert!(tries < 200, "{id}: no submit answered OK");
                    match store.submit_created(&q, Command::with_id(id.clone(), ty, json!({ "i": i }))).await {
                        Ok((_, created)) => {
                            submits.lock().unwrap().insert(id, (tries, created));
                            break;
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                    }
                }
            }
        }));
    }
    for s in submitters {
        s.await.unwrap();
    }
    // The storm goes on while the commands run (at most 6 s more).
    let until = tokio::time::Instant::now() + Duration::from_secs(6);
    while tokio::time::Instant::now() < until {
        match store.counts(&q).await {
            Ok(c) if c.succeeded + c.failed + c.cancelled >= N as u64 => break,
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let killed = storm.stop().await;
    // Then every command should end (a command still not ended after 30 s is reported below).
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let c = store.counts(&q).await.unwrap();
        if c.succeeded + c.failed + c.cancelled >= N as u64 || tokio::time::Instant::now() > until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    svc.close().await;

    // Feed events per id and kind.
    let mut events: HashMap<(String, EventKind), u32> = HashMap::new();
    let mut from = EventFrom::Start;
    loop {
        let page = store.events(&q, from, 1000).await.unwrap();
        for e in &page.events {
            *events.entry((e.id.clone(), e.event)).or_default() += 1;
        }
        if page.up_to_date || page.events.is_empty() {
            break;
        }
        from = EventFrom::After(page.next_offset);
    }
    let ev = |id: &str, k: EventKind| events.get(&(id.to_string(), k)).copied().unwrap_or(0);

    let calls = calls.lock().unwrap().clone();
    let submits = submits.lock().unwrap().clone();
    let mut not_succeeded = Vec::new();
    let mut wrong_result = Vec::new();
    let mut errored = Vec::new();
    let mut executed_not_once = Vec::new();
    let mut events_wrong = Vec::new();
    let mut first_ok_not_created = Vec::new();
    let mut submit_retried = 0;
    for id in &ids {
        let s = store.get(id).await.unwrap().unwrap();
        if s.status != CommandStatus::Succeeded {
            let (exec, checks) = calls.get(id).copied().unwrap_or((0, 0));
            not_succeeded.push((id.clone(), s.status, s.version, s.attempts, exec, checks, s.error.clone()));
        } else if s.result.as_ref().is_none_or(|r| *r != json!({ "id": id })) {
            wrong_result.push((id.clone(), s.result.as_ref().map(|r| r.get().to_string())));
        }
        if s.errors_count != 0 || s.attempts != 1 || s.error.is_some() {
            errored.push((id.clone(), s.attempts, s.errors_count, s.error.clone()));
        }
        let (exec, _checks) = calls.get(id).copied().unwrap_or((0, 0));
        if exec != 1 {
            executed_not_once.push((id.clone(), exec));
        }
        let (sub, suc, fail) = (ev(id, EventKind::Submitted), ev(id, EventKind::Succeeded), ev(id, EventKind::Failed));
        if (sub, suc, fail) != (1, 1, 0) {
            events_wrong.push((id.clone(), sub, suc, fail));
        }
        let (tries, created) = submits[id];
        if tries > 1 {
            submit_retried += 1;
        } else if !created {
            first_ok_not_created.push(id.clone());
        }
    }
    let counts = store.counts(&q).await.unwrap();
    // The queue's messages left (a command still RUNNING with no message left is never polled).
    let msgs = store.messages().stats(&q).await.unwrap();
    let stuck_poll = not_succeeded.iter().filter(|n| n.0.starts_with('c') && n.1 == CommandStatus::Running).count();
    let summary = format!(
        "{N} commands, {killed} connections killed, {submit_retried} submits retried after an error; counts {counts:?}; \
         queue messages left: length {}, pending {}, delayed {}; still RUNNING: {stuck_poll}; \
         not succeeded (id, status, version, attempts, execute calls, check_status calls, error): {} {:?}; wrong result: {}; attempts != 1 or errors: {} {:?}; execute not once: {} {:?}; \
         events (submitted, succeeded, failed) != (1, 1, 0): {} {:?}; first submit answered OK but not created: {} {:?}",
        msgs.length,
        msgs.pending,
        msgs.delayed,
        not_succeeded.len(),
        &not_succeeded[..not_succeeded.len().min(3)],
        wrong_result.len(),
        errored.len(),
        &errored[..errored.len().min(3)],
        executed_not_once.len(),
        &executed_not_once[..executed_not_once.len().min(3)],
        events_wrong.len(),
        &events_wrong[..events_wrong.len().min(3)],
        first_ok_not_created.len(),
        &first_ok_not_created[..first_ok_not_created.len().min(3)],
    );
    eprintln!("{summary}");
    assert!(
        not_succeeded.is_empty()
            && wrong_result.is_empty()
            && errored.is_empty()
            && executed_not_once.is_empty()
            && events_wrong.is_empty()
            && first_ok_not_created.is_empty(),
        "{summary}"
    );
}
