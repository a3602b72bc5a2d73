//! Fused CPU kernels with their own backward for the layers' elementwise chains.
//!
//! Composed from candle primitives, a causal softmax is eight graph nodes, an RMSNorm seven and a
//! rotation seven per operand, and candle's backward adds a zero-filled gradient buffer plus an
//! addition for every node. Each op here is one pass forward and one or two passes backward. Each
//! row is computed on its own (rows are spread over candle's element-wise threads when there are
//! several), so results do not depend on the thread count.
//! f32 and f64 on the CPU only; `layers` keeps the composed versions for other devices and dtypes.

use std::mem::MaybeUninit;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use candle_core::{WithDType, bail};
use rayon::prelude::*;

/// Threads for candle's element-wise operations (`CANDLE_NUM_THREADS`, else candle's product
/// threads), read as candle reads it; [`rows_of`] spreads rows over as many.
fn elementwise_threads() -> usize {
    std::env::var(crate::threads::ELEMENTWISE_VAR)
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(candle_core::utils::get_num_threads)
}

/// Values of work a thread takes at once, and the fewest for which threads are worth starting.
const VALUES_PER_TASK: usize = 16 * 1024;

#[cfg(test)]
thread_local! {
    /// Tests force rows spread (or not) whatever the thread count and size.
    static SPREAD: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Whether `values` of work are spread over threads.
fn spread(values: usize) -> bool {
    #[cfg(test)]
    if let Some(forced) = SPREAD.with(std::cell::Cell::get) {
        return forced;
    }
    values >= 2 * VALUES_PER_TASK && elementwise_threads() > 1
}

/// A `len`-value output computed by `f(r, row)` for each `width`-wide row `r`, spread over the
/// element-wise threads when there are several and enough rows. Each row is computed alone, so
/// the bits do not depend on the thread count. Each row is zero-filled just before `f` writes
/// it, while it is in cache, instead of the whole output in a pass of its own beforehand.
fn rows_of<T: Real>(len: usize, width: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) -> Vec<T> {
    rows_reading(len, width, width, f)
}

/// [`rows_of`] where computing a row reads `read` values (the work a thread is given by).
#[allow(unsafe_code)] // rows are written into the vector's spare capacity
fn rows_reading<T: Real>(
    len: usize,
    width: usize,
    read: usize,
    f: impl Fn(usize, &mut [T]) + Sync + Send,
) -> Vec<T> {
    let (width, read) = (width.max(1), read.max(1));
    let mut out: Vec<T> = Vec::with_capacity(len);
    let row = |r: usize, row: &mut [MaybeUninit<T>]| {
        for v in row.iter_mut() {
            v.write(T::zero());
        }
        // SAFETY: every value of the row was written just above.
        let row = unsafe { &mut *(std::ptr::from_mut(row) as *mut [T]) };
        f(r, row);
    };
    let spare = &mut out.spare_capacity_mut()[..len];
    if spread(len / width * read) {
        spare
            .par_chunks_mut(width)
            .with_min_len((VALUES_PER_TASK / read).max(1))
            .enumerate()
            .for_each(|(r, values)| row(r, values));
    } else {
        spare
            .chunks_mut(width)
            .enumerate()
            .for_each(|(r, values)| row(r, values));
    }
    // SAFETY: the rows cover the first `len` values, and each was written.
    unsafe { out.set_len(len) };
    out
}

/// The float types the kernels run in.
pub(crate) trait Real: WithDType {
    /// Every value of `xs` replaced by its exponential (for f32, `crate::exp`'s loop).
    fn exp_in_place(xs: &mut [Self]);
    fn sqrt(self) -> Self;
    fn neg_infinity() -> Self;
}

impl Real for f32 {
    fn exp_in_place(xs: &mut [Self]) {
        crate::exp::exp_in_place(xs)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn neg_infinity() -> Self {
        f32::NEG_INFINITY
    }
}

impl Real for f64 {
    fn exp_in_place(xs: &mut [Self]) {
        for x in xs {
            *x = x.exp();
        }
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn neg_infinity() -> Self {
        f64::NEG_INFINITY
    }
}

#[cfg(test)]
thread_local! {
    /// Test switch: run the composed versions on the CPU too, to compare the two.
    pub(crate) static COMPOSED_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the fused kernels apply to `t`: f32 or f64 on the CPU.
pub(crate) fn applies(t: &Tensor) -> bool {
    #[cfg(test)]
    if COMPOSED_ONLY.with(|c| c.get()) {
        return false;
    }
    t.device().is_cpu() && matches!(t.dtype(), candle_core::DType::F32 | candle_core::DType::F64)
}

/// The contiguous slice a layout covers, or an error (callers make inputs contiguous first).
fn contiguous<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [T]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{op}: input is not contiguous")
    };
    Ok(&T::cpu_storage_as_slice(s)?[start..end])
}

/// Dispatch a kernel generic over the float type on a storage's dtype.
macro_rules! by_dtype {
    ($s:expr, $op:expr, $f:ident($($arg:expr),*)) => {
        match $s {
            CpuStorage::F32(_) => $f::<f32>($($arg),*),
            CpuStorage::F64(_) => $f::<f64>($($arg),*),
            _ => bail!("{}: only f32 and f64", $op),
        }
    };
}

/// An output computed outside the graph from detached inputs, for a custom op whose node only
/// carries the backward: the op's forward hands over a copy of it, once.
pub(crate) struct Precomputed(std::sync::Mutex<Option<Tensor>>);

impl Precomputed {
    pub(crate) fn new(out: Tensor) -> Self {
        Self(std::sync::Mutex::new(Some(out)))
    }

    /// The output's data as the op's forward result.
    pub(crate) fn hand_back(&self, op: &str) -> Result<(CpuStorage, Shape)> {
        // A poisoned lock only means another thread panicked; the slot is still whole.
        let taken = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(out) = taken else {
            bail!("{op}: applied twice")
        };
        let out = out.contiguous()?;
        let (storage, layout) = out.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            bail!("{op}: CPU only")
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("{op}: output not contiguous")
        };
        let copy = match cpu {
            CpuStorage::F32(x) => CpuStorage::F32(x[start..end].to_vec()),
            CpuStorage::F64(x) => CpuStorage::F64(x[start..end].to_vec()),
            _ => bail!("{op}: f32 and f64 only"),
        };
        Ok((copy, layout.shape().clone()))
    }
}

// ---------------------------------------------------------------------------------------------
// Causal softmax of scaled scores.

/// `softmax(scale * x + causal_mask)` over the last dim of `x: [..., t, t]`: row `i` of each
/// `t x t` block sees columns `0..=i`, the rest come out as exact zeros.
pub(crate) fn causal_softmax(x: &Tensor, scale: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op1(CausalSoftmax { scale })
}

struct CausalSoftmax {
    scale: f64,
}

fn square_tail(l: &Layout, op: &str) -> Result<usize> {
    let dims = l.dims();
    let r = dims.len();
    if r < 2 || dims[r - 1] != dims[r - 2] {
        bail!("{op}: need [..., t, t], got {dims:?}")
    }
    Ok(dims[r - 1])
}

fn softmax_fwd<T: Real>(s: &CpuStorage, l: &Layout, scale: f64) -> Result<CpuStorage> {
    let x = contiguous::<T>(s, l, "causal-softmax")?;
    let t = square_tail(l, "causal-softmax")?;
    let scale = T::from_f64(scale);
    let out = rows_of(x.len(), t, |r, yr| {
        let xr = &x[r * t..][..t];
        let n = r % t + 1;
        let mut m = T::neg_infinity();
        for &v in &xr[..n] {
            let v = v * scale;
            if v > m {
                m = v;
            }
        }
        for (y, &v) in yr[..n].iter_mut().zip(&xr[..n]) {
            *y = v * scale - m;
        }
        T::exp_in_place(&mut yr[..n]);
        let mut sum = T::zero();
        for &y in &yr[..n] {
            sum += y;
        }
        let inv = T::one() / sum;
        for y in &mut yr[..n] {
            *y *= inv;
        }
    });
    Ok(T::to_cpu_storage_owned(out))
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = by_dtype!(s, self.name(), softmax_fwd(s, l, self.scale))?;
        Ok((out, l.shape().clone()))
    }
    fn bwd(&self, _x: &Tensor, p: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        // dx = scale * p * (g - sum(g * p)); masked entries have p = 0 and get 0.
        Ok(Some(causal_softmax_bwd(p, g, self.scale)?))
    }
}

