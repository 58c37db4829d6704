//! The values of settings: human durations (`30s`, `15m`, `1h 30m`; `none` or `off` disables an
//! optional one) and sizes (`8MiB`).

use std::time::Duration;

/// An optional duration: `None` means "disabled" (`none`/`off` on input).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptDuration(pub Option<Duration>);

/// `30s`, `15m`, `1h 30m`, `250ms`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("{s:?} is not a duration like `30s` or `15m`: {e}"))
}

/// A duration, or `none`/`off` to disable.
pub fn parse_opt_duration(s: &str) -> Result<OptDuration, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "none" | "off" | "never" => Ok(OptDuration(None)),
        _ => parse_duration(s).map(|d| OptDuration(Some(d))),
    }
}

/// `1048576`, `512KiB`, `8MiB`, `8MB`, `1k`.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().map_err(|_| format!("{s:?} is not a size like `8MiB` or `65536`"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => return Err(format!("unknown size unit {other:?} in {s:?} (use KiB, MiB or GiB)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_size("8MiB").unwrap(), 8 << 20);
        assert_eq!(parse_size("512 KiB").unwrap(), 512 << 10);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("8 parsecs").is_err());
        assert_eq!(parse_duration("1m 30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_opt_duration("none").unwrap(), OptDuration(None));
        assert!(parse_duration("soon").is_err());
    }
}
