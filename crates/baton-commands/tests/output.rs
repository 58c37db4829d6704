//! Output streams owned by a command (crate docs, "Output streams"): created at submit, written
//! by the handler, ended with the command, and their end deciding the command. Every backend.

use crate::common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_commands::{Command, CommandError, CommandResult, CommandService, CommandStatus, CommandStore, OutputSpec};
use baton_streams::{EndReason, ReadFrom, StreamPath, StreamStore, StreamStoreSettings};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    the_output_ends_with_the_command,
    a_failed_command_ends_its_output_with_an_error_entry,
    a_cancel_ends_the_output_and_signals_the_handler,
    an_output_cancelled_elsewhere_cancels_the_command,
    a_detached_producer_decides_the_command,
    a_silent_producer_fails_the_command,
    a_rerun_writes_a_new_output,
    a_resubmit_with_another_output_is_a_conflict,
    a_delivery_finds_its_output_stream,
    an_output_path_in_use_is_refused,
    a_result_after_the_stream_finished_is_kept,
    a_cancel_racing_the_finish_agrees_with_the_stream,
    a_command_waiting_longer_than_its_silence_timeout_runs,
    a_rerun_while_the_old_run_still_writes,
    a_cancel_racing_the_handlers_terminal_write_agrees_with_the_stream,
    a_superseded_remote_worker_cannot_end_the_output,
    a_handler_that_lost_its_lease_cannot_end_the_output,
    a_command_failing_with_a_full_output_fails_once
);

async fn setup(b: &TestBackend) -> (CommandStore, StreamStore) {
    let store = store_for(b).await;
    let streams = match b.redis_config() {
        None => StreamStore::memory(StreamStoreSettings::default()),
        Some(cfg) => StreamStore::redis(cfg, StreamStoreSettings::default()).await.unwrap(),
    };
    store.set_outputs(streams.clone()).unwrap();
    (store, streams)
}

/// Every record's data of the stream at `path`, as text.
async fn records(streams: &StreamStore, path: &str) -> Vec<String> {
    let path = StreamPath::new(path).unwrap();
    let mut from = ReadFrom::Start;
    let mut out = Vec::new();
    loop {
        let chunk = streams.read(&path, from).await.unwrap();
        out.extend(chunk.records.iter().map(|r| String::from_utf8(r.data.to_vec()).unwrap()));
        if chunk.up_to_date || chunk.records.is_empty() {
            return out;
        }
        from = ReadFrom::At(chunk.next_offset);
    }
}

async fn end_of(streams: &StreamStore, path: &str) -> Option<EndReason> {
    streams.head(&StreamPath::new(path).unwrap()).await.unwrap().end.map(|e| e.reason)
}