/// The gradient of [`causal_softmax`]'s input given its output `p` and the output's gradient.
pub(crate) fn causal_softmax_bwd(p: &Tensor, g: &Tensor, scale: f64) -> Result<Tensor> {
    p.contiguous()?
        .apply_op2_no_bwd(&g.contiguous()?, &CausalSoftmaxBwd { scale })
}

struct CausalSoftmaxBwd {
    scale: f64,
}

fn softmax_bwd<T: Real>(
    sp: &CpuStorage,
    lp: &Layout,
    sg: &CpuStorage,
    lg: &Layout,
    scale: f64,
) -> Result<CpuStorage> {
    let p = contiguous::<T>(sp, lp, "causal-softmax-bwd")?;
    let g = contiguous::<T>(sg, lg, "causal-softmax-bwd")?;
    let t = square_tail(lp, "causal-softmax-bwd")?;
    if p.len() != g.len() {
        bail!(
            "causal-softmax-bwd: {} probabilities, {} gradients",
            p.len(),
            g.len()
        )
    }
    let scale = T::from_f64(scale);
    let out = rows_of(p.len(), t, |r, dr| {
        let (pr, gr) = (&p[r * t..][..t], &g[r * t..][..t]);
        let n = r % t + 1;
        let mut dot = T::zero();
        for (&pv, &gv) in pr[..n].iter().zip(&gr[..n]) {
            dot += pv * gv;
        }
        for ((d, &pv), &gv) in dr[..n].iter_mut().zip(&pr[..n]).zip(&gr[..n]) {
            *d = scale * pv * (gv - dot);
        }
    });
    Ok(T::to_cpu_storage_owned(out))
}

