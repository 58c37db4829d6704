//! Test support for Baton (internal, not published).
//!
//! * [`RedisServer`]: a throwaway `redis-server` on 127.0.0.1, on a free port, in a fresh temporary
//!   directory; it can be killed, restarted on the same port and data directory, paused and resumed.
//! * [`RedisCluster`]: a throwaway 3-master Redis Cluster (no replicas); the next one is formed in
//!   the background while one is used (forming one waits about 2 s).
//!   [`RedisCluster::start_with_replicas`] forms one with replicas, for failover tests;
//!   [`RedisCluster::start_tls`] one whose nodes serve TLS too.
//! * [`RedisServer::start_tls`] (with [`TestCerts`]: a CA, server and client certificates made
//!   with `openssl`), [`RedisServer::start_with_requirepass`] and [`RedisServer::add_acl_user`]:
//!   servers for TLS and authentication tests.
//! * [`RedisSentinelSet`]: a master, its replicas and sentinels, for Sentinel failover tests.
//! * [`TestBackend`]: the backend a shared conformance suite runs against.
//! * [`TcpProxy`]: a local TCP proxy that can cut every live connection, to test dropped
//!   connections for real.
//! * [`KillStorm`]: `CLIENT KILL TYPE normal` on every node of a server or cluster every few
//!   milliseconds until stopped, to break client connections again and again.
//! * [`exact_json`]: JSON texts a lossy round trip would change (params and results that must
//!   come back byte for byte).
//!
//! Every process started here dies with its handle (`Drop`, also when a test panics). As a second
//! line of defence on Linux, each `redis-server` is started with `PR_SET_PDEATHSIG = SIGKILL` from
//! a thread that lives as long as the test process, so the servers die with the process even when
//! it is killed or aborts (handles kept in statics are never dropped).
//!
//! ```
//! use baton_testkit::RedisServer;
//!
//! let mut server = RedisServer::start();
//! assert_eq!(server.cli(&["SET", "k", "v"]).trim(), "OK");
//! server.kill();
//! server.restart();
//! assert_eq!(server.cli(&["PING"]).trim(), "PONG");
//! ```

use std::ffi::OsStr;
use std::fmt;
use std::fs::{self, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use baton_redis::RedisConfig;

pub mod exact_json;
mod kill_storm;
mod proxy;
mod sentinel;
mod suite;
mod tls;

pub use kill_storm::KillStorm;
pub use proxy::TcpProxy;
pub use sentinel::RedisSentinelSet;
pub use suite::eventually;
pub use tls::TestCerts;

const INSTALL_HINT: &str =
    "install the Debian packages `redis-server` and `redis-tools` (apt-get update && apt-get install -y redis-server redis-tools)";

/// Time allowed for a started `redis-server` to answer PING.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Time allowed for `redis-cli --cluster create` (it takes 1–2 s; it waits for the nodes to agree
/// without a limit of its own).
const CLUSTER_CREATE_TIMEOUT: Duration = Duration::from_secs(20);

/// Time allowed for a new cluster to report `cluster_state:ok` on every node.
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(30);
/// Attempts at starting a server on a fresh port when the chosen one turns out to be taken.
const PORT_ATTEMPTS: usize = 20;
/// Ports for servers are drawn from here: below the kernel's ephemeral range (32768–60999 by
/// default), so an outgoing connection never takes the port of a killed server before its restart,
/// and so `port + 10000` (the cluster bus port) is a valid port that is not ephemeral either.
const PORT_RANGE: std::ops::Range<u16> = 12000..22000;

// ------------------------------------------------------------------------------------------------
// Tools on PATH
// ------------------------------------------------------------------------------------------------

fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| {
        use std::os::unix::fs::PermissionsExt;
        fs::metadata(candidate).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
    })
}

