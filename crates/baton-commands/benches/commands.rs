//! Benchmark: submit → no-op `execute` → SUCCEEDED, end to end (the client submits, then waits
//! for the terminal state). Throughput and p50/p99 latency at concurrency 64 and 256 (commands in
//! flight = handler concurrency), on memory and on a redis-server started for the run.
//!
//! `cargo bench -p baton-commands` (add `-- --quick` for a short run).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use baton_commands::{
    Command, CommandHandler, CommandResult, CommandService, CommandStore, HandlerError, QueueSettings,
    RedisStoreOptions,
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
    let mut settings = QueueSettings::default();
    settings.concurrency = concurrency;
    let svc = CommandService::builder(store.clone(), &queue).settings(settings).handler("noop", Noop).start().await.unwrap();
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
                        let st = store.submit(&queue, Command::new("noop", serde_json::Value::Null)).await.unwrap();
                        let done = store.wait(&st.id, Duration::from_secs(60)).await.unwrap();
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

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (mem_n, redis_n) = if quick { (20_000, 5_000) } else { (200_000, 60_000) };
    let mut rows = Vec::new();
    rt.block_on(async {
        for c in [64, 256] {
            rows.push(run(CommandStore::memory(), "memory", c, mem_n).await);
        }
        let server = RedisServer::start();
        for c in [64, 256] {
            let client = RedisClient::new(server.config()).unwrap();
            let store = CommandStore::redis(client, RedisStoreOptions::default()).await.unwrap();
            rows.push(run(store, "redis", c, redis_n).await);
        }
        drop(server);
    });
    println!();
    println!("submit → no-op execute → SUCCEEDED (client waits for the terminal state)");
    println!("| backend | concurrency | commands | commands/s | p50 | p99 |");
    println!("|---------|-------------|----------|------------|-----|-----|");
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
}
