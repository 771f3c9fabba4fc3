//! The CPU matmul `x · qᵀ` for GGUF weights in Q4_1 and Q8_0, for every pass (decode, prefill
//! and scoring).
//!
//! candle 0.11 has no SIMD dot product for Q4_1, and its Q8_0 matmul hands each (row, column)
//! pair to a separate call and, for passes over several positions, our layer dequantised the
//! whole matrix to f32 first. This module reads each weight block in place (no second copy of
//! the weights), quantises the activations to 8 bits per block of 32, and multiplies blocks in
//! exact integer arithmetic, unpacking each weight block once for up to [`ROW_TILE`] activation
//! rows.
//!
//! The arithmetic, which the scalar kernel spells out and every vector kernel repeats:
//! - an activation block `x` (32 values) becomes `d = max|x| / 127`, `q = round_ties_even(x ·
//!   (1 / d))` (0 when `d` is 0) and `s = d · Σq`, all in f32 (ggml rounds `d` and `s` to f16;
//!   we keep them exact);
//! - the block product of weight block `b` with activation block `b` is eight lane sums
//!   `Σ w_q · x_q` over elements `4l..4l + 4` (exact in i32), each added as
//!   `acc[b % 2][l] = fma(d_w · d_x, sum_l, acc[b % 2][l])`; Q4_1's minimum adds
//!   `min[b % 2] = fma(m_w, s_x, min[b % 2])`;
//! - the result is `(Σ_l (acc[0] + acc[1])) + (min[0] + min[1])`, the eight lanes summed as
//!   `((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))`.
//!
//! Invariants:
//! - Every kernel (scalar, AVX2, AVX2 with VNNI) gives the same bits for finite inputs, and an
//!   output depends only on its own activation row, never on the batch around it, so a
//!   sequence's tokens and scores do not change with batching or with the CPU's instruction
//!   sets. The tests hold every kernel the CPU has to the scalar one.
//! - VNNI's `vpdpbusd` (AVX-512 VNNI on 256-bit registers) forms each lane's four products and
//!   their sum in one instruction, where AVX2 needs two (`maddubs`, then `madd`); both sums are
//!   exact, so the two kernels differ only in speed. A 512-bit kernel, two blocks per register,
//!   measured slower than either on an AVX-512 AMD EPYC (its 512-bit operations take two
//!   256-bit passes, and pairing blocks costs shuffles) and no faster on an AVX-512 Intel Xeon,
//!   so there is none.
//! - Outputs differ from candle's (f16 scales, another summation order) and from the exact
//!   product by the activations' 8-bit rounding: at most `Σ_b (d_x,b / 2) · Σ|w_b|` plus f32
//!   rounding, which the tests check.
//! - Non-finite activations make the output meaningless on every path (not necessarily the same
//!   bits).

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{D, DType, Result, Tensor};

/// Elements per weight and activation block.
const QK: usize = 32;
/// Bytes per ggml Q4_1 block: f16 scale `d`, f16 minimum `m`, then 16 bytes of nibbles
/// (element `j` in the low nibble of byte `j`, element `j + 16` in its high nibble).
const Q4_1_BYTES: usize = 20;
/// Bytes per ggml Q8_0 block: f16 scale `d`, then 32 signed bytes.
const Q8_0_BYTES: usize = 34;
/// Activation rows dotted against one weight row per pass, so that each weight block is
/// unpacked once for up to this many rows: [`Kernel::row_tile`] of them, at most this.
const ROW_TILE: usize = 8;
/// How far ahead of the block being read the vector kernels ask for weights. On an Intel Xeon
/// with AVX-512 and AMX (family 6 model 167), whose weights stayed in its large L3, the hardware
/// prefetcher fell behind the kernel: asking 4 KiB ahead made GGUF decode 1.48× faster at batch
/// 1 and 1.58× at batch 8, alternately against no prefetch (1 KiB: 1.40× and 1.51×; 16 KiB:
/// slower than 4 KiB at batch 8). On a Zen 5 AMD EPYC (family 26 model 2), whose weights do not
/// stay in cache, 4 KiB is still best at batch 1 (1 KiB 0.93×, 16 KiB 0.99×, four alternating
/// runs), while 1 KiB measured 1.08× at batch 8. The weights lie contiguously, so the address
/// runs on into the next rows; past the end, a prefetch is a hint that never faults.
const PREFETCH_AHEAD: usize = 4096;
/// Lanes of eight 4-element sums per block (one AVX2 register of i32).
const LANES: usize = 8;

