//! Runtime-upgrade guard: does the node still have every call and storage entry this client uses,
//! with the shape it was compiled for?
//!
//! The comparison uses subxt-metadata's structural hashes (names, argument/field types, hashers,
//! defaults), computed for the compiled-in metadata and for the node's. Indices are compared too:
//! a call that moved would encode to a different call.

use std::sync::OnceLock;

use subxt::metadata::Metadata;

use crate::api::COMPILED_METADATA;
use crate::error::ChainError;

/// Calls the client builds, by pallet.
pub const USED_CALLS: &[(&str, &[&str])] = &[
    ("Balances", &["transfer_allow_death", "transfer_keep_alive"]),
    (
        "SubtensorModule",
        &[
            "set_weights",
            "commit_weights",
            "reveal_weights",
            "commit_timelocked_weights",
            "burned_register",
            "serve_axon",
            "add_stake",
            "remove_stake",
            "register_network",
            "start_call",
        ],
    ),
    ("Sudo", &["sudo"]),
    (
        "AdminUtils",
        &[
            "sudo_set_serving_rate_limit",
            "sudo_set_weights_version_key",
            "sudo_set_weights_set_rate_limit",
            "sudo_set_immunity_period",
            "sudo_set_min_allowed_weights",
            "sudo_set_max_allowed_uids",
            "sudo_set_kappa",
            "sudo_set_activity_cutoff",
            "sudo_set_network_registration_allowed",
            "sudo_set_min_burn",
            "sudo_set_max_burn",
            "sudo_set_max_allowed_validators",
            "sudo_set_bonds_moving_average",
            "sudo_set_max_registrations_per_block",
            "sudo_set_network_rate_limit",
            "sudo_set_tempo",
            "sudo_set_network_min_lock_cost",
            "sudo_set_stake_threshold",
            "sudo_set_commit_reveal_weights_enabled",
            "sudo_set_commit_reveal_weights_interval",
            "sudo_set_yuma3_enabled",
            "sudo_set_commit_reveal_version",
        ],
    ),
];

/// Storage entries the client reads, by pallet.
pub const USED_STORAGE: &[(&str, &[&str])] = &[
    ("System", &["Account"]),
    ("Timestamp", &["Now"]),
    ("Drand", &["BeaconConfig", "LastStoredRound"]),
    (
        "SubtensorModule",
        &[
            "NetworksAdded",
            "SubnetworkN",
            "SubnetOwner",
            "SubnetOwnerHotkey",
            "FirstEmissionBlockNumber",
            "Tempo",
            "WeightsSetRateLimit",
            "ActivityCutoff",
            "WeightsVersionKey",
            "CommitRevealWeightsEnabled",
            "CommitRevealWeightsVersion",
            "RevealPeriodEpochs",
            "TimelockedWeightCommits",
            "Burn",
            "MaxAllowedUids",
            "MaxWeightsLimit",
            "MinAllowedWeights",
            "ImmunityPeriod",
            "MaxAllowedValidators",
            "NetworkRegistrationAllowed",
            "ServingRateLimit",
            "Keys",
            "Uids",
            "Axons",
            "Owner",
            "TotalHotkeyAlpha",
            "BlockAtRegistration",
            "LastUpdate",
            "Incentive",
            "Dividends",
            "Emission",
            "Consensus",
            "ValidatorTrust",
            "ValidatorPermit",
            "Active",
        ],
    ),
];

/// Events the client decodes into its compiled types, by pallet.
pub const USED_EVENTS: &[(&str, &[&str])] = &[
    ("Sudo", &["Sudid"]),
    ("SubtensorModule", &["NeuronRegistered", "NetworkAdded"]),
];

/// Runtime API methods the client calls (through subxt: the account nonce before signing, the
/// metadata at connect), by trait.
pub const USED_RUNTIME_APIS: &[(&str, &[&str])] = &[
    ("AccountNonceApi", &["account_nonce"]),
    ("Metadata", &["metadata_versions", "metadata_at_version"]),
];

/// Calls whose argument embeds the whole runtime call enum, so their hash depends on every pallet
/// of the runtime and never matches between runtimes. For these only presence, index and argument
/// names are compared; the inner call is checked on its own.
const OUTER_ENUM_CALLS: &[(&str, &str)] = &[("Sudo", "sudo")];

