//! Honest replay error across CPU thread counts: the figure validators set their spot-check
//! thresholds from.
//!
//! The same epoch of hops (stage 1 of `small`, micro-batches 4x128, samples in flight across
//! inner steps) runs in child processes with `CANDLE_NUM_THREADS`/`RAYON_NUM_THREADS` = 1 and 2
//! (twice each), 3 and 8; every run is compared with the first single-thread run: worst cosine and relative
//! error over forward outputs, input gradients, and the pseudo-gradient. Built with the `openblas`
//! feature it also runs candle's own kernel (`IOTA_MATMUL=gemm`) and OpenBLAS's AVX2 and AVX-512
//! kernels (`OPENBLAS_CORETYPE`), the error between a miner and a validator whose builds or CPUs
//! differ. Built with the `cuda` feature on a machine with a GPU it also runs the epoch on CUDA
//! device 0 in f32 and in bf16 compute (twice, to show whether the card repeats itself): the
//! error between a GPU miner and a CPU validator.
//!
//! With `--other-build EXE` it also runs EXE, the same example built otherwise (for example with
//! `--no-default-features`, which leaves out the AVX-512 matrix kernels), at 1 and 2 threads.
//!
//! ```text
//! cargo run --release -p iota-model --example replay_error [-- --config tiny] [--rounds R] [--other-build EXE]
//! ```

use std::collections::HashMap;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::Command;

use iota_model::optim::{AdamW, AdamWConfig, LrSchedule};
use iota_model::replay::{Hop, StageRunner, compare};
use iota_model::rng::SplitMix64;
use iota_model::{DType, Device, ModelConfig, Stage, StageOptions, Tensor, merge};

type Res<T> = Result<T, Box<dyn Error>>;

/// A child run: thread count, label, extra environment, extra arguments, and the binary when not
/// this one.
type Run = (
    usize,
    String,
    Vec<(&'static str, &'static str)>,
    Vec<&'static str>,
    Option<PathBuf>,
);

fn randn(dims: &[usize], seed: u64, scale: f64) -> Res<Tensor> {
    let mut r = SplitMix64::new(seed);
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n).map(|_| (r.next_normal() * scale) as f32).collect();
    Ok(Tensor::from_vec(v, dims, &Device::Cpu)?)
}

/// `rounds` repetitions of: four samples, two of them in flight across an inner step.
fn hops(stage: &Stage, rounds: u64) -> Res<Vec<Hop>> {
    let (b, t) = (4, 128.min(stage.config().max_seq_len));
    let fwd = |s: u64| -> Res<Hop> {
        Ok(Hop::Forward {
            sample: s,
            input: randn(&stage.input_dims(b, t), 100 + s, 1.0)?,
            targets: None,
        })
    };
    let bwd = |s: u64| -> Res<Hop> {
        Ok(Hop::Backward {
            sample: s,
            grad_output: Some(randn(&stage.output_dims(b, t), 200_000 + s, 1e-3)?),
        })
    };
    let mut out = Vec::new();
    for r in 0..rounds {
        let s = 4 * r;
        out.extend([
            fwd(s + 1)?,
            fwd(s + 2)?,
            bwd(s + 1)?,
            fwd(s + 3)?,
            Hop::InnerStep { lr: 1e-3 },
            bwd(s + 2)?,
            bwd(s + 3)?,
            fwd(s + 4)?,
            bwd(s + 4)?,
            Hop::InnerStep { lr: 1e-3 },
        ]);
    }
    Ok(out)
}

/// One epoch with `opts`; writes every result vector and the pseudo-gradient to `out`.
fn run(cfg: &ModelConfig, opts: StageOptions, rounds: u64, out: &Path) -> Res<()> {
    let stage = Stage::new(cfg, 1, opts)?;
    let opt = AdamW::new(&stage, AdamWConfig::default(), LrSchedule::constant())?;
    let hops = hops(&stage, rounds)?;
    let start = merge::flatten_params(&stage)?;
    let mut runner = StageRunner::new(stage, opt, 8);
    let mut tensors = HashMap::new();
    let mut steps = 0u64;
    for (i, hop) in hops.iter().enumerate() {
        if let Some(v) = runner.apply(hop)?.values()? {
            let n = v.len();
            tensors.insert(format!("hop{i:03}"), Tensor::from_vec(v, n, &Device::Cpu)?);
        }
        // The pseudo-gradient part way, to show how the error grows with inner steps.
        if matches!(hop, Hop::InnerStep { .. }) {
            steps += 1;
            if steps.is_power_of_two() && i + 1 < hops.len() {
                let pg = runner.pseudo_gradient(&start)?;
                let n = pg.len();
                tensors.insert(
                    format!("pseudo@{steps:05}"),
                    Tensor::from_vec(pg, n, &Device::Cpu)?,
                );
            }
        }
    }
    let pg = runner.pseudo_gradient(&start)?;
    let n = pg.len();
    tensors.insert("pseudo".into(), Tensor::from_vec(pg, n, &Device::Cpu)?);
    candle_core::safetensors::save(&tensors, out)?;
    Ok(())
}

