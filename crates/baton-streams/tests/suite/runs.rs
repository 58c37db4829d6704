//! Run semantics (seed 001): one end, idempotent producers, fencing, silence, spawn.

use std::time::Instant;

use baton_redis::redis::{self, Value};
use bytes::Bytes;

use super::*;

fn limits(silence_ms: Option<u64>) -> Option<RunLimits> {
    Some(RunLimits { silence_timeout: silence_ms.map(Duration::from_millis), ..RunLimits::unlimited() })
}

fn open_opts(id: &str, silence_ms: Option<u64>) -> OpenOptions {
    OpenOptions {
        content_type: Some("text/plain".into()),
        producer_id: Some(id.into()),
        limits: limits(silence_ms),
        ..Default::default()
    }
}

/// Number of hidden end entries in the Redis stream key (exactly one final entry).
async fn end_entries(conn: &mut baton_redis::RedisConn, p: &StreamPath) -> usize {
    let key = format!("baton:s:{{{}}}", p.as_str());
    let v: Value = redis::cmd("XRANGE").arg(&key).arg("-").arg("+").query_async(conn).await.unwrap();
    let Value::Array(entries) = v else { panic!("{v:?}") };
    entries
        .iter()
        .filter(|e| matches!(e, Value::Array(kv) if matches!(&kv[1], Value::Array(f) if f.first() == Some(&Value::BulkString(b"e".to_vec())))))
        .count()
}

pub async fn finish_cancel_producer_lost_race(b: &TestBackend) {
    let s = store(b, settings()).await;
    let mut conn = raw(b).await;
    let mut wins = [0usize; 3];
    for round in 0..1000 {
        let p = path("race");
        let producer = s.open(&p, open_opts("P", Some(60_000))).await.unwrap();
        let tail = producer.append(Bytes::from(format!("event {round}"))).await.unwrap();
        let (s1, s2, p1, p2) = (s.clone(), s.clone(), p.clone(), p.clone());
        let finish = tokio::spawn(async move { producer.finish().await });
        let cancel = tokio::spawn(async move { s1.end(&p1, EndReason::Cancelled).await });
        let lost = tokio::spawn(async move { s2.end(&p2, EndReason::ProducerLost).await });
        let results = [finish.await.unwrap().unwrap(), cancel.await.unwrap().unwrap(), lost.await.unwrap().unwrap()];
        let winners: Vec<usize> = (0..3).filter(|&i| results[i].ended_now).collect();
        assert_eq!(winners.len(), 1, "round {round}: {results:?}");
        wins[winners[0]] += 1;
        let end = results[0].end;
        assert!(results.iter().all(|r| r.end == end), "round {round}: {results:?}");
        assert_eq!(end.final_offset, tail);
        assert_eq!(end.reason, [EndReason::Finished, EndReason::Cancelled, EndReason::ProducerLost][winners[0]]);
        assert_eq!(s.head(&p).await.unwrap().end, Some(end));
        if let Some(c) = conn.as_mut() {
            assert_eq!(end_entries(c, &p).await, 1, "round {round}");
        }
    }
    assert_eq!(wins.iter().sum::<usize>(), 1000);
}

pub async fn lost_reply_and_retried_open(b: &TestBackend) {
    let s = store(b, settings()).await;
    let p = path("retry");
    let producer = s.open(&p, open_opts("R", None)).await.unwrap();
    assert!(producer.created());
    let first = producer.append("one").await.unwrap();
    // The same request sent twice (its first reply lost): written once, same offset reported.
    let req = AppendRequest {
        data: Bytes::from("two"),
        content_type: Some("text/plain".into()),
        producer: Some(ProducerStamp { id: "other".into(), epoch: 0, seq: 0 }),
        ..Default::default()
    };
    let a = s.append(&p, req.clone()).await.unwrap();
    let again = s.append(&p, req).await.unwrap();
    assert_eq!((a.duplicate, again.duplicate), (false, true));
    assert_eq!(again.producer_offset, Some(a.tail));
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "onetwo");
    // A retried open joins the stream: no reset of data, tail or state; a newer epoch.
    let reopened = s.open(&p, open_opts("R", None)).await.unwrap();
    assert!(!reopened.created());
    assert_eq!(reopened.epoch(), producer.epoch() + 1);
    let info = s.head(&p).await.unwrap();
    assert_eq!((info.tail, info.len, info.end), (a.tail, 2, None));
    assert!(first < a.tail);
    reopened.append("three").await.unwrap();
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "onetwothree");
}

