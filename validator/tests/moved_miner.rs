//! A stage whose only miner crashes is filled mid-epoch by a miner the orchestrator moves from
//! another stage. The moved miner takes up its new stage at once (it used to exit), the epoch
//! merges every partition, and a validator's replay of the moved miner passes: it is replayed
//! on its new stage with that stage's hops only, which it started afresh. The validator
//! publishes its scores, and publishes them again in a later pass when they never arrived.
//!
//! A real run: localnet, PostgreSQL, orchestrator, 6 `tiny` miners on the CPU, a validator.
//! Needs `DATABASE_URL` (scripts/test.sh starts PostgreSQL).

use crate::harness;
use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use harness::validator;
use iota_protocol::api::PartitionState;
use support::*;

const VICTIM: u8 = 71;
const OTHERS: [u8; 5] = [72, 73, 74, 75, 76];
const VALIDATOR: u8 = 79;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miner_moved_to_an_emptied_stage_works_there_and_passes_its_replay() {
    init_tracing();
    let mut all = vec![VICTIM];
    all.extend(OTHERS);
    let chain = chain_with(&all, &[VALIDATOR]).await;
    let body = async {
        let db = fresh_db().await;
        let store_dir = tempfile::tempdir().expect("store");
        let run = tiny_run("moved-miner", 48);
        let orch = start(config(&chain, &db, store_dir.path(), run.clone())).await;
        let client = explorer(&orch.base, VALIDATOR).await;
        // Stages go to the least total throughput: the victim alone on stage 0, the others
        // three on stage 1 and two on stage 2.
        let victim = joined(&orch.base, VICTIM, 100_000.0, None).await;
        assert_eq!(victim.status().stage, Some(0));
        let mut others = Vec::new();
        for s in OTHERS {
            others.push(joined(&orch.base, s, 1000.0, None).await);
        }
        let stages: Vec<_> = others.iter().map(|m| m.status().stage).collect();
        assert_eq!(
            stages,
            [Some(1), Some(2), Some(1), Some(2), Some(1)],
            "stage 0 has the victim only"
        );
        // Every stage-1 miner has hops there before the crash, so the one moved has too.
        eventually("everyone at work", Duration::from_secs(120), || async {
            let busy = victim.status().hops >= 2
                && others
                    .iter()
                    .filter(|m| m.status().stage == Some(1))
                    .all(|m| m.status().hops >= 2);
            busy.then_some(())
        })
        .await;
        victim.abort();
        let moved = eventually(
            "a miner moved to stage 0",
            Duration::from_secs(120),
            || async { others.iter().position(|m| m.status().stage == Some(0)) },
        )
        .await;
        wait_epoch(&client, 1, Duration::from_secs(240)).await;
        for (i, m) in others.iter().enumerate() {
            assert!(!m.is_finished(), "miner {i} ended: {:?}", m.status());
        }
        let moved_hotkey = iota_protocol::signing::RequestSigner::ss58(&pair(OTHERS[moved]));

        let parts = client.merge_status(0).await.expect("merge status");
        assert_eq!(parts.len(), (run.stages * run.partitions) as usize);
        for p in &parts {
            assert_eq!(p.state, PartitionState::Accepted, "{p:?}");
        }
        // The moved miner worked on both stages in epoch 0 and merged on its new one.
        let hops = client.hops(0, 0, 5000).await.expect("hops").hops;
        let worked: BTreeSet<u32> = hops
            .iter()
            .filter(|h| h.miner == moved_hotkey && h.status == "done")
            .map(|h| h.stage)
            .collect();
        assert_eq!(
            worked,
            BTreeSet::from([0, 1]),
            "stages the moved miner worked on"
        );
        let record = client.epoch_record(0).await.expect("record");
        assert!(
            record
                .pseudo_gradients
                .iter()
                .any(|g| g.hotkey == moved_hotkey && g.stage == 0),
            "the moved miner's pseudo-gradient of stage 0: {:?}",
            record.pseudo_gradients
        );
        for m in others {
            m.stop().await.expect("clean stop");
        }

        let (v, store) = validator(
            chain.net.ws_url(),
            &orch.base,
            chain.netuid,
            VALIDATOR,
            |c| {
                c.replays_per_epoch = 0;
                c.merges_per_epoch = 0;
                c.set_weights = false;
            },
        )
        .await;
        let scored = v.step().await.expect("validator step");
        assert!(scored.contains(&0), "scored {scored:?}");
        let (run_id, _) = v.run_info().await.expect("run");
        let checks = store.checks(run_id, 0).await.expect("checks");
        let of_moved: Vec<_> = checks.iter().filter(|c| c.hotkey == moved_hotkey).collect();
        assert!(
            of_moved.iter().any(|c| c.kind == "replay" && c.passed),
            "no passed replay of the moved miner: {of_moved:#?}"
        );
        assert!(
            of_moved.iter().all(|c| c.passed),
            "the moved miner failed a check: {of_moved:#?}"
        );
        let scores = store.scores_between(run_id, 0, 0).await.expect("scores");
        let score = scores
            .iter()
            .find(|s| s.hotkey == moved_hotkey)
            .expect("the moved miner's score");
        assert!(score.quality > 0.0 && score.penalty.is_none(), "{score:?}");
        // Published for explorers: the same scores, from this validator, for epoch 0.
        let published = client.scores().await.expect("GET /v1/scores");
        let validator_hotkey = iota_protocol::signing::RequestSigner::ss58(&pair(VALIDATOR));
        let mine = published
            .iter()
            .find(|r| r.validator == validator_hotkey && r.epoch == 0)
            .unwrap_or_else(|| panic!("no scores published by the validator: {published:?}"));
        assert_eq!(mine.epoch, 0);
        // (hotkey, score) by hotkey.
        let by_hotkey = |pairs: Vec<(String, f64)>| -> Vec<(String, f64)> {
            let mut pairs = pairs;
            pairs.sort_by(|a, b| a.0.cmp(&b.0));
            pairs
        };
        let published_pairs = |r: &iota_protocol::api::ScoreRecord| {
            by_hotkey(
                r.scores
                    .iter()
                    .map(|s| (s.hotkey.clone(), s.score))
                    .collect(),
            )
        };
        let stored = by_hotkey(scores.iter().map(|s| (s.hotkey.clone(), s.score)).collect());
        let sent = published_pairs(mine);
        assert!(!sent.is_empty());
        assert_eq!(sent, stored, "published scores");
        assert_eq!(
            store.unpublished(run_id, 16).await.expect("read"),
            Vec::<u64>::new()
        );

        // A publication that never arrived is sent again by a later pass, from the stored rows.
        let orch_db = sqlx::PgPool::connect(&db).await.expect("orchestrator db");
        for forget in [
            "DELETE FROM validator_scores WHERE epoch = 0",
            "DELETE FROM spot_checks WHERE epoch = 0",
        ] {
            sqlx::query(forget)
                .execute(&orch_db)
                .await
                .expect("forget the publication");
        }
        sqlx::query("UPDATE scored_epochs SET published_at = NULL WHERE epoch = 0")
            .execute(store.pool())
            .await
            .expect("unpublished");
        assert!(
            !client
                .scores()
                .await
                .expect("scores")
                .iter()
                .any(|r| r.validator == validator_hotkey && r.epoch == 0)
        );
        v.step().await.expect("a later pass");
        let again = client.scores().await.expect("GET /v1/scores");
        let republished = again
            .iter()
            .find(|r| r.validator == validator_hotkey && r.epoch == 0)
            .unwrap_or_else(|| panic!("epoch 0 was not published again: {again:?}"));
        assert_eq!(
            published_pairs(republished),
            stored,
            "scores published again"
        );
        let checks_again: i64 =
            sqlx::query_scalar("SELECT count(*) FROM spot_checks WHERE epoch = 0")
                .fetch_one(&orch_db)
                .await
                .expect("spot checks");
        assert_eq!(checks_again, 1, "the spot checks published again");
        assert_eq!(
            store.unpublished(run_id, 16).await.expect("read"),
            Vec::<u64>::new()
        );
        orch.stop().await;
    };
    tokio::select! {
        _ = keep_sealing(&chain.net) => unreachable!("seals for ever"),
        _ = body => {}
    }
}
