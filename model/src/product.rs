//! The matrix product every layer and the tiled attention use.

use candle_core::Tensor;

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
