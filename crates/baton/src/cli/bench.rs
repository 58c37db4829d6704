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
//!   With `--open-loop` (BullMQ's benchmark shape): `--count` no-op commands are submitted in
//!   batches of `--batch` (`CommandStore::submit_many`, one call in flight, no service running;
//!   row `commands add`, latency per call), then a command service with `concurrency` handlers
//!   drains them (row `commands drain`: from the service's start until the queue counts exactly
//!   `--count` `SUCCEEDED`). On standalone Redis and Sentinel each `commands` row also counts the
//!   Redis calls per command (`INFO commandstats` deltas, all clients of that Redis).
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

use baton_commands::{
    builtin, Command, CommandHandler, CommandResult, CommandService, CommandStore, HandlerError, QueueSettings,
};
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
    /// `commands`: open loop instead of closed: at each concurrency, `--count` no-op commands are
    /// first submitted in batches of `--batch` (`CommandStore::submit_many`, one batch in flight,
    /// no command service running: they wait in the queue; row `commands add`, latency per
    /// call), then a command service with `concurrency` no-op handlers drains them (row `commands drain`:
    /// commands per second from the service's start until the queue counts exactly `--count`
    /// `SUCCEEDED`), as BullMQ's `addBulk` + `Worker` benchmark does (scripts/bench-bullmq.sh).
    #[arg(long)]
    pub open_loop: bool,
    /// `commands --open-loop`: commands per `submit_many` call.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub batch: u64,
    /// No progress bar (also when stderr is not a terminal).
    #[arg(long)]
    pub quiet: bool,
    /// Print the results as JSON: `{"workload", "backend", "results": [...]}`, one result per
    /// row: `name` (e.g. `commands`, `commands add`, `commands drain`), `concurrency`, `ops`,
    /// `seconds` (wall time of the row), `ops_per_sec` (`ops / seconds`), `latency` (what the
    /// percentiles time, `–` for none), `p50_ms`, `p99_ms`, `max_ms` (0 when none), and
    /// `redis_calls_per_op` (`commands` on standalone Redis or Sentinel: Redis calls per
    /// operation during the row by command name, from `INFO commandstats` of all clients of
    /// that Redis, `INFO` itself left out; else `null`).
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
    /// Redis calls per operation during the row, by command name (most first), when counted.
    redis_calls: Option<Vec<(String, f64)>>,
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
                    "redis_calls_per_op": r.redis_calls.as_ref().map(|calls| {
                        calls.iter().map(|(name, n)| (name.clone(), json!(n))).collect::<serde_json::Map<_, _>>()
                    }),
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
                fmt_latency(r, r.pct(0.50)),
                fmt_latency(r, r.pct(0.99)),
                fmt_latency(r, r.latencies.last().copied().unwrap_or_default()),
                r.latency_of.to_string(),
            ]);
        }
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        println!("backend: {backend}; {}", count(&cpus.to_string(), "CPU", "CPUs"));
        t.print();
        let counted: Vec<&Row> = rows.iter().filter(|r| r.redis_calls.is_some()).collect();
        if !counted.is_empty() {
            println!("Redis calls per operation (INFO commandstats, all clients of that Redis):");
            for r in counted {
                let calls = r.redis_calls.as_deref().unwrap_or_default();
                println!("  {} c={}: {}", r.name, r.concurrency, fmt_calls(calls));
            }
        }
    }
    Ok(exit::OK)
}

/// `name n.nn, …, total n.nn`, or `none` when nothing was called.
fn fmt_calls(calls: &[(String, f64)]) -> String {
    if calls.is_empty() {
        return "none".into();
    }
    let total: f64 = calls.iter().map(|(_, n)| n).sum();
    let each: Vec<String> = calls.iter().map(|(name, n)| format!("{name} {n:.2}")).collect();
    format!("{}; total {total:.2}", each.join(", "))
}

fn fmt_ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

/// `d` in ms, or `–` for a row that times no operation.
fn fmt_latency(r: &Row, d: Duration) -> String {
    if r.latencies.is_empty() {
        "–".into()
    } else {
        fmt_ms(d)
    }
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
            redis_calls: None,
        });
    }
    Ok(rows)
}

async fn bench_commands(args: &BenchArgs, rc: &Option<RedisConfig>) -> Result<Vec<Row>, CliError> {
    let levels = args.concurrency.clone().unwrap_or_else(|| vec![64, 256]);
    let count = args.count.unwrap_or(5_000);
    let store = command_store(rc).await?;
    let calls = CallCounter::new(rc).await?;
    if args.open_loop {
        return bench_commands_open(args, &store, calls.as_ref(), &levels, count).await;
    }
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
        let calls0 = snapshot(calls.as_ref()).await?;
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
        let redis_calls = calls_since(calls.as_ref(), calls0, count).await?;
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
            redis_calls,
        });
    }
    Ok(rows)
}

