//! Training data: sample ids map deterministically to token windows, so every party rebuilds a
//! batch from its ids alone.
//!
//! * [`GrammarCorpus`]: the embedded default, generated from a seeded probabilistic grammar whose
//!   per-token entropy (the best achievable loss) is computed exactly.
//! * [`TextDataset`]: local `.txt` / `.jsonl` files tokenized with a Hugging Face `tokenizers`
//!   file; [`train_bpe_tokenizer`] makes such a file offline.
//! * [`PreparedDataset`]: token shards and a manifest made once by [`prepare::prepare`] from
//!   txt, jsonl (plain, gzip, zstd) or parquet inputs; what real runs train on.

mod grammar;
mod mmap;
pub mod prepare;
mod prepared;
pub mod sources;
mod text;

pub use grammar::GrammarCorpus;
pub use prepared::{HELD_OUT_BASE, PreparedDataset};
pub use text::{END_OF_TEXT, TextDataset, eos_token, read_documents, train_bpe_tokenizer};

use candle_core::{Device, Tensor};

use crate::error::{ModelError, Result};

/// A source of fixed-length token windows addressed by sample id.
pub trait Dataset: Send + Sync {
    /// Tokens predicted per sample (a window holds `seq_len + 1` tokens).
    fn seq_len(&self) -> usize;
    /// Smallest vocabulary that covers every token id this dataset produces.
    fn vocab_size(&self) -> usize;
    /// The `seq_len + 1` tokens of sample `id`.
    fn window(&self, id: u64) -> Result<Vec<u32>>;
    /// Identifies the dataset, tokenizer and `seq_len`: equal fingerprints and equal ids give
    /// equal windows.
    fn fingerprint(&self) -> blake3::Hash;
    /// How many held-out windows exist (ids `HELD_OUT_BASE..HELD_OUT_BASE + n`), where the
    /// dataset has a fixed number; `None` when every held-out id has one.
    fn held_out_windows(&self) -> Option<u64> {
        None
    }
    /// The pass over the training data that training id `id` belongs to (a dataset that
    /// never repeats is always in pass 0).
    fn pass_of(&self, _id: u64) -> u64 {
        0
    }
}

/// Inputs and next-token targets for a list of sample ids.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Sample ids, in row order.
    pub ids: Vec<u64>,
    /// `[batch, seq_len]` u32: tokens `0..seq_len` of each window.
    pub inputs: Tensor,
    /// `[batch, seq_len]` u32: tokens `1..=seq_len` of each window.
    pub targets: Tensor,
}

/// Build the batch for `ids` on `device`.
pub fn make_batch(ds: &dyn Dataset, ids: &[u64], device: &Device) -> Result<Batch> {
    if ids.is_empty() {
        return Err(ModelError::InvalidInput(
            "a batch needs at least one sample id".into(),
        ));
    }
    let t = ds.seq_len();
    let mut inputs = Vec::with_capacity(ids.len() * t);
    let mut targets = Vec::with_capacity(ids.len() * t);
    for id in ids {
        let w = ds.window(*id)?;
        if w.len() != t + 1 {
            return Err(ModelError::Data(format!(
                "window {id} has {} tokens, expected {}",
                w.len(),
                t + 1
            )));
        }
        inputs.extend_from_slice(&w[..t]);
        targets.extend_from_slice(&w[1..]);
    }
    Ok(Batch {
        ids: ids.to_vec(),
        inputs: Tensor::from_vec(inputs, (ids.len(), t), device)?,
        targets: Tensor::from_vec(targets, (ids.len(), t), device)?,
    })
}
