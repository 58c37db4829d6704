//! Two service instances, a 3 s `execute` at claim timeout 1 s: `execute` runs exactly once; the
//! instance running it killed → exactly one re-`execute` elsewhere and no `check_status` before.
//!
//! Redis (standalone and Cluster): the instances are child processes (this test binary re-run as
//! `child_instance`), killed with SIGKILL. Memory: two instances in this process (memory state
//! cannot be shared across processes); the killed one is aborted like a dead process.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command as Proc, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_commands::{Command, CommandResult, CommandService, CommandStatus, CommandStore, QueueSettings};
use baton_redis::redis;
use baton_redis::{RedisClient, RedisConfig, RedisServers};
use baton_testkit::{require_redis, RedisCluster, RedisServer, TestBackend};
use common::*;
use serde_json::json;

fn settings() -> QueueSettings {
    QueueSettings {
        claim_timeout: Duration::from_secs(1),
        check_status_interval: Duration::from_millis(100),
        ..QueueSettings::default()
    }
}

/// The handler of both instances: logs `<instance>:exec-start`, sleeps 3 s, logs `exec-end`,
/// succeeds; `check_status` logs `<instance>:check`. `log` appends to the command's log.
fn start_instance<L>(
    store: CommandStore,
    queue: &str,
    instance: &str,
    log: L,
) -> impl std::future::Future<Output = CommandService>
where
    L: Fn(String, String) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
        + Send
        + Sync
        + Clone
        + 'static,
{
    let (inst, inst2, log2) = (instance.to_string(), instance.to_string(), log.clone());
    let q = queue.to_string();
    async move {
        CommandService::builder(store, &q)
            .settings(settings())
            .handler(
                "sleep3",
                on_execute(move |c: Command| {
                    let (inst, log) = (inst.clone(), log.clone());
                    async move {
                        log(c.id.clone(), format!("{inst}:exec-start")).await;
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        log(c.id.clone(), format!("{inst}:exec-end")).await;
                        Ok(CommandResult::succeeded(json!({ "by": inst })))
                    }
                })
                .on_check(move |c, _s| {
                    let (inst, log) = (inst2.clone(), log2.clone());
                    async move {
                        log(c.id.clone(), format!("{inst}:check")).await;
                        Ok(CommandResult::running())
                    }
                }),
            )
            .start()
            .await
            .unwrap()
    }
}

fn log_key(id: &str) -> String {
    format!("test:log:{{{id}}}")
}

fn config_env(cfg: &RedisConfig) -> String {
    match &cfg.servers {
        RedisServers::Standalone(u) => format!("standalone|{u}"),
        RedisServers::Cluster(us) => format!("cluster|{}", us.join(",")),
        RedisServers::Sentinel { .. } => unreachable!("these tests run standalone and Cluster"),
    }
}

fn config_from_env(s: &str) -> RedisConfig {
    let (kind, rest) = s.split_once('|').unwrap();
    match kind {
        "standalone" => RedisConfig::standalone(rest.to_string()),
        _ => RedisConfig::cluster(rest.split(',')),
    }
}

/// The child process: one service instance on Redis; prints READY, runs until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a child process by the failover tests"]
async fn child_instance() {
    let Ok(cfg) = std::env::var("BATON_CMD_CHILD_REDIS") else { return };
    let queue = std::env::var("BATON_CMD_CHILD_QUEUE").unwrap();
    let instance = std::env::var("BATON_CMD_CHILD_NAME").unwrap();
    let client = RedisClient::new(config_from_env(&cfg)).unwrap();
    let store = CommandStore::redis(client.clone(), Default::default()).await.unwrap();
    let conn = client.shared().await.unwrap();
    let log = move |id: String, line: String| -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        let mut conn = conn.clone();
        Box::pin(async move {
            let _: i64 = redis::cmd("RPUSH").arg(log_key(&id)).arg(line).query_async(&mut conn).await.unwrap();
        })
    };
    let _svc = start_instance(store, &queue, &instance, log).await;
    println!("READY {instance}");
    std::future::pending::<()>().await;
}

struct ChildGuard(Child);
impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_child(cfg: &RedisConfig, queue: &str, name: &str) -> ChildGuard {
    let mut child = Proc::new(std::env::current_exe().unwrap())
        .args(["--exact", "failover::child_instance", "--nocapture", "--include-ignored"])
        .env("BATON_CMD_CHILD_REDIS", config_env(cfg))
        .env("BATON_CMD_CHILD_QUEUE", queue)
        .env("BATON_CMD_CHILD_NAME", name)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.starts_with("READY") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60)).expect("child instance ready");
    ChildGuard(child)
}

