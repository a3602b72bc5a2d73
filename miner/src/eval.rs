//! Evaluating a run from its public records: the weights an epoch starts with, rebuilt from the
//! merge records, and their loss on held-out sequences. For operators, the local subnet and
//! tests; miners themselves never need it.

use std::collections::BTreeMap;

use iota_model::merge::{digest_f32, flatten_params, load_range};
use iota_model::{Device, ModelConfig, Pipeline, Stage, StageOptions, make_batch};
use iota_protocol::api::{PartitionState, RunConfig};
use iota_protocol::client::ApiClient;
use iota_protocol::tensor::decode_merged;

use crate::error::MinerError;
use iota_trainer::run_dataset;
use iota_trainer::sparse::SparseWeights;

/// The stages `epoch` starts with (each partition's latest accepted merge before `epoch`,
/// initial weights where none) and the BLAKE3 (hex) of each stage's flat weights. Merged blobs
/// must still be in the store (`retention_epochs`).
pub async fn epoch_start_stages(
    client: &ApiClient,
    run: &RunConfig,
    epoch: u64,
) -> Result<(Vec<Stage>, Vec<String>), MinerError> {
    let mut model = ModelConfig::load(&run.model)?;
    model.init_seed = run.init_seed;
    if run.sparse.is_some() {
        return sparse_start_stages(client, run, &model, epoch).await;
    }
    let mut latest = BTreeMap::new();
    for e in 0..epoch {
        for p in client.merge_status(e).await? {
            if p.state == PartitionState::Accepted
                && let Some(blob) = p.accepted
            {
                latest.insert((p.stage, p.partition), blob);
            }
        }
    }
    let mut merged = Vec::with_capacity(latest.len());
    for ((k, j), blob) in latest {
        merged.push((k, j, client.download(&blob).await?));
    }
    // Building and loading the stages is seconds of CPU for a larger model: off the runtime.
    let run = run.clone();
    tokio::task::spawn_blocking(move || build_stages(&run, &model, &merged))
        .await
        .map_err(|e| MinerError::Internal(e.to_string()))?
}

/// A sparse run's stages at the start of `epoch`: every stage's initial weights with each
/// earlier epoch's accepted updates applied in turn.
async fn sparse_start_stages(
    client: &ApiClient,
    run: &RunConfig,
    model: &ModelConfig,
    epoch: u64,
) -> Result<(Vec<Stage>, Vec<String>), MinerError> {
    let mut folded = (0..run.stages)
        .map(|k| SparseWeights::initial(run, k))
        .collect::<Result<Vec<_>, _>>()?;
    for e in 0..epoch {
        let mut updates = vec![vec![None; run.partitions as usize]; run.stages as usize];
        for p in client.merge_status(e).await? {
            if p.state == PartitionState::Accepted
                && let Some(blob) = p.accepted
                && let Some(slot) = updates
                    .get_mut(p.stage as usize)
                    .and_then(|u| u.get_mut(p.partition as usize))
            {
                *slot = Some(client.download(&blob).await?);
            }
        }
        for (k, (w, u)) in folded.iter_mut().zip(&updates).enumerate() {
            let refs: Vec<Option<&[u8]>> = u.iter().map(|b| b.as_deref()).collect();
            w.advance(run, k as u32, &refs)
                .map_err(|e| MinerError::BadInput(format!("accepted update of stage {k}: {e}")))?;
        }
    }
    let model = model.clone();
    tokio::task::spawn_blocking(move || {
        let mut stages = Vec::new();
        let mut digests = Vec::new();
        for (k, w) in folded.iter().enumerate() {
            let stage = Stage::new(&model, k, StageOptions::cpu())?;
            load_range(&stage, 0..w.weights.len(), &w.weights)?;
            digests.push(digest_f32(&w.weights).to_hex().to_string());
            stages.push(stage);
        }
        Ok((stages, digests))
    })
    .await
    .map_err(|e| MinerError::Internal(e.to_string()))?
}

