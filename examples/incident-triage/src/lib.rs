//! # incident-triage — a Baton example
//!
//! An on-call engineer starts a *triage run* on a log (a file under the allowed log directories,
//! or uploaded text); the run analyses the log for real — error signatures with numbers, ids,
//! hex, UUIDs and timestamps masked; counts; first occurrence; bursts — and streams its findings
//! to every browser following it. The three Baton capabilities meet here:
//!
//! * the **command service**: a `triage` command on queue `lifecycle` (claim timeout 60 s) that
//!   owns its run's stream (`Command::with_output`), whose `execute` starts the run and hands
//!   off to queue `monitor`, whose `check_status` (every 1 s) completes the command with the
//!   run's summary ([`triage`]); Stop cancels the command, which ends the stream;
//! * **durable streams**: the run is the command's output stream `triage/<engineer>/<run>`,
//!   written by a spawned producer ([`producer`]), read by browsers over SSE with resumable
//!   event ids ([`web`]); `silence_timeout` ends it as `producer_lost` if the producing process
//!   dies, and the command service fails the command;
//! * **one current run per engineer**: a pointer claimed with `SET NX`, released by
//!   compare-and-delete, taken over once its run ended ([`pointer`](mod@pointer)).
//!   (Not `concurrency_key`: that queues a second start instead of refusing it, and holds
//!   its slot on one queue only, released when `execute` hands off; the README says more.)
//!
//! Run it: `cargo run -p incident-triage -- --listen 127.0.0.1:7710` (memory) or add
//! `--redis redis://127.0.0.1:6379` (several processes may share one Redis, each with its own
//! `--listen` address, e.g. `127.0.0.1:7711` for a second one on the same machine).

pub mod analysis;
pub mod pointer;
pub mod producer;
pub mod triage;
pub mod web;

pub use producer::{LogSource, PaceSettings};
pub use triage::{RunInfo, Triage, TriageConfig, TriageError, MAX_UPLOAD_BYTES};
