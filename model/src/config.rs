//! Model shapes: named presets and JSON loading.

use std::ops::Range;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// Upper bound on `max_seq_len` accepted by [`ModelConfig::validate`].
pub const MAX_SEQ_LEN: usize = 1 << 20;

/// The largest model config file read (a config is a few hundred bytes of JSON).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Llama-3.1 style RoPE frequency rescaling for long contexts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    /// Overall scale applied to low frequencies.
    pub factor: f64,
    /// Wavelengths longer than `original_context / low_freq_factor` are scaled fully.
    pub low_freq_factor: f64,
    /// Wavelengths shorter than `original_context / high_freq_factor` are left alone.
    pub high_freq_factor: f64,
    /// Context length the base frequencies were trained for.
    pub original_context: usize,
}

/// Shape of a Llama-3-style decoder split into pipeline stages.
///
/// Block `i` belongs to the stage whose range contains it; stage 0 also owns the embedding and the
/// last stage the final norm and LM head. Between consecutive stages sits a residual bottleneck of
/// width `bottleneck_dim` (equal to `d_model` for none).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Preset name, informational.
    pub name: String,
    /// Number of token ids.
    pub vocab_size: usize,
    /// Residual stream width `d`.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention); divides `n_heads`.
    pub n_kv_heads: usize,
    /// SwiGLU hidden width.
    pub d_ff: usize,
    /// Blocks per stage, in pipeline order.
    pub stages: Vec<usize>,
    /// Width `b` of the activation sent between stages; `d_model` means no bottleneck.
    pub bottleneck_dim: usize,
    /// Longest sequence the model accepts.
    pub max_seq_len: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Optional Llama-3.1 frequency rescaling.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
    /// Standard deviation of the normal initialisation of matrices.
    pub init_std: f64,
    /// Seed of the deterministic initialisation; all parties start from identical weights.
    pub init_seed: u64,
    /// Vocabulary columns per chunk in the cross-entropy, bounding the logits held at once.
    pub loss_vocab_chunk: usize,
}

impl ModelConfig {
    /// Names accepted by [`ModelConfig::by_name`].
    pub const PRESETS: [&'static str; 4] = ["tiny", "small", "iota-1.5b", "iota-15b"];

    /// A preset by name: `tiny`, `small`, `iota-1.5b` or `iota-15b`.
    pub fn by_name(name: &str) -> Result<Self> {
        match name {
            "tiny" => Ok(Self::tiny()),
            "small" => Ok(Self::small()),
            "iota-1.5b" => Ok(Self::iota_1_5b()),
            "iota-15b" => Ok(Self::iota_15b()),
            other => Err(ModelError::Config(format!(
                "unknown model config {other:?}; expected one of {:?} or a JSON file",
                Self::PRESETS
            ))),
        }
    }

    /// Test-sized model: 3 one-block stages, trains on the grammar corpus in seconds on a CPU.
    pub fn tiny() -> Self {
        Self {
            name: "tiny".into(),
            vocab_size: 64,
            d_model: 32,
            n_heads: 4,
            n_kv_heads: 2,
            d_ff: 64,
            stages: vec![1, 1, 1],
            bottleneck_dim: 8,
            max_seq_len: 64,
            rope_theta: 10_000.0,
            rope_scaling: None,
            norm_eps: 1e-5,
            init_std: 0.02,
            init_seed: 42,
            loss_vocab_chunk: 32,
        }
    }

    /// About 20M parameters (at its 8192-token vocabulary), CPU-trainable; 3 stages, d/b = 64.
    pub fn small() -> Self {
        Self {
            name: "small".into(),
            vocab_size: 8192,
            d_model: 384,
            n_heads: 6,
            n_kv_heads: 2,
            d_ff: 1024,
            stages: vec![2, 4, 2],
            bottleneck_dim: 6,
            max_seq_len: 256,
            rope_theta: 10_000.0,
            rope_scaling: None,
            norm_eps: 1e-5,
            init_std: 0.02,
            init_seed: 42,
            loss_vocab_chunk: 4096,
        }
    }

    fn llama3_scaling() -> Option<RopeScaling> {
        Some(RopeScaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192,
        })
    }

