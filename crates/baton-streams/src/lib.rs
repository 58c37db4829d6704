//! Durable streams engine for Baton (DESIGN.md §3): the Durable Streams protocol model
//! (PROTOCOL.md of durable-streams/durable-streams) plus resumable runs (seed `001`), on three
//! backends with one semantics: in-memory, Redis standalone and Redis Cluster (Redis ≥ 7.0).
//!
//! # Model
//! * A stream is addressed by a [`StreamPath`]; its first segment is the scope.
//! * [`StreamStore::create`] (PROTOCOL.md §5.1, idempotent; forks §4.2), [`StreamStore::append`]
//!   (§5.2: bytes, or JSON messages with one level of array flattening; `Stream-Seq`; idempotent
//!   producers §5.2.1; atomic append-and-close), [`StreamStore::close`] (§5.3),
//!   [`StreamStore::delete`] (§5.4, soft delete while forks exist), [`StreamStore::head`] (§5.5),
//!   [`StreamStore::read`] (§5.6 catch-up), [`StreamStore::read_live`] (§5.7 long-poll) and
//!   [`StreamStore::subscribe`] (§5.8 SSE), [`StreamStore::trim`] (§4 retention).
//! * Offsets ([`Offset`], §8): `MMMMMMMMMMMMMMMM_SSSSSSSSSSSSSSSS`, the Redis entry id of the
//!   last entry read, zero-padded; start is `0000000000000000_0000000000000000`.
//! * Runs ([`StreamStore::open`], [`Producer`], [`StreamStore::spawn`]): a producer with an
//!   epoch claimed at open; `append`/`finish`/`cancel`/`keepalive`; exactly one end with a reason
//!   ([`EndReason`]: `finished`, `cancelled`, `producer_lost`); `silence_timeout`, `max_run`,
//!   `done_ttl`, `max_len` ([`RunLimits`]).
//!
//! # Redis layout
//! Per stream, two keys with one hash tag per stream (never a global tag); path characters `%`,
//! `{`, `}` are percent-encoded inside the tag:
//! * `baton:s:{<path>}`: a Redis Stream. Data entry: `d` = bytes (JSON: the messages joined by
//!   `,`), `n` = JSON message count (JSON streams only). The end of a stream is one hidden entry
//!   `e` = reason, written after the last data entry (it wakes blocked `XREAD`s; reads stop at the
//!   tail so they never return it).
//! * `baton:s:{<path>}:m`: a hash: `inc` incarnation, `ct`/`ctn` content type (as given /
//!   normalized), `ttl` (ms, sliding) or `exp` (ms epoch), `dl` hard deadline (min of `exp` and
//!   creation + `max_run`), `sil`/`mr`/`dttl`/`ml`/`mlw` run limits, `tail` last data entry id,
//!   `first` trimmed-through id, `cnt` data entries, `lw` last write or keepalive, `ta` last
//!   access (sliding TTL), `ca` created, `end`/`fin`/`ea`/`cb` end reason, final id, end time,
//!   closing producer tuple, `sq` last `Stream-Seq`, `p:<producer id>` = `epoch:last seq:count:last
//!   offset`, `refs` fork count, `del` soft-deleted, `fsrc`/`foff`/`fsub` fork origin.
//!
//! Both keys carry the same `PEXPIREAT`: min(hard deadline, last access + TTL, end + `done_ttl`),
//! so ending only ever shortens a lifetime, and an expired stream is simply absent (404).
//!
//! Every operation is one script call (one round trip), working on Redis 7.0 (`XADD`, `XRANGE`
//! with exclusive bounds, `XSETID`, `XTRIM MINID`, `TIME`), in `scripts/`:
//! `common.lua` (prelude of each), `create.lua` (create / idempotent re-create / run open with epoch
//! claim), `write.lua` (append, append-and-close, close, finish, cancel), `read.lua` (read, head,
//! fork snapshot; ends silent runs as `producer_lost`), `keepalive.lua`, `delete.lua`,
//! `refs.lua` (fork reference counts), `trim.lua`. A fork is the only multi-step operation
//! (source snapshot, fork create, source reference: three calls on two hash slots; data is copied
//! on fork so fork reads stay one call).
//!
//! # Live reads and fan-out
//! Within one process, all live readers of one stream share one tail loop (a task with one
//! dedicated connection doing `XREAD BLOCK` in slices ≤ 500 ms, then one `read.lua` call per batch
//! that also notices deletion, re-creation, expiry and silence). Readers are served from the tail
//! loop's in-memory window; the number of Redis connections grows with the number of distinct
//! streams being tailed, never with readers.

mod error;
mod memory;
mod offset;
mod redis;
mod run;
mod store;
mod types;

pub use error::StreamError;
pub use offset::{Offset, ReadFrom};
pub use run::{OpenOptions, Producer, RunHandle};
pub use store::{StoreSettings, StreamStore, Subscription};
pub use types::{
    is_json, normalize_content_type, AppendRequest, Appended, CreateOptions, Created, EndReason,
    Ended, EndState, EpochMs, Expiry, ForkFrom, LimitScope, ProducerStamp, ReadChunk, Record, RunLimits,
    StreamInfo, StreamPath, DEFAULT_CONTENT_TYPE,
};

/// Result alias of this crate.
pub type Result<T, E = StreamError> = std::result::Result<T, E>;
