//! Breaker's probes of the re-send guard's tombstone (`scripts/bury.lua`, commit 6a6db78): a
//! delete keeps the `r:` fields in `baton:s:{path}:gone`, a create carries them over.
//!
//! Fixed (each failed as written before the fix, then ignored; now run):
//! * `carrying_many_writers_keeps_the_hash_a_listpack`: 70 writers (78 fields, a listpack with
//!   Redis's default hash-max-listpack-entries 128) became 148 fields after one delete and
//!   re-create (each carried writer added `r~<writer>`): the new, empty stream's hash was a
//!   hashtable, from about 60 writers on. Now one field `r~` per hash holds the deleted
//!   stream's incarnation (bury.lua).
//! * `stale_r_tilde_fields_outlive_the_carried_field`: a writer's next call overwrote its
//!   carried `r:` field but left its `r~<writer>` field in the hash (no such field any more).
//! * `close_answers_name_the_incarnation_they_ended_without_resends` (and the storm variant
//!   `storm_close_answers_name_the_incarnation_they_ended`, ignored as a kill storm): a
//!   close-only request on a stream that had ended already was answered with that stream's end
//!   but with the incarnation of whatever stream a later `head()` found (src/store.rs): after a
//!   delete and re-create, the end of the old stream with the new incarnation. Now the backend
//!   answers such a close with the incarnation it found ended (`WriteSpec::answers_found_end`).
//!
//! Passing: a writer's new call then its old copy (stale); content type changed; stamped
//! appends; closed-at-create, fork and 'exists' creates; listing; and appends under a kill storm
//! on a Cluster with close/read/delete/create cycles (every append answered OK is exactly once in
//! the incarnation it was answered for; `INFO commandstats` HGET counts show carried answers ran).
//! The two storm tests are ignored (run them with `-- --ignored`): one run of this file hung for
//! over 10 minutes, not seen again in 4 runs and not explained; their store calls now panic after
//! 30 s without an answer, so a repeat names the stuck call.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::guard_common;

use baton_redis::redis::{self, Value};
use baton_redis::resend::ResendGuard;
use baton_redis::RedisConn;
use baton_streams::*;
use bytes::Bytes;
use guard_common::{call, encoding, fast, hget, opts, recreate, reply_inc, server, store, xlen};

const KS: &str = "baton:s:{tb}";
const KM: &str = "baton:s:{tb}:m";
const KT: &str = "baton:s:{tb}:gone";
const TP: &str = "text/plain";

fn path() -> StreamPath {
    StreamPath::new("tb").unwrap()
}

async fn hlen(conn: &mut RedisConn) -> usize {
    redis::cmd("HLEN").arg(KM).query_async(conn).await.unwrap()
}

/// 70 writers on one stream (as in write_guard_break.rs; the clean-up drops nothing): the hash is a
/// listpack (78 fields). A delete and re-create carried each writer's `r:` field plus a new
/// `r~<writer>` field: 140 carried fields + the new stream's own, over Redis's 128-entry listpack
/// limit, so the new stream's hash was a hashtable (slower HMGETs on every append and more
/// memory), although the old one was a listpack and the new stream holds no data. Now: 70
/// carried fields and one `r~`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn carrying_many_writers_keeps_the_hash_a_listpack() {
    let (server, mut conn) = server().await;
    // Redis's documented default (this build's default is 512; the hashes were sized for 128:
    // write_guard.lua, "hash-max-listpack-value", and write_guard_break.rs's 70-writer test).
    let _: () =
        redis::cmd("CONFIG").arg("SET").arg("hash-max-listpack-entries").arg(128).query_async(&mut conn).await.unwrap();
    let store = store(&server).await;
    store.create(&path(), opts(TP)).await.unwrap();
    let writers: Vec<ResendGuard> = (0..70).map(|_| ResendGuard::new()).collect();
    for (i, g) in writers.iter().enumerate() {
        let r = call(&mut conn, KS, g, &fast("", TP, format!("w{i}").as_bytes(), None, None), g.next_token()).await;
        assert!(r.is_ok(), "{r:?}");
    }
    let before = (hlen(&mut conn).await, encoding(&mut conn, KM).await);
    assert_eq!(before.1, "listpack", "precondition: the old stream's hash is a listpack ({} fields)", before.0);
    recreate(&store, &path()).await;
    let after = (hlen(&mut conn).await, encoding(&mut conn, KM).await);
    assert_eq!(
        after.1, "listpack",
        "old hash {} fields (listpack); the re-created stream's hash has {} fields",
        before.0, after.0
    );
}

