//! Pause and resume (`MessageStream::pause`, `resume`): the gate of the read of new entries.
//! Every backend (memory, Redis standalone, Redis Cluster).

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_queue::{Decision, Delivery, RemoteOptions};
use baton_testkit::TestBackend;
use common::*;

baton_testkit::on_every_backend!(
    paused_queue_accepts_submits_and_starts_none_until_resumed,
    running_handlers_keep_their_leases_across_a_pause,
    dead_consumers_entries_are_reclaimed_while_paused,
    nothing_is_taken_while_the_flag_is_set,
    pause_and_resume_report_changes_and_stats,
    a_wait_survives_a_flushed_script_cache,
);

/// The gated read that follows a wait is pipelined with it as an `EVALSHA`: when Redis lost its
/// script cache meanwhile (restart, failover; here `SCRIPT FLUSH`) the read still happens.
async fn a_wait_survives_a_flushed_script_cache(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("pause-noscript");
    let (started, first) = (Arc::new(AtomicUsize::new(0)), Arc::new(Mutex::new(None)));
    let c = s.consume(&q, counting(started.clone(), first), fast(3_000)).await.unwrap();
    s.offer(&q, "one").await.unwrap();
    count_is(&started, 1, Duration::from_secs(5)).await.expect("first ran");
    // The consumer now waits (XREAD BLOCK + the pipelined read).
    tokio::time::sleep(Duration::from_millis(200)).await;
    if let Some(mut conn) = conn_for(&b).await {
        let _: () = baton_redis::redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut conn).await.unwrap();
    }
    s.offer(&q, "two").await.unwrap();
    count_is(&started, 2, Duration::from_secs(5)).await.expect("the offer after the flush ran");
    c.drain(Duration::from_secs(1)).await;
}

/// Counts starts; each handler acks at once.
fn counting(started: Arc<AtomicUsize>, first: Arc<Mutex<Option<Instant>>>) -> impl baton_queue::Handler {
    move |_d: Delivery| {
        let (started, first) = (started.clone(), first.clone());
        async move {
            first.lock().unwrap().get_or_insert_with(Instant::now);
            started.fetch_add(1, Ordering::SeqCst);
            Decision::Ack
        }
    }
}

async fn pause_and_resume_report_changes_and_stats(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("pause-state");
    assert!(!s.is_paused(&q).await.unwrap());
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.paused, st.paused_since_ms), (false, None));
    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    assert!(s.pause(&q).await.unwrap(), "running -> paused is a change");
    assert!(!s.pause(&q).await.unwrap(), "paused again: no change");
    let st = s.stats(&q).await.unwrap();
    assert!(st.paused);
    let since = st.paused_since_ms.expect("paused since");
    assert!(since + 5_000 >= before && since <= before + 5_000, "since {since}, now {before}");
    // A second pause keeps the first time.
    assert_eq!(s.stats(&q).await.unwrap().paused_since_ms, Some(since));
    assert!(s.resume(&q).await.unwrap());
    assert!(!s.resume(&q).await.unwrap(), "running again: no change");
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.paused, st.paused_since_ms), (false, None));
    assert!(matches!(s.pause("bad{name}").await, Err(baton_queue::QueueError::InvalidQueueName(_))));
}

/// A paused queue accepts offers and starts none of them, for several poll intervals and claim
/// timeouts; a resume starts them at once (well within the poll interval: the consumer is woken,
/// not polling).
async fn paused_queue_accepts_submits_and_starts_none_until_resumed(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("pause-submits");
    let (started, first) = (Arc::new(AtomicUsize::new(0)), Arc::new(Mutex::new(None)));
    // A long poll interval: only a wake-up can start the work promptly after the resume.
    let opts = fast(6_000).with_poll_interval(Duration::from_secs(5)).with_concurrency(8);
    let c1 = s.consume(&q, counting(started.clone(), first.clone()), opts.clone()).await.unwrap();
    let c2 = s.consume(&q, counting(started.clone(), first.clone()), opts).await.unwrap();
    // Running: an offer starts at once.
    s.offer(&q, "warm-up").await.unwrap();
    count_is(&started, 1, Duration::from_secs(5)).await.expect("warm-up ran");
    *first.lock().unwrap() = None;
    assert!(s.pause(&q).await.unwrap());
    let ids = s.offer_batch(&q, (0..20).map(|i| bytes::Bytes::from(format!("m{i}"))).collect()).await.unwrap();
    assert_eq!(ids.len(), 20, "offers are accepted while paused");
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    assert_eq!(started.load(Ordering::SeqCst), 1, "nothing started while paused");
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.lag, st.paused), (20, 0, 20, true));
    assert_eq!(st.consumers, 2, "the consumers stay alive (heartbeats go on)");
    let resumed = Instant::now();
    assert!(s.resume(&q).await.unwrap());
    count_is(&started, 21, Duration::from_secs(10)).await.expect("all ran after the resume");
    let waited = first.lock().unwrap().expect("started") - resumed;
    assert!(waited < Duration::from_millis(1_000), "first start {waited:?} after the resume (poll interval 5 s)");
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.lag), (0, 0, 0));
    c1.drain(Duration::from_secs(1)).await;
    c2.drain(Duration::from_secs(1)).await;
}

