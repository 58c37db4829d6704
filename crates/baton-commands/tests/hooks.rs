//! Completion hooks (`CommandStore::set_hook`): one delivery message per terminal transition of
//! a hooked queue's commands, with the exact body, on the store's delivery queue under the home
//! queue's name; none for statuses the hook leaves out, none for queues without a hook; a
//! re-run's second end has its own; a command handed off to another queue (another slot, or
//! the same slot: the single-transition script) gets its message on its home queue's. On memory,
//! Redis standalone and Cluster.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use baton_commands::{
    Command, CommandResult, CommandService, CommandState, CommandStatus, CommandStore, CompletionHook,
};
use baton_queue::{ConsumerOptions, Decision, Delivery};
use baton_testkit::TestBackend;
use common::*;
use serde_json::json;
use tokio::sync::mpsc;

baton_testkit::on_every_backend!(
    one_message_per_terminal_transition,
    a_handed_off_command_s_end_is_hooked_on_its_home_queue,
);

/// The exact hook body of terminal state `st` (crate docs of `hooks`).
fn expected(st: &CommandState) -> String {
    let t = |v: &Option<baton_commands::Timestamp>| serde_json::to_string(v).unwrap();
    format!(
        r#"{{"delivery_id":"{id}:{v}","event":"{ev}","id":"{id}","queue":"{q}","type":"{ty}","status":"{s}","result":{r},"error":{e},"attempts":{a},"version":{v},"created_at":{c},"started_at":{b},"completed_at":{d}}}"#,
        id = st.id,
        v = st.version,
        ev = st.status.as_str().to_ascii_lowercase(),
        q = st.queue,
        ty = st.command_type,
        s = st.status.as_str(),
        r = st.result.as_ref().map_or("null".to_string(), |r| r.get().to_string()),
        e = serde_json::to_string(&st.error).unwrap(),
        a = st.attempts,
        c = t(&Some(st.created_at)),
        b = t(&st.started_at),
        d = t(&st.completed_at),
    )
}

/// Every hook message of `queue` from now on, acked as read.
async fn collect(store: &CommandStore, queue: &str) -> (baton_queue::Consumer, mpsc::UnboundedReceiver<String>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let c = store
        .hooks()
        .await
        .unwrap()
        .consume(
            queue,
            move |d: Delivery| {
                let tx = tx.clone();
                async move {
                    let _ = tx.send(String::from_utf8(d.payload.to_vec()).unwrap());
                    Decision::Ack
                }
            },
            ConsumerOptions::new().with_claim_timeout(Duration::from_secs(2)),
        )
        .await
        .unwrap();
    (c, rx)
}

async fn next(rx: &mut mpsc::UnboundedReceiver<String>, within: Duration) -> Option<String> {
    tokio::time::timeout(within, rx.recv()).await.ok().flatten()
}

