//! Replay spot check: re-run one miner's epoch on its stage from the public epoch-start weights,
//! hop by hop in the order it ran them, with the miner's own trainer code, and compare every
//! output, every last-stage loss and the pseudo-gradient it uploaded.
//!
//! The replay drives [`StageTrainer`], the code an honest miner runs, so an honest claim differs
//! from the replay only by the last bits of the kernels (thread count, CPU against GPU). The
//! default thresholds leave orders of magnitude of room above that (see the crate README) while
//! every cheat the miner crate can perform lands far outside them.

use std::time::Instant;

use iota_model::replay::{Comparison, compare};
use iota_model::{BoundaryTensor, StageOptions};
use iota_protocol::api::{Direction, RunConfig};
use iota_trainer::StageTrainer;

use crate::error::ValidatorError;

/// One completed hop of the miner, with the bytes it received and sent.
#[derive(Clone, Debug)]
pub struct RecordedHop {
    /// Task id.
    pub task_id: i64,
    /// Sample.
    pub sample_id: i64,
    /// Direction.
    pub direction: Direction,
    /// The input blob's bytes (none for a forward at stage 0).
    pub input: Option<Vec<u8>>,
    /// The output blob's bytes (none for stage 0's backward).
    pub output: Option<Vec<u8>>,
    /// Per-sequence losses the sample reports (last stage's forward).
    pub sequence_losses: Option<Vec<f64>>,
}

/// Acceptance thresholds of a replay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReplayThresholds {
    /// Smallest acceptable cosine between a claimed tensor and the replay.
    pub min_cosine: f64,
    /// Largest acceptable relative L2 error of a claimed tensor.
    pub max_relative_error: f64,
    /// Largest acceptable relative error of a reported loss.
    pub max_loss_error: f64,
    /// Smallest acceptable cosine between a sparse run's pseudo-gradient upload and the
    /// replayed pseudo-gradient at the offsets the upload holds. The upload also carries what
    /// the miner left unsent in earlier epochs, which no replay of one epoch knows, so it is not
    /// held to `min_cosine`, and its magnitude not at all.
    pub min_sparse_cosine: f64,
}

/// The default [`ReplayThresholds::min_sparse_cosine`]: far under what honest sparse uploads
/// score (0.996 and more in `tests/sparse_run.rs`; what the miner owes from earlier epochs
/// lowers it as a run goes on), over what an upload unrelated to the epoch's training scores
/// (about 0, and 0 for an empty one).
pub const SPARSE_MIN_COSINE: f64 = 0.2;

impl Default for ReplayThresholds {
    fn default() -> Self {
        Self {
            min_cosine: 0.99,
            max_relative_error: 0.05,
            max_loss_error: 0.01,
            min_sparse_cosine: SPARSE_MIN_COSINE,
        }
    }
}

/// What a replay found.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ReplayReport {
    /// Hops replayed.
    pub hops: usize,
    /// Task ids whose output or loss failed the thresholds (or could not be replayed).
    pub failed_hops: Vec<i64>,
    /// Lowest cosine over all compared tensors.
    pub worst_cosine: f64,
    /// Highest relative error over all compared tensors.
    pub worst_relative_error: f64,
    /// Highest relative error of a reported loss.
    pub worst_loss_error: f64,
    /// Pseudo-gradient partitions compared and the lowest cosine among them.
    pub pseudo_gradient_partitions: usize,
    /// Lowest pseudo-gradient cosine (1 when none was compared).
    pub pseudo_gradient_cosine: f64,
    /// Highest pseudo-gradient relative error.
    pub pseudo_gradient_relative_error: f64,
    /// Whether everything passed.
    pub passed: bool,
    /// Why it failed, if it did.
    pub reason: Option<String>,
    /// Seconds the replay computed.
    pub compute_s: f64,
}

fn boundary(bytes: &[u8]) -> Result<Vec<f32>, ValidatorError> {
    Ok(BoundaryTensor::from_bytes(bytes, None)
        .map_err(|e| ValidatorError::BadObject(e.to_string()))?
        .to_f32())
}

