//! Priorities (`OfferOptions::priority`): new entries are taken by priority, higher first, then in
//! offer order; strict (a flood of higher-priority work starves lower work until it drains); the
//! priority holds through scheduling, a key's waiting line and `max_concurrency`. Every backend
//! (memory, Redis standalone, Redis Cluster).

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use baton_queue::{ConsumerOptions, Decision, Delivery, MessageId, MessageStream, OfferOptions, QueueError};
use baton_testkit::{eventually, TestBackend};
use common::*;
use tokio::sync::Semaphore;

baton_testkit::on_every_backend!(
    higher_priorities_run_first_and_equal_ones_in_offer_order,
    max_concurrency_takes_by_priority_too,
    a_flood_of_higher_priority_starves_lower_until_it_drains,
    a_scheduled_entry_keeps_its_priority,
    a_key_waiter_keeps_its_priority_when_promoted,
    stats_count_entries_waiting_by_priority,
    a_long_retry_after_keeps_its_priority,
    priorities_out_of_range_are_refused,
    more_new_entries_than_one_read_moves,
    a_replayed_dead_letter_keeps_its_priority_and_concurrency_key,
);

fn prio(p: i8) -> OfferOptions {
    OfferOptions { priority: p, ..Default::default() }
}

type Runs = Arc<Mutex<Vec<(String, MessageId)>>>;

/// Records each delivery's payload and id (in start order) and acks it.
fn recording(runs: Runs) -> impl baton_queue::Handler {
    move |d: Delivery| {
        let runs = runs.clone();
        async move {
            runs.lock().unwrap().push((String::from_utf8_lossy(&d.payload).into_owned(), d.id));
            Decision::Ack
        }
    }
}

async fn wait_runs(runs: &Runs, n: usize) -> Vec<String> {
    eventually(Duration::from_secs(20), || {
        let got = runs.lock().unwrap().len();
        async move { (got >= n).then_some(()) }
    })
    .await
    .unwrap_or_else(|| panic!("{n} runs expected, got {:?}", runs.lock().unwrap()));
    runs.lock().unwrap().iter().map(|(p, _)| p.clone()).collect()
}

/// Offers 0, 5, -3, 5, 0, 10 to a paused queue, then resumes: the run order is 10, 5, 5, 0, 0, -3,
/// FIFO within a priority, and the delivered ids rise in run order.
async fn run_order(b: &TestBackend, tag: &str, opts: ConsumerOptions) {
    let s = stream_for(b).await;
    let q = queue_name(tag);
    s.pause(&q).await.unwrap();
    let runs: Runs = Arc::default();
    let c = s.consume(&q, recording(runs.clone()), opts).await.unwrap();
    for (name, p) in [("a", 0), ("b", 5), ("c", -3), ("d", 5), ("e", 0), ("f", 10)] {
        s.offer_with(&q, format!("{name}{p}"), prio(p)).await.unwrap();
    }
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.lag, st.pending), (6, 6, 0), "{st:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(runs.lock().unwrap().is_empty(), "nothing runs while paused");
    s.resume(&q).await.unwrap();
    let got = wait_runs(&runs, 6).await;
    assert_eq!(got, ["f10", "b5", "d5", "a0", "e0", "c-3"]);
    let ids: Vec<MessageId> = runs.lock().unwrap().iter().map(|(_, id)| *id).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids rise in run order: {ids:?}");
    c.drain(Duration::from_secs(2)).await;
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.lag, st.pending), (0, 0, 0), "{st:?}");
    // The queue goes back to reading the stream as it is.
    s.offer(&q, "z").await.unwrap();
    s.offer(&q, "y").await.unwrap();
    let runs2: Runs = Arc::default();
    let c = s.consume(&q, recording(runs2.clone()), fast(5_000).with_concurrency(1)).await.unwrap();
    assert_eq!(wait_runs(&runs2, 2).await, ["z", "y"]);
    c.drain(Duration::from_secs(2)).await;
}