async fn the_output_ends_with_the_command(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output");
    let submitted =
        store.submit(&q, Command::new("write", json!({})).with_output(OutputSpec::default())).await.unwrap();
    let link = submitted.output.clone().expect("the state links its output");
    assert_eq!(link.stream, format!("commands/{}", submitted.id));
    assert_eq!((link.run, link.content_type.as_str()), (1, "application/json"));
    // Readers can attach before any handler runs.
    assert_eq!(end_of(&streams, &link.stream).await, None);
    let public = serde_json::to_value(&submitted).unwrap();
    assert_eq!(public["output"]["stream"], link.stream.as_str());
    assert_eq!(public["output"]["url"], format!("/v1/stream/commands/{}", submitted.id));

    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "write",
            on_execute(|c: Command| async move {
                let out = c.output().expect("a delivery of a command with an output").open().await?;
                for i in 0..3 {
                    out.append_json(&json!({ "step": i })).await?;
                }
                Ok(CommandResult::succeeded(json!("done")))
            }),
        )
        .start()
        .await
        .unwrap();
    let done = store.wait(&submitted.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(done.status, CommandStatus::Succeeded);
    assert_eq!(done.result.as_ref().map(|r| r.get()), Some(r#""done""#));
    assert_eq!(end_of(&streams, &link.stream).await, Some(EndReason::Finished));
    assert_eq!(records(&streams, &link.stream).await, vec![r#"{"step":0}"#, r#"{"step":1}"#, r#"{"step":2}"#]);
    // A command without one has none, and its state's JSON says nothing of it.
    let plain = store.submit(&q, Command::new("write", json!({}))).await.unwrap();
    assert_eq!(plain.output, None);
    assert!(serde_json::to_value(&plain).unwrap().get("output").is_none());
    svc.close().await;

    // A store without output streams refuses such a submit, storing nothing.
    let bare = store_for(&b).await;
    let cmd = Command::new("write", json!({})).with_output(OutputSpec::default());
    let id = cmd.id.clone();
    assert!(matches!(bare.submit(&q, cmd).await, Err(CommandError::Output(_))));
    assert!(bare.get(&id).await.unwrap().is_none());
    // A bad path is refused as well.
    let bad = OutputSpec { path: Some("a//b".into()), ..OutputSpec::default() };
    let e = store.submit(&q, Command::new("write", json!({})).with_output(bad)).await.unwrap_err();
    assert!(matches!(e, CommandError::InvalidParams(_)), "{e:?}");
}

async fn a_failed_command_ends_its_output_with_an_error_entry(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-failed");
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "write",
            on_execute(|c: Command| async move {
                c.output().unwrap().open().await?.append_json(&json!({"line": "partial"})).await?;
                Ok(CommandResult::failed("disk full"))
            }),
        )
        .start()
        .await
        .unwrap();
    let spec = OutputSpec { path: Some(format!("team-a/{q}")), ..OutputSpec::default() };
    let st = store.submit(&q, Command::new("write", json!({})).with_output(spec)).await.unwrap();
    let done = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((done.status, done.error.as_deref()), (CommandStatus::Failed, Some("disk full")));
    let path = format!("team-a/{q}");
    assert_eq!(end_of(&streams, &path).await, Some(EndReason::Finished));
    assert_eq!(records(&streams, &path).await, vec![r#"{"line":"partial"}"#, r#"{"error":"disk full"}"#]);
    svc.close().await;
}

async fn a_cancel_ends_the_output_and_signals_the_handler(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-cancel");
    let stopped = Arc::new(AtomicU32::new(0));
    let s2 = stopped.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "write",
            on_execute(move |c: Command| {
                let stopped = s2.clone();
                async move {
                    let out = c.output().unwrap().open().await?;
                    out.append_json(&json!("started")).await?;
                    c.cancelled().await;
                    stopped.fetch_add(1, Ordering::SeqCst);
                    // Whatever it says now, the cancel was first.
                    Ok(CommandResult::succeeded(json!("late")))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let st = store.submit(&q, Command::new("write", json!({})).with_output(OutputSpec::default())).await.unwrap();
    let path = st.output.unwrap().stream;
    eventually(Duration::from_secs(5), || async { (records(&streams, &path).await.len() == 1).then_some(()) })
        .await
        .expect("the handler started writing");
    let cancelled = store.cancel(&st.id).await.unwrap();
    assert_eq!(cancelled.status, CommandStatus::Cancelled);
    assert_eq!(end_of(&streams, &path).await, Some(EndReason::Cancelled), "ended by the cancel itself");
    eventually(Duration::from_secs(5), || async { (stopped.load(Ordering::SeqCst) == 1).then_some(()) })
        .await
        .expect("the handler was signalled");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(store.get(&st.id).await.unwrap().unwrap().status, CommandStatus::Cancelled);
    svc.close().await;
}

async fn an_output_cancelled_elsewhere_cancels_the_command(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-ended");
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "write",
            on_execute(|c: Command| async move {
                let out = c.output().unwrap().open().await?;
                // Appends until one is refused: the stream was ended elsewhere.
                loop {
                    if out.append_json(&json!("tick")).await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                assert!(c.is_cancelled(), "a refused append of a cancelled output signals the handler");
                Ok(CommandResult::succeeded(json!("ignored")))
            }),
        )
        .start()
        .await
        .unwrap();
    let st = store.submit(&q, Command::new("write", json!({})).with_output(OutputSpec::default())).await.unwrap();
    let path = st.output.unwrap().stream;
    eventually(Duration::from_secs(5), || async { (!records(&streams, &path).await.is_empty()).then_some(()) })
        .await
        .expect("the handler is writing");
    streams.end(&StreamPath::new(&path).unwrap(), EndReason::Cancelled).await.unwrap();
    let done = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((done.status, done.result), (CommandStatus::Cancelled, None));
    svc.close().await;
}

async fn a_detached_producer_decides_the_command(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-detached");
    // `execute` starts a producer and returns `running`; the default `check_status` says
    // `running` too: only the stream's end can finish the command.
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "write",
            on_execute(|c: Command| async move {
                let output = c.output().unwrap().clone();
                let fail = c.params_as::<serde_json::Value>()?["fail"].as_bool().unwrap_or(false);
                output.streams().clone().spawn(output.path(), output.link().open_options(), move |p| async move {
                    p.append(json!("working").to_string()).await.map_err(|e| e.to_string())?;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    if fail {
                        return Err("the analysis crashed".to_string());
                    }
                    Ok::<(), String>(())
                });
                Ok(CommandResult::running())
            }),
        )
        .start()
        .await
        .unwrap();
    let ok = store.submit(&q, Command::new("write", json!({})).with_output(OutputSpec::default())).await.unwrap();
    let bad = store
        .submit(&q, Command::new("write", json!({"fail": true})).with_output(OutputSpec::default()))
        .await
        .unwrap();
    let ok = store.wait(&ok.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((ok.status, ok.result.as_ref().map(|r| r.get())), (CommandStatus::Succeeded, Some("null")));
    let bad = store.wait(&bad.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((bad.status, bad.error.as_deref()), (CommandStatus::Failed, Some("the analysis crashed")));
    assert_eq!(records(&streams, &bad.output.unwrap().stream).await.len(), 2, "the failure entry stays the last");
    svc.close().await;
}

async fn a_silent_producer_fails_the_command(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-silent");
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "write",
            on_execute(|c: Command| async move {
                // Opens, writes once, and is never heard of again (a producer whose process died).
                c.output().unwrap().open().await?.append_json(&json!("hello")).await?;
                Ok(CommandResult::running())
            }),
        )
        .start()
        .await
        .unwrap();
    let spec = OutputSpec { silence_timeout: Some(Duration::from_millis(400)), ..OutputSpec::default() };
    let st = store.submit(&q, Command::new("write", json!({})).with_output(spec)).await.unwrap();
    let done = store.wait(&st.id, Duration::from_secs(15)).await.unwrap();
    let path = st.output.unwrap().stream;
    assert_eq!(done.status, CommandStatus::Failed);
    assert_eq!(
        done.error.as_deref(),
        Some(format!("output stream {path} ended producer_lost: nothing was appended to it for 400ms").as_str())
    );
    assert_eq!(end_of(&streams, &path).await, Some(EndReason::ProducerLost));
    svc.close().await;
}

async fn a_rerun_writes_a_new_output(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-rerun");
    let calls = Arc::new(AtomicU32::new(0));
    let c2 = calls.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "write",
            on_execute(move |c: Command| {
                let n = c2.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    c.output().unwrap().open().await?.append_json(&json!({ "run": n })).await?;
                    Ok(if n == 1 { CommandResult::failed("first") } else { CommandResult::succeeded(json!(n)) })
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let st = store.submit(&q, Command::new("write", json!({})).with_output(OutputSpec::default())).await.unwrap();
    let first = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(first.status, CommandStatus::Failed);
    let rerun = store.retry(&st.id).await.unwrap();
    let link = rerun.output.clone().unwrap();
    assert_eq!((link.run, link.stream.clone()), (2, format!("commands/{}/run-2", st.id)));
    let done = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(done.status, CommandStatus::Succeeded);
    assert_eq!(records(&streams, &link.stream).await, vec![r#"{"run":2}"#]);
    assert_eq!(end_of(&streams, &link.stream).await, Some(EndReason::Finished));
    // The re-run's link still answers a resubmit of the first request (the run aside).
    let again = Command::with_id(st.id.clone(), "write", json!({})).with_output(OutputSpec::default());
    assert_eq!(store.submit(&q, again).await.unwrap().output.unwrap().run, 2);
    let other = Command::with_id(st.id.clone(), "write", json!({}))
        .with_output(OutputSpec { path: Some(format!("commands/{}/run-2", st.id)), ..OutputSpec::default() });
    assert!(matches!(store.submit(&q, other).await, Err(CommandError::Conflict { what: "output", .. })));
    let old = format!("commands/{}", st.id);
    assert_eq!(
        records(&streams, &old).await,
        vec![r#"{"run":1}"#, r#"{"error":"first"}"#],
        "the first run's output kept"
    );
    svc.close().await;
}

async fn a_resubmit_with_another_output_is_a_conflict(b: TestBackend) {
    let (store, _streams) = setup(&b).await;
    let q = queue_name("output-idem");
    let spec = OutputSpec {
        path: Some("team/log-1".into()),
        content_type: Some("text/plain".into()),
        silence_timeout: Some(Duration::from_secs(30)),
    };
    let cmd = |spec: Option<OutputSpec>| {
        let c = Command::with_id("idem-1", "write", json!({"a": 1}));
        match spec {
            Some(s) => c.with_output(s),
            None => c,
        }
    };
    let (first, created) = store.submit_created(&q, cmd(Some(spec.clone()))).await.unwrap();
    assert!(created);
    let link = first.output.clone().unwrap();
    assert_eq!(
        (link.stream.as_str(), link.content_type.as_str(), link.silence_timeout_ms),
        ("team/log-1", "text/plain", Some(30_000))
    );
    // The same request (a leading `/` is the same path): the stored state.
    let same = OutputSpec { path: Some("/team/log-1".into()), ..spec.clone() };
    let (again, created) = store.submit_created(&q, cmd(Some(same))).await.unwrap();
    assert_eq!((created, again.output), (false, Some(link)));
    // Anything else is a conflict, and changes nothing.
    let others = [
        None,
        Some(OutputSpec::default()),
        Some(OutputSpec { path: Some("team/log-2".into()), ..spec.clone() }),
        Some(OutputSpec { content_type: None, ..spec.clone() }),
        Some(OutputSpec { silence_timeout: None, ..spec.clone() }),
    ];
    for other in others {
        let e = store.submit(&q, cmd(other.clone())).await.unwrap_err();
        assert!(matches!(&e, CommandError::Conflict { what: "output", .. }), "{other:?}: {e:?}");
        assert_eq!(e.to_string(), "command idem-1 already exists with a different output");
    }
    // A command stored without an output conflicts with a resubmit asking for one.
    store.submit(&q, Command::with_id("idem-2", "write", json!({}))).await.unwrap();
    let e = store.submit(&q, Command::with_id("idem-2", "write", json!({})).with_output(OutputSpec::default())).await;
    assert!(matches!(e, Err(CommandError::Conflict { what: "output", .. })), "{e:?}");
    assert_eq!(store.get("idem-1").await.unwrap().unwrap().output.unwrap().stream, "team/log-1");
}

/// The stream exists before the command can be delivered: a handler that reads its output
/// before opening it (a reader, or a producer that checks first) finds it. Was: the submit
/// enqueued the command, then created the stream, so a quick delivery found nothing.
async fn a_delivery_finds_its_output_stream(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-first");
    let missing = Arc::new(AtomicU32::new(0));
    let m2 = missing.clone();
    let streams2 = streams.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(baton_commands::QueueSettings { concurrency: 16, ..fast() })
        .handler(
            "write",
            on_execute(move |c: Command| {
                let (missing, streams) = (m2.clone(), streams2.clone());
                async move {
                    let path = c.output().unwrap().path();
                    if streams.head(&path).await.is_err() {
                        missing.fetch_add(1, Ordering::SeqCst);
                    }
                    c.output().unwrap().open().await?.append_json(&json!("x")).await?;
                    Ok(CommandResult::succeeded(json!("done")))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let mut ids = Vec::new();
    for _ in 0..40 {
        let s = store.submit(&q, Command::new("write", json!({})).with_output(OutputSpec::default())).await.unwrap();
        ids.push(s.id);
    }
    for id in &ids {
        let done = store.wait(id, Duration::from_secs(10)).await.unwrap();
        assert_eq!(done.status, CommandStatus::Succeeded);
    }
    assert_eq!(missing.load(Ordering::SeqCst), 0, "deliveries that found no output stream");
    svc.close().await;
}

/// An output path naming a stream that is not the command's is refused (409 over HTTP), storing
/// nothing and leaving that stream as it was: a command must not take over another's stream
/// (end it with its own end, fence its writer). Was: the command was stored linking it.
async fn an_output_path_in_use_is_refused(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-taken");
    let theirs = format!("team/{q}");
    // Someone's stream, even with the very configuration the command would ask for.
    let probe = store
        .submit(
            &q,
            Command::new("write", json!({}))
                .with_output(OutputSpec { path: Some(format!("{theirs}-probe")), ..OutputSpec::default() }),
        )
        .await
        .unwrap();
    let limits = probe.output.unwrap().limits();
    let p = StreamPath::new(&theirs).unwrap();
    let opts = baton_streams::CreateOptions {
        content_type: Some("application/json".into()),
        limits: Some(limits),
        ..Default::default()
    };
    streams.create(&p, opts).await.unwrap();
    streams
        .append(
            &p,
            baton_streams::AppendRequest {
                data: r#"{"mine":1}"#.into(),
                content_type: Some("application/json".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let cmd = Command::with_id(format!("taker-{q}"), "write", json!({}))
        .with_output(OutputSpec { path: Some(theirs.clone()), ..OutputSpec::default() });
    let e = store.submit(&q, cmd).await.unwrap_err();
    assert!(matches!(&e, CommandError::OutputInUse { path, .. } if *path == theirs), "{e:?}");
    assert!(store.get(&format!("taker-{q}")).await.unwrap().is_none(), "nothing stored");
    assert_eq!(end_of(&streams, &theirs).await, None);
    assert_eq!(records(&streams, &theirs).await, vec![r#"{"mine":1}"#]);
    // Another content type: the same.
    let cmd = Command::new("write", json!({})).with_output(OutputSpec {
        path: Some(theirs.clone()),
        content_type: Some("text/plain".into()),
        ..OutputSpec::default()
    });
    assert!(matches!(store.submit(&q, cmd).await, Err(CommandError::OutputInUse { .. })));
    // A resubmit of a stored command finds its own stream and is answered as before.
    let own = Command::with_id(format!("own-{q}"), "write", json!({})).with_output(OutputSpec::default());
    let (first, created) = store.submit_created(&q, own.clone()).await.unwrap();
    assert!(created);
    let (again, created) = store.submit_created(&q, own).await.unwrap();
    assert_eq!((created, again.output), (false, first.output));
    // A conflicting submit leaves no stream behind at the path it asked for.
    let other = Command::with_id(format!("own-{q}"), "write", json!({"x": 1}))
        .with_output(OutputSpec { path: Some(format!("{theirs}-never")), ..OutputSpec::default() });
    assert!(matches!(store.submit(&q, other).await, Err(CommandError::Conflict { .. })));
    assert!(streams.head(&StreamPath::new(format!("{theirs}-never")).unwrap()).await.is_err());
}

/// The producer finishes the stream while `check_status` runs and says `running` (its result
/// is not ready yet); the next `check_status` has it. The command's result is that result.
/// Was: `SUCCEEDED` with result `null` at once, the handler's result lost.
async fn a_result_after_the_stream_finished_is_kept(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-late-result");
    let checks = Arc::new(AtomicU32::new(0));
    let c2 = checks.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "write",
            on_execute(|c: Command| async move {
                c.output().unwrap().open().await?.append_json(&json!("working")).await?;
                Ok(CommandResult::running())
            })
            .on_check(move |c: Command, _st| {
                let n = c2.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n == 0 {
                        // The producer is done: it finishes the stream; the summary comes next.
                        let out = c.output().unwrap();
                        out.streams().end(&out.path(), EndReason::Finished).await?;
                        return Ok(CommandResult::running());
                    }
                    Ok(CommandResult::succeeded(json!({"summary": "3 findings"})))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let st = store.submit(&q, Command::new("write", json!({})).with_output(OutputSpec::default())).await.unwrap();
    let done = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(
        (done.status, done.result.as_ref().map(|r| r.get())),
        (CommandStatus::Succeeded, Some(r#"{"summary":"3 findings"}"#))
    );
    assert_eq!(checks.load(Ordering::SeqCst), 2);
    let path = st.output.unwrap().stream;
    assert_eq!(records(&streams, &path).await, vec![r#""working""#]);
    assert_eq!(end_of(&streams, &path).await, Some(EndReason::Finished));
    svc.close().await;
}

/// A cancel racing a handler that finishes its stream and returns its result: exactly one end,
/// and the command's status matches it (CANCELLED ⇔ cancelled).
///
/// Was: a cancel whose compare-and-set landed after the producer finished the stream (before the
/// handler's result was written), or whose stream end came after the producer's finish, left the
/// command CANCELLED with its stream ended `finished`.
async fn a_cancel_racing_the_finish_agrees_with_the_stream(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-race");
    let svc = CommandService::builder(store.clone(), &q)
        .settings(baton_commands::QueueSettings { concurrency: 32, ..fast() })
        .handler(
            "write",
            on_execute(|c: Command| async move {
                let delay = c.params_as::<serde_json::Value>()?["d"].as_u64().unwrap_or(0);
                let out = c.output().unwrap().open().await?;
                out.append_json(&json!("start")).await?;
                tokio::time::sleep(Duration::from_millis(delay)).await;
                let _ = out.producer().finish().await;
                Ok(CommandResult::succeeded(json!("done")))
            }),
        )
        .start()
        .await
        .unwrap();
    let mut ids = Vec::new();
    for i in 0..30u64 {
        let st = store
            .submit(&q, Command::new("write", json!({ "d": 30 + i % 5 })).with_output(OutputSpec::default()))
            .await
            .unwrap();
        ids.push((st.id.clone(), st.output.unwrap().stream, i));
    }
    let mut cancels = Vec::new();
    for (id, path, i) in &ids {
        let (store, streams, id, path, i) = (store.clone(), streams.clone(), id.clone(), path.clone(), *i);
        cancels.push(tokio::spawn(async move {
            eventually(Duration::from_secs(5), || async { (!records(&streams, &path).await.is_empty()).then_some(()) })
                .await
                .expect("started");
            tokio::time::sleep(Duration::from_millis(25 + i % 12)).await;
            let _ = store.cancel(&id).await;
        }));
    }
    for c in cancels {
        c.await.unwrap();
    }
    let mut bad = Vec::new();
    let mut seen = Vec::new();
    for (id, path, _) in &ids {
        let done = store.wait(id, Duration::from_secs(10)).await.unwrap();
        let end = end_of(&streams, path).await;
        let agree = matches!(
            (done.status, end),
            (CommandStatus::Cancelled, Some(EndReason::Cancelled))
                | (CommandStatus::Succeeded, Some(EndReason::Finished))
        );
        if !agree {
            bad.push((done.status, end));
        }
        seen.push(done.status);
    }
    // Both outcomes were seen (the race was run, not one side of it).
    eprintln!("outcomes: {seen:?}");
    assert!(bad.is_empty(), "status and stream end disagree: {bad:?}");
    svc.close().await;
}

/// The silence timeout is a producer's: a command that waits in its queue longer than it (a
/// backlog, no worker yet) still runs, and its output is written. Was: the stream, made at
/// submit, ended `producer_lost` before any handler ran, failing the command.
async fn a_command_waiting_longer_than_its_silence_timeout_runs(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-backlog");
    let spec = OutputSpec { silence_timeout: Some(Duration::from_millis(300)), ..OutputSpec::default() };
    let st = store.submit(&q, Command::new("write", json!({})).with_output(spec)).await.unwrap();
    let path = st.output.clone().unwrap().stream;
    // Nobody works the queue for a while; readers look at the stream meanwhile.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(end_of(&streams, &path).await, None, "no producer yet: nothing was lost");
    }
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "write",
            on_execute(|c: Command| async move {
                c.output().unwrap().open().await?.append_json(&json!("hello")).await?;
                Ok(CommandResult::succeeded(json!("ok")))
            }),
        )
        .start()
        .await
        .unwrap();
    let done = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((done.status, done.error), (CommandStatus::Succeeded, None));
    assert_eq!(records(&streams, &path).await, vec![r#""hello""#]);
    assert_eq!(end_of(&streams, &path).await, Some(EndReason::Finished));
    svc.close().await;
}

/// A re-run while the cancelled run's handler still writes and then returns a result: the old
/// writer is refused by its ended stream, its result is refused by the command, and the new
/// run's stream holds only the new run's output.
async fn a_rerun_while_the_old_run_still_writes(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-rerun-race");
    let refused = Arc::new(AtomicU32::new(0));
    let r2 = refused.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(baton_commands::QueueSettings { concurrency: 4, ..fast() })
        .handler(
            "write",
            on_execute(move |c: Command| {
                let refused = r2.clone();
                async move {
                    let run = c.output().unwrap().link().run;
                    let out = c.output().unwrap().open().await?;
                    out.append_json(&json!({ "run": run, "i": 0 })).await?;
                    if run == 1 {
                        // Ignores the cancel: keeps writing for a while, then claims success.
                        for i in 1..20 {
                            tokio::time::sleep(Duration::from_millis(30)).await;
                            if out.append_json(&json!({ "run": 1, "i": i })).await.is_err() {
                                refused.fetch_add(1, Ordering::SeqCst);
                            }
                        }
                        return Ok(CommandResult::succeeded(json!("old")));
                    }
                    Ok(CommandResult::succeeded(json!("new")))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let st = store.submit(&q, Command::new("write", json!({})).with_output(OutputSpec::default())).await.unwrap();
    let first = st.output.clone().unwrap().stream;
    eventually(Duration::from_secs(5), || async { (!records(&streams, &first).await.is_empty()).then_some(()) })
        .await
        .expect("run 1 writes");
    assert_eq!(store.cancel(&st.id).await.unwrap().status, CommandStatus::Cancelled);
    let rerun = store.retry(&st.id).await.unwrap();
    let second = rerun.output.unwrap().stream;
    let done = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((done.status, done.result.as_ref().map(|r| r.get())), (CommandStatus::Succeeded, Some(r#""new""#)));
    // Run 1's handler finishes later: its result changes nothing.
    eventually(Duration::from_secs(5), || async { (refused.load(Ordering::SeqCst) == 19).then_some(()) })
        .await
        .expect("every append of run 1 after the cancel was refused");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let later = store.get(&st.id).await.unwrap().unwrap();
    assert_eq!((later.status, later.result.as_ref().map(|r| r.get())), (CommandStatus::Succeeded, Some(r#""new""#)));
    assert_eq!(end_of(&streams, &first).await, Some(EndReason::Cancelled));
    assert_eq!(records(&streams, &first).await, vec![r#"{"i":0,"run":1}"#]);
    assert_eq!(records(&streams, &second).await, vec![r#"{"i":0,"run":2}"#]);
    assert_eq!(end_of(&streams, &second).await, Some(EndReason::Finished));
    svc.close().await;
}

/// A cancel racing the handler's own terminal write (the handler leaves its stream open and
/// returns `SUCCEEDED` or `FAILED`): whichever ends the stream first decides, so every command's
/// status matches its stream's end: `SUCCEEDED` ⇔ `finished` without an error entry, `FAILED` ⇔
/// `finished` after an error entry (or `producer_lost`), `CANCELLED` ⇔ `cancelled`.
///
/// Was: the terminal write read the stream's head, wrote the state by compare-and-set and only
/// then ended the stream; a cancel that ended the stream `cancelled` between the read and the
/// write lost its own compare-and-set, and the command ended `SUCCEEDED` (or `FAILED`) with a
/// `cancelled` stream.
async fn a_cancel_racing_the_handlers_terminal_write_agrees_with_the_stream(b: TestBackend) {
    use rand::Rng;
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-terminal-race");
    // The handler tells when it is about to return; both it and the cancel then wait a random
    // few microseconds.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(baton_commands::QueueSettings { concurrency: 16, ..fast() })
        .handler(
            "write",
            on_execute(move |c: Command| {
                let tx = tx.clone();
                async move {
                    let fail = c.params_as::<serde_json::Value>()?["fail"].as_bool().unwrap_or(false);
                    let out = c.output().unwrap().open().await?;
                    out.append_json(&json!("start")).await?;
                    let _ = tx.send(c.id.clone());
                    let spins = rand::rng().random_range(0..10u32);
                    for _ in 0..spins {
                        tokio::task::yield_now().await;
                    }
                    if fail {
                        return Ok(CommandResult::failed("disk full"));
                    }
                    Ok(CommandResult::succeeded(json!("done")))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    // Memory's window is a few microseconds wide (no I/O): more rounds, narrower jitter.
    let (n, max_yields, max_spins) =
        if matches!(b, TestBackend::Memory) { (6000, 10, 3000) } else { (400, 40, 20_000) };
    let canceller = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut tasks = Vec::new();
            for _ in 0..n {
                let Some(id) = rx.recv().await else { break };
                let store = store.clone();
                let (yields, spins) = {
                    let mut r = rand::rng();
                    (r.random_range(0..max_yields), r.random_range(0..max_spins))
                };
                tasks.push(tokio::spawn(async move {
                    for _ in 0..yields {
                        tokio::task::yield_now().await;
                    }
                    for _ in 0..spins {
                        std::hint::spin_loop();
                    }
                    let _ = store.cancel(&id).await;
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        })
    };
    let mut ids = Vec::new();
    for i in 0..n {
        let cmd = Command::new("write", json!({ "fail": i % 2 == 1 })).with_output(OutputSpec::default());
        let st = store.submit(&q, cmd).await.unwrap();
        ids.push((st.id.clone(), st.output.unwrap().stream));
    }
    tokio::time::timeout(Duration::from_secs(60), canceller).await.expect("every handler ran").unwrap();
    let mut bad = Vec::new();
    let mut seen = std::collections::BTreeMap::new();
    for (id, path) in &ids {
        let done = store.wait(id, Duration::from_secs(10)).await.unwrap();
        let end = end_of(&streams, path).await;
        let last = records(&streams, path).await.pop();
        let error_entry = last.as_deref() == Some(r#"{"error":"disk full"}"#);
        let agree = match done.status {
            CommandStatus::Succeeded => end == Some(EndReason::Finished) && !error_entry,
            CommandStatus::Failed => {
                (end == Some(EndReason::Finished) && error_entry) || end == Some(EndReason::ProducerLost)
            }
            CommandStatus::Cancelled => end == Some(EndReason::Cancelled) && !error_entry,
            _ => false,
        };
        if !agree {
            bad.push((done.status, end, last));
        }
        *seen.entry(format!("{:?}", done.status)).or_insert(0) += 1;
    }
    eprintln!("outcomes: {seen:?}; disagreeing: {}", bad.len());
    assert!(bad.is_empty(), "{} of {n} commands' status and stream end disagree: {bad:?}", bad.len());
    svc.close().await;
}

/// The terminal write's end of an output is fenced to the delivery's epoch of the output's
/// producer: a remote worker whose claim was taken over (a later claim opened the output with a
/// newer epoch) cannot end the output of the live delivery; its settlement is refused
/// (`LeaseLost`) and writes nothing, and the live worker's outcome decides.
async fn a_superseded_remote_worker_cannot_end_the_output(b: TestBackend) {
    use baton_commands::{RemoteOutcome, RemoteSettled, RemoteWorkers};
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-remote-fence");
    let w = RemoteWorkers::new(store.clone(), &q, fast()).unwrap();
    let st = store.submit(&q, Command::new("t", json!({})).with_output(OutputSpec::default())).await.unwrap();
    let path = st.output.unwrap().stream;
    let c1 = w.claim("silent", 1, Duration::from_secs(1)).await.unwrap();
    assert_eq!(c1[0].output_epoch, Some(0));
    // `silent` never renews: after the claim timeout (2 s) `alive` gets the command.
    let c2 = w.claim("alive", 1, Duration::from_secs(6)).await.unwrap();
    assert_eq!((c2[0].command.id.as_str(), c2[0].output_epoch), (st.id.as_str(), Some(1)));
    let stale = w.settle("silent", &c1[0].lease, RemoteOutcome::Result(CommandResult::failed("stale"))).await;
    assert!(
        matches!(stale, Err(CommandError::Queue(baton_queue::QueueError::LeaseLost(_)))),
        "the superseded worker's settlement is refused: {stale:?}"
    );
    assert_eq!(end_of(&streams, &path).await, None, "the live delivery's output is not ended by the stale one");
    assert_eq!(records(&streams, &path).await, Vec::<String>::new());
    let s = w.settle("alive", &c2[0].lease, RemoteOutcome::Result(CommandResult::succeeded(json!("alive")))).await;
    let Ok(RemoteSettled::Applied(done)) = s else { panic!("{s:?}") };
    assert_eq!((done.status, done.result.as_ref().map(|r| r.get())), (CommandStatus::Succeeded, Some(r#""alive""#)));
    assert_eq!(end_of(&streams, &path).await, Some(EndReason::Finished));
    assert_eq!(records(&streams, &path).await, Vec::<String>::new());
}

/// An in-process handler whose lease was lost (it ran past `max_processing_time`) and whose
/// command was taken over by a delivery that opened the output: its result is refused and it
/// cannot end the live delivery's output; the live delivery's outcome decides.
async fn a_handler_that_lost_its_lease_cannot_end_the_output(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-lease-lost");
    let calls = Arc::new(AtomicU32::new(0));
    let taken_over = Arc::new(tokio::sync::Notify::new());
    let (c2, t2) = (calls.clone(), taken_over.clone());
    let service = |calls: Arc<AtomicU32>, taken_over: Arc<tokio::sync::Notify>| {
        CommandService::builder(store.clone(), &q)
            .settings(baton_commands::QueueSettings {
                concurrency: 4,
                claim_timeout: Duration::from_millis(600),
                max_processing_time: Duration::from_millis(400),
                poll_interval: Some(Duration::from_millis(50)),
                ..fast()
            })
            .handler(
                "write",
                on_execute(move |c: Command| {
                    let (n, taken_over) = (calls.fetch_add(1, Ordering::SeqCst), taken_over.clone());
                    async move {
                        let out = c.output().unwrap().open().await?;
                        if n == 0 {
                            out.append_json(&json!("first")).await?;
                            // Runs past max_processing_time until the next delivery has opened the output.
                            taken_over.notified().await;
                            return Ok(CommandResult::succeeded(json!("stale")));
                        }
                        out.append_json(&json!("second")).await?;
                        taken_over.notify_one();
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        Ok(CommandResult::failed("live"))
                    }
                }),
            )
            .start()
    };
    // Two instances: the one that takes the command over is another consumer.
    let svc = service(c2.clone(), t2.clone()).await.unwrap();
    let other = service(c2, t2).await.unwrap();
    let st = store.submit(&q, Command::new("write", json!({})).with_output(OutputSpec::default())).await.unwrap();
    let path = st.output.unwrap().stream;
    // The stale delivery returned while the live one still runs: nothing of it was written.
    eventually(Duration::from_secs(10), || async { (calls.load(Ordering::SeqCst) == 2).then_some(()) })
        .await
        .expect("taken over");
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(end_of(&streams, &path).await, None, "the stale delivery did not end the live one's output");
    assert!(!store.get(&st.id).await.unwrap().unwrap().status.is_terminal());
    let done = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((done.status, done.error.as_deref()), (CommandStatus::Failed, Some("live")));
    assert_eq!(end_of(&streams, &path).await, Some(EndReason::Finished));
    assert_eq!(records(&streams, &path).await, vec![r#""first""#, r#""second""#, r#"{"error":"live"}"#]);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    svc.close().await;
    other.close().await;
}

/// A handler that filled its output to the stream's `max_len` (1,000,000 messages) and then
/// fails: the error entry of its FAILED end must not be refused as one message too many (that
/// left the end undone, the delivery retried every second and the handler called again, forever:
/// the command never settled).
async fn a_command_failing_with_a_full_output_fails_once(b: TestBackend) {
    let (store, streams) = setup(&b).await;
    let q = queue_name("output-full");
    let calls = Arc::new(AtomicU32::new(0));
    let c2 = calls.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "write",
            on_execute(move |c: Command| {
                let calls = c2.clone();
                async move {
                    if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                        // One append of an array of 1,000,000 values: the stream is full.
                        let mut body = String::with_capacity(2_000_002);
                        body.push('[');
                        for i in 0..1_000_000 {
                            if i > 0 {
                                body.push(',');
                            }
                            body.push('0');
                        }
                        body.push(']');
                        c.output().unwrap().open().await?.append(body).await?;
                    }
                    Ok(CommandResult::failed("disk full"))
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let st = store.submit(&q, Command::new("write", json!({})).with_output(OutputSpec::default())).await.unwrap();
    let path = st.output.clone().unwrap().stream;
    let done = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((done.status, done.error.as_deref()), (CommandStatus::Failed, Some("disk full")));
    assert_eq!(end_of(&streams, &path).await, Some(EndReason::Finished));
    let p = StreamPath::new(&path).unwrap();
    let mut from = ReadFrom::Start;
    let mut last = None;
    loop {
        let chunk = streams.read(&p, from).await.unwrap();
        if let Some(r) = chunk.records.last() {
            last = Some(String::from_utf8(r.data.to_vec()).unwrap());
        }
        if chunk.up_to_date || chunk.records.is_empty() {
            break;
        }
        from = ReadFrom::At(chunk.next_offset);
    }
    assert_eq!(last.as_deref(), Some(r#"{"error":"disk full"}"#));
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler was called once");
    svc.close().await;
}
