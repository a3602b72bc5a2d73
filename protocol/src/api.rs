//! Request and response types of the orchestrator's HTTP API (`orchestrator/API.md` describes the
//! routes; `orchestrator/openapi.json` is the generated contract).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::blob::BlobDescriptor;
use crate::tensor::{SparseShape, TensorSpec, WireEncoding};

/// Milliseconds since the Unix epoch, the API's one time format.
pub type UnixMs = i64;

/// The shape of a training run: everything a miner, validator or checker needs to know about
/// tensor shapes and timing, without running the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunConfig {
    /// Human name of the run.
    pub name: String,
    /// Model config name or description (`tiny`, `small`, …), for miners to build the stage.
    pub model: String,
    /// Number of pipeline stages.
    pub stages: u32,
    /// Flat parameter count of each stage (length `stages`).
    pub stage_params: Vec<u64>,
    /// Partitions per stage for the butterfly merge.
    pub partitions: u32,
    /// Sequences per sample (micro-batch).
    pub micro_batch: u32,
    /// Tokens per sequence.
    pub seq_len: u32,
    /// Width of the boundary tensor between stages (the bottleneck width).
    pub boundary_dim: u32,
    /// How boundary tensors are encoded.
    pub wire: WireEncoding,
    /// Samples started per epoch (training ends early when all are done).
    pub samples_per_epoch: u64,
    /// Samples one miner may hold in flight at once.
    pub max_in_flight: u32,
    /// Seconds of the training phase.
    pub training_s: u64,
    /// Seconds of the uploading phase.
    pub uploading_s: u64,
    /// Seconds of the merging phase (each reassignment round adds `merge_round_s`).
    pub merging_s: u64,
    /// Seconds of each reassignment round of unmerged partitions.
    pub merge_round_s: u64,
    /// Seconds a work lease lasts.
    pub lease_s: u64,
    /// Seconds without a heartbeat after which a miner is released.
    pub heartbeat_timeout_s: u64,
    /// Epochs of objects kept in the store (older ones are deleted, except the latest merged
    /// weights); at least [`MIN_RETENTION_EPOCHS`].
    pub retention_epochs: u64,
    /// Seed that all parties use to initialise epoch-0 weights.
    pub init_seed: u64,
    /// Outer (merge-time) learning rate applied to the averaged pseudo-gradient.
    pub outer_lr: f64,
    /// Outer Nesterov momentum coefficient.
    pub outer_momentum: f64,
    /// Peak learning rate of each miner's inner AdamW (constant within an epoch).
    #[serde(default = "default_inner_lr")]
    pub inner_lr: f64,
    /// Gradient hops (backward hops, and the last stage's forward hops) a miner accumulates
    /// before each local optimizer step; a remainder is stepped when the epoch's training ends.
    #[serde(default = "default_inner_steps_every")]
    pub inner_steps_every: u32,
    /// The prepared dataset the run trains on, named by the BLAKE3 (hex) of its
    /// `manifest.json`; miners and validators refuse a copy whose manifest hashes otherwise.
    /// `None`: the embedded grammar corpus seeded by `init_seed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataset: Option<String>,
    /// Bytes of memory a miner needs to train each stage at this run's micro-batch (length
    /// `stages`, or empty): the model's state, a sample in flight with per-block checkpointing,
    /// the backward's peak and the epoch-start copy, as the model's memory equation gives them.
    /// Empty: [`RunConfig::memory_needed`] falls back to 20 bytes a parameter.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stage_memory: Vec<u64>,
    /// Pseudo-gradients and merged updates compressed (chunked top-k with 8- or 4-bit values
    /// and error feedback, `iota-sparse/v2`), each miner applying the merged updates itself; `None`:
    /// dense f32 pseudo-gradients, and merged partitions that carry the new weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sparse: Option<SparseEncoding>,
}

/// How a run compresses pseudo-gradients: `k` of every `chunk` values of a partition kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SparseEncoding {
    /// Values per chunk (1 to 65536); chunks start at each partition's first value.
    pub chunk: u32,
    /// Values kept per chunk (1 to `chunk`).
    pub k: u32,
    /// Values each merged update keeps per chunk (`k` to `chunk`); `None`: `k`. The average of
    /// N uploads can hold up to N·k values a chunk, so a merged update larger than an upload
    /// drops less of it, at no more bytes however many miners a stage has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged_k: Option<u32>,
    /// Bits of each kept value, in uploads and merged updates: 8 or 4; `None`: 8. Halves the
    /// values' bytes at a coarser rounding, which error feedback carries to the next epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bits: Option<u8>,
}

impl SparseEncoding {
    /// `k` of every `chunk` values, in uploads and merged updates alike.
    pub fn new(chunk: u32, k: u32) -> Self {
        Self {
            chunk,
            k,
            merged_k: None,
            bits: None,
        }
    }

    /// Values a merged update keeps per chunk.
    pub fn merged_k(&self) -> u32 {
        self.merged_k.unwrap_or(self.k)
    }

    /// Bits of a kept value.
    pub fn bits(&self) -> u8 {
        self.bits.unwrap_or(8)
    }

    /// An upload of a vector of `len` values.
    pub fn upload_shape(&self, len: u64) -> SparseShape {
        SparseShape {
            len,
            chunk: self.chunk,
            k: self.k,
            bits: self.bits(),
        }
    }

    /// A merged update of a vector of `len` values.
    pub fn merged_shape(&self, len: u64) -> SparseShape {
        SparseShape {
            k: self.merged_k(),
            ..self.upload_shape(len)
        }
    }
}

/// Bytes a parameter adds to what a miner holds in a sparse run: what it still owes (error
/// feedback) and the outer momentum, f32 each.
pub const SPARSE_BYTES_PER_PARAM: u64 = 8;

/// Bytes a stage parameter needs when a run gives no memory figures: f32 weights, gradients, two
/// AdamW moments and the epoch-start copy, and nothing for activations.
pub const BYTES_PER_PARAM: u64 = 20;

fn default_inner_lr() -> f64 {
    3e-3
}

fn default_inner_steps_every() -> u32 {
    2
}

/// Upper bounds of a [`RunConfig`] that [`RunConfig::validate`] enforces. A run is served
/// unsigned and sizes what every miner and validator allocates (a vector per partition, a
/// boundary tensor per hop, a sample record per sample), so each bound is far above any real run
/// and low enough that what a client sizes from it fits a machine.
pub mod limits {
    /// Pipeline stages (a subnet has at most a few thousand uids, one miner per stage at least).
    pub const MAX_STAGES: u32 = 1024;
    /// Parameters of one stage (2^40: a trillion).
    pub const MAX_STAGE_PARAMS: u64 = 1 << 40;
    /// Partitions per stage.
    pub const MAX_PARTITIONS: u32 = 1 << 16;
    /// Tokens per sample, `micro_batch · seq_len`.
    pub const MAX_SAMPLE_TOKENS: u64 = 1 << 24;
    /// Values of one boundary tensor, `micro_batch · seq_len · boundary_dim` (1 GiB as f32).
    pub const MAX_BOUNDARY_VALUES: u64 = 1 << 28;
    /// Samples per epoch (a validator reads a record of each).
    pub const MAX_SAMPLES_PER_EPOCH: u64 = 1 << 20;
    /// Samples one miner holds in flight (each holds a forward cache).
    pub const MAX_IN_FLIGHT: u32 = 1 << 12;
    /// Any duration of the run, in seconds (30 days): phases, leases, the heartbeat timeout.
    pub const MAX_DURATION_S: u64 = 30 * 24 * 3600;
    /// Gradient hops per inner step.
    pub const MAX_INNER_STEPS_EVERY: u32 = 1 << 20;
    /// Bytes of the run's and the model's names.
    pub const MAX_NAME_BYTES: usize = 4096;
}

