//! A sparse run (`--pseudo-gradients top-K/CHUNK`): miners upload compressed pseudo-gradients,
//! two owners of each partition publish the same compressed merged update (accepted by their
//! hashes' agreement), every miner applies the updates itself and the miners of a stage hold
//! the same weights, the weights rebuilt from the public record are theirs, and a validator
//! recomputes each merge to the owners' hash and passes honest miners' replays. A miner that
//! publishes wrong merges is caught by the same recomputation.
//!
//! A real run: localnet, PostgreSQL, orchestrator, 7 `tiny` miners on the CPU, a validator.
//! Needs `DATABASE_URL` (scripts/test.sh starts PostgreSQL).

use crate::harness;
use crate::support;

use std::time::Duration;

use harness::validator;
use iota_protocol::api::{PartitionState, SparseEncoding};
use iota_protocol::tensor::TensorSpec;
use support::*;

const MINERS: [u8; 6] = [91, 92, 93, 94, 95, 96];
const WRONG_MERGER: u8 = 97;
const VALIDATOR: u8 = 99;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_merges_agree_by_hash_and_validators_recompute_them() {
    init_tracing();
    let mut all = MINERS.to_vec();
    all.push(WRONG_MERGER);
    let chain = chain_with(&all, &[VALIDATOR]).await;
    let ticking = async {
        // The localnet seals blocks on demand: keep the chain moving as a real one would.
        loop {
            chain.net.produce_blocks(1);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let body = async {
        let db = fresh_db().await;
        let store_dir = tempfile::tempdir().expect("store");
        let mut run = tiny_run("sparse", 24);
        // Merged updates keep four times what an upload does, so uploads send their offsets as
        // a list and merged updates as a bitmap; values have 4 bits.
        run.sparse = Some(SparseEncoding {
            chunk: 512,
            k: 16,
            merged_k: Some(64),
            bits: Some(4),
        });
        // Short enough that epoch 0 is collected within the test, long enough that the validator
        // scores each of epochs 0 and 1 before its objects go (a sparse run's epochs take a few
        // seconds).
        run.retention_epochs = 4;
        let orch = start(config(&chain, &db, store_dir.path(), run.clone())).await;
        let client = explorer(&orch.base, VALIDATOR).await;
        let mut miners = Vec::new();
        for s in MINERS {
            miners.push(joined(&orch.base, s, 1000.0, None).await);
        }
        // A validator, to score epochs 0 and 1 as soon as they end.
        let (v, store) = validator(
            chain.net.ws_url(),
            &orch.base,
            chain.netuid,
            VALIDATOR,
            |c| {
                c.replays_per_epoch = 3;
                c.merges_per_epoch = 64;
                c.set_weights = false;
            },
        )
        .await;
        for epoch in 0..2 {
            wait_epoch(&client, epoch + 1, Duration::from_secs(300)).await;
            let scored = v.step().await.expect("validator step");
            assert!(scored.contains(&epoch), "scored {scored:?}");
        }

        // Every upload and merge was compressed: the record's blobs are sparse partitions, a few
        // percent of the dense ones.
        for epoch in 0..2 {
            assert_all_agreed(&client, &run, epoch).await;
            let record = client.epoch_record(epoch).await.expect("record");
            assert!(!record.pseudo_gradients.is_empty());
            for pg in &record.pseudo_gradients {
                let Some(TensorSpec::Sparse(shape)) =
                    run.pseudo_gradient_spec(pg.stage, pg.partition)
                else {
                    panic!("a sparse run's spec is sparse");
                };
                assert_eq!(pg.blob.shape, vec![shape.kept()], "{pg:?}");
                assert_eq!(pg.blob.dtype, iota_protocol::blob::BlobDtype::I4, "{pg:?}");
                assert!(pg.blob.size * 10 < 4 * shape.len, "{pg:?}");
            }
        }
        // The miners of a stage hold the same weights at each epoch start, and they are the
        // weights anyone rebuilds from the initial ones and the accepted updates.
        let statuses = eventually("epoch 2 loaded", Duration::from_secs(120), || async {
            let st: Vec<_> = miners.iter().map(|m| m.status()).collect();
            st.iter().all(|s| s.weights_epoch >= Some(2)).then_some(st)
        })
        .await;
        for epoch in 1..=2 {
            let (_, digests) = epoch_start_stages(&client, &run, epoch).await;
            for s in &statuses {
                let held = s
                    .weights_history
                    .iter()
                    .find(|(e, _)| *e == epoch)
                    .map(|(_, d)| d.clone());
                let stage = s.stage.expect("stage") as usize;
                assert_eq!(held.as_ref(), Some(&digests[stage]), "epoch {epoch}: {s:?}");
            }
            assert_ne!(
                digests,
                epoch_start_stages(&client, &run, epoch - 1).await.1
            );
        }

        // The validator recomputes every merge to the owners' hash and replays a miner per stage.
        let (run_id, _) = v.run_info().await.expect("run");
        for epoch in 0..2 {
            let checks = store.checks(run_id, epoch).await.expect("checks");
            let merges = checks.iter().filter(|c| c.kind == "merge").count();
            assert!(
                merges as u32 >= run.stages * run.partitions,
                "epoch {epoch}: {checks:#?}"
            );
            // Each replay compared the miner's compressed uploads with its replayed training.
            let replays: Vec<serde_json::Value> = checks
                .iter()
                .filter(|c| c.kind == "replay")
                .map(|c| c.detail.clone())
                .collect();
            assert!(!replays.is_empty(), "epoch {epoch}: {checks:#?}");
            for r in &replays {
                assert!(r["pseudo_gradient_partitions"].as_u64() > Some(0), "{}", r);
                // Where an honest upload sent something, it is the replayed training (plus a
                // little owed from before).
                let cosine = r["pseudo_gradient_cosine"].as_f64().expect("cosine");
                assert!(cosine > 0.9, "{}", r);
            }
            assert!(
                checks.iter().all(|c| c.passed),
                "epoch {epoch}: {checks:#?}"
            );
        }

        // A wrong merger joins: its merges disagree with its co-owners' and fail the validator's
        // recomputation.
        let wrong = joined(
            &orch.base,
            WRONG_MERGER,
            1000.0,
            Some(Adversary::WrongMerge),
        )
        .await;
        let wrong_hotkey = iota_protocol::signing::RequestSigner::ss58(&pair(WRONG_MERGER));
        // Its disputes are settled by the validator's recomputation as the run goes on.
        let caught = eventually("a wrong sparse merge", Duration::from_secs(400), || async {
            if let Err(e) = v.settle_disputes().await {
                tracing::warn!(error = %e, "settling disputes");
            }
            let st = client.status().await.ok()?;
            for epoch in 2..st.epoch {
                let parts = client.merge_status(epoch).await.ok()?;
                if parts
                    .iter()
                    .any(|p| p.results.iter().any(|r| r.hotkey == wrong_hotkey))
                {
                    return Some(epoch);
                }
            }
            None
        })
        .await;
        v.step().await.expect("validator step");
        let checks = store.checks(run_id, caught).await.expect("checks");
        assert!(
            checks
                .iter()
                .any(|c| c.hotkey == wrong_hotkey && c.kind == "merge" && !c.passed),
            "the wrong merger's merge was not failed: {checks:#?}"
        );
        assert!(
            checks
                .iter()
                .filter(|c| c.hotkey != wrong_hotkey)
                .all(|c| c.passed),
            "{checks:#?}"
        );
        let parts = client.merge_status(caught).await.expect("merge status");
        assert!(
            parts.iter().all(|p| p.state == PartitionState::Accepted),
            "{parts:?}"
        );
        // Collection takes an old epoch's samples and uploads, never an accepted update: the
        // weights are still rebuilt from the initial ones, and are the miners'.
        let files = |dir: &std::path::Path| -> Vec<String> {
            let mut out = Vec::new();
            let mut stack = vec![dir.to_path_buf()];
            while let Some(d) = stack.pop() {
                for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                    let p = e.path();
                    match p.is_dir() {
                        true => stack.push(p),
                        false => out.push(p.display().to_string()),
                    }
                }
            }
            out
        };
        let accepted = client.merge_status(0).await.expect("merge status");
        let merged_of_epoch_0 = |left: &[String]| {
            left.iter()
                .filter(|f| f.contains("/epoch-0/merged/"))
                .count()
        };
        // Collection deletes the uploads, then the co-owners' copies of each accepted update:
        // those are not history.
        eventually("epoch 0 collected", Duration::from_secs(300), || async {
            let left = files(store_dir.path());
            let gone = !left
                .iter()
                .any(|f| f.contains("/epoch-0/") && f.contains("/pseudo-gradients/"));
            (gone && merged_of_epoch_0(&left) <= accepted.len()).then_some(())
        })
        .await;
        let left = files(store_dir.path());
        for p in &accepted {
            let key = &p.accepted.as_ref().expect("accepted").key;
            assert!(
                left.iter().any(|f| f.ends_with(key.as_str())),
                "the accepted update {key} was collected"
            );
        }
        assert_eq!(merged_of_epoch_0(&left), accepted.len(), "{left:#?}");
        let mut digests = std::collections::HashMap::new();
        for s in miners.iter().map(|m| m.status()) {
            let epoch = s.weights_epoch.expect("loaded");
            if let std::collections::hash_map::Entry::Vacant(slot) = digests.entry(epoch) {
                slot.insert(epoch_start_stages(&client, &run, epoch).await.1);
            }
            let stage = s.stage.expect("stage") as usize;
            assert_eq!(
                s.weights_digest.as_ref(),
                Some(&digests[&epoch][stage]),
                "{s:?}"
            );
        }
        assert!(
            digests.keys().all(|e| *e > run.retention_epochs),
            "{:?}",
            digests.keys()
        );
        wrong.abort();
        for m in miners {
            m.abort();
        }
        orch.stop().await;
    };
    tokio::select! {
        _ = ticking => unreachable!("the ticker never ends"),
        _ = body => {}
    }
}
