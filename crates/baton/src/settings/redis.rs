//! Where Redis is and how to log in: the `--redis*` flags shared by `baton serve`, `baton worker`
//! and `baton bench`, their `BATON_REDIS*` environment variables and TOML keys, resolved into a
//! [`RedisConfig`].

use std::path::PathBuf;

use baton_redis::{read_secret_file, RedisConfig};
use clap::Args;

/// The Redis flags. Exactly one of `--redis`, `--redis-cluster` and `--redis-sentinel` names
/// the servers (none: the in-memory backend); the rest say how to reach them.
#[derive(Args, Debug, Default, Clone)]
pub struct RedisArgs {
    /// Redis standalone URL, e.g. redis://user:password@host:6379/0 (user, password and database optional), or rediss:// for TLS.
    /// Without it (and without --redis-cluster or --redis-sentinel) everything lives in memory.
    #[arg(long, env = "BATON_REDIS", conflicts_with_all = ["redis_cluster", "redis_sentinel"])]
    pub redis: Option<String>,
    /// Redis Cluster seed node URLs, comma separated (redis:// or rediss://).
    #[arg(long, env = "BATON_REDIS_CLUSTER", value_delimiter = ',', conflicts_with = "redis_sentinel")]
    pub redis_cluster: Option<Vec<String>>,
    /// Redis Sentinel URLs, comma separated (redis://host:26379; rediss:// for TLS to the
    /// sentinels and the data nodes); needs --redis-sentinel-master.
    #[arg(long, env = "BATON_REDIS_SENTINEL", value_delimiter = ',', requires = "redis_sentinel_master")]
    pub redis_sentinel: Option<Vec<String>>,
    /// The master's name in the sentinels' configuration (`sentinel monitor <name> …`).
    #[arg(long, env = "BATON_REDIS_SENTINEL_MASTER")]
    pub redis_sentinel_master: Option<String>,
    /// CA certificate file (PEM) that signs the Redis servers' certificates, for rediss:// URLs
    /// [default: the system's trusted roots].
    #[arg(long, env = "BATON_REDIS_CA")]
    pub redis_ca: Option<PathBuf>,
    /// Client certificate file (PEM) for servers with `tls-auth-clients yes`; needs
    /// --redis-client-key.
    #[arg(long, env = "BATON_REDIS_CLIENT_CERT", requires = "redis_client_key")]
    pub redis_client_cert: Option<PathBuf>,
    /// The client certificate's private key file (PEM).
    #[arg(long, env = "BATON_REDIS_CLIENT_KEY", requires = "redis_client_cert")]
    pub redis_client_key: Option<PathBuf>,
    /// ACL user for the Redis data nodes (overrides a user in the URLs).
    #[arg(long, env = "BATON_REDIS_USERNAME")]
    pub redis_username: Option<String>,
    /// File holding the Redis password (one line) for the data nodes, so that it is not on the
    /// command line; or set BATON_REDIS_PASSWORD.
    #[arg(long, env = "BATON_REDIS_PASSWORD_FILE", conflicts_with = "redis_password")]
    pub redis_password_file: Option<PathBuf>,
    /// The Redis password for the data nodes (environment only).
    #[arg(long = "redis-password", env = "BATON_REDIS_PASSWORD", hide = true, hide_env_values = true)]
    pub redis_password: Option<String>,
    /// Acknowledge command submits and transitions and stream creates, appends and closes only
    /// once this many replicas hold them (Redis `WAIT`); fewer in time is an error (503) [default:
    /// 0, the master alone].
    #[arg(long, env = "BATON_REDIS_WAIT_REPLICAS")]
    pub redis_wait_replicas: Option<u32>,
    /// With --redis-wait-replicas: how long to wait for the replicas, at most 4s [default: 1s].
    #[arg(long, env = "BATON_REDIS_WAIT_TIMEOUT", value_parser = super::values::parse_duration)]
    pub redis_wait_timeout: Option<std::time::Duration>,
}

