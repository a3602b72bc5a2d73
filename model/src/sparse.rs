//! Compressed pseudo-gradients: chunked top-k with int8 values and error feedback, the DeMo /
//! SparseLoCo family, cut so that a butterfly merge of them is as small as one of them.
//!
//! A vector is cut into chunks of `chunk` values; each chunk keeps its `k` largest magnitudes
//! (ties to the lower index) as a `u16` offset and a value of 8 or 4 bits, with one f32 scale
//! per chunk.
//! A miner compresses its pseudo-gradient plus what it has not sent yet ([`ErrorFeedback`]), so
//! nothing it trained is dropped for good, only delayed. Owners of a partition average the
//! decompressed contributions exactly as dense ones ([`crate::weighted_average`]) and compress
//! the average again with the same `chunk` and `k` ([`merge_sparse`]): the merged update has the
//! size of one contribution whatever the number of miners, and every step is deterministic f32
//! arithmetic, so honest owners and a validator produce the same bits.

use std::ops::Range;

use crate::error::{ModelError, Result};
use crate::merge::{Contribution, weighted_average};

/// Largest chunk: offsets within a chunk are `u16`.
pub const MAX_CHUNK: usize = 1 << 16;

/// Bits a kept value may have.
pub const VALUE_BITS: [u8; 2] = [8, 4];

/// How a vector is compressed: `k` of every `chunk` values kept, each in `bits` bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseConfig {
    chunk: usize,
    k: usize,
    bits: u8,
}

impl SparseConfig {
    /// `1 <= k <= chunk <= 65536`, values of 8 bits.
    pub fn new(chunk: usize, k: usize) -> Result<Self> {
        if chunk == 0 || chunk > MAX_CHUNK || k == 0 || k > chunk {
            return Err(ModelError::InvalidInput(format!(
                "a sparse encoding keeps 1 to {chunk} of every chunk of 1 to {MAX_CHUNK} values, not {k} of {chunk}"
            )));
        }
        Ok(Self { chunk, k, bits: 8 })
    }

    /// The same with values of `bits` bits (one of [`VALUE_BITS`]).
    pub fn with_bits(self, bits: u8) -> Result<Self> {
        if !VALUE_BITS.contains(&bits) {
            return Err(ModelError::InvalidInput(format!(
                "sparse values have 8 or 4 bits, not {bits}"
            )));
        }
        Ok(Self { bits, ..self })
    }

    /// Bits of a kept value.
    pub fn bits(&self) -> u8 {
        self.bits
    }

    /// Largest magnitude of a quantised value: `2^(bits-1) - 1`, so the range stays symmetric.
    pub fn q_max(&self) -> i8 {
        ((1u16 << (self.bits - 1)) - 1) as i8
    }

    /// Values per chunk (the last chunk of a vector may be shorter).
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Values kept per full chunk.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Chunks of a vector of `len` values.
    pub fn chunks(&self, len: usize) -> usize {
        len.div_ceil(self.chunk)
    }

    /// Entries kept of a vector of `len` values: `k` per chunk, all of a last chunk shorter
    /// than `k`.
    pub fn kept(&self, len: usize) -> usize {
        (0..self.chunks(len))
            .map(|c| self.kept_in(self.chunk_range(len, c).len()))
            .sum()
    }

    fn kept_in(&self, chunk_len: usize) -> usize {
        self.k.min(chunk_len)
    }

    fn chunk_range(&self, len: usize, c: usize) -> Range<usize> {
        let start = c * self.chunk;
        start..(start + self.chunk).min(len)
    }
}

/// A compressed vector: for each chunk in order, its kept offsets (ascending), their quantised
/// values and the chunk's scale. Value `i` of chunk `c` decodes to `values[i] * scales[c]`.
#[derive(Clone, Debug, PartialEq)]
pub struct SparseVector {
    /// Length of the dense vector.
    pub len: usize,
    /// The encoding.
    pub config: SparseConfig,
    /// Offsets within their chunk, `config.kept(len)` of them.
    pub indices: Vec<u16>,
    /// Quantised values, one per index, in `[-q_max, q_max]` of the config.
    pub values: Vec<i8>,
    /// One non-negative, finite scale per chunk.
    pub scales: Vec<f32>,
}

