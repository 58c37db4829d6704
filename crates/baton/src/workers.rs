//! The workers of the configured command queues: one command service per queue, running its
//! built-in handlers, on the command store of the backend.
//!
//! Every handler is wrapped to record `baton_command_handler_seconds{queue,type,call}`
//! (histogram; `call` = `execute` or `check_status`) and
//! `baton_command_outcomes_total{queue,type,outcome}` (`outcome` = `succeeded`, `failed`,
//! `cancelled`, `running`, `handed_off` or `error`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use baton_commands::{
    Command, CommandError, CommandHandler, CommandResult, CommandService, CommandState, CommandStore,
    CommandStoreSettings, HandlerError,
};
use baton_queue::QueueError;

use crate::settings::{QueueConfig, Storage};

/// The command store of a backend (the same Redis as the streams, or a new in-memory store),
/// writing each of `queues` with its event feed settings (`events = { … }`) and its states'
/// lifetimes (`state_ttl`, `retention`).
/// Errors: Redis cannot be reached (`cannot connect to Redis at redis://…: <why>`), a bad URL,
/// or another Redis failure (`cannot use Redis redis://…: <error>`); a refused feed setting
/// (`queue <name>: …`).
pub async fn command_store(backend: &Storage, queues: &[QueueConfig]) -> Result<CommandStore, String> {
    let settings = CommandStoreSettings {
        lifetimes: queues.iter().filter_map(|q| Some((q.name.clone(), q.lifetimes?))).collect(),
        ..CommandStoreSettings::default()
    };
    let store = connect(backend, settings).await?;
    for q in queues {
        store.set_feed(&q.name, q.feed).map_err(|e| format!("queue {}: {e}", q.name))?;
    }
    crate::webhooks::set_hooks(&store, queues)?;
    Ok(store)
}

async fn connect(backend: &Storage, settings: CommandStoreSettings) -> Result<CommandStore, String> {
    match backend {
        Storage::Memory => CommandStore::memory_with(settings).map_err(|e| e.to_string()),
        Storage::Redis(rc) => {
            // A connect error names the Redis it could not reach: said once, not prefixed again.
            let client = baton_redis::RedisClient::new(rc.clone()).map_err(|e| e.to_string())?;
            let options = baton_commands::RedisCommandStoreOptions { settings, ..Default::default() };
            CommandStore::redis(client, options).await.map_err(|e| match e {
                CommandError::Connect(c) | CommandError::Queue(QueueError::Connect(c)) => c.to_string(),
                other => format!("cannot use {rc}: {other}"),
            })
        }
    }
}

/// The running command services of a process, one per queue, and the completion webhook
/// deliveries of those queues ([`crate::webhooks`]).
pub struct Workers {
    services: Vec<CommandService>,
    deliveries: Option<crate::webhooks::Deliveries>,
    /// The per-minute depth samplers of the queues without handlers here (a service samples its
    /// own queue).
    samplers: Vec<baton_commands::minutes::MinuteSampler>,
    /// The cron schedulers, one per queue with schedules.
    schedulers: Vec<baton_commands::schedules::Scheduler>,
}

/// How a process delivers completion webhooks: the signer (the subscriptions' key set) and
/// whether loopback URLs are allowed.
#[derive(Clone)]
pub struct WebhookDelivery {
    pub signer: baton_subscriptions::Subscriptions,
    pub allow_loopback: bool,
}

impl Workers {
    /// Starts one command service per queue on `store`, each with its configured handlers
    /// (wrapped for metrics). A queue without handlers gets none: its commands are run by workers
    /// elsewhere (an application embedding `baton-commands`, HTTP workers), so this process
    /// takes none of them (it would fail each for want of a handler); it is declared, so
    /// hand-offs to it are accepted, and its depth is sampled for its per-minute records
    /// (`baton_commands::minutes`) as a service's would be. Every queue's settings and handlers are checked before the first
    /// service starts; should a later start still fail (Redis), the services already started are
    /// closed before the error is returned.
    ///
    /// Errors: a refused setting or handler, or the backend's error, named by queue
    /// (`queue <name>: …`).
    ///
    /// Every queue of `queues` with a webhook (handlers here or not: HTTP workers may run its
    /// commands through this process) gets its delivery consumer too, signing with `webhooks`
    /// (an error when it is `None`).
    pub async fn start(
        store: &CommandStore,
        queues: &[QueueConfig],
        webhooks: Option<WebhookDelivery>,
    ) -> Result<Workers, String> {
        // Every queue with a webhook, also one without handlers here (its commands may be run by
        // HTTP workers through this process, or end by a cancel): its deliveries are sent here.
        let hooked: Vec<&QueueConfig> = queues.iter().filter(|q| q.webhook.is_some()).collect();
        Self::start_delivering(store, queues, &hooked, webhooks).await
    }

