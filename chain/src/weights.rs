//! Weight vectors in the shape the Python SDK sends them, and the commit-reveal v2 hash.
//!
//! The functions mirror `bittensor/utils/weight_utils.py` from bittensor 10.2.0 (which requires
//! NumPy 2), so a Rust validator puts the same `u16` values on chain as a Python one given the
//! same scores:
//!
//! * [`convert_weights_and_uids_for_emit`]: max-upscale to `u16`, round half to even, drop zeros.
//! * [`normalize_max_weight`]: sum to 1 with no element above a limit. Generic over `f32` and
//!   `f64`; each follows NumPy's arithmetic for arrays of that dtype, including NumPy's pairwise
//!   summation and NEP 50 scalar promotion, so results match bit for bit.
//! * [`process_weights`]: the SDK's pre-processing against the subnet's `MinAllowedWeights`,
//!   `MaxWeightsLimit` and an exclusion quantile.
//! * [`commit_hash`] and [`generate_salt`] for `commit_weights` / `reveal_weights`.
//!
//! Unlike the SDK, NaN, infinite and negative weights are rejected with a [`WeightsError`]
//! instead of flowing on to the chain.

use parity_scale_codec::Encode;
use rand::Rng;

/// Largest on-chain weight value; the SDK scales the largest weight to this.
pub const U16_MAX: u16 = u16::MAX;

/// Salt length used by [`generate_salt`] when a caller has no preference.
pub const DEFAULT_SALT_LEN: usize = 8;

/// Stability term of the SDK's `normalize_max_weight`.
const EPSILON: f64 = 1e-7;

/// Why a weight vector was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum WeightsError {
    /// `uids` and `weights` differ in length.
    #[error("uids and weights must have the same length, got {uids} uids and {weights} weights")]
    LengthMismatch {
        /// Number of uids.
        uids: usize,
        /// Number of weights.
        weights: usize,
    },
    /// No weights were passed (the SDK raises on this too).
    #[error("no weights were given")]
    Empty,
    /// A weight is NaN or infinite.
    #[error("weight at index {index} is not a finite number ({value})")]
    NotFinite {
        /// Position in the input.
        index: usize,
        /// The offending value.
        value: f64,
    },
    /// A weight is below zero; the chain only stores non-negative weights.
    #[error("weight at index {index} is negative ({value}); weights must be >= 0")]
    Negative {
        /// Position in the input.
        index: usize,
        /// The offending value.
        value: f64,
    },
    /// The max-weight limit is NaN, infinite or negative.
    #[error("max weight limit must be a finite number >= 0, got {limit}")]
    InvalidLimit {
        /// The offending limit.
        limit: f64,
    },
    /// `process_weights` fills a vector of `num_neurons` entries by input position (as the SDK
    /// does), and a non-zero weight sits past its end.
    #[error("weight at index {index} does not fit a subnet of {num_neurons} neurons")]
    IndexOutOfRange {
        /// Position in the input.
        index: usize,
        /// Subnet size that was passed.
        num_neurons: usize,
    },
    /// More neurons than `u16` uids can address.
    #[error("a subnet of {num_neurons} neurons cannot be addressed with u16 uids")]
    TooManyNeurons {
        /// Subnet size that was passed.
        num_neurons: usize,
    },
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// Floating-point element types the weight functions accept: `f32` and `f64`.
///
/// The arithmetic is done in the element type, as NumPy does for an array of that dtype.
pub trait WeightFloat:
    sealed::Sealed
    + Copy
    + PartialOrd
    + std::fmt::Debug
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    /// Additive identity.
    const ZERO: Self;
    /// Multiplicative identity.
    const ONE: Self;
    /// Nearest value of this type (NumPy's cast of a Python float).
    fn from_f64(v: f64) -> Self;
    /// Exact widening to `f64`.
    fn to_f64(self) -> f64;
    /// Nearest value of this type (NumPy's cast of a Python int).
    fn from_usize(n: usize) -> Self;
}