impl CustomOp2 for CausalSoftmaxBwd {
    fn name(&self) -> &'static str {
        "causal-softmax-bwd"
    }
    fn cpu_fwd(
        &self,
        sp: &CpuStorage,
        lp: &Layout,
        sg: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = by_dtype!(sp, self.name(), softmax_bwd(sp, lp, sg, lg, self.scale))?;
        Ok((out, lp.shape().clone()))
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm.

/// `x / sqrt(mean(x^2) + eps) * w` over the last dim of `x: [..., d]`, `w: [d]`.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps })
}

struct RmsNorm {
    eps: f64,
}

fn inv_rms<T: Real>(row: &[T], eps: f64) -> T {
    let mut ss = T::zero();
    for &v in row {
        ss += v * v;
    }
    let d = T::from_f64(row.len() as f64);
    T::one() / (ss / d + T::from_f64(eps)).sqrt()
}

fn rms_dims(lx: &Layout, lw: &Layout, op: &str) -> Result<usize> {
    let d = lx.dims().last().copied().unwrap_or(0);
    if lw.dims() != [d] || d == 0 {
        bail!("{op}: x {:?} and w {:?}", lx.dims(), lw.dims())
    }
    Ok(d)
}

fn rms_fwd<T: Real>(
    sx: &CpuStorage,
    lx: &Layout,
    sw: &CpuStorage,
    lw: &Layout,
    eps: f64,
) -> Result<CpuStorage> {
    let d = rms_dims(lx, lw, "rms-norm")?;
    let x = contiguous::<T>(sx, lx, "rms-norm")?;
    let w = contiguous::<T>(sw, lw, "rms-norm")?;
    let out = rows_of(x.len(), d, |r, yr| {
        let xr = &x[r * d..][..yr.len()];
        let inv = inv_rms(xr, eps);
        for ((y, &xv), &wv) in yr.iter_mut().zip(xr).zip(w) {
            *y = xv * inv * wv;
        }
    });
    Ok(T::to_cpu_storage_owned(out))
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }
    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = by_dtype!(sx, self.name(), rms_fwd(sx, lx, sw, lw, self.eps))?;
        Ok((out, lx.shape().clone()))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let dx = x.apply_op3_no_bwd(
            w,
            &g,
            &RmsNormBwd {
                eps: self.eps,
                wrt_x: true,
            },
        )?;
        let dw = x.apply_op3_no_bwd(
            w,
            &g,
            &RmsNormBwd {
                eps: self.eps,
                wrt_x: false,
            },
        )?;
        Ok((Some(dx), Some(dw)))
    }
}

