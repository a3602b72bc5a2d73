//! Every integration test of this crate in one binary: one link instead of one per file,
//! and the shared helpers compiled once.

mod faults;
mod localnet_up;
mod localnet_up_text;
mod miner_process;
mod orchestrator_process;
mod support;

// The workspace's shared set-up, as `crate::miner_support` for every module.
use iota_testkit as miner_support;
