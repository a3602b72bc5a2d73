//! The forward computation of a stage: weights in the compute dtype, blocks, the causal mask,
//! cached generation and the LM head's forward.

use super::*;

impl Stage {
    /// Parameter `i` in the compute dtype; detached (no gradient graph) unless `track`.
    pub(super) fn weight(&self, i: usize, track: bool) -> Result<Tensor> {
        let t = self.params[i].var.as_tensor();
        if t.dtype() == self.opts.compute_dtype {
            return Ok(if track { t.clone() } else { t.detach() });
        }
        // The cast copies keep their link to the f32 variables, so gradients still reach the
        // master weights; every weight change bumps the version and invalidates them.
        let version = self.weights_version();
        let mut slot = self
            .compute_weights
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let fresh = matches!(slot.as_ref(), Some((v, _)) if *v == version);
        if !fresh {
            let cast = self
                .params
                .iter()
                .map(|p| Ok(p.var.as_tensor().to_dtype(self.opts.compute_dtype)?))
                .collect::<Result<Vec<_>>>()?;
            *slot = Some((version, cast));
        }
        let w = slot
            .as_ref()
            .and_then(|(_, ws)| ws.get(i))
            .ok_or_else(|| ModelError::InvalidInput(format!("no parameter {i}")))?;
        Ok(if track { w.clone() } else { w.detach() })
    }

    pub(crate) fn validate_tokens(&self, tokens: &Tensor, what: &str) -> Result<(usize, usize)> {
        if tokens.dtype() != DType::U32 {
            return Err(ModelError::DType {
                what: what.into(),
                expected: DType::U32,
                got: tokens.dtype(),
            });
        }
        let (b, t) = tokens.dims2().map_err(|_| {
            ModelError::shape(format!("{what} [batch, seq]"), &[0, 0], tokens.dims())
        })?;
        if b == 0 || t == 0 || t > self.cfg.max_seq_len {
            return Err(ModelError::InvalidInput(format!(
                "{what} has shape [{b}, {t}]; need batch >= 1 and 1 <= seq <= {}",
                self.cfg.max_seq_len
            )));
        }
        let max = tokens.flatten_all()?.max(0)?.to_scalar::<u32>()?;
        if max as usize >= self.cfg.vocab_size {
            return Err(ModelError::TokenOutOfRange {
                id: max,
                vocab_size: self.cfg.vocab_size,
            });
        }
        Ok((b, t))
    }

    pub(super) fn validate_float(&self, t: &Tensor, dims: &[usize], what: &str) -> Result<()> {
        if t.dtype() != self.opts.param_dtype {
            return Err(ModelError::DType {
                what: what.into(),
                expected: self.opts.param_dtype,
                got: t.dtype(),
            });
        }
        if t.dims() != dims {
            return Err(ModelError::shape(what, dims, t.dims()));
        }
        check_finite(t, what)
    }

    /// Embedding lookup (stage 0).
    pub(super) fn embed_tokens(&self, tokens: &Tensor, track: bool) -> Result<Tensor> {
        let idx = self
            .embed
            .ok_or_else(|| ModelError::InvalidInput("stage has no embedding".into()))?;
        let (b, t) = tokens.dims2()?;
        let x = self
            .master(idx, track)
            .index_select(&tokens.flatten_all()?, 0)?;
        Ok(x.reshape((b, t, self.cfg.d_model))?)
    }

    /// The master-weight copy of parameter `i` (param dtype), detached unless `track`.
    pub(super) fn master(&self, i: usize, track: bool) -> Tensor {
        let t = self.params[i].var.as_tensor();
        if track { t.clone() } else { t.detach() }
    }

    /// RMSNorm computed in the param dtype (f32 under bf16 compute: a mean of squares in bf16
    /// loses too much), returned in the compute dtype for the matrix products that follow.
    pub(super) fn norm(&self, x: &Tensor, i: usize, track: bool) -> Result<Tensor> {
        let y = layers::rms_norm(
            &x.to_dtype(self.opts.param_dtype)?,
            &self.master(i, track),
            self.cfg.norm_eps,
        )?;
        Ok(y.to_dtype(self.opts.compute_dtype)?)
    }

