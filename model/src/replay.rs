//! Replaying a miner's epoch on one stage, for spot checks.
//!
//! A miner takes local optimizer steps during an epoch, so a single hop can only be re-run with
//! the weights the miner had at that moment. A validator therefore replays the whole sequence:
//! from the public epoch-start weights, the miner's recorded [`Hop`]s in order (forward inputs,
//! incoming gradients, inner-step points with their learning rates), with the same optimizer.
//! It compares every output and input gradient the miner uploaded, and its pseudo-gradient, with
//! the [`Comparison`] helpers.
//!
//! The miner runs the same [`StageRunner`] for its real work, so an honest miner and the
//! validator execute the same code in the same order (stale caches are recomputed the same way,
//! see [`crate::stage`]); what differs is only the last bits of the kernels (thread count, CPU
//! against GPU). The crate README records the measured honest error that thresholds come from.
//!
//! Memory is bounded: at most `max_in_flight` forward caches may wait for their backward, so a
//! hop list from a peer cannot make the replayer hold unbounded state.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};

use crate::error::{ModelError, Result};
use crate::merge::flatten_params;
use crate::optim::{AdamW, StepOutcome, pseudo_gradient};
use crate::stage::{HeldGradients, Stage, StageCache, StageOutput};

/// One recorded event of a miner's epoch on its stage.
#[derive(Clone, Debug)]
pub enum Hop {
    /// A forward pass of `sample`: token ids `[batch, seq]` on stage 0, otherwise the incoming
    /// activation; `targets` on the last stage only.
    Forward {
        /// Sample (micro-batch) id, unique among the samples in flight.
        sample: u64,
        /// The input the miner received.
        input: Tensor,
        /// Next-token targets (last stage).
        targets: Option<Tensor>,
    },
    /// The backward pass of a sample forwarded earlier, with the gradient the miner received
    /// (`None` on the last stage).
    Backward {
        /// The sample whose forward cache is consumed.
        sample: u64,
        /// Gradient of the loss with respect to this stage's output.
        grad_output: Option<Tensor>,
    },
    /// A local optimizer step at this point, with the run's learning rate.
    InnerStep {
        /// Learning rate used.
        lr: f64,
    },
}

/// What a hop produced.
#[derive(Clone, Debug)]
pub enum HopResult {
    /// Output of a forward: the boundary activation, or the loss on the last stage.
    Forward {
        /// Sample id.
        sample: u64,
        /// The output.
        output: StageOutput,
    },
    /// Result of a backward: the gradient with respect to the input (`None` on stage 0).
    Backward {
        /// Sample id.
        sample: u64,
        /// Input gradient.
        grad_input: Option<Tensor>,
    },
    /// Outcome of an inner step.
    InnerStep(StepOutcome),
}

impl HopResult {
    /// The tensor-valued part of the result as f32 values (activations, per-sequence losses,
    /// input gradient); `None` for steps and stage 0's backward.
    pub fn values(&self) -> Result<Option<Vec<f32>>> {
        let t = match self {
            Self::Forward {
                output: StageOutput::Activations(t),
                ..
            } => t,
            Self::Forward {
                output: StageOutput::Loss(l),
                ..
            } => return Ok(Some(l.per_sequence.clone())),
            Self::Backward {
                grad_input: Some(t),
                ..
            } => t,
            _ => return Ok(None),
        };
        Ok(Some(
            t.flatten_all()?
                .to_dtype(DType::F32)?
                .to_device(&candle_core::Device::Cpu)?
                .to_vec1::<f32>()?,
        ))
    }
}

/// A stage and its inner optimizer driven hop by hop: what a miner runs during an epoch and what
/// a validator replays.
#[derive(Debug)]
pub struct StageRunner {
    stage: Stage,
    optimizer: AdamW,
    in_flight: BTreeMap<u64, StageCache>,
    max_in_flight: usize,
}

impl StageRunner {
    /// Drive `stage` (holding the epoch-start weights) with `optimizer`; at most `max_in_flight`
    /// forwards may wait for their backward.
    pub fn new(stage: Stage, optimizer: AdamW, max_in_flight: usize) -> Self {
        Self {
            stage,
            optimizer,
            in_flight: BTreeMap::new(),
            max_in_flight,
        }
    }

