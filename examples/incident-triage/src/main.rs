//! `incident-triage`: the example's web server. See the crate docs and README.md.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use incident_triage::web::{router, WebConfig};
use incident_triage::{PaceSettings, Triage, TriageConfig};

/// Incident triage: analyse logs as durable, resumable runs (a Baton example).
#[derive(Parser, Debug)]
#[command(name = "incident-triage", version)]
struct Args {
    /// Redis URL (e.g. redis://127.0.0.1:6379); without it everything is in memory (one process).
    #[arg(long, env = "TRIAGE_REDIS")]
    redis: Option<String>,
    /// Address to listen on; processes on one machine need one each (e.g. 127.0.0.1:7711).
    #[arg(long, default_value = "127.0.0.1:7710")]
    listen: SocketAddr,
    /// A directory whose log files may be analysed (repeatable).
    #[arg(long = "log-dir", default_value = "/var/log")]
    log_dirs: Vec<PathBuf>,
    /// A run with no event nor keepalive for this long ends as producer_lost (e.g. 10s).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    silence_timeout: Duration,
    /// Pause between progress and finding events (e.g. 250ms).
    #[arg(long, default_value = "250ms", value_parser = humantime::parse_duration)]
    pace: Duration,
    /// Percent of the log between progress events (1-100).
    #[arg(long, default_value_t = 5)]
    progress_step: u8,
    /// Delay between the monitor's checks of a running run.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    check_interval: Duration,
    /// Claim timeout of the monitor queue (a dead process's runs are monitored elsewhere after it).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    monitor_claim_timeout: Duration,
    /// SSE connections are recycled after this long (browsers resume with Last-Event-ID).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    sse_cycle: Duration,
    /// Key prefix of the command store and the run pointers in Redis.
    #[arg(long, default_value = "baton")]
    key_prefix: String,
    /// Name of this process in run events (default: "<hostname> pid <pid>").
    #[arg(long)]
    worker: Option<String>,
}

/// Why the process could not start or serve; printed as one line on stderr, exit status 1.
#[derive(Debug, thiserror::Error)]
enum MainError {
    #[error(
        "cannot listen on {addr}: the address is already in use (another incident-triage process, or \
         another program, listens there); pick another address with --listen, e.g. --listen {suggestion}"
    )]
    AddrInUse { addr: SocketAddr, suggestion: SocketAddr },
    #[error("cannot listen on {addr}: {source}; pick another address with --listen")]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("cannot start the triage service: {0}")]
    Start(#[from] incident_triage::TriageError),
    #[error("serving HTTP failed: {0}")]
    Serve(std::io::Error),
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TRIAGE_LOG")
                .unwrap_or_else(|_| "info,baton_queue=warn".into()),
        )
        .init();
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("incident-triage: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Binds the listener first (a process that cannot serve never joins the queues), then starts the
/// service and serves until SIGINT/SIGTERM.
async fn run(a: Args) -> Result<(), MainError> {
    let listener = tokio::net::TcpListener::bind(a.listen).await.map_err(|source| listen_error(a.listen, source))?;
    let addr = listener.local_addr().map_err(MainError::Serve)?;
    let defaults = TriageConfig::default();
    let cfg = TriageConfig {
        redis: a.redis.clone(),
        key_prefix: a.key_prefix,
        silence_timeout: a.silence_timeout,
        check_interval: a.check_interval,
        monitor_claim_timeout: a.monitor_claim_timeout,
        log_dirs: a.log_dirs,
        pace: PaceSettings { pace: a.pace, progress_step: a.progress_step.clamp(1, 100), ..PaceSettings::default() },
        worker: a.worker.unwrap_or(defaults.worker.clone()),
        ..defaults
    };
    let backend = match &cfg.redis {
        Some(url) => format!("Redis {url}"),
        None => "in-memory backend (one process; runs are lost on exit)".into(),
    };
    let triage = Triage::start(cfg).await?;
    let app = router(triage.clone(), WebConfig { sse_cycle: a.sse_cycle });
    println!("incident-triage on http://{addr}/ ({backend})");
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        })
        .await;
    triage.shutdown().await;
    served.map_err(MainError::Serve)
}

/// The error of a failed bind of `addr`; a taken address suggests the next port.
fn listen_error(addr: SocketAddr, source: std::io::Error) -> MainError {
    if source.kind() == std::io::ErrorKind::AddrInUse {
        let mut suggestion = addr;
        suggestion.set_port(addr.port().checked_add(1).unwrap_or(addr.port() - 1));
        MainError::AddrInUse { addr, suggestion }
    } else {
        MainError::Listen { addr, source }
    }
}
