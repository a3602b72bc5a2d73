//! Exported checkpoints: a trained model out of the pipeline, in one directory that any
//! safetensors reader can use (the format is specified in the crate's README, "Exported
//! checkpoints").
//!
//! ```text
//! <dir>/model.safetensors   every stage's weights, f32, under their canonical names
//! <dir>/config.json         the ModelConfig (ModelConfig::from_json_file reads it)
//! <dir>/tokenizer.json      the tokenizer, when one was given
//! ```
//!
//! The canonical parameter names are already unique across stages (blocks are numbered
//! model-wide; `blocks.{i}.encoder.weight` sits on the last block of a sending stage,
//! `blocks.{i}.decoder.weight` on the first block of the receiving one), so they are used as
//! they are. The safetensors metadata entry `iota` records the format and BLAKE3 digests of the
//! tensors, of `config.json` and of `tokenizer.json`: a loader refuses a corrupt file or files
//! from different exports. [`write_export`] writes into a temporary sibling directory, fsyncs it
//! and renames it into place, so a reader sees a whole export or none.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Tensor};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

use crate::config::{MAX_CONFIG_BYTES, ModelConfig};
use crate::error::{ModelError, Result};
use crate::st;
use crate::stage::{Stage, StageOptions};

/// The weights file of an export.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The model config of an export.
pub const CONFIG_FILE: &str = "config.json";
/// The tokenizer of an export, when it has one.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// `kind` in the weights file's metadata.
pub const EXPORT_KIND: &str = "iota-export";
/// `format` in the weights file's metadata.
pub const EXPORT_FORMAT: u32 = 1;

/// The `iota` metadata entry of `model.safetensors` (field order fixed: bytes are deterministic).
#[derive(Serialize, Deserialize, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
struct ExportMeta {
    kind: String,
    format: u32,
    /// BLAKE3 (hex) of the tensors, see [`tensors_digest`].
    weights_blake3: String,
    /// BLAKE3 (hex) of `config.json`'s bytes.
    config_blake3: String,
    /// BLAKE3 (hex) of `tokenizer.json`'s bytes; `None` when the export has no tokenizer.
    tokenizer_blake3: Option<String>,
}

/// A loaded export.
pub struct Exported {
    /// The model config from `config.json`.
    pub config: ModelConfig,
    /// Stages `0..K` holding the exported weights.
    pub stages: Vec<Stage>,
    /// The tokenizer from `tokenizer.json`, when the export has one.
    pub tokenizer: Option<Tokenizer>,
    /// `tokenizer.json`'s bytes, to pass on to a later [`write_export`].
    pub tokenizer_json: Option<Vec<u8>>,
}

impl std::fmt::Debug for Exported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exported")
            .field("config", &self.config.name)
            .field("stages", &self.stages.len())
            .field("tokenizer", &self.tokenizer.is_some())
            .finish()
    }
}

/// Error if `stages` are not stages `0..K` of one config, in order.
pub(crate) fn check_whole_model(stages: &[Stage]) -> Result<&ModelConfig> {
    let cfg = stages
        .first()
        .ok_or_else(|| ModelError::InvalidInput("no stages given".into()))?
        .config();
    if stages.len() != cfg.num_stages() {
        return Err(ModelError::InvalidInput(format!(
            "{} stages given, config {:?} has {}",
            stages.len(),
            cfg.name,
            cfg.num_stages()
        )));
    }
    for (k, s) in stages.iter().enumerate() {
        if s.index() != k || s.config() != cfg {
            return Err(ModelError::InvalidInput(format!(
                "stage at position {k} is stage {} of config {:?}",
                s.index(),
                s.config().name
            )));
        }
    }
    Ok(cfg)
}

/// Every parameter of the model: name -> shape, from the config alone.
fn expected_tensors(cfg: &ModelConfig) -> Result<BTreeMap<String, Vec<usize>>> {
    let mut out = BTreeMap::new();
    for k in 0..cfg.num_stages() {
        for (name, shape) in cfg.stage_param_shapes(k)? {
            if out.insert(name.clone(), shape).is_some() {
                return Err(ModelError::Config(format!(
                    "parameter name {name} occurs in two stages"
                )));
            }
        }
    }
    Ok(out)
}

