//! Merge math for the butterfly all-reduce: a stable flat view of a stage's parameters, its
//! partitioning into contiguous slices, and a deterministic weighted average.
//!
//! The owners of a partition must produce the same bytes so that their BLAKE3 digests can be
//! compared. The average is therefore computed in plain f32 scalar code (no fused multiply-add,
//! no SIMD reassociation), contributors in the given order, summed as a balanced binary tree
//! (pairwise summation). Threads split the output elements, never a sum, so the result does not
//! depend on the thread count or the machine.

use std::ops::Range;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::stage::Stage;

/// One tensor's place in the flat vector.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatEntry {
    /// Parameter name.
    pub name: String,
    /// Tensor dimensions.
    pub shape: Vec<usize>,
    /// First element in the flat vector.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

/// The order and extent of every parameter in a stage's flat f32 vector.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatLayout {
    /// Entries in canonical parameter order.
    pub entries: Vec<FlatEntry>,
    /// Total element count.
    pub total: usize,
}

impl FlatLayout {
    /// Layout of `stage` (canonical parameter order, row-major tensors).
    pub fn of(stage: &Stage) -> Self {
        let mut offset = 0;
        let entries = stage
            .params()
            .iter()
            .map(|p| {
                let len = p.var().elem_count();
                let e = FlatEntry {
                    name: p.name().to_string(),
                    shape: p.var().dims().to_vec(),
                    offset,
                    len,
                };
                offset += len;
                e
            })
            .collect();
        Self {
            entries,
            total: offset,
        }
    }

    /// BLAKE3 over names and shapes: two parties with equal fingerprints slice identically.
    pub fn fingerprint(&self) -> blake3::Hash {
        let mut h = blake3::Hasher::new();
        h.update(b"iota-model/flat-layout/v1");
        for e in &self.entries {
            h.update(&(e.name.len() as u64).to_le_bytes());
            h.update(e.name.as_bytes());
            h.update(&(e.shape.len() as u64).to_le_bytes());
            for d in &e.shape {
                h.update(&(*d as u64).to_le_bytes());
            }
        }
        h.finalize()
    }
}

/// The stage's parameters as one f32 vector in [`FlatLayout`] order.
pub fn flatten_params(stage: &Stage) -> Result<Vec<f32>> {
    let mut out = Vec::with_capacity(stage.num_parameters());
    for p in stage.params() {
        let t = p.var().as_tensor().flatten_all()?.to_dtype(DType::F32)?;
        out.extend(t.to_vec1::<f32>()?);
    }
    Ok(out)
}

/// Overwrite the stage's parameters from a flat vector (length and finiteness are checked first,
/// so a failed call changes nothing).
pub fn load_flat_params(stage: &Stage, flat: &[f32]) -> Result<()> {
    let layout = FlatLayout::of(stage);
    if flat.len() != layout.total {
        return Err(ModelError::shape(
            "flat parameters",
            &[layout.total],
            &[flat.len()],
        ));
    }
    if flat.iter().any(|v| !v.is_finite()) {
        return Err(ModelError::NonFinite("flat parameters".into()));
    }
    for (p, e) in stage.params().iter().zip(&layout.entries) {
        let var = p.var();
        let t = Tensor::from_slice(
            &flat[e.offset..e.offset + e.len],
            e.shape.clone(),
            var.device(),
        )?
        .to_dtype(var.dtype())?;
        var.set(&t)?;
    }
    stage.mark_weights_changed();
    Ok(())
}

fn check_range(layout: &FlatLayout, range: &Range<usize>) -> Result<()> {
    if range.start > range.end || range.end > layout.total {
        return Err(ModelError::InvalidInput(format!(
            "range {range:?} outside the flat view 0..{}",
            layout.total
        )));
    }
    Ok(())
}

/// The pieces of `range` that fall in each parameter: (parameter index, start within the
/// parameter, start within the range, length).
fn pieces(layout: &FlatLayout, range: &Range<usize>) -> Vec<(usize, usize, usize, usize)> {
    layout
        .entries
        .iter()
        .enumerate()
        .filter_map(|(i, e)| {
            let start = range.start.max(e.offset);
            let end = range.end.min(e.offset + e.len);
            (start < end).then(|| (i, start - e.offset, start - range.start, end - start))
        })
        .collect()
}

