//! Starting and stopping command services: a stopped service gives back every Redis connection
//! it opened, however it was stopped (`close`, `drain`, `abort`, or dropped).

use crate::common;

use std::time::Duration;

use baton_commands::{
    Command, CommandResult, CommandService, CommandStatus, CommandStore, QueueSettings, RedisCommandStoreOptions,
};
use baton_queue::keys;
use baton_redis::RedisClient;
use baton_testkit::{eventually, RedisServer};
use common::*;
use serde_json::json;

async fn redis_store(redis: &RedisServer) -> CommandStore {
    CommandStore::redis(RedisClient::new(redis.config()).unwrap(), RedisCommandStoreOptions::default()).await.unwrap()
}

/// `CLIENT LIST` of the server, one line per connection (the `redis-cli` asking included, so
/// counts taken this way compare exactly).
fn clients(redis: &RedisServer) -> Vec<String> {
    redis.cli(&["CLIENT", "LIST"]).lines().map(str::to_string).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_services_release_their_connections() {
    baton_testkit::require_redis();
    let redis = RedisServer::start();
    let store = redis_store(&redis).await;
    let q = queue_name("lifecycle");

    // The store's own connections (shared connection, pub/sub) are part of the baseline. Its
    // pub/sub connection is opened in the background: a wait on a command of another queue
    // subscribes that queue's channel, and the baseline is taken once the pub/sub connection
    // (`flags=P`) is listed.
    let warm = queue_name("warm");
    store.declare_queue(&warm).unwrap();
    let w = store.submit(&warm, Command::new("x", json!(null))).await.unwrap();
    let st = store.wait(&w.id, Duration::from_millis(300)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Submitted);
    let baseline = eventually(Duration::from_secs(5), || async {
        let now = clients(&redis);
        now.iter().any(|l| l.contains(" flags=P ")).then_some(now)
    })
    .await
    .expect("the store's pub/sub connection is listed");

    // A short claim timeout: should a message be delivered to a stopped service's consumer (a
    // read of it still blocked on the server), the next service takes it over within a fraction
    // of a second instead of the default 30 s. That case has a test of its own
    // (`a_command_submitted_right_after_a_stop_runs_at_once`); this one is about connections.
    let settings = QueueSettings { claim_timeout: Duration::from_millis(300), ..QueueSettings::default() };
    const CYCLES: usize = 30;
    for i in 0..CYCLES {
        let svc = CommandService::builder(store.clone(), &q)
            .settings(settings.clone())
            .handler("echo", on_execute(|c: Command| async move { Ok(CommandResult::succeeded(c.params)) }))
            .start()
            .await
            .unwrap_or_else(|e| panic!("cycle {i}: start: {e}"));
        // Some real work through the service, so its reads and acks ran.
        let id = svc.submit(Command::new("echo", json!(i))).await.unwrap().id;
        let st = store.wait(&id, Duration::from_secs(10)).await.unwrap();
        assert_eq!((st.status, st.result), (CommandStatus::Succeeded, Some(json!(i).into())), "cycle {i}");
        match i % 4 {
            0 => {
                svc.close().await;
            }
            1 => {
                svc.drain(Duration::from_secs(1)).await;
            }
            2 => svc.abort(),
            _ => drop(svc),
        }
    }

    // Connections are closed asynchronously (a connection task ends, a heartbeat thread exits):
    // wait a few seconds for the count to settle back exactly to the baseline.
    let settled = eventually(Duration::from_secs(5), || async {
        let now = clients(&redis);
        (now.len() == baseline.len()).then_some(())
    })
    .await;
    if settled.is_none() {
        let now = clients(&redis);
        panic!(
            "after {CYCLES} start/stop cycles the server has {} client connections, {} at the baseline \
             ({} more); last command per connection now: {:?}, at the baseline: {:?}",
            now.len(),
            baseline.len(),
            now.len() as i64 - baseline.len() as i64,
            last_commands(&now),
            last_commands(&baseline)
        );
    }
}

/// `cmd=` of each `CLIENT LIST` line, counted: `{"xreadgroup": 30, ...}`.
fn last_commands(lines: &[String]) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for l in lines {
        let cmd = l.split(' ').find_map(|f| f.strip_prefix("cmd=")).unwrap_or("?");
        *out.entry(cmd.to_string()).or_insert(0) += 1;
    }
    out
}

