//! Protocol model cases (PROTOCOL.md §4, §5, §8, §9).

use baton_redis::redis;
use bytes::Bytes;

use super::*;

fn opts(ct: &str) -> CreateOptions {
    CreateOptions { content_type: Some(ct.into()), ..Default::default() }
}

fn body(ct: &str, data: &str) -> AppendRequest {
    AppendRequest { data: Bytes::from(data.to_string()), content_type: Some(ct.into()), ..Default::default() }
}

fn stamped(ct: &str, data: &str, id: &str, epoch: u64, seq: u64) -> AppendRequest {
    AppendRequest { producer: Some(ProducerStamp { id: id.into(), epoch, seq }), ..body(ct, data) }
}

pub async fn create_is_idempotent(b: &TestBackend) {
    let s = store(b, settings()).await;
    let p = path("create");
    let first = s.create(&p, CreateOptions { initial: Some("hello".into()), ..opts("text/plain") }).await.unwrap();
    assert!(first.created);
    assert_eq!(first.info.len, 1);
    assert_ne!(first.info.tail, Offset::ZERO);
    // Same config (content type compared case-insensitively, parameters ignored): 200, no reset.
    let again = s.create(&p, opts("TEXT/PLAIN; charset=utf-8")).await.unwrap();
    assert!(!again.created);
    assert_eq!(again.info.tail, first.info.tail);
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "hello");
    // Different content type, TTL, or closed state: 409.
    for other in [
        opts("application/json"),
        CreateOptions { expiry: Expiry::TtlSecs(60), ..opts("text/plain") },
        CreateOptions { closed: true, ..opts("text/plain") },
    ] {
        assert!(matches!(s.create(&p, other).await, Err(StreamError::Conflict { .. })));
    }
    // The content-type conflict names the stream's type (what to fix).
    let e = s.create(&p, opts("application/json")).await.unwrap_err();
    assert_eq!(
        e,
        StreamError::Conflict { reason: "content type differs from the existing stream's (text/plain)".into() }
    );
    // Created closed, with its whole content.
    let c = path("closed");
    let made =
        s.create(&c, CreateOptions { closed: true, initial: Some("done".into()), ..opts("text/plain") }).await.unwrap();
    let end = made.info.end.expect("closed at creation");
    assert_eq!((end.reason, end.final_offset), (EndReason::Finished, made.info.tail));
    assert!(!s.create(&c, CreateOptions { closed: true, ..opts("text/plain") }).await.unwrap().created);
    assert!(matches!(s.create(&c, opts("text/plain")).await, Err(StreamError::Conflict { .. })));
    // Default content type; expiry in the past refused.
    let d = path("default");
    assert_eq!(s.create(&d, CreateOptions::default()).await.unwrap().info.content_type, DEFAULT_CONTENT_TYPE);
    let past = CreateOptions { expiry: Expiry::At(1_000), ..Default::default() };
    assert!(matches!(s.create(&path("past"), past).await, Err(StreamError::InvalidRequest { .. })));
}

