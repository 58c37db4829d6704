//! Concurrency keys over HTTP: `concurrency_key` on submit, shown in the state; a queue configured
//! with `concurrency_per_key = 1` runs the commands of one key one after the other, other keys
//! beside them; bad keys are refused naming the field; on every backend.

use crate::common;

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

/// `rate_limit_per_key` through the command service: a key's commands start at its rate, and the
/// queue JSON counts each key's active, waiting and rate-delayed commands.
async fn per_key_rate_and_counts_over_http(backend: TestBackend) {
    let name = backend.name();
    let srv = start(backend, |c| {
        c.queues = default_queues();
        for q in &mut c.queues {
            q.settings.concurrency_per_key = Some(1);
            q.settings.rate_limit_per_key = Some(baton_queue::RateLimit::new(1, Duration::from_secs(1)).with_burst(1));
        }
    })
    .await;
    let submit = |id: &'static str, ms: u64, key: &'static str| json!({"id": id, "type": "sleep", "params": {"ms": ms}, "concurrency_key": key});
    let post = reqwest::Method::POST;
    for (id, ms, key) in
        [("a1", 1500, "tenant-a"), ("a2", 100, "tenant-a"), ("a3", 100, "tenant-a"), ("b1", 1500, "tenant-b")]
    {
        let (s, st) = send(&srv, post.clone(), "/v1/queues/default/commands", Some(submit(id, ms, key))).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{name}: {st}");
    }
    // While a1 and b1 run: a2 and a3 wait for tenant-a's slot.
    let mut q = Value::Null;
    for _ in 0..100 {
        let (s, body) = send(&srv, reqwest::Method::GET, "/v1/queues/default", None).await;
        assert_eq!(s, StatusCode::OK);
        if body["key_waiting"] == 2 && body["keys"].as_array().is_some_and(|k| k.len() == 2) {
            q = body;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(q["rate_limit_per_key"], json!({"limit": 1, "per_ms": 1000, "burst": 1}), "{name}: {q}");
    assert_eq!(q["key_rate_delayed"], 0, "{name}: {q}");
    assert_eq!(
        q["keys"],
        json!([{"key": "tenant-a", "active": 1, "waiting": 2, "rate_delayed": 0},
               {"key": "tenant-b", "active": 1, "waiting": 0, "rate_delayed": 0}]),
        "{name}: {q}"
    );
    let mut done = std::collections::HashMap::new();
    for id in ["a1", "a2", "a3", "b1"] {
        let (s, st) = send(&srv, reqwest::Method::GET, &format!("/v1/commands/{id}?wait=20s"), None).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(st["status"], "SUCCEEDED", "{name}: {st}");
        done.insert(id, time(&st["started_at"]));
    }
    // a2 starts when a1 ends (its rate allows it by then); a3 one interval (1 s) after a2, not
    // when a2 ends 100 ms later.
    let gap = done["a3"].duration_since(done["a2"]).unwrap_or_default();
    assert!(gap >= Duration::from_millis(950), "{name}: a3 started {gap:?} after a2");
    let (s, q) = send(&srv, reqwest::Method::GET, "/v1/queues/default", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!((&q["key_waiting"], &q["key_rate_delayed"]), (&json!(0), &json!(0)), "{name}: {q}");
}

on_every_backend!(concurrency_keys_over_http, per_key_rate_and_counts_over_http);
