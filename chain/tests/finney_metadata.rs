//! The client against real finney runtime metadata (specs 365 and 393, and a spec-438 runtime's,
//! kept beside the checkout in `../shared/metadata/`): every call it builds encodes for finney and
//! decodes back to the same values, and the runtime shape check passes or names exactly what
//! differs, telling changes of type names only (encoded alike) from changes of the bytes.

use iota_chain::calls::{self, AxonEndpoint, Call, Hyperparam};
use iota_chain::client::{decode_call, encode_call};
use iota_chain::shape;
use iota_chain::wallet::PublicKey;
use subxt::metadata::Metadata;

fn finney(spec: u32) -> Option<Metadata> {
    let path = match spec {
        365 => concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shared/metadata/finney-runtime-365.scale"
        ),
        438 => concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shared/metadata/finney-like-runtime-438-v15.scale"
        ),
        _ => concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shared/metadata/finney-runtime-393.scale"
        ),
    };
    match std::fs::read(path) {
        Ok(bytes) => Some(Metadata::decode_from(&bytes[..]).expect("finney metadata decodes")),
        Err(e) => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "finney spec {spec} metadata missing at {path} ({e}): CI must check against it"
            );
            println!(
                "SKIPPED: finney spec {spec} metadata not found at {path} ({e}); it lives beside the project's own checkout"
            );
            None
        }
    }
}

/// One of every call the client builds, with non-trivial values.
fn sample_calls() -> Vec<Call> {
    let hot = PublicKey::from_bytes([0x11; 32]);
    let dest = PublicKey::from_bytes([0x22; 32]);
    let mut out = vec![
        calls::set_weights(7, vec![0, 3, 9], vec![65535, 100, 1], 1_002_003),
        calls::commit_weights(7, [0xab; 32]),
        calls::reveal_weights(
            7,
            vec![1, 2],
            vec![3, 65535],
            vec![9, 8, 7, 6, 5, 4, 3, 2],
            42,
        ),
        calls::commit_timelocked_weights(7, vec![0x5a; 300], 25_000_000, 4),
        calls::burned_register(7, &hot),
        calls::serve_axon(
            7,
            &AxonEndpoint::new("192.168.1.20".parse().expect("ip"), 8091),
        ),
        calls::serve_axon(
            7,
            &AxonEndpoint {
                ip: "2001:db8::1".parse().expect("ip"),
                port: 443,
                version: 10_002_000,
                protocol: 4,
            },
        ),
        calls::add_stake(&hot, 7, 123_456_789),
        calls::remove_stake(&hot, 7, 5),
        calls::register_network(&hot),
        calls::start_call(7),
        calls::transfer(&dest, 1_000_000_001, true),
        calls::transfer(&dest, 2, false),
    ];
    for name in Hyperparam::NAMES {
        let value = if name.contains("enabled")
            || name.contains("allowed") && !name.contains("weights") && !name.contains("uids")
        {
            "true"
        } else {
            "12"
        };
        let setting = Hyperparam::parse(name, value).expect("known setting");
        out.push(setting.call(7));
        out.push(calls::sudo(setting.call(7)));
    }
    out
}

struct RoundTrip {
    ok: usize,
    failures: Vec<String>,
}

fn round_trip_all(md: &Metadata) -> RoundTrip {
    let compiled = shape::compiled_metadata().expect("compiled metadata");
    let mut r = RoundTrip {
        ok: 0,
        failures: vec![],
    };
    for call in sample_calls() {
        let what = calls::describe(&call);
        let bytes = match encode_call(md, &call) {
            Ok(b) => b,
            Err(e) => {
                r.failures.push(format!("{what}: does not encode: {e}"));
                continue;
            }
        };
        match decode_call(md, &bytes) {
            Ok(back) if back == call => {}
            Ok(back) => {
                r.failures.push(format!("{what}: decodes to {back:?}"));
                continue;
            }
            Err(e) => {
                r.failures.push(format!("{what}: does not decode: {e}"));
                continue;
            }
        }
        // The same bytes the compiled (localnet) metadata produces: indices and layout agree.
        let ours = encode_call(compiled, &call).expect("encodes for the compiled metadata");
        if ours != bytes {
            r.failures.push(format!(
                "{what}: encodes differently (finney 0x{}, compiled 0x{})",
                hex::encode(&bytes),
                hex::encode(&ours)
            ));
            continue;
        }
        r.ok += 1;
    }
    r
}

