//! The triage service: command handlers, runs and the per-engineer pointer.
//!
//! Flow of one run (see the example's README.md):
//! 1. [`Triage::start_run`] claims the engineer's pointer (or takes it over from an ended run),
//!    then submits a `triage` command (id = run id) on queue `lifecycle` that owns its output
//!    stream `triage/<engineer>/<run>` (`Command::with_output`, silence timeout
//!    `silence_timeout`): the command service creates the stream at submit, so browsers can
//!    attach at once, and ends it with the command.
//! 2. `execute` (queue `lifecycle`, claim timeout 60 s) finds the stream (the submit created it
//!    before the command could be delivered; one ended by a Stop is left), spawns the analysis
//!    producer
//!    ([`crate::producer::produce`]) on the command's output (`Command::output`: producer
//!    `command`, a new epoch per delivery) and returns `handed_off("monitor")`. The producer
//!    keeps the stream open after its summary: the command's end ends it.
//! 3. `check_status` (queue `monitor`, every `check_interval`, 1 s by default) reads the stream:
//!    once the producer wrote its summary it completes the command `SUCCEEDED` (result: the
//!    summary), which ends the stream `finished`; `FAILED` if the producer's last event is an
//!    `{"error":…}`. A stream that ended otherwise is the command service's to map, at the end
//!    of that call: `cancelled` → `CANCELLED`, `producer_lost` → `FAILED` (saying the stream went
//!    silent for the silence timeout). The pointer is released then.
//! 4. [`Triage::stop_run`] cancels the command (`CommandStore::cancel`): the command service
//!    ends its output `cancelled` in the same call (readers see it at once); a producer running
//!    in this process is stopped at once and the pointer released; a producer in another
//!    process has its next append refused and stops.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use baton_commands::{
    Command, CommandError, CommandHandler, CommandResult, CommandService, CommandState, CommandStatus, CommandStore,
    HandlerError, OutputSpec, QueueSettings, RedisCommandStoreOptions,
};
use baton_redis::{RedisClient, RedisConfig};
use baton_streams::{EndReason, ReadFrom, RunLimits, StreamError, StreamPath, StreamStore, StreamStoreSettings};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::pointer::Pointers;
use crate::producer::{produce, LogSource, PaceSettings};

/// Queue of the `triage` command's `execute` (claim timeout 60 s).
pub const LIFECYCLE_QUEUE: &str = "lifecycle";
/// Queue the command is handed off to; its `check_status` follows the stream.
pub const MONITOR_QUEUE: &str = "monitor";
/// The command type.
pub const COMMAND_TYPE: &str = "triage";
/// Largest uploaded log text, bytes (1 MiB): it travels in the command's params.
pub const MAX_UPLOAD_BYTES: usize = 1 << 20;
const JSON: &str = "application/json";

/// Settings of a triage service.
#[derive(Clone, Debug)]
pub struct TriageConfig {
    /// Redis URL (`redis://host:port`); `None`: the in-memory backends (one process).
    pub redis: Option<String>,
    /// Key prefix of the command store and the pointers. Default `baton`.
    pub key_prefix: String,
    /// A run with no event nor keepalive for this long ends as `producer_lost`. Default 10 s.
    pub silence_timeout: Duration,
    /// `monitor` queue: delay between `check_status` calls. Default 1 s.
    pub check_interval: Duration,
    /// `lifecycle` queue claim timeout. Default 60 s.
    pub lifecycle_claim_timeout: Duration,
    /// `monitor` queue claim timeout (a dead monitor's command moves to another process after
    /// this). Default 10 s.
    pub monitor_claim_timeout: Duration,
    /// Directories whose files may be analysed (canonicalised). Default `/var/log`.
    pub log_dirs: Vec<PathBuf>,
    /// Producer pace and caps.
    pub pace: PaceSettings,
    /// A name for this process in `started` events (default `<hostname> pid <pid>`).
    pub worker: String,
}

