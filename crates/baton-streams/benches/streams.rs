//! Streams engine benchmark (not a test): starts its own redis-server and prints a table.
//!
//! `CARGO_TARGET_DIR=target/streams cargo bench -p baton-streams --bench streams`
//! (`BATON_BENCH_LATENCY_ONLY=1` stops after the latency rows, e.g. to profile them).

/// The `baton` binary's allocator (see its `main.rs`), so that fan-out tails are those it ships.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_redis::redis::{self, Value};
use baton_streams::*;
use baton_testkit::RedisServer;
use bytes::Bytes;
use futures::StreamExt;

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
    pages * 4096
}

fn settings() -> StreamStoreSettings {
    StreamStoreSettings { default_limits: RunLimits::unlimited(), ..StreamStoreSettings::default() }
}

async fn latency<F, Fut>(n: usize, mut f: F) -> Vec<Duration>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for i in 0..200 {
        f(i).await; // warm-up
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        f(i).await;
        out.push(t.elapsed());
    }
    out.sort();
    out
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    baton_testkit::require_redis();
    let server = RedisServer::start();
    let redis_version =
        server.cli(&["INFO", "server"]).lines().find(|l| l.starts_with("redis_version")).unwrap_or("").to_string();
    let store = StreamStore::redis(server.config(), settings()).await.unwrap();
    let memory = StreamStore::memory(settings());
    let raw = baton_redis::RedisClient::new(server.config()).unwrap().shared().await.unwrap();
    let payload = Bytes::from(vec![b'x'; 100]);
    let mut rows: Vec<(String, String)> = vec![];
    const N: usize = 5000;
    let idle_row = idle_reader_memory(&store).await;

    // 1. Append latency vs a raw XADD round trip (same payload, same connection kind), measured
    // interleaved (raw, append, producer append, raw, ...) so that all three see the same load.
    let ct = Some("application/octet-stream".to_string());
    let plain = StreamPath::new("bench/append").unwrap();
    store.create(&plain, CreateOptions::default()).await.unwrap();
    let run = StreamPath::new("bench/run").unwrap();
    let producer =
        store.open(&run, OpenOptions { limits: Some(RunLimits::default()), ..Default::default() }).await.unwrap();
    let (mut raw_lat, mut append_lat, mut producer_lat) =
        (Vec::with_capacity(N), Vec::with_capacity(N), Vec::with_capacity(N));
    // The append's script called directly (same arguments as the engine sends for a lone append:
    // the fast path's compact layout), plain and stamped on a run of its own: the differences to
    // "append" and "Producer::append" are the engine's client-side cost. A script doing nothing
    // but the XADD shows the floor of any script.
    let write_script = redis::Script::new(concat!(
        include_str!("../scripts/write_fast.lua"),
        include_str!("../scripts/common.lua"),
        include_str!("../scripts/write.lua")
    ));
    let floor_script = redis::Script::new("return redis.call('XADD', KEYS[1], '*', 'd', ARGV[1])");
    let (mut script_lat, mut floor_lat) = (Vec::with_capacity(N), Vec::with_capacity(N));
    let mut pscript_lat = Vec::with_capacity(N);
    let srun = StreamPath::new("bench/script-run").unwrap();
    let sprod =
        store.open(&srun, OpenOptions { limits: Some(RunLimits::default()), ..Default::default() }).await.unwrap();
    sprod.append(payload.clone()).await.unwrap(); // seq 0; the script goes on from seq 1
    let sinc = store.head(&srun).await.unwrap().incarnation;
    for i in 0..N + 200 {
        let mut c = raw.clone();
        let t = Instant::now();
        let _: Value = write_script
            .key("baton:s:{bench/append}")
            .key("baton:s:{bench/append}:m")
            .arg("")
            .arg("application/octet-stream")
            .arg(payload.as_ref())
            .invoke_async(&mut c)
            .await
            .unwrap();
        if i >= 200 {
            script_lat.push(t.elapsed());
        }
        let mut c = raw.clone();
        let t = Instant::now();
        let _: Value = write_script
            .key("baton:s:{bench/script-run}")
            .key("baton:s:{bench/script-run}:m")
            .arg(sinc.as_str())
            .arg("application/octet-stream")
            .arg(payload.as_ref())
            .arg("")
            .arg(format!("p:{}", sprod.id()))
            .arg(format!("{}:{}:", sprod.epoch(), i))
            .arg(format!("{}:{}::", sprod.epoch(), i + 1))
            .invoke_async(&mut c)
            .await
            .unwrap();
        if i >= 200 {
            pscript_lat.push(t.elapsed());
        }
        let mut c = raw.clone();
        let t = Instant::now();
        let _: Value = floor_script.key("bench:floor").arg(payload.as_ref()).invoke_async(&mut c).await.unwrap();
        if i >= 200 {
            floor_lat.push(t.elapsed());
        }
        let mut c = raw.clone();
        let t = Instant::now();
        let _: Value = redis::cmd("XADD")
            .arg("bench:raw")
            .arg("*")
            .arg("d")
            .arg(payload.as_ref())
            .query_async(&mut c)
            .await
            .unwrap();
        let r = t.elapsed();
        let t = Instant::now();
        store
            .append(&plain, AppendRequest { data: payload.clone(), content_type: ct.clone(), ..Default::default() })
            .await
            .unwrap();
        let a = t.elapsed();
        let t = Instant::now();
        producer.append(payload.clone()).await.unwrap();
        let p = t.elapsed();
        if i >= 200 {
            raw_lat.push(r);
            append_lat.push(a);
            producer_lat.push(p);
        }
    }
    raw_lat.sort();
    script_lat.sort();
    floor_lat.sort();
    pscript_lat.sort();
    append_lat.sort();
    producer_lat.sort();
    let mem_path = StreamPath::new("bench/mem").unwrap();
    memory.create(&mem_path, CreateOptions::default()).await.unwrap();
    let mem_lat = latency(N, |_| {
        let (s, p, d, ct) = (memory.clone(), mem_path.clone(), payload.clone(), ct.clone());
        async move {
            s.append(&p, AppendRequest { data: d, content_type: ct, ..Default::default() }).await.unwrap();
        }
    })
    .await;
    let evalsha = server
        .cli(&["INFO", "commandstats"])
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha"))
        .unwrap_or("")
        .to_string();
    let raw50 = pct(&raw_lat, 0.5);
    for (name, l) in [
        ("raw XADD (redis)", &raw_lat),
        ("EVALSHA of a script doing only XADD", &floor_lat),
        ("write script via EVALSHA (redis)", &script_lat),
        ("same, stamped (run limits)", &pscript_lat),
        ("append, no producer (redis)", &append_lat),
        ("Producer::append, run limits (redis)", &producer_lat),
        ("append (memory)", &mem_lat),
    ] {
        rows.push((
            format!("latency {name}"),
            format!(
                "p50 {} p99 {} ({:.2}x raw p50)",
                us(pct(l, 0.5)),
                us(pct(l, 0.99)),
                pct(l, 0.5).as_secs_f64() / raw50.as_secs_f64()
            ),
        ));
    }

    rows.push((
        "  server time per EVALSHA (all scripts)".into(),
        evalsha.split(',').find(|f| f.starts_with("usec_per_call")).unwrap_or("").to_string(),
    ));
    // `BATON_BENCH_LATENCY_ONLY=1`: stop after the latency rows (for profiling them).
    if std::env::var_os("BATON_BENCH_LATENCY_ONLY").is_some() {
        print_rows(&redis_version, rows);
        return;
    }

    // 2. Pipelined producer on one stream: WINDOW appends in flight, producer stamps in order
    // (appends are group-committed: what is queued while a call is in flight goes in the next).
    const WINDOW: usize = 256;
    let pipe = StreamPath::new("bench/pipe").unwrap();
    store.create(&pipe, CreateOptions::default()).await.unwrap();
    let total = 100_000u64;
    let small = Bytes::from_static(b"0123456789abcdef0123456789abcdef");
    let t = Instant::now();
    let dup = futures::stream::iter(0..total)
        .map(|seq| {
            let (s, p, d, ct) = (store.clone(), pipe.clone(), small.clone(), ct.clone());
            async move {
                let req = AppendRequest {
                    data: d,
                    content_type: ct,
                    producer: Some(ProducerStamp { id: "bench".into(), epoch: 0, seq }),
                    ..Default::default()
                };
                // As the protocol's client does (§5.2.1): a gap means an earlier request is still
                // in flight; retry after it.
                let mut retries = 0u64;
                loop {
                    match s.append(&p, req.clone()).await {
                        Ok(a) => return (a.duplicate, retries),
                        Err(StreamError::SequenceGap { .. }) => {
                            retries += 1;
                            tokio::task::yield_now().await;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
            }
        })
        .buffered(WINDOW)
        .fold((0usize, 0u64), |(d, r), (dup, retries)| futures::future::ready((d + dup as usize, r + retries)))
        .await;
    let (dup, gap_retries) = dup;
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(dup, 0);
    assert_eq!(store.head(&pipe).await.unwrap().len, total);
    rows.push((
        format!("pipelined producer, 1 stream, 32 B, {WINDOW} in flight"),
        format!("{:.0} msg/s ({total} msgs in {secs:.2} s, {gap_retries} gap retries)", total as f64 / secs),
    ));

    // 3. 1 writer -> 1,000 readers at 1,000 msg/s: delivery latency.
    let fan = StreamPath::new("bench/fanout").unwrap();
    store.create(&fan, CreateOptions::default()).await.unwrap();
    let origin = Instant::now();
    let readers = 1000;
    let ready = Arc::new(tokio::sync::Barrier::new(readers + 1));
    let mut handles = vec![];
    for _ in 0..readers {
        let (s, p, ready) = (store.clone(), fan.clone(), ready.clone());
        handles.push(tokio::spawn(async move {
            let mut sub = s.subscribe(&p, ReadFrom::Now);
            sub.next(Duration::from_millis(1)).await.unwrap();
            ready.wait().await;
            let mut lat = Vec::with_capacity(5000);
            while let Some(c) = sub.next(Duration::from_secs(30)).await.unwrap() {
                let now = origin.elapsed().as_micros() as u64;
                for r in &c.records {
                    let sent: u64 = std::str::from_utf8(&r.data).unwrap().parse().unwrap();
                    lat.push(Duration::from_micros(now.saturating_sub(sent)));
                }
            }
            lat
        }));
    }
    ready.wait().await;
    let msgs = 5000u64;
    // Paced writer: message i is due at start + i ms and is sent then (or at once when late),
    // without waiting for the previous append's reply, so the rate holds at 1,000 msg/s.
    let wt = Instant::now();
    let mut sends = Vec::with_capacity(msgs as usize);
    for i in 0..msgs {
        tokio::time::sleep_until((wt + Duration::from_millis(i)).into()).await;
        let sent = origin.elapsed().as_micros().to_string();
        let (s, p, ct) = (store.clone(), fan.clone(), ct.clone());
        sends.push(tokio::spawn(async move {
            s.append(&p, AppendRequest { data: Bytes::from(sent), content_type: ct, ..Default::default() })
                .await
                .unwrap();
        }));
    }
    for h in sends {
        h.await.unwrap();
    }
    let rate = msgs as f64 / wt.elapsed().as_secs_f64();
    store.close(&fan, EndReason::Finished).await.unwrap();
    let mut all = vec![];
    for h in handles {
        let l = h.await.unwrap();
        assert_eq!(l.len() as u64, msgs);
        all.extend(l);
    }
    all.sort();
    rows.push((
        format!("1 writer -> {readers} readers, {rate:.0} msg/s"),
        format!(
            "delivery p50 {} p99 {} max {} ({} deliveries)",
            us(pct(&all, 0.5)),
            us(pct(&all, 0.99)),
            us(*all.last().unwrap()),
            all.len()
        ),
    ));

    rows.push(idle_row);
    print_rows(&redis_version, rows);
}

fn print_rows(redis_version: &str, rows: Vec<(String, String)>) {
    println!(
        "\nbaton-streams benchmark — {redis_version}, loopback, {} cores",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    println!("{:-<100}", "");
    for (k, v) in rows {
        println!("{k:<48} {v}");
    }
}

/// Memory per idle reader: the RSS delta over 10,000 waiting subscriptions of one stream. Runs
/// before the other phases: memory they freed stays with the allocator and would hide the
/// readers' growth.
async fn idle_reader_memory(store: &StreamStore) -> (String, String) {
    let idle = StreamPath::new("bench/idle").unwrap();
    store.create(&idle, CreateOptions::default()).await.unwrap();
    let n = 10_000;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = rss_bytes();
    let ready = Arc::new(tokio::sync::Barrier::new(n + 1));
    let mut idle_handles = vec![];
    for _ in 0..n {
        let (s, p, ready) = (store.clone(), idle.clone(), ready.clone());
        idle_handles.push(tokio::spawn(async move {
            let mut sub = s.subscribe(&p, ReadFrom::Now);
            sub.next(Duration::from_millis(1)).await.unwrap();
            ready.wait().await;
            let _ = sub.next(Duration::from_secs(60)).await;
        }));
    }
    ready.wait().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = rss_bytes();
    let row = (
        "memory per idle reader (RSS delta / 10,000)".to_string(),
        format!("{:.0} bytes", (after.saturating_sub(before)) as f64 / n as f64),
    );
    store.close(&idle, EndReason::Finished).await.unwrap();
    for h in idle_handles {
        h.await.unwrap();
    }
    row
}
