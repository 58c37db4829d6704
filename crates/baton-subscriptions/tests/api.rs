//! The subscription API end to end on every backend (memory, Redis standalone, 3-master
//! Cluster): pull-wake claims, acks, releases, fencing and lease expiry; webhook deliveries
//! signed with the published keys, synchronous `done`, callbacks and fencing; and, on Redis, a
//! second service instance (another process's view of the same Redis) that learns of the
//! subscription through the registry.

use std::time::Duration;

use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use baton_streams::{AppendRequest, CreateOptions, ReadFrom, StreamPath, StreamStore, StreamStoreSettings};
use baton_subscriptions::{Subscriptions, SubscriptionsConfig};
use baton_testkit::eventually;
use baton_testkit::{on_every_backend, TestBackend};
use ed25519_dalek::{Signature, Verifier, VerifyingKey};
use serde_json::{json, Value};
use tokio::sync::mpsc;

async fn store(b: &TestBackend) -> StreamStore {
    match b.redis_config() {
        None => StreamStore::memory(StreamStoreSettings::default()),
        Some(rc) => StreamStore::redis(rc, StreamStoreSettings::default()).await.unwrap(),
    }
}

fn cfg() -> SubscriptionsConfig {
    SubscriptionsConfig {
        base_url: "http://baton.test".into(),
        allow_loopback_webhooks: true,
        claim_timeout: Duration::from_secs(2),
        registry_poll: Duration::from_millis(50),
        ..Default::default()
    }
}

async fn service(b: &TestBackend, streams: &StreamStore) -> Subscriptions {
    let s = match b.redis_config() {
        None => Subscriptions::memory(streams.clone(), cfg()).await.unwrap(),
        Some(rc) => {
            Subscriptions::redis(baton_redis::RedisClient::new(rc).unwrap(), streams.clone(), cfg()).await.unwrap()
        }
    };
    s.start_delivery().await.unwrap();
    s
}

fn json_stream() -> CreateOptions {
    CreateOptions { content_type: Some("application/json".into()), ..Default::default() }
}

