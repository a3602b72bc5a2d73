//! Compressed pseudo-gradients against dense ones at equal tokens: replicas of a small model
//! train DiLoCo-style (inner AdamW on their own samples, then the averaged pseudo-gradient
//! through the outer Nesterov step), once with dense fp32 pseudo-gradients and merges, and once
//! per sparse encoding (chunked top-k, int8 or int4, error feedback; the merge compressed
//! again). Every variant sees the same samples in the same order from the same initial weights;
//! held-out loss after every epoch, and the bytes of one pseudo-gradient (and of one merged
//! update) as encoded for the wire, against its fp32 size.
//!
//! Each variant runs once per seed (`BENCH_SEEDS`, default 3), each seed with its own initial
//! weights and samples shared by every variant, and the table gives the mean and each seed's
//! loss against that seed's dense run. On the grammar corpus by default; `BENCH_CORPUS=text` on
//! real English (Debian's python3-doc, or `IOTA_BENCH_CORPUS`) with a BPE tokenizer trained on
//! it (`BENCH_TEXT_VOCAB` tokens, default 2048) and 5% of its documents held out, prepared as a
//! run's data is.
//!
//! `cargo bench -p iota-model --bench sparse`. `BENCH_EPOCHS` (default 32), `BENCH_REPLICAS`,
//! `BENCH_INNER_STEPS`, `BENCH_VARIANTS` and `BENCH_FIRST_SEED` (default 0) change the run.
//! `BENCH_DENSE_PARAMS` (comma-separated parts of parameter names, e.g. `embed,head`) sends
//! the parameters it names as the exact fp32 average in top-k variants, to see what their
//! compression costs; their bytes are not counted.

use std::path::{Path, PathBuf};
use std::time::Instant;

mod support;

use iota_model::data::make_batch;
use iota_model::data::prepare::prepare_with_new_tokenizer;
use iota_model::data::{HELD_OUT_BASE, PreparedDataset};
use iota_model::merge::{flatten_params, load_flat_params};
use iota_model::sparse::{ErrorFeedback, SparseConfig, SparseVector, merge_sparse};
use iota_model::{
    AdamWConfig, Batch, Contribution, Dataset, Device, GrammarCorpus, LrSchedule, ModelConfig,
    OuterConfig, Pipeline, Result, StageOptions, Trainer, weighted_average,
};
use iota_protocol::tensor::{SparseShape, encode_partition, encode_sparse};

fn env_or(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Clone, Copy)]
enum Merge {
    Dense,
    /// `merged_k`: entries of a chunk the merged update keeps (0: the exact average).
    /// `take_back`: each replica takes back into its residual what the merge dropped of what
    /// it sent.
    /// `decay`: how much of its unsent remainder a replica still owes after an epoch.
    /// `bits`: of each kept value, 8 or 4.
    /// `warmup`: epochs before the `k`s hold, each keeping 4 times as many as the next.
    Sparse {
        chunk: usize,
        k: usize,
        merged_k: usize,
        take_back: bool,
        decay: f32,
        bits: u8,
        warmup: u64,
    },
    /// Every value's sign, times one scale per chunk of [`SIGN_CHUNK`] (the mean magnitude),
    /// with error feedback (1-bit compression); the merge rounds the average of the signs to
    /// `levels` steps either side of 0 in each chunk (0: the exact average).
    /// `take_back`: every replica takes back the merge's rounding error, which only an owner
    /// knows (it needs the exact average), so a miner could not do it alone.
    Sign {
        decay: f32,
        levels: u32,
        take_back: bool,
    },
}

/// Values per scale of a [`Merge::Sign`] variant.
const SIGN_CHUNK: usize = 4096;

/// Each value's sign times its chunk's mean magnitude: what a 1-bit upload decodes to.
fn signs(v: &[f32]) -> Vec<f32> {
    v.chunks(SIGN_CHUNK)
        .flat_map(|c| {
            let scale = c.iter().map(|x| x.abs()).sum::<f32>() / c.len() as f32;
            c.iter()
                .map(move |x| if *x >= 0.0 { scale } else { -scale })
        })
        .collect()
}

