//! The process's `tracing` subscriber: the log lines on stderr (text or JSON) and, with
//! `--otlp-endpoint`, the export of trace spans over OTLP/HTTP (docs/operations.md, "Tracing").
//!
//! The spans are those of target [`SPAN_TARGET`] (`baton::trace`): `http.request` (every
//! request), `baton.submit`, `baton.dispatch`, `baton.execute` / `baton.check_status`,
//! `baton.transition`, `baton.handoff` and `baton.stream.append` ([`baton_commands::trace`]).
//! Without `--otlp-endpoint` the subscriber is the log layer under one global filter (`BATON_LOG`
//! plus `baton::trace=off`): no OpenTelemetry layer is installed, nothing is interested in those
//! spans, and each span macro is one cached "disabled" check.
//!
//! With an endpoint: an OpenTelemetry layer (tracing-opentelemetry) exports those spans through a
//! batch span processor (its own thread, OTLP/HTTP protobuf POSTs to `<endpoint>/v1/traces`),
//! a W3C trace context propagation is installed for the engine
//! ([`baton_commands::trace::set_propagation`]), and JSON log lines written inside a span carry
//! its `trace_id` and `span_id`. [`Telemetry::shutdown`] flushes what is still batched.

use std::collections::HashMap;
use std::fmt;

use baton_commands::trace::{Propagation, TraceContext, SPAN_TARGET};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::{Event, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{EnvFilter, FilterExt, FilterFn, LevelFilter};
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

use crate::settings::OtlpConfig;

/// How log lines are written on stderr.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines, coloured when `ansi`.
    Text { ansi: bool },
    /// One JSON object per line (`--log-format json`).
    Json,
}

/// The installed subscriber's exporter, if any: keep it until the process ends, then
/// [`Telemetry::shutdown`].
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

type Boxed = Box<dyn Layer<Registry> + Send + Sync>;

/// The log filter: `BATON_LOG` (an `EnvFilter` directive such as `info,baton=debug`), default
/// `info`.
fn env_filter() -> EnvFilter {
    EnvFilter::try_from_env("BATON_LOG").unwrap_or_else(|_| "info".into())
}

/// Whether a callsite is one of the exported spans.
fn is_trace_span(m: &tracing::Metadata<'_>) -> bool {
    m.is_span() && m.target() == SPAN_TARGET
}

