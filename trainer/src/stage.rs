//! One stage, its inner optimizer and the epoch's bookkeeping: what an honest miner computes and
//! what a validator replays. Blocking code (candle); the miner's loop runs it on a blocking
//! thread.
//!
//! Every epoch is replayable from public data: it starts from the merged weights with a fresh
//! inner optimizer, each hop records how many inner steps preceded it, and a step follows every
//! [`RunConfig::inner_steps_every`] gradient hops (plus one for a remainder when training ends).
//!
//! A validator replays exactly the hops the orchestrator recorded as done, in the order it
//! recorded them. So a gradient hop (a backward, or the last stage's forward) holds its
//! gradients until [`StageTrainer::commit`], which the miner calls once the orchestrator has
//! taken the hop; a hop it refused (a lapsed lease) is [`StageTrainer::discard`]ed and leaves no
//! trace, and one whose gradients are not finite is dropped before it is ever submitted.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use iota_model::bottleneck::WireEncoding as ModelWire;
use iota_model::memory::{MemoryOptions, StageMemory, stage_memory};
use iota_model::merge::{digest_f32, flatten_params, load_range};
use iota_model::{
    AdamW, AdamWConfig, BoundaryTensor, DType, Dataset, HeldGradients, Hop, HopResult, LrSchedule,
    ModelConfig, ModelError, Stage, StageOptions, StageOutput, StageRunner, StepOutcome, Tensor,
    make_batch, pseudo_gradient_range,
};
use iota_protocol::api::RunConfig;
use iota_protocol::tensor::WireEncoding;

use crate::error::TrainerError;
use crate::run::{run_dataset, run_model};
use crate::sparse::{SparseState, merged_shape};

/// The result of one hop, ready to upload.
#[derive(Clone, Debug)]
pub struct HopOutput {
    /// Encoded boundary tensor (`None` for stage 0's backward).
    pub bytes: Option<Vec<u8>>,
    /// Inner steps taken this epoch before the hop ran.
    pub inner_step: u64,
    /// BLAKE3 (hex) of the stage's flat weights the hop ran with.
    pub weights_digest: String,
    /// Mean token loss (last stage's forward).
    pub loss: Option<f32>,
    /// Per-sequence losses (last stage's forward).
    pub sequence_losses: Option<Vec<f32>>,
    /// Tokens processed.
    pub tokens: u64,
}

/// A stage being trained for the orchestrator.
pub struct StageTrainer {
    run: RunConfig,
    model: ModelConfig,
    stage_index: u32,
    opts: StageOptions,
    runner: StageRunner,
    dataset: Arc<dyn Dataset>,
    /// The highest pass over the run's data seen so far (a new one is logged).
    data_pass: u64,
    /// Flat epoch-start weights: the base of the pseudo-gradient.
    epoch_start: Vec<f32>,
    /// Epoch whose start weights are loaded.
    epoch: Option<u64>,
    gradient_hops: u64,
    pending_gradients: u32,
    /// Gradients of hops computed and not yet taken by the orchestrator, by sample.
    held: HashMap<u64, HeldGradients>,
    inner_steps: u64,
    digest: Option<(u64, String)>,
    cache_budget: usize,
    /// Initial weights, kept while an epoch start loads partitions never merged.
    initial: Option<Vec<f32>>,
    /// Non-finite results rolled back (hops dropped, steps skipped).
    nonfinite_events: u64,
    /// A sparse run's error feedback and outer momentum.
    sparse: Option<SparseState>,
}

impl std::fmt::Debug for StageTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageTrainer")
            .field("stage", &self.stage_index)
            .field("epoch", &self.epoch)
            .field("inner_steps", &self.inner_steps)
            .finish_non_exhaustive()
    }
}

fn model_wire(w: WireEncoding) -> ModelWire {
    match w {
        WireEncoding::F32 => ModelWire::F32,
        WireEncoding::Int8 => ModelWire::Int8,
        WireEncoding::Int4 => ModelWire::Int4,
    }
}