struct RmsNormBwd {
    eps: f64,
    /// The gradient with respect to `x` (`[..., d]`), otherwise to `w` (`[d]`).
    wrt_x: bool,
}

fn rms_bwd<T: Real>(
    (sx, lx): (&CpuStorage, &Layout),
    (sw, lw): (&CpuStorage, &Layout),
    (sg, lg): (&CpuStorage, &Layout),
    eps: f64,
    wrt_x: bool,
) -> Result<CpuStorage> {
    let d = rms_dims(lx, lw, "rms-norm-bwd")?;
    let x = contiguous::<T>(sx, lx, "rms-norm-bwd")?;
    let w = contiguous::<T>(sw, lw, "rms-norm-bwd")?;
    let g = contiguous::<T>(sg, lg, "rms-norm-bwd")?;
    if x.len() != g.len() {
        bail!("rms-norm-bwd: {} inputs, {} gradients", x.len(), g.len())
    }
    if !wrt_x {
        // dw = sum over rows of g * x * inv, rows added in order.
        let mut dw = vec![T::zero(); d];
        for (xr, gr) in x.chunks(d).zip(g.chunks(d)) {
            let inv = inv_rms(xr, eps);
            for ((a, &xv), &gv) in dw.iter_mut().zip(xr).zip(gr) {
                *a += gv * xv * inv;
            }
        }
        return Ok(T::to_cpu_storage_owned(dw));
    }
    // With u = g * w: dx = inv * u - x * inv^3 * mean(u * x).
    let dn = T::from_f64(d as f64);
    let out = rows_of(x.len(), d, |r, dr| {
        let (xr, gr) = (&x[r * d..][..dr.len()], &g[r * d..][..dr.len()]);
        let inv = inv_rms(xr, eps);
        let mut dot = T::zero();
        for ((&xv, &gv), &wv) in xr.iter().zip(gr).zip(w) {
            dot += gv * wv * xv;
        }
        let c = inv * inv * inv * dot / dn;
        for (((o, &xv), &gv), &wv) in dr.iter_mut().zip(xr).zip(gr).zip(w) {
            *o = inv * gv * wv - xv * c;
        }
    });
    Ok(T::to_cpu_storage_owned(out))
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "rms-norm-bwd"
    }
    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sg: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = by_dtype!(
            sx,
            self.name(),
            rms_bwd((sx, lx), (sw, lw), (sg, lg), self.eps, self.wrt_x)
        )?;
        let shape = if self.wrt_x { lx.shape() } else { lw.shape() };
        Ok((out, shape.clone()))
    }
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding.

/// Rotary tables `[positions, half]` in f64; kernels round them to their own dtype.
#[derive(Debug, Clone)]
pub(crate) struct RopeTables {
    pub cos: Arc<Vec<f64>>,
    pub sin: Arc<Vec<f64>>,
    pub half: usize,
}

/// Rotate `x: [batch, heads, seq, head_dim]` (rotate-half layout); any strides with a unit last
/// stride are read in place (the heads transpose needs no copy), the output is contiguous.
pub(crate) fn rope(x: &Tensor, tables: &RopeTables) -> Result<Tensor> {
    unit_last_stride(x)?.apply_op1(Rope {
        tables: tables.clone(),
        inverse: false,
    })
}

