//! The gradients of one backward on the CPU. candle gives every gradient it returns a
//! zero-filled buffer and an addition; the linear layers (`crate::linear`) hand their weights'
//! gradients over here instead ([`Gradients`], [`hand_over`]), as tensors or, for runs side by
//! side, as their products' operands, which [`sum_parts`] later sums into one buffer.

use std::cell::RefCell;

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, Tensor, TensorId, bail};

use crate::product::{Bands, constant_product, product, product_shape, product_storage};

thread_local! {
    /// Where the linear layers on this thread hand their weights' gradients during
    /// [`Gradients::of`], in the order the backward forms them, and whether they hand over the
    /// products' operands instead of the products ([`Gradients::deferring`]).
    static WEIGHT_GRADS: RefCell<Option<HandOver>> = const { RefCell::new(None) };
}

/// The weight gradients handed over so far, and whether as their products' operands.
struct HandOver {
    weights: Vec<(TensorId, Part)>,
    defer: bool,
}

/// One term of a parameter's gradient from a backward.
#[derive(Clone)]
pub(crate) enum Part {
    Tensor(Tensor),
    /// A linear layer's weight gradient `dy^T x` for `dy: [rows, out]` and `x: [rows, in]`,
    /// not formed yet: [`sum_parts`] forms it in the buffer of the sum it goes into.
    Product {
        dy: Tensor,
        x: Tensor,
    },
}

impl Part {
    /// The term as a tensor of its own.
    pub(crate) fn into_tensor(self) -> candle_core::Result<Tensor> {
        match self {
            Part::Tensor(t) => Ok(t.detach()),
            Part::Product { dy, x } => constant_product(&dy.t()?, &x),
        }
    }
}

/// The sum of `parts` in order (`None` for none), with the bits of adding the terms as tensors
/// one by one. Where the sum is a CPU matrix, each weight product after the first term is added
/// by gemm into the sum's buffer: no buffer of its own, and no pass to add it (the same bits
/// while each product sums at most 512 rows, gemm's one block; more rows are summed block by
/// block into the sum, the same bits on any number of threads).
pub(crate) fn sum_parts(parts: Vec<Part>) -> candle_core::Result<Option<Tensor>> {
    let mut sum: Option<Sum> = None;
    for part in parts {
        sum = Some(match (sum, part) {
            (None, Part::Product { dy, x }) if Bands::apply(&dy, &x) => {
                Sum::Owned(Owned::product(&dy, &x)?)
            }
            (None, part) => Sum::Tensor(part.into_tensor()?),
            (Some(Sum::Owned(mut owned)), Part::Product { dy, x }) => {
                owned.add_product(&dy, &x)?;
                Sum::Owned(owned)
            }
            (Some(Sum::Tensor(a)), Part::Product { dy, x })
                if Bands::apply(&a, &x) && Bands::apply(&dy, &x) =>
            {
                let mut owned = Owned::copy_of(&a)?;
                owned.add_product(&dy, &x)?;
                Sum::Owned(owned)
            }
            (Some(sum), part) => Sum::Tensor((sum.tensor()? + part.into_tensor()?)?),
        });
    }
    sum.map(Sum::tensor).transpose()
}

/// A running sum of gradient terms.
enum Sum {
    Tensor(Tensor),
    Owned(Owned),
}

impl Sum {
    fn tensor(self) -> candle_core::Result<Tensor> {
        match self {
            Sum::Tensor(t) => Ok(t),
            Sum::Owned(o) => Ok(Tensor::from_storage(
                candle_core::Storage::Cpu(o.values),
                o.dims,
                candle_core::op::BackpropOp::none(),
                false,
            )),
        }
    }
}

/// A CPU matrix this sum owns, which products are added into in place.
struct Owned {
    values: CpuStorage,
    dims: (usize, usize),
}

impl Owned {
    /// A copy of the 2-d CPU tensor `t` (f32 or f64).
    fn copy_of(t: &Tensor) -> candle_core::Result<Self> {
        let dims = t.dims2()?;
        let t = t.contiguous()?;
        let (s, l) = t.storage_and_layout();
        let candle_core::Storage::Cpu(c) = &*s else {
            bail!("sum: a CPU tensor only")
        };
        let range = l.start_offset()..l.start_offset() + dims.0 * dims.1;
        let values = match c {
            CpuStorage::F32(v) => CpuStorage::F32(v[range].to_vec()),
            CpuStorage::F64(v) => CpuStorage::F64(v[range].to_vec()),
            _ => bail!("sum: f32 or f64 only"),
        };
        Ok(Self { values, dims })
    }

    /// `dy^T x` (CPU, f32 or f64) in a buffer of its own.
    fn product(dy: &Tensor, x: &Tensor) -> candle_core::Result<Self> {
        let (dyt, x) = (dy.detach().t()?, x.detach());
        let (sa, la) = dyt.storage_and_layout();
        let (sb, lb) = x.storage_and_layout();
        let (candle_core::Storage::Cpu(ca), candle_core::Storage::Cpu(cb)) = (&*sa, &*sb) else {
            bail!("sum: CPU tensors only")
        };
        let values = product_storage(ca, la, cb, lb)?;
        let dims = (la.dims()[0], lb.dims()[1]);
        Ok(Self { values, dims })
    }

