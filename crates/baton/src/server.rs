//! Starting and stopping `baton serve`.

use std::net::SocketAddr;
use std::sync::Arc;

use baton_streams::{StoreSettings, StreamStore};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{Backend, ServeConfig};
use crate::http::{self, AppState};

/// A running server.
pub struct Server {
    addr: SocketAddr,
    shutdown: CancellationToken,
    join: JoinHandle<std::io::Result<()>>,
    cfg: Arc<ServeConfig>,
}

impl Server {
    /// Connects the backend, binds the listener and starts serving. Errors: the backend cannot
    /// be reached, or the address cannot be bound.
    pub async fn start(cfg: ServeConfig) -> Result<Server, String> {
        let settings = StoreSettings { default_limits: cfg.default_limits, ..StoreSettings::default() };
        let store = match &cfg.backend {
            Backend::Memory => StreamStore::memory(settings),
            Backend::Redis(rc) => StreamStore::redis(rc.clone(), settings)
                .await
                .map_err(|e| format!("cannot use {rc}: {e}"))?,
        };
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let cfg = Arc::new(cfg);
        let shutdown = CancellationToken::new();
        let state = AppState {
            store,
            cfg: cfg.clone(),
            live: Arc::new(Semaphore::new(cfg.max_live_readers)),
            shutdown: shutdown.clone(),
        };
        let app = http::router(state);
        let token = shutdown.clone();
        let join = tokio::spawn(async move {
            axum::serve(listener, app).with_graceful_shutdown(token.cancelled_owned()).await
        });
        Ok(Server { addr, shutdown, join, cfg })
    }

    /// The bound address (useful with port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Ends live reads, stops accepting connections and waits (up to the shutdown grace) for
    /// in-flight requests.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        match tokio::time::timeout(self.cfg.shutdown_grace, self.join).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "server stopped with an error"),
            Ok(Err(e)) => tracing::warn!(error = %e, "server task failed"),
            Err(_) => tracing::warn!(grace = ?self.cfg.shutdown_grace, "requests still running after the grace period; stopping anyway"),
        }
    }
}
