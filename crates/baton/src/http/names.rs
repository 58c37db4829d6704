//! The Durable Streams protocol's header names (and Baton's extensions), and the URL prefix of
//! streams.

use axum::http::HeaderName;

macro_rules! names {
    ($($f:ident = $s:literal;)*) => {
        $(#[doc = $s] pub fn $f() -> HeaderName { HeaderName::from_static($s) })*
        /// Every protocol and extension header, for CORS exposure and preflight.
        pub const ALL: &[&str] = &[$($s),*];
    };
}

names! {
    stream_next_offset = "stream-next-offset";
    stream_up_to_date = "stream-up-to-date";
    stream_closed = "stream-closed";
    stream_cursor = "stream-cursor";
    stream_seq = "stream-seq";
    stream_ttl = "stream-ttl";
    stream_expires_at = "stream-expires-at";
    stream_forked_from = "stream-forked-from";
    stream_fork_offset = "stream-fork-offset";
    stream_fork_sub_offset = "stream-fork-sub-offset";
    stream_sse_data_encoding = "stream-sse-data-encoding";
    producer_id = "producer-id";
    producer_epoch = "producer-epoch";
    producer_seq = "producer-seq";
    producer_expected_seq = "producer-expected-seq";
    producer_received_seq = "producer-received-seq";
    baton_end_reason = "baton-end-reason";
    baton_silence_timeout = "baton-silence-timeout";
    baton_max_run = "baton-max-run";
    baton_done_ttl = "baton-done-ttl";
    baton_max_len = "baton-max-len";
    baton_keepalive = "baton-keepalive";
    baton_already_ended = "baton-already-ended";
}

/// The URL prefix of streams.
pub const STREAM_PREFIX: &str = "/v1/stream/";
