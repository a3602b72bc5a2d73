//! A small deterministic generator.
//!
//! Weight initialisation and corpus sampling are part of the protocol: every miner must start from
//! the same weights and every party must rebuild a sample from its id. So the generator is fixed
//! here (SplitMix64, plain integer arithmetic and IEEE f64 operations that Rust never fuses)
//! instead of depending on a crate whose stream could change between versions.

/// SplitMix64 (Steele, Lea, Flood 2014): 64-bit state, full period, good enough statistically
/// for initialisation and sampling.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// A generator whose seed is derived from a base seed and a label (e.g. a parameter name), so
    /// that streams for different labels are independent and do not depend on creation order.
    pub fn derived(seed: u64, label: &str) -> Self {
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"iota-model/rng/v1");
        hasher.update(&seed.to_le_bytes());
        hasher.update(label.as_bytes());
        let digest = hasher.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest.as_bytes()[..8]);
        Self::new(u64::from_le_bytes(first))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[0, 1)` as f32 (24 bits, so it never rounds up to 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// A standard normal sample (Box-Muller; the second value is discarded to keep the stream
    /// position a simple function of the number of samples drawn).
    pub fn next_normal(&mut self) -> f64 {
        // 1 - u is in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Index drawn from unnormalised non-negative `weights` (the caller guarantees a positive sum).
    pub fn pick(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let mut x = self.next_f64() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        // Rounding can leave x just above the last weight; fall back to the last non-zero entry.
        weights.iter().rposition(|w| *w > 0.0).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_is_fixed() {
        // Reference values of SplitMix64 seeded with 0 (published test vector).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn derived_streams_differ_and_repeat() {
        let a1 = SplitMix64::derived(42, "a").next_u64();
        let a2 = SplitMix64::derived(42, "a").next_u64();
        let b = SplitMix64::derived(42, "b").next_u64();
        assert_eq!(a1, a2);
        assert_ne!(a1, b);
    }

    #[test]
    fn normal_moments() {
        let mut r = SplitMix64::new(7);
        let n = 20_000;
        let xs: Vec<f64> = (0..n).map(|_| r.next_normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "var {var}");
    }

    #[test]
    fn pick_respects_zero_weights() {
        let mut r = SplitMix64::new(1);
        for _ in 0..1000 {
            assert_ne!(r.pick(&[1.0, 0.0, 2.0]), 1);
        }
    }
}
