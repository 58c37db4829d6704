//! Output streams: a durable stream a command owns (its state's [`CommandState::output`]), that
//! its handler writes to and that ends with the command (crate docs, "Output streams").
//!
//! The rule: **the stream's end is the arbiter; whoever ends it first decides**, and the command's
//! terminal status always agrees with its output's end (`SUCCEEDED` ⇔ `finished` without an
//! error entry last, `FAILED` ⇔ `finished` after an error entry or `producer_lost`, `CANCELLED`
//! ⇔ `cancelled`). Two directions:
//! * **command → stream**: every terminal write ends the output *first*, then writes the state,
//!   and writes it only if its end took place. A cancel ([`crate::CommandStore::cancel`]) ends
//!   it `cancelled`; a handler's terminal outcome (in process or remote) ends it `finished`
//!   (`SUCCEEDED`) or `finished` after an error entry (`FAILED`: `{"error": <error>}` on a JSON
//!   stream, `error: <error>` otherwise, the convention of [`Producer::fail`]), entry and end in
//!   one atomic step ([`StreamStore::end_fenced`]). That end is fenced to the delivery: it takes
//!   place only while producer [`OUTPUT_PRODUCER`]'s epoch is the delivery's (the epoch current
//!   when an in-process delivery began, or the latest its [`Output::open`] claimed; the epoch a
//!   remote worker's claim claimed, signed into its lease). So a stale delivery (an in-process
//!   handler whose lease was taken over, a remote worker whose claim was superseded) cannot end
//!   the stream of a delivery that has opened it since: its outcome is refused
//!   (`LeaseLost`) and nothing is written. (A stale delivery whose successor has not opened the
//!   stream yet can still end it first; its state write is then refused by the lease's own
//!   check, and the successor's outcome is decided by that end, as below.) An in-process handler
//!   that claims the producer itself rather than through [`Output::open`]
//!   ([`StreamStore::open`] or [`StreamStore::spawn`] with [`OutputLink::open_options`]) finds
//!   its end fenced by its own newer epoch: while its lease is held, that epoch is taken as the
//!   delivery's and the end is tried once more with it.
//! * **stream → command**: when an output has ended first (a cancel, the producer's own finish
//!   or error entry, `producer_lost`, or an earlier delivery's end), its end decides the outcome
//!   of the handler call that ends after it (`execute` or `check_status`, in process or remote):
//!   `cancelled` → `CANCELLED`; `producer_lost` → `FAILED` (the handler's own failure text if it
//!   returned one); `finished` → `FAILED` when the stream's last entry is an error entry (the
//!   handler's failure text if it returned one, else the entry's), else `SUCCEEDED` (the
//!   handler's result if it returned `SUCCEEDED`, else `null`). A handler that says `running`
//!   in the call during which the stream finished is asked once more (at its next check) before
//!   that: its result, if it has one by then, is the command's.
//!
//! A crash between a delivery's end of the output and its state write: the command is
//! redelivered (after the claim timeout) and its handler called again, and the end decides that
//! call's outcome as above, so the command reaches the status the end says. The lost result
//! itself is not recovered: the command's result is the new call's if it agrees with the end
//! (its `SUCCEEDED` result, its failure text), else `null` (the error entry's text for
//! `FAILED`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_streams::{
    CreateOptions, EndReason, Offset, OpenOptions, Producer, ReadFrom, RunLimits, StreamError, StreamPath, StreamStore,
};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::{CommandError, CommandResult, CommandStatus, Lifetimes};

/// What a submit asks of a command's output stream ([`crate::Command::with_output`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutputSpec {
    /// The stream's path; `None`: `commands/<id>`. A re-run writes to `<path>/run-<n>` (n = 2, 3, …).
    /// The stream is made at submit for this command: a path where another stream exists (not
    /// made by a submit of this id) is refused ([`CommandError::OutputInUse`]).
    pub path: Option<String>,
    /// Content type; `None`: `application/json`.
    pub content_type: Option<String>,
    /// The stream ends `producer_lost` (and the command `FAILED`) after this long with no append
    /// and no keepalive, counted from the first delivery's open of the stream (not while the
    /// command waits in its queue). `None` (the default): never. Set it when a producer outlives the handler
    /// call that started it (a handler that spawns the producer and returns `running`): nothing
    /// else notices that producer's death.
    pub silence_timeout: Option<Duration>,
}

