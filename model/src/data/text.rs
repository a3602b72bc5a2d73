//! Real text: local `.txt` and `.jsonl` files with a Hugging Face `tokenizers` tokenizer.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder};

use super::Dataset;
use crate::error::{ModelError, Result};

/// Document separator added by [`train_bpe_tokenizer`] and looked up when tokenizing.
pub const END_OF_TEXT: &str = "<|endoftext|>";
const EOS_CANDIDATES: [&str; 4] = [END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>"];

/// The tokenizer's end-of-text token, if it has one of the usual names (the crate's BPE
/// trainer's first, then Llama 3's, then common ones).
pub fn eos_token(tokenizer: &Tokenizer) -> Option<u32> {
    EOS_CANDIDATES.iter().find_map(|t| tokenizer.token_to_id(t))
}

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

/// Documents from local files: a `.txt` file is one document; a `.jsonl` file has one JSON
/// object per line with a string `text` field. Files are read in sorted path order so the
/// result does not depend on the order they were listed in.
pub fn read_documents(files: &[PathBuf]) -> Result<Vec<String>> {
    if files.is_empty() {
        return Err(ModelError::Data("no input files".into()));
    }
    let mut files = files.to_vec();
    files.sort();
    let mut docs = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        match path.extension().and_then(|e| e.to_str()) {
            Some("txt") => docs.push(text),
            Some("jsonl") => {
                for (n, line) in text.lines().enumerate() {
                    if line.trim().is_empty() {
                        continue;
                    }
                    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                        ModelError::Data(format!("{}:{}: invalid JSON: {e}", path.display(), n + 1))
                    })?;
                    let t = v.get("text").and_then(|t| t.as_str()).ok_or_else(|| {
                        ModelError::Data(format!(
                            "{}:{}: no string \"text\" field",
                            path.display(),
                            n + 1
                        ))
                    })?;
                    docs.push(t.to_string());
                }
            }
            _ => {
                return Err(ModelError::Data(format!(
                    "{}: unsupported file type (expected .txt or .jsonl)",
                    path.display()
                )));
            }
        }
    }
    Ok(docs)
}

/// Train a byte-level BPE tokenizer with `vocab_size` entries (including the byte alphabet and
/// the `<|endoftext|>` special token) on local files, entirely offline, and write it as a
/// `tokenizer.json` to `out_path`. Returns the trained tokenizer's vocabulary size.
pub fn train_bpe_tokenizer(files: &[PathBuf], vocab_size: usize, out_path: &Path) -> Result<usize> {
    // 256 byte symbols plus the special token must fit.
    if vocab_size < 258 {
        return Err(ModelError::InvalidInput(format!(
            "vocab_size {vocab_size} is below the 258 entries of the byte alphabet plus specials"
        )));
    }
    let docs = read_documents(files)?;
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect::<HashSet<char>>())
        .build();
    let mut tok =
        TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel>::new()
            .with_model(BPE::default())
            .with_pre_tokenizer(Some(ByteLevel::default()))
            .with_post_processor(Some(ByteLevel::default()))
            .with_decoder(Some(ByteLevel::default()))
            .build()
            .map_err(tok_err)?;
    tok.train(&mut trainer, docs.iter()).map_err(tok_err)?;
    if let Some(parent) = out_path.parent()
        && !parent.as_os_str().is_empty()
    {
        std::fs::create_dir_all(parent).map_err(|e| ModelError::io(parent, e))?;
    }
    let tok: Tokenizer = tok.into();
    tok.save(out_path, false).map_err(tok_err)?;
    let n = tok.get_vocab_size(true);
    tracing::info!(target: "iota_model::data", vocab = n, docs = docs.len(), path = %out_path.display(), "trained BPE tokenizer");
    Ok(n)
}

/// Tokenized documents (each followed by the tokenizer's end-of-text token when it has one),
/// concatenated and cut into windows: sample `id` is window `id mod num_windows`, tokens
/// `[w * seq_len, w * seq_len + seq_len]`.
#[derive(Debug, Clone)]
pub struct TextDataset {
    tokens: Vec<u32>,
    seq_len: usize,
    vocab_size: usize,
    fingerprint: blake3::Hash,
}

impl TextDataset {
    /// Read `files` (see [`read_documents`]) and tokenize them with the tokenizer file.
    pub fn from_files(files: &[PathBuf], tokenizer_file: &Path, seq_len: usize) -> Result<Self> {
        let tok_bytes =
            std::fs::read(tokenizer_file).map_err(|e| ModelError::io(tokenizer_file, e))?;
        let tokenizer = Tokenizer::from_bytes(&tok_bytes).map_err(tok_err)?;
        Self::from_documents(&read_documents(files)?, &tokenizer, &tok_bytes, seq_len)
    }

