//! Peak memory of one full training step (forward, backward, AdamW) of each `iota-1.5b` stage,
//! at 1×800 and 4×800 tokens, on the CPU, beside what `iota_model::memory::stage_memory`
//! predicts. Each step runs in its own child process, so its peak resident memory (the kernel's
//! high-water mark) is that step's alone, the process's own baseline included. Stages run with
//! per-block checkpointing, as a miner on a 16 GB card would (`--checkpoint-blocks`).
//!
//! `cargo bench -p iota-model --bench memory` (or `scripts/bench.sh memory`);
//! `IOTA_BENCH_MEMORY_SHAPES=1x800` for fewer shapes. Needs about 16 GB of free memory.

use std::time::Instant;

use iota_model::memory::{MemoryOptions, stage_memory};
use iota_model::{
    AdamW, AdamWConfig, DType, Device, LrSchedule, ModelConfig, Stage, StageOptions, Tensor,
};

mod support;
use support::{fail, load_average, peak_rss_bytes};

const CHILD: &str = "IOTA_BENCH_MEMORY_CHILD";
const MODEL: &str = "iota-1.5b";
const GB: f64 = 1e9;

/// The child: one step of stage `k` at `batch × seq`; prints `peak seconds`.
fn child(spec: &str) {
    let parse = |s: Option<&str>| -> usize {
        s.and_then(|v| v.parse().ok())
            .unwrap_or_else(|| fail("child spec", spec))
    };
    let mut parts = spec.split(',');
    let (k, batch, seq) = (
        parse(parts.next()),
        parse(parts.next()),
        parse(parts.next()),
    );
    let cfg = ModelConfig::load(MODEL).unwrap_or_else(|e| fail("config", e));
    let opts = StageOptions {
        checkpoint_blocks: true,
        ..StageOptions::cpu()
    };
    let mut stage = Stage::new(&cfg, k, opts).unwrap_or_else(|e| fail("stage", e));
    let mut opt = AdamW::new(&stage, AdamWConfig::default(), LrSchedule::constant())
        .unwrap_or_else(|e| fail("optimizer", e));
    let dev = Device::Cpu;
    let ids = |seed: u32| {
        let v: Vec<u32> = (0..(batch * seq) as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % cfg.vocab_size as u32)
            .collect();
        Tensor::from_vec(v, (batch, seq), &dev).unwrap_or_else(|e| fail("ids", e))
    };
    let input = if stage.is_first() {
        ids(1)
    } else {
        Tensor::randn(0f32, 1.0, stage.input_dims(batch, seq), &dev)
            .unwrap_or_else(|e| fail("input", e))
    };
    let targets = stage.is_last().then(|| ids(2));
    let started = Instant::now();
    let (_, cache) = stage
        .forward(&input, targets.as_ref())
        .unwrap_or_else(|e| fail("forward", e));
    let grad = (!stage.is_last()).then(|| {
        Tensor::randn(0f32, 1e-4, stage.output_dims(batch, seq), &dev)
            .and_then(|g| g.to_dtype(DType::F32))
            .unwrap_or_else(|e| fail("output gradient", e))
    });
    stage
        .backward(cache, grad.as_ref())
        .unwrap_or_else(|e| fail("backward", e));
    opt.step(&mut stage).unwrap_or_else(|e| fail("step", e));
    println!("{} {}", peak_rss_bytes(), started.elapsed().as_secs_f64());
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec);
        return;
    }
    let cfg = ModelConfig::load(MODEL).unwrap_or_else(|e| fail("config", e));
    let shapes: Vec<(usize, usize)> = std::env::var("IOTA_BENCH_MEMORY_SHAPES")
        .unwrap_or_else(|_| "1x800,4x800".into())
        .split(',')
        .map(|s| {
            let (b, t) = s.split_once('x').unwrap_or_else(|| fail("shape", s));
            (
                b.parse().unwrap_or_else(|e| fail("batch", e)),
                t.parse().unwrap_or_else(|e| fail("seq", e)),
            )
        })
        .collect();
    println!(
        "{MODEL}, f32 on the CPU, per-block checkpointing; one step = forward, backward, AdamW \
         (first step: no gradients accumulated before). Load average before: {}.",
        load_average()
    );
    println!();
    println!(
        "| stage | params | tokens | predicted peak GB | measured peak RSS GB | measured / predicted | step s | tokens/s |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let exe = std::env::current_exe().unwrap_or_else(|e| fail("current exe", e));
    let mut worst: f64 = 0.0;
    for &(batch, seq) in &shapes {
        for k in 0..cfg.num_stages() {
            let predicted = stage_memory(
                &cfg,
                k,
                batch,
                seq,
                MemoryOptions {
                    checkpoint_blocks: true,
                    half_compute_bytes: 0,
                },
            )
            .unwrap_or_else(|e| fail("prediction", e));
            let out = std::process::Command::new(&exe)
                .env(CHILD, format!("{k},{batch},{seq}"))
                .output()
                .unwrap_or_else(|e| fail("child", e));
            if !out.status.success() {
                fail(
                    "child",
                    format!(
                        "stage {k} {batch}x{seq}: {}\n{}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr)
                    ),
                );
            }
            let text = String::from_utf8_lossy(&out.stdout);
            let mut fields = text.split_whitespace();
            let peak: f64 = fields
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| fail("child output", &text));
            let seconds: f64 = fields
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| fail("child output", &text));
            let predicted_peak = predicted.first_step_peak() as f64;
            worst = worst.max(peak);
            println!(
                "| {k} | {} | {batch}x{seq} | {:.2} | {:.2} | {:.2} | {seconds:.0} | {:.0} |",
                predicted.params,
                predicted_peak / GB,
                peak / GB,
                peak / predicted_peak,
                (batch * seq) as f64 / seconds
            );
        }
    }
    println!();
    println!(
        "Largest measured peak: {:.2} GB (goal: at most 16 GB at 4x800).",
        worst / GB
    );
}
