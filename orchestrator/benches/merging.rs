//! How long merging takes to start (the exclusive phase lock held, which every work request
//! waits on) as partitions grow: simulated miners (two per stage) upload a pseudo-gradient
//! partition for every partition of their stage, then the phase driver starts merging and
//! `iota_phase_change_seconds{step="start_merging"}` says how long that took.
//!
//! `cargo bench -p iota-orchestrator --bench merging` (needs `DATABASE_URL`, as the tests do).

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use futures::future::join_all;
use iota_orchestrator::sim::SimMiner;
use iota_protocol::api::{EpochStatus, Phase};

const SEEDS: [u8; 6] = [1, 2, 3, 4, 5, 6];

/// Seconds the phase driver spent starting merging, and how long the epoch took to get there.
async fn start_merging_at(chain: &Chain, partitions: u32) -> anyhow::Result<(f64, Duration)> {
    let db_url = fresh_db().await;
    let store = tempfile::tempdir()?;
    let mut run = run_config(&format!("merging-{partitions}"));
    run.partitions = partitions;
    run.stage_params = vec![8000, 8000, 8000];
    run.training_s = 20;
    // Long enough for every upload: merging starts by quorum, when all have arrived.
    run.uploading_s = 3600;
    run.merging_s = 60;
    run.heartbeat_timeout_s = 3600;
    run.lease_s = 60;
    let orch = start(config(chain, &db_url, store.path(), run)).await;
    let mut miners = Vec::new();
    for (i, seed) in SEEDS.iter().enumerate() {
        miners.push(
            SimMiner::join(
                &orch.base,
                signer(*seed),
                100.0 + i as f64,
                u64::from(*seed),
            )
            .await?,
        );
    }
    let began = Instant::now();
    loop {
        let status: EpochStatus = reqwest::get(format!("{}/v1/status", orch.base))
            .await?
            .json()
            .await?;
        if status.phase == Phase::Merging {
            break;
        }
        anyhow::ensure!(
            began.elapsed() < Duration::from_secs(1800),
            "merging never started"
        );
        for step in join_all(miners.iter_mut().map(|m| m.step())).await {
            step?;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reached = began.elapsed();
    let metrics = reqwest::get(format!("{}/metrics", orch.base))
        .await?
        .text()
        .await?;
    orch.stop().await;
    // The recorder is the process's: each run's orchestrator adds one sample to the same series.
    let sum = metrics
        .lines()
        .find(|l| l.starts_with("iota_phase_change_seconds_sum{step=\"start_merging\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .ok_or_else(|| anyhow::anyhow!("start_merging was not timed"))?;
    Ok((sum, reached))
}

fn main() -> anyhow::Result<()> {
    if std::env::var("DATABASE_URL").is_err() {
        anyhow::bail!(
            "DATABASE_URL is not set: run through scripts/bench.sh, or eval \"$(scripts/pg.sh start)\""
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let chain = chain_with(&SEEDS, &[]).await;
        println!("start of merging (exclusive phase lock held), 3 stages, 2 miners per stage, each uploading every partition of its stage");
        println!("partitions per stage   contributions   start_merging ms   epoch start to merging s");
        let mut before = 0.0;
        for partitions in [100u32, 1000, 4000] {
            let (sum, reached) = start_merging_at(&chain, partitions).await?;
            println!(
                "{partitions:>20}   {:>13}   {:>16.1}   {:>24.1}",
                SEEDS.len() as u32 * partitions,
                (sum - before) * 1000.0,
                reached.as_secs_f64()
            );
            before = sum;
        }
        Ok(())
    })
}
