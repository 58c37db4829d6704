//! Scheduled commands over HTTP: submit with `run_at` / `delay`, the state's `run_at`, queue
//! counts (`scheduled`, `next_due`), `?scheduled=` listing, `POST /v1/commands/{id}/schedule`,
//! cancel while waiting, the `baton_commands_scheduled` gauge, and bad bodies; on every backend.

use crate::common;

use std::time::Duration;

use baton::settings::default_queues;
use baton_testkit::{on_every_backend, TestBackend};
use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

fn time(v: &Value) -> std::time::SystemTime {
    humantime::parse_rfc3339(v.as_str().unwrap_or_else(|| panic!("not a time: {v}"))).unwrap()
}

async fn scheduled_over_http(backend: TestBackend) {
    let name = backend.name();
    let srv = start(backend, |c| {
        c.queues = default_queues();
        for q in &mut c.queues {
            q.settings.claim_timeout = Duration::from_millis(500);
        }
    })
    .await;

    let far = humantime::format_rfc3339_millis(std::time::SystemTime::now() + Duration::from_secs(3600)).to_string();
    // Scheduled 2 s ahead (longer than four claim timeouts): stored, shown, counted, listed.
    let (s, st) =
        post(&srv, "/v1/queues/default/commands", json!({"id": "later", "type": "echo", "params": 1, "delay": "2s"}))
            .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{name}: {st}");
    assert_eq!(st["status"], "SUBMITTED");
    let run_at = st["run_at"].as_str().expect("run_at").to_string();
    assert!(run_at.ends_with('Z') && run_at.len() == "2025-01-31T12:00:00.000Z".len(), "{run_at}");
    let (_, qj) = get(&srv, "/v1/queues/default").await;
    assert_eq!(qj["commands"]["scheduled"], 1, "{name}: {qj}");
    assert_eq!(qj["commands"]["next_due"], json!(run_at));
    assert_eq!(qj["pending"], 0);
    let (_, page) = get(&srv, "/v1/queues/default/commands?scheduled=true").await;
    let ids: Vec<&str> = page["items"].as_array().unwrap().iter().map(|i| i["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["later"]);
    let (_, page) = get(&srv, "/v1/queues/default/commands?scheduled=false").await;
    assert!(page["items"].as_array().unwrap().is_empty());
    let (s, _) = get(&srv, "/v1/queues/default/commands?scheduled=maybe").await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let metrics = client().get(format!("{}/metrics", srv.base)).send().await.unwrap().text().await.unwrap();
    assert!(
        metrics.lines().any(|l| l.starts_with("baton_commands_scheduled{queue=\"default\"} 1")),
        "{name}: {}",
        metrics.lines().filter(|l| l.contains("scheduled")).collect::<Vec<_>>().join("\n")
    );

    // Idempotent resubmit (a delay matches), another run_at conflicts.
    let (s, _) =
        post(&srv, "/v1/queues/default/commands", json!({"id": "later", "type": "echo", "params": 1, "delay": 5000}))
            .await;
    assert_eq!(s, StatusCode::OK);
    let (s, e) =
        post(&srv, "/v1/queues/default/commands", json!({"id": "later", "type": "echo", "params": 1, "run_at": far}))
            .await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::CONFLICT, Some("conflict")), "{e}");
    assert!(e["message"].as_str().unwrap().contains("run_at"), "{e}");

    // Rescheduled earlier (300 ms from now): runs then.
    let (s, moved) = post(&srv, "/v1/commands/later/schedule", json!({"delay": 300})).await;
    assert_eq!(s, StatusCode::OK, "{moved}");
    assert_eq!(moved["version"], 2);
    assert!(time(&moved["run_at"]) < time(&json!(run_at)));
    let (_, done) = get(&srv, "/v1/commands/later?wait=5s").await;
    assert_eq!(done["status"], "SUCCEEDED", "{name}: {done}");
    assert!(time(&done["started_at"]) >= time(&moved["run_at"]), "{done}");
    let (s, e) = post(&srv, "/v1/commands/later/schedule", json!({"delay": "1m"})).await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::CONFLICT, Some("not_scheduled")), "{e}");
    assert_eq!(e["state"]["status"], "SUCCEEDED");

    // Cancelled while waiting: never runs; no longer counted.
    let (s, _) = post(
        &srv,
        "/v1/queues/default/commands",
        json!({"id": "never", "type": "echo", "run_at": "2099-01-01T00:00:00.000Z"}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "more than 366 days ahead");
    let (s, st) =
        post(&srv, "/v1/queues/default/commands", json!({"id": "never", "type": "echo", "run_at": far})).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{st}");
    assert_eq!(st["run_at"], json!(far));
    let (s, c) = post(&srv, "/v1/commands/never/cancel", json!(null)).await;
    assert_eq!((s, c["status"].as_str()), (StatusCode::OK, Some("CANCELLED")), "{c}");
    let (_, qj) = get(&srv, "/v1/queues/default").await;
    assert_eq!((qj["commands"]["scheduled"].clone(), qj["commands"]["next_due"].clone()), (json!(0), Value::Null));
    assert_eq!(qj["delayed"], 0, "{name}: the cancelled command's message left the delayed set");

    // Bad bodies: each names the field.
    for (body, says) in [
        (json!({"type": "echo", "run_at": far, "delay": "1s"}), "not both"),
        (json!({"type": "echo", "run_at": "tomorrow"}), "\"run_at\""),
        (json!({"type": "echo", "run_at": 5}), "\"run_at\" must be an RFC 3339 time"),
        (json!({"type": "echo", "delay": "soon"}), "\"delay\""),
        (json!({"type": "echo", "delay": -1}), "\"delay\""),
    ] {
        let (s, e) = post(&srv, "/v1/queues/default/commands", body.clone()).await;
        assert_eq!((s, e["error"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_body")), "{body}: {e}");
        assert!(e["message"].as_str().unwrap().contains(says), "{body}: {e}");
    }
    for (body, says) in [
        (json!({}), "missing \"run_at\""),
        (json!({"when": "1s"}), "unknown field"),
        (json!({"run_at": far, "delay": 1}), "not both"),
    ] {
        let (s, e) = post(&srv, "/v1/commands/never/schedule", body.clone()).await;
        assert_eq!((s, e["error"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_body")), "{body}: {e}");
        assert!(e["message"].as_str().unwrap().contains(says), "{body}: {e}");
    }
    let (s, _) = post(&srv, "/v1/commands/nobody/schedule", json!({"delay": "1s"})).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    srv.stop().await;
}

on_every_backend!(scheduled_over_http);
