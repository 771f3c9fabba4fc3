//! `exp` over rows of f32, eight lanes at a time on AVX2 with FMA and sixteen on AVX-512, for
//! the fused kernels' softmax, SiLU, gates and cross-entropy: glibc's `expf` is scalar, and was
//! 5% of a training step's samples.
//!
//! The arithmetic (Cephes' `expf`): `n = floor(x · log2(e) + 1/2)`, `r = x - n · ln2` in two
//! parts, a degree-5 polynomial in `r` by Horner's rule with fused multiply-adds, times `2ⁿ`.
//! Every path (scalar, AVX2, AVX-512: the instruction set [`Kernel`] finds, as decode's dot
//! products use) runs the same operations, so all give the same bits; all are within 2
//! ulp of the correctly rounded `exp` (test). Outside the range: NaN stays NaN, below −87.34
//! gives 0 (where `exp` would underflow to below f32's smallest normal), above 88 gives +∞ (`exp`
//! is finite to 88.72; the callers only feed it `x − max ≤ 0` or the negated argument of a
//! sigmoid, where +∞ gives the right limit).
//!
//! A softmax row's maximum is found in one pass ([`max`]), and the row is shifted,
//! exponentiated and summed in one more ([`exp_shifted`]) rather than three. The vector paths
//! sum in one accumulator per lane, so the sum's rounding depends on the path (within f32's
//! rounding of a sum of positive terms, test); a strict left-to-right sum would chain one
//! dependent add per value.

use crate::decode_matmul::Kernel;

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

/// The largest value of `xs` on `kernel`'s instruction set.
fn max_on(kernel: Kernel, xs: &[f32]) -> f32 {
    match kernel {
        Kernel::Scalar => xs.iter().copied().fold(f32::NEG_INFINITY, f32::max),
        // SAFETY (each arm): `Kernel::detect` and `Kernel::supported` name only instruction
        // sets that this CPU has.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { avx2::max(xs) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { avx512::max(xs) },
    }
}

/// [`sigmoid_in_place`] on `kernel`'s instruction set.
fn sigmoid_on(kernel: Kernel, xs: &mut [f32]) {
    match kernel {
        Kernel::Scalar => sigmoid_scalar(xs),
        // SAFETY (each arm): as in `max_on`.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { avx2::sigmoid(xs) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { avx512::sigmoid(xs) },
    }
}

/// [`swiglu`] on `kernel`'s instruction set.
fn swiglu_on(kernel: Kernel, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == out.len() && up.len() == out.len(),
        "swiglu: gate, up and output of different lengths"
    );
    match kernel {
        Kernel::Scalar => swiglu_scalar(gate, up, out),
        // SAFETY (each arm): as in `max_on`; the lengths are equal (above).
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { avx2::swiglu(gate, up, out) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { avx512::swiglu(gate, up, out) },
    }
}

