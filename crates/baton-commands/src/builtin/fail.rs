//! `fail`: fails with the error text of its params.

use async_trait::async_trait;
use serde_json::Value;

use super::sleep::kind_of;
use crate::{Command, CommandHandler, CommandResult, HandlerError, RawJson};

/// The `fail` built-in handler.
///
/// * Params: `{"error": text}`, `text` a string that is not empty or only whitespace; anything
///   else (another field included) is refused by `validate` with a message saying what to fix.
/// * `execute` returns [`CommandResult::failed`]`(text)`: a real failure, so the command ends
///   `FAILED` with `error` = `text` after one attempt (no retries).
#[derive(Clone, Copy, Debug, Default)]
pub struct FailHandler;

/// Decodes `fail` params into the error text (rules on [`FailHandler`]).
pub fn fail_error(params: &Value) -> Result<&str, String> {
    const SHAPE: &str = "fail params must be {\"error\": text} with text a non-empty string";
    let obj = params.as_object().ok_or_else(|| format!("{SHAPE}; got {}", kind_of(params)))?;
    if let Some(k) = obj.keys().find(|k| k.as_str() != "error") {
        return Err(format!("unknown field {k:?}: {SHAPE}"));
    }
    match obj.get("error") {
        None => Err(format!("missing field \"error\": {SHAPE}")),
        Some(Value::String(s)) if !s.trim().is_empty() => Ok(s),
        Some(Value::String(_)) => Err(format!("\"error\" is empty: {SHAPE}")),
        Some(v) => Err(format!("\"error\" must be a non-empty string; got {}", kind_of(v))),
    }
}

#[async_trait]
impl CommandHandler for FailHandler {
    async fn execute(&self, command: Command) -> Result<CommandResult, HandlerError> {
        let params = match super::value_of(&command.params) {
            Ok(v) => v,
            Err(e) => return Ok(CommandResult::failed(format!("invalid params: {e}"))),
        };
        Ok(match fail_error(&params) {
            Ok(text) => CommandResult::failed(text),
            Err(e) => CommandResult::failed(format!("invalid params: {e}")),
        })
    }

    fn validate(&self, params: &RawJson) -> Result<(), String> {
        fail_error(&super::value_of(params)?).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn params() {
        assert_eq!(fail_error(&json!({"error": "disk full"})), Ok("disk full"));
        assert_eq!(
            fail_error(&json!({"error": "  "})).unwrap_err(),
            "\"error\" is empty: fail params must be {\"error\": text} with text a non-empty string"
        );
        assert_eq!(fail_error(&json!({"error": 3})).unwrap_err(), "\"error\" must be a non-empty string; got a number");
        assert!(fail_error(&json!({})).unwrap_err().starts_with("missing field \"error\""));
        assert!(fail_error(&json!({"error": "x", "y": 1})).unwrap_err().starts_with("unknown field \"y\""));
        assert!(fail_error(&json!("x")).unwrap_err().ends_with("got a string"));
    }
}