/// The same, with writers that then write to the new stream: a per-writer `r~<writer>` field
/// stayed (nothing removed it when the writer's field was overwritten by a new call); now the
/// hash has one `r~` field at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_r_tilde_fields_outlive_the_carried_field() {
    let (server, mut conn) = server().await;
    let store = store(&server).await;
    store.create(&path(), opts(TP)).await.unwrap();
    let g = ResendGuard::new();
    call(&mut conn, KS, &g, &fast("", TP, b"old", None, None), g.next_token()).await.unwrap();
    recreate(&store, &path()).await;
    let r = call(&mut conn, KS, &g, &fast("", TP, b"new", None, None), g.next_token()).await.unwrap();
    let inc = hget(&mut conn, KM, "inc").await.unwrap();
    assert_eq!(reply_inc(&r), inc);
    let field = hget(&mut conn, KM, g.field()).await.unwrap();
    let nl = field.iter().position(|c| *c == b'\n').unwrap();
    assert!(field[nl + 1].is_ascii_lowercase(), "overwritten by the new call");
    let tilde = hget(&mut conn, KM, &format!("r~{}", &g.field()[2..])).await;
    assert_eq!(tilde, None, "a stale r~ field stays in the new stream's hash");
    let fields: Vec<String> = redis::cmd("HKEYS").arg(KM).query_async(&mut conn).await.unwrap();
    let tildes: Vec<&String> = fields.iter().filter(|f| f.starts_with("r~")).collect();
    assert_eq!(tildes, ["r~"], "one r~ field: {fields:?}");
}

/// The writer writes to the new stream first (a new call), then its old call's copy arrives:
/// refused as stale, not written (content type changed across the re-create, too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_copy_after_a_new_call_on_the_new_stream_is_stale() {
    let (server, mut conn) = server().await;
    let store = store(&server).await;
    store.create(&path(), opts(TP)).await.unwrap();
    let g = ResendGuard::new();
    let t1 = g.next_token();
    let old = fast("", TP, b"old", None, None);
    let first = call(&mut conn, KS, &g, &old, t1).await.unwrap();
    store.delete(&path()).await.unwrap();
    store.create(&path(), opts("application/octet-stream")).await.unwrap();
    // The copy before any new call: the first reply, nothing written.
    assert_eq!(call(&mut conn, KS, &g, &old, t1).await.unwrap(), first);
    assert_eq!(xlen(&mut conn, KS).await, 0);
    let new = fast("", "", b"new", None, None);
    let r = call(&mut conn, KS, &g, &new, g.next_token()).await.unwrap();
    assert_ne!(reply_inc(&r), reply_inc(&first), "{r:?}");
    let late = call(&mut conn, KS, &g, &old, t1).await;
    assert!(matches!(&late, Err(e) if e.to_string().contains("BATON_STALE_RESEND")), "{late:?}");
    assert_eq!(xlen(&mut conn, KS).await, 1);
}

/// Stamped producer appends across a delete and re-create: the copy gets its first reply and is
/// not written; the producer starts again at seq 0 on the new stream (no state carried).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stamped_copy_across_recreate() {
    let (server, mut conn) = server().await;
    let store = store(&server).await;
    store.create(&path(), opts(TP)).await.unwrap();
    let g = ResendGuard::new();
    // seq 0 then seq 1 (the second one can take the fast path).
    let a0 = fast("", TP, b"p0", None, Some(("P", "0:-1:", "0:0::")));
    call(&mut conn, KS, &g, &a0, g.next_token()).await.unwrap();
    let a1 = fast("", TP, b"p1", None, Some(("P", "0:0:", "0:1::")));
    let t1 = g.next_token();
    let first = call(&mut conn, KS, &g, &a1, t1).await.unwrap();
    assert_eq!(xlen(&mut conn, KS).await, 2);
    recreate(&store, &path()).await;
    assert_eq!(call(&mut conn, KS, &g, &a1, t1).await.unwrap(), first);
    assert_eq!(xlen(&mut conn, KS).await, 0);
    assert_eq!(hget(&mut conn, KM, "p:P").await, None, "producer state not carried");
    let r = call(&mut conn, KS, &g, &a0, g.next_token()).await.unwrap();
    let Value::Array(items) = &r else { panic!("{r:?}") };
    assert!(matches!(&items[0], Value::Array(x) if x[0] == Value::BulkString(b"ok".to_vec())), "{r:?}");
    assert_eq!(xlen(&mut conn, KS).await, 1);
}

