//! Work-queue conformance suite, part 2 (lifecycle): deferred leases, idle queues, bad input,
//! consumer reaping and drain — on memory, Redis standalone and a 3-master Redis Cluster.

use crate::common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_queue::{ConsumerOptions, Decision, Delivery, QueueError};
use baton_testkit::TestBackend;
use bytes::Bytes;
use common::*;

baton_testkit::on_every_backend!(
    deferred_lease_is_kept_until_settled,
    idle_queue_delivers_at_once,
    bad_input_is_refused_with_clear_errors,
    idle_consumers_without_pending_are_reaped,
    drain_reports_in_flight_work_and_leaves_it_to_a_peer,
    no_handler_starts_after_abort,
);

/// `abort` stops the consumer as if its process died: a read in flight when it is called (here
/// a blocking read on an empty queue) may still return entries, but no handler starts for them
/// (they fail over after the claim timeout like the rest of a dead consumer's work).
async fn no_handler_starts_after_abort(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("abort-read");
    let calls = Arc::new(AtomicU32::new(0));
    let c2 = calls.clone();
    let c = s
        .consume(
            &q,
            move |_d: Delivery| {
                let calls = c2.clone();
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    Decision::Ack
                }
            },
            fast(3_000),
        )
        .await
        .unwrap();
    // Let the acquirer block in its read of the empty queue.
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.abort();
    for i in 0..5 {
        s.offer(&q, format!("m{i}")).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(calls.load(Ordering::SeqCst), 0, "a handler started after abort");
}

async fn deferred_lease_is_kept_until_settled(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("deferred");
    let calls = Arc::new(AtomicU32::new(0));
    let c2 = calls.clone();
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let calls = c2.clone();
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let lease = d.lease.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(2_500)).await;
                        lease.ack().await.unwrap();
                    });
                    Decision::Deferred
                }
            },
            fast(1_000).with_concurrency(1),
        )
        .await
        .unwrap();
    s.offer(&q, "d").await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(c.in_flight().len(), 1, "the deferred lease holds the slot");
    // The late ack's entry leaves Redis before the lease thread frees the local slot (the ack
    // returns after both): wait for both, not for the Redis side alone.
    eventually(Duration::from_secs(4), || {
        let s = s.clone();
        let q = q.clone();
        let freed = c.in_flight().is_empty();
        async move { s.stats(&q).await.ok().filter(|st| st.length == 0 && freed) }
    })
    .await
    .expect("acked later, and the slot freed");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "never redelivered while deferred");
}

async fn idle_queue_delivers_at_once(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("idle");
    let got = Arc::new(Mutex::new(None::<Instant>));
    let g2 = got.clone();
    let _c = s
        .consume(
            &q,
            move |_d: Delivery| {
                let g = g2.clone();
                async move {
                    *g.lock().unwrap() = Some(Instant::now());
                    Decision::Ack
                }
            },
            // Blocking reads of up to 1 s, idle for longer than the 5 s response timeout.
            fast(3_000),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(7)).await;
    let sent = Instant::now();
    s.offer(&q, "wake").await.unwrap();
    let at = eventually(Duration::from_secs(3), || {
        let g = got.clone();
        async move { *g.lock().unwrap() }
    })
    .await
    .expect("delivered");
    assert!(at - sent < Duration::from_millis(500), "delivered {:?} after the offer", at - sent);
}

