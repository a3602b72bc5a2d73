//! The localnet's runtime metadata (V16), built from the same Rust types the runtime dispatches,
//! so what clients are told and what the chain does cannot drift apart.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use frame_metadata::v16::{
    CustomMetadata, EnumDeprecationInfo, ExtrinsicMetadata, FunctionParamMetadata,
    ItemDeprecationInfo, OuterEnums, PalletCallMetadata, PalletConstantMetadata,
    PalletErrorMetadata, PalletEventMetadata, PalletMetadata, PalletStorageMetadata,
    RuntimeApiMetadata, RuntimeApiMethodMetadata, RuntimeMetadataV16, TransactionExtensionMetadata,
};
use frame_metadata::{RuntimeMetadata, RuntimeMetadataPrefixed};
use parity_scale_codec::{Compact, Encode};
use scale_info::{MetaType, TypeInfo, meta_type};

use crate::runtime::call::{
    AdminUtilsCall, BalancesCall, RuntimeCall, SubtensorCall, SudoCall, SystemCall,
};
use crate::runtime::error::{
    AdminUtilsError, BalancesError, SubtensorError, SudoError, SystemError,
};
use crate::runtime::event::{
    AdminUtilsEvent, BalancesEvent, RuntimeEvent, SubtensorEvent, SudoEvent, SystemEvent,
};
use crate::runtime::extrinsic::extension_types as ext;
use crate::runtime::storage;
use crate::runtime::types::{AccountId32, H256, MultiAddress, MultiSignature, RuntimeVersion};
use crate::runtime::{EXISTENTIAL_DEPOSIT, SS58_PREFIX, runtime_version};

/// The module-error outer enum: one variant per pallet wrapping its error enum.
#[derive(TypeInfo)]
#[allow(dead_code)]
enum RuntimeError {
    #[codec(index = 0)]
    System(SystemError),
    #[codec(index = 5)]
    Balances(BalancesError),
    #[codec(index = 7)]
    SubtensorModule(SubtensorError),
    #[codec(index = 12)]
    Sudo(SudoError),
    #[codec(index = 19)]
    AdminUtils(AdminUtilsError),
}

/// Where a Substrate runtime's types live; clients and codegen recognise some of them by path
/// (subxt finds the dispatch error by `sp_runtime::DispatchError`).
const CANONICAL_PATHS: &[(&str, &[&str])] = &[
    ("DispatchError", &["sp_runtime", "DispatchError"]),
    ("ModuleError", &["sp_runtime", "ModuleError"]),
    ("TokenError", &["sp_runtime", "TokenError"]),
    ("ArithmeticError", &["sp_arithmetic", "ArithmeticError"]),
    ("TransactionalError", &["sp_runtime", "TransactionalError"]),
    ("TrieError", &["sp_runtime", "proving_trie", "TrieError"]),
    (
        "MultiAddress",
        &["sp_runtime", "multiaddress", "MultiAddress"],
    ),
    ("MultiSignature", &["sp_runtime", "MultiSignature"]),
    ("Weight", &["sp_weights", "weight_v2", "Weight"]),
    (
        "DispatchClass",
        &["frame_support", "dispatch", "DispatchClass"],
    ),
    ("Pays", &["frame_support", "dispatch", "Pays"]),
    ("DispatchEventInfo", &["frame_system", "DispatchEventInfo"]),
    ("EventRecord", &["frame_system", "EventRecord"]),
    ("Phase", &["frame_system", "Phase"]),
    ("AccountInfo", &["frame_system", "AccountInfo"]),
    ("AccountData", &["pallet_balances", "types", "AccountData"]),
    ("ExtraFlags", &["pallet_balances", "types", "ExtraFlags"]),
    ("AxonInfo", &["pallet_subtensor", "pallet", "AxonInfo"]),
    ("FixedU128", &["substrate_fixed", "FixedU128"]),
    ("RuntimeVersion", &["sp_version", "RuntimeVersion"]),
    ("Cow", &["Cow"]),
    ("RuntimeCall", &["node_subtensor_runtime", "RuntimeCall"]),
    ("RuntimeEvent", &["node_subtensor_runtime", "RuntimeEvent"]),
    ("RuntimeError", &["node_subtensor_runtime", "RuntimeError"]),
    ("SystemCall", &["frame_system", "pallet", "Call"]),
    ("SystemEvent", &["frame_system", "pallet", "Event"]),
    ("SystemError", &["frame_system", "pallet", "Error"]),
    ("BalancesCall", &["pallet_balances", "pallet", "Call"]),
    ("BalancesEvent", &["pallet_balances", "pallet", "Event"]),
    ("BalancesError", &["pallet_balances", "pallet", "Error"]),
    ("SubtensorCall", &["pallet_subtensor", "pallet", "Call"]),
    ("SubtensorEvent", &["pallet_subtensor", "pallet", "Event"]),
    ("SubtensorError", &["pallet_subtensor", "pallet", "Error"]),
    ("SudoCall", &["pallet_sudo", "pallet", "Call"]),
    ("SudoEvent", &["pallet_sudo", "pallet", "Event"]),
    ("SudoError", &["pallet_sudo", "pallet", "Error"]),
    ("AdminUtilsCall", &["pallet_admin_utils", "pallet", "Call"]),
    (
        "AdminUtilsEvent",
        &["pallet_admin_utils", "pallet", "Event"],
    ),
    (
        "AdminUtilsError",
        &["pallet_admin_utils", "pallet", "Error"],
    ),
];