impl WeightFloat for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    #[allow(clippy::cast_possible_truncation)]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    #[allow(clippy::cast_precision_loss)]
    fn from_usize(n: usize) -> Self {
        n as f32
    }
}

impl WeightFloat for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    fn from_f64(v: f64) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
    #[allow(clippy::cast_precision_loss)]
    fn from_usize(n: usize) -> Self {
        n as f64
    }
}

/// Rejects NaN, infinities and negative values. `-0.0` is accepted, as in the SDK.
fn check_weights<T: WeightFloat>(weights: &[T]) -> Result<(), WeightsError> {
    for (index, w) in weights.iter().enumerate() {
        let value = w.to_f64();
        if !value.is_finite() {
            return Err(WeightsError::NotFinite { index, value });
        }
        if value < 0.0 {
            return Err(WeightsError::Negative { index, value });
        }
    }
    Ok(())
}

/// `ndarray.sum()` for a contiguous 1-D array: NumPy's pairwise summation, which unrolls
/// eight accumulators up to 128 elements and splits larger inputs in two. Plain left-to-right
/// addition differs in the last bits, which would break bit-for-bit agreement with the SDK.
fn np_sum<T: WeightFloat>(a: &[T]) -> T {
    const BLOCK: usize = 128;
    let n = a.len();
    if n < 8 {
        a.iter().fold(T::ZERO, |acc, &x| acc + x)
    } else if n <= BLOCK {
        let mut r = [T::ZERO; 8];
        r.copy_from_slice(&a[..8]);
        let whole = n - n % 8;
        for chunk in a[8..whole].chunks_exact(8) {
            for (acc, &x) in r.iter_mut().zip(chunk) {
                *acc = *acc + x;
            }
        }
        let mut res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for &x in &a[whole..] {
            res = res + x;
        }
        res
    } else {
        let mut half = n / 2;
        half -= half % 8;
        np_sum(&a[..half]) + np_sum(&a[half..])
    }
}

/// Largest element of a non-empty, NaN-free slice.
fn max_of<T: WeightFloat>(a: &[T]) -> T {
    a.iter()
        .copied()
        .fold(a.first().copied().unwrap_or(T::ZERO), |m, x| {
            if x > m { x } else { m }
        })
}

/// Converts float weights to the `(uids, values)` pair `set_weights` takes.
///
/// The largest weight becomes 65535 and the others `round_half_even(w / max * 65535)`;
/// entries that round to 0 are dropped. All-zero weights give two empty vectors. The
/// arithmetic is in `f64` whatever the input type, as the SDK converts with `tolist()` first.
///
/// # Errors
///
/// [`WeightsError::LengthMismatch`], [`WeightsError::Empty`], and
/// [`WeightsError::NotFinite`] / [`WeightsError::Negative`] for bad weights.
pub fn convert_weights_and_uids_for_emit<T: WeightFloat>(
    uids: &[u16],
    weights: &[T],
) -> Result<(Vec<u16>, Vec<u16>), WeightsError> {
    if uids.len() != weights.len() {
        return Err(WeightsError::LengthMismatch {
            uids: uids.len(),
            weights: weights.len(),
        });
    }
    if weights.is_empty() {
        return Err(WeightsError::Empty);
    }
    check_weights(weights)?;
    // Non-negative values sum to zero exactly when all of them are zero.
    if weights.iter().all(|w| w.to_f64() == 0.0) {
        return Ok((Vec::new(), Vec::new()));
    }
    let max = max_of(weights).to_f64();
    let scale = f64::from(U16_MAX);
    let mut out_uids = Vec::with_capacity(uids.len());
    let mut out_vals = Vec::with_capacity(uids.len());
    for (&uid, w) in uids.iter().zip(weights) {
        // Python's round() is round-half-to-even. The value lies in [0, 65535], so the cast
        // cannot truncate.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let v = ((w.to_f64() / max) * scale).round_ties_even() as u16;
        if v != 0 {
            out_uids.push(uid);
            out_vals.push(v);
        }
    }
    Ok((out_uids, out_vals))
}

