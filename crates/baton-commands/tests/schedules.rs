//! Cron schedules (`baton_commands::schedules`): exactly one decision per due time across
//! several schedulers (stores as separate processes would have), a pending fire finished by
//! another process, missed-fire policies after a downtime, overlap policies with a handler that
//! runs longer than the period. Every backend.

use crate::common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_commands::schedules::{FireEvent, FireObserver, FireResult, Missed, Overlap, Schedule, Scheduler};
use baton_commands::{CommandResult, CommandService, CommandStatus, CommandStore};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    three_schedulers_decide_each_due_time_once,
    a_stopped_scheduler_leaves_no_gap,
    missed_skip_records_the_downtime_once,
    missed_run_once_runs_the_newest_late_one,
    missed_run_all_runs_the_newest_max_catch_up,
    overlap_skip_never_runs_two_at_once,
    overlap_allow_runs_them_side_by_side,
    overlap_cancel_previous_cancels_the_running_one,
    one_schedule_name_in_two_queues_fires_in_each
);
baton_testkit::on_redis!(a_pending_fire_is_finished_by_another_process);

type Log = Arc<Mutex<Vec<FireEvent>>>;

fn observer() -> (Log, FireObserver) {
    let log: Log = Arc::default();
    let l = log.clone();
    (log, Arc::new(move |e: &FireEvent| l.lock().unwrap().push(e.clone())))
}

fn every_second(overlap: Overlap) -> Schedule {
    Schedule::new("tick", "* * * * * *", "UTC", "noop", json!({"n": 1})).unwrap().with_overlap(overlap)
}

/// The events sorted by due time; panics on a due time decided twice.
fn by_due(log: &Log) -> Vec<FireEvent> {
    let mut v = log.lock().unwrap().clone();
    v.sort_by_key(|e| e.due_ms);
    let mut seen = BTreeMap::new();
    for e in &v {
        assert!(seen.insert(e.due_ms, e.result).is_none(), "due time {} decided twice: {v:?}", e.due_ms);
    }
    v
}

/// Every due time of `s` in `(from, to]` is covered by exactly one event (a `missed` event
/// covers its count of due times ending at its own).
fn assert_covers(s: &Schedule, events: &[FireEvent], from: i64, to: i64) {
    let dues = s.due_times(from, to, 100_000);
    let total: u64 = events.iter().map(|e| e.count).sum();
    assert_eq!(total, dues.len() as u64, "events {events:?} vs due times {dues:?}");
    for e in events.iter().filter(|e| e.result != FireResult::Missed) {
        assert!(dues.contains(&e.due_ms), "{e:?} is not a due time");
    }
}

async fn stores(b: &TestBackend, n: usize) -> Vec<CommandStore> {
    let first = store_for(b).await;
    let mut v = vec![first.clone()];
    for _ in 1..n {
        v.push(other_store(b, &first).await);
    }
    v
}

async fn three_schedulers_decide_each_due_time_once(b: TestBackend) {
    let q = queue_name("sched");
    let s = every_second(Overlap::Allow);
    let (log, obs) = observer();
    let stores = stores(&b, 3).await;
    let scheds: Vec<Scheduler> =
        stores.iter().map(|st| Scheduler::start(st.clone(), q.clone(), vec![s.clone()], Some(obs.clone()))).collect();
    tokio::time::sleep(Duration::from_millis(5_300)).await;
    for sc in scheds {
        sc.stop().await;
    }
    let rec = stores[0].schedule_record(&q, "tick").await.unwrap().expect("recorded");
    let events = by_due(&log);
    assert!(events.len() >= 4, "{events:?}");
    let first = events[0].due_ms;
    assert_covers(&s, &events, first - 1000, rec.cursor_ms);
    for e in &events {
        assert!(on_time(e.result), "{e:?}");
        let id = e.command_id.clone().unwrap();
        assert_eq!(id, s.command_id(&q, e.due_ms));
        let st = stores[1].get(&id).await.unwrap().expect("submitted");
        assert_eq!(st.command_type, "noop");
    }
    assert!(!rec.pending);
    assert_eq!(rec.last_command, events.last().unwrap().command_id);
}

