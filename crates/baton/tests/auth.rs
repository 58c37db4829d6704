//! Bearer tokens: 401 without a valid token, 403 outside a token's operations or scopes, on
//! streams and commands alike; `?access_token=` for EventSource; secrets never logged.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton::settings::QueueConfig;
use baton::settings::TokenConfig;
use baton_testkit::TestBackend;
use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

const READER: &str = "reader-secret-0123456789";
const WRITER: &str = "writer-secret-0123456789";
const ADMIN: &str = "admin-secret-0123456789ab";

/// Everything logged by this test binary (any level), to check that no secret shows up.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture_logs() -> Capture {
    static CAP: std::sync::OnceLock<Capture> = std::sync::OnceLock::new();
    CAP.get_or_init(|| {
        let cap = Capture::default();
        let w = cap.clone();
        let _ = tracing_subscriber::fmt()
            .json()
            .with_max_level(tracing::Level::TRACE)
            .with_writer(move || w.clone())
            .try_init();
        cap
    })
    .clone()
}

async fn secured() -> TestServer {
    start(TestBackend::Memory, |c| {
        let mut other = QueueConfig::with_builtins("other", &["echo"]);
        other.settings.poll_interval = Some(Duration::from_millis(50));
        c.queues = vec![QueueConfig::with_builtins("default", &["echo", "sleep"]), other];
        c.tokens = vec![
            TokenConfig::new("reader", READER, &["read"], &["acme"], &["default"]).unwrap(),
            TokenConfig::new("writer", WRITER, &["read", "write"], &["acme/w/"], &["default"]).unwrap(),
            TokenConfig::admin("admin", ADMIN).unwrap(),
        ];
    })
    .await
}

