//! The `409` of a write to an ended stream (`StreamError::Closed { end, incarnation }`): its
//! `Stream-Next-Offset` and message name exactly the ended stream's final offset token (what its
//! `HEAD` answers, `<16 digits>_<16 digits>_<12 hex>`), for streams ended by silence, by a
//! close, and for a closed fork (whose token carries its source's tag);
//! appends and keepalives alike; a reader given that token resumes there (nothing more, closed)
//! and, once the path is re-created, is told its offset belongs to another incarnation (410).
//! On memory, Redis standalone and Redis Cluster.

use std::time::Duration;

use crate::common::*;
use reqwest::StatusCode;
use serde_json::Value;

fn unique(name: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!("closed-break/{name}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

fn is_token(t: &str) -> bool {
    let p: Vec<&str> = t.split('_').collect();
    p.len() == 3
        && p[0].len() == 16
        && p[1].len() == 16
        && p[2].len() == 12
        && p[0].bytes().chain(p[1].bytes()).all(|b| b.is_ascii_digit())
        && p[2].bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// A write (data, or a keepalive) refused as closed: its token, checked against the message.
async fn refused(c: &reqwest::Client, url: &str, keepalive: bool) -> String {
    let rb = if keepalive {
        c.post(url).header("baton-keepalive", "true")
    } else {
        c.post(url).header("content-type", "text/plain").body("late")
    };
    let r = rb.send().await.unwrap();
    assert_eq!(r.status(), StatusCode::CONFLICT, "{url} keepalive={keepalive}");
    assert_eq!(header(&r, "stream-closed"), Some("true"));
    let token = header(&r, "stream-next-offset").unwrap().to_string();
    let v: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(v["error"], "stream_closed", "{v}");
    assert!(v["message"].as_str().unwrap().contains(&token), "{token}: {v}");
    token
}

/// The 409s of an ended stream at `url` name its HEAD's token; a read there gets nothing more.
async fn check_ended(c: &reqwest::Client, url: &str, body: &str) -> String {
    let head = c.head(url).send().await.unwrap();
    assert_eq!(head.status(), StatusCode::OK, "{url}");
    assert_eq!(header(&head, "stream-closed"), Some("true"), "{url}");
    let tail = header(&head, "stream-next-offset").unwrap().to_string();
    assert!(is_token(&tail), "{tail}");
    for keepalive in [false, true] {
        assert_eq!(refused(c, url, keepalive).await, tail, "{url} keepalive={keepalive}");
    }
    let r = c.get(format!("{url}?offset={tail}")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK, "{url}");
    assert_eq!(header(&r, "stream-next-offset"), Some(tail.as_str()));
    assert_eq!(header(&r, "stream-closed"), Some("true"));
    assert_eq!(r.text().await.unwrap(), "");
    assert_eq!(c.get(format!("{url}?offset=-1")).send().await.unwrap().text().await.unwrap(), body);
    tail
}

pub(crate) async fn closed_tokens_of_ended_streams(srv: &TestServer) {
    let c = client();
    let put = |url: String, h: &'static str, v: &'static str| {
        c.put(url).header("content-type", "text/plain").header(h, v).body("a").send()
    };
    // Silence.
    let silent = srv.url(&unique("silent"));
    assert_eq!(put(silent.clone(), "baton-silence-timeout", "300ms").await.unwrap().status(), StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let token = check_ended(&c, &silent, "a").await;
    // Re-created: the old token is another incarnation's.
    assert_eq!(c.delete(&silent).send().await.unwrap().status(), StatusCode::NO_CONTENT);
    tokio::time::sleep(Duration::from_millis(3)).await;
    c.put(&silent).header("content-type", "text/plain").header("stream-closed", "true").body("b").send().await.unwrap();
    let r = c.get(format!("{silent}?offset={token}")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::GONE);
    let fresh = refused(&c, &silent, false).await;
    assert!(is_token(&fresh) && fresh != token, "{fresh} {token}");
    // Closed by a write: every later write names the close's final offset.
    let closed = srv.url(&unique("closed"));
    c.put(&closed).header("content-type", "text/plain").body("a").send().await.unwrap();
    let r = c.post(&closed).header("content-type", "text/plain").header("stream-closed", "true").body("b").send();
    let r = r.await.unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
    let close_token = header(&r, "stream-next-offset").unwrap().to_string();
    assert_eq!(check_ended(&c, &closed, "ab").await, close_token);
    // A closed fork: its token carries its source's tag.
    let src = srv.url(&unique("src"));
    let r = c.put(&src).header("content-type", "text/plain").body("a").send().await.unwrap();
    let src_tail = header(&r, "stream-next-offset").unwrap().to_string();
    let fork = srv.url(&unique("fork"));
    let from = src.split("/v1/stream/").nth(1).unwrap().to_string();
    assert_eq!(c.put(&fork).header("stream-forked-from", from).send().await.unwrap().status(), StatusCode::CREATED);
    let r = c.post(&fork).header("content-type", "text/plain").header("stream-closed", "true").body("b").send();
    assert_eq!(r.await.unwrap().status(), StatusCode::NO_CONTENT);
    let fork_token = check_ended(&c, &fork, "ab").await;
    assert_eq!(fork_token[34..], src_tail[34..], "{fork_token} {src_tail}");
    // The source deleted (soft: the fork references it): the fork still answers its own token.
    assert_eq!(c.delete(&src).send().await.unwrap().status(), StatusCode::NO_CONTENT);
    assert_eq!(refused(&c, &fork, false).await, fork_token);
}

/// Redis Cluster with every node's client connections killed every 5 ms (the Cluster client
/// re-sends writes, whose re-sent copies are answered from the re-send guard): a path deleted and
/// re-created closed for 2 s (and until 10 re-creates and 100 refused writes, however loaded the
/// machine; 60 s at most) while 3 writers append and keep alive. Every 409 names the final offset
/// token of one of the streams that existed at the path (what its PUT or HEAD answered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_closed_tokens_under_a_kill_storm() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    baton_testkit::require_redis();
    let backend = backend("cluster");
    let urls = match &backend {
        baton_testkit::TestBackend::Cluster(c) => c.urls(),
        _ => unreachable!(),
    };
    let srv = start(backend, |_| {}).await;
    let c = client();
    let url = srv.url(&unique("storm"));
    let put = || c.put(&url).header("content-type", "text/plain").header("stream-closed", "true").body("x").send();
    let mut tokens = std::collections::HashSet::new();
    let r = put().await.unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    tokens.insert(header(&r, "stream-next-offset").unwrap().to_string());
    let storm = baton_testkit::KillStorm::start(urls, Duration::from_millis(5)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let refusals = Arc::new(AtomicUsize::new(0));
    let writers: Vec<_> = (0..3)
        .map(|i| {
            let (c, url, stop, refusals) = (c.clone(), url.clone(), stop.clone(), refusals.clone());
            tokio::spawn(async move {
                let (mut seen, mut other) = (Vec::new(), 0);
                while !stop.load(Ordering::Relaxed) {
                    let r = super::late_write(&c, &url, i == 2).await;
                    match r.status() {
                        StatusCode::CONFLICT => {
                            let token = header(&r, "stream-next-offset").unwrap().to_string();
                            assert!(is_token(&token), "{token}");
                            let v: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
                            assert_eq!(v["error"], "stream_closed", "{v}");
                            assert!(v["message"].as_str().unwrap().contains(&token), "{token}: {v}");
                            seen.push(token);
                            refusals.fetch_add(1, Ordering::Relaxed);
                        }
                        StatusCode::NOT_FOUND => {}
                        s if s.is_server_error() => other += 1,
                        s => panic!("unexpected {s}"),
                    }
                }
                (seen, other)
            })
        })
        .collect();
    let started = std::time::Instant::now();
    let (mut failed, mut recreates) = (0, 0);
    let more = |recreates: usize| {
        started.elapsed() < Duration::from_secs(2) || recreates < 10 || refusals.load(Ordering::Relaxed) < 100
    };
    while more(recreates) && started.elapsed() < Duration::from_secs(60) {
        recreates += 1;
        let _ = c.delete(&url).send().await.unwrap();
        let r = put().await.unwrap();
        if r.status() == StatusCode::CREATED {
            tokens.insert(header(&r, "stream-next-offset").unwrap().to_string());
        } else {
            failed += 1;
        }
        // Whatever is at the path now (a failed PUT may have created it).
        loop {
            let h = c.head(&url).send().await.unwrap();
            match h.status() {
                StatusCode::OK => tokens.insert(header(&h, "stream-next-offset").unwrap().to_string()),
                StatusCode::NOT_FOUND => false,
                _ => continue,
            };
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let killed = storm.stop().await;
    let (mut refused, mut errors) = (0, 0);
    for w in writers {
        let (seen, other) = w.await.unwrap();
        errors += other;
        for token in seen {
            assert!(tokens.contains(&token), "409 token {token} is no stream's final offset token");
            refused += 1;
        }
    }
    eprintln!("{refused} refused, {errors} errors, {} streams, {failed} PUTs failed, {killed} killed", tokens.len());
    assert!(refused > 50, "only {refused} writes refused");
    srv.stop().await;
}
