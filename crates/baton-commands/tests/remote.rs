//! Remote workers (`RemoteWorkers`): commands claimed, renewed and settled by request, under the
//! dispatch rules of an in-process service. Every backend.

use crate::common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_commands::{
    Command, CommandError, CommandResult, CommandService, CommandStatus, Progress, QueueSettings, RawJson, RemoteCall,
    RemoteOutcome, RemoteReport, RemoteSettled, RemoteWorkers,
};
use baton_queue::{LeaseState, QueueError};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    lifecycle,
    silent_worker_fails_over,
    shared_with_an_in_process_service,
    max_processing_time_bounds_a_renewing_worker,
    stopped_workers_leave_the_group,
    altered_lease_tokens_change_nothing,
    a_lost_signing_key_is_learnt_again,
    renewals_report_progress_and_details,
    a_lapsed_lease_back_to_the_same_worker_is_fenced,
    workers_are_listed_with_their_commands,
    a_remote_call_shows_in_the_state
);

/// A remote worker's call shows in its command's `execution` from its first renewal (one write;
/// later renewals without reports write nothing), with a `started` event; the outcome removes it.
async fn a_remote_call_shows_in_the_state(b: TestBackend) {
    use baton_commands::{EventFrom, EventKind, ExecutionCall};
    let store = store_for(&b).await;
    let q = queue_name("remote-execution");
    let w = RemoteWorkers::new(store.clone(), &q, fast()).unwrap();
    let a = store.submit(&q, Command::new("t", json!(1))).await.unwrap();
    let before = baton_commands::Timestamp::now().millis();
    let c = w.claim("w1", 1, Duration::from_secs(3)).await.unwrap();
    assert_eq!(store.get(&a.id).await.unwrap().unwrap().execution, None, "a claim alone writes nothing");
    w.renew("w1", &[c[0].lease.clone()]).await.unwrap();
    let st = store.get(&a.id).await.unwrap().unwrap();
    let e = st.execution.clone().expect("shown after the first renewal");
    assert_eq!((e.worker.as_str(), e.call, e.deliveries, st.version), ("remote-w1", ExecutionCall::Execute, 1, 2));
    assert!(e.since.millis() >= before && e.since.millis() <= baton_commands::Timestamp::now().millis());
    assert_eq!(e.deadline.millis() - e.since.millis(), fast().max_processing_time.as_millis() as u64);
    w.renew("w1", &[c[0].lease.clone()]).await.unwrap();
    assert_eq!(store.get(&a.id).await.unwrap().unwrap().version, 2, "shown once");
    let s = w.settle("w1", &c[0].lease, RemoteOutcome::Result(CommandResult::succeeded(json!("ok")))).await.unwrap();
    let RemoteSettled::Applied(done) = s else { panic!("{s:?}") };
    assert_eq!((done.execution, done.version), (None, 3));
    let kinds: Vec<EventKind> =
        store.command_events(&a.id, EventFrom::Start, 10).await.unwrap().events.iter().map(|e| e.event).collect();
    assert_eq!(kinds, [EventKind::Submitted, EventKind::Started, EventKind::Succeeded]);
}

