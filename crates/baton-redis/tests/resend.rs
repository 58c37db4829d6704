//! The re-send guard (`baton_redis::resend`) on a real server: a call sent twice with the same
//! token applies once and both copies get the first copy's reply (arrays, integers, bulk and
//! status replies survive the packing); a new token applies again; another writer's guard does
//! not answer for this one; a late copy of an earlier call (its writer moved on) applies nothing;
//! the guard key lives `CLUSTER_RESEND_WINDOW`; the guarded script sees its KEYS and ARGV
//! exactly as unguarded (the guard's key and arguments are taken off); and a `ResendPool` lends a
//! guard to one call at a time (a `nil` inside an array reply survives the packing too); a kept
//! reply is byte-exact (every byte value, UTF-8, msgpack length edges, status and error replies).

use baton_redis::resend::{ResendGuard, ResendPool, CLUSTER_RESEND_WINDOW, RESEND_HEAD, RESEND_TAIL};
use baton_redis::{redis, LuaScript, RedisClient, RedisConn};
use baton_testkit::{require_redis, RedisServer};

/// Appends ARGV[1] to a list; replies with what it saw and did, in several reply types.
static PUSH: LuaScript = LuaScript::from_parts(
    "resend_push",
    &[
        RESEND_HEAD,
        "local n = redis.call('RPUSH', KEYS[1], ARGV[1])
         return {n, ARGV[1], #KEYS, #ARGV, {ok = 'OK'}, {'nested', n * 10}}",
        RESEND_TAIL,
    ],
);

fn push_cmd(guard: &ResendGuard, item: &str) -> redis::Cmd {
    let mut cmd = PUSH.evalsha_cmd(2);
    cmd.arg("{r}:list").arg(guard.key("{r}"));
    cmd.arg(item);
    guard.push_args(&mut cmd);
    cmd
}

async fn list(conn: &mut RedisConn) -> Vec<String> {
    redis::cmd("LRANGE").arg("{r}:list").arg(0).arg(-1).query_async(conn).await.unwrap()
}

#[tokio::test]
async fn a_copy_with_the_same_token_applies_once_and_gets_the_first_reply() {
    require_redis();
    let server = RedisServer::start();
    let mut conn = RedisClient::new(server.config()).unwrap().shared().await.unwrap();
    let guard = ResendGuard::new();

    let first = push_cmd(&guard, "a");
    let r1: redis::Value = PUSH.query(&mut conn, &first).await.unwrap();
    let want = redis::Value::Array(vec![
        redis::Value::Int(1),
        redis::Value::BulkString(b"a".to_vec()),
        redis::Value::Int(1),
        redis::Value::Int(1),
        redis::Value::Okay,
        redis::Value::Array(vec![redis::Value::BulkString(b"nested".to_vec()), redis::Value::Int(10)]),
    ]);
    assert_eq!(r1, want, "the script saw one key and one argument");
    // The same command again: what the Cluster client sends after a dropped connection.
    let r2: redis::Value = PUSH.query(&mut conn, &first).await.unwrap();
    assert_eq!(r2, want, "a re-sent copy gets the first copy's reply");
    assert_eq!(list(&mut conn).await, ["a"], "and does not apply again");

    // The next call (a new token) applies.
    let r3: redis::Value = PUSH.query(&mut conn, &push_cmd(&guard, "b")).await.unwrap();
    assert!(matches!(&r3, redis::Value::Array(v) if v[0] == redis::Value::Int(2)), "{r3:?}");
    // Another writer's first call is not answered by this writer's guard.
    let other = ResendGuard::new();
    let _: redis::Value = PUSH.query(&mut conn, &push_cmd(&other, "c")).await.unwrap();
    assert_eq!(list(&mut conn).await, ["a", "b", "c"]);

    // The guard key lives the resend window (300 s), no longer.
    let ttl: i64 = redis::cmd("PTTL").arg(guard.key("{r}")).query_async(&mut conn).await.unwrap();
    let window = CLUSTER_RESEND_WINDOW.as_millis() as i64;
    assert_eq!(window, 300_000);
    assert!(ttl > window - 5_000 && ttl <= window, "{ttl}");
}

#[tokio::test]
async fn a_late_copy_of_an_earlier_call_applies_nothing() {
    require_redis();
    let server = RedisServer::start();
    let mut conn = RedisClient::new(server.config()).unwrap().shared().await.unwrap();
    let guard = ResendGuard::new();
    let (early, late) = (push_cmd(&guard, "early"), push_cmd(&guard, "late"));
    // The earlier call's first copy never ran (given up); the writer's next call ran.
    let _: redis::Value = PUSH.query(&mut conn, &late).await.unwrap();
    // A copy of the earlier call arrives after it: refused, nothing written.
    let e = PUSH.query::<redis::Value, _>(&mut conn, &early).await.unwrap_err();
    assert!(e.to_string().contains("BATON_STALE_RESEND"), "{e}");
    assert_eq!(list(&mut conn).await, ["late"]);
    // The later call's own copy is still answered as before.
    let again: redis::Value = PUSH.query(&mut conn, &late).await.unwrap();
    assert!(matches!(&again, redis::Value::Array(v) if v[0] == redis::Value::Int(1)), "{again:?}");
    assert_eq!(list(&mut conn).await, ["late"]);
}

/// Sets KEYS[1] to ARGV[2] when it holds ARGV[1] ('' = absent), as the store's compare-and-sets
/// do; replies `{'ok', 1}` or `{'conflict', <current or false>, 0}` (a `nil` inside an array).
static CAS: LuaScript = LuaScript::from_parts(
    "resend_cas",
    &[
        RESEND_HEAD,
        "local cur = redis.call('GET', KEYS[1])
         if (cur or '') ~= ARGV[1] then return { 'conflict', cur, 0 } end
         redis.call('SET', KEYS[1], ARGV[2])
         return { 'ok', 1 }",
        RESEND_TAIL,
    ],
);

fn cas_cmd(guard: &ResendGuard, expected: &str, new: &str) -> redis::Cmd {
    let mut cmd = CAS.evalsha_cmd(2);
    cmd.arg("{r}:cas").arg(guard.key("{r}"));
    cmd.arg(expected).arg(new);
    guard.push_args(&mut cmd);
    cmd
}

/// A guard from a `ResendPool`: a call and its re-sent copy get the first copy's reply (a `nil`
/// inside an array included); calls in flight at once hold different guards; a guard returned
/// to the pool is lent again, and a late copy of its earlier call then applies nothing.
#[tokio::test]
async fn a_pooled_guard_carries_one_call_at_a_time() {
    require_redis();
    let server = RedisServer::start();
    let mut conn = RedisClient::new(server.config()).unwrap().shared().await.unwrap();
    let pool = ResendPool::new();
    let value = |s: &str| redis::Value::BulkString(s.as_bytes().to_vec());

    let early;
    {
        let guard = pool.acquire();
        let first = cas_cmd(&guard, "", "a");
        let ok = redis::Value::Array(vec![value("ok"), redis::Value::Int(1)]);
        assert_eq!(CAS.query::<redis::Value, _>(&mut conn, &first).await.unwrap(), ok);
        assert_eq!(CAS.query::<redis::Value, _>(&mut conn, &first).await.unwrap(), ok, "a re-sent copy");
        // A call in flight meanwhile holds another guard: its conflict reply, nil included,
        // survives the packing.
        let other = pool.acquire();
        assert_ne!(other.key("{r}"), guard.key("{r}"));
        let stale = cas_cmd(&other, "", "b");
        let conflict = redis::Value::Array(vec![value("conflict"), value("a"), redis::Value::Int(0)]);
        assert_eq!(CAS.query::<redis::Value, _>(&mut conn, &stale).await.unwrap(), conflict);
        assert_eq!(CAS.query::<redis::Value, _>(&mut conn, &stale).await.unwrap(), conflict, "a re-sent copy");
        let absent = cas_cmd(&other, "x", "y");
        redis::cmd("DEL").arg("{r}:cas").query_async::<()>(&mut conn).await.unwrap();
        let nil = redis::Value::Array(vec![value("conflict"), redis::Value::Nil, redis::Value::Int(0)]);
        assert_eq!(CAS.query::<redis::Value, _>(&mut conn, &absent).await.unwrap(), nil);
        assert_eq!(CAS.query::<redis::Value, _>(&mut conn, &absent).await.unwrap(), nil, "a re-sent copy");
        // This call is given up before its first copy ran (its guard goes back with `guard`).
        early = cas_cmd(&guard, "", "early");
    }
    assert_eq!(pool.idle(), 2);
    // The guard returned last is lent to the next call, whose token is greater.
    let guard = pool.acquire();
    let later = cas_cmd(&guard, "", "later");
    assert_eq!(later.args_iter().count(), early.args_iter().count());
    let _: redis::Value = CAS.query(&mut conn, &later).await.unwrap();
    let e = CAS.query::<redis::Value, _>(&mut conn, &early).await.unwrap_err();
    assert!(baton_redis::resend::is_stale_resend(&e), "{e}");
    let v: Option<String> = redis::cmd("GET").arg("{r}:cas").query_async(&mut conn).await.unwrap();
    assert_eq!(v.as_deref(), Some("later"), "the late copy applied nothing");
}

/// A guarded script's reply kept by the guard and given to a re-sent copy (the same call sent
/// again) is byte-exact: conflict-shaped replies with every byte value, multi-byte UTF-8, sizes
/// at the msgpack length boundaries (31/32, 255/256, 65535/65536 bytes), an empty string,
/// integers at the 32/53-bit edges, `false` in an array, nested arrays, `{ok=...}` and `{err=...}`.
#[tokio::test]
async fn a_kept_reply_is_byte_exact() {
    static ECHO: LuaScript = LuaScript::from_parts(
        "resend_echo",
        &[
            RESEND_HEAD,
            "redis.call('INCR', KEYS[1])
             if ARGV[1] == 'ok' then return redis.status_reply(ARGV[2]) end
             if ARGV[1] == 'err' then return redis.error_reply(ARGV[2]) end
             return { 'conflict', ARGV[2], { ARGV[2], '', { tonumber(ARGV[3]), -tonumber(ARGV[3]) } }, false, 7 }",
            RESEND_TAIL,
        ],
    );
    require_redis();
    let server = RedisServer::start();
    let mut conn = RedisClient::new(server.config()).unwrap().shared().await.unwrap();
    let pool = ResendPool::new();
    let all_bytes: Vec<u8> = (0..=255u8).collect();
    let unicode = "é✓𝄞\n\"\\".as_bytes().to_vec();
    let mut payloads: Vec<Vec<u8>> = vec![Vec::new(), all_bytes.clone(), unicode.clone()];
    for n in [31usize, 32, 255, 256, 65535, 65536, 1 << 20] {
        payloads.push(all_bytes.iter().chain(unicode.iter()).copied().cycle().take(n).collect());
    }
    let numbers = ["0", "1", "2147483647", "2147483648", "4294967296", "9007199254740992", "3"];
    let mut calls = 0;
    for (i, p) in payloads.iter().enumerate() {
        for mode in ["conflict", "ok", "err"] {
            // Status and error replies are one line.
            let one_line: Vec<u8> = p.iter().copied().filter(|c| *c != b'\r' && *c != b'\n').collect();
            let p = if mode == "conflict" { p } else { &one_line };
            calls += 1;
            let guard = pool.acquire();
            let mut cmd = ECHO.evalsha_cmd(2);
            cmd.arg("{echo}:n").arg(guard.key("{echo}"));
            cmd.arg(mode).arg(p.as_slice()).arg(numbers[i % numbers.len()]);
            guard.push_args(&mut cmd);
            let first: redis::RedisResult<redis::Value> = ECHO.query(&mut conn, &cmd).await;
            let copy: redis::RedisResult<redis::Value> = ECHO.query(&mut conn, &cmd).await;
            match (&first, &copy) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "payload {i} ({} bytes), {mode}", p.len()),
                (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "payload {i}, {mode}"),
                _ => panic!("payload {i}, {mode}: {first:?} then {copy:?}"),
            }
            if mode == "conflict" {
                let n: i64 = numbers[i % numbers.len()].parse().unwrap();
                let b = |v: &[u8]| redis::Value::BulkString(v.to_vec());
                let want = redis::Value::Array(vec![
                    b(b"conflict"),
                    b(p),
                    redis::Value::Array(vec![
                        b(p),
                        b(b""),
                        redis::Value::Array(vec![redis::Value::Int(n), redis::Value::Int(-n)]),
                    ]),
                    redis::Value::Nil,
                    redis::Value::Int(7),
                ]);
                assert_eq!(first.unwrap(), want, "payload {i}");
            }
        }
    }
    // Each call applied once (the copies applied nothing).
    let n: i64 = redis::cmd("GET").arg("{echo}:n").query_async(&mut conn).await.unwrap();
    assert_eq!(n, calls, "each call applied once");
}
