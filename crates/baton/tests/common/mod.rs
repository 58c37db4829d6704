//! Shared helpers of the `baton serve` integration tests: an in-process server on a free port
//! over a given backend, and a small HTTP client.

#![allow(dead_code)]

use std::time::Duration;

use baton::server::Server;
use baton::settings::{ServeConfig, Storage};
use baton_testkit::TestBackend;

/// A running server and the backend it uses (kept alive as long as the server).
pub struct TestServer {
    pub server: Option<Server>,
    pub base: String,
    pub backend: TestBackend,
}

impl TestServer {
    /// `{base}/v1/stream/{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("{}/v1/stream/{}", self.base, path)
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown().await;
        }
    }
}

/// Test settings: short long-poll and SSE timings so tests are quick.
pub fn test_config() -> ServeConfig {
    ServeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        long_poll_timeout: Duration::from_millis(700),
        sse_heartbeat: Duration::from_millis(300),
        sse_cycle: Duration::from_secs(30),
        shutdown_grace: Duration::from_secs(5),
        ..ServeConfig::default()
    }
}

pub async fn start(backend: TestBackend, tweak: impl FnOnce(&mut ServeConfig)) -> TestServer {
    let mut cfg = test_config();
    cfg.backend = match backend.redis_config() {
        None => Storage::Memory,
        Some(rc) => Storage::Redis(rc),
    };
    tweak(&mut cfg);
    let server = Server::start(cfg).await.expect("server starts");
    let base = server.base_url();
    TestServer { server: Some(server), base, backend }
}

/// The three backends, by name: `memory`, `standalone`, `cluster`.
pub fn backend(name: &str) -> TestBackend {
    match name {
        "memory" => TestBackend::Memory,
        "standalone" => TestBackend::Standalone(baton_testkit::RedisServer::start()),
        "cluster" => TestBackend::Cluster(baton_testkit::RedisCluster::start()),
        other => panic!("unknown backend {other}"),
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap()
}

pub fn header<'a>(res: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    res.headers().get(name).and_then(|v| v.to_str().ok())
}

/// Sends `method url` with `body` as JSON (if any): the status and the reply parsed as JSON
/// (`Null` for an empty body, the text as a JSON string when it is not JSON).
pub async fn call(
    method: reqwest::Method,
    url: String,
    body: Option<serde_json::Value>,
) -> (reqwest::StatusCode, serde_json::Value) {
    let mut rb = client().request(method, url);
    if let Some(b) = body {
        rb = rb.header("content-type", "application/json").body(b.to_string());
    }
    let res = rb.send().await.expect("request");
    let status = res.status();
    let text = res.text().await.unwrap();
    let v = if text.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text))
    };
    (status, v)
}

/// `POST <server><path>` with a JSON body: see [`call`].
pub async fn post(srv: &TestServer, path: &str, body: serde_json::Value) -> (reqwest::StatusCode, serde_json::Value) {
    call(reqwest::Method::POST, format!("{}{path}", srv.base), Some(body)).await
}

/// `GET <server><path>`: see [`call`].
pub async fn get(srv: &TestServer, path: &str) -> (reqwest::StatusCode, serde_json::Value) {
    call(reqwest::Method::GET, format!("{}{path}", srv.base), None).await
}

/// Reads an SSE response until `pred` holds on the text so far, the server ends the body, or
/// `within` passes. The flag is true only when the server ended the body (a clean end): a
/// broken connection or the client's own timeout (an error of the body) is not an end.
pub async fn read_sse_until(res: reqwest::Response, within: Duration, pred: impl Fn(&str) -> bool) -> (String, bool) {
    use futures::StreamExt;
    let mut body = res.bytes_stream();
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, body.next()).await {
            Ok(Some(Ok(chunk))) => {
                text.push_str(&String::from_utf8_lossy(&chunk));
                if pred(&text) {
                    return (text, false);
                }
            }
            Ok(None) => return (text, true),
            Ok(Some(Err(_))) | Err(_) => return (text, false),
        }
    }
}

