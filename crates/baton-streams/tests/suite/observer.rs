//! The write observer (`StreamStore::set_observer`) and the listing of streams
//! (`StreamStore::list`).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use super::*;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Event {
    Appended(String, String),
    Deleted(String),
}

fn appended(p: &StreamPath, token: String) -> Event {
    Event::Appended(p.to_string(), token)
}

/// Records what it is told.
#[derive(Default)]
struct Recorder(Mutex<Vec<Event>>);

impl Recorder {
    /// What it was told since the last call.
    fn take(&self) -> Vec<Event> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

#[async_trait::async_trait]
impl StreamObserver for Recorder {
    async fn appended(&self, path: &StreamPath, tail: &str) {
        self.0.lock().unwrap().push(Event::Appended(path.to_string(), tail.to_string()));
    }
    async fn deleted(&self, path: &StreamPath) {
        self.0.lock().unwrap().push(Event::Deleted(path.to_string()));
    }
}

fn opts(ct: &str) -> CreateOptions {
    CreateOptions { content_type: Some(ct.into()), ..Default::default() }
}

fn body(ct: &str, data: &str) -> AppendRequest {
    AppendRequest { data: Bytes::from(data.to_string()), content_type: Some(ct.into()), ..Default::default() }
}

/// The observer is told of each committed create (with a body), append and close, with the tail
/// token a client sees in `Stream-Next-Offset`, before the call returns, and of each delete; it is
/// told nothing of producer duplicates, refused writes, or writes that changed nothing. It is
/// shared by clones made before it was installed.
pub async fn observer_sees_committed_writes(b: &TestBackend) {
    let s = store(b, settings()).await;
    let earlier_clone = s.clone();
    let rec = Arc::new(Recorder::default());
    s.set_observer(rec.clone());
    let ct = "text/plain";
    let p = path("obs");

    // Create with a body, through a clone made before the observer was installed.
    let create = CreateOptions { initial: Some("a".into()), ..opts(ct) };
    let c = earlier_clone.create(&p, create.clone()).await.unwrap();
    assert!(c.created);
    assert_ne!(c.info.tail, Offset::ZERO);
    let token = c.info.tail.token(&c.info.incarnation);
    assert_eq!(token.split('_').count(), 3, "a tagged token: {token}");
    assert_eq!(rec.take(), vec![appended(&p, token)]);
    // An identical re-create writes nothing.
    assert!(!s.create(&p, create).await.unwrap().created);
    assert_eq!(rec.take(), vec![]);

    // A plain append (the Redis fast path).
    let a = s.append(&p, body(ct, "b")).await.unwrap();
    assert_eq!(rec.take(), vec![appended(&p, a.tail.token(&a.incarnation))]);
    // A general-path append (Stream-Seq).
    let a = s.append(&p, AppendRequest { stream_seq: Some("1".into()), ..body(ct, "c") }).await.unwrap();
    assert_eq!(rec.take(), vec![appended(&p, a.tail.token(&a.incarnation))]);

    // A producer append, then its duplicate: observed once.
    let stamped =
        |seq| AppendRequest { producer: Some(ProducerStamp { id: "P".into(), epoch: 0, seq }), ..body(ct, "d") };
    let a = s.append(&p, stamped(0)).await.unwrap();
    assert!(!a.duplicate);
    assert_eq!(rec.take(), vec![appended(&p, a.tail.token(&a.incarnation))]);
    let dup = s.append(&p, stamped(0)).await.unwrap();
    assert!(dup.duplicate);
    assert_eq!(rec.take(), vec![]);

    // Refused writes: content-type conflict, sequence gap, unknown stream.
    assert!(matches!(s.append(&p, body("application/json", "1")).await, Err(StreamError::Conflict { .. })));
    assert!(matches!(s.append(&p, stamped(5)).await, Err(StreamError::SequenceGap { .. })));
    assert!(matches!(s.append(&path("obs-none"), body(ct, "x")).await, Err(StreamError::NotFound { .. })));
    assert_eq!(rec.take(), vec![]);

    // Close: observed with the final tail; a second close changes nothing; appends are refused.
    let a = s.close(&p, EndReason::Finished).await.unwrap();
    assert!(a.ended_now);
    assert_eq!(rec.take(), vec![appended(&p, a.tail.token(&a.incarnation))]);
    assert!(!s.close(&p, EndReason::Finished).await.unwrap().ended_now);
    assert!(matches!(s.append(&p, body(ct, "e")).await, Err(StreamError::Closed { .. })));
    assert_eq!(rec.take(), vec![]);

    // Append-and-close in one write.
    let q = path("obs-append-close");
    let c = s.create(&q, opts(ct)).await.unwrap();
    assert_eq!(rec.take(), vec![appended(&q, Offset::ZERO.token(&c.info.incarnation))]);
    let a = s.append(&q, AppendRequest { close: Some(EndReason::Finished), ..body(ct, "last") }).await.unwrap();
    assert!(a.ended_now);
    assert_eq!(rec.take(), vec![appended(&q, a.tail.token(&a.incarnation))]);

    // Delete; a refused delete is not observed.
    s.delete(&p).await.unwrap();
    assert_eq!(rec.take(), vec![Event::Deleted(p.to_string())]);
    assert!(matches!(s.delete(&p).await, Err(StreamError::NotFound { .. })));
    assert_eq!(rec.take(), vec![]);

    // A replaced observer: the old one is told nothing more.
    let second = Arc::new(Recorder::default());
    earlier_clone.set_observer(second.clone());
    s.delete(&q).await.unwrap();
    assert_eq!(rec.take(), vec![]);
    assert_eq!(second.take(), vec![Event::Deleted(q.to_string())]);
}

/// Forks, soft deletes, and the run paths (`open`, `Producer`, `spawn`) are observed too.
pub async fn observer_sees_forks_and_runs(b: &TestBackend) {
    let s = store(b, settings()).await;
    let rec = Arc::new(Recorder::default());
    s.set_observer(rec.clone());
    let ct = "text/plain";

    // A fork: observed at its path with its own tail token; the source's soft delete too.
    let src = path("obs-src");
    s.create(&src, CreateOptions { initial: Some("x".into()), ..opts(ct) }).await.unwrap();
    rec.take();
    let f = path("obs-fork");
    let fork = ForkFrom { source: src.clone(), offset: None, sub_offset: 0 };
    let c = s.create(&f, CreateOptions { fork: Some(fork), ..opts(ct) }).await.unwrap();
    assert!(c.created);
    assert_eq!(rec.take(), vec![appended(&f, c.info.tail.token(&c.info.incarnation))]);
    s.delete(&src).await.unwrap(); // soft: the fork references it
    assert!(matches!(s.head(&src).await, Err(StreamError::Gone { .. })));
    assert_eq!(rec.take(), vec![Event::Deleted(src.to_string())]);
    s.delete(&f).await.unwrap(); // collects the source as well, unobserved
    assert_eq!(rec.take(), vec![Event::Deleted(f.to_string())]);

    // A run: open (creates), append, finish.
    let r = path("obs-run");
    let run_opts = OpenOptions { content_type: Some(ct.into()), ..Default::default() };
    let producer = s.open(&r, run_opts.clone()).await.unwrap();
    let info = s.head(&r).await.unwrap();
    let inc = info.incarnation.clone();
    assert_eq!(rec.take(), vec![appended(&r, info.tail.token(&inc))]);
    let at = producer.append("1").await.unwrap();
    assert_eq!(rec.take(), vec![appended(&r, at.token(&inc))]);
    assert!(producer.finish().await.unwrap().ended_now);
    let end = s.head(&r).await.unwrap().tail;
    assert_eq!(rec.take(), vec![appended(&r, end.token(&inc))]);
    // Re-opening the ended run writes nothing.
    let _ = s.open(&r, run_opts.clone()).await;
    assert_eq!(rec.take(), vec![]);

    // A spawned run: create, one append, finish.
    let g = path("obs-spawn");
    let ended =
        s.spawn(g.clone(), run_opts, |p| async move { p.append("only").await.map(|_| ()) }).join().await.unwrap();
    assert!(ended.ended_now);
    let events = rec.take();
    assert_eq!(events.len(), 3, "{events:?}");
    let inc = s.head(&g).await.unwrap().incarnation;
    assert_eq!(events[2], appended(&g, ended.end.final_offset.token(&inc)));
    assert!(events.iter().all(|e| matches!(e, Event::Appended(p, _) if *p == g.to_string())));
}

/// `list`: 25 streams under several prefixes (glob metacharacters and the escaped `%{}` included);
/// the prefix filter is an exact string prefix, deleted (hard and soft) and expired streams are
/// absent, `limit` is honoured. In Cluster the streams are on every master and all are found.
pub async fn list_streams_by_prefix(b: &TestBackend) {
    let s = store(b, settings()).await;
    let special = "g*[?]\\{%}/";
    let mut names: Vec<String> = Vec::new();
    names.extend((0..10).map(|i| format!("alpha/{i}")));
    names.extend((0..4).map(|i| format!("alphabet/{i}")));
    names.extend((0..8).map(|i| format!("beta/{i}")));
    names.extend((0..2).map(|i| format!("{special}{i}")));
    names.push("gx[?]\\{%}/decoy".to_string()); // matches the special prefix only if `*` were a glob
    assert_eq!(names.len(), 25);
    let paths: Vec<StreamPath> = names.iter().map(|n| StreamPath::new(n).unwrap()).collect();
    futures::future::try_join_all(paths.iter().map(|p| s.create(p, opts("text/plain")))).await.unwrap();
    let set = |v: Vec<StreamPath>| {
        let n = v.len();
        let set: BTreeSet<String> = v.into_iter().map(|p| p.to_string()).collect();
        assert_eq!(set.len(), n, "each path once");
        set
    };
    let under = |prefix: &str| names.iter().filter(|n| n.starts_with(prefix)).cloned().collect::<BTreeSet<_>>();

    assert_eq!(set(s.list("", 100).await.unwrap()), under(""));
    assert_eq!(set(s.list("alpha/", 100).await.unwrap()), under("alpha/"));
    assert_eq!(set(s.list("alpha", 100).await.unwrap()).len(), 14);
    assert_eq!(set(s.list("beta/", 100).await.unwrap()), under("beta/"));
    assert_eq!(set(s.list(special, 100).await.unwrap()), under(special));
    assert_eq!(set(s.list(special, 100).await.unwrap()).len(), 2);
    assert_eq!(s.list("gamma/", 100).await.unwrap(), vec![]);
    assert_eq!(s.list("alpha/1", 100).await.unwrap(), vec![StreamPath::new("alpha/1").unwrap()]);

    // Limits.
    assert_eq!(s.list("", 0).await.unwrap(), vec![]);
    let five = set(s.list("", 5).await.unwrap());
    assert_eq!(five.len(), 5);
    assert!(five.is_subset(&under("")));
    let three = set(s.list("beta/", 3).await.unwrap());
    assert_eq!(three.len(), 3);
    assert!(three.is_subset(&under("beta/")));

    if let TestBackend::Cluster(_) = b {
        // The streams are spread over all three masters.
        for port in ports(b) {
            let out = Command::new("redis-cli")
                .args(["-p", &port.to_string(), "--scan", "--pattern", "baton:s:{*}:m"])
                .output()
                .unwrap();
            let keys = String::from_utf8_lossy(&out.stdout).lines().count();
            assert!(keys > 0, "master {port} holds no stream");
        }
    }

    // Deleted (hard and soft) and expired streams are not listed.
    let fork = StreamPath::new("fork/of-beta-0").unwrap();
    let from = ForkFrom { source: paths[14].clone(), offset: None, sub_offset: 0 };
    assert_eq!(paths[14].as_str(), "beta/0");
    s.create(&fork, CreateOptions { fork: Some(from), ..Default::default() }).await.unwrap();
    s.delete(&paths[14]).await.unwrap(); // soft
    assert!(matches!(s.head(&paths[14]).await, Err(StreamError::Gone { .. })));
    s.delete(&paths[0]).await.unwrap();
    s.delete(&paths[1]).await.unwrap();
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    let short = StreamPath::new("alpha/short-lived").unwrap();
    s.create(&short, CreateOptions { expiry: Expiry::At(now + 300), ..opts("text/plain") }).await.unwrap();
    assert!(s.list("alpha/", 100).await.unwrap().contains(&short));
    tokio::time::sleep(Duration::from_millis(400)).await;

    let mut left = under("");
    left.remove("beta/0");
    left.remove("alpha/0");
    left.remove("alpha/1");
    left.insert(fork.to_string());
    assert_eq!(set(s.list("", 100).await.unwrap()), left);
    assert_eq!(set(s.list("beta/", 100).await.unwrap()).len(), 7);
    assert_eq!(set(s.list("alpha/", 100).await.unwrap()).len(), 8);
}

/// `list_page`: pages in path order after a cursor, through the caller's filter, each stream's
/// metadata as `head` gives it; soft-deleted and deleted streams left out; the last page says so.
/// In Cluster the paths come from every master and are still in one order.
pub async fn list_pages_in_path_order(b: &TestBackend) {
    let s = store(b, settings()).await;
    let mut names: Vec<String> = (0..12).map(|i| format!("acme/run-{i:02}")).collect();
    names.extend((0..5).map(|i| format!("beta/{i}")));
    names.push("acmeco/x".into());
    let paths: Vec<StreamPath> = names.iter().map(|n| StreamPath::new(n).unwrap()).collect();
    futures::future::try_join_all(paths.iter().map(|p| s.create(p, opts("text/plain")))).await.unwrap();
    let json = StreamPath::new("acme/run-03").unwrap();
    s.delete(&json).await.unwrap();
    s.create(&json, opts("application/json")).await.unwrap();
    let arr = AppendRequest {
        data: Bytes::from("[1,2,3]"),
        content_type: Some("application/json".into()),
        ..Default::default()
    };
    s.append(&json, arr).await.unwrap();
    let ended = StreamPath::new("acme/run-05").unwrap();
    s.close(&ended, EndReason::Cancelled).await.unwrap();
    // A soft-deleted source (a fork holds it) and a hard-deleted stream are not listed.
    let fork = StreamPath::new("beta/fork").unwrap();
    let from = ForkFrom { source: StreamPath::new("beta/1").unwrap(), offset: None, sub_offset: 0 };
    s.create(&fork, CreateOptions { fork: Some(from), ..Default::default() }).await.unwrap();
    s.delete(&StreamPath::new("beta/1").unwrap()).await.unwrap();
    s.delete(&StreamPath::new("beta/2").unwrap()).await.unwrap();

    let all = |_: &StreamPath| true;
    let mut seen = Vec::new();
    let mut after: Option<StreamPath> = None;
    let mut pages = 0;
    loop {
        let page = s.list_page("acme/", after.as_ref(), 5, &all).await.unwrap();
        pages += 1;
        assert!(page.streams.len() <= 5);
        seen.extend(page.streams.iter().map(|i| i.path.to_string()));
        match page.next {
            Some(n) => {
                assert_eq!(page.streams.last().map(|i| &i.path), Some(&n), "the cursor is the page's last path");
                after = Some(n)
            }
            None => break,
        }
    }
    let want: Vec<String> = (0..12).map(|i| format!("acme/run-{i:02}")).collect();
    assert_eq!(seen, want);
    assert_eq!(pages, 3, "5 + 5 + 2");

    // The facts of each stream.
    let page = s.list_page("acme/run-0", None, 100, &all).await.unwrap();
    assert_eq!(page.next, None);
    assert_eq!(page.streams.len(), 10);
    let j = &page.streams[3];
    assert_eq!((j.path.as_str(), j.content_type.as_str(), j.len, j.end), ("acme/run-03", "application/json", 3, None));
    assert_eq!(j.tail, s.head(&json).await.unwrap().tail);
    assert_eq!(j.incarnation, s.head(&json).await.unwrap().incarnation);
    let e = &page.streams[5];
    assert_eq!(e.path, ended);
    assert_eq!(e.end.map(|e| e.reason), Some(EndReason::Cancelled));
    assert!(e.ended_at.is_some());
    assert_eq!(page.streams[0].content_type, "text/plain");
    assert_eq!(page.streams[0].end, None);

    // A filter (e.g. what a token may read) and a prefix spanning scopes.
    let not_acme = |p: &StreamPath| !p.as_str().starts_with("acme/");
    let page = s.list_page("", None, 100, &not_acme).await.unwrap();
    let got: Vec<&str> = page.streams.iter().map(|i| i.path.as_str()).collect();
    assert_eq!(got, ["acmeco/x", "beta/0", "beta/3", "beta/4", "beta/fork"]);
    let page = s.list_page("", None, 2, &not_acme).await.unwrap();
    assert_eq!(page.next, Some(StreamPath::new("beta/0").unwrap()));
    let page = s.list_page("", page.next.as_ref(), 2, &not_acme).await.unwrap();
    let got: Vec<&str> = page.streams.iter().map(|i| i.path.as_str()).collect();
    assert_eq!(got, ["beta/3", "beta/4"]);
    let page = s.list_page("", page.next.as_ref(), 2, &not_acme).await.unwrap();
    assert_eq!((page.streams.len(), page.next), (1, None));

    // Past the end; no match; a zero limit.
    let page = s.list_page("acme/", Some(&StreamPath::new("acme/z").unwrap()), 10, &all).await.unwrap();
    assert!(page.streams.is_empty() && page.next.is_none());
    assert!(s.list_page("nobody/", None, 10, &all).await.unwrap().streams.is_empty());
    assert!(matches!(s.list_page("", None, 0, &all).await, Err(StreamError::InvalidRequest { .. })));
}

/// `list_page` runs the caller's filter with no lock of the store held: a create on another
/// thread completes while the filter waits for it (a slow filter over many streams, e.g. a
/// token's scopes, must not stall every other stream operation of the process).
pub async fn list_page_filter_holds_no_lock(b: &TestBackend) {
    let s = store(b, settings()).await;
    for i in 0..3 {
        s.create(&StreamPath::new(format!("lk/{i}")).unwrap(), opts("text/plain")).await.unwrap();
    }
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = Mutex::new(rx);
    let other = s.clone();
    let rt = tokio::runtime::Handle::current();
    let waited: Arc<Mutex<Option<bool>>> = Arc::new(Mutex::new(None));
    let w = waited.clone();
    let keep = move |_: &StreamPath| {
        let mut w = w.lock().unwrap();
        if w.is_none() {
            let (other, tx, rt) = (other.clone(), tx.clone(), rt.clone());
            std::thread::spawn(move || {
                rt.block_on(other.create(&StreamPath::new("lk/other").unwrap(), opts("text/plain"))).unwrap();
                let _ = tx.send(());
            });
            *w = Some(rx.lock().unwrap().recv_timeout(std::time::Duration::from_secs(5)).is_ok());
        }
        true
    };
    let page = s.list_page("lk/", None, 10, &keep).await.unwrap();
    assert_eq!(*waited.lock().unwrap(), Some(true), "the create waited for the listing's filter");
    let got: Vec<&str> = page.streams.iter().map(|i| i.path.as_str()).collect();
    assert!(got.starts_with(&["lk/0", "lk/1", "lk/2"]), "{got:?}");
    let all = |_: &StreamPath| true;
    let page = s.list_page("lk/", None, 10, &all).await.unwrap();
    let got: Vec<&str> = page.streams.iter().map(|i| i.path.as_str()).collect();
    assert_eq!(got, ["lk/0", "lk/1", "lk/2", "lk/other"]);
}
