//! What the model's benchmarks share.

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
