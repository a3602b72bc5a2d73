//! Matrix products through the system's CBLAS (OpenBLAS), behind the `openblas` feature.
//!
//! candle's CPU matmul runs the `gemm` crate, whose stable build uses AVX2 micro-kernels even
//! where AVX-512 is present. With OpenBLAS's AVX-512 kernels a `small` training step ran 1.6x
//! faster per CPU-second (its AVX2 kernels are no faster than candle's). candle has no
//! OpenBLAS backend, so the product is a [`CustomOp2`] with its own backward (two more products
//! through the same op). f32 and f64 CPU tensors take this path; anything else (CUDA, half
//! precision) falls back to candle's matmul, as does every product when `IOTA_MATMUL=gemm` is set
//! (so a BLAS build can replay a miner that used candle's kernel bit for bit).
//!
//! Determinism: OpenBLAS's own threading changes the results' last bits with the thread count
//! (measured with its Haswell kernels), so OpenBLAS runs single-threaded on fixed blocks of
//! output rows and the blocks are spread over threads: the same bits at any thread count (the
//! `replay_error` example checks it). Results do differ in the last bits from candle's kernel,
//! and between OpenBLAS kernels (the `Haswell` and `SkylakeX` kernels that `OPENBLAS_CORETYPE`
//! selects, say).

// The CBLAS calls are foreign functions; every pointer passed is checked against its slice first.
#![allow(unsafe_code)]

use std::os::raw::c_int;
use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, bail};
use cblas_sys::{CBLAS_TRANSPOSE, CblasNoTrans, CblasRowMajor, CblasTrans};
use rayon::prelude::*;

// Links the system library (Debian: libopenblas-dev), which also provides `cblas-sys`'s symbols.
// Not through `openblas-src`: even with its `system` feature it builds a TLS download client.
// The thread-count setter is OpenBLAS's own, not part of CBLAS.
#[link(name = "openblas")]
unsafe extern "C" {
    fn openblas_set_num_threads(num_threads: c_int);
    fn openblas_get_corename() -> *const std::os::raw::c_char;
}

/// The kernel family OpenBLAS picked for this CPU at load time (`Haswell`, `SkylakeX`, ...).
fn corename() -> String {
    // SAFETY: OpenBLAS returns a pointer to a static NUL-terminated string.
    let p = unsafe { openblas_get_corename() };
    if p.is_null() {
        return "unknown".into();
    }
    // SAFETY: non-null, NUL-terminated, static (see above).
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

/// What runs the matrix products, for logs and benchmarks.
pub(crate) fn describe() -> String {
    format!(
        "OpenBLAS {} kernels, {} thread(s) over row blocks",
        corename(),
        pool().map_or(1, |p| p.current_num_threads())
    )
}

/// The threads the row blocks run on: as many as candle gives its own matrix products
/// (`RAYON_NUM_THREADS`, else the physical cores), `None` for one thread (the blocks then run
/// in the caller) or when the pool cannot be started.
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = candle_core::utils::get_num_threads();
        if threads <= 1 {
            return None;
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("iota-blas-{i}"))
            .build()
            .map_err(|e| {
                tracing::warn!(target: "iota_model::blas", error = %e, "no BLAS thread pool; one thread");
            })
            .ok()
    })
    .as_ref()
}

/// OpenBLAS 0.3.21 (Debian 12) does not know AMD Zen 5 and falls back to its AVX2 kernels on a
/// CPU with AVX-512; say so once, since `OPENBLAS_CORETYPE=SkylakeX` is much faster there.
fn warn_if_avx2_on_avx512() {
    #[cfg(target_arch = "x86_64")]
    {
        let core = corename();
        let avx2_kernels = ["Haswell", "Zen"]
            .iter()
            .any(|c| core.eq_ignore_ascii_case(c));
        if avx2_kernels
            && std::is_x86_feature_detected!("avx512f")
            && std::env::var_os("OPENBLAS_CORETYPE").is_none()
        {
            tracing::warn!(
                target: "iota_model::blas",
                kernels = %core,
                "OpenBLAS picked AVX2 kernels on an AVX-512 CPU; OPENBLAS_CORETYPE=SkylakeX \
                 selects its AVX-512 kernels (faster; results differ in the last bits)"
            );
        }
    }
}

