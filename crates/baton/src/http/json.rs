//! JSON bodies of the HTTP API.

use axum::http::header;
use axum::response::{IntoResponse, Response};
use baton_commands::CommandState;
use serde_json::Value;

/// What kind of JSON value `v` is, for error messages: `null`, `a boolean`, `a number`, `a
/// string`, `an array`, `an object`.
pub fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A JSON body with `Content-Type: application/json`.
pub fn json_response(v: Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// A JSON body with `Content-Type: application/json`, written straight from `v` (so the exact
/// params and results of command states stay byte for byte: a `Value` would round numbers and
/// reorder keys).
pub fn serialized_response<T: serde::Serialize + ?Sized>(v: &T) -> Response {
    let body = serde_json::to_string(v).unwrap_or_else(|_| "null".into());
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// A command state as the API shows it, as a `Value` (for pages that embed it in a larger
/// `Value`; its params and result pass through `Value`, so a response that must return them
/// exactly uses [`serialized_response`] with the state instead).
pub fn state_json(s: &CommandState) -> Value {
    serde_json::to_value(s).unwrap_or(Value::Null)
}
