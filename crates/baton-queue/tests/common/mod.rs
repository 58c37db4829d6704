//! Helpers shared by the queue test files.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_queue::{keys, Consumer, ConsumerOptions, Decision, Delivery, Handler, MessageStream, RedisQueueOptions};
use baton_redis::redis;
use baton_redis::{RedisClient, RedisConn};
use baton_testkit::TestBackend;
use tokio::sync::Notify;

pub async fn stream_for(b: &TestBackend) -> MessageStream {
    match b.redis_config() {
        None => MessageStream::memory(),
        Some(cfg) => MessageStream::redis(RedisClient::new(cfg).unwrap(), RedisQueueOptions::default()).await.unwrap(),
    }
}

pub async fn conn_for(b: &TestBackend) -> Option<RedisConn> {
    Some(RedisClient::new(b.redis_config()?).unwrap().shared().await.unwrap())
}

/// Owners of the pending entries of `queue` (Redis only), via XPENDING.
pub async fn pending_owners(conn: &mut RedisConn, queue: &str) -> Vec<(String, String, u64)> {
    let v: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(keys::stream(keys::DEFAULT_PREFIX, queue))
        .arg(keys::DEFAULT_GROUP)
        .arg("-")
        .arg("+")
        .arg(1000)
        .query_async(conn)
        .await
        .unwrap_or_default();
    v.into_iter().map(|(id, owner, _idle, n)| (id, owner, n)).collect()
}

pub use baton_testkit::eventually;

pub fn queue_name(tag: &str) -> String {
    format!("{tag}-{}", uuid::Uuid::now_v7())
}

pub fn fast(ct_ms: u64) -> ConsumerOptions {
    ConsumerOptions::new().with_claim_timeout(Duration::from_millis(ct_ms)).with_reap_idle_consumers_after(None)
}

/// One consumer of the queue's group as `XINFO CONSUMERS` lists it (Redis only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupConsumer {
    pub name: String,
    pub pending: u64,
    pub idle_ms: u64,
}

/// `XINFO CONSUMERS baton:q:{queue} baton` (Redis only). An unknown stream or group (nothing
/// registered yet) is an empty list.
pub async fn xinfo_consumers(conn: &mut RedisConn, queue: &str) -> Vec<GroupConsumer> {
    use baton_redis::redis::Value;
    let r: redis::RedisResult<Value> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(keys::stream(keys::DEFAULT_PREFIX, queue))
        .arg(keys::DEFAULT_GROUP)
        .query_async(conn)
        .await;
    let v = match r {
        Ok(v) => v,
        Err(e) if e.to_string().contains("no such key") || e.to_string().contains("NOGROUP") => return Vec::new(),
        Err(e) => panic!("XINFO CONSUMERS {queue}: {e}"),
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        other => format!("{other:?}"),
    };
    let Value::Array(items) = v else { panic!("XINFO CONSUMERS: unexpected reply {v:?}") };
    items
        .iter()
        .map(|c| {
            let pairs: Vec<(String, String)> = match c {
                Value::Array(kv) => kv.chunks(2).map(|p| (text(&p[0]), text(&p[1]))).collect(),
                Value::Map(m) => m.iter().map(|(k, v)| (text(k), text(v))).collect(),
                other => panic!("XINFO CONSUMERS entry: {other:?}"),
            };
            let get = |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()).unwrap_or_default();
            GroupConsumer {
                name: get("name"),
                pending: get("pending").parse().unwrap_or(0),
                idle_ms: get("idle").parse().unwrap_or(0),
            }
        })
        .collect()
}

/// The names `XINFO CONSUMERS` lists for `queue`, sorted.
pub async fn consumer_names(conn: &mut RedisConn, queue: &str) -> Vec<String> {
    let mut v: Vec<String> = xinfo_consumers(conn, queue).await.into_iter().map(|c| c.name).collect();
    v.sort();
    v
}

/// Ports of the Redis nodes of a backend (empty for memory).
pub fn redis_ports(b: &TestBackend) -> Vec<u16> {
    b.redis_config()
        .map(|cfg| {
            let urls = cfg.urls().to_vec();
            urls.iter().map(|u| u.rsplit(':').next().unwrap().trim_end_matches('/').parse().unwrap()).collect()
        })
        .unwrap_or_default()
}

/// Client connections open on the nodes at `ports` (the sum of `CLIENT LIST` lines), not
/// counting the `redis-cli` connection that asks.
pub fn client_connections(ports: &[u16]) -> usize {
    ports
        .iter()
        .map(|p| {
            let out = std::process::Command::new("redis-cli")
                .args(["-h", "127.0.0.1", "-p", &p.to_string(), "CLIENT", "LIST"])
                .stdin(std::process::Stdio::null())
                .output()
                .expect("run redis-cli");
            assert!(out.status.success(), "redis-cli CLIENT LIST on port {p} failed");
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.starts_with("id=") && !l.contains("cmd=client|list"))
                .count()
        })
        .sum()
}

