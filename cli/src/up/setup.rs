//! What a local run trains: the model re-split by `--stages`, the data prepared from `--data`,
//! and the run config every party derives its shapes from.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use iota_model::ModelConfig;
use iota_protocol::api::{RunConfig, SparseEncoding};

/// The model `localnet up` trains: `--model` re-split by `--stages`, and the name every party
/// loads it by (a preset's name, or a JSON file in the run directory).
pub struct UpModel {
    pub config: ModelConfig,
    pub name: String,
}

/// Sequence length of the local run; the model must accept it.
const SEQ_LEN: usize = 32;

/// The prepared dataset of a local run: its folder and its manifest's BLAKE3.
pub struct UpData {
    pub dir: PathBuf,
    pub manifest: String,
    pub vocab_size: usize,
}

/// Tokenizer size trained for raw `--data` given without `--tokenizer`.
const UP_TOKENIZER_VOCAB: usize = 1024;
/// About the most text that tokenizer is trained on: its merges are settled long before, and
/// `--data` may be a real corpus of gigabytes.
const UP_TOKENIZER_SAMPLE_BYTES: u64 = 4 << 20;

/// Every k-th of `files` (path, size), k chosen so that they add up to about `budget` bytes: a
/// sample spread over the whole corpus rather than its first folder. All of them when they fit.
fn spread_sample(files: &[(PathBuf, u64)], budget: u64) -> Vec<PathBuf> {
    let total: u64 = files.iter().map(|(_, size)| size).sum();
    let stride = total.div_ceil(budget.max(1)).max(1) as usize;
    files
        .iter()
        .step_by(stride)
        .map(|(p, _)| p.clone())
        .collect()
}

/// `--data`: a prepared dataset as is, or raw text prepared into `dir/data` (replacing what an
/// earlier run left there).
pub fn up_data(
    data: &[PathBuf],
    tokenizer: Option<&Path>,
    dir: &Path,
) -> anyhow::Result<Option<UpData>> {
    use iota_model::data::prepare::{MANIFEST_FILE, PrepareOptions, prepare};
    let prepared = match data {
        [] => return Ok(None),
        [one] if one.join(MANIFEST_FILE).is_file() => {
            if tokenizer.is_some() {
                anyhow::bail!(
                    "--tokenizer is for raw --data: the prepared dataset {} carries its own",
                    one.display()
                );
            }
            one.clone()
        }
        raw => {
            let files = iota_model::data::sources::list_inputs(raw).context("--data")?;
            let tok = match tokenizer {
                Some(t) => t.to_path_buf(),
                None => {
                    let mut plain = Vec::new();
                    for f in &files {
                        if f.extension().is_some_and(|e| e == "txt" || e == "jsonl") {
                            let size = std::fs::metadata(f)
                                .with_context(|| format!("--data {}", f.display()))?
                                .len();
                            plain.push((f.clone(), size));
                        }
                    }
                    anyhow::ensure!(
                        !plain.is_empty(),
                        "--data has no .txt or .jsonl file to train a tokenizer on: give one \
                         with --tokenizer"
                    );
                    let sample = spread_sample(&plain, UP_TOKENIZER_SAMPLE_BYTES);
                    let t = dir.join("tokenizer.json");
                    println!(
                        "training a {UP_TOKENIZER_VOCAB}-token BPE tokenizer on {} of --data's {} \
                         text files",
                        sample.len(),
                        plain.len()
                    );
                    iota_model::train_bpe_tokenizer(&sample, UP_TOKENIZER_VOCAB, &t)?;
                    t
                }
            };
            let out = dir.join("data");
            if out.exists() {
                std::fs::remove_dir_all(&out)
                    .with_context(|| format!("removing the earlier {}", out.display()))?;
            }
            println!("preparing --data into {}", out.display());
            // A twentieth held out: a local corpus is small, and the report evaluates on it.
            let opts = PrepareOptions {
                held_out_ppm: 50_000,
                ..PrepareOptions::default()
            };
            let (m, _) = prepare(raw, &tok, &out, &opts, &mut |_| {})?;
            println!(
                "  {} training and {} held-out tokens",
                m.train.tokens, m.held_out.tokens
            );
            out
        }
    };
    let ds = iota_model::data::PreparedDataset::open(&prepared, None, SEQ_LEN, 0)
        .with_context(|| format!("--data {}", prepared.display()))?;
    ds.verify_all()?;
    anyhow::ensure!(
        ds.held_out_count() > 0,
        "--data {}: the held-out split has no window of {} tokens (more text, or a larger \
         held-out fraction when preparing)",
        prepared.display(),
        SEQ_LEN + 1
    );
    Ok(Some(UpData {
        dir: std::fs::canonicalize(&prepared)?,
        manifest: ds.manifest_blake3().to_owned(),
        vocab_size: ds.manifest().vocab_size as usize,
    }))
}

