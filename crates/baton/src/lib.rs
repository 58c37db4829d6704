//! Baton's binary crate: `baton serve` (the Durable Streams protocol and the command API over
//! HTTP), `baton worker` and the client subcommands. The library target lets integration tests
//! start a server in-process.
//!
//! The modules form layers, each using only those listed before it (tests/layers.rs checks):
//!
//! | Layer | Is |
//! |---|---|
//! | [`shutdown`] | waiting for SIGTERM / ctrl-c |
//! | [`settings`] | flags, environment, TOML: what they resolve to (queues, tokens) |
//! | [`auth`] | who may do what: tokens, the caller, what a route needs |
//! | [`workers`] | the command services of the configured queues |
//! | [`http`] | the routes (one table: handler, auth, OpenAPI), the router |
//! | [`server`] | starting and stopping `baton serve` and `baton worker`; their connections ([`server::listen`]) |
//! | [`cli`] | the command line: its grammar, what each subcommand prints |

pub mod auth;
pub mod cli;
pub mod http;
pub mod server;
pub mod settings;
pub mod shutdown;
pub mod workers;
