//! Breaker tests of scheduled commands over HTTP: RFC 3339 offsets, zone-less times, and delays
//! too large to add to the clock.

use crate::common;

use std::time::Duration;

use baton::settings::default_queues;
use baton_testkit::TestBackend;
use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

async fn post(srv: &TestServer, path: &str, body: Value) -> (StatusCode, Value) {
    let res = client()
        .post(format!("{}{path}", srv.base))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap_or_else(|e| panic!("{path} {body}: no response ({e})"));
    let status = res.status();
    let text = res.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

/// RFC 3339 allows any UTC offset and a lowercase `t`/`z`: each names one instant, stored in UTC.
#[tokio::test]
async fn run_at_with_offsets_is_the_same_instant() {
    let srv = start(TestBackend::Memory, |c| c.queues = default_queues()).await;
    let utc = std::time::SystemTime::now() + Duration::from_secs(86_400);
    let utc = std::time::UNIX_EPOCH + Duration::from_secs(utc.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs());
    let want = humantime::format_rfc3339_millis(utc).to_string();
    let plain = humantime::format_rfc3339_seconds(utc).to_string(); // 2026-12-07T09:56:00Z
    let (date, clock) = (&plain[..10], &plain[11..19]);
    // The same instant written with offsets: +14:00 and -12:00 shift the wall clock.
    let shifted = |h: i64| {
        let t = if h >= 0 {
            utc + Duration::from_secs(h as u64 * 3600)
        } else {
            utc - Duration::from_secs((-h) as u64 * 3600)
        };
        humantime::format_rfc3339_seconds(t).to_string()[..19].to_string()
    };
    let forms = [
        format!("{date}T{clock}Z"),
        format!("{date}t{clock}z"),
        format!("{date}T{clock}+00:00"),
        format!("{}+14:00", shifted(14)),
        format!("{}-12:00", shifted(-12)),
    ];
    for (i, at) in forms.iter().enumerate() {
        let (s, st) =
            post(&srv, "/v1/queues/default/commands", json!({"id": format!("off-{i}"), "type": "echo", "run_at": at}))
                .await;
        assert_eq!(s, StatusCode::ACCEPTED, "{at}: {st}");
        assert_eq!(st["run_at"], json!(want), "{at}");
    }
    // Far in the past, with an offset: accepted, and runs at once (stays no scheduled command).
    let (s, st) = post(
        &srv,
        "/v1/queues/default/commands",
        json!({"id": "past", "type": "echo", "run_at": "0001-01-01T00:00:00+01:00"}),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{st}");
}

/// A time without an offset is not RFC 3339 (it names no instant): refused, saying so.
#[tokio::test]
async fn run_at_without_offset_is_refused() {
    let srv = start(TestBackend::Memory, |c| c.queues = default_queues()).await;
    for at in ["2030-01-01T00:00:00", "2030-01-01 00:00:00"] {
        let (s, e) = post(&srv, "/v1/queues/default/commands", json!({"type": "echo", "run_at": at})).await;
        assert_eq!((s, e["error"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_body")), "{at}: {e}");
        assert!(e["message"].as_str().unwrap().contains("run_at"), "{e}");
    }
}

/// A delay the clock cannot add (u64::MAX seconds) is a 400 naming `delay`, on submit and on
/// reschedule: not a panic that drops the connection.
#[tokio::test]
async fn huge_delay_is_a_clear_error() {
    let srv = start(TestBackend::Memory, |c| c.queues = default_queues()).await;
    for d in ["18446744073709551615s", "300000000000y"] {
        let (s, e) = post(&srv, "/v1/queues/default/commands", json!({"type": "echo", "delay": d})).await;
        assert_eq!((s, e["error"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_body")), "{d}: {e}");
        assert!(e["message"].as_str().unwrap().contains("delay"), "{e}");
    }
    let (s, st) = post(&srv, "/v1/queues/default/commands", json!({"id": "w", "type": "echo", "delay": "1h"})).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{st}");
    let (s, e) = post(&srv, "/v1/commands/w/schedule", json!({"delay": "18446744073709551615s"})).await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_body")), "{e}");
    let (s, st) = post(&srv, "/v1/commands/w/schedule", json!({"delay": "2h"})).await;
    assert_eq!(s, StatusCode::OK, "the server still answers: {st}");
}

/// The Rust API: `Command::with_delay` of a delay the clock cannot add does not panic; the store
/// refuses it as too far ahead.
#[tokio::test]
async fn with_delay_of_duration_max_does_not_panic() {
    let c = baton_commands::Command::new("echo", json!(1)).with_delay(Duration::MAX);
    let at = c.run_at().expect("scheduled");
    assert!(at > std::time::SystemTime::now() + baton_commands::CommandStore::SCHEDULE_MAX);
}