    /// IOTA's "1.5B" shape: d = 2048, 16 blocks in stages [4, 8, 4], bottleneck 32.
    pub fn iota_1_5b() -> Self {
        Self {
            name: "iota-1.5b".into(),
            vocab_size: 128_256,
            d_model: 2048,
            n_heads: 32,
            n_kv_heads: 8,
            d_ff: 8192,
            stages: vec![4, 8, 4],
            bottleneck_dim: 32,
            max_seq_len: 8192,
            rope_theta: 500_000.0,
            rope_scaling: Self::llama3_scaling(),
            norm_eps: 1e-5,
            init_std: 0.02,
            init_seed: 42,
            loss_vocab_chunk: 16_384,
        }
    }

    /// IOTA's 15B mainnet shape: d = 5120, 50 blocks in 5 stages, bottleneck 80.
    pub fn iota_15b() -> Self {
        Self {
            name: "iota-15b".into(),
            vocab_size: 128_256,
            d_model: 5120,
            n_heads: 40,
            n_kv_heads: 8,
            d_ff: 13_824,
            stages: vec![8, 11, 11, 11, 9],
            bottleneck_dim: 80,
            max_seq_len: 8192,
            rope_theta: 500_000.0,
            rope_scaling: Self::llama3_scaling(),
            norm_eps: 1e-5,
            init_std: 0.02,
            init_seed: 42,
            loss_vocab_chunk: 16_384,
        }
    }

    /// Parse and validate a JSON config.
    pub fn from_json_str(json: &str) -> Result<Self> {
        let cfg: Self = serde_json::from_str(json)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Read, parse and validate a JSON config file: a regular file of at most
    /// [`MAX_CONFIG_BYTES`]. The name comes from a run the orchestrator serves unsigned, so
    /// neither a device (`/dev/zero` never ends) nor a huge file is read.
    pub fn from_json_file(path: &Path) -> Result<Self> {
        use std::io::Read as _;
        let refuse = |why: String| ModelError::Config(format!("{}: {why}", path.display()));
        // Checked before opening as well: opening a FIFO for reading blocks until a writer comes.
        let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
        if !meta.is_file() {
            return Err(refuse("not a regular file".into()));
        }
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        let meta = file.metadata().map_err(|e| ModelError::io(path, e))?;
        if !meta.is_file() {
            return Err(refuse("not a regular file".into()));
        }
        // A file may grow after the size was read: never read past the bound either way.
        let mut text = String::new();
        file.take(MAX_CONFIG_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| ModelError::io(path, e))?;
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(refuse(format!("larger than {MAX_CONFIG_BYTES} bytes")));
        }
        Self::from_json_str(&text)
    }

    /// A preset name or, failing that, a path to a JSON file.
    pub fn load(name_or_path: &str) -> Result<Self> {
        if Self::PRESETS.contains(&name_or_path) {
            Self::by_name(name_or_path)
        } else {
            Self::from_json_file(Path::new(name_or_path))
        }
    }

    /// Pretty JSON of this config.
    pub fn to_json(&self) -> Result<String> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    /// Same config with another vocabulary size (e.g. to match a tokenizer).
    pub fn with_vocab_size(mut self, vocab_size: usize) -> Self {
        self.vocab_size = vocab_size;
        self
    }

    /// Same config with another bottleneck width.
    pub fn with_bottleneck(mut self, bottleneck_dim: usize) -> Self {
        self.bottleneck_dim = bottleneck_dim;
        self
    }

    /// Same config with another stage split.
    pub fn with_stages(mut self, stages: Vec<usize>) -> Self {
        self.stages = stages;
        self
    }