async fn bad_input_is_refused_with_clear_errors(b: TestBackend) {
    let s = stream_for(&b).await;
    for bad in ["", "a{b}", "tab\there"] {
        match s.offer(bad, "x").await {
            Err(QueueError::InvalidQueueName(n)) => assert_eq!(n, bad),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    let err = s
        .consume("ok", |_d: Delivery| async { Decision::Ack }, ConsumerOptions::new().with_concurrency(0))
        .await
        .err()
        .expect("refused");
    assert_eq!(err.to_string(), "invalid queue setting: concurrency must be at least 1");
    assert!(matches!("12-x".parse::<baton_queue::MessageId>(), Err(QueueError::InvalidMessageId(_))));
    let q = queue_name("empty");
    assert_eq!(s.stats(&q).await.unwrap(), baton_queue::QueueStats::default());
    assert!(s.dead_letters(&q, 10).await.unwrap().is_empty());
    assert_eq!(s.offer_batch(&q, vec![]).await.unwrap(), vec![]);
}

/// Consumers idle with no pending entry are removed; one that still owns an entry is kept.
async fn idle_consumers_without_pending_are_reaped(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("reap");
    let hold = |_d: Delivery| async {
        tokio::time::sleep(Duration::from_secs(60)).await;
        Decision::Ack
    };
    // Z takes m1 and dies holding it (claim timeout 30 s: nobody reclaims it during the test).
    s.offer(&q, "m1").await.unwrap();
    let z = s.consume(&q, hold, fast(30_000).with_concurrency(1)).await.unwrap();
    eventually(Duration::from_secs(3), || {
        let n = z.in_flight().len();
        async move { (n == 1).then_some(()) }
    })
    .await
    .expect("Z holds m1");
    z.abort();
    // X dies with nothing pending. (It runs the queue's usual settings, claim timeout 100 ms like
    // Y: a consumer is never reaped within twice its own claim timeout, whatever the reaper's.)
    let x = s.consume(&q, hold, fast(100)).await.unwrap();
    x.abort();
    // Group members, live or dead (not reaped yet).
    let members = |st: &baton_queue::QueueStats| st.consumers + st.dead_consumers;
    assert_eq!(members(&s.stats(&q).await.unwrap()), 2);
    // Y reaps after 200 ms of idleness; it holds m2 in its only slot, so it reclaims nothing.
    s.offer(&q, "m2").await.unwrap();
    let y = s
        .consume(
            &q,
            |d: Delivery| async move {
                std::mem::forget(d.lease);
                Decision::Deferred
            },
            ConsumerOptions::new()
                .with_claim_timeout(Duration::from_millis(100))
                .with_concurrency(1)
                .with_reap_idle_consumers_after(Some(Duration::from_millis(200))),
        )
        .await
        .unwrap();
    let st = eventually(Duration::from_secs(5), || {
        let s = s.clone();
        let q = q.clone();
        async move { s.stats(&q).await.ok().filter(|st| members(st) == 2 && st.pending == 2) }
    })
    .await
    .expect("X reaped, Z (pending) and Y kept");
    assert_eq!((members(&st), st.pending), (2, 2));
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(members(&s.stats(&q).await.unwrap()), 2, "Z, which owns m1, is never reaped");
    drop(y);
}

/// drain(budget): stops reading, waits for handlers within the budget, reports what is still in
/// flight; that work is taken by a peer after the claim timeout.
async fn drain_reports_in_flight_work_and_leaves_it_to_a_peer(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("drain");
    let a = s
        .consume(
            &q,
            |d: Delivery| async move {
                let slow = &d.payload[..] == b"slow";
                tokio::time::sleep(Duration::from_millis(if slow { 20_000 } else { 200 })).await;
                Decision::Ack
            },
            fast(1_000),
        )
        .await
        .unwrap();
    let ids = s.offer_batch(&q, vec![Bytes::from("slow"), Bytes::from("quick")]).await.unwrap();
    eventually(Duration::from_secs(3), || {
        let n = a.in_flight().len();
        async move { (n == 2).then_some(()) }
    })
    .await
    .expect("both taken");
    let t0 = Instant::now();
    let report = a.drain(Duration::from_millis(1_000)).await;
    assert!(t0.elapsed() >= Duration::from_millis(900) && t0.elapsed() < Duration::from_millis(1_500));
    assert_eq!(report.completed, 1, "the quick one finished within the budget");
    assert_eq!(report.in_flight, vec![ids[0]], "the slow one is reported");
    // Nothing is lost: a peer gets the slow one after the claim timeout.
    let got = Arc::new(Mutex::new(None::<(baton_queue::MessageId, u32)>));
    let g2 = got.clone();
    let _peer = s
        .consume(
            &q,
            move |d: Delivery| {
                let g = g2.clone();
                async move {
                    *g.lock().unwrap() = Some((d.id, d.deliveries));
                    Decision::Ack
                }
            },
            fast(1_000),
        )
        .await
        .unwrap();
    let (id, n) = eventually(Duration::from_secs(4), || {
        let g = got.clone();
        async move { *g.lock().unwrap() }
    })
    .await
    .expect("peer took it");
    assert_eq!((id, n), (ids[0], 2));
}

/// The admin reads (`stats`, `consumers`) answer the first call after a Redis restart: the shared
/// connection finds the old socket dead only when it uses it, and a read that only looks is sent
/// once more on the new one (before, the first call failed with "broken pipe").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_reads_answer_the_first_call_after_a_redis_restart() {
    baton_testkit::require_redis();
    let mut server = baton_testkit::RedisServer::start();
    let client = baton_redis::RedisClient::new(server.config()).unwrap();
    let s = baton_queue::MessageStream::redis(client, baton_queue::RedisQueueOptions::default()).await.unwrap();
    let q = queue_name("restart-stats");
    s.offer(&q, "a").await.unwrap();
    assert_eq!(s.stats(&q).await.unwrap().length, 1);
    assert!(s.consumers(&q, 10).await.unwrap().is_empty());
    server.restart();
    let st = s.stats(&q).await.expect("stats answers the first call after the restart");
    // This server keeps nothing on disk: the restart emptied it.
    assert_eq!(st.length, 0, "{st:?}");
    server.restart();
    assert!(s.consumers(&q, 10).await.expect("consumers answers the first call after the restart").is_empty());
}
