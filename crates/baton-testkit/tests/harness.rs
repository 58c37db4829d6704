//! Proves the test harness: real redis-server processes, a real cluster, a real proxy.

use std::time::{Duration, Instant};

use baton_redis::redis::{self, AsyncCommands};
use baton_redis::RedisClient;
use baton_testkit::{
    free_port, require_redis, KillStorm, RedisCluster, RedisServer, ServerOptions, TcpProxy, TestBackend,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z ")
}

fn server_pid(server: &RedisServer) -> u32 {
    let info = server.cli(&["INFO", "server"]);
    info.lines().find_map(|l| l.strip_prefix("process_id:")).expect("process_id in INFO").trim().parse().unwrap()
}

#[test]
fn free_port_is_bindable() {
    let port = free_port();
    assert_ne!(port, 0);
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("free port can be bound");
}

#[test]
fn standalone_start_ping_kill_and_drop() {
    require_redis();
    let mut server = RedisServer::start();
    assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
    assert_eq!(server.config(), baton_redis::RedisConfig::standalone(server.url()));
    assert_eq!(server.cli(&["PING"]), "PONG");
    assert_eq!(server.cli(&["CONFIG", "GET", "appendonly"]), "appendonly\nno");
    assert_eq!(server.cli(&["CONFIG", "GET", "bind"]), "bind\n127.0.0.1");
    let dir = server.dir().to_path_buf();
    assert!(dir.join("redis.log").exists());

    let pid = server_pid(&server);
    server.kill();
    assert!(!pid_alive(pid), "redis-server {pid} still alive after kill");
    assert!(std::net::TcpStream::connect(("127.0.0.1", server.port())).is_err());

    server.restart();
    assert_eq!(server.cli(&["PING"]), "PONG");
    let pid = server_pid(&server);
    drop(server);
    assert!(!pid_alive(pid), "redis-server {pid} still alive after drop");
    assert!(!dir.exists(), "temp dir {} not removed", dir.display());
}

#[test]
fn restart_without_aof_loses_data() {
    let mut server = RedisServer::start();
    server.cli(&["SET", "k", "v"]);
    server.restart();
    assert_eq!(server.cli(&["EXISTS", "k"]), "0");
}

#[test]
fn restart_with_aof_keeps_data() {
    let mut server = RedisServer::start_with(ServerOptions { appendonly: true });
    assert_eq!(server.cli(&["CONFIG", "GET", "appendfsync"]), "appendfsync\nalways");
    let port = server.port();
    server.cli(&["SET", "k", "v"]);
    server.kill();
    server.restart();
    assert_eq!(server.port(), port);
    assert_eq!(server.cli(&["GET", "k"]), "v");
}

/// A restart returns once the AOF is loaded (INFO is answered while it loads; data commands
/// answer LOADING): 300,000 keys take Redis a few hundred ms to load.
#[test]
fn restart_returns_once_the_data_is_loaded() {
    let mut server = RedisServer::start_with(ServerOptions { appendonly: true });
    server.cli(&["EVAL", "for i = 1, 300000 do redis.call('SET', 'k' .. i, 'v') end", "0"]);
    server.restart();
    assert_eq!(server.cli(&["DBSIZE"]), "300000");
}

#[test]
#[should_panic(expected = "ERR unknown command")]
fn cli_panics_on_error_reply() {
    let server = RedisServer::start();
    server.cli(&["NO-SUCH-COMMAND"]);
}

#[test]
fn panicking_test_still_kills_its_server() {
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::thread::spawn(move || {
        let server = RedisServer::start();
        tx.send(server_pid(&server)).unwrap();
        panic!("test failure with a live server");
    })
    .join();
    assert!(result.is_err());
    let pid = rx.recv().unwrap();
    assert!(!pid_alive(pid), "redis-server {pid} survived a panicking test");
}

#[tokio::test]
async fn pause_and_resume() {
    let server = RedisServer::start();
    let client = RedisClient::new(server.config()).unwrap();
    let mut conn = client.shared().await.unwrap();
    let _: () = conn.set("k", "v").await.unwrap();

    server.pause();
    let res = tokio::time::timeout(Duration::from_millis(300), async {
        let v: redis::RedisResult<String> = conn.get("k").await;
        v
    })
    .await;
    assert!(res.is_err(), "a paused server answered: {res:?}");
    server.resume();
    let v: String = conn.get("k").await.unwrap();
    assert_eq!(v, "v");
}

