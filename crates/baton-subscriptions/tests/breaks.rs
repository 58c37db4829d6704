//! Regression tests for bugs found by breaking the subscription service from outside: webhook
//! receivers that answer late (after the subscription was deleted and created again), and
//! request fields that must not affect other subscriptions.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_streams::{AppendRequest, CreateOptions, StreamPath, StreamStore, StreamStoreSettings};
use baton_subscriptions::{Subscriptions, SubscriptionsConfig};
use baton_testkit::{eventually, RedisServer};
use serde_json::{json, Value};
use tokio::sync::mpsc;

fn cfg() -> SubscriptionsConfig {
    SubscriptionsConfig {
        base_url: "http://baton.test".into(),
        allow_loopback_webhooks: true,
        claim_timeout: Duration::from_secs(2),
        registry_poll: Duration::from_millis(50),
        ..Default::default()
    }
}

async fn services(redis: Option<&RedisServer>) -> (StreamStore, Subscriptions) {
    let (streams, subs) = match redis {
        None => {
            let streams = StreamStore::memory(StreamStoreSettings::default());
            let subs = Subscriptions::memory(streams.clone(), cfg()).await.unwrap();
            (streams, subs)
        }
        Some(r) => {
            let streams = StreamStore::redis(r.config(), StreamStoreSettings::default()).await.unwrap();
            let client = baton_redis::RedisClient::new(r.config()).unwrap();
            let subs = Subscriptions::redis(client, streams.clone(), cfg()).await.unwrap();
            (streams, subs)
        }
    };
    subs.start_delivery().await.unwrap();
    (streams, subs)
}

async fn append(s: &StreamStore, path: &str) -> String {
    let p = StreamPath::new(path).unwrap();
    let opts = CreateOptions { content_type: Some("application/json".into()), ..Default::default() };
    let _ = s.create(&p, opts).await.unwrap();
    let req = AppendRequest {
        data: r#"{"n":1}"#.into(),
        content_type: Some("application/json".into()),
        ..Default::default()
    };
    let a = s.append(&p, req).await.unwrap();
    a.tail.token(&a.incarnation)
}

