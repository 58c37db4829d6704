//! `RedisConn::scan_match` (`KeyScan`) on a standalone server and a 3-master Cluster: every
//! matching key is found, other keys are not, across many pages (a small `COUNT`, so each cursor,
//! in Cluster each master's, is continued several times).

use std::collections::BTreeSet;

use baton_redis::{redis, RedisClient, RedisConfig};
use baton_testkit::{require_redis, RedisCluster, RedisServer};

async fn scan_finds_every_match(config: RedisConfig) {
    let mut conn = RedisClient::new(config).unwrap().shared().await.unwrap();
    let mut want = BTreeSet::new();
    for i in 0..300 {
        // Each key its own slot (no hash tag), so spread over the masters of a Cluster.
        let key = format!("scan:*[k]:{i}");
        let _: () = redis::cmd("SET").arg(&key).arg(1).query_async(&mut conn).await.unwrap();
        want.insert(key);
        let _: () = redis::cmd("SET").arg(format!("other:{i}")).arg(1).query_async(&mut conn).await.unwrap();
        let _: () = redis::cmd("SET").arg(format!("scan:x[k]:{i}")).arg(1).query_async(&mut conn).await.unwrap();
    }
    let mut scan = conn.scan_match("scan:\\*\\[k\\]:*", 10);
    let (mut got, mut pages) = (BTreeSet::new(), 0);
    while let Some(page) = scan.next_page().await.unwrap() {
        pages += 1;
        got.extend(page.into_iter().map(|k| String::from_utf8(k).unwrap()));
    }
    assert_eq!(got, want);
    assert!(pages > 5, "{pages} pages");
    assert_eq!(scan.next_page().await.unwrap(), None, "done stays done");
}

#[tokio::test]
async fn standalone() {
    require_redis();
    let server = RedisServer::start();
    scan_finds_every_match(server.config()).await;
}

#[tokio::test]
async fn cluster() {
    require_redis();
    let cluster = RedisCluster::start();
    scan_finds_every_match(cluster.config()).await;
}
