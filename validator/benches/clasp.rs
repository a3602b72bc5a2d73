//! CLASP at the scale: a million samples over a thousand miners in one window.
//!
//! `cargo bench -p iota-validator --bench clasp` prints the time to accumulate the samples and the
//! time to solve, for 10^4, 10^5 and 10^6 samples with 100 and 1,000 miners over 5 stages.

use std::time::Instant;

use iota_validator::{Clasp, ClaspConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn run(stages: usize, per_stage: usize, samples: usize) {
    let miner_stage: Vec<u32> = (0..stages * per_stage)
        .map(|m| (m / per_stage) as u32)
        .collect();
    let mut rng = StdRng::seed_from_u64(7);
    let mut pathways = Vec::with_capacity(samples * stages);
    let mut losses = Vec::with_capacity(samples);
    for _ in 0..samples {
        let mut loss = 3.0 + rng.gen_range(-0.2..0.2);
        for k in 0..stages {
            let m = (k * per_stage + rng.gen_range(0..per_stage)) as u32;
            if m.is_multiple_of(97) {
                loss += 0.3;
            }
            pathways.push(m);
        }
        losses.push(loss);
    }
    let start = Instant::now();
    let mut clasp = Clasp::new(stages, miner_stage);
    for (i, loss) in losses.iter().enumerate() {
        if let Err(e) = clasp.add(*loss, &pathways[i * stages..(i + 1) * stages]) {
            eprintln!("bad sample: {e}");
            return;
        }
    }
    let accumulate = start.elapsed();
    let start = Instant::now();
    let fit = match clasp.fit(&ClaspConfig::default()) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("fit failed: {e}");
            return;
        }
    };
    let solve = start.elapsed();
    let flagged = fit.effects.iter().filter(|e| e.flagged).count();
    println!(
        "{stages} stages x {per_stage} miners, {samples} samples: accumulate {:.3} s, solve {:.3} s, {flagged} flagged",
        accumulate.as_secs_f64(),
        solve.as_secs_f64()
    );
}

fn main() {
    // 10^4, 10^5 and 10^6 samples with 100 and 1,000 miners (5 stages).
    for samples in [10_000, 100_000, 1_000_000] {
        for per_stage in [20, 200] {
            run(5, per_stage, samples);
        }
    }
}