    /// [`Workers::start`] sending the completion webhook deliveries of `hooked` (each with a
    /// webhook; its other fields are not used), which may name queues not worked here: a
    /// `baton worker --queues` delivers every configured queue's webhook, so a queue that no
    /// worker's `--queues` names (one whose commands HTTP workers run, or that end by cancels)
    /// still has its deliveries sent.
    pub async fn start_delivering(
        store: &CommandStore,
        queues: &[QueueConfig],
        hooked: &[&QueueConfig],
        webhooks: Option<WebhookDelivery>,
    ) -> Result<Workers, String> {
        let deliver = match (hooked.first(), webhooks) {
            (None, _) => None,
            (Some(_), Some(w)) => Some(w),
            (Some(q), None) => return Err(format!("queue {}: webhook deliveries need a signer here", q.name)),
        };
        let mut builders = Vec::new();
        let mut samplers = Vec::new();
        for q in queues {
            q.settings.validate().map_err(|e| format!("queue {}: {e}", q.name))?;
            if q.handlers.is_empty() {
                store.declare_queue(&q.name).map_err(|e| format!("queue {}: {e}", q.name))?;
                samplers.push(store.minute_sampler(&q.name).map_err(|e| format!("queue {}: {e}", q.name))?);
                continue;
            }
            let mut b = CommandService::builder(store.clone(), q.name.clone()).settings(q.settings.clone());
            for (t, h) in q.build_handlers()? {
                let metered = Metered { inner: h, queue: q.name.clone(), command_type: t.clone() };
                b = b.handler(t, metered);
            }
            builders.push((q.name.as_str(), b));
        }
        let mut services = Vec::new();
        for (name, b) in builders {
            match b.start().await {
                Ok(s) => services.push(s),
                Err(e) => {
                    futures::future::join_all(services.iter().map(|s| s.close())).await;
                    return Err(format!("queue {name}: {e}"));
                }
            }
        }
        let deliveries = match deliver {
            None => None,
            Some(w) => match crate::webhooks::Deliveries::start(store, hooked, w.signer, w.allow_loopback).await {
                Ok(d) => Some(d),
                Err(e) => {
                    for s in &samplers {
                        s.stop();
                    }
                    futures::future::join_all(services.iter().map(|s| s.close())).await;
                    return Err(e);
                }
            },
        };
        let schedulers = queues
            .iter()
            .filter(|q| !q.schedules.is_empty())
            .map(|q| {
                let observe: baton_commands::schedules::FireObserver = std::sync::Arc::new(record_fire);
                baton_commands::schedules::Scheduler::start(
                    store.clone(),
                    q.name.clone(),
                    q.schedules.clone(),
                    Some(observe),
                )
            })
            .collect();
        Ok(Workers { services, deliveries, samplers, schedulers })
    }

    /// Names of the queues being worked.
    pub fn queues(&self) -> Vec<String> {
        self.services.iter().map(|s| s.queue().to_string()).collect()
    }

    /// Stops taking work and lets running handlers finish within `budget` (shared by all
    /// queues); unfinished commands are taken over by another worker after `claim_timeout`.
    pub async fn drain(self, budget: Duration) {
        for s in &self.samplers {
            s.stop();
        }
        // No new fires while draining (another process fires the next due times).
        futures::future::join_all(self.schedulers.into_iter().map(|s| s.stop())).await;
        let hooks = async {
            if let Some(d) = self.deliveries {
                d.drain(budget).await;
            }
        };
        let drains = futures::future::join_all(self.services.iter().map(|s| s.drain(budget)));
        let (reports, ()) = tokio::join!(drains, hooks);
        for (s, report) in self.services.iter().zip(reports) {
            if !report.in_flight.is_empty() {
                tracing::warn!(
                    queue = s.queue(),
                    in_flight = report.in_flight.len(),
                    "handlers still running at shutdown; their commands will be taken over after claim_timeout"
                );
            }
        }
    }
}

/// Counts one cron schedule decision (module docs).
fn record_fire(e: &baton_commands::schedules::FireEvent) {
    metrics::counter!("baton_schedule_fires_total", "queue" => e.queue.clone(), "schedule" => e.schedule.clone(), "result" => e.result.as_str())
        .increment(e.count);
}

/// A handler wrapper that records durations and outcomes (module docs).
struct Metered {
    inner: Arc<dyn CommandHandler>,
    queue: String,
    command_type: String,
}