/// [`gate_in_place`] on `kernel`'s instruction set.
fn gate_on(kernel: Kernel, gate: &[f32], out: &mut [f32]) {
    assert_eq!(
        gate.len(),
        out.len(),
        "gate: gate and output of different lengths"
    );
    match kernel {
        Kernel::Scalar => gate_scalar(gate, out),
        // SAFETY (each arm): as in `max_on`; the lengths are equal (above).
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { avx2::gate(gate, out) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { avx512::gate(gate, out) },
    }
}

/// [`swiglu_grad`] on `kernel`'s instruction set.
fn swiglu_grad_on(kernel: Kernel, (gate, up, grad): (&[f32], &[f32], &[f32]), d: Halves) {
    let len = grad.len();
    assert!(
        [gate.len(), up.len(), d.0.len(), d.1.len()]
            .iter()
            .all(|&l| l == len),
        "swiglu gradient: gate, up, gradient and outputs of different lengths"
    );
    match kernel {
        Kernel::Scalar => swiglu_grad_scalar((gate, up, grad), d),
        // SAFETY (each arm): as in `max_on`; the lengths are equal (above).
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { avx2::swiglu_grad((gate, up, grad), d) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { avx512::swiglu_grad((gate, up, grad), d) },
    }
}

/// The gate's and the up half's gradients, written by [`swiglu_grad`].
type Halves<'a> = (&'a mut [f32], &'a mut [f32]);

/// [`exp_shifted`] on `kernel`'s instruction set.
fn exp_shifted_on(kernel: Kernel, xs: &mut [f32], shift: f32) -> f32 {
    match kernel {
        Kernel::Scalar => exp_shifted_scalar(xs, shift, 0.0),
        // SAFETY (each arm): as in `max_on`.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { avx2::exp_shifted(xs, shift) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { avx512::exp_shifted(xs, shift) },
    }
}

/// `x ← exp(x − shift)` one value at a time; returns `sum` plus the results.
fn exp_shifted_scalar(xs: &mut [f32], shift: f32, sum: f32) -> f32 {
    xs.iter_mut().fold(sum, |sum, x| {
        *x = exp_scalar(*x - shift);
        sum + *x
    })
}

/// The largest value of `xs` (−∞ for none). A NaN among them may or may not be the answer,
/// depending on the path: either way the softmax of such a row is NaN throughout.
pub(super) fn max(xs: &[f32]) -> f32 {
    max_on(Kernel::detect(), xs)
}

/// `x ← exp(x − shift)` for every value of `xs`; returns the sum of the results.
pub(super) fn exp_shifted(xs: &mut [f32], shift: f32) -> f32 {
    exp_shifted_on(Kernel::detect(), xs, shift)
}

/// `x ← exp(x)` for every value of `xs`.
pub(super) fn exp_in_place(xs: &mut [f32]) {
    exp_shifted(xs, 0.0);
}

/// `1 / (1 + exp(-x))` of one value, the sigmoid every path computes.
fn sigmoid_of(x: f32) -> f32 {
    1.0 / (1.0 + exp_scalar(-x))
}

/// `x ← 1 / (1 + exp(-x))` one value at a time.
fn sigmoid_scalar(xs: &mut [f32]) {
    xs.iter_mut().for_each(|x| *x = sigmoid_of(*x));
}

/// `out ← sigmoid(g) · (g · u)` one value at a time.
fn swiglu_scalar(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((out, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *out = sigmoid_of(g) * (g * u);
    }
}

/// `out ← silu(g) · u`, SwiGLU's gating, for the values `g`, `u` of `gate` and `up` (all
/// three of one length), in one pass: [`sigmoid_in_place`]'s sigmoid of `g` times `g · u`.
/// Written as a copy of the gate, a sigmoid in place and a product, it took three passes over
/// the row; the copy alone was 1.4–1.6% of a batch-8 prompt's samples on an AVX2-only AMD EPYC
/// (family 25 model 1).
pub(super) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    swiglu_on(Kernel::detect(), gate, up, out);
}

/// `out ← out · sigmoid(g)` one value at a time.
fn gate_scalar(gate: &[f32], out: &mut [f32]) {
    for (out, &g) in out.iter_mut().zip(gate) {
        *out *= sigmoid_of(g);
    }
}

/// `out ← out · sigmoid(g)` for the values `g` of `gate` (as long as `out`), in one pass:
/// attention's output gate, read where the projection holds it. Written as a copy of the gate
/// row, a sigmoid in place and a product, the copy alone was about 1% of a batch-8 prompt's
/// samples on an Intel Xeon (family 6 model 207); the sigmoid is [`sigmoid_in_place`]'s and the
/// product the same, so the bits are the same.
pub(crate) fn gate_in_place(gate: &[f32], out: &mut [f32]) {
    gate_on(Kernel::detect(), gate, out);
}

/// [`swiglu_grad`] one value at a time.
fn swiglu_grad_scalar((gate, up, grad): (&[f32], &[f32], &[f32]), (d_gate, d_up): Halves) {
    for e in 0..grad.len() {
        let (x, u, g) = (gate[e], up[e], grad[e]);
        let s = sigmoid_of(x);
        d_gate[e] = g * u * s * (1.0 + x * (1.0 - s));
        d_up[e] = g * (x * s);
    }
}

/// The gradients of [`swiglu`] from the output's gradient `g`, in one pass: with `s` the
/// sigmoid of the gate value `x` and `u` the up value, `d_gate ← g · u · s · (1 + x · (1 − s))`
/// and `d_up ← g · (x · s)`, each product and sum in that order on every path (no fused
/// multiply-adds), so all give the same bits. The sigmoid is [`sigmoid_in_place`]'s.
pub(super) fn swiglu_grad(gate: &[f32], up: &[f32], grad: &[f32], d: Halves) {
    swiglu_grad_on(Kernel::detect(), (gate, up, grad), d);
}

/// `x ← 1 / (1 + exp(-x))` for every value of `xs`, in one pass.
pub(super) fn sigmoid_in_place(xs: &mut [f32]) {
    sigmoid_on(Kernel::detect(), xs);
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{
        HIGHEST, Halves, LN2_HI, LN2_LO, LOG2E, LOWEST, POLY, exp_shifted_scalar, gate_scalar,
        sigmoid_scalar, swiglu_grad_scalar, swiglu_scalar,
    };

    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_shifted(xs: &mut [f32], shift: f32) -> f32 {
        let (lanes, tail) = xs.as_chunks_mut::<8>();
        let by = _mm256_set1_ps(shift);
        let mut sums = _mm256_setzero_ps();
        for chunk in lanes {
            // SAFETY: the chunk holds the eight values loaded and stored.
            unsafe {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), by));
                sums = _mm256_add_ps(sums, e);
                _mm256_storeu_ps(chunk.as_mut_ptr(), e);
            }
        }
        exp_shifted_scalar(tail, shift, crate::decode_matmul::sum_256(sums))
    }

    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn sigmoid(xs: &mut [f32]) {
        let (lanes, tail) = xs.as_chunks_mut::<8>();
        for chunk in lanes {
            // SAFETY: the chunk holds the eight values loaded and stored.
            unsafe {
                _mm256_storeu_ps(
                    chunk.as_mut_ptr(),
                    sigmoid8(_mm256_loadu_ps(chunk.as_ptr())),
                );
            }
        }
        sigmoid_scalar(tail);
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; `gate`, `up` and `out` have one length.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let (gates, gate_tail) = gate.as_chunks::<8>();
        let (ups, up_tail) = up.as_chunks::<8>();
        let (outs, out_tail) = out.as_chunks_mut::<8>();
        for ((g, u), out) in gates.iter().zip(ups).zip(outs) {
            // SAFETY: each chunk holds the eight values loaded or stored.
            unsafe {
                let g = _mm256_loadu_ps(g.as_ptr());
                let s = sigmoid8(g);
                let gu = _mm256_mul_ps(g, _mm256_loadu_ps(u.as_ptr()));
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(s, gu));
            }
        }
        swiglu_scalar(gate_tail, up_tail, out_tail);
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; `gate` and `out` have one length.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gate(gate: &[f32], out: &mut [f32]) {
        let (gates, gate_tail) = gate.as_chunks::<8>();
        let (outs, out_tail) = out.as_chunks_mut::<8>();
        for (g, out) in gates.iter().zip(outs) {
            // SAFETY: each chunk holds the eight values loaded or stored.
            unsafe {
                let s = sigmoid8(_mm256_loadu_ps(g.as_ptr()));
                let o = _mm256_loadu_ps(out.as_ptr());
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(o, s));
            }
        }
        gate_scalar(gate_tail, out_tail);
    }

    /// # Safety
    /// The CPU has AVX2 and FMA; the five slices have one length.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn swiglu_grad(
        (gate, up, grad): (&[f32], &[f32], &[f32]),
        (d_gate, d_up): Halves,
    ) {
        let whole = grad.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for e in (0..whole).step_by(8) {
            // SAFETY: every slice holds the eight values from `e` loaded or stored.
            unsafe {
                let x = _mm256_loadu_ps(gate.as_ptr().add(e));
                let u = _mm256_loadu_ps(up.as_ptr().add(e));
                let g = _mm256_loadu_ps(grad.as_ptr().add(e));
                let s = sigmoid8(x);
                let slope = _mm256_add_ps(one, _mm256_mul_ps(x, _mm256_sub_ps(one, s)));
                let dg = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(g, u), s), slope);
                _mm256_storeu_ps(d_gate.as_mut_ptr().add(e), dg);
                _mm256_storeu_ps(
                    d_up.as_mut_ptr().add(e),
                    _mm256_mul_ps(g, _mm256_mul_ps(x, s)),
                );
            }
        }
        swiglu_grad_scalar(
            (&gate[whole..], &up[whole..], &grad[whole..]),
            (&mut d_gate[whole..], &mut d_up[whole..]),
        );
    }

    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn max(xs: &[f32]) -> f32 {
        let (lanes, tail) = xs.as_chunks::<8>();
        let mut most = _mm256_set1_ps(f32::NEG_INFINITY);
        for chunk in lanes {
            // SAFETY: the chunk holds the eight values loaded.
            most = _mm256_max_ps(most, unsafe { _mm256_loadu_ps(chunk.as_ptr()) });
        }
        let mut lane_most = [0.0f32; 8];
        // SAFETY: eight values stored into eight.
        unsafe { _mm256_storeu_ps(lane_most.as_mut_ptr(), most) };
        lane_most
            .iter()
            .chain(tail)
            .copied()
            .fold(f32::NEG_INFINITY, f32::max)
    }

    /// `1 / (1 + exp(-x))` of eight values, as `sigmoid_of` computes each.
    #[target_feature(enable = "avx2,fma")]
    fn sigmoid8(x: __m256) -> __m256 {
        let one = _mm256_set1_ps(1.0);
        let e = exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0)));
        _mm256_div_ps(one, _mm256_add_ps(one, e))
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

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{HIGHEST, Halves, LN2_HI, LN2_LO, LOG2E, LOWEST, POLY};

    /// The last chunk is loaded and stored under a mask, so no value takes a scalar path.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_shifted(xs: &mut [f32], shift: f32) -> f32 {
        let by = _mm512_set1_ps(shift);
        let mut sums = _mm512_setzero_ps();
        for chunk in xs.chunks_mut(16) {
            let mask = first_lanes(chunk.len());
            // SAFETY: the mask covers the chunk's values and no more.
            unsafe {
                let x = _mm512_maskz_loadu_ps(mask, chunk.as_ptr());
                let e = exp16(_mm512_sub_ps(x, by));
                sums = _mm512_mask_add_ps(sums, mask, sums, e);
                _mm512_mask_storeu_ps(chunk.as_mut_ptr(), mask, e);
            }
        }
        _mm512_reduce_add_ps(sums)
    }

    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sigmoid(xs: &mut [f32]) {
        for chunk in xs.chunks_mut(16) {
            let mask = first_lanes(chunk.len());
            // SAFETY: the mask covers the chunk's values and no more.
            unsafe {
                let x = _mm512_maskz_loadu_ps(mask, chunk.as_ptr());
                _mm512_mask_storeu_ps(chunk.as_mut_ptr(), mask, sigmoid16(x));
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F; `gate`, `up` and `out` have one length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        for (start, out) in (0..).step_by(16).zip(out.chunks_mut(16)) {
            let mask = first_lanes(out.len());
            // SAFETY: the mask covers the chunk's values and no more, and `gate` and `up` hold
            // as many from `start` as `out`.
            unsafe {
                let g = _mm512_maskz_loadu_ps(mask, gate.as_ptr().add(start));
                let u = _mm512_maskz_loadu_ps(mask, up.as_ptr().add(start));
                let gated = _mm512_mul_ps(sigmoid16(g), _mm512_mul_ps(g, u));
                _mm512_mask_storeu_ps(out.as_mut_ptr(), mask, gated);
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F; `gate` and `out` have one length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gate(gate: &[f32], out: &mut [f32]) {
        for (start, out) in (0..).step_by(16).zip(out.chunks_mut(16)) {
            let mask = first_lanes(out.len());
            // SAFETY: the mask covers the chunk's values and no more, and `gate` holds as many
            // from `start` as `out`.
            unsafe {
                let s = sigmoid16(_mm512_maskz_loadu_ps(mask, gate.as_ptr().add(start)));
                let o = _mm512_maskz_loadu_ps(mask, out.as_ptr());
                _mm512_mask_storeu_ps(out.as_mut_ptr(), mask, _mm512_mul_ps(o, s));
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F; the five slices have one length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn swiglu_grad(
        (gate, up, grad): (&[f32], &[f32], &[f32]),
        (d_gate, d_up): Halves,
    ) {
        let one = _mm512_set1_ps(1.0);
        for e in (0..grad.len()).step_by(16) {
            let mask = first_lanes((grad.len() - e).min(16));
            // SAFETY: the mask covers the values from `e` that every slice holds, and no more.
            unsafe {
                let x = _mm512_maskz_loadu_ps(mask, gate.as_ptr().add(e));
                let u = _mm512_maskz_loadu_ps(mask, up.as_ptr().add(e));
                let g = _mm512_maskz_loadu_ps(mask, grad.as_ptr().add(e));
                let s = sigmoid16(x);
                let slope = _mm512_add_ps(one, _mm512_mul_ps(x, _mm512_sub_ps(one, s)));
                let dg = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(g, u), s), slope);
                _mm512_mask_storeu_ps(d_gate.as_mut_ptr().add(e), mask, dg);
                let du = _mm512_mul_ps(g, _mm512_mul_ps(x, s));
                _mm512_mask_storeu_ps(d_up.as_mut_ptr().add(e), mask, du);
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn max(xs: &[f32]) -> f32 {
        let mut most = _mm512_set1_ps(f32::NEG_INFINITY);
        for chunk in xs.chunks(16) {
            let mask = first_lanes(chunk.len());
            // SAFETY: the mask covers the chunk's values and no more.
            let x = unsafe { _mm512_maskz_loadu_ps(mask, chunk.as_ptr()) };
            most = _mm512_mask_max_ps(most, mask, most, x);
        }
        _mm512_reduce_max_ps(most)
    }

    /// The mask of the first `n` of sixteen lanes (`n` at most 16).
    fn first_lanes(n: usize) -> __mmask16 {
        (1u32 << n).wrapping_sub(1) as __mmask16
    }

    /// `1 / (1 + exp(-x))` of sixteen values, as `sigmoid_of` computes each.
    #[target_feature(enable = "avx512f")]
    fn sigmoid16(x: __m512) -> __m512 {
        let one = _mm512_set1_ps(1.0);
        let e = exp16(_mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(x),
            _mm512_set1_epi32(i32::MIN),
        )));
        _mm512_div_ps(one, _mm512_add_ps(one, e))
    }

    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let low = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(LOWEST));
        let high = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(HIGHEST));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(
            _mm512_fmadd_ps(x, _mm512_set1_ps(LOG2E), _mm512_set1_ps(0.5)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut y = _mm512_set1_ps(POLY[0]);
        for &p in &POLY[1..] {
            y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(p));
        }
        let y = _mm512_add_ps(
            _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r),
            _mm512_set1_ps(1.0),
        );
        // Out-of-range lanes compute garbage exponents here; the masked moves below replace them.
        let power = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvttps_epi32(n),
            _mm512_set1_epi32(127),
        )));
        let result = _mm512_mul_ps(y, power);
        let result = _mm512_mask_mov_ps(result, low, _mm512_setzero_ps());
        let result = _mm512_mask_mov_ps(result, high, _mm512_set1_ps(f32::INFINITY));
        _mm512_mask_mov_ps(result, nan, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(xs: &[f32]) -> Vec<u32> {
        xs.iter().map(|x| x.to_bits()).collect()
    }

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    /// Against the correctly rounded `exp` (f64, rounded once) over the whole range, on every
    /// path this CPU has, and the specials; every path gives the scalar path's bits (its
    /// sigmoid too, and its SwiGLU, the sigmoid times `g · u`, for lengths with every tail), and
    /// its sum is the exact sum to within f32's rounding, for lengths that leave every size of
    /// tail.
    #[test]
    fn within_two_ulp_of_exp_and_the_same_bits_on_every_path() {
        let mut xs: Vec<f32> = (0..200_001)
            .map(|i| LOWEST + (HIGHEST - LOWEST) * i as f32 / 200_000.0)
            .collect();
        xs.extend([0.0, -0.0, 1.0, -1.0, 1e-8, -1e-8, 0.5, -0.5]);
        let mut reference = xs.clone();
        exp_shifted_on(Kernel::Scalar, &mut reference, 0.0);
        for (&x, &e) in xs.iter().zip(&reference) {
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
        for path in Kernel::supported() {
            let mut fast = xs.clone();
            exp_shifted_on(path, &mut fast, 0.0);
            for ((&x, &e), &r) in xs.iter().zip(&fast).zip(&reference) {
                assert_eq!(e.to_bits(), r.to_bits(), "{path:?}: exp({x})");
            }
            let mut sigmoids = xs.clone();
            sigmoid_on(path, &mut sigmoids);
            for (&x, &s) in xs.iter().zip(&sigmoids) {
                let scalar = 1.0 / (1.0 + exp_scalar(-x));
                assert_eq!(s.to_bits(), scalar.to_bits(), "{path:?}: sigmoid({x})");
            }
            let ups: Vec<f32> = (0..xs.len())
                .map(|i| (i as f32 * 0.61).cos() * 3.0)
                .collect();
            for len in [xs.len(), 0, 1, 7, 8, 9, 15, 16, 17, 33] {
                let (gate, up) = (&xs[xs.len() - len..], &ups[..len]);
                let mut gated = vec![f32::NAN; len];
                swiglu_on(path, gate, up, &mut gated);
                for ((&g, &u), &y) in gate.iter().zip(up).zip(&gated) {
                    let apart = (1.0 / (1.0 + exp_scalar(-g))) * (g * u);
                    assert_eq!(y.to_bits(), apart.to_bits(), "{path:?}: swiglu({g}, {u})");
                }
                let mut gated_out = up.to_vec();
                gate_on(path, gate, &mut gated_out);
                for ((&g, &u), &y) in gate.iter().zip(up).zip(&gated_out) {
                    let apart = u * (1.0 / (1.0 + exp_scalar(-g)));
                    assert_eq!(y.to_bits(), apart.to_bits(), "{path:?}: gate({g}) of {u}");
                }
                let grad = &ups[ups.len() - len..];
                let (mut d_gate, mut d_up) = (vec![f32::NAN; len], vec![f32::NAN; len]);
                swiglu_grad_on(path, (gate, up, grad), (&mut d_gate, &mut d_up));
                let mut theirs = (vec![f32::NAN; len], vec![f32::NAN; len]);
                swiglu_grad_scalar((gate, up, grad), (&mut theirs.0, &mut theirs.1));
                assert_eq!(bits(&d_gate), bits(&theirs.0), "{path:?}: gate gradient");
                assert_eq!(bits(&d_up), bits(&theirs.1), "{path:?}: up gradient");
            }
            let mut out = specials;
            exp_shifted_on(path, &mut out, 0.0);
            assert!(out[0].is_nan(), "{path:?}");
            assert_eq!(&out[1..4], &[0.0; 3], "{path:?}");
            assert_eq!(&out[4..], &[f32::INFINITY; 3], "{path:?}");
            for len in 0..40 {
                let row: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
                assert_eq!(
                    max_on(path, &row),
                    max_on(Kernel::Scalar, &row),
                    "{path:?}: max of {len} values"
                );
                let shift = 2.5;
                let mut shifted = row.clone();
                let sum = exp_shifted_on(path, &mut shifted, shift);
                let exact: f64 = row.iter().map(|&x| ((x - shift) as f64).exp()).sum();
                assert!(
                    (sum as f64 - exact).abs() <= exact * 1e-6,
                    "{path:?}, {len} values: sum {sum}, exact {exact}"
                );
                for (&x, &e) in row.iter().zip(&shifted) {
                    assert_eq!(e.to_bits(), exp_scalar(x - shift).to_bits(), "{path:?}");
                }
            }
        }
        assert_eq!(exp_scalar(0.0), 1.0);
        let mut s = [0.0, 100.0, -100.0, 2.0];
        sigmoid_in_place(&mut s);
        assert_eq!(&s[..3], &[0.5, 1.0, 0.0]);
        assert!((s[3] - 1.0 / (1.0 + (-2f32).exp())).abs() < 1e-7);
    }
}
