//! A sparse run's arithmetic ([`RunConfig::sparse`]): the compressed upload of a miner's
//! pseudo-gradient with its error feedback, an owner's merge of compressed contributions, and
//! the outer step with which every miner of a stage applies the merged update to the weights it
//! holds. Deterministic, so owners publish identical bytes, a validator recomputes them, and
//! every miner of a stage holds the same weights after the same updates.

use std::ops::Range;

use iota_model::OuterConfig;
pub use iota_model::sparse::SparseVector;
use iota_model::sparse::{ErrorFeedback, SparseConfig, merge_sparse};
use iota_protocol::api::RunConfig;
use iota_protocol::tensor::{SparseShape, TensorSpec, decode_sparse, encode_sparse};

use crate::error::TrainerError;

/// What a miner still owes of its unsent remainder an epoch later. Below 1, mass that keeps
/// losing its chunk fades instead of arriving epochs late: the miners of the next epoch start
/// from weights that lack it and train much of it again. On real English (`BENCHMARKS.md`,
/// `sparse-text-32`), with 32 inner steps an epoch (what each miner of a 4-miner stage takes
/// under the orchestrator's defaults), 0.7 ends 32 epochs about a point of held-out loss nearer
/// the dense run than 0.9 over 6 seeds; with 8 inner steps the two differ by 0.2 points. A
/// miner's own business: nothing anyone verifies depends on it.
pub const FEEDBACK_DECAY: f32 = 0.7;

/// The run's outer optimizer.
pub fn outer_config(run: &RunConfig) -> OuterConfig {
    OuterConfig {
        lr: run.outer_lr as f32,
        momentum: run.outer_momentum as f32,
        nesterov: true,
    }
}

/// The compressed shape of an upload of partition `partition` of `stage`; an error in a dense
/// run.
pub fn upload_shape(
    run: &RunConfig,
    stage: u32,
    partition: u32,
) -> Result<SparseShape, TrainerError> {
    sparse_of(run.pseudo_gradient_spec(stage, partition), stage, partition)
}

/// The compressed shape of a merged update of partition `partition` of `stage`; an error in a
/// dense run.
pub fn merged_shape(
    run: &RunConfig,
    stage: u32,
    partition: u32,
) -> Result<SparseShape, TrainerError> {
    sparse_of(run.merged_spec(stage, partition), stage, partition)
}

fn sparse_of(
    spec: Option<TensorSpec>,
    stage: u32,
    partition: u32,
) -> Result<SparseShape, TrainerError> {
    match spec {
        Some(TensorSpec::Sparse(shape)) => Ok(shape),
        Some(_) => Err(TrainerError::RunMismatch(
            "the run's pseudo-gradients are dense".into(),
        )),
        None => Err(TrainerError::RunMismatch(format!(
            "no partition {stage}/{partition}"
        ))),
    }
}

pub(crate) fn config_of(shape: SparseShape) -> Result<SparseConfig, TrainerError> {
    Ok(SparseConfig::new(shape.chunk as usize, shape.k as usize)?.with_bits(shape.bits)?)
}

/// `iota-sparse/v3` bytes of `v`.
pub fn encode(v: &SparseVector) -> Vec<u8> {
    let shape = SparseShape {
        len: v.len as u64,
        chunk: v.config.chunk() as u32,
        k: v.config.k() as u32,
        bits: v.config.bits(),
    };
    encode_sparse(shape, &v.indices, &v.values, &v.scales)
}

/// Checks and decodes a compressed partition of exactly `shape`.
pub fn decode(bytes: &[u8], shape: SparseShape) -> Result<SparseVector, TrainerError> {
    let parts = decode_sparse(bytes, shape).map_err(|e| TrainerError::BadInput(e.to_string()))?;
    let v = SparseVector {
        len: usize::try_from(shape.len)
            .map_err(|_| TrainerError::BadInput("a partition longer than memory".into()))?,
        config: config_of(shape)?,
        indices: parts.indices,
        values: parts.values,
        scales: parts.scales,
    };
    v.validate()?;
    Ok(v)
}

/// An owner's merged update of partition `partition` of `stage`: the contributions `(weight,
/// upload)` ([`decode`]d), in the orchestrator's order, averaged and compressed again.
pub fn merged_update(
    run: &RunConfig,
    stage: u32,
    partition: u32,
    contributions: &[(f64, SparseVector)],
) -> Result<Vec<u8>, TrainerError> {
    let shape = merged_shape(run, stage, partition)?;
    let refs: Vec<(f64, &SparseVector)> = contributions.iter().map(|(w, v)| (*w, v)).collect();
    Ok(encode(&merge_sparse(&refs, config_of(shape)?, 1)?))
}

/// What a miner of a sparse run keeps beside its weights: what it has not sent yet, and the
/// outer momentum every miner of its stage holds alike.
#[derive(Debug)]
pub(crate) struct SparseState {
    feedback: ErrorFeedback,
    momentum: Vec<f32>,
    /// This epoch's uploads by partition, until the merged updates say what they dropped.
    sent: std::collections::HashMap<u32, SparseVector>,
}

