//! Every integration test of this crate in one binary: one link instead of one per file,
//! and the shared helpers compiled once.

mod catches_adversaries;
mod clasp_simulation;
mod consensus_fallback;
mod disputes;
mod harness;
mod moved_miner;
mod object_faults;
mod score_totals;
mod sparse_run;
mod submission_recovery;
mod weights_owed;

// The shared set-up, as `crate::support` (and `crate::common`) for every module.
use iota_testkit as support;
use iota_testkit::common;
