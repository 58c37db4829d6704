//! Acks done by the caller inside its own Redis script: `Lease::redis_target` names where the
//! delivery lives, `Lease::mark_acked` settles the lease without a second ack (used by the command
//! service to ack in the same script as its terminal state write). Every backend.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_queue::{ConsumerOptions, Decision, Delivery, QueueError, RedisAckTarget};
use baton_redis::redis;
use baton_testkit::TestBackend;
use common::*;

baton_testkit::on_every_backend!(redis_target_and_mark_acked);

async fn redis_target_and_mark_acked(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = format!("extack-{}", uuid::Uuid::now_v7());
    let conn = conn_for(&b).await;
    type Seen = Vec<(Option<RedisAckTarget>, Option<String>)>;
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let seen2 = seen.clone();
    let c = s
        .consume(
            &q,
            move |d: Delivery| {
                let seen = seen2.clone();
                let conn = conn.clone();
                async move {
                    let target = d.lease.redis_target();
                    let Some(t) = target.clone() else {
                        // Memory: nothing to ack externally; the usual path.
                        seen.lock().unwrap().push((None, None));
                        return Decision::Ack;
                    };
                    // What a caller's script does: ownership check, then XACK + XDEL + HDEL of the
                    // entry's fence.
                    let mut conn = conn.expect("redis");
                    let id = d.id.to_string();
                    let p: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
                        .arg(&t.stream)
                        .arg(&t.group)
                        .arg(&id)
                        .arg(&id)
                        .arg(1)
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    let owner = p.first().map(|e| e.1.clone());
                    assert_eq!(owner.as_deref(), Some(t.consumer.as_str()), "the target names the owner");
                    let _: (i64, i64) = redis::pipe()
                        .atomic()
                        .cmd("XACK")
                        .arg(&t.stream)
                        .arg(&t.group)
                        .arg(&id)
                        .cmd("XDEL")
                        .arg(&t.stream)
                        .arg(&id)
                        .cmd("HDEL")
                        .arg(&t.fences)
                        .arg(&id)
                        .ignore()
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                    d.lease.mark_acked().unwrap();
                    let again = d.lease.mark_acked();
                    assert!(matches!(again, Err(QueueError::AlreadySettled(_))), "{again:?}");
                    assert!(matches!(d.lease.ack().await, Err(QueueError::AlreadySettled(_))));
                    seen.lock().unwrap().push((target, owner));
                    Decision::Deferred
                }
            },
            // One slot: the later messages are only delivered if mark_acked freed it.
            ConsumerOptions::new().with_concurrency(1).with_reap_idle_consumers_after(None),
        )
        .await
        .unwrap();
    for i in 0..3 {
        s.offer(&q, format!("m{i}")).await.unwrap();
    }
    eventually(Duration::from_secs(5), || {
        let seen = seen.clone();
        async move { (seen.lock().unwrap().len() == 3).then_some(()) }
    })
    .await
    .expect("all three handled with one slot");
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending), (0, 0), "{st:?}");
    eventually(Duration::from_secs(2), || {
        let done = c.counters().acked == 3 && c.in_flight().is_empty();
        async move { done.then_some(()) }
    })
    .await
    .expect("counted as acks, nothing in flight");
    let seen = seen.lock().unwrap();
    if b.redis_config().is_some() {
        let t = seen[0].0.clone().unwrap();
        assert_eq!(t.stream, baton_queue::keys::stream(baton_queue::keys::DEFAULT_PREFIX, &q));
        assert_eq!(t.group, baton_queue::keys::DEFAULT_GROUP);
        assert_eq!(t.consumer, c.name());
    } else {
        assert!(seen.iter().all(|(t, _)| t.is_none()), "memory has no Redis target");
    }
}
