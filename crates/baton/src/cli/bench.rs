//! `baton bench queue|commands|streams`: workloads run in this process against a backend (memory
//! by default, `--redis` or `--redis-cluster`), with a progress bar and a summary table.
//!
//! - `queue`: closed loop at each concurrency (1, 64, 512): the consumer runs `concurrency`
//!   handlers and at most `concurrency` messages are outstanding, offered one by one by up to 64
//!   producer tasks; each is offered (with its offer time), delivered to a handler that does
//!   nothing and acknowledged. Latency: offer → handler start. Throughput: messages handled
//!   per second, measured until every message is acknowledged (queue length back to 0).
//! - `commands`: at each concurrency (64, 256), that many clients each submit a command (a no-op
//!   `echo`) and wait for `SUCCEEDED`, then submit the next. Latency: submit → `SUCCEEDED` seen.
//! - `streams`: append throughput (64 writers, each appending to its own stream; latency per
//!   append) and append → read latency (one writer, one live subscriber; the next append starts
//!   when the subscriber received the previous one).
//!
//! - `workers`: open loop, in-process handlers against the HTTP worker protocol on the same
//!   Redis, in interleaved rounds (`--rounds`, default 3) at each concurrency (64): `--count`
//!   no-op commands are submitted first (through the library, not timed), then drained, once by a
//!   command service in this process (`concurrency` handlers) and once through the HTTP worker
//!   protocol of `--server` (a `baton serve --no-workers` on the same Redis with the queue
//!   `--queue`, default `bench`, configured without handlers) by 8 workers, each a loop that
//!   claims its share of the concurrency at once (`max` = `concurrency / 8`) and settles every
//!   claimed command `succeeded`: once each in a request of its own (concurrently), once all of
//!   a claim's commands in one request (`{"settlements": [...]}`). Throughput: commands
//!   `SUCCEEDED` per second from the start of the drain until the queue's count of `SUCCEEDED`
//!   reaches the target; latency (HTTP only): from a claim's request to each of its commands'
//!   settled answers.
//!
//! Every number printed comes from the run it reports. Names are unique per run (`bench-<ms>-…`);
//! on Redis the data is left behind (streams are deleted; queue entries are acknowledged), so use
//! a scratch database.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_commands::{builtin, Command, CommandService, CommandStore, QueueSettings};
use baton_queue::{ConsumerOptions, Decision, MessageStream};
use baton_redis::RedisConfig;
use baton_streams::{AppendRequest, CreateOptions, ReadFrom, StreamPath, StreamStore, StreamStoreSettings};
use bytes::Bytes;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use super::client::CliError;
use super::exit;
use super::output::{count, print_json, Table};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// offer → no-op handler → ack, at concurrency 1, 64 and 512.
    Queue,
    /// submit → no-op execute → SUCCEEDED, at concurrency 64 and 256.
    Commands,
    /// Append throughput, and append → live read latency.
    Streams,
    /// Drain pre-submitted no-op commands: in-process handlers vs HTTP workers of `--server` (Redis only).
    Workers,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// What to run.
    pub workload: Workload,
    /// Where Redis is and how to log in, as for `baton serve` [default: the in-memory backend].
    #[command(flatten)]
    pub redis: crate::settings::RedisArgs,
    /// Operations per level [default: queue 20000, commands 5000, streams 20000 appends and 2000 round trips, workers 5000 per round and side].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub count: Option<u64>,
    /// Concurrency levels, comma separated [default: queue 1,64,512; commands 64,256; streams 64 writers; workers 64].
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub concurrency: Option<Vec<u64>>,
    /// `workers`: the `baton serve` whose HTTP workers drain the queue (same Redis as `--redis`).
    #[arg(long, env = "BATON_SERVER", default_value = "http://127.0.0.1:7700")]
    pub server: String,
    /// `workers`: bearer token with `work` on `--queue` (when the server has tokens).
    #[arg(long, env = "BATON_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// `workers`: the server's queue to drain (configured there without handlers; `--no-workers`).
    #[arg(long, default_value = "bench")]
    pub queue: String,
    /// `workers`: HTTP workers of the load generator, sharing the concurrency (each claims up to
    /// its free slots, as an SDK worker does).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub workers: u64,
    /// `workers`: interleaved rounds of in-process then HTTP.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub rounds: u64,
    /// No progress bar (also when stderr is not a terminal).
    #[arg(long)]
    pub quiet: bool,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
}

