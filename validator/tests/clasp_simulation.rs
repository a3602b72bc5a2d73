//! CLASP on synthetic windows: honest miners (small genuine differences) and harmful ones of
//! several strengths, many seeds. Reports and checks the detection rate (target: at least 95% of
//! harmful miners flagged within one window), the false-positive rate (at most 1% of honest
//! miners) and how closely honest scores track the work done. No chain, no network.

use iota_validator::score::{ScoreConfig, quality};
use iota_validator::{Clasp, ClaspConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const STAGES: usize = 3;
const PER_STAGE: usize = 10;
const SAMPLES: usize = 5_000;
const SEEDS: u64 = 60;
/// Extra loss a harmful miner adds to the samples through it (nats).
const STRENGTHS: [f64; 3] = [0.2, 0.3, 0.5];
/// Per-sample loss noise (nats).
const NOISE: f64 = 0.3;

fn gaussian(rng: &mut StdRng) -> f64 {
    let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
    let u2: f64 = rng.gen_range(0.0..1.0);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[test]
fn clasp_flags_harmful_miners_and_spares_honest_ones() {
    let cfg = ClaspConfig::default();
    let score_cfg = ScoreConfig::default();
    let (mut harmful, mut caught, mut honest, mut false_pos) = (0u32, 0u32, 0u32, 0u32);
    let mut caught_by_strength = [0u32; 3];
    let (mut rel_dev_sum, mut rel_dev_n) = (0f64, 0u32);
    for seed in 0..SEEDS {
        let mut rng = StdRng::seed_from_u64(seed);
        let miners = STAGES * PER_STAGE;
        let miner_stage: Vec<u32> = (0..miners).map(|m| (m / PER_STAGE) as u32).collect();
        // Genuine small differences between honest miners, and three harmful ones at random.
        let mut effect: Vec<f64> = (0..miners).map(|_| 0.01 * gaussian(&mut rng)).collect();
        let mut bad: Vec<Option<usize>> = vec![None; miners];
        for (i, strength) in STRENGTHS.iter().enumerate() {
            let m = loop {
                let m = rng.gen_range(0..miners);
                if bad[m].is_none() {
                    break m;
                }
            };
            bad[m] = Some(i);
            effect[m] += strength;
        }
        // Miners differ in speed, so in how many samples they carry (routing by throughput).
        let speed: Vec<f64> = (0..miners).map(|_| rng.gen_range(0.5..2.0)).collect();
        let mut work = vec![0u64; miners];
        let mut clasp = Clasp::new(STAGES, miner_stage);
        for _ in 0..SAMPLES {
            let mut path = [0u32; STAGES];
            let mut loss = 3.0 + NOISE * gaussian(&mut rng);
            for (k, p) in path.iter_mut().enumerate() {
                let total: f64 = speed[k * PER_STAGE..(k + 1) * PER_STAGE].iter().sum();
                let mut x = rng.gen_range(0.0..total);
                let mut m = k * PER_STAGE;
                while x >= speed[m] && m + 1 < (k + 1) * PER_STAGE {
                    x -= speed[m];
                    m += 1;
                }
                *p = m as u32;
                loss += effect[m];
                work[m] += 1;
            }
            clasp.add(loss, &path).expect("sample");
        }
        let fit = clasp.fit(&cfg).expect("fit");
        for e in &fit.effects {
            let m = e.miner as usize;
            match bad[m] {
                Some(i) => {
                    harmful += 1;
                    if e.flagged {
                        caught += 1;
                        caught_by_strength[i] += 1;
                    }
                }
                None => {
                    honest += 1;
                    false_pos += u32::from(e.flagged);
                    let (q, _) = quality(Some(e.effect), e.flagged, None, &score_cfg);
                    // How far an honest miner's score is from its work, relatively.
                    rel_dev_sum += 1.0 - q;
                    rel_dev_n += 1;
                }
            }
        }
    }
    let detection = f64::from(caught) / f64::from(harmful);
    let fp_rate = f64::from(false_pos) / f64::from(honest);
    let mean_dev = rel_dev_sum / f64::from(rel_dev_n);
    eprintln!(
        "CLASP over {SEEDS} windows of {SAMPLES} samples, {STAGES}x{PER_STAGE} miners, noise {NOISE}: \
         detection {caught}/{harmful} = {detection:.3} (by strength {STRENGTHS:?}: {caught_by_strength:?} of {SEEDS} each), \
         false positives {false_pos}/{honest} = {fp_rate:.4}, honest score = work x quality with mean shortfall {mean_dev:.4}"
    );
    assert!(detection >= 0.95, "detection {detection}");
    assert!(fp_rate <= 0.01, "false positives {fp_rate}");
    assert!(
        mean_dev < 0.1,
        "honest scores track work within 10% on average: {mean_dev}"
    );
}
