//! Limits, bad input, CORS, security headers and graceful shutdown of `baton serve`
//! (independent of the backend, so on the in-memory one).

use crate::common;

use std::time::{Duration, Instant};

use baton_testkit::TestBackend;
use common::*;
use reqwest::StatusCode;

/// Sends one request line with an empty body over a raw socket; returns the response text.
async fn raw_request(addr: std::net::SocketAddr, request_line: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("{request_line}\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    sock.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    sock.read_to_end(&mut out).await.unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

async fn error_code(r: reqwest::Response) -> String {
    let v: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    v["error"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_header_and_path_limits() {
    let srv = start(TestBackend::Memory, |c| {
        c.max_body = 1024;
        c.max_header_bytes = 2048;
    })
    .await;
    let c = client();
    let url = srv.url("acme/limits");
    assert_eq!(c.put(&url).header("content-type", "text/plain").send().await.unwrap().status(), StatusCode::CREATED);

    // 413 for a body over --max-body, on append and on create; exactly the limit is fine.
    let r = c.post(&url).header("content-type", "text/plain").body(vec![b'x'; 1025]).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(error_code(r).await, "body_too_large");
    let r = c.put(srv.url("acme/limits-big")).body(vec![b'x'; 4096]).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(c.head(srv.url("acme/limits-big")).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    let r = c.post(&url).header("content-type", "text/plain").body(vec![b'x'; 1024]).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    // A chunked body (no Content-Length) over the limit is refused too.
    let chunks = futures::stream::iter((0..4).map(|_| Ok::<_, std::io::Error>(vec![b'y'; 400])));
    let r = c
        .post(&url)
        .header("content-type", "text/plain")
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(c.get(&url).send().await.unwrap().text().await.unwrap().len(), 1024);

    // 431 for oversized headers.
    let r = c.get(&url).header("x-padding", "p".repeat(4096)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    assert_eq!(header(&r, "x-content-type-options"), Some("nosniff"));

    // 400 for paths that could escape their scope or alias another path or the control namespace.
    // (Sent raw: HTTP client libraries normalise `%2e%2e` away before sending.)
    for bad in [
        "acme/%2e%2e/other",
        "acme/..",
        "acme/..%2Fother",
        "acme/a%2Fb",
        "acme/a%5Cb",
        "acme/%00",
        "__ds/subscriptions/x",
        "acme//x",
        "acme/%zz",
    ] {
        let head = raw_request(srv.server.as_ref().unwrap().addr(), &format!("PUT /v1/stream/{bad} HTTP/1.1")).await;
        assert!(head.starts_with("HTTP/1.1 400"), "{bad}: {head}");
        assert!(head.to_ascii_lowercase().contains("content-type: application/json"), "{bad}: {head}");
    }
    assert_eq!(c.head(srv.url("other")).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    let r = c.get(format!("{}/v1/stream/", srv.base)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    // Percent-encoded ordinary characters are fine and name the decoded path.
    let r = c.put(srv.url("acme/with%20space")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(c.head(srv.url("acme/with space")).send().await.unwrap().status(), StatusCode::OK);

    // Header validation with messages.
    let r = c.put(srv.url("acme/ttl")).header("stream-ttl", "03600").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert!(r.text().await.unwrap().contains("Stream-TTL"));
    let r = c.put(srv.url("acme/ttl")).header("baton-silence-timeout", "soon").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = c.get(format!("{url}?live=sse")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert!(r.text().await.unwrap().contains("offset=-1"));
    let r = c.patch(&url).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_live_readers_get_503_with_retry_after() {
    let srv = start(TestBackend::Memory, |c| c.max_live_readers = 2).await;
    let c = client();
    let url = srv.url("acme/readers");
    c.put(&url).header("content-type", "text/plain").send().await.unwrap();
    let sse1 = c.get(format!("{url}?offset=-1&live=sse")).send().await.unwrap();
    let sse2 = c.get(format!("{url}?offset=-1&live=sse")).send().await.unwrap();
    assert_eq!((sse1.status(), sse2.status()), (StatusCode::OK, StatusCode::OK));
    let r = c.get(format!("{url}?offset=-1&live=long-poll")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&r, "retry-after"), Some("2"));
    assert_eq!(error_code(r).await, "too_many_live_readers");
    let r = c.get(format!("{url}?offset=-1&live=sse")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    // Catch-up reads are not limited.
    assert_eq!(c.get(&url).send().await.unwrap().status(), StatusCode::OK);
    // A reader that leaves frees its slot (noticed at once, not at the next heartbeat).
    drop(sse1);
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let r = c.get(format!("{url}?offset=now&live=long-poll")).send().await.unwrap();
        if r.status() == StatusCode::NO_CONTENT {
            break;
        }
        assert!(Instant::now() < deadline, "slot not freed: {}", r.status());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(sse2);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_and_security_headers() {
    let srv = start(TestBackend::Memory, |c| c.cors_origins = Some(vec!["https://app.example".into()])).await;
    let c = client();
    let url = srv.url("acme/cors");
    let r = c
        .request(reqwest::Method::OPTIONS, &url)
        .header("origin", "https://app.example")
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "if-none-match, producer-id, stream-closed")
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    assert_eq!(header(&r, "access-control-allow-origin"), Some("https://app.example"));
    let allowed = header(&r, "access-control-allow-headers").unwrap().to_ascii_lowercase();
    assert!(allowed.contains("if-none-match") && allowed.contains("producer-id"), "{allowed}");
    let r = c.put(&url).header("origin", "https://app.example").send().await.unwrap();
    let exposed = header(&r, "access-control-expose-headers").unwrap().to_ascii_lowercase();
    assert!(exposed.contains("stream-next-offset") && exposed.contains("etag"), "{exposed}");
    let r = c.get(&url).header("origin", "https://evil.example").send().await.unwrap();
    assert_eq!(header(&r, "access-control-allow-origin"), None);
    // `/` answers HTML (the dashboard) or JSON by Accept, so both say `Vary: accept`.
    let base = url.split("/v1/").next().unwrap().to_string();
    let r = c.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(header(&r, "vary"), Some("accept"));
    let r = c.get(format!("{base}/")).header("accept", "text/html").send().await.unwrap();
    assert_eq!(header(&r, "vary"), Some("accept"));
    let r = c.get(srv.url("acme/missing")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    assert_eq!(header(&r, "x-content-type-options"), Some("nosniff"));
    assert_eq!(header(&r, "cross-origin-resource-policy"), Some("cross-origin"));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_ends_live_reads() {
    let mut srv = start(TestBackend::Memory, |c| c.long_poll_timeout = Duration::from_secs(30)).await;
    let c = client();
    let url = srv.url("acme/shutdown");
    c.put(&url).header("content-type", "text/plain").body("a").send().await.unwrap();
    let sse = c.get(format!("{url}?offset=-1&live=sse")).send().await.unwrap();
    assert_eq!(sse.status(), StatusCode::OK);
    let sse = tokio::spawn(read_sse_until(sse, Duration::from_secs(10), |_| false));
    let lp = {
        let (c, u) = (c.clone(), format!("{url}?offset=now&live=long-poll"));
        tokio::spawn(async move {
            c.get(u).send().await.map(|r| (r.status(), header(&r, "stream-up-to-date").map(str::to_string)))
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t0 = Instant::now();
    srv.server.take().unwrap().shutdown().await;
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(2), "shutdown took {took:?}");
    let (text, ended) = sse.await.unwrap();
    assert!(ended, "SSE connection not ended by shutdown");
    assert!(text.contains("event: data"), "{text}");
    let (status, up_to_date) = lp.await.unwrap().expect("long-poll answered, not cut");
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(up_to_date.as_deref(), Some("true"));
    assert!(c.get(&url).send().await.is_err(), "server still accepting after shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_heartbeats_then_cycles_the_connection() {
    let srv = start(TestBackend::Memory, |c| {
        c.sse_heartbeat = Duration::from_millis(200);
        c.sse_cycle = Duration::from_millis(1000);
    })
    .await;
    let c = client();
    let url = srv.url("acme/cycle");
    c.put(&url).header("content-type", "text/plain").body("a").send().await.unwrap();
    let t0 = Instant::now();
    let r = c.get(format!("{url}?offset=-1&live=sse")).send().await.unwrap();
    let (text, ended) = read_sse_until(r, Duration::from_secs(5), |_| false).await;
    let took = t0.elapsed();
    assert!(ended, "connection not cycled: {text}");
    // Browsers are asked to reconnect after 500 ms, not their default of about 3 s.
    assert!(text.starts_with("retry: 500\n\n"), "{text:?}");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_millis(2500), "cycled after {took:?}");
    // Every heartbeat follows an event (the body starts with `retry:`), as `\n:\n\n`.
    let heartbeats = text.matches("\n:\n\n").count();
    assert!((3..=5).contains(&heartbeats), "{heartbeats} heartbeats in {text:?}");
    // The last control event names the offset to reconnect from.
    let events = sse_events(&text);
    let control: serde_json::Value = serde_json::from_str(&events.last().unwrap().1).unwrap();
    let r = c.get(format!("{url}?offset={}", control["streamNextOffset"].as_str().unwrap())).send().await.unwrap();
    assert_eq!(header(&r, "stream-up-to-date"), Some("true"));
    assert_eq!(r.text().await.unwrap(), "");
    srv.stop().await;
}

/// Headers within `max_header_bytes` pass however many fields they are (hyper's own limit of
/// 100 fields answered an empty 431 before); over the limit, the 431 is JSON. The JSON routes say
/// what they need when given another content type (415); `+json` and parameters are fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_fields_and_content_types() {
    let srv = start(TestBackend::Memory, |c| c.queues = baton::settings::default_queues()).await;
    let c = client();
    let with_fields = |n: usize| {
        let mut rb = c.get(format!("{}/healthz", srv.base));
        for i in 0..n {
            rb = rb.header(format!("x-field-{i}"), "v");
        }
        rb
    };
    let r = with_fields(150).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK, "150 small fields are within 16KiB");
    let r = with_fields(400).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK, "400 small fields are within 16KiB");
    let r = c.get(format!("{}/healthz", srv.base)).header("x-padding", "p".repeat(20_000)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    assert_eq!(header(&r, "content-type"), Some("application/json"));
    assert_eq!(error_code(r).await, "headers_too_large");
    let mut rb = c.get(format!("{}/healthz", srv.base));
    for i in 0..300 {
        rb = rb.header(format!("x-field-{i}"), "v".repeat(60));
    }
    let r = rb.send().await.unwrap();
    assert_eq!(r.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "300 fields of 70 bytes: over 16KiB");
    assert_eq!(error_code(r).await, "headers_too_large");

    let submit = format!("{}/v1/queues/default/commands", srv.base);
    for ct in ["application/json; charset=utf-8", "application/vnd.example+json", "APPLICATION/JSON"] {
        let r = c.post(&submit).header("content-type", ct).body(r#"{"type": "echo"}"#).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::ACCEPTED, "{ct}");
    }
    let r = c.post(&submit).body(r#"{"type": "echo"}"#).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED, "no Content-Type: read as JSON");
    for ct in ["text/plain", "application/x-www-form-urlencoded", "application/jsonx"] {
        let r = c.post(&submit).header("content-type", ct).body(r#"{"type": "echo"}"#).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE, "{ct}");
        let v: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
        assert_eq!(v["error"], "unsupported_media_type");
        assert!(v["message"].as_str().unwrap().contains("Content-Type: application/json"), "{v}");
    }
    // Stream appends take any content type (the stream's own).
    let url = srv.url("acme/ct");
    assert_eq!(c.put(&url).header("content-type", "text/csv").send().await.unwrap().status(), StatusCode::CREATED);
    let r = c.post(&url).header("content-type", "text/csv").body("a,b\n").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    srv.stop().await;
}

/// A value of the request repeated in an error message is cut to 100 characters (a
/// 100,000-character id came back whole before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoed_values_are_cut() {
    let srv = start(TestBackend::Memory, |c| {
        c.queues = baton::settings::default_queues();
        c.max_command_body = 1 << 20;
    })
    .await;
    let c = client();
    let long = "i".repeat(100_000);
    let submit = format!("{}/v1/queues/default/commands", srv.base);
    let body = serde_json::json!({ "id": long, "type": "echo" }).to_string();
    let cases = [
        c.post(&submit).header("content-type", "application/json").body(body),
        c.get(format!("{}/v1/commands/{}", srv.base, &long[..20_000])),
        c.get(format!("{submit}?{}=1", &long[..20_000])),
        c.get(format!("{}/v1/queues/{}", srv.base, &long[..20_000])),
        c.get(format!("{}?offset={}", srv.url("acme/nope"), &long[..20_000])),
        c.get(format!("{submit}?status={}", &long[..20_000])),
    ];
    for rb in cases {
        let r = rb.send().await.unwrap();
        let status = r.status();
        assert!(status.is_client_error(), "{status}");
        let v: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
        let m = v["message"].as_str().unwrap();
        assert!(m.len() < 400, "{status}: {} bytes: {}…", m.len(), &m[..200]);
        assert!(m.contains("iiii"), "{status}: {m}");
    }
    srv.stop().await;
}

/// `/readyz` answers a JSON 503 (`not_ready`, `Retry-After`) when the backend is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_json_when_not_ready() {
    baton_testkit::require_redis();
    let mut srv = start(backend("standalone"), |_| {}).await;
    let c = client();
    assert_eq!(c.get(format!("{}/readyz", srv.base)).send().await.unwrap().status(), StatusCode::OK);
    if let TestBackend::Standalone(redis) = &mut srv.backend {
        redis.kill();
    }
    let r = c.get(format!("{}/readyz", srv.base)).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&r, "content-type"), Some("application/json"));
    assert_eq!(header(&r, "retry-after"), Some("1"));
    let v: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(v["error"], "not_ready");
    assert!(v["message"].as_str().unwrap().contains("store"), "{v}");
    srv.stop().await;
}
