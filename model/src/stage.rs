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

use candle_core::{D, DType, Device, Tensor, Var, backprop::GradStore};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::layers::{self, AttnWeights, KvCache, Rope};
use crate::loss;
use crate::rng::SplitMix64;

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
    /// Per-token log-sum-exp of the head (last stage).
    lse: Option<Tensor>,
    output_dims: Vec<usize>,
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

    /// Parameter `i` in the compute dtype; detached (no gradient graph) unless `track`.
    fn weight(&self, i: usize, track: bool) -> Result<Tensor> {
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

    fn validate_float(&self, t: &Tensor, dims: &[usize], what: &str) -> Result<()> {
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
    fn embed_tokens(&self, tokens: &Tensor, track: bool) -> Result<Tensor> {
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
    fn master(&self, i: usize, track: bool) -> Tensor {
        let t = self.params[i].var.as_tensor();
        if track { t.clone() } else { t.detach() }
    }

    /// RMSNorm computed in the param dtype (f32 under bf16 compute: a mean of squares in bf16
    /// loses too much), returned in the compute dtype for the matrix products that follow.
    fn norm(&self, x: &Tensor, i: usize, track: bool) -> Result<Tensor> {
        let y = layers::rms_norm(
            &x.to_dtype(self.opts.param_dtype)?,
            &self.master(i, track),
            self.cfg.norm_eps,
        )?;
        Ok(y.to_dtype(self.opts.compute_dtype)?)
    }

    /// One block. The residual stream `x` stays in the param dtype (f32 when computing in
    /// bf16); the branches run in the compute dtype and are added back in the param dtype.
    fn block(&self, blk: &BlockIdx, x: Tensor, attn: Attn<'_>, track: bool) -> Result<Tensor> {
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
    fn causal_mask(&self, t: usize) -> Result<Tensor> {
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
    fn run_inner(&self, input: &Tensor, track: bool) -> Result<Tensor> {
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
    fn block_inputs(&self, input: &Tensor) -> Result<Vec<Tensor>> {
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
    fn finish(&self, xs: &[Tensor], track: bool) -> Result<Tensor> {
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
    fn head_weight(&self) -> Result<Tensor> {
        let i = self
            .head
            .ok_or_else(|| ModelError::InvalidInput("stage has no LM head".into()))?;
        self.weight(i, false)
    }

    /// Loss report and per-token log-sum-exp of the final hidden state `h: [batch, seq, d]`.
    pub(crate) fn head_forward(
        &self,
        h: &Tensor,
        targets: &Tensor,
    ) -> Result<(LossOutput, Tensor)> {
        let d = self.cfg.d_model;
        let (b, t) = targets.dims2()?;
        let f = loss::ce_forward(
            &h.reshape(((), d))?,
            &self.head_weight()?,
            &targets.flatten_all()?,
            self.cfg.loss_vocab_chunk,
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
        Ok((out, f.lse))
    }

    /// Gradient of the **sum** of token losses with respect to `h`; the head's own gradient
    /// (of the same sum) is accumulated.
    pub(crate) fn head_backward(
        &mut self,
        h: &Tensor,
        targets: &Tensor,
        lse: &Tensor,
    ) -> Result<Tensor> {
        let (head, gh, gw) = self.head_gradients(h, targets, lse)?;
        self.add_grad(head, gw)?;
        Ok(gh)
    }

    /// The LM head's backward: its parameter's index, the gradient with respect to `h`, and the
    /// head weight's gradient (not accumulated).
    fn head_gradients(
        &self,
        h: &Tensor,
        targets: &Tensor,
        lse: &Tensor,
    ) -> Result<(usize, Tensor, Tensor)> {
        let d = self.cfg.d_model;
        let (gh, gw) = loss::ce_backward(
            &h.reshape(((), d))?,
            &self.head_weight()?,
            &targets.flatten_all()?,
            lse,
            self.cfg.loss_vocab_chunk,
            1.0,
        )?;
        let head = self
            .head
            .ok_or_else(|| ModelError::InvalidInput("stage has no LM head".into()))?;
        Ok((head, gh.reshape(h.dims())?, gw))
    }

    fn add_grad(&mut self, i: usize, g: Tensor) -> Result<()> {
        let g = g.detach();
        self.grads[i] = Some(match self.grads[i].take() {
            Some(acc) => (acc + g)?,
            None => g,
        });
        Ok(())
    }

    /// Add the gradients that `grads` holds for this stage's parameters.
    pub(crate) fn accumulate(&mut self, grads: &GradStore) -> Result<()> {
        for i in 0..self.params.len() {
            if let Some(g) = grads.get(self.params[i].var.as_tensor()) {
                let g = g.clone();
                self.add_grad(i, g)?;
            }
        }
        Ok(())
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

    fn validate_input(&self, input: &Tensor) -> Result<(usize, usize)> {
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

    fn validate_targets(
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
            Some(tg) => StageOutput::Loss(self.head_forward(&out, tg)?.0),
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
        let input = input.to_device(&self.opts.device)?;
        let targets = self.validate_targets(targets, b, t)?;
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
        let (output, lse) = match &targets {
            Some(tg) => {
                let (l, lse) = self.head_forward(&out, tg)?;
                (StageOutput::Loss(l), Some(lse))
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
            lse,
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
        let graph_input = match &cache.input {
            CachedInput::Tokens(t) => t.clone(),
            CachedInput::Activations(v) => v.as_tensor().clone(),
        };
        let dims = cache.input_dims();
        let tokens = dims[0] * dims[1];
        // A cache from older weights is recomputed in full (see "Stale caches" above): its
        // graph may see the new weights in place (f32) while its activations are old.
        let stale = cache.weights_version != self.weights_version();
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
        if self.opts.checkpoint_blocks {
            let xs = match (&cache.block_inputs, stale) {
                (Some(xs), false) => xs.clone(),
                _ => self.block_inputs(&graph_input)?,
            };
            return self.backward_by_block(&cache, &graph_input, xs, grad_output, stale, tokens);
        }
        let cached_output = if stale { None } else { cache.output.clone() };
        // Every backward yields gradients of the micro-batch's summed token loss: the last stage
        // differentiates the sum directly; other stages scale the mean-loss gradient they got by
        // the token count. The input gradient is scaled back to the mean before it is returned.
        // Parameter gradients in the order they are added (the head's first, as `backward` and
        // the monolithic pipeline add them).
        let mut parts: Vec<(usize, Tensor)> = Vec::new();
        let surrogate = self.surrogate(
            &cache,
            || match cached_output {
                Some(out) => Ok(out),
                None => self.run(&graph_input),
            },
            grad_output,
            stale,
            tokens,
            &mut parts,
        )?;
        let grads = surrogate.backward()?;
        for (i, p) in self.params.iter().enumerate() {
            if let Some(g) = grads.get(p.var.as_tensor()) {
                parts.push((i, g.detach()));
            }
        }
        let held = HeldGradients {
            stage_uid: self.uid,
            parts,
            tokens,
        };
        let grad_input = match &cache.input {
            CachedInput::Tokens(_) => None,
            CachedInput::Activations(v) => Some(match grads.get(v.as_tensor()) {
                Some(g) => (g / tokens as f64)?,
                // Unreachable for a real stage, but a zero gradient is the right answer.
                None => v.as_tensor().zeros_like()?,
            }),
        };
        Ok((grad_input, held))
    }

    /// The scalar a backward differentiates, from the stage's `output` (computed only once the
    /// arguments are known good): on the last stage the sum of token losses through the loss
    /// head, whose weight gradient goes to `parts`; elsewhere the output times the gradient the
    /// next stage sent, scaled from its micro-batch mean to the sum.
    fn surrogate(
        &self,
        cache: &StageCache,
        output: impl FnOnce() -> Result<Tensor>,
        grad_output: Option<&Tensor>,
        stale: bool,
        tokens: usize,
        parts: &mut Vec<(usize, Tensor)>,
    ) -> Result<Tensor> {
        match (self.is_last(), grad_output) {
            (true, None) => {
                let Some(targets) = &cache.targets else {
                    return Err(ModelError::InvalidInput(
                        "last-stage cache lacks targets".into(),
                    ));
                };
                let h = output()?;
                let lse = match (&cache.lse, stale) {
                    (Some(lse), false) => lse.clone(),
                    _ => self.head_forward(&h, targets)?.1,
                };
                let (head, gh, gw) = self.head_gradients(&h, targets, &lse)?;
                parts.push((head, gw.detach()));
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
    fn backward_by_block(
        &self,
        cache: &StageCache,
        graph_input: &Tensor,
        xs: Vec<Tensor>,
        grad_output: Option<&Tensor>,
        stale: bool,
        tokens: usize,
    ) -> Result<(Option<Tensor>, HeldGradients)> {
        let mut parts: Vec<(usize, Tensor)> = Vec::new();
        let take = |grads: &GradStore, parts: &mut Vec<(usize, Tensor)>| {
            for (i, p) in self.params.iter().enumerate() {
                if let Some(g) = grads.get(p.var.as_tensor()) {
                    parts.push((i, g.detach()));
                }
            }
        };
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
        let grads = surrogate.backward()?;
        take(&grads, &mut parts);
        let mut g = grads
            .get(top.as_tensor())
            .cloned()
            .ok_or_else(|| ModelError::InvalidInput("no gradient reached the stage".into()))?;
        drop(grads);
        let mask = self.causal_mask(top.dim(1)?)?;
        for (blk, x) in self.blocks.iter().zip(&xs).rev() {
            let input = Var::from_tensor(x)?;
            let y = self.block(blk, input.as_tensor().clone(), Attn::Full(&mask), true)?;
            let grads = (y * g.detach())?.sum_all()?.backward()?;
            take(&grads, &mut parts);
            g = match grads.get(input.as_tensor()) {
                Some(gi) => gi.clone(),
                None => input.as_tensor().zeros_like()?,
            };
        }
        let grad_input = if self.is_first() {
            let x = self.embed_tokens(graph_input, true)?;
            let grads = (x * g.detach())?.sum_all()?.backward()?;
            take(&grads, &mut parts);
            None
        } else {
            Some((g / tokens as f64)?)
        };
        let held = HeldGradients {
            stage_uid: self.uid,
            parts,
            tokens,
        };
        Ok((grad_input, held))
    }

    /// Adds the gradients of one [`Stage::backward_held`] to the accumulated ones (what
    /// [`Stage::backward`] does at once, with the same arithmetic).
    pub fn commit(&mut self, held: HeldGradients) -> Result<()> {
        if held.stage_uid != self.uid {
            return Err(ModelError::InvalidInput(
                "gradients were produced by a different stage".into(),
            ));
        }
        for (i, g) in held.parts {
            self.add_grad(i, g)?;
        }
        self.count_backward(held.tokens);
        Ok(())
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
mod tests {
    use super::*;
    use crate::data::{GrammarCorpus, make_batch};
    use crate::pipeline::Pipeline;

    fn batch(seq: usize, n: usize) -> crate::data::Batch {
        let g = GrammarCorpus::new(0, seq).unwrap();
        let ids: Vec<u64> = (0..n as u64).collect();
        make_batch(&g, &ids, &Device::Cpu).unwrap()
    }

    fn abs_sum(t: &Tensor) -> f64 {
        t.abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    }

    #[test]
    fn every_parameter_gets_a_nonzero_gradient() {
        for cfg in [
            ModelConfig::tiny(),
            ModelConfig::tiny().with_bottleneck(32),
            ModelConfig::tiny().with_stages(vec![3]),
        ] {
            let mut p = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
            let b = batch(16, 3);
            p.forward_backward(&b.inputs, &b.targets).unwrap();
            for s in p.stages() {
                for (i, param) in s.params().iter().enumerate() {
                    let g = s
                        .grad(i)
                        .unwrap_or_else(|| panic!("{} has no gradient", param.name()));
                    assert_eq!(g.dims(), param.var().dims());
                    let a = abs_sum(g);
                    assert!(a > 0.0 && a.is_finite(), "{}: |grad| = {a}", param.name());
                }
            }
        }
    }

    fn f64_opts() -> StageOptions {
        StageOptions {
            param_dtype: DType::F64,
            compute_dtype: DType::F64,
            ..StageOptions::cpu()
        }
    }

    fn set_elem(var: &Var, i: usize, v: f64) {
        let mut data = var
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        data[i] = v;
        var.set(&Tensor::from_vec(data, var.dims(), var.device()).unwrap())
            .unwrap();
    }

    fn get_elem(t: &Tensor, i: usize) -> f64 {
        t.flatten_all()
            .unwrap()
            .get(i)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    }

    /// The scalar whose gradient `backward` computes: the loss on the last stage, otherwise
    /// `sum(output * g)`.
    fn objective(stage: &Stage, input: &Tensor, targets: &Tensor, g: Option<&Tensor>) -> f64 {
        let tg = stage.is_last().then_some(targets);
        let (out, _) = stage.forward(input, tg).unwrap();
        match (out, g) {
            (StageOutput::Loss(_), _) => {
                // Recompute the loss in f64 (StageOutput rounds it to f32).
                let h = stage.run(input).unwrap();
                let d = stage.config().d_model;
                let f = loss::ce_forward(
                    &h.reshape(((), d)).unwrap(),
                    &stage.head_weight().unwrap(),
                    &targets.flatten_all().unwrap(),
                    stage.config().loss_vocab_chunk,
                )
                .unwrap();
                f.loss.to_scalar::<f64>().unwrap()
            }
            (StageOutput::Activations(a), Some(g)) => (a * g)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap(),
            _ => unreachable!(),
        }
    }

    #[test]
    fn finite_difference_gradients_per_stage() {
        let cfg = ModelConfig::tiny();
        let b = batch(6, 2);
        let (bs, t) = (2, 6);
        let mut rng = crate::rng::SplitMix64::new(11);
        let mut randn = |dims: &[usize]| {
            let n: usize = dims.iter().product();
            Tensor::from_vec(
                (0..n).map(|_| rng.next_normal()).collect::<Vec<f64>>(),
                dims,
                &Device::Cpu,
            )
            .unwrap()
        };
        for k in 0..cfg.num_stages() {
            let mut stage = Stage::new(&cfg, k, f64_opts()).unwrap();
            // Larger weights than the init make every path matter numerically.
            for p in stage.params() {
                if p.decay() {
                    let w = (p.var().as_tensor() * 10.0).unwrap();
                    p.var().set(&w).unwrap();
                }
            }
            let input = if k == 0 {
                b.inputs.clone()
            } else {
                randn(&stage.input_dims(bs, t))
            };
            let g_out = (!stage.is_last()).then(|| randn(&stage.output_dims(bs, t)));
            let tg = stage.is_last().then_some(&b.targets);
            let (_, cache) = stage.forward(&input, tg).unwrap();
            let g_in = stage.backward(cache, g_out.as_ref()).unwrap();
            let eps = 1e-5;
            let mut checked = 0;
            for (pi, p) in stage.params().iter().enumerate() {
                // The token-mean gradient: what the objective's finite difference measures.
                let grad = stage.mean_grad(pi).unwrap().unwrap();
                let n = p.var().elem_count();
                for j in [0, n / 3, n - 1] {
                    let orig = get_elem(p.var().as_tensor(), j);
                    set_elem(p.var(), j, orig + eps);
                    let up = objective(&stage, &input, &b.targets, g_out.as_ref());
                    set_elem(p.var(), j, orig - eps);
                    let down = objective(&stage, &input, &b.targets, g_out.as_ref());
                    set_elem(p.var(), j, orig);
                    let fd = (up - down) / (2.0 * eps);
                    let an = get_elem(&grad, j);
                    let err = (fd - an).abs() / (fd.abs() + an.abs()).max(1e-6);
                    assert!(
                        err < 1e-5,
                        "stage {k} {}[{j}]: fd {fd} vs analytic {an}",
                        p.name()
                    );
                    checked += 1;
                }
            }
            if let Some(g_in) = g_in {
                for j in [0, 7, input.elem_count() - 1] {
                    let orig = get_elem(&input, j);
                    let mut data = input.flatten_all().unwrap().to_vec1::<f64>().unwrap();
                    data[j] = orig + eps;
                    let up_in = Tensor::from_vec(data.clone(), input.dims(), &Device::Cpu).unwrap();
                    data[j] = orig - eps;
                    let down_in = Tensor::from_vec(data, input.dims(), &Device::Cpu).unwrap();
                    let fd = (objective(&stage, &up_in, &b.targets, g_out.as_ref())
                        - objective(&stage, &down_in, &b.targets, g_out.as_ref()))
                        / (2.0 * eps);
                    let an = get_elem(&g_in, j);
                    let err = (fd - an).abs() / (fd.abs() + an.abs()).max(1e-6);
                    assert!(err < 1e-5, "stage {k} input[{j}]: fd {fd} vs analytic {an}");
                    checked += 1;
                }
            }
            assert!(checked >= 30);
        }
    }

    #[test]
    fn recompute_gives_identical_gradients() {
        let cfg = ModelConfig::tiny();
        let b = batch(12, 2);
        let mut a = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
        let mut opts = StageOptions::cpu();
        opts.recompute = true;
        let mut r = Pipeline::new(&cfg, &opts).unwrap();
        let la = a.forward_backward(&b.inputs, &b.targets).unwrap();
        let lr = r.forward_backward(&b.inputs, &b.targets).unwrap();
        assert_eq!(la, lr);
        for (sa, sr) in a.stages().iter().zip(r.stages()) {
            for i in 0..sa.params().len() {
                let d = abs_sum(&(sa.grad(i).unwrap() - sr.grad(i).unwrap()).unwrap());
                assert_eq!(d, 0.0);
            }
        }
        // And it saves what it is for: with recompute, a forward keeps no output graph.
        for recompute in [false, true] {
            let mut opts = StageOptions::cpu();
            opts.recompute = recompute;
            let stage = Stage::new(&cfg, 0, opts).unwrap();
            let (_, cache) = stage.forward(&b.inputs, None).unwrap();
            assert_eq!(cache.output.is_none(), recompute, "recompute {recompute}");
        }
    }

    /// Per-block checkpointing, alone and with recompute, on every kind of stage (embedding,
    /// middle, head) gives the whole graph's loss and the same gradient bits; a block left out of
    /// the recompute, or recomputed from the wrong input, would change them.
    #[test]
    fn checkpointed_blocks_give_identical_gradients() {
        let cfg = ModelConfig::tiny().with_stages(vec![2, 3, 2]);
        let b = batch(12, 2);
        let mut whole = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
        let lw = whole.forward_backward(&b.inputs, &b.targets).unwrap();
        for recompute in [false, true] {
            let mut opts = StageOptions::cpu();
            opts.checkpoint_blocks = true;
            opts.recompute = recompute;
            let mut p = Pipeline::new(&cfg, &opts).unwrap();
            let l = p.forward_backward(&b.inputs, &b.targets).unwrap();
            assert_eq!(l, lw, "recompute {recompute}");
            for (sw, sc) in whole.stages().iter().zip(p.stages()) {
                assert!(sc.num_blocks() > 0);
                for i in 0..sw.params().len() {
                    let (gw, gc) = (sw.grad(i).unwrap(), sc.grad(i).unwrap());
                    assert_eq!(
                        gw.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        gc.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        "stage {} {} (recompute {recompute})",
                        sw.index(),
                        sw.params()[i].name()
                    );
                }
            }
            // What it keeps: block inputs without graphs, or with recompute nothing but the input.
            let stage = Stage::new(&cfg, 1, opts).unwrap();
            let x = Tensor::zeros(stage.input_dims(2, 12), DType::F32, &Device::Cpu).unwrap();
            let (_, cache) = stage.forward(&x, None).unwrap();
            assert!(cache.output.is_none());
            assert_eq!(
                cache.block_inputs.as_ref().map(Vec::len),
                (!recompute).then_some(stage.num_blocks() + 1)
            );
        }
    }

    /// What checkpointing is for: a training step of eight blocks holds far less at its peak.
    #[test]
    fn checkpointed_blocks_bound_the_peak() {
        let cfg = ModelConfig::tiny().with_stages(vec![8]);
        let b = batch(64, 8);
        let peak = |checkpoint_blocks: bool| {
            let opts = StageOptions {
                checkpoint_blocks,
                ..StageOptions::cpu()
            };
            let mut stage = Stage::new(&cfg, 0, opts).unwrap();
            crate::alloc_count::peak_during(|| {
                let (_, cache) = stage.forward(&b.inputs, Some(&b.targets)).unwrap();
                stage.backward(cache, None).unwrap();
            })
            .1
        };
        let (whole, checkpointed) = (peak(false), peak(true));
        assert!(
            checkpointed * 2 < whole,
            "checkpointed {checkpointed} bytes at the peak, whole graph {whole}"
        );
    }

    #[test]
    fn held_gradients_change_nothing_until_committed() {
        // The last stage of a one-stage model: its forward takes tokens, its backward needs no
        // output gradient.
        let cfg = ModelConfig::tiny().with_stages(vec![2]);
        let (b1, b2) = (batch(12, 2), batch(12, 3));
        let mut direct = Stage::new(&cfg, 0, StageOptions::cpu()).unwrap();
        let mut held = Stage::new(&cfg, 0, StageOptions::cpu()).unwrap();
        for (inputs, targets) in [(&b1.inputs, &b1.targets), (&b2.inputs, &b2.targets)] {
            let (_, c) = direct.forward(inputs, Some(targets)).unwrap();
            direct.backward(c, None).unwrap();
        }
        // The first backward is held and dropped; nothing of it remains.
        let (_, c) = held.forward(&b2.inputs, Some(&b2.targets)).unwrap();
        drop(held.backward_held(c, None).unwrap());
        assert_eq!(held.backward_count(), 0);
        assert!((0..held.params().len()).all(|i| held.grad(i).is_none()));
        // Held and committed in order: the same bits as backward at once.
        for (inputs, targets) in [(&b1.inputs, &b1.targets), (&b2.inputs, &b2.targets)] {
            let (_, c) = held.forward(inputs, Some(targets)).unwrap();
            let (_, g) = held.backward_held(c, None).unwrap();
            g.check_finite().unwrap();
            held.commit(g).unwrap();
        }
        assert_eq!(held.backward_tokens(), direct.backward_tokens());
        for i in 0..direct.params().len() {
            let d = abs_sum(&(direct.grad(i).unwrap() - held.grad(i).unwrap()).unwrap());
            assert_eq!(d, 0.0, "parameter {i}");
        }
        // Another stage's gradients are refused.
        let mut other = Stage::new(&cfg, 0, StageOptions::cpu()).unwrap();
        let (_, c) = other.forward(&b1.inputs, Some(&b1.targets)).unwrap();
        let (_, g) = other.backward_held(c, None).unwrap();
        assert!(held.commit(g).is_err());
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let cfg = ModelConfig::tiny();
        let dev = Device::Cpu;
        let s0 = Stage::new(&cfg, 0, StageOptions::cpu()).unwrap();
        let mut s1 = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
        let s2 = Stage::new(&cfg, 2, StageOptions::cpu()).unwrap();
        let tokens = Tensor::new(&[[1u32, 2, 3]], &dev).unwrap();
        // Stage 0: dtype, rank, length, range, stray targets.
        assert!(matches!(
            s0.forward(&tokens.to_dtype(DType::F32).unwrap(), None),
            Err(ModelError::DType { .. })
        ));
        assert!(s0.forward(&tokens.flatten_all().unwrap(), None).is_err());
        let long = Tensor::zeros((1, cfg.max_seq_len + 1), DType::U32, &dev).unwrap();
        assert!(s0.forward(&long, None).is_err());
        let empty = Tensor::zeros((1, 0), DType::U32, &dev).unwrap();
        assert!(s0.forward(&empty, None).is_err());
        let oob = Tensor::new(&[[1u32, 64]], &dev).unwrap();
        assert!(matches!(
            s0.forward(&oob, None),
            Err(ModelError::TokenOutOfRange { id: 64, .. })
        ));
        assert!(s0.forward(&tokens, Some(&tokens)).is_err());
        // Middle stage: width, dtype, NaN.
        let good = Tensor::zeros((1, 3, cfg.bottleneck_dim), DType::F32, &dev).unwrap();
        assert!(
            s1.forward(&Tensor::zeros((1, 3, 5), DType::F32, &dev).unwrap(), None)
                .is_err()
        );
        assert!(
            s1.forward(&good.to_dtype(DType::F64).unwrap(), None)
                .is_err()
        );
        assert!(s1.forward(&tokens, None).is_err());
        let nan = (good.clone() + f64::NAN).unwrap();
        assert!(matches!(
            s1.forward(&nan, None),
            Err(ModelError::NonFinite(_))
        ));
        let inf = (good.clone() + f64::INFINITY).unwrap();
        assert!(matches!(
            s1.forward(&inf, None),
            Err(ModelError::NonFinite(_))
        ));
        // Backward: missing, misshapen or non-finite gradients, foreign caches.
        let (_, c) = s1.forward(&good, None).unwrap();
        assert!(s1.backward(c, None).is_err());
        let (_, c) = s1.forward(&good, None).unwrap();
        assert!(
            s1.backward(
                c,
                Some(&Tensor::zeros((1, 2, 8), DType::F32, &dev).unwrap())
            )
            .is_err()
        );
        let (_, c) = s1.forward(&good, None).unwrap();
        assert!(s1.backward(c, Some(&nan)).is_err());
        let (_, c) = s2.forward(&good, Some(&tokens)).unwrap();
        assert!(s1.backward(c, Some(&good)).is_err());
        // Last stage: targets required and shaped like the input.
        assert!(s2.forward(&good, None).is_err());
        assert!(
            s2.forward(&good, Some(&Tensor::new(&[[1u32, 2]], &dev).unwrap()))
                .is_err()
        );
        assert!(s2.forward(&good, Some(&oob)).is_err());
        // Nothing was accumulated by the failed calls.
        assert_eq!(s1.backward_count(), 0);
        // A bad dtype combination is a config error.
        let bad = StageOptions {
            compute_dtype: DType::U8,
            ..StageOptions::cpu()
        };
        assert!(Stage::new(&cfg, 0, bad).is_err());
        // Half precision on the CPU is refused with a clear message.
        let bf16_cpu = StageOptions {
            compute_dtype: DType::BF16,
            ..StageOptions::cpu()
        };
        let err = Stage::new(&cfg, 0, bf16_cpu).unwrap_err().to_string();
        assert!(err.contains("BF16") && err.contains("CUDA"), "{err}");
        assert!(Stage::new(&cfg, 3, StageOptions::cpu()).is_err());
    }

    fn max_rel_diff(a: &Tensor, b: &Tensor) -> f64 {
        let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        let scale = b
            .to_dtype(DType::F64)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        d / scale.max(1e-12)
    }

    fn random_like(dims: &[usize], seed: u64, dtype: DType) -> Tensor {
        let mut rng = crate::rng::SplitMix64::new(seed);
        let n: usize = dims.iter().product();
        Tensor::from_vec(
            (0..n)
                .map(|_| rng.next_normal() as f32)
                .collect::<Vec<f32>>(),
            dims,
            &Device::Cpu,
        )
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
    }

    /// An optimizer step between a forward and its backward: the backward must give exactly the
    /// gradients of a from-scratch forward+backward with the new weights (a full recompute), not
    /// a mix of old activations (or an old log-sum-exp) with new weights.
    fn check_stale_cache(opts: &StageOptions, tol: f64) {
        check_stale_cache_with(opts, tol, Stage::new)
    }

    fn check_stale_cache_with(
        opts: &StageOptions,
        tol: f64,
        build: fn(&ModelConfig, usize, StageOptions) -> Result<Stage>,
    ) {
        use crate::optim::{AdamW, AdamWConfig, LrSchedule};
        let cfg = ModelConfig::tiny();
        let b = batch(10, 3);
        let other = batch(10, 3);
        let dtype = opts.param_dtype;
        for recompute in [false, true] {
            for k in 0..cfg.num_stages() {
                let opts = StageOptions {
                    recompute,
                    ..opts.clone()
                };
                let mut stage = build(&cfg, k, opts.clone()).unwrap();
                let (input, other_input) = if k == 0 {
                    (b.inputs.clone(), other.inputs.clone())
                } else {
                    let dims = stage.input_dims(3, 10);
                    (random_like(&dims, 1, dtype), random_like(&dims, 2, dtype))
                };
                let g_out =
                    (!stage.is_last()).then(|| random_like(&stage.output_dims(3, 10), 3, dtype));
                let tg = stage.is_last().then_some(&b.targets);
                let (_, cache) = stage.forward(&input, tg).unwrap();
                assert_eq!(cache.weights_version(), stage.weights_version());
                // Another sample's gradients, then a local step: the weights move in place.
                let (_, c2) = stage
                    .forward(&other_input, stage.is_last().then_some(&other.targets))
                    .unwrap();
                stage.backward(c2, g_out.as_ref()).unwrap();
                let mut opt = AdamW::new(
                    &stage,
                    AdamWConfig {
                        lr: 0.05,
                        ..AdamWConfig::default()
                    },
                    LrSchedule::constant(),
                )
                .unwrap();
                let before = stage.weights_version();
                opt.step(&mut stage).unwrap();
                assert_eq!(stage.weights_version(), before + 1);
                let g_in = stage.backward(cache, g_out.as_ref()).unwrap();
                assert_eq!(stage.stale_recomputes(), 1);

                let mut fresh = build(&cfg, k, opts.clone()).unwrap();
                for (f, p) in fresh.params().iter().zip(stage.params()) {
                    f.var().set(&p.var().as_tensor().copy().unwrap()).unwrap();
                }
                let (_, c) = fresh.forward(&input, tg).unwrap();
                let g_ref = fresh.backward(c, g_out.as_ref()).unwrap();
                for i in 0..stage.params().len() {
                    let e = max_rel_diff(stage.grad(i).unwrap(), fresh.grad(i).unwrap());
                    assert!(
                        e <= tol,
                        "stage {k} recompute={recompute} {}: rel diff {e}",
                        stage.params()[i].name()
                    );
                }
                if let (Some(a), Some(r)) = (g_in, g_ref) {
                    let e = max_rel_diff(&a, &r);
                    assert!(e <= tol, "stage {k} input gradient: rel diff {e}");
                }
            }
        }
    }

    #[test]
    fn stale_cache_backward_equals_from_scratch_f32() {
        check_stale_cache(&StageOptions::cpu(), 1e-6);
    }

    #[test]
    fn stale_cache_backward_equals_from_scratch_f64() {
        check_stale_cache(&f64_opts(), 1e-12);
    }

    /// bf16 compute on the CPU (test hook): the cached bf16 graph holds old weight copies, f32
    /// sees the update in place; both recompute the same way. The gradients are compared with a
    /// fresh bf16 stage, so the tolerance is f32-tight: same weights, same arithmetic.
    #[test]
    fn stale_cache_backward_equals_from_scratch_bf16_on_cpu_hook() {
        let opts = StageOptions {
            compute_dtype: DType::BF16,
            ..StageOptions::cpu()
        };
        check_stale_cache_with(&opts, 1e-6, Stage::new_allowing_cpu_half);
    }

    /// bf16 weights are cast once per weights version, and the cast copies still carry the
    /// gradient to the f32 master weights.
    #[test]
    fn bf16_weight_copies_are_made_once_per_step() {
        let cfg = ModelConfig::tiny();
        let opts = StageOptions {
            compute_dtype: DType::BF16,
            ..StageOptions::cpu()
        };
        let mut s = Stage::new_allowing_cpu_half(&cfg, 1, opts).unwrap();
        let x = random_like(&s.input_dims(2, 6), 5, DType::F32);
        let g = random_like(&s.output_dims(2, 6), 6, DType::F32);
        let id = |s: &Stage| s.weight(2, true).unwrap().id();
        let before = id(&s);
        s.forward(&x, None).unwrap();
        assert_eq!(id(&s), before, "no new cast between forwards");
        let (_, c) = s.forward(&x, None).unwrap();
        s.backward(c, Some(&g)).unwrap();
        for i in 0..s.params().len() {
            assert!(
                abs_sum(s.grad(i).unwrap()) > 0.0,
                "{}",
                s.params()[i].name()
            );
            assert_eq!(s.grad(i).unwrap().dtype(), DType::F32);
        }
        s.mark_weights_changed();
        assert_ne!(id(&s), before, "a weight change invalidates the casts");
    }

    /// bf16 compute (CPU test hook) with f32 norms and residual stays close to f32 (outputs,
    /// input gradients and parameter gradients), and does compute in bf16. The output is
    /// compared by what the stage adds to its input: the f32 residual carries most of it, so a
    /// whole-output comparison hid a residual rounded to bf16. A wide stage too, since a mean
    /// of squares summed in bf16 goes wrong with width (at 1,024 channels, a bf16 norm put the
    /// gradients 0.26 off, and 0.07 at 32).
    #[test]
    fn bf16_compute_tracks_f32() {
        check_bf16_tracks_f32(&Device::Cpu, Stage::new_allowing_cpu_half);
    }

    /// The same on a GPU, where `cuda:N:bf16` miners compute: cuBLAS's bf16 products and
    /// candle's CUDA kernels, not the CPU's.
    #[cfg(feature = "cuda")]
    #[test]
    fn bf16_compute_tracks_f32_cuda() {
        let Some(gpu) = crate::cuda_for_checks(0).unwrap() else {
            return;
        };
        check_bf16_tracks_f32(&gpu, Stage::new);
    }

    fn check_bf16_tracks_f32(
        device: &Device,
        build_half: fn(&ModelConfig, usize, StageOptions) -> Result<Stage>,
    ) {
        let wide = ModelConfig {
            d_model: 1024,
            n_heads: 8,
            n_kv_heads: 4,
            d_ff: 1024,
            bottleneck_dim: 64,
            ..ModelConfig::tiny()
        };
        for cfg in [ModelConfig::tiny(), wide] {
            let full = StageOptions {
                device: device.clone(),
                ..StageOptions::cpu()
            };
            let half = StageOptions {
                compute_dtype: DType::BF16,
                ..full.clone()
            };
            let mut a = Stage::new(&cfg, 1, full).unwrap();
            let mut h = build_half(&cfg, 1, half).unwrap();
            let on = |t: Tensor| t.to_device(device).unwrap();
            let x = on(random_like(&a.input_dims(2, 16), 8, DType::F32));
            let g = on(random_like(&a.output_dims(2, 16), 9, DType::F32));
            let (oa, ca) = a.forward(&x, None).unwrap();
            let (oh, ch) = h.forward(&x, None).unwrap();
            let (oa, oh) = (oa.activations().unwrap(), oh.activations().unwrap());
            assert_eq!(oh.dtype(), DType::F32, "the residual stream leaves in f32");
            let added_err = max_rel_diff(&(oh - &x).unwrap(), &(oa - &x).unwrap());
            let ga = a.backward(ca, Some(&g)).unwrap().unwrap();
            let gh = h.backward(ch, Some(&g)).unwrap().unwrap();
            let in_err = max_rel_diff(&gh, &ga);
            let mut worst = 0f64;
            for i in 0..a.params().len() {
                worst = worst.max(max_rel_diff(h.grad(i).unwrap(), a.grad(i).unwrap()));
            }
            let d = cfg.d_model;
            eprintln!(
                "bf16 vs f32 on {device:?}, width {d}: added {added_err:.2e}, input grad \
                 {in_err:.2e}, param grad {worst:.2e}"
            );
            // Measured on the CPU: added 6.2e-3 and 6.0e-3 (32 and 1,024 wide), input grad
            // 1.5e-4 and 2.5e-3, param grad 4.0e-2 and 9.0e-2. With the residual in bf16: added
            // 0.52 (32 wide); with the norms in bf16 (1,024 wide): 7.9e-2, 1.5e-2 and 0.26.
            // On an H200 (`cuda` feature): the same at 32 wide; added 5.7e-3, input grad 2.3e-3
            // and param grad 9.0e-2 at 1,024.
            assert!(
                added_err > 1e-3,
                "width {d}: no bf16 rounding at all ({added_err:.2e})"
            );
            assert!(added_err < 2e-2, "width {d}: added {added_err:.2e}");
            assert!(in_err < 8e-3, "width {d}: input grad {in_err:.2e}");
            assert!(worst < 0.15, "width {d}: param grad {worst:.2e}");
        }
    }

    /// bf16 compute keeps old weight copies in a cached graph while f32 sees the update in
    /// place; both must recompute the same way.
    #[cfg(feature = "cuda")]
    #[test]
    fn stale_cache_backward_equals_from_scratch_bf16_cuda() {
        let Some(gpu) = crate::cuda_for_checks(0).unwrap() else {
            return;
        };
        let opts = StageOptions {
            device: gpu,
            compute_dtype: DType::BF16,
            ..StageOptions::cpu()
        };
        check_stale_cache(&opts, 1e-6);
    }

    /// Micro-batches of 1 and 3 sequences accumulate to the gradient of one batch of all 4: the
    /// step is on the true token mean, not the mean of the micro-batch means.
    #[test]
    fn unequal_micro_batches_give_the_true_token_mean() {
        let cfg = ModelConfig::tiny();
        let g = GrammarCorpus::new(3, 12).unwrap();
        let all = make_batch(&g, &[10, 11, 12, 13], &Device::Cpu).unwrap();
        let one = make_batch(&g, &[10], &Device::Cpu).unwrap();
        let three = make_batch(&g, &[11, 12, 13], &Device::Cpu).unwrap();
        let mut whole = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
        let lw = whole
            .forward_backward(&all.inputs, &all.targets)
            .unwrap()
            .loss;
        let mut split = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
        let l1 = split
            .forward_backward(&one.inputs, &one.targets)
            .unwrap()
            .loss;
        let l3 = split
            .forward_backward(&three.inputs, &three.targets)
            .unwrap()
            .loss;
        // The token mean weights the 3-sequence micro-batch three times as much.
        assert!((f64::from(lw) - (f64::from(l1) + 3.0 * f64::from(l3)) / 4.0).abs() < 1e-5);
        assert!(
            (l1 - l3).abs() > 1e-3,
            "the test needs distinct micro-batch losses"
        );
        for (sw, ss) in whole.stages().iter().zip(split.stages()) {
            assert_eq!(sw.backward_tokens(), ss.backward_tokens());
            for i in 0..sw.params().len() {
                let e = max_rel_diff(
                    &ss.mean_grad(i).unwrap().unwrap(),
                    &sw.mean_grad(i).unwrap().unwrap(),
                );
                assert!(e < 1e-5, "{}: rel diff {e}", sw.params()[i].name());
            }
        }
    }

    /// The last stage reports each sequence's loss, equal to running that sequence alone; the
    /// evaluation forward gives the same values with no gradient graph.
    #[test]
    fn per_sequence_losses_and_eval_forward() {
        let cfg = ModelConfig::tiny();
        let b = batch(9, 3);
        let stages = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
        let run = |inputs: &Tensor, targets: &Tensor, eval: bool| {
            let mut x = inputs.clone();
            for s in &stages {
                let tg = s.is_last().then_some(targets);
                let out = if eval {
                    s.forward_eval(&x, tg).unwrap()
                } else {
                    s.forward(&x, tg).unwrap().0
                };
                match out {
                    StageOutput::Activations(a) => {
                        assert!(!a.track_op(), "activations are detached");
                        x = a;
                    }
                    StageOutput::Loss(l) => return l,
                }
            }
            unreachable!()
        };
        let full = run(&b.inputs, &b.targets, false);
        assert_eq!(full.per_sequence.len(), 3);
        assert_eq!(full.tokens, 27);
        let mean: f32 = full.per_sequence.iter().sum::<f32>() / 3.0;
        assert!((mean - full.mean).abs() < 1e-5);
        for r in 0..3 {
            let alone = run(
                &b.inputs.narrow(0, r, 1).unwrap(),
                &b.targets.narrow(0, r, 1).unwrap(),
                false,
            );
            assert!((alone.mean - full.per_sequence[r]).abs() < 1e-5);
        }
        let eval = run(&b.inputs, &b.targets, true);
        assert_eq!(eval, full);
        // No graph: the evaluation output of a middle stage does not track its weights.
        let x0 = stages[0].forward_eval(&b.inputs, None).unwrap();
        let h = stages[1]
            .run_inner(x0.activations().unwrap(), false)
            .unwrap();
        assert!(!h.track_op());
        assert!(
            stages[1]
                .run_inner(x0.activations().unwrap(), true)
                .unwrap()
                .track_op()
        );
    }

    #[test]
    fn stage_built_alone_equals_stage_in_model() {
        let cfg = ModelConfig::tiny();
        let all = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
        let alone = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
        for (a, b) in all[1].params().iter().zip(alone.params()) {
            assert_eq!(a.name(), b.name());
            let d = abs_sum(&(a.var().as_tensor() - b.var().as_tensor()).unwrap());
            assert_eq!(d, 0.0);
        }
        assert_eq!(all[1].num_parameters(), cfg.stage_param_count(1).unwrap());
        // Same outputs on the same input; and a different seed gives a different stage, so the
        // comparison above can fail.
        let x = random_like(&alone.input_dims(2, 5), 4, DType::F32);
        let a = all[1].forward_eval(&x, None).unwrap();
        let b = alone.forward_eval(&x, None).unwrap();
        assert_eq!(
            abs_sum(&(a.activations().unwrap() - b.activations().unwrap()).unwrap()),
            0.0
        );
        let mut other_cfg = cfg.clone();
        other_cfg.init_seed += 1;
        let other = Stage::new(&other_cfg, 1, StageOptions::cpu()).unwrap();
        let c = other.forward_eval(&x, None).unwrap();
        assert!(abs_sum(&(a.activations().unwrap() - c.activations().unwrap()).unwrap()) > 0.0);
    }
}
