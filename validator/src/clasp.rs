//! CLASP: attribute each sample's loss to the miners on its pathway.
//!
//! Every sample travels one random pathway, one miner per stage. The loss of sample `s` is
//! modelled as
//!
//! ```text
//! loss_s = mu + sum over stages k of alpha[k, miner of s at stage k] + noise
//! ```
//!
//! and fitted by least squares over every sample of a window with a small ridge penalty on the
//! `alpha`s (`mu` is not penalised). Shifting every effect of one stage by `c` and `mu` by `-c`
//! leaves the fit unchanged, so among equally good fits the penalty picks the one whose effects
//! sum to zero within each stage: each effect is a miner's loss relative to an average peer of
//! its stage, and under additive effects it is the miner's Shapley value against that peer.
//! Random pathways make the effects identifiable although stages depend on each other.
//!
//! The fit accumulates the normal equations in one pass over the samples (a `(1 + M)²` Gram
//! matrix for `M` miners, `K + 1` nonzeros per sample), so memory does not grow with the number
//! of samples, and solves them with a Cholesky factorisation. The standard error of an effect is
//! that of the contrast "this miner against its stage's average", `sigma² · c'(G + λI)⁻¹c`,
//! which bounds the ridge estimator's variance from above: the penalty never inflates a z-score,
//! so a flag is conservative.

use faer::linalg::solvers::DenseSolveCore;
use faer::{Mat, Side};

/// Settings of a fit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClaspConfig {
    /// Ridge penalty on the effects (in loss² units per sample-equivalent).
    pub ridge: f64,
    /// A miner is flagged when its effect exceeds `min_effect` with a z-score above this.
    pub z_threshold: f64,
    /// Smallest harmful effect worth a flag, in loss units. With enough samples any difference
    /// is significant; this keeps a flag for a miner that is meaningfully worse than its peers,
    /// not one that is merely below a stage average pulled down by a better miner.
    pub min_effect: f64,
    /// Miners with fewer samples are never flagged (too little evidence).
    pub min_samples: u64,
    /// Epochs of samples one fit pools (the scored epoch and those before it): one epoch of 256
    /// samples is too few to flag anyone past about 8 miners a stage (`benches/power.rs`).
    pub window: u64,
    /// Take a stage's median over its miners seen on at least `min_samples` (all of them
    /// where none is): the ridge pulls a little-seen miner's effect towards the stage's mean,
    /// which measures no peer. Off only to recompute epochs scored before this was the rule.
    pub median_of_seen: bool,
}

impl Default for ClaspConfig {
    fn default() -> Self {
        Self {
            ridge: 1.0,
            // Measured on synthetic windows (tests/clasp_simulation.rs): with these, 5,000
            // samples over 3 x 10 miners at 0.3 nats of per-sample noise flag a 0.2-nat harmful
            // miner in nearly every window and an honest one in almost none.
            z_threshold: 3.0,
            min_effect: 0.02,
            min_samples: 30,
            // The score window's length: pooled over 10 epochs of 256 samples, a 0.2-nat
            // harmful miner is flagged in every trial at 4, 8 and 16 miners a stage.
            window: 10,
            median_of_seen: true,
        }
    }
}

/// One miner's fitted effect.
#[derive(Clone, Debug, PartialEq)]
pub struct MinerEffect {
    /// Miner index (as given in the pathways).
    pub miner: u32,
    /// Stage of the miner.
    pub stage: u32,
    /// Effect on the loss: positive means samples through this miner have higher loss.
    pub effect: f64,
    /// `effect` less its stage's median effect: the miner against its stage's median peer,
    /// which the flag and the score's quality judge (against the mean, one miner understating
    /// its losses made every peer look harmful). The median is over the stage's miners seen on
    /// at least `min_samples` samples, or all of them where none is.
    pub over_median: f64,
    /// Standard error of the effect.
    pub std_error: f64,
    /// `effect / std_error`.
    pub z: f64,
    /// Samples that passed through the miner.
    pub samples: u64,
    /// Significantly more harmful than its stage's median miner by more than `min_effect`:
    /// `(effect - median - min_effect) / std_error` above the threshold (`std_error` being the
    /// contrast against the stage's mean, an approximation for the median's).
    pub flagged: bool,
}

/// The result of a fit.
#[derive(Clone, Debug, PartialEq)]
pub struct ClaspFit {
    /// Mean loss of a sample through average miners.
    pub mean: f64,
    /// Residual variance of the loss.
    pub residual_variance: f64,
    /// Samples fitted.
    pub samples: u64,
    /// One entry per miner, in miner-index order.
    pub effects: Vec<MinerEffect>,
}

