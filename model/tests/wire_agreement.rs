//! The orchestrator accepts a boundary tensor with `iota_protocol::tensor::check_tensor`; every
//! consumer (the next stage's miner, a validator's replay) decodes it with
//! [`BoundaryTensor::from_bytes`]. If the check accepted something the decoder refuses, a stored
//! upload would fail every consumer instead of its producer's upload (a boundary tensor without
//! an `encoding` once did). These properties hold the two to one rule over generated tensors:
//! valid ones from either side's encoder, ones with odd metadata, damaged and crafted ones.
//!
//! Cases per property: `PROPTEST_CASES`, default [`DEFAULT_CASES`].

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::HashMap;

use iota_model::{BoundaryTensor, Payload, WireEncoding};
use iota_protocol::tensor::{
    TensorSpec, WireEncoding as Wire, check_tensor, encode_boundary_f32, encode_boundary_i8,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use safetensors::SafeTensors;

const DEFAULT_CASES: u32 = 512;

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn wire(e: WireEncoding) -> Wire {
    match e {
        WireEncoding::F32 => Wire::F32,
        WireEncoding::Int8 => Wire::Int8,
        WireEncoding::Int4 => Wire::Int4,
    }
}

fn shape3() -> impl Strategy<Value = [u64; 3]> {
    (1u64..4, 1u64..4, 1u64..5).prop_map(|(a, b, c)| [a, b, c])
}

fn usize_shape(s: [u64; 3]) -> [usize; 3] {
    s.map(|d| d as usize)
}

/// The rule, for `bytes` against the slot `[shape, encoding]` of a run: what the check accepts,
/// the decoder accepts with the slot's shape, as the slot's encoding, and every value finite.
fn agree(bytes: &[u8], shape: [u64; 3], encoding: Wire) -> Result<bool, TestCaseError> {
    let spec = TensorSpec::Boundary { shape, encoding };
    let checked = check_tensor(bytes, &spec);
    if checked.is_err() {
        return Ok(false);
    }
    let decoded = BoundaryTensor::from_bytes(bytes, Some(&usize_shape(shape)));
    prop_assert!(
        decoded.is_ok(),
        "check_tensor accepts, from_bytes refuses: {:?}",
        decoded.err()
    );
    let t = decoded.unwrap();
    prop_assert_eq!(wire(t.encoding()), encoding);
    prop_assert_eq!(t.shape(), &usize_shape(shape)[..]);
    prop_assert!(t.to_f32().iter().all(|v| v.is_finite()));
    Ok(true)
}

/// Both slots a tensor of `shape` could be checked against.
fn agree_any(bytes: &[u8], shape: [u64; 3]) -> Result<(), TestCaseError> {
    for e in [Wire::F32, Wire::Int8, Wire::Int4] {
        agree(bytes, shape, e)?;
    }
    Ok(())
}

/// How the `iota` metadata of a tensor is rewritten.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Meta {
    Keep,
    NoEncoding,
    NullEncoding,
    OtherEncoding,
    UnknownEncoding,
    UpperCase,
    NumberEncoding,
    ExtraKey,
    OtherFormat,
    NoFormat,
    NotAnObject,
    NotJson,
    Missing,
}

fn meta() -> impl Strategy<Value = Meta> {
    use Meta::*;
    prop_oneof![
        Just(Keep),
        Just(NoEncoding),
        Just(NullEncoding),
        Just(OtherEncoding),
        Just(UnknownEncoding),
        Just(UpperCase),
        Just(NumberEncoding),
        Just(ExtraKey),
        Just(OtherFormat),
        Just(NoFormat),
        Just(NotAnObject),
        Just(NotJson),
        Just(Missing),
    ]
}

