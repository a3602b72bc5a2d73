//! Group commit for per-request statements: requests that arrive together share one statement.
//!
//! A writer task takes whatever items are queued (up to a limit) as soon as a statement slot is
//! free, runs one statement for all of them, and answers each request on its own channel. There
//! is no timer: under light load a batch is one item and costs what a single statement did; under
//! load a batch grows while the previous statements run, so a round trip to the database and its
//! executor start-up are paid once per batch instead of once per request.
//!
//! Before it takes a batch, the writer yields once, so that the tasks already runnable (requests
//! read from the same readiness events as the first item) queue theirs first. The first item's
//! sender wakes the writer, and the runtime runs a task its running task woke next; without the
//! yield, the writer took a few signatures at a time at half the no-op ceiling of the load
//! benchmark, and each small batch paid a multiscalar product's 253 doublings alone. In 16 rounds
//! there paired in one process (both ways at the same offered rate, the order alternating),
//! batches grew from 3-18 signatures to 14-48, the orchestrator's CPU per signed poll was lower in
//! 15 rounds (by 3.8 us at the median), and the p99 was lower in 12. A yield costs no timer and no
//! thread hand-off: when nothing else is runnable the writer goes on at once.
//!
//! With several statements allowed in flight, one that would start beside another can be held
//! back until a backlog of items waits ([`Batcher::parallel_from`]): otherwise a steady trickle of
//! requests is split into many tiny batches that each pay the fixed cost.

use std::future::Future;
use std::sync::{Arc, OnceLock};

use tokio::sync::{Notify, Semaphore, mpsc, oneshot};

/// Runs one statement for a batch.
pub(crate) trait Flush: Send + Sync + 'static {
    /// What one request asks.
    type Item: Send + 'static;
    /// What it gets back.
    type Output: Send + 'static;
    /// Answers every item, in order (one output per item).
    fn flush(&self, items: Vec<Self::Item>) -> impl Future<Output = Vec<Self::Output>> + Send;
}

type Pending<F> = (<F as Flush>::Item, oneshot::Sender<<F as Flush>::Output>);

/// The writer task went away (the server is shutting down).
#[derive(Debug, thiserror::Error)]
#[error("batch writer stopped")]
pub struct Stopped;

/// A queue in front of a [`Flush`].
pub(crate) struct Batcher<F: Flush> {
    flusher: Arc<F>,
    max_batch: usize,
    max_flushes: usize,
    /// Items that must be waiting before a statement starts beside one in flight.
    parallel_from: usize,
    /// Whether the runtime's worker count raises `max_flushes` (see [`Self::a_flush_per_worker`]).
    flush_per_worker: bool,
    // Started on first use, so the state can be built outside a runtime.
    queue: OnceLock<mpsc::Sender<Pending<F>>>,
}

impl<F: Flush> Batcher<F> {
    /// Batches of at most `max_batch`, at most `max_flushes` statements in flight (so one slow
    /// statement does not stall every request behind it).
    pub(crate) fn new(flusher: F, max_batch: usize, max_flushes: usize) -> Self {
        Self {
            flusher: Arc::new(flusher),
            max_batch: max_batch.max(1),
            max_flushes: max_flushes.max(1),
            parallel_from: 1,
            flush_per_worker: false,
            queue: OnceLock::new(),
        }
    }

    /// At least one statement in flight per worker thread of the runtime that first submits:
    /// for work done on the runtime's own threads (signature checks), where `max_flushes` alone
    /// would leave a many-core runtime's other threads idle while requests wait.
    pub(crate) fn a_flush_per_worker(mut self) -> Self {
        self.flush_per_worker = true;
        self
    }

    /// A statement beside others in flight starts only once `items` wait (at most a full batch);
    /// with none in flight, whatever waits goes at once.
    pub(crate) fn parallel_from(mut self, items: usize) -> Self {
        self.parallel_from = items.clamp(1, self.max_batch);
        self
    }