/// Panics with a clear message when `redis-server` or `redis-cli` is missing from PATH.
pub fn require_redis() {
    for tool in ["redis-server", "redis-cli"] {
        if find_on_path(tool).is_none() {
            panic!("{tool} not found on PATH: {INSTALL_HINT}");
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Ports and directories
// ------------------------------------------------------------------------------------------------

/// A free TCP port on 127.0.0.1 (binds port 0, reads the port, releases it).
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("cannot bind a TCP socket on 127.0.0.1")
}

/// A cheap pseudo-random number (no dependency): time, pid and a counter through splitmix64.
fn pseudo_random() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let mut z =
        nanos ^ (u64::from(std::process::id()) << 32) ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn port_is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
}

/// A port in [`PORT_RANGE`] that is free now, and whose cluster bus port (`port + 10000`) is free
/// too when `with_bus`.
fn pick_server_port(with_bus: bool) -> u16 {
    let span = u64::from(PORT_RANGE.end - PORT_RANGE.start);
    for _ in 0..1000 {
        let port = PORT_RANGE.start + (pseudo_random() % span) as u16;
        if port_is_free(port) && (!with_bus || port_is_free(port + 10000)) {
            return port;
        }
    }
    panic!("no free port found in {PORT_RANGE:?} on 127.0.0.1");
}

/// A fresh directory under the system temp dir, removed by [`TempDir::drop`].
struct TempDir(PathBuf);

impl TempDir {
    fn new(prefix: &str) -> TempDir {
        let base = std::env::temp_dir();
        // The spare cluster's thread: made and listed under the lock, none once the process exits.
        let mut spare_dirs =
            FORMS_SPARE.with(|f| f.get()).then(|| SPARE_DIRS.lock().unwrap_or_else(|e| e.into_inner()));
        if spare_dirs.as_ref().is_some_and(|d| d.1) {
            panic!("the process is exiting: no spare cluster");
        }
        for _ in 0..100 {
            let dir = base.join(format!("{prefix}-{}-{:016x}", std::process::id(), pseudo_random()));
            match fs::create_dir(&dir) {
                Ok(()) => {
                    if let Some(d) = spare_dirs.as_mut() {
                        d.0.push(dir.clone());
                    }
                    return TempDir(dir);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => panic!("cannot create a temporary directory in {}: {e}", base.display()),
            }
        }
        panic!("cannot create a unique temporary directory in {}", base.display());
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

// ------------------------------------------------------------------------------------------------
// Spawning servers that die with the test process
// ------------------------------------------------------------------------------------------------

struct SpawnRequest {
    command: Command,
    reply: mpsc::Sender<io::Result<Child>>,
}

/// Spawns `command` from a thread that lives as long as the process, with `PR_SET_PDEATHSIG =
/// SIGKILL` (Linux). The parent-death signal fires when the *thread* that forked exits, which is
/// why test threads (which end with their test) must not fork servers themselves.
fn spawn_supervised(mut command: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnRequest>> = OnceLock::new();
    let sender = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("baton-testkit-spawner".into())
            .spawn(move || {
                for SpawnRequest { mut command, reply } in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("cannot start the baton-testkit spawner thread");
        tx
    });

    #[cfg(target_os = "linux")]
    {
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: only async-signal-safe calls (prctl, getppid, _exit) between fork and exec.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) == -1 {
                    return Err(io::Error::last_os_error());
                }
                // The parent died before prctl took effect: do not outlive it.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }

    let (reply_tx, reply_rx) = mpsc::channel();
    sender.send(SpawnRequest { command, reply: reply_tx }).expect("baton-testkit spawner thread is gone");
    reply_rx.recv().expect("baton-testkit spawner thread is gone")
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: plain kill(2) on a child we own (not yet reaped, so the pid is not reused).
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Sends SIGTERM to process `pid`, e.g. a worker process a test started and has not reaped yet
/// (so the pid cannot have been reused). SIGKILL is `std::process::Child::kill`.
pub fn sigterm(pid: u32) {
    signal(pid, libc::SIGTERM);
}

// ------------------------------------------------------------------------------------------------
// A minimal RESP client (readiness checks without a runtime)
// ------------------------------------------------------------------------------------------------

fn read_reply(r: &mut impl BufRead) -> io::Result<Result<String, String>> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed"));
    }
    let line = line.trim_end_matches(['\r', '\n']);
    let bad = || io::Error::new(io::ErrorKind::InvalidData, format!("bad RESP line {line:?}"));
    let (kind, rest) = line.split_at(line.len().min(1));
    match kind {
        "+" | ":" => Ok(Ok(rest.to_string())),
        "-" => Ok(Err(rest.to_string())),
        "$" => {
            let len: i64 = rest.parse().map_err(|_| bad())?;
            if len < 0 {
                return Ok(Ok(String::new()));
            }
            let mut buf = vec![0; len as usize + 2];
            r.read_exact(&mut buf)?;
            buf.truncate(len as usize);
            Ok(Ok(String::from_utf8_lossy(&buf).into_owned()))
        }
        "*" => {
            let n: i64 = rest.parse().map_err(|_| bad())?;
            let mut parts = Vec::new();
            for _ in 0..n.max(0) {
                match read_reply(r)? {
                    Ok(s) => parts.push(s),
                    Err(e) => return Ok(Err(e)),
                }
            }
            Ok(Ok(parts.join("\n")))
        }
        _ => Err(bad()),
    }
}

/// Sends one command to 127.0.0.1:`port` and returns its reply (`Err(message)` for an error reply).
/// Writes a key on the master on `port` and sends `WAIT replicas wait_ms` on the same
/// connection: the number of replicas that confirmed the write.
fn write_and_wait(port: u16, replicas: usize, wait_ms: u64) -> io::Result<Result<usize, String>> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let stream = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
    stream.set_read_timeout(Some(Duration::from_secs(2) + Duration::from_millis(wait_ms)))?;
    let (n, ms) = (replicas.to_string(), wait_ms.to_string());
    let req = format!(
        "*3\r\n$3\r\nSET\r\n$22\r\nbaton-testkit:replicas\r\n$1\r\n1\r\n*3\r\n$4\r\nWAIT\r\n${}\r\n{n}\r\n${}\r\n{ms}\r\n",
        n.len(),
        ms.len()
    );
    (&stream).write_all(req.as_bytes())?;
    let mut reader = BufReader::new(&stream);
    if let Err(e) = read_reply(&mut reader)? {
        return Ok(Err(e));
    }
    Ok(read_reply(&mut reader)?.map(|n| n.parse().unwrap_or(0)))
}

/// Waits until the master on 127.0.0.1:`port` has at least `replicas` replicas that confirm a
/// write with `WAIT` (see [`RedisServer::replicate_from`]); panics with the last answer after
/// `timeout`. It writes the key `baton-testkit:replicas`.
pub fn wait_replicas_online(port: u16, replicas: usize, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let last = write_and_wait(port, replicas, 200);
        if matches!(&last, Ok(Ok(n)) if *n >= replicas) {
            return;
        }
        if Instant::now() >= deadline {
            panic!(
                "master 127.0.0.1:{port}: fewer than {replicas} replicas confirm writes after {timeout:?}: {last:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn raw_command(port: u16, args: &[&str]) -> io::Result<Result<String, String>> {
    raw_command_as(port, None, args)
}

/// [`raw_command`], first authenticating as the default user with `password` when given (an
/// `AUTH` error reply is returned as the reply).
fn raw_command_as(port: u16, password: Option<&str>, args: &[&str]) -> io::Result<Result<String, String>> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let stream = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    let encode = |args: &[&str]| {
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        req
    };
    let mut reader = BufReader::new(&stream);
    if let Some(password) = password {
        (&stream).write_all(encode(&["AUTH", password]).as_bytes())?;
        if let Err(e) = read_reply(&mut reader)? {
            return Ok(Err(e));
        }
    }
    (&stream).write_all(encode(args).as_bytes())?;
    read_reply(&mut reader)
}

// ------------------------------------------------------------------------------------------------
// RedisServer
// ------------------------------------------------------------------------------------------------

/// Options of a standalone [`RedisServer`].
#[derive(Default, Clone, Debug)]
pub struct ServerOptions {
    /// Append-only file on, with `appendfsync always`: every acknowledged write survives a kill.
    pub appendonly: bool,
}

/// A `redis-server` process on 127.0.0.1, on its own port and temporary directory. Killed (SIGKILL)
/// and its directory removed on drop.
pub struct RedisServer {
    port: u16,
    /// Arguments after `--port N` (everything but the port and the TLS port).
    args: Vec<String>,
    /// A config file passed first (`redis-server FILE --port N …`), e.g. a sentinel's.
    conf: Option<PathBuf>,
    /// `--tls-port N`, when the server also serves TLS.
    tls_port: Option<u16>,
    /// The default user's password (`--requirepass`): the harness's own commands AUTH with it.
    password: Option<String>,
    /// The certificates a TLS server uses, kept so that a restart still finds them.
    _certs: Option<TestCerts>,
    child: Option<Child>,
    log: PathBuf,
    dir: TempDir,
}

/// What a server is started with beyond its arguments (see [`RedisServer::start_spec`]).
#[derive(Default)]
struct LaunchSpec {
    /// Serve TLS too, on a port picked beside the plain one.
    tls: bool,
    /// `--requirepass`; the harness AUTHs with it.
    password: Option<String>,
    /// A config file to write into the server's directory (as `NAME`, `CONTENTS`) and pass first.
    conf: Option<(&'static str, String)>,
    certs: Option<TestCerts>,
}

enum StartError {
    /// The port (or the cluster bus port) was taken.
    PortInUse(String),
    /// Anything else: the message says what, with the log tail.
    Other(String),
}

impl RedisServer {
    /// A standalone server with no persistence (`--save "" --appendonly no`).
    pub fn start() -> RedisServer {
        Self::start_with(ServerOptions::default())
    }

    /// A standalone server; with `opts.appendonly`, `--appendonly yes --appendfsync always`.
    pub fn start_with(opts: ServerOptions) -> RedisServer {
        let mut args: Vec<String> = vec!["--save".into(), String::new()];
        if opts.appendonly {
            args.extend(["--appendonly", "yes", "--appendfsync", "always"].map(String::from));
        } else {
            args.extend(["--appendonly", "no"].map(String::from));
        }
        Self::start_args("baton-redis", args, false)
    }

    /// A standalone server (as [`RedisServer::start_with`]) whose default user needs `password`
    /// (`--requirepass`). The harness's own commands ([`RedisServer::cli`], readiness checks,
    /// [`RedisServer::add_acl_user`]) authenticate with it.
    pub fn start_with_requirepass(opts: ServerOptions, password: &str) -> RedisServer {
        let mut args: Vec<String> = vec!["--save".into(), String::new()];
        if opts.appendonly {
            args.extend(["--appendonly", "yes", "--appendfsync", "always"].map(String::from));
        } else {
            args.extend(["--appendonly", "no"].map(String::from));
        }
        args.extend(["--requirepass".to_string(), password.to_string()]);
        let spec = LaunchSpec { password: Some(password.to_string()), ..LaunchSpec::default() };
        Self::start_spec("baton-redis", args, false, spec)
    }

    /// A standalone server (no persistence) that serves TLS on [`RedisServer::tls_port`] with
    /// `certs`' server certificate and key, trusting `certs`' CA for client certificates
    /// (`--tls-auth-clients yes` when `require_client_cert`, else `no`). The plain port
    /// ([`RedisServer::port`], 127.0.0.1) stays open for the harness's own commands (readiness,
    /// [`RedisServer::cli`]); a test connects to the TLS port. [`RedisServer::restart`] keeps both
    /// ports and the TLS settings.
    pub fn start_tls(certs: &TestCerts, require_client_cert: bool) -> RedisServer {
        let mut args = vec!["--save".to_string(), String::new(), "--appendonly".into(), "no".into()];
        args.extend(tls_server_args(certs, require_client_cert));
        let spec = LaunchSpec { tls: true, certs: Some(certs.clone()), ..LaunchSpec::default() };
        Self::start_spec("baton-redis-tls", args, false, spec)
    }

    /// Creates (or resets) ACL user `user` with `password`, all keys, all channels and all
    /// commands: `ACL SETUSER user on >password ~* &* +@all`. Panics on failure.
    pub fn add_acl_user(&self, user: &str, password: &str) {
        let pass = format!(">{password}");
        match raw_command_as(
            self.port,
            self.password.as_deref(),
            &["ACL", "SETUSER", user, "on", &pass, "~*", "&*", "+@all"],
        ) {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => panic!("ACL SETUSER {user} on 127.0.0.1:{} failed: {e}", self.port),
            Err(e) => panic!("ACL SETUSER {user} on 127.0.0.1:{} failed: {e}", self.port),
        }
    }

    /// The TLS port on 127.0.0.1; `None` unless started with [`RedisServer::start_tls`].
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// `rediss://127.0.0.1:TLS_PORT` (the server certificate has IP SAN 127.0.0.1). Panics unless
    /// started with [`RedisServer::start_tls`].
    pub fn tls_url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.tls_port.expect("tls_url: not a TLS server (start_tls)"))
    }

    /// `rediss://localhost:TLS_PORT` (the server certificate has DNS SAN localhost). Panics unless
    /// started with [`RedisServer::start_tls`].
    pub fn tls_url_localhost(&self) -> String {
        format!("rediss://localhost:{}", self.tls_port.expect("tls_url_localhost: not a TLS server (start_tls)"))
    }

    /// The default user's password, when started with [`RedisServer::start_with_requirepass`].
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// Starts a server with `extra` arguments on a fresh port, retrying on another port when the
    /// chosen one is taken meanwhile.
    fn start_args(prefix: &str, extra: Vec<String>, cluster_bus: bool) -> RedisServer {
        Self::start_spec(prefix, extra, cluster_bus, LaunchSpec::default())
    }

    /// [`RedisServer::start_args`] with a TLS port, a password or a config file as `spec` says.
    fn start_spec(prefix: &str, extra: Vec<String>, cluster_bus: bool, spec: LaunchSpec) -> RedisServer {
        require_redis();
        let dir = TempDir::new(prefix);
        let log = dir.path().join("redis.log");
        let conf = spec.conf.map(|(name, contents)| {
            let path = dir.path().join(name);
            fs::write(&path, contents).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
            path
        });
        let mut args = vec![
            "--bind".to_string(),
            "127.0.0.1".into(),
            "--daemonize".into(),
            "no".into(),
            "--dir".into(),
            dir.path().display().to_string(),
            "--logfile".into(),
            String::new(),
            // DEBUG SLEEP, DEBUG SET-ACTIVE-EXPIRE etc. from local connections, for failure tests.
            "--enable-debug-command".into(),
            "local".into(),
        ];
        args.extend(extra);
        let mut server = RedisServer {
            port: 0,
            args,
            conf,
            tls_port: None,
            password: spec.password,
            _certs: spec.certs,
            child: None,
            log,
            dir,
        };
        let mut last = String::new();
        for _ in 0..PORT_ATTEMPTS {
            server.port = pick_server_port(cluster_bus);
            if spec.tls {
                // A cluster node with `tls-cluster yes` runs its bus on TLS_PORT + 10000: leave
                // room for that too.
                server.tls_port = Some(loop {
                    let p = pick_server_port(cluster_bus);
                    let apart = |a: u16, b: u16| a != b && (!cluster_bus || (a != b + 10000 && b != a + 10000));
                    if apart(p, server.port) {
                        break p;
                    }
                });
            }
            match server.launch() {
                Ok(()) => return server,
                Err(StartError::PortInUse(msg)) => last = msg,
                Err(StartError::Other(msg)) => panic!("{msg}"),
            }
        }
        panic!("redis-server could not get a free port after {PORT_ATTEMPTS} attempts; last failure: {last}");
    }

    /// Spawns the process on `self.port` and waits until it answers PING (and is the process
    /// answering: another server could hold the port).
    fn launch(&mut self) -> Result<(), StartError> {
        let log_out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| StartError::Other(format!("cannot open {}: {e}", self.log.display())))?;
        let log_err =
            log_out.try_clone().map_err(|e| StartError::Other(format!("cannot open {}: {e}", self.log.display())))?;
        let log_start = log_out.metadata().map(|m| m.len()).unwrap_or(0);

        let mut command = Command::new("redis-server");
        if let Some(conf) = &self.conf {
            command.arg(conf);
        }
        command.arg("--port").arg(self.port.to_string());
        if let Some(tls_port) = self.tls_port {
            command.arg("--tls-port").arg(tls_port.to_string());
        }
        command
            .args(self.args.iter().map(OsStr::new))
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log_out)
            .stderr(log_err);
        let mut child = spawn_supervised(command).map_err(|e| {
            StartError::Other(format!("cannot start redis-server (is it installed? {INSTALL_HINT}): {e}"))
        })?;
        let pid = child.id();

        let deadline = Instant::now() + READY_TIMEOUT;
        let mut last: String;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let tail = self.log_since(log_start);
                let msg = format!(
                    "redis-server on port {} exited during startup ({status}); log {}:\n{tail}",
                    self.port,
                    self.log.display()
                );
                return Err(if tail.contains("in use") { StartError::PortInUse(msg) } else { StartError::Other(msg) });
            }
            // INFO is answered while the AOF or RDB file is still being loaded (data commands get
            // LOADING then): ready means our process answers and `loading:0`.
            match raw_command_as(self.port, self.password.as_deref(), &["INFO", "server", "persistence"]) {
                Ok(Ok(info)) => {
                    let answering = info
                        .lines()
                        .find_map(|l| l.strip_prefix("process_id:"))
                        .and_then(|p| p.trim().parse::<u32>().ok());
                    let loading = info.lines().any(|l| l.trim() == "loading:1");
                    if answering == Some(pid) && !loading {
                        self.child = Some(child);
                        return Ok(());
                    }
                    if answering == Some(pid) {
                        last = "loading its data".to_string();
                    } else {
                        // Another server holds the port; ours will exit shortly with "Address in use".
                        last = format!("port {} answered by another redis-server (pid {answering:?})", self.port);
                    }
                }
                // LOADING (AOF being replayed) and the like: not ready yet.
                Ok(Err(e)) => last = e,
                Err(e) => last = e.to_string(),
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(StartError::Other(format!(
                    "redis-server on port {} not ready after {READY_TIMEOUT:?} (last: {last}); log {}:\n{}",
                    self.port,
                    self.log.display(),
                    self.log_since(log_start)
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The last lines of the log written since byte `start`.
    fn log_since(&self, start: u64) -> String {
        let text = fs::read(&self.log).unwrap_or_default();
        let text = String::from_utf8_lossy(text.get(start as usize..).unwrap_or(&[]));
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// The TCP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `RedisConfig::standalone(self.url())`.
    pub fn config(&self) -> RedisConfig {
        RedisConfig::standalone(self.url())
    }

    /// The server's data directory (`--dir`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Kills the server (SIGKILL) and waits for it to exit. No-op when it is not running.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and data directory (AOF data and cluster node
    /// config survive) and waits until it is ready. Kills it first if it is still running.
    pub fn restart(&mut self) {
        self.kill();
        // The port may be taken by another test in the meantime; give it a few tries.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.launch() {
                Ok(()) => return,
                Err(StartError::PortInUse(msg)) if Instant::now() < deadline => {
                    tracing::warn!(port = self.port, "redis-server restart: port in use, retrying: {msg}");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(StartError::PortInUse(msg) | StartError::Other(msg)) => {
                    panic!("restart failed: {msg}")
                }
            }
        }
    }

    /// Whether the process was started and not killed since (it may still have died by itself).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered.
    pub fn pause(&self) {
        if let Some(child) = &self.child {
            signal(child.id(), libc::SIGSTOP);
        }
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        if let Some(child) = &self.child {
            signal(child.id(), libc::SIGCONT);
        }
    }

    /// Makes this server a replica of `master` (`REPLICAOF`) and waits (up to 20 s) until the
    /// replica reports `master_link_status:up` **and** confirms a write to `WAIT`
    /// ([`wait_replicas_online`]): after a diskless sync the master streams commands to a replica
    /// only from its first `REPLCONF ACK`, up to a second after the link is up (while `INFO`
    /// already says `state=online`). Makes the master's diskless sync start at once
    /// (`repl-diskless-sync-delay 0`).
    pub fn replicate_from(&self, master: &RedisServer) {
        master.cli(&["CONFIG", "SET", "repl-diskless-sync-delay", "0"]);
        self.cli(&["REPLICAOF", "127.0.0.1", &master.port().to_string()]);
        self.wait_replica_link_up(Duration::from_secs(20));
        wait_replicas_online(master.port, 1, Duration::from_secs(20));
    }

    /// Polls `INFO replication` every 20 ms until this server is a replica reporting
    /// `master_link_status:up`; panics with the last reply after `timeout`. A refused or reset
    /// connection counts as "not yet": a server that turns into a replica closes its clients'
    /// connections (a demoted master does, mid-poll).
    pub fn wait_replica_link_up(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let last = match raw_command_as(self.port, self.password.as_deref(), &["INFO", "replication"]) {
                Ok(Ok(info)) if info.lines().any(|l| l.trim() == "master_link_status:up") => return,
                Ok(Ok(info)) => info,
                Ok(Err(e)) => e,
                Err(e) => e.to_string(),
            };
            assert!(
                Instant::now() < deadline,
                "127.0.0.1:{} is not a replica in sync after {timeout:?}; last INFO replication: {last}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `redis-cli -h 127.0.0.1 -p PORT -e ARGS…` and returns its stdout, trimmed. Panics when
    /// redis-cli fails, including on an error reply.
    pub fn cli(&self, args: &[&str]) -> String {
        let mut command = Command::new("redis-cli");
        command.args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-e"]);
        if let Some(password) = &self.password {
            command.args(["--no-auth-warning", "-a", password]);
        }
        let out = command
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run redis-cli ({INSTALL_HINT}): {e}"));
        let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !out.status.success() {
            panic!(
                "redis-cli -p {} {args:?} failed ({}): {stdout} {}",
                self.port,
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        stdout
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

impl fmt::Debug for RedisServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisServer")
            .field("port", &self.port)
            .field("tls_port", &self.tls_port)
            .field("pid", &self.child.as_ref().map(|c| c.id()))
            .field("dir", &self.dir.path())
            .finish()
    }
}

/// `--tls-cert-file`, `--tls-key-file`, `--tls-ca-cert-file` of `certs` (server certificate and
/// key, CA) and `--tls-auth-clients yes|no`.
fn tls_server_args(certs: &TestCerts, require_client_cert: bool) -> Vec<String> {
    let path = |p: PathBuf| p.display().to_string();
    vec![
        "--tls-cert-file".into(),
        path(certs.server_cert()),
        "--tls-key-file".into(),
        path(certs.server_key()),
        "--tls-ca-cert-file".into(),
        path(certs.ca_cert()),
        "--tls-auth-clients".into(),
        if require_client_cert { "yes" } else { "no" }.into(),
    ]
}

// ------------------------------------------------------------------------------------------------
// RedisCluster
// ------------------------------------------------------------------------------------------------

/// The cluster [`RedisCluster::start`] forms for its next call.
static SPARE_CLUSTER: std::sync::Mutex<Option<std::thread::JoinHandle<RedisCluster>>> = std::sync::Mutex::new(None);

/// The directories the spare's servers were given so far (those of the thread forming it), and
/// whether the process is exiting (then the thread makes no more).
static SPARE_DIRS: std::sync::Mutex<(Vec<PathBuf>, bool)> = std::sync::Mutex::new((Vec::new(), false));

thread_local! {
    /// True on the thread that forms the spare cluster: its servers' directories go to `SPARE_DIRS`.
    static FORMS_SPARE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// At exit: a spare cluster that is formed is dropped (servers killed, directories removed); of
/// one still forming, the directories made so far are removed (its servers die with the
/// process, `PR_SET_PDEATHSIG`).
extern "C" fn drop_spare_cluster() {
    let Ok(mut spare) = SPARE_CLUSTER.try_lock() else { return };
    match spare.take() {
        Some(h) if h.is_finished() => drop(h.join()),
        _ => {
            let mut dirs = SPARE_DIRS.lock().unwrap_or_else(|e| e.into_inner());
            dirs.1 = true;
            for dir in dirs.0.drain(..) {
                let _ = fs::remove_dir_all(dir);
            }
        }
    }
}

/// A 3-master Redis Cluster on 127.0.0.1, every slot assigned: no replicas ([`RedisCluster::start`])
/// or N per master ([`RedisCluster::start_with_replicas`]). Killed on drop.
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
    /// For each master killed with [`RedisCluster::kill_master`]: its port and a slot it served.
    killed_slots: Vec<(u16, u16)>,
}

impl RedisCluster {
    /// A new 3-master cluster, of its caller alone: three cluster-enabled servers joined with
    /// `redis-cli --cluster create`, every node reporting `cluster_state:ok` and 16384 slots ok
    /// (waited for up to 30 s).
    ///
    /// Forming one takes about 2 s of waiting (a fresh master turns `ok` no sooner than 2 s
    /// after it started, Redis's `CLUSTER_WRITABLE_DELAY`), so each call also forms the next
    /// one in the background: a test process that starts clusters one after another gets each
    /// after the first ready (or partly formed). The spare is never shared: it is handed to the
    /// next caller only, with no key written. One left over at exit is killed and its
    /// directories removed.
    pub fn start() -> RedisCluster {
        let spare = SPARE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner()).take();
        // A spare whose forming failed (e.g. its port taken) is replaced: the error went to stderr.
        let cluster = spare.and_then(|h| h.join().ok()).unwrap_or_else(Self::form);
        static AT_EXIT: OnceLock<()> = OnceLock::new();
        AT_EXIT.get_or_init(|| {
            // SAFETY: registers a plain extern "C" fn; it touches only this crate's statics.
            unsafe { libc::atexit(drop_spare_cluster) };
        });
        let mut spare = SPARE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
        if spare.is_none() {
            // (Another caller may have started one meanwhile: then that one is the spare.)
            SPARE_DIRS.lock().unwrap_or_else(|e| e.into_inner()).0.clear();
            *spare = Some(std::thread::spawn(|| {
                FORMS_SPARE.with(|f| f.set(true));
                Self::form()
            }));
        }
        drop(spare);
        cluster
    }

    /// Starts three cluster-enabled servers, joins them with `redis-cli --cluster create`, and
    /// waits (up to 30 s) until every node reports `cluster_state:ok` and 16384 slots ok.
    fn form() -> RedisCluster {
        Self::form_with(0, 5000, None)
    }

    /// A new 3-master cluster (no replicas, formed for its caller alone, no spare) whose nodes
    /// also serve TLS with `certs` (server certificate for `localhost` and 127.0.0.1, clients not
    /// asked for a certificate): `--tls-port`, `--tls-cluster yes` (the cluster bus, on
    /// TLS_PORT + 10000, is TLS; nodes connect to it with `certs`' client certificate, which the
    /// bus requires) and `--tls-replication yes`. The plain ports stay open for
    /// `redis-cli --cluster create` and the harness's own commands. Redis 7 announces each node's
    /// TLS port to TLS clients (`CLUSTER SLOTS`, `CLUSTER NODES`, `MOVED`) and its plain port to
    /// plain ones. Connect with [`RedisCluster::tls_urls`] and `certs`' CA. Waits as
    /// [`RedisCluster::start`] does.
    pub fn start_tls(certs: &TestCerts) -> RedisCluster {
        Self::form_with(0, 5000, Some(certs))
    }

    /// A new cluster of 3 masters, each with `replicas_per_master` replicas (`3 × (1 +
    /// replicas_per_master)` nodes, formed with `redis-cli --cluster create … --cluster-replicas
    /// N`), and `cluster-node-timeout` 1000 ms so that a replica takes over a killed master within
    /// a few seconds. Waits (up to 30 s) until every node reports `cluster_state:ok` with 16384
    /// slots ok and every replica reports `master_link_status:up`. Formed for its caller (no spare).
    /// Kill a master with [`RedisCluster::kill_master`] and wait for its replica with
    /// [`RedisCluster::wait_for_failover`].
    pub fn start_with_replicas(replicas_per_master: usize) -> RedisCluster {
        let cluster = Self::form_with(replicas_per_master, 1000, None);
        cluster.wait_replicas_in_sync(3 * replicas_per_master, CLUSTER_TIMEOUT);
        cluster
    }

    /// Starts `3 × (1 + replicas)` cluster-enabled servers with `cluster-node-timeout`
    /// `node_timeout_ms`, joins them with `redis-cli --cluster create`, and waits (up to 30 s)
    /// until every node reports `cluster_state:ok` and 16384 slots ok.
    /// With `tls`, the nodes serve TLS too (see [`RedisCluster::start_tls`]).
    fn form_with(replicas: usize, node_timeout_ms: u64, tls: Option<&TestCerts>) -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3 * (1 + replicas))
            .map(|_| {
                let mut args =
                    ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout"]
                        .map(String::from)
                        .to_vec();
                args.push(node_timeout_ms.to_string());
                args.extend(["--save", "", "--appendonly", "no"].map(String::from));
                if replicas > 0 {
                    // A master starts a full sync at once (not after the default 5 s wait).
                    args.extend(["--repl-diskless-sync-delay", "0"].map(String::from));
                }
                match tls {
                    None => RedisServer::start_args("baton-redis-cluster", args, true),
                    Some(certs) => {
                        args.extend(tls_server_args(certs, false));
                        args.extend(["--tls-cluster", "yes", "--tls-replication", "yes"].map(String::from));
                        // The cluster bus always asks the connecting node for a certificate, and
                        // the server certificate is for serverAuth only: nodes connect to each
                        // other with the client certificate.
                        args.extend([
                            "--tls-client-cert-file".to_string(),
                            certs.client_cert().display().to_string(),
                            "--tls-client-key-file".into(),
                            certs.client_key().display().to_string(),
                        ]);
                        let spec = LaunchSpec { tls: true, certs: Some(certs.clone()), ..LaunchSpec::default() };
                        RedisServer::start_spec("baton-redis-cluster-tls", args, true, spec)
                    }
                }
            })
            .collect();

        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())).collect();
        let mut child = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run redis-cli ({INSTALL_HINT}): {e}"));
        // redis-cli waits without a limit for the nodes to agree on the configuration: a
        // `CLUSTER MEET` lost under load left one node alone and a test process hanging for ever
        // (seen once in CI). The slots are assigned by then.
        let deadline = Instant::now() + CLUSTER_CREATE_TIMEOUT;
        let finished = loop {
            match child.try_wait() {
                Ok(Some(_)) => break true,
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    let _ = child.kill();
                    break false;
                }
            }
        };
        let out = child.wait_with_output().unwrap_or_else(|e| panic!("redis-cli --cluster create: {e}"));
        if !finished {
            assert_eq!(
                replicas,
                0,
                "redis-cli --cluster create {} did not finish within {CLUSTER_CREATE_TIMEOUT:?}:\n{}",
                addrs.join(" "),
                String::from_utf8_lossy(&out.stdout)
            );
            eprintln!(
                "redis-cli --cluster create {} did not finish within {CLUSTER_CREATE_TIMEOUT:?}; introducing \
                 the nodes to each other",
                addrs.join(" ")
            );
            for a in &nodes {
                for b in &nodes {
                    if a.port() != b.port() {
                        let _ = raw_command(a.port(), &["CLUSTER", "MEET", "127.0.0.1", &b.port().to_string()]);
                    }
                }
            }
        } else if !out.status.success() {
            panic!(
                "redis-cli --cluster create {} failed ({}):\n{}\n{}",
                addrs.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }

        let cluster = RedisCluster { nodes, killed_slots: Vec::new() };
        cluster.wait_ok(CLUSTER_TIMEOUT);
        cluster
    }

    /// Polls `INFO replication` on every running node until `replicas` of them are replicas with
    /// `master_link_status:up`; panics with the last output after `timeout`.
    fn wait_replicas_in_sync(&self, replicas: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let mut in_sync = 0;
            let mut last = String::new();
            for node in self.nodes.iter().filter(|n| n.is_running()) {
                let info = match raw_command(node.port(), &["INFO", "replication"]) {
                    Ok(Ok(info)) => info,
                    Ok(Err(e)) => e,
                    Err(e) => e.to_string(),
                };
                if info.lines().any(|l| l.trim() == "role:slave") {
                    if info.lines().any(|l| l.trim() == "master_link_status:up") {
                        in_sync += 1;
                    } else {
                        last = format!("node 127.0.0.1:{}:\n{info}", node.port());
                    }
                }
            }
            if in_sync >= replicas {
                return;
            }
            if Instant::now() >= deadline {
                panic!("{in_sync} of {replicas} cluster replicas in sync after {timeout:?}; last INFO replication from {last}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The `CLUSTER NODES` lines of a running node, as (port, flags, slot ranges) of each node.
    fn cluster_nodes(&self) -> Result<Vec<NodeLine>, String> {
        let mut last = String::from("no node is running");
        for node in self.nodes.iter().filter(|n| n.is_running()) {
            match raw_command(node.port(), &["CLUSTER", "NODES"]) {
                Ok(Ok(text)) => return Ok(parse_cluster_nodes(&text)),
                Ok(Err(e)) => last = e,
                Err(e) => last = e.to_string(),
            }
        }
        Err(last)
    }

    /// Kills (SIGKILL) the master on 127.0.0.1:`port`, first noting a slot it serves, so that
    /// [`RedisCluster::wait_for_failover`] can tell which node takes it over. Panics when no
    /// running node of this cluster has that port or it serves no slot.
    pub fn kill_master(&mut self, port: u16) {
        let nodes = self.cluster_nodes().unwrap_or_else(|e| panic!("kill_master: CLUSTER NODES failed: {e}"));
        let slot = nodes
            .iter()
            .find(|n| n.port == port && n.has_flag("master"))
            .and_then(|n| n.slots.first().map(|r| r.0))
            .unwrap_or_else(|| panic!("kill_master: 127.0.0.1:{port} is not a master serving slots: {nodes:?}"));
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .unwrap_or_else(|| panic!("kill_master: no node on port {port}"));
        node.kill();
        self.killed_slots.retain(|(p, _)| *p != port);
        self.killed_slots.push((port, slot));
    }

    /// Waits until the slots of the master on `old_master_port` (killed with
    /// [`RedisCluster::kill_master`]) are served by another node that says `role:master`, and
    /// every running node reports `cluster_state:ok` with 16384 slots ok. Returns the new
    /// master's port. Panics after `timeout`, or when `old_master_port` was not killed with
    /// `kill_master`.
    pub fn wait_for_failover(&self, old_master_port: u16, timeout: Duration) -> u16 {
        let slot = self
            .killed_slots
            .iter()
            .find(|(p, _)| *p == old_master_port)
            .map(|(_, s)| *s)
            .unwrap_or_else(|| panic!("wait_for_failover: port {old_master_port} was not killed with kill_master"));
        let deadline = Instant::now() + timeout;
        loop {
            let mut last = String::new();
            let owner = match self.cluster_nodes() {
                Ok(nodes) => nodes
                    .iter()
                    .find(|n| {
                        n.has_flag("master")
                            && !n.has_flag("fail")
                            && !n.has_flag("fail?")
                            && n.slots.iter().any(|&(a, b)| a <= slot && slot <= b)
                    })
                    .map(|n| n.port),
                Err(e) => {
                    last = e;
                    None
                }
            };
            if let Some(new_port) = owner.filter(|&p| p != old_master_port) {
                let is_master = matches!(raw_command(new_port, &["INFO", "replication"]),
                    Ok(Ok(info)) if info.lines().any(|l| l.trim() == "role:master"));
                let all_ok = self.nodes.iter().filter(|n| n.is_running()).all(|n| {
                    matches!(raw_command(n.port(), &["CLUSTER", "INFO"]), Ok(Ok(info))
                        if info.lines().any(|l| l.trim() == "cluster_state:ok")
                            && info.lines().any(|l| l.trim() == "cluster_slots_ok:16384"))
                });
                if is_master && all_ok {
                    return new_port;
                }
                last = format!("slot {slot} served by {new_port} (role:master {is_master}, all nodes ok {all_ok})");
            } else if last.is_empty() {
                last = format!("slot {slot} still served by {owner:?}");
            }
            if Instant::now() >= deadline {
                panic!("no failover of 127.0.0.1:{old_master_port} after {timeout:?}: {last}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Polls `CLUSTER INFO` on every node until all say `cluster_state:ok` and
    /// `cluster_slots_ok:16384`; panics with the last output after `timeout`.
    fn wait_ok(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let mut last = String::new();
            let mut all_ok = true;
            for node in &self.nodes {
                let info = match raw_command(node.port(), &["CLUSTER", "INFO"]) {
                    Ok(Ok(info)) => info,
                    Ok(Err(e)) => e,
                    Err(e) => e.to_string(),
                };
                let ok = info.lines().any(|l| l.trim() == "cluster_state:ok")
                    && info.lines().any(|l| l.trim() == "cluster_slots_ok:16384");
                all_ok &= ok;
                if !ok {
                    last = format!("node 127.0.0.1:{}:\n{info}", node.port());
                }
            }
            if all_ok {
                return;
            }
            if Instant::now() >= deadline {
                panic!("Redis Cluster not ok after {timeout:?}; last CLUSTER INFO from {last}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `rediss://127.0.0.1:TLS_PORT` of every node. Panics unless started with
    /// [`RedisCluster::start_tls`].
    pub fn tls_urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::tls_url).collect()
    }

    /// `redis://127.0.0.1:PORT` of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// `RedisConfig::cluster(self.urls())`.
    pub fn config(&self) -> RedisConfig {
        RedisConfig::cluster(self.urls())
    }

    /// The nodes, e.g. to kill, pause or restart one.
    pub fn nodes(&mut self) -> &mut [RedisServer] {
        &mut self.nodes
    }
}

impl fmt::Debug for RedisCluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisCluster").field("nodes", &self.nodes).finish()
    }
}

/// One line of `CLUSTER NODES`: the node's port, its flags (`myself,master`, `slave`,
/// `master,fail`, …) and the slot ranges it serves (inclusive).
#[derive(Debug)]
struct NodeLine {
    port: u16,
    flags: String,
    slots: Vec<(u16, u16)>,
}

impl NodeLine {
    fn has_flag(&self, flag: &str) -> bool {
        self.flags.split(',').any(|f| f == flag)
    }
}

/// Parses `CLUSTER NODES` text into (port, flags, slot ranges) per node; importing/migrating
/// entries (`[…]`) are skipped.
fn parse_cluster_nodes(text: &str) -> Vec<NodeLine> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let addr = f.get(1)?.split('@').next()?;
            let port = addr.rsplit_once(':')?.1.parse().ok()?;
            let flags = f.get(2)?.to_string();
            let slots = f
                .iter()
                .skip(8)
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|a| (a, a)),
                })
                .collect();
            Some(NodeLine { port, flags, slots })
        })
        .collect()
}

// The nodes are RedisServers: dropping the Vec kills each of them and removes their directories.
impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
    }
}

// ------------------------------------------------------------------------------------------------
// TestBackend
// ------------------------------------------------------------------------------------------------

/// A backend under test for shared conformance suites.
#[derive(Debug)]
pub enum TestBackend {
    Memory,
    Standalone(RedisServer),
    Cluster(RedisCluster),
}

impl TestBackend {
    /// The Redis configuration to connect to; `None` for the in-memory backend.
    pub fn redis_config(&self) -> Option<RedisConfig> {
        match self {
            TestBackend::Memory => None,
            TestBackend::Standalone(server) => Some(server.config()),
            TestBackend::Cluster(cluster) => Some(cluster.config()),
        }
    }

    /// `"memory"`, `"standalone"` or `"cluster"`.
    pub fn name(&self) -> &'static str {
        match self {
            TestBackend::Memory => "memory",
            TestBackend::Standalone(_) => "standalone",
            TestBackend::Cluster(_) => "cluster",
        }
    }
}

