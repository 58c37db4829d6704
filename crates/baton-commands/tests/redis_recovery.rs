//! Redis only: on Cluster the id → queue lookup key is written before the submit script (own
//! slot). A crash between the two leaves a lookup with no state; these tests recreate exactly
//! that leftover and check that it reads as "not found" and that a retried submit recovers.

use crate::common;

use std::time::Duration;

use baton_commands::{Command, CommandResult, CommandService, CommandStatus};
use baton_redis::{redis, RedisClient};
use baton_testkit::{require_redis, RedisCluster, RedisServer, TestBackend};
use common::*;
use serde_json::json;

async fn crash_after_lookup_write_is_recovered(b: TestBackend) {
    let store = store_for(&b).await;
    let mut conn = RedisClient::new(b.redis_config().unwrap()).unwrap().shared().await.unwrap();
    let q = queue_name("recover");
    for (id, leftover_home) in [("crashed-same", q.clone()), ("crashed-other", queue_name("elsewhere"))] {
        // The leftover of a submit that died after its lookup write.
        let _: () = redis::cmd("SET")
            .arg(format!("baton:cmdid:{{{id}}}"))
            .arg(&leftover_home)
            .arg("PX")
            .arg(600_000)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(store.get(id).await.unwrap(), None, "a lookup without state is not found");
        let st = store.submit(&q, Command::with_id(id, "echo", json!({"n": 1}))).await.unwrap();
        assert_eq!((st.status, st.version, st.queue.as_str()), (CommandStatus::Submitted, 1, q.as_str()));
        assert_eq!(store.get(id).await.unwrap().unwrap().queue, q);
    }
    // State and message were written together: two commands, two messages.
    assert_eq!(store.messages().stats(&q).await.unwrap().length, 2);
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler("echo", on_execute(|c: Command| async move { Ok(CommandResult::succeeded(c.params)) }))
        .start()
        .await
        .unwrap();
    for id in ["crashed-same", "crashed-other"] {
        let st = store.wait(id, Duration::from_secs(10)).await.unwrap();
        assert_eq!((st.status, st.result), (CommandStatus::Succeeded, Some(json!({"n": 1}).into())));
    }
    svc.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone() {
    require_redis();
    crash_after_lookup_write_is_recovered(TestBackend::Standalone(RedisServer::start())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster() {
    require_redis();
    crash_after_lookup_write_is_recovered(TestBackend::Cluster(RedisCluster::start())).await;
}

/// Right after a Redis restart (the store's connections still point at the old server process)
/// a service starts at the first try, and a submit succeeds at the first try.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_starts_right_after_a_redis_restart() {
    require_redis();
    let mut b = TestBackend::Standalone(RedisServer::start());
    let store = store_for(&b).await;
    let q = queue_name("restarted");
    // Connections in use before the restart.
    store.submit(&q, Command::with_id("before", "echo", json!(1))).await.unwrap();
    if let TestBackend::Standalone(server) = &mut b {
        server.kill();
        server.restart();
    }
    let svc = CommandService::builder(store.clone(), &q)
        .settings(fast())
        .handler("echo", on_execute(|c: Command| async move { Ok(CommandResult::succeeded(c.params)) }))
        .start()
        .await
        .expect("the first start after a restart succeeds");
    // The store's own connection also meets the restart first here: the submit still succeeds.
    let st = store.submit_and_wait(&q, Command::new("echo", json!(2)), Duration::from_secs(10)).await.unwrap();
    assert_eq!((st.status, st.result), (CommandStatus::Succeeded, Some(json!(2).into())));
    svc.close().await;
}
