//! Attacks on `POST /v1/queues/{queue}/commands/batch`: malformed bodies (whole and per
//! item), a client that disconnects mid-request, and `baton serve` killed (SIGKILL) during a
//! big batch; afterwards the same batch again must leave every command stored once, run once.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use baton::settings::default_queues;
use baton_testkit::{on_memory_and_standalone, TestBackend};
use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

const BATCH: &str = "/v1/queues/default/commands/batch";
const SUBMIT: &str = "/v1/queues/default/commands";

async fn serve(backend: TestBackend, tweak: impl FnOnce(&mut baton::settings::ServeConfig)) -> TestServer {
    start(backend, |c| {
        c.queues = default_queues();
        tweak(c)
    })
    .await
}

/// What `item` (raw JSON text) gets as a submit alone, as a batch result.
async fn alone_raw(srv: &TestServer, item: &str) -> Value {
    submitted_alone(&srv.base, SUBMIT, item).await
}

/// `commands` of every wrong kind: the whole request is refused, saying what it got.
async fn whole_request_shapes(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    for (body, got) in [
        (r#"{"commands": null}"#, "null"),
        (r#"{"commands": "x"}"#, "a string"),
        (r#"{"commands": 5}"#, "a number"),
        (r#"{"commands": true}"#, "a boolean"),
        (r#"{"commands": {"type": "echo"}}"#, "an object"),
    ] {
        let (s, e) = post_raw(&srv.base, BATCH, body.to_string()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}: {e}");
        assert_eq!(e["error"], "invalid_body", "{body}: {e}");
        let m = e["message"].as_str().unwrap();
        assert!(m.contains("\"commands\" must be an array of submit bodies"), "{body}: {m}");
        assert!(m.contains(got), "{body}: {m} (want {got})");
    }
    for body in ["[]", "5", "\"commands\"", "null", "[{\"type\": \"echo\"}]"] {
        let (s, e) = post_raw(&srv.base, BATCH, body.to_string()).await;
        assert_eq!((s, &e["error"]), (StatusCode::BAD_REQUEST, &json!("invalid_body")), "{body}: {e}");
    }
    for body in ["", "{", "{\"commands\": [}", "{\"commands\": [{\"type\": \"echo\"}]} x", "\u{feff}{\"commands\": []}"]
    {
        let (s, e) = post_raw(&srv.base, BATCH, body.to_string()).await;
        assert_eq!((s, &e["error"]), (StatusCode::BAD_REQUEST, &json!("invalid_json")), "{body:?}: {e}");
    }
    // Not UTF-8: a whole-request error, nothing stored.
    let res = client()
        .post(format!("{}{BATCH}", srv.base))
        .header("content-type", "application/json")
        .body(b"{\"commands\": [{\"type\": \"echo\", \"params\": \"\xff\"}]}".to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let (_, c) = get(&srv, "/v1/queues/default/commands").await;
    assert_eq!(c["items"].as_array().map(|a| a.len()), Some(0), "{c}");
}

/// Items of every odd shape: each gets exactly what it gets alone (refusals), or is created
/// once with its params as sent (the alone submit afterwards answers 200 with the same state).
async fn odd_items_as_alone(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    let deep = |n: usize| format!(r#"{{"type": "echo", "params": {}{}}}"#, "[".repeat(n), "]".repeat(n));
    let (deep_ok, deep_bad) = (deep(120), deep(300));
    let items: Vec<&str> = vec![
        &deep_ok,
        &deep_bad,
        "[1, 2]",
        "3",
        "\"echo\"",
        "null",
        "true",
        "{}",
        r#"{"type": 5}"#,
        r#"{"type": ["echo"]}"#,
        r#"{"type": null}"#,
        r#"{"type": "echo", "id": {"a": 1}}"#,
        r#"{"type": "echo", "id": 12}"#,
        r#"{"type": "echo", "id": ""}"#,
        r#"{"type": "echo", "priority": 1e3}"#,
        r#"{"type": "echo", "priority": 300}"#,
        r#"{"type": "echo", "priority": "1"}"#,
        r#"{"type": "echo", "priority": 1.5}"#,
        r#"{"type": "echo", "run_at": []}"#,
        r#"{"type": "echo", "run_at": "yesterday"}"#,
        r#"{"type": "echo", "delay": -5}"#,
        r#"{"type": "echo", "delay": "1h", "run_at": "2030-01-01T00:00:00Z"}"#,
        r#"{"type": "echo", "output": 5}"#,
        r#"{"type": "echo", "output": {"content_type": 7}}"#,
        r#"{"type": "echo", "concurrency_key": 7}"#,
        r#"{"type": "echo", "concurrency_key": ""}"#,
        r#"{"type": "echo", "extra": 1}"#,
        r#"{"type": "echo", "type": "nope"}"#,
        r#"{"type": "nope", "type": "echo", "id": "dupkey-1"}"#,
        r#"{"type": "echo", "id": "huge-1", "params": {"a": 123456789012345678901234567890123456789, "b": 1e300, "c": -0.0, "d": 1E-300}}"#,
        r#"{"type": "echo", "id": "esc-1", "params": {"k\u0065y": "\u00e9\n", "key2": "é"}}"#,
    ];
    let body = format!("{{\"commands\": [{}]}}", items.join(","));
    let (s, report) = post_raw(&srv.base, BATCH, body).await;
    assert_eq!(s, StatusCode::OK, "{report}");
    let results = report["results"].as_array().unwrap_or_else(|| panic!("{report}")).clone();
    assert_eq!(results.len(), items.len());
    for (i, (item, r)) in items.iter().zip(&results).enumerate() {
        let status = r["status"].as_u64().unwrap();
        if status >= 400 {
            assert_eq!(r, &alone_raw(&srv, item).await, "item {i}: {item}");
        } else {
            assert_eq!(status, 202, "item {i}: {item}: {r}");
            let id = r["state"]["id"].as_str().unwrap();
            if items[i].contains("\"id\"") {
                // The alone submit of the same body finds it: 200, the same state.
                let a = alone_raw(&srv, item).await;
                assert_eq!(a["status"], 200, "item {i}: {item}: {a}");
                assert_eq!(a["state"]["params"], r["state"]["params"], "item {i}");
                assert_eq!(a["state"]["id"], id);
            }
        }
    }
    // Exact params: the huge integer as sent (the raw response text).
    let text = client().get(format!("{}/v1/commands/huge-1", srv.base)).send().await.unwrap().text().await.unwrap();
    assert!(text.contains(r#"{"a": 123456789012345678901234567890123456789, "b": 1e300"#), "{text}");
}

on_memory_and_standalone!(whole_request_shapes, odd_items_as_alone);

/// 1000 items, each sent by a raw client that closes its connection right after the body (or
/// halfway through it). Then the same batch again: every item 200 (stored already) or 202,
/// 1000 commands stored once each, every one runs once.
async fn client_gone_mid_request(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    let run = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
    );
    let items: Vec<Value> =
        (0..1000).map(|i| json!({"id": format!("g{i}-{run}"), "type": "echo", "params": {"i": i}})).collect();
    let body = json!({ "commands": items }).to_string();
    let addr = srv.base.trim_start_matches("http://").to_string();
    for cut in [body.len() / 2, body.len(), body.len()] {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let head = format!(
            "POST {BATCH} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        use tokio::io::AsyncWriteExt;
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&body.as_bytes()[..cut]).await.unwrap();
        s.flush().await.unwrap();
        // Gone at once (full body: the batch may be deciding now).
        tokio::time::sleep(Duration::from_millis(if cut == body.len() { 5 } else { 0 })).await;
        drop(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (s, report) = post_raw(&srv.base, BATCH, body.clone()).await;
    assert_eq!(s, StatusCode::OK, "{report}");
    let results = report["results"].as_array().unwrap();
    for (i, r) in results.iter().enumerate() {
        let st = r["status"].as_u64().unwrap();
        assert!(st == 200 || st == 202, "item {i}: {r}");
        assert_eq!(r["state"]["id"], json!(format!("g{i}-{run}")), "item {i}");
    }
    // Each ran once: SUCCEEDED with its own params as result, version as for one run.
    let ok = baton_testkit::eventually(Duration::from_secs(30), || async {
        let (_, c) = get(&srv, "/v1/queues/default").await;
        (c["commands"]["succeeded"] == json!(1000)).then_some(())
    })
    .await;
    let (_, c) = get(&srv, "/v1/queues/default").await;
    assert!(ok.is_some(), "not all ran: {c}");
    for i in [0, 499, 999] {
        let (_, st) = get(&srv, &format!("/v1/commands/g{i}-{run}")).await;
        assert_eq!((&st["status"], &st["attempts"]), (&json!("SUCCEEDED"), &json!(1)), "{st}");
    }
}

on_memory_and_standalone!(client_gone_mid_request);

/// `baton serve` (Redis) killed with SIGKILL while a batch of 1000 is being decided; a second
/// `baton serve` then gets the same batch: every item 200 or 202, every command stored once,
/// one message each, all run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_killed_mid_batch_then_resubmitted() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    let dir = std::env::temp_dir().join(format!("baton-batch-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("baton.toml");
    std::fs::write(&cfg, "[queues.jobs]\nclaim_timeout = \"1s\"\n[queues.jobs.handlers]\necho = \"echo\"\n").unwrap();
    let spawn = |workers: bool| {
        let port = baton_testkit::free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
        cmd.args(["serve", "--config", cfg.to_str().unwrap(), "--redis", &redis.url()])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env_remove("BATON_REDIS_CLUSTER")
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if !workers {
            cmd.arg("--no-workers");
        }
        let mut child = cmd.spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        out.read_line(&mut first).unwrap();
        assert!(first.contains("listening on"), "{first}");
        // Kept open: the server writes to it.
        (child, format!("http://127.0.0.1:{port}"), out)
    };
    let run = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
    );
    let items: Vec<Value> =
        (0..1000).map(|i| json!({"id": format!("s{i}-{run}"), "type": "echo", "params": {"i": i}})).collect();
    let body = json!({ "commands": items }).to_string();
    let (mut child, base, _out) = spawn(false);
    let path = "/v1/queues/jobs/commands/batch";
    let mut raw =
        baton_redis::redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let dbsize = |raw: &mut baton_redis::redis::aio::MultiplexedConnection| {
        let mut raw = raw.clone();
        async move { baton_redis::redis::cmd("DBSIZE").query_async::<u64>(&mut raw).await.unwrap() }
    };
    let base_keys = dbsize(&mut raw).await;
    let send = {
        let (base, body) = (base.clone(), body.clone());
        tokio::spawn(async move { client().post(format!("{base}{path}")).body(body).send().await })
    };
    // Killed once the batch has started storing (states and lookups appear), not before.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while dbsize(&mut raw).await < base_keys + 20 && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let first = send.await.unwrap();
    eprintln!("first batch: {:?}", first.as_ref().map(|r| r.status()));
    let (mut child, base, _out2) = spawn(true);
    let (s, report) = post_raw(&base, path, body).await;
    assert_eq!(s, StatusCode::OK, "{report}");
    let before = report["results"].as_array().unwrap().iter().filter(|r| r["status"] == 200).count();
    eprintln!("{before} of 1000 stored before the kill");
    for (i, r) in report["results"].as_array().unwrap().iter().enumerate() {
        let st = r["status"].as_u64().unwrap();
        assert!(st == 200 || st == 202, "item {i}: {r}");
    }
    let ok = baton_testkit::eventually(Duration::from_secs(30), || {
        let base = base.clone();
        async move {
            let (_, c) = get_raw(&base, "/v1/queues/jobs").await;
            (c["commands"]["succeeded"] == json!(1000)).then_some(())
        }
    })
    .await;
    let (_, c) = get_raw(&base, "/v1/queues/jobs").await;
    assert!(ok.is_some(), "not all ran: {c}");
    assert_eq!((&c["commands"]["total"], &c["length"]), (&json!(1000), &json!(0)), "{c}");
    for i in [0, 500, 999] {
        let (_, st) = get_raw(&base, &format!("/v1/commands/s{i}-{run}")).await;
        assert_eq!((&st["status"], &st["attempts"]), (&json!("SUCCEEDED"), &json!(1)), "{st}");
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let _ = std::io::stderr().flush();
    let _ = std::fs::remove_dir_all(&dir);
}

async fn get_raw(base: &str, path: &str) -> (StatusCode, Value) {
    let res = client().get(format!("{base}{path}")).send().await.unwrap();
    let s = res.status();
    (s, serde_json::from_str(&res.text().await.unwrap()).unwrap_or(Value::Null))
}
