//! Hand-off between queues (issue 3): `lifecycle` (long claim timeout) → `monitor` (fast
//! `check_status`), on memory, Redis standalone and Redis Cluster; plus crashes inside it.

use crate::common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_commands::{Command, CommandResult, CommandService, CommandStatus, CommandStore, QueueSettings};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    handoff_runs_execute_once_and_completes_on_the_target,
    handoff_between_queues_of_one_slot,
    crash_between_enqueue_and_ack_does_not_execute_again,
    crash_between_state_write_and_enqueue_is_recovered,
    handoff_to_unknown_queue_or_itself_fails,
);

/// CRC16/XMODEM mod 16384: the Cluster slot of a hash tag.
fn slot(tag: &str) -> u16 {
    let mut crc: u16 = 0;
    for &b in tag.as_bytes() {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc % 16384
}

#[derive(Default)]
struct Calls {
    lifecycle_execute: AtomicU32,
    lifecycle_check: AtomicU32,
    monitor_execute: AtomicU32,
    monitor_check: AtomicU32,
}

fn lifecycle_settings(claim: Duration) -> QueueSettings {
    let mut s = fast();
    s.claim_timeout = claim;
    s.check_status_interval = Duration::from_secs(30);
    s
}

fn monitor_settings() -> QueueSettings {
    let mut s = fast();
    s.check_status_interval = Duration::from_millis(200);
    s
}

async fn start_pair(
    store: &CommandStore,
    lifecycle: &str,
    monitor: &str,
    ls: QueueSettings,
    calls: Arc<Calls>,
) -> (CommandService, CommandService) {
    let (c1, c2, c3, c4) = (calls.clone(), calls.clone(), calls.clone(), calls.clone());
    let target = monitor.to_string();
    let l = CommandService::builder(store.clone(), lifecycle)
        .settings(ls)
        .handler(
            "launch",
            on_execute(move |_c| {
                c1.lifecycle_execute.fetch_add(1, Ordering::SeqCst);
                let target = target.clone();
                async move { Ok(CommandResult::handed_off(target)) }
            })
            .on_check(move |_c, _s| {
                c2.lifecycle_check.fetch_add(1, Ordering::SeqCst);
                async { Ok(CommandResult::running()) }
            }),
        )
        .start()
        .await
        .unwrap();
    let m = CommandService::builder(store.clone(), monitor)
        .settings(monitor_settings())
        .handler(
            "launch",
            on_execute(move |_c| {
                c3.monitor_execute.fetch_add(1, Ordering::SeqCst);
                async { Ok(CommandResult::failed("execute must not run on the monitor queue")) }
            })
            .on_check(move |_c, st| {
                let n = c4.monitor_check.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    assert_eq!(st.status, CommandStatus::Running);
                    Ok(if n < 3 { CommandResult::running() } else { CommandResult::succeeded(json!({"checks": n})) })
                }
            }),
        )
        .start()
        .await
        .unwrap();
    (l, m)
}

