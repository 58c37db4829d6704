//! Trying to break `GET /v1/streams` (on memory, Redis standalone and Cluster): a token never
//! learns of a stream outside its stream prefixes whatever the prefix or cursor (glob characters,
//! braces, escapes, `..`, unicode, a prefix of another scope, a cursor into another scope);
//! bad parameters are `400` with what to fix; pages never exceed `limit`, never repeat a stream
//! and never skip one that existed throughout while streams are created and deleted under the
//! listing; a listing does not restart a sliding TTL; expired and soft-deleted streams are absent.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use baton::settings::TokenConfig;
use baton_testkit::TestBackend;
use common::*;
use serde_json::Value;

const READER: &str = "reader-secret-0123456789";
const NOREAD: &str = "noread-secret-0123456789";
const ADMIN: &str = "admin-secret-0123456789ab";

fn enc(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

async fn get(srv: &TestServer, query: &str, token: &str) -> (u16, Value) {
    let r = client().get(format!("{}/v1/streams{query}", srv.base)).bearer_auth(token).send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|_| panic!("{status}: {text}")))
}

fn paths(v: &Value) -> Vec<String> {
    v["streams"].as_array().unwrap().iter().map(|s| s["path"].as_str().unwrap().to_string()).collect()
}

async fn put(srv: &TestServer, path: &str, headers: &[(&str, &str)]) {
    let url = format!("{}/v1/stream/{}", srv.base, path.split('/').map(enc_seg).collect::<Vec<_>>().join("/"));
    let mut rb = client().put(url).bearer_auth(ADMIN).header("content-type", "text/plain");
    for (k, v) in headers {
        rb = rb.header(*k, *v);
    }
    let r = rb.send().await.unwrap();
    assert_eq!(r.status().as_u16(), 201, "{path}: {}", r.text().await.unwrap());
}

