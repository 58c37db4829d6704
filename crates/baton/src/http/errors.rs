//! The one error response of the HTTP API: a status, the headers the protocol asks for, and a
//! JSON body `{"error": "<code>", "message": "<what to fix>"}` (a refused cancel adds `"state"`),
//! the same shape on every route. The engines' errors map to it here.
//!
//! A value of the request quoted in a message goes through [`echo`] (or [`cut`]): at most
//! [`ECHO_MAX`] characters of it are repeated, then `…` and its size, so a 100,000-character id
//! is not sent back whole. As a last guard, a message longer than [`MESSAGE_MAX`] bytes is cut.

use std::borrow::Cow;

use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use baton_commands::CommandError;
use baton_queue::QueueError;
use baton_streams::StreamError;
use serde_json::value::RawValue;
use serde_json::Value;

use super::names as h;

/// The most characters of a request's value that an error message repeats.
pub const ECHO_MAX: usize = 100;

/// The longest message, in bytes (longer ones are cut, with `…`).
pub const MESSAGE_MAX: usize = 2000;

/// `value` for an error message, unquoted: whole up to [`ECHO_MAX`] characters, else its first
/// [`ECHO_MAX`] characters, `…` and its size (`abc… (100000 bytes)`).
pub fn cut(value: &str) -> Cow<'_, str> {
    match value.char_indices().nth(ECHO_MAX) {
        None => Cow::Borrowed(value),
        Some((at, _)) => Cow::Owned(format!("{}… ({} bytes)", &value[..at], value.len())),
    }
}

/// `value` for an error message, quoted as Rust's `{:?}` quotes it, cut as [`cut`] does:
/// `"abc"`, or `"abc"… (100000 bytes)`.
pub fn echo(value: &str) -> String {
    match value.char_indices().nth(ECHO_MAX) {
        None => format!("{value:?}"),
        Some((at, _)) => format!("{:?}… ({} bytes)", &value[..at], value.len()),
    }
}

/// `message` (made elsewhere, e.g. an engine's error text) with each long `value` in it cut: its
/// quoted form as [`echo`], its bare form as [`cut`].
pub fn cut_values(message: String, values: &[&str]) -> String {
    let mut message = message;
    for v in values.iter().filter(|v| v.chars().nth(ECHO_MAX).is_some()) {
        message = message.replace(&format!("{v:?}"), &echo(v)).replace(*v, &cut(v));
    }
    message
}

/// An HTTP error response.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// More fields of the body, after `error` and `message`, as JSON text (so that a command
    /// state in a body keeps its params and result exactly as stored).
    pub extra: Vec<(String, Box<RawValue>)>,
    pub headers: HeaderMap,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), extra: Vec::new(), headers: HeaderMap::new() }
    }

    /// `400 bad_request` (the protocol's malformed requests).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::invalid("bad_request", message)
    }

    /// `400` with its own code.
    pub fn invalid(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }

    /// `403 forbidden`.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    /// `503 backend_unavailable` with `Retry-After: 1`.
    pub fn unavailable(message: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "backend_unavailable",
            format!("the backend did not answer ({message}); retry later"),
        )
        .with_header(header::RETRY_AFTER, 1)
    }

    /// Adds a header (skipped when `value` is not valid header text).
    pub fn with_header(mut self, name: HeaderName, value: impl ToString) -> Self {
        if let Ok(v) = HeaderValue::from_str(&value.to_string()) {
            self.headers.insert(name, v);
        }
        self
    }

    /// Adds a field to the body.
    pub fn with_field(self, name: &str, value: Value) -> Self {
        self.with_serialized_field(name, &value)
    }

    /// [`ApiError::with_field`] for any serializable value, written as it serializes (a
    /// [`CommandState`](baton_commands::CommandState) keeps its params and result exactly).
    pub fn with_serialized_field<T: serde::Serialize + ?Sized>(mut self, name: &str, value: &T) -> Self {
        let raw = serde_json::value::to_raw_value(value)
            .unwrap_or_else(|_| RawValue::from_string("null".into()).expect("null is JSON"));
        self.extra.retain(|(n, _)| n != name);
        self.extra.push((name.to_string(), raw));
        self
    }
}

