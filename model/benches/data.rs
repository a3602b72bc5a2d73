//! Data benchmarks: `data prepare` tokens/s and peak memory on a corpus over 100 MB, and the
//! prepared-dataset loader's windows/s against what a miner consumes.
//!
//! The corpus is real English: the Python documentation's sources as Debian's `python3-doc`
//! ships them (`IOTA_BENCH_CORPUS` for another folder of `.txt` files), written as JSON lines and
//! repeated until it passes 100 MB. Preparation runs in a child process, so its peak resident
//! memory is its own. `cargo bench -p iota-model --bench data` (or `scripts/bench.sh data`).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use iota_model::data::prepare::{PrepareOptions, prepare};
use iota_model::data::{Dataset, PreparedDataset};
use iota_model::{Device, ModelConfig, Stage, StageOptions, make_batch, train_bpe_tokenizer};

mod support;
use support::{fail, load_average, peak_rss_bytes};

const DEBIAN_CORPUS: &str = "/usr/share/doc/python3-doc/html/_sources";
const CHILD: &str = "IOTA_BENCH_DATA_CHILD";
const MIN_BYTES: u64 = 100 << 20;
const SEQ: usize = 128;
const MICRO_BATCH: usize = 4;

/// The child: prepares `input` with `tokenizer` into `out` and prints what it measured.
fn child(spec: &str) {
    let parts: Vec<&str> = spec.split('|').collect();
    let [input, tokenizer, out] = parts[..] else {
        fail("child spec", spec)
    };
    let started = Instant::now();
    let (m, _) = prepare(
        &[PathBuf::from(input)],
        Path::new(tokenizer),
        Path::new(out),
        &PrepareOptions::default(),
        &mut |_| {},
    )
    .unwrap_or_else(|e| fail("prepare", e));
    let secs = started.elapsed().as_secs_f64();
    println!(
        "PREPARED {} {secs} {} {}",
        m.total_tokens(),
        peak_rss_bytes(),
        m.train.documents + m.held_out.documents
    );
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec);
        return;
    }
    let corpus = std::env::var_os("IOTA_BENCH_CORPUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEBIAN_CORPUS));
    if !corpus.is_dir() {
        fail(
            &corpus.display().to_string(),
            "no corpus (apt-get install python3-doc, or set IOTA_BENCH_CORPUS)",
        );
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "load average before: {}; {threads} threads available",
        load_average()
    );
    let files = iota_model::data::sources::list_inputs(std::slice::from_ref(&corpus))
        .unwrap_or_else(|e| fail("corpus", e));
    let docs: Vec<String> = files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap_or_else(|e| fail(&f.display().to_string(), e)))
        .collect();
    let one: u64 = docs.iter().map(|d| d.len() as u64).sum();
    let tmp = std::env::temp_dir().join(format!("iota-bench-data-{}", std::process::id()));
    std::fs::remove_dir_all(&tmp).ok();
    std::fs::create_dir_all(&tmp).unwrap_or_else(|e| fail("tmp", e));

    let tok = tmp.join("tokenizer.json");
    let t = Instant::now();
    let vocab = train_bpe_tokenizer(&files, 8192, &tok).unwrap_or_else(|e| fail("tokenizer", e));
    println!(
        "corpus: {} ({} documents, {:.1} MB); BPE tokenizer of {vocab} tokens trained in {:.1} s",
        corpus.display(),
        docs.len(),
        one as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );

    // Repeated until past 100 MB, as one JSON-lines file.
    let copies = MIN_BYTES.div_ceil(one.max(1));
    let big = tmp.join("corpus.jsonl");
    {
        let f = std::fs::File::create(&big).unwrap_or_else(|e| fail("corpus", e));
        let mut w = std::io::BufWriter::new(f);
        for _ in 0..copies {
            for d in &docs {
                let line = serde_json::json!({ "text": d }).to_string();
                writeln!(w, "{line}").unwrap_or_else(|e| fail("corpus", e));
            }
        }
        w.flush().unwrap_or_else(|e| fail("corpus", e));
    }
    let bytes = std::fs::metadata(&big).map_or(0, |m| m.len());

    // `data prepare` in a child process, so that its peak resident memory is its own.
    let out = tmp.join("prepared");
    let exe = std::env::current_exe().unwrap_or_else(|e| fail("current exe", e));
    let res = std::process::Command::new(exe)
        .env(
            CHILD,
            format!("{}|{}|{}", big.display(), tok.display(), out.display()),
        )
        .output()
        .unwrap_or_else(|e| fail("child", e));
    if !res.status.success() {
        fail("child", String::from_utf8_lossy(&res.stderr));
    }
    let stdout = String::from_utf8_lossy(&res.stdout);
    let fields: Vec<f64> = stdout
        .lines()
        .find_map(|l| l.strip_prefix("PREPARED "))
        .unwrap_or_else(|| fail("child output", &stdout))
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    let [tokens, secs, rss, ndocs] = fields[..] else {
        fail("child output", &stdout)
    };
    println!();
    println!(
        "## data prepare: {:.1} MB of JSON lines ({copies} copies of the corpus, {ndocs} documents), tokenizer of {vocab} tokens, default options",
        bytes as f64 / 1e6
    );
    println!();
    println!("| tokens | seconds | tokens/s | MB/s | peak resident memory |");
    println!("|---|---|---|---|---|");
    println!(
        "| {tokens:.0} | {secs:.1} | {:.0} | {:.1} | {:.0} MB |",
        tokens / secs,
        bytes as f64 / 1e6 / secs,
        rss / 1e6
    );

    // The loader: make_batch of micro-batches through the permutation, after the shards' hash
    // check (timed apart: it runs once per process).
    let t = Instant::now();
    let ds = PreparedDataset::open(&out, None, SEQ, 0).unwrap_or_else(|e| fail("open", e));
    ds.verify_all().unwrap_or_else(|e| fail("verify", e));
    let verify_s = t.elapsed().as_secs_f64();
    let n = ds.train_windows();
    let samples = 20_000u64;
    let t = Instant::now();
    for s in 0..samples {
        let ids: Vec<u64> = (0..MICRO_BATCH as u64)
            .map(|i| (s * 7919 + i) % n)
            .collect();
        make_batch(&ds, &ids, &Device::Cpu).unwrap_or_else(|e| fail("batch", e));
    }
    let loader_windows_s = (samples * MICRO_BATCH as u64) as f64 / t.elapsed().as_secs_f64();

    // What a miner consumes: stage 0 of `small` at this vocabulary, forward and backward of one
    // micro-batch (the stage that reads the data; the loader serves every stage-0 miner's
    // samples and the last stage's targets).
    let mut cfg = ModelConfig::small();
    cfg.vocab_size = ds.vocab_size().max(cfg.vocab_size);
    let mut stage = Stage::new(&cfg, 0, StageOptions::cpu()).unwrap_or_else(|e| fail("stage", e));
    let batch = make_batch(&ds, &[0, 1, 2, 3], &Device::Cpu).unwrap_or_else(|e| fail("batch", e));
    let grad = iota_model::Tensor::ones(
        stage.output_dims(MICRO_BATCH, SEQ),
        iota_model::DType::F32,
        &Device::Cpu,
    )
    .unwrap_or_else(|e| fail("grad", e));
    let mut run = |k: usize| {
        for _ in 0..k {
            let (_, cache) = stage
                .forward(&batch.inputs, None)
                .unwrap_or_else(|e| fail("forward", e));
            stage
                .backward(cache, Some(&grad))
                .unwrap_or_else(|e| fail("backward", e));
        }
    };
    run(1);
    let iters = 5;
    let t = Instant::now();
    run(iters);
    let stage_windows_s = (iters * MICRO_BATCH) as f64 / t.elapsed().as_secs_f64();
    println!();
    println!(
        "## loader: windows of {} tokens, micro-batches of {MICRO_BATCH}, one thread",
        SEQ + 1
    );
    println!();
    println!("| what | windows/s |");
    println!("|---|---|");
    println!(
        "| `make_batch` through the permutation ({samples} micro-batches over {n} training windows) | {loader_windows_s:.0} |"
    );
    println!(
        "| stage 0 of `small` (vocab {}), forward + backward on the CPU | {stage_windows_s:.1} |",
        cfg.vocab_size
    );
    println!();
    println!(
        "The loader serves {:.0}x what a CPU stage-0 miner consumes; checking every shard's \
         BLAKE3 once per process took {verify_s:.2} s.",
        loader_windows_s / stage_windows_s
    );
    println!("load average after: {}", load_average());
    std::fs::remove_dir_all(&tmp).ok();
}