/// Each value rounded to a multiple of its chunk's peak magnitude / `levels`.
fn rounded(v: &[f32], levels: u32) -> Vec<f32> {
    v.chunks(SIGN_CHUNK)
        .flat_map(|c| {
            let step = c.iter().fold(0f32, |a, x| a.max(x.abs())) / levels as f32;
            c.iter().map(move |x| {
                if step > 0.0 {
                    (x / step).round_ties_even() * step
                } else {
                    0.0
                }
            })
        })
        .collect()
}

impl Merge {
    fn name(self) -> String {
        match self {
            Merge::Dense => "dense fp32".into(),
            Merge::Sparse {
                chunk,
                k,
                merged_k,
                take_back,
                decay,
                bits,
                warmup,
            } => {
                let feedback = if decay < 1.0 {
                    format!("error feedback decaying by {decay}")
                } else {
                    "error feedback".into()
                };
                let merged = match merged_k {
                    0 => "exact average".into(),
                    m => format!("merged top-{m}"),
                };
                let back = if take_back {
                    ", dropped mass taken back"
                } else {
                    ""
                };
                let warm = match warmup {
                    0 => String::new(),
                    w => format!(", 4x denser for each of the first {w} epochs left"),
                };
                format!("top-{k} of {chunk}, int{bits}, {feedback}; {merged}{back}{warm}")
            }
            Merge::Sign {
                decay,
                levels,
                take_back,
            } => {
                let merged = match levels {
                    0 => "exact average".into(),
                    l => format!("merge rounded to {} levels", 2 * l + 1),
                };
                let back = if take_back {
                    ", rounding taken back"
                } else {
                    ""
                };
                format!("signs of {SIGN_CHUNK}, error feedback decaying by {decay}; {merged}{back}")
            }
        }
    }
}

struct Setup {
    cfg: ModelConfig,
    corpus: Box<dyn Dataset>,
    eval: Vec<Batch>,
    replicas: u64,
    inner_steps: u64,
    epochs: u64,
    batch: u64,
    /// Parts of the names of parameters sent as the exact average (`BENCH_DENSE_PARAMS`).
    dense_params: Vec<String>,
}

/// Wire bytes of one encoded pseudo-gradient and one merged update, summed over the stages.
#[derive(Default)]
struct Bytes {
    contribution: usize,
    merged: usize,
    fp32: usize,
    /// Lowest cosine, over replicas, stages and epochs after the first, between what a replica
    /// sent and the pseudo-gradient it trained that epoch: what a validator's replay can compare
    /// without the replica's error-feedback residual.
    min_cosine: f64,
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (f64::from(*x), f64::from(*y));
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    ab / (aa.sqrt() * bb.sqrt()).max(f64::MIN_POSITIVE)
}

fn encoded(s: &SparseVector) -> usize {
    let shape = SparseShape {
        len: s.len as u64,
        chunk: s.config.chunk() as u32,
        k: s.config.k() as u32,
        bits: s.config.bits(),
    };
    encode_sparse(shape, &s.indices, &s.values, &s.scales).len()
}

/// Held-out windows every epoch's loss is measured on.
const EVAL_WINDOWS: u64 = 256;
/// The real-text tokenizer's vocabulary (`BENCH_TEXT_VOCAB`): small, so the embedding and
/// head do not dwarf the blocks whose pseudo-gradients are compressed.
const TEXT_VOCAB: u64 = 2048;

/// Training ids of one seed start this far from the next seed's.
const SEED_STRIDE: u64 = 1 << 32;

