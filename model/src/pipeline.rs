//! Running all stages of a model in one process: the staged path (stage by stage, with boundary
//! tensors encoded and decoded as they would be on the wire) and the monolithic path (one autograd
//! graph through every stage), which must agree.

use candle_core::Tensor;

use crate::bottleneck::{BoundaryTensor, WireEncoding};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::gradients::Part;
use crate::stage::{LossOutput, Stage, StageCache, StageOptions};

/// Encodings used for the two directions of a stage boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireConfig {
    /// Forward activations.
    pub activations: WireEncoding,
    /// Activation gradients coming back.
    pub gradients: WireEncoding,
}

impl Default for WireConfig {
    fn default() -> Self {
        Self {
            activations: WireEncoding::F32,
            gradients: WireEncoding::F32,
        }
    }
}

impl WireConfig {
    /// Both directions quantised to 8 bits per value.
    pub fn int8() -> Self {
        Self {
            activations: WireEncoding::Int8,
            gradients: WireEncoding::Int8,
        }
    }

    /// Both directions quantised to 4 bits per value.
    pub fn int4() -> Self {
        Self {
            activations: WireEncoding::Int4,
            gradients: WireEncoding::Int4,
        }
    }
}

/// What one staged forward+backward moved and produced.
#[derive(Clone, Debug, PartialEq)]
pub struct StepStats {
    /// Mean cross-entropy of the micro-batch.
    pub loss: f32,
    /// Tokens in the micro-batch.
    pub tokens: usize,
    /// Payload bytes of all forward boundary tensors.
    pub forward_bytes: usize,
    /// Payload bytes of all backward boundary tensors.
    pub backward_bytes: usize,
    /// Encoded (safetensors) bytes actually produced, both directions.
    pub encoded_bytes: usize,
}

/// One run of a cut micro-batch: its mean loss, its tokens, and (when the loss is finite) the
/// LM head's parameter index, that parameter's gradient, and every other gradient.
type RunGradients = (
    f32,
    usize,
    Option<(usize, Tensor, crate::gradients::Gradients)>,
);

/// All stages of one model.
#[derive(Debug)]
pub struct Pipeline {
    stages: Vec<Stage>,
    wire: WireConfig,
}

fn hop(
    t: &Tensor,
    enc: WireEncoding,
    device: &candle_core::Device,
) -> Result<(Tensor, usize, usize)> {
    let bt = BoundaryTensor::from_tensor(t, enc)?;
    let bytes = bt.to_bytes()?;
    let back = BoundaryTensor::from_bytes(&bytes, Some(t.dims()))?;
    let out = back.to_tensor(device)?.to_dtype(t.dtype())?;
    Ok((out, back.payload_bytes(), bytes.len()))
}

impl Pipeline {
    /// Fresh stages of `cfg` with f32 wire encoding.
    pub fn new(cfg: &ModelConfig, opts: &StageOptions) -> Result<Self> {
        Self::from_stages(Stage::all(cfg, opts)?)
    }

    /// Wrap existing stages, which must be stages `0..K` of one config, in order.
    pub fn from_stages(stages: Vec<Stage>) -> Result<Self> {
        let first = stages
            .first()
            .ok_or_else(|| ModelError::InvalidInput("a pipeline needs stages".into()))?;
        let cfg = first.config().clone();
        if stages.len() != cfg.num_stages() {
            return Err(ModelError::InvalidInput(format!(
                "{} stages given, config has {}",
                stages.len(),
                cfg.num_stages()
            )));
        }
        for (k, s) in stages.iter().enumerate() {
            if s.index() != k || *s.config() != cfg {
                return Err(ModelError::InvalidInput(format!(
                    "stage at position {k} is stage {} of config {:?}",
                    s.index(),
                    s.config().name
                )));
            }
        }
        Ok(Self {
            stages,
            wire: WireConfig::default(),
        })
    }

    /// Use `wire` for boundary tensors.
    pub fn with_wire(mut self, wire: WireConfig) -> Self {
        self.wire = wire;
        self
    }

    /// Boundary encodings in use.
    pub fn wire(&self) -> WireConfig {
        self.wire
    }

    /// The model config.
    pub fn config(&self) -> &ModelConfig {
        self.stages[0].config()
    }

