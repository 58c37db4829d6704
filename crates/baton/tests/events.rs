//! The command event feeds over HTTP (`GET /v1/queues/{queue}/events`, `GET
//! /v1/commands/{id}/events`): catch-up with paging, `offset=now`, errors, long-poll (woken and
//! timed out), SSE frames and `Last-Event-ID`, and the `events` queue setting, on memory and Redis.

use crate::common;

use std::time::{Duration, Instant};

use baton::settings::{QueueConfig, ServeConfig};
use baton_commands::FeedSettings;
use baton_testkit::{on_memory_and_standalone, TestBackend};
use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

on_memory_and_standalone!(catch_up_pages_and_errors, long_polls, sse_frames_and_resume, a_queue_with_its_feed_off);

/// Queues `default` (echo) and `quiet` (echo, feed off), no workers (so only submits and cancels
/// write events), long-polls of 2 s.
async fn serve(backend: TestBackend, tweak: impl FnOnce(&mut ServeConfig)) -> TestServer {
    start(backend, |c| {
        let mut quiet = QueueConfig::with_builtins("quiet", &["echo"]);
        quiet.feed = FeedSettings { enabled: false, max_len: 10 };
        c.queues = vec![QueueConfig::with_builtins("default", &["echo"]), quiet];
        c.run_workers = false;
        c.long_poll_timeout = Duration::from_secs(2);
        tweak(c)
    })
    .await
}