/// Scales `x` to sum to 1 with no element above `limit`, as the SDK's `normalize_max_weight`.
///
/// Returns the uniform vector `1/n` when `x` sums to zero or `n * limit <= 1` (the limit cannot
/// be met), and `x / sum(x)` when no element exceeds the limit after normalising. Otherwise the
/// largest elements are clipped to a common cutoff, found from the sorted cumulative sum, and
/// the vector is renormalised; because of the SDK's `1e-7` stability term the clipped elements
/// end a little below `limit`.
///
/// # Errors
///
/// [`WeightsError::InvalidLimit`] for a NaN, infinite or negative `limit`, and
/// [`WeightsError::NotFinite`] / [`WeightsError::Negative`] for bad elements.
pub fn normalize_max_weight<T: WeightFloat>(x: &[T], limit: f64) -> Result<Vec<T>, WeightsError> {
    if !limit.is_finite() || limit < 0.0 {
        return Err(WeightsError::InvalidLimit { limit });
    }
    check_weights(x)?;
    let n = x.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    #[allow(clippy::cast_precision_loss)]
    let n_f64 = n as f64;
    if np_sum(x).to_f64() == 0.0 || n_f64 * limit <= 1.0 {
        return Ok(vec![T::ONE / T::from_usize(n); n]);
    }
    // A Python float meeting an array is cast to the array's dtype first (NEP 50).
    let limit_t = T::from_f64(limit);
    let eps_t = T::from_f64(EPSILON);

    let mut values = x.to_vec();
    // NaN was rejected above, so the comparison is total.
    values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let values_sum = np_sum(&values);
    let estimation: Vec<T> = values.iter().map(|&v| v / values_sum).collect();

    if max_of(&estimation) <= limit_t {
        let sum = np_sum(x);
        return Ok(x.iter().map(|&w| w / sum).collect());
    }

    let mut cumsum = Vec::with_capacity(n);
    let mut acc = T::ZERO;
    for &e in &estimation {
        acc = acc + e;
        cumsum.push(acc);
    }
    let n_values = estimation
        .iter()
        .zip(&cumsum)
        .enumerate()
        .filter(|&(i, (&e, &c))| {
            let tail = T::from_usize(n - i - 1) * e;
            e / (tail + c + eps_t) < limit_t
        })
        .count();
    // `cumsum[n_values - 1]` in Python wraps to the last element when n_values is 0.
    let at = n_values.checked_sub(1).unwrap_or(n - 1);
    // The numerator stays in the array dtype; the denominator is float64 because
    // `limit * (len - n_values)` multiplies by a NumPy int64. Their quotient and the cutoff
    // are therefore float64, as is the comparison below.
    let numerator = limit_t * cumsum[at] - eps_t;
    #[allow(clippy::cast_precision_loss)]
    let denominator = 1.0 - limit * (n - n_values) as f64;
    let cutoff = numerator.to_f64() / denominator * values_sum.to_f64();

    let cutoff_t = T::from_f64(cutoff);
    let clipped: Vec<T> = x
        .iter()
        .map(|&w| if w.to_f64() > cutoff { cutoff_t } else { w })
        .collect();
    let sum = np_sum(&clipped);
    Ok(clipped.iter().map(|&w| w / sum).collect())
}

