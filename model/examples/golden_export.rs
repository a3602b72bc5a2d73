//! Writes the inputs of the golden-reference test: for each case, the model config, every
//! parameter (canonical names) and a batch of tokens and targets. `scripts/reference/` runs an
//! independent PyTorch Llama on them and writes the golden loss and gradients; the Rust test
//! `model/tests/golden.rs` compares against those. Run by hand (the outputs are committed):
//!
//! ```text
//! cargo run -p iota-model --example golden_export -- scripts/reference/golden
//! ```

use std::collections::HashMap;
use std::error::Error;
use std::path::Path;

use iota_model::rng::SplitMix64;
use iota_model::{Device, ModelConfig, Stage, StageOptions, Tensor};

type Res<T> = Result<T, Box<dyn Error>>;

/// The cases: a monolithic model without bottleneck, and the staged `tiny` with bottlenecks.
/// Weights are drawn at 10x the usual scale so that every path (RoPE, GQA, norms, bottleneck)
/// moves the gradients well above f32 rounding.
fn cases() -> Vec<(&'static str, ModelConfig, usize, usize)> {
    let mut mono = ModelConfig::tiny()
        .with_bottleneck(32)
        .with_stages(vec![1, 1]);
    mono.name = "golden-mono".into();
    mono.init_std = 0.2;
    mono.init_seed = 7;
    let mut staged = ModelConfig::tiny();
    staged.name = "golden-staged".into();
    staged.init_std = 0.2;
    staged.init_seed = 8;
    vec![("mono", mono, 2, 12), ("staged", staged, 3, 10)]
}

fn main() -> Res<()> {
    let dir = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "scripts/reference/golden".into());
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir)?;
    for (case, cfg, batch, seq) in cases() {
        let mut tensors: HashMap<String, Tensor> = HashMap::new();
        for stage in Stage::all(&cfg, &StageOptions::cpu())? {
            for p in stage.params() {
                tensors.insert(p.name().to_string(), p.var().as_tensor().clone());
            }
        }
        let mut rng = SplitMix64::new(1000 + batch as u64);
        let mut ids = |n: usize| -> Vec<u32> {
            (0..n)
                .map(|_| (rng.next_u64() % cfg.vocab_size as u64) as u32)
                .collect()
        };
        let tokens = Tensor::from_vec(ids(batch * seq), (batch, seq), &Device::Cpu)?;
        let targets = Tensor::from_vec(ids(batch * seq), (batch, seq), &Device::Cpu)?;
        tensors.insert("batch.tokens".into(), tokens);
        tensors.insert("batch.targets".into(), targets);
        candle_core::safetensors::save(&tensors, dir.join(format!("{case}.inputs.safetensors")))?;
        std::fs::write(dir.join(format!("{case}.config.json")), cfg.to_json()?)?;
        println!("{case}: {} parameters", cfg.param_count()?);
    }
    Ok(())
}
