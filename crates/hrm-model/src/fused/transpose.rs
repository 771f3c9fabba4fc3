//! A column-major block of a product's output moved into its row-major place, eight by eight
//! values at a time on AVX (`gemm_at`'s narrow products write their blocks column-major).
//!
//! The scalar loop is the reference and the fallback; both only move values, so they give the
//! same bits.

use std::ops::Range;

/// Writes the column-major `m × n` `block` (column `j` at `block[j * m..]`) as `m` rows of `n`
/// values, `ld` apart, at `dst`.
///
/// # Safety
/// `dst` must be valid for writes of row `i`'s `n` values at `dst + i · ld` for every `i < m`,
/// and nothing else may read or write them meanwhile.
pub(super) unsafe fn columns_into_rows(
    block: &[f32],
    (m, n): (usize, usize),
    dst: *mut f32,
    ld: usize,
) {
    assert!(block.len() >= m * n, "transpose: block too short");
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX; the caller vouches for `dst`.
        unsafe { avx::columns_into_rows(block, (m, n), dst, ld) };
        return;
    }
    // SAFETY: the caller vouches for `dst`.
    unsafe { scalar(block, m, dst, ld, (0..m, 0..n)) };
}

/// [`columns_into_rows`] of an `m`-row block one value at a time, for the given rows and
/// columns.
///
/// # Safety
/// As [`columns_into_rows`], for those rows and columns.
unsafe fn scalar(
    block: &[f32],
    m: usize,
    dst: *mut f32,
    ld: usize,
    (rows, columns): (Range<usize>, Range<usize>),
) {
    for i in rows {
        for j in columns.clone() {
            // SAFETY: the caller vouches for element `(i, j)` at `dst + i · ld + j`.
            unsafe { *dst.add(i * ld + j) = block[j * m + i] };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU has AVX; otherwise as [`super::columns_into_rows`].
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn columns_into_rows(
        block: &[f32],
        (m, n): (usize, usize),
        dst: *mut f32,
        ld: usize,
    ) {
        let (full_m, full_n) = (m / 8 * 8, n / 8 * 8);
        for i0 in (0..full_m).step_by(8) {
            for j0 in (0..full_n).step_by(8) {
                // SAFETY: columns `j0..j0 + 8` hold rows `i0..i0 + 8` inside `block` (its
                // length was checked), and the caller vouches for the eight rows' values at
                // `dst`.
                unsafe {
                    let column = |j: usize| _mm256_loadu_ps(block.as_ptr().add((j0 + j) * m + i0));
                    let rows = transpose8([
                        column(0),
                        column(1),
                        column(2),
                        column(3),
                        column(4),
                        column(5),
                        column(6),
                        column(7),
                    ]);
                    for (i, row) in rows.into_iter().enumerate() {
                        _mm256_storeu_ps(dst.add((i0 + i) * ld + j0), row);
                    }
                }
            }
        }
        // SAFETY: as above; the edges are the rows below `full_m` and the columns right of
        // `full_n`.
        unsafe {
            super::scalar(block, m, dst, ld, (full_m..m, 0..n));
            super::scalar(block, m, dst, ld, (0..full_m, full_n..n));
        }
    }

    /// The 8 × 8 transpose: lane `i` of input `j` becomes lane `j` of output `i`.
    #[target_feature(enable = "avx")]
    fn transpose8(v: [__m256; 8]) -> [__m256; 8] {
        let pairs = |a, b| (_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
        let (t0, t1) = pairs(v[0], v[1]);
        let (t2, t3) = pairs(v[2], v[3]);
        let (t4, t5) = pairs(v[4], v[5]);
        let (t6, t7) = pairs(v[6], v[7]);
        let quads = |a, b| {
            (
                _mm256_shuffle_ps::<0x44>(a, b),
                _mm256_shuffle_ps::<0xEE>(a, b),
            )
        };
        let (q0, q1) = quads(t0, t2);
        let (q2, q3) = quads(t1, t3);
        let (q4, q5) = quads(t4, t6);
        let (q6, q7) = quads(t5, t7);
        let low = |a, b| _mm256_permute2f128_ps::<0x20>(a, b);
        let high = |a, b| _mm256_permute2f128_ps::<0x31>(a, b);
        [
            low(q0, q4),
            low(q1, q5),
            low(q2, q6),
            low(q3, q7),
            high(q0, q4),
            high(q1, q5),
            high(q2, q6),
            high(q3, q7),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(block: &[f32], (m, n): (usize, usize), ld: usize) -> Vec<f32> {
        let mut out = vec![-1.0; m * ld];
        for i in 0..m {
            for j in 0..n {
                out[i * ld + j] = block[j * m + i];
            }
        }
        out
    }

    #[test]
    fn every_value_lands_in_its_row_and_nothing_else_is_written() {
        // Whole tiles, ragged edges on either side, and fewer than eight rows or columns.
        for (m, n, ld) in [
            (16, 24, 24),
            (19, 13, 40),
            (8, 8, 8),
            (5, 3, 7),
            (1, 17, 17),
            (33, 1, 2),
        ] {
            let block: Vec<f32> = (0..m * n).map(|v| v as f32 + 0.5).collect();
            let want = reference(&block, (m, n), ld);
            let mut fast = vec![-1.0; m * ld];
            let mut slow = vec![-1.0; m * ld];
            // SAFETY: both outputs hold `m` rows `ld` apart, each at least `n` long.
            unsafe {
                columns_into_rows(&block, (m, n), fast.as_mut_ptr(), ld);
                scalar(&block, m, slow.as_mut_ptr(), ld, (0..m, 0..n));
            }
            assert_eq!(fast, want, "{m} × {n}, ld {ld}");
            assert_eq!(slow, want, "{m} × {n}, ld {ld}, scalar");
        }
    }
}