/// Fewest epochs of objects a run may keep: a validator replays an epoch from the weights merged
/// at the end of the epoch before, so both must still be in the store.
pub const MIN_RETENTION_EPOCHS: u64 = 2;

/// Held-out sequence ids start here: training samples never reach it (see
/// [`RunConfig::sequence_ids`]).
pub const HELD_OUT_BASE: u64 = 1 << 62;

impl RunConfig {
    /// Sets how pseudo-gradients travel, and counts in [`RunConfig::stage_memory`] what a
    /// sparse run's miners hold besides ([`SPARSE_BYTES_PER_PARAM`]). Call once, after
    /// `stage_memory` and `stage_params` are set.
    pub fn set_sparse(&mut self, sparse: Option<SparseEncoding>) {
        if sparse.is_some() && self.sparse.is_none() {
            for (m, p) in self.stage_memory.iter_mut().zip(&self.stage_params) {
                *m = m.saturating_add(p.saturating_mul(SPARSE_BYTES_PER_PARAM));
            }
        }
        self.sparse = sparse;
    }

    /// Shape of every boundary tensor: `[micro_batch, seq_len, boundary_dim]`.
    pub fn boundary_shape(&self) -> [u64; 3] {
        [
            u64::from(self.micro_batch),
            u64::from(self.seq_len),
            u64::from(self.boundary_dim),
        ]
    }

    /// The largest object of this run, in bytes: a boundary tensor (activation or gradient) or
    /// a merged partition (weights and momentum) of the largest first partition of any stage
    /// (the first is never shorter than the others); a pseudo-gradient partition is half of
    /// one. The orchestrator refuses larger uploads, and [`crate::ApiClient`] refuses to
    /// download an object whose descriptor says more.
    pub fn max_object_bytes(&self) -> u64 {
        let boundary = TensorSpec::Boundary {
            shape: self.boundary_shape(),
            encoding: self.wire,
        }
        .max_bytes();
        let merged = (0..self.stages)
            .filter_map(|s| self.partition_range(s, 0))
            .map(|r| {
                TensorSpec::Merged {
                    len: r.end - r.start,
                }
                .max_bytes()
            })
            .max()
            .unwrap_or(0);
        boundary.max(merged)
    }

    /// What a pseudo-gradient upload of partition `partition` of `stage` must be.
    pub fn pseudo_gradient_spec(&self, stage: u32, partition: u32) -> Option<TensorSpec> {
        let r = self.partition_range(stage, partition)?;
        let len = r.end - r.start;
        Some(match self.sparse {
            Some(s) => TensorSpec::Sparse(s.upload_shape(len)),
            None => TensorSpec::Partition { len },
        })
    }

    /// What a merged result of partition `partition` of `stage` must be: the compressed
    /// average update in a sparse run, otherwise the new weights and momentum.
    pub fn merged_spec(&self, stage: u32, partition: u32) -> Option<TensorSpec> {
        let r = self.partition_range(stage, partition)?;
        let len = r.end - r.start;
        Some(match self.sparse {
            Some(s) => TensorSpec::Sparse(s.merged_shape(len)),
            None => TensorSpec::Merged { len },
        })
    }

    /// Flat parameter count of `stage`, if it exists.
    pub fn params_of(&self, stage: u32) -> Option<u64> {
        self.stage_params.get(stage as usize).copied()
    }

    /// Bytes of memory a miner needs to train `stage` (see [`RunConfig::stage_memory`]); `None`
    /// for a stage the run does not have.
    pub fn memory_needed(&self, stage: u32) -> Option<u64> {
        match self.stage_memory.get(stage as usize) {
            Some(bytes) => Some(*bytes),
            None => Some(self.params_of(stage)?.saturating_mul(BYTES_PER_PARAM)),
        }
    }

    /// The value range of partition `partition` of `stage`: contiguous, sizes differing by at
    /// most one, the first `total % partitions` one longer.
    pub fn partition_range(&self, stage: u32, partition: u32) -> Option<std::ops::Range<u64>> {
        let total = self.params_of(stage)?;
        partition_range(total, self.partitions, partition)
    }

    /// The dataset sequences that make up sample `sample_id`: `micro_batch` consecutive ids.
    /// Stage 0 builds its input from them and the last stage its targets, so every party
    /// (miners, validators recomputing a loss) rebuilds the same batch from the id alone.
    pub fn sequence_ids(&self, sample_id: i64) -> Vec<u64> {
        let mb = u64::from(self.micro_batch);
        if mb == 0 {
            return Vec::new();
        }
        // Whole samples below the held-out ids: `id · mb` for any id a run reaches, wrapped
        // so that no sample straddles `HELD_OUT_BASE` for one it never does.
        let base = (sample_id.unsigned_abs() % (HELD_OUT_BASE / mb)) * mb;
        (0..mb).map(|i| base + i).collect()
    }

    /// `n` held-out sequence ids (never part of a training sample), for evaluating the merged
    /// model.
    pub fn held_out_ids(&self, n: u64) -> Vec<u64> {
        (0..n).map(|i| HELD_OUT_BASE + i).collect()
    }

    /// Checks internal consistency.
    pub fn validate(&self) -> Result<(), String> {
        if self.stages == 0 {
            return Err("a run needs at least one stage".into());
        }
        if self.stage_params.len() != self.stages as usize {
            return Err(format!(
                "{} stage parameter counts for {} stages",
                self.stage_params.len(),
                self.stages
            ));
        }
        if !self.stage_memory.is_empty() && self.stage_memory.len() != self.stages as usize {
            return Err(format!(
                "{} stage memory figures for {} stages",
                self.stage_memory.len(),
                self.stages
            ));
        }
        if self.partitions == 0 {
            return Err("partitions must be at least 1".into());
        }
        if let Some(small) = self
            .stage_params
            .iter()
            .find(|p| **p < u64::from(self.partitions))
        {
            return Err(format!(
                "a stage of {small} parameters cannot be cut into {} partitions",
                self.partitions
            ));
        }
        if self.micro_batch == 0 || self.seq_len == 0 || self.boundary_dim == 0 {
            return Err("micro_batch, seq_len and boundary_dim must be positive".into());
        }
        if self.lease_s == 0 || self.heartbeat_timeout_s == 0 {
            return Err("lease_s and heartbeat_timeout_s must be positive".into());
        }
        // A phase of no time ends at its first step, quorum or not: an epoch of no samples, or
        // of no training time, trains nothing and starts the next one at once, forever, and a
        // merge round of none accepts a single owner's result without a second.
        if self.samples_per_epoch == 0 {
            return Err("samples_per_epoch must be at least 1".into());
        }
        for (what, s) in [
            ("training_s", self.training_s),
            ("uploading_s", self.uploading_s),
            ("merging_s", self.merging_s),
            ("merge_round_s", self.merge_round_s),
        ] {
            if s == 0 {
                return Err(format!("{what} must be at least 1 second"));
            }
        }
        if self.max_in_flight == 0 {
            return Err("max_in_flight must be positive".into());
        }
        if self.retention_epochs < MIN_RETENTION_EPOCHS {
            // Checking an epoch replays it from the weights merged at the end of the epoch
            // before: with one epoch kept, those are gone as soon as the epoch ends.
            return Err(format!(
                "retention_epochs {} must be at least {MIN_RETENTION_EPOCHS}, or validators \
                 cannot check any epoch",
                self.retention_epochs
            ));
        }
        if !(self.inner_lr.is_finite() && self.inner_lr > 0.0) {
            return Err(format!("inner_lr {} must be positive", self.inner_lr));
        }
        if self.inner_steps_every == 0 {
            return Err("inner_steps_every must be at least 1".into());
        }
        // A folder name on every miner and validator: nothing but the hash.
        if let Some(d) = &self.dataset
            && !crate::blob::is_blake3_hex(d)
        {
            return Err(format!(
                "dataset {d:?} is not a BLAKE3 hash (64 lowercase hex digits)"
            ));
        }
        self.validate_bounds()
    }