/// Whether products go through BLAS: on unless `IOTA_MATMUL=gemm`. OpenBLAS itself is set to
/// one thread: products are split into fixed row blocks run on [`pool`] instead, so the result
/// does not depend on the thread count.
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let on = std::env::var("IOTA_MATMUL").map_or(true, |v| v != "gemm");
        if on {
            // SAFETY: takes a plain integer; OpenBLAS is initialised when the library loads.
            unsafe { openblas_set_num_threads(1) };
            tracing::debug!(
                target: "iota_model::blas",
                threads = pool().map_or(1, |p| p.current_num_threads()),
                kernels = %corename(),
                "matrix products through OpenBLAS"
            );
            warn_if_avx2_on_avx512();
        }
        on
    })
}

/// How one operand's last two dims sit in memory, as CBLAS wants them.
#[derive(Clone, Copy)]
struct MatLayout {
    trans: CBLAS_TRANSPOSE,
    ld: usize,
}

/// The CBLAS view of a `[rows, cols]` matrix with strides `(rs, cs)`, if it has one: row-major
/// with a leading dimension, or the transpose of one.
fn mat_layout(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<MatLayout> {
    if cs == 1 && (rows <= 1 || rs >= cols) {
        Some(MatLayout {
            trans: CblasNoTrans,
            ld: if rows <= 1 { cols.max(1) } else { rs },
        })
    } else if rs == 1 && (cols <= 1 || cs >= rows) {
        Some(MatLayout {
            trans: CblasTrans,
            ld: if cols <= 1 { rows.max(1) } else { cs },
        })
    } else {
        None
    }
}

/// Whether `t`'s last two dims can be handed to CBLAS without a copy.
fn blas_ready(t: &Tensor) -> bool {
    let (dims, strides) = (t.dims(), t.stride());
    let r = dims.len();
    r >= 2 && mat_layout(dims[r - 2], dims[r - 1], strides[r - 2], strides[r - 1]).is_some()
}

/// `a @ b` for `a: [..., m, k]`, `b: [..., k, n]` with equal leading dims, through CBLAS when the
/// `openblas` feature is on and both are f32 or f64 on the CPU; candle's matmul otherwise.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let eligible = a.device().is_cpu()
        && a.dtype() == b.dtype()
        && matches!(a.dtype(), candle_core::DType::F32 | candle_core::DType::F64)
        && a.rank() >= 2
        && a.rank() == b.rank()
        && enabled();
    if !eligible {
        return a.matmul(b);
    }
    let a = if blas_ready(a) {
        a.clone()
    } else {
        a.contiguous()?
    };
    let b = if blas_ready(b) {
        b.clone()
    } else {
        b.contiguous()?
    };
    a.apply_op2(&b, BlasMatMul)
}

struct BlasMatMul;

/// [`matmul`] of CPU storages, for custom ops: each operand's last two dims must be a plain or
/// transposed contiguous matrix.
pub(crate) fn storage_matmul(
    s1: &CpuStorage,
    l1: &Layout,
    s2: &CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(CpuStorage, Shape)> {
    BlasMatMul.cpu_fwd(s1, l1, s2, l2)
}

/// Element types CBLAS has a `gemm` for.
trait Gemm: Copy + Default + Send + Sync {
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        ta: CBLAS_TRANSPOSE,
        tb: CBLAS_TRANSPOSE,
        m: c_int,
        n: c_int,
        k: c_int,
        a: &[Self],
        lda: c_int,
        b: &[Self],
        ldb: c_int,
        c: &mut [Self],
        ldc: c_int,
    ) -> candle_core::Result<()>;
}

/// Elements a row-major `[rows, cols]` operand (transposed: stored `[cols, rows]`) with leading
/// dimension `ld` spans, or `None` if `ld` is too small for it.
fn needed(trans: CBLAS_TRANSPOSE, rows: c_int, cols: c_int, ld: c_int) -> Option<usize> {
    let (outer, inner) = match trans {
        CblasNoTrans => (rows, cols),
        _ => (cols, rows),
    };
    let (outer, inner, ld) = (
        usize::try_from(outer).ok()?,
        usize::try_from(inner).ok()?,
        usize::try_from(ld).ok()?,
    );
    if ld < inner.max(1) {
        return None;
    }
    Some(if outer == 0 || inner == 0 {
        0
    } else {
        (outer - 1) * ld + inner
    })
}

