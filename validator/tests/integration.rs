//! Every integration test of this crate in one binary: one link instead of one per file,
//! and the shared helpers compiled once.

mod catches_adversaries;
mod clasp_simulation;
mod consensus_fallback;
mod disputes;
mod harness;
mod moved_miner;
mod object_faults;
mod submission_recovery;
#[path = "../../miner/tests/support/mod.rs"]
mod support;
mod weights_owed;

// The orchestrator's helpers, as the miner's helpers include them.
use support::common;