/// Parsed SSE events: (event type, data joined with `\n`, id).
pub fn sse_events(text: &str) -> Vec<(String, String, Option<String>)> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut ev = String::new();
        let mut data: Vec<&str> = Vec::new();
        let mut id = None;
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                ev = v.trim().to_string();
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push(v);
            } else if let Some(v) = line.strip_prefix("id:") {
                id = Some(v.to_string());
            }
        }
        if !ev.is_empty() {
            out.push((ev, data.join("\n"), id));
        }
    }
    out
}

/// A TCP relay to a local Redis that holds the first connection made through it until
/// [`HeldRelay::release`] (later connections are relayed at once): to act while a process is
/// still starting, e.g. signal it once it is known to be connecting.
pub struct HeldRelay {
    connected: tokio::sync::mpsc::UnboundedReceiver<()>,
    go: std::sync::Arc<tokio::sync::Notify>,
}

impl HeldRelay {
    /// Listens on a free port; returns its `redis://127.0.0.1:PORT` URL and the relay.
    pub async fn start(redis_port: u16) -> (String, HeldRelay) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}", listener.local_addr().unwrap());
        let (tx, connected) = tokio::sync::mpsc::unbounded_channel();
        let go = std::sync::Arc::new(tokio::sync::Notify::new());
        let go2 = go.clone();
        tokio::spawn(async move {
            let mut released = false;
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else { return };
                let _ = tx.send(());
                if !released {
                    go2.notified().await;
                    released = true;
                }
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(("127.0.0.1", redis_port)).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        (url, HeldRelay { connected, go })
    }

    /// Waits (up to 20 s) for the first connection.
    pub async fn connected(&mut self) {
        tokio::time::timeout(Duration::from_secs(20), self.connected.recv())
            .await
            .expect("a connection through the relay within 20 s")
            .expect("relay running");
    }

    /// Lets the held connection (and every later one) through.
    pub fn release(&self) {
        self.go.notify_one();
    }
}

/// In [`sigterm_while_starting`]'s arguments: replaced by the relay's Redis URL.
pub const RELAY: &str = "{relay}";

/// Runs `baton <args>` with Redis reached through a [`HeldRelay`] ([`RELAY`] in `args` stands for
/// its URL), sends SIGTERM once the process holds its first Redis connection (it is starting),
/// lets the connection through, and returns its exit status, stdout and stderr (it must exit
/// within 30 s).
pub async fn sigterm_while_starting(args: &[&str], redis_port: u16) -> (std::process::ExitStatus, String, String) {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let (relay_url, mut relay) = HeldRelay::start(redis_port).await;
    let args: Vec<&str> = args.iter().map(|a| if *a == RELAY { relay_url.as_str() } else { a }).collect();
    let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(&args)
        .env_remove("BATON_CONFIG")
        .env_remove("BATON_REDIS")
        .env_remove("BATON_REDIS_CLUSTER")
        .env_remove("BATON_LISTEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    relay.connected().await;
    let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(killed.success());
    relay.release();
    let done = tokio::task::spawn_blocking(move || {
        let status = child.wait().unwrap();
        let (mut out, mut err) = (String::new(), String::new());
        child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        (status, out, err)
    });
    tokio::time::timeout(Duration::from_secs(30), done).await.expect("exits").unwrap()
}

/// `POST <base><path>` of a raw body (JSON content type): the status and the body as JSON (a
/// body that is not JSON as a JSON string).
pub async fn post_raw(base: &str, path: &str, body: String) -> (reqwest::StatusCode, serde_json::Value) {
    let res = client()
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = res.status();
    let text = res.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)))
}

/// What the submit body `item` (raw JSON text) gets when `POST`ed alone to `submit_path`, in the
/// shape of a batch result: `{"status", "state"}` or `{"status", …the error body}`.
pub async fn submitted_alone(base: &str, submit_path: &str, item: &str) -> serde_json::Value {
    let (s, body) = post_raw(base, submit_path, item.to_string()).await;
    let mut r = serde_json::Map::new();
    r.insert("status".into(), serde_json::json!(s.as_u16()));
    match body {
        serde_json::Value::Object(m) if s.as_u16() >= 400 => r.extend(m),
        state => {
            r.insert("state".into(), state);
        }
    }
    serde_json::Value::Object(r)
}
