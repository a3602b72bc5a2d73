use super::*;
use crate::data::{GrammarCorpus, make_batch};
use crate::pipeline::Pipeline;

fn batch(seq: usize, n: usize) -> crate::data::Batch {
    let g = GrammarCorpus::new(0, seq).unwrap();
    let ids: Vec<u64> = (0..n as u64).collect();
    make_batch(&g, &ids, &Device::Cpu).unwrap()
}

fn abs_sum(t: &Tensor) -> f64 {
    t.abs()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

#[test]
fn every_parameter_gets_a_nonzero_gradient() {
    for cfg in [
        ModelConfig::tiny(),
        ModelConfig::tiny().with_bottleneck(32),
        ModelConfig::tiny().with_stages(vec![3]),
    ] {
        let mut p = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
        let b = batch(16, 3);
        p.forward_backward(&b.inputs, &b.targets).unwrap();
        for s in p.stages() {
            for (i, param) in s.params().iter().enumerate() {
                let g = s
                    .grad(i)
                    .unwrap_or_else(|| panic!("{} has no gradient", param.name()));
                assert_eq!(g.dims(), param.var().dims());
                let a = abs_sum(g);
                assert!(a > 0.0 && a.is_finite(), "{}: |grad| = {a}", param.name());
            }
        }
    }
}

fn f64_opts() -> StageOptions {
    StageOptions {
        param_dtype: DType::F64,
        compute_dtype: DType::F64,
        ..StageOptions::cpu()
    }
}

fn set_elem(var: &Var, i: usize, v: f64) {
    let mut data = var
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    data[i] = v;
    var.set(&Tensor::from_vec(data, var.dims(), var.device()).unwrap())
        .unwrap();
}

fn get_elem(t: &Tensor, i: usize) -> f64 {
    t.flatten_all()
        .unwrap()
        .get(i)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// The scalar whose gradient `backward` computes: the loss on the last stage, otherwise
/// `sum(output * g)`.
fn objective(stage: &Stage, input: &Tensor, targets: &Tensor, g: Option<&Tensor>) -> f64 {
    let tg = stage.is_last().then_some(targets);
    let (out, _) = stage.forward(input, tg).unwrap();
    match (out, g) {
        (StageOutput::Loss(_), _) => {
            // Recompute the loss in f64 (StageOutput rounds it to f32).
            let h = stage.run(input).unwrap();
            let d = stage.config().d_model;
            let f = loss::ce_forward(
                &h.reshape(((), d)).unwrap(),
                &stage.head_weight().unwrap(),
                &targets.flatten_all().unwrap(),
                stage.config().loss_vocab_chunk,
                false,
            )
            .unwrap();
            f.loss.to_scalar::<f64>().unwrap()
        }
        (StageOutput::Activations(a), Some(g)) => (a * g)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap(),
        _ => unreachable!(),
    }
}

#[test]
fn finite_difference_gradients_per_stage() {
    let cfg = ModelConfig::tiny();
    let b = batch(6, 2);
    let (bs, t) = (2, 6);
    let mut rng = crate::rng::SplitMix64::new(11);
    let mut randn = |dims: &[usize]| {
        let n: usize = dims.iter().product();
        Tensor::from_vec(
            (0..n).map(|_| rng.next_normal()).collect::<Vec<f64>>(),
            dims,
            &Device::Cpu,
        )
        .unwrap()
    };
    for k in 0..cfg.num_stages() {
        let mut stage = Stage::new(&cfg, k, f64_opts()).unwrap();
        // Larger weights than the init make every path matter numerically.
        for p in stage.params() {
            if p.decay() {
                let w = (p.var().as_tensor() * 10.0).unwrap();
                p.var().set(&w).unwrap();
            }
        }
        let input = if k == 0 {
            b.inputs.clone()
        } else {
            randn(&stage.input_dims(bs, t))
        };
        let g_out = (!stage.is_last()).then(|| randn(&stage.output_dims(bs, t)));
        let tg = stage.is_last().then_some(&b.targets);
        let (_, cache) = stage.forward(&input, tg).unwrap();
        let g_in = stage.backward(cache, g_out.as_ref()).unwrap();
        let eps = 1e-5;
        let mut checked = 0;
        for (pi, p) in stage.params().iter().enumerate() {
            // The token-mean gradient: what the objective's finite difference measures.
            let grad = stage.mean_grad(pi).unwrap().unwrap();
            let n = p.var().elem_count();
            for j in [0, n / 3, n - 1] {
                let orig = get_elem(p.var().as_tensor(), j);
                set_elem(p.var(), j, orig + eps);
                let up = objective(&stage, &input, &b.targets, g_out.as_ref());
                set_elem(p.var(), j, orig - eps);
                let down = objective(&stage, &input, &b.targets, g_out.as_ref());
                set_elem(p.var(), j, orig);
                let fd = (up - down) / (2.0 * eps);
                let an = get_elem(&grad, j);
                let err = (fd - an).abs() / (fd.abs() + an.abs()).max(1e-6);
                assert!(
                    err < 1e-5,
                    "stage {k} {}[{j}]: fd {fd} vs analytic {an}",
                    p.name()
                );
                checked += 1;
            }
        }
        if let Some(g_in) = g_in {
            for j in [0, 7, input.elem_count() - 1] {
                let orig = get_elem(&input, j);
                let mut data = input.flatten_all().unwrap().to_vec1::<f64>().unwrap();
                data[j] = orig + eps;
                let up_in = Tensor::from_vec(data.clone(), input.dims(), &Device::Cpu).unwrap();
                data[j] = orig - eps;
                let down_in = Tensor::from_vec(data, input.dims(), &Device::Cpu).unwrap();
                let fd = (objective(&stage, &up_in, &b.targets, g_out.as_ref())
                    - objective(&stage, &down_in, &b.targets, g_out.as_ref()))
                    / (2.0 * eps);
                let an = get_elem(&g_in, j);
                let err = (fd - an).abs() / (fd.abs() + an.abs()).max(1e-6);
                assert!(err < 1e-5, "stage {k} input[{j}]: fd {fd} vs analytic {an}");
                checked += 1;
            }
        }
        assert!(checked >= 30);
    }
}

#[test]
fn recompute_gives_identical_gradients() {
    let cfg = ModelConfig::tiny();
    let b = batch(12, 2);
    let mut a = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
    let mut opts = StageOptions::cpu();
    opts.recompute = true;
    let mut r = Pipeline::new(&cfg, &opts).unwrap();
    let la = a.forward_backward(&b.inputs, &b.targets).unwrap();
    let lr = r.forward_backward(&b.inputs, &b.targets).unwrap();
    assert_eq!(la, lr);
    for (sa, sr) in a.stages().iter().zip(r.stages()) {
        for i in 0..sa.params().len() {
            let d = abs_sum(&(sa.grad(i).unwrap() - sr.grad(i).unwrap()).unwrap());
            assert_eq!(d, 0.0);
        }
    }
    // And it saves what it is for: with recompute, a forward keeps no output graph.
    for recompute in [false, true] {
        let mut opts = StageOptions::cpu();
        opts.recompute = recompute;
        let stage = Stage::new(&cfg, 0, opts).unwrap();
        let (_, cache) = stage.forward(&b.inputs, None).unwrap();
        assert_eq!(cache.output.is_none(), recompute, "recompute {recompute}");
    }
}

/// Per-block checkpointing, alone and with recompute, on every kind of stage (embedding,
/// middle, head) gives the whole graph's loss and the same gradient bits; a block left out of
/// the recompute, or recomputed from the wrong input, would change them.
#[test]
fn checkpointed_blocks_give_identical_gradients() {
    let cfg = ModelConfig::tiny().with_stages(vec![2, 3, 2]);
    let b = batch(12, 2);
    let mut whole = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
    let lw = whole.forward_backward(&b.inputs, &b.targets).unwrap();
    for recompute in [false, true] {
        let mut opts = StageOptions::cpu();
        opts.checkpoint_blocks = true;
        opts.recompute = recompute;
        let mut p = Pipeline::new(&cfg, &opts).unwrap();
        let l = p.forward_backward(&b.inputs, &b.targets).unwrap();
        assert_eq!(l, lw, "recompute {recompute}");
        for (sw, sc) in whole.stages().iter().zip(p.stages()) {
            assert!(sc.num_blocks() > 0);
            for i in 0..sw.params().len() {
                let (gw, gc) = (sw.grad(i).unwrap(), sc.grad(i).unwrap());
                assert_eq!(
                    gw.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    gc.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    "stage {} {} (recompute {recompute})",
                    sw.index(),
                    sw.params()[i].name()
                );
            }
        }
        // What it keeps: block inputs without graphs, or with recompute nothing but the input.
        let stage = Stage::new(&cfg, 1, opts).unwrap();
        let x = Tensor::zeros(stage.input_dims(2, 12), DType::F32, &Device::Cpu).unwrap();
        let (_, cache) = stage.forward(&x, None).unwrap();
        assert!(cache.output.is_none());
        assert_eq!(
            cache.block_inputs.as_ref().map(Vec::len),
            (!recompute).then_some(stage.num_blocks() + 1)
        );
    }
}

/// What checkpointing is for: a training step of eight blocks holds far less at its peak.
#[test]
fn checkpointed_blocks_bound_the_peak() {
    let cfg = ModelConfig::tiny().with_stages(vec![8]);
    let b = batch(64, 8);
    let peak = |checkpoint_blocks: bool| {
        let opts = StageOptions {
            checkpoint_blocks,
            ..StageOptions::cpu()
        };
        let mut stage = Stage::new(&cfg, 0, opts).unwrap();
        crate::alloc_count::peak_during(|| {
            let (_, cache) = stage.forward(&b.inputs, Some(&b.targets)).unwrap();
            stage.backward(cache, None).unwrap();
        })
        .1
    };
    let (whole, checkpointed) = (peak(false), peak(true));
    assert!(
        checkpointed * 2 < whole,
        "checkpointed {checkpointed} bytes at the peak, whole graph {whole}"
    );
}

#[test]
fn held_gradients_change_nothing_until_committed() {
    // The last stage of a one-stage model: its forward takes tokens, its backward needs no
    // output gradient.
    let cfg = ModelConfig::tiny().with_stages(vec![2]);
    let (b1, b2) = (batch(12, 2), batch(12, 3));
    let mut direct = Stage::new(&cfg, 0, StageOptions::cpu()).unwrap();
    let mut held = Stage::new(&cfg, 0, StageOptions::cpu()).unwrap();
    for (inputs, targets) in [(&b1.inputs, &b1.targets), (&b2.inputs, &b2.targets)] {
        let (_, c) = direct.forward(inputs, Some(targets)).unwrap();
        direct.backward(c, None).unwrap();
    }
    // The first backward is held and dropped; nothing of it remains.
    let (_, c) = held.forward(&b2.inputs, Some(&b2.targets)).unwrap();
    drop(held.backward_held(c, None).unwrap());
    assert_eq!(held.backward_count(), 0);
    assert!((0..held.params().len()).all(|i| held.grad(i).is_none()));
    // Held and committed in order: the same bits as backward at once.
    for (inputs, targets) in [(&b1.inputs, &b1.targets), (&b2.inputs, &b2.targets)] {
        let (_, c) = held.forward(inputs, Some(targets)).unwrap();
        let (_, g) = held.backward_held(c, None).unwrap();
        g.check_finite().unwrap();
        held.commit(g).unwrap();
    }
    assert_eq!(held.backward_tokens(), direct.backward_tokens());
    for i in 0..direct.params().len() {
        let d = abs_sum(&(direct.grad(i).unwrap() - held.grad(i).unwrap()).unwrap());
        assert_eq!(d, 0.0, "parameter {i}");
    }
    // Another stage's gradients are refused.
    let mut other = Stage::new(&cfg, 0, StageOptions::cpu()).unwrap();
    let (_, c) = other.forward(&b1.inputs, Some(&b1.targets)).unwrap();
    let (_, g) = other.backward_held(c, None).unwrap();
    assert!(held.commit(g).is_err());
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let cfg = ModelConfig::tiny();
    let dev = Device::Cpu;
    let s0 = Stage::new(&cfg, 0, StageOptions::cpu()).unwrap();
    let mut s1 = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
    let s2 = Stage::new(&cfg, 2, StageOptions::cpu()).unwrap();
    let tokens = Tensor::new(&[[1u32, 2, 3]], &dev).unwrap();
    // Stage 0: dtype, rank, length, range, stray targets.
    assert!(matches!(
        s0.forward(&tokens.to_dtype(DType::F32).unwrap(), None),
        Err(ModelError::DType { .. })
    ));
    assert!(s0.forward(&tokens.flatten_all().unwrap(), None).is_err());
    let long = Tensor::zeros((1, cfg.max_seq_len + 1), DType::U32, &dev).unwrap();
    assert!(s0.forward(&long, None).is_err());
    let empty = Tensor::zeros((1, 0), DType::U32, &dev).unwrap();
    assert!(s0.forward(&empty, None).is_err());
    let oob = Tensor::new(&[[1u32, 64]], &dev).unwrap();
    assert!(matches!(
        s0.forward(&oob, None),
        Err(ModelError::TokenOutOfRange { id: 64, .. })
    ));
    assert!(s0.forward(&tokens, Some(&tokens)).is_err());
    // Middle stage: width, dtype, NaN.
    let good = Tensor::zeros((1, 3, cfg.bottleneck_dim), DType::F32, &dev).unwrap();
    assert!(
        s1.forward(&Tensor::zeros((1, 3, 5), DType::F32, &dev).unwrap(), None)
            .is_err()
    );
    assert!(
        s1.forward(&good.to_dtype(DType::F64).unwrap(), None)
            .is_err()
    );
    assert!(s1.forward(&tokens, None).is_err());
    let nan = (good.clone() + f64::NAN).unwrap();
    assert!(matches!(
        s1.forward(&nan, None),
        Err(ModelError::NonFinite(_))
    ));
    let inf = (good.clone() + f64::INFINITY).unwrap();
    assert!(matches!(
        s1.forward(&inf, None),
        Err(ModelError::NonFinite(_))
    ));
    // Backward: missing, misshapen or non-finite gradients, foreign caches.
    let (_, c) = s1.forward(&good, None).unwrap();
    assert!(s1.backward(c, None).is_err());
    let (_, c) = s1.forward(&good, None).unwrap();
    assert!(
        s1.backward(
            c,
            Some(&Tensor::zeros((1, 2, 8), DType::F32, &dev).unwrap())
        )
        .is_err()
    );
    let (_, c) = s1.forward(&good, None).unwrap();
    assert!(s1.backward(c, Some(&nan)).is_err());
    let (_, c) = s2.forward(&good, Some(&tokens)).unwrap();
    assert!(s1.backward(c, Some(&good)).is_err());
    // Last stage: targets required and shaped like the input.
    assert!(s2.forward(&good, None).is_err());
    assert!(
        s2.forward(&good, Some(&Tensor::new(&[[1u32, 2]], &dev).unwrap()))
            .is_err()
    );
    assert!(s2.forward(&good, Some(&oob)).is_err());
    // Nothing was accumulated by the failed calls.
    assert_eq!(s1.backward_count(), 0);
    // A bad dtype combination is a config error.
    let bad = StageOptions {
        compute_dtype: DType::U8,
        ..StageOptions::cpu()
    };
    assert!(Stage::new(&cfg, 0, bad).is_err());
    // Half precision on the CPU is refused with a clear message.
    let bf16_cpu = StageOptions {
        compute_dtype: DType::BF16,
        ..StageOptions::cpu()
    };
    let err = Stage::new(&cfg, 0, bf16_cpu).unwrap_err().to_string();
    assert!(err.contains("BF16") && err.contains("CUDA"), "{err}");
    assert!(Stage::new(&cfg, 3, StageOptions::cpu()).is_err());
}

fn max_rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let scale = b
        .to_dtype(DType::F64)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    d / scale.max(1e-12)
}

fn random_like(dims: &[usize], seed: u64, dtype: DType) -> Tensor {
    let mut rng = crate::rng::SplitMix64::new(seed);
    let n: usize = dims.iter().product();
    Tensor::from_vec(
        (0..n)
            .map(|_| rng.next_normal() as f32)
            .collect::<Vec<f32>>(),
        dims,
        &Device::Cpu,
    )
    .unwrap()
    .to_dtype(dtype)
    .unwrap()
}

/// An optimizer step between a forward and its backward: the backward must give exactly the
/// gradients of a from-scratch forward+backward with the new weights (a full recompute), not
/// a mix of old activations (or an old log-sum-exp) with new weights.
fn check_stale_cache(opts: &StageOptions, tol: f64) {
    check_stale_cache_with(opts, tol, Stage::new)
}

fn check_stale_cache_with(
    opts: &StageOptions,
    tol: f64,
    build: fn(&ModelConfig, usize, StageOptions) -> Result<Stage>,
) {
    use crate::optim::{AdamW, AdamWConfig, LrSchedule};
    let cfg = ModelConfig::tiny();
    let b = batch(10, 3);
    let other = batch(10, 3);
    let dtype = opts.param_dtype;
    for recompute in [false, true] {
        for k in 0..cfg.num_stages() {
            let opts = StageOptions {
                recompute,
                ..opts.clone()
            };
            let mut stage = build(&cfg, k, opts.clone()).unwrap();
            let (input, other_input) = if k == 0 {
                (b.inputs.clone(), other.inputs.clone())
            } else {
                let dims = stage.input_dims(3, 10);
                (random_like(&dims, 1, dtype), random_like(&dims, 2, dtype))
            };
            let g_out =
                (!stage.is_last()).then(|| random_like(&stage.output_dims(3, 10), 3, dtype));
            let tg = stage.is_last().then_some(&b.targets);
            let (_, cache) = stage.forward(&input, tg).unwrap();
            assert_eq!(cache.weights_version(), stage.weights_version());
            // Another sample's gradients, then a local step: the weights move in place.
            let (_, c2) = stage
                .forward(&other_input, stage.is_last().then_some(&other.targets))
                .unwrap();
            stage.backward(c2, g_out.as_ref()).unwrap();
            let mut opt = AdamW::new(
                &stage,
                AdamWConfig {
                    lr: 0.05,
                    ..AdamWConfig::default()
                },
                LrSchedule::constant(),
            )
            .unwrap();
            let before = stage.weights_version();
            opt.step(&mut stage).unwrap();
            assert_eq!(stage.weights_version(), before + 1);
            let g_in = stage.backward(cache, g_out.as_ref()).unwrap();
            assert_eq!(stage.stale_recomputes(), 1);

            let mut fresh = build(&cfg, k, opts.clone()).unwrap();
            for (f, p) in fresh.params().iter().zip(stage.params()) {
                f.var().set(&p.var().as_tensor().copy().unwrap()).unwrap();
            }
            let (_, c) = fresh.forward(&input, tg).unwrap();
            let g_ref = fresh.backward(c, g_out.as_ref()).unwrap();
            for i in 0..stage.params().len() {
                let e = max_rel_diff(stage.grad(i).unwrap(), fresh.grad(i).unwrap());
                assert!(
                    e <= tol,
                    "stage {k} recompute={recompute} {}: rel diff {e}",
                    stage.params()[i].name()
                );
            }
            if let (Some(a), Some(r)) = (g_in, g_ref) {
                let e = max_rel_diff(&a, &r);
                assert!(e <= tol, "stage {k} input gradient: rel diff {e}");
            }
        }
    }
}

#[test]
fn stale_cache_backward_equals_from_scratch_f32() {
    check_stale_cache(&StageOptions::cpu(), 1e-6);
}

#[test]
fn stale_cache_backward_equals_from_scratch_f64() {
    check_stale_cache(&f64_opts(), 1e-12);
}

/// A micro-batch cut into runs: each run's stale cache is recomputed, and the backward counts
/// one stale recompute, not one a run.
#[test]
fn stale_cache_backward_equals_from_scratch_in_runs() {
    let opts = StageOptions {
        sub_batches: 2,
        ..f64_opts()
    };
    check_stale_cache(&opts, 1e-12);
}

/// bf16 compute on the CPU (test hook): the cached bf16 graph holds old weight copies, f32
/// sees the update in place; both recompute the same way. The gradients are compared with a
/// fresh bf16 stage, so the tolerance is f32-tight: same weights, same arithmetic.
#[test]
fn stale_cache_backward_equals_from_scratch_bf16_on_cpu_hook() {
    let opts = StageOptions {
        compute_dtype: DType::BF16,
        ..StageOptions::cpu()
    };
    check_stale_cache_with(&opts, 1e-6, Stage::new_allowing_cpu_half);
}

/// bf16 weights are cast once per weights version, and the cast copies still carry the
/// gradient to the f32 master weights.
#[test]
fn bf16_weight_copies_are_made_once_per_step() {
    let cfg = ModelConfig::tiny();
    let opts = StageOptions {
        compute_dtype: DType::BF16,
        ..StageOptions::cpu()
    };
    let mut s = Stage::new_allowing_cpu_half(&cfg, 1, opts).unwrap();
    let x = random_like(&s.input_dims(2, 6), 5, DType::F32);
    let g = random_like(&s.output_dims(2, 6), 6, DType::F32);
    let id = |s: &Stage| s.weight(2, true).unwrap().id();
    let before = id(&s);
    s.forward(&x, None).unwrap();
    assert_eq!(id(&s), before, "no new cast between forwards");
    let (_, c) = s.forward(&x, None).unwrap();
    s.backward(c, Some(&g)).unwrap();
    for i in 0..s.params().len() {
        assert!(
            abs_sum(s.grad(i).unwrap()) > 0.0,
            "{}",
            s.params()[i].name()
        );
        assert_eq!(s.grad(i).unwrap().dtype(), DType::F32);
    }
    s.mark_weights_changed();
    assert_ne!(id(&s), before, "a weight change invalidates the casts");
}

/// bf16 compute (CPU test hook) with f32 norms and residual stays close to f32 (outputs,
/// input gradients and parameter gradients), and does compute in bf16. The output is
/// compared by what the stage adds to its input: the f32 residual carries most of it, so a
/// whole-output comparison hid a residual rounded to bf16. A wide stage too, since a mean
/// of squares summed in bf16 goes wrong with width (at 1,024 channels, a bf16 norm put the
/// gradients 0.26 off, and 0.07 at 32).
#[test]
fn bf16_compute_tracks_f32() {
    check_bf16_tracks_f32(&Device::Cpu, Stage::new_allowing_cpu_half);
}

/// The same on a GPU, where `cuda:N:bf16` miners compute: cuBLAS's bf16 products and
/// candle's CUDA kernels, not the CPU's.
#[cfg(feature = "cuda")]
#[test]
fn bf16_compute_tracks_f32_cuda() {
    let Some(gpu) = crate::cuda_for_checks(0).unwrap() else {
        return;
    };
    check_bf16_tracks_f32(&gpu, Stage::new);
}

fn check_bf16_tracks_f32(
    device: &Device,
    build_half: fn(&ModelConfig, usize, StageOptions) -> Result<Stage>,
) {
    let wide = ModelConfig {
        d_model: 1024,
        n_heads: 8,
        n_kv_heads: 4,
        d_ff: 1024,
        bottleneck_dim: 64,
        ..ModelConfig::tiny()
    };
    for cfg in [ModelConfig::tiny(), wide] {
        let full = StageOptions {
            device: device.clone(),
            ..StageOptions::cpu()
        };
        let half = StageOptions {
            compute_dtype: DType::BF16,
            ..full.clone()
        };
        let mut a = Stage::new(&cfg, 1, full).unwrap();
        let mut h = build_half(&cfg, 1, half).unwrap();
        let on = |t: Tensor| t.to_device(device).unwrap();
        let x = on(random_like(&a.input_dims(2, 16), 8, DType::F32));
        let g = on(random_like(&a.output_dims(2, 16), 9, DType::F32));
        let (oa, ca) = a.forward(&x, None).unwrap();
        let (oh, ch) = h.forward(&x, None).unwrap();
        let (oa, oh) = (oa.activations().unwrap(), oh.activations().unwrap());
        assert_eq!(oh.dtype(), DType::F32, "the residual stream leaves in f32");
        let added_err = max_rel_diff(&(oh - &x).unwrap(), &(oa - &x).unwrap());
        let ga = a.backward(ca, Some(&g)).unwrap().unwrap();
        let gh = h.backward(ch, Some(&g)).unwrap().unwrap();
        let in_err = max_rel_diff(&gh, &ga);
        let mut worst = 0f64;
        for i in 0..a.params().len() {
            worst = worst.max(max_rel_diff(h.grad(i).unwrap(), a.grad(i).unwrap()));
        }
        let d = cfg.d_model;
        eprintln!(
            "bf16 vs f32 on {device:?}, width {d}: added {added_err:.2e}, input grad \
             {in_err:.2e}, param grad {worst:.2e}"
        );
        // Measured on the CPU: added 6.2e-3 and 6.0e-3 (32 and 1,024 wide), input grad
        // 1.5e-4 and 2.5e-3, param grad 4.0e-2 and 9.0e-2. With the residual in bf16: added
        // 0.52 (32 wide); with the norms in bf16 (1,024 wide): 7.9e-2, 1.5e-2 and 0.26.
        // On an H200 (`cuda` feature): the same at 32 wide; added 5.7e-3, input grad 2.3e-3
        // and param grad 9.0e-2 at 1,024.
        assert!(
            added_err > 1e-3,
            "width {d}: no bf16 rounding at all ({added_err:.2e})"
        );
        assert!(added_err < 2e-2, "width {d}: added {added_err:.2e}");
        assert!(in_err < 8e-3, "width {d}: input grad {in_err:.2e}");
        assert!(worst < 0.15, "width {d}: param grad {worst:.2e}");
    }
}

/// bf16 compute keeps old weight copies in a cached graph while f32 sees the update in
/// place; both must recompute the same way.
#[cfg(feature = "cuda")]
#[test]
fn stale_cache_backward_equals_from_scratch_bf16_cuda() {
    let Some(gpu) = crate::cuda_for_checks(0).unwrap() else {
        return;
    };
    let opts = StageOptions {
        device: gpu,
        compute_dtype: DType::BF16,
        ..StageOptions::cpu()
    };
    check_stale_cache(&opts, 1e-6);
}

/// Micro-batches of 1 and 3 sequences accumulate to the gradient of one batch of all 4: the
/// step is on the true token mean, not the mean of the micro-batch means.
#[test]
fn unequal_micro_batches_give_the_true_token_mean() {
    let cfg = ModelConfig::tiny();
    let g = GrammarCorpus::new(3, 12).unwrap();
    let all = make_batch(&g, &[10, 11, 12, 13], &Device::Cpu).unwrap();
    let one = make_batch(&g, &[10], &Device::Cpu).unwrap();
    let three = make_batch(&g, &[11, 12, 13], &Device::Cpu).unwrap();
    let mut whole = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
    let lw = whole
        .forward_backward(&all.inputs, &all.targets)
        .unwrap()
        .loss;
    let mut split = Pipeline::new(&cfg, &StageOptions::cpu()).unwrap();
    let l1 = split
        .forward_backward(&one.inputs, &one.targets)
        .unwrap()
        .loss;
    let l3 = split
        .forward_backward(&three.inputs, &three.targets)
        .unwrap()
        .loss;
    // The token mean weights the 3-sequence micro-batch three times as much.
    assert!((f64::from(lw) - (f64::from(l1) + 3.0 * f64::from(l3)) / 4.0).abs() < 1e-5);
    assert!(
        (l1 - l3).abs() > 1e-3,
        "the test needs distinct micro-batch losses"
    );
    for (sw, ss) in whole.stages().iter().zip(split.stages()) {
        assert_eq!(sw.backward_tokens(), ss.backward_tokens());
        for i in 0..sw.params().len() {
            let e = max_rel_diff(
                &ss.mean_grad(i).unwrap().unwrap(),
                &sw.mean_grad(i).unwrap().unwrap(),
            );
            assert!(e < 1e-5, "{}: rel diff {e}", sw.params()[i].name());
        }
    }
}

/// The last stage reports each sequence's loss, equal to running that sequence alone; the
/// evaluation forward gives the same values with no gradient graph.
#[test]
fn per_sequence_losses_and_eval_forward() {
    let cfg = ModelConfig::tiny();
    let b = batch(9, 3);
    let stages = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
    let run = |inputs: &Tensor, targets: &Tensor, eval: bool| {
        let mut x = inputs.clone();
        for s in &stages {
            let tg = s.is_last().then_some(targets);
            let out = if eval {
                s.forward_eval(&x, tg).unwrap()
            } else {
                s.forward(&x, tg).unwrap().0
            };
            match out {
                StageOutput::Activations(a) => {
                    assert!(!a.track_op(), "activations are detached");
                    x = a;
                }
                StageOutput::Loss(l) => return l,
            }
        }
        unreachable!()
    };
    let full = run(&b.inputs, &b.targets, false);
    assert_eq!(full.per_sequence.len(), 3);
    assert_eq!(full.tokens, 27);
    let mean: f32 = full.per_sequence.iter().sum::<f32>() / 3.0;
    assert!((mean - full.mean).abs() < 1e-5);
    for r in 0..3 {
        let alone = run(
            &b.inputs.narrow(0, r, 1).unwrap(),
            &b.targets.narrow(0, r, 1).unwrap(),
            false,
        );
        assert!((alone.mean - full.per_sequence[r]).abs() < 1e-5);
    }
    let eval = run(&b.inputs, &b.targets, true);
    assert_eq!(eval, full);
    // No graph: the evaluation output of a middle stage does not track its weights.
    let x0 = stages[0].forward_eval(&b.inputs, None).unwrap();
    let h = stages[1]
        .run_inner(x0.activations().unwrap(), false)
        .unwrap();
    assert!(!h.track_op());
    assert!(
        stages[1]
            .run_inner(x0.activations().unwrap(), true)
            .unwrap()
            .track_op()
    );
}

#[test]
fn stage_built_alone_equals_stage_in_model() {
    let cfg = ModelConfig::tiny();
    let all = Stage::all(&cfg, &StageOptions::cpu()).unwrap();
    let alone = Stage::new(&cfg, 1, StageOptions::cpu()).unwrap();
    for (a, b) in all[1].params().iter().zip(alone.params()) {
        assert_eq!(a.name(), b.name());
        let d = abs_sum(&(a.var().as_tensor() - b.var().as_tensor()).unwrap());
        assert_eq!(d, 0.0);
    }
    assert_eq!(all[1].num_parameters(), cfg.stage_param_count(1).unwrap());
    // Same outputs on the same input; and a different seed gives a different stage, so the
    // comparison above can fail.
    let x = random_like(&alone.input_dims(2, 5), 4, DType::F32);
    let a = all[1].forward_eval(&x, None).unwrap();
    let b = alone.forward_eval(&x, None).unwrap();
    assert_eq!(
        abs_sum(&(a.activations().unwrap() - b.activations().unwrap()).unwrap()),
        0.0
    );
    let mut other_cfg = cfg.clone();
    other_cfg.init_seed += 1;
    let other = Stage::new(&other_cfg, 1, StageOptions::cpu()).unwrap();
    let c = other.forward_eval(&x, None).unwrap();
    assert!(abs_sum(&(a.activations().unwrap() - c.activations().unwrap()).unwrap()) > 0.0);
}

/// All of a stage's (or a model's) accumulated gradients, flattened to f64.
fn all_grads(stages: &[Stage]) -> Vec<Vec<f64>> {
    stages
        .iter()
        .flat_map(|s| {
            (0..s.params().len()).map(move |i| {
                s.grad(i)
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
            })
        })
        .collect()
}

fn max_rel_grad_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let scale = y.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-300);
            x.iter()
                .zip(y)
                .fold(0f64, |m, (p, q)| m.max((p - q).abs() / scale))
        })
        .fold(0f64, f64::max)
}

