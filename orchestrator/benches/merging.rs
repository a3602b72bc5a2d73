//! How long merging takes to start (the exclusive phase lock held, which every work request
//! waits on) as partitions grow: simulated miners (two per stage) upload a pseudo-gradient
//! partition for every partition of their stage, then the phase driver starts merging and
//! `iota_phase_change_seconds{step="start_merging"}` says how long that took. Then nobody
//! merges, and at the merging deadline the driver gives every partition another owner
//! (`step="reassign_round"`); at the last deadline the epoch ends with every partition still
//! open, settled as unmerged (`step="next_epoch"`).
//!
//! `cargo bench -p iota-orchestrator --bench merging` (needs `DATABASE_URL`, as the tests do).

use iota_testkit::common;

use std::time::{Duration, Instant};

use common::*;
use futures::future::join_all;
use iota_protocol::api::{EpochStatus, Phase};
use iota_testkit::sim::SimMiner;

const SEEDS: [u8; 6] = [1, 2, 3, 4, 5, 6];

/// Sum of the process's `iota_phase_change_seconds` samples for `step`, and their count.
fn timed(metrics: &str, step: &str) -> (f64, u64) {
    let value = |what: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "iota_phase_change_seconds_{what}{{step=\"{step}\"}}"
                ))
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (value("sum"), value("count") as u64)
}

struct Measured {
    /// Seconds the driver spent starting merging.
    start_merging: f64,
    /// From the epoch's start until merging began.
    reached: Duration,
    /// Seconds of a reassignment round (the mean), and the partitions the first gave another
    /// owner.
    reassign: f64,
    reassigned: i64,
    /// Seconds of the epoch's end, every partition still open.
    next_epoch: f64,
}

/// One run at `partitions` per stage; `before` is what the process's recorder held before it.
async fn measure(
    chain: &Chain,
    partitions: u32,
    before: &str,
) -> anyhow::Result<(Measured, String)> {
    let db_url = fresh_db().await;
    let store = tempfile::tempdir()?;
    let mut run = run_config(&format!("merging-{partitions}"));
    run.partitions = partitions;
    run.stage_params = vec![8000, 8000, 8000];
    run.training_s = 20;
    // Long enough for every upload: merging starts by quorum, when all have arrived.
    run.uploading_s = 3600;
    run.merging_s = 2;
    run.merge_round_s = 2;
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
    // Nobody merges: at the deadline every partition is given another owner, and at the last
    // the epoch ends.
    let (reassign_before, rounds_before) = timed(before, "reassign_round");
    let (ended_before, ends_before) = timed(before, "next_epoch");
    let metrics = loop {
        let metrics = reqwest::get(format!("{}/metrics", orch.base))
            .await?
            .text()
            .await?;
        if timed(&metrics, "next_epoch").1 > ends_before {
            break metrics;
        }
        anyhow::ensure!(
            began.elapsed() < Duration::from_secs(1800),
            "the epoch never ended"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Every round reassigns every partition (nobody merges): their mean.
    let (reassign_sum, rounds) = timed(&metrics, "reassign_round");
    anyhow::ensure!(rounds > rounds_before, "no reassignment round");
    let reassign = (reassign_sum - reassign_before) / (rounds - rounds_before) as f64;
    let db = sqlx::PgPool::connect(&db_url).await?;
    let reassigned: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT (stage, partition)) FROM partition_owners WHERE round = 1",
    )
    .fetch_one(&db)
    .await?;
    db.close().await;
    orch.stop().await;
    let measured = Measured {
        start_merging: timed(&metrics, "start_merging").0 - timed(before, "start_merging").0,
        reached,
        reassign,
        reassigned,
        next_epoch: timed(&metrics, "next_epoch").0 - ended_before,
    };
    Ok((measured, metrics))
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
        println!("start of merging, a reassignment round and the end of the epoch (each with the exclusive phase lock held), 3 stages, 2 miners per stage, each uploading every partition of its stage; nobody merges, so every partition is reassigned at the deadline and still open when the epoch ends");
        println!("partitions per stage   contributions   start_merging ms   reassigned   reassign_round ms   next_epoch ms   epoch start to merging s");
        let mut metrics = String::new();
        for partitions in [100u32, 1000, 4000] {
            let (m, now) = measure(&chain, partitions, &metrics).await?;
            metrics = now;
            println!(
                "{partitions:>20}   {:>13}   {:>16.1}   {:>10}   {:>17.1}   {:>13.1}   {:>24.1}",
                SEEDS.len() as u32 * partitions,
                m.start_merging * 1000.0,
                m.reassigned,
                m.reassign * 1000.0,
                m.next_epoch * 1000.0,
                m.reached.as_secs_f64()
            );
        }
        Ok(())
    })
}