/// One of three schedulers stops mid-way (its task dropped wherever it was): the others go on,
/// each due time still decided once and submitted.
async fn a_stopped_scheduler_leaves_no_gap(b: TestBackend) {
    let q = queue_name("sched");
    let s = every_second(Overlap::Allow);
    let (log, obs) = observer();
    let stores = stores(&b, 3).await;
    let mut scheds: Vec<Scheduler> =
        stores.iter().map(|st| Scheduler::start(st.clone(), q.clone(), vec![s.clone()], Some(obs.clone()))).collect();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    drop(scheds.remove(0));
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    for sc in scheds {
        sc.stop().await;
    }
    let rec = stores[0].schedule_record(&q, "tick").await.unwrap().unwrap();
    let events = by_due(&log);
    assert!(events.len() >= 4, "{events:?}");
    assert_covers(&s, &events, events[0].due_ms - 1000, rec.cursor_ms);
    for e in &events {
        assert!(stores[2].get(e.command_id.as_ref().unwrap()).await.unwrap().is_some(), "{e:?}");
    }
}

/// Ticks once (the schedule starts), waits `down`, then ticks from three stores at once.
async fn after_downtime(b: &TestBackend, s: &Schedule, down: Duration) -> (Vec<FireEvent>, i64, i64) {
    let q = queue_name("sched");
    let (log, obs) = observer();
    let stores = stores(b, 3).await;
    stores[0].schedule_tick(&q, s, Some(&obs)).await.unwrap();
    let start = stores[0].schedule_record(&q, s.name()).await.unwrap().unwrap().cursor_ms;
    tokio::time::sleep(down).await;
    let ticks = stores.iter().map(|st| st.schedule_tick(&q, s, Some(&obs)));
    for r in futures::future::join_all(ticks).await {
        r.unwrap();
    }
    let rec = stores[0].schedule_record(&q, s.name()).await.unwrap().unwrap();
    assert!(!rec.pending);
    let events = by_due(&log);
    assert_covers(s, &events, start, rec.cursor_ms);
    for e in &events {
        if let Some(id) = &e.command_id {
            assert!(stores[1].get(id).await.unwrap().is_some(), "{e:?}");
        }
    }
    (events, start, rec.cursor_ms)
}

/// Submitted on time: `fired`, or `overlapped` (nothing runs these tests' commands, so the
/// previous one is always live).
fn on_time(r: FireResult) -> bool {
    matches!(r, FireResult::Fired | FireResult::Overlapped)
}

fn results(events: &[FireEvent]) -> Vec<(FireResult, u64)> {
    events.iter().map(|e| (e.result, e.count)).collect()
}

fn late_schedule(missed: Missed, max: u32) -> Schedule {
    every_second(Overlap::Allow).with_missed(missed, max).unwrap().with_missed_after(Duration::from_secs(1)).unwrap()
}

/// About 5 s down, due times more than 1 s late are missed: one `missed` decision covering
/// them (not one per process), then the on-time ones fire.
async fn missed_skip_records_the_downtime_once(b: TestBackend) {
    let s = late_schedule(Missed::Skip, 10);
    let (events, start, _) = after_downtime(&b, &s, Duration::from_millis(5_200)).await;
    let r = results(&events);
    assert_eq!(r[0].0, FireResult::Missed, "{r:?}");
    assert!(r[0].1 >= 3, "{r:?}");
    assert_eq!(events[0].due_ms, start - start % 1000 + 1000 * r[0].1 as i64, "{r:?}");
    assert!(r[1..].iter().all(|&(res, n)| on_time(res) && n == 1), "{r:?}");
    assert!((1..=3).contains(&(r.len() - 1)), "{r:?}");
}

async fn missed_run_once_runs_the_newest_late_one(b: TestBackend) {
    let s = late_schedule(Missed::RunOnce, 10);
    let (events, _, _) = after_downtime(&b, &s, Duration::from_millis(5_200)).await;
    let r = results(&events);
    assert_eq!(r[0].0, FireResult::Missed, "{r:?}");
    assert!(r[0].1 >= 2, "{r:?}");
    assert_eq!(r[1], (FireResult::CaughtUp, 1), "{r:?}");
    assert_eq!(events[1].due_ms, events[0].due_ms + 1000);
    assert!(r[2..].iter().all(|&(res, n)| on_time(res) && n == 1), "{r:?}");
    assert!(!r[2..].is_empty());
}

