//! What a replay spot check costs next to the miner's own compute for the same epoch.
//!
//! `cargo bench -p iota-validator --bench replay_cost [-- SAMPLES RUNS]` trains one epoch of the
//! `tiny` run (3 stages, `iota_trainer::local_tiny_run`) with one honest miner per stage,
//! driving the miners' own `StageTrainer` hop by hop as the orchestrator would route a sample
//! (forward through the stages, the last stage's loss and gradient, backward), and times each
//! miner's compute: its hops, the end-of-epoch inner step and its pseudo-gradients. Then it
//! replays each miner's epoch with `replay_miner` from the recorded bytes, as a validator does,
//! and times that. Miner and replay alternate within each run so machine load hits both alike;
//! the medians over the runs are printed side by side per stage, with the median of the per-run
//! ratios (each run's replay over the same run's miner). Everything is on the CPU, in one
//! process: no network, no database.

use std::time::Instant;

use iota_model::StageOptions;
use iota_protocol::api::{Direction, RunConfig};
use iota_trainer::StageTrainer;
use iota_validator::replay::{RecordedHop, ReplayThresholds, replay_miner};

/// One miner's epoch: what it sent and received, and what computing it took.
struct MinerEpoch {
    hops: Vec<RecordedHop>,
    pseudo_gradients: Vec<(u32, Vec<f32>)>,
    /// Seconds in hops only (what the miner reports to the orchestrator per hop).
    hop_s: f64,
    /// Hops plus the end-of-epoch step and the pseudo-gradients.
    total_s: f64,
}

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("{what}: {e}");
    std::process::exit(1)
}

/// Trains `samples` samples of `epoch` through one miner per stage; returns each miner's epoch.
fn train_epoch(run: &RunConfig, epoch: u64, samples: i64) -> Vec<MinerEpoch> {
    let stages = run.stages as usize;
    let mut trainers: Vec<StageTrainer> = (0..run.stages)
        .map(|k| {
            let mut t = StageTrainer::new(run.clone(), k, StageOptions::cpu(), usize::MAX, None)
                .unwrap_or_else(|e| fail("trainer", e));
            t.begin_epoch(epoch)
                .unwrap_or_else(|e| fail("begin epoch", e));
            t
        })
        .collect();
    let mut out: Vec<MinerEpoch> = (0..stages)
        .map(|_| MinerEpoch {
            hops: Vec::new(),
            pseudo_gradients: Vec::new(),
            hop_s: 0.0,
            total_s: 0.0,
        })
        .collect();
    let mut task = 0i64;
    for sample in 0..samples {
        // Forward through every stage; the last stage's forward is its backward too.
        let mut input: Option<Vec<u8>> = None;
        for k in 0..stages {
            let started = Instant::now();
            let r = trainers[k]
                .forward(sample, input.as_deref())
                .unwrap_or_else(|e| fail("forward", e));
            // Taken by the orchestrator at once (the last stage's forward trains).
            trainers[k]
                .commit(sample)
                .unwrap_or_else(|e| fail("commit", e));
            let s = started.elapsed().as_secs_f64();
            out[k].hop_s += s;
            task += 1;
            out[k].hops.push(RecordedHop {
                task_id: task,
                sample_id: sample,
                direction: Direction::Forward,
                input: input.take(),
                output: r.bytes.clone(),
                sequence_losses: r
                    .sequence_losses
                    .map(|l| l.into_iter().map(f64::from).collect()),
            });
            input = r.bytes;
        }
        // Backward from the stage before the last down to stage 0.
        let mut grad = input;
        for k in (0..stages - 1).rev() {
            let Some(g) = grad.take() else {
                fail("backward", "no gradient")
            };
            let started = Instant::now();
            let r = trainers[k]
                .backward(sample, &g)
                .unwrap_or_else(|e| fail("backward", e));
            trainers[k]
                .commit(sample)
                .unwrap_or_else(|e| fail("commit", e));
            out[k].hop_s += started.elapsed().as_secs_f64();
            task += 1;
            out[k].hops.push(RecordedHop {
                task_id: task,
                sample_id: sample,
                direction: Direction::Backward,
                input: Some(g),
                output: r.bytes.clone(),
                sequence_losses: None,
            });
            grad = r.bytes;
        }
    }
    for (k, t) in trainers.iter_mut().enumerate() {
        let started = Instant::now();
        t.finish_training().unwrap_or_else(|e| fail("finish", e));
        for j in 0..run.partitions {
            let pg = t
                .pseudo_gradient(j)
                .unwrap_or_else(|e| fail("pseudo-gradient", e));
            out[k].pseudo_gradients.push((j, pg));
        }
        out[k].total_s = out[k].hop_s + started.elapsed().as_secs_f64();
    }
    out
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn main() {
    // Cargo passes `--bench`; numbers are ours.
    let nums: Vec<u64> = std::env::args().filter_map(|a| a.parse().ok()).collect();
    let samples = nums.first().copied().unwrap_or(32);
    let runs = nums.get(1).copied().unwrap_or(5).max(1);
    let run =
        iota_trainer::local_tiny_run("replay-cost", samples).unwrap_or_else(|e| fail("run", e));
    let stages = run.stages as usize;
    let start = vec![None; run.partitions as usize];
    let t = ReplayThresholds::default();
    // Per stage: miner hop seconds, miner total seconds, replay seconds, per run.
    let mut miner_hops = vec![Vec::new(); stages];
    let mut miner_total = vec![Vec::new(); stages];
    let mut replay = vec![Vec::new(); stages];
    let mut ratio_hops = vec![Vec::new(); stages];
    let mut ratio_total = vec![Vec::new(); stages];
    println!(
        "tiny run, {samples} samples per epoch, {runs} runs, {} threads available",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    for r in 0..runs {
        let epoch = r;
        let miners = train_epoch(&run, epoch, samples as i64);
        for (k, m) in miners.iter().enumerate() {
            let report = replay_miner(
                &run,
                None,
                k as u32,
                epoch,
                &start,
                &m.hops,
                &m.pseudo_gradients,
                &t,
                1,
            )
            .unwrap_or_else(|e| fail("replay", e));
            if !report.passed {
                fail("an honest replay failed", report.reason.unwrap_or_default());
            }
            ratio_hops[k].push(report.compute_s / m.hop_s);
            ratio_total[k].push(report.compute_s / m.total_s);
            miner_hops[k].push(m.hop_s);
            miner_total[k].push(m.total_s);
            replay[k].push(report.compute_s);
        }
    }
    println!(
        "{:>5} {:>6} {:>12} {:>14} {:>10} {:>16} {:>18}",
        "stage", "hops", "miner hops s", "miner total s", "replay s", "replay/hops", "replay/total"
    );
    for k in 0..stages {
        let hops = if k + 1 == stages {
            samples
        } else {
            2 * samples
        };
        let (h, tot, rep) = (
            median(&mut miner_hops[k]),
            median(&mut miner_total[k]),
            median(&mut replay[k]),
        );
        println!(
            "{k:>5} {hops:>6} {h:>12.3} {tot:>14.3} {rep:>10.3} {:>16.2} {:>18.2}",
            median(&mut ratio_hops[k]),
            median(&mut ratio_total[k])
        );
    }
}