/// `np.quantile(a, q)` with the default linear method and a Python-float `q`, for which NumPy 2
/// interpolates in the array's dtype.
fn np_quantile_f32(a: &[f32], q: f64) -> f32 {
    let mut sorted = a.to_vec();
    sorted.sort_by(f32::total_cmp);
    let n = sorted.len();
    let Some(&last) = sorted.last() else {
        return f32::NAN;
    };
    #[allow(clippy::cast_precision_loss)]
    let virtual_index = (n - 1) as f64 * q;
    #[allow(clippy::cast_precision_loss)]
    if virtual_index >= (n - 1) as f64 {
        return last;
    }
    let floor = virtual_index.floor();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let lo = floor.max(0.0) as usize;
    let (a_lo, b_hi) = (sorted[lo], sorted[(lo + 1).min(n - 1)]);
    let gamma = virtual_index - floor;
    let diff = b_hi - a_lo;
    // NumPy's `_lerp` switches formula at t = 0.5 for accuracy near the upper point.
    #[allow(clippy::cast_possible_truncation)]
    if gamma >= 0.5 {
        b_hi - diff * (1.0 - gamma) as f32
    } else {
        a_lo + diff * gamma as f32
    }
}

/// The SDK's `process_weights`: turns raw scores into the normalised vector it then passes to
/// [`convert_weights_and_uids_for_emit`].
///
/// * Weights are cast to `f32` first, as the SDK does.
/// * No positive weight, or `num_neurons < min_allowed_weights`: uniform `1/num_neurons` over
///   uids `0..num_neurons`.
/// * Fewer positive weights than `min_allowed_weights`: every neuron gets `1e-5` plus its weight
///   (by input *position*, an SDK quirk that assumes `uids == 0..n`), then
///   [`normalize_max_weight`] in `f64`; uids are `0..num_neurons`.
/// * Otherwise positive weights below the `min(exclude_quantile / 65535, (nz - min_allowed) /
///   nz)` quantile are dropped and the rest go through [`normalize_max_weight`] in `f32`.
///
/// `max_weight_limit` is the subnet's `MaxWeightsLimit / 65535`.
///
/// # Errors
///
/// As [`normalize_max_weight`], plus [`WeightsError::LengthMismatch`],
/// [`WeightsError::IndexOutOfRange`] and [`WeightsError::TooManyNeurons`].
pub fn process_weights<T: WeightFloat>(
    uids: &[u16],
    weights: &[T],
    num_neurons: usize,
    min_allowed_weights: usize,
    max_weight_limit: f64,
    exclude_quantile: u16,
) -> Result<(Vec<u16>, Vec<f64>), WeightsError> {
    if uids.len() != weights.len() {
        return Err(WeightsError::LengthMismatch {
            uids: uids.len(),
            weights: weights.len(),
        });
    }
    if !max_weight_limit.is_finite() || max_weight_limit < 0.0 {
        return Err(WeightsError::InvalidLimit {
            limit: max_weight_limit,
        });
    }
    check_weights(weights)?;
    #[allow(clippy::cast_possible_truncation)]
    let weights: Vec<f32> = weights.iter().map(|w| w.to_f64() as f32).collect();
    let quantile = f64::from(exclude_quantile) / f64::from(U16_MAX);

    let non_zero: Vec<usize> = (0..weights.len()).filter(|&i| weights[i] > 0.0).collect();
    let all_uids = || -> Result<Vec<u16>, WeightsError> {
        (0..num_neurons)
            .map(|i| u16::try_from(i).map_err(|_| WeightsError::TooManyNeurons { num_neurons }))
            .collect()
    };

    if non_zero.is_empty() || num_neurons < min_allowed_weights {
        tracing::debug!(
            num_neurons,
            min_allowed_weights,
            "no usable weights; using uniform"
        );
        #[allow(clippy::cast_precision_loss)]
        let uniform = 1.0 / num_neurons as f64;
        return Ok((all_uids()?, vec![uniform; num_neurons]));
    }

    if non_zero.len() < min_allowed_weights {
        tracing::debug!(
            non_zero = non_zero.len(),
            min_allowed_weights,
            "fewer weights than allowed; padding every neuron with 1e-5"
        );
        let mut padded = vec![1e-5_f64; num_neurons];
        for &i in &non_zero {
            let slot = padded.get_mut(i).ok_or(WeightsError::IndexOutOfRange {
                index: i,
                num_neurons,
            })?;
            *slot += f64::from(weights[i]);
        }
        let normalized = normalize_max_weight(&padded, max_weight_limit)?;
        return Ok((all_uids()?, normalized));
    }

    let nz_weights: Vec<f32> = non_zero.iter().map(|&i| weights[i]).collect();
    #[allow(clippy::cast_precision_loss)]
    let max_exclude =
        non_zero.len().saturating_sub(min_allowed_weights) as f64 / non_zero.len() as f64;
    let lowest = np_quantile_f32(&nz_weights, quantile.min(max_exclude));

    let (kept_uids, kept): (Vec<u16>, Vec<f32>) = non_zero
        .iter()
        .filter(|&&i| lowest <= weights[i])
        .map(|&i| (uids[i], weights[i]))
        .unzip();
    let normalized = normalize_max_weight(&kept, max_weight_limit)?;
    Ok((kept_uids, normalized.into_iter().map(f64::from).collect()))
}

