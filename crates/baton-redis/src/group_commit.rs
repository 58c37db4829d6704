//! Group commit: per key (a stream, a home queue), at most one call is in flight from this
//! process; items submitted meanwhile wait and go together in the next call. Under load a call
//! carries many items (fewer round trips and scripts per item); a lone item is sent at once.
//!
//! * Order: an item is queued when its [`GroupCommit::submit`] future is first polled, and the
//!   items of a key are committed in queue order (so items submitted in order by one task are
//!   sent in that order, whatever the number in flight; see the last point).
//! * Batches: at most [`GroupCommitOptions::max_items`] items per call, and at most
//!   [`GroupCommitOptions::max_weight`] in total [`Committer::weight`] (a single heavier item
//!   still goes, alone).
//! * Who sends: the first submitter of an idle key sends its call (of its item alone) from its
//!   own task when [`GroupCommitOptions::lead_sends`] is set (no task hop on an idle key); else
//!   a spawned task sends (one task hop), its first call carrying what is queued by the time it
//!   runs. Every later batch is sent from a spawned task. A submitter that stops waiting never
//!   strands the items queued behind it: an abandoned lead call is finished in a spawned task
//!   (dropped outside a runtime, it is dropped, as below).
//! * Failure: a [`Committer`] returns one reply per item (extra replies are ignored). An item
//!   left without one gets [`Abandoned`]: a short reply vector; a committer that panicked (the
//!   items of its call and those queued behind it, which are not sent; in lead mode too, the
//!   panic does not reach the submitter); a run dropped unfinished (runtime shutdown). The key
//!   is then idle again, so later items are sent normally.
//! * Busy: a key stays busy ([`GroupCommit::is_busy`]) from its first item until the reply of
//!   its last call has been handed out, i.e. a little after [`Committer::commit`] returned.
//! * Order across a lost connection is Redis's: a call cut mid-reply may still run after the
//!   next call, sent on a new connection (writers that need order use their own checks, e.g.
//!   producer sequence numbers or compare-and-set).
//!
//! ```
//! use baton_redis::group_commit::{Committer, GroupCommit, GroupCommitOptions};
//!
//! /// Sums each batch of one key; every item gets its batch's size.
//! struct Count;
//! impl Committer<String, u32, usize> for Count {
//!     async fn commit(&mut self, _key: &String, batch: Vec<u32>) -> Vec<usize> {
//!         vec![batch.len(); batch.len()]
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let gc: GroupCommit<String, u32, usize> = GroupCommit::new(GroupCommitOptions::default());
//! let key = "queue-a".to_string();
//! // Three items submitted together: the spawned sender's first call carries all three.
//! let (a, b, c) = tokio::join!(gc.submit(&key, 1, || Count), gc.submit(&key, 2, || Count), gc.submit(&key, 3, || Count));
//! assert_eq!((a.unwrap(), b.unwrap(), c.unwrap()), (3, 3, 3));
//! # }
//! ```

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::sync::oneshot;

/// How batches are formed and sent.
#[derive(Clone, Copy, Debug)]
pub struct GroupCommitOptions {
    /// Items per call at most (≥ 1). Default 128.
    pub max_items: usize,
    /// Total [`Committer::weight`] per call at most (a heavier single item goes alone). Default:
    /// no limit.
    pub max_weight: usize,
    /// The first submitter of an idle key sends the call from its own task. Default `false`
    /// (from a spawned task).
    pub lead_sends: bool,
}

impl Default for GroupCommitOptions {
    fn default() -> Self {
        Self { max_items: 128, max_weight: usize::MAX, lead_sends: false }
    }
}

/// Sends one batch of a key.
pub trait Committer<K, I, R>: Send + 'static {
    /// Commits `batch` (1 to `max_items` items of `key`, in submission order) in one call and
    /// returns one reply per item, in the same order. An item without a reply gets
    /// [`Abandoned`].
    fn commit(&mut self, key: &K, batch: Vec<I>) -> impl Future<Output = Vec<R>> + Send;

    /// The weight of `item` against [`GroupCommitOptions::max_weight`] (e.g. its bytes).
    /// Default 0.
    fn weight(&self, item: &I) -> usize {
        let _ = item;
        0
    }
}

/// An item that got no reply: its call's committer returned too few replies or panicked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the group commit call carrying this write ended without a reply for it")]
pub struct Abandoned;