/// One variant's run with its own initial weights and samples.
fn run(
    setup: &Setup,
    (merge, outer): (Merge, OuterConfig),
    seed: u64,
) -> Result<(Vec<f64>, Bytes, f64)> {
    let t0 = Instant::now();
    let stages = setup.cfg.num_stages();
    let cfg = ModelConfig {
        init_seed: setup.cfg.init_seed + seed,
        ..setup.cfg.clone()
    };
    let init = Pipeline::new(&cfg, &StageOptions::cpu())?;
    let mut global: Vec<Vec<f32>> = init
        .stages()
        .iter()
        .map(flatten_params)
        .collect::<Result<_>>()?;
    let mut momentum: Vec<Vec<f32>> = global.iter().map(|g| vec![0.0; g.len()]).collect();
    let sparse = match merge {
        Merge::Dense | Merge::Sign { .. } => None,
        Merge::Sparse {
            chunk,
            k,
            merged_k,
            take_back,
            bits,
            warmup,
            ..
        } => Some((chunk, k, merged_k, take_back, bits, warmup)),
    };
    let decay = match merge {
        Merge::Sparse { decay, .. } | Merge::Sign { decay, .. } => decay,
        Merge::Dense => 1.0,
    };
    // Per stage, whether each value travels dense (`BENCH_DENSE_PARAMS`).
    let dense_only: Vec<Vec<bool>> = init
        .stages()
        .iter()
        .map(|stage| {
            stage
                .params()
                .iter()
                .flat_map(|p| {
                    let hit = setup.dense_params.iter().any(|d| p.name().contains(d));
                    std::iter::repeat_n(hit, p.var().elem_count())
                })
                .collect()
        })
        .collect();
    // A sign variant's unsent remainders, per replica and stage.
    let mut unsent: Vec<Vec<Vec<f32>>> = (0..setup.replicas)
        .map(|_| global.iter().map(|g| vec![0.0; g.len()]).collect())
        .collect();
    let mut feedback: Vec<Vec<ErrorFeedback>> = (0..setup.replicas)
        .map(|_| {
            global
                .iter()
                .map(|g| ErrorFeedback::with_decay(g.len(), decay))
                .collect()
        })
        .collect::<Result<_>>()?;
    let eval = |global: &[Vec<f32>]| -> Result<f64> {
        let p = Pipeline::new(&setup.cfg, &StageOptions::cpu())?;
        for (s, w) in p.stages().iter().zip(global) {
            load_flat_params(s, w)?;
        }
        let t = Trainer::new(p, AdamWConfig::default(), LrSchedule::constant())?;
        Ok(f64::from(t.eval(&setup.eval)?))
    };
    let mut losses = vec![eval(&global)?];
    let mut bytes = Bytes {
        min_cosine: 1.0,
        ..Bytes::default()
    };
    for epoch in 0..setup.epochs {
        let mut pseudo: Vec<Vec<Vec<f32>>> = Vec::new();
        for r in 0..setup.replicas {
            let p = Pipeline::new(&setup.cfg, &StageOptions::cpu())?;
            for (s, w) in p.stages().iter().zip(&global) {
                load_flat_params(s, w)?;
            }
            let adamw = AdamWConfig {
                lr: 2e-3,
                weight_decay: 0.0,
                ..AdamWConfig::default()
            };
            let mut t = Trainer::new(p, adamw, LrSchedule::constant())?;
            for step in 0..setup.inner_steps {
                let first = seed * SEED_STRIDE
                    + ((epoch * setup.replicas + r) * setup.inner_steps + step) * setup.batch;
                let ids: Vec<u64> = (first..first + setup.batch).collect();
                t.step(&[make_batch(setup.corpus.as_ref(), &ids, &Device::Cpu)?])?;
            }
            let mut per_stage = Vec::with_capacity(stages);
            for (s, start) in t.pipeline().stages().iter().zip(&global) {
                let cur = flatten_params(s)?;
                per_stage.push(start.iter().zip(&cur).map(|(a, b)| a - b).collect());
            }
            pseudo.push(per_stage);
        }
        for s in 0..stages {
            let update = match (merge, sparse) {
                (
                    Merge::Sign {
                        levels, take_back, ..
                    },
                    _,
                ) => {
                    let n = global[s].len();
                    let mut sum = vec![0f32; n];
                    for (p, owed) in pseudo.iter().zip(unsent.iter_mut()) {
                        let total: Vec<f32> = owed[s]
                            .iter()
                            .zip(&p[s])
                            .map(|(r, d)| decay * r + d)
                            .collect();
                        let sent = signs(&total);
                        for (((r, t), x), m) in
                            owed[s].iter_mut().zip(&total).zip(&sent).zip(&mut sum)
                        {
                            *r = t - x;
                            *m += x;
                        }
                    }
                    let mean: Vec<f32> = sum.iter().map(|v| v / setup.replicas as f32).collect();
                    let merged = match levels {
                        0 => mean.clone(),
                        l => rounded(&mean, l),
                    };
                    if take_back {
                        for owed in unsent.iter_mut() {
                            for ((r, m), x) in owed[s].iter_mut().zip(&mean).zip(&merged) {
                                *r += m - x;
                            }
                        }
                    }
                    if epoch == 0 {
                        let scales = 4 * n.div_ceil(SIGN_CHUNK);
                        bytes.contribution += n.div_ceil(8) + scales;
                        // Values of 2·levels + 1 steps in whole bits; fp32 when exact.
                        bytes.merged += match levels {
                            0 => 4 * n,
                            l => {
                                (n * (2 * l + 1).next_power_of_two().ilog2() as usize).div_ceil(8)
                                    + scales
                            }
                        };
                    }
                    merged
                }
                (_, None) => {
                    let parts: Vec<Contribution<'_>> = pseudo
                        .iter()
                        .map(|p| Contribution {
                            weight: 1.0,
                            values: &p[s],
                        })
                        .collect();
                    if epoch == 0 {
                        bytes.contribution += encode_partition(&pseudo[0][s]).len();
                        bytes.merged += encode_partition(&pseudo[0][s]).len();
                    }
                    weighted_average(&parts, 2)?.values
                }
                (_, Some((chunk, k, merged_k, take_back, bits, warmup))) => {
                    let boost = 4usize.pow(warmup.saturating_sub(epoch).min(8) as u32);
                    // Bytes are measured in the first epoch after the warm-up (the run's own
                    // k), or in the last epoch of a run no longer than the warm-up.
                    let measured = epoch == warmup.min(setup.epochs.saturating_sub(1));
                    let c = SparseConfig::new(chunk, (k * boost).min(chunk))?.with_bits(bits)?;
                    let merged_k = match merged_k {
                        0 => 0,
                        m => (m * boost).min(chunk),
                    };
                    // What `BENCH_DENSE_PARAMS` names is sent apart as the exact average.
                    let exact = &dense_only[s];
                    let compressed: Vec<Vec<f32>> = pseudo
                        .iter()
                        .map(|p| {
                            p[s].iter()
                                .zip(exact)
                                .map(|(v, e)| if *e { 0.0 } else { *v })
                                .collect()
                        })
                        .collect();
                    let sent: Vec<SparseVector> = compressed
                        .iter()
                        .zip(feedback.iter_mut())
                        .map(|(p, ef)| ef[s].compress(0..p.len(), p, c))
                        .collect::<Result<_>>()?;
                    let contribs: Vec<(f64, &SparseVector)> =
                        sent.iter().map(|v| (1.0, v)).collect();
                    if epoch > 0 {
                        for (v, p) in sent.iter().zip(&pseudo) {
                            let c = cosine(&v.decompress()?, &p[s]);
                            bytes.min_cosine = bytes.min_cosine.min(c);
                        }
                    }
                    if measured {
                        bytes.contribution += encoded(&sent[0]);
                    }
                    let mut update = if merged_k == 0 {
                        let dense: Vec<Vec<f32>> =
                            sent.iter().map(|v| v.decompress()).collect::<Result<_>>()?;
                        let parts: Vec<Contribution<'_>> = dense
                            .iter()
                            .map(|values| Contribution {
                                weight: 1.0,
                                values,
                            })
                            .collect();
                        weighted_average(&parts, 2)?.values
                    } else {
                        let out = SparseConfig::new(chunk, merged_k)?.with_bits(c.bits())?;
                        let merged = merge_sparse(&contribs, out, 2)?;
                        if measured {
                            bytes.merged += encoded(&merged);
                        }
                        if take_back {
                            for (ef, v) in feedback.iter_mut().zip(&sent) {
                                ef[s].take_back(0..v.len, v, Some(&merged))?;
                            }
                        }
                        merged.decompress()?
                    };
                    for (j, _) in exact.iter().enumerate().filter(|(_, e)| **e) {
                        let sum: f32 = pseudo.iter().map(|p| p[s][j]).sum();
                        update[j] = sum / pseudo.len() as f32;
                    }
                    update
                }
            };
            if epoch == 0 {
                bytes.fp32 += 4 * update.len();
            }
            outer.apply(&mut global[s], &mut momentum[s], &update)?;
        }
        losses.push(eval(&global)?);
        eprintln!(
            "{} ({}, {}), seed {seed}: epoch {} loss {:.4} ({:.0}s)",
            merge.name(),
            outer.lr,
            outer.momentum,
            epoch + 1,
            losses[losses.len() - 1],
            t0.elapsed().as_secs_f64()
        );
    }
    Ok((losses, bytes, t0.elapsed().as_secs_f64()))
}

