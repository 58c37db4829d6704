//! Completion webhooks (`[queues.<name>.webhook]`): the delivery of the messages that the command
//! store enqueues, atomically with each terminal transition of a queue's commands, on its
//! delivery queue ([`CommandStore::hooks`], see [`baton_commands::hooks`] for the body).
//!
//! Every process that runs workers (`baton serve` without `--no-workers`, `baton worker`) runs
//! one consumer of the deliveries of each configured queue with a webhook (also of a queue whose
//! handlers run elsewhere, e.g. HTTP workers, and of queues a `baton worker --queues` does not
//! work). A delivery is a lease of the leased queue: while
//! an attempt is in flight the process renews it, so a process that dies mid-delivery hands it
//! to another process's consumer after the webhook's `claim_timeout`. An attempt POSTs the body (`content-type: application/json`) with
//!
//! * `webhook-id`: the body's `delivery_id` (`<command id>:<version>`), the same in every attempt
//!   (deliveries are at least once: de-duplicate on it);
//! * `webhook-attempt`: this attempt's number, from 1;
//! * `webhook-signature`: `t=<unix seconds>,kid=<key id>,ed25519=<base64url signature of
//!   "<t>.<body>">`, signed with the key set of the Durable Streams subscription webhooks (public
//!   keys at `GET /v1/stream/__ds/jwks.json`, rotated by `POST /v1/subscriptions/signing-keys/rotate`).
//!
//! A 2xx answer acks the delivery. `410 Gone` makes it a dead letter at once. Any other answer,
//! a timeout or a network error is retried after `claim_timeout`; the attempt that fails as the
//! `max_deliveries`th makes it a dead letter (reason: the last failure). Dead letters are the
//! delivery queue's: `GET /v1/queues/{queue}/dead-letters?of=webhook` (and replay, purge) list
//! them.
//!
//! Metrics: `baton_webhook_deliveries_total{queue,result}` with `result` = `delivered`,
//! `failed` (an attempt to be retried) or `dead_lettered`.

use std::time::Duration;

use baton_commands::CommandStore;
use baton_queue::{Consumer, ConsumerOptions, Decision, Delivery};
use baton_subscriptions::Subscriptions;

use crate::settings::{QueueConfig, WebhookConfig};

/// Sets every queue's completion hook on `store` (each process writing a queue's commands
/// enqueues its deliveries). Errors name the queue.
pub fn set_hooks(store: &CommandStore, queues: &[QueueConfig]) -> Result<(), String> {
    set_hooks_of(store, queues.iter().map(|q| (q.name.as_str(), q.webhook.as_ref())))
}

/// [`set_hooks`] from (queue, its webhook if any) pairs.
pub fn set_hooks_of<'a>(
    store: &CommandStore,
    queues: impl IntoIterator<Item = (&'a str, Option<&'a WebhookConfig>)>,
) -> Result<(), String> {
    for (name, w) in queues {
        let hook = w.map(|w| baton_commands::CompletionHook { statuses: w.statuses.clone() });
        store.set_hook(name, hook).map_err(|e| format!("queue {name}: {e}"))?;
    }
    Ok(())
}

/// The running delivery consumers of a process.
pub struct Deliveries {
    consumers: Vec<Consumer>,
}

impl Deliveries {
    /// Starts one delivery consumer per queue of `queues` with a webhook, signing with `signer`.
    /// `allow_loopback`: loopback webhook URLs (and `http` to them) are allowed. Errors: a URL
    /// refused by the address rules, or the backend's error, named by queue.
    pub async fn start(
        store: &CommandStore,
        queues: &[&QueueConfig],
        signer: Subscriptions,
        allow_loopback: bool,
    ) -> Result<Deliveries, String> {
        let mut consumers = Vec::new();
        for q in queues {
            let Some(w) = &q.webhook else { continue };
            if let Err(e) = baton_subscriptions::check_url(&w.url, allow_loopback) {
                futures::future::join_all(consumers.into_iter().map(|c: Consumer| c.close())).await;
                return Err(format!("queues.{}.webhook.url: {e}", q.name));
            }
            let handler = Deliver {
                queue: q.name.clone(),
                cfg: w.clone(),
                http: baton_subscriptions::webhook_client(allow_loopback, w.timeout),
                signer: signer.clone(),
            };
            let defaults = ConsumerOptions::new();
            let opts = ConsumerOptions::new()
                .with_claim_timeout(w.claim_timeout)
                // An attempt takes at most `timeout` (then the outcome's settle): a longer one is
                // not "processing too long". The queue's defaults (15 min; a heartbeat of a third
                // of the claim timeout must stay under it) would refuse a claim timeout of 45 min
                // and count a 20 min attempt as an expired lease.
                .with_max_processing_time(defaults.max_processing_time.max(w.timeout.saturating_add(w.claim_timeout)))
                // At least twice the claim timeout (the queue's rule), as for command queues.
                .with_reap_idle_consumers_after(
                    defaults.reap_idle_consumers_after.map(|r| r.max(w.claim_timeout.saturating_mul(2))),
                )
                // The handler dead-letters the attempt that fails as the last one, with its
                // reason; the queue's own limit (one more) catches deliveries whose process died
                // every time.
                .with_max_deliveries(Some(w.max_deliveries + 1))
                .with_consumer_prefix("webhooks");
            let hooks = match store.hooks().await {
                Ok(h) => h,
                Err(e) => {
                    futures::future::join_all(consumers.into_iter().map(|c| c.close())).await;
                    return Err(format!("queue {} (webhook deliveries): {e}", q.name));
                }
            };
            match hooks.consume(&q.name, handler, opts).await {
                Ok(c) => consumers.push(c),
                Err(e) => {
                    futures::future::join_all(consumers.into_iter().map(|c| c.close())).await;
                    return Err(format!("queue {} (webhook deliveries): {e}", q.name));
                }
            }
        }
        Ok(Deliveries { consumers })
    }

