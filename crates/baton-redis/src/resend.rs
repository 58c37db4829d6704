//! Re-send guard for script calls that must not apply twice on Redis Cluster.
//!
//! The redis crate's Cluster connection sends a command again when its connection dropped after
//! the command was sent (it cannot tell whether the command ran), up to its retries
//! ([`CLUSTER_RESEND_WINDOW`] at most). For an idempotent call that is harmless; for a write
//! such as an append without a producer stamp the second copy applies again while the caller is
//! answered once. A guarded script closes that: it is the script's text between
//! [`RESEND_HEAD`] and [`RESEND_TAIL`] (`scripts/resend_head.lua`, `scripts/resend_tail.lua`),
//! and each call carries one more key, this writer's guard key for the script's hash tag
//! ([`ResendGuard::key`]), and two more arguments, a token and the guard's lifetime
//! ([`ResendGuard::push_args`]). The script keeps its reply under the key with the token; a copy
//! that finds its own token there gets that reply and writes nothing, and a late copy of an
//! earlier call (one the client gave up on, answering its caller with an error, before the
//! writer's next call ran) finds a greater token and writes nothing either (error reply
//! `BATON_STALE_RESEND`).
//!
//! Rule of use: at most one guarded call in flight per guard and key (e.g. under a
//! [`crate::group_commit`], which keeps one call per key in flight), so that the key always
//! holds the token of the writer's latest call that ran. Standalone and Sentinel connections do not
//! re-send (a dropped call fails), so callers guard only on Cluster
//! ([`crate::RedisClient::is_cluster`]).
//!
//! Cost per call on Cluster: one `GET`, one `SET` of the packed reply (`cmsgpack`), one key per
//! writing process and hash tag for [`CLUSTER_RESEND_WINDOW`] after its last call. A script that
//! already reads and writes a hash of its keys can keep the guard there instead, at the cost of
//! one more field in each ([`ResendGuard::field`], [`ResendGuard::next_token`]; the stream
//! writes of `baton_streams` do).
//!
//! Calls that are not serialized by a group commit (any number in flight at once, e.g. a rare
//! single write) take a guard from a [`ResendPool`] for the call: [`ResendPool::acquire`] lends
//! an idle guard (or makes one when none is idle), and the guard goes back when the
//! [`PooledGuard`] is dropped, after the call was answered or given up. So a guard carries one
//! call at a time (the rule above), and the guard keys stay bounded by the peak number of such
//! calls in flight at once × hash tags (never a key per call). A call the caller gave up on
//! (its future dropped) returns its guard at once; a late copy of it then finds the next
//! borrower's greater token and applies nothing (`BATON_STALE_RESEND`; nobody waits for that
//! reply).
//!
//! Replies: the kept reply is the script's Lua value packed and unpacked with `cmsgpack`, so a
//! copy's reply is what the first copy's would be for integers, strings (binary), booleans,
//! `nil`, nested arrays and `{ok = ...}` / `{err = ...}` tables. A Lua number with a fraction
//! comes back the same number (Redis truncates both to an integer reply).
//!
//! A `BATON_STALE_RESEND` error reply reaches a caller only for a call it no longer waits for
//! (see above); where it is mapped it is a Redis error like any script error
//! ([`is_stale_resend`] tells it).
//!
//! ```
//! use baton_redis::resend::{ResendGuard, RESEND_HEAD, RESEND_TAIL};
//! use baton_redis::LuaScript;
//!
//! // The script's own text, guarded: KEYS and ARGV inside it are those it is sent unguarded.
//! static PUSH: LuaScript = LuaScript::from_parts(
//!     "push",
//!     &[RESEND_HEAD, "return redis.call('RPUSH', KEYS[1], ARGV[1])", RESEND_TAIL],
//! );
//!
//! let guard = ResendGuard::new();
//! let mut cmd = PUSH.evalsha_cmd(2);
//! cmd.arg("{jobs}:list").arg(guard.key("{jobs}"));
//! cmd.arg("payload");
//! guard.push_args(&mut cmd);
//! assert!(guard.key("{jobs}").starts_with("{jobs}:resend:"));
//! ```

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use redis::Cmd;

/// Lua joined before a guarded script's text (see the module docs).
pub const RESEND_HEAD: &str = include_str!("../scripts/resend_head.lua");
/// Lua joined after a guarded script's text (see the module docs).
pub const RESEND_TAIL: &str = include_str!("../scripts/resend_tail.lua");

/// The longest a Cluster call can be re-sent after its first copy ran: each of the client's
/// retries waits at most its longest back-off, a connection timeout and a response timeout
/// (40 × (0.5 + 2 + 5) s = 300 s). A guard key lives this long after its last call.
pub const CLUSTER_RESEND_WINDOW: Duration = Duration::from_millis(
    crate::CLUSTER_RETRIES as u64
        * (crate::CLUSTER_RETRY_WAIT_MS.1
            + crate::CONNECTION_TIMEOUT.as_millis() as u64
            + crate::DEFAULT_RESPONSE_TIMEOUT.as_millis() as u64),
);

/// A call token per second of its time ([`ResendGuard::next_token`]): a token / 2^20 is the
/// Unix time in seconds of its call (or later, after more than 2^20 calls in one second).
pub const TOKEN_SECOND: u64 = 1 << 20;

