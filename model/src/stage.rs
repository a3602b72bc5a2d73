//! One pipeline stage: a contiguous run of blocks plus, at the ends of the pipeline, the embedding
//! or the final norm, LM head and loss.
//!
//! API contract (what a miner runs and a validator re-runs):
//!
//! * [`Stage::forward`] takes token ids (stage 0) or the previous stage's boundary activation and
//!   returns this stage's boundary activation, or the loss on the last stage, plus a
//!   [`StageCache`];
//! * [`Stage::backward`] takes that cache and the gradient of the loss with respect to the output
//!   (none on the last stage), accumulates parameter gradients, and returns the gradient with
//!   respect to the input activation (none on stage 0).
//!
//! The upstream gradient is injected by back-propagating `sum(output * grad.detach())`, whose
//! gradient with respect to everything upstream of `output` is exactly the vector-Jacobian
//! product. With recomputation on, the cache keeps only the input and backward redoes the forward.
//!
//! # Stale caches
//!
//! Optimizer steps (and [`crate::merge::load_range`], checkpoint loads, ...) change the weights in
//! place. Every change bumps the stage's [weights version](Stage::weights_version), and every
//! cache records the version its forward ran with. A backward on a cache whose version is not
//! the current one does a **full recompute**: the forward (and, on the last stage, the loss with
//! its log-sum-exp) is redone from the cached input with the current weights, and the gradient is
//! that of the recomputed graph. It never mixes activations of old weights with new weights, in
//! f32 (where an in-place update is visible to a cached graph) as in bf16 (where the cached graph
//! holds old weight copies): both behave the same.
//!
//! Why recompute rather than an error: a miner has many samples in flight and takes a local step
//! every few backward passes, so an error would throw away most in-flight work at every step;
//! keeping a copy of the weights per outstanding version (weight stashing) costs a full stage copy
//! per step, impossible at 15B. The recompute costs one extra forward and is exactly reproducible
//! by a validator replaying the same order of hops. The gradient of a non-last stage is then the
//! vector-Jacobian product at the current weights with the downstream gradient that was computed
//! from the old output, the usual one-step staleness of asynchronous pipelines.
//! [`Stage::stale_recomputes`] counts how often it happened.
//!
//! # Loss scaling
//!
//! The last stage's loss is the mean next-token cross-entropy over the micro-batch's tokens, and
//! the gradient that crosses a boundary is the gradient of that micro-batch mean. The parameter
//! gradients a stage accumulates are those of the **sum** of token losses (each backward scales by
//! its micro-batch's token count), and [`Stage::backward_tokens`] counts the tokens, so
//! [`crate::optim::AdamW`] divides by the total and steps on the true token mean over all
//! micro-batches, whatever their sizes. [`Stage::mean_grad`] gives that mean gradient.

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{D, DType, Device, Tensor, Var};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::layers::{self, AttnWeights, KvCache, Rope};
use crate::loss::{self, HeadCache};
use crate::rng::SplitMix64;

mod compute;
mod train;
pub(crate) use train::{as_tensors, sum_runs};

/// Device and precision of a stage.
#[derive(Clone, Debug)]
pub struct StageOptions {
    /// Where weights and activations live.
    pub device: Device,
    /// Dtype of the trainable (master) weights, of boundary tensors and of the loss: F32, or F64
    /// for numerical checks.
    pub param_dtype: DType,
    /// Dtype of the block arithmetic: the param dtype, or BF16/F16 on a GPU. Weights are cast on
    /// the fly, so master weights and optimizer moments stay in `param_dtype`.
    pub compute_dtype: DType,
    /// Keep only the input in the cache and redo the forward in backward, bounding memory.
    pub recompute: bool,
    /// Activation checkpointing per block: the forward keeps each block's input and no graph,
    /// and the backward recomputes the blocks one at a time, last first, so that at most one
    /// block's graph exists (with `recompute`, the block inputs too are recomputed). The
    /// gradients are those of the whole graph.
    pub checkpoint_blocks: bool,
    /// Runs a micro-batch is cut into: runs of consecutive sequences (as even as they divide,
    /// at most one per sequence), each forward and backward through its own graph on the
    /// thread pool, their gradients added in order. Runs side by side keep the cores busier
    /// than one run's products and element-wise operations split across them; the cut follows
    /// this number alone, never the thread count, so any number of threads adds the same
    /// bits. Against the uncut micro-batch the gradients differ by f32 rounding (each sum over
    /// tokens is split). 1: the micro-batch whole.
    pub sub_batches: usize,
}

