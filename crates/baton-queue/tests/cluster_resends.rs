//! Offers on Redis Cluster while every node's client connections are killed again and again
//! (`CLIENT KILL TYPE normal` every 5 ms for 4 s, 16 offerers on one queue, no consumer): the
//! redis crate's Cluster connection re-sends a command whose connection was killed after it ran
//! (as `baton-streams/tests/cluster_replays.rs` shows for appends), so an offer may be appended
//! to the queue's stream twice while its caller is answered once — and its message then runs
//! twice.
//!
//! Each offer has a unique payload; afterwards every entry of the queue's stream is read
//! (`XRANGE`) and each payload counted: an offer answered OK must be in the stream exactly once.
//! Both paths are checked: priority 0 (a pipelined `XADD` on standalone) and priority 1
//! (`offer.lua` on standalone); on Cluster both now go through `offer_batch.lua`.
//!
//! Without the fix (offers sent as before on Cluster) both fail: offers answered OK written twice
//! (priority 0: 28 of 1,391, 19 of 704, 28 of 2,064, 33 of 604, 4 of 768, 19 of 5,349, 38 of
//! 2,863, 7 of 418, 1 of 148; priority 1: 247 of 2,523, 14 of 433, 20 of 202, 20 of 1,506, 4 of
//! 60, 18 of 409, 1 of 352, 149 of 1,436), none missing. The offers also stalled under this storm:
//! from 60 to about 5,400 offers in 4 s, each run ending with exactly 16 errors, one per offerer, all
//! `redis: timed out`. The fix: on Cluster every offer goes through a group commit per queue and
//! one `offer_batch.lua` call per batch under a re-send guard (`baton_redis::resend`), so a
//! re-sent copy is answered, not appended again. With it (3 runs each): priority 0 48,869,
//! 14,905 and 42,762 OK offers, priority 1 19,467, 27,035 and 39,540, each in the stream once;
//! 0 to 15 errors per run (`redis: timed out`), none written.
//!
//! Settles under the same storm (`acks_of_held_messages_are_answered_done`): one remote consumer
//! with a 10 min claim timeout (nothing is ever reclaimed or parked, so every delivery it claims
//! stays its own until it acks it) claims and acks, 8 workers at once, for 4 s. A re-sent copy of
//! a settle call whose first copy acked finds the entry no longer pending and answers 0, which
//! the caller sees as `Settled::Gone` (or, inside a lease thread, as an ack of nothing): every ack
//! of a held delivery must be answered `Settled::Done`. Without the guard (settles sent unguarded
//! on Cluster, as before) it fails every time: acks answered `Gone` 336 of 5,624, 369 of 12,040,
//! 445 of 7,890 and 371 of 11,472 (no `LeaseLost`). The fix: on Cluster each settle call runs
//! `settle.lua` under a re-send guard lent per call by the consumer's `ResendPool`, so a re-sent
//! copy is answered with the first copy's reply. With it (5 runs): 4,632, 6,507, 4,055, 6,092 and
//! 4,176 acks, all `Done`; 0 or 1 error per run (`redis: timed out`).
//!
//! Retries and dead-letters under the same storm (`retries_of_held_messages_are_answered_done`,
//! `dead_letters_of_held_messages_are_answered_done`): the same consumer settles each delivery
//! with `retry_after` (alternating 1 s, below the claim timeout: the entry goes to the parked
//! owner; and 20 min, above it: the entry goes to the delayed set) or `dead_letter`. A re-sent
//! copy of one that applied finds the entry parked (answers -1: `LeaseLost`) or gone (answers 0:
//! `Settled::Gone`). Without the guard (both sent unguarded on Cluster) they fail every time:
//! retries answered `Gone` + `LeaseLost` 231 + 247 of 19,552, 237 + 237 of 18,328, 272 + 275 of
//! 17,884; dead-letters answered `Gone` 459 of 14,131, 486 of 18,792, 457 of 16,292. The fix: on
//! Cluster both scripts run under a guard lent per call by the same `ResendPool` as settles. With
//! it (5 runs each): retries 17,800, 15,544, 15,608, 19,384 and 14,099, dead-letters 14,976,
//! 13,128, 18,400, 18,320 and 10,217, all `Done`; 0 to 7 errors per run (`redis: timed out`).

use crate::common;
#[path = "cluster_resends/guard_break.rs"]
mod guard_break;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_queue::{keys, MessageStream, OfferOptions, RedisQueueOptions, RemoteConsumer, RemoteOptions, Settled};
use baton_redis::{redis, RedisClient};
use common::queue_name;

/// What the storm left: per offer (its unique payload) whether it was answered OK, and how many
/// times each payload is in the queue's stream.
struct Outcome {
    answers: HashMap<String, bool>,
    written: HashMap<String, usize>,
    killed: u64,
    /// The errors' texts and how many times each was seen.
    errors: HashMap<String, usize>,
}

