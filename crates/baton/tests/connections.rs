//! The connections of a real `baton` process: silent and half-sent requests are closed after
//! `--header-timeout` (so a descriptor limit is never exhausted), idle kept-alive connections after
//! `--idle-timeout` while live responses are never cut, connections over `--max-connections`
//! are closed at once and counted, and a taken port is refused with a message naming `--listen`.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_baton");

/// A `baton serve` process on a free port, killed when dropped; its stderr goes to a file.
struct Baton {
    child: Child,
    port: u16,
    log: std::path::PathBuf,
}

impl Baton {
    /// Starts `baton serve --listen 127.0.0.1:<free port> <args>`, under a descriptor limit of
    /// `nofile` (soft and hard) when given, and waits for its first line.
    fn start(nofile: Option<u32>, args: &[&str]) -> Baton {
        let port = baton_testkit::free_port();
        let listen = format!("127.0.0.1:{port}");
        let log = std::env::temp_dir().join(format!("baton-conn-{}-{port}.log", std::process::id()));
        let mut cmd = match nofile {
            Some(n) => {
                let mut c = Command::new("bash");
                c.args(["-c", &format!("ulimit -n {n} && exec \"$0\" \"$@\""), BIN]);
                c
            }
            None => Command::new(BIN),
        };
        cmd.args(["serve", "--listen", &listen]).args(args);
        for var in ["BATON_CONFIG", "BATON_REDIS", "BATON_REDIS_CLUSTER", "BATON_LISTEN", "BATON_ADMIN_TOKEN"] {
            cmd.env_remove(var);
        }
        let mut child = cmd.stdout(Stdio::piped()).stderr(std::fs::File::create(&log).unwrap()).spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        out.read_line(&mut first).unwrap();
        // Keep reading: the process prints more lines, and a closed pipe would fail them.
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        assert!(
            first.contains("listening on"),
            "baton serve did not start: {first:?}\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        Baton { child, port, log }
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn connect(&self) -> TcpStream {
        TcpStream::connect(("127.0.0.1", self.port)).unwrap()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `GET /metrics`, retried until the server accepts the connection (within 5 s).
    async fn metric(&self, name: &str) -> f64 {
        let c = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Ok(r) = c.get(format!("{}/metrics", self.base())).send().await {
                let text = r.text().await.unwrap();
                return text
                    .lines()
                    .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.trim().parse::<f64>().ok()))
                    .unwrap_or(0.0);
            }
            assert!(Instant::now() < deadline, "/metrics did not answer");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Baton {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// How long until the peer closes `s` (EOF or reset), at most `within`; `None` if still open.
fn closed_within(s: &mut TcpStream, within: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(t0.elapsed()),
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => return None,
            Err(_) => return Some(t0.elapsed()),
        }
    }
}

/// 1,100 connections that send nothing or half a request head, against a process limited to
/// 1,024 descriptors: those over the connection limit are closed at once, the others after the
/// 2 s header timeout, and `/healthz` answers within 4 s (before this, they held their
/// descriptors forever: accept failed with `Too many open files`, logged every second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_half_sent_connections_do_not_exhaust_descriptors() {
    rlimit::increase_nofile_limit(4096).unwrap();
    let baton = Baton::start(Some(1024), &["--header-timeout", "2s"]);
    let mut held = Vec::with_capacity(1100);
    for i in 0..1100 {
        let mut s = baton.connect();
        if i % 2 == 1 {
            let _ = s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Half: ");
        }
        held.push(s);
    }
    let t0 = Instant::now();
    let c = reqwest::Client::builder().timeout(Duration::from_millis(500)).pool_max_idle_per_host(0).build().unwrap();
    let answered = loop {
        if let Ok(r) = c.get(format!("{}/healthz", baton.base())).send().await {
            break Some((r.status(), t0.elapsed()));
        }
        if t0.elapsed() > Duration::from_secs(4) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let stderr = baton.stderr();
    let (status, after) = answered.unwrap_or_else(|| panic!("/healthz did not answer within 4 s\n{stderr}"));
    assert_eq!(status, 200);
    assert!(after <= Duration::from_secs(4), "{after:?}");
    // Every held connection is closed by the server: at once (over the limit) or by the timeout.
    for s in held.iter_mut() {
        assert!(closed_within(s, Duration::from_secs(3)).is_some(), "a silent connection is still open");
    }
    assert!(baton.metric("baton_http_connections_rejected_total").await >= 1.0);
    assert!(baton.metric("baton_http_connections_timed_out_total{reason=\"header\"}").await >= 500.0);
    assert!(!stderr.contains("Too many open files"), "{stderr}");
}

/// With `--idle-timeout 1s`: an idle kept-alive connection is closed after about a second, while
/// an SSE response and a long-poll stay open well past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_but_live_responses_are_not() {
    let baton = Baton::start(None, &["--idle-timeout", "1s", "--header-timeout", "10s", "--long-poll-timeout", "4s"]);
    // A kept-alive connection after one request.
    let mut s = baton.connect();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.ends_with(b"ok\n") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed before the response");
        got.extend_from_slice(&buf[..n]);
    }
    let closed = closed_within(&mut s, Duration::from_secs(5)).expect("the idle connection is closed");
    assert!(closed >= Duration::from_millis(700) && closed < Duration::from_secs(3), "{closed:?}");

