//! Redis backend (standalone and Cluster): one script call per operation (see the crate docs
//! for the key layout and the scripts), plus the shared tail loops in [`tail`].

mod blocker;
mod reply;
mod sweep;
mod tail;
mod writer;

use std::collections::HashSet;
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use baton_redis::redis::{self, Value};
use baton_redis::{LuaScript, RedisClient, RedisConfig, RedisConn};
use futures::StreamExt;

use crate::backend::{CreateSpec, Deleted, PathFilter, Smallest, Snapshot, StreamBackend, WriteSpec};
use crate::error::{Result, StreamError};
use crate::offset::{Offset, ReadFrom};
use crate::settings::StreamStoreSettings;
use crate::types::*;
use reply::*;

macro_rules! script {
    ($name:literal, $file:literal) => {
        LuaScript::new(
            $name,
            concat!(include_str!("../../scripts/common.lua"), include_str!(concat!("../../scripts/", $file))),
        )
    };
}

/// [`script!`] with `bury.lua` (the re-send guard's tombstone) between the prelude and the
/// script: the scripts that delete a stream's hash.
macro_rules! burying_script {
    ($name:literal, $file:literal) => {
        LuaScript::new(
            $name,
            concat!(
                include_str!("../../scripts/common.lua"),
                include_str!("../../scripts/bury.lua"),
                include_str!(concat!("../../scripts/", $file))
            ),
        )
    };
}

/// Creates a stream; a third key, its tombstone ([`tombstone_key`]), whose re-send guard fields
/// a new stream takes over.
static CREATE: LuaScript = script!("streams.create", "create.lua");
static WRITE: LuaScript = LuaScript::new(
    "streams.write",
    concat!(
        include_str!("../../scripts/write_guard_off.lua"),
        include_str!("../../scripts/write_fast.lua"),
        include_str!("../../scripts/common.lua"),
        include_str!("../../scripts/write.lua")
    ),
);
/// [`WRITE`] under a re-send guard (`scripts/write_guard.lua`, the guard kept in the stream's
/// metadata hash): what Cluster deployments send, so that an append re-sent by the Cluster client
/// after a dropped connection is not written twice and gets the first copy's reply.
static WRITE_GUARDED: LuaScript = LuaScript::new(
    "streams.write",
    concat!(
        include_str!("../../scripts/write_guard.lua"),
        include_str!("../../scripts/write_fast.lua"),
        include_str!("../../scripts/common.lua"),
        include_str!("../../scripts/write.lua")
    ),
);
static READ: LuaScript = script!("streams.read", "read.lua");
/// Deletes a stream; a third key, its tombstone ([`tombstone_key`]), where a hard delete keeps
/// the re-send guard fields.
static DELETE: LuaScript = burying_script!("streams.delete", "delete.lua");
/// Counts fork references; a third key, the tombstone, as [`DELETE`] (collecting a soft-deleted
/// stream deletes its hash).
static REFS: LuaScript = burying_script!("streams.refs", "refs.lua");
static KEEPALIVE: LuaScript = script!("streams.keepalive", "keepalive.lua");
static TRIM: LuaScript = script!("streams.trim", "trim.lua");

/// `baton:s:{<path>}` and `baton:s:{<path>}:m`, with `%`, `{`, `}` percent-encoded in the tag.
pub(crate) fn keys(path: &StreamPath) -> (String, String) {
    let mut ks = String::with_capacity(path.as_str().len() + 12);
    ks.push_str("baton:s:{");
    escape_into(&mut ks, path.as_str());
    ks.push('}');
    let mut km = String::with_capacity(ks.len() + 2);
    km.push_str(&ks);
    km.push_str(":m");
    (ks, km)
}

/// `baton:s:{<path>}:gone` for the stream key `ks` ([`keys`]): the tombstone of a deleted
/// stream's re-send guard (`scripts/bury.lua`), in the stream's slot. Only [`CREATE`], [`DELETE`]
/// and [`REFS`] take it (their `KEYS[3]`); the write scripts never do.
pub(crate) fn tombstone_key(ks: &str) -> String {
    let mut k = String::with_capacity(ks.len() + 5);
    k.push_str(ks);
    k.push_str(":gone");
    k
}