async fn handoff_case(b: &TestBackend, lifecycle: String, monitor: String) {
    let store = store_for(b).await;
    let calls = Arc::new(Calls::default());
    let (l, m) =
        start_pair(&store, &lifecycle, &monitor, lifecycle_settings(Duration::from_secs(60)), calls.clone()).await;
    let id = l.submit(Command::new("launch", json!({"vm": "a"}))).await.unwrap().id;
    let running = eventually(Duration::from_secs(10), || {
        let store = store.clone();
        let id = id.clone();
        async move { store.get(&id).await.ok()?.filter(|s| s.status == CommandStatus::Running) }
    })
    .await
    .expect("RUNNING across the hand-off");
    assert_eq!(running.handed_off_to.as_deref(), Some(monitor.as_str()));
    assert_eq!(running.queue, lifecycle, "the home queue stays");
    assert!(running.started_at.is_some());
    let st = store.wait(&id, Duration::from_secs(15)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    assert_eq!(st.result, Some(json!({"checks": 3}).into()));
    // SUBMITTED(1) → RUNNING + hand-off (2) → SUCCEEDED (3).
    assert_eq!((st.version, st.attempts, st.errors_count), (3, 1, 0));
    assert_eq!(calls.lifecycle_execute.load(Ordering::SeqCst), 1);
    assert_eq!(calls.lifecycle_check.load(Ordering::SeqCst), 0);
    assert_eq!(calls.monitor_execute.load(Ordering::SeqCst), 0);
    assert_eq!(calls.monitor_check.load(Ordering::SeqCst), 3);
    let counts = store.counts(&lifecycle).await.unwrap();
    assert_eq!((counts.succeeded, counts.total()), (1, 1));
    assert_eq!(store.counts(&monitor).await.unwrap().total(), 0, "counted under its home queue");
    for q in [&lifecycle, &monitor] {
        let s = eventually(Duration::from_secs(5), || {
            let store = store.clone();
            async move { store.messages().stats(q).await.ok().filter(|s| s.length == 0 && s.pending == 0) }
        })
        .await;
        assert!(s.is_some(), "queue {q} drained");
    }
    l.close().await;
    m.close().await;
}

/// Queue names in different Cluster slots: the hand-off is state write, then enqueue, then ack.
async fn handoff_runs_execute_once_and_completes_on_the_target(b: TestBackend) {
    let (l, m) = loop {
        let (l, m) = (queue_name("lifecycle"), queue_name("monitor"));
        if slot(&l) != slot(&m) {
            break (l, m);
        }
    };
    handoff_case(&b, l, m).await;
}

/// Queue names in one Cluster slot: state write and enqueue are one script.
async fn handoff_between_queues_of_one_slot(b: TestBackend) {
    let l = queue_name("lifecycle");
    let m = (0..).map(|i| format!("monitor-{i}")).find(|m| slot(m) == slot(&l)).unwrap();
    handoff_case(&b, l, m).await;
}

async fn crash_case(b: &TestBackend, after_enqueue: bool) {
    let store = store_for(b).await;
    let calls = Arc::new(Calls::default());
    let (lifecycle, monitor) = (queue_name("lifecycle"), queue_name("monitor"));
    let mut ls = lifecycle_settings(Duration::from_secs(1));
    if after_enqueue {
        ls.fail_points.crash_after_handoff_enqueue = true;
    } else {
        ls.fail_points.crash_after_handoff_state = true;
    }
    let (l, m) = start_pair(&store, &lifecycle, &monitor, ls, calls.clone()).await;
    let id = l.submit(Command::new("launch", json!({}))).await.unwrap().id;
    let st = store.wait(&id, Duration::from_secs(20)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    assert_eq!(calls.lifecycle_execute.load(Ordering::SeqCst), 1, "execute ran once");
    assert_eq!(calls.lifecycle_check.load(Ordering::SeqCst), 0);
    assert_eq!(calls.monitor_execute.load(Ordering::SeqCst), 0);
    assert!(calls.monitor_check.load(Ordering::SeqCst) >= 3);
    assert_eq!(st.attempts, 1);
    // The replayed source message was acked, and a possible duplicate on the target too.
    for q in [&lifecycle, &monitor] {
        let s = eventually(Duration::from_secs(10), || {
            let store = store.clone();
            async move { store.messages().stats(q).await.ok().filter(|s| s.length == 0 && s.pending == 0) }
        })
        .await;
        assert!(s.is_some(), "queue {q} drained");
    }
    l.close().await;
    m.close().await;
}

async fn crash_between_enqueue_and_ack_does_not_execute_again(b: TestBackend) {
    crash_case(&b, true).await;
}

async fn crash_between_state_write_and_enqueue_is_recovered(b: TestBackend) {
    crash_case(&b, false).await;
}

async fn handoff_to_unknown_queue_or_itself_fails(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("lonely");
    let me = q.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler("to-nowhere", on_execute(|_c| async { Ok(CommandResult::handed_off("no-such-queue")) }))
        .handler(
            "to-self",
            on_execute(move |_c| {
                let me = me.clone();
                async move { Ok(CommandResult::handed_off(me)) }
            }),
        )
        .start()
        .await
        .unwrap();
    let a = svc.submit(Command::new("to-nowhere", json!({}))).await.unwrap().id;
    let b2 = svc.submit(Command::new("to-self", json!({}))).await.unwrap().id;
    let sa = store.wait(&a, Duration::from_secs(10)).await.unwrap();
    assert_eq!(sa.status, CommandStatus::Failed);
    assert_eq!(
        sa.error.as_deref(),
        Some("hand-off to unknown queue \"no-such-queue\": no command service or declared queue of that name")
    );
    let sb = store.wait(&b2, Duration::from_secs(10)).await.unwrap();
    assert_eq!(sb.status, CommandStatus::Failed);
    assert_eq!(sb.error, Some(format!("cannot hand off command to its own queue {q:?}")));
    assert_eq!(sb.handed_off_to, None);
    assert_eq!(store.messages().stats("no-such-queue").await.unwrap().length, 0);
    svc.close().await;
}