/// A no-op handler that counts the commands it ran and wakes the bench at the last one.
struct CountingNoop {
    ran: Arc<AtomicU64>,
    target: u64,
    all_ran: Arc<tokio::sync::Notify>,
    pb: ProgressBar,
}

#[async_trait::async_trait]
impl CommandHandler for CountingNoop {
    async fn execute(&self, _command: Command) -> Result<CommandResult, HandlerError> {
        if self.ran.fetch_add(1, Ordering::Relaxed) + 1 == self.target {
            self.all_ran.notify_one();
        }
        self.pb.inc(1);
        Ok(CommandResult::succeeded(Value::Null))
    }
}

/// `commands --open-loop`: at each concurrency, `count` no-op commands submitted in batches of
/// `--batch` with no service running (row `commands add`), then drained by a command service
/// with `c` handlers (row `commands drain`, from its start until exactly `count` `SUCCEEDED`).
async fn bench_commands_open(
    args: &BenchArgs,
    store: &CommandStore,
    calls: Option<&CallCounter>,
    levels: &[u64],
    count: u64,
) -> Result<Vec<Row>, CliError> {
    let id = run_id();
    let mut rows = Vec::new();
    for &c in levels {
        let queue = format!("{id}-open-c{c}");
        // Add: one `submit_many` call in flight, `--batch` commands each.
        let pb = progress(args.quiet, count, format!("add c={c} batch={}", args.batch));
        let mut lat = Vec::with_capacity(count.div_ceil(args.batch) as usize);
        let calls0 = snapshot(calls).await?;
        let start = Instant::now();
        let mut n = 0;
        while n < count {
            let batch: Vec<Command> = (n..count.min(n + args.batch))
                .map(|i| Command::with_id(format!("{queue}-{i}"), "noop", Value::Null))
                .collect();
            let len = batch.len() as u64;
            let t = Instant::now();
            for (i, outcome) in store.submit_many(&queue, batch).await.into_iter().enumerate() {
                match outcome {
                    Ok((_, true)) => {}
                    Ok((state, false)) => {
                        return Err(failed("submit_many", format!("command {} was already stored", state.id)))
                    }
                    Err(e) => return Err(failed("submit_many", format!("command {queue}-{}: {e}", n + i as u64))),
                }
            }
            lat.push(t.elapsed());
            pb.inc(len);
            n += len;
        }
        let elapsed = start.elapsed();
        let redis_calls = calls_since(calls, calls0, count).await?;
        pb.finish_and_clear();
        lat.sort();
        rows.push(Row {
            name: "commands add".into(),
            concurrency: c,
            ops: count,
            elapsed,
            latencies: lat,
            latency_of: "submit_many call",
            redis_calls,
        });

        // Drain: a service with `c` no-op handlers, timed from its start until the queue counts
        // every command SUCCEEDED (the handlers' count first, so the polling stays short).
        let pb = progress(args.quiet, count, format!("drain c={c}"));
        let ran = Arc::new(AtomicU64::new(0));
        let all_ran = Arc::new(tokio::sync::Notify::new());
        let noop = CountingNoop { ran: ran.clone(), target: count, all_ran: all_ran.clone(), pb: pb.clone() };
        let calls0 = snapshot(calls).await?;
        let start = Instant::now();
        let service = CommandService::builder(store.clone(), queue.clone())
            .settings(QueueSettings { concurrency: c as usize, ..QueueSettings::default() })
            .handler("noop", noop)
            .start()
            .await
            .map_err(|e| failed("start the command service", e))?;
        let mut last = (0, Instant::now());
        while ran.load(Ordering::Relaxed) < count {
            let _ = tokio::time::timeout(Duration::from_millis(100), all_ran.notified()).await;
            let now = ran.load(Ordering::Relaxed);
            if now != last.0 {
                last = (now, Instant::now());
            } else if last.1.elapsed() > Duration::from_secs(30) {
                return Err(failed("drain", format!("{queue}: {now} of {count} handled and no progress for 30 s")));
            }
        }
        until_succeeded(store, &queue, count, &pb).await?;
        let elapsed = start.elapsed();
        let redis_calls = calls_since(calls, calls0, count).await?;
        pb.finish_and_clear();
        service.drain(Duration::from_secs(5)).await;
        let counts = store.counts(&queue).await.map_err(|e| failed("counts", e))?;
        if counts.succeeded != count || counts.submitted + counts.running + counts.failed + counts.cancelled != 0 {
            return Err(failed(
                "drain",
                format!("{queue}: expected exactly {count} SUCCEEDED and nothing else, counted {counts:?}"),
            ));
        }
        rows.push(Row {
            name: "commands drain".into(),
            concurrency: c,
            ops: count,
            elapsed,
            latencies: Vec::new(),
            latency_of: "–",
            redis_calls,
        });
    }
    Ok(rows)
}

/// Counts Redis calls by command name with `INFO commandstats`, on standalone Redis or a
/// Sentinel deployment's master. Not in memory, nor on a Cluster (each node counts its own).
struct CallCounter {
    conn: baton_redis::RedisConn,
}

