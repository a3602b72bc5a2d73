//! Next-token cross-entropy over the LM head, chunked over the vocabulary.
//!
//! The head is `logits = h @ W^T` with `W: [vocab, d]`. Materialising `[tokens, vocab]` logits
//! (and keeping them alive in an autograd graph) is what makes large vocabularies expensive, so the
//! loss and its gradient are computed by hand, one block of vocabulary rows at a time:
//!
//! * forward: an online log-sum-exp over the blocks, plus the target logit `h . W[target]`;
//! * backward: recompute each block's logits (or take the blocks the forward kept), turn them
//!   into probabilities with the saved log-sum-exp, and accumulate `dL/dh` and the block's rows
//!   of `dL/dW`.
//!
//! Unless the forward keeps its blocks, at most `[tokens, chunk]` logits exist at any time. The
//! loss is the mean over tokens.
//!
//! The matrix products run in the dtype of the head weight passed in (bf16 on a GPU, so the
//! largest product of the model uses tensor cores); logits, log-sum-exp, probabilities and the
//! gradients are f32 (the dtype of `h`). With `w` in the dtype of `h` nothing is cast.

use candle_core::{D, Tensor};

use crate::error::Result;
use crate::fused;
use crate::product::{Bands, constant_product};

/// Result of the forward pass: the mean loss, the per-token losses and what the backward reads.
pub(crate) struct CeForward {
    pub loss: Tensor,
    pub token_losses: Tensor,
    pub head: HeadCache,
}

/// What the backward reads of a forward: the per-token log-sum-exp `[n]`, and the logits'
/// vocabulary blocks if the forward kept them (the backward then does not compute them again:
/// a quarter of the head's products).
#[derive(Clone, Debug)]
pub(crate) struct HeadCache {
    pub lse: Tensor,
    pub logits: Option<Vec<Tensor>>,
}

fn chunks(vocab: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..vocab)
        .step_by(chunk.max(1))
        .map(move |s| (s, chunk.min(vocab - s)))
}

/// Mean cross-entropy of `h: [n, d]` against `targets: [n]` (u32) under head `w: [vocab, d]`
/// (matrix products in `w`'s dtype, everything else in `h`'s), keeping the logits if
/// `keep_logits`. Inputs are treated as constants (no autograd graph is built).
pub(crate) fn ce_forward(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    chunk: usize,
    keep_logits: bool,
) -> Result<CeForward> {
    let (h, w) = (h.detach(), w.detach());
    let acc_dtype = h.dtype();
    // `h` rounded to the product dtype; the target logit below uses the same rounded values.
    let h = h.to_dtype(w.dtype())?;
    let vocab = w.dim(0)?;
    let mut acc: Option<(Tensor, Tensor)> = None;
    let mut kept = Vec::new();
    for (start, len) in chunks(vocab, chunk) {
        let logits = constant_product(&h, &w.narrow(0, start, len)?.t()?)?.to_dtype(acc_dtype)?;
        if keep_logits {
            kept.push(logits.clone());
        }
        if fused::applies(&logits) {
            // One pass per chunk: its row max and the sum of exp relative to that max.
            let (cmax, csum) = fused::row_max_sumexp(&logits)?;
            acc = Some(match acc {
                None => (cmax, csum),
                Some((m, s)) => {
                    let m_new = m.maximum(&cmax)?;
                    let s = ((s * (m - &m_new)?.exp()?)? + (csum * (cmax - &m_new)?.exp()?)?)?;
                    (m_new, s)
                }
            });
            continue;
        }
        let cmax = logits.max_keepdim(D::Minus1)?;
        acc = Some(match acc {
            None => {
                let s = logits.broadcast_sub(&cmax)?.exp()?.sum_keepdim(D::Minus1)?;
                (cmax, s)
            }
            Some((m, s)) => {
                let m_new = m.maximum(&cmax)?;
                let s = ((s * (m - &m_new)?.exp()?)?
                    + logits
                        .broadcast_sub(&m_new)?
                        .exp()?
                        .sum_keepdim(D::Minus1)?)?;
                (m_new, s)
            }
        });
    }
    let (m, s) = acc.ok_or_else(|| crate::error::ModelError::Config("empty vocabulary".into()))?;
    let lse = (m + s.log()?)?.squeeze(D::Minus1)?;
    let target_logit = (h.to_dtype(acc_dtype)?
        * w.index_select(targets, 0)?.to_dtype(acc_dtype)?)?
    .sum(D::Minus1)?;
    let token_losses = (&lse - target_logit)?;
    let loss = token_losses.mean_all()?;
    Ok(CeForward {
        loss,
        token_losses,
        head: HeadCache {
            lse,
            logits: keep_logits.then_some(kept),
        },
    })
}