    /// The upper bounds of [`limits`].
    fn validate_bounds(&self) -> Result<(), String> {
        use limits::*;
        for (what, len) in [("name", self.name.len()), ("model", self.model.len())] {
            if len > MAX_NAME_BYTES {
                return Err(format!("{what} is {len} bytes, more than {MAX_NAME_BYTES}"));
            }
        }
        if self.stages > MAX_STAGES {
            return Err(format!("{} stages, more than {MAX_STAGES}", self.stages));
        }
        if let Some(big) = self.stage_params.iter().find(|p| **p > MAX_STAGE_PARAMS) {
            return Err(format!(
                "a stage of {big} parameters, more than {MAX_STAGE_PARAMS}"
            ));
        }
        if self.partitions > MAX_PARTITIONS {
            return Err(format!(
                "{} partitions, more than {MAX_PARTITIONS}",
                self.partitions
            ));
        }
        let tokens = u64::from(self.micro_batch) * u64::from(self.seq_len);
        if tokens > MAX_SAMPLE_TOKENS {
            return Err(format!(
                "micro_batch x seq_len is {tokens} tokens, more than {MAX_SAMPLE_TOKENS}"
            ));
        }
        let values = tokens.saturating_mul(u64::from(self.boundary_dim));
        if values > MAX_BOUNDARY_VALUES {
            return Err(format!(
                "a boundary tensor of {values} values, more than {MAX_BOUNDARY_VALUES}"
            ));
        }
        if self.samples_per_epoch > MAX_SAMPLES_PER_EPOCH {
            return Err(format!(
                "{} samples per epoch, more than {MAX_SAMPLES_PER_EPOCH}",
                self.samples_per_epoch
            ));
        }
        if self.max_in_flight > MAX_IN_FLIGHT {
            return Err(format!(
                "max_in_flight {}, more than {MAX_IN_FLIGHT}",
                self.max_in_flight
            ));
        }
        for (what, s) in [
            ("training_s", self.training_s),
            ("uploading_s", self.uploading_s),
            ("merging_s", self.merging_s),
            ("merge_round_s", self.merge_round_s),
            ("lease_s", self.lease_s),
            ("heartbeat_timeout_s", self.heartbeat_timeout_s),
        ] {
            if s > MAX_DURATION_S {
                return Err(format!("{what} {s}, more than {MAX_DURATION_S} seconds"));
            }
        }
        if self.inner_steps_every > MAX_INNER_STEPS_EVERY {
            return Err(format!(
                "inner_steps_every {}, more than {MAX_INNER_STEPS_EVERY}",
                self.inner_steps_every
            ));
        }
        if !(self.outer_lr.is_finite() && self.outer_lr >= 0.0) {
            return Err(format!(
                "outer_lr {} must be finite and non-negative",
                self.outer_lr
            ));
        }
        if !(0.0..1.0).contains(&self.outer_momentum) {
            return Err(format!(
                "outer_momentum {} must be in [0, 1)",
                self.outer_momentum
            ));
        }
        if let Some(s) = self.sparse {
            // The wire format's own rule on chunk, k and bits, on a vector of one chunk.
            s.upload_shape(u64::from(s.chunk))
                .validate()
                .map_err(|e| format!("sparse pseudo-gradients: {e}"))?;
            if !(s.k..=s.chunk).contains(&s.merged_k()) {
                return Err(format!(
                    "sparse merged updates keep {} to {} of every chunk (the uploads' k to the chunk), not {}",
                    s.k,
                    s.chunk,
                    s.merged_k()
                ));
            }
        }
        Ok(())
    }
}

/// The range of partition `j` of `total` values cut into `parts`.
pub fn partition_range(total: u64, parts: u32, j: u32) -> Option<std::ops::Range<u64>> {
    if parts == 0 || j >= parts || total < u64::from(parts) {
        return None;
    }
    let (base, extra) = (total / u64::from(parts), total % u64::from(parts));
    let j64 = u64::from(j);
    let start = j64 * base + j64.min(extra);
    let len = base + u64::from(j64 < extra);
    Some(start..start + len)
}

/// Epoch phases, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Samples flow through the pipeline.
    Training,
    /// Miners upload pseudo-gradient partitions.
    Uploading,
    /// Partition owners merge.
    Merging,
}

impl Phase {
    /// The name stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Training => "training",
            Self::Uploading => "uploading",
            Self::Merging => "merging",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "training" => Some(Self::Training),
            "uploading" => Some(Self::Uploading),
            "merging" => Some(Self::Merging),
            _ => None,
        }
    }
}

/// Where the run is now.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EpochStatus {
    /// Current epoch (0-based).
    pub epoch: u64,
    /// Current phase.
    pub phase: Phase,
    /// When the phase started.
    pub phase_started_ms: UnixMs,
    /// When the phase ends at the latest.
    pub phase_deadline_ms: UnixMs,
    /// Merge reassignment round (0 in the first merging round).
    pub merge_round: u32,
    /// Samples started this epoch.
    pub samples_started: u64,
    /// Samples whose backward pass reached stage 0 this epoch.
    pub samples_completed: u64,
    /// Samples given up on this epoch (a hop with nowhere to go, a lapsed backward, the epoch's
    /// end). Started minus completed minus abandoned are still travelling.
    #[serde(default)]
    pub samples_abandoned: u64,
    /// The server's clock when this was read.
    pub server_time_ms: UnixMs,
}

/// What a miner reports about its machine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Capacity {
    /// `cpu`, `cuda:0`, … (at most 64 characters).
    #[schema(max_length = 64)]
    pub device: String,
    /// Memory available for training, in bytes (at most `i64::MAX`, as stored).
    #[schema(maximum = 9223372036854775807_u64)]
    pub memory_bytes: u64,
    /// Measured forward+backward throughput, tokens per second (at most [`MAX_TOKENS_PER_S`]).
    #[schema(minimum = 0.0, maximum = 1e9)]
    pub tokens_per_s: f64,
}

/// The largest throughput a miner may report, in tokens per second: far above what any accelerator
/// trains at, and small enough that a sum over every miner of a run stays finite (routing draws
/// from such sums).
pub const MAX_TOKENS_PER_S: f64 = 1e9;

/// Whether `tokens_per_s` is a throughput the orchestrator accepts: finite, from 0 to
/// [`MAX_TOKENS_PER_S`].
pub fn throughput_in_range(tokens_per_s: f64) -> bool {
    (0.0..=MAX_TOKENS_PER_S).contains(&tokens_per_s)
}

/// `POST /v1/miner/register`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RegisterRequest {
    /// The miner's machine.
    pub capacity: Capacity,
    /// Whether this process registered earlier in the running epoch and still holds what it
    /// computed (a miner re-joining after it was released for silence). `false`, the default,
    /// for a process that starts: if the hotkey completed hops of the running epoch before, its
    /// work in the epoch ends (see [`RegisterResponse::work_ended`]), since the state those hops
    /// left is gone and no pseudo-gradient it could upload would match them.
    #[serde(default)]
    pub holds_epoch_state: bool,
}