impl SparseVector {
    /// Checks the layout a peer's vector must have: counts, offsets inside their chunk and
    /// strictly ascending, values in range, scales finite and non-negative.
    pub fn validate(&self) -> Result<()> {
        let cfg = self.config;
        let kept = cfg.kept(self.len);
        if self.indices.len() != kept || self.values.len() != kept {
            return Err(ModelError::shape(
                "sparse entries",
                &[kept, kept],
                &[self.indices.len(), self.values.len()],
            ));
        }
        if self.scales.len() != cfg.chunks(self.len) {
            return Err(ModelError::shape(
                "sparse scales",
                &[cfg.chunks(self.len)],
                &[self.scales.len()],
            ));
        }
        if let Some(s) = self.scales.iter().find(|s| !(s.is_finite() && **s >= 0.0)) {
            return Err(ModelError::NonFinite(format!("sparse scale {s}")));
        }
        let q = cfg.q_max();
        if let Some(v) = self.values.iter().find(|v| !(-q..=q).contains(*v)) {
            return Err(ModelError::InvalidInput(format!(
                "sparse value {v} is outside [-{q}, {q}]"
            )));
        }
        let mut at = 0;
        for c in 0..cfg.chunks(self.len) {
            let chunk_len = cfg.chunk_range(self.len, c).len();
            let n = cfg.kept_in(chunk_len);
            let offsets = &self.indices[at..at + n];
            if offsets.windows(2).any(|w| w[0] >= w[1])
                || offsets.last().is_some_and(|&o| usize::from(o) >= chunk_len)
            {
                return Err(ModelError::InvalidInput(format!(
                    "chunk {c}: offsets are not ascending inside the chunk's {chunk_len} values"
                )));
            }
            at += n;
        }
        Ok(())
    }

    /// The dense vector (zeros where nothing was kept).
    pub fn decompress(&self) -> Result<Vec<f32>> {
        self.validate()?;
        let mut out = vec![0f32; self.len];
        let mut at = 0;
        for (c, scale) in self.scales.iter().enumerate() {
            let range = self.config.chunk_range(self.len, c);
            let n = self.config.kept_in(range.len());
            let dst = &mut out[range];
            for (&o, &q) in self.indices[at..at + n]
                .iter()
                .zip(&self.values[at..at + n])
            {
                dst[usize::from(o)] = f32::from(q) * scale;
            }
            at += n;
        }
        Ok(out)
    }
}

/// Compresses `values` (finite): per chunk, the `k` largest magnitudes (ties to the lower
/// offset), scaled so the largest maps to ±`q_max` and rounded half to even.
pub fn compress(values: &[f32], config: SparseConfig) -> Result<SparseVector> {
    if values.iter().any(|v| !v.is_finite()) {
        return Err(ModelError::NonFinite("vector to compress".into()));
    }
    let len = values.len();
    let kept = config.kept(len);
    let mut out = SparseVector {
        len,
        config,
        indices: Vec::with_capacity(kept),
        values: Vec::with_capacity(kept),
        scales: Vec::with_capacity(config.chunks(len)),
    };
    let q_max = f32::from(config.q_max());
    let mut order: Vec<u16> = Vec::with_capacity(config.chunk);
    for c in 0..config.chunks(len) {
        let chunk = &values[config.chunk_range(len, c)];
        let n = config.kept_in(chunk.len());
        order.clear();
        // `chunk.len() <= MAX_CHUNK`, so every offset fits.
        order.extend((0..chunk.len()).map(|i| i as u16));
        let larger = |a: &u16, b: &u16| {
            let (x, y) = (chunk[usize::from(*a)].abs(), chunk[usize::from(*b)].abs());
            y.total_cmp(&x).then(a.cmp(b))
        };
        if n < chunk.len() {
            order.select_nth_unstable_by(n - 1, larger);
        }
        let top = &mut order[..n];
        top.sort_unstable();
        let peak = top
            .iter()
            .map(|&i| chunk[usize::from(i)].abs())
            .fold(0f32, f32::max);
        let scale = peak / q_max;
        // A peak so small that its scale underflows is sent as zeros.
        let scale = if scale > 0.0 { scale } else { 0.0 };
        for &i in top.iter() {
            let q = if scale > 0.0 {
                (chunk[usize::from(i)] / scale)
                    .round_ties_even()
                    .clamp(-q_max, q_max) as i8
            } else {
                0
            };
            out.indices.push(i);
            out.values.push(q);
        }
        out.scales.push(scale);
    }
    Ok(out)
}

