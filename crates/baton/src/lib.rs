//! Baton's binary crate: `baton serve` (the Durable Streams protocol over HTTP) and its
//! configuration. The library target lets integration tests start a server in-process.

pub mod auth;
pub mod cli;
pub mod config;
pub mod http;
pub mod openapi;
pub mod server;
pub mod workers;
