//! A 100 MB log streams through a whole run (memory backend) with bounded memory: the peak
//! resident set grows by less than 64 MB while it is analysed.
//!
//! Why 64 MB is a fair bound: the analysis keeps one line buffer (≤ 64 KiB), one 64 KiB read
//! buffer and a signature table capped at 5,000 entries of ≤ 240 + 300 bytes plus bookkeeping
//! (≈ 5 MB with the index keys); the stream holds ~40 small events. Reading the file through
//! the page cache does not count towards this process's RSS. A design that buffered the file, or
//! grouped lines without a cap, would grow by at least 100 MB here (the file has 1.5 M lines and
//! over 50,000 distinct signatures). The test is alone in its binary so no other test's
//! allocations disturb the measurement.

mod common;

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_commands::CommandStatus;
use incident_triage::{LogSource, PaceSettings, Triage};

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 4096
}

/// ~100 MB: mostly info lines, 1 in 10 an error with one of 60,000 distinct word-only signatures.
fn write_big_log(path: &std::path::Path, bytes: u64) -> u64 {
    let mut f = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path).unwrap());
    let mut written = 0u64;
    let mut i = 0u64;
    let word = |mut n: u64| {
        let mut w = String::new();
        loop {
            w.push((b'a' + (n % 26) as u8) as char);
            n /= 26;
            if n == 0 {
                break w;
            }
        }
    };
    while written < bytes {
        let line = if i.is_multiple_of(10) {
            format!(
                "2025-02-01T03:{:02}:{:02}.{:03}Z ERROR svc {} failed: request {} id {:x}\n",
                (i / 60_000) % 60,
                (i / 1000) % 60,
                i % 1000,
                word(i / 10 % 60_000),
                i,
                i * 7919
            )
        } else {
            format!(
                "2025-02-01T03:{:02}:{:02}.{:03}Z INFO handled request {} in {} ms for user {}\n",
                (i / 60_000) % 60,
                (i / 1000) % 60,
                i % 1000,
                i,
                i % 97,
                i % 1013
            )
        };
        f.write_all(line.as_bytes()).unwrap();
        written += line.len() as u64;
        i += 1;
    }
    f.flush().unwrap();
    written
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_megabytes_with_bounded_memory() {
    let dir = common::TempDir::new("big");
    let log = dir.path().join("big.log");
    let size = write_big_log(&log, 100 << 20);
    assert!(size >= 100 << 20);
    let mut cfg = common::config(dir.path(), None, Duration::from_millis(1));
    cfg.silence_timeout = Duration::from_secs(30);
    cfg.pace = PaceSettings { pace: Duration::from_millis(1), ..PaceSettings::default() };
    let t = Triage::start(cfg).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let base = rss_bytes();
    let peak = Arc::new(AtomicU64::new(base));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, stop) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(rss_bytes(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let run = t.start_run("big", LogSource::Path { path: log.display().to_string() }).await.unwrap();
    let st = t.commands().wait(&run.run, Duration::from_secs(600)).await.unwrap();
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    assert_eq!(st.status, CommandStatus::Succeeded, "{st:?}");
    let summary = &st.result_as::<serde_json::Value>().unwrap()["summary"];
    assert_eq!(summary["bytes"], size, "every byte was read");
    assert_eq!(summary["signatures"], 5000, "the signature table stopped at its cap");
    assert_eq!(summary["signatures_capped"], true);
    let growth = peak.load(Ordering::Relaxed).saturating_sub(base);
    eprintln!(
        "100 MB log: {} lines; peak RSS growth {:.1} MB (base {:.1} MB)",
        summary["lines"],
        growth as f64 / 1e6,
        base as f64 / 1e6
    );
    assert!(growth < 64 << 20, "peak RSS grew by {growth} bytes");
    t.shutdown().await;
}
