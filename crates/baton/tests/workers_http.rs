//! The HTTP worker protocol of `baton serve` processes (`/v1/queues/{queue}/workers/{worker}/…`),
//! on memory and on Redis: a command claimed, renewed and settled with its exact result bytes, a
//! second settlement refused `409 lease_lost`; a silent worker's command taken over by another
//! after the claim timeout (deliveries 2) and the silent one's settlement refused; a cancel seen
//! on the next renewal; malformed bodies named; auth (`work` claims but cannot submit, `write`
//! cannot claim); a long-poll claim ended by the server's shutdown.

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
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("baton-workers-http-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut config = String::from("[queues.jobs]\nclaim_timeout = \"1s\"\n");
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
        let (st, v) = post_json(&s.worker("w1", "claim"), json!({ "wait": "10m" })).await;
        assert_eq!(st, StatusCode::BAD_REQUEST);
        assert!(v["message"].as_str().unwrap().contains("long-poll timeout"), "{v}");
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
