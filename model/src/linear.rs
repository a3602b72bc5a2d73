//! A linear layer and SwiGLU's gate and up projections, each one node of the gradient graph on
//! the CPU (f32 or f64) with a hand-written backward that forms candle's products and hands the
//! weights' gradients over (`crate::gradients`).

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, bail};

use crate::gradients::hand_over;
use crate::product::{product, product_storage};

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
        linear_storage(xs, xl, ws, wl)
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
        let gx = product(&grad, &w.detach())?.reshape(x.shape())?;
        Ok((Some(gx), hand_over(w, grad, x2)?))
    }
}

/// `x @ w^T` on storages for `x: [..., in]` (contiguous) and `w: [out, in]`, with its shape.
fn linear_storage(
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
    let y = product_storage(xs, &x2, ws, &wt)?;
    Ok((y, Shape::from(dims)))
}

/// SwiGLU's gate and up projections and their product, `silu(x @ wg^T) * (x @ wu^T)` for
/// `x: [..., in]` and `wg, wu: [hidden, in]`, as one node of the gradient graph (CPU, f32 or
/// f64, callers check). As three nodes, candle's backward gives the two projections' outputs and
/// the input a zero-filled gradient buffer and an addition each; here the backward takes both
/// activation gradients in one pass. The values and gradients of the three nodes, bit for bit.
pub(crate) fn gate_up(x: &Tensor, w_gate: &Tensor, w_up: &Tensor) -> candle_core::Result<Tensor> {
    if w_gate.dims() != w_up.dims() {
        bail!("gate-up: gate {:?} and up {:?}", w_gate.dims(), w_up.dims())
    }
    x.contiguous()?.apply_op3(
        &w_gate.contiguous()?,
        &w_up.contiguous()?,
        GateUp {
            projections: std::sync::OnceLock::new(),
        },
    )
}

struct GateUp {
    /// The gate's and up projections' outputs, `[rows, hidden]`, which the backward reads.
    projections: std::sync::OnceLock<(Tensor, Tensor)>,
}