    /// The stage.
    pub fn stage(&self) -> &Stage {
        &self.stage
    }
    /// The inner optimizer.
    pub fn optimizer(&self) -> &AdamW {
        &self.optimizer
    }
    /// The stage, mutably (recomputation, zeroing gradients after a rollback).
    pub fn stage_mut(&mut self) -> &mut Stage {
        &mut self.stage
    }
    /// Drops the forward cache of `sample` (its backward will not come); whether it was held.
    pub fn forget(&mut self, sample: u64) -> bool {
        self.in_flight.remove(&sample).is_some()
    }
    /// Drops every forward cache.
    pub fn forget_all(&mut self) {
        self.in_flight.clear();
    }
    /// Starts over with `optimizer` (a fresh one at an epoch start) and no caches.
    pub fn reset(&mut self, optimizer: AdamW) {
        self.in_flight.clear();
        self.optimizer = optimizer;
    }
    /// Samples forwarded and not yet back-propagated.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
    /// Take the stage and optimizer back.
    pub fn into_parts(self) -> (Stage, AdamW) {
        (self.stage, self.optimizer)
    }

    /// Execute one hop.
    pub fn apply(&mut self, hop: &Hop) -> Result<HopResult> {
        match hop {
            Hop::Forward {
                sample,
                input,
                targets,
            } => {
                if self.in_flight.contains_key(sample) {
                    return Err(ModelError::InvalidInput(format!(
                        "sample {sample} is already in flight"
                    )));
                }
                if self.in_flight.len() >= self.max_in_flight {
                    return Err(ModelError::InvalidInput(format!(
                        "more than {} samples in flight",
                        self.max_in_flight
                    )));
                }
                let (output, cache) = self.stage.forward(input, targets.as_ref())?;
                self.in_flight.insert(*sample, cache);
                Ok(HopResult::Forward {
                    sample: *sample,
                    output,
                })
            }
            Hop::Backward {
                sample,
                grad_output,
            } => {
                let (grad_input, held) = self.backward_held(*sample, grad_output.as_ref())?;
                self.commit(held)?;
                Ok(HopResult::Backward {
                    sample: *sample,
                    grad_input,
                })
            }
            Hop::InnerStep { lr } => Ok(HopResult::InnerStep(
                self.optimizer.step_with(&mut self.stage, *lr)?,
            )),
        }
    }

    /// The backward of `sample` with its parameter gradients held (see
    /// [`Stage::backward_held`]): the stage is unchanged until [`StageRunner::commit`].
    pub fn backward_held(
        &mut self,
        sample: u64,
        grad_output: Option<&Tensor>,
    ) -> Result<(Option<Tensor>, HeldGradients)> {
        let cache = self.in_flight.remove(&sample).ok_or_else(|| {
            ModelError::InvalidInput(format!("backward of sample {sample} with no forward"))
        })?;
        self.stage.backward_held(cache, grad_output)
    }

    /// Adds held gradients to the stage's accumulated ones.
    pub fn commit(&mut self, held: HeldGradients) -> Result<()> {
        self.stage.commit(held)
    }

    /// Execute `hops` in order.
    pub fn apply_all(&mut self, hops: &[Hop]) -> Result<Vec<HopResult>> {
        hops.iter().map(|h| self.apply(h)).collect()
    }

    /// `start - current` over the whole flat view (see [`crate::merge::pseudo_gradient_range`]
    /// for one partition at a time).
    pub fn pseudo_gradient(&self, start: &[f32]) -> Result<Vec<f32>> {
        pseudo_gradient(start, &flatten_params(&self.stage)?)
    }
}

/// A replayed epoch.
#[derive(Debug)]
pub struct Replay {
    /// One result per hop, in order.
    pub results: Vec<HopResult>,
    /// Epoch-start weights minus the weights after the last hop.
    pub pseudo_gradient: Vec<f32>,
}

/// Replay `hops` on `stage` (loaded with the epoch-start weights) with `optimizer` (in its
/// epoch-start state).
pub fn replay(
    stage: Stage,
    optimizer: AdamW,
    hops: &[Hop],
    max_in_flight: usize,
) -> Result<Replay> {
    let start = flatten_params(&stage)?;
    let mut runner = StageRunner::new(stage, optimizer, max_in_flight);
    let results = runner.apply_all(hops)?;
    let pseudo_gradient = runner.pseudo_gradient(&start)?;
    Ok(Replay {
        results,
        pseudo_gradient,
    })
}