impl Metered {
    fn record(&self, call: &'static str, started: Instant, r: &Result<CommandResult, HandlerError>) {
        metrics::histogram!("baton_command_handler_seconds", "queue" => self.queue.clone(), "type" => self.command_type.clone(), "call" => call)
            .record(started.elapsed().as_secs_f64());
        let outcome = match r {
            Ok(CommandResult::Succeeded(_)) => "succeeded",
            Ok(CommandResult::Failed(_)) => "failed",
            Ok(CommandResult::Cancelled) => "cancelled",
            Ok(CommandResult::Running { .. }) => "running",
            Ok(CommandResult::HandedOff { .. }) => "handed_off",
            Ok(CommandResult::RateLimited { .. }) => "rate_limited",
            Err(_) => "error",
        };
        metrics::counter!("baton_command_outcomes_total", "queue" => self.queue.clone(), "type" => self.command_type.clone(), "outcome" => outcome)
            .increment(1);
    }
}

#[async_trait]
impl CommandHandler for Metered {
    async fn execute(&self, command: Command) -> Result<CommandResult, HandlerError> {
        let t = Instant::now();
        let r = self.inner.execute(command).await;
        self.record("execute", t, &r);
        r
    }

    async fn check_status(&self, command: Command, state: CommandState) -> Result<CommandResult, HandlerError> {
        let t = Instant::now();
        let r = self.inner.check_status(command, state).await;
        self.record("check_status", t, &r);
        r
    }

    fn validate(&self, params: &baton_commands::RawJson) -> Result<(), String> {
        self.inner.validate(params)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::settings::queues::{resolve_queues, QueueFile};

    fn parse(text: &str) -> Result<Vec<QueueConfig>, String> {
        #[derive(serde::Deserialize)]
        struct F {
            queues: BTreeMap<String, QueueFile>,
        }
        let f: F = toml::from_str(text).map_err(|e| e.to_string())?;
        resolve_queues(f.queues)
    }

    #[tokio::test]
    async fn reap_idle_consumers_after_is_checked_again_at_start() {
        let mut q = parse("[queues.a]\nclaim_timeout = \"1s\"\nreap_idle_consumers_after = \"2s\"\n").unwrap();
        q[0].settings.claim_timeout = Duration::from_millis(1500);
        let e = Workers::start(&CommandStore::memory(), &q, None).await.err().expect("refused");
        assert_eq!(
            e,
            "queue a: invalid setting: reap_idle_consumers_after (2s) must be at least twice claim_timeout (1.5s), or \
             None to never remove idle consumers"
        );
    }

    /// A queue without handlers gets no service here (its workers run elsewhere): its commands
    /// stay SUBMITTED for them instead of failing for want of a handler.
    #[tokio::test]
    async fn a_queue_without_handlers_is_not_worked_here() {
        let q = parse("[queues.a]\nretention = \"1h\"\n[queues.b.handlers]\ne = \"echo\"\n").unwrap();
        let store = CommandStore::memory();
        let w = Workers::start(&store, &q, None).await.unwrap();
        assert_eq!(w.queues(), ["b"]);
        assert!(store.knows_queue("a"), "declared: hand-offs to it are accepted");
        let st = store.submit("a", Command::with_id("x", "sleep", serde_json::json!({"ms": 1}))).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(store.get(&st.id).await.unwrap().unwrap().status, baton_commands::CommandStatus::Submitted);
        w.drain(Duration::from_secs(1)).await;
    }

    /// A refused queue is found before any service starts: the queues before it (in name order)
    /// never join their groups.
    #[tokio::test]
    async fn a_refused_queue_starts_no_other_queue() {
        let q = parse("[queues.a.handlers]\ne = \"echo\"\n[queues.b]\nconcurrency = 0\n").unwrap();
        let store = CommandStore::memory();
        let e = Workers::start(&store, &q, None).await.err().expect("refused");
        assert!(e.starts_with("queue b: ") && e.contains("concurrency"), "{e}");
        assert_eq!(store.messages().stats("a").await.unwrap().consumers, 0);
    }

    #[tokio::test]
    async fn out_of_range_settings_are_refused_at_start() {
        let mut q = parse("[queues.a]\nconcurrency = 0\n[queues.a.handlers]\ne = \"echo\"\n").unwrap();
        let e = Workers::start(&CommandStore::memory(), &q, None).await.err().expect("refused");
        assert!(e.starts_with("queue a: ") && e.contains("concurrency"), "{e}");
        q[0].settings.concurrency = 1;
        q[0].settings.retry.backoff_factor = 0.5;
        let e = Workers::start(&CommandStore::memory(), &q, None).await.err().expect("refused");
        assert_eq!(e, "queue a: invalid setting: retry.backoff_factor must be at least 1.0 (got 0.5)");
        q[0].settings.retry.backoff_factor = 2.0;
        let w = Workers::start(&CommandStore::memory(), &q, None).await.unwrap();
        assert_eq!(w.queues(), ["a"]);
        w.drain(Duration::from_secs(1)).await;
    }
}
