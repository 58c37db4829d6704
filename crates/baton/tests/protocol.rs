//! `baton serve` speaks the Durable Streams protocol with exact statuses, headers and bodies, on
//! every backend (in-memory, Redis standalone, Redis Cluster). One server per backend runs the
//! whole scenario; every stream path is unique.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use reqwest::StatusCode;

/// `MMMMMMMMMMMMMMMM_SSSSSSSSSSSSSSSS_TTTTTTTTTTTT`: position, then the incarnation tag (hex).
fn is_offset(s: &str) -> bool {
    let b = s.as_bytes();
    s.len() == 46
        && b[16] == b'_'
        && b[33] == b'_'
        && b[..33].iter().enumerate().all(|(i, c)| i == 16 || c.is_ascii_digit())
        && b[34..].iter().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
}

async fn scenario(backend_name: &str) {
    let srv = start(backend(backend_name), |_| {}).await;
    let c = client();
    let run = format!("{backend_name}-{}", std::process::id());

    // --- create: 201 with Location, then 200 for the same config, 409 for another.
    let url = srv.url(&format!("acme/{run}/text"));
    let r = c.put(&url).header("content-type", "text/plain").body("ab").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(header(&r, "location"), Some(url.as_str()));
    assert_eq!(header(&r, "content-type"), Some("text/plain"));
    assert_eq!(header(&r, "x-content-type-options"), Some("nosniff"));
    let after_create = header(&r, "stream-next-offset").unwrap().to_string();
    assert!(is_offset(&after_create), "{after_create}");
    let r = c.put(&url).header("content-type", "TEXT/PLAIN").body("ab").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = c.put(&url).header("content-type", "application/json").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CONFLICT);
    let err: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(err["error"], "conflict");

    // --- append: 204 with a strictly greater offset; bad appends say what to fix.
    let r = c.post(&url).header("content-type", "text/plain").body("cd").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    let after_cd = header(&r, "stream-next-offset").unwrap().to_string();
    assert!(after_cd > after_create);
    let r = c.post(&url).header("content-type", "text/plain").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert!(r.text().await.unwrap().contains("Stream-Closed: true"));
    let r = c.post(&url).body("no type").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert!(r.text().await.unwrap().contains("Content-Type"));
    let r = c.post(&url).header("content-type", "application/json").body("{}").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CONFLICT);

    // --- catch-up: whole stream, from an offset, ETag / 304, offset=now, malformed offsets.
    let r = c.get(&url).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(header(&r, "stream-up-to-date"), Some("true"));
    assert_eq!(header(&r, "stream-next-offset"), Some(after_cd.as_str()));
    assert_eq!(header(&r, "cache-control"), Some("private, max-age=60, stale-while-revalidate=300"));
    let etag = header(&r, "etag").unwrap().to_string();
    assert_eq!(r.text().await.unwrap(), "abcd");
    let r = c.get(&url).header("if-none-match", &etag).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_MODIFIED);
    let r = c.get(format!("{url}?offset={after_create}")).send().await.unwrap();
    assert_eq!(r.text().await.unwrap(), "cd");
    let r = c.get(format!("{url}?offset=now")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(header(&r, "cache-control"), Some("no-store"));
    assert_eq!(header(&r, "stream-next-offset"), Some(after_cd.as_str()));
    assert_eq!(r.text().await.unwrap(), "");
    for bad in ["0,1", "abc", "", "-2"] {
        let r = c.get(format!("{url}?offset={bad}")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "offset {bad:?}");
    }
    let r = c.get(format!("{url}?offset=-1&offset=-1")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);

    // --- long-poll: 204 at the tail after the timeout; woken early by an append.
    let t0 = Instant::now();
    let r = c.get(format!("{url}?offset={after_cd}&live=long-poll")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    assert!(t0.elapsed() >= Duration::from_millis(600), "{:?}", t0.elapsed());
    assert_eq!(header(&r, "stream-up-to-date"), Some("true"));
    assert_eq!(header(&r, "stream-next-offset"), Some(after_cd.as_str()));
    assert!(header(&r, "stream-cursor").unwrap().bytes().all(|b| b.is_ascii_digit()));
    let lp = {
        let (c, u) = (c.clone(), format!("{url}?offset=now&live=long-poll"));
        tokio::spawn(async move {
            let t0 = Instant::now();
            let r = c.get(u).send().await.unwrap();
            let status = r.status();
            (status, r.text().await.unwrap(), t0.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let r = c.post(&url).header("content-type", "text/plain").body("ef").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    let after_ef = header(&r, "stream-next-offset").unwrap().to_string();
    let (status, body, took) = lp.await.unwrap();
    assert_eq!((status, body.as_str()), (StatusCode::OK, "ef"));
    assert!(took < Duration::from_millis(650), "long-poll woke after {took:?}");

    // --- SSE: catch-up data + control, then live data with newlines split into data: lines.
    let r = c.get(format!("{url}?offset=-1&live=sse")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(header(&r, "content-type"), Some("text/event-stream"));
    assert_eq!(header(&r, "stream-sse-data-encoding"), None);
    // Read to the end: the server must end the connection after the final control event.
    let sse = tokio::spawn(read_sse_until(r, Duration::from_secs(10), |_| false));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = c.post(&url).header("content-type", "text/plain").body("g\nh").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    let after_gh = header(&r, "stream-next-offset").unwrap().to_string();
    // Close with the Baton end-reason extension.
    let r = c.post(&url).header("stream-closed", "true").header("baton-end-reason", "cancelled").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    assert_eq!(header(&r, "stream-closed"), Some("true"));
    assert_eq!(header(&r, "baton-end-reason"), Some("cancelled"));
    let (text, ended) = sse.await.unwrap();
    assert!(ended, "the SSE connection stays open after the stream closed: {text}");
    let events = sse_events(&text);
    let kinds: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    // The close may reach the reader with the last data (one control) or after it (two).
    assert!(
        kinds == ["data", "control", "data", "control", "control"] || kinds == ["data", "control", "data", "control"],
        "{text}"
    );
    assert_eq!(events[0].1, "abcdef");
    assert_eq!(events[2].1, "g\nh");
    let c1: serde_json::Value = serde_json::from_str(&events[1].1).unwrap();
    assert_eq!(c1["streamNextOffset"], after_ef.as_str());
    assert_eq!(c1["upToDate"], true);
    assert_eq!(events[1].2.as_deref(), Some(after_ef.as_str()));
    let last: serde_json::Value = serde_json::from_str(&events.last().unwrap().1).unwrap();
    assert_eq!(last["streamClosed"], true);
    assert_eq!(last["batonEndReason"], "cancelled");
    assert_eq!(last["streamNextOffset"], after_gh.as_str());
    assert!(last.get("streamCursor").is_none());

    // --- closed: HEAD says so; appends get 409 with the final offset; close-only is idempotent.
    let r = c.head(&url).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(header(&r, "stream-closed"), Some("true"));
    assert_eq!(header(&r, "baton-end-reason"), Some("cancelled"));
    assert_eq!(header(&r, "cache-control"), Some("no-store"));
    let r = c.post(&url).header("content-type", "text/plain").body("late").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CONFLICT);
    assert_eq!(header(&r, "stream-closed"), Some("true"));
    assert_eq!(header(&r, "stream-next-offset"), Some(after_gh.as_str()));
    let r = c.post(&url).header("stream-closed", "true").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    let r = c.get(format!("{url}?offset={after_gh}&live=long-poll")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    assert_eq!(header(&r, "stream-closed"), Some("true"));
    assert_eq!(header(&r, "stream-cursor"), None);

    // --- EventSource resume: Last-Event-ID wins over the URL offset; at the end, 204 stops it.
    let r = c.get(format!("{url}?offset=-1&live=sse")).header("last-event-id", &after_ef).send().await.unwrap();
    // Read until the server ends the connection (it must, after the final control event).
    let (text, ended) = read_sse_until(r, Duration::from_secs(5), |_| false).await;
    assert!(ended, "the SSE connection stays open after EOF: {text}");
    let events = sse_events(&text);
    assert_eq!(events[0].1, "g\nh", "{text}");
    assert!(!text.contains("abcdef"));
    // The final control event's id marks the end; a browser that saw it is stopped with 204.
    let last_id = text.lines().filter_map(|l| l.strip_prefix("id:")).next_back().unwrap().trim().to_string();
    assert_eq!(last_id, format!("{after_gh}.end"));
    let r = c.get(format!("{url}?offset=-1&live=sse")).header("last-event-id", &last_id).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    // One that reconnects at the final offset without having seen the end (its connection was
    // cycled between the last data and the close) still gets the final control event.
    let r = c.get(format!("{url}?offset=-1&live=sse")).header("last-event-id", &after_gh).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let (text, ended) = read_sse_until(r, Duration::from_secs(5), |_| false).await;
    assert!(ended, "{text}");
    let events = sse_events(&text);
    assert_eq!(events.len(), 1, "{text}");
    let control: serde_json::Value = serde_json::from_str(&events[0].1).unwrap();
    assert_eq!(control["streamClosed"], true);
    assert_eq!(control["streamNextOffset"], after_gh.as_str());

    // --- idempotent producers.
    let purl = srv.url(&format!("acme/{run}/producer"));
    assert_eq!(c.put(&purl).header("content-type", "text/plain").send().await.unwrap().status(), StatusCode::CREATED);
    let send = |epoch: u64, seq: u64, body: &'static str| {
        c.post(&purl)
            .header("content-type", "text/plain")
            .header("producer-id", "p1")
            .header("producer-epoch", epoch.to_string())
            .header("producer-seq", seq.to_string())
            .body(body)
            .send()
    };
    let r = send(0, 0, "x").await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!((header(&r, "producer-epoch"), header(&r, "producer-seq")), (Some("0"), Some("0")));
    assert_eq!(send(0, 0, "x").await.unwrap().status(), StatusCode::NO_CONTENT);
    let r = send(0, 2, "z").await.unwrap();
    assert_eq!(r.status(), StatusCode::CONFLICT);
    assert_eq!((header(&r, "producer-expected-seq"), header(&r, "producer-received-seq")), (Some("1"), Some("2")));
    assert_eq!(send(1, 0, "y").await.unwrap().status(), StatusCode::OK);
    let r = send(0, 1, "zombie").await.unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    assert_eq!(header(&r, "producer-epoch"), Some("1"));
    let r =
        c.post(&purl).header("content-type", "text/plain").header("producer-id", "p1").body("q").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_eq!(c.get(&purl).send().await.unwrap().text().await.unwrap(), "xy");

    // --- JSON mode: one level of flattening, [] refused, reads are one array.
    let jurl = srv.url(&format!("acme/{run}/json"));
    let r = c.put(&jurl).header("content-type", "application/json").body("[]").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let r = c.post(&jurl).header("content-type", "application/json").body(r#"[{"a":1},[2,3]]"#).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    assert_eq!(
        c.post(&jurl).header("content-type", "application/json").body("[]").send().await.unwrap().status(),
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        c.post(&jurl).header("content-type", "application/json").body("{nope").send().await.unwrap().status(),
        StatusCode::BAD_REQUEST
    );
    assert_eq!(c.get(&jurl).send().await.unwrap().text().await.unwrap(), r#"[{"a":1},[2,3]]"#);
    let r = c.get(format!("{jurl}?offset=now")).send().await.unwrap();
    assert_eq!(r.text().await.unwrap(), "[]");

    // --- binary SSE is base64.
    let burl = srv.url(&format!("acme/{run}/bin"));
    c.put(&burl).header("content-type", "application/octet-stream").body(vec![0u8, 255, 10, 13]).send().await.unwrap();
    let r = c.get(format!("{burl}?offset=-1&live=sse")).send().await.unwrap();
    assert_eq!(header(&r, "stream-sse-data-encoding"), Some("base64"));
    let (text, _) = read_sse_until(r, Duration::from_secs(5), |t| t.contains("upToDate")).await;
    assert_eq!(sse_events(&text)[0].1, "AP8KDQ==");

    // --- forks inherit data up to the fork point, then diverge.
    let furl = srv.url(&format!("acme/{run}/fork"));
    let r = c.put(&furl).header("stream-forked-from", format!("/v1/stream/acme/{run}/producer")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(header(&r, "content-type"), Some("text/plain"));
    c.post(&furl).header("content-type", "text/plain").body("F").send().await.unwrap();
    assert_eq!(c.get(&furl).send().await.unwrap().text().await.unwrap(), "xyF");
    assert_eq!(c.get(&purl).send().await.unwrap().text().await.unwrap(), "xy");

    // --- delete: 204, then 404 everywhere.
    assert_eq!(c.delete(&jurl).send().await.unwrap().status(), StatusCode::NO_CONTENT);
    assert_eq!(c.get(&jurl).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    assert_eq!(c.head(&jurl).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    assert_eq!(c.delete(&jurl).send().await.unwrap().status(), StatusCode::NOT_FOUND);

    // --- health.
    assert_eq!(c.get(format!("{}/healthz", srv.base)).send().await.unwrap().status(), StatusCode::OK);
    assert_eq!(c.get(format!("{}/readyz", srv.base)).send().await.unwrap().status(), StatusCode::OK);
    let m = c.get(format!("{}/metrics", srv.base)).send().await.unwrap().text().await.unwrap();
    assert!(m.contains("baton_http_requests_total"), "{m}");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_on_memory() {
    scenario("memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_on_redis_standalone() {
    scenario("standalone").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_on_redis_cluster() {
    scenario("cluster").await;
}

/// Run semantics as extension headers: a per-stream silence timeout ends a silent stream as
/// `producer_lost`; `Baton-Keepalive` keeps it open without adding data.
async fn silence(backend_name: &str) {
    let srv = start(backend(backend_name), |_| {}).await;
    let c = client();
    let url = srv.url(&format!("acme/silence-{backend_name}-{}", std::process::id()));
    let r =
        c.put(&url).header("content-type", "text/plain").header("baton-silence-timeout", "1s").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let r = c.head(&url).send().await.unwrap();
    assert_eq!(header(&r, "baton-silence-timeout"), Some("1s"));
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let r = c.post(&url).header("baton-keepalive", "true").send().await.unwrap();
        assert_eq!(r.status(), StatusCode::NO_CONTENT);
    }
    let r = c.head(&url).send().await.unwrap();
    assert_eq!(header(&r, "stream-closed"), None, "kept alive for 1.6 s with a 1 s silence timeout");
    assert_eq!(c.get(&url).send().await.unwrap().text().await.unwrap(), "", "keepalives add no data");
    // Silent now: a live reader sees the end as producer_lost within the timeout plus slack.
    let t0 = Instant::now();
    let r = c.get(format!("{url}?offset=-1&live=sse")).send().await.unwrap();
    let (text, _) = read_sse_until(r, Duration::from_secs(5), |t| t.contains("streamClosed")).await;
    assert!(text.contains(r#""batonEndReason":"producer_lost""#), "{text}");
    assert!(t0.elapsed() < Duration::from_millis(2500), "{:?}", t0.elapsed());
    let r = c.head(&url).send().await.unwrap();
    assert_eq!(header(&r, "baton-end-reason"), Some("producer_lost"));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silence_timeout_on_memory() {
    silence("memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silence_timeout_on_redis_standalone() {
    silence("standalone").await;
}
