//! Property tests of the tensor wire format: whatever the bytes, `check_tensor` and the decoders
//! answer `Ok` or `Err` and never panic; valid encodings pass and round-trip; damaged ones
//! (truncated, flipped, re-declared with wrong or huge sizes) are refused or still decode to
//! exactly the slot's length.
//!
//! Cases per property: `PROPTEST_CASES`, default [`DEFAULT_CASES`]. Run with `--nocapture` to see
//! the count each property ran.

use iota_protocol::tensor::{
    MAX_PSEUDO_GRADIENT, TensorError, TensorSpec, WireEncoding, check_tensor, decode_merged,
    decode_partition, decode_sparse, encode_boundary_f32, encode_boundary_i4, encode_boundary_i8,
    encode_merged, encode_partition,
};
use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;
use proptest::test_runner::TestCaseError;
use safetensors::{Dtype, SafeTensors};

const DEFAULT_CASES: u32 = 1024;

fn config(name: &str) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES);
    eprintln!("{name}: {cases} cases");
    ProptestConfig {
        cases,
        // Shrunk failures are saved beside this file, to be committed as regressions.
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    }
}

/// A valid encoding and the slot it was made for.
#[derive(Clone, Debug)]
struct Valid {
    spec: TensorSpec,
    bytes: Vec<u8>,
}

fn finite() -> impl Strategy<Value = f32> {
    prop_oneof![
        -1e6f32..1e6f32,
        Just(0.0f32),
        Just(-0.0f32),
        Just(f32::MAX),
        Just(f32::MIN),
        Just(f32::MIN_POSITIVE),
    ]
}

fn shape3() -> impl Strategy<Value = [u64; 3]> {
    (1u64..4, 1u64..4, 1u64..5).prop_map(|(a, b, c)| [a, b, c])
}

/// A pseudo-gradient's values: finite, and within ±`MAX_PSEUDO_GRADIENT`.
fn pseudo_gradient_value() -> impl Strategy<Value = f32> {
    prop_oneof![
        -MAX_PSEUDO_GRADIENT..MAX_PSEUDO_GRADIENT,
        Just(0.0f32),
        Just(-0.0f32),
        Just(MAX_PSEUDO_GRADIENT),
        Just(-MAX_PSEUDO_GRADIENT),
        Just(f32::MIN_POSITIVE),
    ]
}

fn partition() -> impl Strategy<Value = (Vec<f32>, Valid)> {
    prop::collection::vec(pseudo_gradient_value(), 0..40).prop_map(|v| {
        let bytes = encode_partition(&v);
        let spec = TensorSpec::Partition {
            len: v.len() as u64,
        };
        (v, Valid { spec, bytes })
    })
}

fn merged() -> impl Strategy<Value = (Vec<f32>, Vec<f32>, Valid)> {
    (0usize..40)
        .prop_flat_map(|n| {
            (
                prop::collection::vec(finite(), n),
                prop::collection::vec(finite(), n),
            )
        })
        .prop_map(|(v, m)| {
            let bytes = encode_merged(&v, &m);
            let spec = TensorSpec::Merged {
                len: v.len() as u64,
            };
            (v, m, Valid { spec, bytes })
        })
}

fn boundary_f32() -> impl Strategy<Value = Valid> {
    shape3().prop_flat_map(|shape| {
        let n = shape.iter().product::<u64>() as usize;
        prop::collection::vec(finite(), n).prop_map(move |v| Valid {
            spec: TensorSpec::Boundary {
                shape,
                encoding: WireEncoding::F32,
            },
            bytes: encode_boundary_f32(shape, &v),
        })
    })
}

fn boundary_i8() -> impl Strategy<Value = Valid> {
    shape3().prop_flat_map(|shape| {
        let n = shape.iter().product::<u64>() as usize;
        let rows = (shape[0] * shape[1]) as usize;
        (
            prop::collection::vec(-127i8..=127, n),
            prop::collection::vec(0f32..1e3, rows),
        )
            .prop_map(move |(v, s)| Valid {
                spec: TensorSpec::Boundary {
                    shape,
                    encoding: WireEncoding::Int8,
                },
                bytes: encode_boundary_i8(shape, &v, &s),
            })
    })
}