/// `CommandStore::workers`: each worker of a queue with the commands it holds; one silent past
/// its claim timeout is listed dead.
async fn workers_are_listed_with_their_commands(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("remote-workers");
    let w = RemoteWorkers::new(store.clone(), &q, fast()).unwrap();
    let a = store.submit(&q, Command::with_id(format!("{q}-a"), "t", json!(1))).await.unwrap();
    let b2 = store.submit(&q, Command::with_id(format!("{q}-b"), "t", json!(2))).await.unwrap();
    let held = w.claim("holder", 1, Duration::from_millis(10)).await.unwrap();
    assert_eq!(held[0].command.id, a.id);
    assert_eq!(w.claim("other", 1, Duration::from_millis(10)).await.unwrap()[0].command.id, b2.id);
    let listed = store.workers(&q).await.unwrap();
    let short: Vec<_> = listed.iter().map(|x| (x.name.as_str(), x.alive, x.leases, x.commands.clone())).collect();
    assert_eq!(short, [("remote-holder", true, 1, vec![a.id.clone()]), ("remote-other", true, 1, vec![b2.id.clone()])]);
    assert_eq!(listed[0].claim_timeout_ms, Some(2000));
    assert!(listed[0].last_heartbeat.is_some());
    let json = serde_json::to_value(&listed[0]).unwrap();
    assert_eq!(json["commands"], json!([a.id]));
    // `holder` renews; `other` is silent past the claim timeout (2 s).
    let t = std::time::Instant::now();
    while t.elapsed() < Duration::from_millis(2600) {
        w.renew("holder", &[held[0].lease.clone()]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let alive: Vec<_> = store.workers(&q).await.unwrap().iter().map(|x| (x.name.clone(), x.alive)).collect();
    assert_eq!(alive, [("remote-holder".to_string(), true), ("remote-other".to_string(), false)]);
    let stats = store.messages().stats(&q).await.unwrap();
    assert_eq!((stats.consumers, stats.dead_consumers), (1, 1));
}

fn lost(r: Result<RemoteSettled, CommandError>) -> bool {
    matches!(r, Err(CommandError::Queue(QueueError::LeaseLost(_))))
}

async fn lifecycle(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("remote");
    let w = RemoteWorkers::new(store.clone(), &q, fast()).unwrap();
    let a = store.submit(&q, Command::new("t", json!({"n": 1}))).await.unwrap();
    let bb = store.submit(&q, Command::new("t", json!({"n": 2}))).await.unwrap();
    let claims = w.claim("w1", 10, Duration::from_millis(500)).await.unwrap();
    let ids: HashSet<_> = claims.iter().map(|c| c.command.id.clone()).collect();
    assert_eq!(ids, HashSet::from([a.id.clone(), bb.id.clone()]));
    assert!(claims.iter().all(|c| c.call == RemoteCall::Execute && c.deliveries == 1));
    let ca = claims.iter().find(|c| c.command.id == a.id).unwrap().clone();
    let cb = claims.iter().find(|c| c.command.id == bb.id).unwrap().clone();
    let r = w.renew("w1", &[ca.lease.clone(), cb.lease.clone(), "junk".into()]).await.unwrap();
    assert_eq!(
        r.iter().map(|x| x.state).collect::<Vec<_>>(),
        vec![LeaseState::Held, LeaseState::Held, LeaseState::Gone]
    );
    assert!(r.iter().all(|x| !x.finished));
    // Another worker cannot settle what w1 holds.
    assert!(lost(w.settle("w2", &ca.lease, RemoteOutcome::Result(CommandResult::succeeded(json!(0)))).await));

    let done =
        w.settle("w1", &ca.lease, RemoteOutcome::Result(CommandResult::succeeded(json!({"ok": 1})))).await.unwrap();
    let RemoteSettled::Applied(st) = done else { panic!("{done:?}") };
    assert_eq!(st.status, CommandStatus::Succeeded);
    assert_eq!(st.result.as_ref().map(|r| r.get()), Some(r#"{"ok":1}"#));
    assert!(st.started_at.is_some());
    // Settled: the lease is gone, a second settlement is refused.
    assert!(lost(w.settle("w1", &ca.lease, RemoteOutcome::Result(CommandResult::failed("late"))).await));
    assert_eq!(store.get(&a.id).await.unwrap().unwrap().status, CommandStatus::Succeeded);

    // running → redelivered after its delay as a check_status call.
    let run = w
        .settle("w1", &cb.lease, RemoteOutcome::Result(CommandResult::running_after(Duration::from_millis(100))))
        .await
        .unwrap();
    assert!(matches!(run, RemoteSettled::Applied(ref s) if s.status == CommandStatus::Running), "{run:?}");
    let again = w.claim("w1", 10, Duration::from_secs(3)).await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].command.id.as_str(), again[0].call), (bb.id.as_str(), RemoteCall::CheckStatus));
    w.settle("w1", &again[0].lease, RemoteOutcome::Result(CommandResult::succeeded(json!(2)))).await.unwrap();
    assert_eq!(store.get(&bb.id).await.unwrap().unwrap().status, CommandStatus::Succeeded);

    // An error is retried with backoff (fast(): 3 attempts), then the command fails.
    let e = store.submit(&q, Command::new("t", json!({"n": 3}))).await.unwrap();
    for attempt in 1..=3u32 {
        let c = w.claim("w1", 1, Duration::from_secs(3)).await.unwrap();
        assert_eq!(c.len(), 1, "attempt {attempt}");
        assert_eq!(c[0].command.id, e.id);
        assert_eq!(c[0].call, RemoteCall::Execute);
        w.settle("w1", &c[0].lease, RemoteOutcome::Error(format!("boom {attempt}"))).await.unwrap();
    }
    let st = store.get(&e.id).await.unwrap().unwrap();
    assert_eq!((st.status, st.error.as_deref()), (CommandStatus::Failed, Some("boom 3")));

    // A cancel reaches the worker on its next renewal; its result is then not written.
    let k = store.submit(&q, Command::new("t", json!({"n": 4}))).await.unwrap();
    let c = w.claim("w1", 1, Duration::from_secs(3)).await.unwrap();
    assert_eq!(c[0].command.id, k.id);
    store.cancel(&k.id).await.unwrap();
    let r = w.renew("w1", std::slice::from_ref(&c[0].lease)).await.unwrap();
    assert!(r[0].finished, "{r:?}");
    let s = w.settle("w1", &c[0].lease, RemoteOutcome::Result(CommandResult::succeeded(json!(4)))).await.unwrap();
    assert!(matches!(s, RemoteSettled::Finished(Some(ref st)) if st.status == CommandStatus::Cancelled), "{s:?}");
    // Settled through another process (which never saw the claim: it reads the state) and a
    // cancel between a claim and its settle there too.
    let other = RemoteWorkers::new(other_store(&b, &store).await, &q, fast()).unwrap();
    let m = store.submit(&q, Command::new("t", json!({"n": 6}))).await.unwrap();
    let n = store.submit(&q, Command::new("t", json!({"n": 7}))).await.unwrap();
    let c = w.claim("w1", 2, Duration::from_secs(3)).await.unwrap();
    assert_eq!(c.len(), 2);
    let lease_of = |id: &str| c.iter().find(|x| x.command.id == id).unwrap().lease.clone();
    let s = other.settle("w1", &lease_of(&m.id), RemoteOutcome::Result(CommandResult::succeeded(json!(6)))).await;
    assert!(matches!(s, Ok(RemoteSettled::Applied(ref st)) if st.status == CommandStatus::Succeeded), "{s:?}");
    store.cancel(&n.id).await.unwrap();
    let s = other.settle("w1", &lease_of(&n.id), RemoteOutcome::Result(CommandResult::succeeded(json!(7)))).await;
    assert!(matches!(s, Ok(RemoteSettled::Finished(Some(ref st))) if st.status == CommandStatus::Cancelled), "{s:?}");
    // Settled, also for the process that claimed them.
    assert!(lost(w.settle("w1", &lease_of(&m.id), RemoteOutcome::Result(CommandResult::failed("late"))).await));
    assert_eq!(store.get(&m.id).await.unwrap().unwrap().status, CommandStatus::Succeeded);

    // Released: back to the queue, delivered again after the claim timeout.
    let r2 = store.submit(&q, Command::new("t", json!({"n": 5}))).await.unwrap();
    let c = w.claim("w1", 1, Duration::from_secs(3)).await.unwrap();
    assert_eq!(c[0].command.id, r2.id);
    w.settle("w1", &c[0].lease, RemoteOutcome::Release).await.unwrap();
    let c2 = w.claim("w2", 1, Duration::from_secs(5)).await.unwrap();
    assert_eq!((c2[0].command.id.as_str(), c2[0].deliveries), (r2.id.as_str(), 2));
}

async fn silent_worker_fails_over(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("remote-failover");
    let w = RemoteWorkers::new(store.clone(), &q, fast()).unwrap();
    let cmd = store.submit(&q, Command::new("t", json!({}))).await.unwrap();
    let c1 = w.claim("silent", 1, Duration::from_secs(1)).await.unwrap();
    assert_eq!(c1[0].command.id, cmd.id);
    // `silent` never renews: after the claim timeout (2 s) another worker gets the command.
    let t = std::time::Instant::now();
    let c2 = w.claim("alive", 1, Duration::from_secs(6)).await.unwrap();
    assert_eq!(c2.len(), 1);
    assert_eq!((c2[0].command.id.as_str(), c2[0].deliveries), (cmd.id.as_str(), 2));
    assert!(t.elapsed() >= Duration::from_millis(1500), "taken over after {:?}", t.elapsed());
    assert!(lost(
        w.settle("silent", &c1[0].lease, RemoteOutcome::Result(CommandResult::succeeded(json!("silent")))).await
    ));
    w.settle("alive", &c2[0].lease, RemoteOutcome::Result(CommandResult::succeeded(json!("alive")))).await.unwrap();
    let st = store.get(&cmd.id).await.unwrap().unwrap();
    assert_eq!(st.result.as_ref().map(|r| r.get()), Some(r#""alive""#));
}

async fn shared_with_an_in_process_service(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("remote-shared");
    let ran: Arc<Mutex<Vec<(String, &'static str)>>> = Arc::default();
    let ran2 = ran.clone();
    let svc = CommandService::builder(store.clone(), q.clone())
        .settings(QueueSettings { concurrency: 2, ..fast() })
        .handler(
            "t",
            on_execute(move |c: Command| {
                let ran = ran2.clone();
                async move {
                    ran.lock().unwrap().push((c.id.clone(), "rust"));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Ok(CommandResult::succeeded(json!("rust")))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let w = Arc::new(RemoteWorkers::new(store.clone(), &q, fast()).unwrap());
    let mut ids = Vec::new();
    for i in 0..40 {
        ids.push(store.submit(&q, Command::new("t", json!({"i": i}))).await.unwrap().id);
    }
    let remote = tokio::spawn({
        let (w, ran) = (w.clone(), ran.clone());
        async move {
            for _ in 0..60 {
                for c in w.claim("ts", 4, Duration::from_millis(100)).await.unwrap() {
                    ran.lock().unwrap().push((c.command.id.clone(), "remote"));
                    w.settle("ts", &c.lease, RemoteOutcome::Result(CommandResult::succeeded(json!("remote"))))
                        .await
                        .unwrap();
                }
            }
        }
    });
    for id in &ids {
        let st = store.wait(id, Duration::from_secs(10)).await.unwrap();
        assert_eq!(st.status, CommandStatus::Succeeded, "{id}");
    }
    remote.abort();
    svc.close().await;
    let ran = ran.lock().unwrap().clone();
    let once: HashSet<_> = ran.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!((once.len(), ran.len()), (40, 40), "each command ran exactly once: {ran:?}");
    assert!(ran.iter().any(|(_, by)| *by == "remote"), "the remote worker took some");
}

/// A worker that renews faithfully but never finishes is bounded by `max_processing_time`, as an
/// in-process handler is: the renewal past it says `Lost`, its settlement is refused, and another
/// worker gets the command after the claim timeout.
async fn max_processing_time_bounds_a_renewing_worker(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("remote-hung");
    let settings = QueueSettings { max_processing_time: Duration::from_millis(1500), ..fast() };
    let w = RemoteWorkers::new(store.clone(), &q, settings).unwrap();
    let cmd = store.submit(&q, Command::new("t", json!({}))).await.unwrap();
    let c1 = w.claim("hung", 1, Duration::from_secs(1)).await.unwrap();
    assert_eq!(c1[0].command.id, cmd.id);
    // Renewed at a third of the claim timeout: held until max_processing_time, then lost.
    let t = std::time::Instant::now();
    let mut states = Vec::new();
    while t.elapsed() < Duration::from_millis(2200) {
        let r = w.renew("hung", &[c1[0].lease.clone()]).await.unwrap();
        states.push((t.elapsed(), r[0].state));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    for (at, state) in &states {
        let expect = if *at < Duration::from_millis(1400) {
            LeaseState::Held
        } else if *at > Duration::from_millis(1600) {
            LeaseState::Lost
        } else {
            *state
        };
        assert_eq!(*state, expect, "at {at:?}: {states:?}");
    }
    assert!(lost(w.settle("hung", &c1[0].lease, RemoteOutcome::Result(CommandResult::succeeded(json!("late")))).await));
    let c2 = w.claim("other", 1, Duration::from_secs(6)).await.unwrap();
    assert_eq!((c2[0].command.id.as_str(), c2[0].deliveries), (cmd.id.as_str(), 2));
    w.settle("other", &c2[0].lease, RemoteOutcome::Result(CommandResult::succeeded(json!("other")))).await.unwrap();
    let st = store.get(&cmd.id).await.unwrap().unwrap();
    assert_eq!((st.status, st.result.as_ref().map(|r| r.get())), (CommandStatus::Succeeded, Some(r#""other""#)));
}

/// Each worker name is a member of the queue's group; workers that stopped (a restarted SDK
/// worker takes a new name) are removed after `reap_idle_consumers_after` by the claims of the
/// workers still running, so a queue served only by remote workers does not collect them.
async fn stopped_workers_leave_the_group(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("remote-reap");
    let settings = QueueSettings { reap_idle_consumers_after: Some(Duration::from_secs(4)), ..fast() };
    let w = RemoteWorkers::new(store.clone(), &q, settings).unwrap();
    for name in ["gone-1", "gone-2", "gone-3"] {
        assert!(w.claim(name, 1, Duration::ZERO).await.unwrap().is_empty());
    }
    // Group members, live or dead (not reaped yet).
    let members = || async { store.messages().stats(&q).await.map(|st| st.consumers + st.dead_consumers).unwrap() };
    assert_eq!(members().await, 3);
    // `alive` keeps claiming; the others are silent past the window.
    let t = std::time::Instant::now();
    while t.elapsed() < Duration::from_secs(9) {
        assert!(w.claim("alive", 1, Duration::from_millis(500)).await.unwrap().is_empty());
        if members().await == 1 {
            break;
        }
    }
    let left = t.elapsed();
    assert_eq!(members().await, 1, "only `alive` is left after {left:?}");
    assert!(left >= Duration::from_millis(3500), "not before the window: {left:?}");
}

/// A lease token is signed by the servers of the backend: one whose content was altered (another
/// command's id and token, a later claim time) or that is unsigned decodes as no lease at all —
/// refused on settle, `Gone` on renew — and changes nothing: neither the command it names nor the
/// worker's real delivery (which its real lease still settles). Before, the server acted on the
/// altered content: it settled a command another worker held and acked the real delivery, losing
/// its command.
async fn altered_lease_tokens_change_nothing(b: TestBackend) {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let store = store_for(&b).await;
    let q = queue_name("remote-forge");
    let w = RemoteWorkers::new(store.clone(), &q, fast()).unwrap();
    let a = store.submit(&q, Command::new("t", json!({"n": "a"}))).await.unwrap();
    let c1 = w.claim("w1", 1, Duration::from_secs(1)).await.unwrap();
    let victim = store.submit(&q, Command::new("t", json!({"n": "victim"}))).await.unwrap();
    let c2 = w.claim("w2", 1, Duration::from_secs(1)).await.unwrap();
    assert_eq!((c1[0].command.id.as_str(), c2[0].command.id.as_str()), (a.id.as_str(), victim.id.as_str()));
    let (body, sig) = c1[0].lease.split_once('.').expect("signed");
    let (vbody, _) = c2[0].lease.split_once('.').expect("signed");
    let mut t: serde_json::Value = serde_json::from_slice(&b64.decode(body).unwrap()).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&b64.decode(vbody).unwrap()).unwrap();
    // w1's own message, but the victim's command id and token; then a claim time in the future.
    t["i"] = v["i"].clone();
    t["t"] = v["t"].clone();
    let swapped = format!("{}.{sig}", b64.encode(serde_json::to_vec(&t).unwrap()));
    let mut later = serde_json::from_slice::<serde_json::Value>(&b64.decode(body).unwrap()).unwrap();
    later["s"] = json!(1_000_000_000_000_000u64);
    let future = format!("{}.{sig}", b64.encode(serde_json::to_vec(&later).unwrap()));
    let unsigned = body.to_string();
    for forged in [&swapped, &future, &unsigned] {
        let r = w.settle("w1", forged, RemoteOutcome::Result(CommandResult::succeeded(json!("forged")))).await;
        assert!(matches!(r, Err(CommandError::InvalidSettings(_))), "{r:?}");
        let renewed = w.renew("w1", std::slice::from_ref(forged)).await.unwrap();
        assert_eq!(renewed[0].state, LeaseState::Gone);
    }
    assert_eq!(store.get(&victim.id).await.unwrap().unwrap().status, CommandStatus::Submitted);
    // The real leases still hold and settle.
    for (worker, c, r) in [("w1", &c1[0], "a"), ("w2", &c2[0], "victim")] {
        let done = w.settle(worker, &c.lease, RemoteOutcome::Result(CommandResult::succeeded(json!(r)))).await.unwrap();
        let RemoteSettled::Applied(st) = done else { panic!("{done:?}") };
        assert_eq!(st.result.as_ref().map(|x| x.get().to_string()), Some(format!("\"{r}\"")));
    }
}

/// Redis lost its data (restart without persistence): the signing key is gone, and the next
/// process to start creates another. A process running since before learns it when a token does
/// not verify, so it accepts the new process's leases (before, it refused them as not its
/// server's, forever). Memory has one store per process: nothing to learn.
async fn a_lost_signing_key_is_learnt_again(b: TestBackend) {
    let url = match &b {
        TestBackend::Memory => return,
        TestBackend::Standalone(r) => r.url(),
        TestBackend::Cluster(c) => c.urls()[0].clone(),
    };
    let store = store_for(&b).await;
    let q = queue_name("remote-key");
    let old = RemoteWorkers::new(store.clone(), &q, fast()).unwrap();
    assert!(old.claim("w0", 1, Duration::ZERO).await.unwrap().is_empty(), "the old process read the key");
    let del = std::process::Command::new("redis-cli")
        .args(["-c", "-u", &url, "DEL", "baton:secret:remote-leases"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&del.stdout).trim(), "1", "{del:?}");
    let store2 = other_store(&b, &store).await;
    let new = RemoteWorkers::new(store2.clone(), &q, fast()).unwrap();
    let cmd = store.submit(&q, Command::new("t", json!({}))).await.unwrap();
    let c = new.claim("w1", 1, Duration::from_secs(2)).await.unwrap();
    assert_eq!(c[0].command.id, cmd.id);
    let r = old.renew("w1", std::slice::from_ref(&c[0].lease)).await.unwrap();
    assert_eq!(r[0].state, LeaseState::Held);
    let done = old.settle("w1", &c[0].lease, RemoteOutcome::Result(CommandResult::succeeded(json!(1)))).await.unwrap();
    assert!(matches!(done, RemoteSettled::Applied(_)), "{done:?}");
}

/// A renewal's report (progress, details) is written into the command's state while the lease
/// is held, kept by the settle (also when settled through another process), handed to the next
/// delivery after a takeover, and refused from a worker whose lease is gone or whose command
/// was cancelled.
async fn renewals_report_progress_and_details(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("remote-progress");
    let w = RemoteWorkers::new(store.clone(), &q, fast()).unwrap();
    let other = RemoteWorkers::new(other_store(&b, &store).await, &q, fast()).unwrap();
    let report = |fraction: f64, message: &str, details: &str| RemoteReport {
        progress: Some(Progress { fraction: Some(fraction), message: Some(message.into()) }),
        details: Some(RawJson::from_string(details.to_string()).unwrap()),
    };
    let one = |lease: &str, r: Option<RemoteReport>| vec![(lease.to_string(), r)];

    // Reported, then settled by the process that claimed it.
    let a = store.submit(&q, Command::new("t", json!({"n": 1}))).await.unwrap();
    let c = w.claim("w1", 1, Duration::from_secs(3)).await.unwrap();
    assert_eq!(c[0].command.id, a.id);
    let r = w.renew_reporting("w1", &one(&c[0].lease, Some(report(0.5, "half", r#"{"page": 3}"#)))).await.unwrap();
    assert_eq!((r[0].state, r[0].finished), (LeaseState::Held, false));
    let st = store.get(&a.id).await.unwrap().unwrap();
    assert_eq!((st.status, st.version), (CommandStatus::Submitted, 2));
    assert_eq!(st.progress, Some(Progress { fraction: Some(0.5), message: Some("half".into()) }));
    assert_eq!(st.details.as_ref().map(|d| d.get()), Some(r#"{"page": 3}"#));
    // Only details: the progress stays.
    let only = RemoteReport { progress: None, details: Some(RawJson::from_string("[4]".to_string()).unwrap()) };
    w.renew_reporting("w1", &one(&c[0].lease, Some(only))).await.unwrap();
    let s = w.settle("w1", &c[0].lease, RemoteOutcome::Result(CommandResult::succeeded(json!("ok")))).await.unwrap();
    let RemoteSettled::Applied(st) = s else { panic!("{s:?}") };
    assert_eq!((st.status, st.version), (CommandStatus::Succeeded, 4));
    assert_eq!(st.progress.as_ref().and_then(|p| p.message.as_deref()), Some("half"));
    assert_eq!(st.details.as_ref().map(|d| d.get()), Some("[4]"));
    assert_eq!(store.get(&a.id).await.unwrap().unwrap(), st);

    // Reported through one process, settled through another.
    let bb = store.submit(&q, Command::new("t", json!({"n": 2}))).await.unwrap();
    let c = w.claim("w1", 1, Duration::from_secs(3)).await.unwrap();
    other.renew_reporting("w1", &one(&c[0].lease, Some(report(0.2, "b", "1")))).await.unwrap();
    w.renew_reporting("w1", &one(&c[0].lease, Some(report(0.9, "b2", "2")))).await.unwrap();
    let s = other.settle("w1", &c[0].lease, RemoteOutcome::Result(CommandResult::succeeded(json!(2)))).await.unwrap();
    assert!(
        matches!(s, RemoteSettled::Applied(ref st) if st.status == CommandStatus::Succeeded && st.version == 4 && st.details.as_ref().map(|d| d.get()) == Some("2")),
        "{s:?}"
    );
    assert_eq!(store.get(&bb.id).await.unwrap().unwrap().id, bb.id);

    // A worker goes silent after a checkpoint: the next delivery carries it; the silent
    // worker's later report is refused and changes nothing.
    let k = store.submit(&q, Command::new("t", json!({"n": 3}))).await.unwrap();
    let c1 = w.claim("silent", 1, Duration::from_secs(3)).await.unwrap();
    w.renew_reporting("silent", &one(&c1[0].lease, Some(report(0.3, "at 3", r#"{"done": 3}"#)))).await.unwrap();
    let c2 = w.claim("alive", 1, Duration::from_secs(6)).await.unwrap();
    assert_eq!((c2[0].command.id.as_str(), c2[0].deliveries), (k.id.as_str(), 2));
    assert_eq!(c2[0].command.details.as_ref().map(|d| d.get()), Some(r#"{"done": 3}"#));
    let r = w.renew_reporting("silent", &one(&c1[0].lease, Some(report(0.9, "late", r#"{"done": 9}"#)))).await.unwrap();
    assert_eq!(r[0].state, LeaseState::Lost);
    let st = store.get(&k.id).await.unwrap().unwrap();
    assert_eq!((st.version, st.details.as_ref().map(|d| d.get())), (2, Some(r#"{"done": 3}"#)));

    // Cancelled: the report is not written, the renewal says finished.
    let r = w.renew_reporting("alive", &one(&c2[0].lease, Some(report(0.4, "x", "4")))).await.unwrap();
    assert_eq!((r[0].state, r[0].finished), (LeaseState::Held, false));
    store.cancel(&k.id).await.unwrap();
    let r = w.renew_reporting("alive", &one(&c2[0].lease, Some(report(0.5, "y", "5")))).await.unwrap();
    assert_eq!((r[0].state, r[0].finished), (LeaseState::Held, true));
    let st = store.get(&k.id).await.unwrap().unwrap();
    assert_eq!((st.status, st.details.as_ref().map(|d| d.get())), (CommandStatus::Cancelled, Some("4")));

    // Bad reports are refused whole, naming the item; nothing is renewed or written.
    let bad = RemoteReport { progress: Some(Progress { fraction: Some(1.5), message: None }), details: None };
    let e = w.renew_reporting("alive", &[(c2[0].lease.clone(), None), (c2[0].lease.clone(), Some(bad))]).await;
    assert!(matches!(e, Err(CommandError::InvalidParams(ref m)) if m.starts_with("leases[1]: ")), "{e:?}");
    let empty = RemoteReport { progress: Some(Progress { fraction: None, message: None }), details: None };
    assert!(w.renew_reporting("alive", &one(&c2[0].lease, Some(empty))).await.is_err());
    let big = RemoteReport {
        progress: None,
        details: Some(RawJson::from_string(format!("\"{}\"", "x".repeat(70_000))).unwrap()),
    };
    assert!(w.renew_reporting("alive", &one(&c2[0].lease, Some(big))).await.is_err());
}

/// A worker that lets its lease lapse and claims again gets the same command back, as the same
/// group member: the first lease is over (renewal lost, report, settle and hand-back refused and
/// without effect), the second one works.
async fn a_lapsed_lease_back_to_the_same_worker_is_fenced(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("remote-fence");
    let w = RemoteWorkers::new(store.clone(), &q, fast()).unwrap();
    let k = store.submit(&q, Command::new("t", json!({}))).await.unwrap();
    let c1 = w.claim("w", 1, Duration::from_secs(3)).await.unwrap();
    assert_eq!((c1[0].command.id.as_str(), c1[0].deliveries), (k.id.as_str(), 1));
    // Silent past the claim timeout (2 s), then claiming again: the same command, delivered again.
    let c2 = w.claim("w", 1, Duration::from_secs(8)).await.unwrap();
    assert_eq!((c2[0].command.id.as_str(), c2[0].deliveries), (k.id.as_str(), 2));
    assert_ne!(c1[0].lease, c2[0].lease);

    let r = w.renew("w", &[c1[0].lease.clone(), c2[0].lease.clone()]).await.unwrap();
    assert_eq!(r.iter().map(|x| x.state).collect::<Vec<_>>(), vec![LeaseState::Lost, LeaseState::Held]);
    let report = RemoteReport { progress: None, details: Some(RawJson::from_string("1".to_string()).unwrap()) };
    let r = w.renew_reporting("w", &[(c1[0].lease.clone(), Some(report))]).await.unwrap();
    assert_eq!(r[0].state, LeaseState::Lost);
    assert!(lost(w.settle("w", &c1[0].lease, RemoteOutcome::Result(CommandResult::succeeded(json!("stale")))).await));
    assert!(lost(w.settle("w", &c1[0].lease, RemoteOutcome::Release).await));
    w.hand_back("w", std::slice::from_ref(&c1[0].lease)).await.unwrap();
    let st = store.get(&k.id).await.unwrap().unwrap();
    // Version 2: the held lease's first renewal showed its call (`execution`, delivery 2);
    // nothing of the stale lease was written.
    assert_eq!((st.status, st.version, st.details.is_none()), (CommandStatus::Submitted, 2, true), "{st:?}");
    assert_eq!(st.execution.as_ref().map(|e| e.deliveries), Some(2));
    assert_eq!(w.renew("w", std::slice::from_ref(&c2[0].lease)).await.unwrap()[0].state, LeaseState::Held);

    let s = w.settle("w", &c2[0].lease, RemoteOutcome::Result(CommandResult::succeeded(json!("fresh")))).await;
    assert!(matches!(s, Ok(RemoteSettled::Applied(ref st)) if st.status == CommandStatus::Succeeded), "{s:?}");
    let st = store.get(&k.id).await.unwrap().unwrap();
    assert_eq!(st.result.as_ref().map(|r| r.get()), Some(r#""fresh""#));
    let stats = store.messages().stats(&q).await.unwrap();
    assert_eq!((stats.pending, stats.length), (0, 0));
}
