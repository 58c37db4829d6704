//! Edge cases of issue #14 ("Hardening the edges"): what `max_len` counts, re-creates with other
//! run limits, a zero silence timeout, offsets of a deleted stream read from its successor.

use std::time::Duration;

use bytes::Bytes;

use super::*;

fn opts(ct: &str) -> CreateOptions {
    CreateOptions { content_type: Some(ct.into()), ..Default::default() }
}

fn body(ct: &str, data: &str) -> AppendRequest {
    AppendRequest { data: Bytes::from(data.to_string()), content_type: Some(ct.into()), ..Default::default() }
}

/// `max_len` counts messages: the elements of a JSON array append each count, on the single-append
/// path (Redis: `write_fast.lua`) and the general one (here forced with `Stream-Seq`) alike, per
/// stream and per writer.
pub async fn max_len_counts_json_messages(b: &TestBackend) {
    let s = store(b, settings()).await;
    let ct = "application/json";
    let limits = |n| RunLimits { max_len: Some(n), ..RunLimits::unlimited() };
    let too_long = |n| Err(StreamError::TooLong { limit: n, scope: LimitScope::Stream });
    // Fast path: two batches of two messages do not fit in 3.
    let p = path("ml-json");
    s.create(&p, CreateOptions { limits: Some(limits(3)), ..opts(ct) }).await.unwrap();
    s.append(&p, body(ct, "[1,2]")).await.unwrap();
    assert_eq!(s.append(&p, body(ct, "[3,4]")).await.map(|a| a.tail), too_long(3));
    s.append(&p, body(ct, "3")).await.unwrap();
    assert_eq!(s.append(&p, body(ct, "4")).await.map(|a| a.tail), too_long(3));
    assert_eq!(s.head(&p).await.unwrap().len, 3);
    assert_eq!(s.read(&p, ReadFrom::Start).await.unwrap().body(), Bytes::from("[1,2,3]"));
    // General path (Stream-Seq), and messages of the initial body count too.
    let g = path("ml-json-general");
    s.create(&g, CreateOptions { limits: Some(limits(4)), initial: Some("[1,2]".into()), ..opts(ct) }).await.unwrap();
    let seq = |data: &str, n: &str| AppendRequest { stream_seq: Some(n.into()), ..body(ct, data) };
    assert_eq!(s.append(&g, seq("[3,4,5]", "a")).await.map(|a| a.tail), too_long(4));
    s.append(&g, seq("[3,4]", "b")).await.unwrap();
    assert_eq!(s.append(&g, seq("5", "c")).await.map(|a| a.tail), too_long(4));
    assert_eq!(s.head(&g).await.unwrap().len, 4);
    // Per writer: a producer's array counts its elements.
    let w = path("ml-json-writer");
    let lw = RunLimits { max_len_per_writer: Some(3), ..RunLimits::unlimited() };
    s.create(&w, CreateOptions { limits: Some(lw), ..opts(ct) }).await.unwrap();
    let stamped = |data: &str, seq| AppendRequest {
        producer: Some(ProducerStamp { id: "W".into(), epoch: 0, seq }),
        ..body(ct, data)
    };
    s.append(&w, stamped("[1,2]", 0)).await.unwrap();
    assert_eq!(
        s.append(&w, stamped("[3,4]", 1)).await.map(|a| a.tail),
        Err(StreamError::TooLong { limit: 3, scope: LimitScope::Writer })
    );
    s.append(&w, stamped("3", 1)).await.unwrap();
    // Binary streams: one message per append, whatever its bytes.
    let t = path("ml-text");
    s.create(&t, CreateOptions { limits: Some(limits(2)), ..opts("text/plain") }).await.unwrap();
    s.append(&t, body("text/plain", "[1,2]")).await.unwrap();
    s.append(&t, body("text/plain", "[3,4]")).await.unwrap();
    assert_eq!(s.append(&t, body("text/plain", "x")).await.map(|a| a.tail), too_long(2));
}

/// A re-create that asks for other run limits is a conflict naming the limit and both values;
/// the same limits, or none given, are the idempotent re-create.
pub async fn recreate_with_other_limits_conflicts(b: &TestBackend) {
    let s = store(b, settings()).await;
    let ct = "text/plain";
    let p = path("limits");
    let l = RunLimits {
        silence_timeout: Some(Duration::from_secs(60)),
        max_run: Some(Duration::from_secs(3600)),
        done_ttl: None,
        max_len: Some(10),
        max_len_per_writer: None,
    };
    s.create(&p, CreateOptions { limits: Some(l), ..opts(ct) }).await.unwrap();
    assert!(!s.create(&p, CreateOptions { limits: Some(l), ..opts(ct) }).await.unwrap().created);
    assert!(!s.create(&p, opts(ct)).await.unwrap().created);
    let cases = [
        (
            RunLimits { silence_timeout: Some(Duration::from_secs(30)), ..l },
            "silence timeout (Baton-Silence-Timeout)",
            "60s",
            "30s",
        ),
        (RunLimits { silence_timeout: None, ..l }, "silence timeout (Baton-Silence-Timeout)", "60s", "none"),
        (RunLimits { max_run: Some(Duration::from_secs(60)), ..l }, "max run (Baton-Max-Run)", "3600s", "60s"),
        (RunLimits { done_ttl: Some(Duration::from_secs(5)), ..l }, "done TTL (Baton-Done-TTL)", "none", "5s"),
        (RunLimits { max_len: Some(3), ..l }, "max len (Baton-Max-Len)", "10", "3"),
        (RunLimits { max_len_per_writer: Some(3), ..l }, "max len per writer", "none", "3"),
    ];
    for (other, name, have, want) in cases {
        let e = s.create(&p, CreateOptions { limits: Some(other), ..opts(ct) }).await.unwrap_err();
        let StreamError::Conflict { reason } = &e else { panic!("{e:?}") };
        assert!(
            reason.starts_with(&format!(
                "{name} differs from the existing stream's: it has {have}, the request asks for {want}"
            )),
            "{reason}"
        );
    }
    // Nothing changed.
    assert_eq!(s.head(&p).await.unwrap().limits, l);
}

