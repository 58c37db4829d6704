//! The command-service conformance suite: every test runs on memory, Redis standalone and a
//! 3-master Redis Cluster (see `on_every_backend!`).

use crate::common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_commands::{
    validate_params, Command, CommandError, CommandResult, CommandService, CommandStatus, CommandStoreSettings,
    ListQuery, StatusCounts,
};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    fast_command_succeeds_and_cancel_after_completion_is_refused,
    failing_command_fails_with_its_error,
    cancel_right_after_submit_cancels_and_signals_the_handler,
    slow_command_runs_then_succeeds_through_check_status,
    error_once_then_success_clears_errors_count,
    always_erroring_command_fails_after_max_attempts,
    panicking_handler_is_retried_then_failed,
    unknown_type_fails_naming_the_type,
    submit_is_idempotent_and_conflicts_are_refused,
    malformed_params_are_rejected_before_anything_is_stored,
    listing_is_newest_first_with_cursor_pagination_and_exact_counts,
    listing_filters_by_type_id_prefix_and_creation_time,
    bulk_cancel_and_retry_by_filter,
    terminal_states_expire_after_retention,
    retention_is_set_per_queue,
    wait_wakes_on_writes_from_another_store,
    cancel_from_another_store_signals_the_running_handler,
    cancel_racing_completion_keeps_exactly_the_winner,
    wait_returns_the_running_state_at_timeout,
    submit_and_wait_wakes_on_a_write_from_another_store,
);

async fn fast_command_succeeds_and_cancel_after_completion_is_refused(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("fast");
    let runs = Arc::new(AtomicU32::new(0));
    let r2 = runs.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "echo",
            on_execute(move |c: Command| {
                r2.fetch_add(1, Ordering::SeqCst);
                async move { Ok(CommandResult::succeeded(json!({ "echo": c.params }))) }
            }),
        )
        .start()
        .await
        .unwrap();
    let submitted = svc.submit(Command::with_id("cmd-1", "echo", json!({"x": 1}))).await.unwrap();
    assert_eq!(submitted.status, CommandStatus::Submitted);
    assert_eq!(submitted.version, 1);
    let st = store.wait("cmd-1", Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    assert_eq!(st.result, Some(json!({"echo": {"x": 1}}).into()));
    assert_eq!(st.error, None);
    assert_eq!((st.version, st.attempts, st.errors_count), (2, 1, 0));
    assert_eq!(st.queue, q);
    assert!(st.completed_at.is_some());
    assert!(st.completed_at.unwrap() >= st.created_at);
    // Never RUNNING, but it ran: its start is the start of its `execute`.
    let started = st.started_at.expect("a command that ran has a start time");
    assert!(st.created_at <= started && started <= st.completed_at.unwrap());
    // The persisted JSON uses the documented names.
    let doc = serde_json::to_value(&st).unwrap();
    assert_eq!(doc["status"], "SUCCEEDED");
    assert_eq!(doc["type"], "echo");
    assert!(doc["completed_at"].as_str().unwrap().ends_with('Z'));

    match store.cancel("cmd-1").await {
        Err(CommandError::AlreadyTerminal(s)) => assert_eq!(s.status, CommandStatus::Succeeded),
        other => panic!("cancel after completion must be refused, got {other:?}"),
    }
    let after = store.get("cmd-1").await.unwrap().unwrap();
    assert_eq!(after, st, "the refused cancel changed nothing");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(store.counts(&q).await.unwrap(), StatusCounts { succeeded: 1, ..Default::default() });
    svc.close().await;
}

async fn failing_command_fails_with_its_error(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("fail");
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler("fail", on_execute(|_c| async { Ok(CommandResult::failed("disk full")) }))
        .start()
        .await
        .unwrap();
    let id = svc.submit(Command::new("fail", json!(null))).await.unwrap().id;
    let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Failed);
    assert_eq!(st.error.as_deref(), Some("disk full"));
    assert_eq!(st.result, None);
    assert_eq!((st.version, st.attempts, st.errors_count), (2, 1, 0));
    assert!(st.completed_at.is_some());
    assert_eq!(store.counts(&q).await.unwrap(), StatusCounts { failed: 1, ..Default::default() });
    svc.close().await;
}

