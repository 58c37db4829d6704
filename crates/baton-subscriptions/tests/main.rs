//! The integration tests of `baton-subscriptions` in one test binary (one link, one pool of test threads
//! for every file): each file under `tests/` is a module here. One file's tests:
//! `cargo test -p baton-subscriptions --test integration <file>::`.

mod api;
mod breaks;