async fn missed_run_all_runs_the_newest_max_catch_up(b: TestBackend) {
    let s = late_schedule(Missed::RunAll, 2);
    let (events, _, _) = after_downtime(&b, &s, Duration::from_millis(5_200)).await;
    let r = results(&events);
    assert_eq!(r[0].0, FireResult::Missed, "{r:?}");
    assert!(r[0].1 >= 1, "{r:?}");
    assert_eq!(r[1..3], [(FireResult::CaughtUp, 1), (FireResult::CaughtUp, 1)], "{r:?}");
    assert!(r[3..].iter().all(|&(res, n)| on_time(res) && n == 1), "{r:?}");
    assert!(!r[3..].is_empty());
    // With run_all and a bound over the downtime, nothing is missed.
    let s = late_schedule(Missed::RunAll, 100);
    let (events, _, _) = after_downtime(&b, &s, Duration::from_millis(3_200)).await;
    let r = results(&events);
    assert!(r.iter().all(|&(res, _)| res != FireResult::Missed), "{r:?}");
    assert!(r.iter().filter(|&&(res, _)| res == FireResult::CaughtUp).count() >= 1, "{r:?}");
}

/// A service on the queue whose `noop` commands run 2.5 s; one every-second schedule with
/// `overlap` for about 6 s. Returns the events and the store.
async fn with_slow_handler(b: &TestBackend, overlap: Overlap) -> (Vec<FireEvent>, CommandStore) {
    let q = queue_name("sched");
    let store = store_for(b).await;
    let svc = CommandService::builder(store.clone(), q.clone())
        .settings(fast())
        .handler(
            "noop",
            on_execute(|c| async move {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(2_500)) => Ok(CommandResult::succeeded(json!(1))),
                    _ = c.cancelled() => Ok(CommandResult::Cancelled),
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let (log, obs) = observer();
    let sc = Scheduler::start(store.clone(), q.clone(), vec![every_second(overlap)], Some(obs));
    tokio::time::sleep(Duration::from_millis(6_300)).await;
    sc.stop().await;
    let events = by_due(&log);
    // Every submitted command ends (cancelled or run to its end) before the service closes.
    for id in events.iter().filter_map(|e| e.command_id.as_ref()) {
        store.wait(id, Duration::from_secs(15)).await.unwrap();
    }
    svc.close().await;
    (events, store)
}

async fn overlap_skip_never_runs_two_at_once(b: TestBackend) {
    let (events, store) = with_slow_handler(&b, Overlap::Skip).await;
    let fired: Vec<&FireEvent> = events.iter().filter(|e| e.result == FireResult::Fired).collect();
    let skipped = events.iter().filter(|e| e.result == FireResult::Skipped).count();
    assert!(fired.len() >= 2 && skipped >= 3, "{events:?}");
    assert!(events.iter().all(|e| matches!(e.result, FireResult::Fired | FireResult::Skipped)));
    assert!(events.iter().filter(|e| e.result == FireResult::Skipped).all(|e| e.command_id.is_none()));
    // Each fired command ran to its end before the next was submitted.
    let mut prev_end = None;
    for e in fired {
        let st = store.get(e.command_id.as_ref().unwrap()).await.unwrap().unwrap();
        if let Some(end) = prev_end {
            assert!(st.created_at.millis() >= end, "{st:?} created before the previous one ended");
        }
        prev_end = st.completed_at.map(|t| t.millis());
    }
}

async fn overlap_allow_runs_them_side_by_side(b: TestBackend) {
    let (events, store) = with_slow_handler(&b, Overlap::Allow).await;
    assert!(events.iter().filter(|e| e.result == FireResult::Overlapped).count() >= 3, "{events:?}");
    assert!(events.iter().all(|e| matches!(e.result, FireResult::Fired | FireResult::Overlapped)), "{events:?}");
    for e in &events {
        let st = store.get(e.command_id.as_ref().unwrap()).await.unwrap().unwrap();
        assert_ne!(st.status, CommandStatus::Cancelled);
    }
}

async fn overlap_cancel_previous_cancels_the_running_one(b: TestBackend) {
    let (events, store) = with_slow_handler(&b, Overlap::CancelPrevious).await;
    assert!(events.iter().filter(|e| e.result == FireResult::Replaced).count() >= 3, "{events:?}");
    assert_eq!(events[0].result, FireResult::Fired);
    assert!(events[1..].iter().all(|e| e.result == FireResult::Replaced), "{events:?}");
    // Every command but the last was cancelled by the next fire; the last ran to its end.
    for e in &events[..events.len() - 1] {
        let st = store.get(e.command_id.as_ref().unwrap()).await.unwrap().unwrap();
        assert_eq!(st.status, CommandStatus::Cancelled, "{e:?}");
    }
    let last = store.get(events.last().unwrap().command_id.as_ref().unwrap()).await.unwrap().unwrap();
    assert_eq!(last.status, CommandStatus::Succeeded);
}

/// A process that won a fire and died before its submit leaves the record pending: the next
/// process to look submits the same command id.
async fn a_pending_fire_is_finished_by_another_process(b: TestBackend) {
    let q = queue_name("sched");
    let s = Schedule::new("daily", "0 3 * * *", "UTC", "noop", json!({})).unwrap();
    let store = store_for(&b).await;
    let due = 1_767_236_400_000i64; // 2026-01-01T03:00:00Z
    let id = s.command_id(&q, due);
    let record = json!({
        "cursor_ms": due,
        "last": {"due_ms": due, "command_id": id, "result": "fired", "decided_ms": due},
        "last_command": id,
        "pending": true,
        "missed_total": 0
    });
    let key = format!("baton:cmd:{{{q}}}:sched:daily");
    let cfg = b.redis_config().unwrap();
    let client = baton_redis::RedisClient::new(cfg).unwrap();
    let mut conn = client.dedicated().await.unwrap();
    let _: () = baton_redis::redis::cmd("SET").arg(&key).arg(record.to_string()).query_async(&mut conn).await.unwrap();
    assert!(store.get(&id).await.unwrap().is_none());
    let (log, obs) = observer();
    let (next, _) = store.schedule_tick(&q, &s, Some(&obs)).await.unwrap();
    let st = store.get(&id).await.unwrap().expect("submitted by the second process");
    assert_eq!(st.status, CommandStatus::Submitted);
    let rec = store.schedule_record(&q, "daily").await.unwrap().unwrap();
    assert!(!rec.pending);
    // The due times since then are late (the record is from 2026-01-01): missed, once.
    let events = by_due(&log);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].result, FireResult::Missed);
    assert!(next.unwrap() > rec.cursor_ms);
}