    /// One block. The residual stream `x` stays in the param dtype (f32 when computing in
    /// bf16); the branches run in the compute dtype and are added back in the param dtype.
    pub(super) fn block(
        &self,
        blk: &BlockIdx,
        x: Tensor,
        attn: Attn<'_>,
        track: bool,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (d, b) = (cfg.d_model, cfg.bottleneck_dim);
        let (pd, cd) = (self.opts.param_dtype, self.opts.compute_dtype);
        // Receiving side of the bottleneck: decode b -> d for attention; the incoming b-vector
        // is the residual of the first b channels.
        let (x, skip) = match blk.decoder {
            Some(i) => (
                layers::linear(&x.to_dtype(cd)?, &self.weight(i, track)?)?
                    .relu()?
                    .to_dtype(pd)?,
                Some(x),
            ),
            None => (x, None),
        };
        let attn_in = self.norm(&x, blk.attn_norm, track)?;
        let weights = [blk.wq, blk.wk, blk.wv, blk.wo]
            .iter()
            .map(|i| self.weight(*i, track))
            .collect::<Result<Vec<_>>>()?;
        let w = AttnWeights {
            wq: &weights[0],
            wk: &weights[1],
            wv: &weights[2],
            wo: &weights[3],
        };
        let a = match attn {
            Attn::Full(mask) => layers::attention(&attn_in, &w, cfg, &self.rope, mask)?,
            Attn::Cached(kv) => layers::attention_cached(&attn_in, &w, cfg, &self.rope, kv)?,
        }
        .to_dtype(pd)?;
        let h = match skip {
            Some(z) => (a + z.pad_with_zeros(D::Minus1, 0, d - b)?)?,
            None => (x + a)?,
        };
        let f = layers::swiglu(
            &self.norm(&h, blk.ffn_norm, track)?,
            &self.weight(blk.w_gate, track)?,
            &self.weight(blk.w_up, track)?,
            &self.weight(blk.w_down, track)?,
        )?;
        match blk.encoder {
            // Sending side: project d -> b and carry the first b residual channels through.
            Some(i) => Ok(
                (layers::linear(&f.silu()?, &self.weight(i, track)?)?.to_dtype(pd)?
                    + h.narrow(D::Minus1, 0, b)?)?,
            ),
            None => Ok((h + f.to_dtype(pd)?)?),
        }
    }

    /// The stage's differentiable computation from an already validated input (tokens for stage
    /// 0, activations otherwise) to its boundary output, or to the final-normed hidden state
    /// `[batch, seq, d]` on the last stage. Outputs are in the param dtype.
    pub(crate) fn run(&self, input: &Tensor) -> Result<Tensor> {
        self.run_inner(input, true)
    }

    /// The `[t, t]` causal mask, rebuilt only when the sequence length changes.
    pub(super) fn causal_mask(&self, t: usize) -> Result<Tensor> {
        // A poisoned lock only means another thread panicked mid-update; the cache is still a
        // valid mask or empty, so recover it.
        let mut slot = self.mask.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = slot.as_ref()
            && m.dim(0)? == t
        {
            return Ok(m.clone());
        }
        // Scores are masked in f32 under half-precision compute (see `layers::attention`).
        let dtype = match self.opts.compute_dtype {
            DType::BF16 | DType::F16 => DType::F32,
            other => other,
        };
        let m = layers::causal_mask(t, dtype, &self.opts.device)?;
        *slot = Some(m.clone());
        Ok(m)
    }

    /// [`Stage::run`], building the gradient graph only if `track`.
    pub(super) fn run_inner(&self, input: &Tensor, track: bool) -> Result<Tensor> {
        // The residual stream is kept in the param dtype (see `block`).
        let mut x = if self.is_first() {
            self.embed_tokens(input, track)?
        } else {
            input.clone()
        };
        let mask = self.causal_mask(x.dim(1)?)?;
        for blk in &self.blocks {
            x = self.block(blk, x, Attn::Full(&mask), track)?;
        }
        if let Some(i) = self.norm {
            x = layers::rms_norm(&x, &self.master(i, track), self.cfg.norm_eps)?;
        }
        Ok(x)
    }

    /// Without a graph: the input of every block and the last block's output (`blocks + 1`
    /// tensors in the param dtype), from a validated input.
    pub(super) fn block_inputs(&self, input: &Tensor) -> Result<Vec<Tensor>> {
        let mut x = if self.is_first() {
            self.embed_tokens(input, false)?
        } else {
            input.detach()
        };
        let mask = self.causal_mask(x.dim(1)?)?;
        let mut xs = Vec::with_capacity(self.blocks.len() + 1);
        for blk in &self.blocks {
            xs.push(x.clone());
            x = self.block(blk, x, Attn::Full(&mask), false)?;
        }
        xs.push(x);
        Ok(xs)
    }

    /// The stage's output from [`Stage::block_inputs`]: the last block's output, final-normed
    /// on the last stage.
    pub(super) fn finish(&self, xs: &[Tensor], track: bool) -> Result<Tensor> {
        let x = xs
            .last()
            .ok_or_else(|| ModelError::InvalidInput("no block output".into()))?;
        Ok(match self.norm {
            Some(i) => layers::rms_norm(x, &self.master(i, track), self.cfg.norm_eps)?,
            None => x.clone(),
        })
    }

