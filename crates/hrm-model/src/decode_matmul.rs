//! The CPU product `x · wᵀ` of a decode step (one position per sequence) with a dense f32
//! weight matrix `w` of shape (out, in).
//!
//! candle hands every product to `gemm`, which packs the weight matrix into panels on each call:
//! for the few activation rows of a decode step the packing costs about as much as the
//! arithmetic. Here each weight row is read once, in place, and dotted with every activation row
//! while it is in cache, and the weight rows are split across candle's persistent thread team
//! ([`crate::team`]).
//!
//! Invariants:
//! - Only passes of one position per sequence come here, whatever their batch: decode steps,
//!   and the final block of a generation pass once it has kept each sequence's last position
//!   (`layers::Outputs`). So a sequence's tokens never depend on what else is batched with it;
//!   the rest of a prompt's pass, and scoring, keep the GEMM.
//! - The kernel is chosen at run time: AVX-512F, else AVX2 with FMA, else scalar. The vector
//!   kernels sum in a different order from candle's (and fuse the multiply-add), so outputs agree
//!   with candle's within f32 rounding, not bit for bit; tests hold every kernel the CPU has to
//!   candle's product.

use candle_core::{D, DType, Result, Tensor};

/// Whether `Linear` should route `x · wᵀ` here rather than through candle: one position per
/// sequence in f32 on the CPU, with no gradient to track (this product has no
/// backward pass).
pub(crate) fn applies(w: &Tensor, x: &Tensor) -> bool {
    holds(w)
        && !x.track_op()
        && x.device().is_cpu()
        && x.dtype() == DType::F32
        && x.rank() == 3
        && x.dim(1).is_ok_and(|positions| positions == 1)
}

/// Whether this kernel can read `w` in place: contiguous `(out, in)` f32 on the CPU, with no
/// gradient to track.
pub(crate) fn holds(w: &Tensor) -> bool {
    !w.track_op()
        && w.device().is_cpu()
        && w.dtype() == DType::F32
        && w.rank() == 2
        && w.is_contiguous()
}

/// `x · wᵀ` for `w` of shape (out, in) and `x` of shape (..., in), like `candle_nn::Linear`.
pub(crate) fn forward(w: &Tensor, x: &Tensor) -> Result<Tensor> {
    let (out, k) = w.dims2()?;
    if x.dim(D::Minus1)? != k {
        candle_core::bail!(
            "decode matmul: input {:?} against weights ({out}, {k})",
            x.shape()
        );
    }
    let x = x.contiguous()?;
    let rows = x.elem_count() / k.max(1);
    let y = {
        let (w_storage, w_layout) = w.storage_and_layout();
        let (x_storage, x_layout) = x.storage_and_layout();
        let w = crate::fused::values(crate::fused::cpu_storage(&w_storage)?, w_layout)?;
        let x = crate::fused::values(crate::fused::cpu_storage(&x_storage)?, x_layout)?;
        matmul(w, x, (rows, k, out))
    };
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("rank 3") = out;
    Tensor::from_vec(y, dims, x.device())
}

/// The most activation rows dotted against each weight row per pass ([`Kernel::row_tile`]).
pub(crate) const ROW_TILE: usize = 8;
/// How far ahead the vector kernels ask for weights (each cache line of the pass is asked for):
/// as in the GGUF kernels (`quant_matmul.rs`), the hardware prefetcher of an Intel Xeon (family
/// 6 model 167, AVX-512) fell behind; there it took 0.94× the wall time of `hrm bench model` on
/// `models/sample`.
pub(crate) const PREFETCH_AHEAD: usize = 4096;

/// [`matmul_with`] on the kernel this CPU runs best.
pub(crate) fn matmul(w: &[f32], x: &[f32], (rows, k, out): (usize, usize, usize)) -> Vec<f32> {
    matmul_with(Kernel::detect(), w, x, (rows, k, out))
}