async fn submit(srv: &TestServer, queue: &str, id: &str) {
    let res = client()
        .post(format!("{}/v1/queues/{queue}/commands", srv.base))
        .header("content-type", "application/json")
        .body(json!({"id": id, "type": "echo", "params": {"n": 1}}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::ACCEPTED);
}

async fn get(srv: &TestServer, path: &str) -> reqwest::Response {
    client().get(format!("{}{path}", srv.base)).send().await.unwrap()
}

/// The body as JSON, and its (event, id, status, version) per event.
async fn events(res: reqwest::Response) -> (Value, Vec<(String, String, String, u64)>) {
    let v: Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
    let short = v
        .as_array()
        .expect("an array of events")
        .iter()
        .map(|e| {
            (
                e["event"].as_str().unwrap().to_string(),
                e["id"].as_str().unwrap().to_string(),
                e["status"].as_str().unwrap().to_string(),
                e["version"].as_u64().unwrap(),
            )
        })
        .collect();
    (v, short)
}

fn ev(event: &str, id: &str, status: &str, version: u64) -> (String, String, String, u64) {
    (event.to_string(), id.to_string(), status.to_string(), version)
}

async fn catch_up_pages_and_errors(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    for id in ["a", "b", "c"] {
        submit(&srv, "default", id).await;
    }
    let cancelled = client().post(format!("{}/v1/commands/b/cancel", srv.base)).send().await.unwrap();
    assert_eq!(cancelled.status(), StatusCode::OK);

    // Page 1 of 3 events, then the rest from its Stream-Next-Offset.
    let res = get(&srv, "/v1/queues/default/events?limit=3").await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "content-type"), Some("application/json"));
    assert_eq!(header(&res, "cache-control"), Some("private, max-age=60, stale-while-revalidate=300"));
    assert_eq!(header(&res, "stream-up-to-date"), None);
    let next = header(&res, "stream-next-offset").unwrap().to_string();
    let (body, got) = events(res).await;
    assert_eq!(
        got,
        [
            ev("submitted", "a", "SUBMITTED", 1),
            ev("submitted", "b", "SUBMITTED", 1),
            ev("submitted", "c", "SUBMITTED", 1)
        ]
    );
    assert_eq!(body[2]["offset"], next.as_str());
    let first = &body[0];
    let keys: Vec<&str> = first.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(keys, ["at", "attempts", "event", "id", "offset", "status", "type", "version"]);
    assert_eq!((first["type"].as_str(), first["attempts"].as_u64()), (Some("echo"), Some(0)));
    assert_eq!(next.len(), 26, "{next}");

    let res = get(&srv, &format!("/v1/queues/default/events?offset={next}&limit=3")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "stream-up-to-date"), Some("true"));
    let tail = header(&res, "stream-next-offset").unwrap().to_string();
    let (body, got) = events(res).await;
    assert_eq!(got, [ev("cancelled", "b", "CANCELLED", 2)]);
    assert_eq!(body[0]["offset"], tail.as_str());
    assert!(tail > next, "{tail} after {next}");

    // At the tail: an empty page, not cached; offset=now too.
    for q in [format!("offset={tail}"), "offset=now".to_string()] {
        let res = get(&srv, &format!("/v1/queues/default/events?{q}")).await;
        assert_eq!(res.status(), StatusCode::OK, "{q}");
        assert_eq!(header(&res, "cache-control"), Some("no-store"), "{q}");
        assert_eq!(header(&res, "stream-up-to-date"), Some("true"), "{q}");
        assert_eq!(header(&res, "stream-next-offset"), Some(tail.as_str()), "{q}");
        assert_eq!(res.text().await.unwrap(), "[]", "{q}");
    }

    // One command's events, from its creation.
    let (_, got) = events(get(&srv, "/v1/commands/b/events").await).await;
    assert_eq!(got, [ev("submitted", "b", "SUBMITTED", 1), ev("cancelled", "b", "CANCELLED", 2)]);
    let (_, got) = events(get(&srv, "/v1/commands/c/events?offset=-1").await).await;
    assert_eq!(got, [ev("submitted", "c", "SUBMITTED", 1)]);

    // Errors say what to fix.
    let err = |status: StatusCode, code: &str, message: &str| (status, json!({"error": code, "message": message}));
    let cases = [
        (
            "/v1/queues/default/events?offset=bogus",
            err(
                StatusCode::BAD_REQUEST,
                "invalid_offset",
                "invalid offset \"bogus\": use -1 (the start), now (the tail) or an offset returned by a read",
            ),
        ),
        (
            "/v1/commands/b/events?offset=12-3",
            err(
                StatusCode::BAD_REQUEST,
                "invalid_offset",
                "invalid offset \"12-3\": use -1 (the start), now (the tail) or an offset returned by a read",
            ),
        ),
        (
            "/v1/commands/nope/events",
            err(StatusCode::NOT_FOUND, "not_found", "no command nope (never submitted, or expired)"),
        ),
        (
            "/v1/queues/nope/events",
            err(
                StatusCode::NOT_FOUND,
                "unknown_queue",
                "no queue \"nope\" on this server; configured queues: default, quiet",
            ),
        ),
        (
            "/v1/queues/default/events?live=long-poll",
            err(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "live reads need an offset: use offset=-1 (start), offset=now (tail) or a returned offset",
            ),
        ),
        (
            "/v1/queues/default/events?offset=-1&live=forever",
            err(StatusCode::BAD_REQUEST, "bad_request", "live must be `long-poll` or `sse`, not \"forever\""),
        ),
        (
            "/v1/queues/default/events?limit=1001",
            err(StatusCode::BAD_REQUEST, "invalid_limit", "limit must be an integer from 1 to 1000; got \"1001\""),
        ),
        (
            "/v1/queues/default/events?ofset=-1",
            err(
                StatusCode::BAD_REQUEST,
                "invalid_query",
                "unknown query parameter \"ofset\"; this endpoint takes offset, live, limit, cursor",
            ),
        ),
    ];
    for (path, (status, body)) in cases {
        let res = get(&srv, path).await;
        assert_eq!(res.status(), status, "{path}");
        let got: Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
        assert_eq!(got, body, "{path}");
    }
    srv.stop().await;
}