impl StageTrainer {
    /// Stage `stage` of the run with its initial weights, its data read from `data_dir` when the
    /// run names a prepared dataset; load every partition and call
    /// [`StageTrainer::begin_epoch`] before training.
    pub fn new(
        run: RunConfig,
        stage: u32,
        opts: StageOptions,
        cache_budget: usize,
        data_dir: Option<&Path>,
    ) -> Result<Self, TrainerError> {
        let model = run_model(&run)?;
        let dataset = run_dataset(&run, &model, data_dir)?;
        let s = Stage::new(&model, stage as usize, opts.clone())?;
        let adamw = Self::optimizer(&model, &run, &s)?;
        let epoch_start = flatten_params(&s)?;
        let sparse = run
            .sparse
            .map(|_| SparseState::new(epoch_start.len()))
            .transpose()?;
        Ok(Self {
            runner: StageRunner::new(s, adamw, usize::MAX),
            run,
            model,
            stage_index: stage,
            opts,
            dataset,
            data_pass: 0,
            epoch_start,
            epoch: None,
            gradient_hops: 0,
            pending_gradients: 0,
            held: HashMap::new(),
            inner_steps: 0,
            digest: None,
            cache_budget: cache_budget.max(1),
            initial: None,
            nonfinite_events: 0,
            sparse,
        })
    }

    fn optimizer(model: &ModelConfig, run: &RunConfig, s: &Stage) -> Result<AdamW, TrainerError> {
        let cfg = AdamWConfig {
            lr: run.inner_lr,
            ..AdamWConfig::default()
        }
        .for_stage(model, s.index())?;
        Ok(AdamW::new(s, cfg, LrSchedule::constant())?)
    }

    /// The model.
    pub fn model(&self) -> &ModelConfig {
        &self.model
    }
    /// The stage index.
    pub fn stage_index(&self) -> u32 {
        self.stage_index
    }
    /// Epoch whose start weights are loaded.
    pub fn epoch(&self) -> Option<u64> {
        self.epoch
    }
    /// Gradient hops committed this epoch (the merge weight the orchestrator counts).
    pub fn gradient_hops(&self) -> u64 {
        self.gradient_hops
    }
    /// Inner steps taken this epoch.
    pub fn inner_steps(&self) -> u64 {
        self.inner_steps
    }
    /// Forward caches kept for pending backwards before recomputing instead.
    pub fn cache_budget(&self) -> usize {
        self.cache_budget
    }
    /// Sets [`StageTrainer::cache_budget`] (at least one).
    pub fn set_cache_budget(&mut self, budget: usize) {
        self.cache_budget = budget.max(1);
    }
    /// What the stage needs by the memory equation, at the run's micro-batch.
    pub fn memory(&self) -> Result<StageMemory, TrainerError> {
        Ok(stage_memory(
            &self.model,
            self.stage_index as usize,
            self.run.micro_batch as usize,
            self.run.seq_len as usize,
            MemoryOptions::of(&self.opts),
        )?)
    }
    /// The stage, for a measurement before training (a miner's start-up speed test). Its
    /// weights must come out unchanged, or the epoch no longer replays.
    pub fn stage_mut(&mut self) -> &mut Stage {
        self.runner.stage_mut()
    }
    /// Non-finite results rolled back so far (hops dropped, steps skipped).
    pub fn nonfinite_events(&self) -> u64 {
        self.nonfinite_events
    }
    /// The run.
    pub fn run(&self) -> &RunConfig {
        &self.run
    }
    /// Forward caches waiting for their backward.
    pub fn in_flight(&self) -> usize {
        self.runner.in_flight()
    }
    /// The stage.
    pub fn stage(&self) -> &Stage {
        self.runner.stage()
    }

    /// Loads partition `j` of the next epoch's start weights: its merged values, or `None` for
    /// a partition never merged (initial weights from the run's seed). Call
    /// [`StageTrainer::begin_epoch`] once every partition is loaded.
    pub fn load_partition(&mut self, j: u32, values: Option<&[f32]>) -> Result<(), TrainerError> {
        let range = self.partition(j)?;
        match values {
            Some(v) => load_range(self.runner.stage(), range, v)?,
            None => {
                if self.initial.is_none() {
                    let s =
                        Stage::new(&self.model, self.stage_index as usize, StageOptions::cpu())?;
                    self.initial = Some(flatten_params(&s)?);
                }
                let init = self
                    .initial
                    .as_ref()
                    .and_then(|v| v.get(range.clone()))
                    .ok_or_else(|| {
                        TrainerError::Internal("initial weights shorter than the stage".into())
                    })?;
                load_range(self.runner.stage(), range, init)?;
            }
        }
        Ok(())
    }

    /// Starts epoch `epoch` from the loaded weights: caches and gradients dropped, a fresh inner
    /// optimizer, the weights kept as the pseudo-gradient's base.
    pub fn begin_epoch(&mut self, epoch: u64) -> Result<(), TrainerError> {
        self.runner.stage_mut().zero_grad();
        let adamw = Self::optimizer(&self.model, &self.run, self.runner.stage())?;
        self.runner.reset(adamw);
        self.epoch_start = flatten_params(self.runner.stage())?;
        self.initial = None;
        self.epoch = Some(epoch);
        if let Some(s) = self.sparse.as_mut() {
            s.forget_uploads();
        }
        self.gradient_hops = 0;
        self.pending_gradients = 0;
        self.held.clear();
        self.inner_steps = 0;
        self.digest = None;
        Ok(())
    }