/// Replays `hops` of a miner of `stage` from `start` (the epoch-start weights per partition,
/// `None` for never merged) and compares with what it claimed, including its pseudo-gradient
/// partitions `claimed_pg` (`(partition, values)`). `data_dir` holds the run's prepared dataset
/// when it names one. Each micro-batch is cut into `sub_batches` runs trained side by side
/// ([`StageOptions::sub_batches`]; a miner's own cut, whatever it is, differs by f32 rounding).
#[allow(clippy::too_many_arguments)]
pub fn replay_miner(
    run: &RunConfig,
    data_dir: Option<&std::path::Path>,
    stage: u32,
    epoch: u64,
    start: &[Option<Vec<f32>>],
    hops: &[RecordedHop],
    claimed_pg: &[(u32, Vec<f32>)],
    t: &ReplayThresholds,
    sub_batches: usize,
) -> Result<ReplayReport, ValidatorError> {
    let started = Instant::now();
    let mut trainer = StageTrainer::new(
        run.clone(),
        stage,
        StageOptions {
            sub_batches: sub_batches.max(1),
            ..StageOptions::cpu()
        },
        usize::MAX,
        data_dir,
    )?;
    for (j, values) in start.iter().enumerate() {
        trainer.load_partition(j as u32, values.as_deref())?;
    }
    trainer.begin_epoch(epoch)?;
    let mut report = ReplayReport {
        hops: 0,
        failed_hops: Vec::new(),
        worst_cosine: 1.0,
        worst_relative_error: 0.0,
        worst_loss_error: 0.0,
        pseudo_gradient_partitions: 0,
        pseudo_gradient_cosine: 1.0,
        pseudo_gradient_relative_error: 0.0,
        passed: true,
        reason: None,
        compute_s: 0.0,
    };
    let note = |report: &mut ReplayReport, c: &Comparison| {
        report.worst_cosine = report.worst_cosine.min(c.cosine);
        report.worst_relative_error = report.worst_relative_error.max(c.relative_error);
    };
    for hop in hops {
        report.hops += 1;
        let out = match hop.direction {
            Direction::Forward => trainer.forward(hop.sample_id, hop.input.as_deref()),
            Direction::Backward => match &hop.input {
                Some(g) => trainer.backward(hop.sample_id, g),
                None => Err(iota_trainer::TrainerError::BadInput("no gradient".into())),
            },
        };
        // Recorded as done, so the miner's trainer took its gradients in (see
        // `StageTrainer::commit`); the replay does the same, in the same order.
        let out = match out.and_then(|o| trainer.commit(hop.sample_id).map(|_| o)) {
            Ok(o) => o,
            Err(e) => {
                trainer.discard(hop.sample_id);
                report.failed_hops.push(hop.task_id);
                report
                    .reason
                    .get_or_insert(format!("task {}: {e}", hop.task_id));
                continue;
            }
        };
        let mut ok = true;
        match (&out.bytes, &hop.output) {
            (Some(mine), Some(theirs)) => {
                // The miner's claim is the miner's problem: one that does not decode fails this
                // hop (and so the replay), it does not stop the epoch's scoring.
                let theirs = match boundary(theirs) {
                    Ok(v) => v,
                    Err(e) => {
                        report.failed_hops.push(hop.task_id);
                        report.reason.get_or_insert(format!(
                            "task {}: claimed output unreadable: {e}",
                            hop.task_id
                        ));
                        continue;
                    }
                };
                let c = match compare(&theirs, &boundary(mine)?) {
                    Ok(c) => c,
                    // Another shape than the replay's output.
                    Err(e) => {
                        report.failed_hops.push(hop.task_id);
                        report.reason.get_or_insert(format!(
                            "task {}: claimed output does not match the replay's: {e}",
                            hop.task_id
                        ));
                        continue;
                    }
                };
                note(&mut report, &c);
                ok &= c.cosine >= t.min_cosine && c.relative_error <= t.max_relative_error;
            }
            (None, None) => {}
            _ => ok = false,
        }
        if let Some(replayed) = &out.sequence_losses {
            match &hop.sequence_losses {
                Some(claimed) if claimed.len() == replayed.len() => {
                    for (c, r) in claimed.iter().zip(replayed) {
                        let r = f64::from(*r);
                        let err = (c - r).abs() / r.abs().max(1e-6);
                        report.worst_loss_error = report.worst_loss_error.max(err);
                        ok &= err <= t.max_loss_error;
                    }
                }
                _ => ok = false,
            }
        }
        if !ok {
            report.failed_hops.push(hop.task_id);
            report.reason.get_or_insert(format!(
                "task {}: output or loss differs from the replay",
                hop.task_id
            ));
        }
    }
    trainer.finish_training()?;
    for (j, claimed) in claimed_pg {
        let mut mine = trainer.pseudo_gradient(*j)?;
        if run.sparse.is_some() && claimed.len() == mine.len() {
            // A sparse upload is compared where it sent something: elsewhere it owes the
            // replayed values to a later epoch.
            for (m, c) in mine.iter_mut().zip(claimed) {
                if *c == 0.0 {
                    *m = 0.0;
                }
            }
        }
        let c = match compare(claimed, &mine) {
            Ok(c) => c,
            // A claim of another length than the partition fails the miner, not the epoch.
            Err(e) => {
                report.passed = false;
                report
                    .reason
                    .get_or_insert(format!("pseudo-gradient partition {j}: {e}"));
                continue;
            }
        };
        report.pseudo_gradient_partitions += 1;
        report.pseudo_gradient_cosine = report.pseudo_gradient_cosine.min(c.cosine);
        report.pseudo_gradient_relative_error =
            report.pseudo_gradient_relative_error.max(c.relative_error);
        let passes = match run.sparse {
            Some(_) => c.cosine >= t.min_sparse_cosine,
            None => c.cosine >= t.min_cosine && c.relative_error <= t.max_relative_error,
        };
        if !passes {
            report.passed = false;
            report.reason.get_or_insert(format!(
                "pseudo-gradient partition {j} differs from the replay"
            ));
        }
    }
    report.passed &= report.failed_hops.is_empty();
    report.compute_s = started.elapsed().as_secs_f64();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use iota_protocol::tensor::{WireEncoding, encode_boundary_f32};

    /// Two stage-0 forward hops of an honest miner, as recorded.
    fn honest_hops(run: &RunConfig) -> Vec<RecordedHop> {
        let mut miner = StageTrainer::new(run.clone(), 0, StageOptions::cpu(), usize::MAX, None)
            .expect("trainer");
        miner.begin_epoch(0).expect("epoch");
        (0..2)
            .map(|i| {
                let out = miner.forward(i, None).expect("forward");
                RecordedHop {
                    task_id: 10 + i,
                    sample_id: i,
                    direction: Direction::Forward,
                    input: None,
                    output: out.bytes,
                    sequence_losses: None,
                }
            })
            .collect()
    }

    #[test]
    fn an_unreadable_claim_fails_the_hop_not_the_replay() {
        let mut run = iota_trainer::local_tiny_run("replay-test", 4).expect("run");
        run.wire = WireEncoding::F32;
        let start = vec![None; run.partitions as usize];
        let t = ReplayThresholds::default();
        let honest = honest_hops(&run);
        // Replayed whole or cut in two runs side by side, an honest miner's hops pass.
        for sub_batches in [1, 2] {
            let report = replay_miner(&run, None, 0, 0, &start, &honest, &[], &t, sub_batches)
                .expect("replay");
            assert!(report.passed, "{sub_batches} runs: {report:?}");
        }

        let shape = run.boundary_shape();
        let n = shape.iter().product::<u64>() as usize;
        let other_shape = [shape[0], shape[1], shape[2] + 1];
        for (what, claim) in [
            ("garbage", b"not a tensor".to_vec()),
            ("truncated", {
                let mut good = encode_boundary_f32(shape, &vec![0.5; n]);
                good.truncate(good.len() - 1);
                good
            }),
            (
                "wrong shape",
                encode_boundary_f32(other_shape, &vec![0.5; n + n / shape[2] as usize]),
            ),
        ] {
            let mut hops = honest.clone();
            hops[1].output = Some(claim);
            let report = replay_miner(&run, None, 0, 0, &start, &hops, &[], &t, 2)
                .unwrap_or_else(|e| panic!("{what}: the replay failed as a whole: {e}"));
            assert!(!report.passed, "{what}: {report:?}");
            assert_eq!(report.failed_hops, vec![11], "{what}");
        }
        // A pseudo-gradient claim of another length fails the miner too.
        let report = replay_miner(
            &run,
            None,
            0,
            0,
            &start,
            &honest,
            &[(0, vec![1.0; 3])],
            &t,
            1,
        )
        .expect("replay");
        assert!(!report.passed);
    }
}
