//! The integration tests of `baton-commands` in one test binary (one link, one pool of test threads
//! for every file): each file under `tests/` is a module here. One file's tests:
//! `cargo test -p baton-commands --test integration <file>::`.

mod batch_break;
mod break_store;
mod breaker_feed;
mod breaker_feed_ops;
mod breaker_hooks;
mod breaker_sched;
mod builtin;
mod cadence;
mod caps;
mod cluster_resends;
mod common;
mod conformance;
mod exact_json;
mod failover;
mod fast_path;
mod feed;
mod flow_breaker;
mod group_commit_races;
mod handoff;
mod hooks;
mod lifecycle;
mod minutes;
mod output;
mod priority;
mod progress;
mod rate_limited;
mod redis_recovery;
mod remote;
mod scheduled;
mod schedules;
mod submit_many;
mod submit_races;
