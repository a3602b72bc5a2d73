//! Merge checks: re-derive a partition's merge from the contributions the orchestrator froze and
//! the partition's base, with the miners' own arithmetic, and compare hashes.

use iota_protocol::api::RunConfig;
use iota_trainer::sparse::{SparseVector, merged_update};
use iota_trainer::{initial_range, merged_partition, run_model};

use crate::error::ValidatorError;

/// The BLAKE3 (hex) of the honest merge of one partition.
///
/// `contributions` are `(hotkey, weight, values)` in any order (they are sorted by hotkey, the
/// orchestrator's fixed order); `base` is the partition's merged weights and momentum before
/// the epoch (`None`: the initial weights and zero momentum).
pub fn recompute_merge(
    run: &RunConfig,
    stage: u32,
    partition: u32,
    mut contributions: Vec<(String, f64, Vec<f32>)>,
    base: Option<(Vec<f32>, Vec<f32>)>,
) -> Result<(Vec<u8>, String), ValidatorError> {
    let range = run
        .partition_range(stage, partition)
        .ok_or_else(|| ValidatorError::BadObject(format!("no partition {stage}/{partition}")))?;
    let (weights, momentum) = match base {
        Some(b) => b,
        None => {
            let model = run_model(run)?;
            let init = initial_range(&model, stage, range.start as usize..range.end as usize)?;
            let n = init.len();
            (init, vec![0.0; n])
        }
    };
    contributions.sort_by(|a, b| a.0.cmp(&b.0));
    let parts: Vec<(f64, Vec<f32>)> = contributions.into_iter().map(|(_, w, v)| (w, v)).collect();
    let bytes = merged_partition(run, &parts, weights, momentum)?;
    let hash = blake3::hash(&bytes).to_hex().to_string();
    Ok((bytes, hash))
}

/// The BLAKE3 (hex) of the honest merge of one partition of a sparse run: the decoded
/// `contributions` `(hotkey, weight, upload)`, in any order (sorted by hotkey, the orchestrator's
/// fixed order), averaged and compressed again. No base: the merge is the update alone.
pub fn recompute_sparse_merge(
    run: &RunConfig,
    stage: u32,
    partition: u32,
    mut contributions: Vec<(String, f64, SparseVector)>,
) -> Result<(Vec<u8>, String), ValidatorError> {
    contributions.sort_by(|a, b| a.0.cmp(&b.0));
    let parts: Vec<(f64, SparseVector)> =
        contributions.into_iter().map(|(_, w, v)| (w, v)).collect();
    let bytes = merged_update(run, stage, partition, &parts)?;
    let hash = blake3::hash(&bytes).to_hex().to_string();
    Ok((bytes, hash))
}