#[test]
fn every_call_round_trips_through_finney_393() {
    let Some(md) = finney(393) else { return };
    let r = round_trip_all(&md);
    println!("spec 393: {} calls encode and decode back unchanged", r.ok);
    assert!(r.failures.is_empty(), "{}", r.failures.join("\n"));
    assert_eq!(r.ok, sample_calls().len());
}

#[test]
fn shape_check_passes_for_finney_393() {
    let Some(md) = finney(393) else { return };
    let diffs = shape::differences(shape::compiled_metadata().expect("compiled"), &md);
    println!("spec 393 shape differences: {diffs:?}");
    assert!(diffs.is_empty(), "{diffs:?}");
    assert!(shape::check(&md).expect("compatible").is_empty());
}

/// The shape check's differences between the compiled metadata and finney spec `spec`'s, and
/// the sample calls' round trips through it, both printed. Checked for any runtime: every call
/// round-trips unless the check names its item as changed in a breaking way, and no item it
/// calls encoded alike fails a round trip.
fn compare(spec: u32, md: &Metadata) -> (Vec<shape::Difference>, RoundTrip) {
    let diffs = shape::differences(shape::compiled_metadata().expect("compiled"), md);
    let breaking: Vec<_> = diffs.iter().filter(|d| d.breaking).collect();
    println!(
        "spec {spec} shape differences ({}, {} breaking):",
        diffs.len(),
        breaking.len()
    );
    for d in &diffs {
        println!("  {d}");
    }
    let r = round_trip_all(md);
    println!(
        "spec {spec}: {} calls round-trip; failures ({}):",
        r.ok,
        r.failures.len()
    );
    for f in &r.failures {
        println!("  {f}");
    }
    let item = |d: &shape::Difference| {
        d.description
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_owned()
    };
    for f in &r.failures {
        assert!(
            breaking.iter().any(|d| f.contains(&item(d))),
            "round-trip failure not named by the shape check: {f}"
        );
    }
    for d in diffs.iter().filter(|d| !d.breaking) {
        assert!(
            !r.failures.iter().any(|f| f.contains(&item(d))),
            "{d}, yet a call of it failed: {:?}",
            r.failures
        );
    }
    (diffs, r)
}

#[test]
fn finney_365_differences_are_named() {
    let Some(md) = finney(365) else { return };
    let (diffs, _) = compare(365, &md);
    let breaking: Vec<_> = diffs.iter().filter(|d| d.breaking).collect();
    match shape::check(&md) {
        Ok(notes) => {
            assert!(breaking.is_empty());
            assert_eq!(notes, diffs);
        }
        Err(iota_chain::ChainError::ShapeMismatch(listed)) => {
            let message = iota_chain::ChainError::ShapeMismatch(listed.clone()).to_string();
            assert_eq!(listed.len(), breaking.len());
            for d in &breaking {
                assert!(message.contains(&d.description), "the error names {d}");
            }
        }
        Err(other) => panic!("unexpected error {other}"),
    }
    // What spec 365 is known to differ in (measured): only a storage default, which the client
    // reads from the node's own metadata, so the connect-time check passes.
    assert_eq!(
        diffs.iter().map(ToString::to_string).collect::<Vec<_>>(),
        vec![
            "storage SubtensorModule.MaxAllowedUids changed default from 0x0001 to 0x0010 (not breaking)"
                .to_owned()
        ]
    );
}