    /// Adds `dy^T x` in place.
    fn add_product(&mut self, dy: &Tensor, x: &Tensor) -> candle_core::Result<()> {
        let dyt = dy.detach().t()?;
        let x = x.detach();
        let (sa, la) = dyt.storage_and_layout();
        let (sb, lb) = x.storage_and_layout();
        let (candle_core::Storage::Cpu(ca), candle_core::Storage::Cpu(cb)) = (&*sa, &*sb) else {
            bail!("sum: CPU tensors only")
        };
        let shape = product_shape(la, lb)?;
        if (shape.m, shape.n) != self.dims {
            bail!(
                "sum: a {}x{} product added to {:?}",
                shape.m,
                shape.n,
                self.dims
            )
        }
        match (ca, cb, &mut self.values) {
            (CpuStorage::F32(a), CpuStorage::F32(b), CpuStorage::F32(d)) => shape.add_to(a, b, d),
            (CpuStorage::F64(a), CpuStorage::F64(b), CpuStorage::F64(d)) => shape.add_to(a, b, d),
            _ => bail!("sum: the terms in one dtype, f32 or f64"),
        }
    }
}

/// The gradients of one backward. candle gives every gradient it returns a zero-filled buffer and
/// an addition, a weight-sized pass each for the linear layers' weights; those layers hand their
/// weights' gradients over here instead, the same bits with neither pass.
pub(crate) struct Gradients {
    store: GradStore,
    weights: Vec<(TensorId, Part)>,
}

/// Puts back the hand-over that was in place before a [`Gradients::of`] began, also when it
/// fails or panics (an inner backward can run on this thread while an outer one waits for a
/// product).
struct Restore(Option<HandOver>);

impl Drop for Restore {
    fn drop(&mut self) {
        let outer = self.0.take();
        WEIGHT_GRADS.with(|c| c.replace(outer));
    }
}

impl Gradients {
    /// The backward of `root`.
    pub(crate) fn of(root: &Tensor) -> candle_core::Result<Self> {
        Self::backward(root, false)
    }

    /// [`Gradients::of`] where the linear layers' weight gradients are left as the operands of
    /// their products ([`Part::Product`]), for runs side by side: each weight's products are then
    /// summed into one buffer after the runs ([`sum_parts`]). The operands stay alive until then.
    pub(crate) fn deferring(root: &Tensor) -> candle_core::Result<Self> {
        Self::backward(root, true)
    }

    fn backward(root: &Tensor, defer: bool) -> candle_core::Result<Self> {
        let fresh = HandOver {
            weights: Vec::new(),
            defer,
        };
        let _restore = Restore(WEIGHT_GRADS.with(|c| c.replace(Some(fresh))));
        let store = root.backward()?;
        let weights = WEIGHT_GRADS
            .with(|c| c.replace(None))
            .map(|h| h.weights)
            .unwrap_or_default();
        Ok(Self { store, weights })
    }

    /// The gradient of a tensor that is not a linear layer's weight (an input, for example).
    pub(crate) fn get(&self, t: &Tensor) -> Option<&Tensor> {
        self.store.get(t)
    }

    /// The terms of variable `v`'s gradient: candle's, then any the linear layers handed over,
    /// in the order the backward formed them (candle's own order).
    pub(crate) fn parts_of_var(&self, v: &Tensor) -> Vec<Part> {
        let id = v.id();
        let store = self.store.get(v).map(|g| Part::Tensor(g.detach()));
        let handed = self
            .weights
            .iter()
            .filter(|(w, _)| *w == id)
            .map(|(_, g)| g.clone());
        store.into_iter().chain(handed).collect()
    }

    /// The gradient of variable `v`, detached: its terms added in order.
    #[cfg(test)]
    pub(crate) fn of_var(&self, v: &Tensor) -> candle_core::Result<Option<Tensor>> {
        sum_parts(self.parts_of_var(v))
    }
}

/// The gradient `dy^T x` of weight `w` (`dy: [rows, out]`, `x: [rows, in]`) from a backward:
/// handed over to the [`Gradients::of`] running on this thread if `w` is a variable and one is
/// (as the product's operands where it defers them), else returned for candle's store.
pub(crate) fn hand_over(w: &Tensor, dy: Tensor, x: Tensor) -> candle_core::Result<Option<Tensor>> {
    let defer = WEIGHT_GRADS.with(|c| c.borrow().as_ref().map(|h| h.defer));
    let part = match defer {
        Some(true) if w.is_variable() => Part::Product { dy, x },
        _ => Part::Tensor(product(&dy.t()?, &x)?),
    };
    if !w.is_variable() {
        return part.into_tensor().map(Some);
    }
    WEIGHT_GRADS.with(|c| match c.borrow_mut().as_mut() {
        Some(h) => {
            h.weights.push((w.id(), part));
            Ok(None)
        }
        None => part.into_tensor().map(Some),
    })
}