    /// Drops the forward cache of a sample whose lease lapsed.
    pub fn forget(&mut self, sample: u64) -> bool {
        self.runner.forget(sample)
    }

    /// The flat range of partition `j` of this stage.
    pub fn partition(&self, j: u32) -> Result<Range<usize>, TrainerError> {
        let r = self
            .run
            .partition_range(self.stage_index, j)
            .ok_or_else(|| TrainerError::RunMismatch(format!("no partition {j}")))?;
        Ok(r.start as usize..r.end as usize)
    }

    /// Epoch-start values of `range`.
    pub fn epoch_start_range(&self, range: Range<usize>) -> Option<&[f32]> {
        self.epoch_start.get(range)
    }

    /// BLAKE3 (hex) of the current flat weights, recomputed only after they change.
    pub fn weights_digest(&mut self) -> Result<String, TrainerError> {
        let version = self.runner.stage().weights_version();
        if let Some((v, d)) = &self.digest
            && *v == version
        {
            return Ok(d.clone());
        }
        let d = digest_f32(&flatten_params(self.runner.stage())?)
            .to_hex()
            .to_string();
        self.digest = Some((version, d.clone()));
        Ok(d)
    }

    fn dims(&self) -> [usize; 3] {
        [
            self.run.micro_batch as usize,
            self.run.seq_len as usize,
            self.run.boundary_dim as usize,
        ]
    }

    fn encode(&mut self, t: &Tensor) -> Result<Vec<u8>, TrainerError> {
        let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        self.encode_boundary(t.dims(), &values).inspect_err(|e| {
            if matches!(e, TrainerError::NonFinite(_)) {
                self.nonfinite_events += 1;
            }
        })
    }

    /// `values` of shape `dims` in the run's wire encoding.
    pub fn encode_boundary(&self, dims: &[usize], values: &[f32]) -> Result<Vec<u8>, TrainerError> {
        let b =
            BoundaryTensor::from_f32(dims, values, model_wire(self.run.wire)).map_err(
                |e| match e {
                    ModelError::NonFinite(what) => TrainerError::NonFinite(what),
                    e => e.into(),
                },
            )?;
        Ok(b.to_bytes()?)
    }

    /// The shape and values of a boundary tensor of this run (activations or their gradient).
    pub fn decode_boundary(&self, bytes: &[u8]) -> Result<(Vec<usize>, Vec<f32>), TrainerError> {
        let t = self.decode(bytes)?;
        let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        Ok((t.dims().to_vec(), values))
    }

    fn decode(&self, bytes: &[u8]) -> Result<Tensor, TrainerError> {
        let b = BoundaryTensor::from_bytes(bytes, Some(&self.dims()))
            .map_err(|e| TrainerError::BadInput(e.to_string()))?;
        Ok(b.to_tensor(&self.opts.device)?)
    }

    fn is_last(&self) -> bool {
        self.stage_index + 1 == self.run.stages
    }

    fn record(&mut self) -> Result<(u64, String), TrainerError> {
        Ok((self.inner_steps, self.weights_digest()?))
    }

    /// The batch of `sample_id` and this stage's input for it: the previous stage's activation
    /// decoded, or the tokens on stage 0.
    fn input(
        &mut self,
        sample_id: i64,
        input: Option<&[u8]>,
    ) -> Result<(iota_model::Batch, Tensor), TrainerError> {
        let ids = self.run.sequence_ids(sample_id);
        if let Some(pass) = ids.last().map(|i| self.dataset.pass_of(*i))
            && pass > self.data_pass
        {
            self.data_pass = pass;
            tracing::info!(
                pass,
                stage = self.stage_index,
                "every training window has been used: pass {pass} over the data begins, in a new \
                 order"
            );
        }
        let batch = make_batch(self.dataset.as_ref(), &ids, &self.opts.device)?;
        let x = match input {
            None if self.stage_index == 0 => batch.inputs.clone(),
            Some(bytes) if self.stage_index > 0 => self.decode(bytes)?,
            _ => {
                return Err(TrainerError::BadInput(
                    "a forward input is needed exactly on stages after the first".into(),
                ));
            }
        };
        Ok((batch, x))
    }

    fn tokens(&self) -> u64 {
        u64::from(self.run.micro_batch) * u64::from(self.run.seq_len)
    }

