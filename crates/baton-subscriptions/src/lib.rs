//! # baton-subscriptions — Durable Streams subscriptions
//!
//! The reserved subscription API of the Durable Streams protocol (`/v1/stream/__ds/…`, as the
//! reference server `@durable-streams/server` 0.3.7 defines it), durable on Redis standalone
//! and Cluster and in memory with the same semantics:
//!
//! * **webhook** subscriptions: when a stream matching the subscription's `pattern` (a glob:
//!   `*` one path segment, `**` any number) or one of its explicit `streams` gets entries past
//!   its acknowledged offset, a *wake* is POSTed to the webhook, signed with Ed25519
//!   (`Webhook-Signature: t=…,kid=…,ed25519=…`; keys at `__ds/jwks.json`, stored in the backend
//!   so every process signs with the same key set). The receiver acknowledges offsets through
//!   the callback (`callback_url`, bearer `callback_token`) or answers `{"done": true}` to
//!   acknowledge the whole wake at once. Failed deliveries are retried with backoff (1 s
//!   doubling to 60 s, ±20 %).
//! * **pull-wake** subscriptions: wake events are appended to the `wake_stream` (an existing
//!   `application/json` stream; the events are never matched by any subscription); workers
//!   `claim` the wake (one holder at a time), `ack` offsets and `release`.
//!
//! Each wake has an id and a *generation* (incremented per wake); a callback, ack or release of
//! an older generation is refused with `FENCED`. A wake's lease lasts `lease_ttl_ms` from its
//! creation or delivery (webhook) or claim (pull-wake), renewed by every callback or ack; when
//! it ends without `done`, the next generation is woken if entries are still pending.
//!
//! **Built on the leased queue.** Every subscription is driven by at most one message of the
//! `baton-queue` queue `__ds-subscriptions` at a time (its token is in the record): the process
//! that delivers a wake holds that message's lease, renewed whatever the process does, so no
//! wake is delivered twice while its holder lives; if the process dies, another process's
//! consumer takes the message over after the queue's claim timeout and delivers. Records are
//! stored by compare-and-set on a version, in the same step as the registry change and the
//! delivery message they imply (one script, one hash tag, on Redis). Decisions are made once,
//! in Rust, for every backend (`machine.rs`).
//!
//! **Learning of appends.** The service installs itself as the
//! [`StreamStore`](baton_streams::StreamStore)'s observer: every create, append and close made
//! through a store with subscriptions is matched (in memory) against the registry of
//! subscriptions, and matching subscriptions are told before the write returns; a subscription
//! that cannot be told (its backend failing, e.g. a Redis failover) is told again in the
//! background, with the stream's tail then, until the backend answers. Other
//! processes' subscriptions are found by polling the registry version
//! ([`SubscriptionsConfig::registry_poll`]); a newly seen subscription, and every subscription
//! when a process starts, is reconciled by comparing each of its streams with its tail, so an
//! append nobody was told of still wakes it.
//!
//! ```
//! use baton_streams::{AppendRequest, CreateOptions, StreamPath, StreamStore, StreamStoreSettings};
//! use baton_subscriptions::{Subscriptions, SubscriptionsConfig};
//! use serde_json::json;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let streams = StreamStore::memory(StreamStoreSettings::default());
//! let subs = Subscriptions::memory(streams.clone(), SubscriptionsConfig::default()).await?;
//! subs.start_delivery().await?;
//!
//! let wake = StreamPath::new("wake/pool")?;
//! streams.create(&wake, CreateOptions { content_type: Some("application/json".into()), ..Default::default() }).await?;
//! let (created, _) = subs
//!     .create("jobs", &json!({"type": "pull-wake", "pattern": "events/*", "wake_stream": "wake/pool"}))
//!     .await?;
//! assert!(created);
//!
//! // An append to a matching stream wakes the subscription: a worker claims it.
//! let events = StreamPath::new("events/a")?;
//! streams.create(&events, CreateOptions::default()).await?;
//! streams.append(&events, AppendRequest { data: "hello".into(), ..Default::default() }).await?;
//! let claim = subs.claim("jobs", &json!({"worker": "w1"})).await?;
//! let tail = claim["streams"][0]["tail_offset"].as_str().unwrap().to_string();
//! let token = claim["token"].as_str().unwrap().to_string();
//! let ack = json!({"wake_id": claim["wake_id"], "generation": claim["generation"],
//!                  "acks": [{"stream": "events/a", "offset": tail}], "done": true});
//! assert_eq!(subs.ack("jobs", &token, &ack).await?, json!({"ok": true, "next_wake": false}));
//! // The same ack again: its wake is over.
//! assert_eq!(subs.ack("jobs", &token, &ack).await.unwrap_err().code(), "FENCED");
//! subs.close(std::time::Duration::from_secs(1)).await;
//! # Ok(())
//! # }
//! ```

mod backend;
mod machine;
mod memory;
mod model;
mod redis;
mod service;
mod signing;
mod webhook_url;

pub use backend::QUEUE;
pub use model::{glob_match, Kind, SubscriptionError, DEFAULT_LEASE_TTL_MS, MAX_LEASE_TTL_MS, MIN_LEASE_TTL_MS};
pub use service::{Subscriptions, SubscriptionsConfig, MAX_GLOB_STREAMS};
pub use signing::RETIRED_KEY_GRACE_MS;
pub use webhook_url::{address_refused, check_url, client as webhook_client};
