//! What a miner reports when it joins: device memory and a short measured throughput.

use std::time::Instant;

use iota_model::memory::StageMemory;
use iota_model::{DType, ModelConfig, Stage, Tensor};
use iota_protocol::api::RunConfig;

use crate::config::DeviceSpec;
use crate::error::MinerError;

/// Memory available for training, in bytes: free device memory from the CUDA driver, or the
/// OS's available memory on the CPU (0 when it cannot be read).
pub fn available_memory(device: &DeviceSpec) -> u64 {
    match device.cuda_ordinal() {
        None => meminfo_available().unwrap_or(0),
        Some(n) => cuda_free_memory(n).unwrap_or(0),
    }
}

/// `MemAvailable` from `/proc/meminfo` (Linux).
fn meminfo_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_meminfo(&text)
}

fn parse_meminfo(text: &str) -> Option<u64> {
    kib_field(text, "MemAvailable:")
}

/// The value of a `Name:   123 kB` line, in bytes.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

#[cfg(feature = "cuda")]
fn cuda_free_memory(ordinal: usize) -> Option<u64> {
    // A context must be current for the driver to answer.
    let ctx = cudarc::driver::CudaContext::new(ordinal).ok()?;
    ctx.bind_to_thread().ok()?;
    let (free, _total) = cudarc::driver::result::mem_get_info().ok()?;
    Some(free as u64)
}

#[cfg(not(feature = "cuda"))]
fn cuda_free_memory(_ordinal: usize) -> Option<u64> {
    None
}

/// What the start-up test measured on the miner's own stage.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StageSpeed {
    /// Forward+backward tokens per second, one sequence at a time.
    pub tokens_per_s: f64,
    /// Device memory one sequence's forward held until its backward (0 where the device's
    /// memory cannot be read, or the allocator reused memory it already had).
    pub bytes_per_sequence: u64,
}

/// Forward+backward throughput of `stage` on sequences of `seq` tokens, one at a time, and what
/// a forward holds until its backward. Small on purpose: the test runs before any work, so it
/// must fit wherever the stage's training fits. The stage's accumulated gradients are dropped
/// afterwards; its weights are not touched.
pub fn measure_stage(
    stage: &mut Stage,
    seq: usize,
    device: &DeviceSpec,
) -> Result<StageSpeed, MinerError> {
    let pass = Pass::new(stage, 1, seq)?;
    let before = used_memory(device);
    let (_, cache) = stage.forward(&pass.input, pass.targets.as_ref())?;
    stage.options().device.synchronize()?;
    let held = used_memory(device);
    stage.backward(cache, pass.grad.as_ref())?;
    let bytes_per_sequence = match (before, held) {
        (Some(b), Some(h)) => h.saturating_sub(b),
        _ => 0,
    };
    let tokens_per_s = pass.time(stage)?;
    stage.zero_grad();
    Ok(StageSpeed {
        tokens_per_s,
        bytes_per_sequence,
    })
}

/// A figure to register with before the stage is known: one block of the run's model (with
/// the bottleneck around it) timed on one sequence, divided by the blocks of an average stage.
/// It never builds a whole stage, so it fits on any card that fits a stage; the miner reports
/// its own stage's figure once it has one ([`measure_stage`]).
pub fn estimate_tokens_per_s(
    run: &RunConfig,
    model: &ModelConfig,
    device: &DeviceSpec,
) -> Result<f64, MinerError> {
    let probe = model.clone().with_stages(vec![1, 1, 1]);
    let mut block = Stage::new(&probe, 1, device.stage_options()?)?;
    let pass = Pass::new(&block, 1, run.seq_len as usize)?;
    let per_block = pass.time(&mut block)?;
    let blocks_per_stage = model.n_layers() as f64 / model.num_stages().max(1) as f64;
    Ok(per_block / blocks_per_stage.max(1.0))
}

/// Zero inputs of one forward+backward through a stage.
struct Pass {
    input: Tensor,
    targets: Option<Tensor>,
    grad: Option<Tensor>,
    tokens: usize,
}

