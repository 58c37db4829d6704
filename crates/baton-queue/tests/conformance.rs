//! The work-queue conformance suite: every test runs on memory, Redis standalone and a 3-master
//! Redis Cluster (see `on_every_backend!`).

use crate::common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_queue::{json_handler, Decision, Delivery, QueueError};
use baton_testkit::TestBackend;
use bytes::Bytes;
use common::*;

baton_testkit::on_every_backend!(
    fifo_and_exact_counts,
    long_handler_runs_once_with_one_owner,
    lease_renews_while_handlers_block_every_worker_thread,
    aborted_consumer_fails_over_within_claim_timeout,
    retry_cadence_is_claim_timeout_and_not_heartbeated,
    retry_after_below_and_above_claim_timeout,
    max_processing_time_releases_the_lease,
    stale_owner_cannot_ack,
    poison_messages_go_to_dead_letters_and_replay,
);

async fn fifo_and_exact_counts(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("fifo");
    let payloads: Vec<Bytes> = (0..100).map(|i| Bytes::from(format!("m{i}"))).collect();
    let ids = s.offer_batch(&q, payloads.clone()).await.unwrap();
    assert_eq!(ids.len(), 100);
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids increase");
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.lag, st.dead_letters), (100, 0, 100, 0));

    let seen = Arc::new(Mutex::new(Vec::<Bytes>::new()));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (seen2, gate2) = (seen.clone(), gate.clone());
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let (seen, gate) = (seen2.clone(), gate2.clone());
                async move {
                    gate.acquire().await.unwrap().forget();
                    seen.lock().unwrap().push(d.payload.clone());
                    Decision::Ack
                }
            },
            fast(5_000).with_concurrency(1),
        )
        .await
        .unwrap();
    // One delivery is held by the gated handler: exactly one pending.
    let st = eventually(Duration::from_secs(5), || {
        let s = s.clone();
        let q = q.clone();
        async move { s.stats(&q).await.ok().filter(|st| st.pending == 1) }
    })
    .await
    .expect("one pending entry");
    assert_eq!((st.length, st.pending, st.consumers, st.lag), (100, 1, 1, 99));
    gate.add_permits(100);
    eventually(Duration::from_secs(10), || {
        let s = s.clone();
        let q = q.clone();
        async move { s.stats(&q).await.ok().filter(|st| st.length == 0) }
    })
    .await
    .expect("all acked");
    assert_eq!(*seen.lock().unwrap(), payloads, "delivered in offer order");
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.lag), (0, 0, 0));
    assert_eq!(c.counters().acked, 100);
    let report = c.drain(Duration::from_secs(1)).await;
    assert!(report.in_flight.is_empty());
}

/// A handler running 5× the claim timeout with two consumers: it runs exactly once and the
/// pending entry keeps one owner throughout.
async fn long_handler_runs_once_with_one_owner(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("long");
    let runs = Arc::new(AtomicU32::new(0));
    let mk = |runs: Arc<AtomicU32>| {
        move |_d: Delivery| {
            let runs = runs.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(5)).await;
                Decision::Ack
            }
        }
    };
    let a = s.consume(&q, mk(runs.clone()), fast(1_000)).await.unwrap();
    let bc = s.consume(&q, mk(runs.clone()), fast(1_000)).await.unwrap();
    s.offer(&q, "job").await.unwrap();
    let mut conn = conn_for(&b).await;
    let mut owners = std::collections::BTreeSet::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(5_500) {
        if let Some(conn) = conn.as_mut() {
            for (_, owner, n) in pending_owners(conn, &q).await {
                assert_eq!(n, 1, "never redelivered");
                owners.insert(owner);
            }
        }
        let inflight = a.in_flight().len() + bc.in_flight().len();
        assert!(inflight <= 1, "held by at most one consumer");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eventually(Duration::from_secs(3), || {
        let s = s.clone();
        let q = q.clone();
        async move { s.stats(&q).await.ok().filter(|st| st.length == 0) }
    })
    .await
    .expect("acked");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "ran exactly once");
    if conn.is_some() {
        assert_eq!(owners.len(), 1, "one owner throughout: {owners:?}");
    }
    assert_eq!(a.counters().reclaimed + bc.counters().reclaimed, 0);
    assert!(a.counters().renewals + bc.counters().renewals >= 10, "heartbeat renewed the lease");
}