impl ApiError {
    /// The body's JSON text: `{"error": code, "message": text}` (the message cut past
    /// [`MESSAGE_MAX`]) then the extra fields in order, each as its JSON text; with `status`,
    /// `"status": <the HTTP status>` comes first. The item of a batch answer
    /// ([`ApiError::item_json`]) is this object with its status.
    fn body_text(&self, status: bool) -> String {
        let mut message = self.message.clone();
        if message.len() > MESSAGE_MAX {
            let mut at = MESSAGE_MAX;
            while !message.is_char_boundary(at) {
                at -= 1;
            }
            message.truncate(at);
            message.push('…');
        }
        let quote = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
        let mut text = String::from("{");
        if status {
            text.push_str(&format!("\"status\":{},", self.status.as_u16()));
        }
        text.push_str(&format!("\"error\":{},\"message\":{}", quote(self.code), quote(&message)));
        for (name, raw) in &self.extra {
            text.push(',');
            text.push_str(&quote(name));
            text.push(':');
            text.push_str(raw.get());
        }
        text.push('}');
        text
    }

    /// This error as one item of a batch answer (`POST /v1/queues/{queue}/commands/batch`):
    /// `{"status": <the status it would answer alone>, "error": code, "message": text, …extra
    /// fields}`, as JSON text. Its headers are not carried.
    pub fn item_json(&self) -> String {
        self.body_text(true)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, code = self.code, message = %self.message, "request failed");
        } else {
            tracing::debug!(status = %self.status, code = self.code, message = %self.message, "request refused");
        }
        let text = self.body_text(false);
        let res = ([(header::CONTENT_TYPE, "application/json")], text).into_response();
        let mut res = (self.status, res).into_response();
        res.headers_mut().extend(self.headers);
        res
    }
}

impl From<StreamError> for ApiError {
    fn from(e: StreamError) -> Self {
        use StreamError::*;
        let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let (code, message) = match &e {
            NotFound { path } => ("not_found", cut_values(format!("{e}; create it with PUT first"), &[path.as_str()])),
            Gone { path } => ("gone", cut_values(e.to_string(), &[path.as_str()])),
            OffsetGone { earliest, .. } => ("offset_gone", format!("{e}; read from offset=-1 or from {earliest}")),
            OffsetIncarnation { .. } => (
                "offset_incarnation",
                format!("{e}; its offsets do not apply to the new stream: read it from offset=-1"),
            ),
            MalformedOffset { input } => (
                "malformed_offset",
                cut_values(
                    format!("{e}; use -1, now, or a Stream-Next-Offset value returned by this server"),
                    &[input],
                ),
            ),
            OffsetAhead { .. } => ("offset_ahead", format!("{e}; use an offset returned by this server")),
            InvalidRequest { .. } => ("invalid_request", e.to_string()),
            InvalidJson { .. } => ("invalid_json", format!("{e}; the stream is application/json, send valid JSON")),
            EmptyArray => ("empty_array", "an append of [] adds nothing; send at least one JSON value".to_string()),
            Conflict { .. } => ("conflict", e.to_string()),
            StreamSeqRegression { received, last } => (
                "stream_seq_regression",
                cut_values(
                    format!("{e}; Stream-Seq values must increase strictly (bytewise comparison)"),
                    &[received, last],
                ),
            ),
            Fenced { .. } => ("producer_fenced", format!("{e}; a newer producer epoch owns this producer id")),
            EpochMustStartAtZero { .. } => ("epoch_must_start_at_zero", e.to_string()),
            SequenceGap { .. } => ("sequence_gap", format!("{e}; resend the missing sequences first")),
            // The message names the final offset as the token the header carries.
            Closed { end, incarnation } => (
                "stream_closed",
                format!("{e}; a closed stream accepts no more appends").replacen(
                    &end.final_offset.to_string(),
                    &end.final_offset.token(incarnation),
                    1,
                ),
            ),
            TooLong { .. } => ("max_len", e.to_string()),
            Backend(_) => ("backend_unavailable", format!("{e}; retry later")),
        };
        let mut err = ApiError::new(status, code, message);
        match e {
            Closed { end, incarnation } => {
                err = err
                    .with_header(h::stream_closed(), "true")
                    .with_header(h::stream_next_offset(), end.final_offset.token(&incarnation))
                    .with_header(h::baton_end_reason(), end.reason);
            }
            Fenced { current_epoch, .. } => err = err.with_header(h::producer_epoch(), current_epoch),
            SequenceGap { expected, received } => {
                err = err
                    .with_header(h::producer_expected_seq(), expected)
                    .with_header(h::producer_received_seq(), received);
            }
            Backend(_) => err = err.with_header(header::RETRY_AFTER, 1),
            _ => {}
        }
        err
    }
}