/// The answer to a registration: the stage to train and the weights to start from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RegisterResponse {
    /// The run.
    pub run: RunInfo,
    /// The miner's uid on the subnet.
    pub uid: u16,
    /// Assigned stage.
    pub stage: u32,
    /// Where the run is.
    pub status: EpochStatus,
    /// The weights the epoch in `status` started from (merges of earlier epochs), one blob per
    /// partition in partition order; `None` for a partition never merged (start it from
    /// `init_seed`).
    pub weights: StageWeights,
    /// An epoch in which the caller's work has ended (it uploaded its pseudo-gradient, or
    /// registered from a new process after completing hops of it): it is routed no more of
    /// that epoch's hops, completes none, and uploads no pseudo-gradient for it; it merges the
    /// partitions it owns and trains again from the next epoch.
    #[serde(default)]
    pub work_ended: Option<u64>,
}

/// Merged weights of one stage after an epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StageWeights {
    /// The epoch whose merge produced them (`None`: initial weights from the seed).
    pub epoch: Option<u64>,
    /// Stage.
    pub stage: u32,
    /// Per partition: its merged blob, or `None` when the partition kept its previous value.
    ///
    /// In a sparse run ([`RunConfig::sparse`]) a merge is the compressed update of one epoch,
    /// and these are the updates accepted in the epoch just before the one asked for (`None`:
    /// that partition was not updated); the weights are the initial ones with every epoch's
    /// updates applied in turn by the outer step.
    pub partitions: Vec<Option<BlobDescriptor>>,
}

/// Identity and configuration of the run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RunInfo {
    /// Run id.
    pub id: i64,
    /// Shapes and timing.
    pub config: RunConfig,
    /// The orchestrator's hotkey (what requests are signed for).
    pub orchestrator_hotkey: String,
    /// Subnet.
    pub netuid: u16,
    /// When the run was created.
    pub created_ms: UnixMs,
    /// Whether the run's store takes uploads straight from miners through presigned URLs
    /// (`…/presign`, PUT, then `…/commit`); otherwise they go through the orchestrator.
    #[serde(default)]
    pub direct_uploads: bool,
}

/// `POST /v1/miner/heartbeat`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct HeartbeatRequest {
    /// Updated throughput measurement, if any (from 0 to [`MAX_TOKENS_PER_S`]).
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 1e9)]
    pub tokens_per_s: Option<f64>,
}

/// The answer to a heartbeat.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct HeartbeatResponse {
    /// The miner's stage.
    pub stage: u32,
    /// Where the run is.
    pub status: EpochStatus,
}

/// `POST /v1/sessions` (signed with sr25519): open a session whose requests carry a MAC instead
/// of a signature (see [`crate::session`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OpenSessionRequest {
    /// The caller's handshake point `A = a·G`: a compressed Ristretto point, 64 hex digits.
    #[schema(pattern = "^(0x)?[0-9a-fA-F]{64}$")]
    pub public_key: String,
}

/// The answer to an open-session request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OpenSessionResponse {
    /// The session's token, sent as `Iota-Session` on each request of the session.
    pub session: String,
    /// The server's handshake point `B = b·G`, 64 hex digits.
    pub public_key: String,
    /// The session key sealed for the caller (`K ⊕ pad`, see [`crate::session`]), 64 hex digits.
    pub sealed_key: String,
    /// When the server stops taking the session, in milliseconds since the Unix epoch.
    pub expires_at_ms: u64,
}

/// The most work items one poll may ask for.
pub const MAX_WORK_ITEMS: u32 = 32;

/// `POST /v1/miner/work`: ask for leased work.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WorkRequest {
    /// At most this many items, from 1 to [`MAX_WORK_ITEMS`].
    #[schema(minimum = 1, maximum = 32)]
    pub max_items: u32,
}

/// Direction of a hop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Activations towards the last stage.
    Forward,
    /// Gradients back towards stage 0.
    Backward,
}

impl Direction {
    /// The name stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Forward => "forward",
            Self::Backward => "backward",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "forward" => Some(Self::Forward),
            "backward" => Some(Self::Backward),
            _ => None,
        }
    }
}

/// One leased unit of work.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WorkItem {
    /// Task id.
    pub task_id: i64,
    /// Lease: present it when uploading and completing.
    pub lease: Uuid,
    /// When the lease lapses.
    pub lease_expires_ms: UnixMs,
    /// Epoch of the sample.
    pub epoch: u64,
    /// Sample id (stage 0 builds its batch from it).
    pub sample_id: i64,
    /// Stage.
    pub stage: u32,
    /// Forward or backward.
    pub direction: Direction,
    /// The input: the previous stage's activations (forward at stage > 0) or the next stage's
    /// gradient (backward). `None` for a forward at stage 0.
    pub input: Option<BlobDescriptor>,
    /// Whether the task expects an output blob (everything except the backward at stage 0).
    pub expects_output: bool,
}

/// Answer to a work poll.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WorkResponse {
    /// Leased items (possibly none).
    pub items: Vec<WorkItem>,
    /// Where the run is.
    pub status: EpochStatus,
}

/// `POST /v1/miner/tasks/{task_id}/complete`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompleteRequest {
    /// The lease from the work item.
    pub lease: Uuid,
    /// The uploaded output (from the upload response), if the task expects one.
    #[serde(default)]
    pub output: Option<BlobDescriptor>,
    /// Inner optimizer steps the miner had taken this epoch when it ran this hop.
    pub inner_step: u64,
    /// BLAKE3 (hex) of the miner's stage weights when it ran this hop (at most 128 characters).
    #[schema(max_length = 128)]
    pub weights_digest: String,
    /// Mean token loss of the sample, nats (required on the last stage's forward).
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 1e4)]
    pub loss: Option<f64>,
    /// Per-sequence losses of the sample: exactly `micro_batch` on the last stage's forward,
    /// whose mean is `loss`; none on other hops.
    #[serde(default)]
    pub sequence_losses: Option<Vec<f64>>,
    /// Milliseconds the miner spent on the hop.
    #[serde(default)]
    pub compute_ms: Option<u64>,
}

/// Answer to a completion.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompleteResponse {
    /// The hop's task id.
    pub task_id: i64,
    /// The next task created for the sample, if any.
    pub next_task_id: Option<i64>,
    /// True when this completion finished the sample.
    pub sample_done: bool,
}

/// Answer to any direct upload: the stored object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct UploadResponse {
    /// The object as stored.
    pub blob: BlobDescriptor,
}

/// Answer to `POST /v1/miner/epochs/{epoch}/pseudo-gradients/reserve`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReservationResponse {
    /// The epoch whose uploading phase is held open for the caller's partitions.
    pub epoch: u64,
    /// The latest the phase stays open for them (its deadline plus one more phase length).
    pub holds_until_ms: UnixMs,
}

/// `POST …/presign`: ask to upload straight to the store.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PresignRequest {
    /// Exact size the upload will have.
    pub size: u64,
    /// BLAKE3 the bytes will have (64 lowercase hex digits).
    #[schema(pattern = "^[0-9a-f]{64}$")]
    pub blake3: String,
    /// Whether the client can upload in parts ([`PresignResponse::multipart`]). Without it, the
    /// answer is always one URL for one PUT.
    #[serde(default)]
    pub multipart: bool,
}

/// A presigned upload target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PresignResponse {
    /// PUT the bytes here (with [`PresignResponse::multipart`]: the first part).
    pub url: String,
    /// Object key to name in the commit.
    pub key: String,
    /// When the URL stops working.
    pub expires_ms: UnixMs,
    /// For an object larger than the store's part size, when the request allowed it: upload it
    /// in parts, each PUT to its own URL (a part whose connection drops is sent again alone),
    /// then commit with [`CommitRequest::multipart`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multipart: Option<MultipartTarget>,
}

