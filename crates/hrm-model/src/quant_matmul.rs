//! The CPU matmul `x · qᵀ` for GGUF weights in Q4_1 and Q8_0, for every pass (decode, prefill
//! and scoring).
//!
//! candle 0.11 has no SIMD dot product for Q4_1, and its Q8_0 matmul hands each (row, column)
//! pair to a separate call. This module repacks each such matrix once, at load, into the layout
//! its kernels read ([`QuantMatrix`]: the same bytes, rearranged, and the ggml copy dropped),
//! quantises the activations to 8 bits per block of 32, and multiplies blocks in exact integer
//! arithmetic, unpacking each pair of weight blocks once for up to [`ROW_TILE`] activation rows.
//! The repacked matrices lie one after another, in the order the model loads them, in memory
//! that asks for huge pages ([`crate::huge_pages`]).
//!
//! The layout: each weight row holds its blocks' quants two blocks at a time, then the scales
//! of all its blocks, then (Q4_1) their minimums, as f16. A pair of blocks `a, b` is one 32-byte
//! register of Q4_1 nibbles (`a`'s 16 bytes, then `b`'s; the low nibble of byte `j` is element
//! `j`, the high one element `j + 16`, as in ggml), or two of Q8_0 bytes (`a₀…a₁₅ b₀…b₁₅`, then
//! `a₁₆…a₃₁ b₁₆…b₃₁`), and the activations are stored in the second arrangement. So one load and
//! two masks (Q4_1) give a pair's quants in the activations' order, and eight blocks' scales
//! convert and multiply in one instruction each; ggml's 20-byte Q4_1 blocks cost a scalar
//! conversion, multiply and broadcast per block, which left the kernel reading weights at half
//! the rate a core streams memory.
//!
//! The arithmetic, which the scalar kernel spells out and every vector kernel repeats:
//! - an activation block `x` (32 values) becomes `d = max|x| / 127`, `q = round_ties_even(x ·
//!   (1 / d))` (0 when `d` is 0) and `s = d · Σq`, all in f32 (ggml rounds `d` and `s` to f16;
//!   we keep them exact);
//! - block `b` (the `h`-th of its pair, `h` = `b % 2`) gives four lane sums, lane `4h + l`
//!   summing `w_j · x_j` over `j` in `4l..4l + 4` and `16 + 4l..16 + 4l + 4` (exact in i32),
//!   each added as `acc[4h + l] = fma(d_w · d_x, sum, acc[4h + l])`, pairs in order; Q8_0's
//!   odd pairs add into a second set of lanes `odd` instead, so that two chains of `fmadd`s
//!   are in flight; Q4_1's minimum adds `min[b % 8] = fma(m_w, s_x, min[b % 8])`, blocks in
//!   order;
//! - the result is `Σ_l acc` plus `Σ_l min` for Q4_1, and `Σ_l (acc + odd)` (lane by lane
//!   first) for Q8_0, eight lanes summed as `((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 +
//!   v7))`.
//!
//! Invariants:
//! - Every kernel (scalar, AVX2, AVX2 with VNNI) gives the same bits for finite inputs, and an
//!   output depends only on its own activation row, never on the batch around it, so a
//!   sequence's tokens and scores do not change with batching or with the CPU's instruction
//!   sets. The tests hold every kernel the CPU has to the scalar one.
//! - A row of an odd number of blocks ends in half a pair: the other half's weights,
//!   activations and scales are zeros, whose products add exact zeros.
//! - VNNI's `vpdpbusd` (AVX-512 VNNI on 256-bit registers) forms each lane's four products and
//!   their sum in one instruction, where AVX2 needs two (`maddubs`, then `madd`; for Q4_1 the
//!   two registers of a pair share one `madd`, their nibble products small enough to add in
//!   i16 first); all these sums are exact, so the kernels differ only in speed. A 512-bit
//!   kernel on ggml's layout (two blocks per register, paired by shuffles) measured slower
//!   than either on an AVX-512 AMD EPYC (its 512-bit operations take two 256-bit passes) and
//!   no faster on an AVX-512 Intel Xeon. One on this layout (two pairs per register, Q4_1 with
//!   no shuffles) measured 0.9× the 256-bit VNNI kernel at batch 8 on a Zen 5 AMD EPYC
//!   (family 26, model 2), whose 512-bit units are full width, and no faster at batch 1,
//!   where the kernel waits for memory; so there is none. Nor does one activation row go
//!   against two weight rows at once (two chains of `fmadd`s in flight, the activations' loads
//!   shared): that measured 0.86× the GGUF's batch-1 decode on an AVX2-only Zen 3 AMD EPYC
//!   (family 25, model 1).
//! - Two chains within one weight row pay for Q8_0 only. On that Zen 3, a Q8_0 pair carries
//!   twice Q4_1's quants for one `fmadd`, and alternating its pairs between two sets of lanes
//!   made SmolLM2's output head (49,152 × 576) 1.39× faster for one activation row in the
//!   kernel bench (where much of its 30 MB stays in the L3 between calls) and 1.13× for eight,
//!   and the GGUF's batch-1 decode 1.04×. Q4_1's layers ran no faster for one row and at
//!   0.77–0.90× for eight: a tile of four rows' second lanes, beside its minimums' and its
//!   scales, no longer fit the sixteen registers. On an Intel Xeon with VNNI (family 6, model
//!   167) the same order left both GGUF decode steps as they were (1.00× at batch 1, 1.02× at
//!   batch 8), though the head's kernel alone ran 0.87× for eight rows, whose tile then spills;
//!   every kernel keeps the one order, as the first invariant requires. Q4_1 in two chains
//!   there measured 1.04× at batch 1 (0.92–1.31) and 0.95× at batch 8 (0.97× with VNNI's tile
//!   cut to four rows, whose accumulators then fit), and 0.97–0.99× on the AVX2 kernel.
//! - Outputs differ from candle's (f16 scales, another summation order) and from the exact
//!   product by the activations' 8-bit rounding: at most `Σ_b (d_x,b / 2) · Σ|w_b|` plus f32
//!   rounding, which the tests check.
//! - Non-finite activations make the output meaningless on every path (not necessarily the same
//!   bits).

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{D, DType, Result, Tensor};