impl Outcome {
    fn oks(&self) -> usize {
        self.answers.values().filter(|ok| **ok).count()
    }

    /// The offers answered OK that are not in the stream exactly once: (payload, times written).
    fn not_once(&self) -> Vec<(String, usize)> {
        let mut out: Vec<(String, usize)> = self
            .answers
            .iter()
            .filter(|(_, ok)| **ok)
            .map(|(p, _)| (p.clone(), self.written.get(p).copied().unwrap_or(0)))
            .filter(|(_, n)| *n != 1)
            .collect();
        out.sort();
        out
    }

    fn summary(&self) -> String {
        let wrong = self.not_once();
        let twice = wrong.iter().filter(|(_, n)| *n > 1).count();
        let lost = wrong.iter().filter(|(_, n)| *n == 0).count();
        let errs_written =
            self.answers.iter().filter(|(p, ok)| !**ok && self.written.get(*p).copied().unwrap_or(0) > 0).count();
        let entries: usize = self.written.values().sum();
        format!(
            "{} offers, {} answered OK, {} errors ({} of them written anyway); {} stream entries; OK offers written \
             twice or more: {twice}, missing: {lost}; {} connections killed; first: {:?}; errors: {:?}",
            self.answers.len(),
            self.oks(),
            self.answers.len() - self.oks(),
            errs_written,
            entries,
            self.killed,
            &wrong[..wrong.len().min(5)],
            self.errors
        )
    }
}

