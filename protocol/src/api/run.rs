//! A run's shape: what a miner, validator or checker derives from it alike, and the rules that
//! keep it sizeable.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::tensor::{SparseShape, TensorSpec, WireEncoding};

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
    /// and error feedback, `iota-sparse/v3`), each miner applying the merged updates itself; `None`:
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

    /// A run served by an orchestrator that predates the inner optimizer's settings reads with
    /// their defaults.
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