/// Only the exported spans (all at `INFO`: the hint keeps the level short-cut of the log filter).
fn trace_spans() -> FilterFn<fn(&tracing::Metadata<'_>) -> bool> {
    FilterFn::new(is_trace_span as fn(&tracing::Metadata<'_>) -> bool).with_max_level_hint(LevelFilter::INFO)
}

/// Everything but the exported spans.
fn not_trace_spans() -> FilterFn<fn(&tracing::Metadata<'_>) -> bool> {
    FilterFn::new((|m| !is_trace_span(m)) as fn(&tracing::Metadata<'_>) -> bool).with_max_level_hint(LevelFilter::TRACE)
}

/// Installs the global subscriber: the log layer in `format` filtered by `BATON_LOG`, and with
/// `otlp` the span export. Call once, first thing (before any span or log line). Errors: the
/// exporter cannot be built (e.g. an endpoint URL the HTTP client refuses); nothing is installed
/// then.
pub fn init(format: LogFormat, otlp: Option<&OtlpConfig>) -> Result<Telemetry, String> {
    let Some(otlp) = otlp else {
        // No OpenTelemetry layer at all: the log subscriber as it always was (one global
        // filter, so its level hint still short-circuits disabled levels), told to take no
        // `baton::trace` span, so nothing is interested in them.
        let filter = env_filter().add_directive(format!("{SPAN_TARGET}=off").parse().expect("a directive"));
        let stderr = std::io::stderr;
        match format {
            LogFormat::Json => tracing_subscriber::fmt().json().with_env_filter(filter).with_writer(stderr).init(),
            LogFormat::Text { ansi } => {
                tracing_subscriber::fmt().with_ansi(ansi).with_env_filter(filter).with_writer(stderr).init()
            }
        }
        return Ok(Telemetry { provider: None });
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(otlp.traces_url.clone())
        .build()
        .map_err(|e| format!("--otlp-endpoint {}: {e}", otlp.traces_url))?;
    let resource = opentelemetry_sdk::Resource::builder().with_service_name(otlp.service_name.clone()).build();
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
    let tracer = provider.tracer("baton");
    let spans: Boxed = tracing_opentelemetry::layer().with_tracer(tracer).with_filter(trace_spans()).boxed();
    let logs: Boxed = match format {
        // The JSON layer sees the spans too (never printing them): it finds the current span's
        // ids for `trace_id` / `span_id`.
        LogFormat::Json => {
            fmt_json().event_format(WithTraceIds(json_format())).with_filter(env_filter().or(trace_spans())).boxed()
        }
        LogFormat::Text { ansi } => fmt_text(ansi).with_filter(env_filter().and(not_trace_spans())).boxed(),
    };
    tracing_subscriber::registry().with(vec![spans, logs]).init();
    baton_commands::trace::set_propagation(Propagation { set_parent, context_of });
    Ok(Telemetry { provider: Some(provider) })
}

fn fmt_text<S>(
    ansi: bool,
) -> tracing_subscriber::fmt::Layer<S, format::DefaultFields, format::Format, fn() -> std::io::Stderr>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(std::io::stderr as fn() -> std::io::Stderr)
}

fn json_format() -> format::Format<format::Json> {
    format::format().json().with_current_span(false).with_span_list(false)
}

fn fmt_json<S>(
) -> tracing_subscriber::fmt::Layer<S, format::JsonFields, format::Format<format::Json>, fn() -> std::io::Stderr>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .json()
        .with_writer(std::io::stderr as fn() -> std::io::Stderr)
        .event_format(json_format())
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports the spans still batched and stops the exporter (waits for the export, bounded by
    /// the exporter's timeout). A no-op without `--otlp-endpoint`.
    pub async fn shutdown(self) {
        if let Some(p) = self.provider {
            let done = tokio::task::spawn_blocking(move || p.shutdown()).await;
            if let Ok(Err(e)) = done {
                eprintln!("baton: exporting the last trace spans failed: {e}");
            }
        }
    }
}

/// A `traceparent` / `tracestate` carrier.
struct Carrier<'a>(&'a mut HashMap<String, String>);

impl Injector for Carrier<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_string(), value);
    }
}

struct ReadCarrier<'a>(&'a TraceContext);

impl Extractor for ReadCarrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" => Some(&self.0.traceparent),
            "tracestate" => self.0.tracestate.as_deref(),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

fn set_parent(span: &tracing::Span, cx: &TraceContext) {
    let parent = TraceContextPropagator::new().extract(&ReadCarrier(cx));
    if parent.span().span_context().is_valid() {
        let _ = span.set_parent(parent);
    }
}

fn context_of(span: &tracing::Span) -> Option<TraceContext> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut map = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut Carrier(&mut map));
    let traceparent = map.remove("traceparent")?;
    Some(TraceContext { traceparent, tracestate: map.remove("tracestate").filter(|s| !s.is_empty()) })
}

/// The JSON event format with `"trace_id"` and `"span_id"` (hex) added to lines written inside
/// an exported span.
struct WithTraceIds<F>(F);

impl<S, N, F> FormatEvent<S, N> for WithTraceIds<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let ids = ctx.lookup_current().and_then(|span| {
            let ext = span.extensions();
            let data = ext.get::<tracing_opentelemetry::OtelData>()?;
            Some((data.trace_id()?, data.span_id()?))
        });
        let Some((trace_id, span_id)) = ids else { return self.0.format_event(ctx, writer, event) };
        let mut line = String::new();
        self.0.format_event(ctx, Writer::new(&mut line), event)?;
        let body = line.trim_end_matches('\n');
        match body.strip_suffix('}') {
            Some(open) => writeln!(writer, "{open},\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\"}}"),
            None => writer.write_str(&line),
        }
    }
}
