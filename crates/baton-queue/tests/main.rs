//! The integration tests of `baton-queue` in one test binary (one link, one pool of test threads
//! for every file): each file under `tests/` is a module here. One file's tests:
//! `cargo test -p baton-queue --test integration <file>::`.

mod breaker;
mod caps;
mod cluster_resends;
mod common;
mod conformance;
mod external_ack;
mod flow_breaker;
mod flow_processes;
mod key_rate;
mod key_rate_break;
mod lifecycle;
mod pause;
mod pause_wakeups;
mod priority;
mod priority_break;
mod processes;
mod rate;
mod remote;
mod scheduled;