    /// The stages.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// The stages, mutably (e.g. for optimizer steps).
    pub fn stages_mut(&mut self) -> &mut [Stage] {
        &mut self.stages
    }

    /// Take the stages back.
    pub fn into_stages(self) -> Vec<Stage> {
        self.stages
    }

    /// Clear accumulated gradients of every stage.
    pub fn zero_grad(&mut self) {
        self.stages.iter_mut().for_each(Stage::zero_grad);
    }

    /// Staged forward and backward of one micro-batch, accumulating every stage's gradients.
    /// Boundary tensors go through the configured wire encoding in both directions. A non-finite
    /// loss is returned without running the backward pass.
    pub fn forward_backward(&mut self, tokens: &Tensor, targets: &Tensor) -> Result<StepStats> {
        let last = self.stages.len() - 1;
        let mut caches: Vec<StageCache> = Vec::with_capacity(self.stages.len());
        let (mut fwd, mut bwd, mut enc) = (0, 0, 0);
        let mut x = tokens.clone();
        let mut loss = f32::NAN;
        for (k, stage) in self.stages.iter().enumerate() {
            let (out, cache) = stage.forward(&x, (k == last).then_some(targets))?;
            caches.push(cache);
            if k == last {
                loss = out.loss()?;
            } else {
                let (next, payload, bytes) = hop(
                    out.activations()?,
                    self.wire.activations,
                    &stage.options().device,
                )?;
                fwd += payload;
                enc += bytes;
                x = next;
            }
        }
        if !loss.is_finite() {
            // Nothing useful can flow back from a NaN/Inf loss; the caller skips the step.
            return Ok(StepStats {
                loss,
                tokens: tokens.elem_count(),
                forward_bytes: fwd,
                backward_bytes: 0,
                encoded_bytes: enc,
            });
        }
        let mut grad: Option<Tensor> = None;
        for (stage, cache) in self.stages.iter_mut().zip(caches).rev() {
            let g_in = stage.backward(cache, grad.as_ref())?;
            grad = match g_in {
                Some(g) => {
                    let (g, payload, bytes) =
                        hop(&g, self.wire.gradients, &stage.options().device)?;
                    bwd += payload;
                    enc += bytes;
                    Some(g)
                }
                None => None,
            };
        }
        Ok(StepStats {
            loss,
            tokens: tokens.elem_count(),
            forward_bytes: fwd,
            backward_bytes: bwd,
            encoded_bytes: enc,
        })
    }

