//! Every integration test of this crate in one binary: one link instead of one per file,
//! and the shared helpers compiled once.

mod faults;
mod localnet_up;
mod localnet_up_text;
mod miner_process;
#[path = "../../miner/tests/support/mod.rs"]
mod miner_support;
mod orchestrator_process;
mod support;
