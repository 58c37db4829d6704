//! A second `incident-triage` on a taken address exits at once with status 1 and one line on
//! stderr saying the address is in use and how to pick another (`--listen`), not a Rust error
//! dump (`Os { code: 98, … }`).

use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use baton_testkit::{eventually, free_port};

fn start(port: u16) -> Child {
    Command::new(env!("CARGO_BIN_EXE_incident-triage"))
        .args(["--listen", &format!("127.0.0.1:{port}"), "--log-dir"])
        .arg(std::env::temp_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The output of a process that is expected to exit by itself within 20 s.
fn exited(mut child: Child) -> Output {
    let end = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > end {
            child.kill().unwrap();
            panic!("the process did not exit on a taken port: {:?}", child.wait_with_output().unwrap());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn assert_explains_taken_port(out: &Output, port: u16) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit status 1; stderr: {stderr}");
    assert_eq!(
        stderr.trim_end(),
        format!(
            "incident-triage: cannot listen on 127.0.0.1:{port}: the address is already in use (another \
             incident-triage process, or another program, listens there); pick another address with \
             --listen, e.g. --listen 127.0.0.1:{}",
            port + 1
        ),
        "one clear line on stderr"
    );
    assert!(!stderr.contains("Os {") && !stderr.contains("code: 98"), "no Rust debug dump: {stderr}");
}

#[test]
fn a_port_taken_by_another_program() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let out = exited(start(port));
    assert_explains_taken_port(&out, port);
    assert!(!String::from_utf8_lossy(&out.stdout).contains("incident-triage on http"), "it never served");
}

#[tokio::test]
async fn a_second_process_on_the_same_port() {
    let port = free_port();
    let first = KillOnDrop(start(port));
    let http = reqwest::Client::new();
    eventually(Duration::from_secs(20), || async {
        let r = http.get(format!("http://127.0.0.1:{port}/healthz")).send().await.ok()?;
        r.status().is_success().then_some(())
    })
    .await
    .expect("the first process serves");
    let out = tokio::task::spawn_blocking(move || exited(start(port))).await.unwrap();
    assert_explains_taken_port(&out, port);
    // The first one is unaffected.
    let r = http.get(format!("http://127.0.0.1:{port}/healthz")).send().await.unwrap();
    assert!(r.status().is_success());
    drop(first);
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