/// A presigned upload in parts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MultipartTarget {
    /// The store's id of the upload, named again in the commit.
    pub upload_id: String,
    /// Bytes of every part but the last, which holds the rest.
    pub part_bytes: u64,
    /// Where to PUT each part, in order (part numbers 1, 2, …).
    pub part_urls: Vec<String>,
}

/// The parts of a presigned upload in parts, for its commit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MultipartCommit {
    /// [`MultipartTarget::upload_id`].
    pub upload_id: String,
    /// The `ETag` the store answered to each part's PUT, in order.
    pub etags: Vec<String>,
}

/// `POST …/commit`: after a presigned upload, have the orchestrator check and record it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CommitRequest {
    /// The key from the presign response.
    pub key: String,
    /// Size.
    pub size: u64,
    /// BLAKE3 (64 lowercase hex digits).
    #[schema(pattern = "^[0-9a-f]{64}$")]
    pub blake3: String,
    /// For an upload in parts: the orchestrator completes it (the object appears at `key`)
    /// before checking it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multipart: Option<MultipartCommit>,
}

/// One partition a miner must merge.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MergeAssignment {
    /// Epoch.
    pub epoch: u64,
    /// Stage.
    pub stage: u32,
    /// Partition index.
    pub partition: u32,
    /// Value range of the partition in the stage's flat parameter vector.
    pub start: u64,
    /// End of the range (exclusive).
    pub end: u64,
    /// Contributions in the fixed order to average them in, with their weights.
    pub contributions: Vec<MergeContribution>,
    /// The partition's latest merged weights and momentum from before this epoch
    /// (`iota-merged/v1`): the outer step starts from them. `None`: the initial weights from
    /// `init_seed` and zero momentum.
    #[serde(default)]
    pub base: Option<BlobDescriptor>,
    /// Upload the result by this time.
    pub deadline_ms: UnixMs,
}

/// One miner's pseudo-gradient partition in a merge.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MergeContribution {
    /// Contributor.
    pub hotkey: String,
    /// Weight (completed backward passes this epoch).
    pub weight: f64,
    /// The partition blob.
    pub blob: BlobDescriptor,
}

/// Answer to `GET /v1/miner/merges`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MergeAssignments {
    /// Assignments of the current merging round.
    pub assignments: Vec<MergeAssignment>,
    /// Where the run is.
    pub status: EpochStatus,
}

/// State of one partition's merge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PartitionState {
    /// Waiting for owners.
    Open,
    /// Every first-round owner's result agrees (or a validator settled it).
    Accepted,
    /// Results disagree; validators recompute it.
    Disputed,
    /// Nobody contributed to this stage this epoch: weights are unchanged.
    Unchanged,
}

impl PartitionState {
    /// The name stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Accepted => "accepted",
            Self::Disputed => "disputed",
            Self::Unchanged => "unchanged",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "open" => Some(Self::Open),
            "accepted" => Some(Self::Accepted),
            "disputed" => Some(Self::Disputed),
            "unchanged" => Some(Self::Unchanged),
            _ => None,
        }
    }
}

/// Merge status of one partition.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PartitionStatus {
    /// Epoch.
    pub epoch: u64,
    /// Stage.
    pub stage: u32,
    /// Partition.
    pub partition: u32,
    /// State.
    pub state: PartitionState,
    /// Owners so far, in assignment order.
    pub owners: Vec<String>,
    /// Submitted results: owner and hash.
    pub results: Vec<MergeResult>,
    /// The accepted result.
    pub accepted: Option<BlobDescriptor>,
    /// Who settled it: `agreement` (every first-round owner, at least two, submitted the same
    /// hash) or `validator:<ss58>` (accepted by validators' votes holding a majority of the
    /// permit holders' stake; the vote that made it); `unmerged` (no result by the last
    /// deadline) or `unverified` (results that disagreed, or too few, and no validator majority
    /// settled them by then), both keeping the partition's weights.
    pub resolved_by: Option<String>,
}

/// One owner's merged result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MergeResult {
    /// Who submitted it.
    pub hotkey: String,
    /// BLAKE3 of the result. Absent from the public view (`GET /v1/epochs/{epoch}/merges`) while
    /// the partition is open or disputed: an owner who saw another's hash (and so its object's
    /// key) could submit that result as its own instead of merging.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blake3: Option<String>,
}

/// `POST /v1/miner/reports/bad-object`: a downloaded object failed its checks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct BadObjectReport {
    /// Object key.
    pub key: String,
    /// What was wrong.
    pub reason: String,
}

/// Answer to a bad-object report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct BadObjectVerdict {
    /// True when the orchestrator re-checked the object, found it bad and failed its producer.
    pub confirmed: bool,
    /// What happened.
    pub detail: String,
}

/// One recorded hop, as validators and explorers read it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct HopRecord {
    /// Task id (increasing in creation order).
    pub task_id: i64,
    /// Epoch.
    pub epoch: u64,
    /// Sample.
    pub sample_id: i64,
    /// Stage.
    pub stage: u32,
    /// Direction.
    pub direction: Direction,
    /// Attempt number of this hop (re-routing adds one).
    pub attempt: u32,
    /// Miner that held it.
    pub miner: String,
    /// `pending`, `leased`, `done`, `expired`, `failed`, `abandoned`.
    pub status: String,
    /// Input blob.
    pub input: Option<BlobDescriptor>,
    /// Output blob.
    pub output: Option<BlobDescriptor>,
    /// Inner step the miner reported.
    pub inner_step: Option<u64>,
    /// Weight digest the miner reported.
    pub weights_digest: Option<String>,
    /// Created.
    pub created_ms: UnixMs,
    /// Leased.
    pub leased_ms: Option<UnixMs>,
    /// Completed.
    pub completed_ms: Option<UnixMs>,
    /// Miner-reported compute time.
    pub compute_ms: Option<u64>,
}

/// A page of hop records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct HopPage {
    /// Records, by task id.
    pub hops: Vec<HopRecord>,
    /// Pass as `after` for the next page; `None` at the end.
    pub next_after: Option<i64>,
}

/// A sample with its pathway and loss.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SampleRecord {
    /// Sample id.
    pub sample_id: i64,
    /// Epoch.
    pub epoch: u64,
    /// `forward`, `backward`, `done`, `abandoned`.
    pub status: String,
    /// Miner (ss58) per stage on the pathway, as far as it got (the miner of the latest
    /// successful forward attempt at each stage).
    pub pathway: Vec<String>,
    /// Mean token loss from the last stage.
    pub loss: Option<f64>,
    /// Per-sequence losses.
    pub sequence_losses: Option<Vec<f64>>,
}

/// A page of samples.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SamplePage {
    /// Samples, by id.
    pub samples: Vec<SampleRecord>,
    /// Pass as `after` for the next page; `None` at the end.
    pub next_after: Option<i64>,
}

/// A pseudo-gradient submission.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PseudoGradientRecord {
    /// Epoch.
    pub epoch: u64,
    /// Stage.
    pub stage: u32,
    /// Partition.
    pub partition: u32,
    /// Miner.
    pub hotkey: String,
    /// Blob.
    pub blob: BlobDescriptor,
    /// Merge weight.
    pub weight: f64,
}

