//! The tensor checks allocate in proportion to the bytes they are given, never to the sizes those
//! bytes declare: a 100-byte body that claims a 2^60-element tensor or an 8 EiB header costs
//! kilobytes, not a crash or an out-of-memory kill.
//!
//! The allocator counter is process-wide, so this binary holds exactly one test. Cases:
//! `PROPTEST_CASES`, default [`DEFAULT_CASES`].

use std::alloc::System;

use iota_protocol::tensor::{
    TensorSpec, WireEncoding, check_tensor, decode_merged, decode_partition, encode_boundary_i8,
    encode_merged, encode_partition,
};
use proptest::prelude::*;
use proptest::test_runner::{FileFailurePersistence, TestRunner};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const DEFAULT_CASES: u32 = 2048;

/// Allowed bytes allocated per input byte, plus a fixed allowance for the parser's tables,
/// error messages and the decoded `Vec` (at most the input's size again).
const PER_INPUT_BYTE: usize = 16;
const FIXED: usize = 16 * 1024;

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec::Partition { len: 3 },
        TensorSpec::Partition { len: u64::MAX },
        TensorSpec::Merged { len: 3 },
        TensorSpec::Merged { len: 1 << 40 },
        TensorSpec::Boundary {
            shape: [2, 3, 4],
            encoding: WireEncoding::F32,
        },
        TensorSpec::Boundary {
            shape: [u64::MAX, 2, 2],
            encoding: WireEncoding::Int8,
        },
    ]
}

/// Bytes that reach deep into the parser: a valid encoding, or a header (declared length and
/// JSON text with possibly huge shapes and offsets) followed by a little payload.
fn input() -> impl Strategy<Value = Vec<u8>> {
    let huge = prop_oneof![0u64..64, Just(u64::MAX), Just(1u64 << 60), any::<u64>()];
    let crafted = (
        prop_oneof![Just("F32"), Just("I8"), Just("F64")],
        prop::collection::vec(huge.clone(), 0..4),
        (huge.clone(), huge.clone()),
        prop::collection::vec(any::<u8>(), 0..256),
    )
        .prop_map(|(dtype, shape, (s, e), payload)| {
            let text = serde_json::json!({
                "__metadata__": { "iota": "{\"format\":\"iota-partition/v1\"}" },
                "values": { "dtype": dtype, "shape": shape, "data_offsets": [s, e] },
            })
            .to_string();
            let mut b = (text.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(text.as_bytes());
            b.extend_from_slice(&payload);
            b
        });
    let lying_length = (huge, prop::collection::vec(any::<u8>(), 0..1024)).prop_map(|(n, rest)| {
        let mut b = n.to_le_bytes().to_vec();
        b.extend_from_slice(&rest);
        b
    });
    let valid = prop::collection::vec(-1e3f32..1e3, 0..256).prop_map(|v| {
        let mut b = if v.len() % 2 == 0 {
            encode_partition(&v)
        } else {
            encode_merged(&v, &v)
        };
        b.extend_from_slice(&encode_boundary_i8([1, 1, 1], &[1], &[0.5]));
        b
    });
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..2048),
        crafted,
        lying_length,
        valid,
    ]
}

#[test]
fn checks_allocate_in_proportion_to_the_input() {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES);
    let mut runner = TestRunner::new(ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        source_file: Some(file!()),
        ..ProptestConfig::default()
    });
    let specs = specs();
    // The closure proptest runs is `Fn`: tally through cells.
    let worst_ratio = std::cell::Cell::new(0f64);
    let calls = std::cell::Cell::new(0u64);
    let worst_bytes = std::cell::Cell::new(0usize);
    let result = runner.run(&input(), |bytes| {
        for spec in &specs {
            let region = Region::new(GLOBAL);
            let _ = check_tensor(&bytes, spec);
            if let TensorSpec::Partition { len } | TensorSpec::Merged { len } = spec {
                let _ = decode_partition(&bytes, *len);
                let _ = decode_merged(&bytes, *len);
            }
            let change = region.change();
            calls.set(calls.get() + 1);
            let spent = change.bytes_allocated + change.bytes_reallocated.max(0) as usize;
            let allowed = PER_INPUT_BYTE * bytes.len() + FIXED;
            let ratio = spent as f64 / bytes.len().max(1) as f64;
            worst_ratio.set(worst_ratio.get().max(ratio));
            worst_bytes.set(worst_bytes.get().max(spent));
            prop_assert!(
                spent <= allowed,
                "{} bytes allocated for a {}-byte input against {:?} (allowed {})",
                spent,
                bytes.len(),
                spec,
                allowed
            );
        }
        Ok(())
    });
    eprintln!(
        "checks_allocate_in_proportion_to_the_input: {cases} cases, {} checked calls, \
         at most {} bytes allocated in one call, {:.1} per input byte",
        calls.get(),
        worst_bytes.get(),
        worst_ratio.get()
    );
    if let Err(e) = result {
        panic!("{e}");
    }
}