/// `x · wᵀ` (`rows × out`, row-major) for `x: rows × k` and `w: out × k`, both row-major.
fn matmul_with(
    kernel: Kernel,
    w: &[f32],
    x: &[f32],
    (rows, k, out): (usize, usize, usize),
) -> Vec<f32> {
    assert_eq!(w.len(), out * k, "decode matmul: weight length");
    assert_eq!(x.len(), rows * k, "decode matmul: input length");
    if k == 0 {
        return vec![0.0; rows * out];
    }
    let x = LineAlignedRows::new(x, k);
    let xs: Vec<&[f32]> = (0..rows).map(|i| x.row(i)).collect();
    let row_tile = kernel.row_tile();
    crate::team::columns_in_parallel(rows, out, |range, block| {
        let w = &w[range.start * k..range.end * k];
        for (t, tile) in xs.chunks(row_tile).enumerate() {
            for (j, w_row) in w.chunks_exact(k).enumerate() {
                let dots = &mut block[j * rows + t * row_tile..][..tile.len()];
                kernel.dots(w_row, Read::Streamed, tile, dots);
            }
        }
    })
}

/// One cache line of f32 values.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// Activation rows copied so that each starts on a cache line.
///
/// The kernels read every activation row once per weight row, from L1, in whole vectors. The
/// allocator aligns candle's buffers to 16 bytes only; a row 16 bytes past a cache line makes
/// every AVX-512 load (and every other AVX2 load) cross into the next line, and such a load
/// costs two of the core's loads: on an Intel Xeon (family 6 model 207) the batch-8 AVX-512
/// kernel with its operands in L1 ran at 23.6 against 50.2 GMAC/s on one thread, off the line
/// against on it (`k` = 768). The copy is `rows × k` values against the weights' `out × k`.
struct LineAlignedRows {
    lines: Vec<Line>,
    /// Values per row; each row takes `k` rounded up to whole lines.
    k: usize,
}

impl LineAlignedRows {
    fn new(x: &[f32], k: usize) -> Self {
        assert!(k > 0, "aligned rows: rows of no values");
        let per_row = k.div_ceil(16);
        let mut lines = vec![Line([0.0; 16]); x.len() / k * per_row];
        for (row, x) in lines.chunks_exact_mut(per_row).zip(x.chunks_exact(k)) {
            for (line, x) in row.iter_mut().zip(x.chunks(16)) {
                line.0[..x.len()].copy_from_slice(x);
            }
        }
        Self { lines, k }
    }

    fn row(&self, i: usize) -> &[f32] {
        let start = i * self.k.div_ceil(16) * 16;
        let values = self.lines.len() * 16;
        assert!(start + self.k <= values, "aligned rows: row {i}");
        // SAFETY: `Line` is `repr(C)` around sixteen f32 with no padding (64 bytes, aligned to
        // 64), so the vector's lines are `values` consecutive f32, of which the row's `k` lie
        // inside (checked above); the borrow of `self` keeps them alive and unchanged.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>().add(start), self.k) }
    }
}

/// How [`Kernel::dots`] reads its `w`: a weight row streamed once per pass (the kernel asks for
/// the weights [`PREFETCH_AHEAD`] on), or a vector that stays in cache (decode attention's
/// query, past which there is nothing to ask for).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Read {
    Streamed,
    Cached,
}