/// What a validator may check for one epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EpochRecord {
    /// Epoch.
    pub epoch: u64,
    /// Current phase if the epoch is running, `None` when finished.
    pub phase: Option<Phase>,
    /// Per miner: stage and the work it did.
    pub miners: Vec<MinerWork>,
    /// Every pseudo-gradient submission.
    pub pseudo_gradients: Vec<PseudoGradientRecord>,
    /// Every partition's merge status.
    pub partitions: Vec<PartitionStatus>,
    /// Merged weights of the previous epoch per stage (the epoch-start weights to replay from).
    pub start_weights: Vec<StageWeights>,
}

/// A miner's work in one epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MinerWork {
    /// Miner.
    pub hotkey: String,
    /// The stage it worked in during the epoch (its pseudo-gradient's, else its last hop's),
    /// which may not be the stage it is in now.
    pub stage: u32,
    /// Completed forward hops.
    pub forward_done: u64,
    /// Completed backward hops.
    pub backward_done: u64,
    /// Leases that lapsed or were failed.
    pub failed: u64,
}

/// An open or settled dispute over a partition.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Dispute {
    /// Dispute id.
    pub id: i64,
    /// The partition.
    pub partition: PartitionStatus,
    /// The contributions the merge must be computed from.
    pub contributions: Vec<MergeContribution>,
    /// `open` or `settled`.
    pub state: String,
}

/// What a validator may spot-check in an epoch, and what validators reported checking.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SpotCheckTasks {
    /// Epoch.
    pub epoch: u64,
    /// Per miner with work in the epoch (a page of them, by hotkey): the hops that can be
    /// replayed, in the order they ran.
    pub miners: Vec<SpotCheckCandidate>,
    /// The last miner of a full page: ask again with `?after=` it for the next.
    #[serde(default)]
    pub next_after: Option<String>,
    /// Partitions whose merge can be re-derived (accepted ones, with their hash); on the first
    /// page only (empty on a page asked for with `?after=`).
    pub partitions: Vec<PartitionStatus>,
    /// Spot checks validators have reported for this epoch; on the first page only.
    pub reported: Vec<SpotCheckReport>,
}

/// One miner's replayable work.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SpotCheckCandidate {
    /// Miner.
    pub hotkey: String,
    /// The stage it worked in during the epoch (its pseudo-gradient's, else its last hop's),
    /// which may not be the stage it is in now: the stage to replay it on.
    pub stage: u32,
    /// Completed hops at `stage`, by completion time (the replay order). Hops of another stage
    /// (before a move) are left out: the miner began the new stage afresh.
    pub hop_task_ids: Vec<i64>,
    /// Partitions of its pseudo-gradient that were uploaded.
    pub pseudo_gradient_partitions: Vec<u32>,
}

/// The outcome of one check.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SpotCheckResult {
    /// Miner checked.
    pub hotkey: String,
    /// `replay`, `merge`, `loss`, …
    pub kind: String,
    /// What was checked (task ids, `stage/partition`, …).
    pub target: String,
    /// Whether it passed.
    pub passed: bool,
    /// Measurements (cosine, relative error, hashes).
    pub detail: String,
}

/// `POST /v1/validator/epochs/{epoch}/spot-checks`: what a validator checked and found.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SpotCheckReport {
    /// Validator (filled in by the orchestrator from the signature).
    #[serde(default)]
    pub validator: String,
    /// The seed the draw came from (hex), so anyone can redo the draw.
    #[schema(max_length = 256)]
    pub seed: String,
    /// The chain block whose hash went into the seed.
    pub seed_block: u64,
    /// Results.
    #[schema(max_items = 10000)]
    pub checks: Vec<SpotCheckResult>,
}

/// `POST /v1/validator/disputes/{id}/settle`: the hash the validator recomputed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SettleRequest {
    /// BLAKE3 of the recomputed merge (64 lowercase hex digits).
    #[schema(pattern = "^[0-9a-f]{64}$")]
    pub blake3: String,
}

/// One miner's score from one validator, with what went into it (so anyone can recompute it).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MinerScore {
    /// Miner (at most 64 characters).
    #[schema(max_length = 64)]
    pub hotkey: String,
    /// Score (non-negative): `work * quality`.
    #[schema(minimum = 0.0)]
    pub score: f64,
    /// Gradient hops completed, times the share of the miner's pseudo-gradient merged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work: Option<f64>,
    /// Quality factor in [0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quality: Option<f64>,
    /// Why the score is zero, when a check failed (at most 1024 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 1024)]
    pub penalty: Option<String>,
    /// The miner's CLASP effect on the loss (absent: not fitted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<f64>,
    /// Whether CLASP flagged the miner as harmful.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flagged: Option<bool>,
}

/// The settings a validator scored an epoch with, published with its scores: with them and the
/// public records, anyone can recompute its fit, scores and weights
/// (`iota validator audit --validator`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScoringParams {
    /// CLASP's ridge penalty.
    pub clasp_ridge: f64,
    /// CLASP's z-score above which a harmful effect is flagged.
    pub clasp_z_threshold: f64,
    /// CLASP's smallest flagged effect, in nats.
    pub clasp_min_effect: f64,
    /// CLASP's fewest samples for a flag.
    pub clasp_min_samples: u64,
    /// Epochs of samples one CLASP fit pools: the scored epoch and those before it (at most
    /// 64; absent in publications from before it was a setting, which fitted one epoch).
    #[serde(default = "one_epoch")]
    #[schema(minimum = 1, maximum = 64)]
    pub clasp_window: u64,
    /// Loss difference (nats) at which quality halves.
    pub quality_scale: f64,
    /// Per-epoch decay of older scores, in (0, 1].
    pub decay: f64,
    /// Epochs of scores that count toward the weights (at most 1000).
    #[schema(maximum = 1000)]
    pub window: u64,
    /// The uid that receives the burn share, if any.
    #[serde(default)]
    pub burn_uid: Option<u16>,
    /// The share of the weights burnt, in [0, 1).
    #[serde(default)]
    pub burn_share: f64,
}

fn one_epoch() -> u64 {
    1
}

impl ScoringParams {
    /// Most epochs a published score window may span.
    pub const MAX_WINDOW: u64 = 1000;
    /// Most epochs one CLASP fit may pool (what it holds in memory grows with them).
    pub const MAX_CLASP_WINDOW: u64 = 64;

    /// Whether every value is one a validator could have scored with.
    pub fn is_valid(&self) -> bool {
        let finite = [
            self.clasp_ridge,
            self.clasp_z_threshold,
            self.clasp_min_effect,
            self.quality_scale,
            self.decay,
            self.burn_share,
        ]
        .iter()
        .all(|v| v.is_finite());
        finite
            && self.clasp_ridge >= 0.0
            && self.quality_scale > 0.0
            && self.decay > 0.0
            && self.decay <= 1.0
            && (1..=Self::MAX_WINDOW).contains(&self.window)
            && (1..=Self::MAX_CLASP_WINDOW).contains(&self.clasp_window)
            && (0.0..1.0).contains(&self.burn_share)
    }
}

/// Weights a validator set on chain.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WeightsSet {
    /// Block the weights landed in.
    #[schema(maximum = 9223372036854775807_u64)]
    pub block: u64,
    /// Uids, each once.
    #[schema(max_items = 4096)]
    pub uids: Vec<u16>,
    /// Weights, u16 as set, one per uid.
    #[schema(max_items = 4096)]
    pub weights: Vec<u16>,
}

/// `POST /v1/validator/epochs/{epoch}/scores`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScoreSubmission {
    /// Scores per miner.
    #[schema(max_items = 4096)]
    pub scores: Vec<MinerScore>,
    /// The on-chain weights these scores produced, once they are on chain (set, or revealed).
    #[serde(default)]
    pub weights: Option<WeightsSet>,
    /// The settings the epoch was scored with.
    #[serde(default)]
    pub params: Option<ScoringParams>,
}

