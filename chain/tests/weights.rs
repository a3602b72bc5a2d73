//! Weight conversion against the Python SDK.
//!
//! Expected values were produced once by running the unmodified
//! `bittensor/utils/weight_utils.py` from bittensor 10.2.0 (wheel from PyPI) under NumPy 2.4.6,
//! with only its logging/torch imports stubbed out. Each case records the exact call. Floats
//! are compared bit for bit: the Rust code follows NumPy's summation order and dtype rules.

use iota_chain::weights::{
    DEFAULT_SALT_LEN, WeightsError, commit_hash, convert_weights_and_uids_for_emit, generate_salt,
    normalize_max_weight, process_weights,
};

/// Widens results to `f64` so that `repr(float(v))` values printed by Python compare exactly.
fn widen<T: Into<f64> + Copy>(v: &[T]) -> Vec<f64> {
    v.iter().map(|&x| x.into()).collect()
}

// ---------------------------------------------------------------------------------------------
// convert_weights_and_uids_for_emit
// ---------------------------------------------------------------------------------------------

#[test]
fn emit_max_upscales_and_rounds() {
    // convert_weights_and_uids_for_emit(np.array([0, 1, 2]), np.array([0.5, 1.0, 0.25], np.float32))
    // -> ([0, 1, 2], [32768, 65535, 16384]); 0.5 * 65535 = 32767.5 rounds to the even 32768.
    let (uids, vals) =
        convert_weights_and_uids_for_emit(&[0, 1, 2], &[0.5_f32, 1.0, 0.25]).unwrap();
    assert_eq!(uids, [0, 1, 2]);
    assert_eq!(vals, [32768, 65535, 16384]);
}

#[test]
fn emit_rounds_exact_halves_to_even() {
    // w / 131070 * 65535 lands exactly on k + 0.5 for w = 2k + 1:
    // 1 -> 0.5 -> 0 (dropped), 3 -> 1.5 -> 2, 5 -> 2.5 -> 2, 7 -> 3.5 -> 4.
    // SDK (float64 input): ([0, 2, 3, 4], [65535, 2, 2, 4]).
    let (uids, vals) =
        convert_weights_and_uids_for_emit(&[0, 1, 2, 3, 4], &[131_070.0_f64, 1.0, 3.0, 5.0, 7.0])
            .unwrap();
    assert_eq!(uids, [0, 2, 3, 4]);
    assert_eq!(vals, [65535, 2, 2, 4]);

    // Larger halves: 21 -> 10.5 -> 10, 23 -> 11.5 -> 12, 65533 -> 32766.5 -> 32766.
    let (_, vals) =
        convert_weights_and_uids_for_emit(&[0, 1, 2, 3], &[131_070.0_f64, 21.0, 23.0, 65_533.0])
            .unwrap();
    assert_eq!(vals, [65535, 10, 12, 32766]);
}

#[test]
fn emit_matches_sdk_for_float32_and_float64_input() {
    // uids 0..7, weights [0.1, 0.3, 0.7, 0.05, 0.0, 1e-6, 0.9999] as float32 and as float64:
    // both give ([0, 1, 2, 3, 6], [6554, 19662, 45879, 3277, 65535]).
    let w64 = [0.1_f64, 0.3, 0.7, 0.05, 0.0, 1e-6, 0.9999];
    #[allow(clippy::cast_possible_truncation)]
    let w32: Vec<f32> = w64.iter().map(|&w| w as f32).collect();
    let uids: Vec<u16> = (0..7).collect();
    for (u, v) in [
        convert_weights_and_uids_for_emit(&uids, &w32).unwrap(),
        convert_weights_and_uids_for_emit(&uids, &w64).unwrap(),
    ] {
        assert_eq!(u, [0, 1, 2, 3, 6]);
        assert_eq!(v, [6554, 19662, 45879, 3277, 65535]);
    }
}

#[test]
fn emit_drops_zeros_and_values_that_round_to_zero() {
    // SDK: ([0, 1, 2], [1.0, 0.0, 1e-6]) -> ([0], [65535]); 1e-6 * 65535 = 0.066 rounds to 0.
    let (uids, vals) =
        convert_weights_and_uids_for_emit(&[0, 1, 2], &[1.0_f32, 0.0, 1e-6]).unwrap();
    assert_eq!(uids, [0]);
    assert_eq!(vals, [65535]);
}

#[test]
fn emit_all_zero_gives_empty_vectors() {
    let (uids, vals) = convert_weights_and_uids_for_emit(&[0, 1, 2], &[0.0_f32, 0.0, 0.0]).unwrap();
    assert!(uids.is_empty());
    assert!(vals.is_empty());
}

