//! Benchmark: submit → no-op `execute` → SUCCEEDED, end to end (the client submits, then waits
//! for the terminal state). Throughput and p50/p99 latency at concurrency 64 and 256 (commands in
//! flight = handler concurrency), on memory and on a redis-server started for the run.
//!
//! `cargo bench -p baton-commands` (add `-- --quick` for a short run).
//!
//! Each client task calls `CommandStore::submit_and_wait`; with `BATON_BENCH_SPLIT=1` it calls
//! `submit` then `wait` instead (one Redis read more per command).
//!
//! Environment: `BATON_BENCH_ONLY=memory|redis` runs one backend; `BATON_BENCH_C=64,256` sets the
//! concurrencies; `BATON_BENCH_FEED=off` turns the queues' event feed off (default on: every
//! command appends `submitted` and `succeeded`). For Redis runs it also prints, per command, the Redis calls by command name
//! (`INFO commandstats` deltas) and the CPU time Redis and this process used (`INFO cpu`,
//! `getrusage`), to show where the time goes.
//!
//! Open loop (BullMQ's benchmark shape; Redis only, c=64): 20,000 commands (`--quick`: 5,000)
//! are submitted with `CommandStore::submit_many` in batches of 100, one call in flight and no
//! service running, then a command service with 64 no-op handlers drains them. It prints the add
//! rate (commands/s over the submits), the processing rate (commands/s from the service's start
//! until the queue counts exactly that many `SUCCEEDED`) and the Redis calls per command of each
//! phase. `BATON_BENCH_OPEN=off` leaves it out, `BATON_BENCH_OPEN=only` runs nothing else.

/// mimalloc, for applications that embed the library with it: glibc malloc was about 30% of
/// this bench's CPU (memory backend: 89-100k commands/s with glibc, 120-158k with mimalloc). The
/// `baton` binary uses jemalloc instead: mimalloc's tails hurt stream fan-out (1,000 readers:
/// p99 4-55 ms against 2-5 ms), jemalloc's do not (docs/benchmarks.md, issue 19).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use baton_commands::{
    Command, CommandHandler, CommandResult, CommandService, CommandStore, CommandStoreSettings, FeedSettings,
    HandlerError, QueueSettings, RedisCommandStoreOptions,
};
use baton_redis::RedisClient;
use baton_testkit::RedisServer;

struct Noop;

#[async_trait]
impl CommandHandler for Noop {
    async fn execute(&self, _c: Command) -> Result<CommandResult, HandlerError> {
        Ok(CommandResult::succeeded(serde_json::Value::Null))
    }
}

struct Row {
    backend: &'static str,
    concurrency: usize,
    commands: usize,
    per_sec: f64,
    p50: Duration,
    p99: Duration,
}

async fn run(store: CommandStore, backend: &'static str, concurrency: usize, total: usize) -> Row {
    let queue = format!("bench-{}", uuid::Uuid::now_v7());
    let settings = QueueSettings { concurrency, ..QueueSettings::default() };
    let svc =
        CommandService::builder(store.clone(), &queue).settings(settings).handler("noop", Noop).start().await.unwrap();
    let split = std::env::var("BATON_BENCH_SPLIT").is_ok_and(|v| v == "1");
    let run_phase = |n: usize| {
        let store = store.clone();
        let queue = queue.clone();
        async move {
            let next = Arc::new(AtomicUsize::new(0));
            let mut tasks = Vec::new();
            let started = Instant::now();
            for _ in 0..concurrency {
                let (store, queue, next) = (store.clone(), queue.clone(), next.clone());
                tasks.push(tokio::spawn(async move {
                    let mut lat = Vec::new();
                    while next.fetch_add(1, Ordering::Relaxed) < n {
                        let t0 = Instant::now();
                        let cmd = Command::new("noop", serde_json::Value::Null);
                        let done = if split {
                            let st = store.submit(&queue, cmd).await.unwrap();
                            store.wait(&st.id, Duration::from_secs(60)).await.unwrap()
                        } else {
                            store.submit_and_wait(&queue, cmd, Duration::from_secs(60)).await.unwrap()
                        };
                        assert!(done.status.is_terminal(), "not done: {done:?}");
                        lat.push(t0.elapsed());
                    }
                    lat
                }));
            }
            let mut all = Vec::with_capacity(n);
            for t in tasks {
                all.extend(t.await.unwrap());
            }
            (started.elapsed(), all)
        }
    };
    run_phase(total / 10).await; // warm-up
    let (elapsed, mut lat) = run_phase(total).await;
    svc.close().await;
    lat.sort();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    Row {
        backend,
        concurrency,
        commands: total,
        per_sec: total as f64 / elapsed.as_secs_f64(),
        p50: pct(0.50),
        p99: pct(0.99),
    }
}

/// A no-op handler that counts the commands it ran and wakes the bench at the last one.
struct CountingNoop {
    ran: Arc<AtomicUsize>,
    target: usize,
    all_ran: Arc<tokio::sync::Notify>,
}