/// bf16 bits of a finite non-negative scale (sign clear, exponent below all-ones).
fn bf16_scale() -> impl Strategy<Value = u16> {
    (0u16..0x7f80).prop_map(|b| b & 0x7fff)
}

fn boundary_i4() -> impl Strategy<Value = Valid> {
    shape3().prop_flat_map(|shape| {
        let n = shape.iter().product::<u64>() as usize;
        let rows = (shape[0] * shape[1]) as usize;
        (
            prop::collection::vec(-7i8..=7, n),
            prop::collection::vec(bf16_scale(), rows),
        )
            .prop_map(move |(v, s)| Valid {
                spec: TensorSpec::Boundary {
                    shape,
                    encoding: WireEncoding::Int4,
                },
                bytes: encode_boundary_i4(shape, &v, &s),
            })
    })
}

fn any_valid() -> impl Strategy<Value = Valid> {
    prop_oneof![
        partition().prop_map(|(_, v)| v),
        merged().prop_map(|(_, _, v)| v),
        boundary_f32(),
        boundary_i8(),
        boundary_i4(),
    ]
}

const ENCODINGS: [WireEncoding; 3] = [WireEncoding::F32, WireEncoding::Int8, WireEncoding::Int4];

/// Every slot kind, with dimensions from tiny to absurd (the arithmetic on them must not
/// overflow into a panic).
fn any_spec() -> impl Strategy<Value = TensorSpec> {
    let dim = prop_oneof![
        0u64..8,
        Just(u64::from(u32::MAX)),
        Just(u64::MAX / 2),
        Just(u64::MAX),
        any::<u64>(),
    ];
    prop_oneof![
        dim.clone().prop_map(|len| TensorSpec::Partition { len }),
        dim.clone().prop_map(|len| TensorSpec::Merged { len }),
        (
            [dim.clone(), dim.clone(), dim],
            prop_oneof![
                Just(WireEncoding::F32),
                Just(WireEncoding::Int8),
                Just(WireEncoding::Int4)
            ]
        )
            .prop_map(|(shape, encoding)| TensorSpec::Boundary { shape, encoding }),
    ]
}

/// One way to damage an encoding.
#[derive(Clone, Debug)]
enum Damage {
    /// Keep only the first `at` bytes (scaled to the length).
    Truncate(prop::sample::Index),
    /// XOR one byte with a non-zero mask.
    Flip(prop::sample::Index, u8),
    /// Overwrite the 8-byte header length.
    HeaderLen(u64),
    /// Insert bytes somewhere.
    Insert(prop::sample::Index, Vec<u8>),
    /// Append bytes (the payload is then longer than the header declares).
    Append(Vec<u8>),
    /// Rewrite one number in the JSON header (a shape dimension or a data offset).
    Number(prop::sample::Index, u64),
}

fn damage() -> impl Strategy<Value = Damage> {
    let big = prop_oneof![
        0u64..64,
        Just(u64::from(u32::MAX)),
        Just(i64::MAX as u64),
        Just(u64::MAX),
        any::<u64>(),
    ];
    prop_oneof![
        any::<prop::sample::Index>().prop_map(Damage::Truncate),
        (any::<prop::sample::Index>(), 1u8..=255).prop_map(|(i, m)| Damage::Flip(i, m)),
        big.clone().prop_map(Damage::HeaderLen),
        (
            any::<prop::sample::Index>(),
            prop::collection::vec(any::<u8>(), 1..16)
        )
            .prop_map(|(i, b)| Damage::Insert(i, b)),
        prop::collection::vec(any::<u8>(), 1..16).prop_map(Damage::Append),
        (any::<prop::sample::Index>(), big).prop_map(|(i, n)| Damage::Number(i, n)),
    ]
}