impl Default for TriageConfig {
    fn default() -> Self {
        let host = std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_string()).unwrap_or_default();
        Self {
            redis: None,
            key_prefix: "baton".into(),
            silence_timeout: Duration::from_secs(10),
            check_interval: Duration::from_secs(1),
            lifecycle_claim_timeout: Duration::from_secs(60),
            monitor_claim_timeout: Duration::from_secs(10),
            log_dirs: vec![PathBuf::from("/var/log")],
            pace: PaceSettings::default(),
            worker: format!("{} pid {}", if host.is_empty() { "localhost" } else { &host }, std::process::id()),
        }
    }
}

/// Params of a `triage` command.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TriageParams {
    pub engineer: String,
    pub run: String,
    pub source: LogSource,
}

/// What a caller learns about a run.
#[derive(Clone, Debug, Serialize)]
pub struct RunInfo {
    pub engineer: String,
    pub run: String,
    /// `triage/<engineer>/<run>`.
    pub stream: String,
    pub source: Option<String>,
    /// The command's persisted status (`SUBMITTED`, `RUNNING`, `SUCCEEDED`, `FAILED`,
    /// `CANCELLED`), `None` when the command is gone (expired).
    pub status: Option<CommandStatus>,
    /// The command's error (`FAILED`).
    pub error: Option<String>,
    /// The stream's end reason (`finished`, `cancelled`, `producer_lost`) once it ended.
    pub stream_end: Option<String>,
    /// Events in the stream so far.
    pub events: u64,
}

