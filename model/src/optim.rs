//! Optimizers: the inner AdamW a miner runs on its stage, and the outer Nesterov step applied to
//! averaged pseudo-gradients at merge time (DiLoCo).
//!
//! AdamW keeps its moments in the master-weight dtype (f32), whatever the compute dtype. A step is
//! transactional: a first pass computes every new weight and moment and checks it for NaN/Inf
//! without keeping it, and only then a second pass computes them again and writes them in place,
//! so a bad step leaves the stage exactly at its last good state. Both passes go a chunk of
//! [`STEP_CHUNK`] elements at a time: the step's temporaries are a few chunks, never a copy of
//! the model (for a 1.5B stage, three such copies were gigabytes).

use std::ops::Range;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::stage::Stage;

/// Elements of a tensor that one AdamW chunk updates: the step's temporaries are a few of these
/// (16 MiB each in f32), whatever the size of the stage's largest tensor.
pub const STEP_CHUNK: usize = 1 << 22;

/// Inner optimizer hyper-parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Peak learning rate (scaled by the schedule).
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay, applied to matrices only.
    pub weight_decay: f64,
    /// Clip the gradient to this L2 norm; `None` disables clipping. For the model-wide
    /// threshold of a run, give each stage [`AdamWConfig::for_stage`]: a miner sees only its own
    /// stage's gradient, so it clips to its share of the global norm (IOTA's rule).
    pub max_grad_norm: Option<f64>,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 3e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            max_grad_norm: Some(1.0),
        }
    }
}

impl AdamWConfig {
    /// This config for stage `k` of `model`, reading `max_grad_norm` as the model-wide threshold
    /// and scaling it to `max_norm * sqrt(stage_params / total_params)` ([`stage_clip_norm`]).
    /// If every stage's gradient sits at its threshold, the model-wide norm is `max_norm`.
    pub fn for_stage(&self, model: &crate::config::ModelConfig, k: usize) -> Result<Self> {
        let stage = model.stage_param_count(k)?;
        let total = model.param_count()?;
        Ok(Self {
            max_grad_norm: self.max_grad_norm.map(|c| stage_clip_norm(c, stage, total)),
            ..self.clone()
        })
    }

    fn validate(&self) -> Result<()> {
        let finite_nonneg = |v: f64| v.is_finite() && v >= 0.0;
        let ok = finite_nonneg(self.lr)
            && (0.0..1.0).contains(&self.beta1)
            && (0.0..1.0).contains(&self.beta2)
            && self.eps.is_finite()
            && self.eps > 0.0
            && finite_nonneg(self.weight_decay)
            && self.max_grad_norm.is_none_or(|c| c.is_finite() && c > 0.0);
        if ok {
            Ok(())
        } else {
            Err(ModelError::Config(format!("invalid AdamW config {self:?}")))
        }
    }
}

/// Linear warmup then cosine decay to `min_lr_ratio` of the peak at `total_steps`, constant after.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// Steps of linear warmup (the first step uses `1/warmup_steps` of the peak).
    pub warmup_steps: u64,
    /// Step at which the cosine reaches its floor.
    pub total_steps: u64,
    /// Floor as a fraction of the peak.
    pub min_lr_ratio: f64,
}

impl LrSchedule {
    /// Constant learning rate.
    pub fn constant() -> Self {
        Self {
            warmup_steps: 0,
            total_steps: 0,
            min_lr_ratio: 1.0,
        }
    }

    /// Multiplier of the peak learning rate for 1-based step `step`.
    pub fn factor(&self, step: u64) -> f64 {
        if self.warmup_steps > 0 && step <= self.warmup_steps {
            return step as f64 / self.warmup_steps as f64;
        }
        if step >= self.total_steps || self.total_steps <= self.warmup_steps {
            return if self.total_steps == 0 {
                1.0
            } else {
                self.min_lr_ratio
            };
        }
        let p = (step - self.warmup_steps) as f64 / (self.total_steps - self.warmup_steps) as f64;
        self.min_lr_ratio
            + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
    }

    fn validate(&self) -> Result<()> {
        if (0.0..=1.0).contains(&self.min_lr_ratio) {
            Ok(())
        } else {
            Err(ModelError::Config(format!(
                "min_lr_ratio {} not in [0, 1]",
                self.min_lr_ratio
            )))
        }
    }
}

/// Why a step was not applied.
#[derive(Clone, Debug, PartialEq)]
pub enum SkipReason {
    /// The loss was NaN or infinite.
    NonFiniteLoss,
    /// An activation or activation gradient crossing a stage boundary was NaN or infinite.
    NonFiniteActivation,
    /// A gradient held NaN or infinity.
    NonFiniteGradient,
    /// The update would have produced NaN or infinite weights or moments.
    NonFiniteUpdate,
}

/// Result of [`AdamW::step`].
#[derive(Clone, Debug, PartialEq)]
pub enum StepOutcome {
    /// Weights were updated.
    Applied {
        /// 1-based optimizer step.
        step: u64,
        /// Learning rate used.
        lr: f64,
        /// Norm of the (averaged) gradient before clipping.
        grad_norm: f64,
    },
    /// Nothing changed except that gradients were dropped.
    Skipped(SkipReason),
}

/// An update computed by [`AdamW::prepare`] and not yet written: lets a caller step several
/// stages transactionally (all commit, or all skip).
#[derive(Debug)]
pub struct PreparedStep {
    kind: Prepared,
    params: usize,
}

#[derive(Debug)]
enum Prepared {
    Update {
        step: u64,
        lr: f64,
        grad_norm: f64,
        coefficients: Coefficients,
    },
    Skip(SkipReason),
}

/// What one step multiplies by, fixed before any element is touched.
#[derive(Clone, Copy, Debug)]
struct Coefficients {
    /// From the accumulated gradient to the clipped token-mean one.
    grad_scale: f64,
    beta1: f64,
    beta2: f64,
    inv_bias1: f64,
    inv_bias2: f64,
    eps: f64,
    lr: f64,
    weight_decay: f64,
}

