//! Waiting for the signals that stop `baton serve` and `baton worker` (the bottom layer: it
//! uses nothing else of this crate).

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