/// The gradient of [`rope`]'s input given its output's: the inverse rotation.
pub(crate) fn rope_bwd(g: &Tensor, tables: &RopeTables) -> Result<Tensor> {
    unit_last_stride(g)?.apply_op1_no_bwd(&Rope {
        tables: tables.clone(),
        inverse: true,
    })
}

fn unit_last_stride(x: &Tensor) -> Result<Tensor> {
    if x.stride().last() == Some(&1) {
        Ok(x.clone())
    } else {
        x.contiguous()
    }
}

struct Rope {
    tables: RopeTables,
    /// Rotate by minus the angle: the backward (rotations are orthogonal).
    inverse: bool,
}

fn rope_kernel<T: Real>(
    s: &CpuStorage,
    l: &Layout,
    tables: &RopeTables,
    inverse: bool,
) -> Result<CpuStorage> {
    let (b, h, t, hd) = l.shape().dims4()?;
    let half = tables.half;
    let st = l.stride();
    if hd != 2 * half || st[3] != 1 || t * half > tables.cos.len() {
        bail!("rope: dims {:?} strides {st:?} for half {half}", l.dims())
    }
    let x = T::cpu_storage_as_slice(s)?;
    let last = l.start_offset() + (b - 1) * st[0] + (h - 1) * st[1] + (t - 1) * st[2] + hd;
    if b * h * t * hd == 0 || last > x.len() {
        if b * h * t * hd == 0 {
            return Ok(T::to_cpu_storage_owned(Vec::new()));
        }
        bail!("rope: layout reaches past the storage")
    }
    let sign = if inverse { -1.0 } else { 1.0 };
    // Row r of the output is position ti of head hi of sequence bi, in that order.
    let out = rows_of(b * h * t * hd, hd, |r, yr| {
        let (ti, hi, bi) = (r % t, (r / t) % h, r / (t * h));
        let start = l.start_offset() + bi * st[0] + hi * st[1] + ti * st[2];
        let xr = &x[start..start + hd];
        let (cos, sin) = (
            &tables.cos[ti * half..(ti + 1) * half],
            &tables.sin[ti * half..(ti + 1) * half],
        );
        let (x1, x2) = xr.split_at(half);
        let (y1, y2) = yr.split_at_mut(half);
        for i in 0..half {
            let (c, s) = (T::from_f64(cos[i]), T::from_f64(sign * sin[i]));
            y1[i] = x1[i] * c - x2[i] * s;
            y2[i] = x2[i] * c + x1[i] * s;
        }
    });
    Ok(T::to_cpu_storage_owned(out))
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = by_dtype!(
            s,
            self.name(),
            rope_kernel(s, l, &self.tables, self.inverse)
        )?;
        Ok((out, Shape::from(l.dims())))
    }
    fn bwd(&self, _x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(unit_last_stride(g)?.apply_op1_no_bwd(&Rope {
            tables: self.tables.clone(),
            inverse: !self.inverse,
        })?))
    }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU gate.

/// `silu(g) * u`, elementwise.
pub(crate) fn silu_mul(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    g.contiguous()?.apply_op2(&u.contiguous()?, SiluMul)
}

struct SiluMul;

/// Values SwiGLU's kernels take as one row of [`rows_of`] (each value is computed alone).
const SIGMOID_ROW: usize = 4096;

/// Calls `f(i, sigmoid(v[i]))` for every value in order, taking `exp` of a block of values at a
/// time (a buffer that stays in cache, not a copy of the whole tensor).
fn for_each_sigmoid<T: Real>(v: &[T], mut f: impl FnMut(usize, T)) {
    const BLOCK: usize = 256;
    let mut buf = [T::zero(); BLOCK];
    for (b, block) in v.chunks(BLOCK).enumerate() {
        let e = &mut buf[..block.len()];
        for (e, &a) in e.iter_mut().zip(block) {
            *e = T::zero() - a;
        }
        T::exp_in_place(e);
        for (j, &e) in e.iter().enumerate() {
            f(b * BLOCK + j, T::one() / (T::one() + e));
        }
    }
}

