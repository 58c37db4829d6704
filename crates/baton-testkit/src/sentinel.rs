//! A throwaway Redis Sentinel deployment: one master, its replicas, and the sentinels watching it.

use std::fmt;
use std::time::{Duration, Instant};

use crate::{raw_command, tls_server_args, LaunchSpec, RedisServer, TestCerts};

/// The name the sentinels monitor the master under.
const MASTER_NAME: &str = "baton-master";
/// Time allowed for the replicas to sync and the sentinels to find each other.
const FORM_TIMEOUT: Duration = Duration::from_secs(30);

/// One master, `replicas` replicas (`--replicaof 127.0.0.1 MASTER_PORT`) and `sentinels` sentinels
/// (`redis-server sentinel.conf --sentinel`, each with its own `sentinel.conf` in its own
/// temporary directory), all on 127.0.0.1. The sentinels monitor the master as
/// [`RedisSentinelSet::master_name`] with quorum `sentinels / 2 + 1`, `down-after-milliseconds`
/// 1000 and `failover-timeout` 5000, so a killed master is replaced within a few seconds.
///
/// Every process is a [`RedisServer`] (free ports, temporary directories, killed on drop, dies
/// with the test process).
pub struct RedisSentinelSet {
    /// The data servers: `[0]` is the first master, then the replicas in start order.
    nodes: Vec<RedisServer>,
    sentinels: Vec<RedisServer>,
}

impl RedisSentinelSet {
    /// Starts the set and waits (up to 30 s) until every replica reports `master_link_status:up`
    /// and every sentinel knows the master (flags `master`), all `replicas` replicas (none down
    /// or disconnected) and the `sentinels - 1` other sentinels. Panics on failure, with the last
    /// state seen. `sentinels` must be at least 1.
    pub fn start(replicas: usize, sentinels: usize) -> RedisSentinelSet {
        Self::start_with(replicas, sentinels, None)
    }

    /// [`RedisSentinelSet::start`], every process also serving TLS with `certs` (server
    /// certificate for 127.0.0.1 and `localhost`, clients not asked for a certificate): the data
    /// nodes replicate over TLS (`tls-replication yes`, replicas of the master's TLS port) and the
    /// sentinels reach the data nodes and each other over TLS (`tls-replication yes`), so they
    /// name the nodes by their TLS ports ([`RedisSentinelSet::master_port`] is a TLS port). The
    /// plain ports stay open for the harness. Connect with
    /// [`RedisSentinelSet::sentinel_tls_urls`] and `certs`' CA.
    pub fn start_tls(certs: &TestCerts, replicas: usize, sentinels: usize) -> RedisSentinelSet {
        Self::start_with(replicas, sentinels, Some(certs))
    }

    fn start_with(replicas: usize, sentinels: usize, tls: Option<&TestCerts>) -> RedisSentinelSet {
        assert!(sentinels >= 1, "RedisSentinelSet::start: at least one sentinel");
        let tls_args = |certs: &TestCerts| {
            let mut args = tls_server_args(certs, false);
            args.extend([
                "--tls-replication".to_string(),
                "yes".into(),
                "--tls-client-cert-file".into(),
                certs.client_cert().display().to_string(),
                "--tls-client-key-file".into(),
                certs.client_key().display().to_string(),
            ]);
            args
        };
        let start = |prefix: &str, args: Vec<String>, conf: Option<(&'static str, String)>| {
            let spec = LaunchSpec { conf, tls: tls.is_some(), certs: tls.cloned(), ..LaunchSpec::default() };
            RedisServer::start_spec(prefix, args, false, spec)
        };
        // A master starts a full sync at once (not after the default 5 s wait for more replicas).
        let data_args = || {
            let mut args =
                ["--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0"].map(String::from).to_vec();
            if let Some(certs) = tls {
                args.extend(tls_args(certs));
            }
            args
        };
        let master = start("baton-redis-sentinel-data", data_args(), None);
        // The port replicas and sentinels reach the master on.
        let master_port = master.tls_port().unwrap_or(master.port());
        let mut nodes = vec![master];
        for _ in 0..replicas {
            let mut args = data_args();
            args.extend(["--replicaof".to_string(), "127.0.0.1".into(), master_port.to_string()]);
            nodes.push(start("baton-redis-sentinel-data", args, None));
        }
        let mut set = RedisSentinelSet { nodes, sentinels: Vec::new() };
        set.wait_replicas_in_sync(replicas);

        let quorum = sentinels / 2 + 1;
        let conf = format!(
            "sentinel resolve-hostnames no\n\
             sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} {quorum}\n\
             sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
             sentinel failover-timeout {MASTER_NAME} 5000\n"
        );
        for _ in 0..sentinels {
            let mut args = vec!["--sentinel".to_string()];
            if let Some(certs) = tls {
                args.extend(tls_args(certs));
            }
            set.sentinels.push(start("baton-redis-sentinel", args, Some(("sentinel.conf", conf.clone()))));
        }
        set.wait_sentinels_ready(replicas, sentinels - 1);
        set
    }

