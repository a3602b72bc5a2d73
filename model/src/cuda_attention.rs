//! Causal grouped-query attention on CUDA through the crate's own kernels
//! (`src/cuda/attention.cu`), the GPU twin of [`crate::tiled_attention`]: the forward keeps the
//! output and each row's log-sum-exp, the backward recomputes the probabilities tile by tile, and
//! no `[batch, heads, t, t]` score matrix is ever allocated. The kernels compute in f32 for f32
//! and bf16 storage, and sum in a fixed order without atomics, so two runs are bit-identical.
//!
//! Inputs are `q: [b, heads, t, hd]` and `k, v: [b, kv_heads, t, hd]` after RoPE, `hd <=`
//! [`HEAD_DIM_MAX`]; each key/value head serves `heads / kv_heads` adjacent query heads.

// Kernel launches and uninitialised device buffers (each filled whole by the kernel that gets
// it) are unsafe calls into cudarc.
#![allow(unsafe_code)]

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Storage, Tensor, bail};

use crate::error::Result;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
const MODULE: &str = "iota_attention";
/// Rows per block (one warp each), as `WARPS` in the kernels.
const ROWS_PER_BLOCK: u32 = 8;
/// The widest head the kernels hold (`HD_MAX`).
pub(crate) const HEAD_DIM_MAX: usize = 128;

/// Whether the kernels take `q`: on a CUDA device, f32 or bf16, heads at most
/// [`HEAD_DIM_MAX`] wide.
pub(crate) fn applies(q: &Tensor) -> bool {
    q.device().is_cuda()
        && matches!(q.dtype(), DType::F32 | DType::BF16)
        && q.dims().last().is_some_and(|&hd| hd <= HEAD_DIM_MAX)
}

/// Causal attention of `q` over `k`, `v` with scores scaled by `scale`; differentiable in all
/// three.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let op = CudaAttention {
        scale: scale as f32,
        lse: Mutex::new(None),
    };
    Ok(q.apply_op3(&k, &v, op)?)
}

struct CudaAttention {
    scale: f32,
    /// Each row's log-sum-exp `[b, heads, t]` (f32), written by the forward for the backward.
    lse: Mutex<Option<Tensor>>,
}

/// The sizes of one call, checked against each other.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    heads: usize,
    kv: usize,
    t: usize,
    hd: usize,
}

impl Dims {
    fn of(q: &Shape, k: &Shape, v: &Shape) -> candle_core::Result<Dims> {
        let (b, heads, t, hd) = q.dims4()?;
        let (kb, kv, kt, khd) = k.dims4()?;
        if (kb, kt, khd) != (b, t, hd) || k != v {
            bail!("CUDA attention: q {q:?}, k {k:?} and v {v:?} do not fit together")
        }
        if kv == 0 || !heads.is_multiple_of(kv) {
            bail!("CUDA attention: {heads} heads do not share {kv} key/value heads evenly")
        }
        if hd > HEAD_DIM_MAX {
            bail!("CUDA attention: heads of {hd} exceed the kernels' {HEAD_DIM_MAX}")
        }
        for n in [b, heads, t, hd] {
            if i32::try_from(n).is_err() {
                bail!("CUDA attention: size {n} too large")
            }
        }
        Ok(Dims {
            b,
            heads,
            kv,
            t,
            hd,
        })
    }

    /// One block per `ROWS_PER_BLOCK` rows of each of `heads` heads of each sequence.
    fn grid(&self, heads: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (
                (self.t as u32).div_ceil(ROWS_PER_BLOCK),
                heads as u32,
                self.b as u32,
            ),
            block_dim: (ROWS_PER_BLOCK * 32, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn ints(&self) -> [i32; 4] {
        // In range: checked in `of`.
        [self.heads, self.kv, self.t, self.hd].map(|n| n as i32)
    }
}

/// The kernels' name suffix for a storage type.
fn suffix(dtype: DType) -> candle_core::Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        other => bail!("CUDA attention: {other:?} is not supported (f32, bf16)"),
    }
}

/// A contiguous tensor's elements on the device.
fn view<'a, T: CudaDType>(
    storage: &'a Storage,
    layout: &Layout,
) -> candle_core::Result<CudaView<'a, T>> {
    let Storage::Cuda(cuda) = storage else {
        bail!("CUDA attention: a tensor is not on a CUDA device")
    };
    if !layout.is_contiguous() {
        bail!("CUDA attention: a tensor is not contiguous")
    }
    at(cuda, layout)
}

