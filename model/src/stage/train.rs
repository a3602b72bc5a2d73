//! The backward of a stage: the LM head's gradients, accumulation, the training forward and
//! backward (whole or block by block, held or committed).

use rayon::prelude::*;

use super::*;
use crate::gradients::{Gradients, Part};

/// Parameter gradients of one backward, (parameter index, gradient) in the order they are added.
type ParamGrads = Vec<(usize, Tensor)>;

/// Terms of the parameter gradients of one backward, (parameter index, term) in the order they
/// are added.
type ParamParts = Vec<(usize, Part)>;

/// One run's backward: the input's gradient, the parameters', and whether its cache was stale.
struct RunBackward {
    grad_input: Option<Tensor>,
    params: ParamParts,
    stale: bool,
}

impl Stage {
    /// The LM head's backward: its parameter's index, the gradient with respect to `h`, and the
    /// head weight's gradient (not accumulated).
    pub(crate) fn head_gradients(
        &self,
        h: &Tensor,
        targets: &Tensor,
        kept: &HeadCache,
    ) -> Result<(usize, Tensor, Tensor)> {
        let d = self.cfg.d_model;
        let (gh, gw) = loss::ce_backward(
            &h.reshape(((), d))?,
            &self.head_weight()?,
            &targets.flatten_all()?,
            kept,
            self.cfg.loss_vocab_chunk,
            1.0,
        )?;
        let head = self
            .head
            .ok_or_else(|| ModelError::InvalidInput("stage has no LM head".into()))?;
        Ok((head, gh.reshape(h.dims())?, gw))
    }

    /// Add `parts` (parameter index, gradient) to the accumulated gradients: each parameter's in
    /// the order given, different parameters at once (the sums, and so the bits, are those of
    /// adding them one by one).
    pub(crate) fn add_grads(&mut self, parts: Vec<(usize, Tensor)>) -> Result<()> {
        let mut by_param: Vec<Vec<Tensor>> = vec![Vec::new(); self.grads.len()];
        for (i, g) in parts {
            by_param
                .get_mut(i)
                .ok_or_else(|| ModelError::InvalidInput(format!("no parameter {i}")))?
                .push(g.detach());
        }
        self.grads
            .par_iter_mut()
            .zip(by_param)
            .try_for_each(|(acc, gs)| -> Result<()> {
                for g in gs {
                    *acc = Some(match acc.take() {
                        Some(a) => (a + g)?,
                        None => g,
                    });
                }
                Ok(())
            })
    }

