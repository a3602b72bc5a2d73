//! A real run: localnet + PostgreSQL + orchestrator + 3 stages × 2 miners training the `tiny`
//! model on the CPU for several epochs. Needs `DATABASE_URL` (scripts/test.sh starts PostgreSQL).

use crate::support;

use std::time::Duration;

use iota_miner::{MinerHandle, spawn};
use support::*;

const EPOCHS: u64 = 3;

async fn start_miners(base: &str, seeds: &[u8]) -> Vec<MinerHandle> {
    seeds
        .iter()
        .map(|s| {
            let mut cfg = miner_config(base);
            cfg.seed = u64::from(*s);
            // One throughput for all, so the stage choice gives each stage two miners.
            cfg.tokens_per_s = Some(1000.0);
            spawn(cfg, signer(*s))
        })
        .collect()
}

/// Waits until every miner has moved past epoch `epoch`'s start and returns, per miner, its stage
/// and the digest of the start weights it loaded for `epoch`.
async fn loaded_digests(miners: &[MinerHandle], epoch: u64) -> Vec<(u32, String)> {
    eventually(
        &format!("miners on epoch {epoch}'s weights"),
        Duration::from_secs(60),
        || async {
            let all: Vec<_> = miners.iter().map(|m| m.status()).collect();
            all.iter().all(|s| s.weights_epoch >= Some(epoch)).then(|| {
                all.iter()
                    .map(|s| {
                        let (_, d) = s
                            .weights_history
                            .iter()
                            .find(|(e, _)| *e == epoch)
                            .unwrap_or_else(|| panic!("{} skipped epoch {epoch}", s.hotkey));
                        (s.stage.expect("stage"), d.clone())
                    })
                    .collect()
            })
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn miners_train_merge_and_agree() {
    init_tracing();
    let seeds = [11u8, 12, 13, 14, 15, 16];
    let chain = chain_with(&seeds, &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("store");
    let run = tiny_run("miners-train", 24);
    let orch = start(config(&chain, &db, store.path(), run.clone())).await;
    let client = explorer(&orch.base, seeds[0]).await;
    let initial = held_out_loss(&client, &run, 0).await;

    let miners = start_miners(&orch.base, &seeds).await;
    let mut losses = vec![initial];
    for epoch in 1..=EPOCHS {
        wait_epoch(&client, epoch, Duration::from_secs(240)).await;
        assert_all_agreed(&client, &run, epoch - 1).await;
        // Every miner of a stage loaded bit-identical weights: the merged ones.
        let (_, merged) = epoch_start_stages(&client, &run, epoch).await;
        for (stage, digest) in loaded_digests(&miners, epoch).await {
            assert_eq!(
                digest, merged[stage as usize],
                "stage {stage} at the start of epoch {epoch}"
            );
        }
        losses.push(held_out_loss(&client, &run, epoch).await);
    }
    eprintln!("held-out loss by epoch: {losses:?}");
    if !losses.windows(2).all(|w| w[1] < w[0]) {
        // How each epoch's partitions were settled and how many samples finished: what to look
        // at when the loss rises (a partition left unmerged moves one stage without the rest).
        let mut epochs = Vec::new();
        for epoch in 0..EPOCHS {
            let merges = client.merge_status(epoch).await.expect("merges");
            let settled: Vec<String> = merges
                .iter()
                .map(|p| {
                    format!(
                        "{}/{} {:?} {}",
                        p.stage,
                        p.partition,
                        p.state,
                        p.resolved_by.as_deref().unwrap_or("-")
                    )
                })
                .collect();
            epochs.push(format!("epoch {epoch}: {settled:?}"));
        }
        panic!(
            "held-out loss did not go down: {losses:?}\n{}",
            epochs.join("\n")
        );
    }
    let stages: std::collections::HashSet<u32> =
        miners.iter().filter_map(|m| m.status().stage).collect();
    assert_eq!(stages.len(), 3, "every stage has miners");
    let mut borrowed_bases = 0;
    for m in miners {
        let s = m.stop().await.expect("clean stop");
        assert!(s.hops > 0, "{} did no work", s.hotkey);
        assert_eq!(s.nonfinite_events, 0);
        // Two miners a stage own every partition of it, with a third owner borrowed from another
        // stage, and their results agreed: every epoch's weights are ones the miner computed
        // itself, so none is downloaded. Only a borrowed owner downloads a merge base, of a
        // stage it does not hold.
        assert_eq!(
            s.all_reduce.weights_received, 0,
            "{} downloaded merged partitions it held",
            s.hotkey
        );
        borrowed_bases += s.all_reduce.bases_received;
        assert!(s.all_reduce.contributions_received > 0);
    }
    assert!(borrowed_bases > 0, "no stage borrowed a third owner");
    orch.stop().await;
}

/// Four miners a stage and four partitions: each miner owns three partitions an epoch, and the
/// owners change from epoch to epoch. Every merge base is a partition the owner loaded at the
/// epoch's start, so none is downloaded; at each start a miner downloads only the partitions it
/// did not merge itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn owners_merge_from_the_partitions_they_loaded() {
    init_tracing();
    let seeds: Vec<u8> = (21..33).collect();
    let mut run = tiny_run("reuse", 18);
    run.partitions = 4;
    let swarm = swarm(&seeds, run.clone()).await;
    wait_epoch(&swarm.client, 3, Duration::from_secs(240)).await;
    for epoch in 0..3 {
        assert_all_agreed(&swarm.client, &run, epoch).await;
    }
    let mut downloaded_weights = 0;
    for m in swarm.miners {
        let s = m.stop().await.expect("clean stop");
        assert!(s.merges > 0, "{} merged nothing", s.hotkey);
        assert_eq!(
            s.all_reduce.bases_received, 0,
            "{} downloaded a merge base it had loaded",
            s.hotkey
        );
        downloaded_weights += s.all_reduce.weights_received;
    }
    // Partitions owned by others were downloaded (the owners do change).
    assert!(downloaded_weights > 0);
    swarm.orch.stop().await;
}
