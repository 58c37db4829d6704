//! A command handler's `CommandResult::RateLimited`: the queue backs off (no command of the
//! queue starts meanwhile), the call is made again after it, and it counts as neither an attempt
//! nor an error. Memory, Redis standalone and Cluster.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_commands::{Command, CommandResult, CommandService, CommandStatus, QueueSettings};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;

baton_testkit::on_every_backend!(rate_limited_execute_backs_off_the_queue_and_is_not_an_attempt);

async fn rate_limited_execute_backs_off_the_queue_and_is_not_an_attempt(b: TestBackend) {
    let store = store_for(&b).await;
    let q = queue_name("cmd-rate-limited");
    let starts: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let answered: Arc<Mutex<Option<Instant>>> = Arc::default();
    let handler = {
        let (starts, answered) = (starts.clone(), answered.clone());
        on_execute(move |c: Command| {
            let (starts, answered) = (starts.clone(), answered.clone());
            async move {
                let name = c.params.get().trim_matches('"').to_string();
                starts.lock().unwrap().push((name.clone(), Instant::now()));
                let mut a = answered.lock().unwrap();
                if name == "a" && a.is_none() {
                    *a = Some(Instant::now());
                    return Ok(CommandResult::rate_limited(Duration::from_secs(1)));
                }
                Ok(CommandResult::succeeded(c.params))
            }
        })
    };
    let settings = QueueSettings { concurrency: 1, poll_interval: Some(Duration::from_millis(100)), ..fast() };
    let svc =
        CommandService::builder(store.clone(), &q).settings(settings).handler("t", handler).start().await.unwrap();
    let a = svc.submit(Command::new("t", json!("a"))).await.unwrap().id;
    // Submitted once `a` was answered, so that they wait in the queue behind the back-off.
    eventually(Duration::from_secs(10), || {
        let done = answered.lock().unwrap().is_some();
        async move { done.then_some(()) }
    })
    .await
    .expect("a ran");
    let b_id = svc.submit(Command::new("t", json!("b"))).await.unwrap().id;
    let c_id = svc.submit(Command::new("t", json!("c"))).await.unwrap().id;
    for id in [&a, &b_id, &c_id] {
        let st = store.wait(id, Duration::from_secs(15)).await.unwrap();
        assert_eq!(st.status, CommandStatus::Succeeded, "{id}");
        assert_eq!((st.attempts, st.errors_count), (1, 0), "{id}: a rate limited call is not an attempt");
    }
    let t = answered.lock().unwrap().unwrap();
    let starts = starts.lock().unwrap().clone();
    assert_eq!(starts.iter().filter(|(n, _)| n == "a").count(), 2, "{starts:?}");
    for (n, at) in &starts[1..] {
        assert!(*at >= t + Duration::from_millis(950), "{n} started {:?} after the 1 s back-off began", *at - t);
    }
    svc.close().await;
}