use crate::huge_pages::WeightBytes;

/// Elements per weight and activation block.
const QK: usize = 32;
/// Bytes per ggml Q4_1 block: f16 scale `d`, f16 minimum `m`, then 16 bytes of nibbles
/// (element `j` in the low nibble of byte `j`, element `j + 16` in its high nibble).
const Q4_1_BYTES: usize = 20;
/// Bytes per ggml Q8_0 block: f16 scale `d`, then 32 signed bytes.
const Q8_0_BYTES: usize = 34;
/// Blocks whose scales are read, converted and multiplied together: one register of f32.
const SCALE_GROUP: usize = 8;
/// Activation rows dotted against one weight row per pass, so that each pair of weight blocks
/// is unpacked once for up to this many rows: [`Kernel::row_tile`] of them, at most this.
const ROW_TILE: usize = 8;
/// How far ahead of the pair being read the vector kernels ask for weights. On an Intel Xeon
/// with AVX-512 and AMX (family 6 model 167), whose weights stayed in its large L3, the hardware
/// prefetcher fell behind the kernel: asking 4 KiB ahead made GGUF decode 1.48× faster at batch
/// 1 and 1.58× at batch 8, alternately against no prefetch (1 KiB: 1.40× and 1.51×; 16 KiB:
/// slower than 4 KiB at batch 8). On a Zen 5 AMD EPYC (family 26 model 2), whose weights do not
/// stay in cache, 4 KiB is still best at batch 1 (1 KiB 0.93×, 16 KiB 0.99×, four alternating
/// runs), while 1 KiB measured 1.08× at batch 8. The weights lie contiguously, so the address
/// runs on into the next rows; past the end, a prefetch is a hint that never faults.
const PREFETCH_AHEAD: usize = 4096;
/// How far ahead the vector kernels ask for weights a second time, with the T2 hint: for the
/// outer caches, not the L1 (Intel's manual leaves the level to the core; we did not measure
/// which one fills). On machine B (Intel Xeon, family 6 model 167), once its weights no longer
/// stayed in its L3, the two cores' kernels read about 22 GB/s while they ran (derived from a
/// profile), against 25–30 GB/s for torch's sum of as many bytes; our reading is that a core's
/// misses to the L1 overlap too little to go faster. This second prefetch made the GGUF's batch-1
/// decode there 1.03–1.14× as fast (medians of four alternating runs; 16 and 128 KiB measured
/// alike) and its batch-8 step as fast as before; the AVX2 kernel, forced on there for the
/// measurement, gained 1.02× at batch 1. Not measured on other CPUs (docs/performance.md).
const L2_AHEAD: usize = 32 * 1024;
/// Lanes of the block sums (one AVX2 register of i32).
const LANES: usize = 8;
/// Zero bytes after a repacked matrix's last row, so that the vector kernels read every scale
/// group as a whole register: a group cut short at a row's end runs on into the row's minimums,
/// the next row or these bytes, and the lanes past the row's blocks are then cleared.
const SLACK: usize = 16;

/// Whether a GGUF weight goes to this module (repacked at load) rather than to candle.
pub(crate) fn repacks(q: &QTensor) -> bool {
    Format::of(q.dtype()).is_some() && q.device().is_cpu() && q.shape().rank() == 2
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

    /// Bytes of one ggml block, as the GGUF file holds it.
    fn ggml_block_bytes(self) -> usize {
        match self {
            Self::Q4_1 => Q4_1_BYTES,
            Self::Q8_0 => Q8_0_BYTES,
        }
    }

    /// Bytes of a pair of blocks' quants in the repacked layout.
    fn pair_bytes(self) -> usize {
        match self {
            Self::Q4_1 => 32,
            Self::Q8_0 => 64,
        }
    }

    /// f16 values per block after the quants: the scale, and Q4_1's minimum.
    fn scales_per_block(self) -> usize {
        match self {
            Self::Q4_1 => 2,
            Self::Q8_0 => 1,
        }
    }
}

/// Bytes of one repacked row of `nb` blocks: the quants in pairs of blocks, then the scales,
/// then (Q4_1) the minimums.
fn row_bytes(format: Format, nb: usize) -> usize {
    nb.div_ceil(2) * format.pair_bytes() + 2 * nb * format.scales_per_block()
}

/// One row of ggml blocks (`source`) in the repacked layout (`row`, [`row_bytes`] long).
fn repack_row(format: Format, source: &[u8], row: &mut [u8]) {
    let block_bytes = format.ggml_block_bytes();
    let nb = source.len() / block_bytes;
    let (quants, scales) = row.split_at_mut(nb.div_ceil(2) * format.pair_bytes());
    let (d, m) = scales.split_at_mut(2 * nb);
    for (b, block) in source.chunks_exact(block_bytes).enumerate() {
        let pair = &mut quants[b / 2 * format.pair_bytes()..][..format.pair_bytes()];
        let h = b % 2;
        d[2 * b..2 * b + 2].copy_from_slice(&block[..2]);
        match format {
            Format::Q4_1 => {
                m[2 * b..2 * b + 2].copy_from_slice(&block[2..4]);
                pair[16 * h..16 * h + 16].copy_from_slice(&block[4..Q4_1_BYTES]);
            }
            Format::Q8_0 => {
                pair[16 * h..16 * h + 16].copy_from_slice(&block[2..18]);
                pair[32 + 16 * h..32 + 16 * h + 16].copy_from_slice(&block[18..]);
            }
        }
    }
}