/// The spec-438 runtime: what differs from the compiled metadata for the items the client uses,
/// which of it changes the bytes, and which calls still encode and decode the same values.
#[test]
fn finney_438_differences_are_named() {
    let Some(md) = finney(438) else { return };
    let (diffs, r) = compare(438, &md);
    let breaking: Vec<_> = diffs.iter().filter(|d| d.breaking).collect();
    // Measured: every difference is a newtype in place of what it wraps (NetUid for u16,
    // TaoBalance and AlphaBalance for u64, PerU16 for u16), so the client connects and every
    // call it builds round-trips.
    assert!(breaking.is_empty(), "{breaking:?}");
    // Events and runtime APIs are compared too: the two events the client decodes by subnet
    // take a `NetUid`; the runtime APIs it calls are unchanged.
    let named = |prefix: &str| -> Vec<&str> {
        diffs
            .iter()
            .filter(|d| d.description.starts_with(prefix))
            .map(|d| d.description.as_str())
            .collect()
    };
    assert_eq!(named("event ").len(), 2, "{:?}", named("event "));
    assert!(named("event ").iter().all(|d| d.contains("encoded alike")));
    assert!(
        named("runtime API ").is_empty(),
        "{:?}",
        named("runtime API ")
    );
    assert!(!diffs.is_empty(), "spec 438 names its types as 393 did");
    assert!(shape::check(&md).is_ok());
    assert_eq!(r.ok, sample_calls().len());
}

/// The rule that tells a change of type names from a change of bytes, on real types: finney's
/// `set_weights` takes its netuid as a newtype of `u16` (`NetUid`) where the compiled metadata
/// has a plain `u16`; both encode alike, and neither encodes as the `u64` version key.
#[test]
fn a_newtype_encodes_as_what_it_wraps() {
    let Some(md) = finney(438) else { return };
    let compiled = shape::compiled_metadata().expect("compiled");
    let arg = |md: &Metadata, name: &str| -> u32 {
        let pallet = md.pallet_by_name("SubtensorModule").expect("pallet");
        let call = pallet.call_variant_by_name("set_weights").expect("call");
        call.fields
            .iter()
            .find(|f| f.name.as_deref() == Some(name))
            .expect("argument")
            .ty
            .id
    };
    let (ours, theirs) = (arg(compiled, "netuid"), arg(&md, "netuid"));
    println!(
        "netuid: {} here, {} in spec 438",
        compiled
            .types()
            .resolve(ours)
            .map(|t| format!("{:?}", t.path))
            .unwrap_or_default(),
        md.types()
            .resolve(theirs)
            .map(|t| format!("{:?}", t.path))
            .unwrap_or_default()
    );
    assert!(shape::encode_alike(compiled, ours, &md, theirs));
    assert!(shape::encode_alike(&md, theirs, compiled, ours));
    assert!(!shape::encode_alike(
        compiled,
        ours,
        &md,
        arg(&md, "version_key")
    ));
    assert!(!shape::encode_alike(
        compiled,
        arg(compiled, "dests"),
        &md,
        theirs
    ));
}

#[test]
fn a_changed_runtime_is_refused_with_names() {
    // The compiled metadata against itself passes; against a runtime missing pallets it names them.
    let compiled = shape::compiled_metadata().expect("compiled");
    assert!(shape::differences(compiled, compiled).is_empty());
    let Some(md) = finney(393) else { return };
    // Finney compared the other way round (finney as "compiled") still has everything we use.
    assert!(shape::differences(&md, compiled).is_empty());
}