fn silu_mul_fwd<T: Real>(
    sg: &CpuStorage,
    lg: &Layout,
    su: &CpuStorage,
    lu: &Layout,
) -> Result<CpuStorage> {
    let g = contiguous::<T>(sg, lg, "silu-mul")?;
    let u = contiguous::<T>(su, lu, "silu-mul")?;
    if lg.dims() != lu.dims() {
        bail!("silu-mul: {:?} and {:?}", lg.dims(), lu.dims())
    }
    let out = rows_of(g.len(), SIGMOID_ROW, |r, o| {
        let at = r * SIGMOID_ROW;
        let (g, u) = (&g[at..][..o.len()], &u[at..][..o.len()]);
        for_each_sigmoid(g, |i, s| o[i] = g[i] * s * u[i]);
    });
    Ok(T::to_cpu_storage_owned(out))
}

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }
    fn cpu_fwd(
        &self,
        sg: &CpuStorage,
        lg: &Layout,
        su: &CpuStorage,
        lu: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = by_dtype!(sg, self.name(), silu_mul_fwd(sg, lg, su, lu))?;
        Ok((out, lg.shape().clone()))
    }
    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dg, du) = silu_mul_grads(g, u, dy)?;
        Ok((Some(dg), Some(du)))
    }
}

/// [`silu_mul`]'s forward on storages: `silu(g) * u`.
pub(crate) fn silu_mul_storage(
    sg: &CpuStorage,
    lg: &Layout,
    su: &CpuStorage,
    lu: &Layout,
) -> Result<CpuStorage> {
    by_dtype!(sg, "silu-mul", silu_mul_fwd(sg, lg, su, lu))
}

/// The gradients of `silu(g) * u` with respect to `g` and to `u` under `dy`, in one pass over
/// the three (one sigmoid per value, not one per gradient).
pub(crate) fn silu_mul_grads(g: &Tensor, u: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let (g, u, dy) = (g.contiguous()?, u.contiguous()?, dy.contiguous()?);
    let both = g.apply_op3_no_bwd(&u, &dy, &SiluMulGrads)?;
    let last = g.rank().saturating_sub(1);
    let n = g.dim(last)?;
    Ok((both.narrow(last, 0, n)?, both.narrow(last, n, n)?))
}

struct SiluMulGrads;

/// Both gradients side by side: `[..., 2n]`, the gate's in the first half of each row.
fn silu_mul_grads_kernel<T: Real>(
    (sg, lg): (&CpuStorage, &Layout),
    (su, lu): (&CpuStorage, &Layout),
    (sd, ld): (&CpuStorage, &Layout),
) -> Result<CpuStorage> {
    let g = contiguous::<T>(sg, lg, "silu-mul-grads")?;
    let u = contiguous::<T>(su, lu, "silu-mul-grads")?;
    let dy = contiguous::<T>(sd, ld, "silu-mul-grads")?;
    if lg.dims() != lu.dims() || lg.dims() != ld.dims() {
        bail!(
            "silu-mul-grads: {:?} {:?} {:?}",
            lg.dims(),
            lu.dims(),
            ld.dims()
        )
    }
    let n = lg.dims().last().copied().unwrap_or(1).max(1);
    let out = rows_reading(2 * g.len(), 2 * n, 3 * n, |r, o| {
        let at = r * n;
        let (g, u, dy) = (&g[at..][..n], &u[at..][..n], &dy[at..][..n]);
        let (og, ou) = o.split_at_mut(n);
        for_each_sigmoid(g, |i, s| {
            og[i] = dy[i] * u[i] * s * (T::one() + g[i] * (T::one() - s));
            ou[i] = dy[i] * g[i] * s;
        });
    });
    Ok(T::to_cpu_storage_owned(out))
}

impl CustomOp3 for SiluMulGrads {
    fn name(&self) -> &'static str {
        "silu-mul-grads"
    }
    fn cpu_fwd(
        &self,
        sg: &CpuStorage,
        lg: &Layout,
        su: &CpuStorage,
        lu: &Layout,
        sd: &CpuStorage,
        ld: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = by_dtype!(
            sg,
            self.name(),
            silu_mul_grads_kernel((sg, lg), (su, lu), (sd, ld))
        )?;
        let mut dims = lg.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last *= 2;
        }
        Ok((out, Shape::from(dims)))
    }
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy helpers (no gradient graph: the loss computes its gradient by hand).