pub async fn zombie_cancel_and_recreate_fencing(b: &TestBackend) {
    let s = store(b, settings()).await;
    let p = path("zombie");
    let old = s.open(&p, open_opts("W", None)).await.unwrap();
    old.append("a").await.unwrap();
    let new = s.open(&p, open_opts("W", None)).await.unwrap(); // a restart bumps the epoch
    new.append("b").await.unwrap();
    assert_eq!(old.append("zombie").await, Err(StreamError::Fenced { epoch: 0, current_epoch: 1 }));
    assert_eq!(old.keepalive().await, Err(StreamError::Fenced { epoch: 0, current_epoch: 1 }));
    // Appends after a cancel are refused with the final offset.
    let tail = s.head(&p).await.unwrap().tail;
    let cancelled = s.end(&p, EndReason::Cancelled).await.unwrap();
    let end = EndState { reason: EndReason::Cancelled, final_offset: tail };
    assert_eq!(cancelled, Ended { end, ended_now: true });
    let inc = s.head(&p).await.unwrap().incarnation;
    assert_eq!(new.append("c").await, Err(StreamError::Closed { end, incarnation: inc }));
    assert_eq!(new.finish().await.unwrap(), Ended { end, ended_now: false });
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "ab");
    // Opening an ended run is refused.
    assert!(matches!(s.open(&p, open_opts("W", None)).await, Err(StreamError::Closed { .. })));
    // Deleted and re-created at the same path: the old producer is refused.
    let q = path("recreated");
    let before = s.open(&q, open_opts("X", None)).await.unwrap();
    before.append("old").await.unwrap();
    s.delete(&q).await.unwrap();
    s.create(&q, CreateOptions { content_type: Some("text/plain".into()), ..Default::default() }).await.unwrap();
    assert_eq!(before.append("stale").await, Err(StreamError::NotFound { path: q.to_string() }));
    assert!(matches!(before.finish().await, Err(StreamError::NotFound { .. })));
    let fresh = s.read(&q, ReadFrom::Start).await.unwrap();
    assert_eq!((fresh.records.len(), fresh.end), (0, None));
}

