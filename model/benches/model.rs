//! Training-core benchmarks, printed as tables (run with `scripts/bench-model.sh`).
//!
//! 1. Throughput: forward+backward tokens/s of each stage of `small`, the boundary encoding, and
//!    the same model back-propagated monolithically, measured side by side in one run.
//! 2. Compression: bytes per token crossing a stage boundary and held-out loss after a fixed
//!    number of steps on the grammar corpus, for d/b = 1, 8, 32 and 64 in f32, and 64 and 128
//!    with int8 and int4 wire.
//!
//! 3. Device (`-- device`, not part of the default run): forward+backward tokens/s of each stage
//!    of a model on a GPU (built with `--features cuda`), in bf16 and f32 compute, with the
//!    model FLOPs achieved next to candle's own matrix-product rate on the same device, measured
//!    in the same run.
//!
//! `BENCH_STEPS` (default 500) sets the training steps of the compression runs and
//! `BENCH_ITERS` (default 5) the timed iterations of the throughput and device runs. The device
//! run reads `BENCH_DEVICE` (default `cuda:0`), `BENCH_MODEL` (default `iota-1.5b`),
//! `BENCH_BATCH` (4) and `BENCH_SEQ` (1024).

use std::time::{Duration, Instant};

mod support;

use iota_model::data::{Batch, Dataset, GrammarCorpus, make_batch};
use iota_model::{
    AdamWConfig, BoundaryTensor, DType, Device, LrSchedule, ModelConfig, ModelError, Pipeline,
    Result, Stage, StageOptions, Tensor, Trainer, WireConfig, WireEncoding,
};