type Waiter<I, R> = (I, oneshot::Sender<R>);
type Queues<K, I, R> = Arc<Mutex<HashMap<K, VecDeque<Waiter<I, R>>>>>;

/// See the module docs. `K` names the unit of serialisation, `I` an item, `R` its reply.
pub struct GroupCommit<K, I, R> {
    /// Key → items waiting for its in-flight call (a key is present while a call for it is in
    /// flight or about to be sent).
    queues: Queues<K, I, R>,
    options: GroupCommitOptions,
}

impl<K, I, R> GroupCommit<K, I, R>
where
    K: Eq + Hash + Clone + Send + 'static,
    I: Send + 'static,
    R: Send + 'static,
{
    /// A group commit with nothing in flight. Panics if `options.max_items` is 0.
    pub fn new(options: GroupCommitOptions) -> Self {
        assert!(options.max_items >= 1, "GroupCommitOptions::max_items must be at least 1");
        Self { queues: Arc::new(Mutex::new(HashMap::new())), options }
    }

    /// Commits `item` for `key` in the next call for that key and returns its reply.
    /// `committer` is called only when this item starts a call on an idle key; that committer
    /// then sends every batch of the key until its queue is empty. Errors: [`Abandoned`].
    pub async fn submit<C, F>(&self, key: &K, item: I, committer: F) -> Result<R, Abandoned>
    where
        C: Committer<K, I, R>,
        F: FnOnce() -> C,
    {
        let (tx, rx) = oneshot::channel();
        let lead_sends = self.options.lead_sends;
        let lead = {
            let mut queues = lock(&self.queues);
            match queues.get_mut(key) {
                Some(q) => {
                    q.push_back((item, tx));
                    None
                }
                None if lead_sends => {
                    queues.insert(key.clone(), VecDeque::new());
                    Some(Some(vec![(item, tx)]))
                }
                None => {
                    // The spawned task's first call carries what is queued by the time it runs.
                    queues.insert(key.clone(), VecDeque::from([(item, tx)]));
                    Some(None)
                }
            }
        };
        if let Some(first) = lead {
            let run = Run { queues: self.queues.clone(), key: key.clone(), options: self.options, done: false };
            let flush = run.flush(committer(), first, !lead_sends);
            if lead_sends {
                Detached(Some(flush)).await;
            } else {
                tokio::spawn(flush);
            }
        }
        rx.await.map_err(|_| Abandoned)
    }

    /// Commits `items` for `key` together: they are queued at once, in order, so no other
    /// item of the key comes between them, and go in as few calls as the batch limits allow
    /// (one for up to [`GroupCommitOptions::max_items`] items of total weight within
    /// [`GroupCommitOptions::max_weight`]), behind a call already in flight. Calls are sent from
    /// a spawned task (also with [`GroupCommitOptions::lead_sends`]). Returns one reply per item,
    /// in order; `committer` as in [`GroupCommit::submit`]. An empty `items` returns at once.
    pub async fn submit_many<C, F>(&self, key: &K, items: Vec<I>, committer: F) -> Vec<Result<R, Abandoned>>
    where
        C: Committer<K, I, R>,
        F: FnOnce() -> C,
    {
        if items.is_empty() {
            return Vec::new();
        }
        let mut rxs = Vec::with_capacity(items.len());
        let waiters = items.into_iter().map(|item| {
            let (tx, rx) = oneshot::channel();
            rxs.push(rx);
            (item, tx)
        });
        let idle = {
            let mut queues = lock(&self.queues);
            match queues.get_mut(key) {
                Some(q) => {
                    q.extend(waiters);
                    false
                }
                None => {
                    queues.insert(key.clone(), waiters.collect());
                    true
                }
            }
        };
        if idle {
            let run = Run { queues: self.queues.clone(), key: key.clone(), options: self.options, done: false };
            tokio::spawn(run.flush(committer(), None, true));
        }
        let mut out = Vec::with_capacity(rxs.len());
        for rx in rxs {
            out.push(rx.await.map_err(|_| Abandoned));
        }
        out
    }

    /// A call for `key` is in flight (or items of it are queued).
    pub fn is_busy(&self, key: &K) -> bool {
        lock(&self.queues).contains_key(key)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One key's sending run: from the lead item until the key's queue is empty.
struct Run<K: Eq + Hash, I, R> {
    queues: Queues<K, I, R>,
    key: K,
    options: GroupCommitOptions,
    /// The key was left idle: nothing to clean up on drop.
    done: bool,
}

impl<K, I, R> Run<K, I, R>
where
    K: Eq + Hash + Clone + Send + 'static,
    I: Send + 'static,
    R: Send + 'static,
{
    /// Sends `first` (or, if `None`, the first queued batch), then the batches queued meanwhile.
    /// Unless `looping`, only the first batch is sent here and the rest is handed to a spawned
    /// task.
    fn flush<C: Committer<K, I, R>>(
        mut self,
        mut committer: C,
        first: Option<Vec<Waiter<I, R>>>,
        looping: bool,
    ) -> Flush {
        Box::pin(async move {
            let mut batch = match first {
                Some(b) => b,
                None => match self.next_batch(&committer) {
                    Some(b) => b,
                    None => return,
                },
            };
            loop {
                let (items, txs): (Vec<I>, Vec<oneshot::Sender<R>>) = batch.into_iter().unzip();
                let replies = committer.commit(&self.key, items).await;
                for (tx, r) in txs.into_iter().zip(replies) {
                    let _ = tx.send(r);
                }
                match self.next_batch(&committer) {
                    None => return,
                    Some(next) if looping => batch = next,
                    Some(next) => {
                        tokio::spawn(self.flush(committer, Some(next), true));
                        return;
                    }
                }
            }
        })
    }

    /// The next batch of the key, or `None` (and the key is idle again) when nothing is queued.
    fn next_batch<C: Committer<K, I, R>>(&mut self, committer: &C) -> Option<Vec<Waiter<I, R>>> {
        let mut queues = lock(&self.queues);
        let q = queues.get_mut(&self.key).expect("a running key stays present");
        if q.is_empty() {
            queues.remove(&self.key);
            self.done = true;
            return None;
        }
        let (mut take, mut weight) = (0usize, 0usize);
        for (item, _) in q.iter() {
            let w = committer.weight(item);
            if take > 0 && (take >= self.options.max_items || weight.saturating_add(w) > self.options.max_weight) {
                break;
            }
            take += 1;
            weight = weight.saturating_add(w);
        }
        Some(if take == q.len() { std::mem::take(q).into() } else { q.drain(..take).collect() })
    }
}

impl<K: Eq + Hash, I, R> Drop for Run<K, I, R> {
    fn drop(&mut self) {
        // Moving into a spawned task moves the run (its `done` travels with it); a run dropped
        // before it left the key idle was unwound by a panic or dropped with its runtime: free
        // the key, and its queued items get `Abandoned` (their senders drop, after the lock).
        if !self.done {
            let abandoned = lock(&self.queues).remove(&self.key);
            drop(abandoned);
        }
    }
}

type Flush = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs a future to completion even if the caller drops it (it is then spawned).
struct Detached(Option<Flush>);

impl Future for Detached {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(f) = self.0.as_mut() else { return Poll::Ready(()) };
        // A panicking committer unwinds the run (its drop frees the key; the items get
        // `Abandoned`), not the caller; the poisoned future is not polled or spawned again.
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(())) | Err(_) => {
                self.0 = None;
                Poll::Ready(())
            }
        }
    }
}

