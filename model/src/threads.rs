//! How many threads one tensor operation may use on the CPU.
//!
//! candle takes this from the environment only: `RAYON_NUM_THREADS` for matrix products (read
//! at every product, and by the `openblas` row blocks once) and `CANDLE_NUM_THREADS` for its
//! element-wise pool (read once, at the first operation that uses it). Unset, both are the
//! physical cores, which suits one model per process.
//!
//! Several models working at once in one process (`iota localnet up`'s miners and validators)
//! share those pools, and the element-wise pool serves one caller at a time while its threads
//! and callers spin on each other. With three miners on two cores the pipeline bench made 709
//! tokens/s with the defaults and 1,213 with one thread per operation (`BENCHMARKS.md`,
//! pipeline, has the current figures), so such a process runs each operation on fewer threads
//! and lets the models run side by side instead.

/// The variable candle's matrix products read.
pub const MATMUL_VAR: &str = "RAYON_NUM_THREADS";
/// The variable candle's element-wise pool reads.
pub const ELEMENTWISE_VAR: &str = "CANDLE_NUM_THREADS";

/// Threads per CPU tensor operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuThreads {
    /// Threads one matrix product may use.
    pub matmul: usize,
    /// Threads one element-wise operation may use.
    pub elementwise: usize,
}

impl CpuThreads {
    /// `threads` for every operation (at least one).
    pub fn uniform(threads: usize) -> Self {
        let threads = threads.max(1);
        Self {
            matmul: threads,
            elementwise: threads,
        }
    }

    /// For `models` models working at once in one process on `cores` cores: each product gets
    /// an equal share of the cores (at least one), and element-wise operations one thread, since
    /// candle's element-wise pool would make the models take turns.
    pub fn shared(models: usize, cores: usize) -> Self {
        Self {
            matmul: (cores / models.max(1)).max(1),
            elementwise: 1,
        }
    }

    /// For runs of a micro-batch trained side by side ([`crate::StageOptions::sub_batches`]):
    /// products on every core, element-wise operations on one thread each, since candle's
    /// element-wise pool serves one caller at a time and would make the runs take turns.
    pub fn side_by_side() -> Self {
        Self {
            matmul: available_cores(),
            elementwise: 1,
        }
    }

    /// The environment variables that select these counts, for a child process or for
    /// setting in this one before any thread starts.
    pub fn env(&self) -> [(&'static str, String); 2] {
        [
            (MATMUL_VAR, self.matmul.to_string()),
            (ELEMENTWISE_VAR, self.elementwise.to_string()),
        ]
    }

    /// Whether the environment already chooses either count (a user's choice wins over a
    /// default).
    pub fn set_in_env() -> bool {
        [MATMUL_VAR, ELEMENTWISE_VAR]
            .iter()
            .any(|v| std::env::var_os(v).is_some())
    }
}

/// Logical cores this process may run on (1 if unknown).
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_splits_products_and_keeps_elementwise_on_one_thread() {
        assert_eq!(
            CpuThreads::shared(3, 2),
            CpuThreads {
                matmul: 1,
                elementwise: 1
            }
        );
        assert_eq!(CpuThreads::shared(8, 16).matmul, 2);
        assert_eq!(CpuThreads::shared(0, 4).matmul, 4);
        assert_eq!(CpuThreads::uniform(0), CpuThreads::uniform(1));
        let env = CpuThreads::shared(8, 16).env();
        assert_eq!(
            env,
            [
                ("RAYON_NUM_THREADS", "2".to_owned()),
                ("CANDLE_NUM_THREADS", "1".to_owned())
            ]
        );
    }
}