/// Appends `path` with `%`, `{`, `}` percent-encoded (`%25`, `%7B`, `%7D`): the hash tag of its keys.
fn escape_into(out: &mut String, path: &str) {
    for c in path.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
}

/// The `SCAN … MATCH` pattern of the metadata keys of the streams whose path starts with `prefix`
/// (`""` for all): `baton:s:{<prefix>*}:m`, the prefix escaped as in [`keys`] and then its glob
/// metacharacters `*?[]\` escaped with `\`. It matches no other key of the layout: a data key
/// does not end in `}:m` (`}` inside a tag is always `%7D`), nor does a tombstone
/// ([`tombstone_key`]) or an overflow key, the deadline shards are
/// `baton:s:deadlines:{N}`.
pub(crate) fn meta_pattern(prefix: &str) -> String {
    let mut tag = String::with_capacity(prefix.len() + 8);
    escape_into(&mut tag, prefix);
    let mut p = String::with_capacity(tag.len() + 16);
    p.push_str("baton:s:{");
    for c in tag.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            p.push('\\');
        }
        p.push(c);
    }
    p.push_str("*}:m");
    p
}

/// The stream path of a metadata key `baton:s:{<escaped path>}:m`; `None` for any other key (or
/// a tag that is not a valid escaped path).
pub(crate) fn meta_path(key: &[u8]) -> Option<StreamPath> {
    let key = std::str::from_utf8(key).ok()?;
    let tag = key.strip_prefix("baton:s:{")?.strip_suffix("}:m")?;
    let mut path = String::with_capacity(tag.len());
    let mut rest = tag;
    while let Some(i) = rest.find(['%', '{', '}']) {
        path.push_str(&rest[..i]);
        let c = match rest.get(i..i + 3)? {
            "%25" => '%',
            "%7B" => '{',
            "%7D" => '}',
            _ => return None,
        };
        path.push(c);
        rest = &rest[i + 3..];
    }
    path.push_str(rest);
    StreamPath::new(path).ok()
}

/// `COUNT` of each `SCAN` call of [`StreamBackend::list`].
const SCAN_COUNT: usize = 1000;
/// Metadata reads in flight at once while [`StreamBackend::list`] checks a page of keys.
const LIST_CHECKS: usize = 64;

pub(crate) struct RedisStreamBackend {
    client: RedisClient,
    conn: RedisConn,
    /// With opt-in durability: the connections of writes that wait for replicas.
    durable: Option<baton_redis::DurableWriter>,
    settings: Arc<StreamStoreSettings>,
    hub: tail::TailHub,
    writer: writer::Writer,
    /// On Cluster: the guard of this process's `write.lua` calls ([`WRITE_GUARDED`]; the group
    /// commit keeps one call per stream in flight, as the guard needs).
    resend: Option<baton_redis::resend::ResendGuard>,
    blocker: blocker::Blocker,
    me: Weak<RedisStreamBackend>,
}

fn ms_arg(d: Option<Duration>) -> Vec<u8> {
    d.map(|d| d.as_millis().to_string().into_bytes()).unwrap_or_default()
}

fn opt_arg(v: Option<u64>) -> Vec<u8> {
    v.map(|v| v.to_string().into_bytes()).unwrap_or_default()
}

impl RedisStreamBackend {
    pub(crate) async fn connect(config: RedisConfig, settings: Arc<StreamStoreSettings>) -> Result<Arc<Self>> {
        let client = RedisClient::new(config)?;
        let conn = client.shared().await?;
        let durable = client.durable_writer().await?;
        let every = settings.sweep_interval;
        let resend = client.is_cluster().then(baton_redis::resend::ResendGuard::new);
        let store = Arc::new_cyclic(|weak| Self {
            client,
            conn,
            durable,
            settings,
            hub: tail::TailHub::new(weak.clone()),
            writer: writer::Writer::default(),
            resend,
            blocker: blocker::Blocker::default(),
            me: weak.clone(),
        });
        tokio::spawn(sweep::sweeper(Arc::downgrade(&store), every));
        Ok(store)
    }

