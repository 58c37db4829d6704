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
//!
//! The store's single writes, guarded on Cluster by a guard lent per call
//! (`baton_redis::resend::ResendPool`), under the same storm: re-runs of cancelled commands
//! (`transition.lua` with an enqueue), reschedules (`reschedule.lua`) and cron decisions
//! (`schedule_cas.lua`) are each answered as written and applied once.

use crate::common;

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

/// `q`'s feed events per command id and kind (after the storm: read until up to date).
async fn feed_events(store: &baton_commands::CommandStore, q: &str) -> HashMap<(String, EventKind), u32> {
    let mut events: HashMap<(String, EventKind), u32> = HashMap::new();
    let mut from = EventFrom::Start;
    loop {
        let page = store.events(q, from, 1000).await.unwrap();
        for e in &page.events {
            *events.entry((e.id.clone(), e.event)).or_default() += 1;
        }
        if page.up_to_date || page.events.is_empty() {
            break;
        }
        from = EventFrom::After(page.next_offset);
    }
    events
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

    let events = feed_events(&store, &q).await;
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

/// Prints what a storm test saw and fails it on any mismatch (the first three of the errors and
/// mismatches shown).
fn assert_no_mismatches(what: &str, killed: u64, ok: usize, errors: &[String], mismatches: &[String]) {
    let summary = format!(
        "{what}, {killed} connections killed; answered Ok: {ok}, errors: {} {:?}; mismatches: {} {:?}",
        errors.len(),
        &errors[..errors.len().min(3)],
        mismatches.len(),
        &mismatches[..mismatches.len().min(3)],
    );
    eprintln!("{summary}");
    assert!(mismatches.is_empty(), "{summary}");
}

/// Runs `call` once for every id, 8 at a time, while every node's client connections are killed
/// every 5 ms; returns each id's answer and the number of connections killed.
async fn under_a_storm<T, F, Fut>(urls: Vec<String>, ids: &[String], call: F) -> (HashMap<String, T>, u64)
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = T>,
{
    use futures::StreamExt;
    let storm = baton_testkit::KillStorm::start(urls, Duration::from_millis(5)).await;
    let answers: HashMap<String, T> = futures::stream::iter(ids.iter().cloned())
        .map(|id| {
            let f = call(id.clone());
            async move { (id, f.await) }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    let killed = storm.stop().await;
    // Right after the storm a call may still meet a connection being re-made.
    tokio::time::sleep(Duration::from_millis(500)).await;
    (answers, killed)
}

/// Commands of the retry and reschedule tests.
const N_SINGLE: usize = 600;

/// Re-runs (`CommandStore::retry`) of cancelled commands under the storm, one call per command:
/// a re-run is a single (not group-committed) transition that enqueues the new run's message.
/// Each call must be answered `Ok` with its re-run written once (one `rerun` event, the version
/// one past the cancel's), or fail with a Redis error (outcome unknown: at most one re-run);
/// never `NotRetryable`, as nothing else re-runs them.
///
/// Before the single transition was guarded on Cluster: the re-sent copy of an applied re-run
/// found its own write and answered "conflict", and the retry then saw the command SUBMITTED
/// and answered `NotRetryable` although its re-run was written and enqueued once (43, 10, 31 and
/// 48 of 600 in 4 runs with the guard switched off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_under_a_kill_storm_are_answered_as_written() {
    use futures::StreamExt;
    baton_testkit::require_redis();
    let cluster = baton_testkit::RedisCluster::start();
    let urls = cluster.urls();
    let b = TestBackend::Cluster(cluster);
    let store = store_for(&b).await;
    let q = queue_name("retry-resends");
    let ids: Vec<String> = (0..N_SINGLE).map(|i| format!("x{i}-{q}")).collect();
    for chunk in ids.chunks(300) {
        let batch = chunk.iter().map(|id| Command::with_id(id.clone(), "t", json!(1))).collect();
        assert!(store.submit_many(&q, batch).await.iter().all(|r| r.is_ok()));
    }
    // Cancelled before the storm (no service: they are still SUBMITTED): version per id.
    let cancelled: HashMap<String, u64> = futures::stream::iter(ids.iter().cloned())
        .map(|id| {
            let store = store.clone();
            async move {
                let st = store.cancel(&id).await.unwrap();
                assert_eq!(st.status, CommandStatus::Cancelled);
                (id, st.version)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;

    let (answers, killed) = under_a_storm(urls, &ids, |id| {
        let store = store.clone();
        async move { store.retry(&id).await }
    })
    .await;

    let events = feed_events(&store, &q).await;
    let mut ok = 0;
    let mut errors = Vec::new();
    let mut mismatches = Vec::new();
    for id in &ids {
        let reruns = events.get(&(id.clone(), EventKind::Rerun)).copied().unwrap_or(0);
        let st = store.get(id).await.unwrap().unwrap();
        let written = st.status == CommandStatus::Submitted && st.version == cancelled[id] + 1;
        match &answers[id] {
            Ok(r) => {
                ok += 1;
                if !(written && reruns == 1 && r.version == st.version && r.status == CommandStatus::Submitted) {
                    mismatches.push(format!(
                        "{id}: answered Ok, {reruns} rerun events, stored {} v{}",
                        st.status, st.version
                    ));
                }
            }
            Err(baton_commands::CommandError::Redis(e)) => {
                errors.push(e.to_string());
                let unwritten = st.status == CommandStatus::Cancelled && st.version == cancelled[id] && reruns == 0;
                if !(unwritten || (written && reruns == 1)) {
                    mismatches.push(format!(
                        "{id}: answered {e}, {reruns} rerun events, stored {} v{}",
                        st.status, st.version
                    ));
                }
            }
            Err(e) => mismatches
                .push(format!("{id}: answered {e}, {reruns} rerun events, stored {} v{}", st.status, st.version)),
        }
    }
    assert_no_mismatches(&format!("{N_SINGLE} retries"), killed, ok, &errors, &mismatches);
}

/// Reschedules (`CommandStore::reschedule`) of scheduled commands under the storm, one call per
/// command (a compare-and-set on the version that moves the message in the delayed set, with a
/// `rescheduled` event). A call answered `Ok` must have applied once (one event, the version one
/// past the submit's, the new due time); one that failed with a Redis error at most once.
///
/// Before the reschedule was guarded on Cluster: the re-sent copy of an applied reschedule found
/// the version moved on ("conflict"), and `reschedule` applied it again on the state it read
/// (two `rescheduled` events, version + 2; 23, 24, 8 and 12 of 600 in 4 runs with the guard
/// switched off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reschedules_under_a_kill_storm_apply_once() {
    baton_testkit::require_redis();
    let cluster = baton_testkit::RedisCluster::start();
    let urls = cluster.urls();
    let b = TestBackend::Cluster(cluster);
    let store = store_for(&b).await;
    let q = queue_name("reschedule-resends");
    let now = std::time::SystemTime::now();
    let (first, later) = (now + Duration::from_secs(3600), now + Duration::from_secs(7200));
    let ids: Vec<String> = (0..N_SINGLE).map(|i| format!("y{i}-{q}")).collect();
    let mut submitted: HashMap<String, u64> = HashMap::new();
    for chunk in ids.chunks(300) {
        let batch = chunk.iter().map(|id| Command::with_id(id.clone(), "t", json!(1)).with_run_at(first)).collect();
        for (id, r) in chunk.iter().zip(store.submit_many(&q, batch).await) {
            submitted.insert(id.clone(), r.unwrap().0.version);
        }
    }

    let (answers, killed) = under_a_storm(urls, &ids, |id| {
        let store = store.clone();
        async move { store.reschedule(&id, later).await }
    })
    .await;

    let later_ms = later.duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let events = feed_events(&store, &q).await;
    let mut ok = 0;
    let mut errors = Vec::new();
    let mut mismatches = Vec::new();
    for id in &ids {
        let n = events.get(&(id.clone(), EventKind::Rescheduled)).copied().unwrap_or(0);
        let st = store.get(id).await.unwrap().unwrap();
        let once = n == 1 && st.version == submitted[id] + 1 && st.run_at.map(|t| t.millis()) == Some(later_ms);
        match &answers[id] {
            Ok(r) => {
                ok += 1;
                if !(once && r.version == st.version) {
                    mismatches.push(format!(
                        "{id}: answered Ok v{}, {n} rescheduled events, stored v{}",
                        r.version, st.version
                    ));
                }
            }
            Err(baton_commands::CommandError::Redis(e)) => {
                errors.push(e.to_string());
                if !(once || (n == 0 && st.version == submitted[id])) {
                    mismatches.push(format!("{id}: answered {e}, {n} rescheduled events, stored v{}", st.version));
                }
            }
            Err(e) => mismatches.push(format!("{id}: answered {e}, {n} rescheduled events, stored v{}", st.version)),
        }
    }
    assert_no_mismatches(&format!("{N_SINGLE} reschedules"), killed, ok, &errors, &mismatches);
}

/// Cron schedule ticks (`CommandStore::schedule_tick`) under the storm, one per schedule: every
/// due time a tick decides is a compare-and-set of the schedule's record
/// (`scripts/schedule_cas.lua`), and this process reports each decision it won to its observer.
/// With one process ticking, every due time between the record's cursor before the tick and
/// after it must have been reported, exactly once, when the tick answered `Ok`.
///
/// Before the compare-and-set was guarded on Cluster: the re-sent copy of an applied
/// compare-and-set answered "not written", so the tick took its own decision for another
/// process's and reported nothing (27, 6, 28 and 19 of 300 schedules in 4 runs with the guard
/// switched off; with 150 schedules, as now, 64 and 21 in 2 runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedule_ticks_under_a_kill_storm_report_every_decision() {
    use baton_commands::schedules::{FireEvent, FireObserver, Schedule};
    baton_testkit::require_redis();
    let cluster = baton_testkit::RedisCluster::start();
    let urls = cluster.urls();
    let b = TestBackend::Cluster(cluster);
    let store = store_for(&b).await;
    let q = queue_name("cron-resends");
    let names: Vec<String> = (0..150).map(|i| format!("s{i}")).collect();
    let schedule = |name: &str| Schedule::new(name, "* * * * * *", "UTC", "t", json!({})).unwrap();
    // Each schedule's record made before the storm: its cursor is the backend's clock then.
    let mut cursor: HashMap<String, i64> = HashMap::new();
    for name in &names {
        store.schedule_tick(&q, &schedule(name), None).await.unwrap();
        cursor.insert(name.clone(), store.schedule_record(&q, name).await.unwrap().unwrap().cursor_ms);
    }
    // At least one due time (a whole second) passes for every schedule.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let seen: Arc<Mutex<Vec<FireEvent>>> = Arc::default();
    let observe: FireObserver = {
        let seen = seen.clone();
        Arc::new(move |e: &FireEvent| seen.lock().unwrap().push(e.clone()))
    };

    let (answers, killed) = under_a_storm(urls, &names, |name| {
        let (store, q, observe, s) = (store.clone(), q.clone(), observe.clone(), schedule(&name));
        async move { store.schedule_tick(&q, &s, Some(&observe)).await }
    })
    .await;

    let seen = seen.lock().unwrap().clone();
    let (mut ok, mut errors, mut mismatches) = (0, Vec::new(), Vec::new());
    for name in &names {
        if let Err(e) = &answers[name] {
            errors.push(e.to_string()); // Outcome unknown: not checked.
            continue;
        }
        ok += 1;
        let after = store.schedule_record(&q, name).await.unwrap().unwrap().cursor_ms;
        let decided = schedule(name).due_times(cursor[name], after, 1000);
        let mine: Vec<&FireEvent> = seen.iter().filter(|e| e.schedule == *name).collect();
        let reported: u64 = mine.iter().map(|e| e.count).sum();
        if decided.is_empty() || reported != decided.len() as u64 || mine.last().map(|e| e.due_ms) != Some(after) {
            mismatches.push(format!("{name}: {} due times decided, {reported} reported {:?}", decided.len(), mine));
        }
    }
    assert_no_mismatches(&format!("{} schedule ticks", names.len()), killed, ok, &errors, &mismatches);
}