    /// Tokenize in-memory documents. `tokenizer_bytes` (the tokenizer's JSON) enters the
    /// fingerprint.
    pub fn from_documents(
        docs: &[String],
        tokenizer: &Tokenizer,
        tokenizer_bytes: &[u8],
        seq_len: usize,
    ) -> Result<Self> {
        if seq_len == 0 {
            return Err(ModelError::Data("seq_len must be positive".into()));
        }
        let eos = eos_token(tokenizer);
        let mut tokens = Vec::new();
        let mut h = blake3::Hasher::new();
        h.update(b"iota-model/text/v1");
        h.update(&(seq_len as u64).to_le_bytes());
        h.update(blake3::hash(tokenizer_bytes).as_bytes());
        for d in docs {
            h.update(&(d.len() as u64).to_le_bytes());
            h.update(d.as_bytes());
            let enc = tokenizer.encode(d.as_str(), false).map_err(tok_err)?;
            tokens.extend_from_slice(enc.get_ids());
            if let Some(e) = eos {
                tokens.push(e);
            }
        }
        if tokens.len() < seq_len + 1 {
            return Err(ModelError::Data(format!(
                "{} tokens is less than one window of {} tokens",
                tokens.len(),
                seq_len + 1
            )));
        }
        let vocab_size = tokenizer.get_vocab_size(true);
        if let Some(bad) = tokens.iter().find(|t| **t as usize >= vocab_size) {
            return Err(ModelError::Data(format!(
                "tokenizer produced id {bad} outside its vocabulary of {vocab_size}"
            )));
        }
        Ok(Self {
            tokens,
            seq_len,
            vocab_size,
            fingerprint: h.finalize(),
        })
    }

    /// Number of distinct windows.
    pub fn num_windows(&self) -> usize {
        (self.tokens.len() - 1) / self.seq_len
    }

    /// Total tokens.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }
}

impl Dataset for TextDataset {
    fn seq_len(&self) -> usize {
        self.seq_len
    }
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    fn window(&self, id: u64) -> Result<Vec<u32>> {
        let w = (id % self.num_windows() as u64) as usize;
        let start = w * self.seq_len;
        Ok(self.tokens[start..start + self.seq_len + 1].to_vec())
    }
    fn fingerprint(&self) -> blake3::Hash {
        self.fingerprint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::GrammarCorpus;

    fn tmp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("iota-text-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn bpe_training_and_text_dataset() {
        let dir = tmp_dir("bpe");
        let g = GrammarCorpus::new(5, 64).unwrap();
        let txt = dir.join("a.txt");
        let body: Vec<String> = (0..40).map(|i| g.text(i).unwrap()).collect();
        std::fs::write(&txt, body.join("\n")).unwrap();
        let jsonl = dir.join("b.jsonl");
        let lines: Vec<String> = (40..80)
            .map(|i| serde_json::json!({ "text": g.text(i).unwrap(), "id": i }).to_string())
            .collect();
        std::fs::write(&jsonl, lines.join("\n")).unwrap();
        let files = vec![jsonl.clone(), txt.clone()];

        let tok_path = dir.join("tok/tokenizer.json");
        let n = train_bpe_tokenizer(&files, 400, &tok_path).unwrap();
        assert!(n > 300 && n <= 400, "{n}");

        let ds = TextDataset::from_files(&files, &tok_path, 16).unwrap();
        assert!(ds.num_windows() > 10);
        assert_eq!(ds.vocab_size(), n);
        let w = ds.window(3).unwrap();
        assert_eq!(w.len(), 17);
        assert_eq!(w, ds.window(3 + ds.num_windows() as u64).unwrap());
        // File order does not matter; content does.
        let ds2 = TextDataset::from_files(&[txt.clone(), jsonl.clone()], &tok_path, 16).unwrap();
        assert_eq!(ds.fingerprint(), ds2.fingerprint());
        assert_eq!(ds.window(5).unwrap(), ds2.window(5).unwrap());
        let ds3 = TextDataset::from_files(std::slice::from_ref(&txt), &tok_path, 16).unwrap();
        assert_ne!(ds.fingerprint(), ds3.fingerprint());

        // Merges learned: frequent words are single tokens.
        let tok = Tokenizer::from_file(&tok_path).unwrap();
        let sample = g.text(3).unwrap();
        let ids = tok.encode(sample.as_str(), false).unwrap();
        assert!(
            ids.get_ids().len() * 3 < sample.len(),
            "{:?}",
            ids.get_tokens()
        );
        assert!(tok.token_to_id(END_OF_TEXT).is_some());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn bad_inputs_are_errors() {
        let dir = tmp_dir("bad");
        let bad_json = dir.join("x.jsonl");
        std::fs::write(&bad_json, "{\"text\": 3}\n").unwrap();
        assert!(read_documents(&[bad_json]).is_err());
        let not_json = dir.join("y.jsonl");
        std::fs::write(&not_json, "nope\n").unwrap();
        assert!(read_documents(&[not_json]).is_err());
        let csv = dir.join("z.csv");
        std::fs::write(&csv, "a,b").unwrap();
        assert!(read_documents(&[csv]).is_err());
        assert!(read_documents(&[dir.join("missing.txt")]).is_err());
        assert!(read_documents(&[]).is_err());
        let small = dir.join("s.txt");
        std::fs::write(&small, "hello hello").unwrap();
        assert!(
            train_bpe_tokenizer(std::slice::from_ref(&small), 10, &dir.join("t.json")).is_err()
        );
        let tok_path = dir.join("t.json");
        train_bpe_tokenizer(std::slice::from_ref(&small), 260, &tok_path).unwrap();
        // Far too little text for one window of 1000 tokens.
        assert!(TextDataset::from_files(&[small], &tok_path, 1000).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }
}
