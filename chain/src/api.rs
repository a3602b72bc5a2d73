//! Types and call/storage addresses generated at compile time from `metadata/localnet.scale`.
//!
//! The localnet's metadata is a subset of finney's with identical structural hashes for every item
//! it declares, so what is generated here encodes the same bytes for finney. Whether a live node
//! still agrees is checked at connect by [`crate::shape`].

/// The metadata the client was built against (the same file the macro below reads; including
/// it also makes cargo rebuild this crate when the file changes).
pub const COMPILED_METADATA: &[u8] = include_bytes!("../../metadata/localnet.scale");

/// Finney's account address type (no account indices).
pub type Address = subxt::utils::MultiAddress<subxt::utils::AccountId32, ()>;

#[allow(
    missing_docs,
    clippy::all,
    clippy::unwrap_used,
    clippy::pedantic,
    non_camel_case_types,
    unused
)]
#[subxt::subxt(
    runtime_metadata_path = "../metadata/localnet.scale",
    derive_for_all_types = "Clone, PartialEq, Eq",
    // The localnet declares `MultiAddress` without type parameters; spell out finney's
    // `MultiAddress<AccountId32, ()>` so subxt's own type is used.
    substitute_type(
        path = "sp_runtime::multiaddress::MultiAddress",
        with = "crate::api::Address"
    )
)]
pub mod runtime {}

pub use runtime::*;