/// What a miner has trained but not yet sent, over its stage's flat parameter vector. Each
/// epoch's pseudo-gradient is added to it and the compressed sum sent; what the compression
/// dropped stays for the next epoch.
#[derive(Clone, Debug)]
pub struct ErrorFeedback {
    residual: Vec<f32>,
    decay: f32,
}

impl ErrorFeedback {
    /// Nothing owed, over `len` values; what stays unsent is owed in full.
    pub fn new(len: usize) -> Self {
        Self {
            residual: vec![0.0; len],
            decay: 1.0,
        }
    }

    /// Nothing owed, over `len` values; each epoch the remainder shrinks by `decay` (0 to 1)
    /// before the new pseudo-gradient is added, so stale mass fades instead of arriving late.
    pub fn with_decay(len: usize, decay: f32) -> Result<Self> {
        if !(0.0..=1.0).contains(&decay) {
            return Err(ModelError::InvalidInput(format!(
                "error-feedback decay must be between 0 and 1, not {decay}"
            )));
        }
        Ok(Self {
            residual: vec![0.0; len],
            decay,
        })
    }

    /// The unsent remainder.
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Takes back what the merge dropped of what this miner sent over `range`: the values of
    /// `sent` at offsets `merged` kept nothing at (all of them when no merge was accepted).
    /// Summed over the miners, that is the merge's own loss (the average of the contributions
    /// there), so the next epoch sends it again. On error nothing changes.
    pub fn take_back(
        &mut self,
        range: Range<usize>,
        sent: &SparseVector,
        merged: Option<&SparseVector>,
    ) -> Result<()> {
        if let Some(m) = merged
            && (m.len != sent.len || m.config.chunk() != sent.config.chunk())
        {
            return Err(ModelError::InvalidInput(format!(
                "a merge of {} values in chunks of {} for an upload of {} in chunks of {}",
                m.len,
                m.config.chunk(),
                sent.len,
                sent.config.chunk()
            )));
        }
        if sent.len != range.len() {
            return Err(ModelError::shape("upload", &[range.len()], &[sent.len]));
        }
        sent.validate()?;
        if let Some(m) = merged {
            m.validate()?;
        }
        let owed = self.residual.get_mut(range.clone()).ok_or_else(|| {
            ModelError::InvalidInput(format!("range {range:?} is outside the vector"))
        })?;
        let (mut a, mut b) = (0, 0);
        for (c, scale) in sent.scales.iter().enumerate() {
            let chunk = sent.config.chunk_range(sent.len, c);
            let n = sent.config.kept_in(chunk.len());
            let kept: &[u16] = match merged {
                Some(m) => {
                    let k = m.config.kept_in(chunk.len());
                    b += k;
                    &m.indices[b - k..b]
                }
                None => &[],
            };
            for (&o, &q) in sent.indices[a..a + n].iter().zip(&sent.values[a..a + n]) {
                if kept.binary_search(&o).is_err() {
                    owed[chunk.start + usize::from(o)] += f32::from(q) * scale;
                }
            }
            a += n;
        }
        Ok(())
    }