/// Handlers that block their thread (synchronous sleep) on every worker of their runtime: the
/// lease still renews, so a consumer on another runtime never takes the messages.
async fn lease_renews_while_handlers_block_every_worker_thread(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("blocking");
    let runs = Arc::new(AtomicU32::new(0));
    let runs_a = runs.clone();
    s.offer_batch(&q, vec![Bytes::from("x"), Bytes::from("y")]).await.unwrap();
    // Consumer A on this test's runtime (2 worker threads), concurrency 2: both workers blocked.
    let a = s
        .consume(
            &q,
            move |_d: Delivery| {
                let runs = runs_a.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(3_500));
                    Decision::Ack
                }
            },
            fast(1_000).with_concurrency(2),
        )
        .await
        .unwrap();
    // Wait (synchronously: the workers are about to be blocked) until A holds both.
    let t0 = Instant::now();
    while a.in_flight().len() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(5), "A never took both messages");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Consumer B on a runtime of its own keeps polling while A's workers are blocked.
    let (s2, q2, runs_b) = (s.clone(), q.clone(), runs.clone());
    let other = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async move {
            let c = s2
                .consume(
                    &q2,
                    move |_d: Delivery| {
                        let runs = runs_b.clone();
                        async move {
                            runs.fetch_add(1, Ordering::SeqCst);
                            Decision::Ack
                        }
                    },
                    fast(1_000),
                )
                .await
                .unwrap();
            // Past the 3.5 s handlers plus a claim timeout.
            tokio::time::sleep(Duration::from_millis(5_000)).await;
            c.counters().reclaimed
        })
    });
    let reclaimed_by_b = other.join().unwrap();
    let done = eventually(Duration::from_secs(5), || {
        let s = s.clone();
        let q = q.clone();
        async move { s.stats(&q).await.ok().filter(|st| st.length == 0) }
    })
    .await;
    assert!(done.is_some(), "both messages acked");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "each message ran exactly once");
    assert_eq!(reclaimed_by_b, 0, "no message was reclaimed by the peer");
    assert!(a.counters().renewals >= 4, "renewed while blocked: {:?}", a.counters());
    assert_eq!(a.counters().acked, 2);
}

/// A consumer that stops dead (memory: `abort`; Redis: see `processes.rs` for SIGKILL) loses its
/// work to a peer within claim_timeout + 1 s.
async fn aborted_consumer_fails_over_within_claim_timeout(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("abort");
    let (a, started) = hanging_consumer(&s, &q, fast(1_000)).await;
    s.offer(&q, "job").await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), started.notified()).await.expect("A started");
    let got = Arc::new(Mutex::new(None::<(Instant, u32)>));
    let got2 = got.clone();
    let bc = s
        .consume(
            &q,
            move |d: Delivery| {
                let got = got2.clone();
                async move {
                    *got.lock().unwrap() = Some((Instant::now(), d.deliveries));
                    Decision::Ack
                }
            },
            fast(1_000),
        )
        .await
        .unwrap();
    let killed_at = Instant::now();
    a.abort();
    let (at, deliveries) = eventually(Duration::from_secs(5), || {
        let got = got.clone();
        async move { *got.lock().unwrap() }
    })
    .await
    .expect("taken over");
    let after = at - killed_at;
    assert!(after <= Duration::from_millis(2_000), "taken over {after:?} after the abort");
    assert_eq!(deliveries, 2);
    assert_eq!(bc.counters().reclaimed, 1);
}