impl OutputSpec {
    /// The stream path a submit of command `id` with this spec gets (before any check):
    /// [`OutputSpec::path`] without its leading `/`, else `commands/<id>`.
    pub fn stream_for(&self, id: &str) -> String {
        match &self.path {
            Some(p) => p.trim_start_matches('/').to_string(),
            None => format!("commands/{id}"),
        }
    }
}

/// The producer id of every output stream's writer: each delivery's [`Output::open`] claims a
/// new epoch of it, fencing the writer of an earlier delivery (a process taken for dead).
pub const OUTPUT_PRODUCER: &str = "command";

/// A command's output stream, as its state records it (`output` in the state's JSON). Its
/// limits are fixed at submit (or re-run), so every open of the stream asks for the same ones.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputLink {
    /// The stream's path (read it at `/v1/stream/<stream>` over HTTP).
    pub stream: String,
    /// The run of the command it belongs to: 1 for the submit, +1 per re-run.
    pub run: u32,
    pub content_type: String,
    /// See [`OutputSpec::silence_timeout`]; ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub silence_timeout_ms: Option<u64>,
    /// The stream is deleted this long after its creation (the home queue's `state_ttl`); ms.
    pub max_run_ms: u64,
    /// The stream is kept this long after its end (the home queue's `retention`); ms.
    pub done_ttl_ms: u64,
}

impl OutputLink {
    /// The link of run 1 of command `id`, from `spec` and the home queue's lifetimes.
    /// Errors: [`CommandError::InvalidParams`] for a bad path or a zero silence timeout.
    pub(crate) fn new(id: &str, spec: &OutputSpec, lifetimes: Lifetimes) -> Result<Self, CommandError> {
        let stream = spec.stream_for(id);
        let path = StreamPath::new(&stream).map_err(|e| CommandError::InvalidParams(format!("output path: {e}")))?;
        if spec.silence_timeout.is_some_and(|d| d < Duration::from_millis(1)) {
            return Err(CommandError::InvalidParams("output silence_timeout must be at least 1 ms".into()));
        }
        Ok(Self {
            stream: path.as_str().to_string(),
            run: 1,
            content_type: spec.content_type.clone().unwrap_or_else(|| "application/json".into()),
            silence_timeout_ms: spec.silence_timeout.map(|d| d.as_millis() as u64),
            max_run_ms: lifetimes.state_ttl.as_millis() as u64,
            done_ttl_ms: lifetimes.retention.as_millis() as u64,
        })
    }

    /// The link of the next run (a re-run): `<base>/run-<n>`.
    pub(crate) fn next_run(&self) -> Self {
        let base = match self.run {
            1 => self.stream.as_str(),
            n => self.stream.strip_suffix(&format!("/run-{n}")).unwrap_or(&self.stream),
        };
        let run = self.run + 1;
        Self { stream: format!("{base}/run-{run}"), run, ..self.clone() }
    }

    /// True when `other` (a submit's link, run 1) asks for the same output as this one, this
    /// one's run aside: same base path, content type and silence timeout (the lifetimes come from
    /// the queue's settings, not from the submit, so they are not compared).
    pub(crate) fn same_request(&self, other: &OutputLink) -> bool {
        let base = match self.run {
            1 => self.stream.as_str(),
            n => self.stream.strip_suffix(&format!("/run-{n}")).unwrap_or(&self.stream),
        };
        base == other.stream
            && self.content_type == other.content_type
            && self.silence_timeout_ms == other.silence_timeout_ms
    }

    /// The URL path that reads the stream over HTTP: `/v1/stream/<stream>`, each segment
    /// percent-encoded (RFC 3986 unreserved characters kept).
    pub fn url(&self) -> String {
        let mut out = String::from("/v1/stream");
        for seg in self.stream.split('/') {
            out.push('/');
            for b in seg.bytes() {
                if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
                    out.push(b as char);
                } else {
                    out.push_str(&format!("%{b:02X}"));
                }
            }
        }
        out
    }

    /// The stream path (checked at submit).
    pub fn path(&self) -> StreamPath {
        StreamPath::new(&self.stream).expect("checked at submit")
    }

    /// The run limits every create and open of the stream gives.
    pub fn limits(&self) -> RunLimits {
        RunLimits {
            silence_timeout: self.silence_timeout_ms.map(Duration::from_millis),
            max_run: Some(Duration::from_millis(self.max_run_ms)),
            done_ttl: Some(Duration::from_millis(self.done_ttl_ms)),
            ..RunLimits::default()
        }
    }

    /// How to open the stream as its writer (producer [`OUTPUT_PRODUCER`]), e.g. for
    /// [`StreamStore::spawn`].
    pub fn open_options(&self) -> OpenOptions {
        OpenOptions {
            content_type: Some(self.content_type.clone()),
            limits: Some(self.limits()),
            producer_id: Some(OUTPUT_PRODUCER.into()),
            ..OpenOptions::default()
        }
    }

    fn is_json(&self) -> bool {
        baton_streams::is_json(&self.content_type)
    }
}