impl Default for StageOptions {
    fn default() -> Self {
        Self::cpu()
    }
}

impl StageOptions {
    /// f32 on the CPU, no recomputation.
    pub fn cpu() -> Self {
        Self {
            device: Device::Cpu,
            param_dtype: DType::F32,
            compute_dtype: DType::F32,
            recompute: false,
            checkpoint_blocks: false,
            sub_batches: 1,
        }
    }

    /// CUDA device 0 with bf16 compute when built with the `cuda` feature and a GPU is present,
    /// otherwise [`StageOptions::cpu`].
    pub fn best_available() -> Result<Self> {
        let device = Device::cuda_if_available(0)?;
        let compute_dtype = if device.is_cuda() {
            DType::BF16
        } else {
            DType::F32
        };
        Ok(Self {
            device,
            compute_dtype,
            ..Self::cpu()
        })
    }

    fn validate(&self, allow_cpu_half: bool) -> Result<()> {
        if self.sub_batches == 0 {
            return Err(ModelError::Config("sub_batches must be at least 1".into()));
        }
        // Runs side by side keep CPU cores busy; on a GPU they would only share its stream.
        if self.sub_batches > 1 && !self.device.is_cpu() {
            return Err(ModelError::Config(format!(
                "sub_batches {} is for the CPU; on a GPU use 1",
                self.sub_batches
            )));
        }
        if !matches!(self.param_dtype, DType::F32 | DType::F64) {
            return Err(ModelError::Config(format!(
                "param_dtype must be F32 or F64, got {:?}",
                self.param_dtype
            )));
        }
        let ok = self.compute_dtype == self.param_dtype
            || (self.param_dtype == DType::F32
                && matches!(self.compute_dtype, DType::BF16 | DType::F16));
        if !ok {
            return Err(ModelError::Config(format!(
                "compute_dtype {:?} is not allowed with param_dtype {:?}",
                self.compute_dtype, self.param_dtype
            )));
        }
        if !allow_cpu_half
            && self.device.is_cpu()
            && matches!(self.compute_dtype, DType::BF16 | DType::F16)
        {
            // candle's CPU half-precision kernels are slow and not what a GPU computes, so a
            // CPU run would be both useless for speed and a bad replay of a GPU miner.
            return Err(ModelError::Config(format!(
                "compute_dtype {:?} needs a CUDA device (build with the `cuda` feature); on the \
                 CPU use F32",
                self.compute_dtype
            )));
        }
        Ok(())
    }
}

/// A trainable tensor of a stage.
#[derive(Clone)]
pub struct Param {
    name: String,
    var: Var,
    decay: bool,
}

impl Param {
    /// Canonical name, e.g. `blocks.3.attn.wq`.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The variable (master weights).
    pub fn var(&self) -> &Var {
        &self.var
    }
    /// Whether weight decay applies (matrices yes; norm gains no).
    pub fn decay(&self) -> bool {
        self.decay
    }
}

impl std::fmt::Debug for Param {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Param({}, {:?})", self.name, self.var.dims())
    }
}

