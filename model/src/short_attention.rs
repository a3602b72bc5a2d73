//! Causal grouped-query attention of a sequence no longer than one attention tile, from the
//! three projections to the output's rows, as one node of the gradient graph (CPU, f32 or f64).
//!
//! Composed, the heads' reshapes and transposes, the rotations, the two products and the softmax
//! are about fifteen nodes, and candle's backward gives each node's input a zero-filled gradient
//! buffer and an addition. Here the forward runs on detached tensors and keeps the rotated
//! queries and keys, the values and the probabilities; the backward forms the same products
//! candle's would, so values and gradients are the composed version's bit for bit.

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use crate::error::Result;
use crate::fused::{self, RopeTables};
use crate::product::constant_product;
#[cfg(test)]
use crate::product::matmul;

/// Heads and widths of one attention.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Attention of `q: [b, t, heads · head_dim]` over `k, v: [b, t, kv_heads · head_dim]` (the
/// projections, before RoPE), rotated from position 0, scores scaled by `scale`; returns
/// `[b, t, heads · head_dim]`. Differentiable in `q`, `k` and `v`.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    shape: Heads,
    tables: &RopeTables,
    scale: f64,
) -> Result<Tensor> {
    let saved = forward(&q.detach(), &k.detach(), &v.detach(), shape, tables, scale)?;
    let op = ShortAttention {
        shape,
        tables: tables.clone(),
        scale,
        out: fused::Precomputed::new(saved.out),
        saved: saved.kept,
    };
    Ok(q.apply_op3(k, v, op)?)
}

/// What the backward reads, all contiguous: queries `[b, kv, rep · t, hd]` (each key/value
/// head's query heads stacked as rows) and keys `[b, kv, t, hd]` after RoPE, values
/// `[b, kv, t, hd]`, probabilities `[b, kv, rep · t, t]`.
struct Kept {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    p: Tensor,
}

struct Forward {
    out: Tensor,
    kept: Kept,
}

/// `y: [b, t, n · hd]` as `[b, n, t, hd]` (a strided view).
fn split_heads(y: &Tensor, n: usize, hd: usize) -> Result<Tensor> {
    let (b, t, _) = y.dims3()?;
    Ok(y.reshape((b, t, n, hd))?.transpose(1, 2)?)
}

/// `y: [b, n, t, hd]` as `[b, t, n · hd]`.
fn merge_heads(y: &Tensor) -> Result<Tensor> {
    let (b, n, t, hd) = y.dims4()?;
    Ok(y.transpose(1, 2)?.reshape((b, t, n * hd))?)
}

fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: Heads,
    tables: &RopeTables,
    scale: f64,
) -> Result<Forward> {
    let (b, t, _) = q.dims3()?;
    let (h, kv, hd) = (s.heads, s.kv_heads, s.head_dim);
    // The h/kv query heads that share a key/value head are adjacent: they stack into the rows of
    // one product per key/value head, with no copies of k and v.
    let rep = h / kv;
    let q = fused::rope(&split_heads(q, h, hd)?, tables)?.reshape((b, kv, rep * t, hd))?;
    let k = fused::rope(&split_heads(k, kv, hd)?, tables)?;
    let v = split_heads(v, kv, hd)?.contiguous()?;
    let scores = constant_product(&q, &k.t()?)?.reshape((b, h, t, t))?;
    let p = fused::causal_softmax(&scores, scale)?.reshape((b, kv, rep * t, t))?;
    let out = merge_heads(&constant_product(&p, &v)?.reshape((b, h, t, hd))?)?;
    Ok(Forward {
        out,
        kept: Kept { q, k, v, p },
    })
}

struct ShortAttention {
    shape: Heads,
    tables: RopeTables,
    scale: f64,
    /// The output, computed before the op is applied and handed over by its forward.
    out: fused::Precomputed,
    saved: Kept,
}

impl ShortAttention {
    /// Gradients of the three projections given the output's.
    fn backward(&self, d_out: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let Kept { q, k, v, p } = &self.saved;
        let (b, kv, rows, t) = p.dims4()?;
        let (h, hd) = (self.shape.heads, self.shape.head_dim);
        let d_o = split_heads(d_out, h, hd)?
            .contiguous()?
            .reshape((b, kv, rows, hd))?;
        // The products of candle's matmul backward: for C = A B, dA = dC B^T and dB = A^T dC.
        // The keys' gradient stays the transposed view of q^T dS: OpenBLAS's dS^T q differs in
        // the last bit.
        let dv = constant_product(&p.t()?, &d_o)?;
        let dp = constant_product(&d_o, &v.t()?)?;
        let ds = fused::causal_softmax_bwd(
            &p.reshape((b, h, t, t))?,
            &dp.reshape((b, h, t, t))?,
            self.scale,
        )?
        .reshape((b, kv, rows, t))?;
        let dq = constant_product(&ds, k)?.reshape((b, h, t, hd))?;
        let dk = constant_product(&q.t()?, &ds)?.t()?;
        Ok((
            merge_heads(&fused::rope_bwd(&dq, &self.tables)?)?,
            merge_heads(&fused::rope_bwd(&dk, &self.tables)?)?,
            merge_heads(&dv)?,
        ))
    }
}

