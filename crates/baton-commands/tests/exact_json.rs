//! Params and results come back exactly as given, through the Rust API, on memory, Redis
//! standalone and a 3-master Redis Cluster: numbers of any size and precision, escapes and key
//! order, byte for byte; idempotent resubmits compare on meaning. And `started_at` is set for
//! every command a handler ran.

use crate::common;

use std::time::Duration;

use baton_commands::{Command, CommandError, CommandResult, CommandService, CommandStatus, ListQuery, RawJson};
use baton_testkit::exact_json;
use baton_testkit::TestBackend;
use common::*;

baton_testkit::on_every_backend!(
    params_and_results_come_back_byte_for_byte,
    resubmits_compare_on_meaning,
    started_at_is_set_when_a_handler_ran,
);

fn raw(s: &str) -> RawJson {
    RawJson::from_string(s.to_string()).expect("JSON")
}

/// A handler's own result text: beyond `f64`, beyond 128 bits, escapes, key order.
const ANSWER: &str = r#"{"pi": 3.14159265358979323846264338327950288, "n": 340282366920938463463374607431768211457, "m": 340282366920938463463374607431768211455, "s": "\u00e9\ud83d\ude00", "a": [0.10, 1E+2]}"#;

async fn params_and_results_come_back_byte_for_byte(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("exact");
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler("echo", on_execute(|c: Command| async move { Ok(CommandResult::succeeded(c.params)) }))
        .handler("answer", on_execute(|_c: Command| async move { Ok(CommandResult::succeeded(raw(ANSWER))) }))
        .start()
        .await
        .unwrap();
    let sample = exact_json::sample(10_000, 7);

    let submitted = store.submit(&q, Command::with_id("exact-1", "echo", raw(&sample.text))).await.unwrap();
    assert!(submitted.params.get() == sample.text, "submit returns the params as given");
    let read = store.get("exact-1").await.unwrap().expect("stored");
    assert!(read.params.get() == sample.text, "get returns the params as given");
    let done = store.wait("exact-1", Duration::from_secs(20)).await.unwrap();
    assert_eq!(done.status, CommandStatus::Succeeded, "{:?}", done.error);
    assert!(done.params.get() == sample.text);
    assert!(done.result.as_ref().map(RawJson::get) == Some(sample.text.as_str()), "the echoed result is exact");
    // Read by another store (Redis: its own connections, as another process).
    let other = other_store(&b, &store).await;
    let there = other.get("exact-1").await.unwrap().expect("stored");
    assert!(there.params.get() == sample.text && there.result.as_ref().map(RawJson::get) == Some(&*sample.text));
    // Listed.
    let page = store.list(&q, ListQuery::default()).await.unwrap();
    assert!(page.items[0].params.get() == sample.text);

    // A result the handler wrote as text.
    let st =
        store.submit_and_wait(&q, Command::with_id("exact-2", "answer", raw("null")), Duration::from_secs(20)).await;
    let st = st.unwrap();
    assert_eq!(st.result.as_ref().map(RawJson::get), Some(ANSWER));
    assert_eq!(other.get("exact-2").await.unwrap().unwrap().result.as_ref().map(RawJson::get), Some(ANSWER));
    // Typed reads decode from the text: no rounding through f64 for a u128.
    #[derive(serde::Deserialize)]
    struct Answer {
        m: u128,
        s: String,
    }
    let a: Answer = st.result_as().unwrap();
    assert_eq!((a.m, a.s.as_str()), (u128::MAX, "é😀"));
    // Every integer form, alone.
    for (i, text) in ["18446744073709551615", "-9223372036854775809", "123456789012345678901234567890", "\"\\u00e9\""]
        .into_iter()
        .enumerate()
    {
        let st = store
            .submit_and_wait(&q, Command::with_id(format!("exact-int-{i}"), "echo", raw(text)), Duration::from_secs(20))
            .await
            .unwrap();
        assert_eq!((st.params.get(), st.result.as_ref().map(RawJson::get)), (text, Some(text)));
    }
    svc.close().await;
}

