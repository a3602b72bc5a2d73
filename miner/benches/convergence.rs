//! Convergence at equal tokens: `small` (18.9M parameters) trained on real English by the
//! decentralized system (3 stages x 2 miners, int8 boundary tensors, a merge every epoch: inner
//! AdamW and the outer Nesterov step on the averaged pseudo-gradients) against one process
//! training the same model with AdamW on the same samples in the same order, held-out loss of
//! both after every epoch on the same windows. The single process runs twice: stepping at each
//! miner's cadence (so twice the optimizer steps of the decentralized run, whose two miners per
//! stage each step on half the samples), and stepping on the global batch of a stage's miners
//! (the data-parallel equivalent: as many steps as each miner).
//!
//! The corpus is the Python documentation's sources as Debian's `python3-doc` ships them
//! (`IOTA_BENCH_CORPUS` for another folder of `.txt` files), tokenized with an 8,192-token BPE
//! trained on it. `CONVERGENCE_EPOCHS` (default 6) and `CONVERGENCE_SAMPLES` (samples per epoch,
//! default 48) size the run. `cargo bench -p iota-miner --bench convergence` with
//! `DATABASE_URL` set (`scripts/pg.sh start`), or `scripts/bench.sh convergence`.

use iota_testkit as support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use iota_model::data::prepare::prepare_with_new_tokenizer;
use iota_model::data::{Batch, make_batch};
use iota_model::{Device, ModelConfig, Pipeline, StageOptions};
use iota_protocol::ApiClient;
use iota_protocol::api::{PartitionState, RunConfig};
use iota_trainer::{run_dataset, run_model};
use support::*;