async fn retry_cadence_is_claim_timeout_and_not_heartbeated(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("retry");
    let times = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let t2 = times.clone();
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let t = t2.clone();
                async move {
                    t.lock().unwrap().push(Instant::now());
                    if d.deliveries < 3 {
                        Decision::Retry
                    } else {
                        Decision::Ack
                    }
                }
            },
            fast(3_000),
        )
        .await
        .unwrap();
    s.offer(&q, "r").await.unwrap();
    eventually(Duration::from_secs(20), || {
        let t = times.clone();
        async move { (t.lock().unwrap().len() >= 3).then_some(()) }
    })
    .await
    .expect("three deliveries");
    let t = times.lock().unwrap().clone();
    for w in t.windows(2) {
        let gap = w[1] - w[0];
        // Redelivered once idle for claim_timeout (3 s), found by the next poll (≤ 1 s); the
        // margin (1.5 s) absorbs a loaded machine and stays under twice the claim timeout, so a
        // cadence of two claim timeouts still fails.
        assert!(gap >= Duration::from_millis(2_950), "gap {gap:?} shorter than claim_timeout");
        assert!(gap <= Duration::from_millis(3_000 + 1_000 + 1_500), "gap {gap:?} too long");
    }
    assert_eq!(c.counters().renewals, 0, "a handler that returned is not heartbeated");
    assert_eq!(c.counters().retried, 2);
}

async fn retry_after_below_and_above_claim_timeout(b: TestBackend) {
    let s = stream_for(&b).await;
    for delay_ms in [300u64, 2_500] {
        let q = queue_name("retry-after");
        let times = Arc::new(Mutex::new(Vec::<(Instant, u32)>::new()));
        let t2 = times.clone();
        let _c = s
            .consume(
                &q,
                move |d: Delivery| {
                    let t = t2.clone();
                    async move {
                        let first = {
                            let mut t = t.lock().unwrap();
                            t.push((Instant::now(), d.deliveries));
                            t.len() == 1
                        };
                        if first {
                            Decision::RetryAfter(Duration::from_millis(delay_ms))
                        } else {
                            Decision::Ack
                        }
                    }
                },
                fast(1_000),
            )
            .await
            .unwrap();
        s.offer(&q, "r").await.unwrap();
        eventually(Duration::from_secs(6), || {
            let t = times.clone();
            async move { (t.lock().unwrap().len() >= 2).then_some(()) }
        })
        .await
        .expect("redelivered");
        let t = times.lock().unwrap().clone();
        let gap = t[1].0 - t[0].0;
        let d = Duration::from_millis(delay_ms);
        assert!(gap >= d - Duration::from_millis(50), "delay {d:?}: redelivered after only {gap:?}");
        assert!(gap <= d + Duration::from_millis(333 + 300), "delay {d:?}: redelivered after {gap:?}");
        assert_eq!(t[1].1, 1, "a RetryAfter redelivery does not count as a delivery");
        eventually(Duration::from_secs(3), || {
            let s = s.clone();
            let q = q.clone();
            async move { s.stats(&q).await.ok().filter(|st| st.length == 0 && st.delayed == 0) }
        })
        .await
        .expect("acked");
    }
    // Re-polls never dead-letter: five RetryAfter rounds with max_deliveries = 1, then Ack.
    let q = queue_name("repoll");
    let rounds = Arc::new(AtomicU32::new(0));
    let r2 = rounds.clone();
    let _c = s
        .consume(
            &q,
            move |d: Delivery| {
                let r = r2.clone();
                async move {
                    assert_eq!(d.deliveries, 1);
                    if r.fetch_add(1, Ordering::SeqCst) < 5 {
                        Decision::RetryAfter(Duration::from_millis(50))
                    } else {
                        Decision::Ack
                    }
                }
            },
            fast(1_000).with_max_deliveries(Some(1)),
        )
        .await
        .unwrap();
    s.offer(&q, "poll me").await.unwrap();
    let st = eventually(Duration::from_secs(6), || {
        let s = s.clone();
        let q = q.clone();
        async move { s.stats(&q).await.ok().filter(|st| st.length == 0) }
    })
    .await
    .expect("acked after the re-polls");
    assert_eq!(st.dead_letters, 0);
    assert_eq!(rounds.load(Ordering::SeqCst), 6);
}