/// Gradients of `scale * sum_i CE_i` (pass `scale = 1/n` for the mean) with respect to `h` and
/// `w`, given what [`ce_forward`] kept for it (with the same `chunk`).
pub(crate) fn ce_backward(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    head: &HeadCache,
    chunk: usize,
    scale: f64,
) -> Result<(Tensor, Tensor)> {
    let lse = &head.lse;
    let (h, w) = (h.detach(), w.detach());
    let acc = h.dtype();
    let mm = w.dtype();
    let h_mm = h.to_dtype(mm)?;
    let (vocab, width) = w.dims2()?;
    let lse_col = lse.unsqueeze(D::Minus1)?;
    let device = h.device();
    let targets_u32 = targets.to_dtype(candle_core::DType::U32)?;
    let mut grad_h = h.zeros_like()?;
    // Written block by block in place: no list of blocks to concatenate, no copy to add the
    // targets' rows into (for a 1.5B head those were gigabytes each). On the CPU each block's
    // product is written straight into its rows; elsewhere into a zero-filled matrix.
    let mut grad_w = if mm == acc && Bands::apply(&h_mm, &w) {
        HeadGradient::Bands(Bands::new(vocab, width, acc)?)
    } else {
        HeadGradient::Zeroed(Tensor::zeros((vocab, width), acc, device)?)
    };
    let kept = head.logits.as_deref();
    if kept.is_some_and(|k| k.len() != chunks(vocab, chunk).count()) {
        return Err(crate::error::ModelError::InvalidInput(
            "kept logits are not the head's vocabulary blocks".into(),
        ));
    }
    for (c, (start, len)) in chunks(vocab, chunk).enumerate() {
        let wc = w.narrow(0, start, len)?;
        let logits = match kept.and_then(|k| k.get(c)) {
            Some(l) if l.dims() == [h.dim(0)?, len] => l.clone(),
            Some(l) => {
                return Err(crate::error::ModelError::InvalidInput(format!(
                    "kept logits block {c} is {:?}, not the head's vocabulary blocks",
                    l.dims()
                )));
            }
            None => constant_product(&h_mm, &wc.t()?)?.to_dtype(acc)?,
        };
        let probs = if fused::applies(&logits) {
            fused::scaled_probs(&logits, lse, &targets_u32, start, scale)?
        } else {
            let probs = (logits.broadcast_sub(&lse_col)?.exp()? * scale)?;
            // The -1 of the one-hot target, for the targets in this block.
            let ids = Tensor::arange(start as u32, (start + len) as u32, device)?.unsqueeze(0)?;
            let hits = targets_u32
                .unsqueeze(1)?
                .broadcast_eq(&ids)?
                .to_dtype(acc)?;
            (probs - (hits * scale)?)?
        };
        let probs_mm = probs.to_dtype(mm)?;
        grad_h = (grad_h + constant_product(&probs_mm, &wc)?.to_dtype(acc)?)?;
        match &mut grad_w {
            HeadGradient::Bands(bands) => bands.push_product(&probs_mm.t()?, &h_mm)?,
            HeadGradient::Zeroed(grad_w) => {
                let block = constant_product(&probs_mm.t()?, &h_mm)?.to_dtype(acc)?;
                grad_w.slice_set(&block.contiguous()?, 0, start)?;
            }
        }
    }
    let grad_w = match grad_w {
        HeadGradient::Bands(bands) => bands.finish()?,
        HeadGradient::Zeroed(grad_w) => grad_w,
    };
    Ok((grad_h, grad_w))
}

