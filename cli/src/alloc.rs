//! The process's allocator, and what it does with memory a training step frees.

// glibc's malloc spent about a tenth of the orchestrator's time on a signed work poll (freeing
// across threads and consolidating after each batch of signature checks); mimalloc does not.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay`: its place in mimalloc's `mi_option_e` (the same in mimalloc 2 and 3;
/// `libmimalloc-sys` names no constant for it). The test below fails if it names another option.
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps memory the process frees for its own reuse instead of handing it back to the kernel.
///
/// A training step frees and allocates the same buffers again and again. By default mimalloc
/// hands freed memory back once a second, and every page of it then returns through a page
/// fault that zeroes it: with two runs of `small` side by side on two cores, a fifth of the
/// process's samples were the kernel clearing pages. The process's resident memory stays at its
/// peak instead, which the next step needs anyway.
///
/// Call it while the process has one thread (mimalloc's options are not thread-safe).
#[allow(unsafe_code)]
pub fn keep_freed_memory() {
    // SAFETY: sets a plain integer option; the caller runs before any other thread starts.
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, -1) }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    /// This process's resident bytes (Linux).
    fn resident_bytes() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").expect("reading /proc/self/statm");
        let pages: usize = statm
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .expect("resident pages in /proc/self/statm");
        pages * 4096
    }

    /// With the default purge delay (one second in mimalloc 3) the freed buffer leaves the
    /// process once the delay has passed; kept, it stays resident. Each test runs in its own
    /// process under nextest, so nothing else allocates meanwhile.
    #[test]
    #[allow(unsafe_code)]
    fn freed_memory_stays_resident_for_the_next_step() {
        const BYTES: usize = 256 << 20;
        super::keep_freed_memory();
        let buffer = std::hint::black_box(vec![1u8; BYTES]);
        let held = resident_bytes();
        drop(buffer);
        std::thread::sleep(Duration::from_millis(1500));
        // SAFETY: mimalloc's collection, which also carries out purges whose delay has passed.
        unsafe { libmimalloc_sys::mi_collect(false) };
        let after = resident_bytes();
        assert!(
            after + BYTES / 4 > held,
            "{} MiB of the freed {} MiB went back to the kernel",
            held.saturating_sub(after) >> 20,
            BYTES >> 20
        );
    }
}