/// `end_fenced`: ends the stream (after its entry, atomically) only while the producer is at the
/// given epoch (`None`: never claimed); an ended stream answers with its end first; a fenced or
/// refused end writes nothing and leaves the producer's state as it was.
pub async fn an_end_fenced_to_a_producer_epoch(b: &TestBackend) {
    let s = store(b, settings()).await;
    let p = path("fenced-end");
    s.create(&p, CreateOptions { content_type: Some("text/plain".into()), ..Default::default() }).await.unwrap();
    let entry = || Some((Bytes::from("error: stale"), "text/plain".to_string()));
    // Never claimed: only `None` passes.
    assert_eq!(s.producer_epoch(&p, "W").await.unwrap(), None);
    assert_eq!(
        s.end_fenced(&p, EndReason::Finished, entry(), "W", Some(0)).await,
        Err(StreamError::Fenced { epoch: 0, current_epoch: 0 })
    );
    let first = s.open(&p, open_opts("W", None)).await.unwrap();
    first.append("a").await.unwrap();
    let second = s.open(&p, open_opts("W", None)).await.unwrap();
    second.append("b").await.unwrap();
    assert_eq!(s.producer_epoch(&p, "W").await.unwrap(), Some(1));
    // The holder of epoch 0 (or of none) cannot end it any more: nothing written.
    for stale in [None, Some(0)] {
        assert_eq!(
            s.end_fenced(&p, EndReason::Finished, entry(), "W", stale).await,
            Err(StreamError::Fenced { epoch: stale.unwrap_or(0), current_epoch: 1 })
        );
    }
    assert_eq!(s.head(&p).await.unwrap().end, None);
    // A wrong content type for the entry is refused, nothing written.
    assert!(matches!(
        s.end_fenced(&p, EndReason::Finished, Some(("{}".into(), "application/json".into())), "W", Some(1)).await,
        Err(StreamError::Conflict { .. })
    ));
    // The current epoch's end: the entry, then the end, in one step; the producer goes on in
    // sequence (its state untouched) until the end refuses it.
    let ended = s.end_fenced(&p, EndReason::Finished, entry(), "W", Some(1)).await.unwrap();
    let tail = s.head(&p).await.unwrap().tail;
    assert_eq!(ended, Ended { end: EndState { reason: EndReason::Finished, final_offset: tail }, ended_now: true });
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "aberror: stale");
    let inc = s.head(&p).await.unwrap().incarnation;
    assert_eq!(second.append("c").await, Err(StreamError::Closed { end: ended.end, incarnation: inc }));
    // Ended: every later end is told that end (fenced or not), nothing written.
    for e in [None, Some(0), Some(1)] {
        let again = s.end_fenced(&p, EndReason::Cancelled, entry(), "W", e).await.unwrap();
        assert_eq!(again, Ended { end: ended.end, ended_now: false });
    }
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "aberror: stale");
    // A close-only fenced end; missing streams.
    let q = path("fenced-close");
    let w = s.open(&q, open_opts("W", None)).await.unwrap();
    let cancelled = s.end_fenced(&q, EndReason::Cancelled, None, "W", Some(w.epoch())).await.unwrap();
    assert_eq!((cancelled.end.reason, cancelled.ended_now), (EndReason::Cancelled, true));
    let missing = path("fenced-missing");
    assert!(matches!(
        s.end_fenced(&missing, EndReason::Finished, None, "W", None).await,
        Err(StreamError::NotFound { .. })
    ));
    assert!(matches!(s.producer_epoch(&missing, "W").await, Err(StreamError::NotFound { .. })));
}

pub async fn keepalive_and_silence(b: &TestBackend) {
    let s = store(b, settings()).await;
    let p = path("silence");
    let producer = s.open(&p, open_opts("K", Some(400))).await.unwrap();
    let tail = producer.append("x").await.unwrap();
    // Idle for 3x the silence timeout, but keeping alive: not ended.
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1200) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        producer.keepalive().await.unwrap();
    }
    let info = s.head(&p).await.unwrap();
    assert_eq!((info.end, info.tail, info.len), (None, tail, 1));
    // Silent: a live reader sees producer_lost within silence_timeout + 1 s.
    let silent_since = Instant::now();
    let eof = s.read_live(&p, ReadFrom::Now, 10 * SEC).await.unwrap();
    let waited = silent_since.elapsed();
    let end = EndState { reason: EndReason::ProducerLost, final_offset: tail };
    assert_eq!(eof.end, Some(end));
    assert!(waited <= Duration::from_millis(1400), "ended after {waited:?}");
    let inc = s.head(&p).await.unwrap().incarnation;
    assert_eq!(producer.append("late").await, Err(StreamError::Closed { end, incarnation: inc }));
    assert_eq!(producer.finish().await.unwrap(), Ended { end, ended_now: false });
}

pub async fn done_ttl_only_shortens(b: &TestBackend) {
    let s = store(b, settings()).await;
    // done_ttl longer than what is left of max_run: the end does not extend the lifetime.
    let p = path("short");
    let l = RunLimits {
        max_run: Some(Duration::from_secs(3)),
        done_ttl: Some(Duration::from_secs(60)),
        ..RunLimits::unlimited()
    };
    let made = s.create(&p, CreateOptions { limits: Some(l), ..Default::default() }).await.unwrap();
    let before = made.info.deadline.unwrap();
    s.close(&p, EndReason::Finished).await.unwrap();
    assert_eq!(s.head(&p).await.unwrap().deadline, Some(before));
    // done_ttl shorter: the stream disappears done_ttl after its end.
    let q = path("done");
    let l = RunLimits {
        max_run: Some(Duration::from_secs(600)),
        done_ttl: Some(Duration::from_millis(800)),
        ..RunLimits::unlimited()
    };
    s.create(&q, CreateOptions { limits: Some(l), ..Default::default() }).await.unwrap();
    s.close(&q, EndReason::Finished).await.unwrap();
    let d = s.head(&q).await.unwrap().deadline.unwrap();
    assert!(d < made.info.created_at + 600_000);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(matches!(s.head(&q).await, Err(StreamError::NotFound { .. })));
}