/// How far a claimed vector is from a reference (the replay).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Comparison {
    /// Cosine similarity (1 for two zero vectors, 0 if exactly one is zero).
    pub cosine: f64,
    /// `|claimed - reference| / |reference|` (L2; `|claimed|` if the reference is zero).
    pub relative_error: f64,
    /// `|claimed| / |reference|` (1 for two zero vectors, infinite if only the reference is zero).
    pub magnitude_ratio: f64,
}

/// Acceptance thresholds for a [`Comparison`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Thresholds {
    /// Smallest acceptable cosine.
    pub min_cosine: f64,
    /// Largest acceptable relative error.
    pub max_relative_error: f64,
}

impl Comparison {
    /// Whether the claim passes `t`. Non-finite values never pass.
    pub fn passes(&self, t: &Thresholds) -> bool {
        self.cosine.is_finite()
            && self.relative_error.is_finite()
            && self.cosine >= t.min_cosine
            && self.relative_error <= t.max_relative_error
    }
}

/// Compare `claimed` with `reference`, in f64.
pub fn compare(claimed: &[f32], reference: &[f32]) -> Result<Comparison> {
    if claimed.len() != reference.len() {
        return Err(ModelError::shape(
            "compared vectors",
            &[reference.len()],
            &[claimed.len()],
        ));
    }
    let (mut dot, mut na, mut nb, mut nd) = (0f64, 0f64, 0f64, 0f64);
    for (a, b) in claimed.iter().zip(reference) {
        let (a, b) = (f64::from(*a), f64::from(*b));
        dot += a * b;
        na += a * a;
        nb += b * b;
        nd += (a - b) * (a - b);
    }
    let (na, nb, nd) = (na.sqrt(), nb.sqrt(), nd.sqrt());
    let cosine = match (na > 0.0, nb > 0.0) {
        (true, true) => dot / (na * nb),
        (false, false) => 1.0,
        _ => 0.0,
    };
    let relative_error = if nb > 0.0 { nd / nb } else { na };
    let magnitude_ratio = match (na > 0.0, nb > 0.0) {
        (_, true) => na / nb,
        (false, false) => 1.0,
        (true, false) => f64::INFINITY,
    };
    Ok(Comparison {
        cosine,
        relative_error,
        magnitude_ratio,
    })
}

/// Cosine similarity of two vectors (see [`Comparison::cosine`]).
pub fn cosine(a: &[f32], b: &[f32]) -> Result<f64> {
    Ok(compare(a, b)?.cosine)
}

/// Relative L2 error of `claimed` against `reference` (see [`Comparison::relative_error`]).
pub fn relative_error(claimed: &[f32], reference: &[f32]) -> Result<f64> {
    Ok(compare(claimed, reference)?.relative_error)
}

/// Norm ratio of `claimed` to `reference` (see [`Comparison::magnitude_ratio`]).
pub fn magnitude_ratio(claimed: &[f32], reference: &[f32]) -> Result<f64> {
    Ok(compare(claimed, reference)?.magnitude_ratio)
}

