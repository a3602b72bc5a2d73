//! What a run's public config fixes for a stage: its model (checked against the run's shapes),
//! its training data, its initial weights.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use iota_model::data::PreparedDataset;
use iota_model::merge::flatten_range;
use iota_model::{Dataset, GrammarCorpus, ModelConfig, Stage, StageOptions};
use iota_protocol::api::RunConfig;
use iota_protocol::tensor::WireEncoding;

use crate::error::TrainerError;

/// The model config a run names, with the run's initialisation seed, checked against the
/// run's stage shapes so a miner never trains a model the orchestrator does not describe.
pub fn run_model(run: &RunConfig) -> Result<ModelConfig, TrainerError> {
    let mut model = ModelConfig::load(&run.model)?;
    model.init_seed = run.init_seed;
    if model.num_stages() != run.stages as usize {
        return Err(TrainerError::RunMismatch(format!(
            "model {:?} has {} stages, the run {}",
            run.model,
            model.num_stages(),
            run.stages
        )));
    }
    for (k, want) in run.stage_params.iter().enumerate() {
        let have = model.stage_param_count(k)? as u64;
        if have != *want {
            return Err(TrainerError::RunMismatch(format!(
                "stage {k} of {:?} has {have} parameters, the run {want}",
                run.model
            )));
        }
    }
    if model.boundary_dim() as u64 != u64::from(run.boundary_dim) {
        return Err(TrainerError::RunMismatch(format!(
            "boundary width {} against the run's {}",
            model.boundary_dim(),
            run.boundary_dim
        )));
    }
    Ok(model)
}

/// The embedded grammar corpus seeded by the run (the data of a run that names no dataset).
pub fn grammar_corpus(run: &RunConfig) -> Result<GrammarCorpus, TrainerError> {
    Ok(GrammarCorpus::new(run.init_seed, run.seq_len as usize)?)
}

/// Prepared datasets already opened by this process, shared by its trainers and replays so each
/// shard is mapped and hashed once.
type OpenKey = (PathBuf, String, usize, u64);
static OPEN: Mutex<Vec<(OpenKey, Arc<PreparedDataset>)>> = Mutex::new(Vec::new());

/// The prepared dataset in `dir` whose manifest hashes to `manifest`, windows of `seq_len`
/// tokens permuted by `seed`; opened once per process.
pub fn open_prepared(
    dir: &Path,
    manifest: &str,
    seq_len: usize,
    seed: u64,
) -> Result<Arc<PreparedDataset>, TrainerError> {
    let key = (
        dir.to_path_buf(),
        manifest.to_ascii_lowercase(),
        seq_len,
        seed,
    );
    let mut open = OPEN
        .lock()
        .map_err(|_| TrainerError::Internal("the dataset cache is poisoned".into()))?;
    if let Some((_, ds)) = open.iter().find(|(k, _)| *k == key) {
        return Ok(ds.clone());
    }
    let ds = Arc::new(PreparedDataset::open(dir, Some(manifest), seq_len, seed)?);
    open.push((key, ds.clone()));
    Ok(ds)
}

/// The run's training data: the prepared dataset it names, read from `data_dir`, or the
/// embedded grammar when it names none. The model's vocabulary must hold the tokenizer's.
pub fn run_dataset(
    run: &RunConfig,
    model: &ModelConfig,
    data_dir: Option<&Path>,
) -> Result<Arc<dyn Dataset>, TrainerError> {
    let ds: Arc<dyn Dataset> = match (&run.dataset, data_dir) {
        (None, _) => Arc::new(grammar_corpus(run)?),
        (Some(hash), Some(dir)) => open_prepared(dir, hash, run.seq_len as usize, run.init_seed)?,
        (Some(hash), None) => {
            return Err(TrainerError::Config(format!(
                "the run trains on the prepared dataset {hash}: give its folder with --data-dir"
            )));
        }
    };
    if ds.vocab_size() > model.vocab_size {
        return Err(TrainerError::RunMismatch(format!(
            "the data's tokenizer has {} tokens, more than model {:?}'s vocabulary of {}",
            ds.vocab_size(),
            model.name,
            model.vocab_size
        )));
    }
    Ok(ds)
}

/// Initial weights of `range` of `stage`, from the run's seed.
pub fn initial_range(
    model: &ModelConfig,
    stage: u32,
    range: Range<usize>,
) -> Result<Vec<f32>, TrainerError> {
    let s = Stage::new(model, stage as usize, StageOptions::cpu())?;
    Ok(flatten_range(&s, range)?)
}

/// A run of the `tiny` model for one machine: 3 stages, 2 partitions each, short phases.
pub fn local_tiny_run(name: &str, samples_per_epoch: u64) -> Result<RunConfig, TrainerError> {
    let model = ModelConfig::tiny();
    let stage_params = (0..model.num_stages())
        .map(|k| model.stage_param_count(k).map(|n| n as u64))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(RunConfig {
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
        // IOTA ramps the momentum from 0.5; epochs of a few inner steps overshoot at 0.9.
        outer_momentum: 0.5,
        // The inner AdamW starts afresh each epoch (so a validator can replay an epoch alone),
        // and its first steps move every weight by about the learning rate. With the outer
        // momentum on top, 5e-3 made the held-out loss rise in the third epoch of 2 miners per
        // stage and 24 samples in 2 of 16 runs; 3e-3 did not in 20.
        inner_lr: 3e-3,
        inner_steps_every: 2,
        dataset: None,
        stage_memory: Vec::new(),
        sparse: None,
    })
}