/// BLAKE3 of named f32 tensors: in byte order of their names, each as its name's length (u64
/// little-endian) and bytes, its rank and dimensions (u64 LE each), its data's length (u64 LE)
/// and the data (f32 LE).
fn tensors_digest<'a>(tensors: impl Iterator<Item = (&'a str, &'a [usize], &'a [u8])>) -> String {
    let mut sorted: Vec<_> = tensors.collect();
    sorted.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let mut h = blake3::Hasher::new();
    for (name, shape, data) in sorted {
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(&(shape.len() as u64).to_le_bytes());
        for d in shape {
            h.update(&(*d as u64).to_le_bytes());
        }
        h.update(&(data.len() as u64).to_le_bytes());
        h.update(data);
    }
    h.finalize().to_hex().to_string()
}

fn parse_tokenizer(bytes: &[u8], what: &str) -> Result<Tokenizer> {
    Tokenizer::from_bytes(bytes).map_err(|e| ModelError::Tokenizer(format!("{what}: {e}")))
}

/// The files of an export, `(file name, bytes)`: deterministic for equal weights, config and
/// tokenizer.
pub fn export_files(
    stages: &[Stage],
    tokenizer_json: Option<&[u8]>,
) -> Result<Vec<(&'static str, Vec<u8>)>> {
    let cfg = check_whole_model(stages)?;
    if let Some(bytes) = tokenizer_json {
        let tok = parse_tokenizer(bytes, "tokenizer given for export")?;
        let n = tok.get_vocab_size(true);
        if n > cfg.vocab_size {
            return Err(ModelError::InvalidInput(format!(
                "the tokenizer has {n} ids, the model's vocabulary only {}",
                cfg.vocab_size
            )));
        }
    }
    let config_json = cfg.to_json()?.into_bytes();
    let mut tensors = Vec::new();
    let mut names = BTreeSet::new();
    for stage in stages {
        for p in stage.params() {
            if !names.insert(p.name().to_string()) {
                return Err(ModelError::InvalidInput(format!(
                    "parameter {} occurs twice",
                    p.name()
                )));
            }
            let t = p.var().as_tensor();
            let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            if values.iter().any(|v| !v.is_finite()) {
                return Err(ModelError::NonFinite(format!(
                    "parameter {} (stage {})",
                    p.name(),
                    stage.index()
                )));
            }
            tensors.push((
                p.name().to_string(),
                st::f32_view(t.dims().to_vec(), &values),
            ));
        }
    }
    let meta = ExportMeta {
        kind: EXPORT_KIND.into(),
        format: EXPORT_FORMAT,
        weights_blake3: tensors_digest(
            tensors
                .iter()
                .map(|(n, v)| (n.as_str(), v.shape.as_slice(), v.data.as_slice())),
        ),
        config_blake3: blake3::hash(&config_json).to_hex().to_string(),
        tokenizer_blake3: tokenizer_json.map(|b| blake3::hash(b).to_hex().to_string()),
    };
    let weights = st::encode(tensors, &serde_json::to_string(&meta)?)?;
    let mut files = vec![(WEIGHTS_FILE, weights), (CONFIG_FILE, config_json)];
    if let Some(bytes) = tokenizer_json {
        files.push((TOKENIZER_FILE, bytes.to_vec()));
    }
    Ok(files)
}

/// Write the whole model (`stages` `0..K` of one config) and optionally its tokenizer's JSON to
/// the directory `dir`, atomically: the files go into a new temporary sibling directory, are
/// fsynced, and the directory is renamed to `dir`. An existing `dir` is replaced only if it
/// holds nothing but export files (it is moved aside first, so for a moment `dir` is absent,
/// never partial; a crash in that moment leaves the old export in a hidden sibling
/// `.<name>.export-old.*`). Not for several writers of the same `dir` at once.
pub fn write_export(dir: &Path, stages: &[Stage], tokenizer_json: Option<&[u8]>) -> Result<()> {
    let files = export_files(stages, tokenizer_json)?;
    write_dir_atomically(dir, &files)
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn sibling(parent: &Path, name: &str, what: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    parent.join(format!(
        ".{name}.{what}.{}.{}.{nanos}",
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| ModelError::io(dir, e))
}

/// Error unless `dir` is absent or a directory of export files only (so that replacing it
/// cannot delete anything else). Returns whether it exists.
fn replaceable(dir: &Path) -> Result<bool> {
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(ModelError::io(dir, e)),
    };
    if !meta.is_dir() {
        return Err(ModelError::InvalidInput(format!(
            "{} exists and is not a directory",
            dir.display()
        )));
    }
    for entry in std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))? {
        let entry = entry.map_err(|e| ModelError::io(dir, e))?;
        let name = entry.file_name();
        let ok = [WEIGHTS_FILE, CONFIG_FILE, TOKENIZER_FILE]
            .iter()
            .any(|f| name == *f)
            && entry.file_type().map(|t| t.is_file()).unwrap_or(false);
        if !ok {
            return Err(ModelError::InvalidInput(format!(
                "{} holds {:?}, which is not part of an export: not replacing it",
                dir.display(),
                name
            )));
        }
    }
    Ok(true)
}