/// Why a fit failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClaspError {
    /// Not enough samples to fit anything.
    #[error("{0} samples: CLASP needs at least two")]
    TooFewSamples(u64),
    /// A pathway's length is not the number of stages.
    #[error("sample {index}: pathway has {got} stages, the run has {expected}")]
    PathwayLength {
        /// Sample position.
        index: u64,
        /// Its length.
        got: usize,
        /// Stages.
        expected: usize,
    },
    /// A pathway names a miner that is not registered at that stage.
    #[error("sample {index}: miner {miner} is not a miner of stage {stage}")]
    WrongMiner {
        /// Sample position.
        index: u64,
        /// Miner index.
        miner: u32,
        /// Stage.
        stage: usize,
    },
    /// A loss is NaN or infinite.
    #[error("sample {0}: loss is not finite")]
    NonFiniteLoss(u64),
    /// The system could not be solved (a non-positive ridge with unidentifiable effects).
    #[error("the normal equations are singular; use a positive ridge")]
    Singular,
    /// More distinct miners (a hotkey at each stage it served) than a fit takes
    /// ([`MAX_MINERS`]).
    #[error("more than {0} distinct miners on the pathways")]
    TooManyMiners(usize),
}

/// The most distinct miners one fit takes. The fit holds a `(1 + M)²` Gram matrix of f64 and
/// the solver a few copies of it; a subnet has at most a few thousand uids (256 by default), so
/// 4096 miners (a 134 MB matrix) bounds what a sample list from the orchestrator can make the
/// validator allocate without refusing any real subnet.
pub const MAX_MINERS: usize = 4096;

/// Accumulates samples, then fits.
pub struct Clasp {
    miner_stage: Vec<u32>,
    stages: usize,
    /// Gram matrix of the design `[1 | one-hot miners]`, lower triangle filled.
    gram: Vec<f64>,
    xty: Vec<f64>,
    yty: f64,
    counts: Vec<u64>,
    n: u64,
    dim: usize,
}

impl Clasp {
    /// A fit over miners `0..miner_stage.len()`, miner `i` serving stage `miner_stage[i]` of
    /// `stages`. Memory is quadratic in the miners: callers with untrusted input bound them
    /// first ([`fit_samples`] refuses more than [`MAX_MINERS`]).
    pub fn new(stages: usize, miner_stage: Vec<u32>) -> Self {
        let dim = 1 + miner_stage.len();
        Self {
            miner_stage,
            stages,
            gram: vec![0.0; dim * dim],
            xty: vec![0.0; dim],
            yty: 0.0,
            counts: vec![0; dim - 1],
            n: 0,
            dim,
        }
    }

    /// Adds one sample: its loss and the miner at each stage.
    pub fn add(&mut self, loss: f64, pathway: &[u32]) -> Result<(), ClaspError> {
        let index = self.n;
        if !loss.is_finite() {
            return Err(ClaspError::NonFiniteLoss(index));
        }
        if pathway.len() != self.stages {
            return Err(ClaspError::PathwayLength {
                index,
                got: pathway.len(),
                expected: self.stages,
            });
        }
        for (stage, m) in pathway.iter().enumerate() {
            if self.miner_stage.get(*m as usize).copied() != Some(stage as u32) {
                return Err(ClaspError::WrongMiner {
                    index,
                    miner: *m,
                    stage,
                });
            }
        }
        let dim = self.dim;
        // Columns touched by this sample: the intercept and one miner per stage.
        self.gram[0] += 1.0;
        self.xty[0] += loss;
        for (i, m) in pathway.iter().enumerate() {
            let a = 1 + *m as usize;
            self.gram[a * dim] += 1.0;
            self.gram[a * dim + a] += 1.0;
            for b in &pathway[..i] {
                let b = 1 + *b as usize;
                let (hi, lo) = if a > b { (a, b) } else { (b, a) };
                self.gram[hi * dim + lo] += 1.0;
            }
            self.xty[a] += loss;
            self.counts[*m as usize] += 1;
        }
        self.yty += loss * loss;
        self.n += 1;
        Ok(())
    }

    /// Samples added so far.
    pub fn len(&self) -> u64 {
        self.n
    }

