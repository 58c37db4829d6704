//! The Durable Streams subscription API (`/v1/stream/__ds/…`) of `baton serve` processes, on
//! memory and on Redis: create / confirm / conflict, webhook URL checks, a signed webhook
//! delivery verified against the JWKS and its callback, pull-wake claim / ack / release, auth
//! (admin management, callbacks with the callback token only), and on Redis a delivery taken
//! over by a second process after the first is killed, and never duplicated while it lives.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::HeaderMap;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use baton_testkit::{eventually, free_port, RedisServer};
use common::client;
use ed25519_dalek::{Signature, Verifier, VerifyingKey};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// A `baton serve` child process on a free port.
struct Serve {
    child: Child,
    port: u16,
}

impl Serve {
    async fn spawn(redis: Option<&str>, args: &[&str], env: &[(&str, &str)]) -> Serve {
        let port = free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
        cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--no-workers"]);
        if let Some(r) = redis {
            cmd.args(["--redis", r]);
        }
        cmd.args(args)
            .env_remove("BATON_REDIS")
            .env_remove("BATON_REDIS_CLUSTER")
            .env_remove("BATON_ADMIN_TOKEN")
            .env_remove("BATON_CONFIG");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("baton serve starts");
        let s = Serve { child, port };
        let up = eventually(Duration::from_secs(20), || async {
            let r = client().get(s.url("/healthz")).send().await.ok()?;
            (r.status() == StatusCode::OK).then_some(())
        })
        .await;
        assert!(up.is_some(), "baton serve did not start");
        s
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn sub(&self, id: &str, tail: &str) -> String {
        self.url(&format!("/v1/stream/__ds/subscriptions/{id}{tail}"))
    }

    /// SIGKILL.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One webhook POST as the receiver got it.
#[derive(Debug)]
struct Post {
    headers: HeaderMap,
    body: Bytes,
}

/// A webhook receiver on 127.0.0.1: every POST is sent to the channel; the first `hold` POSTs
/// are never answered, the others get `200 {}`.
async fn receiver(hold: usize) -> (String, mpsc::UnboundedReceiver<Post>) {
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
                if n < hold {
                    std::future::pending::<()>().await;
                }
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/hook"), rx)
}

/// A JSON request body (reqwest is built without its `json` feature).
trait JsonBody {
    fn js(self, v: &Value) -> Self;
}

impl JsonBody for reqwest::RequestBuilder {
    fn js(self, v: &Value) -> Self {
        self.header("content-type", "application/json").body(v.to_string())
    }
}

async fn send(rb: reqwest::RequestBuilder) -> (StatusCode, Value) {
    let res = rb.send().await.unwrap();
    let status = res.status();
    let text = res.text().await.unwrap();
    (status, if text.is_empty() { Value::Null } else { serde_json::from_str(&text).unwrap_or(Value::String(text)) })
}

async fn put_json(url: String, body: Value) -> (StatusCode, Value) {
    send(client().put(url).js(&body)).await
}

async fn create_stream(s: &Serve, path: &str, ct: &str) {
    let r = client().put(s.url(&format!("/v1/stream/{path}"))).header("content-type", ct).send().await.unwrap();
    assert!(r.status().is_success(), "create {path}: {}", r.status());
}

async fn append(s: &Serve, path: &str, ct: &str, data: &str) {
    let r = client()
        .post(s.url(&format!("/v1/stream/{path}")))
        .header("content-type", ct)
        .body(data.to_string())
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "append {path}: {}", r.status());
}

async fn next_post(rx: &mut mpsc::UnboundedReceiver<Post>, within: Duration) -> Option<Post> {
    tokio::time::timeout(within, rx.recv()).await.ok().flatten()
}

/// The body of a callback or ack that acknowledges every stream of `wake` at its tail.
fn ack_all(wake: &Value, done: bool) -> Value {
    let acks: Vec<Value> = wake["streams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| json!({ "stream": s["path"], "offset": s["tail_offset"] }))
        .collect();
    json!({ "wake_id": wake["wake_id"], "generation": wake["generation"], "acks": acks, "done": done })
}

fn backends() -> Vec<(&'static str, Option<RedisServer>)> {
    vec![("memory", None), ("standalone", Some(RedisServer::start()))]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_confirm_conflict_url_checks_and_routing() {
    for (name, redis) in backends() {
        let url = redis.as_ref().map(|r| r.url());
        let s = Serve::spawn(url.as_deref(), &[], &[]).await;
        create_stream(&s, "wake/pool", "application/json").await;
        let spec = json!({ "type": "pull-wake", "pattern": "events/*", "wake_stream": "wake/pool" });
        let (st, v) = put_json(s.sub("jobs", ""), spec.clone()).await;
        assert_eq!(st, StatusCode::CREATED, "{name}: {v}");
        assert_eq!(v["subscription_id"], "jobs", "{name}");
        let (st, _) = put_json(s.sub("jobs", ""), spec).await;
        assert_eq!(st, StatusCode::OK, "{name}");
        let other = json!({ "type": "pull-wake", "pattern": "other/*", "wake_stream": "wake/pool" });
        let (st, v) = put_json(s.sub("jobs", ""), other).await;
        assert_eq!((st, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("SUBSCRIPTION_ALREADY_EXISTS")));
        let (st, v) = send(client().get(s.sub("jobs", ""))).await;
        assert_eq!((st, v["pattern"].as_str()), (StatusCode::OK, Some("events/*")), "{name}");

        // Private and (without --allow-loopback-webhooks) loopback webhook URLs are refused.
        for hook in ["http://10.0.0.1/hook", "http://127.0.0.1:9/hook"] {
            let body = json!({ "type": "webhook", "pattern": "events/*", "webhook": { "url": hook } });
            let (st, v) = put_json(s.sub("hook", ""), body).await;
            assert_eq!(st, StatusCode::BAD_REQUEST, "{name} {hook}: {v}");
            assert_eq!(v["error"]["code"], "WEBHOOK_URL_REJECTED", "{name} {hook}: {v}");
        }
        let (st, v) = send(client().put(s.sub("bad", "")).header("content-type", "application/json").body("{")).await;
        assert_eq!((st, v["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("INVALID_REQUEST")));
        assert_eq!(v["error"]["message"], "Invalid JSON body");

        // A normal stream under /v1/stream still works beside the static __ds routes...
        create_stream(&s, "events/a", "text/plain").await;
        append(&s, "events/a", "text/plain", "hello").await;
        let r = client().get(s.url("/v1/stream/events/a?offset=-1")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.text().await.unwrap(), "hello");
        create_stream(&s, "__dsx/a", "text/plain").await;
        // ...and anything else under __ds is the control 404.
        for p in ["/v1/stream/__ds", "/v1/stream/__ds/x", "/v1/stream/__ds/subscriptions/jobs/nope"] {
            let (st, v) = send(client().get(s.url(p))).await;
            assert_eq!(st, StatusCode::NOT_FOUND, "{name} {p}");
            assert_eq!(v["error"]["code"], "SUBSCRIPTION_NOT_FOUND", "{name} {p}");
            assert_eq!(v["error"]["message"], "Durable Streams control route not found", "{name} {p}");
        }
        let r = client().delete(s.sub("jobs", "/streams/events%2Fa")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
        let r = client().delete(s.sub("jobs", "")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
        let (st, _) = send(client().get(s.sub("jobs", ""))).await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        drop(s);
        drop(redis);
    }
}

/// Verifies `Webhook-Signature: t=…,kid=…,ed25519=…` of `post` against the JWKS.
fn verify(post: &Post, jwks: &Value) {
    let h = post.headers.get("webhook-signature").expect("signed").to_str().unwrap();
    let (t, rest) = h.strip_prefix("t=").unwrap().split_once(",kid=").unwrap();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_is_delivered_signed_and_its_callback_is_fenced_once_used() {
    for (name, redis) in backends() {
        let url = redis.as_ref().map(|r| r.url());
        let s = Serve::spawn(url.as_deref(), &["--allow-loopback-webhooks"], &[]).await;
        let (hook, mut rx) = receiver(0).await;
        create_stream(&s, "events/a", "text/plain").await;
        let body = json!({ "type": "webhook", "pattern": "events/*", "webhook": { "url": hook } });
        let (st, v) = put_json(s.sub("hooked", ""), body).await;
        assert_eq!(st, StatusCode::CREATED, "{name}: {v}");
        append(&s, "events/a", "text/plain", "x").await;
        let post = next_post(&mut rx, Duration::from_secs(10)).await.expect("a webhook POST");
        let wake: Value = serde_json::from_slice(&post.body).unwrap();
        assert_eq!(wake["subscription_id"], "hooked", "{name}");
        assert_eq!(wake["callback_url"], s.sub("hooked", "/callback"), "{name}");
        let res = client().get(s.url("/v1/stream/__ds/jwks.json")).send().await.unwrap();
        assert_eq!(res.headers()["content-type"], "application/jwk-set+json");
        assert_eq!(res.headers()["cache-control"], "public, max-age=300");
        let jwks: Value = serde_json::from_str(&res.text().await.unwrap()).unwrap();
        verify(&post, &jwks);

        let token = wake["callback_token"].as_str().unwrap();
        // Without wake_id: a 400 naming the field, not FENCED.
        let no_id = json!({ "generation": wake["generation"], "done": true });
        let (st, v) = send(client().post(s.sub("hooked", "/callback")).bearer_auth(token).js(&no_id)).await;
        assert_eq!((st, v["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("INVALID_REQUEST")), "{name}");
        assert_eq!(v["error"]["message"], "wake_id is required: the wake_id of the wake being acknowledged");
        let cb = || client().post(s.sub("hooked", "/callback")).bearer_auth(token).js(&ack_all(&wake, true));
        let (st, v) = send(cb()).await;
        assert_eq!((st, v), (StatusCode::OK, json!({ "ok": true, "next_wake": false })), "{name}");
        let (st, v) = send(cb()).await;
        assert_eq!((st, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("FENCED")), "{name}");
        assert_eq!(
            v["error"]["message"],
            "the wake of generation 1 is no longer current: its lease ended or it was acknowledged done"
        );
        let (st, v) = send(client().post(s.sub("hooked", "/callback")).js(&ack_all(&wake, true))).await;
        assert_eq!((st, v["error"]["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("TOKEN_INVALID")), "{name}");
        drop(s);
        drop(redis);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_wake_claim_ack_release() {
    for (name, redis) in backends() {
        let url = redis.as_ref().map(|r| r.url());
        let s = Serve::spawn(url.as_deref(), &[], &[]).await;
        create_stream(&s, "wake/pool", "application/json").await;
        create_stream(&s, "events/a", "text/plain").await;
        let spec = json!({ "type": "pull-wake", "pattern": "events/*", "wake_stream": "wake/pool" });
        assert_eq!(put_json(s.sub("pw", ""), spec).await.0, StatusCode::CREATED);
        let claim = |w: &str| send(client().post(s.sub("pw", "/claim")).js(&json!({ "worker": w })));
        let (st, v) = claim("w1").await;
        assert_eq!((st, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("NO_PENDING_WORK")), "{name}");

        append(&s, "events/a", "text/plain", "one").await;
        let (st, wake) = claim("w1").await;
        assert_eq!(st, StatusCode::OK, "{name}: {wake}");
        let (st, v) = claim("w2").await;
        assert_eq!((st, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("ALREADY_CLAIMED")), "{name}");
        assert_eq!(v["error"]["current_holder"], "w1");
        let token = wake["token"].as_str().unwrap().to_string();
        let ack = || client().post(s.sub("pw", "/ack")).bearer_auth(&token).js(&ack_all(&wake, true));
        let (st, v) = send(ack()).await;
        assert_eq!((st, v), (StatusCode::OK, json!({ "ok": true, "next_wake": false })), "{name}");
        let (st, v) = send(ack()).await;
        assert_eq!((st, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("FENCED")), "{name}");

        append(&s, "events/a", "text/plain", "two").await;
        let (st, wake) = claim("w2").await;
        assert_eq!(st, StatusCode::OK, "{name}: {wake}");
        let token = wake["token"].as_str().unwrap().to_string();
        let body = json!({ "wake_id": wake["wake_id"], "generation": wake["generation"] });
        let release = || client().post(s.sub("pw", "/release")).bearer_auth(&token).js(&body);
        let r = release().send().await.unwrap();
        assert_eq!(r.status(), StatusCode::NO_CONTENT, "{name}: {}", r.text().await.unwrap());
        let (st, v) = send(release()).await;
        assert_eq!((st, v["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("FENCED")), "{name}");
        let bad = client().post(s.sub("pw", "/release")).bearer_auth("99.nope").js(&body);
        let (st, v) = send(bad).await;
        assert_eq!((st, v["error"]["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("TOKEN_INVALID")), "{name}");
        assert_eq!(v["error"]["message"], "claim token invalid: not a token of this subscription");
        // Released, not acknowledged: the entries are still pending, so a new wake is claimable.
        let again = eventually(Duration::from_secs(10), || async {
            let (st, v) = claim("w3").await;
            (st == StatusCode::OK).then_some(v)
        })
        .await;
        assert!(again.is_some(), "{name}: the released entries were not woken again");
        drop(s);
        drop(redis);
    }
}

const ADMIN: &str = "admin-secret-0123456789abcdef";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn management_needs_admin_but_callbacks_need_only_the_callback_token() {
    let s = Serve::spawn(None, &["--allow-loopback-webhooks"], &[("BATON_ADMIN_TOKEN", ADMIN)]).await;
    let (hook, mut rx) = receiver(0).await;
    let body = json!({ "type": "webhook", "pattern": "events/*", "webhook": { "url": hook } });
    let (st, v) = put_json(s.sub("sec", ""), body.clone()).await;
    assert_eq!((st, v["error"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")), "{v}");
    let (st, _) = send(client().get(s.sub("sec", ""))).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, _) = send(client().post(s.sub("sec", "/claim")).js(&json!({ "worker": "w" }))).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, v) = send(client().put(s.sub("sec", "")).bearer_auth(ADMIN).js(&body)).await;
    assert_eq!(st, StatusCode::CREATED, "{v}");
    // The JWKS is public.
    let (st, _) = send(client().get(s.url("/v1/stream/__ds/jwks.json"))).await;
    assert_eq!(st, StatusCode::OK);

    let r = client()
        .put(s.url("/v1/stream/events/a"))
        .bearer_auth(ADMIN)
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    let r = client()
        .post(s.url("/v1/stream/events/a"))
        .bearer_auth(ADMIN)
        .header("content-type", "text/plain")
        .body("x")
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let post = next_post(&mut rx, Duration::from_secs(10)).await.expect("a webhook POST");
    let wake: Value = serde_json::from_slice(&post.body).unwrap();
    let token = wake["callback_token"].as_str().unwrap();
    let (st, v) = send(client().post(s.sub("sec", "/callback")).bearer_auth(token).js(&ack_all(&wake, true))).await;
    assert_eq!((st, v), (StatusCode::OK, json!({ "ok": true, "next_wake": false })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_process_delivery_is_taken_over_and_a_live_one_is_never_duplicated() {
    let redis = RedisServer::start();
    let url = redis.url();
    let args = ["--allow-loopback-webhooks", "--subscription-claim-timeout", "2s"];

    // Both alive: the first POST is held for 3× the claim timeout; nothing else arrives.
    {
        let (hook, mut rx) = receiver(1).await;
        let a = Serve::spawn(Some(&url), &args, &[]).await;
        create_stream(&a, "live/a", "text/plain").await;
        let body = json!({ "type": "webhook", "pattern": "live/*", "webhook": { "url": hook } });
        assert_eq!(put_json(a.sub("held", ""), body).await.0, StatusCode::CREATED);
        let b = Serve::spawn(Some(&url), &args, &[]).await;
        append(&a, "live/a", "text/plain", "x").await;
        let first = next_post(&mut rx, Duration::from_secs(10)).await.expect("the first POST");
        let wake: Value = serde_json::from_slice(&first.body).unwrap();
        assert_eq!(wake["subscription_id"], "held");
        let second = next_post(&mut rx, Duration::from_secs(6)).await;
        assert!(second.is_none(), "a second POST while the holder lives: {second:?}");
        drop((a, b));
    }

    // A killed: B takes the delivery over within the claim timeout (plus slack).
    let (hook, mut rx) = receiver(1).await;
    let mut a = Serve::spawn(Some(&url), &args, &[]).await;
    create_stream(&a, "events/a", "text/plain").await;
    let body = json!({ "type": "webhook", "pattern": "events/*", "webhook": { "url": hook } });
    assert_eq!(put_json(a.sub("takeover", ""), body).await.0, StatusCode::CREATED);
    append(&a, "events/a", "text/plain", "x").await;
    let first = next_post(&mut rx, Duration::from_secs(10)).await.expect("the first POST");
    let w1: Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(w1["subscription_id"], "takeover");
    let _b = Serve::spawn(Some(&url), &args, &[]).await;
    a.kill();
    let second = next_post(&mut rx, Duration::from_secs(5)).await.expect("a second POST, from B, after A died");
    let w2: Value = serde_json::from_slice(&second.body).unwrap();
    assert_eq!(w2["subscription_id"], "takeover");
    assert_ne!(w2["callback_url"], w1["callback_url"], "the second POST comes from B");
}

/// `POST /v1/subscriptions/signing-keys/rotate` (admin): the new kid comes back with the JWKS
/// URL; the JWKS lists the new key first and keeps the old one; the next webhook is signed with
/// the new key; without the admin token it is 401 (Baton's error shape). On Redis, a second
/// process serves the new key first from its next registry poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotating_the_signing_key_publishes_the_new_key_first_and_signs_with_it() {
    const ROTATE: &str = "/v1/subscriptions/signing-keys/rotate";
    let kids = |jwks: &Value| -> Vec<String> {
        jwks["keys"].as_array().unwrap().iter().map(|k| k["kid"].as_str().unwrap().to_string()).collect()
    };
    for (name, redis) in backends() {
        let url = redis.as_ref().map(|r| r.url());
        let env = [("BATON_ADMIN_TOKEN", ADMIN)];
        let s = Serve::spawn(url.as_deref(), &["--allow-loopback-webhooks"], &env).await;
        let (_, before) = send(client().get(s.url("/v1/stream/__ds/jwks.json"))).await;
        let old = kids(&before);
        assert_eq!(old.len(), 1, "{name}: {before}");

        // Not without the admin token: Baton's 401, not the protocol's error body.
        let (st, v) = send(client().post(s.url(ROTATE))).await;
        assert_eq!((st, v["error"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")), "{name}: {v}");
        let (st, _) = send(client().post(s.url(ROTATE)).bearer_auth("not-the-admin-token-0123456789")).await;
        assert_eq!(st, StatusCode::UNAUTHORIZED, "{name}");
        let (_, same) = send(client().get(s.url("/v1/stream/__ds/jwks.json"))).await;
        assert_eq!(kids(&same), old, "{name}: a refused rotation changes nothing");

        let (st, v) = send(client().post(s.url(ROTATE)).bearer_auth(ADMIN)).await;
        assert_eq!(st, StatusCode::OK, "{name}: {v}");
        let kid = v["kid"].as_str().unwrap().to_string();
        assert!(kid.starts_with("ds_") && kid != old[0], "{name}: {v}");
        assert_eq!(v["jwks_url"], s.url("/v1/stream/__ds/jwks.json"), "{name}");
        let (_, after) = send(client().get(s.url("/v1/stream/__ds/jwks.json"))).await;
        assert_eq!(kids(&after), vec![kid.clone(), old[0].clone()], "{name}: {after}");

        // The next delivery is signed with the new key.
        let (hook, mut rx) = receiver(0).await;
        let stream = s.url("/v1/stream/rot/a");
        let r = client().put(&stream).bearer_auth(ADMIN).header("content-type", "text/plain").send().await.unwrap();
        assert_eq!(r.status(), StatusCode::CREATED, "{name}");
        let body = json!({ "type": "webhook", "pattern": "rot/*", "webhook": { "url": hook } });
        let (st, v) = send(client().put(s.sub("rot", "")).bearer_auth(ADMIN).js(&body)).await;
        assert_eq!(st, StatusCode::CREATED, "{name}: {v}");
        let r = client().post(&stream).bearer_auth(ADMIN).header("content-type", "text/plain").body("x");
        assert!(r.send().await.unwrap().status().is_success(), "{name}");
        let post = next_post(&mut rx, Duration::from_secs(10)).await.expect("a webhook POST");
        let sig = post.headers["webhook-signature"].to_str().unwrap().to_string();
        assert!(sig.contains(&format!(",kid={kid},")), "{name}: {sig}");
        verify(&post, &after);

        // Another process on the same Redis picks the new key up at its next registry poll.
        if let Some(u) = url.as_deref() {
            let b = Serve::spawn(Some(u), &["--allow-loopback-webhooks"], &env).await;
            let (st, v) = send(client().post(b.url(ROTATE)).bearer_auth(ADMIN)).await;
            assert_eq!(st, StatusCode::OK, "{name}: {v}");
            let newest = v["kid"].as_str().unwrap().to_string();
            let seen = eventually(Duration::from_secs(5), || async {
                let (_, j) = send(client().get(s.url("/v1/stream/__ds/jwks.json"))).await;
                (kids(&j).first() == Some(&newest)).then_some(j)
            })
            .await
            .unwrap_or_else(|| panic!("{name}: the first process never served {newest} first"));
            assert_eq!(kids(&seen), vec![newest, kid.clone(), old[0].clone()], "{name}: {seen}");
        }
        drop(s);
        drop(redis);
    }
}
