//! Completion webhooks (`[queues.<name>.webhook]`) on memory, Redis standalone and Cluster: one
//! signed delivery per terminal transition with the exact body (a re-run's second end its own),
//! none for a queue without a webhook; a receiver failing twice gets three attempts and one
//! success; one always failing ends in exactly one dead letter after `max_deliveries`
//! (reachable and replayable with `?of=webhook`); a delivery whose consumer dies mid-attempt is
//! taken over by another after the claim timeout, and never duplicated while its holder lives;
//! and `baton serve` with the webhook set in its TOML file.

use crate::common;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode as AxumStatus};
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use baton::settings::{QueueConfig, WebhookConfig};
use baton_commands::{Command as Cmd, CommandState, CommandStore, CompletionHook, RawJson};
use baton_testkit::{eventually, free_port, TestBackend};
use common::client;
use ed25519_dalek::{Signature, Verifier, VerifyingKey};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// One POST as the receiver got it.
#[derive(Debug)]
struct Post {
    headers: HeaderMap,
    body: Bytes,
}

impl Post {
    fn header(&self, name: &str) -> &str {
        self.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default()
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// What the receiver answers to its `n`th POST (from 0): a status, or never (held).
type Answer = fn(usize) -> Option<u16>;

/// A webhook receiver on 127.0.0.1: every POST goes to the channel and is answered by `answer`.
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

/// Verifies `webhook-signature: t=…,kid=…,ed25519=…` of `post` against the JWKS.
fn verify(post: &Post, jwks: &Value) {
    let h = post.header("webhook-signature");
    let (t, rest) = h.strip_prefix("t=").expect("signed").split_once(",kid=").unwrap();
    let (kid, sig) = rest.split_once(",ed25519=").unwrap();
    let key = jwks["keys"].as_array().unwrap().iter().find(|k| k["kid"] == kid).expect("kid in the JWKS");
    let x: [u8; 32] = B64.decode(key["x"].as_str().unwrap()).unwrap().try_into().unwrap();
    let vk = VerifyingKey::from_bytes(&x).unwrap();
    let sig = Signature::from_bytes(&B64.decode(sig).unwrap().try_into().unwrap());
    let mut msg = format!("{t}.").into_bytes();
    msg.extend_from_slice(&post.body);
    vk.verify(&msg, &sig).expect("the signature verifies");
    let mut tampered = msg.clone();
    tampered.push(b' ');
    assert!(vk.verify(&tampered, &sig).is_err());
}

/// The exact body of the delivery of terminal state `st`.
fn expected_body(st: &CommandState) -> String {
    let event = st.status.as_str().to_ascii_lowercase();
    let t = |v: &Option<baton_commands::Timestamp>| serde_json::to_string(v).unwrap();
    format!(
        r#"{{"delivery_id":"{id}:{v}","event":"{event}","id":"{id}","queue":"{q}","type":"{ty}","status":"{s}","result":{r},"error":{e},"attempts":{a},"version":{v},"created_at":{c},"started_at":{st_},"completed_at":{d}}}"#,
        id = st.id,
        v = st.version,
        q = st.queue,
        ty = st.command_type,
        s = st.status.as_str(),
        r = st.result.as_ref().map_or("null".to_string(), |r| r.get().to_string()),
        e = serde_json::to_string(&st.error).unwrap(),
        a = st.attempts,
        c = t(&Some(st.created_at)),
        st_ = t(&st.started_at),
        d = t(&st.completed_at),
    )
}

fn webhook(url: &str, max_deliveries: u32, claim_timeout: Duration) -> WebhookConfig {
    WebhookConfig {
        url: url.to_string(),
        statuses: CompletionHook::default().statuses,
        timeout: Duration::from_secs(5),
        max_deliveries,
        claim_timeout,
    }
}

fn hooked_queue(name: &str, hook: WebhookConfig) -> QueueConfig {
    let mut q = QueueConfig::with_builtins(name, &["echo", "fail", "sleep"]);
    q.webhook = Some(hook);
    q
}

async fn submit(base: &str, queue: &str, body: Value) {
    submit_raw(base, queue, body.to_string()).await
}

async fn submit_raw(base: &str, queue: &str, body: String) {
    let r = client()
        .post(format!("{base}/v1/queues/{queue}/commands"))
        .header("content-type", "application/json")
        .body(body)
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

/// Waits for `id` to be terminal (at a version above `after`) and returns its state.
async fn terminal(store: &CommandStore, id: &str, after: u64) -> CommandState {
    eventually(Duration::from_secs(15), || async {
        store.get(id).await.unwrap().filter(|s| s.status.is_terminal() && s.version > after)
    })
    .await
    .unwrap_or_else(|| panic!("{id} did not end"))
}

const BACKENDS: [&str; 3] = ["memory", "standalone", "cluster"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_signed_delivery_per_terminal_transition_and_none_without_a_webhook() {
    for name in BACKENDS {
        let (url, mut rx) = receiver(|_| Some(200)).await;
        let ts = common::start(common::backend(name), |cfg| {
            cfg.allow_loopback_webhooks = true;
            cfg.queues = vec![
                hooked_queue("hooked", webhook(&url, 3, Duration::from_millis(500))),
                QueueConfig::with_builtins("plain", &["echo"]),
                {
                    // No handlers here (HTTP workers would run its commands): still delivered here.
                    let mut q = QueueConfig::with_builtins("elsewhere", &[]);
                    q.webhook = Some(webhook(&url, 3, Duration::from_millis(500)));
                    q
                },
            ];
        })
        .await;
        let store = ts.server.as_ref().unwrap().command_store().clone();
        let jwks = get_json(format!("{}/v1/stream/__ds/jwks.json", ts.base)).await;

        // Succeeded.
        submit_raw(&ts.base, "hooked", r#"{"id": "ok-1", "type": "echo", "params": {"a": [1, 2.50]}}"#.into()).await;
        let st = terminal(&store, "ok-1", 0).await;
        let p = next_post(&mut rx, Duration::from_secs(10)).await.expect("a delivery");
        assert_eq!(std::str::from_utf8(&p.body).unwrap(), expected_body(&st), "{name}");
        assert!(expected_body(&st).contains(r#""result":{"a": [1, 2.50]}"#), "{name}: the result's exact text");
        assert_eq!(p.header("webhook-id"), format!("ok-1:{}", st.version), "{name}");
        assert_eq!(p.header("webhook-attempt"), "1", "{name}");
        assert_eq!(p.header("content-type"), "application/json", "{name}");
        verify(&p, &jwks);

        // A queue without a webhook: nothing enqueued, nothing delivered.
        submit(&ts.base, "plain", json!({"id": "plain-1", "type": "echo", "params": 1})).await;
        terminal(&store, "plain-1", 0).await;

        // Failed, then re-run: its second end gets its own delivery.
        submit(&ts.base, "hooked", json!({"id": "f-1", "type": "fail", "params": {"error": "boom"}})).await;
        let f1 = terminal(&store, "f-1", 0).await;
        let p = next_post(&mut rx, Duration::from_secs(10)).await.expect("the failure's delivery");
        assert_eq!(std::str::from_utf8(&p.body).unwrap(), expected_body(&f1), "{name}");
        assert_eq!(p.json()["event"], "failed");
        assert_eq!(p.json()["error"], "boom");
        verify(&p, &jwks);
        let r = client().post(format!("{}/v1/commands/f-1/retry", ts.base)).send().await.unwrap();
        assert!(r.status().is_success(), "{name}: retry {}", r.status());
        let f2 = terminal(&store, "f-1", f1.version).await;
        let p = next_post(&mut rx, Duration::from_secs(10)).await.expect("the re-run's delivery");
        assert_eq!(std::str::from_utf8(&p.body).unwrap(), expected_body(&f2), "{name}");
        assert_eq!(p.header("webhook-id"), format!("f-1:{}", f2.version), "{name}");
        assert_ne!(f1.version, f2.version);

        // Cancelled.
        submit(&ts.base, "hooked", json!({"id": "s-1", "type": "sleep", "params": {"ms": 60000}})).await;
        let r = client().post(format!("{}/v1/commands/s-1/cancel", ts.base)).send().await.unwrap();
        assert!(r.status().is_success(), "{name}: cancel {}", r.status());
        let s1 = terminal(&store, "s-1", 0).await;
        let p = next_post(&mut rx, Duration::from_secs(10)).await.expect("the cancel's delivery");
        assert_eq!(std::str::from_utf8(&p.body).unwrap(), expected_body(&s1), "{name}");
        assert_eq!(p.json()["event"], "cancelled");
        assert_eq!(p.json()["started_at"], Value::Null);

        // A queue whose workers run elsewhere: its command cancelled here is delivered here.
        submit(&ts.base, "elsewhere", json!({"id": "e-1", "type": "remote-job", "params": null})).await;
        let r = client().post(format!("{}/v1/commands/e-1/cancel", ts.base)).send().await.unwrap();
        assert!(r.status().is_success(), "{name}: cancel {}", r.status());
        let e1 = terminal(&store, "e-1", 0).await;
        let p = next_post(&mut rx, Duration::from_secs(10)).await.expect("the handler-less queue's delivery");
        assert_eq!(std::str::from_utf8(&p.body).unwrap(), expected_body(&e1), "{name}");

        // Exactly those five: no duplicate, nothing for `plain`.
        assert!(next_post(&mut rx, Duration::from_millis(1500)).await.is_none(), "{name}: an extra delivery");
        assert_eq!(store.hooks().await.unwrap().stats("plain").await.unwrap().length, 0, "{name}");
        let hooked = store.hooks().await.unwrap().stats("hooked").await.unwrap();
        assert_eq!((hooked.length, hooked.pending, hooked.dead_letters), (0, 0, 0), "{name}: all acked");
        if let Some(redis) = ts.backend.redis_config() {
            // The layout: `<prefix>:hook:q:{<queue>}` (acked entries are deleted; the group stays).
            let client = baton_redis::RedisClient::new(redis).unwrap();
            let mut conn = client.shared().await.unwrap();
            let t: String =
                baton_redis::redis::cmd("TYPE").arg("baton:hook:q:{hooked}").query_async(&mut conn).await.unwrap();
            assert_eq!(t, "stream", "{name}");
            let n: i64 =
                baton_redis::redis::cmd("EXISTS").arg("baton:hook:q:{plain}").query_async(&mut conn).await.unwrap();
            assert_eq!(n, 0, "{name}: a queue without a webhook has no delivery key");
        }
        ts.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_attempts_are_retried_then_dead_lettered_after_max_deliveries() {
    for name in BACKENDS {
        // 500 twice, then 200: three attempts, one success.
        let (ok_url, mut ok_rx) = receiver(|n| Some(if n < 2 { 500 } else { 200 })).await;
        // Always 500: three attempts, then one dead letter.
        let (bad_url, mut bad_rx) = receiver(|_| Some(500)).await;
        let claim = Duration::from_millis(400);
        let ts = common::start(common::backend(name), |cfg| {
            cfg.allow_loopback_webhooks = true;
            cfg.queues = vec![
                hooked_queue("flaky", webhook(&ok_url, 3, claim)),
                hooked_queue("down", webhook(&bad_url, 3, claim)),
            ];
        })
        .await;
        let store = ts.server.as_ref().unwrap().command_store().clone();
        submit(&ts.base, "flaky", json!({"id": "r-1", "type": "echo", "params": null})).await;
        submit(&ts.base, "down", json!({"id": "d-1", "type": "echo", "params": null})).await;
        let r1 = terminal(&store, "r-1", 0).await;
        let d1 = terminal(&store, "d-1", 0).await;

        for (rx, st, what) in [(&mut ok_rx, &r1, "flaky"), (&mut bad_rx, &d1, "down")] {
            for attempt in 1..=3 {
                let p = next_post(rx, Duration::from_secs(10))
                    .await
                    .unwrap_or_else(|| panic!("{name} {what}: attempt {attempt}"));
                assert_eq!(p.header("webhook-attempt"), attempt.to_string(), "{name} {what}");
                assert_eq!(p.header("webhook-id"), format!("{}:{}", st.id, st.version), "{name} {what}");
                assert_eq!(std::str::from_utf8(&p.body).unwrap(), expected_body(st), "{name} {what}");
            }
        }
        // No fourth attempt of either.
        assert!(next_post(&mut ok_rx, claim * 4).await.is_none(), "{name}: delivered, not retried again");
        assert!(next_post(&mut bad_rx, claim * 2).await.is_none(), "{name}: dead, not retried again");

        let dead = |q: &str, of: &str| format!("{}/v1/queues/{q}/dead-letters{of}", ts.base);
        assert_eq!(get_json(dead("flaky", "?of=webhook")).await["items"], json!([]), "{name}");
        let items = get_json(dead("down", "?of=webhook")).await["items"].as_array().unwrap().clone();
        assert_eq!(items.len(), 1, "{name}: exactly one dead letter: {items:?}");
        assert_eq!(items[0]["payload"], expected_body(&d1), "{name}");
        assert_eq!(items[0]["deliveries"], 3, "{name}");
        assert_eq!(items[0]["command_id"], "d-1", "{name}");
        assert_eq!(items[0]["reason"], "the webhook answered 500 Internal Server Error (attempt 3 of 3)", "{name}");
        assert_eq!(
            get_json(dead("down", "")).await["items"],
            json!([]),
            "{name}: the commands' dead letters are apart"
        );
        let r = client().get(dead("down", "?of=nope")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{name}");

        // The CLI lists it with --webhook (the commands' dead letters are none).
        let cli = |args: &'static [&'static str]| {
            let base = ts.base.clone();
            async move {
                let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_baton"))
                    .args(args)
                    .env("BATON_SERVER", &base)
                    .env_remove("BATON_TOKEN")
                    .output()
                    .await
                    .unwrap();
                assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
                String::from_utf8(out.stdout).unwrap()
            }
        };
        let listed: Value =
            serde_json::from_str(&cli(&["queues", "dead", "down", "--webhook", "--json"]).await).unwrap();
        assert_eq!(listed["items"][0]["id"], items[0]["id"], "{name}");
        assert_eq!(cli(&["queues", "dead", "down"]).await.trim(), "no dead letters in down", "{name}");
        // A replay delivers it again (the receiver still fails: a new first attempt).
        assert_eq!(
            cli(&["queues", "replay", "down", "--all", "--webhook"]).await.trim(),
            "replayed 1 dead letter onto down",
            "{name}"
        );
        let p = next_post(&mut bad_rx, Duration::from_secs(10)).await.expect("the replayed delivery");
        assert_eq!(p.header("webhook-id"), format!("d-1:{}", d1.version), "{name}");
        assert_eq!(std::str::from_utf8(&p.body).unwrap(), expected_body(&d1), "{name}");
        ts.stop().await;
    }
}

/// Two "processes" (two command stores on one backend; on memory one store, the backend being
/// the process): the first holds an attempt (its receiver never answers); while it lives nothing
/// is sent again; once it dies (its consumer aborted, as by SIGKILL) the second sends the same
/// delivery after the claim timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_consumer_s_delivery_fails_over_after_the_claim_timeout() {
    for name in BACKENDS {
        let backend = common::backend(name);
        let (url, mut rx) = receiver(|n| if n == 0 { None } else { Some(200) }).await;
        let claim = Duration::from_millis(800);
        let q = hooked_queue("fo", webhook(&url, 5, claim));
        let storage = match backend.redis_config() {
            None => baton::settings::Storage::Memory,
            Some(rc) => baton::settings::Storage::Redis(rc),
        };
        let store_a = baton::workers::command_store(&storage, std::slice::from_ref(&q)).await.unwrap();
        let store_b = match &backend {
            TestBackend::Memory => store_a.clone(),
            _ => baton::workers::command_store(&storage, std::slice::from_ref(&q)).await.unwrap(),
        };
        let signer = baton_subscriptions::Subscriptions::memory(
            baton_streams::StreamStore::memory(Default::default()),
            Default::default(),
        )
        .await
        .unwrap();
        let a = baton::webhooks::Deliveries::start(&store_a, &[&q], signer.clone(), true).await.unwrap();
        store_a.declare_queue("fo").unwrap();
        store_a.submit("fo", Cmd::with_id("c-1", "echo", RawJson::null())).await.unwrap();
        let st = store_a.cancel("c-1").await.unwrap();
        let first = next_post(&mut rx, Duration::from_secs(10)).await.expect("the first attempt");
        assert_eq!(first.header("webhook-attempt"), "1");
        let b = baton::webhooks::Deliveries::start(&store_b, &[&q], signer.clone(), true).await.unwrap();
        assert!(next_post(&mut rx, claim * 3).await.is_none(), "{name}: sent again while its holder lives");
        a.abort();
        let second = next_post(&mut rx, claim * 4).await.expect("taken over after the claim timeout");
        assert_eq!(second.header("webhook-attempt"), "2", "{name}");
        assert_eq!(second.header("webhook-id"), format!("c-1:{}", st.version), "{name}");
        assert_eq!(second.body, first.body, "{name}");
        assert!(next_post(&mut rx, claim * 2).await.is_none(), "{name}: acked once");
        b.drain(Duration::from_secs(2)).await;
    }
}

/// A child `baton` process (`serve` or `worker`) with a config file, up once its `/healthz`
/// answers; SIGKILLed when dropped.
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

/// `baton worker` processes on one Redis: the one whose attempt is in flight (its receiver never
/// answers) is SIGKILLed; another worker delivers the same delivery after the claim timeout,
/// signed with the key the server's JWKS publishes; while the first lived, nothing was sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_s_delivery_is_taken_over_by_another_worker() {
    baton_testkit::require_redis();
    let redis = baton_testkit::RedisServer::start();
    let (url, mut rx) = receiver(|n| if n == 0 { None } else { Some(200) }).await;
    let dir = std::env::temp_dir().join(format!("baton-webhooks-kill-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("baton.toml");
    std::fs::write(
        &file,
        format!(
            "redis = \"{}\"\nallow_loopback_webhooks = true\n[queues.jobs.handlers]\necho = \"echo\"\n[queues.jobs.webhook]\nurl = \"{url}\"\nclaim_timeout = \"1s\"\n",
            redis.url()
        ),
    )
    .unwrap();
    let cfg = file.to_str().unwrap();
    let serve_port = free_port();
    let _serve = spawn(&["serve", "--no-workers", "--config", cfg], serve_port).await;
    let base = format!("http://127.0.0.1:{serve_port}");
    let a = spawn(&["worker", "--config", cfg], free_port()).await;
    submit(&base, "jobs", json!({"id": "k-1", "type": "echo", "params": 7})).await;
    let first = next_post(&mut rx, Duration::from_secs(15)).await.expect("the first attempt");
    assert_eq!(first.header("webhook-attempt"), "1");
    let _b = spawn(&["worker", "--config", cfg], free_port()).await;
    assert!(next_post(&mut rx, Duration::from_secs(3)).await.is_none(), "sent again while its holder lives");
    drop(a);
    let second = next_post(&mut rx, Duration::from_secs(6)).await.expect("taken over after the claim timeout");
    assert_eq!(second.header("webhook-attempt"), "2");
    assert_eq!(second.header("webhook-id"), first.header("webhook-id"));
    assert_eq!(second.body, first.body);
    let state = get_json(format!("{base}/v1/commands/k-1")).await;
    assert_eq!(second.header("webhook-id"), format!("k-1:{}", state["version"]));
    verify(&second, &get_json(format!("{base}/v1/stream/__ds/jwks.json")).await);
    assert!(next_post(&mut rx, Duration::from_secs(2)).await.is_none(), "acked once");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `baton serve` with `[queues.<q>.webhook]` in its TOML file: a command's end is POSTed,
/// signed with the key of the server's JWKS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn baton_serve_delivers_the_webhook_of_its_toml_file() {
    let (url, mut rx) = receiver(|_| Some(204)).await;
    let dir = std::env::temp_dir().join(format!("baton-webhooks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("baton.toml");
    std::fs::write(
        &file,
        format!(
            "allow_loopback_webhooks = true\n[queues.jobs.handlers]\necho = \"echo\"\nfail = \"fail\"\n[queues.jobs.webhook]\nurl = \"{url}\"\nevents = [\"succeeded\"]\nclaim_timeout = \"1s\"\n"
        ),
    )
    .unwrap();
    let port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--config", file.to_str().unwrap()])
        .env_remove("BATON_REDIS")
        .env_remove("BATON_REDIS_CLUSTER")
        .env_remove("BATON_ADMIN_TOKEN")
        .env_remove("BATON_CONFIG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let up = eventually(Duration::from_secs(20), || async {
        let r = client().get(format!("{base}/healthz")).send().await.ok()?;
        (r.status() == StatusCode::OK).then_some(())
    })
    .await;
    assert!(up.is_some(), "baton serve did not start");
    submit(&base, "jobs", json!({"id": "j-1", "type": "echo", "params": {"x": "y"}})).await;
    let p = next_post(&mut rx, Duration::from_secs(10)).await.expect("a delivery");
    let state = get_json(format!("{base}/v1/commands/j-1")).await;
    let body = p.json();
    assert_eq!(body["delivery_id"], format!("j-1:{}", state["version"]));
    assert_eq!(body["event"], "succeeded");
    assert_eq!(body["result"], json!({"x": "y"}));
    assert_eq!(body["completed_at"], state["completed_at"]);
    verify(&p, &get_json(format!("{base}/v1/stream/__ds/jwks.json")).await);
    // `events = ["succeeded"]`: a failure is not delivered.
    submit(&base, "jobs", json!({"id": "j-2", "type": "fail", "params": {"error": "no"}})).await;
    let st = get_json(format!("{base}/v1/commands/j-2?wait=5s")).await;
    assert_eq!(st["status"], "FAILED");
    assert!(next_post(&mut rx, Duration::from_millis(1500)).await.is_none(), "a failure was delivered");
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
