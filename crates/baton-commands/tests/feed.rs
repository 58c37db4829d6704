//! The durable event feed: every transition appended with its write, per queue and per
//! command, readable from any offset, waited for across processes, bounded, and off per queue.
//! Every backend.

use crate::common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_commands::{
    Command, CommandEvent, CommandResult, CommandService, CommandStatus, CommandStore, CommandStoreSettings, EventFrom,
    EventKind, FeedSettings, REPORT_INTERVAL,
};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(
    every_transition_is_in_the_feed,
    reads_resume_from_any_offset,
    a_long_poll_wakes_on_another_process_append,
    the_feed_keeps_the_newest_events,
    a_queue_with_its_feed_off_appends_nothing,
    a_failed_or_cancelled_command_reruns,
    an_offset_past_the_tail_is_refused
);

fn kinds(events: &[CommandEvent]) -> Vec<EventKind> {
    events.iter().map(|e| e.event).collect()
}

/// Every event of `id`, read in pages of 2 (so paging is exercised too).
async fn all_of(store: &CommandStore, id: &str) -> Vec<CommandEvent> {
    let mut out = Vec::new();
    let mut from = EventFrom::Start;
    loop {
        let page = store.command_events(id, from, 2).await.unwrap();
        out.extend(page.events);
        if page.up_to_date {
            return out;
        }
        from = EventFrom::After(page.next_offset);
    }
}

async fn every_transition_is_in_the_feed(b: TestBackend) {
    use EventKind::*;
    let store = store_for(&b).await;
    let q = queue_name("feed");
    let target = queue_name("feed-target");
    let flaky_calls = Arc::new(AtomicU32::new(0));
    let calls = flaky_calls.clone();
    let to = target.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler("ok", on_execute(|_c| async { Ok(CommandResult::succeeded(json!(1))) }))
        .handler(
            "flaky",
            on_execute(move |_c| {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n == 0 {
                        Err("first try fails".into())
                    } else {
                        Ok(CommandResult::succeeded(json!(2)))
                    }
                }
            }),
        )
        .handler(
            "poll",
            on_execute(|_c| async { Ok(CommandResult::running()) })
                .on_check(|_c, _s| async { Ok(CommandResult::succeeded(json!(3))) }),
        )
        .handler(
            "slow",
            on_execute(|c: Command| async move {
                c.progress(Some(0.25), Some("a quarter")).unwrap();
                tokio::time::sleep(REPORT_INTERVAL + Duration::from_millis(300)).await;
                c.progress(Some(0.5), Some("half")).unwrap();
                tokio::time::sleep(REPORT_INTERVAL + Duration::from_millis(700)).await;
                c.progress(Some(0.9), Some("almost")).unwrap();
                Ok(CommandResult::succeeded(json!(4)))
            }),
        )
        .handler(
            "hold",
            on_execute(|c: Command| async move {
                c.cancelled().await;
                Ok(CommandResult::succeeded(json!("too late")))
            }),
        )
        .handler(
            "away",
            on_execute(move |_c| {
                let to = to.clone();
                async move { Ok(CommandResult::handed_off(to)) }
            }),
        )
        .start()
        .await
        .unwrap();
    let there = CommandService::builder(store.clone(), &target)
        .settings(fast())
        // A handed-off command is RUNNING: the target queue polls it with check_status.
        .handler(
            "away",
            on_execute(|_c| async { Ok(CommandResult::failed("not called")) })
                .on_check(|_c, _s| async { Ok(CommandResult::succeeded(json!(5))) }),
        )
        .start()
        .await
        .unwrap();

    let mut ids = Vec::new();
    for t in ["ok", "flaky", "poll", "slow", "away"] {
        let st = store.submit(&q, Command::new(t, json!({}))).await.unwrap();
        ids.push(st.id);
    }
    for id in &ids {
        let done = store.wait(id, Duration::from_secs(15)).await.unwrap();
        assert_eq!(done.status, CommandStatus::Succeeded, "{id}");
    }
    let hold = store.submit(&q, Command::new("hold", json!({}))).await.unwrap();
    eventually(Duration::from_secs(5), || async {
        // Picked up: the handler is waiting to be cancelled (a second in, `started` shows).
        all_of(&store, &hold.id).await.iter().any(|e| e.event == Started).then_some(())
    })
    .await
    .expect("the held command starts");
    store.cancel(&hold.id).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    let ok = all_of(&store, &ids[0]).await;
    assert_eq!(kinds(&ok), [Submitted, Succeeded]);
    assert_eq!((ok[1].status, ok[1].version, ok[1].attempts), (CommandStatus::Succeeded, 2, 1));
    assert_eq!((ok[0].command_type.as_str(), ok[0].status, ok[0].version), ("ok", CommandStatus::Submitted, 1));

    let flaky = all_of(&store, &ids[1]).await;
    assert_eq!(kinds(&flaky), [Submitted, RetryScheduled, Succeeded]);
    assert_eq!(flaky[1].error.as_deref(), Some("first try fails"));
    assert_eq!(flaky[1].retry_in_ms, Some(20), "the first backoff of fast()");
    assert_eq!(flaky[2].error, None);

    assert_eq!(kinds(&all_of(&store, &ids[2]).await), [Submitted, Running, Succeeded]);

    let slow = all_of(&store, &ids[3]).await;
    assert_eq!(kinds(&slow), [Submitted, Started, Progress, Succeeded]);
    let p = |f: f64, m: &str| Some(baton_commands::Progress { fraction: Some(f), message: Some(m.into()) });
    assert_eq!(slow[1].progress, p(0.25, "a quarter"));
    assert!(slow[1].worker.as_deref().is_some_and(|w| !w.is_empty()));
    assert_eq!(slow[2].progress, p(0.5, "half"));
    assert_eq!(slow[3].progress, p(0.9, "almost"), "the last report goes with the outcome");
    assert!(slow[1].at < slow[2].at && slow[2].at < slow[3].at);

    let away = all_of(&store, &ids[4]).await;
    assert_eq!(kinds(&away), [Submitted, HandedOff, Succeeded]);
    assert_eq!(away[1].handed_off_to.as_deref(), Some(target.as_str()));

    // The handler's late success is refused by the compare-and-set: nothing appended for it.
    assert_eq!(kinds(&all_of(&store, &hold.id).await), [Submitted, Started, Cancelled]);

    // The queue's feed holds all of them, offsets strictly increasing, each command's events in
    // its own order.
    let feed = store.events(&q, EventFrom::Start, 1000).await.unwrap();
    assert!(feed.up_to_date);
    assert_eq!(feed.events.len(), 2 + 3 + 3 + 4 + 3 + 3);
    assert!(feed.events.windows(2).all(|w| w[0].offset < w[1].offset));
    assert_eq!(feed.next_offset, feed.events.last().unwrap().offset);
    for id in ids.iter().chain([&hold.id]) {
        let mine: Vec<_> = feed.events.iter().filter(|e| &e.id == id).cloned().collect();
        assert_eq!(mine, all_of(&store, id).await);
    }
    // The target queue's feed has none of them: a command's events are in its home queue's.
    assert!(store.events(&target, EventFrom::Start, 100).await.unwrap().events.is_empty());
    svc.close().await;
    there.close().await;
}

