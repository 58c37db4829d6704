//! The integration tests of `baton` in one test binary (one link, one pool of test threads
//! for every file): each file under `tests/` is a module here. One file's tests:
//! `cargo test -p baton --test integration <file>::`.

mod batch_break_http;
mod batch_submit;
mod binary;
mod breaker_bulk;
mod breaker_cli;
mod breaker_events;
mod breaker_prod;
mod breaker_sched;
mod breaker_stream_list;
mod breaker_webhooks;
mod caps_http;
mod cli;
mod commands_api;
mod common;
mod connections;
mod doc_links;
mod events;
mod failover_replicas;
mod failover_subscriptions;
mod http_golden;
mod layers;
mod limits;
mod openapi;
mod otlp;
mod priority_http;
mod protocol;
mod redis_production;
mod scheduled_http;
mod schedules;
mod stream_edges;
mod stream_list;
mod subscriptions;
mod webhooks;
mod workers;
mod workers_http;
