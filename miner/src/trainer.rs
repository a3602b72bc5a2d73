//! The miner's trainer: the honest [`StageTrainer`] that validators replay, with the dishonest
//! behaviour of `--adversary` (if any) wrapped around it, and the non-finite events counted as a
//! metric.

use iota_model::memory::StageMemory;
use iota_trainer::{HopOutput, StageTrainer, TrainerError};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::adversary::{Adversary, IDLE_PER_COMPUTE, LAZY_LOSS_FACTOR, MIN_IDLE, add_noise};
use crate::capacity::{StageSpeed, measure_stage};
use crate::config::DeviceSpec;
use crate::error::MinerError;

/// A stage trained for the orchestrator: honest unless an adversary is set.
#[derive(Debug)]
pub struct MinerTrainer {
    honest: StageTrainer,
    adversary: Option<Adversary>,
    rng: StdRng,
    /// Backward hops a freeloader claimed without computing them.
    claimed_hops: u64,
}

impl MinerTrainer {
    /// Wraps `honest`; `seed` drives the noise of [`Adversary::Noise`].
    pub fn new(honest: StageTrainer, adversary: Option<Adversary>, seed: u64) -> Self {
        Self {
            honest,
            adversary,
            rng: StdRng::seed_from_u64(seed),
            claimed_hops: 0,
        }
    }

    /// The honest trainer underneath.
    pub fn honest(&self) -> &StageTrainer {
        &self.honest
    }

    fn is(&self, a: Adversary) -> bool {
        self.adversary == Some(a)
    }

    /// A claim-speed cheater idles [`IDLE_PER_COMPUTE`] times the hop's compute after it, at
    /// least [`MIN_IDLE`].
    fn idle_if_slow(&self, started: std::time::Instant) {
        if self.is(Adversary::ClaimSpeed) {
            std::thread::sleep((started.elapsed() * IDLE_PER_COMPUTE).max(MIN_IDLE));
        }
    }

    /// Counts what the honest trainer rolled back during `f` as a metric.
    fn counted<T>(
        &mut self,
        f: impl FnOnce(&mut StageTrainer) -> Result<T, TrainerError>,
    ) -> Result<T, MinerError> {
        let before = self.honest.nonfinite_events();
        let result = f(&mut self.honest);
        let rolled_back = self.honest.nonfinite_events().saturating_sub(before);
        if rolled_back > 0 {
            metrics::counter!("iota_miner_nonfinite_total").increment(rolled_back);
        }
        Ok(result?)
    }

    /// The bytes a cheater sends instead of `bytes`: zeros, or the values with noise added.
    fn tamper(
        &mut self,
        bytes: Option<Vec<u8>>,
        noise: bool,
    ) -> Result<Option<Vec<u8>>, MinerError> {
        let Some(bytes) = bytes else {
            return Ok(None);
        };
        let (dims, mut values) = self.honest.decode_boundary(&bytes)?;
        if noise {
            add_noise(&mut values, &mut self.rng);
        } else {
            values.iter_mut().for_each(|v| *v = 0.0);
        }
        Ok(Some(self.honest.encode_boundary(&dims, &values)?))
    }

    fn zeros_like_output(&self) -> Result<Vec<u8>, MinerError> {
        let run = self.honest.run();
        let dims = [
            run.micro_batch as usize,
            run.seq_len as usize,
            run.boundary_dim as usize,
        ];
        let zeros = vec![0.0f32; dims.iter().product()];
        Ok(self.honest.encode_boundary(&dims, &zeros)?)
    }

    /// See [`StageTrainer::forward`].
    pub fn forward(
        &mut self,
        sample_id: i64,
        input: Option<&[u8]>,
    ) -> Result<HopOutput, MinerError> {
        let last = self.honest.stage_index() + 1 == self.honest.run().stages;
        if last && self.is(Adversary::Freeload) {
            // Computes the loss only; claims the backward with a zero gradient.
            let mut out = self.counted(|t| t.evaluate(sample_id, input))?;
            out.bytes = Some(self.zeros_like_output()?);
            self.claimed_hops += 1;
            return Ok(out);
        }
        let started = std::time::Instant::now();
        let mut out = self.counted(|t| t.forward(sample_id, input))?;
        self.idle_if_slow(started);
        if self.is(Adversary::Zeros) || (!last && self.is(Adversary::Noise)) {
            let noise = self.is(Adversary::Noise);
            out.bytes = self.tamper(out.bytes.take(), noise)?;
        }
        if self.is(Adversary::LazyLoss) {
            out.loss = out.loss.map(|l| l * LAZY_LOSS_FACTOR);
            if let Some(seq) = out.sequence_losses.as_mut() {
                seq.iter_mut().for_each(|v| *v *= LAZY_LOSS_FACTOR);
            }
        }
        if self.is(Adversary::ForgeLoss) {
            out.loss = out.loss.map(|l| l * LAZY_LOSS_FACTOR);
            out.sequence_losses = None;
        }
        Ok(out)
    }

