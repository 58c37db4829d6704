//! Two `incident-triage` processes against one Redis: the process running a run's producer is
//! killed with SIGKILL mid-run → the stream ends as `producer_lost` within the silence timeout
//! (+ the sweeper's tick), the command ends `FAILED` with the command service's error, the engineer's pointer
//! is released, and the engineer can start a new run, which the surviving process completes.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use baton_commands::{CommandStatus, CommandStore, RedisCommandStoreOptions};
use baton_redis::{RedisClient, RedisConfig};
use baton_streams::{EndReason, ReadFrom, StreamStore, StreamStoreSettings};
use baton_testkit::{eventually, free_port, RedisServer};
use incident_triage::triage::stream_path;
use serde_json::{json, Value};

const SILENCE: Duration = Duration::from_secs(3);

struct Proc {
    name: &'static str,
    child: Child,
    base: String,
    log: std::path::PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(name: &'static str, redis: &str, dir: &std::path::Path) -> Proc {
    let port = free_port();
    let log = dir.join(format!("{name}.out"));
    let out = std::fs::File::create(&log).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_incident-triage"))
        .args(["--redis", redis, "--listen", &format!("127.0.0.1:{port}"), "--log-dir"])
        .arg(dir)
        .args([
            "--silence-timeout",
            "3s",
            "--pace",
            "300ms",
            "--check-interval",
            "500ms",
            "--monitor-claim-timeout",
            "2s",
        ])
        .args(["--worker", name])
        .stdout(Stdio::from(out.try_clone().unwrap()))
        .stderr(Stdio::from(out))
        .spawn()
        .unwrap();
    Proc { name, child, base: format!("http://127.0.0.1:{port}"), log }
}

async fn ready(http: &reqwest::Client, p: &Proc) {
    eventually(Duration::from_secs(20), || async {
        http.get(format!("{}/healthz", p.base)).send().await.ok().filter(|r| r.status().is_success()).map(|_| ())
    })
    .await
    .unwrap_or_else(|| panic!("{} did not start: {}", p.name, std::fs::read_to_string(&p.log).unwrap_or_default()));
}

async fn events(streams: &StreamStore, engineer: &str, run: &str) -> Vec<Value> {
    match streams.read(&stream_path(engineer, run), ReadFrom::Start).await {
        Ok(c) => c.records.iter().map(|r| serde_json::from_slice(&r.data).unwrap()).collect(),
        Err(_) => vec![],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_producing_process() {
    baton_testkit::require_redis();
    let server = RedisServer::start();
    let dir = common::TempDir::new("procs");
    let log = dir.path().join("app.log");
    common::write_app_log(&log, 20_000);
    let http = reqwest::Client::new();
    let mut procs = vec![spawn("proc-a", &server.url(), dir.path()), spawn("proc-b", &server.url(), dir.path())];
    for p in &procs {
        ready(&http, p).await;
    }
    // The test reads Redis directly too, as a third party.
    let streams =
        StreamStore::redis(RedisConfig::standalone(server.url()), StreamStoreSettings::default()).await.unwrap();
    let client = RedisClient::new(RedisConfig::standalone(server.url())).unwrap();
    let commands = CommandStore::redis(client, RedisCommandStoreOptions::default()).await.unwrap();

    let body = json!({"engineer": "gus", "source": {"kind": "path", "path": log}});
    let r = http.post(format!("{}/api/runs", procs[0].base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 201);
    let run = r.json::<Value>().await.unwrap()["run"].as_str().unwrap().to_string();
    // Mid-run: a few events in; the `started` event names the producing process.
    let evs = eventually(Duration::from_secs(15), || async {
        let e = events(&streams, "gus", &run).await;
        (e.len() >= 4).then_some(e)
    })
    .await
    .expect("the run streams events");
    let worker = evs[0]["worker"].as_str().unwrap().to_string();
    let victim = procs.iter().position(|p| p.name == worker).expect("a known worker");
    let mut dead = procs.remove(victim);
    let survivor = &procs[0];
    dead.child.kill().unwrap(); // SIGKILL
    dead.child.wait().unwrap();
    let killed_at = Instant::now();
    eprintln!("killed {} (the producer) after {} events", dead.name, evs.len());

    // The stream ends as producer_lost within the silence timeout (+ sweep tick and slack).
    let head = eventually(SILENCE + Duration::from_secs(3), || async {
        streams.head(&stream_path("gus", &run)).await.ok().filter(|h| h.end.is_some())
    })
    .await
    .expect("the stream ended");
    let ended_after = killed_at.elapsed();
    assert_eq!(head.end.unwrap().reason, EndReason::ProducerLost);
    assert!(ended_after <= SILENCE + Duration::from_secs(2), "ended {ended_after:?} after the kill");
    // The command ends FAILED with a clear error (the survivor's monitor completes it).
    let st = commands.wait(&run, Duration::from_secs(20)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Failed, "{st:?}");
    let err = st.error.unwrap();
    // The command service's mapping of the output's producer_lost end.
    assert_eq!(
        err,
        format!(
            "output stream triage/gus/{run} ended producer_lost: nothing was appended to it for {}",
            humantime::format_duration(SILENCE)
        )
    );
    // The pointer is released and the engineer can start again; the survivor runs it to the end.
    let cur = http.get(format!("{}/api/engineers/gus/current", survivor.base)).send().await.unwrap();
    assert_eq!(cur.status(), 404, "pointer released");
    let small = dir.path().join("small.log");
    common::write_app_log(&small, 500);
    let body = json!({"engineer": "gus", "source": {"kind": "path", "path": small}});
    let r = http.post(format!("{}/api/runs", survivor.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 201);
    let run2 = r.json::<Value>().await.unwrap()["run"].as_str().unwrap().to_string();
    let st = commands.wait(&run2, Duration::from_secs(60)).await.unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded, "{st:?}");
    assert_eq!(events(&streams, "gus", &run2).await[0]["worker"], survivor.name);
    eprintln!("stream ended producer_lost {ended_after:?} after the SIGKILL; command FAILED: {err}");
}