impl Coefficients {
    /// New weights, first and second moments for elements `at..at + len` of the flat weights,
    /// gradient and moments `[w, g, m, v]`; `decays` for matrices.
    fn update(
        &self,
        decays: bool,
        [w, g, m, v]: [&Tensor; 4],
        at: usize,
        len: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let [w, g, m, v] = [w, g, m, v].map(|t| t.narrow(0, at, len));
        let (w, g, m, v) = (w?, g?, m?, v?);
        let (b1, b2) = (self.beta1, self.beta2);
        let g = (g * self.grad_scale)?;
        let m = ((m * b1)? + (&g * (1.0 - b1))?)?;
        let v = ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
        let denom = ((&v * self.inv_bias2)?.sqrt()? + self.eps)?;
        let update = ((&m * self.inv_bias1)? / denom)?;
        let decay = if decays {
            1.0 - self.lr * self.weight_decay
        } else {
            1.0
        };
        let w = ((w * decay)? - (update * self.lr)?)?;
        Ok((w, m, v))
    }
}

/// Calls `f(offset, len)` for consecutive chunks of at most `chunk` elements covering `total`.
fn for_each_chunk(
    total: usize,
    chunk: usize,
    mut f: impl FnMut(usize, usize) -> Result<()>,
) -> Result<()> {
    let chunk = chunk.max(1);
    let mut offset = 0;
    while offset < total {
        let len = chunk.min(total - offset);
        f(offset, len)?;
        offset += len;
    }
    Ok(())
}

/// Whether `a` and `b` are views of one storage (candle keeps its own check private).
fn shares_storage(a: &Tensor, b: &Tensor) -> bool {
    // One lock at a time: the first guard is dropped before the second is taken.
    let first = {
        let (storage, _) = a.storage_and_layout();
        &*storage as *const candle_core::Storage
    };
    let (second, _) = b.storage_and_layout();
    std::ptr::eq(first, &*second)
}

/// `t` as one dimension, sharing its storage, so that writing into the view writes into `t`.
fn flat_view(t: &Tensor, what: &str) -> Result<Tensor> {
    if !t.is_contiguous() {
        return Err(ModelError::InvalidInput(format!(
            "{what} is not contiguous: it cannot be updated in place"
        )));
    }
    Ok(t.flatten_all()?)
}

impl PreparedStep {
    /// Why the step would be skipped, if it would.
    pub fn skip_reason(&self) -> Option<&SkipReason> {
        match &self.kind {
            Prepared::Skip(r) => Some(r),
            Prepared::Update { .. } => None,
        }
    }
    /// Norm of the mean gradient before clipping (`None` for a skipped step).
    pub fn grad_norm(&self) -> Option<f64> {
        match &self.kind {
            Prepared::Update { grad_norm, .. } => Some(*grad_norm),
            Prepared::Skip(_) => None,
        }
    }
}

/// AdamW with moments in the master-weight dtype, global-norm clipping and a schedule.
///
/// The step divides the accumulated gradients by [`Stage::backward_tokens`], so it steps on
/// the token-mean loss over all micro-batches since the last step. The learning rate comes from
/// the schedule ([`AdamW::step`]) or from the caller ([`AdamW::step_with`]): a miner follows the
/// run's global schedule, not a count of its own steps.
#[derive(Debug)]
pub struct AdamW {
    cfg: AdamWConfig,
    schedule: LrSchedule,
    step: u64,
    skipped: u64,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    chunk: usize,
}

impl AdamW {
    /// Zero moments shaped like `stage`'s parameters.
    pub fn new(stage: &Stage, cfg: AdamWConfig, schedule: LrSchedule) -> Result<Self> {
        cfg.validate()?;
        schedule.validate()?;
        // Separate allocations: the moments are written in place.
        let zeros = || {
            stage
                .params()
                .iter()
                .map(|p| Ok(p.var().as_tensor().zeros_like()?))
                .collect::<Result<Vec<_>>>()
        };
        Ok(Self {
            cfg,
            schedule,
            step: 0,
            skipped: 0,
            m: zeros()?,
            v: zeros()?,
            chunk: STEP_CHUNK,
        })
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }
    /// Steps applied so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }
    /// Steps skipped because of NaN/Inf.
    pub fn skipped_count(&self) -> u64 {
        self.skipped
    }
    /// Learning rate the next step will use.
    pub fn next_lr(&self) -> f64 {
        self.cfg.lr * self.schedule.factor(self.step + 1)
    }
    pub(crate) fn moments(&self) -> (&[Tensor], &[Tensor]) {
        (&self.m, &self.v)
    }
    pub(crate) fn set_state(&mut self, step: u64, m: Vec<Tensor>, v: Vec<Tensor>) -> Result<()> {
        // The moments are written in place: no two may share storage.
        let mut v = v;
        for (m, v) in m.iter().zip(v.iter_mut()) {
            if shares_storage(m, v) {
                *v = v.copy()?;
            }
        }
        self.step = step;
        self.m = m;
        self.v = v;
        Ok(())
    }

    /// Record a skipped step: drop the stage's gradients, count and log it.
    pub fn skip(&mut self, stage: &mut Stage, reason: SkipReason) -> StepOutcome {
        stage.zero_grad();
        self.skipped += 1;
        tracing::warn!(
            target: "iota_model::optim",
            stage = stage.index(),
            step = self.step + 1,
            skipped_total = self.skipped,
            reason = ?reason,
            "non-finite values: step skipped, weights and moments kept at the last good state"
        );
        StepOutcome::Skipped(reason)
    }

    /// Apply one update with the schedule's learning rate for step `step_count() + 1`, from the
    /// token-mean of the gradients accumulated in `stage`, then clear them.
    pub fn step(&mut self, stage: &mut Stage) -> Result<StepOutcome> {
        let lr = self.next_lr();
        self.step_with(stage, lr)
    }

