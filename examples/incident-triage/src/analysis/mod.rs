//! The log analysis itself, synchronous and bounded in memory:
//!
//! * [`read_line_capped`] reads one line, keeping at most `max_line_len` bytes of it (the rest
//!   is skipped), so a file with no newline never grows a buffer past that cap.
//! * [`Analyzer`] classifies each line ([`mask::severity`]), strips its leading timestamp, masks
//!   the rest into a signature ([`mask::mask_into`]) and counts error and warning lines per
//!   signature: count, first and last occurrence, a sample line, and the peak window (for
//!   bursts). The signature table holds at most `max_signatures` entries; lines of new
//!   signatures past the cap are only counted (`untracked_lines`).
//!
//! Memory is therefore bounded by `max_signatures × (max_signature_len + max_sample_len + a few
//! hundred bytes)` plus one line buffer, whatever the size of the log (about 3.5 MB with the
//! defaults), which `tests/big_file.rs` checks on a 100 MB file.

pub mod mask;

use std::collections::HashMap;
use std::io::{self, BufRead};

use serde::Serialize;

pub use mask::Severity;

/// Caps of one analysis.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Distinct error/warning signatures tracked. Default 5,000.
    pub max_signatures: usize,
    /// Bytes kept of a masked signature. Default 240.
    pub max_signature_len: usize,
    /// Bytes kept of a sample line. Default 300.
    pub max_sample_len: usize,
    /// Bytes kept of one raw line (the rest is skipped). Default 64 KiB.
    pub max_line_len: usize,
    /// Lines per window when the log has no timestamps (burst detection). Default 1,000.
    pub line_window: u64,
    /// Seconds per window when the log has timestamps. Default 60.
    pub time_window_secs: i64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_signatures: 5_000,
            max_signature_len: 240,
            max_sample_len: 300,
            max_line_len: 64 * 1024,
            line_window: 1_000,
            time_window_secs: 60,
        }
    }
}

/// Reads one line (through `\n`) from `r` into `buf` (cleared first), keeping at most `cap`
/// bytes; the rest of a longer line is consumed and dropped. The trailing `\n`/`\r\n` is not
/// kept. Returns the bytes consumed from `r` (0 at end of input).
pub fn read_line_capped(r: &mut dyn BufRead, buf: &mut Vec<u8>, cap: usize) -> io::Result<usize> {
    buf.clear();
    let mut consumed = 0;
    loop {
        let avail = match r.fill_buf() {
            Ok(a) => a,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            break;
        }
        let (take, done) = match avail.iter().position(|&c| c == b'\n') {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        let room = cap.saturating_sub(buf.len());
        buf.extend_from_slice(&avail[..take.min(room)]);
        r.consume(take);
        consumed += take;
        if done {
            break;
        }
    }
    while buf.last().is_some_and(|c| *c == b'\n' || *c == b'\r') {
        buf.pop();
    }
    Ok(consumed)
}

/// Where a signature was seen.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Occurrence {
    /// 1-based line number.
    pub line: u64,
    /// The line's leading timestamp as written in the log, if it had one.
    pub at: Option<String>,
}

/// A window in which a signature occurred far more often than on average.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Burst {
    /// Occurrences within the window.
    pub count: u64,
    /// The window: `"1 min"` (timestamped logs) or `"1000 lines"`.
    pub window: String,
    /// Where the window starts: the first timestamp in it, or `"line N"`.
    pub start: String,
    /// `count` divided by the signature's mean per window over the whole log.
    pub times_mean: f64,
}

/// One error signature, as reported.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Finding {
    /// 1 = most frequent error signature (errors before warnings, then by count).
    pub rank: usize,
    pub severity: Severity,
    /// The masked line.
    pub signature: String,
    pub count: u64,
    /// Percent of all error and warning lines, one decimal.
    pub share: f64,
    pub first: Occurrence,
    pub last: Occurrence,
    /// The first line seen with this signature (timestamp removed, truncated).
    pub sample: String,
    pub burst: Option<Burst>,
}