/// `loss` against a dense run's, or a dash when no dense variant ran.
fn versus(loss: f64, dense: f64) -> String {
    if dense.is_finite() {
        format!("{:+.2}%", 100.0 * (loss - dense) / dense)
    } else {
        "—".to_string()
    }
}

/// Debian's copy of the Python documentation's sources, the benches' real English.
const DEBIAN_CORPUS: &str = "/usr/share/doc/python3-doc/html/_sources";

/// The real-text corpus: `IOTA_BENCH_CORPUS` (or Debian's python3-doc) with a BPE tokenizer
/// of `vocab` tokens trained on it, prepared as a run's data is, 5% of documents held out.
/// Returns the dataset and the held-out sample ids.
fn text_corpus(tmp: &Path, vocab: usize, seq: usize) -> Result<(Box<dyn Dataset>, u64)> {
    let corpus = std::env::var_os("IOTA_BENCH_CORPUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEBIAN_CORPUS));
    if !corpus.is_dir() {
        support::fail(
            &corpus.display().to_string(),
            "no corpus (apt-get install python3-doc, or set IOTA_BENCH_CORPUS)",
        );
    }
    let (out, _) = prepare_with_new_tokenizer(&corpus, vocab, tmp, 50_000)?;
    let ds = PreparedDataset::open(&out, None, seq, 0)?;
    let held_out = ds.held_out_count();
    Ok((Box::new(ds), held_out))
}

fn main() -> Result<()> {
    let (batch, seq) = (8u64, 64usize);
    let text = match std::env::var("BENCH_CORPUS").as_deref() {
        Ok("text") => true,
        Ok("grammar") | Err(_) => false,
        Ok(other) => support::fail("BENCH_CORPUS", format!("{other}: not grammar or text")),
    };
    let tmp = std::env::temp_dir().join(format!("iota-bench-sparse-{}", std::process::id()));
    let (corpus, eval_ids, corpus_name): (Box<dyn Dataset>, Vec<u64>, String) = if text {
        std::fs::create_dir_all(&tmp)
            .unwrap_or_else(|e| support::fail(&tmp.display().to_string(), e));
        let vocab = env_or("BENCH_TEXT_VOCAB", TEXT_VOCAB) as usize;
        let (ds, held_out) = text_corpus(&tmp, vocab, seq)?;
        if held_out < EVAL_WINDOWS {
            support::fail(
                "corpus",
                format!("{held_out} held-out windows, fewer than {EVAL_WINDOWS}"),
            );
        }
        let name = format!("real English (python3-doc, BPE vocab {vocab})");
        (
            ds,
            (HELD_OUT_BASE..HELD_OUT_BASE + EVAL_WINDOWS).collect(),
            name,
        )
    } else {
        let ds = GrammarCorpus::new(0, seq)?;
        (
            Box::new(ds),
            (10_000_000..10_000_000 + EVAL_WINDOWS).collect(),
            "grammar corpus".into(),
        )
    };
    let cfg = support::three_small_stages("bench-sparse", corpus.vocab_size(), seq);
    let eval = eval_ids
        .chunks(batch as usize)
        .map(|c| make_batch(corpus.as_ref(), c, &Device::Cpu))
        .collect::<Result<_>>()?;
    let setup = Setup {
        cfg,
        corpus,
        eval,
        replicas: env_or("BENCH_REPLICAS", 4),
        inner_steps: env_or("BENCH_INNER_STEPS", 8),
        epochs: env_or("BENCH_EPOCHS", 32),
        batch,
        dense_params: std::env::var("BENCH_DENSE_PARAMS")
            .unwrap_or_default()
            .split(',')
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect(),
    };
    let seeds = env_or("BENCH_SEEDS", 3).max(1);
    let first_seed = env_or("BENCH_FIRST_SEED", 0);
    // `BENCH_VARIANTS=dense,4096:128:128+fb@1/0,…`: chunk:k:merged k (0 for the exact
    // average), optionally :the error feedback's decay (1 when absent), :the values' bits (8
    // when absent) and :warm-up epochs (0 when absent), `+fb` to take back
    // what the merge dropped, then the outer lr and momentum after `@` (0.7/0.9 when absent).
    // `sign:decay:levels` (`+fb` to take back the merge's rounding) is a 1-bit variant.
    let variants: Vec<(Merge, OuterConfig)> = std::env::var("BENCH_VARIANTS")
        .unwrap_or_else(|_| "dense@1/0,4096:128:512+fb@1/0,4096:128:512:0.95+fb@1/0".into())
        .split(',')
        .map(|v| {
            let (merge, outer) = v.split_once('@').unwrap_or((v, "0.7/0.9"));
            let n: Vec<&str> = merge.trim_end_matches("+fb").split(':').collect();
            let o: Vec<f32> = outer.split('/').filter_map(|x| x.parse().ok()).collect();
            let num = |i: usize| -> usize {
                n[i].parse()
                    .unwrap_or_else(|e| support::fail(&format!("variant {v}"), e))
            };
            let merge = match n.len() {
                3 if n[0] == "sign" => Merge::Sign {
                    decay: n[1]
                        .parse()
                        .unwrap_or_else(|e| support::fail(&format!("variant {v}"), e)),
                    levels: num(2) as u32,
                    take_back: merge.ends_with("+fb"),
                },
                3..=6 => Merge::Sparse {
                    chunk: num(0),
                    k: num(1),
                    merged_k: num(2),
                    take_back: merge.ends_with("+fb"),
                    decay: n.get(3).map_or(1.0, |d| {
                        d.parse()
                            .unwrap_or_else(|e| support::fail(&format!("variant {v}"), e))
                    }),
                    bits: n.get(4).map_or(8, |b| {
                        b.parse()
                            .unwrap_or_else(|e| support::fail(&format!("variant {v}"), e))
                    }),
                    warmup: n.get(5).map_or(0, |w| {
                        w.parse()
                            .unwrap_or_else(|e| support::fail(&format!("variant {v}"), e))
                    }),
                },
                _ => Merge::Dense,
            };
            let outer = OuterConfig {
                lr: o.first().copied().unwrap_or(0.7),
                momentum: o.get(1).copied().unwrap_or(0.9),
                nesterov: true,
            };
            (merge, outer)
        })
        .collect();
    let mut results = Vec::new();
    for v in variants {
        let runs = (0..seeds)
            .map(|seed| run(&setup, v.clone(), first_seed + seed))
            .collect::<Result<Vec<_>>>()?;
        results.push((v, runs));
    }
    if text {
        std::fs::remove_dir_all(&tmp).ok();
    }
    let epochs = setup.epochs as usize;
    let mean = |runs: &[(Vec<f64>, Bytes, f64)], e: usize| -> f64 {
        runs.iter().map(|(l, _, _)| l[e]).sum::<f64>() / runs.len() as f64
    };
    let tokens = setup.replicas * setup.inner_steps * setup.batch * seq as u64;
    println!(
        "## Compressed pseudo-gradients: d=256, stages [1, 1, 1], {corpus_name}; {} replicas x {} inner AdamW steps (lr 2e-3, moments reset each epoch) of {batch}x{seq} tokens per epoch ({tokens} tokens an epoch), outer Nesterov step; held-out loss on {EVAL_WINDOWS} windows{}",
        setup.replicas,
        setup.inner_steps,
        if seeds > 1 {
            format!(", mean of {seeds} seeds (each its own initial weights and samples)")
        } else {
            String::new()
        }
    );
    println!();
    println!(
        "| pseudo-gradient | outer lr, momentum | contribution vs fp32 | merged update vs fp32 | lowest cosine, sent vs trained | loss after {epochs} epochs | vs best dense |{} time |",
        if seeds > 1 {
            " each seed (vs its best dense) |"
        } else {
            ""
        }
    );
    println!(
        "|---|---|---:|---:|---:|---:|---:|{}---:|",
        if seeds > 1 { "---|" } else { "" }
    );
    // Against the best dense run, so that a compressed run is never flattered by a dense one
    // with worse outer settings.
    let dense_loss = results
        .iter()
        .filter(|((m, _), _)| matches!(m, Merge::Dense))
        .map(|(_, runs)| mean(runs, epochs))
        .fold(f64::INFINITY, f64::min);
    let dense_by_seed: Vec<f64> = (0..seeds as usize)
        .map(|seed| {
            results
                .iter()
                .filter(|((m, _), _)| matches!(m, Merge::Dense))
                .map(|(_, runs)| runs[seed].0[epochs])
                .fold(f64::INFINITY, f64::min)
        })
        .collect();
    for ((m, outer), runs) in &results {
        let loss = mean(runs, epochs);
        let b = &runs[0].1;
        let min_cosine = runs
            .iter()
            .map(|(_, b, _)| b.min_cosine)
            .fold(1.0, f64::min);
        let secs: f64 = runs.iter().map(|(_, _, s)| s).sum();
        let each = runs
            .iter()
            .zip(&dense_by_seed)
            .map(|((l, _, _), d)| format!("{:.4} ({})", l[epochs], versus(l[epochs], *d)))
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "| {} | {}, {} | {:.4}x | {} | {min_cosine:.3} | {loss:.4} | {} |{} {secs:.0}s |",
            m.name(),
            outer.lr,
            outer.momentum,
            b.contribution as f64 / b.fp32 as f64,
            // The exact average is not sent anywhere: it only shows what re-compression costs.
            match b.merged {
                0 => "not sent".to_string(),
                n => format!("{:.4}x", n as f64 / b.fp32 as f64),
            },
            versus(loss, dense_loss),
            if seeds > 1 {
                format!(" {each} |")
            } else {
                String::new()
            }
        );
    }
    println!();
    println!(
        "Held-out loss after each epoch{}:",
        if seeds > 1 {
            " (mean of the seeds)"
        } else {
            ""
        }
    );
    println!();
    print!("| epoch |");
    for ((m, outer), _) in &results {
        print!(" {} ({}, {}) |", m.name(), outer.lr, outer.momentum);
    }
    println!();
    println!("|---:|{}", "---:|".repeat(results.len()));
    for e in 0..=epochs {
        print!("| {e} |");
        for (_, runs) in &results {
            print!(" {:.4} |", mean(runs, e));
        }
        println!();
    }
    Ok(())
}
