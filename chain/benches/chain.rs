//! Chain client benchmarks against an in-process localnet (instant blocks: a block per
//! transaction, so timings are client + RPC + localnet, not block time):
//!
//! * metagraph sync of a full 256-UID subnet (every uid with an axon and some stake), next to
//!   reading only its members (uid, hotkey, validator permit: what a metagraph watcher reads at
//!   each block), and what building its storage keys costs with the address checked per key or
//!   per entry;
//! * `set_weights` round trip, submission to inclusion in a block, for 256 uids.
//!
//! Run with `cargo bench -p iota-chain --bench chain`.

use std::time::{Duration, Instant};

use iota_chain::calls::{self, AxonEndpoint, Hyperparam, RAO_PER_TAO};
use iota_chain::client::StorageBatch;
use iota_chain::commit::MemoryCommitStore;
use iota_chain::wallet::Keypair;
use iota_chain::{ConnectOptions, Subtensor, TxOptions, WeightOptions};
use iota_localnet::{Localnet, LocalnetConfig};
use sp_core::Pair as _;

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

struct Stats {
    median: Duration,
    p90: Duration,
    min: Duration,
    max: Duration,
}

fn stats(mut xs: Vec<Duration>) -> Stats {
    xs.sort();
    let at = |q: f64| xs[((xs.len() - 1) as f64 * q).round() as usize];
    Stats {
        median: at(0.5),
        p90: at(0.9),
        min: xs[0],
        max: xs[xs.len() - 1],
    }
}

fn show(name: &str, n: usize, s: &Stats) {
    println!(
        "{name:<58} n={n:<3} median {:>8.2?}  p90 {:>8.2?}  min {:>8.2?}  max {:>8.2?}",
        s.median, s.p90, s.min, s.max
    );
}

fn key(i: u32) -> Keypair {
    let mut seed = [7u8; 32];
    seed[..4].copy_from_slice(&i.to_le_bytes());
    Keypair::from_seed(seed)
}

