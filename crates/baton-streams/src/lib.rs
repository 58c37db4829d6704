//! Durable streams engine for Baton: the Durable Streams protocol model (PROTOCOL.md of
//! durable-streams/durable-streams; the § numbers in these docs are its sections) plus resumable
//! runs, on three backends with one semantics: in-memory, Redis standalone and Redis
//! Cluster (Redis ≥ 7.0).
//!
//! A producer and a live reader of one run, on the memory backend:
//!
//! ```
//! use std::time::Duration;
//!
//! use baton_streams::{EndReason, OpenOptions, ReadFrom, StreamStoreSettings, StreamPath, StreamStore};
//!
//! # #[tokio::main]
//! # async fn main() -> baton_streams::Result<()> {
//! let store = StreamStore::memory(StreamStoreSettings::default());
//! let path = StreamPath::new("acme/run-1")?;
//! let producer = store.open(&path, OpenOptions::default()).await?;
//!
//! // A live reader from the start: it gets what is there, then waits for more, until the end.
//! let reader = tokio::spawn({
//!     let (store, path) = (store.clone(), path.clone());
//!     async move {
//!         let mut subscription = store.subscribe(&path, ReadFrom::Start);
//!         let (mut body, mut end) = (Vec::new(), None);
//!         while let Some(chunk) = subscription.next(Duration::from_secs(5)).await? {
//!             body.extend_from_slice(&chunk.body());
//!             end = end.or(chunk.end);
//!         }
//!         Ok::<_, baton_streams::StreamError>((body, end))
//!     }
//! });
//!
//! producer.append("step 1 done\n").await?;
//! producer.append("step 2 done\n").await?;
//! let ended = producer.finish().await?;
//! assert!(ended.ended_now);
//!
//! let (body, end) = reader.await.expect("reader task")?;
//! assert_eq!(body, b"step 1 done\nstep 2 done\n");
//! assert_eq!(end.map(|e| e.reason), Some(EndReason::Finished));
//! # Ok(())
//! # }
//! ```
//!
//! # Model
//! * A stream is addressed by a [`StreamPath`]; its first segment is the scope.
//! * [`StreamStore::create`] (PROTOCOL.md §5.1, idempotent; forks §4.2), [`StreamStore::append`]
//!   (§5.2: bytes, or JSON messages with one level of array flattening; `Stream-Seq`; idempotent
//!   producers §5.2.1; atomic append-and-close), [`StreamStore::close`] (§5.3),
//!   [`StreamStore::delete`] (§5.4, soft delete while forks exist), [`StreamStore::head`] (§5.5),
//!   [`StreamStore::read`] (§5.6 catch-up), [`StreamStore::read_live`] (§5.7 long-poll) and
//!   [`StreamStore::subscribe`] (§5.8 SSE), [`StreamStore::trim`] (§4 retention).
//! * [`StreamStore::list`]: the paths of the existing streams under a prefix;
//!   [`StreamStore::list_page`]: a page of them in path order after a cursor, through a filter,
//!   with each one's metadata (a stream browser's listing).
//! * [`StreamObserver`] ([`StreamStore::set_observer`]): told of each create, append, close and
//!   delete a store makes, with the new tail as a client-visible offset token, before the call
//!   returns (e.g. to wake subscribers of streams matching a pattern).
//! * Offsets ([`Offset`], §8): `MMMMMMMMMMMMMMMM_SSSSSSSSSSSSSSSS`, the Redis entry id of the
//!   last entry read, zero-padded; start is `0000000000000000_0000000000000000`. Over HTTP they
//!   travel as tokens with the stream incarnation's [`OffsetTag`] appended ([`Offset::token`],
//!   [`ReadFrom::Tagged`]): a token of a deleted stream is refused by a new stream at its path
//!   ([`StreamError::OffsetIncarnation`], 410).
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
//!   `first` trimmed-through id, `cnt` messages (what `max_len` counts), `lw` last write or keepalive, `ta` last
//!   access (sliding TTL), `ca` created, `end`/`fin`/`ea`/`cb` end reason, final id, end time,
//!   closing producer tuple, `sq` last `Stream-Seq`, `p:<producer id>` = `epoch:last seq:count:last
//!   offset`, `refs` fork count, `del` soft-deleted, `fsrc`/`foff`/`fsub` fork origin; on Cluster
//!   only, `r:<writer>` = `<call token>\n<kind><reply>`: one writing process's re-send guard of
//!   the stream's `write.lua` calls (`scripts/write_guard.lua`: the Cluster client may send a
//!   call again after its connection dropped; the guard answers that copy with the first one's
//!   reply instead of appending twice). It is read and written by the `HMGET` and `HSET` each
//!   write makes anyway; kind `f` is a fast-path reply (`<previous tail> <new id>`), `m` a packed
//!   (`cmsgpack`) general-path reply, `k` one too long for a listpack value (over 64 bytes: a
//!   batch), kept in the writer's overflow key below. One field per writing process; a writer's
//!   first write to a stream whose hash has over 48 fields drops those idle for 600 s (twice the
//!   re-send window, by the token's time: a writer whose clock is more than 300 s behind the
//!   server's may lose its field while a re-sent copy can still arrive). The fields live and die
//!   with the hash, save for a delete's tombstone (below): a copy re-sent after the stream was
//!   deleted is answered as a write to a missing stream (404; the write went with the stream),
//!   and one re-sent after it was deleted and created again gets the first copy's reply, with
//!   the old incarnation, and writes nothing to the new stream. A carried field's kind is
//!   upper-cased (`F`, `M`, `K`), and one field `r~` holds the incarnation of the deleted
//!   stream, on which all the fields carried by that delete ran (one field per hash, not one per
//!   writer: the hash stays a listpack). A field is carried across one delete only: the next
//!   delete drops it, so a copy re-sent across two deletes and creates within its re-send window
//!   is written to the newest stream.
//! * On Cluster only, `baton:s:{<path>}:gone`: a deleted stream's tombstone (`scripts/bury.lua`,
//!   joined to `delete.lua` and to `refs.lua`, which deletes a soft-deleted stream when its last
//!   fork goes): a hash of the `r:` fields of calls made within 600 s (the clean-up's age, by
//!   the token's time; fields carried already are dropped) and `r~`, expiring after the
//!   re-send window (300 s, the longest a copy arrives after its call ran). A create of a new stream within that time
//!   carries its fields into the new hash and deletes it. The write scripts never read it, so
//!   writes pay nothing for it; `create.lua`, `delete.lua` and `refs.lua` take it as `KEYS[3]`.
//!   Left open: a stream that expires (no script runs) leaves no tombstone, so a copy re-sent
//!   after it expired and was created again is still written to the new stream.
//! * On Cluster only, `baton:s:{<path>}:resend:<writer>`: a writer's overflow key, the packed
//!   reply of its latest call whose reply was too long for the `r:<writer>` field (only then
//!   written), expiring 300 s after that call.
//! * Shared by all streams: 16 sorted sets `baton:s:deadlines:{0}` … `baton:s:deadlines:{15}`
//!   (each its own hash tag, so spread over the Cluster; never one global tag) for the silence
//!   sweeper, below.
//!
//! Both keys carry the same `PEXPIREAT`: min(hard deadline, last access + TTL, end + `done_ttl`),
//! so ending only ever shortens a lifetime, and an expired stream is simply absent (404).
//!
//! Every operation is one script call (one round trip), working on Redis 7.0 (`XADD`, `XRANGE`
//! with exclusive bounds, `XSETID`, `XTRIM MINID`, `TIME`), in `scripts/`:
//! `common.lua` (prelude of each), `create.lua` (create / idempotent re-create / run open with epoch
//! claim), `write.lua` (a batch of appends, append-and-closes, closes, finishes, cancels: group
//! commit, below), `read.lua` (read, head,
//! fork snapshot; ends silent runs as `producer_lost`), `keepalive.lua`, `delete.lua`,
//! `refs.lua` (fork reference counts), `bury.lua` (prepended to both: the re-send guard's
//! tombstone), `trim.lua`, `write_fast.lua` (prepended to `write.lua`),
//! `write_guard.lua` (prepended to both on Cluster: the re-send guard) or `write_guard_off.lua`.
//! A fork is the only multi-step operation
//! (source snapshot, fork create, source reference: three calls on two hash slots; data is copied
//! on fork so fork reads stay one call). `sweep.lua` claims due members of one deadline shard.
//!
//! # Writes: group commit
//! Per stream, at most one `write.lua` call is in flight from a process. Writes submitted while it
//! is in flight are queued (in submission order: a write is queued synchronously when its future is
//! first polled) and all go in the next call (up to 1,024 requests / 4 MiB). The script applies
//! them one after the other exactly as separate calls would — each keeps its own producer
//! (id, epoch, seq) checks, `Stream-Seq`, `max_len`, end handling, offset and reply — but reads the
//! metadata hash once and writes it once, so a request costs a few Lua comparisons plus one `XADD`
//! per record. A lone write is still one round trip (sent from the caller's own task). The common
//! single plain append (one record, no close, no `Stream-Seq`, producer in sequence, no sliding
//! TTL) is sent in a compact argument layout (4 to 8 arguments instead of 11 or more: Redis copies
//! every argument into Lua before the script runs) and takes a fast path (`write_fast.lua`, run
//! before the prelude): `HMGET` of the hot fields, `XADD NOMKSTREAM`, `HSET` of
//! `lw`/`tail`/`cnt`(/producer), no `string.format('%.0f')` / `tonumber` on the way, and a bare
//! entry id as the reply (a nested array costs Redis several microseconds to convert); its clock
//! is the new entry's id (an entry written to a stream found silent by that clock is deleted again,
//! never visible, and the full script ends the stream). Anything else falls through to the full
//! script, unchanged. New streams store the fields the fast path reads first in the hash (a small
//! hash is a listpack, searched from its start).
//! A backend
//! error fails every request of its batch (each may or may not have been applied: retry with the
//! same producer sequence). Because nothing waits on the client library's bounded command channel
//! per request, many writes in flight are never reordered on the client (before group commit, ~64+
//! concurrent requests driven from one task could overtake each other in redis-rs's 50-slot
//! command channel under Tokio's cooperative budget, which the engine answered with
//! `SequenceGap`).
//!
//! # Silence sweeper
//! `silence_timeout` is enforced by every script that touches a stream (reads, writes, tail loops)
//! and, for streams nobody touches, by a sweeper task in every process
//! ([`StreamStoreSettings::sweep_interval`], default 1 s). A stream created with a silence timeout is
//! registered in deadline shard `hash(path) % 16` (member `<incarnation> <path>`, score = the
//! earliest time it may turn silent) by a `ZADD` sent concurrently with the create script (another
//! slot in Cluster, so it cannot be in the script; creates stay one round-trip time). Appends and
//! keepalives never touch the shards: a score is only a lower bound. Each tick, a sweeper claims
//! the due members of each shard (`sweep.lua`: due members are re-scored `now + 10 s`, a lease, so
//! concurrent sweepers in other processes skip them) and runs the stream's own `read.lua` metadata
//! read on each: it ends a silent stream as `producer_lost` with the same `check_silence`/`do_end`
//! code as every other script, so races with finish/cancel still leave exactly one end. A live
//! stream is re-scored at `last write + silence_timeout`; an ended, deleted, expired or re-created
//! one is removed. A silent stream is ended within `silence_timeout` + `sweep_interval` (+ the
//! time to check the due members).
//!
//! Cost: per tick, 16 `sweep.lua` calls per process (one per shard; nothing due ⇒ an empty
//! `ZRANGE`); per live stream, one `read.lua` + one `ZADD` about once per `silence_timeout` (plus
//! one more check after it ends); memory, one sorted-set member per registered stream. No `SCAN`:
//! the cost does not grow with the rest of the keyspace. Chosen over a `SCAN MATCH baton:s:*:m`
//! cursor spread over ticks because a SCAN cycle grows with the whole keyspace (work queues
//! included), so no detection bound could be promised. (The only `SCAN`s of the crate are the
//! on-demand listings, [`StreamStore::list`] and [`StreamStore::list_page`].) Not done: updating the score on appends
//! (it would need a second command per append in Cluster).
//!
//! # Live reads and fan-out
//! Within one process, all live readers of one stream share one tail loop (a task with one
//! dedicated connection doing `XREAD BLOCK` in slices ≤ 500 ms, then one `read.lua` call per batch
//! on the shared connection that also notices deletion, re-creation, expiry and silence). Readers
//! are served from the tail loop's in-memory window (a binary search per wake-up). The number of
//! Redis connections grows with the number of distinct streams being tailed, never with readers.
//! In Cluster the tail loop's connection is a plain connection to the one master that owns the
//! stream key's slot (resolved with `CLUSTER SLOTS`, re-resolved after any error such as `MOVED`),
//! not a cluster connection, so 1,000 readers of one stream use 4 connections on a 3-master
//! Cluster (the shared cluster connection's 3 + 1), 2 on standalone.
//!
//! On standalone, the tail loops of all tailed streams share one blocking connection (`blocker.rs`):
//! one `XREAD BLOCK … STREAMS k1 … kn id1 … idn` over every stream whose tail loop is waiting; a
//! stream that gets an entry wakes its tail loop, which reads and re-arms; a watch armed while the
//! `XREAD` is blocked interrupts it (`CLIENT UNBLOCK`, from the shared connection) to be included at
//! once. So a store uses 2 connections on standalone however many streams are live. In Cluster a
//! multi-key `XREAD` must stay within one hash slot, and every stream has its own slot, so there each
//! tailed stream keeps its own connection (to the one node owning its slot).

mod backend;
mod end;
mod error;
mod limits;
mod memory;
mod offset;
mod redis;
mod run;
mod settings;
mod store;
mod types;

pub use backend::PathFilter;
/// The Redis connection settings of [`StreamStore::redis`], re-exported from `baton-redis` (an
/// embedder needs no dependency on it).
pub use baton_redis::RedisConfig;
pub use end::{EndReason, EndState, Ended};
pub use error::{Result, StreamError};
pub use limits::{LimitScope, RunLimits};
pub use offset::{Offset, OffsetTag, ReadFrom};
pub use run::{OpenOptions, Producer, RunHandle};
pub use settings::StreamStoreSettings;
pub use store::{StreamObserver, StreamPage, StreamStore, Subscription};
pub use types::{
    is_json, normalize_content_type, AppendRequest, Appended, CreateOptions, Created, EpochMs, Expiry, ForkFrom,
    ProducerStamp, ReadChunk, Record, StreamInfo, StreamPath, DEFAULT_CONTENT_TYPE,
};