/// Whether `Linear` should route `x · qᵀ` here rather than through candle.
pub(crate) fn applies(q: &QTensor, x: &Tensor) -> bool {
    Format::of(q.dtype()).is_some()
        && q.device().is_cpu()
        && x.device().is_cpu()
        && x.dtype() == DType::F32
        && q.shape().rank() == 2
}

/// `x · qᵀ` for a Q4_1 or Q8_0 `q` of shape (out, in) and an f32 `x` of shape (..., in), like
/// candle's `QMatMul::forward`.
pub(crate) fn forward(q: &QTensor, x: &Tensor) -> Result<Tensor> {
    let Some(format) = Format::of(q.dtype()) else {
        candle_core::bail!("quantised matmul: {:?} weights", q.dtype());
    };
    let (out, k) = q.shape().dims2()?;
    let data = q.data()?;
    let weights = QuantWeights::new(format, &data, out, k)?;
    if x.rank() < 2 || x.dim(D::Minus1)? != k {
        candle_core::bail!(
            "quantised matmul: input {:?} against weights ({out}, {k})",
            x.shape()
        );
    }
    let x = x.contiguous()?;
    let rows = x.elem_count() / k;
    let y = {
        let (storage, layout) = x.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("quantised matmul: input is not on the CPU");
        };
        weights.matmul(crate::fused::values(cpu, layout)?, rows)
    };
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("rank checked above") = out;
    Tensor::from_vec(y, dims, x.device())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Q4_1,
    Q8_0,
}

impl Format {
    fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            _ => None,
        }
    }

    fn block_bytes(self) -> usize {
        match self {
            Self::Q4_1 => Q4_1_BYTES,
            Self::Q8_0 => Q8_0_BYTES,
        }
    }

    /// A block's scale, minimum (0 for Q8_0) and 32 quants in element order.
    fn unpack(self, block: &[u8]) -> (f32, f32, [i8; QK]) {
        let f16 = |i: usize| half::f16::from_le_bytes([block[i], block[i + 1]]).to_f32();
        match self {
            Self::Q4_1 => {
                let nibbles = &block[4..Q4_1_BYTES];
                let q = std::array::from_fn(|j| {
                    let byte = nibbles[j % 16];
                    (if j < 16 { byte & 0x0F } else { byte >> 4 }) as i8
                });
                (f16(0), f16(2), q)
            }
            Self::Q8_0 => (f16(0), 0.0, std::array::from_fn(|j| block[2 + j] as i8)),
        }
    }
}

/// A quantised weight matrix of shape (out, in), borrowed as ggml's raw block bytes.
struct QuantWeights<'a> {
    format: Format,
    blocks: &'a [u8],
    out: usize,
    k: usize,
}

impl<'a> QuantWeights<'a> {
    fn new(format: Format, blocks: &'a [u8], out: usize, k: usize) -> Result<Self> {
        if k == 0 || !k.is_multiple_of(QK) || blocks.len() != out * (k / QK) * format.block_bytes()
        {
            candle_core::bail!(
                "quantised matmul: {} bytes do not hold ({out}, {k}) {format:?} weights",
                blocks.len()
            );
        }
        Ok(Self {
            format,
            blocks,
            out,
            k,
        })
    }

    /// Weight rows `range`, contiguous.
    fn rows(&self, range: std::ops::Range<usize>) -> &'a [u8] {
        let len = self.k / QK * self.format.block_bytes();
        &self.blocks[range.start * len..range.end * len]
    }

    /// `x · Wᵀ` for `rows` f32 rows of length `in`, row-major (rows, out).
    fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        self.matmul_with(Kernel::detect(), x, rows)
    }

    fn matmul_with(&self, kernel: Kernel, x: &[f32], rows: usize) -> Vec<f32> {
        assert_eq!(x.len(), rows * self.k, "quantised matmul: input length");
        let nb = self.k / QK;
        let xq: Vec<ActBlock> = x
            .as_chunks::<QK>()
            .0
            .iter()
            .map(|b| kernel.quantize(b))
            .collect();
        let xs: Vec<&[ActBlock]> = xq.chunks_exact(nb).collect();
        crate::team::columns_in_parallel(rows, self.out, |range, block| {
            let w = self.rows(range.clone());
            let row_tile = kernel.row_tile();
            if (1..=row_tile).contains(&rows) {
                // One tile: the kernel's column-major output is the block's own layout.
                kernel.dot_rows(self.format, w, nb, &xs, block);
                return;
            }
            let mut dots = vec![0f32; range.len() * row_tile];
            for (t, tile) in xs.chunks(row_tile).enumerate() {
                let dots = &mut dots[..range.len() * tile.len()];
                kernel.dot_rows(self.format, w, nb, tile, dots);
                for (column, dots) in block
                    .chunks_exact_mut(rows)
                    .zip(dots.chunks_exact(tile.len()))
                {
                    column[t * row_tile..][..tile.len()].copy_from_slice(dots);
                }
            }
        })
    }
}

