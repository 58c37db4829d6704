//! Arguments shared by the client subcommands: how to reach the server, and human durations.

use std::time::Duration;

use clap::Args;

use crate::settings::parse_duration;

/// How to reach the server; shared by the client subcommands.
#[derive(Args, Debug, Clone)]
pub struct Conn {
    /// Base URL of `baton serve`.
    #[arg(long, global = true, env = "BATON_SERVER", default_value = "http://127.0.0.1:7700")]
    pub server: String,
    /// Bearer token (when the server has tokens configured).
    #[arg(long, global = true, env = "BATON_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Print JSON (one document, or one per line for `tail`) instead of text.
    #[arg(long, global = true)]
    pub json: bool,
}

/// A `clap` value parser for human durations (`30s`, `5m`, `250ms`).
pub fn duration_arg(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}