    /// Whether no sample was added.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Solves for the effects.
    pub fn fit(&self, cfg: &ClaspConfig) -> Result<ClaspFit, ClaspError> {
        if self.n < 2 {
            return Err(ClaspError::TooFewSamples(self.n));
        }
        let dim = self.dim;
        let gram = |i: usize, j: usize| {
            if i >= j {
                self.gram[i * dim + j]
            } else {
                self.gram[j * dim + i]
            }
        };
        let a = Mat::<f64>::from_fn(dim, dim, |i, j| {
            gram(i, j) + if i == j && i > 0 { cfg.ridge } else { 0.0 }
        });
        let llt = a.llt(Side::Lower).map_err(|_| ClaspError::Singular)?;
        let rhs = Mat::<f64>::from_fn(dim, 1, |i, _| self.xty[i]);
        let beta = faer::linalg::solvers::Solve::solve(&llt, &rhs);
        let beta: Vec<f64> = (0..dim).map(|i| beta[(i, 0)]).collect();
        // RSS = y'y - 2 b'X'y + b'G b, with G the unpenalised Gram.
        let mut bgb = 0.0;
        for i in 0..dim {
            let mut row = 0.0;
            for (j, bj) in beta.iter().enumerate() {
                row += gram(i, j) * bj;
            }
            bgb += beta[i] * row;
        }
        let bxy: f64 = beta.iter().zip(&self.xty).map(|(b, x)| b * x).sum();
        let rss = (self.yty - 2.0 * bxy + bgb).max(0.0);
        let params = dim.min(self.n as usize - 1);
        let dof = (self.n as usize).saturating_sub(params).max(1);
        let sigma2 = rss / dof as f64;
        // An effect is a contrast: the miner against the average of its stage. Its variance
        // c'A⁻¹c cancels the direction the data cannot see (a stage's effects all shifted
        // against the mean), which A⁻¹ alone only bounds by 1/ridge.
        let inverse = llt.inverse();
        let members: Vec<Vec<usize>> = (0..self.stages)
            .map(|k| {
                (0..self.miner_stage.len())
                    .filter(|m| self.miner_stage[*m] as usize == k)
                    .map(|m| 1 + m)
                    .collect()
            })
            .collect();
        let block_mean: Vec<f64> = members
            .iter()
            .map(|cols| {
                let n = cols.len().max(1) as f64;
                let total: f64 = cols
                    .iter()
                    .flat_map(|a| cols.iter().map(move |b| (*a, *b)))
                    .map(|(a, b)| inverse[(a, b)])
                    .sum();
                total / (n * n)
            })
            .collect();
        // A flag measures a miner against its stage's median peer, not the mean: one miner
        // whose samples report far lower losses (a last-stage miner understating them) pulls the
        // mean down and every peer above it, which flagged honest peers. The median moves with a
        // majority only. It is taken over the miners seen on at least `min_samples` (all of
        // them where none is): the ridge pulls a little-seen miner's effect towards the stage's
        // mean, which measures no peer, and an honest miner was flagged against it.
        let medians: Vec<f64> = members
            .iter()
            .map(|cols| {
                let seen: Vec<f64> = cols
                    .iter()
                    .filter(|c| !cfg.median_of_seen || self.counts[**c - 1] >= cfg.min_samples)
                    .map(|c| beta[*c])
                    .collect();
                match seen.is_empty() {
                    true => median(cols.iter().map(|c| beta[*c]).collect()),
                    false => median(seen),
                }
            })
            .collect();
        let effects = self
            .miner_stage
            .iter()
            .enumerate()
            .map(|(m, stage)| {
                let i = 1 + m;
                let effect = beta[i];
                let cols = &members[*stage as usize];
                let n = cols.len().max(1) as f64;
                let row_mean: f64 = cols.iter().map(|j| inverse[(i, *j)]).sum::<f64>() / n;
                let contrast = inverse[(i, i)] - 2.0 * row_mean + block_mean[*stage as usize];
                let std_error = (sigma2 * contrast).max(0.0).sqrt();
                let z = if std_error > 0.0 {
                    effect / std_error
                } else {
                    0.0
                };
                let samples = self.counts[m];
                MinerEffect {
                    miner: m as u32,
                    stage: *stage,
                    effect,
                    std_error,
                    z,
                    samples,
                    over_median: effect - medians[*stage as usize],
                    flagged: samples >= cfg.min_samples
                        && std_error > 0.0
                        && (effect - medians[*stage as usize] - cfg.min_effect) / std_error
                            > cfg.z_threshold,
                }
            })
            .collect();
        Ok(ClaspFit {
            mean: beta[0],
            residual_variance: sigma2,
            samples: self.n,
            effects,
        })
    }
}

