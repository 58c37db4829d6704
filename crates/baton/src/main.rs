use std::process::ExitCode;

use baton::config::{Cli, Command};
use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BATON_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Serve(args) => match baton::cli::serve(args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("baton serve: {e}");
                ExitCode::FAILURE
            }
        },
    }
}
