//! `sleep`: waits `{"ms": n}` milliseconds, then succeeds with `{"slept_ms": n}`.

use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};

use crate::{Command, CommandHandler, CommandResult, HandlerError, RawJson};

/// The longest `sleep`: 24 h, in milliseconds (86 400 000).
pub const MAX_SLEEP_MS: u64 = 24 * 60 * 60 * 1000;

/// The `sleep` built-in handler.
///
/// * Params: `{"ms": n}`, `n` an integer number of milliseconds, `0 ≤ n ≤ 86 400 000` (24 h).
///   Anything else — a missing or non-integer `ms`, a negative or larger value, another field,
///   params that are not an object — is refused by `validate` (so at submit) with a message
///   saying what to fix.
/// * `execute`: waits `n` ms, then succeeds with `{"slept_ms": n}`. When the command is
///   cancelled meanwhile it stops at once and returns [`CommandResult::cancelled`]. While it
///   waits it reports its progress ([`Command::progress`]) every
///   [`REPORT_INTERVAL`](crate::REPORT_INTERVAL): the fraction slept and `"slept <x> of <n> ms"`.
/// * `check_status` is never needed (`execute` never returns `running`).
///
/// A sleep longer than the queue's `max_processing_time` (default 15 min) loses its lease like
/// any other handler: renewal stops and the message can be taken over by another consumer (the
/// handler is not stopped).
#[derive(Clone, Copy, Debug, Default)]
pub struct SleepHandler;

/// Decodes `sleep` params into milliseconds (rules on [`SleepHandler`]).
pub fn sleep_ms(params: &Value) -> Result<u64, String> {
    const SHAPE: &str =
        "sleep params must be {\"ms\": n} with n an integer number of milliseconds from 0 to 86400000 (24 h)";
    let obj = params.as_object().ok_or_else(|| format!("{SHAPE}; got {}", kind_of(params)))?;
    if let Some(k) = obj.keys().find(|k| k.as_str() != "ms") {
        return Err(format!("unknown field {k:?}: {SHAPE}"));
    }
    let v = obj.get("ms").ok_or_else(|| format!("missing field \"ms\": {SHAPE}"))?;
    match v.as_u64() {
        Some(n) if n <= MAX_SLEEP_MS => Ok(n),
        Some(n) => Err(format!("\"ms\" is {n}, above the 86400000 (24 h) maximum")),
        None => Err(format!("\"ms\" must be an integer from 0 to 86400000 (milliseconds); got {v}")),
    }
}

pub(crate) fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[async_trait]
impl CommandHandler for SleepHandler {
    async fn execute(&self, command: Command) -> Result<CommandResult, HandlerError> {
        let ms = match super::value_of(&command.params).and_then(|v| sleep_ms(&v)) {
            Ok(ms) => ms,
            Err(e) => return Ok(CommandResult::failed(format!("invalid params: {e}"))),
        };
        if command.is_cancelled() {
            return Ok(CommandResult::cancelled());
        }
        let start = tokio::time::Instant::now();
        let end = start + Duration::from_millis(ms);
        loop {
            let tick = (tokio::time::Instant::now() + crate::REPORT_INTERVAL).min(end);
            tokio::select! {
                _ = tokio::time::sleep_until(tick) => {}
                _ = command.cancelled() => return Ok(CommandResult::cancelled()),
            }
            if tick >= end {
                return Ok(CommandResult::succeeded(json!({ "slept_ms": ms })));
            }
            let slept = start.elapsed().as_millis() as u64;
            let fraction = (slept as f64 / ms as f64).min(1.0);
            let _ = command.progress(Some(fraction), Some(&format!("slept {slept} of {ms} ms")));
        }
    }

    fn validate(&self, params: &RawJson) -> Result<(), String> {
        sleep_ms(&super::value_of(params)?).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params() {
        assert_eq!(sleep_ms(&json!({"ms": 0})), Ok(0));
        assert_eq!(sleep_ms(&json!({"ms": 86_400_000})), Ok(86_400_000));
        for bad in [
            json!({"ms": 86_400_001}),
            json!({"ms": -1}),
            json!({"ms": 1.5}),
            json!({"ms": "5"}),
            json!({}),
            json!({"ms": 5, "x": 1}),
            json!(null),
            json!([5]),
        ] {
            assert!(sleep_ms(&bad).is_err(), "{bad} accepted");
        }
        assert_eq!(
            sleep_ms(&json!({"ms": -1})).unwrap_err(),
            "\"ms\" must be an integer from 0 to 86400000 (milliseconds); got -1"
        );
        assert_eq!(
            sleep_ms(&json!({"ms": 86_400_001})).unwrap_err(),
            "\"ms\" is 86400001, above the 86400000 (24 h) maximum"
        );
        assert!(sleep_ms(&json!({"ms": 5, "x": 1})).unwrap_err().starts_with("unknown field \"x\""));
    }
}
