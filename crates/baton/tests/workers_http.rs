//! The HTTP worker protocol of `baton serve` processes (`/v1/queues/{queue}/workers/{worker}/…`),
//! on memory and on Redis: a command claimed, renewed and settled with its exact result bytes, a
//! second settlement refused `409 lease_lost`; a silent worker's command taken over by another
//! after the claim timeout (deliveries 2) and the silent one's settlement refused; a cancel seen
//! on the next renewal; malformed bodies named; auth (`work` claims but cannot submit, `write`
//! cannot claim); a long-poll claim ended by the server's shutdown; a claim's wait cut to the
//! long-poll timeout; many settlements in one request; a hand-off to an unknown queue refused;
//! a claim abandoned by its worker hands back what it got at once.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use baton_testkit::{eventually, free_port, RedisServer};
use reqwest::StatusCode;
use serde_json::{json, Value};

const WORK: &str = "work-token-0123456789";
const WRITE: &str = "write-token-0123456789";

/// A `baton serve --no-workers` child process on a free port with one queue `jobs` (claim
/// timeout 1 s, no handlers: any command type).
struct Serve {
    child: Child,
    port: u16,
    _dir: tempdir::Dir,
}

mod tempdir {
    /// A directory removed on drop.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Serve {
    async fn spawn(redis: Option<&str>, tokens: bool) -> Serve {
        Serve::spawn_with(redis, tokens, &[]).await
    }

