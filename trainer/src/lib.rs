//! A stage's honest epoch, fixed by a run's public config: what miners train with and what
//! validators replay, so both sides run the same code and neither depends on the other.
//!
//! * [`StageTrainer`]: one stage, its inner optimizer and the epoch's bookkeeping (held
//!   gradients, inner steps, pseudo-gradients), blocking.
//! * [`merge`]: a partition owner's weighted average and outer step.
//! * [`run`]: the model, data and initial weights a run names.
//! * [`sparse`]: a sparse run's compressed uploads, merges and outer steps.
//!
//! Nothing here is dishonest: a miner's `--adversary` behaviours wrap [`StageTrainer`] in the
//! miner crate.

mod error;
pub mod merge;
pub mod run;
pub mod sparse;
mod stage;

pub use error::TrainerError;
pub use merge::{merged_partition, merged_values};
pub use run::{
    grammar_corpus, initial_range, local_tiny_run, open_prepared, run_dataset, run_model,
};
pub use stage::{HopOutput, StageTrainer};