/// Per row of `x: [n, v]`: the max `m` and `sum(exp(x - m))`, as two `[n, 1]` tensors.
pub(crate) fn row_max_sumexp(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let both = x.contiguous()?.apply_op1_no_bwd(&RowMaxSumExp)?;
    Ok((both.narrow(1, 0, 1)?, both.narrow(1, 1, 1)?))
}

struct RowMaxSumExp;

fn max_sumexp<T: Real>(s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
    let (_, v) = l.shape().dims2()?;
    let x = contiguous::<T>(s, l, "row-max-sumexp")?;
    let v = v.max(1);
    // Each output row (max, sum of exp) reads a row of `x`; exp taken a cached block at a time.
    let out = rows_reading(2 * (x.len() / v), 2, v, |r, o| {
        const BLOCK: usize = 256;
        let row = &x[r * v..][..v];
        let m = row
            .iter()
            .fold(T::neg_infinity(), |m, &a| if a > m { a } else { m });
        let mut buf = [T::zero(); BLOCK];
        let mut sum = T::zero();
        for block in row.chunks(BLOCK) {
            let e = &mut buf[..block.len()];
            for (e, &a) in e.iter_mut().zip(block) {
                *e = a - m;
            }
            T::exp_in_place(e);
            for &a in e.iter() {
                sum += a;
            }
        }
        o[0] = m;
        o[1] = sum;
    });
    Ok(T::to_cpu_storage_owned(out))
}

impl CustomOp1 for RowMaxSumExp {
    fn name(&self) -> &'static str {
        "row-max-sumexp"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, _) = l.shape().dims2()?;
        let out = by_dtype!(s, self.name(), max_sumexp(s, l))?;
        Ok((out, Shape::from((n, 2))))
    }
}

/// The loss head's gradient at the logits `x: [n, v]` of vocabulary entries `first..first + v`:
/// `(exp(x - lse) - onehot(targets)) * scale`, for `lse: [n]` and `targets: [n]` (u32).
pub(crate) fn scaled_probs(
    x: &Tensor,
    lse: &Tensor,
    targets: &Tensor,
    first: usize,
    scale: f64,
) -> Result<Tensor> {
    x.contiguous()?.apply_op3_no_bwd(
        &lse.contiguous()?,
        &targets.contiguous()?,
        &ScaledProbs { first, scale },
    )
}

struct ScaledProbs {
    first: usize,
    scale: f64,
}

fn scaled_probs_kernel<T: Real>(
    sx: &CpuStorage,
    lx: &Layout,
    sl: &CpuStorage,
    ll: &Layout,
    targets: &[u32],
    op: &ScaledProbs,
) -> Result<CpuStorage> {
    let (n, v) = lx.shape().dims2()?;
    if ll.dims() != [n] || targets.len() != n {
        bail!(
            "scaled-probs: x {:?}, lse {:?}, {} targets",
            lx.dims(),
            ll.dims(),
            targets.len()
        )
    }
    let x = contiguous::<T>(sx, lx, "scaled-probs")?;
    let lse = contiguous::<T>(sl, ll, "scaled-probs")?;
    let scale = T::from_f64(op.scale);
    let out = rows_of(x.len(), v, |r, o| {
        let (row, l, target) = (&x[r * v..][..o.len()], lse[r], targets[r]);
        for (y, &a) in o.iter_mut().zip(row) {
            *y = a - l;
        }
        T::exp_in_place(o);
        for y in o.iter_mut() {
            *y *= scale;
        }
        if let Some(y) = (target as usize)
            .checked_sub(op.first)
            .and_then(|c| o.get_mut(c))
        {
            *y -= scale;
        }
    });
    Ok(T::to_cpu_storage_owned(out))
}