/// The metadata this client was built against.
///
/// # Errors
///
/// [`ChainError::Decode`] if the embedded file is corrupt (a build problem).
pub fn compiled_metadata() -> Result<&'static Metadata, ChainError> {
    static COMPILED: OnceLock<Result<Metadata, String>> = OnceLock::new();
    COMPILED
        .get_or_init(|| Metadata::decode_from(COMPILED_METADATA).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| ChainError::decode("compiled metadata", e))
}

/// One way the node's runtime differs from the compiled one, for an item the client uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Difference {
    /// What changed, naming the pallet and item.
    pub description: String,
    /// Whether the client can no longer use the item as built. A changed storage *default* is
    /// not breaking: absent values are decoded with the node's own default.
    pub breaking: bool,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.description)?;
        if !self.breaking {
            f.write_str(" (not breaking)")?;
        }
        Ok(())
    }
}

struct Diffs(Vec<Difference>);

impl Diffs {
    fn push(&mut self, description: String) {
        self.0.push(Difference {
            description,
            breaking: true,
        });
    }
}

/// Lists every difference between the compiled metadata and `node` for the items the client
/// uses; empty when the node has exactly the shapes the client was built for.
pub fn differences(compiled: &Metadata, node: &Metadata) -> Vec<Difference> {
    let mut out = Diffs(Vec::new());
    for (pallet, calls) in USED_CALLS {
        let (Some(ours), theirs) = (compiled.pallet_by_name(pallet), node.pallet_by_name(pallet))
        else {
            out.push(format!(
                "pallet {pallet} is missing from the compiled metadata"
            ));
            continue;
        };
        let Some(theirs) = theirs else {
            out.push(format!("pallet {pallet} is missing"));
            continue;
        };
        if ours.call_index() != theirs.call_index() {
            out.push(format!(
                "pallet {pallet} moved from index {} to {}",
                ours.call_index(),
                theirs.call_index()
            ));
        }
        for call in *calls {
            let ours_v = ours.call_variant_by_name(call);
            let Some(theirs_v) = theirs.call_variant_by_name(call) else {
                out.push(format!("call {pallet}.{call} is missing"));
                continue;
            };
            if let Some(v) = ours_v
                && v.index != theirs_v.index
            {
                out.push(format!(
                    "call {pallet}.{call} moved from index {} to {}",
                    v.index, theirs_v.index
                ));
            }
            if OUTER_ENUM_CALLS.contains(&(pallet, call)) {
                let names = |v: &scale_info::Variant<scale_info::form::PortableForm>| {
                    v.fields.iter().map(|f| f.name.clone()).collect::<Vec<_>>()
                };
                if ours_v.map(names) != Some(names(theirs_v)) {
                    out.push(format!("call {pallet}.{call} changed its arguments"));
                }
                continue;
            }
            if ours.call_hash(call) != theirs.call_hash(call) {
                let same_bytes = ours_v.is_some_and(|v| {
                    fields_encode_alike(compiled, &v.fields, node, &theirs_v.fields)
                });
                out.0.push(Difference {
                    description: match same_bytes {
                        true => format!(
                            "call {pallet}.{call} changed only type names (arguments: {}), \
                             encoded alike",
                            describe_fields(node, theirs_v)
                        ),
                        false => format!(
                            "call {pallet}.{call} changed shape (arguments: {})",
                            describe_fields(node, theirs_v)
                        ),
                    },
                    breaking: !same_bytes,
                });
            }
        }
    }
    for (pallet, entries) in USED_STORAGE {
        let (Some(ours), Some(theirs)) =
            (compiled.pallet_by_name(pallet), node.pallet_by_name(pallet))
        else {
            out.push(format!("pallet {pallet} (storage) is missing"));
            continue;
        };
        for entry in *entries {
            match (ours.storage_hash(entry), theirs.storage_hash(entry)) {
                (_, None) => out.push(format!("storage {pallet}.{entry} is missing")),
                (Some(a), Some(b)) if a == b => {}
                _ => {
                    let (what, breaking) = storage_change(compiled, &ours, node, &theirs, entry);
                    out.0.push(Difference {
                        description: format!("storage {pallet}.{entry} changed {what}"),
                        breaking,
                    });
                }
            }
        }
    }
    events(compiled, node, &mut out);
    runtime_apis(compiled, node, &mut out);
    out.0
}

