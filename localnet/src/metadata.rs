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
    AdminUtilsError, BalancesError, DrandError, SubtensorError, SudoError, SystemError,
};
use crate::runtime::event::{
    AdminUtilsEvent, BalancesEvent, DrandEvent, RuntimeEvent, SubtensorEvent, SudoEvent,
    SystemEvent,
};
use crate::runtime::extrinsic::extension_types as ext;
use crate::runtime::storage;
use crate::runtime::types::{AccountId32, H256, MultiAddress, MultiSignature, RuntimeVersion};
use crate::runtime::{EXISTENTIAL_DEPOSIT, SLOT_DURATION_MS, SS58_PREFIX, runtime_version};

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
    #[codec(index = 26)]
    Drand(DrandError),
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
    ("Runtime", &["node_subtensor_runtime", "Runtime"]),
    ("OpaqueMetadata", &["sp_core", "OpaqueMetadata"]),
    (
        "RuntimeDispatchInfo",
        &["pallet_transaction_payment", "types", "RuntimeDispatchInfo"],
    ),
    (
        "TransactionSource",
        &["sp_runtime", "transaction_validity", "TransactionSource"],
    ),
    (
        "ValidTransaction",
        &["sp_runtime", "transaction_validity", "ValidTransaction"],
    ),
    (
        "InvalidTransactionKind",
        &["sp_runtime", "transaction_validity", "InvalidTransaction"],
    ),
    (
        "UnknownTransaction",
        &["sp_runtime", "transaction_validity", "UnknownTransaction"],
    ),
    (
        "TransactionValidityError",
        &[
            "sp_runtime",
            "transaction_validity",
            "TransactionValidityError",
        ],
    ),
    ("Pulse", &["pallet_drand", "types", "Pulse"]),
    (
        "BeaconConfiguration",
        &["pallet_drand", "types", "BeaconConfiguration"],
    ),
    ("BeaconMetadata", &["pallet_drand", "types", "Metadata"]),
    ("FixedI128", &["substrate_fixed", "FixedI128"]),
    ("FixedI64", &["substrate_fixed", "FixedI64"]),
    (
        "SubnetIdentityV3",
        &["pallet_subtensor", "pallet", "SubnetIdentityV3"],
    ),
    (
        "ChainIdentityV2",
        &["pallet_subtensor", "pallet", "ChainIdentityV2"],
    ),
    (
        "PrometheusInfo",
        &["pallet_subtensor", "pallet", "PrometheusInfo"],
    ),
    (
        "Metagraph",
        &["pallet_subtensor", "rpc_info", "metagraph", "Metagraph"],
    ),
    (
        "SelectiveMetagraph",
        &[
            "pallet_subtensor",
            "rpc_info",
            "metagraph",
            "SelectiveMetagraph",
        ],
    ),
    (
        "NeuronInfo",
        &["pallet_subtensor", "rpc_info", "neuron_info", "NeuronInfo"],
    ),
    (
        "NeuronInfoLite",
        &[
            "pallet_subtensor",
            "rpc_info",
            "neuron_info",
            "NeuronInfoLite",
        ],
    ),
    (
        "SimSwapResult",
        &["pallet_subtensor_swap_runtime_api", "SimSwapResult"],
    ),
    (
        "SubnetState",
        &["pallet_subtensor", "rpc_info", "show_subnet", "SubnetState"],
    ),
    (
        "StakeInfo",
        &["pallet_subtensor", "rpc_info", "stake_info", "StakeInfo"],
    ),
    (
        "SubnetHyperparamsV2",
        &[
            "pallet_subtensor",
            "rpc_info",
            "subnet_info",
            "SubnetHyperparamsV2",
        ],
    ),
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
    ("DrandEvent", &["pallet_drand", "pallet", "Event"]),
    ("DrandError", &["pallet_drand", "pallet", "Error"]),
];

