//! `POST /v1/queues/{queue}/commands/batch`: each item answered exactly as a submit of it alone
//! (`POST /v1/queues/{queue}/commands`) would answer, in the order of the items; whole-request
//! errors; every created command runs; on Redis, one script call for the whole batch.

use crate::common;

use std::time::Duration;

use baton::settings::default_queues;
use baton_testkit::{eventually, on_memory_and_standalone, TestBackend};
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

/// The result a submit of `item` alone gets, as a batch result: `{"status", …its body}`.
async fn alone(srv: &TestServer, item: &Value) -> Value {
    submitted_alone(&srv.base, SUBMIT, &item.to_string()).await
}

/// New, same id and body (200, same state), same id with other params (409), a bad item (400),
/// an unknown type (400 unknown_type), the same new id twice, a bad id: each result is what the
/// item alone gets, in order; the new command runs to SUCCEEDED.
async fn mixed_batch(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    // Scheduled an hour ahead: its state stays as submitted.
    let kept = json!({"id": "later-1", "type": "echo", "params": {"n": 1}, "delay": "1h"});
    let (s, kept_state) = post(&srv, SUBMIT, kept.clone()).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let items = vec![
        json!({"id": "new-1", "type": "echo", "params": {"n": 0}}),
        kept.clone(),
        json!({"id": "later-1", "type": "echo", "params": {"n": 2}, "delay": "1h"}),
        json!({"type": "echo", "prams": 1}),
        json!({"type": "nope"}),
        json!({"id": "new-1", "type": "echo", "params": {"n": 0}}),
        json!(5),
        json!({"id": "with space", "type": "echo"}),
        json!({"type": "echo"}),
    ];
    let (s, report) = post(&srv, BATCH, json!({ "commands": items })).await;
    assert_eq!(s, StatusCode::OK, "{report}");
    let results = report["results"].as_array().unwrap();
    assert_eq!(results.len(), 9, "{report}");
    assert_eq!(report.as_object().unwrap().len(), 1, "{report}");

    // 0: created.
    assert_eq!(results[0]["status"], 202);
    assert_eq!(
        (results[0]["state"]["id"].as_str(), results[0]["state"]["status"].as_str(), &results[0]["state"]["params"]),
        (Some("new-1"), Some("SUBMITTED"), &json!({"n": 0}))
    );
    assert_eq!(results[0]["state"]["version"], 1);
    // 1: stored already with the same body: 200 and the state as it is.
    assert_eq!(results[1], json!({"status": 200, "state": kept_state}));
    // 2: other params: 409 as alone.
    assert_eq!(
        results[2],
        json!({"status": 409, "error": "conflict",
               "message": "command later-1 already exists with a different type or params; resubmit the same body, or use a new id"})
    );
    // 3: not a submit body.
    assert_eq!(
        results[3],
        json!({"status": 400, "error": "invalid_body",
               "message": "unknown field \"prams\"; a command body has only id, type, params, output, run_at, delay, concurrency_key and priority"})
    );
    // 4: no handler for the type.
    assert_eq!(
        results[4],
        json!({"status": 400, "error": "unknown_type",
               "message": "queue \"default\" has no handler for type \"nope\"; use one of echo, fail, sleep"})
    );
    // 5: the new id again, same body: 200 with the state item 0 created.
    assert_eq!(results[5], json!({"status": 200, "state": results[0]["state"]}));
    // 6: not an object.
    assert_eq!((&results[6]["status"], &results[6]["error"]), (&json!(400), &json!("invalid_body")));
    // 7: a bad id.
    assert_eq!((&results[7]["status"], &results[7]["error"]), (&json!(400), &json!("invalid_id")));
    // 8: created with an id of the server's.
    assert_eq!(results[8]["status"], 202);
    let generated = results[8]["state"]["id"].as_str().unwrap().to_string();
    assert_eq!(generated.len(), 36, "{generated}");

    // Every refusal is the one the item gets alone (which stores nothing either).
    for i in [2, 3, 4, 6, 7] {
        assert_eq!(results[i], alone(&srv, &items[i]).await, "item {i}");
    }
    // And the stored ones answer 200 alone now.
    assert_eq!(alone(&srv, &items[1]).await, json!({"status": 200, "state": kept_state}));

    for id in ["new-1", generated.as_str()] {
        let done = eventually(Duration::from_secs(15), || async {
            let (_, st) = get(&srv, &format!("/v1/commands/{id}")).await;
            (st["status"] == "SUCCEEDED").then_some(st)
        })
        .await;
        assert!(done.is_some(), "{id} did not succeed");
    }
    let (_, st) = get(&srv, "/v1/commands/new-1").await;
    assert_eq!(st["result"], json!({"n": 0}));
    srv.stop().await;
}