async fn one_message_per_terminal_transition(b: TestBackend) {
    let store = store_for(&b).await;
    let (hooked, only_ok, plain) = (queue_name("hooked"), queue_name("only-ok"), queue_name("plain"));
    store.set_hook(&hooked, Some(CompletionHook::default())).unwrap();
    store.set_hook(&only_ok, Some(CompletionHook { statuses: BTreeSet::from([CommandStatus::Succeeded]) })).unwrap();
    let e = store
        .set_hook(&plain, Some(CompletionHook { statuses: BTreeSet::from([CommandStatus::Running]) }))
        .unwrap_err();
    assert!(e.to_string().contains("SUCCEEDED, FAILED, CANCELLED"), "{e}");
    let mut services = Vec::new();
    for q in [&hooked, &only_ok, &plain] {
        let s = CommandService::builder(store.clone(), q.as_str())
            .settings(fast())
            .handler(
                "run",
                on_execute(|c| async move {
                    Ok(if c.params.get() == "\"fail\"" {
                        CommandResult::failed("it failed")
                    } else {
                        CommandResult::succeeded(json!({"ok": [1, 2]}))
                    })
                }),
            )
            .start()
            .await
            .unwrap();
        services.push(s);
    }
    let (c1, mut rx_hooked) = collect(&store, &hooked).await;
    let (c2, mut rx_ok) = collect(&store, &only_ok).await;
    for q in [&hooked, &only_ok, &plain] {
        store.submit(q, Command::with_id(format!("{q}-ok"), "run", json!("ok"))).await.unwrap();
        store.submit(q, Command::with_id(format!("{q}-fail"), "run", json!("fail"))).await.unwrap();
    }
    let w = Duration::from_secs(10);
    let ok = store.wait(&format!("{hooked}-ok"), w).await.unwrap();
    let failed = store.wait(&format!("{hooked}-fail"), w).await.unwrap();
    let mut got = vec![next(&mut rx_hooked, w).await.unwrap(), next(&mut rx_hooked, w).await.unwrap()];
    got.sort();
    let mut want = vec![expected(&ok), expected(&failed)];
    want.sort();
    assert_eq!(got, want);
    // A re-run's second end: its own message.
    let rerun = store.retry(&failed.id).await.unwrap();
    let again = eventually(w, || async {
        store.get(&failed.id).await.unwrap().filter(|s| s.status.is_terminal() && s.version > rerun.version)
    })
    .await
    .unwrap();
    assert_eq!(next(&mut rx_hooked, w).await.unwrap(), expected(&again));
    assert_ne!(expected(&again), expected(&failed));
    // `only_ok`: the success only.
    let ok2 = store.wait(&format!("{only_ok}-ok"), w).await.unwrap();
    store.wait(&format!("{only_ok}-fail"), w).await.unwrap();
    assert_eq!(next(&mut rx_ok, w).await.unwrap(), expected(&ok2));
    // Nothing more anywhere; nothing at all for the queue without a hook.
    store.wait(&format!("{plain}-ok"), w).await.unwrap();
    store.wait(&format!("{plain}-fail"), w).await.unwrap();
    assert_eq!(next(&mut rx_hooked, Duration::from_millis(500)).await, None);
    assert_eq!(next(&mut rx_ok, Duration::from_millis(100)).await, None);
    assert_eq!(store.hooks().await.unwrap().stats(&plain).await.unwrap().length, 0);
    c1.close().await;
    c2.close().await;
    for s in services {
        s.close().await;
    }
}

/// CRC16/XMODEM mod 16384: the Cluster slot of a hash tag.
fn slot(tag: &str) -> u16 {
    let mut crc: u16 = 0;
    for &b in tag.as_bytes() {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc % 16384
}

async fn a_handed_off_command_s_end_is_hooked_on_its_home_queue(b: TestBackend) {
    let store = store_for(&b).await;
    let home = queue_name("home");
    let same_slot = (0..).map(|i| format!("target-{i}")).find(|m| slot(m) == slot(&home)).unwrap();
    let other_slot = (0..).map(|i| format!("elsewhere-{i}")).find(|m| slot(m) != slot(&home)).unwrap();
    store.set_hook(&home, Some(CompletionHook::default())).unwrap();
    let mut services = Vec::new();
    let h = CommandService::builder(store.clone(), home.as_str())
        .settings(fast())
        .handler(
            "go",
            on_execute(|c| async move {
                let to: String = serde_json::from_str(c.params.get()).unwrap();
                Ok(CommandResult::handed_off(to))
            }),
        )
        .start()
        .await
        .unwrap();
    services.push(h);
    for t in [&same_slot, &other_slot] {
        let s = CommandService::builder(store.clone(), t.as_str())
            .settings(fast())
            .handler(
                "go",
                on_execute(|_| async { Ok(CommandResult::failed("not here")) })
                    .on_check(|_, _| async { Ok(CommandResult::succeeded(json!("checked"))) }),
            )
            .start()
            .await
            .unwrap();
        services.push(s);
    }
    let (c, mut rx) = collect(&store, &home).await;
    let w = Duration::from_secs(10);
    for t in [&same_slot, &other_slot] {
        let id = format!("{t}-cmd");
        store.submit(&home, Command::with_id(id.clone(), "go", json!(t))).await.unwrap();
        let st = store.wait(&id, w).await.unwrap();
        assert_eq!((st.status, st.handed_off_to.as_deref()), (CommandStatus::Succeeded, Some(t.as_str())));
        assert_eq!(next(&mut rx, w).await.unwrap(), expected(&st), "hand-off to {t}");
        assert_eq!(
            store.hooks().await.unwrap().stats(t).await.unwrap().length,
            0,
            "nothing on the target's hook queue"
        );
    }
    assert_eq!(next(&mut rx, Duration::from_millis(500)).await, None);
    c.close().await;
    for s in services {
        s.close().await;
    }
}
