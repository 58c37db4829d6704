//! Breaker's probes of the re-send guard of `write.lua` (`scripts/write_guard.lua`): the same
//! call (same token) sent again, as a Cluster client re-sends it.
//!
//! * Every kind of outcome (fast-path appends, binary, JSON counts, producer fresh / next / dup /
//!   gap / stale epoch / new epoch, max_len and max_len per writer, content type, incarnation,
//!   after the end, silence fired, sliding TTL, closes with and without data, fenced ends,
//!   Stream-Seq, a mixed batch, a soft-deleted stream), as a writer's first call and as a later
//!   one: the copy gets the first copy's reply and changes nothing (every hash field, the
//!   entries, both expiries, the hash's encoding, which stays a listpack).
//! * 70 writers on one stream (every first call cleans up): each call re-sent after all the
//!   others is answered as the first and written once; the hash stays a listpack.
//! * A copy re-sent across a delete and re-create of the stream (once or twice; every kind of
//!   kept reply) gets the first reply, with the old incarnation, and is not written to the new
//!   stream: the delete keeps the guard's fields in the stream's tombstone `baton:s:{path}:gone`
//!   (`scripts/bury.lua`, for the re-send window) and the create carries them over. A delete
//!   with no create leaves only the tombstone, which expires; the carried fields answer no other
//!   writer.
use crate::guard_common;

use baton_redis::redis::{self, Value};
use baton_redis::resend::ResendGuard;
use baton_redis::RedisConn;
use baton_streams::{CreateOptions, ForkFrom, StreamPath};
use guard_common::{b, call, fast, hget, recreate, reply_inc, server, store, xlen};

const KS: &str = "baton:s:{brk}";
const KM: &str = "baton:s:{brk}:m";

