//! `iota miner` as a process: SIGKILL mid-epoch does not stall the run, and the miner restarted
//! with the same hotkey rejoins its stage and loads the current weights. Needs PostgreSQL
//! (`DATABASE_URL`, started by scripts/test.sh).

use crate::miner_support as support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use iota_chain::wallet::{Keypair, Wallet};
use iota_miner::spawn;
use support::*;

/// Kills the child on drop, so a failing test leaves no process behind.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_miner(
    wallets: &std::path::Path,
    chain: &Chain,
    base: &str,
    log: &std::path::Path,
) -> Proc {
    let log = std::fs::File::create(log).expect("log file");
    let child = Command::new(env!("CARGO_BIN_EXE_iota"))
        .args([
            "miner",
            "--wallet.name",
            "victim",
            "--wallet.hotkey",
            "default",
        ])
        .arg("--wallet.path")
        .arg(wallets)
        .args(["--subtensor.chain_endpoint", &chain.net.ws_url()])
        .args(["--netuid", &chain.netuid.to_string()])
        .args(["--orchestrator.url", base])
        .args([
            "--progress",
            "off",
            "--poll-interval-ms",
            "50",
            "--memory-gb",
            "8",
        ])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn iota miner");
    Proc(child)
}

/// The `(epoch, digest)` of every "epoch-start weights loaded" line in a miner's log.
fn loaded(log: &std::path::Path) -> Vec<(u64, String)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter(|l| l.contains("epoch-start weights loaded"))
        .filter_map(|l| {
            let field = |name: &str| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(&format!("{name}=")).map(str::to_owned))
            };
            Some((field("epoch")?.parse().ok()?, field("weights")?))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_miner_process_rejoins_and_catches_up() {
    init_tracing();
    let victim_seed = 61u8;
    let others = [62u8, 63, 64, 65, 66];
    let all: Vec<u8> = std::iter::once(victim_seed).chain(others).collect();
    let chain = chain_with(&all, &[]).await;
    let wallets = tempfile::tempdir().expect("wallets");
    Wallet::new(wallets.path(), "victim", "default")
        .expect("wallet")
        .set_hotkey(&Keypair::from_seed([victim_seed; 32]), None, false)
        .expect("hotkey");
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("store");
    let run = tiny_run("miner-sigkill", 32);
    let orch = start(config(&chain, &db, store.path(), run.clone())).await;
    let client = explorer(&orch.base, others[0]).await;
    let miners: Vec<_> = others
        .iter()
        .map(|s| spawn(miner_config(&orch.base), signer(*s)))
        .collect();
    let logs = tempfile::tempdir().expect("logs");
    let (log1, log2) = (logs.path().join("1.log"), logs.path().join("2.log"));
    let victim_ss58 = iota_protocol::signing::RequestSigner::ss58(&pair(victim_seed));

    let mut victim = start_miner(wallets.path(), &chain, &orch.base, &log1);
    let stage = eventually("the victim at work", Duration::from_secs(120), || async {
        let miners: Vec<iota_protocol::api::MinerInfo> =
            client.public_get("/v1/miners").await.ok()?;
        let me = miners.iter().find(|m| m.hotkey == victim_ss58)?;
        (me.hops_this_epoch >= 2).then_some(me.stage)
    })
    .await;
    victim.0.kill().expect("SIGKILL");
    let _ = victim.0.wait();

    // The run goes on without it: the epoch completes with every partition merged.
    wait_epoch(&client, 1, Duration::from_secs(240)).await;
    for p in client.merge_status(0).await.expect("merges") {
        assert_eq!(
            p.state,
            iota_protocol::api::PartitionState::Accepted,
            "{p:?}"
        );
    }

    let _victim = start_miner(wallets.path(), &chain, &orch.base, &log2);
    let (epoch, digest) = eventually("the victim back", Duration::from_secs(120), || async {
        loaded(&log2).first().cloned()
    })
    .await;
    assert!(epoch >= 1, "rejoined in epoch {epoch}");
    let (_, merged) = epoch_start_stages(&client, &run, epoch).await;
    assert_eq!(
        digest, merged[stage as usize],
        "loaded the current weights of its stage"
    );
    eventually(
        "the victim working again",
        Duration::from_secs(120),
        || async {
            let miners: Vec<iota_protocol::api::MinerInfo> =
                client.public_get("/v1/miners").await.ok()?;
            let me = miners.iter().find(|m| m.hotkey == victim_ss58)?;
            (me.status == "active" && me.stage == stage && me.hops_this_epoch > 0).then_some(())
        },
    )
    .await;
    for m in miners {
        m.stop().await.expect("clean stop");
    }
    orch.stop().await;
}