async fn higher_priorities_run_first_and_equal_ones_in_offer_order(b: TestBackend) {
    run_order(&b, "prio-order", fast(5_000).with_concurrency(1)).await;
}

async fn max_concurrency_takes_by_priority_too(b: TestBackend) {
    run_order(&b, "prio-maxc", fast(5_000).with_concurrency(4).with_max_concurrency(Some(1))).await;
}

/// With one handler slot, a producer keeps an entry of priority 5 waiting (each one's handler
/// offers the next before it acks) while 20 entries of priority 0 wait: none of the 20 runs until
/// the flood stops; then all 20 run in offer order.
async fn a_flood_of_higher_priority_starves_lower_until_it_drains(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("prio-flood");
    s.pause(&q).await.unwrap();
    let runs: Runs = Arc::default();
    let (s2, q2, runs2) = (s.clone(), q.clone(), runs.clone());
    let h = move |d: Delivery| {
        let (s, q, runs) = (s2.clone(), q2.clone(), runs2.clone());
        async move {
            let p = String::from_utf8_lossy(&d.payload).into_owned();
            if let Some(n) = p.strip_prefix('h').and_then(|n| n.parse::<u32>().ok()) {
                if n < 29 {
                    s.offer_with(&q, format!("h{}", n + 1), prio(5)).await.unwrap();
                }
            }
            runs.lock().unwrap().push((p, d.id));
            Decision::Ack
        }
    };
    let c = s.consume(&q, h, fast(5_000).with_concurrency(1)).await.unwrap();
    for i in 0..20 {
        s.offer(&q, format!("z{i}")).await.unwrap();
    }
    s.offer_with(&q, "h0", prio(5)).await.unwrap();
    s.resume(&q).await.unwrap();
    let got = wait_runs(&runs, 50).await;
    let want: Vec<String> = (0..30).map(|i| format!("h{i}")).chain((0..20).map(|i| format!("z{i}"))).collect();
    assert_eq!(got, want);
    c.drain(Duration::from_secs(2)).await;
}

/// A scheduled entry of priority 7, promoted while the queue is paused, runs before an entry of
/// priority 0 offered before it.
async fn a_scheduled_entry_keeps_its_priority(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("prio-sched");
    s.pause(&q).await.unwrap();
    let runs: Runs = Arc::default();
    let c = s.consume(&q, recording(runs.clone()), fast(5_000).with_concurrency(1)).await.unwrap();
    s.offer(&q, "n0").await.unwrap();
    let due = SystemTime::now() + Duration::from_millis(200);
    assert!(s.offer_at_with(&q, "job:s7", "s7", due, prio(7)).await.unwrap());
    eventually(Duration::from_secs(10), || {
        let s = s.clone();
        let q = q.clone();
        async move { (s.stats(&q).await.unwrap().delayed == 0).then_some(()) }
    })
    .await
    .expect("promoted");
    s.offer(&q, "n1").await.unwrap();
    s.resume(&q).await.unwrap();
    assert_eq!(wait_runs(&runs, 3).await, ["s7", "n0", "n1"]);
    c.drain(Duration::from_secs(2)).await;
}

