//! Shared helpers of the integration tests: a deterministic log writer and a test setup.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use incident_triage::{PaceSettings, TriageConfig};

/// Writes `lines` lines of an application log with timestamps (one second apart at most):
/// `db: connection refused` errors (~5 %), `cache slow` warnings (~2 %), `panic` errors (~1 %),
/// and — from line `lines/2` for 300 lines — a burst of `upstream timed out` errors (60 %).
pub fn write_app_log(path: &Path, lines: usize) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut seed: u64 = 7;
    let mut rnd = |n: u64| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) % n
    };
    let mut t: u64 = 0;
    for i in 0..lines {
        t += rnd(3);
        let (h, m, s) = (12 + t / 3600, (t / 60) % 60, t % 60);
        let ts = format!("2025-01-31T{h:02}:{m:02}:{s:02}.{:03}Z", rnd(1000));
        let r = rnd(1000);
        if i > lines / 2 && i < lines / 2 + 300 && r < 600 {
            writeln!(
                f,
                "{ts} ERROR payments: upstream timed out after {}ms (request {:08x}-{:04x}-7{:03x}-8{:03x}-{:012x})",
                1000 + rnd(8000),
                rnd(1 << 32),
                rnd(1 << 16),
                rnd(1 << 12),
                rnd(1 << 12),
                rnd(1 << 48)
            )
            .unwrap();
        } else if r < 50 {
            writeln!(
                f,
                "{ts} ERROR db: connection to 10.0.{}.{}:5432 refused (attempt {})",
                rnd(10),
                1 + rnd(250),
                1 + rnd(5)
            )
            .unwrap();
        } else if r < 70 {
            writeln!(f, "{ts} WARN cache: slow response from node-{} ({} ms)", 1 + rnd(12), 200 + rnd(700)).unwrap();
        } else if r < 80 {
            writeln!(
                f,
                "{ts} ERROR worker-{}: panic: index out of range [{}] with length {}",
                1 + rnd(8),
                rnd(99),
                rnd(99)
            )
            .unwrap();
        } else {
            writeln!(f, "{ts} INFO http: GET /api/orders/{} 200 {}ms", rnd(99999), 1 + rnd(80)).unwrap();
        }
    }
    f.flush().unwrap();
}

/// A fresh temporary directory (removed on drop).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("triage-test-{tag}-{}-{}", std::process::id(), uuid_like()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn uuid_like() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
}

/// A config for tests: logs under `dir`, a short silence timeout, fast checks, `pace` per event.
pub fn config(dir: &Path, redis: Option<String>, pace: Duration) -> TriageConfig {
    TriageConfig {
        redis,
        silence_timeout: Duration::from_secs(3),
        check_interval: Duration::from_millis(200),
        monitor_claim_timeout: Duration::from_secs(2),
        log_dirs: vec![dir.to_path_buf()],
        pace: PaceSettings { pace, ..PaceSettings::default() },
        ..TriageConfig::default()
    }
}