    /// With more `baton serve` arguments.
    async fn spawn_with(redis: Option<&str>, tokens: bool, extra: &[&str]) -> Serve {
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("baton-workers-http-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut config =
            String::from("[queues.jobs]\nclaim_timeout = \"1s\"\n[queues.other]\nclaim_timeout = \"1s\"\n");
        if tokens {
            config.push_str(&format!(
                "[[tokens]]\nname = \"worker\"\ntoken = \"{WORK}\"\noperations = [\"work\"]\nqueues = [\"jobs\"]\n\
                 [[tokens]]\nname = \"client\"\ntoken = \"{WRITE}\"\noperations = [\"read\", \"write\"]\nqueues = [\"jobs\"]\n"
            ));
        }
        let file = dir.join("baton.toml");
        std::fs::write(&file, config).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
        cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--no-workers", "--config"]).arg(&file);
        if let Some(r) = redis {
            cmd.args(["--redis", r]);
        }
        cmd.args(extra);
        cmd.env_remove("BATON_REDIS")
            .env_remove("BATON_REDIS_CLUSTER")
            .env_remove("BATON_ADMIN_TOKEN")
            .env_remove("BATON_CONFIG");
        let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("baton serve starts");
        let s = Serve { child, port, _dir: tempdir::Dir(dir) };
        let up = eventually(Duration::from_secs(20), || async {
            let r = client().get(s.url("/healthz")).send().await.ok()?;
            (r.status() == StatusCode::OK).then_some(())
        })
        .await;
        assert!(up.is_some(), "baton serve did not start");
        s
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn worker(&self, worker: &str, op: &str) -> String {
        self.url(&format!("/v1/queues/jobs/workers/{worker}/{op}"))
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap()
}

/// POSTs `body` (JSON text) with an optional bearer token: status, body text.
async fn post(url: &str, body: &str, token: Option<&str>) -> (StatusCode, String) {
    let mut rb = client().post(url).header("content-type", "application/json").body(body.to_string());
    if let Some(t) = token {
        rb = rb.bearer_auth(t);
    }
    let r = rb.send().await.unwrap();
    (r.status(), r.text().await.unwrap())
}

async fn post_json(url: &str, body: Value) -> (StatusCode, Value) {
    let (s, text) = post(url, &body.to_string(), None).await;
    (s, serde_json::from_str(&text).unwrap_or(Value::Null))
}

async fn submit(s: &Serve, id: &str, params: &str) {
    let (st, text) =
        post(&s.url("/v1/queues/jobs/commands"), &format!(r#"{{"id":"{id}","type":"job","params":{params}}}"#), None)
            .await;
    assert_eq!(st, StatusCode::ACCEPTED, "{text}");
}

async fn get_command(s: &Serve, id: &str) -> (Value, String) {
    let text = client().get(s.url(&format!("/v1/commands/{id}"))).send().await.unwrap().text().await.unwrap();
    (serde_json::from_str(&text).unwrap(), text)
}

/// Claims one command for `worker` (waiting up to `wait`): the lease entry and the body text.
async fn claim_one(s: &Serve, worker: &str, wait: &str) -> (Value, String) {
    let (st, text) = post(&s.worker(worker, "claim"), &json!({ "wait": wait }).to_string(), None).await;
    assert_eq!(st, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let leases = v["leases"].as_array().unwrap();
    assert_eq!(leases.len(), 1, "{text}");
    (leases[0].clone(), text)
}

fn backends() -> Vec<(&'static str, Option<RedisServer>)> {
    vec![("memory", None), ("standalone", Some(RedisServer::start()))]
}

/// A claim on a paused queue gets nothing new (it waits its whole `wait`); a claim waiting when
/// the queue is resumed gets the command at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_on_a_paused_queue_gets_nothing_new() {
    for (name, redis) in backends() {
        let s = Serve::spawn(redis.as_ref().map(|r| r.url()).as_deref(), false).await;
        let (st, v) = post_json(&s.url("/v1/queues/jobs/pause"), json!(null)).await;
        assert_eq!((st, v["paused"].as_bool()), (StatusCode::OK, Some(true)), "{name}: {v}");
        submit(&s, "p-1", "{}").await;
        let t = Instant::now();
        let (st, v) = post_json(&s.worker("w1", "claim"), json!({ "wait": "1s" })).await;
        assert_eq!(st, StatusCode::OK, "{name}: {v}");
        assert_eq!(v["leases"], json!([]), "{name}: claimed while paused: {v}");
        assert!(t.elapsed() >= Duration::from_millis(900), "{name}: the claim waited");
        let (c, _) = get_command(&s, "p-1").await;
        assert_eq!(c["status"], "SUBMITTED", "{name}");
        // A claim waiting across the resume gets the command when it comes.
        let url = s.worker("w1", "claim");
        let waiting = tokio::spawn(async move {
            let t = Instant::now();
            (post_json(&url, json!({ "wait": "20s" })).await, t.elapsed())
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        let resumed = Instant::now();
        let (st, _) = post_json(&s.url("/v1/queues/jobs/resume"), json!(null)).await;
        assert_eq!(st, StatusCode::OK);
        let ((st, v), _) = waiting.await.unwrap();
        assert_eq!(st, StatusCode::OK, "{name}: {v}");
        assert_eq!(v["leases"].as_array().map(Vec::len), Some(1), "{name}: {v}");
        assert!(
            resumed.elapsed() < Duration::from_secs(3),
            "{name}: the waiting claim got it {:?} after the resume",
            resumed.elapsed()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_renew_settle_with_exact_result_then_lease_lost() {
    for (name, redis) in backends() {
        let url = redis.as_ref().map(|r| r.url());
        let s = Serve::spawn(url.as_deref(), false).await;
        // Nothing ready: an empty list after the wait.
        let t = Instant::now();
        let (st, v) = post_json(&s.worker("w1", "claim"), json!({ "wait": "300ms" })).await;
        assert_eq!((st, v.clone()), (StatusCode::OK, json!({ "leases": [] })), "{name}");
        assert!(t.elapsed() >= Duration::from_millis(250), "{name}: the claim waited");

        let params = r#"{"n": 1.50, "big": 18446744073709551617}"#;
        submit(&s, "c1", params).await;
        let (lease, text) = claim_one(&s, "w1", "5s").await;
        assert_eq!(lease["call"], "execute", "{name}");
        assert_eq!(lease["deliveries"], 1, "{name}");
        assert_eq!(lease["lease_timeout_ms"], 1000, "{name}");
        assert_eq!(lease["command"]["id"], "c1", "{name}");
        assert!(text.contains(params), "{name}: params exact in the claim: {text}");
        let token = lease["lease"].as_str().unwrap().to_string();

        let (st, v) = post_json(&s.worker("w1", "renew"), json!({ "leases": [token, "junk"] })).await;
        assert_eq!(st, StatusCode::OK, "{name}");
        assert_eq!(
            v,
            json!({ "leases": [{ "lease": token, "state": "held", "cancelled": false },
                               { "lease": "junk", "state": "gone", "cancelled": false }] }),
            "{name}"
        );

        let result = r#"{"z": 0.1000, "a": [18446744073709551617, "\u00e9"]}"#;
        let body = format!(r#"{{"lease": "{token}", "outcome": "succeeded", "result": {result}}}"#);
        let (st, text) = post(&s.worker("w1", "settle"), &body, None).await;
        assert_eq!(st, StatusCode::OK, "{name}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!((v["applied"].clone(), v["command"]["status"].clone()), (json!(true), json!("SUCCEEDED")), "{name}");
        let (state, raw) = get_command(&s, "c1").await;
        assert_eq!(state["status"], "SUCCEEDED", "{name}");
        assert!(raw.contains(&format!("\"result\":{result}")), "{name}: result bytes kept: {raw}");

        // Settled: a second settlement is refused and changes nothing.
        let (st, v) =
            post_json(&s.worker("w1", "settle"), json!({ "lease": token, "outcome": "failed", "error": "late" })).await;
        assert_eq!((st, v["error"].clone()), (StatusCode::CONFLICT, json!("lease_lost")), "{name}: {v}");
        assert!(v["message"].as_str().unwrap().contains("do not retry"), "{v}");
        assert_eq!(get_command(&s, "c1").await.0["status"], "SUCCEEDED", "{name}");
        let (_, v) = post_json(&s.worker("w1", "renew"), json!({ "leases": [token] })).await;
        assert_eq!(v["leases"][0]["state"], "gone", "{name}");

        // Malformed requests name what to fix.
        let (st, v) = post_json(&s.worker("w1", "settle"), json!({ "lease": "nope", "outcome": "release" })).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{name}: {v}");
        assert!(v["message"].as_str().unwrap().contains("lease"), "{v}");
        let (st, v) = post_json(&s.worker("w1", "settle"), json!({ "lease": token, "outcome": "finished" })).await;
        assert_eq!(st, StatusCode::BAD_REQUEST);
        assert!(v["message"].as_str().unwrap().contains("\"outcome\""), "{v}");
        let (st, v) = post_json(&s.worker("w1", "claim"), json!({ "max": 0 })).await;
        assert_eq!(st, StatusCode::BAD_REQUEST);
        assert!(v["message"].as_str().unwrap().contains("\"max\""), "{v}");
        let (st, v) = post_json(&s.worker(&"x".repeat(129), "claim"), json!({})).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
        assert!(v["message"].as_str().unwrap().contains("worker name"), "{v}");
        let (st, v) = post_json(&s.url("/v1/queues/nope/workers/w1/claim"), json!({})).await;
        assert_eq!((st, v["error"].clone()), (StatusCode::NOT_FOUND, json!("unknown_queue")));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_workers_command_goes_to_another_after_the_claim_timeout() {
    for (name, redis) in backends() {
        let url = redis.as_ref().map(|r| r.url());
        let s = Serve::spawn(url.as_deref(), false).await;
        submit(&s, "c2", "{}").await;
        let (first, _) = claim_one(&s, "w1", "5s").await;
        let t = Instant::now();
        // w1 says nothing more; w2's long-poll gets the command once w1's lease times out.
        let (second, _) = claim_one(&s, "w2", "10s").await;
        assert!(t.elapsed() >= Duration::from_millis(700), "{name}: taken over only after the claim timeout");
        assert_eq!(second["deliveries"], 2, "{name}");
        assert_eq!(second["command"]["id"], "c2", "{name}");
        let (st, v) = post_json(
            &s.worker("w1", "settle"),
            json!({ "lease": first["lease"], "outcome": "succeeded", "result": "stale" }),
        )
        .await;
        assert_eq!((st, v["error"].clone()), (StatusCode::CONFLICT, json!("lease_lost")), "{name}: {v}");
        let (_, v) = post_json(&s.worker("w1", "renew"), json!({ "leases": [first["lease"]] })).await;
        assert_eq!(v["leases"][0]["state"], "lost", "{name}");
        let (st, v) = post_json(
            &s.worker("w2", "settle"),
            json!({ "lease": second["lease"], "outcome": "succeeded", "result": "fresh" }),
        )
        .await;
        assert_eq!((st, v["applied"].clone()), (StatusCode::OK, json!(true)), "{name}: {v}");
        assert_eq!(get_command(&s, "c2").await.0["result"], "fresh", "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_carry_progress_and_details() {
    for (name, redis) in backends() {
        let url = redis.as_ref().map(|r| r.url());
        let s = Serve::spawn(url.as_deref(), false).await;
        submit(&s, "p1", "{}").await;
        let (lease, _) = claim_one(&s, "w1", "5s").await;
        let l = lease["lease"].clone();
        // `details` come back byte for byte (key order and spacing kept).
        let body = format!(
            r#"{{"leases": [{{"lease": {l}, "progress": {{"fraction": 0.25, "message": "page 1 of 4"}}, "details": {{"page": 1, "ids": [7,8]}}}}, {l}]}}"#
        );
        let (st, v) = post(&s.worker("w1", "renew"), &body, None).await;
        assert_eq!(st, StatusCode::OK, "{name}: {v}");
        let v: Value = serde_json::from_str(&v).unwrap();
        assert_eq!(v["leases"][0], json!({ "lease": l, "state": "held", "cancelled": false }), "{name}");
        let (cmd, raw) = get_command(&s, "p1").await;
        assert_eq!(
            (cmd["status"].clone(), cmd["version"].clone(), cmd["progress"].clone()),
            (json!("SUBMITTED"), json!(2), json!({ "fraction": 0.25, "message": "page 1 of 4" })),
            "{name}: {raw}"
        );
        assert!(raw.contains(r#""details":{"page": 1, "ids": [7,8]}"#), "{name}: {raw}");
        // A bad item refuses the request, naming it; nothing is written.
        for (bad, says) in [
            (json!({ "lease": l, "progress": { "fraction": 2 } }), "leases[1]: progress fraction 2 is outside 0 to 1"),
            (json!({ "lease": l, "progress": {} }), "leases[1]: progress needs"),
            (json!({ "lease": l, "progress": { "done": 1 } }), "leases[1]: progress: unknown field \"done\""),
            (json!({ "lease": l, "details": "x".repeat(70_000) }), "leases[1]: details are 70002 bytes of JSON"),
            (json!({ "lease": l, "extra": 1 }), "leases[1]: unknown field \"extra\""),
            (json!(3), "leases[1]: \"lease\" must be a lease string"),
        ] {
            let (st, v) = post_json(&s.worker("w1", "renew"), json!({ "leases": [l, bad] })).await;
            assert_eq!(
                (st, v["error"].clone(), v["index"].clone()),
                (StatusCode::BAD_REQUEST, json!("invalid_body"), json!(1)),
                "{name}: {v}"
            );
            assert!(v["message"].as_str().unwrap().starts_with(says), "{name}: {v}");
        }
        // JSON that does not decode (a lone surrogate escape) is refused, naming what.
        let lease = l.as_str().unwrap();
        for (item, says) in [
            (
                format!(r#"{{"lease": "{lease}", "progress": {{"message": "\ud800"}}}}"#),
                "leases[0]: \"message\" does not decode",
            ),
            (format!(r#"{{"lease": "{lease}", "details": {{"a": ["\udfff"]}}}}"#), "leases[0]: details do not decode"),
            // Past f64's range: refused as out of range (was read as absent, erasing the fraction).
            (
                format!(r#"{{"lease": "{lease}", "progress": {{"fraction": 1e400, "message": "m"}}}}"#),
                "leases[0]: progress fraction 1e400 is outside 0 to 1",
            ),
            (
                format!(r#"{{"lease": "{lease}", "progress": {{"fraction": -1e400}}}}"#),
                "leases[0]: progress fraction -1e400 is outside",
            ),
        ] {
            let (st, v) = post(&s.worker("w1", "renew"), &format!(r#"{{"leases": [{item}]}}"#), None).await;
            let v: Value = serde_json::from_str(&v).unwrap();
            assert_eq!((st, v["index"].clone()), (StatusCode::BAD_REQUEST, json!(0)), "{name}: {v}");
            assert!(v["message"].as_str().unwrap().starts_with(says), "{name}: {v}");
        }
        assert_eq!(get_command(&s, "p1").await.0["version"], 2, "{name}");
        // Settled: the report stays in the final state.
        let (st, v) =
            post_json(&s.worker("w1", "settle"), json!({ "lease": l, "outcome": "succeeded", "result": 1 })).await;
        assert_eq!(st, StatusCode::OK, "{name}: {v}");
        assert_eq!(
            (v["command"]["status"].clone(), v["command"]["details"].clone()),
            (json!("SUCCEEDED"), json!({ "ids": [7, 8], "page": 1 })),
            "{name}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_shows_on_the_next_renewal() {
    for (name, redis) in backends() {
        let url = redis.as_ref().map(|r| r.url());
        let s = Serve::spawn(url.as_deref(), false).await;
        submit(&s, "c3", "{}").await;
        let (lease, _) = claim_one(&s, "w1", "5s").await;
        let (st, _) = post_json(&s.url("/v1/commands/c3/cancel"), json!({})).await;
        assert_eq!(st, StatusCode::OK, "{name}");
        let (_, v) = post_json(&s.worker("w1", "renew"), json!({ "leases": [lease["lease"]] })).await;
        assert_eq!(v["leases"][0]["cancelled"], true, "{name}: {v}");
        let (st, v) = post_json(
            &s.worker("w1", "settle"),
            json!({ "lease": lease["lease"], "outcome": "succeeded", "result": 1 }),
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{name}: {v}");
        assert_eq!(
            (v["applied"].clone(), v["command"]["status"].clone()),
            (json!(false), json!("CANCELLED")),
            "{name}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_tokens_claim_but_cannot_submit_and_write_tokens_cannot_claim() {
    let s = Serve::spawn(None, true).await;
    let submit_url = s.url("/v1/queues/jobs/commands");
    let (st, text) = post(&submit_url, r#"{"type":"job"}"#, Some(WORK)).await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{text}");
    let (st, text) = post(&submit_url, r#"{"id":"c4","type":"job"}"#, Some(WRITE)).await;
    assert_eq!(st, StatusCode::ACCEPTED, "{text}");
    let (st, text) = post(&s.worker("w1", "claim"), "{}", Some(WRITE)).await;
    assert_eq!(st, StatusCode::FORBIDDEN, "{text}");
    assert!(text.contains("may not work queue"), "{text}");
    let (st, text) = post(&s.worker("w1", "claim"), r#"{"wait":"5s"}"#, Some(WORK)).await;
    assert_eq!(st, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["leases"][0]["command"]["id"], "c4");
    let (st, _) = post(&s.worker("w1", "claim"), "{}", None).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_a_long_poll_claim() {
    let s = Serve::spawn(None, false).await;
    let url = s.worker("w1", "claim");
    let t = Instant::now();
    let held = tokio::spawn(async move { post(&url, r#"{"wait":"25s"}"#, None).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed = Command::new("kill").args(["-TERM", &s.child.id().to_string()]).status().unwrap();
    assert!(killed.success());
    let (st, text) = held.await.unwrap();
    assert_eq!((st, text.as_str()), (StatusCode::OK, r#"{"leases":[]}"#));
    assert!(t.elapsed() < Duration::from_secs(10), "the claim ended at shutdown, not after its wait");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claims_wait_beyond_the_long_poll_timeout_is_cut_to_it() {
    let s = Serve::spawn_with(None, false, &["--long-poll-timeout", "1s"]).await;
    let t = Instant::now();
    let (st, v) = post_json(&s.worker("w1", "claim"), json!({ "wait": "10m" })).await;
    assert_eq!((st, v), (StatusCode::OK, json!({ "leases": [] })));
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(5), "waited {took:?}");
}

/// `{"settlements": [...]}`: each item decided as alone, answers in order; a stale lease is a
/// per-item `lease_lost`; a bad item refuses the whole request (naming its index) and settles
/// nothing; a hand-off to a queue the server does not have is refused, not a FAILED command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_settlements_in_one_request() {
    for (name, redis) in backends() {
        let url = redis.as_ref().map(|r| r.url());
        let s = Serve::spawn(url.as_deref(), false).await;
        for id in ["b1", "b2", "b3", "b4"] {
            submit(&s, id, "{}").await;
        }
        let (st, v) = post_json(&s.worker("w1", "claim"), json!({ "max": 4, "wait": "2s" })).await;
        assert_eq!(st, StatusCode::OK, "{name}: {v}");
        let mut leases = std::collections::BTreeMap::new();
        for l in v["leases"].as_array().unwrap() {
            leases.insert(l["command"]["id"].as_str().unwrap().to_string(), l["lease"].as_str().unwrap().to_string());
        }
        assert_eq!(leases.len(), 4, "{name}: {v}");
        // b4 is settled alone first: its lease is stale in the batch.
        let (st, _) =
            post_json(&s.worker("w1", "settle"), json!({ "lease": leases["b4"], "outcome": "cancelled" })).await;
        assert_eq!(st, StatusCode::OK);

        // Refused as a whole: an unknown hand-off target, then a bad field, then a duplicate.
        for (bad, says) in [
            (
                json!({ "lease": leases["b2"], "outcome": "handed_off", "queue": "nowhere" }),
                "settlements[1]: outcome \"handed_off\": no queue \"nowhere\"",
            ),
            (
                json!({ "lease": leases["b2"], "outcome": "failed", "result": 1 }),
                "settlements[1]: field \"result\" does not go with outcome \"failed\"",
            ),
            (
                json!({ "lease": leases["b1"], "outcome": "release" }),
                "settlements[1]: this lease is settled by an earlier item",
            ),
        ] {
            let body = json!({ "settlements": [{ "lease": leases["b1"], "outcome": "succeeded", "result": 1 }, bad] });
            let (st, v) = post_json(&s.worker("w1", "settle"), body).await;
            assert_eq!((st, v["index"].clone()), (StatusCode::BAD_REQUEST, json!(1)), "{name}: {v}");
            assert!(v["message"].as_str().unwrap().starts_with(says), "{name}: {v}");
        }
        for id in ["b1", "b2", "b3"] {
            assert_eq!(get_command(&s, id).await.0["status"], "SUBMITTED", "{name}: nothing settled");
        }

        let body = format!(
            r#"{{"settlements": [
                {{"lease": "{}", "outcome": "succeeded", "result": {{"x": 1.50}}}},
                {{"lease": "{}", "outcome": "handed_off", "queue": "other"}},
                {{"lease": "{}", "outcome": "release"}},
                {{"lease": "{}", "outcome": "succeeded"}}]}}"#,
            leases["b1"], leases["b2"], leases["b3"], leases["b4"]
        );
        let (st, text) = post(&s.worker("w1", "settle"), &body, None).await;
        assert_eq!(st, StatusCode::OK, "{name}: {text}");
        assert!(text.contains(r#""result":{"x": 1.50}"#), "{name}: result bytes kept: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let items = v["settlements"].as_array().unwrap();
        let summary: Vec<(String, Value, Value)> = items
            .iter()
            .map(|i| (i["lease"].as_str().unwrap().to_string(), i["applied"].clone(), i["command"]["status"].clone()))
            .collect();
        assert_eq!(
            summary,
            vec![
                (leases["b1"].clone(), json!(true), json!("SUCCEEDED")),
                (leases["b2"].clone(), json!(true), json!("RUNNING")),
                (leases["b3"].clone(), json!(true), json!("SUBMITTED")),
                (leases["b4"].clone(), Value::Null, Value::Null),
            ],
            "{name}: {text}"
        );
        assert_eq!(items[3]["error"], "lease_lost", "{name}: {text}");
        assert_eq!(get_command(&s, "b4").await.0["status"], "CANCELLED", "{name}");
        // The hand-off reached `other`: claimed there as a check_status call.
        let (st, v) = post_json(&s.url("/v1/queues/other/workers/w9/claim"), json!({ "wait": "3s" })).await;
        assert_eq!(st, StatusCode::OK);
        assert_eq!(
            (v["leases"][0]["command"]["id"].clone(), v["leases"][0]["call"].clone()),
            (json!("b2"), json!("check_status")),
            "{name}: {v}"
        );
        // Empty and oversized batches are refused.
        let (st, v) = post_json(&s.worker("w1", "settle"), json!({ "settlements": [] })).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
        let (st, v) = post_json(&s.worker("w1", "settle"), json!({ "settlements": 3 })).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
        // Single settlements refuse the unknown hand-off target too, changing nothing.
        let (lease, _) = claim_one(&s, "w1", "3s").await;
        let (st, v) = post_json(
            &s.worker("w1", "settle"),
            json!({ "lease": lease["lease"], "outcome": "handed_off", "queue": "jobs" }),
        )
        .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{name}: {v}");
        assert!(v["message"].as_str().unwrap().contains("own queue"), "{v}");
        assert_eq!(get_command(&s, lease["command"]["id"].as_str().unwrap()).await.0["status"], "SUBMITTED");
    }
}

/// A worker that hangs up during a long-poll claim: a command submitted meanwhile is not lost to
/// it (taken, unseen, for a claim timeout and counted as a delivery) but goes to the next
/// worker at once with deliveries 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_claim_hands_back_what_it_got() {
    for (name, redis) in backends() {
        let url = redis.as_ref().map(|r| r.url());
        let s = Serve::spawn(url.as_deref(), false).await;
        for round in 0..3 {
            // It hangs up while the claim's second 250 ms slice is in flight (a read that Redis
            // still completes for the worker's consumer when the request goes away).
            let impatient = reqwest::Client::builder().timeout(Duration::from_millis(300)).build().unwrap();
            let r = impatient
                .post(s.worker("gone", "claim"))
                .header("content-type", "application/json")
                .body(r#"{"wait": "20s"}"#)
                .send()
                .await;
            assert!(r.is_err(), "{name}: the impatient client gave up");
            drop(impatient);
            // The server sees the connection close first.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let id = format!("a{round}");
            submit(&s, &id, "{}").await;
            let t = Instant::now();
            let (lease, text) = claim_one(&s, "w2", "5s").await;
            assert_eq!(
                (lease["command"]["id"].as_str(), lease["deliveries"].as_u64()),
                (Some(id.as_str()), Some(1)),
                "{name}: after {:?}: {text}",
                t.elapsed()
            );
            assert!(t.elapsed() < Duration::from_millis(900), "{name}: handed to w2 after {:?}", t.elapsed());
            let (st, _) =
                post_json(&s.worker("w2", "settle"), json!({ "lease": lease["lease"], "outcome": "succeeded" })).await;
            assert_eq!(st, StatusCode::OK);
        }
    }
}

/// Appends `body` to a lease's output as its producer (`seq` given): status and body text.
async fn append_output(s: &Serve, output: &Value, seq: u64, body: &str) -> (StatusCode, String) {
    let r = client()
        .post(s.url(output["url"].as_str().unwrap()))
        .header("content-type", "application/json")
        .header("producer-id", output["producer_id"].as_str().unwrap())
        .header("producer-epoch", output["producer_epoch"].as_u64().unwrap().to_string())
        .header("producer-seq", seq.to_string())
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    (r.status(), r.text().await.unwrap())
}

/// A claimed command's output stream comes with the lease, opened for that delivery: its worker
/// appends as producer `command`; a later delivery's epoch fences the earlier worker; the
/// settlement ends the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_carries_the_output_stream() {
    let cluster = baton_testkit::RedisCluster::start();
    let cluster_arg = cluster.urls().join(",");
    let mut all: Vec<(&str, Option<RedisServer>, Vec<&str>)> =
        backends().into_iter().map(|(n, r)| (n, r, Vec::new())).collect();
    all.push(("cluster", None, vec!["--redis-cluster", &cluster_arg]));
    for (name, redis, extra) in all {
        let url = redis.as_ref().map(|r| r.url());
        let s = Serve::spawn_with(url.as_deref(), false, &extra).await;
        let (st, text) =
            post(&s.url("/v1/queues/jobs/commands"), r#"{"id":"o1","type":"job","output":true}"#, None).await;
        assert_eq!(st, StatusCode::ACCEPTED, "{name}: {text}");
        let (first, _) = claim_one(&s, "w1", "5s").await;
        let out1 = first["output"].clone();
        assert_eq!(
            (&out1["stream"], &out1["url"], &out1["content_type"], &out1["producer_id"]),
            (&json!("commands/o1"), &json!("/v1/stream/commands/o1"), &json!("application/json"), &json!("command")),
            "{name}: {first}"
        );
        assert_eq!(first["command"]["output"]["url"], "/v1/stream/commands/o1", "{name}");
        let (st, text) = append_output(&s, &out1, 0, r#"{"line":"from w1"}"#).await;
        assert_eq!(st, StatusCode::OK, "{name}: {text}");
        // w1 goes silent; w2 gets the command with a newer epoch, which fences w1.
        let (second, _) = claim_one(&s, "w2", "10s").await;
        let out2 = second["output"].clone();
        assert_eq!(
            out2["producer_epoch"].as_u64(),
            Some(out1["producer_epoch"].as_u64().unwrap() + 1),
            "{name}: {second}"
        );
        let (st, _) = append_output(&s, &out1, 1, r#"{"line":"stale"}"#).await;
        assert_eq!(st, StatusCode::FORBIDDEN, "{name}: the earlier delivery's writer is fenced");
        let (st, text) = append_output(&s, &out2, 0, r#"{"line":"from w2"}"#).await;
        assert_eq!(st, StatusCode::OK, "{name}: {text}");
        let (st, v) =
            post_json(&s.worker("w2", "settle"), json!({ "lease": second["lease"], "outcome": "succeeded" })).await;
        assert_eq!((st, v["applied"].clone()), (StatusCode::OK, json!(true)), "{name}: {v}");
        let r = client().get(s.url("/v1/stream/commands/o1?offset=-1")).send().await.unwrap();
        let closed = r.headers().get("stream-closed").map(|v| v.to_str().unwrap().to_string());
        assert_eq!(closed.as_deref(), Some("true"), "{name}");
        assert_eq!(r.text().await.unwrap(), r#"[{"line":"from w1"},{"line":"from w2"}]"#, "{name}");
        // A command without an output: no output in its lease.
        submit(&s, "plain", "{}").await;
        let (lease, _) = claim_one(&s, "w2", "5s").await;
        assert!(lease.get("output").is_none(), "{name}: {lease}");
    }
}

/// A worker's `rate_limited` settlement: nothing is written (no attempt, no error), no worker of
/// the queue gets a command for `retry_after`, then the same command comes again; a missing or
/// zero `retry_after` is a `400` naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_settlement_backs_off_the_queue() {
    for (name, redis) in backends() {
        let s = Serve::spawn(redis.as_ref().map(|r| r.url()).as_deref(), false).await;
        submit(&s, "r-1", "{}").await;
        let (lease, _) = claim_one(&s, "w1", "5s").await;
        let token = lease["lease"].as_str().unwrap().to_string();
        submit(&s, "r-2", "{}").await;
        let (st, v) = post_json(&s.worker("w1", "settle"), json!({ "lease": token, "outcome": "rate_limited" })).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{name}: {v}");
        assert!(v["message"].as_str().unwrap().contains("\"retry_after\""), "{name}: {v}");
        let (st, v) = post_json(
            &s.worker("w1", "settle"),
            json!({ "lease": token, "outcome": "rate_limited", "retry_after": "0s" }),
        )
        .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{name}: {v}");
        let (st, v) = post_json(
            &s.worker("w1", "settle"),
            json!({ "lease": token, "outcome": "rate_limited", "retry_after": "1500ms" }),
        )
        .await;
        let settled = Instant::now();
        assert_eq!(st, StatusCode::OK, "{name}: {v}");
        assert_eq!(v["applied"], json!(true), "{name}: {v}");
        let (c, _) = get_command(&s, "r-1").await;
        assert_eq!(
            (c["status"].clone(), c["attempts"].clone(), c["errors_count"].clone()),
            (json!("SUBMITTED"), json!(0), json!(0)),
            "{name}: {c}"
        );
        // Another worker gets nothing during the back-off, though r-2 waits in the queue.
        let (st, v) = post_json(&s.worker("w2", "claim"), json!({ "wait": "500ms", "max": 5 })).await;
        assert_eq!((st, v["leases"].clone()), (StatusCode::OK, json!([])), "{name}: claimed during the back-off: {v}");
        // After it both come.
        let mut got = Vec::new();
        while got.len() < 2 && settled.elapsed() < Duration::from_secs(15) {
            let (st, v) = post_json(&s.worker("w2", "claim"), json!({ "wait": "2s", "max": 5 })).await;
            assert_eq!(st, StatusCode::OK, "{name}: {v}");
            for l in v["leases"].as_array().unwrap() {
                assert!(settled.elapsed() >= Duration::from_millis(1_400), "{name}: {l} came during the back-off");
                got.push(l["command"]["id"].as_str().unwrap().to_string());
            }
        }
        got.sort();
        assert_eq!(got, ["r-1", "r-2"], "{name}");
    }
}
