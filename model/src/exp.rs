//! `exp` over a slice of f32, for the fused kernels' softmaxes, sigmoids and loss rows.
//!
//! The C library's `expf` is a call per value that no loop vectorises (the SwiGLU gate's sigmoid
//! alone took 7% of a step of `small`), and its last bit may differ between C libraries. This is
//! the classic range reduction `x = n ln 2 + r`, `|r| <= ln 2 / 2`, a degree-7 polynomial for
//! `e^r` and `2^n` put in the exponent bits, written as plain arithmetic so that the compiler
//! vectorises the loop. It stays within 1 ulp of `expf` (tested). No fused multiply-adds: the loop
//! compiled for AVX-512 or AVX2 (picked at run time) gives the same bits as the baseline one, so
//! results depend neither on the CPU nor on the platform's libm.

/// Above this, `e^x` overflows f32.
const HI: f32 = 88.722_83;
/// Below this, `e^x` is under the smallest normal f32 and comes out as 0.
const LO: f32 = -87.336_55;
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split in two, the first part with few mantissa bits so `n * LN2_HI` is exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// `e^x` of one value, the same arithmetic as the slice loop.
#[inline(always)]
fn exp1(x: f32) -> f32 {
    let c = x.clamp(LO, HI);
    // Round to nearest by adding 1.5 * 2^23, which drops the fraction: the sum's low mantissa
    // bits then hold n as an integer (no float-to-int conversion, which would not vectorise).
    const ROUND: f32 = 12_582_912.0;
    let t = c * LOG2_E + ROUND;
    let n_int = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let n = t - ROUND;
    let r = (c - n * LN2_HI) - n * LN2_LO;
    // Taylor coefficients 1/k!; on |r| <= 0.347 the truncation error is under 3e-9.
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // 2^n in two exact factors: n reaches 128 just under HI, past the largest f32 exponent.
    let n = n_int;
    let half = n >> 1;
    let pow2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    let y = p * pow2(half) * pow2(n - half);
    let y = if x < LO { 0.0 } else { y };
    let y = if x > HI { f32::INFINITY } else { y };
    if x.is_nan() { x } else { y }
}

#[inline(always)]
fn exp_loop(xs: &mut [f32]) {
    for x in xs {
        *x = exp1(*x);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn exp_loop_avx2(xs: &mut [f32]) {
    exp_loop(xs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn exp_loop_avx512(xs: &mut [f32]) {
    exp_loop(xs)
}

/// Replaces every value of `xs` with its exponential.
pub(crate) fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked just above).
        return unsafe { exp_loop_avx512(xs) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { exp_loop_avx2(xs) };
    }
    exp_loop(xs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn within_one_ulp_of_expf_over_the_whole_range() {
        let mut xs: Vec<f32> = (0..2_000_001)
            .map(|i| -90.0 + 180.0 * i as f32 / 2_000_000.0)
            .collect();
        // Near 0, where a wrong constant term or rounding shows most.
        xs.extend((0..20_001).map(|i| -1e-3 + 2e-3 * i as f32 / 20_000.0));
        let want: Vec<f32> = xs.iter().map(|x| x.exp()).collect();
        let mut got = xs.clone();
        exp_in_place(&mut got);
        let mut worst = (0, 0.0);
        for ((&x, &w), &g) in xs.iter().zip(&want).zip(&got) {
            if w.is_normal() {
                let u = ulps(g, w);
                if u > worst.0 {
                    worst = (u, x);
                }
            } else if w.is_infinite() {
                assert_eq!(g, w, "exp({x})");
            } else {
                // Under the smallest normal: 0 or the tiny value itself.
                assert!(
                    g == 0.0 || (g - w).abs() < 1e-37,
                    "exp({x}) = {g}, want {w}"
                );
            }
        }
        assert!(worst.0 <= 1, "{} ulp at x = {}", worst.0, worst.1);
    }

    #[test]
    fn edges_and_specials() {
        let mut xs = [
            0.0,
            -0.0,
            1.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
            -200.0,
            200.0,
            88.0,
            -87.0,
        ];
        exp_in_place(&mut xs);
        assert_eq!(xs[0], 1.0);
        assert_eq!(xs[1], 1.0);
        assert_eq!(xs[2], std::f32::consts::E);
        assert_eq!(xs[3], 0.0);
        assert_eq!(xs[4], f32::INFINITY);
        assert!(xs[5].is_nan());
        assert_eq!(xs[6], 0.0);
        assert_eq!(xs[7], f32::INFINITY);
        assert!(ulps(xs[8], 88f32.exp()) <= 2);
        assert!(ulps(xs[9], (-87f32).exp()) <= 2);
    }

    #[test]
    fn the_avx2_and_avx512_loops_give_the_baseline_bits() {
        #[cfg(target_arch = "x86_64")]
        {
            let xs: Vec<f32> = (0..100_003).map(|i| -95.0 + i as f32 * 1.9e-3).collect();
            let mut base = xs.clone();
            exp_loop(&mut base);
            let same = |wide: &[f32]| {
                base.iter()
                    .zip(wide)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            };
            if std::arch::is_x86_feature_detected!("avx2") {
                let mut wide = xs.clone();
                // SAFETY: AVX2 checked above.
                unsafe { exp_loop_avx2(&mut wide) };
                assert!(same(&wide), "AVX2 and baseline loops differ");
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                let mut wide = xs;
                // SAFETY: AVX-512F checked above.
                unsafe { exp_loop_avx512(&mut wide) };
                assert!(same(&wide), "AVX-512 and baseline loops differ");
            }
        }
    }
}