async fn reads_resume_from_any_offset(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("feed-offsets");
    let empty = store.events(&q, EventFrom::Start, 10).await.unwrap();
    assert!(empty.events.is_empty() && empty.up_to_date);
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(store.submit(&q, Command::new("t", json!(i))).await.unwrap().id);
    }
    let all = store.events(&q, EventFrom::Start, 0).await.unwrap();
    assert_eq!(all.events.iter().map(|e| e.id.clone()).collect::<Vec<_>>(), ids);
    // Paged by 2: the same events, and the last full page is not yet up to date.
    let p1 = store.events(&q, EventFrom::Start, 2).await.unwrap();
    assert_eq!((p1.events.len(), p1.up_to_date), (2, false));
    let p2 = store.events(&q, EventFrom::After(p1.next_offset), 2).await.unwrap();
    let p3 = store.events(&q, EventFrom::After(p2.next_offset), 2).await.unwrap();
    assert_eq!((p3.events.len(), p3.up_to_date), (1, true));
    let paged: Vec<_> = p1.events.into_iter().chain(p2.events).chain(p3.events).collect();
    assert_eq!(paged, all.events);
    // From the tail: nothing now, then only what comes after.
    let now = store.events(&q, EventFrom::Now, 10).await.unwrap();
    assert_eq!((now.events.len(), now.up_to_date, now.next_offset), (0, true, all.next_offset));
    let late = store.submit(&q, Command::new("t", json!("late"))).await.unwrap();
    let after = store.events(&q, EventFrom::After(now.next_offset), 10).await.unwrap();
    assert_eq!(after.events.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(), [late.id.as_str()]);
    // An offset shown as text parses back to the same position.
    let mid = &all.events[2];
    let from = EventFrom::parse(&mid.offset.to_string()).unwrap();
    let rest = store.events(&q, from, 10).await.unwrap();
    assert_eq!(rest.events.len(), 3);
    assert_eq!(serde_json::to_value(mid).unwrap()["offset"], mid.offset.to_string());
    assert!(EventFrom::parse("12-3").is_err());
    // A command that does not exist.
    assert!(matches!(
        store.command_events("no-such-command", EventFrom::Start, 10).await,
        Err(baton_commands::CommandError::NotFound(_))
    ));
}

