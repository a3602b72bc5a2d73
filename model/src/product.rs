//! The matrix products every layer and the tiled attention use: through `gemm` into outputs that
//! are not zero-filled first ([`constant_product`], [`Bands`]), and on a run's share of the
//! product threads when runs train side by side ([`side_by_side`]). The layers built on them are
//! in `crate::linear`; the gradients they hand over, in `crate::gradients`.

use std::cell::Cell;

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor, bail};

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
pub(crate) fn product(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
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
pub(crate) fn product_storage(
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
pub(crate) fn product_shape(al: &Layout, bl: &Layout) -> candle_core::Result<Product> {
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
pub(crate) struct Product {
    pub(crate) m: usize,
    pub(crate) n: usize,
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
    pub(crate) fn add_to<T: candle_core::WithDType>(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_var;
    use candle_core::DType;

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
        assert_eq!(crate::test_util::bits(&got), crate::test_util::bits(&want));

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
        let product = || constant_product(x.as_tensor(), &w.as_tensor().t()?);
        let alone = product()
            .and_then(|y| y.flatten_all()?.to_vec1::<f32>())
            .expect("product");
        let runs = side_by_side(&[0, 1, 2], |_| {
            let y = product()?.flatten_all()?;
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