#[tokio::test]
async fn cluster_start_and_cross_slot_keys() {
    let started = Instant::now();
    let mut cluster = RedisCluster::start();
    eprintln!("cluster ready in {:?}", started.elapsed());
    assert_eq!(cluster.urls().len(), 3);
    for node in cluster.nodes().iter() {
        let info = node.cli(&["CLUSTER", "INFO"]);
        assert!(info.contains("cluster_state:ok"), "{info}");
        assert!(info.contains("cluster_slots_assigned:16384"), "{info}");
        assert!(info.contains("cluster_known_nodes:3"), "{info}");
    }

    let client = RedisClient::new(cluster.config()).unwrap();
    assert!(client.is_cluster());
    let mut conn = client.shared().await.unwrap();
    // Keys whose slots fall on different masters.
    let keys = ["a", "b", "c", "{user1}x", "{user2}y", "foo", "bar", "baz"];
    let mut slots = std::collections::BTreeSet::new();
    for key in keys {
        let slot: i64 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query_async(&mut conn).await.unwrap();
        slots.insert(slot / 5462); // 3 masters, ~5461 slots each
        let _: () = conn.set(key, format!("value-{key}")).await.unwrap();
    }
    assert!(slots.len() >= 2, "keys all on one node: {slots:?}");
    for key in keys {
        let v: String = conn.get(key).await.unwrap();
        assert_eq!(v, format!("value-{key}"));
    }
    // Every node holds some of them.
    let per_node: Vec<i64> = cluster.nodes().iter().map(|n| n.cli(&["DBSIZE"]).parse().unwrap()).collect();
    assert_eq!(per_node.iter().sum::<i64>(), keys.len() as i64);
    assert!(per_node.iter().filter(|&&n| n > 0).count() >= 2, "{per_node:?}");

    // A node can be killed and restarted with its cluster identity.
    let node = &mut cluster.nodes()[0];
    node.kill();
    node.restart();
    assert!(node.cli(&["CLUSTER", "MYID"]).len() == 40);

    let backend = TestBackend::Cluster(cluster);
    assert_eq!(backend.name(), "cluster");
    assert!(
        matches!(backend.redis_config().map(|c| c.servers), Some(baton_redis::RedisServers::Cluster(urls)) if urls.len() == 3)
    );
}

/// Clusters started one after another (the later ones formed in the background meanwhile) are
/// each their caller's own: no node in common, every node `ok` with all slots, no key in any,
/// and one keeps working when the one before it is dropped.
#[test]
fn clusters_started_in_a_row_are_separate_and_empty() {
    let mut first = RedisCluster::start();
    // A key in the first (redis-cli -c follows the redirect to the slot's node).
    let port = first.nodes()[0].port().to_string();
    let out =
        std::process::Command::new("redis-cli").args(["-c", "-p", &port, "SET", "{k}", "first"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "OK");
    let mut second = RedisCluster::start();
    let mut third = RedisCluster::start();
    let ports = |c: &mut RedisCluster| c.nodes().iter().map(|n| n.port()).collect::<std::collections::BTreeSet<u16>>();
    let (p1, p2, p3) = (ports(&mut first), ports(&mut second), ports(&mut third));
    assert_eq!((p1.len(), p2.len(), p3.len()), (3, 3, 3));
    assert!(p1.is_disjoint(&p2) && p2.is_disjoint(&p3) && p1.is_disjoint(&p3), "{p1:?} {p2:?} {p3:?}");
    drop(first);
    for c in [&mut second, &mut third] {
        for node in c.nodes().iter() {
            let info = node.cli(&["CLUSTER", "INFO"]);
            assert!(info.contains("cluster_state:ok"), "{info}");
            assert!(info.contains("cluster_slots_ok:16384"), "{info}");
            assert!(info.contains("cluster_known_nodes:3"), "{info}");
            assert_eq!(node.cli(&["DBSIZE"]).trim(), "0");
        }
    }
}

#[test]
fn test_backend_names_and_configs() {
    assert_eq!(TestBackend::Memory.name(), "memory");
    assert_eq!(TestBackend::Memory.redis_config(), None);
    let server = RedisServer::start();
    let config = server.config();
    let backend = TestBackend::Standalone(server);
    assert_eq!(backend.name(), "standalone");
    assert_eq!(backend.redis_config(), Some(config));
}

async fn ping_raw(stream: &mut tokio::net::TcpStream) -> std::io::Result<String> {
    stream.write_all(b"PING\r\n").await?;
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buf)).await??;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// The stream is closed: a PING gets end-of-file or an error (reset, broken pipe) within 2 s; an
/// answer or silence fails.
async fn assert_closed(stream: &mut tokio::net::TcpStream, what: &str) {
    // A write to a closed connection may still succeed locally (the reset comes later).
    let _ = stream.write_all(b"PING\r\n").await;
    let mut buf = [0u8; 64];
    match tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buf)).await {
        Ok(Ok(0)) | Ok(Err(_)) => {}
        Ok(Ok(n)) => panic!("{what} answered: {:?}", String::from_utf8_lossy(&buf[..n])),
        Err(_) => panic!("{what} is still open: no end-of-file or error within 2 s"),
    }
}

