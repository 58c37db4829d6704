//! Work-queue benchmark (`cargo bench -p baton-queue --bench queue`).
//!
//! Starts its own redis-server (via baton-testkit) and prints a Markdown table of:
//! * `redis-benchmark` unpipelined XADD on the same server (the reference),
//! * offer → no-op handler → ack throughput at concurrency 1, 64 and 512, on memory and Redis,
//! * the cost of one lease-renewal tick for 10,000 leased in-flight messages (round trips, ms).
//!
//! Environment: `BATON_BENCH_N` scales the message counts (default 1.0); `BATON_BENCH_ONLY=memory` stops
//! after the memory runs.

/// mimalloc, as in the command bench (see there for why the `baton` binary uses jemalloc).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_queue::{keys, ConsumerOptions, Decision, Delivery, MessageStream, RedisQueueOptions};
use baton_redis::{redis, LuaScript, RedisClient};
use baton_testkit::RedisServer;
use bytes::Bytes;

static HEARTBEAT: LuaScript = LuaScript::new("heartbeat", include_str!("../scripts/heartbeat.lua"));

fn scale(n: u64) -> u64 {
    let f: f64 = std::env::var("BATON_BENCH_N").ok().and_then(|s| s.parse().ok()).unwrap_or(1.0);
    ((n as f64) * f).max(100.0) as u64
}

fn redis_benchmark_xadd(port: u16) -> f64 {
    let out = Command::new("redis-benchmark")
        .args([
            "-p",
            &port.to_string(),
            "-c",
            "50",
            "-n",
            "200000",
            "--csv",
            "XADD",
            "bench:xadd",
            "*",
            "p",
            "0123456789",
        ])
        .output()
        .expect("redis-benchmark (Debian package redis-tools)");
    let text = String::from_utf8_lossy(&out.stdout);
    // CSV: "test","rps",... ; the data line starts with "XADD
    for line in text.lines() {
        if line.starts_with("\"XADD") {
            let rps = line.split(',').nth(1).unwrap().trim_matches('"');
            return rps.parse().unwrap();
        }
    }
    panic!("unexpected redis-benchmark output: {text}");
}

async fn end_to_end(s: &MessageStream, queue: &str, concurrency: usize, n: u64) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let notify = Arc::new(tokio::sync::Notify::new());
    let (d2, n2) = (done.clone(), notify.clone());
    let c = s
        .consume(
            queue,
            move |_d: Delivery| {
                let (done, notify) = (d2.clone(), n2.clone());
                async move {
                    if done.fetch_add(1, Ordering::Relaxed) + 1 == n {
                        notify.notify_one();
                    }
                    Decision::Ack
                }
            },
            ConsumerOptions::new().with_concurrency(concurrency).with_reap_idle_consumers_after(None),
        )
        .await
        .unwrap();
    let payload = Bytes::from_static(b"0123456789");
    let start = Instant::now();
    // The producer offers in batches of 100 while the consumer runs.
    let producer = {
        let s = s.clone();
        let q = queue.to_string();
        tokio::spawn(async move {
            let mut left = n;
            while left > 0 {
                let k = left.min(100);
                s.offer_batch(&q, vec![payload.clone(); k as usize]).await.unwrap();
                left -= k;
            }
        })
    };
    notify.notified().await;
    let secs = start.elapsed().as_secs_f64();
    producer.await.unwrap();
    // Let the last acks land before measuring the next run.
    let report = c.drain(Duration::from_secs(5)).await;
    assert!(report.in_flight.is_empty());
    let st = s.stats(queue).await.unwrap();
    assert_eq!(st.length, 0, "every message acked and deleted");
    n as f64 / secs
}

