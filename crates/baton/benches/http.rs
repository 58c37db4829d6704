//! HTTP load generator for `baton serve` and any other Durable Streams server (the same client for
//! all, so the comparison is fair). Not a timed test: it prints a Markdown table.
//!
//! ```sh
//! BENCH_REDIS_PORT=P cargo bench -p baton --bench http -- append NAME=URL[@PID...] [...]
//!     # per server: append throughput (1,000 appends of 100 bytes, 50 in flight, median of 5
//!     # runs; and 20,000 appends (BENCH_LONG), median of 3), runs interleaved across servers
//!     # after a warm-up; CPU per append of the server (its PIDs), of Redis (BENCH_REDIS_PORT) and
//!     # of this generator, Redis commands per append; append → long-poll round trip (p50 / p99
//!     # of 300 sequential rounds, servers interleaved round by round). The client is
//!     # `http/client.rs` (hyper's HTTP/1.1 client
//!     # connection, keep-alive, one connection per request in flight) on one thread.
//! cargo bench -p baton --bench http -- fanout URL READERS [REDIS_PORT ...]
//!     # READERS concurrent SSE readers of one stream; delivery latency of appends to all of them,
//!     # and the Redis client count (INFO clients on each REDIS_PORT) before and while they read
//! ```

#[path = "http/client.rs"]
mod client;
#[path = "http/cpu.rs"]
mod cpu;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use client::{Conn, Req};
use futures::StreamExt;

/// The issue's shape: 1,000 appends of 100 bytes, 50 in flight.
const MESSAGES: usize = 1000;
const PAYLOAD: usize = 100;
const CONCURRENCY: usize = 50;
const RUNS: usize = 5;
/// The longer run (steadier numbers, and long enough to measure CPU per append).
const LONG_MESSAGES: usize = 20_000;
const LONG_RUNS: usize = 3;
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

/// Milliseconds since the epoch (unique names per run).
fn now_ms() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// A server under test: its name, `host:port`, URL prefix and the processes whose CPU is its own.
struct Target {
    name: String,
    host: String,
    prefix: String,
    pids: Vec<u32>,
    conns: Vec<Conn>,
    issue: Vec<f64>,
    long: Vec<f64>,
    /// CPU over the long runs (ns): server, Redis, generator; and the appends they served.
    cpu: [u64; 3],
    long_appends: usize,
    long_wall: Duration,
    redis_calls: Vec<(String, u64)>,
}

impl Target {
    fn parse(arg: &str) -> Target {
        let (name, rest) = arg.split_once('=').expect("targets are NAME=URL[@PID...]");
        let mut parts = rest.split('@');
        let (host, prefix) = client::split_url(parts.next().unwrap().trim_end_matches('/'));
        let pids = parts.map(|p| p.parse().expect("@PID is a process id")).collect();
        let conns = (0..CONCURRENCY).map(|_| Conn::new(&host)).collect();
        Target {
            name: name.to_string(),
            host,
            prefix,
            pids,
            conns,
            issue: vec![],
            long: vec![],
            cpu: [0; 3],
            long_appends: 0,
            long_wall: Duration::ZERO,
            redis_calls: vec![],
        }
    }

    fn stream(&self, name: &str) -> String {
        format!("{}/v1/stream/bench/{name}", self.prefix)
    }

    fn req(&self, method: &str, path: &str, ct: bool, body: &[u8]) -> Req {
        let headers: &[(&str, &str)] = if ct { &[("content-type", "application/octet-stream")] } else { &[] };
        Req::new(method, &self.host, path, headers, body)
    }

    async fn create(&mut self, path: &str) {
        let req = self.req("PUT", path, true, b"");
        let status = self.conns[0].send(&req).await.unwrap();
        assert!((200..300).contains(&status), "create {path}: {status}");
    }

    /// `n` appends of `PAYLOAD` bytes to a new stream, `CONCURRENCY` in flight (one connection
    /// each). Returns appends per second and the wall time.
    async fn append_run(&mut self, stream: &str, n: usize) -> (f64, Duration) {
        let path = self.stream(stream);
        self.create(&path).await;
        let req = self.req("POST", &path, true, &[b'x'; PAYLOAD]);
        let next = Arc::new(AtomicUsize::new(0));
        let t0 = Instant::now();
        let tasks: Vec<_> = std::mem::take(&mut self.conns)
            .into_iter()
            .map(|mut c| {
                let (req, next) = (req.clone(), next.clone());
                tokio::spawn(async move {
                    while next.fetch_add(1, Ordering::Relaxed) < n {
                        let status = c.send(&req).await.unwrap();
                        assert!((200..300).contains(&status), "append: {status}");
                    }
                    c
                })
            })
            .collect();
        for t in tasks {
            self.conns.push(t.await.unwrap());
        }
        let wall = t0.elapsed();
        (n as f64 / wall.as_secs_f64(), wall)
    }

