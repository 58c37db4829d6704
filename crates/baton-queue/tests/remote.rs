//! Remote consumers (`MessageStream::remote_consumer`): workers elsewhere that claim, renew and
//! settle by request, under the same lease rules as in-process consumers. Every backend.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_queue::{Decision, Delivery, LeaseState, QueueError, RemoteOptions, Settled};
use baton_testkit::TestBackend;
use common::*;

baton_testkit::on_every_backend!(
    claim_renew_settle,
    silent_worker_fails_over_renewing_one_never_does,
    lapsed_lease_back_to_the_same_worker_is_fenced,
    a_recreated_group_starts_its_fences_anew,
    consumers_are_listed_live_and_dead
);

/// `MessageStream::consumers` lists the group's consumers with their leases; one silent past its
/// claim timeout is dead, and the queue's stats count it apart from the live ones.
async fn consumers_are_listed_live_and_dead(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("remote-consumers");
    let ct = Duration::from_secs(1);
    let steady = s.remote_consumer(&q, "steady", opts(ct)).await.unwrap();
    let silent = s.remote_consumer(&q, "silent", opts(ct)).await.unwrap();
    let ids = [s.offer(&q, "m0").await.unwrap(), s.offer(&q, "m1").await.unwrap(), s.offer(&q, "m2").await.unwrap()];
    let held: Vec<_> = steady.claim(2, Duration::from_millis(10)).await.unwrap();
    assert_eq!(held.iter().map(|d| d.id).collect::<Vec<_>>(), ids[..2]);
    assert_eq!(silent.claim(1, Duration::from_millis(10)).await.unwrap()[0].id, ids[2]);
    let listed = s.consumers(&q, 10).await.unwrap();
    let short: Vec<_> = listed.iter().map(|c| (c.name.as_str(), c.alive, c.pending, c.claim_timeout_ms)).collect();
    assert_eq!(short, [("silent", true, 1, Some(1000)), ("steady", true, 2, Some(1000))]);
    let leases: Vec<_> =
        listed[1].leases.iter().map(|l| (l.id, l.deliveries, l.payload.as_deref().map(|p| p.to_vec()))).collect();
    assert_eq!(leases, [(ids[0], 1, Some(b"m0".to_vec())), (ids[1], 1, Some(b"m1".to_vec()))]);
    assert_eq!(s.consumers(&q, 1).await.unwrap()[1].leases.len(), 1, "at most the number asked for");
    let stats = s.stats(&q).await.unwrap();
    assert_eq!((stats.consumers, stats.dead_consumers), (2, 0));
    // The steady one renews; the silent one does not.
    let leases_of = |v: &[baton_queue::RemoteDelivery]| v.iter().map(|d| (d.id, d.fence)).collect::<Vec<_>>();
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        steady.renew(&leases_of(&held)).await.unwrap();
    }
    let listed = s.consumers(&q, 10).await.unwrap();
    let short: Vec<_> = listed.iter().map(|c| (c.name.as_str(), c.alive, c.pending)).collect();
    assert_eq!(short, [("silent", false, 1), ("steady", true, 2)]);
    assert!(listed[0].last_heartbeat_ms < listed[1].last_heartbeat_ms);
    let stats = s.stats(&q).await.unwrap();
    assert_eq!((stats.consumers, stats.dead_consumers), (1, 1));
}

fn opts(ct: Duration) -> RemoteOptions {
    RemoteOptions { claim_timeout: ct, max_deliveries: Some(5), ..Default::default() }
}

