//! Failover, measured (issue #18): the master serving Baton's keys is killed (SIGKILL) under load,
//! on a Sentinel set (1 master, 1 replica, 3 sentinels) and on a Cluster with one replica per
//! master. Baton (the same stores, clients and workers: nothing is restarted) must recover by
//! itself within [`RECOVERY_BOUND`], and afterwards:
//!
//! 1. commands: every acknowledged submit that is still there reaches a terminal state, none is
//!    stuck, none runs twice unless its completion was written in the loss window;
//! 2. streams: appends go on (offsets increase, no duplicate of an idempotent producer's write,
//!    no offset of an acknowledged append reused for other data);
//! 3. queue leases: a handler running across the failover (from before the kill until Baton serves again)
//!    keeps its lease and runs once.
//!
//! Redis replication is asynchronous: a write a master acknowledged just before it died can be
//! missing on the replica that takes over. That loss is *measured* and printed (a table per run,
//! on stderr), not asserted zero; it is asserted to come only from the last
//! [`LOSS_WINDOW`] before the kill. On localhost a replica is rarely more than a few ms behind,
//! so the plain runs lose nothing; the `*_replica_behind` runs make the loss certain (the
//! replicas are cut off, or frozen and flooded, [`FORCED_LAG`] before the kill) to check that
//! what survives still ends correctly, and the `*_wait_1` run checks that with
//! `RedisConfig::with_durability(1, …)` nothing acknowledged is lost.
//!
//! `BATON_FAILOVER_RUNS=N` repeats each test N times (default 1, about 30 s for the file);
//! run with `--nocapture` to see the tables.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use baton_commands::{
    Command, CommandHandler, CommandResult, CommandService, CommandStatus, CommandStore, HandlerError, QueueSettings,
};
use baton_queue::{ConsumerOptions, Decision, Delivery, MessageStream, RedisQueueOptions};
use baton_redis::{key_slot, redis, RedisClient, RedisConfig};
use baton_streams::{
    AppendRequest, CreateOptions, Offset, ProducerStamp, ReadFrom, RunLimits, StreamError, StreamPath, StreamStore,
    StreamStoreSettings,
};
use baton_testkit::{require_redis, RedisCluster, RedisSentinelSet, TcpProxy};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::json;

/// Baton must serve again (a submit and an append started after the kill succeed) within this.
const RECOVERY_BOUND: Duration = Duration::from_secs(20);
/// Acknowledged writes may be lost only if acknowledged this long before the kill, or later.
const LOSS_WINDOW: Duration = Duration::from_secs(1);
/// Load before the kill.
const WARM_UP: Duration = Duration::from_millis(1_000);
/// Load kept up after recovery.
const AFTER_RECOVERY: Duration = Duration::from_secs(2);
/// Concurrent submitters, and streams appended to.
const SUBMITTERS: usize = 4;
const STREAMS: usize = 3;
/// The lease scenario: messages, and how long each handler runs at most: it returns once Baton
/// serves again after the kill (so its ack is written to the new master, whatever the machine's
/// load made of the time between its start and the kill), or after this.
const LEASE_MESSAGES: usize = 4;
const LEASE_HANDLER_MAX: Duration = Duration::from_secs(60);
/// The command worker's claim timeout: a completion lost in the failover is re-run after this.
const CMD_CLAIM_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the replica is cut off before the kill in the forced-lag test.
const FORCED_LAG: Duration = Duration::from_millis(300);