    /// Sends `cmd`, an `EVALSHA` of `script` ([`LuaScript::evalsha_cmd`]), on the shared
    /// connection ([`LuaScript::query`]: loads the script on `NOSCRIPT`, e.g. after a restart).
    pub(crate) async fn eval(&self, script: &LuaScript, cmd: &baton_redis::redis::Cmd) -> Result<Value> {
        Ok(script.query(&mut self.conn.clone(), cmd).await?)
    }

    /// [`Self::eval`] of a write acknowledged to the client (appends, closes, creates): with the
    /// client's opt-in [`baton_redis::Durability`], it waits for that many replicas
    /// ([`LuaScript::query_durable`]).
    pub(crate) async fn eval_durable(
        &self,
        script: &LuaScript,
        path: &StreamPath,
        cmd: &baton_redis::redis::Cmd,
    ) -> Result<Value> {
        match &self.durable {
            Some(w) => Ok(w.query(script, path.as_str(), cmd).await?),
            None => self.eval(script, cmd).await,
        }
    }

    /// Runs `script` with the stream's two keys and `args`; its reply must be a non-empty array.
    pub(crate) async fn call(&self, script: &LuaScript, path: &StreamPath, args: Vec<Vec<u8>>) -> Result<Vec<Value>> {
        self.call_keys(script, path, args, false, false).await
    }

    /// [`Self::call`] with a third key, the stream's tombstone ([`tombstone_key`]): [`CREATE`],
    /// [`DELETE`], [`REFS`].
    pub(crate) async fn call_burying(
        &self,
        script: &LuaScript,
        path: &StreamPath,
        args: Vec<Vec<u8>>,
    ) -> Result<Vec<Value>> {
        self.call_keys(script, path, args, false, true).await
    }

    /// [`Self::call_burying`] of a write acknowledged to the client ([`Self::eval_durable`]):
    /// [`CREATE`].
    pub(crate) async fn call_durable_burying(
        &self,
        script: &LuaScript,
        path: &StreamPath,
        args: Vec<Vec<u8>>,
    ) -> Result<Vec<Value>> {
        self.call_keys(script, path, args, true, true).await
    }

    async fn call_keys(
        &self,
        script: &LuaScript,
        path: &StreamPath,
        args: Vec<Vec<u8>>,
        durable: bool,
        tombstone: bool,
    ) -> Result<Vec<Value>> {
        let (ks, km) = keys(path);
        // Every key a script touches is in KEYS (Cluster): the tombstone too, where it is used.
        let kt = tombstone.then(|| tombstone_key(&ks));
        // Sized up front: `EVALSHA <sha1> <numkeys>`, the keys, the arguments.
        let bytes = 7
            + 40
            + 1
            + ks.len()
            + km.len()
            + kt.as_ref().map_or(0, String::len)
            + args.iter().map(Vec::len).sum::<usize>();
        let n = 2 + usize::from(tombstone);
        let mut cmd = script.evalsha_cmd_with_capacity(n, 3 + n + args.len(), bytes);
        cmd.arg(ks).arg(km);
        if let Some(kt) = kt {
            cmd.arg(kt);
        }
        for a in &args {
            cmd.arg(a.as_slice());
        }
        let reply =
            if durable { self.eval_durable(script, path, &cmd).await? } else { self.eval(script, &cmd).await? };
        match reply {
            Value::Array(items) if !items.is_empty() => Ok(items),
            other => Err(StreamError::Backend(format!("{}: unexpected reply {other:?}", script.name()))),
        }
    }

    /// One `read.lua` call.
    pub(crate) async fn read_raw(
        &self,
        path: &StreamPath,
        from: ReadFrom,
        max_records: usize,
        max_bytes: usize,
        touch: bool,
        incarnation: Option<&str>,
    ) -> Result<(ReadChunk, StreamInfo)> {
        let (mode, id) = match from {
            ReadFrom::Start => ("start", String::new()),
            ReadFrom::Now => ("now", String::new()),
            ReadFrom::At(o) | ReadFrom::Tagged(o, _) => ("at", o.to_redis_id()),
        };
        let args = vec![
            mode.into(),
            id.into_bytes(),
            max_records.to_string().into_bytes(),
            max_bytes.to_string().into_bytes(),
            if touch { b"1".to_vec() } else { vec![] },
            incarnation.unwrap_or("").as_bytes().to_vec(),
        ];
        let r = self.call(&READ, path, args).await?;
        let requested = match from {
            ReadFrom::At(o) | ReadFrom::Tagged(o, _) => o,
            _ => Offset::ZERO,
        };
        check(path, &r, requested, 0)?;
        let info = parse_info(path, &r[1])?;
        let records = parse_records(&r[2])?;
        let next = parse_id(&r[3])?;
        let up_to_date = next == info.tail;
        let chunk = ReadChunk {
            records,
            next_offset: next,
            up_to_date,
            end: info.end.filter(|_| up_to_date),
            content_type: info.content_type.clone(),
            incarnation: info.incarnation.clone(),
        };
        Ok((chunk, info))
    }
}