/// Closed-at-create, then a fork create at the path: each carries the tombstone; an idempotent
/// create ('exists') leaves a tombstone alone; the listing never shows the tombstone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_fork_and_exists_creates_across_recreate() {
    let (server, mut conn) = server().await;
    let store = store(&server).await;
    store.create(&path(), opts(TP)).await.unwrap();
    let g = ResendGuard::new();
    let t = g.next_token();
    let args = fast("", TP, b"once", None, None);
    let first = call(&mut conn, KS, &g, &args, t).await.unwrap();
    store.delete(&path()).await.unwrap();
    assert!(store.list("", 100).await.unwrap().is_empty(), "a tombstone listed as a stream");
    assert!(matches!(store.head(&path()).await, Err(StreamError::NotFound { .. })));
    store.create(&path(), CreateOptions { closed: true, ..opts(TP) }).await.unwrap();
    assert_eq!(call(&mut conn, KS, &g, &args, t).await.unwrap(), first, "closed-at-create");
    // exists: same config; the tombstone (made by hand) is not consumed.
    let _: () = redis::cmd("HSET").arg(KT).arg("r:zz").arg("1\nFx").query_async(&mut conn).await.unwrap();
    let c = store.create(&path(), CreateOptions { closed: true, ..opts(TP) }).await.unwrap();
    assert!(!c.created);
    assert!(hget(&mut conn, KT, "r:zz").await.is_some(), "an 'exists' create consumed the tombstone");
    let _: () = redis::cmd("DEL").arg(KT).query_async(&mut conn).await.unwrap();
    // A call on the closed stream (refused, its reply kept): the next delete carries its field.
    // (The field of `first` is carried across one delete only: bury.lua drops a carried field.)
    let t2 = g.next_token();
    let closed = call(&mut conn, KS, &g, &args, t2).await.unwrap();
    // A fork at the path (source: another stream).
    let src = StreamPath::new("tb-src").unwrap();
    store.create(&src, CreateOptions { initial: Some(Bytes::from("s")), ..opts(TP) }).await.unwrap();
    store.delete(&path()).await.unwrap();
    let from = ForkFrom { source: src.clone(), offset: None, sub_offset: 0 };
    store.create(&path(), CreateOptions { fork: Some(from), ..opts(TP) }).await.unwrap();
    assert_eq!(call(&mut conn, KS, &g, &args, t2).await.unwrap(), closed, "fork create");
    let chunk = store.read(&path(), ReadFrom::Start).await.unwrap();
    assert_eq!(&chunk.body()[..], b"s", "the fork holds its source's data only");
    let info = store.head(&path()).await.unwrap();
    assert_ne!(info.incarnation.as_bytes(), &reply_inc(&first)[..]);
    assert_ne!(info.incarnation.as_bytes(), &reply_inc(&closed)[..]);
    let mut listed = store.list("", 100).await.unwrap();
    listed.sort();
    assert_eq!(listed, [path(), src]);
}

/// `f`, or a panic naming `what` after 30 s (a store call that never returns).
async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(30), f).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no answer within 30 s"),
    }
}