/// Every stage at its initial weights, with the `(stage, partition, merged bytes)` loaded over
/// them, and the BLAKE3 of each stage's flat weights.
fn build_stages(
    run: &RunConfig,
    model: &ModelConfig,
    merged: &[(u32, u32, bytes::Bytes)],
) -> Result<(Vec<Stage>, Vec<String>), MinerError> {
    let mut stages = Vec::new();
    let mut digests = Vec::new();
    for k in 0..run.stages {
        let stage = Stage::new(model, k as usize, StageOptions::cpu())?;
        for (_, j, bytes) in merged.iter().filter(|(s, _, _)| *s == k) {
            let range = run
                .partition_range(k, *j)
                .ok_or_else(|| MinerError::RunMismatch(format!("no partition {k}/{j}")))?;
            let (values, _) = decode_merged(bytes, range.end - range.start)
                .map_err(|e| MinerError::BadInput(format!("merged partition {k}/{j}: {e}")))?;
            load_range(&stage, range.start as usize..range.end as usize, &values)?;
        }
        digests.push(digest_f32(&flatten_params(&stage)?).to_hex().to_string());
        stages.push(stage);
    }
    Ok((stages, digests))
}

/// Mean loss of `epoch`'s start weights on 32 held-out sequences of the run's corpus (fewer
/// when a prepared dataset holds fewer), read from `data_dir` when the run names a dataset.
pub async fn held_out_loss(
    client: &ApiClient,
    run: &RunConfig,
    epoch: u64,
    data_dir: Option<&std::path::Path>,
) -> Result<f32, MinerError> {
    let (stages, _) = epoch_start_stages(client, run, epoch).await?;
    let model = stages
        .first()
        .map(|s| s.config().clone())
        .ok_or_else(|| MinerError::RunMismatch("a run without stages".into()))?;
    let run = run.clone();
    let data_dir = data_dir.map(std::path::Path::to_path_buf);
    tokio::task::spawn_blocking(move || {
        let ds = run_dataset(&run, &model, data_dir.as_deref())?;
        let pipe = Pipeline::from_stages(stages)?;
        let n = ds.held_out_windows().unwrap_or(32).min(32);
        if n == 0 {
            return Err(MinerError::RunMismatch(
                "the run's dataset holds no held-out window".into(),
            ));
        }
        let batch = make_batch(ds.as_ref(), &run.held_out_ids(n), &Device::Cpu)?;
        Ok(pipe.eval_loss(&batch.inputs, &batch.targets)?)
    })
    .await
    .map_err(|e| MinerError::Internal(e.to_string()))?
}

/// A short continuation sampled (seeded) from `epoch`'s start weights, prompted by the first
/// `prompt_tokens` tokens of the run's first held-out window: `(prompt, continuation)`. For a
/// run that names a dataset, read from `data_dir` with the dataset's tokenizer.
pub async fn sample_text(
    client: &ApiClient,
    run: &RunConfig,
    epoch: u64,
    data_dir: &std::path::Path,
    prompt_tokens: usize,
    max_new_tokens: usize,
) -> Result<(String, String), MinerError> {
    let (stages, _) = epoch_start_stages(client, run, epoch).await?;
    let run = run.clone();
    let data_dir = data_dir.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let hash = run.dataset.as_deref().ok_or_else(|| {
            MinerError::RunMismatch("the run names no dataset and so no tokenizer".into())
        })?;
        let ds = iota_trainer::open_prepared(&data_dir, hash, run.seq_len as usize, run.init_seed)?;
        let tokenizer = tokenizers::Tokenizer::from_file(ds.tokenizer_path())
            .map_err(|e| MinerError::BadInput(format!("the dataset's tokenizer: {e}")))?;
        let window = iota_model::Dataset::window(ds.as_ref(), run.held_out_ids(1)[0])?;
        let prompt = tokenizer
            .decode(&window[..prompt_tokens.min(window.len())], true)
            .map_err(|e| MinerError::BadInput(format!("decoding the prompt: {e}")))?;
        let opts = iota_model::generate::GenerateOptions::sampled(max_new_tokens, 0.8, 0.95, 0);
        let text = iota_model::generate::generate(&stages, &tokenizer, &prompt, &opts)?;
        Ok((prompt, text))
    })
    .await
    .map_err(|e| MinerError::Internal(e.to_string()))?
}

/// Writes the weights `epoch` starts with (the merges of every earlier epoch) as one export
/// folder (`iota_model::export`), with `tokenizer_json` when given; returns each stage's BLAKE3.
pub async fn export_epoch(
    client: &ApiClient,
    run: &RunConfig,
    epoch: u64,
    tokenizer_json: Option<Vec<u8>>,
    out: &std::path::Path,
) -> Result<Vec<String>, MinerError> {
    let (stages, digests) = epoch_start_stages(client, run, epoch).await?;
    let out = out.to_path_buf();
    tokio::task::spawn_blocking(move || {
        iota_model::export::write_export(&out, &stages, tokenizer_json.as_deref())
    })
    .await
    .map_err(|e| MinerError::Internal(e.to_string()))??;
    Ok(digests)
}