/// The median of `values` (the mean of the middle two of an even count; 0 for none).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => values[n / 2],
        _ => 0.5 * (values[n / 2 - 1] + values[n / 2]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The miners a fit flagged.
    fn flagged(fit: &ClaspFit) -> Vec<u32> {
        fit.effects
            .iter()
            .filter(|e| e.flagged)
            .map(|e| e.miner)
            .collect()
    }

    /// Planted effects, random pathways, Gaussian-ish noise.
    fn simulate(
        stages: usize,
        per_stage: usize,
        samples: usize,
        noise: f64,
        effect: impl Fn(usize) -> f64,
        seed: u64,
    ) -> (Clasp, Vec<f64>) {
        let miner_stage: Vec<u32> = (0..stages * per_stage)
            .map(|m| (m / per_stage) as u32)
            .collect();
        let truth: Vec<f64> = (0..stages * per_stage).map(&effect).collect();
        let mut clasp = Clasp::new(stages, miner_stage);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut path = vec![0u32; stages];
        for _ in 0..samples {
            let mut loss = 3.0;
            for (k, p) in path.iter_mut().enumerate() {
                let m = k * per_stage + rng.gen_range(0..per_stage);
                *p = m as u32;
                loss += truth[m];
            }
            // Sum of uniforms: roughly normal, variance noise².
            let u: f64 = (0..12).map(|_| rng.gen_range(0.0..1.0)).sum::<f64>() - 6.0;
            loss += noise * u;
            clasp.add(loss, &path).expect("valid sample");
        }
        (clasp, truth)
    }

    #[test]
    fn recovers_planted_effects_and_flags_the_harmful_miner() {
        // Stage effects centred within each stage, one miner clearly harmful.
        let per_stage = 8;
        let raw = |m: usize| match m {
            5 => 0.3,
            12 => -0.1,
            _ => 0.0,
        };
        let (clasp, truth_raw) = simulate(3, per_stage, 20_000, 0.2, raw, 1);
        let fit = clasp.fit(&ClaspConfig::default()).expect("fit");
        // Compare with the truth centred per stage (the identifiable quantity).
        for k in 0..3 {
            let stage: Vec<usize> = (k * per_stage..(k + 1) * per_stage).collect();
            let mean_truth: f64 =
                stage.iter().map(|m| truth_raw[*m]).sum::<f64>() / per_stage as f64;
            let sum_fit: f64 = stage.iter().map(|m| fit.effects[*m].effect).sum();
            assert!(sum_fit.abs() < 1e-6, "stage {k} effects sum to {sum_fit}");
            for m in stage {
                let want = truth_raw[m] - mean_truth;
                let got = fit.effects[m].effect;
                assert!((got - want).abs() < 0.02, "miner {m}: {got} vs {want}");
            }
        }
        assert_eq!(flagged(&fit), vec![5], "{:?}", fit.effects);
        // A helpful miner has a negative z, never flagged.
        assert!(fit.effects[12].z < -4.0);
        assert!((fit.residual_variance.sqrt() - 0.2).abs() < 0.01);
        assert!((fit.mean - (3.0 + 0.3 / 8.0 - 0.1 / 8.0)).abs() < 0.01);
    }

    #[test]
    fn honest_miners_are_not_flagged() {
        let (clasp, _) = simulate(4, 10, 10_000, 0.3, |_| 0.0, 2);
        let fit = clasp.fit(&ClaspConfig::default()).expect("fit");
        assert!(fit.effects.iter().all(|e| !e.flagged), "{:?}", fit.effects);
        assert!(fit.effects.iter().all(|e| e.effect.abs() < 0.05));
    }

    #[test]
    fn a_miner_understating_its_losses_does_not_get_its_peers_flagged() {
        // Miner 4 of stage 1 reports half of every loss: its effect is far below its peers',
        // which pulls the stage's mean down and every honest peer above it.
        let (clasp, _) = simulate(2, 5, 600, 0.05, |m| if m == 9 { -1.5 } else { 0.0 }, 4);
        let fit = clasp.fit(&ClaspConfig::default()).expect("fit");
        let peers: Vec<&MinerEffect> = fit.effects[5..9].iter().collect();
        assert!(
            peers.iter().all(|e| e.z > 3.0 + 0.02 / e.std_error),
            "against the mean each peer looks harmful: {peers:?}"
        );
        assert!(fit.effects.iter().all(|e| !e.flagged), "{:?}", fit.effects);
        // Against the median the peers are as good as each other, so their quality is whole.
        assert!(
            peers.iter().all(|e| e.over_median.abs() < 0.02),
            "{peers:?}"
        );
        // A harmful miner among them is still flagged.
        let (clasp, _) = simulate(
            2,
            5,
            600,
            0.05,
            |m| match m {
                9 => -1.5,
                6 => 0.2,
                _ => 0.0,
            },
            5,
        );
        let fit = clasp.fit(&ClaspConfig::default()).expect("fit");
        assert_eq!(flagged(&fit), vec![6], "{:?}", fit.effects);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(Vec::new()), 0.0);
    }

    /// The CI failure this guards against: at the last stage, a miner halving its reported
    /// losses, two honest miners seen on many samples and one honest miner seen on two. The
    /// ridge pulls the little-seen miner's effect towards the stage's mean, which the halving
    /// miner holds far below the honest ones; a median counting it fell between the honest
    /// miners and that shrunken estimate, and flagged an honest miner against it.
    #[test]
    fn a_little_seen_miner_does_not_set_its_stages_median() {
        let mut clasp = Clasp::new(2, vec![0, 0, 0, 1, 1, 1, 1]);
        let mut rng = StdRng::seed_from_u64(11);
        let honest_loss = |rng: &mut StdRng| 3.0 + rng.gen_range(-0.1..0.1);
        for i in 0..600u32 {
            let last = 3 + i % 3;
            let loss = honest_loss(&mut rng);
            let reported = if last == 3 { 0.5 * loss } else { loss };
            clasp
                .add(reported, &[rng.gen_range(0..3u32), last])
                .expect("add");
        }
        for i in 0..2u32 {
            clasp.add(honest_loss(&mut rng), &[i, 6]).expect("add");
        }
        let fit = clasp.fit(&ClaspConfig::default()).expect("fit");
        let (halving, honest, little) = (&fit.effects[3], &fit.effects[4..6], &fit.effects[6]);
        assert!(halving.effect < -1.0, "{halving:?}");
        assert!(
            little.effect < honest[0].effect - 0.1,
            "the ridge shrinks the little-seen miner: {little:?}"
        );
        assert!(fit.effects.iter().all(|e| !e.flagged), "{:?}", fit.effects);
        assert!(
            honest.iter().all(|e| e.over_median.abs() < 0.02),
            "the honest miners are the stage's median: {honest:?}"
        );
        // The rule before, kept for recomputing epochs scored under it: both honest miners
        // flagged.
        let before = clasp
            .fit(&ClaspConfig {
                median_of_seen: false,
                ..ClaspConfig::default()
            })
            .expect("fit");
        assert_eq!(flagged(&before), vec![4, 5], "{:?}", before.effects);
    }

    #[test]
    fn little_evidence_is_not_a_flag() {
        // Miner 6 (stage 0) is seen on only five samples, each with a terrible loss.
        let mut clasp = Clasp::new(2, vec![0, 0, 0, 1, 1, 1, 0]);
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..600 {
            let path = [rng.gen_range(0..3u32), rng.gen_range(3..6u32)];
            clasp
                .add(3.0 + rng.gen_range(-0.1..0.1), &path)
                .expect("add");
        }
        for i in 0..5u32 {
            clasp.add(10.0, &[6, 3 + i % 3]).expect("add");
        }
        let strict = clasp.fit(&ClaspConfig::default()).expect("fit");
        assert_eq!(strict.effects[6].samples, 5);
        assert!(strict.effects[6].z > 4.0, "{:?}", strict.effects[6]);
        assert!(
            strict.effects.iter().all(|e| !e.flagged),
            "five samples are too few"
        );
        let lax = clasp
            .fit(&ClaspConfig {
                min_samples: 1,
                ..ClaspConfig::default()
            })
            .expect("fit");
        assert!(lax.effects[6].flagged);
    }

    #[test]
    fn bad_input_is_refused() {
        let mut c = Clasp::new(2, vec![0, 1]);
        assert_eq!(c.add(f64::NAN, &[0, 1]), Err(ClaspError::NonFiniteLoss(0)));
        assert!(matches!(
            c.add(1.0, &[0]),
            Err(ClaspError::PathwayLength { .. })
        ));
        assert!(matches!(
            c.add(1.0, &[1, 0]),
            Err(ClaspError::WrongMiner { .. })
        ));
        assert!(matches!(
            c.add(1.0, &[0, 7]),
            Err(ClaspError::WrongMiner { .. })
        ));
        assert_eq!(c.len(), 0);
        assert_eq!(
            c.fit(&ClaspConfig::default()),
            Err(ClaspError::TooFewSamples(0))
        );
    }
}