/// Checks that a `gemm` call stays inside its slices: what makes the foreign call sound.
fn check_call(
    (ta, tb): (CBLAS_TRANSPOSE, CBLAS_TRANSPOSE),
    (m, n, k): (c_int, c_int, c_int),
    (a, lda): (usize, c_int),
    (b, ldb): (usize, c_int),
    (c, ldc): (usize, c_int),
) -> candle_core::Result<()> {
    let ok = needed(ta, m, k, lda).is_some_and(|need| need <= a)
        && needed(tb, k, n, ldb).is_some_and(|need| need <= b)
        && needed(CblasNoTrans, m, n, ldc).is_some_and(|need| need <= c);
    if !ok {
        bail!("blas matmul: a {m}x{n}x{k} product does not fit its buffers")
    }
    Ok(())
}

impl Gemm for f32 {
    fn gemm(
        ta: CBLAS_TRANSPOSE,
        tb: CBLAS_TRANSPOSE,
        m: c_int,
        n: c_int,
        k: c_int,
        a: &[f32],
        lda: c_int,
        b: &[f32],
        ldb: c_int,
        c: &mut [f32],
        ldc: c_int,
    ) -> candle_core::Result<()> {
        check_call(
            (ta, tb),
            (m, n, k),
            (a.len(), lda),
            (b.len(), ldb),
            (c.len(), ldc),
        )?;
        // SAFETY: `check_call` showed that every element the call reads or writes lies inside
        // the slices; CBLAS keeps no pointer after returning.
        unsafe {
            cblas_sys::cblas_sgemm(
                CblasRowMajor,
                ta,
                tb,
                m,
                n,
                k,
                1.0,
                a.as_ptr(),
                lda,
                b.as_ptr(),
                ldb,
                0.0,
                c.as_mut_ptr(),
                ldc,
            )
        };
        Ok(())
    }
}

impl Gemm for f64 {
    fn gemm(
        ta: CBLAS_TRANSPOSE,
        tb: CBLAS_TRANSPOSE,
        m: c_int,
        n: c_int,
        k: c_int,
        a: &[f64],
        lda: c_int,
        b: &[f64],
        ldb: c_int,
        c: &mut [f64],
        ldc: c_int,
    ) -> candle_core::Result<()> {
        check_call(
            (ta, tb),
            (m, n, k),
            (a.len(), lda),
            (b.len(), ldb),
            (c.len(), ldc),
        )?;
        // SAFETY: as for f32 (`check_call` above).
        unsafe {
            cblas_sys::cblas_dgemm(
                CblasRowMajor,
                ta,
                tb,
                m,
                n,
                k,
                1.0,
                a.as_ptr(),
                lda,
                b.as_ptr(),
                ldb,
                0.0,
                c.as_mut_ptr(),
                ldc,
            )
        };
        Ok(())
    }
}

/// One operand: its matrix layout and where each batch's matrix starts.
struct Operand {
    mat: MatLayout,
    offsets: Vec<usize>,
    rows: usize,
    cols: usize,
}

impl Operand {
    fn new(l: &Layout, batch_dims: &[usize]) -> candle_core::Result<Self> {
        let (dims, strides) = (l.dims(), l.stride());
        let r = dims.len();
        let (rows, cols) = (dims[r - 2], dims[r - 1]);
        let Some(mat) = mat_layout(rows, cols, strides[r - 2], strides[r - 1]) else {
            bail!("blas matmul: operand strides {strides:?} for dims {dims:?} are not BLAS-ready")
        };
        // Batch offsets from the leading strides (any strides, broadcasts included).
        let mut offsets = vec![l.start_offset()];
        for (&d, &s) in batch_dims.iter().zip(&strides[..r - 2]) {
            offsets = offsets
                .iter()
                .flat_map(|&o| (0..d).map(move |i| o + i * s))
                .collect();
        }
        Ok(Self {
            mat,
            offsets,
            rows,
            cols,
        })
    }

    /// Elements one matrix spans from its start: the last one it reads is at `span - 1`.
    fn span(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            return 0;
        }
        // In memory the matrix is `outer` rows of `inner` elements, `ld` apart.
        let (outer, inner) = match self.mat.trans {
            CblasNoTrans => (self.rows, self.cols),
            _ => (self.cols, self.rows),
        };
        (outer - 1) * self.mat.ld + inner
    }

    fn check(&self, len: usize) -> candle_core::Result<()> {
        let span = self.span();
        for &o in &self.offsets {
            if span > 0 && o + span > len {
                bail!("blas matmul: operand reaches element {} of {len}", o + span)
            }
        }
        Ok(())
    }
}

fn to_int(v: usize) -> candle_core::Result<c_int> {
    c_int::try_from(v).map_err(|_| candle_core::Error::Msg(format!("blas matmul: {v} > i32")))
}

