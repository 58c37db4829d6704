//! Commands run to completion on Redis Cluster while every node's client connections are killed
//! again and again (`CLIENT KILL TYPE normal` every 5 ms): the redis crate's Cluster connection
//! re-sends a command whose connection was killed after it ran (see
//! `baton-streams/tests/cluster_resends.rs`), so a write may be applied and then applied again,
//! its caller answered by the second copy.
//!
//! Submits are idempotent by id and every transition is a compare-and-set on the state's
//! version, so an unguarded re-sent copy finds its own write and answers "exists" / "conflict".
//! Each command is submitted (retried on an error, as a caller would) and run by a service whose
//! handlers count their calls; afterwards each command must have succeeded with its handler's
//! result, its `execute` called exactly once, one `succeeded` event in the feed and no failure;
//! a first submit answered OK must say "created".
//!
//! Found here before the store's batched writes were guarded on Cluster (`baton_redis::resend`):
//! some polled commands stayed RUNNING for good. `execute` returns `running()`; the SUBMITTED ->
//! RUNNING write was applied, its connection killed, and the re-sent copy answered `conflict`
//! with the write itself as the current state; `write_retrying` takes a conflict with its own
//! write as done only after a retry of its own, so `apply` saw RUNNING where it expected
//! SUBMITTED, logged "outcome refused: the command moved on" and acked the message, leaving
//! nothing to call `check_status`. Now the copy gets the first copy's reply.
//!
//! Found here too: now and then the service's consumer stopped taking work under the storm (71,
//! 96, 368 of 400 commands still SUBMITTED 30 s after it, their messages in the queue, no handler
//! call). The consumer's Cluster connection had lost every node connection in a slot refresh and
//! the redis crate (1.8) never made one again: every read, reclaim and heartbeat failed at once
//! with "No connections found" for good (the lease thread's loop kept going, retrying). `ClusterConn`
//! now replaces such a connection as it does a wedged one (`baton-redis/tests/cluster_conn_break.rs`,
//! `every_connection_answers_after_a_client_kill_storm`). The same state failed submits 200 times
//! in a row.
//!
//! Remote workers (second test): a settle whose result was written must be answered `Applied`.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_commands::{Command, CommandResult, CommandService, CommandStatus, EventFrom, EventKind, QueueSettings};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