/// `concurrency_per_key` 1, two handler slots: k1 (key k) runs and holds; k2 (key k, priority 9)
/// waits in k's line; x runs and holds; u1, u2 (priority 0) wait in the stream. When k1 acks, k2
/// is promoted behind u1 and u2 but keeps its priority, so it runs first.
async fn a_key_waiter_keeps_its_priority_when_promoted(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("prio-key");
    let runs: Runs = Arc::default();
    let gates: Arc<Mutex<std::collections::HashMap<String, Arc<Semaphore>>>> = Arc::default();
    for g in ["k1", "x"] {
        gates.lock().unwrap().insert(g.to_string(), Arc::new(Semaphore::new(0)));
    }
    let (runs2, gates2) = (runs.clone(), gates.clone());
    let h = move |d: Delivery| {
        let (runs, gates) = (runs2.clone(), gates2.clone());
        async move {
            let p = String::from_utf8_lossy(&d.payload).into_owned();
            runs.lock().unwrap().push((p.clone(), d.id));
            let gate = gates.lock().unwrap().get(&p).cloned();
            if let Some(g) = gate {
                let _ = g.acquire().await;
            }
            Decision::Ack
        }
    };
    let opts = fast(10_000).with_concurrency(2).with_concurrency_per_key(Some(1));
    let c = s.consume(&q, h, opts).await.unwrap();
    let keyed = |p: i8| OfferOptions { concurrency_key: Some("k".into()), priority: p };
    s.offer_with(&q, "k1", keyed(0)).await.unwrap();
    wait_runs(&runs, 1).await;
    s.offer_with(&q, "k2", keyed(9)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    s.offer(&q, "x").await.unwrap();
    assert_eq!(wait_runs(&runs, 2).await, ["k1", "x"], "k2 waits in its key's line");
    s.offer(&q, "u1").await.unwrap();
    s.offer(&q, "u2").await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let release = |g: &str| gates.lock().unwrap()[g].add_permits(1);
    // k1's slot runs k2 (promoted holding k's slot), then u1 and u2; x still holds the other.
    release("k1");
    assert_eq!(wait_runs(&runs, 5).await, ["k1", "x", "k2", "u1", "u2"]);
    release("x");
    c.drain(Duration::from_secs(2)).await;
}

/// Entries waiting in the priorities' ready set count in the stats (length and lag).
async fn stats_count_entries_waiting_by_priority(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("prio-stats");
    s.pause(&q).await.unwrap();
    let hold = Arc::new(Semaphore::new(0));
    let runs: Runs = Arc::default();
    let (runs2, hold2) = (runs.clone(), hold.clone());
    let h = move |d: Delivery| {
        let (runs, hold) = (runs2.clone(), hold2.clone());
        async move {
            runs.lock().unwrap().push((String::from_utf8_lossy(&d.payload).into_owned(), d.id));
            let _ = hold.acquire().await;
            Decision::Ack
        }
    };
    let c = s.consume(&q, h, fast(10_000).with_concurrency(2)).await.unwrap();
    s.offer(&q, "a").await.unwrap();
    s.offer(&q, "b").await.unwrap();
    s.offer_with(&q, "c", prio(5)).await.unwrap();
    s.resume(&q).await.unwrap();
    let mut got = wait_runs(&runs, 2).await;
    got.sort();
    assert_eq!(got, ["a", "c"]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.lag, st.pending), (3, 1, 2), "{st:?}");
    hold.add_permits(1);
    let got = wait_runs(&runs, 3).await;
    assert_eq!(got[2], "b");
    hold.add_permits(2);
    c.drain(Duration::from_secs(2)).await;
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.lag, st.pending), (0, 0, 0), "{st:?}");
}

/// An entry of priority 4 answered with a `RetryAfter` longer than the claim timeout goes to the
/// delayed set and, when due, runs before entries of priority 0 offered meanwhile.
async fn a_long_retry_after_keeps_its_priority(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("prio-retry");
    let runs: Runs = Arc::default();
    let (runs2, s2, q2) = (runs.clone(), s.clone(), q.clone());
    let first = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let h = move |d: Delivery| {
        let (runs, s, q, first) = (runs2.clone(), s2.clone(), q2.clone(), first.clone());
        async move {
            let p = String::from_utf8_lossy(&d.payload).into_owned();
            runs.lock().unwrap().push((p.clone(), d.id));
            if p == "r4" && first.swap(false, std::sync::atomic::Ordering::SeqCst) {
                // Paused while it waits, so that the entries offered meanwhile wait too.
                s.pause(&q).await.unwrap();
                return Decision::RetryAfter(Duration::from_millis(1_500));
            }
            Decision::Ack
        }
    };
    let c = s.consume(&q, h, fast(1_000).with_concurrency(1)).await.unwrap();
    s.offer_with(&q, "r4", prio(4)).await.unwrap();
    wait_runs(&runs, 1).await;
    eventually(Duration::from_secs(5), || {
        let (s, q) = (s.clone(), q.clone());
        async move { (s.stats(&q).await.unwrap().delayed == 1).then_some(()) }
    })
    .await
    .expect("delayed");
    s.offer(&q, "n0").await.unwrap();
    s.offer(&q, "n1").await.unwrap();
    eventually(Duration::from_secs(10), || {
        let (s, q) = (s.clone(), q.clone());
        async move { (s.stats(&q).await.unwrap().delayed == 0).then_some(()) }
    })
    .await
    .expect("promoted");
    s.resume(&q).await.unwrap();
    assert_eq!(wait_runs(&runs, 4).await, ["r4", "r4", "n0", "n1"]);
    c.drain(Duration::from_secs(2)).await;
}

