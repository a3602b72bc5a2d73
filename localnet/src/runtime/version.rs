//! The runtime's identity: its spec and the runtime APIs it advertises.

use super::types::{Cow, RuntimeVersion};

/// The runtime interface the localnet mirrors: finney's spec 393.
pub const SPEC_NAME: &str = "node-subtensor";
pub const IMPL_NAME: &str = "iota-localnet";
pub const SPEC_VERSION: u32 = 393;
pub const TRANSACTION_VERSION: u32 = 1;
pub const SS58_PREFIX: u16 = 42;
/// `Aura.SlotDuration` as declared, and how far the chain's clock (`Timestamp.Now`) moves per
/// block: the default block time of `iota localnet chain` (a timer set on the command line
/// changes how often blocks come, not this constant).
pub const SLOT_DURATION_MS: u64 = 250;

/// Runtime API identifiers: blake2-64 of the trait name, with the versions finney advertises.
pub fn runtime_version() -> RuntimeVersion {
    let api = |name: &str, version: u32| (sp_crypto_hashing::blake2_64(name.as_bytes()), version);
    RuntimeVersion {
        spec_name: Cow(SPEC_NAME.into()),
        impl_name: Cow(IMPL_NAME.into()),
        authoring_version: 1,
        spec_version: SPEC_VERSION,
        impl_version: 1,
        apis: Cow(RUNTIME_APIS
            .iter()
            .map(|(name, version)| api(name, *version))
            .collect()),
        transaction_version: TRANSACTION_VERSION,
        system_version: 1,
    }
}

/// The runtime APIs the localnet answers, with finney's trait names, method names, parameter
/// names and types. `runtime_version()` advertises the same traits.
pub const RUNTIME_APIS: &[(&str, u32)] = &[
    ("Core", 5),
    ("Metadata", 2),
    ("TaggedTransactionQueue", 3),
    ("AccountNonceApi", 1),
    ("TransactionPaymentApi", 4),
    ("NeuronInfoRuntimeApi", 1),
    ("SubnetInfoRuntimeApi", 1),
    ("SubnetRegistrationRuntimeApi", 1),
    ("StakeInfoRuntimeApi", 1),
    ("SwapRuntimeApi", 1),
];

#[cfg(test)]
mod tests {
    #[test]
    fn runtime_api_ids_are_substrates() {
        // Known identifiers of `Core` and `Metadata` on every Substrate chain.
        let apis = super::runtime_version().apis.0;
        assert_eq!(hex::encode(apis[0].0), "df6acb689907609b");
        assert_eq!(hex::encode(apis[1].0), "37e397fc7c91f5e4");
    }
}