/// Elements `range` of the stage's flat f32 view (as [`flatten_params`] would give them),
/// copying only the tensors the range touches, so a partition of a large stage never needs a
/// full host copy.
pub fn flatten_range(stage: &Stage, range: Range<usize>) -> Result<Vec<f32>> {
    let layout = FlatLayout::of(stage);
    check_range(&layout, &range)?;
    let mut out = Vec::with_capacity(range.len());
    for (i, local, _, len) in pieces(&layout, &range) {
        let t = stage.params()[i]
            .var()
            .as_tensor()
            .flatten_all()?
            .narrow(0, local, len)?
            .to_dtype(DType::F32)?;
        out.extend(t.to_vec1::<f32>()?);
    }
    Ok(out)
}

/// Overwrite elements `range` of the stage's flat view with `values` (checked for length and
/// finiteness before anything is written) and bump the stage's weights version.
pub fn load_range(stage: &Stage, range: Range<usize>, values: &[f32]) -> Result<()> {
    let layout = FlatLayout::of(stage);
    check_range(&layout, &range)?;
    if values.len() != range.len() {
        return Err(ModelError::shape(
            format!("values for range {range:?}"),
            &[range.len()],
            &[values.len()],
        ));
    }
    if values.iter().any(|v| !v.is_finite()) {
        return Err(ModelError::NonFinite(format!("values for range {range:?}")));
    }
    for (i, local, at, len) in pieces(&layout, &range) {
        let var = stage.params()[i].var();
        let src =
            Tensor::from_slice(&values[at..at + len], len, var.device())?.to_dtype(var.dtype())?;
        // A contiguous variable's flat view shares its storage: write the slice in place.
        var.as_tensor().flatten_all()?.slice_set(&src, 0, local)?;
    }
    stage.mark_weights_changed();
    Ok(())
}

/// The pseudo-gradient `start - current` over `range` of the flat view, where `start` holds the
/// epoch-start weights of that range: what a miner uploads for one partition.
pub fn pseudo_gradient_range(
    stage: &Stage,
    range: Range<usize>,
    start: &[f32],
) -> Result<Vec<f32>> {
    let current = flatten_range(stage, range)?;
    crate::optim::pseudo_gradient(start, &current)
}