/// One measured level.
struct Row {
    name: String,
    concurrency: u64,
    ops: u64,
    elapsed: Duration,
    latencies: Vec<Duration>,
    latency_of: &'static str,
}

impl Row {
    fn throughput(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
    fn pct(&self, p: f64) -> Duration {
        percentile(&self.latencies, p)
    }
}

/// The `p` quantile (0..=1) of sorted `v` (nearest rank).
fn percentile(v: &[Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn redis_config(args: &BenchArgs) -> Result<Option<RedisConfig>, CliError> {
    args.redis.clone().resolve(Default::default()).map_err(CliError::usage)
}

fn describe(rc: &Option<RedisConfig>) -> String {
    match rc {
        None => "in-memory".into(),
        Some(c) => c.to_string(),
    }
}

fn run_id() -> String {
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis();
    format!("bench-{ms}-{}", std::process::id())
}

fn progress(quiet: bool, len: u64, label: String) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>24} [{bar:32}] {pos}/{len} {per_sec} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_prefix(label);
    pb
}

pub async fn run(args: BenchArgs) -> Result<u8, CliError> {
    let rc = redis_config(&args)?;
    let backend = describe(&rc);
    if !args.json {
        eprintln!("baton bench {} on {backend}", format!("{:?}", args.workload).to_lowercase());
    }
    let rows = match args.workload {
        Workload::Queue => bench_queue(&args, &rc).await?,
        Workload::Commands => bench_commands(&args, &rc).await?,
        Workload::Streams => bench_streams(&args, &rc).await?,
        Workload::Workers => bench_workers(&args, &rc).await?,
    };
    if args.json {
        let out: Vec<Value> = rows
            .iter()
            .map(|r| {
                json!({
                    "name": r.name, "concurrency": r.concurrency, "ops": r.ops,
                    "seconds": r.elapsed.as_secs_f64(), "ops_per_sec": r.throughput(),
                    "latency": r.latency_of,
                    "p50_ms": r.pct(0.50).as_secs_f64() * 1e3, "p99_ms": r.pct(0.99).as_secs_f64() * 1e3,
                    "max_ms": r.latencies.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
                })
            })
            .collect();
        print_json(
            &json!({ "workload": format!("{:?}", args.workload).to_lowercase(), "backend": backend, "results": out }),
        );
    } else {
        let mut t =
            Table::new(&["WORKLOAD", "CONCURRENCY", "OPS", "SECONDS", "OPS/S", "P50", "P99", "MAX", "LATENCY OF"])
                .right(&[1, 2, 3, 4, 5, 6, 7]);
        for r in &rows {
            t.row(vec![
                r.name.clone(),
                r.concurrency.to_string(),
                r.ops.to_string(),
                format!("{:.2}", r.elapsed.as_secs_f64()),
                format!("{:.0}", r.throughput()),
                fmt_ms(r.pct(0.50)),
                fmt_ms(r.pct(0.99)),
                fmt_ms(r.latencies.last().copied().unwrap_or_default()),
                r.latency_of.to_string(),
            ]);
        }
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        println!("backend: {backend}; {}", count(&cpus.to_string(), "CPU", "CPUs"));
        t.print();
    }
    Ok(exit::OK)
}

fn fmt_ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn failed(what: &str, e: impl std::fmt::Display) -> CliError {
    CliError::server(format!("bench: {what}: {e}"))
}

async fn message_stream(rc: &Option<RedisConfig>) -> Result<MessageStream, CliError> {
    match rc {
        None => Ok(MessageStream::memory()),
        Some(c) => {
            let client = baton_redis::RedisClient::new(c.clone()).map_err(|e| failed("connect", e))?;
            MessageStream::redis(client, Default::default()).await.map_err(|e| failed("connect", e))
        }
    }
}

async fn bench_queue(args: &BenchArgs, rc: &Option<RedisConfig>) -> Result<Vec<Row>, CliError> {
    let levels = args.concurrency.clone().unwrap_or_else(|| vec![1, 64, 512]);
    let count = args.count.unwrap_or(20_000);
    let ms = message_stream(rc).await?;
    let id = run_id();
    let mut rows = Vec::new();
    for c in levels {
        let queue = format!("{id}-q{c}");
        let epoch = Instant::now();
        let latencies = Arc::new(Mutex::new(Vec::with_capacity(count as usize)));
        let handled = Arc::new(AtomicU64::new(0));
        let window = Arc::new(Semaphore::new(c as usize));
        let pb = progress(args.quiet, count, format!("queue c={c}"));
        let handler = {
            let (latencies, handled, window, pb) = (latencies.clone(), handled.clone(), window.clone(), pb.clone());
            move |d: baton_queue::Delivery| {
                let (latencies, handled, window, pb) = (latencies.clone(), handled.clone(), window.clone(), pb.clone());
                async move {
                    let sent = u64::from_le_bytes(d.payload[..8].try_into().unwrap_or([0; 8]));
                    let lat = epoch.elapsed().saturating_sub(Duration::from_nanos(sent));
                    latencies.lock().unwrap().push(lat);
                    handled.fetch_add(1, Ordering::Relaxed);
                    pb.inc(1);
                    window.add_permits(1);
                    Decision::Ack
                }
            }
        };
        let opts = ConsumerOptions::new()
            .with_concurrency(c as usize)
            .with_max_deliveries(None)
            .with_consumer_prefix("baton-bench");
        let consumer = ms.consume(&queue, handler, opts).await.map_err(|e| failed("consume", e))?;
        let start = Instant::now();
        // Producers: up to 64 tasks share the window so offers are not serialized on one round trip.
        let producers = c.clamp(1, 64);
        let offered = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for _ in 0..producers {
            let (ms, queue, window, offered) = (ms.clone(), queue.clone(), window.clone(), offered.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    let permit = window.acquire().await.expect("never closed");
                    if offered.fetch_add(1, Ordering::Relaxed) >= count {
                        return Ok(());
                    }
                    permit.forget();
                    let ts = (epoch.elapsed().as_nanos() as u64).to_le_bytes();
                    ms.offer(&queue, Bytes::copy_from_slice(&ts)).await?;
                }
            }));
        }
        for t in tasks {
            t.await.map_err(|e| failed("producer", e))?.map_err(|e: baton_queue::QueueError| failed("offer", e))?;
        }
        while handled.load(Ordering::Relaxed) < count {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // Acks follow the handlers: wait until the queue is empty.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = ms.stats(&queue).await.map_err(|e| failed("stats", e))?;
            if s.length == 0 || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let elapsed = start.elapsed();
        pb.finish_and_clear();
        let _ = consumer.close().await;
        let mut lat = std::mem::take(&mut *latencies.lock().unwrap());
        lat.sort();
        rows.push(Row {
            name: "queue".into(),
            concurrency: c,
            ops: count,
            elapsed,
            latencies: lat,
            latency_of: "offer → handler",
        });
    }
    Ok(rows)
}