async fn send(
    srv: &TestServer,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> reqwest::Response {
    let mut rb = client().request(method.parse().unwrap(), format!("{}{path}", srv.base));
    if let Some(t) = token {
        rb = rb.bearer_auth(t);
    }
    if let Some(b) = body {
        rb = rb.header("content-type", "application/json").body(b.to_string());
    }
    rb.send().await.unwrap()
}

async fn status(srv: &TestServer, method: &str, path: &str, token: Option<&str>, body: Option<Value>) -> u16 {
    send(srv, method, path, token, body).await.status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_scopes_and_operations() {
    let srv = secured().await;
    // No token: 401 with a Bearer challenge, on commands and streams alike.
    for (m, p) in
        [("GET", "/v1/queues"), ("GET", "/v1/stream/acme/x"), ("PUT", "/v1/stream/acme/x"), ("GET", "/v1/commands/x")]
    {
        let res = send(&srv, m, p, None, None).await;
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{m} {p}");
        assert_eq!(header(&res, "www-authenticate"), Some("Bearer realm=\"baton\""));
        let v: Value = res.text().await.map(|t| serde_json::from_str::<Value>(&t).unwrap()).unwrap();
        assert_eq!(v["error"], "unauthorized");
        assert!(v["message"].as_str().unwrap().contains("Authorization: Bearer <token>"));
    }
    // A wrong token, or another scheme: 401 invalid_token.
    let res = send(&srv, "GET", "/v1/queues", Some("not-a-valid-token-at-all"), None).await;
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(header(&res, "www-authenticate"), Some("Bearer realm=\"baton\", error=\"invalid_token\""));
    let res = client().get(format!("{}/v1/queues", srv.base)).basic_auth("u", Some("p")).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    // A prefix of a valid token is not valid.
    assert_eq!(status(&srv, "GET", "/v1/queues", Some(&READER[..20]), None).await, 401);
    // Public endpoints need no token.
    for p in ["/healthz", "/readyz", "/metrics", "/openapi.json", "/"] {
        assert_eq!(status(&srv, "GET", p, None, None).await, 200, "{p}");
    }

    // Streams: reader reads under acme only; writer writes under acme/w only.
    assert_eq!(status(&srv, "PUT", "/v1/stream/acme/w/1", Some(WRITER), None).await, 201);
    assert_eq!(
        status(&srv, "POST", "/v1/stream/acme/w/1", Some(WRITER), None).await,
        400,
        "allowed; empty append refused by the protocol"
    );
    assert_eq!(status(&srv, "PUT", "/v1/stream/acme/x", Some(WRITER), None).await, 403);
    assert_eq!(status(&srv, "PUT", "/v1/stream/acme/w", Some(WRITER), None).await, 201, "the prefix itself is covered");
    assert_eq!(
        status(&srv, "PUT", "/v1/stream/acme/wx", Some(WRITER), None).await,
        403,
        "prefixes match whole segments"
    );
    assert_eq!(status(&srv, "GET", "/v1/stream/acme/w/1", Some(READER), None).await, 200);
    assert_eq!(status(&srv, "HEAD", "/v1/stream/acme/w/1", Some(READER), None).await, 200);
    assert_eq!(status(&srv, "PUT", "/v1/stream/acme/r", Some(READER), None).await, 403);
    assert_eq!(status(&srv, "DELETE", "/v1/stream/acme/w/1", Some(READER), None).await, 403);
    assert_eq!(status(&srv, "GET", "/v1/stream/acmeco/x", Some(READER), None).await, 403);
    assert_eq!(status(&srv, "GET", "/v1/stream/other/x", Some(WRITER), None).await, 403);
    let res = send(&srv, "GET", "/v1/stream/other/x", Some(READER), None).await;
    let v: Value = res.text().await.map(|t| serde_json::from_str::<Value>(&t).unwrap()).unwrap();
    assert_eq!(
        v,
        json!({"error": "forbidden", "message": "token \"reader\" may not read stream \"other/x\" (operations: read; stream prefixes: acme)"})
    );
    assert_eq!(status(&srv, "PUT", "/v1/stream/any/where", Some(ADMIN), None).await, 201);
    // A fork needs read on its source: no copying a stream outside the token's scope.
    let fork = |src: &str| {
        client()
            .put(format!("{}/v1/stream/acme/w/fork-{}", srv.base, src.len()))
            .bearer_auth(WRITER)
            .header("stream-forked-from", src.to_string())
            .send()
    };
    assert_eq!(fork("/v1/stream/any/where").await.unwrap().status(), StatusCode::FORBIDDEN);
    assert_eq!(fork("any/where").await.unwrap().status(), StatusCode::FORBIDDEN);
    assert_eq!(fork("/v1/stream/acme/w/1").await.unwrap().status(), StatusCode::CREATED);

    // Commands: reader reads queue default; writer submits to default; nobody but admin touches other.
    let submit = json!({"id": "c-1", "type": "sleep", "params": {"ms": 60000}});
    assert_eq!(status(&srv, "POST", "/v1/queues/default/commands", Some(READER), Some(submit.clone())).await, 403);
    assert_eq!(status(&srv, "POST", "/v1/queues/default/commands", Some(WRITER), Some(submit)).await, 202);
    assert_eq!(
        status(&srv, "POST", "/v1/queues/other/commands", Some(WRITER), Some(json!({"type": "echo"}))).await,
        403
    );
    assert_eq!(
        status(&srv, "POST", "/v1/queues/other/commands", Some(ADMIN), Some(json!({"id": "o-1", "type": "echo"})))
            .await,
        202
    );
    assert_eq!(status(&srv, "GET", "/v1/commands/c-1", Some(READER), None).await, 200);
    assert_eq!(status(&srv, "GET", "/v1/commands/o-1", Some(READER), None).await, 403);
    assert_eq!(status(&srv, "GET", "/v1/commands/o-1?wait=5s", Some(WRITER), None).await, 403);
    assert_eq!(status(&srv, "POST", "/v1/commands/c-1/cancel", Some(READER), None).await, 403);
    assert_eq!(status(&srv, "POST", "/v1/commands/o-1/cancel", Some(WRITER), None).await, 403);
    assert_eq!(status(&srv, "POST", "/v1/commands/c-1/cancel", Some(WRITER), None).await, 200);
    assert_eq!(status(&srv, "GET", "/v1/queues/default/commands", Some(READER), None).await, 200);
    assert_eq!(status(&srv, "GET", "/v1/queues/other/commands", Some(READER), None).await, 403);
    assert_eq!(status(&srv, "GET", "/v1/queues/other", Some(READER), None).await, 403);
    // The queue listing shows only the queues a token may read.
    let v: Value = send(&srv, "GET", "/v1/queues", Some(READER), None)
        .await
        .text()
        .await
        .map(|t| serde_json::from_str::<Value>(&t).unwrap())
        .unwrap();
    let names: Vec<&str> = v["queues"].as_array().unwrap().iter().map(|q| q["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["default"]);
    let v: Value = send(&srv, "GET", "/v1/queues", Some(ADMIN), None)
        .await
        .text()
        .await
        .map(|t| serde_json::from_str::<Value>(&t).unwrap())
        .unwrap();
    assert_eq!(v["queues"].as_array().unwrap().len(), 2);
    // Dead letters: reading is read, replay and purge are admin.
    assert_eq!(status(&srv, "GET", "/v1/queues/default/dead-letters", Some(READER), None).await, 200);
    assert_eq!(status(&srv, "DELETE", "/v1/queues/default/dead-letters", Some(WRITER), None).await, 403);
    assert_eq!(status(&srv, "POST", "/v1/queues/default/dead-letters/replay", Some(WRITER), None).await, 403);
    assert_eq!(status(&srv, "POST", "/v1/queues/default/dead-letters/1-0/replay", Some(WRITER), None).await, 403);
    assert_eq!(status(&srv, "DELETE", "/v1/queues/default/dead-letters", Some(ADMIN), None).await, 200);
    assert_eq!(status(&srv, "POST", "/v1/queues/default/dead-letters/1-0/replay", Some(ADMIN), None).await, 404);
    // CORS preflights pass without a token.
    let res = client()
        .request(reqwest::Method::OPTIONS, format!("{}/v1/queues", srv.base))
        .header("origin", "http://example.com")
        .header("access-control-request-method", "GET")
        .header("access-control-request-headers", "authorization")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_token_for_event_source_is_never_logged() {
    let logs = capture_logs();
    let srv = secured().await;
    let url = |p: &str| format!("{}{p}", srv.base);
    let res = client()
        .put(url("/v1/stream/acme/w/live"))
        .bearer_auth(WRITER)
        .header("content-type", "text/plain")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    let res = client()
        .post(url("/v1/stream/acme/w/live"))
        .bearer_auth(WRITER)
        .header("content-type", "text/plain")
        .body("hello")
        .send()
        .await
        .unwrap();
    assert!(res.status().is_success());
    // EventSource cannot set headers: the token rides in the query and the read works.
    let res = client()
        .get(url(&format!("/v1/stream/acme/w/live?offset=-1&live=sse&access_token={READER}")))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let (text, _) = read_sse_until(res, Duration::from_secs(5), |t| t.contains("event: control")).await;
    assert!(text.contains("hello"), "{text}");
    // A wrong query token is 401; a query token outside the scope is 403.
    assert_eq!(
        client().get(url("/v1/stream/acme/w/live?access_token=wrong-token-xxxxxxxx")).send().await.unwrap().status(),
        401
    );
    assert_eq!(
        client().get(url(&format!("/v1/stream/zzz/a?access_token={READER}"))).send().await.unwrap().status(),
        403
    );
    // A command read with the token in the query (and the query otherwise valid).
    assert_eq!(
        client().get(url(&format!("/v1/commands/none?access_token={READER}&wait=1ms"))).send().await.unwrap().status(),
        404
    );
    srv.stop().await;
    let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    assert!(!text.is_empty(), "the capture saw no logs at all");
    for secret in [READER, WRITER, ADMIN] {
        assert!(!text.contains(secret), "a token appeared in the logs");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_tokens_means_open() {
    let srv = start(TestBackend::Memory, |c| c.queues = baton::settings::default_queues()).await;
    assert_eq!(status(&srv, "PUT", "/v1/stream/a/b", None, None).await, 201);
    assert_eq!(status(&srv, "POST", "/v1/queues/default/commands", None, Some(json!({"type": "echo"}))).await, 202);
    assert_eq!(status(&srv, "DELETE", "/v1/queues/default/dead-letters", None, None).await, 200);
    let v: Value = client()
        .get(format!("{}/", srv.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .map(|t| serde_json::from_str::<Value>(&t).unwrap())
        .unwrap();
    assert_eq!(v["auth"], "none");
    srv.stop().await;
}

/// More than one credential is refused with 400, whichever would have won: two `Authorization`
/// headers (even two valid ones), `access_token` twice, or both forms at once; one credential
/// still works, and public routes never look at credentials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_than_one_credential_is_refused() {
    let srv = secured().await;
    let c = client();
    let url = format!("{}/v1/queues", srv.base);
    let two_headers = c
        .get(&url)
        .header("authorization", format!("Bearer {ADMIN}"))
        .header("authorization", format!("Bearer {READER}"))
        .send()
        .await
        .unwrap();
    let twice = c.get(format!("{url}?access_token={READER}&access_token={ADMIN}")).send().await.unwrap();
    let both = c.get(format!("{url}?access_token={READER}")).bearer_auth(READER).send().await.unwrap();
    for (what, r) in [("two headers", two_headers), ("access_token twice", twice), ("both", both)] {
        assert_eq!(r.status(), 400, "{what}");
        let v: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
        assert_eq!(v["error"], "duplicate_credentials", "{what}: {v}");
        assert!(!v["message"].as_str().unwrap().contains(READER), "{what}: the token is echoed: {v}");
    }
    assert_eq!(status(&srv, "GET", "/v1/queues", Some(READER), None).await, 200);
    assert_eq!(c.get(format!("{url}?access_token={READER}")).send().await.unwrap().status(), 200);
    let r = c
        .get(format!("{}/healthz", srv.base))
        .header("authorization", "Bearer a")
        .header("authorization", "Bearer b")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    srv.stop().await;
}
