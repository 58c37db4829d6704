//! Coalesced state reads of the Redis store: the reads that concurrent tasks start within one
//! scheduler turn (a worker dispatching a read batch of messages, waiters starting together)
//! become one `MGET` per home queue, sent together. Keys of one home queue share its
//! hash slot (see the crate docs), so each `MGET` is valid on Redis Cluster too.
//!
//! The flush runs in its own task, so a caller that gives up waiting never strands the others.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use baton_redis::redis::{self, RedisError};
use baton_redis::RedisConn;
use tokio::sync::oneshot;

type Reply = Result<Option<Vec<u8>>, (redis::ErrorKind, String)>;

struct Pending {
    /// Home queue → (state key, reply) in arrival order.
    by_queue: HashMap<String, Vec<(String, oneshot::Sender<Reply>)>>,
    /// A flush task is scheduled and has not taken the reads yet.
    scheduled: bool,
}

/// See the module docs.
pub(crate) struct ReadBatcher {
    conn: RedisConn,
    pending: Arc<Mutex<Pending>>,
}

impl ReadBatcher {
    pub fn new(conn: RedisConn) -> Self {
        Self { conn, pending: Arc::new(Mutex::new(Pending { by_queue: HashMap::new(), scheduled: false })) }
    }

    /// `GET key` (a state key of home queue `queue`), batched with the reads started around it.
    /// Errors: the Redis error of the batch's pipeline.
    pub async fn get(&self, queue: &str, key: String) -> Result<Option<Vec<u8>>, RedisError> {
        let (tx, rx) = oneshot::channel();
        let spawn = {
            let mut p = self.pending.lock().unwrap();
            p.by_queue.entry(queue.to_string()).or_default().push((key, tx));
            !std::mem::replace(&mut p.scheduled, true)
        };
        if spawn {
            tokio::spawn(flush(self.conn.clone(), self.pending.clone()));
        }
        match rx.await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err((kind, detail))) => Err(RedisError::from((kind, "batched state read failed", detail))),
            Err(_) => Err(RedisError::from((redis::ErrorKind::Io, "batched state read dropped"))),
        }
    }
}

async fn flush(conn: RedisConn, pending: Arc<Mutex<Pending>>) {
    // Let the tasks woken with this one start their reads first.
    tokio::task::yield_now().await;
    let groups: Vec<Vec<(String, oneshot::Sender<Reply>)>> = {
        let mut p = pending.lock().unwrap();
        p.scheduled = false;
        p.by_queue.drain().map(|(_, v)| v).collect()
    };
    // One request per queue (a Cluster pipeline may not cross slots); sent together.
    let sends = groups.into_iter().map(|g| {
        let mut conn = conn.clone();
        async move {
            let mut mget = redis::cmd("MGET");
            for (key, _) in &g {
                mget.arg(key);
            }
            match mget.query_async::<Vec<Option<Vec<u8>>>>(&mut conn).await {
                Ok(values) => {
                    for ((_, tx), v) in g.into_iter().zip(values) {
                        let _ = tx.send(Ok(v));
                    }
                }
                Err(e) => {
                    let (kind, detail) = (e.kind(), e.to_string());
                    for (_, tx) in g {
                        let _ = tx.send(Err((kind, detail.clone())));
                    }
                }
            }
        }
    });
    futures::future::join_all(sends).await;
}