/// Two queues with a schedule of the same name and pattern (`tick` every second): each due
/// time fires in each queue, each fire's command on its own queue (command ids are global).
async fn one_schedule_name_in_two_queues_fires_in_each(b: TestBackend) {
    let s = every_second(Overlap::Allow);
    let (qa, qb) = (queue_name("sched-a"), queue_name("sched-b"));
    let stores = stores(&b, 2).await;
    for (st, q) in stores.iter().zip([&qa, &qb]) {
        st.schedule_tick(q, &s, None).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    let (log, obs) = observer();
    for (st, q) in stores.iter().zip([&qa, &qb]) {
        st.schedule_tick(q, &s, Some(&obs)).await.unwrap();
    }
    let events = log.lock().unwrap().clone();
    for q in [&qa, &qb] {
        let mine: Vec<&FireEvent> = events.iter().filter(|e| &e.queue == q).collect();
        assert!(mine.len() >= 2, "{events:?}");
        for e in mine {
            assert!(on_time(e.result), "{e:?}");
            let id = e.command_id.as_ref().unwrap();
            let st = stores[0].get(id).await.unwrap().unwrap_or_else(|| panic!("{id} not found"));
            assert_eq!(&st.queue, q, "the fire of {q} at {} is {id}, a command of {}", e.due_ms, st.queue);
        }
    }
}
