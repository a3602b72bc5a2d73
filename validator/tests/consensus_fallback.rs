//! With the orchestrator unreachable, a validator still sets weights at the subnet's cadence by
//! copying the chain's stake-weighted consensus: localnet in-process, two validators (one, with
//! most of the stake, sets weights by hand), no orchestrator at all. Needs `DATABASE_URL`
//! (scripts/test.sh starts PostgreSQL).

#[path = "../../orchestrator/tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use iota_chain::calls::{Hyperparam, RAO_PER_TAO};
use iota_chain::commit::MemoryCommitStore;
use iota_chain::wallet::Keypair;
use iota_chain::{ConnectOptions, Subtensor, WeightOptions, WeightsOutcome};
use iota_protocol::client::RetryPolicy;
use iota_validator::onchain::{at_number, weights_row};
use iota_validator::{Store, Validator, ValidatorConfig};
use sp_core::Pair as _;

const MINERS: [u8; 3] = [11, 12, 13];
/// Sets weights by hand and holds most of the stake.
const OTHER: u8 = 98;
/// The validator under test.
const VALIDATOR: u8 = 99;

fn alice() -> Keypair {
    Keypair::from_private_key(&iota_localnet::dev_pair("Alice").to_raw_vec()).expect("alice")
}

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
    let chain = chain_with(&MINERS, &[OTHER, VALIDATOR]).await;
    let (c, netuid) = (&chain.chain, chain.netuid);
    for setting in [
        Hyperparam::CommitRevealWeightsEnabled(false),
        Hyperparam::WeightsRateLimit(0),
    ] {
        c.set_hyperparam(&alice(), netuid, setting, true, &tx())
            .await
            .expect("hyperparameter");
    }
    // The other validator holds four fifths of the stake: consensus follows it.
    c.add_stake(
        &alice(),
        &public(&pair(OTHER)),
        netuid,
        3_000 * RAO_PER_TAO,
        &tx(),
    )
    .await
    .expect("stake");
    let meta = c.metagraph(netuid).await.expect("metagraph");
    let uid = |seed: u8| meta.uid_of(&public(&pair(seed))).expect("uid");
    let other = Keypair::from_seed([OTHER; 32]);
    let outcome = c
        .set_weights(
            &other,
            netuid,
            &[uid(MINERS[0]), uid(MINERS[1])],
            &[3.0, 1.0],
            &MemoryCommitStore::new(),
            &WeightOptions {
                tx: tx(),
                ..WeightOptions::default()
            },
        )
        .await
        .expect("the other validator's weights");
    assert!(matches!(outcome, WeightsOutcome::Set { .. }), "{outcome:?}");
    let tempo = meta.hyperparams.tempo;
    chain.net.produce_blocks(u32::from(tempo) + 2);
    let meta = c.metagraph(netuid).await.expect("metagraph");
    let consensus: Vec<(u16, u16)> = meta
        .neurons
        .iter()
        .filter(|n| n.consensus > 0)
        .map(|n| (n.uid, n.consensus))
        .collect();
    assert_eq!(
        consensus.iter().map(|c| c.0).collect::<Vec<_>>(),
        vec![uid(MINERS[0]), uid(MINERS[1])],
        "a Yuma epoch gave consensus: {consensus:?}"
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
    let sub = &subs[0];
    assert_eq!(
        (sub.source.as_str(), sub.state.as_str(), sub.epoch),
        ("consensus", "set", None),
        "{sub:?}"
    );
    // What landed on chain is the consensus: 3:1 between the two miners.
    let mine = uid(VALIDATOR);
    let at = at_number(c, sub.block.expect("block")).await.expect("at");
    let row: BTreeMap<u16, u16> = weights_row(c, &at, netuid, mine)
        .await
        .expect("weights row")
        .into_iter()
        .collect();
    assert_eq!(row.len(), 2, "{row:?}");
    let (a, b) = (row[&uid(MINERS[0])], row[&uid(MINERS[1])]);
    assert_eq!(a, u16::MAX, "{row:?}");
    let ratio = f64::from(a) / f64::from(b);
    assert!((ratio - 3.0).abs() < 0.01, "weights {row:?}, ratio {ratio}");

    // At the subnet's cadence: nothing more within the tempo, again after it.
    v.step().await.expect("second step");
    assert_eq!(store.submissions(10).await.expect("subs").len(), 1);
    chain.net.produce_blocks(u32::from(tempo) + 1);
    v.step().await.expect("step after a tempo");
    let subs = store.submissions(10).await.expect("subs");
    assert_eq!(subs.len(), 2, "{subs:?}");
    assert_eq!(
        (subs[0].source.as_str(), subs[0].state.as_str()),
        ("consensus", "set")
    );
    assert!(subs[0].block > sub.block);
}