    /// A forward hop of `sample_id`: `input` is the previous stage's activation (none on
    /// stage 0). On the last stage this is forward and backward at once, and the output is the
    /// input gradient.
    pub fn forward(
        &mut self,
        sample_id: i64,
        input: Option<&[u8]>,
    ) -> Result<HopOutput, TrainerError> {
        let sample = sample_id as u64;
        // A re-routed attempt of a sample this miner already holds replaces the old cache.
        self.runner.forget(sample);
        self.held.remove(&sample);
        let (batch, x) = self.input(sample_id, input)?;
        let tokens = self.tokens();
        let (inner_step, weights_digest) = self.record()?;
        let last = self.is_last();
        let recompute = self.runner.in_flight() >= self.cache_budget;
        self.runner.stage_mut().set_recompute(recompute);
        let targets = last.then(|| batch.targets.clone());
        let result = self.runner.apply(&Hop::Forward {
            sample,
            input: x,
            targets,
        });
        let output = match self.nonfinite_guard(result)? {
            HopResult::Forward { output, .. } => output,
            _ => {
                return Err(TrainerError::Internal(
                    "forward gave no forward result".into(),
                ));
            }
        };
        match output {
            StageOutput::Activations(a) => Ok(HopOutput {
                bytes: Some(self.encode(&a)?),
                inner_step,
                weights_digest,
                loss: None,
                sequence_losses: None,
                tokens,
            }),
            StageOutput::Loss(l) => {
                let grad = match self.backward_inner(sample, None)? {
                    Some(g) => g,
                    None => return Err(TrainerError::Internal("no input gradient".into())),
                };
                let bytes = self
                    .encode(&grad)
                    .inspect_err(|_| self.discard(sample_id))?;
                Ok(HopOutput {
                    bytes: Some(bytes),
                    inner_step,
                    weights_digest,
                    loss: Some(l.mean),
                    sequence_losses: Some(l.per_sequence),
                    tokens,
                })
            }
        }
    }

    /// The last stage's loss of `sample_id` at the current weights, with nothing kept or
    /// trained: no output bytes, nothing to commit.
    pub fn evaluate(
        &mut self,
        sample_id: i64,
        input: Option<&[u8]>,
    ) -> Result<HopOutput, TrainerError> {
        if !self.is_last() {
            return Err(TrainerError::Internal(
                "only the last stage computes a loss".into(),
            ));
        }
        let (batch, x) = self.input(sample_id, input)?;
        let (inner_step, weights_digest) = self.record()?;
        let out = self.runner.stage().forward_eval(&x, Some(&batch.targets))?;
        let l = out.loss_output()?;
        Ok(HopOutput {
            bytes: None,
            inner_step,
            weights_digest,
            loss: Some(l.mean),
            sequence_losses: Some(l.per_sequence.clone()),
            tokens: self.tokens(),
        })
    }

    /// A backward hop: `grad` is the gradient of the loss with respect to this stage's output.
    pub fn backward(&mut self, sample_id: i64, grad: &[u8]) -> Result<HopOutput, TrainerError> {
        let sample = sample_id as u64;
        let g = self.decode(grad)?;
        let tokens = self.tokens();
        let (inner_step, weights_digest) = self.record()?;
        let grad_input = self.backward_inner(sample, Some(g))?;
        let bytes = match grad_input {
            Some(t) => Some(self.encode(&t).inspect_err(|_| self.discard(sample_id))?),
            None => None,
        };
        Ok(HopOutput {
            bytes,
            inner_step,
            weights_digest,
            loss: None,
            sequence_losses: None,
            tokens,
        })
    }

    /// The backward of `sample`, its gradients held until [`StageTrainer::commit`].
    fn backward_inner(
        &mut self,
        sample: u64,
        grad_output: Option<Tensor>,
    ) -> Result<Option<Tensor>, TrainerError> {
        let result = self.runner.backward_held(sample, grad_output.as_ref());
        let (grad_input, held) = self.nonfinite_guard(result)?;
        // Finite inputs can still overflow here (a peer's huge gradient): such a hop is dropped
        // before it is submitted, and nothing accumulated so far is touched. (The input
        // gradient is checked when it is encoded.)
        self.nonfinite_guard(held.check_finite())?;
        self.held.insert(sample, held);
        Ok(grad_input)
    }

