use std::io::IsTerminal;
use std::process::ExitCode;

use baton::cli::{Cli, ClientCommand, Command};
use baton::settings::{ServeConfig, WorkerConfig};
use baton::telemetry::{self, LogFormat};
use clap::Parser;

/// What this process runs, its settings resolved (one per process: its size does not matter).
#[allow(clippy::large_enum_variant)]
enum Run {
    Serve(ServeConfig),
    Worker(WorkerConfig),
    Client(ClientCommand),
}

/// jemalloc rather than glibc's malloc: tasks move between the runtime's worker threads, and
/// glibc takes an arena lock for every object freed or grown on a thread other than the one
/// that allocated it. Measured against glibc (docs/benchmarks.md, issue 19): 0.88× the CPU per
/// command on Redis, 0.77-0.95× per HTTP append on Redis, 1.13× a pipelined producer's rate,
/// and no fan-out latency tails (mimalloc, also faster, had them: p99 up to 65 ms).
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let format = if cli.log_format.as_deref() == Some("json") {
        LogFormat::Json
    } else {
        // Colours only on a terminal (and never with NO_COLOR): no escape codes in log files.
        LogFormat::Text { ansi: baton::cli::colour(std::io::stderr().is_terminal()) }
    };
    // Settings first: the subscriber needs `--otlp-endpoint`. Resolving logs nothing.
    let run = match cli.command {
        Command::Serve(args) => match args.resolve() {
            Ok(cfg) => Run::Serve(cfg),
            Err(e) => {
                eprintln!("baton serve: {e}");
                return ExitCode::FAILURE;
            }
        },
        Command::Worker(args) => match args.resolve() {
            Ok(cfg) => Run::Worker(cfg),
            Err(e) => {
                eprintln!("baton worker: {e}");
                return ExitCode::FAILURE;
            }
        },
        Command::Client(cmd) => Run::Client(cmd),
    };
    let otlp = match &run {
        Run::Serve(cfg) => cfg.otlp.as_ref(),
        Run::Worker(cfg) => cfg.otlp.as_ref(),
        Run::Client(_) => None,
    };
    let telemetry = match telemetry::init(format, otlp) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("baton: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = match run {
        Run::Serve(cfg) => match baton::cli::serve_resolved(cfg).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("baton serve: {e}");
                ExitCode::FAILURE
            }
        },
        Run::Client(cmd) => baton::cli::run(cmd).await,
        Run::Worker(cfg) => match baton::cli::worker_resolved(cfg).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("baton worker: {e}");
                ExitCode::FAILURE
            }
        },
    };
    // Spans still batched are exported before the process ends.
    telemetry.shutdown().await;
    code
}