/// A micro-batch cut into runs (evenly, unevenly, into more runs than it has sequences; with
/// and without per-block checkpointing) gives the whole micro-batch's loss, per-sequence losses
/// and gradients up to f64 rounding, staged and monolithic. A run's gradient scaled by its own
/// token count instead of the micro-batch's, or runs put back in another order, would not.
#[test]
fn sub_batches_give_the_whole_micro_batchs_gradients() {
    let cfg = ModelConfig::tiny().with_stages(vec![1, 2, 1]);
    let b = batch(12, 5);
    let mut whole = Pipeline::new(&cfg, &f64_opts()).unwrap();
    let lw = whole.forward_backward(&b.inputs, &b.targets).unwrap().loss;
    let gw = all_grads(whole.stages());
    let mut mono = Pipeline::new(&cfg, &f64_opts()).unwrap();
    mono.forward_backward_monolithic(&b.inputs, &b.targets)
        .unwrap();
    let gm = all_grads(mono.stages());
    let last = cfg.num_stages() - 1;
    let x = whole.stages()[..last]
        .iter()
        .fold(b.inputs.clone(), |x, s| s.run(&x).unwrap());
    let per_sequence = |s: &Stage| match s.forward(&x, Some(&b.targets)).unwrap().0 {
        StageOutput::Loss(l) => l.per_sequence,
        StageOutput::Activations(_) => panic!("the last stage gives a loss"),
    };
    let sequences = per_sequence(&whole.stages()[last]);
    for (parts, checkpoint_blocks) in [(2, false), (3, true), (8, false)] {
        let opts = StageOptions {
            sub_batches: parts,
            checkpoint_blocks,
            ..f64_opts()
        };
        let what = format!("{parts} runs, checkpointing {checkpoint_blocks}");
        let mut p = Pipeline::new(&cfg, &opts).unwrap();
        let l = p.forward_backward(&b.inputs, &b.targets).unwrap().loss;
        assert!(
            (l - lw).abs() <= 1e-6 * lw.abs(),
            "{what}: loss {l} vs {lw}"
        );
        let d = max_rel_grad_diff(&all_grads(p.stages()), &gw);
        assert!(d < 1e-9, "{what}: staged gradients differ by {d}");
        let cut = per_sequence(&p.stages()[last]);
        assert_eq!(cut.len(), sequences.len());
        for (c, w) in cut.iter().zip(&sequences) {
            assert!(
                (c - w).abs() <= 1e-6 * w.abs(),
                "{what}: {cut:?} vs {sequences:?}"
            );
        }
        let mut m = Pipeline::new(&cfg, &opts).unwrap();
        m.forward_backward_monolithic(&b.inputs, &b.targets)
            .unwrap();
        let d = max_rel_grad_diff(&all_grads(m.stages()), &gm);
        assert!(d < 1e-9, "{what}: monolithic gradients differ by {d}");
        // A middle stage alone, given the gradient of the micro-batch's mean loss: the input's
        // gradient it returns is the whole micro-batch's too (in a pipeline, a wrong scale of
        // it would cancel against the stage below's).
        let mut alone = [
            Stage::new(&cfg, 1, f64_opts()).unwrap(),
            Stage::new(&cfg, 1, opts.clone()).unwrap(),
        ];
        let x1 = whole.stages()[0].run(&b.inputs).unwrap();
        let g = random_like(&alone[0].output_dims(5, 12), 7, DType::F64);
        let inputs: Vec<Tensor> = alone
            .iter_mut()
            .map(|s| {
                let (_, cache) = s.forward(&x1, None).unwrap();
                s.backward(cache, Some(&g)).unwrap().unwrap()
            })
            .collect();
        let d = max_rel_diff(&inputs[1], &inputs[0]);
        assert!(d < 1e-9, "{what}: input gradients differ by {d}");
        let d = max_rel_grad_diff(&all_grads(&alone[1..]), &all_grads(&alone[..1]));
        assert!(d < 1e-9, "{what}: a stage's gradients differ by {d}");
        // The whole micro-batch is checked once, before it is cut: a non-finite value in any
        // run, and a last stage without targets, are refused.
        let mut bad = x1.to_vec3::<f64>().unwrap();
        bad[4][11][0] = f64::NAN;
        let bad = Tensor::new(bad, x1.device()).unwrap();
        assert!(alone[1].forward(&bad, None).is_err(), "{what}: NaN input");
        let last = Stage::new(&cfg, cfg.stages.len() - 1, opts).unwrap();
        let x_last = random_like(&last.input_dims(5, 12), 9, DType::F64);
        assert!(last.forward(&x_last, None).is_err(), "{what}: no targets");
    }
    let none = StageOptions {
        sub_batches: 0,
        ..StageOptions::cpu()
    };
    assert!(Stage::new(&cfg, 0, none).is_err());
}

/// The runs of a cut micro-batch add up to the same bits whatever the number of threads they
/// ran on: the cut and the order of the sums follow the options, never the thread pool.
#[test]
fn sub_batches_add_the_same_bits_on_any_thread_count() {
    let cfg = ModelConfig::tiny().with_stages(vec![1, 2, 1]);
    let b = batch(12, 4);
    let opts = StageOptions {
        sub_batches: 3,
        ..StageOptions::cpu()
    };
    let run = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| {
                let mut staged = Pipeline::new(&cfg, &opts).unwrap();
                staged.forward_backward(&b.inputs, &b.targets).unwrap();
                let mut mono = Pipeline::new(&cfg, &opts).unwrap();
                mono.forward_backward_monolithic(&b.inputs, &b.targets)
                    .unwrap();
                (all_grads(staged.stages()), all_grads(mono.stages()))
            })
    };
    let one = run(1);
    for threads in [2, 4] {
        assert!(run(threads) == one, "{threads} threads");
    }
}
