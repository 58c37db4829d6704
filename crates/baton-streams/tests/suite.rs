//! The shared conformance suite of the streams engine: every case runs on the in-memory backend,
//! Redis standalone and a 3-master Redis Cluster (each test starts its own servers).

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use baton_streams::*;
use baton_testkit::{RedisCluster, RedisServer, TestBackend};

#[path = "suite/edges.rs"]
mod edges;
#[path = "suite/live.rs"]
mod live;
#[path = "suite/observer.rs"]
mod observer;
#[path = "suite/protocol.rs"]
mod protocol;
#[path = "suite/runs.rs"]
mod runs;

/// A fresh store on `backend`, with small limits suitable for tests.
pub async fn store(backend: &TestBackend, settings: StreamStoreSettings) -> StreamStore {
    match backend.redis_config() {
        None => StreamStore::memory(settings),
        Some(cfg) => StreamStore::redis(cfg, settings).await.expect("connect"),
    }
}

/// Default test settings: no run limits unless a test sets them.
pub fn settings() -> StreamStoreSettings {
    StreamStoreSettings { default_limits: RunLimits::unlimited(), ..StreamStoreSettings::default() }
}

static N: AtomicU64 = AtomicU64::new(0);

/// A unique path in scope `t`.
pub fn path(name: &str) -> StreamPath {
    StreamPath::new(format!("t/{name}-{}", N.fetch_add(1, Ordering::Relaxed))).unwrap()
}

pub fn text(c: &ReadChunk) -> String {
    String::from_utf8(c.body().to_vec()).unwrap()
}

/// Node ports of a Redis backend.
pub fn ports(backend: &TestBackend) -> Vec<u16> {
    let urls = backend.redis_config().map(|c| c.urls().to_vec()).unwrap_or_default();
    urls.iter().map(|u| u.rsplit(':').next().unwrap().trim_end_matches('/').parse().unwrap()).collect()
}

/// Client connections on a node, the `redis-cli` asking excluded.
pub fn client_count(port: u16) -> usize {
    let out = Command::new("redis-cli").args(["-p", &port.to_string(), "CLIENT", "LIST"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines().filter(|l| l.contains("id=") && !l.contains("cmd=client|list")).count()
}

/// Raw commands for layout assertions (Redis backends only).
pub async fn raw(backend: &TestBackend) -> Option<baton_redis::RedisConn> {
    let cfg = backend.redis_config()?;
    Some(baton_redis::RedisClient::new(cfg).unwrap().shared().await.unwrap())
}

pub const SEC: Duration = Duration::from_secs(1);

/// Instantiates each case once per backend.
macro_rules! suite {
    ($($module:ident :: $case:ident),* $(,)?) => {
        mod memory {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let b = baton_testkit::TestBackend::Memory;
                crate::suite::$module::$case(&b).await
            })*
        }
        mod standalone {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                baton_testkit::require_redis();
                let b = baton_testkit::TestBackend::Standalone(crate::suite::RedisServer::start());
                crate::suite::$module::$case(&b).await
            })*
        }
        mod cluster {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                baton_testkit::require_redis();
                let b = baton_testkit::TestBackend::Cluster(crate::suite::RedisCluster::start());
                crate::suite::$module::$case(&b).await
            })*
        }
    };
}

suite!(
    protocol::create_is_idempotent,
    protocol::append_and_read_bytes,
    protocol::json_mode,
    protocol::stream_seq_is_bytewise_increasing,
    protocol::idempotent_producers,
    protocol::close_semantics,
    protocol::reader_outcomes,
    protocol::chunked_reads,
    protocol::ttl_and_expiry,
    protocol::forks,
    protocol::fork_sub_offsets,
    protocol::soft_delete_and_gc,
    protocol::max_len,
    protocol::fast_path_refusals_and_state,
    protocol::fast_path_producer_states,
    runs::finish_cancel_producer_lost_race,
    runs::lost_reply_and_retried_open,
    runs::zombie_cancel_and_recreate_fencing,
    runs::an_end_fenced_to_a_producer_epoch,
    runs::keepalive_and_silence,
    runs::sweeper_ends_unread_silent_runs,
    runs::append_after_silence_is_refused,
    runs::pipelined_appends_in_order,
    runs::done_ttl_only_shortens,
    runs::spawn_outcomes,
    live::long_poll_wakes_and_times_out,
    live::waiting_reader_released_on_delete_and_expiry,
    live::fan_out_thousand_readers,
    live::many_live_streams,
    live::subscription_to_eof,
    live::local_appends_reach_live_readers_directly,
    edges::max_len_counts_json_messages,
    edges::recreate_with_other_limits_conflicts,
    edges::zero_silence_timeout_is_refused,
    edges::zero_max_run_is_refused,
    edges::offsets_of_a_deleted_stream_are_refused,
    observer::observer_sees_committed_writes,
    observer::observer_sees_forks_and_runs,
    observer::list_streams_by_prefix,
    observer::list_pages_in_path_order,
    observer::list_page_filter_holds_no_lock,
);