/// Every record of `p` (one read loop, retried from the start on an error): its incarnation and
/// the lines of its body. `None` when the stream is not there.
async fn snapshot(store: &StreamStore, p: &StreamPath) -> Option<(String, Vec<String>, Option<Offset>)> {
    let mut tries = 0;
    'again: loop {
        tries += 1;
        assert!(tries < 500, "a read of the stream failed 500 times in a row");
        let mut body = String::new();
        let mut from = ReadFrom::Start;
        let mut inc = None::<String>;
        let fin = loop {
            let chunk = match within("read", store.read(p, from)).await {
                Ok(c) => c,
                Err(e @ (StreamError::NotFound { .. } | StreamError::Gone { .. })) => {
                    if std::env::var("TB_LOG").is_ok() {
                        eprintln!("snapshot: {e}");
                    }
                    return None;
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue 'again;
                }
            };
            match &inc {
                None => inc = Some(chunk.incarnation.clone()),
                Some(i) if *i != chunk.incarnation => continue 'again,
                _ => {}
            }
            body.push_str(&String::from_utf8_lossy(&chunk.body()));
            if chunk.up_to_date || chunk.end.is_some() && chunk.records.is_empty() {
                break chunk.end.as_ref().map(|e| e.final_offset);
            }
            from = ReadFrom::At(chunk.next_offset);
        };
        return Some((inc.unwrap_or_default(), body.lines().map(str::to_string).collect(), fin));
    }
}

/// What a storm run saw: per append body, its answer (`Some(incarnation)` when OK); per
/// incarnation, its snapshot (complete when `complete`) and the number of cycles.
struct StormRun {
    answers: HashMap<String, Option<String>>,
    /// Appends answered OK for an incarnation after the cycler's delete of it had returned.
    late: usize,
    snaps: Vec<(String, Vec<String>, bool, Option<Offset>)>,
    /// The closer's answers OK: incarnation, the end's final offset, ended now.
    closes: Vec<(String, Offset, bool)>,
    cycles: usize,
}