/// Fields alike in name and type hash: the same item, not merely one encoded alike.
fn same_fields(
    md_a: &Metadata,
    a: &[scale_info::Field<scale_info::form::PortableForm>],
    md_b: &Metadata,
    b: &[scale_info::Field<scale_info::form::PortableForm>],
) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.name == y.name && md_a.type_hash(x.ty.id) == md_b.type_hash(y.ty.id))
}

fn events(compiled: &Metadata, node: &Metadata, out: &mut Diffs) {
    for (pallet, names) in USED_EVENTS {
        let (Some(ours), Some(theirs)) =
            (compiled.pallet_by_name(pallet), node.pallet_by_name(pallet))
        else {
            out.push(format!("pallet {pallet} (events) is missing"));
            continue;
        };
        let find = |p: &subxt::metadata::PalletMetadata<'_>, name: &str| {
            p.event_variants()
                .and_then(|vs| vs.iter().find(|v| v.name == name).cloned())
        };
        for name in *names {
            let (Some(a), Some(b)) = (find(&ours, name), find(&theirs, name)) else {
                out.push(format!("event {pallet}.{name} is missing"));
                continue;
            };
            if same_fields(compiled, &a.fields, node, &b.fields) {
                continue;
            }
            // Events are found by name and decoded field by field, so a moved index is not a
            // change; the fields' bytes are.
            let alike = fields_encode_alike(compiled, &a.fields, node, &b.fields);
            out.0.push(Difference {
                description: match alike {
                    true => format!(
                        "event {pallet}.{name} changed only type names (fields: {}), encoded alike",
                        describe_fields(node, &b)
                    ),
                    false => format!(
                        "event {pallet}.{name} changed shape (fields: {})",
                        describe_fields(node, &b)
                    ),
                },
                breaking: !alike,
            });
        }
    }
}

fn runtime_apis(compiled: &Metadata, node: &Metadata, out: &mut Diffs) {
    for (api, methods) in USED_RUNTIME_APIS {
        let (Some(ours), Some(theirs)) = (
            compiled.runtime_api_trait_by_name(api),
            node.runtime_api_trait_by_name(api),
        ) else {
            out.push(format!("runtime API {api} is missing"));
            continue;
        };
        for method in *methods {
            let (Some(a), Some(b)) = (ours.method_by_name(method), theirs.method_by_name(method))
            else {
                out.push(format!("runtime API {api}.{method} is missing"));
                continue;
            };
            if a.hash() == b.hash() {
                continue;
            }
            let inputs_alike = a.inputs().len() == b.inputs().len()
                && a.inputs()
                    .zip(b.inputs())
                    .all(|(x, y)| encode_alike(compiled, x.id, node, y.id));
            let alike = inputs_alike && encode_alike(compiled, a.output_ty(), node, b.output_ty());
            let signature = format!(
                "({}) -> {}",
                b.inputs()
                    .map(|i| format!("{}: {}", i.name, type_name(node, i.id, 0)))
                    .collect::<Vec<_>>()
                    .join(", "),
                type_name(node, b.output_ty(), 0)
            );
            out.0.push(Difference {
                description: match alike {
                    true => format!(
                        "runtime API {api}.{method} changed only type names {signature}, encoded alike"
                    ),
                    false => format!("runtime API {api}.{method} changed shape {signature}"),
                },
                breaking: !alike,
            });
        }
    }
}