/// Everything a call may change: the hash, the entries, both expiries, the hash's encoding.
async fn state(conn: &mut RedisConn) -> (Vec<(Vec<u8>, Vec<u8>)>, Value, i64, i64, Value) {
    let mut h: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL").arg(KM).query_async(conn).await.unwrap();
    h.sort();
    let x: Value = redis::cmd("XRANGE").arg(KS).arg("-").arg("+").query_async(conn).await.unwrap();
    let t1: i64 = redis::cmd("PTTL").arg(KM).query_async(conn).await.unwrap();
    let t2: i64 = redis::cmd("PTTL").arg(KS).query_async(conn).await.unwrap();
    let enc: Value = redis::cmd("OBJECT").arg("ENCODING").arg(KM).query_async(conn).await.unwrap_or(Value::Nil);
    // Expiries move with time: rounded to 10 s (nearest).
    (h, x, (t1 + 5_000) / 10_000, (t2 + 5_000) / 10_000, enc)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

/// A fresh stream made directly (create.lua's fields): `extra` fields added, `records` entries.
async fn fresh(conn: &mut RedisConn, inc: &str, ctn: &str, extra: &[(&str, String)], records: usize) {
    let _: () = redis::cmd("DEL").arg(KS).arg(KM).query_async(conn).await.unwrap();
    let now = now_ms().to_string();
    let mut tail = "0-0".to_string();
    for i in 0..records {
        tail = redis::cmd("XADD").arg(KS).arg("*").arg("d").arg(format!("r{i}")).query_async(conn).await.unwrap();
    }
    let mut cmd = redis::cmd("HSET");
    cmd.arg(KM).arg("inc").arg(inc).arg("ctn").arg(ctn).arg("cnt").arg(records.to_string());
    cmd.arg("lw").arg(&now).arg("tail").arg(&tail).arg("ct").arg(ctn).arg("ca").arg(&now).arg("ta").arg(&now);
    for (k, v) in extra {
        // A clock set back ("lw") waits for the warm-up call (see `run`).
        let v = if *k == "lw" { now.clone() } else { v.clone() };
        cmd.arg(*k).arg(v);
    }
    let _: () = cmd.query_async(conn).await.unwrap();
}

/// One request of the general layout.
fn req(inc: &str, ctn: &str, sseq: &str, p: (&str, &str, &str), close: &str, recs: &[(&[u8], &str)]) -> Vec<Vec<u8>> {
    let mut a = vec![b(inc), b(ctn), b(sseq), b(p.0), b(p.1), b(p.2), b(close), b(&recs.len().to_string())];
    for (d, m) in recs {
        a.push(d.to_vec());
        a.push(b(m));
    }
    a
}

fn batch(reqs: Vec<Vec<Vec<u8>>>) -> Vec<Vec<u8>> {
    let mut a = vec![b(&reqs.len().to_string())];
    for r in reqs {
        a.extend(r);
    }
    a
}

struct Case {
    name: &'static str,
    inc: &'static str,
    ctn: &'static str,
    extra: Vec<(&'static str, String)>,
    records: usize,
    args: Vec<Vec<u8>>,
}

/// Every case, as a writer's first call and as a later one (after a warm-up call of the same
/// writer on the stream, so the fast path may answer): the copy's reply equals the first, and
/// the copy changes nothing.
async fn run(conn: &mut RedisConn, c: &Case) {
    for warm in [false, true] {
        fresh(conn, c.inc, c.ctn, &c.extra, c.records).await;
        let g = ResendGuard::new();
        if warm {
            // A rejected call (content type) writes only the guard field.
            let w = call(
                conn,
                KS,
                &g,
                &[b("1")]
                    .into_iter()
                    .chain(req("", "x/none", "", ("", "", ""), "", &[(b"w", "0")]))
                    .collect::<Vec<_>>(),
                g.next_token(),
            )
            .await;
            assert!(w.is_ok(), "{}: warm-up {w:?}", c.name);
            // The silence cases: the clock set back only now (the warm-up would have ended the
            // stream), so the fast path itself finds the stream silent.
            for (k, v) in c.extra.iter().filter(|(k, _)| *k == "lw") {
                let _: () = redis::cmd("HSET").arg(KM).arg(*k).arg(v.as_str()).query_async(conn).await.unwrap();
            }
        }
        if !warm {
            for (k, v) in c.extra.iter().filter(|(k, _)| *k == "lw") {
                let _: () = redis::cmd("HSET").arg(KM).arg(*k).arg(v.as_str()).query_async(conn).await.unwrap();
            }
        }
        let t = g.next_token();
        let first = call(conn, KS, &g, &c.args, t).await;
        let before = state(conn).await;
        for _ in 0..2 {
            let again = call(conn, KS, &g, &c.args, t).await;
            assert_eq!(again, first, "{} (warm {warm}): a re-sent copy's reply", c.name);
            let after = state(conn).await;
            assert_eq!(after, before, "{} (warm {warm}): a re-sent copy changed the state", c.name);
        }
        if before.4 != Value::Nil {
            assert_eq!(before.4, Value::BulkString(b"listpack".to_vec()), "{} (warm {warm}): {:?}", c.name, before.0);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_copy_of_every_outcome_gets_the_same_reply_and_changes_nothing() {
    let (_server, mut conn) = server().await;
    let tp = "text/plain";
    let js = "application/json";
    let inc = "0190aaaa-bbbb";
    let long_inc = "x".repeat(60);
    let old = (now_ms() - 100_000).to_string();
    let lw = |v: &str| ("lw", v.to_string());
    let one = |r: Vec<Vec<u8>>| batch(vec![r]);
    let st = |s: &str| s.to_string();
    let cases = vec![
        Case { name: "fast append", inc, ctn: tp, extra: vec![], records: 1, args: fast("", tp, b"a", None, None) },
        Case {
            name: "fast append, long inc",
            inc: Box::leak(long_inc.into_boxed_str()),
            ctn: tp,
            extra: vec![],
            records: 1,
            args: fast("", tp, b"a", None, None),
        },
        Case {
            name: "fast binary",
            inc,
            ctn: "application/octet-stream",
            extra: vec![],
            records: 1,
            args: fast("", "", b"\0\xff\n\r \x80", None, None),
        },
        Case {
            name: "fast on empty stream",
            inc,
            ctn: tp,
            extra: vec![],
            records: 0,
            args: fast("", tp, b"a", None, None),
        },
        Case {
            name: "fast json 3",
            inc,
            ctn: js,
            extra: vec![],
            records: 1,
            args: fast("", js, b"[1,2,3]", Some("3"), None),
        },
        Case {
            name: "stamped fresh",
            inc,
            ctn: tp,
            extra: vec![],
            records: 1,
            args: fast("", tp, b"a", None, Some(("P", "0:-1:", "0:0::"))),
        },
        Case {
            name: "stamped next",
            inc,
            ctn: tp,
            extra: vec![("p:P", st("0:0::1-1"))],
            records: 1,
            args: fast("", tp, b"a", None, Some(("P", "0:0:", "0:1::"))),
        },
        Case {
            name: "stamped dup",
            inc,
            ctn: tp,
            extra: vec![("p:P", st("0:5::1-1"))],
            records: 1,
            args: fast("", tp, b"a", None, Some(("P", "0:2:", "0:3::"))),
        },
        Case {
            name: "stamped gap",
            inc,
            ctn: tp,
            extra: vec![("p:P", st("0:5::1-1"))],
            records: 1,
            args: fast("", tp, b"a", None, Some(("P", "0:7:", "0:8::"))),
        },
        Case {
            name: "stamped stale epoch",
            inc,
            ctn: tp,
            extra: vec![("p:P", st("3:5::1-1"))],
            records: 1,
            args: fast("", tp, b"a", None, Some(("P", "2:-1:", "2:0::"))),
        },
        Case {
            name: "stamped new epoch",
            inc,
            ctn: tp,
            extra: vec![("p:P", st("3:5::1-1"))],
            records: 1,
            args: fast("", tp, b"a", None, Some(("P", "4:-1:", "4:0::"))),
        },
        Case {
            name: "stamped new epoch seq 2",
            inc,
            ctn: tp,
            extra: vec![("p:P", st("3:5::1-1"))],
            records: 1,
            args: fast("", tp, b"a", None, Some(("P", "4:1:", "4:2::"))),
        },
        Case {
            name: "mlw reject",
            inc,
            ctn: tp,
            extra: vec![("mlw", st("2")), ("p:P", st("0:1:2:1-1"))],
            records: 1,
            args: fast("", tp, b"a", None, Some(("P", "0:1:", "0:2::"))),
        },
        Case {
            name: "mlw ok",
            inc,
            ctn: tp,
            extra: vec![("mlw", st("5")), ("p:P", st("0:1:2:1-1"))],
            records: 1,
            args: fast("", tp, b"a", None, Some(("P", "0:1:", "0:2::"))),
        },
        Case {
            name: "max_len reject",
            inc,
            ctn: tp,
            extra: vec![("ml", st("1"))],
            records: 1,
            args: fast("", tp, b"a", None, None),
        },
        Case {
            name: "max_len json reject",
            inc,
            ctn: js,
            extra: vec![("ml", st("3"))],
            records: 1,
            args: fast("", js, b"[1,2,3]", Some("3"), None),
        },
        Case {
            name: "ctn mismatch",
            inc,
            ctn: tp,
            extra: vec![],
            records: 1,
            args: fast("", "text/x", b"a", None, None),
        },
        Case { name: "binary on json", inc, ctn: js, extra: vec![], records: 1, args: fast("", "", b"a", None, None) },
        Case {
            name: "inc mismatch",
            inc,
            ctn: tp,
            extra: vec![],
            records: 1,
            args: fast("other", tp, b"a", None, None),
        },
        Case { name: "inc match", inc, ctn: tp, extra: vec![], records: 1, args: fast(inc, tp, b"a", None, None) },
        Case {
            name: "after end",
            inc,
            ctn: tp,
            extra: vec![("end", st("finished")), ("fin", st("1-1")), ("ea", old.clone())],
            records: 1,
            args: fast("", tp, b"a", None, None),
        },
        Case {
            name: "silence fired",
            inc,
            ctn: tp,
            extra: vec![("sil", st("1000")), lw(&old)],
            records: 1,
            args: fast("", tp, b"a", None, None),
        },
        Case {
            name: "silence fired, close",
            inc,
            ctn: tp,
            extra: vec![("sil", st("1000")), lw(&old)],
            records: 1,
            args: one(req("", tp, "", ("", "", ""), "finished", &[])),
        },
        Case {
            name: "sliding ttl",
            inc,
            ctn: tp,
            extra: vec![("ttl", st("600000"))],
            records: 1,
            args: fast("", tp, b"a", None, None),
        },
        Case {
            name: "close no data",
            inc,
            ctn: tp,
            extra: vec![],
            records: 1,
            args: one(req("", tp, "", ("", "", ""), "finished", &[])),
        },
        Case {
            name: "close no data, done_ttl",
            inc,
            ctn: tp,
            extra: vec![("dttl", st("600000"))],
            records: 1,
            args: one(req("", tp, "", ("", "", ""), "cancelled", &[])),
        },
        Case {
            name: "close with data, stamped",
            inc,
            ctn: tp,
            extra: vec![],
            records: 1,
            args: one(req("", tp, "", ("P", "0", "0"), "finished", &[(b"z", "0")])),
        },
        Case {
            name: "close after close, stamped dup",
            inc,
            ctn: tp,
            extra: vec![
                ("end", st("finished")),
                ("fin", st("1-1")),
                ("ea", old.clone()),
                ("cb", "P\u{0}0\u{0}0".into()),
            ],
            records: 1,
            args: one(req("", tp, "", ("P", "0", "0"), "finished", &[(b"z", "0")])),
        },
        Case {
            name: "fenced end ok",
            inc,
            ctn: tp,
            extra: vec![("p:P", st("2:5::1-1"))],
            records: 1,
            args: one(req("", tp, "", ("P", "2", "f"), "producer_lost", &[])),
        },
        Case {
            name: "fenced end refused",
            inc,
            ctn: tp,
            extra: vec![("p:P", st("2:5::1-1"))],
            records: 1,
            args: one(req("", tp, "", ("P", "1", "f"), "producer_lost", &[])),
        },
        Case {
            name: "stream seq",
            inc,
            ctn: tp,
            extra: vec![("sq", st("b"))],
            records: 1,
            args: one(req("", tp, "c", ("", "", ""), "", &[(b"z", "0")])),
        },
        Case {
            name: "stream seq refused",
            inc,
            ctn: tp,
            extra: vec![("sq", st("b"))],
            records: 1,
            args: one(req("", tp, "a", ("", "", ""), "", &[(b"z", "0")])),
        },
        Case {
            name: "mixed batch",
            inc,
            ctn: tp,
            extra: vec![("ml", st("4"))],
            records: 1,
            args: batch(vec![
                req("", tp, "", ("P", "0", "0"), "", &[(b"a", "0")]),
                req("", tp, "", ("P", "0", "0"), "", &[(b"dup", "0")]),
                req("", "text/x", "", ("", "", ""), "", &[(b"ct", "0")]),
                req("", tp, "", ("", "", ""), "", &[(b"b", "0"), (b"\0c", "0")]),
                req("", tp, "", ("", "", ""), "", &[(b"toolong", "0")]),
                req("other", tp, "", ("", "", ""), "", &[(b"nf", "0")]),
                req("", tp, "", ("P", "0", "1"), "finished", &[]),
                req("", tp, "", ("", "", ""), "", &[(b"closed", "0")]),
            ]),
        },
        Case {
            name: "missing stream",
            inc,
            ctn: tp,
            extra: vec![("del", st("1"))],
            records: 1,
            args: fast("", tp, b"a", None, None),
        },
    ];
    for c in &cases {
        run(&mut conn, c).await;
    }
}

fn path() -> StreamPath {
    StreamPath::new("brk").unwrap()
}

/// The guard's state died with the stream's hash, so a copy re-sent after the stream was deleted
/// and created again (a request without an incarnation, as a plain append) was written to the
/// new stream, which the writer never wrote to (failed on 84c32d5: the new stream had 1 record).
/// The delete keeps the fields in the stream's tombstone and the create carries them over
/// (`scripts/bury.lua`): the copy gets the first copy's reply, the old incarnation's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_resent_across_delete_and_create_is_not_written_to_the_new_stream() {
    let (server, mut conn) = server().await;
    let store = store(&server).await;
    let tp = "text/plain";
    fresh(&mut conn, "inc1", tp, &[], 1).await;
    let g = ResendGuard::new();
    let t = g.next_token();
    let args = fast("", tp, b"once", None, None);
    let first = call(&mut conn, KS, &g, &args, t).await.unwrap();
    recreate(&store, &path()).await;
    let again = call(&mut conn, KS, &g, &args, t).await;
    assert_eq!(xlen(&mut conn, KS).await, 0, "the re-sent copy was written to the new stream");
    assert_eq!(again.unwrap(), first, "the copy's reply");
}

/// Every kind of kept reply (`m` a first call, `f` a fast-path one, `k` a batch in the overflow
/// key), across two deletes and creates in a row: the fields of calls made on the middle stream
/// are carried once, so each such copy gets its first reply (with the middle stream's
/// incarnation, from the one field `r~`) and writes nothing. The fields of calls made on the
/// first stream were carried twice: the second delete dropped them (`scripts/bury.lua`, a
/// documented limit), so those copies are written to the newest stream, answered with its
/// incarnation. Each writer's next call is written to the newest stream as usual; the hash stays
/// a listpack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_reply_is_answered_across_two_deletes_and_creates() {
    let (server, mut conn) = server().await;
    let store = store(&server).await;
    let tp = "text/plain";
    fresh(&mut conn, "inc1", tp, &[], 1).await;
    let one = fast("", tp, b"x", None, None);
    let many = batch(vec![
        req("", tp, "", ("P", "0", "0"), "", &[(b"c", "0")]),
        req("", tp, "", ("P", "0", "1"), "", &[(b"d", "0"), (b"e", "0")]),
        req("", tp, "", ("", "", ""), "", &[(b"f", "0")]),
    ]);
    // One call of each kind by three writers on the stream now, its incarnation `inc`.
    async fn calls<'a>(
        conn: &mut RedisConn,
        gs: &'a [ResendGuard; 3],
        one: &'a [Vec<u8>],
        many: &'a [Vec<u8>],
        inc: &[u8],
    ) -> Vec<(&'a ResendGuard, &'a [Vec<u8>], u64, Value)> {
        let tp = "text/plain";
        let warm = call(conn, KS, &gs[1], &fast("", tp, b"warm", None, None), gs[1].next_token()).await;
        assert!(matches!(warm, Ok(Value::Array(_))), "{warm:?}");
        let mut sent = Vec::new();
        for (g, args, kind) in [(&gs[0], one, b'm'), (&gs[1], one, b'f'), (&gs[2], many, b'k')] {
            let t = g.next_token();
            let first = call(conn, KS, g, args, t).await.unwrap();
            let field = hget(conn, KM, g.field()).await.unwrap();
            assert_eq!(field[field.iter().position(|c| *c == b'\n').unwrap() + 1], kind);
            assert_eq!(reply_inc(&first), inc);
            sent.push((g, args, t, first));
        }
        assert!(matches!(&sent[1].3, Value::BulkString(_)), "{:?}", sent[1].3);
        sent
    }
    let old = [ResendGuard::new(), ResendGuard::new(), ResendGuard::new()];
    let mid = [ResendGuard::new(), ResendGuard::new(), ResendGuard::new()];
    let sent1 = calls(&mut conn, &old, &one, &many, b"inc1").await;
    recreate(&store, &path()).await;
    let inc2 = hget(&mut conn, KM, "inc").await.unwrap();
    assert_ne!(inc2, b"inc1");
    assert_eq!(hget(&mut conn, KM, "r~").await.as_deref(), Some(&b"inc1"[..]));
    let sent2 = calls(&mut conn, &mid, &one, &many, &inc2).await;
    assert_eq!(xlen(&mut conn, KS).await, 7, "on the middle stream: warm, x, x, and the batch's 4");
    recreate(&store, &path()).await;
    let inc3 = hget(&mut conn, KM, "inc").await.unwrap();
    assert_ne!(inc3, inc2);
    assert_eq!(xlen(&mut conn, KS).await, 0);
    // One `r~` field, the middle stream's incarnation; the first stream's writers have no field.
    assert_eq!(hget(&mut conn, KM, "r~").await, Some(inc2.clone()));
    for (g, _, _, _) in &sent1 {
        assert_eq!(hget(&mut conn, KM, g.field()).await, None, "carried twice: dropped");
    }
    let h: Vec<(String, Vec<u8>)> = redis::cmd("HGETALL").arg(KM).query_async(&mut conn).await.unwrap();
    let guard: Vec<&String> = h.iter().map(|(f, _)| f).filter(|f| f.starts_with("r:") || *f == "r~").collect();
    assert_eq!(guard.len(), 4, "the middle stream's three writers' fields and r~: {guard:?}");
    // The middle stream's copies: their first replies, nothing written.
    for (g, args, t, first) in &sent2 {
        assert_eq!(&call(&mut conn, KS, g, args, *t).await.unwrap(), first);
    }
    assert_eq!(xlen(&mut conn, KS).await, 0, "a carried copy was written to the new stream");
    assert_eq!(state(&mut conn).await.4, Value::BulkString(b"listpack".to_vec()));
    // The first stream's copies (re-sent across two deletes and creates): written to the newest
    // stream (x, x, and the batch's c, d, e, f), answered as first calls there.
    for (g, args, t, first) in &sent1 {
        let r = call(&mut conn, KS, g, args, *t).await.unwrap();
        assert_ne!(&r, first);
        assert_eq!(reply_inc(&r), inc3, "{r:?}");
        let Value::Array(items) = &r else { panic!("{r:?}") };
        for item in &items[..items.len() - 1] {
            assert!(matches!(item, Value::Array(a) if a[0] == Value::BulkString(b"ok".to_vec())), "{r:?}");
        }
    }
    assert_eq!(xlen(&mut conn, KS).await, 6);
    // Every writer's next call: written to the newest stream, with its incarnation.
    for (g, _, _, _) in sent1.iter().chain(&sent2) {
        let r = call(&mut conn, KS, g, &fast("", tp, b"next", None, None), g.next_token()).await.unwrap();
        assert_eq!(reply_inc(&r), inc3, "{r:?}");
    }
    assert_eq!(xlen(&mut conn, KS).await, 12);
    assert_eq!(state(&mut conn).await.4, Value::BulkString(b"listpack".to_vec()));
}

/// A hard delete with no create after it leaves only the tombstone `baton:s:{path}:gone`: the
/// fields of calls within the window (marked carried) and one `r~`, the deleted stream's
/// incarnation, none of idle writers, expiring after the re-send window (the window is the
/// client's, as in `write_guard.lua`). A copy re-sent meanwhile answers as a write to a missing stream and
/// creates nothing. A stream with no guard field (standalone, Sentinel) leaves no tombstone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_without_create_leaves_only_a_tombstone_that_expires() {
    const BURY: &str = include_str!("../scripts/bury.lua");
    let window = baton_redis::resend::CLUSTER_RESEND_WINDOW.as_millis() as i64;
    assert!(BURY.contains(&format!("local RW = {window}\n")), "bury.lua should keep {window} ms");
    let (server, mut conn) = server().await;
    let store = store(&server).await;
    let tp = "text/plain";
    let idle = (now_ms() / 1000 - 1200) * baton_redis::resend::TOKEN_SECOND;
    fresh(&mut conn, "inc1", tp, &[("r:idle", format!("{idle}\nm"))], 1).await;
    let g = ResendGuard::new();
    let t = g.next_token();
    let args = fast("", tp, b"once", None, None);
    call(&mut conn, KS, &g, &args, t).await.unwrap();
    let field = hget(&mut conn, KM, g.field()).await.unwrap();
    store.delete(&path()).await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await.unwrap();
    assert_eq!(keys, ["baton:s:{brk}:gone"]);
    let mut kept: Vec<(String, Vec<u8>)> =
        redis::cmd("HGETALL").arg("baton:s:{brk}:gone").query_async(&mut conn).await.unwrap();
    kept.sort();
    let mut carried = field.clone();
    let nl = carried.iter().position(|c| *c == b'\n').unwrap();
    carried[nl + 1] = b'M';
    let w = &g.field()[2..];
    assert_eq!(kept, [(format!("r:{w}"), carried), ("r~".to_string(), b"inc1".to_vec())]);
    let ttl: i64 = redis::cmd("PTTL").arg("baton:s:{brk}:gone").query_async(&mut conn).await.unwrap();
    assert!(ttl > 0 && ttl <= window, "{ttl}");
    let again = call(&mut conn, KS, &g, &args, t).await.unwrap();
    assert_eq!(again, Value::Array(vec![Value::Array(vec![Value::BulkString(b"nf".to_vec())])]));
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await.unwrap();
    assert_eq!(keys, ["baton:s:{brk}:gone"]);
    // Expiry, quickly: the tombstone is a plain key with a TTL.
    let _: () = redis::cmd("PEXPIRE").arg("baton:s:{brk}:gone").arg(1).query_async(&mut conn).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await.unwrap();
    assert!(keys.is_empty(), "{keys:?}");

    // No guard field, no tombstone.
    fresh(&mut conn, "inc2", tp, &[], 1).await;
    store.delete(&path()).await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut conn).await.unwrap();
    assert!(keys.is_empty(), "{keys:?}");
}

