//! Every integration test of this crate in one binary: one link instead of one per file,
//! and the shared helpers compiled once.

mod client_limits;
mod signing_props;
mod tensor_props;
