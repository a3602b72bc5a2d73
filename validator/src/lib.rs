//! The IOTA validator: verifies miners' work, attributes loss with CLASP, persists scores in
//! PostgreSQL and sets weights on chain.
//!
//! * [`clasp`]: the pathway loss attribution (ridge least squares with faer).
//! * [`replay`]: replay spot checks of a miner's epoch with the miner's own trainer code.
//! * [`merges`]: re-deriving a partition's merge.
//! * [`score`]: the scoring formula.
//! * [`store`]: the database (`migrations/validator/`), including the commit-reveal store.
//! * [`service`]: the loop that ties them together.

pub mod clasp;
pub mod config;
mod error;
pub mod merges;
pub mod replay;
pub mod score;
pub mod service;
pub mod store;

pub use clasp::{
    Clasp, ClaspConfig, ClaspError, ClaspFit, HotkeyEffects, MinerEffect, fit_samples,
};
pub use config::ValidatorArgs;
pub use error::ValidatorError;
pub use service::{EpochOutcome, Validator, ValidatorConfig, draw_seed, run};
pub use store::Store;