/// A soft-deleted stream (a fork references it) keeps its hash, so a copy re-sent meanwhile
/// answers `gone`; when its last fork is deleted, `refs.lua` collects it and keeps its guard in the
/// tombstone as `delete.lua` does, and a create carries it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_soft_deleted_stream_collected_by_its_last_fork_leaves_a_tombstone() {
    let (server, mut conn) = server().await;
    let store = store(&server).await;
    let tp = "text/plain";
    let ct = Some(tp.to_string());
    store.create(&path(), CreateOptions { content_type: ct.clone(), ..Default::default() }).await.unwrap();
    let g = ResendGuard::new();
    let t = g.next_token();
    let args = fast("", tp, b"once", None, None);
    let first = call(&mut conn, KS, &g, &args, t).await.unwrap();
    let fork = StreamPath::new("brk-fork").unwrap();
    let from = ForkFrom { source: path(), offset: None, sub_offset: 0 };
    store.create(&fork, CreateOptions { content_type: ct, fork: Some(from), ..Default::default() }).await.unwrap();
    store.delete(&path()).await.unwrap(); // soft
    let exists: bool = redis::cmd("EXISTS").arg("baton:s:{brk}:gone").query_async(&mut conn).await.unwrap();
    assert!(!exists, "a soft delete keeps the hash");
    store.delete(&fork).await.unwrap(); // collects brk (refs.lua)
    let kept: Vec<String> = redis::cmd("HKEYS").arg("baton:s:{brk}:gone").query_async(&mut conn).await.unwrap();
    assert_eq!(kept.len(), 2, "{kept:?}");
    let ct = Some(tp.to_string());
    store.create(&path(), CreateOptions { content_type: ct, ..Default::default() }).await.unwrap();
    assert_eq!(call(&mut conn, KS, &g, &args, t).await.unwrap(), first);
    assert_eq!(xlen(&mut conn, KS).await, 0);
}

