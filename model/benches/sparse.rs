//! Compressed pseudo-gradients against dense ones at equal tokens: replicas of a small model
//! train DiLoCo-style (inner AdamW on their own samples, then the averaged pseudo-gradient
//! through the outer Nesterov step), once with dense fp32 pseudo-gradients and merges, and once
//! per sparse encoding (chunked top-k, int8, error feedback; the merge compressed again). Every
//! variant sees the same samples in the same order from the same initial weights; held-out loss
//! after every epoch, and the bytes of one pseudo-gradient (and of one merged update) as
//! encoded for the wire, against its fp32 size.
//!
//! `cargo bench -p iota-model --bench sparse`. `BENCH_EPOCHS`, `BENCH_REPLICAS` and
//! `BENCH_INNER_STEPS` change the run.

use std::time::Instant;

mod support;

use iota_model::data::make_batch;
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
    Sparse {
        chunk: usize,
        k: usize,
        merged_k: usize,
        take_back: bool,
    },
}

impl Merge {
    fn name(self) -> String {
        match self {
            Merge::Dense => "dense fp32".into(),
            Merge::Sparse {
                chunk,
                k,
                merged_k: 0,
                ..
            } => format!("top-{k} of {chunk}, int8, error feedback; exact average"),
            Merge::Sparse {
                chunk,
                k,
                merged_k,
                take_back,
            } => format!(
                "top-{k} of {chunk}, int8, error feedback; merged top-{merged_k}{}",
                if take_back {
                    ", dropped mass taken back"
                } else {
                    ""
                }
            ),
        }
    }
}

struct Setup {
    cfg: ModelConfig,
    corpus: GrammarCorpus,
    eval: Vec<Batch>,
    replicas: u64,
    inner_steps: u64,
    epochs: u64,
    batch: u64,
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
    };
    encode_sparse(shape, &s.indices, &s.values, &s.scales).len()
}

