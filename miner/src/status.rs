//! What a miner is doing, for its status line, its metrics and tests.

use iota_protocol::api::Phase;
use serde::Serialize;

use crate::adversary::Adversary;

/// A snapshot of a miner.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MinerStatus {
    /// SS58 of the hotkey.
    pub hotkey: String,
    /// Uid on the subnet.
    pub uid: Option<u16>,
    /// Assigned stage.
    pub stage: Option<u32>,
    /// The run's current epoch.
    pub epoch: u64,
    /// The run's current phase.
    pub phase: Option<Phase>,
    /// When the phase ends at the latest (server clock, ms).
    pub phase_deadline_ms: i64,
    /// The server's clock at the last answer (ms).
    pub server_time_ms: i64,
    /// Epoch whose start weights are loaded.
    pub weights_epoch: Option<u64>,
    /// BLAKE3 of those epoch-start weights (hex).
    pub weights_digest: Option<String>,
    /// The last epoch-start weights loaded: `(epoch, digest)`, oldest first, at most
    /// [`MinerStatus::HISTORY`].
    pub weights_history: Vec<(u64, String)>,
    /// Hops completed (accepted by the orchestrator).
    pub hops: u64,
    /// Hops completed this epoch.
    pub epoch_hops: u64,
    /// Tokens processed in completed hops.
    pub tokens: u64,
    /// Recent compute throughput.
    pub tokens_per_s: f64,
    /// Last loss computed (last stage).
    pub last_loss: Option<f32>,
    /// Bytes uploaded.
    pub bytes_uploaded: u64,
    /// Of those, boundary tensors (activations and input gradients).
    pub boundary_bytes: u64,
    /// Milliseconds spent handling completed hops: download, compute, upload, completion.
    pub busy_ms: f64,
    /// Of those, milliseconds in the training core (decode, forward/backward, step, encode).
    pub compute_ms: f64,
    /// Throughput of the last activation upload.
    pub upload_mb_per_s: f64,
    /// Pseudo-gradient partitions uploaded.
    pub pseudo_gradients: u64,
    /// Merged partitions uploaded.
    pub merges: u64,
    /// Bytes moved by the weight all-reduce.
    pub all_reduce: AllReduceBytes,
    /// Hops dropped because their lease lapsed.
    pub leases_lost: u64,
    /// Non-finite results rolled back.
    pub nonfinite_events: u64,
    /// Rounds that failed and were retried.
    pub errors: u64,
    /// The configured dishonest behaviour, if any.
    pub adversary: Option<Adversary>,
}

/// Bytes a miner moved in the weight all-reduce, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AllReduceBytes {
    /// Pseudo-gradient partitions uploaded.
    pub pseudo_gradients_sent: u64,
    /// Contributions downloaded for the partitions this miner merged.
    pub contributions_received: u64,
    /// Merge bases (previous merged weights and momentum) downloaded for those partitions.
    pub bases_received: u64,
    /// Merged partitions uploaded.
    pub merged_sent: u64,
    /// The stage's merged partitions downloaded at each epoch start.
    pub weights_received: u64,
}

impl AllReduceBytes {
    /// Everything uploaded.
    pub fn sent(&self) -> u64 {
        self.pseudo_gradients_sent + self.merged_sent
    }

    /// Everything downloaded.
    pub fn received(&self) -> u64 {
        self.contributions_received + self.bases_received + self.weights_received
    }
}

impl MinerStatus {
    /// Entries kept in [`MinerStatus::weights_history`].
    pub const HISTORY: usize = 32;

    /// A miner that has not joined yet.
    pub fn new(hotkey: String) -> Self {
        Self {
            hotkey,
            ..Self::default()
        }
    }

    /// One line for a terminal.
    pub fn line(&self) -> String {
        let phase = self.phase.map(|p| p.as_str()).unwrap_or("joining");
        let stage = self
            .stage
            .map(|s| s.to_string())
            .unwrap_or_else(|| "-".into());
        let left = ((self.phase_deadline_ms - self.server_time_ms).max(0) as f64 / 1000.0).round();
        let loss = self
            .last_loss
            .map(|l| format!("{l:.3}"))
            .unwrap_or_else(|| "-".into());
        format!(
            "stage {stage} | epoch {} {phase} ({left:.0}s left) | hops {} (epoch {}) | {:.0} tok/s | loss {loss} | up {:.1} MB ({:.1} MB/s) | pg {} merges {} | lost {} nan {}",
            self.epoch,
            self.hops,
            self.epoch_hops,
            self.tokens_per_s,
            self.bytes_uploaded as f64 / 1e6,
            self.upload_mb_per_s,
            self.pseudo_gradients,
            self.merges,
            self.leases_lost,
            self.nonfinite_events,
        )
    }
}