async fn a_long_poll_wakes_on_another_process_append(b: TestBackend) {
    let store = store_for(&b).await;
    let other = other_store(&b, &store).await;
    let q = queue_name("feed-wait");
    let waiting = {
        let store = store.clone();
        let q = q.clone();
        tokio::spawn(async move { store.events_wait(&q, EventFrom::Now, 10, Duration::from_secs(20)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let st = other.submit(&q, Command::new("t", json!(null))).await.unwrap();
    let page = tokio::time::timeout(Duration::from_secs(10), waiting).await.expect("woken").unwrap().unwrap();
    assert_eq!(page.events.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(), [st.id.as_str()]);
    // A command's wait wakes on its own events, not on other commands'.
    let waiting = {
        let store = store.clone();
        let id = st.id.clone();
        let from = EventFrom::After(page.next_offset);
        tokio::spawn(async move { store.command_events_wait(&id, from, 10, Duration::from_secs(20)).await })
    };
    other.submit(&q, Command::new("t", json!("another"))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    other.cancel(&st.id).await.unwrap();
    let mut seen = Vec::new();
    let page = tokio::time::timeout(Duration::from_secs(10), waiting).await.expect("woken").unwrap().unwrap();
    seen.extend(page.events);
    if seen.is_empty() {
        // The wait may have returned on the other command's append, having looked past it.
        let more = store.command_events(&st.id, EventFrom::After(page.next_offset), 10).await.unwrap();
        seen.extend(more.events);
    }
    assert_eq!(kinds(&seen), [EventKind::Cancelled]);
    // A wait that sees nothing returns at its timeout with the tail as its offset.
    let t = std::time::Instant::now();
    let idle = store.events_wait(&q, EventFrom::Now, 10, Duration::from_millis(400)).await.unwrap();
    assert!(idle.events.is_empty() && idle.up_to_date && t.elapsed() >= Duration::from_millis(400));
}

async fn the_feed_keeps_the_newest_events(b: TestBackend) {
    let settings = CommandStoreSettings { feed: FeedSettings { enabled: true, max_len: 50 }, ..Default::default() };
    let store = store_with(&b, settings).await;
    let q = queue_name("feed-trim");
    let mut last = String::new();
    for i in 0..300 {
        last = store.submit(&q, Command::new("t", json!(i))).await.unwrap().id;
    }
    let page = store.events(&q, EventFrom::Start, 1000).await.unwrap();
    let n = page.events.len();
    match b {
        TestBackend::Memory => assert_eq!(n, 50),
        // MAXLEN ~: at least 50, at most one radix node (100 entries by default) more.
        _ => assert!((50..=150).contains(&n), "{n} events kept"),
    }
    assert_eq!(page.events.last().unwrap().id, last);
    let store2 = store_with(&b, CommandStoreSettings::default()).await;
    assert!(store2.set_feed(&q, FeedSettings { enabled: true, max_len: 0 }).is_err());
}

async fn a_queue_with_its_feed_off_appends_nothing(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("feed-off");
    store.set_feed(&q, FeedSettings::OFF).unwrap();
    assert_eq!(store.feed_settings(&q), FeedSettings::OFF);
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler("ok", on_execute(|_c| async { Ok(CommandResult::succeeded(json!(1))) }))
        .start()
        .await
        .unwrap();
    let st = store.submit(&q, Command::new("ok", json!({}))).await.unwrap();
    assert_eq!(store.wait(&st.id, Duration::from_secs(10)).await.unwrap().status, CommandStatus::Succeeded);
    let page = store.events(&q, EventFrom::Start, 100).await.unwrap();
    assert!(page.events.is_empty() && page.up_to_date);
    assert!(store.command_events(&st.id, EventFrom::Start, 10).await.unwrap().events.is_empty());
    svc.close().await;
}

/// A FAILED or CANCELLED command re-runs from the start (one compare-and-set and a new message),
/// its history kept in the feed; anything else is refused with its state; a cancel from before
/// the re-run does not reach the re-run's handler.
async fn a_failed_or_cancelled_command_reruns(b: TestBackend) {
    use EventKind::*;
    let store = store_for(&b).await;
    let other = other_store(&b, &store).await;
    let q = queue_name("rerun");
    let calls = Arc::new(AtomicU32::new(0));
    let c2 = calls.clone();
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler(
            "twice",
            on_execute(move |c: Command| {
                let n = c2.fetch_add(1, Ordering::SeqCst);
                async move {
                    match n {
                        0 => Ok(CommandResult::failed("first run fails")),
                        1 => {
                            // The second run waits to be cancelled.
                            c.cancelled().await;
                            Ok(CommandResult::cancelled())
                        }
                        _ => {
                            // The third: not signalled by the earlier cancel.
                            tokio::time::sleep(Duration::from_millis(500)).await;
                            if c.is_cancelled() {
                                return Ok(CommandResult::failed("signalled by an old cancel"));
                            }
                            Ok(CommandResult::succeeded(json!("third time")))
                        }
                    }
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let st = store.submit(&q, Command::new("twice", json!({}))).await.unwrap();
    let failed = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!((failed.status, failed.error.as_deref()), (CommandStatus::Failed, Some("first run fails")));

    let rerun = other.retry(&st.id).await.unwrap();
    assert_eq!(
        (rerun.status, rerun.version, rerun.error.as_deref()),
        (CommandStatus::Submitted, failed.version + 1, None)
    );
    assert_eq!((rerun.completed_at, rerun.attempts), (None, 1));
    // A second re-run now is refused with the state.
    match store.retry(&st.id).await {
        Err(baton_commands::CommandError::NotRetryable(s)) => assert_eq!(s.status, CommandStatus::Submitted),
        other => panic!("{other:?}"),
    }
    eventually(Duration::from_secs(5), || async { (calls.load(Ordering::SeqCst) == 2).then_some(()) })
        .await
        .expect("the re-run executes");
    tokio::time::sleep(Duration::from_millis(100)).await;
    other.cancel(&st.id).await.unwrap();
    let cancelled = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(cancelled.status, CommandStatus::Cancelled);
    store.retry(&st.id).await.unwrap();
    let done = store.wait(&st.id, Duration::from_secs(10)).await.unwrap();
    assert_eq!(
        (done.status, done.result.as_ref().map(|r| r.get())),
        (CommandStatus::Succeeded, Some(r#""third time""#))
    );
    // Three execute calls; the cancelled run's outcome was refused (the cancel won), so it is
    // not a recorded attempt.
    assert_eq!((done.attempts, calls.load(Ordering::SeqCst)), (2, 3));
    match store.retry(&st.id).await {
        Err(baton_commands::CommandError::NotRetryable(s)) => assert_eq!(s.status, CommandStatus::Succeeded),
        other => panic!("{other:?}"),
    }
    assert!(matches!(store.retry("no-such-command").await, Err(baton_commands::CommandError::NotFound(_))));
    assert_eq!(kinds(&all_of(&store, &st.id).await), [Submitted, Failed, Rerun, Cancelled, Rerun, Succeeded]);
    svc.close().await;
}

/// An offset from the future (never handed out) is refused, not waited on.
async fn an_offset_past_the_tail_is_refused(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("feed-ahead");
    let st = store.submit(&q, Command::new("t", json!(1))).await.unwrap();
    let tail = store.events(&q, EventFrom::Now, 1).await.unwrap().next_offset;
    assert_eq!(store.events(&q, EventFrom::After(tail), 10).await.unwrap().events.len(), 0, "the tail itself is fine");
    let ahead = EventFrom::parse("999999999999999_0000000000").unwrap();
    let refused = |r: Result<baton_commands::EventPage, baton_commands::CommandError>| matches!(r, Err(baton_commands::CommandError::InvalidOffset(o)) if o == "999999999999999_0000000000");
    assert!(refused(store.events(&q, ahead, 10).await));
    assert!(refused(store.events_wait(&q, ahead, 10, Duration::from_secs(5)).await));
    assert!(refused(store.command_events(&st.id, ahead, 10).await));
    assert!(refused(store.command_events_wait(&st.id, ahead, 10, Duration::from_secs(5)).await));
}