async fn append(s: &StreamStore, path: &str, body: &str) -> String {
    let p = StreamPath::new(path).unwrap();
    let _ = s.create(&p, json_stream()).await.unwrap();
    let a = s
        .append(
            &p,
            AppendRequest {
                data: body.to_string().into(),
                content_type: Some("application/json".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    a.tail.token(&a.incarnation)
}

async fn wake_events(s: &StreamStore, path: &str) -> Vec<Value> {
    let chunk = s.read(&StreamPath::new(path).unwrap(), ReadFrom::Start).await.unwrap();
    let v: Value = serde_json::from_slice(&chunk.body()).unwrap();
    v.as_array().unwrap().clone()
}

fn ack_body(claim: &Value, acks: Value, done: bool) -> Value {
    json!({"wake_id": claim["wake_id"], "generation": claim["generation"], "acks": acks, "done": done})
}

async fn pull_wake(b: TestBackend) {
    let streams = store(&b).await;
    let subs = service(&b, &streams).await;
    streams.create(&StreamPath::new("wake/pool").unwrap(), json_stream()).await.unwrap();
    let spec = json!({"type": "pull-wake", "pattern": "events/*", "wake_stream": "wake/pool", "lease_ttl_ms": 1000});
    assert!(subs.create("p1", &spec).await.unwrap().0);
    assert!(!subs.create("p1", &spec).await.unwrap().0, "an identical PUT confirms");
    let other = json!({"type": "pull-wake", "pattern": "events/**", "wake_stream": "wake/pool"});
    assert_eq!(subs.create("p1", &other).await.unwrap_err().code(), "SUBSCRIPTION_ALREADY_EXISTS");
    assert_eq!(subs.claim("p1", &json!({"worker": "w1"})).await.unwrap_err().code(), "NO_PENDING_WORK");

    let tail = append(&streams, "events/a", r#"{"n":1}"#).await;
    let events = eventually(Duration::from_secs(5), || async {
        let e = wake_events(&streams, "wake/pool").await;
        (!e.is_empty()).then_some(e)
    })
    .await
    .expect("a wake event");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["subscription_id"], "p1");
    assert_eq!(events[0]["stream"], "events/a");
    assert_eq!(events[0]["generation"], 1);

    let c1 = subs.claim("p1", &json!({"worker": "w1"})).await.unwrap();
    assert_eq!(c1["generation"], 1);
    assert_eq!(c1["streams"][0]["tail_offset"], tail.as_str());
    let busy = subs.claim("p1", &json!({"worker": "w2"})).await.unwrap_err();
    assert_eq!(busy.body()["error"]["current_holder"], "w1");
    let t1 = c1["token"].as_str().unwrap();
    // A body without generation is a 400 naming it (not FENCED).
    let e = subs.ack("p1", t1, &json!({"wake_id": c1["wake_id"]})).await.unwrap_err();
    assert_eq!(
        (e.code(), e.to_string().as_str()),
        ("INVALID_REQUEST", "generation is required: the generation of the wake being acknowledged")
    );
    // An ack past the tail is refused and changes nothing.
    let past = format!("{:016}_{:016}", u64::MAX / 2_000_000, 0);
    let e =
        subs.ack("p1", t1, &ack_body(&c1, json!([{"stream": "events/a", "offset": past}]), true)).await.unwrap_err();
    assert_eq!(e.code(), "INVALID_OFFSET");
    let done = ack_body(&c1, json!([{"stream": "events/a", "offset": tail}]), true);
    assert_eq!(subs.ack("p1", t1, &done).await.unwrap(), json!({"ok": true, "next_wake": false}));
    assert_eq!(subs.ack("p1", t1, &done).await.unwrap_err().code(), "FENCED");
    let got = subs.get("p1").await.unwrap();
    assert_eq!(got["streams"][0]["acked_offset"], tail.as_str());

    // A second append, a claim, a release: the wake comes back (entries still pending).
    let tail2 = append(&streams, "events/a", r#"{"n":2}"#).await;
    let c2 = eventually(Duration::from_secs(5), || async { subs.claim("p1", &json!({"worker": "w1"})).await.ok() })
        .await
        .unwrap();
    assert_eq!(c2["generation"], 2);
    subs.release("p1", c2["token"].as_str().unwrap(), &ack_body(&c2, json!([]), false)).await.unwrap();
    let c3 = subs.claim("p1", &json!({"worker": "w2"})).await.unwrap();
    assert_eq!(c3["generation"], 3);
    // Its lease (1 s) expires without renewal: another worker claims, the old token is fenced.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let c4 = subs.claim("p1", &json!({"worker": "w3"})).await.unwrap();
    assert!(c4["generation"].as_u64().unwrap() > 3);
    let e = subs
        .ack(
            "p1",
            c3["token"].as_str().unwrap(),
            &ack_body(&c3, json!([{"stream": "events/a", "offset": tail2}]), true),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), "FENCED");
    let ok = subs
        .ack(
            "p1",
            c4["token"].as_str().unwrap(),
            &ack_body(&c4, json!([{"stream": "events/a", "offset": tail2}]), true),
        )
        .await
        .unwrap();
    assert_eq!(ok["next_wake"], false);

    // Another process on the same Redis learns of a new subscription through the registry,
    // and its appends wake it.
    if b.redis_config().is_some() {
        let streams_b = store(&b).await;
        let subs_b = service(&b, &streams_b).await;
        streams.create(&StreamPath::new("wake/two").unwrap(), json_stream()).await.unwrap();
        let spec2 =
            json!({"type": "pull-wake", "streams": ["jobs/x"], "wake_stream": "wake/two", "lease_ttl_ms": 1000});
        assert!(subs.create("p2", &spec2).await.unwrap().0);
        eventually(Duration::from_secs(5), || async { (subs_b.count() == 2).then_some(()) }).await.expect("B sees p2");
        append(&streams_b, "jobs/x", r#"{"n":1}"#).await;
        let c =
            eventually(Duration::from_secs(5), || async { subs.claim("p2", &json!({"worker": "w"})).await.ok() }).await;
        assert_eq!(c.expect("claimable after B's append")["generation"], 1);
        subs_b.close(Duration::from_secs(1)).await;
    }
    subs.delete("p1").await.unwrap();
    assert_eq!(subs.get("p1").await.unwrap_err().code(), "SUBSCRIPTION_NOT_FOUND");
    subs.close(Duration::from_secs(1)).await;
}

struct Received {
    body: String,
    signature: String,
}

/// A webhook receiver on 127.0.0.1: every request is sent to the channel; it answers with
/// `answer`.
async fn receiver(answer: Value) -> (String, mpsc::UnboundedReceiver<Received>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: String| {
            let tx = tx.clone();
            let answer = answer.clone();
            async move {
                let signature =
                    headers.get("webhook-signature").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                let _ = tx.send(Received { body, signature });
                axum::Json(answer)
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (url, rx)
}

fn verify(jwks: &Value, r: &Received) {
    let h = r.signature.strip_prefix("t=").expect("t=");
    let (t, rest) = h.split_once(",kid=").unwrap();
    let (kid, sig) = rest.split_once(",ed25519=").unwrap();
    let key = jwks["keys"].as_array().unwrap().iter().find(|k| k["kid"] == kid).expect("kid published");
    let x: [u8; 32] = B64.decode(key["x"].as_str().unwrap()).unwrap().try_into().unwrap();
    let vk = VerifyingKey::from_bytes(&x).unwrap();
    let sig = Signature::from_bytes(&B64.decode(sig).unwrap().try_into().unwrap());
    vk.verify(format!("{t}.{}", r.body).as_bytes(), &sig).expect("valid signature");
}

async fn webhook(b: TestBackend) {
    let streams = store(&b).await;
    let subs = service(&b, &streams).await;
    let refused = json!({"type": "webhook", "pattern": "a/*", "webhook": {"url": "http://10.0.0.1/hook"}});
    assert_eq!(subs.create("bad", &refused).await.unwrap_err().code(), "WEBHOOK_URL_REJECTED");

    // Synchronous done: the snapshot is acknowledged by the delivery itself.
    let (url, mut rx) = receiver(json!({"done": true})).await;
    let spec = json!({"type": "webhook", "pattern": "sync/*", "webhook": {"url": url}, "lease_ttl_ms": 1000});
    let (_, view) = subs.create("w1", &spec).await.unwrap();
    assert_eq!(view["webhook"]["signing"]["jwks_url"], "http://baton.test/v1/stream/__ds/jwks.json");
    let tail = append(&streams, "sync/a", r#"{"n":1}"#).await;
    let r = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
    let jwks = subs.jwks().await.unwrap();
    verify(&jwks, &r);
    let body: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(body["subscription_id"], "w1");
    assert_eq!(body["callback_url"], "http://baton.test/v1/stream/__ds/subscriptions/w1/callback");
    assert_eq!(body["streams"][0]["tail_offset"], tail.as_str());
    assert_eq!(body["streams"][0]["has_pending"], true);
    eventually(Duration::from_secs(3), || async {
        let g = subs.get("w1").await.unwrap();
        (g["streams"][0]["acked_offset"] == tail.as_str()).then_some(())
    })
    .await
    .expect("auto-acked");

    // Callback: ack, done, then the same callback is fenced. A rotated key signs the next wake.
    let (url2, mut rx2) = receiver(json!({})).await;
    let spec2 = json!({"type": "webhook", "streams": ["cb/a"], "webhook": {"url": url2}, "lease_ttl_ms": 5000});
    subs.create("w2", &spec2).await.unwrap();
    let kid = subs.rotate_signing_key().await.unwrap();
    let tail = append(&streams, "cb/a", r#"{"n":1}"#).await;
    let r = tokio::time::timeout(Duration::from_secs(5), rx2.recv()).await.unwrap().unwrap();
    assert!(r.signature.contains(&format!("kid={kid},")), "{}", r.signature);
    let jwks = subs.jwks().await.unwrap();
    assert_eq!(jwks["keys"].as_array().unwrap().len(), 2, "the retired key stays published");
    verify(&jwks, &r);
    let body: Value = serde_json::from_str(&r.body).unwrap();
    let token = body["callback_token"].as_str().unwrap();
    let cb = json!({"wake_id": body["wake_id"], "generation": body["generation"], "acks": [{"stream": "cb/a", "offset": tail}], "done": true});
    assert_eq!(subs.callback("w2", "nope", &cb).await.unwrap_err().code(), "TOKEN_INVALID");
    assert_eq!(subs.callback("w2", token, &cb).await.unwrap(), json!({"ok": true, "next_wake": false}));
    assert_eq!(subs.callback("w2", token, &cb).await.unwrap_err().code(), "FENCED");
    // Nothing pending: no further delivery.
    assert!(tokio::time::timeout(Duration::from_millis(300), rx2.recv()).await.is_err());
    subs.close(Duration::from_secs(1)).await;
}

on_every_backend!(pull_wake, webhook);
