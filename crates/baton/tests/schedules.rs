//! Cron schedules from the configuration (`[[queues.<q>.schedules]]`) run by `baton worker`
//! processes sharing one Redis (standalone and Cluster): every due time has exactly one command
//! while one process is SIGKILLed mid-way; the fires are counted in `/metrics`; the schedules
//! and their last fire are served at `GET /v1/queues/{queue}/schedules`.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use baton::server::Server;
use baton::settings::ServeArgs;
use baton_commands::{CommandStore, ListQuery, RedisCommandStoreOptions};
use baton_redis::{RedisClient, RedisConfig};
use baton_testkit::{eventually, free_port, RedisCluster, RedisServer};
use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

const CONFIG: &str = r#"
[queues.cron]
claim_timeout = "1s"
poll_interval = "100ms"
[queues.cron.handlers]
say = "echo"

[[queues.cron.schedules]]
name = "tick"
cron = "* * * * * *"
type = "say"
params = { hello = "world" }
overlap = "allow"
"#;

struct Worker {
    child: Child,
    port: u16,
}

impl Worker {
    fn spawn(config: &std::path::Path, redis: &[String]) -> Worker {
        let port = free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
        cmd.args(["worker", "--shutdown-grace", "1s", "--listen", &format!("127.0.0.1:{port}")])
            .arg("--config")
            .arg(config);
        if redis.len() == 1 {
            cmd.args(["--redis", &redis[0]]);
        } else {
            cmd.args(["--redis-cluster", &redis.join(",")]);
        }
        let child = cmd
            .env_remove("BATON_REDIS_CLUSTER")
            .env_remove("BATON_REDIS")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("baton worker starts");
        Worker { child, port }
    }

    async fn ready(&self) {
        let ok = eventually(Duration::from_secs(20), || async {
            let r = client().get(format!("http://127.0.0.1:{}/readyz", self.port)).send().await.ok()?;
            (r.status() == StatusCode::OK).then_some(())
        })
        .await;
        assert!(ok.is_some(), "worker did not become ready");
    }

    /// The sum of `baton_schedule_fires_total` of schedule `tick` by result, from `/metrics`.
    async fn fires(&self) -> std::collections::BTreeMap<String, u64> {
        let text =
            client().get(format!("http://127.0.0.1:{}/metrics", self.port)).send().await.unwrap().text().await.unwrap();
        let mut out = std::collections::BTreeMap::new();
        for line in text.lines().filter(|l| l.starts_with("baton_schedule_fires_total{")) {
            let result = line.split("result=\"").nth(1).and_then(|r| r.split('"').next()).unwrap().to_string();
            let n: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
            *out.entry(result).or_default() += n;
        }
        out
    }
}

impl Worker {
    /// SIGTERM, then waits for the exit (a graceful stop: the scheduler finishes its tick).
    fn terminate(mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }
}

