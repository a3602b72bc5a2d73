//! candle forward+backward tokens/s for one model, one micro-batch shape, f32 on the CPU: the
//! candle half of `scripts/bench-cpu-vs-torch.sh` (which runs PyTorch on the same shapes).
//!
//! ```text
//! CANDLE_NUM_THREADS=2 cargo run --release -p iota-model --example speed -- small 4 128 5 [staged|sub-batched:N]
//! ```
//!
//! Prints `tokens_per_s=<median over the timed iterations, after one warm-up>` on stdout, and on
//! stderr the tokens per CPU-second of the whole process over the timed iterations (from
//! `/proc/self/stat`, Linux only): less sensitive than wall time to other processes on a busy
//! machine, and with several threads it shows what the extra threads cost.

use std::error::Error;
use std::time::Instant;

use iota_model::rng::SplitMix64;
use iota_model::{Device, ModelConfig, Pipeline, StageOptions, Tensor};

// The allocator of the `iota` binary that miners and validators run: glibc's malloc returned
// freed gradient buffers to the kernel and paid a page fault per fresh page again.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// What `iota` does for the commands that train (`cli/src/alloc.rs`): freed memory stays with
/// the process (`mi_option_purge_delay`, 15 in mimalloc's `mi_option_e`, set to -1), so a step
/// does not take every page back through a zeroing page fault.
#[allow(unsafe_code)]
fn keep_freed_memory() {
    // SAFETY: sets a plain integer option before any other thread starts.
    unsafe { libmimalloc_sys::mi_option_set(15, -1) }
}

fn main() -> Result<(), Box<dyn Error>> {
    keep_freed_memory();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--print-config") {
        let name = args.get(1).map(String::as_str).unwrap_or("small");
        println!("{}", ModelConfig::load(name)?.to_json()?);
        return Ok(());
    }
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let cfg = ModelConfig::load(&arg(0, "small"))?;
    let batch: usize = arg(1, "4").parse()?;
    let seq: usize = arg(2, "128").parse()?;
    let iters: usize = arg(3, "5").parse()?;
    // `staged`, `monolithic` (the default) or `sub-batched:N` (the micro-batch cut in N runs).
    let mode = arg(4, "monolithic");
    let staged = mode == "staged";
    let parts: usize = match mode.strip_prefix("sub-batched:") {
        Some(n) => n.parse()?,
        None => 1,
    };
    let mut rng = SplitMix64::new(0);
    let mut ids = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| (rng.next_u64() % cfg.vocab_size as u64) as u32)
            .collect()
    };
    let tokens = Tensor::from_vec(ids(batch * seq), (batch, seq), &Device::Cpu)?;
    let targets = Tensor::from_vec(ids(batch * seq), (batch, seq), &Device::Cpu)?;
    let opts = StageOptions {
        sub_batches: parts,
        ..StageOptions::cpu()
    };
    let mut p = Pipeline::new(&cfg, &opts)?;
    let mut times = Vec::new();
    let mut cpu_start = None;
    for it in 0..=iters {
        if it == 1 {
            cpu_start = cpu_seconds();
        }
        p.zero_grad();
        let t0 = Instant::now();
        if staged {
            p.forward_backward(&tokens, &targets)?;
        } else {
            p.forward_backward_monolithic(&tokens, &targets)?;
        }
        if it > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!("tokens_per_s={:.1}", (batch * seq) as f64 / median);
    eprintln!("matmul: {}", iota_model::matmul_backend());
    if let (Some(a), Some(b)) = (cpu_start, cpu_seconds()) {
        eprintln!(
            "tokens_per_cpu_s={:.1}",
            (batch * seq * iters) as f64 / (b - a).max(1e-9)
        );
    }
    Ok(())
}

/// User plus system CPU time of this process in seconds (all threads), from `/proc/self/stat`.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // The kernel reports USER_HZ ticks, 100 per second on every Linux architecture.
    Some(ticks / 100.0)
}
