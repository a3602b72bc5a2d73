//! With the orchestrator unreachable, a validator still sets weights at the subnet's cadence by
//! copying the chain's stake-weighted consensus: localnet in-process, three validators (two set
//! opposite weights by hand, the one with most of the stake 3:1, the other 1:3), no
//! orchestrator at all. Before any Yuma epoch has seen weights the copy is the stake-weighted
//! mean of their rows (19:9); once one has, it is the metagraph's consensus, the stake-weighted
//! median (3:1). Needs `DATABASE_URL` (scripts/test.sh starts PostgreSQL).

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use iota_chain::calls::{Hyperparam, RAO_PER_TAO};
use iota_chain::commit::MemoryCommitStore;
use iota_chain::epoch::blocks_until_next_epoch;
use iota_chain::wallet::Keypair;
use iota_chain::{ConnectOptions, Subtensor, WeightOptions, WeightsOutcome};
use iota_protocol::client::RetryPolicy;
use iota_validator::onchain::{at_number, weights_row};
use iota_validator::store::SubmissionRow;
use iota_validator::{Store, Validator, ValidatorConfig};

const MINERS: [u8; 3] = [11, 12, 13];
/// Sets 3:1 by hand and holds three quarters of the stake.
const OTHER: u8 = 98;
/// Sets 1:3 by hand, with an eighth of the stake.
const THIRD: u8 = 97;
/// The validator under test.
const VALIDATOR: u8 = 99;

/// A URL nothing listens on.
fn dead_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    drop(listener);
    format!("http://127.0.0.1:{port}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_orchestrator_means_consensus_weights_at_the_subnet_cadence() {
    init_tracing();
    let chain = chain_with(&MINERS, &[OTHER, THIRD, VALIDATOR]).await;
    let (c, netuid) = (&chain.chain, chain.netuid);
    set_hyperparams(
        &chain,
        [
            Hyperparam::CommitRevealWeightsEnabled(false),
            Hyperparam::WeightsRateLimit(0),
        ],
    )
    .await;
    // Stakes 6000 (OTHER), 1000 (THIRD), 1000 (the validator under test).
    c.add_stake(
        &dev("Alice"),
        &public(&pair(OTHER)),
        netuid,
        5_000 * RAO_PER_TAO,
        &tx(),
    )
    .await
    .expect("stake");
    let meta = c.metagraph(netuid).await.expect("metagraph");
    let uid = |seed: u8| meta.uid_of(&public(&pair(seed))).expect("uid");
    let tempo = meta.hyperparams.tempo;
    assert!(tempo >= 10, "tempo {tempo}");
    // Keep the next Yuma epoch clear of the next few blocks, so that no consensus exists yet
    // when the validator first copies.
    let best = c.best_block_number().await.expect("best");
    let until = blocks_until_next_epoch(netuid, tempo, best);
    if until < 8 {
        chain.net.produce_blocks(until as u32 + 1);
    }
    for (seed, scores) in [(OTHER, [3.0, 1.0]), (THIRD, [1.0, 3.0])] {
        let outcome = c
            .set_weights(
                &Keypair::from_seed([seed; 32]),
                netuid,
                &[uid(MINERS[0]), uid(MINERS[1])],
                &scores,
                &MemoryCommitStore::new(),
                &WeightOptions {
                    tx: tx(),
                    ..WeightOptions::default()
                },
            )
            .await
            .expect("a validator's weights");
        assert!(matches!(outcome, WeightsOutcome::Set { .. }), "{outcome:?}");
    }
    let meta = c.metagraph(netuid).await.expect("metagraph");
    assert!(
        meta.neurons.iter().all(|n| n.consensus == 0),
        "no Yuma epoch has seen the weights yet"
    );

    // The validator under test, with no orchestrator to reach.
    let db = fresh_db().await;
    let store = Store::connect(&db).await.expect("validator db");
    let vchain = Subtensor::connect(ConnectOptions::new(chain.net.ws_url()))
        .await
        .expect("chain");
    let mut cfg = ValidatorConfig::new(dead_url(), netuid);
    cfg.tx = tx();
    cfg.retry = RetryPolicy {
        attempts: 2,
        base: Duration::from_millis(10),
        max: Duration::from_millis(20),
        timeout: Duration::from_secs(2),
    };
    let v = Validator::connect(
        cfg,
        Keypair::from_seed([VALIDATOR; 32]),
        vchain,
        store.clone(),
    )
    .await
    .expect("a validator starts without its orchestrator");
    let scored = v.step().await.expect("step without the orchestrator");
    assert!(scored.is_empty());

    let subs = store.submissions(10).await.expect("submissions");
    assert_eq!(subs.len(), 1, "{subs:?}");
    let first = subs[0].clone();
    assert_eq!(
        (first.source.as_str(), first.state.as_str(), first.epoch),
        ("consensus", "set", None),
        "{first:?}"
    );
    // No consensus yet: the stake-weighted mean of the two rows,
    // (6000·3/4 + 1000·1/4) : (6000·1/4 + 1000·3/4) = 19 : 9.
    let ratio = chain_ratio(
        &chain,
        &first,
        uid(VALIDATOR),
        uid(MINERS[0]),
        uid(MINERS[1]),
    )
    .await;
    assert!((ratio - 19.0 / 9.0).abs() < 0.01, "ratio {ratio}");

    // At the subnet's cadence: nothing more within the tempo…
    v.step().await.expect("second step");
    assert_eq!(store.submissions(10).await.expect("subs").len(), 1);
    // …and after it, a Yuma epoch has run: the consensus (a stake-weighted median, which the
    // big validator's 3:1 dominates) is copied.
    chain.net.produce_blocks(u32::from(tempo) + 2);
    let meta = c.metagraph(netuid).await.expect("metagraph");
    let consensus: Vec<u16> = meta
        .neurons
        .iter()
        .filter(|n| n.consensus > 0)
        .map(|n| n.uid)
        .collect();
    assert_eq!(consensus, vec![uid(MINERS[0]), uid(MINERS[1])]);
    v.step().await.expect("step after a tempo");
    let subs = store.submissions(10).await.expect("subs");
    assert_eq!(subs.len(), 2, "{subs:?}");
    let second = &subs[0];
    assert_eq!(
        (second.source.as_str(), second.state.as_str()),
        ("consensus", "set")
    );
    assert!(second.block > first.block);
    let ratio = chain_ratio(
        &chain,
        second,
        uid(VALIDATOR),
        uid(MINERS[0]),
        uid(MINERS[1]),
    )
    .await;
    assert!((ratio - 3.0).abs() < 0.01, "ratio {ratio}");
}

/// The ratio of the two miners' weights in the validator's `Weights` row at the submission's
/// block (the larger is 65535).
async fn chain_ratio(chain: &Chain, sub: &SubmissionRow, validator: u16, a: u16, b: u16) -> f64 {
    let at = at_number(&chain.chain, sub.block.expect("block"))
        .await
        .expect("at");
    let row: BTreeMap<u16, u16> = weights_row(&chain.chain, &at, chain.netuid, validator)
        .await
        .expect("weights row")
        .into_iter()
        .collect();
    assert_eq!(row.len(), 2, "{row:?}");
    assert_eq!(row[&a], u16::MAX, "{row:?}");
    f64::from(row[&a]) / f64::from(row[&b])
}
