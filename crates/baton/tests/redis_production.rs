//! `baton serve` on production-shaped Redis: TLS (`rediss://`, `--redis-ca`, client
//! certificates), ACL users with the password from a file, Sentinel, and the opt-in durability
//! `--redis-wait-replicas`. Real `redis-server` processes; the server in process, and the binary
//! for what a user sees at startup.

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use baton::server::Server;
use baton::settings::{RedisArgs, ServeArgs};
use baton_testkit::{RedisSentinelSet, RedisServer, TestCerts};
use common::client;
use reqwest::StatusCode;
use serde_json::{json, Value};

async fn serve(redis: RedisArgs) -> Server {
    let cfg =
        ServeArgs { redis, listen: Some("127.0.0.1:0".parse().unwrap()), ..Default::default() }.resolve().unwrap();
    Server::start(cfg).await.unwrap()
}

/// Submits a command (`id`) and reads its status after a wait; returns both answers.
async fn submit(base: &str, id: &str) -> (StatusCode, String) {
    let body = json!({"id": id, "type": "echo", "params": {"n": 1}});
    let r = client().post(format!("{base}/v1/queues/default/commands")).body(body.to_string()).send().await.unwrap();
    let status = r.status();
    (status, r.text().await.unwrap())
}

async fn final_status(base: &str, id: &str) -> Value {
    let r = client().get(format!("{base}/v1/commands/{id}?wait=5s")).send().await.unwrap();
    serde_json::from_str(&r.text().await.unwrap()).unwrap()
}

