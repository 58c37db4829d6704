//! Production connections end to end, against real `redis-server` processes: TLS (standalone and
//! Cluster, CA and client certificates, and the errors a wrong setup gives), ACL users and
//! passwords, and Redis Sentinel (a killed master, a manual failover, unreachable sentinels).
//!
//! The error messages users see are asserted in full where Baton writes them (the part from the
//! redis crate or rustls is asserted by its key words), so a change in wording fails here.

use std::time::{Duration, Instant};

use baton_redis::sentinel::RESOLVE_TIMEOUT;
use baton_redis::{redis, ConnectError, LuaScript, RedisClient, RedisConfig, RedisConn};
use baton_testkit::{free_port, require_redis, RedisCluster, RedisSentinelSet, RedisServer, ServerOptions, TestCerts};

static SET_AND_GET: LuaScript =
    LuaScript::new("set_and_get", "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('GET', KEYS[1])");

async fn cmd<T: redis::FromRedisValue>(conn: &mut RedisConn, args: &[&str]) -> redis::RedisResult<T> {
    let mut c = redis::cmd(args[0]);
    for a in &args[1..] {
        c.arg(*a);
    }
    c.query_async(conn).await
}

/// SET/GET and a script call on `conn`, with values unique to `tag`.
async fn set_get_script(conn: &mut RedisConn, tag: &str) {
    let () = cmd(conn, &["SET", &format!("{tag}:k"), &format!("{tag}-v")]).await.unwrap();
    let v: String = cmd(conn, &["GET", &format!("{tag}:k")]).await.unwrap();
    assert_eq!(v, format!("{tag}-v"));
    let got: String = SET_AND_GET.run(conn, &[&format!("{tag}:s")], &[&format!("{tag}-script")]).await.unwrap();
    assert_eq!(got, format!("{tag}-script"));
}

/// The `ConnectError` of connecting `config` (the client must build): `shared()`'s error.
async fn shared_error(config: RedisConfig) -> ConnectError {
    match RedisClient::new(config).unwrap().shared().await {
        Ok(_) => panic!("connected, but an error was expected"),
        Err(e) => e,
    }
}

fn new_error(config: RedisConfig) -> String {
    match RedisClient::new(config) {
        Err(ConnectError::TlsConfig(msg)) => msg,
        Err(other) => panic!("expected ConnectError::TlsConfig, got {other:?}"),
        Ok(_) => panic!("RedisClient::new accepted a bad TLS configuration"),
    }
}

/// The port the server behind `conn` listens on (`INFO server`'s `tcp_port`) and its `ROLE`.
async fn where_am_i(conn: &mut RedisConn) -> (u16, String) {
    let info: String = cmd(conn, &["INFO", "server"]).await.unwrap();
    let port = info.lines().find_map(|l| l.strip_prefix("tcp_port:")).unwrap().trim().parse().unwrap();
    let role: Vec<redis::Value> = cmd(conn, &["ROLE"]).await.unwrap();
    let role = match &role[0] {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        other => format!("{other:?}"),
    };
    (port, role)
}

// ------------------------------------------------------------------------------------------------
// TLS, standalone
// ------------------------------------------------------------------------------------------------

