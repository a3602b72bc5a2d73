//! The matrix products every layer and the tiled attention use.

use std::cell::{Cell, RefCell};

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor, TensorId, bail};

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

/// `a @ b` of tensors taken as constants (no gradient graph), `a: [..., m, k]` and
/// `b: [..., k, n]` with the same leading dims, the same values as [`matmul`]: on the CPU in
/// f32 or f64 written into an output that is not zero-filled first (candle fills it, then
/// overwrites every value), each product on this thread's share of the product threads.
pub(crate) fn constant_product(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let (a, b) = (a.detach(), b.detach());
    let cpu_float = |t: &Tensor| {
        t.device().is_cpu() && t.rank() >= 2 && matches!(t.dtype(), DType::F32 | DType::F64)
    };
    let lead = |t: &Tensor| t.dims()[..t.rank().saturating_sub(2)].to_vec();
    if cpu_float(&a) && cpu_float(&b) && lead(&a) == lead(&b) {
        product(&a, &b)
    } else {
        matmul(&a, &b)
    }
}

/// [`constant_product`] of CPU tensors, f32 or f64, with the same leading dims.
fn product(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "openblas")]
    if crate::blas::enabled() {
        return matmul(a, b);
    }
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (candle_core::Storage::Cpu(ca), candle_core::Storage::Cpu(cb)) = (&*sa, &*sb) else {
        bail!("product: CPU tensors only")
    };
    let r = la.dims().len();
    let (m, n) = (la.dims()[r - 2], lb.dims()[r - 1]);
    let mut dims = la.dims()[..r - 2].to_vec();
    dims.extend([m, n]);
    let out = match (ca, cb) {
        (CpuStorage::F32(x), CpuStorage::F32(y)) => CpuStorage::F32(batched(x, la, y, lb)?),
        (CpuStorage::F64(x), CpuStorage::F64(y)) => CpuStorage::F64(batched(x, la, y, lb)?),
        _ => bail!("product: f32 or f64 of one type only"),
    };
    Ok(Tensor::from_storage(
        candle_core::Storage::Cpu(out),
        dims,
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// The products of the last two dims of `a` and `b` (laid out as `al` and `bl`, the same
/// leading dims), one after another in row-major order of the leading dims.
fn batched<T: candle_core::WithDType>(
    a: &[T],
    al: &Layout,
    b: &[T],
    bl: &Layout,
) -> candle_core::Result<Vec<T>> {
    let r = al.dims().len();
    if r < 2 || bl.dims().len() != r || al.dims()[..r - 2] != bl.dims()[..r - 2] {
        bail!("product: {:?} against {:?}", al.dims(), bl.dims())
    }
    let lead = &al.dims()[..r - 2];
    let (sa, sb) = (al.stride(), bl.stride());
    let matrix = |l: &Layout, offset: usize| {
        let (d, s) = (l.dims(), l.stride());
        Layout::new(
            Shape::from((d[r - 2], d[r - 1])),
            vec![s[r - 2], s[r - 1]],
            offset,
        )
    };
    let count: usize = lead.iter().product();
    let mut out = Vec::with_capacity(count * al.dims()[r - 2] * bl.dims()[r - 1]);
    for i in 0..count {
        // The leading index of product i, last dim fastest.
        let (mut rest, mut oa, mut ob) = (i, al.start_offset(), bl.start_offset());
        for dim in (0..r - 2).rev() {
            let at = rest % lead[dim];
            rest /= lead[dim];
            oa += at * sa[dim];
            ob += at * sb[dim];
        }
        product_shape(&matrix(al, oa), &matrix(bl, ob))?.append_to(a, b, &mut out)?;
    }
    Ok(out)
}

/// [`product`] on storages of 2-d operands.
fn product_storage(
    a: &CpuStorage,
    al: &Layout,
    b: &CpuStorage,
    bl: &Layout,
) -> candle_core::Result<CpuStorage> {
    let shape = product_shape(al, bl)?;
    Ok(match (a, b) {
        (CpuStorage::F32(a), CpuStorage::F32(b)) => CpuStorage::F32(shape.run(a, b)?),
        (CpuStorage::F64(a), CpuStorage::F64(b)) => CpuStorage::F64(shape.run(a, b)?),
        _ => bail!("product: f32 or f64 of one type only"),
    })
}

/// The product of 2-d operands laid out as `al` and `bl`.
fn product_shape(al: &Layout, bl: &Layout) -> candle_core::Result<Product> {
    let ([m, k], [k2, n]) = (al.dims(), bl.dims()) else {
        bail!("product: {:?} against {:?}", al.dims(), bl.dims())
    };
    if k != k2 {
        bail!("product: {:?} against {:?}", al.dims(), bl.dims())
    }
    Ok(Product {
        m: *m,
        n: *n,
        k: *k,
        a: (al.start_offset(), al.stride()[0], al.stride()[1]),
        b: (bl.start_offset(), bl.stride()[0], bl.stride()[1]),
    })
}

/// A product's sizes and its operands' offsets and row and column strides.
struct Product {
    m: usize,
    n: usize,
    k: usize,
    a: (usize, usize, usize),
    b: (usize, usize, usize),
}

impl Product {
    fn run<T: candle_core::WithDType>(&self, a: &[T], b: &[T]) -> candle_core::Result<Vec<T>> {
        let mut out = Vec::new();
        self.append_to(a, b, &mut out)?;
        Ok(out)
    }

    /// Whether the operands' strides stay inside `a` and `b`; an error where they do not.
    fn check<T>(&self, a: &[T], b: &[T]) -> candle_core::Result<()> {
        let Product {
            m,
            n,
            k,
            a: (ao, ars, acs),
            b: (bo, brs, bcs),
        } = *self;
        // The last element each operand's strides reach must lie inside its buffer.
        let reach = |o: usize, rs: usize, cs: usize, rows: usize, cols: usize| {
            o + rows.saturating_sub(1) * rs + cols.saturating_sub(1) * cs
        };
        if m * n * k > 0
            && (reach(ao, ars, acs, m, k) >= a.len() || reach(bo, brs, bcs, k, n) >= b.len())
        {
            bail!("product: operand strides reach past their buffers")
        }
        Ok(())
    }

    /// Appends the product's `m * n` values (row-major) to `out`.
    #[allow(unsafe_code)] // gemm's interface takes raw pointers
    fn append_to<T: candle_core::WithDType>(
        &self,
        a: &[T],
        b: &[T],
        out: &mut Vec<T>,
    ) -> candle_core::Result<()> {
        let Product { m, n, k, .. } = *self;
        self.check(a, b)?;
        if m * n == 0 || k == 0 {
            out.resize(out.len() + m * n, T::from_f64(0.0));
            return Ok(());
        }
        // gemm's general path writes every output value before it reads any when it does not
        // accumulate; its small-size and vector paths are left a zero-filled output.
        let general = m > 16 && n > 16 && k > 2;
        let at = out.len();
        if general {
            out.reserve(m * n);
        } else {
            out.resize(at + m * n, T::from_f64(0.0));
        }
        // SAFETY: the operands' strides stay inside their slices (checked above); `out` has room
        // for m * n values after `at`, written with row stride n; with `read_dst` false gemm
        // writes each output value once before any read, so on the general path the values are
        // whole when the length is set.
        unsafe {
            self.gemm(a, b, out.as_mut_ptr().add(at), false);
            if general {
                out.set_len(at + m * n);
            }
        }
        Ok(())
    }

    /// Adds the product to `dst` (`m * n` values, row-major) in gemm's own pass: each value
    /// becomes `dst + product`, rounded once, the bits of forming the product and adding it
    /// when `k` is at most 512 (gemm then sums each value's products in one block).
    #[allow(unsafe_code)] // gemm's interface takes raw pointers
    fn add_to<T: candle_core::WithDType>(
        &self,
        a: &[T],
        b: &[T],
        dst: &mut [T],
    ) -> candle_core::Result<()> {
        let Product { m, n, k, .. } = *self;
        self.check(a, b)?;
        if dst.len() != m * n {
            bail!("product: {m}x{n} added to {} values", dst.len())
        }
        if m * n == 0 || k == 0 {
            return Ok(());
        }
        // SAFETY: the operands' strides stay inside their slices (checked above); `dst` holds
        // m * n initialised values, read and written with row stride n.
        unsafe { self.gemm(a, b, dst.as_mut_ptr(), true) };
        Ok(())
    }

    /// `dst = (read_dst ? dst : 0) + a b` through gemm, on this thread's product threads.
    ///
    /// # Safety
    /// The operands' strides stay inside `a` and `b` ([`Product::check`]), `dst` has room for
    /// `m * n` values with row stride `n`, initialised where `read_dst` is set.
    #[allow(unsafe_code)]
    unsafe fn gemm<T: candle_core::WithDType>(
        &self,
        a: &[T],
        b: &[T],
        dst: *mut T,
        read_dst: bool,
    ) {
        let Product {
            m,
            n,
            k,
            a: (ao, ars, acs),
            b: (bo, brs, bcs),
        } = *self;
        let threads = PRODUCT_THREADS
            .with(Cell::get)
            .unwrap_or_else(candle_core::utils::get_num_threads);
        let parallelism = if threads > 1 {
            gemm::Parallelism::Rayon(threads)
        } else {
            gemm::Parallelism::None
        };
        let alpha = if read_dst { 1.0 } else { 0.0 };
        // SAFETY: the caller's contract.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst,
                1,
                n as isize,
                read_dst,
                a.as_ptr().add(ao),
                acs as isize,
                ars as isize,
                b.as_ptr().add(bo),
                bcs as isize,
                brs as isize,
                T::from_f64(alpha),
                T::from_f64(1.0),
                false,
                false,
                false,
                parallelism,
            );
        }
    }
}