async fn max_processing_time_releases_the_lease(b: TestBackend) {
    metrics_recorder();
    let logs = captured_logs();
    let s = stream_for(&b).await;
    let q = queue_name("mpt");
    let lost_after = Arc::new(Mutex::new(None::<Duration>));
    let la = lost_after.clone();
    let a = s
        .consume(
            &q,
            move |d: Delivery| {
                let la = la.clone();
                async move {
                    let t0 = Instant::now();
                    tokio::select! {
                        _ = d.lease.lost() => { *la.lock().unwrap() = Some(t0.elapsed()); }
                        _ = tokio::time::sleep(Duration::from_secs(10)) => {}
                    }
                    // The peer has it now (or will): our ack must not win.
                    tokio::time::sleep(Duration::from_millis(800)).await;
                    Decision::Ack
                }
            },
            fast(1_000).with_max_processing_time(Duration::from_millis(1_500)),
        )
        .await
        .unwrap();
    s.offer(&q, "slow").await.unwrap();
    // Let A take it before the peer starts.
    eventually(Duration::from_secs(3), || {
        let n = a.in_flight().len();
        async move { (n == 1).then_some(()) }
    })
    .await
    .expect("A holds it");
    let peer_got = Arc::new(Mutex::new(None::<Instant>));
    let pg = peer_got.clone();
    let t_offer = Instant::now();
    let _peer = s
        .consume(
            &q,
            move |_d: Delivery| {
                let pg = pg.clone();
                async move {
                    *pg.lock().unwrap() = Some(Instant::now());
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Decision::Ack
                }
            },
            fast(1_000),
        )
        .await
        .unwrap();
    let got = eventually(Duration::from_secs(5), || {
        let pg = peer_got.clone();
        async move { *pg.lock().unwrap() }
    })
    .await
    .expect("the peer takes the released message");
    assert!(got - t_offer < Duration::from_millis(3_000), "released promptly, not after the claim timeout cycle");
    let lost = lost_after.lock().unwrap().expect("lost-lease signal fired");
    assert!(lost >= Duration::from_millis(1_400) && lost <= Duration::from_millis(2_100), "lost after {lost:?}");
    assert_eq!(a.counters().leases_expired, 1);
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let ac = a.counters();
    assert_eq!(ac.acked, 0, "the first handler's late ack is refused");
    // Metric and warning recorded for this queue.
    assert_eq!(counter_total("baton_queue_leases_expired_total", &[("queue", &q)]), 1);
    let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).to_string();
    assert!(
        text.lines().any(|l| l.contains("WARN") && l.contains("max_processing_time") && l.contains(&q)),
        "warning logged"
    );
}

async fn stale_owner_cannot_ack(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("stale");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let a = s
        .consume(
            &q,
            move |d: Delivery| {
                let tx = tx.clone();
                async move {
                    tx.send(d.lease.clone()).unwrap();
                    Decision::Deferred
                }
            },
            fast(1_000).with_max_processing_time(Duration::from_millis(1_200)),
        )
        .await
        .unwrap();
    s.offer(&q, "x").await.unwrap();
    let lease = tokio::time::timeout(Duration::from_secs(3), rx.recv()).await.unwrap().unwrap();
    let bgot = Arc::new(tokio::sync::Notify::new());
    let bg = bgot.clone();
    let (btx, mut brx) = tokio::sync::mpsc::unbounded_channel();
    let _b = s
        .consume(
            &q,
            move |d: Delivery| {
                let (bg, btx) = (bg.clone(), btx.clone());
                async move {
                    btx.send(d.lease.clone()).unwrap();
                    bg.notify_one();
                    Decision::Deferred
                }
            },
            fast(1_000),
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), bgot.notified()).await.expect("B took it");
    let b_lease = brx.recv().await.unwrap();
    assert!(lease.is_lost());
    match lease.ack().await {
        Err(QueueError::LeaseLost(id)) => assert_eq!(id, lease.id()),
        other => panic!("stale ack must be refused, got {other:?}"),
    }
    // Still B's: B acks fine, and only once.
    b_lease.ack().await.unwrap();
    assert!(matches!(b_lease.ack().await, Err(QueueError::AlreadySettled(_))));
    assert_eq!(s.stats(&q).await.unwrap().length, 0);
    assert_eq!(a.counters().acked, 0);
}

