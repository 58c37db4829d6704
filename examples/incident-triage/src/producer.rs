//! The analysis producer: reads a log with [`crate::analysis::Analyzer`] in blocks (on Tokio's
//! blocking pool) and appends JSON events to the run's stream at a human pace.
//!
//! Events (one JSON object per append, `seq` counting from 0 with no gap):
//!
//! ```json
//! {"seq":0,"type":"started","engineer":"alice","run":"…","source":"/var/log/syslog","bytes_total":81234,"worker":"host pid 4242"}
//! {"seq":1,"type":"progress","percent":5,"bytes_read":4100,"bytes_total":81234,"lines":51,"errors":3,"warnings":1,"signatures":2}
//! {"seq":21,"type":"finding","rank":1,"severity":"error","signature":"db: connection to <ip> refused","count":200,"share":64.1,
//!  "first":{"line":17,"at":"2025-01-31T12:00:01Z"},"last":{…},"sample":"…","burst":{"count":120,"window":"1 min","start":"…","times_mean":18.0}}
//! {"seq":31,"type":"summary","headline":"…","lines":…,"bytes":…,"errors":…,"warnings":…,"signatures":…,"signatures_capped":false,
//!  "untracked_lines":0,"timestamped_lines":…,"first_at":…,"last_at":…,"findings":10,"elapsed_ms":9120}
//! ```
//!
//! Pace: a progress event each time another `progress_step` percent of the bytes is read, and
//! one finding per tick, each followed by a `pace` pause (so a run takes about
//! `(100 / progress_step + findings) × pace` plus the reading time). A refused append (the run
//! was cancelled or ended elsewhere) stops the producer at once.

use std::fs::File;
use std::io::{BufRead, BufReader, Cursor, Read};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use baton_streams::Producer;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::analysis::{headline, read_line_capped, Analyzer, Limits};

/// Where the log comes from (command params field `source`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum LogSource {
    /// A file on the server, under one of the allowed log directories.
    Path { path: String },
    /// Log text uploaded with the request (at most [`crate::MAX_UPLOAD_BYTES`]).
    Text { name: String, text: String },
}

impl LogSource {
    /// A short label: the path, or `upload:<name>`.
    pub fn label(&self) -> String {
        match self {
            LogSource::Path { path } => path.clone(),
            LogSource::Text { name, .. } => format!("upload:{name}"),
        }
    }
}

/// How the producer paces and bounds itself.
#[derive(Clone, Debug)]
pub struct PaceSettings {
    /// Pause after each progress and finding event. Default 250 ms.
    pub pace: Duration,
    /// Percent of the bytes between progress events (1 to 100). Default 5.
    pub progress_step: u8,
    /// Findings reported (top signatures). Default 10.
    pub top_findings: usize,
    /// Analysis caps.
    pub limits: Limits,
}

impl Default for PaceSettings {
    fn default() -> Self {
        Self { pace: Duration::from_millis(250), progress_step: 5, top_findings: 10, limits: Limits::default() }
    }
}