async fn renewal_tick(server: &RedisServer, leases: usize) -> (usize, f64, f64) {
    let client = RedisClient::new(server.config()).unwrap();
    let mut conn = client.shared().await.unwrap();
    let (key, liveness) =
        (keys::stream(keys::DEFAULT_PREFIX, "renewbench"), keys::consumers(keys::DEFAULT_PREFIX, "renewbench"));
    let mut pipe = redis::pipe();
    for _ in 0..leases {
        pipe.cmd("XADD").arg(&key).arg("*").arg(keys::PAYLOAD_FIELD).arg("x").ignore();
    }
    let _: () = pipe.query_async(&mut conn).await.unwrap();
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&key)
        .arg(keys::DEFAULT_GROUP)
        .arg("0")
        .query_async(&mut conn)
        .await
        .unwrap();
    let read: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(keys::DEFAULT_GROUP)
        .arg("c1")
        .arg("COUNT")
        .arg(leases)
        .arg("STREAMS")
        .arg(&key)
        .arg(">")
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut ids: Vec<String> = read.keys[0].ids.iter().map(|i| i.id.clone()).collect();
    ids.sort_by_key(|s| {
        let (a, b) = s.split_once('-').unwrap();
        (a.parse::<u64>().unwrap(), b.parse::<u64>().unwrap())
    });
    assert_eq!(ids.len(), leases);
    // The consumer's heartbeat (heartbeat.lua): liveness record, renew every lease, no quiet or
    // released ids, orphan check over its pending entries.
    let n = ids.len();
    let mut args: Vec<String> = vec![
        keys::DEFAULT_GROUP.into(),
        "c1".into(),
        keys::PARKED.into(),
        "30000".into(),
        "15000".into(),
        (n + 200).to_string(),
        "20000".into(),
        n.to_string(),
    ];
    args.extend(ids);
    // No fences (an in-process consumer's), no quiet ids.
    args.push("0".into());
    args.push("0".into());
    let refs: Vec<&dyn baton_redis::ArgLike> = args.iter().map(|a| a as &dyn baton_redis::ArgLike).collect();
    let fences = keys::fences(keys::DEFAULT_PREFIX, "renewbench");
    let keys = [key.as_str(), liveness.as_str(), fences.as_str()];
    // Warm up (loads the script).
    let (lost, gone, orphans, stale): (Vec<String>, Vec<String>, u64, Vec<u64>) =
        HEARTBEAT.run(&mut conn, &keys, &refs).await.unwrap();
    assert!(lost.is_empty() && gone.is_empty() && orphans == 0 && stale.is_empty());
    let mut ms = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        let (lost, gone, _, _): (Vec<String>, Vec<String>, u64, Vec<u64>) =
            HEARTBEAT.run(&mut conn, &keys, &refs).await.unwrap();
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
        assert!(lost.is_empty() && gone.is_empty());
    }
    ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (1, ms[ms.len() / 2], ms[ms.len() - 1])
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let server = RedisServer::start();
        let version = server.cli(&["INFO", "server"]);
        let version = version.lines().find(|l| l.starts_with("redis_version:")).unwrap_or("?").trim().to_string();
        println!("# baton-queue benchmark\n");
        println!(
            "machine: {} cores; {version}; redis on loopback\n",
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
        );

        let xadd = redis_benchmark_xadd(server.port());
        println!("| measurement | result |\n| --- | --- |");
        println!("| redis-benchmark XADD, 50 clients, unpipelined | {xadd:.0} ops/s |");

        let mem = MessageStream::memory();
        for c in [1usize, 64, 512] {
            let n = scale(if c == 1 { 100_000 } else { 500_000 });
            let cpu = baton_testkit::process_cpu_seconds();
            let r = end_to_end(&mem, &format!("mem-{c}"), c, n).await;
            let us = (baton_testkit::process_cpu_seconds() - cpu) * 1e6 / n as f64;
            println!("| memory: offer → no-op handler → ack, concurrency {c} ({n} msgs) | {r:.0} msg/s, {us:.2} µs CPU/msg |");
        }
        if std::env::var("BATON_BENCH_ONLY").is_ok_and(|v| v == "memory") {
            return;
        }
        let s = MessageStream::redis(RedisClient::new(server.config()).unwrap(), RedisQueueOptions::default())
            .await
            .unwrap();
        for c in [1usize, 64, 512] {
            let n = scale(if c == 1 { 10_000 } else { 100_000 });
            let r = end_to_end(&s, &format!("redis-{c}"), c, n).await;
            println!(
                "| redis: offer → no-op handler → ack, concurrency {c} ({n} msgs) | {r:.0} msg/s ({:.0}% of XADD) |",
                100.0 * r / xadd
            );
        }
        let (rt_per_tick, p50, max) = renewal_tick(&server, 10_000).await;
        println!("| renewal of 10,000 leases: round trips per tick | {rt_per_tick} |");
        println!("| renewal of 10,000 leases: ms per tick (p50 / max of 20) | {p50:.1} / {max:.1} ms |");
    });
}