fn enc_seg(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

async fn server(b: TestBackend) -> TestServer {
    start(b, |c| {
        c.tokens = vec![
            TokenConfig::new("reader", READER, &["read"], &["acme"], &["default"]).unwrap(),
            TokenConfig::new("noread", NOREAD, &["write"], &["acme"], &["default"]).unwrap(),
            TokenConfig::admin("admin", ADMIN).unwrap(),
        ];
    })
    .await
}

async fn scopes_hold_whatever_the_prefix(b: TestBackend) {
    let srv = server(b).await;
    let inside = ["acme", "acme/a", "acme/{x}", "acme/g*[?]", "acme/é", "acme/%7B", "acme/}{"];
    let outside = ["acmeco/x", "other/y", "{acme}/z", "ac*/w", "acme%2Fx/v", "acmé/u"];
    for p in inside.iter().chain(outside.iter()) {
        put(&srv, p, &[]).await;
    }
    let mut all_inside: Vec<String> = inside.iter().map(|s| s.to_string()).collect();
    all_inside.sort();
    // Every prefix a reader might try: only its own streams that start with the prefix, ever.
    for prefix in [
        "",
        "a",
        "acme",
        "acme/",
        "*",
        "acme*",
        "?",
        "?cme",
        "[a]cme",
        "acme/{",
        "acme/%7B",
        "acme/%",
        "acmeco",
        "../other",
        "acme/../other",
        "other",
        "{other}",
        "{",
        "}",
        "\\",
        "a\\",
        "ac*",
        "acme%2F",
        "acme/é",
        "acm",
        "%",
        "%2",
        "%25",
        "\u{0}",
        "acme\u{0}",
    ] {
        let (s, v) = get(&srv, &format!("?prefix={}", enc(prefix)), READER).await;
        assert_eq!(s, 200, "{prefix:?}: {v}");
        let want: Vec<String> =
            all_inside.iter().filter(|p| p.starts_with(prefix.trim_start_matches('/'))).cloned().collect();
        assert_eq!(paths(&v), want, "prefix {prefix:?}");
        assert_eq!(v["next_cursor"], Value::Null, "prefix {prefix:?}");
        // The admin sees exactly the streams that start with it (a literal prefix, not a glob).
        let (s, v) = get(&srv, &format!("?prefix={}", enc(prefix)), ADMIN).await;
        assert_eq!(s, 200, "{prefix:?}: {v}");
        let mut want: Vec<String> = inside
            .iter()
            .chain(outside.iter())
            .filter(|p| p.starts_with(prefix.trim_start_matches('/')))
            .map(|s| s.to_string())
            .collect();
        want.sort();
        assert_eq!(paths(&v), want, "admin, prefix {prefix:?}");
    }
    // A very long prefix: nothing, no error.
    let (s, v) = get(&srv, &format!("?prefix={}", "a".repeat(5000)), READER).await;
    assert_eq!((s, paths(&v).len()), (200, 0), "{v}");

    // Cursor tricks: one page at a time never leaks; a cursor into another scope or past the
    // end lists nothing of it.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let q = match &cursor {
            None => "?limit=1".to_string(),
            Some(c) => format!("?limit=1&cursor={}", enc(c)),
        };
        let (s, v) = get(&srv, &q, READER).await;
        assert_eq!(s, 200, "{v}");
        assert!(paths(&v).len() <= 1);
        seen.extend(paths(&v));
        match v["next_cursor"].as_str() {
            Some(c) => {
                assert!(all_inside.iter().any(|p| p == c), "a cursor names a stream of the reader: {c}");
                cursor = Some(c.to_string());
            }
            None => break,
        }
    }
    assert_eq!(seen, all_inside);
    for c in ["acmeco/x", "acmé", "other", "{acme}/z", "zzz", "\u{10FFFF}"] {
        let (s, v) = get(&srv, &format!("?cursor={}", enc(c)), READER).await;
        assert_eq!((s, paths(&v).len(), &v["next_cursor"]), (200, 0, &Value::Null), "cursor {c:?}: {v}");
    }
    // A cursor before the scope lists the scope from its start.
    let (_, v) = get(&srv, &format!("?cursor={}", enc("ac")), READER).await;
    assert_eq!(paths(&v), all_inside);

    // A token without read lists nothing (not a 5xx, not another's streams).
    let (s, v) = get(&srv, "", NOREAD).await;
    assert_eq!((s, paths(&v).len()), (200, 0), "{v}");

    // Without a token, or with a wrong one: 401.
    let r = client().get(format!("{}/v1/streams", srv.base)).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r =
        client().get(format!("{}/v1/streams", srv.base)).bearer_auth("nope-nope-nope-nope-nope").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);

    // Bad input: 400 with the code and a message naming what to fix.
    for (q, code, says) in [
        ("?limit=0", "invalid_limit", "1 to 1000"),
        ("?limit=1001", "invalid_limit", "1 to 1000"),
        ("?limit=-1", "invalid_limit", "1 to 1000"),
        ("?limit=abc", "invalid_limit", "1 to 1000"),
        ("?limit=", "invalid_limit", "1 to 1000"),
        ("?limit=1.5", "invalid_limit", "1 to 1000"),
        ("?limit=99999999999999999999999", "invalid_limit", "1 to 1000"),
        ("?cursor=a//b", "invalid_cursor", "next_cursor"),
        ("?cursor=acme/..", "invalid_cursor", "next_cursor"),
        ("?cursor=acme/%01", "invalid_cursor", "next_cursor"),
        ("?cursor=/", "invalid_cursor", "next_cursor"),
        ("?prefix=a&prefix=b", "invalid_query", "once"),
        ("?after=acme", "invalid_query", "prefix, limit, cursor"),
    ] {
        let (s, v) = get(&srv, q, READER).await;
        assert_eq!((s, v["error"].as_str()), (400, Some(code)), "{q}: {v}");
        assert!(v["message"].as_str().unwrap().contains(says), "{q}: {v}");
    }
    let long = "a".repeat(1100);
    let (s, v) = get(&srv, &format!("?cursor={long}"), READER).await;
    assert_eq!((s, v["error"].as_str()), (400, Some("invalid_cursor")), "{v}");
    srv.stop().await;
}