#[derive(serde::Deserialize)]
struct Job {
    #[allow(dead_code)]
    n: u32,
}

async fn poison_messages_go_to_dead_letters_and_replay(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("poison");
    let calls = Arc::new(AtomicU32::new(0));
    let heal = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (c2, h2) = (calls.clone(), heal.clone());
    let c = s
        .consume(
            &q,
            move |_d: Delivery| {
                let (calls, heal) = (c2.clone(), h2.clone());
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    if heal.load(Ordering::SeqCst) {
                        Decision::Ack
                    } else {
                        Decision::Retry
                    }
                }
            },
            fast(300).with_max_deliveries(Some(3)),
        )
        .await
        .unwrap();
    let id = s.offer(&q, "always fails").await.unwrap();
    let st = eventually(Duration::from_secs(6), || {
        let s = s.clone();
        let q = q.clone();
        async move { s.stats(&q).await.ok().filter(|st| st.dead_letters == 1) }
    })
    .await
    .expect("dead-lettered");
    assert_eq!((st.length, st.pending), (0, 0));
    assert_eq!(calls.load(Ordering::SeqCst), 3, "delivered exactly max_deliveries times");
    let dl = s.dead_letters(&q, 10).await.unwrap();
    assert_eq!(dl.len(), 1);
    assert_eq!(dl[0].original_id, id);
    assert_eq!(dl[0].payload, Bytes::from("always fails"));
    assert_eq!(dl[0].deliveries, 3);
    assert_eq!(dl[0].reason, "max deliveries exceeded");
    heal.store(true, Ordering::SeqCst);
    let new_id = s.replay_dead_letter(&q, dl[0].id).await.unwrap();
    assert!(new_id > id);
    assert!(matches!(s.replay_dead_letter(&q, dl[0].id).await, Err(QueueError::DeadLetterNotFound(_))));
    eventually(Duration::from_secs(5), || {
        let s = s.clone();
        let q = q.clone();
        async move { s.stats(&q).await.ok().filter(|st| st.length == 0 && st.dead_letters == 0) }
    })
    .await
    .expect("replayed and acked");
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    c.close().await;

    // Undecodable payloads go straight to dead letters; the typed handler is never called.
    let q2 = queue_name("undecodable");
    let typed_calls = Arc::new(AtomicU32::new(0));
    let tc = typed_calls.clone();
    let _c2 = s
        .consume(
            &q2,
            json_handler(move |_job: Job, _d: Delivery| {
                let tc = tc.clone();
                async move {
                    tc.fetch_add(1, Ordering::SeqCst);
                    Decision::Ack
                }
            }),
            fast(300),
        )
        .await
        .unwrap();
    s.offer(&q2, "{not json").await.unwrap();
    s.offer(&q2, r#"{"n": 1}"#).await.unwrap();
    eventually(Duration::from_secs(5), || {
        let s = s.clone();
        let q = q2.clone();
        async move { s.stats(&q).await.ok().filter(|st| st.length == 0 && st.dead_letters == 1) }
    })
    .await
    .expect("one dead letter, one acked");
    let dl = s.dead_letters(&q2, 10).await.unwrap();
    assert!(dl[0].reason.starts_with("undecodable payload:"), "{}", dl[0].reason);
    assert_eq!(dl[0].deliveries, 1);
    assert_eq!(typed_calls.load(Ordering::SeqCst), 1);
    // Replay all, then purge.
    assert_eq!(s.purge_dead_letters(&q2).await.unwrap(), 1);
    assert_eq!(s.stats(&q2).await.unwrap().dead_letters, 0);
}
