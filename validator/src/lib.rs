//! The IOTA validator: verifies miners' work, attributes loss with CLASP, persists scores in
//! PostgreSQL and sets weights on chain.
//!
//! * [`clasp`]: the pathway loss attribution (ridge least squares with faer).
//! * [`replay`]: replay spot checks of a miner's epoch with the honest trainer miners run (`iota-trainer`).
//! * [`merges`]: re-deriving a partition's merge.
//! * [`score`]: the scoring formula.
//! * [`store`]: the database (`migrations/validator/`), including the commit-reveal store.
//! * [`service`]: the loop that ties them together.
//! * [`audit`]: recompute a scored epoch's fit, scores and weights and compare them with the
//!   database and the chain.
//! * [`fallback`]: the consensus weights set while the orchestrator is unreachable.
//! * [`onchain`]: reads of the chain's weight storage.
//! * [`published`]: what a validator publishes with its scores so that anyone can recompute them.
//! * [`owed`]: when weights that did not reach the chain are tried again.

pub mod audit;
pub mod clasp;
pub mod config;
mod error;
pub mod fallback;
pub mod merges;
pub mod onchain;
pub mod owed;
pub mod published;
pub mod replay;
pub mod score;
pub mod service;
pub mod store;

pub use audit::AuditReport;
pub use clasp::{
    Clasp, ClaspConfig, ClaspError, ClaspFit, HotkeyEffects, MinerEffect, fit_samples,
};
pub use config::ValidatorArgs;
pub use error::ValidatorError;
pub use service::{
    EpochOutcome, Validator, ValidatorConfig, draw_seed, orchestrator_unreachable, run,
};
pub use store::{ScoreTotal, Store, WeightSource};