async fn priorities_out_of_range_are_refused(b: TestBackend) {
    let s: MessageStream = stream_for(&b).await;
    let q = queue_name("prio-bad");
    for p in [11, -11, i8::MAX, i8::MIN] {
        match s.offer_with(&q, "x", prio(p)).await {
            Err(QueueError::InvalidSettings(m)) => {
                assert_eq!(m, format!("priority must be an integer from -10 to 10 (got {p})"))
            }
            other => panic!("priority {p}: {other:?}"),
        }
        let due = SystemTime::now();
        assert!(matches!(s.offer_at_with(&q, "a:b", "x", due, prio(p)).await, Err(QueueError::InvalidSettings(_))));
    }
    for p in [10, -10] {
        s.offer_with(&q, "ok", prio(p)).await.unwrap();
    }
    assert_eq!(s.stats(&q).await.unwrap().length, 2);
}

/// 600 entries of priority 0, then one of priority 9, offered while paused: the gated read moves
/// at most 256 unread entries to the ready set per call (and asks to be called again), so taking
/// the first one needs three calls; the entry of priority 9 still runs first, the others in order.
async fn more_new_entries_than_one_read_moves(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("prio-many");
    s.pause(&q).await.unwrap();
    let runs: Runs = Arc::default();
    let c = s.consume(&q, recording(runs.clone()), fast(5_000).with_concurrency(4)).await.unwrap();
    s.offer_batch(&q, (0..600).map(|i| bytes::Bytes::from(format!("z{i}"))).collect()).await.unwrap();
    s.offer_with(&q, "p9", prio(9)).await.unwrap();
    s.resume(&q).await.unwrap();
    wait_runs(&runs, 601).await;
    // Four handler slots: the entries of one read may start in any order, so the order taken is
    // that of the delivered ids (they rise with each read, see `run_order`); each ran once.
    let mut taken = runs.lock().unwrap().clone();
    taken.sort_by_key(|(_, id)| *id);
    let taken: Vec<String> = taken.into_iter().map(|(p, _)| p).collect();
    let want: Vec<String> = std::iter::once("p9".to_string()).chain((0..600).map(|i| format!("z{i}"))).collect();
    assert_eq!(taken, want);
    c.drain(Duration::from_secs(2)).await;
}

