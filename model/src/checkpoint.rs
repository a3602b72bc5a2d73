//! safetensors checkpoints of a stage's weights and of its optimizer state.
//!
//! Weights are stored under their canonical names in f32; AdamW moments as `adamw.m.<name>` and
//! `adamw.v.<name>`; the outer momentum as one flat tensor. A JSON metadata entry records what the
//! file is, so that loading the wrong kind of file, another stage's weights or a mismatched shape
//! is an error instead of a silent partial load. Bytes are deterministic for equal contents.
//!
//! The metadata holds BLAKE3 fingerprints of the model config (its JSON) and of the stage's flat
//! layout (names and shapes in order); loading refuses a file whose fingerprints differ from the
//! stage's, naming both configs. Files are written to a unique temporary file beside the target,
//! fsynced, renamed over the target, and the directory is fsynced, so a crash leaves either the
//! old or the new checkpoint, and two writers never share a temporary file.

use std::path::Path;

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::merge::FlatLayout;
use crate::optim::{AdamW, OuterOptimizer};
use crate::st;
use crate::stage::Stage;

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Meta {
    kind: String,
    format: u32,
    config: String,
    stage: usize,
    #[serde(default)]
    step: u64,
    #[serde(default)]
    config_fingerprint: String,
    #[serde(default)]
    layout_fingerprint: String,
}

const FORMAT: u32 = 2;

/// BLAKE3 of the config's JSON: equal for configs that build identical models.
pub fn config_fingerprint(cfg: &crate::config::ModelConfig) -> Result<String> {
    Ok(blake3::hash(cfg.to_json()?.as_bytes()).to_hex().to_string())
}

fn tensor_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

static TMP_COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| ModelError::io(&parent, e))?;
    let name = path
        .file_name()
        .ok_or_else(|| ModelError::InvalidInput(format!("{} is not a file path", path.display())))?
        .to_string_lossy();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    // Unique per process, call and time; `create_new` refuses an existing file in any case.
    let tmp = parent.join(format!(
        ".{name}.{}.{}.{nanos}.tmp",
        std::process::id(),
        TMP_COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| ModelError::io(&tmp, e))?;
        f.write_all(bytes).map_err(|e| ModelError::io(&tmp, e))?;
        f.sync_all().map_err(|e| ModelError::io(&tmp, e))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(|e| ModelError::io(path, e))?;
        // Make the rename itself durable.
        std::fs::File::open(&parent)
            .and_then(|d| d.sync_all())
            .map_err(|e| ModelError::io(&parent, e))
    })();
    if result.is_err() {
        std::fs::remove_file(&tmp).ok();
    }
    result
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| ModelError::io(path, e))
}

fn check_meta(meta: &str, stage: &Stage, kind: &str) -> Result<Meta> {
    let m: Meta = serde_json::from_str(meta)
        .map_err(|e| ModelError::Checkpoint(format!("bad metadata: {e}")))?;
    if m.kind != kind || m.format != FORMAT {
        return Err(ModelError::Checkpoint(format!(
            "file holds {:?} (format {}), expected {kind:?} (format {FORMAT})",
            m.kind, m.format
        )));
    }
    if m.stage != stage.index() {
        return Err(ModelError::Checkpoint(format!(
            "file is for stage {}, this is stage {}",
            m.stage,
            stage.index()
        )));
    }
    let cfg_fp = config_fingerprint(stage.config())?;
    if m.config_fingerprint != cfg_fp {
        return Err(ModelError::Checkpoint(format!(
            "file was written for config {:?} (fingerprint {}), this stage is config {:?} \
             (fingerprint {cfg_fp}): the model shapes or hyper-parameters differ",
            m.config,
            short(&m.config_fingerprint),
            stage.config().name,
        )));
    }
    let layout_fp = FlatLayout::of(stage).fingerprint().to_hex().to_string();
    if m.layout_fingerprint != layout_fp {
        return Err(ModelError::Checkpoint(format!(
            "file's parameter layout (fingerprint {}) differs from stage {}'s ({})",
            short(&m.layout_fingerprint),
            stage.index(),
            short(&layout_fp)
        )));
    }
    Ok(m)
}

