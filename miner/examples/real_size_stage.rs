//! A miner's trainer on one stage of `iota-1.5b`, on the CPU: a few hops as the orchestrator
//! would hand them out (forward, backward, the hop taken), with AdamW inner steps between them,
//! then the process's peak resident memory beside what the run would publish for the stage.
//!
//! ```text
//! cargo run -p iota-miner --release --example real_size_stage -- [STAGE] [MICRO_BATCH] [HOPS]
//! ```
//!
//! Defaults: stage 1, micro-batch 1, 4 hops (two inner steps), sequences of 800 tokens, blocks
//! checkpointed as `--checkpoint-blocks` does. The training data is the generated corpus: only
//! the shapes matter here.

use std::time::Instant;

use anyhow::{Context, bail};
use iota_model::bottleneck::WireEncoding;
use iota_model::memory::miner_stage_bytes;
use iota_model::{BoundaryTensor, ModelConfig, StageOptions};
use iota_trainer::StageTrainer;

const MODEL: &str = "iota-1.5b";
const SEQ_LEN: u32 = 800;

fn main() -> anyhow::Result<()> {
    let arg = |i: usize, default: u32| -> anyhow::Result<u32> {
        std::env::args().nth(i).map_or(Ok(default), |a| {
            a.parse().with_context(|| format!("argument {i}: {a:?}"))
        })
    };
    let (stage, micro_batch, hops) = (arg(1, 1)?, arg(2, 1)?, arg(3, 4)?);
    let model = ModelConfig::by_name(MODEL)?;
    if stage as usize >= model.num_stages() {
        bail!("{MODEL} has {} stages", model.num_stages());
    }
    let mut run = iota_trainer::local_tiny_run("real-size", u64::from(hops))?;
    run.model = MODEL.into();
    run.stages = model.num_stages() as u32;
    run.stage_params = (0..model.num_stages())
        .map(|k| model.stage_param_count(k).map(|n| n as u64))
        .collect::<Result<_, _>>()?;
    run.boundary_dim = model.boundary_dim() as u32;
    run.micro_batch = micro_batch;
    run.seq_len = SEQ_LEN;
    let opts = StageOptions {
        checkpoint_blocks: true,
        ..StageOptions::cpu()
    };
    let started = Instant::now();
    let mut trainer = StageTrainer::new(run.clone(), stage, opts, 1, None)?;
    for j in 0..run.partitions {
        trainer.load_partition(j, None)?;
    }
    trainer.begin_epoch(0)?;
    println!(
        "{MODEL} stage {stage}: {:.0}M parameters, ready in {:.1} s",
        trainer.stage().num_parameters() as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    let last = stage + 1 == run.stages;
    let shape = [
        micro_batch as usize,
        SEQ_LEN as usize,
        run.boundary_dim as usize,
    ];
    for hop in 0..i64::from(hops) {
        let started = Instant::now();
        let input = (stage > 0)
            .then(|| boundary(&shape, 1e-2, hop))
            .transpose()?;
        let out = trainer.forward(hop, input.as_deref())?;
        if !last {
            trainer.backward(hop, &boundary(&shape, 1e-4, 100 + hop)?)?;
        }
        if !trainer.commit(hop)? {
            bail!("hop {hop} was not committed");
        }
        println!(
            "hop {hop}: {:.1} s{}, {} inner steps so far, peak resident {:.2} GB",
            started.elapsed().as_secs_f64(),
            out.loss
                .map(|l| format!(", loss {l:.3}"))
                .unwrap_or_default(),
            trainer.inner_steps(),
            peak_resident_bytes()? as f64 / 1e9
        );
    }
    let predicted = miner_stage_bytes(&model, stage as usize, micro_batch as usize, 800)?;
    println!(
        "peak resident memory {:.2} GB; the run would publish {:.2} GB for this stage at {micro_batch}x{SEQ_LEN}",
        peak_resident_bytes()? as f64 / 1e9,
        predicted as f64 / 1e9
    );
    Ok(())
}

/// A deterministic boundary tensor of `shape` as the wire carries it.
fn boundary(shape: &[usize; 3], scale: f32, seed: i64) -> anyhow::Result<Vec<u8>> {
    let v: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|i| ((((i as u64 * 7919 + seed as u64) % 200) as f32) - 100.0) * scale)
        .collect();
    Ok(BoundaryTensor::from_f32(shape, &v, WireEncoding::F32)?.to_bytes()?)
}

fn peak_resident_bytes() -> anyhow::Result<u64> {
    iota_miner::capacity::peak_resident_memory().context("no VmHWM in /proc/self/status")
}
