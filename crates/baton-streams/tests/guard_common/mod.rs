//! What the tests of the re-send guard of `write.lua` share (`write_guard.rs`,
//! `write_guard_break.rs`, `tombstone_break.rs`): the guarded script sent directly, as a Cluster
//! client sends it, the argument layout of a fast-path append, reads of a stream's keys, and a
//! server with a store on it. Each file names its own stream (`ks`, its hash `<ks>:m`).
// Each test file uses only some of these.
#![allow(dead_code)]

use baton_redis::redis::{self, Value};
use baton_redis::resend::ResendGuard;
use baton_redis::{RedisClient, RedisConn};
use baton_streams::{CreateOptions, RunLimits, StreamPath, StreamStore, StreamStoreSettings};
use baton_testkit::RedisServer;

/// `write.lua` as the Cluster backend runs it: the re-send guard first.
pub const GUARDED: &str = concat!(
    include_str!("../../scripts/write_guard.lua"),
    include_str!("../../scripts/write_fast.lua"),
    include_str!("../../scripts/common.lua"),
    include_str!("../../scripts/write.lua")
);

/// One guarded call on the stream `ks` (its hash `<ks>:m`, the writer's overflow key
/// `g.key(ks)`): `args` in the script's own layout, then the guard's field and `token` (the same
/// token again = a re-sent copy).
pub async fn call<A: AsRef<[u8]>>(
    conn: &mut RedisConn,
    ks: &str,
    g: &ResendGuard,
    args: &[A],
    token: u64,
) -> redis::RedisResult<Value> {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(GUARDED).arg(3).arg(ks).arg(format!("{ks}:m")).arg(g.key(ks));
    for a in args {
        cmd.arg(a.as_ref());
    }
    cmd.arg(g.field()).arg(token);
    cmd.query_async(conn).await
}

pub fn b(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

/// The fast layout of one append: incarnation, content type, data, then (when given) the
/// message count and a producer stamp `(id, prefix, state)`.
pub fn fast(inc: &str, ctn: &str, data: &[u8], msgs: Option<&str>, p: Option<(&str, &str, &str)>) -> Vec<Vec<u8>> {
    let mut a = vec![b(inc), b(ctn), data.to_vec()];
    if let Some(m) = msgs {
        a.push(b(m));
    }
    if let Some((pid, pre, st)) = p {
        if msgs.is_none() {
            a.push(b(""));
        }
        a.push(b(&format!("p:{pid}")));
        a.push(b(pre));
        a.push(b(st));
    }
    a
}

/// The number of entries of the stream `ks` with data (not the hidden end entry).
pub async fn xlen(conn: &mut RedisConn, ks: &str) -> usize {
    let entries: Vec<(String, Vec<(String, String)>)> =
        redis::cmd("XRANGE").arg(ks).arg("-").arg("+").query_async(conn).await.unwrap();
    entries.iter().filter(|(_, f)| f.iter().any(|(k, _)| k == "d")).count()
}

pub async fn hget(conn: &mut RedisConn, key: &str, field: &str) -> Option<Vec<u8>> {
    redis::cmd("HGET").arg(key).arg(field).query_async(conn).await.unwrap()
}

/// The encoding of the hash `key` (`listpack` or `hashtable`).
pub async fn encoding(conn: &mut RedisConn, key: &str) -> String {
    redis::cmd("OBJECT").arg("ENCODING").arg(key).query_async(conn).await.unwrap()
}

/// The incarnation in a write's reply: a fast-path string's first word, or the first item of a
/// general reply's last array.
pub fn reply_inc(r: &Value) -> Vec<u8> {
    match r {
        Value::BulkString(b) => b.split(|c| *c == b' ').next().unwrap().to_vec(),
        Value::Array(items) => match items.last() {
            Some(Value::Array(ip)) => match &ip[0] {
                Value::BulkString(b) => b.clone(),
                o => panic!("{o:?}"),
            },
            o => panic!("{o:?}"),
        },
        o => panic!("{o:?}"),
    }
}

/// A fresh Redis server (skips the test where there is none) and a connection to it.
pub async fn server() -> (RedisServer, RedisConn) {
    baton_testkit::require_redis();
    let server = RedisServer::start();
    let conn = RedisClient::new(server.config()).unwrap().shared().await.unwrap();
    (server, conn)
}

/// A store on the same server, without run limits: deletes and creates go through the
/// backend's callers of `delete.lua` and `create.lua` (their third key, the tombstone).
pub async fn store(server: &RedisServer) -> StreamStore {
    let settings = StreamStoreSettings { default_limits: RunLimits::unlimited(), ..StreamStoreSettings::default() };
    StreamStore::redis(server.config(), settings).await.unwrap()
}

/// `CreateOptions` with content type `ct`.
pub fn opts(ct: &str) -> CreateOptions {
    CreateOptions { content_type: Some(ct.to_string()), ..Default::default() }
}

/// Deletes `p` (`delete.lua`: the guard's fields go to the tombstone) and creates it again as
/// `text/plain` (`create.lua`: it carries them over).
pub async fn recreate(store: &StreamStore, p: &StreamPath) {
    store.delete(p).await.unwrap();
    store.create(p, opts("text/plain")).await.unwrap();
}