/// The fields a re-created stream carries answer only their own writers' copies: another
/// writer's first call (no field of its own) is written and answered as usual, and so is its
/// re-sent copy; the create took the tombstone away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn carried_fields_do_not_answer_an_unrelated_writers_first_call() {
    let (server, mut conn) = server().await;
    let store = store(&server).await;
    let tp = "text/plain";
    fresh(&mut conn, "inc1", tp, &[], 1).await;
    let g = ResendGuard::new();
    call(&mut conn, KS, &g, &fast("", tp, b"old", None, None), g.next_token()).await.unwrap();
    recreate(&store, &path()).await;
    let exists: bool = redis::cmd("EXISTS").arg("baton:s:{brk}:gone").query_async(&mut conn).await.unwrap();
    assert!(!exists, "the create leaves the tombstone");
    assert!(hget(&mut conn, KM, g.field()).await.is_some(), "carried");
    let inc = hget(&mut conn, KM, "inc").await.unwrap();
    let other = ResendGuard::new();
    let t = other.next_token();
    let args = fast("", tp, b"new", None, None);
    let first = call(&mut conn, KS, &other, &args, t).await.unwrap();
    let Value::Array(items) = &first else { panic!("{first:?}") };
    assert!(matches!(&items[0], Value::Array(r) if r[0] == Value::BulkString(b"ok".to_vec())), "{first:?}");
    assert_eq!(reply_inc(&first), inc);
    assert_eq!(xlen(&mut conn, KS).await, 1);
    assert_eq!(call(&mut conn, KS, &other, &args, t).await.unwrap(), first);
    assert_eq!(xlen(&mut conn, KS).await, 1);
    // The one `r~` field: the deleted stream's incarnation, unchanged by the other writer's calls.
    assert_eq!(hget(&mut conn, KM, "r~").await.as_deref(), Some(&b"inc1"[..]));
    let h: Vec<String> = redis::cmd("HKEYS").arg(KM).query_async(&mut conn).await.unwrap();
    assert_eq!(h.iter().filter(|f| f.starts_with("r~")).count(), 1, "{h:?}");
}