/// An "upgraded" runtime made from the compiled metadata: `set_weights.version_key` becomes a
/// `u16`, `Axons` disappears, `NeuronRegistered`'s uid becomes a `u64` and `AccountNonceApi` is
/// gone. The check must name all four and refuse.
#[test]
fn breaking_changes_are_named() {
    use frame_metadata::{RuntimeMetadata, RuntimeMetadataPrefixed};
    use parity_scale_codec::{Decode, Encode};

    let mut bytes = iota_chain::api::COMPILED_METADATA;
    let mut prefixed =
        RuntimeMetadataPrefixed::decode(&mut bytes).expect("compiled metadata decodes");
    let RuntimeMetadata::V16(md) = &mut prefixed.1 else {
        panic!("localnet metadata is V16");
    };
    let pallet = md
        .pallets
        .iter_mut()
        .find(|p| p.name == "SubtensorModule")
        .expect("pallet");
    let call_ty = pallet.calls.as_ref().expect("calls").ty.id;
    let event_ty = pallet.event.as_ref().expect("events").ty.id;
    pallet
        .storage
        .as_mut()
        .expect("storage")
        .entries
        .retain(|e| e.name != "Axons");
    let u16_id = primitive_id(md, scale_info::TypeDefPrimitive::U16);
    let u64_id = primitive_id(md, scale_info::TypeDefPrimitive::U64);
    let set_weights = variant_mut(md, call_ty, "set_weights");
    let field = set_weights
        .fields
        .iter_mut()
        .find(|f| f.name.as_deref() == Some("version_key"))
        .expect("version_key");
    field.ty = u16_id.into();
    variant_mut(md, event_ty, "NeuronRegistered").fields[1].ty = u64_id.into();
    md.apis.retain(|api| api.name != "AccountNonceApi");

    let upgraded = Metadata::decode_from(&prefixed.encode()[..]).expect("upgraded metadata");
    let err = shape::check(&upgraded).expect_err("breaking changes refuse");
    let iota_chain::ChainError::ShapeMismatch(listed) = &err else {
        panic!("{err}");
    };
    assert_eq!(
        listed,
        &vec![
            "call SubtensorModule.set_weights changed shape (arguments: netuid: u16, dests: Vec<u16>, weights: Vec<u16>, version_key: u16)".to_owned(),
            "storage SubtensorModule.Axons is missing".to_owned(),
            "event SubtensorModule.NeuronRegistered changed shape (fields: _: u16, _: u64, _: AccountId32)".to_owned(),
            "runtime API AccountNonceApi is missing".to_owned(),
        ]
    );
    println!("{err}");
    // And the call no longer encodes the same way for that runtime: the dry-run path says so
    // rather than sending wrong bytes.
    let call = calls::set_weights(1, vec![0], vec![1], 70_000);
    assert!(encode_call(&upgraded, &call).is_err());
}

/// The id of `primitive` in `md`'s type registry.
fn primitive_id(
    md: &frame_metadata::v16::RuntimeMetadataV16,
    primitive: scale_info::TypeDefPrimitive,
) -> u32 {
    md.types
        .types
        .iter()
        .find(|t| t.ty.type_def == scale_info::TypeDef::Primitive(primitive.clone()))
        .unwrap_or_else(|| panic!("{primitive:?} registered"))
        .id
}

/// Variant `name` of the enum type `enum_ty` in `md`, to change.
fn variant_mut<'a>(
    md: &'a mut frame_metadata::v16::RuntimeMetadataV16,
    enum_ty: u32,
    name: &str,
) -> &'a mut scale_info::Variant<scale_info::form::PortableForm> {
    let ty = md
        .types
        .types
        .iter_mut()
        .find(|t| t.id == enum_ty)
        .expect("enum type");
    let scale_info::TypeDef::Variant(variants) = &mut ty.ty.type_def else {
        panic!("type {enum_ty} is not an enum");
    };
    variants
        .variants
        .iter_mut()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("variant {name}"))
}

#[test]
fn finney_and_the_localnet_default_to_timelocked_commits() {
    use iota_chain::set_weights::{
        FIRST_TIMELOCKED_COMMIT_REVEAL_VERSION, commit_reveal_version_item,
    };
    let localnet = Metadata::decode_from(iota_localnet_metadata()).expect("localnet metadata");
    let (_, default) = commit_reveal_version_item(&localnet).expect("the localnet declares it");
    assert_eq!(default, Some(4));
    let Some(finney) = finney(393) else { return };
    let (_, default) = commit_reveal_version_item(&finney).expect("spec 393 declares the version");
    assert!(
        default.is_some_and(|v| v >= FIRST_TIMELOCKED_COMMIT_REVEAL_VERSION),
        "{default:?}"
    );
}

fn iota_localnet_metadata() -> &'static [u8] {
    include_bytes!("../../metadata/localnet.scale")
}
