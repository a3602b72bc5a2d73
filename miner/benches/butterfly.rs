//! The weight all-reduce at 2, 4, 8 and 16 miners per stage: bytes each miner sends and
//! receives for one epoch's merge, as a multiple of its stage's fp32 size, and the time from the
//! start of the upload phase until every miner has loaded the merged weights.
//!
//! `cargo bench -p iota-miner --bench butterfly` with `DATABASE_URL` set (`scripts/pg.sh start`).
//! Real miners (`tiny` at width 256, 3 stages) against a real orchestrator, PostgreSQL and localnet;
//! partitions = miners per stage, three owners per partition. Each miner is measured from loading
//! the weights of the first epoch that starts once all have joined (never the run's first, which
//! merges onto the initial weights) to loading the next epoch's. Every size runs with dense pseudo-gradients and with
//! sparse ones (`top-K/CHUNK`, `BUTTERFLY_SPARSE`, top-32/1024 by default: compressed uploads;
//! compressed merged updates that each miner applies, keeping `BUTTERFLY_MERGED_TOP` values a
//! chunk, 128 by default: the union of four uploads; `BUTTERFLY_SPARSE_BITS=4` for 4-bit values,
//! 8 by default). `BUTTERFLY_SIZES=2,4` picks the sizes,
//! `BUTTERFLY_MODES=sparse` (or `dense`) one of the two.

use iota_testkit as support;

use std::time::{Duration, Instant};

use iota_miner::{AllReduceBytes, MinerHandle, spawn};
use iota_protocol::api::{Phase, RunConfig, SparseEncoding};
use iota_protocol::client::ApiClient;
use support::*;

/// Per miner, in multiples of its stage's fp32 size.
#[derive(Default)]
struct Figures {
    pseudo_gradients: String,
    per_stage: usize,
    contributors: usize,
    /// Miners that held epoch 1's weights (the others are left out of the means).
    measured: usize,
    pseudo_gradients_sent: f64,
    contributions_received: f64,
    bases_received: f64,
    merged_sent: f64,
    weights_received: f64,
    mean: f64,
    max: f64,
    seconds: f64,
}

/// `tiny` at width 256: large enough that an object's safetensors header (about 300 bytes) is
/// a small part of a compressed partition even at 16 partitions a stage, small enough for 48
/// miners on a few cores. Written to `dir`, which the run names it by.
fn bench_model(dir: &std::path::Path) -> iota_model::ModelConfig {
    let model = iota_model::ModelConfig {
        name: "butterfly".into(),
        d_model: 256,
        d_ff: 512,
        ..iota_model::ModelConfig::tiny()
    };
    let json = model.to_json().expect("model json");
    std::fs::write(dir.join("butterfly.json"), json).expect("model file");
    model
}

fn run_config(
    per_stage: usize,
    sparse: Option<SparseEncoding>,
    dir: &std::path::Path,
) -> RunConfig {
    let mut run = tiny_run("butterfly", 4 * per_stage as u64);
    let model = bench_model(dir);
    run.model = dir.join("butterfly.json").display().to_string();
    run.stage_params = (0..model.num_stages())
        .map(|k| model.stage_param_count(k).expect("stage") as u64)
        .collect();
    run.sparse = sparse;
    run.partitions = per_stage as u32;
    run.max_in_flight = 2 * per_stage as u32;
    run.lease_s = 60;
    run.heartbeat_timeout_s = 60;
    run
}

/// A miner's all-reduce counters and pseudo-gradient partitions uploaded.
fn counters(m: &MinerHandle) -> (AllReduceBytes, u64) {
    let s = m.status();
    (s.all_reduce, s.pseudo_gradients)
}