const DEBIAN_CORPUS: &str = "/usr/share/doc/python3-doc/html/_sources";
/// Held-out windows both sides are scored on.
const HELD_OUT: u64 = 64;
const MINERS: [u8; 6] = [61, 62, 63, 64, 65, 66];
/// 6 miners over the run's 3 stages.
const MINERS_PER_STAGE: u32 = 2;
const VALIDATOR: u8 = 70;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// The corpus prepared with an 8,192-token tokenizer: the folder and its manifest hash.
fn prepared(tmp: &Path) -> (PathBuf, String) {
    let corpus = std::env::var_os("IOTA_BENCH_CORPUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEBIAN_CORPUS));
    assert!(
        corpus.is_dir(),
        "{}: no corpus (apt-get install python3-doc, or set IOTA_BENCH_CORPUS)",
        corpus.display()
    );
    prepare_with_new_tokenizer(&corpus, 8192, tmp, 50_000).expect("prepare")
}

fn run_config(samples: u64, dataset: String) -> RunConfig {
    let model = ModelConfig::small();
    RunConfig {
        name: "convergence".into(),
        model: "small".into(),
        stages: 3,
        stage_params: (0..3)
            .map(|k| model.stage_param_count(k).expect("stage") as u64)
            .collect(),
        partitions: 4,
        micro_batch: 4,
        seq_len: 64,
        boundary_dim: model.boundary_dim() as u32,
        samples_per_epoch: samples,
        max_in_flight: 8,
        training_s: 1800,
        uploading_s: 300,
        merging_s: 300,
        merge_round_s: 60,
        lease_s: 300,
        heartbeat_timeout_s: 120,
        dataset: Some(dataset),
        ..tiny_run("convergence", samples)
    }
}

/// The decentralized run: held-out loss before training and after each epoch, and the samples
/// each epoch trained (done end to end), in id order.
async fn decentralized(run: &RunConfig, data: &Path, held: &Batch, epochs: u64) -> Decentralized {
    let chain = chain_with(&MINERS, &[VALIDATOR]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("store");
    let orch = start(config(&chain, &db, store.path(), run.clone())).await;
    let validator = explorer(&orch.base, VALIDATOR).await;
    // The weights epoch `e` starts with, scored on the same windows as the single process.
    let held = |e: u64| {
        let (client, run) = (&validator, run);
        async move {
            let (stages, _) = epoch_start_stages(client, run, e).await;
            let pipe = Pipeline::from_stages(stages).expect("pipeline");
            pipe.eval_loss(&held.inputs, &held.targets).expect("eval")
        }
    };
    let mut losses = vec![held(0).await];
    let started = Instant::now();
    let miners: Vec<_> = MINERS
        .iter()
        .map(|s| {
            let mut cfg = miner_config(&orch.base);
            cfg.tokens_per_s = Some(1000.0);
            cfg.data_dir = Some(data.to_path_buf());
            iota_miner::spawn(cfg, signer(*s))
        })
        .collect();
    let mut trained = Vec::new();
    let mut merged = Vec::new();
    for e in 1..=epochs {
        wait_epoch(&validator, e, Duration::from_secs(3600)).await;
        // Read before the held-out loss, so that the table shows any partition the evaluated
        // weights lacked.
        let merges = merge_summary(&validator, e - 1).await;
        losses.push(held(e).await);
        let mut done = Vec::new();
        let mut after = 0;
        loop {
            let page = validator.samples(e - 1, after, 500).await.expect("samples");
            done.extend(
                page.samples
                    .iter()
                    .filter(|s| s.status == "done")
                    .map(|s| s.sample_id),
            );
            match page.next_after {
                Some(a) => after = a,
                None => break,
            }
        }
        done.sort_unstable();
        eprintln!(
            "epoch {e}: {} samples done, merges {merges}, held-out loss {:.4}",
            done.len(),
            losses[e as usize]
        );
        merged.push(merges);
        trained.push(done);
    }
    let seconds = started.elapsed().as_secs_f64();
    for m in miners {
        let _ = m.stop().await;
    }
    orch.stop().await;
    drop(chain);
    Decentralized {
        losses,
        trained,
        merged,
        seconds,
    }
}

/// What the decentralized run measured.
struct Decentralized {
    /// Held-out loss before training and after each epoch.
    losses: Vec<f32>,
    /// The samples each epoch trained (done end to end), in id order.
    trained: Vec<Vec<i64>>,
    /// How each epoch's partitions were settled.
    merged: Vec<String>,
    seconds: f64,
}

/// How `epoch`'s partitions were settled, e.g. `12/12 (agreement 11, validator 1)`: an epoch
/// whose partitions were not all merged leaves some of the model at older weights.
async fn merge_summary(client: &ApiClient, epoch: u64) -> String {
    let parts = client.merge_status(epoch).await.expect("merge status");
    let mut by = std::collections::BTreeMap::<String, usize>::new();
    for p in &parts {
        let how = match (&p.state, &p.resolved_by) {
            (PartitionState::Accepted, Some(r)) => r.split(':').next().unwrap_or(r).to_owned(),
            (state, _) => format!("{state:?}").to_lowercase(),
        };
        *by.entry(how).or_default() += 1;
    }
    let accepted = parts
        .iter()
        .filter(|p| p.state == PartitionState::Accepted)
        .count();
    let by: Vec<String> = by.iter().map(|(k, n)| format!("{k} {n}")).collect();
    format!("{accepted}/{} ({})", parts.len(), by.join(", "))
}

/// One process: the same model from the same initial weights, AdamW on every stage at the
/// run's learning rate with a step every `steps_every` samples, over the samples the run
/// trained, in id order; the held-out loss before training and after each epoch's samples.
fn single_process(
    run: &RunConfig,
    data: &Path,
    held: &Batch,
    trained: &[Vec<i64>],
    steps_every: u32,
) -> (Vec<f32>, f64) {
    let model = run_model(run).expect("model");
    let ds = run_dataset(run, &model, Some(data)).expect("dataset");
    let mut pipe = Pipeline::new(&model, &StageOptions::cpu()).expect("pipeline");
    let mut opts = stage_optimizers(run, &model, &mut pipe);
    let eval = |pipe: &Pipeline| pipe.eval_loss(&held.inputs, &held.targets).expect("eval");
    let mut losses = vec![eval(&pipe)];
    let started = Instant::now();
    let mut since_step = 0u32;
    for samples in trained {
        for s in samples {
            let b = make_batch(ds.as_ref(), &run.sequence_ids(*s), &Device::Cpu).expect("batch");
            pipe.forward_backward_monolithic(&b.inputs, &b.targets)
                .expect("train");
            since_step += 1;
            if since_step == steps_every {
                for (stage, opt) in pipe.stages_mut().iter_mut().zip(&mut opts) {
                    opt.step_with(stage, run.inner_lr).expect("step");
                }
                since_step = 0;
            }
        }
        losses.push(eval(&pipe));
        eprintln!(
            "single process (a step every {steps_every} samples) after {} samples: held-out loss {:.4}",
            samples.len(),
            losses.last().copied().unwrap_or(f32::NAN)
        );
    }
    (losses, started.elapsed().as_secs_f64())
}

fn main() {
    let epochs = env_or("CONVERGENCE_EPOCHS", 6);
    let samples = env_or("CONVERGENCE_SAMPLES", 48);
    println!("load average before: {}", load_average());
    let tmp = tempfile::tempdir().expect("tmp");
    let (data, hash) = prepared(tmp.path());
    let run = run_config(samples, hash);
    run.validate().expect("run config");
    init_tracing();
    let held = {
        let model = run_model(&run).expect("model");
        let ds = run_dataset(&run, &model, Some(&data)).expect("dataset");
        make_batch(ds.as_ref(), &run.held_out_ids(HELD_OUT), &Device::Cpu).expect("held out")
    };
    let Decentralized {
        losses: dec,
        trained,
        merged,
        seconds: dec_s,
    } = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(decentralized(&run, &data, &held, epochs));
    // Per miner: a step every `inner_steps_every` of a miner's own samples, as each miner
    // steps. Global batch: a step over the samples all miners of a stage trained meanwhile, the
    // data-parallel equivalent (the same number of optimizer steps as each miner takes).
    let per_miner = run.inner_steps_every;
    let global = run.inner_steps_every * MINERS_PER_STAGE;
    let (single, single_s) = single_process(&run, &data, &held, &trained, per_miner);
    let (batched, batched_s) = single_process(&run, &data, &held, &trained, global);
    let tokens: usize =
        trained.iter().map(Vec::len).sum::<usize>() * (run.micro_batch * run.seq_len) as usize;
    println!(
        "## Convergence at equal tokens: `small` (18.9M parameters, vocab 8192), {epochs} epochs of up to {samples} samples of {}x{} tokens ({tokens} tokens trained), real English (python3-doc)",
        run.micro_batch, run.seq_len
    );
    println!();
    println!(
        "Decentralized: 3 stages x {MINERS_PER_STAGE} miners, int8 boundary tensors, {} partitions per stage merged every epoch (inner AdamW lr {}, a step every {per_miner} gradient hops, moments reset each epoch; outer lr {}, momentum {}), {dec_s:.0} s. Single process: AdamW at the same lr over the same samples in id order, moments kept, with a step every {per_miner} samples (each miner's cadence, twice the decentralized run's optimizer steps), {single_s:.0} s, and with a step every {global} samples (the global batch of a stage's miners, as many steps as each miner takes), {batched_s:.0} s.",
        run.partitions, run.inner_lr, run.outer_lr, run.outer_momentum
    );
    println!();
    println!(
        "Held-out loss (nats/token) on the same {HELD_OUT} held-out windows, after each epoch:"
    );
    println!();
    println!(
        "| epoch | samples trained | partitions merged | decentralized | single, step every {per_miner} | ratio | single, step every {global} | ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for e in 0..=epochs as usize {
        let (n, how) = if e == 0 {
            (0, "")
        } else {
            (trained[e - 1].len(), merged[e - 1].as_str())
        };
        println!(
            "| {e} | {n} | {how} | {:.4} | {:.4} | {:.3} | {:.4} | {:.3} |",
            dec[e],
            single[e],
            dec[e] / single[e],
            batched[e],
            dec[e] / batched[e]
        );
    }
    println!();
    let last = epochs as usize;
    println!(
        "Held-out loss ratio at the end, decentralized / single process: **{:.3}** against a step every {per_miner} samples, **{:.3}** against the global batch (goal: at most 1.02).",
        dec[last] / single[last],
        dec[last] / batched[last]
    );
    println!();
    println!("load average after: {}", load_average());
}