/// A webhook receiver on 127.0.0.1 that reports every request body, waits `delay`, then answers
/// `status` with `answer`. Returns its URL, the bodies, and the count of requests.
async fn receiver(
    delay: Duration,
    status: u16,
    answer: Value,
) -> (String, mpsc::UnboundedReceiver<Value>, Arc<AtomicUsize>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let count = Arc::new(AtomicUsize::new(0));
    let n = count.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |body: String| {
            let tx = tx.clone();
            let answer = answer.clone();
            let n = n.clone();
            async move {
                n.fetch_add(1, Ordering::SeqCst);
                let _ = tx.send(serde_json::from_str::<Value>(&body).unwrap_or(Value::Null));
                tokio::time::sleep(delay).await;
                (axum::http::StatusCode::from_u16(status).unwrap(), axum::Json(answer))
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (url, rx, count)
}

/// A slow receiver answers `{"done": true}` to generation 1 of a subscription that was deleted
/// and created again meanwhile (whose first wake is generation 1 too): that answer must not
/// acknowledge or end the new subscription's wake, which its own receiver refused.
async fn late_done_of_a_deleted_subscription(redis: Option<&RedisServer>) {
    let (streams, subs) = services(redis).await;
    let (slow, mut slow_rx, _) = receiver(Duration::from_millis(1500), 200, json!({"done": true})).await;
    let (failing, mut failing_rx, failing_n) = receiver(Duration::ZERO, 500, json!({})).await;
    let spec =
        |url: &str| json!({"type": "webhook", "pattern": "dr/*", "webhook": {"url": url}, "lease_ttl_ms": 10000});
    subs.create("x", &spec(&slow)).await.unwrap();
    append(&streams, "dr/a").await;
    let first = tokio::time::timeout(Duration::from_secs(5), slow_rx.recv()).await.unwrap().unwrap();
    assert_eq!(first["generation"], 1);

    // While the slow receiver holds the POST: delete, create again, append.
    subs.delete("x").await.unwrap();
    subs.create("x", &spec(&failing)).await.unwrap();
    let tail = append(&streams, "dr/a").await;
    let second = tokio::time::timeout(Duration::from_secs(5), failing_rx.recv()).await.unwrap().unwrap();
    assert_eq!(second["generation"], 1);

    // The slow receiver's done arrives (1.5 s after the first POST); the new wake must stay.
    tokio::time::sleep(Duration::from_millis(1800)).await;
    let view = subs.get("x").await.unwrap();
    assert_ne!(
        view["streams"][0]["acked_offset"],
        tail.as_str(),
        "the deleted subscription's delivery acknowledged the new one's entries: {view}"
    );
    // The new wake is still retried (backoff about 1 s, then 2 s).
    eventually(Duration::from_secs(5), || async { (failing_n.load(Ordering::SeqCst) >= 2).then_some(()) })
        .await
        .expect("the new wake is retried");
    subs.close(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_done_of_a_deleted_subscription_memory() {
    late_done_of_a_deleted_subscription(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_done_of_a_deleted_subscription_redis() {
    let r = RedisServer::start();
    late_done_of_a_deleted_subscription(Some(&r)).await;
}

/// `wake_stream` means nothing for a webhook subscription: given one, other subscriptions of that
/// stream must still be woken by its appends (wake streams are never matched).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_wake_stream_blinds_nobody() {
    let (streams, subs) = services(None).await;
    let (url, mut rx, _) = receiver(Duration::ZERO, 200, json!({"done": true})).await;
    let odd = json!({"type": "webhook", "pattern": "zz/*", "webhook": {"url": url}, "wake_stream": "ev/a"});
    let (_, view) = subs.create("odd", &odd).await.unwrap();
    assert!(view.get("wake_stream").is_none(), "{view}");
    let watcher = json!({"type": "webhook", "streams": ["ev/a"], "webhook": {"url": url}});
    subs.create("watcher", &watcher).await.unwrap();
    append(&streams, "ev/a").await;
    let got = tokio::time::timeout(Duration::from_secs(3), rx.recv()).await.expect("watcher woken").unwrap();
    assert_eq!(got["subscription_id"], "watcher");
    subs.close(Duration::from_secs(1)).await;
}

/// `.` and `..` are refused as ids (their callback URL would resolve to another route).
#[tokio::test]
async fn dot_ids_are_refused() {
    let (_streams, subs) = services(None).await;
    for id in [".", ".."] {
        let spec = json!({"type": "webhook", "pattern": "a/*", "webhook": {"url": "https://example.com/h"}});
        assert_eq!(subs.create(id, &spec).await.unwrap_err().code(), "INVALID_REQUEST", "{id}");
    }
    subs.close(Duration::from_secs(1)).await;
}

async fn wake_events(s: &StreamStore, path: &str) -> Vec<Value> {
    let chunk = s.read(&StreamPath::new(path).unwrap(), baton_streams::ReadFrom::Start).await.unwrap();
    serde_json::from_slice::<Value>(&chunk.body()).unwrap().as_array().unwrap().clone()
}

/// Wake events are Baton's own appends: no subscription wakes on them, however its pattern
/// reads (no wake feeds itself or another), while a user's appends to a wake stream wake the
/// subscriptions that match it like any stream's (a wake stream is not hidden from anyone).
async fn wake_events_wake_nobody(redis: Option<&RedisServer>) {
    let (streams, subs) = services(redis).await;
    let json_stream = CreateOptions { content_type: Some("application/json".into()), ..Default::default() };
    for w in ["w/a", "w2/b"] {
        streams.create(&StreamPath::new(w).unwrap(), json_stream.clone()).await.unwrap();
    }
    // `all` matches everything, its own wake stream included; `watch` matches `all`'s wake stream.
    subs.create("all", &json!({"type": "pull-wake", "pattern": "**", "wake_stream": "w/a"})).await.unwrap();
    subs.create("watch", &json!({"type": "pull-wake", "pattern": "w/*", "wake_stream": "w2/b"})).await.unwrap();
    append(&streams, "events/x").await;
    eventually(Duration::from_secs(5), || async { (wake_events(&streams, "w/a").await.len() == 1).then_some(()) })
        .await
        .expect("one wake event for `all`");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(wake_events(&streams, "w/a").await.len(), 1, "a wake event woke `all` again");
    assert!(wake_events(&streams, "w2/b").await.is_empty(), "`all`'s wake event woke `watch`");
    assert_eq!(subs.claim("watch", &json!({"worker": "x"})).await.unwrap_err().code(), "NO_PENDING_WORK");
    // A user's own append to the wake stream is an append like any other.
    append(&streams, "w/a").await;
    let c = eventually(Duration::from_secs(5), || async { subs.claim("watch", &json!({"worker": "x"})).await.ok() })
        .await
        .expect("`watch` woken by a user's append to w/a");
    assert_eq!(c["streams"][0]["path"], "w/a");
    subs.close(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wake_events_wake_nobody_memory() {
    wake_events_wake_nobody(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wake_events_wake_nobody_redis() {
    let r = RedisServer::start();
    wake_events_wake_nobody(Some(&r)).await;
}

/// A pull-wake's wake stream must exist and take JSON: otherwise its wake events would be lost.
#[tokio::test]
async fn a_wake_stream_must_exist_and_be_json() {
    let (streams, subs) = services(None).await;
    let spec = json!({"type": "pull-wake", "pattern": "a/*", "wake_stream": "w/none"});
    let e = subs.create("p", &spec).await.unwrap_err();
    assert_eq!(e.to_string(), "wake_stream \"w/none\" does not exist: create it first (PUT /v1/stream/w/none with Content-Type: application/json)");
    streams.create(&StreamPath::new("w/text").unwrap(), CreateOptions::default()).await.unwrap();
    let spec = json!({"type": "pull-wake", "pattern": "a/*", "wake_stream": "w/text"});
    let e = subs.create("p", &spec).await.unwrap_err();
    assert_eq!(e.code(), "INVALID_REQUEST");
    assert!(e.to_string().contains("not application/json"), "{e}");
    subs.close(Duration::from_secs(1)).await;
}

/// An append acknowledged while the subscriptions' Redis cannot be reached (its master failing
/// over; on a Cluster, the streams' master is another one and keeps taking appends) must still
/// wake the subscriptions it matches once that Redis is back, even when nothing is appended
/// after it: the notification that failed is retried, not dropped with a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_made_while_the_subscriptions_redis_is_down_still_wakes() {
    let streams_redis = RedisServer::start();
    let subs_redis = RedisServer::start();
    let proxy = baton_testkit::TcpProxy::start(([127, 0, 0, 1], subs_redis.port()).into()).await;
    let streams = StreamStore::redis(streams_redis.config(), StreamStoreSettings::default()).await.unwrap();
    let client =
        baton_redis::RedisClient::new(baton_redis::RedisConfig::standalone(format!("redis://{}", proxy.addr())))
            .unwrap();
    let subs = Subscriptions::redis(client, streams.clone(), cfg()).await.unwrap();
    subs.start_delivery().await.unwrap();
    let json_stream = CreateOptions { content_type: Some("application/json".into()), ..Default::default() };
    streams.create(&StreamPath::new("w/pool").unwrap(), json_stream).await.unwrap();
    subs.create("p", &json!({"type": "pull-wake", "pattern": "events/*", "wake_stream": "w/pool"})).await.unwrap();
    let events = StreamPath::new("events/a").unwrap();
    streams.create(&events, CreateOptions::default()).await.unwrap();

    // The subscriptions' Redis goes away; the append still succeeds (another Redis).
    proxy.set_refuse(true);
    proxy.drop_connections();
    let req = AppendRequest { data: "while down".into(), ..Default::default() };
    let a = tokio::time::timeout(Duration::from_secs(20), streams.append(&events, req)).await.unwrap().unwrap();
    let tail = a.tail.token(&a.incarnation);
    proxy.set_refuse(false);

    let c = eventually(Duration::from_secs(10), || async { subs.claim("p", &json!({"worker": "w"})).await.ok() })
        .await
        .expect("the append made while the subscriptions' Redis was down wakes the subscription once it is back");
    assert_eq!(
        (c["streams"][0]["path"].as_str(), c["streams"][0]["tail_offset"].as_str()),
        (Some("events/a"), Some(tail.as_str()))
    );
    subs.close(Duration::from_secs(1)).await;
}
