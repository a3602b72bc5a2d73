//! A devnet of chain, orchestrator and a validator (no miners), started and then dropped without
//! `stop()`: its orchestrator and chain stop answering. Needs `DATABASE_URL` (scripts/test.sh
//! starts PostgreSQL).

use std::time::{Duration, Instant};

use iota_chain::TxOptions;
use iota_chain::wallet::Keypair;
use iota_devnet::{Devnet, DevnetConfig, Neuron, Role};
use iota_localnet::LocalnetConfig;
use iota_miner::MinerConfig;
use iota_protocol::signing::SkewWindow;
use iota_validator::ValidatorConfig;

/// Polls `check` every 50 ms until it holds; panics after `timeout`.
async fn within(what: &str, timeout: Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn config(store: &std::path::Path) -> DevnetConfig {
    let database_url = std::env::var("DATABASE_URL").expect(
        "DATABASE_URL is not set: run the tests through scripts/test.sh, which starts PostgreSQL",
    );
    let tx = TxOptions {
        timeout: Duration::from_secs(30),
        ..TxOptions::default()
    };
    let owner = Keypair::from_seed([250; 32]);
    let run = iota_trainer::local_tiny_run("devnet-drop", 8).expect("tiny run");
    let mut chain = LocalnetConfig::with_block_time(Duration::from_millis(100));
    chain.chain.new_subnet_tempo = 10;
    DevnetConfig {
        chain,
        permit_timeout: Duration::from_secs(60),
        neurons: vec![Neuron {
            name: "validator0".into(),
            key: Keypair::from_seed([1; 32]),
            role: Role::Validator,
            adversary: None,
        }],
        database_url,
        database_prefix: format!("iota_devnet_{}", std::process::id()),
        orchestrator: iota_orchestrator::Config {
            database_url: String::new(),
            db_max_connections: 4,
            store: iota_orchestrator::StoreConfig::Local(store.into()),
            chain_endpoint: String::new(),
            chain_timeout: Duration::from_secs(30),
            trusted_proxies: Vec::new(),
            netuid: 0,
            hotkey: owner.ss58(),
            run,
            metagraph_refresh: Duration::from_millis(200),
            skew: SkewWindow::default(),
            limits: iota_orchestrator::Limits::default(),
            tick: Duration::from_millis(100),
            max_merge_rounds: 2,
            dataset: None,
        },
        owner,
        validator: ValidatorConfig::new(String::new(), 0),
        miner: MinerConfig::new(String::new()),
        miner_join_timeout: Duration::from_secs(30),
        tx,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_devnet_stops_its_orchestrator_and_chain() {
    let store = tempfile::tempdir().expect("store dir");
    let devnet = Devnet::start(config(store.path())).await.expect("devnet");
    assert_eq!(devnet.validators.len(), 1);
    assert!(devnet.miners.is_empty());
    devnet
        .client
        .status()
        .await
        .expect("the orchestrator answers");
    let status_url = format!("{}/v1/status", devnet.base);
    let chain_addr = devnet
        .ws_url()
        .expect("running")
        .trim_start_matches("ws://")
        .to_owned();
    drop(devnet);
    within(
        "the orchestrator to stop",
        Duration::from_secs(30),
        async || reqwest::get(&status_url).await.is_err(),
    )
    .await;
    within("the chain to stop", Duration::from_secs(30), async || {
        tokio::net::TcpStream::connect(&chain_addr).await.is_err()
    })
    .await;
}