    /// Whether anything was ever queued (the writer task has started).
    #[cfg(test)]
    pub(crate) fn started(&self) -> bool {
        self.queue.get().is_some()
    }

    /// Queues `item` and waits for its answer.
    pub(crate) async fn submit(&self, item: F::Item) -> Result<F::Output, Stopped> {
        let queue = self.queue.get_or_init(|| {
            let (tx, rx) = mpsc::channel(16 * self.max_batch);
            let max_flushes = if self.flush_per_worker {
                let workers = tokio::runtime::Handle::current().metrics().num_workers();
                self.max_flushes.max(workers)
            } else {
                self.max_flushes
            };
            tokio::spawn(writer(
                self.flusher.clone(),
                rx,
                Limits {
                    max_batch: self.max_batch,
                    max_flushes,
                    parallel_from: self.parallel_from,
                },
            ));
            tx
        });
        let (reply, answer) = oneshot::channel();
        queue.send((item, reply)).await.map_err(|_| Stopped)?;
        answer.await.map_err(|_| Stopped)
    }
}

#[derive(Clone, Copy)]
struct Limits {
    max_batch: usize,
    max_flushes: usize,
    parallel_from: usize,
}

/// A statement's slot: freed, and the writer told, when the statement ends (panics included).
struct InFlight {
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
    ended: Arc<Notify>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // Freed first, so that the writer sees the slot free when it wakes.
        drop(self.slot.take());
        self.ended.notify_one();
    }
}

