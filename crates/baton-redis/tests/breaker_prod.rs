//! Breaking the production connections with real processes: SIGSTOPped sentinels and masters,
//! and the password file's edge cases.

use std::time::{Duration, Instant};

use baton_redis::{read_secret_file, redis, LuaScript, RedisClient, RedisConfig, RedisConn};
use baton_testkit::{require_redis, RedisSentinelSet};

async fn cmd<T: redis::FromRedisValue>(conn: &mut RedisConn, args: &[&str]) -> redis::RedisResult<T> {
    let mut c = redis::cmd(args[0]);
    for a in &args[1..] {
        c.arg(*a);
    }
    c.query_async(conn).await
}

/// Retries `args` on `conn` every 100 ms (each try bounded by 3 s) until it succeeds or `limit`
/// passes; panics with the distinct errors seen.
async fn until_ok<T: redis::FromRedisValue>(conn: &RedisConn, args: &[&str], limit: Duration) -> (T, Duration) {
    let start = Instant::now();
    let mut errors: Vec<String> = Vec::new();
    loop {
        let mut c = conn.clone();
        let r = match tokio::time::timeout(Duration::from_secs(3), cmd::<T>(&mut c, args)).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err("no reply within 3 s".to_string()),
        };
        match r {
            Ok(v) => {
                eprintln!("{args:?}: ok after {:?}; errors on the way: {errors:?}", start.elapsed());
                return (v, start.elapsed());
            }
            Err(e) => {
                if !errors.contains(&e) {
                    errors.push(e);
                }
                assert!(start.elapsed() < limit, "{args:?}: not recovered after {limit:?}; errors: {errors:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The node (plain port) that `ROLE` says is master, among `set`'s nodes other than `old`, waiting
/// up to `limit`.
fn wait_promoted(set: &mut RedisSentinelSet, old: u16, limit: Duration) -> u16 {
    let deadline = Instant::now() + limit;
    loop {
        for n in set.nodes().iter().filter(|n| n.port() != old) {
            if n.cli(&["ROLE"]).starts_with("master") {
                return n.port();
            }
        }
        assert!(Instant::now() < deadline, "no replica promoted within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One sentinel (the first listed) frozen by SIGSTOP, the master killed: the two other
/// sentinels fail over, and Baton must find the new master through them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_first_sentinel_does_not_hide_the_new_master() {
    require_redis();
    let mut set = RedisSentinelSet::start(1, 3);
    let client = RedisClient::new(RedisConfig::sentinel(set.sentinel_urls(), set.master_name())).unwrap();
    let shared = client.shared().await.unwrap();
    let _: i64 = cmd(&mut shared.clone(), &["INCR", "n"]).await.unwrap();
    let _: i64 = cmd(&mut shared.clone(), &["WAIT", "1", "2000"]).await.unwrap();
    let old = set.master_port();
    set.sentinels()[0].pause();
    set.node_by_port(old).kill();
    let new = wait_promoted(&mut set, old, Duration::from_secs(20));
    let (n, _) = until_ok::<i64>(&shared, &["INCR", "n"], Duration::from_secs(12)).await;
    assert_eq!(n, 2);
    assert_eq!(set.node_by_port(new).cli(&["GET", "n"]), "2");
    set.sentinels()[0].resume();
}

/// The master frozen by SIGSTOP (not killed): its sockets stay open. Writes go on in a loop;
/// the sentinels promote the replica; then the old master resumes (a master for a moment, until
/// the sentinels demote it). Every write Baton acknowledged must be on the new master: none
/// may have gone to the frozen-then-resumed old master, whose data is thrown away on demotion.
///
/// Seen failing without durability: 579 writes acknowledged, no error at all, and w16..w57 lost
/// (the writes of the ~1 s between the old master's resume and Baton hearing `+switch-master`).
/// This is Redis Sentinel's own window (the sentinels have promoted the replica but not yet
/// announced it); the fix is `--redis-wait-replicas` (next test), now documented.
#[ignore = "Redis Sentinel's window: a resumed old master acknowledges writes until +switch-master \
            reaches Baton (~1 s); lost on demotion. Use --redis-wait-replicas (see the durable variant)"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_master_loses_no_acknowledged_write() {
    frozen_master(false).await;
}

/// As above with `WAIT 1 1000` after every write (a `DurableWriter`): the resumed old master's
/// replica is gone (promoted), so its writes fail `WAIT` and are never acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_master_loses_no_durable_write() {
    frozen_master(true).await;
}

static PUSH: LuaScript = LuaScript::new("push", "return redis.call('RPUSH', KEYS[1], ARGV[1])");

async fn frozen_master(durable: bool) {
    require_redis();
    let mut set = RedisSentinelSet::start(1, 3);
    let mut config = RedisConfig::sentinel(set.sentinel_urls(), set.master_name());
    if durable {
        config = config.with_durability(1, Duration::from_secs(1));
    }
    let client = RedisClient::new(config).unwrap();
    let durable_writer = client.durable_writer().await.unwrap();
    let shared = client.shared().await.unwrap();
    let _: i64 = cmd(&mut shared.clone(), &["RPUSH", "acked", "start"]).await.unwrap();
    let _: i64 = cmd(&mut shared.clone(), &["WAIT", "1", "2000"]).await.unwrap();
    let old = set.master_port();

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (shared, stop, dw) = (shared.clone(), stop.clone(), durable_writer.clone());
        tokio::spawn(async move {
            let (mut acked, mut errors) = (Vec::new(), Vec::<String>::new());
            let mut i = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                i += 1;
                let id = format!("w{i}");
                let mut c = shared.clone();
                let r = match &dw {
                    Some(dw) => {
                        let mut push = PUSH.evalsha_cmd(1);
                        push.arg("acked").arg(&id);
                        dw.query::<i64>(&PUSH, "acked", &push).await
                    }
                    None => cmd::<i64>(&mut c, &["RPUSH", "acked", &id]).await,
                };
                match r {
                    Ok(_) => acked.push(id),
                    Err(e) if !errors.contains(&e.to_string()) => errors.push(e.to_string()),
                    Err(_) => {}
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (acked, errors)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    set.node_by_port(old).pause();
    let new = wait_promoted(&mut set, old, Duration::from_secs(20));
    set.node_by_port(old).resume();
    // The sentinels turn the old master into a replica of the new one.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !set.node_by_port(old).cli(&["ROLE"]).starts_with("slave") {
        assert!(Instant::now() < deadline, "the old master was never demoted");
        std::thread::sleep(Duration::from_millis(100));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (acked, errors) = writer.await.unwrap();
    eprintln!("{} writes acknowledged; errors: {errors:?}", acked.len());
    let on_new = set.node_by_port(new).cli(&["LRANGE", "acked", "0", "-1"]);
    let on_new: Vec<&str> = on_new.lines().collect();
    let lost: Vec<&String> = acked.iter().filter(|id| !on_new.contains(&id.as_str())).collect();
    assert!(lost.is_empty(), "acknowledged writes lost with the demoted master: {lost:?}");
    assert!(acked.len() > 10, "too few writes acknowledged: {}", acked.len());
}

/// Every sentinel frozen (SIGSTOP) while the master is fine: the connection Baton has keeps
/// working (it needs the sentinels only to find a new master), past the `+switch-master`
/// subscription's PING check (5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_sentinels_do_not_stop_a_healthy_master() {
    require_redis();
    let mut set = RedisSentinelSet::start(0, 2);
    let client = RedisClient::new(RedisConfig::sentinel(set.sentinel_urls(), set.master_name())).unwrap();
    let shared = client.shared().await.unwrap();
    let _: i64 = cmd(&mut shared.clone(), &["INCR", "n"]).await.unwrap();
    for s in set.sentinels() {
        s.pause();
    }
    let start = Instant::now();
    let mut n = 1;
    while start.elapsed() < Duration::from_secs(7) {
        let t = Instant::now();
        let got: i64 = cmd(&mut shared.clone(), &["INCR", "n"]).await.expect("INCR with the sentinels frozen");
        n += 1;
        assert_eq!(got, n);
        assert!(t.elapsed() < Duration::from_millis(500), "INCR took {:?}", t.elapsed());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for s in set.sentinels() {
        s.resume();
    }
}

/// The password file: one line, its line break(s) removed (`\n`, `\r\n`, a trailing blank line
/// an editor left); a line break inside the secret would be sent to `AUTH` and fail there with
/// no hint, so it is an error naming the file.
#[test]
fn password_file_line_breaks() {
    let dir = std::env::temp_dir().join(format!("baton-brk18-pw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("pw");
    for (text, want) in [
        ("s3cret", "s3cret"),
        ("s3cret\n", "s3cret"),
        ("s3cret\r\n", "s3cret"),
        ("s3cret\n\n", "s3cret"),
        ("s3cret\r\n\r\n", "s3cret"),
    ] {
        std::fs::write(&path, text).unwrap();
        assert_eq!(read_secret_file(&path).as_deref(), Ok(want), "file {text:?}");
    }
    std::fs::write(&path, "s3cret\nother\n").unwrap();
    let err = read_secret_file(&path).unwrap_err();
    assert!(err.contains(&path.display().to_string()) && err.contains("one line"), "{err}");
    assert!(!err.contains("s3cret"), "{err}");
    std::fs::write(&path, "\n").unwrap();
    assert!(read_secret_file(&path).unwrap_err().contains("is empty"));
    std::fs::remove_dir_all(dir).unwrap();
}

/// Passwords written into URLs unencoded, with characters that end a URL's authority (`/`, `?`,
/// `#`): the shown URL must still hide them (they reach logs, errors and `/`).
#[test]
fn redacted_urls_hide_passwords_with_url_delimiters() {
    for (url, secret) in [
        ("redis://:pa/ss@h:1", "pa/ss"),
        ("redis://u:pa?ss@h:1/0", "pa?ss"),
        ("rediss://u:pa#ss@h:1", "pa#ss"),
        ("redis://u:a/b@c@h:1/2", "a/b@c"),
    ] {
        let shown = baton_redis::redact_url(url);
        assert!(!shown.contains(secret), "{url} is shown as {shown}");
        let config = RedisConfig::standalone(url);
        assert!(!format!("{config} {config:?}").contains(secret), "{config}");
    }
    assert_eq!(baton_redis::redact_url("redis://u:pa/ss@h:1/0"), "redis://u:***@h:1/0");
    assert_eq!(baton_redis::redact_url("redis://h:1/0"), "redis://h:1/0");
    assert_eq!(baton_redis::redact_url("redis://u@h:1/0"), "redis://u@h:1/0");
}

/// A master and one replica in sync.
fn master_and_replica() -> (baton_testkit::RedisServer, baton_testkit::RedisServer) {
    let master = baton_testkit::RedisServer::start();
    let replica = baton_testkit::RedisServer::start();
    replica.replicate_from(&master);
    (master, replica)
}

fn push(key: &str, id: &str) -> redis::Cmd {
    let mut c = PUSH.evalsha_cmd(1);
    c.arg(key).arg(id);
    c
}

/// `WAIT 2` with one replica: every write fails promptly (about the wait timeout) with the
/// count in the message, and each was applied exactly once (no write sent twice, also not the
/// first one, which loads the script after `NOSCRIPT`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_replicas_asked_than_exist() {
    require_redis();
    let (master, _replica) = master_and_replica();
    let client =
        RedisClient::new(RedisConfig::standalone(master.url()).with_durability(2, Duration::from_millis(300))).unwrap();
    let dw = client.durable_writer().await.unwrap().unwrap();
    for i in 0..4 {
        let t = Instant::now();
        let err = dw.query::<i64>(&PUSH, "two", &push("two", &format!("p{i}"))).await.unwrap_err();
        assert!(baton_redis::is_not_replicated(&err), "{err}");
        assert!(err.to_string().contains(" of 2 replica(s) confirmed within 300ms"), "{err}");
        assert!(t.elapsed() < Duration::from_millis(1500), "took {:?}", t.elapsed());
    }
    assert_eq!(master.cli(&["LRANGE", "two", "0", "-1"]), "p0\np1\np2\np3");
}

/// The master frozen (SIGSTOP) longer than a `DurableWriter` connection's response timeout
/// (5 s + 2 × the wait timeout): the write in flight fails with a timeout, not a hang; after the
/// resume every write on that connection gets its own reply (no late reply taken for the next
/// write's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_connection_outlives_a_frozen_master() {
    require_redis();
    let (master, _replica) = master_and_replica();
    let client =
        RedisClient::new(RedisConfig::standalone(master.url()).with_durability(1, Duration::from_millis(100))).unwrap();
    let dw = client.durable_writer().await.unwrap().unwrap();
    let n: i64 = dw.query(&PUSH, "f", &push("f", "a")).await.unwrap();
    assert_eq!(n, 1);
    master.pause();
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(9), dw.query::<i64>(&PUSH, "f", &push("f", "b"))).await;
    let elapsed = t.elapsed();
    master.resume();
    let err = r.expect("the durable write hung past its response timeout").unwrap_err();
    eprintln!("frozen master, durable write: {err} after {elapsed:?}");
    assert!(err.is_timeout() || baton_redis::is_transient(&err), "{err}");
    // After the resume: the writes' replies are their own. "b" may have been applied late.
    let mut last = None;
    for id in ["c", "d", "e"] {
        let (n, _) = {
            let start = Instant::now();
            loop {
                match dw.query::<i64>(&PUSH, "f", &push("f", id)).await {
                    Ok(n) => break (n, start.elapsed()),
                    Err(e) => {
                        assert!(start.elapsed() < Duration::from_secs(5), "{id}: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        };
        let list = master.cli(&["LRANGE", "f", "0", "-1"]);
        let pos = list.lines().position(|l| l == id).map(|p| p as i64 + 1);
        assert_eq!(Some(n), pos, "{id}: reply {n}, list {list:?}");
        last = Some(n);
    }
    assert!(last.is_some());
}

/// `openssl` in `dir`, panicking with its output on failure.
fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = std::process::Command::new("openssl").current_dir(dir).args(args).output().unwrap();
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// The TLS server restarted with a certificate of another CA (not trusted): calls fail with an
/// error that says the certificate is not trusted; when the right certificate is back (another
/// restart) the same connection works again, with no restart of Baton.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_certificate_swapped_under_a_running_client() {
    require_redis();
    let certs = baton_testkit::TestCerts::generate();
    let mut server = baton_testkit::RedisServer::start_tls(&certs, false);
    let client = RedisClient::new(RedisConfig::standalone(server.tls_url()).with_ca_file(certs.ca_cert())).unwrap();
    let shared = client.shared().await.unwrap();
    let () = cmd(&mut shared.clone(), &["SET", "k", "1"]).await.unwrap();

    // A server certificate for the same names, signed by the unrelated CA.
    let d = certs.dir();
    for f in ["server.crt", "server.key"] {
        std::fs::copy(d.join(f), d.join(format!("{f}.good"))).unwrap();
    }
    openssl(
        d,
        &[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "other.csr",
            "-subj",
            "/CN=localhost",
            "-config",
            "openssl.cnf",
        ],
    );
    openssl(
        d,
        &[
            "x509",
            "-req",
            "-in",
            "other.csr",
            "-CA",
            "other-ca.crt",
            "-CAkey",
            "other-ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "30",
            "-extfile",
            "openssl.cnf",
            "-extensions",
            "server_ext",
        ],
    );
    server.restart();

    let mut errors: Vec<String> = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        match tokio::time::timeout(Duration::from_secs(3), cmd::<String>(&mut shared.clone(), &["GET", "k"])).await {
            Ok(Ok(v)) => panic!("read {v:?} from a server whose certificate is not trusted"),
            Ok(Err(e)) if !errors.contains(&e.to_string()) => errors.push(e.to_string()),
            Ok(Err(_)) => {}
            Err(_) => errors.push("no answer within 3 s".into()),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("untrusted certificate after a restart: {errors:?}");
    assert!(
        errors.iter().any(|e| e.contains("UnknownIssuer") || e.contains("not signed") || e.contains("certificate")),
        "no error names the certificate: {errors:?}"
    );

    for f in ["server.crt", "server.key"] {
        std::fs::copy(d.join(format!("{f}.good")), d.join(f)).unwrap();
    }
    server.restart();
    // No persistence in the test server: the key is gone, the connection is back.
    let (v, _) = until_ok::<Option<String>>(&shared, &["GET", "k"], Duration::from_secs(10)).await;
    assert_eq!(v, None);
    let () = cmd(&mut shared.clone(), &["SET", "k", "2"]).await.unwrap();
}

/// The password rotated on the server while Baton runs (`ACL SETUSER baton resetpass >new`),
/// then every connection cut (`CLIENT KILL`, as a Redis restart would): reconnecting fails with
/// an authentication error that shows no password; nothing reloads the password file, so the
/// way to rotate is to add the new password first (`ACL SETUSER baton >new`: both work),
/// restart Baton with it, then remove the old one (docs/operations.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_rotated_on_the_server() {
    require_redis();
    let server = baton_testkit::RedisServer::start();
    server.add_acl_user("baton", "old-pass-1");
    let client = RedisClient::new(
        RedisConfig::standalone(format!("redis://127.0.0.1:{}", server.port()))
            .with_username("baton")
            .with_password("old-pass-1"),
    )
    .unwrap();
    let shared = client.shared().await.unwrap();
    let () = cmd(&mut shared.clone(), &["SET", "k", "1"]).await.unwrap();

    // Both passwords valid: a reconnect still logs in.
    server.cli(&["ACL", "SETUSER", "baton", ">new-pass-2"]);
    server.cli(&["CLIENT", "KILL", "USER", "baton"]);
    let (v, _) = until_ok::<String>(&shared, &["GET", "k"], Duration::from_secs(5)).await;
    assert_eq!(v, "1");

    // Only the new one: the existing connection is cut, the reconnect is refused.
    server.cli(&["ACL", "SETUSER", "baton", "resetpass", ">new-pass-2"]);
    server.cli(&["CLIENT", "KILL", "USER", "baton"]);
    let mut errors: Vec<String> = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(2) {
        match tokio::time::timeout(Duration::from_secs(3), cmd::<String>(&mut shared.clone(), &["GET", "k"])).await {
            Ok(Ok(v)) => panic!("read {v:?} after the password was rotated"),
            Ok(Err(e)) if !errors.contains(&e.to_string()) => errors.push(e.to_string()),
            Ok(Err(_)) => {}
            Err(_) => errors.push("no answer within 3 s".into()),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("password rotated: {errors:?}");
    assert!(errors.iter().all(|e| !e.contains("old-pass-1") && !e.contains("new-pass-2")), "{errors:?}");
    assert!(
        errors.iter().any(|e| e.contains("WRONGPASS") || e.contains("uthentication")),
        "no error says the login failed: {errors:?}"
    );
    // The old password back on the server: the same client recovers by itself.
    server.cli(&["ACL", "SETUSER", "baton", ">old-pass-1"]);
    let (v, _) = until_ok::<String>(&shared, &["GET", "k"], Duration::from_secs(10)).await;
    assert_eq!(v, "1");
}

/// The master restarted (SIGKILL, no persistence) while a durable write waits in `WAIT` (its
/// replica frozen): the write fails promptly with a dropped-connection error (not a hang, not a
/// success), and once the replica is back in sync the same writer works again (the script
/// reloaded after `NOSCRIPT`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn master_restarted_mid_wait() {
    require_redis();
    let (mut master, replica) = master_and_replica();
    let client =
        RedisClient::new(RedisConfig::standalone(master.url()).with_durability(1, Duration::from_secs(3))).unwrap();
    let dw = client.durable_writer().await.unwrap().unwrap();
    let _: i64 = dw.query(&PUSH, "r", &push("r", "a")).await.unwrap();
    replica.pause();
    let pending = {
        let dw = dw.clone();
        tokio::spawn(async move {
            let t = Instant::now();
            (dw.query::<i64>(&PUSH, "r", &push("r", "b")).await, t.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    master.restart();
    let (r, elapsed) = pending.await.unwrap();
    let err = r.expect_err("a write acknowledged by a master that was killed during its WAIT");
    eprintln!("master restarted mid-WAIT: {err} after {elapsed:?}");
    assert!(baton_redis::is_transient(&err), "{err}");
    assert!(elapsed < Duration::from_secs(3), "{elapsed:?}");
    replica.resume();
    replica.wait_replica_link_up(Duration::from_secs(20));
    let start = Instant::now();
    let n: i64 = loop {
        match dw.query::<i64>(&PUSH, "r", &push("r", "c")).await {
            Ok(n) => break n,
            Err(e) => {
                assert!(start.elapsed() < Duration::from_secs(10), "{e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    // The restarted master lost "a" and "b" (no persistence); "c" is there once.
    assert_eq!(master.cli(&["LRANGE", "r", "0", "-1"]), "c");
    assert_eq!(n, 1);
}
