//! What the model's benchmarks share; each uses a part.
#![allow(dead_code)]

/// Ends the benchmark with what failed.
pub fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("{} bench: {what}: {e}", env!("CARGO_CRATE_NAME"));
    std::process::exit(1)
}

/// The machine's load averages over 1, 5 and 15 minutes, for the figures' context.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Peak resident memory of this process, from the kernel's high-water mark.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// The compression benches' model: three one-block stages of width 256 (two boundaries, d/b up
/// to 64 at b = 4), small enough to train close to the grammar's entropy floor in minutes on a
/// CPU, for a corpus of `vocab_size` tokens and windows of `seq`.
pub fn three_small_stages(name: &str, vocab_size: usize, seq: usize) -> iota_model::ModelConfig {
    iota_model::ModelConfig {
        name: name.into(),
        d_model: 256,
        n_heads: 4,
        n_kv_heads: 2,
        d_ff: 512,
        max_seq_len: seq,
        ..iota_model::ModelConfig::small()
    }
    .with_vocab_size(vocab_size)
    .with_stages(vec![1, 1, 1])
}
