//! Differentiable building blocks.
//!
//! candle's fused `rms_norm`, `softmax_last_dim` and `rotary_emb::rope*` kernels have no backward
//! pass: gradients silently stop at them. On the CPU in f32/f64 the layers run this crate's fused
//! kernels, which have one (`crate::fused`); elsewhere (CUDA, half precision) they are written
//! with ops that candle can differentiate (matmul, elementwise, reductions, narrow/cat).

use candle_core::{D, DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::fused::{self, RopeTables};
use crate::product::matmul;

/// `x @ w^T` for `x: [..., in]` and `w: [out, in]`, folding leading dims into one matmul.
pub(crate) fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if fused::applies(x) && x.dtype() == w.dtype() && w.device().is_cpu() {
        return Ok(crate::linear::linear(x, w)?);
    }
    let dims = x.dims();
    let (lead, inner) = dims.split_at(dims.len().saturating_sub(1));
    let rows: usize = lead.iter().product();
    let inp = *inner
        .first()
        .ok_or_else(|| ModelError::InvalidInput("linear on a scalar".into()))?;
    let out = w.dim(0)?;
    let y = matmul(&x.reshape((rows, inp))?, &w.t()?)?;
    let mut shape = lead.to_vec();
    shape.push(out);
    Ok(y.reshape(shape)?)
}

/// RMSNorm over the last dim: `x / sqrt(mean(x^2) + eps) * w`.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if fused::applies(x) {
        return Ok(fused::rms_norm(x, w, eps)?);
    }
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (ms + eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv)?.broadcast_mul(w)?)
}

/// Softmax over the last dim. The max is detached: softmax is shift invariant, so this changes
/// no value or gradient and spares a backward pass through the max.
pub(crate) fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    Ok(e.broadcast_div(&s)?)
}

/// Additive causal mask `[t, t]`: 0 on and below the diagonal, -inf above.
pub(crate) fn causal_mask(t: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let data: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(data, (t, t), device)?.to_dtype(dtype)?)
}

/// Precomputed rotary tables `[max_seq_len, head_dim / 2]` (rotate-half layout, as HF Llama).
#[derive(Debug, Clone)]
pub(crate) struct Rope {
    cos: Tensor,
    sin: Tensor,
    /// The same tables in f64 for the fused CPU kernel.
    tables: RopeTables,
}