fn env_or(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn hop(t: &iota_model::Tensor, enc: WireEncoding) -> Result<iota_model::Tensor> {
    let bytes = BoundaryTensor::from_tensor(t, enc)?.to_bytes()?;
    BoundaryTensor::from_bytes(&bytes, Some(t.dims()))?.to_tensor(&Device::Cpu)
}

struct Timings {
    stage: Vec<Duration>,
    stage_recompute: Vec<Duration>,
    wire: Duration,
    monolithic: Duration,
}

/// One staged forward+backward with per-stage timers (forward and backward of a stage summed).
fn staged(stages: &mut [Stage], b: &Batch, t: &mut Timings, recompute: bool) -> Result<f32> {
    let last = stages.len() - 1;
    let mut caches = Vec::new();
    let mut x = b.inputs.clone();
    let mut loss = 0.0;
    for (k, s) in stages.iter().enumerate() {
        let t0 = Instant::now();
        let (out, cache) = s.forward(&x, (k == last).then_some(&b.targets))?;
        let dt = t0.elapsed();
        if recompute {
            t.stage_recompute[k] += dt
        } else {
            t.stage[k] += dt
        }
        caches.push(cache);
        if k == last {
            loss = out.loss()?;
        } else {
            let t0 = Instant::now();
            x = hop(out.activations()?, WireEncoding::F32)?;
            if !recompute {
                t.wire += t0.elapsed();
            }
        }
    }
    let mut grad = None;
    for (k, (s, c)) in stages.iter_mut().zip(caches).enumerate().rev() {
        let t0 = Instant::now();
        let g = s.backward(c, grad.as_ref())?;
        let dt = t0.elapsed();
        if recompute {
            t.stage_recompute[k] += dt
        } else {
            t.stage[k] += dt
        }
        grad = match g {
            Some(g) => {
                let t0 = Instant::now();
                let g = hop(&g, WireEncoding::F32)?;
                if !recompute {
                    t.wire += t0.elapsed();
                }
                Some(g)
            }
            None => None,
        };
    }
    Ok(loss)
}

fn throughput() -> Result<()> {
    let cfg = ModelConfig::small();
    let (batch, seq) = (4usize, 128usize);
    let iters = env_or("BENCH_ITERS", 5) as u32;
    let g = GrammarCorpus::new(0, seq)?;
    let batches: Vec<Batch> = (0..=iters as u64)
        .map(|i| make_batch(&g, &(i * 4..i * 4 + 4).collect::<Vec<_>>(), &Device::Cpu))
        .collect::<Result<_>>()?;
    let mut pipe = Pipeline::new(&cfg, &StageOptions::cpu())?;
    let mut rec_opts = StageOptions::cpu();
    rec_opts.recompute = true;
    let mut rec = Stage::all(&cfg, &rec_opts)?;
    let k = cfg.num_stages();
    let mut t = Timings {
        stage: vec![Duration::ZERO; k],
        stage_recompute: vec![Duration::ZERO; k],
        wire: Duration::ZERO,
        monolithic: Duration::ZERO,
    };
    let mut scratch = Timings {
        stage: vec![Duration::ZERO; k],
        stage_recompute: vec![Duration::ZERO; k],
        wire: Duration::ZERO,
        monolithic: Duration::ZERO,
    };
    // Warm-up (first-touch allocations, thread pools), not timed.
    staged(pipe.stages_mut(), &batches[0], &mut scratch, false)?;
    pipe.forward_backward_monolithic(&batches[0].inputs, &batches[0].targets)?;
    staged(&mut rec, &batches[0], &mut scratch, true)?;
    // Interleave the variants so that machine noise hits all of them alike.
    for b in &batches[1..] {
        staged(pipe.stages_mut(), b, &mut t, false)?;
        let t0 = Instant::now();
        pipe.forward_backward_monolithic(&b.inputs, &b.targets)?;
        t.monolithic += t0.elapsed();
        staged(&mut rec, b, &mut t, true)?;
        pipe.zero_grad();
        rec.iter_mut().for_each(Stage::zero_grad);
    }
    let tokens = (batch * seq) as f64 * f64::from(iters);
    let tps = |d: Duration| tokens / d.as_secs_f64();
    let ms = |d: Duration| d.as_secs_f64() * 1e3 / f64::from(iters);
    println!(
        "## Throughput: `small` ({:.1}M parameters, d={}, stages {:?}, b={}), CPU f32, micro-batch {batch}x{seq} tokens, {iters} timed iterations, {} threads",
        cfg.param_count()? as f64 / 1e6,
        cfg.d_model,
        cfg.stages,
        cfg.bottleneck_dim,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    println!();
    println!(
        "| part | params | fwd+bwd ms / micro-batch | tokens/s | with recompute: ms | tokens/s |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for s in 0..k {
        println!(
            "| stage {s} | {:.2}M | {:.1} | {:.0} | {:.1} | {:.0} |",
            cfg.stage_param_count(s)? as f64 / 1e6,
            ms(t.stage[s]),
            tps(t.stage[s]),
            ms(t.stage_recompute[s]),
            tps(t.stage_recompute[s])
        );
    }
    let staged_total: Duration = t.stage.iter().sum::<Duration>() + t.wire;
    println!(
        "| boundary encode+decode (f32, {} hops) | - | {:.1} | - | - | - |",
        2 * (k - 1),
        ms(t.wire)
    );
    println!(
        "| all stages in sequence (sum above) | {:.2}M | {:.1} | {:.0} | - | - |",
        cfg.param_count()? as f64 / 1e6,
        ms(staged_total),
        tps(staged_total)
    );
    println!(
        "| monolithic (one graph) | {:.2}M | {:.1} | {:.0} | - | - |",
        cfg.param_count()? as f64 / 1e6,
        ms(t.monolithic),
        tps(t.monolithic)
    );
    println!();
    println!(
        "Pipeline overhead: staged / monolithic time = {:.3} (stage compute alone {:.3}); recompute costs {:.2}x the stage time.",
        staged_total.as_secs_f64() / t.monolithic.as_secs_f64(),
        t.stage.iter().sum::<Duration>().as_secs_f64() / t.monolithic.as_secs_f64(),
        t.stage_recompute.iter().sum::<Duration>().as_secs_f64()
            / t.stage.iter().sum::<Duration>().as_secs_f64()
    );
    println!();
    Ok(())
}

fn compression() -> Result<()> {
    let steps = env_or("BENCH_STEPS", 500);
    let (batch, seq) = (8u64, 64usize);
    let g = GrammarCorpus::new(0, seq)?;
    let base = support::three_small_stages("bench-compression", g.vocab_size(), seq);
    let d = base.d_model;
    let eval_ids: Vec<u64> = (10_000_000..10_000_000 + 256).collect();
    let eval: Vec<Batch> = eval_ids
        .chunks(batch as usize)
        .map(|c| make_batch(&g, c, &Device::Cpu))
        .collect::<Result<_>>()?;
    let floor = eval_ids
        .iter()
        .map(|id| g.surprisal(&g.window(*id)?))
        .sum::<Result<f64>>()?
        / eval_ids.len() as f64;
    println!(
        "## Compression: d={d}, {} heads, d_ff {}, stages {:?}, grammar corpus (vocab {}), {steps} steps of {batch}x{seq} tokens, AdamW lr 3e-3 warmup+cosine; held-out loss on {} windows (entropy floor on them {floor:.4} nats/token)",
        base.n_heads,
        base.d_ff,
        base.stages,
        g.vocab_size(),
        eval_ids.len()
    );
    println!();
    println!(
        "| d/b | b | wire | bytes/token/boundary (fwd) | (bwd) | vs fp32 residual ({} B) | loss | vs d/b=1 | time |",
        4 * d
    );
    println!("|---|---:|---|---:|---:|---:|---:|---:|---:|");
    let runs: [(usize, WireConfig); 8] = [
        (1, WireConfig::default()),
        (8, WireConfig::default()),
        (32, WireConfig::default()),
        (64, WireConfig::default()),
        (64, WireConfig::int8()),
        (64, WireConfig::int4()),
        (128, WireConfig::int8()),
        (128, WireConfig::int4()),
    ];
    let mut baseline = None;
    for (ratio, wire) in runs {
        let cfg = base.clone().with_bottleneck(d / ratio);
        let pipe = Pipeline::new(&cfg, &StageOptions::cpu())?.with_wire(wire);
        let adamw = AdamWConfig {
            lr: 3e-3,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        };
        let schedule = LrSchedule {
            warmup_steps: steps / 10,
            total_steps: steps,
            min_lr_ratio: 0.1,
        };
        let mut tr = Trainer::new(pipe, adamw, schedule)?;
        let t0 = Instant::now();
        let (mut fwd, mut bwd, mut tok) = (0usize, 0usize, 0usize);
        for s in 0..steps {
            let ids: Vec<u64> = (s * batch..(s + 1) * batch).collect();
            let r = tr.step(&[make_batch(&g, &ids, &Device::Cpu)?])?;
            fwd += r.forward_bytes;
            bwd += r.backward_bytes;
            tok += r.tokens;
        }
        let loss = f64::from(tr.eval(&eval)?);
        let boundaries = (cfg.num_stages() - 1) * tok;
        let (bf, bb) = (
            fwd as f64 / boundaries as f64,
            bwd as f64 / boundaries as f64,
        );
        let base_loss = *baseline.get_or_insert(loss);
        let wire_name = match wire.activations {
            WireEncoding::F32 => "f32",
            WireEncoding::Int8 => "int8",
            WireEncoding::Int4 => "int4",
        };
        println!(
            "| {ratio} | {} | {wire_name} | {bf:.0} | {bb:.0} | {:.0}x | {loss:.4} | {:+.2}% | {:.0}s |",
            cfg.bottleneck_dim,
            (4 * d) as f64 / bf,
            100.0 * (loss - base_loss) / base_loss,
            t0.elapsed().as_secs_f64()
        );
    }
    println!();
    Ok(())
}

/// Matrix-multiply FLOPs of one token's forward+backward through stage `s`: 2 per weight of
/// every linear map (the embedding is a lookup, not a product) and 2 x 2 x seq x d per block
/// for the attention scores and their weighted sum (causal masking not discounted), times 3
/// for the backward.
fn stage_flops_per_token(stage: &Stage, seq: usize) -> f64 {
    let linear: usize = stage
        .params()
        .iter()
        .filter(|p| p.var().as_tensor().rank() == 2 && p.name() != "embed.weight")
        .map(|p| p.var().as_tensor().elem_count())
        .sum();
    let blocks = stage.config().stages[stage.index()];
    let attention = 4 * seq * stage.config().d_model * blocks;
    3.0 * (2 * linear + attention) as f64
}

/// TFLOP/s of candle's own `n x n x n` matrix product on `device` in `dtype`: the ceiling the
/// stage figures are read against. Median of 10 after 3 warm-ups, over random operands.
fn matmul_tflops(device: &Device, dtype: DType, n: usize) -> Result<f64> {
    let a = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(dtype)?;
    let mut times = Vec::new();
    for i in 0..13 {
        device.synchronize()?;
        let t0 = Instant::now();
        let c = a.matmul(&b)?;
        device.synchronize()?;
        if i >= 3 {
            times.push(t0.elapsed().as_secs_f64());
        }
        drop(c);
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * (n as f64).powi(3) / times[times.len() / 2] / 1e12)
}

/// Forward+backward of one micro-batch through `stage` alone, as a miner holding it runs it:
/// token ids or a boundary activation in, the loss or a boundary gradient back, each crossing
/// the wire format. The device is synchronised before the clock is read.
fn pass_on(stage: &mut Stage, b: &Batch, batch: usize, seq: usize, seed: u64) -> Result<()> {
    let device = stage.options().device.clone();
    let wire = |t: &Tensor| -> Result<Tensor> {
        let bytes = BoundaryTensor::from_tensor(t, WireEncoding::F32)?.to_bytes()?;
        BoundaryTensor::from_bytes(&bytes, Some(t.dims()))?.to_tensor(&device)
    };
    let input = if stage.is_first() {
        b.inputs.clone()
    } else {
        wire(&Tensor::randn(
            0f32,
            1.0,
            stage.input_dims(batch, seq),
            &device,
        )?)?
    };
    let targets = stage.is_last().then_some(&b.targets);
    let (out, cache) = stage.forward(&input, targets)?;
    let grad = if stage.is_last() {
        if !out.loss()?.is_finite() {
            return Err(ModelError::InvalidInput(format!(
                "seed {seed}: loss {} is not finite",
                out.loss()?
            )));
        }
        None
    } else {
        Some(wire(
            &(Tensor::randn(0f32, 1.0, stage.output_dims(batch, seq), &device)? * 1e-3)?,
        )?)
    };
    if let Some(g) = stage.backward(cache, grad.as_ref())? {
        wire(&g)?;
    }
    device.synchronize()?;
    Ok(())
}

fn device_throughput() -> Result<()> {
    let spec = std::env::var("BENCH_DEVICE").unwrap_or_else(|_| "cuda:0".into());
    let device = match spec.as_str() {
        "cpu" => Device::Cpu,
        other => {
            let n = other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| {
                    ModelError::Config(format!("BENCH_DEVICE {other:?}: use cpu or cuda:N"))
                })?;
            Device::new_cuda(n)?
        }
    };
    let model = std::env::var("BENCH_MODEL").unwrap_or_else(|_| "iota-1.5b".into());
    let cfg = ModelConfig::by_name(&model)?;
    // For a reference run of the same shapes elsewhere (scripts/reference/torch_stage_speed.py).
    if let Ok(path) = std::env::var("BENCH_CONFIG_OUT") {
        std::fs::write(&path, cfg.to_json()?)
            .map_err(|e| ModelError::Config(format!("writing {path}: {e}")))?;
    }
    let batch = env_or("BENCH_BATCH", 4) as usize;
    let seq = env_or("BENCH_SEQ", 1024) as usize;
    let iters = env_or("BENCH_ITERS", 5) as u32;
    let g = GrammarCorpus::new(0, seq)?;
    let batches: Vec<Batch> = (0..=u64::from(iters))
        .map(|i| {
            let ids: Vec<u64> = (i * batch as u64..(i + 1) * batch as u64).collect();
            make_batch(&g, &ids, &device)
        })
        .collect::<Result<_>>()?;
    let tokens = (batch * seq) as f64 * f64::from(iters);
    let dtypes: &[DType] = if device.is_cpu() {
        &[DType::F32]
    } else {
        &[DType::BF16, DType::F32]
    };
    println!(
        "## Device throughput: each stage of `{model}` ({:.2}B parameters, d={}, stages {:?}, b={}) alone on {spec}, as one miner holds it; micro-batch {batch}x{seq} tokens, {iters} timed passes after one warm-up; f32 master weights and gradients",
        cfg.param_count()? as f64 / 1e9,
        cfg.d_model,
        cfg.stages,
        cfg.bottleneck_dim,
    );
    println!();
    println!(
        "| compute | part | fwd+bwd ms / micro-batch | tokens/s | model TFLOP/s | of candle's {0}x{0}x{0} product |",
        4096
    );
    println!("|---|---|---:|---:|---:|---:|");
    for &dtype in dtypes {
        let ceiling = matmul_tflops(&device, dtype, 4096)?;
        let opts = StageOptions {
            device: device.clone(),
            compute_dtype: dtype,
            ..StageOptions::cpu()
        };
        let name = format!("{dtype:?}").to_lowercase();
        for k in 0..cfg.num_stages() {
            let mut stage = Stage::new(&cfg, k, opts.clone())?;
            pass_on(&mut stage, &batches[0], batch, seq, 0)?;
            let mut secs = 0.0;
            for (i, b) in batches[1..].iter().enumerate() {
                stage.zero_grad();
                device.synchronize()?;
                let t0 = Instant::now();
                pass_on(&mut stage, b, batch, seq, i as u64 + 1)?;
                secs += t0.elapsed().as_secs_f64();
            }
            let tflops = stage_flops_per_token(&stage, seq) * tokens / secs / 1e12;
            println!(
                "| {name} | stage {k} ({:.0}M params) | {:.1} | {:.0} | {tflops:.1} | {:.0}% |",
                stage.num_parameters() as f64 / 1e6,
                secs * 1e3 / f64::from(iters),
                tokens / secs,
                100.0 * tflops / ceiling
            );
        }
        println!(
            "| {name} | candle {0}x{0}x{0} product | - | - | {ceiling:.1} | 100% |",
            4096
        );
    }
    println!();
    println!(
        "Model FLOPs per token: 3 x (2 per linear weight + 4 x seq x d per block), causal masking not discounted; the timed pass includes the boundary tensors' wire encoding."
    );
    println!();
    Ok(())
}

fn main() -> Result<()> {
    let which = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    match which.as_deref() {
        Some("throughput") => throughput(),
        Some("compression") => compression(),
        Some("device") => device_throughput(),
        _ => {
            throughput()?;
            compression()
        }
    }
}