fn wrap<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: Shape) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

fn forward<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    (q, k, v): (CudaView<'_, T>, CudaView<'_, T>, CudaView<'_, T>),
    dims: Dims,
    scale: f32,
    name: &str,
) -> candle_core::Result<(CudaSlice<T>, CudaSlice<f32>)> {
    let rows = dims.b * dims.heads * dims.t;
    // SAFETY: the forward kernel writes every element of both (each live row's output and
    // log-sum-exp).
    let out = unsafe { dev.alloc::<T>(rows * dims.hd)? };
    let lse = unsafe { dev.alloc::<f32>(rows)? };
    let func = dev.get_or_load_custom_func(&format!("attention_forward_{name}"), MODULE, PTX)?;
    let [heads, kv, t, hd] = dims.ints();
    let mut launch = func.builder();
    launch.arg(&q).arg(&k).arg(&v).arg(&out).arg(&lse);
    launch.arg(&heads).arg(&kv).arg(&t).arg(&hd).arg(&scale);
    // SAFETY: the arguments match the kernel's signature; sizes were checked by `Dims::of`.
    unsafe { launch.launch(dims.grid(dims.heads)) }.w()?;
    Ok((out, lse))
}

fn forward_storage<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    [(q, ql), (k, kl), (v, vl)]: [(&CudaStorage, &Layout); 3],
    dims: Dims,
    scale: f32,
) -> candle_core::Result<(CudaStorage, CudaSlice<f32>)> {
    let views = (at::<T>(q, ql)?, at::<T>(k, kl)?, at::<T>(v, vl)?);
    let (out, lse) = forward(dev, views, dims, scale, suffix(q.dtype())?)?;
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lse))
}

/// The elements of `s` from where `l` starts.
fn at<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> candle_core::Result<CudaView<'a, T>> {
    Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
}

/// `(dq, dk, dv)` given the forward's inputs, output `o`, its gradient `d_o` and `lse`.
fn backward<T: CudaDType + DeviceRepr>(
    [q, k, v, o, d_o]: [&Tensor; 5],
    lse: &Tensor,
    scale: f32,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let Some(dev) = q.device().as_cuda_device().ok().cloned() else {
        bail!("CUDA attention: not on a CUDA device")
    };
    let dims = Dims::of(q.shape(), k.shape(), v.shape())?;
    let name = suffix(q.dtype())?;
    let d_o = d_o.to_dtype(q.dtype())?.contiguous()?;
    let o = o.contiguous()?;
    let guards = [q, k, v, &o, &d_o].map(|x| x.storage_and_layout());
    let [q_, k_, v_, o_, d_o_] = [0, 1, 2, 3, 4].map(|i| view::<T>(&guards[i].0, guards[i].1));
    let (q_, k_, v_, o_, d_o_) = (q_?, k_?, v_?, o_?, d_o_?);
    let (lse_storage, lse_layout) = lse.storage_and_layout();
    let lse_ = view::<f32>(&lse_storage, lse_layout)?;
    let rows = dims.b * dims.heads * dims.t;
    let kv_len = dims.b * dims.kv * dims.t * dims.hd;
    // SAFETY: the dQ kernel writes every row's delta and dQ; the dK/dV kernel every key row's
    // dK and dV.
    let delta = unsafe { dev.alloc::<f32>(rows)? };
    let dq = unsafe { dev.alloc::<T>(rows * dims.hd)? };
    let dk = unsafe { dev.alloc::<T>(kv_len)? };
    let dv = unsafe { dev.alloc::<T>(kv_len)? };
    let [heads, kv, t, hd] = dims.ints();

    let func = dev.get_or_load_custom_func(&format!("attention_backward_q_{name}"), MODULE, PTX)?;
    let mut launch = func.builder();
    launch
        .arg(&q_)
        .arg(&k_)
        .arg(&v_)
        .arg(&o_)
        .arg(&d_o_)
        .arg(&lse_);
    launch.arg(&delta).arg(&dq);
    launch.arg(&heads).arg(&kv).arg(&t).arg(&hd).arg(&scale);
    // SAFETY: as in `forward`.
    unsafe { launch.launch(dims.grid(dims.heads)) }.w()?;

    // Same stream: runs after the dQ kernel has written `delta`.
    let func =
        dev.get_or_load_custom_func(&format!("attention_backward_kv_{name}"), MODULE, PTX)?;
    let mut launch = func.builder();
    launch
        .arg(&q_)
        .arg(&k_)
        .arg(&v_)
        .arg(&d_o_)
        .arg(&lse_)
        .arg(&delta);
    launch.arg(&dk).arg(&dv);
    launch.arg(&heads).arg(&kv).arg(&t).arg(&hd).arg(&scale);
    // SAFETY: as in `forward`.
    unsafe { launch.launch(dims.grid(dims.kv)) }.w()?;

    Ok((
        wrap(dq, &dev, q.shape().clone()),
        wrap(dk, &dev, k.shape().clone()),
        wrap(dv, &dev, v.shape().clone()),
    ))
}

