//! A real lost reply (standalone Redis behind a TCP proxy): the append reaches Redis and runs,
//! the connection is cut before the reply comes back, and the retry with the same producer
//! sequence writes nothing more.

use std::time::Duration;

use baton_redis::{redis, RedisClient, RedisConfig};
use baton_streams::*;
use baton_testkit::{RedisServer, TcpProxy};
use bytes::Bytes;

/// Keeps Redis busy for `ms` (a script spinning on TIME), so requests sent meanwhile wait in
/// their sockets, unanswered.
async fn busy(conn: &mut baton_redis::RedisConn, ms: u64) {
    let spin = "local s = redis.call('TIME') \
        while true do local t = redis.call('TIME') \
        if (t[1] - s[1]) * 1000000 + (t[2] - s[2]) > tonumber(ARGV[1]) * 1000 then return 1 end end";
    let _: i64 = redis::cmd("EVAL").arg(spin).arg(0).arg(ms).query_async(conn).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_reply_on_append_writes_once() {
    baton_testkit::require_redis();
    let server = RedisServer::start();
    let proxy = TcpProxy::start(format!("127.0.0.1:{}", server.port()).parse().unwrap()).await;
    let settings = StreamStoreSettings { default_limits: RunLimits::unlimited(), ..StreamStoreSettings::default() };
    let store =
        StreamStore::redis(RedisConfig::standalone(format!("redis://{}", proxy.addr())), settings).await.unwrap();
    let direct = RedisClient::new(server.config()).unwrap().shared().await.unwrap();
    let p = StreamPath::new("t/lost-reply").unwrap();
    let ct = Some("text/plain".to_string());
    store.create(&p, CreateOptions { content_type: ct.clone(), ..Default::default() }).await.unwrap();
    // Scripts loaded (a first EVALSHA would answer NOSCRIPT and never write).
    let warm = StreamPath::new("t/warm-up").unwrap();
    store.create(&warm, CreateOptions { content_type: ct.clone(), ..Default::default() }).await.unwrap();
    store
        .append(&warm, AppendRequest { data: Bytes::from("w"), content_type: ct.clone(), ..Default::default() })
        .await
        .unwrap();

    // 1. Explicit producer stamps (as an HTTP client sends them).
    let req = AppendRequest {
        data: Bytes::from("once"),
        content_type: ct.clone(),
        producer: Some(ProducerStamp { id: "P".into(), epoch: 0, seq: 0 }),
        ..Default::default()
    };
    let mut d = direct.clone();
    let hold = tokio::spawn(async move { busy(&mut d, 600).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (s, p2, r2) = (store.clone(), p.clone(), req.clone());
    let first = tokio::spawn(async move { s.append(&p2, r2).await });
    tokio::time::sleep(Duration::from_millis(150)).await; // the request is in Redis's socket buffer
    proxy.drop_connections();
    let first = first.await.unwrap();
    assert!(matches!(first, Err(StreamError::Backend(_))), "{first:?}");
    hold.await.unwrap();
    // The request ran after all (Redis gets to the closed connection's last request shortly
    // after the busy script): its reply was lost, not the write.
    let mut d = direct.clone();
    let key = "baton:s:{t/lost-reply}";
    let mut len = 0u64;
    for _ in 0..100 {
        len = redis::cmd("XLEN").arg(key).query_async(&mut d).await.unwrap();
        if len > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(len, 1);
    let again = loop {
        match store.append(&p, req.clone()).await {
            Err(StreamError::Backend(_)) => tokio::time::sleep(Duration::from_millis(50)).await, // reconnecting
            other => break other.unwrap(),
        }
    };
    let chunk = store.read(&p, ReadFrom::Start).await.unwrap();
    assert_eq!(chunk.records.len(), 1);
    assert_eq!(chunk.body(), Bytes::from("once"));
    assert_eq!(
        (again.duplicate, again.producer, again.producer_offset),
        (true, Some((0, 0)), Some(chunk.records[0].offset))
    );
    let len: u64 = redis::cmd("XLEN").arg(key).query_async(&mut d).await.unwrap();
    assert_eq!(len, 1);

    // 2. A Producer retries by itself with the same sequence: the caller sees one success.
    let q = StreamPath::new("t/lost-reply-run").unwrap();
    let producer = store.open(&q, OpenOptions { content_type: ct.clone(), ..Default::default() }).await.unwrap();
    let mut d2 = direct.clone();
    let hold = tokio::spawn(async move { busy(&mut d2, 600).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let pr = producer.clone();
    let appended = tokio::spawn(async move { pr.append("only").await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    proxy.drop_connections();
    hold.await.unwrap();
    let off = appended.await.unwrap().unwrap();
    let chunk = store.read(&q, ReadFrom::Start).await.unwrap();
    assert_eq!(
        chunk.records.iter().map(|r| (r.offset, r.data.clone())).collect::<Vec<_>>(),
        vec![(off, Bytes::from("only"))]
    );
    assert!(producer.append("next").await.unwrap() > off);
    assert_eq!(store.read(&q, ReadFrom::Start).await.unwrap().body(), Bytes::from("onlynext"));
}
