//! `GET /v1/streams`: the streams by prefix, on memory, Redis standalone and Cluster. Pages in
//! path order with `next_cursor`; each stream's facts (content type, tail as `Stream-Next-Offset`
//! gives it, length, end and its reason); only the streams a token may read (its stream
//! prefixes), whatever the prefix asked; deleted streams absent.

use crate::common;

use baton::settings::TokenConfig;
use baton_testkit::TestBackend;
use common::*;
use serde_json::Value;

const READER: &str = "reader-secret-0123456789";
const ADMIN: &str = "admin-secret-0123456789ab";

async fn get(srv: &TestServer, path: &str, token: &str) -> (u16, Value) {
    let r = client().get(format!("{}{path}", srv.base)).bearer_auth(token).send().await.unwrap();
    let status = r.status().as_u16();
    (status, serde_json::from_str(&r.text().await.unwrap()).unwrap())
}

fn paths(v: &Value) -> Vec<&str> {
    v["streams"].as_array().unwrap().iter().map(|s| s["path"].as_str().unwrap()).collect()
}

async fn lists_streams_by_prefix(b: TestBackend) {
    let srv = start(b, |c| {
        c.tokens = vec![
            TokenConfig::new("reader", READER, &["read"], &["acme"], &["default"]).unwrap(),
            TokenConfig::admin("admin", ADMIN).unwrap(),
        ];
    })
    .await;
    let c = client();
    let put = |path: &str, ct: &str, body: &str| {
        c.put(srv.url(path)).bearer_auth(ADMIN).header("content-type", ct).body(body.to_string()).send()
    };
    for (p, ct, body) in [
        ("acme/a", "text/plain", "hello"),
        ("acme/b", "text/plain", ""),
        ("acme/c", "application/json", "[1, 2]"),
        ("acme/gone", "text/plain", ""),
        ("acmeco/x", "text/plain", ""),
        ("other/y", "text/plain", ""),
    ] {
        assert_eq!(put(p, ct, body).await.unwrap().status().as_u16(), 201, "{p}");
    }
    let r = c
        .post(srv.url("acme/b"))
        .bearer_auth(ADMIN)
        .header("stream-closed", "true")
        .header("baton-end-reason", "cancelled")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
    assert_eq!(c.delete(srv.url("acme/gone")).bearer_auth(ADMIN).send().await.unwrap().status().as_u16(), 204);
    let head = c.head(srv.url("acme/c")).bearer_auth(ADMIN).send().await.unwrap();
    let tail_c = header(&head, "stream-next-offset").unwrap().to_string();

    // The reader: two pages, its scope only (not acmeco/x, not other/y).
    let (s, page) = get(&srv, "/v1/streams?limit=2", READER).await;
    assert_eq!(s, 200, "{page}");
    assert_eq!(paths(&page), ["acme/a", "acme/b"]);
    assert_eq!(page["next_cursor"], "acme/b");
    let a = &page["streams"][0];
    assert_eq!(
        (a["content_type"].as_str(), a["length"].as_u64(), a["closed"].as_bool()),
        (Some("text/plain"), Some(1), Some(false))
    );
    assert_eq!((&a["end_reason"], &a["ended_at"], &a["forked_from"]), (&Value::Null, &Value::Null, &Value::Null));
    let b = &page["streams"][1];
    assert_eq!(
        (b["closed"].as_bool(), b["end_reason"].as_str(), b["length"].as_u64()),
        (Some(true), Some("cancelled"), Some(0))
    );
    assert!(b["ended_at"].as_str().unwrap().ends_with('Z'));
    let (s, page) = get(&srv, "/v1/streams?limit=2&cursor=acme/b", READER).await;
    assert_eq!(s, 200);
    assert_eq!(paths(&page), ["acme/c"]);
    assert_eq!(page["next_cursor"], Value::Null);
    let cs = &page["streams"][0];
    assert_eq!((cs["content_type"].as_str(), cs["length"].as_u64()), (Some("application/json"), Some(2)));
    assert_eq!(cs["next_offset"].as_str(), Some(tail_c.as_str()));
    // A prefix outside its scope lists nothing; one spanning scopes lists its part.
    assert_eq!(paths(&get(&srv, "/v1/streams?prefix=other/", READER).await.1), Vec::<&str>::new());
    assert_eq!(paths(&get(&srv, "/v1/streams?prefix=acm", READER).await.1), ["acme/a", "acme/b", "acme/c"]);
    assert_eq!(paths(&get(&srv, "/v1/streams?prefix=/acme/", READER).await.1), ["acme/a", "acme/b", "acme/c"]);

    // The admin sees every scope.
    assert_eq!(paths(&get(&srv, "/v1/streams?prefix=acme", ADMIN).await.1), ["acme/a", "acme/b", "acme/c", "acmeco/x"]);
    let (_, all) = get(&srv, "/v1/streams", ADMIN).await;
    assert_eq!(paths(&all), ["acme/a", "acme/b", "acme/c", "acmeco/x", "other/y"]);
    assert_eq!(all["next_cursor"], Value::Null);
    let (s, e) = get(&srv, "/v1/streams?cursor=a//b", ADMIN).await;
    assert_eq!((s, e["error"].as_str()), (400, Some("invalid_cursor")));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory() {
    lists_streams_by_prefix(backend("memory")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone() {
    baton_testkit::require_redis();
    lists_streams_by_prefix(backend("standalone")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster() {
    baton_testkit::require_redis();
    lists_streams_by_prefix(backend("cluster")).await
}

/// The listing's times have the fixed-width millisecond form of every other time in the API
/// (`2099-01-01T00:00:00.000Z`, as a command's `created_at`): no trailing zeros dropped, no
/// fraction left out on a whole second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listed_times_have_three_digit_milliseconds() {
    let srv = start(backend("memory"), |c| c.tokens = vec![TokenConfig::admin("admin", ADMIN).unwrap()]).await;
    let c = client();
    let r = c
        .put(srv.url("times/a"))
        .bearer_auth(ADMIN)
        .header("content-type", "text/plain")
        .header("stream-expires-at", "2099-01-01T00:00:00Z")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let r = c.post(srv.url("times/a")).bearer_auth(ADMIN).header("stream-closed", "true").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 204);
    let (s, v) = get(&srv, "/v1/streams?prefix=times/", ADMIN).await;
    assert_eq!(s, 200, "{v}");
    let a = &v["streams"][0];
    assert_eq!(a["expires_at"], "2099-01-01T00:00:00.000Z", "{v}");
    for k in ["created_at", "last_write_at", "ended_at"] {
        let t = a[k].as_str().unwrap_or_else(|| panic!("{k}: {v}"));
        let fixed = t.len() == 24
            && t.as_bytes()[19] == b'.'
            && t[20..23].bytes().all(|b| b.is_ascii_digit())
            && t.ends_with('Z')
            && humantime::parse_rfc3339(t).is_ok();
        assert!(fixed, "{k} {t} is not YYYY-MM-DDTHH:MM:SS.mmmZ");
    }
    srv.stop().await;
}
