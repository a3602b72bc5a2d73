//! Shared set-up of the miner's integration tests: the orchestrator's test harness (fresh
//! PostgreSQL database, localnet subnet, orchestrator in-process) with a real `tiny` run, and
//! helpers that read what the run produced.

#![allow(dead_code)]

#[path = "../../../orchestrator/tests/common/mod.rs"]
pub mod common;

use std::time::Duration;

use iota_miner::MinerConfig;
use iota_model::merge::{digest_f32, flatten_params, load_range};
use iota_model::{Device, ModelConfig, Pipeline, Stage, StageOptions, make_batch};
use iota_protocol::api::{PartitionState, RunConfig};
use iota_protocol::client::{ApiClient, RetryPolicy};
use iota_protocol::tensor::{WireEncoding, decode_merged};

pub use common::*;

/// A real run of the `tiny` model: 3 stages, 2 partitions each, small epochs.
pub fn tiny_run(name: &str, samples_per_epoch: u64) -> RunConfig {
    let model = ModelConfig::tiny();
    let stage_params = (0..model.num_stages())
        .map(|k| model.stage_param_count(k).expect("stage") as u64)
        .collect();
    RunConfig {
        name: name.into(),
        model: "tiny".into(),
        stages: model.num_stages() as u32,
        stage_params,
        partitions: 2,
        micro_batch: 4,
        seq_len: 32,
        boundary_dim: model.boundary_dim() as u32,
        wire: WireEncoding::Int8,
        samples_per_epoch,
        max_in_flight: 4,
        training_s: 90,
        uploading_s: 30,
        merging_s: 30,
        merge_round_s: 10,
        lease_s: 10,
        heartbeat_timeout_s: 6,
        retention_epochs: 100,
        init_seed: 7,
        outer_lr: 0.7,
        // IOTA ramps the momentum from 0.5; tiny epochs of a few inner steps overshoot at 0.9.
        outer_momentum: 0.5,
        inner_lr: 5e-3,
        inner_steps_every: 2,
    }
}

/// Miner settings for tests: fast polls, quick retries.
pub fn miner_config(base: &str) -> MinerConfig {
    let mut c = MinerConfig::new(base);
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

/// A client for explorer routes that signs blob downloads as the registered hotkey `seed`.
pub async fn explorer(base: &str, seed: u8) -> ApiClient {
    ApiClient::connect(base, signer(seed), RetryPolicy::default())
        .await
        .expect("client")
}

/// The start weights of `epoch` rebuilt from the merge records (each partition's latest
/// accepted merge before `epoch`, initial weights where none): the stages and their digests.
/// Needs every merged blob kept (`retention_epochs` above the epochs of the test).
pub async fn epoch_start_stages(
    client: &ApiClient,
    run: &RunConfig,
    epoch: u64,
) -> (Vec<Stage>, Vec<String>) {
    let mut model = ModelConfig::load(&run.model).expect("model");
    model.init_seed = run.init_seed;
    let mut latest = std::collections::BTreeMap::new();
    for e in 0..epoch {
        for p in client.merge_status(e).await.expect("merge status") {
            if p.state == PartitionState::Accepted
                && let Some(blob) = p.accepted
            {
                latest.insert((p.stage, p.partition), blob);
            }
        }
    }
    let mut stages = Vec::new();
    let mut digests = Vec::new();
    for k in 0..run.stages {
        let stage = Stage::new(&model, k as usize, StageOptions::cpu()).expect("stage");
        for j in 0..run.partitions {
            let Some(blob) = latest.get(&(k, j)) else {
                continue;
            };
            let range = run.partition_range(k, j).expect("range");
            let bytes = client.download(blob).await.expect("download");
            let (values, _) = decode_merged(&bytes, range.end - range.start).expect("merged");
            load_range(&stage, range.start as usize..range.end as usize, &values).expect("load");
        }
        digests.push(
            digest_f32(&flatten_params(&stage).expect("flat"))
                .to_hex()
                .to_string(),
        );
        stages.push(stage);
    }
    (stages, digests)
}

/// Mean loss of the merged model on held-out sequences of the run's corpus.
pub async fn held_out_loss(client: &ApiClient, run: &RunConfig, epoch: u64) -> f32 {
    let (stages, _) = epoch_start_stages(client, run, epoch).await;
    let model = stages[0].config().clone();
    let ds = iota_miner::trainer::run_dataset(run, &model).expect("dataset");
    let pipe = Pipeline::from_stages(stages).expect("pipeline");
    let batch = make_batch(&ds, &run.held_out_ids(32), &Device::Cpu).expect("batch");
    pipe.eval_loss(&batch.inputs, &batch.targets).expect("eval")
}

/// Waits until the run is in epoch `epoch` (all earlier epochs merged).
pub async fn wait_epoch(client: &ApiClient, epoch: u64, timeout: Duration) {
    eventually(&format!("epoch {epoch}"), timeout, || async {
        let st = client.status().await.ok()?;
        (st.epoch >= epoch).then_some(())
    })
    .await
}

/// Every partition of `epoch` is accepted, and with the two owners' agreement.
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
        let hashes: std::collections::HashSet<&str> =
            p.results.iter().map(|r| r.blake3.as_str()).collect();
        assert_eq!(hashes.len(), 1, "owners disagree: {p:?}");
    }
}
