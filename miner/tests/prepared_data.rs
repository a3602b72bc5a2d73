//! A run that names a prepared dataset: miners and validators train on exactly its windows,
//! and refuse a missing copy, another dataset, or a tokenizer the model's vocabulary cannot hold.

use std::path::{Path, PathBuf};

use iota_model::data::prepare::{PrepareOptions, prepare};
use iota_model::{Dataset, ModelConfig, StageOptions, make_batch, train_bpe_tokenizer};
use iota_protocol::api::RunConfig;
use iota_trainer::{StageTrainer, run_dataset};

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("iota-miner-data-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).expect("tmp");
    d
}

/// A small English text, a 400-token tokenizer and the prepared dataset.
fn dataset(dir: &Path) -> String {
    let text = "The river ran quietly past the old mill, and the miller watched the water turn \
                the wheel. In the evening the children came down to the bank to throw stones \
                and count the ripples. Nobody remembered when the mill was built, but everyone \
                agreed it had always been there.\n";
    let docs: String = (0..300)
        .map(|i| serde_json::json!({ "text": format!("{i}. {text}") }).to_string() + "\n")
        .collect();
    let raw = dir.join("raw.jsonl");
    std::fs::write(&raw, docs).expect("write");
    let tok = dir.join("tokenizer.json");
    train_bpe_tokenizer(std::slice::from_ref(&raw), 400, &tok).expect("tokenizer");
    let opts = PrepareOptions {
        held_out_ppm: 100_000,
        ..PrepareOptions::default()
    };
    let (_, hash) = prepare(&[raw], &tok, &dir.join("ds"), &opts, &mut |_| {}).expect("prepare");
    hash
}

/// The local tiny run on `model`.
fn run_on(model: &ModelConfig, name: String, dataset: Option<String>) -> RunConfig {
    let mut run = iota_trainer::local_tiny_run("prepared", 8).expect("run");
    run.model = name;
    run.stage_params = (0..model.num_stages())
        .map(|k| model.stage_param_count(k).expect("params") as u64)
        .collect();
    run.dataset = dataset;
    run
}

#[test]
fn a_run_on_a_prepared_dataset_trains_its_windows() {
    let dir = tmp("trains");
    let hash = dataset(&dir);
    let ds_dir = dir.join("ds");
    // `tiny` with a vocabulary that holds the tokenizer.
    let mut model = ModelConfig::tiny();
    model.vocab_size = 512;
    let model_file = dir.join("model.json");
    std::fs::write(&model_file, model.to_json().expect("json")).expect("write");
    let run = run_on(&model, model_file.display().to_string(), Some(hash.clone()));

    let ds = run_dataset(&run, &model, Some(&ds_dir)).expect("dataset");
    assert_eq!(ds.vocab_size(), 400);
    let ids = run.sequence_ids(3);
    let want = make_batch(ds.as_ref(), &ids, &iota_model::Device::Cpu).expect("batch");
    // The batch is the dataset's windows, not the grammar's.
    let direct = iota_model::data::PreparedDataset::open(&ds_dir, Some(&hash), 32, run.init_seed)
        .expect("open");
    assert_eq!(
        want.inputs.to_vec2::<u32>().expect("ids")[0],
        direct.window(ids[0]).expect("window")[..32]
    );

    let mut t =
        StageTrainer::new(run.clone(), 0, StageOptions::cpu(), 8, Some(&ds_dir)).expect("trainer");
    for j in 0..run.partitions {
        t.load_partition(j, None).expect("init");
    }
    t.begin_epoch(0).expect("epoch");
    let out = t.forward(3, None).expect("forward");
    assert_eq!(out.tokens, u64::from(run.micro_batch * run.seq_len));

    // Without the folder, with another dataset's hash, or on a model whose vocabulary is
    // smaller than the tokenizer's: a clear refusal.
    let err = run_dataset(&run, &model, None)
        .err()
        .expect("no folder")
        .to_string();
    assert!(err.contains("--data-dir") && err.contains(&hash), "{err}");
    let other = run_on(&model, run.model.clone(), Some("ab".repeat(32)));
    let err = run_dataset(&other, &model, Some(&ds_dir))
        .err()
        .expect("another dataset")
        .to_string();
    assert!(err.contains("manifest.json"), "{err}");
    let tiny = ModelConfig::tiny();
    let small_vocab = run_on(&tiny, "tiny".into(), Some(hash));
    let err = StageTrainer::new(small_vocab, 0, StageOptions::cpu(), 8, Some(&ds_dir))
        .expect_err("vocabulary")
        .to_string();
    assert!(err.contains("400 tokens") && err.contains("64"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