fn apply(bytes: &[u8], d: &Damage) -> Vec<u8> {
    let mut out = bytes.to_vec();
    match d {
        Damage::Truncate(i) => out.truncate(i.index(bytes.len().max(1))),
        Damage::Flip(i, m) => {
            if !out.is_empty() {
                let at = i.index(out.len());
                out[at] ^= m;
            }
        }
        Damage::HeaderLen(n) => {
            if out.len() >= 8 {
                out[..8].copy_from_slice(&n.to_le_bytes());
            }
        }
        Damage::Insert(i, b) => {
            let at = i.index(out.len() + 1);
            out.splice(at..at, b.iter().copied());
        }
        Damage::Append(b) => out.extend_from_slice(b),
        Damage::Number(i, n) => {
            // The header is ASCII JSON after the 8-byte length: replace the i-th run of digits.
            if out.len() < 8 {
                return out;
            }
            let header_len = out
                .get(..8)
                .map(|h| u64::from_le_bytes(h.try_into().unwrap_or([0; 8])) as usize)
                .unwrap_or(0)
                .min(out.len().saturating_sub(8));
            let header = &out[8..8 + header_len];
            let mut runs = Vec::new();
            let mut start = None;
            for (k, c) in header.iter().enumerate() {
                match (c.is_ascii_digit(), start) {
                    (true, None) => start = Some(k),
                    (false, Some(s)) => {
                        runs.push(s..k);
                        start = None;
                    }
                    _ => {}
                }
            }
            if !runs.is_empty() {
                let r = runs[i.index(runs.len())].clone();
                let text = n.to_string();
                let mut h = header.to_vec();
                h.splice(r, text.bytes());
                let mut rebuilt = (h.len() as u64).to_le_bytes().to_vec();
                rebuilt.extend_from_slice(&h);
                rebuilt.extend_from_slice(&out[8 + header_len..]);
                out = rebuilt;
            }
        }
    }
    out
}

/// An independent reading of a safetensors buffer, straight from the `safetensors` crate: the
/// `iota` metadata as JSON and every tensor's dtype, shape and bytes. The oracle the checks and
/// decoders are compared with.
struct Raw {
    meta: serde_json::Value,
    tensors: BTreeMap<String, (Dtype, Vec<u64>, Vec<u8>)>,
}

fn raw(bytes: &[u8]) -> Option<Raw> {
    let st = SafeTensors::deserialize(bytes).ok()?;
    let (_, header) = SafeTensors::read_metadata(bytes).ok()?;
    let meta = header.metadata().as_ref()?.get("iota")?;
    let meta = serde_json::from_str(meta).ok()?;
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let shape = t.shape().iter().map(|d| *d as u64).collect();
            (name, (t.dtype(), shape, t.data().to_vec()))
        })
        .collect();
    Some(Raw { meta, tensors })
}

fn f32s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The `[len]` F32 tensor `name` of `r`, finite, as values; `None` if it is anything else.
fn flat(r: &Raw, name: &str, len: u64) -> Option<Vec<f32>> {
    let (dtype, shape, data) = r.tensors.get(name)?;
    let v = f32s(data);
    (*dtype == Dtype::F32 && shape == &[len] && v.iter().all(|x| x.is_finite())).then_some(v)
}

