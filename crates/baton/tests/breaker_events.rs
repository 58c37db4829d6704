//! Breaker tests of the command event feeds over HTTP.

use crate::common;

use std::time::Duration;

use baton::settings::{QueueConfig, ServeConfig};
use baton_testkit::{on_memory_and_standalone, TestBackend};
use common::*;
use reqwest::StatusCode;
use serde_json::json;

on_memory_and_standalone!(
    an_offset_at_the_largest_id_is_answered_without_a_server_error,
    list_times_with_a_utc_offset_are_rfc_3339
);

async fn serve(backend: TestBackend, tweak: impl FnOnce(&mut ServeConfig)) -> TestServer {
    start(backend, |c| {
        c.queues = vec![QueueConfig::with_builtins("default", &["echo"])];
        c.run_workers = false;
        c.long_poll_timeout = Duration::from_secs(1);
        tweak(c)
    })
    .await
}

/// An offset the parser accepts (two digit runs of at most 20 digits that fit a u64) must be
/// answered as any other: a 200 / 204 (nothing after it) or a 4xx saying what is wrong, never a
/// 5xx. `18446744073709551615_18446744073709551615` is the largest one.
async fn an_offset_at_the_largest_id_is_answered_without_a_server_error(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    let res = client()
        .post(format!("{}/v1/queues/default/commands", srv.base))
        .header("content-type", "application/json")
        .body(json!({"id": "a", "type": "echo", "params": {}}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    let max = "18446744073709551615_18446744073709551615";
    for path in [
        format!("/v1/queues/default/events?offset={max}"),
        format!("/v1/queues/default/events?offset={max}&live=long-poll"),
        format!("/v1/commands/a/events?offset={max}"),
    ] {
        let res = client().get(format!("{}{path}", srv.base)).send().await.unwrap();
        let status = res.status();
        let body = res.text().await.unwrap();
        assert!(status.is_success() || status.is_client_error(), "{path}: {status} {body}");
    }
    srv.stop().await;
}

/// `created_after` / `created_before` are documented as RFC 3339 times; RFC 3339 times carry a
/// UTC offset (`Z` or `+hh:mm` / `-hh:mm`), so `2000-01-01T00:00:00+00:00` (the same instant as
/// `2000-01-01T00:00:00Z`) must be accepted, not refused as "not an RFC 3339 time".
async fn list_times_with_a_utc_offset_are_rfc_3339(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    let res = client()
        .post(format!("{}/v1/queues/default/commands", srv.base))
        .header("content-type", "application/json")
        .body(json!({"id": "a", "type": "echo", "params": {}}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    for t in [
        "2000-01-01T00:00:00Z",
        "2000-01-01T00:00:00%2B00:00",
        "2000-01-01T02:00:00%2B02:00",
        "1999-12-31T19:00:00-05:00",
    ] {
        let res =
            client().get(format!("{}/v1/queues/default/commands?created_after={t}", srv.base)).send().await.unwrap();
        let status = res.status();
        let body = res.text().await.unwrap();
        assert_eq!(status, StatusCode::OK, "created_after={t}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["items"].as_array().unwrap().len(), 1, "created_after={t}: {body}");
    }
    srv.stop().await;
}