    /// Takes in the gradients of `sample_id`'s hop once the orchestrator has recorded it, and
    /// steps when `inner_steps_every` hops have accumulated; whether it held any.
    pub fn commit(&mut self, sample_id: i64) -> Result<bool, TrainerError> {
        let Some(held) = self.held.remove(&(sample_id as u64)) else {
            return Ok(false);
        };
        self.runner.commit(held)?;
        self.gradient_hops += 1;
        self.pending_gradients += 1;
        if self.pending_gradients >= self.run.inner_steps_every {
            self.inner_step()?;
        }
        Ok(true)
    }

    /// Drops the held gradients of `sample_id`'s hop (the orchestrator did not take it).
    pub fn discard(&mut self, sample_id: i64) {
        self.held.remove(&(sample_id as u64));
    }

    /// Hops whose gradients are held, waiting for [`StageTrainer::commit`].
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// A non-finite result: the hop is dropped and never submitted. The gradients accumulated
    /// so far are only ever those of committed hops, so nothing else changes.
    fn nonfinite_guard<T>(&mut self, r: iota_model::Result<T>) -> Result<T, TrainerError> {
        match r {
            Err(ModelError::NonFinite(what)) => {
                self.nonfinite_events += 1;
                tracing::warn!(
                    stage = self.stage_index,
                    what,
                    "non-finite values: hop dropped"
                );
                Err(TrainerError::NonFinite(what))
            }
            other => Ok(other?),
        }
    }

    fn inner_step(&mut self) -> Result<(), TrainerError> {
        self.pending_gradients = 0;
        let outcome = self.runner.apply(&Hop::InnerStep {
            lr: self.run.inner_lr,
        })?;
        self.inner_steps += 1;
        if let HopResult::InnerStep(StepOutcome::Skipped(reason)) = &outcome {
            self.nonfinite_events += 1;
            tracing::warn!(stage = self.stage_index, ?reason, "inner step skipped");
        }
        Ok(())
    }

    /// Ends the epoch's training: steps the remaining accumulated gradients. Held gradients of
    /// hops never taken by the orchestrator are dropped.
    pub fn finish_training(&mut self) -> Result<(), TrainerError> {
        self.held.clear();
        if self.pending_gradients > 0 {
            self.inner_step()?;
        }
        self.runner.forget_all();
        Ok(())
    }

    /// A sparse run's upload of partition `j`: its pseudo-gradient plus what was not sent
    /// before, compressed (what the compression leaves out is owed to the next epoch).
    pub fn sparse_pseudo_gradient(&mut self, j: u32) -> Result<Vec<u8>, TrainerError> {
        let values = self.pseudo_gradient(j)?;
        let range = self.partition(j)?;
        let state = self.sparse.as_mut().ok_or_else(dense_run)?;
        state.upload(&self.run, self.stage_index, j, range, &values)
    }

    /// A sparse run's step to the next epoch's weights for partition `j`: the merged update
    /// accepted for it applied to this epoch's start weights with the outer step, or `None`
    /// (nobody's update was accepted) for this epoch's start weights unchanged. Call
    /// [`StageTrainer::begin_epoch`] once every partition is stepped.
    pub fn apply_update(&mut self, j: u32, update: Option<&[u8]>) -> Result<(), TrainerError> {
        let range = self.partition(j)?;
        let shape = merged_shape(&self.run, self.stage_index, j)?;
        let state = self.sparse.as_mut().ok_or_else(dense_run)?;
        let start = self.epoch_start.get(range.clone()).ok_or_else(|| {
            TrainerError::Internal("epoch-start weights shorter than the stage".into())
        })?;
        let merged = update
            .map(|bytes| crate::sparse::decode(bytes, shape))
            .transpose()?;
        let next = match &merged {
            Some(update) => state.step(&self.run, range.clone(), start, update)?,
            None => start.to_vec(),
        };
        state.take_back(j, range.clone(), merged.as_ref())?;
        load_range(self.runner.stage(), range, &next)?;
        Ok(())
    }

    /// Pseudo-gradient (epoch-start minus current weights) of partition `j`.
    pub fn pseudo_gradient(&self, j: u32) -> Result<Vec<f32>, TrainerError> {
        let range = self.partition(j)?;
        let start = self.epoch_start.get(range.clone()).ok_or_else(|| {
            TrainerError::Internal("epoch-start weights shorter than the stage".into())
        })?;
        Ok(pseudo_gradient_range(self.runner.stage(), range, start)?)
    }
}

