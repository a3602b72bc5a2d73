//! A partition owner's arithmetic: the contributions' weighted average in the order the
//! orchestrator fixed, then the outer Nesterov step from the partition's base weights and
//! momentum. Deterministic, so honest owners publish identical bytes.

use iota_model::merge::Contribution;
use iota_model::{OuterConfig, weighted_average};
use iota_protocol::api::RunConfig;
use iota_protocol::tensor::encode_merged;

use crate::adversary::{Adversary, corrupt_merge};
use crate::error::MinerError;

/// The merged partition (`iota-merged/v1` bytes): new weights and momentum.
///
/// `contributions` are `(weight, values)` in the given order; `weights` and `momentum` are the
/// base the step starts from.
pub fn merged_partition(
    run: &RunConfig,
    contributions: &[(f64, Vec<f32>)],
    mut weights: Vec<f32>,
    mut momentum: Vec<f32>,
    adversary: Option<Adversary>,
) -> Result<Vec<u8>, MinerError> {
    let parts: Vec<Contribution<'_>> = contributions
        .iter()
        .map(|(w, v)| Contribution {
            weight: *w,
            values: v,
        })
        .collect();
    let avg = weighted_average(&parts, 1)?;
    let outer = OuterConfig {
        lr: run.outer_lr as f32,
        momentum: run.outer_momentum as f32,
        nesterov: true,
    };
    outer.apply(&mut weights, &mut momentum, &avg.values)?;
    if adversary == Some(Adversary::WrongMerge) {
        corrupt_merge(&mut weights);
    }
    Ok(encode_merged(&weights, &momentum))
}
