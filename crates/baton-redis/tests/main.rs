//! The integration tests of `baton-redis` in one test binary (one link, one pool of test threads
//! for every file): each file under `tests/` is a module here. One file's tests:
//! `cargo test -p baton-redis --test integration <file>::`.

mod breaker_prod;
mod cluster_conn_break;
mod cluster_recovery;
mod durability;
mod production;
mod resend;
mod scan;