fn write_dir_atomically(dir: &Path, files: &[(&str, Vec<u8>)]) -> Result<()> {
    use std::io::Write;
    let name = dir
        .file_name()
        .ok_or_else(|| {
            ModelError::InvalidInput(format!("{} does not name a directory", dir.display()))
        })?
        .to_string_lossy()
        .into_owned();
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| ModelError::io(&parent, e))?;
    let exists = replaceable(dir)?;
    let tmp = sibling(&parent, &name, "export-tmp");
    std::fs::create_dir(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    let written = (|| {
        for (file, bytes) in files {
            let path = tmp.join(file);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(|e| ModelError::io(&path, e))?;
            f.write_all(bytes).map_err(|e| ModelError::io(&path, e))?;
            f.sync_all().map_err(|e| ModelError::io(&path, e))?;
        }
        sync_dir(&tmp)
    })();
    if let Err(e) = written {
        std::fs::remove_dir_all(&tmp).ok();
        return Err(e);
    }
    let old = exists.then(|| sibling(&parent, &name, "export-old"));
    if let Some(old) = &old
        && let Err(e) = std::fs::rename(dir, old)
    {
        std::fs::remove_dir_all(&tmp).ok();
        return Err(ModelError::io(dir, e));
    }
    if let Err(e) = std::fs::rename(&tmp, dir) {
        // Put the previous export back rather than leave none.
        if let Some(old) = &old {
            std::fs::rename(old, dir).ok();
        }
        std::fs::remove_dir_all(&tmp).ok();
        return Err(ModelError::io(dir, e));
    }
    sync_dir(&parent)?;
    if let Some(old) = old
        && let Err(e) = std::fs::remove_dir_all(&old)
    {
        // The new export is in place; a leftover hidden directory is only untidy.
        tracing::warn!(target: "iota_model::export", path = %old.display(), error = %e, "could not remove the replaced export");
    }
    Ok(())
}

fn corrupt(path: &Path, why: impl std::fmt::Display) -> ModelError {
    ModelError::Checkpoint(format!("{}: {why}", path.display()))
}

/// Read `path` if it exists.
fn read_optional(path: &Path) -> Result<Option<Vec<u8>>> {
    match std::fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ModelError::io(path, e)),
    }
}

fn read_config(path: &Path) -> Result<(ModelConfig, Vec<u8>)> {
    use std::io::Read as _;
    let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    let meta = file.metadata().map_err(|e| ModelError::io(path, e))?;
    if !meta.is_file() {
        return Err(corrupt(path, "not a regular file"));
    }
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| ModelError::io(path, e))?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(corrupt(
            path,
            format!("larger than {MAX_CONFIG_BYTES} bytes"),
        ));
    }
    let text = std::str::from_utf8(&bytes).map_err(|e| corrupt(path, e))?;
    let cfg = ModelConfig::from_json_str(text).map_err(|e| corrupt(path, e))?;
    Ok((cfg, bytes))
}