/// Compare a miner's claimed results with the replay, hop by hop: one entry per hop that has
/// values (forward outputs, input gradients), `(hop index, comparison)`. Results of different
/// kinds or samples at the same position are an error: the claim does not describe these hops.
pub fn compare_results(
    claimed: &[HopResult],
    replayed: &[HopResult],
) -> Result<Vec<(usize, Comparison)>> {
    if claimed.len() != replayed.len() {
        return Err(ModelError::shape(
            "hop results",
            &[replayed.len()],
            &[claimed.len()],
        ));
    }
    let mut out = Vec::new();
    for (i, (c, r)) in claimed.iter().zip(replayed).enumerate() {
        let same_hop = match (c, r) {
            (HopResult::Forward { sample: a, .. }, HopResult::Forward { sample: b, .. })
            | (HopResult::Backward { sample: a, .. }, HopResult::Backward { sample: b, .. }) => {
                a == b
            }
            (HopResult::InnerStep(_), HopResult::InnerStep(_)) => true,
            _ => false,
        };
        if !same_hop {
            return Err(ModelError::InvalidInput(format!(
                "hop {i}: claimed result does not match the hop kind or sample"
            )));
        }
        if let (Some(cv), Some(rv)) = (c.values()?, r.values()?) {
            out.push((i, compare(&cv, &rv)?));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::optim::{AdamWConfig, LrSchedule};
    use crate::rng::SplitMix64;
    use crate::stage::StageOptions;
    use candle_core::Device;

    fn randn(dims: &[usize], seed: u64) -> Tensor {
        let mut r = SplitMix64::new(seed);
        let n: usize = dims.iter().product();
        Tensor::from_vec(
            (0..n).map(|_| r.next_normal() as f32).collect::<Vec<_>>(),
            dims,
            &Device::Cpu,
        )
        .unwrap()
    }

    /// An epoch of a middle stage with samples in flight across inner steps (so some backward
    /// passes find stale caches).
    fn hops(stage: &Stage) -> Vec<Hop> {
        let (b, t) = (2, 12);
        let fwd = |s: u64| Hop::Forward {
            sample: s,
            input: randn(&stage.input_dims(b, t), 100 + s),
            targets: None,
        };
        let bwd = |s: u64| Hop::Backward {
            sample: s,
            grad_output: Some((randn(&stage.output_dims(b, t), 200 + s) * 1e-3).unwrap()),
        };
        vec![
            fwd(1),
            fwd(2),
            bwd(1),
            fwd(3),
            Hop::InnerStep { lr: 1e-2 },
            bwd(2),
            bwd(3),
            fwd(4),
            fwd(5),
            bwd(5),
            Hop::InnerStep { lr: 5e-3 },
            bwd(4),
            Hop::InnerStep { lr: 5e-3 },
        ]
    }

    fn fresh(cfg: &ModelConfig) -> (Stage, AdamW) {
        let stage = Stage::new(cfg, 1, StageOptions::cpu()).unwrap();
        let opt = AdamW::new(&stage, AdamWConfig::default(), LrSchedule::constant()).unwrap();
        (stage, opt)
    }

    #[test]
    fn honest_run_replays_exactly_and_a_tampered_hop_is_found() {
        let cfg = ModelConfig::tiny();
        let (stage, opt) = fresh(&cfg);
        let hops = hops(&stage);
        // The miner's run, with the same runner a validator uses.
        let start = flatten_params(&stage).unwrap();
        let mut miner = StageRunner::new(stage, opt, 8);
        let claimed = miner.apply_all(&hops).unwrap();
        let claimed_pg = miner.pseudo_gradient(&start).unwrap();
        assert!(
            miner.stage().stale_recomputes() >= 2,
            "the run crosses steps"
        );
        assert_eq!(miner.optimizer().step_count(), 3);
        assert!(claimed_pg.iter().any(|v| *v != 0.0));

        let (stage, opt) = fresh(&cfg);
        let rep = replay(stage, opt, &hops, 8).unwrap();
        let cmp = compare_results(&claimed, &rep.results).unwrap();
        assert_eq!(cmp.len(), 10, "5 outputs and 5 input gradients");
        for (i, c) in &cmp {
            assert_eq!(c.relative_error, 0.0, "hop {i}: {c:?}");
            assert_eq!(c.magnitude_ratio, 1.0);
        }
        assert_eq!(
            claimed_pg.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            rep.pseudo_gradient
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        );

        // A miner who skipped work on hop 3 (forward of sample 3) and sent a slightly wrong
        // activation: only that hop fails a threshold far above honest noise.
        let strict = Thresholds {
            min_cosine: 0.999,
            max_relative_error: 1e-3,
        };
        let mut tampered = claimed.clone();
        if let HopResult::Forward {
            output: StageOutput::Activations(a),
            ..
        } = &mut tampered[3]
        {
            let noise = (randn(a.dims(), 7) * 0.02).unwrap();
            *a = (&*a + (a.abs().unwrap() * noise).unwrap()).unwrap();
        } else {
            panic!("hop 3 is a forward");
        }
        let cmp = compare_results(&tampered, &rep.results).unwrap();
        let failed: Vec<usize> = cmp
            .iter()
            .filter(|(_, c)| !c.passes(&strict))
            .map(|(i, _)| *i)
            .collect();
        assert_eq!(failed, vec![3]);

        // A miner who replays a different incoming gradient (hop 5's) gets a different input
        // gradient and a different pseudo-gradient.
        let mut other_hops = hops.clone();
        if let Hop::Backward { grad_output, .. } = &mut other_hops[5] {
            *grad_output = Some((grad_output.as_ref().unwrap() * -1.0).unwrap());
        }
        let (stage, opt) = fresh(&cfg);
        let forged = replay(stage, opt, &other_hops, 8).unwrap();
        let c = compare(&forged.pseudo_gradient, &rep.pseudo_gradient).unwrap();
        assert!(!c.passes(&strict), "{c:?}");
    }

    /// The last stage: forwards carry targets, outputs are per-sequence losses, backward takes
    /// no gradient; a replay across an inner step is exact.
    #[test]
    fn last_stage_replays_losses() {
        use crate::data::{GrammarCorpus, make_batch};
        let cfg = ModelConfig::tiny();
        let g = GrammarCorpus::new(5, 12).unwrap();
        let build = || {
            let stage = Stage::new(&cfg, 2, StageOptions::cpu()).unwrap();
            let opt = AdamW::new(&stage, AdamWConfig::default(), LrSchedule::constant()).unwrap();
            (stage, opt)
        };
        let (stage, opt) = build();
        let fwd = |s: u64| Hop::Forward {
            sample: s,
            input: randn(&stage.input_dims(3, 12), 300 + s),
            targets: Some(
                make_batch(&g, &[3 * s, 3 * s + 1, 3 * s + 2], &Device::Cpu)
                    .unwrap()
                    .targets,
            ),
        };
        let bwd = |s: u64| Hop::Backward {
            sample: s,
            grad_output: None,
        };
        let hops = vec![
            fwd(1),
            fwd(2),
            bwd(1),
            Hop::InnerStep { lr: 1e-2 },
            bwd(2),
            fwd(3),
        ];
        let mut miner = StageRunner::new(stage, opt, 4);
        let claimed = miner.apply_all(&hops).unwrap();
        let losses = claimed[5].values().unwrap().unwrap();
        assert_eq!(losses.len(), 3, "one loss per sequence");
        let (stage, opt) = build();
        let rep = replay(stage, opt, &hops, 4).unwrap();
        let cmp = compare_results(&claimed, &rep.results).unwrap();
        assert_eq!(cmp.len(), 5, "three loss vectors and two input gradients");
        assert!(cmp.iter().all(|(_, c)| c.relative_error == 0.0));
    }

    #[test]
    fn malformed_hop_lists_are_errors() {
        let cfg = ModelConfig::tiny();
        let (stage, opt) = fresh(&cfg);
        let h = hops(&stage);
        let mut r = StageRunner::new(stage, opt, 2);
        r.apply(&h[0]).unwrap();
        assert!(r.apply(&h[0]).is_err(), "same sample twice in flight");
        r.apply(&h[1]).unwrap();
        assert!(r.apply(&h[3]).is_err(), "over the in-flight bound");
        assert!(
            r.apply(&Hop::Backward {
                sample: 99,
                grad_output: None
            })
            .is_err()
        );
        assert_eq!(r.in_flight(), 2);
        assert!(compare(&[1.0], &[1.0, 2.0]).is_err());
        assert!(
            compare_results(
                &[],
                &[HopResult::InnerStep(StepOutcome::Skipped(
                    crate::optim::SkipReason::NonFiniteLoss
                ))]
            )
            .is_err()
        );
    }

    #[test]
    fn comparison_helpers() {
        let c = compare(&[2.0, 0.0], &[1.0, 0.0]).unwrap();
        assert_eq!(
            (c.cosine, c.relative_error, c.magnitude_ratio),
            (1.0, 1.0, 2.0)
        );
        let c = compare(&[0.0, 1.0], &[1.0, 0.0]).unwrap();
        assert_eq!(c.cosine, 0.0);
        assert!((c.relative_error - 2f64.sqrt()).abs() < 1e-12);
        let z = compare(&[0.0], &[0.0]).unwrap();
        assert_eq!(
            (z.cosine, z.relative_error, z.magnitude_ratio),
            (1.0, 0.0, 1.0)
        );
        assert_eq!(magnitude_ratio(&[1.0], &[0.0]).unwrap(), f64::INFINITY);
        assert!((cosine(&[1.0, 1.0], &[-1.0, -1.0]).unwrap() + 1.0).abs() < 1e-12);
        assert_eq!(relative_error(&[1.0], &[1.0]).unwrap(), 0.0);
        let t = Thresholds {
            min_cosine: 0.9,
            max_relative_error: 0.1,
        };
        assert!(compare(&[1.0, 1.05], &[1.0, 1.0]).unwrap().passes(&t));
        assert!(!compare(&[1.0, 2.0], &[1.0, 1.0]).unwrap().passes(&t));
        assert!(!compare(&[f32::NAN], &[1.0]).unwrap().passes(&t));
    }
}
