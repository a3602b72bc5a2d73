//! Progress a person can read: a status line redrawn in place on a terminal, or a structured
//! log line every few seconds.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use tokio::sync::watch;

use crate::config::ProgressMode;
use crate::status::MinerStatus;

/// Shows `status` until the sender is dropped.
pub async fn show(mut status: watch::Receiver<MinerStatus>, mode: ProgressMode) {
    let line = match mode {
        ProgressMode::Off => return,
        ProgressMode::Line => true,
        ProgressMode::Log => false,
        ProgressMode::Auto => std::io::stderr().is_terminal(),
    };
    let every = if line {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(10)
    };
    loop {
        tokio::select! {
            changed = status.changed() => if changed.is_err() { break },
            _ = tokio::time::sleep(every) => {}
        }
        let s = status.borrow().clone();
        if line {
            let mut err = std::io::stderr();
            let _ = write!(err, "\r\x1b[2K{}", s.line());
            let _ = err.flush();
        } else {
            tracing::info!(
                stage = ?s.stage, epoch = s.epoch, phase = ?s.phase, hops = s.hops,
                tokens_per_s = s.tokens_per_s, loss = ?s.last_loss, uploaded_mb = s.bytes_uploaded as f64 / 1e6,
                pseudo_gradients = s.pseudo_gradients, merges = s.merges, leases_lost = s.leases_lost,
                "progress"
            );
            // At most a line per period, but not a moment past the miner's end: sleeping the
            // period out held `iota miner` up to 10 s after it had stopped.
            let pause = tokio::time::sleep(every);
            tokio::pin!(pause);
            loop {
                tokio::select! {
                    _ = &mut pause => break,
                    changed = status.changed() => if changed.is_err() { return },
                }
            }
        }
    }
    if line {
        let _ = writeln!(std::io::stderr());
    }
}

/// Serves Prometheus metrics (`iota_miner_*`) on `addr`; once per process.
pub fn serve_metrics(addr: std::net::SocketAddr) -> Result<(), crate::MinerError> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| crate::MinerError::Config(format!("metrics on {addr}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The log lines end with the miner: `show` returns as soon as the status's sender is
    /// dropped, not after the period it waits between lines.
    #[tokio::test]
    async fn log_mode_ends_with_the_miner() {
        let (tx, rx) = watch::channel(MinerStatus::new("5Miner".into()));
        let shown = tokio::spawn(show(rx, ProgressMode::Log));
        // A change: one line now, then the wait before the next.
        tx.send_modify(|s| s.hops = 1);
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(tx);
        tokio::time::timeout(Duration::from_secs(2), shown)
            .await
            .expect("show returned within 2 s of the miner's end")
            .expect("show did not panic");
    }
}
