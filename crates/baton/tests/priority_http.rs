//! Priorities over HTTP: `priority` on submit, shown in the state (absent when 0); commands of a
//! paused queue run by priority, then submit order, once it resumes; bad values are refused with
//! 400 `invalid_body` naming the range; on every backend.

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

async fn priorities_over_http(backend: TestBackend) {
    let name = backend.name();
    let srv = start(backend, |c| {
        c.queues = default_queues();
        for q in &mut c.queues {
            q.settings.concurrency = 1;
        }
    })
    .await;
    let post = reqwest::Method::POST;
    let (s, _) = send(&srv, post.clone(), "/v1/queues/default/pause", None).await;
    assert!(s.is_success(), "{name}: pause {s}");
    // A scheduled command keeps its priority when it is enqueued at its due time.
    let body = json!({"id": "s", "type": "sleep", "params": {"ms": 20}, "priority": 7, "delay": "100ms"});
    let (s, st) = send(&srv, post.clone(), "/v1/queues/default/commands", Some(body)).await;
    assert_eq!((s, &st["priority"]), (StatusCode::ACCEPTED, &json!(7)), "{name}: {st}");
    let order = [("a", 0), ("b", 5), ("c", -3), ("d", 5), ("e", 0), ("f", 10)];
    for (id, p) in order {
        let body = json!({"id": id, "type": "sleep", "params": {"ms": 20}, "priority": p});
        let (s, st) = send(&srv, post.clone(), "/v1/queues/default/commands", Some(body)).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{name}: {st}");
        if p == 0 {
            assert!(st.get("priority").is_none(), "{name}: priority 0 is not shown: {st}");
        } else {
            assert_eq!(st["priority"], p, "{name}: {st}");
        }
    }
    // Promoted while paused (the workers' reclaim ticks go on): the queue counts no scheduled one.
    let mut promoted = false;
    for _ in 0..100 {
        let (_, qj) = send(&srv, reqwest::Method::GET, "/v1/queues/default", None).await;
        if qj["commands"]["scheduled"] == 0 {
            promoted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(promoted, "{name}: the scheduled command was not enqueued");
    let (s, _) = send(&srv, post.clone(), "/v1/queues/default/resume", None).await;
    assert!(s.is_success(), "{name}: resume {s}");
    let mut started = Vec::new();
    for (id, p) in [("s", 7)].into_iter().chain(order) {
        let (s, st) = send(&srv, reqwest::Method::GET, &format!("/v1/commands/{id}?wait=20s"), None).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(st["status"], "SUCCEEDED", "{name}: {st}");
        if p != 0 {
            assert_eq!(st["priority"], p, "{name}: {st}");
        }
        started.push((time(&st["started_at"]), id));
    }
    started.sort();
    let ran: Vec<&str> = started.iter().map(|(_, id)| *id).collect();
    assert_eq!(ran, ["f", "s", "b", "d", "a", "e", "c"], "{name}");
    // Bad values: 400 naming the range, nothing stored.
    for (p, got) in [(json!(11), "11"), (json!(-11), "-11"), (json!(2.5), "2.5"), (json!("1"), "a string")] {
        let body = json!({"id": "bad", "type": "echo", "priority": p});
        let (s, e) = send(&srv, post.clone(), "/v1/queues/default/commands", Some(body)).await;
        let msg = format!("\"priority\" must be an integer from -10 to 10; got {got}");
        assert_eq!(
            (s, e["error"].as_str(), e["message"].as_str()),
            (StatusCode::BAD_REQUEST, Some("invalid_body"), Some(msg.as_str()))
        );
    }
    let (s, _) = send(&srv, reqwest::Method::GET, "/v1/commands/bad", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    tokio::time::sleep(Duration::from_millis(10)).await;
    srv.stop().await;
}

on_every_backend!(priorities_over_http);
