//! A prepared dataset (see [`super::prepare`]) read as windows addressed by sample id.
//!
//! Training ids `0..HELD_OUT_BASE` walk the training split's windows in passes: id `i` is
//! window `permute(i mod N)` of pass `i / N`, where `N` is the number of training windows and
//! each pass has its own seeded permutation. Nothing wraps silently: [`Dataset::pass_of`]
//! tells a caller when a new pass begins. Ids from `HELD_OUT_BASE` on are the held-out split's
//! windows in order; there are only as many as the split holds. The two splits are different
//! files, so no training window can overlap a held-out one.
//!
//! Shards are memory-mapped and checked against the manifest's BLAKE3 the first time a window
//! touches them; the manifest itself is checked against the hash the run publishes, and the
//! tokenizer against the manifest.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::Dataset;
use super::mmap::MappedFile;
use super::prepare::{MANIFEST_FILE, MANIFEST_FORMAT, Manifest, SplitInfo, TOKENIZER_FILE};
use crate::error::{ModelError, Result};

/// The first held-out sample id; equal to the protocol's `HELD_OUT_BASE` (a test checks).
pub const HELD_OUT_BASE: u64 = 1 << 62;

/// One split's shards and where its windows start.
#[derive(Debug)]
struct Split {
    shards: Vec<Shard>,
    /// Windows before each shard (prefix sums), plus the total at the end.
    starts: Vec<u64>,
}

#[derive(Debug)]
struct Shard {
    path: PathBuf,
    tokens: u64,
    blake3: String,
    map: OnceLock<std::result::Result<MappedFile, String>>,
}

impl Split {
    fn open(dir: &Path, info: &SplitInfo, token_bytes: u8, seq_len: usize) -> Result<Self> {
        let mut shards = Vec::with_capacity(info.shards.len());
        let mut starts = vec![0u64];
        for s in &info.shards {
            if s.file.contains('/') || s.file.contains('\\') || s.file.starts_with('.') {
                return Err(ModelError::Data(format!(
                    "{}: shard name {:?} is not a plain file name",
                    dir.join(MANIFEST_FILE).display(),
                    s.file
                )));
            }
            let path = dir.join(&s.file);
            let len = std::fs::metadata(&path)
                .map_err(|e| ModelError::io(&path, e))?
                .len();
            if len != s.tokens * u64::from(token_bytes) {
                return Err(ModelError::Data(format!(
                    "{}: {len} bytes, the manifest says {} tokens of {token_bytes} bytes",
                    path.display(),
                    s.tokens
                )));
            }
            let windows = s.tokens.saturating_sub(1) / seq_len as u64;
            starts.push(starts.last().copied().unwrap_or(0) + windows);
            shards.push(Shard {
                path,
                tokens: s.tokens,
                blake3: s.blake3.clone(),
                map: OnceLock::new(),
            });
        }
        Ok(Self { shards, starts })
    }

    fn windows(&self) -> u64 {
        self.starts.last().copied().unwrap_or(0)
    }

    /// The shard holding window `w` and the window's index inside it.
    fn locate(&self, w: u64) -> (usize, u64) {
        // `starts` is sorted; the shard is the last one starting at or before `w`.
        let k = self.starts.partition_point(|s| *s <= w) - 1;
        (k, w - self.starts[k])
    }
}

impl Shard {
    /// The verified mapping (hashed once, on first use).
    fn bytes(&self) -> Result<&[u8]> {
        let m = self.map.get_or_init(|| {
            let m = MappedFile::open(&self.path).map_err(|e| e.to_string())?;
            let got = blake3::hash(m.bytes()).to_hex().to_string();
            if got != self.blake3 {
                return Err(format!(
                    "{}: BLAKE3 {got} differs from the manifest's {} (a corrupt or tampered \
                     shard)",
                    self.path.display(),
                    self.blake3
                ));
            }
            Ok(m)
        });
        match m {
            Ok(m) => Ok(m.bytes()),
            Err(e) => Err(ModelError::Data(e.clone())),
        }
    }
}

