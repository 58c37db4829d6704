//! Group commit of state transitions on Redis: per home queue, at most one `transitions.lua`
//! call is in flight from this store; transitions started meanwhile queue up and go together in
//! the next call (at most [`MAX_BATCH`]), where the script decides each one exactly as it would
//! alone and merges their index, expiry, ack and announcement writes. Under load a call carries
//! many transitions (fewer script calls and Redis commands per command); a lone transition is
//! sent at once. All keys of a batch are in the home queue's hash slot (see the crate docs), so
//! a batch is valid on Redis Cluster.
//!
//! The calls are sent from a spawned task, so a caller that stops waiting never strands the
//! transitions queued behind it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use baton_redis::redis::{self, RedisError, Value};
use baton_redis::{LuaScript, RedisConn};
use tokio::sync::oneshot;

/// Transitions per `transitions.lua` call at most.
const MAX_BATCH: usize = 128;

static TRANSITIONS: LuaScript = LuaScript::new(
    "transitions",
    concat!(include_str!("../../scripts/lib.lua"), include_str!("../../scripts/transitions.lua")),
);

/// One compare-and-set (the arguments of `transitions.lua`, see there).
pub(crate) struct Transition {
    pub state_key: String,
    /// `<version - 1> <OLD STATUS> `.
    pub expected: String,
    /// The new stored state (header and JSON).
    pub value: Vec<u8>,
    pub ttl_ms: u64,
    pub id: String,
    /// KEYS positions (2..=6) of the old and new status indexes.
    pub old_index: usize,
    pub new_index: usize,
    /// Entry id of the delivery to ack on the home queue's stream, or empty.
    pub ack_id: String,
    /// The announcement (terminal writes), or empty.
    pub announce: String,
}

/// The keys shared by a home queue's transitions.
#[derive(Clone)]
pub(crate) struct BatchKeys {
    /// The expiry zset, then the five status indexes.
    pub index: [String; 6],
    /// The home queue's stream.
    pub stream: String,
    pub channel: String,
    pub group: String,
}

type Reply = Result<Value, (redis::ErrorKind, String)>;

#[derive(Default)]
struct Queues {
    /// Home queue → transitions waiting for its in-flight call (present while a call is in
    /// flight or scheduled).
    waiting: HashMap<String, Vec<(Transition, oneshot::Sender<Reply>)>>,
}

/// See the module docs.
pub(crate) struct TransitionBatcher {
    conn: RedisConn,
    queues: Arc<Mutex<Queues>>,
}

impl TransitionBatcher {
    pub fn new(conn: RedisConn) -> Self {
        Self { conn, queues: Arc::new(Mutex::new(Queues::default())) }
    }

    /// Runs `t` (a transition of home queue `home`, whose keys are `keys`) in the next call for
    /// that queue. Returns the script's reply for it: `{'ok', acked}`, `{'missing'}` or
    /// `{'conflict', state}`. Errors: the Redis error of the call that carried it.
    pub async fn run(&self, home: &str, keys: &BatchKeys, t: Transition) -> Result<Value, RedisError> {
        let (tx, rx) = oneshot::channel();
        let lead = {
            let mut q = self.queues.lock().unwrap();
            match q.waiting.get_mut(home) {
                Some(w) => {
                    w.push((t, tx));
                    false
                }
                None => {
                    q.waiting.insert(home.to_string(), vec![(t, tx)]);
                    true
                }
            }
        };
        if lead {
            tokio::spawn(flush(self.conn.clone(), self.queues.clone(), home.to_string(), keys.clone()));
        }
        match rx.await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err((kind, detail))) => Err(RedisError::from((kind, "batched transition failed", detail))),
            Err(_) => Err(RedisError::from((redis::ErrorKind::Io, "batched transition dropped"))),
        }
    }
}

/// Sends the waiting transitions of `home`, batch after batch, until none is left.
async fn flush(mut conn: RedisConn, queues: Arc<Mutex<Queues>>, home: String, keys: BatchKeys) {
    loop {
        let batch = {
            let mut q = queues.lock().unwrap();
            let Some(w) = q.waiting.get_mut(&home) else { return };
            if w.is_empty() {
                q.waiting.remove(&home);
                return;
            }
            if w.len() <= MAX_BATCH {
                std::mem::take(w)
            } else {
                w.drain(..MAX_BATCH).collect::<Vec<_>>()
            }
        };
        send(&mut conn, &keys, batch).await;
    }
}

async fn send(conn: &mut RedisConn, keys: &BatchKeys, batch: Vec<(Transition, oneshot::Sender<Reply>)>) {
    let s = TRANSITIONS.script();
    let n = batch.len();
    let bytes = 256 + batch.iter().map(|(t, _)| t.state_key.len() + t.value.len() + t.expected.len() + t.id.len() + t.announce.len() + 64).sum::<usize>();
    let mut cmd = redis::Cmd::with_capacity(6 + 7 + n * 9, bytes);
    cmd.arg("EVALSHA").arg(s.get_hash()).arg(7 + n);
    for k in &keys.index {
        cmd.arg(k);
    }
    cmd.arg(&keys.stream);
    for (t, _) in &batch {
        cmd.arg(&t.state_key);
    }
    cmd.arg(n).arg(&keys.channel).arg(&keys.group);
    for (t, _) in &batch {
        cmd.arg(&t.expected)
            .arg(&t.value)
            .arg(t.ttl_ms)
            .arg(&t.id)
            .arg(t.old_index)
            .arg(t.new_index)
            .arg(&t.ack_id)
            .arg(&t.announce);
    }
    let r: redis::RedisResult<Value> = match cmd.query_async(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            match s.load_async(conn).await {
                Ok(_) => cmd.query_async(conn).await,
                Err(e) => Err(e),
            }
        }
        r => r,
    };
    match r {
        Ok(Value::Array(replies)) if replies.len() == n => {
            for ((_, tx), v) in batch.into_iter().zip(replies) {
                let _ = tx.send(Ok(v));
            }
        }
        Ok(other) => {
            let detail = format!("transitions: unexpected reply {other:?}");
            for (_, tx) in batch {
                let _ = tx.send(Err((redis::ErrorKind::Parse, detail.clone())));
            }
        }
        Err(e) => {
            let (kind, detail) = (e.kind(), e.to_string());
            for (_, tx) in batch {
                let _ = tx.send(Err((kind, detail.clone())));
            }
        }
    }
}
