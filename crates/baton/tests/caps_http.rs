//! Concurrency keys over HTTP: `concurrency_key` on submit, shown in the state; a queue configured
//! with `concurrency_per_key = 1` runs the commands of one key one after the other, other keys
//! beside them; bad keys are refused naming the field; on every backend.

mod common;

use std::time::{Duration, SystemTime};

use baton::settings::default_queues;
use baton_testkit::{on_every_backend, TestBackend};
use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

async fn send(srv: &TestServer, method: reqwest::Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
    let mut rb = client().request(method, format!("{}{path}", srv.base));
    if let Some(b) = body {
        rb = rb.header("content-type", "application/json").body(b.to_string());
    }
    let res = rb.send().await.expect("request");
    let status = res.status();
    let text = res.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

fn time(v: &Value) -> SystemTime {
    humantime::parse_rfc3339(v.as_str().unwrap_or_else(|| panic!("not a time: {v}"))).unwrap()
}

async fn concurrency_keys_over_http(backend: TestBackend) {
    let name = backend.name();
    let srv = start(backend, |c| {
        c.queues = default_queues();
        for q in &mut c.queues {
            q.settings.concurrency_per_key = Some(1);
        }
    })
    .await;
    let submit = |id: &'static str, ms: u64, key: &'static str| json!({"id": id, "type": "sleep", "params": {"ms": ms}, "concurrency_key": key});
    let post = reqwest::Method::POST;
    for (id, ms, key) in [("a1", 600, "tenant-a"), ("a2", 100, "tenant-a"), ("b1", 600, "tenant-b")] {
        let (s, st) = send(&srv, post.clone(), "/v1/queues/default/commands", Some(submit(id, ms, key))).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{name}: {st}");
        assert_eq!(st["concurrency_key"], key);
    }
    let mut done = std::collections::HashMap::new();
    for id in ["a1", "a2", "b1"] {
        let (s, st) = send(&srv, reqwest::Method::GET, &format!("/v1/commands/{id}?wait=20s"), None).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(st["status"], "SUCCEEDED", "{name}: {st}");
        done.insert(id, st);
    }
    let (a1, a2, b1) = (&done["a1"], &done["a2"], &done["b1"]);
    assert!(time(&a2["started_at"]) >= time(&a1["completed_at"]), "{name}: a2 started before a1 ended: {a1} {a2}");
    assert!(time(&b1["started_at"]) < time(&a1["completed_at"]), "{name}: b1 waited for tenant-a: {a1} {b1}");
    assert_eq!(a2["concurrency_key"], "tenant-a");
    // Bad keys: 400 naming the field, nothing stored.
    for (key, msg) in [
        (json!(7), "\"concurrency_key\" must be a string (1 to 256 bytes); got a number"),
        (json!(""), "\"concurrency_key\" must be 1 to 256 bytes without control characters; got 0 bytes"),
        (
            json!("k".repeat(257)),
            "\"concurrency_key\" must be 1 to 256 bytes without control characters; got 257 bytes",
        ),
    ] {
        let body = json!({"id": "bad", "type": "echo", "concurrency_key": key});
        let (s, e) = send(&srv, post.clone(), "/v1/queues/default/commands", Some(body)).await;
        assert_eq!(
            (s, e["error"].as_str(), e["message"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid_body"), Some(msg))
        );
    }
    let (s, _) = send(&srv, reqwest::Method::GET, "/v1/commands/bad", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    tokio::time::sleep(Duration::from_millis(10)).await;
    srv.stop().await;
}

on_every_backend!(concurrency_keys_over_http);
