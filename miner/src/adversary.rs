//! Dishonest behaviours, for testing validators. Off unless `--adversary` names one; the honest
//! path never consults this module except through [`Adversary`] checks at the points where a
//! cheater would deviate.

use iota_protocol::api::RunConfig;
use iota_protocol::tensor::encode_merged;
use rand::Rng;
use rand::rngs::StdRng;

use crate::error::MinerError;

/// One way of cheating.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum Adversary {
    /// Adds Gaussian noise (one standard deviation of the activations) to forward outputs.
    Noise,
    /// Sends zeros instead of activations and input gradients.
    Zeros,
    /// Never loads the merged weights after the first epoch: trains, and computes its
    /// pseudo-gradient, on its own stale weights.
    StaleWeights,
    /// Claims backward work without doing it: zero input gradients, no optimizer steps, so a
    /// zero pseudo-gradient.
    Freeload,
    /// Publishes merged partitions that are not the average (the first value shifted by an
    /// amount of its own hotkey's, so two of them never agree).
    WrongMerge,
    /// Publishes the same wrong merge as every other miner in this mode (the first value
    /// shifted by 1): a colluding pair that owns a partition together agrees on it.
    ColludingMerge,
    /// Reports last-stage losses at half of what it computed.
    LazyLoss,
    /// Reports a last-stage loss at half of what it computed, without the per-sequence losses a
    /// replay could check it against.
    ForgeLoss,
    /// Trains, then reserves the upload of its pseudo-gradient and never makes it: its hops are
    /// claimed, its training never reaches the model, and its reservation holds the phase open.
    Withhold,
    /// Holds its merges back until just before the round's deadline, then publishes a wrong one
    /// (shifted as [`Adversary::WrongMerge`]'s), hoping to be the only result when the others are
    /// slow.
    LateLoneMerge,
    /// Claims ten times the throughput it measured, at registration and in its heartbeats, and
    /// idles after each hop (twice its compute, at least a second): a claim that drew work to it
    /// would stall the samples it holds.
    ClaimSpeed,
}

impl Adversary {
    /// The flag value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Noise => "noise",
            Self::Zeros => "zeros",
            Self::StaleWeights => "stale-weights",
            Self::Freeload => "freeload",
            Self::WrongMerge => "wrong-merge",
            Self::ColludingMerge => "colluding-merge",
            Self::LazyLoss => "lazy-loss",
            Self::ForgeLoss => "forge-loss",
            Self::Withhold => "withhold",
            Self::LateLoneMerge => "late-lone-merge",
            Self::ClaimSpeed => "claim-speed",
        }
    }

    /// How many miners act out this mode together: two colluding mergers, one of the others.
    pub fn miners(self) -> usize {
        match self {
            Self::ColludingMerge => 2,
            _ => 1,
        }
    }

    /// Whether the mode acts only at the last stage (it forges the losses computed there): a
    /// devnet puts such a miner there, where it cheats, not where it would be honest.
    pub fn acts_at_the_last_stage(self) -> bool {
        matches!(self, Self::LazyLoss | Self::ForgeLoss)
    }

    /// Every mode, for tests and help texts.
    pub const ALL: [Adversary; 11] = [
        Self::Noise,
        Self::Zeros,
        Self::StaleWeights,
        Self::Freeload,
        Self::WrongMerge,
        Self::ColludingMerge,
        Self::LazyLoss,
        Self::ForgeLoss,
        Self::Withhold,
        Self::LateLoneMerge,
        Self::ClaimSpeed,
    ];
}

impl std::fmt::Display for Adversary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How much more throughput [`Adversary::ClaimSpeed`] claims than it measured.
pub const CLAIMED_SPEED_FACTOR: f64 = 10.0;

/// How long [`Adversary::ClaimSpeed`] idles after each hop, in multiples of the hop's compute…
pub const IDLE_PER_COMPUTE: u32 = 2;

/// …and at least this long: a slow card, whatever the model's size.
pub const MIN_IDLE: std::time::Duration = std::time::Duration::from_secs(1);

/// How long before a merge round's deadline [`Adversary::LateLoneMerge`] publishes, in ms.
pub const LATE_MERGE_MARGIN_MS: i64 = 1_500;

/// Whether a [`Adversary::LateLoneMerge`] miner still holds back a merge due at `deadline_ms`
/// at `now_ms` (both Unix ms).
pub fn holds_merge_back(adversary: Option<Adversary>, now_ms: i64, deadline_ms: i64) -> bool {
    adversary == Some(Adversary::LateLoneMerge) && now_ms < deadline_ms - LATE_MERGE_MARGIN_MS
}

/// Factor applied to reported losses by [`Adversary::LazyLoss`] and [`Adversary::ForgeLoss`].
pub const LAZY_LOSS_FACTOR: f32 = 0.5;