/// Totals of a finished analysis.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Totals {
    pub lines: u64,
    pub bytes: u64,
    pub errors: u64,
    pub warnings: u64,
    /// Distinct error/warning signatures tracked.
    pub signatures: usize,
    /// True when the signature cap was reached.
    pub signatures_capped: bool,
    /// Error/warning lines of signatures past the cap (counted, not grouped).
    pub untracked_lines: u64,
    /// Lines that started with a timestamp.
    pub timestamped_lines: u64,
    /// First and last leading timestamps, as written.
    pub first_at: Option<String>,
    pub last_at: Option<String>,
}

#[derive(Default)]
struct Window {
    cur: i64,
    cur_count: u64,
    cur_label: Option<String>,
    peak: i64,
    peak_count: u64,
    peak_label: Option<String>,
}

impl Window {
    fn add(&mut self, bucket: i64, label: Option<&str>) {
        if self.cur_count > 0 && bucket == self.cur {
            self.cur_count += 1;
            return;
        }
        self.settle();
        self.cur = bucket;
        self.cur_count = 1;
        self.cur_label = label.map(str::to_string);
    }
    fn settle(&mut self) {
        if self.cur_count > self.peak_count {
            self.peak = self.cur;
            self.peak_count = self.cur_count;
            self.peak_label.clone_from(&self.cur_label);
        }
    }
}

struct Sig {
    text: String,
    severity: Severity,
    count: u64,
    first: Occurrence,
    last: Occurrence,
    sample: String,
    by_time: Window,
    by_line: Window,
}

/// Groups error and warning lines by signature (module docs).
pub struct Analyzer {
    limits: Limits,
    index: HashMap<String, usize>,
    sigs: Vec<Sig>,
    totals: Totals,
    last_ts: Option<i64>,
    min_time: i64,
    max_time: i64,
    buf: String,
}