    /// Set-up of append → long-poll round trips: a new stream and the reader's connection.
    async fn rt_setup(&mut self, stamp: u128) -> Rt {
        let path = self.stream(&format!("rt-{stamp}"));
        self.create(&path).await;
        let writer = &mut self.conns[0];
        writer.send(&Req::new("HEAD", &self.host, &path, &[], b"")).await.unwrap();
        let offset = writer.header("stream-next-offset").expect("Stream-Next-Offset").to_string();
        let append = self.req("POST", &path, true, &[b'r'; PAYLOAD]);
        Rt { path, offset, append, reader: Some(Conn::new(&self.host)) }
    }

    /// One round trip: a reader parked at the tail (its own connection), then one append; the
    /// time from sending the append to the reader's complete response.
    async fn rt_round(&mut self, rt: &mut Rt) -> Duration {
        let get = Req::new("GET", &self.host, &format!("{}?offset={}&live=long-poll", rt.path, rt.offset), &[], b"");
        let mut rc = rt.reader.take().unwrap();
        let reader = tokio::spawn(async move {
            let status = rc.send(&get).await.unwrap();
            let at = Instant::now();
            let next = rc.header("stream-next-offset").expect("Stream-Next-Offset").to_string();
            assert_eq!(rc.body(), &[b'r'; PAYLOAD], "the long-poll returns the append");
            (rc, status, next, at)
        });
        tokio::time::sleep(Duration::from_millis(15)).await; // let the long-poll park
        let t0 = Instant::now();
        let status = self.conns[0].send(&rt.append).await.unwrap();
        assert!((200..300).contains(&status));
        let (rc, status, next, at) = reader.await.unwrap();
        assert_eq!(status, 200, "the long-poll should have been woken by the append");
        rt.reader = Some(rc);
        rt.offset = next;
        at.duration_since(t0)
    }
}

/// State of one server's round trips.
struct Rt {
    path: String,
    offset: String,
    append: Req,
    reader: Option<Conn>,
}

fn redis_commandstats(port: u16) -> Vec<(String, u64)> {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string(), "info", "commandstats"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (cmd, rest) = l.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?.parse().ok()?;
            Some((cmd.to_string(), calls))
        })
        .collect()
}

