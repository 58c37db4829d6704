//! Queues and handlers from a TOML file; `baton serve --no-workers` plus `baton worker`
//! processes sharing one Redis: the work is done by the workers, a killed worker's command is
//! taken over by another, JSON logs, worker health and metrics.

use crate::common;

use baton_queue::keys;
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use baton::server::Server;
use baton::settings::ServeArgs;
use baton_commands::{Command as BatonCommand, CommandStatus, CommandStore};
use baton_redis::RedisClient;
use baton_testkit::{eventually, free_port, RedisServer};
use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

const CONFIG: &str = r#"
[queues.jobs]
claim_timeout = "1s"
poll_interval = "100ms"
[queues.jobs.handlers]
nap = "sleep"
say = { kind = "echo" }
"#;

struct Worker {
    child: Child,
    port: u16,
}

impl Worker {
    fn spawn(config: &std::path::Path, redis: &str) -> Worker {
        Self::spawn_with_grace(config, redis, "1s")
    }

    fn spawn_with_grace(config: &std::path::Path, redis: &str, grace: &str) -> Worker {
        let port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_baton"))
            .args(["--log-format", "json", "worker", "--redis", redis, "--shutdown-grace", grace])
            .arg("--config")
            .arg(config)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env_remove("BATON_REDIS_CLUSTER")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("baton worker starts");
        Worker { child, port }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    async fn ready(&self) {
        let ok = eventually(Duration::from_secs(20), || async {
            let r = client().get(self.url("/readyz")).send().await.ok()?;
            (r.status() == StatusCode::OK).then_some(())
        })
        .await;
        assert!(ok.is_some(), "worker did not become ready");
    }

    /// SIGTERM, then the exit status and everything it logged.
    fn terminate(mut self) -> (std::process::ExitStatus, String) {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let status = self.child.wait().unwrap();
        let mut err = String::new();
        self.child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        (status, err)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn wait_state(base: &str, id: &str) -> Value {
    let res = client().get(format!("{base}/v1/commands/{id}?wait=20s")).send().await.unwrap();
    serde_json::from_str(&res.text().await.unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_and_worker_processes_share_redis() {
    baton_testkit::require_redis();
    let redis = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("baton-workers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("baton.toml");
    std::fs::write(&config, CONFIG).unwrap();

    let mut cfg = ServeArgs {
        config: Some(config.clone()),
        redis: baton::settings::RedisArgs { redis: Some(redis.url()), ..Default::default() },
        listen: Some("127.0.0.1:0".parse().unwrap()),
        no_workers: true,
        ..Default::default()
    }
    .resolve()
    .unwrap();
    cfg.shutdown_grace = Duration::from_secs(2);
    assert!(!cfg.queues_defaulted);
    let server = Server::start(cfg).await.unwrap();
    let base = server.base_url();

    // The API knows the configured queue and its handler types, but runs no workers.
    let v: Value = serde_json::from_str(
        &client().get(format!("{base}/v1/queues/jobs")).send().await.unwrap().text().await.unwrap(),
    )
    .unwrap();
    assert_eq!(v["handlers"], json!(["nap", "say"]));
    assert_eq!(v["workers"], json!(false));
    assert_eq!(client().get(format!("{base}/v1/queues/default")).send().await.unwrap().status(), StatusCode::NOT_FOUND);

    // Nothing runs without workers.
    let submit = |body: Value| {
        let base = base.clone();
        async move {
            let r =
                client().post(format!("{base}/v1/queues/jobs/commands")).body(body.to_string()).send().await.unwrap();
            assert_eq!(r.status(), StatusCode::ACCEPTED);
        }
    };
    submit(json!({"id": "say-1", "type": "say", "params": "hi"})).await;
    let st: Value = serde_json::from_str(
        &client().get(format!("{base}/v1/commands/say-1?wait=300ms")).send().await.unwrap().text().await.unwrap(),
    )
    .unwrap();
    assert_eq!(st["status"], "SUBMITTED");

    // One worker: it does the queued work.
    let a = Worker::spawn(&config, &redis.url());
    a.ready().await;
    let st = wait_state(&base, "say-1").await;
    assert_eq!((st["status"].as_str(), &st["result"]), (Some("SUCCEEDED"), &json!("hi")));

    // A long sleep is taken by worker A; a second worker starts; A dies; B finishes it.
    submit(json!({"id": "nap-1", "type": "nap", "params": {"ms": 4000}})).await;
    let taken = eventually(Duration::from_secs(10), || async {
        let v: Value =
            serde_json::from_str(&client().get(format!("{base}/v1/queues/jobs")).send().await.ok()?.text().await.ok()?)
                .ok()?;
        (v["pending"] == 1).then_some(())
    })
    .await;
    assert!(taken.is_some(), "worker A never took the command");
    let b = Worker::spawn(&config, &redis.url());
    b.ready().await;
    drop(a); // SIGKILL: its lease stops renewing
    let st = wait_state(&base, "nap-1").await;
    assert_eq!(st["status"], "SUCCEEDED", "{st}");
    assert_eq!(st["result"], json!({"slept_ms": 4000}));

    // The worker's own metrics and health.
    let metrics = client().get(b.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("baton_queue_length{queue=\"jobs\"} 0"), "{metrics}");
    assert!(
        metrics.contains("baton_command_outcomes_total{queue=\"jobs\",type=\"nap\",outcome=\"succeeded\"} 1"),
        "{metrics}"
    );
    assert_eq!(client().get(b.url("/healthz")).send().await.unwrap().status(), StatusCode::OK);

    // Graceful stop; every log line is one JSON object.
    let (status, logs) = b.terminate();
    assert!(status.success(), "{status:?}\n{logs}");
    let lines: Vec<&str> = logs.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty());
    for l in &lines {
        let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v["level"].is_string() && v["fields"].is_object(), "{l}");
    }
    assert!(logs.contains("consumer started"), "{logs}");
    server.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Names of the consumers of `queue`'s group (`XINFO CONSUMERS baton:q:{queue} baton`).
fn group_consumers(redis: &RedisServer, queue: &str) -> Vec<String> {
    let out = redis.cli(&["XINFO", "CONSUMERS", &keys::stream(keys::DEFAULT_PREFIX, queue), keys::DEFAULT_GROUP]);
    let lines: Vec<&str> = out.lines().collect();
    lines.windows(2).filter(|w| w[0] == "name").map(|w| w[1].to_string()).collect()
}

/// `reap_idle_consumers_after` of a `[queues.*]` table reaches the queue's consumer in `baton
/// serve`: a stale member of the group (as a stopped worker leaves behind) is removed after the
/// configured 1 s, and kept on the queue configured with `"never"`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reap_idle_consumers_after_from_the_config_reaches_the_workers() {
    baton_testkit::require_redis();
    let redis = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("baton-reap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("baton.toml");
    std::fs::write(
        &config,
        r#"
[queues.reaping]
claim_timeout = "500ms"
reap_idle_consumers_after = "1s"
[queues.reaping.handlers]
say = "echo"
[queues.keeping]
claim_timeout = "500ms"
reap_idle_consumers_after = "never"
[queues.keeping.handlers]
say = "echo"
"#,
    )
    .unwrap();
    let cfg = ServeArgs {
        config: Some(config),
        redis: baton::settings::RedisArgs { redis: Some(redis.url()), ..Default::default() },
        listen: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    }
    .resolve()
    .unwrap();
    let reap: Vec<(&str, Option<Duration>)> =
        cfg.queues.iter().map(|q| (q.name.as_str(), q.settings.reap_idle_consumers_after)).collect();
    assert_eq!(reap, [("keeping", None), ("reaping", Some(Duration::from_secs(1)))]);
    let server = Server::start(cfg).await.unwrap();

    // The workers created the groups, one consumer each; a stale member joins each.
    for q in ["keeping", "reaping"] {
        let members = group_consumers(&redis, q);
        assert!(members.len() == 1 && members[0].starts_with("baton-cmd-"), "{q}: {members:?}");
        assert_eq!(
            redis.cli(&[
                "XGROUP",
                "CREATECONSUMER",
                &keys::stream(keys::DEFAULT_PREFIX, q),
                keys::DEFAULT_GROUP,
                "stale-worker"
            ]),
            "1"
        );
    }
    let created = std::time::Instant::now();
    let reaped = eventually(Duration::from_secs(10), || async {
        (!group_consumers(&redis, "reaping").iter().any(|c| c == "stale-worker")).then_some(())
    })
    .await;
    assert!(reaped.is_some(), "not reaped: {:?}", group_consumers(&redis, "reaping"));
    assert!(created.elapsed() >= Duration::from_secs(1), "reaped after {:?}", created.elapsed());
    assert_eq!(group_consumers(&redis, "reaping").len(), 1, "the worker's own consumer stays");
    // At least as idle on the "never" queue, and kept through two more windows of reap checks.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let kept = group_consumers(&redis, "keeping");
    assert!(kept.len() == 2 && kept.iter().any(|c| c == "stale-worker"), "{kept:?}");
    server.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

async fn redis_store(redis: &RedisServer) -> CommandStore {
    CommandStore::redis(RedisClient::new(redis.config()).unwrap(), Default::default()).await.unwrap()
}

/// SIGTERM while a handler runs: the worker stops taking work, lets the handler finish within
/// `--shutdown-grace`, and only then exits (successfully). With one worker and nobody to take the
/// command over, the command is `SUCCEEDED` the moment the process is gone only if it was drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_finishes_running_handlers_before_exiting_on_sigterm() {
    baton_testkit::require_redis();
    let redis = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("baton-worker-term-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("baton.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let store = redis_store(&redis).await;
    let w = Worker::spawn_with_grace(&config, &redis.url(), "20s");
    w.ready().await;
    store.submit("jobs", BatonCommand::with_id("nap-term", "nap", json!({"ms": 1500}))).await.unwrap();
    let running = eventually(Duration::from_secs(10), || async {
        (store.messages().stats("jobs").await.ok()?.pending == 1).then_some(())
    })
    .await;
    assert!(running.is_some(), "the worker never took the command");
    let (status, logs) = w.terminate();
    assert!(status.success(), "{status:?}\n{logs}");
    let st = store.get("nap-term").await.unwrap().expect("stored");
    assert_eq!(st.status, CommandStatus::Succeeded, "not drained at SIGTERM: {st:?}\n{logs}");
    assert_eq!(st.result, Some(json!({"slept_ms": 1500}).into()));
    assert_eq!(store.messages().stats("jobs").await.unwrap().pending, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A worker that cannot serve its `--listen` address fails before any queue consumer starts, so
/// it leaves no member in any queue's group and takes no work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_that_cannot_listen_starts_no_consumer() {
    baton_testkit::require_redis();
    let redis = RedisServer::start();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["worker", "--redis", &redis.url(), "--listen", &addr])
        .env_remove("BATON_CONFIG")
        .env_remove("BATON_REDIS_CLUSTER")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("baton worker: cannot listen on {addr}: ")), "{err}");
    // The built-in default queue: no consumer ever joined its group.
    assert_eq!(
        redis.cli(&["EXISTS", &keys::stream(keys::DEFAULT_PREFIX, "default")]),
        "0",
        "{:?}",
        group_consumers(&redis, "default")
    );
}

/// SIGTERM while `baton worker` is still starting (connecting to Redis) is not fatal: the worker
/// finishes starting, then shuts down as for any SIGTERM (drains, exits with success). Redis is
/// reached through a relay that holds the first connection until the signal has been sent, so
/// the signal surely arrives during startup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_starting_shuts_the_worker_down_cleanly() {
    baton_testkit::require_redis();
    let redis = RedisServer::start();
    let (status, out, err) =
        sigterm_while_starting(&["worker", "--redis", RELAY, "--shutdown-grace", "5s"], redis.port()).await;
    assert!(status.success(), "{status:?}\nstdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("baton worker: working queues default"), "{out}");
    assert!(out.contains("baton worker: shutting down"), "{out}");
}

#[test]
fn worker_refuses_the_memory_backend_and_unknown_queues() {
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .arg("worker")
        .env_remove("BATON_REDIS")
        .env_remove("BATON_REDIS_CLUSTER")
        .env_remove("BATON_REDIS_SENTINEL")
        .env_remove("BATON_CONFIG")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("baton worker: it needs --redis, --redis-cluster or --redis-sentinel"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["worker", "--redis", "redis://127.0.0.1:1", "--queues", "nope"])
        .env_remove("BATON_CONFIG")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--queues names \"nope\", which is not configured; configured: default"), "{err}");
}
