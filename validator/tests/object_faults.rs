//! One object of one miner that no longer checks out (overwritten in the store) or is gone
//! (deleted), or a merge whose bytes do not decode, must not stop a validator: the epoch is
//! scored, the producer of the object (the owners who submitted the merge) fail, the others are
//! scored as usual. And epochs whose objects the orchestrator
//! has collected while the validator was away are passed over, not retried for ever.
//!
//! A real run: localnet, PostgreSQL, orchestrator with a local store, one `tiny` miner per
//! stage, then a validator that joins late. Needs `DATABASE_URL` (scripts/test.sh starts
//! PostgreSQL).

use crate::harness;
use crate::support;

use std::time::Duration;

use harness::validator;
use iota_protocol::api::{Direction, Phase};
use iota_protocol::{ApiClient, RetryPolicy};
use iota_validator::score::CheckRow;
use iota_validator::service::objects_collected;
use support::*;

const MINERS: [u8; 3] = [61, 62, 63];
const VALIDATOR: u8 = 69;
/// Epochs of objects the orchestrator keeps.
const RETENTION: u64 = 3;
/// The run is at least here before the validator starts, so that epoch 0 is collected.
const EPOCHS: u64 = RETENTION + 1;
const SAMPLES: u64 = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_object_fails_its_producer_and_collected_epochs_are_skipped() {
    init_tracing();
    let chain = chain_with(&MINERS, &[VALIDATOR]).await;
    let body = async {
        let db = fresh_db().await;
        let store_dir = tempfile::tempdir().expect("store");
        let mut run = tiny_run("object-faults", SAMPLES);
        run.retention_epochs = RETENTION;
        // Once the miners stop, an epoch whose samples have not all started stays in training
        // far longer than the validator takes.
        run.training_s = 1800;
        let orch = start(config(&chain, &db, store_dir.path(), run.clone())).await;
        let client = explorer(&orch.base, MINERS[0]).await;
        let mut miners = Vec::new();
        for s in MINERS {
            let mut cfg = miner_config(&orch.base);
            cfg.tokens_per_s = Some(1000.0);
            cfg.seed = u64::from(s);
            miners.push(spawn_miner(cfg, signer(s)));
        }
        wait_epoch(&client, EPOCHS, Duration::from_secs(600)).await;
        for m in miners {
            let _ = m.stop().await;
        }
        // Wait for the run to stall: in training, with samples nobody will start.
        let current = eventually("the run to stall", Duration::from_secs(300), || async {
            let st = client.status().await.ok()?;
            (st.phase == Phase::Training && st.samples_started < SAMPLES).then_some(st.epoch)
        })
        .await;

        // The latest finished epoch the miners completed: a stage-1 forward output and a
        // stage-2 pseudo-gradient to spoil.
        let reader = ApiClient::connect(&orch.base, signer(VALIDATOR), RetryPolicy::default())
            .await
            .expect("validator client");
        let checkable: Vec<u64> = (0..current)
            .filter(|e| !objects_collected(*e, current, RETENTION))
            .collect();
        let mut target = None;
        for &epoch in checkable.iter().rev() {
            let record = reader.epoch_record(epoch).await.expect("record");
            let hops = reader.hops(epoch, 0, 500).await.expect("hops").hops;
            let output = hops.iter().find(|h| {
                h.stage == 1
                    && h.direction == Direction::Forward
                    && h.status == "done"
                    && h.output.is_some()
            });
            let pg = record.pseudo_gradients.iter().find(|p| p.stage == 2);
            if let (Some(h), Some(pg)) = (output, pg)
                && record.miners.iter().any(|m| m.stage == 0)
            {
                target = Some((epoch, record.clone(), h.clone(), pg.clone()));
                break;
            }
        }
        let (epoch, record, hop, pg) = target.expect("a complete epoch to spoil");
        // And a merge another checkable epoch started from (not this one): its owners come from
        // any stage, so it is judged in that epoch, apart from the checks above.
        let mut spoil = None;
        for &other in checkable.iter().filter(|e| **e != epoch) {
            let rec = reader.epoch_record(other).await.expect("record");
            for w in &rec.start_weights {
                let Some(merged_in) = w.epoch else { continue };
                let statuses = reader.merge_status(merged_in).await.expect("merges");
                for blob in w.partitions.iter().flatten() {
                    let shared = record
                        .start_weights
                        .iter()
                        .flat_map(|x| x.partitions.iter().flatten())
                        .any(|b| b.key == blob.key);
                    let owners: Vec<String> = statuses
                        .iter()
                        .filter(|p| p.stage == w.stage)
                        .flat_map(|p| &p.results)
                        .filter(|r| r.blake3.as_ref() == Some(&blob.blake3))
                        .map(|r| r.hotkey.clone())
                        .collect();
                    if !shared && !owners.is_empty() && spoil.is_none() {
                        spoil = Some((other, blob.clone(), owners));
                    }
                }
            }
        }
        let (spoiled_epoch, merged, owners) =
            spoil.expect("another checkable epoch started from merged weights of its own");
        let output = hop.output.clone().expect("output");
        std::fs::write(store_dir.path().join(&output.key), b"overwritten").expect("overwrite");
        std::fs::remove_file(store_dir.path().join(&pg.blob.key)).expect("delete");
        // An accepted merge is sealed where no owner can write; spoiled here (as if its owners
        // had submitted bytes that do not decode), it fails the owners whose result it is.
        std::fs::write(store_dir.path().join(&merged.key), b"spoiled").expect("spoil");
        let stage0 = record
            .miners
            .iter()
            .find(|m| m.stage == 0)
            .expect("stage 0")
            .hotkey
            .clone();
        eprintln!(
            "epoch {epoch} (run in {current}): {} overwritten ({}), {} deleted ({}); epoch \
             {spoiled_epoch}: {} spoiled ({owners:?})",
            output.key, hop.miner, pg.blob.key, pg.hotkey, merged.key
        );

        let (v, store) = validator(
            chain.net.ws_url(),
            &orch.base,
            chain.netuid,
            VALIDATOR,
            |c| {
                c.replays_per_epoch = 0;
                // Every partition's merge is recomputed, including those of the epoch that
                // started from the spoiled merge.
                c.merges_per_epoch = usize::MAX;
                c.set_weights = false;
            },
        )
        .await;
        let scored = v
            .step()
            .await
            .expect("a bad object does not stop the validator");
        // Epoch 0's objects are gone: skipped. The epochs that can be checked are scored.
        assert!(objects_collected(0, current, RETENTION));
        assert_eq!(scored, checkable, "run in epoch {current}");
        assert!(scored.contains(&epoch) && scored.contains(&spoiled_epoch));

        let (run_id, _) = v.run_info().await.expect("run");
        let checks = store.checks(run_id, epoch).await.expect("checks");
        eprintln!("{checks:#?}");
        let failed = |hotkey: &str| -> Vec<&CheckRow> {
            checks
                .iter()
                .filter(|c| c.hotkey == hotkey && !c.passed)
                .collect()
        };
        let names =
            |c: &CheckRow, key: &str| c.detail.get("key").and_then(|k| k.as_str()) == Some(key);
        // The overwritten output fails the miner that produced it…
        assert!(
            failed(&hop.miner)
                .iter()
                .any(|c| c.kind == "object" && names(c, &output.key)),
            "{checks:?}"
        );
        // …the deleted pseudo-gradient the miner that uploaded it…
        assert!(
            failed(&pg.hotkey)
                .iter()
                .any(|c| c.kind == "pseudo_gradient" && names(c, &pg.blob.key)),
            "{checks:?}"
        );
        // …and nobody else fails for them.
        assert!(failed(&stage0).is_empty(), "{checks:?}");
        let scores = store
            .scores_between(run_id, epoch, epoch)
            .await
            .expect("scores");
        let of = |h: &str| scores.iter().find(|s| s.hotkey == h).expect("a score");
        assert!(of(&stage0).score > 0.0, "{scores:?}");
        for cheat in [&hop.miner, &pg.hotkey] {
            assert_eq!(of(cheat).quality, 0.0, "{scores:?}");
            assert!(of(cheat).penalty.is_some(), "{scores:?}");
        }
        // In the epoch that started from the spoiled merge, each owner that submitted it fails.
        let spoiled_checks = store.checks(run_id, spoiled_epoch).await.expect("checks");
        for owner in &owners {
            assert!(
                spoiled_checks.iter().any(|c| &c.hotkey == owner
                    && !c.passed
                    && c.kind == "object"
                    && names(c, &merged.key)),
                "{owner}: {spoiled_checks:?}"
            );
        }
        let spoiled_scores = store
            .scores_between(run_id, spoiled_epoch, spoiled_epoch)
            .await
            .expect("scores");
        for owner in &owners {
            let score = spoiled_scores
                .iter()
                .find(|s| &s.hotkey == owner)
                .expect("a score");
            assert!(score.penalty.is_some(), "{spoiled_scores:?}");
        }
        // Nothing is retried: a second pass has nothing left to score.
        assert_eq!(v.step().await.expect("second step"), Vec::<u64>::new());

        orch.stop().await;
    };
    tokio::select! {
        _ = keep_sealing(&chain.net) => unreachable!("seals for ever"),
        _ = body => {}
    }
}
