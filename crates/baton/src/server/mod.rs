//! Starting and stopping the two processes: `baton serve` ([`Server`]: the HTTP API and, unless
//! `--no-workers`, the workers) and `baton worker` ([`Worker`]: the workers and, with `--listen`,
//! the health API). What they print and when they stop is the command line's. Both serve HTTP
//! through [`listen`]: its connection timeouts, connection limit and accept loop.

pub mod listen;

use std::net::SocketAddr;
use std::sync::Arc;

use baton_streams::{StreamStore, StreamStoreSettings};
use baton_subscriptions::{Subscriptions, SubscriptionsConfig};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::auth::Auth;
use crate::http::{self, AppState, CommandsApi};
use crate::settings::{describe_queues, ServeConfig, Storage, WorkerConfig};
use crate::workers::{self, Workers};

/// A running server.
pub struct Server {
    addr: SocketAddr,
    shutdown: CancellationToken,
    join: JoinHandle<std::io::Result<()>>,
    cfg: Arc<ServeConfig>,
    workers: Option<Workers>,
    commands: baton_commands::CommandStore,
    subscriptions: Subscriptions,
}

impl Server {
    /// Connects the backend, binds the listener and starts serving. Errors: the backend cannot
    /// be reached, or the address cannot be bound.
    pub async fn start(cfg: ServeConfig) -> Result<Server, String> {
        // The command store first: an unreachable Redis is reported by it, once, by name.
        let command_store = workers::command_store(&cfg.backend, &cfg.queues).await?;
        let settings = StreamStoreSettings { default_limits: cfg.default_limits, ..StreamStoreSettings::default() };
        let store = match &cfg.backend {
            Storage::Memory => StreamStore::memory(settings),
            Storage::Redis(rc) => {
                StreamStore::redis(rc.clone(), settings).await.map_err(|e| format!("cannot use {rc}: {e}"))?
            }
        };
        // Commands' output streams live with the other streams (and end with their commands).
        command_store.set_outputs(store.clone()).map_err(|e| e.to_string())?;
        let commands = CommandsApi::new(command_store.clone(), &cfg.queues, cfg.max_command_body, cfg.run_workers)?;
        let auth = Arc::new(Auth::new(cfg.tokens.clone()));
        let listener = listen::bind(cfg.listen, "--listen", "or BATON_LISTEN, or `listen` in the config file").await?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        // After binding: the default public URL names the bound port (also with port 0).
        let public_url = cfg.public_url.clone().unwrap_or_else(|| format!("http://{addr}"));
        let sub_cfg = SubscriptionsConfig {
            base_url: public_url.clone(),
            allow_loopback_webhooks: cfg.allow_loopback_webhooks,
            claim_timeout: cfg.subscription_claim_timeout,
            ..SubscriptionsConfig::default()
        };
        let subscriptions = match &cfg.backend {
            Storage::Memory => Subscriptions::memory(store.clone(), sub_cfg).await,
            Storage::Redis(rc) => {
                let client = baton_redis::RedisClient::new(rc.clone()).map_err(|e| format!("cannot use {rc}: {e}"))?;
                Subscriptions::redis(client, store.clone(), sub_cfg).await
            }
        }
        .map_err(|e| format!("subscriptions: {e}"))?;
        // Webhook delivery is part of the API: it runs in every `baton serve`, --no-workers too.
        subscriptions.start_delivery().await.map_err(|e| format!("subscriptions: {e}"))?;
        let cfg = Arc::new(cfg);
        let shutdown = CancellationToken::new();
        let state = AppState::new(http::Shared {
            store,
            cfg: cfg.clone(),
            live: Arc::new(Semaphore::new(cfg.max_live_readers)),
            shutdown: shutdown.clone(),
            commands,
            auth: auth.clone(),
            subscriptions: subscriptions.clone(),
            public_url,
        });
        let queues = describe_queues(&cfg.queues);
        let default_note = if cfg.queues_defaulted { " (built-in default: no [queues] configured)" } else { "" };
        let workers = if cfg.run_workers && !cfg.queues.is_empty() {
            tracing::info!("command queues{default_note}: {queues}; workers run in this process");
            Some(
                Workers::start(
                    &command_store,
                    &cfg.queues,
                    Some(workers::WebhookDelivery {
                        signer: subscriptions.clone(),
                        allow_loopback: cfg.allow_loopback_webhooks,
                    }),
                )
                .await?,
            )
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
        let limits = listen::Limits::new(&cfg.connections, cfg.max_header_bytes);
        let join = tokio::spawn(listen::serve(listener, app, limits, shutdown.clone()));
        Ok(Server { addr, shutdown, join, cfg, workers, commands: command_store, subscriptions })
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
        let subscriptions = self.subscriptions;
        let drain = async move {
            // Deliveries in flight get the grace; unfinished ones are taken over elsewhere.
            let subs = subscriptions.close(grace);
            let w = async {
                if let Some(w) = workers {
                    w.drain(grace).await;
                }
            };
            tokio::join!(subs, w);
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

/// A running `baton worker`: the configured queues' workers, and the health API when
/// `--listen` was given.
pub struct Worker {
    workers: Workers,
    health: Option<(SocketAddr, JoinHandle<std::io::Result<()>>)>,
    shutdown: CancellationToken,
    grace: std::time::Duration,
}

impl Worker {
    /// Connects the command store, binds the health listener (if any) and starts the workers.
    /// Everything that can fail is done before the first queue's service starts (the command
    /// store, the health API and its listener), so an error never leaves a started service
    /// behind. Errors: the backend cannot be reached, the address cannot be bound, a queue is
    /// refused.
    pub async fn start(cfg: &WorkerConfig) -> Result<Worker, String> {
        let store = workers::command_store(&cfg.backend, &cfg.queues).await?;
        // Every configured queue's webhook, also of queues not worked here (`--queues`): a
        // command homed there that was handed off to a queue worked here ends here.
        crate::webhooks::set_hooks_of(&store, cfg.webhooks.iter().map(|(q, w)| (q.as_str(), Some(w))))?;
        // The terminal writes of this process end commands' output streams too.
        if let Storage::Redis(rc) = &cfg.backend {
            let streams = StreamStore::redis(rc.clone(), StreamStoreSettings::default())
                .await
                .map_err(|e| format!("cannot use {rc}: {e}"))?;
            store.set_outputs(streams).map_err(|e| e.to_string())?;
        }
        let health = match cfg.listen {
            None => None,
            Some(addr) => {
                let api = CommandsApi::new(store.clone(), &cfg.queues, 0, true)?;
                let listener = listen::bind(addr, "--listen", "or BATON_WORKER_LISTEN").await?;
                let addr = listener.local_addr().map_err(|e| e.to_string())?;
                Some((addr, listener, http::ops::worker_router(api)))
            }
        };
        // Completion webhooks are signed with the subscriptions' key set (shared through Redis,
        // published by `baton serve`): only a worker that delivers some needs it.
        // Every configured queue's webhook is delivered here, `--queues` or not (as every
        // configured queue's hook is set above): a queue no worker's `--queues` names (its
        // commands run by HTTP workers, or ended by cancels) would otherwise never be delivered.
        let hooked: Vec<crate::settings::QueueConfig> = cfg
            .webhooks
            .iter()
            .map(|(q, w)| {
                let mut c = crate::settings::QueueConfig::with_builtins(q, &[]);
                c.webhook = Some(w.clone());
                c
            })
            .collect();
        let webhooks = if !hooked.is_empty() {
            let Storage::Redis(rc) = &cfg.backend else {
                return Err("completion webhooks from baton worker need Redis".into());
            };
            let client = baton_redis::RedisClient::new(rc.clone()).map_err(|e| format!("cannot use {rc}: {e}"))?;
            let streams = store.outputs().cloned().ok_or("the worker's streams are not set")?;
            let signer = Subscriptions::redis(client, streams, SubscriptionsConfig::default())
                .await
                .map_err(|e| format!("subscriptions (webhook signing keys): {e}"))?;
            Some(workers::WebhookDelivery { signer, allow_loopback: cfg.allow_loopback_webhooks })
        } else {
            None
        };
        let hooked: Vec<&crate::settings::QueueConfig> = hooked.iter().collect();
        let workers = Workers::start_delivering(&store, &cfg.queues, &hooked, webhooks).await?;
        let default_note = if cfg.queues_defaulted { " (the built-in default: no [queues] configured)" } else { "" };
        // Logged under the target it always had (the line moved here from `workers`).
        tracing::info!(target: "baton::workers", backend = %cfg.backend.describe(), queues = %describe_queues(&cfg.queues), "baton worker: running{default_note}");
        let shutdown = CancellationToken::new();
        let health = health.map(|(addr, listener, app)| {
            // The health API has no header limit of its own: hyper's are set from the default.
            let limits =
                listen::Limits::new(&cfg.connections, crate::settings::ServeConfig::default().max_header_bytes);
            (addr, tokio::spawn(listen::serve(listener, app, limits, shutdown.clone())))
        });
        Ok(Worker { workers, health, shutdown, grace: cfg.shutdown_grace })
    }

    /// Where the health API listens, if anywhere.
    pub fn health_addr(&self) -> Option<SocketAddr> {
        self.health.as_ref().map(|(addr, _)| *addr)
    }

    /// Drains the workers within the shutdown grace (every queue's service is drained, which
    /// also closes it; unfinished commands are taken over elsewhere after `claim_timeout`),
    /// then stops the health API.
    pub async fn shutdown(self) {
        self.workers.drain(self.grace).await;
        self.shutdown.cancel();
        if let Some((_, join)) = self.health {
            let _ = join.await;
        }
    }
}
