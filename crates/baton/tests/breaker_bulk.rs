//! Trying to break `POST /v1/queues/{queue}/commands/bulk` as the dashboard uses it (on memory,
//! Redis standalone and Cluster): the dry-run count equals what the action then does when
//! nothing changes in between (also when acting page by page through `next_cursor`); a dry run
//! changes nothing; filters select exactly; a token without `write` is refused; bad bodies are
//! `400` naming what to fix, never a 5xx.

use crate::common;

use std::time::Duration;

use baton::settings::{default_queues, TokenConfig};
use baton_testkit::{eventually, TestBackend};
use common::*;
use serde_json::{json, Value};

const WRITER: &str = "writer-secret-0123456789";
const READER: &str = "reader-secret-0123456789";

async fn call(
    srv: &TestServer,
    method: reqwest::Method,
    path: &str,
    token: &str,
    body: Option<String>,
) -> (u16, Value) {
    let mut rb = client().request(method, format!("{}{path}", srv.base)).bearer_auth(token);
    if let Some(b) = body {
        rb = rb.header("content-type", "application/json").body(b);
    }
    let r = rb.send().await.unwrap();
    let s = r.status().as_u16();
    let text = r.text().await.unwrap();
    (s, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

async fn bulk(srv: &TestServer, token: &str, body: Value) -> (u16, Value) {
    call(srv, reqwest::Method::POST, "/v1/queues/default/commands/bulk", token, Some(body.to_string())).await
}

async fn count(srv: &TestServer, status: &str) -> usize {
    let mut n = 0;
    let mut cursor: Option<String> = None;
    loop {
        let q = match &cursor {
            None => format!("/v1/queues/default/commands?status={status}&limit=1000"),
            Some(c) => format!("/v1/queues/default/commands?status={status}&limit=1000&cursor={c}"),
        };
        let (s, v) = call(srv, reqwest::Method::GET, &q, WRITER, None).await;
        assert_eq!(s, 200, "{v}");
        n += v["items"].as_array().unwrap().len();
        match v["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => return n,
        }
    }
}

async fn bulk_dry_run_matches_action(b: TestBackend) {
    let srv = start(b, |c| {
        c.queues = default_queues();
        c.tokens = vec![
            TokenConfig::new("writer", WRITER, &["read", "write"], &[], &["default"]).unwrap(),
            TokenConfig::new("reader", READER, &["read"], &[], &["default"]).unwrap(),
        ];
    })
    .await;
    for i in 0..23 {
        let body = json!({"id": format!("bf-{i:02}"), "type": "fail", "params": {"error": "no"}});
        let (s, v) =
            call(&srv, reqwest::Method::POST, "/v1/queues/default/commands", WRITER, Some(body.to_string())).await;
        assert_eq!(s, 202, "{v}");
    }
    eventually(Duration::from_secs(30), || async { (count(&srv, "failed").await == 23).then_some(()) }).await;

    // A token without write: 403, and nothing changes.
    let (s, v) = bulk(&srv, READER, json!({"action": "retry", "dry_run": true})).await;
    assert_eq!(s, 403, "{v}");
    let (s, v) = bulk(&srv, READER, json!({"action": "cancel"})).await;
    assert_eq!(s, 403, "{v}");

    // A dry run counts exactly and changes nothing; a filter selects exactly.
    let (s, dry) = bulk(&srv, WRITER, json!({"action": "retry", "dry_run": true, "status": "failed"})).await;
    assert_eq!(s, 200, "{dry}");
    assert_eq!((dry["eligible"].as_u64(), dry["applied"].as_u64()), (Some(23), Some(0)), "{dry}");
    let (_, dry_prefix) = bulk(&srv, WRITER, json!({"action": "retry", "dry_run": true, "id_prefix": "bf-1"})).await;
    assert_eq!(dry_prefix["eligible"].as_u64(), Some(10), "{dry_prefix}");
    let (_, dry_type) = bulk(&srv, WRITER, json!({"action": "retry", "dry_run": true, "type": "echo"})).await;
    assert_eq!(dry_type["eligible"].as_u64(), Some(0), "{dry_type}");
    assert_eq!(count(&srv, "failed").await, 23);

    // Acting page by page (max 5, through next_cursor, as the dashboard does) applies exactly the
    // dry run's count: nothing twice, nothing missed.
    let (mut applied, mut refused, mut calls) = (0, 0, 0);
    let mut cursor: Option<String> = None;
    loop {
        let mut body = json!({"action": "retry", "status": "failed", "max": 5});
        if let Some(c) = &cursor {
            body["cursor"] = json!(c);
        }
        let (s, r) = bulk(&srv, WRITER, body).await;
        assert_eq!(s, 200, "{r}");
        applied += r["applied"].as_u64().unwrap();
        refused += r["refused"].as_u64().unwrap();
        calls += 1;
        assert!(calls < 20, "the cursor does not end: {r}");
        match r["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    assert_eq!((applied, refused), (23, 0));

    // Bad bodies: 400 naming what to fix.
    for (body, says) in [
        (json!({"action": "retry", "status": "bogus"}).to_string(), "status"),
        (json!({"action": "retry", "created_after": "yesterday"}).to_string(), "created_after"),
        (json!({"action": "retry", "cursor": "garbage!"}).to_string(), "cursor"),
        (json!({"action": "retry", "max": -1}).to_string(), "max"),
        (json!({"action": "retry", "max": 10001}).to_string(), "max"),
        (json!({"action": "retry", "type": 5}).to_string(), "type"),
        (json!({"dry_run": true}).to_string(), "action"),
        (json!({"action": "retry", "extra": 1}).to_string(), "extra"),
        ("not json".to_string(), "bulk body"),
        (String::new(), "bulk body"),
    ] {
        let (s, v) =
            call(&srv, reqwest::Method::POST, "/v1/queues/default/commands/bulk", WRITER, Some(body.clone())).await;
        assert_eq!(s, 400, "{body}: {v}");
        assert!(v["message"].as_str().unwrap_or("").contains(says), "{body}: {v}");
    }
    let (s, v) = call(
        &srv,
        reqwest::Method::POST,
        "/v1/queues/nope/commands/bulk",
        WRITER,
        Some(json!({"action": "retry"}).to_string()),
    )
    .await;
    assert!(s == 404 || s == 403, "{s} {v}");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory() {
    bulk_dry_run_matches_action(backend("memory")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone() {
    baton_testkit::require_redis();
    bulk_dry_run_matches_action(backend("standalone")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster() {
    baton_testkit::require_redis();
    bulk_dry_run_matches_action(backend("cluster")).await
}