    /// [`AdamW::step`] with the learning rate `lr` given by the caller (the run's schedule at the
    /// current global step); the bias correction uses this optimizer's own step count.
    pub fn step_with(&mut self, stage: &mut Stage, lr: f64) -> Result<StepOutcome> {
        let p = self.prepare(stage, lr)?;
        self.commit(stage, p)
    }

    /// Set the step count used for bias correction (e.g. from the run state when a miner
    /// joins mid-run; the moments are kept).
    pub fn set_step_count(&mut self, step: u64) {
        self.step = step;
    }

    /// Write a prepared update into `stage` (or record its skip) and clear the gradients.
    pub fn commit(&mut self, stage: &mut Stage, prepared: PreparedStep) -> Result<StepOutcome> {
        if prepared.params != stage.params().len() || self.m.len() != stage.params().len() {
            return Err(ModelError::InvalidInput(
                "prepared step belongs to another stage".into(),
            ));
        }
        let (t, lr, grad_norm, coefficients) = match prepared.kind {
            Prepared::Skip(reason) => return Ok(self.skip(stage, reason)),
            Prepared::Update {
                step,
                lr,
                grad_norm,
                coefficients,
            } => (step, lr, grad_norm, coefficients),
        };
        let chunk = self.chunk;
        for (i, p) in stage.params().iter().enumerate() {
            let Some(g) = stage.grad(i) else { continue };
            let w = flat_view(p.var().as_tensor(), p.name())?;
            let m = flat_view(&self.m[i], "a first moment")?;
            let v = flat_view(&self.v[i], "a second moment")?;
            let g = g.flatten_all()?;
            for_each_chunk(w.elem_count(), chunk, |at, len| {
                let (nw, nm, nv) = coefficients.update(p.decay(), [&w, &g, &m, &v], at, len)?;
                w.slice_set(&nw, 0, at)?;
                m.slice_set(&nm, 0, at)?;
                v.slice_set(&nv, 0, at)?;
                Ok(())
            })?;
        }
        stage.mark_weights_changed();
        self.step = t;
        stage.zero_grad();
        Ok(StepOutcome::Applied {
            step: t,
            lr,
            grad_norm,
        })
    }

    /// Compute the update from the gradients accumulated in `stage` with learning rate `lr`,
    /// without writing anything.
    pub fn prepare(&self, stage: &Stage, lr: f64) -> Result<PreparedStep> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(ModelError::InvalidInput(format!("learning rate {lr}")));
        }
        let params = stage.params().len();
        let skip = |r| PreparedStep {
            kind: Prepared::Skip(r),
            params,
        };
        let n = stage.backward_tokens();
        if n == 0 {
            return Err(ModelError::InvalidInput(
                "no gradients accumulated since the last step".into(),
            ));
        }
        if self.m.len() != stage.params().len() {
            return Err(ModelError::InvalidInput(
                "optimizer was built for another stage".into(),
            ));
        }
        let inv_n = 1.0 / n as f64;
        // Squared norm in f64 on the host: one scalar per tensor, independent of tensor sizes.
        let mut sq = 0f64;
        for i in 0..stage.params().len() {
            if let Some(g) = stage.grad(i) {
                sq += g
                    .sqr()?
                    .sum_all()?
                    .to_dtype(DType::F64)?
                    .to_scalar::<f64>()?;
            }
        }
        let grad_norm = sq.sqrt() * inv_n;
        if !grad_norm.is_finite() {
            return Ok(skip(SkipReason::NonFiniteGradient));
        }
        let clip = match self.cfg.max_grad_norm {
            Some(c) if grad_norm > c => c / (grad_norm + 1e-6),
            _ => 1.0,
        };
        let t = self.step + 1;
        let (b1, b2) = (self.cfg.beta1, self.cfg.beta2);
        let bc1 = 1.0 - b1.powi(t.min(i32::MAX as u64) as i32);
        let bc2 = 1.0 - b2.powi(t.min(i32::MAX as u64) as i32);
        let coefficients = Coefficients {
            grad_scale: inv_n * clip,
            beta1: b1,
            beta2: b2,
            inv_bias1: 1.0 / bc1,
            inv_bias2: 1.0 / bc2,
            eps: self.cfg.eps,
            lr,
            weight_decay: self.cfg.weight_decay,
        };
        // The check pass: every new value is computed and dropped; one NaN/Inf skips the step.
        // A tensor no gradient reached is left untouched (its moments are not decayed either).
        let mut check = 0f32;
        for (i, p) in stage.params().iter().enumerate() {
            let Some(g) = stage.grad(i) else { continue };
            let w = p.var().as_tensor().flatten_all()?;
            let (m, v, g) = (
                self.m[i].flatten_all()?,
                self.v[i].flatten_all()?,
                g.flatten_all()?,
            );
            for_each_chunk(w.elem_count(), self.chunk, |at, len| {
                let new = coefficients.update(p.decay(), [&w, &g, &m, &v], at, len)?;
                for t in [&new.0, &new.1, &new.2] {
                    check += (t * 0.0)?
                        .sum_all()?
                        .to_dtype(DType::F32)?
                        .to_scalar::<f32>()?;
                }
                Ok(())
            })?;
            if !check.is_finite() {
                return Ok(skip(SkipReason::NonFiniteUpdate));
            }
        }
        Ok(PreparedStep {
            kind: Prepared::Update {
                step: t,
                lr,
                grad_norm,
                coefficients,
            },
            params,
        })
    }
}