/// The same keys in the TOML file (`redis`, `redis_cluster`, `redis_sentinel`,
/// `redis_sentinel_master`, `redis_ca`, `redis_client_cert`, `redis_client_key`,
/// `redis_username`, `redis_password_file`, `redis_wait_replicas`, `redis_wait_timeout`; a
/// password itself is never read from the file).
#[derive(Debug, Default)]
pub struct RedisFile {
    pub redis: Option<String>,
    pub redis_cluster: Option<Vec<String>>,
    pub redis_sentinel: Option<Vec<String>>,
    pub redis_sentinel_master: Option<String>,
    pub redis_ca: Option<PathBuf>,
    pub redis_client_cert: Option<PathBuf>,
    pub redis_client_key: Option<PathBuf>,
    pub redis_username: Option<String>,
    pub redis_password_file: Option<PathBuf>,
    pub redis_wait_replicas: Option<u32>,
    /// As written in the file (`"1s"`).
    pub redis_wait_timeout: Option<String>,
}

/// Default of `--redis-wait-timeout`: 1 s.
pub const DEFAULT_WAIT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

impl RedisArgs {
    /// The configuration the flags (over the file's keys) name, or `None` for the in-memory
    /// backend. Reads the password file. Errors name the flag to fix: more than one of
    /// `--redis` / `--redis-cluster` / `--redis-sentinel`, an empty URL list, a sentinel without
    /// its master name, TLS or login flags without Redis, an unreadable or empty password file.
    pub fn resolve(self, file: RedisFile) -> Result<Option<RedisConfig>, String> {
        // Flags and environment win over the file, key by key; the servers as one choice, so a
        // flag --redis-cluster replaces the file's `redis` rather than conflicting with it.
        let flag_servers = self.redis.is_some() || self.redis_cluster.is_some() || self.redis_sentinel.is_some();
        let (redis, cluster, sentinel) = if flag_servers {
            (self.redis, self.redis_cluster, self.redis_sentinel)
        } else {
            (file.redis, file.redis_cluster, file.redis_sentinel)
        };
        let list = |urls: Vec<String>, flag: &str| -> Result<Vec<String>, String> {
            let urls: Vec<String> = urls.into_iter().map(|u| u.trim().to_string()).filter(|u| !u.is_empty()).collect();
            if urls.is_empty() {
                return Err(format!("{flag} needs at least one URL"));
            }
            Ok(urls)
        };
        let master = self.redis_sentinel_master.or(file.redis_sentinel_master);
        let config = match (redis, cluster, sentinel) {
            (None, None, None) => None,
            (Some(url), None, None) => Some(RedisConfig::standalone(url.trim())),
            (None, Some(urls), None) => Some(RedisConfig::cluster(list(urls, "--redis-cluster")?)),
            (None, None, Some(urls)) => {
                let urls = list(urls, "--redis-sentinel")?;
                let Some(master) = master.clone().filter(|m| !m.trim().is_empty()) else {
                    return Err("--redis-sentinel needs --redis-sentinel-master NAME (the name in the sentinels' \
                                `sentinel monitor NAME …` line)"
                        .into());
                };
                Some(RedisConfig::sentinel(urls, master.trim()))
            }
            _ => return Err("give one of --redis, --redis-cluster and --redis-sentinel, not several".into()),
        };
        let ca = self.redis_ca.or(file.redis_ca);
        let cert = self.redis_client_cert.or(file.redis_client_cert);
        let key = self.redis_client_key.or(file.redis_client_key);
        let username = self.redis_username.or(file.redis_username);
        let password = match (self.redis_password, self.redis_password_file.or(file.redis_password_file)) {
            (Some(p), _) => Some(p),
            (None, Some(path)) => Some(read_secret_file(&path).map_err(|e| format!("--redis-password-file: {e}"))?),
            (None, None) => None,
        };
        let Some(mut config) = config else {
            if ca.is_some() || cert.is_some() || key.is_some() || username.is_some() || password.is_some() {
                return Err("--redis-ca, --redis-client-cert/-key, --redis-username and the Redis password need \
                            --redis, --redis-cluster or --redis-sentinel"
                    .into());
            }
            return Ok(None);
        };
        if master.is_some() && !matches!(config.servers, baton_redis::RedisServers::Sentinel { .. }) {
            return Err("--redis-sentinel-master needs --redis-sentinel".into());
        }
        if let Some(ca) = ca {
            config = config.with_ca_file(ca);
        }
        match (cert, key) {
            (Some(c), Some(k)) => config = config.with_client_cert(c, k),
            (None, None) => {}
            _ => return Err("--redis-client-cert and --redis-client-key go together".into()),
        }
        if let Some(u) = username {
            config = config.with_username(u);
        }
        if let Some(p) = password {
            config = config.with_password(p);
        }
        let wait_timeout = match (self.redis_wait_timeout, file.redis_wait_timeout) {
            (Some(d), _) => Some(d),
            (None, Some(text)) => {
                Some(super::values::parse_duration(&text).map_err(|e| format!("config key redis_wait_timeout: {e}"))?)
            }
            (None, None) => None,
        };
        match (self.redis_wait_replicas.or(file.redis_wait_replicas), wait_timeout) {
            (None | Some(0), None) => {}
            (None | Some(0), Some(_)) => {
                return Err("--redis-wait-timeout needs --redis-wait-replicas N (N ≥ 1)".into())
            }
            (Some(n), timeout) => {
                config = config.with_durability(n, timeout.unwrap_or(DEFAULT_WAIT_TIMEOUT));
                if let Some(d) = &config.durability {
                    d.check().map_err(|e| format!("--redis-wait-replicas / --redis-wait-timeout: {e}"))?;
                }
            }
        }
        if (config.tls != Default::default()) && !config.uses_tls() {
            return Err("--redis-ca and --redis-client-cert are for TLS: use rediss:// URLs".into());
        }
        Ok(Some(config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_needs_its_master_and_tls_needs_rediss() {
        let args = RedisArgs { redis_sentinel: Some(vec!["redis://s:26379".into()]), ..Default::default() };
        assert!(args.resolve(RedisFile::default()).unwrap_err().contains("--redis-sentinel-master"));
        let args = RedisArgs {
            redis_sentinel: Some(vec!["redis://s:26379".into(), " ".into()]),
            redis_sentinel_master: Some("mymaster".into()),
            ..Default::default()
        };
        assert_eq!(
            args.resolve(RedisFile::default()).unwrap(),
            Some(RedisConfig::sentinel(["redis://s:26379"], "mymaster"))
        );
        let args =
            RedisArgs { redis: Some("redis://h:1".into()), redis_ca: Some("/ca.pem".into()), ..Default::default() };
        assert!(args.resolve(RedisFile::default()).unwrap_err().contains("rediss://"));
        let args = RedisArgs { redis_ca: Some("/ca.pem".into()), ..Default::default() };
        assert!(args.resolve(RedisFile::default()).unwrap_err().contains("need"));
    }

    #[test]
    fn the_password_comes_from_a_file_without_its_line_break() {
        let dir = std::env::temp_dir().join(format!("baton-redis-args-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pw");
        std::fs::write(&path, "s3cret\n").unwrap();
        let args = RedisArgs {
            redis: Some("redis://app@h:1".into()),
            redis_password_file: Some(path.clone()),
            ..Default::default()
        };
        let config = args.resolve(RedisFile::default()).unwrap().unwrap();
        assert_eq!(config.password.as_deref(), Some("s3cret"));
        std::fs::write(&path, "").unwrap();
        let args =
            RedisArgs { redis: Some("redis://h:1".into()), redis_password_file: Some(path), ..Default::default() };
        assert!(args.resolve(RedisFile::default()).unwrap_err().contains("is empty"));
        // A flag naming other servers replaces the file's choice.
        let file = RedisFile { redis: Some("redis://file:1".into()), ..Default::default() };
        let args = RedisArgs { redis_cluster: Some(vec!["redis://a:1".into()]), ..Default::default() };
        assert_eq!(args.resolve(file).unwrap(), Some(RedisConfig::cluster(["redis://a:1"])));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
