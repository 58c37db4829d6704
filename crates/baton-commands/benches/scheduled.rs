//! Benchmark: scheduled commands due at one moment. 100,000 commands are submitted with the
//! same `run_at` (far enough ahead for the submits to finish first) while a service of their
//! queue runs; from the due time, the rate at which they are promoted out of the delayed set
//! and started (their no-op handler called) is measured, until the last one started. The
//! reference, in the same run on the same server: the same number of commands submitted to run
//! at once while no service runs (a backlog in the stream), then a service started, and the
//! rate at which they start. The ratio scheduled / backlog says what the promotion costs.
//!
//! `cargo bench -p baton-commands --bench scheduled`, each phase on a redis-server started for
//! it. Environment: `BATON_BENCH_ORDER` (`backlog,scheduled` by default; e.g.
//! `scheduled,backlog,scheduled`), `BATON_BENCH_N` (default 100000), `BATON_BENCH_LEAD` (seconds from the start
//! of the submits to the due time, default 30), `BATON_BENCH_C` (handler concurrency, default
//! 256).

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use baton_commands::{
    Command, CommandHandler, CommandResult, CommandService, CommandStore, HandlerError, QueueSettings,
    RedisCommandStoreOptions,
};
use baton_redis::RedisClient;
use baton_testkit::RedisServer;

/// Counts starts; notes when the last expected one started.
struct Counter {
    started: AtomicUsize,
    want: usize,
    first: Mutex<Option<SystemTime>>,
    last: Mutex<Option<SystemTime>>,
}

struct Noop(Arc<Counter>);

#[async_trait]
impl CommandHandler for Noop {
    async fn execute(&self, _c: Command) -> Result<CommandResult, HandlerError> {
        let now = SystemTime::now();
        let n = self.0.started.fetch_add(1, Ordering::Relaxed) + 1;
        if n == 1 {
            *self.0.first.lock().unwrap() = Some(now);
        }
        if n == self.0.want {
            *self.0.last.lock().unwrap() = Some(now);
        }
        Ok(CommandResult::succeeded(serde_json::Value::Null))
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

async fn submit_all(store: &CommandStore, queue: &str, n: usize, run_at: Option<SystemTime>) -> Duration {
    let t = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..256 {
        let (store, queue, next) = (store.clone(), queue.to_string(), next.clone());
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < n {
                let c = Command::new("noop", serde_json::Value::Null);
                let c = match run_at {
                    Some(at) => c.with_run_at(at),
                    None => c,
                };
                store.submit(&queue, c).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    t.elapsed()
}

async fn start(store: &CommandStore, queue: &str, counter: &Arc<Counter>, concurrency: usize) -> CommandService {
    let settings = QueueSettings { concurrency, ..QueueSettings::default() };
    CommandService::builder(store.clone(), queue)
        .settings(settings)
        .handler("noop", Noop(counter.clone()))
        .start()
        .await
        .unwrap()
}

async fn wait_all(counter: &Counter, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while counter.started.load(Ordering::Relaxed) < counter.want {
        assert!(
            Instant::now() < deadline,
            "only {} of {} started",
            counter.started.load(Ordering::Relaxed),
            counter.want
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn counter(want: usize) -> Arc<Counter> {
    Arc::new(Counter { started: AtomicUsize::new(0), want, first: Mutex::new(None), last: Mutex::new(None) })
}

fn main() {
    let n = env("BATON_BENCH_N", 100_000) as usize;
    let lead = Duration::from_secs(env("BATON_BENCH_LEAD", 30));
    let concurrency = env("BATON_BENCH_C", 256) as usize;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // Each phase on a redis-server of its own (a server already holding the other phase's
    // 100,000 states is slower), in the order given by BATON_BENCH_ORDER (default: backlog
    // first).
    let order = std::env::var("BATON_BENCH_ORDER").unwrap_or_else(|_| "backlog,scheduled".into());
    let mut backlog_rate = None;
    for phase in order.split(',') {
        let server = RedisServer::start();
        rt.block_on(async {
            let store =
                CommandStore::redis(RedisClient::new(server.config()).unwrap(), RedisCommandStoreOptions::default())
                    .await
                    .unwrap();
            match phase {
                "backlog" => backlog_rate = Some(backlog(&store, n, concurrency).await),
                _ => scheduled(&store, n, concurrency, lead, backlog_rate).await,
            }
        });
    }
}

/// The reference: a backlog of commands to run at once, then a service; returns the start rate.
async fn backlog(store: &CommandStore, n: usize, concurrency: usize) -> f64 {
    let queue = format!("backlog-{}", uuid::Uuid::now_v7());
    store.declare_queue(&queue).unwrap();
    let took = submit_all(store, &queue, n, None).await;
    println!("backlog: {n} submits in {took:.2?} ({:.0}/s)", n as f64 / took.as_secs_f64());
    let c = counter(n);
    let t = Instant::now();
    let svc = start(store, &queue, &c, concurrency).await;
    wait_all(&c, Duration::from_secs(600)).await;
    let rate = n as f64 / t.elapsed().as_secs_f64();
    println!("backlog: {n} started in {:.2?}: {rate:.0}/s", t.elapsed());
    svc.close().await;
    rate
}

/// Scheduled: all due at one moment, a service running meanwhile.
async fn scheduled(store: &CommandStore, n: usize, concurrency: usize, lead: Duration, backlog_rate: Option<f64>) {
    {
        let store = store.clone();
        let queue = format!("scheduled-{}", uuid::Uuid::now_v7());
        let c = counter(n);
        let svc = start(&store, &queue, &c, concurrency).await;
        let due = SystemTime::now() + lead;
        let took = submit_all(&store, &queue, n, Some(due)).await;
        println!("scheduled: {n} submits in {took:.2?} ({:.0}/s)", n as f64 / took.as_secs_f64());
        assert!(SystemTime::now() < due, "the submits outlasted BATON_BENCH_LEAD; raise it");
        assert_eq!(c.started.load(Ordering::Relaxed), 0, "started before due");
        let sc = store.scheduled(&queue).await.unwrap();
        assert_eq!(sc.scheduled, n as u64);
        // Promotion alone: until the delayed set is empty (sampled every 5 ms).
        let promoted_after = loop {
            let now = SystemTime::now();
            if now >= due && store.scheduled(&queue).await.unwrap().scheduled == 0 {
                break now.duration_since(due).unwrap_or_default();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        println!(
            "scheduled: all {n} promoted {promoted_after:.2?} after due: {:.0}/s",
            n as f64 / promoted_after.as_secs_f64()
        );
        wait_all(&c, lead + Duration::from_secs(600)).await;
        let first = c.first.lock().unwrap().unwrap();
        let last = c.last.lock().unwrap().unwrap();
        let spread = last.duration_since(due).unwrap_or_default();
        let rate = n as f64 / spread.as_secs_f64();
        let ratio = backlog_rate.map(|b| format!(" ({:.2} of the backlog's rate)", rate / b)).unwrap_or_default();
        println!(
            "scheduled: first started {:?} after due, all {n} {spread:.2?} after due: {rate:.0}/s{ratio}",
            first.duration_since(due).unwrap_or_default(),
        );
        svc.close().await;
    }
}