impl Drop for Detached {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            // Outside a runtime the run is dropped instead: the key is freed and its items get
            // `Abandoned`.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(f);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// Records every call's batch; replies with the item doubled. `gate` holds each call until
    /// a permit is added; `panic_on` panics on a batch containing that item; `short` drops the
    /// last reply of every batch.
    #[derive(Clone, Default)]
    struct Probe {
        calls: Arc<Mutex<Vec<Vec<u32>>>>,
        gate: Option<Arc<tokio::sync::Semaphore>>,
        panic_on: Option<u32>,
        short: bool,
        in_flight: Arc<AtomicUsize>,
        max_in_flight: Arc<AtomicUsize>,
    }

    impl Committer<&'static str, u32, u32> for Probe {
        async fn commit(&mut self, _key: &&'static str, batch: Vec<u32>) -> Vec<u32> {
            let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.max_in_flight.fetch_max(n, Ordering::SeqCst);
            if let Some(g) = &self.gate {
                g.acquire().await.unwrap().forget();
            }
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            self.calls.lock().unwrap().push(batch.clone());
            if self.panic_on.is_some_and(|p| batch.contains(&p)) {
                panic!("committer panics");
            }
            let mut out: Vec<u32> = batch.iter().map(|i| i * 2).collect();
            if self.short {
                out.pop();
            }
            out
        }