/// 70 writers on one stream (over 48 fields: every first call cleans up), each call re-sent
/// after every other writer's call: no field of a live writer is dropped, each call written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_writers_resends_after_cleanups() {
    let (_server, mut conn) = server().await;
    let tp = "text/plain";
    fresh(&mut conn, "inc1", tp, &[], 1).await;
    let writers: Vec<ResendGuard> = (0..70).map(|_| ResendGuard::new()).collect();
    for round in 0..3 {
        let mut sent = Vec::new();
        for (i, g) in writers.iter().enumerate() {
            let body = format!("w{i}-{round}");
            let args = if i % 3 == 0 {
                batch(vec![
                    req("", tp, "", ("", "", ""), "", &[(body.as_bytes(), "0")]),
                    req("", tp, "", ("", "", ""), "", &[(b"x", "0")]),
                ])
            } else {
                fast("", tp, body.as_bytes(), None, None)
            };
            let t = g.next_token();
            let first = call(&mut conn, KS, g, &args, t).await.unwrap();
            sent.push((g, args, t, first));
        }
        for (g, args, t, first) in &sent {
            assert_eq!(&call(&mut conn, KS, g, args, *t).await.unwrap(), first);
        }
    }
    let hlen: usize = redis::cmd("HLEN").arg(KM).query_async(&mut conn).await.unwrap();
    assert_eq!(xlen(&mut conn, KS).await, 1 + 3 * (70 + 24));
    // 70 guard fields, each at most 64 bytes: still a listpack (128 entries at most).
    assert_eq!(hlen, 78);
    assert_eq!(state(&mut conn).await.4, Value::BulkString(b"listpack".to_vec()));
}