/// A `[rows, width]` CPU matrix of f32 or f64 whose rows are products, band after band, each
/// written in place: no zero-filled matrix for the bands to be copied into.
pub(crate) struct Bands {
    rows: usize,
    width: usize,
    values: CpuStorage,
}

impl Bands {
    /// An empty matrix of `rows x width` values of `dtype` (f32 or f64).
    pub(crate) fn new(rows: usize, width: usize, dtype: DType) -> candle_core::Result<Self> {
        let values = match dtype {
            DType::F32 => CpuStorage::F32(Vec::with_capacity(rows * width)),
            DType::F64 => CpuStorage::F64(Vec::with_capacity(rows * width)),
            other => bail!("bands: f32 or f64, not {other:?}"),
        };
        Ok(Self {
            rows,
            width,
            values,
        })
    }

    /// Whether [`Bands`] can be built from products of `a` and `b` (CPU, 2-d, f32 or f64, and
    /// not through OpenBLAS).
    pub(crate) fn apply(a: &Tensor, b: &Tensor) -> bool {
        #[cfg(feature = "openblas")]
        if crate::blas::enabled() {
            return false;
        }
        [a, b].iter().all(|t| {
            t.device().is_cpu() && t.rank() == 2 && matches!(t.dtype(), DType::F32 | DType::F64)
        })
    }