async fn redis_log(conn: &mut baton_redis::RedisConn, id: &str) -> Vec<String> {
    redis::cmd("LRANGE").arg(log_key(id)).arg(0).arg(-1).query_async(conn).await.unwrap()
}

async fn cross_process(b: TestBackend) {
    let cfg = b.redis_config().unwrap();
    let queue = queue_name("failover");
    let store = store_for(&b).await;
    let mut conn = RedisClient::new(cfg.clone()).unwrap().shared().await.unwrap();
    let mut children = [Some(spawn_child(&cfg, &queue, "a")), Some(spawn_child(&cfg, &queue, "b"))];

    // 1. Both alive: the 3 s execute (3× the claim timeout) runs exactly once.
    let id1 = store.submit(&queue, Command::new("sleep3", json!({}))).await.unwrap().id;
    let st = store.wait(&id1, Duration::from_secs(30)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    let log = redis_log(&mut conn, &id1).await;
    assert_eq!(log.len(), 2, "{log:?}");
    let who = log[0].split(':').next().unwrap().to_string();
    assert_eq!(log, vec![format!("{who}:exec-start"), format!("{who}:exec-end")]);
    assert_eq!(st.attempts, 1);

    // 2. The instance running it is killed (SIGKILL): exactly one re-execute elsewhere.
    let id2 = store.submit(&queue, Command::new("sleep3", json!({}))).await.unwrap().id;
    let first = eventually(Duration::from_secs(10), || {
        let mut conn = conn.clone();
        let id2 = id2.clone();
        async move { redis_log(&mut conn, &id2).await.first().cloned() }
    })
    .await
    .expect("execute started");
    let victim = first.split(':').next().unwrap().to_string();
    let idx = if victim == "a" { 0 } else { 1 };
    children[idx].take(); // SIGKILL + reap
    let survivor = if victim == "a" { "b" } else { "a" };
    let st = store.wait(&id2, Duration::from_secs(30)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    assert_eq!(st.result, Some(json!({ "by": survivor }).into()));
    let log = redis_log(&mut conn, &id2).await;
    assert_eq!(
        log,
        vec![format!("{victim}:exec-start"), format!("{survivor}:exec-start"), format!("{survivor}:exec-end")],
        "one re-execute on the survivor, no check_status before it"
    );
    assert_eq!(st.attempts, 1, "the killed attempt never returned");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_standalone() {
    require_redis();
    cross_process(TestBackend::Standalone(RedisServer::start())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_cluster() {
    require_redis();
    cross_process(TestBackend::Cluster(RedisCluster::start())).await;
}

/// Memory: two instances in one process; the one running `execute` is aborted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_memory() {
    let store = CommandStore::memory();
    let queue = queue_name("failover");
    let logs: Arc<Mutex<Vec<(String, String)>>> = Arc::new(Mutex::new(Vec::new()));
    let l2 = logs.clone();
    let log = move |id: String, line: String| -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        l2.lock().unwrap().push((id, line));
        Box::pin(async {})
    };
    let a = start_instance(store.clone(), &queue, "a", log.clone()).await;
    let b = start_instance(store.clone(), &queue, "b", log).await;
    let lines = |id: &str| -> Vec<String> {
        logs.lock().unwrap().iter().filter(|(i, _)| i == id).map(|(_, l)| l.clone()).collect()
    };
    let id1 = store.submit(&queue, Command::new("sleep3", json!({}))).await.unwrap().id;
    let st = store.wait(&id1, Duration::from_secs(30)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    let log = lines(&id1);
    let who = log[0].split(':').next().unwrap().to_string();
    assert_eq!(log, vec![format!("{who}:exec-start"), format!("{who}:exec-end")]);

    let id2 = store.submit(&queue, Command::new("sleep3", json!({}))).await.unwrap().id;
    let first = eventually(Duration::from_secs(10), || {
        let l = lines(&id2);
        async move { l.first().cloned() }
    })
    .await
    .expect("execute started");
    let victim = first.split(':').next().unwrap().to_string();
    let survivor = if victim == "a" { "b" } else { "a" };
    if victim == "a" {
        a.abort();
    } else {
        b.abort();
    }
    let st = store.wait(&id2, Duration::from_secs(30)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded);
    assert_eq!(
        lines(&id2),
        vec![format!("{victim}:exec-start"), format!("{survivor}:exec-start"), format!("{survivor}:exec-end")]
    );
}