async fn bench_commands(args: &BenchArgs, rc: &Option<RedisConfig>) -> Result<Vec<Row>, CliError> {
    let levels = args.concurrency.clone().unwrap_or_else(|| vec![64, 256]);
    let count = args.count.unwrap_or(5_000);
    let store = match rc {
        None => CommandStore::memory(),
        Some(c) => {
            let client = baton_redis::RedisClient::new(c.clone()).map_err(|e| failed("connect", e))?;
            CommandStore::redis(client, Default::default()).await.map_err(|e| failed("connect", e))?
        }
    };
    let id = run_id();
    let mut rows = Vec::new();
    for c in levels {
        let queue = format!("{id}-c{c}");
        let noop = builtin::from_config("echo", &Value::Null).map_err(|e| failed("handler", e))?;
        let settings = QueueSettings { concurrency: c as usize, ..QueueSettings::default() };
        let service = CommandService::builder(store.clone(), queue.clone())
            .settings(settings)
            .handler_arc("noop", noop)
            .start()
            .await
            .map_err(|e| failed("start the command service", e))?;
        let pb = progress(args.quiet, count, format!("commands c={c}"));
        let next = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..c {
            let (store, queue, next, pb) = (store.clone(), queue.clone(), next.clone(), pb.clone());
            tasks.push(tokio::spawn(async move {
                let mut lat = Vec::new();
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= count {
                        return Ok::<_, String>(lat);
                    }
                    let t = Instant::now();
                    let st = store
                        .submit(&queue, Command::with_id(format!("{queue}-{n}"), "noop", Value::Null))
                        .await
                        .map_err(|e| format!("submit: {e}"))?;
                    let done = store.wait(&st.id, Duration::from_secs(60)).await.map_err(|e| format!("wait: {e}"))?;
                    if done.status != baton_commands::CommandStatus::Succeeded {
                        return Err(format!("command {} ended {:?}", st.id, done.status));
                    }
                    lat.push(t.elapsed());
                    pb.inc(1);
                }
            }));
        }
        let mut lat = Vec::with_capacity(count as usize);
        for t in tasks {
            lat.extend(t.await.map_err(|e| failed("client", e))?.map_err(|e| failed("commands", e))?);
        }
        let elapsed = start.elapsed();
        pb.finish_and_clear();
        service.drain(Duration::from_secs(5)).await;
        lat.sort();
        rows.push(Row {
            name: "commands".into(),
            concurrency: c,
            ops: count,
            elapsed,
            latencies: lat,
            latency_of: "submit → SUCCEEDED",
        });
    }
    Ok(rows)
}

