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
            tokio::time::sleep(every).await;
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
