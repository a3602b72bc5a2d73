//! Weights that did not reach the chain when their epoch was scored are sent by a later pass, as
//! soon as the subnet's rate limit lets the validator set weights, without waiting for another
//! epoch to be scored (a stalled run may never bring one), and only once. A send the chain
//! refuses is tried again after a back-off in blocks, not at every pass.
//!
//! Localnet in-process, an orchestrator with no miners (its run stays in epoch 0), and a
//! validator whose database holds epoch 0 scored: the state a pass leaves when it scores an
//! epoch and its weights fail. Needs `DATABASE_URL` (scripts/test.sh starts PostgreSQL).

use crate::common;

use common::*;
use iota_chain::calls::Hyperparam;
use iota_chain::commit::MemoryCommitStore;
use iota_chain::wallet::Keypair;
use iota_chain::{ConnectOptions, Subtensor, WeightOptions, WeightsOutcome};
use iota_validator::score::EpochScore;
use iota_validator::{Store, Validator, ValidatorConfig};

const MINERS: [u8; 2] = [21, 22];
const VALIDATOR: u8 = 29;
/// Blocks between two weight settings of one uid.
const RATE_LIMIT: u64 = 20;

/// What a pass leaves when it scores an epoch and its weights fail: an orchestrator whose run
/// stays in epoch 0 (no miners, so nothing new to score), and a validator whose database holds
/// epoch 0 scored as `scores` (miner seed, score) with no weights sent.
struct Scored {
    orch: Running,
    _store_dir: tempfile::TempDir,
    v: Validator,
    store: Store,
}