impl From<CommandError> for ApiError {
    fn from(e: CommandError) -> Self {
        use CommandError::*;
        let msg = match &e {
            InvalidId(v) | InvalidType(v) | InvalidStatus(v) | InvalidCursor(v) | InvalidOffset(v) | NotFound(v) => {
                cut_values(e.to_string(), &[v])
            }
            Conflict { id, .. } => cut_values(e.to_string(), &[id]),
            Queue(QueueError::InvalidQueueName(v)) => cut_values(e.to_string(), &[v]),
            _ => e.to_string(),
        };
        match e {
            InvalidId(_) => ApiError::invalid("invalid_id", msg),
            InvalidType(_) => ApiError::invalid("invalid_type", msg),
            InvalidParams(_) => ApiError::invalid("invalid_params", msg),
            InvalidStatus(_) => ApiError::invalid("invalid_status", msg),
            InvalidCursor(_) => ApiError::invalid(
                "invalid_cursor",
                format!("{msg}: pass a next_cursor returned by this endpoint, or omit cursor to start from the newest"),
            ),
            InvalidOffset(_) => ApiError::invalid("invalid_offset", msg),
            InvalidSettings(_) => ApiError::invalid("invalid_request", msg),
            Conflict { .. } => ApiError::new(
                StatusCode::CONFLICT,
                "conflict",
                format!("{msg}; resubmit the same body, or use a new id"),
            ),
            NotFound(_) => ApiError::not_found("not_found", format!("{msg} (never submitted, or expired)")),
            AlreadyTerminal(st) => {
                ApiError::new(StatusCode::CONFLICT, "already_terminal", msg).with_serialized_field("state", &st)
            }
            NotRetryable(st) => {
                ApiError::new(StatusCode::CONFLICT, "not_retryable", msg).with_serialized_field("state", &st)
            }
            NotScheduled(st) => {
                ApiError::new(StatusCode::CONFLICT, "not_scheduled", msg).with_serialized_field("state", &st)
            }
            InvalidSchedule(_) => ApiError::invalid("invalid_body", msg),
            InvalidConcurrencyKey(_) => ApiError::invalid("invalid_body", msg),
            InvalidPriority(_) => ApiError::invalid("invalid_body", msg),
            Queue(QueueError::InvalidQueueName(_)) => ApiError::invalid("invalid_queue", msg),
            Corrupt { .. } => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "corrupt_state", msg),
            Output(_) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "output_unavailable", msg),
            OutputInUse { .. } => ApiError::new(
                StatusCode::CONFLICT,
                "output_in_use",
                format!("{msg}; give the output another path (or none: commands/<id>)"),
            ),
            Queue(_) | Redis(_) | Connect(_) => ApiError::unavailable(msg),
        }
    }
}

impl From<QueueError> for ApiError {
    fn from(e: QueueError) -> Self {
        match e {
            QueueError::InvalidMessageId(ref v) => ApiError::invalid("invalid_id", cut_values(e.to_string(), &[v])),
            QueueError::DeadLetterNotFound(_) => ApiError::not_found("not_found", e.to_string()),
            QueueError::InvalidQueueName(ref v) => ApiError::invalid("invalid_queue", cut_values(e.to_string(), &[v])),
            other => CommandError::Queue(other).into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echoed_values_are_cut() {
        assert_eq!(echo("abc"), "\"abc\"");
        let long = "é".repeat(150);
        let quoted = echo(&long);
        assert_eq!(quoted, format!("{:?}… (300 bytes)", "é".repeat(100)));
        assert_eq!(cut(&long), format!("{}… (300 bytes)", "é".repeat(100)));
        let id = "x".repeat(100_000);
        let e: ApiError = CommandError::InvalidId(id.clone()).into();
        assert!(e.message.len() < 300 && e.message.starts_with("invalid command id \"xxx"), "{}", e.message);
        assert!(e.message.contains("… (100000 bytes)"), "{}", e.message);
        let e: ApiError = CommandError::NotFound(id).into();
        assert!(e.message.len() < 300, "{}", e.message);
    }
}
