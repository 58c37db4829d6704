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
//! * Known gap (ignored): a copy re-sent across a delete and re-create of the stream is written
//!   to the new stream.
use baton_redis::redis::{self, Value};
use baton_redis::resend::ResendGuard;
use baton_redis::{RedisClient, RedisConn};
use baton_testkit::RedisServer;

const GUARDED: &str = concat!(
    include_str!("../scripts/write_guard.lua"),
    include_str!("../scripts/write_fast.lua"),
    include_str!("../scripts/common.lua"),
    include_str!("../scripts/write.lua")
);

const KS: &str = "baton:s:{brk}";
const KM: &str = "baton:s:{brk}:m";

async fn call(conn: &mut RedisConn, g: &ResendGuard, args: &[Vec<u8>], token: u64) -> redis::RedisResult<Value> {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(GUARDED).arg(3).arg(KS).arg(KM).arg(g.key(KS));
    for a in args {
        cmd.arg(a.as_slice());
    }
    cmd.arg(g.field()).arg(token);
    cmd.query_async(conn).await
}

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

fn b(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
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
        let first = call(conn, &g, &c.args, t).await;
        let before = state(conn).await;
        for _ in 0..2 {
            let again = call(conn, &g, &c.args, t).await;
            assert_eq!(again, first, "{} (warm {warm}): a re-sent copy's reply", c.name);
            let after = state(conn).await;
            assert_eq!(after, before, "{} (warm {warm}): a re-sent copy changed the state", c.name);
        }
        if before.4 != Value::Nil {
            assert_eq!(before.4, Value::BulkString(b"listpack".to_vec()), "{} (warm {warm}): {:?}", c.name, before.0);
        }
    }
}

fn fast(inc: &str, ctn: &str, data: &[u8], msgs: Option<&str>, p: Option<(&str, &str, &str)>) -> Vec<Vec<u8>> {
    let mut a = vec![b(inc), b(ctn), data.to_vec()];
    if let Some(m) = msgs {
        a.push(b(m));
    }
    if let Some((pid, pre, st)) = p {
        if msgs.is_none() {
            a.push(b(""));
        }
        a.push(b(&format!("p:{pid}")));
        a.push(b(pre));
        a.push(b(st));
    }
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_copy_of_every_outcome_gets_the_same_reply_and_changes_nothing() {
    baton_testkit::require_redis();
    let server = RedisServer::start();
    let mut conn = RedisClient::new(server.config()).unwrap().shared().await.unwrap();
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

async fn xlen(conn: &mut RedisConn) -> usize {
    let entries: Vec<(String, Vec<(String, String)>)> =
        redis::cmd("XRANGE").arg(KS).arg("-").arg("+").query_async(conn).await.unwrap();
    entries.iter().filter(|(_, f)| f.iter().any(|(k, _)| k == "d")).count()
}

/// Known gap (not fixed: no small fix): the guard's state dies with the stream's hash, so a copy
/// re-sent after the stream was deleted and created again (a request without an incarnation, as
/// a plain append) is written to the new stream, which the writer never wrote to. The former
/// guard key (`baton:s:{path}:resend:<writer>`, not deleted with the stream) answered such a
/// copy with the first copy's reply. Fails on 2f00f9f: the new stream has 1 record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known gap of the hash-kept guard: a copy re-sent across a delete and re-create is applied to the new stream"]
async fn a_copy_resent_across_delete_and_create_is_not_written_to_the_new_stream() {
    baton_testkit::require_redis();
    let server = RedisServer::start();
    let mut conn = RedisClient::new(server.config()).unwrap().shared().await.unwrap();
    let tp = "text/plain";
    fresh(&mut conn, "inc1", tp, &[], 1).await;
    let g = ResendGuard::new();
    let t = g.next_token();
    let args = fast("", tp, b"once", None, None);
    call(&mut conn, &g, &args, t).await.unwrap();
    let _: () = redis::cmd("DEL").arg(KS).arg(KM).query_async(&mut conn).await.unwrap(); // delete.lua
    fresh(&mut conn, "inc2", tp, &[], 0).await;
    let _again = call(&mut conn, &g, &args, t).await;
    assert_eq!(xlen(&mut conn).await, 0, "the re-sent copy was written to the new stream");
}

/// 70 writers on one stream (over 48 fields: every first call cleans up), each call re-sent
/// after every other writer's call: no field of a live writer is dropped, each call written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_writers_resends_after_cleanups() {
    baton_testkit::require_redis();
    let server = RedisServer::start();
    let mut conn = RedisClient::new(server.config()).unwrap().shared().await.unwrap();
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
            let first = call(&mut conn, g, &args, t).await.unwrap();
            sent.push((g, args, t, first));
        }
        for (g, args, t, first) in &sent {
            assert_eq!(&call(&mut conn, g, args, *t).await.unwrap(), first);
        }
    }
    let hlen: usize = redis::cmd("HLEN").arg(KM).query_async(&mut conn).await.unwrap();
    assert_eq!(xlen(&mut conn).await, 1 + 3 * (70 + 24));
    // 70 guard fields, each at most 64 bytes: still a listpack (128 entries at most).
    assert_eq!(hlen, 78);
    assert_eq!(state(&mut conn).await.4, Value::BulkString(b"listpack".to_vec()));
}