#[async_trait]
impl StreamBackend for RedisStreamBackend {
    async fn create(&self, path: &StreamPath, spec: CreateSpec) -> Result<(Created, Option<u64>)> {
        let (ttl, exp) = match spec.expiry {
            Expiry::None => (None, None),
            Expiry::TtlSecs(s) => (Some(s * 1000), None),
            Expiry::At(t) => (None, Some(t)),
        };
        let fork = spec.fork.as_ref();
        let mut args: Vec<Vec<u8>> = vec![
            spec.incarnation.clone().into_bytes(),
            spec.content_type.clone().into_bytes(),
            normalize_content_type(&spec.content_type).into_bytes(),
            opt_arg(ttl),
            opt_arg(exp),
            if spec.closed { b"1".to_vec() } else { vec![] },
            match (spec.silence_from_open, spec.limits.silence_timeout) {
                // Kept aside until the first producer's open arms it (create.lua).
                (true, Some(d)) => format!("o{}", d.as_millis()).into_bytes(),
                (_, d) => ms_arg(d),
            },
            ms_arg(spec.limits.max_run),
            ms_arg(spec.limits.done_ttl),
            opt_arg(spec.limits.max_len),
            opt_arg(spec.limits.max_len_per_writer),
            fork.map(|f| f.source.as_str().as_bytes().to_vec()).unwrap_or_default(),
            fork.and_then(|f| f.offset).map(|o| o.to_redis_id().into_bytes()).unwrap_or_default(),
            fork.map(|f| f.sub_offset.to_string().into_bytes()).unwrap_or_default(),
            spec.base.to_redis_id().into_bytes(),
            spec.claim.clone().unwrap_or_default().into_bytes(),
            spec.records.len().to_string().into_bytes(),
        ];
        for (id, data, n) in &spec.records {
            args.push(id.map(|o| o.to_redis_id()).unwrap_or_else(|| "*".into()).into_bytes());
            args.push(data.to_vec());
            args.push(n.to_string().into_bytes());
        }
        // Silence sweeper: register the new incarnation in its deadline shard, concurrently with
        // the create (another slot in Cluster, so not in the script); a score is a lower bound.
        let silence = spec
            .limits
            .silence_timeout
            .filter(|_| !spec.closed && !spec.silence_from_open)
            .map(|d| d.as_millis() as u64);
        let early = silence.map(|sil| now_ms() + sil - (sil / 4).min(1000));
        let (r, registered) = match early {
            Some(at) => {
                let (r, g) = tokio::join!(
                    self.call_durable_burying(&CREATE, path, args),
                    self.register_deadline(path, &spec.incarnation, Some(at), None)
                );
                (r?, Some(g))
            }
            None => (self.call_durable_burying(&CREATE, path, args).await?, None),
        };
        check(path, &r, Offset::ZERO, 0)?;
        let info = parse_info(path, &r[1])?;
        let epoch = r.get(2).map(text).filter(|s| !s.is_empty()).and_then(|s| s.parse().ok());
        let created = is(&r[0], "created");
        if let Some(registered) = registered {
            if !created || registered.is_err() {
                // An existing stream (registered when it was created; re-registered here in case
                // that failed), or a failed registration: register the actual incarnation now.
                match (info.end, info.limits.silence_timeout) {
                    (None, Some(sil)) => {
                        let at = info.last_write_at + sil.as_millis() as u64 + 1;
                        self.register_deadline(path, &info.incarnation, Some(at), Some(&spec.incarnation)).await?
                    }
                    // Nothing to watch: only drop the member registered for this call.
                    _ => self.register_deadline(path, &info.incarnation, None, Some(&spec.incarnation)).await?,
                }
            }
        }
        Ok((Created { created, info }, epoch))
    }