async fn run() -> BenchResult<()> {
    let net = Localnet::spawn(LocalnetConfig::instant()).await?;
    let chain = Subtensor::connect(ConnectOptions::new(net.ws_url())).await?;
    let alice = Keypair::from_private_key(&iota_localnet::dev_pair("Alice").to_raw_vec())?;
    let tx = TxOptions::default();

    // A full subnet: Alice owns it, 255 more hotkeys, each with an axon; 64 with stake.
    let setup = Instant::now();
    let owner_hot = key(0);
    let netuid = chain
        .register_network(&alice, &owner_hot.public(), &tx)
        .await?
        .done()
        .ok_or("dry run")?;
    chain.start_call(&alice, netuid, &tx).await?;
    for (setting, sudo) in [
        (Hyperparam::CommitRevealWeightsEnabled(false), false),
        (Hyperparam::WeightsRateLimit(0), true),
        (Hyperparam::ServingRateLimit(0), false),
    ] {
        chain
            .set_hyperparam(&alice, netuid, setting, sudo, &tx)
            .await?;
    }
    let hotkeys: Vec<Keypair> = (0..256).map(key).collect();
    for hot in &hotkeys[1..] {
        chain.register(&alice, netuid, &hot.public(), &tx).await?;
    }
    for (i, hot) in hotkeys.iter().enumerate() {
        let ip = std::net::Ipv4Addr::new(10, 0, (i / 256) as u8, (i % 256) as u8 + 1);
        let axon = AxonEndpoint::new(ip.into(), 8000 + i as u16);
        chain.serve_axon(hot, netuid, &axon, &tx).await?;
    }
    for hot in &hotkeys[..64] {
        chain
            .add_stake(&alice, &hot.public(), netuid, 10 * RAO_PER_TAO, &tx)
            .await?;
    }
    // An epoch hands out validator permits by stake.
    net.produce_blocks(12);
    println!(
        "setup: 256-UID subnet with axons and stake in {:.2?} ({} blocks)",
        setup.elapsed(),
        net.best_number()
    );

    // Metagraph sync, alternating with the members read (what a metagraph watcher reads at each
    // new block), both at one block.
    let at = chain.at_finalized().await?;
    let mg = chain.metagraph_at(&at, netuid).await?;
    assert_eq!(mg.neurons.len(), 256);
    assert!(mg.neurons.iter().all(|n| n.axon.is_some()));
    let (mut samples, mut member_samples) = (Vec::new(), Vec::new());
    for _ in 0..30 {
        let t = Instant::now();
        let mg = chain.metagraph_at(&at, netuid).await?;
        samples.push(t.elapsed());
        assert_eq!(mg.neurons.len(), 256);
        let t = Instant::now();
        let members = chain.members_at(&at, netuid).await?;
        member_samples.push(t.elapsed());
        assert_eq!(members, iota_chain::Members::from(&mg));
    }
    show(
        "metagraph sync, 256 UIDs (3 batched queries)",
        samples.len(),
        &stats(samples),
    );
    show(
        "members (uid, hotkey, permit), 256 UIDs (2 queries)",
        member_samples.len(),
        &stats(member_samples),
    );

    // Building a batch's storage keys: each address checked against the node's metadata once
    // per key (`add` in a loop, as the metagraph read did) or once per entry (`add_all`).
    let at = chain.at_finalized().await?;
    let st = || iota_chain::api::storage().subtensor_module();
    let uids = || (0..256u16).map(|uid| (netuid, uid));
    let (mut per_key, mut per_entry) = (Vec::new(), Vec::new());
    for _ in 0..30 {
        let t = Instant::now();
        let mut batch = StorageBatch::new(&at);
        for parts in uids() {
            batch.add(st().keys(), parts)?;
            batch.add(st().block_at_registration(), parts)?;
        }
        per_key.push(t.elapsed());
        assert_eq!(batch.len(), 512);
        let t = Instant::now();
        let mut batch = StorageBatch::new(&at);
        batch.add_all(st().keys(), uids())?;
        batch.add_all(st().block_at_registration(), uids())?;
        per_entry.push(t.elapsed());
        assert_eq!(batch.len(), 512);
    }
    show(
        "512 storage keys, address checked per key",
        per_key.len(),
        &stats(per_key),
    );
    show(
        "512 storage keys, address checked per entry",
        per_entry.len(),
        &stats(per_entry),
    );

    // For comparison: the per-neuron items read one RPC per value through plain subxt.
    let mut naive = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let at = chain.at_finalized().await?;
        let st = || iota_chain::api::storage().subtensor_module();
        for uid in 0..256u16 {
            let hotkey = at
                .storage()
                .fetch(st().keys(), (netuid, uid))
                .await?
                .decode()?;
            let _owner = at
                .storage()
                .fetch(st().owner(), (hotkey,))
                .await?
                .decode()?;
            let _stake = at
                .storage()
                .fetch(st().total_hotkey_alpha(), (hotkey, netuid))
                .await?
                .decode()?;
            let _axon = at
                .storage()
                .try_fetch(st().axons(), (netuid, hotkey))
                .await?;
        }
        naive.push(t.elapsed());
    }
    show(
        "  vs. one RPC per value (Keys, Owner, stake, Axons only)",
        naive.len(),
        &stats(naive),
    );

    // set_weights round trips for the top validator, all 256 uids.
    let validator = &hotkeys[0];
    let uids: Vec<u16> = (0..256).collect();
    let values: Vec<u16> = (0..256u32).map(|i| (i * 251 % 65535 + 1) as u16).collect();
    let store = MemoryCommitStore::new();
    let opts = WeightOptions {
        tx: tx.clone(),
        ..WeightOptions::default()
    };
    let mut submit_only = Vec::new();
    let mut full = Vec::new();
    for round in 0..40 {
        let t = Instant::now();
        if round % 2 == 0 {
            let call = calls::set_weights(netuid, uids.clone(), values.clone(), 0);
            let out = chain.submit(&call, validator, &tx).await?;
            assert!(out.receipt().is_some());
            submit_only.push(t.elapsed());
        } else {
            chain
                .set_weights_u16(
                    validator,
                    netuid,
                    uids.clone(),
                    values.clone(),
                    &store,
                    &opts,
                )
                .await?;
            full.push(t.elapsed());
        }
    }
    show(
        "set_weights submit -> in block (sign, submit, watch, events)",
        submit_only.len(),
        &stats(submit_only),
    );
    show(
        "set_weights API incl. reads (hyperparams, uid, rate limit)",
        full.len(),
        &stats(full),
    );
    net.stop().await;
    Ok(())
}

fn main() -> BenchResult<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(run())
}