/// Create, append to and read back a stream: the three answers must be 201, 204 and the data.
async fn stream_round_trip(base: &str, path: &str) {
    let url = format!("{base}/v1/stream/{path}");
    let c = client();
    assert_eq!(c.put(&url).header("content-type", "text/plain").send().await.unwrap().status(), StatusCode::CREATED);
    let r = c.post(&url).header("content-type", "text/plain").body("hello").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    let r = c.get(format!("{url}?offset=-1")).send().await.unwrap();
    assert_eq!(r.text().await.unwrap(), "hello");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_over_tls_with_a_client_certificate() {
    let certs = TestCerts::generate();
    let redis = RedisServer::start_tls(&certs, true);
    let server = serve(RedisArgs {
        redis: Some(redis.tls_url()),
        redis_ca: Some(certs.ca_cert()),
        redis_client_cert: Some(certs.client_cert()),
        redis_client_key: Some(certs.client_key()),
        ..Default::default()
    })
    .await;
    let base = server.base_url();
    let (status, body) = submit(&base, "tls-1").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(final_status(&base, "tls-1").await["status"], "SUCCEEDED");
    stream_round_trip(&base, "tls/one").await;
    // The data is in that Redis (read over its plain admin port).
    let keys: u64 = redis.cli(&["DBSIZE"]).trim().parse().unwrap();
    assert!(keys > 3, "{keys} keys");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_an_acl_user_and_the_password_from_a_file() {
    let redis = RedisServer::start();
    redis.add_acl_user("baton", "pa55-word");
    // Only the ACL user may log in.
    redis.cli(&["ACL", "SETUSER", "default", "off"]);
    let dir = std::env::temp_dir().join(format!("baton-redis-pw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("redis-password");
    std::fs::write(&file, "pa55-word\n").unwrap();
    let server = serve(RedisArgs {
        redis: Some(format!("redis://baton@127.0.0.1:{}", redis.port())),
        redis_password_file: Some(file.clone()),
        ..Default::default()
    })
    .await;
    let base = server.base_url();
    let (status, body) = submit(&base, "acl-1").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(final_status(&base, "acl-1").await["status"], "SUCCEEDED");
    stream_round_trip(&base, "acl/one").await;
    server.shutdown().await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// What a user sees when the certificate is not trusted, or the password is wrong: `baton
/// serve` exits at startup with a message saying what to fix, never showing the password.
#[test]
fn serve_refuses_to_start_with_a_message_naming_the_fix() {
    let certs = TestCerts::generate();
    let redis = RedisServer::start_tls(&certs, false);
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_baton"))
            .arg("serve")
            .args(args)
            .args(["--listen", "127.0.0.1:0"])
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let other_ca = certs.other_ca_cert();
    let (code, err) = run(&["--redis", &redis.tls_url(), "--redis-ca", other_ca.to_str().unwrap()]);
    assert_ne!(code, Some(0));
    assert!(err.contains("TLS handshake with Redis at rediss://127.0.0.1"), "{err}");
    assert!(err.contains(&format!("not signed by the CA in {}", other_ca.display())), "{err}");

    let plain = RedisServer::start_with_requirepass(Default::default(), "right-one");
    let url = format!("redis://:wrong-one@127.0.0.1:{}", plain.port());
    let (code, err) = run(&["--redis", &url]);
    assert_ne!(code, Some(0));
    assert!(err.contains("cannot connect to Redis at redis://:***@127.0.0.1"), "{err}");
    assert!(!err.contains("wrong-one"), "the password is shown: {err}");
    let (code, err) = run(&["--redis", &plain.url(), "--redis-ca", "/nonexistent.pem"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("--redis-ca and --redis-client-cert are for TLS: use rediss:// URLs"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_wait_for_replicas_when_asked_and_fail_clearly_without_them() {
    let master = RedisServer::start();
    let replica = RedisServer::start();
    replica.replicate_from(&master);
    let server = serve(RedisArgs {
        redis: Some(master.url()),
        redis_wait_replicas: Some(1),
        // Long enough for a loaded CI machine's replica to confirm; the 503s below take this long.
        redis_wait_timeout: Some(Duration::from_secs(1)),
        ..Default::default()
    })
    .await;
    let base = server.base_url();
    let (status, body) = submit(&base, "w-1").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(final_status(&base, "w-1").await["status"], "SUCCEEDED");
    stream_round_trip(&base, "wait/one").await;

    // The replica stops confirming: the submit and the append answer 503 with the reason; both
    // writes are on the master.
    replica.pause();
    let (status, body) = submit(&base, "w-2").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("0 of 1 replica(s) confirmed within 1s"), "{body}");
    let url = format!("{base}/v1/stream/wait/one");
    let r = client().post(&url).header("content-type", "text/plain").body(" again").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.text().await.unwrap().contains("applied on the master"));
    replica.resume();

    // Retrying the submit with its id is safe: one command, and it completes.
    let (status, body) = submit(&base, "w-2").await;
    assert!(status == StatusCode::OK || status == StatusCode::ACCEPTED, "{status} {body}");
    assert_eq!(final_status(&base, "w-2").await["status"], "SUCCEEDED");
    let r = client().get(format!("{url}?offset=-1")).send().await.unwrap();
    assert_eq!(r.text().await.unwrap(), "hello again");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_follows_the_sentinel_master_across_a_failover() {
    let mut set = RedisSentinelSet::start(1, 3);
    let server = serve(RedisArgs {
        redis_sentinel: Some(set.sentinel_urls()),
        redis_sentinel_master: Some(set.master_name().to_string()),
        ..Default::default()
    })
    .await;
    let base = server.base_url();
    let (status, body) = submit(&base, "s-1").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(final_status(&base, "s-1").await["status"], "SUCCEEDED");
    stream_round_trip(&base, "sentinel/one").await;

    let old = set.master_port();
    set.node_by_port(old).kill();
    let killed = Instant::now();
    // Submits fail while there is no master, then succeed again without restarting baton.
    let mut n = 0;
    let recovered = loop {
        n += 1;
        let (status, _) = submit(&base, &format!("s-after-{n}")).await;
        if status == StatusCode::ACCEPTED {
            break killed.elapsed();
        }
        assert!(killed.elapsed() < Duration::from_secs(20), "no recovery 20 s after the master was killed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let new = set.wait_for_failover(old, Duration::from_secs(5));
    assert_ne!(new, old);
    eprintln!("sentinel failover: submits accepted again {recovered:?} after SIGKILL of the master");
    assert_eq!(final_status(&base, &format!("s-after-{n}")).await["status"], "SUCCEEDED");
    stream_round_trip(&base, "sentinel/two").await;
    server.shutdown().await;
}