fn short(fp: &str) -> &str {
    fp.get(..16).unwrap_or(fp)
}

fn meta_json(stage: &Stage, kind: &str, step: u64) -> Result<String> {
    Ok(serde_json::to_string(&Meta {
        kind: kind.into(),
        format: FORMAT,
        config: stage.config().name.clone(),
        stage: stage.index(),
        step,
        config_fingerprint: config_fingerprint(stage.config())?,
        layout_fingerprint: FlatLayout::of(stage).fingerprint().to_hex().to_string(),
    })?)
}

/// Encode the stage's weights.
pub fn weights_to_bytes(stage: &Stage) -> Result<Vec<u8>> {
    let mut tensors = Vec::new();
    for p in stage.params() {
        let t = p.var().as_tensor();
        tensors.push((
            p.name().to_string(),
            st::f32_view(t.dims().to_vec(), &tensor_f32(t)?),
        ));
    }
    st::encode(tensors, &meta_json(stage, "stage-weights", 0)?)
}

/// Load weights into `stage`. Every tensor is decoded and checked (names, shapes, finiteness)
/// before any weight is written.
pub fn load_weights_bytes(stage: &Stage, bytes: &[u8]) -> Result<()> {
    let (tensors, meta) = st::decode(bytes)?;
    check_meta(&meta, stage, "stage-weights")?;
    if tensors.len() != stage.params().len() {
        return Err(ModelError::Checkpoint(format!(
            "{} tensors in file, stage has {} parameters",
            tensors.len(),
            stage.params().len()
        )));
    }
    let mut staged = Vec::with_capacity(stage.params().len());
    for p in stage.params() {
        let var = p.var();
        let (_, v) = st::read_f32(&tensors, p.name(), Some(var.dims()))?;
        if v.iter().any(|x| !x.is_finite()) {
            return Err(ModelError::NonFinite(format!(
                "checkpoint tensor {}",
                p.name()
            )));
        }
        staged.push(Tensor::from_vec(v, var.dims(), var.device())?.to_dtype(var.dtype())?);
    }
    for (p, t) in stage.params().iter().zip(staged) {
        p.var().set(&t)?;
    }
    stage.mark_weights_changed();
    Ok(())
}

/// Save the stage's weights to `path`.
pub fn save_weights(stage: &Stage, path: &Path) -> Result<()> {
    write(path, &weights_to_bytes(stage)?)
}

/// Load the stage's weights from `path`.
pub fn load_weights(stage: &Stage, path: &Path) -> Result<()> {
    load_weights_bytes(stage, &read(path)?)
}

/// Encode AdamW's moments and step count for `stage`.
pub fn adamw_to_bytes(opt: &AdamW, stage: &Stage) -> Result<Vec<u8>> {
    let (m, v) = opt.moments();
    if m.len() != stage.params().len() {
        return Err(ModelError::Checkpoint(
            "optimizer does not belong to this stage".into(),
        ));
    }
    let mut tensors = Vec::new();
    for ((p, m), v) in stage.params().iter().zip(m).zip(v) {
        tensors.push((
            format!("adamw.m.{}", p.name()),
            st::f32_view(m.dims().to_vec(), &tensor_f32(m)?),
        ));
        tensors.push((
            format!("adamw.v.{}", p.name()),
            st::f32_view(v.dims().to_vec(), &tensor_f32(v)?),
        ));
    }
    st::encode(tensors, &meta_json(stage, "adamw-state", opt.step_count())?)
}

/// Restore AdamW's moments and step count (checked completely before anything changes).
pub fn load_adamw_bytes(opt: &mut AdamW, stage: &Stage, bytes: &[u8]) -> Result<()> {
    let (tensors, meta) = st::decode(bytes)?;
    let meta = check_meta(&meta, stage, "adamw-state")?;
    if tensors.len() != 2 * stage.params().len() {
        return Err(ModelError::Checkpoint(format!(
            "{} tensors in file, expected {}",
            tensors.len(),
            2 * stage.params().len()
        )));
    }
    let (mut ms, mut vs) = (Vec::new(), Vec::new());
    for p in stage.params() {
        let var = p.var();
        for (prefix, out) in [("m", &mut ms), ("v", &mut vs)] {
            let name = format!("adamw.{prefix}.{}", p.name());
            let (_, data) = st::read_f32(&tensors, &name, Some(var.dims()))?;
            if data.iter().any(|x| !x.is_finite())
                || (prefix == "v" && data.iter().any(|x| *x < 0.0))
            {
                return Err(ModelError::Checkpoint(format!("invalid values in {name}")));
            }
            out.push(Tensor::from_vec(data, var.dims(), var.device())?.to_dtype(var.dtype())?);
        }
    }
    opt.set_state(meta.step, ms, vs)?;
    Ok(())
}

