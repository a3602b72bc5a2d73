//! `data prepare`: raw text tokenized once into fixed-size token shards and a manifest.
//!
//! Layout of a prepared dataset folder:
//!
//! * `manifest.json`: [`Manifest`]; a run names the dataset by the BLAKE3 of this file's bytes;
//! * `tokenizer.json`: the tokenizer, byte for byte as given (its BLAKE3 is in the manifest);
//! * `train-NNNNN.tok`, `held_out-NNNNN.tok`: little-endian token ids (u16 when the vocabulary
//!   fits, else u32), documents concatenated in input order, each followed by the end-of-text
//!   token when the tokenizer has one; every shard but a split's last holds exactly
//!   `shard_tokens` tokens.
//!
//! A document goes to the held-out split when a keyed hash of its text falls below the
//! held-out fraction, so the split depends on content, never position, and duplicates land on
//! the same side. Files are read in sorted path order while a reader thread runs ahead of the
//! tokenizer, which encodes each batch of documents on every core; the output is a function of
//! the inputs and the tokenizer alone (no times, paths or thread counts), so preparing the same
//! input twice gives byte-identical files. Everything is written into a temporary folder beside
//! the target and renamed into place only when complete.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

use super::sources::{self, Piece, SourceOptions};
use crate::error::{ModelError, Result};

/// The manifest's `format` string.
pub const MANIFEST_FORMAT: &str = "iota-tokens/1";
/// File name of the manifest in a prepared dataset.
pub const MANIFEST_FILE: &str = "manifest.json";
/// File name of the tokenizer in a prepared dataset.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// One token shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// File name inside the dataset folder.
    pub file: String,
    /// Tokens in the file.
    pub tokens: u64,
    /// BLAKE3 (hex) of the file's bytes.
    pub blake3: String,
}

/// One split of a prepared dataset.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitInfo {
    /// Documents in the split.
    pub documents: u64,
    /// Tokens in the split (end-of-text tokens included).
    pub tokens: u64,
    /// The shards, in order.
    pub shards: Vec<ShardInfo>,
}

/// What `manifest.json` holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`].
    pub format: String,
    /// BLAKE3 (hex) of `tokenizer.json`.
    pub tokenizer_blake3: String,
    /// The tokenizer's vocabulary size, added tokens included: a model must have at least this.
    pub vocab_size: u64,
    /// Bytes per token in the shards: 2 or 4.
    pub token_bytes: u8,
    /// The end-of-text token appended to every document, if the tokenizer has one.
    pub eos_token: Option<u32>,
    /// Documents per million sent to the held-out split.
    pub held_out_ppm: u32,
    /// Tokens per full shard.
    pub shard_tokens: u64,
    /// Empty documents skipped (empty files, empty or null text fields).
    pub skipped_empty: u64,
    /// The training split.
    pub train: SplitInfo,
    /// The held-out split.
    pub held_out: SplitInfo,
}

impl Manifest {
    /// Total tokens in both splits.
    pub fn total_tokens(&self) -> u64 {
        self.train.tokens + self.held_out.tokens
    }
}

/// Options of [`prepare`].
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// How input files are read.
    pub source: SourceOptions,
    /// Tokens per shard.
    pub shard_tokens: u64,
    /// Fraction of documents held out, in parts per million.
    pub held_out_ppm: u32,
    /// Text bytes handed to the tokenizer at once (the batch that is encoded in parallel).
    pub batch_bytes: usize,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        Self {
            source: SourceOptions::default(),
            shard_tokens: 1 << 26,
            held_out_ppm: 10_000,
            batch_bytes: 4 << 20,
        }
    }
}

/// Progress of [`prepare`], reported after every batch.
#[derive(Debug, Clone, Copy, Default)]
pub struct Progress {
    /// Raw input bytes read so far (compressed bytes for compressed files).
    pub bytes_read: u64,
    /// Raw input bytes in all files.
    pub bytes_total: u64,
    /// Tokens written so far.
    pub tokens: u64,
    /// Documents finished so far.
    pub documents: u64,
}