pub async fn spawn_outcomes(b: &TestBackend) {
    let s = store(b, settings()).await;
    // Ok => finished.
    let p = path("spawn-ok");
    let h = s.spawn(p.clone(), open_opts("S", Some(2_000)), |pr: Producer| async move {
        pr.append("a").await?;
        pr.append("b").await?;
        Ok::<_, StreamError>(())
    });
    let ended = h.join().await.unwrap();
    let tail = s.head(&p).await.unwrap().tail;
    assert_eq!(ended, Ended { end: EndState { reason: EndReason::Finished, final_offset: tail }, ended_now: true });
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "ab");
    // Err => an error entry, then finished.
    let q = path("spawn-err");
    let h = s.spawn(q.clone(), open_opts("S", Some(2_000)), |pr: Producer| async move {
        pr.append("a").await.unwrap();
        Err::<(), _>("boom")
    });
    assert_eq!(h.join().await.unwrap().end.reason, EndReason::Finished);
    assert_eq!(text(&s.read(&q, ReadFrom::Start).await.unwrap()), "aerror: boom");
    // Cancelled in this process => cancelled; the task is stopped.
    let r = path("spawn-cancel");
    let h = s.spawn(r.clone(), open_opts("S", Some(2_000)), |pr: Producer| async move {
        loop {
            pr.append("tick").await?;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        #[allow(unreachable_code)]
        Ok::<_, StreamError>(())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    h.cancel();
    let ended = h.join().await.unwrap();
    assert_eq!((ended.end.reason, ended.ended_now), (EndReason::Cancelled, true));
    assert_eq!(s.head(&r).await.unwrap().end, Some(ended.end));
    // A quiet task is kept alive by keepalives, and stopped when someone else ends the run.
    let q2 = path("spawn-quiet");
    let h = s.spawn(q2.clone(), open_opts("S", Some(300)), |_pr: Producer| async move {
        tokio::time::sleep(Duration::from_secs(30)).await;
        Ok::<_, StreamError>(())
    });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(s.head(&q2).await.unwrap().end, None);
    let started = Instant::now();
    let by_other = s.end(&q2, EndReason::Cancelled).await.unwrap();
    let ended = h.join().await.unwrap();
    assert_eq!(ended, Ended { end: by_other.end, ended_now: false });
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// The server sweeper: a silent run nobody reads is ended as `producer_lost` within
/// `silence_timeout` + the sweep interval (+1 s); a run kept alive is not.
pub async fn sweeper_ends_unread_silent_runs(b: &TestBackend) {
    let sweep = Duration::from_millis(300);
    let s = store(b, StreamStoreSettings { sweep_interval: sweep, ..settings() }).await;
    let (silent, kept) = (path("swept"), path("kept"));
    let sil = 500u64;
    let a = s.open(&silent, open_opts("A", Some(sil))).await.unwrap();
    let tail = a.append("x").await.unwrap();
    let k = s.open(&kept, open_opts("B", Some(sil))).await.unwrap();
    // 5x the silence timeout; nobody reads `silent` meanwhile.
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(5 * sil) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        k.keepalive().await.unwrap();
    }
    let info = s.head(&silent).await.unwrap();
    assert_eq!(info.end, Some(EndState { reason: EndReason::ProducerLost, final_offset: tail }));
    // Ended by the sweeper (this head came 2.5 s after the last write, past the bound).
    let after = info.ended_at.unwrap() - info.last_write_at;
    assert!(after > sil && after <= sil + sweep.as_millis() as u64 + 1000, "ended {after} ms after the last write");
    let kept_info = s.head(&kept).await.unwrap();
    assert_eq!((kept_info.end, kept_info.ended_at), (None, None));
    assert_eq!(
        a.append("late").await,
        Err(StreamError::Closed { end: info.end.unwrap(), incarnation: info.incarnation.clone() })
    );
    if let Some(mut c) = raw(b).await {
        // The deadline shards hold the kept run only (the ended one was removed when swept).
        let mut members = Vec::new();
        for n in 0..16 {
            let m: Vec<String> = redis::cmd("ZRANGE")
                .arg(format!("baton:s:deadlines:{{{n}}}"))
                .arg(0)
                .arg(-1)
                .query_async(&mut c)
                .await
                .unwrap();
            members.extend(m);
        }
        assert_eq!(members, vec![format!("{} {}", kept_info.incarnation, kept.as_str())]);
    }
}

/// An append that arrives after the silence timeout (nobody noticed yet) is refused with the
/// `producer_lost` end; nothing of it is ever visible.
pub async fn append_after_silence_is_refused(b: &TestBackend) {
    // No sweeper in the way: only the append itself can notice the silence.
    let s = store(b, StreamStoreSettings { sweep_interval: Duration::from_secs(3600), ..settings() }).await;
    let p = path("late");
    let producer = s.open(&p, open_opts("L", Some(300))).await.unwrap();
    let tail = producer.append("a").await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let end = EndState { reason: EndReason::ProducerLost, final_offset: tail };
    let inc = s.head(&p).await.unwrap().incarnation;
    assert_eq!(producer.append("late").await, Err(StreamError::Closed { end, incarnation: inc }));
    let info = s.head(&p).await.unwrap();
    assert_eq!((info.end, info.tail, info.len), (Some(end), tail, 1));
    assert_eq!(text(&s.read(&p, ReadFrom::Start).await.unwrap()), "a");
    if let Some(mut c) = raw(b).await {
        // One data entry and the one end entry.
        let n: u64 = redis::cmd("XLEN").arg(format!("baton:s:{{{}}}", p.as_str())).query_async(&mut c).await.unwrap();
        assert_eq!(n, 2);
    }
}

/// Many appends in flight from one task (group commit on Redis): applied in submission order,
/// each caller gets its own offset, no sequence gap; a close in the middle ends the stream for
/// the requests queued after it, which all learn the same end.
pub async fn pipelined_appends_in_order(b: &TestBackend) {
    use futures::StreamExt;
    let s = store(b, settings()).await;
    let p = path("pipelined");
    s.create(&p, CreateOptions { content_type: Some("text/plain".into()), ..Default::default() }).await.unwrap();
    const N: u64 = 2000;
    const CLOSE_AT: u64 = 1500;
    let results: Vec<Result<Appended, StreamError>> = futures::stream::iter(0..N)
        .map(|seq| {
            let (s, p) = (s.clone(), p.clone());
            async move {
                let req = AppendRequest {
                    data: Bytes::from(format!("{seq},")),
                    content_type: Some("text/plain".into()),
                    producer: Some(ProducerStamp { id: "pipe".into(), epoch: 0, seq }),
                    close: (seq == CLOSE_AT).then_some(EndReason::Finished),
                    ..Default::default()
                };
                s.append(&p, req).await
            }
        })
        .buffered(512)
        .collect()
        .await;
    let mut last = Offset::ZERO;
    for (seq, r) in results.iter().enumerate().take(CLOSE_AT as usize + 1) {
        let a = r.as_ref().unwrap_or_else(|e| panic!("seq {seq}: {e}"));
        assert_eq!((a.duplicate, a.producer, a.ended_now), (false, Some((0, seq as u64)), seq as u64 == CLOSE_AT));
        assert!(a.tail > last, "seq {seq}");
        last = a.tail;
    }
    let end = EndState { reason: EndReason::Finished, final_offset: last };
    let inc = s.head(&p).await.unwrap().incarnation;
    for r in &results[CLOSE_AT as usize + 1..] {
        assert_eq!(r, &Err(StreamError::Closed { end, incarnation: inc.clone() }));
    }
    let body = text(&s.read(&p, ReadFrom::Start).await.unwrap());
    assert_eq!(body, (0..=CLOSE_AT).map(|i| format!("{i},")).collect::<String>());
    assert_eq!(s.head(&p).await.unwrap().len, CLOSE_AT + 1);
}