impl Pass {
    fn new(stage: &Stage, b: usize, t: usize) -> Result<Self, MinerError> {
        let dev = stage.options().device.clone();
        let input = if stage.is_first() {
            Tensor::zeros((b, t), DType::U32, &dev)?
        } else {
            Tensor::zeros(stage.input_dims(b, t), DType::F32, &dev)?
        };
        let targets = stage
            .is_last()
            .then(|| Tensor::zeros((b, t), DType::U32, &dev))
            .transpose()?;
        let grad = (!stage.is_last())
            .then(|| Tensor::ones(stage.output_dims(b, t), DType::F32, &dev))
            .transpose()?;
        Ok(Self {
            input,
            targets,
            grad,
            tokens: b * t,
        })
    }

    fn run(&self, stage: &mut Stage) -> Result<(), MinerError> {
        let (_, cache) = stage.forward(&self.input, self.targets.as_ref())?;
        stage.backward(cache, self.grad.as_ref())?;
        Ok(())
    }

    /// Tokens per second after one warm-up pass: at least two timed passes, more until half a
    /// second has gone (at most 50).
    fn time(&self, stage: &mut Stage) -> Result<f64, MinerError> {
        let dev = stage.options().device.clone();
        self.run(stage)?;
        // A GPU runs its queue behind the host: wait for it around the timed passes.
        dev.synchronize()?;
        let started = Instant::now();
        let mut passes = 0u32;
        while passes < 2 || (started.elapsed().as_secs_f64() < 0.5 && passes < 50) {
            self.run(stage)?;
            passes += 1;
        }
        dev.synchronize()?;
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        Ok(self.tokens as f64 * f64::from(passes) / secs)
    }
}

/// Memory in use: this process's resident memory on the CPU, the whole device's on a GPU.
fn used_memory(device: &DeviceSpec) -> Option<u64> {
    match device.cuda_ordinal() {
        None => resident_memory(),
        Some(n) => cuda_used_memory(n),
    }
}

/// `VmRSS` from `/proc/self/status` (Linux).
fn resident_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    kib_field(&text, "VmRSS:")
}

/// The most resident memory this process has held so far (`VmHWM`, Linux).
pub fn peak_resident_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    kib_field(&text, "VmHWM:")
}

#[cfg(feature = "cuda")]
fn cuda_used_memory(ordinal: usize) -> Option<u64> {
    let ctx = cudarc::driver::CudaContext::new(ordinal).ok()?;
    ctx.bind_to_thread().ok()?;
    let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
    Some(total.saturating_sub(free) as u64)
}

#[cfg(not(feature = "cuda"))]
fn cuda_used_memory(_ordinal: usize) -> Option<u64> {
    None
}