impl CustomOp3 for ScaledProbs {
    fn name(&self) -> &'static str {
        "scaled-probs"
    }
    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sl: &CpuStorage,
        ll: &Layout,
        st: &CpuStorage,
        lt: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::U32(t) = st else {
            bail!("scaled-probs: targets must be u32")
        };
        let Some((start, end)) = lt.contiguous_offsets() else {
            bail!("scaled-probs: targets are not contiguous")
        };
        let targets = &t[start..end];
        let out = by_dtype!(
            sx,
            self.name(),
            scaled_probs_kernel(sx, lx, sl, ll, targets, self)
        )?;
        Ok((out, lx.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::random_var;
    use candle_core::DType;

    fn storage(dims: &[usize], seed: u64) -> (CpuStorage, Layout) {
        let t = random_var(dims, DType::F32, seed).as_tensor().clone();
        let (s, l) = t.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*s else {
            panic!("CPU tensor")
        };
        (cpu.clone(), l.clone())
    }

    fn bits(s: Result<CpuStorage>) -> Vec<u32> {
        let s = s.expect("kernel");
        s.as_slice::<f32>()
            .expect("f32")
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// Every kernel's output, each large enough to be spread over threads.
    fn outputs() -> Vec<Vec<u32>> {
        let sq = [2, 3, 128, 128];
        let (p, lp) = storage(&sq, 1);
        let (g, lg) = storage(&sq, 2);
        let (x, lx) = storage(&[300, 384], 3);
        let (w, lw) = storage(&[384], 4);
        let (gx, lgx) = storage(&[300, 384], 5);
        let (r, lr) = storage(&[2, 4, 128, 64], 6);
        let (a, la) = storage(&[30, 1024], 7);
        let (u, lu) = storage(&[30, 1024], 8);
        let (d, ld) = storage(&[30, 1024], 9);
        let (v, lv) = storage(&[12, 4096], 10);
        let lse: Vec<f32> = (0..12).map(|i| 8.0 + i as f32 * 0.1).collect();
        let lse = CpuStorage::F32(lse);
        let ll = Layout::contiguous(12);
        let targets: Vec<u32> = (0..12).map(|i| i * 700).collect();
        let tables = RopeTables {
            cos: Arc::new((0..128 * 32).map(|i| (i as f64 * 0.01).cos()).collect()),
            sin: Arc::new((0..128 * 32).map(|i| (i as f64 * 0.01).sin()).collect()),
            half: 32,
        };
        let probs = ScaledProbs {
            first: 100,
            scale: 0.5,
        };
        vec![
            bits(softmax_fwd::<f32>(&p, &lp, 0.125)),
            bits(softmax_bwd::<f32>(&p, &lp, &g, &lg, 0.125)),
            bits(rms_fwd::<f32>(&x, &lx, &w, &lw, 1e-5)),
            bits(rms_bwd::<f32>(
                (&x, &lx),
                (&w, &lw),
                (&gx, &lgx),
                1e-5,
                true,
            )),
            bits(rope_kernel::<f32>(&r, &lr, &tables, false)),
            bits(silu_mul_fwd::<f32>(&a, &la, &u, &lu)),
            bits(silu_mul_grads_kernel::<f32>(
                (&a, &la),
                (&u, &lu),
                (&d, &ld),
            )),
            bits(max_sumexp::<f32>(&v, &lv)),
            bits(scaled_probs_kernel::<f32>(
                &v, &lv, &lse, &ll, &targets, &probs,
            )),
        ]
    }

    /// Rows spread over three threads give the bits of rows taken one by one on one.
    #[test]
    fn rows_spread_over_threads_give_the_serial_bits() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("pool");
        let run = |spread: bool| {
            pool.install(|| {
                SPREAD.with(|c| c.set(Some(spread)));
                let out = outputs();
                SPREAD.with(|c| c.set(None));
                out
            })
        };
        let (one, spread) = (run(false), run(true));
        for (k, (a, b)) in one.iter().zip(&spread).enumerate() {
            assert!(!a.is_empty(), "kernel {k} gave nothing");
            assert_eq!(a, b, "kernel {k}");
        }
    }
}