fn pallet(
    name: &'static str,
    index: u8,
    calls: Option<MetaType>,
    event: Option<MetaType>,
    error: Option<MetaType>,
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
        error: error.map(|ty| PalletErrorMetadata {
            ty,
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

fn runtime_apis() -> Vec<RuntimeApiMetadata> {
    use crate::runtime::rpc_info as info;
    let netuid = || ("netuid", meta_type::<u16>());
    let uid = || ("uid", meta_type::<u16>());
    let methods = |name: &str| -> Vec<RuntimeApiMethodMetadata> {
        match name {
            "Core" => vec![api_method("version", vec![], meta_type::<RuntimeVersion>())],
            "Metadata" => vec![
                api_method("metadata", vec![], meta_type::<info::OpaqueMetadata>()),
                api_method(
                    "metadata_at_version",
                    vec![("version", meta_type::<u32>())],
                    meta_type::<Option<info::OpaqueMetadata>>(),
                ),
                api_method("metadata_versions", vec![], meta_type::<Vec<u32>>()),
            ],
            "TaggedTransactionQueue" => vec![api_method(
                "validate_transaction",
                vec![
                    ("source", meta_type::<ext::TransactionSource>()),
                    ("tx", meta_type::<ext::UncheckedExtrinsic>()),
                    ("block_hash", meta_type::<H256>()),
                ],
                meta_type::<ext::TransactionValidity>(),
            )],
            "AccountNonceApi" => vec![api_method(
                "account_nonce",
                vec![("account", meta_type::<AccountId32>())],
                meta_type::<u32>(),
            )],
            "TransactionPaymentApi" => vec![api_method(
                "query_info",
                vec![
                    ("uxt", meta_type::<ext::UncheckedExtrinsic>()),
                    ("len", meta_type::<u32>()),
                ],
                meta_type::<info::RuntimeDispatchInfo>(),
            )],
            "NeuronInfoRuntimeApi" => vec![
                api_method(
                    "get_neurons",
                    vec![netuid()],
                    meta_type::<Vec<info::NeuronInfo>>(),
                ),
                api_method(
                    "get_neuron",
                    vec![netuid(), uid()],
                    meta_type::<Option<info::NeuronInfo>>(),
                ),
                api_method(
                    "get_neurons_lite",
                    vec![netuid()],
                    meta_type::<Vec<info::NeuronInfoLite>>(),
                ),
                api_method(
                    "get_neuron_lite",
                    vec![netuid(), uid()],
                    meta_type::<Option<info::NeuronInfoLite>>(),
                ),
            ],
            "SubnetInfoRuntimeApi" => vec![
                api_method(
                    "get_subnet_hyperparams_v2",
                    vec![netuid()],
                    meta_type::<Option<info::SubnetHyperparamsV2>>(),
                ),
                api_method(
                    "get_metagraph",
                    vec![netuid()],
                    meta_type::<Option<info::Metagraph>>(),
                ),
                api_method(
                    "get_selective_metagraph",
                    vec![netuid(), ("metagraph_indexes", meta_type::<Vec<u16>>())],
                    meta_type::<Option<info::SelectiveMetagraph>>(),
                ),
                api_method(
                    "get_selective_mechagraph",
                    vec![
                        netuid(),
                        ("subid", meta_type::<u8>()),
                        ("metagraph_indexes", meta_type::<Vec<u16>>()),
                    ],
                    meta_type::<Option<info::SelectiveMetagraph>>(),
                ),
                api_method(
                    "get_subnet_state",
                    vec![netuid()],
                    meta_type::<Option<info::SubnetState>>(),
                ),
            ],
            "SubnetRegistrationRuntimeApi" => vec![api_method(
                "get_network_registration_cost",
                vec![],
                meta_type::<u64>(),
            )],
            "StakeInfoRuntimeApi" => vec![
                api_method(
                    "get_stake_info_for_coldkey",
                    vec![("coldkey_account", meta_type::<AccountId32>())],
                    meta_type::<Vec<info::StakeInfo>>(),
                ),
                api_method(
                    "get_stake_info_for_hotkey_coldkey_netuid",
                    vec![
                        ("hotkey_account", meta_type::<AccountId32>()),
                        ("coldkey_account", meta_type::<AccountId32>()),
                        ("netuid", meta_type::<u16>()),
                    ],
                    meta_type::<Option<info::StakeInfo>>(),
                ),
            ],
            "SwapRuntimeApi" => vec![
                api_method("current_alpha_price", vec![netuid()], meta_type::<u64>()),
                api_method(
                    "sim_swap_tao_for_alpha",
                    vec![netuid(), ("tao", meta_type::<u64>())],
                    meta_type::<info::SimSwapResult>(),
                ),
                api_method(
                    "sim_swap_alpha_for_tao",
                    vec![netuid(), ("alpha", meta_type::<u64>())],
                    meta_type::<info::SimSwapResult>(),
                ),
            ],
            _ => vec![],
        }
    };
    crate::runtime::RUNTIME_APIS
        .iter()
        .map(|(name, version)| api(name, *version, methods(name)))
        .collect()
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
            Some(meta_type::<SystemError>()),
            ("System", storage::system::entries()),
            vec![
                constant("BlockHashCount", crate::chain::BLOCK_HASH_COUNT as u32),
                constant("Version", runtime_version()),
                constant("SS58Prefix", SS58_PREFIX),
            ],
        ),
        // Only the block's time, which the localnet advances by one slot per block.
        pallet(
            "Timestamp",
            2,
            None,
            None,
            None,
            ("Timestamp", storage::timestamp::entries()),
            vec![],
        ),
        // Only the slot duration: clients read the block time from it.
        pallet(
            "Aura",
            3,
            None,
            None,
            None,
            ("Aura", vec![]),
            vec![constant("SlotDuration", SLOT_DURATION_MS)],
        ),
        pallet(
            "Balances",
            5,
            Some(meta_type::<BalancesCall>()),
            Some(meta_type::<BalancesEvent>()),
            Some(meta_type::<BalancesError>()),
            ("Balances", storage::balances::entries()),
            vec![constant("ExistentialDeposit", EXISTENTIAL_DEPOSIT)],
        ),
        pallet(
            "SubtensorModule",
            7,
            Some(meta_type::<SubtensorCall>()),
            Some(meta_type::<SubtensorEvent>()),
            Some(meta_type::<SubtensorError>()),
            ("SubtensorModule", storage::subtensor::entries()),
            vec![],
        ),
        pallet(
            "Sudo",
            12,
            Some(meta_type::<SudoCall>()),
            Some(meta_type::<SudoEvent>()),
            Some(meta_type::<SudoError>()),
            ("Sudo", storage::sudo::entries()),
            vec![],
        ),
        pallet(
            "AdminUtils",
            19,
            Some(meta_type::<AdminUtilsCall>()),
            Some(meta_type::<AdminUtilsEvent>()),
            Some(meta_type::<AdminUtilsError>()),
            ("AdminUtils", vec![]),
            vec![],
        ),
        // The localnet's own beacon stands in for drand: pulses are written by the chain itself,
        // so the pallet has no calls.
        pallet(
            "Drand",
            26,
            None,
            Some(meta_type::<DrandEvent>()),
            Some(meta_type::<DrandError>()),
            ("Drand", storage::drand::entries()),
            vec![
                constant("UnsignedPriority", 1u64 << 20),
                constant("HttpFetchTimeout", 1_000u64),
            ],
        ),
    ];

    let apis = runtime_apis();

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
    // The runtime marker type V14 and V15 point at; nothing else refers to it.
    let id = metadata.types.types.len() as u32;
    metadata.types.types.push(scale_info::PortableType {
        id,
        ty: scale_info::Type {
            path: scale_info::Path {
                segments: vec!["node_subtensor_runtime".into(), "Runtime".into()],
            },
            type_params: vec![],
            type_def: scale_info::TypeDef::Composite(scale_info::TypeDefComposite {
                fields: vec![],
            }),
            docs: vec![],
        },
    });
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

/// The metadata versions served, as `Metadata_metadata_versions` lists them.
pub const METADATA_VERSIONS: [u32; 3] = [14, 15, 16];

/// The metadata in `version` (14, 15 or 16), every version from one type registry: V14 and V15
/// are V16 with the fields older clients know, and the same type ids.
pub fn metadata_bytes_at(version: u32) -> Option<&'static [u8]> {
    static V14: OnceLock<Vec<u8>> = OnceLock::new();
    static V15: OnceLock<Vec<u8>> = OnceLock::new();
    let prefixed = |md: RuntimeMetadata| RuntimeMetadataPrefixed(frame_metadata::META_RESERVED, md);
    match version {
        14 => {
            Some(V14.get_or_init(|| prefixed(RuntimeMetadata::V14(older::v14(build()))).encode()))
        }
        15 => {
            Some(V15.get_or_init(|| prefixed(RuntimeMetadata::V15(older::v15(build()))).encode()))
        }
        16 => Some(metadata_bytes()),
        _ => None,
    }
}

/// Down-conversion of the portable V16 metadata to V15 and V14.
mod older {
    use frame_metadata::v14;
    use frame_metadata::v15;
    use frame_metadata::v16::{self, RuntimeMetadataV16};
    use scale_info::form::PortableForm;
    use scale_info::{PortableRegistry, TypeDef};

    type P = PortableForm;

    fn find(types: &PortableRegistry, last: &str) -> u32 {
        types
            .types
            .iter()
            .find(|t| t.ty.path.segments.last().map(String::as_str) == Some(last))
            .map(|t| t.id)
            .unwrap_or_else(|| panic!("type {last} is registered by the runtime API declarations"))
    }

    fn type_param(types: &PortableRegistry, id: u32, name: &str) -> u32 {
        types
            .resolve(id)
            .and_then(|t| t.type_params.iter().find(|p| p.name == name))
            .and_then(|p| p.ty)
            .map(|t| t.id)
            .unwrap_or_else(|| panic!("UncheckedExtrinsic has a type parameter {name}"))
    }

    fn storage(s: v16::PalletStorageMetadata<P>) -> v14::PalletStorageMetadata<P> {
        v14::PalletStorageMetadata {
            prefix: s.prefix,
            entries: s
                .entries
                .into_iter()
                .map(|e| v14::StorageEntryMetadata {
                    name: e.name,
                    modifier: e.modifier,
                    ty: e.ty,
                    default: e.default,
                    docs: e.docs,
                })
                .collect(),
        }
    }

    struct Parts {
        constants: Vec<v14::PalletConstantMetadata<P>>,
        storage: Option<v14::PalletStorageMetadata<P>>,
        calls: Option<v14::PalletCallMetadata<P>>,
        event: Option<v14::PalletEventMetadata<P>>,
        error: Option<v14::PalletErrorMetadata<P>>,
    }

    fn parts(p: &v16::PalletMetadata<P>) -> Parts {
        Parts {
            constants: p
                .constants
                .iter()
                .map(|c| v14::PalletConstantMetadata {
                    name: c.name.clone(),
                    ty: c.ty,
                    value: c.value.clone(),
                    docs: c.docs.clone(),
                })
                .collect(),
            storage: p.storage.clone().map(storage),
            calls: p
                .calls
                .as_ref()
                .map(|c| v14::PalletCallMetadata { ty: c.ty }),
            event: p
                .event
                .as_ref()
                .map(|e| v14::PalletEventMetadata { ty: e.ty }),
            error: p
                .error
                .as_ref()
                .map(|e| v14::PalletErrorMetadata { ty: e.ty }),
        }
    }

    fn extensions(md: &RuntimeMetadataV16) -> Vec<v14::SignedExtensionMetadata<P>> {
        md.extrinsic
            .transaction_extensions
            .iter()
            .map(|e| v14::SignedExtensionMetadata {
                identifier: e.identifier.clone(),
                ty: e.ty,
                additional_signed: e.implicit,
            })
            .collect()
    }

    pub fn v15(md: RuntimeMetadataV16) -> v15::RuntimeMetadataV15 {
        let xt = find(&md.types, "UncheckedExtrinsic");
        let extra = type_param(&md.types, xt, "Extra");
        let runtime = find(&md.types, "Runtime");
        let signed_extensions = extensions(&md)
            .into_iter()
            .map(|e| v15::SignedExtensionMetadata {
                identifier: e.identifier,
                ty: e.ty,
                additional_signed: e.additional_signed,
            })
            .collect();
        let pallets = md
            .pallets
            .iter()
            .map(|p| {
                let parts = parts(p);
                v15::PalletMetadata {
                    name: p.name.clone(),
                    storage: parts.storage,
                    calls: parts.calls,
                    event: parts.event,
                    constants: parts.constants,
                    error: parts.error,
                    index: p.index,
                    docs: p.docs.clone(),
                }
            })
            .collect();
        let apis = md
            .apis
            .iter()
            .map(|a| v15::RuntimeApiMetadata {
                name: a.name.clone(),
                methods: a
                    .methods
                    .iter()
                    .map(|m| v15::RuntimeApiMethodMetadata {
                        name: m.name.clone(),
                        inputs: m
                            .inputs
                            .iter()
                            .map(|i| v15::RuntimeApiMethodParamMetadata {
                                name: i.name.clone(),
                                ty: i.ty,
                            })
                            .collect(),
                        output: m.output,
                        docs: m.docs.clone(),
                    })
                    .collect(),
                docs: a.docs.clone(),
            })
            .collect();
        v15::RuntimeMetadataV15 {
            pallets,
            extrinsic: v15::ExtrinsicMetadata {
                version: 4,
                address_ty: md.extrinsic.address_ty,
                call_ty: md.extrinsic.call_ty,
                signature_ty: md.extrinsic.signature_ty,
                extra_ty: extra.into(),
                signed_extensions,
            },
            ty: runtime.into(),
            apis,
            outer_enums: md.outer_enums,
            custom: md.custom,
            types: md.types,
        }
    }

    pub fn v14(md: RuntimeMetadataV16) -> v14::RuntimeMetadataV14 {
        let xt = find(&md.types, "UncheckedExtrinsic");
        debug_assert!(matches!(
            md.types.resolve(xt).map(|t| &t.type_def),
            Some(TypeDef::Composite(_))
        ));
        let runtime = find(&md.types, "Runtime");
        let pallets = md
            .pallets
            .iter()
            .map(|p| {
                let parts = parts(p);
                v14::PalletMetadata {
                    name: p.name.clone(),
                    storage: parts.storage,
                    calls: parts.calls,
                    event: parts.event,
                    constants: parts.constants,
                    error: parts.error,
                    index: p.index,
                }
            })
            .collect();
        v14::RuntimeMetadataV14 {
            pallets,
            extrinsic: v14::ExtrinsicMetadata {
                ty: xt.into(),
                version: 4,
                signed_extensions: extensions(&md),
            },
            ty: runtime.into(),
            types: md.types,
        }
    }
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

    #[test]
    fn v14_v15_and_v16_describe_the_same_runtime() {
        let v16 = subxt_metadata::Metadata::decode_from(metadata_bytes()).expect("v16");
        for version in [14, 15] {
            let bytes = metadata_bytes_at(version).expect("served");
            assert_eq!(&bytes[..4], b"meta");
            assert_eq!(bytes[4], version as u8, "version byte");
            let md = subxt_metadata::Metadata::decode_from(bytes).expect("decodes");
            for p in v16.pallets() {
                let q = md.pallet_by_name(p.name()).expect("same pallets");
                assert_eq!(p.call_index(), q.call_index());
                assert_eq!(p.hash(), q.hash(), "pallet {} in V{version}", p.name());
            }
            let ids = |m: &subxt_metadata::Metadata| {
                m.extrinsic()
                    .transaction_extensions_to_use_for_encoding()
                    .map(|e| e.identifier().to_string())
                    .collect::<Vec<_>>()
            };
            assert_eq!(ids(&md), ids(&v16), "V{version} transaction extensions");
            let names = |m: &subxt_metadata::Metadata| {
                m.runtime_api_traits()
                    .flat_map(|t| {
                        t.methods()
                            .map(move |x| (t.name().to_string(), x.name().to_string(), x.hash()))
                    })
                    .collect::<Vec<_>>()
            };
            if version == 15 {
                assert_eq!(
                    names(&md),
                    names(&v16),
                    "V15 declares the same runtime APIs"
                );
            }
        }
        assert!(metadata_bytes_at(13).is_none());
        let sub = v16
            .runtime_api_trait_by_name("SubnetInfoRuntimeApi")
            .expect("declared");
        assert!(sub.method_by_name("get_metagraph").is_some());
    }
}
