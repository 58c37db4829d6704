//! The consumer: a lease thread (`engine.rs`: reads, reclaims, renewals, settlements, on its own
//! OS thread and connections) and handler tasks on the application's runtime, started by the
//! acquirer the moment a delivery is registered. Backend independent: the same code drives the
//! memory and the Redis backends.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use tokio::time::Instant;

use crate::backend::{ConsumerSpec, QueueBackend};
use crate::engine::{self, Control};
use crate::lease::{Job, Shared, Starter};
use crate::{ConsumerCounters, ConsumerOptions, Decision, Delivery, DrainReport, Lease, MessageId};

/// Handles deliveries. Implemented for any `Fn(Delivery) -> impl Future<Output = Decision>`.
///
/// A panic in `handle` is caught and treated as [`Decision::Retry`]. Whatever `handle` does —
/// block its thread, spin the CPU, starve the runtime — the lease of its delivery keeps renewing
/// (it is renewed by the consumer's lease thread, not by the handler's runtime).
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    async fn handle(&self, delivery: Delivery) -> Decision;
}

#[async_trait]
impl<F, Fut> Handler for F
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Decision> + Send + 'static,
{
    async fn handle(&self, delivery: Delivery) -> Decision {
        (self)(delivery).await
    }
}

/// A running consumer of one queue. Stop it with [`Consumer::drain`] or [`Consumer::close`];
/// dropping it stops it like [`Consumer::close`] without waiting (running handlers keep running,
/// unrenewed); [`Consumer::abort`] stops it as if the process died.
pub struct Consumer {
    shared: Arc<Shared>,
    control: Control,
}

impl Consumer {
    pub(crate) async fn start(
        backend: Arc<dyn QueueBackend>,
        queue: &str,
        handler: Arc<dyn Handler>,
        options: ConsumerOptions,
    ) -> Result<Consumer, crate::QueueError> {
        options.validate()?;
        crate::validate_queue_name(queue)?;
        let consumer = format!("{}-{}", options.consumer_prefix, uuid::Uuid::now_v7());
        let spec = ConsumerSpec {
            queue: queue.to_string(),
            consumer,
            claim_timeout: options.claim_timeout,
            heartbeat: options.heartbeat(),
            max_deliveries: options.max_deliveries,
            rate_limit: options.rate_limit,
            rate_limit_per_key: options.rate_limit_per_key,
            max_concurrency: options.max_concurrency,
            concurrency_per_key: options.concurrency_per_key,
        };
        // Handlers run on the runtime that starts the consumer, whichever thread starts them.
        let app = tokio::runtime::Handle::current();
        let start: Starter = Box::new(move |shared, job| start_handler(&app, shared, &handler, job));
        let (shared, control) = engine::start(backend, spec, options, start).await?;
        tracing::info!(queue, consumer = %shared.consumer, "consumer started");
        Ok(Consumer { shared, control })
    }

    /// The state its tasks share (for [`crate::MessageStream::due_hint`]).
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The consumer's name in the group: `<prefix>-<uuid v7>`, unique per incarnation.
    pub fn name(&self) -> &str {
        &self.shared.consumer
    }

    /// The queue consumed.
    pub fn queue(&self) -> &str {
        &self.shared.queue
    }

    /// Counters since start.
    pub fn counters(&self) -> ConsumerCounters {
        self.shared.counters.snapshot()
    }

    /// Ids held with a handler (running, deferred leases unsettled, settlements being applied),
    /// ascending. Short `RetryAfter`s waiting here are not included.
    pub fn in_flight(&self) -> Vec<MessageId> {
        self.shared.in_flight()
    }

    /// Stops acquiring work (the read in flight completes; what it returned runs within the
    /// budget like the work already running, or, with a zero budget, is requeued at the stream's
    /// tail; waiting `RetryAfter`s are handed back due when they would have been), lets
    /// running handlers finish within `budget` while their leases keep renewing, then stops renewing.
    /// When nothing is left in flight it leaves the group and closes its connections before
    /// returning. Work still in flight is reported: its leases are no longer renewed (its
    /// handlers are told through [`Lease::lost`]), what they settle within one `claim_timeout` is
    /// still applied (then the consumer leaves the
    /// group and closes its connections), and otherwise another consumer takes it after
    /// `claim_timeout` (nothing is lost).
    pub async fn drain(self, budget: Duration) -> DrainReport {
        let deadline = Instant::now() + budget;
        let before = self.shared.counters.snapshot();
        if !budget.is_zero() {
            self.shared.requeue_late.store(false, std::sync::atomic::Ordering::Release);
        }
        self.control.stop_acquiring.cancel();
        self.control.acquiring_done.cancelled().await;
        loop {
            let notified = self.shared.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.shared.in_flight().is_empty() {
                break;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                break;
            }
        }
        let after = self.shared.counters.snapshot();
        let in_flight = self.shared.in_flight();
        self.control.finish.cancel();
        if in_flight.is_empty() {
            // Nothing left to settle: the lease thread leaves the group and ends at once.
            self.control.exited.cancelled().await;
        }
        let completed = (after.acked + after.retried + after.dead_lettered + after.rate_limited)
            .saturating_sub(before.acked + before.retried + before.dead_lettered + before.rate_limited)
            as usize;
        if !in_flight.is_empty() {
            tracing::warn!(queue = %self.shared.queue, in_flight = in_flight.len(), "drain budget ran out; leases left to expire");
        }
        DrainReport { completed, in_flight }
    }

    /// [`Consumer::drain`] with no budget.
    pub async fn close(self) -> DrainReport {
        self.drain(Duration::ZERO).await
    }

    /// Stops at once, as if the process died: no more reads, renewals stop, running handler
    /// tasks are aborted, nothing is handed back and the consumer stays in the group. Its
    /// messages are taken by another consumer after `claim_timeout`. Its connections close.
    pub fn abort(self) {
        self.shared.abort_all();
        self.control.stop_acquiring.cancel();
        self.control.kill.cancel();
        // Drop does the rest.
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.control.stop_acquiring.cancel();
        self.control.finish.cancel();
    }
}

/// Spawns the handler task of a registered delivery on `app`; see [`Starter`].
fn start_handler(
    app: &tokio::runtime::Handle,
    shared: &Arc<Shared>,
    handler: &Arc<dyn Handler>,
    job: Job,
) -> tokio::task::AbortHandle {
    let (id, seq) = (job.id, job.seq);
    let lease = Lease::new(shared.clone(), id, seq, job.lost);
    let delivery = Delivery { id, payload: job.payload, deliveries: job.deliveries, lease: lease.clone() };
    let handler = handler.clone();
    let q = shared.queue.clone();
    let task = app.spawn(async move {
        let started = std::time::Instant::now();
        let decision = match std::panic::AssertUnwindSafe(handler.handle(delivery)).catch_unwind().await {
            Ok(d) => d,
            Err(_) => {
                tracing::error!(queue = %q, message_id = %id, "handler panicked; the message will be redelivered");
                Decision::Retry
            }
        };
        metrics::histogram!("baton_queue_handler_seconds", "queue" => q.clone())
            .record(started.elapsed().as_secs_f64());
        lease.settle_detached(decision);
    });
    task.abort_handle()
}