/// Step several stages transactionally with learning rate `lr`: every update is computed and
/// checked first; if any stage would skip (NaN/Inf), every stage skips with that reason and no
/// weight changes anywhere. `optimizers[k]` belongs to `stages[k]`.
pub fn step_stages(
    optimizers: &mut [AdamW],
    stages: &mut [Stage],
    lr: f64,
) -> Result<Vec<StepOutcome>> {
    if optimizers.len() != stages.len() {
        return Err(ModelError::InvalidInput(format!(
            "{} optimizers for {} stages",
            optimizers.len(),
            stages.len()
        )));
    }
    let prepared = optimizers
        .iter()
        .zip(stages.iter())
        .map(|(o, s)| o.prepare(s, lr))
        .collect::<Result<Vec<_>>>()?;
    if let Some(reason) = prepared.iter().find_map(|p| p.skip_reason().cloned()) {
        return Ok(optimizers
            .iter_mut()
            .zip(stages.iter_mut())
            .map(|(o, s)| o.skip(s, reason.clone()))
            .collect());
    }
    optimizers
        .iter_mut()
        .zip(stages.iter_mut())
        .zip(prepared)
        .map(|((o, s), p)| o.commit(s, p))
        .collect()
}

/// IOTA's per-stage clipping threshold: a global threshold scaled by
/// `sqrt(stage parameters / model parameters)`, so the stages' norms add up to the global one.
pub fn stage_clip_norm(global: f64, stage_params: usize, total_params: usize) -> f64 {
    if total_params == 0 {
        return global;
    }
    global * (stage_params as f64 / total_params as f64).sqrt()
}

/// Outer (merge-time) optimizer settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OuterConfig {
    /// Outer learning rate (IOTA uses 0.7).
    pub lr: f32,
    /// Momentum (IOTA ramps 0.5 to 0.9).
    pub momentum: f32,
    /// Nesterov look-ahead (DiLoCo uses it).
    pub nesterov: bool,
}

impl Default for OuterConfig {
    fn default() -> Self {
        Self {
            lr: 0.7,
            momentum: 0.9,
            nesterov: true,
        }
    }
}

/// `start - current`, elementwise: the displacement a replica made during an epoch, as a
/// gradient (pointing uphill).
pub fn pseudo_gradient(start: &[f32], current: &[f32]) -> Result<Vec<f32>> {
    if start.len() != current.len() {
        return Err(ModelError::shape(
            "pseudo-gradient",
            &[start.len()],
            &[current.len()],
        ));
    }
    let pg: Vec<f32> = start.iter().zip(current).map(|(a, b)| a - b).collect();
    if pg.iter().any(|v| !v.is_finite()) {
        return Err(ModelError::NonFinite("pseudo-gradient".into()));
    }
    Ok(pg)
}

impl OuterConfig {
    /// The outer update on one slice, in place: `buf = mu * buf + g`, then
    /// `w -= lr * (g + mu * buf)` with Nesterov, `w -= lr * buf` without. `weights`, `momentum`
    /// and `avg_pseudo_grad` are the same slice of the flat view (a partition), so a caller can
    /// stream a large stage partition by partition with its momentum slice. Nothing changes if
    /// an input or the result is not finite.
    pub fn apply(
        &self,
        weights: &mut [f32],
        momentum: &mut [f32],
        avg_pseudo_grad: &[f32],
    ) -> Result<()> {
        let n = momentum.len();
        if weights.len() != n || avg_pseudo_grad.len() != n {
            return Err(ModelError::shape(
                "outer step inputs (weights, pseudo-gradient)",
                &[n, n],
                &[weights.len(), avg_pseudo_grad.len()],
            ));
        }
        if avg_pseudo_grad.iter().any(|v| !v.is_finite()) {
            return Err(ModelError::NonFinite("averaged pseudo-gradient".into()));
        }
        let (lr, mu) = (self.lr, self.momentum);
        let mut new_buf = Vec::with_capacity(n);
        let mut new_w = Vec::with_capacity(n);
        for ((w, g), b) in weights.iter().zip(avg_pseudo_grad).zip(momentum.iter()) {
            let b = mu * b + g;
            let dir = if self.nesterov { g + mu * b } else { b };
            new_buf.push(b);
            new_w.push(w - lr * dir);
        }
        if new_w.iter().chain(&new_buf).any(|v| !v.is_finite()) {
            tracing::warn!(target: "iota_model::optim", "outer step produced non-finite values; not applied");
            return Err(ModelError::NonFinite("outer step result".into()));
        }
        weights.copy_from_slice(&new_w);
        momentum.copy_from_slice(&new_buf);
        Ok(())
    }
}

/// SGD with (Nesterov) momentum on flat f32 vectors; plain scalar arithmetic so every party
/// derives the same bytes.
///
/// A step is applied either whole ([`OuterOptimizer::step`]) or partition by partition
/// ([`OuterOptimizer::step_partition`]); the step count advances once the partitions of the
/// current step cover the whole vector.
#[derive(Clone, Debug)]
pub struct OuterOptimizer {
    cfg: OuterConfig,
    momentum: Vec<f32>,
    steps: u64,
    /// Ranges already applied in the current (unfinished) step, sorted by start.
    applied: Vec<Range<usize>>,
}

impl OuterOptimizer {
    /// Zero momentum for `len` parameters.
    pub fn new(cfg: OuterConfig, len: usize) -> Result<Self> {
        if !(cfg.lr.is_finite() && cfg.lr > 0.0 && (0.0..1.0).contains(&cfg.momentum)) {
            return Err(ModelError::Config(format!("invalid outer config {cfg:?}")));
        }
        Ok(Self {
            cfg,
            momentum: vec![0.0; len],
            steps: 0,
            applied: Vec::new(),
        })
    }

