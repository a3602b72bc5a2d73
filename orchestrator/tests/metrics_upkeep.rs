//! Histogram samples (one per request) do not pile up in memory while nobody scrapes
//! `/metrics`: the recorder's upkeep folds them into their summaries in the background.
//!
//! The allocator counter is process-wide, so this binary holds exactly one test.

use std::alloc::System;
use std::time::{Duration, Instant};

use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Samples recorded at once: 16 MB kept (a value and a timestamp each) until they are folded.
const SAMPLES: usize = 1_000_000;
/// Samples recorded on each look afterwards, as requests would go on arriving. The recorder frees
/// folded samples' blocks through epoch-based reclamation, which runs as later samples are
/// recorded.
const TRICKLE: usize = 1_000;
/// What may stay allocated once upkeep has run: the summary, the recorder's tables, the samples
/// since the last upkeep, and blocks whose freeing is still deferred (a thread's bag holds at
/// most 64 deferred frees of 32 blocks of 64 samples, 2 MB).
const KEPT_AT_MOST: isize = 4 << 20;

#[test]
fn histogram_samples_are_folded_without_a_scrape() {
    let handle = iota_orchestrator::metrics_handle();
    let histogram = metrics::histogram!("iota_test_upkeep_seconds");
    // The series exists before the region starts, so only the samples are counted.
    histogram.record(0.0);
    handle.run_upkeep();
    let started = Instant::now();
    let region = Region::new(GLOBAL);
    for i in 0..SAMPLES {
        histogram.record(i as f64 * 1e-6);
    }
    let retained = || {
        let change = region.change();
        change.bytes_allocated as isize - change.bytes_deallocated as isize
    };
    let recorded = retained();
    assert!(
        recorded > KEPT_AT_MOST,
        "recording {SAMPLES} samples kept only {recorded} bytes: this test measures nothing"
    );
    let wait = iota_orchestrator::METRICS_UPKEEP_EVERY * 3 + Duration::from_secs(2);
    let deadline = Instant::now() + wait;
    let mut total = SAMPLES + 1;
    while retained() > KEPT_AT_MOST {
        for _ in 0..TRICKLE {
            histogram.record(1e-3);
        }
        total += TRICKLE;
        assert!(
            Instant::now() < deadline,
            "{} bytes still held {wait:?} after recording {SAMPLES} samples, with no scrape",
            retained()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The samples are in the summary: a scrape counts them. metrics-util's bucket can miss a
    // sample whose push began just before an upkeep swapped the bucket out and ended after it was
    // read, so each background upkeep may cost this one recording thread at most one sample.
    let upkeeps =
        started.elapsed().as_secs_f64() / iota_orchestrator::METRICS_UPKEEP_EVERY.as_secs_f64();
    let may_miss = upkeeps.ceil() as usize + 1;
    let text = handle.render();
    let count = text
        .lines()
        .find_map(|l| l.strip_prefix("iota_test_upkeep_seconds_count "))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or_else(|| panic!("no count in the scrape:\n{text}"));
    assert!(
        count <= total && count + may_miss >= total,
        "counted {count} of {total} samples (at most {may_miss} may be missed):\n{text}"
    );
}