async fn long_polls(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    // Woken by a submit (well before the 2 s timeout).
    let base = srv.base.clone();
    let poll = tokio::spawn(async move {
        let t = Instant::now();
        let res =
            client().get(format!("{base}/v1/queues/default/events?offset=now&live=long-poll")).send().await.unwrap();
        (res, t.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    submit(&srv, "default", "lp-1").await;
    let (res, took) = poll.await.unwrap();
    assert!(took < Duration::from_millis(1500), "{took:?}");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "stream-up-to-date"), Some("true"));
    assert!(header(&res, "stream-cursor").is_some_and(|c| c.parse::<u64>().is_ok()));
    let next = header(&res, "stream-next-offset").unwrap().to_string();
    let (body, got) = events(res).await;
    assert_eq!(got, [ev("submitted", "lp-1", "SUBMITTED", 1)]);
    assert_eq!(body[0]["offset"], next.as_str());

    // Nothing more within the timeout: 204 at about 2 s, at the same offset.
    let t = Instant::now();
    let res = get(&srv, &format!("/v1/queues/default/events?offset={next}&live=long-poll")).await;
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(1900) && took < Duration::from_secs(6), "{took:?}");
    assert_eq!(res.status(), StatusCode::NO_CONTENT);
    assert_eq!(header(&res, "stream-next-offset"), Some(next.as_str()));
    assert_eq!(header(&res, "stream-up-to-date"), Some("true"));
    assert_eq!(header(&res, "content-type"), None);
    assert_eq!(header(&res, "cache-control"), Some("no-store"));

    // One command's long-poll, woken by its cancel (another command's submit does not end it).
    let base = srv.base.clone();
    let from = next.clone();
    let poll = tokio::spawn(async move {
        let url = format!("{base}/v1/commands/lp-1/events?offset={from}&live=long-poll");
        let t = Instant::now();
        let res = client().get(url).send().await.unwrap();
        (res, t.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    submit(&srv, "default", "lp-2").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let res = client().post(format!("{}/v1/commands/lp-1/cancel", srv.base)).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let (res, took) = poll.await.unwrap();
    assert!(took < Duration::from_millis(1900), "{took:?}");
    assert_eq!(res.status(), StatusCode::OK);
    let (_, got) = events(res).await;
    assert_eq!(got, [ev("cancelled", "lp-1", "CANCELLED", 2)]);
    srv.stop().await;
}

/// The control event's fields but the cursor (a time-based number, checked to be one).
fn control_of(data: &str) -> Value {
    let mut v: Value = serde_json::from_str(data).unwrap();
    let cursor = v.as_object_mut().unwrap().remove("streamCursor").expect("a cursor");
    assert!(cursor.as_str().unwrap().parse::<u64>().is_ok(), "{cursor}");
    v
}

async fn sse_frames_and_resume(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    submit(&srv, "default", "s-1").await;
    submit(&srv, "default", "s-2").await;
    let (all, _) = events(get(&srv, "/v1/queues/default/events").await).await;
    let (o1, o2) = (all[0]["offset"].as_str().unwrap().to_string(), all[1]["offset"].as_str().unwrap().to_string());

    // Catch-up one event per data event, each followed by its control event (id: its offset).
    let res = get(&srv, "/v1/queues/default/events?offset=-1&live=sse&limit=1").await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "content-type"), Some("text/event-stream"));
    assert_eq!(header(&res, "cache-control"), Some("no-cache"));
    let (text, _) = read_sse_until(res, Duration::from_secs(10), |t| t.contains("\"upToDate\":true")).await;
    assert!(text.starts_with("retry: 500\n\n"), "{text}");
    let evs = sse_events(&text);
    assert_eq!(evs.len(), 4, "{text}");
    assert_eq!((evs[0].0.as_str(), evs[0].2.as_deref()), ("data", None));
    assert_eq!(serde_json::from_str::<Value>(&evs[0].1).unwrap(), json!([all[0]]));
    assert_eq!((evs[1].0.as_str(), evs[1].2.as_deref()), ("control", Some(o1.as_str())));
    assert_eq!(control_of(&evs[1].1), json!({"streamNextOffset": o1}));
    assert_eq!(serde_json::from_str::<Value>(&evs[2].1).unwrap(), json!([all[1]]));
    assert_eq!((evs[3].0.as_str(), evs[3].2.as_deref()), ("control", Some(o2.as_str())));
    assert_eq!(control_of(&evs[3].1), json!({"streamNextOffset": o2, "upToDate": true}));

    // Last-Event-ID wins over the URL's offset; then live: a submit arrives as it happens, and
    // an idle connection gets heartbeats.
    let res = client()
        .get(format!("{}/v1/queues/default/events?offset=-1&live=sse", srv.base))
        .header("last-event-id", &o1)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let base = srv.base.clone();
    let later = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(800)).await;
        let res = client()
            .post(format!("{base}/v1/queues/default/commands"))
            .header("content-type", "application/json")
            .body(json!({"id": "s-3", "type": "echo"}).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::ACCEPTED);
    });
    let (text, _) =
        read_sse_until(res, Duration::from_secs(10), |t| t.contains("\"s-3\"") && t.ends_with("\n\n")).await;
    later.await.unwrap();
    let evs = sse_events(&text);
    let data: Vec<Value> = evs.iter().filter(|e| e.0 == "data").map(|e| serde_json::from_str(&e.1).unwrap()).collect();
    let ids: Vec<Vec<&str>> =
        data.iter().map(|d| d.as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap()).collect()).collect();
    assert_eq!(ids, [vec!["s-2"], vec!["s-3"]], "{text}");
    assert!(text.contains("\n:\n\n"), "a heartbeat while idle: {text}");
    let last = evs.iter().rev().find(|e| e.0 == "control").unwrap();
    assert_eq!(last.2.as_deref(), data[1][0]["offset"].as_str());

    // A Last-Event-ID that is not an offset: 400 saying so.
    let res = client()
        .get(format!("{}/v1/commands/s-1/events?offset=-1&live=sse", srv.base))
        .header("last-event-id", "x")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let v: Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
    assert_eq!(v["message"], "Last-Event-ID \"x\" is not an offset returned by this server");
    srv.stop().await;
}

