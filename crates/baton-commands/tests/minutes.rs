//! Per-minute aggregates (`CommandStore::minutes`, `baton_commands::minutes`): counts and
//! handler-duration buckets written with the transitions, two stores counting into one record,
//! depth and oldest age sampled once a minute, the window's shape. Every backend.

use crate::common;

use std::time::Duration;

use baton_commands::minutes::{bucket_of, MinuteStats, BUCKETS, MINUTES_KEPT};
use baton_commands::{Command, CommandError, CommandResult, CommandService, CommandStatus, HandlerError, Timestamp};
use baton_testkit::{eventually, TestBackend};
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    outcomes_and_durations_count_in_their_minute,
    long_work_counts_its_duration_from_its_start,
    depth_and_oldest_age_are_sampled_once_a_minute,
    the_window_ends_now_with_missing_minutes_as_zeros
);
baton_testkit::on_redis!(a_slot_from_two_hours_ago_is_cleared_not_added_to);

/// Waits, if needed, until the current minute has at least 20 s left, so that work started now
/// ends in it (the records are per minute).
async fn early_in_a_minute() {
    let in_minute = Timestamp::now().millis() % 60_000;
    if in_minute > 40_000 {
        tokio::time::sleep(Duration::from_millis(60_000 - in_minute + 200)).await;
    }
}

fn service(store: &baton_commands::CommandStore, q: &str) -> baton_commands::CommandServiceBuilder {
    CommandService::builder(store.clone(), q)
        .settings(fast())
        .handler(
            "ok",
            on_execute(|_| async {
                tokio::time::sleep(Duration::from_millis(250)).await;
                Ok(CommandResult::succeeded(json!(1)))
            }),
        )
        .handler(
            "bad",
            on_execute(|_| async {
                tokio::time::sleep(Duration::from_millis(1_100)).await;
                Ok(CommandResult::failed("no"))
            }),
        )
        .handler(
            "err",
            on_execute(|_| async {
                tokio::time::sleep(Duration::from_millis(120)).await;
                Err(HandlerError::from("boom"))
            }),
        )
        .handler(
            "park",
            on_execute(|c: Command| async move {
                c.cancellation_token().cancelled().await;
                Ok(CommandResult::cancelled())
            }),
        )
}

async fn outcomes_and_durations_count_in_their_minute(b: TestBackend) {
    let a = store_for(&b).await;
    let other = other_store(&b, &a).await;
    let q = queue_name("minutes");
    early_in_a_minute().await;
    // A service on each store (on Redis, two processes): both count into the queue's record.
    let s1 = service(&a, &q).start().await.unwrap();
    let s2 = service(&other, &q).start().await.unwrap();
    let ok1 = a.submit(&q, Command::new("ok", json!({}))).await.unwrap();
    let ok2 = other.submit(&q, Command::new("ok", json!({}))).await.unwrap();
    let bad = a.submit(&q, Command::new("bad", json!({}))).await.unwrap();
    let err = other.submit(&q, Command::new("err", json!({}))).await.unwrap();
    let park = a.submit(&q, Command::new("park", json!({}))).await.unwrap();
    eventually(Duration::from_secs(5), || async {
        a.get(&park.id).await.unwrap().filter(|s| s.execution.is_some()).map(|_| ())
    })
    .await
    .expect("the parked handler runs");
    // A cancel from outside (another store): counted, with no duration.
    other.cancel(&park.id).await.unwrap();
    for (id, status) in [
        (&ok1.id, CommandStatus::Succeeded),
        (&ok2.id, CommandStatus::Succeeded),
        (&bad.id, CommandStatus::Failed),
        (&err.id, CommandStatus::Failed),
        (&park.id, CommandStatus::Cancelled),
    ] {
        assert_eq!(a.wait(id, Duration::from_secs(10)).await.unwrap().status, status, "{id}");
    }
    // The parked handler's own `cancelled` result comes after the cancel: refused, not counted.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut expected = MinuteStats::empty(Timestamp::now().millis() / 60_000);
    expected.succeeded = 2;
    expected.failed = 2;
    expected.cancelled = 1;
    expected.retried = 2; // `err`: two errors retried, the third (max_attempts 3) fails it
    expected.durations[bucket_of(250)] = 2; // [200, 500) ms
    expected.durations[bucket_of(1_100)] = 1; // [1, 2) s
    expected.durations[bucket_of(120)] = 3; // [100, 200) ms, each `err` attempt
    for store in [&a, &other] {
        let got = store.minutes(&q, 1).await.unwrap();
        assert_eq!(got.len(), 1);
        let mut m = got[0].clone();
        assert_eq!(m.minute, expected.minute, "the current minute");
        // Sampled or not (the services sample once a minute), depth is not this test's subject.
        (m.depth, m.oldest_age_ms) = (None, None);
        let (p50, p90, p99) = (m.duration_p50_ms, m.duration_p90_ms, m.duration_p99_ms);
        (m.duration_p50_ms, m.duration_p90_ms, m.duration_p99_ms) = (None, None, None);
        assert_eq!(m, expected);
        // 6 durations: rank 3 (p50) the last of the 3 in [100, 200), 5.4 (p90) and 5.94 (p99) in
        // [1000, 2000), interpolated.
        assert_eq!(p50, Some(200.0));
        assert!(p90.is_some_and(|p| (p - 1_400.0).abs() < 1e-6), "{p90:?}");
        assert!(p99.is_some_and(|p| (p - 1_940.0).abs() < 1e-6), "{p99:?}");
    }
    s1.close().await;
    s2.close().await;
}