#[async_trait]
impl CommandHandler for CountingNoop {
    async fn execute(&self, _c: Command) -> Result<CommandResult, HandlerError> {
        if self.ran.fetch_add(1, Ordering::Relaxed) + 1 == self.target {
            self.all_ran.notify_one();
        }
        Ok(CommandResult::succeeded(serde_json::Value::Null))
    }
}

/// One open-loop run: rates of the add and drain phases and Redis calls per command of each.
struct OpenRow {
    concurrency: usize,
    commands: usize,
    batch: usize,
    add_per_sec: f64,
    drain_per_sec: f64,
    add_calls: String,
    drain_calls: String,
}

/// Open loop on `server`: `total` commands submitted in batches of `batch` (one `submit_many`
/// call in flight, no service running), then drained by a service with `concurrency` no-op
/// handlers, timed from its start until the queue counts exactly `total` `SUCCEEDED`.
async fn open_loop(
    store: CommandStore,
    server: &RedisServer,
    concurrency: usize,
    total: usize,
    batch: usize,
) -> OpenRow {
    let queue = format!("bench-open-{}", uuid::Uuid::now_v7());
    let (_, calls0) = redis_snapshot(server);
    let started = Instant::now();
    let mut n = 0;
    while n < total {
        let cmds: Vec<Command> =
            (n..total.min(n + batch)).map(|_| Command::new("noop", serde_json::Value::Null)).collect();
        let len = cmds.len();
        for outcome in store.submit_many(&queue, cmds).await {
            let (state, created) = outcome.unwrap();
            assert!(created, "{} was already stored", state.id);
        }
        n += len;
    }
    let add = started.elapsed();
    let (_, calls1) = redis_snapshot(server);

    let ran = Arc::new(AtomicUsize::new(0));
    let all_ran = Arc::new(tokio::sync::Notify::new());
    let noop = CountingNoop { ran: ran.clone(), target: total, all_ran: all_ran.clone() };
    let settings = QueueSettings { concurrency, ..QueueSettings::default() };
    let started = Instant::now();
    let svc =
        CommandService::builder(store.clone(), &queue).settings(settings).handler("noop", noop).start().await.unwrap();
    // The handlers' count first, then the store's (the last results may still be committing).
    while ran.load(Ordering::Relaxed) < total {
        let _ = tokio::time::timeout(Duration::from_millis(100), all_ran.notified()).await;
        assert!(started.elapsed() < Duration::from_secs(300), "drain stuck at {}", ran.load(Ordering::Relaxed));
    }
    loop {
        let c = store.counts(&queue).await.unwrap();
        assert_eq!(c.failed + c.cancelled, 0, "{c:?}");
        if c.succeeded as usize >= total {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let drain = started.elapsed();
    let (_, calls2) = redis_snapshot(server);
    svc.close().await;
    let c = store.counts(&queue).await.unwrap();
    assert_eq!((c.succeeded as usize, c.submitted + c.running + c.failed + c.cancelled), (total, 0), "{c:?}");
    OpenRow {
        concurrency,
        commands: total,
        batch,
        add_per_sec: total as f64 / add.as_secs_f64(),
        drain_per_sec: total as f64 / drain.as_secs_f64(),
        add_calls: calls_per_command(&calls0, &calls1, total as f64),
        drain_calls: calls_per_command(&calls1, &calls2, total as f64),
    }
}

/// `name calls (µs in Redis)` per command from `before` to `after` (`info` and under 0.01 left out).
fn calls_per_command(before: &CommandStats, after: &CommandStats, n: f64) -> String {
    let mut per: Vec<(&str, f64, f64)> = after
        .iter()
        .filter(|(name, _)| name != "info")
        .map(|(name, c1)| {
            let (c0, u0) = before.iter().find(|(n0, _)| n0 == name).map(|(_, c)| *c).unwrap_or((0, 0));
            (name.as_str(), c1.0.saturating_sub(c0) as f64 / n, c1.1.saturating_sub(u0) as f64 / n)
        })
        .collect();
    let total: f64 = per.iter().map(|(_, d, _)| d).sum();
    per.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(b.0)));
    let shown: Vec<String> =
        per.iter().filter(|(_, d, _)| *d >= 0.01).map(|(name, d, us)| format!("{name} {d:.2} ({us:.1} µs)")).collect();
    format!("{}; total {total:.2}", shown.join(", "))
}

/// `INFO commandstats`: (calls, µs) per command name.
type CommandStats = Vec<(String, (u64, u64))>;

