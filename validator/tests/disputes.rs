//! A dispute whose owners both merged wrongly: the validator recomputes the merge, finds that no
//! submitted result has its hash, submits its own merge and settles the dispute with it, so the
//! partition is accepted with the honest weights (the orchestrator refuses a settlement that
//! names no submitted result).
//!
//! Simulated miners (`iota_testkit::sim`) on a real `tiny` run: their merges are plain
//! averages without the outer step, so none of them is what the validator computes. Needs
//! `DATABASE_URL` (scripts/test.sh starts PostgreSQL).

use crate::harness;
use crate::support;

use std::time::Duration;

use harness::validator;
use iota_protocol::api::PartitionState;
use iota_protocol::{ApiClient, RetryPolicy};
use iota_testkit::sim::SimMiner;
use support::*;

const MINERS: [u8; 3] = [51, 52, 53];
const VALIDATOR: u8 = 59;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispute_nobody_merged_honestly_is_settled_with_the_validators_merge() {
    init_tracing();
    let chain = chain_with(&MINERS, &[VALIDATOR]).await;
    let db = fresh_db().await;
    let store_dir = tempfile::tempdir().expect("store");
    let mut run = tiny_run("disputes", 6);
    // The dispute waits for the validator.
    run.merging_s = 600;
    let orch = start(config(&chain, &db, store_dir.path(), run.clone())).await;
    let mut miners = Vec::new();
    for (i, s) in MINERS.iter().enumerate() {
        miners.push(
            SimMiner::join(&orch.base, signer(*s), 1000.0, i as u64)
                .await
                .expect("join"),
        );
    }
    miners[1].wrong_merge = true;
    let reader = ApiClient::connect(&orch.base, signer(VALIDATOR), RetryPolicy::default())
        .await
        .expect("validator client");

    // Step the miners one at a time until a dispute opens, and no further: the tie-break owner
    // it brings in never merges, so only the validator can settle it.
    let mut open = Vec::new();
    'run: for _ in 0..3000 {
        for m in &mut miners {
            m.step().await.expect("step");
            open = reader.disputes().await.expect("disputes");
            if !open.is_empty() {
                break 'run;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!open.is_empty(), "no dispute opened");
    let disputed = open[0].partition.clone();

    let (v, _) = validator(
        chain.net.ws_url(),
        &orch.base,
        chain.netuid,
        VALIDATOR,
        |c| {
            c.set_weights = false;
        },
    )
    .await;
    let settled = v.settle_disputes().await.expect("settle");
    assert!(settled >= 1, "settled {settled} of {}", open.len());

    let now = reader
        .merge_status(disputed.epoch)
        .await
        .expect("merges")
        .into_iter()
        .find(|p| p.stage == disputed.stage && p.partition == disputed.partition)
        .expect("the disputed partition");
    assert_eq!(now.state, PartitionState::Accepted, "{now:?}");
    let accepted = now.accepted.as_ref().expect("accepted weights");
    // Not what either owner submitted: the validator's own merge, listed among the results.
    for r in &disputed.results {
        assert_ne!(r.blake3.as_ref(), Some(&accepted.blake3), "{now:?}");
    }
    assert!(
        now.results
            .iter()
            .any(|r| r.blake3.as_ref() == Some(&accepted.blake3)),
        "{now:?}"
    );
    assert!(
        now.resolved_by
            .as_deref()
            .is_some_and(|by| by.starts_with("validator:")),
        "{now:?}"
    );
    assert!(
        reader
            .disputes()
            .await
            .expect("disputes")
            .iter()
            .all(|d| d.id != open[0].id),
        "still open"
    );
    // The accepted bytes are the honest merge of the partition's frozen contributions: in the
    // first epoch, from the initial weights and zero momentum.
    let bytes = reader.download(accepted).await.expect("download");
    let len = run
        .partition_range(disputed.stage, disputed.partition)
        .map(|r| r.end - r.start)
        .expect("range");
    iota_protocol::tensor::decode_merged(&bytes, len).expect("decodes");
    assert_eq!(disputed.epoch, 0, "a dispute of the first epoch");
    let mut contributions = Vec::new();
    for c in &open[0].contributions {
        let part = reader.download(&c.blob).await.expect("a contribution");
        let values = iota_protocol::tensor::decode_partition(&part, len).expect("decodes");
        contributions.push((c.hotkey.clone(), c.weight, values));
    }
    assert!(!contributions.is_empty(), "a dispute without contributions");
    let (_, honest) = iota_validator::merges::recompute_merge(
        &run,
        disputed.stage,
        disputed.partition,
        contributions,
        None,
    )
    .expect("the honest merge");
    assert_eq!(
        accepted.blake3, honest,
        "the validator's merge is not the honest one"
    );
    orch.stop().await;
}