/// A stored score submission.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ScoreRecord {
    /// Validator.
    pub validator: String,
    /// Epoch.
    pub epoch: u64,
    /// Scores.
    pub scores: Vec<MinerScore>,
    /// Weights set.
    pub weights: Option<WeightsSet>,
    /// The settings the epoch was scored with.
    #[serde(default)]
    pub params: Option<ScoringParams>,
    /// When submitted.
    pub submitted_ms: UnixMs,
}

/// A stage as explorers see it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StageInfo {
    /// Stage.
    pub stage: u32,
    /// Flat parameter count.
    pub params: u64,
    /// Active miners.
    pub active_miners: u32,
    /// Sum of their reported throughput.
    pub tokens_per_s: f64,
}

/// A miner as explorers see it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MinerInfo {
    /// Hotkey.
    pub hotkey: String,
    /// Uid at registration.
    pub uid: u16,
    /// Stage.
    pub stage: u32,
    /// `active` or `released`.
    pub status: String,
    /// Capacity as the miner reported it (its `tokens_per_s` claimed, not measured).
    pub capacity: Capacity,
    /// Last heartbeat or request.
    pub last_seen_ms: UnixMs,
    /// Epoch it joined in.
    pub joined_epoch: u64,
    /// Completed hops in the current epoch.
    pub hops_this_epoch: u64,
    /// Throughput as the orchestrator measured it from the miner's completed hops, tokens per
    /// second (`None` before its first); routing uses it in place of the claimed
    /// `capacity.tokens_per_s` once there is one.
    #[serde(default)]
    pub measured_tokens_per_s: Option<f64>,
}

/// One point of the loss series.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LossPoint {
    /// Epoch.
    pub epoch: u64,
    /// Samples with a loss.
    pub samples: u64,
    /// Mean loss over them.
    pub mean_loss: f64,
}

/// Throughput per epoch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ThroughputPoint {
    /// Epoch.
    pub epoch: u64,
    /// Completed samples.
    pub samples: u64,
    /// Tokens of completed samples.
    pub tokens: u64,
    /// Seconds from the epoch's start to the end of its training phase (or now).
    pub seconds: f64,
    /// Bytes of boundary tensors moved.
    pub wire_bytes: u64,
}

