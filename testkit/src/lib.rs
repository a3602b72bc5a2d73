//! Shared set-up of the workspace's integration tests and benchmarks, in one place instead of
//! files included by path.
//!
//! * [`common`]: a fresh PostgreSQL database per test, a localnet chain with a subnet and
//!   registered hotkeys, orchestrators started in-process on port 0, raw signed requests, the
//!   polling helper [`eventually`]; re-exported here.
//! * [`sim`]: simulated miners (the real client and wire formats, no model).
//! * [`iota_devnet`]: the subnet bootstrap, shared with `iota localnet up`; re-exported.
//! * Here: real miners on a `tiny` run, and helpers that read what the run produced.

pub mod common;
pub mod sim;

use std::time::Duration;

use iota_miner::{DeviceSpec, MinerConfig};
use iota_model::{AdamW, AdamWConfig, LrSchedule, ModelConfig, Pipeline, Stage};
use iota_protocol::api::{PartitionState, RunConfig};
use iota_protocol::client::{ApiClient, RetryPolicy};

pub use common::*;
/// The subnet bootstrap the tests share with `localnet up`.
pub use iota_devnet;
/// The miner as tests drive it (crates whose tests need real miners, such as the validator's,
/// reach it through here rather than depending on it).
pub use iota_miner::{Adversary, MinerHandle, spawn as spawn_miner};

/// A real run of the `tiny` model: 3 stages, 2 partitions each, small epochs.
pub fn tiny_run(name: &str, samples_per_epoch: u64) -> RunConfig {
    iota_trainer::local_tiny_run(name, samples_per_epoch).expect("tiny run")
}

/// Miner settings for tests: fast polls, quick retries; the CPU unless `IOTA_TEST_DEVICE` names
/// another device (`cuda:0` in a `--features cuda` build on a GPU machine).
pub fn miner_config(base: &str) -> MinerConfig {
    let mut c = MinerConfig::new(base);
    if let Ok(device) = std::env::var("IOTA_TEST_DEVICE") {
        c.device = DeviceSpec::parse(&device).expect("IOTA_TEST_DEVICE: cpu or cuda:N");
    }
    c.poll_interval = Duration::from_millis(50);
    c.memory_bytes = Some(8 << 30);
    c.retry = RetryPolicy {
        attempts: 4,
        base: Duration::from_millis(50),
        max: Duration::from_millis(500),
        timeout: Duration::from_secs(20),
    };
    c
}

/// A miner with hotkey `seed` (also its seed for data order and adversarial noise) that reports
/// `tokens_per_s` instead of measuring it, so that the orchestrator's stage assignment follows
/// the join order; waits until it has joined.
pub async fn joined(
    base: &str,
    seed: u8,
    tokens_per_s: f64,
    adversary: Option<Adversary>,
) -> MinerHandle {
    joined_with(miner_config(base), seed, tokens_per_s, adversary).await
}

/// [`joined`] with settings of its own (`cfg`, from [`miner_config`]).
pub async fn joined_with(
    mut cfg: MinerConfig,
    seed: u8,
    tokens_per_s: f64,
    adversary: Option<Adversary>,
) -> MinerHandle {
    cfg.tokens_per_s = Some(tokens_per_s);
    cfg.adversary = adversary;
    cfg.seed = u64::from(seed);
    let m = iota_miner::spawn(cfg, signer(seed));
    eventually("joined", Duration::from_secs(60), || async {
        m.status().stage.map(|_| ())
    })
    .await;
    m
}

/// A client for explorer routes that signs blob downloads as the registered hotkey `seed`.
pub async fn explorer(base: &str, seed: u8) -> ApiClient {
    ApiClient::connect(base, signer(seed), RetryPolicy::default())
        .await
        .expect("client")
}

/// The stages `epoch` starts with, rebuilt from the merge records, and their digests.
pub async fn epoch_start_stages(
    client: &ApiClient,
    run: &RunConfig,
    epoch: u64,
) -> (Vec<Stage>, Vec<String>) {
    iota_miner::eval::epoch_start_stages(client, run, epoch)
        .await
        .expect("epoch-start weights")
}

/// Mean loss of `epoch`'s start weights on held-out sequences of the run's corpus.
pub async fn held_out_loss(client: &ApiClient, run: &RunConfig, epoch: u64) -> f32 {
    iota_miner::eval::held_out_loss(client, run, epoch, None)
        .await
        .expect("held-out loss")
}

/// Waits until the run is in epoch `epoch` (all earlier epochs merged).
pub async fn wait_epoch(client: &ApiClient, epoch: u64, timeout: Duration) {
    eventually(&format!("epoch {epoch}"), timeout, || async {
        let st = client.status().await.ok()?;
        (st.epoch >= epoch).then_some(())
    })
    .await
}

/// Every partition of `epoch` is accepted, by its owners' agreement.
pub async fn assert_all_agreed(client: &ApiClient, run: &RunConfig, epoch: u64) {
    let parts = client.merge_status(epoch).await.expect("merge status");
    assert_eq!(
        parts.len() as u32,
        run.stages * run.partitions,
        "partitions of epoch {epoch}: {parts:?}"
    );
    for p in &parts {
        assert_eq!(p.state, PartitionState::Accepted, "{p:?}");
        assert_eq!(p.resolved_by.as_deref(), Some("agreement"), "{p:?}");
        let hashes: std::collections::HashSet<&str> = p
            .results
            .iter()
            .filter_map(|r| r.blake3.as_deref())
            .collect();
        assert_eq!(hashes.len(), 1, "owners disagree: {p:?}");
    }
}

/// A run being served: a fresh subnet, database, store and orchestrator, and its miners.
pub struct Swarm {
    pub orch: Running,
    /// An explorer client signing as the first miner's hotkey.
    pub client: ApiClient,
    pub miners: Vec<iota_miner::MinerHandle>,
    _chain: Chain,
    _store: tempfile::TempDir,
}

/// Serves `run` and spawns one miner per seed at once, all reporting the same throughput so
/// the stage choice spreads them evenly.
pub async fn swarm(seeds: &[u8], run: RunConfig) -> Swarm {
    let chain = chain_with(seeds, &[]).await;
    let db = fresh_db().await;
    let store = tempfile::tempdir().expect("store");
    let orch = start(config(&chain, &db, store.path(), run)).await;
    let client = explorer(&orch.base, seeds[0]).await;
    let miners = seeds
        .iter()
        .map(|s| {
            let mut cfg = miner_config(&orch.base);
            cfg.tokens_per_s = Some(1000.0);
            iota_miner::spawn(cfg, signer(*s))
        })
        .collect();
    Swarm {
        orch,
        client,
        miners,
        _chain: chain,
        _store: store,
    }
}

/// AdamW on every stage of `pipe` at the run's inner learning rate, each clipped to its stage's
/// share of the norm: what one process training the run's model steps with.
pub fn stage_optimizers(run: &RunConfig, model: &ModelConfig, pipe: &mut Pipeline) -> Vec<AdamW> {
    pipe.stages_mut()
        .iter()
        .enumerate()
        .map(|(k, stage)| {
            let cfg = AdamWConfig {
                lr: run.inner_lr,
                ..AdamWConfig::default()
            }
            .for_stage(model, k)
            .expect("adamw");
            AdamW::new(stage, cfg, LrSchedule::constant()).expect("adamw")
        })
        .collect()
}