#[test]
fn emit_all_equal_gives_all_max() {
    let (uids, vals) =
        convert_weights_and_uids_for_emit(&[0, 1, 2, 3], &[1.0_f32, 1.0, 1.0, 1.0]).unwrap();
    assert_eq!(uids, [0, 1, 2, 3]);
    assert_eq!(vals, [65535; 4]);
}

#[test]
fn emit_single_uid_gets_full_weight() {
    // SDK: ([7], [0.3]) -> ([7], [65535]).
    let (uids, vals) = convert_weights_and_uids_for_emit(&[7], &[0.3_f32]).unwrap();
    assert_eq!(uids, [7]);
    assert_eq!(vals, [65535]);
}

#[test]
fn emit_rejects_bad_input() {
    assert_eq!(
        convert_weights_and_uids_for_emit(&[0, 1], &[1.0_f32]),
        Err(WeightsError::LengthMismatch {
            uids: 2,
            weights: 1
        })
    );
    assert_eq!(
        convert_weights_and_uids_for_emit::<f32>(&[], &[]),
        Err(WeightsError::Empty)
    );
    assert!(matches!(
        convert_weights_and_uids_for_emit(&[0, 1], &[1.0_f32, f32::NAN]),
        Err(WeightsError::NotFinite { index: 1, .. })
    ));
    assert!(matches!(
        convert_weights_and_uids_for_emit(&[0, 1], &[f64::INFINITY, 1.0]),
        Err(WeightsError::NotFinite { index: 0, .. })
    ));
    assert_eq!(
        convert_weights_and_uids_for_emit(&[0, 1], &[1.0_f64, -0.5]),
        Err(WeightsError::Negative {
            index: 1,
            value: -0.5
        })
    );
    // The message names the problem.
    let err = convert_weights_and_uids_for_emit(&[0, 1], &[1.0_f64, -0.5]).unwrap_err();
    assert!(err.to_string().contains("negative"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// normalize_max_weight
// ---------------------------------------------------------------------------------------------

#[test]
fn normalize_clips_to_limit_float64() {
    // normalize_max_weight(np.array([1, 2, 3, 4, 10], np.float64), limit=0.3)
    let y = normalize_max_weight(&[1.0_f64, 2.0, 3.0, 4.0, 10.0], 0.3).unwrap();
    assert_eq!(
        y,
        [
            0.0700000140000028,
            0.1400000280000056,
            0.2100000420000084,
            0.2800000560000112,
            0.29999985999997203
        ]
    );
}

#[test]
fn normalize_clips_to_limit_float32() {
    // normalize_max_weight(np.array([1, 2, 3, 4, 10], np.float32), limit=0.3)
    let y = normalize_max_weight(&[1.0_f32, 2.0, 3.0, 4.0, 10.0], 0.3).unwrap();
    assert_eq!(
        widen(&y),
        [
            0.07000001519918442,
            0.14000003039836884,
            0.21000003814697266,
            0.28000006079673767,
            0.299999862909317
        ]
    );
}

#[test]
fn normalize_below_limit_is_plain_normalisation() {
    // limit=0.6: the largest share is 0.5, so the SDK returns x / x.sum().
    let y = normalize_max_weight(&[1.0_f64, 2.0, 3.0, 4.0, 10.0], 0.6).unwrap();
    assert_eq!(y, [0.05, 0.1, 0.15, 0.2, 0.5]);
}

#[test]
fn normalize_unreachable_limit_or_zero_sum_is_uniform() {
    // n * limit <= 1: 5 * 0.1 cannot reach 1, so the SDK returns 1/n.
    assert_eq!(
        normalize_max_weight(&[1.0_f64, 1.0, 1.0, 1.0, 1.0], 0.1).unwrap(),
        [0.2; 5]
    );
    assert_eq!(
        normalize_max_weight(&[5.0_f64, 0.0, 1.0], 0.2).unwrap(),
        [1.0 / 3.0; 3]
    );
    assert_eq!(
        normalize_max_weight(&[0.0_f64, 0.0, 0.0], 0.5).unwrap(),
        [0.3333333333333333; 3]
    );
    assert!(normalize_max_weight::<f64>(&[], 0.5).unwrap().is_empty());
}

/// The input used for the long-vector cases, also evaluated in Python.
fn long_input() -> Vec<f64> {
    // x = [((i * 37) % 101) / 101.0 + (5.0 if i % 50 == 0 else 0.0) for i in range(200)]
    (0..200_u32)
        .map(|i| f64::from((i * 37) % 101) / 101.0 + if i % 50 == 0 { 5.0 } else { 0.0 })
        .collect()
}

#[test]
fn normalize_long_vector_float64_bit_exact() {
    // 200 elements exercise NumPy's recursive pairwise summation (blocks above 128).
    let y = normalize_max_weight(&long_input(), 0.02).unwrap();
    assert_eq!(y.len(), 200);
    let expected: [(usize, f64); 8] = [
        (0, 0.01999988727019024),
        (1, 0.003467456115311383),
        (2, 0.006934912230622766),
        (50, 0.01999988727019024),
        (99, 0.0025303058138758743),
        (100, 0.01999988727019024),
        (150, 0.01999988727019024),
        (199, 0.008528067743063132),
    ];
    for (i, v) in expected {
        assert_eq!(y[i].to_bits(), v.to_bits(), "index {i}: {} != {v}", y[i]);
    }
    assert!(y.iter().all(|&v| v <= 0.02));
}

#[test]
fn normalize_long_vector_float32_bit_exact() {
    #[allow(clippy::cast_possible_truncation)]
    let x: Vec<f32> = long_input().iter().map(|&v| v as f32).collect();
    let y = normalize_max_weight(&x, 0.02).unwrap();
    let expected = [
        (0, 0.019999884068965912),
        (1, 0.0034674559719860554),
        (2, 0.006934911943972111),
        (50, 0.019999884068965912),
        (99, 0.0025303056463599205),
        (100, 0.019999884068965912),
        (150, 0.019999884068965912),
        (199, 0.008528067730367184),
    ];
    for (i, v) in expected {
        assert_eq!(f64::from(y[i]), v, "index {i}");
    }
}

#[test]
fn normalize_rejects_bad_input() {
    assert!(matches!(
        normalize_max_weight(&[1.0_f64, f64::NAN], 0.5),
        Err(WeightsError::NotFinite { index: 1, .. })
    ));
    assert!(matches!(
        normalize_max_weight(&[1.0_f32, -1.0], 0.5),
        Err(WeightsError::Negative { index: 1, .. })
    ));
    assert!(matches!(
        normalize_max_weight(&[1.0_f64], f64::NAN),
        Err(WeightsError::InvalidLimit { .. })
    ));
    assert!(matches!(
        normalize_max_weight(&[1.0_f64], -0.1),
        Err(WeightsError::InvalidLimit { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// process_weights (uids, float32 weights, num_neurons, min_allowed_weights, max_weight_limit,
// exclude_quantile)
// ---------------------------------------------------------------------------------------------

#[test]
fn process_all_zero_is_uniform_over_all_neurons() {
    // process_weights([0..5], [0, 0, 0, 0, 0], 5, 1, 1.0) -> (arange(5), [0.2] * 5)
    let (uids, w) = process_weights(&[0, 1, 2, 3, 4], &[0.0_f32; 5], 5, 1, 1.0, 0).unwrap();
    assert_eq!(uids, [0, 1, 2, 3, 4]);
    assert_eq!(w, [0.2; 5]);
}

#[test]
fn process_small_subnet_is_uniform() {
    // num_neurons < min_allowed_weights: process_weights([0, 1, 2], [0.3, 0.2, 0.1], 3, 8, 0.5)
    let (uids, w) = process_weights(&[0, 1, 2], &[0.3_f32, 0.2, 0.1], 3, 8, 0.5, 0).unwrap();
    assert_eq!(uids, [0, 1, 2]);
    assert_eq!(w, [0.3333333333333333; 3]);
}

#[test]
fn process_pads_when_fewer_than_min_allowed() {
    // process_weights([0..6], [0.5, 0, 0.25, 0, 0, 0], 6, 3, 0.5)
    let (uids, w) = process_weights(
        &[0, 1, 2, 3, 4, 5],
        &[0.5_f32, 0.0, 0.25, 0.0, 0.0, 0.0],
        6,
        3,
        0.5,
        0,
    )
    .unwrap();
    assert_eq!(uids, [0, 1, 2, 3, 4, 5]);
    assert_eq!(
        w,
        [
            0.4999998500179515,
            1.9996006797922363e-05,
            0.499920165954857,
            1.9996006797922363e-05,
            1.9996006797922363e-05,
            1.9996006797922363e-05
        ]
    );
}

#[test]
fn process_excludes_low_quantile_and_clips() {
    // process_weights([3, 5, 8, 9, 10, 12], [0.1, 0.4, 0.2, 0.05, 0.8, 0.3], 16, 2, 0.35, 20000)
    let (uids, w) = process_weights(
        &[3, 5, 8, 9, 10, 12],
        &[0.1_f32, 0.4, 0.2, 0.05, 0.8, 0.3],
        16,
        2,
        0.35,
        20000,
    )
    .unwrap();
    assert_eq!(uids, [5, 8, 10, 12]);
    assert_eq!(
        w,
        [
            0.28888893127441406,
            0.14444446563720703,
            0.34999987483024597,
            0.21666671335697174
        ]
    );

    // Same with exclude_quantile=65535 but min_allowed_weights=5: at most one weight may go.
    let (uids, w) = process_weights(
        &[3, 5, 8, 9, 10, 12],
        &[0.1_f32, 0.4, 0.2, 0.05, 0.8, 0.3],
        16,
        5,
        0.35,
        65535,
    )
    .unwrap();
    assert_eq!(uids, [3, 5, 8, 10, 12]);
    assert_eq!(
        w,
        [
            0.0650000125169754,
            0.2600000500679016,
            0.1300000250339508,
            0.34999990463256836,
            0.1950000524520874
        ]
    );
}

#[test]
fn process_without_limit_only_normalises() {
    // process_weights([4, 2, 9], [0.25, 0.5, 0.125], 10, 1, 1.0)
    let (uids, w) = process_weights(&[4, 2, 9], &[0.25_f32, 0.5, 0.125], 10, 1, 1.0, 0).unwrap();
    assert_eq!(uids, [4, 2, 9]);
    assert_eq!(
        w,
        [0.2857142984867096, 0.5714285969734192, 0.1428571492433548]
    );
}

#[test]
fn process_rejects_bad_input() {
    assert!(matches!(
        process_weights(&[0, 1], &[0.5_f32], 2, 1, 1.0, 0),
        Err(WeightsError::LengthMismatch {
            uids: 2,
            weights: 1
        })
    ));
    assert!(matches!(
        process_weights(&[0, 1], &[0.5_f32, f32::NAN], 2, 1, 1.0, 0),
        Err(WeightsError::NotFinite { index: 1, .. })
    ));
    // Padding indexes by position; a weight past num_neurons cannot be placed.
    assert!(matches!(
        process_weights(&[0, 1, 2], &[0.0_f32, 0.0, 1.0], 2, 2, 1.0, 0),
        Err(WeightsError::IndexOutOfRange {
            index: 2,
            num_neurons: 2
        })
    ));
}

// ---------------------------------------------------------------------------------------------
// Commit-reveal v2
// ---------------------------------------------------------------------------------------------

/// Public key of ss58 `5ChZYomNX9nFhKBThkdMUhsneWcAkrdBH5cJh27Q6SBxkzmR` (the fixture coldkey).
const ACCOUNT: [u8; 32] = [
    0x1c, 0x1c, 0x1c, 0xe5, 0x85, 0xcc, 0x1e, 0x17, 0x22, 0x49, 0xa2, 0x37, 0xb6, 0x9b, 0x22, 0xf6,
    0x4d, 0x37, 0xc5, 0x18, 0x17, 0x3a, 0x9f, 0xb1, 0x39, 0xd5, 0xed, 0xe8, 0xfa, 0x00, 0x87, 0x4e,
];

fn hex32(s: &str) -> [u8; 32] {
    let bytes = hex::decode(s.trim_start_matches("0x")).expect("hex literal");
    bytes.try_into().expect("32-byte literal")
}

#[test]
fn commit_hash_matches_sdk_generate_weight_hash() {
    // generate_weight_hash(ss58, 9, [0, 1, 5], [65535, 32768, 17], 10002000, [1, 2, 3, 4, 5, 6, 7, 8])
    assert_eq!(
        commit_hash(
            ACCOUNT,
            9,
            &[0, 1, 5],
            &[65535, 32768, 17],
            &[1, 2, 3, 4, 5, 6, 7, 8],
            10_002_000
        ),
        hex32("0xca780b63c0ae28b793cb7d8a5af9e7252252dc3c632902f8b7cab4e2db13fd92")
    );
    // generate_weight_hash(ss58, 0, [], [], 0, [])
    assert_eq!(
        commit_hash(ACCOUNT, 0, &[], &[], &[], 0),
        hex32("0x69eec7d4bee916af39bb6df5b03bb1a4a3d8f9590b6ac65d6d5b9e8b88f0245c")
    );
    // 70 entries need a two-byte compact length prefix.
    // generate_weight_hash(ss58, 4097, list(range(70)), [i * 900 for i in range(70)],
    //                      2**64 - 1, [65535, 0, 300])
    let uids: Vec<u16> = (0..70).collect();
    let values: Vec<u16> = (0..70).map(|i| i * 900).collect();
    assert_eq!(
        commit_hash(ACCOUNT, 4097, &uids, &values, &[65535, 0, 300], u64::MAX),
        hex32("0x884418810755e9ca59bcaaaf7b7e7064c23b595326efe86b58d6e5dd20b9d5a3")
    );
}

#[test]
fn salts_are_random() {
    let a = generate_salt(DEFAULT_SALT_LEN);
    let b = generate_salt(DEFAULT_SALT_LEN);
    assert_eq!(a.len(), DEFAULT_SALT_LEN);
    // 2^-128 chance of a false failure.
    assert_ne!(a, b);
}