/// A CLASP fit over the orchestrator's sample records, by hotkey.
#[derive(Clone, Debug, PartialEq)]
pub struct HotkeyEffects {
    /// The fit; `effects[i]` belongs to `hotkeys[i]`.
    pub fit: ClaspFit,
    /// Miner hotkeys, in effect order.
    pub hotkeys: Vec<String>,
}

impl HotkeyEffects {
    /// Each miner's effect and flag, by hotkey.
    pub fn by_hotkey(&self) -> std::collections::BTreeMap<&str, (f64, bool)> {
        self.keyed(|e| (e.effect, e.flagged))
    }

    /// Each miner's effect over its stage's median and flag, by hotkey: what its score reads.
    pub fn over_median_by_hotkey(&self) -> std::collections::BTreeMap<&str, (f64, bool)> {
        self.keyed(|e| (e.over_median, e.flagged))
    }

    fn keyed<T>(&self, f: impl Fn(&MinerEffect) -> T) -> std::collections::BTreeMap<&str, T> {
        self.fit
            .effects
            .iter()
            .filter_map(|e| {
                self.hotkeys
                    .get(e.miner as usize)
                    .map(|h| (h.as_str(), f(e)))
            })
            .collect()
    }
}

/// Fits CLASP on every sample whose forward pass went all the way (a full pathway and a loss),
/// finished or abandoned after its loss; others are skipped. Abandoned samples count because
/// which ones finish is up to the miners downstream: fitting finished samples only would let a
/// miner that lets the backwards of a rival's low-loss samples lapse make the rival look worse.
///
/// A miner is placed at each stage where it appears: one the orchestrator moved to another stage
/// during the epoch (to fill a stage left empty) is fitted once per stage, and its worst effect
/// is the one it gets (flagged at any stage is flagged). Refusing such an epoch left every
/// miner of it unattributed.
pub fn fit_samples(
    stages: usize,
    samples: &[iota_protocol::api::SampleRecord],
    cfg: &ClaspConfig,
) -> Result<HotkeyEffects, ClaspError> {
    fit_samples_of_at_most(stages, samples, cfg, MAX_MINERS)
}