async fn epoch_0_scored(chain: &Chain, name: &str, scores: &[(u8, f64)]) -> Scored {
    let db = fresh_db().await;
    let store_dir = tempfile::tempdir().expect("store");
    let mut run = run_config(name);
    run.training_s = 1800;
    let orch = start(config(chain, &db, store_dir.path(), run)).await;
    let vdb = fresh_db().await;
    let store = Store::connect(&vdb).await.expect("validator db");
    let vchain = Subtensor::connect(ConnectOptions::new(chain.net.ws_url()))
        .await
        .expect("chain");
    let mut cfg = ValidatorConfig::new(orch.base.clone(), chain.netuid);
    cfg.tx = tx();
    let v = Validator::connect(
        cfg,
        Keypair::from_seed([VALIDATOR; 32]),
        vchain,
        store.clone(),
    )
    .await
    .expect("validator");
    let (run_id, _) = v.run_info().await.expect("run");
    let scores: Vec<EpochScore> = scores
        .iter()
        .map(|(seed, score)| EpochScore {
            hotkey: public(&pair(*seed)).ss58(),
            epoch: 0,
            work: *score,
            quality: 1.0,
            score: *score,
            penalty: None,
        })
        .collect();
    store
        .record_epoch(run_id, 0, "seed", 0, &[], None, &scores, &params())
        .await
        .expect("epoch 0 scored");
    Scored {
        orch,
        _store_dir: store_dir,
        v,
        store,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_owed_for_a_scored_epoch_are_sent_once_the_rate_limit_allows() {
    init_tracing();
    let chain = chain_with(&MINERS, &[VALIDATOR]).await;
    let (c, netuid) = (&chain.chain, chain.netuid);
    // No rate limit until the validator has set weights by hand (below): registration counts
    // as an update.
    set_hyperparams(
        &chain,
        [
            Hyperparam::CommitRevealWeightsEnabled(false),
            Hyperparam::WeightsRateLimit(0),
        ],
    )
    .await;
    let Scored {
        orch,
        _store_dir,
        v,
        store,
    } = epoch_0_scored(
        &chain,
        "weights-owed",
        &[(MINERS[0], 1.0), (MINERS[1], 3.0)],
    )
    .await;
    let hotkey = Keypair::from_seed([VALIDATOR; 32]);
    let meta = c.metagraph(netuid).await.expect("metagraph");
    let uid = |seed: u8| meta.uid_of(&public(&pair(seed))).expect("uid");

    // The validator has just set weights (by hand): the rate limit holds it back.
    let by_hand = c
        .set_weights(
            &hotkey,
            netuid,
            &[uid(MINERS[0])],
            &[1.0],
            &MemoryCommitStore::new(),
            &WeightOptions {
                tx: tx(),
                ..WeightOptions::default()
            },
        )
        .await
        .expect("weights by hand");
    let WeightsOutcome::Set { block: set_at, .. } = by_hand else {
        panic!("{by_hand:?}");
    };
    set_hyperparams(&chain, [Hyperparam::WeightsRateLimit(RATE_LIMIT)]).await;

    // Within the rate limit: nothing is sent (a send would fail).
    assert!(v.step().await.expect("step").is_empty());
    let subs = store.submissions(10).await.expect("submissions");
    assert!(subs.is_empty(), "sent into the rate limit: {subs:?}");

    // Past it, the owed weights go, though no epoch was scored since.
    chain.net.produce_blocks(RATE_LIMIT as u32);
    assert!(v.step().await.expect("step").is_empty());
    let subs = store.submissions(10).await.expect("submissions");
    assert_eq!(subs.len(), 1, "{subs:?}");
    let sent = &subs[0];
    assert_eq!(
        (sent.source.as_str(), sent.state.as_str(), sent.epoch),
        ("scores", "set", Some(0)),
        "{sent:?}"
    );
    let block = sent.block.expect("a block");
    assert!(block >= set_at + RATE_LIMIT, "{block} after {set_at}");
    assert_eq!(sent.uids, vec![uid(MINERS[0]), uid(MINERS[1])]);
    assert!(
        (sent.weights[1] / sent.weights[0] - 3.0).abs() < 1e-6,
        "{sent:?}"
    );
    let meta = c.metagraph(netuid).await.expect("metagraph");
    let me = meta
        .neuron_by_hotkey(&hotkey.public())
        .expect("the validator");
    assert_eq!(me.last_update, block, "the weights reached the chain");

    // Sent once: later passes, past the rate limit again, send nothing more.
    chain.net.produce_blocks(RATE_LIMIT as u32);
    v.step().await.expect("step");
    assert_eq!(store.submissions(10).await.expect("subs").len(), 1);
    orch.stop().await;
}

/// Weights already on chain are sent again once half the subnet's activity cutoff has passed
/// with no newer epoch scored (the run stalled): the validator would otherwise drop out of
/// consensus while it waits. Before half the cutoff nothing is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_are_refreshed_before_the_activity_cutoff_when_the_run_stalls() {
    init_tracing();
    let chain = chain_with(&MINERS, &[VALIDATOR]).await;
    const CUTOFF: u16 = 40;
    set_hyperparams(
        &chain,
        [
            Hyperparam::CommitRevealWeightsEnabled(false),
            Hyperparam::WeightsRateLimit(0),
            Hyperparam::ActivityCutoff(CUTOFF),
        ],
    )
    .await;
    let Scored {
        orch,
        _store_dir,
        v,
        store,
    } = epoch_0_scored(
        &chain,
        "weights-refresh",
        &[(MINERS[0], 1.0), (MINERS[1], 2.0)],
    )
    .await;
    let blocks = || async {
        let mut subs = store.submissions(10).await.expect("submissions");
        subs.reverse();
        subs.iter()
            .map(|s| {
                assert_eq!((s.state.as_str(), s.epoch), ("set", Some(0)), "{s:?}");
                s.block.expect("a block")
            })
            .collect::<Vec<u64>>()
    };
    v.step().await.expect("step");
    let first = blocks().await;
    assert_eq!(first.len(), 1, "{first:?}");
    // Within half the cutoff: nothing more.
    chain.net.produce_blocks(u32::from(CUTOFF) / 2 - 2);
    v.step().await.expect("step");
    assert_eq!(blocks().await, first);
    // Past it: the same epoch's weights again.
    chain.net.produce_blocks(2);
    v.step().await.expect("step");
    let again = blocks().await;
    assert_eq!(again.len(), 2, "{again:?}");
    assert!(again[1] >= first[0] + u64::from(CUTOFF) / 2, "{again:?}");
    let meta = chain
        .chain
        .metagraph(chain.netuid)
        .await
        .expect("metagraph");
    let me = meta
        .neuron_by_hotkey(&Keypair::from_seed([VALIDATOR; 32]).public())
        .expect("the validator");
    assert_eq!(me.last_update, again[1], "the refresh reached the chain");
    orch.stop().await;
}

/// A send the chain refuses (here: too little stake to set weights) is tried again after a
/// back-off of 2, then 4 blocks, not at every pass, and goes through once the refusal ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_weights_back_off_and_are_sent_when_the_chain_accepts() {
    init_tracing();
    let chain = chain_with(&MINERS, &[VALIDATOR]).await;
    set_hyperparams(
        &chain,
        [
            Hyperparam::CommitRevealWeightsEnabled(false),
            Hyperparam::WeightsRateLimit(0),
            Hyperparam::StakeThreshold(u64::MAX / 2),
        ],
    )
    .await;
    let Scored {
        orch,
        _store_dir,
        v,
        store,
    } = epoch_0_scored(
        &chain,
        "weights-refused",
        &[(MINERS[0], 1.0), (MINERS[1], 1.0)],
    )
    .await;
    let states = || async {
        let mut subs = store.submissions(10).await.expect("submissions");
        subs.reverse();
        subs.into_iter().map(|s| s.state).collect::<Vec<_>>()
    };
    // A pass at block `at` (the chain sealed up to it; a refused send seals nothing).
    let pass_at = |at: u64| {
        let best = chain.net.best_number();
        assert!(best <= at, "the chain is at {best}, past {at}");
        chain.net.produce_blocks((at - best) as u32);
        v.step()
    };
    let refused_at = chain.net.best_number();
    pass_at(refused_at).await.expect("step");
    assert_eq!(states().await, ["failed"], "refused");
    pass_at(refused_at + 1).await.expect("step");
    assert_eq!(states().await, ["failed"], "not again within 2 blocks");
    pass_at(refused_at + 2).await.expect("step");
    assert_eq!(states().await, ["failed", "failed"], "again 2 blocks on");
    pass_at(refused_at + 5).await.expect("step");
    assert_eq!(states().await, ["failed", "failed"], "then 4 blocks on");
    set_hyperparams(&chain, [Hyperparam::StakeThreshold(0)]).await;
    pass_at(refused_at + 6).await.expect("step");
    assert_eq!(
        states().await,
        ["failed", "failed", "set"],
        "sent once accepted"
    );
    orch.stop().await;
}