fn delta(before: &[(String, u64)], after: &[(String, u64)]) -> Vec<(String, u64)> {
    after
        .iter()
        .map(|(c, n)| (c.clone(), n - before.iter().find(|(b, _)| b == c).map_or(0, |(_, m)| *m)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

fn redis_pid(port: u16) -> Option<u32> {
    let out =
        std::process::Command::new("redis-cli").args(["-p", &port.to_string(), "info", "server"]).output().ok()?;
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| l.trim().strip_prefix("process_id:")?.parse().ok())
}

/// Environment: `BENCH_REDIS_PORT` (the Redis of the Redis-backed targets: its CPU and
/// `INFO commandstats` per append are reported), `BENCH_LONG` (appends per long run), `BENCH_RT=0`
/// (no round trips).
async fn append_bench(mut targets: Vec<Target>) {
    let redis_port: Option<u16> = std::env::var("BENCH_REDIS_PORT").ok().map(|p| p.parse().expect("BENCH_REDIS_PORT"));
    let long_n: usize = std::env::var("BENCH_LONG").map_or(LONG_MESSAGES, |v| v.parse().expect("BENCH_LONG"));
    let rpid = redis_port.and_then(redis_pid);
    let stamp = now_ms();
    // Warm-up (the reference's JIT), not counted.
    for t in &mut targets {
        t.append_run(&format!("warm-{stamp}"), 5 * MESSAGES).await;
    }
    // Runs interleaved across servers, so that every server sees the same machine load.
    for run in 0..RUNS {
        for t in &mut targets {
            let (rate, _) = t.append_run(&format!("append-{stamp}-{run}"), MESSAGES).await;
            t.issue.push(rate);
        }
    }
    for run in 0..LONG_RUNS {
        for t in &mut targets {
            let stats = redis_port.map(redis_commandstats);
            let before = [cpu::of(&t.pids), rpid.map_or(0, |p| cpu::of(&[p])), cpu::own()];
            let (rate, wall) = t.append_run(&format!("long-{stamp}-{run}"), long_n).await;
            let after = [cpu::of(&t.pids), rpid.map_or(0, |p| cpu::of(&[p])), cpu::own()];
            for i in 0..3 {
                t.cpu[i] += after[i] - before[i];
            }
            t.long.push(rate);
            t.long_appends += long_n;
            t.long_wall += wall;
            if let (Some(port), Some(b)) = (redis_port, stats) {
                for (c, n) in delta(&b, &redis_commandstats(port)) {
                    match t.redis_calls.iter_mut().find(|(k, _)| *k == c) {
                        Some((_, m)) => *m += n,
                        None => t.redis_calls.push((c, n)),
                    }
                }
            }
        }
    }
    // Round trips interleaved across servers, round by round (20 warm-up rounds not counted).
    let mut rts: Vec<Vec<Duration>> = vec![Vec::new(); targets.len()];
    if !std::env::var("BENCH_RT").is_ok_and(|v| v == "0") {
        let mut states = Vec::new();
        for t in &mut targets {
            states.push(t.rt_setup(stamp).await);
        }
        for i in 0..ROUNDS + 20 {
            for ((t, st), out) in targets.iter_mut().zip(&mut states).zip(&mut rts) {
                let d = t.rt_round(st).await;
                if i >= 20 {
                    out.push(d);
                }
            }
        }
        for out in &mut rts {
            out.sort();
        }
    }
    println!(
        "| server | 1,000 × 100 B, 50 in flight (median of {RUNS}; runs) | {long_n} × 100 B (median of {LONG_RUNS}) | append → long-poll p50 | p99 |"
    );
    println!("| --- | --- | --- | --- | --- |");
    for (t, rt) in targets.iter_mut().zip(&rts) {
        let runs = t.issue.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(", ");
        println!(
            "| {} | {:.0} appends/s ({runs}) | {:.0} appends/s | {} | {} |",
            t.name,
            median(&mut t.issue.clone()),
            median(&mut t.long.clone()),
            ms(pct(rt, 0.5)),
            ms(pct(rt, 0.99))
        );
    }
    println!();
    println!("CPU per append over the long runs (µs; share of one core while running):");
    println!();
    println!("| server | server processes | Redis | load generator |");
    println!("| --- | --- | --- | --- |");
    for t in &targets {
        let per = |ns: u64| ns as f64 / 1000.0 / t.long_appends as f64;
        let share = |ns: u64| 100.0 * ns as f64 / t.long_wall.as_nanos() as f64;
        let cell = |ns: u64, known: bool| {
            if known {
                format!("{:.1} µs ({:.0}%)", per(ns), share(ns))
            } else {
                "–".to_string()
            }
        };
        println!(
            "| {} | {} | {} | {} |",
            t.name,
            cell(t.cpu[0], !t.pids.is_empty()),
            cell(t.cpu[1], rpid.is_some()),
            cell(t.cpu[2], true)
        );
    }
    if redis_port.is_some() {
        println!();
        println!("Redis commands per append over the long runs (INFO commandstats; all clients of that Redis):");
        println!();
        for t in &targets {
            let calls = t
                .redis_calls
                .iter()
                .map(|(c, n)| format!("{c} {:.3}", *n as f64 / t.long_appends as f64))
                .collect::<Vec<_>>()
                .join(", ");
            println!("- {}: {}", t.name, if calls.is_empty() { "none".to_string() } else { calls });
        }
    }
}

fn redis_clients(port: u16) -> usize {
    let out =
        std::process::Command::new("redis-cli").args(["-p", &port.to_string(), "info", "clients"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("connected_clients:").map(|v| v.trim().parse().unwrap()))
        .unwrap_or(0)
}

async fn fanout(base: String, readers: usize, redis_ports: Vec<u16>) {
    let count = |ports: &[u16]| ports.iter().map(|p| redis_clients(*p)).sum::<usize>();
    let before = count(&redis_ports);
    let c = client(16);
    let stamp = now_ms();
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
        assert!(
            t_connect.elapsed() < Duration::from_secs(300),
            "only {} readers connected",
            connected.load(Ordering::Relaxed)
        );
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
    match args.first().map(String::as_str) {
        Some("append") => {
            let targets = args[1..].iter().map(|a| Target::parse(a)).collect();
            // One thread: the generator takes at most one core of the machine it measures on.
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(append_bench(targets));
        }
        Some("fanout") => {
            let base = args.get(1).expect("fanout URL READERS [REDIS_PORT ...]").trim_end_matches('/').to_string();
            let readers = args.get(2).map_or(10_000, |r| r.parse().unwrap());
            let ports = args[3.min(args.len())..].iter().map(|p| p.parse().unwrap()).collect();
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
            rt.block_on(fanout(base, readers, ports));
        }
        _ => eprintln!(
            "usage: cargo bench -p baton --bench http -- append NAME=URL[@PID...] [...]\n       cargo bench -p baton --bench http -- fanout URL READERS [REDIS_PORT ...]"
        ),
    }
}
