//! In-process handlers' reports: what runs now (`execution`), progress and checkpoints
//! (`Command::progress`, `Command::checkpoint`), written while the handler runs and resumed by
//! the next delivery. Every backend.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_commands::{
    Command, CommandError, CommandResult, CommandService, CommandStatus, ExecutionCall, Progress, QueueSettings,
    REPORT_INTERVAL,
};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    a_running_handler_shows_what_it_does,
    a_checkpoint_resumes_the_next_attempt,
    a_handler_past_its_lease_writes_no_more_reports
);

async fn a_running_handler_shows_what_it_does(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("progress");
    let settings = fast();
    let max = settings.max_processing_time;
    let svc = CommandService::builder(store.clone(), &q)
        .settings(settings)
        .handler(
            "slow",
            on_execute(|c: Command| async move {
                assert!(matches!(c.progress(Some(1.5), None), Err(CommandError::InvalidParams(_))));
                assert!(matches!(c.progress(None, None), Err(CommandError::InvalidParams(_))));
                c.progress(Some(0.25), Some("a quarter")).unwrap();
                c.checkpoint(&json!({"page": 1})).unwrap();
                tokio::time::sleep(REPORT_INTERVAL * 3).await;
                c.progress(Some(0.9), Some("almost")).unwrap();
                Ok(CommandResult::succeeded(json!("done")))
            }),
        )
        .start()
        .await
        .unwrap();
    let cmd = store.submit(&q, Command::new("slow", json!({}))).await.unwrap();
    let running = eventually(Duration::from_secs(5), || async {
        store.get(&cmd.id).await.unwrap().filter(|s| s.execution.is_some())
    })
    .await
    .expect("the running call is shown");
    let e = running.execution.clone().unwrap();
    assert_eq!((e.call, e.deliveries), (ExecutionCall::Execute, 1));
    assert!(!e.worker.is_empty());
    assert_eq!(e.deadline.millis() - e.since.millis(), max.as_millis() as u64);
    assert_eq!(running.status, CommandStatus::Submitted);
    assert_eq!(running.progress, Some(Progress { fraction: Some(0.25), message: Some("a quarter".into()) }));
    assert_eq!(running.details.as_ref().map(|d| d.get()), Some(r#"{"page":1}"#));
    let public = serde_json::to_value(&running).unwrap();
    assert_eq!(public["execution"]["call"], "execute");
    assert_eq!(public["execution"]["worker"], e.worker.as_str());

    let done = store.wait(&cmd.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(done.status, CommandStatus::Succeeded);
    assert_eq!(done.execution, None, "the call is over");
    assert!(serde_json::to_value(&done).unwrap().get("execution").is_none());
    assert_eq!(done.progress, Some(Progress { fraction: Some(0.9), message: Some("almost".into()) }));
    assert_eq!(done.details.as_ref().map(|d| d.get()), Some(r#"{"page":1}"#));
    assert_eq!(done.result.as_ref().map(|r| r.get()), Some(r#""done""#));
    svc.close().await;
}

async fn a_checkpoint_resumes_the_next_attempt(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("resume");
    let seen: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    let seen2 = seen.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "step",
            on_execute(move |c: Command| {
                let seen = seen2.clone();
                async move {
                    let resumed = c.details().map(|d| d.get().to_string());
                    seen.lock().unwrap().push(resumed.clone());
                    if resumed.is_none() {
                        // No wait: the checkpoint goes with the error's write.
                        c.checkpoint(&json!({"step": 3})).unwrap();
                        return Err("boom".into());
                    }
                    Ok(CommandResult::succeeded(json!("resumed")))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let cmd = store.submit(&q, Command::new("step", json!({}))).await.unwrap();
    let done = store.wait(&cmd.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(done.status, CommandStatus::Succeeded);
    assert_eq!(*seen.lock().unwrap(), vec![None, Some(r#"{"step":3}"#.to_string())]);
    assert_eq!((done.attempts, done.execution.is_none()), (2, true));
    svc.close().await;
}

/// A handler that runs past `max_processing_time` has lost its lease: its later reports are not
/// written (another delivery may be working on the command by then).
async fn a_handler_past_its_lease_writes_no_more_reports(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("lapsed-reports");
    let settings = QueueSettings { max_processing_time: Duration::from_secs(1), ..fast() };
    let svc = CommandService::builder(store.clone(), &q)
        .settings(settings)
        .handler(
            "long",
            on_execute(|c: Command| async move {
                for i in 0..45 {
                    c.progress(None, Some(&format!("tick {i}"))).unwrap();
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Ok(CommandResult::succeeded(json!(null)))
            }),
        )
        .start()
        .await
        .unwrap();
    let cmd = store.submit(&q, Command::new("long", json!({}))).await.unwrap();
    let message = || async {
        let st = store.get(&cmd.id).await.unwrap().unwrap();
        (st.version, st.progress.and_then(|p| p.message))
    };
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let (v1, m1) = message().await;
    assert!(m1.is_some(), "reports were written while the lease was held");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (v2, m2) = message().await;
    assert_eq!((v2, m2), (v1, m1), "nothing written after the lease was lost");
    svc.close().await;
}
