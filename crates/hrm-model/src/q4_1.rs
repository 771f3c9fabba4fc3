//! The CPU matmul for GGUF Q4_1 weights, for every pass (decode, prefill and scoring).
//!
//! candle 0.11 computes the Q4_1 × Q8_1 dot product with scalar code, which made decode of Q4_1
//! models compute-bound far below the memory-bandwidth limit. This module owns a replacement
//! with an AVX2 dot product. It reads the `QTensor`'s blocks in place (no second copy of the
//! weights), quantises the activations to Q8_1 as candle does and keeps candle's float
//! arithmetic, so its outputs equal candle's bit for bit: switching kernels changes no token.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{D, DType, Result, Tensor};

/// Elements per Q4_1 and Q8_1 block.
const QK: usize = 32;
/// Bytes per ggml Q4_1 block: f16 scale `d`, f16 minimum `m`, then 16 bytes of nibbles
/// (element `j` in the low nibble of byte `j`, element `j + 16` in its high nibble).
const Q4_1_BYTES: usize = 20;
/// Activation rows dotted against one weight row per pass, so that each weight block is
/// unpacked once for up to this many rows.
const ROW_TILE: usize = 4;

/// Whether `Linear` should route `x · qᵀ` here rather than through candle.
pub(crate) fn applies(q: &QTensor, x: &Tensor) -> bool {
    q.dtype() == GgmlDType::Q4_1
        && q.device().is_cpu()
        && x.device().is_cpu()
        && x.dtype() == DType::F32
        && q.shape().rank() == 2
}

/// `x · qᵀ` for a Q4_1 `q` of shape (out, in) and an f32 `x` of shape (..., in), like
/// candle's `QMatMul::forward`.
pub(crate) fn forward(q: &QTensor, x: &Tensor) -> Result<Tensor> {
    let (out, k) = q.shape().dims2()?;
    let data = q.data()?;
    let weights = Q4_1Weights::new(&data, out, k)?;
    if x.rank() < 2 || x.dim(D::Minus1)? != k {
        candle_core::bail!(
            "q4_1 matmul: input {:?} against weights ({out}, {k})",
            x.shape()
        );
    }
    let x = x.contiguous()?;
    let rows = x.elem_count() / k;
    let y = {
        let (storage, layout) = x.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("q4_1 matmul: input is not on the CPU");
        };
        let start = layout.start_offset();
        weights.matmul(&cpu.as_slice::<f32>()?[start..start + rows * k], rows)
    };
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("rank checked above") = out;
    Tensor::from_vec(y, dims, x.device())
}

/// A Q4_1 weight matrix of shape (out, in), borrowed as ggml's raw block bytes.
pub(crate) struct Q4_1Weights<'a> {
    blocks: &'a [u8],
    out: usize,
    k: usize,
}

impl<'a> Q4_1Weights<'a> {
    pub(crate) fn new(blocks: &'a [u8], out: usize, k: usize) -> Result<Self> {
        if k == 0 || !k.is_multiple_of(QK) || blocks.len() != out * (k / QK) * Q4_1_BYTES {
            candle_core::bail!(
                "q4_1 matmul: {} bytes do not hold ({out}, {k}) Q4_1 weights",
                blocks.len()
            );
        }
        Ok(Self { blocks, out, k })
    }

    /// Weight rows `range`, contiguous.
    fn rows(&self, range: std::ops::Range<usize>) -> &'a [u8] {
        let len = self.k / QK * Q4_1_BYTES;
        &self.blocks[range.start * len..range.end * len]
    }

    /// `x · Wᵀ` for `rows` f32 rows of length `in`, row-major (rows, out).
    pub(crate) fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        self.matmul_with(Kernel::detect(), x, rows)
    }

    fn matmul_with(&self, kernel: Kernel, x: &[f32], rows: usize) -> Vec<f32> {
        assert_eq!(x.len(), rows * self.k, "q4_1 matmul: input length");
        let nb = self.k / QK;
        let xq: Vec<Q8_1> = x
            .as_chunks::<QK>()
            .0
            .iter()
            .map(|b| Q8_1::from(quantize_q8_1(b)))
            .collect();
        let xs: Vec<&[Q8_1]> = xq.chunks_exact(nb).collect();
        crate::decode_matmul::columns_in_parallel(rows, self.out, |range, block| {
            let w = self.rows(range.clone());
            let mut dots = vec![0f32; range.len() * ROW_TILE];
            for (t, tile) in xs.chunks(ROW_TILE).enumerate() {
                let dots = &mut dots[..range.len() * tile.len()];
                kernel.dot_rows(w, nb, tile, dots);
                for (column, dots) in block
                    .chunks_exact_mut(rows)
                    .zip(dots.chunks_exact(tile.len()))
                {
                    column[t * ROW_TILE..][..tile.len()].copy_from_slice(dots);
                }
            }
        })
    }
}