    /// Appends `a @ b` (`[n, width]`, the same values as [`constant_product`]) as the next `n`
    /// rows.
    pub(crate) fn push_product(&mut self, a: &Tensor, b: &Tensor) -> candle_core::Result<()> {
        let (a, b) = (a.detach(), b.detach());
        let (sa, la) = a.storage_and_layout();
        let (sb, lb) = b.storage_and_layout();
        let (candle_core::Storage::Cpu(ca), candle_core::Storage::Cpu(cb)) = (&*sa, &*sb) else {
            bail!("bands: CPU tensors only")
        };
        let shape = product_shape(la, lb)?;
        if shape.n != self.width || self.filled() + shape.m > self.rows {
            bail!(
                "bands: a [{}, {}] band after {} of {} rows {} wide",
                shape.m,
                shape.n,
                self.filled(),
                self.rows,
                self.width
            )
        }
        match (ca, cb, &mut self.values) {
            (CpuStorage::F32(a), CpuStorage::F32(b), CpuStorage::F32(out)) => {
                shape.append_to(a, b, out)
            }
            (CpuStorage::F64(a), CpuStorage::F64(b), CpuStorage::F64(out)) => {
                shape.append_to(a, b, out)
            }
            _ => bail!("bands: the bands and the matrix in one dtype, f32 or f64"),
        }
    }

    fn filled(&self) -> usize {
        let len = match &self.values {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            _ => 0,
        };
        len / self.width.max(1)
    }