/// How a block's attention sees the sequence: the whole sequence under a causal mask
/// (training, evaluation), or new positions against a key/value cache (generation).
enum Attn<'a> {
    Full(&'a Tensor),
    Cached(&'a mut KvCache),
}

/// Indices into `Stage::params` for one block.
#[derive(Debug, Clone)]
struct BlockIdx {
    decoder: Option<usize>,
    attn_norm: usize,
    wq: usize,
    wk: usize,
    wv: usize,
    wo: usize,
    ffn_norm: usize,
    w_gate: usize,
    w_up: usize,
    w_down: usize,
    encoder: Option<usize>,
}

/// The last stage's loss for one micro-batch.
#[derive(Debug, Clone, PartialEq)]
pub struct LossOutput {
    /// Mean next-token cross-entropy over all tokens of the micro-batch.
    pub mean: f32,
    /// Mean cross-entropy of each sequence (row of the batch), in batch order: what CLASP
    /// attributes to the pathway of each sample.
    pub per_sequence: Vec<f32>,
    /// Tokens in the micro-batch (`batch * seq`).
    pub tokens: usize,
}

/// The mean over every token of runs' mean losses `(mean, tokens)`, each weighted by its tokens.
/// Exact for one run: a mean of f32 times at most 2^31 tokens is exact in f64.
pub(crate) fn token_weighted_mean(runs: impl IntoIterator<Item = (f32, usize)>) -> f32 {
    let (mut sum, mut tokens) = (0f64, 0usize);
    for (mean, n) in runs {
        sum += f64::from(mean) * n as f64;
        tokens += n;
    }
    (sum / tokens.max(1) as f64) as f32
}

/// What [`Stage::forward`] produced.
#[derive(Debug, Clone)]
pub enum StageOutput {
    /// Boundary activation `[batch, seq, bottleneck_dim]` in the param dtype, detached.
    Activations(Tensor),
    /// Next-token cross-entropy (last stage).
    Loss(LossOutput),
}

impl StageOutput {
    /// The activation, or an error on the last stage.
    pub fn activations(&self) -> Result<&Tensor> {
        match self {
            Self::Activations(t) => Ok(t),
            Self::Loss(_) => Err(ModelError::InvalidInput(
                "the last stage outputs a loss".into(),
            )),
        }
    }
    /// The mean loss, or an error on a non-last stage.
    pub fn loss(&self) -> Result<f32> {
        Ok(self.loss_output()?.mean)
    }
    /// Per-sequence mean losses, or an error on a non-last stage.
    pub fn sequence_losses(&self) -> Result<&[f32]> {
        Ok(&self.loss_output()?.per_sequence)
    }
    /// The full loss report, or an error on a non-last stage.
    pub fn loss_output(&self) -> Result<&LossOutput> {
        match self {
            Self::Loss(l) => Ok(l),
            Self::Activations(_) => Err(ModelError::InvalidInput(
                "only the last stage outputs a loss".into(),
            )),
        }
    }
}

/// The largest logits (bytes) a last stage keeps from a training forward for its backward,
/// which then skips a quarter of the head's products: `small`'s at 4x128 are 16 MiB; an
/// `iota-1.5b` micro-batch's (4x800 tokens, 128,256 entries) are 1.6 GB and are recomputed
/// block by block instead.
pub const KEPT_LOGITS_MAX_BYTES: u64 = 64 << 20;

/// Bytes of the logits a training forward of `tokens` keeps (0: not kept), with `float_bytes` a
/// value: the rule of [`KEPT_LOGITS_MAX_BYTES`], for the stage and the memory equation.
pub(crate) fn kept_logits_bytes(tokens: usize, vocab: usize, float_bytes: usize) -> u64 {
    let bytes = tokens as u64 * vocab as u64 * float_bytes as u64;
    if bytes <= KEPT_LOGITS_MAX_BYTES {
        bytes
    } else {
        0
    }
}

/// State kept between forward and backward of one micro-batch.
pub struct StageCache {
    stage_uid: u64,
    /// [`Stage::weights_version`] the forward ran with.
    weights_version: u64,
    /// Token ids (stage 0) or the input activation as a variable (so its gradient is recorded).
    input: CachedInput,
    /// Output of the block stack with its graph; `None` when recomputing.
    output: Option<Tensor>,
    /// Under [`StageOptions::checkpoint_blocks`] without `recompute`: each block's input and the
    /// last block's output, without graphs.
    block_inputs: Option<Vec<Tensor>>,
    targets: Option<Tensor>,
    /// What the head's backward reads (last stage).
    head: Option<HeadCache>,
    output_dims: Vec<usize>,
    /// Under [`StageOptions::sub_batches`]: each run's own cache, in batch order (`input` then
    /// holds the whole input, for its shape, and nothing else is kept here).
    runs: Vec<StageCache>,
}

/// The cut of a micro-batch of `b` sequences into `parts` runs: (first sequence, sequences).
pub(crate) fn sub_batch_cuts(b: usize, parts: usize) -> Vec<(usize, usize)> {
    let parts = parts.clamp(1, b.max(1));
    (0..parts)
        .map(|i| (i * b / parts, (i + 1) * b / parts - i * b / parts))
        .collect()
}

enum CachedInput {
    Tokens(Tensor),
    Activations(Var),
}

impl StageCache {
    /// The [`Stage::weights_version`] the forward ran with; a backward on a cache whose version
    /// is no longer current recomputes (see the module docs).
    pub fn weights_version(&self) -> u64 {
        self.weights_version
    }
    /// Shape of the input the forward was run on.
    pub fn input_dims(&self) -> &[usize] {
        match &self.input {
            CachedInput::Tokens(t) => t.dims(),
            CachedInput::Activations(v) => v.dims(),
        }
    }
}

impl std::fmt::Debug for StageCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageCache")
            .field("stage_uid", &self.stage_uid)
            .field("weights_version", &self.weights_version)
            .field("recomputed", &self.output.is_none())
            .field("output_dims", &self.output_dims)
            .finish()
    }
}