fn pallet(
    name: &'static str,
    index: u8,
    calls: Option<MetaType>,
    event: Option<MetaType>,
    error: MetaType,
    storage: (&'static str, Vec<frame_metadata::v16::StorageEntryMetadata>),
    constants: Vec<PalletConstantMetadata>,
) -> PalletMetadata {
    PalletMetadata {
        name,
        storage: Some(PalletStorageMetadata {
            prefix: storage.0,
            entries: storage.1,
        }),
        calls: calls.map(|ty| PalletCallMetadata {
            ty,
            deprecation_info: EnumDeprecationInfo::nothing_deprecated(),
        }),
        event: event.map(|ty| PalletEventMetadata {
            ty,
            deprecation_info: EnumDeprecationInfo::nothing_deprecated(),
        }),
        constants,
        error: Some(PalletErrorMetadata {
            ty: error,
            deprecation_info: EnumDeprecationInfo::nothing_deprecated(),
        }),
        associated_types: vec![],
        view_functions: vec![],
        index,
        docs: vec![],
        deprecation_info: ItemDeprecationInfo::NotDeprecated,
    }
}

fn constant<T: TypeInfo + Encode + 'static>(
    name: &'static str,
    value: T,
) -> PalletConstantMetadata {
    PalletConstantMetadata {
        name,
        ty: meta_type::<T>(),
        value: value.encode(),
        docs: vec![],
        deprecation_info: ItemDeprecationInfo::NotDeprecated,
    }
}