fn runs() -> usize {
    std::env::var("BATON_FAILOVER_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(1).max(1)
}

fn unique(tag: &str) -> String {
    format!("{tag}-{}-{:08x}", std::process::id(), rand::random::<u32>())
}

// ------------------------------------------------------------------------------------------------
// Topologies
// ------------------------------------------------------------------------------------------------

enum Topology {
    Sentinel(RedisSentinelSet),
    Cluster(RedisCluster),
}

impl Topology {
    fn name(&self) -> &'static str {
        match self {
            Topology::Sentinel(_) => "sentinel",
            Topology::Cluster(_) => "cluster",
        }
    }

    fn config(&self) -> RedisConfig {
        match self {
            Topology::Sentinel(s) => RedisConfig::sentinel(s.sentinel_urls(), s.master_name()),
            Topology::Cluster(c) => c.config(),
        }
    }

    /// The master serving `slot`: (first slot, last slot, port) of every master (`CLUSTER NODES`
    /// on a running node; Sentinel: the one master serves all).
    fn slot_owners(&mut self) -> Vec<(u16, u16, u16)> {
        match self {
            Topology::Sentinel(s) => vec![(0, 16383, s.master_port())],
            Topology::Cluster(c) => {
                let node = c.nodes().iter().find(|n| n.is_running()).expect("a running cluster node");
                let text = node.cli(&["CLUSTER", "NODES"]);
                let mut owners = Vec::new();
                for line in text.lines() {
                    let f: Vec<&str> = line.split_whitespace().collect();
                    if f.len() < 9 || !f[2].split(',').any(|x| x == "master") || f[2].contains("fail") {
                        continue;
                    }
                    let port: u16 = f[1].split(['@', ',']).next().unwrap().rsplit(':').next().unwrap().parse().unwrap();
                    for range in f[8..].iter().filter(|r| !r.starts_with('[')) {
                        let (a, b) = range.split_once('-').unwrap_or((range, range));
                        owners.push((a.parse().unwrap(), b.parse().unwrap(), port));
                    }
                }
                owners
            }
        }
    }

    /// Cluster only: the port of the (first) replica of the master on `port` (`CLUSTER NODES`).
    fn cluster_replica_of(&mut self, port: u16) -> u16 {
        let Topology::Cluster(c) = self else { panic!("cluster_replica_of: Cluster only") };
        let node = c.nodes().iter().find(|n| n.is_running()).expect("a running cluster node");
        let text = node.cli(&["CLUSTER", "NODES"]);
        let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split_whitespace().collect()).collect();
        let port_of =
            |f: &[&str]| -> u16 { f[1].split(['@', ',']).next().unwrap().rsplit(':').next().unwrap().parse().unwrap() };
        let master_id =
            rows.iter().find(|f| f.len() > 3 && port_of(f) == port).map(|f| f[0]).expect("the master's row");
        rows.iter()
            .find(|f| f.len() > 3 && f[3] == master_id && f[2].contains("slave"))
            .map(|f| port_of(f))
            .unwrap_or_else(|| panic!("no replica of 127.0.0.1:{port}: {text}"))
    }

    /// Cluster only: the node on `port`.
    fn cluster_node(&mut self, port: u16) -> &mut baton_testkit::RedisServer {
        let Topology::Cluster(c) = self else { panic!("cluster_node: Cluster only") };
        c.nodes().iter_mut().find(|n| n.port() == port).expect("a node on that port")
    }

    fn kill_master(&mut self, port: u16) {
        match self {
            Topology::Sentinel(s) => s.node_by_port(port).kill(),
            Topology::Cluster(c) => c.kill_master(port),
        }
    }

    fn wait_for_failover(&self, port: u16, timeout: Duration) -> u16 {
        match self {
            Topology::Sentinel(s) => s.wait_for_failover(port, timeout),
            Topology::Cluster(c) => c.wait_for_failover(port, timeout),
        }
    }
}

fn owner_of(owners: &[(u16, u16, u16)], slot: u16) -> u16 {
    owners.iter().find(|(a, b, _)| *a <= slot && slot <= *b).map(|o| o.2).expect("every slot is served")
}

