//! Proves the production-shaped fixtures: TLS, ACL users and passwords, Sentinel, and a Redis
//! Cluster with replicas — real processes, checked with raw commands and `redis-cli`.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use baton_testkit::{require_redis, RedisCluster, RedisSentinelSet, RedisServer, ServerOptions, TestCerts};

/// `redis-cli --tls -h HOST -p PORT --cacert CA [--cert C --key K] ARGS…`.
fn tls_cli(host: &str, port: u16, ca: &Path, client: Option<(&Path, &Path)>, args: &[&str]) -> Output {
    let mut cmd = Command::new("redis-cli");
    cmd.args(["--tls", "-h", host, "-p", &port.to_string(), "--cacert"]).arg(ca);
    if let Some((cert, key)) = client {
        cmd.arg("--cert").arg(cert).arg("--key").arg(key);
    }
    cmd.arg("-e").args(args).stdin(Stdio::null()).output().expect("run redis-cli")
}

fn text(out: &Output) -> String {
    format!("{} {}", String::from_utf8_lossy(&out.stdout).trim(), String::from_utf8_lossy(&out.stderr).trim())
}

fn pong(out: &Output) -> bool {
    out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "PONG"
}

#[test]
fn test_certs_are_pkcs8_and_verify() {
    let started = Instant::now();
    let certs = TestCerts::generate();
    eprintln!("certificates generated in {:?}", started.elapsed());
    for key in [certs.server_key(), certs.client_key()] {
        let pem = std::fs::read_to_string(&key).unwrap();
        assert!(pem.starts_with("-----BEGIN PRIVATE KEY-----"), "{}: not PKCS#8: {pem}", key.display());
    }
    for (ca, cert, ok) in [
        (certs.ca_cert(), certs.server_cert(), true),
        (certs.ca_cert(), certs.client_cert(), true),
        (certs.other_ca_cert(), certs.server_cert(), false),
    ] {
        let out = Command::new("openssl").arg("verify").arg("-CAfile").arg(&ca).arg(&cert).output().unwrap();
        assert_eq!(out.status.success(), ok, "openssl verify {} {}: {}", ca.display(), cert.display(), text(&out));
    }
    let out = Command::new("openssl")
        .args(["x509", "-noout", "-ext", "subjectAltName", "-in"])
        .arg(certs.server_cert())
        .output()
        .unwrap();
    let san = String::from_utf8_lossy(&out.stdout);
    assert!(san.contains("DNS:localhost") && san.contains("IP Address:127.0.0.1"), "{san}");
    let dir = certs.dir().to_path_buf();
    drop(certs);
    assert!(!dir.exists(), "{} not removed", dir.display());
}

#[test]
fn tls_server_without_client_certs() {
    require_redis();
    let certs = TestCerts::generate();
    let started = Instant::now();
    let mut server = RedisServer::start_tls(&certs, false);
    eprintln!("TLS server ready in {:?}", started.elapsed());
    let port = server.tls_port().expect("tls port");
    assert_ne!(port, server.port());
    assert_eq!(server.tls_url(), format!("rediss://127.0.0.1:{port}"));
    assert_eq!(server.tls_url_localhost(), format!("rediss://localhost:{port}"));
    // The harness's plain port still works.
    assert_eq!(server.cli(&["PING"]), "PONG");

    for host in ["127.0.0.1", "localhost"] {
        let out = tls_cli(host, port, &certs.ca_cert(), None, &["PING"]);
        assert!(pong(&out), "PING over TLS to {host}: {}", text(&out));
    }
    // The wrong CA: the server certificate does not verify.
    let out = tls_cli("127.0.0.1", port, &certs.other_ca_cert(), None, &["PING"]);
    assert!(!pong(&out), "PING with the wrong CA answered: {}", text(&out));
    // Plain text on the TLS port gets no PONG.
    let out = Command::new("redis-cli").args(["-p", &port.to_string(), "-e", "PING"]).output().unwrap();
    assert!(!pong(&out), "plain PING on the TLS port answered: {}", text(&out));

    // Restart keeps both ports and TLS.
    server.kill();
    server.restart();
    assert_eq!(server.tls_port(), Some(port));
    let out = tls_cli("127.0.0.1", port, &certs.ca_cert(), None, &["PING"]);
    assert!(pong(&out), "PING over TLS after restart: {}", text(&out));
}