    /// Check every invariant the model code relies on.
    pub fn validate(&self) -> Result<()> {
        let err = |m: String| Err(ModelError::Config(m));
        if self.vocab_size == 0 || self.vocab_size > u32::MAX as usize {
            return err(format!(
                "vocab_size {} must be in 1..=u32::MAX",
                self.vocab_size
            ));
        }
        if self.d_model == 0 || self.n_heads == 0 || self.n_kv_heads == 0 || self.d_ff == 0 {
            return err("d_model, n_heads, n_kv_heads and d_ff must be positive".into());
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            return err(format!(
                "d_model {} is not divisible by n_heads {}",
                self.d_model, self.n_heads
            ));
        }
        if !(self.d_model / self.n_heads).is_multiple_of(2) {
            return err("head dimension must be even for RoPE".into());
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return err(format!(
                "n_heads {} is not a multiple of n_kv_heads {}",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.stages.is_empty() {
            return err("at least one stage is required".into());
        }
        if self.stages.contains(&0) {
            return err(format!(
                "every stage needs at least one block, got {:?}",
                self.stages
            ));
        }
        if self.bottleneck_dim == 0 || self.bottleneck_dim > self.d_model {
            return err(format!(
                "bottleneck_dim {} must be in 1..={}",
                self.bottleneck_dim, self.d_model
            ));
        }
        if self.max_seq_len == 0 || self.loss_vocab_chunk == 0 {
            return err("max_seq_len and loss_vocab_chunk must be positive".into());
        }
        // The RoPE tables hold max_seq_len x head_dim values; bound them to something sane.
        if self.max_seq_len > MAX_SEQ_LEN {
            return err(format!(
                "max_seq_len {} exceeds {MAX_SEQ_LEN}",
                self.max_seq_len
            ));
        }
        for (name, v) in [
            ("rope_theta", self.rope_theta),
            ("norm_eps", self.norm_eps),
            ("init_std", self.init_std),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return err(format!("{name} must be finite and positive, got {v}"));
            }
        }
        if let Some(s) = &self.rope_scaling
            && !(s.factor >= 1.0
                && s.low_freq_factor > 0.0
                && s.high_freq_factor > s.low_freq_factor
                && s.original_context > 0)
        {
            return err(format!("inconsistent rope_scaling {s:?}"));
        }
        Ok(())
    }

    /// Total number of blocks.
    pub fn n_layers(&self) -> usize {
        self.stages.iter().sum()
    }

    /// Number of pipeline stages.
    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.d_model.checked_div(self.n_heads).unwrap_or(0)
    }

    /// Whether stage boundaries compress (`bottleneck_dim < d_model`).
    pub fn has_bottleneck(&self) -> bool {
        self.bottleneck_dim < self.d_model
    }

    /// Width of the tensor crossing a stage boundary.
    pub fn boundary_dim(&self) -> usize {
        self.bottleneck_dim
    }

    /// The `d/b` ratio.
    pub fn compression_ratio(&self) -> f64 {
        self.d_model as f64 / self.bottleneck_dim as f64
    }

    /// Global block indices owned by stage `k`.
    pub fn stage_blocks(&self, k: usize) -> Result<Range<usize>> {
        if k >= self.stages.len() {
            return Err(ModelError::InvalidInput(format!(
                "stage {k} does not exist; the model has {} stages",
                self.stages.len()
            )));
        }
        let start: usize = self.stages[..k].iter().sum();
        Ok(start..start + self.stages[k])
    }

    /// Names and shapes of stage `k`'s parameters, in the canonical (flat-view) order.
    pub fn stage_param_shapes(&self, k: usize) -> Result<Vec<(String, Vec<usize>)>> {
        let blocks = self.stage_blocks(k)?;
        let last = k + 1 == self.stages.len();
        let (d, hd, b) = (self.d_model, self.head_dim(), self.bottleneck_dim);
        let mut out = Vec::new();
        if k == 0 {
            out.push(("embed.weight".to_string(), vec![self.vocab_size, d]));
        }
        for i in blocks.clone() {
            let p = format!("blocks.{i}");
            if k > 0 && i == blocks.start && self.has_bottleneck() {
                out.push((format!("{p}.decoder.weight"), vec![d, b]));
            }
            out.push((format!("{p}.attn_norm.weight"), vec![d]));
            out.push((format!("{p}.attn.wq"), vec![self.n_heads * hd, d]));
            out.push((format!("{p}.attn.wk"), vec![self.n_kv_heads * hd, d]));
            out.push((format!("{p}.attn.wv"), vec![self.n_kv_heads * hd, d]));
            out.push((format!("{p}.attn.wo"), vec![d, self.n_heads * hd]));
            out.push((format!("{p}.ffn_norm.weight"), vec![d]));
            out.push((format!("{p}.ffn.w_gate"), vec![self.d_ff, d]));
            out.push((format!("{p}.ffn.w_up"), vec![self.d_ff, d]));
            out.push((format!("{p}.ffn.w_down"), vec![d, self.d_ff]));
            if !last && i + 1 == blocks.end && self.has_bottleneck() {
                out.push((format!("{p}.encoder.weight"), vec![b, d]));
            }
        }
        if last {
            out.push(("norm.weight".to_string(), vec![d]));
            out.push(("head.weight".to_string(), vec![self.vocab_size, d]));
        }
        Ok(out)
    }

    /// Number of parameters of stage `k`.
    pub fn stage_param_count(&self, k: usize) -> Result<usize> {
        Ok(self
            .stage_param_shapes(k)?
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum())
    }

    /// Number of parameters of the whole model.
    pub fn param_count(&self) -> Result<usize> {
        (0..self.stages.len())
            .map(|k| self.stage_param_count(k))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_validate() {
        for name in ModelConfig::PRESETS {
            let cfg = ModelConfig::by_name(name).unwrap();
            cfg.validate().unwrap();
            assert_eq!(cfg.name, name);
        }
        assert!(ModelConfig::by_name("huge").is_err());
    }

    #[test]
    fn iota_shapes() {
        let c = ModelConfig::iota_1_5b();
        assert_eq!((c.d_model, c.n_layers(), c.bottleneck_dim), (2048, 16, 32));
        assert_eq!(c.stages, vec![4, 8, 4]);
        assert_eq!(c.compression_ratio(), 64.0);
        // IOTA's 1B tail stage (4 blocks, decoder, norm, head) has 506,021,888 parameters.
        assert_eq!(c.stage_param_count(2).unwrap(), 506_021_888);
        let c = ModelConfig::iota_15b();
        assert_eq!((c.d_model, c.n_layers(), c.bottleneck_dim), (5120, 50, 80));
        assert_eq!(c.num_stages(), 5);
        let total = c.param_count().unwrap();
        assert!((14.9e9..15.2e9).contains(&(total as f64)), "{total}");
    }

    #[test]
    fn small_is_about_20m() {
        let n = ModelConfig::small().param_count().unwrap() as f64;
        assert!((17e6..23e6).contains(&n), "{n}");
    }

    #[test]
    fn json_round_trip_and_rejects_bad() {
        let c = ModelConfig::tiny();
        let back = ModelConfig::from_json_str(&c.to_json().unwrap()).unwrap();
        assert_eq!(c, back);
        let bad = c.clone().with_bottleneck(0).to_json().unwrap();
        assert!(ModelConfig::from_json_str(&bad).is_err());
        assert!(ModelConfig::from_json_str("{\"name\": 3}").is_err());
        let mut zero_heads = c.clone();
        zero_heads.n_heads = 0;
        assert_eq!(zero_heads.head_dim(), 0);
        assert!(zero_heads.validate().is_err());
        let mut long = c.clone();
        long.max_seq_len = usize::MAX;
        assert!(long.validate().is_err());
        let no_stage = c.clone().with_stages(vec![1, 0]).to_json().unwrap();
        assert!(ModelConfig::from_json_str(&no_stage).is_err());
    }

    #[test]
    fn config_files_are_read_bounded() {
        let dir = std::env::temp_dir().join(format!("iota-model-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("tiny.json");
        std::fs::write(&good, ModelConfig::tiny().to_json().unwrap()).unwrap();
        assert_eq!(
            ModelConfig::load(good.to_str().unwrap()).unwrap(),
            ModelConfig::tiny()
        );
        // A run may name any path: an endless device is refused without being read, …
        #[cfg(unix)]
        assert!(matches!(
            ModelConfig::load("/dev/zero"),
            Err(ModelError::Config(m)) if m.contains("not a regular file")
        ));
        // … a directory too, and a file over the bound whatever it holds.
        assert!(ModelConfig::load(dir.to_str().unwrap()).is_err());
        let big = dir.join("big.json");
        let mut text = ModelConfig::tiny().to_json().unwrap();
        text.push_str(&" ".repeat(MAX_CONFIG_BYTES as usize));
        std::fs::write(&big, text).unwrap();
        assert!(matches!(
            ModelConfig::load(big.to_str().unwrap()),
            Err(ModelError::Config(m)) if m.contains("larger than")
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn stage_ranges_cover_blocks() {
        let c = ModelConfig::iota_15b();
        let mut next = 0;
        for k in 0..c.num_stages() {
            let r = c.stage_blocks(k).unwrap();
            assert_eq!(r.start, next);
            next = r.end;
        }
        assert_eq!(next, 50);
        assert!(c.stage_blocks(5).is_err());
    }
}