/// Whether a document goes to the held-out split: a keyed hash of its text below the fraction.
pub fn is_held_out(doc_hash: &[u8; 32], held_out_ppm: u32) -> bool {
    let h = blake3::keyed_hash(&HELD_OUT_KEY, doc_hash);
    let mut x = [0u8; 8];
    x.copy_from_slice(&h.as_bytes()[..8]);
    // Uniform in [0, 10^6).
    let draw = (u128::from(u64::from_le_bytes(x)) * 1_000_000) >> 64;
    draw < u128::from(held_out_ppm)
}

const HELD_OUT_KEY: [u8; 32] = *b"iota data prepare held-out v1 ..";

/// Trains a BPE tokenizer of `vocab_size` tokens on the files under `corpus` (as
/// `dir/tokenizer.json`) and prepares `corpus` with it into `dir/data`, `held_out_ppm` of its
/// documents held out: a real-text dataset in one step, as the benches that train on English
/// build theirs. Returns the dataset folder and its name in a run.
pub fn prepare_with_new_tokenizer(
    corpus: &Path,
    vocab_size: usize,
    dir: &Path,
    held_out_ppm: u32,
) -> Result<(PathBuf, String)> {
    let files = sources::list_inputs(std::slice::from_ref(&corpus.to_path_buf()))?;
    let tokenizer = dir.join("tokenizer.json");
    super::text::train_bpe_tokenizer(&files, vocab_size, &tokenizer)?;
    let out = dir.join("data");
    let opts = PrepareOptions {
        held_out_ppm,
        ..PrepareOptions::default()
    };
    let (_, name) = prepare(
        &[corpus.to_path_buf()],
        &tokenizer,
        &out,
        &opts,
        &mut |_| {},
    )?;
    Ok((out, name))
}

