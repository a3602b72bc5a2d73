//! The matrix products every layer and the tiled attention use.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, bail};

/// `a @ b` for `a: [..., m, k]`, `b: [..., k, n]`: through OpenBLAS with the `openblas` feature
/// (f32 and f64 on the CPU), candle's matmul otherwise.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "openblas")]
    {
        crate::blas::matmul(a, b)
    }
    #[cfg(not(feature = "openblas"))]
    {
        a.matmul(b)
    }
}

/// `x @ w^T` for `x: [..., in]` and `w: [out, in]` as one node of the gradient graph, for CPU
/// tensors (f32 or f64, callers check). Written with reshapes, a transpose and a matmul it is
/// four nodes, and candle's backward gives each node's input a zero-filled gradient buffer and an
/// addition: the size of the activations twice and of the weight once more than needed.
/// Values and gradients are the composed version's, bit for bit.
pub(crate) fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, Linear)
}

struct Linear;

/// Rows, input and output widths of `x: [..., in]` against `w: [out, in]`.
fn linear_dims(x: &[usize], w: &[usize]) -> candle_core::Result<(usize, usize, usize)> {
    let (Some((&inp, lead)), [out, w_in]) = (x.split_last(), w) else {
        bail!("linear: {x:?} against a weight of {w:?}")
    };
    if inp != *w_in {
        bail!("linear: input width {inp} against a weight of {w:?}")
    }
    Ok((lead.iter().product(), inp, *out))
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, inp, out) = linear_dims(xl.dims(), wl.dims())?;
        if !xl.is_contiguous() {
            bail!("linear: input is not contiguous")
        }
        let x2 = Layout::contiguous_with_offset((rows, inp), xl.start_offset());
        let wt = wl.transpose(0, 1)?;
        let mut dims = xl.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out;
        }
        #[cfg(feature = "openblas")]
        if crate::blas::enabled() {
            let (y, _) = crate::blas::storage_matmul(xs, &x2, ws, &wt)?;
            return Ok((y, Shape::from(dims)));
        }
        let y = xs.matmul(ws, (1, rows, out, inp), &x2, &wt)?;
        Ok((y, Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (rows, inp, out) = linear_dims(x.dims(), w.dims())?;
        let x2 = x.detach().reshape((rows, inp))?;
        let grad = grad.reshape((rows, out))?;
        // dx = dy w and dw = dy^T x, contiguous. The composed version forms dw^T = x^T dy (the
        // same sums) and adds its transposed view with strides, a slow walk for a large weight.
        let gx = matmul(&grad, &w.detach())?.reshape(x.shape())?;
        let gw = matmul(&grad.t()?, &x2)?;
        Ok((Some(gx), Some(gw)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_var;
    use candle_core::DType;

    fn composed(x: &Tensor, w: &Tensor) -> Tensor {
        let (lead, inp) = x.dims().split_at(x.rank() - 1);
        let rows: usize = lead.iter().product();
        let mut shape = lead.to_vec();
        shape.push(w.dim(0).expect("out"));
        matmul(&x.reshape((rows, inp[0])).expect("2d"), &w.t().expect("t"))
            .and_then(|y| y.reshape(shape))
            .expect("product")
    }

    /// Values and both gradients equal the reshape/transpose/matmul graph bit for bit, in f32
    /// and f64, for a 3-d input and a weight read through a narrowed (offset) view, at a toy
    /// size and at `small`'s widest product (blocked along every dimension).
    #[test]
    fn equals_the_composed_product_bit_for_bit() {
        for dtype in [DType::F32, DType::F64] {
            for (b, t, inp, out) in [(3, 5, 16, 24), (4, 128, 384, 1024)] {
                let x = random_var(&[b, t, inp], dtype, 1);
                let big = random_var(&[out + 40, inp], dtype, 2);
                let w = big.narrow(0, 7, out).expect("narrow");
                let up = random_var(&[b, t, out], dtype, 3);
                let run = |f: &dyn Fn(&Tensor, &Tensor) -> Tensor| {
                    let y = f(x.as_tensor(), &w);
                    let grads = (&y * up.as_tensor())
                        .and_then(|p| p.sum_all())
                        .and_then(|l| l.backward())
                        .expect("backward");
                    let gx = grads.get(x.as_tensor()).expect("dx").clone();
                    let gw = grads.get(big.as_tensor()).expect("dw").clone();
                    (y, gx, gw)
                };
                let (y, gx, gw) = run(&|x, w| linear(x, w).expect("linear"));
                let (y0, gx0, gw0) = run(&composed);
                assert_eq!(y.dims(), [b, t, out]);
                for (a, b) in [(&y, &y0), (&gx, &gx0), (&gw, &gw0)] {
                    let diff = crate::test_util::max_diff(a, b);
                    assert_eq!(diff, 0.0, "{dtype:?} {inp}x{out}");
                }
            }
        }
    }

    #[test]
    fn mismatched_widths_are_refused() {
        let x = random_var(&[2, 8], DType::F32, 1);
        let w = random_var(&[4, 6], DType::F32, 2);
        let err = linear(x.as_tensor(), w.as_tensor()).expect_err("widths differ");
        assert!(err.to_string().contains("input width 8"), "{err}");
    }
}