/// Why the producer stopped early.
#[derive(Debug, thiserror::Error)]
pub enum ProduceError {
    /// The log could not be read.
    #[error("cannot read {source_label}: {error}")]
    Read { source_label: String, error: std::io::Error },
    /// The stream refused an append (ended elsewhere, fenced, deleted) or failed.
    #[error("stream refused the event: {0}")]
    Stream(#[from] baton_streams::StreamError),
    /// Stopped by this process (the Stop button, shutdown).
    #[error("stopped")]
    Stopped,
}

struct Scan {
    reader: Box<dyn BufRead + Send>,
    analyzer: Analyzer,
    line: Vec<u8>,
    read: u64,
    eof: bool,
}

impl Scan {
    /// Reads lines until `until` bytes were read in total, or the end.
    fn block(&mut self, until: u64) -> std::io::Result<()> {
        let cap = self.analyzer.limits().max_line_len;
        while self.read < until {
            let n = read_line_capped(&mut *self.reader, &mut self.line, cap)?;
            if n == 0 {
                self.eof = true;
                break;
            }
            self.read += n as u64;
            self.analyzer.feed(&self.line, n);
        }
        Ok(())
    }
}

/// Opens `source` (a file is read only up to its size now, so a growing log still ends).
/// Returns the reader and the byte count.
pub fn open_source(source: &LogSource) -> std::io::Result<(Box<dyn BufRead + Send>, u64)> {
    match source {
        LogSource::Path { path } => {
            let f = File::open(PathBuf::from(path))?;
            let len = f.metadata()?.len();
            Ok((Box::new(BufReader::with_capacity(64 * 1024, f.take(len))), len))
        }
        LogSource::Text { text, .. } => {
            let bytes = text.clone().into_bytes();
            let len = bytes.len() as u64;
            Ok((Box::new(Cursor::new(bytes)), len))
        }
    }
}

/// Appends one event with its `seq`.
struct Emitter {
    producer: Producer,
    seq: u64,
    stop: CancellationToken,
}

impl Emitter {
    async fn emit(&mut self, kind: &str, mut body: Value) -> Result<(), ProduceError> {
        if self.stop.is_cancelled() {
            return Err(ProduceError::Stopped);
        }
        let obj = body.as_object_mut().expect("events are objects");
        obj.insert("seq".into(), self.seq.into());
        obj.insert("type".into(), kind.into());
        self.producer.append(serde_json::to_vec(&body).expect("serializable")).await?;
        self.seq += 1;
        Ok(())
    }

    async fn pause(&self, d: Duration) -> Result<(), ProduceError> {
        tokio::select! {
            _ = tokio::time::sleep(d) => Ok(()),
            _ = self.stop.cancelled() => Err(ProduceError::Stopped),
        }
    }
}

/// Runs one analysis as the producer of a run (see the module docs for the events).
pub async fn produce(
    producer: Producer,
    source: LogSource,
    header: Value,
    settings: PaceSettings,
    stop: CancellationToken,
) -> Result<(), ProduceError> {
    let started = Instant::now();
    let label = source.label();
    let read_err = |error| ProduceError::Read { source_label: label.clone(), error };
    let (reader, total) = open_source(&source).map_err(read_err)?;
    let mut em = Emitter { producer, seq: 0, stop };
    let mut start = header;
    start["source"] = label.clone().into();
    start["bytes_total"] = total.into();
    em.emit("started", start).await?;
    let mut scan =
        Scan { reader, analyzer: Analyzer::new(settings.limits.clone()), line: Vec::new(), read: 0, eof: false };
    let step = settings.progress_step.clamp(1, 100) as u64;
    let mut percent = 0;
    while !scan.eof && percent < 100 {
        percent = (percent + step).min(100);
        let until = if percent >= 100 { u64::MAX } else { total * percent / 100 };
        scan = tokio::task::spawn_blocking(move || scan.block(until).map(|_| scan))
            .await
            .map_err(|e| read_err(std::io::Error::other(e.to_string())))?
            .map_err(read_err)?;
        let t = scan.analyzer.totals();
        let shown = (scan.read * 100).checked_div(total).map_or(100, |p| p.min(100));
        em.emit(
            "progress",
            json!({"percent": shown, "bytes_read": scan.read, "bytes_total": total, "lines": t.lines,
                   "errors": t.errors, "warnings": t.warnings, "signatures": t.signatures}),
        )
        .await?;
        em.pause(settings.pace).await?;
    }
    let findings = scan.analyzer.findings(settings.top_findings);
    for f in &findings {
        em.emit("finding", serde_json::to_value(f).expect("serializable")).await?;
        em.pause(settings.pace).await?;
    }
    let t = scan.analyzer.totals();
    let mut summary = serde_json::to_value(&t).expect("serializable");
    summary["headline"] = headline(&t, &findings).into();
    summary["findings"] = findings.len().into();
    summary["elapsed_ms"] = (started.elapsed().as_millis() as u64).into();
    em.emit("summary", summary).await?;
    Ok(())
}
