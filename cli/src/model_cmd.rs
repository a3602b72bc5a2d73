//! `iota model export | generate | eval`: the trained model out of a run, and put to use.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use iota_model::data::PreparedDataset;
use iota_model::generate::GenerateOptions;
use iota_model::{Dataset as _, StageOptions};
use iota_protocol::client::{ApiClient, RetryPolicy};

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The orchestrator's base URL.
    #[arg(long = "orchestrator.url", env = "IOTA_ORCHESTRATOR_URL")]
    orchestrator_url: String,
    /// The epoch whose starting weights (every earlier epoch's merges) to export; default: the
    /// run's current epoch, i.e. the latest merged weights.
    #[arg(long, env = "IOTA_EXPORT_EPOCH")]
    epoch: Option<u64>,
    /// The folder to write (`model.safetensors`, `config.json`, `tokenizer.json`).
    #[arg(long, env = "IOTA_EXPORT_OUT")]
    out: PathBuf,
    /// The run's prepared dataset, whose tokenizer goes into the export (checked against the
    /// run's manifest hash).
    #[arg(long = "data-dir", env = "IOTA_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// A registered hotkey: the merged weights are served to members of the subnet only.
    #[command(flatten)]
    wallet: iota_chain::wallet::cli::WalletArgs,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// An export folder (`iota model export`).
    #[arg(long, env = "IOTA_CHECKPOINT")]
    checkpoint: PathBuf,
    /// The text to continue.
    #[arg(long, env = "IOTA_PROMPT")]
    prompt: String,
    /// Tokens to generate at most.
    #[arg(long, env = "IOTA_MAX_NEW_TOKENS", default_value_t = 64)]
    max_new_tokens: usize,
    /// 0: greedy; otherwise logits are divided by it before sampling.
    #[arg(long, env = "IOTA_TEMPERATURE", default_value_t = 0.0)]
    temperature: f64,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches this.
    #[arg(long, env = "IOTA_TOP_P", default_value_t = 1.0)]
    top_p: f64,
    /// Seed of the sampler.
    #[arg(long, env = "IOTA_SEED", default_value_t = 0)]
    seed: u64,
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// An export folder (`iota model export`).
    #[arg(long, env = "IOTA_CHECKPOINT")]
    checkpoint: PathBuf,
    /// A prepared dataset made with the export's tokenizer; its held-out split is scored.
    #[arg(long, env = "IOTA_DATA_DIR")]
    data: PathBuf,
    /// Tokens predicted per window.
    #[arg(long, env = "IOTA_SEQ_LEN", default_value_t = 128)]
    seq_len: usize,
    /// Held-out windows scored at most (the first ones).
    #[arg(long, env = "IOTA_EVAL_WINDOWS", default_value_t = 256)]
    windows: u64,
}

pub async fn export(a: ExportArgs) -> anyhow::Result<()> {
    let password = iota_chain::wallet::PasswordSource::EnvOrPrompt;
    let hotkey = a.wallet.wallet()?.hotkey(&password)?;
    let client = ApiClient::connect(
        &a.orchestrator_url,
        Arc::new(hotkey.as_pair().clone()),
        RetryPolicy::default(),
    )
    .await
    .with_context(|| format!("connecting to {}", a.orchestrator_url))?;
    let run = client.run_info().await?.config;
    let epoch = match a.epoch {
        Some(e) => e,
        None => client.status().await?.epoch,
    };
    let tokenizer = tokenizer_of(&run, a.data_dir.as_deref())?;
    let digests = iota_miner::eval::export_epoch(&client, &run, epoch, tokenizer, &a.out).await?;
    println!(
        "wrote {}: the weights epoch {epoch} starts with, {} stages (BLAKE3 {})",
        a.out.display(),
        digests.len(),
        digests.join(", ")
    );
    Ok(())
}

/// The tokenizer of the run's dataset, from a local copy checked against the run.
pub fn tokenizer_of(
    run: &iota_protocol::api::RunConfig,
    data_dir: Option<&Path>,
) -> anyhow::Result<Option<Vec<u8>>> {
    match (&run.dataset, data_dir) {
        (Some(hash), Some(dir)) => {
            let ds = PreparedDataset::open(dir, Some(hash), run.seq_len as usize, 0)?;
            let path = ds.tokenizer_path();
            Ok(Some(
                std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
            ))
        }
        (Some(hash), None) => {
            println!(
                "the run trains on dataset {hash}: give its folder with --data-dir to include \
                 the tokenizer"
            );
            Ok(None)
        }
        (None, Some(_)) => anyhow::bail!("--data-dir: the run names no dataset"),
        (None, None) => Ok(None),
    }
}

pub fn generate(a: GenerateArgs) -> anyhow::Result<()> {
    let ex = iota_model::load_export(&a.checkpoint, &StageOptions::cpu())?;
    let tokenizer = ex.tokenizer.as_ref().with_context(|| {
        format!(
            "{}: the export has no tokenizer.json to read a prompt with",
            a.checkpoint.display()
        )
    })?;
    let opts = GenerateOptions::sampled(a.max_new_tokens, a.temperature, a.top_p, a.seed);
    let text = iota_model::generate::generate(&ex.stages, tokenizer, &a.prompt, &opts)?;
    println!("{}{text}", a.prompt);
    Ok(())
}

pub fn eval(a: EvalArgs) -> anyhow::Result<()> {
    let ex = iota_model::load_export(&a.checkpoint, &StageOptions::cpu())?;
    let ds = PreparedDataset::open(&a.data, None, a.seq_len, 0)?;
    // Scores are only meaningful in the tokens the model was trained on.
    if let Some(tok) = &ex.tokenizer_json {
        let have = blake3::hash(tok).to_hex().to_string();
        anyhow::ensure!(
            have == ds.manifest().tokenizer_blake3,
            "{}: the dataset was prepared with another tokenizer than the export's",
            a.data.display()
        );
    }
    anyhow::ensure!(
        ds.vocab_size() <= ex.config.vocab_size,
        "the dataset's {} tokens do not fit the model's vocabulary of {}",
        ds.vocab_size(),
        ex.config.vocab_size
    );
    let n = ds.held_out_count().min(a.windows);
    anyhow::ensure!(
        n > 0,
        "{}: no held-out window of {} tokens",
        a.data.display(),
        a.seq_len + 1
    );
    let ids: Vec<u64> = (0..n)
        .map(|i| iota_model::data::HELD_OUT_BASE + i)
        .collect();
    let r = iota_model::generate::held_out_loss(&ex.stages, &ds, &ids, 8)?;
    println!(
        "held-out loss {:.4} nats/token, perplexity {:.2} ({} windows, {} tokens)",
        r.loss, r.perplexity, n, r.tokens
    );
    Ok(())
}
