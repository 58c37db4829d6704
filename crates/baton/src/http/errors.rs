//! The one error response of the HTTP API: a status, the headers the protocol asks for, and a
//! JSON body `{"error": "<code>", "message": "<what to fix>"}` (a refused cancel adds `"state"`),
//! the same shape on every route. The engines' errors map to it here.

use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use baton_commands::CommandError;
use baton_queue::QueueError;
use baton_streams::StreamError;
use serde_json::{Map, Value};

use super::json::{json_response, state_json};
use super::names as h;

/// An HTTP error response.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// More fields of the body, after `error` and `message`.
    pub extra: Map<String, Value>,
    pub headers: HeaderMap,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), extra: Map::new(), headers: HeaderMap::new() }
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
    fn unavailable(message: impl std::fmt::Display) -> Self {
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
    pub fn with_field(mut self, name: &str, value: Value) -> Self {
        self.extra.insert(name.to_string(), value);
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, code = self.code, message = %self.message, "request failed");
        } else {
            tracing::debug!(status = %self.status, code = self.code, message = %self.message, "request refused");
        }
        let mut body = Map::new();
        body.insert("error".into(), Value::from(self.code));
        body.insert("message".into(), Value::from(self.message));
        body.extend(self.extra);
        let mut res = (self.status, json_response(Value::Object(body))).into_response();
        res.headers_mut().extend(self.headers);
        res
    }
}

impl From<StreamError> for ApiError {
    fn from(e: StreamError) -> Self {
        use StreamError::*;
        let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let (code, message) = match &e {
            NotFound { .. } => ("not_found", format!("{e}; create it with PUT first")),
            Gone { .. } => ("gone", e.to_string()),
            OffsetGone { earliest, .. } => ("offset_gone", format!("{e}; read from offset=-1 or from {earliest}")),
            OffsetIncarnation { .. } => (
                "offset_incarnation",
                format!("{e}; its offsets do not apply to the new stream: read it from offset=-1"),
            ),
            MalformedOffset { .. } => {
                ("malformed_offset", format!("{e}; use -1, now, or a Stream-Next-Offset value returned by this server"))
            }
            OffsetAhead { .. } => ("offset_ahead", format!("{e}; use an offset returned by this server")),
            InvalidRequest { .. } => ("invalid_request", e.to_string()),
            InvalidJson { .. } => ("invalid_json", format!("{e}; the stream is application/json, send valid JSON")),
            EmptyArray => ("empty_array", "an append of [] adds nothing; send at least one JSON value".to_string()),
            Conflict { .. } => ("conflict", e.to_string()),
            StreamSeqRegression { .. } => (
                "stream_seq_regression",
                format!("{e}; Stream-Seq values must increase strictly (bytewise comparison)"),
            ),
            Fenced { .. } => ("producer_fenced", format!("{e}; a newer producer epoch owns this producer id")),
            EpochMustStartAtZero { .. } => ("epoch_must_start_at_zero", e.to_string()),
            SequenceGap { .. } => ("sequence_gap", format!("{e}; resend the missing sequences first")),
            Closed { .. } => ("stream_closed", format!("{e}; a closed stream accepts no more appends")),
            TooLong { .. } => ("max_len", e.to_string()),
            Backend(_) => ("backend_unavailable", format!("{e}; retry later")),
        };
        let mut err = ApiError::new(status, code, message);
        match e {
            Closed { end } => {
                err = err
                    .with_header(h::stream_closed(), "true")
                    .with_header(h::stream_next_offset(), end.final_offset)
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
        let msg = e.to_string();
        match e {
            InvalidId(_) => ApiError::invalid("invalid_id", msg),
            InvalidType(_) => ApiError::invalid("invalid_type", msg),
            InvalidParams(_) => ApiError::invalid("invalid_params", msg),
            InvalidStatus(_) => ApiError::invalid("invalid_status", msg),
            InvalidCursor(_) => ApiError::invalid(
                "invalid_cursor",
                format!("{msg}: pass a next_cursor returned by this endpoint, or omit cursor to start from the newest"),
            ),
            InvalidSettings(_) => ApiError::invalid("invalid_request", msg),
            Conflict { .. } => ApiError::new(
                StatusCode::CONFLICT,
                "conflict",
                format!("{msg}; resubmit the same body, or use a new id"),
            ),
            NotFound(_) => ApiError::not_found("not_found", format!("{msg} (never submitted, or expired)")),
            AlreadyTerminal(st) => {
                ApiError::new(StatusCode::CONFLICT, "already_terminal", msg).with_field("state", state_json(&st))
            }
            Queue(QueueError::InvalidQueueName(_)) => ApiError::invalid("invalid_queue", msg),
            Corrupt { .. } => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "corrupt_state", msg),
            Queue(_) | Redis(_) | Connect(_) => ApiError::unavailable(msg),
        }
    }
}

impl From<QueueError> for ApiError {
    fn from(e: QueueError) -> Self {
        match e {
            QueueError::InvalidMessageId(_) => ApiError::invalid("invalid_id", e.to_string()),
            QueueError::DeadLetterNotFound(_) => ApiError::not_found("not_found", e.to_string()),
            QueueError::InvalidQueueName(_) => ApiError::invalid("invalid_queue", e.to_string()),
            other => CommandError::Queue(other).into(),
        }
    }
}