/// A handler that counts its starts in `started` and acks each delivery at once.
pub fn acking_counter(started: Arc<AtomicUsize>) -> impl Handler {
    move |_d: Delivery| {
        let started = started.clone();
        async move {
            started.fetch_add(1, Ordering::SeqCst);
            Decision::Ack
        }
    }
}

/// Waits up to `within` for `counter` to read exactly `want`; `None` if it did not (a counter
/// past `want` never matches).
pub async fn count_is(counter: &AtomicUsize, want: usize, within: Duration) -> Option<()> {
    eventually(within, || {
        let n = counter.load(Ordering::SeqCst);
        async move { (n == want).then_some(()) }
    })
    .await
}

/// A consumer of `queue` whose handler notifies the returned `Notify` and then hangs for 60 s
/// (longer than any test) without acking: a live consumer's stuck handler, or, once the consumer
/// is aborted, a dead consumer's entry.
pub async fn hanging_consumer(s: &MessageStream, queue: &str, opts: ConsumerOptions) -> (Consumer, Arc<Notify>) {
    let started = Arc::new(Notify::new());
    let st = started.clone();
    let c = s
        .consume(
            queue,
            move |_d: Delivery| {
                let st = st.clone();
                async move {
                    st.notify_one();
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    Decision::Ack
                }
            },
            opts,
        )
        .await
        .unwrap();
    (c, started)
}

/// A child process running one ignored test of the current test binary as a worker (killed and
/// reaped when dropped).
pub struct ChildWorker(pub std::process::Child);

impl Drop for ChildWorker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts this test binary again running only the ignored test `test` (its worker entry point,
/// named by its path in the binary: `<file>::<test>`)
/// with the environment `envs`, and waits until it prints `READY` (its consumer started).
pub fn spawn_child_worker(test: &str, envs: &[(&str, &str)]) -> ChildWorker {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--include-ignored", "--nocapture", "--test-threads=1"])
        .envs(envs.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd.spawn().expect("spawn worker");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        let line = lines.next().expect("worker exited before READY").unwrap();
        if line.contains("READY ") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    ChildWorker(child)
}

/// The process's metrics recorder (a debugging recorder, installed on first use: one per test
/// binary, shared by every file). Call it before the code whose counters a test reads.
pub fn metrics_recorder() -> &'static metrics_util::debugging::Snapshotter {
    static S: std::sync::OnceLock<metrics_util::debugging::Snapshotter> = std::sync::OnceLock::new();
    S.get_or_init(|| {
        let rec = metrics_util::debugging::DebuggingRecorder::new();
        let snap = rec.snapshotter();
        rec.install().expect("install the debugging recorder once");
        snap
    })
}

/// A counter's total so far over the series whose labels include every pair of `labels`.
/// Snapshots reset the debugging recorder's counters and tests run concurrently, so every
/// snapshot is folded into one tally shared by all tests of the binary.
pub fn counter_total(name: &str, labels: &[(&str, &str)]) -> u64 {
    type Series = (String, Vec<(String, String)>);
    static TALLY: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<Series, u64>>> =
        std::sync::OnceLock::new();
    let snap = metrics_recorder();
    let mut tally = TALLY.get_or_init(Default::default).lock().unwrap();
    for (k, _, _, v) in snap.snapshot().into_vec() {
        if let metrics_util::debugging::DebugValue::Counter(n) = v {
            let ls = k.key().labels().map(|l| (l.key().to_string(), l.value().to_string())).collect();
            *tally.entry((k.key().name().to_string(), ls)).or_default() += n;
        }
    }
    tally
        .iter()
        .filter(|((n, ls), _)| n == name && labels.iter().all(|(k, v)| ls.iter().any(|(lk, lv)| lk == k && lv == v)))
        .map(|(_, v)| *v)
        .sum()
}

/// Warnings and errors logged by this process (every target), captured from the first call on:
/// the process's one tracing subscriber, shared by every file of the test binary.
#[derive(Clone, Default)]
pub struct LogBuf(pub std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs (once) the subscriber that captures warnings into [`LogBuf`] and returns the buffer.
pub fn captured_logs() -> &'static LogBuf {
    static L: std::sync::OnceLock<LogBuf> = std::sync::OnceLock::new();
    L.get_or_init(|| {
        let buf = LogBuf::default();
        let w = buf.clone();
        tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .init();
        buf
    })
}
