//! The integration tests of `baton-streams` in one test binary (one link, one pool of test threads
//! for every file): each file under `tests/` is a module here. One file's tests:
//! `cargo test -p baton-streams --test integration <file>::`.

mod cluster_resends;
mod guard_common;
mod live_handover_races;
mod lost_reply;
mod suite;
mod tombstone_break;
mod write_guard;
mod write_guard_break;