/// 100 items: the results in the order of the items, every one created and run to SUCCEEDED
/// with its own result.
async fn order_and_runs(backend: TestBackend) {
    let srv = serve(backend, |_| {}).await;
    let items: Vec<Value> =
        (0..100).map(|i| json!({"id": format!("o-{i}"), "type": "echo", "params": {"n": i}})).collect();
    let (s, report) = post(&srv, BATCH, json!({ "commands": items })).await;
    assert_eq!(s, StatusCode::OK);
    let results = report["results"].as_array().unwrap();
    assert_eq!(results.len(), 100);
    for (i, r) in results.iter().enumerate() {
        assert_eq!((r["status"].as_u64(), r["state"]["id"].as_str()), (Some(202), Some(format!("o-{i}").as_str())));
    }
    for i in 0..100 {
        let done = eventually(Duration::from_secs(20), || async {
            let (_, st) = get(&srv, &format!("/v1/commands/o-{i}")).await;
            (st["status"] == "SUCCEEDED").then_some(st)
        })
        .await
        .unwrap_or_else(|| panic!("o-{i} did not succeed"));
        assert_eq!(done["result"], json!({"n": i}));
    }
    srv.stop().await;
}

on_memory_and_standalone!(mixed_batch, order_and_runs);

/// Whole-request refusals: nothing stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_request_errors() {
    let srv = serve(TestBackend::Memory, |c| c.max_command_body = 1000).await;
    let shape = "send {\"commands\": [{\"type\": \"echo\", \"params\": {…}}, …]}";
    let (s, e) = post_raw(&srv.base, BATCH, "{".into()).await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_json")));
    assert!(e["message"].as_str().unwrap().starts_with("request body is not valid JSON (EOF"), "{e}");
    for (body, message) in [
        ("[]".to_string(), format!("request body must be a JSON object; got an array; {shape}")),
        ("{}".to_string(), format!("missing field \"commands\"; {shape}")),
        (
            r#"{"commands": {}}"#.to_string(),
            format!("\"commands\" must be an array of submit bodies; got an object; {shape}"),
        ),
        (r#"{"commands": []}"#.to_string(), format!("\"commands\" is empty; give 1 to 1000 submit bodies; {shape}")),
        (
            r#"{"comm\u0061nds": []}"#.to_string(),
            format!("\"commands\" is empty; give 1 to 1000 submit bodies; {shape}"),
        ),
        (
            r#"{"commands": [{"type": "echo"}], "wait": "1s"}"#.to_string(),
            format!("unknown field \"wait\"; a batch body has only \"commands\"; {shape}"),
        ),
        (
            json!({ "commands": vec![json!({"type": "echo"}); 1001] }).to_string(),
            format!(
                "\"commands\" has 1001 items; a batch takes at most 1000: send the rest in another request; {shape}"
            ),
        ),
    ] {
        let (s, e) = post_raw(&srv.base, BATCH, body).await;
        assert_eq!((s, e), (StatusCode::BAD_REQUEST, json!({"error": "invalid_body", "message": message})));
    }
    let (s, e) = post(&srv, "/v1/queues/nope/commands/batch", json!({"commands": [{"type": "echo"}]})).await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::NOT_FOUND, Some("unknown_queue")));
    let (_, page) = get(&srv, "/v1/queues/default/commands").await;
    assert_eq!(page["items"], json!([]), "nothing stored");

    // Over 16 MiB: 413 as any body over its limit.
    let big = format!(r#"{{"commands": [{{"type": "echo", "params": "{}"}}]}}"#, "x".repeat(17 << 20));
    let (s, e) = post_raw(&srv.base, BATCH, big).await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::PAYLOAD_TOO_LARGE, Some("body_too_large")));
    // An item over max_command_body: its own 413, as alone; the others go on.
    let item = json!({"type": "echo", "params": "y".repeat(1200)});
    let (s, report) = post(&srv, BATCH, json!({"commands": [item.clone(), {"id": "small", "type": "echo"}]})).await;
    assert_eq!(s, StatusCode::OK);
    let too_large = alone(&srv, &item).await;
    assert_eq!(too_large["status"], 413);
    // The item's text is compact here, the body alone too: the same size in the message.
    assert_eq!(report["results"][0], too_large);
    assert_eq!(
        (report["results"][1]["status"].as_u64(), report["results"][1]["state"]["id"].as_str()),
        (Some(202), Some("small"))
    );
    // Not JSON: 415 as the single submit.
    let res = client()
        .post(format!("{}{BATCH}", srv.base))
        .header("content-type", "text/plain")
        .body(r#"{"commands": [{"type": "echo"}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    srv.stop().await;
}