/// A Q4_1 or Q8_0 weight matrix of shape (out, in), repacked for the kernels (module doc).
#[derive(Clone, Debug)]
pub struct QuantMatrix {
    format: Format,
    out: usize,
    k: usize,
    bytes: WeightBytes,
}

impl QuantMatrix {
    pub(crate) fn from_qtensor(q: &QTensor) -> Result<Self> {
        let Some(format) = Format::of(q.dtype()) else {
            candle_core::bail!("quantised matmul: {:?} weights", q.dtype());
        };
        let (out, k) = q.shape().dims2()?;
        Self::from_ggml(format, &q.data()?, out, k)
    }

    fn from_ggml(format: Format, blocks: &[u8], out: usize, k: usize) -> Result<Self> {
        let block_bytes = format.ggml_block_bytes();
        if k == 0 || !k.is_multiple_of(QK) || blocks.len() != out * (k / QK) * block_bytes {
            candle_core::bail!(
                "quantised matmul: {} bytes do not hold ({out}, {k}) {format:?} weights",
                blocks.len()
            );
        }
        let nb = k / QK;
        let row_bytes = row_bytes(format, nb);
        let bytes = WeightBytes::new(out * row_bytes + SLACK, |bytes| {
            for (source, row) in blocks
                .chunks_exact(nb * block_bytes)
                .zip(bytes.chunks_exact_mut(row_bytes))
            {
                repack_row(format, source, row);
            }
        });
        Ok(Self {
            format,
            out,
            k,
            bytes,
        })
    }

    /// `(out, in)`.
    pub(crate) fn shape(&self) -> (usize, usize) {
        (self.out, self.k)
    }

    /// Bytes of weights one product reads.
    pub(crate) fn storage_bytes(&self) -> usize {
        self.bytes.len() - SLACK
    }

    fn blocks_per_row(&self) -> usize {
        self.k / QK
    }

    fn row_bytes(&self) -> usize {
        row_bytes(self.format, self.blocks_per_row())
    }