/// One activation block quantised to 8 bits: `x ≈ d · qs`, and `s = d · Σqs`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct ActBlock {
    d: f32,
    s: f32,
    qs: [i8; QK],
}

/// The activation quantisation that every kernel repeats (see the module doc).
fn quantize_scalar(xs: &[f32; QK]) -> ActBlock {
    let amax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let qs = xs.map(|x| (x * id).round_ties_even() as i8);
    let sum: i32 = qs.iter().map(|&q| i32::from(q)).sum();
    ActBlock {
        d,
        s: d * sum as f32,
        qs,
    }
}

/// One weight row against one activation row, in the module's order of operations.
fn dot_scalar(format: Format, w: &[u8], xs: &[ActBlock]) -> f32 {
    let mut acc = [[0f32; LANES]; 2];
    let mut min = [0f32; 2];
    for (b, (block, x)) in w.chunks_exact(format.block_bytes()).zip(xs).enumerate() {
        let (d, m, q) = format.unpack(block);
        let dd = d * x.d;
        for (l, acc) in acc[b % 2].iter_mut().enumerate() {
            let sum: i32 = (4 * l..4 * l + 4)
                .map(|j| i32::from(q[j]) * i32::from(x.qs[j]))
                .sum();
            *acc = dd.mul_add(sum as f32, *acc);
        }
        if format == Format::Q4_1 {
            min[b % 2] = m.mul_add(x.s, min[b % 2]);
        }
    }
    let v: [f32; LANES] = std::array::from_fn(|l| acc[0][l] + acc[1][l]);
    (((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))) + (min[0] + min[1])
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// The AVX2 kernel with VNNI's byte dot product (AVX-512 VNNI and VL).
    #[cfg(target_arch = "x86_64")]
    Avx2Vnni,
}

impl Kernel {
    /// The fastest kernel this CPU runs, found once per process (every matmul asks).
    fn detect() -> Self {
        static FASTEST: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *FASTEST.get_or_init(|| {
            *Self::supported()
                .last()
                .expect("the scalar kernel runs anywhere")
        })
    }