/// Whether `r` is a valid boundary tensor for a slot of `shape` and `encoding`, judged from the
/// format's description (module docs of `iota_protocol::tensor`) rather than its code.
fn valid_boundary(r: &Raw, shape: [u64; 3], encoding: WireEncoding) -> bool {
    let named = match encoding {
        WireEncoding::F32 => "f32",
        WireEncoding::Int8 => "int8",
        WireEncoding::Int4 => "int4",
    };
    if r.meta.get("format").and_then(|f| f.as_str()) != Some("iota-boundary/v1")
        || r.meta.get("encoding").and_then(|e| e.as_str()) != Some(named)
        || shape.contains(&0)
    {
        return false;
    }
    let names: Vec<&str> = r.tensors.keys().map(String::as_str).collect();
    let Some((dtype, got, data)) = r.tensors.get("values") else {
        return false;
    };
    // An int4 tensor holds `ceil(width / 2)` bytes a row and names its width.
    let bytes_shape = match encoding {
        WireEncoding::Int4 => [shape[0], shape[1], shape[2].div_ceil(2)],
        _ => shape,
    };
    if got != &bytes_shape {
        return false;
    }
    match encoding {
        WireEncoding::F32 => {
            names == ["values"] && *dtype == Dtype::F32 && f32s(data).iter().all(|x| x.is_finite())
        }
        WireEncoding::Int8 => {
            names == ["scales", "values"]
                && *dtype == Dtype::I8
                && !data.contains(&0x80)
                && flat(r, "scales", shape[0].saturating_mul(shape[1]))
                    .is_some_and(|s| s.iter().all(|x| *x >= 0.0))
        }
        WireEncoding::Int4 => {
            let rows = shape[0].saturating_mul(shape[1]);
            let row_bytes = shape[2].div_ceil(2) as usize;
            // Nibbles in [-7, 7]; an odd row's last high nibble is padding, 0.
            let nibbles_ok = data.chunks_exact(row_bytes).all(|row| {
                (0..shape[2] as usize).all(|i| (row[i / 2] >> (4 * (i % 2))) & 0x0f != 0x08)
                    && (shape[2].is_multiple_of(2) || row[row_bytes - 1] >> 4 == 0)
            });
            let scales_ok = r.tensors.get("scales").is_some_and(|(dt, sh, d)| {
                *dt == Dtype::BF16
                    && sh == &[rows]
                    && d.chunks_exact(2).all(|b| {
                        let s = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                        s.is_finite() && s >= 0.0
                    })
            });
            names == ["scales", "values"]
                && *dtype == Dtype::U8
                && r.meta.get("width").and_then(|w| w.as_u64()) == Some(shape[2])
                && nibbles_ok
                && scales_ok
        }
    }
}

/// Whether a decoder refused for the reason the check gives. The kind, not the message:
/// `safetensors` names whichever bad tensor its hash map visits first.
fn same_refusal(e: &TensorError, checked: &Result<(), TensorError>) -> bool {
    checked
        .as_ref()
        .err()
        .is_some_and(|c| std::mem::discriminant(c) == std::mem::discriminant(e))
}

/// What any checked tensor promises, against the independent reading: `check_tensor` accepts
/// exactly what the format allows, a decoder refuses with the check's own error or returns
/// exactly the values the bytes hold.
fn decoders_agree(bytes: &[u8], spec: &TensorSpec) -> Result<(), TestCaseError> {
    let checked = check_tensor(bytes, spec);
    let r = raw(bytes);
    let fits = bytes.len() as u64 <= spec.max_bytes();
    // Every format's metadata is an object with a `format` string and, if any, a known encoding.
    let format = |want: &str| {
        r.as_ref().is_some_and(|r| {
            r.meta.get("format").and_then(|f| f.as_str()) == Some(want)
                && match r.meta.get("encoding") {
                    None | Some(serde_json::Value::Null) => true,
                    Some(e) => matches!(e.as_str(), Some("f32" | "int8" | "int4")),
                }
        })
    };
    match spec {
        // The sparse check is its decoder (`decode_sparse`), covered by its unit tests and by the
        // model's round trip.
        TensorSpec::Sparse(shape) => {
            prop_assert_eq!(checked.is_ok(), decode_sparse(bytes, *shape).is_ok());
        }
        TensorSpec::Partition { len } => {
            let want = r
                .as_ref()
                .filter(|r| fits && format("iota-partition/v1") && r.tensors.len() == 1)
                .and_then(|r| flat(r, "values", *len))
                .filter(|v| v.iter().all(|x| x.abs() <= MAX_PSEUDO_GRADIENT));
            prop_assert_eq!(checked.is_ok(), want.is_some(), "{:?}", checked);
            match decode_partition(bytes, *len) {
                Ok(v) => prop_assert_eq!(Some(v), want),
                Err(e) => prop_assert!(same_refusal(&e, &checked), "{e:?} / {checked:?}"),
            }
        }
        TensorSpec::Merged { len } => {
            let want = r
                .as_ref()
                .filter(|r| fits && format("iota-merged/v1") && r.tensors.len() == 2)
                .and_then(|r| Some((flat(r, "values", *len)?, flat(r, "momentum", *len)?)));
            prop_assert_eq!(checked.is_ok(), want.is_some(), "{:?}", checked);
            match decode_merged(bytes, *len) {
                Ok(d) => prop_assert_eq!(Some(d), want),
                Err(e) => prop_assert!(same_refusal(&e, &checked), "{e:?} / {checked:?}"),
            }
        }
        TensorSpec::Boundary { shape, encoding } => {
            let want = fits
                && format("iota-boundary/v1")
                && r.as_ref()
                    .is_some_and(|r| valid_boundary(r, *shape, *encoding));
            prop_assert_eq!(checked.is_ok(), want, "{:?}", checked);
        }
    }
    Ok(())
}