    /// Stops at once, as if the process died: attempts in flight are abandoned unsettled and
    /// taken over by another process's consumer after the webhook's `claim_timeout`.
    pub fn abort(self) {
        for c in self.consumers {
            c.abort();
        }
    }

    /// Stops taking deliveries and lets attempts in flight end within `budget`; unfinished ones
    /// are taken over elsewhere after the webhook's `claim_timeout`.
    pub async fn drain(self, budget: Duration) {
        futures::future::join_all(self.consumers.into_iter().map(|c| c.drain(budget))).await;
    }
}

struct Deliver {
    queue: String,
    cfg: WebhookConfig,
    http: reqwest::Client,
    signer: Subscriptions,
}

/// The outcome of one attempt.
enum Attempt {
    Delivered,
    Gone(String),
    Failed(String),
}

impl Deliver {
    async fn attempt(&self, body: &[u8], delivery_id: &str, attempt: u32) -> Attempt {
        let mut req = self
            .http
            .post(&self.cfg.url)
            .header("content-type", "application/json")
            .header("webhook-id", delivery_id)
            .header("webhook-attempt", attempt.to_string())
            .body(body.to_vec());
        if let Some(sig) = self.signer.sign(body) {
            req = req.header("webhook-signature", sig);
        }
        match req.send().await {
            Ok(resp) if resp.status().is_success() => Attempt::Delivered,
            Ok(resp) if resp.status() == reqwest::StatusCode::GONE => {
                Attempt::Gone("the webhook answered 410 Gone".into())
            }
            Ok(resp) => Attempt::Failed(format!("the webhook answered {}", resp.status())),
            Err(e) => {
                // The whole cause chain: reqwest's own text does not say "connection refused".
                let mut why = e.to_string();
                let mut src = std::error::Error::source(&e);
                while let Some(c) = src {
                    why.push_str(": ");
                    why.push_str(&c.to_string());
                    src = c.source();
                }
                Attempt::Failed(why)
            }
        }
    }

    fn count(&self, result: &'static str) {
        metrics::counter!("baton_webhook_deliveries_total", "queue" => self.queue.clone(), "result" => result)
            .increment(1);
    }
}

#[async_trait::async_trait]
impl baton_queue::Handler for Deliver {
    async fn handle(&self, d: Delivery) -> Decision {
        #[derive(serde::Deserialize)]
        struct Head {
            delivery_id: String,
        }
        let Ok(head) = serde_json::from_slice::<Head>(&d.payload) else {
            self.count("dead_lettered");
            return Decision::DeadLetter("not a completion webhook body".into());
        };
        match self.attempt(&d.payload, &head.delivery_id, d.deliveries).await {
            Attempt::Delivered => {
                self.count("delivered");
                Decision::Ack
            }
            Attempt::Gone(why) => {
                tracing::warn!(queue = %self.queue, delivery = %head.delivery_id, url = %self.cfg.url, "{why}; the delivery is a dead letter");
                self.count("dead_lettered");
                Decision::DeadLetter(why)
            }
            Attempt::Failed(why) if d.deliveries >= self.cfg.max_deliveries => {
                tracing::warn!(queue = %self.queue, delivery = %head.delivery_id, url = %self.cfg.url, attempts = d.deliveries, error = %why, "webhook delivery failed for the last time; it is a dead letter");
                self.count("dead_lettered");
                Decision::DeadLetter(format!("{why} (attempt {} of {})", d.deliveries, self.cfg.max_deliveries))
            }
            Attempt::Failed(why) => {
                tracing::warn!(queue = %self.queue, delivery = %head.delivery_id, url = %self.cfg.url, attempt = d.deliveries, error = %why, "webhook delivery failed; retried after claim_timeout");
                self.count("failed");
                Decision::Retry
            }
        }
    }
}