const N: usize = 400;
/// Commands of the remote-worker test.
const N_REMOTE: usize = 3000;

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
                let mut last = None;
                loop {
                    tries += 1;
                    assert!(tries < 200, "{id}: no submit answered OK; the last error: {last:?}");
                    match store.submit_created(&q, Command::with_id(id.clone(), ty, json!({ "i": i }))).await {
                        Ok((_, created)) => {
                            submits.lock().unwrap().insert(id, (tries, created));
                            break;
                        }
                        Err(e) => {
                            last = Some(e);
                            tokio::time::sleep(Duration::from_millis(10)).await
                        }
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
        // Right after the storm a call may still meet a connection being re-made: ask again.
        let ended = store.counts(&q).await.is_ok_and(|c| c.succeeded + c.failed + c.cancelled >= N as u64);
        if ended || tokio::time::Instant::now() > until {
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

/// How a remote worker's settle was answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Answer {
    Applied,
    Finished,
    LeaseLost,
    Error,
}

/// Remote workers (`RemoteWorkers`) claim and settle N_REMOTE commands under the storm; a settle that
/// fails with a store error is sent again (as a worker would), one answered `LeaseLost` or
/// `Finished` is given up. Each command must end SUCCEEDED with the result of the worker whose
/// settle was answered `Applied`, and no settle whose result was written may be answered
/// otherwise.
///
/// Before the re-send guard on the store's batched writes (`baton_redis::resend`): a terminal
/// settle was written and its delivery acked in one script run; the re-sent copy's owner check
/// then answered `lost`, and the worker was told its lease was lost and nothing written (78, 36,
/// 79 of 3,000 settles in 3 runs, all on the worker's first send; 28 when checked again with the
/// guard switched off). Now the copy gets the first run's reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_settles_under_a_kill_storm_are_answered_as_written() {
    baton_testkit::require_redis();
    let cluster = baton_testkit::RedisCluster::start();
    let urls = cluster.urls();
    let b = TestBackend::Cluster(cluster);
    let store = store_for(&b).await;
    let q = queue_name("remote-resends");
    let ids: Vec<String> = (0..N_REMOTE).map(|i| format!("r{i}-{q}")).collect();
    for chunk in ids.chunks(500) {
        let batch = chunk.iter().map(|id| Command::with_id(id.clone(), "t", json!(1))).collect();
        assert!(store.submit_many(&q, batch).await.iter().all(|r| r.is_ok()));
    }
    let workers = Arc::new(baton_commands::RemoteWorkers::new(store.clone(), &q, fast()).unwrap());
    let storm = baton_testkit::KillStorm::start(urls, Duration::from_millis(5)).await;
    // Per id: (worker, call, final answer of its settle, settles sent).
    #[allow(clippy::type_complexity)]
    let settles: Arc<Mutex<HashMap<String, Vec<(String, baton_commands::RemoteCall, Answer, u32)>>>> = Arc::default();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for w in 0..4 {
        let (workers, settles, done) = (workers.clone(), settles.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let name = format!("w{w}");
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let Ok(claims) = workers.claim(&name, 8, Duration::from_millis(200)).await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                for c in claims {
                    let outcome = baton_commands::RemoteOutcome::Result(CommandResult::succeeded(
                        json!({ "id": c.command.id, "by": name }),
                    ));
                    let mut answer = Answer::Error;
                    let mut sent = 0;
                    for _ in 0..20 {
                        sent += 1;
                        match workers.settle(&name, &c.lease, outcome.clone()).await {
                            Ok(baton_commands::RemoteSettled::Applied(_)) => answer = Answer::Applied,
                            Ok(baton_commands::RemoteSettled::Finished(_)) => answer = Answer::Finished,
                            Err(baton_commands::CommandError::Queue(baton_queue::QueueError::LeaseLost(_))) => {
                                answer = Answer::LeaseLost
                            }
                            Err(_) => {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                                continue;
                            }
                        }
                        break;
                    }
                    settles.lock().unwrap().entry(c.command.id.clone()).or_default().push((
                        name.clone(),
                        c.call,
                        answer,
                        sent,
                    ));
                }
            }
        }));
    }
    let until = tokio::time::Instant::now() + Duration::from_secs(6);
    while tokio::time::Instant::now() < until {
        match store.counts(&q).await {
            Ok(c) if c.succeeded + c.failed + c.cancelled >= N_REMOTE as u64 => break,
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let killed = storm.stop().await;
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        // Right after the storm a call may still meet a connection being re-made: ask again.
        let ended = store.counts(&q).await.is_ok_and(|c| c.succeeded + c.failed + c.cancelled >= N_REMOTE as u64);
        if ended || tokio::time::Instant::now() > until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let settles = settles.lock().unwrap().clone();
    let mut answers: HashMap<Answer, usize> = HashMap::new();
    let mut not_succeeded = Vec::new();
    // Settles whose result was written but that were answered otherwise.
    let mut written_but_refused = Vec::new();
    let mut executed_not_once = Vec::new();
    for id in &ids {
        let list = settles.get(id).cloned().unwrap_or_default();
        for (_, _, a, _) in &list {
            *answers.entry(*a).or_default() += 1;
        }
        let execs = list.iter().filter(|(_, call, _, _)| *call == baton_commands::RemoteCall::Execute).count();
        if execs != 1 {
            executed_not_once.push((id.clone(), list.clone()));
        }
        let s = store.get(id).await.unwrap().unwrap();
        if s.status != CommandStatus::Succeeded {
            not_succeeded.push((id.clone(), s.status, list.clone()));
            continue;
        }
        let by: serde_json::Value = serde_json::from_str(s.result.as_ref().unwrap().get()).unwrap();
        let by = by["by"].as_str().unwrap().to_string();
        if let Some((w, _, a, sent)) = list.iter().find(|(w, _, _, _)| *w == by) {
            if *a != Answer::Applied {
                written_but_refused.push((id.clone(), w.clone(), *a, *sent));
            }
        }
    }
    let first_send = written_but_refused.iter().filter(|r| r.3 == 1).count();
    let summary = format!(
        "{N_REMOTE} commands, 4 remote workers, {killed} connections killed; settle answers {answers:?}; not succeeded: {} \
         {:?}; result written but its settle answered otherwise: {} (of them on the worker's first send: \
         {first_send}) {:?}; claimed for execute not once: {} {:?}",
        not_succeeded.len(),
        &not_succeeded[..not_succeeded.len().min(3)],
        written_but_refused.len(),
        &written_but_refused[..written_but_refused.len().min(3)],
        executed_not_once.len(),
        &executed_not_once[..executed_not_once.len().min(3)],
    );
    eprintln!("{summary}");
    assert!(not_succeeded.is_empty() && written_but_refused.is_empty() && executed_not_once.is_empty(), "{summary}");
}
