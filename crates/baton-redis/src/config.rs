//! [`RedisConfig`]: which Redis servers, and how to log in and verify them.

use std::path::{Path, PathBuf};

/// Where Redis is ([`RedisServers`]) and how to reach it: TLS material for `rediss://` URLs
/// ([`TlsFiles`]) and credentials given apart from the URLs.
///
/// Build one with [`RedisConfig::standalone`], [`RedisConfig::cluster`] or
/// [`RedisConfig::sentinel`], then the `with_*` methods:
///
/// ```
/// use baton_redis::RedisConfig;
///
/// let config = RedisConfig::standalone("rediss://baton@redis.internal:6380")
///     .with_password("s3cret")
///     .with_ca_file("/etc/baton/redis-ca.pem");
/// // Passwords are never shown.
/// assert_eq!(config.to_string(), "Redis rediss://baton@redis.internal:6380 (TLS, CA /etc/baton/redis-ca.pem)");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// The servers.
    pub servers: RedisServers,
    /// Certificates for TLS (`rediss://` URLs). Unused by plain `redis://` URLs.
    pub tls: TlsFiles,
    /// ACL user for the data nodes (not the sentinels), overriding a user in the URLs.
    pub username: Option<String>,
    /// Password for the data nodes (not the sentinels), overriding one in the URLs; read from a
    /// file or an environment variable so that it is not on a command line.
    pub password: Option<String>,
    /// Opt-in durability of acknowledged writes (`None`: a write is acknowledged once the master
    /// has applied it, Redis's default). See [`Durability`].
    pub durability: Option<Durability>,
}

/// How many replicas must hold a write before Baton acknowledges it: the writes that say so
/// (command submits and state transitions, stream creates, appends and closes) are followed on
/// the same connection by `WAIT replicas timeout`, in the same round trip. When fewer replicas
/// confirm within `timeout`, the call fails with an error saying so: the write **was applied on
/// the master** and may or may not survive a failover (retrying is safe where the write is
/// idempotent: a submit with its command id, an append with producer headers).
///
/// What it guarantees: an acknowledged write is on the master and on at least `replicas`
/// replicas, so a failover that promotes one of those replicas keeps it. Redis may still
/// promote a replica that does not have it (Sentinel and Cluster pick the most up-to-date
/// reachable replica, which has it whenever `replicas` ≥ the number of replicas), and `WAIT`
/// says nothing about disk (the `appendfsync` setting of each node does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Durability {
    /// Replicas that must confirm (≥ 1).
    pub replicas: u32,
    /// How long to wait for them (1 ms ..= [`Durability::MAX_TIMEOUT`]).
    pub timeout: std::time::Duration,
}

impl Durability {
    /// Longest `timeout`: 4 s, below the shared connections' response timeout (5 s).
    pub const MAX_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(4);

    /// Checks the bounds above. Errors: a message naming the bad value.
    pub fn check(&self) -> Result<(), String> {
        if self.replicas == 0 {
            return Err("the number of replicas to wait for must be at least 1".into());
        }
        if self.timeout.is_zero() || self.timeout > Self::MAX_TIMEOUT {
            return Err(format!(
                "the replica wait timeout must be from 1ms to {:?}; got {:?}",
                Self::MAX_TIMEOUT,
                self.timeout
            ));
        }
        Ok(())
    }
}

/// Which Redis servers hold Baton's data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RedisServers {
    /// One server, `redis://[user[:password]@]host:port[/db]` (`rediss://` for TLS).
    Standalone(String),
    /// Seed nodes of a Redis Cluster (any of its nodes; the client discovers the rest). All use
    /// one scheme: `redis://` or, for TLS, `rediss://`.
    Cluster(Vec<String>),
    /// The master that a set of Redis Sentinels monitor under `master` (the name in their
    /// `sentinel monitor <name> …` line). `sentinels` are the sentinels' URLs
    /// (`redis://[user:password@]host:26379`, with the sentinels' own credentials); with
    /// `rediss://` the sentinels and the data nodes are both reached over TLS. Baton asks the
    /// sentinels for the current master and asks again whenever the master it talks to is gone
    /// or has become a replica, so it follows failovers.
    Sentinel { sentinels: Vec<String>, master: String },
}

/// PEM files for TLS. With no CA file the server's certificate is checked against the system's
/// trusted roots. The server's certificate must name the host in the URL (DNS name or IP
/// address); in Sentinel mode that is the address the sentinels report for the master.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// CA certificate(s) that sign the servers' certificates (replaces the system roots).
    pub ca: Option<PathBuf>,
    /// Client certificate (chain) for servers that require one (`tls-auth-clients yes`).
    pub client_cert: Option<PathBuf>,
    /// The client certificate's private key (PKCS#8, PKCS#1 or SEC1 PEM).
    pub client_key: Option<PathBuf>,
}

impl RedisConfig {
    /// One standalone server at `url`.
    pub fn standalone(url: impl Into<String>) -> Self {
        Self::of(RedisServers::Standalone(url.into()))
    }

    /// A Redis Cluster reached through any of `seeds`.
    pub fn cluster<S: Into<String>>(seeds: impl IntoIterator<Item = S>) -> Self {
        Self::of(RedisServers::Cluster(seeds.into_iter().map(Into::into).collect()))
    }

