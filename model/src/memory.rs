//! How many bytes a stage needs to train, from its config and the shape of a micro-batch.
//!
//! Three parts, each what the code holds (f32 master weights):
//!
//! * **state**, held all the time: weights, accumulated gradients and AdamW's two moments,
//!   16 bytes a parameter (plus a compute-dtype copy of the weights under bf16); before a stage's
//!   first backward there are no accumulated gradients yet, and that backward's become them;
//! * **kept per sample in flight**, from a forward until its backward: with
//!   [`crate::StageOptions::checkpoint_blocks`] each block's input and the last block's output,
//!   about `blocks · tokens · d` floats; without, every block's graph, about
//!   `tokens · (12·d + 3·d_ff)` floats a block, plus the `heads · t²` score matrices kept by the
//!   untiled attention of sequences of at most [`crate::layers`]' tile height; on the last
//!   stage, the head's logits when they are small enough to keep
//!   ([`crate::stage::KEPT_LOGITS_MAX_BYTES`]);
//! * **the backward's transient**: the hop's own parameter gradients (4 bytes a parameter, held
//!   until committed), one block's recomputed graph and its gradients (about
//!   `tokens · (20·d + 10·d_ff)` floats, checkpointed), and on the last stage the loss head's
//!   vocabulary blocks.
//!
//! The coefficients were read off the counting allocator's measurements of middle stages; the
//! tests hold the equation to those measurements, and `cargo bench --bench memory` holds it to the
//! peak resident memory of real-size stages.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::TILED_ATTENTION_ROWS;

/// Bytes of one float of the master weights and activations (f32).
const F32: u64 = 4;

/// What a stage needs, in bytes (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageMemory {
    /// Scalar parameters of the stage.
    pub params: u64,
    /// Weights, gradients and optimizer moments.
    pub state: u64,
    /// Kept from a forward until its backward, for each sample in flight.
    pub per_sample: u64,
    /// Allocated during a backward and freed by its end.
    pub backward: u64,
}

impl StageMemory {
    /// The peak of a training step with `in_flight` samples between forward and backward, while
    /// gradients are being accumulated (a miner between optimizer steps).
    pub fn peak(&self, in_flight: u64) -> u64 {
        self.state + self.per_sample * in_flight.max(1) + self.backward
    }

    /// The peak of a stage's first step from zeroed gradients, one sample in flight: that
    /// backward's gradients are the accumulated ones, not held beside them.
    pub fn first_step_peak(&self) -> u64 {
        self.peak(1) - self.params * F32
    }

    /// Samples that fit in flight within `budget` bytes (0 when not even one does).
    pub fn samples_within(&self, budget: u64) -> u64 {
        let fixed = self.state.saturating_add(self.backward);
        if budget < fixed.saturating_add(self.per_sample) {
            return 0;
        }
        (budget - fixed) / self.per_sample.max(1)
    }
}

/// How a stage is run, as far as memory goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryOptions {
    /// [`crate::StageOptions::checkpoint_blocks`].
    pub checkpoint_blocks: bool,
    /// Bytes of the compute dtype when it is not the master weights' f32 (2 for bf16), else 0.
    pub half_compute_bytes: u64,
}

impl MemoryOptions {
    /// How a stage built with `opts` runs.
    pub fn of(opts: &crate::StageOptions) -> Self {
        let half = opts.compute_dtype != crate::DType::F32;
        Self {
            checkpoint_blocks: opts.checkpoint_blocks,
            half_compute_bytes: if half {
                opts.compute_dtype.size_in_bytes() as u64
            } else {
                0
            },
        }
    }
}

/// The memory stage `k` of `cfg` needs to train micro-batches of `batch × seq` tokens.
pub fn stage_memory(
    cfg: &ModelConfig,
    k: usize,
    batch: usize,
    seq: usize,
    opts: MemoryOptions,
) -> Result<StageMemory> {
    let params = cfg.stage_param_count(k)? as u64;
    let blocks = cfg.stage_blocks(k)?.len() as u64;
    let (d, ff, heads) = (cfg.d_model as u64, cfg.d_ff as u64, cfg.n_heads as u64);
    let (b, t) = (batch as u64, seq as u64);
    let tokens = b * t;
    let state = params * (4 * F32 + opts.half_compute_bytes);
    // Untiled attention keeps a few [b, heads, t, t] matrices per block; tiled keeps none.
    let scores = if seq <= TILED_ATTENTION_ROWS {
        4 * b * heads * t * t
    } else {
        0
    };
    let first = k == 0;
    let last = k + 1 == cfg.num_stages();
    let boundary = cfg.boundary_dim() as u64;
    // A later stage keeps its own copy of the incoming boundary tensor (its gradient's variable).
    let input = if first { 0 } else { tokens * boundary };
    // A last stage's training forward may keep its logits for the backward.
    let logits = if last {
        crate::stage::kept_logits_bytes(batch * seq, cfg.vocab_size, F32 as usize)
    } else {
        0
    };
    let per_sample = logits
        + if opts.checkpoint_blocks {
            // Block inputs: the embedding's output on the first stage (a later stage's first block
            // reads the input it keeps anyway), d-wide between blocks, and the last block's output.
            let embedded = if first { d } else { 0 };
            let output = if last { d } else { boundary };
            input + tokens * (embedded + blocks.saturating_sub(1) * d + output)
        } else {
            input + blocks * (tokens * (12 * d + 3 * ff) + scores)
        } * F32;
    let block_transient = if opts.checkpoint_blocks {
        (tokens * (20 * d + 10 * ff) + scores) * F32
    } else {
        // The tiled attention's backward holds a few row blocks of scores at once.
        let tiles = if seq > TILED_ATTENTION_ROWS {
            3 * b * heads * TILED_ATTENTION_ROWS as u64 * t
        } else {
            0
        };
        (tokens * (4 * d + 3 * ff) + tiles) * F32
    };
    // The loss head: a vocabulary block's logits, probabilities and their gradient at once.
    let head = if last {
        4 * tokens * cfg.loss_vocab_chunk.min(cfg.vocab_size) as u64 * F32
    } else {
        0
    };
    Ok(StageMemory {
        params,
        state,
        per_sample,
        backward: params * F32 + block_transient.max(head),
    })
}