async fn cancel_right_after_submit_cancels_and_signals_the_handler(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("cancel");
    let signalled = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let s2 = signalled.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "slow",
            on_execute(move |c: Command| {
                let (s2, started_tx) = (s2.clone(), started_tx.clone());
                async move {
                    let _ = started_tx.send(c.id.clone());
                    tokio::select! {
                        _ = c.cancelled() => s2.lock().unwrap().push(c.id.clone()),
                        _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                    }
                    // The late result must be refused.
                    Ok(CommandResult::succeeded(json!("late")))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let id = svc.submit(Command::new("slow", json!({}))).await.unwrap().id;
    let cancelled = store.cancel(&id).await.unwrap();
    assert_eq!(cancelled.status, CommandStatus::Cancelled);
    assert_eq!(cancelled.version, 2);
    let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Cancelled);
    assert!(st.completed_at.is_some());
    assert_eq!(st.result, None);

    // A second one: cancelled while its handler runs → the handler is signalled, result refused.
    let id2 = svc.submit(Command::new("slow", json!({}))).await.unwrap().id;
    loop {
        let started = tokio::time::timeout(Duration::from_secs(10), started_rx.recv()).await.unwrap().unwrap();
        if started == id2 {
            break;
        }
    }
    store.cancel(&id2).await.unwrap();
    eventually(Duration::from_secs(3), || {
        let s = signalled.clone();
        let id2 = id2.clone();
        async move { s.lock().unwrap().contains(&id2).then_some(()) }
    })
    .await
    .expect("the running handler received the cancellation signal");
    // Let the refused result be attempted (the message is acked), then check nothing changed.
    eventually(Duration::from_secs(3), || {
        let store = store.clone();
        let q = q.clone();
        async move { (store.messages().stats(&q).await.ok()?.length == 0).then_some(()) }
    })
    .await
    .expect("messages acked");
    let st2 = store.get(&id2).await.unwrap().unwrap();
    assert_eq!((st2.status, st2.version, st2.result.clone()), (CommandStatus::Cancelled, 2, None));
    assert_eq!(store.counts(&q).await.unwrap(), StatusCounts { cancelled: 2, ..Default::default() });
    svc.close().await;
}

async fn slow_command_runs_then_succeeds_through_check_status(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("slow");
    let execs = Arc::new(AtomicU32::new(0));
    let checks = Arc::new(AtomicU32::new(0));
    let (e2, c2) = (execs.clone(), checks.clone());
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "build",
            on_execute(move |_c| {
                e2.fetch_add(1, Ordering::SeqCst);
                async { Ok(CommandResult::running_after(Duration::from_millis(300))) }
            })
            .on_check(move |_c, st| {
                let n = c2.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    assert_eq!(st.status, CommandStatus::Running);
                    Ok(if n < 3 { CommandResult::running() } else { CommandResult::succeeded(json!({"checks": n})) })
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let id = svc.submit(Command::new("build", json!({}))).await.unwrap().id;
    let running = eventually(Duration::from_secs(10), || {
        let store = store.clone();
        let id = id.clone();
        async move { store.get(&id).await.ok()?.filter(|s| s.status == CommandStatus::Running) }
    })
    .await
    .expect("RUNNING is written");
    assert!(running.started_at.is_some());
    assert_eq!((running.version, running.attempts), (2, 1));
    assert_eq!(store.counts(&q).await.unwrap(), StatusCounts { running: 1, ..Default::default() });
    let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    assert_eq!(st.result, Some(json!({"checks": 3}).into()));
    assert_eq!(st.started_at, running.started_at);
    // Quiet polls write nothing: SUBMITTED(1) → RUNNING(2) → SUCCEEDED(3).
    assert_eq!((st.version, st.attempts), (3, 1));
    assert_eq!(execs.load(Ordering::SeqCst), 1);
    assert_eq!(checks.load(Ordering::SeqCst), 3);
    svc.close().await;
}

async fn error_once_then_success_clears_errors_count(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("flaky");
    let calls = Arc::new(AtomicU32::new(0));
    let seen = Arc::new(std::sync::Mutex::new(None));
    let (c2, seen2, store2) = (calls.clone(), seen.clone(), store.clone());
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "flaky",
            on_execute(move |c: Command| {
                let n = c2.fetch_add(1, Ordering::SeqCst) + 1;
                let (seen2, store2) = (seen2.clone(), store2.clone());
                async move {
                    if n == 1 {
                        return Err("connection reset".into());
                    }
                    *seen2.lock().unwrap() = store2.get(&c.id).await.unwrap();
                    Ok(CommandResult::succeeded(json!("ok")))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let id = svc.submit(Command::new("flaky", json!({}))).await.unwrap().id;
    let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    assert_eq!((st.errors_count, st.attempts, st.version), (0, 2, 3));
    assert_eq!(st.error, None);
    let mid = seen.lock().unwrap().clone().expect("state seen during the retry");
    assert_eq!((mid.status, mid.errors_count, mid.attempts), (CommandStatus::Submitted, 1, 1));
    assert_eq!(mid.error.as_deref(), Some("connection reset"));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    svc.close().await;
}

async fn always_erroring_command_fails_after_max_attempts(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("broken");
    let calls = Arc::new(AtomicU32::new(0));
    let c2 = calls.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast()) // max_attempts 3
        .handler(
            "broken",
            on_execute(move |_c| {
                let n = c2.fetch_add(1, Ordering::SeqCst) + 1;
                async move { Err(format!("broken #{n}").into()) }
            }),
        )
        .start()
        .await
        .unwrap();
    let id = svc.submit(Command::new("broken", json!({}))).await.unwrap().id;
    let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Failed);
    assert_eq!(st.error.as_deref(), Some("broken #3"), "the last error");
    assert_eq!((st.errors_count, st.attempts, st.version), (3, 3, 4));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(calls.load(Ordering::SeqCst), 3, "no call after FAILED");
    svc.close().await;
}

async fn panicking_handler_is_retried_then_failed(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("panic");
    let mut s = fast();
    s.retry.max_attempts = 2;
    let svc = CommandService::builder(store.clone(), &q)
        .settings(s)
        .handler(
            "panic",
            on_execute(|_c| async {
                if true {
                    panic!("kaboom");
                }
                Ok(CommandResult::running())
            }),
        )
        .start()
        .await
        .unwrap();
    let id = svc.submit(Command::new("panic", json!({}))).await.unwrap().id;
    let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Failed);
    assert_eq!(st.error.as_deref(), Some("handler panicked: kaboom"));
    assert_eq!((st.errors_count, st.attempts), (2, 2));
    svc.close().await;
}

async fn unknown_type_fails_naming_the_type(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("unknown");
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler("echo", on_execute(|_c| async { Ok(CommandResult::succeeded(json!(1))) }))
        .start()
        .await
        .unwrap();
    let id = svc.submit(Command::new("launch-rocket", json!({}))).await.unwrap().id;
    let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Failed);
    let err = st.error.unwrap();
    assert!(err.contains("\"launch-rocket\""), "{err}");
    assert_eq!(st.attempts, 0, "no execute ran");
    svc.close().await;
}

async fn submit_is_idempotent_and_conflicts_are_refused(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("idem");
    let runs = Arc::new(AtomicU32::new(0));
    let r2 = runs.clone();
    let first = store.submit(&q, Command::with_id("same", "echo", json!({"a": 1, "b": [1, 2]}))).await.unwrap();
    // Same id and body (keys in another order): the existing state, nothing new stored or enqueued.
    let again = store.submit(&q, Command::with_id("same", "echo", json!({"b": [1, 2], "a": 1}))).await.unwrap();
    assert_eq!(again, first);
    assert_eq!(store.messages().stats(&q).await.unwrap().length, 1);
    match store.submit(&q, Command::with_id("same", "echo", json!({"a": 2}))).await {
        Err(CommandError::Conflict { id, what }) => assert_eq!((id.as_str(), what), ("same", "type or params")),
        other => panic!("expected a conflict, got {other:?}"),
    }
    match store.submit(&q, Command::with_id("same", "other", json!({"a": 1, "b": [1, 2]}))).await {
        Err(CommandError::Conflict { what, .. }) => assert_eq!(what, "type or params"),
        other => panic!("expected a conflict, got {other:?}"),
    }
    let q2 = queue_name("idem-other");
    match store.submit(&q2, Command::with_id("same", "echo", json!({"a": 1, "b": [1, 2]}))).await {
        Err(CommandError::Conflict { what, .. }) => assert_eq!(what, "queue"),
        other => panic!("expected a queue conflict, got {other:?}"),
    }
    assert_eq!(store.messages().stats(&q2).await.unwrap().length, 0);
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "echo",
            on_execute(move |_c| {
                r2.fetch_add(1, Ordering::SeqCst);
                async { Ok(CommandResult::succeeded(json!("done"))) }
            }),
        )
        .start()
        .await
        .unwrap();
    let done = store.wait("same", Duration::from_secs(10)).await.unwrap();
    assert_eq!(done.status, CommandStatus::Succeeded);
    // Resubmitting a finished command returns its state and does not run it again.
    let again = store.submit(&q, Command::with_id("same", "echo", json!({"a": 1, "b": [1, 2]}))).await.unwrap();
    assert_eq!(again, done);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(store.counts(&q).await.unwrap().total(), 1);
    svc.close().await;
}

#[derive(serde::Deserialize)]
#[allow(dead_code)]
struct LaunchParams {
    region: String,
    count: u32,
}

async fn malformed_params_are_rejected_before_anything_is_stored(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("params");
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "launch",
            on_execute(|c: Command| async move {
                let p: LaunchParams = c.params_as()?;
                Ok(CommandResult::succeeded(json!(p.count)))
            })
            .validating(validate_params::<LaunchParams>),
        )
        .start()
        .await
        .unwrap();
    // Not JSON at all.
    match store.submit_json(&q, Some("bad-1".into()), "launch", b"{\"region\": ").await {
        Err(CommandError::InvalidParams(_)) => {}
        other => panic!("expected InvalidParams, got {other:?}"),
    }
    // JSON, but refused by the handler's typed validation.
    match store.submit(&q, Command::with_id("bad-2", "launch", json!({"region": "eu", "count": "three"}))).await {
        Err(CommandError::InvalidParams(m)) => assert!(m.contains("count") || m.contains("invalid type"), "{m}"),
        other => panic!("expected InvalidParams, got {other:?}"),
    }
    // Bad ids and types.
    assert!(matches!(
        store.submit(&q, Command::with_id("a b", "launch", json!({}))).await,
        Err(CommandError::InvalidId(_))
    ));
    assert!(matches!(
        store.submit(&q, Command::with_id("a{b}", "launch", json!({}))).await,
        Err(CommandError::InvalidId(_))
    ));
    assert!(matches!(store.submit(&q, Command::with_id("ok", "", json!({}))).await, Err(CommandError::InvalidType(_))));
    for id in ["bad-1", "bad-2"] {
        assert_eq!(store.get(id).await.unwrap(), None);
    }
    assert_eq!(store.counts(&q).await.unwrap(), StatusCounts::default());
    assert_eq!(store.list(&q, ListQuery::default()).await.unwrap().items.len(), 0);
    assert_eq!(store.messages().stats(&q).await.unwrap().length, 0);
    // Good params go through.
    let ok = store.submit_json(&q, Some("good".into()), "launch", br#"{"region":"eu","count":3}"#).await.unwrap();
    let st = store.wait(&ok.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((st.status, st.result), (CommandStatus::Succeeded, Some(json!(3).into())));
    svc.close().await;
}

async fn listing_filters_by_type_id_prefix_and_creation_time(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("search");
    let mut made = Vec::new();
    for (prefix, t) in [("a", "x"), ("b", "y")] {
        // The halves are created in distinct milliseconds.
        tokio::time::sleep(Duration::from_millis(5)).await;
        for i in 0..6 {
            made.push(store.submit(&q, Command::with_id(format!("{prefix}-{i}"), t, json!(i))).await.unwrap());
        }
    }
    store.cancel("a-1").await.unwrap();
    let newest_first = |pred: &dyn Fn(&baton_commands::CommandState) -> bool| {
        let mut v: Vec<(u64, String)> =
            made.iter().filter(|s| pred(s)).map(|s| (s.created_at.millis(), s.id.clone())).collect();
        v.sort();
        v.reverse();
        v.into_iter().map(|(_, id)| id).collect::<Vec<_>>()
    };
    let ids = |p: &baton_commands::CommandPage| p.items.iter().map(|s| s.id.clone()).collect::<Vec<_>>();
    let all = |query: ListQuery| {
        let store = store.clone();
        let q = q.clone();
        async move {
            let mut out = Vec::new();
            let mut query = query;
            loop {
                let page = store.list(&q, query.clone()).await.unwrap();
                out.extend(page.items.iter().map(|s| s.id.clone()));
                match page.next_cursor {
                    Some(c) => query.cursor = Some(c),
                    None => return out,
                }
            }
        }
    };
    let by_type = ListQuery { command_type: Some("y".into()), ..Default::default() };
    let page = store.list(&q, by_type.clone()).await.unwrap();
    assert_eq!((ids(&page), page.next_cursor), (newest_first(&|s| s.command_type == "y"), None));
    // Paged by 2: the same, in 3 pages.
    assert_eq!(all(ListQuery { limit: 2, ..by_type.clone() }).await, newest_first(&|s| s.command_type == "y"));
    let by_prefix = ListQuery { id_prefix: Some("a-".into()), ..Default::default() };
    assert_eq!(ids(&store.list(&q, by_prefix).await.unwrap()), newest_first(&|s| s.id.starts_with("a-")));
    let none = store
        .list(&q, ListQuery { command_type: Some("x".into()), id_prefix: Some("b-".into()), ..Default::default() })
        .await
        .unwrap();
    assert_eq!((none.items.len(), none.next_cursor), (0, None));
    let b0 = made.iter().find(|s| s.id == "b-0").unwrap().created_at;
    let after = store.list(&q, ListQuery { created_after: Some(b0), ..Default::default() }).await.unwrap();
    assert_eq!(ids(&after), newest_first(&|s| s.created_at >= b0));
    assert_eq!(ids(&after), newest_first(&|s| s.id.starts_with("b-")));
    let before = ListQuery { created_before: Some(b0), limit: 4, ..Default::default() };
    assert_eq!(all(before).await, newest_first(&|s| s.id.starts_with("a-")));
    let cancelled_x =
        ListQuery { status: Some(CommandStatus::Cancelled), command_type: Some("x".into()), ..Default::default() };
    assert_eq!(ids(&store.list(&q, cancelled_x).await.unwrap()), ["a-1"]);
    let empty_range = ListQuery { created_after: Some(b0), created_before: Some(b0), ..Default::default() };
    assert!(store.list(&q, empty_range).await.unwrap().items.is_empty());
}

async fn bulk_cancel_and_retry_by_filter(b: TestBackend) {
    use baton_commands::{BulkAction, BulkReport};
    let store = store_for(&b).await;
    let q = queue_name("bulk");
    for i in 0..6 {
        store.submit(&q, Command::with_id(format!("{q}-x{i}"), "x", json!(i))).await.unwrap();
    }
    store.submit(&q, Command::with_id(format!("{q}-y"), "y", json!(null))).await.unwrap();
    for i in 0..3 {
        store.cancel(&format!("{q}-x{i}")).await.unwrap();
    }
    let xs = || ListQuery { command_type: Some("x".into()), ..Default::default() };
    let report = |looked_at, eligible, applied, next: bool| (looked_at, eligible, applied, 0, next);
    let short = |r: BulkReport| (r.looked_at, r.eligible, r.applied, r.refused, r.next_cursor.is_some());
    // A dry run counts and changes nothing.
    let dry = store.bulk(&q, BulkAction::Retry, xs(), true, 0).await.unwrap();
    assert_eq!(short(dry), report(6, 3, 0, false));
    assert_eq!(store.counts(&q).await.unwrap(), StatusCounts { submitted: 4, cancelled: 3, ..Default::default() });
    // Cancel the SUBMITTED x's two at a time: a cursor to go on, then the last.
    let submitted_xs = ListQuery { status: Some(CommandStatus::Submitted), ..xs() };
    let first = store.bulk(&q, BulkAction::Cancel, submitted_xs.clone(), false, 2).await.unwrap();
    let cursor = first.next_cursor.clone();
    assert_eq!(short(first), report(2, 2, 2, true));
    let rest = store.bulk(&q, BulkAction::Cancel, ListQuery { cursor, ..submitted_xs }, false, 2).await.unwrap();
    assert_eq!(short(rest), report(1, 1, 1, false));
    assert_eq!(store.counts(&q).await.unwrap(), StatusCounts { submitted: 1, cancelled: 6, ..Default::default() });
    // Re-run every x; y is not selected; nothing is left to re-run after.
    let all = store.bulk(&q, BulkAction::Retry, xs(), false, 0).await.unwrap();
    assert_eq!(short(all), report(6, 6, 6, false));
    assert_eq!(store.counts(&q).await.unwrap(), StatusCounts { submitted: 7, ..Default::default() });
    let none = store.bulk(&q, BulkAction::Retry, ListQuery::default(), false, 0).await.unwrap();
    assert_eq!(short(none), report(7, 0, 0, false));
}

async fn listing_is_newest_first_with_cursor_pagination_and_exact_counts(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("list");
    let mut ids = Vec::new();
    for i in 0..7 {
        ids.push(store.submit(&q, Command::with_id(format!("l-{i}"), "t", json!(i))).await.unwrap());
        if i % 2 == 0 {
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
    }
    // Expected order: created desc, then id desc.
    let mut expected: Vec<(u64, String)> = ids.iter().map(|s| (s.created_at.millis(), s.id.clone())).collect();
    expected.sort();
    expected.reverse();
    let expected: Vec<String> = expected.into_iter().map(|(_, id)| id).collect();
    store.cancel("l-1").await.unwrap();
    store.cancel("l-4").await.unwrap();
    let mut got = Vec::new();
    let mut cursor = None;
    let mut pages = 0;
    loop {
        let page = store
            .list(&q, ListQuery { status: None, limit: 3, cursor: cursor.clone(), ..Default::default() })
            .await
            .unwrap();
        pages += 1;
        assert!(page.items.len() <= 3);
        got.extend(page.items.iter().map(|s| s.id.clone()));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(got, expected);
    assert_eq!(pages, 3);
    let cancelled = store
        .list(&q, ListQuery { status: Some(CommandStatus::Cancelled), limit: 10, cursor: None, ..Default::default() })
        .await
        .unwrap();
    let want: Vec<String> = expected.iter().filter(|i| *i == "l-1" || *i == "l-4").cloned().collect();
    assert_eq!(cancelled.items.iter().map(|s| s.id.clone()).collect::<Vec<_>>(), want);
    assert!(cancelled.items.iter().all(|s| s.status == CommandStatus::Cancelled));
    assert_eq!(cancelled.next_cursor, None);
    let submitted = store
        .list(&q, ListQuery { status: Some(CommandStatus::Submitted), limit: 100, cursor: None, ..Default::default() })
        .await
        .unwrap();
    assert_eq!(submitted.items.len(), 5);
    assert_eq!(store.counts(&q).await.unwrap(), StatusCounts { submitted: 5, cancelled: 2, ..Default::default() });
    assert!(matches!(
        store.list(&q, ListQuery { cursor: Some("nope".into()), ..Default::default() }).await,
        Err(CommandError::InvalidCursor(_))
    ));
}

async fn terminal_states_expire_after_retention(b: TestBackend) {
    let settings = CommandStoreSettings {
        state_ttl: Duration::from_secs(60),
        retention: Duration::from_secs(1),
        ..Default::default()
    };
    let store = store_with(&b, settings).await;
    let q = queue_name("retention");
    store.submit(&q, Command::with_id("keep", "t", json!(1))).await.unwrap();
    store.submit(&q, Command::with_id("gone", "t", json!(2))).await.unwrap();
    store.cancel("gone").await.unwrap();
    assert_eq!(store.counts(&q).await.unwrap(), StatusCounts { submitted: 1, cancelled: 1, ..Default::default() });
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert_eq!(store.get("gone").await.unwrap(), None);
    assert_eq!(store.counts(&q).await.unwrap(), StatusCounts { submitted: 1, ..Default::default() });
    let page = store.list(&q, ListQuery::default()).await.unwrap();
    assert_eq!(page.items.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), vec!["keep"]);
    assert!(matches!(store.cancel("gone").await, Err(CommandError::NotFound(_))));
    // The id can be used again once expired.
    let again = store.submit(&q, Command::with_id("gone", "t", json!(3))).await.unwrap();
    assert_eq!((again.version, again.status), (1, CommandStatus::Submitted));
}

async fn retention_is_set_per_queue(b: TestBackend) {
    let short = queue_name("short-retention");
    let long = queue_name("default-retention");
    let mut settings = CommandStoreSettings::default();
    let one_second =
        baton_commands::Lifetimes { state_ttl: Duration::from_secs(60), retention: Duration::from_secs(1) };
    settings.lifetimes.insert(short.clone(), one_second);
    assert_eq!(settings.lifetimes_of(&short), one_second);
    assert_eq!(settings.lifetimes_of(&long).retention, Duration::from_secs(24 * 3600));
    let store = store_with(&b, settings.clone()).await;
    for q in [&short, &long] {
        let id = format!("{q}-done");
        store.submit(q, Command::with_id(&id, "t", json!(1))).await.unwrap();
        store.cancel(&id).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert_eq!(store.get(&format!("{short}-done")).await.unwrap(), None, "the short queue's retention");
    assert_eq!(store.counts(&short).await.unwrap(), StatusCounts::default());
    let kept = store.get(&format!("{long}-done")).await.unwrap().expect("the store's retention (24 h)");
    assert_eq!(kept.status, CommandStatus::Cancelled);
    // A lifetime under a second is refused, naming the queue.
    settings.lifetimes.insert("bad".into(), baton_commands::Lifetimes { retention: Duration::ZERO, ..one_second });
    match baton_commands::CommandStore::memory_with(settings) {
        Err(CommandError::InvalidSettings(m)) => assert!(m.contains("\"bad\""), "{m}"),
        other => panic!("{:?}", other.err()),
    }
}

async fn wait_wakes_on_writes_from_another_store(b: TestBackend) {
    let store = store_for(&b).await;
    let watcher = other_store(&b, &store).await;
    let q = queue_name("wait");
    let gate = Arc::new(tokio::sync::Notify::new());
    let g2 = gate.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "gated",
            on_execute(move |_c| {
                let g2 = g2.clone();
                async move {
                    g2.notified().await;
                    Ok(CommandResult::succeeded(json!("opened")))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let id = svc.submit(Command::new("gated", json!({}))).await.unwrap().id;
    let w = {
        let watcher = watcher.clone();
        let id = id.clone();
        tokio::spawn(async move { watcher.wait(&id, Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!w.is_finished());
    gate.notify_one();
    let st = w.await.unwrap().unwrap();
    assert_eq!((st.status, st.result), (CommandStatus::Succeeded, Some(json!("opened").into())));
    assert!(matches!(watcher.wait("never-submitted", Duration::from_millis(10)).await, Err(CommandError::NotFound(_))));
    svc.close().await;
}

async fn cancel_from_another_store_signals_the_running_handler(b: TestBackend) {
    let store = store_for(&b).await;
    let canceller = other_store(&b, &store).await;
    let q = queue_name("remote-cancel");
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "cooperative",
            on_execute(move |c: Command| {
                let started_tx = started_tx.clone();
                async move {
                    started_tx.send(()).unwrap();
                    tokio::select! {
                        _ = c.cancelled() => Ok(CommandResult::cancelled()),
                        _ = tokio::time::sleep(Duration::from_secs(20)) => Ok(CommandResult::succeeded(json!("too late"))),
                    }
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let id = svc.submit(Command::new("cooperative", json!({}))).await.unwrap().id;
    started_rx.recv().await.unwrap();
    let c = canceller.cancel(&id).await.unwrap();
    assert_eq!(c.status, CommandStatus::Cancelled);
    // The handler stops on the signal: its message is acked well before its 20 s sleep.
    eventually(Duration::from_secs(10), || {
        let store = store.clone();
        let q = q.clone();
        async move { (store.messages().stats(&q).await.ok()?.length == 0).then_some(()) }
    })
    .await
    .expect("the handler was signalled and returned");
    let st = store.get(&id).await.unwrap().unwrap();
    assert_eq!((st.status, st.version), (CommandStatus::Cancelled, 2));
    svc.close().await;
}

/// Cancel racing completion, 200 rounds: the final state is exactly the winner's, never a mix.
async fn cancel_racing_completion_keeps_exactly_the_winner(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("race");
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel::<(String, Arc<tokio::sync::Notify>)>();
    let mut s = fast();
    s.concurrency = 4;
    let svc = CommandService::builder(store.clone(), &q)
        .settings(s)
        .handler(
            "race",
            on_execute(move |c: Command| {
                let started_tx = started_tx.clone();
                async move {
                    let go = Arc::new(tokio::sync::Notify::new());
                    started_tx.send((c.id.clone(), go.clone())).unwrap();
                    go.notified().await;
                    // Ignores the cancellation signal on purpose: its write races the cancel.
                    Ok(CommandResult::succeeded(json!({ "winner": "completion", "id": c.id })))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let (mut cancels_won, mut completions_won) = (0, 0);
    for round in 0..200 {
        let id = format!("race-{round}");
        svc.submit(Command::with_id(&id, "race", json!(round))).await.unwrap();
        let (started, go) = started_rx.recv().await.unwrap();
        assert_eq!(started, id);
        // The cancel runs on another worker thread while the handler is released; half of the
        // rounds delay the handler's release by a yield or 1 ms.
        let cancel = {
            let store = store.clone();
            let id = id.clone();
            tokio::spawn(async move { store.cancel(&id).await })
        };
        match round % 4 {
            1 => tokio::task::yield_now().await,
            3 => tokio::time::sleep(Duration::from_millis(1)).await,
            _ => {}
        }
        go.notify_one();
        let cancel_result = cancel.await.unwrap();
        let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
        assert_eq!(st.version, 2, "exactly one write after submit");
        match cancel_result {
            Ok(c) => {
                cancels_won += 1;
                assert_eq!(st, c, "the cancel's state is the final state");
                assert_eq!((st.status, st.result.clone(), st.attempts), (CommandStatus::Cancelled, None, 0));
            }
            Err(CommandError::AlreadyTerminal(seen)) => {
                completions_won += 1;
                assert_eq!(st.status, CommandStatus::Succeeded);
                assert_eq!(st.result, Some(json!({"winner": "completion", "id": id}).into()));
                assert_eq!((st.attempts, st.error.clone()), (1, None));
                assert_eq!(*seen, st);
            }
            Err(e) => panic!("unexpected cancel error {e}"),
        }
    }
    assert_eq!(cancels_won + completions_won, 200);
    let counts = store.counts(&q).await.unwrap();
    assert_eq!(counts, StatusCounts { succeeded: completions_won, cancelled: cancels_won, ..Default::default() });
    eprintln!("race ({}): cancel won {cancels_won}, completion won {completions_won}", b.name());
    svc.close().await;
}

async fn wait_returns_the_running_state_at_timeout(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("wait-timeout");
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler("long", on_execute(|_c| async { Ok(CommandResult::running_after(Duration::from_secs(60))) }))
        .start()
        .await
        .unwrap();
    let id = svc.submit(Command::new("long", json!({}))).await.unwrap().id;
    eventually(Duration::from_secs(10), || {
        let store = store.clone();
        let id = id.clone();
        async move { store.get(&id).await.ok()?.filter(|s| s.status == CommandStatus::Running) }
    })
    .await
    .expect("running");
    let st = store.wait(&id, Duration::from_millis(300)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Running);
    svc.abort();
}

/// `submit_and_wait` subscribes before it submits, so a completion written by another store is
/// seen through its notification, not by the once-a-second fallback re-read.
async fn submit_and_wait_wakes_on_a_write_from_another_store(b: TestBackend) {
    let store = store_for(&b).await;
    let worker = other_store(&b, &store).await;
    let q = queue_name("submit-wait");
    let svc = CommandService::builder(worker.clone(), &q)
        .settings(fast())
        .handler(
            "double",
            on_execute(|c: Command| async move {
                Ok(CommandResult::succeeded(json!(c.params.parse::<i64>().unwrap() * 2)))
            }),
        )
        .start()
        .await
        .unwrap();
    let mut fastest = Duration::MAX;
    for i in 0..3 {
        let t0 = std::time::Instant::now();
        let st = store
            .submit_and_wait(&q, Command::with_id(format!("sw-{i}"), "double", json!(i)), Duration::from_secs(20))
            .await
            .unwrap();
        fastest = fastest.min(t0.elapsed());
        assert_eq!((st.status, st.result, st.version), (CommandStatus::Succeeded, Some(json!(i * 2).into()), 2));
    }
    // The fallback re-read comes after 1 s; a notification much sooner.
    assert!(fastest < Duration::from_millis(900), "fastest submit_and_wait took {fastest:?}");
    // An idempotent resubmit of a finished command returns its stored state at once.
    let again =
        store.submit_and_wait(&q, Command::with_id("sw-1", "double", json!(1)), Duration::from_secs(20)).await.unwrap();
    assert_eq!((again.status, again.result, again.version), (CommandStatus::Succeeded, Some(json!(2).into()), 2));
    // A different body under the same id is still a conflict.
    assert!(matches!(
        store.submit_and_wait(&q, Command::with_id("sw-1", "double", json!(5)), Duration::from_secs(1)).await,
        Err(CommandError::Conflict { .. })
    ));
    // Nobody runs queue `idle`: the submitted state comes back at the timeout.
    let idle = queue_name("submit-wait-idle");
    let st = store.submit_and_wait(&idle, Command::new("double", json!(1)), Duration::from_millis(200)).await.unwrap();
    assert_eq!((st.status, st.version), (CommandStatus::Submitted, 1));
    svc.close().await;
}