fn dense_run() -> TrainerError {
    TrainerError::RunMismatch("the run's pseudo-gradients are dense".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run() -> RunConfig {
        crate::local_tiny_run("held-gradients", 8).expect("run")
    }

    fn trainer(stage: u32) -> StageTrainer {
        let mut t = StageTrainer::new(run(), stage, StageOptions::cpu(), 8, None).expect("trainer");
        for j in 0..run().partitions {
            t.load_partition(j, None).expect("init");
        }
        t.begin_epoch(0).expect("epoch");
        t
    }

    fn boundary(scale: f32, seed: u64) -> Vec<u8> {
        let r = run();
        let shape = [
            r.micro_batch as usize,
            r.seq_len as usize,
            r.boundary_dim as usize,
        ];
        let v: Vec<f32> = (0..shape.iter().product::<usize>())
            .map(|i| ((((i as u64 * 7919 + seed) % 200) as f32) - 100.0) * scale)
            .collect();
        BoundaryTensor::from_f32(&shape, &v, ModelWire::F32)
            .expect("boundary")
            .to_bytes()
            .expect("bytes")
    }

    fn pseudo_gradient(t: &mut StageTrainer) -> Vec<f32> {
        t.finish_training().expect("finish");
        (0..run().partitions)
            .flat_map(|j| t.pseudo_gradient(j).expect("pg"))
            .collect()
    }

    /// Samples 0..6 through a stage's hops (a middle stage: forward and backward; the last: its
    /// forward, which trains), each committed, except `skip` (not run at all) and `refuse` (run,
    /// then discarded as a refused hop is), with `huge` sent a gradient that overflows.
    fn epoch(t: &mut StageTrainer, skip: Option<i64>, refuse: Option<i64>, huge: Option<i64>) {
        let last = t.stage_index() + 1 == run().stages;
        for s in 0..6i64 {
            if Some(s) == skip {
                continue;
            }
            let out = t.forward(s, Some(&boundary(1e-2, s as u64))).expect("fwd");
            if last {
                assert!(out.loss.is_some());
                if Some(s) == refuse {
                    t.discard(s);
                } else {
                    assert!(t.commit(s).expect("commit"));
                }
                continue;
            }
            if Some(s) == huge {
                let dropped = t.backward(s, &boundary(1e36, s as u64));
                assert!(
                    matches!(dropped, Err(TrainerError::NonFinite(_))),
                    "an overflowing backward was not dropped: {dropped:?}"
                );
                continue;
            }
            t.backward(s, &boundary(1e-4, 100 + s as u64)).expect("bwd");
            if Some(s) == refuse {
                t.discard(s);
            } else {
                assert!(t.commit(s).expect("commit"));
            }
        }
    }

    /// A miner that checkpoints its blocks (`--checkpoint-blocks`) trains to the same bits as
    /// one that keeps whole graphs, so validators replay it without knowing.
    #[test]
    fn checkpointed_blocks_train_to_the_same_bits() {
        // The hops below feed boundary tensors: the stages after the first (the model's tests
        // cover stage 0).
        for stage in 1..run().stages {
            let mut whole = trainer(stage);
            let opts = StageOptions {
                checkpoint_blocks: true,
                ..StageOptions::cpu()
            };
            let mut checkpointed = StageTrainer::new(run(), stage, opts, 8, None).expect("trainer");
            for j in 0..run().partitions {
                checkpointed.load_partition(j, None).expect("init");
            }
            checkpointed.begin_epoch(0).expect("epoch");
            epoch(&mut whole, None, None, None);
            epoch(&mut checkpointed, None, None, None);
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            let (a, b) = (
                bits(pseudo_gradient(&mut whole)),
                bits(pseudo_gradient(&mut checkpointed)),
            );
            assert!(a.iter().any(|x| *x != 0), "stage {stage} did not train");
            assert_eq!(a, b, "stage {stage}");
        }
    }

    /// A run on the int4 wire: stage 0's output crosses as the run's encoding, checks as its
    /// slot does, and a second trainer (a validator replaying the hop) produces the same bytes;
    /// the next stage takes it as input and sends int4 gradients back.
    #[test]
    fn an_int4_run_sends_int4_hops_that_replay_to_the_same_bytes() {
        let mut r = run();
        r.wire = WireEncoding::Int4;
        let fresh = |stage: u32| {
            let mut t =
                StageTrainer::new(r.clone(), stage, StageOptions::cpu(), 8, None).expect("trainer");
            for j in 0..r.partitions {
                t.load_partition(j, None).expect("init");
            }
            t.begin_epoch(0).expect("epoch");
            t
        };
        let shape = [
            u64::from(r.micro_batch),
            u64::from(r.seq_len),
            u64::from(r.boundary_dim),
        ];
        let spec = iota_protocol::tensor::TensorSpec::Boundary {
            shape,
            encoding: WireEncoding::Int4,
        };
        let sent = fresh(0)
            .forward(3, None)
            .expect("fwd")
            .bytes
            .expect("output");
        let replayed = fresh(0)
            .forward(3, None)
            .expect("fwd")
            .bytes
            .expect("output");
        assert_eq!(sent, replayed);
        iota_protocol::tensor::check_tensor(&sent, &spec).expect("an int4 slot takes it");
        let decoded = BoundaryTensor::from_bytes(&sent, None).expect("decodes");
        assert_eq!(decoded.encoding(), ModelWire::Int4);
        assert_eq!(
            decoded.payload_bytes() as u64,
            shape[0] * shape[1] * (shape[2].div_ceil(2) + 2)
        );

        let mut next = fresh(1);
        next.forward(3, Some(&sent))
            .expect("stage 1 takes the int4 input");
        let grad = next
            .backward(3, &boundary(1e-4, 9))
            .expect("bwd")
            .bytes
            .expect("a gradient for stage 0");
        iota_protocol::tensor::check_tensor(&grad, &spec).expect("int4 gradient");
    }

    /// A sparse run over two epochs: two miners of a stage train on different samples and
    /// upload compressed pseudo-gradients; two owners of each partition publish the same merged
    /// bytes; both miners reach the same weights by applying the updates, and so does a
    /// validator folding them from the initial weights. What one epoch left out of an upload
    /// is sent the next.
    #[test]
    fn a_sparse_run_keeps_miners_owners_and_validators_in_step() {
        use crate::sparse::{SparseWeights, merged_update};
        let mut r = run();
        // Merged updates keep more than an upload: their own shape throughout.
        r.sparse = Some(iota_protocol::api::SparseEncoding {
            chunk: 256,
            k: 8,
            merged_k: Some(12),
            bits: None,
        });
        let stage = 1;
        let fresh = || {
            let mut t =
                StageTrainer::new(r.clone(), stage, StageOptions::cpu(), 8, None).expect("trainer");
            t.begin_epoch(0).expect("epoch");
            t
        };
        let (mut a, mut b) = (fresh(), fresh());
        let mut folded = SparseWeights::initial(&r, stage).expect("initial");
        assert_eq!(flatten_params(a.stage()).expect("flat"), folded.weights);
        // Miner a's error feedback as the model keeps it, with the trainer's decay and without.
        let lens: Vec<usize> = (0..r.partitions)
            .map(|j| a.partition(j).expect("range").len())
            .collect();
        let len = |j: u32| lens[j as usize];
        let mirror = |decay: f32| -> Vec<iota_model::sparse::ErrorFeedback> {
            (0..r.partitions)
                .map(|j| iota_model::sparse::ErrorFeedback::with_decay(len(j), decay))
                .collect::<Result<_, _>>()
                .expect("feedback")
        };
        let (mut decaying, mut undecayed) = (mirror(crate::sparse::FEEDBACK_DECAY), mirror(1.0));
        let mut sent_by_a = Vec::new();
        for e in 0..2u64 {
            epoch(&mut a, None, None, None);
            epoch(&mut b, Some(1), None, Some(4));
            a.finish_training().expect("finish");
            b.finish_training().expect("finish");
            let mut updates = Vec::new();
            for j in 0..r.partitions {
                let dense = a.pseudo_gradient(j).expect("pg");
                let sent = [
                    (3.0, a.sparse_pseudo_gradient(j).expect("upload")),
                    (2.0, b.sparse_pseudo_gradient(j).expect("upload")),
                ];
                let shape = crate::sparse::upload_shape(&r, stage, j).expect("shape");
                let spec = iota_protocol::tensor::TensorSpec::Sparse(shape);
                iota_protocol::tensor::check_tensor(&sent[0].1, &spec).expect("its slot takes it");
                let kept = crate::sparse::decode(&sent[0].1, shape).expect("decodes");
                let nonzero = dense.iter().filter(|v| **v != 0.0).count();
                assert!(nonzero > kept.indices.len(), "compression kept everything");
                // Each upload is what the first left out, decayed, plus this epoch's training:
                // neither what a trainer without a residual nor one without the decay sends.
                let config = crate::sparse::config_of(shape).expect("config");
                let expected = decaying[j as usize]
                    .compress(0..len(j), &dense, config)
                    .expect("upload");
                assert_eq!(crate::sparse::encode(&expected), sent[0].1, "epoch {e}");
                let without_decay = undecayed[j as usize]
                    .compress(0..len(j), &dense, config)
                    .expect("upload");
                if e == 1 {
                    assert_ne!(crate::sparse::encode(&without_decay), sent[0].1);
                    let mut plain =
                        crate::sparse::SparseState::new(a.epoch_start.len()).expect("state");
                    let range = a.partition(j).expect("range");
                    let without = plain.upload(&r, stage, j, range, &dense).expect("upload");
                    assert_ne!(without, sent[0].1);
                }
                sent_by_a.push((expected, without_decay));
                let decoded: Vec<(f64, crate::sparse::SparseVector)> = sent
                    .iter()
                    .map(|(w, b)| (*w, crate::sparse::decode(b, shape).expect("decodes")))
                    .collect();
                let owner_one = merged_update(&r, stage, j, &decoded).expect("merge");
                let owner_two = merged_update(&r, stage, j, &decoded).expect("merge");
                assert_eq!(owner_one, owner_two);
                let merged = crate::sparse::merged_shape(&r, stage, j).expect("shape");
                assert_eq!((merged.chunk, merged.k), (256, 12));
                iota_protocol::tensor::check_tensor(
                    &owner_one,
                    &iota_protocol::tensor::TensorSpec::Sparse(merged),
                )
                .expect("a merge has the merged shape");
                updates.push(owner_one);
            }
            // Partition 1 is not updated this epoch in the second round: it stays.
            let applied: Vec<Option<&[u8]>> = updates
                .iter()
                .enumerate()
                .map(|(j, u)| (e == 0 || j == 0).then_some(u.as_slice()))
                .collect();
            for t in [&mut a, &mut b] {
                for (j, u) in applied.iter().enumerate() {
                    t.apply_update(j as u32, *u).expect("apply");
                }
                t.begin_epoch(e + 1).expect("epoch");
            }
            for (j, ((sent, sent_undecayed), u)) in sent_by_a.drain(..).zip(&applied).enumerate() {
                let merged = u.map(|b| {
                    crate::sparse::decode(b, crate::sparse::merged_shape(&r, stage, j as u32)?)
                });
                let merged = merged.transpose().expect("merged");
                let n = len(j as u32);
                decaying[j]
                    .take_back(0..n, &sent, merged.as_ref())
                    .expect("take back");
                undecayed[j]
                    .take_back(0..n, &sent_undecayed, merged.as_ref())
                    .expect("take back");
            }
            folded.advance(&r, stage, &applied).expect("fold");
            let flat = flatten_params(a.stage()).expect("flat");
            assert_eq!(flat, flatten_params(b.stage()).expect("flat"));
            assert_eq!(flat, folded.weights, "epoch {e}");
            assert_eq!(folded.epoch, e + 1);
        }
        // A corrupt update is refused and changes nothing.
        let before = folded.clone();
        assert!(
            folded
                .advance(&r, stage, &[Some(&b"junk"[..]), None])
                .is_err()
        );
        assert!(a.apply_update(0, Some(b"junk")).is_err());
        assert_eq!(folded, before);
        // A dense run has no sparse uploads.
        assert!(trainer(stage).sparse_pseudo_gradient(0).is_err());
    }

    #[test]
    fn a_hop_the_orchestrator_refused_leaves_no_trace() {
        // A middle stage, and the last, whose LM head has its own gradient path.
        for stage in [1, run().stages - 1] {
            let (mut refused, mut never) = (trainer(stage), trainer(stage));
            epoch(&mut refused, None, Some(2), None);
            epoch(&mut never, Some(2), None, None);
            assert_eq!(refused.gradient_hops(), 5);
            assert_eq!(refused.held(), 0);
            assert_eq!(refused.inner_steps(), never.inner_steps());
            let pg = pseudo_gradient(&mut refused);
            assert!(
                pg.iter().any(|v| *v != 0.0),
                "stage {stage} trained nothing"
            );
            let other = pseudo_gradient(&mut never);
            let worst = pg
                .iter()
                .zip(&other)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                pg == other,
                "stage {stage}: pseudo-gradients differ by up to {worst}"
            );
        }
    }

    #[test]
    fn an_overflowing_gradient_is_dropped_and_touches_nothing_else() {
        let (mut hit, mut never) = (trainer(1), trainer(1));
        epoch(&mut hit, None, None, Some(3));
        epoch(&mut never, Some(3), None, None);
        assert!(hit.nonfinite_events() >= 1);
        assert_eq!(hit.held(), 0, "the dropped hop's gradients are held");
        assert_eq!(hit.inner_steps(), never.inner_steps());
        let pg = pseudo_gradient(&mut hit);
        assert!(pg.iter().any(|v| *v != 0.0), "nothing trained");
        assert!(
            pg == pseudo_gradient(&mut never),
            "the dropped hop changed the pseudo-gradient"
        );
    }
}
