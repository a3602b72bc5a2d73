//! Every integration test of this crate in one binary: one link instead of one per file,
//! and the shared helpers compiled once.

mod metadata_fidelity;
mod python_sdk;
mod subxt_e2e;