/// Commit-reveal v4, as finney runs it: the validator seals its owed weights to the drand round
/// out when the reveal epoch begins and commits them; the chain holds only the ciphertext until
/// its own beacon stores that round's pulse in the reveal epoch, then opens it and sets the
/// weights; the validator records the reveal's block, and the next Yuma epoch pays the miners in
/// the ratio of their scores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timelocked_weights_are_revealed_by_the_chain_and_paid_on() {
    init_tracing();
    let chain = chain_with(&MINERS, &[VALIDATOR]).await;
    let (c, netuid) = (&chain.chain, chain.netuid);
    set_hyperparams(
        &chain,
        [
            Hyperparam::CommitRevealWeightsEnabled(true),
            Hyperparam::CommitRevealVersion(4),
            Hyperparam::WeightsRateLimit(0),
        ],
    )
    .await;
    let Scored {
        orch,
        _store_dir,
        v,
        store,
    } = epoch_0_scored(
        &chain,
        "weights-timelocked",
        &[(MINERS[0], 1.0), (MINERS[1], 3.0)],
    )
    .await;
    let hotkey = Keypair::from_seed([VALIDATOR; 32]);
    let meta = c.metagraph(netuid).await.expect("metagraph");
    let uid = |seed: u8| meta.uid_of(&public(&pair(seed))).expect("uid");
    let me = uid(VALIDATOR);
    let weights_row = || async {
        let at = c.at_best().await.expect("block");
        iota_validator::onchain::weights_row(c, &at, netuid, me)
            .await
            .expect("weights row")
    };

    assert!(v.step().await.expect("step").is_empty());
    let subs = store.submissions(10).await.expect("submissions");
    assert_eq!(subs.len(), 1, "{subs:?}");
    assert_eq!(subs[0].state, "committed", "{subs:?}");
    let commit_block = subs[0].block.expect("the commit's block");
    assert!(
        weights_row().await.is_empty(),
        "only the ciphertext is on chain"
    );

    let hp = c.hyperparams(netuid).await.expect("hyperparams");
    let mut revealed = None;
    for _ in 0..3 * (u32::from(hp.tempo) + 1) {
        chain.net.produce_blocks(1);
        v.reveal().await.expect("reveal pass");
        let sub = store.submissions(10).await.expect("submissions").remove(0);
        if sub.state == "revealed" {
            revealed = Some(sub);
            break;
        }
        assert_eq!(sub.state, "committed", "{sub:?}");
    }
    let sent = revealed.expect("the chain revealed the commit");
    let block = sent.block.expect("the reveal's block");
    assert_eq!(
        hp.epoch_of(block),
        hp.epoch_of(commit_block) + hp.reveal_period_epochs,
        "revealed in the reveal epoch"
    );
    let row = weights_row().await;
    assert_eq!(
        row,
        vec![(uid(MINERS[0]), 21_845), (uid(MINERS[1]), 65_535)]
    );
    let meta = c.metagraph(netuid).await.expect("metagraph");
    let validator = meta.neuron_by_hotkey(&hotkey.public()).expect("validator");
    assert_eq!(validator.last_update, block, "the reveal set the weights");

    // The next epoch pays on them.
    let paid_from = chain.net.best_number();
    chain.net.produce_blocks(u32::from(hp.tempo) + 2);
    let meta = c.metagraph(netuid).await.expect("metagraph");
    assert!(meta.block > paid_from);
    let incentive = |seed: u8| meta.neurons[usize::from(uid(seed))].incentive;
    let (low, high) = (incentive(MINERS[0]), incentive(MINERS[1]));
    assert!(low > 0 && high > 0, "{:?}", meta.neurons);
    let ratio = f64::from(high) / f64::from(low);
    assert!((ratio - 3.0).abs() < 0.01, "incentive {high}/{low}");
    orch.stop().await;
}

/// The default scoring settings, as published.
fn params() -> iota_protocol::api::ScoringParams {
    iota_validator::published::params(&Default::default(), &Default::default(), None)
}
