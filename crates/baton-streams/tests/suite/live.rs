//! Live reads: long-poll, subscriptions, release on deletion/expiry, fan-out.

use std::time::Instant;

use bytes::Bytes;

use super::*;

fn plain() -> CreateOptions {
    CreateOptions { content_type: Some("text/plain".into()), ..Default::default() }
}

fn data(s: &str) -> AppendRequest {
    AppendRequest { data: Bytes::from(s.to_string()), content_type: Some("text/plain".into()), ..Default::default() }
}

pub async fn long_poll_wakes_and_times_out(b: &TestBackend) {
    let s = store(b, settings()).await;
    let p = path("longpoll");
    s.create(&p, plain()).await.unwrap();
    let started = Instant::now();
    let empty = s.read_live(&p, ReadFrom::Now, Duration::from_millis(300)).await.unwrap();
    assert_eq!((empty.records.len(), empty.up_to_date, empty.end, empty.next_offset), (0, true, None, Offset::ZERO));
    assert!(started.elapsed() >= Duration::from_millis(300));
    let (s2, p2) = (s.clone(), p.clone());
    let waiter = tokio::spawn(async move { s2.read_live(&p2, ReadFrom::Now, 10 * SEC).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let t = s.append(&p, data("hello")).await.unwrap().tail;
    let got = waiter.await.unwrap().unwrap();
    assert_eq!((text(&got), got.next_offset, got.up_to_date), ("hello".to_string(), t, true));
    // Data already there: immediate.
    let now = Instant::now();
    let c = s.read_live(&p, ReadFrom::Start, 10 * SEC).await.unwrap();
    assert_eq!(text(&c), "hello");
    assert!(now.elapsed() < SEC);
}

pub async fn waiting_reader_released_on_delete_and_expiry(b: &TestBackend) {
    let s = store(b, settings()).await;
    let p = path("deleted");
    s.create(&p, plain()).await.unwrap();
    let (s2, p2) = (s.clone(), p.clone());
    let waiter = tokio::spawn(async move { s2.read_live(&p2, ReadFrom::Now, 30 * SEC).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let deleted_at = Instant::now();
    s.delete(&p).await.unwrap();
    assert_eq!(waiter.await.unwrap(), Err(StreamError::NotFound { path: p.to_string() }));
    assert!(deleted_at.elapsed() < Duration::from_millis(1500), "{:?}", deleted_at.elapsed());
    // Expiry (TTL 1 s): released within about a second of it.
    let q = path("expiring");
    s.create(&q, CreateOptions { expiry: Expiry::TtlSecs(1), ..plain() }).await.unwrap();
    let started = Instant::now();
    let r = s.read_live(&q, ReadFrom::Now, 30 * SEC).await;
    assert_eq!(r, Err(StreamError::NotFound { path: q.to_string() }));
    assert!(started.elapsed() < Duration::from_millis(2500), "{:?}", started.elapsed());
    // Deleted and re-created while waiting: the old reader is released, never fed new data.
    let r2 = path("recreate");
    s.create(&r2, plain()).await.unwrap();
    let mut sub = s.subscribe(&r2, ReadFrom::Now);
    let (s3, r3) = (s.clone(), r2.clone());
    let recreate = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        s3.delete(&r3).await.unwrap();
        s3.create(&r3, plain()).await.unwrap();
        s3.append(&r3, data("new life")).await.unwrap();
    });
    let out = sub.next(30 * SEC).await;
    recreate.await.unwrap();
    assert_eq!(out, Err(StreamError::NotFound { path: r2.to_string() }));
}

pub async fn fan_out_thousand_readers(b: &TestBackend) {
    let s = store(b, settings()).await;
    let p = path("fanout");
    s.create(&p, plain()).await.unwrap();
    const READERS: usize = 1000;
    const EVENTS: usize = 50;
    let ready = std::sync::Arc::new(tokio::sync::Barrier::new(READERS + 1));
    let mut readers = Vec::new();
    for _ in 0..READERS {
        let (s, p, ready) = (s.clone(), p.clone(), ready.clone());
        readers.push(tokio::spawn(async move {
            let mut sub = s.subscribe(&p, ReadFrom::Start);
            let first = sub.next(Duration::from_millis(1)).await.unwrap().unwrap();
            let mut got: Vec<Record> = first.records;
            ready.wait().await;
            while let Some(c) = sub.next(30 * SEC).await.unwrap() {
                got.extend(c.records);
            }
            got
        }));
    }
    ready.wait().await;
    let mut sent = Vec::new();
    for i in 0..EVENTS {
        sent.push(s.append(&p, data(&format!("e{i};"))).await.unwrap().tail);
        if i == EVENTS / 2 && !matches!(b, TestBackend::Memory) {
            // At most 4 connections in total (standalone: shared + blocker; 3-master Cluster: the
            // shared cluster connection's 3 + one to the node owning the stream's slot).
            let counts: Vec<usize> = ports(b).iter().map(|&port| client_count(port)).collect();
            eprintln!("{}: connections per node while {READERS} readers wait: {counts:?}", b.name());
            assert!(counts.iter().sum::<usize>() <= 4, "{counts:?}");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    s.close(&p, EndReason::Finished).await.unwrap();
    for r in readers {
        let got = r.await.unwrap();
        let offsets: Vec<Offset> = got.iter().map(|r| r.offset).collect();
        assert_eq!(offsets, sent);
        let body: String = got.iter().map(|r| String::from_utf8(r.data.to_vec()).unwrap()).collect();
        assert_eq!(body, (0..EVENTS).map(|i| format!("e{i};")).collect::<String>());
    }
}

pub async fn subscription_to_eof(b: &TestBackend) {
    let s = store(b, settings()).await;
    let p = path("sub");
    s.create(&p, CreateOptions { initial: Some("a".into()), ..plain() }).await.unwrap();
    let mut sub = s.subscribe(&p, ReadFrom::Start);
    let c1 = sub.next(SEC).await.unwrap().unwrap();
    assert_eq!((text(&c1), c1.up_to_date, c1.end), ("a".to_string(), true, None));
    let idle = sub.next(Duration::from_millis(200)).await.unwrap().unwrap();
    assert_eq!((idle.records.len(), idle.up_to_date, idle.next_offset), (0, true, c1.next_offset));
    let t = s.append(&p, data("b")).await.unwrap().tail;
    let c2 = sub.next(10 * SEC).await.unwrap().unwrap();
    assert_eq!((text(&c2), c2.next_offset), ("b".to_string(), t));
    let end = s.append(&p, AppendRequest { close: Some(EndReason::Finished), ..data("c") }).await.unwrap();
    let c3 = sub.next(10 * SEC).await.unwrap().unwrap();
    assert_eq!((text(&c3), c3.end), ("c".to_string(), end.end));
    assert_eq!(sub.next(SEC).await.unwrap(), None);
    // Subscribing at the end of a closed stream: EOF at once.
    let mut late = s.subscribe(&p, ReadFrom::Now);
    let eof = late.next(10 * SEC).await.unwrap().unwrap();
    assert_eq!((eof.records.len(), eof.end), (0, end.end));
}

/// Readers of many distinct streams: each gets its own data. On standalone every tailed stream
/// of a store shares one blocking connection (a watch armed later joins the blocked `XREAD` at
/// once: with a 30 s slice, a missed watch would leave its reader empty-handed after 20 s); in
/// Cluster each tailed stream has one connection to the node owning its slot.
pub async fn many_live_streams(b: &TestBackend) {
    let s = store(b, StreamStoreSettings { live_slice: Duration::from_secs(30), ..settings() }).await;
    const K: usize = 20;
    let mut paths = Vec::new();
    for _ in 0..K {
        let p = path("many");
        s.create(&p, plain()).await.unwrap();
        paths.push(p);
    }
    let ready = std::sync::Arc::new(tokio::sync::Barrier::new(K + 1));
    let mut readers = Vec::new();
    for p in &paths {
        let (s, p, ready) = (s.clone(), p.clone(), ready.clone());
        readers.push(tokio::spawn(async move {
            let mut sub = s.subscribe(&p, ReadFrom::Now);
            let first = sub.next(Duration::from_millis(1)).await.unwrap().unwrap();
            assert!(first.records.is_empty());
            ready.wait().await;
            sub.next(20 * SEC).await.unwrap().unwrap()
        }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ready.wait().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    if !matches!(b, TestBackend::Memory) {
        let counts: Vec<usize> = ports(b).iter().map(|&port| client_count(port)).collect();
        let limit = if matches!(b, TestBackend::Cluster(_)) { 3 + K } else { 2 };
        assert!(counts.iter().sum::<usize>() <= limit, "{counts:?}");
    }
    for (i, p) in paths.iter().enumerate() {
        s.append(p, data(&format!("s{i}"))).await.unwrap();
    }
    for (i, r) in readers.into_iter().enumerate() {
        assert_eq!(text(&r.await.unwrap()), format!("s{i}"));
    }
}

/// Appends made by the reader's own process reach its live readers without a Redis read (the
/// writer hands its records to the tail loop when they directly follow what it has read), and
/// appends from another process interleaved with them still reach those readers exactly once,
/// in stream order.
pub async fn local_appends_reach_live_readers_directly(b: &TestBackend) {
    let s = store(b, settings()).await;
    let other = match b {
        TestBackend::Memory => s.clone(),
        _ => store(b, settings()).await, // another process's store: its own connections
    };
    // Interleaving: 3 writers here (two of them concurrent, so batched calls) and one elsewhere.
    let p = path("interleave");
    s.create(&p, plain()).await.unwrap();
    let mut sub = s.subscribe(&p, ReadFrom::Now);
    assert!(sub.next(Duration::from_millis(1)).await.unwrap().unwrap().records.is_empty());
    const EACH: usize = 100;
    let mut writers = Vec::new();
    for (w, st) in [("a", s.clone()), ("b", s.clone()), ("c", s.clone()), ("x", other.clone())] {
        let p = p.clone();
        writers.push(tokio::spawn(async move {
            for i in 0..EACH {
                st.append(&p, data(&format!("{w}{i};"))).await.unwrap();
                if i % 10 == 0 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }));
    }
    let mut got: Vec<Record> = Vec::new();
    while got.len() < 4 * EACH {
        let c = sub.next(10 * SEC).await.unwrap().expect("not ended");
        got.extend(c.records);
    }
    for w in writers {
        w.await.unwrap();
    }
    let all = s.read(&p, ReadFrom::Start).await.unwrap();
    assert_eq!(all.records.len(), 4 * EACH);
    assert_eq!(got, all.records, "the live reader saw every record once, in stream order");
    // Sequential append → long-poll rounds in one process: with no other writer, every record is
    // handed over directly, so Redis runs no range read for them (each woken tail loop finds
    // nothing new). Standalone only (one node's command statistics).
    let Some(mut conn) = raw(b).await.filter(|_| matches!(b, TestBackend::Standalone(_))) else { return };
    let q = path("direct");
    let mut at = s.create(&q, plain()).await.unwrap().info.tail;
    let xrange = |info: String| -> u64 {
        info.lines()
            .find(|l| l.starts_with("cmdstat_xrange:"))
            .and_then(|l| l.split("calls=").nth(1)?.split(',').next()?.parse().ok())
            .unwrap_or(0)
    };
    // A first round starts the stream's tail loop.
    let (s2, q2) = (s.clone(), q.clone());
    let first = tokio::spawn(async move { s2.read_live(&q2, ReadFrom::At(at), 10 * SEC).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    at = s.append(&q, data("r-;")).await.unwrap().tail;
    assert_eq!(text(&first.await.unwrap().unwrap()), "r-;");
    let before = xrange(baton_redis::redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap());
    const ROUNDS: usize = 30;
    for i in 0..ROUNDS {
        let (s2, q2) = (s.clone(), q.clone());
        let reader = tokio::spawn(async move { s2.read_live(&q2, ReadFrom::At(at), 10 * SEC).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let t = s.append(&q, data(&format!("r{i};"))).await.unwrap().tail;
        let c = reader.await.unwrap().unwrap();
        assert_eq!((text(&c), c.next_offset), (format!("r{i};"), t));
        at = t;
    }
    let after = xrange(baton_redis::redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap());
    eprintln!("{} range reads for {ROUNDS} append → long-poll rounds", after - before);
    // Before the hand-over every round cost one range read (30); a tail loop that wins the race
    // against the writer's reply may still read one now and then.
    assert!(after - before <= ROUNDS as u64 / 3, "{} range reads for {ROUNDS} rounds", after - before);
}
