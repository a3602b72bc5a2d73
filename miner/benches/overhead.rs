//! The miner's overhead: tokens/s of a miner training the middle stage of the `small` model on
//! the CPU through the whole protocol (download, compute, encode, upload, complete, against a
//! real orchestrator, PostgreSQL and localnet), next to the training core's own
//! forward+backward(+inner step) figure for that stage, measured before and after in one run.
//! Also the boundary bytes the miner sends per token next to the fp32 residual stream.
//!
//! `cargo bench -p iota-miner --bench overhead` with `DATABASE_URL` set (`scripts/pg.sh start`).
//! Samples go through the pipeline one at a time (`max_in_flight` 1), so only one stage computes
//! at any moment and the miners do not compete for the cores; the miner's figure counts the
//! time it spent handling its hops, from receiving a work item to the accepted completion.

use iota_testkit as support;

use std::time::{Duration, Instant};

use iota_model::{
    AdamW, AdamWConfig, DType, Device, LrSchedule, ModelConfig, Stage, StageOptions, Tensor,
};
use iota_protocol::api::{Phase, RunConfig};
use support::*;

const STAGE: usize = 1;
const SAMPLES: u64 = 24;

fn run_config() -> RunConfig {
    let model = ModelConfig::small();
    RunConfig {
        name: "overhead".into(),
        model: "small".into(),
        stages: 3,
        stage_params: (0..3)
            .map(|k| model.stage_param_count(k).expect("stage") as u64)
            .collect(),
        partitions: 4,
        micro_batch: 4,
        seq_len: 128,
        boundary_dim: model.boundary_dim() as u32,
        wire: iota_protocol::tensor::WireEncoding::Int8,
        samples_per_epoch: SAMPLES,
        max_in_flight: 1,
        training_s: 900,
        uploading_s: 120,
        merging_s: 120,
        merge_round_s: 60,
        lease_s: 120,
        heartbeat_timeout_s: 60,
        ..tiny_run("overhead", SAMPLES)
    }
}

/// The training core alone: forward, backward and the inner step cadence of the run, on the
/// same shapes; tokens per second.
fn core_tokens_per_s(run: &RunConfig, reps: usize) -> f64 {
    let mut model = ModelConfig::small();
    model.init_seed = run.init_seed;
    let mut stage = Stage::new(&model, STAGE, StageOptions::cpu()).expect("stage");
    let cfg = AdamWConfig {
        lr: run.inner_lr,
        ..AdamWConfig::default()
    }
    .for_stage(&model, STAGE)
    .expect("adamw");
    let mut opt = AdamW::new(&stage, cfg, LrSchedule::constant()).expect("adamw");
    let (b, t) = (run.micro_batch as usize, run.seq_len as usize);
    let x = Tensor::randn(0f32, 1.0, stage.input_dims(b, t), &Device::Cpu).expect("x");
    let g = (Tensor::randn(0f32, 1.0, stage.output_dims(b, t), &Device::Cpu).expect("g") * 1e-3)
        .expect("g");
    let g = g.to_dtype(DType::F32).expect("g");
    let pass = |i: usize, stage: &mut Stage, opt: &mut AdamW| {
        let (_, cache) = stage.forward(&x, None).expect("forward");
        stage.backward(cache, Some(&g)).expect("backward");
        if (i + 1).is_multiple_of(run.inner_steps_every as usize) {
            opt.step_with(stage, run.inner_lr).expect("step");
        }
    };
    pass(0, &mut stage, &mut opt);
    let started = Instant::now();
    for i in 0..reps {
        pass(i, &mut stage, &mut opt);
    }
    (b * t * reps) as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    init_tracing();
    let run = run_config();
    let core_before = tokio::task::spawn_blocking({
        let run = run.clone();
        move || core_tokens_per_s(&run, SAMPLES as usize)
    })
    .await
    .expect("core");

    // Partial moves: the chain and store stay alive with `serving` until the end.
    let serving = swarm(&[71u8, 72, 73], run.clone()).await;
    let (orch, client, miners) = (serving.orch, serving.client, serving.miners);
    eventually("training done", Duration::from_secs(900), || async {
        let st = client.status().await.ok()?;
        (st.epoch > 0 || st.phase != Phase::Training).then_some(())
    })
    .await;
    for m in &miners {
        let s = m.status();
        println!(
            "  miner stage {:?}: hops {}, busy {:.1} s, leases lost {}, errors {}, non-finite {}",
            s.stage,
            s.hops,
            s.busy_ms / 1e3,
            s.leases_lost,
            s.errors,
            s.nonfinite_events
        );
    }
    let middle = miners
        .iter()
        .map(|m| m.status())
        .find(|s| s.stage == Some(STAGE as u32))
        .expect("a miner on the middle stage");
    let core_after = tokio::task::spawn_blocking({
        let run = run.clone();
        move || core_tokens_per_s(&run, SAMPLES as usize)
    })
    .await
    .expect("core");

    let tokens_per_sample = u64::from(run.micro_batch * run.seq_len);
    let samples = middle.hops / 2;
    let miner_tps = (samples * tokens_per_sample) as f64 / (middle.busy_ms / 1e3);
    let core = (core_before + core_after) / 2.0;
    let d_model = ModelConfig::small().d_model as f64;
    // Two boundary tensors per sample: the activation forward, the input gradient backward.
    let wire_per_token = middle.boundary_bytes as f64 / (2 * samples * tokens_per_sample) as f64;
    println!("miner overhead, `small` stage {STAGE} on the CPU, micro-batch 4x128, int8 wire");
    println!(
        "  training core forward+backward(+inner step): {core_before:.0} tokens/s before, {core_after:.0} after"
    );
    println!(
        "  miner (hop handling incl. download, encode, upload, complete): {miner_tps:.0} tokens/s over {samples} samples"
    );
    println!("  ratio miner / core: {:.3}", miner_tps / core);
    // Load on a shared machine moves both figures above; within the same hops it cannot.
    println!(
        "  within the miner's own hops: {:.1} s in the training core of {:.1} s handling them: {:.3}",
        middle.compute_ms / 1e3,
        middle.busy_ms / 1e3,
        middle.compute_ms / middle.busy_ms.max(1e-9)
    );
    println!(
        "  boundary bytes per token per direction: {wire_per_token:.1} (fp32 residual stream: {:.0}; {:.0}x smaller)",
        4.0 * d_model,
        4.0 * d_model / wire_per_token
    );
    for m in miners {
        let _ = m.stop().await;
    }
    orch.stop().await;
}