/// The dot-product kernel of this CPU (decode attention also runs on the instruction set it
/// names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Kernel {
    pub(crate) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Self::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Self::Avx2;
            }
        }
        Self::Scalar
    }

    /// Every kernel this CPU can run, the scalar one first.
    #[cfg(test)]
    pub(crate) fn supported() -> Vec<Self> {
        let mut kernels = vec![Self::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                kernels.push(Self::Avx2);
            }
            if is_x86_feature_detected!("avx512f") {
                kernels.push(Self::Avx512);
            }
        }
        kernels
    }

    /// Activation rows per pass over a weight row: two accumulators per row must stay in
    /// registers, sixteen of them in AVX2, thirty-two in AVX-512.
    pub(crate) fn row_tile(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => ROW_TILE,
            _ => 4,
        }
    }

    /// `out[i] = w · xs[i]` for up to [`Self::row_tile`] activation rows, each as long as `w`.
    pub(crate) fn dots(self, w: &[f32], read: Read, xs: &[&[f32]], out: &mut [f32]) {
        assert!(xs.len() <= self.row_tile() && out.len() == xs.len());
        assert!(xs.iter().all(|x| x.len() == w.len()));
        match read {
            Read::Streamed => self.dots_tile::<true>(w, xs, out),
            Read::Cached => self.dots_tile::<false>(w, xs, out),
        }
    }

    fn dots_tile<const STREAMED: bool>(self, w: &[f32], xs: &[&[f32]], out: &mut [f32]) {
        // A row count known at compile time keeps the accumulators in registers.
        match *xs {
            [a] => self.dots_of::<_, STREAMED>(w, [a], out),
            [a, b] => self.dots_of::<_, STREAMED>(w, [a, b], out),
            [a, b, c] => self.dots_of::<_, STREAMED>(w, [a, b, c], out),
            [a, b, c, d] => self.dots_of::<_, STREAMED>(w, [a, b, c, d], out),
            [a, b, c, d, e] => self.dots_of::<_, STREAMED>(w, [a, b, c, d, e], out),
            [a, b, c, d, e, f] => self.dots_of::<_, STREAMED>(w, [a, b, c, d, e, f], out),
            [a, b, c, d, e, f, g] => self.dots_of::<_, STREAMED>(w, [a, b, c, d, e, f, g], out),
            [a, b, c, d, e, f, g, h] => {
                self.dots_of::<_, STREAMED>(w, [a, b, c, d, e, f, g, h], out)
            }
            _ => unreachable!("row tile of {}", xs.len()),
        }
    }

    fn dots_of<const R: usize, const STREAMED: bool>(
        self,
        w: &[f32],
        xs: [&[f32]; R],
        out: &mut [f32],
    ) {
        match self {
            Self::Scalar => {
                for (out, x) in out.iter_mut().zip(xs) {
                    *out = w.iter().zip(x).map(|(w, x)| w * x).sum();
                }
            }
            // SAFETY (both): `detect` chose the kernel only after finding its features, and
            // `dots` checked that every row is as long as `w`.
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => unsafe { avx2::dots::<R, STREAMED>(w, xs, out) },
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => unsafe { avx512::dots::<R, STREAMED>(w, xs, out) },
        }
    }

    /// `out = Σ_j p[j] · rows[j]` over the `p.len()` rows of `rows`, each `out.len()` long
    /// (decode attention's probability-weighted sum of values).
    pub(crate) fn weighted_rows(self, p: &[f32], rows: &[f32], out: &mut [f32]) {
        assert_eq!(rows.len(), p.len() * out.len(), "weighted rows: lengths");
        match self {
            Self::Scalar => {
                out.fill(0.0);
                for (p, row) in p.iter().zip(rows.chunks_exact(out.len().max(1))) {
                    for (o, v) in out.iter_mut().zip(row) {
                        *o += p * v;
                    }
                }
            }
            // SAFETY (both): `detect` chose the kernel only after finding its features, and
            // `rows` was checked above to hold `p.len()` rows as long as `out`.
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => unsafe { avx2::weighted_rows(p, rows, out) },
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => unsafe { avx512::weighted_rows(p, rows, out) },
        }
    }
}