/// Says what differs between two versions of a storage entry.
fn storage_change(
    ours_md: &Metadata,
    ours: &subxt::metadata::PalletMetadata<'_>,
    theirs_md: &Metadata,
    theirs: &subxt::metadata::PalletMetadata<'_>,
    entry: &str,
) -> (String, bool) {
    let find = |p: &subxt::metadata::PalletMetadata<'_>| {
        p.storage().and_then(|s| s.entry_by_name(entry)).cloned()
    };
    let (Some(a), Some(b)) = (find(ours), find(theirs)) else {
        return ("shape".to_owned(), true);
    };
    let keys = |md: &Metadata, e: &subxt::metadata::StorageEntryMetadata| {
        e.keys()
            .map(|k| format!("{:?}({})", k.hasher, type_name(md, k.key_id, 0)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut parts = Vec::new();
    let mut breaking = false;
    let (ka, kb) = (keys(ours_md, &a), keys(theirs_md, &b));
    if ka != kb {
        let keys_alike = a.keys().len() == b.keys().len()
            && a.keys().zip(b.keys()).all(|(x, y)| {
                x.hasher == y.hasher && encode_alike(ours_md, x.key_id, theirs_md, y.key_id)
            });
        match keys_alike {
            true => parts.push(format!(
                "key type names from [{ka}] to [{kb}], encoded alike"
            )),
            false => {
                parts.push(format!("keys from [{ka}] to [{kb}]"));
                breaking = true;
            }
        }
    }
    let (va, vb) = (
        type_name(ours_md, a.value_ty(), 0),
        type_name(theirs_md, b.value_ty(), 0),
    );
    if ours_md.type_hash(a.value_ty()) != theirs_md.type_hash(b.value_ty()) {
        match encode_alike(ours_md, a.value_ty(), theirs_md, b.value_ty()) {
            true => parts.push(format!("value type name from {va} to {vb}, encoded alike")),
            false => {
                parts.push(format!("value type from {va} to {vb}"));
                breaking = true;
            }
        }
    }
    if a.default_value() != b.default_value() {
        let hexed = |d: Option<&[u8]>| {
            d.map(|d| format!("0x{}", hex::encode(d)))
                .unwrap_or_else(|| "none".to_owned())
        };
        parts.push(format!(
            "default from {} to {}",
            hexed(a.default_value()),
            hexed(b.default_value())
        ));
    }
    if parts.is_empty() {
        // The hashes differ in a way none of the above shows: treat it as breaking.
        ("shape".to_owned(), true)
    } else {
        (parts.join("; "), breaking)
    }
}

/// Whether type `a` of `md_a` and type `b` of `md_b` have the same SCALE encoding: the same
/// bytes stand for the same values. The rule: a composite or tuple of one field is encoded as
/// that field (a newtype such as a netuid or a balance type), so it is compared through;
/// primitives must be equal; sequences, arrays, compacts and tuples compare their elements;
/// composites of several fields compare field by field, in order, by name where named; enums
/// must have the same variants (name and index) with fields alike; bit sequences, the same
/// store and order types. A recursive type is taken as alike where the comparison comes back
/// to a pair it is already comparing.
pub fn encode_alike(md_a: &Metadata, a: u32, md_b: &Metadata, b: u32) -> bool {
    Alike {
        a: md_a,
        b: md_b,
        comparing: Vec::new(),
    }
    .types(a, b)
}

/// [`encode_alike`] for two lists of fields (a call's arguments): the same count, names and
/// encodings, in order.
pub fn fields_encode_alike(
    md_a: &Metadata,
    a: &[scale_info::Field<scale_info::form::PortableForm>],
    md_b: &Metadata,
    b: &[scale_info::Field<scale_info::form::PortableForm>],
) -> bool {
    Alike {
        a: md_a,
        b: md_b,
        comparing: Vec::new(),
    }
    .fields(a, b)
}

struct Alike<'m> {
    a: &'m Metadata,
    b: &'m Metadata,
    /// Pairs being compared further up (for recursive types).
    comparing: Vec<(u32, u32)>,
}

impl Alike<'_> {
    /// The type a newtype wraps, through any number of wrappers.
    fn unwrap(md: &Metadata, mut id: u32) -> u32 {
        use scale_info::TypeDef;
        for _ in 0..32 {
            let Some(ty) = md.types().resolve(id) else {
                return id;
            };
            id = match &ty.type_def {
                TypeDef::Composite(c) if c.fields.len() == 1 => c.fields[0].ty.id,
                TypeDef::Tuple(t) if t.fields.len() == 1 => t.fields[0].id,
                _ => return id,
            };
        }
        id
    }

    fn types(&mut self, a: u32, b: u32) -> bool {
        use scale_info::TypeDef;
        let (a, b) = (Self::unwrap(self.a, a), Self::unwrap(self.b, b));
        if self.comparing.contains(&(a, b)) {
            return true;
        }
        let (Some(ta), Some(tb)) = (self.a.types().resolve(a), self.b.types().resolve(b)) else {
            return false;
        };
        self.comparing.push((a, b));
        let alike = match (&ta.type_def, &tb.type_def) {
            (TypeDef::Primitive(x), TypeDef::Primitive(y)) => x == y,
            (TypeDef::Sequence(x), TypeDef::Sequence(y)) => {
                self.types(x.type_param.id, y.type_param.id)
            }
            (TypeDef::Array(x), TypeDef::Array(y)) => {
                x.len == y.len && self.types(x.type_param.id, y.type_param.id)
            }
            (TypeDef::Compact(x), TypeDef::Compact(y)) => {
                self.types(x.type_param.id, y.type_param.id)
            }
            (TypeDef::Tuple(x), TypeDef::Tuple(y)) => {
                x.fields.len() == y.fields.len()
                    && x.fields
                        .iter()
                        .zip(&y.fields)
                        .all(|(p, q)| self.types(p.id, q.id))
            }
            (TypeDef::Composite(x), TypeDef::Composite(y)) => self.fields(&x.fields, &y.fields),
            (TypeDef::Variant(x), TypeDef::Variant(y)) => {
                x.variants.len() == y.variants.len()
                    && x.variants.iter().all(|v| {
                        y.variants.iter().any(|w| {
                            v.index == w.index
                                && v.name == w.name
                                && self.fields(&v.fields, &w.fields)
                        })
                    })
            }
            // The order types are empty structs: told apart by name (Lsb0, Msb0).
            (TypeDef::BitSequence(x), TypeDef::BitSequence(y)) => {
                self.types(x.bit_store_type.id, y.bit_store_type.id)
                    && type_name(self.a, x.bit_order_type.id, 0)
                        == type_name(self.b, y.bit_order_type.id, 0)
            }
            _ => false,
        };
        self.comparing.pop();
        alike
    }

    fn fields(
        &mut self,
        a: &[scale_info::Field<scale_info::form::PortableForm>],
        b: &[scale_info::Field<scale_info::form::PortableForm>],
    ) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| x.name == y.name && self.types(x.ty.id, y.ty.id))
    }
}

