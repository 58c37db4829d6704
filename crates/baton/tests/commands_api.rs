//! The command HTTP API of `baton serve`: submit, state, wait, cancel, listing, queue stats, dead
//! letters and metrics, on every backend; bad input on the in-memory one.

use crate::common;

use std::time::{Duration, Instant};

use baton::settings::{default_queues, QueueConfig};
use baton_testkit::{eventually, on_every_backend, TestBackend};
use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

/// A server whose queues are `default` (sleep, echo, fail) plus `extra` (echo).
async fn serve(backend: TestBackend, tweak: impl FnOnce(&mut baton::settings::ServeConfig)) -> TestServer {
    start(backend, |c| {
        c.queues = default_queues();
        let mut extra = QueueConfig::with_builtins("extra", &["echo"]);
        extra.settings.poll_interval = Some(Duration::from_millis(50));
        c.queues.push(extra);
        for q in &mut c.queues {
            q.settings.claim_timeout = Duration::from_secs(2);
        }
        tweak(c)
    })
    .await
}

/// Submit, idempotent resubmit, conflict, state, bounded wait, early wait, cancel, terminal
/// refusals, echo and fail results, unknown ids.
async fn submit_state_wait_cancel(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    let body = json!({"id": "nap-1", "type": "sleep", "params": {"ms": 60000}});
    let res =
        client().post(format!("{}/v1/queues/default/commands", srv.base)).body(body.to_string()).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    assert_eq!(header(&res, "location"), Some("/v1/commands/nap-1"));
    let first: Value = res.text().await.map(|t| serde_json::from_str::<Value>(&t).unwrap()).unwrap();
    assert_eq!(first["id"], "nap-1");
    assert_eq!(first["queue"], "default");
    assert_eq!(first["type"], "sleep");
    assert_eq!(first["status"], "SUBMITTED");
    assert_eq!(first["version"], 1);
    assert!(first.get("_token").is_none(), "internal fields are hidden: {first}");
    assert!(first["created_at"].as_str().unwrap().ends_with('Z'));

    // Same id, same body (keys in another order): 200 and the same command.
    let (s, again) =
        post(&srv, "/v1/queues/default/commands", json!({"params": {"ms": 60000}, "type": "sleep", "id": "nap-1"}))
            .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(again["created_at"], first["created_at"]);
    // Same id, other body: 409.
    let (s, e) =
        post(&srv, "/v1/queues/default/commands", json!({"id": "nap-1", "type": "sleep", "params": {"ms": 5}})).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(e["error"], "conflict");
    assert_eq!(
        e["message"],
        "command nap-1 already exists with a different type or params; resubmit the same body, or use a new id"
    );
    // Same id on another queue: 409 too.
    let (s, e) = post(&srv, "/v1/queues/extra/commands", json!({"id": "nap-1", "type": "echo"})).await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::CONFLICT, Some("conflict")));
    // Submit and wait in one request: 202 (this request created it) with the terminal state.
    let (s, done) =
        post(&srv, "/v1/queues/default/commands?wait=20s", json!({"id": "e-1", "type": "echo", "params": {"n": 7}}))
            .await;
    assert_eq!(
        (s, done["status"].as_str(), &done["result"]),
        (StatusCode::ACCEPTED, Some("SUCCEEDED"), &json!({"n": 7}))
    );
    // Again: 200 (found), at once, the same terminal state.
    let (s, again) =
        post(&srv, "/v1/queues/default/commands?wait=20s", json!({"id": "e-1", "type": "echo", "params": {"n": 7}}))
            .await;
    assert_eq!((s, &again["completed_at"]), (StatusCode::OK, &done["completed_at"]));

    // A bounded wait on a long sleep returns the non-terminal state after about the wait.
    let t = Instant::now();
    let (s, st) = get(&srv, "/v1/commands/nap-1?wait=400ms").await;
    let waited = t.elapsed();
    assert_eq!(s, StatusCode::OK);
    assert!(waited >= Duration::from_millis(380) && waited < Duration::from_secs(5), "{waited:?}");
    assert!(matches!(st["status"].as_str(), Some("SUBMITTED") | Some("RUNNING")), "{st}");

    // Cancel: 200 CANCELLED; again: 409 with the state.
    let (s, st) = post(&srv, "/v1/commands/nap-1/cancel", json!(null)).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(st["status"], "CANCELLED");
    assert!(st["completed_at"].is_string());
    let (s, e) = post(&srv, "/v1/commands/nap-1/cancel", json!(null)).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(e["error"], "already_terminal");
    assert_eq!(e["message"], "command nap-1 is already CANCELLED");
    assert_eq!(e["state"]["status"], "CANCELLED");

    // A wait ends as soon as the command is terminal.
    let (s, _) =
        post(&srv, "/v1/queues/default/commands", json!({"id": "nap-2", "type": "sleep", "params": {"ms": 300}})).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let t = Instant::now();
    let (s, st) = get(&srv, "/v1/commands/nap-2?wait=20s").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(st["status"], "SUCCEEDED", "{st}");
    assert_eq!(st["result"], json!({"slept_ms": 300}));
    assert_eq!(st["attempts"], 1);
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());

    // echo and fail; a generated id.
    let (s, st) = post(&srv, "/v1/queues/extra/commands", json!({"type": "echo", "params": {"a": [1, 2]}})).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let id = st["id"].as_str().unwrap().to_string();
    assert_eq!(id.len(), 36, "a UUID: {id}");
    let (_, st) = get(&srv, &format!("/v1/commands/{id}?wait=20s")).await;
    assert_eq!((st["status"].as_str(), &st["result"]), (Some("SUCCEEDED"), &json!({"a": [1, 2]})));
    let (_, st) = post(
        &srv,
        "/v1/queues/default/commands",
        json!({"id": "f-1", "type": "fail", "params": {"error": "disk full"}}),
    )
    .await;
    assert_eq!(st["id"], "f-1");
    let (_, st) = get(&srv, "/v1/commands/f-1?wait=20s").await;
    assert_eq!((st["status"].as_str(), st["error"].as_str()), (Some("FAILED"), Some("disk full")));
    // Cancelling a finished command: 409.
    let (s, e) = post(&srv, "/v1/commands/f-1/cancel", json!(null)).await;
    assert_eq!((s, e["state"]["status"].as_str()), (StatusCode::CONFLICT, Some("FAILED")));

    // Unknown ids: 404 on read, wait and cancel.
    for (method, path) in
        [("GET", "/v1/commands/nope"), ("GET", "/v1/commands/nope?wait=1s"), ("POST", "/v1/commands/nope/cancel")]
    {
        let (s, e) = call(method.parse().unwrap(), format!("{}{path}", srv.base), None).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{method} {path}");
        assert_eq!(e, json!({"error": "not_found", "message": "no command nope (never submitted, or expired)"}));
    }
    srv.stop().await;
}