#[test]
fn tls_server_requiring_client_certs() {
    require_redis();
    let certs = TestCerts::generate();
    let server = RedisServer::start_tls(&certs, true);
    let port = server.tls_port().unwrap();
    let client = Some((certs.client_cert(), certs.client_key()));
    let client = client.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
    let out = tls_cli("127.0.0.1", port, &certs.ca_cert(), client, &["PING"]);
    assert!(pong(&out), "PING with the client certificate: {}", text(&out));
    let out = tls_cli("127.0.0.1", port, &certs.ca_cert(), None, &["PING"]);
    assert!(!pong(&out), "PING without a client certificate answered: {}", text(&out));
    eprintln!("without a client certificate: {}", text(&out));
    // The certificates outlive the caller's handle: the server keeps them for a restart.
    drop(certs);
}

#[test]
fn acl_user_and_requirepass() {
    require_redis();
    let server = RedisServer::start();
    server.add_acl_user("app", "s3cret");
    assert_eq!(server.cli(&["AUTH", "app", "s3cret"]), "OK");
    let out = Command::new("redis-cli")
        .args([
            "-p",
            &server.port().to_string(),
            "--user",
            "app",
            "--pass",
            "s3cret",
            "--no-auth-warning",
            "-e",
            "SET",
            "k",
            "v",
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "OK", "{}", text(&out));
    // (redis-cli carries on as the default user after a failed --user/--pass: AUTH directly.)
    let out =
        Command::new("redis-cli").args(["-p", &server.port().to_string(), "AUTH", "app", "wrong"]).output().unwrap();
    assert!(text(&out).contains("WRONGPASS"), "wrong password accepted: {}", text(&out));

    let mut locked = RedisServer::start_with_requirepass(ServerOptions::default(), "adminpw");
    assert_eq!(locked.password(), Some("adminpw"));
    assert_eq!(locked.cli(&["PING"]), "PONG");
    let out = Command::new("redis-cli").args(["-p", &locked.port().to_string(), "-e", "GET", "k"]).output().unwrap();
    assert!(text(&out).contains("NOAUTH"), "no password yet answered: {}", text(&out));
    locked.add_acl_user("app", "s3cret");
    assert_eq!(locked.cli(&["AUTH", "app", "s3cret"]), "OK");
    locked.kill();
    locked.restart();
    assert_eq!(locked.cli(&["PING"]), "PONG");
}

#[test]
fn sentinel_failover_after_master_kill() {
    require_redis();
    let started = Instant::now();
    let mut set = RedisSentinelSet::start(2, 3);
    eprintln!("sentinel set (1 master, 2 replicas, 3 sentinels) ready in {:?}", started.elapsed());
    assert_eq!(set.sentinel_urls().len(), 3);
    assert!(set.sentinel_urls().iter().all(|u| u.starts_with("redis://127.0.0.1:")));
    let old = set.master_port();
    assert_eq!(old, set.nodes()[0].port());
    set.nodes()[0].cli(&["SET", "k", "v"]);

    let killed = Instant::now();
    set.node_by_port(old).kill();
    let new = set.wait_for_failover(old, Duration::from_secs(15));
    eprintln!("sentinel failover {old} -> {new} in {:?}", killed.elapsed());
    assert_ne!(new, old);
    assert_eq!(set.master_port(), new);
    let node = set.node_by_port(new);
    assert!(node.cli(&["INFO", "replication"]).contains("role:master"));
    assert_eq!(node.cli(&["SET", "k2", "v2"]), "OK");
}

#[test]
fn cluster_with_replicas_fails_over() {
    require_redis();
    let started = Instant::now();
    let mut cluster = RedisCluster::start_with_replicas(1);
    eprintln!("cluster with 3 masters + 3 replicas ready in {:?}", started.elapsed());
    assert_eq!(cluster.urls().len(), 6);
    let roles: Vec<String> = cluster
        .nodes()
        .iter()
        .map(|n| {
            let info = n.cli(&["INFO", "replication"]);
            info.lines().find(|l| l.starts_with("role:")).unwrap().trim().to_string()
        })
        .collect();
    assert_eq!(roles.iter().filter(|r| *r == "role:master").count(), 3, "{roles:?}");
    let master =
        cluster.nodes().iter().find(|n| n.cli(&["INFO", "replication"]).contains("role:master")).unwrap().port();

    let killed = Instant::now();
    cluster.kill_master(master);
    let new = cluster.wait_for_failover(master, Duration::from_secs(30));
    eprintln!("cluster failover {master} -> {new} in {:?}", killed.elapsed());
    assert_ne!(new, master);
    for node in cluster.nodes().iter().filter(|n| n.is_running()) {
        let info = node.cli(&["CLUSTER", "INFO"]);
        assert!(info.contains("cluster_state:ok"), "{}: {info}", node.port());
    }
}
