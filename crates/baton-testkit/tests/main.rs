//! The integration tests of `baton-testkit` in one test binary (one link, one pool of test threads
//! for every file): each file under `tests/` is a module here. One file's tests:
//! `cargo test -p baton-testkit --test integration <file>::`.

mod fixtures_prod;
mod harness;