    /// The matrix, once every row has been written.
    pub(crate) fn finish(self) -> candle_core::Result<Tensor> {
        if self.filled() != self.rows {
            bail!("bands: {} of {} rows written", self.filled(), self.rows)
        }
        Ok(Tensor::from_storage(
            candle_core::Storage::Cpu(self.values),
            (self.rows, self.width),
            candle_core::op::BackpropOp::none(),
            false,
        ))
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

thread_local! {
    /// Threads each product on this thread may use while it runs one of several runs side by
    /// side ([`side_by_side`]); candle's count otherwise.
    static PRODUCT_THREADS: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Puts back the product threads that were set before a run began.
struct RestoreThreads(Option<usize>);

impl Drop for RestoreThreads {
    fn drop(&mut self) {
        PRODUCT_THREADS.with(|c| c.set(self.0));
    }
}

/// `f` of each item, the items side by side on rayon's threads, and the products inside each
/// on an equal share of the product threads (at least one): the runs keep the other threads
/// busy, and a product split over them would pack its operands once per thread and wait for a
/// thread that is working on another run. Products give the same bits on any number of threads.
pub(crate) fn side_by_side<T, R, E>(
    items: &[T],
    f: impl Fn(&T) -> Result<R, E> + Sync + Send,
) -> Result<Vec<R>, E>
where
    T: Sync,
    R: Send,
    E: Send,
{
    use rayon::prelude::*;
    let share = (candle_core::utils::get_num_threads() / items.len().max(1)).max(1);
    items
        .par_iter()
        .map(|item| {
            let _restore = RestoreThreads(PRODUCT_THREADS.with(|c| c.replace(Some(share))));
            f(item)
        })
        .collect()
}

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

/// The gradient `dy^T x` of weight `w` (`dy: [rows, out]`, `x: [rows, in]`) from a backward:
/// handed over to the [`Gradients::of`] running on this thread if `w` is a variable and one is
/// (as the product's operands where it defers them), else returned for candle's store.
fn hand_over(w: &Tensor, dy: Tensor, x: Tensor) -> candle_core::Result<Option<Tensor>> {
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

    /// A tensor's values as f64 bits (exact for f32 and f64).
    fn bits_of(t: &Tensor) -> Vec<u64> {
        let v = t
            .to_dtype(DType::F64)
            .and_then(|t| t.flatten_all()?.to_vec1::<f64>())
            .expect("values");
        v.into_iter().map(f64::to_bits).collect()
    }

    /// An f32 tensor's values as bits.
    fn bits(t: &Tensor) -> Vec<u32> {
        let v = t
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("values");
        v.into_iter().map(f32::to_bits).collect()
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
        assert_eq!(bits(&a), bits(&b));
        let (ga, gb) = (
            Gradients::of(&a).expect("grads"),
            Gradients::of(&b).expect("grads"),
        );
        for t in [x, wg, wu, wd] {
            let want = ga.of_var(t).expect("of_var").expect("a gradient");
            let got = gb.of_var(t).expect("of_var").expect("a gradient");
            assert_eq!(bits(&want), bits(&got));
        }
        let plain = one().and_then(|l| l.backward()).expect("backward");
        for t in [wg, wu] {
            let want = ga.of_var(t).expect("of_var").expect("a gradient");
            assert_eq!(bits(&want), bits(plain.get(t).expect("in candle's store")));
        }
        let err = gate_up(x, wg, wd).expect_err("gate and up differ");
        assert!(err.to_string().contains("gate-up"), "{err}");
    }

    /// A product over leading dims is [`matmul`]'s (candle's batched one, or OpenBLAS's) bit for
    /// bit, in f32 and f64, for a transposed and offset operand, on gemm's general and
    /// small-size paths; leading dims that candle's matmul refuses (not one stride) give the
    /// products of their contiguous copies.
    #[test]
    fn constant_products_over_leading_dims_are_candles() {
        for dtype in [DType::F32, DType::F64] {
            for (b, h, m, k, n) in [(2, 3, 40, 24, 36), (1, 2, 5, 3, 4)] {
                let a = random_var(&[b, h, m, k], dtype, 11);
                // [b, h, k, n]: transposed, and offset into a wider tensor.
                let wide = random_var(&[b, h, n, k + 2], dtype, 12);
                let bt = wide
                    .as_tensor()
                    .narrow(3, 2, k)
                    .and_then(|t| t.t())
                    .expect("view");
                let got = constant_product(a.as_tensor(), &bt).expect("product");
                let want = matmul(a.as_tensor(), &bt).expect("matmul");
                assert_eq!(got.dims(), [b, h, m, n]);
                let diff = crate::test_util::max_diff(&got, &want);
                assert_eq!(diff, 0.0, "{dtype:?} {m}x{k}x{n}");
            }
            // OpenBLAS treats strided and contiguous operands differently in the last bit.
            #[cfg(feature = "openblas")]
            if crate::blas::enabled() {
                continue;
            }
            let swapped = random_var(&[3, 2, 40, 24], dtype, 13);
            let at = swapped.as_tensor().transpose(0, 1).expect("swap");
            let wide = random_var(&[3, 2, 36, 24], dtype, 14);
            let bt = wide
                .as_tensor()
                .transpose(0, 1)
                .and_then(|t| t.t())
                .expect("view");
            let got = constant_product(&at, &bt).expect("product");
            let copies = |t: &Tensor| t.contiguous().expect("copy");
            let want = constant_product(&copies(&at), &copies(&bt)).expect("product");
            assert_eq!(crate::test_util::max_diff(&got, &want), 0.0, "{dtype:?}");
        }
        let a = random_var(&[2, 4, 3], DType::F32, 15);
        let b = random_var(&[3, 3, 5], DType::F32, 16);
        assert!(
            constant_product(a.as_tensor(), b.as_tensor()).is_err(),
            "leading dims differ"
        );
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
                    bits_of(&deferred(false)),
                    bits_of(&added),
                    "{dtype:?} {rows}"
                );
                let added = ((&first + &products[0]).and_then(|s| s + &products[1])).expect("add");
                assert_eq!(
                    bits_of(&deferred(true)),
                    bits_of(&added),
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
            assert_eq!(bits_of(&got), bits_of(&want));
        }
        let (a, b) = (now.get(x.as_tensor()), later.get(x.as_tensor()));
        assert_eq!(bits_of(a.expect("dx")), bits_of(b.expect("dx")));
    }

    /// A matrix built band by band from products is the products' rows, bit for bit, on
    /// gemm's general and small-size paths, and a band that does not fit is refused.
    #[test]
    fn bands_are_their_products_rows() {
        let h = random_var(&[40, 32], DType::F32, 9);
        let p = random_var(&[40, 60], DType::F32, 10);
        let pt = p.as_tensor().t().expect("t");
        let mut bands = Bands::new(60, 32, DType::F32).expect("bands");
        let mut want = Vec::new();
        for (start, len) in [(0, 5), (5, 30), (35, 25)] {
            let part = pt.narrow(0, start, len).expect("narrow");
            bands.push_product(&part, h.as_tensor()).expect("band");
            want.push(constant_product(&part, h.as_tensor()).expect("product"));
        }
        let got = bands.finish().expect("whole");
        let want = Tensor::cat(&want, 0).expect("cat");
        assert_eq!(bits(&got), bits(&want));

        let mut short = Bands::new(60, 32, DType::F32).expect("bands");
        let part = pt.narrow(0, 0, 30).expect("narrow");
        short.push_product(&part, h.as_tensor()).expect("band");
        assert!(
            short.push_product(&pt, h.as_tensor()).is_err(),
            "past the last row"
        );
        let narrow = p.as_tensor().narrow(1, 0, 16).expect("narrow");
        let err = short
            .push_product(&part, &narrow)
            .expect_err("another width");
        assert!(err.to_string().contains("16] band"), "{err}");
        assert!(short.finish().is_err(), "half written");
    }

    /// Runs side by side share the product threads while they run and leave nothing set
    /// afterwards, and a product inside a run gives the bits it gives outside.
    #[test]
    fn runs_side_by_side_share_the_product_threads_with_the_same_bits() {
        let x = random_var(&[96, 80], DType::F32, 3);
        let w = random_var(&[72, 80], DType::F32, 4);
        let alone = linear(x.as_tensor(), w.as_tensor())
            .and_then(|y| y.flatten_all()?.to_vec1::<f32>())
            .expect("product");
        let runs = side_by_side(&[0, 1, 2], |_| {
            let y = linear(x.as_tensor(), w.as_tensor())?.flatten_all()?;
            Ok::<_, candle_core::Error>((PRODUCT_THREADS.with(Cell::get), y.to_vec1::<f32>()?))
        })
        .expect("runs");
        let share = (candle_core::utils::get_num_threads() / 3).max(1);
        for (threads, y) in runs {
            assert_eq!(threads, Some(share));
            assert!(
                y.iter()
                    .zip(&alone)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
        }
        let left = rayon::broadcast(|_| PRODUCT_THREADS.with(Cell::get));
        assert!(
            left.iter()
                .chain([&PRODUCT_THREADS.with(Cell::get)])
                .all(Option::is_none)
        );
    }
}