impl candle_core::CustomOp3 for GateUp {
    fn name(&self) -> &'static str {
        "gate-up"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        if gl.dims() != ul.dims() {
            bail!("gate-up: gate {:?} and up {:?}", gl.dims(), ul.dims())
        }
        let (rows, _, hidden) = linear_dims(xl.dims(), gl.dims())?;
        let (g, shape) = linear_storage(xs, xl, gs, gl)?;
        let (u, _) = linear_storage(xs, xl, us, ul)?;
        let flat = Layout::contiguous((rows, hidden));
        let h = crate::fused::silu_mul_storage(&g, &flat, &u, &flat)?;
        let tensor = |s: CpuStorage| {
            Tensor::from_storage(
                candle_core::Storage::Cpu(s),
                (rows, hidden),
                candle_core::op::BackpropOp::none(),
                false,
            )
        };
        if self.projections.set((tensor(g), tensor(u))).is_err() {
            bail!("gate-up: applied twice")
        }
        Ok((h, shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w_gate: &Tensor,
        w_up: &Tensor,
        _h: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some((g, u)) = self.projections.get() else {
            bail!("gate-up: backward before forward")
        };
        let (rows, inp, _) = linear_dims(x.dims(), w_gate.dims())?;
        let x2 = x.detach().reshape((rows, inp))?;
        let (dg, du) = crate::fused::silu_mul_grads(g, u, &grad.reshape(g.shape())?)?;
        // The input's gradient is the two projections' sum, as candle's store would add them.
        let gx = (product(&dg, &w_gate.detach())? + product(&du, &w_up.detach())?)?
            .reshape(x.shape())?;
        Ok((
            Some(gx),
            hand_over(w_gate, dg, x2.clone())?,
            hand_over(w_up, du, x2)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradients::{Gradients, Part, sum_parts};
    use crate::product::{constant_product, matmul};
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

    /// A weight's gradient handed over by the layer is candle's bit for bit, as is the input's,
    /// a weight used twice gets both gradients added, and a plain backward afterwards finds the
    /// weight's gradient in candle's store again.
    #[test]
    fn handed_over_weight_gradients_are_candles() {
        let x = random_var(&[2, 9, 16], DType::F32, 1);
        let w = random_var(&[24, 16], DType::F32, 2);
        let w2 = random_var(&[16, 24], DType::F32, 3);
        let loss = || {
            let h = linear(x.as_tensor(), w.as_tensor()).expect("linear");
            let y = linear(&h, w2.as_tensor()).expect("linear");
            let again = linear(&y.sin().expect("sin"), w.as_tensor()).expect("linear");
            again.sqr().and_then(|s| s.sum_all()).expect("loss")
        };
        let store = loss().backward().expect("backward");
        let handed = Gradients::of(&loss()).expect("backward");
        for v in [&w, &w2] {
            let a = handed.of_var(v.as_tensor()).expect("sum").expect("grad");
            let b = store.get(v.as_tensor()).expect("grad");
            assert_eq!(crate::test_util::max_diff(&a, b), 0.0);
        }
        let gx = handed.get(x.as_tensor()).expect("input grad");
        let gx0 = store.get(x.as_tensor()).expect("input grad");
        assert_eq!(crate::test_util::max_diff(gx, gx0), 0.0);
        let after = loss().backward().expect("backward");
        assert!(after.get(w.as_tensor()).is_some(), "hand-over ended");
    }

    #[test]
    fn mismatched_widths_are_refused() {
        let x = random_var(&[2, 8], DType::F32, 1);
        let w = random_var(&[4, 6], DType::F32, 2);
        let err = linear(x.as_tensor(), w.as_tensor()).expect_err("widths differ");
        assert!(err.to_string().contains("input width 8"), "{err}");
    }

    /// SwiGLU's gate and up projections as one node against three: the same values, and the
    /// same gradients for the input and both weights, through the hand-over and through a plain
    /// backward.
    #[test]
    fn gate_and_up_as_one_node_are_three_nodes_bit_for_bit() {
        let x = random_var(&[2, 40, 48], DType::F32, 5);
        let wg = random_var(&[72, 48], DType::F32, 6);
        let wu = random_var(&[72, 48], DType::F32, 7);
        let wd = random_var(&[48, 72], DType::F32, 8);
        let (x, wg, wu, wd) = (
            x.as_tensor(),
            wg.as_tensor(),
            wu.as_tensor(),
            wd.as_tensor(),
        );
        let three = || -> candle_core::Result<Tensor> {
            let h = crate::fused::silu_mul(&linear(x, wg)?, &linear(x, wu)?)?;
            linear(&h, wd)?.sqr()?.sum_all()
        };
        let one = || -> candle_core::Result<Tensor> {
            linear(&gate_up(x, wg, wu)?, wd)?.sqr()?.sum_all()
        };
        let (a, b) = (three().expect("three"), one().expect("one"));
        assert_eq!(crate::test_util::bits(&a), crate::test_util::bits(&b));
        let (ga, gb) = (
            Gradients::of(&a).expect("grads"),
            Gradients::of(&b).expect("grads"),
        );
        for t in [x, wg, wu, wd] {
            let want = ga.of_var(t).expect("of_var").expect("a gradient");
            let got = gb.of_var(t).expect("of_var").expect("a gradient");
            assert_eq!(crate::test_util::bits(&want), crate::test_util::bits(&got));
        }
        let plain = one().and_then(|l| l.backward()).expect("backward");
        for t in [wg, wu] {
            let want = ga.of_var(t).expect("of_var").expect("a gradient");
            assert_eq!(
                crate::test_util::bits(&want),
                crate::test_util::bits(plain.get(t).expect("in candle's store"))
            );
        }
        let err = gate_up(x, wg, wd).expect_err("gate and up differ");
        assert!(err.to_string().contains("gate-up"), "{err}");
    }

    /// Weight gradients left as their products' operands and summed into one buffer are the
    /// products added one by one, bit for bit: on gemm's general and small-size paths, for a
    /// gradient read through a strided view, after a tensor term, and through a backward that
    /// defers them against one that does not.
    #[test]
    fn deferred_products_add_up_to_the_same_bits() {
        for dtype in [DType::F32, DType::F64] {
            for (rows, out, inp) in [(256, 72, 48), (5, 3, 4), (512, 20, 30)] {
                let both = random_var(&[rows, 2 * out], dtype, 21);
                let dys = [
                    random_var(&[rows, out], dtype, 22).as_tensor().clone(),
                    both.as_tensor().narrow(1, out, out).expect("half"),
                ];
                let xs = [
                    random_var(&[rows, inp], dtype, 23),
                    random_var(&[rows, inp], dtype, 24),
                ];
                let first = random_var(&[out, inp], dtype, 25).as_tensor().clone();
                let products: Vec<Tensor> = dys
                    .iter()
                    .zip(&xs)
                    .map(|(dy, x)| constant_product(&dy.t()?, x.as_tensor()))
                    .collect::<candle_core::Result<_>>()
                    .expect("products");
                let deferred = |with_first: bool| {
                    let mut parts: Vec<Part> = with_first
                        .then(|| Part::Tensor(first.clone()))
                        .into_iter()
                        .collect();
                    parts.extend(dys.iter().zip(&xs).map(|(dy, x)| Part::Product {
                        dy: dy.clone(),
                        x: x.as_tensor().clone(),
                    }));
                    sum_parts(parts).expect("sum").expect("a sum")
                };
                let added = (&products[0] + &products[1]).expect("add");
                assert_eq!(
                    crate::test_util::bits(&deferred(false)),
                    crate::test_util::bits(&added),
                    "{dtype:?} {rows}"
                );
                let added = ((&first + &products[0]).and_then(|s| s + &products[1])).expect("add");
                assert_eq!(
                    crate::test_util::bits(&deferred(true)),
                    crate::test_util::bits(&added),
                    "{dtype:?} {rows}"
                );
            }
        }
        // A backward that defers against one that does not, through the linear layer and the
        // gate and up projections.
        let x = random_var(&[2, 40, 48], DType::F32, 26);
        let (wg, wu, wd) = (
            random_var(&[72, 48], DType::F32, 27),
            random_var(&[72, 48], DType::F32, 28),
            random_var(&[48, 72], DType::F32, 29),
        );
        let loss = || {
            linear(
                &gate_up(x.as_tensor(), wg.as_tensor(), wu.as_tensor()).expect("gate-up"),
                wd.as_tensor(),
            )
            .and_then(|y| y.sqr()?.sum_all())
            .expect("loss")
        };
        let now = Gradients::of(&loss()).expect("backward");
        let later = Gradients::deferring(&loss()).expect("backward");
        for w in [&wg, &wu, &wd] {
            let parts = later.parts_of_var(w.as_tensor());
            assert!(matches!(parts.as_slice(), [Part::Product { .. }]));
            let want = now.of_var(w.as_tensor()).expect("sum").expect("grad");
            let got = sum_parts(parts).expect("sum").expect("grad");
            assert_eq!(crate::test_util::bits(&got), crate::test_util::bits(&want));
        }
        let (a, b) = (now.get(x.as_tensor()), later.get(x.as_tensor()));
        assert_eq!(
            crate::test_util::bits(a.expect("dx")),
            crate::test_util::bits(b.expect("dx"))
        );
    }
}
