//! Line normalisation: the leading timestamp is parsed and removed, and every variable part of
//! the rest (numbers, ids, hex, UUIDs, IP addresses, embedded timestamps) is masked, so lines
//! that differ only in those parts share one *signature*.
//!
//! Masks: `<uuid>` (8-4-4-4-12 hex), `<ts>` (an ISO 8601 date-time), `<time>` (`hh:mm:ss[.f]`),
//! `<ip>` (dotted IPv4, optional `:port`), `<hex>` (`0x…`, or a hex word of ≥ 6 characters with
//! a digit and a letter), `<n>` (a digit run, decimals included). Runs of whitespace become one
//! space. Hand-written (no regex) so a 100 MB log is a single linear pass.

/// A leading timestamp found on a line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeadingTs {
    /// Seconds on a scale that is monotonic within one log: Unix seconds for ISO 8601 stamps;
    /// seconds since 1 January of an unknown year for syslog stamps (`Jan 31 12:00:01`).
    pub secs: i64,
    /// Length in bytes of the stamp (and the separator after it) at the start of the line.
    pub len: usize,
}

const MONTHS: [&[u8; 3]; 12] =
    [b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov", b"Dec"];

fn digits(b: &[u8], at: usize, n: usize) -> Option<i64> {
    let s = b.get(at..at + n)?;
    if !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(s.iter().fold(0i64, |acc, d| acc * 10 + (d - b'0') as i64))
}

/// `hh:mm:ss` at `at` → seconds of the day.
fn hms(b: &[u8], at: usize) -> Option<i64> {
    let h = digits(b, at, 2)?;
    let m = digits(b, at + 3, 2)?;
    let s = digits(b, at + 6, 2)?;
    (b[at + 2] == b':' && b[at + 5] == b':' && h < 24 && m < 60 && s < 61).then_some(h * 3600 + m * 60 + s)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Length of an ISO 8601 date-time at `at` (`YYYY-MM-DD[T ]hh:mm:ss[.f][Z|±hh[:]mm]`) and its
/// Unix seconds (the zone is ignored: one log uses one zone).
fn iso_at(b: &[u8], at: usize) -> Option<(usize, i64)> {
    let y = digits(b, at, 4)?;
    let mo = digits(b, at + 5, 2)?;
    let d = digits(b, at + 8, 2)?;
    if b[at + 4] != b'-' || b[at + 7] != b'-' || !(1..=12).contains(&mo) || !(1..=31).contains(&d) {
        return None;
    }
    if !matches!(b.get(at + 10), Some(b'T' | b' ')) {
        return None;
    }
    let secs = hms(b, at + 11)?;
    let mut i = at + 19;
    if matches!(b.get(i), Some(b'.' | b',')) && b.get(i + 1).is_some_and(u8::is_ascii_digit) {
        i += 1;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
    }
    match b.get(i) {
        Some(b'Z') => i += 1,
        Some(b'+' | b'-') if digits(b, i + 1, 2).is_some() => {
            i += 3;
            if b.get(i) == Some(&b':') && digits(b, i + 1, 2).is_some() {
                i += 3;
            } else if digits(b, i, 2).is_some() {
                i += 2;
            }
        }
        _ => {}
    }
    Some((i - at, days_from_civil(y, mo, d) * 86_400 + secs))
}

/// Parses the timestamp a line starts with (optionally inside `[` `]`): ISO 8601 or syslog.
pub fn leading_timestamp(line: &[u8]) -> Option<LeadingTs> {
    let open = usize::from(line.first() == Some(&b'['));
    let (len, secs) = if let Some((n, secs)) = iso_at(line, open) {
        (n, secs)
    } else {
        // Syslog: `Mmm dd hh:mm:ss` or `Mmm  d hh:mm:ss`.
        let mon = MONTHS.iter().position(|m| line.get(open..open + 3) == Some(&m[..]))? as i64;
        let b = line;
        if b.get(open + 3) != Some(&b' ') {
            return None;
        }
        let day = match (b.get(open + 4), b.get(open + 5)) {
            (Some(b' '), Some(d)) if d.is_ascii_digit() => (d - b'0') as i64,
            _ => digits(b, open + 4, 2)?,
        };
        if b.get(open + 6) != Some(&b' ') {
            return None;
        }
        let t = hms(b, open + 7)?;
        (15, (mon * 31 + day) * 86_400 + t)
    };
    let mut end = open + len;
    if open == 1 {
        end = end + line[end..].iter().position(|&c| c == b']')? + 1;
    }
    while line.get(end) == Some(&b' ') || line.get(end) == Some(&b'\t') {
        end += 1;
    }
    Some(LeadingTs { secs, len: end })
}

fn is_word(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

fn is_uuid_at(b: &[u8], at: usize) -> bool {
    const GROUPS: [usize; 5] = [8, 4, 4, 4, 12];
    let mut i = at;
    for (g, n) in GROUPS.iter().enumerate() {
        if !b.get(i..i + n).is_some_and(|s| s.iter().all(u8::is_ascii_hexdigit)) {
            return false;
        }
        i += n;
        if g < 4 {
            if b.get(i) != Some(&b'-') {
                return false;
            }
            i += 1;
        }
    }
    !b.get(i).copied().is_some_and(is_word)
}

/// Length of a dotted IPv4 address (with an optional `:port`) at `at`.
fn ipv4_at(b: &[u8], at: usize) -> Option<usize> {
    let mut i = at;
    for part in 0..4 {
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() && i - start < 3 {
            i += 1;
        }
        if i == start {
            return None;
        }
        if part < 3 {
            if b.get(i) != Some(&b'.') {
                return None;
            }
            i += 1;
        }
    }
    if b.get(i).is_some_and(|c| c.is_ascii_digit() || *c == b'.') {
        return None;
    }
    if b.get(i) == Some(&b':') && b.get(i + 1).is_some_and(u8::is_ascii_digit) {
        i += 1;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
    }
    Some(i - at)
}

/// Writes the masked form of `line` into `out` (cleared first), at most `max_len` bytes (cut at
/// a character boundary). `line` should not include the leading timestamp.
pub fn mask_into(line: &[u8], out: &mut String, max_len: usize) {
    out.clear();
    let b = line;
    let mut i = 0;
    let mut last_space = true;
    let push = |out: &mut String, s: &str| out.push_str(s);
    while i < b.len() && out.len() < max_len {
        let c = b[i];
        let word_start = i == 0 || !is_word(b[i - 1]);
        if c.is_ascii_whitespace() {
            if !last_space {
                out.push(' ');
                last_space = true;
            }
            i += 1;
            continue;
        }
        last_space = false;
        if word_start && c.is_ascii_hexdigit() {
            if is_uuid_at(b, i) {
                push(out, "<uuid>");
                i += 36;
                continue;
            }
            if let Some((n, _)) = iso_at(b, i) {
                push(out, "<ts>");
                i += n;
                continue;
            }
        }
        if word_start && c.is_ascii_digit() {
            if b.len() >= i + 8 && hms(b, i).is_some() {
                push(out, "<time>");
                i += 8;
                while b.get(i).is_some_and(|c| c.is_ascii_digit() || *c == b'.') {
                    i += 1;
                }
                continue;
            }
            if let Some(n) = ipv4_at(b, i) {
                push(out, "<ip>");
                i += n;
                continue;
            }
            if c == b'0' && matches!(b.get(i + 1), Some(b'x' | b'X')) && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit)
            {
                push(out, "<hex>");
                i += 2;
                while b.get(i).is_some_and(u8::is_ascii_hexdigit) {
                    i += 1;
                }
                continue;
            }
        }
        if is_word(c) && word_start {
            // A whole word: hex id, number, or text with digit runs masked.
            let mut end = i;
            while end < b.len() && is_word(b[end]) {
                end += 1;
            }
            let w = &b[i..end];
            let has_digit = w.iter().any(u8::is_ascii_digit);
            let all_hex = w.iter().all(u8::is_ascii_hexdigit);
            if all_hex && w.len() >= 6 && has_digit && w.iter().any(u8::is_ascii_alphabetic) {
                push(out, "<hex>");
            } else if has_digit {
                let mut j = 0;
                while j < w.len() {
                    if w[j].is_ascii_digit() {
                        while j < w.len() && w[j].is_ascii_digit() {
                            j += 1;
                        }
                        push(out, "<n>");
                    } else {
                        out.push(w[j] as char);
                        j += 1;
                    }
                }
                // A decimal part belongs to the number: `12.5ms` → `<n>ms`.
                if w.last().is_some_and(u8::is_ascii_digit)
                    && b.get(end) == Some(&b'.')
                    && b.get(end + 1).is_some_and(u8::is_ascii_digit)
                {
                    end += 1;
                    while b.get(end).is_some_and(u8::is_ascii_digit) {
                        end += 1;
                    }
                }
            } else {
                // Plain ASCII word.
                out.push_str(std::str::from_utf8(w).unwrap_or(""));
            }
            i = end;
            continue;
        }
        // Any other byte: copy one UTF-8 character (lossily).
        let len = utf8_len(c);
        match std::str::from_utf8(&b[i..(i + len).min(b.len())]) {
            Ok(s) => out.push_str(s),
            Err(_) => out.push('\u{FFFD}'),
        }
        i += len.max(1);
    }
    while out.len() > max_len {
        out.pop();
    }
    if out.ends_with(' ') {
        out.pop();
    }
}

fn utf8_len(first: u8) -> usize {
    match first {
        0x00..=0x7F => 1,
        0xC0..=0xDF => 2,
        0xE0..=0xEF => 3,
        0xF0..=0xF7 => 4,
        _ => 1,
    }
}

/// How bad a line is, judged by its words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Info,
    Warning,
    Error,
}

const ERROR_PREFIXES: [&str; 17] = [
    "err",
    "fatal",
    "panic",
    "exception",
    "fail",
    "crit",
    "emerg",
    "segfault",
    "traceback",
    "denied",
    "refused",
    "timeout",
    "unreachable",
    "oom",
    "abort",
    "killed",
    "unhandled",
];
const WARN_PREFIXES: [&str; 6] = ["warn", "deprecat", "retry", "retrying", "degraded", "slow"];

/// Classifies a line: any word starting (case-insensitively) with an error prefix (`err`,
/// `fatal`, `panic`, `exception`, `fail`, `timeout`, `refused`, …) makes it an error; else a
/// warning prefix (`warn`, `deprecat`, `retry`, `degraded`, `slow`); else info. `timed out`
/// counts as an error.
pub fn severity(line: &[u8]) -> Severity {
    let mut sev = Severity::Info;
    let mut prev_timed = false;
    for w in line.split(|c| !c.is_ascii_alphabetic()).filter(|w| !w.is_empty()) {
        let mut lw = [0u8; 12];
        let n = w.len().min(12);
        for (d, s) in lw.iter_mut().zip(&w[..n]) {
            *d = s.to_ascii_lowercase();
        }
        let lw = &lw[..n];
        if ERROR_PREFIXES.iter().any(|p| lw.starts_with(p.as_bytes())) || (prev_timed && lw == b"out") {
            return Severity::Error;
        }
        if WARN_PREFIXES.iter().any(|p| lw.starts_with(p.as_bytes())) {
            sev = Severity::Warning;
        }
        prev_timed = lw == b"timed";
    }
    sev
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(s: &str) -> String {
        let mut out = String::new();
        mask_into(s.as_bytes(), &mut out, 240);
        out
    }

    #[test]
    fn masks_variable_parts() {
        assert_eq!(m("user 4711 failed login from 10.0.0.12:5532"), "user <n> failed login from <ip>");
        assert_eq!(m("request 0197a0b2-3c4d-7e8f-9a0b-1c2d3e4f5a6b took 12.5ms"), "request <uuid> took <n>ms");
        assert_eq!(m("blob deadbeef42 at 0x7ffd1234 ok"), "blob <hex> at <hex> ok");
        assert_eq!(m("added 3 files"), "added <n> files");
        assert_eq!(m("retry at 2025-01-31T12:00:01.123Z then 12:00:05"), "retry at <ts> then <time>");
        assert_eq!(m("worker-17   pid=992  exited"), "worker-<n> pid=<n> exited");
        assert_eq!(m("job job42 done"), "job job<n> done");
        assert_eq!(m("héllo wörld 5"), "héllo wörld <n>");
    }

    #[test]
    fn leading_timestamps() {
        let l = b"2025-01-31T12:00:01.5Z ERROR boom";
        let ts = leading_timestamp(l).unwrap();
        assert_eq!(&l[ts.len..], b"ERROR boom");
        assert_eq!(ts.secs, 1_738_324_801);
        let l = b"Jan  5 07:01:02 host sshd[12]: Failed password";
        let ts = leading_timestamp(l).unwrap();
        assert_eq!(&l[ts.len..], b"host sshd[12]: Failed password");
        let l = b"[2025-01-31 12:00:01,250] WARN x";
        let ts = leading_timestamp(l).unwrap();
        assert_eq!(&l[ts.len..], b"WARN x");
        assert!(leading_timestamp(b"no stamp here").is_none());
        assert!(leading_timestamp(b"Jan").is_none());
    }

    #[test]
    fn severities() {
        assert_eq!(severity(b"ERROR db: connection refused"), Severity::Error);
        assert_eq!(severity(b"upstream timed out (110)"), Severity::Error);
        assert_eq!(severity(b"WARN disk 91% full"), Severity::Warning);
        assert_eq!(severity(b"Started session 42 of user root."), Severity::Info);
        assert_eq!(severity(b"Failed password for root"), Severity::Error);
    }
}
