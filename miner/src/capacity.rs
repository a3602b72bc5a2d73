//! What a miner reports when it joins: device memory and a short measured throughput.

use std::time::Instant;

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
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
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

/// Forward+backward tokens per second of one micro-batch through the run's middle stage on
/// `device`, after one warm-up pass: a short, honest figure for the orchestrator's routing.
pub fn measure_tokens_per_s(
    run: &RunConfig,
    model: &ModelConfig,
    device: &DeviceSpec,
) -> Result<f64, MinerError> {
    let k = model.num_stages() / 2;
    let mut stage = Stage::new(model, k, device.stage_options()?)?;
    let (b, t) = (run.micro_batch as usize, run.seq_len as usize);
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
    let pass = |stage: &mut Stage| -> Result<(), MinerError> {
        let (_, cache) = stage.forward(&input, targets.as_ref())?;
        stage.backward(cache, grad.as_ref())?;
        Ok(())
    };
    pass(&mut stage)?;
    // A GPU runs its queue behind the host: wait for it around the timed passes.
    dev.synchronize()?;
    let started = Instant::now();
    let mut passes = 0u32;
    while passes < 2 || (started.elapsed().as_secs_f64() < 0.5 && passes < 50) {
        pass(&mut stage)?;
        passes += 1;
    }
    dev.synchronize()?;
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    Ok((b * t) as f64 * f64::from(passes) / secs)
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
        let run = crate::eval::local_tiny_run("gpu", 8).unwrap();
        let model = ModelConfig::tiny();
        let gpu = measure_tokens_per_s(&run, &model, &DeviceSpec::Cuda(0)).unwrap();
        let cpu = measure_tokens_per_s(&run, &model, &DeviceSpec::Cpu).unwrap();
        eprintln!(
            "free {:.1} GB; tiny at {}x{}: cuda {gpu:.0} tokens/s, cpu {cpu:.0}",
            free as f64 / 1e9,
            run.micro_batch,
            run.seq_len
        );
        assert!(gpu.is_finite() && gpu > 0.0);
    }

    #[test]
    fn cpu_memory_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(available_memory(&DeviceSpec::Cpu) > 0);
        }
    }
}
