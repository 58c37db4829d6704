//! Breaker tests of `baton commands watch` against a real `baton serve`.

use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_baton");

/// `baton commands watch ID` of a command that has ended, in a queue whose feed has more than
/// `SCAN_MAX` (10,000) entries after the command's creation: the first read finds both of its
/// events (submitted, failed) but is not up to date (the scan stopped at 10,000 entries), the
/// next reads find none of its events. The watch must still end (exit 1, FAILED) with its two
/// lines, not wait forever for an outcome it has already printed.
#[test]
fn watch_of_an_ended_command_in_a_busy_queue_ends() {
    let port = baton_testkit::free_port();
    let mut serve = Command::new(BIN)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .env_remove("BATON_CONFIG")
        .env_remove("BATON_ADMIN_TOKEN")
        .env_remove("BATON_REDIS")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("baton serve starts");
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "baton serve did not listen on {port}");
        std::thread::sleep(Duration::from_millis(30));
    }
    let base = format!("http://127.0.0.1:{port}");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let c = reqwest::Client::new();
        let post = |body: String| {
            let c = c.clone();
            let url = format!("{base}/v1/queues/default/commands");
            async move {
                let r = c.post(url).header("content-type", "application/json").body(body).send().await.unwrap();
                assert!(r.status().is_success(), "{}", r.status());
            }
        };
        post(r#"{"id":"early","type":"fail","params":{"error":"disk full"}}"#.to_string()).await;
        // 10,200 more feed entries (echo: submitted + succeeded each).
        let mut n = 0;
        while n < 5_100 {
            let batch: Vec<_> =
                (n..n + 50).map(|i| post(format!(r#"{{"id":"e{i}","type":"echo","params":{{}}}}"#))).collect();
            futures::future::join_all(batch).await;
            n += 50;
        }
        // Let the echo commands finish (their outcome events).
        tokio::time::sleep(Duration::from_secs(3)).await;
    });
    let mut watch = Command::new(BIN)
        .args(["commands", "watch", "early"])
        .env("BATON_SERVER", &base)
        .env_remove("BATON_TOKEN")
        .env("BATON_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = watch.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if status.is_none() {
        let _ = watch.kill();
    }
    let out = watch.wait_with_output().unwrap();
    let _ = serve.kill();
    let _ = serve.wait();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let kinds: Vec<&str> = stdout.lines().map(|l| l.split(' ').nth(1).unwrap_or("")).collect();
    assert_eq!(
        (status.map(|s| s.code()), kinds),
        (Some(Some(1)), vec!["submitted", "failed"]),
        "the watch of an ended command did not end within 15 s: {stdout}"
    );
}

/// `baton commands watch` of a command of a queue whose event feed is off (`events = { enabled =
/// false }`): the docs say watch exits "as `wait` once it ends"; the command has ended (FAILED),
/// so the watch must end (exit 1) rather than long-poll forever for events that are never
/// appended.
#[test]
fn watch_of_an_ended_command_of_a_queue_with_its_feed_off_ends() {
    let dir = tempfile_dir();
    let cfg = dir.join("baton.toml");
    std::fs::write(&cfg, "[queues.quiet]\nevents = { enabled = false }\n[queues.quiet.handlers]\nfail = \"fail\"\n")
        .unwrap();
    let port = baton_testkit::free_port();
    let mut serve = Command::new(BIN)
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .env("BATON_CONFIG", &cfg)
        .env_remove("BATON_ADMIN_TOKEN")
        .env_remove("BATON_REDIS")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("baton serve starts");
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "baton serve did not listen on {port}");
        std::thread::sleep(Duration::from_millis(30));
    }
    let base = format!("http://127.0.0.1:{port}");
    let run = |args: &[&str]| {
        Command::new(BIN)
            .args(args)
            .env("BATON_SERVER", &base)
            .env_remove("BATON_TOKEN")
            .env("BATON_LOG", "warn")
            .output()
            .unwrap()
    };
    let out = run(&["commands", "submit", "quiet", "fail", r#"{"error":"disk full"}"#, "--id", "q1"]);
    assert!(out.status.success(), "{out:?}");
    let out = run(&["commands", "wait", "q1"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let mut watch = Command::new(BIN)
        .args(["commands", "watch", "q1"])
        .env("BATON_SERVER", &base)
        .env_remove("BATON_TOKEN")
        .env("BATON_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = watch.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if status.is_none() {
        let _ = watch.kill();
    }
    let out = watch.wait_with_output().unwrap();
    let _ = serve.kill();
    let _ = serve.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        status.map(|s| s.code()),
        Some(Some(1)),
        "the watch of an ended command did not end within 15 s: {out:?}"
    );
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("breaker-cli-{}-{}", std::process::id(), baton_testkit::free_port()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
