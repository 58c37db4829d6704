//! Error responses: a status, protocol headers where the protocol asks for them, and a JSON body
//! `{"error": "<code>", "message": "<what to fix>"}` (the same shape as every other Baton route).

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use baton_streams::StreamError;

use super::headers as h;

/// An HTTP error response.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub headers: HeaderMap,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), headers: HeaderMap::new() }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub fn with_header(mut self, name: HeaderName, value: impl ToString) -> Self {
        if let Ok(v) = HeaderValue::from_str(&value.to_string()) {
            self.headers.insert(name, v);
        }
        self
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
            Backend(_) => err = err.with_header(axum::http::header::RETRY_AFTER, 1),
            _ => {}
        }
        err
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, code = self.code, message = %self.message, "request failed");
        } else {
            tracing::debug!(status = %self.status, code = self.code, message = %self.message, "request refused");
        }
        let body = serde_json::json!({ "error": self.code, "message": self.message }).to_string();
        let mut res = (self.status, body).into_response();
        res.headers_mut().insert(axum::http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        res.headers_mut().extend(self.headers);
        res
    }
}