/// How the `iota` metadata of a generated boundary tensor is written.
#[derive(Clone, Copy, Debug, PartialEq)]
enum BoundaryMeta {
    /// As `iota-model` and the encoders write it.
    Proper,
    /// No `encoding` key (an old or hand-made writer).
    NoEncoding,
    /// `"encoding": null`.
    NullEncoding,
    /// The other encoding than the payload has.
    OtherEncoding,
    /// An unknown encoding name.
    UnknownEncoding,
    /// Upper case (`"F32"`).
    UpperCase,
    /// An extra key beside the proper ones.
    ExtraKey,
    /// Proper but for an int4 tensor's `width`, left out.
    NoWidth,
    /// Another format's name.
    OtherFormat,
    /// The entry is not JSON.
    NotJson,
    /// No `iota` entry at all.
    Missing,
}

fn boundary_meta() -> impl Strategy<Value = BoundaryMeta> {
    use BoundaryMeta::*;
    prop_oneof![
        Just(Proper),
        Just(NoEncoding),
        Just(NullEncoding),
        Just(OtherEncoding),
        Just(UnknownEncoding),
        Just(UpperCase),
        Just(ExtraKey),
        Just(NoWidth),
        Just(OtherFormat),
        Just(NotJson),
        Just(Missing),
    ]
}

/// A boundary tensor of `shape` with an `encoding` payload and metadata written as `how`.
fn odd_boundary(
    shape: [u64; 3],
    encoding: WireEncoding,
    values: &[f32],
    how: BoundaryMeta,
) -> Vec<u8> {
    use BoundaryMeta::*;
    let name = |e: WireEncoding| match e {
        WireEncoding::F32 => "f32",
        WireEncoding::Int8 => "int8",
        WireEncoding::Int4 => "int4",
    };
    let other = match encoding {
        WireEncoding::F32 => WireEncoding::Int8,
        WireEncoding::Int8 => WireEncoding::Int4,
        WireEncoding::Int4 => WireEncoding::F32,
    };
    let fmt = "iota-boundary/v1";
    // An int4 tensor's width goes with its metadata whatever else is done to it.
    let with_width = |mut v: serde_json::Value| {
        if encoding == WireEncoding::Int4
            && let Some(o) = v.as_object_mut()
        {
            o.insert("width".into(), shape[2].into());
        }
        v.to_string()
    };
    let meta = match how {
        Proper => Some(with_width(
            serde_json::json!({"format": fmt, "encoding": name(encoding)}),
        )),
        NoEncoding => Some(serde_json::json!({"format": fmt}).to_string()),
        NullEncoding => Some(serde_json::json!({"format": fmt, "encoding": null}).to_string()),
        OtherEncoding => {
            Some(serde_json::json!({"format": fmt, "encoding": name(other)}).to_string())
        }
        UnknownEncoding => Some(serde_json::json!({"format": fmt, "encoding": "bf16"}).to_string()),
        UpperCase => Some(
            serde_json::json!({"format": fmt, "encoding": name(encoding).to_uppercase()})
                .to_string(),
        ),
        NoWidth => Some(serde_json::json!({"format": fmt, "encoding": name(encoding)}).to_string()),
        ExtraKey => Some(with_width(
            serde_json::json!({"format": fmt, "encoding": name(encoding), "note": 1}),
        )),
        OtherFormat => Some(
            serde_json::json!({"format": "iota-partition/v1", "encoding": name(encoding)})
                .to_string(),
        ),
        NotJson => Some("{format: iota-boundary/v1".to_owned()),
        Missing => None,
    };
    let proper = match encoding {
        WireEncoding::F32 => encode_boundary_f32(shape, values),
        WireEncoding::Int8 => {
            let q: Vec<i8> = values
                .iter()
                .map(|v| v.clamp(-127.0, 127.0) as i8)
                .collect();
            let rows = (shape[0] * shape[1]) as usize;
            encode_boundary_i8(shape, &q, &vec![0.5; rows])
        }
        WireEncoding::Int4 => {
            let q: Vec<i8> = values.iter().map(|v| v.clamp(-7.0, 7.0) as i8).collect();
            let rows = (shape[0] * shape[1]) as usize;
            encode_boundary_i4(shape, &q, &vec![0x3f00; rows])
        }
    };
    // Same tensors, metadata replaced.
    let st = SafeTensors::deserialize(&proper).expect("own encoding");
    let tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = st.tensors();
    let info = meta.map(|m| std::collections::HashMap::from([("iota".to_owned(), m)]));
    safetensors::serialize(tensors, info).expect("serialise")
}

