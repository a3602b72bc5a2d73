//! Fidelity of the localnet's runtime interface to finney, measured with subxt-metadata's
//! structural hashes, and freshness of the committed `metadata/localnet.scale`.

use std::path::PathBuf;

use subxt_metadata::Metadata;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Real finney metadata lives in `../shared` beside the checkout; a user's clone may not have it,
/// but CI must: under `CI=true` a missing file fails the test instead of skipping it.
fn finney(spec: u32) -> Option<Metadata> {
    let path = workspace().join(format!("../shared/metadata/finney-runtime-{spec}.scale"));
    let Ok(bytes) = std::fs::read(&path) else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{} is missing: CI must measure fidelity against finney",
            path.display()
        );
        println!("SKIPPED: {} not found", path.display());
        return None;
    };
    Some(Metadata::decode_from(&bytes[..]).expect("finney metadata decodes"))
}

fn localnet() -> Metadata {
    Metadata::decode_from(iota_localnet::metadata::metadata_bytes())
        .expect("localnet metadata decodes")
}

/// Items whose types embed the runtime's outer enums (every pallet's events, or every call), so
/// they can only match a runtime with exactly finney's full set of pallets.
const KNOWN_EXCEPTIONS: &[(&str, &str, &str)] = &[
    ("storage", "System", "Events"),
    ("call", "Sudo", "sudo"),
    // Runtime APIs taking a whole extrinsic, whose type embeds the outer call enum.
    (
        "runtime api",
        "TaggedTransactionQueue",
        "validate_transaction",
    ),
    ("runtime api", "TransactionPaymentApi", "query_info"),
];

/// Structural hash of an event variant: its name and, order-insensitively, each field's name and
/// type hash (the same construction subxt-metadata uses for calls).
fn variant_hash(
    md: &Metadata,
    v: &scale_info::Variant<scale_info::form::PortableForm>,
) -> [u8; 32] {
    let mut fields = [0u8; 32];
    for f in &v.fields {
        let name = f
            .name
            .as_deref()
            .map(|n| sp_crypto_hashing::blake2_256(n.as_bytes()))
            .unwrap_or([0; 32]);
        let ty = md.type_hash(f.ty.id).expect("field type is registered");
        let h = sp_crypto_hashing::blake2_256(&[name, ty].concat());
        for (a, b) in fields.iter_mut().zip(h) {
            *a ^= b;
        }
    }
    sp_crypto_hashing::blake2_256(
        &[sp_crypto_hashing::blake2_256(v.name.as_bytes()), fields].concat(),
    )
}

#[derive(Default)]
struct Report {
    matched: usize,
    exceptions: usize,
    mismatches: Vec<String>,
    /// Items compared, by kind: (kind, matched, compared).
    counts: std::collections::BTreeMap<&'static str, (usize, usize)>,
}

