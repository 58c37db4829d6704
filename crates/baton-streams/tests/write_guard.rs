//! The re-send guard of `write.lua` on Cluster (`scripts/write_guard.lua`), sent directly as a
//! Cluster client re-sends a call: the same call (same token) twice. The guard lives in the
//! stream's metadata hash (field `r:<writer>`), so a standalone server shows it as well.
//!
//! * A re-sent copy of a fast-path write and of a general-path write (one request; a batch,
//!   whose reply overflows into the writer's own key; a rejection) gets exactly the first
//!   copy's reply and writes nothing.
//! * A late copy of an earlier call (a smaller token) writes nothing and gets `BATON_STALE_RESEND`.
//! * The hash stays a listpack; a writer's first call on a large hash drops the fields of writers
//!   idle for twice the re-send window; a deleted and re-created stream carries the old one's
//!   fields of calls within that age, marked, with the old incarnation (`scripts/bury.lua`).

use crate::guard_common;

use baton_redis::redis::{self, Value};
use baton_redis::resend::{ResendGuard, CLUSTER_RESEND_WINDOW, TOKEN_SECOND};
use baton_redis::RedisConn;
use baton_streams::*;
use baton_testkit::RedisServer;
use bytes::Bytes;
use guard_common::{call, encoding, recreate, server, store, GUARDED};

const KS: &str = "baton:s:{guard}";
const KM: &str = "baton:s:{guard}:m";

/// The same call twice: both replies, which must be equal.
async fn twice(conn: &mut RedisConn, guard: &ResendGuard, args: &[&str], token: u64) -> Value {
    let first = call(conn, KS, guard, args, token).await.unwrap();
    let again = call(conn, KS, guard, args, token).await.unwrap();
    assert_eq!(again, first, "a re-sent copy's reply");
    first
}

/// The stream's record bodies, in order.
async fn bodies(conn: &mut RedisConn) -> Vec<String> {
    let entries: Vec<(String, Vec<(String, String)>)> =
        redis::cmd("XRANGE").arg(KS).arg("-").arg("+").query_async(conn).await.unwrap();
    entries.into_iter().filter_map(|(_, f)| f.into_iter().find(|(k, _)| k == "d").map(|(_, v)| v)).collect()
}

/// The guard's field (`<token>\n<kind><reply>`; a packed reply is binary).
async fn field(conn: &mut RedisConn, guard: &ResendGuard) -> Vec<u8> {
    redis::cmd("HGET").arg(KM).arg(guard.field()).query_async(conn).await.unwrap()
}

async fn setup() -> (RedisServer, StreamStore, RedisConn) {
    let (server, conn) = server().await;
    let store = store(&server).await;
    let p = StreamPath::new("guard").unwrap();
    let ct = Some("text/plain".to_string());
    store.create(&p, CreateOptions { content_type: ct.clone(), ..Default::default() }).await.unwrap();
    store.append(&p, AppendRequest { data: Bytes::from("0"), content_type: ct, ..Default::default() }).await.unwrap();
    (server, store, conn)
}