impl CallCounter {
    /// `None` in memory, on a Cluster, or when Redis refuses `INFO` (said on stderr).
    async fn new(rc: &Option<RedisConfig>) -> Result<Option<Self>, CliError> {
        let Some(c) = rc else { return Ok(None) };
        let client = baton_redis::RedisClient::new(c.clone()).map_err(|e| failed("connect", e))?;
        if client.is_cluster() {
            return Ok(None);
        }
        let counter = CallCounter { conn: client.shared().await.map_err(|e| failed("connect", e))? };
        match counter.snapshot().await {
            Ok(_) => Ok(Some(counter)),
            Err(e) => {
                eprintln!("baton bench: Redis calls are not counted ({})", e.message);
                Ok(None)
            }
        }
    }

    /// Calls so far by command name.
    async fn snapshot(&self) -> Result<Vec<(String, u64)>, CliError> {
        let info: String = baton_redis::redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| failed("INFO commandstats", e))?;
        Ok(parse_commandstats(&info))
    }
}

async fn snapshot(calls: Option<&CallCounter>) -> Result<Vec<(String, u64)>, CliError> {
    match calls {
        Some(c) => c.snapshot().await,
        None => Ok(Vec::new()),
    }
}

/// Calls per operation since `before` (`ops` operations), or `None` when not counted.
async fn calls_since(
    calls: Option<&CallCounter>,
    before: Vec<(String, u64)>,
    ops: u64,
) -> Result<Option<Vec<(String, f64)>>, CliError> {
    match calls {
        Some(c) => Ok(Some(calls_per_op(&before, &c.snapshot().await?, ops))),
        None => Ok(None),
    }
}

/// `(command, calls)` of the `cmdstat_<command>:calls=<n>,…` lines of `INFO commandstats`.
fn parse_commandstats(info: &str) -> Vec<(String, u64)> {
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?.parse().ok()?;
            Some((name.to_string(), calls))
        })
        .collect()
}

/// Calls per operation from `before` to `after` by command, most first (ties by name), leaving
/// out `info` (the counting itself) and commands under 0.005 calls per operation.
fn calls_per_op(before: &[(String, u64)], after: &[(String, u64)], ops: u64) -> Vec<(String, f64)> {
    let mut per: Vec<(String, f64)> = after
        .iter()
        .filter(|(name, _)| name != "info")
        .filter_map(|(name, n)| {
            let n0 = before.iter().find(|(b, _)| b == name).map_or(0, |(_, n0)| *n0);
            let d = n.saturating_sub(n0) as f64 / ops.max(1) as f64;
            (d >= 0.005).then(|| (name.clone(), d))
        })
        .collect();
    per.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    per
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
            redis_calls: None,
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
        redis_calls: None,
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
        redis_calls: None,
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
                redis_calls: None,
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
    fn commandstats_lines_parse_to_calls() {
        let info = "# Commandstats\r\ncmdstat_evalsha:calls=2000,usec=5000,usec_per_call=2.50,rejected_calls=0,failed_calls=0\r\n\
                    cmdstat_client|setinfo:calls=2,usec=1,usec_per_call=0.50,rejected_calls=0,failed_calls=0\r\n\
                    cmdstat_info:calls=7,usec=70,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n";
        assert_eq!(
            parse_commandstats(info),
            vec![("evalsha".to_string(), 2000), ("client|setinfo".to_string(), 2), ("info".to_string(), 7)]
        );
        assert_eq!(parse_commandstats("# Commandstats\r\n"), Vec::<(String, u64)>::new());
    }

    #[test]
    fn calls_per_op_are_deltas_over_ops_most_first() {
        let before = vec![("evalsha".to_string(), 100), ("info".to_string(), 5), ("xadd".to_string(), 10)];
        let after = vec![
            ("evalsha".to_string(), 2100),
            ("info".to_string(), 9),
            ("xadd".to_string(), 1010),
            ("publish".to_string(), 1000),
            ("ping".to_string(), 4),
        ];
        // 1000 ops: evalsha 2.0, then xadd and publish 1.0 (by name), ping 0.004 left out.
        assert_eq!(
            calls_per_op(&before, &after, 1000),
            vec![("evalsha".to_string(), 2.0), ("publish".to_string(), 1.0), ("xadd".to_string(), 1.0)]
        );
        assert_eq!(
            fmt_calls(&calls_per_op(&before, &after, 1000)),
            "evalsha 2.00, publish 1.00, xadd 1.00; total 4.00"
        );
        assert_eq!(fmt_calls(&[]), "none");
    }

    #[test]
    fn percentiles_nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&v, 0.5), Duration::from_millis(50));
        assert_eq!(percentile(&v, 0.99), Duration::from_millis(99));
        assert_eq!(percentile(&v[..1], 0.99), Duration::from_millis(1));
        assert_eq!(percentile(&[], 0.5), Duration::ZERO);
    }
}
