//! JSON bodies of the HTTP API.

use axum::http::header;
use axum::response::{IntoResponse, Response};
use baton_commands::CommandState;
use serde_json::Value;

/// A JSON body with `Content-Type: application/json`.
pub fn json_response(v: Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// A command state as the API shows it (internal `_…` fields removed).
pub fn state_json(s: &CommandState) -> Value {
    let mut v = serde_json::to_value(s).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        m.retain(|k, _| !k.starts_with('_'));
    }
    v
}