/// One writer's guard: a random id (its keys) and its call tokens.
#[derive(Debug)]
pub struct ResendGuard {
    id: String,
    field: String,
    last: AtomicU64,
}

impl Default for ResendGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl ResendGuard {
    /// A guard with a fresh random id (a UUID v7), so no two writers share a key.
    pub fn new() -> Self {
        let id = uuid::Uuid::now_v7().simple().to_string();
        Self { field: format!("r:{id}"), id, last: AtomicU64::new(0) }
    }

    /// This writer's field in a hash that holds the guard itself instead of a key of its own:
    /// `r:<id>` (e.g. the stream write's guard in the stream's metadata hash, see
    /// `baton_streams`).
    pub fn field(&self) -> &str {
        &self.field
    }

    /// A new call token: greater than every earlier token of this guard, and at least the Unix
    /// time in seconds × 2^20 ([`TOKEN_SECOND`]) when it is taken, so a stored token tells how
    /// long ago its call was made (by this process's clock). Below 2^53 until the year 2242, so
    /// exact in Lua.
    pub fn next_token(&self) -> u64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
            .saturating_mul(TOKEN_SECOND);
        let prev = self
            .last
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| Some(now.max(last + 1)))
            .expect("always Some");
        now.max(prev + 1)
    }

    /// This writer's guard key next to the keys it guards: `<prefix>:resend:<id>`. `prefix` must
    /// carry the hash tag of the script's other keys (e.g. `baton:s:{path}`).
    pub fn key(&self, prefix: &str) -> String {
        let mut k = String::with_capacity(prefix.len() + 8 + self.id.len());
        k.push_str(prefix);
        k.push_str(":resend:");
        k.push_str(&self.id);
        k
    }

    /// Writes the call's two trailing arguments: a new token, then the guard key's lifetime in
    /// ms ([`CLUSTER_RESEND_WINDOW`]). Call once per call, after all the script's own arguments.
    pub fn push_args(&self, cmd: &mut Cmd) {
        cmd.arg(self.next_token()).arg(CLUSTER_RESEND_WINDOW.as_millis() as u64);
    }
}

/// True for the error reply of a late copy of an earlier call (`BATON_STALE_RESEND`, see the
/// module docs): that copy applied nothing.
pub fn is_stale_resend(err: &redis::RedisError) -> bool {
    err.code() == Some("BATON_STALE_RESEND") || err.to_string().contains("BATON_STALE_RESEND")
}

/// Guards lent one call at a time, for guarded calls that are not serialized otherwise (see the
/// module docs). Holds the idle guards (as many as were ever lent at once); made empty.
///
/// ```
/// use baton_redis::resend::{ResendPool, RESEND_HEAD, RESEND_TAIL};
/// use baton_redis::LuaScript;
///
/// static PUSH: LuaScript = LuaScript::from_parts(
///     "push",
///     &[RESEND_HEAD, "return redis.call('RPUSH', KEYS[1], ARGV[1])", RESEND_TAIL],
/// );
///
/// let pool = ResendPool::new();
/// let (first_key, second_key);
/// {
///     // Held for the call: from building its command until its reply (or giving up).
///     let guard = pool.acquire();
///     let mut cmd = PUSH.evalsha_cmd(2);
///     cmd.arg("{jobs}:list").arg(guard.key("{jobs}"));
///     cmd.arg("payload");
///     guard.push_args(&mut cmd);
///     // ... PUSH.query(&mut conn, &cmd).await ...
///     first_key = guard.key("{jobs}");
///     // A call in flight meanwhile gets another guard.
///     second_key = pool.acquire().key("{jobs}");
/// }
/// assert_ne!(first_key, second_key);
/// assert_eq!(pool.idle(), 2);
/// // A guard back in the pool is lent again (the most recently returned first).
/// let again = pool.acquire();
/// assert!([first_key, second_key].contains(&again.key("{jobs}")));
/// assert_eq!(pool.idle(), 1);
/// ```
#[derive(Debug, Default)]
pub struct ResendPool {
    idle: Mutex<Vec<ResendGuard>>,
}

impl ResendPool {
    /// An empty pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// Lends an idle guard, the one returned last (so few guard keys are in use), or a new one
    /// ([`ResendGuard::new`]) when none is idle. It returns to the pool when the
    /// [`PooledGuard`] is dropped.
    pub fn acquire(&self) -> PooledGuard<'_> {
        let guard = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
        PooledGuard { pool: self, guard: Some(guard) }
    }

    /// Guards idle in the pool now.
    pub fn idle(&self) -> usize {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// A guard lent by a [`ResendPool`] to one call (derefs to [`ResendGuard`]); back to the pool
/// on drop.
#[derive(Debug)]
pub struct PooledGuard<'a> {
    pool: &'a ResendPool,
    guard: Option<ResendGuard>,
}

impl Deref for PooledGuard<'_> {
    type Target = ResendGuard;
    fn deref(&self) -> &ResendGuard {
        self.guard.as_ref().expect("a pooled guard is held until dropped")
    }
}

impl Drop for PooledGuard<'_> {
    fn drop(&mut self) {
        if let Some(g) = self.guard.take() {
            self.pool.idle.lock().unwrap_or_else(|e| e.into_inner()).push(g);
        }
    }
}
