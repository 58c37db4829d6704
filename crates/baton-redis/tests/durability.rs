//! Opt-in durability (`Durability`, `LuaScript::query_durable`): a write is acknowledged only
//! once the replicas asked for hold it, and too few replicas in time is an error that says the
//! write is on the master. Real processes: a master and a replica (`REPLICAOF`), the replica
//! paused with SIGSTOP to stop it confirming.

use std::time::{Duration, Instant};

use baton_redis::{is_not_replicated, redis, LuaScript, RedisClient, RedisConfig};
use baton_testkit::RedisServer;

static SET_AND_COUNT: LuaScript =
    LuaScript::new("set_and_count", "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('INCR', KEYS[2])");

/// A master and one replica in sync.
fn master_and_replica() -> (RedisServer, RedisServer) {
    let master = RedisServer::start();
    let replica = RedisServer::start();
    replica.replicate_from(&master);
    (master, replica)
}

fn cmd(key: &str, counter: &str, value: &str) -> redis::Cmd {
    let mut c = SET_AND_COUNT.evalsha_cmd(2);
    c.arg(key).arg(counter).arg(value);
    c
}

#[tokio::test]
async fn a_durable_write_is_on_the_replica_when_acknowledged_and_an_error_when_it_cannot_be() {
    let (master, replica) = master_and_replica();
    let config = RedisConfig::standalone(master.url()).with_durability(1, Duration::from_millis(300));
    let client = RedisClient::new(config).unwrap();
    let d = client.durability();
    assert_eq!(d, Some(baton_redis::Durability { replicas: 1, timeout: Duration::from_millis(300) }));
    let mut conn = client.shared().await.unwrap();

    // The first call loads the script (NOSCRIPT inside the pipeline) and still waits. A longer
    // timeout for the writes that must succeed: a loaded CI machine can hold a replica's ack
    // back for a while.
    let patient = Some(baton_redis::Durability { replicas: 1, timeout: Duration::from_secs(4) });
    for i in 1..=20i64 {
        let n: i64 =
            SET_AND_COUNT.query_durable(&mut conn, &cmd("{d}:k", "{d}:n", &format!("v{i}")), patient).await.unwrap();
        assert_eq!(n, i);
        // Acknowledged means the replica has it, read right away.
        assert_eq!(replica.cli(&["GET", "{d}:n"]).trim(), i.to_string());
    }

    // The replica stops confirming: the write fails after the timeout, saying so; it is on the
    // master all the same.
    replica.pause();
    let started = Instant::now();
    let err = SET_AND_COUNT
        .query_durable::<i64, _>(&mut conn, &cmd("{d}:k", "{d}:n", "late"), d)
        .await
        .expect_err("no replica confirms");
    let waited = started.elapsed();
    replica.resume();
    assert!(is_not_replicated(&err), "{err}");
    let text = err.to_string();
    assert!(text.contains("0 of 1 replica(s) confirmed within 300ms"), "{text}");
    assert!(text.contains("applied on the master"), "{text}");
    assert!(waited >= Duration::from_millis(290) && waited < Duration::from_secs(3), "{waited:?}");
    assert_eq!(master.cli(&["GET", "{d}:n"]).trim(), "21");

    // Without durability the same call does not wait.
    let plain = RedisClient::new(RedisConfig::standalone(master.url())).unwrap();
    let mut pconn = plain.shared().await.unwrap();
    replica.pause();
    let started = Instant::now();
    let n: i64 = SET_AND_COUNT.query_durable(&mut pconn, &cmd("{d}:k", "{d}:n", "x"), None).await.unwrap();
    assert_eq!(n, 22);
    assert!(started.elapsed() < Duration::from_millis(250), "{:?}", started.elapsed());
    replica.resume();

    // A script error is the script's error, not a replication one.
    static FAILS: LuaScript = LuaScript::new("fails", "return redis.error_reply('ERR nope')");
    let mut c = FAILS.evalsha_cmd(1);
    c.arg("{d}:k");
    let err = FAILS.query_durable::<i64, _>(&mut conn, &c, d).await.unwrap_err();
    assert!(!is_not_replicated(&err) && err.to_string().contains("nope"), "{err}");
}

#[test]
fn durability_bounds_are_checked_when_the_client_is_built() {
    let zero = RedisConfig::standalone("redis://127.0.0.1:1").with_durability(0, Duration::from_secs(1));
    let e = RedisClient::new(zero).err().expect("0 replicas refused").to_string();
    assert_eq!(e, "Redis durability: the number of replicas to wait for must be at least 1");
    let long = RedisConfig::standalone("redis://127.0.0.1:1").with_durability(1, Duration::from_secs(5));
    let e = RedisClient::new(long).err().expect("5 s refused").to_string();
    assert_eq!(e, "Redis durability: the replica wait timeout must be from 1ms to 4s; got 5s");
}