/// The due times (ms) of the queue's `sched-cron.tick-*` commands, sorted.
async fn fired_due_times(store: &CommandStore) -> Vec<i64> {
    let mut dues = Vec::new();
    let mut cursor = None;
    loop {
        let page =
            store.list("cron", ListQuery { limit: 1000, cursor: cursor.clone(), ..Default::default() }).await.unwrap();
        for st in &page.items {
            let due = st.id.strip_prefix("sched-cron.tick-").expect("a scheduled command").parse::<i64>().unwrap();
            assert_eq!(st.params.get(), r#"{"hello":"world"}"#);
            dues.push(due);
        }
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    dues.sort();
    dues
}

/// A temporary directory with [`CONFIG`] as `baton.toml`, and three worker processes on it
/// (Redis at `redis`: one URL, or a Cluster's), all ready. `tag` names the directory.
async fn three_workers(tag: &str, redis: &[String]) -> (std::path::PathBuf, Vec<Worker>) {
    let dir = std::env::temp_dir().join(format!("{tag}-{}-{}", std::process::id(), free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("baton.toml");
    std::fs::write(&path, CONFIG).unwrap();
    let workers: Vec<Worker> = (0..3).map(|_| Worker::spawn(&path, redis)).collect();
    for w in &workers {
        w.ready().await;
    }
    (dir, workers)
}

/// Checks what the workers left in Redis at `config`: at least `at_least` `tick` commands, one
/// per due time with none missing (due times 1 s apart), nothing counted missed, and the
/// schedule's cursor at the last one. Returns the due times (ms, sorted) and the record.
async fn one_command_per_due_time(
    config: RedisConfig,
    at_least: usize,
) -> (Vec<i64>, baton_commands::schedules::ScheduleRecord) {
    let store =
        CommandStore::redis(RedisClient::new(config).unwrap(), RedisCommandStoreOptions::default()).await.unwrap();
    let dues = fired_due_times(&store).await;
    assert!(dues.len() >= at_least, "{dues:?}");
    for pair in dues.windows(2) {
        assert_eq!(pair[1] - pair[0], 1000, "a due time without its command, or two for one: {dues:?}");
    }
    let rec = store.schedule_record("cron", "tick").await.unwrap().unwrap();
    assert_eq!(rec.missed_total, 0);
    assert_eq!(rec.cursor_ms, *dues.last().unwrap());
    (dues, rec)
}

async fn three_workers_one_killed(redis: Vec<String>, config: RedisConfig) {
    let (dir, mut workers) = three_workers("baton-sched", &redis).await;
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    drop(workers.remove(0)); // SIGKILL, wherever it was
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let counted: Vec<_> = futures::future::join_all(workers.iter().map(|w| w.fires())).await;
    for w in workers {
        w.terminate();
    }
    let (dues, _) = one_command_per_due_time(config, 5).await;
    // The survivors decided some of them, each one once (the killed one's counts died with it).
    let survived: u64 = counted.iter().flat_map(|m| m.values()).sum();
    assert!(survived >= 2 && survived <= dues.len() as u64, "{counted:?} vs {} commands", dues.len());
    for m in &counted {
        assert!(m.keys().all(|r| r == "fired" || r == "overlapped"), "{counted:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_processes_fire_once_per_due_time_standalone() {
    baton_testkit::require_redis();
    let redis = RedisServer::start();
    three_workers_one_killed(vec![redis.url()], redis.config()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_processes_fire_once_per_due_time_cluster() {
    baton_testkit::require_redis();
    let cluster = RedisCluster::start();
    three_workers_one_killed(cluster.urls(), cluster.config()).await;
}

/// `GET /v1/queues/{queue}/schedules` on a memory server running the schedule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_lists_schedules_with_their_last_fire() {
    let dir = std::env::temp_dir().join(format!("baton-sched-api-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("baton.toml");
    std::fs::write(
        &path,
        format!(
            "{CONFIG}\n[[queues.cron.schedules]]\nname = \"nightly\"\ncron = \"30 2 * * *\"\ntimezone = \"Europe/Berlin\"\ntype = \"say\"\nmissed = \"run_once\"\n"
        ),
    )
    .unwrap();
    let cfg = ServeArgs { config: Some(path), listen: Some("127.0.0.1:0".parse().unwrap()), ..Default::default() }
        .resolve()
        .unwrap();
    let server = Server::start(cfg).await.unwrap();
    let base = server.base_url();
    let get = || async {
        let r = client().get(format!("{base}/v1/queues/cron/schedules")).send().await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        serde_json::from_str::<Value>(&r.text().await.unwrap()).unwrap()
    };
    let fired = eventually(Duration::from_secs(5), || async {
        let v = get().await;
        (v["schedules"][0]["last_fire"]["result"] == "fired").then_some(v)
    })
    .await
    .expect("the every-second schedule fired");
    let tick = &fired["schedules"][0];
    assert_eq!(tick["name"], "tick");
    assert_eq!(tick["cron"], "* * * * * *");
    assert_eq!(tick["timezone"], "UTC");
    assert_eq!(tick["type"], "say");
    assert_eq!(tick["params"], json!({"hello": "world"}));
    assert_eq!(tick["overlap"], "allow");
    assert_eq!(tick["missed"], "skip");
    let id = tick["last_fire"]["command_id"].as_str().unwrap().to_string();
    let st: Value = serde_json::from_str(
        &client().get(format!("{base}/v1/commands/{id}?wait=5s")).send().await.unwrap().text().await.unwrap(),
    )
    .unwrap();
    assert_eq!((st["status"].as_str(), &st["result"]), (Some("SUCCEEDED"), &json!({"hello": "world"})));
    let nightly = &fired["schedules"][1];
    assert_eq!(nightly["name"], "nightly");
    assert_eq!(nightly["timezone"], "Europe/Berlin");
    assert_eq!(nightly["missed"], "run_once");
    assert_eq!(nightly["last_fire"], Value::Null);
    // 02:30 Berlin time is 00:30 or 01:30 UTC.
    let next = nightly["next_due"].as_str().unwrap();
    assert!(next.ends_with("T00:30:00.000Z") || next.ends_with("T01:30:00.000Z"), "{next}");
    let r = client().get(format!("{base}/v1/queues/nope/schedules")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    server.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Three worker processes; for about 10 s one of them at a time is SIGSTOPped for 0.2 – 1.5 s
/// (wherever it is: between its compare-and-set and its submit, mid-submit), then SIGCONTed:
/// still exactly one command per due time, none missing, nothing counted missed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_processes_stopped_and_continued_fire_once_per_due_time() {
    baton_testkit::require_redis();
    let redis = RedisServer::start();
    let (dir, workers) = three_workers("baton-sched-stop", &[redis.url()]).await;
    let signal = |sig: &str, w: &Worker| {
        Command::new("kill").args([sig, &w.child.id().to_string()]).status().unwrap();
    };
    for i in 0..12u64 {
        let w = &workers[(i % 3) as usize];
        // A pause that varies with i, at a varying phase of the second.
        tokio::time::sleep(Duration::from_millis(37 * (i % 7))).await;
        signal("-STOP", w);
        tokio::time::sleep(Duration::from_millis(200 + (i * 271) % 1300)).await;
        signal("-CONT", w);
    }
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for w in workers {
        w.terminate();
    }
    let (_, rec) = one_command_per_due_time(redis.config(), 9).await;
    assert!(!rec.pending);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Three worker processes on a Redis (append-only file) that is frozen for 3 s, then killed and
/// restarted 2 s later: the due times of the outage fire after it (late by less than
/// `missed_after`), still exactly one command per due time, none missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_processes_ride_out_a_redis_pause_and_restart() {
    baton_testkit::require_redis();
    let mut redis = RedisServer::start_with(baton_testkit::ServerOptions { appendonly: true });
    let (dir, workers) = three_workers("baton-sched-restart", &[redis.url()]).await;
    tokio::time::sleep(Duration::from_millis(2_300)).await;
    redis.pause();
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    redis.resume();
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    redis.kill();
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    redis.restart();
    tokio::time::sleep(Duration::from_millis(4_000)).await;
    for w in workers {
        w.terminate();
    }
    let (_, rec) = one_command_per_due_time(redis.config(), 11).await;
    assert!(!rec.pending);
    let _ = std::fs::remove_dir_all(&dir);
}