/// A handler running across a pause keeps its lease for several claim timeouts (no other
/// consumer takes it over) and its ack applies.
async fn running_handlers_keep_their_leases_across_a_pause(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("pause-leases");
    let started = Arc::new(tokio::sync::Notify::new());
    let (st2, runs) = (started.clone(), Arc::new(AtomicUsize::new(0)));
    let runs2 = runs.clone();
    let a = s
        .consume(
            &q,
            move |_d: Delivery| {
                let (st, runs) = (st2.clone(), runs2.clone());
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    st.notify_one();
                    tokio::time::sleep(Duration::from_millis(4_000)).await;
                    Decision::Ack
                }
            },
            fast(1_000),
        )
        .await
        .unwrap();
    s.offer(&q, "long").await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), started.notified()).await.expect("started");
    assert!(s.pause(&q).await.unwrap());
    let other_runs = Arc::new(AtomicUsize::new(0));
    let b_runs = other_runs.clone();
    let bc = s.consume(&q, acking_counter(b_runs.clone()), fast(1_000)).await.unwrap();
    eventually(Duration::from_secs(10), || {
        let acked = a.counters().acked;
        async move { (acked == 1).then_some(()) }
    })
    .await
    .expect("the long handler's ack applied");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(other_runs.load(Ordering::SeqCst), 0, "never taken over");
    assert_eq!((a.counters().leases_lost, bc.counters().reclaimed), (0, 0));
    assert!(a.counters().renewals >= 3, "renewed during the pause: {:?}", a.counters());
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.paused), (0, 0, true));
    bc.drain(Duration::from_secs(1)).await;
    a.drain(Duration::from_secs(1)).await;
}

/// A consumer that dies (abort: as if its process was killed) while the queue is paused: its
/// entry is reclaimed by a live consumer during the pause, while the new entries still wait.
async fn dead_consumers_entries_are_reclaimed_while_paused(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("pause-failover");
    let (a, started) = hanging_consumer(&s, &q, fast(1_000)).await;
    let job = s.offer(&q, "job").await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), started.notified()).await.expect("A started");
    assert!(s.pause(&q).await.unwrap());
    s.offer_batch(&q, vec!["new1".into(), "new2".into()]).await.unwrap();
    let got = Arc::new(Mutex::new(Vec::new()));
    let got2 = got.clone();
    let bc = s
        .consume(
            &q,
            move |d: Delivery| {
                let got = got2.clone();
                async move {
                    got.lock().unwrap().push((d.id, d.deliveries));
                    Decision::Ack
                }
            },
            fast(1_000),
        )
        .await
        .unwrap();
    a.abort();
    let taken = eventually(Duration::from_secs(6), || {
        let v = got.lock().unwrap().clone();
        async move { (!v.is_empty()).then_some(v) }
    })
    .await
    .expect("taken over while paused");
    assert_eq!(taken, [(job, 2)]);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(got.lock().unwrap().len(), 1, "the new entries wait: {:?}", got.lock().unwrap());
    assert_eq!(bc.counters().reclaimed, 1);
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.lag, st.paused), (2, 2, true));
    assert!(s.resume(&q).await.unwrap());
    eventually(Duration::from_secs(5), || {
        let n = got.lock().unwrap().len();
        async move { (n == 3).then_some(()) }
    })
    .await
    .expect("the new entries ran after the resume");
    bc.drain(Duration::from_secs(1)).await;
}

/// Reads in a tight loop while another task toggles the pause: a read that began after a pause
/// returned and ended before the next resume began takes nothing. Plenty of entries wait all
/// along, so a read that ignored the flag would take one; the reads between the toggles take
/// many (the test checks both).
async fn nothing_is_taken_while_the_flag_is_set(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("pause-race");
    const TOTAL: u64 = 5_000;
    s.offer_batch(&q, (0..TOTAL).map(|i| bytes::Bytes::from(format!("m{i}"))).collect()).await.unwrap();
    // Odd: a pause has returned and no resume has begun.
    let epoch = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let mut readers = Vec::new();
    for r in 0..2 {
        let w = s
            .remote_consumer(
                &q,
                &format!("reader-{r}"),
                RemoteOptions { claim_timeout: Duration::from_secs(30), max_deliveries: None, ..Default::default() },
            )
            .await
            .unwrap();
        let (epoch, done) = (epoch.clone(), done.clone());
        readers.push(tokio::spawn(async move {
            let (mut paused_reads, mut violations, mut taken) = (0u64, Vec::new(), 0u64);
            while !done.load(Ordering::SeqCst) {
                let e1 = epoch.load(Ordering::SeqCst);
                let got = w.claim_with(1, Duration::ZERO, false).await.unwrap();
                let e2 = epoch.load(Ordering::SeqCst);
                taken += got.len() as u64;
                if e1 == e2 && e1 % 2 == 1 {
                    paused_reads += 1;
                    if !got.is_empty() {
                        violations.push((e1, got[0].id));
                    }
                }
                if !got.is_empty() {
                    // Leave entries for the later windows (memory reads take microseconds).
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            (paused_reads, violations, taken)
        }));
    }
    for _ in 0..40 {
        s.pause(&q).await.unwrap();
        epoch.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(15)).await;
        epoch.fetch_add(1, Ordering::SeqCst);
        s.resume(&q).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    done.store(true, Ordering::SeqCst);
    let (mut paused_reads, mut taken) = (0, 0);
    for r in readers {
        let (p, v, t) = r.await.unwrap();
        assert!(v.is_empty(), "{} taken while paused, first (epoch, id): {:?}", v.len(), &v[..v.len().min(3)]);
        paused_reads += p;
        taken += t;
    }
    assert!(paused_reads >= 100, "only {paused_reads} reads inside the paused windows");
    assert!(taken >= 40, "only {taken} entries taken between the pauses");
    assert!(taken < TOTAL, "entries were left all along");
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.pending, st.lag), (taken, TOTAL - taken));
}
