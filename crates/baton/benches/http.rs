//! HTTP load generator for `baton serve` and any other Durable Streams server (the same client for
//! all, so the comparison is fair). Not a timed test: it prints a Markdown table.
//!
//! ```sh
//! cargo bench -p baton --bench http -- append NAME=URL [NAME=URL ...]
//!     # per server: append throughput (1,000 appends of 100 bytes, 50 in flight; median of 5 runs,
//!     # after a warm-up) and append → long-poll round trip (p50 / p99 of 300 sequential rounds)
//! cargo bench -p baton --bench http -- fanout URL READERS [REDIS_PORT ...]
//!     # READERS concurrent SSE readers of one stream; delivery latency of appends to all of them,
//!     # and the Redis client count (INFO clients on each REDIS_PORT) before and while they read
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;

const MESSAGES: usize = 1000;
const PAYLOAD: usize = 100;
const CONCURRENCY: usize = 50;
const RUNS: usize = 5;
const ROUNDS: usize = 300;

fn client(max_idle: usize) -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(max_idle)
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

async fn create(c: &reqwest::Client, url: &str) {
    let r = c.put(url).header("content-type", "application/octet-stream").send().await.unwrap();
    assert!(r.status().is_success(), "create {url}: {}", r.status());
}

/// One run: `MESSAGES` appends, `CONCURRENCY` in flight. Returns appends per second.
async fn append_run(c: &reqwest::Client, url: &str) -> f64 {
    let next = Arc::new(AtomicUsize::new(0));
    let body = bytes::Bytes::from(vec![b'x'; PAYLOAD]);
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (c, url, next, body) = (c.clone(), url.to_string(), next.clone(), body.clone());
            tokio::spawn(async move {
                while next.fetch_add(1, Ordering::Relaxed) < MESSAGES {
                    let r = c
                        .post(&url)
                        .header("content-type", "application/octet-stream")
                        .body(body.clone())
                        .send()
                        .await
                        .unwrap();
                    assert!(r.status().is_success(), "append: {}", r.status());
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    MESSAGES as f64 / t0.elapsed().as_secs_f64()
}

/// Append → long-poll round trips: a reader parked at the tail, then one append; the time from
/// sending the append to the reader's response.
async fn roundtrip(c: &reqwest::Client, url: &str) -> Vec<Duration> {
    let r = c.head(url).send().await.unwrap();
    let mut offset = r.headers()["stream-next-offset"].to_str().unwrap().to_string();
    let mut out = Vec::with_capacity(ROUNDS);
    for i in 0..ROUNDS + 20 {
        let reader = {
            let (c, u) = (c.clone(), format!("{url}?offset={offset}&live=long-poll"));
            tokio::spawn(async move {
                let r = c.get(u).send().await.unwrap();
                let at = Instant::now();
                let next = r.headers()["stream-next-offset"].to_str().unwrap().to_string();
                let status = r.status();
                let _ = r.bytes().await;
                (status, next, at)
            })
        };
        tokio::time::sleep(Duration::from_millis(15)).await; // let the long-poll park
        let t0 = Instant::now();
        let w = c.post(url).header("content-type", "application/octet-stream").body(vec![b'r'; PAYLOAD]).send().await.unwrap();
        assert!(w.status().is_success());
        let (status, next, at) = reader.await.unwrap();
        assert_eq!(status, 200, "the long-poll should have been woken by the append");
        offset = next;
        if i >= 20 {
            out.push(at.duration_since(t0));
        }
    }
    out.sort();
    out
}

async fn append_bench(targets: Vec<(String, String)>) {
    println!("| server | append throughput (1,000 × 100 B, 50 in flight; median of {RUNS}) | append → long-poll p50 | p99 |");
    println!("| --- | --- | --- | --- |");
    for (name, base) in targets {
        let c = client(CONCURRENCY * 2);
        let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
        let mut rates = Vec::new();
        // Warm-up run, not counted.
        let warm = format!("{base}/v1/stream/bench/warm-{stamp}");
        create(&c, &warm).await;
        append_run(&c, &warm).await;
        for run in 0..RUNS {
            let url = format!("{base}/v1/stream/bench/append-{stamp}-{run}");
            create(&c, &url).await;
            rates.push(append_run(&c, &url).await);
        }
        rates.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let url = format!("{base}/v1/stream/bench/rt-{stamp}");
        create(&c, &url).await;
        let rt = roundtrip(&c, &url).await;
        println!(
            "| {name} | {:.0} appends/s (runs: {}) | {} | {} |",
            rates[RUNS / 2],
            rates.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(", "),
            ms(pct(&rt, 0.5)),
            ms(pct(&rt, 0.99))
        );
    }
}

fn redis_clients(port: u16) -> usize {
    let out = std::process::Command::new("redis-cli").args(["-p", &port.to_string(), "info", "clients"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("connected_clients:").map(|v| v.trim().parse().unwrap()))
        .unwrap_or(0)
}

async fn fanout(base: String, readers: usize, redis_ports: Vec<u16>) {
    let count = |ports: &[u16]| ports.iter().map(|p| redis_clients(*p)).sum::<usize>();
    let before = count(&redis_ports);
    let c = client(16);
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
    let url = format!("{base}/v1/stream/bench/fanout-{stamp}");
    let r = c.put(&url).header("content-type", "text/plain").send().await.unwrap();
    assert!(r.status().is_success());
    const EVENTS: usize = 10;
    // Each reader: its own connection (a fresh client per 1,000 readers keeps pools small).
    let connected = Arc::new(AtomicUsize::new(0));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Instant)>();
    let t_connect = Instant::now();
    let mut handles = Vec::with_capacity(readers);
    let sem = Arc::new(tokio::sync::Semaphore::new(500));
    for i in 0..readers {
        let (u, connected, tx, sem) = (format!("{url}?offset=-1&live=sse"), connected.clone(), tx.clone(), sem.clone());
        let c = reqwest::Client::builder().pool_max_idle_per_host(0).timeout(Duration::from_secs(600)).build().unwrap();
        handles.push(tokio::spawn(async move {
            let mut permit = Some(sem.acquire_owned().await.unwrap());
            let r = c.get(u).send().await.unwrap();
            assert_eq!(r.status(), 200, "reader {i}");
            let mut body = r.bytes_stream();
            let mut text = String::new();
            let mut seen = 0usize;
            let mut first = true;
            while let Some(Ok(chunk)) = body.next().await {
                text.push_str(&String::from_utf8_lossy(&chunk));
                if first && text.contains("upToDate") {
                    first = false;
                    connected.fetch_add(1, Ordering::Relaxed);
                    permit.take(); // connected: let the next reader connect
                }
                while let Some(pos) = text.find("e#") {
                    let rest = &text[pos + 2..];
                    let Some(end) = rest.find('#') else { break };
                    let n: usize = rest[..end].parse().unwrap();
                    let _ = tx.send((n, Instant::now()));
                    seen += 1;
                    text = rest[end..].to_string();
                }
                if seen >= EVENTS {
                    break;
                }
            }
        }));
    }
    drop(tx);
    while connected.load(Ordering::Relaxed) < readers {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(t_connect.elapsed() < Duration::from_secs(300), "only {} readers connected", connected.load(Ordering::Relaxed));
    }
    let connect_time = t_connect.elapsed();
    let during = count(&redis_ports);
    // Appends, one every 200 ms; delivery latency = receive time − send time, over all readers.
    let mut sent = Vec::new();
    for n in 0..EVENTS {
        sent.push(Instant::now());
        let r = c.post(&url).header("content-type", "text/plain").body(format!("e#{n}#")).send().await.unwrap();
        assert!(r.status().is_success());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut lat = Vec::with_capacity(readers * EVENTS);
    let deadline = Instant::now() + Duration::from_secs(120);
    while lat.len() < readers * EVENTS && Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
            Ok(Some((n, at))) => lat.push(at.duration_since(sent[n])),
            _ => break,
        }
    }
    let delivered = lat.len();
    lat.sort();
    let after = count(&redis_ports);
    for h in handles {
        h.abort();
    }
    println!("| SSE readers | connected in | events delivered | delivery p50 | p99 | max | Redis clients before / while reading / after |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| {readers} | {:.1} s | {delivered} of {} | {} | {} | {} | {before} / {during} / {after} |",
        connect_time.as_secs_f64(),
        readers * EVENTS,
        ms(pct(&lat, 0.5)),
        ms(pct(&lat, 0.99)),
        ms(lat.last().copied().unwrap_or_default())
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    match args.first().map(String::as_str) {
        Some("append") => {
            let targets = args[1..]
                .iter()
                .map(|a| {
                    let (n, u) = a.split_once('=').expect("targets are NAME=URL");
                    (n.to_string(), u.trim_end_matches('/').to_string())
                })
                .collect();
            rt.block_on(append_bench(targets));
        }
        Some("fanout") => {
            let base = args.get(1).expect("fanout URL READERS [REDIS_PORT ...]").trim_end_matches('/').to_string();
            let readers = args.get(2).map_or(10_000, |r| r.parse().unwrap());
            let ports = args[3.min(args.len())..].iter().map(|p| p.parse().unwrap()).collect();
            rt.block_on(fanout(base, readers, ports));
        }
        _ => eprintln!(
            "usage: cargo bench -p baton --bench http -- append NAME=URL [NAME=URL ...]\n       cargo bench -p baton --bench http -- fanout URL READERS [REDIS_PORT ...]"
        ),
    }
}