/// Listing newest first with cursors and a status filter; queue stats with exact counts.
async fn listing_and_queue_stats(backend: TestBackend) {
    let srv = serve(backend, |c| c.run_workers = false).await;
    for i in 0..5 {
        let (s, _) =
            post(&srv, "/v1/queues/extra/commands", json!({"id": format!("l-{i}"), "type": "echo", "params": i})).await;
        assert_eq!(s, StatusCode::ACCEPTED);
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    let (s, _) = post(&srv, "/v1/commands/l-1/cancel", json!(null)).await;
    assert_eq!(s, StatusCode::OK);

    let mut ids = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let q = match &cursor {
            Some(c) => format!("?limit=2&cursor={}", urlencode(c)),
            None => "?limit=2".to_string(),
        };
        let (s, page) = get(&srv, &format!("/v1/queues/extra/commands{q}")).await;
        assert_eq!(s, StatusCode::OK, "{page}");
        pages += 1;
        for it in page["items"].as_array().unwrap() {
            ids.push(it["id"].as_str().unwrap().to_string());
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
        assert!(pages < 10);
    }
    assert_eq!(ids, ["l-4", "l-3", "l-2", "l-1", "l-0"]);
    assert_eq!(pages, 3);
    let (_, page) = get(&srv, "/v1/queues/extra/commands?status=cancelled").await;
    let only: Vec<&str> = page["items"].as_array().unwrap().iter().map(|i| i["id"].as_str().unwrap()).collect();
    assert_eq!(only, ["l-1"]);
    assert_eq!(page["next_cursor"], Value::Null);
    let (_, page) = get(&srv, "/v1/queues/extra/commands?status=PENDING").await;
    assert_eq!(page["items"].as_array().unwrap().len(), 4);

    let (s, all) = get(&srv, "/v1/queues").await;
    assert_eq!(s, StatusCode::OK);
    let names: Vec<&str> = all["queues"].as_array().unwrap().iter().map(|q| q["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["default", "extra"]);
    let (s, q) = get(&srv, "/v1/queues/extra").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        q["commands"],
        json!({"submitted": 4, "running": 0, "succeeded": 0, "failed": 0, "cancelled": 1, "total": 5, "scheduled": 0, "next_due": null})
    );
    // No workers here: nothing consumed; all five messages wait in the stream, none delivered.
    assert_eq!((q["length"].as_u64(), q["lag"].as_u64(), q["pending"].as_u64()), (Some(5), Some(5), Some(0)));
    assert_eq!((q["consumers"].as_u64(), q["dead_letters"].as_u64()), (Some(0), Some(0)));
    assert_eq!(q["handlers"], json!(["echo"]));
    assert_eq!(q["workers"], json!(false));
    srv.stop().await;
}

/// `POST /v1/queues/{queue}/pause|resume`: a paused queue accepts submits and starts none of
/// them (for several claim timeouts) while a running command goes on and finishes; the queue
/// JSON and `/metrics` show the state; a resume starts the waiting ones; unknown queues are 404.
async fn pause_and_resume_a_queue(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    let (s, r) =
        post(&srv, "/v1/queues/default/commands", json!({"id": "long", "type": "sleep", "params": {"ms": 4000}})).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{r}");
    eventually(Duration::from_secs(10), || async {
        let (_, st) = get(&srv, "/v1/commands/long").await;
        // Started: RUNNING, or its first progress report (RUNNING may be written with it).
        (st["status"] == "RUNNING" || st["progress"].is_object()).then_some(())
    })
    .await
    .expect("long runs");
    let (s, q) = post(&srv, "/v1/queues/default/pause", json!(null)).await;
    assert_eq!(s, StatusCode::OK, "{q}");
    assert_eq!(
        (q["name"].as_str(), q["paused"].as_bool(), q["changed"].as_bool()),
        (Some("default"), Some(true), Some(true))
    );
    assert!(q["paused_since"].as_str().is_some_and(|t| t.ends_with('Z')), "{q}");
    let (_, again) = post(&srv, "/v1/queues/default/pause", json!(null)).await;
    assert_eq!((again["paused"].as_bool(), again["changed"].as_bool()), (Some(true), Some(false)));
    assert_eq!(again["paused_since"], q["paused_since"]);
    for i in 0..3 {
        let (s, _) = post(&srv, "/v1/queues/default/commands", json!({"id": format!("w-{i}"), "type": "echo"})).await;
        assert_eq!(s, StatusCode::ACCEPTED, "submits are accepted while paused");
    }
    // Several claim timeouts (2 s): nothing new starts; the running one finishes.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (_, long) = get(&srv, "/v1/commands/long").await;
    assert_eq!(long["status"], "SUCCEEDED", "the running command went on: {long}");
    for i in 0..3 {
        let (_, st) = get(&srv, &format!("/v1/commands/w-{i}")).await;
        assert_eq!(st["status"], "SUBMITTED", "w-{i} started while paused: {st}");
    }
    let (_, q) = get(&srv, "/v1/queues/default").await;
    assert_eq!((q["paused"].as_bool(), q["lag"].as_u64(), q["pending"].as_u64()), (Some(true), Some(3), Some(0)));
    let text = client().get(format!("{}/metrics", srv.base)).send().await.unwrap().text().await.unwrap();
    assert!(text.contains("baton_queue_paused{queue=\"default\"} 1"), "{text}");
    assert!(text.contains("baton_queue_paused{queue=\"extra\"} 0"), "{text}");
    let (s, q) = post(&srv, "/v1/queues/default/resume", json!(null)).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        (q["paused"].as_bool(), q["changed"].as_bool(), &q["paused_since"]),
        (Some(false), Some(true), &Value::Null)
    );
    for i in 0..3 {
        let (_, st) = get(&srv, &format!("/v1/commands/w-{i}?wait=10s")).await;
        assert_eq!(st["status"], "SUCCEEDED", "{st}");
    }
    let (_, q) = post(&srv, "/v1/queues/default/resume", json!(null)).await;
    assert_eq!(q["changed"].as_bool(), Some(false));
    let text = client().get(format!("{}/metrics", srv.base)).send().await.unwrap().text().await.unwrap();
    assert!(text.contains("baton_queue_paused{queue=\"default\"} 0"), "{text}");
    let (s, e) = post(&srv, "/v1/queues/nope/pause", json!(null)).await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::NOT_FOUND, Some("unknown_queue")));
    let (s, _) = post(&srv, "/v1/queues/nope/resume", json!(null)).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    srv.stop().await;
}

