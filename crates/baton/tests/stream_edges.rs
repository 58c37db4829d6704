//! The stream edges of issue #14 over HTTP: SSE encoding of text that is not UTF-8, what
//! `Baton-Max-Len` counts, re-creates with other `Baton-*` settings, `Baton-Silence-Timeout: 0s`,
//! `Last-Event-ID: <offset>.end` on a stream that has not ended, offsets of a deleted stream,
//! what a waiting reader gets when its stream is deleted. The backend-level ones run on memory and
//! Redis standalone.

#[path = "stream_edges/closed_break.rs"]
mod closed_break;
use crate::common;
use closed_break::closed_tokens_of_ended_streams;

use std::time::Duration;

use base64::Engine as _;
use common::*;
use reqwest::StatusCode;
use serde_json::Value;

fn unique(name: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!("edges/{name}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

async fn error_of(r: reqwest::Response) -> (StatusCode, Value) {
    let status = r.status();
    (status, serde_json::from_str(&r.text().await.unwrap()).unwrap())
}

/// The data of the `data` events, base64-decoded.
fn base64_data(text: &str) -> Vec<u8> {
    let b64 = base64::engine::general_purpose::STANDARD;
    sse_events(text).iter().filter(|e| e.0 == "data").flat_map(|e| b64.decode(e.1.trim()).unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_carries_text_that_is_not_utf8_as_base64() {
    let srv = start(backend("memory"), |_| {}).await;
    let c = client();
    // A Latin-1 stream: `é` is the byte 0xE9.
    let url = srv.url(&unique("latin1"));
    let ct = "text/plain; charset=iso-8859-1";
    assert_eq!(c.put(&url).header("content-type", ct).send().await.unwrap().status(), StatusCode::CREATED);
    c.post(&url).header("content-type", ct).body(b"caf\xE9".to_vec()).send().await.unwrap();
    let r = c.get(format!("{url}?offset=-1&live=sse")).send().await.unwrap();
    assert_eq!(header(&r, "stream-sse-data-encoding"), Some("base64"));
    let (text, _) = read_sse_until(r, Duration::from_secs(5), |t| t.contains("upToDate")).await;
    assert_eq!(base64_data(&text), b"caf\xE9");
    // UTF-8 text stays text.
    let utf8 = srv.url(&unique("utf8"));
    c.put(&utf8).header("content-type", "text/plain; charset=UTF-8").send().await.unwrap();
    c.post(&utf8).header("content-type", "text/plain").body("café").send().await.unwrap();
    let r = c.get(format!("{utf8}?offset=-1&live=sse")).send().await.unwrap();
    assert_eq!(header(&r, "stream-sse-data-encoding"), None);
    let (text, _) = read_sse_until(r, Duration::from_secs(5), |t| t.contains("upToDate")).await;
    assert!(text.contains("data:café\n"), "{text}");
    // A character split over two appends is still text (the batch is valid UTF-8).
    let split = srv.url(&unique("split"));
    c.put(&split).header("content-type", "text/plain").send().await.unwrap();
    let e_acute = "é".as_bytes();
    c.post(&split).header("content-type", "text/plain").body(vec![b'x', e_acute[0]]).send().await.unwrap();
    c.post(&split).header("content-type", "text/plain").body(vec![e_acute[1]]).send().await.unwrap();
    let r = c.get(format!("{split}?offset=-1&live=sse")).send().await.unwrap();
    assert_eq!(header(&r, "stream-sse-data-encoding"), None);
    let (text, _) = read_sse_until(r, Duration::from_secs(5), |t| t.contains("upToDate")).await;
    assert!(text.contains("data:xé\n"), "{text}");
    // A `text/plain` stream holding bytes that are not UTF-8: base64 from the start...
    let raw = srv.url(&unique("raw"));
    c.put(&raw).header("content-type", "text/plain").send().await.unwrap();
    c.post(&raw).header("content-type", "text/plain").body(vec![b'a', 0xFF, 0xFE]).send().await.unwrap();
    let r = c.get(format!("{raw}?offset=-1&live=sse")).send().await.unwrap();
    assert_eq!(header(&r, "stream-sse-data-encoding"), Some("base64"));
    let (text, _) = read_sse_until(r, Duration::from_secs(5), |t| t.contains("upToDate")).await;
    assert_eq!(base64_data(&text), vec![b'a', 0xFF, 0xFE]);
    // ... and a text connection that meets such bytes live ends before them: the reconnect from
    // its last control event gets them base64, none replaced.
    let live = srv.url(&unique("live"));
    c.put(&live).header("content-type", "text/plain").body("ok").send().await.unwrap();
    let r = c.get(format!("{live}?offset=-1&live=sse")).send().await.unwrap();
    assert_eq!(header(&r, "stream-sse-data-encoding"), None);
    let reader = tokio::spawn(read_sse_until(r, Duration::from_secs(5), |_| false));
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.post(&live).header("content-type", "text/plain").body(vec![0xE9]).send().await.unwrap();
    let (text, ended) = reader.await.unwrap();
    assert!(ended, "the server ends the text connection: {text}");
    assert!(!text.contains('\u{FFFD}'), "{text}");
    let last = sse_events(&text).into_iter().filter_map(|e| e.2).next_back().unwrap();
    let r = c.get(format!("{live}?offset={last}&live=sse")).send().await.unwrap();
    assert_eq!(header(&r, "stream-sse-data-encoding"), Some("base64"));
    let (text, _) = read_sse_until(r, Duration::from_secs(5), |t| t.contains("upToDate")).await;
    assert_eq!(base64_data(&text), vec![0xE9]);
    srv.stop().await;
}

/// `Last-Event-ID: <offset>.end` gets 204 only from a stream that ended at that offset;
/// otherwise the read resumes from the offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_event_id_end_suffix_on_a_stream_that_has_not_ended() {
    let srv = start(backend("memory"), |_| {}).await;
    let c = client();
    let url = srv.url(&unique("end-suffix"));
    let r = c.put(&url).header("content-type", "text/plain").body("a").send().await.unwrap();
    let first = header(&r, "stream-next-offset").unwrap().to_string();
    c.post(&url).header("content-type", "text/plain").body("b").send().await.unwrap();
    let sse = format!("{url}?offset=-1&live=sse");
    let r = c.get(&sse).header("last-event-id", format!("{first}.end")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK, "not ended: resume, not 204");
    let (text, _) = read_sse_until(r, Duration::from_secs(5), |t| t.contains("upToDate")).await;
    let data: Vec<_> = sse_events(&text).into_iter().filter(|e| e.0 == "data").map(|e| e.1).collect();
    assert_eq!(data, ["b"]);
    // Ended, but later than that offset: the rest and the final control event.
    let r = c.post(&url).header("stream-closed", "true").send().await.unwrap();
    let last = header(&r, "stream-next-offset").unwrap().to_string();
    let r = c.get(&sse).header("last-event-id", format!("{first}.end")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let (text, _) = read_sse_until(r, Duration::from_secs(5), |t| t.contains("streamClosed")).await;
    assert!(text.contains("data:b\n") && text.contains(&format!("id:{last}.end")), "{text}");
    // Ended at that offset: 204 stops the EventSource.
    let r = c.get(&sse).header("last-event-id", format!("{last}.end")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    srv.stop().await;
}

/// `Baton-Max-Len` counts messages: JSON array elements each count.
async fn max_len_counts_messages(srv: &TestServer) {
    let c = client();
    let url = srv.url(&unique("max-len"));
    let r = c.put(&url).header("content-type", "application/json").header("baton-max-len", "3").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let post = |body: &'static str| c.post(&url).header("content-type", "application/json").body(body).send();
    assert_eq!(post("[1,2]").await.unwrap().status(), StatusCode::NO_CONTENT);
    let (status, err) = error_of(post("[3,4]").await.unwrap()).await;
    assert_eq!((status, err["error"].as_str()), (StatusCode::PAYLOAD_TOO_LARGE, Some("max_len")));
    assert!(err["message"].as_str().unwrap().contains("3 messages per stream"), "{err}");
    assert_eq!(post("3").await.unwrap().status(), StatusCode::NO_CONTENT);
    assert_eq!(c.get(&url).send().await.unwrap().text().await.unwrap(), "[1,2,3]");
}

/// A PUT with other `Baton-*` settings is a 409 naming the setting; the same ones are a 200.
async fn put_with_other_settings_conflicts(srv: &TestServer) {
    let c = client();
    let url = srv.url(&unique("settings"));
    let put = |sil: &str| {
        c.put(&url)
            .header("content-type", "text/plain")
            .header("baton-silence-timeout", sil.to_string())
            .header("baton-max-len", "10")
            .send()
    };
    assert_eq!(put("1m").await.unwrap().status(), StatusCode::CREATED);
    assert_eq!(put("60s").await.unwrap().status(), StatusCode::OK);
    let (status, err) = error_of(put("30s").await.unwrap()).await;
    assert_eq!((status, err["error"].as_str()), (StatusCode::CONFLICT, Some("conflict")));
    let msg = err["message"].as_str().unwrap();
    assert!(msg.contains("Baton-Silence-Timeout") && msg.contains("it has 60s, the request asks for 30s"), "{msg}");
    let r = c
        .put(&url)
        .header("content-type", "text/plain")
        .header("baton-silence-timeout", "60s")
        .header("baton-max-len", "5")
        .send()
        .await
        .unwrap();
    let (status, err) = error_of(r).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(err["message"].as_str().unwrap().contains("Baton-Max-Len"), "{err}");
    let r = c.head(&url).send().await.unwrap();
    assert_eq!((header(&r, "baton-silence-timeout"), header(&r, "baton-max-len")), (Some("1m"), Some("10")));
    // Without Baton-* headers: a plain protocol re-create, 200.
    assert_eq!(c.put(&url).header("content-type", "text/plain").send().await.unwrap().status(), StatusCode::OK);
}

/// `Baton-Silence-Timeout: 0s` is refused (`none` disables it).
async fn zero_silence_timeout_is_refused(srv: &TestServer) {
    let c = client();
    let url = srv.url(&unique("sil0"));
    let r =
        c.put(&url).header("content-type", "text/plain").header("baton-silence-timeout", "0s").send().await.unwrap();
    let (status, err) = error_of(r).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(err["message"].as_str().unwrap().contains("`none`"), "{err}");
    assert_eq!(c.head(&url).send().await.unwrap().status(), StatusCode::NOT_FOUND);
}

/// `Baton-Max-Run: 0s` (and `0`) is refused: the stream would be deleted as soon as it is created
/// (before this, the `PUT` answered `201` and the stream was gone at once, `404`).
async fn zero_max_run_is_refused(srv: &TestServer) {
    let c = client();
    let url = srv.url(&unique("run0"));
    for zero in ["0s", "0"] {
        let r = c.put(&url).header("content-type", "text/plain").header("baton-max-run", zero).send().await.unwrap();
        let (status, err) = error_of(r).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{zero}: {err}");
        assert!(err["message"].as_str().unwrap().contains("`none`"), "{err}");
        assert_eq!(c.head(&url).send().await.unwrap().status(), StatusCode::NOT_FOUND);
    }
    let r = c.put(&url).header("content-type", "text/plain").header("baton-max-run", "1h").send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(c.head(&url).send().await.unwrap().status(), StatusCode::OK);
}

/// An offset of a deleted stream is refused by the stream re-created at its path.
async fn offsets_of_a_deleted_stream_are_gone(srv: &TestServer) {
    let c = client();
    let url = srv.url(&unique("reincarnated"));
    let r = c.put(&url).header("content-type", "text/plain").body("old-1").send().await.unwrap();
    let old_start = header(&r, "stream-next-offset").unwrap().to_string();
    let r = c.post(&url).header("content-type", "text/plain").body("old-2").send().await.unwrap();
    let old_tail = header(&r, "stream-next-offset").unwrap().to_string();
    assert_eq!(c.get(format!("{url}?offset={old_start}")).send().await.unwrap().text().await.unwrap(), "old-2");
    assert_eq!(c.delete(&url).send().await.unwrap().status(), StatusCode::NO_CONTENT);
    tokio::time::sleep(Duration::from_millis(5)).await;
    let r = c.put(&url).header("content-type", "text/plain").body("new-1").send().await.unwrap();
    let new_start = header(&r, "stream-next-offset").unwrap().to_string();
    c.post(&url).header("content-type", "text/plain").body("new-2").send().await.unwrap();
    for old in [&old_start, &old_tail] {
        for mode in ["", "&live=long-poll", "&live=sse"] {
            let (status, err) = error_of(c.get(format!("{url}?offset={old}{mode}")).send().await.unwrap()).await;
            assert_eq!(status, StatusCode::GONE, "{old}{mode}: {err}");
            assert_eq!(err["error"], "offset_incarnation", "{err}");
            assert!(err["message"].as_str().unwrap().contains("offset=-1"), "{err}");
        }
    }
    assert_eq!(c.get(format!("{url}?offset={new_start}")).send().await.unwrap().text().await.unwrap(), "new-2");
    assert_eq!(c.get(format!("{url}?offset=-1")).send().await.unwrap().text().await.unwrap(), "new-1new-2");
    // The untagged form of a current offset still reads.
    let untagged = &new_start[..33];
    assert_eq!(c.get(format!("{url}?offset={untagged}")).send().await.unwrap().text().await.unwrap(), "new-2");
}

/// A long-poll waiting on a stream that is deleted: 404; soft-deleted: 410; an SSE connection
/// gets `event: error` (as documented).
async fn long_poll_on_a_deleted_stream(srv: &TestServer) {
    let c = client();
    let url = srv.url(&unique("deleted-while-waiting"));
    let r = c.put(&url).header("content-type", "text/plain").send().await.unwrap();
    let tail = header(&r, "stream-next-offset").unwrap().to_string();
    let waiting = tokio::spawn(c.get(format!("{url}?offset={tail}&live=long-poll")).send());
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.delete(&url).send().await.unwrap();
    let (status, err) = error_of(waiting.await.unwrap().unwrap()).await;
    assert_eq!((status, err["error"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
    // Soft-deleted while it waits (a fork still references it): 410.
    let src = srv.url(&unique("soft-deleted-while-waiting"));
    let r = c.put(&src).header("content-type", "text/plain").body("a").send().await.unwrap();
    let tail = header(&r, "stream-next-offset").unwrap().to_string();
    let fork = srv.url(&unique("fork"));
    let from = src.split("/v1/stream/").nth(1).unwrap().to_string();
    let r = c.put(&fork).header("stream-forked-from", from).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let waiting = tokio::spawn(c.get(format!("{src}?offset={tail}&live=long-poll")).send());
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.delete(&src).send().await.unwrap();
    let (status, err) = error_of(waiting.await.unwrap().unwrap()).await;
    assert_eq!((status, err["error"].as_str()), (StatusCode::GONE, Some("gone")));
    // An SSE connection whose stream is deleted: one `event: error`, then the end.
    let url = srv.url(&unique("deleted-under-sse"));
    c.put(&url).header("content-type", "text/plain").send().await.unwrap();
    let r = c.get(format!("{url}?offset=-1&live=sse")).send().await.unwrap();
    let reader = tokio::spawn(read_sse_until(r, Duration::from_secs(5), |_| false));
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.delete(&url).send().await.unwrap();
    let (text, ended) = reader.await.unwrap();
    assert!(ended, "{text}");
    let events = sse_events(&text);
    let (kind, data, _) = events.last().unwrap();
    assert_eq!(kind, "error", "{text}");
    let v: Value = serde_json::from_str(data).unwrap();
    assert!(v["error"].as_str().unwrap().contains("not found"), "{text}");
}

/// A write refused by an ended stream (409) names its final offset as a token of that stream's
/// incarnation, also while the path is deleted and re-created (closed again) meanwhile: the
/// token is always one a re-created stream's PUT answered, never the final offset of one stream
/// paired with the incarnation of the next (nor a bare offset).
async fn closed_answer_names_the_ended_stream_across_re_creates(srv: &TestServer) {
    let c = client();
    let url = srv.url(&unique("closed-recreated"));
    let put = || c.put(&url).header("content-type", "text/plain").header("stream-closed", "true").body("x").send();
    let r = put().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let first = header(&r, "stream-next-offset").unwrap().to_string();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..3)
        .map(|i| {
            let (c, url, stop) = (c.clone(), url.clone(), stop.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let r = crate::stream_edges::late_write(&c, &url, i == 2).await;
                    match r.status() {
                        StatusCode::CONFLICT => {
                            let token = header(&r, "stream-next-offset").unwrap().to_string();
                            let (_, err) = error_of(r).await;
                            assert_eq!(err["error"], "stream_closed", "{err}");
                            assert!(err["message"].as_str().unwrap().contains(&token), "{token}: {err}");
                            seen.push(token);
                        }
                        StatusCode::NOT_FOUND => {}
                        other => panic!("unexpected {other}"),
                    }
                }
                seen
            })
        })
        .collect();
    // Delete and re-create (closed) for a while; each stream's final offset token is its PUT's.
    let mut tokens = std::collections::HashSet::from([first]);
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        assert_eq!(c.delete(&url).send().await.unwrap().status(), StatusCode::NO_CONTENT);
        let r = put().await.unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        tokens.insert(header(&r, "stream-next-offset").unwrap().to_string());
        // The next stream's final offset differs from this one's (offsets are ms-based).
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut refused = 0;
    for w in writers {
        for token in w.await.unwrap() {
            assert!(tokens.contains(&token), "409 token {token} is no stream's final offset token");
            refused += 1;
        }
    }
    assert!(refused > 100, "only {refused} writes refused");
}

/// A write to a stream that may have ended: a keepalive, or a one-line text append.
pub(crate) async fn late_write(c: &reqwest::Client, url: &str, keepalive: bool) -> reqwest::Response {
    let req = if keepalive {
        c.post(url).header("baton-keepalive", "true")
    } else {
        c.post(url).header("content-type", "text/plain").body("late")
    };
    req.send().await.unwrap()
}

/// One test of `case` on `backend` (one server each).
macro_rules! on_backend {
    ($backend:literal, $case:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            if $backend != "memory" {
                baton_testkit::require_redis();
            }
            let srv = crate::stream_edges::start(crate::stream_edges::backend($backend), |_| {}).await;
            crate::stream_edges::$case(&srv).await;
            srv.stop().await;
        }
    };
}

/// Each case on memory and on Redis standalone; the cases after `cluster:` on Redis Cluster too.
macro_rules! on_backends {
    ($($case:ident),* $(,)?; cluster: $($ccase:ident),* $(,)?) => {
        mod memory {
            $(on_backend!("memory", $case);)*
            $(on_backend!("memory", $ccase);)*
        }
        mod standalone {
            $(on_backend!("standalone", $case);)*
            $(on_backend!("standalone", $ccase);)*
        }
        mod cluster {
            $(on_backend!("cluster", $ccase);)*
        }
    };
}

on_backends!(
    max_len_counts_messages,
    put_with_other_settings_conflicts,
    zero_silence_timeout_is_refused,
    zero_max_run_is_refused,
    offsets_of_a_deleted_stream_are_gone,
    long_poll_on_a_deleted_stream,
    closed_answer_names_the_ended_stream_across_re_creates;
    cluster: closed_tokens_of_ended_streams,
);