/// [`fit_samples`], refusing more than `max_miners` distinct (hotkey, stage) pairs.
fn fit_samples_of_at_most(
    stages: usize,
    samples: &[iota_protocol::api::SampleRecord],
    cfg: &ClaspConfig,
    max_miners: usize,
) -> Result<HotkeyEffects, ClaspError> {
    let usable = || {
        samples.iter().filter(|s| {
            (s.status == "done" || s.status == "abandoned")
                && s.pathway.len() == stages
                && s.loss.is_some()
        })
    };
    // One unknown per (hotkey, stage).
    let mut index: std::collections::HashMap<(&str, u32), u32> = std::collections::HashMap::new();
    let mut placed: Vec<&str> = Vec::new();
    let mut miner_stage: Vec<u32> = Vec::new();
    for s in usable() {
        for (k, h) in s.pathway.iter().enumerate() {
            let key = (h.as_str(), k as u32);
            if index.contains_key(&key) {
                continue;
            }
            // Counted before anything is sized from them.
            if placed.len() >= max_miners {
                return Err(ClaspError::TooManyMiners(max_miners));
            }
            index.insert(key, placed.len() as u32);
            placed.push(h);
            miner_stage.push(k as u32);
        }
    }
    // Each epoch's losses about its own mean: the model trains between epochs, so a pooled fit
    // would otherwise charge the miners of early epochs with the loss the run has since shed.
    // (Within one epoch this only moves `mu`, which is not penalised.)
    let mut sums: std::collections::HashMap<u64, (f64, u64)> = std::collections::HashMap::new();
    for s in usable() {
        let e = sums.entry(s.epoch).or_default();
        e.0 += s.loss.unwrap_or_default();
        e.1 += 1;
    }
    let mean = |epoch: u64| sums.get(&epoch).map_or(0.0, |(sum, n)| sum / *n as f64);
    let mut clasp = Clasp::new(stages, miner_stage);
    let mut path = vec![0u32; stages];
    for s in usable() {
        for (k, (p, h)) in path.iter_mut().zip(&s.pathway).enumerate() {
            *p = index
                .get(&(h.as_str(), k as u32))
                .copied()
                .unwrap_or_default();
        }
        clasp.add(s.loss.unwrap_or_default() - mean(s.epoch), &path)?;
    }
    let fit = clasp.fit(cfg)?;
    Ok(worst_per_hotkey(fit, &placed))
}

/// `fit` (over `placed[i]` at their stages) with one effect per hotkey: for a hotkey placed at
/// several stages, a flagged effect before an unflagged one, then the larger over its stage's
/// median.
fn worst_per_hotkey(fit: ClaspFit, placed: &[&str]) -> HotkeyEffects {
    let mut hotkeys: Vec<String> = Vec::new();
    let mut effects: Vec<MinerEffect> = Vec::new();
    let mut at: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for e in fit.effects {
        let Some(h) = placed.get(e.miner as usize).copied() else {
            continue;
        };
        match at.get(h) {
            None => {
                at.insert(h, effects.len());
                hotkeys.push(h.to_owned());
                effects.push(MinerEffect {
                    miner: effects.len() as u32,
                    ..e
                });
            }
            Some(&i) => {
                let kept = &effects[i];
                if (e.flagged, e.over_median) > (kept.flagged, kept.over_median) {
                    effects[i] = MinerEffect {
                        miner: i as u32,
                        ..e
                    };
                }
            }
        }
    }
    HotkeyEffects {
        fit: ClaspFit { effects, ..fit },
        hotkeys,
    }
}