fn truncate(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

impl Analyzer {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            index: HashMap::new(),
            sigs: Vec::new(),
            totals: Totals {
                lines: 0,
                bytes: 0,
                errors: 0,
                warnings: 0,
                signatures: 0,
                signatures_capped: false,
                untracked_lines: 0,
                timestamped_lines: 0,
                first_at: None,
                last_at: None,
            },
            last_ts: None,
            min_time: i64::MAX,
            max_time: i64::MIN,
            buf: String::new(),
        }
    }

    /// The caps in use.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Feeds one line (without its newline); `consumed` is the bytes it took in the input.
    pub fn feed(&mut self, line: &[u8], consumed: usize) {
        let t = &mut self.totals;
        t.lines += 1;
        t.bytes += consumed as u64;
        let line_no = t.lines;
        let ts = mask::leading_timestamp(line);
        let stamp = ts.map(|ts| {
            let raw = String::from_utf8_lossy(&line[..ts.len]);
            raw.trim().trim_start_matches('[').trim_end_matches(']').to_string()
        });
        if let (Some(ts), Some(stamp)) = (ts, &stamp) {
            t.timestamped_lines += 1;
            self.last_ts = Some(ts.secs);
            self.min_time = self.min_time.min(ts.secs);
            self.max_time = self.max_time.max(ts.secs);
            if t.first_at.is_none() {
                t.first_at = Some(stamp.clone());
            }
            t.last_at = Some(stamp.clone());
        }
        let body = &line[ts.map_or(0, |t| t.len)..];
        let severity = mask::severity(body);
        match severity {
            Severity::Info => return,
            Severity::Warning => t.warnings += 1,
            Severity::Error => t.errors += 1,
        }
        mask::mask_into(body, &mut self.buf, self.limits.max_signature_len);
        let at = Occurrence { line: line_no, at: stamp.clone() };
        let i = match self.index.get(self.buf.as_str()) {
            Some(&i) => i,
            None if self.sigs.len() >= self.limits.max_signatures => {
                self.totals.signatures_capped = true;
                self.totals.untracked_lines += 1;
                return;
            }
            None => {
                let sample = truncate(&String::from_utf8_lossy(body), self.limits.max_sample_len);
                self.sigs.push(Sig {
                    text: self.buf.clone(),
                    severity,
                    count: 0,
                    first: at.clone(),
                    last: at.clone(),
                    sample,
                    by_time: Window::default(),
                    by_line: Window::default(),
                });
                self.index.insert(self.buf.clone(), self.sigs.len() - 1);
                self.sigs.len() - 1
            }
        };
        let s = &mut self.sigs[i];
        s.count += 1;
        s.last = at;
        if let Some(secs) = self.last_ts {
            s.by_time.add(secs.div_euclid(self.limits.time_window_secs), stamp.as_deref());
        }
        s.by_line.add(((line_no - 1) / self.limits.line_window) as i64, None);
    }

    /// Totals so far.
    pub fn totals(&self) -> Totals {
        let mut t = self.totals.clone();
        t.signatures = self.sigs.len();
        t
    }

    /// The `top` most important signatures (errors first, then by count, then by first
    /// occurrence), with bursts: a window holding at least 8 occurrences and at least 4 times the
    /// signature's mean per window over the whole log.
    pub fn findings(&mut self, top: usize) -> Vec<Finding> {
        let t = self.totals();
        let timed = t.timestamped_lines * 2 >= t.lines.max(1);
        let spans = if timed {
            let w = self.limits.time_window_secs;
            (self.max_time.div_euclid(w) - self.min_time.div_euclid(w) + 1).max(1)
        } else {
            (t.lines.saturating_sub(1) / self.limits.line_window + 1) as i64
        };
        let flagged = (t.errors + t.warnings).max(1) as f64;
        let mut order: Vec<usize> = (0..self.sigs.len()).collect();
        order.sort_by(|&a, &b| {
            let (a, b) = (&self.sigs[a], &self.sigs[b]);
            b.severity.cmp(&a.severity).then(b.count.cmp(&a.count)).then(a.first.line.cmp(&b.first.line))
        });
        let line_window = self.limits.line_window;
        order
            .into_iter()
            .take(top)
            .enumerate()
            .map(|(rank, i)| {
                let s = &mut self.sigs[i];
                let w = if timed { &mut s.by_time } else { &mut s.by_line };
                w.settle();
                let mean = s.count as f64 / spans as f64;
                let burst = (w.peak_count >= 8 && w.peak_count as f64 >= 4.0 * mean).then(|| Burst {
                    count: w.peak_count,
                    window: if timed { "1 min".to_string() } else { format!("{line_window} lines") },
                    start: match (&w.peak_label, timed) {
                        (Some(l), true) => l.clone(),
                        _ => format!("line {}", w.peak as u64 * line_window + 1),
                    },
                    times_mean: (w.peak_count as f64 / mean * 10.0).round() / 10.0,
                });
                Finding {
                    rank: rank + 1,
                    severity: s.severity,
                    signature: s.text.clone(),
                    count: s.count,
                    share: (s.count as f64 * 1000.0 / flagged).round() / 10.0,
                    first: s.first.clone(),
                    last: s.last.clone(),
                    sample: s.sample.clone(),
                    burst,
                }
            })
            .collect()
    }
}

/// A one-sentence verdict for the summary.
pub fn headline(t: &Totals, findings: &[Finding]) -> String {
    if t.errors + t.warnings == 0 {
        return format!("No errors or warnings in {} lines.", t.lines);
    }
    let mut s = format!(
        "{} errors and {} warnings in {} lines, {} distinct signatures.",
        t.errors, t.warnings, t.lines, t.signatures
    );
    if let Some(f) = findings.first() {
        s.push_str(&format!(" Top: \u{201c}{}\u{201d} \u{d7}{} ({}%).", f.signature, f.count, f.share));
    }
    if let Some(b) = findings.iter().find(|f| f.burst.is_some()) {
        let burst = b.burst.as_ref().expect("checked");
        s.push_str(&format!(" Burst: #{} \u{d7}{} within {} from {}.", b.rank, burst.count, burst.window, burst.start));
    }
    s
}
