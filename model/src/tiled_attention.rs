//! Causal attention a block of query rows at a time, keeping no score matrix for the backward.
//!
//! Plain attention builds `[batch, heads, t, t]` scores and probabilities, and autograd keeps
//! them until the backward: at IOTA's 4×800 tokens and 16 heads that is 164 MB per copy and
//! block. Here the forward visits `block` query rows at a time (each row block against the keys
//! it may see), keeps only the output and each row's log-sum-exp, and the backward recomputes
//! every row block's probabilities from those (the FlashAttention recurrence, with whole key rows
//! per block: the keys of a 800-token sequence fit in one tile). At most one row block's scores
//! exist at a time, forward or backward.
//!
//! Inputs are `q: [b, heads, t, hd]` and `k, v: [b, kv_heads, t, hd]` after RoPE; each key/value
//! head serves `heads / kv_heads` adjacent query heads. Scores, the softmax and the log-sum-exp
//! are f32 or f64 (the mask's dtype); products run in the inputs' dtype. CPU only: the graph is
//! cut by a custom op whose forward hands back the output computed outside it.

use candle_core::{CpuStorage, CustomOp3, D, Layout, Shape, Tensor};

use crate::error::Result;
use crate::product::matmul;

/// Causal attention of `q` over `k`, `v` with scores scaled by `scale` and the additive mask
/// `mask: [t, t]` (0 where a row may look, -inf elsewhere), `block` query rows at a time.
/// Differentiable in `q`, `k` and `v`.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
    block: usize,
) -> Result<Tensor> {
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let mut op = TiledAttention {
        mask: mask.detach(),
        scale,
        block: block.max(1),
        lse: None,
        out: None,
    };
    let (out, lse) = op.forward(&q.detach(), &k.detach(), &v.detach())?;
    op.lse = Some(lse);
    op.out = Some(crate::fused::Precomputed::new(out));
    Ok(q.apply_op3(&k, &v, op)?)
}

struct TiledAttention {
    mask: Tensor,
    scale: f64,
    block: usize,
    /// Each row's log-sum-exp `[b, heads, t, 1]`, kept for the backward.
    lse: Option<Tensor>,
    /// The output, computed before the op is applied and handed over by its forward.
    out: Option<crate::fused::Precomputed>,
}

/// `y: [b, kv, t, hd]` with each head repeated for the `heads / kv` query heads it serves.
fn expand_heads(y: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, kv, t, hd) = y.dims4()?;
    if kv == heads {
        return Ok(y.clone());
    }
    Ok(y.unsqueeze(2)?
        .broadcast_as((b, kv, heads / kv, t, hd))?
        .reshape((b, heads, t, hd))?)
}

/// The sum over each group of `heads / kv` adjacent heads of `y: [b, heads, t, hd]`.
fn fold_heads(y: &Tensor, kv: usize) -> Result<Tensor> {
    let (b, heads, t, hd) = y.dims4()?;
    if kv == heads {
        return Ok(y.clone());
    }
    Ok(y.reshape((b, kv, heads / kv, t, hd))?.sum(2)?)
}

/// Row blocks `(first row, rows)` of `t` rows.
fn row_blocks(t: usize, block: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t).step_by(block).map(move |r| (r, block.min(t - r)))
}

impl TiledAttention {
    /// Scaled, masked scores of rows `r0..r0 + rows` against the keys they may see (`0..r0 +
    /// rows`), in the mask's dtype.
    fn scores(&self, q: &Tensor, k: &Tensor, r0: usize, rows: usize) -> Result<Tensor> {
        let end = r0 + rows;
        let qb = q.narrow(2, r0, rows)?;
        let kb = k.narrow(2, 0, end)?;
        let s = matmul(&qb, &kb.t()?)?.to_dtype(self.mask.dtype())?;
        let mask = self.mask.narrow(0, r0, rows)?.narrow(1, 0, end)?;
        Ok((s * self.scale)?.broadcast_add(&mask)?)
    }