    /// The master the `sentinels` know as `master`.
    pub fn sentinel<S: Into<String>>(sentinels: impl IntoIterator<Item = S>, master: impl Into<String>) -> Self {
        Self::of(RedisServers::Sentinel {
            sentinels: sentinels.into_iter().map(Into::into).collect(),
            master: master.into(),
        })
    }

    fn of(servers: RedisServers) -> Self {
        Self { servers, tls: TlsFiles::default(), username: None, password: None, durability: None }
    }

    /// Verify servers against the CA certificate(s) in `path` (PEM) instead of the system roots.
    pub fn with_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.tls.ca = Some(path.into());
        self
    }

    /// Present the client certificate in `cert` with its private key in `key` (PEM files).
    pub fn with_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.tls.client_cert = Some(cert.into());
        self.tls.client_key = Some(key.into());
        self
    }

    /// Log in to the data nodes as ACL user `username`.
    pub fn with_username(mut self, username: impl Into<String>) -> Self {
        self.username = Some(username.into());
        self
    }

    /// Log in to the data nodes with `password`.
    pub fn with_password(mut self, password: impl Into<String>) -> Self {
        self.password = Some(password.into());
        self
    }

    /// Acknowledge writes only once `replicas` replicas hold them, waiting at most `timeout`
    /// ([`Durability`]).
    pub fn with_durability(mut self, replicas: u32, timeout: std::time::Duration) -> Self {
        self.durability = Some(Durability { replicas, timeout });
        self
    }

    /// True when the servers are reached over TLS (`rediss://` URLs).
    pub fn uses_tls(&self) -> bool {
        self.urls().iter().any(|u| u.starts_with("rediss://"))
    }

    /// The URLs given: the server, the seed nodes or the sentinels.
    pub fn urls(&self) -> &[String] {
        match &self.servers {
            RedisServers::Standalone(url) => std::slice::from_ref(url),
            RedisServers::Cluster(urls) => urls,
            RedisServers::Sentinel { sentinels, .. } => sentinels,
        }
    }
}

impl std::fmt::Display for RedisConfig {
    /// `Redis <url>`, `Redis Cluster <url>,<url>` or `Redis Sentinel <master> via <url>,…`, URLs
    /// with any password replaced by `***`, then `(TLS, CA <file>)` when TLS is in use.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let join = |urls: &[String]| urls.iter().map(|u| redact_url(u)).collect::<Vec<_>>().join(",");
        match &self.servers {
            RedisServers::Standalone(url) => write!(f, "Redis {}", redact_url(url))?,
            RedisServers::Cluster(urls) => write!(f, "Redis Cluster {}", join(urls))?,
            RedisServers::Sentinel { sentinels, master } => {
                write!(f, "Redis Sentinel master {master:?} via {}", join(sentinels))?
            }
        }
        if self.uses_tls() {
            match &self.tls.ca {
                Some(ca) => write!(f, " (TLS, CA {})", ca.display())?,
                None => write!(f, " (TLS, system roots)")?,
            }
        }
        if let Some(d) = &self.durability {
            write!(f, " (writes wait for {} replica(s), at most {:?})", d.replicas, d.timeout)?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<String> = self.urls().iter().map(|u| redact_url(u)).collect();
        let mut d = f.debug_struct("RedisConfig");
        match &self.servers {
            RedisServers::Standalone(_) => d.field("standalone", &urls[0]),
            RedisServers::Cluster(_) => d.field("cluster", &urls),
            RedisServers::Sentinel { master, .. } => d.field("sentinels", &urls).field("master", master),
        };
        d.field("tls", &self.tls)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("durability", &self.durability)
            .finish()
    }
}

/// `url` with the password of its user info (`scheme://user:password@host`) replaced by `***`;
/// anything else unchanged.
///
/// The user info is everything before the URL's last `@` (a Redis URL's `/db` and `?…` hold
/// none), so a password written unencoded with `/`, `?`, `#` or `@` in it is hidden too.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}"),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

/// Reads a secret from `path`: the file's one line without its trailing line breaks (any
/// number of `\n` / `\r\n`, e.g. a blank line an editor added). Spaces are kept (they may be
/// part of the secret).
///
/// Errors (the path in the message, never the secret): the I/O error; an empty file; a line
/// break inside the secret (a file of several lines).
pub fn read_secret_file(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let secret = text.trim_end_matches(['\n', '\r']);
    if secret.is_empty() {
        return Err(format!("{} is empty", path.display()));
    }
    if secret.contains(['\n', '\r']) {
        return Err(format!("{} must hold one line (the secret alone); it has several", path.display()));
    }
    Ok(secret.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_and_debug_never_show_passwords() {
        let c = RedisConfig::cluster(["redis://u:pw1@a:1/0", "redis://:pw2@b:2"]).with_password("pw3");
        let shown = format!("{c} {c:?}");
        assert!(!shown.contains("pw1") && !shown.contains("pw2") && !shown.contains("pw3"), "{shown}");
        assert_eq!(c.to_string(), "Redis Cluster redis://u:***@a:1/0,redis://:***@b:2");
        let s = RedisConfig::sentinel(["rediss://s:26379"], "mymaster");
        assert_eq!(s.to_string(), "Redis Sentinel master \"mymaster\" via rediss://s:26379 (TLS, system roots)");
    }

    #[test]
    fn redact_url_keeps_everything_but_the_password() {
        assert_eq!(redact_url("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(redact_url("redis://user@h:1"), "redis://user@h:1");
        assert_eq!(redact_url("rediss://user:p@ss@h:1/2"), "rediss://user:***@h:1/2");
    }
}
