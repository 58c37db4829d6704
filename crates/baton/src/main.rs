use std::io::IsTerminal;
use std::process::ExitCode;

use baton::cli::{Cli, Command};
use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = || tracing_subscriber::EnvFilter::try_from_env("BATON_LOG").unwrap_or_else(|_| "info".into());
    if cli.log_format.as_deref() == Some("json") {
        tracing_subscriber::fmt().json().with_env_filter(filter()).with_writer(std::io::stderr).init();
    } else {
        // Colours only on a terminal (and never with NO_COLOR): no escape codes in log files.
        let ansi = baton::cli::colour(std::io::stderr().is_terminal());
        tracing_subscriber::fmt().with_ansi(ansi).with_env_filter(filter()).with_writer(std::io::stderr).init();
    }
    match cli.command {
        Command::Serve(args) => match baton::cli::serve(args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("baton serve: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Client(cmd) => baton::cli::run(cmd).await,
        Command::Worker(args) => match baton::cli::worker(args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("baton worker: {e}");
                ExitCode::FAILURE
            }
        },
    }
}
