//! Webhook deliveries never go through `HTTP_PROXY` / `HTTPS_PROXY`: through a proxy the address
//! check would see the proxy's address, not the webhook's. A process of its own (this file),
//! since it sets the environment.

use std::time::Duration;

use baton_streams::{AppendRequest, CreateOptions, StreamPath, StreamStore, StreamStoreSettings};
use baton_subscriptions::{Subscriptions, SubscriptionsConfig};
use serde_json::json;
use tokio::sync::mpsc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_ignore_proxy_variables() {
    // A proxy that is not there: a delivery through it would fail.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    for var in ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"] {
        std::env::set_var(var, &proxy);
    }
    std::env::remove_var("NO_PROXY");
    std::env::remove_var("no_proxy");

    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |body: String| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(body);
                axum::Json(json!({"done": true}))
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });

    let streams = StreamStore::memory(StreamStoreSettings::default());
    let cfg = SubscriptionsConfig { allow_loopback_webhooks: true, ..Default::default() };
    let subs = Subscriptions::memory(streams.clone(), cfg).await.unwrap();
    subs.start_delivery().await.unwrap();
    subs.create("p", &json!({"type": "webhook", "streams": ["a/b"], "webhook": {"url": url}})).await.unwrap();
    let p = StreamPath::new("a/b").unwrap();
    streams.create(&p, CreateOptions::default()).await.unwrap();
    streams.append(&p, AppendRequest { data: "x".into(), ..Default::default() }).await.unwrap();
    let body = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("delivered directly").unwrap();
    assert!(body.contains("\"subscription_id\":\"p\""), "{body}");
    subs.close(Duration::from_secs(1)).await;
}