/// Each miner's counters when it has loaded `epoch`'s weights and when it has loaded the next
/// epoch's: between the two lie exactly its part in `epoch`'s merge. Taken per miner, since in
/// a fast run some miners are already past `epoch` before others have loaded it. A miner that
/// never held `epoch`'s weights has `None`. Also returns when the run left `epoch`'s training.
async fn one_epoch(
    miners: &[MinerHandle],
    client: &ApiClient,
    epoch: u64,
) -> (Vec<Option<[(AllReduceBytes, u64); 2]>>, Instant) {
    let mut start: Vec<Option<(AllReduceBytes, u64)>> = vec![None; miners.len()];
    let mut window = vec![None; miners.len()];
    let mut done = vec![false; miners.len()];
    let mut upload_started = None;
    let deadline = Instant::now() + Duration::from_secs(600);
    while done.iter().any(|d| !d) {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for epoch {}",
            epoch + 1
        );
        for (i, m) in miners.iter().enumerate() {
            let loaded = m.status().weights_epoch;
            if loaded == Some(epoch) && start[i].is_none() {
                start[i] = Some(counters(m));
            } else if loaded > Some(epoch) && !done[i] {
                done[i] = true;
                window[i] = start[i].take().map(|s| [s, counters(m)]);
            }
        }
        if upload_started.is_none()
            && let Ok(st) = client.status().await
            && (st.epoch > epoch || st.phase != Phase::Training)
        {
            upload_started = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (window, upload_started.unwrap_or_else(Instant::now))
}

async fn measure(per_stage: usize, sparse: Option<SparseEncoding>) -> Figures {
    let model_dir = tempfile::tempdir().expect("model dir");
    let run = run_config(per_stage, sparse, model_dir.path());
    let seeds: Vec<u8> = (0..(3 * per_stage) as u8).map(|i| 10 + i).collect();
    let chain = chain_with(&seeds, &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("store");
    let orch = start(config(&chain, &db, store.path(), run.clone())).await;
    let client = explorer(&orch.base, seeds[0]).await;
    let mut miners = Vec::new();
    for s in &seeds {
        let mut cfg = miner_config(&orch.base);
        cfg.tokens_per_s = Some(1000.0);
        miners.push(spawn(cfg, signer(*s)));
        // One at a time, so the stage choice (least loaded) spreads them evenly.
        let n = miners.len();
        eventually("joined", Duration::from_secs(120), || async {
            miners[..n]
                .iter()
                .all(|m| m.status().stage.is_some())
                .then_some(())
        })
        .await;
    }
    // The first epoch that starts after every miner joined, and not the first of the run (that
    // one merges onto the initial weights).
    let joined = client.status().await.expect("status").epoch;
    let (windows, upload_started) = one_epoch(&miners, &client, joined.max(1) + 1).await;
    let seconds = upload_started.elapsed().as_secs_f64();
    let mut f = Figures {
        pseudo_gradients: match sparse {
            Some(s) => format!(
                "top-{}/{}, merged top-{}, {}-bit values",
                s.k,
                s.chunk,
                s.merged_k(),
                s.bits()
            ),
            None => "dense".into(),
        },
        per_stage,
        seconds,
        ..Figures::default()
    };
    let mut totals = Vec::new();
    for (m, window) in miners.iter().zip(&windows) {
        let Some([(b, bp), (a, ap)]) = window else {
            continue;
        };
        f.measured += 1;
        let stage = m.status().stage.expect("stage") as usize;
        let size = 4.0 * run.stage_params[stage] as f64;
        let d = |get: fn(&AllReduceBytes) -> u64| (get(a) - get(b)) as f64 / size;
        f.pseudo_gradients_sent += d(|r| r.pseudo_gradients_sent);
        f.contributions_received += d(|r| r.contributions_received);
        f.bases_received += d(|r| r.bases_received);
        f.merged_sent += d(|r| r.merged_sent);
        f.weights_received += d(|r| r.weights_received);
        totals.push(d(|r| r.sent() + r.received()));
        if ap > bp {
            f.contributors += 1;
        }
    }
    let n = totals.len() as f64;
    for x in [
        &mut f.pseudo_gradients_sent,
        &mut f.contributions_received,
        &mut f.bases_received,
        &mut f.merged_sent,
        &mut f.weights_received,
    ] {
        *x /= n;
    }
    f.mean = totals.iter().sum::<f64>() / n;
    f.max = totals.iter().cloned().fold(0.0, f64::max);
    for m in miners {
        let _ = m.stop().await;
    }
    orch.stop().await;
    f
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    init_tracing();
    let sizes: Vec<usize> = std::env::var("BUTTERFLY_SIZES")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![2, 4, 8, 16]);
    let sparse = std::env::var("BUTTERFLY_SPARSE").unwrap_or_else(|_| "top-32/1024".into());
    let sparse = sparse
        .strip_prefix("top-")
        .and_then(|s| s.split_once('/'))
        .and_then(|(k, chunk)| {
            Some(SparseEncoding {
                chunk: chunk.parse().ok()?,
                k: k.parse().ok()?,
                merged_k: match std::env::var("BUTTERFLY_MERGED_TOP") {
                    Ok(m) => Some(m.parse().ok()?),
                    Err(_) => Some(128),
                },
                bits: match std::env::var("BUTTERFLY_SPARSE_BITS") {
                    Ok(b) => Some(b.parse().ok()?),
                    Err(_) => None,
                },
            })
        })
        .expect(
            "BUTTERFLY_SPARSE is top-K/CHUNK, BUTTERFLY_MERGED_TOP a count and BUTTERFLY_SPARSE_BITS 8 or 4",
        );
    let modes = std::env::var("BUTTERFLY_MODES").unwrap_or_else(|_| "dense,sparse".into());
    let modes: Vec<Option<SparseEncoding>> = modes
        .split(',')
        .map(|m| match m.trim() {
            "dense" => None,
            "sparse" => Some(sparse),
            other => panic!("BUTTERFLY_MODES lists dense and sparse, not {other:?}"),
        })
        .collect();
    let mut rows = Vec::new();
    for mode in modes {
        for &n in &sizes {
            let f = measure(n, mode).await;
            eprintln!(
                "{} {n} per stage: {:.2}x mean, {:.1} s",
                f.pseudo_gradients, f.mean, f.seconds
            );
            rows.push(f);
        }
    }
    println!(
        "weight all-reduce, `tiny` at d_model 256 (stages of {:?} parameters), partitions = miners per stage, 3 owners each",
        run_config(2, None, tempfile::tempdir().expect("dir").path()).stage_params
    );
    println!(
        "bytes per miner for one epoch's merge (not the first), in multiples of its stage's fp32 size; means over the miners"
    );
    println!();
    println!(
        "| pseudo-gradients | miners/stage | measured | contributors | pseudo-gradient up | contributions down | bases down | merged up | weights down | reduce (pg up + contributions down) | total (mean) | total (max) | time (s) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for f in &rows {
        println!(
            "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.1} |",
            f.pseudo_gradients,
            f.per_stage,
            f.measured,
            f.contributors,
            f.pseudo_gradients_sent,
            f.contributions_received,
            f.bases_received,
            f.merged_sent,
            f.weights_received,
            f.pseudo_gradients_sent + f.contributions_received,
            f.mean,
            f.max,
            f.seconds
        );
    }
    // Across sizes, per mode.
    for mode in ["dense", "top-"] {
        let rows: Vec<&Figures> = rows
            .iter()
            .filter(|f| f.pseudo_gradients.starts_with(mode))
            .collect();
        let spread = |get: fn(&Figures) -> f64| {
            let lo = rows.iter().map(|f| get(f)).fold(f64::INFINITY, f64::min);
            let hi = rows.iter().map(|f| get(f)).fold(0.0, f64::max);
            hi / lo
        };
        let Some(first) = rows.first() else { continue };
        println!();
        println!(
            "{}: max/min across sizes: reduce {:.3}, total {:.3}; largest total (mean) {:.3}x",
            first.pseudo_gradients,
            spread(|f| f.pseudo_gradients_sent + f.contributions_received),
            spread(|f| f.mean),
            rows.iter().map(|f| f.mean).fold(0.0, f64::max)
        );
    }
}