/// CPU seconds (user + system) this process has used so far, from Linux `/proc/self/stat` (100 Hz
/// ticks, so 10 ms resolution); 0 where that file cannot be read. For benchmarks that report CPU
/// per operation beside wall time.
pub fn process_cpu_seconds() -> f64 {
    let stat = fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name (in parentheses, which may contain spaces): utime is the
    // 12th and stime the 13th of them.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A port taken by another redis-server is detected (by pid, not by PING alone) and reported
    /// as `PortInUse`, which `start` answers by trying another port.
    #[test]
    fn launch_on_a_taken_port_is_port_in_use() {
        let holder = RedisServer::start();
        let mut other = RedisServer::start();
        other.kill();
        other.port = holder.port();
        match other.launch() {
            Err(StartError::PortInUse(msg)) => assert!(msg.contains("in use"), "{msg}"),
            Err(StartError::Other(msg)) => panic!("expected PortInUse, got: {msg}"),
            Ok(()) => panic!("started on a taken port"),
        }
        assert_eq!(holder.cli(&["PING"]), "PONG");
    }

    #[test]
    fn server_ports_leave_room_for_the_bus_port() {
        for _ in 0..100 {
            let port = pick_server_port(true);
            assert!(PORT_RANGE.contains(&port));
            assert!(u32::from(port) + 10000 < 32768);
        }
    }
}