/// The general layout of one request: inc, ctn, stream seq, producer id, epoch, seq, close, n,
/// then n × (data, messages).
fn general(records: &[&'static str], producer: (&'static str, &'static str, &'static str)) -> Vec<&'static str> {
    let n: &'static str = ["0", "1", "2", "3"][records.len()];
    let mut a = vec!["", "text/plain", "", producer.0, producer.1, producer.2, "", n];
    for r in records {
        a.push(r);
        a.push("0");
    }
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_copy_gets_the_first_reply_and_writes_once() {
    let (_server, _store, mut conn) = setup().await;
    let g = ResendGuard::new();
    let inc: String = redis::cmd("HGET").arg(KM).arg("inc").query_async(&mut conn).await.unwrap();
    let tail = |v: &Value| match v {
        Value::Array(a) => match &a[0] {
            Value::Array(r) => match &r[1] {
                Value::BulkString(b) => String::from_utf8(b.clone()).unwrap(),
                o => panic!("{o:?}"),
            },
            o => panic!("{o:?}"),
        },
        o => panic!("{o:?}"),
    };

    // 1. The writer's first call on the stream (fast layout): no field yet, so the general path
    //    answers (an array), and stores its reply (kind 'm').
    let t1 = g.next_token();
    let r1 = twice(&mut conn, &g, &["", "text/plain", "a"], t1).await;
    let a_id = tail(&r1);
    let Value::Array(items) = &r1 else { unreachable!() };
    assert_eq!(items.len(), 2);
    assert!(matches!(&items[1], Value::Array(ip) if ip[0] == Value::BulkString(inc.clone().into_bytes())));
    assert!(field(&mut conn, &g).await.starts_with(format!("{t1}\nm").as_bytes()));
    assert_eq!(bodies(&mut conn).await, ["0", "a"]);

    // 2. Its next call takes the fast path: one bulk string "<inc> <previous tail> <new id>".
    let t2 = g.next_token();
    let r2 = twice(&mut conn, &g, &["", "text/plain", "b"], t2).await;
    let Value::BulkString(b) = &r2 else { panic!("{r2:?}") };
    let b = String::from_utf8(b.clone()).unwrap();
    let b_id = b.rsplit(' ').next().unwrap().to_string();
    assert_eq!(b, format!("{inc} {a_id} {b_id}"));
    assert_eq!(field(&mut conn, &g).await, format!("{t2}\nf{a_id} {b_id}").into_bytes());
    assert_eq!(bodies(&mut conn).await, ["0", "a", "b"]);

    // 3. A late copy of call 1 (a smaller token) writes nothing.
    let stale = call(&mut conn, KS, &g, &["", "text/plain", "late"], t1).await.unwrap_err();
    assert_eq!(stale.code(), Some("BATON_STALE_RESEND"), "{stale:?}");
    let stale =
        call(&mut conn, KS, &g, &["1"].iter().copied().chain(general(&["late"], ("", "", ""))).collect::<Vec<_>>(), t1)
            .await
            .unwrap_err();
    assert_eq!(stale.code(), Some("BATON_STALE_RESEND"), "{stale:?}");
    assert_eq!(bodies(&mut conn).await, ["0", "a", "b"]);

    // 4. A batch of three requests (general layout, stamped): its reply is too long for a
    //    listpack value, so it goes to the writer's own key (kind 'k'); the hash stays a listpack.
    let mut batch = vec!["3"];
    batch.extend(general(&["c"], ("P", "0", "0")));
    batch.extend(general(&["d", "e"], ("P", "0", "1")));
    batch.extend(general(&["f"], ("", "", "")));
    let t4 = g.next_token();
    let r4 = twice(&mut conn, &g, &batch, t4).await;
    let Value::Array(items) = &r4 else { panic!("{r4:?}") };
    assert_eq!(items.len(), 4);
    assert_eq!(field(&mut conn, &g).await, format!("{t4}\nk").into_bytes());
    let ttl: i64 = redis::cmd("PTTL").arg(g.key(KS)).query_async(&mut conn).await.unwrap();
    assert!(ttl > 299_000 && ttl <= 300_000, "{ttl}");
    assert_eq!(bodies(&mut conn).await, ["0", "a", "b", "c", "d", "e", "f"]);
    assert_eq!(encoding(&mut conn, KM).await, "listpack");

    // 5. A rejected request (a producer sequence gap), stamped, on the fast layout: the general
    //    path answers; a re-sent copy gets the same rejection even after the gap is filled.
    let t5 = g.next_token();
    let gap = ["", "text/plain", "h", "", "p:P", "0:2:", "0:3::"];
    let r5 = call(&mut conn, KS, &g, &gap, t5).await.unwrap();
    let fill = g.next_token();
    let filled =
        call(&mut conn, KS, &ResendGuard::new(), &["", "text/plain", "g", "", "p:P", "0:1:", "0:2::"], fill).await;
    assert!(filled.is_ok(), "{filled:?}");
    let again = call(&mut conn, KS, &g, &gap, t5).await.unwrap();
    assert_eq!(again, r5);
    let Value::Array(items) = &r5 else { panic!("{r5:?}") };
    assert!(matches!(&items[0], Value::Array(r) if r[0] == Value::BulkString(b"gap".to_vec())), "{r5:?}");
    assert_eq!(bodies(&mut conn).await, ["0", "a", "b", "c", "d", "e", "f", "g"]);
    assert_eq!(encoding(&mut conn, KM).await, "listpack");
}