/// Errors of the triage API.
#[derive(Debug, thiserror::Error)]
pub enum TriageError {
    #[error("{0}")]
    Invalid(String),
    #[error("engineer {engineer} already has a run in progress ({run})")]
    Busy { engineer: String, run: String },
    #[error("no such run")]
    NotFound,
    #[error("command store: {0}")]
    Commands(#[from] CommandError),
    #[error("stream store: {0}")]
    Streams(#[from] StreamError),
    #[error("redis: {0}")]
    Redis(#[from] baton_redis::redis::RedisError),
    #[error(transparent)]
    Connect(#[from] baton_redis::ConnectError),
}

/// The stream path of a run.
pub fn stream_path(engineer: &str, run: &str) -> StreamPath {
    StreamPath::new(format!("triage/{engineer}/{run}")).expect("validated engineer and run ids")
}

/// Engineer ids: 1 to 64 of `A-Z a-z 0-9 . _ -`.
pub fn valid_engineer(e: &str) -> bool {
    !e.is_empty()
        && e.len() <= 64
        && e.bytes().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
        && e != "."
        && e != ".."
}

fn valid_run(r: &str) -> bool {
    !r.is_empty() && r.len() <= 64 && r.bytes().all(|c| c.is_ascii_hexdigit() || c == b'-')
}

/// State shared with the handlers.
pub(crate) struct Shared {
    pub cfg: TriageConfig,
    pub commands: CommandStore,
    pub streams: StreamStore,
    pub pointers: Pointers,
    /// Producers running in this process: run id → stop signal.
    pub local: Mutex<HashMap<String, CancellationToken>>,
}

/// The triage service of one process (cheap to clone).
#[derive(Clone)]
pub struct Triage {
    pub(crate) shared: Arc<Shared>,
    services: Arc<Mutex<Vec<CommandService>>>,
}

impl Triage {
    /// Connects the backends (Redis when `cfg.redis` is set, else memory) and starts the
    /// `monitor` and `lifecycle` command services.
    pub async fn start(cfg: TriageConfig) -> Result<Self, TriageError> {
        let limits = RunLimits { silence_timeout: Some(cfg.silence_timeout), ..RunLimits::default() };
        let settings = StreamStoreSettings { default_limits: limits, ..StreamStoreSettings::default() };
        let pointer_ttl = limits.max_run.unwrap_or(Duration::from_secs(86_400));
        let (commands, streams, pointers) = match &cfg.redis {
            None => (CommandStore::memory(), StreamStore::memory(settings), Pointers::memory(pointer_ttl)),
            Some(url) => {
                let config = RedisConfig::standalone(url.clone());
                let client = RedisClient::new(config.clone())?;
                let opts = RedisCommandStoreOptions {
                    key_prefix: cfg.key_prefix.clone(),
                    ..RedisCommandStoreOptions::default()
                };
                let commands = CommandStore::redis(client.clone(), opts).await?;
                let streams = StreamStore::redis(config, settings).await?;
                let pointers = Pointers::redis(&client, &cfg.key_prefix, pointer_ttl).await?;
                (commands, streams, pointers)
            }
        };
        // The runs are the `triage` commands' output streams.
        commands.set_outputs(streams.clone())?;
        let shared = Arc::new(Shared { cfg, commands, streams, pointers, local: Mutex::new(HashMap::new()) });
        let monitor = CommandService::builder(shared.commands.clone(), MONITOR_QUEUE)
            .settings(QueueSettings {
                claim_timeout: shared.cfg.monitor_claim_timeout,
                check_status_interval: shared.cfg.check_interval,
                consumer_prefix: "triage-monitor".into(),
                ..QueueSettings::default()
            })
            .handler(COMMAND_TYPE, Monitor(shared.clone()))
            .start()
            .await?;
        let lifecycle = CommandService::builder(shared.commands.clone(), LIFECYCLE_QUEUE)
            .settings(QueueSettings {
                claim_timeout: shared.cfg.lifecycle_claim_timeout,
                check_status_interval: shared.cfg.check_interval,
                consumer_prefix: "triage-lifecycle".into(),
                ..QueueSettings::default()
            })
            .handler(COMMAND_TYPE, Lifecycle(shared.clone()))
            .start()
            .await?;
        Ok(Self { shared, services: Arc::new(Mutex::new(vec![monitor, lifecycle])) })
    }

    /// The settings in use.
    pub fn config(&self) -> &TriageConfig {
        &self.shared.cfg
    }

    /// The stream store (for readers).
    pub fn streams(&self) -> &StreamStore {
        &self.shared.streams
    }

    /// The command store.
    pub fn commands(&self) -> &CommandStore {
        &self.shared.commands
    }

    /// Runs whose producer runs in this process now (run ids).
    pub fn local_runs(&self) -> Vec<String> {
        self.shared.local.lock().unwrap().keys().cloned().collect()
    }

    /// The pointer store.
    pub fn pointers(&self) -> &Pointers {
        &self.shared.pointers
    }

    /// Stops the command services (running producers in this process are stopped too; their
    /// runs end as `producer_lost` after the silence timeout unless ended otherwise).
    pub async fn shutdown(&self) {
        let services: Vec<_> = std::mem::take(&mut *self.services.lock().unwrap());
        for s in services {
            s.drain(Duration::from_secs(2)).await;
        }
        for (_, t) in self.shared.local.lock().unwrap().drain() {
            t.cancel();
        }
    }

    /// Checks a log source: a path must be an existing regular file under one of the allowed
    /// directories (after resolving symlinks); text must be non-empty and at most
    /// [`MAX_UPLOAD_BYTES`]. Returns the source with the path canonicalised.
    pub fn check_source(&self, source: LogSource) -> Result<LogSource, TriageError> {
        check_source(&self.shared.cfg.log_dirs, source)
    }

    /// Starts a run for `engineer` (see the module docs). Errors: [`TriageError::Busy`] naming
    /// the current run when one is in progress; [`TriageError::Invalid`] for a bad engineer id
    /// or source.
    pub async fn start_run(&self, engineer: &str, source: LogSource) -> Result<RunInfo, TriageError> {
        if !valid_engineer(engineer) {
            return Err(TriageError::Invalid("engineer: use 1 to 64 letters, digits, '.', '_' or '-'".into()));
        }
        let source = self.check_source(source)?;
        let run = uuid::Uuid::now_v7().to_string();
        let p = &self.shared.pointers;
        let mut claimed = false;
        for _ in 0..5 {
            if p.claim(engineer, &run).await? {
                claimed = true;
                break;
            }
            let Some(current) = p.get(engineer).await? else { continue };
            if !self.run_ended(engineer, &current).await? {
                return Err(TriageError::Busy { engineer: engineer.into(), run: current });
            }
            if p.take_over(engineer, &current, &run).await? {
                tracing::info!(engineer, old = %current, new = %run, "pointer taken over from an ended run");
                claimed = true;
                break;
            }
        }
        if !claimed {
            return Err(TriageError::Invalid("the engineer's current run changed repeatedly; try again".into()));
        }
        let params = TriageParams { engineer: engineer.into(), run: run.clone(), source };
        let output = OutputSpec {
            path: Some(stream_path(engineer, &run).as_str().to_string()),
            content_type: Some(JSON.into()),
            silence_timeout: Some(self.shared.cfg.silence_timeout),
        };
        let cmd = Command::with_id(run.clone(), COMMAND_TYPE, serde_json::to_value(&params).expect("serializable"))
            .with_output(output);
        if let Err(e) = self.shared.commands.submit(LIFECYCLE_QUEUE, cmd).await {
            let _ = p.release(engineer, &run).await;
            return Err(e.into());
        }
        self.run_info(engineer, &run).await?.ok_or(TriageError::NotFound)
    }

    /// True when `run` can no longer produce: its stream ended, or it has no stream and its
    /// command is terminal or gone.
    async fn run_ended(&self, engineer: &str, run: &str) -> Result<bool, TriageError> {
        if !valid_run(run) {
            return Ok(true);
        }
        match self.shared.streams.head(&stream_path(engineer, run)).await {
            Ok(info) => Ok(info.end.is_some()),
            Err(StreamError::NotFound { .. }) | Err(StreamError::Gone { .. }) => {
                Ok(self.shared.commands.get(run).await?.is_none_or(|s| s.status.is_terminal()))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The engineer's current run, if the pointer names one.
    pub async fn current_run(&self, engineer: &str) -> Result<Option<RunInfo>, TriageError> {
        if !valid_engineer(engineer) {
            return Err(TriageError::Invalid("bad engineer id".into()));
        }
        match self.shared.pointers.get(engineer).await? {
            Some(run) if valid_run(&run) => self.run_info(engineer, &run).await,
            _ => Ok(None),
        }
    }

    /// What is known of a run: command state and stream head. `None` when neither exists.
    pub async fn run_info(&self, engineer: &str, run: &str) -> Result<Option<RunInfo>, TriageError> {
        if !valid_engineer(engineer) || !valid_run(run) {
            return Ok(None);
        }
        let state = self.shared.commands.get(run).await?;
        if state.as_ref().is_some_and(|s| s.command_type != COMMAND_TYPE) {
            return Ok(None);
        }
        let head = match self.shared.streams.head(&stream_path(engineer, run)).await {
            Ok(h) => Some(h),
            Err(StreamError::NotFound { .. }) | Err(StreamError::Gone { .. }) => None,
            Err(e) => return Err(e.into()),
        };
        if state.is_none() && head.is_none() {
            return Ok(None);
        }
        let source = state.as_ref().and_then(|s| s.params.parse::<TriageParams>().ok()).map(|p| p.source.label());
        Ok(Some(RunInfo {
            engineer: engineer.into(),
            run: run.into(),
            stream: stream_path(engineer, run).as_str().to_string(),
            source,
            status: state.as_ref().map(|s| s.status),
            error: state.as_ref().and_then(|s| s.error.clone()),
            stream_end: head.as_ref().and_then(|h| h.end).map(|e| e.reason.as_str().to_string()),
            events: head.map_or(0, |h| h.len),
        }))
    }

    /// Stops a run: cancels its command, which ends its output stream `cancelled` (readers see
    /// it at once; a command that has ended already is left as it is), stops a producer of this
    /// process at once, and releases the pointer. Returns the run as it is now.
    pub async fn stop_run(&self, engineer: &str, run: &str) -> Result<RunInfo, TriageError> {
        if self.run_info(engineer, run).await?.is_none() {
            return Err(TriageError::NotFound);
        }
        match self.shared.commands.cancel(run).await {
            Ok(st) => tracing::info!(run, status = %st.status, "stop: cancelled"),
            Err(CommandError::AlreadyTerminal(st)) => tracing::info!(run, status = %st.status, "stop: had ended"),
            // The command expired before its stream: end the stream itself.
            Err(CommandError::NotFound(_)) => {
                match self.shared.streams.end(&stream_path(engineer, run), EndReason::Cancelled).await {
                    Ok(_) | Err(StreamError::NotFound { .. }) | Err(StreamError::Gone { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        }
        if let Some(t) = self.shared.local.lock().unwrap().remove(run) {
            t.cancel();
        }
        self.shared.pointers.release(engineer, run).await?;
        self.run_info(engineer, run).await?.ok_or(TriageError::NotFound)
    }
}

/// See [`Triage::check_source`].
pub fn check_source(dirs: &[PathBuf], source: LogSource) -> Result<LogSource, TriageError> {
    match source {
        LogSource::Path { path } => {
            let canon = std::fs::canonicalize(&path).map_err(|e| TriageError::Invalid(format!("{path}: {e}")))?;
            if !canon.is_file() {
                return Err(TriageError::Invalid(format!("{path} is not a regular file")));
            }
            let allowed = dirs.iter().filter_map(|d| std::fs::canonicalize(d).ok()).any(|d| canon.starts_with(&d));
            if !allowed {
                let list: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
                return Err(TriageError::Invalid(format!(
                    "{path} is outside the allowed log directories ({})",
                    list.join(", ")
                )));
            }
            std::fs::File::open(&canon).map_err(|e| TriageError::Invalid(format!("{path}: {e}")))?;
            Ok(LogSource::Path { path: canon.display().to_string() })
        }
        LogSource::Text { name, text } => {
            if text.is_empty() {
                return Err(TriageError::Invalid("the uploaded log is empty".into()));
            }
            if text.len() > MAX_UPLOAD_BYTES {
                return Err(TriageError::Invalid(format!(
                    "uploads are limited to {MAX_UPLOAD_BYTES} bytes; put larger logs in a log directory"
                )));
            }
            let name: String =
                Path::new(&name).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            Ok(LogSource::Text { name: if name.is_empty() { "upload.log".into() } else { name }, text })
        }
    }
}

fn params_of(command: &Command) -> Result<TriageParams, String> {
    let p: TriageParams = command.params_as().map_err(|e| e.to_string())?;
    if !valid_engineer(&p.engineer) || !valid_run(&p.run) {
        return Err("bad engineer or run id".into());
    }
    Ok(p)
}

/// `execute` on `lifecycle`: spawn the producer on the command's output, hand off to `monitor`.
struct Lifecycle(Arc<Shared>);

#[async_trait]
impl CommandHandler for Lifecycle {
    async fn execute(&self, command: Command) -> Result<CommandResult, HandlerError> {
        let sh = &self.0;
        let p = match params_of(&command) {
            Ok(p) => p,
            Err(e) => return Ok(CommandResult::failed(e)),
        };
        let Some(output) = command.output().cloned() else {
            return Ok(CommandResult::failed("a triage command needs its output stream (submitted without one)"));
        };
        let source = match check_source(&sh.cfg.log_dirs, p.source.clone()) {
            Ok(s) => s,
            Err(e) => {
                let _ = sh.pointers.release(&p.engineer, &p.run).await;
                return Ok(CommandResult::failed(e.to_string()));
            }
        };
        if command.is_cancelled() {
            return Ok(CommandResult::cancelled());
        }
        // The command service created the output at submit, before this delivery could come.
        // One that ended already (a Stop) is left: the hand-off's end decides the command.
        let path = output.path();
        if sh.streams.head(&path).await.is_ok_and(|h| h.end.is_some()) {
            return Ok(CommandResult::handed_off(MONITOR_QUEUE));
        }
        let stop = CancellationToken::new();
        sh.local.lock().unwrap().insert(p.run.clone(), stop.clone());
        let header = json!({"engineer": p.engineer, "run": p.run, "worker": sh.cfg.worker});
        let pace = sh.cfg.pace.clone();
        let stop2 = stop.clone();
        // The producer opens the output as its writer (a new epoch: an earlier delivery's
        // producer is fenced), keeps it alive, and ends it when the analysis returns.
        let handle = output.streams().spawn(path.clone(), output.link().open_options(), move |producer| async move {
            produce(producer, source, header, pace, stop2.clone()).await?;
            // The summary is written: the stream stays open (kept alive) until the command ends
            // it, when `monitor` completes the command with the summary as its result (so the
            // result never races the stream's end), or until a Stop.
            stop2.cancelled().await;
            Ok::<(), crate::producer::ProduceError>(())
        });
        let shared = sh.clone();
        let run = p.run.clone();
        tokio::spawn(async move {
            match handle.join().await {
                Ok(e) => tracing::info!(%path, reason = %e.end.reason, "producer done"),
                Err(e) => tracing::warn!(%path, error = %e, "producer could not run"),
            }
            shared.local.lock().unwrap().remove(&run);
        });
        Ok(CommandResult::handed_off(MONITOR_QUEUE))
    }
}

/// `check_status` on `monitor`: complete the command when the stream ends.
struct Monitor(Arc<Shared>);

#[async_trait]
impl CommandHandler for Monitor {
    async fn execute(&self, _command: Command) -> Result<CommandResult, HandlerError> {
        Ok(CommandResult::failed("triage commands must be submitted to the lifecycle queue"))
    }

    async fn check_status(&self, command: Command, _state: CommandState) -> Result<CommandResult, HandlerError> {
        let sh = &self.0;
        let p = match params_of(&command) {
            Ok(p) => p,
            Err(e) => return Ok(CommandResult::failed(e)),
        };
        let path = command.output().map(|o| o.path()).unwrap_or_else(|| stream_path(&p.engineer, &p.run));
        let (result, ended) = match sh.streams.head(&path).await {
            // Cancelled or producer_lost: the command service decides as this call ends
            // (CANCELLED, or FAILED saying the stream went silent).
            Ok(info) if info.end.is_some_and(|e| e.reason != EndReason::Finished) => (CommandResult::running(), true),
            Ok(info) => match outcome(sh, &path, info.end.is_some()).await? {
                Some(r) => (r, true),
                None => return Ok(CommandResult::running()),
            },
            Err(StreamError::NotFound { .. }) | Err(StreamError::Gone { .. }) => {
                (CommandResult::failed(format!("stream {path} disappeared (expired or deleted) before it ended")), true)
            }
            Err(e) => return Err(e.into()),
        };
        if ended {
            sh.pointers.release(&p.engineer, &p.run).await?;
        }
        Ok(result)
    }
}

/// The outcome the stream's events say: `SUCCEEDED` with the summary once the producer wrote
/// it, `FAILED` with the producer's error, `FAILED` for a stream that finished without either;
/// `None` while the analysis goes on.
async fn outcome(sh: &Shared, path: &StreamPath, finished: bool) -> Result<Option<CommandResult>, StreamError> {
    let mut from = ReadFrom::Start;
    let mut last: Option<Value> = None;
    let mut events = 0u64;
    loop {
        let chunk = sh.streams.read(path, from).await?;
        for r in &chunk.records {
            events += 1;
            last = serde_json::from_slice(&r.data).ok();
        }
        if chunk.up_to_date || chunk.records.is_empty() {
            break;
        }
        from = ReadFrom::At(chunk.next_offset);
    }
    Ok(match last {
        Some(v) if v.get("error").is_some() => {
            Some(CommandResult::failed(format!("analysis failed: {}", v["error"].as_str().unwrap_or("unknown error"))))
        }
        Some(v) if v.get("type").and_then(Value::as_str) == Some("summary") => {
            Some(CommandResult::succeeded(json!({"stream": path.as_str(), "events": events, "summary": v})))
        }
        _ if finished => Some(CommandResult::failed(format!("stream {path} finished without a summary"))),
        _ => None,
    })
}