impl CustomOp3 for ShortAttention {
    fn name(&self) -> &'static str {
        "short-attention"
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
        self.out.hand_back(self.name())
    }

    fn bwd(
        &self,
        _q: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _out: &Tensor,
        d_out: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv) = self
            .backward(&d_out.detach())
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_var;
    use candle_core::{DType, Var};

    fn tables(t: usize, half: usize) -> RopeTables {
        let angle = |p: usize, i: usize| p as f64 / 10_000f64.powf(i as f64 / half as f64);
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in 0..t {
            for i in 0..half {
                cos.push(angle(p, i).cos());
                sin.push(angle(p, i).sin());
            }
        }
        RopeTables {
            cos: std::sync::Arc::new(cos),
            sin: std::sync::Arc::new(sin),
            half,
        }
    }

    /// The same attention through candle's autograd, node by node (the fused kernels, which
    /// have their own tests against plain candle ops).
    fn composed(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        s: Heads,
        r: &RopeTables,
        scale: f64,
    ) -> Tensor {
        let (b, t, _) = q.dims3().expect("dims");
        let rep = s.heads / s.kv_heads;
        let heads = |y: &Tensor, n| split_heads(y, n, s.head_dim).expect("heads");
        let q = fused::rope(&heads(q, s.heads), r).expect("rope");
        let k = fused::rope(&heads(k, s.kv_heads), r).expect("rope");
        let v = heads(v, s.kv_heads).contiguous().expect("v");
        let q = q
            .contiguous()
            .and_then(|q| q.reshape((b, s.kv_heads, rep * t, s.head_dim)));
        let scores = q
            .and_then(|q| matmul(&q, &k.t()?))
            .and_then(|x| x.reshape((b, s.heads, t, t)))
            .expect("scores");
        let p = fused::causal_softmax(&scores, scale)
            .and_then(|p| p.reshape((b, s.kv_heads, rep * t, t)))
            .expect("probs");
        matmul(&p, &v)
            .and_then(|o| o.reshape((b, s.heads, t, s.head_dim)))
            .map_err(Into::into)
            .and_then(|o| merge_heads(&o))
            .expect("out")
    }

    /// Values and the three gradients equal the composed graph's bit for bit, with and without
    /// grouped keys, in f32 and f64, at odd lengths.
    #[test]
    fn equals_the_composed_graph_bit_for_bit() {
        for dtype in [DType::F32, DType::F64] {
            for (heads, kv_heads, t) in [(4, 2, 7), (2, 2, 5), (6, 1, 16)] {
                let s = Heads {
                    heads,
                    kv_heads,
                    head_dim: 8,
                };
                let r = tables(t, 4);
                let q = random_var(&[2, t, heads * 8], dtype, 1);
                let k = random_var(&[2, t, kv_heads * 8], dtype, 2);
                let v = random_var(&[2, t, kv_heads * 8], dtype, 3);
                let up = random_var(&[2, t, heads * 8], dtype, 4);
                let run = |f: &dyn Fn() -> Tensor| {
                    let y = f();
                    let grads = (&y * up.as_tensor())
                        .and_then(|p| p.sum_all())
                        .and_then(|l| l.backward())
                        .expect("backward");
                    let g = |x: &Var| grads.get(x.as_tensor()).expect("grad").clone();
                    [y, g(&q), g(&k), g(&v)]
                };
                let ours = run(&|| {
                    attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), s, &r, 0.3)
                        .expect("attention")
                });
                let theirs =
                    run(&|| composed(q.as_tensor(), k.as_tensor(), v.as_tensor(), s, &r, 0.3));
                for (a, b) in ours.iter().zip(&theirs) {
                    assert_eq!(a.dims(), b.dims());
                    let diff = crate::test_util::max_diff(a, b);
                    assert_eq!(diff, 0.0, "{dtype:?} {heads}/{kv_heads} heads, t {t}");
                }
            }
        }
    }
}