    async fn write(&self, path: &StreamPath, spec: WriteSpec) -> Result<Appended> {
        let me = self.me.upgrade().ok_or_else(|| StreamError::Backend("store dropped".into()))?;
        me.submit_write(path, spec).await
    }

    async fn read(
        &self,
        path: &StreamPath,
        from: ReadFrom,
        max_records: usize,
        max_bytes: usize,
        touch: bool,
        incarnation: Option<&str>,
    ) -> Result<(ReadChunk, StreamInfo)> {
        self.read_raw(path, from, max_records, max_bytes, touch, incarnation).await
    }

    async fn snapshot(&self, path: &StreamPath, offset: Option<Offset>) -> Result<Snapshot> {
        let id = offset.map(|o| o.to_redis_id()).unwrap_or_default();
        let args = vec![b"snap".to_vec(), id.into_bytes(), b"0".to_vec(), b"0".to_vec(), vec![], vec![]];
        let r = self.call(&READ, path, args).await?;
        check(path, &r, offset.unwrap_or_default(), 0)?;
        let info = parse_info(path, &r[1])?;
        let inherited = parse_records(&r[2])?;
        let next = parse_records(&r[3])?.into_iter().next();
        Ok(Snapshot { info, inherited, next, offset: parse_id(&r[4])? })
    }

    async fn delete(&self, path: &StreamPath) -> Result<Deleted> {
        let r = self.call_burying(&DELETE, path, vec![]).await?;
        check(path, &r, Offset::ZERO, 0)?;
        Ok(match text(&r[0]).as_str() {
            "soft" => Deleted::Soft,
            _ => Deleted::Hard { fork_source: source_path(&r[1]) },
        })
    }

    async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<StreamPath>> {
        let mut out = Vec::new();
        if limit == 0 {
            return Ok(out);
        }
        let mut seen = HashSet::new();
        let mut scan = self.conn.scan_match(meta_pattern(prefix), SCAN_COUNT);
        while let Some(page) = scan.next_page().await? {
            let fresh: Vec<StreamPath> = page
                .iter()
                .filter_map(|k| meta_path(k))
                .filter(|p| p.as_str().starts_with(prefix) && seen.insert(p.clone()))
                .collect();
            // A key SCAN returned may be gone by now, or be a soft-deleted stream (`del`).
            let mut checks = futures::stream::iter(fresh)
                .map(|p| async move {
                    let (_, km) = keys(&p);
                    let mut conn = self.conn.clone();
                    let (inc, del): (Option<Vec<u8>>, Option<Vec<u8>>) =
                        redis::cmd("HMGET").arg(km).arg("inc").arg("del").query_async(&mut conn).await?;
                    Ok::<_, StreamError>((inc.is_some() && del.is_none()).then_some(p))
                })
                .buffered(LIST_CHECKS);
            while let Some(checked) = checks.next().await {
                if let Some(p) = checked? {
                    out.push(p);
                    if out.len() >= limit {
                        return Ok(out);
                    }
                }
            }
        }
        Ok(out)
    }

    async fn list_sorted(
        &self,
        prefix: &str,
        after: Option<&StreamPath>,
        limit: usize,
        keep: &PathFilter,
    ) -> Result<(Vec<StreamPath>, bool)> {
        // Every metadata key under the prefix, on every master: SCAN has no order, so the whole
        // match set is walked and only the `limit + 1` smallest paths are kept.
        let mut smallest = Smallest::new(limit.saturating_add(1));
        let mut scan = self.conn.scan_match(meta_pattern(prefix), SCAN_COUNT);
        while let Some(page) = scan.next_page().await? {
            for p in page.iter().filter_map(|k| meta_path(k)) {
                if p.as_str().starts_with(prefix) && after.is_none_or(|a| p > *a) && keep(&p) {
                    smallest.offer(p);
                }
            }
        }
        Ok(smallest.page(limit))
    }

