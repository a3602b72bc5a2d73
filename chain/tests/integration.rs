//! Every integration test of this crate in one binary: one link instead of one per file,
//! and the shared helpers compiled once.

mod cli;
mod drand_python;
mod finney_metadata;
mod localnet;
mod wallet;
mod weights;
