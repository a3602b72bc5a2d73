//! Group commit for per-request statements: requests that arrive together share one statement.
//!
//! A writer task takes whatever items are queued (up to a limit) as soon as a statement slot is
//! free, runs one statement for all of them, and answers each request on its own channel. There
//! is no timer: under light load a batch is one item and costs what a single statement did; under
//! load a batch grows while the previous statements run, so a round trip to the database and its
//! executor start-up are paid once per batch instead of once per request.

use std::future::Future;
use std::sync::{Arc, OnceLock};

use tokio::sync::{Semaphore, mpsc, oneshot};

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
            queue: OnceLock::new(),
        }
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
            tokio::spawn(writer(
                self.flusher.clone(),
                rx,
                self.max_batch,
                self.max_flushes,
            ));
            tx
        });
        let (reply, answer) = oneshot::channel();
        queue.send((item, reply)).await.map_err(|_| Stopped)?;
        answer.await.map_err(|_| Stopped)
    }
}

/// Ends when the batcher is dropped (after the statements in flight).
async fn writer<F: Flush>(
    flusher: Arc<F>,
    mut rx: mpsc::Receiver<Pending<F>>,
    max_batch: usize,
    max_flushes: usize,
) {
    let slots = Arc::new(Semaphore::new(max_flushes));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut batch = Vec::new();
        if rx.recv_many(&mut batch, max_batch).await == 0 {
            return;
        }
        let flusher = flusher.clone();
        tokio::spawn(async move {
            let (items, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            let outputs = flusher.flush(items).await;
            for (reply, output) in replies.into_iter().zip(outputs) {
                let _ = reply.send(output);
            }
            drop(slot);
        });
    }
}