/// A silence timeout of 0 would end a stream at once: refused (`None` disables it).
pub async fn zero_silence_timeout_is_refused(b: &TestBackend) {
    let s = store(b, settings()).await;
    let zero = RunLimits { silence_timeout: Some(Duration::ZERO), ..RunLimits::unlimited() };
    let p = path("sil0");
    let e = s.create(&p, CreateOptions { limits: Some(zero), ..opts("text/plain") }).await.unwrap_err();
    assert!(matches!(&e, StreamError::InvalidRequest { reason } if reason.contains("none to disable")), "{e:?}");
    assert!(matches!(s.head(&p).await, Err(StreamError::NotFound { .. })));
    let opened = s.open(&p, OpenOptions { limits: Some(zero), ..Default::default() }).await;
    assert!(matches!(opened, Err(StreamError::InvalidRequest { .. })));
}

/// A max run of 0 would delete a stream as soon as it is created: refused (`None` disables it;
/// before this, the create succeeded and the stream was gone at once).
pub async fn zero_max_run_is_refused(b: &TestBackend) {
    let s = store(b, settings()).await;
    let zero = RunLimits { max_run: Some(Duration::ZERO), ..RunLimits::unlimited() };
    let p = path("run0");
    let e = s.create(&p, CreateOptions { limits: Some(zero), ..opts("text/plain") }).await.unwrap_err();
    assert!(matches!(&e, StreamError::InvalidRequest { reason } if reason.contains("none for no limit")), "{e:?}");
    assert!(matches!(s.head(&p).await, Err(StreamError::NotFound { .. })));
    let opened = s.open(&p, OpenOptions { limits: Some(zero), ..Default::default() }).await;
    assert!(matches!(opened, Err(StreamError::InvalidRequest { .. })));
}

fn tagged(offset: Offset, incarnation: &str) -> ReadFrom {
    ReadFrom::parse(&offset.token(incarnation)).unwrap()
}

/// An offset token of a deleted stream is refused by the stream re-created at its path (410),
/// whether it lies within the new data, ahead of it, or at its start; tokens of the current
/// incarnation, untagged offsets, `-1` and `now` read as before; a fork takes its source's tokens.
pub async fn offsets_of_a_deleted_stream_are_refused(b: &TestBackend) {
    let s = store(b, settings()).await;
    let ct = "text/plain";
    let p = path("reincarnated");
    let old = s.create(&p, CreateOptions { initial: Some("old-1".into()), ..opts(ct) }).await.unwrap().info;
    let a = s.append(&p, body(ct, "old-2")).await.unwrap();
    assert_eq!(a.incarnation, old.incarnation);
    let old_early = tagged(old.tail, &old.incarnation);
    let old_late = tagged(a.tail, &a.incarnation);
    assert_eq!(text(&s.read(&p, old_early).await.unwrap()), "old-2");
    s.delete(&p).await.unwrap();
    // The new stream's data lies after both old offsets (later entry ids), and one is ahead of it.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let new = s.create(&p, CreateOptions { initial: Some("new-1".into()), ..opts(ct) }).await.unwrap().info;
    s.append(&p, body(ct, "new-2")).await.unwrap();
    assert_ne!(new.incarnation, old.incarnation);
    for from in [old_early, old_late, tagged(Offset::ZERO, &old.incarnation)] {
        let e = s.read(&p, from).await.unwrap_err();
        assert!(matches!(e, StreamError::OffsetIncarnation { .. }), "{from:?}: {e:?}");
        assert_eq!(e.status(), 410);
        assert!(matches!(s.read_live(&p, from, SEC).await, Err(StreamError::OffsetIncarnation { .. })));
        assert!(matches!(s.subscribe(&p, from).next(SEC).await, Err(StreamError::OffsetIncarnation { .. })));
    }
    let ahead = tagged(Offset::new(new.tail.ms + 1_000_000, 0), &old.incarnation);
    assert!(matches!(s.read(&p, ahead).await, Err(StreamError::OffsetIncarnation { .. })));
    // The current incarnation's tokens, untagged offsets and the sentinels work.
    assert_eq!(text(&s.read(&p, tagged(new.tail, &new.incarnation)).await.unwrap()), "new-2");
    assert_eq!(text(&s.read(&p, ReadFrom::At(new.tail)).await.unwrap()), "new-2");
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "new-1new-2");
    assert!(s.read(&p, ReadFrom::Now).await.unwrap().records.is_empty());
    // A current token ahead of the tail is still `OffsetAhead`.
    let far = Offset::new(new.tail.ms + 1_000_000, 0);
    assert!(matches!(s.read(&p, tagged(far, &new.incarnation)).await, Err(StreamError::OffsetAhead { .. })));
    // A fork accepts its source's tokens (same positions up to the fork point) and hands out the
    // same token for its tail.
    let f = path("reincarnated-fork");
    let fork = ForkFrom { source: p.clone(), offset: Some(new.tail), sub_offset: 0 };
    let made = s.create(&f, CreateOptions { fork: Some(fork), ..Default::default() }).await.unwrap().info;
    assert_eq!(made.tail.token(&made.incarnation), new.tail.token(&new.incarnation));
    assert_eq!(text(&s.read(&f, tagged(Offset::ZERO, &new.incarnation)).await.unwrap()), "new-1");
    assert!(matches!(s.read(&f, old_early).await, Err(StreamError::OffsetIncarnation { .. })));
}
