//! The subnet bootstrap on an in-process localnet: uids follow the neurons' order, the uid limit
//! and settings are applied, and the staked validator holds its permit after the tempo.

use std::time::Duration;

use iota_chain::calls::Hyperparam;
use iota_chain::wallet::{Keypair, PublicKey};
use iota_chain::{ConnectOptions, Subtensor, TxOptions};
use iota_devnet::{PermitWait, SubnetPlan, VALIDATOR_STAKE_TAO, bootstrap};
use iota_localnet::{Localnet, LocalnetConfig};

fn key(seed: u8) -> Keypair {
    Keypair::from_seed([seed; 32])
}

#[tokio::test]
async fn bootstrap_registers_in_order_and_the_validator_gets_its_permit() {
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("localnet");
    let mut opts = ConnectOptions::new(net.ws_url());
    opts.connect_timeout = Duration::from_secs(20);
    let chain = Subtensor::connect(opts).await.expect("connect");
    let alice = Keypair::from_private_key(&sp_core::Pair::to_raw_vec(&iota_localnet::dev_pair(
        "Alice",
    )))
    .expect("alice");
    let neurons: Vec<PublicKey> = [1, 2, 3].iter().map(|s| key(*s).public()).collect();
    let tx = TxOptions {
        timeout: Duration::from_secs(30),
        ..TxOptions::default()
    };
    let netuid = bootstrap(
        &chain,
        &SubnetPlan {
            sudo: &alice,
            owner: &key(250).public(),
            max_uids: 64,
            settings: &[Hyperparam::WeightsRateLimit(0)],
            neurons: &neurons,
            validators: &[key(3).public()],
            permits: PermitWait::Produce(&net),
            tx: &tx,
        },
    )
    .await
    .expect("bootstrap");
    let params = chain.hyperparams(netuid).await.expect("hyperparams");
    assert_eq!(params.max_uids, 64);
    assert_eq!(params.owner_hotkey, key(250).public());
    assert_eq!(params.weights_rate_limit, 0);
    let meta = chain.metagraph(netuid).await.expect("metagraph");
    let uids: Vec<Option<u16>> = neurons.iter().map(|k| meta.uid_of(k)).collect();
    // Uid 0 is the owner's hotkey.
    assert_eq!(uids, [Some(1), Some(2), Some(3)]);
    let validator = meta
        .neurons
        .iter()
        .find(|n| n.hotkey == key(3).public())
        .expect("validator registered");
    assert!(validator.validator_permit, "{validator:?}");
    assert!(validator.stake >= VALIDATOR_STAKE_TAO * iota_chain::calls::RAO_PER_TAO / 2);
    net.stop().await;
}