/// Headroom on a miner's figure for what the equation does not count (the allocator's
/// fragmentation, the process itself), as a fraction `1/ADMISSION_HEADROOM`: a miner training an
/// `iota-1.5b` stage at 1x800 (`cargo run -p iota-miner --example real_size_stage`) peaked 1.3%
/// above the bare equation.
const ADMISSION_HEADROOM: u64 = 16;

/// What a miner needs to train stage `k` at `batch × seq` with per-block checkpointing: the
/// step's peak with one sample in flight while gradients accumulate, plus the copy of the
/// epoch's starting weights its pseudo-gradient is taken against, plus a sixteenth of headroom.
/// The figure a run publishes per stage, and the orchestrator admits by.
pub fn miner_stage_bytes(cfg: &ModelConfig, k: usize, batch: usize, seq: usize) -> Result<u64> {
    let m = stage_memory(
        cfg,
        k,
        batch,
        seq,
        MemoryOptions {
            checkpoint_blocks: true,
            half_compute_bytes: 0,
        },
    )?;
    let bytes = m.peak(1) + m.params * F32;
    Ok(bytes + bytes / ADMISSION_HEADROOM)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc_count::{held, peak_during};
    use crate::{Device, Stage, StageOptions, Tensor};

    /// A middle stage's forward and backward, measured by the counting allocator: what the
    /// forward keeps and the backward's peak above that.
    fn measure(cfg: &ModelConfig, b: usize, t: usize, checkpoint_blocks: bool) -> (u64, u64) {
        let opts = StageOptions {
            checkpoint_blocks,
            ..StageOptions::cpu()
        };
        let mut stage = Stage::new(cfg, 1, opts).unwrap();
        let x = Tensor::randn(0f32, 1.0, stage.input_dims(b, t), &Device::Cpu).unwrap();
        let g = Tensor::randn(0f32, 1e-3, stage.output_dims(b, t), &Device::Cpu).unwrap();
        // A first step allocates what is kept for every later one (the causal mask).
        let (_, cache) = stage.forward(&x, None).unwrap();
        stage.backward(cache, Some(&g)).unwrap();
        let before = held();
        let (_, cache) = stage.forward(&x, None).unwrap();
        let kept = (held() - before).max(0) as u64;
        let (_, backward) = peak_during(|| stage.backward(cache, Some(&g)).unwrap());
        (kept, backward as u64)
    }

    fn config(d: usize, heads: usize, ff: usize, blocks: usize) -> ModelConfig {
        ModelConfig {
            d_model: d,
            n_heads: heads,
            n_kv_heads: 2,
            d_ff: ff,
            vocab_size: 512,
            max_seq_len: 1024,
            bottleneck_dim: 16,
            ..ModelConfig::tiny()
        }
        .with_stages(vec![1, blocks, 1])
    }

    /// The equation within a quarter of what a middle stage holds, over widths, depths, batch
    /// sizes and sequence lengths on both sides of the attention tile, with and without
    /// checkpointing.
    #[test]
    fn the_equation_predicts_what_a_stage_holds() {
        let mut off = Vec::new();
        let mut within = |what: &str, predicted: u64, measured: u64| {
            let ratio = predicted as f64 / measured.max(1) as f64;
            if !(0.75..=1.33).contains(&ratio) {
                off.push(format!(
                    "{what}: predicted {predicted}, measured {measured}"
                ));
            }
        };
        for (d, heads, ff, blocks) in [(128, 4, 512, 2), (256, 8, 1024, 3)] {
            let cfg = config(d, heads, ff, blocks);
            for (b, t) in [(2, 64), (1, 256)] {
                for checkpoint_blocks in [false, true] {
                    let m = stage_memory(
                        &cfg,
                        1,
                        b,
                        t,
                        MemoryOptions {
                            checkpoint_blocks,
                            half_compute_bytes: 0,
                        },
                    )
                    .unwrap();
                    let (kept, backward) = measure(&cfg, b, t, checkpoint_blocks);
                    let case = format!("d {d} L {blocks} {b}x{t} checkpoint {checkpoint_blocks}");
                    within(&format!("{case} kept"), m.per_sample, kept);
                    within(&format!("{case} backward"), m.backward, backward);
                }
            }
        }
        assert!(off.is_empty(), "{}", off.join("\n"));
    }

    /// Every stage of `iota-1.5b` at IOTA's 4x800 fits a 16 GB card by the equation.
    #[test]
    fn iota_1_5b_stages_fit_16_gb() {
        let cfg = ModelConfig::iota_1_5b();
        for k in 0..cfg.num_stages() {
            let bytes = miner_stage_bytes(&cfg, k, 4, 800).unwrap();
            assert!(bytes < 16_000_000_000, "stage {k}: {bytes} bytes");
        }
    }

    #[test]
    fn samples_within_a_budget() {
        let m = StageMemory {
            params: 10,
            state: 100,
            per_sample: 10,
            backward: 50,
        };
        assert_eq!(m.peak(3), 180);
        assert_eq!(m.first_step_peak(), 160 - 40);
        assert_eq!(m.samples_within(159), 0);
        assert_eq!(m.samples_within(160), 1);
        assert_eq!(m.samples_within(185), 3);
    }
}