/// Load an export written by [`write_export`] onto the device and dtypes of `opts`. Every file
/// is checked before any stage is built: the config, the metadata and digests, and each
/// tensor's presence, dtype (F32), shape and finiteness; errors name the file and the tensor.
pub fn load_export(dir: &Path, opts: &StageOptions) -> Result<Exported> {
    let config_path = dir.join(CONFIG_FILE);
    let weights_path = dir.join(WEIGHTS_FILE);
    let tokenizer_path = dir.join(TOKENIZER_FILE);
    let (config, config_bytes) = read_config(&config_path)?;
    let bytes = std::fs::read(&weights_path).map_err(|e| ModelError::io(&weights_path, e))?;
    let (tensors, meta) = match st::decode(&bytes) {
        Ok(x) => x,
        Err(e) => return Err(corrupt(&weights_path, format!("not a valid export: {e}"))),
    };
    let meta: ExportMeta = serde_json::from_str(&meta).map_err(|e| {
        corrupt(
            &weights_path,
            format!("bad {:?} metadata: {e}", st::META_KEY),
        )
    })?;
    if meta.kind != EXPORT_KIND || meta.format != EXPORT_FORMAT {
        return Err(corrupt(
            &weights_path,
            format!(
                "holds {:?} format {}, expected {EXPORT_KIND:?} format {EXPORT_FORMAT}",
                meta.kind, meta.format
            ),
        ));
    }
    if blake3::hash(&config_bytes).to_hex().as_str() != meta.config_blake3 {
        return Err(corrupt(
            &config_path,
            format!(
                "differs from the config {} was exported with (BLAKE3 mismatch)",
                weights_path.display()
            ),
        ));
    }

    // Structure first, so that a wrong file gets a precise message, then the digest.
    let expected = expected_tensors(&config)?;
    if let Some(extra) = tensors
        .names()
        .into_iter()
        .filter(|n| !expected.contains_key(*n))
        .min()
    {
        return Err(corrupt(
            &weights_path,
            format!("extra tensor {extra:?}, not a parameter of config.json's model"),
        ));
    }
    let mut views = Vec::with_capacity(expected.len());
    for (name, shape) in &expected {
        let view = tensors
            .tensor(name)
            .map_err(|_| corrupt(&weights_path, format!("missing tensor {name:?}")))?;
        if view.dtype() != Dtype::F32 {
            return Err(corrupt(
                &weights_path,
                format!("tensor {name:?} has dtype {:?}, expected F32", view.dtype()),
            ));
        }
        if view.shape() != shape.as_slice() {
            return Err(corrupt(
                &weights_path,
                format!(
                    "tensor {name:?} has shape {:?}, config.json gives {shape:?}",
                    view.shape()
                ),
            ));
        }
        views.push((name.as_str(), view));
    }
    let digest = tensors_digest(views.iter().map(|(n, v)| (*n, v.shape(), v.data())));
    if digest != meta.weights_blake3 {
        return Err(corrupt(
            &weights_path,
            "tensor data differ from the BLAKE3 recorded in its metadata (corrupt file)",
        ));
    }
    let mut values: BTreeMap<&str, (Vec<usize>, Vec<f32>)> = BTreeMap::new();
    for (name, view) in &views {
        let v = st::le_to_f32(view.data()).map_err(|e| corrupt(&weights_path, e))?;
        if v.iter().any(|x| !x.is_finite()) {
            return Err(corrupt(
                &weights_path,
                format!("tensor {name:?} holds NaN or infinity"),
            ));
        }
        values.insert(name, (view.shape().to_vec(), v));
    }
    drop(views);

    let tokenizer_json = read_optional(&tokenizer_path)?;
    let tokenizer = match (&meta.tokenizer_blake3, &tokenizer_json) {
        (None, None) => None,
        (Some(_), None) => {
            return Err(corrupt(
                &tokenizer_path,
                format!("missing, but {} records one", weights_path.display()),
            ));
        }
        (None, Some(_)) => {
            return Err(corrupt(
                &tokenizer_path,
                format!("not part of the export in {}", weights_path.display()),
            ));
        }
        (Some(h), Some(b)) => {
            if blake3::hash(b).to_hex().as_str() != h {
                return Err(corrupt(
                    &tokenizer_path,
                    format!(
                        "differs from the tokenizer {} was exported with (BLAKE3 mismatch)",
                        weights_path.display()
                    ),
                ));
            }
            Some(parse_tokenizer(b, &tokenizer_path.display().to_string())?)
        }
    };

    let mut stages = Vec::with_capacity(config.num_stages());
    for k in 0..config.num_stages() {
        let stage = Stage::with_weights(&config, k, opts.clone(), &mut |name, _| {
            let (shape, v) = values
                .remove(name)
                .ok_or_else(|| corrupt(&weights_path, format!("missing tensor {name:?}")))?;
            Ok(Tensor::from_vec(v, shape, &candle_core::Device::Cpu)?)
        })?;
        stages.push(stage);
    }
    Ok(Exported {
        config,
        stages,
        tokenizer,
        tokenizer_json,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{GenerateOptions, generate, generate_tokens, last_logits};
    use crate::st::OwnedView;

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("iota-export-{}-{name}", std::process::id()));
        std::fs::remove_dir_all(&d).ok();
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Stages whose weights are not the initial ones (so a loader that re-initialised, or put
    /// a tensor under another name, would be caught), with sharp attention.
    fn moved_stages(cfg: &ModelConfig) -> Vec<Stage> {
        let stages = Stage::all(cfg, &StageOptions::cpu()).unwrap();
        for s in &stages {
            for (i, p) in s.params().iter().enumerate() {
                let t = p.var().as_tensor();
                let moved = ((t * (1.5 + 0.1 * i as f64)).unwrap() + 0.01).unwrap();
                p.var().set(&moved).unwrap();
            }
            s.mark_weights_changed();
        }
        stages
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    fn sequence(cfg: &ModelConfig) -> Tensor {
        let ids: Vec<u32> = (0..24).map(|i| (i * 7 % cfg.vocab_size) as u32).collect();
        Tensor::from_vec(ids, (2, 12), &candle_core::Device::Cpu).unwrap()
    }

    fn configs() -> Vec<ModelConfig> {
        let sharp = |c: ModelConfig| ModelConfig { init_std: 0.3, ..c };
        vec![
            sharp(ModelConfig::tiny()),
            sharp(ModelConfig::tiny().with_stages(vec![1, 2, 2])),
            sharp(
                ModelConfig::tiny()
                    .with_bottleneck(32)
                    .with_stages(vec![2, 1]),
            ),
            sharp(ModelConfig::tiny().with_stages(vec![2])),
        ]
    }

    /// Export, load: the same weights bit for bit, so the same logits and loss bit for bit;
    /// and a second export of equal weights has equal bytes.
    #[test]
    fn round_trip_is_bit_identical() {
        let root = temp_dir("round-trip");
        for (n, cfg) in configs().into_iter().enumerate() {
            let stages = moved_stages(&cfg);
            let dir = root.join(format!("m{n}"));
            write_export(&dir, &stages, None).unwrap();
            let back = load_export(&dir, &StageOptions::cpu()).unwrap();
            assert_eq!(back.config, cfg);
            assert!(back.tokenizer.is_none());
            assert_eq!(back.stages.len(), stages.len());
            let fresh = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
            for ((a, b), f) in stages.iter().zip(&back.stages).zip(&fresh) {
                assert_eq!(a.index(), b.index());
                for ((pa, pb), pf) in a.params().iter().zip(b.params()).zip(f.params()) {
                    assert_eq!(pa.name(), pb.name());
                    let (va, vb) = (values(pa.var().as_tensor()), values(pb.var().as_tensor()));
                    assert_eq!(va, vb, "{}", pa.name());
                    assert_ne!(va, values(pf.var().as_tensor()), "{} moved", pa.name());
                }
            }
            let seq = sequence(&cfg);
            let (la, lb) = (
                last_logits(&stages, &seq).unwrap(),
                last_logits(&back.stages, &seq).unwrap(),
            );
            assert_eq!(values(&la), values(&lb));
            assert_ne!(values(&la), values(&last_logits(&fresh, &seq).unwrap()));
            let g = crate::data::GrammarCorpus::new(0, 16).unwrap();
            let loss = |s: &[Stage]| crate::generate::held_out_loss(s, &g, &[1, 2, 3], 2).unwrap();
            assert_eq!(loss(&stages), loss(&back.stages));
            // Deterministic bytes.
            let again = root.join(format!("m{n}-again"));
            write_export(&again, &back.stages, None).unwrap();
            for f in [WEIGHTS_FILE, CONFIG_FILE] {
                assert_eq!(
                    std::fs::read(dir.join(f)).unwrap(),
                    std::fs::read(again.join(f)).unwrap(),
                    "{f}"
                );
            }
            assert!(!again.join(TOKENIZER_FILE).exists());
        }
        // f64 stages load the f32 values exactly.
        let f64_opts = StageOptions {
            param_dtype: DType::F64,
            compute_dtype: DType::F64,
            ..StageOptions::cpu()
        };
        let back = load_export(&root.join("m0"), &f64_opts).unwrap();
        let orig = load_export(&root.join("m0"), &StageOptions::cpu()).unwrap();
        for (a, b) in back.stages.iter().zip(&orig.stages) {
            assert_eq!(a.params()[0].var().dtype(), DType::F64);
            assert_eq!(
                values(
                    &a.params()[0]
                        .var()
                        .as_tensor()
                        .to_dtype(DType::F32)
                        .unwrap()
                ),
                values(b.params()[0].var().as_tensor())
            );
        }
        std::fs::remove_dir_all(&root).ok();
    }

    /// Copy the export `src` to `dst`, re-encoding its weights after `edit` (with the original
    /// metadata, digests included).
    fn rewrite(src: &Path, dst: &Path, edit: impl FnOnce(&mut Vec<(String, OwnedView)>)) {
        std::fs::create_dir_all(dst).unwrap();
        for f in [CONFIG_FILE, TOKENIZER_FILE] {
            if src.join(f).exists() {
                std::fs::copy(src.join(f), dst.join(f)).unwrap();
            }
        }
        let bytes = std::fs::read(src.join(WEIGHTS_FILE)).unwrap();
        let (tensors, meta) = st::decode(&bytes).unwrap();
        let mut list: Vec<(String, OwnedView)> = tensors
            .tensors()
            .into_iter()
            .map(|(n, v)| {
                (
                    n,
                    OwnedView {
                        dtype: v.dtype(),
                        shape: v.shape().to_vec(),
                        data: v.data().to_vec(),
                    },
                )
            })
            .collect();
        edit(&mut list);
        std::fs::write(dst.join(WEIGHTS_FILE), st::encode(list, &meta).unwrap()).unwrap();
    }

    fn load_err(dir: &Path) -> String {
        load_export(dir, &StageOptions::cpu())
            .unwrap_err()
            .to_string()
    }

    fn find(list: &mut [(String, OwnedView)], name: &str) -> usize {
        list.iter().position(|(n, _)| n == name).unwrap()
    }

    #[test]
    fn damaged_exports_are_refused_naming_file_and_tensor() {
        let root = temp_dir("damaged");
        let cfg = ModelConfig::tiny();
        let good = root.join("good");
        write_export(&good, &moved_stages(&cfg), None).unwrap();
        // Re-encoding without a change loads: the edits below are what is refused.
        let same = root.join("same");
        rewrite(&good, &same, |_| {});
        load_export(&same, &StageOptions::cpu()).unwrap();
        let weights = |d: &Path| d.join(WEIGHTS_FILE).display().to_string();

        let d = root.join("missing");
        rewrite(&good, &d, |l| {
            let i = find(l, "blocks.1.decoder.weight");
            l.remove(i);
        });
        let e = load_err(&d);
        assert!(e.contains(&weights(&d)), "{e}");
        assert!(
            e.contains("missing tensor \"blocks.1.decoder.weight\""),
            "{e}"
        );

        let d = root.join("extra");
        rewrite(&good, &d, |l| {
            l.push((
                "blocks.7.attn.wq".into(),
                st::f32_view(vec![2], &[1.0, 2.0]),
            ))
        });
        let e = load_err(&d);
        assert!(e.contains(&weights(&d)), "{e}");
        assert!(e.contains("extra tensor \"blocks.7.attn.wq\""), "{e}");

        let d = root.join("dtype");
        rewrite(&good, &d, |l| {
            let i = find(l, "norm.weight");
            let v = st::le_to_f32(&l[i].1.data).unwrap();
            l[i].1.dtype = Dtype::F64;
            l[i].1.data = v.iter().flat_map(|x| f64::from(*x).to_le_bytes()).collect();
        });
        let e = load_err(&d);
        assert!(e.contains(&weights(&d)), "{e}");
        assert!(
            e.contains("tensor \"norm.weight\" has dtype F64, expected F32"),
            "{e}"
        );

        let d = root.join("shape");
        rewrite(&good, &d, |l| {
            let i = find(l, "blocks.0.ffn.w_up");
            l[i].1.shape = vec![32, 64];
        });
        let e = load_err(&d);
        assert!(e.contains(&weights(&d)), "{e}");
        assert!(
            e.contains(
                "tensor \"blocks.0.ffn.w_up\" has shape [32, 64], config.json gives [64, 32]"
            ),
            "{e}"
        );

        // A changed value, in a well-formed file: only the digest can tell.
        let d = root.join("value");
        rewrite(&good, &d, |l| {
            let i = find(l, "head.weight");
            l[i].1.data[5] ^= 0x10;
        });
        let e = load_err(&d);
        assert!(e.contains(&weights(&d)) && e.contains("corrupt"), "{e}");

        // Two tensors of one shape swapped: names are hashed with their data.
        let d = root.join("swapped");
        rewrite(&good, &d, |l| {
            let (g, u) = (find(l, "blocks.0.ffn.w_gate"), find(l, "blocks.0.ffn.w_up"));
            let data = l[g].1.data.clone();
            l[g].1.data = l[u].1.data.clone();
            l[u].1.data = data;
        });
        assert!(load_err(&d).contains("corrupt"));

        // Raw damage: a flipped byte, a truncated file, no metadata.
        let d = root.join("flipped");
        rewrite(&good, &d, |_| {});
        let mut bytes = std::fs::read(d.join(WEIGHTS_FILE)).unwrap();
        let n = bytes.len();
        bytes[n - 3] ^= 1;
        std::fs::write(d.join(WEIGHTS_FILE), &bytes).unwrap();
        let e = load_err(&d);
        assert!(e.contains(&weights(&d)) && e.contains("corrupt"), "{e}");
        std::fs::write(d.join(WEIGHTS_FILE), &bytes[..n / 2]).unwrap();
        let e = load_err(&d);
        assert!(
            e.contains(&weights(&d)) && e.contains("not a valid export"),
            "{e}"
        );
        let plain =
            safetensors::serialize(vec![("x", st::f32_view(vec![1], &[1.0]))], None).unwrap();
        std::fs::write(d.join(WEIGHTS_FILE), plain).unwrap();
        let e = load_err(&d);
        assert!(e.contains(&weights(&d)) && e.contains("metadata"), "{e}");

        // A config.json from another model, or none.
        let d = root.join("config");
        rewrite(&good, &d, |_| {});
        let other = ModelConfig {
            norm_eps: 1e-6,
            ..cfg.clone()
        };
        std::fs::write(d.join(CONFIG_FILE), other.to_json().unwrap()).unwrap();
        let e = load_err(&d);
        assert!(
            e.contains(&d.join(CONFIG_FILE).display().to_string()),
            "{e}"
        );
        assert!(e.contains("BLAKE3"), "{e}");
        std::fs::remove_file(d.join(CONFIG_FILE)).unwrap();
        let e = load_err(&d);
        assert!(
            e.contains(&d.join(CONFIG_FILE).display().to_string()),
            "{e}"
        );
        std::fs::remove_dir_all(&root).ok();
    }

    fn tokenizer_json(root: &Path) -> Vec<u8> {
        let text = root.join("corpus.txt");
        let line = "the cat sat on the mat. the dog sat on the log. a cat and a dog met. ";
        std::fs::write(&text, line.repeat(40)).unwrap();
        let out = root.join("trained-tokenizer.json");
        crate::data::train_bpe_tokenizer(&[text], 300, &out).unwrap();
        std::fs::read(out).unwrap()
    }

    /// The tokenizer travels with the weights; generation from the loaded export gives the
    /// original's text; a tokenizer that does not belong is refused.
    #[test]
    fn tokenizer_travels_with_the_export() {
        let root = temp_dir("tokenizer");
        let tok_bytes = tokenizer_json(&root);
        let tok = Tokenizer::from_bytes(&tok_bytes).unwrap();
        let cfg = ModelConfig {
            init_std: 0.3,
            ..ModelConfig::tiny().with_vocab_size(tok.get_vocab_size(true))
        };
        let stages = moved_stages(&cfg);
        let dir = root.join("export");
        write_export(&dir, &stages, Some(&tok_bytes)).unwrap();
        let back = load_export(&dir, &StageOptions::cpu()).unwrap();
        assert_eq!(back.tokenizer_json.as_deref(), Some(tok_bytes.as_slice()));
        let loaded_tok = back.tokenizer.as_ref().unwrap();
        for opts in [
            GenerateOptions::greedy(12),
            GenerateOptions::sampled(12, 1.0, 0.9, 3),
        ] {
            let a = generate(&stages, &tok, "the cat", &opts).unwrap();
            let b = generate(&back.stages, loaded_tok, "the cat", &opts).unwrap();
            assert_eq!(a, b);
            let prompt = tok.encode("the cat", false).unwrap().get_ids().to_vec();
            let ta = generate_tokens(&stages, &prompt, &opts).unwrap().tokens;
            let tb = generate_tokens(&back.stages, &prompt, &opts)
                .unwrap()
                .tokens;
            assert_eq!(ta.len(), 12);
            assert_eq!(ta, tb);
        }
        // A bigger vocabulary than the model's is refused at export.
        let small = ModelConfig::tiny();
        assert!(
            write_export(&root.join("small"), &moved_stages(&small), Some(&tok_bytes)).is_err()
        );
        assert!(write_export(&root.join("junk"), &stages, Some(b"{not json")).is_err());
        // Changed, missing, or not part of the export.
        let tok_path = dir.join(TOKENIZER_FILE).display().to_string();
        let mut changed = tok_bytes.clone();
        changed.extend_from_slice(b"\n");
        std::fs::write(dir.join(TOKENIZER_FILE), &changed).unwrap();
        let e = load_err(&dir);
        assert!(e.contains(&tok_path) && e.contains("BLAKE3"), "{e}");
        std::fs::remove_file(dir.join(TOKENIZER_FILE)).unwrap();
        let e = load_err(&dir);
        assert!(e.contains(&tok_path) && e.contains("missing"), "{e}");
        let bare = root.join("bare");
        write_export(&bare, &stages, None).unwrap();
        std::fs::write(bare.join(TOKENIZER_FILE), &tok_bytes).unwrap();
        let e = load_err(&bare);
        assert!(e.contains("not part of the export"), "{e}");
        std::fs::remove_dir_all(&root).ok();
    }

    /// The directory appears whole or not at all; an earlier export is replaced, anything else
    /// is left alone; no temporary directories remain.
    #[test]
    fn writes_are_atomic_and_replace_only_exports() {
        let root = temp_dir("atomic");
        let cfg = ModelConfig::tiny();
        let first = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
        let second = moved_stages(&cfg);
        let dir = root.join("out");
        write_export(&dir, &first, None).unwrap();
        write_export(&dir, &second, None).unwrap();
        let back = load_export(&dir, &StageOptions::cpu()).unwrap();
        let seq = sequence(&cfg);
        assert_eq!(
            values(&last_logits(&back.stages, &seq).unwrap()),
            values(&last_logits(&second, &seq).unwrap())
        );
        let names = |d: &Path| {
            let mut v: Vec<String> = std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        assert_eq!(names(&root), vec!["out".to_string()], "no leftovers");
        assert_eq!(names(&dir), vec![CONFIG_FILE, WEIGHTS_FILE]);

        // Something that is not an export is never replaced.
        let foreign = root.join("foreign");
        std::fs::create_dir_all(&foreign).unwrap();
        std::fs::write(foreign.join("notes.txt"), b"keep me").unwrap();
        let e = write_export(&foreign, &second, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("notes.txt"), "{e}");
        assert_eq!(
            std::fs::read(foreign.join("notes.txt")).unwrap(),
            b"keep me"
        );
        let file = root.join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(write_export(&file, &second, None).is_err());
        assert_eq!(std::fs::read(&file).unwrap(), b"x");
        // An incomplete model is refused before anything is written.
        assert!(write_export(&root.join("partial"), &second[1..], None).is_err());
        assert!(!root.join("partial").exists());
        let mut sorted = names(&root);
        sorted.retain(|n| n.starts_with('.'));
        assert!(sorted.is_empty(), "{sorted:?}");
        std::fs::remove_dir_all(&root).ok();
    }
}