/// Tokenizes `inputs` (see [`sources::list_inputs`]) with the tokenizer at `tokenizer_file`
/// into a new dataset folder `out`, which must not exist or be empty. Returns the manifest and
/// its BLAKE3 (hex), the dataset's name in a run.
pub fn prepare(
    inputs: &[PathBuf],
    tokenizer_file: &Path,
    out: &Path,
    opts: &PrepareOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<(Manifest, String)> {
    if opts.shard_tokens == 0 {
        return Err(ModelError::InvalidInput(
            "shard_tokens must be positive".into(),
        ));
    }
    if opts.held_out_ppm >= 1_000_000 {
        return Err(ModelError::InvalidInput(
            "the held-out fraction must be below 1".into(),
        ));
    }
    let files = sources::list_inputs(inputs)?;
    let tok_bytes = std::fs::read(tokenizer_file).map_err(|e| ModelError::io(tokenizer_file, e))?;
    let tokenizer = Tokenizer::from_bytes(&tok_bytes)
        .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tokenizer_file.display())))?;
    let vocab_size = tokenizer.get_vocab_size(true) as u64;
    let eos = super::text::eos_token(&tokenizer);
    let token_bytes: u8 = if vocab_size <= 1 << 16 { 2 } else { 4 };
    let mut bytes_total = 0;
    for f in &files {
        bytes_total += std::fs::metadata(f)
            .map_err(|e| ModelError::io(f, e))?
            .len();
    }

    let staging = Staging::new(out)?;
    std::fs::write(staging.dir.join(TOKENIZER_FILE), &tok_bytes)
        .map_err(|e| ModelError::io(staging.dir.join(TOKENIZER_FILE), e))?;
    let mut train = ShardWriter::new(&staging.dir, "train", opts.shard_tokens, token_bytes);
    let mut held = ShardWriter::new(&staging.dir, "held_out", opts.shard_tokens, token_bytes);

    let read = Arc::new(AtomicU64::new(0));
    let mut prog = Progress {
        bytes_total,
        ..Progress::default()
    };
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<Piece>>(2);
    let reader = {
        let files = files.clone();
        let src = opts.source.clone();
        let read = read.clone();
        let batch_bytes = opts.batch_bytes.max(1);
        std::thread::spawn(move || -> Result<u64> {
            let mut batch = Vec::new();
            let mut size = 0;
            let mut empty = 0;
            for f in &files {
                empty += sources::read_file(f, &src, &read, &mut |p| {
                    size += p.text.len();
                    batch.push(p);
                    if size >= batch_bytes {
                        size = 0;
                        // The receiver is gone only when tokenizing failed; its error wins.
                        tx.send(std::mem::take(&mut batch))
                            .map_err(|_| ModelError::Data("tokenizing stopped".into()))?;
                    }
                    Ok(())
                })?;
            }
            if !batch.is_empty() {
                tx.send(batch)
                    .map_err(|_| ModelError::Data("tokenizing stopped".into()))?;
            }
            Ok(empty)
        })
    };

    let mut tokenize = || -> Result<()> {
        for batch in rx.iter() {
            let texts: Vec<&str> = batch.iter().map(|p| p.text.as_str()).collect();
            let encs = tokenizer
                .encode_batch_fast(texts, false)
                .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
            for (piece, enc) in batch.iter().zip(&encs) {
                let w = if is_held_out(&piece.doc_hash, opts.held_out_ppm) {
                    &mut held
                } else {
                    &mut train
                };
                let ids = enc.get_ids();
                if let Some(bad) = ids.iter().find(|t| u64::from(**t) >= vocab_size) {
                    return Err(ModelError::Data(format!(
                        "the tokenizer produced id {bad} outside its vocabulary of {vocab_size}"
                    )));
                }
                w.push(ids)?;
                if piece.last {
                    if let Some(e) = eos {
                        w.push(&[e])?;
                    }
                    w.documents += 1;
                    prog.documents += 1;
                }
                prog.tokens += ids.len() as u64 + u64::from(piece.last && eos.is_some());
            }
            prog.bytes_read = read.load(Ordering::Relaxed).min(bytes_total);
            progress(&prog);
        }
        Ok(())
    };
    let tokenized = tokenize();
    drop(rx);
    let skipped_empty = reader
        .join()
        .map_err(|_| ModelError::Data("the input reader panicked".into()))??;
    tokenized?;

    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        tokenizer_blake3: blake3::hash(&tok_bytes).to_hex().to_string(),
        vocab_size,
        token_bytes,
        eos_token: eos,
        held_out_ppm: opts.held_out_ppm,
        shard_tokens: opts.shard_tokens,
        skipped_empty,
        train: train.finish()?,
        held_out: held.finish()?,
    };
    if manifest.train.tokens == 0 {
        return Err(ModelError::Data("the inputs hold no text".into()));
    }
    let mut json = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| ModelError::Data(format!("manifest: {e}")))?;
    json.push(b'\n');
    write_synced(&staging.dir.join(MANIFEST_FILE), &json)?;
    staging.commit()?;
    prog.bytes_read = bytes_total;
    progress(&prog);
    Ok((manifest, blake3::hash(&json).to_hex().to_string()))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| ModelError::io(path, e))?;
    f.write_all(bytes).map_err(|e| ModelError::io(path, e))?;
    f.sync_all().map_err(|e| ModelError::io(path, e))
}

/// Writes one split's shards, hashing as it goes.
struct ShardWriter {
    dir: PathBuf,
    split: &'static str,
    shard_tokens: u64,
    token_bytes: u8,
    open: Option<(BufWriter<File>, PathBuf, blake3::Hasher, u64)>,
    info: SplitInfo,
    documents: u64,
}