async fn claim_renew_settle(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("remote");
    let ct = Duration::from_secs(1);
    let a = s.remote_consumer(&q, "worker-a", opts(ct)).await.unwrap();
    assert!(matches!(s.remote_consumer(&q, "~parked", opts(ct)).await, Err(QueueError::InvalidSettings(_))));
    // A claim timeout above a day (say Duration::MAX) is refused, not left to overflow clocks.
    match s.remote_consumer(&q, "worker-x", opts(Duration::MAX)).await {
        Err(QueueError::InvalidSettings(m)) => assert!(m.starts_with("claim_timeout must be at most 1 day"), "{m}"),
        other => panic!("expected InvalidSettings, got {:?}", other.map(|_| ())),
    }
    // Long-poll: a claim waiting on an empty queue returns as soon as a message arrives.
    let waiter = tokio::spawn({
        let a = a.clone();
        async move {
            let t = Instant::now();
            (a.claim(2, Duration::from_secs(5)).await.unwrap(), t.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let m1 = s.offer(&q, "one").await.unwrap();
    let (got, took) = waiter.await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].id, &got[0].payload[..], got[0].deliveries), (m1, &b"one"[..], 1));
    assert!(took < Duration::from_secs(3), "long-poll answered after {took:?}");

    let m2 = s.offer(&q, "two").await.unwrap();
    let m3 = s.offer(&q, "three").await.unwrap();
    let got = a.claim(5, Duration::from_millis(10)).await.unwrap();
    assert_eq!(got.iter().map(|d| d.id).collect::<Vec<_>>(), vec![m2, m3]);
    assert_eq!(a.renew(&[(m1, 0), (m2, 0), (m3, 0)]).await.unwrap(), vec![LeaseState::Held; 3]);
    // Another worker cannot settle what `a` holds.
    let bw = s.remote_consumer(&q, "worker-b", opts(ct)).await.unwrap();
    assert!(matches!(bw.ack(m3, 0).await, Err(QueueError::LeaseLost(id)) if id == m3));
    assert!(matches!(bw.release(m3, 0).await, Err(QueueError::LeaseLost(id)) if id == m3));
    assert_eq!(a.ack(m3, 0).await.unwrap(), Settled::Done);
    assert_eq!(a.ack(m1, 0).await.unwrap(), Settled::Done);
    assert_eq!(a.ack(m1, 0).await.unwrap(), Settled::Gone, "a repeated ack applies nothing");
    assert_eq!(a.renew(&[(m1, 0)]).await.unwrap(), vec![LeaseState::Gone]);
    // A released message goes to any consumer after the claim timeout, one delivery more.
    assert_eq!(a.release(m2, 0).await.unwrap(), Settled::Done);
    assert!(bw.claim(5, Duration::from_millis(10)).await.unwrap().is_empty(), "not before the claim timeout");
    let again = eventually(Duration::from_secs(5), || async {
        let v = bw.claim(5, Duration::from_millis(10)).await.unwrap();
        (!v.is_empty()).then_some(v)
    })
    .await
    .expect("released message redelivered");
    assert_eq!((again[0].id, again[0].deliveries, again[0].fence), (m2, 2, 1));
    // RetryAfter: redelivered after the delay, not counted.
    assert_eq!(bw.retry_after(m2, 1, Duration::from_millis(300)).await.unwrap(), Settled::Done);
    let later = eventually(Duration::from_secs(5), || async {
        let v = bw.claim(5, Duration::from_millis(10)).await.unwrap();
        (!v.is_empty()).then_some(v)
    })
    .await
    .expect("retry_after redelivered");
    assert_eq!((later[0].id, later[0].deliveries, later[0].fence), (m2, 2, 2));
    assert_eq!(bw.dead_letter(m2, 2, 2, "poison").await.unwrap(), Settled::Done);
    assert_eq!(s.dead_letters(&q, 10).await.unwrap()[0].reason, "poison");
}

async fn silent_worker_fails_over_renewing_one_never_does(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("remote-failover");
    let ct = Duration::from_secs(1);
    let silent = s.remote_consumer(&q, "silent", opts(ct)).await.unwrap();
    let busy = s.remote_consumer(&q, "busy", opts(ct)).await.unwrap();
    let m_silent = s.offer(&q, "s").await.unwrap();
    assert_eq!(silent.claim(1, Duration::from_millis(10)).await.unwrap()[0].id, m_silent);
    let m_busy = s.offer(&q, "b").await.unwrap();
    assert_eq!(busy.claim(1, Duration::from_millis(10)).await.unwrap()[0].id, m_busy);

    // An in-process consumer of the same queue.
    let seen: Arc<Mutex<Vec<(String, u32)>>> = Arc::default();
    let seen2 = seen.clone();
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let seen = seen2.clone();
                async move {
                    seen.lock().unwrap().push((String::from_utf8_lossy(&d.payload).into_owned(), d.deliveries));
                    Decision::Ack
                }
            },
            fast(1000),
        )
        .await
        .unwrap();
    // `busy` renews at a third of the claim timeout for three claim timeouts: never taken.
    let until = Instant::now() + 3 * ct;
    while Instant::now() < until {
        assert_eq!(busy.renew(&[(m_busy, 0)]).await.unwrap(), vec![LeaseState::Held]);
        tokio::time::sleep(ct / 3).await;
    }
    let got = seen.lock().unwrap().clone();
    assert_eq!(got, vec![("s".to_string(), 2)], "only the silent worker's message failed over");
    assert_eq!(busy.ack(m_busy, 0).await.unwrap(), Settled::Done);
    // The silent worker learns it lost the lease; its ack is refused or finds nothing.
    let st = silent.renew(&[(m_silent, 0)]).await.unwrap();
    assert_ne!(st, vec![LeaseState::Held]);
    assert!(!matches!(silent.ack(m_silent, 0).await, Ok(Settled::Done)));
    c.close().await;
}