    /// Every kernel this CPU runs, slowest first.
    fn supported() -> Vec<Self> {
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut kernels = vec![Self::Scalar];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            kernels.push(Self::Avx2);
            if is_x86_feature_detected!("avx512vl") && is_x86_feature_detected!("avx512vnni") {
                kernels.push(Self::Avx2Vnni);
            }
        }
        kernels
    }

    /// Activation rows per pass over a weight row: the AVX2 kernel's sixteen registers hold the
    /// accumulators of four, VNNI's thirty-two (AVX-512's EVEX encoding) those of eight.
    fn row_tile(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx2Vnni => ROW_TILE,
            _ => 4,
        }
    }

    fn quantize(self, xs: &[f32; QK]) -> ActBlock {
        match self {
            Self::Scalar => quantize_scalar(xs),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `supported` listed these kernels only after finding AVX2, FMA and F16C.
            Self::Avx2 | Self::Avx2Vnni => unsafe { avx2::quantize(xs) },
        }
    }

    /// `out[j * xs.len() + i] = w_j · xs[i]` for consecutive weight rows `w_j` of `nb` blocks
    /// and up to `ROW_TILE` activation rows.
    fn dot_rows(self, format: Format, w: &[u8], nb: usize, xs: &[&[ActBlock]], out: &mut [f32]) {
        let xs: Vec<&[ActBlock]> = xs.iter().map(|x| &x[..nb]).collect();
        match *xs {
            [a] => self.dot_rows_of::<1>(format, w, nb, [a], out),
            [a, b] => self.dot_rows_of::<2>(format, w, nb, [a, b], out),
            [a, b, c] => self.dot_rows_of::<3>(format, w, nb, [a, b, c], out),
            [a, b, c, d] => self.dot_rows_of::<4>(format, w, nb, [a, b, c, d], out),
            [a, b, c, d, e] => self.dot_rows_of::<5>(format, w, nb, [a, b, c, d, e], out),
            [a, b, c, d, e, f] => self.dot_rows_of::<6>(format, w, nb, [a, b, c, d, e, f], out),
            [a, b, c, d, e, f, g] => {
                self.dot_rows_of::<7>(format, w, nb, [a, b, c, d, e, f, g], out)
            }
            [a, b, c, d, e, f, g, h] => {
                self.dot_rows_of::<8>(format, w, nb, [a, b, c, d, e, f, g, h], out)
            }
            _ => unreachable!("row tile of {}", xs.len()),
        }
    }

    fn dot_rows_of<const R: usize>(
        self,
        format: Format,
        w: &[u8],
        nb: usize,
        xs: [&[ActBlock]; R],
        out: &mut [f32],
    ) {
        let row_bytes = nb * format.block_bytes();
        let out = out.as_chunks_mut::<R>().0;
        assert_eq!(
            w.len(),
            out.len() * row_bytes,
            "quantised matmul: weight rows"
        );
        match self {
            Self::Scalar => {
                for (w, out) in w.chunks_exact(row_bytes).zip(out) {
                    *out = xs.map(|x| dot_scalar(format, w, x));
                }
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 | Self::Avx2Vnni => match format {
                Format::Q4_1 => self.vector_rows::<Q4_1_BYTES, R>(w.as_chunks().0, nb, xs, out),
                Format::Q8_0 => self.vector_rows::<Q8_0_BYTES, R>(w.as_chunks().0, nb, xs, out),
            },
        }
    }

    /// [`Self::dot_rows_of`] on a vector kernel, with the weight rows as blocks of `BYTES`.
    #[cfg(target_arch = "x86_64")]
    fn vector_rows<const BYTES: usize, const R: usize>(
        self,
        w: &[[u8; BYTES]],
        nb: usize,
        xs: [&[ActBlock]; R],
        out: &mut [[f32; R]],
    ) {
        // SAFETY (both): `supported` listed the kernel only after finding its features; every
        // activation row holds `nb` blocks and `w` whole rows of `nb` blocks.
        match self {
            Self::Avx2 => unsafe { avx2_rows::dot_rows::<BYTES, R>(w, nb, xs, out) },
            Self::Avx2Vnni => unsafe { vnni_rows::dot_rows::<BYTES, R>(w, nb, xs, out) },
            Self::Scalar => unreachable!("the scalar kernel has no vector rows"),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{ActBlock, Q4_1_BYTES, QK};

    /// The eight lane sums of four byte products `w · x` (`w` unsigned, `x` signed): `maddubs`
    /// adds products in pairs into i16, which cannot saturate here (a pair is at most
    /// 2 · 128 · 127), and `madd` adds the pairs into i32.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn lane_sums(w: __m256i, x: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
    }

    /// [`lane_sums`] in one VNNI instruction.
    #[target_feature(enable = "avx2,avx512vl,avx512vnni")]
    #[inline]
    pub(super) fn lane_sums_vnni(w: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
    }

    /// [`super::quantize_scalar`] in AVX2: `cvtps` rounds to nearest even, as
    /// `round_ties_even` does.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn quantize(xs: &[f32; QK]) -> ActBlock {
        let chunks = xs.as_chunks::<8>().0;
        // SAFETY: each chunk holds the eight values read.
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(chunks[i].as_ptr()) });
        let sign = _mm256_set1_ps(-0.0);
        let abs = v.map(|v| _mm256_andnot_ps(sign, v));
        let max = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
        let max = _mm_max_ps(_mm256_castps256_ps128(max), _mm256_extractf128_ps(max, 1));
        let max = _mm_max_ps(max, _mm_movehl_ps(max, max));
        let amax = _mm_cvtss_f32(_mm_max_ss(max, _mm_movehdup_ps(max)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let q = v.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, id)));
        // The packs interleave 128-bit lanes; the permute puts the 32 values back in order.
        let q16 = [
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        ];
        let q8 = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(q16[0], q16[1]),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
        );
        let mut qs = [0i8; QK];
        // SAFETY: `qs` holds the 32 bytes written.
        unsafe { _mm256_storeu_si256(qs.as_mut_ptr().cast(), q8) };
        let sum: i32 = qs.iter().map(|&q| i32::from(q)).sum();
        ActBlock {
            d,
            s: d * sum as f32,
            qs,
        }
    }

    /// A block's scale, minimum (0 for Q8_0) and 32 quants in element order.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn unpack<const BYTES: usize>(block: &[u8; BYTES]) -> (f32, f32, __m256i) {
        let halves = |i: usize| i32::from(u16::from_le_bytes([block[i], block[i + 1]]));
        if BYTES == Q4_1_BYTES {
            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(halves(0) | halves(2) << 16));
            // SAFETY: a Q4_1 block holds 16 quant bytes after its 4 bytes of scales.
            let packed = unsafe { _mm_loadu_si128(block[4..].as_ptr().cast()) };
            // Low nibbles are elements 0..16, high nibbles 16..32.
            let q = _mm256_and_si256(
                _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                _mm256_set1_epi8(0x0F),
            );
            (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)), q)
        } else {
            let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(halves(0))));
            // SAFETY: a Q8_0 block holds 32 quant bytes after its 2 bytes of scale.
            (d, 0.0, unsafe {
                _mm256_loadu_si256(block[2..].as_ptr().cast())
            })
        }
    }

    /// `((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))`.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn sum_lanes(v: __m256) -> f32 {
        let halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
        _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)))
    }
}

