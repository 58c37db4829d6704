//! The writer → live-window hand-off (writer.rs `after_write`, tail.rs `push`):
//! live readers (subscriptions and long-poll loops) in two stores ("processes") must receive
//! exactly what a final catch-up read returns: no gap, no duplicate, no reordering, no record of
//! another incarnation.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_streams::*;
use baton_testkit::{RedisServer, ServerOptions, TestBackend};
use bytes::Bytes;

/// The chunks one reader got: (store, reader, records).
type Chunks = (String, String, Vec<Record>);

static N: AtomicU64 = AtomicU64::new(0);

fn path(name: &str) -> StreamPath {
    StreamPath::new(format!("t/brk-{name}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))).unwrap()
}

fn settings() -> StreamStoreSettings {
    StreamStoreSettings { default_limits: RunLimits::unlimited(), ..StreamStoreSettings::default() }
}

async fn store(b: &TestBackend, s: StreamStoreSettings) -> StreamStore {
    match b.redis_config() {
        None => StreamStore::memory(s),
        Some(cfg) => StreamStore::redis(cfg, s).await.expect("connect"),
    }
}

fn req(ct: &str, data: String) -> AppendRequest {
    AppendRequest { data: Bytes::from(data), content_type: Some(ct.to_string()), ..Default::default() }
}

#[derive(Default, Debug)]
struct Seen {
    records: Vec<Record>,
    incarnations: Vec<String>,
    eof: bool,
    error: Option<String>,
}

impl Seen {
    /// Records one chunk; true when the reader is done (the end, or nothing new after `stop`).
    fn take(&mut self, c: ReadChunk, stop: &AtomicBool) -> bool {
        if !self.incarnations.contains(&c.incarnation) {
            self.incarnations.push(c.incarnation.clone());
        }
        let empty = c.records.is_empty();
        self.records.extend(c.records);
        if c.end.is_some() {
            self.eof = true;
            return true;
        }
        empty && stop.load(Ordering::Relaxed)
    }
}

/// A subscription reader: until EOF, an error, or `stop` with nothing new.
fn sub_reader(s: StreamStore, p: StreamPath, from: ReadFrom, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Seen> {
    tokio::spawn(async move {
        let mut seen = Seen::default();
        let mut sub = s.subscribe(&p, from);
        loop {
            match sub.next(Duration::from_millis(300)).await {
                Ok(Some(c)) => {
                    if seen.take(c, &stop) {
                        return seen;
                    }
                }
                Ok(None) => {
                    seen.eof = true;
                    return seen;
                }
                Err(e) => {
                    seen.error = Some(format!("{e:?}"));
                    return seen;
                }
            }
        }
    })
}

/// A long-poll reader from `at`.
fn poll_reader(s: StreamStore, p: StreamPath, mut at: Offset, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Seen> {
    tokio::spawn(async move {
        let mut seen = Seen::default();
        loop {
            match s.read_live(&p, ReadFrom::At(at), Duration::from_millis(300)).await {
                Ok(c) => {
                    at = c.next_offset;
                    if seen.take(c, &stop) {
                        return seen;
                    }
                }
                Err(e) => {
                    seen.error = Some(format!("{e:?}"));
                    return seen;
                }
            }
        }
    })
}

async fn read_all(s: &StreamStore, p: &StreamPath, from: Offset) -> (Vec<Record>, bool) {
    let mut out = Vec::new();
    let mut at = from;
    loop {
        let c = s.read(p, ReadFrom::At(at)).await.unwrap();
        at = c.next_offset;
        out.extend(c.records);
        if c.up_to_date {
            return (out, c.end.is_some());
        }
    }
}

fn check_order(name: &str, recs: &[Record]) {
    for w in recs.windows(2) {
        assert!(
            w[0].offset < w[1].offset,
            "{name}: out of order or duplicate: {:?} then {:?}",
            w[0].offset,
            w[1].offset
        );
    }
}

/// Starts 2 subscribers and 1 long-poll reader per store, all from `start`.
fn readers(
    stores: &[StreamStore],
    p: &StreamPath,
    start: Offset,
    stop: &Arc<AtomicBool>,
) -> Vec<(String, tokio::task::JoinHandle<Seen>)> {
    let mut out = Vec::new();
    for (i, s) in stores.iter().enumerate() {
        out.push((format!("sub{i}a"), sub_reader(s.clone(), p.clone(), ReadFrom::At(start), stop.clone())));
        out.push((format!("sub{i}b"), sub_reader(s.clone(), p.clone(), ReadFrom::At(start), stop.clone())));
        out.push((format!("poll{i}"), poll_reader(s.clone(), p.clone(), start, stop.clone())));
    }
    out
}

/// Writers in two stores (3 + 2 concurrent tasks, some producer-stamped with retried
/// duplicates), binary or JSON (several messages per append), then a close; optionally a close
/// racing the appends.
async fn interleaved(b: &TestBackend, json: bool, close_midway: bool) {
    interleaved_with(b, json, close_midway, settings()).await
}

async fn interleaved_with(b: &TestBackend, json: bool, close_midway: bool, set: StreamStoreSettings) {
    let s1 = store(b, set.clone()).await;
    let s2 = match b {
        TestBackend::Memory => s1.clone(),
        _ => store(b, set.clone()).await,
    };
    let ct = if json { "application/json" } else { "text/plain" };
    let p = path("inter");
    let start =
        s1.create(&p, CreateOptions { content_type: Some(ct.into()), ..Default::default() }).await.unwrap().info.tail;
    let stop = Arc::new(AtomicBool::new(false));
    let rs = readers(&[s1.clone(), s2.clone()], &p, start, &stop);
    tokio::time::sleep(Duration::from_millis(100)).await;
    const EACH: usize = 150;
    let mut ws = Vec::new();
    for (w, st) in [("a", &s1), ("b", &s1), ("c", &s1), ("x", &s2), ("y", &s2)] {
        let (st, p) = (st.clone(), p.clone());
        ws.push(tokio::spawn(async move {
            let mut seq = 0u64;
            for i in 0..EACH {
                let body = if json {
                    match i % 3 {
                        0 => format!("{{\"w\":\"{w}\",\"i\":{i}}}"),
                        1 => format!("[{{\"w\":\"{w}\",\"i\":{i}}},{{\"w\":\"{w}\",\"j\":{i}}}]"),
                        _ => format!("[1,2,{{\"w\":\"{w}{i}\"}}]"),
                    }
                } else {
                    format!("{w}{i};")
                };
                let mut r = req(ct, body);
                // Writers a and x are idempotent producers; every 5th append is sent twice.
                if w == "a" || w == "x" {
                    r.producer = Some(ProducerStamp { id: format!("P{w}"), epoch: 0, seq });
                    seq += 1;
                }
                let res = st.append(&p, r.clone()).await;
                match res {
                    Ok(_) => {}
                    Err(StreamError::Closed { .. }) if close_midway => return,
                    Err(e) => panic!("{w}{i}: {e:?}"),
                }
                if r.producer.is_some() && i % 5 == 0 {
                    match st.append(&p, r).await {
                        Ok(a) => assert!(a.duplicate, "retry not a duplicate"),
                        Err(StreamError::Closed { .. }) if close_midway => return,
                        Err(e) => panic!("{w}{i} retry: {e:?}"),
                    }
                }
                if i % 17 == 0 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }));
    }
    if close_midway {
        tokio::time::sleep(Duration::from_millis(30)).await;
        let (a, b2) = tokio::join!(s2.close(&p, EndReason::Cancelled), s1.close(&p, EndReason::Finished));
        a.unwrap();
        b2.unwrap();
    }
    for w in ws {
        w.await.unwrap();
    }
    if !close_midway {
        s2.close(&p, EndReason::Finished).await.unwrap();
    }
    let (all, ended) = read_all(&s1, &p, start).await;
    assert!(ended);
    check_order("catch-up", &all);
    let mut total = 0;
    for (name, r) in rs {
        let seen = tokio::time::timeout(Duration::from_secs(30), r).await.expect("reader hangs").unwrap();
        assert!(seen.error.is_none(), "{name}: {:?}", seen.error);
        assert!(seen.eof, "{name}: no EOF");
        check_order(&name, &seen.records);
        if seen.records != all {
            let first = seen.records.iter().zip(&all).position(|(a, b)| a != b);
            panic!(
                "{name}: live reader differs from catch-up: {} vs {} records, first difference at {first:?}: {:?} vs {:?}",
                seen.records.len(),
                all.len(),
                first.map(|i| &seen.records[i]),
                first.map(|i| &all[i])
            );
        }
        total += seen.records.len();
    }
    eprintln!("interleaved json={json} close_midway={close_midway}: {} records, {total} delivered", all.len());
}

async fn interleaved_binary(b: TestBackend) {
    interleaved(&b, false, false).await
}
async fn interleaved_json(b: TestBackend) {
    interleaved(&b, true, false).await
}
async fn interleaved_close_midway(b: TestBackend) {
    interleaved(&b, false, true).await
}
/// A tiny live window and small reads: readers fall behind the window and read on their own.
async fn interleaved_small_window(b: TestBackend) {
    let set = StreamStoreSettings { live_window: 3, max_read_bytes: 64, ..settings() };
    interleaved_with(&b, false, false, set.clone()).await;
    interleaved_with(&b, true, true, set).await
}

/// Delete and re-create the stream repeatedly while both stores append and read: every reader
/// chunk carries one incarnation, and its records must be exactly a prefix-free slice of what was
/// written to that incarnation (no record of another incarnation, no gap, no duplicate).
async fn delete_recreate_while_live(b: TestBackend) {
    let s1 = store(&b, settings()).await;
    let s2 = match &b {
        TestBackend::Memory => s1.clone(),
        _ => store(&b, settings()).await,
    };
    let ct = "text/plain";
    let p = path("recreate");
    let log: Arc<Mutex<Vec<(String, Offset, String)>>> = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    // Readers: per generation, read from Start by subscription in each store, keyed by incarnation.
    let chunks: Arc<Mutex<Vec<Chunks>>> = Arc::new(Mutex::new(Vec::new()));
    let mut rtasks = Vec::new();
    for (ri, s) in [s1.clone(), s2.clone(), s1.clone(), s2.clone()].into_iter().enumerate() {
        let (p, stop, chunks) = (p.clone(), stop.clone(), chunks.clone());
        rtasks.push(tokio::spawn(async move {
            let name = format!("r{ri}");
            while !stop.load(Ordering::Relaxed) {
                let mut sub = s.subscribe(&p, ReadFrom::Start);
                loop {
                    match sub.next(Duration::from_millis(200)).await {
                        Ok(Some(c)) => {
                            if !c.records.is_empty() {
                                chunks.lock().unwrap().push((name.clone(), c.incarnation.clone(), c.records));
                            }
                            if c.end.is_some() || stop.load(Ordering::Relaxed) {
                                break;
                            }
                        }
                        Ok(None) => break,
                        Err(_) => break, // deleted / recreated: subscribe again
                    }
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }));
    }
    for gen in 0..6 {
        let made = s1.create(&p, CreateOptions { content_type: Some(ct.into()), ..Default::default() }).await.unwrap();
        let inc = made.info.incarnation.clone();
        let mut ws = Vec::new();
        for (w, st) in [("a", &s1), ("b", &s1), ("x", &s2)] {
            let (st, p, log, inc) = (st.clone(), p.clone(), log.clone(), inc.clone());
            ws.push(tokio::spawn(async move {
                for i in 0..60 {
                    let data = format!("g{gen}{w}{i};");
                    let mut r = req(ct, data.clone());
                    r.incarnation = Some(inc.clone());
                    match st.append(&p, r).await {
                        Ok(a) => log.lock().unwrap().push((inc.clone(), a.tail, data)),
                        Err(_) => return, // deleted under us
                    }
                    if i % 9 == 0 {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(15 + 5 * gen)).await;
        // Delete mid-appends from the other store.
        let _ = s2.delete(&p).await;
        for w in ws {
            w.await.unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    for r in rtasks {
        tokio::time::timeout(Duration::from_secs(20), r).await.expect("reader hangs").unwrap();
    }
    let log = log.lock().unwrap().clone();
    let mut problems = Vec::new();
    let mut per_reader: std::collections::HashMap<(String, String), Vec<Record>> = Default::default();
    for (name, inc, recs) in chunks.lock().unwrap().iter() {
        per_reader.entry((name.clone(), inc.clone())).or_default().extend(recs.iter().cloned());
    }
    let mut truth: std::collections::HashMap<String, Vec<(Offset, String)>> = Default::default();
    for (inc, off, data) in &log {
        truth.entry(inc.clone()).or_default().push((*off, data.clone()));
    }
    for t in truth.values_mut() {
        t.sort();
    }
    for ((name, inc), recs) in &per_reader {
        let Some(t) = truth.get(inc) else {
            problems.push(format!("{name}: records of unknown incarnation {inc}"));
            continue;
        };
        // Each (re)subscription reads from Start, so a reader may see an incarnation's records
        // several times, each time as a prefix of the truth.
        let mut k = 0;
        for r in recs {
            if r.offset == t[0].0 {
                k = 0;
            }
            match t.get(k) {
                Some((o, d)) if *o == r.offset && d.as_bytes() == &r.data[..] => k += 1,
                other => {
                    problems.push(format!(
                        "{name} inc {inc}: got {:?} {:?}, expected {other:?}",
                        r.offset,
                        String::from_utf8_lossy(&r.data)
                    ));
                    break;
                }
            }
        }
    }
    eprintln!("recreate: {} appends, {} reader/incarnation pairs", log.len(), per_reader.len());
    assert!(problems.is_empty(), "{problems:#?}");
}

/// A stream with max_len: appends beyond it are refused; live readers still match catch-up.
/// Also a silence timeout racing the appends (producer_lost) and a sliding TTL.
async fn limits_and_silence(b: TestBackend) {
    let s1 = store(&b, settings()).await;
    let s2 = match &b {
        TestBackend::Memory => s1.clone(),
        _ => store(&b, settings()).await,
    };
    for (case, limits, expiry) in [
        ("maxlen", RunLimits { max_len: Some(200), ..RunLimits::unlimited() }, Expiry::None),
        (
            "silence",
            RunLimits { silence_timeout: Some(Duration::from_millis(150)), ..RunLimits::unlimited() },
            Expiry::None,
        ),
        ("ttl", RunLimits::unlimited(), Expiry::TtlSecs(60)),
    ] {
        let p = path(case);
        let start = s1
            .create(
                &p,
                CreateOptions {
                    content_type: Some("text/plain".into()),
                    limits: Some(limits),
                    expiry,
                    ..Default::default()
                },
            )
            .await
            .unwrap()
            .info
            .tail;
        let stop = Arc::new(AtomicBool::new(false));
        let rs = readers(&[s1.clone(), s2.clone()], &p, start, &stop);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut ws = Vec::new();
        for (w, st) in [("a", &s1), ("b", &s1), ("x", &s2)] {
            let (st, p) = (st.clone(), p.clone());
            ws.push(tokio::spawn(async move {
                for i in 0..120 {
                    if w != "x" && i % 20 == 19 {
                        tokio::time::sleep(Duration::from_millis(30)).await;
                    }
                    match st.append(&p, req("text/plain", format!("{w}{i};"))).await {
                        Ok(_) => {}
                        Err(StreamError::Closed { .. }) | Err(StreamError::TooLong { .. }) => {}
                        Err(e) => panic!("{w}{i}: {e:?}"),
                    }
                    // The silence case: pauses around the timeout.
                    if w == "x" && i % 20 == 19 {
                        tokio::time::sleep(Duration::from_millis(145 + (i as u64 % 3) * 3)).await;
                    }
                }
            }));
        }
        for w in ws {
            w.await.unwrap();
        }
        let _ = s1.close(&p, EndReason::Finished).await;
        let (all, ended) = read_all(&s1, &p, start).await;
        assert!(ended, "{case}");
        for (name, r) in rs {
            let seen = tokio::time::timeout(Duration::from_secs(30), r).await.expect("reader hangs").unwrap();
            assert!(seen.error.is_none(), "{case} {name}: {:?}", seen.error);
            assert!(seen.eof, "{case} {name}: no EOF");
            check_order(&name, &seen.records);
            assert!(
                seen.records == all,
                "{case} {name}: {} live vs {} catch-up records",
                seen.records.len(),
                all.len()
            );
        }
        eprintln!("{case}: {} records", all.len());
    }
}

/// Forks: appends to a fork (and to its source) with live readers on the fork in both stores.
async fn fork_live(b: TestBackend) {
    let s1 = store(&b, settings()).await;
    let s2 = match &b {
        TestBackend::Memory => s1.clone(),
        _ => store(&b, settings()).await,
    };
    let src = path("fsrc");
    s1.create(
        &src,
        CreateOptions { content_type: Some("text/plain".into()), initial: Some("first".into()), ..Default::default() },
    )
    .await
    .unwrap();
    let at = s1.append(&src, req("text/plain", "second".into())).await.unwrap().tail;
    s1.append(&src, req("text/plain", "third".into())).await.unwrap();
    for (k, sub_offset) in [(0, 0u64), (1, 3)] {
        let f = path("fork");
        let made = s2
            .create(
                &f,
                CreateOptions {
                    fork: Some(ForkFrom { source: src.clone(), offset: Some(at), sub_offset }),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        let start = made.info.tail;
        let stop = Arc::new(AtomicBool::new(false));
        let rs = readers(&[s1.clone(), s2.clone()], &f, start, &stop);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut ws = Vec::new();
        for (w, st) in [("a", &s1), ("b", &s1), ("x", &s2)] {
            let (st, f, src) = (st.clone(), f.clone(), src.clone());
            ws.push(tokio::spawn(async move {
                for i in 0..80 {
                    st.append(&f, req("text/plain", format!("{w}{i};"))).await.unwrap();
                    if i % 10 == 0 {
                        st.append(&src, req("text/plain", format!("S{w}{i};"))).await.unwrap();
                    }
                }
            }));
        }
        for w in ws {
            w.await.unwrap();
        }
        s2.close(&f, EndReason::Finished).await.unwrap();
        let (all, _) = read_all(&s1, &f, start).await;
        for (name, r) in rs {
            let seen = tokio::time::timeout(Duration::from_secs(30), r).await.expect("reader hangs").unwrap();
            assert!(seen.error.is_none(), "fork{k} {name}: {:?}", seen.error);
            check_order(&name, &seen.records);
            assert!(
                seen.records == all,
                "fork{k} {name}: {} live vs {} catch-up records",
                seen.records.len(),
                all.len()
            );
        }
        eprintln!("fork{k}: {} records", all.len());
    }
}

baton_testkit::on_every_backend!(
    interleaved_binary,
    interleaved_json,
    interleaved_close_midway,
    interleaved_small_window,
    delete_recreate_while_live,
    limits_and_silence,
    fork_live
);

/// Redis restarted (AOF) while appending with live readers in two stores: readers may get an
/// error, but what they got before must be a prefix of the final content (no gap / reorder).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_live() {
    baton_testkit::require_redis();
    let mut server = RedisServer::start_with(ServerOptions { appendonly: true });
    let s1 = StreamStore::redis(server.config(), settings()).await.unwrap();
    let s2 = StreamStore::redis(server.config(), settings()).await.unwrap();
    let p = path("restart");
    let start = s1
        .create(&p, CreateOptions { content_type: Some("text/plain".into()), ..Default::default() })
        .await
        .unwrap()
        .info
        .tail;
    let stop = Arc::new(AtomicBool::new(false));
    let rs = readers(&[s1.clone(), s2.clone()], &p, start, &stop);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut ws = Vec::new();
    for (w, st) in [("a", &s1), ("b", &s1), ("x", &s2)] {
        let (st, p) = (st.clone(), p.clone());
        ws.push(tokio::spawn(async move {
            let mut errs = 0;
            for i in 0..400 {
                if st.append(&p, req("text/plain", format!("{w}{i};"))).await.is_err() {
                    errs += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            errs
        }));
    }
    tokio::time::sleep(Duration::from_millis(40)).await;
    server.restart();
    let mut errs = 0;
    for w in ws {
        errs += w.await.unwrap();
    }
    s1.close(&p, EndReason::Finished).await.unwrap();
    stop.store(true, Ordering::Relaxed);
    let (all, _) = read_all(&s1, &p, start).await;
    for (name, r) in rs {
        let seen = tokio::time::timeout(Duration::from_secs(30), r).await.expect("reader hangs").unwrap();
        check_order(&name, &seen.records);
        let n = seen.records.len();
        assert!(
            n <= all.len() && seen.records[..] == all[..n],
            "{name}: not a prefix ({n} of {}) err {:?}",
            all.len(),
            seen.error
        );
        eprintln!("{name}: {n}/{} records, eof {}, error {:?}", all.len(), seen.eof, seen.error);
    }
    eprintln!("restart: {errs} failed appends, {} records", all.len());
}
