//! Training core of IOTA: what miners run and validators re-run.
//!
//! Pure compute on candle: no async, no network, no chain. CPU by default; the `cuda` feature
//! enables candle's CUDA backend ([`StageOptions::best_available`] picks a GPU when present).
//!
//! * [`config`]: Llama-3-style model shapes (`tiny`, `small`, `iota-1.5b`, `iota-15b`, JSON).
//! * [`stage`]: one pipeline stage with `forward(input) -> (output, cache)` and
//!   `backward(cache, grad_output) -> grad_input`, optional recomputation.
//! * [`bottleneck`]: the boundary tensor between stages (residual bottleneck output or its
//!   gradient), f32 or per-row int8, safetensors on the wire, validated on decode.
//! * [`pipeline`]: all stages in one process, staged (through the wire encoding) or monolithic.
//! * [`optim`]: inner AdamW (f32 master weights and moments, clipping, warmup + cosine,
//!   transactional NaN/Inf skip) and the outer Nesterov step on pseudo-gradients.
//! * [`merge`]: flat parameter view, partitions, deterministic weighted average, BLAKE3.
//! * [`sparse`]: compressed pseudo-gradients (chunked top-k, int8, error feedback) and their
//!   deterministic merge.
//! * [`checkpoint`]: safetensors weights and optimizer state.
//! * [`data`]: sample id -> token window; the grammar corpus with its entropy floor; text files
//!   with a `tokenizers` tokenizer; offline BPE training.
//! * [`mod@replay`]: a stage driven hop by hop (miner) and replayed from epoch-start weights
//!   (validator spot checks), with comparison helpers.
//! * [`train`]: a local loop over a pipeline for tests, benchmarks and single-machine runs.
//!
//! # A miner's epoch on one stage, and a validator's replay
//!
//! ```
//! use iota_model::merge::{flatten_range, partition_ranges, pseudo_gradient_range};
//! use iota_model::replay::{Hop, StageRunner, compare_results, replay};
//! use iota_model::{AdamW, AdamWConfig, LrSchedule, ModelConfig, Stage, StageOptions, Tensor};
//! # fn main() -> iota_model::Result<()> {
//! let cfg = ModelConfig::tiny();
//! let build = || -> iota_model::Result<(Stage, AdamW)> {
//!     let stage = Stage::new(&cfg, 1, StageOptions::cpu())?; // epoch-start weights
//!     let adamw = AdamWConfig::default().for_stage(&cfg, 1)?; // IOTA's per-stage clip share
//!     let opt = AdamW::new(&stage, adamw, LrSchedule::constant())?;
//!     Ok((stage, opt))
//! };
//! let (stage, opt) = build()?;
//! let start = flatten_range(&stage, 0..stage.num_parameters())?;
//! // Inputs and gradients arrive from the neighbouring stages' miners.
//! let x = Tensor::zeros(stage.input_dims(2, 8), iota_model::DType::F32, &iota_model::Device::Cpu)?;
//! let g = Tensor::ones(stage.output_dims(2, 8), iota_model::DType::F32, &iota_model::Device::Cpu)?;
//! let hops = vec![
//!     Hop::Forward { sample: 7, input: x, targets: None },
//!     Hop::Backward { sample: 7, grad_output: Some((g * 1e-3)?) },
//!     Hop::InnerStep { lr: 1e-3 }, // the run's learning rate, from outside
//! ];
//! let mut miner = StageRunner::new(stage, opt, 16);
//! let claimed = miner.apply_all(&hops)?;
//! // Upload the pseudo-gradient partition by partition.
//! for r in partition_ranges(start.len(), 4)? {
//!     let _part = pseudo_gradient_range(miner.stage(), r.clone(), &start[r])?;
//! }
//! // A validator replays from the same epoch-start weights and compares hop by hop.
//! let (stage, opt) = build()?;
//! let rep = replay(stage, opt, &hops, 16)?;
//! for (_, c) in compare_results(&claimed, &rep.results)? {
//!     assert_eq!(c.relative_error, 0.0);
//! }
//! # Ok(())
//! # }
//! ```
//!
//! candle's fused RmsNorm, `softmax_last_dim` and rope kernels drop gradients, so the layers are
//! composed from differentiable primitives and a test checks that every parameter gets a
//! non-zero gradient.