    /// Output `[b, heads, t, hd]` and log-sum-exp `[b, heads, t, 1]` of detached inputs.
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (_, heads, t, _) = q.dims4()?;
        let (k, v) = (expand_heads(k, heads)?, expand_heads(v, heads)?);
        let (mut outs, mut lses) = (Vec::new(), Vec::new());
        for (r0, rows) in row_blocks(t, self.block) {
            let s = self.scores(q, &k, r0, rows)?;
            let max = s.max_keepdim(D::Minus1)?;
            let e = s.broadcast_sub(&max)?.exp()?;
            let sum = e.sum_keepdim(D::Minus1)?;
            let p = e.broadcast_div(&sum)?.to_dtype(v.dtype())?;
            outs.push(matmul(&p, &v.narrow(2, 0, r0 + rows)?)?);
            lses.push((max + sum.log()?)?);
        }
        Ok((Tensor::cat(&outs, 2)?, Tensor::cat(&lses, 2)?))
    }

    /// Gradients of `q`, `k`, `v` (detached) given the output `o` and its gradient `d_o`.
    fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
        lse: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (_, heads, t, _) = q.dims4()?;
        let kv = k.dim(1)?;
        let (ke, ve) = (expand_heads(k, heads)?, expand_heads(v, heads)?);
        let sdtype = self.mask.dtype();
        let d_o = d_o.contiguous()?;
        // D_i = sum_j P_ij dP_ij = dO_i . O_i: the softmax backward's row term, without P.
        let row_dot = (d_o.to_dtype(sdtype)? * o.to_dtype(sdtype)?)?.sum_keepdim(D::Minus1)?;
        let mut dq = Vec::new();
        let mut dk = ke.zeros_like()?.to_dtype(sdtype)?;
        let mut dv = dk.clone();
        for (r0, rows) in row_blocks(t, self.block) {
            let end = r0 + rows;
            let s = self.scores(q, &ke, r0, rows)?;
            let p = s.broadcast_sub(&lse.narrow(2, r0, rows)?)?.exp()?;
            let d_ob = d_o.narrow(2, r0, rows)?;
            let (kb, vb, qb) = (
                ke.narrow(2, 0, end)?,
                ve.narrow(2, 0, end)?,
                q.narrow(2, r0, rows)?,
            );
            let p_in = p.to_dtype(v.dtype())?;
            let dv_b = matmul(&p_in.t()?, &d_ob)?.to_dtype(sdtype)?;
            let dp = matmul(&d_ob, &vb.t()?)?.to_dtype(sdtype)?;
            let ds = (p * dp.broadcast_sub(&row_dot.narrow(2, r0, rows)?)?)?;
            let ds = (ds * self.scale)?.to_dtype(q.dtype())?;
            dq.push(matmul(&ds, &kb)?.to_dtype(sdtype)?);
            let dk_b = matmul(&ds.t()?, &qb)?.to_dtype(sdtype)?;
            dk = (dk + dk_b.pad_with_zeros(2, 0, t - end)?)?;
            dv = (dv + dv_b.pad_with_zeros(2, 0, t - end)?)?;
        }
        let dq = Tensor::cat(&dq, 2)?.to_dtype(q.dtype())?;
        let dk = fold_heads(&dk, kv)?.to_dtype(k.dtype())?;
        let dv = fold_heads(&dv, kv)?.to_dtype(v.dtype())?;
        Ok((dq, dk, dv))
    }
}

impl CustomOp3 for TiledAttention {
    fn name(&self) -> &'static str {
        "tiled-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        match &self.out {
            Some(out) => out.hand_back(self.name()),
            None => candle_core::bail!("tiled attention: no forward computed"),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(lse) = &self.lse else {
            candle_core::bail!("tiled attention: no forward computed")
        };
        let (dq, dk, dv) = self
            .backward(
                &q.detach(),
                &k.detach(),
                &v.detach(),
                &o.detach(),
                &d_o.detach(),
                lse,
            )
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::{causal_mask, softmax_last};
    use crate::test_util::max_diff;
    use candle_core::{DType, Device, Var};

