//! A run's prepared dataset as it travels through the run's store: which files make it up,
//! under which keys, and how big each may be.
//!
//! The manifest format belongs to `iota data prepare` (the model crate); this is the part of it
//! that says which files a copy needs and what their BLAKE3 and sizes are, so that the
//! orchestrator (which never loads the model) and a downloader agree on the list.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::blob::is_blake3_hex;

/// File name of the manifest in a prepared dataset.
pub const MANIFEST_FILE: &str = "manifest.json";
/// File name of the tokenizer in a prepared dataset.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The largest manifest a party reads (a manifest lists shards of many millions of tokens each:
/// a few hundred bytes per shard).
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;
/// The largest tokenizer a party downloads.
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Key prefix of the dataset whose manifest hashes to `manifest_blake3` in a run's store (shared
/// by runs on the same dataset).
pub fn dataset_prefix(manifest_blake3: &str) -> String {
    format!("datasets/{manifest_blake3}/")
}

/// `GET /v1/dataset`: the files of the run's dataset in its store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct DatasetFiles {
    /// BLAKE3 (hex) of `manifest.json`: the run's `dataset`.
    pub dataset: String,
    /// The manifest, the tokenizer and every shard the manifest lists.
    pub files: Vec<DatasetFile>,
}

/// One file of a dataset in the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct DatasetFile {
    /// File name inside the dataset folder.
    pub name: String,
    /// Object key in the store.
    pub key: String,
    /// Size in bytes of the stored object.
    pub size: u64,
    /// BLAKE3 (hex) the file must have: the run's `dataset` for the manifest, the manifest's
    /// for the others.
    pub blake3: String,
    /// A presigned download URL when the store serves bytes directly; otherwise the bytes come
    /// from `GET /v1/blobs/{key}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

/// The part of `manifest.json` that lists the files.
#[derive(Clone, Debug, Deserialize)]
pub struct ManifestFiles {
    /// BLAKE3 (hex) of `tokenizer.json`.
    pub tokenizer_blake3: String,
    /// Bytes per token in the shards.
    pub token_bytes: u8,
    /// The training split.
    pub train: SplitFiles,
    /// The held-out split.
    pub held_out: SplitFiles,
}

/// The shards of one split.
#[derive(Clone, Debug, Deserialize)]
pub struct SplitFiles {
    /// The shards, in order.
    pub shards: Vec<ShardFile>,
}

/// One shard as the manifest lists it.
#[derive(Clone, Debug, Deserialize)]
pub struct ShardFile {
    /// File name inside the dataset folder.
    pub file: String,
    /// Tokens in the file.
    pub tokens: u64,
    /// BLAKE3 (hex) of the file.
    pub blake3: String,
}

/// A file a copy of the dataset needs, besides the manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectedFile {
    /// File name inside the dataset folder.
    pub name: String,
    /// BLAKE3 (hex) from the manifest.
    pub blake3: String,
    /// Its size, when the manifest fixes it (shards: tokens × token bytes); the tokenizer's is
    /// bounded by [`MAX_TOKENIZER_BYTES`] only.
    pub size: Option<u64>,
}

impl ManifestFiles {
    /// Parses a manifest's bytes.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("{MANIFEST_FILE}: {e}"))
    }

    /// The tokenizer and every shard, checked: names that stay inside the folder and appear
    /// once, BLAKE3 digests, sizes that fit in a `u64`.
    pub fn expected(&self) -> Result<Vec<ExpectedFile>, String> {
        if self.token_bytes != 2 && self.token_bytes != 4 {
            return Err(format!(
                "{MANIFEST_FILE}: {} bytes per token (2 or 4 expected)",
                self.token_bytes
            ));
        }
        let mut out = vec![ExpectedFile {
            name: TOKENIZER_FILE.to_owned(),
            blake3: self.tokenizer_blake3.clone(),
            size: None,
        }];
        for shard in self.train.shards.iter().chain(&self.held_out.shards) {
            let size = shard
                .tokens
                .checked_mul(u64::from(self.token_bytes))
                .ok_or_else(|| format!("{MANIFEST_FILE}: {} is too large", shard.file))?;
            out.push(ExpectedFile {
                name: shard.file.clone(),
                blake3: shard.blake3.clone(),
                size: Some(size),
            });
        }
        let mut seen = std::collections::HashSet::new();
        for f in &out {
            if !is_file_name(&f.name) || f.name == MANIFEST_FILE {
                return Err(format!("{MANIFEST_FILE}: bad file name {:?}", f.name));
            }
            if !seen.insert(f.name.as_str()) {
                return Err(format!("{MANIFEST_FILE}: {:?} listed twice", f.name));
            }
            if !is_blake3_hex(&f.blake3) {
                return Err(format!(
                    "{MANIFEST_FILE}: {}: {:?} is not a BLAKE3 digest",
                    f.name, f.blake3
                ));
            }
        }
        Ok(out)
    }
}

/// A plain file name: no separator, no `..`, not hidden, printable ASCII.
fn is_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(shard: &str, token_bytes: u8) -> Vec<u8> {
        serde_json::json!({
            "format": "iota-tokens/1",
            "tokenizer_blake3": "ab".repeat(32),
            "vocab_size": 400,
            "token_bytes": token_bytes,
            "train": {"documents": 1, "tokens": 10,
                      "shards": [{"file": shard, "tokens": 10, "blake3": "cd".repeat(32)}]},
            "held_out": {"documents": 0, "tokens": 0, "shards": []}
        })
        .to_string()
        .into_bytes()
    }

    #[test]
    fn lists_the_tokenizer_and_shards_with_their_sizes() {
        let m = ManifestFiles::parse(&manifest("train-00000.tok", 2)).expect("parse");
        let files = m.expected().expect("files");
        assert_eq!(files.len(), 2);
        assert_eq!(files[0].name, TOKENIZER_FILE);
        assert_eq!(files[0].size, None);
        assert_eq!(files[1].name, "train-00000.tok");
        assert_eq!(files[1].size, Some(20));
    }

    #[test]
    fn refuses_names_outside_the_folder_and_odd_token_widths() {
        for bad in [
            "../x.tok",
            "a/b.tok",
            ".hidden",
            "",
            "manifest.json",
            "tokenizer.json",
        ] {
            let m = ManifestFiles::parse(&manifest(bad, 2)).expect("parse");
            assert!(m.expected().is_err(), "{bad:?}");
        }
        let m = ManifestFiles::parse(&manifest("train-00000.tok", 3)).expect("parse");
        assert!(m.expected().expect_err("width").contains("3 bytes"));
    }
}
