//! `iota data prepare`: raw text to token shards and a manifest, with progress a person can read.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use iota_model::data::prepare::{PrepareOptions, Progress, prepare};
use iota_model::data::sources::SourceOptions;

#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Tokenize text once into fixed-size token shards and a manifest that a run names by its
    /// BLAKE3: `.txt`, `.jsonl`, `.jsonl.gz`, `.jsonl.zst`, `.parquet`, or folders of them.
    Prepare(PrepareArgs),
}

#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// Input files or folders (searched recursively for supported files).
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// The `tokenizer.json` (Hugging Face `tokenizers` format; `iota model train-tokenizer`
    /// makes one).
    #[arg(long, env = "IOTA_DATA_TOKENIZER")]
    tokenizer: PathBuf,
    /// The dataset folder to create (must not exist, or be empty).
    #[arg(long, env = "IOTA_DATA_OUT")]
    out: PathBuf,
    /// The JSON field (jsonl) or column (parquet) that holds each document's text.
    #[arg(long, env = "IOTA_DATA_TEXT_FIELD", default_value = "text")]
    text_field: String,
    /// Fraction of documents held out for evaluation, chosen by a hash of their text.
    #[arg(long, env = "IOTA_DATA_HELD_OUT", default_value_t = 0.01)]
    held_out: f64,
    /// Tokens per shard file.
    #[arg(long, env = "IOTA_DATA_SHARD_TOKENS", default_value_t = 1 << 26)]
    shard_tokens: u64,
    /// The longest document accepted from a JSON line or a parquet value, in bytes (a `.txt`
    /// file is read in pieces and has no limit).
    #[arg(long, env = "IOTA_DATA_MAX_DOCUMENT_BYTES", default_value_t = 64 << 20)]
    max_document_bytes: usize,
}

pub fn run(cmd: DataCommand) -> anyhow::Result<()> {
    match cmd {
        DataCommand::Prepare(a) => prepare_cmd(a),
    }
}

fn prepare_cmd(a: PrepareArgs) -> anyhow::Result<()> {
    if !(0.0..1.0).contains(&a.held_out) {
        anyhow::bail!("--held-out {} is not a fraction in [0, 1)", a.held_out);
    }
    let opts = PrepareOptions {
        source: SourceOptions {
            text_field: a.text_field,
            max_document_bytes: a.max_document_bytes,
            ..SourceOptions::default()
        },
        shard_tokens: a.shard_tokens,
        held_out_ppm: (a.held_out * 1e6).round() as u32,
        ..PrepareOptions::default()
    };
    let mut bar = Bar::new();
    let (m, hash) = prepare(&a.inputs, &a.tokenizer, &a.out, &opts, &mut |p| bar.show(p))?;
    bar.finish();
    let secs = bar.start.elapsed().as_secs_f64();
    println!(
        "wrote {}: {} tokens ({} training, {} held out) in {} + {} shards, {} documents ({} \
         empty skipped), {:.0} tokens/s",
        a.out.display(),
        m.total_tokens(),
        m.train.tokens,
        m.held_out.tokens,
        m.train.shards.len(),
        m.held_out.shards.len(),
        m.train.documents + m.held_out.documents,
        m.skipped_empty,
        m.total_tokens() as f64 / secs.max(1e-9),
    );
    println!("manifest BLAKE3 {hash}");
    Ok(())
}

/// A bar redrawn in place on a terminal, otherwise a log line every ten seconds.
struct Bar {
    start: Instant,
    last: Option<Instant>,
    terminal: bool,
}

impl Bar {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            last: None,
            terminal: std::io::stderr().is_terminal(),
        }
    }

    fn show(&mut self, p: &Progress) {
        let every = if self.terminal {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(10)
        };
        if self.last.is_some_and(|l| l.elapsed() < every) {
            return;
        }
        self.last = Some(Instant::now());
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        let done = if p.bytes_total == 0 {
            1.0
        } else {
            p.bytes_read as f64 / p.bytes_total as f64
        };
        let eta = if done > 0.0 {
            format!("{:.0}s", secs / done - secs)
        } else {
            "?".into()
        };
        let rate = p.tokens as f64 / secs;
        if self.terminal {
            let width = 30;
            let filled = ((done * width as f64) as usize).min(width);
            let mut err = std::io::stderr();
            let _ = write!(
                err,
                "\r\x1b[2K[{}{}] {:5.1}%  {} tokens  {:.0} tokens/s  ETA {eta}",
                "#".repeat(filled),
                " ".repeat(width - filled),
                done * 100.0,
                p.tokens,
                rate
            );
            let _ = err.flush();
        } else {
            tracing::info!(
                percent = done * 100.0,
                tokens = p.tokens,
                documents = p.documents,
                tokens_per_s = rate,
                eta = %eta,
                "preparing"
            );
        }
    }

    fn finish(&self) {
        if self.terminal {
            let _ = writeln!(std::io::stderr());
        }
    }
}