fn batched<T: Gemm>(
    a: &[T],
    la: &Layout,
    b: &[T],
    lb: &Layout,
    pool: Option<&rayon::ThreadPool>,
) -> candle_core::Result<(Vec<T>, Shape)> {
    let (da, db) = (la.dims(), lb.dims());
    let r = da.len();
    if r < 2 || db.len() != r || da[..r - 2] != db[..r - 2] || da[r - 1] != db[r - 2] {
        bail!("blas matmul: shapes {da:?} and {db:?} do not multiply")
    }
    let batch_dims = &da[..r - 2];
    let (m, k, n) = (da[r - 2], da[r - 1], db[r - 1]);
    let oa = Operand::new(la, batch_dims)?;
    let ob = Operand::new(lb, batch_dims)?;
    oa.check(a.len())?;
    ob.check(b.len())?;
    let mut out_dims = batch_dims.to_vec();
    out_dims.extend([m, n]);
    let mut c = vec![T::default(); oa.offsets.len() * m * n];
    if m * n == 0 || k == 0 {
        // Empty output, or a sum over nothing: zeros.
        return Ok((c, Shape::from(out_dims)));
    }
    let (ni, ki) = (to_int(n)?, to_int(k)?);
    let (lda, ldb) = (to_int(oa.mat.ld)?, to_int(ob.mat.ld)?);
    // Work items: blocks of ROW_BLOCK output rows of each batch, split the same way whatever the
    // thread count, each a single-threaded OpenBLAS call (see `enabled`), spread over `pool`.
    // OpenBLAS's own threading would make results depend on the thread count.
    let mut items = Vec::with_capacity(oa.offsets.len() * m.div_ceil(ROW_BLOCK));
    for ((&pa, &pb), cm) in oa.offsets.iter().zip(&ob.offsets).zip(c.chunks_mut(m * n)) {
        for (blk, rows) in cm.chunks_mut(ROW_BLOCK * n).enumerate() {
            let r0 = blk * ROW_BLOCK;
            let mr = rows.len() / n;
            // Row r0 of op(A): a row of storage without transpose, a column with it.
            let a0 = match oa.mat.trans {
                CblasNoTrans => pa + r0 * oa.mat.ld,
                _ => pa + r0,
            };
            let a_span = match oa.mat.trans {
                CblasNoTrans => (mr - 1) * oa.mat.ld + k,
                _ => (k - 1) * oa.mat.ld + mr,
            };
            items.push((
                &a[a0..a0 + a_span],
                &b[pb..pb + ob.span()],
                to_int(mr)?,
                rows,
            ));
        }
    }
    let (ta, tb) = (oa.mat.trans, ob.mat.trans);
    let run = |(ab, bb, mr, rows): (&[T], &[T], c_int, &mut [T])| {
        T::gemm(ta, tb, mr, ni, ki, ab, lda, bb, ldb, rows, ni)
    };
    match pool {
        Some(p) if items.len() > 1 => p.install(|| items.into_par_iter().try_for_each(run))?,
        _ => items.into_iter().try_for_each(run)?,
    }
    Ok((c, Shape::from(out_dims)))
}

/// Output rows per OpenBLAS call. Smaller blocks share a product between more threads but cost
/// single-thread speed (each call packs the whole right operand again): measured on `small`
/// with one thread, 64 rows cost 14%, 128 rows 8%, 256 rows 3% against one call per product.
const ROW_BLOCK: usize = 256;