/// `GET /healthz` and the unsigned no-op.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// Always `ok`.
    pub status: String,
    /// Whether this process currently drives the epoch phases.
    pub leader: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run() -> RunConfig {
        RunConfig {
            name: "t".into(),
            model: "tiny".into(),
            stages: 3,
            stage_params: vec![1000, 1000, 1000],
            partitions: 4,
            micro_batch: 4,
            seq_len: 64,
            boundary_dim: 8,
            wire: WireEncoding::Int8,
            samples_per_epoch: 256,
            max_in_flight: 8,
            training_s: 600,
            uploading_s: 120,
            merging_s: 120,
            merge_round_s: 60,
            lease_s: 60,
            heartbeat_timeout_s: 90,
            retention_epochs: 3,
            init_seed: 0,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            inner_lr: 3e-3,
            inner_steps_every: 2,
            dataset: None,
            stage_memory: Vec::new(),
            sparse: None,
        }
    }

    /// A run's published memory figures are what admission uses; without them, 20 bytes a
    /// parameter.
    #[test]
    fn memory_needed_is_the_published_figure_or_the_parameter_rule() {
        let mut r = run();
        assert_eq!(
            r.memory_needed(1),
            Some(r.stage_params[1] * BYTES_PER_PARAM)
        );
        r.stage_memory = (0..r.stages).map(|k| 1000 + u64::from(k)).collect();
        assert_eq!(r.validate(), Ok(()));
        assert_eq!(r.memory_needed(1), Some(1001));
        assert_eq!(r.memory_needed(r.stages), None);
    }

    /// Each change gives a run `validate` refuses, with a message naming `field`.
    #[test]
    fn validate_refuses_runs_a_client_cannot_size() {
        assert_eq!(run().validate(), Ok(()));
        type Change = Box<dyn Fn(&mut RunConfig)>;
        let cases: Vec<(&str, Change)> = vec![
            ("partitions", Box::new(|r| r.partitions = u32::MAX)),
            (
                "stages",
                Box::new(|r| {
                    r.stages = limits::MAX_STAGES + 1;
                    r.stage_params = vec![1000; r.stages as usize];
                }),
            ),
            ("parameters", Box::new(|r| r.stage_params[1] = u64::MAX)),
            ("memory", Box::new(|r| r.stage_memory = vec![1 << 30])),
            (
                "seq_len",
                Box::new(|r| {
                    r.micro_batch = u32::MAX;
                    r.seq_len = u32::MAX;
                }),
            ),
            ("boundary tensor", Box::new(|r| r.boundary_dim = u32::MAX)),
            (
                "samples per epoch",
                Box::new(|r| r.samples_per_epoch = u64::MAX),
            ),
            ("max_in_flight", Box::new(|r| r.max_in_flight = u32::MAX)),
            (
                "heartbeat_timeout_s",
                Box::new(|r| r.heartbeat_timeout_s = u64::MAX),
            ),
            ("lease_s", Box::new(|r| r.lease_s = u64::MAX / 1000)),
            ("training_s", Box::new(|r| r.training_s = u64::MAX)),
            ("merge_round_s", Box::new(|r| r.merge_round_s = u64::MAX)),
            (
                "inner_steps_every",
                Box::new(|r| r.inner_steps_every = u32::MAX),
            ),
            ("outer_lr", Box::new(|r| r.outer_lr = f64::NAN)),
            ("outer_momentum", Box::new(|r| r.outer_momentum = 1.5)),
            ("model", Box::new(|r| r.model = "x".repeat(1 << 20))),
            // Phases of no time: epochs that train nothing, one after another, forever.
            ("samples_per_epoch", Box::new(|r| r.samples_per_epoch = 0)),
            ("training_s", Box::new(|r| r.training_s = 0)),
            ("uploading_s", Box::new(|r| r.uploading_s = 0)),
            ("merging_s", Box::new(|r| r.merging_s = 0)),
            ("merge_round_s", Box::new(|r| r.merge_round_s = 0)),
            ("partitions", Box::new(|r| r.stage_params[2] = 3)),
            ("positive", Box::new(|r| r.micro_batch = 0)),
            ("positive", Box::new(|r| r.seq_len = 0)),
            ("positive", Box::new(|r| r.boundary_dim = 0)),
            ("positive", Box::new(|r| r.lease_s = 0)),
            ("positive", Box::new(|r| r.heartbeat_timeout_s = 0)),
            (
                "tokens",
                Box::new(|r| {
                    r.micro_batch = 1 << 12;
                    r.seq_len = 1 << 13;
                }),
            ),
            ("outer_lr", Box::new(|r| r.outer_lr = -0.1)),
            ("inner_lr", Box::new(|r| r.inner_lr = 0.0)),
            ("inner_lr", Box::new(|r| r.inner_lr = -1e-3)),
            ("inner_lr", Box::new(|r| r.inner_lr = f64::NAN)),
            ("inner_lr", Box::new(|r| r.inner_lr = f64::INFINITY)),
        ];
        for (field, change) in cases {
            let mut r = run();
            change(&mut r);
            let err = r.validate().expect_err(field);
            assert!(err.contains(field), "{field}: {err}");
        }
        // The bounds themselves are valid: a run at every limit passes.
        let mut r = run();
        r.stage_params[2] = u64::from(r.partitions);
        assert_eq!(r.validate(), Ok(()), "a partition of one parameter");
        let mut r = run();
        r.partitions = limits::MAX_PARTITIONS;
        r.stage_params = vec![limits::MAX_STAGE_PARAMS; 3];
        r.samples_per_epoch = limits::MAX_SAMPLES_PER_EPOCH;
        r.heartbeat_timeout_s = limits::MAX_DURATION_S;
        r.max_in_flight = limits::MAX_IN_FLIGHT;
        r.inner_steps_every = limits::MAX_INNER_STEPS_EVERY;
        r.name = "n".repeat(limits::MAX_NAME_BYTES);
        r.model = "m".repeat(limits::MAX_NAME_BYTES);
        assert_eq!(r.validate(), Ok(()));
        let mut r = run();
        r.stages = limits::MAX_STAGES;
        r.stage_params = vec![1000; r.stages as usize];
        // 2^24 tokens of 16 values: both limits exactly.
        (r.micro_batch, r.seq_len, r.boundary_dim) = (1 << 12, 1 << 12, 16);
        assert_eq!(r.validate(), Ok(()));
    }

    /// What every party derives from a run alike: shapes, stage sizes, partitions, the
    /// largest object, a sample's sequences.
    #[test]
    fn what_a_run_sizes() {
        let mut r = run();
        r.stage_params = vec![1001, 1000, 4003];
        assert_eq!(r.boundary_shape(), [4, 64, 8]);
        assert_eq!(r.params_of(2), Some(4003));
        assert_eq!(r.params_of(3), None);
        // 4,003 in 4: three of 1,001, then 1,000.
        assert_eq!(r.partition_range(2, 0), Some(0..1001));
        assert_eq!(r.partition_range(2, 3), Some(3003..4003));
        assert_eq!(r.partition_range(3, 0), None);
        // The largest object: stage 2's first merged partition, then a wide boundary tensor.
        assert_eq!(
            r.max_object_bytes(),
            TensorSpec::Merged { len: 1001 }.max_bytes()
        );
        r.boundary_dim = 4096;
        let boundary = TensorSpec::Boundary {
            shape: [4, 64, 4096],
            encoding: WireEncoding::Int8,
        };
        assert_eq!(r.max_object_bytes(), boundary.max_bytes());
        // A sample is `micro_batch` consecutive sequences, whatever the id's sign.
        assert_eq!(r.sequence_ids(0), [0, 1, 2, 3]);
        assert_eq!(r.sequence_ids(5), [20, 21, 22, 23]);
        assert_eq!(r.sequence_ids(-5), r.sequence_ids(5));
        // No training sequence is a held-out one, for any id and micro-batch.
        for mb in [1, 3, 4, 7] {
            r.micro_batch = mb;
            for id in [i64::MAX, i64::MIN, -1, (HELD_OUT_BASE / 3) as i64] {
                let ids = r.sequence_ids(id);
                assert_eq!(ids.len(), mb as usize);
                assert!(ids.iter().all(|s| *s < HELD_OUT_BASE), "{mb} {id}: {ids:?}");
            }
        }
        assert_eq!(r.held_out_ids(2), [HELD_OUT_BASE, HELD_OUT_BASE + 1]);
    }

    /// Partitions tile a stage's values in order, their sizes differing by at most one, the
    /// first `total % parts` the longer ones; there is no partition past the last, and none of
    /// a stage too small to cut.
    #[test]
    fn partitions_tile_the_values() {
        for (total, parts) in [
            (10u64, 1u32),
            (10, 3),
            (12, 4),
            (4003, 4),
            (7, 7),
            (1000, 999),
        ] {
            let mut next = 0;
            for j in 0..parts {
                let r = partition_range(total, parts, j).expect("a partition");
                assert_eq!(
                    r.start,
                    next,
                    "{total}/{parts}: partition {j} starts where {} ended",
                    j.max(1) - 1
                );
                let long = u64::from(j) < total % u64::from(parts);
                assert_eq!(
                    r.end - r.start,
                    total / u64::from(parts) + u64::from(long),
                    "{total}/{parts}: {j}"
                );
                next = r.end;
            }
            assert_eq!(next, total, "{total}/{parts}");
            assert_eq!(partition_range(total, parts, parts), None);
        }
        assert_eq!(partition_range(10, 0, 0), None);
        assert_eq!(partition_range(3, 4, 0), None);
        assert_eq!(partition_range(4, 4, 3), Some(3..4));
    }

    /// Phases, directions and partition states are stored and sent by the names serde gives
    /// them, and read back.
    #[test]
    fn stored_names_round_trip() {
        for phase in [Phase::Training, Phase::Uploading, Phase::Merging] {
            assert_eq!(Phase::parse(phase.as_str()), Some(phase));
            let json = serde_json::to_string(&phase).expect("json");
            assert_eq!(json, format!("\"{}\"", phase.as_str()));
        }
        for direction in [Direction::Forward, Direction::Backward] {
            assert_eq!(Direction::parse(direction.as_str()), Some(direction));
            let json = serde_json::to_string(&direction).expect("json");
            assert_eq!(json, format!("\"{}\"", direction.as_str()));
        }
        for state in [
            PartitionState::Open,
            PartitionState::Accepted,
            PartitionState::Disputed,
            PartitionState::Unchanged,
        ] {
            assert_eq!(PartitionState::parse(state.as_str()), Some(state));
            let json = serde_json::to_string(&state).expect("json");
            assert_eq!(json, format!("\"{}\"", state.as_str()));
        }
        assert_eq!(PartitionState::parse("closed"), None);
        assert_eq!(Phase::parse("Training"), None);
        assert_eq!(Direction::parse("sideways"), None);
    }

    #[test]
    fn throughput_bounds() {
        for ok in [0.0, 1.5, MAX_TOKENS_PER_S] {
            assert!(throughput_in_range(ok), "{ok}");
        }
        for bad in [-1.0, MAX_TOKENS_PER_S * 1.5, f64::NAN, f64::INFINITY] {
            assert!(!throughput_in_range(bad), "{bad}");
        }
    }

    /// A run served by an orchestrator that predates the inner optimizer's settings reads with
    /// their defaults.
    #[test]
    fn a_dataset_is_named_by_its_hash_only() {
        let mut r = run();
        r.dataset = Some("ab".repeat(32));
        assert!(r.validate().is_ok());
        for bad in ["../../etc", "AB".repeat(32).as_str(), "ab", ""] {
            r.dataset = Some(bad.to_owned());
            assert!(r.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn inner_settings_default_when_absent() {
        let mut json = serde_json::to_value(run()).expect("json");
        let fields = json.as_object_mut().expect("object");
        fields.remove("inner_lr");
        fields.remove("inner_steps_every");
        let r: RunConfig = serde_json::from_value(json).expect("a run");
        assert_eq!((r.inner_lr, r.inner_steps_every), (3e-3, 2));
    }

    /// Every duration may be up to 30 days, and no more.
    #[test]
    fn durations_reach_thirty_days() {
        let mut r = run();
        r.heartbeat_timeout_s = 30 * 86_400;
        assert_eq!(r.validate(), Ok(()));
        r.heartbeat_timeout_s += 1;
        assert!(r.validate().is_err());
    }

    #[test]
    fn validate_keeps_what_a_validator_replays() {
        for (retention, ok) in [(0, false), (1, false), (2, true), (3, true)] {
            let mut r = run();
            r.retention_epochs = retention;
            match r.validate() {
                Ok(()) => assert!(ok, "retention {retention} accepted"),
                Err(e) => {
                    assert!(!ok, "retention {retention} refused: {e}");
                    assert!(e.contains("retention_epochs"), "{e}");
                }
            }
        }
    }
}