    let c = reqwest::Client::new();
    let url = format!("{}/v1/stream/acme/idle", baton.base());
    assert_eq!(c.put(&url).header("content-type", "text/plain").send().await.unwrap().status(), 201);
    let sse = c.get(format!("{url}?offset=now&live=sse")).send().await.unwrap();
    assert_eq!(sse.status(), 200);
    let t0 = Instant::now();
    let poll = tokio::spawn({
        let c = c.clone();
        let url = url.clone();
        async move { c.get(format!("{url}?offset=now&live=long-poll")).send().await.map(|r| r.status()) }
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    let r = c.post(&url).header("content-type", "text/plain").body("still here").send().await.unwrap();
    assert_eq!(r.status(), 204);
    let (text, _) = common::read_sse_until(sse, Duration::from_secs(3), |t| t.contains("still here")).await;
    assert!(text.contains("still here"), "the SSE response was cut: {text:?}");
    // The long-poll saw the append (or its own 4 s timeout), not a cut connection.
    let status = poll.await.unwrap().expect("the long-poll is answered");
    assert!(status == 200 || status == 204, "{status}");
    assert!(t0.elapsed() >= Duration::from_secs(3));
}

/// With `--header-timeout 2s`: a request whose head is complete but whose body stops arriving
/// (a stream append and a command submit that announce more bytes than they send) is answered
/// `408 body_timeout` after about 2 s and its connection closed, and the connection gauge
/// returns to the one `/metrics` request (before this, such a connection was held as long as the
/// client liked: the header timeout ended with the head, the idle timeout never applied while the
/// request was in flight, so stalled bodies exhausted the connection limit as silent heads once
/// did). A body sent in pieces with pauses shorter than the timeout is read whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_arriving_is_answered_408_and_closed() {
    let baton = Baton::start(None, &["--header-timeout", "2s", "--idle-timeout", "30s"]);
    let c = reqwest::Client::new();
    let url = format!("{}/v1/stream/acme/stalled", baton.base());
    assert_eq!(c.put(&url).header("content-type", "text/plain").send().await.unwrap().status(), 201);
    let heads = [
        "POST /v1/stream/acme/stalled HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\nab",
        "POST /v1/queues/default/commands HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"type\"",
    ];
    for head in heads {
        let mut s = baton.connect();
        s.write_all(head.as_bytes()).unwrap();
        let t0 = Instant::now();
        s.set_read_timeout(Some(Duration::from_secs(6))).unwrap();
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        let took = t0.elapsed();
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 408"), "{head}: {text}");
        assert!(text.contains(r#""error":"body_timeout""#) && text.contains("--header-timeout"), "{text}");
        assert!(took >= Duration::from_millis(1500) && took < Duration::from_secs(5), "{took:?}");
    }
    // Pauses of 1 s between pieces: each wait is shorter than the timeout.
    let mut s = baton.connect();
    s.write_all(b"POST /v1/stream/acme/stalled HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 9\r\nConnection: close\r\n\r\nabc").unwrap();
    for piece in [b"def", b"ghi"] {
        std::thread::sleep(Duration::from_secs(1));
        s.write_all(piece).unwrap();
    }
    let mut got = String::new();
    s.read_to_string(&mut got).unwrap();
    assert!(got.starts_with("HTTP/1.1 204"), "{got}");
    let body = c.get(format!("{url}?offset=-1")).send().await.unwrap().text().await.unwrap();
    assert_eq!(body, "abcdefghi");
    assert_eq!(baton.metric("baton_http_connections_timed_out_total{reason=\"body\"}").await, 2.0);
    drop((c, s));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(baton.metric("baton_http_connections ").await, 1.0, "only the /metrics request is open");
}

/// With `--idle-timeout 1s`: a client that reads an 8 MiB catch-up response slowly (16 KiB
/// every 16 ms, about 8 s in all, more than the server's send buffer holds) receives all of it,
/// while one that stops reading is closed about an idle timeout later. Before this, the idle
/// clock started once the body had been handed to hyper, so the slow reader was cut
/// mid-response after 1 s; and then it counted from the server's last write only, so a reader
/// slow enough that a third of the kernel's send buffer took over 1 s to drain (Linux wakes a
/// writer only then) was cut too (CI, on a loaded machine; now the draining of the send queue
/// counts as progress).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_gets_its_whole_response() {
    let baton = Baton::start(None, &["--idle-timeout", "1s", "--header-timeout", "10s", "--max-body", "9MiB"]);
    let c = reqwest::Client::new();
    let url = format!("{}/v1/stream/acme/big", baton.base());
    let body = vec![b'x'; 8 << 20];
    let r = c.put(&url).header("content-type", "application/octet-stream").body(body).send().await.unwrap();
    assert_eq!(r.status(), 201);
    // A small receive buffer (no autotuning), so the response waits in the server, not in the
    // kernel, while the client reads slowly.
    let slow = tokio::net::TcpSocket::new_v4().unwrap();
    slow.set_recv_buffer_size(16 << 10).unwrap();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", baton.port).parse().unwrap();
    let mut s = slow.connect(addr).await.unwrap().into_std().unwrap();
    s.set_nonblocking(false).unwrap();
    s.write_all(b"GET /v1/stream/acme/big?offset=-1 HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 16 << 10];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    loop {
        std::thread::sleep(Duration::from_millis(16));
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
        if got.len() >= (8 << 20) && got.windows(4).any(|w| w == b"\r\n\r\n") {
            let head = got.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
            if got.len() - head >= 8 << 20 {
                break;
            }
        }
    }
    let head = got.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head") + 4;
    assert!(t0.elapsed() > Duration::from_millis(1500), "the read was not slow: {:?}", t0.elapsed());
    assert_eq!(got.len() - head, 8 << 20, "the response was cut after {:?}", t0.elapsed());
    // A client that stops reading: closed about an idle timeout after its last progress.
    let mut stalled = baton.connect();
    stalled.write_all(b"GET /v1/stream/acme/big?offset=-1 HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    std::thread::sleep(Duration::from_secs(4));
    assert!(closed_within(&mut stalled, Duration::from_secs(5)).is_some(), "a client that stopped reading is closed");
}

/// With `--max-connections 4`: a fifth and sixth connection are closed as soon as accepted and
/// counted in `baton_http_connections_rejected_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_limit_are_closed_at_once_and_counted() {
    let baton = Baton::start(None, &["--max-connections", "4", "--header-timeout", "30s"]);
    let held: Vec<TcpStream> = (0..4).map(|_| baton.connect()).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..2 {
        let mut extra = baton.connect();
        let closed = closed_within(&mut extra, Duration::from_secs(2)).expect("closed at once");
        assert!(closed < Duration::from_secs(1), "{closed:?}");
    }
    drop(held);
    assert!(baton.metric("baton_http_connections_rejected_total").await >= 2.0);
    assert_eq!(baton.metric("baton_http_connections_max").await, 4.0);
}

/// `baton serve` and `baton worker --listen` on a taken port say so and name `--listen`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_port_is_refused_with_what_to_do() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = Command::new(BIN).args(["serve", "--listen", &addr]).env_remove("BATON_CONFIG").output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("cannot listen on {addr}: the address is already in use")), "{err}");
    assert!(err.contains("--listen") && !err.contains("os error"), "{err}");

    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    let out = Command::new(BIN)
        .args(["worker", "--redis", &redis.url(), "--listen", &addr])
        .env_remove("BATON_CONFIG")
        .env_remove("BATON_REDIS_CLUSTER")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already in use") && err.contains("--listen") && !err.contains("os error"), "{err}");
}

/// A request answered before its body was read (a submit to an unknown queue: 404 from the
/// path alone) leaves the body's bytes on the connection, so the connection cannot carry another
/// request: the answer says `Connection: close`, and the connection closes after it. A request
/// whose body was read keeps the connection (the next request on it is answered). Before, the
/// 404 did not say so, and a client that sent its next request on the connection lost it (2–3%
/// of such pairs, seen with the Python SDK).
#[test]
fn an_answer_before_the_body_was_read_closes_the_connection() {
    let b = Baton::start(None, &[]);
    let body = r#"{"type": "sleep", "params": {"ms": 1}}"#;
    let post = |path: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    // Read to the end: the connection stays open for the next request.
    let mut s = b.connect();
    s.write_all(post("/v1/queues/default/commands").as_bytes()).unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut all = String::new();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.read_to_string(&mut all).unwrap();
    assert!(all.starts_with("HTTP/1.1 202"), "{all}");
    assert_eq!(all.matches("HTTP/1.1 ").count(), 2, "both answered on one connection: {all}");
    assert!(!all.split("\r\n\r\n").next().unwrap().to_ascii_lowercase().contains("connection: close"), "{all}");

    // Answered from the path alone: `Connection: close`, and nothing more on the connection.
    let mut s = b.connect();
    s.write_all(post("/v1/queues/nope/commands").as_bytes()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let all = String::from_utf8_lossy(&raw).to_string();
    let head = all.split("\r\n\r\n").next().unwrap().to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 404"), "{all}");
    assert!(head.contains("connection: close"), "the 404 says the connection closes: {all}");
}