#[test]
fn boundary_metadata_is_checked_as_the_format_says() {
    // A boundary tensor without `encoding` passed the check as f32 while `iota-model`'s decoder
    // refused it, so every consumer (and a validator's replay) failed on a stored upload.
    proptest!(config("boundary_metadata_is_checked_as_the_format_says"), |(
        shape in shape3(),
        kind in 0usize..3,
        how in boundary_meta(),
        seed in any::<u64>(),
    )| {
        let encoding = ENCODINGS[kind];
        let n = shape.iter().product::<u64>() as usize;
        let values: Vec<f32> = (0..n).map(|i| ((seed as f32) + i as f32).sin() * 100.0).collect();
        let bytes = odd_boundary(shape, encoding, &values, how);
        let spec = TensorSpec::Boundary { shape, encoding };
        prop_assert_eq!(
            check_tensor(&bytes, &spec).is_ok(),
            how == BoundaryMeta::Proper
                || how == BoundaryMeta::ExtraKey
                || (how == BoundaryMeta::NoWidth && encoding != WireEncoding::Int4),
            "{:?}", how
        );
        for e in ENCODINGS {
            decoders_agree(&bytes, &TensorSpec::Boundary { shape, encoding: e })?;
            decoders_agree(&bytes, &TensorSpec::Boundary { shape: [shape[0], 0, shape[2]], encoding: e })?;
        }
        decoders_agree(&bytes, &TensorSpec::Partition { len: n as u64 })?;
    });
}

#[test]
fn arbitrary_bytes_never_panic() {
    proptest!(config("arbitrary_bytes_never_panic"), |(
        bytes in prop::collection::vec(any::<u8>(), 0..512),
        spec in any_spec(),
    )| {
        let _ = check_tensor(&bytes, &spec);
        let _ = spec.max_bytes();
        let _ = spec.dtype_and_shape();
        if let TensorSpec::Partition { len } | TensorSpec::Merged { len } = spec {
            let _ = decode_partition(&bytes, len);
            let _ = decode_merged(&bytes, len);
        }
    });
}

#[test]
fn header_prefixed_garbage_is_refused() {
    // A plausible 8-byte length followed by random bytes gets past the first check into the JSON
    // parser and the offset validation.
    proptest!(config("header_prefixed_garbage_is_refused"), |(
        declared in prop_oneof![0u64..600, any::<u64>()],
        rest in prop::collection::vec(any::<u8>(), 0..600),
        spec in any_spec(),
    )| {
        let mut bytes = declared.to_le_bytes().to_vec();
        bytes.extend_from_slice(&rest);
        let _ = check_tensor(&bytes, &spec);
    });
}

