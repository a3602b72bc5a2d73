//! A real run with one miner of each adversarial kind among honest ones: localnet, PostgreSQL,
//! orchestrator, 14 miners on the CPU (`tiny`) and a validator. Each cheater is caught by a
//! replay, a merge check or CLASP, or is paid for no work (a loss without its sequences is
//! refused; hops whose pseudo-gradient was withheld count for nothing); the weights the validator sets give every cheater less than
//! every honest miner; after a tempo the chain's Yuma epoch pays honest miners more. The audit
//! of the epoch the weights came from reproduces them, both while committed and once revealed,
//! and reports tampered scores or another epoch's records. Needs `DATABASE_URL`
//! (scripts/test.sh starts PostgreSQL).

use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::support::Adversary;
use iota_chain::wallet::Keypair;
use iota_chain::{ConnectOptions, Subtensor};
use iota_protocol::client::{ApiClient, RetryPolicy};
use iota_validator::audit::ChainCheck;
use iota_validator::audit::public::PublicAudit;
use iota_validator::{AuditReport, Store, Validator, ValidatorConfig};
use support::*;

const HONEST: [u8; 6] = [81, 82, 83, 84, 85, 86];
/// Joined in this order after the honest miners, they land on stages 0, 1, 2, 0, 1, 2, 0, 1, 2
/// and 0.
/// Those that must cheat in epoch 0 (the withholder, whose unused reservation there costs it
/// epoch 1's) or that cheat only from their second epoch on (stale weights) join early. The two
/// colluding mergers share stage 1, where they own partitions together.
const CHEATERS: [(u8, Adversary); 10] = [
    (91, Adversary::Noise),
    (WITHHOLDER, Adversary::Withhold),
    (93, Adversary::LazyLoss),
    (94, Adversary::StaleWeights),
    (COLLUDERS[0], Adversary::ColludingMerge),
    (96, Adversary::ForgeLoss),
    (97, Adversary::Freeload),
    (COLLUDERS[1], Adversary::ColludingMerge),
    (98, Adversary::Zeros),
    (89, Adversary::LateLoneMerge),
];
const COLLUDERS: [u8; 2] = [95, 90];
const WITHHOLDER: u8 = 92;
const VALIDATOR: u8 = 99;
const EPOCHS: u64 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validator_catches_every_adversary_and_pays_honest_miners_more() {
    init_tracing();
    let miners_seeds: Vec<u8> = HONEST
        .iter()
        .copied()
        .chain(CHEATERS.iter().map(|c| c.0))
        .collect();
    let chain = chain_with(&miners_seeds, &[VALIDATOR]).await;
    // Held while the test audits a commit: the reveal window is a single short tempo here.
    let paused = AtomicBool::new(false);
    let ticking = async {
        // The localnet seals blocks on demand: keep the chain moving as a real one would.
        loop {
            if !paused.load(Ordering::SeqCst) {
                chain.net.produce_blocks(1);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let body = async {
        let db = fresh_db().await;
        let store_dir = tempfile::tempdir().expect("store");
        let mut run = tiny_run("validator-adversaries", 48);
        // As many partitions as a stage has miners: owners are neighbours in a random order, so
        // with fewer some miners own none in an epoch, and the wrong merger might never merge.
        run.partitions = 6;
        let orch = start(config(&chain, &db, store_dir.path(), run.clone())).await;
        let client = explorer(&orch.base, HONEST[0]).await;
        let mut miners = Vec::new();
        // Honest miners 84, 82 and 86 (one a stage) cut each micro-batch in two runs trained side
        // by side; the validator replays micro-batches whole, and must still pass them.
        for s in HONEST {
            let mut cfg = miner_config(&orch.base);
            cfg.sub_batches = if s % 2 == 0 { 2 } else { 1 };
            miners.push((s, None, joined_with(cfg, s, 1000.0, None).await));
        }
        for (s, a) in CHEATERS {
            miners.push((s, Some(a), joined(&orch.base, s, 1000.0, Some(a)).await));
        }
        for (_, a, m) in &miners {
            let want = match a {
                Some(Adversary::Noise | Adversary::StaleWeights | Adversary::Freeload) => Some(0),
                Some(Adversary::Withhold | Adversary::ColludingMerge) => Some(1),
                Some(Adversary::LazyLoss | Adversary::ForgeLoss | Adversary::Zeros) => Some(2),
                _ => None,
            };
            if want.is_some() {
                assert_eq!(
                    m.status().stage,
                    want,
                    "{a:?} is on the stage where it can cheat"
                );
            }
        }
        let vdb = fresh_db().await;
        let store = Store::connect(&vdb).await.expect("validator db");
        let vchain = Subtensor::connect(ConnectOptions::new(chain.net.ws_url()))
            .await
            .expect("chain");
        let mut cfg = ValidatorConfig::new(&orch.base, chain.netuid);
        cfg.replays_per_epoch = 0;
        cfg.merges_per_epoch = 0;
        cfg.tx = tx();
        let hotkey = Keypair::from_seed([VALIDATOR; 32]);
        let v = Validator::connect(cfg, hotkey, vchain, store.clone())
            .await
            .expect("validator");
        // The validator settles disputes as the run goes, as its loop does: the colluders'
        // partitions are merged by its recomputation instead of keeping their weights.
        let settling = async {
            loop {
                if let Err(e) = v.settle_disputes().await {
                    eprintln!("settling disputes: {e}");
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        };
        tokio::select! {
            _ = wait_epoch(&client, EPOCHS, Duration::from_secs(400)) => {}
            _ = settling => unreachable!("settling never ends"),
        }
        let scored = v.step().await.expect("validator step");
        // Stop the chain until the commit has been audited, so its reveal window cannot pass.
        paused.store(true, Ordering::SeqCst);
        assert!(scored.len() as u64 >= EPOCHS, "scored {scored:?}");

        // Every cheater lost its score in at least one epoch, for the reason its cheat gives.
        let rows: Vec<(i64, String, f64, Option<String>, f64)> = sqlx::query_as(
            "SELECT epoch, hotkey, quality, penalty, work FROM scores ORDER BY epoch, hotkey",
        )
        .fetch_all(store.pool())
        .await
        .expect("scores");
        let ss58 = |seed: u8| iota_protocol::signing::RequestSigner::ss58(&pair(seed));
        for (seed, kind) in CHEATERS {
            let mine: Vec<_> = rows.iter().filter(|r| r.1 == ss58(seed)).collect();
            if matches!(kind, Adversary::ForgeLoss | Adversary::Withhold) {
                // Not caught by a check but paid for nothing: the forger's completions are
                // refused, the withholder's hops never reached the model.
                eprintln!("{kind}: {mine:?}");
                assert!(mine.iter().all(|r| r.4 == 0.0), "{kind} was paid: {mine:?}");
                continue;
            }
            let penalties: Vec<String> = mine
                .iter()
                .filter(|r| r.2 == 0.0)
                .filter_map(|r| r.3.clone())
                .collect();
            eprintln!("{kind}: {penalties:?}");
            assert!(!penalties.is_empty(), "{kind} was never caught: {rows:?}");
            // Caught by the check its cheat breaks, not by another one that happened to fail.
            let reasons: &[&str] = match kind {
                Adversary::WrongMerge | Adversary::ColludingMerge | Adversary::LateLoneMerge => {
                    &["merge "]
                }
                Adversary::Freeload => &["replay: ", "bad pseudo-gradient: "],
                Adversary::Noise
                | Adversary::Zeros
                | Adversary::LazyLoss
                | Adversary::StaleWeights => &["replay: "],
                Adversary::ForgeLoss | Adversary::Withhold => unreachable!("checked above"),
                Adversary::ClaimSpeed => unreachable!("not in this run"),
            };
            assert!(
                penalties
                    .iter()
                    .any(|p| reasons.iter().any(|r| p.starts_with(r))),
                "{kind} caught for another reason: {penalties:?}"
            );
        }
        // The withholder did the work it was not paid for.
        let withheld = explorer(&orch.base, VALIDATOR)
            .await
            .epoch_record(0)
            .await
            .expect("epoch 0");
        let withholder = withheld
            .miners
            .iter()
            .find(|m| m.hotkey == ss58(WITHHOLDER))
            .expect("the withholder's hops");
        assert!(
            withholder.backward_done > 0,
            "the withholder trained: {withholder:?}"
        );
        assert!(
            withheld
                .pseudo_gradients
                .iter()
                .all(|p| p.hotkey != ss58(WITHHOLDER)),
            "it uploaded nothing"
        );
        // Its unused reservation of epoch 0 cost it the next ones: it trained in epoch 1, and its
        // reservation there was refused.
        let next = explorer(&orch.base, VALIDATOR)
            .await
            .epoch_record(1)
            .await
            .expect("epoch 1");
        assert!(
            next.miners
                .iter()
                .any(|m| m.hotkey == ss58(WITHHOLDER) && m.backward_done > 0),
            "the withholder trained in epoch 1: {:?}",
            next.miners
        );
        let orch_db = sqlx::PgPool::connect(&db).await.expect("orchestrator db");
        let reserved: Vec<i64> = sqlx::query_scalar(
            "SELECT epoch FROM upload_reservations WHERE miner = $1 ORDER BY epoch",
        )
        .bind(ss58(WITHHOLDER))
        .fetch_all(&orch_db)
        .await
        .expect("reservations");
        // The run may have reached epoch 2's uploading; that one is refused too, as it has not
        // uploaded since.
        assert_eq!(reserved, vec![0], "reservations of the withholder");
        // Every miner's CLASP fit, named by seed and kind: when an honest miner is flagged (it
        // happened once, in epoch 1 of a CI run), its stage's fits say why.
        let names: BTreeMap<String, String> = HONEST
            .iter()
            .map(|s| (ss58(*s), format!("honest {s}")))
            .chain(CHEATERS.iter().map(|(s, a)| (ss58(*s), format!("{a} {s}"))))
            .collect();
        let effects: Vec<(String, String)> = sqlx::query_as(
            "SELECT hotkey, format('epoch %s stage %s: effect %s se %s z %s n %s flagged %s', \
             epoch, stage, round(effect::numeric, 4), round(std_error::numeric, 4), \
             round(z::numeric, 2), samples, flagged) \
             FROM clasp_effects ORDER BY epoch, stage, effect",
        )
        .fetch_all(store.pool())
        .await
        .expect("clasp effects");
        let fits: Vec<String> = effects
            .iter()
            .map(|(h, fit)| format!("{} {fit}", names.get(h).map_or(h.as_str(), String::as_str)))
            .collect();
        eprintln!("CLASP fits:\n{}", fits.join("\n"));
        for seed in HONEST {
            let zeroed: Vec<_> = rows
                .iter()
                .filter(|r| r.1 == ss58(seed) && r.2 == 0.0)
                .collect();
            assert!(
                zeroed.is_empty(),
                "honest miner {seed} penalised: {zeroed:?} (CLASP fits above)"
            );
        }

        // The weights the validator committed (what it reveals) rank every cheater below every
        // honest miner.
        let subs = store.submissions(10).await.expect("submissions");
        // The localnet runs commit-reveal, as finney does: a plain set would skip the commit
        // and reveal checks below.
        let sent = subs
            .iter()
            .find(|s| s.state == "committed" || s.state == "set")
            .expect("weights sent to the chain")
            .clone();
        assert_eq!(sent.state, "committed", "{sent:?}");
        let meta = chain
            .chain
            .metagraph(chain.netuid)
            .await
            .expect("metagraph");
        let uid = |seed: u8| {
            meta.neurons
                .iter()
                .find(|n| n.hotkey.ss58() == ss58(seed))
                .map(|n| n.uid)
                .expect("uid")
        };
        let w: BTreeMap<u16, f64> = sent
            .uids
            .iter()
            .copied()
            .zip(sent.weights.iter().copied())
            .collect();
        let weight = |seed: u8| w.get(&uid(seed)).copied().unwrap_or(0.0);
        // What the weights came from, for a failure's diagnosis.
        for r in &rows {
            let seed = HONEST
                .iter()
                .chain(CHEATERS.iter().map(|c| &c.0))
                .find(|s| ss58(**s) == r.1);
            eprintln!(
                "score: epoch {} seed {seed:?} work {:.1} quality {:.3} penalty {:?}",
                r.0, r.4, r.2, r.3
            );
        }
        // The colluders' agreeing wrong merge never became the model's weights: each partition
        // they merged together met the third owner's honest result and was disputed, and no
        // accepted partition holds a result of theirs (the validator's merge check above found
        // theirs not the average); the validator's recomputation settled the disputes.
        let colluders: Vec<String> = COLLUDERS.iter().map(|s| ss58(*s)).collect();
        let (mut together, mut settled_by_validator) = (0, 0);
        for epoch in 0..EPOCHS {
            let merges = client.merge_status(epoch).await.expect("merges");
            let how: Vec<_> = merges
                .iter()
                .map(|p| (p.stage, p.partition, p.resolved_by.clone()))
                .collect();
            eprintln!("merges of epoch {epoch}: {how:?}");
            for p in &merges {
                let theirs: Vec<_> = p
                    .results
                    .iter()
                    .filter(|r| colluders.contains(&r.hotkey))
                    .collect();
                together += usize::from(theirs.len() == 2);
                settled_by_validator += usize::from(
                    p.resolved_by
                        .as_deref()
                        .is_some_and(|by| by.starts_with("validator:")),
                );
                if let Some(accepted) = &p.accepted {
                    assert!(
                        theirs
                            .iter()
                            .all(|r| r.blake3.as_deref() != Some(accepted.blake3.as_str())),
                        "a colluders' merge was adopted: {p:?}"
                    );
                }
            }
        }
        assert!(
            together > 0,
            "the colluders never merged a partition together"
        );
        assert!(
            settled_by_validator > 0,
            "no dispute was settled by recomputation"
        );
        let min_honest = HONEST
            .iter()
            .map(|s| weight(*s))
            .fold(f64::INFINITY, f64::min);
        let max_cheat = CHEATERS.iter().map(|(s, _)| weight(*s)).fold(0.0, f64::max);
        assert!(
            min_honest > max_cheat,
            "weights: honest min {min_honest}, cheater max {max_cheat}"
        );

        // The audit of the epoch the weights came from recomputes them from the orchestrator's
        // records: while committed (drand-timelocked, the localnet's default as finney's), the
        // weights sealed are the recomputed ones and the ciphertext is on chain.
        let audited = sent.epoch.expect("weights from scores have an epoch");
        let report = v.audit(audited).await.expect("audit");
        eprintln!("{report}");
        assert_audit_matches(&report, &sent.weights);
        if sent.state == "committed" {
            // The chain may have opened the commit already, between its landing and the pause:
            // then the audit reads the Weights row the chain set.
            assert!(
                matches!(
                    report.chain,
                    ChainCheck::Sealed {
                        matches: true,
                        on_chain: true,
                        ..
                    } | ChainCheck::Weights { matches: true, .. }
                ),
                "{:?}",
                report.chain
            );
        }

        // Restart the validator between commit and reveal: the new process reveals from the
        // database.
        drop(v);
        let store = Store::connect(&vdb).await.expect("validator db again");
        let vchain = Subtensor::connect(ConnectOptions::new(chain.net.ws_url()))
            .await
            .expect("chain");
        let mut cfg = ValidatorConfig::new(&orch.base, chain.netuid);
        cfg.tx = tx();
        let v = Validator::connect(
            cfg,
            Keypair::from_seed([VALIDATOR; 32]),
            vchain,
            store.clone(),
        )
        .await
        .expect("validator restarted");
        paused.store(false, Ordering::SeqCst);
        let mut revealed_at = sent.block;
        if sent.state == "committed" {
            // The chain opens the commit itself. Before the validator's reveal pass has seen it,
            // the audit finds the commit gone from chain and checks the Weights row it set.
            let opened_at = eventually("the chain's reveal", Duration::from_secs(120), || async {
                match v.audit(audited).await.expect("audit while revealing").chain {
                    ChainCheck::Weights { matches, block, .. } => Some((matches, block)),
                    ChainCheck::Sealed { matches: true, .. } => None,
                    other => panic!("audit while revealing: {other:?}"),
                }
            })
            .await;
            assert!(opened_at.0, "the Weights row the chain set differs");
            revealed_at = eventually("the reveal", Duration::from_secs(120), || async {
                v.reveal().await.expect("reveal");
                let subs = store.submissions(10).await.ok()?;
                subs.iter()
                    .find(|s| s.id == sent.id && s.state == "revealed")
                    .and_then(|s| s.block)
            })
            .await
            .into();
            assert_eq!(revealed_at, Some(opened_at.1), "the block the audit read");
        }

        // Once on chain, the audit reproduces the chain's Weights row of the validator's uid.
        let report = v.audit(audited).await.expect("audit after the reveal");
        eprintln!("{report}");
        assert_audit_matches(&report, &sent.weights);
        assert!(
            matches!(report.chain, ChainCheck::Weights { matches: true, block, .. } if Some(block) == revealed_at),
            "{:?}",
            report.chain
        );
        for w in &report.weights {
            assert_eq!(w.on_chain, w.chain_expected, "{w:?}");
        }
        assert!(report.weights.iter().any(|w| w.on_chain == Some(u16::MAX)));

        // Anyone can do the same from public records alone, with no database and no hotkey:
        // once the validator's next pass has published the weights with the epoch's scores.
        let published = v.publish_pending().await.expect("publish");
        assert!(published >= 1, "the revealed weights were published");
        let auditor = PublicAudit::new(
            ApiClient::public(&orch.base, RetryPolicy::default()).expect("client"),
            Subtensor::connect(ConnectOptions::new(chain.net.ws_url()))
                .await
                .expect("chain"),
            chain.netuid,
        );
        let public = auditor
            .audit(&ss58(VALIDATOR), audited)
            .await
            .expect("public audit");
        eprintln!("{public}");
        assert!(public.matches && public.records_match, "{public}");
        assert!(
            matches!(public.chain, ChainCheck::Weights { matches: true, block, .. } if Some(block) == revealed_at),
            "{:?}",
            public.chain
        );
        assert_eq!(public.window, report.window, "the same score window");
        let by_uid = |r: &AuditReport| -> BTreeMap<u16, Option<u16>> {
            r.weights
                .iter()
                .map(|w| (w.uid, w.chain_expected))
                .collect()
        };
        assert_eq!(by_uid(&public), by_uid(&report), "the same weights");
        for w in &public.weights {
            assert_eq!(w.published, w.chain_expected, "{w:?}");
            assert_eq!(w.on_chain, w.chain_expected, "{w:?}");
        }
        // Another epoch's records passed off as this epoch's are caught by the public audit…
        let earlier = auditor.evidence(audited - 1).await.expect("records");
        let mut forged = auditor.evidence(audited).await.expect("records");
        forged.samples = earlier.samples;
        forged.record.miners = earlier.record.miners;
        let public = auditor
            .audit_with(&ss58(VALIDATOR), audited, [(audited, forged)].into())
            .await
            .expect("public audit of forged records");
        assert!(!public.matches && !public.records_match, "{public}");
        assert!(
            public.mismatches.iter().any(|m| m.contains("score of")),
            "{:?}",
            public.mismatches
        );

        // …and so is a published score altered after the fact.
        let altered = sqlx::query(
            "UPDATE validator_scores SET scores = jsonb_set(scores, '{0,score}',
                 to_jsonb((scores->0->>'score')::float8 * 2 + 1))
             WHERE epoch = $1 AND validator = $2",
        )
        .bind(audited as i64)
        .bind(ss58(VALIDATOR))
        .execute(&orch_db)
        .await
        .expect("tamper with the publication");
        assert_eq!(altered.rows_affected(), 1);
        let public = auditor
            .audit(&ss58(VALIDATOR), audited)
            .await
            .expect("public audit of a tampered publication");
        assert!(!public.matches && !public.records_match, "{public}");
        assert!(
            public.mismatches.iter().any(|m| m.contains("score of")),
            "{:?}",
            public.mismatches
        );
        // Tampering: another epoch's records passed off as this epoch's are caught…
        let earlier = v.fetch_evidence(audited - 1).await.expect("records");
        let mut forged = v.fetch_evidence(audited).await.expect("records");
        forged.samples = earlier.samples;
        forged.record.miners = earlier.record.miners;
        let report = v
            .audit_with(audited, [(audited, forged)].into())
            .await
            .expect("audit of forged records");
        eprintln!("{report}");
        assert!(!report.matches && !report.records_match, "{report}");
        assert!(
            report.mismatches.iter().any(|m| m.contains("score of")),
            "{:?}",
            report.mismatches
        );
        // …and so is a stored score row altered after the fact.
        let honest = ss58(HONEST[0]);
        let altered =
            sqlx::query("UPDATE scores SET score = score * 2 + 1 WHERE epoch = $1 AND hotkey = $2")
                .bind(audited as i64)
                .bind(&honest)
                .execute(store.pool())
                .await
                .expect("tamper");
        assert_eq!(altered.rows_affected(), 1);
        let report = v.audit(audited).await.expect("audit of a tampered db");
        eprintln!("{report}");
        assert!(!report.matches && !report.records_match, "{report}");
        let row = report
            .miners
            .iter()
            .find(|m| m.hotkey == honest)
            .expect("the tampered miner");
        assert!(!row.matches, "{row:?}");
        assert_eq!(
            report.miners.iter().filter(|m| !m.matches).count(),
            1,
            "only the altered row differs"
        );

        // After a tempo, Yuma pays honest miners more incentive than any cheater.
        let tempo = chain
            .chain
            .hyperparams(chain.netuid)
            .await
            .expect("hp")
            .tempo;
        let start = revealed_at.expect("block");
        chain
            .chain
            .wait_for_block(start + u64::from(tempo) + 2, Duration::from_secs(120))
            .await
            .expect("a tempo");
        let meta = chain
            .chain
            .metagraph(chain.netuid)
            .await
            .expect("metagraph");
        let incentive = |seed: u8| {
            meta.neurons
                .iter()
                .find(|n| n.hotkey.ss58() == ss58(seed))
                .map(|n| n.incentive)
                .expect("neuron")
        };
        let min_honest = HONEST.iter().map(|s| incentive(*s)).min().expect("honest");
        let max_cheat = CHEATERS
            .iter()
            .map(|(s, _)| incentive(*s))
            .max()
            .expect("cheaters");
        eprintln!("incentive: honest min {min_honest}, cheater max {max_cheat}");
        assert!(
            min_honest > max_cheat,
            "incentive: honest min {min_honest}, cheater max {max_cheat}"
        );

        for (_, _, m) in miners {
            let _ = m.stop().await;
        }
        orch.stop().await;
    };
    tokio::select! {
        _ = ticking => unreachable!("the ticker never ends"),
        _ = body => {}
    }
}

/// The audit matches the database and the chain, and rebuilds exactly the recorded weights.
fn assert_audit_matches(report: &AuditReport, recorded: &[f64]) {
    assert!(report.matches, "{report}");
    assert!(
        report.records_match && report.mismatches.is_empty(),
        "{report}"
    );
    assert!(report.miners.iter().all(|m| m.matches), "{report}");
    assert!(report.window.len() as u64 >= EPOCHS, "{report}");
    let mut rebuilt: Vec<f64> = report.weights.iter().map(|w| w.recomputed).collect();
    let mut recorded = recorded.to_vec();
    rebuilt.sort_by(f64::total_cmp);
    recorded.sort_by(f64::total_cmp);
    assert_eq!(rebuilt.len(), recorded.len(), "{report}");
    for (a, b) in rebuilt.iter().zip(&recorded) {
        assert!((a - b).abs() < 1e-9, "{report}");
    }
}