/// Dead letters: an undecodable message is dead-lettered by the worker; list, replay one (it is
/// dead-lettered again under a new id), replay all, purge, unknown ids.
async fn dead_letters(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    let store = srv.server.as_ref().unwrap().command_store().clone();
    for p in ["garbage-1", "garbage-2"] {
        store.messages().offer("extra", p.as_bytes().to_vec()).await.unwrap();
    }
    let dl = |n: usize| {
        let srv = &srv;
        async move {
            eventually(Duration::from_secs(15), || async {
                let (_, v) = get(srv, "/v1/queues/extra/dead-letters").await;
                let items = v["items"].as_array().cloned().unwrap_or_default();
                (items.len() == n).then_some(items)
            })
            .await
            .unwrap_or_else(|| panic!("{n} dead letters expected"))
        }
    };
    let items = dl(2).await;
    let by_payload = |items: &[Value], p: &str| items.iter().find(|i| i["payload"] == p).cloned().expect(p);
    let g1 = by_payload(&items, "garbage-1");
    by_payload(&items, "garbage-2");
    assert_eq!(g1["command_id"], Value::Null);
    assert!(g1["reason"].as_str().unwrap().starts_with("not a command message"), "{g1}");
    assert!(g1["dead_lettered_at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(g1["deliveries"], 1);
    let (_, q) = get(&srv, "/v1/queues/extra").await;
    assert_eq!(q["dead_letters"], 2);

    let first = g1["id"].as_str().unwrap().to_string();
    let (s, r) = post(&srv, &format!("/v1/queues/extra/dead-letters/{first}/replay"), json!(null)).await;
    assert_eq!(s, StatusCode::OK, "{r}");
    assert_eq!(r["replayed"], first.as_str());
    // Consumed again and dead-lettered again: still two, the replayed one under a new id.
    let items = eventually(Duration::from_secs(15), || async {
        let (_, v) = get(&srv, "/v1/queues/extra/dead-letters").await;
        let items = v["items"].as_array().cloned().unwrap_or_default();
        (items.len() == 2 && items.iter().all(|i| i["id"] != first.as_str())).then_some(items)
    })
    .await
    .expect("replayed letter dead-lettered again");
    assert_eq!(by_payload(&items, "garbage-1")["original_id"], r["id"]);

    let (s, e) = post(&srv, &format!("/v1/queues/extra/dead-letters/{first}/replay"), json!(null)).await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
    let (s, r) = post(&srv, "/v1/queues/extra/dead-letters/replay?limit=10", json!(null)).await;
    assert_eq!((s, &r), (StatusCode::OK, &json!({"replayed": 2})));
    dl(2).await;
    let (s, r) = call(reqwest::Method::DELETE, format!("{}/v1/queues/extra/dead-letters", srv.base), None).await;
    assert_eq!((s, &r), (StatusCode::OK, &json!({"purged": 2})));
    let (_, v) = get(&srv, "/v1/queues/extra/dead-letters").await;
    assert_eq!(v, json!({"items": []}));
    srv.stop().await;
}

/// A field of a JSON object text, as its text.
fn raw_field(text: &str, key: &str) -> String {
    let m: std::collections::BTreeMap<String, Box<serde_json::value::RawValue>> =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not a JSON object ({e}): {text:.300}"));
    m.get(key).map(|r| r.get().to_string()).unwrap_or_else(|| panic!("no {key:?} in {text:.300}"))
}

async fn post_text(srv: &TestServer, path: &str, body: String) -> (StatusCode, String) {
    let res = client()
        .post(format!("{}{path}", srv.base))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    (res.status(), res.text().await.unwrap())
}

async fn get_text(srv: &TestServer, path: &str) -> (StatusCode, String) {
    let res = client().get(format!("{}{path}", srv.base)).send().await.unwrap();
    (res.status(), res.text().await.unwrap())
}

/// Params come back exactly as submitted and the echo's result exactly as its params (10,000
/// floats of 17 significant digits, integers beyond 2^53 and 64 bits, escapes, key order), in
/// the submit's answer, the state, a wait and the listing; a resubmit of the same meaning
/// written otherwise is the same command, one digit off is a conflict.
async fn params_come_back_exactly(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    let sample = baton_testkit::exact_json::sample(10_000, 3);
    let body = format!(r#"{{"id": "x-1", "type": "echo", "params": {}}}"#, sample.text);
    let (s, text) = post_text(&srv, "/v1/queues/extra/commands", body).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{text:.300}");
    assert!(raw_field(&text, "params") == sample.text, "submit answer: params changed");
    let (s, text) = get_text(&srv, "/v1/commands/x-1?wait=20s").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(raw_field(&text, "status"), "\"SUCCEEDED\"");
    assert!(raw_field(&text, "params") == sample.text, "state: params changed");
    assert!(raw_field(&text, "result") == sample.text, "state: the echo's result changed");
    let (_, page) = get_text(&srv, "/v1/queues/extra/commands").await;
    let items: Vec<Box<serde_json::value::RawValue>> = serde_json::from_str(&raw_field(&page, "items")).unwrap();
    assert!(raw_field(items[0].get(), "params") == sample.text, "listing: params changed");
    assert!(raw_field(items[0].get(), "result") == sample.text, "listing: result changed");
    // A refused cancel carries the state too.
    let (s, text) = post_text(&srv, "/v1/commands/x-1/cancel", String::new()).await;
    assert_eq!(s, StatusCode::CONFLICT, "{text:.300}");
    let state = raw_field(&text, "state");
    assert!(raw_field(&state, "params") == sample.text, "409 already_terminal: params changed");
    assert!(raw_field(&state, "result") == sample.text, "409 already_terminal: result changed");

    let same = format!(r#"{{"type":"echo","params":{},"id":"x-1"}}"#, sample.same_meaning);
    let (s, text) = post_text(&srv, "/v1/queues/extra/commands", same).await;
    assert_eq!(s, StatusCode::OK, "same meaning, written otherwise: {text:.300}");
    assert!(raw_field(&text, "params") == sample.text, "the first text is kept");
    let other = format!(r#"{{"id": "x-1", "type": "echo", "params": {}}}"#, sample.different);
    let (s, text) = post_text(&srv, "/v1/queues/extra/commands", other).await;
    assert_eq!(s, StatusCode::CONFLICT, "one digit off is another command: {text:.300}");

    for (i, p) in
        ["18446744073709551615", "-9223372036854775809", "123456789012345678901234567890", r#""\u00e9\ud83d\ude00""#]
            .into_iter()
            .enumerate()
    {
        let (s, _) = post_text(
            &srv,
            "/v1/queues/extra/commands",
            format!(r#"{{"id": "x-int-{i}", "type": "echo", "params": {p}}}"#),
        )
        .await;
        assert_eq!(s, StatusCode::ACCEPTED);
        let (_, text) = get_text(&srv, &format!("/v1/commands/x-int-{i}?wait=20s")).await;
        assert_eq!((raw_field(&text, "params"), raw_field(&text, "result")), (p.to_string(), p.to_string()));
    }
    srv.stop().await;
}

/// `POST /v1/commands/{id}/retry` re-runs a FAILED or CANCELLED command; anything else is a 409
/// with the state; the list filters (type, id prefix, creation time) and their bad values.
async fn retry_and_list_filters(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    let (s, _) = post(
        &srv,
        "/v1/queues/default/commands",
        json!({"id": "r-f", "type": "fail", "params": {"error": "disk full"}}),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let (_, failed) = get(&srv, "/v1/commands/r-f?wait=10s").await;
    assert_eq!((failed["status"].as_str(), failed["version"].as_u64()), (Some("FAILED"), Some(2)));
    let (s, again) = post(&srv, "/v1/commands/r-f/retry", json!(null)).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        (again["status"].as_str(), again["version"].as_u64(), &again["error"]),
        (Some("SUBMITTED"), Some(3), &Value::Null)
    );
    let (_, refailed) = get(&srv, "/v1/commands/r-f?wait=10s").await;
    assert_eq!((refailed["status"].as_str(), refailed["version"].as_u64()), (Some("FAILED"), Some(4)));
    let (_, events) = get(&srv, "/v1/commands/r-f/events?offset=-1").await;
    let kinds: Vec<&str> = events.as_array().unwrap().iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["submitted", "failed", "rerun", "failed"]);
    // Not FAILED or CANCELLED: 409 with the state; unknown: 404.
    let (s, _) = post(&srv, "/v1/queues/default/commands", json!({"id": "r-ok", "type": "echo", "params": 1})).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    get(&srv, "/v1/commands/r-ok?wait=10s").await;
    let (s, e) = post(&srv, "/v1/commands/r-ok/retry", json!(null)).await;
    assert_eq!(
        (s, e["error"].as_str(), e["state"]["status"].as_str()),
        (StatusCode::CONFLICT, Some("not_retryable"), Some("SUCCEEDED"))
    );
    assert_eq!(e["message"], "command r-ok is SUCCEEDED: only FAILED or CANCELLED commands can be re-run");
    let (s, e) = post(&srv, "/v1/commands/nope/retry", json!(null)).await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));

    let ids = |v: &Value| {
        v["items"].as_array().unwrap().iter().map(|s| s["id"].as_str().unwrap().to_string()).collect::<Vec<_>>()
    };
    let (_, by_type) = get(&srv, "/v1/queues/default/commands?type=fail").await;
    assert_eq!(ids(&by_type), ["r-f"]);
    let (_, by_prefix) = get(&srv, "/v1/queues/default/commands?id_prefix=r-o").await;
    assert_eq!(ids(&by_prefix), ["r-ok"]);
    let created = refailed["created_at"].as_str().unwrap().to_string();
    let (_, after) = get(&srv, &format!("/v1/queues/default/commands?created_after={created}&type=echo")).await;
    assert_eq!(ids(&after), ["r-ok"]);
    let (_, before) = get(&srv, &format!("/v1/queues/default/commands?created_before={created}")).await;
    assert_eq!(ids(&before), Vec::<String>::new());
    // Bulk: a dry run counts; an action on what the filter selects; a bad body.
    let (s, r) =
        post(&srv, "/v1/queues/default/commands/bulk", json!({"action": "retry", "type": "fail", "dry_run": true}))
            .await;
    assert_eq!(
        (s, r),
        (StatusCode::OK, json!({"looked_at": 1, "eligible": 1, "applied": 0, "refused": 0, "next_cursor": null}))
    );
    let (_, r) =
        post(&srv, "/v1/queues/default/commands/bulk", json!({"action": "cancel", "status": "succeeded"})).await;
    assert_eq!(r, json!({"looked_at": 1, "eligible": 0, "applied": 0, "refused": 0, "next_cursor": null}));
    let (_, r) = post(&srv, "/v1/queues/default/commands/bulk", json!({"action": "retry", "max": 1})).await;
    assert_eq!((r["looked_at"].as_u64(), r["next_cursor"].is_string()), (Some(1), true));
    let (s, e) = post(&srv, "/v1/queues/default/commands/bulk", json!({"action": "delete"})).await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_body")));
    assert!(
        e["message"].as_str().unwrap().starts_with("unknown variant `delete`, expected `cancel` or `retry`"),
        "{e}"
    );
    let (s, e) = post(&srv, "/v1/queues/default/commands/bulk", json!({"action": "cancel", "max": 10001})).await;
    assert_eq!((s, e["message"].as_str()), (StatusCode::BAD_REQUEST, Some("max 10001 is above 10000")));
    let (s, e) = get(&srv, "/v1/queues/default/commands?created_after=yesterday").await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_query")));
    assert_eq!(e["message"], "created_after \"yesterday\" is not an RFC 3339 time such as 2026-12-04T10:00:00Z or 2026-12-04T11:00:00+01:00 (a + in a URL is written %2B)");
    srv.stop().await;
}

/// `GET /v1/queues/{queue}/workers`: this server's worker of the queue, alive, holding the
/// command it runs; the queue's JSON counts live and dead consumers apart.
async fn workers_list(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    let (s, _) =
        post(&srv, "/v1/queues/default/commands", json!({"id": "w-nap", "type": "sleep", "params": {"ms": 60000}}))
            .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let listed = eventually(Duration::from_secs(10), || async {
        let (_, v) = get(&srv, "/v1/queues/default/workers").await;
        (v["workers"][0]["commands"] == json!(["w-nap"])).then_some(v)
    })
    .await
    .expect("the worker holds the command");
    assert_eq!((listed["alive"].as_u64(), listed["dead"].as_u64()), (Some(1), Some(0)));
    let w = &listed["workers"][0];
    assert_eq!(
        (w["alive"].as_bool(), w["leases"].as_u64(), w["claim_timeout_ms"].as_u64()),
        (Some(true), Some(1), Some(2000))
    );
    assert!(w["name"].as_str().unwrap().starts_with("baton-"), "{w}");
    assert!(w["last_heartbeat"].as_str().unwrap().ends_with('Z'), "{w}");
    let (_, q) = get(&srv, "/v1/queues/default").await;
    assert_eq!((q["consumers"].as_u64(), q["dead_consumers"].as_u64()), (Some(1), Some(0)));
    let (s, e) = get(&srv, "/v1/queues/nope/workers").await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::NOT_FOUND, Some("unknown_queue")));
    post(&srv, "/v1/commands/w-nap/cancel", json!(null)).await;
    srv.stop().await;
}

/// `GET /v1/queues/{queue}/minutes` after known work: the current minute's outcomes and
/// duration buckets, the depth the queue's service sampled, the window's length.
async fn minutes_after_work(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    // Work started now ends in this minute.
    let in_minute = baton_commands::Timestamp::now().millis() % 60_000;
    if in_minute > 45_000 {
        tokio::time::sleep(Duration::from_millis(60_000 - in_minute + 200)).await;
    }
    let submit = "/v1/queues/default/commands?wait=20s";
    let (_, v) = post(&srv, submit, json!({"type": "sleep", "params": {"ms": 300}})).await;
    assert_eq!(v["status"].as_str(), Some("SUCCEEDED"), "{v}");
    let (_, v) = post(&srv, submit, json!({"type": "fail", "params": {"error": "no"}})).await;
    assert_eq!(v["status"].as_str(), Some("FAILED"), "{v}");
    let (s, v) = get(&srv, "/v1/queues/default/minutes?last=3").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let minutes = v["minutes"].as_array().unwrap();
    assert_eq!(minutes.len(), 3);
    assert_eq!(v["bounds_ms"].as_array().unwrap().len(), 21);
    let now = &minutes[2];
    assert_eq!(
        (now["succeeded"].as_u64(), now["failed"].as_u64(), now["cancelled"].as_u64()),
        (Some(1), Some(1), Some(0))
    );
    let mut durations = [0u64; 22];
    durations[8] += 1; // the sleep: [200, 500) ms
    let got: Vec<u64> = now["durations"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
    // The `fail` handler returns at once: one duration under 200 ms.
    assert_eq!(got[8..], durations[8..], "{now}");
    assert_eq!(got[..8].iter().sum::<u64>(), 1, "{now}");
    assert!(now["minute"].as_str().unwrap().ends_with(":00.000Z"), "a whole minute: {now}");
    // The queue's service samples its depth at start (a minute of these 3), then once a minute.
    assert!(minutes.iter().any(|m| m["depth"].is_u64() && m["oldest_age_ms"].is_u64()), "{v}");
    let (s, e) = get(&srv, "/v1/queues/default/minutes?last=0").await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_last")));
    srv.stop().await;
}

on_every_backend!(
    pause_and_resume_a_queue,
    minutes_after_work,
    submit_state_wait_cancel,
    dead_letters,
    params_come_back_exactly,
    retry_and_list_filters,
    workers_list,
    output_streams
);

mod listing {
    use super::*;
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory() {
        listing_and_queue_stats(TestBackend::Memory).await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn standalone() {
        baton_testkit::require_redis();
        listing_and_queue_stats(TestBackend::Standalone(baton_testkit::RedisServer::start())).await
    }
}

/// A stream's whole body and its end (`Stream-Closed`, `Baton-End-Reason`) read at `url`.
async fn read_stream(srv: &TestServer, url: &str) -> (StatusCode, String, Option<String>) {
    let res = client().get(format!("{}{url}?offset=-1", srv.base)).send().await.unwrap();
    let status = res.status();
    let closed = header(&res, "stream-closed") == Some("true");
    let reason = header(&res, "baton-end-reason").map(str::to_string);
    let body = res.text().await.unwrap();
    (status, body, if closed { Some(reason.unwrap_or_else(|| "finished".into())) } else { None })
}

/// A command submitted with `output` owns a stream, linked in its state, readable at its url,
/// ended with the command (SUCCEEDED finished, FAILED an error entry, CANCELLED cancelled); a
/// resubmit with another output is a 409.
async fn output_streams(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    let submit = "/v1/queues/default/commands";
    let (s, st) = post(&srv, &format!("{submit}?wait=10s"), json!({"id": "o-1", "type": "echo", "output": true})).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(st["status"], "SUCCEEDED");
    assert_eq!(
        st["output"],
        json!({"stream": "commands/o-1", "url": "/v1/stream/commands/o-1", "run": 1,
               "content_type": "application/json", "max_run_ms": 604_800_000u64, "done_ttl_ms": 86_400_000u64})
    );
    assert_eq!(
        read_stream(&srv, "/v1/stream/commands/o-1").await,
        (StatusCode::OK, "[]".into(), Some("finished".into()))
    );
    // The same request again is the same command; another output is a conflict.
    let (s, again) = post(&srv, submit, json!({"type": "echo", "output": true, "id": "o-1"})).await;
    assert_eq!((s, &again["output"]), (StatusCode::OK, &st["output"]));
    for other in [json!({"id": "o-1", "type": "echo"}), json!({"id": "o-1", "type": "echo", "output": {"path": "x/y"}})]
    {
        let (s, e) = post(&srv, submit, other).await;
        assert_eq!(s, StatusCode::CONFLICT);
        assert_eq!(e["error"], "conflict");
        assert_eq!(
            e["message"],
            "command o-1 already exists with a different output; resubmit the same body, or use a new id"
        );
    }
    // The refused submit left no stream at the path it asked for.
    assert_eq!(read_stream(&srv, "/v1/stream/x/y").await.0, StatusCode::NOT_FOUND);

    // A failure ends it with an error entry; a custom path, type and silence timeout are kept.
    let body = json!({"id": "o-2", "type": "fail", "params": {"error": "no disk"},
                      "output": {"path": "team/o 2", "content_type": "text/plain", "silence_timeout": "2m"}});
    let (s, st) = post(&srv, &format!("{submit}?wait=10s"), body).await;
    assert_eq!((s, &st["status"]), (StatusCode::ACCEPTED, &json!("FAILED")));
    assert_eq!(st["output"]["url"], "/v1/stream/team/o%202");
    assert_eq!(
        (&st["output"]["content_type"], &st["output"]["silence_timeout_ms"]),
        (&json!("text/plain"), &json!(120_000))
    );
    let (s, text, end) = read_stream(&srv, "/v1/stream/team/o%202").await;
    assert_eq!((s, text.as_str(), end.as_deref()), (StatusCode::OK, "error: no disk", Some("finished")));

    // A cancel ends it cancelled, whether or not its handler is running.
    let (s, st) =
        post(&srv, submit, json!({"id": "o-3", "type": "sleep", "params": {"ms": 60000}, "output": true})).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(read_stream(&srv, "/v1/stream/commands/o-3").await, (StatusCode::OK, "[]".into(), None));
    let (s, st2) = post(&srv, "/v1/commands/o-3/cancel", json!({})).await;
    assert_eq!((s, &st2["status"], &st2["output"]), (StatusCode::OK, &json!("CANCELLED"), &st["output"]));
    assert_eq!(
        read_stream(&srv, "/v1/stream/commands/o-3").await,
        (StatusCode::OK, "[]".into(), Some("cancelled".into()))
    );

    // A re-run writes <path>/run-2.
    let (s, st) = post(&srv, "/v1/commands/o-3/retry", json!({})).await;
    assert_eq!(
        (s, &st["output"]["url"], &st["output"]["run"]),
        (StatusCode::OK, &json!("/v1/stream/commands/o-3/run-2"), &json!(2))
    );

    // A path where someone else's stream is: 409 output_in_use, nothing stored, that stream as
    // it was (was: the command was stored linking it, and its cancel ended that stream).
    let res = client()
        .put(srv.url("team/theirs"))
        .header("content-type", "application/json")
        .body(r#"{"mine": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    let body = json!({"id": "o-4", "type": "sleep", "params": {"ms": 60000}, "output": {"path": "team/theirs"}});
    let (s, e) = post(&srv, submit, body).await;
    assert_eq!((s, &e["error"]), (StatusCode::CONFLICT, &json!("output_in_use")), "{e}");
    assert_eq!(
        e["message"],
        "output path team/theirs is in use: another stream exists at this path; give the output another path (or none: commands/<id>)"
    );
    assert_eq!(get(&srv, "/v1/commands/o-4").await.0, StatusCode::NOT_FOUND);
    assert_eq!(read_stream(&srv, "/v1/stream/team/theirs").await, (StatusCode::OK, r#"[{"mine": 1}]"#.into(), None));
    srv.stop().await;
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Params nested deeper than a handler can decode (serde_json's limit) are refused with a 400
/// that says so; the server stays up. 400,000 levels fit in a 1 MiB body: walking them one
/// level per call frame overflowed a worker's stack and aborted the whole process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deeply_nested_params_are_refused() {
    let srv = serve(TestBackend::Memory, |_| {}).await;
    for (depth, open, close) in [(400_000, "[", "]"), (128, "[", "]"), (100_000, r#"{"a":"#, "}")] {
        let params = format!("{}0{}", open.repeat(depth), close.repeat(depth));
        let body = format!(r#"{{"id": "deep-{depth}", "type": "echo", "params": {params}}}"#);
        let (s, text) = post_text(&srv, "/v1/queues/extra/commands", body).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{text:.300}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"], "invalid_params", "{text:.300}");
        assert!(v["message"].as_str().unwrap().contains("nested more than 127 deep"), "{text:.300}");
        let (s, _) = get(&srv, &format!("/v1/commands/deep-{depth}")).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "nothing stored");
    }
    // 127 levels are what a handler decodes: stored and echoed exactly.
    let params = format!("{}{}", "[".repeat(127), "]".repeat(127));
    let body = format!(r#"{{"id": "deep-ok", "type": "echo", "params": {params}}}"#);
    let (s, text) = post_text(&srv, "/v1/queues/extra/commands", body).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{text:.300}");
    let (_, text) = get_text(&srv, "/v1/commands/deep-ok?wait=20s").await;
    assert_eq!((raw_field(&text, "params"), raw_field(&text, "result")), (params.clone(), params));
    srv.stop().await;
}

/// Every command and queue route with bad input: the status, the error code and the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_4xx_with_what_to_fix() {
    let srv = serve(TestBackend::Memory, |c| c.max_command_body = 1024).await;
    let (s, _) = post(&srv, "/v1/queues/default/commands", json!({"id": "known", "type": "echo"})).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let raw = |method: &str, path: &str, body: &str| {
        let rb = client().request(method.parse().unwrap(), format!("{}{path}", srv.base)).body(body.to_string());
        async move {
            let res = rb.send().await.unwrap();
            let s = res.status();
            let v: Value = serde_json::from_str(&res.text().await.unwrap()).expect("JSON error body");
            (s, v)
        }
    };
    let big = format!("{{\"type\":\"echo\",\"params\":\"{}\"}}", "x".repeat(2000));
    let cases: Vec<(&str, &str, String, u16, &str, &str)> = vec![
        ("POST", "/v1/queues/default/commands", "{\"type\": ".into(), 400, "invalid_json", "request body is not valid JSON (EOF while parsing a value at line 1 column 9); send {\"type\": \"echo\", \"params\": {…}} (optional \"id\": a string)"),
        ("POST", "/v1/queues/default/commands", "".into(), 400, "invalid_json", "request body is not valid JSON"),
        ("POST", "/v1/queues/default/commands", "[]".into(), 400, "invalid_body", "got an array"),
        ("POST", "/v1/queues/default/commands", "{\"type\": 5}".into(), 400, "invalid_body", "\"type\" must be a string naming a handler; got a number"),
        ("POST", "/v1/queues/default/commands", "{\"type\": \"echo\", \"id\": true}".into(), 400, "invalid_body", "\"id\" must be a string"),
        ("POST", "/v1/queues/default/commands", "{\"type\": \"echo\", \"extra\": 1}".into(), 400, "invalid_body", "unknown field \"extra\""),
        ("POST", "/v1/queues/default/commands", "{\"type\": \"echo\", \"id\": \"a b\"}".into(), 400, "invalid_id", "invalid command id \"a b\": use 1 to 200 bytes without braces, whitespace or control characters"),
        ("POST", "/v1/queues/default/commands", "{\"type\": \"echo\", \"id\": \"\"}".into(), 400, "invalid_id", "invalid command id \"\""),
        ("POST", "/v1/queues/default/commands", "{\"type\": \"nap\"}".into(), 400, "unknown_type", "queue \"default\" has no handler for type \"nap\"; use one of echo, fail, sleep"),
        ("POST", "/v1/queues/default/commands", "{\"type\": \"sleep\", \"params\": {\"ms\": \"5\"}}".into(), 400, "invalid_params", "invalid params: \"ms\" must be an integer from 0 to 86400000 (milliseconds); got \"5\""),
        ("POST", "/v1/queues/default/commands", "{\"type\": \"fail\", \"params\": 3}".into(), 400, "invalid_params", "invalid params:"),
        ("POST", "/v1/queues/default/commands", big, 413, "body_too_large", "commands take at most 1024 bytes (max_command_body)"),
        ("POST", "/v1/queues/default/commands?x=1", "{\"type\": \"echo\"}".into(), 400, "invalid_query", "unknown query parameter \"x\"; this endpoint takes wait"),
        ("POST", "/v1/queues/default/commands?wait=soon", "{\"type\": \"echo\"}".into(), 400, "invalid_wait", "wait must be a duration like 30s, 500ms or 2m, at most 5m; \"soon\""),
        ("POST", "/v1/queues/nope/commands", "{\"type\": \"echo\"}".into(), 404, "unknown_queue", "no queue \"nope\" on this server; configured queues: default, extra"),
        ("GET", "/v1/queues/nope/commands", "".into(), 404, "unknown_queue", "no queue \"nope\""),
        ("GET", "/v1/queues/nope", "".into(), 404, "unknown_queue", "no queue \"nope\""),
        ("GET", "/v1/queues/nope/dead-letters", "".into(), 404, "unknown_queue", "no queue \"nope\""),
        ("DELETE", "/v1/queues/nope/dead-letters", "".into(), 404, "unknown_queue", "no queue \"nope\""),
        ("POST", "/v1/queues/nope/dead-letters/replay", "".into(), 404, "unknown_queue", "no queue \"nope\""),
        ("POST", "/v1/queues/nope/dead-letters/1-0/replay", "".into(), 404, "unknown_queue", "no queue \"nope\""),
        ("GET", "/v1/queues/default/commands?status=DONE", "".into(), 400, "invalid_status", "status \"DONE\" is not one of SUBMITTED, RUNNING, SUCCEEDED, FAILED, CANCELLED (any case)"),
        ("GET", "/v1/queues/default/commands?limit=abc", "".into(), 400, "invalid_limit", "limit must be an integer from 1 to 1000; got \"abc\""),
        ("GET", "/v1/queues/default/commands?limit=1001", "".into(), 400, "invalid_limit", "limit must be an integer from 1 to 1000"),
        ("GET", "/v1/queues/default/commands?cursor=zzz", "".into(), 400, "invalid_cursor", "invalid cursor \"zzz\": pass a next_cursor returned by this endpoint, or omit cursor to start from the newest"),
        ("GET", "/v1/queues/default/commands?limit=1&limit=2", "".into(), 400, "invalid_query", "give the query parameter limit once"),
        ("GET", "/v1/commands/known?wait=soon", "".into(), 400, "invalid_wait", "wait must be a duration like 30s, 500ms or 2m, at most 5m; \"soon\""),
        ("GET", "/v1/commands/known?wait=10m", "".into(), 400, "invalid_wait", "at most 5m; got \"10m\""),
        ("GET", "/v1/commands/known?wait=-1s", "".into(), 400, "invalid_wait", "wait must be a duration"),
        ("GET", "/v1/commands/known?wiat=1s", "".into(), 400, "invalid_query", "unknown query parameter \"wiat\"; this endpoint takes wait"),
        ("GET", "/v1/commands/a%20b", "".into(), 400, "invalid_id", "invalid command id \"a b\""),
        ("GET", "/v1/commands/%FF", "".into(), 400, "invalid_path", "percent-encode UTF-8"),
        ("POST", "/v1/commands/a%7Bb/cancel", "".into(), 400, "invalid_id", "invalid command id \"a{b\""),
        ("GET", "/v1/commands/unknown", "".into(), 404, "not_found", "no command unknown (never submitted, or expired)"),
        ("POST", "/v1/commands/unknown/cancel", "".into(), 404, "not_found", "no command unknown"),
        ("GET", "/v1/queues/default/dead-letters?limit=0", "".into(), 400, "invalid_limit", "limit must be an integer from 1 to 1000; got \"0\""),
        ("POST", "/v1/queues/default/dead-letters/replay?limit=-3", "".into(), 400, "invalid_limit", "limit must be an integer from 1 to 100000"),
        ("POST", "/v1/queues/default/dead-letters/xyz/replay", "".into(), 400, "invalid_id", "\"xyz\" is not a dead-letter id; use an id from GET …/dead-letters (like 1700000000000-0)"),
        ("POST", "/v1/queues/default/dead-letters/5-5/replay", "".into(), 404, "not_found", "no dead letter 5-5 in this queue"),
        ("GET", "/v1/queues?verbose=1", "".into(), 400, "invalid_query", "unknown query parameter \"verbose\""),
        ("PUT", "/v1/commands/known", "{}".into(), 405, "method_not_allowed", "PUT is not served here; use GET or HEAD"),
        ("GET", "/v1/commands/known/cancel", "".into(), 405, "method_not_allowed", "GET is not served here; use POST"),
        ("DELETE", "/v1/queues/default/commands", "".into(), 405, "method_not_allowed", "use GET or POST or HEAD"),
        ("POST", "/v1/queues", "".into(), 405, "method_not_allowed", "use GET or HEAD"),
    ];
    for (method, path, body, status, code, message) in cases {
        let (s, v) = raw(method, path, &body).await;
        assert_eq!(s.as_u16(), status, "{method} {path} {body:.60}: {v}");
        assert_eq!(v["error"], code, "{method} {path}: {v}");
        let m = v["message"].as_str().unwrap();
        assert!(m.starts_with(message) || m.contains(message), "{method} {path}: {m:?} lacks {message:?}");
    }
    // Nothing was stored by the refused submits.
    let (_, q) = get(&srv, "/v1/queues/default").await;
    assert_eq!(q["commands"]["total"], 1);
    // A body far over the limit is refused by its declared length alone.
    let res = client()
        .post(format!("{}/v1/queues/default/commands", srv.base))
        .body(vec![b' '; 10 << 20])
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
    srv.stop().await;
}

/// `/metrics`: sampled queue gauges, commands by status, handler histograms and outcomes, HTTP
/// durations by route template; no command id appears in any label.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_cover_queues_commands_and_routes() {
    let srv = start(TestBackend::Memory, |c| {
        let mut q = QueueConfig::with_builtins("metered", &["echo", "fail"]);
        q.settings.poll_interval = Some(Duration::from_millis(50));
        c.queues = vec![q];
    })
    .await;
    for i in 0..3 {
        post(&srv, "/v1/queues/metered/commands", json!({"id": format!("secret-id-{i}"), "type": "echo"})).await;
    }
    post(&srv, "/v1/queues/metered/commands", json!({"id": "secret-id-f", "type": "fail", "params": {"error": "x"}}))
        .await;
    for id in ["secret-id-0", "secret-id-1", "secret-id-2", "secret-id-f"] {
        let (_, st) = get(&srv, &format!("/v1/commands/{id}?wait=10s")).await;
        assert!(st["completed_at"].is_string(), "{st}");
    }
    let text = client().get(format!("{}/metrics", srv.base)).send().await.unwrap().text().await.unwrap();
    let has = |line: &str| text.lines().any(|l| l == line);
    for line in [
        "baton_commands{queue=\"metered\",status=\"succeeded\"} 3",
        "baton_commands{queue=\"metered\",status=\"failed\"} 1",
        "baton_commands{queue=\"metered\",status=\"submitted\"} 0",
        "baton_queue_length{queue=\"metered\"} 0",
        "baton_queue_pending{queue=\"metered\"} 0",
        "baton_queue_lag{queue=\"metered\"} 0",
        "baton_queue_consumers{queue=\"metered\"} 1",
        "baton_queue_dead_letter_entries{queue=\"metered\"} 0",
        "baton_command_outcomes_total{queue=\"metered\",type=\"echo\",outcome=\"succeeded\"} 3",
        "baton_command_outcomes_total{queue=\"metered\",type=\"fail\",outcome=\"failed\"} 1",
        "baton_command_handler_seconds_count{queue=\"metered\",type=\"echo\",call=\"execute\"} 3",
        "baton_commands_submitted_total{queue=\"metered\"} 4",
    ] {
        assert!(has(line), "missing {line:?} in\n{text}");
    }
    assert!(
        text.contains(
            "baton_http_request_duration_seconds_bucket{route=\"/v1/commands/{id}\",method=\"GET\",status=\"200\""
        ),
        "{text}"
    );
    assert!(text.contains("baton_http_request_duration_seconds_count{route=\"/v1/queues/{queue}/commands\",method=\"POST\",status=\"202\"}"));
    assert!(text.contains("# TYPE baton_command_handler_seconds histogram"));
    assert!(!text.contains("secret-id"), "a command id leaked into a label");
    srv.stop().await;
}

/// `/readyz` follows the backend: 503 while Redis is down, 200 again after it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_redis() {
    baton_testkit::require_redis();
    let mut srv = serve(TestBackend::Standalone(baton_testkit::RedisServer::start()), |_| {}).await;
    let ready = |base: String| async move { client().get(format!("{base}/readyz")).send().await.unwrap().status() };
    assert_eq!(ready(srv.base.clone()).await, StatusCode::OK);
    let TestBackend::Standalone(redis) = &mut srv.backend else { unreachable!() };
    redis.kill();
    let down = eventually(Duration::from_secs(10), || async {
        (ready(srv.base.clone()).await == StatusCode::SERVICE_UNAVAILABLE).then_some(())
    })
    .await;
    assert!(down.is_some(), "readyz stayed 200 with Redis down");
    let TestBackend::Standalone(redis) = &mut srv.backend else { unreachable!() };
    redis.restart();
    let up = eventually(Duration::from_secs(15), || async {
        (ready(srv.base.clone()).await == StatusCode::OK).then_some(())
    })
    .await;
    assert!(up.is_some(), "readyz did not recover");
    srv.stop().await;
}

/// A `?wait=` holds a live-reader slot: with none free it is 503 with `Retry-After`, while a
/// plain read still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_count_as_live_readers() {
    let srv = serve(TestBackend::Memory, |c| c.max_live_readers = 0).await;
    let (s, _) =
        post(&srv, "/v1/queues/default/commands", json!({"id": "w-1", "type": "sleep", "params": {"ms": 60000}})).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let res = client().get(format!("{}/v1/commands/w-1?wait=1s", srv.base)).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&res, "retry-after"), Some("2"));
    let v: Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
    assert_eq!(v["error"], "too_many_live_readers");
    let (s, st) = get(&srv, "/v1/commands/w-1").await;
    assert_eq!((s, st["id"].as_str()), (StatusCode::OK, Some("w-1")));
    // A submit that would wait is refused the same way, before anything is stored.
    let res = client()
        .post(format!("{}/v1/queues/default/commands?wait=1s", srv.base))
        .body(json!({"id": "w-2", "type": "echo"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    let (s, _) = get(&srv, "/v1/commands/w-2").await;
    assert_eq!(s, StatusCode::NOT_FOUND, "nothing stored");
    // A terminal command needs no slot: the wait returns at once.
    post(&srv, "/v1/commands/w-1/cancel", json!(null)).await;
    let (s, st) = get(&srv, "/v1/commands/w-1?wait=1s").await;
    assert_eq!((s, st["status"].as_str()), (StatusCode::OK, Some("CANCELLED")));
    srv.stop().await;
}