/// The public (HTTP) form of an [`OutputLink`]: its fields and `url` ([`OutputLink::url`]).
#[derive(Serialize)]
pub(crate) struct PublicOutput<'a> {
    #[serde(flatten)]
    pub link: &'a OutputLink,
    pub url: String,
}

/// A handler's access to its command's output stream ([`crate::Command::output`]).
#[derive(Clone)]
pub struct Output {
    pub(crate) streams: StreamStore,
    pub(crate) link: OutputLink,
    pub(crate) cancel: CancellationToken,
    /// The epoch of producer [`OUTPUT_PRODUCER`] this delivery holds: the one current when the
    /// delivery began, then the latest its [`Output::open`] claimed (the fence of its end).
    pub(crate) epoch: Arc<Mutex<Option<u64>>>,
}

impl std::fmt::Debug for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Output").field("link", &self.link).finish_non_exhaustive()
    }
}

impl Output {
    /// The link, as the state records it.
    pub fn link(&self) -> &OutputLink {
        &self.link
    }

    /// The stream path.
    pub fn path(&self) -> StreamPath {
        self.link.path()
    }

    /// The stream store the output lives in.
    pub fn streams(&self) -> &StreamStore {
        &self.streams
    }

    /// Opens the stream as its writer: creates it if it is missing (idempotent) and claims a new
    /// producer epoch, which fences the writer of an earlier delivery of the command. Errors:
    /// those of [`StreamStore::open`]; `Closed` when the output already ended.
    pub async fn open(&self) -> Result<OutputWriter, StreamError> {
        let producer = self.streams.open(&self.path(), self.link.open_options()).await?;
        {
            let mut e = self.epoch.lock().expect("lock");
            *e = Some(e.map_or(producer.epoch(), |e| e.max(producer.epoch())));
        }
        Ok(OutputWriter { producer, cancel: self.cancel.clone() })
    }
}

/// The writer of a command's output ([`Output::open`]). An append refused because the stream
/// ended `cancelled` or `producer_lost` also fires the command's cancellation signal
/// ([`crate::Command::cancelled`]): the command ends with the stream, so the handler should stop.
#[derive(Clone)]
pub struct OutputWriter {
    producer: Producer,
    cancel: CancellationToken,
}

impl OutputWriter {
    /// Appends one event (see [`Producer::append`]). Errors: those of [`Producer::append`].
    pub async fn append(&self, data: impl Into<Bytes>) -> Result<Offset, StreamError> {
        let r = self.producer.append(data).await;
        if let Err(StreamError::Closed { end, .. }) = &r {
            if end.reason != EndReason::Finished {
                self.cancel.cancel();
            }
        }
        r
    }

    /// Appends `value` as JSON. Errors: those of [`OutputWriter::append`].
    pub async fn append_json<T: Serialize + ?Sized>(&self, value: &T) -> Result<Offset, StreamError> {
        let body = serde_json::to_vec(value).map_err(|e| StreamError::InvalidJson { detail: e.to_string() })?;
        self.append(body).await
    }

    /// The underlying producer (keepalives, an early `finish`).
    pub fn producer(&self) -> &Producer {
        &self.producer
    }
}

/// The owner mark of the output streams made for command `id` ([`CreateOptions::owner`]): 24
/// hex digits of the SHA-256 of the id, so a stream found at an output's path tells whether a
/// submit of this command made it.
pub(crate) fn owner_mark(id: &str) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(id.as_bytes());
    d.iter().take(12).map(|b| format!("{b:02x}")).collect()
}