        fn weight(&self, item: &u32) -> usize {
            *item as usize
        }
    }

    fn gc(max_items: usize, max_weight: usize, lead_sends: bool) -> Arc<GroupCommit<&'static str, u32, u32>> {
        Arc::new(GroupCommit::new(GroupCommitOptions { max_items, max_weight, lead_sends }))
    }

    /// Submits `items` to `key` from one task each (in order), the first call held at the gate
    /// until all are queued; returns their results.
    async fn run(
        g: &Arc<GroupCommit<&'static str, u32, u32>>,
        probe: &Probe,
        items: &[u32],
    ) -> Vec<Result<u32, Abandoned>> {
        let mut handles = Vec::new();
        for &i in items {
            let (g, p) = (g.clone(), probe.clone());
            handles.push(tokio::spawn(async move { g.submit(&"k", i, || p).await }));
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(2)).await;
            if handles.len() == 1 && probe.gate.is_some() {
                // The first call is in flight (held at the gate) before the others queue.
                while probe.in_flight.load(Ordering::SeqCst) == 0 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
        if let Some(gate) = &probe.gate {
            gate.add_permits(1000);
        }
        let mut out = Vec::new();
        for h in handles {
            out.push(h.await.unwrap());
        }
        out
    }

    #[tokio::test]
    async fn one_call_in_flight_and_queue_order_kept_in_batches_of_max_items() {
        for lead_sends in [false, true] {
            let probe = Probe { gate: Some(Arc::new(tokio::sync::Semaphore::new(0))), ..Default::default() };
            let g = gc(3, usize::MAX, lead_sends);
            let out = run(&g, &probe, &[1, 2, 3, 4, 5, 6, 7, 8]).await;
            assert_eq!(out, (1..=8).map(|i| Ok(i * 2)).collect::<Vec<_>>());
            assert_eq!(*probe.calls.lock().unwrap(), vec![vec![1], vec![2, 3, 4], vec![5, 6, 7], vec![8]]);
            assert_eq!(probe.max_in_flight.load(Ordering::SeqCst), 1);
            assert!(!g.is_busy(&"k"));
        }
    }

    #[tokio::test]
    async fn submit_many_queues_its_items_together_behind_the_call_in_flight() {
        for lead_sends in [false, true] {
            // Idle key: 5 items in one call; then 7 items with max 3 behind a held call.
            let probe = Probe::default();
            let g = gc(3, usize::MAX, lead_sends);
            assert_eq!(g.submit_many(&"k", vec![], || probe.clone()).await, vec![]);
            let g5 = gc(5, usize::MAX, lead_sends);
            let out = g5.submit_many(&"k", vec![1, 2, 3, 4, 5], || probe.clone()).await;
            assert_eq!(out, [2, 4, 6, 8, 10].map(Ok).to_vec());
            assert_eq!(*probe.calls.lock().unwrap(), vec![vec![1, 2, 3, 4, 5]]);
            assert!(!g5.is_busy(&"k"));

            let probe = Probe { gate: Some(Arc::new(tokio::sync::Semaphore::new(0))), ..Default::default() };
            let first = {
                let (g, p) = (g.clone(), probe.clone());
                tokio::spawn(async move { g.submit(&"k", 100, || p).await })
            };
            while probe.in_flight.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let many = {
                let (g, p) = (g.clone(), probe.clone());
                tokio::spawn(async move { g.submit_many(&"k", (1..=7).collect(), || p).await })
            };
            while lock(&g.queues).get(&"k").map_or(0, |q| q.len()) < 7 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            // An item submitted after the batch goes after all of it.
            let last = {
                let (g, p) = (g.clone(), probe.clone());
                tokio::spawn(async move { g.submit(&"k", 50, || p).await })
            };
            while lock(&g.queues).get(&"k").map_or(0, |q| q.len()) < 8 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            probe.gate.as_ref().unwrap().add_permits(100);
            assert_eq!(first.await.unwrap(), Ok(200));
            assert_eq!(many.await.unwrap(), (1..=7).map(|i| Ok(i * 2)).collect::<Vec<_>>());
            assert_eq!(last.await.unwrap(), Ok(100));
            assert_eq!(*probe.calls.lock().unwrap(), vec![vec![100], vec![1, 2, 3], vec![4, 5, 6], vec![7, 50]]);
            assert!(!g.is_busy(&"k"));
        }
    }

    #[tokio::test]
    async fn weight_caps_a_batch_but_a_heavy_item_goes_alone() {
        let probe = Probe { gate: Some(Arc::new(tokio::sync::Semaphore::new(0))), ..Default::default() };
        let g = gc(100, 10, false);
        let out = run(&g, &probe, &[1, 4, 5, 2, 30, 3, 3, 3]).await;
        assert!(out.iter().all(|r| r.is_ok()));
        assert_eq!(*probe.calls.lock().unwrap(), vec![vec![1], vec![4, 5], vec![2], vec![30], vec![3, 3, 3]]);
    }

    #[tokio::test]
    async fn keys_are_independent() {
        let g = gc(10, usize::MAX, true);
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let held = Probe { gate: Some(gate.clone()), ..Default::default() };
        let a = tokio::spawn({
            let (g, p) = (g.clone(), held.clone());
            async move { g.submit(&"a", 1, || p).await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(g.is_busy(&"a"));
        // Another key is not held behind "a"'s call.
        let free = Probe::default();
        assert_eq!(g.submit(&"b", 5, || free.clone()).await, Ok(10));
        gate.add_permits(1);
        assert_eq!(a.await.unwrap(), Ok(2));
    }

    #[tokio::test]
    async fn an_abandoned_lead_call_still_serves_the_items_behind_it() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let probe = Probe { gate: Some(gate.clone()), ..Default::default() };
        let g = gc(10, usize::MAX, true);
        let lead = tokio::spawn({
            let (g, p) = (g.clone(), probe.clone());
            async move { g.submit(&"k", 1, || p).await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let behind = tokio::spawn({
            let (g, p) = (g.clone(), probe.clone());
            async move { g.submit(&"k", 2, || p).await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        lead.abort();
        let _ = lead.await;
        gate.add_permits(10);
        assert_eq!(behind.await.unwrap(), Ok(4));
        assert_eq!(*probe.calls.lock().unwrap(), vec![vec![1], vec![2]]);
    }

    #[tokio::test]
    async fn missing_replies_are_abandoned() {
        let probe = Probe { gate: Some(Arc::new(tokio::sync::Semaphore::new(0))), short: true, ..Default::default() };
        let g = gc(10, usize::MAX, false);
        let out = run(&g, &probe, &[1, 2, 3]).await;
        assert_eq!(out, vec![Err(Abandoned), Ok(4), Err(Abandoned)]);
    }

    #[tokio::test]
    async fn a_lead_sending_committer_that_panics_abandons_its_item_without_panicking_the_caller() {
        let g = gc(10, usize::MAX, true);
        let probe = Probe { panic_on: Some(1), ..Default::default() };
        let lead = tokio::spawn({
            let (g, p) = (g.clone(), probe.clone());
            async move { g.submit(&"k", 1, || p).await }
        });
        assert_eq!(lead.await.expect("the submitter's task does not panic"), Err(Abandoned));
        assert!(!g.is_busy(&"k"));
        assert_eq!(g.submit(&"k", 2, || probe.clone()).await, Ok(4));
    }

    #[test]
    fn a_lead_call_dropped_outside_a_runtime_frees_the_key() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let g = gc(10, usize::MAX, true);
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let probe = Probe { gate: Some(gate), ..Default::default() };
        let mut fut = Box::pin(g.submit(&"k", 1, move || probe));
        rt.block_on(async {
            // Poll once: the lead call is in flight, held at the gate.
            let _ = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
        });
        assert!(g.is_busy(&"k"));
        let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(fut)));
        assert!(dropped.is_ok(), "dropping the submit outside a runtime panicked");
        assert!(!g.is_busy(&"k"));
    }

    #[tokio::test]
    async fn a_panicking_committer_frees_the_key() {
        for lead_sends in [false, true] {
            let probe =
                Probe { gate: Some(Arc::new(tokio::sync::Semaphore::new(0))), panic_on: Some(2), ..Default::default() };
            let g = gc(10, usize::MAX, lead_sends);
            // 1 goes alone; 2 and 3 go together and the committer panics on them.
            let out = run(&g, &probe, &[1, 2, 3]).await;
            assert_eq!(out, vec![Ok(2), Err(Abandoned), Err(Abandoned)]);
            assert!(!g.is_busy(&"k"), "the key is idle again after the panic");
            let ok = Probe::default();
            assert_eq!(g.submit(&"k", 7, || ok.clone()).await, Ok(14));
        }
    }
}