async fn long_work_counts_its_duration_from_its_start(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("minutes-long");
    early_in_a_minute().await;
    // `execute` returns at once; the work ends at a `check_status` about 2.5 s after it started:
    // its duration is the work's, from `started_at`, not the last call's.
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "long",
            on_execute(|_| async { Ok(CommandResult::running_after(Duration::from_millis(2_500))) }).on_check(
                |_, st| async move {
                    let since = st.started_at.expect("started").millis();
                    if Timestamp::now().millis() - since >= 2_500 {
                        Ok(CommandResult::succeeded(json!("done")))
                    } else {
                        Ok(CommandResult::running_after(Duration::from_millis(100)))
                    }
                },
            ),
        )
        .start()
        .await
        .unwrap();
    let c = store.submit(&q, Command::new("long", json!({}))).await.unwrap();
    let done = store.wait(&c.id, Duration::from_secs(15)).await.unwrap();
    assert_eq!(done.status, CommandStatus::Succeeded);
    let m = &store.minutes(&q, 1).await.unwrap()[0];
    let mut durations = vec![0; BUCKETS];
    durations[bucket_of(2_500)] = 1; // [2, 5) s
    assert_eq!((m.succeeded, m.retried, &m.durations), (1, 0, &durations));
    svc.close().await;
}

async fn depth_and_oldest_age_are_sampled_once_a_minute(b: TestBackend) {
    let a = store_for(&b).await;
    let other = other_store(&b, &a).await;
    let q = queue_name("minutes-depth");
    early_in_a_minute().await;
    // No service: the commands wait.
    let t0 = Timestamp::now().millis();
    for _ in 0..3 {
        a.submit(&q, Command::new("t", json!({}))).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(a.sample_minute(&q).await.unwrap(), "the first sample of the minute is kept");
    let t1 = Timestamp::now().millis();
    // More work later in the minute does not replace the sample, from any process.
    a.submit(&q, Command::new("t", json!({}))).await.unwrap();
    assert!(!other.sample_minute(&q).await.unwrap());
    assert!(!a.sample_minute(&q).await.unwrap());
    let m = &other.minutes(&q, 1).await.unwrap()[0];
    assert_eq!(m.depth, Some(3));
    let age = m.oldest_age_ms.expect("sampled");
    assert!((350..=t1 - t0 + 50).contains(&age), "oldest age {age} ms, sampled {} ms after the first submit", t1 - t0);
    // An empty queue samples as 0 and 0.
    let empty = queue_name("minutes-empty");
    assert!(a.sample_minute(&empty).await.unwrap());
    let m = &a.minutes(&empty, 1).await.unwrap()[0];
    assert_eq!((m.depth, m.oldest_age_ms), (Some(0), Some(0)));
}

async fn the_window_ends_now_with_missing_minutes_as_zeros(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("minutes-window");
    early_in_a_minute().await;
    let now = Timestamp::now().millis() / 60_000;
    let got = store.minutes(&q, 60).await.unwrap();
    assert_eq!(got.len(), 60);
    for (i, m) in got.iter().enumerate() {
        assert_eq!(*m, MinuteStats::empty(now - 59 + i as u64), "minute {i}");
    }
    assert_eq!(store.minutes(&q, MINUTES_KEPT).await.unwrap().len(), MINUTES_KEPT);
    for bad in [0, MINUTES_KEPT + 1] {
        let e = store.minutes(&q, bad).await.unwrap_err();
        assert!(matches!(e, CommandError::InvalidSettings(ref m) if m.contains("last must be 1 to 120")), "{e}");
    }
}

/// Redis keeps a ring of 120 one-minute slots: the slot of this minute may still hold the minute
/// 120 minutes ago. Its data is not this minute's (a read shows zeros), and the first write of
/// this minute clears it before counting.
async fn a_slot_from_two_hours_ago_is_cleared_not_added_to(b: TestBackend) {
    use baton_redis::redis;
    let store = store_for(&b).await;
    let q = queue_name("minutes-ring");
    early_in_a_minute().await;
    let m = Timestamp::now().millis() / 60_000;
    let slot = m % MINUTES_KEPT as u64;
    let key = format!("{}:cmd:{{{q}}}:minutes", baton_queue::keys::DEFAULT_PREFIX);
    let mut conn = baton_redis::RedisClient::new(b.redis_config().unwrap()).unwrap().shared().await.unwrap();
    let stale = MINUTES_KEPT as u64;
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg(format!("{slot}:m"))
        .arg(m - stale)
        .arg(format!("{slot}:c"))
        .arg(50)
        .arg(format!("{slot}:d3"))
        .arg(7)
        .arg(format!("{slot}:q"))
        .arg(9)
        .query_async(&mut conn)
        .await
        .unwrap();
    let now = &store.minutes(&q, 1).await.unwrap()[0];
    assert_eq!(*now, MinuteStats::empty(m), "another minute's data is not this one's");
    // The slot's old sample does not stop this minute's.
    assert!(store.sample_minute(&q).await.unwrap());
    let c = store.submit(&q, Command::new("t", json!({}))).await.unwrap();
    store.cancel(&c.id).await.unwrap();
    let now = &store.minutes(&q, 1).await.unwrap()[0];
    assert_eq!((now.cancelled, now.durations.iter().sum::<u64>(), now.depth), (1, 0, Some(0)), "{now:?}");
    let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut conn).await.unwrap();
    assert!(ttl > 120 * 60_000 && ttl <= 121 * 60_000, "the hash expires with the ring's span: {ttl} ms");
}