#[cfg(test)]
#[allow(unsafe_code)] // a global allocator's interface is unsafe
mod alloc_count;
#[cfg(feature = "openblas")]
mod blas;
pub mod bottleneck;
pub mod checkpoint;
pub mod config;
#[cfg(feature = "cuda")]
mod cuda_attention;
pub mod data;
pub mod error;
#[allow(unsafe_code)] // a target-feature function is unsafe to call
mod exp;
pub mod export;
mod fused;
pub mod generate;
mod gradients;
mod layers;
mod linear;
mod loss;
pub mod memory;
pub mod merge;
pub mod optim;
pub mod pipeline;
mod product;
pub mod replay;
pub mod rng;
mod short_attention;
pub mod sparse;
mod st;
pub mod stage;
#[cfg(test)]
mod test_util;
pub mod threads;
mod tiled_attention;
pub mod train;

pub use bottleneck::{BoundaryTensor, Payload, WireEncoding};
pub use config::{ModelConfig, RopeScaling};
pub use data::{Batch, Dataset, GrammarCorpus, TextDataset, make_batch, train_bpe_tokenizer};
pub use error::{ModelError, Result};
pub use export::{Exported, load_export, write_export};
pub use generate::{
    GenerateOptions, Generation, HeldOutLoss, generate, generate_tokens, held_out_loss,
};
pub use merge::{
    Contribution, FlatLayout, MergedPartition, flatten_range, load_range, partition_ranges,
    pseudo_gradient_range, weighted_average,
};
pub use optim::{
    AdamW, AdamWConfig, LrSchedule, OuterConfig, OuterOptimizer, PreparedStep, StepOutcome,
};
pub use pipeline::{Pipeline, StepStats, WireConfig};
pub use replay::{Comparison, Hop, HopResult, Replay, StageRunner, Thresholds, compare, replay};
pub use stage::{HeldGradients, LossOutput, Stage, StageCache, StageOptions, StageOutput};
pub use threads::CpuThreads;
pub use train::{TrainStep, Trainer};

/// What runs the CPU matrix products: OpenBLAS (with its kernel family and thread count) when
/// built with the `openblas` feature, otherwise candle's own kernel. For logs and benchmarks.
pub fn matmul_backend() -> String {
    #[cfg(feature = "openblas")]
    if blas::enabled() {
        return blas::describe();
    }
    format!("candle gemm ({} kernels)", gemm_kernels())
}

/// The kernel family candle's `gemm` picks at run time on this CPU: AVX-512 where the CPU has it
/// and the `avx512` feature is on, else AVX2 with FMA, else portable code.
fn gemm_kernels() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if cfg!(feature = "avx512") && std::arch::is_x86_feature_detected!("avx512f") {
            return "AVX-512";
        }
        if std::arch::is_x86_feature_detected!("fma") {
            return "AVX2+FMA";
        }
        "scalar"
    }
    #[cfg(target_arch = "aarch64")]
    {
        "NEON"
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        "portable"
    }
}

#[cfg(test)]
#[global_allocator]
static ALLOCATOR: alloc_count::Counting = alloc_count::Counting;

/// candle's tensor, device and dtype types, re-exported so callers need no direct dependency.
pub use candle_core::{DType, Device, Tensor};

/// CUDA device `ordinal` for a GPU check (a test, an example), or `None` when there is none and
/// the check should be skipped. With `IOTA_REQUIRE_CUDA` set a missing device is an error
/// instead, so that a check run on a GPU machine cannot pass by skipping.
pub fn cuda_for_checks(ordinal: usize) -> Result<Option<Device>> {
    match Device::new_cuda(ordinal) {
        Ok(gpu) => Ok(Some(gpu)),
        Err(e) if std::env::var_os("IOTA_REQUIRE_CUDA").is_some() => Err(ModelError::Config(
            format!("IOTA_REQUIRE_CUDA is set but CUDA device {ordinal} failed: {e}"),
        )),
        Err(e) => {
            eprintln!("no CUDA device {ordinal} ({e}): skipped");
            Ok(None)
        }
    }
}
