//! The handler, producer and pointer logic end to end, on the in-memory backend and on a Redis
//! standalone server started by the test.

mod common;

use std::time::Duration;

use baton_commands::CommandStatus;
use baton_streams::{EndReason, ReadFrom};
use baton_testkit::{eventually, RedisServer};
use incident_triage::triage::stream_path;
use incident_triage::{LogSource, Triage, TriageError};
use serde_json::Value;

async fn events(t: &Triage, engineer: &str, run: &str) -> Vec<Value> {
    let Ok(chunk) = t.streams().read(&stream_path(engineer, run), ReadFrom::Start).await else { return vec![] };
    chunk.records.iter().map(|r| serde_json::from_slice(&r.data).unwrap()).collect()
}

fn path_source(p: &std::path::Path) -> LogSource {
    LogSource::Path { path: p.display().to_string() }
}

async fn full_run_succeeds(redis: Option<String>) {
    let dir = common::TempDir::new("full");
    let log = dir.path().join("app.log");
    common::write_app_log(&log, 6000);
    let t = Triage::start(common::config(dir.path(), redis, Duration::from_millis(5))).await.unwrap();
    let run = t.start_run("alice", path_source(&log)).await.unwrap();
    assert_eq!(run.stream, format!("triage/alice/{}", run.run));
    let done = t.commands().wait(&run.run, Duration::from_secs(30)).await.unwrap();
    assert_eq!(done.status, CommandStatus::Succeeded, "{done:?}");
    assert_eq!(done.queue, "lifecycle");
    assert_eq!(done.handed_off_to.as_deref(), Some("monitor"));
    // The run is the command's own output stream (Command::with_output), ended with it.
    let link = done.output.clone().expect("the command owns its output stream");
    assert_eq!(
        (link.stream.as_str(), link.content_type.as_str(), link.silence_timeout_ms),
        (run.stream.as_str(), "application/json", Some(3_000))
    );
    let head = t.streams().head(&stream_path("alice", &run.run)).await.unwrap();
    assert_eq!(head.end.map(|e| e.reason), Some(EndReason::Finished));
    let evs = events(&t, "alice", &run.run).await;
    for (i, e) in evs.iter().enumerate() {
        assert_eq!(e["seq"], i as u64, "seq has no gap");
    }
    let kinds: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds[0], "started");
    assert_eq!(kinds.iter().filter(|k| **k == "progress").count(), 20, "every 5 %");
    assert_eq!(kinds.iter().filter(|k| **k == "finding").count(), 4);
    assert_eq!(*kinds.last().unwrap(), "summary");
    let progress: Vec<u64> =
        evs.iter().filter(|e| e["type"] == "progress").map(|e| e["percent"].as_u64().unwrap()).collect();
    assert!(progress.windows(2).all(|w| w[0] <= w[1]) && *progress.last().unwrap() == 100, "{progress:?}");
    let summary = &done.result_as::<serde_json::Value>().unwrap()["summary"];
    assert_eq!(summary["lines"], 6000);
    assert_eq!(summary["bytes"], std::fs::metadata(&log).unwrap().len());
    assert!(summary["headline"].as_str().unwrap().contains("Burst"), "{summary}");
    let finding = evs.iter().find(|e| e["type"] == "finding").unwrap();
    assert_eq!(finding["rank"], 1);
    assert_eq!(finding["signature"], "ERROR db: connection to <ip> refused (attempt <n>)");
    // The pointer was released by the monitor when it completed the command.
    assert_eq!(t.pointers().get("alice").await.unwrap(), None);
    assert!(t.current_run("alice").await.unwrap().is_none());
    t.shutdown().await;
}