fn run(setup: &Setup, (merge, outer): (Merge, OuterConfig)) -> Result<(Vec<f64>, Bytes, f64)> {
    let t0 = Instant::now();
    let stages = setup.cfg.num_stages();
    let init = Pipeline::new(&setup.cfg, &StageOptions::cpu())?;
    let mut global: Vec<Vec<f32>> = init
        .stages()
        .iter()
        .map(flatten_params)
        .collect::<Result<_>>()?;
    let mut momentum: Vec<Vec<f32>> = global.iter().map(|g| vec![0.0; g.len()]).collect();
    let sparse = match merge {
        Merge::Dense => None,
        Merge::Sparse {
            chunk,
            k,
            merged_k,
            take_back,
        } => Some((SparseConfig::new(chunk, k)?, chunk, merged_k, take_back)),
    };
    let mut feedback: Vec<Vec<ErrorFeedback>> = (0..setup.replicas)
        .map(|_| global.iter().map(|g| ErrorFeedback::new(g.len())).collect())
        .collect();
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
                let first = ((epoch * setup.replicas + r) * setup.inner_steps + step) * setup.batch;
                let ids: Vec<u64> = (first..first + setup.batch).collect();
                t.step(&[make_batch(&setup.corpus, &ids, &Device::Cpu)?])?;
            }
            let mut per_stage = Vec::with_capacity(stages);
            for (s, start) in t.pipeline().stages().iter().zip(&global) {
                let cur = flatten_params(s)?;
                per_stage.push(start.iter().zip(&cur).map(|(a, b)| a - b).collect());
            }
            pseudo.push(per_stage);
        }
        for s in 0..stages {
            let update = match sparse {
                None => {
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
                Some((c, chunk, merged_k, take_back)) => {
                    let sent: Vec<SparseVector> = pseudo
                        .iter()
                        .zip(feedback.iter_mut())
                        .map(|(p, ef)| ef[s].compress(0..p[s].len(), &p[s], c))
                        .collect::<Result<_>>()?;
                    let contribs: Vec<(f64, &SparseVector)> =
                        sent.iter().map(|v| (1.0, v)).collect();
                    if epoch > 0 {
                        for (v, p) in sent.iter().zip(&pseudo) {
                            let c = cosine(&v.decompress()?, &p[s]);
                            bytes.min_cosine = bytes.min_cosine.min(c);
                        }
                    }
                    if epoch == 0 {
                        bytes.contribution += encoded(&sent[0]);
                    }
                    if merged_k == 0 {
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
                        let out = SparseConfig::new(chunk, merged_k)?;
                        let merged = merge_sparse(&contribs, out, 2)?;
                        if epoch == 0 {
                            bytes.merged += encoded(&merged);
                        }
                        if take_back {
                            for (ef, v) in feedback.iter_mut().zip(&sent) {
                                ef[s].take_back(0..v.len, v, Some(&merged))?;
                            }
                        }
                        merged.decompress()?
                    }
                }
            };
            if epoch == 0 {
                bytes.fp32 += 4 * update.len();
            }
            outer.apply(&mut global[s], &mut momentum[s], &update)?;
        }
        losses.push(eval(&global)?);
        eprintln!(
            "{} ({}, {}): epoch {} loss {:.4} ({:.0}s)",
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

fn main() -> Result<()> {
    let (batch, seq) = (8u64, 64usize);
    let corpus = GrammarCorpus::new(0, seq)?;
    let cfg = support::three_small_stages("bench-sparse", corpus.vocab_size(), seq);
    let eval_ids: Vec<u64> = (10_000_000..10_000_000 + 256).collect();
    let eval = eval_ids
        .chunks(batch as usize)
        .map(|c| make_batch(&corpus, c, &Device::Cpu))
        .collect::<Result<_>>()?;
    let setup = Setup {
        cfg,
        corpus,
        eval,
        replicas: env_or("BENCH_REPLICAS", 4),
        inner_steps: env_or("BENCH_INNER_STEPS", 8),
        epochs: env_or("BENCH_EPOCHS", 16),
        batch,
    };
    // `BENCH_VARIANTS=dense,4096:128:128+fb@1/0,…`: chunk:k:merged k (0 for the exact
    // average), `+fb` to take back what the merge dropped, then the outer lr and momentum
    // after `@` (0.7/0.9 when absent).
    let variants: Vec<(Merge, OuterConfig)> = std::env::var("BENCH_VARIANTS")
        .unwrap_or_else(|_| {
            "dense,dense@1/0,4096:128:0@1/0,4096:128:128+fb@1/0,4096:128:512+fb@1/0,4096:256:0@1/0,4096:256:1024+fb@1/0".into()
        })
        .split(',')
        .map(|v| {
            let (merge, outer) = v.split_once('@').unwrap_or((v, "0.7/0.9"));
            let n: Vec<usize> = merge
                .trim_end_matches("+fb")
                .split(':')
                .filter_map(|x| x.parse().ok())
                .collect();
            let o: Vec<f32> = outer.split('/').filter_map(|x| x.parse().ok()).collect();
            let merge = match n[..] {
                [chunk, k, merged_k] => Merge::Sparse {
                    chunk,
                    k,
                    merged_k,
                    take_back: merge.ends_with("+fb"),
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
        results.push((v.clone(), run(&setup, v)?));
    }
    let tokens = setup.replicas * setup.inner_steps * setup.batch * seq as u64;
    println!(
        "## Compressed pseudo-gradients: d=256, stages [1, 1, 1], grammar corpus; {} replicas x {} inner AdamW steps (lr 2e-3, moments reset each epoch) of {batch}x{seq} tokens per epoch ({tokens} tokens an epoch), outer Nesterov step; held-out loss on 256 windows",
        setup.replicas, setup.inner_steps
    );
    println!();
    println!(
        "| pseudo-gradient | outer lr, momentum | contribution vs fp32 | merged update vs fp32 | lowest cosine, sent vs trained | loss after {} epochs | vs best dense | time |",
        setup.epochs
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    // Against the best dense run, so that a compressed run is never flattered by a dense one
    // with worse outer settings.
    let dense_loss = results
        .iter()
        .filter(|((m, _), _)| matches!(m, Merge::Dense))
        .map(|(_, (losses, _, _))| losses[setup.epochs as usize])
        .fold(f64::INFINITY, f64::min);
    for ((m, outer), (losses, b, secs)) in &results {
        let loss = losses[setup.epochs as usize];
        println!(
            "| {} | {}, {} | {:.4}x | {} | {:.3} | {loss:.4} | {:+.2}% | {secs:.0}s |",
            m.name(),
            outer.lr,
            outer.momentum,
            b.contribution as f64 / b.fp32 as f64,
            // The exact average is not sent anywhere: it only shows what re-compression costs.
            match b.merged {
                0 => "not sent".to_string(),
                n => format!("{:.4}x", n as f64 / b.fp32 as f64),
            },
            b.min_cosine,
            100.0 * (loss - dense_loss) / dense_loss
        );
    }
    println!();
    println!("Held-out loss after each epoch:");
    println!();
    print!("| epoch |");
    for ((m, outer), _) in &results {
        print!(" {} ({}, {}) |", m.name(), outer.lr, outer.momentum);
    }
    println!();
    println!("|---:|{}", "---:|".repeat(results.len()));
    for e in 0..=setup.epochs as usize {
        print!("| {e} |");
        for (_, (losses, _, _)) in &results {
            print!(" {:.4} |", losses[e]);
        }
        println!();
    }
    Ok(())
}