/// A service stopped in any way must not leave a read of its own blocked on the server: such a
/// read takes the next message (Redis hands a new entry to the longest-blocked reader) for a
/// consumer that is gone, and the command then waits a whole claim timeout (30 s by default).
/// A long poll interval (10 s) makes each service's read block for up to 10 s, so a read left
/// behind by a stop is still waiting when the next command is submitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_submitted_right_after_a_stop_runs_at_once() {
    baton_testkit::require_redis();
    let redis = RedisServer::start();
    let store = redis_store(&redis).await;
    let q = queue_name("restart");
    let settings = QueueSettings { poll_interval: Some(Duration::from_secs(10)), ..QueueSettings::default() };
    let start = || {
        CommandService::builder(store.clone(), &q)
            .settings(settings.clone())
            .handler("echo", on_execute(|c: Command| async move { Ok(CommandResult::succeeded(c.params)) }))
            .start()
    };
    let mut svc = start().await.unwrap();
    let first = svc.submit(Command::new("echo", json!("first"))).await.unwrap().id;
    let st = store.wait(&first, Duration::from_secs(10)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    for stop in ["close", "drain", "abort", "drop"] {
        // The service is now blocked in a read for the next message; stop it and start another.
        match stop {
            "close" => {
                svc.close().await;
            }
            "drain" => {
                svc.drain(Duration::from_secs(1)).await;
            }
            "abort" => svc.abort(),
            _ => drop(svc),
        }
        svc = start().await.unwrap();
        let id = svc.submit(Command::new("echo", json!(stop))).await.unwrap().id;
        // Runs in milliseconds; 5 s of slack for a loaded machine, far below the 30 s a message
        // taken by a read left behind would wait.
        let st = store.wait(&id, Duration::from_secs(5)).await.unwrap();
        assert_eq!(
            (st.status, st.result.clone()),
            (CommandStatus::Succeeded, Some(json!(stop).into())),
            "a command submitted right after a service was stopped with {stop} did not run within 5 s: \
             {st:?}; queue: {:?}",
            store.messages().stats(&q).await
        );
    }
    svc.close().await;
}

/// Names of the consumers of `queue`'s group (`XINFO CONSUMERS baton:q:{queue} baton`).
fn group_consumers(redis: &RedisServer, queue: &str) -> Vec<String> {
    let out = redis.cli(&["XINFO", "CONSUMERS", &keys::stream(keys::DEFAULT_PREFIX, queue), keys::DEFAULT_GROUP]);
    let lines: Vec<&str> = out.lines().collect();
    lines.windows(2).filter(|w| w[0] == "name").map(|w| w[1].to_string()).collect()
}

/// `QueueSettings::reap_idle_consumers_after` reaches the queue's consumer: a member of the group
/// that never reads (as a stopped worker leaves behind) is removed by the running service once
/// idle for the configured window, while a service configured with `None` keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_foreign_consumers_are_reaped_after_the_configured_window() {
    baton_testkit::require_redis();
    let redis = RedisServer::start();
    let store = redis_store(&redis).await;
    let (reaping, keeping) = (queue_name("reaping"), queue_name("keeping"));
    let claim = Duration::from_millis(500);
    let window = Duration::from_secs(1);
    let start = |q: &str, reap: Option<Duration>| {
        CommandService::builder(store.clone(), q)
            .settings(QueueSettings {
                claim_timeout: claim,
                reap_idle_consumers_after: reap,
                ..QueueSettings::default()
            })
            .handler("echo", on_execute(|c: Command| async move { Ok(CommandResult::succeeded(c.params)) }))
            .start()
    };
    // The services create the groups; then a stale member joins each (idle from now on).
    let keeper = start(&keeping, None).await.unwrap();
    let reaper = start(&reaping, Some(window)).await.unwrap();
    let own = |q: &str| group_consumers(&redis, q);
    assert_eq!(own(&keeping).len(), 1, "{:?}", own(&keeping));
    assert_eq!(own(&reaping).len(), 1, "{:?}", own(&reaping));
    assert!(own(&reaping)[0].starts_with("baton-cmd-"), "{:?}", own(&reaping));
    for q in [&keeping, &reaping] {
        let stream = keys::stream(keys::DEFAULT_PREFIX, q);
        assert_eq!(redis.cli(&["XGROUP", "CREATECONSUMER", &stream, keys::DEFAULT_GROUP, "stale-worker"]), "1");
    }
    let created = std::time::Instant::now();

    let reaped = eventually(Duration::from_secs(10), || async {
        (!own(&reaping).iter().any(|c| c == "stale-worker")).then_some(())
    })
    .await;
    assert!(reaped.is_some(), "stale-worker still in the group of {reaping}: {:?}", own(&reaping));
    assert!(created.elapsed() >= window, "removed after {:?}, before the {window:?} window", created.elapsed());
    // The service's own consumer stays.
    assert_eq!(own(&reaping).len(), 1, "{:?}", own(&reaping));
    assert!(own(&reaping)[0].starts_with("baton-cmd-"), "{:?}", own(&reaping));

    // The stale member of the `None` queue is at least as idle, and stays through a few more
    // windows' worth of reap checks.
    tokio::time::sleep(2 * window).await;
    let kept = own(&keeping);
    assert_eq!(kept.len(), 2, "{kept:?}");
    assert!(kept.iter().any(|c| c == "stale-worker"), "{kept:?}");
    keeper.close().await;
    reaper.close().await;
}