    /// Plain attention through autograd: the whole score matrix, GQA by repeating heads.
    fn plain(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Tensor {
        let heads = q.dim(1).unwrap();
        let (k, v) = (
            expand_heads(k, heads).unwrap(),
            expand_heads(v, heads).unwrap(),
        );
        let s = (q.matmul(&k.t().unwrap()).unwrap() * scale)
            .unwrap()
            .broadcast_add(mask)
            .unwrap();
        softmax_last(&s).unwrap().matmul(&v).unwrap()
    }

    /// Output and gradients of `q`, `k`, `v` (against a fixed random upstream gradient).
    fn run(
        tiled: Option<usize>,
        q: &Var,
        k: &Var,
        v: &Var,
        up: &Tensor,
    ) -> (Tensor, Tensor, Tensor, Tensor) {
        let t = q.dim(2).unwrap();
        let mask = causal_mask(t, q.dtype(), &Device::Cpu).unwrap();
        let scale = 0.37;
        let out = match tiled {
            Some(block) => attention(
                q.as_tensor(),
                k.as_tensor(),
                v.as_tensor(),
                &mask,
                scale,
                block,
            )
            .unwrap(),
            None => plain(q.as_tensor(), k.as_tensor(), v.as_tensor(), &mask, scale),
        };
        let g = (&out * up).unwrap().sum_all().unwrap().backward().unwrap();
        let grad = |x: &Var| g.get(x.as_tensor()).unwrap().clone();
        (out, grad(q), grad(k), grad(v))
    }

    /// Odd lengths cut by odd blocks (last block short, one row per block, one block for all),
    /// and grouped heads: every output and gradient equals plain attention's within rounding.
    #[test]
    fn equals_plain_attention_and_its_gradients() {
        let dev = Device::Cpu;
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
            for (heads, kv) in [(4, 2), (3, 3), (4, 1)] {
                for t in [1, 7, 13] {
                    let var = |n: usize| {
                        Var::from_tensor(
                            &Tensor::randn(0f64, 1.0, (2, n, t, 8), &dev)
                                .unwrap()
                                .to_dtype(dtype)
                                .unwrap(),
                        )
                        .unwrap()
                    };
                    let (q, k, v) = (var(heads), var(kv), var(kv));
                    let up = Tensor::randn(0f64, 1.0, (2, heads, t, 8), &dev)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap();
                    let want = run(None, &q, &k, &v, &up);
                    for block in [1, 3, 4, t, 64] {
                        let got = run(Some(block), &q, &k, &v, &up);
                        let case = format!("{dtype:?} heads {heads}/{kv} t {t} block {block}");
                        for (name, a, b) in [
                            ("out", &got.0, &want.0),
                            ("dq", &got.1, &want.1),
                            ("dk", &got.2, &want.2),
                            ("dv", &got.3, &want.3),
                        ] {
                            assert_eq!(a.dims(), b.dims(), "{case} {name}");
                            let d = max_diff(a, b);
                            assert!(d < tol, "{case}: {name} off by {d}");
                        }
                    }
                }
            }
        }
    }

    /// Forward and backward together never hold a score matrix of the whole sequence.
    #[test]
    fn no_whole_score_matrix_is_held() {
        let dev = Device::Cpu;
        let (b, heads, t, hd, block) = (1, 4, 1024, 16, 16);
        let var = || {
            Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, heads, t, hd), &dev).unwrap()).unwrap()
        };
        let (q, k, v) = (var(), var(), var());
        let up = Tensor::randn(0f32, 1.0, (b, heads, t, hd), &dev).unwrap();
        let mask = causal_mask(t, DType::F32, &dev).unwrap();
        let (grads, peak) = crate::alloc_count::peak_during(|| {
            let out = attention(
                q.as_tensor(),
                k.as_tensor(),
                v.as_tensor(),
                &mask,
                0.25,
                block,
            )
            .unwrap();
            (&out * &up).unwrap().sum_all().unwrap().backward().unwrap()
        });
        assert!(grads.get(k.as_tensor()).is_some());
        let scores = b * heads * t * t * 4;
        assert!(
            peak < scores,
            "{peak} bytes held at once: a whole score matrix is {scores}"
        );
    }
}