#[test]
fn crafted_headers_with_huge_sizes_are_refused() {
    // Syntactically valid headers that lie: shapes whose element count overflows, offsets past the
    // end, dtypes and names that do not belong. None may pass, none may panic.
    let dim = prop_oneof![
        0u64..5,
        Just(u64::from(u32::MAX)),
        Just(i64::MAX as u64),
        Just(u64::MAX),
    ];
    let dtype = prop_oneof![
        Just("F32"),
        Just("I8"),
        Just("F64"),
        Just("BOOL"),
        Just("U8"),
        Just("F4"),
        Just("nope")
    ];
    let name = prop_oneof![Just("values"), Just("scales"), Just("momentum"), Just("x")];
    let entry = (
        name,
        dtype,
        prop::collection::vec(dim.clone(), 0..4),
        (dim.clone(), dim),
    );
    proptest!(config("crafted_headers_with_huge_sizes_are_refused"), |(
        entries in prop::collection::vec(entry, 0..4),
        format in prop_oneof![
            Just("iota-partition/v1"),
            Just("iota-merged/v1"),
            Just("iota-boundary/v1"),
            Just("other"),
        ],
        payload in prop::collection::vec(any::<u8>(), 0..64),
        spec in any_spec(),
    )| {
        let mut header = serde_json::Map::new();
        header.insert(
            "__metadata__".into(),
            serde_json::json!({ "iota": serde_json::json!({ "format": format }).to_string() }),
        );
        for (name, dtype, shape, (s, e)) in &entries {
            header.insert(
                (*name).into(),
                serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [s, e] }),
            );
        }
        let text = serde_json::Value::Object(header).to_string();
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(text.as_bytes());
        bytes.extend_from_slice(&payload);
        // Anything that passes must be a real, consistent tensor, and whatever is refused is
        // refused for a reason the format gives.
        decoders_agree(&bytes, &spec)?;
    });
}

#[test]
fn valid_encodings_pass_and_round_trip() {
    proptest!(config("valid_encodings_pass_and_round_trip"), |(
        (pv, p) in partition(),
        (mv, mm, m) in merged(),
        b in boundary_f32(),
        q in boundary_i8(),
        h in boundary_i4(),
    )| {
        prop_assert_eq!(check_tensor(&p.bytes, &p.spec), Ok(()));
        let len = pv.len() as u64;
        prop_assert_eq!(decode_partition(&p.bytes, len), Ok(pv.clone()));
        prop_assert_eq!(encode_partition(&pv), p.bytes.clone(), "deterministic");
        prop_assert_eq!(check_tensor(&m.bytes, &m.spec), Ok(()));
        prop_assert_eq!(decode_merged(&m.bytes, mv.len() as u64), Ok((mv, mm)));
        prop_assert_eq!(check_tensor(&b.bytes, &b.spec), Ok(()));
        prop_assert_eq!(check_tensor(&q.bytes, &q.spec), Ok(()));
        prop_assert_eq!(check_tensor(&h.bytes, &h.spec), Ok(()));
        // A valid tensor of one kind is not accepted for a slot of another length.
        let longer = TensorSpec::Partition { len: len + 1 };
        prop_assert!(check_tensor(&p.bytes, &longer).is_err());
    });
}

#[test]
fn damaged_encodings_never_panic_and_never_decode_wrong() {
    proptest!(config("damaged_encodings_never_panic_and_never_decode_wrong"), |(
        v in any_valid(),
        damages in prop::collection::vec(damage(), 1..4),
    )| {
        let mut bytes = v.bytes.clone();
        for d in &damages {
            bytes = apply(&bytes, d);
        }
        // Against its own slot and against every other kind of slot of a similar size.
        decoders_agree(&bytes, &v.spec)?;
        for len in [0u64, 1, 3, 24] {
            decoders_agree(&bytes, &TensorSpec::Partition { len })?;
            decoders_agree(&bytes, &TensorSpec::Merged { len })?;
        }
        for encoding in ENCODINGS {
            decoders_agree(&bytes, &TensorSpec::Boundary { shape: [2, 3, 4], encoding })?;
        }
    });
}