/// Redis `INFO cpu` (user, sys) seconds, and `INFO commandstats` (calls, µs) per command name.
fn redis_snapshot(server: &RedisServer) -> ((f64, f64), CommandStats) {
    let cpu = server.cli(&["INFO", "cpu"]);
    let field = |name: &str| cpu.lines().find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok()).unwrap_or(0.0);
    let secs = (field("used_cpu_user:"), field("used_cpu_sys:"));
    let stats = server.cli(&["INFO", "commandstats"]);
    let calls = stats
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let field = |f: &str| rest.split(',').find_map(|kv| kv.strip_prefix(f))?.parse::<u64>().ok();
            Some((name.to_string(), (field("calls=")?, field("usec=")?)))
        })
        .collect();
    (secs, calls)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let only = std::env::var("BATON_BENCH_ONLY").unwrap_or_default();
    let levels: Vec<usize> = std::env::var("BATON_BENCH_C")
        .ok()
        .map(|s| s.split(',').filter_map(|c| c.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![64, 256]);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (mem_n, redis_n) = if quick { (20_000, 5_000) } else { (200_000, 60_000) };
    let feed = match std::env::var("BATON_BENCH_FEED").as_deref() {
        Ok("off") => FeedSettings::OFF,
        _ => FeedSettings::default(),
    };
    let settings = CommandStoreSettings { feed, ..CommandStoreSettings::default() };
    let open = std::env::var("BATON_BENCH_OPEN").unwrap_or_default();
    let closed = open != "only";
    let open_n = if quick { 5_000 } else { 20_000 };
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    let mut open_rows = Vec::new();
    rt.block_on(async {
        if closed && (only.is_empty() || only == "memory") {
            for &c in &levels {
                rows.push(run(CommandStore::memory_with(settings.clone()).unwrap(), "memory", c, mem_n).await);
            }
        }
        if only.is_empty() || only == "redis" {
            let server = RedisServer::start();
            for &c in levels.iter().filter(|_| closed) {
                let client = RedisClient::new(server.config()).unwrap();
                let options = RedisCommandStoreOptions { settings: settings.clone(), ..Default::default() };
                let store = CommandStore::redis(client, options).await.unwrap();
                let (cpu0, calls0) = redis_snapshot(&server);
                let own0 = baton_testkit::process_cpu_seconds();
                let t0 = Instant::now();
                let row = run(store, "redis", c, redis_n).await;
                let wall = t0.elapsed().as_secs_f64();
                let (cpu1, calls1) = redis_snapshot(&server);
                let own = baton_testkit::process_cpu_seconds() - own0;
                // Warm-up phase included: 1.1 × commands.
                let n = redis_n as f64 * 1.1;
                notes.push(format!(
                    "redis c={c}: Redis CPU {:.0}% of one core ({:.0}% user, {:.0}% system), client CPU {:.0}%; Redis calls (µs in Redis) per command: {}",
                    (cpu1.0 + cpu1.1 - cpu0.0 - cpu0.1) / wall * 100.0,
                    (cpu1.0 - cpu0.0) / wall * 100.0,
                    (cpu1.1 - cpu0.1) / wall * 100.0,
                    own / wall * 100.0,
                    calls_per_command(&calls0, &calls1, n)
                ));
                rows.push(row);
            }
            if open != "off" {
                let client = RedisClient::new(server.config()).unwrap();
                let options = RedisCommandStoreOptions { settings: settings.clone(), ..Default::default() };
                let store = CommandStore::redis(client, options).await.unwrap();
                open_rows.push(open_loop(store, &server, 64, open_n, 100).await);
            }
            drop(server);
        }
    });
    if !rows.is_empty() {
        println!();
        println!(
            "submit → no-op execute → SUCCEEDED (client waits for the terminal state); event feed {}",
            if feed.enabled { "on" } else { "off" }
        );
        println!("| backend | concurrency | commands | commands/s | p50 | p99 |");
        println!("|---------|-------------|----------|------------|-----|-----|");
    }
    for r in rows {
        println!(
            "| {} | {} | {} | {:.0} | {:.2} ms | {:.2} ms |",
            r.backend,
            r.concurrency,
            r.commands,
            r.per_sec,
            r.p50.as_secs_f64() * 1000.0,
            r.p99.as_secs_f64() * 1000.0
        );
    }
    for n in notes {
        println!("{n}");
    }
    if !open_rows.is_empty() {
        println!();
        println!(
            "open loop (redis): submit_many in batches, no service running, then a service drains them; event feed {}",
            if feed.enabled { "on" } else { "off" }
        );
        println!("| concurrency | commands | batch | add commands/s | processing commands/s |");
        println!("|-------------|----------|-------|----------------|-----------------------|");
        for r in &open_rows {
            println!(
                "| {} | {} | {} | {:.0} | {:.0} |",
                r.concurrency, r.commands, r.batch, r.add_per_sec, r.drain_per_sec
            );
        }
        for r in &open_rows {
            println!("open loop c={}: Redis calls (µs in Redis) per command: add: {}", r.concurrency, r.add_calls);
            println!("open loop c={}: Redis calls (µs in Redis) per command: drain: {}", r.concurrency, r.drain_calls);
        }
    }
}
