//! Helpers shared by the unit tests.

use candle_core::{DType, Tensor};

/// The largest absolute difference between two tensors of one shape, in f64.
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    let f64 = |t: &Tensor| t.to_dtype(DType::F64).expect("to f64");
    (f64(a) - f64(b))
        .and_then(|d| d.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>())
        .expect("difference")
}