#[cfg(test)]
mod record_tests {
    use super::*;
    use iota_protocol::api::SampleRecord;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Ten epochs of 256 samples over 12 miners a stage, the loss falling 0.3 nats an epoch as
    /// the run trains. One epoch gives each miner about 21 samples, under the 30 a flag needs;
    /// pooled, the harmful miner is flagged. A miner that left halfway and the one that took its
    /// place are judged against their own epochs, not charged or credited with the drift.
    #[test]
    fn a_window_pools_epochs_about_their_own_means() {
        let mut rng = StdRng::seed_from_u64(17);
        let mut samples = Vec::new();
        for epoch in 0..10u64 {
            let stage0: Vec<String> = (0..12)
                .map(|i| match (i, epoch) {
                    (0, 0..5) => "early".to_owned(),
                    (0, _) => "late".to_owned(),
                    _ => format!("a{i}"),
                })
                .collect();
            for i in 0..256 {
                let pathway = vec![
                    stage0[rng.gen_range(0..12)].clone(),
                    format!("b{}", rng.gen_range(0..12)),
                ];
                let harm = if pathway[1] == "b3" { 0.2 } else { 0.0 };
                samples.push(SampleRecord {
                    sample_id: (epoch * 1000 + i) as i64,
                    epoch,
                    status: "done".into(),
                    loss: Some(5.0 - 0.3 * epoch as f64 + harm + rng.gen_range(-0.5..0.5)),
                    sequence_losses: None,
                    pathway,
                });
            }
        }
        let flagged = |f: &HotkeyEffects| -> Vec<String> {
            f.by_hotkey()
                .into_iter()
                .filter(|(_, (_, flagged))| *flagged)
                .map(|(h, _)| h.to_owned())
                .collect()
        };
        let last: Vec<SampleRecord> = samples.iter().filter(|s| s.epoch == 9).cloned().collect();
        let one = fit_samples(2, &last, &ClaspConfig::default()).expect("one epoch");
        assert!(flagged(&one).is_empty(), "{:?}", one.by_hotkey());
        let window = fit_samples(2, &samples, &ClaspConfig::default()).expect("window");
        assert_eq!(window.fit.samples, 2560);
        assert_eq!(flagged(&window), vec!["b3".to_owned()]);
        let over = window.over_median_by_hotkey();
        for h in ["early", "late"] {
            assert!(over[h].0.abs() < 0.05, "{h}: {:?}", over[h]);
        }
    }

    #[test]
    fn fits_sample_records_by_hotkey() {
        let mut rng = StdRng::seed_from_u64(9);
        let names = [["a0", "a1", "a2"], ["b0", "b1", "b2"]];
        let mut samples: Vec<SampleRecord> = (0..3000)
            .map(|i| {
                let pathway: Vec<String> = names
                    .iter()
                    .map(|stage| stage[rng.gen_range(0..3)].to_owned())
                    .collect();
                let bad = pathway.iter().any(|h| h == "b1");
                SampleRecord {
                    sample_id: i,
                    epoch: 0,
                    status: "done".into(),
                    loss: Some(3.0 + if bad { 0.5 } else { 0.0 } + rng.gen_range(-0.1..0.1)),
                    sequence_losses: None,
                    pathway,
                }
            })
            .collect();
        // Samples whose forward did not reach the loss are ignored, whatever they claim, and
        // so are samples still travelling (a record read before the epoch ended): only done or
        // abandoned ones are final.
        samples.push(SampleRecord {
            sample_id: -1,
            epoch: 0,
            status: "abandoned".into(),
            pathway: vec!["a0".into()],
            loss: Some(100.0),
            sequence_losses: None,
        });
        for (id, status) in [(-2, "backward"), (-3, "forward")] {
            samples.push(SampleRecord {
                sample_id: id,
                epoch: 0,
                status: status.into(),
                pathway: vec!["a0".into(), "b0".into()],
                loss: Some(100.0),
                sequence_losses: None,
            });
        }
        let fitted = fit_samples(2, &samples, &ClaspConfig::default()).expect("fit");
        assert_eq!(fitted.fit.samples, 3000);
        let flagged: Vec<&str> = fitted
            .fit
            .effects
            .iter()
            .filter(|e| e.flagged)
            .map(|e| fitted.hotkeys[e.miner as usize].as_str())
            .collect();
        assert_eq!(flagged, vec!["b1"]);
    }