/// A prepared dataset cut into windows of `seq_len + 1` tokens (consecutive windows share one
/// token; no window crosses a shard boundary).
#[derive(Debug)]
pub struct PreparedDataset {
    dir: PathBuf,
    manifest: Manifest,
    manifest_blake3: String,
    seq_len: usize,
    seed: u64,
    train: Split,
    held_out: Split,
}

impl PreparedDataset {
    /// Opens the dataset in `dir`. With `expected_manifest` (the BLAKE3 hex a run publishes), a
    /// manifest with other bytes is refused. The tokenizer file and every shard's size are
    /// checked now, shard contents on first use.
    pub fn open(
        dir: &Path,
        expected_manifest: Option<&str>,
        seq_len: usize,
        seed: u64,
    ) -> Result<Self> {
        if seq_len == 0 {
            return Err(ModelError::Data("seq_len must be positive".into()));
        }
        let mpath = dir.join(MANIFEST_FILE);
        let bytes = std::fs::read(&mpath).map_err(|e| ModelError::io(&mpath, e))?;
        let manifest_blake3 = blake3::hash(&bytes).to_hex().to_string();
        if let Some(want) = expected_manifest
            && !want.eq_ignore_ascii_case(&manifest_blake3)
        {
            return Err(ModelError::Data(format!(
                "{}: BLAKE3 {manifest_blake3} differs from the run's {want} (another dataset, \
                 or a tampered manifest)",
                mpath.display()
            )));
        }
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| ModelError::Data(format!("{}: {e}", mpath.display())))?;
        if manifest.format != MANIFEST_FORMAT {
            return Err(ModelError::Data(format!(
                "{}: format {:?}, this build reads {MANIFEST_FORMAT:?}",
                mpath.display(),
                manifest.format
            )));
        }
        if manifest.token_bytes != 2 && manifest.token_bytes != 4 {
            return Err(ModelError::Data(format!(
                "{}: {} bytes per token (2 or 4 expected)",
                mpath.display(),
                manifest.token_bytes
            )));
        }
        let tpath = dir.join(TOKENIZER_FILE);
        let tok = std::fs::read(&tpath).map_err(|e| ModelError::io(&tpath, e))?;
        let tok_hash = blake3::hash(&tok).to_hex().to_string();
        if tok_hash != manifest.tokenizer_blake3 {
            return Err(ModelError::Data(format!(
                "{}: BLAKE3 {tok_hash} differs from the manifest's {}",
                tpath.display(),
                manifest.tokenizer_blake3
            )));
        }
        let train = Split::open(dir, &manifest.train, manifest.token_bytes, seq_len)?;
        let held_out = Split::open(dir, &manifest.held_out, manifest.token_bytes, seq_len)?;
        if train.windows() == 0 {
            return Err(ModelError::Data(format!(
                "{}: the training split has no window of {} tokens",
                dir.display(),
                seq_len + 1
            )));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest,
            manifest_blake3,
            seq_len,
            seed,
            train,
            held_out,
        })
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    /// BLAKE3 (hex) of `manifest.json`: the dataset's name in a run.
    pub fn manifest_blake3(&self) -> &str {
        &self.manifest_blake3
    }
    /// The tokenizer file inside the dataset.
    pub fn tokenizer_path(&self) -> PathBuf {
        self.dir.join(TOKENIZER_FILE)
    }
    /// Windows in the training split (one pass).
    pub fn train_windows(&self) -> u64 {
        self.train.windows()
    }
    /// Windows in the held-out split.
    pub fn held_out_count(&self) -> u64 {
        self.held_out.windows()
    }

    /// Checks every shard's hash now (a start-up check; windows check lazily anyway).
    pub fn verify_all(&self) -> Result<()> {
        for s in self.train.shards.iter().chain(&self.held_out.shards) {
            s.bytes()?;
        }
        Ok(())
    }

    /// The split and window index of sample `id`.
    pub fn locate(&self, id: u64) -> Result<(bool, u64)> {
        if id >= HELD_OUT_BASE {
            let w = id - HELD_OUT_BASE;
            if w >= self.held_out.windows() {
                return Err(ModelError::Data(format!(
                    "held-out window {w} asked of a split of {}",
                    self.held_out.windows()
                )));
            }
            return Ok((true, w));
        }
        let n = self.train.windows();
        let key = pass_key(self.seed, id / n);
        Ok((false, permute(id % n, n, &key)))
    }

    fn read_window(&self, split: &Split, w: u64) -> Result<Vec<u32>> {
        let (k, local) = split.locate(w);
        let shard = &split.shards[k];
        let tb = usize::from(self.manifest.token_bytes);
        let start = local as usize * self.seq_len;
        let end = start + self.seq_len + 1;
        if end as u64 > shard.tokens {
            return Err(ModelError::Data(format!(
                "{}: window {local} runs past the shard's end",
                shard.path.display()
            )));
        }
        let bytes = &shard.bytes()?[start * tb..end * tb];
        let tokens: Vec<u32> = if tb == 2 {
            bytes
                .chunks_exact(2)
                .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
                .collect()
        } else {
            bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        if let Some(bad) = tokens
            .iter()
            .find(|t| u64::from(**t) >= self.manifest.vocab_size)
        {
            return Err(ModelError::Data(format!(
                "{}: token {bad} outside the vocabulary of {}",
                shard.path.display(),
                self.manifest.vocab_size
            )));
        }
        Ok(tokens)
    }
}