/// One activation block quantised to Q8_1, with the f16 scales already widened (exactly) to
/// f32 since every weight row reuses them.
#[derive(Clone, Copy, Debug)]
struct Q8_1 {
    /// `d`: the scale.
    d: f32,
    /// `s`: `d` times the sum of `qs`, as candle rounds it through f16.
    s: f32,
    qs: [i8; QK],
}

/// ggml's Q8_1 block as raw fields: f16 bits of `d` and `s`, then the quants.
type Q8_1Raw = (u16, u16, [i8; QK]);

impl From<Q8_1Raw> for Q8_1 {
    fn from((d, s, qs): Q8_1Raw) -> Self {
        Self {
            d: f16_to_f32(d),
            s: f16_to_f32(s),
            qs,
        }
    }
}

/// candle's `BlockQ8_1::from_float` (ggml's `quantize_row_q8_1` reference) for one block. Its
/// fields are private to candle, so the arithmetic is repeated here operation for operation.
fn quantize_q8_1(xs: &[f32; QK]) -> Q8_1Raw {
    let mut amax = 0f32;
    for &x in xs {
        amax = amax.max(x.abs());
    }
    let d = amax / ((1 << 7) - 1) as f32;
    let id = if d != 0f32 { 1. / d } else { 0. };
    let d = f32_to_f16(d);
    let mut qs = [0i8; QK];
    let mut sum = 0i32;
    for j in 0..QK / 2 {
        qs[j] = f32::round(xs[j] * id) as i8;
        qs[j + QK / 2] = f32::round(xs[j + QK / 2] * id) as i8;
        sum += qs[j] as i32 + qs[j + QK / 2] as i32;
    }
    // half's f16 product: both factors widened, multiplied in f32, rounded back.
    let s = f32_to_f16(f16_to_f32(f32_to_f16(sum as f32)) * f16_to_f32(d));
    (d, s, qs)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Kernel {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
            return Self::Avx2;
        }
        Self::Scalar
    }

    /// `out[j * xs.len() + i] = w_j · xs[i]` for consecutive weight rows `w_j` of `nb` blocks
    /// and up to `ROW_TILE` activation rows.
    fn dot_rows(self, w: &[u8], nb: usize, xs: &[&[Q8_1]], out: &mut [f32]) {
        match *xs {
            [a] => self.dot_rows_of::<1>(w, nb, [a], out),
            [a, b] => self.dot_rows_of::<2>(w, nb, [a, b], out),
            [a, b, c] => self.dot_rows_of::<3>(w, nb, [a, b, c], out),
            [a, b, c, d] => self.dot_rows_of::<4>(w, nb, [a, b, c, d], out),
            _ => unreachable!("row tile of {}", xs.len()),
        }
    }

    fn dot_rows_of<const R: usize>(self, w: &[u8], nb: usize, xs: [&[Q8_1]; R], out: &mut [f32]) {
        let out = out.as_chunks_mut::<R>().0;
        match self {
            Self::Scalar => {
                for (w, out) in w.chunks_exact(nb * Q4_1_BYTES).zip(out) {
                    *out = xs.map(|x| dot_scalar(w, x));
                }
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect` chose this kernel only after finding avx2 and f16c.
            Self::Avx2 => unsafe { avx2::dot_rows(w, nb, xs, out) },
        }
    }
}

/// candle's `BlockQ4_1::vec_dot_unopt`, in its order of operations.
fn dot_scalar(w: &[u8], xs: &[Q8_1]) -> f32 {
    let mut sumf = 0f32;
    for (w, x) in w.as_chunks::<Q4_1_BYTES>().0.iter().zip(xs) {
        let d = f16_to_f32(u16::from_le_bytes([w[0], w[1]]));
        let m = f16_to_f32(u16::from_le_bytes([w[2], w[3]]));
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            let q = w[4 + j];
            sumi += (q & 0x0F) as i32 * x.qs[j] as i32 + (q >> 4) as i32 * x.qs[j + QK / 2] as i32;
        }
        sumf += sumi as f32 * d * x.d + m * x.s;
    }
    sumf
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Q4_1_BYTES, Q8_1};

    /// Dot products of weight rows against `R` activation rows, four (weight row, activation
    /// row) pairs at a time: `W` weight rows against all `R` activation rows, padded to four.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) fn dot_rows<const R: usize>(
        w: &[u8],
        nb: usize,
        xs: [&[Q8_1]; R],
        out: &mut [[f32; R]],
    ) {
        match R {
            1 => rows_by::<4, R>(w, nb, xs, out),
            2 => rows_by::<2, R>(w, nb, xs, out),
            _ => rows_by::<1, R>(w, nb, xs, out),
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn rows_by<const W: usize, const R: usize>(
        w: &[u8],
        nb: usize,
        xs: [&[Q8_1]; R],
        out: &mut [[f32; R]],
    ) {
        let lanes_per_row = 4 / W;
        let n = out.len();
        let row = |j: usize| {
            w[j * nb * Q4_1_BYTES..(j + 1) * nb * Q4_1_BYTES]
                .as_chunks()
                .0
        };
        let xs = xs.map(|x| &x[..nb]);
        // Every weight row reuses the lanes' activation scales, so they are gathered once.
        let x_of = |l: usize| l % lanes_per_row % R;
        let scales: Vec<[__m128; 2]> = (0..nb)
            .map(|b| {
                let x = |l: usize| &xs[x_of(l)][b];
                [
                    _mm_setr_ps(x(0).d, x(1).d, x(2).d, x(3).d),
                    _mm_setr_ps(x(0).s, x(1).s, x(2).s, x(3).s),
                ]
            })
            .collect();
        for j0 in (0..n).step_by(W) {
            // A short last group repeats its last row; those lanes are discarded.
            let ws: [&[[u8; Q4_1_BYTES]]; W] = std::array::from_fn(|i| row((j0 + i).min(n - 1)));
            let sums = dot4::<W, R>(ws, &xs, &scales);
            for (i, out) in out[j0..].iter_mut().take(W).enumerate() {
                for (r, out) in out.iter_mut().enumerate() {
                    *out = sums[i * lanes_per_row + r];
                }
            }
        }
    }

    /// candle's `BlockQ4_1::vec_dot_unopt` for four (weight row, activation row) pairs, one per
    /// lane: lane `l` pairs weight row `l / (4 / W)` with activation row `l % (4 / W) % R`.
    /// Each block's integer dot product is exact in any order, so the SIMD sums it freely; the
    /// float steps after it run per lane in candle's order, without FMA, so every lane equals
    /// candle's scalar result bit for bit.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn dot4<const W: usize, const R: usize>(
        ws: [&[[u8; Q4_1_BYTES]]; W],
        xs: &[&[Q8_1]; R],
        scales: &[[__m128; 2]],
    ) -> [f32; 4] {
        let lanes_per_row = 4 / W;
        let w_of = |l: usize| l / lanes_per_row;
        let x_of = |l: usize| l % lanes_per_row % R;
        // Picks each lane's weight d (low half) and m (high half) out of the converted
        // [d0, m0, d1, m1, ..] of the group's blocks.
        let pick = _mm256_setr_epi32(
            2 * w_of(0) as i32,
            2 * w_of(1) as i32,
            2 * w_of(2) as i32,
            2 * w_of(3) as i32,
            2 * w_of(0) as i32 + 1,
            2 * w_of(1) as i32 + 1,
            2 * w_of(2) as i32 + 1,
            2 * w_of(3) as i32 + 1,
        );
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut sumf = _mm_setzero_ps();
        for (b, &[dx, sx]) in scales.iter().enumerate() {
            let mut dm = [0i32; 4];
            let mut qw = [_mm256_setzero_si256(); W];
            for ((dm, qw), blocks) in dm.iter_mut().zip(&mut qw).zip(&ws) {
                let blk = &blocks[b];
                *dm = i32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
                let packed = load_16(blk[4..].try_into().expect("a block has 16 quant bytes"));
                // Low nibbles are elements 0..16, high nibbles 16..32: Q8_1's order.
                *qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
            }
            let dm = _mm256_permutevar8x32_ps(
                _mm256_cvtph_ps(_mm_setr_epi32(dm[0], dm[1], dm[2], dm[3])),
                pick,
            );
            let (d, m) = (_mm256_castps256_ps128(dm), _mm256_extractf128_ps(dm, 1));
            let qx: [__m256i; R] = std::array::from_fn(|r| load_32(&xs[r][b].qs));
            // maddubs saturates at i16, which 2 · 15 · 127 never reaches.
            let p: [__m256i; 4] = std::array::from_fn(|l| {
                _mm256_madd_epi16(_mm256_maddubs_epi16(qw[w_of(l)], qx[x_of(l)]), ones)
            });
            let sumi =
                _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
            let sumi = _mm_add_epi32(
                _mm256_castsi256_si128(sumi),
                _mm256_extracti128_si256(sumi, 1),
            );
            // sumi · d_w · d_x + m_w · s_x, as candle evaluates it.
            let v = _mm_add_ps(
                _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(sumi), d), dx),
                _mm_mul_ps(m, sx),
            );
            sumf = _mm_add_ps(sumf, v);
        }
        [
            f32::from_bits(_mm_extract_ps::<0>(sumf) as u32),
            f32::from_bits(_mm_extract_ps::<1>(sumf) as u32),
            f32::from_bits(_mm_extract_ps::<2>(sumf) as u32),
            f32::from_bits(_mm_extract_ps::<3>(sumf) as u32),
        ]
    }

    #[target_feature(enable = "avx2")]
    fn load_16(bytes: &[u8; 16]) -> __m128i {
        // SAFETY: the reference covers the 16 bytes read; the load has no alignment requirement.
        unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) }
    }

    #[target_feature(enable = "avx2")]
    fn load_32(bytes: &[i8; 32]) -> __m256i {
        // SAFETY: the reference covers the 32 bytes read; the load has no alignment requirement.
        unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) }
    }
}

/// IEEE binary16 bits to f32 (exact).
fn f16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

/// f32 to IEEE binary16 bits, rounding to nearest even, with the `half` crate candle itself
/// uses for Q8_1's scales.
fn f32_to_f16(value: f32) -> u16 {
    half::f16::from_f32(value).to_bits()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module};

    use super::*;

    fn random(shape: (usize, usize), seed: u64) -> Tensor {
        // A fixed xorshift stream, so a failure reproduces.
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let data: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    /// (candle's `QMatMul` output, ours with `kernel`) for a random (out, k) Q4_1 matrix.
    fn against_candle(out: usize, k: usize, rows: usize, kernel: Kernel) -> (Vec<f32>, Vec<f32>) {
        let q = Arc::new(QTensor::quantize(&random((out, k), 1), GgmlDType::Q4_1).unwrap());
        let x = random((rows, k), 2);
        let expected = QMatMul::from_arc(q.clone())
            .unwrap()
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let data = q.data().unwrap();
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let got = Q4_1Weights::new(&data, out, k)
            .unwrap()
            .matmul_with(kernel, &xs, rows);
        (expected, got)
    }

    const SHAPES: [(usize, usize); 3] = [(37, 64), (301, 4096), (576, 1536)];

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn q4_1_detected_kernel_is_candles_arithmetic() {
        for (out, k) in SHAPES {
            for rows in [1, 2, 3, 4, 9] {
                let (expected, got) = against_candle(out, k, rows, Kernel::detect());
                assert_eq!(bits(&expected), bits(&got), "({out}, {k}) × {rows} rows");
            }
        }
    }

    #[test]
    fn q4_1_scalar_kernel_is_candles_arithmetic() {
        for (out, k) in SHAPES {
            for rows in [1, 3] {
                let (expected, got) = against_candle(out, k, rows, Kernel::Scalar);
                assert_eq!(bits(&expected), bits(&got), "({out}, {k}) × {rows} rows");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q4_1_avx2_kernel_matches_scalar() {
        if Kernel::detect() != Kernel::Avx2 {
            eprintln!("no AVX2+F16C on this CPU; the dispatch test covers the scalar path");
            return;
        }
        // Output counts that leave every remainder of the 4- and 2-row weight groups.
        for out in [1, 2, 3, 5, 6, 203] {
            let q = QTensor::quantize(&random((out, 4096), 3), GgmlDType::Q4_1).unwrap();
            let data = q.data().unwrap();
            let w = Q4_1Weights::new(&data, out, 4096).unwrap();
            for rows in 1..=8 {
                let xs = random((rows, 4096), 4)
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let scalar = w.matmul_with(Kernel::Scalar, &xs, rows);
                let simd = w.matmul_with(Kernel::Avx2, &xs, rows);
                assert_eq!(bits(&scalar), bits(&simd), "{out} outputs, {rows} rows");
            }
        }
    }

    #[test]
    fn q4_1_activation_blocks_are_candles_q8_1_bytes() {
        let mut x = random((4, 256), 5)
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        // An all-zero block (d = 0), one whose scale underflows f16, and large values.
        x[..32].fill(0.0);
        x[32..64].iter_mut().for_each(|v| *v *= 1e-6);
        x[64..96].iter_mut().for_each(|v| *v *= 3e3);
        let t = Tensor::from_vec(x.clone(), (4, 256), &Device::Cpu).unwrap();
        let candle = QTensor::quantize(&t, GgmlDType::Q8_1).unwrap();
        let ours: Vec<u8> = x
            .as_chunks::<QK>()
            .0
            .iter()
            .flat_map(|b| {
                let (d, s, qs) = quantize_q8_1(b);
                let mut bytes = Vec::with_capacity(36);
                bytes.extend(d.to_le_bytes());
                bytes.extend(s.to_le_bytes());
                bytes.extend(qs.map(|q| q as u8));
                bytes
            })
            .collect();
        assert_eq!(&*candle.data().unwrap(), &ours[..]);
    }
}
