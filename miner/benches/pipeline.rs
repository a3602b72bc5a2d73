//! The pipeline against monolithic training: end-to-end tokens/s of one epoch of the `small`
//! model trained by three miners (one per stage) through the whole protocol, next to the same
//! model trained in one process as one autograd graph (same micro-batches, same inner-step
//! cadence), measured before and after the pipeline run on the same machine.
//!
//! `cargo bench -p iota-miner --bench pipeline` with `DATABASE_URL` set (`scripts/pg.sh start`).
//! `PIPELINE_SAMPLES` (default 48) sets the epoch's samples, `PIPELINE_IN_FLIGHT` (default 8, the
//! orchestrator's default `--max-in-flight`) how many samples may be in the pipeline at once; with
//! 3 in flight the three miners wait on each other's polls and the ratio measured 0.54. The
//! pipeline's time runs from the moment every miner has joined to the end of the training phase.
//!
//! candle reads its CPU thread counts from the environment once per process, so each side runs
//! in a child process: the pipeline with the setting `iota localnet up` picks for three models
//! on this machine ([`CpuThreads::shared`]), monolithic training under each of three settings
//! (candle's defaults among them) before and after the pipeline, and the best monolithic mean is
//! the baseline. The pipeline also runs once more with candle's defaults, for reference.

use iota_testkit as support;

use std::time::{Duration, Instant};

use iota_model::data::make_batch;
use iota_model::threads::{self, CpuThreads};
use iota_model::{Device, ModelConfig, Pipeline, StageOptions};
use iota_protocol::api::{Phase, RunConfig};
use iota_trainer::{run_dataset, run_model};
use support::*;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn run_config(samples: u64, in_flight: u32) -> RunConfig {
    let model = ModelConfig::small();
    RunConfig {
        name: "pipeline".into(),
        model: "small".into(),
        stages: 3,
        stage_params: (0..3)
            .map(|k| model.stage_param_count(k).expect("stage") as u64)
            .collect(),
        partitions: 4,
        micro_batch: 4,
        seq_len: 128,
        boundary_dim: model.boundary_dim() as u32,
        samples_per_epoch: samples,
        max_in_flight: in_flight,
        training_s: 1800,
        uploading_s: 120,
        merging_s: 120,
        merge_round_s: 60,
        lease_s: 300,
        heartbeat_timeout_s: 120,
        ..tiny_run("pipeline", samples)
    }
}

/// Monolithic training of the run's model on the run's samples: forward and backward through
/// all stages as one graph, an AdamW step on every stage at the run's cadence. Tokens/s.
fn monolithic_tokens_per_s(run: &RunConfig) -> f64 {
    let model = run_model(run).expect("model");
    let data = run_dataset(run, &model, None).expect("corpus");
    let mut pipe = Pipeline::new(&model, &StageOptions::cpu()).expect("pipeline");
    let mut opts = stage_optimizers(run, &model, &mut pipe);
    let batch = |sample: i64| {
        make_batch(data.as_ref(), &run.sequence_ids(sample), &Device::Cpu).expect("batch")
    };
    // Warm-up, not timed.
    let b = batch(0);
    pipe.forward_backward_monolithic(&b.inputs, &b.targets)
        .expect("warm-up");
    pipe.zero_grad();
    let started = Instant::now();
    for i in 0..run.samples_per_epoch {
        let b = batch(i as i64);
        pipe.forward_backward_monolithic(&b.inputs, &b.targets)
            .expect("train");
        if (i + 1).is_multiple_of(u64::from(run.inner_steps_every)) {
            for (stage, opt) in pipe.stages_mut().iter_mut().zip(&mut opts) {
                opt.step_with(stage, run.inner_lr).expect("step");
            }
        }
    }
    let tokens = run.samples_per_epoch * u64::from(run.micro_batch * run.seq_len);
    tokens as f64 / started.elapsed().as_secs_f64()
}

/// What a child process measures (`PIPELINE_PART`), the parent reads its last stdout line.
const PART_VAR: &str = "PIPELINE_PART";

/// The monolithic side's thread settings: candle's defaults, then the two the pipeline might be
/// thought to gain from; the best of them is the baseline.
fn monolithic_settings(cores: usize) -> Vec<(String, Option<CpuThreads>)> {
    vec![
        ("candle's defaults (physical cores)".into(), None),
        (
            format!("{cores} threads per product, 1 per element-wise op"),
            Some(CpuThreads {
                matmul: cores,
                elementwise: 1,
            }),
        ),
        (
            "1 thread per operation".into(),
            Some(CpuThreads::uniform(1)),
        ),
    ]
}

