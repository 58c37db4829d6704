//! What every handler shares: the stream store, the command API's queues, the settings, the
//! live-reader slots, the shutdown signal and the tokens.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::http::{header, StatusCode};
use baton_commands::{CommandHandler, CommandStore, RemoteWorkers};
use baton_streams::StreamStore;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::errors::{echo, ApiError};
use crate::auth::Auth;
use crate::settings::{QueueConfig, ServeConfig};

/// Shared state of every handler: one `Arc`, so the per-request clones (each middleware layer
/// and extractor takes one) are a single reference-count increment.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl AppState {
    pub fn new(shared: Shared) -> Self {
        AppState(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// What [`AppState`] holds.
pub struct Shared {
    pub store: StreamStore,
    pub cfg: Arc<ServeConfig>,
    /// One permit per live reader (long-poll or SSE).
    pub live: Arc<Semaphore>,
    /// Cancelled when the server shuts down: live reads end cleanly.
    pub shutdown: CancellationToken,
    /// The command API (store and configured queues).
    pub commands: CommandsApi,
    /// Bearer tokens (none: open server).
    pub auth: Arc<Auth>,
    /// The Durable Streams subscriptions (`/v1/stream/__ds/…`) over `store`.
    pub subscriptions: baton_subscriptions::Subscriptions,
    /// The server's public base URL without a trailing `/` (`--public-url`, else
    /// `http://<bound address>`): the base of the URLs the API hands out.
    pub public_url: String,
}

impl AppState {
    /// A live-reader slot, or 503 with `Retry-After` when all are taken.
    pub fn live_permit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.live.clone().try_acquire_owned().map_err(|_| {
            metrics::counter!("baton_live_readers_refused_total").increment(1);
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "too_many_live_readers",
                format!(
                    "this server already has {} live readers (long-poll and SSE); retry later or read without live=",
                    self.cfg.max_live_readers
                ),
            )
            .with_header(header::RETRY_AFTER, 2)
        })
    }
}

/// One configured queue as the API knows it.
pub struct QueueEntry {
    /// Command type → handler (for type checks and `validate` at submit).
    pub handlers: BTreeMap<String, Arc<dyn CommandHandler>>,
    /// The queue's remote workers (the HTTP worker protocol), with the queue's settings.
    pub remote: Arc<RemoteWorkers>,
    /// Its cron schedules, as configured.
    pub schedules: Vec<baton_commands::schedules::Schedule>,
}

/// The command API's state: the store and the configured queues.
#[derive(Clone)]
pub struct CommandsApi {
    inner: Arc<ApiInner>,
}

struct ApiInner {
    store: CommandStore,
    queues: BTreeMap<String, QueueEntry>,
    max_body: usize,
    workers_here: bool,
}

impl CommandsApi {
    /// The API over `store` for `queues`; `workers_here` says whether this process runs their
    /// workers (shown in queue stats), `max_body` is the largest submit body. Every queue also
    /// gets its [`RemoteWorkers`] (with its settings), so remote workers can share it with the
    /// in-process handlers. Errors: a queue whose handlers or settings are refused.
    pub fn new(
        store: CommandStore,
        queues: &[QueueConfig],
        max_body: usize,
        workers_here: bool,
    ) -> Result<Self, String> {
        let mut map = BTreeMap::new();
        for q in queues {
            store.declare_queue(&q.name).map_err(|e| format!("queue {}: {e}", q.name))?;
            let remote = RemoteWorkers::new(store.clone(), &q.name, q.settings.clone())
                .map_err(|e| format!("queue {}: {e}", q.name))?;
            map.insert(
                q.name.clone(),
                QueueEntry { handlers: q.build_handlers()?, remote: Arc::new(remote), schedules: q.schedules.clone() },
            );
        }
        Ok(Self { inner: Arc::new(ApiInner { store, queues: map, max_body, workers_here }) })
    }

    /// The command store.
    pub fn store(&self) -> &CommandStore {
        &self.inner.store
    }

    /// Configured queue names, sorted.
    pub fn queue_names(&self) -> Vec<String> {
        self.inner.queues.keys().cloned().collect()
    }

    /// True when this process runs the queues' workers.
    pub fn workers_here(&self) -> bool {
        self.inner.workers_here
    }

    /// The largest submit body, in bytes.
    pub fn max_body(&self) -> usize {
        self.inner.max_body
    }

    /// The entry of `queue`, or `404 unknown_queue` naming the configured queues.
    pub fn queue(&self, queue: &str) -> Result<&QueueEntry, ApiError> {
        self.inner.queues.get(queue).ok_or_else(|| {
            ApiError::not_found(
                "unknown_queue",
                format!(
                    "no queue {} on this server; configured queues: {}",
                    echo(queue),
                    self.queue_names().join(", ")
                ),
            )
        })
    }

    /// A quick backend round trip (for `/readyz`).
    pub async fn probe(&self) -> Result<(), String> {
        match self.inner.store.get("__baton_readyz").await {
            Ok(_) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }
}