async fn one_current_run_stop_and_take_over(redis: Option<String>) {
    let dir = common::TempDir::new("pointer");
    let log = dir.path().join("app.log");
    common::write_app_log(&log, 3000);
    let t = Triage::start(common::config(dir.path(), redis, Duration::from_millis(200))).await.unwrap();
    let a = t.start_run("bob", path_source(&log)).await.unwrap();
    // A second start while the first runs is refused and names the current run.
    match t.start_run("bob", path_source(&log)).await {
        Err(TriageError::Busy { run, .. }) => assert_eq!(run, a.run),
        other => panic!("expected Busy, got {other:?}"),
    }
    // A second device finds the current run and reads it from the start.
    let cur = t.current_run("bob").await.unwrap().unwrap();
    assert_eq!(cur.run, a.run);
    eventually(Duration::from_secs(10), || async { (events(&t, "bob", &a.run).await.len() >= 3).then_some(()) })
        .await
        .unwrap();
    assert_eq!(events(&t, "bob", &a.run).await[0]["type"], "started");
    assert_eq!(t.local_runs(), vec![a.run.clone()]);
    // Stop: the stream ends cancelled now, the local producer stops at once, the pointer is free.
    let stopped = t.stop_run("bob", &a.run).await.unwrap();
    assert_eq!(stopped.stream_end.as_deref(), Some("cancelled"));
    // Stop is a cancel of the command: CANCELLED at once (not at the monitor's next check).
    assert_eq!(stopped.status, Some(CommandStatus::Cancelled));
    assert_eq!(t.pointers().get("bob").await.unwrap(), None);
    eventually(Duration::from_secs(2), || async { t.local_runs().is_empty().then_some(()) })
        .await
        .expect("producer stopped");
    let n = events(&t, "bob", &a.run).await.len();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(events(&t, "bob", &a.run).await.len(), n, "no event after the stop");
    let st = t.commands().wait(&a.run, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Cancelled);
    // The engineer can start again.
    let b = t.start_run("bob", path_source(&log)).await.unwrap();
    assert_ne!(b.run, a.run);
    t.stop_run("bob", &b.run).await.unwrap();
    // A pointer left behind by a run that ended without releasing it is taken over.
    t.pointers().release("bob", &b.run).await.unwrap();
    assert!(t.pointers().claim("bob", &a.run).await.unwrap(), "stale pointer to the cancelled run");
    let c = t.start_run("bob", path_source(&log)).await.unwrap();
    assert_eq!(t.pointers().get("bob").await.unwrap().as_deref(), Some(c.run.as_str()));
    // A pointer to a run that never got a command nor a stream (crash after the claim) too.
    t.stop_run("bob", &c.run).await.unwrap();
    let ghost = "01a22ac0-0000-7000-8000-000000000000";
    assert!(t.pointers().claim("bob", ghost).await.unwrap());
    let d = t.start_run("bob", path_source(&log)).await.unwrap();
    assert_eq!(t.current_run("bob").await.unwrap().unwrap().run, d.run);
    t.stop_run("bob", &d.run).await.unwrap();
    // Release is compare-and-delete: another run's id does not release it.
    assert!(t.pointers().claim("zed", "r1").await.unwrap());
    assert!(!t.pointers().release("zed", "r2").await.unwrap());
    assert!(!t.pointers().take_over("zed", "r2", "r3").await.unwrap());
    assert!(t.pointers().take_over("zed", "r1", "r3").await.unwrap());
    assert!(t.pointers().release("zed", "r3").await.unwrap());
    t.shutdown().await;
}

async fn bad_sources_fail_clearly(redis: Option<String>) {
    let dir = common::TempDir::new("bad");
    let t = Triage::start(common::config(dir.path(), redis, Duration::from_millis(5))).await.unwrap();
    let err = t.start_run("eve", LogSource::Path { path: "/etc/passwd".into() }).await.unwrap_err();
    assert!(err.to_string().contains("outside the allowed log directories"), "{err}");
    let err = t
        .start_run("eve", LogSource::Path { path: dir.path().join("nope.log").display().to_string() })
        .await
        .unwrap_err();
    assert!(matches!(err, TriageError::Invalid(_)), "{err}");
    let err = t.start_run("bad id!", LogSource::Text { name: "x".into(), text: "y".into() }).await.unwrap_err();
    assert!(matches!(err, TriageError::Invalid(_)));
    // Uploaded text is analysed like a file.
    let run = t
        .start_run(
            "eve",
            LogSource::Text { name: "../../etc/x.log".into(), text: "ERROR boom 1\nERROR boom 2\nok\n".into() },
        )
        .await
        .unwrap();
    assert_eq!(run.source.as_deref(), Some("upload:x.log"));
    let st = t.commands().wait(&run.run, Duration::from_secs(20)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    assert_eq!(st.result_as::<serde_json::Value>().unwrap()["summary"]["errors"], 2);
    t.shutdown().await;
}

/// Two services on one Redis (as two processes would be): a Stop through the one that does not
/// run the producer ends the stream at once; the producer's next append is refused and it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stop_from_another_instance() {
    baton_testkit::require_redis();
    let server = RedisServer::start();
    let dir = common::TempDir::new("remote");
    let log = dir.path().join("app.log");
    common::write_app_log(&log, 3000);
    let cfg = common::config(dir.path(), Some(server.url()), Duration::from_millis(200));
    let x = Triage::start(cfg.clone()).await.unwrap();
    let y = Triage::start(cfg).await.unwrap();
    let run = x.start_run("fay", path_source(&log)).await.unwrap();
    let (owner, other) = eventually(Duration::from_secs(10), || async {
        if !x.local_runs().is_empty() {
            Some((&x, &y))
        } else if !y.local_runs().is_empty() {
            Some((&y, &x))
        } else {
            None
        }
    })
    .await
    .expect("one instance runs the producer");
    eventually(Duration::from_secs(10), || async { (events(other, "fay", &run.run).await.len() >= 3).then_some(()) })
        .await
        .unwrap();
    let stopped = other.stop_run("fay", &run.run).await.unwrap();
    assert_eq!((stopped.stream_end.as_deref(), stopped.status), (Some("cancelled"), Some(CommandStatus::Cancelled)));
    // The owner's producer is refused at its next append (one pace later) and stops.
    eventually(Duration::from_secs(2), || async { owner.local_runs().is_empty().then_some(()) })
        .await
        .expect("remote producer stopped");
    let head = owner.streams().head(&stream_path("fay", &run.run)).await.unwrap();
    assert_eq!(head.end.unwrap().reason, EndReason::Cancelled);
    let st = x.commands().wait(&run.run, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Cancelled);
    x.shutdown().await;
    y.shutdown().await;
}

macro_rules! on_memory_and_redis {
    ($($name:ident),*) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::$name(None).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                baton_testkit::require_redis();
                let server = baton_testkit::RedisServer::start();
                super::$name(Some(server.url())).await
            }
        }
    )*};
}

on_memory_and_redis!(full_run_succeeds, one_current_run_stop_and_take_over, bad_sources_fail_clearly);