impl CustomOp2 for BlasMatMul {
    fn name(&self) -> &'static str {
        "blas-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        match (s1, s2) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => {
                let (c, s) = batched(a, l1, b, l2, pool())?;
                Ok((CpuStorage::F32(c), s))
            }
            (CpuStorage::F64(a), CpuStorage::F64(b)) => {
                let (c, s) = batched(a, l1, b, l2, pool())?;
                Ok((CpuStorage::F64(c), s))
            }
            _ => bail!(
                "blas matmul: {:?} x {:?} is not supported",
                s1.dtype(),
                s2.dtype()
            ),
        }
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // C = A B: dA = dC B^T, dB = A^T dC (transposes are strided views CBLAS takes as is).
        let ga = matmul(grad, &b.t()?)?;
        let gb = matmul(&a.t()?, grad)?;
        Ok((Some(ga), Some(gb)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn randn(dims: &[usize], seed: u64) -> Tensor {
        let mut r = crate::rng::SplitMix64::new(seed);
        let n: usize = dims.iter().product();
        let v: Vec<f64> = (0..n).map(|_| r.next_normal()).collect();
        Tensor::from_vec(v, dims, &Device::Cpu).expect("tensor")
    }

    fn max_diff(x: &Tensor, y: &Tensor) -> f64 {
        (x - y)
            .and_then(|d| d.abs())
            .and_then(|d| d.flatten_all())
            .and_then(|d| d.max(0))
            .and_then(|d| d.to_scalar::<f64>())
            .expect("diff")
    }

    #[test]
    fn products_match_candle_for_every_layout() {
        let a = randn(&[2, 3, 5, 7], 1);
        let b = randn(&[2, 3, 7, 4], 2);
        let bt = randn(&[2, 3, 4, 7], 3);
        let cases = [
            (a.clone(), b.clone()),
            // Transposed rhs (a strided view), as in `x @ w^T` and `q @ k^T`.
            (a.clone(), bt.t().expect("t")),
            // Transposed lhs, as in the backward's `A^T dC`.
            (randn(&[2, 3, 7, 5], 4).t().expect("t"), b.clone()),
            // Heads moved by a transpose: batch strides that are not contiguous.
            (
                randn(&[2, 5, 3, 7], 5).transpose(1, 2).expect("t"),
                b.clone(),
            ),
            // A narrowed operand (offset and row stride larger than the width).
            (
                randn(&[2, 3, 5, 9], 6).narrow(3, 1, 7).expect("n"),
                b.clone(),
            ),
            // Unit dims.
            (randn(&[1, 1, 1, 7], 7), randn(&[1, 1, 7, 1], 8)),
        ];
        for (i, (x, y)) in cases.iter().enumerate() {
            let ours = matmul(x, y).expect("blas");
            let theirs = x
                .contiguous()
                .expect("c")
                .matmul(&y.contiguous().expect("c"));
            let theirs = theirs.expect("candle");
            assert_eq!(ours.dims(), theirs.dims(), "case {i}");
            assert!(max_diff(&ours, &theirs) < 1e-12, "case {i}");
        }
        // Two-dimensional, f32.
        let x = randn(&[6, 5], 9)
            .to_dtype(candle_core::DType::F32)
            .expect("c");
        let y = randn(&[4, 5], 10)
            .to_dtype(candle_core::DType::F32)
            .expect("c");
        let ours = matmul(&x, &y.t().expect("t")).expect("blas");
        let theirs = x.matmul(&y.t().expect("t")).expect("candle");
        let d = max_diff(
            &ours.to_dtype(candle_core::DType::F64).expect("c"),
            &theirs.to_dtype(candle_core::DType::F64).expect("c"),
        );
        assert!(d < 1e-5, "{d}");
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        // Three row blocks and a transposed operand, as in a linear layer's backward.
        let a = randn(&[700, 96], 14)
            .to_dtype(candle_core::DType::F32)
            .expect("c");
        let b = randn(&[80, 96], 15)
            .to_dtype(candle_core::DType::F32)
            .expect("c");
        let (av, bv) = (
            a.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("a"),
            b.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("b"),
        );
        let la = Layout::contiguous(a.shape());
        let lb = Layout::contiguous(b.shape()).transpose(0, 1).expect("t");
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("pool");
            let pool = (threads > 1).then_some(&pool);
            batched(&av, &la, &bv, &lb, pool).expect("matmul").0
        };
        let one = run(1);
        for threads in [2, 3] {
            let other = run(threads);
            assert!(
                one.iter()
                    .zip(&other)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{threads} threads"
            );
        }
    }

    #[test]
    fn gradients_match_candle() {
        let a = Var::from_tensor(&randn(&[2, 5, 7], 11)).expect("var");
        let b = Var::from_tensor(&randn(&[2, 4, 7], 12)).expect("var");
        let w = randn(&[2, 5, 4], 13);
        let grads = |blas: bool| {
            let bt = b.as_tensor().t().expect("t");
            let c = if blas {
                matmul(a.as_tensor(), &bt)
            } else {
                a.as_tensor().matmul(&bt)
            }
            .expect("matmul");
            let g = (c * &w)
                .and_then(|p| p.sum_all())
                .and_then(|s| s.backward())
                .expect("backward");
            (
                g.get(a.as_tensor()).expect("ga").clone(),
                g.get(b.as_tensor()).expect("gb").clone(),
            )
        };
        let (ga, gb) = grads(true);
        let (ra, rb) = grads(false);
        assert!(max_diff(&ga, &ra) < 1e-12);
        assert!(max_diff(&gb, &rb) < 1e-12);
    }
}
