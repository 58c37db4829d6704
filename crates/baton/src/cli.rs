//! Subcommand entry points.

use crate::config::{Backend, ServeArgs};
use crate::http::describe_backend;
use crate::server::Server;

/// `baton serve`: runs until ctrl-c or SIGTERM, then shuts down gracefully.
pub async fn serve(args: ServeArgs) -> Result<(), String> {
    let cfg = args.resolve()?;
    let backend = cfg.backend.clone();
    let server = Server::start(cfg).await?;
    let base = server.base_url();
    match backend {
        Backend::Memory => println!(
            "baton serve: listening on {base} with the IN-MEMORY backend (no --redis or --redis-cluster given; data is lost on exit)"
        ),
        other => println!("baton serve: listening on {base} with {}", describe_backend(&other)),
    }
    println!("baton serve: streams at {base}/v1/stream/{{path}}; health at {base}/healthz, {base}/readyz; metrics at {base}/metrics");
    wait_for_signal().await;
    println!("baton serve: shutting down");
    server.shutdown().await;
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}