fn api_method(
    name: &'static str,
    inputs: Vec<(&'static str, MetaType)>,
    output: MetaType,
) -> RuntimeApiMethodMetadata {
    RuntimeApiMethodMetadata {
        name,
        inputs: inputs
            .into_iter()
            .map(|(name, ty)| FunctionParamMetadata { name, ty })
            .collect(),
        output,
        docs: vec![],
        deprecation_info: ItemDeprecationInfo::NotDeprecated,
    }
}

fn api(
    name: &'static str,
    version: u32,
    methods: Vec<RuntimeApiMethodMetadata>,
) -> RuntimeApiMetadata {
    RuntimeApiMetadata {
        name,
        methods,
        docs: vec![],
        version: Compact(version),
        deprecation_info: ItemDeprecationInfo::NotDeprecated,
    }
}

fn extension<T: TypeInfo + 'static, I: TypeInfo + 'static>(
    identifier: &'static str,
) -> TransactionExtensionMetadata {
    TransactionExtensionMetadata {
        identifier,
        ty: meta_type::<T>(),
        implicit: meta_type::<I>(),
    }
}

fn build() -> RuntimeMetadataV16 {
    let extensions = vec![
        extension::<ext::CheckNonZeroSender, ()>("CheckNonZeroSender"),
        extension::<ext::CheckSpecVersion, u32>("CheckSpecVersion"),
        extension::<ext::CheckTxVersion, u32>("CheckTxVersion"),
        extension::<ext::CheckGenesis, H256>("CheckGenesis"),
        extension::<ext::CheckMortality, H256>("CheckMortality"),
        extension::<ext::CheckNonce, ()>("CheckNonce"),
        extension::<ext::CheckWeight, ()>("CheckWeight"),
        extension::<ext::ChargeTransactionPayment, ()>("ChargeTransactionPayment"),
        extension::<ext::SudoTransactionExtension, ()>("SudoTransactionExtension"),
        extension::<ext::CheckShieldedTxValidity, ()>("CheckShieldedTxValidity"),
        extension::<ext::SubtensorTransactionExtension, ()>("SubtensorTransactionExtension"),
        extension::<ext::DrandPriority, ()>("DrandPriority"),
        extension::<ext::CheckMetadataHash, Option<[u8; 32]>>("CheckMetadataHash"),
    ];
    let all_extensions = (0..extensions.len() as u32).map(Compact).collect();
    let extrinsic = ExtrinsicMetadata {
        versions: vec![4, 5],
        address_ty: meta_type::<MultiAddress>(),
        call_ty: meta_type::<RuntimeCall>(),
        signature_ty: meta_type::<MultiSignature>(),
        transaction_extensions_by_version: BTreeMap::from([(0u8, all_extensions)]),
        transaction_extensions: extensions,
    };

    let pallets = vec![
        pallet(
            "System",
            0,
            Some(meta_type::<SystemCall>()),
            Some(meta_type::<SystemEvent>()),
            meta_type::<SystemError>(),
            ("System", storage::system::entries()),
            vec![
                constant("BlockHashCount", 2_400u32),
                constant("Version", runtime_version()),
                constant("SS58Prefix", SS58_PREFIX),
            ],
        ),
        pallet(
            "Balances",
            5,
            Some(meta_type::<BalancesCall>()),
            Some(meta_type::<BalancesEvent>()),
            meta_type::<BalancesError>(),
            ("Balances", storage::balances::entries()),
            vec![constant("ExistentialDeposit", EXISTENTIAL_DEPOSIT)],
        ),
        pallet(
            "SubtensorModule",
            7,
            Some(meta_type::<SubtensorCall>()),
            Some(meta_type::<SubtensorEvent>()),
            meta_type::<SubtensorError>(),
            ("SubtensorModule", storage::subtensor::entries()),
            vec![],
        ),
        pallet(
            "Sudo",
            12,
            Some(meta_type::<SudoCall>()),
            Some(meta_type::<SudoEvent>()),
            meta_type::<SudoError>(),
            ("Sudo", storage::sudo::entries()),
            vec![],
        ),
        pallet(
            "AdminUtils",
            19,
            Some(meta_type::<AdminUtilsCall>()),
            Some(meta_type::<AdminUtilsEvent>()),
            meta_type::<AdminUtilsError>(),
            ("AdminUtils", vec![]),
            vec![],
        ),
    ];

    let apis = vec![
        api(
            "Core",
            5,
            vec![api_method("version", vec![], meta_type::<RuntimeVersion>())],
        ),
        api(
            "Metadata",
            2,
            vec![
                api_method("metadata", vec![], meta_type::<Vec<u8>>()),
                api_method(
                    "metadata_at_version",
                    vec![("version", meta_type::<u32>())],
                    meta_type::<Option<Vec<u8>>>(),
                ),
                api_method("metadata_versions", vec![], meta_type::<Vec<u32>>()),
            ],
        ),
        api(
            "AccountNonceApi",
            1,
            vec![api_method(
                "account_nonce",
                vec![("account", meta_type::<AccountId32>())],
                meta_type::<u32>(),
            )],
        ),
    ];

    let outer_enums = OuterEnums {
        call_enum_ty: meta_type::<RuntimeCall>(),
        event_enum_ty: meta_type::<RuntimeEvent>(),
        error_enum_ty: meta_type::<RuntimeError>(),
    };
    let mut metadata = RuntimeMetadataV16::new(
        pallets,
        extrinsic,
        apis,
        outer_enums,
        CustomMetadata {
            map: BTreeMap::new(),
        },
    );
    for ty in metadata.types.types.iter_mut() {
        let segments = &mut ty.ty.path.segments;
        if segments.first().map(String::as_str) != Some("iota_localnet") {
            continue;
        }
        let Some(last) = segments.last() else {
            continue;
        };
        if let Some((_, path)) = CANONICAL_PATHS.iter().find(|(name, _)| name == last) {
            *segments = path.iter().map(|s| s.to_string()).collect();
        }
    }
    metadata
}

/// The metadata as `RuntimeMetadataPrefixed` bytes ("meta" + version 16), built once.
pub fn metadata_bytes() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        RuntimeMetadataPrefixed(frame_metadata::META_RESERVED, RuntimeMetadata::V16(build()))
            .encode()
    })
}

/// The path of the committed copy, relative to the workspace root.
pub const COMMITTED_PATH: &str = "metadata/localnet.scale";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_decodes_with_subxt() {
        let md = subxt_metadata::Metadata::decode_from(metadata_bytes()).expect("decodes");
        let sub = md.pallet_by_name("SubtensorModule").expect("pallet");
        assert_eq!(sub.call_index(), 7);
        assert_eq!(
            sub.call_variant_by_name("set_weights").map(|v| v.index),
            Some(0)
        );
        assert!(
            md.dispatch_error_ty().is_some(),
            "subxt must find sp_runtime::DispatchError"
        );
        let errors = sub.error_variants().expect("errors");
        assert_eq!(errors[28].name, "SettingWeightsTooFast");
    }
}