/// `parts` contiguous ranges covering `0..total`, sizes differing by at most one (the first
/// `total % parts` ranges are one longer).
pub fn partition_ranges(total: usize, parts: usize) -> Result<Vec<Range<usize>>> {
    if parts == 0 || parts > total.max(1) {
        return Err(ModelError::InvalidInput(format!(
            "cannot cut {total} elements into {parts} partitions"
        )));
    }
    let (base, extra) = (total / parts, total % parts);
    let mut start = 0;
    Ok((0..parts)
        .map(|j| {
            let len = base + usize::from(j < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect())
}

/// One contributor's slice and its weight (e.g. 1 + verified backward passes).
#[derive(Clone, Copy, Debug)]
pub struct Contribution<'a> {
    /// Non-negative, finite weight.
    pub weight: f64,
    /// The contributor's values for the partition.
    pub values: &'a [f32],
}

/// A merged partition and the digest both owners must agree on.
#[derive(Clone, Debug, PartialEq)]
pub struct MergedPartition {
    /// The weighted average.
    pub values: Vec<f32>,
    /// BLAKE3 of the values' little-endian bytes.
    pub digest: blake3::Hash,
}

/// BLAKE3 of the little-endian bytes of `values`.
pub fn digest_f32(values: &[f32]) -> blake3::Hash {
    let mut h = blake3::Hasher::new();
    for chunk in values.chunks(4096) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
        h.update(&bytes);
    }
    h.finalize()
}

fn pairwise_sum(terms: &[f32]) -> f32 {
    match terms.len() {
        0 => 0.0,
        1 => terms[0],
        n => {
            let (a, b) = terms.split_at(n / 2);
            pairwise_sum(a) + pairwise_sum(b)
        }
    }
}

/// Deterministic weighted average of `contributions` (in the given order), using `threads`
/// worker threads (0 or 1 = the calling thread). The weights are normalised in f64, rounded to
/// f32 once, and each output element is the pairwise sum of `w_j * x_j` over contributors.
pub fn weighted_average(
    contributions: &[Contribution<'_>],
    threads: usize,
) -> Result<MergedPartition> {
    let first = contributions
        .first()
        .ok_or_else(|| ModelError::InvalidInput("no contributions to average".into()))?;
    let len = first.values.len();
    let mut total = 0f64;
    for (j, c) in contributions.iter().enumerate() {
        if c.values.len() != len {
            return Err(ModelError::shape(
                format!("contribution {j}"),
                &[len],
                &[c.values.len()],
            ));
        }
        if !(c.weight.is_finite() && c.weight >= 0.0) {
            return Err(ModelError::InvalidInput(format!(
                "contribution {j} has weight {}",
                c.weight
            )));
        }
        if c.values.iter().any(|v| !v.is_finite()) {
            return Err(ModelError::NonFinite(format!("contribution {j}")));
        }
        total += c.weight;
    }
    if total <= 0.0 {
        return Err(ModelError::InvalidInput(
            "contribution weights sum to zero".into(),
        ));
    }
    let weights: Vec<f32> = contributions
        .iter()
        .map(|c| (c.weight / total) as f32)
        .collect();
    let mut out = vec![0f32; len];
    let fill = |start: usize, dst: &mut [f32]| {
        let mut terms = vec![0f32; contributions.len()];
        for (k, o) in dst.iter_mut().enumerate() {
            for (j, c) in contributions.iter().enumerate() {
                terms[j] = weights[j] * c.values[start + k];
            }
            *o = pairwise_sum(&terms);
        }
    };
    let threads = threads.max(1).min(len.max(1));
    if threads == 1 {
        fill(0, &mut out);
    } else {
        let chunk = len.div_ceil(threads);
        std::thread::scope(|s| {
            for (i, dst) in out.chunks_mut(chunk).enumerate() {
                let fill = &fill;
                s.spawn(move || fill(i * chunk, dst));
            }
        });
    }
    if out.iter().any(|v| !v.is_finite()) {
        return Err(ModelError::NonFinite("merged partition".into()));
    }
    let digest = digest_f32(&out);
    Ok(MergedPartition {
        values: out,
        digest,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::rng::SplitMix64;
    use crate::stage::StageOptions;

    #[test]
    fn partitions_cover_exactly() {
        for (total, parts) in [(10, 3), (7, 7), (1000, 6), (5, 1)] {
            let r = partition_ranges(total, parts).unwrap();
            assert_eq!(r.len(), parts);
            assert_eq!(r[0].start, 0);
            assert_eq!(r[parts - 1].end, total);
            for w in r.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            let lens: Vec<usize> = r.iter().map(|x| x.len()).collect();
            assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
        }
        assert!(partition_ranges(3, 0).is_err());
        assert!(partition_ranges(3, 4).is_err());
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = SplitMix64::new(seed);
        (0..n).map(|_| (r.next_normal() * 10.0) as f32).collect()
    }

    #[test]
    fn average_is_thread_count_independent_and_correct() {
        let data: Vec<Vec<f32>> = (0..5).map(|s| random(10_001, s)).collect();
        let weights = [1.0, 3.0, 0.5, 2.0, 11.0];
        let contribs: Vec<Contribution<'_>> = data
            .iter()
            .zip(weights)
            .map(|(v, w)| Contribution {
                weight: w,
                values: v,
            })
            .collect();
        let one = weighted_average(&contribs, 1).unwrap();
        for t in [2, 3, 8, 64] {
            let many = weighted_average(&contribs, t).unwrap();
            assert_eq!(one.digest, many.digest);
            assert_eq!(
                one.values.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                many.values.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
        let total: f64 = weights.iter().sum();
        for i in [0, 17, 10_000] {
            let exact: f64 = data
                .iter()
                .zip(weights)
                .map(|(v, w)| v[i] as f64 * w / total)
                .sum();
            assert!((one.values[i] as f64 - exact).abs() < 1e-4 * exact.abs().max(1.0));
        }
    }

    #[test]
    fn average_rejects_bad_contributions() {
        let a = vec![1.0f32, 2.0];
        let b = vec![1.0f32];
        let nan = vec![f32::NAN, 0.0];
        let c = |w, v| Contribution {
            weight: w,
            values: v,
        };
        assert!(weighted_average(&[], 1).is_err());
        assert!(weighted_average(&[c(1.0, &a), c(1.0, &b)], 1).is_err());
        assert!(weighted_average(&[c(1.0, &a), c(1.0, &nan)], 1).is_err());
        assert!(weighted_average(&[c(-1.0, &a)], 1).is_err());
        assert!(weighted_average(&[c(0.0, &a)], 1).is_err());
        assert!(weighted_average(&[c(f64::NAN, &a)], 1).is_err());
        let one = weighted_average(&[c(2.0, &a)], 4).unwrap();
        assert_eq!(one.values, a);
    }

    /// One epoch of the merge protocol for one stage: replicas train from the same weights,
    /// upload pseudo-gradients in partitions, two owners per partition average them and must
    /// agree bit for bit, and the outer step moves the global weights.
    #[test]
    fn butterfly_epoch_owners_agree_and_outer_step_applies() {
        use crate::data::{GrammarCorpus, make_batch};
        use crate::optim::{OuterConfig, OuterOptimizer, pseudo_gradient};
        use crate::train::Trainer;
        use crate::{AdamWConfig, LrSchedule, Pipeline};
        use candle_core::Device;

        let cfg = ModelConfig::tiny();
        let g = GrammarCorpus::new(1, 16).unwrap();
        let start: Vec<Vec<f32>> = Stage::all(&cfg, &StageOptions::cpu())
            .unwrap()
            .iter()
            .map(|s| flatten_params(s).unwrap())
            .collect();
        // Three replicas of the whole pipeline, each on its own data.
        let mut pseudo = Vec::new();
        for r in 0..3u64 {
            let p = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
            let mut t = Trainer::new(p, AdamWConfig::default(), LrSchedule::constant()).unwrap();
            for step in 0..2 {
                let ids: Vec<u64> = (0..4).map(|i| 1000 * r + 4 * step + i).collect();
                t.step(&[make_batch(&g, &ids, &Device::Cpu).unwrap()])
                    .unwrap();
            }
            let cur = flatten_params(&t.pipeline().stages()[1]).unwrap();
            pseudo.push(pseudo_gradient(&start[1], &cur).unwrap());
        }
        let work = [3.0, 1.0, 2.0];
        let parts = partition_ranges(start[1].len(), 4).unwrap();
        let mut merged = Vec::new();
        for range in &parts {
            let contribs: Vec<Contribution<'_>> = pseudo
                .iter()
                .zip(work)
                .map(|(pg, w)| Contribution {
                    weight: w,
                    values: &pg[range.clone()],
                })
                .collect();
            let owner_a = weighted_average(&contribs, 1).unwrap();
            let owner_b = weighted_average(&contribs, 3).unwrap();
            assert_eq!(owner_a.digest, owner_b.digest);
            assert_eq!(owner_a.digest, digest_f32(&owner_b.values));
            merged.extend(owner_a.values);
        }
        let mut global = start[1].clone();
        let mut outer = OuterOptimizer::new(OuterConfig::default(), global.len()).unwrap();
        outer.step(&mut global, &merged).unwrap();
        assert_ne!(global, start[1]);
        let stage = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
        load_flat_params(&stage, &global).unwrap();
        assert_eq!(flatten_params(&stage).unwrap(), global);
    }

    #[test]
    fn range_io_matches_the_full_view_across_tensor_boundaries() {
        use crate::optim::pseudo_gradient;
        let cfg = ModelConfig::tiny();
        let s = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
        let full = flatten_params(&s).unwrap();
        let n = full.len();
        let layout = FlatLayout::of(&s);
        let b1 = layout.entries[1].offset;
        // Ranges inside one tensor, across several, empty, and the whole view.
        for r in [0..5, b1 - 3..b1 + 700, 0..n, n - 1..n, 7..7] {
            assert_eq!(flatten_range(&s, r.clone()).unwrap(), full[r].to_vec());
        }
        assert!(flatten_range(&s, 0..n + 1).is_err());
        let v0 = s.weights_version();
        let parts = partition_ranges(n, 7).unwrap();
        let mut expect = full.clone();
        for (j, r) in parts.iter().enumerate() {
            let vals: Vec<f32> = (0..r.len()).map(|k| (j * 1000 + k) as f32 * 1e-4).collect();
            expect[r.clone()].copy_from_slice(&vals);
            load_range(&s, r.clone(), &vals).unwrap();
        }
        assert_eq!(flatten_params(&s).unwrap(), expect);
        assert_eq!(s.weights_version(), v0 + 7);
        // Bad input changes nothing.
        assert!(load_range(&s, 0..3, &[1.0, 2.0]).is_err());
        assert!(load_range(&s, 0..2, &[1.0, f32::NAN]).is_err());
        assert!(load_range(&s, n..n + 1, &[1.0]).is_err());
        assert_eq!(flatten_params(&s).unwrap(), expect);
        // The pseudo-gradient by partition equals the full one, sliced.
        let pg = pseudo_gradient(&full, &expect).unwrap();
        for r in &parts {
            assert_eq!(
                pseudo_gradient_range(&s, r.clone(), &full[r.clone()]).unwrap(),
                pg[r.clone()].to_vec()
            );
        }
    }

    /// The outer step applied partition by partition, in any order, gives the same bytes as the
    /// whole-vector step, and the step count advances once the partitions cover the vector.
    #[test]
    fn outer_step_by_partition_equals_whole_step() {
        use crate::optim::{OuterConfig, OuterOptimizer};
        let n = 10_007;
        let w0 = random(n, 1);
        let g1 = random(n, 2);
        let g2 = random(n, 3);
        let mut whole = OuterOptimizer::new(OuterConfig::default(), n).unwrap();
        let mut ww = w0.clone();
        whole.step(&mut ww, &g1).unwrap();
        whole.step(&mut ww, &g2).unwrap();
        let mut parted = OuterOptimizer::new(OuterConfig::default(), n).unwrap();
        let mut wp = w0.clone();
        let parts = partition_ranges(n, 5).unwrap();
        for g in [&g1, &g2] {
            for j in [3, 0, 4, 1, 2] {
                let r = parts[j].clone();
                assert_eq!(parted.steps(), if std::ptr::eq(g, &g1) { 0 } else { 1 });
                parted
                    .step_partition(r.clone(), &mut wp[r.clone()], &g[r])
                    .unwrap();
            }
        }
        assert_eq!(parted.steps(), 2);
        assert!(!parted.step_in_progress());
        assert_eq!(
            ww.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            wp.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(whole.momentum_buffer(), parted.momentum_buffer());
        // A partition applied twice in one step, or out of bounds, is refused without change.
        let r = parts[0].clone();
        parted
            .step_partition(r.clone(), &mut wp[r.clone()], &g1[r.clone()])
            .unwrap();
        let before = (wp.clone(), parted.momentum_buffer().to_vec());
        assert!(
            parted
                .step_partition(r.clone(), &mut wp[r.clone()], &g1[r.clone()])
                .is_err()
        );
        assert!(
            parted
                .step_partition(n - 1..n + 1, &mut [0.0, 0.0], &[0.0, 0.0])
                .is_err()
        );
        assert!(
            parted.step(&mut wp, &g1).is_err(),
            "a partitioned step is in progress"
        );
        assert_eq!((wp, parted.momentum_buffer().to_vec()), before);
    }

    #[test]
    fn flat_round_trip_and_layout() {
        let cfg = ModelConfig::tiny();
        let s = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
        let layout = FlatLayout::of(&s);
        assert_eq!(layout.total, cfg.stage_param_count(1).unwrap());
        let flat = flatten_params(&s).unwrap();
        assert_eq!(flat.len(), layout.total);
        let shifted: Vec<f32> = flat.iter().map(|v| v + 1.0).collect();
        let v0 = s.weights_version();
        load_flat_params(&s, &shifted).unwrap();
        assert_eq!(flatten_params(&s).unwrap(), shifted);
        // A load is a change of weights (a forward cached before it is stale); a refused load
        // changes nothing.
        assert_eq!(s.weights_version(), v0 + 1);
        assert!(load_flat_params(&s, &shifted[1..]).is_err());
        let mut bad = shifted.clone();
        bad[3] = f32::INFINITY;
        assert!(load_flat_params(&s, &bad).is_err());
        assert_eq!(flatten_params(&s).unwrap(), shifted);
        assert_eq!(s.weights_version(), v0 + 1);
        let other = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
        assert_eq!(layout.fingerprint(), FlatLayout::of(&other).fingerprint());
        let s0 = Stage::new(&cfg, 0, StageOptions::cpu()).unwrap();
        assert_ne!(layout.fingerprint(), FlatLayout::of(&s0).fingerprint());
    }
}