impl SparseState {
    pub(crate) fn new(len: usize) -> Result<Self, TrainerError> {
        Ok(Self {
            feedback: ErrorFeedback::with_decay(len, FEEDBACK_DECAY)?,
            momentum: vec![0.0; len],
            sent: std::collections::HashMap::new(),
        })
    }

    /// The compressed upload of `pseudo_gradient` over `range` (partition `partition`).
    pub(crate) fn upload(
        &mut self,
        run: &RunConfig,
        stage: u32,
        partition: u32,
        range: Range<usize>,
        pseudo_gradient: &[f32],
    ) -> Result<Vec<u8>, TrainerError> {
        let config = config_of(upload_shape(run, stage, partition)?)?;
        let sent = self.feedback.compress(range, pseudo_gradient, config)?;
        let bytes = encode(&sent);
        self.sent.insert(partition, sent);
        Ok(bytes)
    }

    /// Takes back into the residual what the merge of `partition` dropped of this miner's
    /// upload there (all of it when no merge was accepted); nothing when it uploaded none.
    pub(crate) fn take_back(
        &mut self,
        partition: u32,
        range: Range<usize>,
        merged: Option<&SparseVector>,
    ) -> Result<(), TrainerError> {
        if let Some(sent) = self.sent.remove(&partition) {
            self.feedback.take_back(range, &sent, merged)?;
        }
        Ok(())
    }

    /// Forgets uploads no merge will answer (an epoch start without their epoch's updates).
    pub(crate) fn forget_uploads(&mut self) {
        self.sent.clear();
    }

    /// `start` (the epoch-start weights of `range`) moved by the outer step with `update`'s
    /// decompressed values; the momentum of `range` moves with it. On error nothing changes.
    pub(crate) fn step(
        &mut self,
        run: &RunConfig,
        range: Range<usize>,
        start: &[f32],
        update: &SparseVector,
    ) -> Result<Vec<f32>, TrainerError> {
        let momentum = self
            .momentum
            .get_mut(range)
            .ok_or_else(|| TrainerError::Internal("momentum shorter than the stage".into()))?;
        let mut weights = start.to_vec();
        outer_step(run, &mut weights, momentum, update)?;
        Ok(weights)
    }
}

/// The outer step of one partition with a merged update ([`decode`]d), in place. On error
/// nothing changes.
fn outer_step(
    run: &RunConfig,
    weights: &mut [f32],
    momentum: &mut [f32],
    update: &SparseVector,
) -> Result<(), TrainerError> {
    let dense = update.decompress()?;
    let (mut w, mut m) = (weights.to_vec(), momentum.to_vec());
    outer_config(run).apply(&mut w, &mut m, &dense)?;
    weights.copy_from_slice(&w);
    momentum.copy_from_slice(&m);
    Ok(())
}

/// A stage's weights in a sparse run at the start of `epoch`, and its outer momentum: the
/// initial weights with the updates accepted in every earlier epoch applied in turn. What a
/// validator replays from and an evaluation loads.
#[derive(Clone, Debug, PartialEq)]
pub struct SparseWeights {
    /// The epoch these weights start.
    pub epoch: u64,
    /// Flat weights of the stage.
    pub weights: Vec<f32>,
    /// Outer momentum, as long.
    pub momentum: Vec<f32>,
}

impl SparseWeights {
    /// Epoch 0: the initial weights from the run's seed, no momentum.
    pub fn initial(run: &RunConfig, stage: u32) -> Result<Self, TrainerError> {
        let model = crate::run::run_model(run)?;
        let total = run
            .params_of(stage)
            .ok_or_else(|| TrainerError::RunMismatch(format!("no stage {stage}")))?;
        let weights = crate::run::initial_range(&model, stage, 0..total as usize)?;
        let momentum = vec![0.0; weights.len()];
        Ok(Self {
            epoch: 0,
            weights,
            momentum,
        })
    }

    /// To the next epoch's start with the updates accepted in this one, one per partition
    /// (`None`: the partition was not updated). Every update is checked before any is applied,
    /// so a bad one changes nothing.
    pub fn advance(
        &mut self,
        run: &RunConfig,
        stage: u32,
        updates: &[Option<&[u8]>],
    ) -> Result<(), TrainerError> {
        if updates.len() != run.partitions as usize {
            return Err(TrainerError::BadInput(format!(
                "{} updates for {} partitions",
                updates.len(),
                run.partitions
            )));
        }
        let decoded = updates
            .iter()
            .enumerate()
            .map(|(j, u)| {
                u.map(|bytes| decode(bytes, merged_shape(run, stage, j as u32)?))
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()?;
        for (j, u) in decoded.iter().enumerate() {
            let Some(update) = u else { continue };
            let j = j as u32;
            let range = run
                .partition_range(stage, j)
                .map(|r| r.start as usize..r.end as usize)
                .filter(|r| r.end <= self.weights.len())
                .ok_or_else(|| TrainerError::RunMismatch(format!("no partition {stage}/{j}")))?;
            outer_step(
                run,
                &mut self.weights[range.clone()],
                &mut self.momentum[range],
                update,
            )?;
        }
        self.epoch += 1;
        Ok(())
    }
}