#[test]
fn the_scripts_window_is_the_clients() {
    let line = format!("local RW = {}\n", CLUSTER_RESEND_WINDOW.as_millis());
    assert!(GUARDED.contains(&line), "write_guard.lua should say {line:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_writers_fields_are_dropped_and_a_new_stream_has_none() {
    let (_server, store, mut conn) = setup().await;
    // 60 writers: 40 idle for 20 minutes (more than twice the 5-minute re-send window), 20 recent.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    for i in 0..60u64 {
        let age = if i < 40 { 1200 } else { 60 };
        let token = (now - age) * TOKEN_SECOND + i;
        let _: () = redis::cmd("HSET")
            .arg(KM)
            .arg(format!("r:w{i}"))
            .arg(format!("{token}\nm"))
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let before: usize = redis::cmd("HLEN").arg(KM).query_async(&mut conn).await.unwrap();
    // A writer's first call drops the 40 idle fields and adds its own.
    let g = ResendGuard::new();
    call(&mut conn, KS, &g, &["", "text/plain", "a"], g.next_token()).await.unwrap();
    let after: usize = redis::cmd("HLEN").arg(KM).query_async(&mut conn).await.unwrap();
    assert_eq!(after, before - 40 + 1);
    let kept: Vec<String> = redis::cmd("HKEYS").arg(KM).query_async(&mut conn).await.unwrap();
    assert_eq!(kept.iter().filter(|f| f.starts_with("r:w")).count(), 20);
    assert!(kept.iter().all(|f| !f.starts_with("r:w") || f[3..].parse::<u64>().unwrap() >= 40));
    assert_eq!(bodies(&mut conn).await, ["0", "a"]);

    // Deleted and created again: the fields of calls within the window (20 writers and this
    // one) are carried over, marked (upper-cased kind), with the old incarnation in the one
    // field `r~` (scripts/bury.lua); a writer idle for 20 minutes is not (here: 20 minutes idle,
    // set in the meantime, as a clean-up left none).
    let old_inc: String = redis::cmd("HGET").arg(KM).arg("inc").query_async(&mut conn).await.unwrap();
    let stale = (now - 1200) * TOKEN_SECOND;
    let _: () =
        redis::cmd("HSET").arg(KM).arg("r:idle").arg(format!("{stale}\nm")).query_async(&mut conn).await.unwrap();
    let p = StreamPath::new("guard").unwrap();
    recreate(&store, &p).await;
    let h: Vec<(String, Vec<u8>)> = redis::cmd("HGETALL").arg(KM).query_async(&mut conn).await.unwrap();
    let guard: Vec<_> = h.iter().filter(|(f, _)| f.starts_with("r:")).collect();
    assert_eq!(guard.len(), 21, "{guard:?}");
    let kind = |v: &[u8]| v[v.iter().position(|c| *c == b'\n').unwrap() + 1];
    assert!(guard.iter().all(|(f, v)| f != "r:idle" && kind(v) == b'M'), "{guard:?}");
    let incs: Vec<_> = h.iter().filter(|(f, _)| f.starts_with("r~")).collect();
    assert_eq!(incs, [&("r~".to_string(), old_inc.into_bytes())]);
    assert_eq!(encoding(&mut conn, KM).await, "listpack");
}