#[tokio::test]
async fn tls_standalone_with_the_ca_file() {
    require_redis();
    let certs = TestCerts::generate();
    let mut server = RedisServer::start_tls(&certs, false);

    let client = RedisClient::new(RedisConfig::standalone(server.tls_url()).with_ca_file(certs.ca_cert())).unwrap();
    let mut conn = client.shared().await.unwrap();
    set_get_script(&mut conn, "ip").await;
    // The data went over TLS to the same server (the plain port sees it).
    assert_eq!(server.cli(&["GET", "ip:k"]), "ip-v");

    let localhost =
        RedisClient::new(RedisConfig::standalone(server.tls_url_localhost()).with_ca_file(certs.ca_cert())).unwrap();
    set_get_script(&mut localhost.shared().await.unwrap(), "name").await;

    // A blocking read on a dedicated TLS connection: the entry, then a 100 ms block that ends empty.
    let mut dedicated = client.dedicated().await.unwrap();
    let id: String = cmd(&mut conn, &["XADD", "st", "*", "f", "v"]).await.unwrap();
    let read: redis::streams::StreamReadReply =
        cmd(&mut dedicated, &["XREAD", "BLOCK", "100", "STREAMS", "st", "0"]).await.unwrap();
    assert_eq!(read.keys[0].ids[0].id, id);
    let t = Instant::now();
    let empty: Option<redis::streams::StreamReadReply> =
        cmd(&mut dedicated, &["XREAD", "BLOCK", "100", "STREAMS", "st", "$"]).await.unwrap();
    assert!(empty.is_none(), "{empty:?}");
    assert!(t.elapsed() >= Duration::from_millis(100), "{:?}", t.elapsed());

    // After a restart the shared connection reconnects by itself (the first call may fail).
    server.restart();
    let first: redis::RedisResult<String> = cmd(&mut conn, &["PING"]).await;
    if let Err(e) = &first {
        eprintln!("first call after the restart: {e}");
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match cmd::<()>(&mut conn, &["SET", "after", "restart"]).await {
            Ok(()) => break,
            Err(e) if Instant::now() < deadline => {
                eprintln!("after the restart: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the shared TLS connection did not come back after a restart: {e}"),
        }
    }
    assert_eq!(server.cli(&["GET", "after"]), "restart");
    set_get_script(&mut conn, "restarted").await;
}

#[tokio::test]
async fn tls_standalone_certificate_errors() {
    require_redis();
    let certs = TestCerts::generate();
    let server = RedisServer::start_tls(&certs, false);

    // A CA that did not sign the server's certificate.
    let other = certs.other_ca_cert();
    let err = shared_error(RedisConfig::standalone(server.tls_url()).with_ca_file(&other)).await;
    let shown = err.to_string();
    eprintln!("wrong CA: {shown}");
    let ConnectError::Tls { target, hint, .. } = &err else { panic!("expected ConnectError::Tls, got {err:?}") };
    assert_eq!(target, &format!("Redis at {}", server.tls_url()));
    assert_eq!(hint, &format!("the server's certificate is not signed by the CA in {}", other.display()));
    assert!(shown.starts_with(&format!("TLS handshake with Redis at {} failed: ", server.tls_url())), "{shown}");
    assert!(shown.ends_with(&format!("; {hint}")), "{shown}");
    assert!(shown.to_ascii_lowercase().contains("unknownissuer"), "{shown}");

    // No CA file: the system roots, which do not hold the test CA.
    let err = shared_error(RedisConfig::standalone(server.tls_url())).await;
    eprintln!("system roots: {err}");
    let ConnectError::Tls { hint, .. } = &err else { panic!("expected ConnectError::Tls, got {err:?}") };
    assert_eq!(
        hint,
        "the server's certificate is not signed by a CA the system trusts; give the CA's certificate \
         (baton: --redis-ca FILE or BATON_REDIS_CA)"
    );
}

#[tokio::test]
async fn tls_standalone_client_certificate() {
    require_redis();
    let certs = TestCerts::generate();
    let server = RedisServer::start_tls(&certs, true);
    let config = RedisConfig::standalone(server.tls_url()).with_ca_file(certs.ca_cert());

    let err = shared_error(config.clone()).await;
    eprintln!("no client certificate: {err}");
    let ConnectError::Tls { hint, .. } = &err else { panic!("expected ConnectError::Tls, got {err:?}") };
    assert_eq!(hint, "the server requires a client certificate (baton: --redis-client-cert and --redis-client-key)");

    let with_cert = config.with_client_cert(certs.client_cert(), certs.client_key());
    let client = RedisClient::new(with_cert).unwrap();
    set_get_script(&mut client.shared().await.unwrap(), "mtls").await;
    let mut dedicated = client.dedicated().await.unwrap();
    let none: Option<redis::streams::StreamReadReply> =
        cmd(&mut dedicated, &["XREAD", "BLOCK", "100", "STREAMS", "nothing", "$"]).await.unwrap();
    assert!(none.is_none());
}

#[test]
fn tls_configuration_errors_name_the_file() {
    let certs = TestCerts::generate();
    let url = "rediss://127.0.0.1:1";
    let dir = certs.dir();

    let not_pem = dir.join("not-pem.crt");
    std::fs::write(&not_pem, "this is not a certificate\n").unwrap();
    let msg = new_error(RedisConfig::standalone(url).with_ca_file(&not_pem));
    assert_eq!(
        msg,
        format!("{} holds no PEM CA certificate (expected a \"-----BEGIN CERTIFICATE-----\" block)", not_pem.display())
    );

    // A PEM block whose contents are not a certificate.
    let bad_pem = dir.join("bad-pem.crt");
    std::fs::write(&bad_pem, "-----BEGIN CERTIFICATE-----\nnot base64 !!!\n-----END CERTIFICATE-----\n").unwrap();
    let msg = new_error(RedisConfig::standalone(url).with_ca_file(&bad_pem));
    eprintln!("bad PEM: {msg}");
    assert!(msg.starts_with(&format!("the CA certificate file {} cannot be parsed: ", bad_pem.display())), "{msg}");

    let missing = dir.join("missing.crt");
    let msg = new_error(RedisConfig::standalone(url).with_ca_file(&missing));
    assert_eq!(
        msg,
        format!("cannot read the CA certificate file {}: No such file or directory (os error 2)", missing.display())
    );

    // A client certificate without its key (and a key without its certificate).
    let mut config = RedisConfig::standalone(url).with_ca_file(certs.ca_cert());
    config.tls.client_cert = Some(certs.client_cert());
    let msg = new_error(config);
    assert_eq!(
        msg,
        format!("the client certificate {} is given without its private key file", certs.client_cert().display())
    );
    let mut config = RedisConfig::standalone(url);
    config.tls.client_key = Some(certs.client_key());
    assert_eq!(
        new_error(config),
        format!("the private key {} is given without its client certificate file", certs.client_key().display())
    );

    // The certificate given as the key.
    let msg = new_error(RedisConfig::standalone(url).with_client_cert(certs.client_cert(), certs.client_cert()));
    assert_eq!(
        msg,
        format!(
            "{} holds no PEM private key (expected a \"-----BEGIN PRIVATE KEY-----\" block)",
            certs.client_cert().display()
        )
    );

    assert_eq!(
        new_error(RedisConfig::cluster(["rediss://127.0.0.1:1", "redis://127.0.0.1:2"])),
        "mix of rediss:// and redis:// URLs; use rediss:// for every node or for none"
    );
    assert_eq!(
        new_error(RedisConfig::standalone("redis://127.0.0.1:1").with_ca_file(certs.ca_cert())),
        "a CA or client certificate is set but the URLs use redis://; use rediss:// URLs for TLS"
    );
    // The Display users see.
    let err = RedisClient::new(RedisConfig::standalone(url).with_ca_file(&missing)).err().unwrap();
    assert!(err.to_string().starts_with("TLS configuration: cannot read the CA certificate file "), "{err}");
}

// ------------------------------------------------------------------------------------------------
// TLS, Cluster
// ------------------------------------------------------------------------------------------------

#[tokio::test]
async fn tls_cluster() {
    require_redis();
    let certs = TestCerts::generate();
    let mut cluster = RedisCluster::start_tls(&certs);
    let tls_ports: Vec<u16> = cluster.nodes().iter().map(|n| n.tls_port().unwrap()).collect();
    let plain_ports: Vec<u16> = cluster.nodes().iter().map(|n| n.port()).collect();

    let client = RedisClient::new(RedisConfig::cluster(cluster.tls_urls()).with_ca_file(certs.ca_cert())).unwrap();
    let mut conn = client.shared().await.unwrap();
    // Keys in many slots, so on every master (reached through the addresses CLUSTER SLOTS gives).
    for i in 0..30 {
        let key = format!("{{t{i}}}:k");
        let got: String = SET_AND_GET.run(&mut conn, &[&key], &[&format!("v{i}")]).await.unwrap();
        assert_eq!(got, format!("v{i}"));
    }

    // CLUSTER SLOTS over TLS names the TLS ports.
    let slots: Vec<redis::Value> = cmd(&mut conn, &["CLUSTER", "SLOTS"]).await.unwrap();
    let mut announced = Vec::new();
    for range in &slots {
        let redis::Value::Array(parts) = range else { panic!("{range:?}") };
        let (start, end): (u16, u16) =
            (redis::from_redis_value(parts[0].clone()).unwrap(), redis::from_redis_value(parts[1].clone()).unwrap());
        let master: Vec<redis::Value> = redis::from_redis_value(parts[2].clone()).unwrap();
        let host: String = redis::from_redis_value(master[0].clone()).unwrap();
        let port: u16 = redis::from_redis_value(master[1].clone()).unwrap();
        announced.push(port);
        // A node client for that master, over TLS: it owns the keys of its slots (one of the
        // 30 written is in every master's range).
        let key = (0..30).map(|i| format!("{{t{i}}}:k")).find(|k| {
            let s = baton_redis::key_slot(k.as_bytes());
            start <= s && s <= end
        });
        let node = client.node_client(&host, port).unwrap();
        let mut nc = node.get_multiplexed_async_connection().await.unwrap();
        let pong: String = redis::cmd("PING").query_async(&mut nc).await.unwrap();
        assert_eq!(pong, "PONG");
        let key = key.unwrap_or_else(|| panic!("none of the 30 keys is in slots {start}-{end}"));
        let v: String = redis::cmd("GET").arg(&key).query_async(&mut nc).await.unwrap();
        assert_eq!(v, format!("v{}", &key[2..key.find('}').unwrap()]));
    }
    announced.sort();
    let mut want = tls_ports.clone();
    want.sort();
    assert_eq!(announced, want, "CLUSTER SLOTS over TLS (plain ports {plain_ports:?})");

    // A blocking read on a dedicated Cluster connection over TLS.
    let mut dedicated = client.dedicated().await.unwrap();
    let none: Option<redis::streams::StreamReadReply> =
        cmd(&mut dedicated, &["XREAD", "BLOCK", "100", "STREAMS", "{t1}:s", "$"]).await.unwrap();
    assert!(none.is_none());
}

// ------------------------------------------------------------------------------------------------
// ACL users and passwords
// ------------------------------------------------------------------------------------------------

async fn whoami(config: RedisConfig) -> String {
    let mut conn = RedisClient::new(config).unwrap().shared().await.unwrap();
    set_get_script(&mut conn, "acl").await;
    cmd(&mut conn, &["ACL", "WHOAMI"]).await.unwrap()
}

#[tokio::test]
async fn acl_user_and_password() {
    require_redis();
    let server = RedisServer::start_with_requirepass(ServerOptions::default(), "defaultpw");
    server.add_acl_user("app", "s3cret");
    let p = server.port();

    assert_eq!(whoami(RedisConfig::standalone(format!("redis://app:s3cret@127.0.0.1:{p}"))).await, "app");
    assert_eq!(
        whoami(RedisConfig::standalone(format!("redis://app@127.0.0.1:{p}")).with_password("s3cret")).await,
        "app"
    );
    assert_eq!(
        whoami(RedisConfig::standalone(format!("redis://127.0.0.1:{p}")).with_username("app").with_password("s3cret"))
            .await,
        "app"
    );
    // requirepass: the default user with a password.
    assert_eq!(
        whoami(RedisConfig::standalone(format!("redis://127.0.0.1:{p}")).with_password("defaultpw")).await,
        "default"
    );

    // A wrong password: Unreachable, and the message never shows the password.
    let t = Instant::now();
    let err = shared_error(RedisConfig::standalone(format!("redis://app:WrongPw1@127.0.0.1:{p}"))).await;
    let shown = err.to_string();
    eprintln!("wrong password in the URL ({:?}): {shown}", t.elapsed());
    assert!(matches!(err, ConnectError::Unreachable { .. }), "{err:?}");
    assert!(!shown.contains("WrongPw1") && !format!("{err:?}").contains("WrongPw1"), "{shown} / {err:?}");
    assert_eq!(
        shown,
        format!("cannot connect to Redis at redis://app:***@127.0.0.1:{p}: Password authentication failed - AuthenticationFailed")
    );

    let err = shared_error(
        RedisConfig::standalone(format!("redis://127.0.0.1:{p}")).with_username("app").with_password("WrongPw2"),
    )
    .await;
    let shown = err.to_string();
    eprintln!("wrong password given apart: {shown}");
    assert!(matches!(err, ConnectError::Unreachable { .. }), "{err:?}");
    assert!(!shown.contains("WrongPw2") && !format!("{err:?}").contains("WrongPw2"), "{shown}");
    assert_eq!(
        shown,
        format!(
            "cannot connect to Redis at redis://127.0.0.1:{p}: Password authentication failed - AuthenticationFailed"
        )
    );

    // No password at all on a requirepass server.
    let err = shared_error(RedisConfig::standalone(format!("redis://127.0.0.1:{p}"))).await;
    eprintln!("no password: {err}");
    assert!(matches!(err, ConnectError::Unreachable { .. }), "{err:?}");
    assert!(err.to_string().starts_with(&format!("cannot connect to Redis at redis://127.0.0.1:{p}: ")), "{err}");
    assert!(err.to_string().contains("NOAUTH"), "{err}");
}

#[tokio::test]
async fn acl_cluster() {
    require_redis();
    let mut cluster = RedisCluster::start();
    for node in cluster.nodes().iter() {
        node.add_acl_user("app", "s3cret");
    }
    let config = cluster.config().with_username("app").with_password("s3cret");
    let client = RedisClient::new(config.clone()).unwrap();
    let mut conn = client.shared().await.unwrap();
    for i in 0..12 {
        let key = format!("{{a{i}}}:k");
        let got: String = SET_AND_GET.run(&mut conn, &[&key], &[&"x"]).await.unwrap();
        assert_eq!(got, "x");
    }
    let me: String = cmd(&mut conn, &["ACL", "WHOAMI"]).await.unwrap();
    assert_eq!(me, "app");
    let port = cluster.nodes()[1].port();
    let mut node = client.node_client("127.0.0.1", port).unwrap().get_multiplexed_async_connection().await.unwrap();
    let me: String = redis::cmd("ACL").arg("WHOAMI").query_async(&mut node).await.unwrap();
    assert_eq!(me, "app");

    let err = shared_error(cluster.config().with_username("app").with_password("WrongPw3")).await;
    let shown = err.to_string();
    eprintln!("cluster, wrong password: {shown}");
    assert!(matches!(err, ConnectError::Unreachable { .. }), "{err:?}");
    assert!(!shown.contains("WrongPw3") && !format!("{err:?}").contains("WrongPw3"), "{shown}");
    assert!(
        shown.ends_with(
            ": Failed to create initial connections - Io: Password authentication failed - AuthenticationFailed"
        ),
        "{shown}"
    );
}

// ------------------------------------------------------------------------------------------------
// Sentinel
// ------------------------------------------------------------------------------------------------

/// Calls `attempt` every 50 ms until it succeeds or `limit` passes; returns its value and the time
/// taken, and prints the distinct errors seen on the way.
async fn until_ok<T, F, Fut>(what: &str, limit: Duration, mut attempt: F) -> (T, Duration)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = redis::RedisResult<T>>,
{
    let start = Instant::now();
    let mut errors: Vec<String> = Vec::new();
    loop {
        match attempt().await {
            Ok(v) => {
                eprintln!("{what}: recovered after {:?}; errors on the way: {errors:?}", start.elapsed());
                return (v, start.elapsed());
            }
            Err(e) => {
                let e = e.to_string();
                if !errors.contains(&e) {
                    errors.push(e);
                }
                if start.elapsed() > limit {
                    panic!("{what}: not recovered after {limit:?}; errors: {errors:?}");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

// Multi-threaded: the test blocks its thread (testkit calls), the client's tasks run meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_follows_a_killed_master() {
    require_redis();
    let mut set = RedisSentinelSet::start(1, 3);
    let client = RedisClient::new(RedisConfig::sentinel(set.sentinel_urls(), set.master_name())).unwrap();
    let mut shared = client.shared().await.unwrap();
    let mut dedicated = client.dedicated().await.unwrap();
    for _ in 0..5 {
        let _: i64 = cmd(&mut shared, &["INCR", "n"]).await.unwrap();
    }
    let old = set.master_port();
    assert_eq!(where_am_i(&mut shared).await, (old, "master".to_string()));
    assert_eq!(where_am_i(&mut dedicated).await, (old, "master".to_string()));
    let replicated: i64 = cmd(&mut shared, &["WAIT", "1", "2000"]).await.unwrap();
    assert_eq!(replicated, 1);

    set.node_by_port(old).kill();
    let killed = Instant::now();
    let writes = {
        let shared = shared.clone();
        async move {
            until_ok("shared connection, INCR", Duration::from_secs(15), || {
                let mut c = shared.clone();
                async move { cmd::<i64>(&mut c, &["INCR", "n"]).await }
            })
            .await
        }
    };
    let reads = {
        let dedicated = dedicated.clone();
        async move {
            until_ok("dedicated connection, XREAD BLOCK 200", Duration::from_secs(15), || {
                let mut c = dedicated.clone();
                async move {
                    match tokio::time::timeout(
                        Duration::from_secs(2),
                        cmd::<Option<redis::streams::StreamReadReply>>(
                            &mut c,
                            &["XREAD", "BLOCK", "200", "STREAMS", "stream", "$"],
                        ),
                    )
                    .await
                    {
                        Ok(r) => r,
                        Err(_) => Err(redis::RedisError::from(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "XREAD BLOCK 200 got no reply within 2 s",
                        ))),
                    }
                }
            })
            .await
        }
    };
    let ((n, write_time), (_, read_time)) = tokio::join!(writes, reads);
    eprintln!(
        "Sentinel, master SIGKILLed: shared INCR back after {write_time:?}, dedicated XREAD after {read_time:?} \
         (total since kill {:?})",
        killed.elapsed()
    );
    assert_eq!(n, 6, "the 5 replicated increments survive, the new one lands on the new master");
    let new = set.master_port();
    assert_ne!(new, old);
    assert_eq!(where_am_i(&mut shared).await, (new, "master".to_string()));
    assert_eq!(where_am_i(&mut dedicated).await, (new, "master".to_string()));
}

// Multi-threaded: the test blocks its thread (testkit calls), the client's tasks run meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_follows_a_manual_failover() {
    require_redis();
    let mut set = RedisSentinelSet::start(1, 3);
    let client = RedisClient::new(RedisConfig::sentinel(set.sentinel_urls(), set.master_name())).unwrap();
    let mut shared = client.shared().await.unwrap();
    for _ in 0..3 {
        let _: i64 = cmd(&mut shared, &["INCR", "m"]).await.unwrap();
    }
    let replicated: i64 = cmd(&mut shared, &["WAIT", "1", "2000"]).await.unwrap();
    assert_eq!(replicated, 1);
    let old = set.master_port();

    let started = Instant::now();
    sentinel_failover(&mut set).await;
    // The old master stays a master (and takes writes, lost later) until the sentinels convert
    // it to a replica, about 8 s after the failover: the connection must move to the new master
    // as soon as the sentinels switch (their +switch-master event), not when the old one is
    // demoted.
    let new = set.wait_for_failover(old, Duration::from_secs(15));
    eprintln!("127.0.0.1:{old} after the switch: ROLE {:?}", set.node_by_port(old).cli(&["ROLE"]));
    let (n, t) = until_ok("shared connection after SENTINEL FAILOVER", Duration::from_secs(10), || {
        let mut c = shared.clone();
        async move { cmd::<i64>(&mut c, &["INCR", "m"]).await }
    })
    .await;
    eprintln!("Sentinel, manual failover: done after {:?}, first write {t:?} after", started.elapsed());
    assert_eq!(n, 4);
    assert_eq!(where_am_i(&mut shared).await, (new, "master".to_string()));
    assert_eq!(set.node_by_port(new).cli(&["GET", "m"]), "4");
}

// Multi-threaded: the test blocks its thread (testkit calls), the client's tasks run meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_unreachable_sentinels() {
    require_redis();
    let mut set = RedisSentinelSet::start(0, 2);
    let dead = format!("redis://127.0.0.1:{}", free_port());
    let mut urls = vec![dead.clone()];
    urls.extend(set.sentinel_urls());
    let client = RedisClient::new(RedisConfig::sentinel(urls, set.master_name())).unwrap();
    let mut conn = client.shared().await.unwrap();
    set_get_script(&mut conn, "dead-first").await;
    assert_eq!(where_am_i(&mut conn).await, (set.master_port(), "master".to_string()));

    // Every sentinel gone: an error, promptly.
    for s in set.sentinels() {
        s.kill();
    }
    let t = Instant::now();
    let err = client.shared().await.err().expect("connected with every sentinel down");
    eprintln!("all sentinels down ({:?}): {err}", t.elapsed());
    assert!(t.elapsed() < RESOLVE_TIMEOUT + Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(matches!(err, ConnectError::Unreachable { .. }), "{err:?}");

    // Sentinels that accept connections but never answer (SIGSTOP): an error within the
    // resolve timeout, not a hang.
    for s in set.sentinels() {
        s.restart();
        s.pause();
    }
    let t = Instant::now();
    let err = client.shared().await.err().expect("connected with every sentinel paused");
    eprintln!("all sentinels paused ({:?}): {err}", t.elapsed());
    assert!(t.elapsed() < RESOLVE_TIMEOUT + Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(matches!(err, ConnectError::Unreachable { .. }), "{err:?}");
    for s in set.sentinels() {
        s.resume();
    }
}

/// `SENTINEL FAILOVER <master>` on the first sentinel, again while it answers `NOGOODSLAVE` (its
/// view of the replica a moment old, under load) for up to 5 s.
async fn sentinel_failover(set: &mut RedisSentinelSet) {
    let name = set.master_name().to_string();
    let url = set.sentinels()[0].url();
    let mut conn = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match redis::cmd("SENTINEL").arg("FAILOVER").arg(&name).query_async::<String>(&mut conn).await {
            Ok(ok) => return assert_eq!(ok, "OK"),
            Err(e) if e.code() == Some("NOGOODSLAVE") && Instant::now() < deadline => {
                eprintln!("SENTINEL FAILOVER: {e}; again");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("SENTINEL FAILOVER {name}: {e}"),
        }
    }
}

/// The port a node of `set` listens on for the harness (plain) given the port the sentinels name
/// (TLS).
fn plain_port(set: &mut RedisSentinelSet, port: u16) -> u16 {
    set.node_by_port(port).port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_sentinel() {
    require_redis();
    let certs = TestCerts::generate();
    let mut set = RedisSentinelSet::start_tls(&certs, 1, 3);
    let config = RedisConfig::sentinel(set.sentinel_tls_urls(), set.master_name()).with_ca_file(certs.ca_cert());
    let client = RedisClient::new(config).unwrap();
    let mut shared = client.shared().await.unwrap();
    let mut dedicated = client.dedicated().await.unwrap();
    set_get_script(&mut shared, "tls-sentinel").await;
    let first = set.master_port();
    assert_eq!(set.node_by_port(first).tls_port(), Some(first), "the sentinels name the TLS port");
    let first_plain = plain_port(&mut set, first);
    assert_eq!(where_am_i(&mut shared).await, (first_plain, "master".to_string()));
    let none: Option<redis::streams::StreamReadReply> =
        cmd(&mut dedicated, &["XREAD", "BLOCK", "100", "STREAMS", "s", "$"]).await.unwrap();
    assert!(none.is_none());
    let _: i64 = cmd(&mut shared, &["INCR", "t"]).await.unwrap();
    assert_eq!(cmd::<i64>(&mut shared, &["WAIT", "1", "2000"]).await.unwrap(), 1);

    // A manual failover: the announced master, reached over TLS.
    sentinel_failover(&mut set).await;
    let second = set.wait_for_failover(first, Duration::from_secs(15));
    let (n, _) = until_ok("TLS Sentinel, after SENTINEL FAILOVER", Duration::from_secs(10), || {
        let mut c = shared.clone();
        async move { cmd::<i64>(&mut c, &["INCR", "t"]).await }
    })
    .await;
    assert_eq!(n, 2);
    let second_plain = plain_port(&mut set, second);
    assert_eq!(where_am_i(&mut shared).await, (second_plain, "master".to_string()));

    // The new master killed: the sentinels, asked over TLS, name the first one again.
    set.node_by_port(first).wait_replica_link_up(Duration::from_secs(15));
    assert_eq!(cmd::<i64>(&mut shared, &["WAIT", "1", "2000"]).await.unwrap(), 1);
    set.node_by_port(second).kill();
    let (n, t) = until_ok("TLS Sentinel, after SIGKILL", Duration::from_secs(15), || {
        let mut c = shared.clone();
        async move { cmd::<i64>(&mut c, &["INCR", "t"]).await }
    })
    .await;
    eprintln!("TLS Sentinel, master SIGKILLed: writes back after {t:?}");
    assert_eq!(n, 3);
    assert_eq!(where_am_i(&mut shared).await, (first_plain, "master".to_string()));
    let none: Option<redis::streams::StreamReadReply> =
        until_ok("TLS Sentinel, dedicated", Duration::from_secs(5), || {
            let mut c = dedicated.clone();
            async move { cmd(&mut c, &["XREAD", "BLOCK", "100", "STREAMS", "s", "$"]).await }
        })
        .await
        .0;
    assert!(none.is_none());
    assert_eq!(where_am_i(&mut dedicated).await, (first_plain, "master".to_string()));
}