    async fn refs(&self, path: &StreamPath, add: bool) -> Result<Option<StreamPath>> {
        let r = self.call_burying(&REFS, path, vec![if add { b"+".to_vec() } else { b"-".to_vec() }]).await?;
        Ok(if text(&r[0]) == "collected" { source_path(&r[1]) } else { None })
    }

    async fn producer_epoch(&self, path: &StreamPath, id: &str) -> Result<Option<u64>> {
        // One key of the stream: a plain read (no script). A soft-deleted stream keeps its
        // metadata with `del` set.
        let (_, km) = keys(path);
        let (inc, del, state): (Option<String>, Option<String>, Option<String>) = baton_redis::redis::cmd("HMGET")
            .arg(&km)
            .arg("inc")
            .arg("del")
            .arg(format!("p:{id}"))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| StreamError::Backend(format!("streams.producer_epoch: {e}")))?;
        match (inc, del) {
            (None, _) => Err(StreamError::NotFound { path: path.to_string() }),
            (Some(_), Some(_)) => Err(StreamError::Gone { path: path.to_string() }),
            // "epoch:last:count:offset"
            (Some(_), None) => {
                match state {
                    None => Ok(None),
                    Some(s) => s.split(':').next().and_then(|e| e.parse().ok()).map(Some).ok_or_else(|| {
                        StreamError::Backend(format!("streams.producer_epoch: bad producer state {s:?}"))
                    }),
                }
            }
        }
    }

    async fn keepalive(
        &self,
        path: &StreamPath,
        incarnation: Option<&str>,
        producer: Option<(&str, u64)>,
    ) -> Result<StreamInfo> {
        let args = vec![
            incarnation.unwrap_or("").as_bytes().to_vec(),
            producer.map(|p| p.0).unwrap_or("").as_bytes().to_vec(),
            producer.map(|p| p.1.to_string()).unwrap_or_default().into_bytes(),
        ];
        let r = self.call(&KEEPALIVE, path, args).await?;
        check(path, &r, Offset::ZERO, producer.map_or(0, |p| p.1))?;
        parse_info(path, &r[1])
    }

    async fn trim(&self, path: &StreamPath, through: Offset) -> Result<Offset> {
        let after = Offset::new(through.ms, through.seq + 1);
        let r =
            self.call(&TRIM, path, vec![through.to_redis_id().into_bytes(), after.to_redis_id().into_bytes()]).await?;
        check(path, &r, through, 0)?;
        parse_id(&r[1])
    }

    async fn wait(
        &self,
        path: &StreamPath,
        after: Offset,
        incarnation: &str,
        max_bytes: usize,
        timeout: Duration,
    ) -> Result<ReadChunk> {
        self.hub.wait(path, after, incarnation, max_bytes, timeout).await
    }
}

impl RedisStreamBackend {
    pub(crate) fn client(&self) -> &RedisClient {
        &self.client
    }

    pub(crate) fn settings(&self) -> &StreamStoreSettings {
        &self.settings
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_patterns_escape_the_tag_then_the_glob() {
        assert_eq!(meta_pattern(""), "baton:s:{*}:m");
        assert_eq!(meta_pattern("acme/run"), "baton:s:{acme/run*}:m");
        assert_eq!(meta_pattern("g*[?]\\{%}/"), "baton:s:{g\\*\\[\\?\\]\\\\%7B%25%7D/*}:m");
    }

    #[test]
    fn meta_paths_invert_keys() {
        for p in ["acme/run-1", "g*[?]\\{%}/0", "a/%7B/{}%", "é/ü"] {
            let path = StreamPath::new(p).unwrap();
            let (ks, km) = keys(&path);
            assert_eq!(meta_path(km.as_bytes()), Some(path), "{km}");
            assert_eq!(meta_path(ks.as_bytes()), None, "a data key: {ks}");
        }
        assert_eq!(meta_path(b"baton:s:deadlines:{3}"), None);
        assert_eq!(meta_path(b"baton:s:{a%7Xb}:m"), None, "not an escape of keys()");
        assert_eq!(meta_path(b"baton:s:{a{b}:m"), None, "a raw brace");
        assert_eq!(meta_path(b"baton:s:{}:m"), None, "not a valid path");
    }
}
