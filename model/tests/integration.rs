//! Every integration test of this crate in one binary: one link instead of one per file,
//! and the shared helpers compiled once.

mod golden;
mod prepared_data;
mod wire_agreement;