/// A dead letter keeps its entry's concurrency key and priority (listed with it), and a replay
/// offers it with both: replayed behind two entries of priority 0 it runs first, and while
/// another entry of its key runs (`concurrency_per_key = 1`) it waits for it. (Before, a replay
/// came back at priority 0 without its key: last, and beside its key's running entry.)
async fn a_replayed_dead_letter_keeps_its_priority_and_concurrency_key(b: TestBackend) {
    let s = stream_for(&b).await;
    let q = queue_name("prio-replay");
    type Log = Arc<Mutex<Vec<(String, std::time::Instant, std::time::Instant)>>>;
    let log: Log = Arc::default();
    let h = {
        let log = log.clone();
        move |d: Delivery| {
            let log = log.clone();
            async move {
                let p = String::from_utf8_lossy(&d.payload).into_owned();
                let start = std::time::Instant::now();
                let first = !log.lock().unwrap().iter().any(|(x, _, _)| *x == p);
                if p == "k/b" {
                    tokio::time::sleep(Duration::from_millis(800)).await;
                }
                log.lock().unwrap().push((p.clone(), start, std::time::Instant::now()));
                if first && (p == "k/a" || p == "p/x") {
                    Decision::DeadLetter("poison".into())
                } else {
                    Decision::Ack
                }
            }
        }
    };
    let c = s.consume(&q, h, fast(10_000).with_concurrency(2).with_concurrency_per_key(Some(1))).await.unwrap();
    s.offer_with(&q, "k/a", OfferOptions { concurrency_key: Some("k".into()), priority: 3 }).await.unwrap();
    s.offer_with(&q, "p/x", prio(4)).await.unwrap();
    let dead = eventually(Duration::from_secs(10), || {
        let s = s.clone();
        let q = q.clone();
        async move {
            let d = s.dead_letters(&q, 10).await.unwrap();
            (d.len() == 2).then_some(d)
        }
    })
    .await
    .expect("both dead-lettered");
    let mut kept: Vec<(String, Option<String>, i8)> = dead
        .iter()
        .map(|d| (String::from_utf8_lossy(&d.payload).into_owned(), d.concurrency_key.clone(), d.priority))
        .collect();
    kept.sort();
    assert_eq!(kept, [("k/a".to_string(), Some("k".to_string()), 3), ("p/x".to_string(), None, 4)]);
    let id_of = |p: &str| dead.iter().find(|d| d.payload == p.as_bytes()).unwrap().id;
    // The key: k/b holds k's one slot for 800 ms; k/a replayed meanwhile waits for it.
    s.offer_with(&q, "k/b", OfferOptions { concurrency_key: Some("k".into()), priority: 0 }).await.unwrap();
    eventually(Duration::from_secs(5), || {
        let n = log.lock().unwrap().len();
        async move { (n >= 2).then_some(()) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.replay_dead_letter(&q, id_of("k/a")).await.unwrap();
    eventually(Duration::from_secs(10), || {
        let n = log.lock().unwrap().iter().filter(|(p, _, _)| p == "k/a").count();
        async move { (n == 2).then_some(()) }
    })
    .await
    .expect("k/a ran again");
    let at = |p: &str| log.lock().unwrap().iter().rev().find(|(x, _, _)| x == p).map(|(_, s, e)| (*s, *e)).unwrap();
    let (kb_start, kb_end) = at("k/b");
    let (ka_start, _) = at("k/a");
    assert!(ka_start >= kb_end, "k/a started {:?} before k/b ended", kb_end.saturating_duration_since(ka_start));
    assert!(ka_start >= kb_start + Duration::from_millis(700));
    // The priority: replayed into a paused queue behind two entries of priority 0.
    s.pause(&q).await.unwrap();
    s.offer(&q, "n/0").await.unwrap();
    s.offer(&q, "n/1").await.unwrap();
    s.replay_dead_letter(&q, id_of("p/x")).await.unwrap();
    s.resume(&q).await.unwrap();
    eventually(Duration::from_secs(10), || {
        let n = log.lock().unwrap().len();
        async move { (n >= 7).then_some(()) }
    })
    .await
    .expect("all ran");
    // Two slots: the first read takes p/x and n/0, n/1 waits for a free slot. The log is written
    // when a handler ends (n/1 may end before n/0), so compare when they started: at priority 0
    // p/x would have waited behind n/0 and n/1 and started last.
    let (px_start, _) = at("p/x");
    let (n1_start, _) = at("n/1");
    let order: Vec<String> = log.lock().unwrap().iter().skip(4).map(|(p, _, _)| p.clone()).collect();
    assert!(px_start < n1_start, "p/x started {:?} after n/1: {order:?}", px_start - n1_start);
    c.drain(Duration::from_secs(2)).await;
    let st = s.stats(&q).await.unwrap();
    assert_eq!((st.length, st.pending, st.dead_letters), (0, 0, 0), "{st:?}");
}