#[tokio::test]
async fn proxy_forwards_drops_and_refuses() {
    let server = RedisServer::start();
    let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
    let proxy = TcpProxy::start(target).await;
    assert_eq!(proxy.addr().ip(), std::net::Ipv4Addr::LOCALHOST);

    // Raw connection: works, is cut, a new one works.
    let mut raw = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(ping_raw(&mut raw).await.unwrap(), "+PONG\r\n");
    proxy.drop_connections();
    assert_closed(&mut raw, "a cut connection").await;
    let mut raw2 = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(ping_raw(&mut raw2).await.unwrap(), "+PONG\r\n");

    // redis crate connection (no auto-reconnect): works, breaks on a cut, a new one works.
    let client = redis::Client::open(format!("redis://{}", proxy.addr())).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = conn.set("k", "v").await.unwrap();
    proxy.drop_connections();
    let res: redis::RedisResult<String> = conn.get("k").await;
    assert!(res.is_err(), "connection survived drop_connections: {res:?}");
    let mut conn2 = client.get_multiplexed_async_connection().await.unwrap();
    let v: String = conn2.get("k").await.unwrap();
    assert_eq!(v, "v");

    // Refusing: new connections are closed at once; live ones keep working; then accepted again.
    proxy.set_refuse(true);
    let mut refused = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    assert_closed(&mut refused, "a refused connection").await;
    let v: String = conn2.get("k").await.unwrap();
    assert_eq!(v, "v");
    proxy.set_refuse(false);
    let mut raw3 = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(ping_raw(&mut raw3).await.unwrap(), "+PONG\r\n");

    // Dropping the proxy cuts what is left.
    drop(proxy);
    assert_closed(&mut raw3, "a connection through a dropped proxy").await;
}

/// A kill storm breaks every normal connection open when it starts, counts them, and kills
/// nothing once stopped.
#[tokio::test]
async fn kill_storm_kills_normal_connections_until_stopped() {
    require_redis();
    let server = RedisServer::start();
    let client = redis::Client::open(server.url()).unwrap();
    let mut conns = Vec::new();
    for _ in 0..3 {
        conns.push(client.get_multiplexed_async_connection().await.unwrap());
    }
    let storm = KillStorm::start(vec![server.url()], Duration::from_millis(3)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let killed = storm.stop().await;
    assert!(killed >= 3, "{killed} connections killed");
    for conn in &mut conns {
        let r: redis::RedisResult<String> = redis::cmd("PING").query_async(conn).await;
        assert!(r.is_err(), "a connection survived the storm: {r:?}");
    }
    let mut after = client.get_multiplexed_async_connection().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let pong: String = redis::cmd("PING").query_async(&mut after).await.unwrap();
    assert_eq!(pong, "PONG");
}

/// Helper for `servers_die_with_a_killed_test_process`: does nothing unless run by it.
#[test]
#[ignore = "helper process, run by servers_die_with_a_killed_test_process"]
fn helper_hold_servers_until_killed() {
    if std::env::var_os("BATON_TESTKIT_HOLD_SERVERS").is_none() {
        return;
    }
    // One server started from a thread that ends, one from the test thread, one in a static-like
    // leak (never dropped).
    let from_thread = std::thread::spawn(RedisServer::start).join().unwrap();
    let here = RedisServer::start();
    let leaked: &'static RedisServer = Box::leak(Box::new(RedisServer::start()));
    std::thread::sleep(Duration::from_millis(300)); // the spawning thread is gone by now
    for s in [&from_thread, &here, leaked] {
        assert_eq!(s.cli(&["PING"]), "PONG");
        println!("PID {}", server_pid(s));
        println!("DIR {}", s.dir().display());
    }
    println!("READY");
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn servers_die_with_a_killed_test_process() {
    use std::io::BufRead;
    // Orphans of the helper are re-parented to this process (not to PID 1), so that they can be
    // reaped here and leave no zombie behind.
    // SAFETY: prctl with integer arguments.
    assert_eq!(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong) }, 0);
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["harness::helper_hold_servers_until_killed", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("BATON_TESTKIT_HOLD_SERVERS", "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut pids = Vec::new();
    let mut dirs = Vec::new();
    for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        // libtest may print "test NAME ... " on the same line, before the first one.
        if let Some((_, pid)) = line.split_once("PID ") {
            pids.push(pid.trim().parse::<u32>().unwrap());
        }
        if let Some((_, dir)) = line.split_once("DIR ") {
            dirs.push(std::path::PathBuf::from(dir.trim()));
        }
        if line.contains("READY") {
            break;
        }
    }
    assert_eq!(pids.len(), 3, "helper did not report its servers");
    assert!(pids.iter().all(|&p| pid_alive(p)));
    child.kill().unwrap(); // SIGKILL: no Drop runs
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut alive = pids.clone();
    while !alive.is_empty() {
        // SAFETY: waitpid on specific pids, now children of this process (subreaper).
        alive.retain(|&p| {
            match unsafe { libc::waitpid(p as libc::pid_t, std::ptr::null_mut(), libc::WNOHANG) } {
                0 => true,          // still running
                -1 => pid_alive(p), // not our child (no subreaper support): look at /proc
                _ => false,         // reaped
            }
        });
        assert!(Instant::now() < deadline, "redis-server outlived its killed test process: {alive:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(pids.iter().all(|&p| !pid_alive(p)));
    // No Drop ran in the killed process: its temporary directories are left to clean.
    for dir in dirs {
        std::fs::remove_dir_all(&dir).unwrap();
    }
    // SAFETY: as above.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 0 as libc::c_ulong) };
}
