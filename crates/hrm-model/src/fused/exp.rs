//! `exp` over rows of f32, eight lanes at a time on AVX2 with FMA, for the fused kernels'
//! softmax, SiLU, gates and cross-entropy: glibc's `expf` is scalar, and was 5% of a training
//! step's samples.
//!
//! The arithmetic (Cephes' `expf`): `n = floor(x · log2(e) + 1/2)`, `r = x - n · ln2` in two
//! parts, a degree-5 polynomial in `r` by Horner's rule with fused multiply-adds, times `2ⁿ`.
//! The scalar twin runs the same operations with `mul_add`, so both give the same bits; both
//! are within 2 ulp of the correctly rounded `exp` (test). Outside the range: NaN stays NaN,
//! below −87.34 gives 0 (where `exp` would underflow to below f32's smallest normal), above 88
//! gives +∞ (`exp` is finite to 88.72; the callers only feed it `x − max ≤ 0` or the negated
//! argument of a sigmoid, where +∞ gives the right limit).

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two, so that `x - n · ln2` loses nothing for |n| up to 128.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];
const LOWEST: f32 = -87.336_55;
const HIGHEST: f32 = 88.0;

/// `exp` of one value, in the module's arithmetic.
fn exp_scalar(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < LOWEST {
        return 0.0;
    }
    if x > HIGHEST {
        return f32::INFINITY;
    }
    let n = x.mul_add(LOG2E, 0.5).floor();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let y = POLY[1..].iter().fold(POLY[0], |y, &p| y.mul_add(r, p));
    let y = y.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `x ← exp(x)` for every value of `xs`.
pub(super) fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features just checked.
        unsafe { avx2::exp_in_place(xs) };
        return;
    }
    xs.iter_mut().for_each(|x| *x = exp_scalar(*x));
}

/// `x ← 1 / (1 + exp(-x))` for every value of `xs`.
pub(super) fn sigmoid_in_place(xs: &mut [f32]) {
    xs.iter_mut().for_each(|x| *x = -*x);
    exp_in_place(xs);
    xs.iter_mut().for_each(|e| *e = 1.0 / (1.0 + *e));
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{HIGHEST, LN2_HI, LN2_LO, LOG2E, LOWEST, POLY, exp_scalar};

    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_in_place(xs: &mut [f32]) {
        let (lanes, tail) = xs.as_chunks_mut::<8>();
        for chunk in lanes {
            // SAFETY: the chunk holds the eight values loaded and stored.
            unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), exp8(_mm256_loadu_ps(chunk.as_ptr()))) };
        }
        tail.iter_mut().for_each(|x| *x = exp_scalar(*x));
    }

    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        let low = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(LOWEST));
        let high = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(HIGHEST));
        let n = _mm256_floor_ps(_mm256_fmadd_ps(
            x,
            _mm256_set1_ps(LOG2E),
            _mm256_set1_ps(0.5),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut y = _mm256_set1_ps(POLY[0]);
        for &p in &POLY[1..] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(p));
        }
        let y = _mm256_add_ps(
            _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        // Out-of-range lanes compute garbage exponents here; the blends below replace them.
        let power = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvttps_epi32(n),
            _mm256_set1_epi32(127),
        )));
        let result = _mm256_mul_ps(y, power);
        let result = _mm256_blendv_ps(result, _mm256_setzero_ps(), low);
        let result = _mm256_blendv_ps(result, _mm256_set1_ps(f32::INFINITY), high);
        _mm256_blendv_ps(result, x, nan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    /// Against the correctly rounded `exp` (f64, rounded once) over the whole range, on every
    /// path this CPU has, and the specials.
    #[test]
    fn within_two_ulp_of_exp_and_the_same_bits_on_every_path() {
        let mut xs: Vec<f32> = (0..200_001)
            .map(|i| LOWEST + (HIGHEST - LOWEST) * i as f32 / 200_000.0)
            .collect();
        xs.extend([0.0, -0.0, 1.0, -1.0, 1e-8, -1e-8, 0.5, -0.5]);
        let mut fast = xs.clone();
        exp_in_place(&mut fast);
        for (&x, &e) in xs.iter().zip(&fast) {
            assert_eq!(
                e.to_bits(),
                exp_scalar(x).to_bits(),
                "exp({x}): vector and scalar"
            );
            let exact = (x as f64).exp() as f32;
            assert!(
                ulps(e, exact) <= 2,
                "exp({x}) = {e}, correctly rounded {exact}"
            );
        }
        let specials = [
            f32::NAN,
            f32::NEG_INFINITY,
            -100.0,
            f32::MIN,
            88.5,
            f32::INFINITY,
            f32::MAX,
        ];
        let mut out = specials;
        exp_in_place(&mut out);
        assert!(out[0].is_nan());
        assert_eq!(&out[1..4], &[0.0; 3]);
        assert_eq!(&out[4..], &[f32::INFINITY; 3]);
        assert_eq!(exp_scalar(0.0), 1.0);
        let mut s = [0.0, 100.0, -100.0, 2.0];
        sigmoid_in_place(&mut s);
        assert_eq!(&s[..3], &[0.5, 1.0, 0.0]);
        assert!((s[3] - 1.0 / (1.0 + (-2f32).exp())).abs() < 1e-7);
    }
}
