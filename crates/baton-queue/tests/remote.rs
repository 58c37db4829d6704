//! Remote consumers (`MessageStream::remote_consumer`): workers elsewhere that claim, renew and
//! settle by request, under the same lease rules as in-process consumers. Every backend.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_queue::{Decision, Delivery, LeaseState, QueueError, RemoteOptions, Settled};
use baton_testkit::TestBackend;
use common::*;

baton_testkit::on_every_backend!(claim_renew_settle, silent_worker_fails_over_renewing_one_never_does);

fn opts(ct: Duration) -> RemoteOptions {
    RemoteOptions { claim_timeout: ct, max_deliveries: Some(5) }
}

async fn claim_renew_settle(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("remote");
    let ct = Duration::from_secs(1);
    let a = s.remote_consumer(&q, "worker-a", opts(ct)).await.unwrap();
    assert!(matches!(s.remote_consumer(&q, "~parked", opts(ct)).await, Err(QueueError::InvalidSettings(_))));
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
    assert_eq!(a.renew(&[m1, m2, m3]).await.unwrap(), vec![LeaseState::Held; 3]);
    // Another worker cannot settle what `a` holds.
    let bw = s.remote_consumer(&q, "worker-b", opts(ct)).await.unwrap();
    assert!(matches!(bw.ack(m3).await, Err(QueueError::LeaseLost(id)) if id == m3));
    assert!(matches!(bw.release(m3).await, Err(QueueError::LeaseLost(id)) if id == m3));
    assert_eq!(a.ack(m3).await.unwrap(), Settled::Done);
    assert_eq!(a.ack(m1).await.unwrap(), Settled::Done);
    assert_eq!(a.ack(m1).await.unwrap(), Settled::Gone, "a repeated ack applies nothing");
    assert_eq!(a.renew(&[m1]).await.unwrap(), vec![LeaseState::Gone]);
    // A released message goes to any consumer after the claim timeout, one delivery more.
    assert_eq!(a.release(m2).await.unwrap(), Settled::Done);
    assert!(bw.claim(5, Duration::from_millis(10)).await.unwrap().is_empty(), "not before the claim timeout");
    let again = eventually(Duration::from_secs(5), || async {
        let v = bw.claim(5, Duration::from_millis(10)).await.unwrap();
        (!v.is_empty()).then_some(v)
    })
    .await
    .expect("released message redelivered");
    assert_eq!((again[0].id, again[0].deliveries), (m2, 2));
    // RetryAfter: redelivered after the delay, not counted.
    assert_eq!(bw.retry_after(m2, Duration::from_millis(300)).await.unwrap(), Settled::Done);
    let later = eventually(Duration::from_secs(5), || async {
        let v = bw.claim(5, Duration::from_millis(10)).await.unwrap();
        (!v.is_empty()).then_some(v)
    })
    .await
    .expect("retry_after redelivered");
    assert_eq!((later[0].id, later[0].deliveries), (m2, 2));
    assert_eq!(bw.dead_letter(m2, 2, "poison").await.unwrap(), Settled::Done);
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
        assert_eq!(busy.renew(&[m_busy]).await.unwrap(), vec![LeaseState::Held]);
        tokio::time::sleep(ct / 3).await;
    }
    let got = seen.lock().unwrap().clone();
    assert_eq!(got, vec![("s".to_string(), 2)], "only the silent worker's message failed over");
    assert_eq!(busy.ack(m_busy).await.unwrap(), Settled::Done);
    // The silent worker learns it lost the lease; its ack is refused or finds nothing.
    let st = silent.renew(&[m_silent]).await.unwrap();
    assert_ne!(st, vec![LeaseState::Held]);
    assert!(!matches!(silent.ack(m_silent).await, Ok(Settled::Done)));
    c.close().await;
}