/// The AVX2 kernel's rows, once for each way of forming a block's lane sums.
#[cfg(target_arch = "x86_64")]
macro_rules! byte_dot_kernel {
    ($name:ident, $features:literal, $lane_sums:path) => {
        mod $name {
            use std::arch::x86_64::*;

            use super::avx2::{sum_lanes, unpack};
            use super::{ActBlock, PREFETCH_AHEAD, Q4_1_BYTES};

            /// [`super::dot_scalar`] of each weight row of `w` (blocks of `BYTES`, `nb` per row)
            /// against `R` activation rows.
            #[target_feature(enable = $features)]
            pub(super) fn dot_rows<const BYTES: usize, const R: usize>(
                w: &[[u8; BYTES]],
                nb: usize,
                xs: [&[ActBlock]; R],
                out: &mut [[f32; R]],
            ) {
                for (row, out) in w.chunks_exact(nb).zip(out) {
                    // Even and odd blocks in their own registers: one accumulator would make each
                    // block's multiply-add wait for the last one's.
                    let (mut even, mut odd) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
                    let (mut even_min, mut odd_min) = ([0f32; R], [0f32; R]);
                    let mut b = 0;
                    while b + 1 < nb {
                        let ahead = row.as_ptr().wrapping_add(b).cast::<i8>();
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(PREFETCH_AHEAD));
                        let (next, x_next) = (&row[b + 1], xs.map(|x| &x[b + 1]));
                        block::<BYTES, R>(&row[b], xs.map(|x| &x[b]), &mut even, &mut even_min);
                        block::<BYTES, R>(next, x_next, &mut odd, &mut odd_min);
                        b += 2;
                    }
                    if b < nb {
                        block::<BYTES, R>(&row[b], xs.map(|x| &x[b]), &mut even, &mut even_min);
                    }
                    for r in 0..R {
                        let lanes = _mm256_add_ps(even[r], odd[r]);
                        out[r] = sum_lanes(lanes) + (even_min[r] + odd_min[r]);
                    }
                }
            }

            /// One weight block against the same block of `R` activation rows, added into
            /// `acc` and (Q4_1) `min`.
            #[target_feature(enable = $features)]
            #[inline]
            fn block<const BYTES: usize, const R: usize>(
                block: &[u8; BYTES],
                xs: [&ActBlock; R],
                acc: &mut [__m256; R],
                min: &mut [f32; R],
            ) {
                let (d, m, q) = unpack::<BYTES>(block);
                let weights = if BYTES == Q4_1_BYTES {
                    q
                } else {
                    _mm256_sign_epi8(q, q)
                };
                for r in 0..R {
                    let x = xs[r];
                    // SAFETY: the block holds the 32 quants read.
                    let xq = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
                    // The lane sums multiply unsigned by signed bytes: Q4_1's nibbles are
                    // unsigned; Q8_0's signed weights go in as |w|, their signs moved onto x.
                    let xq = if BYTES == Q4_1_BYTES {
                        xq
                    } else {
                        _mm256_sign_epi8(xq, q)
                    };
                    let products = $lane_sums(weights, xq);
                    acc[r] = _mm256_fmadd_ps(
                        _mm256_set1_ps(d * x.d),
                        _mm256_cvtepi32_ps(products),
                        acc[r],
                    );
                    if BYTES == Q4_1_BYTES {
                        min[r] = m.mul_add(x.s, min[r]);
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
byte_dot_kernel!(avx2_rows, "avx2,fma,f16c", super::avx2::lane_sums);
#[cfg(target_arch = "x86_64")]
byte_dot_kernel!(
    vnni_rows,
    "avx2,fma,f16c,avx512vl,avx512vnni",
    super::avx2::lane_sums_vnni
);

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module};

    use super::*;

    fn random(shape: (usize, usize), seed: u64) -> Vec<f32> {
        // A fixed xorshift stream, so a failure reproduces.
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..shape.0 * shape.1)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn quantized(format: Format, out: usize, k: usize, seed: u64) -> Arc<QTensor> {
        let w = Tensor::from_vec(random((out, k), seed), (out, k), &Device::Cpu).unwrap();
        let dtype = match format {
            Format::Q4_1 => GgmlDType::Q4_1,
            Format::Q8_0 => GgmlDType::Q8_0,
        };
        Arc::new(QTensor::quantize(&w, dtype).unwrap())
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    const FORMATS: [Format; 2] = [Format::Q4_1, Format::Q8_0];

    /// Every kernel this CPU has gives the scalar kernel's bits, for every remainder of the row
    /// tile, odd and even block counts, and outputs that leave a short last chunk.
    #[test]
    fn every_kernel_gives_the_scalar_bits() {
        for format in FORMATS {
            for (out, k) in [(1, 32), (7, 96), (203, 4096), (50, 576)] {
                let q = quantized(format, out, k, out as u64);
                let data = q.data().unwrap();
                let w = QuantWeights::new(format, &data, out, k).unwrap();
                // No rows (an empty batch) up to more than one tile of the widest kernel.
                for rows in 0..=9 {
                    let x = random((rows, k), 7 + rows as u64);
                    let scalar = w.matmul_with(Kernel::Scalar, &x, rows);
                    for kernel in Kernel::supported() {
                        let got = w.matmul_with(kernel, &x, rows);
                        assert_eq!(
                            bits(&scalar),
                            bits(&got),
                            "{format:?} {kernel:?} ({out}, {k}) × {rows}"
                        );
                    }
                }
            }
        }
    }

    /// A row's output is the same whatever is batched with it.
    #[test]
    fn a_rows_output_does_not_depend_on_its_batch() {
        for format in FORMATS {
            let (out, k) = (64, 256);
            let q = quantized(format, out, k, 3);
            let data = q.data().unwrap();
            let w = QuantWeights::new(format, &data, out, k).unwrap();
            let x = random((6, k), 11);
            let batched = w.matmul(&x, 6);
            for i in 0..6 {
                let alone = w.matmul(&x[i * k..(i + 1) * k], 1);
                assert_eq!(
                    bits(&alone),
                    bits(&batched[i * out..(i + 1) * out]),
                    "{format:?} row {i}"
                );
            }
        }
    }

    #[test]
    fn activation_quantisation_is_the_same_on_every_kernel() {
        let mut x = random((8, QK), 5);
        // An all-zero block (d = 0), a tiny one, a large one and exact halves (ties).
        x[..32].fill(0.0);
        x[32..64].iter_mut().for_each(|v| *v *= 1e-30);
        x[64..96].iter_mut().for_each(|v| *v *= 3e30);
        for (j, v) in x[96..128].iter_mut().enumerate() {
            *v = if j == 0 { 127.0 } else { j as f32 - 15.5 };
        }
        for block in x.as_chunks::<QK>().0 {
            let reference = quantize_scalar(block);
            for kernel in Kernel::supported() {
                assert_eq!(kernel.quantize(block), reference, "{kernel:?} {block:?}");
            }
            let dequantised = reference.qs.map(|q| f32::from(q) * reference.d);
            for (x, y) in block.iter().zip(dequantised) {
                assert!((x - y).abs() <= reference.d * 0.5001, "{x} -> {y}");
            }
        }
        let halves = quantize_scalar(x[96..128].try_into().unwrap());
        assert_eq!(halves.qs[1], -14, "-14.5 rounds to even");
        assert_eq!(halves.qs[2], -14, "-13.5 rounds to even");
    }

    /// Against the exact product of the dequantised weights: within the activations' rounding
    /// (each activation is at most `d_b / 2` from its quant, so a block is off by at most
    /// `d_b / 2 · Σ|w_b|`) plus f32 rounding; and against candle's quantised matmul within both
    /// kernels' rounding.
    #[test]
    fn outputs_are_the_exact_product_within_the_activations_rounding() {
        for format in FORMATS {
            for (out, k, rows) in [(37, 64, 3), (37, 64, 1), (301, 4096, 2), (576, 1536, 5)] {
                let q = quantized(format, out, k, 1);
                let data = q.data().unwrap();
                let w = q
                    .dequantize(&Device::Cpu)
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap();
                let x = random((rows, k), 2);
                let got = QuantWeights::new(format, &data, out, k)
                    .unwrap()
                    .matmul_with(Kernel::detect(), &x, rows);
                let xt = Tensor::from_vec(x.clone(), (rows, k), &Device::Cpu).unwrap();
                let candle = QMatMul::from_arc(q.clone())
                    .unwrap()
                    .forward(&xt)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                for i in 0..rows {
                    let x = &x[i * k..(i + 1) * k];
                    let blocks: Vec<ActBlock> =
                        x.as_chunks::<QK>().0.iter().map(quantize_scalar).collect();
                    for (j, w) in w.iter().enumerate() {
                        let exact: f64 = w
                            .iter()
                            .zip(x)
                            .map(|(w, x)| f64::from(*w) * f64::from(*x))
                            .sum();
                        let magnitude: f64 =
                            w.iter().zip(x).map(|(w, x)| f64::from((w * x).abs())).sum();
                        let rounding: f64 = w
                            .chunks_exact(QK)
                            .zip(&blocks)
                            .map(|(w, b)| {
                                f64::from(b.d) / 2.0
                                    * w.iter().map(|w| f64::from(w.abs())).sum::<f64>()
                            })
                            .sum();
                        let bound = rounding + 1e-5 * magnitude;
                        let ours = f64::from(got[i * out + j]);
                        assert!(
                            (ours - exact).abs() <= bound,
                            "{format:?} ({out}, {k}) row {i} col {j}: {ours} vs exact {exact} (bound {bound})"
                        );
                        let theirs = f64::from(candle[i * out + j]);
                        assert!(
                            (ours - theirs).abs() <= 2.0 * bound + 1e-3 * magnitude,
                            "{format:?} ({out}, {k}) row {i} col {j}: {ours} vs candle {theirs}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn only_q4_1_and_q8_0_on_the_cpu_in_f32_come_here() {
        let x = Tensor::from_vec(random((2, 256), 1), (2, 256), &Device::Cpu).unwrap();
        let w = Tensor::from_vec(random((8, 256), 2), (8, 256), &Device::Cpu).unwrap();
        for (dtype, expected) in [
            (GgmlDType::Q4_1, true),
            (GgmlDType::Q8_0, true),
            (GgmlDType::Q4_0, false),
            (GgmlDType::Q4K, false),
        ] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            assert_eq!(applies(&q, &x), expected, "{dtype:?}");
        }
        assert!(!applies(
            &QTensor::quantize(&w, GgmlDType::Q8_0).unwrap(),
            &x.to_dtype(DType::BF16).unwrap()
        ));
        let q = quantized(Format::Q8_0, 8, 64, 3);
        let err = forward(
            &q,
            &Tensor::zeros((2, 96), DType::F32, &Device::Cpu).unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("against weights (8, 64)"), "{err}");
    }

    #[test]
    fn weights_of_the_wrong_size_are_refused() {
        let err = QuantWeights::new(Format::Q4_1, &[0u8; 39], 1, 64)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("39 bytes do not hold (1, 64) Q4_1"), "{err}");
        assert!(QuantWeights::new(Format::Q8_0, &[0u8; 68], 1, 64).is_ok());
        assert!(QuantWeights::new(Format::Q8_0, &[0u8; 68], 2, 32).is_ok());
        assert!(
            QuantWeights::new(Format::Q8_0, &[0u8; 34], 1, 48).is_err(),
            "k not a block multiple"
        );
    }
}