/// 2 writing stores x 6 appenders on one path under a kill storm (every node's normal client
/// connections killed every 5 ms) while a third store, again and again: (closes the stream,
/// when `close_first`,) reads it whole, deletes it and creates it again.
async fn storm_with_recreates(
    cluster: &baton_testkit::RedisCluster,
    close_first: bool,
    secs: u64,
    pause_ms: u64,
    kill: bool,
    with_closer: bool,
) -> StormRun {
    let settings = || StreamStoreSettings { default_limits: RunLimits::unlimited(), ..StreamStoreSettings::default() };
    let writers = [
        StreamStore::redis(cluster.config(), settings()).await.unwrap(),
        StreamStore::redis(cluster.config(), settings()).await.unwrap(),
    ];
    let admin = StreamStore::redis(cluster.config(), settings()).await.unwrap();
    let closer = StreamStore::redis(cluster.config(), settings()).await.unwrap();
    let p = StreamPath::new("t/tomb").unwrap();
    admin.create(&p, opts(TP)).await.unwrap();
    let storm =
        if kill { Some(baton_testkit::KillStorm::start(cluster.urls(), Duration::from_millis(5)).await) } else { None };
    let stop = Arc::new(AtomicBool::new(false));
    let answers: Arc<Mutex<HashMap<String, Option<String>>>> = Arc::default();
    let deleted: Arc<Mutex<HashMap<String, std::time::Instant>>> = Arc::default();
    let late = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for (s, store) in writers.iter().enumerate() {
        for w in 0..6 {
            let (store, p, stop, answers) = (store.clone(), p.clone(), stop.clone(), answers.clone());
            let (deleted, late) = (deleted.clone(), late.clone());
            tasks.push(tokio::spawn(async move {
                let mut seq = 0;
                while !stop.load(Ordering::Relaxed) {
                    let data = format!("s{s}w{w}-{seq}");
                    seq += 1;
                    let req = AppendRequest {
                        data: Bytes::from(format!("{data}\n")),
                        content_type: Some(TP.to_string()),
                        ..Default::default()
                    };
                    let r = within("append", store.append(&p, req)).await;
                    if let Ok(a) = &r {
                        if deleted.lock().unwrap().contains_key(&a.incarnation) {
                            late.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    answers.lock().unwrap().insert(data, r.ok().map(|a| a.incarnation));
                    if seq % 8 == 0 {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            }));
        }
    }
    // The closer: a burst of close-only requests each time the cycler has closed the stream (or,
    // without close_first, is about to read it), until one finds no stream.
    let burst = Arc::new(tokio::sync::Notify::new());
    let closes: Arc<Mutex<Vec<(String, Offset, bool)>>> = Arc::default();
    if with_closer {
        let (closer, p, stop, burst, closes) = (closer.clone(), p.clone(), stop.clone(), burst.clone(), closes.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                tokio::select! {
                    _ = burst.notified() => {}
                    _ = tokio::time::sleep(Duration::from_millis(100)) => continue,
                }
                for _ in 0..30 {
                    match within("closer close", closer.close(&p, EndReason::Cancelled)).await {
                        Ok(a) => {
                            let end = a.end.expect("a close's answer has the end");
                            closes.lock().unwrap().push((a.incarnation, end.final_offset, a.ended_now));
                        }
                        Err(StreamError::NotFound { .. }) | Err(StreamError::Gone { .. }) => break,
                        Err(_) => {}
                    }
                }
            }
        }));
    }
    let mut snaps = Vec::new();
    let mut cycles = 0;
    let until = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        if close_first {
            for _ in 0..50 {
                match within("admin close", admin.close(&p, EndReason::Finished)).await {
                    Ok(_) | Err(StreamError::NotFound { .. }) | Err(StreamError::Gone { .. }) => break,
                    Err(_) => continue,
                }
            }
        }
        burst.notify_one();
        let snap = snapshot(&admin, &p).await;
        for _ in 0..50 {
            match within("delete", admin.delete(&p)).await {
                Ok(()) | Err(StreamError::NotFound { .. }) => break,
                Err(_) => continue,
            }
        }
        if let Some((inc, lines, fin)) = snap {
            deleted.lock().unwrap().insert(inc.clone(), std::time::Instant::now());
            snaps.push((inc, lines, close_first, fin));
        }
        for _ in 0..50 {
            match within("create", admin.create(&p, opts(TP))).await {
                Ok(c) => {
                    if std::env::var("TB_LOG").is_ok() {
                        eprintln!("create {} {}", c.created, c.info.incarnation);
                    }
                    break;
                }
                Err(e) => {
                    if std::env::var("TB_LOG").is_ok() {
                        eprintln!("create error {e}");
                    }
                }
            }
        }
        cycles += 1;
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(storm) = storm {
        storm.stop().await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Re-sent copies still in flight land meanwhile.
    tokio::time::sleep(Duration::from_secs(2)).await;
    if let Some((inc, lines, fin)) = snapshot(&admin, &p).await {
        snaps.push((inc, lines, true, fin));
    }
    let answers = answers.lock().unwrap().clone();
    let closes = closes.lock().unwrap().clone();
    StormRun { answers, late: late.load(Ordering::Relaxed), snaps, closes, cycles }
}

/// The problems: appends answered OK for incarnation X found in another incarnation's stream,
/// found more than once in X's, or missing from X's complete snapshot; and bodies written twice
/// anywhere (OK or not).
fn problems(run: &StormRun) -> (Vec<String>, usize, usize) {
    let mut wrong = Vec::new();
    let mut per: HashMap<&str, HashMap<&str, usize>> = HashMap::new();
    let mut total: HashMap<&str, usize> = HashMap::new();
    for (inc, lines, _, _) in &run.snaps {
        let m = per.entry(inc.as_str()).or_default();
        for l in lines {
            *m.entry(l.as_str()).or_default() += 1;
            *total.entry(l.as_str()).or_default() += 1;
        }
    }
    let complete: HashMap<&str, bool> = run.snaps.iter().map(|(i, _, c, _)| (i.as_str(), *c)).collect();
    let ends: HashMap<&str, Option<Offset>> = run.snaps.iter().map(|(i, _, _, f)| (i.as_str(), *f)).collect();
    // A close answered OK for incarnation X with an end at F: X's stream ended at F.
    for (inc, fin, now) in &run.closes {
        match (ends.get(inc.as_str()), complete.get(inc.as_str())) {
            (Some(Some(f)), _) if f != fin => wrong.push(format!(
                "close answered OK (ended_now {now}) for {inc} with its end at {fin:?}; {inc} ended at {f:?}"
            )),
            (Some(None), Some(true)) => {
                wrong.push(format!("close answered OK (ended_now {now}) for {inc} at {fin:?}; {inc} never ended"))
            }
            _ => {}
        }
    }
    let (mut ok, mut unverified) = (0, 0);
    for (data, ans) in &run.answers {
        let Some(inc) = ans else { continue };
        ok += 1;
        for (other, m) in &per {
            if *other != inc.as_str() && m.contains_key(data.as_str()) {
                wrong.push(format!("{data}: answered OK for {inc}, written to {other}"));
            }
        }
        let n = per.get(inc.as_str()).and_then(|m| m.get(data.as_str())).copied().unwrap_or(0);
        match complete.get(inc.as_str()) {
            None => unverified += 1,
            Some(true) if n != 1 => wrong.push(format!("{data}: answered OK for {inc}, written {n} times there")),
            Some(false) if n > 1 => wrong.push(format!("{data}: answered OK for {inc}, written {n} times there")),
            _ => {}
        }
    }
    for (data, n) in &total {
        if *n > 1 && !run.answers.get(*data).is_some_and(Option::is_some) {
            wrong.push(format!("{data}: answered with an error, written {n} times"));
        }
    }
    wrong.sort();
    (wrong, ok, unverified)
}

/// `HGET` calls on every node (`INFO commandstats`): during the storm only the carried-field
/// branch of write.lua calls HGET (unstamped appends; no run open), so this counts the copies
/// answered from a carried field.
async fn hget_calls(cluster: &baton_testkit::RedisCluster) -> u64 {
    let mut n = 0;
    for url in cluster.urls() {
        let client = redis::Client::open(url.as_str()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let info: String = redis::cmd("INFO").arg("commandstats").query_async(&mut c).await.unwrap();
        for line in info.lines().filter(|l| l.starts_with("cmdstat_hget:")) {
            let calls = line.split(&[':', ',', '='][..]).nth(2).unwrap();
            n += calls.parse::<u64>().unwrap();
        }
    }
    n
}

async fn assert_storm(close_first: bool, pause_ms: u64, kill: bool, with_closer: bool) {
    baton_testkit::require_redis();
    let cluster = baton_testkit::RedisCluster::start();
    let run = storm_with_recreates(&cluster, close_first, 6, pause_ms, kill, with_closer).await;
    let (wrong, ok, unverified) = problems(&run);
    let carried = hget_calls(&cluster).await;
    eprintln!(
        "kill {kill} closer {with_closer} close_first {close_first} pause {pause_ms}: {} cycles, {} snapshots, {ok} appends OK ({unverified} for an incarnation never read, {} answered OK after its delete), {} answered, {} closes OK; {carried} HGETs (carried answers)",
        run.cycles,
        run.snaps.len(),
        run.late,
        run.answers.len(),
        run.closes.len()
    );
    assert!(ok > 100, "only {ok} appends answered OK");
    assert!(run.cycles > 5, "only {} delete/create cycles", run.cycles);
    assert!(wrong.is_empty(), "{} problems: {:#?}", wrong.len(), &wrong[..wrong.len().min(10)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kill storm with delete/re-create cycles (passed in ~34 runs); one run hung > 10 min, unexplained: by hand until found"]
async fn storm_appends_with_close_read_delete_create_cycles() {
    for pause in [60, 5] {
        assert_storm(true, pause, true, false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kill storm with delete/re-create cycles (passed in ~34 runs); one run hung > 10 min, unexplained: by hand until found"]
async fn storm_appends_with_read_delete_create_cycles() {
    for pause in [60, 5] {
        assert_storm(false, pause, true, false).await;
    }
}

/// A third store closes the stream in bursts (close-only requests, mostly on a stream ended
/// already) while the cycler closes, reads, deletes and re-creates it, under the kill storm:
/// every close answered OK must carry the end of the incarnation it names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kill storm (as the two above): by hand; passed after the fix (the backend names the incarnation it found ended)"]
async fn storm_close_answers_name_the_incarnation_they_ended() {
    assert_storm(true, 60, true, true).await;
}

/// The same without the kill storm (no re-sent copy, so no carried field answers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_answers_name_the_incarnation_they_ended_without_resends() {
    assert_storm(true, 60, false, true).await;
}