async fn bench_streams(args: &BenchArgs, rc: &Option<RedisConfig>) -> Result<Vec<Row>, CliError> {
    let writers = args.concurrency.clone().unwrap_or_else(|| vec![64]);
    let count = args.count.unwrap_or(20_000);
    let store = match rc {
        None => StreamStore::memory(StreamStoreSettings::default()),
        Some(c) => {
            StreamStore::redis(c.clone(), StreamStoreSettings::default()).await.map_err(|e| failed("connect", e))?
        }
    };
    let id = run_id();
    let payload = Bytes::from(vec![b'x'; 100]);
    let mut rows = Vec::new();
    // Append throughput: `w` writers, each on its own stream.
    for w in writers {
        let mut paths = Vec::new();
        for i in 0..w {
            let p = StreamPath::new(format!("{id}/w{w}-{i}")).map_err(|e| failed("path", e))?;
            store
                .create(&p, CreateOptions { content_type: Some("text/plain".into()), ..Default::default() })
                .await
                .map_err(|e| failed("create", e))?;
            paths.push(p);
        }
        let pb = progress(args.quiet, count, format!("append w={w}"));
        let next = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let mut tasks = Vec::new();
        for p in paths.clone() {
            let (store, next, pb, payload) = (store.clone(), next.clone(), pb.clone(), payload.clone());
            tasks.push(tokio::spawn(async move {
                let mut lat = Vec::new();
                while next.fetch_add(1, Ordering::Relaxed) < count {
                    let t = Instant::now();
                    store
                        .append(
                            &p,
                            AppendRequest {
                                data: payload.clone(),
                                content_type: Some("text/plain".into()),
                                ..Default::default()
                            },
                        )
                        .await
                        .map_err(|e| e.to_string())?;
                    lat.push(t.elapsed());
                    pb.inc(1);
                }
                Ok::<_, String>(lat)
            }));
        }
        let mut lat = Vec::with_capacity(count as usize);
        for t in tasks {
            lat.extend(t.await.map_err(|e| failed("writer", e))?.map_err(|e| failed("append", e))?);
        }
        let elapsed = start.elapsed();
        pb.finish_and_clear();
        for p in &paths {
            let _ = store.delete(p).await;
        }
        lat.sort();
        rows.push(Row {
            name: "stream append".into(),
            concurrency: w,
            ops: count,
            elapsed,
            latencies: lat,
            latency_of: "append call",
        });
    }
    // Append → live read: one writer, one subscriber, one record in flight.
    let trips = args.count.map(|c| c.min(100_000)).unwrap_or(2_000);
    let p = StreamPath::new(format!("{id}/live")).map_err(|e| failed("path", e))?;
    store
        .create(&p, CreateOptions { content_type: Some("text/plain".into()), ..Default::default() })
        .await
        .map_err(|e| failed("create", e))?;
    let mut sub = store.subscribe(&p, ReadFrom::parse("now").map_err(|e| failed("offset", e))?);
    // Position the subscriber at the tail before the first append.
    let _ = sub.next(Duration::from_millis(1)).await.map_err(|e| failed("subscribe", e))?;
    let pb = progress(args.quiet, trips, "append → read".to_string());
    let mut lat = Vec::with_capacity(trips as usize);
    let start = Instant::now();
    for _ in 0..trips {
        let t = Instant::now();
        store
            .append(
                &p,
                AppendRequest { data: payload.clone(), content_type: Some("text/plain".into()), ..Default::default() },
            )
            .await
            .map_err(|e| failed("append", e))?;
        loop {
            let c = sub.next(Duration::from_secs(10)).await.map_err(|e| failed("live read", e))?;
            match c {
                Some(c) if !c.records.is_empty() => break,
                Some(_) => {
                    if t.elapsed() > Duration::from_secs(10) {
                        return Err(failed("live read", "the subscriber did not see an append within 10s"));
                    }
                }
                None => return Err(failed("live read", "the stream ended")),
            }
        }
        lat.push(t.elapsed());
        pb.inc(1);
    }
    let elapsed = start.elapsed();
    pb.finish_and_clear();
    let _ = store.delete(&p).await;
    lat.sort();
    rows.push(Row {
        name: "append → live read".into(),
        concurrency: 1,
        ops: trips,
        elapsed,
        latencies: lat,
        latency_of: "append → subscriber",
    });
    Ok(rows)
}

