//! Helpers shared by the unit tests.

use candle_core::{DType, Device, Tensor, Var};

/// The largest absolute difference between two tensors of one shape, in f64.
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    let f64 = |t: &Tensor| t.to_dtype(DType::F64).expect("to f64");
    (f64(a) - f64(b))
        .and_then(|d| d.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>())
        .expect("difference")
}

/// A variable of uniform values in [-1, 1) from `seed`, in `dtype` on the CPU.
pub(crate) fn random_var(dims: &[usize], dtype: DType, seed: u64) -> Var {
    let mut rng = crate::rng::SplitMix64::new(seed);
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.next_f64() * 2.0 - 1.0).collect();
    let t = Tensor::from_vec(v, dims, &Device::Cpu).and_then(|t| t.to_dtype(dtype));
    Var::from_tensor(&t.expect("tensor")).expect("var")
}

/// A tensor's values as f64 bits: exact for f32 and f64, so equal bits are equal values.
pub(crate) fn bits(t: &Tensor) -> Vec<u64> {
    let v = t
        .to_dtype(DType::F64)
        .and_then(|t| t.flatten_all()?.to_vec1::<f64>())
        .expect("values");
    v.into_iter().map(f64::to_bits).collect()
}