pub async fn append_and_read_bytes(b: &TestBackend) {
    let s = store(b, settings()).await;
    let p = path("bytes");
    assert!(matches!(s.append(&p, body("text/plain", "x")).await, Err(StreamError::NotFound { .. })));
    s.create(&p, opts("text/plain")).await.unwrap();
    let empty = s.read(&p, ReadFrom::Start).await.unwrap();
    assert_eq!((empty.records.len(), empty.next_offset, empty.up_to_date, empty.end), (0, Offset::ZERO, true, None));
    let mut offsets = vec![];
    for chunk in ["chunk1", "chunk2", "chunk3"] {
        offsets.push(s.append(&p, body("text/plain", chunk)).await.unwrap().tail);
    }
    // Strictly increasing, unique, lexicographically sortable offsets.
    assert!(offsets.windows(2).all(|w| w[0] < w[1] && w[0].to_string() < w[1].to_string()));
    let all = s.read(&p, ReadFrom::Start).await.unwrap();
    assert_eq!(text(&all), "chunk1chunk2chunk3");
    assert_eq!((all.next_offset, all.up_to_date), (offsets[2], true));
    let rest = s.read(&p, ReadFrom::At(offsets[0])).await.unwrap();
    assert_eq!(text(&rest), "chunk2chunk3");
    let now = s.read(&p, ReadFrom::Now).await.unwrap();
    assert_eq!((now.records.len(), now.next_offset, now.up_to_date), (0, offsets[2], true));
    // Content type mismatch (the refusal names both types and what to send) and empty bodies.
    assert_eq!(
        s.append(&p, body("Application/JSON; charset=utf-8", "{}")).await,
        Err(StreamError::Conflict {
            reason: "content type differs from the stream's (text/plain): this append was sent as application/json; \
                     send it with Content-Type: text/plain"
                .into()
        })
    );
    assert!(matches!(s.append(&p, body("text/plain", "")).await, Err(StreamError::InvalidRequest { .. })));
    // Binary integrity.
    let bin = path("bin");
    s.create(&bin, CreateOptions::default()).await.unwrap();
    let data: Vec<u8> = (0..=255u8).collect();
    s.append(
        &bin,
        AppendRequest {
            data: Bytes::from(data.clone()),
            content_type: Some(DEFAULT_CONTENT_TYPE.into()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(s.read(&bin, ReadFrom::Start).await.unwrap().body().to_vec(), data);
    let info = s.head(&p).await.unwrap();
    assert_eq!((info.tail, info.len, info.content_type.as_str(), info.end), (offsets[2], 3, "text/plain", None));
}

pub async fn json_mode(b: &TestBackend) {
    let s = store(b, settings()).await;
    let ct = "application/json";
    let p = path("json");
    s.create(&p, CreateOptions { initial: Some("[]".into()), ..opts(ct) }).await.unwrap();
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "[]");
    s.append(&p, body(ct, r#"{"event":"created"}"#)).await.unwrap();
    s.append(&p, body(ct, r#"[{"a":1}, {"b":2}]"#)).await.unwrap();
    s.append(&p, body(ct, "[[1,2],[3,4]]")).await.unwrap();
    s.append(&p, body(ct, "[[[1,2,3]]]")).await.unwrap();
    let got: serde_json::Value = serde_json::from_slice(&s.read(&p, ReadFrom::Start).await.unwrap().body()).unwrap();
    assert_eq!(got, serde_json::json!([{"event":"created"},{"a":1},{"b":2},[1,2],[3,4],[[1,2,3]]]));
    assert_eq!(s.append(&p, body(ct, "[]")).await, Err(StreamError::EmptyArray));
    assert!(matches!(s.append(&p, body(ct, "{oops")).await, Err(StreamError::InvalidJson { .. })));
    // A JSON stream refuses a body without a content type (it would be stored unvalidated).
    let raw = AppendRequest { data: Bytes::from("{}"), ..Default::default() };
    assert_eq!(
        s.append(&p, raw).await,
        Err(StreamError::Conflict {
            reason: format!(
                "content type differs from the stream's ({ct}): this append has no content type; send it with \
                 Content-Type: {ct}"
            )
        })
    );
    let now = s.read(&p, ReadFrom::Now).await.unwrap();
    assert_eq!(text(&now), "[]");
}

pub async fn stream_seq_is_bytewise_increasing(b: &TestBackend) {
    let s = store(b, settings()).await;
    let p = path("seq");
    s.create(&p, opts("text/plain")).await.unwrap();
    let seq = |v: &str| AppendRequest { stream_seq: Some(v.into()), ..body("text/plain", "x") };
    s.append(&p, seq("09")).await.unwrap();
    s.append(&p, seq("10")).await.unwrap();
    assert_eq!(
        s.append(&p, seq("10")).await,
        Err(StreamError::StreamSeqRegression { last: "10".into(), received: "10".into() })
    );
    assert!(s.append(&p, seq("2")).await.is_ok()); // "2" > "10" bytewise
    assert!(matches!(s.append(&p, seq("10")).await, Err(StreamError::StreamSeqRegression { .. })));
    assert!(s.append(&p, seq("B")).await.is_ok());
    assert!(s.append(&p, seq("a")).await.is_ok()); // case-sensitive: "a" > "B"
    assert!(matches!(s.append(&p, seq("Z")).await, Err(StreamError::StreamSeqRegression { .. })));
}

pub async fn idempotent_producers(b: &TestBackend) {
    let s = store(b, settings()).await;
    let ct = "text/plain";
    let p = path("producer");
    s.create(&p, opts(ct)).await.unwrap();
    let a0 = s.append(&p, stamped(ct, "m0", "A", 0, 0)).await.unwrap();
    assert_eq!((a0.duplicate, a0.producer), (false, Some((0, 0))));
    let a1 = s.append(&p, stamped(ct, "m1", "A", 0, 1)).await.unwrap();
    let a2 = s.append(&p, stamped(ct, "m2", "A", 0, 2)).await.unwrap();
    // Duplicate: success, nothing written, highest accepted seq reported.
    let dup = s.append(&p, stamped(ct, "m1-again", "A", 0, 1)).await.unwrap();
    assert_eq!((dup.duplicate, dup.producer, dup.tail), (true, Some((0, 2)), a2.tail));
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "m0m1m2");
    assert_eq!(dup.producer_offset, Some(a2.tail));
    assert!(a1.tail < a2.tail);
    // Gap, new epoch not at 0, epoch bump, zombie fencing.
    assert_eq!(
        s.append(&p, stamped(ct, "x", "A", 0, 5)).await,
        Err(StreamError::SequenceGap { expected: 3, received: 5 })
    );
    assert_eq!(s.append(&p, stamped(ct, "x", "A", 1, 1)).await, Err(StreamError::EpochMustStartAtZero { seq: 1 }));
    s.append(&p, stamped(ct, "e1", "A", 1, 0)).await.unwrap();
    assert_eq!(
        s.append(&p, stamped(ct, "z", "A", 0, 3)).await,
        Err(StreamError::Fenced { epoch: 0, current_epoch: 1 })
    );
    // A new producer must start at 0; producers are independent.
    assert_eq!(
        s.append(&p, stamped(ct, "x", "B", 0, 1)).await,
        Err(StreamError::SequenceGap { expected: 0, received: 1 })
    );
    s.append(&p, stamped(ct, "b0", "B", 7, 0)).await.unwrap();
    // Producer duplicate wins over a Stream-Seq regression (§5.2.1).
    let with_seq = AppendRequest { stream_seq: Some("1".into()), ..stamped(ct, "s", "C", 0, 0) };
    s.append(&p, with_seq.clone()).await.unwrap();
    assert!(s.append(&p, with_seq).await.unwrap().duplicate);
    // Bad stamps.
    assert!(matches!(s.append(&p, stamped(ct, "x", "", 0, 0)).await, Err(StreamError::InvalidRequest { .. })));
    assert!(matches!(s.append(&p, stamped(ct, "x", "D", 1 << 53, 0)).await, Err(StreamError::InvalidRequest { .. })));
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "m0m1m2e1b0s");
}

pub async fn close_semantics(b: &TestBackend) {
    let s = store(b, settings()).await;
    let ct = "text/plain";
    let p = path("close");
    s.create(&p, opts(ct)).await.unwrap();
    s.append(&p, stamped(ct, "first", "P", 0, 0)).await.unwrap();
    let closing = AppendRequest { close: Some(EndReason::Finished), ..stamped(ct, "final", "P", 0, 1) };
    let closed = s.append(&p, closing.clone()).await.unwrap();
    assert!(closed.ended_now);
    let end = closed.end.unwrap();
    assert_eq!((end.reason, end.final_offset), (EndReason::Finished, closed.tail));
    // Retry of the closing tuple (even with another body): duplicate success.
    let retry = AppendRequest { data: Bytes::from("other"), ..closing };
    let r = s.append(&p, retry).await.unwrap();
    assert!(r.duplicate && r.end == Some(end));
    // Another tuple, a plain append, or a keepalive: closed (409) with the final offset and the
    // incarnation of the ended stream the backend found (the HTTP layer's token of that offset).
    let incarnation = closed.incarnation.clone();
    assert!(!incarnation.is_empty());
    let refused = StreamError::Closed { end, incarnation };
    assert_eq!(s.append(&p, stamped(ct, "late", "P", 0, 2)).await, Err(refused.clone()));
    assert_eq!(s.append(&p, body(ct, "late")).await, Err(refused.clone()));
    assert_eq!(s.append(&p, stamped(ct, "x", "Q", 0, 0)).await, Err(refused.clone()));
    assert_eq!(s.keepalive(&p).await.err(), Some(refused));
    // Close-only is idempotent and reports the existing end.
    let again = s.close(&p, EndReason::Cancelled).await.unwrap();
    assert_eq!((again.end, again.ended_now), (Some(end), false));
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "firstfinal");
    let eof = s.read(&p, ReadFrom::At(end.final_offset)).await.unwrap();
    assert_eq!((eof.records.len(), eof.end), (0, Some(end)));
    // Close-only on an open stream keeps the tail.
    let q = path("close-only");
    s.create(&q, opts(ct)).await.unwrap();
    let t = s.append(&q, body(ct, "a")).await.unwrap().tail;
    let c = s.close(&q, EndReason::Finished).await.unwrap();
    assert_eq!((c.tail, c.ended_now), (t, true));
    assert_eq!(s.head(&q).await.unwrap().end, Some(EndState { reason: EndReason::Finished, final_offset: t }));
    // Delete a closed stream: gone (404).
    s.delete(&q).await.unwrap();
    assert!(matches!(s.head(&q).await, Err(StreamError::NotFound { .. })));
    assert!(matches!(s.delete(&q).await, Err(StreamError::NotFound { .. })));
}

pub async fn reader_outcomes(b: &TestBackend) {
    let s = store(b, settings()).await;
    let ct = "text/plain";
    let p = path("outcomes");
    assert_eq!(s.read(&p, ReadFrom::Start).await, Err(StreamError::NotFound { path: p.to_string() }));
    assert!(matches!(ReadFrom::parse("0,1"), Err(StreamError::MalformedOffset { .. })));
    s.create(&p, opts(ct)).await.unwrap();
    let o1 = s.append(&p, body(ct, "a")).await.unwrap().tail;
    let o2 = s.append(&p, body(ct, "b")).await.unwrap().tail;
    let o3 = s.append(&p, body(ct, "c")).await.unwrap().tail;
    let ahead = Offset::new(o3.ms + 1_000_000, 0);
    assert_eq!(s.read(&p, ReadFrom::At(ahead)).await, Err(StreamError::OffsetAhead { offset: ahead, tail: o3 }));
    // Retention: data through o1 dropped; earlier offsets are gone (410), -1 starts after it.
    assert_eq!(s.trim(&p, o1).await.unwrap(), o1);
    assert_eq!(
        s.read(&p, ReadFrom::At(Offset::ZERO)).await,
        Err(StreamError::OffsetGone { offset: Offset::ZERO, earliest: o1 })
    );
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "bc");
    assert_eq!(text(&s.read(&p, ReadFrom::At(o1)).await.unwrap()), "bc");
    // Data then EOF with the end reason.
    s.close(&p, EndReason::Cancelled).await.unwrap();
    let last = s.read(&p, ReadFrom::At(o2)).await.unwrap();
    assert_eq!(text(&last), "c");
    assert_eq!(last.end, Some(EndState { reason: EndReason::Cancelled, final_offset: o3 }));
    let eof = s.read_live(&p, ReadFrom::Now, 10 * SEC).await.unwrap();
    assert_eq!((eof.records.len(), eof.next_offset, eof.end.map(|e| e.reason)), (0, o3, Some(EndReason::Cancelled)));
}

pub async fn chunked_reads(b: &TestBackend) {
    let s = store(b, StreamStoreSettings { max_read_bytes: 10, ..settings() }).await;
    let p = path("chunks");
    s.create(&p, opts("text/plain")).await.unwrap();
    for part in ["aaaa", "bbbb", "cccc", "dddddddddddddddd"] {
        s.append(&p, body("text/plain", part)).await.unwrap();
    }
    let mut from = ReadFrom::Start;
    let mut pages = vec![];
    loop {
        let c = s.read(&p, from).await.unwrap();
        pages.push((text(&c), c.up_to_date));
        if c.up_to_date {
            break;
        }
        from = ReadFrom::At(c.next_offset);
    }
    // At most 10 bytes per page, but always at least one record.
    assert_eq!(pages, vec![("aaaabbbb".into(), false), ("cccc".into(), false), ("dddddddddddddddd".into(), true)]);
}

pub async fn ttl_and_expiry(b: &TestBackend) {
    let s = store(b, settings()).await;
    let sliding = path("ttl");
    let c = s.create(&sliding, CreateOptions { expiry: Expiry::TtlSecs(2), ..opts("text/plain") }).await.unwrap();
    assert_eq!(c.info.expiry, Expiry::TtlSecs(2));
    tokio::time::sleep(Duration::from_millis(1300)).await;
    s.read(&sliding, ReadFrom::Start).await.unwrap(); // a read restarts the window
    tokio::time::sleep(Duration::from_millis(1300)).await;
    s.head(&sliding).await.unwrap(); // alive: 1.3 s since the read; HEAD does not restart it
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(matches!(s.head(&sliding).await, Err(StreamError::NotFound { .. })));
    let at = path("expires-at");
    let deadline =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64 + 1500;
    s.create(&at, CreateOptions { expiry: Expiry::At(deadline), ..opts("text/plain") }).await.unwrap();
    assert_eq!(s.head(&at).await.unwrap().deadline, Some(deadline));
    s.append(&at, body("text/plain", "x")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1700)).await;
    assert!(matches!(s.append(&at, body("text/plain", "y")).await, Err(StreamError::NotFound { .. })));
    // An expired path can be created again (201).
    assert!(s.create(&at, opts("application/json")).await.unwrap().created);
}

pub async fn forks(b: &TestBackend) {
    let s = store(b, settings()).await;
    let ct = "text/plain";
    let src = path("src");
    s.create(&src, CreateOptions { initial: Some("A".into()), expiry: Expiry::TtlSecs(3600), ..opts(ct) })
        .await
        .unwrap();
    let at = s.append(&src, body(ct, "B")).await.unwrap().tail;
    s.append(&src, body(ct, "C")).await.unwrap();
    let fork = path("fork");
    let f = ForkFrom { source: src.clone(), offset: Some(at), sub_offset: 0 };
    let made = s.create(&fork, CreateOptions { fork: Some(f.clone()), ..Default::default() }).await.unwrap();
    assert!(made.created);
    assert_eq!((made.info.tail, made.info.content_type.as_str(), made.info.expiry), (at, ct, Expiry::TtlSecs(3600)));
    // Idempotent re-create; different fork origin conflicts.
    assert!(!s.create(&fork, CreateOptions { fork: Some(f.clone()), ..Default::default() }).await.unwrap().created);
    let other = ForkFrom { offset: Some(Offset::ZERO), ..f.clone() };
    assert!(matches!(
        s.create(&fork, CreateOptions { fork: Some(other), ..Default::default() }).await,
        Err(StreamError::Conflict { .. })
    ));
    let own = s.append(&fork, body(ct, "x")).await.unwrap().tail;
    assert!(own > at);
    s.append(&src, body(ct, "D")).await.unwrap();
    assert_eq!(text(&s.read(&fork, ReadFrom::Start).await.unwrap()), "ABx");
    assert_eq!(text(&s.read(&fork, ReadFrom::At(at)).await.unwrap()), "x");
    assert_eq!(text(&s.read(&src, ReadFrom::Start).await.unwrap()), "ABCD");
    // Same offsets as the source up to the fork point.
    assert_eq!(s.read(&fork, ReadFrom::Start).await.unwrap().records[1].offset, at);
    // Errors: missing source, offset past the tail, content type mismatch.
    let missing = ForkFrom { source: path("nope"), offset: None, sub_offset: 0 };
    assert!(matches!(
        s.create(&path("f2"), CreateOptions { fork: Some(missing), ..Default::default() }).await,
        Err(StreamError::NotFound { .. })
    ));
    let far = ForkFrom { offset: Some(Offset::new(own.ms + 10_000_000, 0)), ..f.clone() };
    assert!(matches!(
        s.create(&path("f3"), CreateOptions { fork: Some(far), ..Default::default() }).await,
        Err(StreamError::OffsetAhead { .. })
    ));
    let json = CreateOptions { fork: Some(f.clone()), ..opts("application/json") };
    assert!(matches!(s.create(&path("f4"), json).await, Err(StreamError::Conflict { .. })));
    // A closed source forks into an open stream; a fork has its own producer state.
    s.close(&src, EndReason::Finished).await.unwrap();
    let f5 = path("f5");
    let open = s
        .create(&f5, CreateOptions { fork: Some(ForkFrom { offset: None, ..f }), ..Default::default() })
        .await
        .unwrap();
    assert_eq!(open.info.end, None);
    assert_eq!(text(&s.read(&f5, ReadFrom::Start).await.unwrap()), "ABCD");
}

pub async fn fork_sub_offsets(b: &TestBackend) {
    let s = store(b, settings()).await;
    let src = path("sub-src");
    let first =
        s.create(&src, CreateOptions { initial: Some("first".into()), ..opts("text/plain") }).await.unwrap().info.tail;
    s.append(&src, stamped("text/plain", "second", "P", 0, 0)).await.unwrap();
    let fork = |off: Offset, sub: u64| CreateOptions {
        fork: Some(ForkFrom { source: src.clone(), offset: Some(off), sub_offset: sub }),
        initial: Some("XY".into()),
        ..Default::default()
    };
    let f = path("sub-fork");
    let made = s.create(&f, fork(first, 3)).await.unwrap();
    assert_eq!(text(&s.read(&f, ReadFrom::Start).await.unwrap()), "firstsecXY");
    let tail_read = s.read(&f, ReadFrom::At(made.info.tail)).await.unwrap();
    assert_eq!((tail_read.records.len(), tail_read.up_to_date), (0, true));
    assert!(matches!(s.create(&path("over"), fork(first, 7)).await, Err(StreamError::InvalidRequest { .. })));
    // Sub-offset 0 at the anchor: just the inherited prefix plus the initial body.
    let zero = path("sub-zero");
    s.create(&zero, fork(first, 0)).await.unwrap();
    assert_eq!(text(&s.read(&zero, ReadFrom::Start).await.unwrap()), "firstXY");
    // Producer state is not inherited: P seq 0 is a fresh accept on the fork.
    assert!(!s.append(&f, stamped("text/plain", "LO", "P", 0, 0)).await.unwrap().duplicate);
    // JSON: flattened messages of the next append.
    let js = path("sub-json");
    s.create(&js, CreateOptions { initial: Some(r#"[{"a":1},{"b":2},{"c":3}]"#.into()), ..opts("application/json") })
        .await
        .unwrap();
    let jf = path("sub-json-fork");
    let jfork = |sub| CreateOptions {
        fork: Some(ForkFrom { source: js.clone(), offset: Some(Offset::ZERO), sub_offset: sub }),
        ..Default::default()
    };
    s.create(&jf, jfork(2)).await.unwrap();
    assert_eq!(text(&s.read(&jf, ReadFrom::Start).await.unwrap()), r#"[{"a":1},{"b":2}]"#);
    assert!(matches!(s.create(&path("j-over"), jfork(4)).await, Err(StreamError::InvalidRequest { .. })));
}

pub async fn soft_delete_and_gc(b: &TestBackend) {
    let s = store(b, settings()).await;
    let ct = "text/plain";
    let l0 = path("l0");
    s.create(&l0, CreateOptions { initial: Some("A".into()), ..opts(ct) }).await.unwrap();
    let fork_of = |src: &StreamPath, data: &str| CreateOptions {
        fork: Some(ForkFrom { source: src.clone(), offset: None, sub_offset: 0 }),
        initial: Some(Bytes::from(data.to_string())),
        ..Default::default()
    };
    let l1 = path("l1");
    s.create(&l1, fork_of(&l0, "B")).await.unwrap();
    let l2 = path("l2");
    s.create(&l2, fork_of(&l1, "C")).await.unwrap();
    s.delete(&l1).await.unwrap();
    let gone = StreamError::Gone { path: l1.to_string() };
    assert_eq!(s.head(&l1).await, Err(gone.clone()));
    assert_eq!(s.read(&l1, ReadFrom::Start).await, Err(gone.clone()));
    assert_eq!(s.append(&l1, body(ct, "x")).await, Err(gone.clone()));
    assert_eq!(s.delete(&l1).await, Err(gone));
    assert!(matches!(s.create(&l1, opts(ct)).await, Err(StreamError::Conflict { .. })));
    assert!(matches!(s.create(&path("from-deleted"), fork_of(&l1, "")).await, Err(StreamError::Conflict { .. })));
    assert_eq!(text(&s.read(&l2, ReadFrom::Start).await.unwrap()), "ABC");
    assert_eq!(text(&s.read(&l0, ReadFrom::Start).await.unwrap()), "A");
    // Deleting the last fork collects soft-deleted ancestors (cascade); a live root stays.
    s.delete(&l0).await.unwrap();
    assert!(matches!(s.head(&l0).await, Err(StreamError::Gone { .. })));
    s.delete(&l2).await.unwrap();
    assert!(matches!(s.head(&l2).await, Err(StreamError::NotFound { .. })));
    assert!(matches!(s.head(&l1).await, Err(StreamError::NotFound { .. })));
    assert!(matches!(s.head(&l0).await, Err(StreamError::NotFound { .. })));
    assert!(s.create(&l1, opts(ct)).await.unwrap().created);
    // A failed fork (content type mismatch) takes no reference.
    let r = path("root");
    s.create(&r, opts(ct)).await.unwrap();
    let bad = CreateOptions { content_type: Some("application/json".into()), ..fork_of(&r, "") };
    assert!(s.create(&path("bad"), bad).await.is_err());
    s.delete(&r).await.unwrap();
    assert!(matches!(s.head(&r).await, Err(StreamError::NotFound { .. })));
}

pub async fn max_len(b: &TestBackend) {
    let s = store(b, settings()).await;
    let ct = "text/plain";
    let p = path("maxlen");
    let limits = RunLimits { max_len: Some(3), max_len_per_writer: Some(2), ..RunLimits::unlimited() };
    s.create(&p, CreateOptions { limits: Some(limits), ..opts(ct) }).await.unwrap();
    s.append(&p, stamped(ct, "a", "W", 0, 0)).await.unwrap();
    s.append(&p, stamped(ct, "b", "W", 0, 1)).await.unwrap();
    assert_eq!(
        s.append(&p, stamped(ct, "c", "W", 0, 2)).await,
        Err(StreamError::TooLong { limit: 2, scope: LimitScope::Writer })
    );
    s.keepalive(&p).await.unwrap(); // invisible: no event, no offset change
    s.append(&p, body(ct, "c")).await.unwrap();
    assert_eq!(s.append(&p, body(ct, "d")).await, Err(StreamError::TooLong { limit: 3, scope: LimitScope::Stream }));
    let info = s.head(&p).await.unwrap();
    assert_eq!(info.len, 3);
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "abc");
}

/// Appends that the Redis script's fast path (`write_fast.lua`) must hand to the full script,
/// and the state a fast-path append leaves behind (the same as the full script's).
pub async fn fast_path_refusals_and_state(b: &TestBackend) {
    let s = store(b, settings()).await;
    let ct = "text/plain";
    let src = path("fp-src");
    s.create(&src, CreateOptions { initial: Some("A".into()), ..opts(ct) }).await.unwrap();
    // A soft-deleted stream (a fork still references it) has data but no stream key: nothing is
    // appended, and its stream key is not re-created.
    let soft = path("fp-soft");
    let fork = CreateOptions {
        fork: Some(ForkFrom { source: src.clone(), offset: None, sub_offset: 0 }),
        initial: Some("B".into()),
        ..Default::default()
    };
    s.create(&soft, fork.clone()).await.unwrap();
    s.append(&soft, stamped(ct, "C", "P", 3, 0)).await.unwrap();
    let child = path("fp-child");
    s.create(
        &child,
        CreateOptions {
            fork: Some(ForkFrom { source: soft.clone(), ..fork.fork.clone().unwrap() }),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    s.delete(&soft).await.unwrap();
    let gone = StreamError::Gone { path: soft.to_string() };
    assert_eq!(s.append(&soft, body(ct, "x")).await, Err(gone.clone()));
    assert_eq!(s.append(&soft, stamped(ct, "x", "P", 3, 1)).await, Err(gone.clone()));
    if let Some(mut c) = raw(b).await {
        let n: u64 =
            redis::cmd("EXISTS").arg(format!("baton:s:{{{}}}", soft.as_str())).query_async(&mut c).await.unwrap();
        assert_eq!(n, 0, "a refused append re-created the stream key");
    }
    assert_eq!(text(&s.read(&child, ReadFrom::Start).await.unwrap()), "ABC");

    // Producer checks on a stream with data: every outcome, then the stored state.
    let p = path("fp-producer");
    s.create(&p, CreateOptions { initial: Some("0".into()), ..opts(ct) }).await.unwrap();
    let a = s.append(&p, stamped(ct, "a", "W", 10, 0)).await.unwrap();
    let b1 = s.append(&p, stamped(ct, "b", "W", 10, 1)).await.unwrap();
    assert_eq!((b1.duplicate, b1.producer, b1.producer_offset), (false, Some((10, 1)), Some(b1.tail)));
    assert!(a.tail < b1.tail);
    let dup = s.append(&p, stamped(ct, "b", "W", 10, 1)).await.unwrap();
    assert_eq!((dup.duplicate, dup.producer_offset, dup.tail), (true, Some(b1.tail), b1.tail));
    assert!(matches!(
        s.append(&p, stamped(ct, "c", "W", 10, 3)).await,
        Err(StreamError::SequenceGap { expected: 2, received: 3 })
    ));
    assert!(matches!(s.append(&p, stamped(ct, "c", "W", 9, 2)).await, Err(StreamError::Fenced { .. })));
    assert!(matches!(s.append(&p, stamped(ct, "c", "W", 11, 1)).await, Err(StreamError::EpochMustStartAtZero { .. })));
    assert!(matches!(
        s.append(&p, stamped(ct, "c", "V", 0, 1)).await,
        Err(StreamError::SequenceGap { expected: 0, received: 1 })
    ));
    let c1 = s.append(&p, stamped(ct, "c", "W", 11, 0)).await.unwrap();
    let d1 = s.append(&p, body(ct, "d")).await.unwrap();
    assert!(matches!(s.append(&p, body("application/json", "1")).await, Err(StreamError::Conflict { .. })));
    let info = s.head(&p).await.unwrap();
    assert_eq!((info.len, info.tail), (5, d1.tail));
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "0abcd");
    if let Some(mut c) = raw(b).await {
        let m = format!("baton:s:{{{}}}:m", p.as_str());
        let state: String = redis::cmd("HGET").arg(&m).arg("p:W").query_async(&mut c).await.unwrap();
        // No per-writer max length: the state keeps no count.
        assert_eq!(state, format!("11:0::{}", c1.tail.to_redis_id()));
        let (cnt, tail, lw): (String, String, String) =
            redis::cmd("HMGET").arg(&m).arg("cnt").arg("tail").arg("lw").query_async(&mut c).await.unwrap();
        assert_eq!((cnt.as_str(), tail), ("5", d1.tail.to_redis_id()));
        assert_eq!(lw, d1.tail.ms.to_string());
    }
    // An ended stream refuses a stamped append in sequence.
    s.close(&p, EndReason::Finished).await.unwrap();
    assert!(matches!(s.append(&p, stamped(ct, "e", "W", 11, 1)).await, Err(StreamError::Closed { .. })));
    // JSON messages counted through the fast path.
    let j = path("fp-json");
    s.create(&j, CreateOptions { initial: Some("[1]".into()), ..opts("application/json") }).await.unwrap();
    s.append(&j, body("application/json", "[2,3]")).await.unwrap();
    s.append(&j, stamped("application/json", "[4,5,6]", "J", 0, 0)).await.unwrap();
    s.append(&j, stamped("application/json", "7", "J", 0, 1)).await.unwrap();
    assert_eq!(text(&s.read(&j, ReadFrom::Start).await.unwrap()), "[1,2,3,4,5,6,7]");
}

/// The producer states the fast path reads and writes: the count kept (and enforced) only with a
/// per-writer max length, whether the state was left by a claim, the full script or the fast
/// path; the largest epoch and seq (2^53-1) in sequence, duplicate and gap; a first write (no
/// state) at seq 0 only.
pub async fn fast_path_producer_states(b: &TestBackend) {
    let s = store(b, settings()).await;
    let ct = "text/plain";
    let state = |p: &StreamPath, id: &str| {
        let (m, f) = (format!("baton:s:{{{}}}:m", p.as_str()), format!("p:{id}"));
        async move {
            let mut c = raw(b).await?;
            let v: Option<String> = redis::cmd("HGET").arg(m).arg(f).query_async(&mut c).await.unwrap();
            v
        }
    };
    // With a per-writer max length of 3: first write without state, then the fast path.
    let p = path("fps-mlw");
    let limits = RunLimits { max_len_per_writer: Some(3), ..RunLimits::unlimited() };
    s.create(&p, CreateOptions { limits: Some(limits), initial: Some("0".into()), ..opts(ct) }).await.unwrap();
    assert!(matches!(
        s.append(&p, stamped(ct, "x", "W", 0, 1)).await,
        Err(StreamError::SequenceGap { expected: 0, received: 1 })
    ));
    s.append(&p, stamped(ct, "a", "W", 0, 0)).await.unwrap();
    s.append(&p, stamped(ct, "b", "W", 0, 1)).await.unwrap();
    let c = s.append(&p, stamped(ct, "c", "W", 0, 2)).await.unwrap();
    if b.redis_config().is_some() {
        assert_eq!(state(&p, "W").await.unwrap(), format!("0:2:3:{}", c.tail.to_redis_id()));
    }
    assert_eq!(
        s.append(&p, stamped(ct, "d", "W", 0, 3)).await,
        Err(StreamError::TooLong { limit: 3, scope: LimitScope::Writer })
    );
    // A new epoch keeps the count.
    assert_eq!(
        s.append(&p, stamped(ct, "d", "W", 1, 0)).await,
        Err(StreamError::TooLong { limit: 3, scope: LimitScope::Writer })
    );
    let dup = s.append(&p, stamped(ct, "c", "W", 0, 2)).await.unwrap();
    assert_eq!((dup.duplicate, dup.producer_offset), (true, Some(c.tail)));
    // Another writer has its own count.
    s.append(&p, stamped(ct, "e", "V", 7, 0)).await.unwrap();
    s.append(&p, stamped(ct, "f", "V", 7, 1)).await.unwrap();
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "0abcef");

    // A run: the open claims the producer (state with a count, no mlw), then the fast path.
    let r = path("fps-run");
    let prod = s.open(&r, OpenOptions { limits: Some(RunLimits::default()), ..Default::default() }).await.unwrap();
    let first = prod.append(Bytes::from_static(b"1")).await.unwrap();
    let second = prod.append(Bytes::from_static(b"2")).await.unwrap();
    assert!(first < second);
    if b.redis_config().is_some() {
        assert_eq!(state(&r, prod.id()).await.unwrap(), format!("{}:1::{}", prod.epoch(), second.to_redis_id()));
    }

    // The largest stamp, through the fast path; then one above it is refused.
    let q = path("fps-max");
    const MAX: u64 = (1 << 53) - 1;
    s.create(&q, CreateOptions { initial: Some("0".into()), ..opts(ct) }).await.unwrap();
    s.append(&q, stamped(ct, "a", "Z", MAX, 0)).await.unwrap();
    s.append(&q, stamped(ct, "b", "Z", MAX, 1)).await.unwrap();
    s.append(&q, stamped(ct, "c", "Z", MAX, 2)).await.unwrap();
    let dup = s.append(&q, stamped(ct, "b", "Z", MAX, 1)).await.unwrap();
    assert!(dup.duplicate);
    assert!(matches!(
        s.append(&q, stamped(ct, "d", "Z", MAX, 4)).await,
        Err(StreamError::SequenceGap { expected: 3, received: 4 })
    ));
    assert!(matches!(s.append(&q, stamped(ct, "d", "Z", MAX - 1, 3)).await, Err(StreamError::Fenced { .. })));
    assert!(matches!(s.append(&q, stamped(ct, "d", "Z", MAX + 1, 0)).await, Err(StreamError::InvalidRequest { .. })));
    assert!(matches!(s.append(&q, stamped(ct, "d", "Y", 0, MAX + 1)).await, Err(StreamError::InvalidRequest { .. })));
    s.append(&q, stamped(ct, "d", "Y", 5, 0)).await.unwrap();
    s.append(&q, stamped(ct, "e", "Y", 5, 1)).await.unwrap();
    assert!(matches!(s.append(&q, stamped(ct, "f", "Y", 6, 1)).await, Err(StreamError::EpochMustStartAtZero { .. })));
    assert_eq!(text(&s.read(&q, ReadFrom::Start).await.unwrap()), "0abcde");
    if b.redis_config().is_some() {
        assert!(state(&q, "Z").await.unwrap().starts_with("9007199254740991:2::"));
    }
}