/// Commit-reveal v2 hash: blake2b-256 of the SCALE encoding of
/// `(account, netuid_index, uids, values, salt, version_key)`.
///
/// This is `BlakeTwo256::hash_of` of the tuple the chain rebuilds on `reveal_weights`, and the
/// same bytes as the SDK's `generate_weight_hash`. `netuid_index` is the netuid, or the
/// `NetUidStorageIndex` for mechanism commits.
#[must_use]
pub fn commit_hash(
    account: [u8; 32],
    netuid_index: u16,
    uids: &[u16],
    values: &[u16],
    salt: &[u16],
    version_key: u64,
) -> [u8; 32] {
    let encoded = (account, netuid_index, uids, values, salt, version_key).encode();
    sp_crypto_hashing::blake2_256(&encoded)
}

/// A fresh random salt of `len` `u16` values from the OS generator, for [`commit_hash`].
///
/// The salt must be kept until the reveal; anyone who learns it can test guesses of the weights
/// against the public commit.
#[must_use]
pub fn generate_salt(len: usize) -> Vec<u16> {
    let mut rng = rand::rngs::OsRng;
    (0..len).map(|_| rng.r#gen::<u16>()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairwise_sum_matches_sequential_for_short_inputs() {
        let a = [0.1_f64, 0.2, 0.3];
        assert_eq!(np_sum(&a), (0.0 + 0.1) + 0.2 + 0.3);
    }

    #[test]
    fn pairwise_sum_unrolls_eight_accumulators() {
        let a: Vec<f64> = (0..19).map(|i| f64::from(i) * 0.1).collect();
        // 16 elements go to 8 lanes (a[j] + a[j + 8]); the remaining 3 are added at the end.
        let lane = |j: usize| a[j] + a[j + 8];
        let lanes = ((lane(0) + lane(1)) + (lane(2) + lane(3)))
            + ((lane(4) + lane(5)) + (lane(6) + lane(7)));
        let expected = lanes + a[16] + a[17] + a[18];
        assert_eq!(np_sum(&a).to_bits(), expected.to_bits());
    }

    #[test]
    fn quantile_matches_numpy_linear_method() {
        // Expected values from NumPy 2.4:
        // np.quantile(np.array([0.4, 0.05, 0.8, 0.1, 0.3, 0.2], np.float32), q)
        let a = [0.4_f32, 0.05, 0.8, 0.1, 0.3, 0.2];
        assert_eq!(np_quantile_f32(&a, 0.25), 0.125);
        assert_eq!(np_quantile_f32(&a, 0.0), 0.05);
        assert_eq!(np_quantile_f32(&a, 1.0), 0.8);
        assert_eq!(np_quantile_f32(&a, 0.7), 0.350_000_02);
        // 0.6000000238418579, which is also the f32 nearest 0.6.
        assert_eq!(np_quantile_f32(&a, 0.9), 0.6);
    }

    #[test]
    fn salt_has_requested_length() {
        assert_eq!(generate_salt(DEFAULT_SALT_LEN).len(), 8);
        assert!(generate_salt(0).is_empty());
    }
}