/// `bytes` with its tensors kept and its metadata rewritten as `how` (an int4 tensor's width,
/// where its metadata had one, kept wherever the encoding is).
fn rewrite(bytes: &[u8], encoding: Wire, how: Meta) -> Vec<u8> {
    let (name, other) = match encoding {
        Wire::F32 => ("f32", "int8"),
        Wire::Int8 => ("int8", "int4"),
        Wire::Int4 => ("int4", "int8"),
    };
    let f = "iota-boundary/v1";
    let width = SafeTensors::read_metadata(bytes)
        .ok()
        .and_then(|(_, m)| m.metadata().as_ref()?.get("iota").cloned())
        .and_then(|m| serde_json::from_str::<serde_json::Value>(&m).ok())
        .and_then(|m| m.get("width").cloned());
    let json = |mut v: serde_json::Value| {
        if let (Some(w), Some(o)) = (&width, v.as_object_mut())
            && o.contains_key("encoding")
        {
            o.insert("width".into(), w.clone());
        }
        Some(v.to_string())
    };
    let meta = match how {
        Meta::Keep => json(serde_json::json!({"format": f, "encoding": name})),
        Meta::NoEncoding => json(serde_json::json!({"format": f})),
        Meta::NullEncoding => json(serde_json::json!({"format": f, "encoding": null})),
        Meta::OtherEncoding => json(serde_json::json!({"format": f, "encoding": other})),
        Meta::UnknownEncoding => json(serde_json::json!({"format": f, "encoding": "fp8"})),
        Meta::UpperCase => json(serde_json::json!({"format": f, "encoding": name.to_uppercase()})),
        Meta::NumberEncoding => json(serde_json::json!({"format": f, "encoding": 1})),
        Meta::ExtraKey => json(serde_json::json!({"format": f, "encoding": name, "v": [1]})),
        Meta::OtherFormat => {
            json(serde_json::json!({"format": "iota-partition/v1", "encoding": name}))
        }
        Meta::NoFormat => json(serde_json::json!({"encoding": name})),
        Meta::NotAnObject => json(serde_json::json!([f, name])),
        Meta::NotJson => Some(format!("format={f}")),
        Meta::Missing => None,
    };
    let st = SafeTensors::deserialize(bytes).unwrap();
    let info = meta.map(|m| HashMap::from([("iota".to_owned(), m)]));
    safetensors::serialize(st.tensors(), info).unwrap()
}

/// A valid boundary tensor of `shape` and `encoding` from one of the two encoders (int4 from the
/// model's only), with its values as the decoder should return them.
fn valid() -> impl Strategy<Value = ([u64; 3], Wire, Vec<u8>, Vec<f32>)> {
    (shape3(), 0u8..3, any::<bool>()).prop_flat_map(|(shape, kind, from_model)| {
        let int8 = kind == 1;
        let n = shape.iter().product::<u64>() as usize;
        let rows = (shape[0] * shape[1]) as usize;
        (
            prop::collection::vec(-1e4f32..1e4, n),
            prop::collection::vec(-127i8..=127, n),
            prop::collection::vec(0f32..10.0, rows),
        )
            .prop_map(move |(v, q, s)| {
                let (encoding, e) = match kind {
                    0 => (Wire::F32, WireEncoding::F32),
                    1 => (Wire::Int8, WireEncoding::Int8),
                    _ => (Wire::Int4, WireEncoding::Int4),
                };
                if from_model || e == WireEncoding::Int4 {
                    let t = BoundaryTensor::from_f32(&usize_shape(shape), &v, e).unwrap();
                    (shape, encoding, t.to_bytes().unwrap(), t.to_f32())
                } else if int8 {
                    let width = shape[2] as usize;
                    let deq = q
                        .chunks(width)
                        .zip(&s)
                        .flat_map(|(row, sc)| row.iter().map(move |x| f32::from(*x) * sc))
                        .collect();
                    (shape, encoding, encode_boundary_i8(shape, &q, &s), deq)
                } else {
                    (shape, encoding, encode_boundary_f32(shape, &v), v)
                }
            })
    })
}

#[test]
fn valid_tensors_pass_both_and_decode_to_their_values() {
    proptest!(config(), |((shape, encoding, bytes, values) in valid())| {
        prop_assert!(agree(&bytes, shape, encoding)?, "a valid tensor is refused by the check");
        let t = BoundaryTensor::from_bytes(&bytes, Some(&usize_shape(shape))).unwrap();
        prop_assert_eq!(t.to_f32(), values);
        match t.payload() {
            Payload::Int8 { scales, .. } => {
                prop_assert_eq!(scales.len() as u64, shape[0] * shape[1]);
            }
            Payload::Int4 { packed, scales } => {
                prop_assert_eq!(scales.len() as u64, shape[0] * shape[1]);
                prop_assert_eq!(packed.len() as u64, shape[0] * shape[1] * shape[2].div_ceil(2));
            }
            Payload::F32(_) => {}
        }
    });
}