/// The command store of `rc` (memory when `None`).
async fn command_store(rc: &Option<RedisConfig>) -> Result<CommandStore, CliError> {
    match rc {
        None => Ok(CommandStore::memory()),
        Some(c) => {
            let client = baton_redis::RedisClient::new(c.clone()).map_err(|e| failed("connect", e))?;
            CommandStore::redis(client, Default::default()).await.map_err(|e| failed("connect", e))
        }
    }
}

/// Submits `count` no-op commands `{prefix}-{n}` to `queue`, 64 at a time (not timed).
async fn presubmit(store: &CommandStore, queue: &str, prefix: &str, count: u64) -> Result<(), CliError> {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (store, queue, prefix, next) = (store.clone(), queue.to_string(), prefix.to_string(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= count {
                    return Ok::<_, baton_commands::CommandError>(());
                }
                store.submit(&queue, Command::with_id(format!("{prefix}-{n}"), "noop", Value::Null)).await?;
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| failed("submit", e))?.map_err(|e| failed("submit", e))?;
    }
    Ok(())
}

/// Waits until `queue` counts `target` `SUCCEEDED` commands (polling every 2 ms); an error when
/// any failed or nothing moved for 30 s.
async fn until_succeeded(store: &CommandStore, queue: &str, target: u64, pb: &ProgressBar) -> Result<(), CliError> {
    let mut last = (0, Instant::now());
    loop {
        let c = store.counts(queue).await.map_err(|e| failed("counts", e))?;
        pb.set_position(c.succeeded.min(target));
        if c.failed + c.cancelled > 0 {
            return Err(failed(
                "drain",
                format!("{} commands of {queue} failed or were cancelled", c.failed + c.cancelled),
            ));
        }
        if c.succeeded >= target {
            return Ok(());
        }
        if c.succeeded != last.0 {
            last = (c.succeeded, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(30) {
            return Err(failed(
                "drain",
                format!("{queue}: {} of {target} SUCCEEDED and no progress for 30 s", c.succeeded),
            ));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Drains `count` no-op commands pre-submitted to the server's `queue` through the HTTP worker
/// protocol, as SDK workers do: `--workers` workers share the concurrency `c`; each claims up to
/// its free slots (long-poll), hands every claimed command to its no-op handler at once, and
/// settles finished ones while it claims again: each in a request of its own, or (`batch`)
/// everything finished since the last settlement in one request.
#[allow(clippy::too_many_arguments)]
async fn http_drain(
    args: &BenchArgs,
    store: &CommandStore,
    http: &Arc<super::client::Client>,
    queue: &str,
    id: &str,
    c: u64,
    count: u64,
    batch: bool,
) -> Result<Row, CliError> {
    let before = store.counts(queue).await.map_err(|e| failed("counts", e))?.succeeded;
    let side = if batch { "settle batch" } else { "settle each" };
    let prefix = format!("{id}-http-c{c}-{}", if batch { "batch" } else { "each" });
    presubmit(store, queue, &prefix, count).await?;
    let pb = progress(args.quiet, count, format!("http {side} c={c}"));
    let claimed_total = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    let workers = c.min(args.workers);
    for w in 0..workers {
        let (http, queue, claimed_total) = (http.clone(), queue.to_string(), claimed_total.clone());
        let worker = format!("{id}-w{w}");
        let slots = (c / workers + u64::from(w < c % workers)) as usize;
        tasks.push(tokio::spawn(async move {
            let post = {
                let (http, queue, worker) = (http.clone(), queue.clone(), worker.clone());
                move |op: &'static str, body: String| {
                    let url = format!("/v1/queues/{queue}/workers/{worker}/{op}");
                    let rb = http
                        .request(reqwest::Method::POST, &url)
                        .header("content-type", "application/json")
                        .body(body);
                    async move {
                        let r = rb.send().await.map_err(|e| format!("{op}: {e}"))?;
                        let r = r.error_for_status().map_err(|e| format!("{op}: {e}"))?;
                        let b = r.bytes().await.map_err(|e| format!("{op}: {e}"))?;
                        serde_json::from_slice::<Value>(&b).map_err(|e| format!("{op}: {e}"))
                    }
                }
            };
            let free = Arc::new(Semaphore::new(slots));
            // Finished handlers' leases, with when each was claimed.
            let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<(String, Instant)>();
            let one = |lease: &str| json!({"lease": lease, "outcome": "succeeded", "result": null});
            // The settling side: one request per lease, or everything finished so far in one.
            let settler = {
                let (post, free) = (post.clone(), free.clone());
                tokio::spawn(async move {
                    let mut lat = Vec::new();
                    let mut inflight = futures::stream::FuturesUnordered::new();
                    loop {
                        use futures::StreamExt;
                        tokio::select! {
                            got = done_rx.recv() => {
                                let Some(first) = got else { break };
                                if batch {
                                    let mut ready = vec![first];
                                    while let Ok(more) = done_rx.try_recv() {
                                        ready.push(more);
                                    }
                                    let body = json!({"settlements": ready.iter().map(|(l, _)| one(l)).collect::<Vec<_>>()});
                                    let v = post("settle", body.to_string()).await?;
                                    if let Some(bad) = v["settlements"]
                                        .as_array()
                                        .and_then(|a| a.iter().find(|i| i.get("error").is_some()))
                                    {
                                        return Err(format!("settle: {bad}"));
                                    }
                                    lat.extend(ready.iter().map(|(_, t)| t.elapsed()));
                                    free.add_permits(ready.len());
                                } else {
                                    let (lease, t) = first;
                                    let r = post("settle", one(&lease).to_string());
                                    inflight.push(async move { r.await.map(|_| t.elapsed()) });
                                }
                            }
                            Some(r) = inflight.next(), if !inflight.is_empty() => {
                                lat.push(r?);
                                free.add_permits(1);
                            }
                        }
                    }
                    while let Some(r) = futures::StreamExt::next(&mut inflight).await {
                        lat.push(r?);
                    }
                    Ok::<_, String>(lat)
                })
            };
            // The claiming side: up to the free slots, each claimed command "handled" at once.
            while claimed_total.load(Ordering::Relaxed) < count {
                let Ok(first) = free.clone().acquire_many_owned(1).await else { break };
                first.forget();
                let mut n = 1;
                while n < slots && free.try_acquire().map(|p| p.forget()).is_ok() {
                    n += 1;
                }
                let t = Instant::now();
                let claimed = post("claim", json!({"max": n, "wait": "1s"}).to_string()).await?;
                let leases: Vec<String> = claimed["leases"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|l| l["lease"].as_str().map(String::from)).collect())
                    .unwrap_or_default();
                free.add_permits(n - leases.len());
                claimed_total.fetch_add(leases.len() as u64, Ordering::Relaxed);
                for l in leases {
                    let _ = done_tx.send((l, t));
                }
            }
            drop(done_tx);
            settler.await.map_err(|e| format!("settler: {e}"))?
        }));
    }
    let done = until_succeeded(store, queue, before + count, &pb).await;
    let elapsed = start.elapsed();
    pb.finish_and_clear();
    let mut lat = Vec::with_capacity(count as usize);
    for t in tasks {
        lat.extend(t.await.map_err(|e| failed("worker", e))?.map_err(|e| failed("http worker", e))?);
    }
    done?;
    lat.sort();
    Ok(Row {
        name: format!("http, {side}"),
        concurrency: c,
        ops: count,
        elapsed,
        latencies: lat,
        latency_of: "claim → settled",
    })
}

async fn bench_workers(args: &BenchArgs, rc: &Option<RedisConfig>) -> Result<Vec<Row>, CliError> {
    if rc.is_none() {
        return Err(CliError::usage(
            "bench workers needs --redis, --redis-cluster or --redis-sentinel: the Redis that the --server `baton serve` uses",
        ));
    }
    let levels = args.concurrency.clone().unwrap_or_else(|| vec![64]);
    let count = args.count.unwrap_or(5_000);
    let store = command_store(rc).await?;
    let conn = super::args::Conn { server: args.server.clone(), token: args.token.clone(), json: false };
    let http = Arc::new(super::client::Client::new(&conn)?);
    let queue = args.queue.clone();
    // The server must serve the queue's worker routes.
    let probe = http
        .request(reqwest::Method::POST, &format!("/v1/queues/{queue}/workers/bench-probe/claim"))
        .header("content-type", "application/json")
        .body(json!({"max": 1}).to_string())
        .send()
        .await
        .map_err(|e| failed(&format!("reach {}", http.base()), e))?;
    if !probe.status().is_success() {
        let status = probe.status();
        let body = probe.text().await.unwrap_or_default();
        return Err(failed(
            "claim",
            format!(
                "{} answered {status} for queue {queue:?}: {body} (start it with `--no-workers` and `[queues.{queue}]` without handlers, on the same Redis)",
                http.base()
            ),
        ));
    }
    let id = run_id();
    let mut rows = Vec::new();
    for c in levels {
        for round in 1..=args.rounds {
            // A: in-process handlers, a fresh queue each round.
            let inq = format!("{id}-inproc-c{c}-r{round}");
            presubmit(&store, &inq, &inq, count).await?;
            let noop = builtin::from_config("echo", &Value::Null).map_err(|e| failed("handler", e))?;
            let pb = progress(args.quiet, count, format!("in-process c={c} r{round}"));
            let start = Instant::now();
            let service = CommandService::builder(store.clone(), inq.clone())
                .settings(QueueSettings { concurrency: c as usize, ..QueueSettings::default() })
                .handler_arc("noop", noop)
                .start()
                .await
                .map_err(|e| failed("start the command service", e))?;
            until_succeeded(&store, &inq, count, &pb).await?;
            let elapsed = start.elapsed();
            pb.finish_and_clear();
            service.drain(Duration::from_secs(5)).await;
            rows.push(Row {
                name: "in-process".into(),
                concurrency: c,
                ops: count,
                elapsed,
                latencies: Vec::new(),
                latency_of: "–",
            });

            // B and C: HTTP workers of the server, on its queue; settling each command in a
            // request of its own, then all of a claim's commands in one request.
            for batch in [false, true] {
                let run = format!("{id}-r{round}");
                rows.push(http_drain(args, &store, &http, &queue, &run, c, count, batch).await?);
            }
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&v, 0.5), Duration::from_millis(50));
        assert_eq!(percentile(&v, 0.99), Duration::from_millis(99));
        assert_eq!(percentile(&v[..1], 0.99), Duration::from_millis(1));
        assert_eq!(percentile(&[], 0.5), Duration::ZERO);
    }
}
