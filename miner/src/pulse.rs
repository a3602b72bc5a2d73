//! Heartbeats while the miner's loop is busy.
//!
//! The loop's work polls keep the miner registered, but one round can hold the loop for longer
//! than the orchestrator's heartbeat timeout: a slow hop of a large stage, several hops in a
//! row, an upload of every partition. The pulse sends a heartbeat whenever nothing has reached
//! the orchestrator for one heartbeat interval, so a miner is released only when it is gone.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use iota_protocol::client::ApiClient;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::status::MinerStatus;

/// When the orchestrator last heard from this miner; shared by the loop and the pulse.
#[derive(Clone)]
pub(crate) struct LastContact(Arc<Mutex<Instant>>);

impl LastContact {
    pub(crate) fn now() -> Self {
        Self(Arc::new(Mutex::new(Instant::now())))
    }

    /// Records an answered request.
    pub(crate) fn touch(&self) {
        if let Ok(mut t) = self.0.lock() {
            *t = Instant::now();
        }
    }

    fn elapsed(&self) -> Duration {
        self.0.lock().map(|t| t.elapsed()).unwrap_or(Duration::ZERO)
    }
}

/// The heartbeat task of a joined miner; aborted when dropped.
pub(crate) struct Pulse(tokio::task::JoinHandle<()>);

impl Pulse {
    /// Heartbeats through `client` (with the throughput `status` reports) whenever `last` is
    /// `every` old.
    pub(crate) fn spawn(
        client: ApiClient,
        status: watch::Receiver<MinerStatus>,
        every: Duration,
        last: LastContact,
    ) -> Self {
        Self(tokio::spawn(pulse(every, last, move || {
            let (client, tokens_per_s) = (client.clone(), status.borrow().tokens_per_s);
            async move {
                // No figure yet (still joining) is no news, not a throughput of zero.
                let tokens_per_s = (tokens_per_s > 0.0).then_some(tokens_per_s);
                match client.heartbeat(tokens_per_s).await {
                    Ok(_) => true,
                    Err(e) => {
                        tracing::warn!(error = %e, "heartbeat failed");
                        false
                    }
                }
            }
        })))
    }
}

impl Drop for Pulse {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs until dropped: every `every / 2`, a heartbeat through `beat` if the last contact is at
/// least `every` old. A failed heartbeat is tried again at the next check.
pub(crate) async fn pulse<F, Fut>(every: Duration, last: LastContact, mut beat: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let check = (every / 2).max(Duration::from_millis(50));
    loop {
        tokio::time::sleep(check).await;
        if last.elapsed() >= every && beat().await {
            last.touch();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A pulse every 2 s over `last` whose heartbeats succeed when `answer(tries before)` says
    /// so; the tries are counted.
    fn counting_pulse(
        last: &LastContact,
        answer: fn(usize) -> bool,
    ) -> (tokio::task::JoinHandle<()>, Arc<AtomicUsize>) {
        let tries = Arc::new(AtomicUsize::new(0));
        let counted = tries.clone();
        let task = tokio::spawn(pulse(Duration::from_secs(2), last.clone(), move || {
            let counted = counted.clone();
            async move { answer(counted.fetch_add(1, Ordering::SeqCst)) }
        }));
        (task, tries)
    }

    #[tokio::test(start_paused = true)]
    async fn beats_only_while_the_loop_is_silent() {
        let last = LastContact::now();
        let (task, beats) = counting_pulse(&last, |_| true);
        // The loop talks to the orchestrator every second: no heartbeat is needed.
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            last.touch();
        }
        assert_eq!(beats.load(Ordering::SeqCst), 0);
        // The loop is busy for 10 s: a heartbeat at least every 2 s (checked every second).
        tokio::time::sleep(Duration::from_secs(10)).await;
        let n = beats.load(Ordering::SeqCst);
        assert!((4..=5).contains(&n), "{n} heartbeats in 10 silent seconds");
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_heartbeat_is_retried_at_the_next_check() {
        let last = LastContact::now();
        // The first try fails, every later one succeeds.
        let (task, tries) = counting_pulse(&last, |before| before > 0);
        // Silent from t=0: the first try (t=2 s) fails, the second (t=3 s) succeeds, and the
        // next is due 2 s later (t=5 s).
        tokio::time::sleep(Duration::from_millis(4_500)).await;
        assert_eq!(tries.load(Ordering::SeqCst), 2);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(tries.load(Ordering::SeqCst), 3);
        task.abort();
    }
}