#[test]
fn odd_metadata_is_refused_by_the_check_when_the_decoder_refuses_it() {
    proptest!(config(), |((shape, encoding, bytes, _) in valid(), how in meta())| {
        let bytes = rewrite(&bytes, encoding, how);
        agree_any(&bytes, shape)?;
        // The case that once got through: no `encoding`, checked as f32.
        if how == Meta::NoEncoding && encoding == Wire::F32 {
            let spec = TensorSpec::Boundary { shape, encoding };
            prop_assert!(check_tensor(&bytes, &spec).is_err());
        }
    });
}

#[test]
fn damaged_tensors_never_pass_the_check_alone() {
    let damage = prop_oneof![
        (any::<prop::sample::Index>(), 1u8..=255).prop_map(|(i, m)| (0u8, i, m)),
        any::<prop::sample::Index>().prop_map(|i| (1u8, i, 0)),
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, b)| (2u8, i, b)),
    ];
    proptest!(config(), |(
        (shape, encoding, bytes, _) in valid(),
        how in meta(),
        damages in prop::collection::vec(damage, 1..4),
    )| {
        let mut bytes = rewrite(&bytes, encoding, how);
        for (kind, at, b) in &damages {
            match kind {
                // Flip one byte (header or payload), if a truncation left any.
                0 if !bytes.is_empty() => {
                    let i = at.index(bytes.len());
                    bytes[i] ^= b;
                }
                0 => {}
                // Truncate.
                1 => bytes.truncate(at.index(bytes.len() + 1)),
                // Insert a byte.
                _ => {
                    let i = at.index(bytes.len() + 1);
                    bytes.insert(i, *b);
                }
            }
        }
        agree_any(&bytes, shape)?;
    });
}

#[test]
fn crafted_headers_agree() {
    // Hand-made headers: any of the names, dtypes and shapes, with metadata in any of the ways.
    let dtype = prop_oneof![
        Just("F32"),
        Just("I8"),
        Just("U8"),
        Just("F16"),
        Just("BF16")
    ];
    let name = prop_oneof![Just("values"), Just("scales"), Just("x")];
    let dims = prop::collection::vec(0u64..4, 0..4);
    proptest!(config(), |(
        entries in prop::collection::vec((name, dtype, dims), 1..3),
        how in meta(),
        kind in 0u8..3,
        width in prop::option::of(0u64..6),
        fill in any::<u8>(),
    )| {
        let encoding = [Wire::F32, Wire::Int8, Wire::Int4][usize::from(kind)];
        let mut header = serde_json::Map::new();
        let mut offset = 0u64;
        let mut shape_of_values = None;
        for (name, dtype, dims) in &entries {
            let size = match *dtype {
                "F32" => 4,
                "F16" | "BF16" => 2,
                _ => 1,
            };
            let len = dims.iter().product::<u64>() * size;
            header.insert(
                (*name).into(),
                serde_json::json!({"dtype": dtype, "shape": dims, "data_offsets": [offset, offset + len]}),
            );
            if *name == "values" {
                shape_of_values = Some(dims.clone());
            }
            offset += len;
        }
        // A width in the metadata, as an int4 tensor carries, for `rewrite` to keep.
        if let Some(w) = width {
            let iota = serde_json::json!({"format": "iota-boundary/v1", "encoding": "int4", "width": w});
            header.insert("__metadata__".into(), serde_json::json!({"iota": iota.to_string()}));
        }
        let text = serde_json::Value::Object(header).to_string();
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(text.as_bytes());
        bytes.resize(bytes.len() + offset as usize, fill);
        // Only a readable buffer can have its metadata rewritten; others are checked as they are.
        if SafeTensors::deserialize(&bytes).is_ok() {
            bytes = rewrite(&bytes, encoding, how);
        }
        let shape = match shape_of_values.as_deref() {
            Some([a, b, c]) => [*a, *b, *c],
            _ => [1, 1, 1],
        };
        agree_any(&bytes, shape)?;
        // An int4 slot's width is the metadata's, not the bytes' per row.
        if let Some(w) = width {
            agree_any(&bytes, [shape[0], shape[1], w])?;
        }
    });
}