    /// The gradients' terms that `grads` holds for this stage's parameters, in parameter
    /// order, detached.
    pub(crate) fn grads_in(&self, grads: &Gradients) -> ParamParts {
        let mut held = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            held.extend(
                grads
                    .parts_of_var(p.var.as_tensor())
                    .into_iter()
                    .map(|g| (i, g)),
            );
        }
        held
    }

    pub(crate) fn count_backward(&mut self, tokens: usize) {
        self.backward_count += 1;
        self.backward_tokens += tokens;
    }

    /// Test hook: replace parameter `i`'s accumulated gradient and count one backward of one
    /// token (so the gradient is used as the mean gradient as given).
    #[cfg(test)]
    pub(crate) fn set_grad_for_test(&mut self, i: usize, g: Tensor) {
        self.grads[i] = Some(g);
        self.backward_count = self.backward_count.max(1);
        self.backward_tokens = self.backward_tokens.max(1);
    }

    pub(super) fn validate_input(&self, input: &Tensor) -> Result<(usize, usize)> {
        if self.is_first() {
            return self.validate_tokens(input, "input tokens");
        }
        let dims = input.dims();
        if dims.len() != 3 {
            return Err(ModelError::shape(
                "input activations [batch, seq, b]",
                &[0, 0, self.cfg.boundary_dim()],
                dims,
            ));
        }
        let (b, t) = (dims[0], dims[1]);
        if b == 0 || t == 0 || t > self.cfg.max_seq_len {
            return Err(ModelError::InvalidInput(format!(
                "input activations have shape {dims:?}; need batch >= 1 and 1 <= seq <= {}",
                self.cfg.max_seq_len
            )));
        }
        self.validate_float(input, &self.input_dims(b, t), "input activations")?;
        Ok((b, t))
    }

    pub(super) fn validate_targets(
        &self,
        targets: Option<&Tensor>,
        b: usize,
        t: usize,
    ) -> Result<Option<Tensor>> {
        match (self.is_last(), targets) {
            (true, Some(tg)) => {
                let dims = self.validate_tokens(tg, "targets")?;
                if dims != (b, t) {
                    return Err(ModelError::shape("targets", &[b, t], tg.dims()));
                }
                Ok(Some(tg.to_device(&self.opts.device)?))
            }
            (true, None) => Err(ModelError::InvalidInput(
                "the last stage needs targets".into(),
            )),
            (false, Some(_)) => Err(ModelError::InvalidInput(
                "only the last stage takes targets".into(),
            )),
            (false, None) => Ok(None),
        }
    }

    /// Forward without a gradient graph (evaluation, validators' loss checks): same validation
    /// and same values as [`Stage::forward`], nothing kept for a backward pass.
    pub fn forward_eval(&self, input: &Tensor, targets: Option<&Tensor>) -> Result<StageOutput> {
        let (b, t) = self.validate_input(input)?;
        let input = input.to_device(&self.opts.device)?;
        let targets = self.validate_targets(targets, b, t)?;
        let out = self.run_inner(&input, false)?;
        Ok(match &targets {
            Some(tg) => StageOutput::Loss(self.head_forward(&out, tg, false)?.0),
            None => StageOutput::Activations(out),
        })
    }

    /// Run the stage on `input` (token ids `[batch, seq]` u32 on stage 0, otherwise the
    /// activation `[batch, seq, bottleneck_dim]` in the param dtype). The last stage needs
    /// `targets` (`[batch, seq]` u32) and returns the loss; other stages must not get targets.
    pub fn forward(
        &self,
        input: &Tensor,
        targets: Option<&Tensor>,
    ) -> Result<(StageOutput, StageCache)> {
        let (b, t) = self.validate_input(input)?;
        let targets = self.validate_targets(targets, b, t)?;
        if self.opts.sub_batches.min(b) <= 1 {
            return self.forward_validated(input, targets);
        }
        let cuts = sub_batch_cuts(b, self.opts.sub_batches);
        let runs: Vec<(StageOutput, StageCache)> =
            crate::product::side_by_side(&cuts, |&(first, n)| {
                let y = match &targets {
                    Some(y) => Some(y.narrow(0, first, n)?),
                    None => None,
                };
                self.forward_validated(&input.narrow(0, first, n)?, y)
            })?;
        let (outputs, caches): (Vec<StageOutput>, Vec<StageCache>) = runs.into_iter().unzip();
        let mut output_dims = caches[0].output_dims.clone();
        output_dims[0] = b;
        let output = match &outputs[0] {
            StageOutput::Activations(_) => {
                let parts = outputs
                    .into_iter()
                    .map(|o| match o {
                        StageOutput::Activations(a) => Ok(a),
                        StageOutput::Loss(_) => Err(ModelError::InvalidInput(
                            "a run of the micro-batch ended in a loss".into(),
                        )),
                    })
                    .collect::<Result<Vec<_>>>()?;
                StageOutput::Activations(Tensor::cat(&parts, 0)?)
            }
            StageOutput::Loss(_) => {
                let losses = outputs
                    .into_iter()
                    .map(|o| match o {
                        StageOutput::Loss(l) => Ok(l),
                        StageOutput::Activations(_) => Err(ModelError::InvalidInput(
                            "a run of the micro-batch ended in activations".into(),
                        )),
                    })
                    .collect::<Result<Vec<_>>>()?;
                StageOutput::Loss(LossOutput {
                    mean: token_weighted_mean(losses.iter().map(|l| (l.mean, l.tokens))),
                    tokens: losses.iter().map(|l| l.tokens).sum(),
                    per_sequence: losses.into_iter().flat_map(|l| l.per_sequence).collect(),
                })
            }
        };
        let cache = StageCache {
            stage_uid: self.uid,
            weights_version: self.weights_version(),
            input: CachedInput::Tokens(input.clone()),
            output: None,
            block_inputs: None,
            targets: None,
            head: None,
            output_dims,
            runs: caches,
        };
        Ok((output, cache))
    }

    /// [`Stage::forward`] of `input` whole, whatever [`StageOptions::sub_batches`] says, once
    /// `input` and `targets` have passed their checks (the caller's, for the whole micro-batch).
    fn forward_validated(
        &self,
        input: &Tensor,
        targets: Option<Tensor>,
    ) -> Result<(StageOutput, StageCache)> {
        let input = input.to_device(&self.opts.device)?;
        let cached_input = if self.is_first() {
            CachedInput::Tokens(input)
        } else {
            CachedInput::Activations(Var::from_tensor(&input)?)
        };
        let graph_input = match &cached_input {
            CachedInput::Tokens(t) => t.clone(),
            CachedInput::Activations(v) => v.as_tensor().clone(),
        };
        let (out, block_inputs) = if self.opts.checkpoint_blocks {
            let xs = self.block_inputs(&graph_input)?;
            (
                self.finish(&xs, false)?,
                (!self.opts.recompute).then_some(xs),
            )
        } else {
            (self.run(&graph_input)?, None)
        };
        let (output, head) = match &targets {
            Some(tg) => {
                let (l, head) = self.head_forward(&out, tg, true)?;
                (StageOutput::Loss(l), Some(head))
            }
            None => (StageOutput::Activations(out.detach()), None),
        };
        let cache = StageCache {
            stage_uid: self.uid,
            weights_version: self.weights_version(),
            input: cached_input,
            output_dims: out.dims().to_vec(),
            output: if self.opts.recompute || self.opts.checkpoint_blocks {
                None
            } else {
                Some(out)
            },
            block_inputs,
            targets,
            head,
            runs: Vec::new(),
        };
        Ok((output, cache))
    }

    /// Back-propagate one micro-batch. `grad_output` is the gradient of the loss with respect to
    /// this stage's output activation (`None` on the last stage, whose output is the loss).
    /// Returns the gradient with respect to the input activation (`None` on stage 0).
    pub fn backward(
        &mut self,
        cache: StageCache,
        grad_output: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        let (grad_input, held) = self.backward_held(cache, grad_output)?;
        self.commit(held)?;
        Ok(grad_input)
    }

    /// [`Stage::backward`] whose parameter gradients are handed back instead of accumulated: the
    /// stage is unchanged until they are given to [`Stage::commit`], and dropping them undoes
    /// the backward. A miner holds a hop's gradients until the orchestrator has recorded the
    /// hop, so that its accumulated gradients are always those of the hops a validator replays.
    pub fn backward_held(
        &mut self,
        cache: StageCache,
        grad_output: Option<&Tensor>,
    ) -> Result<(Option<Tensor>, HeldGradients)> {
        if cache.stage_uid != self.uid {
            return Err(ModelError::InvalidInput(
                "cache was produced by a different stage".into(),
            ));
        }
        let dims = cache.input_dims();
        let tokens = dims[0] * dims[1];
        let (grad_input, parts, stale) = if cache.runs.is_empty() {
            let r = self.backward_run(&cache, grad_output, tokens, false)?;
            (r.grad_input, as_tensors(r.params)?, r.stale)
        } else {
            if let Some(g) = grad_output {
                self.validate_float(g, &cache.output_dims, "output gradient")?;
            }
            let mut first = 0;
            let mut cuts = Vec::with_capacity(cache.runs.len());
            for run in &cache.runs {
                let n = run.input_dims()[0];
                cuts.push((run, first, n));
                first += n;
            }
            let this = &*self;
            let runs = crate::product::side_by_side(&cuts, |&(run, first, n)| {
                let g = match grad_output {
                    Some(g) => Some(g.narrow(0, first, n)?),
                    None => None,
                };
                this.backward_run(run, g.as_ref(), tokens, true)
            })?;
            let mut inputs = Vec::new();
            let mut parts = Vec::new();
            let mut stale = false;
            for r in runs {
                inputs.extend(r.grad_input);
                parts.extend(r.params);
                stale |= r.stale;
            }
            let grad_input = if inputs.is_empty() {
                None
            } else {
                Some(Tensor::cat(&inputs, 0)?)
            };
            (grad_input, sum_runs(parts)?, stale)
        };
        if stale {
            self.stale_recomputes += 1;
            tracing::debug!(
                target: "iota_model::stage",
                stage = self.index,
                cache_version = cache.weights_version,
                weights_version = self.weights_version(),
                "stale cache: recomputing the forward with the current weights"
            );
        }
        let held = HeldGradients {
            stage_uid: self.uid,
            parts,
            tokens,
        };
        Ok((grad_input, held))
    }

    /// The backward of one run's `cache` (the whole micro-batch, or one run of it) whose token
    /// losses the micro-batch's `tokens` average: the input's gradient, the parameters'
    /// gradients in the order they are added, and whether the cache was stale. One of several
    /// runs (`in_runs`) leaves the linear layers' weight gradients as their products' operands,
    /// for [`sum_runs`], unless it checkpoints blocks (which keeps no block's operands).
    fn backward_run(
        &self,
        cache: &StageCache,
        grad_output: Option<&Tensor>,
        tokens: usize,
        in_runs: bool,
    ) -> Result<RunBackward> {
        if !cache.runs.is_empty() {
            return Err(ModelError::InvalidInput(
                "a run's cache holds runs of its own".into(),
            ));
        }
        let graph_input = match &cache.input {
            CachedInput::Tokens(t) => t.clone(),
            CachedInput::Activations(v) => v.as_tensor().clone(),
        };
        // A cache from older weights is recomputed in full (see "Stale caches" above): its
        // graph may see the new weights in place (f32) while its activations are old.
        let stale = cache.weights_version != self.weights_version();
        if self.opts.checkpoint_blocks {
            let xs = match (&cache.block_inputs, stale) {
                (Some(xs), false) => xs.clone(),
                _ => self.block_inputs(&graph_input)?,
            };
            let (grad_input, params) =
                self.backward_by_block(cache, &graph_input, xs, grad_output, stale, tokens)?;
            return Ok(RunBackward {
                grad_input,
                params,
                stale,
            });
        }
        let cached_output = if stale { None } else { cache.output.clone() };
        // Every backward yields gradients of the micro-batch's summed token loss: the last stage
        // differentiates the sum directly; other stages scale the mean-loss gradient they got by
        // the token count. The input gradient is scaled back to the mean before it is returned.
        // Parameter gradients in the order they are added (the head's first, as `backward` and
        // the monolithic pipeline add them).
        let mut parts: ParamParts = Vec::new();
        let surrogate = self.surrogate(
            cache,
            || match cached_output {
                Some(out) => Ok(out),
                None => self.run(&graph_input),
            },
            grad_output,
            stale,
            tokens,
            &mut parts,
        )?;
        let grads = if in_runs {
            Gradients::deferring(&surrogate)?
        } else {
            Gradients::of(&surrogate)?
        };
        parts.extend(self.grads_in(&grads));
        let grad_input = match &cache.input {
            CachedInput::Tokens(_) => None,
            CachedInput::Activations(v) => Some(match grads.get(v.as_tensor()) {
                Some(g) => (g / tokens as f64)?,
                // Unreachable for a real stage, but a zero gradient is the right answer.
                None => v.as_tensor().zeros_like()?,
            }),
        };
        Ok(RunBackward {
            grad_input,
            params: parts,
            stale,
        })
    }

    /// The scalar a backward differentiates, from the stage's `output` (computed only once the
    /// arguments are known good): on the last stage the sum of token losses through the loss
    /// head, whose weight gradient goes to `parts`; elsewhere the output times the gradient the
    /// next stage sent, scaled from its micro-batch mean to the sum.
    pub(super) fn surrogate(
        &self,
        cache: &StageCache,
        output: impl FnOnce() -> Result<Tensor>,
        grad_output: Option<&Tensor>,
        stale: bool,
        tokens: usize,
        parts: &mut ParamParts,
    ) -> Result<Tensor> {
        match (self.is_last(), grad_output) {
            (true, None) => {
                let Some(targets) = &cache.targets else {
                    return Err(ModelError::InvalidInput(
                        "last-stage cache lacks targets".into(),
                    ));
                };
                let h = output()?;
                let kept = match (&cache.head, stale) {
                    (Some(kept), false) => kept.clone(),
                    _ => self.head_forward(&h, targets, true)?.1,
                };
                let (head, gh, gw) = self.head_gradients(&h, targets, &kept)?;
                parts.push((head, Part::Tensor(gw.detach())));
                Ok((h * gh)?.sum_all()?)
            }
            (false, Some(g)) => {
                self.validate_float(g, &cache.output_dims, "output gradient")?;
                let out = output()?;
                let g = g.to_device(&self.opts.device)?.detach();
                Ok(((out * g)?.sum_all()? * tokens as f64)?)
            }
            (true, Some(_)) => Err(ModelError::InvalidInput(
                "the last stage takes no output gradient".into(),
            )),
            (false, None) => Err(ModelError::InvalidInput(
                "a non-last stage needs the output gradient".into(),
            )),
        }
    }

    /// [`Stage::backward_held`] under [`StageOptions::checkpoint_blocks`]: from the top down, the
    /// gradient at each block's output is back-propagated through that block alone, recomputed
    /// from its input `xs[i]`; then through the embedding (stage 0) or out as the input's.
    pub(super) fn backward_by_block(
        &self,
        cache: &StageCache,
        graph_input: &Tensor,
        xs: Vec<Tensor>,
        grad_output: Option<&Tensor>,
        stale: bool,
        tokens: usize,
    ) -> Result<(Option<Tensor>, ParamParts)> {
        let mut parts: ParamParts = Vec::new();
        let top = Var::from_tensor(
            xs.last()
                .ok_or_else(|| ModelError::InvalidInput("no block output".into()))?,
        )?;
        // The same surrogates as the whole-graph backward, on the top block's output.
        let surrogate = self.surrogate(
            cache,
            || self.finish(std::slice::from_ref(top.as_tensor()), true),
            grad_output,
            stale,
            tokens,
            &mut parts,
        )?;
        let grads = Gradients::of(&surrogate)?;
        parts.extend(self.grads_in(&grads));
        let mut g = grads
            .get(top.as_tensor())
            .cloned()
            .ok_or_else(|| ModelError::InvalidInput("no gradient reached the stage".into()))?;
        drop(grads);
        let mask = self.causal_mask(top.dim(1)?)?;
        for (blk, x) in self.blocks.iter().zip(&xs).rev() {
            let input = Var::from_tensor(x)?;
            let y = self.block(blk, input.as_tensor().clone(), Attn::Full(&mask), true)?;
            let grads = Gradients::of(&(y * g.detach())?.sum_all()?)?;
            parts.extend(self.grads_in(&grads));
            g = match grads.get(input.as_tensor()) {
                Some(gi) => gi.clone(),
                None => input.as_tensor().zeros_like()?,
            };
        }
        let grad_input = if self.is_first() {
            let x = self.embed_tokens(graph_input, true)?;
            let grads = Gradients::of(&(x * g.detach())?.sum_all()?)?;
            parts.extend(self.grads_in(&grads));
            None
        } else {
            Some((g / tokens as f64)?)
        };
        Ok((grad_input, parts))
    }

    /// Adds the gradients of one [`Stage::backward_held`] to the accumulated ones (what
    /// [`Stage::backward`] does at once, with the same arithmetic).
    pub fn commit(&mut self, held: HeldGradients) -> Result<()> {
        if held.stage_uid != self.uid {
            return Err(ModelError::InvalidInput(
                "gradients were produced by a different stage".into(),
            ));
        }
        self.add_grads(held.parts)?;
        self.count_backward(held.tokens);
        Ok(())
    }
}

/// Each term as a tensor of its own, in order.
pub(crate) fn as_tensors(parts: ParamParts) -> Result<ParamGrads> {
    Ok(parts
        .into_iter()
        .map(|(i, p)| Ok((i, p.into_tensor()?)))
        .collect::<candle_core::Result<_>>()?)
}

/// The runs' terms of each parameter's gradient summed in run order, one gradient a parameter
/// (in parameter order): each weight's products are added into one buffer
/// ([`crate::gradients::sum_parts`]), the parameters side by side.
pub(crate) fn sum_runs(parts: ParamParts) -> Result<ParamGrads> {
    let mut by_param: std::collections::BTreeMap<usize, Vec<Part>> = Default::default();
    for (i, p) in parts {
        by_param.entry(i).or_default().push(p);
    }
    let groups: Vec<(usize, Vec<Part>)> = by_param.into_iter().collect();
    let sums = crate::product::side_by_side(&groups, |(i, parts)| {
        crate::gradients::sum_parts(parts.clone()).map(|s| s.map(|s| (*i, s)))
    })?;
    Ok(sums.into_iter().flatten().collect())
}