fn load(path: &Path) -> Res<HashMap<String, Vec<f32>>> {
    let mut out = HashMap::new();
    for (k, t) in candle_core::safetensors::load(path, &Device::Cpu)? {
        out.insert(k, t.to_vec1::<f32>()?);
    }
    Ok(out)
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let cfg = ModelConfig::by_name(&flag("--config").unwrap_or_else(|| "small".into()))?;
    let rounds: u64 = flag("--rounds").unwrap_or_else(|| "1".into()).parse()?;
    if let Some(out) = flag("--run") {
        let opts = match flag("--compute").as_deref() {
            None => StageOptions::cpu(),
            Some(dtype) => StageOptions {
                device: Device::new_cuda(0)?,
                compute_dtype: match dtype {
                    "bf16" => DType::BF16,
                    "f32" => DType::F32,
                    other => return Err(format!("--compute {other:?}: use f32 or bf16").into()),
                },
                ..StageOptions::cpu()
            },
        };
        return run(&cfg, opts, rounds, Path::new(&out));
    }
    let dir = std::env::temp_dir().join(format!("iota-replay-error-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let exe = std::env::current_exe()?;
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    // (threads, label, extra environment): the same build at several thread counts and, in an
    // `openblas` build, the other matrix kernels a miner or validator might end up with.
    let mut runs: Vec<Run> = [(1, 'a'), (1, 'b'), (2, 'a')]
        .into_iter()
        .chain([(2, 'b'), (3, 'a'), (8, 'a')])
        .map(|(t, rep)| (t, format!("run {rep}"), vec![], vec![], None))
        .collect();
    // CPU runs agree bit for bit across thread counts (measured above), so a GPU-only
    // comparison takes its CPU reference from one run on 8 threads.
    if args.iter().any(|a| a == "--gpu-only") {
        runs.truncate(1);
        runs[0].0 = 8;
    }
    if iota_model::cuda_for_checks(0)?.is_some() {
        for (label, compute) in [
            ("CUDA f32", "f32"),
            ("CUDA bf16, run a", "bf16"),
            ("CUDA bf16, run b", "bf16"),
        ] {
            runs.push((1, label.into(), vec![], vec!["--compute", compute], None));
        }
    }
    let backend = iota_model::matmul_backend();
    eprintln!("matmul: {backend}");
    if backend.starts_with("OpenBLAS") {
        runs.push((
            1,
            "IOTA_MATMUL=gemm".into(),
            vec![("IOTA_MATMUL", "gemm")],
            vec![],
            None,
        ));
        for core in ["Haswell", "SkylakeX"] {
            #[cfg(target_arch = "x86_64")]
            if core == "SkylakeX" && !std::is_x86_feature_detected!("avx512f") {
                continue;
            }
            for t in [1, 2] {
                runs.push((
                    t,
                    format!("OPENBLAS_CORETYPE={core}"),
                    vec![("OPENBLAS_CORETYPE", core)],
                    vec![],
                    None,
                ));
            }
        }
    }
    if let Some(other) = flag("--other-build") {
        for t in [1, 2] {
            runs.push((
                t,
                format!("other build ({other})"),
                vec![],
                vec![],
                Some(other.clone().into()),
            ));
        }
    }
    for (i, (threads, label, env, extra, bin)) in runs.iter().enumerate() {
        let path = dir.join(format!("run{i}.safetensors"));
        let t0 = std::time::Instant::now();
        let status = Command::new(bin.as_ref().unwrap_or(&exe))
            .args([
                "--config",
                &cfg.name,
                "--rounds",
                &rounds.to_string(),
                "--run",
            ])
            .arg(&path)
            .args(extra)
            .env("CANDLE_NUM_THREADS", threads.to_string())
            .env("RAYON_NUM_THREADS", threads.to_string())
            .envs(env.iter().copied())
            .status()?;
        if !status.success() {
            return Err(format!("child run with {threads} threads failed: {status}").into());
        }
        eprintln!("{threads} thread(s), {label}: {:.1?}", t0.elapsed());
        files.push((format!("{threads} thread(s), {label}"), path));
    }
    let reference = load(&files[0].1)?;
    println!(
        "## Honest replay error, stage 1 of `{}`, micro-batches of 4 sequences (up to 128 tokens), {} samples, {} inner steps (reference: {}; matmul: {backend})\n",
        cfg.name,
        4 * rounds,
        2 * rounds,
        files[0].0
    );
    println!(
        "| run | worst output/input-grad cosine | worst rel. error | pseudo-grad cosine | pseudo-grad rel. error |"
    );
    println!("|---|---|---|---|---|");
    for (label, path) in &files[1..] {
        let other = load(path)?;
        let (mut worst_cos, mut worst_rel) = (1f64, 0f64);
        let mut keys: Vec<&String> = reference.keys().filter(|k| k.starts_with("hop")).collect();
        keys.sort();
        for k in keys {
            let c = compare(&other[k], &reference[k])?;
            worst_cos = worst_cos.min(c.cosine);
            worst_rel = worst_rel.max(c.relative_error);
        }
        let p = compare(&other["pseudo"], &reference["pseudo"])?;
        println!(
            "| {label} | {worst_cos:.9} | {worst_rel:.3e} | {:.9} | {:.3e} |",
            p.cosine, p.relative_error
        );
    }
    let mut partway: Vec<&String> = reference
        .keys()
        .filter(|k| k.starts_with("pseudo@"))
        .collect();
    partway.sort();
    if !partway.is_empty() {
        let steps: Vec<&str> = partway.iter().map(|k| &k["pseudo@".len()..]).collect();
        println!(
            "\nPseudo-gradient relative error after n inner steps:\n\n| run | {} | {} |",
            steps
                .iter()
                .map(|s| format!("n={}", s.trim_start_matches('0')))
                .collect::<Vec<_>>()
                .join(" | "),
            format_args!("n={}", 2 * rounds)
        );
        println!("|---|{}---|", "---|".repeat(steps.len()));
        for (label, path) in &files[1..] {
            let other = load(path)?;
            let mut cells = Vec::new();
            for k in partway
                .iter()
                .copied()
                .chain(std::iter::once(&"pseudo".to_string()))
            {
                cells.push(format!(
                    "{:.3e}",
                    compare(&other[k], &reference[k])?.relative_error
                ));
            }
            println!("| {label} | {} |", cells.join(" | "));
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