    /// Compresses `delta` (the pseudo-gradient over `range` of the flat vector) plus the
    /// remainder owed there, and keeps what was not sent. On error nothing changes.
    pub fn compress(
        &mut self,
        range: Range<usize>,
        delta: &[f32],
        config: SparseConfig,
    ) -> Result<SparseVector> {
        let owed = self.residual.get(range.clone()).ok_or_else(|| {
            ModelError::InvalidInput(format!("range {range:?} is outside the vector"))
        })?;
        if owed.len() != delta.len() {
            return Err(ModelError::shape(
                "pseudo-gradient range",
                &[owed.len()],
                &[delta.len()],
            ));
        }
        let total: Vec<f32> = owed
            .iter()
            .zip(delta)
            .map(|(r, d)| self.decay * r + d)
            .collect();
        let sent = compress(&total, config)?;
        let dense = sent.decompress()?;
        for ((r, t), s) in self.residual[range].iter_mut().zip(&total).zip(&dense) {
            *r = t - s;
        }
        Ok(sent)
    }
}

/// The merged update of one partition: the weighted average of the contributions (in the given
/// order, as [`weighted_average`] computes it over their dense forms), compressed again with
/// `config`. Every contribution must have the same length and encoding.
pub fn merge_sparse(
    contributions: &[(f64, &SparseVector)],
    config: SparseConfig,
    threads: usize,
) -> Result<SparseVector> {
    let (_, first) = contributions
        .first()
        .ok_or_else(|| ModelError::InvalidInput("no contributions to merge".into()))?;
    let dense = contributions
        .iter()
        .enumerate()
        .map(|(j, (_, c))| {
            if c.len != first.len || c.config != first.config {
                return Err(ModelError::InvalidInput(format!(
                    "contribution {j} is {} values as {:?}, not {} as {:?}",
                    c.len, c.config, first.len, first.config
                )));
            }
            c.decompress()
        })
        .collect::<Result<Vec<_>>>()?;
    let parts: Vec<Contribution<'_>> = contributions
        .iter()
        .zip(&dense)
        .map(|((weight, _), values)| Contribution {
            weight: *weight,
            values,
        })
        .collect();
    let average = weighted_average(&parts, threads)?;
    compress(&average.values, config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = SplitMix64::new(seed);
        (0..n).map(|_| r.next_normal() as f32).collect()
    }

    fn cfg(chunk: usize, k: usize) -> SparseConfig {
        SparseConfig::new(chunk, k).unwrap()
    }

    #[test]
    fn config_bounds() {
        assert!(SparseConfig::new(0, 0).is_err());
        assert!(SparseConfig::new(8, 0).is_err());
        assert!(SparseConfig::new(8, 9).is_err());
        assert!(SparseConfig::new(MAX_CHUNK + 1, 1).is_err());
        let c = cfg(MAX_CHUNK, MAX_CHUNK);
        assert_eq!(c.kept(MAX_CHUNK + 3), MAX_CHUNK + 3);
        let c = cfg(10, 4);
        assert_eq!((c.chunks(23), c.kept(23)), (3, 4 + 4 + 3));
        assert_eq!((c.chunks(0), c.kept(0)), (0, 0));
    }

    #[test]
    fn keeps_the_largest_magnitudes_of_each_chunk() {
        // Chunk 0: the two largest are -9 (offset 3) and 8 (offset 1); chunk 1 is shorter than
        // k and kept whole; ties go to the lower offset.
        let v = [1.0, 8.0, -2.0, -9.0, 0.5, 3.0, -3.0];
        let s = compress(&v, cfg(5, 2)).unwrap();
        assert_eq!(s.indices, vec![1, 3, 0, 1]);
        assert_eq!(s.values, vec![113, -127, 127, -127]);
        assert_eq!(s.scales, vec![9.0 / 127.0, 3.0 / 127.0]);
        let ties = compress(&[2.0, -2.0, 2.0, 1.0], cfg(4, 2)).unwrap();
        assert_eq!(ties.indices, vec![0, 1]);
        let d = s.decompress().unwrap();
        assert_eq!(d[2], 0.0);
        assert!((d[3] + 9.0).abs() < 1e-6);
        assert!((d[1] - 8.0).abs() <= 9.0 / 127.0 / 2.0);
        assert!((d[5] - 3.0).abs() < 1e-6 && (d[6] + 3.0).abs() < 1e-6);
        // All zeros and values too small to scale compress to zeros.
        let z = compress(&[0.0, 1e-45, 0.0], cfg(3, 2)).unwrap();
        assert_eq!(z.decompress().unwrap(), vec![0.0; 3]);
        assert!(compress(&[1.0, f32::NAN], cfg(2, 1)).is_err());
    }

    #[test]
    fn four_bit_values_use_seven_levels_a_side() {
        assert!(cfg(5, 2).with_bits(2).is_err() && cfg(5, 2).with_bits(16).is_err());
        let c = cfg(5, 2).with_bits(4).unwrap();
        assert_eq!((c.bits(), c.q_max(), cfg(5, 2).q_max()), (4, 7, 127));
        let v = [1.0, 8.0, -2.0, -9.0, 0.5, 3.0, -3.0];
        let s = compress(&v, c).unwrap();
        assert_eq!(s.indices, vec![1, 3, 0, 1]);
        // 8 / (9/7) = 6.22 rounds to 6.
        assert_eq!(s.values, vec![6, -7, 7, -7]);
        assert_eq!(s.scales, vec![9.0 / 7.0, 3.0 / 7.0]);
        // Every kept value is off by at most half a step of its chunk's scale.
        let x = random(4000, 7);
        let s = compress(&x, cfg(1000, 100).with_bits(4).unwrap()).unwrap();
        let d = s.decompress().unwrap();
        for (chunk, (orig, back)) in x.chunks(1000).zip(d.chunks(1000)).enumerate() {
            for (o, b) in orig.iter().zip(back).filter(|(_, b)| **b != 0.0) {
                assert!((o - b).abs() <= s.scales[chunk] / 2.0 * 1.0001);
            }
        }
    }

    #[test]
    fn the_error_is_the_dropped_mass_and_the_rounding() {
        let v = random(10_000, 1);
        let c = cfg(1000, 50);
        let s = compress(&v, c).unwrap();
        s.validate().unwrap();
        let d = s.decompress().unwrap();
        for (chunk, (orig, back)) in v.chunks(1000).zip(d.chunks(1000)).enumerate() {
            let kept: Vec<usize> = (0..1000).filter(|&i| back[i] != 0.0).collect();
            let smallest_kept = kept.iter().map(|&i| orig[i].abs()).fold(f32::MAX, f32::min);
            let largest_dropped = (0..1000)
                .filter(|i| back[*i] == 0.0)
                .map(|i| orig[i].abs())
                .fold(0.0, f32::max);
            assert!(smallest_kept >= largest_dropped, "chunk {chunk}");
            for &i in &kept {
                assert!((orig[i] - back[i]).abs() <= s.scales[chunk] / 2.0 * 1.0001);
            }
        }
    }

    #[test]
    fn malformed_vectors_are_refused() {
        let good = compress(&random(25, 2), cfg(10, 3)).unwrap();
        good.validate().unwrap();
        let mut bad = vec![];
        let mut b = good.clone();
        b.indices.swap(0, 1);
        bad.push(b);
        let mut b = good.clone();
        b.indices[8] = 5; // the last chunk has 5 values: offsets 0..5
        bad.push(b);
        let mut b = good.clone();
        b.values[0] = i8::MIN;
        bad.push(b);
        let mut b = good.clone();
        b.scales[1] = f32::INFINITY;
        bad.push(b);
        let mut b = good.clone();
        b.scales[1] = -1.0;
        bad.push(b);
        let mut b = good.clone();
        b.values.pop();
        bad.push(b);
        let mut b = good.clone();
        b.scales.push(1.0);
        bad.push(b);
        let mut b = good.clone();
        b.indices[1] = b.indices[0];
        bad.push(b);
        // A value of 8 bits in a vector of 4-bit values.
        let mut b = compress(&random(25, 2), cfg(10, 3).with_bits(4).unwrap()).unwrap();
        b.validate().unwrap();
        b.values[0] = 8;
        bad.push(b);
        for (i, b) in bad.iter().enumerate() {
            assert!(b.validate().is_err(), "case {i}");
            assert!(b.decompress().is_err(), "case {i}");
        }
    }

    /// With error feedback nothing is lost: after many epochs, what was sent plus what is owed
    /// equals everything trained, and a coordinate too small to win a chunk is still sent once
    /// its debt has grown.
    #[test]
    fn error_feedback_delays_and_never_drops() {
        let n = 4096;
        let c = cfg(512, 8);
        let mut ef = ErrorFeedback::new(n);
        let mut trained = vec![0f64; n];
        let mut sent = vec![0f64; n];
        for epoch in 0..200 {
            let mut delta = random(n, 100 + epoch);
            // One coordinate that moves a little, always the same way, and never wins alone.
            delta[777] = 0.5;
            for r in [0..1000, 1000..n] {
                let s = ef.compress(r.clone(), &delta[r.clone()], c).unwrap();
                for (i, v) in s.decompress().unwrap().iter().enumerate() {
                    sent[r.start + i] += f64::from(*v);
                }
            }
            for (t, d) in trained.iter_mut().zip(&delta) {
                *t += f64::from(*d);
            }
        }
        for i in 0..n {
            let owed = f64::from(ef.residual()[i]);
            assert!((sent[i] + owed - trained[i]).abs() < 1e-3, "coordinate {i}");
        }
        assert!(sent[777] > 0.0, "the steady coordinate was sent");
        // The debt stays bounded: it does not grow with the epochs.
        let worst = ef.residual().iter().fold(0f32, |m, r| m.max(r.abs()));
        assert!(worst < 40.0, "worst residual {worst}");
        // A refused range changes nothing.
        let before = ef.residual().to_vec();
        assert!(ef.compress(0..3, &[1.0, f32::NAN, 0.0], c).is_err());
        assert!(ef.compress(n - 1..n + 1, &[1.0, 1.0], c).is_err());
        assert!(ef.compress(0..3, &[1.0], c).is_err());
        assert_eq!(ef.residual(), &before[..]);
    }

    /// A decaying remainder is owed less each epoch before the new pseudo-gradient joins it;
    /// a decay of 1 is the plain error feedback, bit for bit.
    #[test]
    fn a_decaying_remainder_shrinks_before_each_epoch() {
        let c = cfg(4, 1);
        let close = |got: &[f32], want: &[f32]| {
            assert!(
                got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-5),
                "{got:?} against {want:?}"
            )
        };
        let mut ef = ErrorFeedback::with_decay(4, 0.5).unwrap();
        let s = ef.compress(0..4, &[8.0, 2.0, 0.0, -4.0], c).unwrap();
        close(&s.decompress().unwrap(), &[8.0, 0.0, 0.0, 0.0]);
        close(ef.residual(), &[0.0, 2.0, 0.0, -4.0]);
        // Owed half of (2, -4), (1, -2), plus (1, 1, 0, 1): (1, 2, 0, -1). Without the decay
        // it would be (1, 3, 0, -3), and 3 sent.
        let s = ef.compress(0..4, &[1.0, 1.0, 0.0, 1.0], c).unwrap();
        close(&s.decompress().unwrap(), &[0.0, 2.0, 0.0, 0.0]);
        close(ef.residual(), &[1.0, 0.0, 0.0, -1.0]);
        for bad in [-0.1, 1.1, f32::NAN] {
            assert!(ErrorFeedback::with_decay(4, bad).is_err(), "{bad}");
        }
        let (mut plain, mut one) = (
            ErrorFeedback::new(1000),
            ErrorFeedback::with_decay(1000, 1.0).unwrap(),
        );
        for epoch in 0..5 {
            let delta = random(1000, 300 + epoch);
            let a = plain.compress(0..1000, &delta, cfg(100, 3)).unwrap();
            let b = one.compress(0..1000, &delta, cfg(100, 3)).unwrap();
            assert_eq!(
                (a.indices, a.values, a.scales),
                (b.indices, b.values, b.scales)
            );
        }
        assert_eq!(plain.residual(), one.residual());
    }

    /// What a merge dropped of an upload goes back to the sender's residual, and only that.
    #[test]
    fn what_the_merge_dropped_is_taken_back() {
        let c = cfg(4, 2);
        let sent = compress(&[4.0, 0.0, -2.0, 1.0, 0.0, 3.0, 0.5], c).unwrap();
        assert_eq!(sent.indices, vec![0, 2, 1, 2]);
        // The merge kept offsets 1 and 2 of chunk 0 and 0 and 1 of chunk 1: this upload's 4.0
        // and 0.5 were dropped.
        let merged = compress(&[0.0, 1.0, 5.0, 0.0, 5.0, 0.0, 0.0], c).unwrap();
        assert_eq!(merged.indices, vec![1, 2, 0, 1]);
        let mut ef = ErrorFeedback::new(8);
        ef.take_back(1..8, &sent, Some(&merged)).unwrap();
        // As sent: 0.5 quantised on its chunk's scale of 3/127.
        let want = [0.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 21.0 * 3.0 / 127.0];
        for (got, want) in ef.residual().iter().zip(want) {
            assert!((got - want).abs() < 1e-6, "{:?}", ef.residual());
        }
        // No merge accepted: all of it.
        let mut ef = ErrorFeedback::new(7);
        ef.take_back(0..7, &sent, None).unwrap();
        assert_eq!(ef.residual(), &sent.decompress().unwrap()[..]);
        // Mismatched shapes change nothing.
        let other = compress(&[1.0; 7], cfg(3, 1)).unwrap();
        assert!(ef.take_back(0..7, &sent, Some(&other)).is_err());
        assert!(ef.take_back(0..6, &sent, None).is_err());
        assert_eq!(ef.residual(), &sent.decompress().unwrap()[..]);
    }

    /// The merged update has the size of one contribution whatever the number of miners, is
    /// the same bits for any thread count, and is the compressed weighted average.
    #[test]
    fn merges_are_deterministic_and_as_small_as_one_contribution() {
        let n = 20_011;
        let c = cfg(2048, 64);
        let dense: Vec<Vec<f32>> = (0..9).map(|s| random(n, 50 + s)).collect();
        let sparse: Vec<SparseVector> = dense.iter().map(|v| compress(v, c).unwrap()).collect();
        for miners in [1, 2, 5, 9] {
            let contribs: Vec<(f64, &SparseVector)> = sparse[..miners]
                .iter()
                .enumerate()
                .map(|(i, s)| (1.0 + i as f64, s))
                .collect();
            let one = merge_sparse(&contribs, c, 1).unwrap();
            assert_eq!(one.indices.len(), c.kept(n));
            for t in [2, 7] {
                assert_eq!(merge_sparse(&contribs, c, t).unwrap(), one);
            }
            let parts: Vec<Vec<f32>> = sparse[..miners]
                .iter()
                .map(|s| s.decompress().unwrap())
                .collect();
            let avg = weighted_average(
                &parts
                    .iter()
                    .zip(&contribs)
                    .map(|(v, (w, _))| Contribution {
                        weight: *w,
                        values: v,
                    })
                    .collect::<Vec<_>>(),
                1,
            )
            .unwrap();
            assert_eq!(one, compress(&avg.values, c).unwrap());
        }
        // Contributions of other lengths or encodings are refused.
        let other = compress(&dense[0], cfg(1024, 64)).unwrap();
        assert!(merge_sparse(&[(1.0, &sparse[0]), (1.0, &other)], c, 1).is_err());
        let short = compress(&dense[0][..n - 1], c).unwrap();
        assert!(merge_sparse(&[(1.0, &sparse[0]), (1.0, &short)], c, 1).is_err());
        assert!(merge_sparse(&[], c, 1).is_err());
    }
}