impl CustomOp3 for CudaAttention {
    fn name(&self) -> &'static str {
        "cuda-attention"
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
        bail!("CUDA attention: CUDA only (the CPU has tiled_attention)")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dims = Dims::of(ql.shape(), kl.shape(), vl.shape())?;
        if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
            bail!("CUDA attention: q, k and v differ in dtype")
        }
        for layout in [ql, kl, vl] {
            if !layout.is_contiguous() {
                bail!("CUDA attention: inputs must be contiguous")
            }
        }
        let dev = q.device().clone();
        let (out, lse) = match q.dtype() {
            DType::F32 => {
                forward_storage::<f32>(&dev, [(q, ql), (k, kl), (v, vl)], dims, self.scale)?
            }
            DType::BF16 => {
                forward_storage::<half::bf16>(&dev, [(q, ql), (k, kl), (v, vl)], dims, self.scale)?
            }
            other => bail!("CUDA attention: {other:?} is not supported (f32, bf16)"),
        };
        let lse = wrap(lse, &dev, Shape::from((dims.b, dims.heads, dims.t)));
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(lse);
        Ok((out, ql.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self.lse.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(lse) = lse else {
            bail!("CUDA attention: no forward computed")
        };
        let inputs = [q, k, v, o, d_o];
        let (dq, dk, dv) = match q.dtype() {
            DType::F32 => backward::<f32>(inputs, &lse, self.scale)?,
            DType::BF16 => backward::<half::bf16>(inputs, &lse, self.scale)?,
            other => bail!("CUDA attention: {other:?} is not supported (f32, bf16)"),
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::causal_mask;
    use candle_core::{Device, Var};

    /// Output and gradients of `q`, `k`, `v` against the upstream gradient `up`, all on the CPU
    /// in f32: through the CPU's tiled attention when `gpu` is `None`, else through the kernels
    /// on `gpu` in `dtype`.
    fn run(gpu: Option<(&Device, DType)>, [q, k, v, up]: [&Tensor; 4], scale: f64) -> [Tensor; 4] {
        let (dev, dtype) = gpu.unwrap_or((&Device::Cpu, DType::F32));
        let on = |x: &Tensor| x.to_device(dev).unwrap().to_dtype(dtype).unwrap();
        let [qv, kv, vv] = [q, k, v].map(|x| Var::from_tensor(&on(x)).unwrap());
        let out = match gpu {
            Some(_) => attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), scale).unwrap(),
            None => {
                let mask = causal_mask(q.dim(2).unwrap(), DType::F32, &Device::Cpu).unwrap();
                let (qt, kt, vt) = (qv.as_tensor(), kv.as_tensor(), vv.as_tensor());
                crate::tiled_attention::attention(qt, kt, vt, &mask, scale, 16).unwrap()
            }
        };
        let grads = (&out * on(up))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let back = |x: &Tensor| {
            x.to_dtype(DType::F32)
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap()
        };
        let grad = |x: &Var| back(grads.get(x.as_tensor()).expect("a gradient"));
        [back(&out), grad(&qv), grad(&kv), grad(&vv)]
    }

    /// Largest absolute difference over the largest magnitude of `want`, or over 1 where `want`
    /// is smaller: the inputs are of unit size, and a gradient that is zero up to their rounding
    /// (dQ and dK of a one-token sequence) has no relative error to speak of.
    fn relative(got: &Tensor, want: &Tensor) -> f64 {
        let scale = want.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        let scale = scale
            .to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        crate::test_util::max_diff(got, want) / scale.max(1.0)
    }

    fn inputs(b: usize, heads: usize, kv: usize, t: usize, hd: usize) -> [Tensor; 4] {
        let r = |n: usize| Tensor::randn(0f32, 1.0, (b, n, t, hd), &Device::Cpu).unwrap();
        [r(heads), r(kv), r(kv), r(heads)]
    }

    /// Lengths around the kernels' tiles (32 rows) and blocks (8 rows), heads narrower and wider
    /// than a warp and not a multiple of it, grouped and plain heads: the output and every
    /// gradient equal the CPU's within f32 rounding, and within bf16 rounding for bf16 storage
    /// (against the CPU on the same bf16-rounded inputs).
    #[test]
    fn equals_the_cpu_attention_and_its_gradients() {
        let Some(gpu) = crate::cuda_for_checks(0).unwrap() else {
            return;
        };
        let cases = [
            (1, 4, 2, 1, 8),
            (2, 4, 2, 7, 8),
            (2, 3, 3, 33, 40),
            (1, 4, 1, 31, 64),
            (2, 4, 4, 32, 64),
            (1, 32, 8, 100, 64),
            (2, 8, 2, 257, 128),
            (1, 6, 2, 129, 96),
        ];
        let mut failed = Vec::new();
        for (b, heads, kv, t, hd) in cases {
            let x = inputs(b, heads, kv, t, hd);
            let scale = 1.0 / (hd as f64).sqrt();
            let refs = x.each_ref();
            let want = run(None, refs, scale);
            let got = run(Some((&gpu, DType::F32)), refs, scale);
            let rounded = x.each_ref().map(|y| {
                y.to_dtype(DType::BF16)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
            });
            let want_bf16 = run(None, rounded.each_ref(), scale);
            let got_bf16 = run(Some((&gpu, DType::BF16)), rounded.each_ref(), scale);
            for (i, name) in ["out", "dq", "dk", "dv"].into_iter().enumerate() {
                let case = format!("b {b} heads {heads}/{kv} t {t} hd {hd} {name}");
                assert_eq!(got[i].dims(), want[i].dims(), "{case}");
                let (e32, e16) = (
                    relative(&got[i], &want[i]),
                    relative(&got_bf16[i], &want_bf16[i]),
                );
                eprintln!("{case}: f32 {e32:.2e}, bf16 {e16:.2e}");
                if e32 >= 2e-6 || e16 >= 2e-2 || e32.is_nan() || e16.is_nan() {
                    failed.push(format!("{case}: f32 off by {e32:.2e}, bf16 by {e16:.2e}"));
                }
            }
        }
        assert!(failed.is_empty(), "{failed:#?}");
    }

    /// The same inputs give the same bits, forward and backward, in f32 and bf16.
    #[test]
    fn two_runs_are_bit_identical() {
        let Some(gpu) = crate::cuda_for_checks(0).unwrap() else {
            return;
        };
        let x = inputs(2, 32, 8, 300, 64);
        for dtype in [DType::F32, DType::BF16] {
            let first = run(Some((&gpu, dtype)), x.each_ref(), 0.125);
            let second = run(Some((&gpu, dtype)), x.each_ref(), 0.125);
            for (a, b) in first.iter().zip(&second) {
                let bits = |t: &Tensor| -> Vec<u32> {
                    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    v.into_iter().map(f32::to_bits).collect()
                };
                assert!(bits(a) == bits(b), "{dtype:?}: two runs differ");
            }
        }
    }

    /// Shapes the kernels cannot take are refused with an error, not run out of bounds.
    #[test]
    fn refuses_heads_it_cannot_hold() {
        let Some(gpu) = crate::cuda_for_checks(0).unwrap() else {
            return;
        };
        let wide = Tensor::zeros((1, 2, 4, HEAD_DIM_MAX + 2), DType::F32, &gpu).unwrap();
        assert!(!applies(&wide));
        let err = attention(&wide, &wide, &wide, 1.0).unwrap_err().to_string();
        assert!(err.contains("exceed"), "{err}");
        let q = Tensor::zeros((1, 3, 4, 8), DType::F32, &gpu).unwrap();
        let k = Tensor::zeros((1, 2, 4, 8), DType::F32, &gpu).unwrap();
        let err = attention(&q, &k, &k, 1.0).unwrap_err().to_string();
        assert!(err.contains("evenly"), "{err}");
    }
}
