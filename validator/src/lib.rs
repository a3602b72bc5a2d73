//! The IOTA validator: verifies miners' work, attributes loss with CLASP, persists scores and
//! sets weights on chain.
//!
//! Built so far: [`clasp`], the pathway loss attribution. The service (spot checks by replay,
//! merge and loss checks, PostgreSQL persistence, weight setting) is not built yet.

pub mod clasp;

pub use clasp::{
    Clasp, ClaspConfig, ClaspError, ClaspFit, HotkeyEffects, MinerEffect, fit_samples,
};