    fn wait_replicas_in_sync(&self, replicas: usize) {
        let deadline = Instant::now() + FORM_TIMEOUT;
        loop {
            let mut last = String::new();
            let mut in_sync = 0;
            for node in &self.nodes[1..] {
                match raw_command(node.port(), &["INFO", "replication"]) {
                    Ok(Ok(info)) if info.lines().any(|l| l.trim() == "master_link_status:up") => in_sync += 1,
                    other => last = format!("replica 127.0.0.1:{}: {other:?}", node.port()),
                }
            }
            if in_sync == replicas {
                // And the master counts them online (what WAIT counts).
                crate::wait_replicas_online(self.nodes[0].port(), replicas, FORM_TIMEOUT);
                return;
            }
            if Instant::now() >= deadline {
                panic!("{in_sync} of {replicas} replicas in sync after {FORM_TIMEOUT:?}; last: {last}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_sentinels_ready(&self, replicas: usize, others: usize) {
        let deadline = Instant::now() + FORM_TIMEOUT;
        loop {
            let mut last = String::new();
            let ready = self.sentinels.iter().all(|s| match sentinel_state(s.port(), replicas, others) {
                Ok(()) => true,
                Err(e) => {
                    last = format!("sentinel 127.0.0.1:{}: {e}", s.port());
                    false
                }
            });
            if ready {
                return;
            }
            if Instant::now() >= deadline {
                panic!("sentinels not ready after {FORM_TIMEOUT:?}; last: {last}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The name the master is monitored under (`baton-master`).
    pub fn master_name(&self) -> &str {
        MASTER_NAME
    }

    /// `redis://127.0.0.1:PORT` of every sentinel.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// `rediss://127.0.0.1:TLS_PORT` of every sentinel. Panics unless started with
    /// [`RedisSentinelSet::start_tls`].
    pub fn sentinel_tls_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::tls_url).collect()
    }

    /// The current master's port, as the first running sentinel that answers says
    /// (`SENTINEL GET-MASTER-ADDR-BY-NAME`): with [`RedisSentinelSet::start_tls`], its TLS port.
    /// Panics when none answers.
    pub fn master_port(&self) -> u16 {
        let mut last = String::from("no sentinel is running");
        for s in self.sentinels.iter().filter(|s| s.is_running()) {
            match master_addr(s.port()) {
                Ok(port) => return port,
                Err(e) => last = e,
            }
        }
        panic!("master_port: no sentinel answered: {last}");
    }

    /// The data servers: `[0]` is the master the set started with, then the replicas. A test may
    /// kill, pause or restart any (find the current master with [`RedisSentinelSet::master_port`]).
    pub fn nodes(&mut self) -> &mut [RedisServer] {
        &mut self.nodes
    }

    /// The data server on `port` (its plain or TLS port), if it is one of this set's. Panics
    /// otherwise.
    pub fn node_by_port(&mut self, port: u16) -> &mut RedisServer {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port || n.tls_port() == Some(port))
            .unwrap_or_else(|| panic!("node_by_port: no data node on port {port}"))
    }

    /// The sentinel processes, e.g. to kill one.
    pub fn sentinels(&mut self) -> &mut [RedisServer] {
        &mut self.sentinels
    }

    /// Waits until every running sentinel names a master other than `old_port` (all the same
    /// one) and that server says `role:master` in `INFO replication`; returns its port. Panics
    /// after `timeout` with the last state seen.
    pub fn wait_for_failover(&self, old_port: u16, timeout: Duration) -> u16 {
        let deadline = Instant::now() + timeout;
        loop {
            let answers: Vec<Result<u16, String>> =
                self.sentinels.iter().filter(|s| s.is_running()).map(|s| master_addr(s.port())).collect();
            let last = match answers.first() {
                Some(Ok(port)) if *port != old_port && answers.iter().all(|a| a.as_ref() == Ok(port)) => {
                    // The harness talks to the node's plain port.
                    let plain = self.nodes.iter().find(|n| n.tls_port() == Some(*port)).map_or(*port, |n| n.port());
                    match raw_command(plain, &["INFO", "replication"]) {
                        Ok(Ok(info)) if info.lines().any(|l| l.trim() == "role:master") => return *port,
                        other => format!("sentinels name {port}, whose INFO replication is {other:?}"),
                    }
                }
                _ => format!("sentinels answer {answers:?}"),
            };
            if Instant::now() >= deadline {
                panic!("no failover from 127.0.0.1:{old_port} after {timeout:?}: {last}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// `SENTINEL GET-MASTER-ADDR-BY-NAME` on the sentinel at `port`: the master's port.
fn master_addr(port: u16) -> Result<u16, String> {
    match raw_command(port, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME]) {
        Ok(Ok(reply)) => {
            let mut parts = reply.lines();
            let _host = parts.next();
            parts.next().and_then(|p| p.trim().parse().ok()).ok_or_else(|| format!("bad reply {reply:?}"))
        }
        Ok(Err(e)) => Err(e),
        Err(e) => Err(e.to_string()),
    }
}

/// `Ok` when the sentinel at `port` sees the master up with `replicas` healthy replicas and
/// `others` other sentinels.
fn sentinel_state(port: u16, replicas: usize, others: usize) -> Result<(), String> {
    let field = |reply: &str, name: &str| -> Option<String> {
        let items: Vec<&str> = reply.lines().collect();
        items.chunks(2).find(|kv| kv[0] == name).and_then(|kv| kv.get(1)).map(|v| v.to_string())
    };
    let master = match raw_command(port, &["SENTINEL", "MASTER", MASTER_NAME]) {
        Ok(Ok(reply)) => reply,
        other => return Err(format!("SENTINEL MASTER: {other:?}")),
    };
    let flags = field(&master, "flags").unwrap_or_default();
    let slaves = field(&master, "num-slaves").and_then(|v| v.parse::<usize>().ok());
    let other_sentinels = field(&master, "num-other-sentinels").and_then(|v| v.parse::<usize>().ok());
    if flags != "master" || slaves != Some(replicas) || other_sentinels != Some(others) {
        return Err(format!("master flags {flags:?}, num-slaves {slaves:?}, num-other-sentinels {other_sentinels:?}"));
    }
    // SENTINEL REPLICAS: one flat key/value list per replica, joined; every replica's flags
    // must be plain `slave` (not s_down, disconnected, …).
    let reply = match raw_command(port, &["SENTINEL", "REPLICAS", MASTER_NAME]) {
        Ok(Ok(reply)) => reply,
        other => return Err(format!("SENTINEL REPLICAS: {other:?}")),
    };
    let items: Vec<&str> = reply.lines().collect();
    let replica_flags: Vec<&str> = items.windows(2).filter(|kv| kv[0] == "flags").map(|kv| kv[1]).collect();
    if replica_flags.len() != replicas || replica_flags.iter().any(|f| *f != "slave") {
        return Err(format!("replica flags {replica_flags:?}"));
    }
    Ok(())
}

impl fmt::Debug for RedisSentinelSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSentinelSet")
            .field("master_name", &MASTER_NAME)
            .field("nodes", &self.nodes)
            .field("sentinels", &self.sentinels)
            .finish()
    }
}

// Every process is a RedisServer: dropping the Vecs kills each of them and removes their
// directories. The sentinels go first, so none starts a failover while the data nodes die.
impl Drop for RedisSentinelSet {
    fn drop(&mut self) {
        for s in &mut self.sentinels {
            s.kill();
        }
        for n in &mut self.nodes {
            n.kill();
        }
    }
}