/// How a submit creates `link`'s stream, marked for `owner` ([`owner_mark`]).
pub(crate) fn create_options(link: &OutputLink, owner: &str) -> CreateOptions {
    CreateOptions {
        content_type: Some(link.content_type.clone()),
        limits: Some(link.limits()),
        owner: Some(owner.to_string()),
        // The silence timeout is the producer's: it counts from the first delivery's open, not
        // while the command waits in its queue.
        silence_from_open: true,
        ..CreateOptions::default()
    }
}

/// Which epoch of producer [`OUTPUT_PRODUCER`] a delivery's terminal write is fenced to
/// ([`end_fenced`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OutputFence {
    /// The delivery's: the epoch current when it began (`None`: none claimed yet), or the
    /// latest it claimed since (an in-process [`Output::open`], a remote worker's claim).
    Delivery(Option<u64>),
    /// Not known (no handler ran, or a remote lease signed before leases carried it): the
    /// epoch current at the write.
    Unknown,
}

/// What [`end_fenced`] found.
#[derive(Debug)]
pub(crate) enum FencedEnd {
    /// This write ended the output as `status` says, or the output is gone (nothing to end).
    Ended,
    /// The output had ended first: that end decides ([`decide`]).
    EndedBefore,
    /// A later delivery holds the output (a newer epoch of [`OUTPUT_PRODUCER`]): this one is
    /// stale. The current epoch.
    Fenced(u64),
}