async fn a_queue_with_its_feed_off(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    submit(&srv, "quiet", "q-1").await;
    submit(&srv, "default", "d-1").await;
    let res = get(&srv, "/v1/queues/quiet/events").await;
    assert_eq!(header(&res, "stream-up-to-date"), Some("true"));
    assert_eq!(res.text().await.unwrap(), "[]");
    assert_eq!(get(&srv, "/v1/commands/q-1/events").await.text().await.unwrap(), "[]");
    let (_, got) = events(get(&srv, "/v1/queues/default/events").await).await;
    assert_eq!(got, [ev("submitted", "d-1", "SUBMITTED", 1)]);
    srv.stop().await;
}

/// `events = { … }` from the TOML file: `enabled = false` gives an empty feed; `max_len = 0`
/// stops `baton serve` at startup with the key and what to give.
#[test]
fn events_setting_from_toml() {
    use std::process::{Command, Stdio};
    let dir = std::env::temp_dir().join(format!("baton-events-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "[queues.jobs]\nevents = { max_len = 0 }\n[queues.jobs.handlers]\necho = \"echo\"\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config", bad.to_str().unwrap()])
        .env_remove("BATON_CONFIG")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "queues.jobs.events.max_len: 0 would keep no events; give at least 1 (default 100000), or enabled = \
             false for no feed"
        ),
        "{stderr}"
    );

    let port = baton_testkit::free_port();
    let off = dir.join("off.toml");
    std::fs::write(
        &off,
        format!(
            "listen = \"127.0.0.1:{port}\"\n[queues.jobs]\nevents = {{ enabled = false }}\n[queues.jobs.handlers]\necho = \"echo\"\n\
             [queues.loud]\n[queues.loud.handlers]\necho = \"echo\"\n"
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["serve", "--config", off.to_str().unwrap()])
        .env_remove("BATON_CONFIG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let result = rt.block_on(async {
        let c = client();
        let deadline = Instant::now() + Duration::from_secs(20);
        while c.get(format!("{base}/healthz")).send().await.is_err() {
            assert!(Instant::now() < deadline, "baton serve did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for q in ["jobs", "loud"] {
            let res = c
                .post(format!("{base}/v1/queues/{q}/commands?wait=10s"))
                .body(json!({"id": format!("{q}-1"), "type": "echo"}).to_string())
                .send()
                .await
                .unwrap();
            assert_eq!(res.status(), StatusCode::ACCEPTED);
        }
        let jobs = c.get(format!("{base}/v1/queues/jobs/events")).send().await.unwrap().text().await.unwrap();
        let (_, loud) = events(c.get(format!("{base}/v1/queues/loud/events")).send().await.unwrap()).await;
        (jobs, loud)
    });
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(result.0, "[]");
    assert_eq!(result.1, [ev("submitted", "loud-1", "SUBMITTED", 1), ev("succeeded", "loud-1", "SUCCEEDED", 2)]);
}