/// How many forward caches a miner keeps for pending backwards (each further sample in flight
/// is recomputed at its backward instead): as many micro-batches as fit in `available` bytes
/// beside the stage's fixed needs and the epoch-start copy of its weights, at most `cap`, at
/// least one. A micro-batch costs `micro_batch` times the measured bytes of one sequence, or
/// the equation's figure where that is more (a measurement can read low when the allocator
/// reuses memory it already had).
pub fn cache_budget(
    memory: &StageMemory,
    micro_batch: u64,
    bytes_per_sequence: u64,
    available: u64,
    cap: usize,
) -> usize {
    let per_sample = memory
        .per_sample
        .max(bytes_per_sequence.saturating_mul(micro_batch));
    let needs = StageMemory {
        per_sample,
        ..*memory
    };
    let epoch_start = memory.params.saturating_mul(4);
    let fits = needs.samples_within(available.saturating_sub(epoch_start));
    usize::try_from(fits)
        .unwrap_or(usize::MAX)
        .clamp(1, cap.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_is_parsed() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_meminfo(text), Some(20_000_000 * 1024));
        assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), None);
    }

    /// On a GPU machine (`IOTA_REQUIRE_CUDA` set) the driver's free memory and a measured
    /// throughput come back; without a GPU the test is skipped.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_memory_and_throughput_are_measured() {
        if iota_model::cuda_for_checks(0).unwrap().is_none() {
            return;
        }
        let free = available_memory(&DeviceSpec::Cuda(0));
        assert!(free > 1 << 30, "free GPU memory {free} bytes");
        let run = iota_trainer::local_tiny_run("gpu", 8).unwrap();
        let model = ModelConfig::tiny();
        let gpu = estimate_tokens_per_s(&run, &model, &DeviceSpec::Cuda(0)).unwrap();
        let cpu = estimate_tokens_per_s(&run, &model, &DeviceSpec::Cpu).unwrap();
        eprintln!(
            "free {:.1} GB; tiny, one block at 1x{}: cuda {gpu:.0} tokens/s, cpu {cpu:.0}",
            free as f64 / 1e9,
            run.seq_len
        );
        assert!(gpu.is_finite() && gpu > 0.0);
    }

    fn stage_needs() -> StageMemory {
        StageMemory {
            params: 100,
            state: 1_600,
            per_sample: 1_000,
            backward: 500,
        }
    }

    #[test]
    fn cache_budget_is_what_memory_holds_beside_the_stage() {
        let m = stage_needs();
        // 400 bytes of epoch-start weights, 2,100 of state and backward, then 3.5 samples.
        let available = 400 + 2_100 + 3_500;
        assert_eq!(cache_budget(&m, 2, 0, available, 32), 3);
        // A measured sequence over the equation's figure decides: 2 × 700 bytes a micro-batch.
        assert_eq!(cache_budget(&m, 2, 700, available, 32), 2);
        // A measurement below the equation's does not raise the budget.
        assert_eq!(cache_budget(&m, 2, 10, available, 32), 3);
        // At most the cap, and never below one: a miner always keeps its newest forward.
        assert_eq!(cache_budget(&m, 2, 0, 1 << 40, 8), 8);
        assert_eq!(cache_budget(&m, 2, 0, 1_000, 8), 1);
        assert_eq!(cache_budget(&m, 2, u64::MAX, u64::MAX, 8), 1);
    }

    /// The speed test runs the stage it is given, leaves no gradient behind and changes no
    /// weight, and reads what a forward holds from the process's resident memory.
    #[test]
    fn the_speed_test_measures_the_stage_and_leaves_it_as_it_was() {
        let model = ModelConfig {
            d_model: 512,
            n_heads: 8,
            n_kv_heads: 2,
            d_ff: 2048,
            stages: vec![1, 4, 1],
            bottleneck_dim: 64,
            max_seq_len: 256,
            ..ModelConfig::tiny()
        };
        let mut stage = Stage::new(&model, 1, iota_model::StageOptions::cpu()).unwrap();
        let before = iota_model::merge::flatten_params(&stage).unwrap();
        let seq = 256;
        let speed = measure_stage(&mut stage, seq, &DeviceSpec::Cpu).unwrap();
        assert!(speed.tokens_per_s.is_finite() && speed.tokens_per_s > 0.0);
        assert_eq!(stage.backward_count(), 0);
        assert!((0..stage.params().len()).all(|i| stage.grad(i).is_none()));
        assert_eq!(iota_model::merge::flatten_params(&stage).unwrap(), before);
        let predicted = iota_model::memory::stage_memory(
            &model,
            1,
            1,
            seq,
            iota_model::memory::MemoryOptions::default(),
        )
        .unwrap();
        if cfg!(target_os = "linux") {
            // Read before the forward's cache exists it would be about zero; read after the
            // backward, it would add the stage's gradients (more than the cache here).
            assert!(predicted.params * 4 > predicted.per_sample);
            let ratio = speed.bytes_per_sequence as f64 / predicted.per_sample as f64;
            assert!(
                (0.4..1.8).contains(&ratio),
                "measured {} bytes a sequence, the equation {}",
                speed.bytes_per_sequence,
                predicted.per_sample
            );
        }
    }

    #[test]
    fn cpu_memory_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            // Read after the resident memory, the high-water mark is at least that.
            let now = resident_memory().unwrap();
            assert!(now > 0 && peak_resident_memory().unwrap() >= now);
            assert!(available_memory(&DeviceSpec::Cpu) > 0);
        }
    }
}