/// Checks `--model` and `--stages`; writes the effective config to `dir/model.json` when it is
/// not a preset as is. A preset's vocabulary is widened (to a multiple of 64) to `min_vocab`.
pub fn up_model(
    model: &str,
    stages: Option<u32>,
    dir: &Path,
    min_vocab: usize,
) -> anyhow::Result<UpModel> {
    let preset = matches!(model, "tiny" | "small");
    if !preset && !Path::new(model).is_file() {
        anyhow::bail!(
            "--model {model:?}: expected `tiny`, `small` or a model config JSON file (no such file)"
        );
    }
    let mut config = ModelConfig::load(model).with_context(|| format!("--model {model}"))?;
    let widened = config.vocab_size < min_vocab;
    if widened {
        anyhow::ensure!(
            preset,
            "--model {model}: a vocabulary of {} cannot hold the data's {min_vocab} tokens",
            config.vocab_size
        );
        config.vocab_size = min_vocab.div_ceil(64) * 64;
    }
    let blocks = config.n_layers();
    let own_stages = config.num_stages();
    if let Some(n) = stages {
        let n = n as usize;
        // A pipeline: activations cross at least one stage boundary.
        if n < 2 {
            anyhow::bail!("--stages {n}: the pipeline needs at least 2 stages");
        }
        if n > blocks {
            anyhow::bail!(
                "--stages {n}: model {:?} has {blocks} blocks and every stage needs at least one \
                 (at most --stages {blocks})",
                config.name
            );
        }
        // The model's own split when the count matches; otherwise blocks spread as evenly as
        // they go, the earlier stages taking the remainder.
        if n != own_stages {
            let split = (0..n)
                .map(|k| blocks / n + usize::from(k < blocks % n))
                .collect();
            config = config.with_stages(split);
        }
    }
    config
        .validate()
        .with_context(|| format!("--model {model} with --stages {stages:?}"))?;
    if config.max_seq_len < SEQ_LEN {
        anyhow::bail!(
            "--model {model}: max_seq_len {} is below the local run's {SEQ_LEN} tokens",
            config.max_seq_len
        );
    }
    if preset && config.num_stages() == own_stages && !widened {
        return Ok(UpModel {
            config,
            name: model.to_owned(),
        });
    }
    let path = dir.join("model.json");
    std::fs::write(&path, config.to_json()?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(UpModel {
        config,
        name: path.to_string_lossy().into_owned(),
    })
}

/// The local run of `model` on `data`: the tiny run's phases and optimiser, the model's shapes;
/// with `sparse`, compressed pseudo-gradients and no outer momentum (a sparse merge applies what
/// each miner has owed for several epochs at once, and momentum on top of that overshoots).
pub(super) fn local_run(
    model: &UpModel,
    samples_per_epoch: u64,
    data: Option<&UpData>,
    sparse: Option<SparseEncoding>,
) -> anyhow::Result<RunConfig> {
    let mut run = iota_trainer::local_tiny_run("localnet-up", samples_per_epoch)?;
    let m = &model.config;
    run.model = model.name.clone();
    run.stages = m.num_stages() as u32;
    run.stage_params = (0..m.num_stages())
        .map(|k| m.stage_param_count(k).map(|n| n as u64))
        .collect::<Result<Vec<_>, _>>()?;
    run.boundary_dim = u32::try_from(m.boundary_dim())?;
    run.seq_len = SEQ_LEN as u32;
    run.stage_memory = (0..m.num_stages())
        .map(|k| iota_model::memory::miner_stage_bytes(m, k, run.micro_batch as usize, SEQ_LEN))
        .collect::<Result<Vec<_>, _>>()?;
    run.dataset = data.map(|d| d.manifest.clone());
    if sparse.is_some() {
        run.outer_lr = 1.0;
        run.outer_momentum = 0.0;
    }
    run.set_sparse(sparse);
    run.validate().map_err(anyhow::Error::msg)?;
    // The corpus must fit the vocabulary; say so now rather than in every miner.
    iota_trainer::run_dataset(&run, m, data.map(|d| d.dir.as_path()))
        .with_context(|| format!("--model {}", m.name))?;
    Ok(run)
}

/// The grammar corpus's entropy floor, for a run on it; real text has no known floor.
pub(super) fn entropy_floor(run: &RunConfig) -> anyhow::Result<Option<f64>> {
    Ok(match run.dataset {
        None => Some(iota_trainer::grammar_corpus(run)?.entropy_floor()),
        Some(_) => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tokenizer_sample_is_spread_over_the_corpus_and_near_its_budget() {
        use std::path::PathBuf;
        let files: Vec<(PathBuf, u64)> = (0..100)
            .map(|i| (PathBuf::from(format!("{i:03}.txt")), 1000))
            .collect();
        let names = |s: Vec<PathBuf>| -> Vec<String> {
            s.iter().map(|p| p.display().to_string()).collect()
        };
        assert_eq!(spread_sample(&files, 1 << 30).len(), 100, "all fit");
        let sample = names(spread_sample(&files, 25_000));
        assert_eq!(sample.len(), 25);
        assert_eq!(sample[..3], ["000.txt", "004.txt", "008.txt"]);
        assert_eq!(sample.last().map(String::as_str), Some("096.txt"));
        let one = names(spread_sample(&files, 1));
        assert_eq!(one, ["000.txt"]);
        assert!(spread_sample(&[], 10).is_empty());
    }

    fn err(model: &str, stages: Option<u32>, dir: &Path) -> String {
        match up_model(model, stages, dir, 0) {
            Ok(m) => panic!("{model} {stages:?} accepted: {:?}", m.config.stages),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn model_and_stages_flags() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        // Presets as they are keep their names.
        let m = up_model("tiny", None, d, 0).expect("tiny");
        assert_eq!(
            (m.name.as_str(), m.config.stages.clone()),
            ("tiny", vec![1, 1, 1])
        );
        let m = up_model("tiny", Some(3), d, 0).expect("tiny/3");
        assert_eq!(m.name, "tiny");
        let m = up_model("small", None, d, 0).expect("small");
        assert_eq!(m.name, "small");
        // A re-split goes to a file every party loads.
        let m = up_model("tiny", Some(2), d, 0).expect("tiny/2");
        assert_eq!(m.config.stages, vec![2, 1]);
        assert_eq!(
            ModelConfig::load(&m.name).expect("written config"),
            m.config
        );
        let m = up_model("small", Some(3), d, 0).expect("small/3");
        assert_eq!(
            (m.name.as_str(), m.config.stages.clone()),
            ("small", vec![2, 4, 2])
        );
        let m5 = up_model("small", Some(5), d, 0).expect("small/5");
        assert_eq!(m5.config.stages, vec![2, 2, 2, 1, 1]);
        let run = local_run(&m5, 8, None, None).expect("run");
        assert_eq!(run.stages, 5);
        assert_eq!(iota_trainer::run_model(&run).expect("miners load it"), {
            let mut c = m5.config.clone();
            c.init_seed = run.init_seed;
            c
        });
        // Errors that say what to change.
        assert!(err("tiny", Some(0), d).contains("at least 2 stages"));
        assert!(err("tiny", Some(1), d).contains("at least 2 stages"));
        let e = err("tiny", Some(4), d);
        assert!(
            e.contains("3 blocks") && e.contains("at most --stages 3"),
            "{e}"
        );
        let e = err("huge", None, d);
        assert!(e.contains("tiny") && e.contains("no such file"), "{e}");
        let bad = d.join("bad.json");
        std::fs::write(&bad, "{\"name\": 1}").expect("write");
        assert!(err(bad.to_str().expect("utf-8"), None, d).contains("--model"));
        // A model file works, re-split or not.
        let file = d.join("mine.json");
        let mut cfg = ModelConfig::tiny().with_stages(vec![1, 1]);
        cfg.name = "mine".into();
        std::fs::write(&file, cfg.to_json().expect("json")).expect("write");
        let m = up_model(file.to_str().expect("utf-8"), None, d, 0).expect("file");
        assert_eq!(m.config.stages, vec![1, 1]);
        let three = d.join("three.json");
        let mut cfg = ModelConfig::tiny().with_stages(vec![1, 1, 1, 1]);
        cfg.name = "four-blocks".into();
        std::fs::write(&three, cfg.to_json().expect("json")).expect("write");
        let m = up_model(three.to_str().expect("utf-8"), Some(3), d, 0).expect("file/3");
        assert_eq!(m.config.stages, vec![2, 1, 1]);
        // The corpus must fit the vocabulary.
        let small_vocab = d.join("v.json");
        std::fs::write(
            &small_vocab,
            ModelConfig::tiny()
                .with_vocab_size(8)
                .to_json()
                .expect("json"),
        )
        .expect("write");
        let m = up_model(small_vocab.to_str().expect("utf-8"), None, d, 0).expect("valid shape");
        assert!(local_run(&m, 8, None, None).is_err());
    }

    #[test]
    fn a_sparse_local_run_turns_the_outer_momentum_off_and_counts_the_miners_extra_memory() {
        let dir = tempfile::tempdir().expect("dir");
        let m = up_model("tiny", None, dir.path(), 0).expect("tiny");
        let dense = local_run(&m, 8, None, None).expect("dense");
        let top = SparseEncoding::new(512, 16);
        let sparse = local_run(&m, 8, None, Some(top)).expect("sparse");
        assert_eq!((dense.sparse, sparse.sparse), (None, Some(top)));
        assert!(dense.outer_momentum > 0.0);
        assert_eq!((sparse.outer_lr, sparse.outer_momentum), (1.0, 0.0));
        for ((d, s), p) in dense
            .stage_memory
            .iter()
            .zip(&sparse.stage_memory)
            .zip(&sparse.stage_params)
        {
            assert_eq!(*s, d + 8 * p);
        }
        sparse.validate().expect("a valid run");
        // A merged update keeps at least what an upload does.
        let fewer = SparseEncoding {
            merged_k: Some(8),
            ..top
        };
        let e = local_run(&m, 8, None, Some(fewer)).unwrap_err().to_string();
        assert!(e.contains("merged updates keep 16 to 512"), "{e}");
    }

    #[test]
    fn a_preset_widens_its_vocabulary_for_the_data_and_a_file_does_not() {
        let dir = tempfile::tempdir().expect("dir");
        let d = dir.path();
        let m = up_model("tiny", None, d, 400).expect("tiny for 400 tokens");
        assert_eq!(m.config.vocab_size, 448);
        assert_eq!(m.name, d.join("model.json").to_string_lossy());
        let written = ModelConfig::load(&m.name).expect("written config");
        assert_eq!(written.vocab_size, 448);
        // Already wide enough: the preset itself.
        assert_eq!(
            up_model("small", None, d, 400).expect("small").name,
            "small"
        );
        let file = d.join("mine.json");
        std::fs::write(&file, ModelConfig::tiny().to_json().expect("json")).expect("write");
        let err = up_model(file.to_str().expect("utf-8"), None, d, 400)
            .err()
            .expect("a file's vocabulary is the user's")
            .to_string();
        assert!(err.contains("400 tokens"), "{err}");
    }
}