    /// Forward and backward through all stages as one autograd graph (no boundary encoding),
    /// accumulating the same parameter gradients as [`Pipeline::forward_backward`] would (and,
    /// like it, skipping the backward pass when the loss is not finite). The micro-batch is cut
    /// as the first stage's [`StageOptions::sub_batches`] says, one graph per run.
    pub fn forward_backward_monolithic(
        &mut self,
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<f32> {
        let first = &self.stages[0];
        let (b, t) = first.validate_tokens(tokens, "input tokens")?;
        let last = self.stages.len() - 1;
        let dims = self.stages[last].validate_tokens(targets, "targets")?;
        if dims != (b, t) {
            return Err(ModelError::shape("targets", &[b, t], targets.dims()));
        }
        let targets = &targets.to_device(&self.stages[last].options().device)?;
        let cuts = crate::stage::sub_batch_cuts(b, self.stages[0].options().sub_batches);
        let stages = &self.stages;
        let in_runs = cuts.len() > 1;
        let run = |&(start, len): &(usize, usize)| -> Result<RunGradients> {
            let mut x = tokens.narrow(0, start, len)?;
            let y = targets.narrow(0, start, len)?;
            for stage in stages {
                x = stage.run(&x.to_device(&stage.options().device)?)?;
            }
            let (loss, kept) = stages[last].head_forward(&x, &y, true)?;
            if !loss.mean.is_finite() {
                return Ok((loss.mean, loss.tokens, None));
            }
            let (head, gh, gw) = stages[last].head_gradients(&x, &y, &kept)?;
            let surrogate = (x * gh)?.sum_all()?;
            let grads = if in_runs {
                crate::gradients::Gradients::deferring(&surrogate)?
            } else {
                crate::gradients::Gradients::of(&surrogate)?
            };
            Ok((loss.mean, loss.tokens, Some((head, gw, grads))))
        };
        let runs: Vec<RunGradients> = if cuts.len() == 1 {
            vec![run(&cuts[0])?]
        } else {
            crate::product::side_by_side(&cuts, run)?
        };
        if let Some((mean, ..)) = runs.iter().find(|r| !r.0.is_finite()) {
            return Ok(*mean);
        }
        let mean = crate::stage::token_weighted_mean(runs.iter().map(|r| (r.0, r.1)));
        // Each parameter's gradients in run order, the head weight's first in each run.
        let mut parts: Vec<Vec<(usize, Part)>> = vec![Vec::new(); self.stages.len()];
        for (_, _, g) in runs {
            if let Some((head, gw, grads)) = g {
                parts[last].push((head, Part::Tensor(gw)));
                for (stage, p) in self.stages.iter().zip(&mut parts) {
                    p.extend(stage.grads_in(&grads));
                }
            }
        }
        for (stage, p) in self.stages.iter_mut().zip(parts) {
            let grads = if in_runs {
                crate::stage::sum_runs(p)?
            } else {
                crate::stage::as_tensors(p)?
            };
            stage.add_grads(grads)?;
        }
        for stage in &mut self.stages {
            stage.count_backward(b * t);
        }
        Ok(mean)
    }

    /// Mean loss of a batch through the staged path (including wire encoding of activations),
    /// without building a gradient graph or touching gradients.
    pub fn eval_loss(&self, tokens: &Tensor, targets: &Tensor) -> Result<f32> {
        Ok(self.eval(tokens, targets)?.mean)
    }

    /// [`Pipeline::eval_loss`] with the per-sequence losses.
    pub fn eval(&self, tokens: &Tensor, targets: &Tensor) -> Result<LossOutput> {
        let last = self.stages.len() - 1;
        let mut x = tokens.clone();
        for (k, stage) in self.stages.iter().enumerate() {
            let out = stage.forward_eval(&x, (k == last).then_some(targets))?;
            if k == last {
                return Ok(out.loss_output()?.clone());
            }
            x = hop(
                out.activations()?,
                self.wire.activations,
                &stage.options().device,
            )?
            .0;
        }
        Err(ModelError::InvalidInput("empty pipeline".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{Dataset, GrammarCorpus, make_batch};
    use candle_core::{DType, Device};

    fn max_abs(t: &Tensor) -> f32 {
        t.abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    fn check_equivalence(cfg: &ModelConfig) {
        let g = GrammarCorpus::new(2, 24).unwrap();
        let b = make_batch(&g, &[5, 6, 7], &Device::Cpu).unwrap();
        let mut staged = Pipeline::new(cfg, &StageOptions::cpu()).unwrap();
        let mut mono = Pipeline::new(cfg, &StageOptions::cpu()).unwrap();
        // Two micro-batches accumulate the same way in both paths.
        let mut ls = 0.0;
        let mut lm = 0.0;
        for _ in 0..2 {
            ls = staged.forward_backward(&b.inputs, &b.targets).unwrap().loss;
            lm = mono
                .forward_backward_monolithic(&b.inputs, &b.targets)
                .unwrap();
        }
        assert!((ls - lm).abs() < 1e-6, "loss {ls} vs {lm}");
        assert!(
            (ls - (g.vocab_size() as f32).ln()).abs() < 1.0,
            "untrained loss {ls}"
        );
        for (s, m) in staged.stages().iter().zip(mono.stages()) {
            assert_eq!(s.backward_count(), m.backward_count());
            for (i, p) in s.params().iter().enumerate() {
                let (gs, gm) = (s.grad(i).unwrap(), m.grad(i).unwrap());
                let diff = max_abs(&(gs - gm).unwrap());
                let scale = max_abs(gm).max(1e-3);
                assert!(
                    diff <= 1e-5 * scale.max(1.0),
                    "{}: max diff {diff}, scale {scale}",
                    p.name()
                );
            }
        }
    }

    #[test]
    fn staged_equals_monolithic_with_bottleneck() {
        check_equivalence(&ModelConfig::tiny());
    }

    #[test]
    fn staged_equals_monolithic_without_bottleneck_and_uneven_stages() {
        check_equivalence(
            &ModelConfig::tiny()
                .with_bottleneck(32)
                .with_stages(vec![2, 1]),
        );
        check_equivalence(&ModelConfig::tiny().with_stages(vec![1, 2, 1, 1]));
    }

    #[test]
    fn wire_bytes_are_counted() {
        let cfg = ModelConfig::tiny();
        let g = GrammarCorpus::new(2, 10).unwrap();
        let b = make_batch(&g, &[1, 2], &Device::Cpu).unwrap();
        let mut p = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
        let s = p.forward_backward(&b.inputs, &b.targets).unwrap();
        // Two boundaries, 20 tokens, 8 f32 values each way.
        assert_eq!(s.forward_bytes, 2 * 20 * 8 * 4);
        assert_eq!(s.backward_bytes, s.forward_bytes);
        let mut q = Pipeline::new(&cfg, &StageOptions::cpu())
            .unwrap()
            .with_wire(WireConfig::int8());
        let s8 = q.forward_backward(&b.inputs, &b.targets).unwrap();
        assert_eq!(s8.forward_bytes, 2 * 20 * (8 + 4));
        assert!((s8.loss - s.loss).abs() < 0.05);
        assert!(Pipeline::from_stages(vec![]).is_err());
        let stages = Stage::all(&cfg, &StageOptions::cpu())
            .unwrap()
            .into_iter()
            .rev()
            .collect();
        assert!(Pipeline::from_stages(stages).is_err());
    }

    #[cfg(feature = "cuda")]
    fn flat_grads(p: &Pipeline) -> Vec<f32> {
        p.stages()
            .iter()
            .flat_map(|s| {
                (0..s.params().len()).flat_map(move |i| {
                    s.grad(i)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_dtype(DType::F32)
                        .unwrap()
                        .to_device(&Device::Cpu)
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                })
            })
            .collect()
    }

    /// Same micro-batch on the CPU (f32) and on CUDA (f32, then bf16 compute with f32 master
    /// weights): losses and gradients must agree.
    #[cfg(feature = "cuda")]
    #[test]
    fn gpu_matches_cpu() {
        let Some(gpu) = crate::cuda_for_checks(0).unwrap() else {
            return;
        };
        let cfg = ModelConfig::tiny();
        let g = GrammarCorpus::new(2, 24).unwrap();
        let b = make_batch(&g, &[1, 2, 3], &Device::Cpu).unwrap();
        let mut cpu = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
        let lc = cpu.forward_backward(&b.inputs, &b.targets).unwrap().loss;
        let gc = flat_grads(&cpu);
        // (compute, loss tolerance, least gradient cosine, relative gradient error between).
        // Measured on an H200: f32 relative error 1.3e-7 (cosine 1.0), bf16 3.8e-3 (cosine
        // 0.99999298). The lower bound on bf16's error catches a `bf16` that computes in f32.
        let cases = [
            (DType::F32, 1e-4, 0.9999, (0.0, 1e-4)),
            (DType::BF16, 3e-2, 0.98, (1e-4, 0.2)),
        ];
        for (dtype, tol, min_cos, (least_err, most_err)) in cases {
            let opts = StageOptions {
                device: gpu.clone(),
                compute_dtype: dtype,
                ..StageOptions::cpu()
            };
            let mut p = Pipeline::new(&cfg, &opts).unwrap();
            let lg = p.forward_backward(&b.inputs, &b.targets).unwrap().loss;
            assert!((lc - lg).abs() < tol, "{dtype:?}: loss {lg} vs cpu {lc}");
            let gg = flat_grads(&p);
            let dot: f64 = gc
                .iter()
                .zip(&gg)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            let na: f64 = gc.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>().sqrt();
            let nb: f64 = gg.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>().sqrt();
            let diff: f64 = gc
                .iter()
                .zip(&gg)
                .map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2))
                .sum::<f64>()
                .sqrt();
            let (cos, err) = (dot / (na * nb), diff / na);
            eprintln!(
                "{dtype:?} on the GPU against the CPU: loss {lg} vs {lc}, gradient cosine {cos:.9}, relative error {err:.2e}"
            );
            assert!(cos > min_cos, "{dtype:?}: gradient cosine {cos}");
            assert!(
                err >= least_err && err < most_err,
                "{dtype:?}: relative gradient error {err:.2e} outside [{least_err:e}, {most_err:e})"
            );
        }
    }
}