/// On Redis, a batch of 100 new commands is one `EVALSHA`. Other script calls go on meanwhile
/// (about 20 a second with no service of the queue running: the server's own upkeep), so the
/// count is of the calls that name the batch's ids, from the slow log (every command logged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_script_call_per_batch_on_redis() {
    baton_testkit::require_redis();
    let srv = serve(TestBackend::Standalone(baton_testkit::RedisServer::start()), |c| c.run_workers = false).await;
    let TestBackend::Standalone(redis) = &srv.backend else { unreachable!() };
    // A first submit loads the scripts.
    let (s, _) = post(&srv, SUBMIT, json!({"id": "warm", "type": "echo"})).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    redis.cli(&["CONFIG", "SET", "slowlog-max-len", "100000"]);
    redis.cli(&["CONFIG", "SET", "slowlog-log-slower-than", "0"]);
    redis.cli(&["SLOWLOG", "RESET"]);
    let items: Vec<Value> =
        (0..100).map(|i| json!({"id": format!("probe-{i}"), "type": "echo", "params": {"n": i}})).collect();
    let (s, report) = post(&srv, BATCH, json!({ "commands": items })).await;
    let log = redis.cli(&["SLOWLOG", "GET", "-1"]);
    redis.cli(&["CONFIG", "SET", "slowlog-log-slower-than", "10000"]);
    assert_eq!(s, StatusCode::OK);
    assert!(report["results"].as_array().unwrap().iter().all(|r| r["status"] == 202), "{report}");
    // redis-cli prints the entries' fields one a line: a call's name, then its arguments.
    let mut ours = 0;
    let mut in_evalsha = false;
    let mut counted = false;
    for line in log.lines() {
        if line.eq_ignore_ascii_case("evalsha") {
            in_evalsha = true;
            counted = false;
        } else if line.starts_with("127.0.0.1:") {
            in_evalsha = false;
        } else if in_evalsha && !counted && line.contains("probe-") {
            ours += 1;
            counted = true;
        }
    }
    let all = log.lines().filter(|l| l.eq_ignore_ascii_case("evalsha")).count();
    assert_eq!(ours, 1, "EVALSHA calls naming the batch's ids ({all} EVALSHA in all while it ran)");
    srv.stop().await;
}

/// With tokens: no token is the whole request's 401, a token without write on the queue its 403
/// (as the submit); an item whose output stream the token may not write gets its own 403, the
/// others are stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_as_the_submit() {
    use baton::settings::TokenConfig;
    const WRITER: &str = "writer-secret-0123456789abcdef";
    const READER: &str = "reader-secret-0123456789abcdef";
    let srv = serve(TestBackend::Memory, |c| {
        c.tokens = vec![
            TokenConfig::new("writer", WRITER, &["read", "write"], &["mine/"], &["default"]).unwrap(),
            TokenConfig::new("reader", READER, &["read"], &["*"], &["default"]).unwrap(),
        ]
    })
    .await;
    let send = |token: Option<&'static str>, body: Value| {
        let mut rb = client()
            .post(format!("{}{BATCH}", srv.base))
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(t) = token {
            rb = rb.bearer_auth(t);
        }
        async move {
            let res = rb.send().await.unwrap();
            let s = res.status();
            (s, serde_json::from_str::<Value>(&res.text().await.unwrap()).unwrap())
        }
    };
    let one = json!({"commands": [{"type": "echo"}]});
    let (s, e) = send(None, one.clone()).await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")));
    let (s, e) = send(Some(READER), one).await;
    assert_eq!((s, e["error"].as_str()), (StatusCode::FORBIDDEN, Some("forbidden")));

    let items = json!([
        {"id": "out-1", "type": "echo", "output": {"path": "mine/out-1"}},
        {"id": "out-2", "type": "echo", "output": true},
    ]);
    let (s, report) = send(Some(WRITER), json!({ "commands": items })).await;
    assert_eq!(s, StatusCode::OK, "{report}");
    assert_eq!(
        (report["results"][0]["status"].as_u64(), report["results"][0]["state"]["output"]["stream"].as_str()),
        (Some(202), Some("mine/out-1"))
    );
    // commands/out-2 is not under mine/: refused as the submit alone refuses it.
    let res = client()
        .post(format!("{}{SUBMIT}", srv.base))
        .bearer_auth(WRITER)
        .header("content-type", "application/json")
        .body(items[1].to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::FORBIDDEN);
    let mut alone: Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
    alone.as_object_mut().unwrap().insert("status".into(), json!(403));
    assert_eq!(report["results"][1], alone);
    assert_eq!(report["results"][1]["error"], "forbidden");
    srv.stop().await;
}

/// `baton_commands_submitted_total` counts the items a batch created (not those found, nor
/// those refused), as the submit counts its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_submit_counter_counts_created_items() {
    let srv = start(TestBackend::Memory, |c| {
        c.queues = vec![baton::settings::QueueConfig::with_builtins("batched", &["echo"])];
    })
    .await;
    let item = |i: u32| json!({"id": format!("m-{i}"), "type": "echo", "params": {"n": i}});
    let (s, report) = post(
        &srv,
        "/v1/queues/batched/commands/batch",
        json!({"commands": [item(0), item(1), item(0), {"type": "nope"}, item(2)]}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let statuses: Vec<u64> =
        report["results"].as_array().unwrap().iter().map(|r| r["status"].as_u64().unwrap()).collect();
    assert_eq!(statuses, [202, 202, 200, 400, 202]);
    let text = client().get(format!("{}/metrics", srv.base)).send().await.unwrap().text().await.unwrap();
    assert!(
        text.lines().any(|l| l == "baton_commands_submitted_total{queue=\"batched\"} 3"),
        "{}",
        text.lines().filter(|l| l.contains("submitted_total")).collect::<Vec<_>>().join("\n")
    );
    srv.stop().await;
}