/// The head weight's gradient while the backward writes it block by block.
enum HeadGradient {
    /// On the CPU: each block's product written straight into its rows.
    Bands(Bands),
    /// Elsewhere: a zero-filled matrix each block is copied into.
    Zeroed(Tensor),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::max_diff;
    use candle_core::{DType, Device, Var};

    fn reference(h: &Tensor, w: &Tensor, t: &Tensor) -> (f64, Tensor, Tensor) {
        // Plain autograd over the full logits.
        let hv = Var::from_tensor(h).unwrap();
        let wv = Var::from_tensor(w).unwrap();
        let logits = hv.as_tensor().matmul(&wv.as_tensor().t().unwrap()).unwrap();
        let lse = logits.log_sum_exp(D::Minus1).unwrap();
        let tl = logits
            .gather(&t.unsqueeze(1).unwrap(), 1)
            .unwrap()
            .squeeze(1)
            .unwrap();
        let loss = (lse - tl).unwrap().mean_all().unwrap();
        let g = loss.backward().unwrap();
        (
            loss.to_scalar::<f64>().unwrap(),
            g.get(hv.as_tensor()).unwrap().clone(),
            g.get(wv.as_tensor()).unwrap().clone(),
        )
    }

    /// Products in bf16 (weight passed in bf16), arithmetic in f32: close to the f32 result,
    /// gradients in f32.
    #[test]
    fn bf16_products_stay_close_to_f32() {
        let dev = Device::Cpu;
        let h = Tensor::randn(0f32, 1.0, (9, 16), &dev).unwrap();
        let w = Tensor::randn(0f32, 0.3, (40, 16), &dev).unwrap();
        let t = Tensor::new(&[0u32, 39, 3, 3, 7, 1, 12, 20, 21], &dev).unwrap();
        let f = ce_forward(&h, &w, &t, 16, false).unwrap();
        let (gh, gw) = ce_backward(&h, &w, &t, &f.head, 16, 1.0 / 9.0).unwrap();
        let wb = w.to_dtype(DType::BF16).unwrap();
        let fb = ce_forward(&h, &wb, &t, 16, false).unwrap();
        let (ghb, gwb) = ce_backward(&h, &wb, &t, &fb.head, 16, 1.0 / 9.0).unwrap();
        assert_eq!(
            (fb.loss.dtype(), ghb.dtype(), gwb.dtype()),
            (DType::F32, DType::F32, DType::F32)
        );
        let l = f.loss.to_scalar::<f32>().unwrap();
        let lb = fb.loss.to_scalar::<f32>().unwrap();
        assert!((l - lb).abs() / l < 1e-2, "{l} vs {lb}");
        let rel = |a: &Tensor, b: &Tensor| {
            let d = (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap();
            let m = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
            d.to_scalar::<f32>().unwrap() / m.to_scalar::<f32>().unwrap()
        };
        assert!(rel(&ghb, &gh) < 3e-2 && rel(&gwb, &gw) < 3e-2);
    }

    /// The head's backward holds the weight gradient once, plus a block's worth: building it
    /// from a list of blocks joined at the end and then copied to add the targets' rows held it
    /// three times.
    #[test]
    fn the_head_backward_holds_one_weight_gradient_and_a_block() {
        crate::fused::COMPOSED_ONLY.with(|c| c.set(false));
        let dev = Device::Cpu;
        let (n, d, vocab, chunk) = (16, 64, 4096, 256);
        let h = Tensor::randn(0f32, 1.0, (n, d), &dev).unwrap();
        let w = Tensor::randn(0f32, 0.1, (vocab, d), &dev).unwrap();
        let t = Tensor::arange(0u32, n as u32, &dev)
            .unwrap()
            .affine(250.0, 3.0)
            .unwrap();
        let f = ce_forward(&h, &w, &t, chunk, false).unwrap();
        // Once before measuring: the matrix products keep per-thread packing buffers after their
        // first call, larger on machines with more cores (on a 16-core machine the first call's
        // peak was 3.3 MB here), which are not the head's to account for.
        drop(ce_backward(&h, &w, &t, &f.head, chunk, 1.0 / n as f64).unwrap());
        let (grads, peak) = crate::alloc_count::peak_during(|| {
            ce_backward(&h, &w, &t, &f.head, chunk, 1.0 / n as f64).unwrap()
        });
        let grad_w_bytes = vocab * d * 4;
        let block_bytes = n * chunk * 4 + chunk * d * 4;
        assert!(
            peak <= grad_w_bytes + 8 * block_bytes,
            "peak {peak} bytes for a {grad_w_bytes}-byte weight gradient and {block_bytes}-byte blocks"
        );
        drop(grads);
    }

    #[test]
    fn chunked_matches_full_for_any_chunk() {
        let dev = Device::Cpu;
        let h = Tensor::randn(0f64, 1.0, (7, 5), &dev).unwrap();
        let w = Tensor::randn(0f64, 1.0, (13, 5), &dev).unwrap();
        let t = Tensor::new(&[0u32, 12, 3, 3, 7, 1, 12], &dev).unwrap();
        let (l_ref, gh_ref, gw_ref) = reference(&h, &w, &t);
        // The fused kernels (the CPU's path) and the composed ops (every other device's).
        for composed in [false, true] {
            crate::fused::COMPOSED_ONLY.with(|c| c.set(composed));
            for chunk in [1, 4, 13, 100] {
                let f = ce_forward(&h, &w, &t, chunk, false).unwrap();
                let l = f.loss.to_scalar::<f64>().unwrap();
                let case = format!("composed {composed}, chunk {chunk}");
                assert!((l - l_ref).abs() < 1e-12, "{case}: {l} vs {l_ref}");
                let (gh, gw) = ce_backward(&h, &w, &t, &f.head, chunk, 1.0 / 7.0).unwrap();
                assert!(max_diff(&gh, &gh_ref) < 1e-12, "{case}");
                assert!(max_diff(&gw, &gw_ref) < 1e-12, "{case}");
                assert_eq!(gw.dtype(), DType::F64);
            }
        }
        crate::fused::COMPOSED_ONLY.with(|c| c.set(false));
    }

    /// Logits kept by the forward give the backward the bits of recomputing them, at every
    /// block size; blocks of another cut are refused.
    #[test]
    fn kept_logits_give_the_recomputed_bits() {
        let dev = Device::Cpu;
        let h = Tensor::randn(0f32, 1.0, (9, 6), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (23, 6), &dev).unwrap();
        let t = Tensor::new(&[0u32, 22, 5, 5, 11, 1, 22, 16, 8], &dev).unwrap();
        for chunk in [1, 5, 23, 64] {
            let kept = ce_forward(&h, &w, &t, chunk, true).unwrap();
            let plain = ce_forward(&h, &w, &t, chunk, false).unwrap();
            assert!(plain.head.logits.is_none());
            assert_eq!(max_diff(&kept.loss, &plain.loss), 0.0);
            let a = ce_backward(&h, &w, &t, &kept.head, chunk, 0.1).unwrap();
            let b = ce_backward(&h, &w, &t, &plain.head, chunk, 0.1).unwrap();
            assert_eq!(max_diff(&a.0, &b.0), 0.0, "chunk {chunk}");
            assert_eq!(max_diff(&a.1, &b.1), 0.0, "chunk {chunk}");
        }
        let kept = ce_forward(&h, &w, &t, 5, true).unwrap();
        let err = ce_backward(&h, &w, &t, &kept.head, 4, 0.1).unwrap_err();
        assert!(err.to_string().contains("vocabulary blocks"), "{err}");
    }
}