/// Runs this bench again as a child measuring `part` with `threads` (candle's defaults for
/// `None`); returns the numbers of its last stdout line.
fn child(part: &str, threads: Option<CpuThreads>) -> Vec<f64> {
    let exe = std::env::current_exe().expect("bench executable");
    let mut cmd = std::process::Command::new(exe);
    cmd.env(PART_VAR, part)
        .env_remove(threads::MATMUL_VAR)
        .env_remove(threads::ELEMENTWISE_VAR)
        .stderr(std::process::Stdio::inherit());
    if let Some(t) = threads {
        cmd.envs(t.env());
    }
    let out = cmd.output().expect("child bench process");
    assert!(out.status.success(), "{part} child failed: {}", out.status);
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .last()
        .unwrap_or_default()
        .split_whitespace()
        .map(|v| v.parse().expect("a number"))
        .collect()
}

/// The pipeline: three miners, orchestrator, PostgreSQL and store in this process. Prints
/// tokens/s, seconds and wire bytes.
async fn pipeline_part(run: RunConfig) {
    // Partial moves: the chain and store stay alive with `serving` until the end.
    let serving = swarm(&[81u8, 82, 83], run.clone()).await;
    let (orch, client, miners) = (serving.orch, serving.client, serving.miners);
    let joined = eventually("joined", Duration::from_secs(300), || async {
        miners
            .iter()
            .all(|m| m.status().weights_epoch == Some(0))
            .then(Instant::now)
    })
    .await;
    let done = eventually("training done", Duration::from_secs(1800), || async {
        let st = client.status().await.ok()?;
        (st.epoch > 0 || st.phase != Phase::Training).then(Instant::now)
    })
    .await;
    let seconds = done.duration_since(joined).as_secs_f64();
    let wire: u64 = miners.iter().map(|m| m.status().boundary_bytes).sum();
    for m in miners {
        let _ = m.stop().await;
    }
    orch.stop().await;
    let tokens = run.samples_per_epoch * u64::from(run.micro_batch * run.seq_len);
    println!("{} {seconds} {wire}", tokens as f64 / seconds);
}

fn main() {
    let samples = env_or("PIPELINE_SAMPLES", 48);
    let in_flight = env_or("PIPELINE_IN_FLIGHT", 8) as u32;
    let run = run_config(samples, in_flight);
    match std::env::var(PART_VAR).as_deref() {
        Ok("monolithic") => {
            println!("{}", monolithic_tokens_per_s(&run));
            return;
        }
        Ok("pipeline") => {
            init_tracing();
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(pipeline_part(run));
            return;
        }
        _ => {}
    }

    // The parent: monolithic runs before and after the pipeline, each setting in its own
    // process since candle reads its thread counts once.
    let cores = threads::available_cores();
    let settings = monolithic_settings(cores);
    let before: Vec<f64> = settings
        .iter()
        .map(|(_, t)| child("monolithic", *t)[0])
        .collect();
    // The miners' setting is the one `iota localnet up` picks for three models on this machine.
    let pipeline_threads = CpuThreads::shared(3, cores);
    let p = child("pipeline", Some(pipeline_threads));
    let (pipeline, seconds, wire) = (p[0], p[1], p[2]);
    // For reference: the same pipeline with candle's defaults in every miner.
    let p_default = child("pipeline", None);
    let after: Vec<f64> = settings
        .iter()
        .map(|(_, t)| child("monolithic", *t)[0])
        .collect();

    let tokens = samples * u64::from(run.micro_batch * run.seq_len);
    println!(
        "pipeline against monolithic, `small` on the CPU ({cores} cores), {samples} samples of {}x{}, {in_flight} in flight, int8 wire",
        run.micro_batch, run.seq_len
    );
    println!("  monolithic (one graph, same samples and inner steps), tokens/s before and after:");
    let mut best = (0.0f64, "");
    for ((name, _), (b, a)) in settings.iter().zip(before.iter().zip(&after)) {
        let mean = (b + a) / 2.0;
        println!("    {name:<48} {b:>6.0} {a:>6.0}   mean {mean:.0}");
        if mean > best.0 {
            best = (mean, name);
        }
    }
    println!(
        "  pipeline (3 miners, orchestrator, PostgreSQL, object store; {} thread(s) per product, {} per element-wise op, as `iota localnet up` sets for 3 models): {pipeline:.0} tokens/s ({tokens} tokens in {seconds:.1} s, {:.1} MB on the wire)",
        pipeline_threads.matmul,
        pipeline_threads.elementwise,
        wire / 1e6
    );
    println!(
        "  the same pipeline with candle's defaults: {:.0} tokens/s ({:.2}x slower)",
        p_default[0],
        pipeline / p_default[0]
    );
    println!(
        "  ratio pipeline / best monolithic ({}): {:.3}",
        best.1,
        pipeline / best.0
    );
}