/// One vector kernel per instruction set: `dots(w, xs, out)` sets `out[i] = w · xs[i]`, reading
/// each vector of `w` once for all the activation rows. Each row keeps two accumulators (even
/// and odd vectors), so a single row's multiply-adds do not all wait on one another.
#[cfg(target_arch = "x86_64")]
macro_rules! vector_kernel {
    ($name:ident, $features:literal, $lanes:literal, $zero:ident, $load:ident, $fma:ident,
     $add:ident, $sum:path, $splat:ident, $store:ident) => {
        mod $name {
            use std::arch::x86_64::*;

            use super::PREFETCH_AHEAD;

            /// # Safety
            /// The CPU has the module's features, and every row of `xs` is as long as `w`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn dots<const R: usize, const STREAMED: bool>(
                w: &[f32],
                xs: [&[f32]; R],
                out: &mut [f32],
            ) {
                const STEP: usize = 2 * $lanes;
                let k = w.len();
                let pairs = k / STEP * STEP;
                let full = k / $lanes * $lanes;
                let mut even = [$zero(); R];
                let mut odd = [$zero(); R];
                // SAFETY (both loops): every load reads `lanes` values from c < full <= k, the
                // length of `w` and of every row.
                let mut c = 0;
                while c < pairs {
                    if STREAMED {
                        let ahead = w
                            .as_ptr()
                            .wrapping_add(c)
                            .cast::<i8>()
                            .wrapping_add(PREFETCH_AHEAD);
                        for line in (0..STEP * 4).step_by(64) {
                            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line));
                        }
                    }
                    unsafe {
                        let (w0, w1) =
                            ($load(w.as_ptr().add(c)), $load(w.as_ptr().add(c + $lanes)));
                        for ((even, odd), x) in even.iter_mut().zip(&mut odd).zip(xs) {
                            *even = $fma(w0, $load(x.as_ptr().add(c)), *even);
                            *odd = $fma(w1, $load(x.as_ptr().add(c + $lanes)), *odd);
                        }
                    }
                    c += STEP;
                }
                if c < full {
                    unsafe {
                        let w0 = $load(w.as_ptr().add(c));
                        for (even, x) in even.iter_mut().zip(xs) {
                            *even = $fma(w0, $load(x.as_ptr().add(c)), *even);
                        }
                    }
                }
                for (((out, even), odd), x) in out.iter_mut().zip(even).zip(odd).zip(xs) {
                    let tail: f32 = w[full..].iter().zip(&x[full..]).map(|(w, x)| w * x).sum();
                    *out = $sum($add(even, odd)) + tail;
                }
            }

            /// `out = Σ_j p[j] · rows[j]`, four vectors of `out` at a time held in registers
            /// over all the rows, then one vector at a time, then the scalar tail; each
            /// element sums its rows in order with fused multiply-adds.
            ///
            /// # Safety
            /// The CPU has the module's features, and `rows` holds `p.len()` rows as long as
            /// `out`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn weighted_rows(p: &[f32], rows: &[f32], out: &mut [f32]) {
                const WIDE: usize = 4 * $lanes;
                let d = out.len();
                let mut c = 0;
                // SAFETY (both loops): every load and store covers c..c + lanes <= d of a row
                // of `rows` or of `out`.
                while c + WIDE <= d {
                    let mut acc = [$zero(); 4];
                    for (j, &pj) in p.iter().enumerate() {
                        let (w, row) = ($splat(pj), rows[j * d + c..].as_ptr());
                        for (i, acc) in acc.iter_mut().enumerate() {
                            *acc = $fma(w, unsafe { $load(row.add(i * $lanes)) }, *acc);
                        }
                    }
                    for (i, acc) in acc.into_iter().enumerate() {
                        unsafe { $store(out[c + i * $lanes..].as_mut_ptr(), acc) };
                    }
                    c += WIDE;
                }
                while c + $lanes <= d {
                    let mut acc = $zero();
                    for (j, &pj) in p.iter().enumerate() {
                        acc = $fma(
                            $splat(pj),
                            unsafe { $load(rows[j * d + c..].as_ptr()) },
                            acc,
                        );
                    }
                    unsafe { $store(out[c..].as_mut_ptr(), acc) };
                    c += $lanes;
                }
                for (e, o) in out.iter_mut().enumerate().skip(c) {
                    *o = p
                        .iter()
                        .enumerate()
                        .fold(0.0, |acc, (j, pj)| pj.mul_add(rows[j * d + e], acc));
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
vector_kernel!(
    avx512,
    "avx512f",
    16,
    _mm512_setzero_ps,
    _mm512_loadu_ps,
    _mm512_fmadd_ps,
    _mm512_add_ps,
    _mm512_reduce_add_ps,
    _mm512_set1_ps,
    _mm512_storeu_ps
);

#[cfg(target_arch = "x86_64")]
vector_kernel!(
    avx2,
    "avx2,fma",
    8,
    _mm256_setzero_ps,
    _mm256_loadu_ps,
    _mm256_fmadd_ps,
    _mm256_add_ps,
    super::sum_256,
    _mm256_set1_ps,
    _mm256_storeu_ps
);

/// The sum of an AVX register's eight lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) fn sum_256(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
    let one = _mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1));
    _mm_cvtss_f32(one)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn random(shape: (usize, usize, usize), seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let values: Vec<f32> = (0..shape.0 * shape.1 * shape.2)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    }

    /// Each copied row starts on a cache line and holds the row's values, for widths that fill
    /// whole lines and widths that do not.
    #[test]
    fn aligned_rows_start_on_lines_and_keep_the_values() {
        for (rows, k) in [(1, 16), (3, 5), (8, 37), (2, 768)] {
            let x: Vec<f32> = (0..rows * k).map(|i| i as f32 * 0.5 - 3.0).collect();
            let aligned = LineAlignedRows::new(&x, k);
            for (i, expected) in x.chunks_exact(k).enumerate() {
                let row = aligned.row(i);
                assert_eq!(row.as_ptr() as usize % 64, 0, "row {i} of {rows} × {k}");
                assert_eq!(row, expected);
            }
        }
    }

    /// Every kernel this CPU can run, against candle's product, on batches from one row to more
    /// than a tile and inner lengths with and without a tail past the last full vector.
    #[test]
    fn every_kernel_agrees_with_candles_product() {
        assert!(Kernel::supported().contains(&Kernel::detect()));
        for (batch, k, out) in [(1, 256, 768), (3, 37, 50), (8, 256, 1536), (9, 100, 7)] {
            let x = random((batch, 1, k), k as u64);
            let w = random((1, out, k), out as u64).squeeze(0).unwrap();
            assert!(applies(&w, &x));
            let reference: Vec<f32> = x
                .broadcast_matmul(&w.t().unwrap())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            let ws: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
            for kernel in Kernel::supported() {
                let ours = matmul_with(kernel, &ws, &xs, (batch, k, out));
                for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                        "{kernel:?} {batch}x{k}x{out} element {i}: {a} vs {b}"
                    );
                }
            }
            let y = forward(&w, &x).unwrap();
            assert_eq!(y.dims(), &[batch, 1, out]);
        }
    }

    /// Every kernel's weighted sum of rows against candle's `p · rows`, for row lengths with
    /// and without the wide (four-vector) part, the one-vector part and a scalar tail.
    #[test]
    fn every_kernel_weights_rows_as_candle_does() {
        for (count, d) in [
            (1, 64),
            (7, 64),
            (300, 64),
            (5, 40),
            (9, 100),
            (3, 7),
            (2, 128),
        ] {
            let p = random((1, 1, count), d as u64);
            let rows = random((1, count, d), count as u64);
            let reference: Vec<f32> = p
                .squeeze(0)
                .unwrap()
                .matmul(&rows.squeeze(0).unwrap())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let p: Vec<f32> = p.flatten_all().unwrap().to_vec1().unwrap();
            let rows: Vec<f32> = rows.flatten_all().unwrap().to_vec1().unwrap();
            for kernel in Kernel::supported() {
                let mut out = vec![f32::NAN; d];
                kernel.weighted_rows(&p, &rows, &mut out);
                for (i, (a, b)) in out.iter().zip(&reference).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-5 * (1.0 + b.abs()) * (count as f32).sqrt(),
                        "{kernel:?} {count} rows of {d}, element {i}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn only_decode_steps_in_f32_come_here() {
        let w = random((1, 8, 4), 1).squeeze(0).unwrap();
        assert!(applies(&w, &random((2, 1, 4), 2)));
        assert!(!applies(&w, &random((2, 3, 4), 3)), "a prefill pass");
        assert!(
            !applies(&w.t().unwrap(), &random((2, 1, 8), 4)),
            "a transposed weight"
        );
        let tracked = candle_core::Var::from_tensor(&w).unwrap();
        assert!(
            !applies(tracked.as_tensor(), &random((2, 1, 4), 7)),
            "training"
        );
        let half = random((2, 1, 4), 5).to_dtype(DType::BF16).unwrap();
        assert!(!applies(&w.to_dtype(DType::BF16).unwrap(), &half));
        let err = forward(&w, &random((2, 1, 5), 6)).unwrap_err().to_string();
        assert!(err.contains("against weights (8, 4)"), "{err}");
    }
}
