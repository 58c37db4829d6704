//! The re-poll cadence of a `RUNNING` command, seen from the handler: `check_status` is called
//! every `check_status_interval`, whatever the claim timeout and the work queue's poll interval.
//! Runs on memory, Redis standalone and a 3-master Redis Cluster (`on_every_backend!`).

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_commands::{Command, CommandResult, CommandService, CommandStatus, QueueSettings};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(check_status_is_called_every_check_status_interval);

/// `check_status` calls until the command succeeds (the 10th returns `succeeded`).
const CHECKS: usize = 10;
const INTERVAL: Duration = Duration::from_millis(200);

async fn check_status_is_called_every_check_status_interval(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("cadence");
    // Only the check interval is set: claim timeout (30 s) and poll interval (the queue's
    // default, 1 s) stay at their defaults, so a cadence that follows either shows.
    let settings = QueueSettings { check_status_interval: INTERVAL, ..QueueSettings::default() };
    assert_eq!(settings.claim_timeout, Duration::from_secs(30));
    assert_eq!(settings.poll_interval, None);
    let calls: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let executes = Arc::new(Mutex::new(0u32));
    let (c2, e2) = (calls.clone(), executes.clone());
    let svc = CommandService::builder(store.clone(), &q)
        .settings(settings)
        .handler(
            "poll",
            on_execute(move |_c: Command| {
                *e2.lock().unwrap() += 1;
                async { Ok(CommandResult::running()) }
            })
            .on_check(move |_c, _st| {
                let n = {
                    let mut calls = c2.lock().unwrap();
                    calls.push(Instant::now());
                    calls.len()
                };
                async move {
                    Ok(if n < CHECKS {
                        CommandResult::running()
                    } else {
                        CommandResult::succeeded(json!({ "checks": n }))
                    })
                }
            }),
        )
        .start()
        .await
        .unwrap();
    let id = svc.submit(Command::new("poll", json!({}))).await.unwrap().id;
    // 9 intervals of 200 ms take about 2 s; the generous timeout lets a wrong cadence (e.g. one
    // poll interval, 1 s, per check) finish and be reported with its gaps, not as a timeout.
    let st = store.wait(&id, Duration::from_secs(40)).await.unwrap();
    svc.close().await;
    assert_eq!(st.status, CommandStatus::Succeeded, "{st:?}");
    assert_eq!(st.result, Some(json!({ "checks": CHECKS }).into()));
    assert_eq!(*executes.lock().unwrap(), 1, "execute runs once");
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), CHECKS, "check_status calls");

    let gaps: Vec<Duration> = calls.windows(2).map(|w| w[1] - w[0]).collect();
    let ms: Vec<u128> = gaps.iter().map(|g| g.as_millis()).collect();
    // The allowed deviation: 20 ms or 10 % of the interval, whichever is larger.
    let tol = Duration::from_millis(20).max(INTERVAL / 10);
    // The cadence itself is judged by the median gap, which must be within ± tol of the interval:
    // on a loaded 2-core machine a single re-poll can be late by a scheduling hiccup (a busy
    // runtime thread, a slow Redis round trip), and the median ignores a few such outliers while
    // still catching any systematic cadence (a poll interval, a claim timeout) however close.
    // Every single gap must still be within [interval - tol, interval + 60 ms]: a re-poll is never
    // scheduled before its delay (the lower bound needs no slack for load), and +60 ms bounds a
    // hiccup without letting a 1 s cadence through.
    let mut sorted = gaps.clone();
    sorted.sort();
    let median = sorted[sorted.len() / 2];
    assert!(
        median >= INTERVAL - tol && median <= INTERVAL + tol,
        "median gap between check_status calls is {} ms, expected {} ms ± {} ms; gaps (ms): {ms:?}",
        median.as_millis(),
        INTERVAL.as_millis(),
        tol.as_millis()
    );
    for (i, g) in gaps.iter().enumerate() {
        assert!(
            *g >= INTERVAL - tol && *g <= INTERVAL + Duration::from_millis(60),
            "gap {i} between check_status calls is {} ms, expected {} to {} ms; gaps (ms): {ms:?}",
            g.as_millis(),
            (INTERVAL - tol).as_millis(),
            (INTERVAL + Duration::from_millis(60)).as_millis()
        );
    }
}