/// Pages under churn: streams created and deleted while a reader pages through (limit 7): no page
/// over the limit, no stream twice, pages in one order, and every stream that existed throughout
/// is listed.
async fn pages_hold_under_churn(b: TestBackend) {
    let srv = server(b).await;
    let stable: Vec<String> = (0..120).map(|i| format!("acme/s-{i:04}")).collect();
    let doomed: Vec<String> = (0..60).map(|i| format!("acme/d-{i:04}")).collect();
    for chunk in stable.chunks(30).chain(doomed.chunks(30)) {
        futures::future::join_all(chunk.iter().map(|p| put(&srv, p, &[]))).await;
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let stop = stop.clone();
        let base = srv.base.clone();
        let doomed = doomed.clone();
        tokio::spawn(async move {
            let c = client();
            let mut i = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let fresh = format!("{base}/v1/stream/acme/n-{i:04}");
                c.put(&fresh).bearer_auth(ADMIN).send().await.unwrap();
                if i < doomed.len() {
                    c.delete(format!("{base}/v1/stream/{}", doomed[i])).bearer_auth(ADMIN).send().await.unwrap();
                }
                i += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            i
        })
    };
    for _round in 0..3 {
        let mut seen = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let q = match &cursor {
                None => "?limit=7&prefix=acme/".to_string(),
                Some(c) => format!("?limit=7&prefix=acme/&cursor={}", enc(c)),
            };
            let (s, v) = get(&srv, &q, READER).await;
            assert_eq!(s, 200, "{v}");
            let page = paths(&v);
            assert!(page.len() <= 7, "{} on one page", page.len());
            seen.extend(page);
            match v["next_cursor"].as_str() {
                Some(c) => cursor = Some(c.to_string()),
                None => break,
            }
        }
        let mut sorted = seen.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(seen, sorted, "in order, each once");
        let set: BTreeSet<&String> = seen.iter().collect();
        for p in &stable {
            assert!(set.contains(p), "{p} existed throughout and was not listed");
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let made = churn.await.unwrap();
    assert!(made > 0);
    srv.stop().await;
}

/// A listing reads metadata only: a sliding TTL is not restarted (a read would); an expired
/// stream and a soft-deleted source (its fork alive) are not listed; the fork is, with its
/// source.
async fn no_side_effects_on_ttl(b: TestBackend) {
    let srv = server(b).await;
    put(&srv, "acme/ttl", &[("stream-ttl", "30")]).await;
    put(&srv, "acme/short", &[("stream-ttl", "1")]).await;
    put(&srv, "acme/src", &[]).await;
    put(&srv, "acme/fork", &[("stream-forked-from", "acme/src")]).await;
    let r = client().delete(srv.url("acme/src")).bearer_auth(ADMIN).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let expires = |v: &Value| {
        v["streams"].as_array().unwrap().iter().find(|s| s["path"] == "acme/ttl").unwrap()["expires_at"].clone()
    };
    let (_, v1) = get(&srv, "?prefix=acme/", READER).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, v2) = get(&srv, "?prefix=acme/", READER).await;
    assert_eq!(expires(&v1), expires(&v2), "a listing restarted the sliding TTL");
    assert!(expires(&v1).is_string());
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (_, v) = get(&srv, "?prefix=acme/", READER).await;
    assert_eq!(paths(&v), ["acme/fork", "acme/ttl"], "{v}");
    assert_eq!(v["streams"][0]["forked_from"], "acme/src");
    srv.stop().await;
}

/// A long run of soft-deleted sources (their forks alive elsewhere) under the prefix: pages
/// may come back short or empty but each has a cursor that moves on, no page holds a deleted
/// stream, and the live ones after them are reached.
async fn soft_deleted_runs_do_not_stall_paging(b: TestBackend) {
    let srv = server(b).await;
    for i in 0..30 {
        let src = format!("acme/sd-{i:02}");
        put(&srv, &src, &[]).await;
        put(&srv, &format!("other/fk-{i:02}"), &[("stream-forked-from", src.as_str())]).await;
        let r = client().delete(srv.url(&src)).bearer_auth(ADMIN).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 204);
    }
    put(&srv, "acme/a", &[]).await;
    put(&srv, "acme/z", &[]).await;
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    for calls in 1.. {
        assert!(calls <= 30, "the cursor does not move on");
        let q = match &cursor {
            None => "?limit=2".to_string(),
            Some(c) => format!("?limit=2&cursor={}", enc(c)),
        };
        let (s, v) = get(&srv, &q, READER).await;
        assert_eq!(s, 200, "{v}");
        assert!(paths(&v).len() <= 2);
        seen.extend(paths(&v));
        match v["next_cursor"].as_str() {
            Some(c) => {
                assert!(cursor.as_deref().is_none_or(|old| c > old), "the cursor moves on: {c}");
                cursor = Some(c.to_string());
            }
            None => break,
        }
    }
    assert_eq!(seen, ["acme/a", "acme/z"]);
    srv.stop().await;
}

macro_rules! per_backend {
    ($name:ident) => {
        mod $name {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::$name(backend("memory")).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn standalone() {
                baton_testkit::require_redis();
                super::$name(backend("standalone")).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cluster() {
                baton_testkit::require_redis();
                super::$name(backend("cluster")).await
            }
        }
    };
}

per_backend!(scopes_hold_whatever_the_prefix);
per_backend!(pages_hold_under_churn);
per_backend!(no_side_effects_on_ttl);
per_backend!(soft_deleted_runs_do_not_stall_paging);
