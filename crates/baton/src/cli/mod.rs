//! The command line: its grammar ([`Cli`]), `baton serve` and `baton worker` (start the
//! process, print where it is, wait for SIGTERM or ctrl-c, stop), and the client subcommands
//! (`baton streams`, `baton commands`, `baton queues`, `baton subscriptions`) that talk to a running server over HTTP,
//! plus `baton bench`, which runs workloads in-process against a backend.
//!
//! Exit codes of the client subcommands (docs/cli.md):
//!
//! | Code | Meaning |
//! |---|---|
//! | 0 | success |
//! | 1 | the command waited for ended `FAILED` or `CANCELLED` (`commands wait`, `submit --wait`, `commands watch`) |
//! | 2 | usage error: bad arguments, or input the server refused as malformed (400, 413, 415, 422, 431) |
//! | 3 | not found: unknown stream, command, queue, dead letter or subscription (404, 410) |
//! | 4 | conflict or refused: 409 (e.g. cancelling a finished command), 401, 403 |
//! | 5 | server or network error: connection refused, timeout, 5xx, an unreadable reply |
//! | 6 | `commands wait` / `submit --wait`: the timeout passed before the command ended |

mod args;
mod bench;
mod client;
mod commands;
pub mod exit;
mod output;
mod queues;
mod streams;
mod subscriptions;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::server::{Server, Worker};
use crate::settings::{describe_queues, ServeArgs, Storage, WorkerArgs};
use crate::shutdown::ShutdownSignal;

pub use args::Conn;
pub use client::CliError;
pub use output::colour;

/// Baton: durable work queues and durable streams on Redis.
#[derive(Parser, Debug)]
#[command(name = "baton", version, about)]
pub struct Cli {
    /// Log format on stderr: `text` or `json` (one JSON object per line) [default: text].
    #[arg(long, global = true, env = "BATON_LOG_FORMAT", value_parser = ["text", "json"])]
    pub log_format: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process: the size of `ServeArgs` does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve the HTTP API (commands, queues, Durable Streams protocol), the dashboard and the
    /// command workers (in memory, or on Redis / Redis Cluster).
    Serve(ServeArgs),
    /// Run the workers of the configured command queues only (no command API), on Redis or
    /// Redis Cluster, so several processes share the work.
    Worker(WorkerArgs),
    #[command(flatten)]
    Client(ClientCommand),
}

/// `baton serve`: runs until ctrl-c or SIGTERM, then shuts down gracefully.
pub async fn serve(args: ServeArgs) -> Result<(), String> {
    serve_resolved(args.resolve()?).await
}

/// [`serve`] with its settings resolved already (`main` resolves them first: the log and trace
/// setup needs `--otlp-endpoint`).
pub async fn serve_resolved(cfg: crate::settings::ServeConfig) -> Result<(), String> {
    let backend = cfg.backend.clone();
    // Before the workers start: a signal during startup shuts down (drains) once started.
    let mut signal = ShutdownSignal::listen()?;
    let server = Server::start(cfg).await?;
    let base = server.base_url();
    match backend {
        Storage::Memory => println!(
            "baton serve: listening on {base} with the IN-MEMORY backend (no --redis, --redis-cluster or --redis-sentinel given; data is lost on exit)"
        ),
        other => println!("baton serve: listening on {base} with {}", other.describe()),
    }
    println!("baton serve: dashboard at {base}/");
    println!("baton serve: commands at {base}/v1/queues/{{queue}}/commands and {base}/v1/commands/{{id}}; streams at {base}/v1/stream/{{path}}; API description at {base}/openapi.json");
    println!("baton serve: subscriptions at {base}/v1/stream/__ds/subscriptions/{{id}}; webhook signing keys at {base}/v1/stream/__ds/jwks.json");
    println!("baton serve: health at {base}/healthz, {base}/readyz; metrics at {base}/metrics");
    signal.recv().await;
    println!("baton serve: shutting down");
    server.shutdown().await;
    Ok(())
}

/// `baton worker`: runs the configured queues' workers until ctrl-c or SIGTERM, then drains them
/// within the shutdown grace. With `--listen`, serves `/healthz`, `/readyz` and `/metrics`.
///
/// The signal handlers are installed before anything starts: a signal during startup is kept
/// and shuts the worker down once started.
pub async fn worker(args: WorkerArgs) -> Result<(), String> {
    worker_resolved(args.resolve()?).await
}

/// [`worker`] with its settings resolved already.
pub async fn worker_resolved(cfg: crate::settings::WorkerConfig) -> Result<(), String> {
    let mut signal = ShutdownSignal::listen()?;
    let worker = Worker::start(&cfg).await?;
    let default_note = if cfg.queues_defaulted { " (the built-in default: no [queues] configured)" } else { "" };
    println!(
        "baton worker: working queues {}{default_note} on {}",
        describe_queues(&cfg.queues),
        cfg.backend.describe()
    );
    if let Some(addr) = worker.health_addr() {
        println!("baton worker: health at http://{addr}/healthz, metrics at http://{addr}/metrics");
    }
    signal.recv().await;
    println!(
        "baton worker: shutting down (up to {} for running handlers)",
        humantime::format_duration(cfg.shutdown_grace)
    );
    worker.shutdown().await;
    Ok(())
}

/// The client and bench subcommands (flattened into the top-level `baton` command).
#[derive(Subcommand, Debug)]
pub enum ClientCommand {
    /// Durable streams on a server: create, append, read, tail, close, delete.
    Streams(StreamsCmd),
    /// Commands on a server: submit (one, or a batch from a file), status, wait, watch, cancel, list.
    Commands(CommandsCmd),
    /// Queues on a server: list, pending, dead (letters), replay, events.
    Queues(QueuesCmd),
    /// Durable Streams subscriptions on a server: rotate-key (the webhook signing key), get.
    Subscriptions(SubscriptionsCmd),
    /// Run a workload in-process (memory, Redis or Redis Cluster) and print throughput and latency.
    Bench(bench::BenchArgs),
}

#[derive(Args, Debug)]
pub struct StreamsCmd {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub op: streams::StreamsOp,
}

#[derive(Args, Debug)]
pub struct CommandsCmd {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub op: commands::CommandsOp,
}

#[derive(Args, Debug)]
pub struct QueuesCmd {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub op: queues::QueuesOp,
}

#[derive(Args, Debug)]
pub struct SubscriptionsCmd {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub op: subscriptions::SubscriptionsOp,
}

/// Runs a client or bench subcommand; errors are printed to stderr and become the exit code.
pub async fn run(cmd: ClientCommand) -> ExitCode {
    let result = match cmd {
        ClientCommand::Streams(c) => match client::Client::new(&c.conn) {
            Ok(cl) => streams::run(&cl, c.op).await,
            Err(e) => Err(e),
        },
        ClientCommand::Commands(c) => match client::Client::new(&c.conn) {
            Ok(cl) => commands::run(&cl, c.op).await,
            Err(e) => Err(e),
        },
        ClientCommand::Queues(c) => match client::Client::new(&c.conn) {
            Ok(cl) => queues::run(&cl, c.op).await,
            Err(e) => Err(e),
        },
        ClientCommand::Subscriptions(c) => match client::Client::new(&c.conn) {
            Ok(cl) => subscriptions::run(&cl, c.op).await,
            Err(e) => Err(e),
        },
        ClientCommand::Bench(args) => bench::run(args).await,
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("baton: {}", e.message);
            ExitCode::from(e.code)
        }
    }
}