    /// Samples through `names`, one miner per stage at random; loss 3 plus 0.5 for each
    /// (hotkey, stage) in `bad` on the pathway, plus noise.
    fn records(seed: u64, names: &[[&str; 3]; 2], bad: &[(&str, usize)]) -> Vec<SampleRecord> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..3000)
            .map(|i| {
                let pathway: Vec<String> = names
                    .iter()
                    .map(|stage| stage[rng.gen_range(0..3)].to_owned())
                    .collect();
                let harm = bad.iter().filter(|(h, k)| pathway[*k] == *h).count() as f64;
                SampleRecord {
                    sample_id: i,
                    epoch: 0,
                    status: "done".into(),
                    loss: Some(3.0 + 0.5 * harm + rng.gen_range(-0.1..0.1)),
                    sequence_losses: None,
                    pathway,
                }
            })
            .collect()
    }

    #[test]
    fn a_miner_moved_between_stages_is_fitted_at_each_and_keeps_its_worst() {
        // "m" served stage 0 for the first half of the epoch, then was moved to stage 1.
        let before = [["a0", "m", "a2"], ["b0", "b1", "b2"]];
        let after = [["a0", "a1", "a2"], ["b0", "m", "b2"]];
        for (bad, harmful_at) in [((&"m", 0usize), 0u32), ((&"m", 1), 1)] {
            let mut samples = records(5, &before, &[(bad.0, bad.1)]);
            samples.extend(records(6, &after, &[(bad.0, bad.1)]));
            let fitted = fit_samples(2, &samples, &ClaspConfig::default())
                .expect("an epoch with a moved miner is fitted");
            assert_eq!(fitted.fit.samples, 6000);
            // One effect per hotkey, each pointing at its own hotkey.
            let mut hotkeys = fitted.hotkeys.clone();
            hotkeys.sort();
            hotkeys.dedup();
            assert_eq!(hotkeys.len(), fitted.hotkeys.len(), "{:?}", fitted.hotkeys);
            assert_eq!(fitted.fit.effects.len(), fitted.hotkeys.len());
            for (i, e) in fitted.fit.effects.iter().enumerate() {
                assert_eq!(e.miner as usize, i);
            }
            let by = fitted.by_hotkey();
            let flagged: Vec<&str> = by
                .iter()
                .filter(|(_, (_, f))| *f)
                .map(|(h, _)| *h)
                .collect();
            assert_eq!(flagged, vec!["m"], "harmful at stage {harmful_at}: {by:?}");
            let m = fitted
                .fit
                .effects
                .iter()
                .find(|e| fitted.hotkeys[e.miner as usize] == "m")
                .expect("m");
            assert_eq!(m.stage, harmful_at, "{m:?}");
        }
    }

    #[test]
    fn letting_a_rivals_good_samples_lapse_does_not_make_it_look_worse() {
        // No miner is worse than another; a downstream miner lets the backwards of a1's
        // better-than-average samples lapse, so only a1's worse ones finish.
        let mut rng = StdRng::seed_from_u64(11);
        let names = [["a0", "a1", "a2"], ["b0", "b1", "b2"]];
        let samples: Vec<SampleRecord> = (0..3000)
            .map(|i| {
                let pathway: Vec<String> = names
                    .iter()
                    .map(|stage| stage[rng.gen_range(0..3)].to_owned())
                    .collect();
                let loss = 3.0 + rng.gen_range(-0.1..0.1);
                let lapsed = pathway[0] == "a1" && loss < 3.0;
                SampleRecord {
                    sample_id: i,
                    epoch: 0,
                    status: if lapsed { "abandoned" } else { "done" }.into(),
                    loss: Some(loss),
                    sequence_losses: None,
                    pathway,
                }
            })
            .collect();
        let flagged = |fitted: &HotkeyEffects| -> Vec<String> {
            fitted
                .fit
                .effects
                .iter()
                .filter(|e| e.flagged)
                .map(|e| fitted.hotkeys[e.miner as usize].clone())
                .collect()
        };
        // Fitted on finished samples only, the selection frames a1.
        let finished: Vec<SampleRecord> = samples
            .iter()
            .filter(|s| s.status == "done")
            .cloned()
            .collect();
        let framed = fit_samples(2, &finished, &ClaspConfig::default()).expect("fit");
        assert_eq!(flagged(&framed), ["a1"], "the selection does not bite");
        // Every sample with a loss: nobody stands out.
        let fitted = fit_samples(2, &samples, &ClaspConfig::default()).expect("fit");
        assert_eq!(fitted.fit.samples, 3000);
        assert!(flagged(&fitted).is_empty(), "{:?}", flagged(&fitted));
    }

    #[test]
    fn too_many_distinct_miners_are_refused_before_the_fit_is_sized() {
        // Two stages of three miners, every pairing once (a fit needs a few samples each).
        let mut samples: Vec<SampleRecord> = (0..60)
            .map(|i| SampleRecord {
                sample_id: i,
                epoch: 0,
                status: "done".into(),
                pathway: vec![format!("a{}", i % 3), format!("b{}", (i / 3) % 3)],
                loss: Some(3.0 + (i % 7) as f64 * 0.01),
                sequence_losses: None,
            })
            .collect();
        let cfg = ClaspConfig::default();
        let fitted = fit_samples_of_at_most(2, &samples, &cfg, 6).expect("at the bound");
        assert_eq!(fitted.hotkeys.len(), 6);
        // One more distinct hotkey: refused (100k of them asked for an 80 GB Gram matrix).
        samples[5].pathway[1] = "b-new".into();
        assert_eq!(
            fit_samples_of_at_most(2, &samples, &cfg, 6),
            Err(ClaspError::TooManyMiners(6))
        );
        // The service's bound is the documented one.
        assert_eq!(
            fit_samples(2, &samples, &cfg).map(|f| f.hotkeys.len()),
            Ok(7)
        );
    }
}
