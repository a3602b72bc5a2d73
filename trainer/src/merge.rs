//! A partition owner's arithmetic: the contributions' weighted average in the order the
//! orchestrator fixed, then the outer Nesterov step from the partition's base weights and
//! momentum. Deterministic, so honest owners publish identical bytes and a validator recomputes
//! them.

use iota_model::merge::Contribution;
use iota_model::weighted_average;
use iota_protocol::api::RunConfig;
use iota_protocol::tensor::encode_merged;

use crate::error::TrainerError;

/// The merged partition's new weights and momentum.
///
/// `contributions` are `(weight, values)` in the given order; `weights` and `momentum` are the
/// base the step starts from.
pub fn merged_values(
    run: &RunConfig,
    contributions: &[(f64, Vec<f32>)],
    mut weights: Vec<f32>,
    mut momentum: Vec<f32>,
) -> Result<(Vec<f32>, Vec<f32>), TrainerError> {
    let parts: Vec<Contribution<'_>> = contributions
        .iter()
        .map(|(w, v)| Contribution {
            weight: *w,
            values: v,
        })
        .collect();
    let avg = weighted_average(&parts, 1)?;
    crate::sparse::outer_config(run).apply(&mut weights, &mut momentum, &avg.values)?;
    Ok((weights, momentum))
}

/// [`merged_values`] as the published `iota-merged/v1` bytes.
pub fn merged_partition(
    run: &RunConfig,
    contributions: &[(f64, Vec<f32>)],
    weights: Vec<f32>,
    momentum: Vec<f32>,
) -> Result<Vec<u8>, TrainerError> {
    let (weights, momentum) = merged_values(run, contributions, weights, momentum)?;
    Ok(encode_merged(&weights, &momentum))
}
