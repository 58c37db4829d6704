//! # Baton
//!
//! Durable work and durable streams on Redis. **To use them in your own program, depend on the
//! library crates** (each with an in-memory and a Redis backend, standalone or Cluster; their
//! crate docs start with the `Cargo.toml` lines and an example):
//!
//! * [`baton_queue`]: [`MessageStream`](baton_queue::MessageStream), the leased work queue
//!   (heartbeat leases, failover, retries, dead letters);
//! * [`baton_commands`]: [`CommandStore`](baton_commands::CommandStore) and
//!   [`CommandService`](baton_commands::CommandService), persisted commands with `execute` /
//!   `check_status`, cancel and hand-off, and the built-in handlers;
//! * [`baton_streams`]: [`StreamStore`](baton_streams::StreamStore), durable streams with
//!   idempotent producers, exactly one end and resumable readers;
//! * [`baton_redis`]: [`RedisClient`](baton_redis::RedisClient) and
//!   [`RedisConfig`](baton_redis::RedisConfig), the connection the Redis backends take
//!   (re-exported by `baton-queue` and `baton-commands`).
//!
//! This crate is the `baton` program built on them: `baton serve` (the Durable Streams protocol
//! and the command API over HTTP), `baton worker` and the client subcommands. Its library target
//! lets integration tests start a server in-process.
//!
//! The modules form layers, each using only those listed before it (tests/layers.rs checks):
//!
//! | Layer | Is |
//! |---|---|
//! | [`shutdown`] | waiting for SIGTERM / ctrl-c |
//! | [`settings`] | flags, environment, TOML: what they resolve to (queues, tokens) |
//! | [`telemetry`] | the `tracing` subscriber: log lines, and the opt-in OTLP span export |
//! | [`auth`] | who may do what: tokens, the caller, what a route needs |
//! | [`webhooks`] | the delivery of the queues' completion webhooks (signed POSTs from their delivery queues) |
//! | [`workers`] | the command services of the configured queues, and their webhook deliveries |
//! | [`http`] | the routes (one table: handler, auth, OpenAPI), the router |
//! | [`server`] | starting and stopping `baton serve` and `baton worker`; their connections ([`server::listen`]) |
//! | [`cli`] | the command line: its grammar, what each subcommand prints |

pub mod auth;
pub mod cli;
pub mod http;
pub mod server;
pub mod settings;
pub mod shutdown;
pub mod telemetry;
pub mod webhooks;
pub mod workers;