/// Ends when the batcher is dropped (after the statements in flight).
async fn writer<F: Flush>(flusher: Arc<F>, mut rx: mpsc::Receiver<Pending<F>>, limits: Limits) {
    let slots = Arc::new(Semaphore::new(limits.max_flushes));
    // Told when a statement ends: items held back for a backlog then go at once.
    let ended = Arc::new(Notify::new());
    let mut batch = Vec::new();
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        loop {
            // This slot is held, so the others in flight are the permits missing besides it.
            let others_in_flight = slots.available_permits() + 1 < limits.max_flushes;
            let ready =
                !batch.is_empty() && (!others_in_flight || batch.len() >= limits.parallel_from);
            if ready || batch.len() >= limits.max_batch {
                break;
            }
            let room = limits.max_batch - batch.len();
            tokio::select! {
                received = rx.recv_many(&mut batch, room) => {
                    if received == 0 {
                        // The batcher is gone: answer what is held, then stop.
                        if batch.is_empty() {
                            return;
                        }
                        break;
                    }
                }
                () = ended.notified(), if others_in_flight => {}
            }
        }
        if batch.len() < limits.max_batch {
            tokio::task::yield_now().await;
            while batch.len() < limits.max_batch {
                let Ok(item) = rx.try_recv() else { break };
                batch.push(item);
            }
        }
        let flusher = flusher.clone();
        let in_flight = InFlight {
            slot: Some(slot),
            ended: ended.clone(),
        };
        let items = std::mem::take(&mut batch);
        tokio::spawn(async move {
            let (items, replies): (Vec<_>, Vec<_>) = items.into_iter().unzip();
            let outputs = flusher.flush(items).await;
            for (reply, output) in replies.into_iter().zip(outputs) {
                let _ = reply.send(output);
            }
            drop(in_flight);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Duration;

    /// Records each batch and holds it until told to finish.
    #[derive(Default)]
    struct Held {
        batches: Mutex<Vec<Vec<u32>>>,
        release: Notify,
    }

    impl Flush for Held {
        type Item = u32;
        type Output = u32;

        async fn flush(&self, items: Vec<u32>) -> Vec<u32> {
            self.batches.lock().expect("lock").push(items.clone());
            self.release.notified().await;
            items
        }
    }

    /// Submits `item` from a task of its own.
    fn submit_from_task<F: Flush<Item = u32, Output = u32>>(
        batcher: &Arc<Batcher<F>>,
        item: u32,
    ) -> tokio::task::JoinHandle<Option<u32>> {
        let batcher = batcher.clone();
        tokio::spawn(async move { batcher.submit(item).await.ok() })
    }

    async fn batches_become(held: &Held, want: &[Vec<u32>]) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            if *held.batches.lock().expect("lock") == want {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "batches {:?}, wanted {want:?}",
                held.batches.lock().expect("lock")
            );
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_second_statement_waits_for_a_backlog_or_the_first_to_end() {
        let batcher = Arc::new(Batcher::new(Held::default(), 8, 2).parallel_from(3));
        let held = batcher.flusher.clone();
        let submit = |item| submit_from_task(&batcher, item);
        // Nothing in flight: one item goes alone.
        let first = submit(1);
        batches_become(&held, &[vec![1]]).await;
        // Beside it, two items are held back: fewer than three wait.
        let (a, b) = (submit(2), submit(3));
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        batches_become(&held, &[vec![1]]).await;
        // A third makes the backlog: the second statement starts beside the first.
        let c = submit(4);
        batches_become(&held, &[vec![1], vec![2, 3, 4]]).await;
        // Both slots busy: the next item waits for a slot.
        let d = submit(5);
        held.release.notify_one();
        let done = [first, a, b, c];
        let mut answered = 0;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while answered < 1 {
            answered = done.iter().filter(|t| t.is_finished()).count();
            assert!(tokio::time::Instant::now() < deadline, "no statement ended");
            tokio::task::yield_now().await;
        }
        // One statement still in flight and one item waiting: held until the other ends.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(held.batches.lock().expect("lock").len(), 2);
        held.release.notify_one();
        batches_become(&held, &[vec![1], vec![2, 3, 4], vec![5]]).await;
        held.release.notify_one();
        assert_eq!(d.await.expect("task"), Some(5));
        for t in done {
            assert!(t.await.expect("task").is_some());
        }
    }

    #[tokio::test]
    async fn no_batch_is_larger_than_the_limit() {
        // One slot, batches of at most four: nine items queue while the first is in flight.
        let batcher = Arc::new(Batcher::new(Held::default(), 4, 1));
        let held = batcher.flusher.clone();
        let submit = |item| submit_from_task(&batcher, item);
        let mut tasks = vec![submit(1)];
        batches_become(&held, &[vec![1]]).await;
        tasks.extend((2..=10).map(submit));
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        let mut want = vec![vec![1]];
        for next in [vec![2, 3, 4, 5], vec![6, 7, 8, 9], vec![10]] {
            held.release.notify_one();
            want.push(next);
            batches_become(&held, &want).await;
        }
        held.release.notify_one();
        for (t, item) in tasks.into_iter().zip(1..) {
            assert_eq!(t.await.expect("task"), Some(item));
        }
    }

    #[tokio::test]
    async fn a_batch_gathered_for_a_backlog_stops_at_the_limit() {
        let batcher = Arc::new(Batcher::new(Held::default(), 4, 2).parallel_from(3));
        let held = batcher.flusher.clone();
        let submit = |item| submit_from_task(&batcher, item);
        let mut tasks = vec![submit(1)];
        batches_become(&held, &[vec![1]]).await;
        // Beside the first statement, one item is held back for a backlog.
        tasks.push(submit(2));
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        batches_become(&held, &[vec![1]]).await;
        // Five more at once: the held-back batch takes three of them, up to four.
        tasks.extend((3..=7).map(submit));
        batches_become(&held, &[vec![1], vec![2, 3, 4, 5]]).await;
        held.release.notify_one();
        held.release.notify_one();
        batches_become(&held, &[vec![1], vec![2, 3, 4, 5], vec![6, 7]]).await;
        held.release.notify_one();
        for (t, item) in tasks.into_iter().zip(1..) {
            assert_eq!(t.await.expect("task"), Some(item));
        }
    }

    /// Records each batch and answers at once.
    #[derive(Default)]
    struct Recorded(Mutex<Vec<Vec<u32>>>);

    impl Flush for Recorded {
        type Item = u32;
        type Output = u32;

        async fn flush(&self, items: Vec<u32>) -> Vec<u32> {
            self.0.lock().expect("lock").push(items.clone());
            items
        }
    }

    #[tokio::test]
    async fn an_item_from_a_task_woken_with_the_writer_joins_its_batch() {
        // The first submit wakes the writer; the second submitter is woken just after it, so it
        // runs after the writer in the queue. The writer's yield lets it queue first.
        let batcher = Arc::new(Batcher::new(Recorded::default(), 8, 1));
        let go = Arc::new(Notify::new());
        let second = {
            let (batcher, go) = (batcher.clone(), go.clone());
            tokio::spawn(async move {
                go.notified().await;
                batcher.submit(2).await.ok()
            })
        };
        // Parked on `go` before the first submit.
        tokio::task::yield_now().await;
        let (first, ()) = tokio::join!(batcher.submit(1), async { go.notify_one() });
        assert_eq!(first.ok(), Some(1));
        assert_eq!(second.await.expect("task"), Some(2));
        assert_eq!(*batcher.flusher.0.lock().expect("lock"), [vec![1, 2]]);
    }

    #[tokio::test]
    async fn items_that_join_after_the_yield_fill_a_batch_only_to_the_limit() {
        // As above, with three more woken beside the writer and batches of at most two.
        let batcher = Arc::new(Batcher::new(Recorded::default(), 2, 1));
        let go = Arc::new(Notify::new());
        let others: Vec<_> = (2..=4)
            .map(|item| {
                let (batcher, go) = (batcher.clone(), go.clone());
                tokio::spawn(async move {
                    go.notified().await;
                    batcher.submit(item).await.ok()
                })
            })
            .collect();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let (first, ()) = tokio::join!(batcher.submit(1), async { go.notify_waiters() });
        assert_eq!(first.ok(), Some(1));
        for (t, item) in others.into_iter().zip(2..) {
            assert_eq!(t.await.expect("task"), Some(item));
        }
        let batches = batcher.flusher.0.lock().expect("lock").clone();
        assert_eq!(batches.first(), Some(&vec![1, 2]), "batches {batches:?}");
        assert!(batches.iter().all(|b| b.len() <= 2), "batches {batches:?}");
        assert_eq!(batches.concat().len(), 4);
    }

    #[tokio::test]
    async fn without_a_backlog_rule_a_second_statement_starts_at_once() {
        let batcher = Arc::new(Batcher::new(Held::default(), 8, 2));
        let held = batcher.flusher.clone();
        let submit = |item| submit_from_task(&batcher, item);
        let tasks = [submit(1)];
        batches_become(&held, &[vec![1]]).await;
        let second = submit(2);
        batches_become(&held, &[vec![1], vec![2]]).await;
        held.release.notify_one();
        held.release.notify_one();
        assert_eq!(second.await.expect("task"), Some(2));
        for t in tasks {
            assert_eq!(t.await.expect("task"), Some(1));
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_flush_per_worker_uses_every_worker_of_the_runtime() {
        // Two statements allowed, but the runtime has four workers: four go at once.
        let batcher = Arc::new(Batcher::new(Held::default(), 8, 2).a_flush_per_worker());
        let held = batcher.flusher.clone();
        let submit = |item| submit_from_task(&batcher, item);
        let mut tasks = Vec::new();
        for item in 1..=5 {
            tasks.push(submit(item));
            let want: Vec<Vec<u32>> = (1..=item.min(4)).map(|i| vec![i]).collect();
            batches_become(&held, &want).await;
        }
        // The fifth waits for a slot: no fifth statement while four are in flight.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(held.batches.lock().expect("lock").len(), 4);
        for _ in 0..5 {
            held.release.notify_one();
        }
        batches_become(&held, &[vec![1], vec![2], vec![3], vec![4], vec![5]]).await;
        held.release.notify_one();
        for (t, item) in tasks.into_iter().zip(1..) {
            assert_eq!(t.await.expect("task"), Some(item));
        }
    }
}