/// Save AdamW state to `path`.
pub fn save_adamw(opt: &AdamW, stage: &Stage, path: &Path) -> Result<()> {
    write(path, &adamw_to_bytes(opt, stage)?)
}

/// Load AdamW state from `path`.
pub fn load_adamw(opt: &mut AdamW, stage: &Stage, path: &Path) -> Result<()> {
    load_adamw_bytes(opt, stage, &read(path)?)
}

/// Encode the outer optimizer's momentum buffer for `stage`.
pub fn outer_to_bytes(opt: &OuterOptimizer, stage: &Stage) -> Result<Vec<u8>> {
    if opt.step_in_progress() {
        return Err(ModelError::Checkpoint(
            "outer step is half applied (some partitions pending); finish it first".into(),
        ));
    }
    let buf = opt.momentum_buffer();
    let tensors = vec![(
        "outer.momentum".to_string(),
        st::f32_view(vec![buf.len()], buf),
    )];
    st::encode(tensors, &meta_json(stage, "outer-state", opt.steps())?)
}

/// Restore the outer momentum buffer and the outer step count.
pub fn load_outer_bytes(opt: &mut OuterOptimizer, stage: &Stage, bytes: &[u8]) -> Result<()> {
    let (tensors, meta) = st::decode(bytes)?;
    let meta = check_meta(&meta, stage, "outer-state")?;
    let n = opt.momentum_buffer().len();
    let (_, data) = st::read_f32(&tensors, "outer.momentum", Some(&[n]))?;
    opt.set_momentum_buffer(data)?;
    opt.set_steps(meta.step);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::merge::{flatten_params, load_flat_params};
    use crate::optim::{AdamWConfig, LrSchedule, OuterConfig};
    use crate::stage::StageOptions;

    #[test]
    fn weights_round_trip_and_mismatch_errors() {
        let cfg = ModelConfig::tiny();
        let a = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
        let flat: Vec<f32> = flatten_params(&a)
            .unwrap()
            .iter()
            .map(|v| v * 2.0)
            .collect();
        load_flat_params(&a, &flat).unwrap();
        let bytes = weights_to_bytes(&a).unwrap();
        assert_eq!(
            bytes,
            weights_to_bytes(&a).unwrap(),
            "encoding is deterministic"
        );
        let b = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
        let v0 = b.weights_version();
        load_weights_bytes(&b, &bytes).unwrap();
        assert_eq!(flatten_params(&b).unwrap(), flat);
        // A load is a change of weights: a forward cached before it is stale.
        assert_eq!(b.weights_version(), v0 + 1);

        let s0 = Stage::new(&cfg, 0, StageOptions::cpu()).unwrap();
        assert!(matches!(
            load_weights_bytes(&s0, &bytes),
            Err(ModelError::Checkpoint(_))
        ));
        assert!(load_weights_bytes(&b, &bytes[..bytes.len() / 2]).is_err());
        assert!(load_weights_bytes(&b, b"not a checkpoint").is_err());

        let dir = std::env::temp_dir().join(format!("iota-ckpt-{}", std::process::id()));
        let path = dir.join("stage1.safetensors");
        save_weights(&a, &path).unwrap();
        let c = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
        load_weights(&c, &path).unwrap();
        assert_eq!(flatten_params(&c).unwrap(), flat);
        assert!(load_weights(&c, &dir.join("missing.safetensors")).is_err());
        // Saving over an existing file, from several threads at once, leaves one whole file
        // and no temporary files.
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| save_weights(&a, &path).unwrap());
            }
        });
        load_weights(&c, &path).unwrap();
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        assert_eq!(names, vec!["stage1.safetensors".to_string()]);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_checkpoint_of_another_config_or_layout_is_refused() {
        let cfg = ModelConfig::tiny();
        let a = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
        let bytes = weights_to_bytes(&a).unwrap();
        // Same shapes, different hyper-parameter: the config fingerprint differs.
        let mut other = cfg.clone();
        other.rope_theta = 500_000.0;
        let b = Stage::new(&other, 1, StageOptions::cpu()).unwrap();
        let before = flatten_params(&b).unwrap();
        let err = load_weights_bytes(&b, &bytes).unwrap_err().to_string();
        assert!(
            err.contains("config") && err.contains("fingerprint"),
            "{err}"
        );
        assert_eq!(flatten_params(&b).unwrap(), before, "nothing was loaded");
        // Different shapes: refused before any tensor is read.
        let c = Stage::new(&cfg.clone().with_bottleneck(32), 1, StageOptions::cpu()).unwrap();
        assert!(matches!(
            load_weights_bytes(&c, &bytes),
            Err(ModelError::Checkpoint(_))
        ));
        // Optimizer and outer state carry the same check.
        let opt = AdamW::new(&a, AdamWConfig::default(), LrSchedule::constant()).unwrap();
        let ob = adamw_to_bytes(&opt, &a).unwrap();
        let mut opt_b = AdamW::new(&b, AdamWConfig::default(), LrSchedule::constant()).unwrap();
        assert!(load_adamw_bytes(&mut opt_b, &b, &ob).is_err());
        let outer = OuterOptimizer::new(OuterConfig::default(), a.num_parameters()).unwrap();
        let ub = outer_to_bytes(&outer, &a).unwrap();
        let mut outer_b = OuterOptimizer::new(OuterConfig::default(), b.num_parameters()).unwrap();
        assert!(load_outer_bytes(&mut outer_b, &b, &ub).is_err());
        // And the matching config loads.
        let d = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
        load_weights_bytes(&d, &bytes).unwrap();
    }

    #[test]
    fn optimizer_state_round_trip() {
        let cfg = ModelConfig::tiny();
        let s = Stage::new(&cfg, 2, StageOptions::cpu()).unwrap();
        let mut opt = AdamW::new(&s, AdamWConfig::default(), LrSchedule::constant()).unwrap();
        let m: Vec<Tensor> = s
            .params()
            .iter()
            .map(|p| (p.var().as_tensor() * 0.5).unwrap())
            .collect();
        let v: Vec<Tensor> = s
            .params()
            .iter()
            .map(|p| p.var().as_tensor().sqr().unwrap())
            .collect();
        opt.set_state(7, m, v).unwrap();
        let bytes = adamw_to_bytes(&opt, &s).unwrap();
        let mut back = AdamW::new(&s, AdamWConfig::default(), LrSchedule::constant()).unwrap();
        load_adamw_bytes(&mut back, &s, &bytes).unwrap();
        assert_eq!(back.step_count(), 7);
        assert_eq!(adamw_to_bytes(&back, &s).unwrap(), bytes);
        // Weights bytes are not optimizer bytes.
        assert!(load_adamw_bytes(&mut back, &s, &weights_to_bytes(&s).unwrap()).is_err());

        let mut outer = OuterOptimizer::new(OuterConfig::default(), s.num_parameters()).unwrap();
        let mut w = flatten_params(&s).unwrap();
        let g = vec![0.01f32; w.len()];
        outer.step(&mut w, &g).unwrap();
        let ob = outer_to_bytes(&outer, &s).unwrap();
        let mut outer2 = OuterOptimizer::new(OuterConfig::default(), s.num_parameters()).unwrap();
        load_outer_bytes(&mut outer2, &s, &ob).unwrap();
        assert_eq!(outer2.momentum_buffer(), outer.momentum_buffer());
        assert_eq!(
            outer2.steps(),
            1,
            "the outer step count survives the round trip"
        );
        // Half an outer step cannot be checkpointed.
        outer.step_partition(0..3, &mut w[0..3], &g[0..3]).unwrap();
        assert!(outer_to_bytes(&outer, &s).is_err());
    }
}
