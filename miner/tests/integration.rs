//! Every integration test of this crate in one binary: one link instead of one per file,
//! and the shared helpers compiled once.

mod adversaries;
mod dataset_store;
mod direct_uploads;
mod faults;
mod prepared_data;
mod run_bounds;
mod training;

// The shared set-up, as `crate::support` for every module.
use iota_testkit as support;