fn describe_fields(
    md: &Metadata,
    v: &scale_info::Variant<scale_info::form::PortableForm>,
) -> String {
    v.fields
        .iter()
        .map(|f| {
            format!(
                "{}: {}",
                f.name.as_deref().unwrap_or("_"),
                type_name(md, f.ty.id, 0)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A short Rust-like name for a type in `md`, for messages.
pub(crate) fn type_name(md: &Metadata, id: u32, depth: usize) -> String {
    use scale_info::TypeDef;
    let Some(ty) = md.types().resolve(id) else {
        return format!("#{id}");
    };
    if depth > 4 {
        return "…".to_owned();
    }
    match &ty.type_def {
        TypeDef::Primitive(p) => format!("{p:?}").to_ascii_lowercase(),
        TypeDef::Sequence(s) => format!("Vec<{}>", type_name(md, s.type_param.id, depth + 1)),
        TypeDef::Array(a) => format!("[{}; {}]", type_name(md, a.type_param.id, depth + 1), a.len),
        TypeDef::Compact(c) => format!("Compact<{}>", type_name(md, c.type_param.id, depth + 1)),
        TypeDef::Tuple(t) => format!(
            "({})",
            t.fields
                .iter()
                .map(|f| type_name(md, f.id, depth + 1))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        TypeDef::BitSequence(_) => "BitVec".to_owned(),
        TypeDef::Composite(_) | TypeDef::Variant(_) => ty
            .path
            .segments
            .last()
            .cloned()
            .unwrap_or_else(|| format!("#{id}")),
    }
}

/// Checks `node` against the compiled metadata.
///
/// # Errors
///
/// [`ChainError::ShapeMismatch`] naming every call or storage entry that changed in a breaking way
/// or is missing. Non-breaking differences are returned for logging.
pub fn check(node: &Metadata) -> Result<Vec<Difference>, ChainError> {
    let (breaking, notes): (Vec<_>, Vec<_>) = differences(compiled_metadata()?, node)
        .into_iter()
        .partition(|d| d.breaking);
    if breaking.is_empty() {
        Ok(notes)
    } else {
        Err(ChainError::ShapeMismatch(
            breaking.into_iter().map(|d| d.description).collect(),
        ))
    }
}
