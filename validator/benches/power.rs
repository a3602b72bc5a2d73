//! How often the validator's checks catch a cheater at the default settings, and what being
//! caught costs it under the score decay.
//!
//! 1. CLASP at 256 samples an epoch (the run's default) over 3 stages, and pooled over the
//!    10-epoch scoring window: the share of harmful miners flagged and of honest ones flagged.
//! 2. The replay draw: 4 replays an epoch (the default) among the miners that worked, so a
//!    miner is replayed with probability 4/N. Every replay of a replay-caught kind catches it
//!    (`tests/catches_adversaries.rs`).
//! 3. What a cheater earns against an honest miner, both claiming the same work, when each epoch
//!    it is caught with probability p: the scoring rule itself (`score::decayed_totals`) over a
//!    long run, a failed check zeroing the whole window.
//!
//! `cargo bench -p iota-validator --bench power`. Synthetic: no chain, no network.

use std::collections::BTreeMap;

use iota_validator::score::{EpochScore, ScoreConfig, decayed_totals};
use iota_validator::{Clasp, ClaspConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const STAGES: usize = 3;
const SAMPLES_PER_EPOCH: usize = 256;
const WINDOW_EPOCHS: usize = 10;
/// Per-sample loss noise (nats), as in `tests/clasp_simulation.rs`.
const NOISE: f64 = 0.3;
/// Extra loss a harmful miner adds to the samples through it (nats).
const STRENGTHS: [f64; 4] = [0.1, 0.2, 0.3, 0.5];
const TRIALS: u64 = 200;
const REPLAYS_PER_EPOCH: usize = 4;

fn gaussian(rng: &mut StdRng) -> f64 {
    let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
    let u2: f64 = rng.gen_range(0.0..1.0);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// One fit over `samples` random pathways through `per_stage` miners a stage, miner 0 of
/// stage 1 harmful by `strength`, honest miners differing by 0.01 nats: whether the harmful one
/// was flagged, and how many of the honest ones were.
fn trial(per_stage: usize, samples: usize, strength: f64, seed: u64) -> (bool, usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let miners = STAGES * per_stage;
    let harmful = per_stage;
    let mut effect: Vec<f64> = (0..miners).map(|_| 0.01 * gaussian(&mut rng)).collect();
    effect[harmful] += strength;
    let miner_stage: Vec<u32> = (0..miners).map(|m| (m / per_stage) as u32).collect();
    let mut clasp = Clasp::new(STAGES, miner_stage);
    let mut path = [0u32; STAGES];
    for _ in 0..samples {
        let mut loss = 3.0 + NOISE * gaussian(&mut rng);
        for (k, p) in path.iter_mut().enumerate() {
            let m = k * per_stage + rng.gen_range(0..per_stage);
            *p = m as u32;
            loss += effect[m];
        }
        if clasp.add(loss, &path).is_err() {
            return (false, 0);
        }
    }
    let Ok(fit) = clasp.fit(&ClaspConfig::default()) else {
        return (false, 0);
    };
    let caught = fit.effects[harmful].flagged;
    let false_flags = fit
        .effects
        .iter()
        .filter(|e| e.flagged && e.miner as usize != harmful)
        .count();
    (caught, false_flags)
}

fn clasp_power() {
    println!(
        "CLASP at the defaults: {STAGES} stages, per-sample noise {NOISE} nats, z >= 3 and >= 0.02 \
         nats over the stage's median, {TRIALS} trials per cell"
    );
    println!(
        "one harmful miner among honest ones; detection = harmful flagged, FP = honest flagged"
    );
    println!();
    println!("| miners/stage | samples fitted | harmful +nats | detection | FP per honest miner |");
    println!("|---:|---:|---:|---:|---:|");
    for per_stage in [4usize, 8, 16] {
        for (samples, what) in [
            (SAMPLES_PER_EPOCH, "1 epoch"),
            (SAMPLES_PER_EPOCH * WINDOW_EPOCHS, "10 epochs"),
        ] {
            for strength in STRENGTHS {
                let (mut caught, mut false_flags) = (0u64, 0u64);
                for seed in 0..TRIALS {
                    let (c, f) =
                        trial(per_stage, samples, strength, seed * 7919 + per_stage as u64);
                    caught += u64::from(c);
                    false_flags += f as u64;
                }
                let honest = TRIALS * (STAGES * per_stage - 1) as u64;
                println!(
                    "| {per_stage} | {samples} ({what}) | {strength:.1} | {:.1}% | {:.2}% |",
                    100.0 * caught as f64 / TRIALS as f64,
                    100.0 * false_flags as f64 / honest as f64
                );
            }
        }
    }
    println!();
}

/// A cheater's long-run payout against an honest miner's when each epoch it is caught with
/// probability `p`: both claim a score of 1 an epoch; the cheater's caught epochs carry a
/// replay penalty, which zeroes its whole window.
fn payout_ratio(p: f64, epochs: u64, seed: u64) -> f64 {
    let cfg = ScoreConfig::default();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut scores: Vec<EpochScore> = Vec::new();
    let (mut honest, mut cheater) = (0.0, 0.0);
    for epoch in 0..epochs {
        let caught = rng.gen_bool(p);
        for (hotkey, penalty) in [("honest", None), ("cheater", caught.then_some("replay: x"))] {
            scores.push(EpochScore {
                hotkey: hotkey.into(),
                epoch,
                work: 1.0,
                quality: if penalty.is_some() { 0.0 } else { 1.0 },
                score: if penalty.is_some() { 0.0 } else { 1.0 },
                penalty: penalty.map(str::to_owned),
            });
        }
        scores.retain(|s| epoch - s.epoch < cfg.window);
        let totals: BTreeMap<String, f64> = decayed_totals(&scores, &cfg);
        if epoch >= cfg.window {
            honest += totals.get("honest").copied().unwrap_or(0.0);
            cheater += totals.get("cheater").copied().unwrap_or(0.0);
        }
    }
    cheater / honest
}

fn replay_draw_and_payout() {
    let cfg = ScoreConfig::default();
    println!(
        "replay draw: {REPLAYS_PER_EPOCH} replays an epoch among N miners that worked; payout under the \
         score rule (decay {}, window {} epochs, a failed check zeroing the window), 20,000 epochs",
        cfg.decay, cfg.window
    );
    println!();
    println!(
        "| N | replayed per epoch | caught within the window | cheater's payout / honest's (claiming the same work) |"
    );
    println!("|---:|---:|---:|---:|");
    for n in [4usize, 8, 16, 32, 64, 128, 256] {
        let p = (REPLAYS_PER_EPOCH as f64 / n as f64).min(1.0);
        let within = 1.0 - (1.0 - p).powi(cfg.window as i32);
        let ratio = payout_ratio(p, 20_000, n as u64);
        println!(
            "| {n} | {:.1}% | {:.1}% | {ratio:.3} |",
            100.0 * p,
            100.0 * within
        );
    }
    println!();
    println!(
        "merges: every disputed partition is recomputed, so a wrong merge that meets an honest owner's \
         result is caught in its epoch; a colluding pair always does (three owners, all must agree)"
    );
}

fn main() {
    clasp_power();
    replay_draw_and_payout();
}