impl Report {
    fn summary(&self) -> String {
        self.counts
            .iter()
            .map(|(kind, (ok, all))| format!("{kind}: {ok}/{all}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn compare(ours: &Metadata, theirs: &Metadata) -> Report {
    let mut r = Report::default();
    let mut check = |kind: &'static str, pallet: &str, item: &str, ok: bool, detail: String| {
        let count = r.counts.entry(kind).or_default();
        count.1 += 1;
        if KNOWN_EXCEPTIONS.contains(&(kind, pallet, item)) {
            r.exceptions += 1;
        } else if ok {
            count.0 += 1;
            r.matched += 1;
        } else {
            r.mismatches
                .push(format!("{kind} {pallet}.{item}: {detail}"));
        }
    };
    for p in ours.pallets() {
        let Some(f) = theirs.pallet_by_name(p.name()) else {
            check("pallet", p.name(), "", false, "absent from finney".into());
            continue;
        };
        check(
            "pallet",
            p.name(),
            "index",
            p.call_index() == f.call_index(),
            format!("{} vs {}", p.call_index(), f.call_index()),
        );
        for v in p.call_variants().unwrap_or_default() {
            let theirs_v = f.call_variant_by_name(&v.name);
            let same_index = theirs_v.map(|t| t.index) == Some(v.index);
            let same_shape =
                f.call_hash(&v.name).is_some() && p.call_hash(&v.name) == f.call_hash(&v.name);
            check(
                "call",
                p.name(),
                &v.name,
                same_index && same_shape,
                format!("index {same_index}, shape {same_shape}"),
            );
        }
        for v in p.event_variants().unwrap_or_default() {
            let t = f
                .event_variants()
                .unwrap_or_default()
                .iter()
                .find(|t| t.name == v.name);
            let ok = t.is_some_and(|t| {
                t.index == v.index && variant_hash(theirs, t) == variant_hash(ours, v)
            });
            check(
                "event",
                p.name(),
                &v.name,
                ok,
                "index or fields differ".into(),
            );
        }
        for e in p.storage().map(|s| s.entries()).unwrap_or_default() {
            let ok = f.storage_hash(e.name()).is_some()
                && p.storage_hash(e.name()) == f.storage_hash(e.name());
            check(
                "storage",
                p.name(),
                e.name(),
                ok,
                "hashers, key, value or default differ".into(),
            );
        }
        let (ours_err, theirs_err) = (
            p.error_variants().unwrap_or_default(),
            f.error_variants().unwrap_or_default(),
        );
        let same_errors = ours_err.len() == theirs_err.len()
            && ours_err
                .iter()
                .zip(theirs_err)
                .all(|(a, b)| a.name == b.name && a.index == b.index);
        check(
            "errors",
            p.name(),
            "all",
            same_errors,
            format!("{} vs {} variants", ours_err.len(), theirs_err.len()),
        );
        for c in p.constants() {
            let ok = f.constant_hash(c.name()).is_some()
                && p.constant_hash(c.name()) == f.constant_hash(c.name());
            check("constant", p.name(), c.name(), ok, "type differs".into());
        }
    }
    // Runtime APIs: the hash covers the trait and method names, each input's name and type,
    // and the output type, structurally.
    for api in ours.runtime_api_traits() {
        for m in api.methods() {
            let theirs_m = theirs
                .runtime_api_trait_by_name(api.name())
                .and_then(|t| t.method_by_name(m.name()));
            let ok = theirs_m.as_ref().is_some_and(|t| t.hash() == m.hash());
            check(
                "runtime api",
                api.name(),
                m.name(),
                ok,
                if theirs_m.is_some() {
                    "inputs or output differ".into()
                } else {
                    "absent from finney".into()
                },
            );
        }
    }
    let (ours_x, theirs_x) = (ours.extrinsic(), theirs.extrinsic());
    let ext = |md: &Metadata| -> Vec<(String, [u8; 32], [u8; 32])> {
        md.extrinsic()
            .transaction_extensions_to_use_for_encoding()
            .map(|e| {
                (
                    e.identifier().to_string(),
                    md.type_hash(e.extra_ty()).unwrap_or_default(),
                    md.type_hash(e.additional_ty()).unwrap_or_default(),
                )
            })
            .collect()
    };
    check(
        "extrinsic",
        "-",
        "transaction extensions",
        ext(ours) == ext(theirs) && ours_x.supported_versions() == theirs_x.supported_versions(),
        "extension list or types differ".into(),
    );
    r
}

#[test]
fn localnet_matches_finney_spec_393() {
    let Some(finney) = finney(393) else {
        println!(
            "SKIPPED: ../shared/metadata/finney-runtime-393.scale not found (only present beside the project's own checkout)"
        );
        return;
    };
    let r = compare(&localnet(), &finney);
    println!(
        "{}/{} implemented items match finney spec 393, {} known exceptions ({})",
        r.matched,
        r.matched + r.mismatches.len(),
        r.exceptions,
        r.summary()
    );
    for kind in [
        "call",
        "storage",
        "event",
        "errors",
        "constant",
        "runtime api",
    ] {
        assert!(
            r.counts.get(kind).is_some_and(|(ok, _)| *ok > 0),
            "no {kind} was compared"
        );
    }
    assert!(
        r.mismatches.is_empty(),
        "mismatches:\n{}",
        r.mismatches.join("\n")
    );
    assert!(
        r.matched > 100,
        "the comparison covered the implemented items"
    );
}

#[test]
fn drift_against_finney_spec_365_is_shape_only() {
    // Spec 365 predates items the localnet mirrors from 393, so shapes may differ; indices of
    // pallets and of the calls both specs have must not (clients hard-code those).
    let Some(finney) = finney(365) else {
        return;
    };
    let ours = localnet();
    let r = compare(&ours, &finney);
    println!(
        "{}/{} implemented items match finney spec 365, {} known exceptions ({}); differing: {:?}",
        r.matched,
        r.matched + r.mismatches.len(),
        r.exceptions,
        r.summary(),
        r.mismatches
    );
    let mut calls_compared = 0;
    for p in ours.pallets() {
        let f = finney
            .pallet_by_name(p.name())
            .expect("pallet exists in spec 365");
        assert_eq!(p.call_index(), f.call_index(), "pallet {} index", p.name());
        for v in p.call_variants().unwrap_or_default() {
            if let Some(t) = f.call_variant_by_name(&v.name) {
                assert_eq!(t.index, v.index, "{}.{} call index", p.name(), v.name);
                calls_compared += 1;
            }
        }
    }
    assert!(calls_compared > 30, "compared {calls_compared} calls");
    assert!(
        r.matched > 100,
        "most items still match spec 365: {}",
        r.matched
    );
}

/// `IOTA_BLESS=1` rewrites the committed file (the same as `iota localnet metadata`).
#[test]
fn committed_metadata_is_fresh() {
    let path = workspace().join(iota_localnet::metadata::COMMITTED_PATH);
    if std::env::var_os("IOTA_BLESS").is_some() {
        std::fs::write(&path, iota_localnet::metadata::metadata_bytes()).expect("write metadata");
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == iota_localnet::metadata::metadata_bytes(),
        "{} is stale or missing: regenerate it with `cargo run -p iota-cli -- localnet metadata` or `IOTA_BLESS=1 cargo test -p iota-localnet --test integration metadata_fidelity`",
        path.display()
    );
}