    /// `x · qᵀ` for an `x` of shape (..., in), like candle's `QMatMul::forward`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let k = self.k;
        if x.rank() < 2 || x.dim(D::Minus1)? != k {
            candle_core::bail!(
                "quantised matmul: input {:?} against weights ({}, {k})",
                x.shape(),
                self.out
            );
        }
        if !x.device().is_cpu() {
            candle_core::bail!("quantised matmul: input is not on the CPU");
        }
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        let rows = x.elem_count() / k;
        let y = {
            let (storage, layout) = x.storage_and_layout();
            let candle_core::Storage::Cpu(cpu) = &*storage else {
                candle_core::bail!("quantised matmul: input is not on the CPU");
            };
            self.matmul(crate::fused::values(cpu, layout)?, rows)
        };
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("rank checked above") = self.out;
        Tensor::from_vec(y, dims, x.device())?.to_dtype(dtype)
    }

    /// Weight rows `range`, contiguous, and the [`SLACK`] bytes after them.
    fn rows(&self, range: std::ops::Range<usize>) -> &[u8] {
        let len = self.row_bytes();
        &self.bytes[range.start * len..range.end * len + SLACK]
    }

    /// `x · Wᵀ` for `rows` f32 rows of length `in`, row-major (rows, out).
    pub(crate) fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        self.matmul_with(Kernel::detect(), x, rows)
    }

    fn matmul_with(&self, kernel: Kernel, x: &[f32], rows: usize) -> Vec<f32> {
        assert_eq!(x.len(), rows * self.k, "quantised matmul: input length");
        let acts = Activations::quantize(kernel, x, self.blocks_per_row());
        let xs: Vec<ActRow> = (0..rows).map(|i| acts.row(i)).collect();
        let layout = RowLayout::of(self);
        crate::team::columns_in_parallel(rows, self.out, |range, block| {
            let w = self.rows(range.clone());
            let row_tile = kernel.row_tile();
            if (1..=row_tile).contains(&rows) {
                // One tile: the kernel's column-major output is the block's own layout.
                kernel.dot_rows(layout, w, &xs, block);
                return;
            }
            let mut dots = vec![0f32; range.len() * row_tile];
            for (t, tile) in xs.chunks(row_tile).enumerate() {
                let dots = &mut dots[..range.len() * tile.len()];
                kernel.dot_rows(layout, w, tile, dots);
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

/// Where a repacked weight row keeps its parts.
#[derive(Clone, Copy, Debug)]
struct RowLayout {
    format: Format,
    /// Blocks per row.
    nb: usize,
    /// Bytes per row.
    bytes: usize,
}

impl RowLayout {
    fn of(matrix: &QuantMatrix) -> Self {
        Self {
            format: matrix.format,
            nb: matrix.blocks_per_row(),
            bytes: matrix.row_bytes(),
        }
    }

    fn pairs(self) -> usize {
        self.nb.div_ceil(2)
    }

    /// Byte offset of the row's scales; its minimums (Q4_1) follow them.
    fn scales_at(self) -> usize {
        self.pairs() * self.format.pair_bytes()
    }
}

/// One activation block quantised to 8 bits: `x ≈ d · qs`, and `s = d · Σqs`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct ActBlock {
    d: f32,
    s: f32,
    qs: [i8; QK],
}

/// A pair of activation blocks' quants (module doc), on a cache line of its own: the kernels
/// load each half as one 32-byte vector per weight row, and at the allocator's 16-byte
/// alignment up to one in two of those loads would cross two cache lines.
#[derive(Clone, Copy)]
#[repr(align(64))]
struct ActPair([i8; 64]);

/// Every activation row quantised, in the pair layout of the module doc. Scales and sums are
/// padded with zeros to whole groups of [`SCALE_GROUP`] blocks, and a half pair with zero
/// quants. Each row has buffers of its own, so that the rows of a prefill are quantised in
/// parallel on the thread team rather than on the calling thread while the others wait.
///
/// A thread keeps the rows of its last products ([`SPARE_ROWS`]) and hands them to its next ones
/// of the same row length: a decode step runs some two hundred products of one row each, and
/// on an Intel Xeon (family 6 model 207) keeping them took the allocator's share of a GGUF
/// decode's samples from 2.3% to 1.6%. A kept row's padding is still zero, since quantising
/// writes only the row's own blocks.
struct Activations {
    rows: Vec<RowBuffers>,
}

/// One row of [`Activations`], for rows of `nb` blocks.
struct RowBuffers {
    nb: usize,
    qs: Vec<ActPair>,
    d: Vec<f32>,
    s: Vec<f32>,
}

/// The most rows a thread keeps for its next products: a decode step's batch, not a prefill's.
const SPARE_ROWS_KEPT: usize = 64;

thread_local! {
    /// Rows of this thread's finished products, for its next ones (see [`Activations`]).
    static SPARE_ROWS: std::cell::RefCell<Vec<RowBuffers>> = const {
        std::cell::RefCell::new(Vec::new())
    };
}

impl RowBuffers {
    /// Zeroed buffers for a row of `nb` blocks, padded as [`Activations`] says.
    fn zeroed(nb: usize) -> Self {
        let scales = nb.next_multiple_of(SCALE_GROUP);
        Self {
            nb,
            qs: vec![ActPair([0; 64]); nb.div_ceil(2)],
            d: vec![0.0; scales],
            s: vec![0.0; scales],
        }
    }
}

impl Drop for Activations {
    fn drop(&mut self) {
        // `try_with`: a thread that is exiting has dropped its spare rows already.
        let _ = SPARE_ROWS.try_with(|spare| {
            let mut spare = spare.borrow_mut();
            let room = SPARE_ROWS_KEPT.saturating_sub(spare.len());
            spare.extend(self.rows.drain(..).take(room));
        });
    }
}

impl Activations {
    fn quantize(kernel: Kernel, x: &[f32], nb: usize) -> Self {
        let count = x.len() / (nb * QK);
        let mut rows: Vec<RowBuffers> = SPARE_ROWS.with_borrow_mut(|spare| {
            let mut kept = Vec::with_capacity(count);
            let mut i = 0;
            while kept.len() < count && i < spare.len() {
                if spare[i].nb == nb {
                    kept.push(spare.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            kept
        });
        rows.extend((rows.len()..count).map(|_| RowBuffers::zeroed(nb)));
        crate::team::chunks_in_parallel(&mut rows, 1, |i, row| {
            let row = &mut row[0];
            for (b, block) in x[i * nb * QK..][..nb * QK]
                .as_chunks::<QK>()
                .0
                .iter()
                .enumerate()
            {
                let q = kernel.quantize(block);
                let pair = &mut row.qs[b / 2].0;
                let h = b % 2;
                pair[16 * h..16 * h + 16].copy_from_slice(&q.qs[..16]);
                pair[32 + 16 * h..32 + 16 * h + 16].copy_from_slice(&q.qs[16..]);
                row.d[b] = q.d;
                row.s[b] = q.s;
            }
        });
        Self { rows }
    }

    fn row(&self, i: usize) -> ActRow<'_> {
        let row = &self.rows[i];
        ActRow {
            qs: &row.qs,
            d: &row.d,
            s: &row.s,
        }
    }
}

/// One activation row of [`Activations`].
#[derive(Clone, Copy)]
struct ActRow<'a> {
    qs: &'a [ActPair],
    d: &'a [f32],
    s: &'a [f32],
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

/// `((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))`.
fn sum_lanes_scalar(v: [f32; LANES]) -> f32 {
    ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
}

/// One repacked weight row against one activation row, in the module's order of operations.
fn dot_scalar(layout: RowLayout, w: &[u8], x: ActRow) -> f32 {
    let format = layout.format;
    let half = |at: usize| half::f16::from_le_bytes([w[at], w[at + 1]]).to_f32();
    let scales = layout.scales_at();
    // Q8_0's odd pairs go to the second set of lanes (module doc).
    let mut acc = [[0f32; LANES]; 2];
    let mut min = [0f32; LANES];
    for b in 0..layout.nb {
        let (p, h) = (b / 2, b % 2);
        let pair = &w[p * format.pair_bytes()..][..format.pair_bytes()];
        // Element `j` of the block as an integer.
        let weight = |j: usize| -> i32 {
            match format {
                Format::Q4_1 => {
                    let byte = pair[16 * h + j % 16];
                    i32::from(if j < 16 { byte & 0x0F } else { byte >> 4 })
                }
                Format::Q8_0 => i32::from(pair[32 * (j / 16) + 16 * h + j % 16] as i8),
            }
        };
        let act = |j: usize| i32::from(x.qs[p].0[32 * (j / 16) + 16 * h + j % 16]);
        let dd = half(scales + 2 * b) * x.d[b];
        let acc = &mut acc[usize::from(format == Format::Q8_0) * (p % 2)];
        for l in 0..4 {
            let sum: i32 = (4 * l..4 * l + 4)
                .map(|j| weight(j) * act(j) + weight(16 + j) * act(16 + j))
                .sum();
            acc[4 * h + l] = dd.mul_add(sum as f32, acc[4 * h + l]);
        }
        if format == Format::Q4_1 {
            let m = half(scales + 2 * layout.nb + 2 * b);
            min[b % SCALE_GROUP] = m.mul_add(x.s[b], min[b % SCALE_GROUP]);
        }
    }
    let [even, odd] = acc;
    match format {
        Format::Q4_1 => sum_lanes_scalar(even) + sum_lanes_scalar(min),
        Format::Q8_0 => sum_lanes_scalar(std::array::from_fn(|l| even[l] + odd[l])),
    }
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

    /// `out[j * xs.len() + i] = w_j · xs[i]` for consecutive repacked weight rows `w_j`
    /// (followed by [`SLACK`] bytes) and up to `ROW_TILE` activation rows.
    fn dot_rows(self, layout: RowLayout, w: &[u8], xs: &[ActRow], out: &mut [f32]) {
        match *xs {
            [a] => self.dot_rows_of::<1>(layout, w, [a], out),
            [a, b] => self.dot_rows_of::<2>(layout, w, [a, b], out),
            [a, b, c] => self.dot_rows_of::<3>(layout, w, [a, b, c], out),
            [a, b, c, d] => self.dot_rows_of::<4>(layout, w, [a, b, c, d], out),
            [a, b, c, d, e] => self.dot_rows_of::<5>(layout, w, [a, b, c, d, e], out),
            [a, b, c, d, e, f] => self.dot_rows_of::<6>(layout, w, [a, b, c, d, e, f], out),
            [a, b, c, d, e, f, g] => self.dot_rows_of::<7>(layout, w, [a, b, c, d, e, f, g], out),
            [a, b, c, d, e, f, g, h] => {
                self.dot_rows_of::<8>(layout, w, [a, b, c, d, e, f, g, h], out)
            }
            _ => unreachable!("row tile of {}", xs.len()),
        }
    }

    fn dot_rows_of<const R: usize>(
        self,
        layout: RowLayout,
        w: &[u8],
        xs: [ActRow; R],
        out: &mut [f32],
    ) {
        let out = out.as_chunks_mut::<R>().0;
        assert_eq!(
            w.len(),
            out.len() * layout.bytes + SLACK,
            "quantised matmul: weight rows"
        );
        match self {
            Self::Scalar => {
                for (w, out) in w.chunks_exact(layout.bytes).zip(out) {
                    *out = xs.map(|x| dot_scalar(layout, w, x));
                }
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 | Self::Avx2Vnni => self.vector_rows(layout, w, xs, out),
        }
    }

    /// [`Self::dot_rows_of`] on a vector kernel.
    #[cfg(target_arch = "x86_64")]
    fn vector_rows<const R: usize>(
        self,
        layout: RowLayout,
        w: &[u8],
        xs: [ActRow; R],
        out: &mut [[f32; R]],
    ) {
        let q4_1 = layout.format == Format::Q4_1;
        // SAFETY (all four): `supported` listed the kernel only after finding its features;
        // `w` holds whole rows of `layout` and the slack after them, and every activation row
        // the pairs and padded scales of `layout.nb` blocks.
        match self {
            Self::Avx2 if q4_1 => unsafe { avx2_rows::dot_rows::<true, R>(layout, w, xs, out) },
            Self::Avx2 => unsafe { avx2_rows::dot_rows::<false, R>(layout, w, xs, out) },
            Self::Avx2Vnni if q4_1 => unsafe { vnni_rows::dot_rows::<true, R>(layout, w, xs, out) },
            Self::Avx2Vnni => unsafe { vnni_rows::dot_rows::<false, R>(layout, w, xs, out) },
            Self::Scalar => unreachable!("the scalar kernel has no vector rows"),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{ActBlock, QK};

    /// The eight lane sums of a pair of blocks (module doc): `w` unsigned, `x` signed, in two
    /// registers each. `maddubs` adds products in pairs into i16, which cannot saturate here (a
    /// pair is at most 2 · 128 · 127), and `madd` adds the pairs into i32.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn lane_sums(w: [__m256i; 2], x: [__m256i; 2]) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let half = |w, x| _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
        _mm256_add_epi32(half(w[0], x[0]), half(w[1], x[1]))
    }

    /// [`lane_sums`] for Q4_1, whose weights are nibbles: the two halves' pair sums are added in
    /// i16 before one `madd` (four instructions instead of five). Each pair sum is at most
    /// 2 · 15 · 128, so their sum stays far inside i16, and the lanes are the same exact
    /// integers. Q8_0's pair sums reach 2 · 128 · 127 and would overflow.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn lane_sums_nibbles(w: [__m256i; 2], x: [__m256i; 2]) -> __m256i {
        let pairs = _mm256_add_epi16(
            _mm256_maddubs_epi16(w[0], x[0]),
            _mm256_maddubs_epi16(w[1], x[1]),
        );
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
    }

    /// [`lane_sums`] in VNNI's byte dot products.
    #[target_feature(enable = "avx2,avx512vl,avx512vnni")]
    #[inline]
    pub(super) fn lane_sums_vnni(w: [__m256i; 2], x: [__m256i; 2]) -> __m256i {
        _mm256_dpbusd_epi32(
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[0], x[0]),
            w[1],
            x[1],
        )
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
        // Σqs, exact: byte pairs into i16, then pairs of those into eight i32 lanes.
        let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q8);
        let lanes = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        let half = _mm_add_epi32(
            _mm256_castsi256_si128(lanes),
            _mm256_extracti128_si256::<1>(lanes),
        );
        let half = _mm_add_epi32(half, _mm_shuffle_epi32::<0b01_00_11_10>(half));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(
            half,
            _mm_shuffle_epi32::<0b10_11_00_01>(half),
        ));
        ActBlock {
            d,
            s: d * sum as f32,
            qs,
        }
    }

    /// The first `count` of the eight f16 values at the start of `src` as f32, the other
    /// lanes zero (a scale group at a row's end has fewer than eight blocks).
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C, and `src` points at 16 readable bytes.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn halves(src: *const u8, count: usize) -> __m256 {
        // SAFETY: the caller's.
        let v = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(src.cast()) });
        if count >= 8 {
            return v;
        }
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let kept = _mm256_cmpgt_epi32(_mm256_set1_epi32(count as i32), lanes);
        _mm256_and_ps(v, _mm256_castsi256_ps(kept))
    }

    /// A pair of blocks' quants in the activations' order, as unsigned bytes (Q8_0's as `|w|`),
    /// and Q8_0's signed bytes, whose signs the kernel moves onto the activations.
    ///
    /// # Safety
    /// The CPU has AVX2, and `pair` points at a pair's 32 (Q4_1) or 64 (Q8_0) readable bytes.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) unsafe fn unpack<const Q4_1: bool>(pair: *const u8) -> ([__m256i; 2], [__m256i; 2]) {
        let pair = pair.cast::<__m256i>();
        if Q4_1 {
            // SAFETY: the caller's.
            let packed = unsafe { _mm256_loadu_si256(pair) };
            let low = _mm256_set1_epi8(0x0F);
            let q = [
                _mm256_and_si256(packed, low),
                _mm256_and_si256(_mm256_srli_epi16(packed, 4), low),
            ];
            (q, q)
        } else {
            // SAFETY: the caller's.
            let q = unsafe { [_mm256_loadu_si256(pair), _mm256_loadu_si256(pair.add(1))] };
            (q.map(|q| _mm256_sign_epi8(q, q)), q)
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

/// The AVX2 kernel's rows, once for each way of forming a pair's lane sums.
#[cfg(target_arch = "x86_64")]
macro_rules! byte_dot_kernel {
    ($name:ident, $features:literal, $lane_sums:path, $nibble_sums:path) => {
        mod $name {
            use std::arch::x86_64::*;

            use super::avx2::{halves, sum_lanes, unpack};
            use super::{ActRow, L2_AHEAD, PREFETCH_AHEAD, RowLayout, SCALE_GROUP};

            /// [`super::dot_scalar`] of each weight row of `w` against `R` activation rows.
            #[target_feature(enable = $features)]
            pub(super) fn dot_rows<const Q4_1: bool, const R: usize>(
                layout: RowLayout,
                w: &[u8],
                xs: [ActRow; R],
                out: &mut [[f32; R]],
            ) {
                let nb = layout.nb;
                for x in &xs {
                    assert!(
                        x.qs.len() >= nb.div_ceil(2)
                            && x.d.len() >= nb.next_multiple_of(SCALE_GROUP)
                            && x.s.len() >= nb.next_multiple_of(SCALE_GROUP),
                        "quantised matmul: activation row"
                    );
                }
                for (j, out) in out.iter_mut().enumerate() {
                    dot_row::<Q4_1, R>(layout, &w[j * layout.bytes..], &xs, out);
                }
            }

            /// [`dot_rows`] for the weight row at the start of `w`.
            #[target_feature(enable = $features)]
            #[inline]
            fn dot_row<const Q4_1: bool, const R: usize>(
                layout: RowLayout,
                w: &[u8],
                xs: &[ActRow; R],
                out: &mut [f32; R],
            ) {
                let nb = layout.nb;
                assert!(
                    w.len() >= layout.bytes + super::SLACK,
                    "quantised matmul: row"
                );
                let row = w.as_ptr();
                let zero = _mm256_setzero_ps();
                let mut lanes = Lanes {
                    acc: [zero; R],
                    acc_odd: [zero; R],
                    min: [zero; R],
                };
                // Whole groups with a fixed count, so that their pairs unroll without checks.
                let whole = nb / SCALE_GROUP * SCALE_GROUP;
                for g in (0..whole).step_by(SCALE_GROUP) {
                    // SAFETY: the asserts here and in `dot_rows`, as `group` requires; this
                    // function's features are the ones `group` runs on once inlined here.
                    unsafe { group::<Q4_1, R>(layout, row, xs, g, SCALE_GROUP, &mut lanes) };
                }
                if whole < nb {
                    // SAFETY: as above.
                    unsafe { group::<Q4_1, R>(layout, row, xs, whole, nb - whole, &mut lanes) };
                }
                let Lanes { acc, acc_odd, min } = lanes;
                for r in 0..R {
                    out[r] = if Q4_1 {
                        sum_lanes(acc[r]) + sum_lanes(min[r])
                    } else {
                        sum_lanes(_mm256_add_ps(acc[r], acc_odd[r]))
                    };
                }
            }

            /// A row's running lane sums against `R` activation rows.
            struct Lanes<const R: usize> {
                acc: [__m256; R],
                /// Q8_0's odd pairs (module doc).
                acc_odd: [__m256; R],
                min: [__m256; R],
            }

            /// The `blocks` blocks of the row at `row` from block `g` (a multiple of
            /// [`SCALE_GROUP`]) added into `lanes`.
            ///
            /// Always inlined into [`dot_row`], whose features it then runs on. Written as a
            /// closure there, it was left out of line by LLVM in some of the kernels for a
            /// row's last, short group (SmolLM2's rows of 18 blocks end in one of 2), which then
            /// passed the accumulators through memory.
            ///
            /// # Safety
            /// Called only from [`dot_row`], after its and [`dot_rows`]' asserts, with
            /// `blocks ≤ SCALE_GROUP` and `g + blocks ≤ layout.nb`.
            #[inline(always)]
            unsafe fn group<const Q4_1: bool, const R: usize>(
                layout: RowLayout,
                row: *const u8,
                xs: &[ActRow; R],
                g: usize,
                blocks: usize,
                lanes: &mut Lanes<R>,
            ) {
                let nb = layout.nb;
                let pair_bytes = layout.format.pair_bytes();
                let scales = row.wrapping_add(layout.scales_at());
                // SAFETY (every read below): the caller's; a scale group cut short at a row's
                // end reads on into the row's minimums, the next row or the slack, and `halves`
                // clears those lanes; activation scales and sums are padded to whole groups, and
                // quants to whole pairs.
                unsafe {
                    // The lanes of the group's scales that pair `i` of it spreads over its
                    // eight lane sums: block 2i over the first four, block 2i + 1 over the rest.
                    let spread: [__m256i; SCALE_GROUP / 2] = std::array::from_fn(|i| {
                        let (a, b) = (2 * i as i32, 2 * i as i32 + 1);
                        _mm256_setr_epi32(a, a, a, a, b, b, b, b)
                    });
                    let d_x = xs.map(|x| _mm256_loadu_ps(x.d.as_ptr().add(g)));
                    let d_w = halves(scales.add(2 * g), blocks);
                    let dd = d_x.map(|d_x| _mm256_mul_ps(d_w, d_x));
                    if Q4_1 {
                        let s_x = xs.map(|x| _mm256_loadu_ps(x.s.as_ptr().add(g)));
                        let m_w = halves(scales.add(2 * nb + 2 * g), blocks);
                        for (min, s_x) in lanes.min.iter_mut().zip(s_x) {
                            *min = _mm256_fmadd_ps(m_w, s_x, *min);
                        }
                    }
                    for (i, spread) in spread.iter().enumerate().take(blocks.div_ceil(2)) {
                        let p = g / 2 + i;
                        let pair = row.add(p * pair_bytes);
                        _mm_prefetch::<_MM_HINT_T0>(pair.wrapping_add(PREFETCH_AHEAD).cast());
                        _mm_prefetch::<_MM_HINT_T2>(pair.wrapping_add(L2_AHEAD).cast());
                        let (weights, signed) = unpack::<Q4_1>(pair);
                        for r in 0..R {
                            let qs = xs[r].qs.as_ptr().add(p).cast::<__m256i>();
                            let x = [_mm256_loadu_si256(qs), _mm256_loadu_si256(qs.add(1))];
                            // Q4_1's nibbles are unsigned; Q8_0's signed weights go in as
                            // |w|, their signs moved onto x.
                            let x = if Q4_1 {
                                x
                            } else {
                                [
                                    _mm256_sign_epi8(x[0], signed[0]),
                                    _mm256_sign_epi8(x[1], signed[1]),
                                ]
                            };
                            let sums = _mm256_cvtepi32_ps(if Q4_1 {
                                $nibble_sums(weights, x)
                            } else {
                                $lane_sums(weights, x)
                            });
                            let scale = _mm256_permutevar8x32_ps(dd[r], *spread);
                            if Q4_1 || p % 2 == 0 {
                                lanes.acc[r] = _mm256_fmadd_ps(scale, sums, lanes.acc[r]);
                            } else {
                                lanes.acc_odd[r] = _mm256_fmadd_ps(scale, sums, lanes.acc_odd[r]);
                            }
                        }
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
byte_dot_kernel!(
    avx2_rows,
    "avx2,fma,f16c",
    super::avx2::lane_sums,
    super::avx2::lane_sums_nibbles
);
#[cfg(target_arch = "x86_64")]
byte_dot_kernel!(
    vnni_rows,
    "avx2,fma,f16c,avx512vl,avx512vnni",
    super::avx2::lane_sums_vnni,
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
        quantized_from(format, random((out, k), seed), out, k)
    }

    fn quantized_from(format: Format, values: Vec<f32>, out: usize, k: usize) -> Arc<QTensor> {
        let w = Tensor::from_vec(values, (out, k), &Device::Cpu).unwrap();
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

    /// `x · wᵀ` (`rows` rows) on every kernel this CPU has, bit for bit the scalar kernel's.
    fn assert_every_kernel_gives_the_scalar_bits(w: &QuantMatrix, x: &[f32], rows: usize) {
        let scalar = w.matmul_with(Kernel::Scalar, x, rows);
        for kernel in Kernel::supported() {
            let got = w.matmul_with(kernel, x, rows);
            assert_eq!(
                bits(&scalar),
                bits(&got),
                "{:?} {kernel:?} ({}, {}) × {rows}",
                w.format,
                w.out,
                w.k
            );
        }
    }

    /// Every kernel this CPU has gives the scalar kernel's bits, for every remainder of the row
    /// tile, odd and even block counts, scale groups cut short at a row's end, and outputs that
    /// leave a short last chunk.
    #[test]
    fn every_kernel_gives_the_scalar_bits() {
        for format in FORMATS {
            for (out, k) in [(1, 32), (7, 96), (5, 288), (203, 4096), (50, 576)] {
                let w = QuantMatrix::from_qtensor(&quantized(format, out, k, out as u64)).unwrap();
                // No rows (an empty batch) up to more than one tile of the widest kernel.
                for rows in 0..=9 {
                    let x = random((rows, k), 7 + rows as u64);
                    assert_every_kernel_gives_the_scalar_bits(&w, &x, rows);
                }
            }
        }
    }

    /// The largest byte products the kernels meet, where a pair sum added in i16 would
    /// saturate first: weight blocks all +1, all −1 or alternating (one zero each), so Q4_1
    /// nibbles at 15 and Q8_0 quants at ±127, against activations at ±127 in rows of either
    /// sign. Every kernel still gives the scalar kernel's bits.
    #[test]
    fn the_largest_byte_products_give_the_scalar_bits() {
        let (out, k) = (6, 576);
        let weights: Vec<f32> = (0..out * k)
            .map(|i| match (i % QK, i / k % 3) {
                (0, _) => 0.0,
                (_, 0) => 1.0,
                (_, 1) => -1.0,
                _ if i % 2 == 0 => 1.0,
                _ => -1.0,
            })
            .collect();
        for format in FORMATS {
            let w = quantized_from(format, weights.clone(), out, k);
            let w = QuantMatrix::from_qtensor(&w).unwrap();
            for rows in [1, 8, 9] {
                let x: Vec<f32> = (0..rows * k)
                    .map(|i| if i / k % 2 == 0 { 1.0 } else { -1.0 })
                    .collect();
                assert_every_kernel_gives_the_scalar_bits(&w, &x, rows);
            }
        }
    }

    /// Rows a thread kept from earlier products give the bits of fresh ones: rows of another
    /// length (here left by a product of infinities) are not taken, and rows of the same length
    /// are overwritten in full.
    #[test]
    fn kept_activation_rows_give_the_bits_of_fresh_ones() {
        let clear = || SPARE_ROWS.with_borrow_mut(Vec::clear);
        let wide = QuantMatrix::from_qtensor(&quantized(Format::Q4_1, 16, 576, 7)).unwrap();
        let narrow = QuantMatrix::from_qtensor(&quantized(Format::Q8_0, 16, 96, 8)).unwrap();
        for (first, (then, k)) in [(&wide, (&narrow, 96)), (&narrow, (&wide, 576))] {
            let x = random((3, k), 21);
            clear();
            let fresh = then.matmul(&x, 3);
            clear();
            first.matmul(&vec![f32::INFINITY; 3 * first.k], 3);
            let beside_other_rows = then.matmul(&x, 3);
            then.matmul(&random((3, k), 22), 3);
            let in_kept_rows = then.matmul(&x, 3);
            assert_eq!(bits(&beside_other_rows), bits(&fresh), "k = {k}");
            assert_eq!(bits(&in_kept_rows), bits(&fresh), "k = {k}");
        }
        clear();
    }

    /// A row's output is the same whatever is batched with it.
    #[test]
    fn a_rows_output_does_not_depend_on_its_batch() {
        for format in FORMATS {
            let (out, k) = (64, 256);
            let w = QuantMatrix::from_qtensor(&quantized(format, out, k, 3)).unwrap();
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
    /// kernels' rounding. Odd block counts (a half pair at each row's end) against the exact
    /// product only.
    #[test]
    fn outputs_are_the_exact_product_within_the_activations_rounding() {
        for format in FORMATS {
            for (out, k, rows) in [
                (37, 64, 3),
                (37, 64, 1),
                (19, 288, 2),
                (301, 4096, 2),
                (576, 1536, 5),
            ] {
                let q = quantized(format, out, k, 1);
                let w = q
                    .dequantize(&Device::Cpu)
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap();
                let x = random((rows, k), 2);
                let got =
                    QuantMatrix::from_qtensor(&q)
                        .unwrap()
                        .matmul_with(Kernel::detect(), &x, rows);
                // candle's own Q4_1 kernel takes only an even number of blocks per row.
                let candle = (k / QK).is_multiple_of(2).then(|| {
                    let xt = Tensor::from_vec(x.clone(), (rows, k), &Device::Cpu).unwrap();
                    QMatMul::from_arc(q.clone())
                        .unwrap()
                        .forward(&xt)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                });
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
                        if let Some(candle) = &candle {
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
    }

    #[test]
    fn only_q4_1_and_q8_0_on_the_cpu_are_repacked() {
        let w = Tensor::from_vec(random((8, 256), 2), (8, 256), &Device::Cpu).unwrap();
        for (dtype, expected) in [
            (GgmlDType::Q4_1, true),
            (GgmlDType::Q8_0, true),
            (GgmlDType::Q4_0, false),
            (GgmlDType::Q4K, false),
        ] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            assert_eq!(repacks(&q), expected, "{dtype:?}");
        }
        let err = QuantMatrix::from_qtensor(&QTensor::quantize(&w, GgmlDType::Q4_0).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("Q4_0 weights"), "{err}");
    }

    /// `forward` takes any input dtype and batch shape, and refuses a wrong width.
    #[test]
    fn forward_keeps_the_batch_shape_and_dtype_and_checks_the_width() {
        let w = QuantMatrix::from_qtensor(&quantized(Format::Q8_0, 8, 64, 3)).unwrap();
        let x = Tensor::from_vec(random((6, 64), 4), (2, 3, 64), &Device::Cpu).unwrap();
        let y = w.forward(&x).unwrap();
        assert_eq!(y.dims(), &[2, 3, 8]);
        let rows = w.matmul(&x.flatten_all().unwrap().to_vec1::<f32>().unwrap(), 6);
        assert_eq!(
            bits(&y.flatten_all().unwrap().to_vec1().unwrap()),
            bits(&rows)
        );
        let half = w.forward(&x.to_dtype(DType::BF16).unwrap()).unwrap();
        assert_eq!(half.dtype(), DType::BF16);
        let err = w
            .forward(&Tensor::zeros((2, 96), DType::F32, &Device::Cpu).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("against weights (8, 64)"), "{err}");
    }

    #[test]
    fn weights_of_the_wrong_size_are_refused() {
        let err = QuantMatrix::from_ggml(Format::Q4_1, &[0u8; 39], 1, 64)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("39 bytes do not hold (1, 64) Q4_1"), "{err}");
        assert!(QuantMatrix::from_ggml(Format::Q8_0, &[0u8; 68], 1, 64).is_ok());
        assert!(QuantMatrix::from_ggml(Format::Q8_0, &[0u8; 68], 2, 32).is_ok());
        assert!(
            QuantMatrix::from_ggml(Format::Q8_0, &[0u8; 34], 1, 48).is_err(),
            "k not a block multiple"
        );
    }
}