/// Adds zero-mean Gaussian noise with the values' own standard deviation (Box–Muller).
pub fn add_noise(values: &mut [f32], rng: &mut StdRng) {
    let n = values.len().max(1) as f64;
    let mean = values.iter().map(|v| f64::from(*v)).sum::<f64>() / n;
    let var = values
        .iter()
        .map(|v| (f64::from(*v) - mean).powi(2))
        .sum::<f64>()
        / n;
    let sigma = var.sqrt().max(1e-3);
    for v in values.iter_mut() {
        let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
        let u2: f64 = rng.gen_range(0.0..1.0);
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        *v += (sigma * z) as f32;
    }
}

/// The corruption a wrong merger applies to a merged partition: `shift` added to the first value.
pub fn corrupt_merge(values: &mut [f32], shift: f32) {
    if let Some(first) = values.first_mut() {
        *first += shift;
    }
}

/// What [`Adversary::WrongMerge`] adds: in [1, 2), from the hotkey, so lone wrong mergers
/// disagree with each other as well as with the honest owners.
fn own_shift(hotkey: &str) -> f32 {
    let h = blake3::hash(hotkey.as_bytes());
    let bits = u16::from_le_bytes([h.as_bytes()[0], h.as_bytes()[1]]);
    1.0 + f32::from(bits) / 65_536.0
}

/// A partition owner's merge ([`iota_trainer::merged_values`]) as published bytes, corrupted
/// when `adversary` is [`Adversary::WrongMerge`] or [`Adversary::LateLoneMerge`] (by `hotkey`'s
/// own shift) or
/// [`Adversary::ColludingMerge`] (by the shift every colluder uses).
pub fn merged_partition(
    run: &RunConfig,
    contributions: &[(f64, Vec<f32>)],
    (weights, momentum): (Vec<f32>, Vec<f32>),
    adversary: Option<Adversary>,
    hotkey: &str,
) -> Result<Vec<u8>, MinerError> {
    let (mut weights, momentum) =
        iota_trainer::merged_values(run, contributions, weights, momentum)?;
    match adversary {
        Some(Adversary::WrongMerge | Adversary::LateLoneMerge) => {
            corrupt_merge(&mut weights, own_shift(hotkey))
        }
        Some(Adversary::ColludingMerge) => corrupt_merge(&mut weights, 1.0),
        _ => {}
    }
    Ok(encode_merged(&weights, &momentum))
}

/// A sparse run's merged update ([`iota_trainer::sparse::merged_update`]), corrupted as
/// [`merged_partition`] corrupts a dense one: the first chunk's scale shifted (a shift keeps it
/// a valid scale, so only a recomputation tells it apart).
pub fn merged_update(
    run: &RunConfig,
    stage: u32,
    partition: u32,
    contributions: &[(f64, iota_trainer::sparse::SparseVector)],
    adversary: Option<Adversary>,
    hotkey: &str,
) -> Result<Vec<u8>, MinerError> {
    use iota_trainer::sparse::{decode, encode, merged_shape, merged_update};
    let honest = merged_update(run, stage, partition, contributions)?;
    let shift = match adversary {
        Some(Adversary::WrongMerge | Adversary::LateLoneMerge) => own_shift(hotkey),
        Some(Adversary::ColludingMerge) => 1.0,
        _ => return Ok(honest),
    };
    let mut v = decode(&honest, merged_shape(run, stage, partition)?)?;
    if let Some(s) = v.scales.first_mut() {
        *s += shift;
    }
    Ok(encode(&v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn noise_has_the_values_scale() {
        let mut rng = StdRng::seed_from_u64(3);
        let clean: Vec<f32> = (0..20_000)
            .map(|i| ((i % 200) as f32 - 100.0) / 50.0)
            .collect();
        let mut noisy = clean.clone();
        add_noise(&mut noisy, &mut rng);
        let n = clean.len() as f64;
        let std = |v: &[f32]| {
            let m = v.iter().map(|x| f64::from(*x)).sum::<f64>() / n;
            (v.iter().map(|x| (f64::from(*x) - m).powi(2)).sum::<f64>() / n).sqrt()
        };
        let diff: Vec<f32> = noisy.iter().zip(&clean).map(|(a, b)| a - b).collect();
        let ratio = std(&diff) / std(&clean);
        assert!(
            (ratio - 1.0).abs() < 0.05,
            "noise std / signal std = {ratio}"
        );
    }

    #[test]
    fn wrong_merge_changes_the_first_value_only() {
        let mut v = vec![0.5f32, 2.0, 3.0];
        corrupt_merge(&mut v, 1.0);
        assert_eq!(v, vec![1.5, 2.0, 3.0]);
    }

    #[test]
    fn a_late_merger_holds_back_until_the_margin() {
        let late = Some(Adversary::LateLoneMerge);
        assert!(holds_merge_back(late, 10_000, 20_000));
        assert!(holds_merge_back(late, 18_499, 20_000));
        assert!(!holds_merge_back(late, 18_500, 20_000));
        assert!(!holds_merge_back(None, 10_000, 20_000));
        assert!(!holds_merge_back(
            Some(Adversary::WrongMerge),
            10_000,
            20_000
        ));
    }

    #[test]
    fn flag_names_round_trip() {
        use clap::ValueEnum as _;
        for a in Adversary::ALL {
            assert_eq!(Adversary::from_str(a.as_str(), false), Ok(a));
        }
    }
}