    /// Settings.
    pub fn config(&self) -> &OuterConfig {
        &self.cfg
    }
    /// Change the momentum coefficient (for a ramp).
    pub fn set_momentum(&mut self, momentum: f32) -> Result<()> {
        if !(0.0..1.0).contains(&momentum) {
            return Err(ModelError::Config(format!(
                "momentum {momentum} not in [0, 1)"
            )));
        }
        self.cfg.momentum = momentum;
        Ok(())
    }
    /// Momentum buffer.
    pub fn momentum_buffer(&self) -> &[f32] {
        &self.momentum
    }
    /// Replace the momentum buffer (from a checkpoint).
    pub fn set_momentum_buffer(&mut self, buf: Vec<f32>) -> Result<()> {
        if buf.len() != self.momentum.len() {
            return Err(ModelError::shape(
                "outer momentum",
                &[self.momentum.len()],
                &[buf.len()],
            ));
        }
        if buf.iter().any(|v| !v.is_finite()) {
            return Err(ModelError::NonFinite("outer momentum".into()));
        }
        self.momentum = buf;
        Ok(())
    }
    /// Outer steps completed.
    pub fn steps(&self) -> u64 {
        self.steps
    }
    /// Set the completed-step count (from a checkpoint or the run state).
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }
    /// Whether some but not all partitions of the current step were applied.
    pub fn step_in_progress(&self) -> bool {
        !self.applied.is_empty()
    }

    /// Apply the outer step to partition `range` of the flat view: `weights` are the
    /// epoch-start (global) weights of that range, updated in place, and `avg_pseudo_grad` the
    /// merged pseudo-gradient of the same range; the momentum slice `range` is used and updated.
    /// Each range may be applied once per step; the step completes when the ranges cover the
    /// whole vector. A failed call changes nothing.
    pub fn step_partition(
        &mut self,
        range: Range<usize>,
        weights: &mut [f32],
        avg_pseudo_grad: &[f32],
    ) -> Result<()> {
        let n = self.momentum.len();
        if range.start > range.end || range.end > n {
            return Err(ModelError::InvalidInput(format!(
                "partition {range:?} outside 0..{n}"
            )));
        }
        if self
            .applied
            .iter()
            .any(|r| r.start < range.end && range.start < r.end)
        {
            return Err(ModelError::InvalidInput(format!(
                "partition {range:?} overlaps one already applied in this outer step"
            )));
        }
        self.cfg
            .apply(weights, &mut self.momentum[range.clone()], avg_pseudo_grad)?;
        let pos = self.applied.partition_point(|r| r.start < range.start);
        self.applied.insert(pos, range);
        let covered: usize = self.applied.iter().map(|r| r.len()).sum();
        if covered == n {
            self.applied.clear();
            self.steps += 1;
        }
        Ok(())
    }

    /// Apply the averaged pseudo-gradient to the epoch-start (global) weights in place:
    /// `buf = mu * buf + g`, then `w -= lr * (g + mu * buf)` with Nesterov, `w -= lr * buf`
    /// without. Nothing changes if the inputs or the result are not finite.
    pub fn step(&mut self, weights: &mut [f32], avg_pseudo_grad: &[f32]) -> Result<()> {
        if self.step_in_progress() {
            return Err(ModelError::InvalidInput(
                "a partitioned outer step is in progress".into(),
            ));
        }
        let n = self.momentum.len();
        self.step_partition(0..n, weights, avg_pseudo_grad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_shape() {
        let s = LrSchedule {
            warmup_steps: 10,
            total_steps: 110,
            min_lr_ratio: 0.1,
        };
        assert!((s.factor(1) - 0.1).abs() < 1e-12);
        assert!((s.factor(10) - 1.0).abs() < 1e-12);
        assert!((s.factor(60) - 0.55).abs() < 1e-12);
        assert!((s.factor(110) - 0.1).abs() < 1e-12);
        assert!((s.factor(1000) - 0.1).abs() < 1e-12);
        let mut prev = 2.0;
        for t in 10..=110 {
            assert!(s.factor(t) <= prev);
            prev = s.factor(t);
        }
        assert_eq!(LrSchedule::constant().factor(5), 1.0);
    }

    #[test]
    fn outer_nesterov_matches_hand_computation() {
        let mut o = OuterOptimizer::new(
            OuterConfig {
                lr: 0.5,
                momentum: 0.9,
                nesterov: true,
            },
            2,
        )
        .unwrap();
        let mut w = vec![1.0f32, -1.0];
        o.step(&mut w, &[0.2, 0.0]).unwrap();
        // buf = 0.2; dir = 0.2 + 0.9 * 0.2 = 0.38; w = 1 - 0.19
        assert!((w[0] - 0.81).abs() < 1e-6);
        assert_eq!(w[1], -1.0);
        o.step(&mut w, &[0.2, 0.0]).unwrap();
        // buf = 0.38; dir = 0.2 + 0.342 = 0.542; w = 0.81 - 0.271
        assert!((w[0] - 0.539).abs() < 1e-6);
        assert_eq!(o.steps(), 2);
    }

    #[test]
    fn outer_rejects_bad_input_without_changing_state() {
        let mut o = OuterOptimizer::new(OuterConfig::default(), 2).unwrap();
        let mut w = vec![1.0f32, 2.0];
        assert!(o.step(&mut w, &[f32::NAN, 0.0]).is_err());
        assert!(o.step(&mut w, &[0.0]).is_err());
        assert!(o.step(&mut w, &[f32::MAX, f32::MAX]).is_err());
        assert_eq!(w, vec![1.0, 2.0]);
        assert_eq!(o.momentum_buffer(), &[0.0, 0.0]);
        assert!(
            OuterOptimizer::new(
                OuterConfig {
                    lr: -1.0,
                    ..Default::default()
                },
                1
            )
            .is_err()
        );
    }

    #[test]
    fn pseudo_gradient_plain_lr_one_restores_average() {
        // With lr 1 and no momentum, the outer step moves the start weights to the average.
        let start = vec![1.0f32, 1.0];
        let a = pseudo_gradient(&start, &[0.5, 1.5]).unwrap();
        assert_eq!(a, vec![0.5, -0.5]);
        let mut o = OuterOptimizer::new(
            OuterConfig {
                lr: 1.0,
                momentum: 0.0,
                nesterov: false,
            },
            2,
        )
        .unwrap();
        let mut w = start.clone();
        o.step(&mut w, &a).unwrap();
        assert_eq!(w, vec![0.5, 1.5]);
        assert!(pseudo_gradient(&start, &[1.0]).is_err());
    }

    use crate::config::ModelConfig;
    use crate::stage::StageOptions;
    use candle_core::DType;

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    /// The step is on the token mean of what was accumulated (the hand-checked tests above set
    /// one token's gradient), and a gradient under the clipping norm is left as it is.
    #[test]
    fn adamw_steps_on_the_token_mean_and_clips_only_above_the_norm() {
        use crate::data::{GrammarCorpus, make_batch};
        use candle_core::Device;
        let cfg = ModelConfig::tiny();
        let corpus = GrammarCorpus::new(3, 12).unwrap();
        for max_grad_norm in [None, Some(1e6)] {
            let mut pipeline = crate::pipeline::Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
            for ids in [&[10u64][..], &[11, 12, 13]] {
                let b = make_batch(&corpus, ids, &Device::Cpu).unwrap();
                pipeline.forward_backward(&b.inputs, &b.targets).unwrap();
            }
            let stage = &mut pipeline.stages_mut()[0];
            assert!(stage.backward_tokens() > 1);
            let c = AdamWConfig {
                lr: 0.1,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.0,
                max_grad_norm,
            };
            let means: Vec<Option<Tensor>> = (0..stage.params().len())
                .map(|i| stage.mean_grad(i).unwrap())
                .collect();
            let mut opt = AdamW::new(stage, c, LrSchedule::constant()).unwrap();
            let out = opt.step(stage).unwrap();
            assert!(
                matches!(out, StepOutcome::Applied { step: 1, .. }),
                "{out:?}"
            );
            let mut checked = 0;
            for (i, mean) in means.iter().enumerate() {
                let Some(mean) = mean else { continue };
                // First moment after one step: (1 - beta1) times the gradient stepped on.
                let (m, want) = (values(&opt.m[i]), values(&(mean * 0.1).unwrap()));
                let scale = want.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-12);
                let worst = m
                    .iter()
                    .zip(&want)
                    .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
                assert!(
                    worst <= 1e-5 * scale,
                    "{max_grad_norm:?}, {}: off by {worst} of {scale}",
                    stage.params()[i].name()
                );
                checked += 1;
            }
            assert!(checked > 0);
        }
    }

    #[test]
    fn adamw_matches_hand_computation_and_clips() {
        let cfg = ModelConfig::tiny();
        let mut s = Stage::new(&cfg, 2, StageOptions::cpu()).unwrap();
        let c = AdamWConfig {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.5,
            max_grad_norm: None,
        };
        let mut opt = AdamW::new(&s, c.clone(), LrSchedule::constant()).unwrap();
        let w0: Vec<Vec<f32>> = s
            .params()
            .iter()
            .map(|p| values(p.var().as_tensor()))
            .collect();
        for i in 0..s.params().len() {
            let g = (s.params()[i].var().as_tensor().ones_like().unwrap() * 0.25).unwrap();
            s.set_grad_for_test(i, g);
        }
        let out = opt.step(&mut s).unwrap();
        assert!(matches!(out, StepOutcome::Applied { step: 1, .. }));
        for (i, p) in s.params().iter().enumerate() {
            let w1 = values(p.var().as_tensor());
            // First step: m_hat = g, v_hat = g^2, so the Adam direction is g / (|g| + eps) ~ 1.
            let decay = if p.decay() { 1.0 - 0.1 * 0.5 } else { 1.0 };
            let expect = w0[i][0] * decay - 0.1 * (0.25 / (0.25 + 1e-8));
            assert!(
                (w1[0] - expect).abs() < 1e-6,
                "{}: {} vs {expect}",
                p.name(),
                w1[0]
            );
        }
        assert_eq!(s.backward_count(), 0);
        assert!(opt.step(&mut s).is_err(), "no gradients accumulated");

        // Clipping: a huge gradient is scaled to the threshold.
        let mut opt = AdamW::new(
            &s,
            AdamWConfig {
                max_grad_norm: Some(1.0),
                ..c
            },
            LrSchedule::constant(),
        )
        .unwrap();
        for i in 0..s.params().len() {
            let g = (s.params()[i].var().as_tensor().ones_like().unwrap() * 1e3).unwrap();
            s.set_grad_for_test(i, g);
        }
        match opt.step(&mut s).unwrap() {
            StepOutcome::Applied { grad_norm, .. } => {
                let n = s.num_parameters() as f64;
                assert!((grad_norm - 1e3 * n.sqrt()).abs() / grad_norm < 1e-5);
            }
            other => panic!("{other:?}"),
        }
        // Adam's first update is scale invariant, so the weights cannot show the clipping; the
        // first moment can: m = (1 - beta1) * clipped gradient, whose norm is the threshold.
        let m_norm = opt
            .moments()
            .0
            .iter()
            .map(|m| values(m).iter().map(|v| f64::from(*v).powi(2)).sum::<f64>())
            .sum::<f64>()
            .sqrt();
        assert!(
            (m_norm - (1.0 - c.beta1) * 1.0).abs() < 1e-4,
            "first-moment norm {m_norm}: the gradient was not clipped to 1"
        );
    }

    #[test]
    fn caller_given_learning_rate_is_used() {
        let cfg = ModelConfig::tiny();
        let mut s = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
        let c = AdamWConfig {
            lr: 1.0,
            weight_decay: 0.0,
            max_grad_norm: None,
            ..AdamWConfig::default()
        };
        // The schedule would give 1.0; the caller's 0.01 must win.
        let mut opt = AdamW::new(&s, c, LrSchedule::constant()).unwrap();
        let w0 = values(s.params()[0].var().as_tensor());
        let g = (s.params()[0].var().as_tensor().ones_like().unwrap() * 3.0).unwrap();
        s.set_grad_for_test(0, g);
        let out = opt.step_with(&mut s, 0.01).unwrap();
        assert!(matches!(out, StepOutcome::Applied { lr, step: 1, .. } if lr == 0.01));
        let w1 = values(s.params()[0].var().as_tensor());
        assert!(
            (w0[0] - w1[0] - 0.01).abs() < 1e-6,
            "{} -> {}",
            w0[0],
            w1[0]
        );
        assert!(opt.step_with(&mut s, f64::NAN).is_err());
        opt.set_step_count(41);
        let g = s.params()[0].var().as_tensor().ones_like().unwrap();
        s.set_grad_for_test(0, g);
        assert!(matches!(
            opt.step_with(&mut s, 0.01).unwrap(),
            StepOutcome::Applied { step: 42, .. }
        ));
    }

    #[test]
    fn per_stage_clip_shares_add_up_to_the_global_norm() {
        let cfg = ModelConfig::tiny();
        let global = AdamWConfig {
            max_grad_norm: Some(2.0),
            ..AdamWConfig::default()
        };
        let total = cfg.param_count().unwrap() as f64;
        let mut sq = 0.0;
        for k in 0..cfg.num_stages() {
            let c = global.for_stage(&cfg, k).unwrap().max_grad_norm.unwrap();
            let share = cfg.stage_param_count(k).unwrap() as f64 / total;
            assert!((c - 2.0 * share.sqrt()).abs() < 1e-12);
            sq += c * c;
        }
        assert!((sq.sqrt() - 2.0).abs() < 1e-12);
        let none = AdamWConfig {
            max_grad_norm: None,
            ..AdamWConfig::default()
        };
        assert_eq!(none.for_stage(&cfg, 0).unwrap().max_grad_norm, None);
    }

    /// One stage with an infinite gradient: no stage moves, every optimizer records the skip.
    #[test]
    fn multi_stage_step_is_all_or_nothing() {
        let cfg = ModelConfig::tiny();
        let mut stages = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
        let mut opts: Vec<AdamW> = stages
            .iter()
            .map(|s| AdamW::new(s, AdamWConfig::default(), LrSchedule::constant()).unwrap())
            .collect();
        let snapshot = |st: &[Stage]| -> Vec<Vec<f32>> {
            st.iter()
                .flat_map(|s| s.params().iter().map(|p| values(p.var().as_tensor())))
                .collect()
        };
        let set_grads = |st: &mut [Stage], bad: Option<usize>| {
            for (k, s) in st.iter_mut().enumerate() {
                for i in 0..s.params().len() {
                    let v = if bad == Some(k) && i == 1 {
                        f64::INFINITY
                    } else {
                        0.01
                    };
                    let g = (s.params()[i].var().as_tensor().ones_like().unwrap() * v).unwrap();
                    s.set_grad_for_test(i, g);
                }
            }
        };
        let before = snapshot(&stages);
        set_grads(&mut stages, Some(1));
        let out = step_stages(&mut opts, &mut stages, 1e-3).unwrap();
        assert!(
            out.iter()
                .all(|o| *o == StepOutcome::Skipped(SkipReason::NonFiniteGradient))
        );
        assert_eq!(
            snapshot(&stages),
            before,
            "stages 0 and 2 did not step either"
        );
        assert!(
            opts.iter()
                .all(|o| o.step_count() == 0 && o.skipped_count() == 1)
        );
        set_grads(&mut stages, None);
        let out = step_stages(&mut opts, &mut stages, 1e-3).unwrap();
        assert!(out.iter().all(|o| matches!(o, StepOutcome::Applied { .. })));
        assert_ne!(snapshot(&stages), before);
        assert!(step_stages(&mut opts[..2], &mut stages, 1e-3).is_err());
    }

    #[test]
    fn non_finite_gradient_is_skipped() {
        let cfg = ModelConfig::tiny();
        let mut s = Stage::new(&cfg, 0, StageOptions::cpu()).unwrap();
        let mut opt = AdamW::new(&s, AdamWConfig::default(), LrSchedule::constant()).unwrap();
        let before: Vec<Vec<f32>> = s
            .params()
            .iter()
            .map(|p| values(p.var().as_tensor()))
            .collect();
        let g = (s.params()[3].var().as_tensor().ones_like().unwrap() * f64::INFINITY).unwrap();
        s.set_grad_for_test(3, g);
        assert_eq!(
            opt.step(&mut s).unwrap(),
            StepOutcome::Skipped(SkipReason::NonFiniteGradient)
        );
        let after: Vec<Vec<f32>> = s
            .params()
            .iter()
            .map(|p| values(p.var().as_tensor()))
            .collect();
        assert_eq!(before, after);
        assert_eq!((opt.step_count(), opt.skipped_count()), (0, 1));
        assert!(
            AdamW::new(
                &s,
                AdamWConfig {
                    beta1: 1.0,
                    ..AdamWConfig::default()
                },
                LrSchedule::constant()
            )
            .is_err()
        );
    }

    /// The step as it was before it went in place: whole tensors computed aside, then set.
    /// The in-place step must give exactly these bits.
    fn reference_step(
        cfg: &AdamWConfig,
        t: u64,
        lr: f64,
        stage: &Stage,
        m: &mut [Tensor],
        v: &mut [Tensor],
    ) -> Vec<Option<Tensor>> {
        let inv_n = 1.0 / stage.backward_tokens() as f64;
        let mut sq = 0f64;
        for i in 0..stage.params().len() {
            if let Some(g) = stage.grad(i) {
                sq += g
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
            }
        }
        let grad_norm = sq.sqrt() * inv_n;
        let clip = match cfg.max_grad_norm {
            Some(c) if grad_norm > c => c / (grad_norm + 1e-6),
            _ => 1.0,
        };
        let (b1, b2) = (cfg.beta1, cfg.beta2);
        let bc1 = 1.0 - b1.powi(t as i32);
        let bc2 = 1.0 - b2.powi(t as i32);
        let mut out = Vec::new();
        for (i, p) in stage.params().iter().enumerate() {
            let Some(g) = stage.grad(i) else {
                out.push(None);
                continue;
            };
            let w = p.var().as_tensor();
            let g = (g * (inv_n * clip)).unwrap();
            let nm = ((&m[i] * b1).unwrap() + (&g * (1.0 - b1)).unwrap()).unwrap();
            let nv = ((&v[i] * b2).unwrap() + (g.sqr().unwrap() * (1.0 - b2)).unwrap()).unwrap();
            let denom = ((&nv * (1.0 / bc2)).unwrap().sqrt().unwrap() + cfg.eps).unwrap();
            let update = ((&nm * (1.0 / bc1)).unwrap() / denom).unwrap();
            let decay = if p.decay() {
                1.0 - lr * cfg.weight_decay
            } else {
                1.0
            };
            let nw = ((w * decay).unwrap() - (update * lr).unwrap()).unwrap();
            m[i] = nm;
            v[i] = nv;
            out.push(Some(nw));
        }
        out
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        values(t).iter().map(|x| x.to_bits()).collect()
    }

    /// Chunks of 7 elements cut every tensor at odd places: an offset or length off by one would
    /// move or miss elements, and the bits would differ.
    #[test]
    fn the_in_place_step_gives_the_bits_of_the_whole_tensor_step() {
        use crate::data::{GrammarCorpus, make_batch};
        use candle_core::Device;
        let cfg = ModelConfig::tiny();
        let corpus = GrammarCorpus::new(3, 12).unwrap();
        let c = AdamWConfig {
            lr: 0.05,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
            max_grad_norm: Some(0.5),
        };
        for chunk in [7, STEP_CHUNK] {
            let mut pipeline = crate::pipeline::Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
            let stages = pipeline.stages_mut().len();
            let mut opts: Vec<AdamW> = pipeline
                .stages_mut()
                .iter()
                .map(|s| AdamW::new(s, c.clone(), LrSchedule::constant()).unwrap())
                .collect();
            for o in &mut opts {
                o.chunk = chunk;
            }
            let mut moments: Vec<(Vec<Tensor>, Vec<Tensor>)> =
                opts.iter().map(|o| (o.m.clone(), o.v.clone())).collect();
            for step in 1..=3u64 {
                let b = make_batch(&corpus, &[step, step + 10], &Device::Cpu).unwrap();
                pipeline.forward_backward(&b.inputs, &b.targets).unwrap();
                for k in 0..stages {
                    let stage = &mut pipeline.stages_mut()[k];
                    let (m, v) = &mut moments[k];
                    let want = reference_step(&c, step, c.lr, stage, m, v);
                    let out = opts[k].step(stage).unwrap();
                    assert!(matches!(out, StepOutcome::Applied { .. }), "{out:?}");
                    let mut compared = 0;
                    for (i, w) in want.iter().enumerate() {
                        let Some(w) = w else { continue };
                        let p = &stage.params()[i];
                        assert_eq!(bits(p.var().as_tensor()), bits(w), "{}", p.name());
                        assert_eq!(bits(&opts[k].m[i]), bits(&m[i]), "m of {}", p.name());
                        assert_eq!(bits(&opts[k].v[i]), bits(&v[i]), "v of {}", p.name());
                        compared += 1;
                    }
                    assert!(compared > 0);
                }
            }
        }
    }

    /// A step holds a few chunks beside the stage, never a copy of it (the step it replaced
    /// computed every new weight and both moments before writing any: three copies).
    #[test]
    fn a_step_holds_chunks_not_copies_of_the_stage() {
        let cfg = ModelConfig::tiny().with_stages(vec![2]);
        let mut s = Stage::new(&cfg, 0, StageOptions::cpu()).unwrap();
        let mut opt = AdamW::new(&s, AdamWConfig::default(), LrSchedule::constant()).unwrap();
        opt.chunk = 64;
        for i in 0..s.params().len() {
            let g = (s.params()[i].var().as_tensor().ones_like().unwrap() * 0.3).unwrap();
            s.set_grad_for_test(i, g);
        }
        let stage_bytes = s.num_parameters() * 4;
        let (out, peak) = crate::alloc_count::peak_during(|| opt.step(&mut s).unwrap());
        assert!(matches!(out, StepOutcome::Applied { .. }), "{out:?}");
        assert!(
            peak < stage_bytes / 2,
            "a step held {peak} bytes at once beside a {stage_bytes}-byte stage"
        );
    }

    /// Moments handed over as one shared tensor (a checkpoint loader could) must not be written
    /// through each other.
    #[test]
    fn moments_restored_as_one_tensor_are_kept_apart() {
        let cfg = ModelConfig::tiny();
        let mut s = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
        let c = AdamWConfig::default();
        let mut opt = AdamW::new(&s, c.clone(), LrSchedule::constant()).unwrap();
        let shared: Vec<Tensor> = s
            .params()
            .iter()
            .map(|p| (p.var().as_tensor().ones_like().unwrap() * 1e-3).unwrap())
            .collect();
        opt.set_state(4, shared.clone(), shared.clone()).unwrap();
        let (mut m, mut v) = (shared.clone(), shared.clone());
        for i in 0..s.params().len() {
            let g = (s.params()[i].var().as_tensor().ones_like().unwrap() * 0.3).unwrap();
            s.set_grad_for_test(i, g);
        }
        let want = reference_step(&c, 5, c.lr, &s, &mut m, &mut v);
        opt.step(&mut s).unwrap();
        for (i, w) in want.iter().enumerate() {
            let w = w.as_ref().unwrap();
            assert_eq!(bits(s.params()[i].var().as_tensor()), bits(w));
            assert_eq!(bits(&opt.m[i]), bits(&m[i]));
            assert_eq!(bits(&opt.v[i]), bits(&v[i]));
        }
    }

    #[test]
    fn clip_norm_scaling() {
        assert!((stage_clip_norm(1.0, 25, 100) - 0.5).abs() < 1e-12);
    }
}