/// A worker that lets its lease lapse and claims again gets the same message back, as the same
/// group member: only the fence tells the two deliveries apart. Every operation naming the first
/// one is refused; none of them touches the second.
async fn lapsed_lease_back_to_the_same_worker_is_fenced(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("remote-fence");
    let ct = Duration::from_secs(1);
    let w = s.remote_consumer(&q, "w", opts(ct)).await.unwrap();
    let m = s.offer(&q, "job").await.unwrap();
    let first = w.claim(1, Duration::from_millis(10)).await.unwrap();
    assert_eq!((first[0].id, first[0].deliveries, first[0].fence), (m, 1, 0));
    // Silent past the claim timeout: its next claim parks the unrenewed entry as its orphan and
    // takes it back as a new delivery.
    tokio::time::sleep(ct + Duration::from_millis(300)).await;
    let second = eventually(Duration::from_secs(5), || async {
        let v = w.claim(1, Duration::from_millis(10)).await.unwrap();
        (!v.is_empty()).then_some(v)
    })
    .await
    .expect("redelivered");
    assert_eq!((second[0].id, second[0].deliveries, second[0].fence), (m, 2, 1));

    assert_eq!(w.renew(&[(m, 0)]).await.unwrap(), vec![LeaseState::Lost], "the first delivery is over");
    assert_eq!(w.renew(&[(m, 1)]).await.unwrap(), vec![LeaseState::Held]);
    assert_eq!(w.renew(&[(m, 0), (m, 1)]).await.unwrap(), vec![LeaseState::Lost, LeaseState::Held]);
    assert!(matches!(w.ack(m, 0).await, Err(QueueError::LeaseLost(id)) if id == m));
    assert!(matches!(w.release(m, 0).await, Err(QueueError::LeaseLost(_))));
    assert!(matches!(w.retry_after(m, 0, Duration::from_millis(10)).await, Err(QueueError::LeaseLost(_))));
    assert!(matches!(w.dead_letter(m, 0, 1, "stale").await, Err(QueueError::LeaseLost(_))));
    assert_eq!(w.hand_back(&[(m, 0)]).await.unwrap(), 0, "a stale hand-back leaves the message alone");
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.pending, st.delayed, st.dead_letters, st.length), (1, 0, 0, 1), "nothing applied: {st:?}");
    assert_eq!(w.ack(m, 1).await.unwrap(), Settled::Done);
    assert_eq!(w.ack(m, 1).await.unwrap(), Settled::Gone);
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.pending, st.length), (0, 0));
    if let Some(mut conn) = conn_for(&b).await {
        let n: u64 = baton_redis::redis::cmd("HLEN")
            .arg(baton_queue::keys::fences(baton_queue::keys::DEFAULT_PREFIX, &q))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(n, 0, "the ack removed the entry's fence");
    }
}

/// A consumer group lost while its stream stays (`XGROUP DESTROY`) is recreated and delivers every
/// entry anew, with fence 0: the fences of the old group are gone with it, so the new deliveries
/// settle (breaker: they were refused as lost until a reclaim raised the fence again).
async fn a_recreated_group_starts_its_fences_anew(b: TestBackend) {
    let Some(mut conn) = conn_for(&b).await else { return }; // Redis only
    let s = stream_for(&b).await;
    let q = queue_name("remote-regroup");
    let ct = Duration::from_secs(1);
    let w = s.remote_consumer(&q, "w", opts(ct)).await.unwrap();
    let m = s.offer(&q, "job").await.unwrap();
    assert_eq!(w.claim(1, Duration::from_millis(10)).await.unwrap()[0].fence, 0);
    assert_eq!(w.release(m, 0).await.unwrap(), Settled::Done);
    let again = eventually(Duration::from_secs(5), || async {
        let v = w.claim(1, Duration::from_millis(10)).await.unwrap();
        (!v.is_empty()).then_some(v)
    })
    .await
    .expect("redelivered");
    assert_eq!(again[0].fence, 1);
    let stream = baton_queue::keys::stream(baton_queue::keys::DEFAULT_PREFIX, &q);
    let _: i64 = baton_redis::redis::cmd("XGROUP")
        .arg("DESTROY")
        .arg(&stream)
        .arg(baton_queue::keys::DEFAULT_GROUP)
        .query_async(&mut conn)
        .await
        .unwrap();
    let anew = eventually(Duration::from_secs(5), || async {
        let v = w.claim(1, Duration::from_millis(10)).await.unwrap();
        (!v.is_empty()).then_some(v)
    })
    .await
    .expect("delivered by the recreated group");
    assert_eq!((anew[0].id, anew[0].fence), (m, 0));
    assert_eq!(w.ack(m, 0).await.unwrap(), Settled::Done);
    let n: u64 = baton_redis::redis::cmd("HLEN")
        .arg(baton_queue::keys::fences(baton_queue::keys::DEFAULT_PREFIX, &q))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, 0);
}