    /// See [`StageTrainer::backward`].
    pub fn backward(&mut self, sample_id: i64, grad: &[u8]) -> Result<HopOutput, MinerError> {
        if self.is(Adversary::Freeload) {
            // The gradient is read (a malformed one is refused as from an honest miner), then
            // nothing is computed.
            self.honest.decode_boundary(grad)?;
            if !self.honest.forget(sample_id as u64) {
                return Err(MinerError::BadInput(format!(
                    "backward of sample {sample_id} with no forward"
                )));
            }
            self.claimed_hops += 1;
            let bytes = match self.honest.stage_index() {
                0 => None,
                _ => Some(self.zeros_like_output()?),
            };
            let inner_step = self.honest.inner_steps();
            let run = self.honest.run();
            let tokens = u64::from(run.micro_batch) * u64::from(run.seq_len);
            return Ok(HopOutput {
                bytes,
                inner_step,
                weights_digest: self.honest.weights_digest()?,
                loss: None,
                sequence_losses: None,
                tokens,
            });
        }
        let started = std::time::Instant::now();
        let mut out = self.counted(|t| t.backward(sample_id, grad))?;
        self.idle_if_slow(started);
        if self.is(Adversary::Zeros) {
            out.bytes = self.tamper(out.bytes.take(), false)?;
        }
        Ok(out)
    }

    /// See [`StageTrainer::load_partition`]; a stale-weights cheater keeps its own weights after
    /// its first epoch.
    pub fn load_partition(&mut self, j: u32, values: Option<&[f32]>) -> Result<(), MinerError> {
        if self.is(Adversary::StaleWeights) && self.honest.epoch().is_some() {
            return Ok(());
        }
        Ok(self.honest.load_partition(j, values)?)
    }

    /// See [`StageTrainer::begin_epoch`].
    pub fn begin_epoch(&mut self, epoch: u64) -> Result<(), MinerError> {
        self.claimed_hops = 0;
        Ok(self.honest.begin_epoch(epoch)?)
    }

    /// See [`StageTrainer::commit`].
    pub fn commit(&mut self, sample_id: i64) -> Result<bool, MinerError> {
        self.counted(|t| t.commit(sample_id))
    }

    /// See [`StageTrainer::discard`].
    pub fn discard(&mut self, sample_id: i64) {
        self.honest.discard(sample_id);
    }

    /// See [`StageTrainer::forget`].
    pub fn forget(&mut self, sample: u64) -> bool {
        self.honest.forget(sample)
    }

    /// See [`StageTrainer::finish_training`].
    pub fn finish_training(&mut self) -> Result<(), MinerError> {
        self.counted(StageTrainer::finish_training)
    }

    /// See [`StageTrainer::pseudo_gradient`].
    pub fn pseudo_gradient(&self, j: u32) -> Result<Vec<f32>, MinerError> {
        Ok(self.honest.pseudo_gradient(j)?)
    }

    /// See [`StageTrainer::sparse_pseudo_gradient`].
    pub fn sparse_pseudo_gradient(&mut self, j: u32) -> Result<Vec<u8>, MinerError> {
        Ok(self.honest.sparse_pseudo_gradient(j)?)
    }

    /// See [`StageTrainer::apply_update`]; a stale-weights cheater keeps its own weights after
    /// its first epoch, as with dense merges.
    pub fn apply_update(&mut self, j: u32, update: Option<&[u8]>) -> Result<(), MinerError> {
        if self.is(Adversary::StaleWeights) && self.honest.epoch().is_some() {
            return Ok(());
        }
        Ok(self.honest.apply_update(j, update)?)
    }

    /// See [`StageTrainer::epoch`].
    pub fn epoch(&self) -> Option<u64> {
        self.honest.epoch()
    }

    /// See [`StageTrainer::weights_digest`].
    pub fn weights_digest(&mut self) -> Result<String, MinerError> {
        Ok(self.honest.weights_digest()?)
    }

    /// Gradient hops this epoch: committed ones, and those a freeloader claimed.
    pub fn gradient_hops(&self) -> u64 {
        self.honest.gradient_hops() + self.claimed_hops
    }

    /// See [`StageTrainer::inner_steps`].
    pub fn inner_steps(&self) -> u64 {
        self.honest.inner_steps()
    }

    /// See [`StageTrainer::memory`].
    pub fn memory(&self) -> Result<StageMemory, MinerError> {
        Ok(self.honest.memory()?)
    }

    /// See [`StageTrainer::set_cache_budget`].
    pub fn set_cache_budget(&mut self, budget: usize) {
        self.honest.set_cache_budget(budget);
    }

    /// The start-up speed test on this stage ([`measure_stage`]); call it before training: it
    /// drops accumulated gradients.
    pub fn measure_speed(&mut self, device: &DeviceSpec) -> Result<StageSpeed, MinerError> {
        let seq = self.honest.run().seq_len as usize;
        measure_stage(self.honest.stage_mut(), seq, device)
    }

    /// The model.
    pub fn model(&self) -> &iota_model::ModelConfig {
        self.honest.model()
    }
}
