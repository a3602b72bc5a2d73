//! Every integration test of this crate in one binary: one link instead of one per file,
//! and the shared helpers compiled once.

mod dashboard;
mod epoch;
mod fuzz;
mod openapi;
mod phases;
mod poll_view;
mod replay;
mod schemathesis;
mod sessions;
mod storage;
mod trust;

// The shared set-up, as `crate::common` for every module.
use iota_testkit::common;