    /// Blocks of this stage.
    pub(crate) fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Generation: the stage on `n` new positions (token ids `[batch, n]` on stage 0, boundary
    /// activations `[batch, n, b]` otherwise) whose earlier positions are in `caches`, one per
    /// block; appends the new keys and values. The arithmetic is the evaluation forward's except
    /// that attention reads the cache. Returns what [`Stage::run`] returns for those positions.
    pub(crate) fn run_cached(&self, input: &Tensor, caches: &mut [KvCache]) -> Result<Tensor> {
        if caches.len() != self.blocks.len() {
            return Err(ModelError::InvalidInput(format!(
                "{} key/value caches for {} blocks",
                caches.len(),
                self.blocks.len()
            )));
        }
        let past = caches.first().map_or(0, KvCache::len);
        let (b, n) = match input.dims() {
            [b, n] | [b, n, _] => (*b, *n),
            dims => return Err(ModelError::shape("generation input", &[0, 0], dims)),
        };
        if b == 0 || n == 0 || past + n > self.cfg.max_seq_len {
            return Err(ModelError::InvalidInput(format!(
                "{n} new positions after {past} in a batch of {b}: need batch >= 1 and \
                 1 <= positions <= max_seq_len {}",
                self.cfg.max_seq_len
            )));
        }
        let input = input.to_device(&self.opts.device)?;
        let mut x = if self.is_first() {
            self.validate_tokens(&input, "input tokens")?;
            self.embed_tokens(&input, false)?
        } else {
            self.validate_float(&input, &self.input_dims(b, n), "input activations")?;
            input
        };
        for (blk, kv) in self.blocks.iter().zip(caches.iter_mut()) {
            x = self.block(blk, x, Attn::Cached(kv), false)?;
        }
        if let Some(i) = self.norm {
            x = layers::rms_norm(&x, &self.master(i, false), self.cfg.norm_eps)?;
        }
        Ok(x)
    }

    /// Logits `[batch, n, vocab]` in the param dtype of final hidden states `h: [batch, n, d]`
    /// (last stage): `h @ head^T`, the product in the dtype the loss uses for it.
    pub(crate) fn logits(&self, h: &Tensor) -> Result<Tensor> {
        let w = self.head_weight()?;
        let y = layers::linear(&h.to_dtype(w.dtype())?, &w)?;
        Ok(y.to_dtype(self.opts.param_dtype)?)
    }

    /// The last stage's evaluation forward on a whole sequence, ending in the logits of its last
    /// `n` positions instead of the loss (the training path is untouched).
    pub(crate) fn last_logits(&self, input: &Tensor, n: usize) -> Result<Tensor> {
        if !self.is_last() {
            return Err(ModelError::InvalidInput(
                "only the last stage computes logits".into(),
            ));
        }
        let (_, t) = self.validate_input(input)?;
        if n == 0 || n > t {
            return Err(ModelError::InvalidInput(format!(
                "logits of the last {n} of {t} positions"
            )));
        }
        let h = self.run_inner(&input.to_device(&self.opts.device)?, false)?;
        self.logits(&h.narrow(1, t - n, n)?)
    }

    /// The LM head weight in the compute dtype (the cached cast under bf16), for the head's
    /// matrix products; the loss arithmetic stays in the param dtype.
    pub(super) fn head_weight(&self) -> Result<Tensor> {
        let i = self
            .head
            .ok_or_else(|| ModelError::InvalidInput("stage has no LM head".into()))?;
        self.weight(i, false)
    }

    /// Loss report of the final hidden state `h: [batch, seq, d]`, and what the head's backward
    /// reads: the logits too if `train` and [`Stage::keeps_logits`] says so.
    pub(crate) fn head_forward(
        &self,
        h: &Tensor,
        targets: &Tensor,
        train: bool,
    ) -> Result<(LossOutput, HeadCache)> {
        let d = self.cfg.d_model;
        let (b, t) = targets.dims2()?;
        let f = loss::ce_forward(
            &h.reshape(((), d))?,
            &self.head_weight()?,
            &targets.flatten_all()?,
            self.cfg.loss_vocab_chunk,
            train && self.keeps_logits(b * t),
        )?;
        let mean = f.loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let per_sequence = f
            .token_losses
            .reshape((b, t))?
            .mean(1)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        let out = LossOutput {
            mean,
            per_sequence,
            tokens: b * t,
        };
        Ok((out, f.head))
    }

    /// Whether a training forward of `tokens` keeps the head's logits for the backward: unless
    /// the stage recomputes to save memory, and only up to [`KEPT_LOGITS_MAX_BYTES`].
    pub(crate) fn keeps_logits(&self, tokens: usize) -> bool {
        let bytes = kept_logits_bytes(
            tokens,
            self.cfg.vocab_size,
            self.opts.param_dtype.size_in_bytes(),
        );
        !self.opts.recompute && bytes > 0
    }
}