static NEXT_UID: AtomicU64 = AtomicU64::new(1);

/// One pipeline stage with its parameters and accumulated gradients.
pub struct Stage {
    cfg: ModelConfig,
    index: usize,
    opts: StageOptions,
    params: Vec<Param>,
    grads: Vec<Option<Tensor>>,
    backward_count: usize,
    backward_tokens: usize,
    weights_version: AtomicU64,
    stale_recomputes: u64,
    embed: Option<usize>,
    blocks: Vec<BlockIdx>,
    norm: Option<usize>,
    head: Option<usize>,
    rope: Rope,
    /// Causal mask of the last sequence length used, kept so a step does not rebuild it.
    mask: std::sync::Mutex<Option<Tensor>>,
    /// Weights cast to the compute dtype (when it differs from the param dtype), tagged with the
    /// weights version they were cast from: one cast per optimizer step, not per forward.
    compute_weights: std::sync::Mutex<Option<(u64, Vec<Tensor>)>>,
    uid: u64,
}

impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage")
            .field("config", &self.cfg.name)
            .field("index", &self.index)
            .field("params", &self.params.len())
            .field("backward_count", &self.backward_count)
            .field("weights_version", &self.weights_version())
            .finish()
    }
}

impl Stage {
    /// Build stage `index` of `cfg` with the deterministic initialisation (seeded by
    /// `cfg.init_seed` and each parameter's name, so a stage built alone equals the same stage
    /// built as part of the whole model).
    pub fn new(cfg: &ModelConfig, index: usize, opts: StageOptions) -> Result<Self> {
        let device = opts.device.clone();
        Self::build(cfg, index, opts, false, &mut |name, shape| {
            init_param(cfg, name, shape, &device)
        })
    }

    /// Stage `index` of `cfg` holding the weights that `weight(name, shape)` returns (a float
    /// tensor of that shape on any device; cast to the stage's device and param dtype). No random
    /// initialisation is run, so loading a large model costs no extra pass.
    pub(crate) fn with_weights(
        cfg: &ModelConfig,
        index: usize,
        opts: StageOptions,
        weight: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>,
    ) -> Result<Self> {
        Self::build(cfg, index, opts, false, weight)
    }

    /// Test hook: a half-precision stage on the CPU (slow, but it exercises the bf16 paths
    /// where no GPU is available).
    #[cfg(test)]
    pub(crate) fn new_allowing_cpu_half(
        cfg: &ModelConfig,
        index: usize,
        opts: StageOptions,
    ) -> Result<Self> {
        let device = opts.device.clone();
        Self::build(cfg, index, opts, true, &mut |name, shape| {
            init_param(cfg, name, shape, &device)
        })
    }

