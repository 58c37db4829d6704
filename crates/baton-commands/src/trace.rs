//! Tracing spans of the command engine, and the W3C trace context a command carries.
//!
//! The engine opens [`tracing`] spans under the target [`SPAN_TARGET`] (`baton::trace`):
//! `baton.submit` ([`crate::CommandStore::submit`]), `baton.dispatch` (a worker taking a
//! delivery of a command), `baton.execute` / `baton.check_status` (the handler call, inside
//! `baton.dispatch`), `baton.transition` (a state write) and `baton.handoff`. They cost next to
//! nothing when no subscriber is interested in that target (the `baton` program installs none
//! unless `--otlp-endpoint` is given); the program's OpenTelemetry layer exports them.
//!
//! A command keeps the W3C trace context it was submitted under ([`TraceContext`],
//! [`crate::Command::with_trace_context`], stored with its state as `trace`), so that
//! `baton.dispatch` in any process is a child of the submit's span: the program installs a
//! [`Propagation`] that turns a [`TraceContext`] into a span's parent and a span into
//! a [`TraceContext`]. This crate does not depend on OpenTelemetry.

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// The target of every span of the engine (and of `baton-streams`' `baton.stream.append`):
/// `baton::trace`.
pub const SPAN_TARGET: &str = "baton::trace";

/// A W3C trace context (<https://www.w3.org/TR/trace-context/>): the `traceparent` header value
/// (`00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`) and the optional `tracestate`.
/// Stored with a command's state as `{"traceparent":"…","tracestate":"…"}` (`tracestate`
/// absent when there is none).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceContext {
    pub traceparent: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
}

/// Longest `tracestate` kept (the W3C limit of 32 members fits well within it); a longer one is
/// dropped (the `traceparent` is kept).
pub const MAX_TRACESTATE: usize = 512;

impl TraceContext {
    /// A context from header values, `None` when `traceparent` is not of the W3C form: version
    /// `00` exactly 55 characters (another version, except `ff`, at least that long, its first
    /// four fields read), lower-case hex, trace id and parent id not all zeros. A `tracestate` of
    /// more than [`MAX_TRACESTATE`] bytes or with characters outside printable ASCII is dropped.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<TraceContext> {
        let tp = traceparent.trim();
        let b = tp.as_bytes();
        let hex = |s: &[u8]| !s.is_empty() && s.iter().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c));
        if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return None;
        }
        let (version, trace, parent, flags) = (&b[0..2], &b[3..35], &b[36..52], &b[53..55]);
        if !(hex(version) && hex(trace) && hex(parent) && hex(flags)) || version == b"ff" {
            return None;
        }
        if (version == b"00" && b.len() != 55) || (b.len() > 55 && b[55] != b'-') {
            return None;
        }
        if trace.iter().all(|c| *c == b'0') || parent.iter().all(|c| *c == b'0') {
            return None;
        }
        let tracestate = tracestate
            .map(str::trim)
            .filter(|s| !s.is_empty() && s.len() <= MAX_TRACESTATE && s.bytes().all(|c| (0x20..0x7f).contains(&c)))
            .map(str::to_string);
        Some(TraceContext { traceparent: tp[..55].to_string(), tracestate })
    }

    /// The trace id: 32 lower-case hex digits.
    pub fn trace_id(&self) -> &str {
        &self.traceparent[3..35]
    }

    /// The parent (span) id: 16 lower-case hex digits.
    pub fn parent_id(&self) -> &str {
        &self.traceparent[36..52]
    }
}

/// How spans and trace contexts meet: installed once per process by whoever exports the spans
/// ([`set_propagation`]). Both are plain functions so that nothing is allocated when no
/// propagation is installed.
#[derive(Clone, Copy, Debug)]
pub struct Propagation {
    /// Makes the span a child of the context (called right after the span is created, before
    /// anything runs in it).
    pub set_parent: fn(&tracing::Span, &TraceContext),
    /// The context of a span (whether entered or not), `None` when it has none.
    pub context_of: fn(&tracing::Span) -> Option<TraceContext>,
}

static PROPAGATION: OnceLock<Propagation> = OnceLock::new();

/// Installs the process's propagation; `false` when one was already installed (it is kept).
pub fn set_propagation(p: Propagation) -> bool {
    PROPAGATION.set(p).is_ok()
}

/// Whether a propagation is installed (span export is on).
pub fn propagation_installed() -> bool {
    PROPAGATION.get().is_some()
}

/// Makes `span` a child of `cx` when a propagation is installed and the span is enabled.
pub fn set_parent(span: &tracing::Span, cx: Option<&TraceContext>) {
    if let (Some(p), Some(cx)) = (PROPAGATION.get(), cx) {
        if !span.is_disabled() {
            (p.set_parent)(span, cx);
        }
    }
}

/// The current span's context when a propagation is installed, else `None`.
pub fn current() -> Option<TraceContext> {
    PROPAGATION.get().and_then(|p| (p.context_of)(&tracing::Span::current()))
}

/// `span`'s context when a propagation is installed and the span is enabled, else `None`.
pub fn context_of(span: &tracing::Span) -> Option<TraceContext> {
    match PROPAGATION.get() {
        Some(p) if !span.is_disabled() => (p.context_of)(span),
        _ => None,
    }
}

/// The context to send downstream from inside a command's handler: the current span's when span
/// export is on, otherwise the command's own (as submitted, passed through unchanged).
pub fn outgoing(command_trace: Option<&TraceContext>) -> Option<TraceContext> {
    current().or_else(|| command_trace.cloned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_forms() {
        let ok = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = TraceContext::parse(ok, Some("rojo=00f067aa0ba902b7")).unwrap();
        assert_eq!(cx.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(cx.parent_id(), "00f067aa0ba902b7");
        assert_eq!(cx.tracestate.as_deref(), Some("rojo=00f067aa0ba902b7"));
        assert!(TraceContext::parse(ok, Some("")).unwrap().tracestate.is_none());
        for bad in [
            "",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert!(TraceContext::parse(bad, None).is_none(), "{bad}");
        }
        // A later version may append fields: the first four are read.
        let v1 = TraceContext::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-abc", None).unwrap();
        assert_eq!(v1.traceparent, "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    }
}