async fn resubmits_compare_on_meaning(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("meaning");
    let sample = exact_json::sample(1_000, 11);
    let (first, created) = store.submit_created(&q, Command::with_id("m-1", "t", raw(&sample.text))).await.unwrap();
    assert!(created);
    // The same meaning written otherwise: the same command, the first text kept.
    let (again, created) =
        store.submit_created(&q, Command::with_id("m-1", "t", raw(&sample.same_meaning))).await.unwrap();
    assert!(!created, "same meaning is the same command");
    assert!(again.params.get() == sample.text && again.created_at == first.created_at);
    // One float one digit off: another command.
    let e = store.submit(&q, Command::with_id("m-1", "t", raw(&sample.different))).await.unwrap_err();
    assert!(matches!(e, CommandError::Conflict { .. }), "{e}");
    // Integer and fraction are different kinds; 0.1 and 0.10 the same value.
    store.submit(&q, Command::with_id("m-2", "t", raw(r#"{"n": 1, "x": 0.1}"#))).await.unwrap();
    let (_, created) =
        store.submit_created(&q, Command::with_id("m-2", "t", raw(r#"{"x":0.10,"n":1}"#))).await.unwrap();
    assert!(!created);
    let e = store.submit(&q, Command::with_id("m-2", "t", raw(r#"{"n": 1.0, "x": 0.1}"#))).await.unwrap_err();
    assert!(matches!(e, CommandError::Conflict { .. }), "{e}");
    // Beyond 64 bits, integers compare exactly.
    store.submit(&q, Command::with_id("m-3", "t", raw("123456789012345678901234567890"))).await.unwrap();
    let e = store.submit(&q, Command::with_id("m-3", "t", raw("123456789012345678901234567891"))).await.unwrap_err();
    assert!(matches!(e, CommandError::Conflict { .. }), "{e}");
    // A lone surrogate does not decode: refused before anything is stored.
    let e = store.submit(&q, Command::with_id("m-4", "t", raw(r#""\ud83d""#))).await.unwrap_err();
    assert!(matches!(e, CommandError::InvalidParams(_)), "{e}");
    assert!(store.get("m-4").await.unwrap().is_none());
}

/// A command that a handler ran has a start time: finished by `execute` alone (succeeded,
/// failed, cancelled by the handler), or after a retried error; no handler: none.
async fn started_at_is_set_when_a_handler_ran(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("started");
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "slow",
            on_execute(|_c: Command| async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                Ok(CommandResult::succeeded(serde_json::json!(1)))
            }),
        )
        .handler("fail", on_execute(|_c: Command| async move { Ok(CommandResult::failed("no")) }))
        .handler("stop", on_execute(|_c: Command| async move { Ok(CommandResult::cancelled()) }))
        .start()
        .await
        .unwrap();
    let wait = Duration::from_secs(20);
    let st = store.submit_and_wait(&q, Command::with_id("s-slow", "slow", raw("null")), wait).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    let started = st.started_at.expect("a command that ran has a start time");
    assert!(started >= st.created_at && started <= st.completed_at.unwrap(), "{st:?}");
    // The start of the call, not its end: the handler took 200 ms.
    assert!(st.completed_at.unwrap().millis() - started.millis() >= 150, "{st:?}");
    for t in ["fail", "stop"] {
        let st = store.submit_and_wait(&q, Command::with_id(format!("s-{t}"), t, raw("null")), wait).await.unwrap();
        assert!(st.status.is_terminal() && st.started_at.is_some(), "{st:?}");
    }
    let st = store.submit_and_wait(&q, Command::with_id("s-none", "nobody", raw("null")), wait).await.unwrap();
    assert_eq!((st.status, st.started_at), (CommandStatus::Failed, None), "no handler ran: {st:?}");
    svc.close().await;
}

/// A Redis state written by a version before exact params carries the hash of the old canonical
/// body (params read as a `Value`, keys sorted): a resubmit of the same meaning by that rule is
/// still the same command, not a conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_hashed_by_an_older_version_stays_idempotent() {
    baton_testkit::require_redis();
    let b = TestBackend::Standalone(baton_testkit::RedisServer::start());
    let TestBackend::Standalone(server) = &b else { unreachable!() };
    let store = store_for(&b).await;
    let q = queue_name("legacy");
    store.submit(&q, Command::with_id("l-1", "t", raw(r#"{"b": 1.50, "a": "\u00e9"}"#))).await.unwrap();
    // Rewrite the header's hash (`<version> <STATUS> <created ms> <sha1> <JSON>`) as the older
    // versions computed it.
    let key = format!("baton:cmd:{{{q}}}:id:l-1");
    let stored = server.cli(&["GET", &key]);
    let old = sha1_smol::Sha1::from("\"t\"\n{\"a\":\"é\",\"b\":1.5}").digest().to_string();
    let mut parts: Vec<&str> = stored.splitn(5, ' ').collect();
    parts[3] = &old;
    assert_eq!(server.cli(&["SET", &key, &parts.join(" "), "KEEPTTL"]), "OK");
    let (st, created) =
        store.submit_created(&q, Command::with_id("l-1", "t", raw(r#"{"a":"é","b":1.5}"#))).await.unwrap();
    assert!(!created, "the same command by the older rule");
    assert_eq!(st.params.get(), r#"{"b": 1.50, "a": "\u00e9"}"#);
    let e = store.submit(&q, Command::with_id("l-1", "t", raw(r#"{"a":"é","b":1.6}"#))).await.unwrap_err();
    assert!(matches!(e, CommandError::Conflict { .. }), "{e}");
}
