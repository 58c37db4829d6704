//! Breaker tests for completion webhooks with real processes (`baton serve`, `baton worker`,
//! redis-server standalone and Cluster, a local HTTP receiver): a SIGSTOPped `baton worker`
//! holding a delivery (taken over after the claim timeout; when it wakes it sends nothing more),
//! deliveries taken by a stopped worker's open read, a lost-lease worker's refused settle, a slow
//! receiver past the claim timeout, a Redis restart under load, a signing key rotated while
//! `baton worker` processes deliver (verified exactly as docs/http-api.md tells a receiver, with
//! its Python snippet), the key set lost with Redis's data, `baton worker --queues` and a
//! handler-less queue's webhook, non-ASCII command ids, and webhook durations at their limits.

use crate::common;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode as AxumStatus};
use baton_testkit::{eventually, free_port};
use common::client;
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::mpsc;

#[derive(Debug)]
struct Post {
    headers: HeaderMap,
    body: Bytes,
}

impl Post {
    fn header(&self, name: &str) -> &str {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default()
    }
}

type Answer = fn(usize) -> Option<u16>;

async fn receiver(answer: Answer) -> (String, mpsc::UnboundedReceiver<Post>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let seen = Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: HeaderMap, body: Bytes| {
            let tx = tx.clone();
            let seen = seen.clone();
            async move {
                let n = seen.fetch_add(1, Ordering::SeqCst);
                let _ = tx.send(Post { headers, body });
                match answer(n) {
                    Some(s) => AxumStatus::from_u16(s).unwrap(),
                    None => std::future::pending().await,
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/hook"), rx)
}

async fn next_post(rx: &mut mpsc::UnboundedReceiver<Post>, within: Duration) -> Option<Post> {
    tokio::time::timeout(within, rx.recv()).await.ok().flatten()
}

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn spawn(args: &[&str], port: u16) -> Child {
    let child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(args)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env_remove("BATON_REDIS")
        .env_remove("BATON_REDIS_CLUSTER")
        .env_remove("BATON_ADMIN_TOKEN")
        .env_remove("BATON_CONFIG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let child = Child(child);
    let up = eventually(Duration::from_secs(20), || async {
        let r = client().get(format!("http://127.0.0.1:{port}/healthz")).send().await.ok()?;
        (r.status() == StatusCode::OK).then_some(())
    })
    .await;
    assert!(up.is_some(), "baton {args:?} did not start");
    child
}

async fn submit(base: &str, queue: &str, body: Value) {
    let r = client()
        .post(format!("{base}/v1/queues/{queue}/commands"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED, "{}", r.text().await.unwrap());
}

async fn get_json(url: String) -> Value {
    let r = client().get(url).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    serde_json::from_str(&r.text().await.unwrap()).unwrap()
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill").args([sig, &child.0.id().to_string()]).status().unwrap().success();
    assert!(ok, "kill {sig}");
}

fn write_config(tag: &str, text: &str) -> (std::path::PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("baton-break-hooks-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("baton.toml");
    std::fs::write(&file, text).unwrap();
    let f = file.to_str().unwrap().to_string();
    (dir, f)
}

/// The holder of a delivery in flight (its receiver never answers the first attempt) is
/// SIGSTOPped: another worker sends the same delivery after the claim timeout (attempt 2,
/// answered 200). The stopped one is then woken (SIGCONT): its attempt times out on a lease it
/// no longer holds, and nothing is sent again, nor dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigstopped_worker_s_delivery_is_taken_over_and_its_wake_sends_nothing_more() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    let (url, mut rx) = receiver(|n| if n == 0 { None } else { Some(200) }).await;
    let (dir, cfg) = write_config(
        "stop",
        &format!(
            "redis = \"{}\"\nallow_loopback_webhooks = true\n[queues.jobs.handlers]\necho = \"echo\"\n\
             [queues.jobs.webhook]\nurl = \"{url}\"\ntimeout = \"2s\"\nclaim_timeout = \"1s\"\nmax_deliveries = 3\n",
            redis.url()
        ),
    );
    let serve_port = free_port();
    let _serve = spawn(&["serve", "--no-workers", "--config", &cfg], serve_port).await;
    let base = format!("http://127.0.0.1:{serve_port}");
    let a = spawn(&["worker", "--config", &cfg], free_port()).await;
    submit(&base, "jobs", json!({"id": "s-1", "type": "echo", "params": 1})).await;
    let first = next_post(&mut rx, Duration::from_secs(15)).await.expect("the first attempt");
    assert_eq!(first.header("webhook-attempt"), "1");
    signal(&a, "-STOP");
    let _b = spawn(&["worker", "--config", &cfg], free_port()).await;
    let second = next_post(&mut rx, Duration::from_secs(8)).await.expect("taken over from the stopped holder");
    assert_eq!(second.header("webhook-attempt"), "2");
    assert_eq!(second.header("webhook-id"), first.header("webhook-id"));
    assert_eq!(second.body, first.body);
    signal(&a, "-CONT");
    // The woken holder's attempt times out (2 s) on a lease it lost: no third attempt.
    assert!(next_post(&mut rx, Duration::from_secs(5)).await.is_none(), "sent again after the holder woke");
    let dead = get_json(format!("{base}/v1/queues/jobs/dead-letters?of=webhook")).await;
    assert_eq!(dead["items"], json!([]));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The docs' Python snippet (docs/http-api.md, "Verifying a delivery"), run as written.
fn python_verify(post: &Post, jwks: &Value) -> bool {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/http-api.md")).unwrap();
    let start = doc.find("```python\nimport base64, time").expect("the snippet");
    let code = &doc[start + "```python\n".len()..];
    let code = &code[..code.find("```").unwrap()];
    let dir = tempfile_dir();
    let body = dir.join("body");
    std::fs::write(&body, &post.body).unwrap();
    let script = format!(
        "{code}\nimport json, sys\nh = {{'webhook-signature': sys.argv[1]}}\nb = open(sys.argv[2], 'rb').read()\n\
         j = json.loads(sys.argv[3])\ntry:\n    print('ok' if verify(h, b, j) else 'refused')\nexcept Exception as e:\n    print('error', repr(e))\n"
    );
    let out = Command::new("python3")
        .args(["-c", &script, post.header("webhook-signature"), body.to_str().unwrap(), &jwks.to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "python: {}", String::from_utf8_lossy(&out.stderr));
    text == "ok"
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "baton-break-hooks-py-{}",
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A key rotation on `baton serve` while a `baton worker` delivers: the worker's next
/// deliveries carry the new key's kid, and every delivery (before and after) verifies with the
/// JWKS, using the docs' own Python snippet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_signs_with_the_rotated_key_and_the_docs_snippet_verifies_it() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    let (url, mut rx) = receiver(|_| Some(200)).await;
    let (dir, cfg) = write_config(
        "rotate",
        &format!(
            "redis = \"{}\"\nallow_loopback_webhooks = true\n[queues.jobs.handlers]\necho = \"echo\"\n\
             [queues.jobs.webhook]\nurl = \"{url}\"\nclaim_timeout = \"1s\"\n",
            redis.url()
        ),
    );
    let serve_port = free_port();
    let _serve = spawn(&["serve", "--no-workers", "--config", &cfg], serve_port).await;
    let base = format!("http://127.0.0.1:{serve_port}");
    let _w = spawn(&["worker", "--config", &cfg], free_port()).await;
    submit(&base, "jobs", json!({"id": "r-1", "type": "echo", "params": 1})).await;
    let p1 = next_post(&mut rx, Duration::from_secs(15)).await.expect("a delivery");
    let jwks = get_json(format!("{base}/v1/stream/__ds/jwks.json")).await;
    let kid1 = jwks["keys"][0]["kid"].as_str().unwrap().to_string();
    assert!(p1.header("webhook-signature").contains(&format!(",kid={kid1},")), "{}", p1.header("webhook-signature"));
    assert!(python_verify(&p1, &jwks), "the docs' snippet verifies the delivery");
    let mut tampered = Post { headers: p1.headers.clone(), body: p1.body.clone() };
    tampered.body = Bytes::from([&p1.body[..], b" "].concat());
    assert!(!python_verify(&tampered, &jwks), "the docs' snippet refuses a changed body");

    let r = client().post(format!("{base}/v1/subscriptions/signing-keys/rotate")).send().await.unwrap();
    assert!(r.status().is_success(), "rotate: {}", r.status());
    let jwks2 = get_json(format!("{base}/v1/stream/__ds/jwks.json")).await;
    let kid2 = jwks2["keys"][0]["kid"].as_str().unwrap().to_string();
    assert_ne!(kid1, kid2);
    // The worker reloads the key ring within its registry poll (200 ms).
    tokio::time::sleep(Duration::from_secs(2)).await;
    submit(&base, "jobs", json!({"id": "r-2", "type": "echo", "params": 2})).await;
    let p2 = next_post(&mut rx, Duration::from_secs(15)).await.expect("a delivery after rotation");
    assert!(
        p2.header("webhook-signature").contains(&format!(",kid={kid2},")),
        "signed with the new key: {}",
        p2.header("webhook-signature")
    );
    assert!(python_verify(&p2, &jwks2));
    assert!(python_verify(&p1, &jwks2), "the old key stays published");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A long `claim_timeout` (over 30 minutes) and a long `timeout` (over 15 minutes) are
/// documented as accepted: `baton serve` starts with them and delivers. Values past the limit
/// (24 h) are refused at startup naming the key, also by `baton serve --no-workers`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_webhook_durations_start_and_deliver_and_past_the_limit_are_refused_by_key() {
    let (url, mut rx) = receiver(|_| Some(200)).await;
    let (dir, cfg) = write_config(
        "long",
        &format!(
            "allow_loopback_webhooks = true\n[queues.jobs.handlers]\necho = \"echo\"\n[queues.jobs.webhook]\n\
             url = \"{url}\"\ntimeout = \"20m\"\nclaim_timeout = \"45m\"\n"
        ),
    );
    let port = free_port();
    let _serve = spawn(&["serve", "--config", &cfg], port).await;
    submit(&format!("http://127.0.0.1:{port}"), "jobs", json!({"id": "l-1", "type": "echo", "params": 1})).await;
    let p = next_post(&mut rx, Duration::from_secs(15)).await.expect("delivered");
    assert_eq!(p.header("webhook-attempt"), "1");

    for (line, err) in [
        ("claim_timeout = \"25h\"", "queues.jobs.webhook.claim_timeout: 1day 1h is over the most, 1day (default 30s)"),
        (
            "timeout = \"500000000000y\"",
            "queues.jobs.webhook.timeout: 500000000000years is over the most, 1day (default 10s)",
        ),
    ] {
        for no_workers in [false, true] {
            let (d, c) = write_config(
                "limit",
                &format!(
                    "allow_loopback_webhooks = true\n[queues.jobs.handlers]\necho = \"echo\"\n[queues.jobs.webhook]\n\
                     url = \"{url}\"\n{line}\n"
                ),
            );
            let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--config", &c];
            if no_workers {
                args.push("--no-workers");
            }
            let out = Command::new(env!("CARGO_BIN_EXE_baton"))
                .args(&args)
                .env_remove("BATON_REDIS")
                .env_remove("BATON_CONFIG")
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{line}: started");
            assert!(stderr.contains(err), "{line} (no_workers {no_workers}): {stderr}");
            let _ = std::fs::remove_dir_all(&d);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Redis (append-only, every write fsynced) killed and restarted while `baton serve` runs
/// commands with a webhook: every command that ended has its delivery (at least once), with the
/// body of its final state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_under_load_loses_no_delivery() {
    baton_testkit::require_redis();
    let mut redis = baton_testkit::RedisServer::start_with(baton_testkit::ServerOptions { appendonly: true });
    let (url, mut rx) = receiver(|_| Some(200)).await;
    let (dir, cfg) = write_config(
        "restart",
        &format!(
            "redis = \"{}\"\nallow_loopback_webhooks = true\n[queues.jobs]\nclaim_timeout = \"1s\"\n\
             [queues.jobs.handlers]\necho = \"echo\"\n[queues.jobs.webhook]\nurl = \"{url}\"\nclaim_timeout = \"1s\"\n",
            redis.url()
        ),
    );
    let port = free_port();
    let _serve = spawn(&["serve", "--config", &cfg], port).await;
    let base = format!("http://127.0.0.1:{port}");
    let mut accepted = Vec::new();
    for i in 0..60 {
        if i == 20 {
            redis.kill();
        }
        if i == 30 {
            redis.restart();
        }
        let r = client()
            .post(format!("{base}/v1/queues/jobs/commands"))
            .header("content-type", "application/json")
            .body(json!({"id": format!("x-{i}"), "type": "echo", "params": i}).to_string())
            .send()
            .await
            .unwrap();
        if r.status() == StatusCode::ACCEPTED {
            accepted.push(format!("x-{i}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(accepted.len() >= 40, "accepted {}", accepted.len());
    let mut finals = std::collections::BTreeMap::new();
    for id in &accepted {
        let st = eventually(Duration::from_secs(30), || async {
            let v = get_json(format!("{base}/v1/commands/{id}")).await;
            (v["status"] == "SUCCEEDED").then_some(v)
        })
        .await
        .unwrap_or_else(|| panic!("{id} did not end"));
        finals.insert(id.clone(), format!("{id}:{}", st["version"]));
    }
    let mut got = std::collections::BTreeMap::<String, usize>::new();
    while let Some(p) = next_post(&mut rx, Duration::from_secs(5)).await {
        *got.entry(p.header("webhook-id").to_string()).or_default() += 1;
    }
    let missing: Vec<&String> = finals.values().filter(|d| !got.contains_key(*d)).collect();
    assert!(missing.is_empty(), "deliveries missing: {missing:?}; got {got:?}");
    let dups: Vec<(&String, &usize)> = got.iter().filter(|(_, n)| **n > 1).collect();
    eprintln!("deliveries: {} of {} commands; duplicates: {dups:?}", got.len(), finals.len());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `baton worker` running a command is SIGSTOPped past the queue's claim timeout: another
/// worker takes the command over and ends it (one delivery). The stopped worker is woken; its
/// handler's outcome is refused (its lease is gone), so it enqueues no second delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_worker_s_refused_settle_enqueues_no_delivery() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    let (url, mut rx) = receiver(|_| Some(200)).await;
    let (dir, cfg) = write_config(
        "lease",
        &format!(
            "redis = \"{}\"\nallow_loopback_webhooks = true\n[queues.jobs]\nclaim_timeout = \"1s\"\n\
             [queues.jobs.handlers]\nsleep = \"sleep\"\n[queues.jobs.webhook]\nurl = \"{url}\"\nclaim_timeout = \"1s\"\n",
            redis.url()
        ),
    );
    let serve_port = free_port();
    let _serve = spawn(&["serve", "--no-workers", "--config", &cfg], serve_port).await;
    let base = format!("http://127.0.0.1:{serve_port}");
    let a = spawn(&["worker", "--config", &cfg], free_port()).await;
    submit(&base, "jobs", json!({"id": "z-1", "type": "sleep", "params": {"ms": 2500}})).await;
    // The only worker takes it at once (the started write may be batched with a later one).
    tokio::time::sleep(Duration::from_millis(700)).await;
    signal(&a, "-STOP");
    let v = get_json(format!("{base}/v1/commands/z-1")).await;
    assert!(!["SUCCEEDED", "FAILED", "CANCELLED"].contains(&v["status"].as_str().unwrap()), "stopped mid-run: {v}");
    let _b = spawn(&["worker", "--config", &cfg], free_port()).await;
    let done = eventually(Duration::from_secs(20), || async {
        let v = get_json(format!("{base}/v1/commands/z-1")).await;
        (v["status"] == "SUCCEEDED").then_some(v)
    })
    .await
    .expect("ended by b");
    let p = next_post(&mut rx, Duration::from_secs(10)).await.expect("the delivery");
    assert_eq!(p.header("webhook-id"), format!("z-1:{}", done["version"]));
    signal(&a, "-CONT");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = get_json(format!("{base}/v1/commands/z-1")).await;
    assert_eq!(after["version"], done["version"], "the woken worker's outcome was refused");
    if let Some(p2) = next_post(&mut rx, Duration::from_secs(2)).await {
        panic!(
            "a second delivery: id {} attempt {} body {} (the first: attempt {} body {})",
            p2.header("webhook-id"),
            p2.header("webhook-attempt"),
            String::from_utf8_lossy(&p2.body),
            p.header("webhook-attempt"),
            String::from_utf8_lossy(&p.body)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Deliveries enqueued right after an idle `baton worker` is SIGSTOPped (its blocking read of
/// the delivery queue may still be open in Redis and take them): each is delivered by the other
/// worker after the claim timeout, at least once. When the stopped worker wakes it may send what
/// its read took (at least once: a duplicate with the same `webhook-id`), never a different body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_taken_by_a_stopped_worker_s_open_read_are_delivered_at_least_once() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    let (url, mut rx) = receiver(|_| Some(200)).await;
    let (dir, cfg) = write_config(
        "openread",
        &format!(
            "redis = \"{}\"\nallow_loopback_webhooks = true\n[queues.jobs.handlers]\necho = \"echo\"\n\
             [queues.remote]\nretention = \"1h\"\n[queues.remote.webhook]\nurl = \"{url}\"\nclaim_timeout = \"3s\"\n",
            redis.url()
        ),
    );
    let serve_port = free_port();
    let _serve = spawn(&["serve", "--no-workers", "--config", &cfg], serve_port).await;
    let base = format!("http://127.0.0.1:{serve_port}");
    let a = spawn(&["worker", "--config", &cfg], free_port()).await;
    let _b = spawn(&["worker", "--config", &cfg], free_port()).await;
    for i in 0..10 {
        submit(&base, "remote", json!({"id": format!("o-{i}"), "type": "nobody-runs-this", "params": i})).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    signal(&a, "-STOP");
    for i in 0..10 {
        let r = client().post(format!("{base}/v1/commands/o-{i}/cancel")).send().await.unwrap();
        assert!(r.status().is_success());
    }
    let mut got = std::collections::BTreeMap::<String, Vec<String>>::new();
    while let Some(p) = next_post(&mut rx, Duration::from_secs(8)).await {
        got.entry(p.header("webhook-id").to_string()).or_default().push(p.header("webhook-attempt").to_string());
    }
    assert_eq!(got.len(), 10, "every cancel delivered while a is stopped: {got:?}");
    signal(&a, "-CONT");
    while let Some(p) = next_post(&mut rx, Duration::from_secs(4)).await {
        got.entry(p.header("webhook-id").to_string())
            .or_default()
            .push(format!("after wake: {}", p.header("webhook-attempt")));
    }
    eprintln!("attempts per delivery: {got:?}");
    assert_eq!(got.len(), 10);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A receiver that answers 200 only after 3 s (three claim timeouts), with two `baton worker`
/// processes: the holder keeps its lease while it waits, so the delivery is POSTed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_receiver_past_the_claim_timeout_gets_one_post() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    let (tx, mut rx) = mpsc::unbounded_channel::<Post>();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: HeaderMap, body: Bytes| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(Post { headers, body });
                tokio::time::sleep(Duration::from_secs(3)).await;
                AxumStatus::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let (dir, cfg) = write_config(
        "slow",
        &format!(
            "redis = \"{}\"\nallow_loopback_webhooks = true\n[queues.jobs.handlers]\necho = \"echo\"\n\
             [queues.jobs.webhook]\nurl = \"{url}\"\ntimeout = \"10s\"\nclaim_timeout = \"1s\"\n",
            redis.url()
        ),
    );
    let serve_port = free_port();
    let _serve = spawn(&["serve", "--config", &cfg], serve_port).await;
    let base = format!("http://127.0.0.1:{serve_port}");
    let _a = spawn(&["worker", "--config", &cfg], free_port()).await;
    let _b = spawn(&["worker", "--config", &cfg], free_port()).await;
    for i in 0..5 {
        submit(&base, "jobs", json!({"id": format!("w-{i}"), "type": "echo", "params": i})).await;
    }
    let mut got = std::collections::BTreeMap::<String, usize>::new();
    while let Some(p) = next_post(&mut rx, Duration::from_secs(6)).await {
        *got.entry(p.header("webhook-id").to_string()).or_default() += 1;
    }
    assert_eq!(got.len(), 5, "{got:?}");
    assert!(got.values().all(|n| *n == 1), "a delivery POSTed twice while its holder lived: {got:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `baton serve --no-workers` and a `baton worker --queues jobs`: a queue `remote` with a
/// webhook and no handlers (its commands run by HTTP workers, or ended by cancels) has its
/// deliveries sent by the worker (every configured queue's webhook is delivered by every
/// process running workers, as the docs say), not left waiting forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_queues_delivers_a_handler_less_queue_s_webhook() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    let (url, mut rx) = receiver(|_| Some(200)).await;
    let (dir, cfg) = write_config(
        "only",
        &format!(
            "redis = \"{}\"\nallow_loopback_webhooks = true\n[queues.jobs.handlers]\necho = \"echo\"\n\
             [queues.remote]\nretention = \"1h\"\n[queues.remote.webhook]\nurl = \"{url}\"\nclaim_timeout = \"1s\"\n",
            redis.url()
        ),
    );
    let serve_port = free_port();
    let _serve = spawn(&["serve", "--no-workers", "--config", &cfg], serve_port).await;
    let base = format!("http://127.0.0.1:{serve_port}");
    let _w = spawn(&["worker", "--queues", "jobs", "--config", &cfg], free_port()).await;
    submit(&base, "remote", json!({"id": "rq-1", "type": "remote-job", "params": 1})).await;
    let r = client().post(format!("{base}/v1/commands/rq-1/cancel")).send().await.unwrap();
    assert!(r.status().is_success());
    let st = get_json(format!("{base}/v1/commands/rq-1")).await;
    let p = next_post(&mut rx, Duration::from_secs(10)).await.expect("the handler-less queue's delivery");
    assert_eq!(p.header("webhook-id"), format!("rq-1:{}", st["version"]));
    let _ = std::fs::remove_dir_all(&dir);
}

/// On Redis Cluster, `baton serve --no-workers` and two `baton worker` processes: a command's
/// end is delivered once, signed with a key of the server's JWKS (the worker loads the key set
/// from the Cluster), and a re-run's end is delivered too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_processes_deliver_once_signed_with_the_published_key() {
    baton_testkit::require_redis();
    let cluster = baton_testkit::RedisCluster::start();
    let (url, mut rx) = receiver(|_| Some(200)).await;
    let (dir, cfg) = write_config(
        "cluster",
        &format!(
            "redis_cluster = \"{}\"\nallow_loopback_webhooks = true\n[queues.jobs.handlers]\necho = \"echo\"\nfail = \"fail\"\n\
             [queues.jobs.webhook]\nurl = \"{url}\"\nclaim_timeout = \"1s\"\n",
            cluster.urls().join(",")
        ),
    );
    let serve_port = free_port();
    let _serve = spawn(&["serve", "--no-workers", "--config", &cfg], serve_port).await;
    let base = format!("http://127.0.0.1:{serve_port}");
    let _a = spawn(&["worker", "--config", &cfg], free_port()).await;
    let _b = spawn(&["worker", "--config", &cfg], free_port()).await;
    submit(&base, "jobs", json!({"id": "c-1", "type": "fail", "params": {"error": "x"}})).await;
    let p = next_post(&mut rx, Duration::from_secs(15)).await.expect("the failure's delivery");
    let jwks = get_json(format!("{base}/v1/stream/__ds/jwks.json")).await;
    assert!(python_verify(&p, &jwks));
    let st = get_json(format!("{base}/v1/commands/c-1")).await;
    assert_eq!(p.header("webhook-id"), format!("c-1:{}", st["version"]));
    let r = client().post(format!("{base}/v1/commands/c-1/retry")).send().await.unwrap();
    assert!(r.status().is_success());
    let p2 = next_post(&mut rx, Duration::from_secs(15)).await.expect("the re-run's delivery");
    assert_ne!(p2.header("webhook-id"), p.header("webhook-id"));
    assert!(python_verify(&p2, &jwks));
    assert!(next_post(&mut rx, Duration::from_secs(3)).await.is_none(), "a duplicate");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Redis without persistence restarts (its data, the signing keys among them, lost) while a
/// `baton worker` keeps running; `baton serve` is then restarted and creates a new key. The
/// worker's next delivery must verify with the JWKS the (new) server publishes: the worker
/// follows the key set in Redis instead of signing forever with a key nobody publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_lost_its_keys_a_worker_signs_with_the_key_the_server_publishes() {
    baton_testkit::require_redis();
    let mut redis = baton_testkit::RedisServer::start();
    let (url, mut rx) = receiver(|_| Some(200)).await;
    let (dir, cfg) = write_config(
        "lostkeys",
        &format!(
            "redis = \"{}\"\nallow_loopback_webhooks = true\n[queues.jobs.handlers]\necho = \"echo\"\n\
             [queues.jobs.webhook]\nurl = \"{url}\"\nclaim_timeout = \"1s\"\n",
            redis.url()
        ),
    );
    let serve_port = free_port();
    let serve = spawn(&["serve", "--no-workers", "--config", &cfg], serve_port).await;
    let base = format!("http://127.0.0.1:{serve_port}");
    let _w = spawn(&["worker", "--config", &cfg], free_port()).await;
    submit(&base, "jobs", json!({"id": "k-1", "type": "echo", "params": 1})).await;
    let p1 = next_post(&mut rx, Duration::from_secs(15)).await.expect("a delivery");
    assert!(python_verify(&p1, &get_json(format!("{base}/v1/stream/__ds/jwks.json")).await));
    redis.restart();
    drop(serve);
    let serve_port = free_port();
    let _serve = spawn(&["serve", "--no-workers", "--config", &cfg], serve_port).await;
    let base = format!("http://127.0.0.1:{serve_port}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ok = eventually(Duration::from_secs(15), || async {
        let r = client()
            .post(format!("{base}/v1/queues/jobs/commands"))
            .header("content-type", "application/json")
            .body(json!({"id": "k-2", "type": "echo", "params": 2}).to_string())
            .send()
            .await
            .ok()?;
        (r.status() == StatusCode::ACCEPTED).then_some(())
    })
    .await;
    assert!(ok.is_some(), "submit after the restart");
    let p2 = next_post(&mut rx, Duration::from_secs(20)).await.expect("a delivery after the restart");
    let jwks = get_json(format!("{base}/v1/stream/__ds/jwks.json")).await;
    assert!(python_verify(&p2, &jwks), "signed {} ; the server publishes {jwks}", p2.header("webhook-signature"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A command id is any text without braces, whitespace or control characters, so it may be
/// non-ASCII (`déploiement-1`, `任务-7`): its delivery is sent at once like any other (the
/// `webhook-id` header carries the id's UTF-8 bytes, exactly the body's `delivery_id`), not
/// retried until it is a dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_ascii_command_id_is_delivered() {
    let (url, mut rx) = receiver(|_| Some(200)).await;
    let (dir, cfg) = write_config(
        "utf8",
        &format!(
            "allow_loopback_webhooks = true\n[queues.jobs.handlers]\necho = \"echo\"\n[queues.jobs.webhook]\n\
             url = \"{url}\"\nclaim_timeout = \"1s\"\nmax_deliveries = 2\n"
        ),
    );
    let port = free_port();
    let _serve = spawn(&["serve", "--config", &cfg], port).await;
    let base = format!("http://127.0.0.1:{port}");
    for id in ["déploiement-1", "任务-7"] {
        submit(&base, "jobs", json!({"id": id, "type": "echo", "params": 1})).await;
        let p = next_post(&mut rx, Duration::from_secs(10)).await.unwrap_or_else(|| panic!("{id}: no delivery"));
        let body: Value = serde_json::from_slice(&p.body).unwrap();
        assert_eq!(body["id"], id);
        assert_eq!(p.headers.get("webhook-id").unwrap().as_bytes(), body["delivery_id"].as_str().unwrap().as_bytes());
        assert_eq!(p.header("webhook-attempt"), "1", "{id}: delivered at the first attempt");
    }
    let dead = get_json(format!("{base}/v1/queues/jobs/dead-letters?of=webhook")).await;
    assert_eq!(dead["items"], json!([]));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `410 Gone` makes the delivery a dead letter at once (one POST), with the reason the docs give;
/// a `3xx` is not followed and is retried like any failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_is_a_dead_letter_at_once_and_a_redirect_is_not_followed() {
    let (gone_url, mut gone_rx) = receiver(|_| Some(410)).await;
    let (moved_url, mut moved_rx) = receiver(|_| Some(308)).await;
    let (dir, cfg) = write_config(
        "gone",
        &format!(
            "allow_loopback_webhooks = true\n[queues.a.handlers]\necho = \"echo\"\n[queues.a.webhook]\n\
             url = \"{gone_url}\"\nclaim_timeout = \"300ms\"\nmax_deliveries = 5\n\
             [queues.b.handlers]\necho = \"echo\"\n[queues.b.webhook]\nurl = \"{moved_url}\"\nclaim_timeout = \"300ms\"\nmax_deliveries = 2\n"
        ),
    );
    let port = free_port();
    let _serve = spawn(&["serve", "--config", &cfg], port).await;
    let base = format!("http://127.0.0.1:{port}");
    submit(&base, "a", json!({"id": "g-1", "type": "echo", "params": 1})).await;
    submit(&base, "b", json!({"id": "m-1", "type": "echo", "params": 1})).await;
    assert!(next_post(&mut gone_rx, Duration::from_secs(10)).await.is_some());
    assert!(next_post(&mut gone_rx, Duration::from_secs(2)).await.is_none(), "410 retried");
    let dead = get_json(format!("{base}/v1/queues/a/dead-letters?of=webhook")).await;
    assert_eq!(dead["items"][0]["reason"], "the webhook answered 410 Gone", "{dead}");
    for attempt in ["1", "2"] {
        let p = next_post(&mut moved_rx, Duration::from_secs(10)).await.expect("an attempt");
        assert_eq!(p.header("webhook-attempt"), attempt);
    }
    assert!(next_post(&mut moved_rx, Duration::from_secs(2)).await.is_none());
    let dead = get_json(format!("{base}/v1/queues/b/dead-letters?of=webhook")).await;
    assert_eq!(dead["items"][0]["reason"], "the webhook answered 308 Permanent Redirect (attempt 2 of 2)", "{dead}");
    let _ = std::fs::remove_dir_all(&dir);
}
