//! `/healthz`, `/readyz` and `/metrics`, for `baton serve` and for `baton worker --listen`
//! ([`worker_router`]), one implementation for both; the sampled queue gauges and the
//! process-wide Prometheus recorder.

use std::sync::OnceLock;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use baton_streams::{StreamError, StreamPath, StreamStore};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::sync::Semaphore;

use super::errors::ApiError;
use super::state::{AppState, CommandsApi};

/// How long `/readyz` waits for each backend.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// The process-wide Prometheus recorder (installed once; later servers in the same process share it).
/// Histograms are exported with these buckets (seconds).
pub fn prometheus() -> Option<&'static PrometheusHandle> {
    const BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| PrometheusBuilder::new().set_buckets(BUCKETS).and_then(|b| b.install_recorder()).ok())
        .as_ref()
}

/// `GET /healthz`: the process is up.
pub async fn healthz() -> &'static str {
    "ok\n"
}

/// 200 `ready` when the backends answer (the stream store, when there is one, then the command
/// store) within 3 s each; else `503 not_ready` (JSON, `Retry-After: 1`) naming the first that
/// does not.
async fn ready(streams: Option<&StreamStore>, commands: &CommandsApi) -> Response {
    let not_ready = |what: String| {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "not_ready", format!("{what}; /readyz answers 200 once it does"))
            .with_header(header::RETRY_AFTER, 1)
            .into_response()
    };
    if let Some(store) = streams {
        let probe = StreamPath::new("__baton/readyz").expect("valid probe path");
        match tokio::time::timeout(PROBE_TIMEOUT, store.head(&probe)).await {
            Ok(Ok(_)) | Ok(Err(StreamError::NotFound { .. })) | Ok(Err(StreamError::Gone { .. })) => {}
            Ok(Err(e)) => return not_ready(format!("the stream store is not reachable ({e})")),
            Err(_) => return not_ready("the stream store did not answer within 3s".into()),
        }
    }
    match tokio::time::timeout(PROBE_TIMEOUT, commands.probe()).await {
        Ok(Ok(())) => "ready\n".into_response(),
        Ok(Err(e)) => not_ready(format!("the command store is not reachable ({e})")),
        Err(_) => not_ready("the command store did not answer within 3s".into()),
    }
}

/// The Prometheus text, after sampling the queue gauges (and `baton_live_readers`, the taken
/// slots of `live`: its semaphore and number of slots).
async fn metrics_text(commands: &CommandsApi, live: Option<(&Semaphore, usize)>) -> Response {
    sample_metrics(commands).await;
    if let Some((slots, max)) = live {
        metrics::gauge!("baton_live_readers").set((max - slots.available_permits()) as f64);
    }
    match prometheus() {
        Some(h) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], h.render()).into_response(),
        None => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "metrics_unavailable",
            "the metrics recorder could not be installed (another one was installed in this process first)",
        )
        .into_response(),
    }
}

/// `GET /readyz` of `baton serve`.
pub async fn readyz(State(st): State<AppState>) -> Response {
    ready(Some(&st.store), &st.commands).await
}

/// `GET /metrics` of `baton serve` (with `baton_live_readers`).
pub async fn metrics(State(st): State<AppState>) -> Response {
    metrics_text(&st.commands, Some((&st.live, st.cfg.max_live_readers))).await
}

/// The HTTP face of `baton worker --listen`: `/healthz`, `/readyz` (the command store answers
/// within 3 s) and `/metrics` (with the sampled queue gauges).
pub fn worker_router(api: CommandsApi) -> Router {
    let _ = prometheus();
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(|State(api): State<CommandsApi>| async move { ready(None, &api).await }))
        .route("/metrics", get(|State(api): State<CommandsApi>| async move { metrics_text(&api, None).await }))
        .with_state(api)
}

/// Sets the sampled queue gauges (for each configured queue, at most 2 s in all):
/// `baton_queue_length`, `baton_queue_pending`, `baton_queue_consumers`, `baton_queue_lag`,
/// `baton_queue_delayed`, `baton_queue_dead_letter_entries`, `baton_queue_paused` (1 paused, 0
/// running) (label `queue`) and
/// `baton_commands{queue,status}` (status lower case), `baton_commands_scheduled{queue}` (the
/// SUBMITTED commands still waiting for their due time). A failed sample counts
/// `baton_queue_sample_failures_total` and leaves the previous values.
async fn sample_metrics(api: &CommandsApi) {
    let work = async {
        for q in api.queue_names() {
            let stats = api.store().messages().stats(&q).await;
            let counts = api.store().counts(&q).await;
            let sched = api.store().scheduled(&q).await;
            match (stats, counts, sched) {
                (Ok(s), Ok(c), Ok(sc)) => {
                    let g = |name: &'static str, v: u64| metrics::gauge!(name, "queue" => q.clone()).set(v as f64);
                    g("baton_queue_length", s.length);
                    g("baton_queue_pending", s.pending);
                    g("baton_queue_consumers", s.consumers);
                    g("baton_queue_dead_consumers", s.dead_consumers);
                    g("baton_queue_lag", s.lag);
                    g("baton_queue_delayed", s.delayed);
                    g("baton_queue_key_waiting", s.key_waiting);
                    g("baton_queue_dead_letter_entries", s.dead_letters);
                    g("baton_queue_paused", u64::from(s.paused));
                    g("baton_commands_scheduled", sc.scheduled);
                    for (status, v) in [
                        ("submitted", c.submitted),
                        ("running", c.running),
                        ("succeeded", c.succeeded),
                        ("failed", c.failed),
                        ("cancelled", c.cancelled),
                    ] {
                        metrics::gauge!("baton_commands", "queue" => q.clone(), "status" => status).set(v as f64);
                    }
                }
                _ => metrics::counter!("baton_queue_sample_failures_total", "queue" => q.clone()).increment(1),
            }
        }
    };
    if tokio::time::timeout(Duration::from_secs(2), work).await.is_err() {
        metrics::counter!("baton_queue_sample_failures_total", "queue" => "*").increment(1);
    }
}