    fn build(
        cfg: &ModelConfig,
        index: usize,
        opts: StageOptions,
        allow_cpu_half: bool,
        weight: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>,
    ) -> Result<Self> {
        cfg.validate()?;
        opts.validate(allow_cpu_half)?;
        let shapes = cfg.stage_param_shapes(index)?;
        let mut params = Vec::with_capacity(shapes.len());
        for (name, shape) in shapes {
            let t = weight(&name, &shape)?;
            if t.dims() != shape.as_slice() {
                return Err(ModelError::shape(name, &shape, t.dims()));
            }
            let t = t.to_device(&opts.device)?.to_dtype(opts.param_dtype)?;
            params.push(Param {
                decay: shape.len() >= 2,
                var: Var::from_tensor(&t)?,
                name,
            });
        }
        let find = |name: &str| params.iter().position(|p| p.name == name);
        let need = |name: String| {
            find(&name).ok_or_else(|| ModelError::Config(format!("missing parameter {name}")))
        };
        let mut blocks = Vec::new();
        for i in cfg.stage_blocks(index)? {
            let p = format!("blocks.{i}");
            blocks.push(BlockIdx {
                decoder: find(&format!("{p}.decoder.weight")),
                attn_norm: need(format!("{p}.attn_norm.weight"))?,
                wq: need(format!("{p}.attn.wq"))?,
                wk: need(format!("{p}.attn.wk"))?,
                wv: need(format!("{p}.attn.wv"))?,
                wo: need(format!("{p}.attn.wo"))?,
                ffn_norm: need(format!("{p}.ffn_norm.weight"))?,
                w_gate: need(format!("{p}.ffn.w_gate"))?,
                w_up: need(format!("{p}.ffn.w_up"))?,
                w_down: need(format!("{p}.ffn.w_down"))?,
                encoder: find(&format!("{p}.encoder.weight")),
            });
        }
        let rope = Rope::new(cfg, opts.compute_dtype, &opts.device)?;
        Ok(Self {
            embed: find("embed.weight"),
            norm: find("norm.weight"),
            head: find("head.weight"),
            grads: vec![None; params.len()],
            cfg: cfg.clone(),
            index,
            opts,
            params,
            backward_count: 0,
            backward_tokens: 0,
            weights_version: AtomicU64::new(0),
            stale_recomputes: 0,
            blocks,
            rope,
            mask: std::sync::Mutex::new(None),
            compute_weights: std::sync::Mutex::new(None),
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// All stages of `cfg`, in order.
    pub fn all(cfg: &ModelConfig, opts: &StageOptions) -> Result<Vec<Self>> {
        (0..cfg.num_stages())
            .map(|k| Self::new(cfg, k, opts.clone()))
            .collect()
    }

    /// The model config.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    /// Position in the pipeline.
    pub fn index(&self) -> usize {
        self.index
    }
    /// Device and precision.
    pub fn options(&self) -> &StageOptions {
        &self.opts
    }
    /// Whether this stage owns the embedding.
    pub fn is_first(&self) -> bool {
        self.index == 0
    }
    /// Whether this stage owns the final norm, LM head and loss.
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.cfg.num_stages()
    }
    /// Turn recomputation on or off (affects caches created afterwards).
    pub fn set_recompute(&mut self, on: bool) {
        self.opts.recompute = on;
    }
    /// Parameters in canonical order (the order of the flat view).
    pub fn params(&self) -> &[Param] {
        &self.params
    }
    /// Number of scalar parameters.
    pub fn num_parameters(&self) -> usize {
        self.params.iter().map(|p| p.var.elem_count()).sum()
    }
    /// Accumulated gradient of parameter `i`: the gradient of the **sum** of token losses over
    /// the backward calls since the last reset (see "Loss scaling" in the module docs).
    pub fn grad(&self, i: usize) -> Option<&Tensor> {
        self.grads.get(i).and_then(|g| g.as_ref())
    }
    /// Accumulated gradient of parameter `i` divided by [`Stage::backward_tokens`]: the gradient
    /// of the token-mean loss over all accumulated micro-batches.
    pub fn mean_grad(&self, i: usize) -> Result<Option<Tensor>> {
        let n = self.backward_tokens.max(1) as f64;
        self.grad(i).map(|g| Ok((g / n)?)).transpose()
    }
    /// Accumulated gradient by parameter name.
    pub fn grad_by_name(&self, name: &str) -> Option<&Tensor> {
        let i = self.params.iter().position(|p| p.name == name)?;
        self.grad(i)
    }
    /// Backward calls accumulated since the last [`Stage::zero_grad`].
    pub fn backward_count(&self) -> usize {
        self.backward_count
    }
    /// Tokens of the micro-batches accumulated since the last [`Stage::zero_grad`].
    pub fn backward_tokens(&self) -> usize {
        self.backward_tokens
    }
    /// Drop accumulated gradients.
    pub fn zero_grad(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = None);
        self.backward_count = 0;
        self.backward_tokens = 0;
    }
    /// Version of the weights: bumped by every change made through this crate (optimizer steps,
    /// [`crate::merge::load_flat_params`], [`crate::merge::load_range`], checkpoint loads).
    pub fn weights_version(&self) -> u64 {
        self.weights_version.load(Ordering::SeqCst)
    }
    /// Declare that the weights changed. Code that writes a parameter's [`Var`] directly must call
    /// this, or caches taken before the write would not be recognised as stale.
    pub fn mark_weights_changed(&self) {
        self.weights_version.fetch_add(1, Ordering::SeqCst);
    }
    /// Backward calls that found a stale cache and recomputed (since the stage was built).
    pub fn stale_recomputes(&self) -> u64 {
        self.stale_recomputes
    }

    /// Shape of the input this stage accepts for a `[batch, seq]` micro-batch.
    pub fn input_dims(&self, batch: usize, seq: usize) -> Vec<usize> {
        if self.is_first() {
            vec![batch, seq]
        } else {
            vec![batch, seq, self.cfg.boundary_dim()]
        }
    }

    /// Shape of this stage's boundary output (`[]` for the loss of the last stage).
    pub fn output_dims(&self, batch: usize, seq: usize) -> Vec<usize> {
        if self.is_last() {
            vec![]
        } else {
            vec![batch, seq, self.cfg.boundary_dim()]
        }
    }
}

/// The parameter gradients of one backward, not yet added to its stage's accumulated gradients
/// (see [`Stage::backward_held`]).
#[derive(Debug)]
pub struct HeldGradients {
    stage_uid: u64,
    /// (parameter index, gradient), in the order they are added.
    parts: Vec<(usize, Tensor)>,
    tokens: usize,
}

impl HeldGradients {
    /// Error if any gradient holds NaN or infinity (finite but huge inputs can overflow).
    pub fn check_finite(&self) -> Result<()> {
        // One reduction per gradient but one read back: x * 0 is NaN exactly where x is not
        // finite, and the sums carry it without overflowing.
        let mut total: Option<Tensor> = None;
        for (_, g) in &self.parts {
            let s = (g.to_dtype(DType::F32)? * 0.0)?.sum_all()?;
            total = Some(match total {
                Some(t) => (t + s)?,
                None => s,
            });
        }
        match total {
            Some(t) if !t.to_scalar::<f32>()?.is_finite() => {
                Err(ModelError::NonFinite("parameter gradient".into()))
            }
            _ => Ok(()),
        }
    }
}

/// The deterministic initial value of parameter `name` (f64 on `device`): seeded by
/// `cfg.init_seed` and the name, so it does not depend on which stages are built.
fn init_param(cfg: &ModelConfig, name: &str, shape: &[usize], device: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let values: Vec<f64> = if name.ends_with("norm.weight") {
        vec![1.0; n]
    } else {
        let std = if name.ends_with("attn.wo") || name.ends_with("ffn.w_down") {
            // Residual-branch outputs scaled down with depth (GPT-2 style).
            cfg.init_std / (2.0 * cfg.n_layers() as f64).sqrt()
        } else if name.ends_with("decoder.weight") {
            // He init: the decoder feeds a ReLU from a b-wide input.
            (2.0 / cfg.bottleneck_dim as f64).sqrt()
        } else {
            cfg.init_std
        };
        let mut rng = SplitMix64::derived(cfg.init_seed, name);
        (0..n).map(|_| rng.next_normal() * std).collect()
    };
    Ok(Tensor::from_vec(values, shape, device)?)
}

/// Error if `t` holds NaN or infinity.
pub(crate) fn check_finite(t: &Tensor, what: &str) -> Result<()> {
    // x * 0 is NaN exactly where x is not finite, and the sum propagates it without overflow.
    let s = (t.to_dtype(DType::F32)? * 0.0)?
        .sum_all()?
        .to_scalar::<f32>()?;
    if s.is_finite() {
        Ok(())
    } else {
        Err(ModelError::NonFinite(what.into()))
    }
}

#[cfg(test)]
mod tests;