async fn offers_under_a_kill_storm(cluster: &baton_testkit::RedisCluster, priority: i8) -> Outcome {
    let client = RedisClient::new(cluster.config()).unwrap();
    let stream = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
    let q = queue_name("resends");
    let storm = baton_testkit::KillStorm::start(cluster.urls(), Duration::from_millis(5)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let answers: Arc<Mutex<HashMap<String, bool>>> = Arc::default();
    let errors: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let mut offerers = Vec::new();
    for w in 0..16 {
        let (stream, q, stop, answers, errors) =
            (stream.clone(), q.clone(), stop.clone(), answers.clone(), errors.clone());
        offerers.push(tokio::spawn(async move {
            let mut seq = 0;
            while !stop.load(Ordering::Relaxed) {
                let payload = format!("w{w}-{seq}");
                seq += 1;
                let r = if priority == 0 {
                    stream.offer(&q, payload.clone()).await
                } else {
                    stream.offer_with(&q, payload.clone(), OfferOptions { priority, ..Default::default() }).await
                };
                if let Err(e) = &r {
                    *errors.lock().unwrap().entry(e.to_string()).or_default() += 1;
                }
                let ok = r.is_ok();
                answers.lock().unwrap().insert(payload, ok);
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    let killed = storm.stop().await;
    for o in offerers {
        o.await.unwrap();
    }
    // Re-sent copies still in flight land meanwhile.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut conn = client.shared().await.unwrap();
    let key = keys::stream(keys::DEFAULT_PREFIX, &q);
    let mut written: HashMap<String, usize> = HashMap::new();
    let mut from = "-".to_string();
    loop {
        let page: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
            .arg(&key)
            .arg(&from)
            .arg("+")
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .unwrap();
        let Some((last, _)) = page.last() else { break };
        from = format!("({last}");
        for (_, fields) in &page {
            let p = fields.chunks(2).find(|f| f[0] == keys::PAYLOAD_FIELD).map(|f| f[1].clone()).unwrap();
            *written.entry(p).or_default() += 1;
        }
    }
    let answers = answers.lock().unwrap().clone();
    let errors = errors.lock().unwrap().clone();
    Outcome { answers, written, killed, errors }
}

fn check(out: &Outcome) {
    eprintln!("{}", out.summary());
    assert!(out.oks() > 100, "only {} offers answered OK", out.oks());
    assert!(out.not_once().is_empty(), "{}", out.summary());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offers_answered_ok_are_in_the_stream_once() {
    baton_testkit::require_redis();
    let cluster = baton_testkit::RedisCluster::start();
    check(&offers_under_a_kill_storm(&cluster, 0).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_offers_answered_ok_are_in_the_stream_once() {
    baton_testkit::require_redis();
    let cluster = baton_testkit::RedisCluster::start();
    check(&offers_under_a_kill_storm(&cluster, 1).await);
}

/// What the acks under the storm were answered: `Settled::Done`, `Settled::Gone`, `LeaseLost`, or
/// another error (its text and how many times).
#[derive(Default)]
struct Acks {
    done: u64,
    gone: u64,
    lost: u64,
    errors: HashMap<String, usize>,
}

/// How each claimed delivery is settled under the storm.
#[derive(Clone, Copy)]
enum Settle {
    Ack,
    /// `retry_after`, alternating a delay shorter than the claim timeout (the entry is handed to
    /// the parked owner: a re-sent copy would answer "another consumer owns it", `LeaseLost`)
    /// and a longer one (moved to the delayed set: a re-sent copy would answer "not pending",
    /// `Gone`).
    RetryAfter,
    DeadLetter,
}

/// A queue on a fresh 3-master Cluster with `chunks × per` messages (offered in batches of `per`)
/// and one remote consumer with a 10 min claim timeout and no delivery limit: nothing is ever
/// reclaimed or parked behind its back, so every delivery it claims stays its own until settled.
pub(crate) struct Held {
    pub cluster: baton_testkit::RedisCluster,
    pub client: RedisClient,
    pub queue: String,
    pub consumer: RemoteConsumer,
}

impl Held {
    pub async fn start(queue: &str, consumer: &str, chunks: usize, per: usize) -> Held {
        let cluster = baton_testkit::RedisCluster::start();
        let client = RedisClient::new(cluster.config()).unwrap();
        let stream = MessageStream::redis(client.clone(), RedisQueueOptions::default()).await.unwrap();
        let q = queue_name(queue);
        for chunk in 0..chunks {
            let payloads = (0..per).map(|i| bytes::Bytes::from(format!("m{chunk}-{i}"))).collect();
            stream.offer_batch(&q, payloads).await.unwrap();
        }
        let options =
            RemoteOptions { claim_timeout: Duration::from_secs(600), max_deliveries: None, ..Default::default() };
        let consumer = stream.remote_consumer(&q, consumer, options).await.unwrap();
        Held { cluster, client, queue: q, consumer }
    }
}

/// One remote consumer with a 10 min claim timeout (nothing is ever reclaimed or parked behind
/// its back, so every delivery it claims stays its own until it settles it) claims and settles
/// each delivery with `how`, 8 workers at once, for 4 s under the kill storm.
async fn settles_under_a_kill_storm(how: Settle) -> (Acks, u64) {
    let held = Held::start("settles", "acker", 60, 500).await;
    let (cluster, consumer) = (&held.cluster, held.consumer.clone());
    let storm = baton_testkit::KillStorm::start(cluster.urls(), Duration::from_millis(5)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let acks: Arc<Mutex<Acks>> = Arc::default();
    let mut workers = Vec::new();
    for _ in 0..8 {
        let (consumer, stop, acks) = (consumer.clone(), stop.clone(), acks.clone());
        workers.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // A claim that fails (its reply lost) leaves its entries pending under this
                // consumer, unsettled: they are not counted.
                let Ok(claimed) = consumer.claim_with(4, Duration::from_millis(100), false).await else { continue };
                for d in claimed {
                    n += 1;
                    let r = match how {
                        Settle::Ack => consumer.ack(d.id, d.fence).await,
                        Settle::RetryAfter => {
                            let delay =
                                if n.is_multiple_of(2) { Duration::from_secs(1) } else { Duration::from_secs(1200) };
                            consumer.retry_after(d.id, d.fence, delay).await
                        }
                        Settle::DeadLetter => consumer.dead_letter(d.id, d.fence, d.deliveries, "storm").await,
                    };
                    let mut a = acks.lock().unwrap();
                    match r {
                        Ok(Settled::Done) => a.done += 1,
                        Ok(Settled::Gone) => a.gone += 1,
                        Err(baton_queue::QueueError::LeaseLost(_)) => a.lost += 1,
                        Err(e) => *a.errors.entry(e.to_string()).or_default() += 1,
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    let killed = storm.stop().await;
    for w in workers {
        w.await.unwrap();
    }
    let a = std::mem::take(&mut *acks.lock().unwrap());
    (a, killed)
}

/// Every settle of a held delivery must be answered `Settled::Done`.
fn check_settles(what: &str, (a, killed): (Acks, u64)) {
    let summary = format!(
        "{what} answered Done: {}, Gone: {}, LeaseLost: {}; errors: {:?}; {killed} connections killed",
        a.done, a.gone, a.lost, a.errors
    );
    eprintln!("{summary}");
    assert!(a.done > 100, "only {} {what} answered Done: {summary}", a.done);
    assert_eq!(a.gone + a.lost, 0, "{what} of held messages not answered Done: {summary}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_of_held_messages_are_answered_done() {
    baton_testkit::require_redis();
    check_settles("acks", settles_under_a_kill_storm(Settle::Ack).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_of_held_messages_are_answered_done() {
    baton_testkit::require_redis();
    check_settles("retries", settles_under_a_kill_storm(Settle::RetryAfter).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_of_held_messages_are_answered_done() {
    baton_testkit::require_redis();
    check_settles("dead-letters", settles_under_a_kill_storm(Settle::DeadLetter).await);
}