impl Dataset for PreparedDataset {
    fn seq_len(&self) -> usize {
        self.seq_len
    }
    fn vocab_size(&self) -> usize {
        self.manifest.vocab_size as usize
    }
    fn window(&self, id: u64) -> Result<Vec<u32>> {
        let (held, w) = self.locate(id)?;
        self.read_window(if held { &self.held_out } else { &self.train }, w)
    }
    fn fingerprint(&self) -> blake3::Hash {
        let mut h = blake3::Hasher::new();
        h.update(b"iota-model/prepared/v1");
        h.update(self.manifest_blake3.as_bytes());
        h.update(&(self.seq_len as u64).to_le_bytes());
        h.update(&self.seed.to_le_bytes());
        h.finalize()
    }
    fn held_out_windows(&self) -> Option<u64> {
        Some(self.held_out.windows())
    }
    fn pass_of(&self, id: u64) -> u64 {
        if id >= HELD_OUT_BASE {
            return 0;
        }
        id / self.train.windows()
    }
}

/// Round keys of pass `pass` of a run seeded `seed`.
fn pass_key(seed: u64, pass: u64) -> [u64; ROUNDS] {
    let mut h = blake3::Hasher::new_derive_key("iota-model prepared dataset window permutation v1");
    h.update(&seed.to_le_bytes());
    h.update(&pass.to_le_bytes());
    let mut out = [0u8; ROUNDS * 8];
    h.finalize_xof().fill(&mut out);
    std::array::from_fn(|i| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&out[i * 8..i * 8 + 8]);
        u64::from_le_bytes(b)
    })
}

const ROUNDS: usize = 6;

fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A bijection of `0..n` chosen by `key`: a balanced Feistel network over the smallest
/// even-bit power of two that holds `n`, walking the cycle until the value falls inside `0..n`
/// (fewer than four steps on average). No table: O(1) memory for any `n`.
pub(crate) fn permute(i: u64, n: u64, key: &[u64; ROUNDS]) -> u64 {
    debug_assert!(i < n);
    if n <= 1 {
        return 0;
    }
    let bits = 64 - (n - 1).leading_zeros();
    let half = bits.div_ceil(2);
    let mask = (1u64 << half) - 1;
    let mut x = i;
    loop {
        let (mut l, mut r) = (x >> half, x & mask);
        for k in key {
            let f = mix(r ^ k) & mask;
            (l, r) = (r, l ^ f);
        }
        x = (l << half) | r;
        if x < n {
            return x;
        }
    }
}
