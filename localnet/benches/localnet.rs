//! Localnet benchmarks: start-up time, transactions accepted per second with instant blocks, and a
//! full-map storage iteration of a 256-UID subnet read through subxt.
//! Run with `cargo bench -p iota-localnet --bench localnet`.

use std::time::{Duration, Instant};

use iota_localnet::runtime::call::{
    AdminUtilsCall, RuntimeCall, SubtensorCall, SudoCall, SystemCall,
};
use iota_localnet::runtime::extrinsic::{self, ChainContext};
use iota_localnet::runtime::types::AccountId32;
use iota_localnet::{Localnet, LocalnetConfig, dev_pair};
use jsonrpsee::core::client::ClientT;
use subxt::{OnlineClient, PolkadotConfig};

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

async fn startup() -> Duration {
    let mut samples = vec![];
    for _ in 0..20 {
        let t = Instant::now();
        let net = Localnet::spawn(LocalnetConfig::default())
            .await
            .expect("spawn");
        let client = jsonrpsee::ws_client::WsClientBuilder::default()
            .build(net.ws_url())
            .await
            .expect("connect");
        let _: String = client
            .request("chain_getBlockHash", jsonrpsee::rpc_params![0])
            .await
            .expect("rpc");
        samples.push(t.elapsed());
        net.stop().await;
    }
    median(samples)
}

async fn transactions_per_second(n: u32) -> f64 {
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("spawn");
    let alice = dev_pair("Alice");
    let genesis_hash = net.chain().lock().expect("lock").genesis_hash();
    let lookup = |_: u64| None;
    let ctx = ChainContext {
        genesis_hash,
        spec_version: iota_localnet::runtime::SPEC_VERSION,
        transaction_version: iota_localnet::runtime::TRANSACTION_VERSION,
        next_block: 1,
        block_hash: &lookup,
    };
    let txs: Vec<String> = (0..n)
        .map(|nonce| {
            let call = RuntimeCall::System(SystemCall::remark {
                remark: nonce.to_le_bytes().to_vec(),
            });
            format!(
                "0x{}",
                hex::encode(extrinsic::sign(&alice, &call, nonce, &ctx))
            )
        })
        .collect();
    let client = jsonrpsee::ws_client::WsClientBuilder::default()
        .build(net.ws_url())
        .await
        .expect("connect");
    let t = Instant::now();
    for tx in &txs {
        let _: String = client
            .request("author_submitExtrinsic", jsonrpsee::rpc_params![tx])
            .await
            .expect("accepted");
    }
    let rate = n as f64 / t.elapsed().as_secs_f64();
    assert_eq!(net.best_number(), n as u64, "one block per transaction");
    net.stop().await;
    rate
}

async fn metagraph_iteration() -> (Duration, Duration) {
    let net = Localnet::spawn(LocalnetConfig::instant())
        .await
        .expect("spawn");
    let alice = dev_pair("Alice");
    {
        let mut chain = net.chain().lock().expect("lock");
        let owner_hot = AccountId32::new([1; 32]);
        chain
            .sign_and_submit(
                &alice,
                &RuntimeCall::SubtensorModule(SubtensorCall::register_network {
                    hotkey: owner_hot,
                }),
            )
            .expect("subnet");
        let sudo = |call| {
            RuntimeCall::Sudo(SudoCall::sudo {
                call: Box::new(RuntimeCall::AdminUtils(call)),
            })
        };
        chain
            .sign_and_submit(
                &alice,
                &sudo(AdminUtilsCall::sudo_set_max_registrations_per_block {
                    netuid: 1,
                    max_registrations_per_block: 1_000,
                }),
            )
            .expect("sudo");
        for i in 1..256u32 {
            let mut raw = [0u8; 32];
            raw[..4].copy_from_slice(&(i + 1_000).to_le_bytes());
            let call = RuntimeCall::SubtensorModule(SubtensorCall::burned_register {
                netuid: 1,
                hotkey: AccountId32::new(raw),
            });
            chain.sign_and_submit(&alice, &call).expect("register");
        }
    }
    let client = OnlineClient::<PolkadotConfig>::from_insecure_url(net.ws_url())
        .await
        .expect("subxt");
    let mut samples_keys = vec![];
    let mut samples_all = vec![];
    for _ in 0..10 {
        let at = client.at_current_block().await.expect("block");
        let t = Instant::now();
        let addr = subxt::dynamic::storage::<(u16, u16), [u8; 32]>("SubtensorModule", "Keys");
        let mut iter = at.storage().iter(addr, (1u16,)).await.expect("iter");
        let mut count = 0;
        while let Some(entry) = iter.next().await {
            entry.expect("entry");
            count += 1;
        }
        assert_eq!(count, 256);
        samples_keys.push(t.elapsed());

        // The whole metagraph's per-uid vectors too: one fetch each.
        let t = Instant::now();
        for item in [
            "Incentive",
            "Dividends",
            "Consensus",
            "ValidatorTrust",
            "StakeWeight",
        ] {
            let addr = subxt::dynamic::storage::<(u16,), Vec<u16>>("SubtensorModule", item);
            at.storage().fetch(addr, (1u16,)).await.expect("fetch");
        }
        samples_all.push(t.elapsed() + samples_keys[samples_keys.len() - 1]);
    }
    net.stop().await;
    (median(samples_keys), median(samples_all))
}

/// Resident set size of this process, in MiB (Linux `/proc/self/status`).
fn resident_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// Resident memory before and after `n` signed transactions through the chain (40 per block, so
/// the run passes `BlockHashCount` and pruning takes effect), with the block count at the end.
fn memory_after_transactions(n: u32) -> (f64, f64, u64) {
    use iota_localnet::chain::{Chain, ChainConfig};
    let before = resident_mib().unwrap_or(f64::NAN);
    let mut chain = Chain::new(ChainConfig {
        block_time: None,
        instant: false,
        ..ChainConfig::default()
    });
    let signers: Vec<_> = (0..10).map(|i| dev_pair(&format!("Mem{i}"))).collect();
    for i in 0..n {
        let call = RuntimeCall::System(SystemCall::remark {
            remark: i.to_le_bytes().to_vec(),
        });
        chain
            .sign_and_submit(&signers[(i % 10) as usize], &call)
            .expect("accepted");
        if i % 40 == 39 {
            chain.produce_block();
        }
    }
    chain.produce_block();
    let blocks = chain.best().header.number as u64;
    let after = resident_mib().unwrap_or(f64::NAN);
    drop(chain);
    (before, after, blocks)
}

#[tokio::main]
async fn main() {
    let (rss_before, rss_after, blocks) = memory_after_transactions(100_000);
    let startup = startup().await;
    let tps = transactions_per_second(2_000).await;
    let (keys, metagraph) = metagraph_iteration().await;
    println!("localnet benchmarks (median of repeated runs)");
    println!(
        "  start-up (spawn + first RPC answer):          {:>8.2} ms",
        startup.as_secs_f64() * 1e3
    );
    println!(
        "  transactions accepted, instant blocks:        {tps:>8.0} tx/s (2000 signed remarks over WebSocket)"
    );
    println!(
        "  full-map iteration, Keys of a 256-UID subnet: {:>8.2} ms (subxt storage iter)",
        keys.as_secs_f64() * 1e3
    );
    println!(
        "  Keys + 5 per-uid vectors (metagraph read):    {:>8.2} ms",
        metagraph.as_secs_f64() * 1e3
    );
    println!(
        "  resident memory, 10^5 transactions:           {rss_after:>8.1} MiB ({rss_before:.1} MiB before; {blocks} blocks of 40)"
    );
}
