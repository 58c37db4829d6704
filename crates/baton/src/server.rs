//! Starting and stopping `baton serve`.

use std::net::SocketAddr;
use std::sync::Arc;

use baton_streams::{StoreSettings, StreamStore};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{Backend, ServeConfig};
use crate::http::{self, AppState};
use crate::workers::{self, Workers};

/// SIGTERM and ctrl-c (SIGINT), listened for from the moment [`ShutdownSignal::listen`] is
/// called. Created before anything starts, so a signal that arrives while the process is still
/// starting is kept ([`ShutdownSignal::recv`] then returns at once) instead of ending the process
/// on the spot without draining the queues' services (the default action of both signals).
pub struct ShutdownSignal {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignal {
    /// Installs the handlers (inside a Tokio runtime). Errors: a handler cannot be installed.
    pub fn listen() -> Result<ShutdownSignal, String> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let term = signal(SignalKind::terminate()).map_err(|e| format!("cannot handle SIGTERM: {e}"))?;
            let int = signal(SignalKind::interrupt()).map_err(|e| format!("cannot handle SIGINT: {e}"))?;
            Ok(ShutdownSignal { term, int })
        }
        #[cfg(not(unix))]
        Ok(ShutdownSignal {})
    }

    /// Waits for the next SIGTERM or ctrl-c (at once if one came since `listen` or the last call).
    pub async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// A running server.
pub struct Server {
    addr: SocketAddr,
    shutdown: CancellationToken,
    join: JoinHandle<std::io::Result<()>>,
    cfg: Arc<ServeConfig>,
    workers: Option<Workers>,
    commands: baton_commands::CommandStore,
}

impl Server {
    /// Connects the backend, binds the listener and starts serving. Errors: the backend cannot
    /// be reached, or the address cannot be bound.
    pub async fn start(cfg: ServeConfig) -> Result<Server, String> {
        let settings = StoreSettings { default_limits: cfg.default_limits, ..StoreSettings::default() };
        let store = match &cfg.backend {
            Backend::Memory => StreamStore::memory(settings),
            Backend::Redis(rc) => {
                StreamStore::redis(rc.clone(), settings).await.map_err(|e| format!("cannot use {rc}: {e}"))?
            }
        };
        let command_store = workers::command_store(&cfg.backend).await?;
        let commands = http::commands::CommandsApi::new(
            command_store.clone(),
            &cfg.queues,
            cfg.max_command_body,
            cfg.run_workers,
        )?;
        let auth = Arc::new(crate::auth::Auth::new(cfg.tokens.clone()));
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let cfg = Arc::new(cfg);
        let shutdown = CancellationToken::new();
        let state = AppState::new(http::Shared {
            store,
            cfg: cfg.clone(),
            live: Arc::new(Semaphore::new(cfg.max_live_readers)),
            shutdown: shutdown.clone(),
            commands,
            auth: auth.clone(),
        });
        let queues = workers::describe_queues(&cfg.queues);
        let default_note = if cfg.queues_defaulted { " (built-in default: no [queues] configured)" } else { "" };
        let workers = if cfg.run_workers && !cfg.queues.is_empty() {
            tracing::info!("command queues{default_note}: {queues}; workers run in this process");
            Some(Workers::start(&command_store, &cfg.queues).await?)
        } else {
            tracing::info!("command queues{default_note}: {queues}; no workers in this process (--no-workers)");
            None
        };
        if auth.enabled() {
            let names: Vec<&str> = cfg.tokens.iter().map(|t| t.name.as_str()).collect();
            tracing::info!("bearer tokens required ({} configured: {})", names.len(), names.join(", "));
        } else {
            tracing::warn!("no tokens configured: every API request is allowed (add [[tokens]] to the config to require bearer tokens)");
        }
        let app = http::router(state);
        let token = shutdown.clone();
        let join =
            tokio::spawn(
                async move { axum::serve(listener, app).with_graceful_shutdown(token.cancelled_owned()).await },
            );
        Ok(Server { addr, shutdown, join, cfg, workers, commands: command_store })
    }

    /// The command store behind the command API (to submit or inspect from the same process).
    pub fn command_store(&self) -> &baton_commands::CommandStore {
        &self.commands
    }

    /// The bound address (useful with port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Ends live reads (and `?wait=` holds), stops accepting connections and waits up to the
    /// shutdown grace for in-flight requests, while this process's workers drain within the same
    /// grace (unfinished commands are taken over elsewhere after `claim_timeout`).
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        // Workers drain (running handlers get the grace too) while in-flight requests finish.
        let grace = self.cfg.shutdown_grace;
        let workers = self.workers;
        let drain = async move {
            if let Some(w) = workers {
                w.drain(grace).await;
            }
        };
        let http = async move {
            match tokio::time::timeout(grace, self.join).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::warn!(error = %e, "server stopped with an error"),
                Ok(Err(e)) => tracing::warn!(error = %e, "server task failed"),
                Err(_) => {
                    tracing::warn!(grace = ?grace, "requests still running after the grace period; stopping anyway")
                }
            }
        };
        tokio::join!(drain, http);
    }
}