/// The terminal write's end of `link`'s output (module docs, command → stream): `status`
/// (`SUCCEEDED` as `finished`, `CANCELLED` as `cancelled`, `FAILED` as `finished` after an error
/// entry of `error`) in one atomic step that happens only if the output has not ended and
/// producer [`OUTPUT_PRODUCER`]'s epoch is `fence`'s. Errors: [`CommandError::Output`] when the
/// stream could not be reached (after a few tries).
pub(crate) async fn end_fenced(
    streams: &StreamStore,
    link: &OutputLink,
    status: CommandStatus,
    error: Option<&str>,
    fence: OutputFence,
) -> Result<FencedEnd, CommandError> {
    let (reason, entry) = match status {
        CommandStatus::Succeeded => (EndReason::Finished, None),
        CommandStatus::Cancelled => (EndReason::Cancelled, None),
        CommandStatus::Failed => {
            let e = error.unwrap_or("failed");
            let entry =
                if link.is_json() { serde_json::json!({ "error": e }).to_string() } else { format!("error: {e}") };
            (EndReason::Finished, Some((Bytes::from(entry), link.content_type.clone())))
        }
        _ => return Ok(FencedEnd::Ended),
    };
    let path = link.path();
    let mut delay = Duration::from_millis(50);
    let mut attempt = 0;
    loop {
        let epoch = match fence {
            OutputFence::Delivery(e) => Ok(e),
            OutputFence::Unknown => streams.producer_epoch(&path, OUTPUT_PRODUCER).await,
        };
        let r = match epoch {
            Ok(epoch) => streams.end_fenced(&path, reason, entry.clone(), OUTPUT_PRODUCER, epoch).await,
            Err(e) => Err(e),
        };
        match r {
            Ok(e) if e.ended_now => return Ok(FencedEnd::Ended),
            Ok(_) => return Ok(FencedEnd::EndedBefore),
            Err(StreamError::NotFound { .. } | StreamError::Gone { .. }) => return Ok(FencedEnd::Ended),
            Err(StreamError::Fenced { current_epoch, .. }) if matches!(fence, OutputFence::Delivery(_)) => {
                return Ok(FencedEnd::Fenced(current_epoch))
            }
            Err(e @ StreamError::Backend(_)) | Err(e @ StreamError::Fenced { .. }) if attempt < 4 => {
                tracing::debug!(%path, error = %e, "ending the output failed; retrying");
                attempt += 1;
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            Err(e) => return Err(CommandError::Output(format!("ending {path}: {e}"))),
        }
    }
}

/// The stream → command direction of the module docs: what the output's end, if it ended,
/// makes of `result` (the handler's, `None` for an error or no call); `None`: the output has not
/// ended (or cannot be read: the handler's outcome stands).
///
/// `called_at` (ms since the Unix epoch): when the handler call that gave `result` began. A
/// stream that ended `finished` while that call ran, with the call's answer `running`, does not
/// decide yet: the handler may not have seen the end, and its next call may bring the result
/// (the producer finished the stream a moment before the handler had its result ready). Once
/// the handler says `running` in a call that began after the end, the command is `SUCCEEDED`
/// with result `null`: the stream is all it produced.
pub(crate) async fn decide(
    streams: &StreamStore,
    link: &OutputLink,
    result: Option<&CommandResult>,
    called_at: u64,
) -> Option<CommandResult> {
    let path = link.path();
    let info = match streams.head(&path).await {
        Ok(i) => i,
        Err(StreamError::NotFound { .. } | StreamError::Gone { .. }) => return None,
        Err(e) => {
            tracing::warn!(%path, error = %e, "could not read the command's output stream; the handler's outcome stands");
            return None;
        }
    };
    let end = info.end?;
    let handler_failed = match result {
        Some(CommandResult::Failed(e)) => Some(e.clone()),
        _ => None,
    };
    Some(match end.reason {
        EndReason::Cancelled => CommandResult::Cancelled,
        EndReason::ProducerLost => CommandResult::Failed(handler_failed.unwrap_or_else(|| {
            let silence = link.silence_timeout_ms.map(Duration::from_millis).unwrap_or_default();
            format!(
                "output stream {path} ended producer_lost: nothing was appended to it for {}",
                humantime::format_duration(silence)
            )
        })),
        EndReason::Finished => {
            if result.is_some_and(|r| !r.is_terminal()) && info.ended_at.is_some_and(|t| t >= called_at) {
                return None;
            }
            // The status is the stream's (an error entry last: FAILED); the handler's result
            // or error text fills it in when it agrees.
            match (last_error(streams, link).await, result) {
                (Some(_), Some(CommandResult::Failed(e))) => CommandResult::Failed(e.clone()),
                (Some(entry), _) => CommandResult::Failed(entry),
                (None, Some(CommandResult::Succeeded(v))) => CommandResult::Succeeded(v.clone()),
                (None, _) => CommandResult::Succeeded(crate::RawJson::null()),
            }
        }
    })
}

/// The error of the output's last entry, if it is an error entry.
async fn last_error(streams: &StreamStore, link: &OutputLink) -> Option<String> {
    let path = link.path();
    let mut from = ReadFrom::Start;
    let mut last: Option<Bytes> = None;
    loop {
        let chunk = streams.read(&path, from).await.ok()?;
        if let Some(r) = chunk.records.last() {
            last = Some(r.data.clone());
        }
        if chunk.up_to_date || chunk.records.is_empty() {
            break;
        }
        from = ReadFrom::At(chunk.next_offset);
    }
    let last = last?;
    if link.is_json() {
        let v: serde_json::Value = serde_json::from_slice(&last).ok()?;
        let e = v.as_object().filter(|o| o.len() == 1)?.get("error")?;
        Some(e.as_str().map(str::to_string).unwrap_or_else(|| e.to_string()))
    } else {
        std::str::from_utf8(&last).ok()?.strip_prefix("error: ").map(str::to_string)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_run_gets_its_own_path_on_the_base() {
        let l = Lifetimes { state_ttl: Duration::from_secs(60), retention: Duration::from_secs(10) };
        let first = OutputLink::new("c-1", &OutputSpec::default(), l).unwrap();
        assert_eq!(
            (first.stream.as_str(), first.run, first.max_run_ms, first.done_ttl_ms),
            ("commands/c-1", 1, 60_000, 10_000)
        );
        let second = first.next_run();
        assert_eq!((second.stream.as_str(), second.run), ("commands/c-1/run-2", 2));
        let third = second.next_run();
        assert_eq!((third.stream.as_str(), third.run), ("commands/c-1/run-3", 3));
        let custom = OutputSpec { path: Some("/team/x".into()), ..OutputSpec::default() };
        assert_eq!(OutputLink::new("c-1", &custom, l).unwrap().stream, "team/x");
        let odd = OutputSpec { path: Some("a b/ü%/x".into()), ..OutputSpec::default() };
        assert_eq!(OutputLink::new("c-1", &odd, l).unwrap().url(), "/v1/stream/a%20b/%C3%BC%25/x");
        assert_eq!(first.url(), "/v1/stream/commands/c-1");
        let zero = OutputSpec { silence_timeout: Some(Duration::ZERO), ..OutputSpec::default() };
        assert!(matches!(OutputLink::new("c-1", &zero, l), Err(CommandError::InvalidParams(_))));
    }
}
