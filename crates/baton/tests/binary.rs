//! The `baton` binary: configuration from environment and TOML, the start-up announcement, and a
//! clean exit on SIGTERM while a live reader is connected.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn serve_announces_backend_and_exits_cleanly_on_sigterm() {
    let port = baton_testkit::free_port();
    let dir = std::env::temp_dir().join(format!("baton-binary-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("baton.toml");
    // The file sets the port and a long-poll timeout; the environment overrides the timeout.
    std::fs::write(&cfg, format!("listen = \"127.0.0.1:{port}\"\nlong_poll_timeout = \"20s\"\n")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["serve", "--config", cfg.to_str().unwrap()])
        .env("BATON_LONG_POLL_TIMEOUT", "300ms")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    assert!(first.contains(&format!("http://127.0.0.1:{port}")), "{first}");
    assert!(first.contains("IN-MEMORY"), "{first}");

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        assert_eq!(c.get(format!("{base}/healthz")).send().await.unwrap().status(), 200);
        let url = format!("{base}/v1/stream/acme/bin");
        assert_eq!(c.put(&url).send().await.unwrap().status(), 201);
        // The environment's 300 ms long-poll timeout wins over the file's 20 s.
        let t0 = Instant::now();
        let r = c.get(format!("{url}?offset=now&live=long-poll")).send().await.unwrap();
        assert_eq!(r.status(), 204);
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        // An SSE reader is connected when SIGTERM arrives: the process still exits promptly.
        let sse = c.get(format!("{url}?offset=-1&live=sse")).send().await.unwrap();
        assert_eq!(sse.status(), 200);
        let t0 = Instant::now();
        let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
        assert!(killed.success());
        // The server ends the stream cleanly (a reset or a cut chunked body is an error here).
        let body = sse.bytes().await.expect("the SSE body ends cleanly");
        let body = String::from_utf8_lossy(&body);
        assert!(body.starts_with("retry: 500\n\n") && body.contains("event: control"), "{body}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "baton serve did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit status {status}");
    let rest: Vec<String> = out.lines().map_while(Result::ok).collect();
    assert!(rest.iter().any(|l| l.contains("shutting down")), "{rest:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_configuration_is_refused_with_a_message() {
    let out =
        Command::new(env!("CARGO_BIN_EXE_baton")).args(["serve", "--long-poll-timeout", "soon"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a duration"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["serve", "--redis", "redis://127.0.0.1:1", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // Named once: not "cannot use Redis redis://…: … cannot connect to Redis at Redis redis://…".
    assert_eq!(err.matches("127.0.0.1:1").count(), 1, "{err}");
    assert!(err.starts_with("baton serve: cannot connect to Redis at redis://127.0.0.1:1: "), "{err}");
    assert!(!err.contains("Redis redis://"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["worker", "--redis-cluster", "redis://127.0.0.1:1,redis://127.0.0.1:2"])
        .env("BATON_LOG", "off")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("baton worker: cannot connect to Redis Cluster at redis://127.0.0.1:1,redis://127.0.0.1:2: "),
        "{err}"
    );
}

/// SIGTERM while one of `baton serve`'s own workers runs a handler: the process exits (with
/// success) only after the handler finished within `--shutdown-grace`, so the command is
/// `SUCCEEDED` the moment the process is gone (nobody else could have finished it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_finishes_running_handlers_before_exiting_on_sigterm() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    let port = baton_testkit::free_port();
    let dir = std::env::temp_dir().join(format!("baton-binary-term-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("baton.toml");
    std::fs::write(&cfg, "[queues.jobs]\nclaim_timeout = \"1s\"\n[queues.jobs.handlers]\nnap = \"sleep\"\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["serve", "--config", cfg.to_str().unwrap(), "--redis", &redis.url(), "--shutdown-grace", "20s"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env_remove("BATON_REDIS_CLUSTER")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    assert!(first.contains("listening on"), "{first}");

    let store =
        baton_commands::CommandStore::redis(baton_redis::RedisClient::new(redis.config()).unwrap(), Default::default())
            .await
            .unwrap();
    let cmd = baton_commands::Command::with_id("nap-serve", "nap", serde_json::json!({"ms": 1500}));
    store.submit("jobs", cmd).await.unwrap();
    let running = baton_testkit::eventually(Duration::from_secs(10), || async {
        (store.messages().stats("jobs").await.ok()?.pending == 1).then_some(())
    })
    .await;
    assert!(running.is_some(), "the server's worker never took the command");
    let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(killed.success());
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap()).await.unwrap();
    assert!(status.success(), "exit status {status}");
    let st = store.get("nap-serve").await.unwrap().expect("stored");
    assert_eq!(st.status, baton_commands::CommandStatus::Succeeded, "not drained at SIGTERM: {st:?}");
    assert_eq!(st.result, Some(serde_json::json!({"slept_ms": 1500}).into()));
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGTERM while `baton serve` is still starting (connecting to Redis) is not fatal: the server
/// finishes starting, then shuts down as for any SIGTERM (drains its workers, exits with
/// success). Redis is reached through a relay that holds the first connection until the signal
/// has been sent, so the signal surely arrives during startup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_starting_shuts_serve_down_cleanly() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    let (status, out, err) = common::sigterm_while_starting(
        &["serve", "--redis", common::RELAY, "--listen", "127.0.0.1:0", "--shutdown-grace", "5s"],
        redis.port(),
    )
    .await;
    assert!(status.success(), "{status:?}\nstdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("baton serve: listening on"), "{out}");
    assert!(out.contains("baton serve: shutting down"), "{out}");
}
