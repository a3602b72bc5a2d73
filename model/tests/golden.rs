//! Golden-reference regression guard: loss and per-parameter gradients of `model/` against an
//! independent PyTorch Llama (`scripts/reference/llama_reference.py`, float64) on committed
//! weights and batches, for a monolithic model without bottleneck and the staged `tiny` with
//! bottlenecks. No Python is needed here: the reference's outputs are committed.
//!
//! Gradients are compared, not only the loss: a wrong RoPE moves the loss at these weights by
//! little but the gradients by percent.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use iota_model::{ModelConfig, Pipeline, StageOptions};

struct Case {
    cfg: ModelConfig,
    inputs: HashMap<String, Tensor>,
    golden: HashMap<String, Tensor>,
}

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/reference/golden")
}

fn load(case: &str) -> Case {
    let dir = golden_dir();
    let cfg = ModelConfig::from_json_file(&dir.join(format!("{case}.config.json"))).unwrap();
    let inputs = candle_core::safetensors::load(
        dir.join(format!("{case}.inputs.safetensors")),
        &Device::Cpu,
    )
    .unwrap();
    let golden = candle_core::safetensors::load(
        dir.join(format!("{case}.golden.safetensors")),
        &Device::Cpu,
    )
    .unwrap();
    Case {
        cfg,
        inputs,
        golden,
    }
}

fn max_abs(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Worst loss and gradient relative errors of one run: (loss, gradient, worst parameter).
fn run(case: &Case, dtype: DType, monolithic: bool) -> (f64, f64, String) {
    let opts = StageOptions {
        param_dtype: dtype,
        compute_dtype: dtype,
        ..StageOptions::cpu()
    };
    let mut p = Pipeline::new(&case.cfg, &opts).unwrap();
    for s in p.stages() {
        for param in s.params() {
            let w = case.inputs.get(param.name()).unwrap_or_else(|| {
                panic!("golden inputs lack {}", param.name());
            });
            param.var().set(&w.to_dtype(dtype).unwrap()).unwrap();
        }
        s.mark_weights_changed();
    }
    let tokens = &case.inputs["batch.tokens"];
    let targets = &case.inputs["batch.targets"];
    let loss = if monolithic {
        p.forward_backward_monolithic(tokens, targets).unwrap()
    } else {
        p.forward_backward(tokens, targets).unwrap().loss
    };
    let golden_loss = case.golden["loss"].to_vec1::<f64>().unwrap()[0];
    let loss_err = (f64::from(loss) - golden_loss).abs() / golden_loss.abs();
    let (mut worst, mut worst_name) = (0f64, String::new());
    let mut seen = 0;
    for s in p.stages() {
        for (i, param) in s.params().iter().enumerate() {
            let g = s.mean_grad(i).unwrap().unwrap();
            let reference = &case.golden[&format!("grad.{}", param.name())];
            let diff = (g.to_dtype(DType::F64).unwrap() - reference.to_dtype(DType::F64).unwrap())
                .unwrap();
            let e = max_abs(&diff) / max_abs(reference);
            if e > worst {
                worst = e;
                worst_name = param.name().to_string();
            }
            seen += 1;
        }
    }
    assert_eq!(
        seen + 1,
        case.golden.len(),
        "a gradient per parameter, and the loss"
    );
    (loss_err, worst, worst_name)
}

#[test]
fn loss_and_gradients_match_the_pytorch_reference() {
    let mut table = String::from(
        "| case | path | dtype | loss rel. error | worst gradient rel. error (max abs diff / max abs) |\n|---|---|---|---|---|\n",
    );
    for case_name in ["mono", "staged"] {
        let case = load(case_name);
        // The loss is reported as f32 (relative rounding 6e-8) in both dtypes.
        for (dtype, loss_tol, grad_tol) in [(DType::F32, 1e-6, 2e-5), (DType::F64, 1e-7, 1e-6)] {
            for monolithic in [true, false] {
                let (le, ge, worst) = run(&case, dtype, monolithic);
                let path = if monolithic { "monolithic" } else { "staged" };
                table.push_str(&format!(
                    "| {case_name} | {path} | {dtype:?} | {le:.2e} | {ge:.2e} ({worst}) |\n"
                ));
                assert!(
                    le < loss_tol,
                    "{case_name} {path} {dtype:?}: loss relative error {le}"
                );
                assert!(
                    ge < grad_tol,
                    "{case_name} {path} {dtype:?}: gradient relative error {ge} on {worst}"
                );
            }
        }
    }
    eprintln!("{table}");
}

/// The guard is sensitive: perturbing one weight by 1% moves the gradients far beyond the
/// tolerance, so a real numerical change cannot hide under it.
#[test]
fn a_small_change_is_detected() {
    let mut case = load("staged");
    let name = "blocks.1.attn.wk";
    let w = &case.inputs[name];
    let bumped = (w * 1.01).unwrap();
    case.inputs.insert(name.into(), bumped);
    let (_, ge, _) = run(&case, DType::F64, false);
    assert!(ge > 1e-3, "gradient error {ge} after a 1% weight change");
}