/// A name starting with `tag` whose hash tag (the name itself) lands on the master `port`.
fn name_on(owners: &[(u16, u16, u16)], port: u16, tag: &str) -> String {
    loop {
        let name = unique(tag);
        if owner_of(owners, key_slot(name.as_bytes())) == port {
            return name;
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Load: commands
// ------------------------------------------------------------------------------------------------

/// One acknowledged write: what, when the request started, when its Ok came back.
#[derive(Clone, Debug)]
struct Ack<T> {
    what: T,
    started: Instant,
    acked: Instant,
}

#[derive(Default)]
struct Errors {
    count: AtomicU64,
    last: Mutex<Option<String>>,
}

impl Errors {
    fn note(&self, e: impl std::fmt::Display) {
        self.count.fetch_add(1, Ordering::Relaxed);
        *self.last.lock().unwrap() = Some(e.to_string());
    }
}

/// Per command id: how many times `execute` ran, and when the first run returned.
#[derive(Default)]
struct Runs {
    by_id: Mutex<HashMap<String, (u32, Option<Instant>)>>,
}

struct NoopHandler(Arc<Runs>);

#[async_trait]
impl CommandHandler for NoopHandler {
    async fn execute(&self, command: Command) -> Result<CommandResult, HandlerError> {
        self.0.by_id.lock().unwrap().entry(command.id.clone()).or_default().0 += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
        let mut runs = self.0.by_id.lock().unwrap();
        let entry = runs.entry(command.id).or_default();
        entry.1.get_or_insert_with(Instant::now);
        Ok(CommandResult::succeeded(json!({})))
    }
}

fn spawn_submitters(
    store: &CommandStore,
    queue: &str,
    stop: &Arc<AtomicBool>,
    acks: &Arc<Mutex<Vec<Ack<String>>>>,
    errors: &Arc<Errors>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..SUBMITTERS)
        .map(|_| {
            let (store, queue, stop, acks, errors) =
                (store.clone(), queue.to_string(), stop.clone(), acks.clone(), errors.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let submit = store.submit(&queue, Command::new("noop", json!({})));
                    match tokio::time::timeout(Duration::from_secs(5), submit).await {
                        Ok(Ok(st)) => acks.lock().unwrap().push(Ack { what: st.id, started, acked: Instant::now() }),
                        Ok(Err(e)) => {
                            errors.note(e);
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        Err(_) => errors.note("submit timed out after 5 s"),
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        })
        .collect()
}

// ------------------------------------------------------------------------------------------------
// Load: streams
// ------------------------------------------------------------------------------------------------

/// Acknowledged appends of every stream: (stream index, data, offset).
type AppendAcks = Arc<Mutex<Vec<Ack<(usize, Bytes, Offset)>>>>;

/// One stream's appender: an idempotent producer (explicit stamps) that retries a failed append
/// with the same stamp, and starts a new epoch when the stream reports a sequence gap (its
/// earlier acknowledged writes were lost).
fn spawn_appender(
    store: StreamStore,
    path: StreamPath,
    stop: Arc<AtomicBool>,
    index: usize,
    acks: AppendAcks,
    errors: Arc<Errors>,
    gaps: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<(u64, u64)> {
    tokio::spawn(async move {
        let (mut epoch, mut seq) = (0u64, 0u64);
        while !stop.load(Ordering::Relaxed) {
            let data = Bytes::from(format!("{epoch}.{seq};"));
            let req = AppendRequest {
                data: data.clone(),
                content_type: Some("text/plain".into()),
                producer: Some(ProducerStamp { id: "fo".into(), epoch, seq }),
                ..Default::default()
            };
            let started = Instant::now();
            match tokio::time::timeout(Duration::from_secs(5), store.append(&path, req)).await {
                Ok(Ok(a)) => {
                    let offset = a.producer_offset.unwrap_or(a.tail);
                    acks.lock().unwrap().push(Ack { what: (index, data, offset), started, acked: Instant::now() });
                    seq += 1;
                }
                Ok(Err(StreamError::SequenceGap { .. })) => {
                    gaps.fetch_add(1, Ordering::Relaxed);
                    epoch += 1;
                    seq = 0;
                }
                Ok(Err(e)) => {
                    errors.note(e);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(_) => errors.note("append timed out after 5 s"),
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        (epoch, seq)
    })
}

/// Every record of `path`, from the start, as (offset, data).
async fn read_all(store: &StreamStore, path: &StreamPath) -> Vec<(Offset, Bytes)> {
    let mut out = Vec::new();
    let mut from = ReadFrom::Start;
    loop {
        let chunk = store.read(path, from).await.unwrap();
        let n = chunk.records.len();
        out.extend(chunk.records.into_iter().map(|r| (r.offset, r.data)));
        if chunk.up_to_date || n == 0 {
            return out;
        }
        from = ReadFrom::At(chunk.next_offset);
    }
}

// ------------------------------------------------------------------------------------------------
// One run
// ------------------------------------------------------------------------------------------------

/// What one failover cost.
#[derive(Debug, Default, Clone)]
struct Measured {
    /// Kill → first Ok of a submit started after the kill.
    cmd_recovery_ms: u128,
    /// Kill → first Ok of an append started after the kill.
    stream_recovery_ms: u128,
    /// Kill → the sentinels / cluster name a new master (as the testkit sees it; for reference).
    redis_failover_ms: u128,
    submits: usize,
    submits_in_window: usize,
    submits_lost: usize,
    cmd_terminal: usize,
    cmd_stuck: usize,
    cmd_double_runs: usize,
    /// Double runs whose first run returned before the kill: a completion lost with the master.
    transitions_lost: usize,
    /// Lost submits whose `execute` ran anyway (before the kill): work done for a command that
    /// no longer exists afterwards.
    lost_but_ran: usize,
    cmd_errors: u64,
    appends: usize,
    appends_in_window: usize,
    appends_lost: usize,
    seq_gaps: u64,
    append_errors: u64,
    lease_runs: usize,
    lease_double_runs: usize,
    leases_lost: u64,
    renewal_failures: u64,
}

fn print_table(topology: &str, rows: &[Measured]) {
    eprintln!(
        "\n{topology}: failover under load ({} run(s))\n\
         run | redis ms | cmd recov ms | strm recov ms | submits (window/lost) | terminal stuck | double runs (lost transitions) | lost but ran | cmd errs | appends (window/lost) gaps | strm errs | lease runs double lost renewal-fails",
        rows.len()
    );
    for (i, m) in rows.iter().enumerate() {
        eprintln!(
            "{:>3} | {:>8} | {:>12} | {:>13} | {:>6} ({:>4}/{:>3})     | {:>8} {:>5} | {:>5} ({:>3})                    | {:>12} | {:>8} | {:>6} ({:>4}/{:>3}) {:>4} | {:>9} | {:>10} {:>6} {:>4} {:>13}",
            i + 1,
            m.redis_failover_ms,
            m.cmd_recovery_ms,
            m.stream_recovery_ms,
            m.submits,
            m.submits_in_window,
            m.submits_lost,
            m.cmd_terminal,
            m.cmd_stuck,
            m.cmd_double_runs,
            m.transitions_lost,
            m.lost_but_ran,
            m.cmd_errors,
            m.appends,
            m.appends_in_window,
            m.appends_lost,
            m.seq_gaps,
            m.append_errors,
            m.lease_runs,
            m.lease_double_runs,
            m.leases_lost,
            m.renewal_failures,
        );
    }
}

/// The first Ok (after the kill) of a request started after the kill, waited for up to
/// [`RECOVERY_BOUND`]: the time from the kill, or a panic naming the last error.
async fn recovery<T: Clone>(kill: Instant, acks: &Mutex<Vec<Ack<T>>>, errors: &Errors, what: &str) -> Duration {
    loop {
        if let Some(at) = acks.lock().unwrap().iter().filter(|a| a.started >= kill).map(|a| a.acked).min() {
            return at - kill;
        }
        if kill.elapsed() > RECOVERY_BOUND {
            panic!(
                "{what}: no success {RECOVERY_BOUND:?} after the kill ({} errors, last: {:?})",
                errors.count.load(Ordering::Relaxed),
                errors.last.lock().unwrap()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sentinel only: every replica replicates through its own [`TcpProxy`]; the proxies are cut
/// [`FORCED_LAG`] before the kill, so that the writes acknowledged meanwhile exist on the master
/// alone and are lost for sure (the failover's worst case, made deterministic).
async fn replicate_through_proxies(topo: &mut Topology) -> Vec<TcpProxy> {
    let Topology::Sentinel(s) = topo else { panic!("forced lag: Sentinel only") };
    let master = s.master_port();
    let mut proxies = Vec::new();
    for replica in s.nodes().iter().filter(|n| n.port() != master) {
        let proxy = TcpProxy::start(([127, 0, 0, 1], master).into()).await;
        replica.cli(&["REPLICAOF", "127.0.0.1", &proxy.addr().port().to_string()]);
        tokio::task::block_in_place(|| replica.wait_replica_link_up(Duration::from_secs(10)));
        proxies.push(proxy);
    }
    proxies
}

/// How a run is set up.
#[derive(Clone, Copy, Debug)]
struct Mode {
    /// Cut the replicas off [`FORCED_LAG`] before the kill (Sentinel: through proxies; Cluster:
    /// the replica frozen and its socket buffers filled).
    forced_lag: bool,
    /// Baton waits for one replica to confirm each write (`RedisConfig::with_durability(1, …)`).
    wait_one_replica: bool,
}

async fn one_run(mut topo: Topology, mode: Mode) -> Measured {
    let mut m = Measured::default();
    let mut cfg = topo.config();
    if mode.wait_one_replica {
        cfg = cfg.with_durability(1, Duration::from_millis(500));
    }
    let sentinel = matches!(topo, Topology::Sentinel(_));
    let proxies = if mode.forced_lag && sentinel { replicate_through_proxies(&mut topo).await } else { Vec::new() };

    // Everything Baton writes here lives on one master: the one serving the command queue's slot.
    let owners = topo.slot_owners();
    let cmd_queue = unique("fo-cmd");
    let victim = owner_of(&owners, key_slot(cmd_queue.as_bytes()));
    let lease_queue = name_on(&owners, victim, "fo-lease");
    let paths: Vec<StreamPath> =
        (0..STREAMS).map(|i| StreamPath::new(name_on(&owners, victim, &format!("fo/s{i}"))).unwrap()).collect();

    // --- Baton side: built once, never restarted.
    let store = CommandStore::redis(RedisClient::new(cfg.clone()).unwrap(), Default::default()).await.unwrap();
    let runs = Arc::new(Runs::default());
    let settings = QueueSettings {
        claim_timeout: CMD_CLAIM_TIMEOUT,
        check_status_interval: Duration::from_millis(200),
        ..QueueSettings::default()
    };
    let svc = CommandService::builder(store.clone(), &cmd_queue)
        .settings(settings)
        .handler("noop", NoopHandler(runs.clone()))
        .start()
        .await
        .unwrap();

    let streams_settings =
        StreamStoreSettings { default_limits: RunLimits::unlimited(), ..StreamStoreSettings::default() };
    let streams = StreamStore::redis(cfg.clone(), streams_settings).await.unwrap();
    for p in &paths {
        streams
            .create(p, CreateOptions { content_type: Some("text/plain".into()), ..Default::default() })
            .await
            .unwrap();
    }

    // Two consumers (two stores, as two processes would have) of the lease queue.
    let lease_runs: Arc<Mutex<Vec<(String, String, Instant)>>> = Arc::default();
    let (recovered_tx, recovered) = tokio::sync::watch::channel(false);
    let opts = ConsumerOptions::new()
        .with_claim_timeout(Duration::from_secs(10))
        .with_concurrency(2)
        .with_reap_idle_consumers_after(None);
    let mut consumers = Vec::new();
    let mut lease_streams = Vec::new();
    for _ in 0..2 {
        let ms =
            MessageStream::redis(RedisClient::new(cfg.clone()).unwrap(), RedisQueueOptions::default()).await.unwrap();
        let log = lease_runs.clone();
        let recovered = recovered.clone();
        let handler = move |d: Delivery| {
            let (log, mut recovered) = (log.clone(), recovered.clone());
            async move {
                log.lock().unwrap().push((d.id.to_string(), d.lease.consumer().to_string(), Instant::now()));
                let _ = tokio::time::timeout(LEASE_HANDLER_MAX, recovered.wait_for(|r| *r)).await;
                if d.lease.is_lost() {
                    Decision::Retry
                } else {
                    Decision::Ack
                }
            }
        };
        consumers.push(ms.consume(&lease_queue, handler, opts.clone()).await.unwrap());
        lease_streams.push(ms);
    }

    // --- Load.
    let stop = Arc::new(AtomicBool::new(false));
    let cmd_acks: Arc<Mutex<Vec<Ack<String>>>> = Arc::default();
    let cmd_errors = Arc::new(Errors::default());
    let submitters = spawn_submitters(&store, &cmd_queue, &stop, &cmd_acks, &cmd_errors);
    let append_acks: AppendAcks = Arc::default();
    let append_errors = Arc::new(Errors::default());
    let gaps = Arc::new(AtomicU64::new(0));
    let appenders: Vec<_> = paths
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (acks, errors) = (append_acks.clone(), append_errors.clone());
            spawn_appender(streams.clone(), p.clone(), stop.clone(), i, acks, errors, gaps.clone())
        })
        .collect();
    let mut offered = Vec::new();
    for i in 0..LEASE_MESSAGES {
        offered.push(lease_streams[0].offer(&lease_queue, format!("m{i}")).await.unwrap().to_string());
    }
    let t0 = Instant::now();
    while lease_runs.lock().unwrap().len() < LEASE_MESSAGES {
        assert!(t0.elapsed() < Duration::from_secs(10), "the lease handlers did not all start");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(WARM_UP.saturating_sub(t0.elapsed())).await;

    // --- SIGKILL the master (with forced lag: after cutting its replica off).
    for proxy in &proxies {
        proxy.set_refuse(true);
        proxy.drop_connections();
    }
    // Cluster: the victim's replica is frozen (SIGSTOP) and a 32 MiB value is written on the
    // victim, which fills the loopback socket buffers towards the replica: what the master
    // writes next stays in its output buffer and dies with it.
    let frozen = if mode.forced_lag && !sentinel {
        let replica = topo.cluster_replica_of(victim);
        topo.cluster_node(replica).pause();
        let mut conn = RedisClient::new(cfg.clone()).unwrap().shared().await.unwrap();
        let junk = name_on(&owners, victim, "fo-junk");
        let _: () = redis::cmd("SET").arg(&junk).arg(vec![b'x'; 32 << 20]).query_async(&mut conn).await.unwrap();
        Some(replica)
    } else {
        None
    };
    if mode.forced_lag {
        tokio::time::sleep(FORCED_LAG).await;
    }
    // The kill's instant is taken once the process is gone (reaped): a request started before
    // it may have been answered by the old master, none started after.
    topo.kill_master(victim);
    let kill = Instant::now();
    if let Some(replica) = frozen {
        topo.cluster_node(replica).resume();
    }
    let topo = Arc::new(topo);
    let t = topo.clone();
    let redis_failover = tokio::task::spawn_blocking(move || {
        t.wait_for_failover(victim, Duration::from_secs(30));
        kill.elapsed()
    });

    let cmd_rec = recovery(kill, &cmd_acks, &cmd_errors, "submit").await;
    let stream_rec = recovery(kill, &append_acks, &append_errors, "append").await;
    // Baton serves again: the lease handlers, started before the kill, return now.
    let _ = recovered_tx.send(true);
    m.cmd_recovery_ms = cmd_rec.as_millis();
    m.stream_recovery_ms = stream_rec.as_millis();
    tokio::time::sleep(AFTER_RECOVERY).await;
    stop.store(true, Ordering::Relaxed);
    for s in submitters {
        s.await.unwrap();
    }
    let mut producer_state = Vec::new();
    for a in appenders {
        producer_state.push(a.await.unwrap());
    }
    m.redis_failover_ms = redis_failover.await.unwrap().as_millis();
    let window_start = kill - LOSS_WINDOW;

    // --- 1. Commands: every acknowledged submit, settled.
    let acks = cmd_acks.lock().unwrap().clone();
    m.submits = acks.len();
    m.submits_in_window = acks.iter().filter(|a| a.acked >= window_start && a.started < kill).count();
    m.cmd_errors = cmd_errors.count.load(Ordering::Relaxed);
    let settle_deadline = Instant::now() + Duration::from_secs(30);
    let mut pending: Vec<Ack<String>> = acks.clone();
    let mut lost: Vec<Ack<String>> = Vec::new();
    let mut terminal = 0usize;
    loop {
        let states: Vec<(Ack<String>, Option<baton_commands::CommandState>)> = futures::stream::iter(pending)
            .map(|a| {
                let store = store.clone();
                async move {
                    let got = loop {
                        match store.get(&a.what).await {
                            Ok(s) => break s,
                            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                        }
                    };
                    (a, got)
                }
            })
            .buffer_unordered(32)
            .collect()
            .await;
        pending = Vec::new();
        for (a, st) in states {
            match st {
                None => lost.push(a),
                Some(st) if st.status.is_terminal() => {
                    assert_eq!(st.status, CommandStatus::Succeeded, "{st:?}");
                    terminal += 1;
                }
                Some(_) => pending.push(a),
            }
        }
        if pending.is_empty() || Instant::now() > settle_deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    m.submits_lost = lost.len();
    m.cmd_terminal = terminal;
    m.cmd_stuck = pending.len();
    {
        let by_id = runs.by_id.lock().unwrap();
        let doubles: Vec<(&String, &(u32, Option<Instant>))> = by_id.iter().filter(|(_, r)| r.0 > 1).collect();
        m.cmd_double_runs = doubles.len();
        m.transitions_lost = doubles.iter().filter(|(_, r)| r.1.is_some_and(|t| t < kill)).count();
        m.lost_but_ran = lost.iter().filter(|a| by_id.contains_key(&a.what)).count();
        for (id, (n, first_done)) in &doubles {
            let durable = first_done.is_some_and(|t| t < window_start);
            assert!(!durable, "command {id} ran {n} times although its first run returned before the loss window");
        }
    }
    svc.abort();

    // --- 2. Streams: read back, look for losses, duplicates and reused offsets; append again.
    for (i, p) in paths.iter().enumerate() {
        let acks: Vec<Ack<(usize, Bytes, Offset)>> =
            append_acks.lock().unwrap().iter().filter(|a| a.what.0 == i).cloned().collect();
        m.appends += acks.len();
        m.appends_in_window += acks.iter().filter(|a| a.acked >= window_start && a.started < kill).count();
        let records = read_all(&streams, p).await;
        let by_offset: BTreeMap<Offset, Bytes> = records.iter().cloned().collect();
        let mut seen = HashSet::new();
        for (_, data) in &records {
            assert!(seen.insert(data.clone()), "stream {p:?}: {data:?} stored twice");
        }
        for a in &acks {
            let (_, data, offset) = &a.what;
            if seen.contains(data) {
                assert_eq!(by_offset.get(offset), Some(data), "stream {p:?}: {data:?} acknowledged at {offset}");
                continue;
            }
            m.appends_lost += 1;
            assert!(
                a.acked >= window_start && a.started < kill,
                "stream {p:?}: {data:?} lost although acknowledged outside the loss window"
            );
            assert!(
                !by_offset.contains_key(offset),
                "stream {p:?}: the offset {offset} of lost {data:?} now holds {:?}",
                by_offset.get(offset)
            );
        }
        // The stream goes on after the failover: a next write lands after everything stored.
        let (epoch, seq) = producer_state[i];
        let req = AppendRequest {
            data: Bytes::from("after;"),
            content_type: Some("text/plain".into()),
            producer: Some(ProducerStamp { id: "fo".into(), epoch, seq }),
            ..Default::default()
        };
        // With WAIT, the new master's replica may still be syncing (more so on a loaded machine):
        // a write it does not confirm in time was applied on the master all the same, so the
        // retry with the same stamp that then succeeds answers it as a duplicate.
        let retry_until = Instant::now() + Duration::from_secs(10);
        let mut unconfirmed = 0;
        let a = loop {
            match streams.append(p, req.clone()).await {
                Ok(a) => break a,
                Err(e) if e.to_string().contains("not confirmed") && Instant::now() < retry_until => {
                    unconfirmed += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("stream {p:?}: the append after the failover failed: {e}"),
            }
        };
        assert!(!a.duplicate || unconfirmed > 0, "a first append after the failover answered as a duplicate");
        let last = records.last().map(|r| r.0).unwrap_or_default();
        assert!(a.tail > last, "stream {p:?}: next append at {} not after {last}", a.tail);
        let again = streams.append(p, req).await.unwrap();
        assert!(again.duplicate, "the same producer stamp again writes nothing");
        let tail: Vec<Bytes> = read_all(&streams, p).await.into_iter().skip(records.len()).map(|r| r.1).collect();
        assert_eq!(tail, vec![Bytes::from("after;")]);
    }
    m.seq_gaps = gaps.load(Ordering::Relaxed);
    m.append_errors = append_errors.count.load(Ordering::Relaxed);

    // --- 3. Leases: every offered message handled once, acknowledged, gone from the queue.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let acked: u64 = consumers.iter().map(|c| c.counters().acked).sum();
        if acked >= LEASE_MESSAGES as u64 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Room for a wrongful redelivery to show (a lease lost in the failover would be taken over
    // after the 10 s claim timeout, counted from the handler's start at the latest).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let log = lease_runs.lock().unwrap().clone();
    let mut per_id: HashMap<&str, usize> = HashMap::new();
    for (id, _, _) in &log {
        *per_id.entry(id.as_str()).or_default() += 1;
    }
    m.lease_runs = log.len();
    m.lease_double_runs = per_id.values().filter(|n| **n > 1).count();
    for c in &consumers {
        let k = c.counters();
        m.leases_lost += k.leases_lost + k.leases_expired;
        m.renewal_failures += k.renewal_failures;
    }
    let mut conn = RedisClient::new(cfg.clone()).unwrap().shared().await.unwrap();
    let key = baton_queue::keys::stream(baton_queue::keys::DEFAULT_PREFIX, &lease_queue);
    let xlen: u64 = redis::cmd("XLEN").arg(&key).query_async(&mut conn).await.unwrap();
    let acked: u64 = consumers.iter().map(|c| c.counters().acked).sum();
    for c in consumers {
        c.close().await;
    }

    // --- Assertions (the numbers are in the table).
    eprintln!(
        "{}: killed 127.0.0.1:{victim}; last submit error: {:?}; last append error: {:?}; leases lost {}, renewal failures {}, kill at {kill:?}",
        topo.name(),
        cmd_errors.last.lock().unwrap(),
        append_errors.last.lock().unwrap(),
        m.leases_lost,
        m.renewal_failures,
    );
    assert!(cmd_rec <= RECOVERY_BOUND && stream_rec <= RECOVERY_BOUND);
    for a in &lost {
        assert!(
            a.acked >= window_start && a.started < kill,
            "submit {} lost although acknowledged outside the loss window",
            a.what
        );
    }
    if mode.wait_one_replica {
        let lost = (m.submits_lost, m.transitions_lost, m.appends_lost);
        assert_eq!(lost, (0, 0, 0), "WAIT 1: an acknowledged write was lost (submits, transitions, appends)");
    }
    assert!(m.submits_lost <= m.submits_in_window);
    assert!(m.appends_lost <= m.appends_in_window);
    assert_eq!(m.cmd_stuck, 0, "acknowledged commands still not terminal 30 s after the load: {pending:?}");
    assert_eq!(terminal + lost.len(), acks.len());
    assert_eq!(per_id.len(), LEASE_MESSAGES, "every offered message ran: {log:?} (offered {offered:?})");
    assert_eq!(m.lease_double_runs, 0, "a lease was lost in the failover: {log:?}");
    assert_eq!(m.leases_lost, 0);
    assert_eq!((acked, xlen), (LEASE_MESSAGES as u64, 0), "every message acknowledged and deleted");
    m
}

async fn measure(name: &str, mode: Mode, start: impl Fn() -> Topology) {
    require_redis();
    let mut rows = Vec::new();
    for _ in 0..runs() {
        let topo = start();
        assert!(name.starts_with(topo.name()));
        rows.push(one_run(topo, mode).await);
        print_table(name, &rows);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sentinel_master_killed_under_load() {
    measure("sentinel", Mode { forced_lag: false, wait_one_replica: false }, || {
        Topology::Sentinel(RedisSentinelSet::start(1, 3))
    })
    .await;
}

/// The replica is cut off [`FORCED_LAG`] before the master dies: the loss is certain, and what
/// was not lost must still end correctly (lost completions re-run, producers resume).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sentinel_master_killed_with_replica_behind() {
    let mode = Mode { forced_lag: true, wait_one_replica: false };
    measure("sentinel (replica 300 ms behind)", mode, || Topology::Sentinel(RedisSentinelSet::start(1, 3))).await;
}

/// As above with Baton waiting for one replica per write (`WAIT 1`, 500 ms): nothing written
/// while the replicas are cut off is acknowledged, so nothing acknowledged is lost. Two replicas,
/// so that the promoted one still has a replica to confirm writes after the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sentinel_master_killed_with_replicas_behind_and_wait_1() {
    let mode = Mode { forced_lag: true, wait_one_replica: true };
    let name = "sentinel (2 replicas 300 ms behind, WAIT 1)";
    measure(name, mode, || Topology::Sentinel(RedisSentinelSet::start(2, 3))).await;
}

/// The victim's replica is frozen and flooded [`FORCED_LAG`] before the kill (see `one_run`):
/// the loss is certain; what was not lost must still end correctly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_master_killed_with_replica_behind() {
    let mode = Mode { forced_lag: true, wait_one_replica: false };
    measure("cluster (replica 300 ms behind)", mode, || Topology::Cluster(RedisCluster::start_with_replicas(1))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_master_killed_under_load() {
    measure("cluster", Mode { forced_lag: false, wait_one_replica: false }, || {
        Topology::Cluster(RedisCluster::start_with_replicas(1))
    })
    .await;
}