impl Rope {
    pub(crate) fn new(cfg: &ModelConfig, dtype: DType, device: &Device) -> Result<Self> {
        let hd = cfg.head_dim();
        let half = hd / 2;
        let mut inv_freq: Vec<f64> = (0..half)
            .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / hd as f64))
            .collect();
        if let Some(s) = &cfg.rope_scaling {
            let orig = s.original_context as f64;
            let low_wavelen = orig / s.low_freq_factor;
            let high_wavelen = orig / s.high_freq_factor;
            for f in inv_freq.iter_mut() {
                let wavelen = std::f64::consts::TAU / *f;
                if wavelen > low_wavelen {
                    *f /= s.factor;
                } else if wavelen >= high_wavelen {
                    let smooth = (orig / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
                }
            }
        }
        let t = cfg.max_seq_len;
        let mut cos = Vec::with_capacity(t * half);
        let mut sin = Vec::with_capacity(t * half);
        for pos in 0..t {
            for f in &inv_freq {
                let a = pos as f64 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let tables = RopeTables {
            cos: std::sync::Arc::new(cos.clone()),
            sin: std::sync::Arc::new(sin.clone()),
            half,
        };
        let cos = Tensor::from_vec(cos, (t, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (t, half), device)?.to_dtype(dtype)?;
        Ok(Self { cos, sin, tables })
    }

    fn check_positions(&self, offset: usize, t: usize) -> Result<()> {
        let positions = self.cos.dim(0)?;
        if offset + t > positions {
            return Err(ModelError::InvalidInput(format!(
                "positions {offset}..{} exceed the {positions} rotary positions (max_seq_len)",
                offset + t
            )));
        }
        Ok(())
    }

    /// Rotate `x: [batch, heads, seq, head_dim]` (positions `0..seq`).
    pub(crate) fn apply(&self, x: &Tensor) -> Result<Tensor> {
        self.apply_at(x, 0)
    }

    /// Rotate `x: [batch, heads, seq, head_dim]` holding positions `offset..offset + seq`.
    pub(crate) fn apply_at(&self, x: &Tensor, offset: usize) -> Result<Tensor> {
        let (_, _, t, hd) = x.dims4()?;
        self.check_positions(offset, t)?;
        if fused::applies(x) {
            if offset == 0 {
                return Ok(fused::rope(x, &self.tables)?);
            }
            // The kernel reads rows 0..seq of its tables: hand it the rows from `offset`.
            let half = self.tables.half;
            let rows = offset * half..(offset + t) * half;
            let tables = RopeTables {
                cos: std::sync::Arc::new(self.tables.cos[rows.clone()].to_vec()),
                sin: std::sync::Arc::new(self.tables.sin[rows].to_vec()),
                half,
            };
            return Ok(fused::rope(x, &tables)?);
        }
        let half = hd / 2;
        let cos = self.cos.narrow(0, offset, t)?;
        let sin = self.sin.narrow(0, offset, t)?;
        let x1 = x.narrow(D::Minus1, 0, half)?;
        let x2 = x.narrow(D::Minus1, half, half)?;
        let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
        let r2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
        Ok(Tensor::cat(&[r1, r2], D::Minus1)?)
    }
}

/// Attention weights of one block, already cast to the compute dtype.
pub(crate) struct AttnWeights<'a> {
    pub wq: &'a Tensor,
    pub wk: &'a Tensor,
    pub wv: &'a Tensor,
    pub wo: &'a Tensor,
}

/// Query rows per block of the tiled attention, which sequences longer than this use on the CPU:
/// their score matrices are never whole (`crate::tiled_attention`).
pub(crate) const TILED_ATTENTION_ROWS: usize = 128;

/// Causal grouped-query self-attention on a normalised input `x: [batch, seq, d]`.
pub(crate) fn attention(
    x: &Tensor,
    w: &AttnWeights<'_>,
    cfg: &ModelConfig,
    rope: &Rope,
    mask: &Tensor,
) -> Result<Tensor> {
    let (b, t, _) = x.dims3()?;
    let (h, kv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim());
    let scale = 1.0 / (hd as f64).sqrt();
    if fused::applies(x) && t <= TILED_ATTENTION_ROWS {
        rope.check_positions(0, t)?;
        let shape = crate::short_attention::Heads {
            heads: h,
            kv_heads: kv,
            head_dim: hd,
        };
        let (q, k, v) = (linear(x, w.wq)?, linear(x, w.wk)?, linear(x, w.wv)?);
        let out = crate::short_attention::attention(&q, &k, &v, shape, &rope.tables, scale)?;
        return linear(&out, w.wo);
    }
    let heads =
        |y: Tensor, n: usize| -> Result<Tensor> { Ok(y.reshape((b, t, n, hd))?.transpose(1, 2)?) };
    let q = rope.apply(&heads(linear(x, w.wq)?, h)?)?;
    let k = rope.apply(&heads(linear(x, w.wk)?, kv)?)?;
    let v = heads(linear(x, w.wv)?, kv)?.contiguous()?;
    #[cfg(feature = "cuda")]
    if crate::cuda_attention::applies(&q) {
        let out = crate::cuda_attention::attention(&q, &k, &v, scale)?
            .transpose(1, 2)?
            .reshape((b, t, h * hd))?;
        return linear(&out, w.wo);
    }
    if fused::applies(&q) {
        let out = crate::tiled_attention::attention(&q, &k, &v, mask, scale, TILED_ATTENTION_ROWS)?
            .transpose(1, 2)?
            .reshape((b, t, h * hd))?;
        return linear(&out, w.wo);
    }
    let (k, v) = if h == kv {
        (k, v)
    } else {
        // Each key/value head serves h/kv query heads.
        let rep = h / kv;
        let expand = |y: Tensor| -> Result<Tensor> {
            Ok(y.unsqueeze(2)?
                .broadcast_as((b, kv, rep, t, hd))?
                .reshape((b, h, t, hd))?)
        };
        (expand(k)?, expand(v)?)
    };
    let scores = (matmul(&q, &k.t()?)? * scale)?;
    // Under half-precision compute the mask is f32 and the softmax runs in f32: exp and its sum
    // lose too much in bf16.
    let probs = if scores.dtype() == mask.dtype() {
        softmax_last(&scores.broadcast_add(mask)?)?
    } else {
        softmax_last(&scores.to_dtype(mask.dtype())?.broadcast_add(mask)?)?
            .to_dtype(scores.dtype())?
    };
    let out = matmul(&probs, &v)?
        .transpose(1, 2)?
        .reshape((b, t, h * hd))?;
    linear(&out, w.wo)
}

/// Keys (after RoPE) and values of the positions a block has seen, `[batch, kv_heads,
/// positions, head_dim]` each: the state of incremental (generation) attention.
#[derive(Debug, Clone, Default)]
pub(crate) struct KvCache {
    kv: Option<(Tensor, Tensor)>,
    len: usize,
}

impl KvCache {
    /// Positions held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Append `n` positions; returns the keys and values of all positions.
    fn append(&mut self, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        let n = k.dim(2)?;
        // Contiguous parts make a contiguous concatenation, which the products need.
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        let (k, v) = match self.kv.take() {
            Some((pk, pv)) => (
                Tensor::cat(&[&pk, &k], 2)?.contiguous()?,
                Tensor::cat(&[&pv, &v], 2)?.contiguous()?,
            ),
            None => (k, v),
        };
        self.kv = Some((k.clone(), v.clone()));
        self.len += n;
        Ok((k, v))
    }
}

/// [`attention`] of `n` new positions `x: [batch, n, d]` that follow the `cache.len()`
/// positions in `cache`, which receives their keys and values. Query `i` (position
/// `cache.len() + i`) attends to every position up to its own.
pub(crate) fn attention_cached(
    x: &Tensor,
    w: &AttnWeights<'_>,
    cfg: &ModelConfig,
    rope: &Rope,
    cache: &mut KvCache,
) -> Result<Tensor> {
    let (b, n, _) = x.dims3()?;
    let (h, kv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim());
    let past = cache.len();
    let heads =
        |y: Tensor, m: usize| -> Result<Tensor> { Ok(y.reshape((b, n, m, hd))?.transpose(1, 2)?) };
    let q = rope.apply_at(&heads(linear(x, w.wq)?, h)?, past)?;
    let k = rope.apply_at(&heads(linear(x, w.wk)?, kv)?, past)?;
    let v = heads(linear(x, w.wv)?, kv)?;
    let (k, v) = cache.append(k, v)?;
    let total = past + n;
    // Query heads i * rep .. (i + 1) * rep share key/value head i, as in `attention`: stacked
    // as rows of one product per key/value head.
    let rep = h / kv;
    let q = q.contiguous()?.reshape((b, kv, rep * n, hd))?;
    let scale = 1.0 / (hd as f64).sqrt();
    let scores = (matmul(&q, &k.t()?)? * scale)?.reshape((b, h, n, total))?;
    // Softmax in f32 under half-precision compute, as in `attention`.
    let sdtype = match scores.dtype() {
        DType::BF16 | DType::F16 => DType::F32,
        other => other,
    };
    let scores = scores.to_dtype(sdtype)?;
    let scores = if n > 1 {
        let data: Vec<f32> = (0..n)
            .flat_map(|i| {
                (0..total).map(move |j| {
                    if j <= past + i {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(data, (n, total), x.device())?.to_dtype(sdtype)?;
        scores.broadcast_add(&mask)?
    } else {
        // A single new position sees every cached one.
        scores
    };
    let probs = softmax_last(&scores)?
        .to_dtype(v.dtype())?
        .reshape((b, kv, rep * n, total))?;
    let out = matmul(&probs, &v)?
        .reshape((b, h, n, hd))?
        .transpose(1, 2)?
        .reshape((b, n, h * hd))?;
    linear(&out, w.wo)
}

/// SwiGLU feed-forward without the residual: `w_down(silu(w_gate x) * w_up x)`.
pub(crate) fn swiglu(
    x: &Tensor,
    w_gate: &Tensor,
    w_up: &Tensor,
    w_down: &Tensor,
) -> Result<Tensor> {
    let on_cpu = |w: &Tensor| w.dtype() == x.dtype() && w.device().is_cpu();
    if fused::applies(x) && on_cpu(w_gate) && on_cpu(w_up) {
        return linear(&crate::linear::gate_up(x, w_gate, w_up)?, w_down);
    }
    let g = linear(x, w_gate)?;
    let u = linear(x, w_up)?;
    if fused::applies(&g) {
        return linear(&fused::silu_mul(&g, &u)?, w_down);
    }
    linear(&(g.silu()? * u)?, w_down)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev() -> Device {
        Device::Cpu
    }

    /// A block's attention and feed-forward through the fused CPU kernels and through the
    /// composed candle ops: same values and same gradients (f64, grouped-query heads).
    #[test]
    fn fused_kernels_match_composed_ops() {
        let cfg = ModelConfig::tiny();
        let d = cfg.d_model;
        let kvd = cfg.n_kv_heads * cfg.head_dim();
        let var = |dims: &[usize], seed: u64, scale: f64| {
            let mut r = crate::rng::SplitMix64::new(seed);
            let n: usize = dims.iter().product();
            let v: Vec<f64> = (0..n).map(|_| r.next_normal() * scale).collect();
            candle_core::Var::from_tensor(&Tensor::from_vec(v, dims, &dev()).unwrap()).unwrap()
        };
        let x = var(&[2, 7, d], 1, 1.0);
        let norm_w = var(&[d], 2, 1.0);
        let (wq, wk, wv, wo) = (
            var(&[d, d], 3, 0.3),
            var(&[kvd, d], 4, 0.3),
            var(&[kvd, d], 5, 0.3),
            var(&[d, d], 6, 0.3),
        );
        let (wg, wu, wd) = (
            var(&[cfg.d_ff, d], 7, 0.3),
            var(&[cfg.d_ff, d], 8, 0.3),
            var(&[d, cfg.d_ff], 9, 0.3),
        );
        let r = var(&[2, 7, d], 10, 1.0);
        let rope = Rope::new(&cfg, DType::F64, &dev()).unwrap();
        let mask = causal_mask(7, DType::F64, &dev()).unwrap();
        let vars = [&x, &norm_w, &wq, &wk, &wv, &wo, &wg, &wu, &wd];
        let run = |composed: bool| {
            crate::fused::COMPOSED_ONLY.with(|c| c.set(composed));
            let n = rms_norm(x.as_tensor(), norm_w.as_tensor(), 1e-5).unwrap();
            let w = AttnWeights {
                wq: wq.as_tensor(),
                wk: wk.as_tensor(),
                wv: wv.as_tensor(),
                wo: wo.as_tensor(),
            };
            let a = attention(&n, &w, &cfg, &rope, &mask).unwrap();
            let f = swiglu(&a, wg.as_tensor(), wu.as_tensor(), wd.as_tensor()).unwrap();
            crate::fused::COMPOSED_ONLY.with(|c| c.set(false));
            let loss = (f * r.as_tensor()).unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            let mut out = vec![loss.to_scalar::<f64>().unwrap()];
            for v in vars {
                out.extend(
                    grads
                        .get(v.as_tensor())
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f64>()
                        .unwrap(),
                );
            }
            out
        };
        let (fused, composed) = (run(false), run(true));
        assert_eq!(fused.len(), composed.len());
        let scale = composed.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (i, (a, b)) in fused.iter().zip(&composed).enumerate() {
            assert!((a - b).abs() <= 1e-12 * scale, "element {i}: {a} vs {b}");
        }
    }

    #[test]
    fn softmax_matches_reference_and_has_gradient() {
        let x = candle_core::Var::new(&[[1.0f32, 2.0, 3.0], [0.0, 0.0, f32::NEG_INFINITY]], &dev())
            .unwrap();
        let p = softmax_last(x.as_tensor()).unwrap();
        let v = p.to_vec2::<f32>().unwrap();
        let e: Vec<f32> = [1.0f32, 2.0, 3.0].iter().map(|a| (a - 3.0).exp()).collect();
        let s: f32 = e.iter().sum();
        for j in 0..3 {
            assert!((v[0][j] - e[j] / s).abs() < 1e-6);
        }
        assert_eq!(v[1], vec![0.5, 0.5, 0.0]);
        let w = Tensor::new(&[[1.0f32, 0.0, 0.0], [0.0, 0.0, 0.0]], &dev()).unwrap();
        let g = (p * w).unwrap().sum_all().unwrap().backward().unwrap();
        let gx = g.get(x.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        assert!(gx[0][0] > 0.0 && gx[0][1] < 0.0);
        assert!(gx[1].iter().all(|v| v.is_finite()));
    }

    #[test]
    fn rms_norm_matches_hand_computation() {
        // eps 0 with unit gains: every row comes out with unit RMS.
        let x = Tensor::new(&[[3.0f32, 4.0], [1.0, -1.0]], &dev()).unwrap();
        let w = Tensor::new(&[1.0f32, 1.0], &dev()).unwrap();
        let y = rms_norm(&x, &w, 0.0).unwrap().to_vec2::<f32>().unwrap();
        for row in y {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / 2.0;
            assert!((ms - 1.0).abs() < 1e-5);
        }
        // A large eps and non-unit gains: x / sqrt(mean(x^2) + eps) * w, eps inside the root.
        let x = Tensor::new(&[[3.0f64, 4.0, 0.0]], &dev()).unwrap();
        let w = Tensor::new(&[2.0f64, -1.0, 5.0], &dev()).unwrap();
        let y = rms_norm(&x, &w, 0.5).unwrap().to_vec2::<f64>().unwrap();
        let inv = 1.0 / ((9.0 + 16.0) / 3.0 + 0.5f64).sqrt();
        let expect = [3.0 * inv * 2.0, -4.0 * inv, 0.0];
        for (a, b) in y[0].iter().zip(expect) {
            assert!((a - b).abs() < 1e-12, "{:?} vs {expect:?}", y[0]);
        }
    }

    #[test]
    fn rope_matches_hand_computed_rotation() {
        let cfg = ModelConfig::tiny();
        let hd = cfg.head_dim();
        let half = hd / 2;
        let rope = Rope::new(&cfg, DType::F64, &dev()).unwrap();
        let x = Tensor::randn(0f64, 1.0, (1, 2, 5, hd), &dev()).unwrap();
        let y = rope.apply(&x).unwrap();
        let xv = x.squeeze(0).unwrap().to_vec3::<f64>().unwrap();
        let yv = y.squeeze(0).unwrap().to_vec3::<f64>().unwrap();
        // Rotate-half layout (HF Llama): pair (i, i + half) rotates by pos * theta^(-2i/hd).
        for h in 0..2 {
            for pos in 0..5 {
                for i in 0..half {
                    let a = pos as f64 * cfg.rope_theta.powf(-2.0 * i as f64 / hd as f64);
                    let (x1, x2) = (xv[h][pos][i], xv[h][pos][i + half]);
                    let r1 = x1 * a.cos() - x2 * a.sin();
                    let r2 = x2 * a.cos() + x1 * a.sin();
                    assert!((yv[h][pos][i] - r1).abs() < 1e-12, "pos {pos} i {i}");
                    assert!((yv[h][pos][i + half] - r2).abs() < 1e-12, "pos {pos} i {i}");
                }
            }
        }
        // Relative positions: <R(m) q, R(n) k> depends only on m - n.
        let q = Tensor::randn(0f64, 1.0, (1, 1, 1, hd), &dev()).unwrap();
        let k = Tensor::randn(0f64, 1.0, (1, 1, 1, hd), &dev()).unwrap();
        let at = |t: &Tensor, p: usize| {
            let rep = t.repeat((1, 1, 5, 1)).unwrap();
            rope.apply(&rep).unwrap().narrow(2, p, 1).unwrap()
        };
        let dot = |a: Tensor, b: Tensor| {
            (a * b)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        let d1 = dot(at(&q, 3), at(&k, 1));
        let d2 = dot(at(&q, 4), at(&k, 2));
        let d3 = dot(at(&q, 4), at(&k, 1));
        assert!((d1 - d2).abs() < 1e-12);
        assert!(
            (d1 - d3).abs() > 1e-6,
            "a different offset gives a different score"
        );
    }

    #[test]
    fn llama3_scaling_slows_low_frequencies() {
        let mut cfg = ModelConfig::iota_1_5b();
        cfg.max_seq_len = 4;
        let plain = {
            let mut c = cfg.clone();
            c.rope_scaling = None;
            Rope::new(&c, DType::F32, &dev()).unwrap()
        };
        let scaled = Rope::new(&cfg, DType::F32, &dev()).unwrap();
        let p = plain
            .sin
            .narrow(0, 1, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let s = scaled
            .sin
            .narrow(0, 1, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        // Highest frequency untouched, lowest divided by the factor.
        assert_eq!(p[0], s[0]);
        let last = p.len() - 1;
        assert!((p[last] / s[last] - 32.0).abs() < 0.5);
        // Every frequency against Llama 3.1's rule, written out here as the share of the
        // original frequency kept: none past the long wavelength (only 1/factor of it), all of it
        // below the short one, and in between a share linear in context / wavelength.
        let sc = cfg.rope_scaling.clone().unwrap();
        let hd = cfg.head_dim() as f64;
        let mut blended = 0;
        for (i, got) in s.iter().enumerate() {
            let f = 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / hd);
            let waves_in_context = sc.original_context as f64 * f / std::f64::consts::TAU;
            let kept = ((waves_in_context - sc.low_freq_factor)
                / (sc.high_freq_factor - sc.low_freq_factor))
                .clamp(0.0, 1.0);
            if kept > 0.0 && kept < 1.0 {
                blended += 1;
            }
            let expected = f * (kept + (1.0 - kept) / sc.factor);
            // At position 1 the angle is the frequency (all under pi/2).
            let got = f64::from(*got).asin();
            assert!(
                (got - expected).abs() <= 1e-5 * expected,
                "frequency {i}: {got} against {expected} (kept {kept})"
            );
        }
        assert!(
            blended >= 3,
            "only {blended} frequencies in the blended band"
        );
    }
}
