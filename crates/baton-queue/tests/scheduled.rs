//! Scheduled entries (`MessageStream::offer_at`): named members of the delayed set, promoted by
//! a running consumer when due (never before, never pending meanwhile), moved, removed,
//! counted; a backlog of due entries larger than one promotion call is promoted call after
//! call; an entry scheduled or moved earlier through the stream whose consumer runs in this
//! process is promoted on time, not at the consumer's next poll. On memory, Redis standalone and
//! Redis Cluster.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use baton_queue::{Decision, Delivery, QueueError};
use baton_testkit::TestBackend;
use bytes::Bytes;
use common::*;

baton_testkit::on_every_backend!(scheduled_entries, due_backlog_is_promoted_at_once, local_due_times_wake_the_consumer);

/// What a recording consumer got: each payload and when its handler started.
type Seen = Arc<Mutex<Vec<(Bytes, SystemTime)>>>;

/// A consumer of `q` that records what it gets (and acks it).
async fn recording_consumer(
    s: &baton_queue::MessageStream,
    q: &str,
    opts: baton_queue::ConsumerOptions,
) -> (baton_queue::Consumer, Seen) {
    let got: Seen = Arc::default();
    let g = got.clone();
    let c = s
        .consume(
            q,
            move |d: Delivery| {
                let g = g.clone();
                async move {
                    g.lock().unwrap().push((d.payload.clone(), SystemTime::now()));
                    Decision::Ack
                }
            },
            opts,
        )
        .await
        .unwrap();
    (c, got)
}

/// What was recorded once `n` entries were (within 5 s), else `None`.
async fn eventually_seen(got: &Seen, n: usize) -> Option<Vec<(Bytes, SystemTime)>> {
    eventually(Duration::from_secs(5), || {
        let g = got.clone();
        async move {
            let seen = g.lock().unwrap().clone();
            (seen.len() >= n).then_some(seen)
        }
    })
    .await
}

/// A consumer polling every 20 s (so that its poll cannot be what finds them): an entry
/// scheduled through the same stream 300 ms ahead, and one moved from an hour ahead to 300 ms
/// ahead, are both delivered within a second of their due time.
async fn local_due_times_wake_the_consumer(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("schedw");
    let (_c, got) = recording_consumer(&s, &q, fast(30_000).with_poll_interval(Duration::from_secs(20))).await;
    assert!(s.offer_at(&q, "c:later", "L", SystemTime::now() + Duration::from_secs(3600)).await.unwrap());
    tokio::time::sleep(Duration::from_millis(300)).await; // past the consumer's first poll
    let due_a = SystemTime::now() + Duration::from_millis(300);
    assert!(s.offer_at(&q, "c:soon", "S", due_a).await.unwrap());
    let due_b = SystemTime::now() + Duration::from_millis(600);
    assert!(s.reschedule(&q, "c:later", due_b).await.unwrap());
    let done = eventually_seen(&got, 2).await.unwrap_or_else(|| panic!("{}: not both delivered within 5 s", b.name()));
    assert_eq!(done.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>(), [Bytes::from("S"), Bytes::from("L")]);
    for ((_, at), due) in done.iter().zip([due_a, due_b]) {
        let late = at.duration_since(due).unwrap_or_default();
        assert!(late < Duration::from_secs(1), "{}: delivered {late:?} after its due time", b.name());
    }
}

async fn scheduled_entries(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("sched");
    let now = SystemTime::now();
    assert!(s.offer_at(&q, "c:a", "A", now + Duration::from_millis(800)).await.unwrap());
    assert!(s.offer_at(&q, "c:b", "B", now + Duration::from_secs(60)).await.unwrap());
    assert!(s.offer_at(&q, "c:gone", "G", now + Duration::from_millis(300)).await.unwrap());
    // Replaced (same name): not counted twice.
    assert!(!s.offer_at(&q, "c:gone", "G2", now + Duration::from_millis(400)).await.unwrap());
    let (n, first) = s.scheduled(&q).await.unwrap();
    assert_eq!(n, 3, "{}", b.name());
    let ms = |t: SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
    assert_eq!(first.map(ms), Some(ms(now + Duration::from_millis(400))), "{}", b.name());
    assert!(s.unschedule(&q, "c:gone").await.unwrap());
    assert!(!s.unschedule(&q, "c:gone").await.unwrap());
    // b moved earlier than a.
    assert!(s.reschedule(&q, "c:b", now + Duration::from_millis(500)).await.unwrap());
    assert!(!s.reschedule(&q, "c:never", now).await.unwrap());
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.delayed), (0, 0, 2), "{}: {st:?}", b.name());

    let (_c, got) = recording_consumer(&s, &q, fast(1_000)).await;
    let done = eventually_seen(&got, 2).await.expect("both delivered");
    assert_eq!(done.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>(), [Bytes::from("B"), Bytes::from("A")]);
    for ((_, at), due) in done.iter().zip([500u64, 800]) {
        let due = now + Duration::from_millis(due);
        assert!(*at >= due, "{}: delivered before due", b.name());
        assert!(at.duration_since(due).unwrap() < Duration::from_millis(300), "{}: late", b.name());
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(got.lock().unwrap().len(), 2, "{}: the removed entry was delivered", b.name());
    assert_eq!(s.scheduled(&q).await.unwrap(), (0, None));
    assert!(!s.reschedule(&q, "c:a", now).await.unwrap(), "promoted: not waiting any more");

    // Names that could be entry ids are refused.
    assert!(matches!(s.offer_at(&q, "1-0", "x", now).await, Err(QueueError::InvalidSettings(_))));
}

/// 5,000 entries due at once (five promotion calls' worth): all delivered within a second of
/// their due time, not one call per tick.
async fn due_backlog_is_promoted_at_once(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("backlog");
    let n = 5_000;
    let due = SystemTime::now() + Duration::from_millis(1500);
    for i in 0..n {
        s.offer_at(&q, &format!("c:{i}"), "x", due).await.unwrap();
    }
    let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let c2 = count.clone();
    let _c = s
        .consume(
            &q,
            move |_d: Delivery| {
                c2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                async { Decision::Ack }
            },
            fast(30_000).with_concurrency(256),
        )
        .await
        .unwrap();
    let wait = due.duration_since(SystemTime::now()).unwrap_or_default();
    tokio::time::sleep(wait).await;
    let t = Instant::now();
    eventually(Duration::from_secs(10), || {
        let c = count.clone();
        async move { (c.load(std::sync::atomic::Ordering::Relaxed) >= n).then_some(()) }
    })
    .await
    .expect("all delivered");
    assert!(t.elapsed() < Duration::from_millis(1500), "{}: {n} due entries took {:?}", b.name(), t.elapsed());
    assert_eq!(s.scheduled(&q).await.unwrap(), (0, None));
}