impl ShardWriter {
    fn new(dir: &Path, split: &'static str, shard_tokens: u64, token_bytes: u8) -> Self {
        Self {
            dir: dir.to_path_buf(),
            split,
            shard_tokens,
            token_bytes,
            open: None,
            info: SplitInfo::default(),
            documents: 0,
        }
    }

    fn push(&mut self, mut ids: &[u32]) -> Result<()> {
        while !ids.is_empty() {
            if self.open.is_none() {
                let name = format!("{}-{:05}.tok", self.split, self.info.shards.len());
                let path = self.dir.join(&name);
                let f = File::create(&path).map_err(|e| ModelError::io(&path, e))?;
                self.open = Some((
                    BufWriter::with_capacity(1 << 20, f),
                    path,
                    blake3::Hasher::new(),
                    0,
                ));
            }
            let Some((w, path, h, n)) = self.open.as_mut() else {
                unreachable!("opened above");
            };
            let take = ((self.shard_tokens - *n) as usize).min(ids.len());
            let mut bytes = Vec::with_capacity(take * usize::from(self.token_bytes));
            for t in &ids[..take] {
                if self.token_bytes == 2 {
                    // The vocabulary fits u16 (checked against the tokenizer's size).
                    bytes.extend_from_slice(&(*t as u16).to_le_bytes());
                } else {
                    bytes.extend_from_slice(&t.to_le_bytes());
                }
            }
            w.write_all(&bytes).map_err(|e| ModelError::io(&*path, e))?;
            h.update(&bytes);
            *n += take as u64;
            ids = &ids[take..];
            if *n == self.shard_tokens {
                self.close()?;
            }
        }
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        if let Some((w, path, h, n)) = self.open.take() {
            let f = w
                .into_inner()
                .map_err(|e| ModelError::io(&path, e.into_error()))?;
            f.sync_all().map_err(|e| ModelError::io(&path, e))?;
            let file = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_string();
            self.info.tokens += n;
            self.info.shards.push(ShardInfo {
                file,
                tokens: n,
                blake3: h.finalize().to_hex().to_string(),
            });
        }
        Ok(())
    }

    fn finish(mut self) -> Result<SplitInfo> {
        self.close()?;
        self.info.documents = self.documents;
        Ok(self.info)
    }
}

/// A temporary folder beside the target, removed unless committed.
struct Staging {
    dir: PathBuf,
    target: PathBuf,
    committed: bool,
}

impl Staging {
    fn new(target: &Path) -> Result<Self> {
        if let Ok(mut entries) = std::fs::read_dir(target) {
            if entries.next().is_some() {
                return Err(ModelError::Data(format!(
                    "{}: the output folder exists and is not empty",
                    target.display()
                )));
            }
        } else if target.exists() {
            return Err(ModelError::Data(format!(
                "{}: the output exists and is not a folder",
                target.display()
            )));
        }
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).map_err(|e| ModelError::io(&parent, e))?;
        let name = target
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| ModelError::Data(format!("{}: not a folder name", target.display())))?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir = parent.join(format!(".{name}.partial-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| ModelError::io(&dir, e))?;
        Ok(Self {
            dir,
            target: target.to_path_buf(),
            committed: false,
        })
    }

    fn commit(mut self) -> Result<()> {
        sync_dir(&self.dir)?;
        if self.target.is_dir() {
            // Empty (checked at the start); rename cannot replace a folder on every system.
            std::fs::remove_dir(&self.target).map_err(|e| ModelError::io(&self.target, e))?;
        }
        std::fs::rename(&self.dir, &self.target).map_err(|e| ModelError::io(&self.target, e))?;
        self.committed = true;
        if let Some(p) = self.target.parent() {
            // Best effort: the rename is durable once the parent folder is synced.
            sync_dir(if p.as_os_str().is_empty() {
                Path::new(".")
            } else {
                p
            })
            .ok();
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            std::fs::remove_dir_all(&self.dir).ok();
        }
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| ModelError::io(dir, e))
}
