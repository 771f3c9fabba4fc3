//! Fused CPU kernels with their backward passes, for training: candle's own fused kernels have
//! no backward pass, so without these a tracked forward composes many element-wise tensor ops,
//! each a pass over memory and an allocation.
//!
//! - [`RmsNormOp`]: `x / sqrt(mean(x²) + eps)` over the last dimension, one pass forward and
//!   one pass backward (`dx = r (g - y · mean(g y))`, `r = 1 / sqrt(mean(x²) + eps)`).
//! - [`ScaledRmsNormOp`]: the same with a learned scale (Llama's), whose gradient is summed over
//!   the rows in fixed blocks of rows, added in order.
//! - [`SoftmaxOp`]: softmax over the last dimension (attention's), one pass forward and one pass
//!   backward from the output (`dx = y (g - sum(g y))`).
//! - [`SwiGluOp`]: `silu(gate) · up` over rows of `[gate | up]`, one pass forward, one pass
//!   backward writing both halves' gradients in the same layout.
//! - [`swiglu_mlp`] and [`grouped_swiglu_mlp`]: a whole SwiGLU MLP (gate/up product, gating,
//!   down product; dense, or per expert over the rows routed to each) as one graph node for
//!   training, so that its two widest activations get no zeroed gradient buffers from candle's
//!   backward pass (`mlp.rs`).
//! - [`RopeOp`]: the rotary embedding of `[batch, heads, seq, head_dim]`; its backward pass is
//!   the same kernel turning the other way (`sin → -sin`).
//! - [`batched_matmul`]: attention's `scale · A · B` over `[batch, heads]` of small matrices,
//!   one single-threaded GEMM per matrix spread over the thread team (candle runs the matrices
//!   one after another, each split over a pool, which costs more in hand-offs than small
//!   matrices take); its backward pass is two more of the same (`dA = scale · G Bᵀ`,
//!   `dB = scale · Aᵀ G`).
//! - [`grouped_linear`]: a mixture-of-experts block's per-expert products, `x · w[e]ᵀ` over the
//!   rows routed to each expert, as one op on the weights as stored (`[experts, out, in]`); its
//!   backward pass writes each expert's weight gradient into its own block of the weight's own
//!   layout (`dW[e] = gₑᵀ · xₑ`), so no transposed view of the weight becomes a graph node.
//! - [`gather_rows`] and [`combine_rows`]: a mixture-of-experts block's gather of tokens into
//!   routing slots and its weighted scatter back (`routing.rs`).
//! - [`cross_entropy`]: mean next-token cross-entropy over the vocabulary, one pass forward and
//!   one pass backward (`dx = (softmax(x) - onehot(label)) · g`), no `[rows, vocab]` temporaries
//!   besides the gradient itself.
//! - [`head_cross_entropy`]: the language-model head's product and that cross-entropy as one
//!   op, whose logits never become a graph node (`head_loss.rs`).
//!
//! Their products go through one gemm wrapper (`gemm_at`), which cuts large products into one
//! block per thread and writes narrow ones column-major, moved into place by `transpose.rs`.
//! Their `exp` is `exp.rs`'s, eight or sixteen lanes at a time. Inference uses [`SoftmaxOp`]
//! too (on the CPU in f32) and [`sigmoid`] for the attention gate, for the same `exp`: glibc's
//! scalar `expf` behind candle's own kernels was 6% of a prefill's samples.
//!
//! Each runs on f32 CPU tensors whose rows (last dimension) are contiguous at one stride, so a
//! `narrow` of the last dimension needs no copy; callers use the composed form elsewhere. Rows,
//! matrices and the blocks of a large product are spread over candle's persistent thread team
//! (`crate::team`), the one that candle's own CPU kernels use, except in tensors too small to
//! pay for the hand-off: a second pool (rayon's, gemm's own parallel mode) would wake and spin
//! against it between one op and the next. Tests hold each to the composed form's values and
//! gradients. The slice helpers here also serve the fused AdamW step (`train::optim`).

use std::mem::MaybeUninit;
use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Tensor};

use crate::layers::RopeLayout;

mod attention;
mod exp;
mod head_loss;
mod linear;
mod mlp;
mod routing;
mod transpose;
mod weight_grads;
pub use attention::AttentionOp;
pub(crate) use exp::gate_in_place;
pub use head_loss::head_cross_entropy;
pub use linear::linear;
pub use mlp::{grouped_swiglu_mlp, swiglu_mlp};
pub use routing::{Routing, combine_rows, gather_rows};
pub use weight_grads::{WeightGrads, summing_weight_grads};

/// Root-mean-square normalisation without a scale, with its backward pass.
pub struct RmsNormOp {
    pub eps: f32,
}

fn error(message: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("fused kernels: {message}"))
}

/// A storage's CPU side, or an error naming the kernels for any other device.
pub(crate) fn cpu_storage(storage: &candle_core::Storage) -> candle_core::Result<&CpuStorage> {
    match storage {
        candle_core::Storage::Cpu(cpu) => Ok(cpu),
        _ => Err(error("CPU tensors only")),
    }
}

/// The contiguous f32 values of a CPU storage.
pub(crate) fn values<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a [f32]> {
    values_of(storage, layout)
}

/// The contiguous values of a CPU storage of `T`.
pub(crate) fn values_of<'a, T: candle_core::WithDType>(
    storage: &'a CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a [T]> {
    let (start, end) = contiguous(layout)?;
    Ok(&storage.as_slice::<T>()?[start..end])
}

pub(crate) fn values_mut<'a>(
    storage: &'a mut CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a mut [f32]> {
    let (start, end) = contiguous(layout)?;
    match storage {
        CpuStorage::F32(values) => Ok(&mut values[start..end]),
        _ => Err(error("f32 only")),
    }
}

fn contiguous(layout: &Layout) -> candle_core::Result<(usize, usize)> {
    layout
        .contiguous_offsets()
        .ok_or_else(|| error("contiguous tensors only"))
}

/// The rows (last dimension) of a tensor whose rows are each contiguous and lie at one stride:
/// a contiguous tensor, or a `narrow` of one along its last dimension.
struct Rows<'a> {
    values: &'a [f32],
    stride: usize,
    width: usize,
    count: usize,
}

impl<'a> Rows<'a> {
    fn new(storage: &'a CpuStorage, layout: &Layout) -> candle_core::Result<Self> {
        let stride =
            row_stride(layout).ok_or_else(|| error("rows must be contiguous, at one stride"))?;
        let dims = layout.dims();
        let width = dims.last().copied().unwrap_or(1);
        let count = dims.iter().rev().skip(1).product::<usize>();
        let start = layout.start_offset();
        let len = if count == 0 || width == 0 {
            0
        } else {
            (count - 1) * stride + width
        };
        let values = storage
            .as_slice::<f32>()?
            .get(start..start + len)
            .ok_or_else(|| error("layout outside its storage"))?;
        Ok(Self {
            values,
            stride,
            width,
            count,
        })
    }

    /// `values` as contiguous rows of `width`.
    fn dense(values: &'a [f32], width: usize) -> Self {
        Self {
            values,
            stride: width,
            width,
            count: values.len().checked_div(width).unwrap_or(0),
        }
    }

    fn row(&self, i: usize) -> &'a [f32] {
        &self.values[i * self.stride..i * self.stride + self.width]
    }
}

/// The stride of the innermost of `dims` longer than one, if all of those nest without gaps
/// (dimensions of length one may carry any stride); `Some(None)` when none is longer than one.
fn nested_step(dims: &[usize], strides: &[usize]) -> Option<Option<usize>> {
    let outer: Vec<(usize, usize)> = dims
        .iter()
        .zip(strides)
        .filter(|&(&d, _)| d > 1)
        .map(|(&d, &s)| (d, s))
        .collect();
    let Some(&(_, step)) = outer.last() else {
        return Some(None);
    };
    let mut expected = step;
    for &(d, s) in outer.iter().rev() {
        if s != expected {
            return None;
        }
        expected *= d;
    }
    Some(Some(step))
}

/// The distance between a layout's rows if each row is contiguous and they lie at one stride.
fn row_stride(layout: &Layout) -> Option<usize> {
    let (dims, strides) = (layout.dims(), layout.stride());
    let Some((&width, leading)) = dims.split_last() else {
        return Some(1);
    };
    if width > 1 && strides[leading.len()] != 1 {
        return None;
    }
    match nested_step(leading, strides)? {
        None => Some(width),
        Some(row) => (row >= width).then_some(row),
    }
}

/// `x` itself where the fused kernels can read its rows in place, else a contiguous copy.
fn row_readable(x: &Tensor) -> candle_core::Result<Tensor> {
    if row_stride(x.layout()).is_some() {
        Ok(x.clone())
    } else {
        x.contiguous()
    }
}

/// Below this many values a row kernel runs on the calling thread: handing it to the team costs
/// more than the work (a decode step's gate or router rows).
const PARALLEL_MIN_VALUES: usize = 1 << 14;

/// A new `[rows, width]` buffer filled row by row by `fill(row_index, out_row)`, in parallel
/// unless it is small. Each row is zeroed just before its `fill`, by the thread that fills it.
fn fill_rows(count: usize, width: usize, fill: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    fill_rows_reading(count, width, width, fill)
}

/// [`fill_rows`] for rows that each read `read` values, which decide whether the work is
/// worth the hand-off (the cross-entropy writes one value per row of the vocabulary).
///
/// The buffer is not zeroed up front: on the calling thread that would be a serial pass over
/// the whole output while the team waits (a training step's profile put 3–4% of the calling
/// thread's time there, with the worker idle), and a recycled heap block must be zeroed by
/// hand. Each row is zeroed instead where it is filled, in cache, on the team.
fn fill_rows_reading(
    count: usize,
    width: usize,
    read: usize,
    fill: impl Fn(usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    let len = count * width;
    let mut out = Vec::with_capacity(len);
    if width == 0 {
        return out;
    }
    let zero_then_fill = |i: usize, row: &mut [MaybeUninit<f32>]| {
        row.fill(MaybeUninit::new(0.0));
        // SAFETY: every element of `row` was written just above, and `MaybeUninit<f32>` has
        // the layout of `f32`.
        let row = unsafe { &mut *(std::ptr::from_mut::<[MaybeUninit<f32>]>(row) as *mut [f32]) };
        fill(i, row);
    };
    let rows = &mut out.spare_capacity_mut()[..len];
    if count * read.max(width) < PARALLEL_MIN_VALUES {
        rows.chunks_mut(width)
            .enumerate()
            .for_each(|(i, row)| zero_then_fill(i, row));
    } else {
        crate::team::chunks_in_parallel(rows, width, zero_then_fill);
    }
    // SAFETY: both branches handed every `width`-value row of the first `len` values to
    // `zero_then_fill` (chunks_in_parallel's contract), which initialised all of it; a panic
    // in `fill` unwinds past this line and drops the vector with length 0.
    unsafe { out.set_len(len) };
    out
}

/// `row(out, x)` over every row (last dimension) of `x`: a new contiguous tensor of `x`'s shape.
fn map_rows(
    storage: &CpuStorage,
    layout: &Layout,
    row: impl Fn(&mut [f32], &[f32]) + Sync,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let x = Rows::new(storage, layout)?;
    let out = fill_rows(x.count, x.width, |i, out| row(out, x.row(i)));
    Ok((CpuStorage::F32(out), layout.shape().clone()))
}

/// `row(out, a, b)` over matching rows of `a` and `b` (of one shape), like [`map_rows`].
fn map_row_pairs(
    (a_storage, a_layout): (&CpuStorage, &Layout),
    (b_storage, b_layout): (&CpuStorage, &Layout),
    row: impl Fn(&mut [f32], &[f32], &[f32]) + Sync,
) -> candle_core::Result<(CpuStorage, Shape)> {
    same_shape(a_layout, b_layout)?;
    let (a, b) = (
        Rows::new(a_storage, a_layout)?,
        Rows::new(b_storage, b_layout)?,
    );
    let out = fill_rows(a.count, a.width, |i, out| row(out, a.row(i), b.row(i)));
    Ok((CpuStorage::F32(out), a_layout.shape().clone()))
}

fn same_shape(a: &Layout, b: &Layout) -> candle_core::Result<()> {
    if a.dims() == b.dims() {
        Ok(())
    } else {
        Err(error("operands of different shapes"))
    }
}

/// Partial sums of [`rms`]'s squares: as many as a 64-byte line holds f32 values.
const SQUARE_LANES: usize = 16;

/// `sqrt(mean(x²) + eps)` of one row.
///
/// The squares go into [`SQUARE_LANES`] partial sums, lane `j` taking elements `j`, `j + 16`, …,
/// which are then added in a fixed order: in a single running sum each add waits for the one
/// before, and that held a batch-8 prompt's norms at 4–5% of its time on an Intel Xeon of family
/// 6 model 106 (docs/performance.md, "An Intel Xeon without AMX"). The order depends only on the
/// row's length, so every CPU gives the same bits (Rust never fuses the multiply into the add).
fn rms(row: &[f32], eps: f32) -> f32 {
    let (lines, tail) = row.as_chunks::<SQUARE_LANES>();
    let mut lanes = [0f32; SQUARE_LANES];
    for line in lines {
        for (lane, &x) in lanes.iter_mut().zip(line) {
            *lane += x * x;
        }
    }
    for (lane, &x) in lanes.iter_mut().zip(tail) {
        *lane += x * x;
    }
    let sum = lanes.iter().sum::<f32>();
    (sum / row.len() as f32 + eps).sqrt()
}

/// One row of [`RmsNormOp`]: `y = x / sqrt(mean(x²) + eps)`.
pub(crate) fn rms_norm_row(x: &[f32], eps: f32, y: &mut [f32]) {
    // A division, as the composed form divides.
    let scale = rms(x, eps);
    for (y, &x) in y.iter_mut().zip(x) {
        *y = x / scale;
    }
}

impl CustomOp1 for RmsNormOp {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        map_rows(storage, layout, |y, x| rms_norm_row(x, self.eps, y))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        x.apply_op2_no_bwd(&grad, &RmsNormGrad { eps: self.eps })
            .map(Some)
    }
}

/// The input gradient of [`RmsNormOp`], from the input and the output's gradient.
struct RmsNormGrad {
    eps: f32,
}

impl CustomOp2 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "fused-rms-norm-grad"
    }

    fn cpu_fwd(
        &self,
        x_storage: &CpuStorage,
        x_layout: &Layout,
        g_storage: &CpuStorage,
        g_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        map_row_pairs((x_storage, x_layout), (g_storage, g_layout), |dx, x, g| {
            dx.copy_from_slice(g);
            rms_norm_grad_in_place(x, self.eps, dx);
        })
    }
}

/// The input gradient of one row of the unscaled norm, in place: `dx` holds the output's
/// gradient `g` on entry and `r (g - y · mean(g y))` on return. Returns the row's
/// `sqrt(mean(x²) + eps)`.
fn rms_norm_grad_in_place(x: &[f32], eps: f32, dx: &mut [f32]) -> f32 {
    let norm = rms(x, eps);
    let r = 1.0 / norm;
    let mean_gy = x.iter().zip(&*dx).map(|(&x, &g)| g * x * r).sum::<f32>() / x.len() as f32;
    for (dx, &x) in dx.iter_mut().zip(x) {
        *dx = r * (*dx - x * r * mean_gy);
    }
    norm
}

/// RMSNorm with a learned scale (Llama's): `(x / sqrt(mean(x²) + eps)) · w` over the last
/// dimension, one pass forward and one pass backward. Composed as [`RmsNormOp`] and a broadcast
/// product, the scale cost a product forward, two backward, and a sum over every row for its
/// gradient, which candle runs on one thread.
pub struct ScaledRmsNormOp {
    pub eps: f32,
}

/// Rows per partial sum of the scale's gradient: the partials are added in row order, so the
/// gradient does not depend on the number of threads.
const SCALE_GRAD_ROWS: usize = 64;

impl ScaledRmsNormOp {
    fn scale<'a>(
        w_storage: &'a CpuStorage,
        w_layout: &Layout,
        width: usize,
    ) -> candle_core::Result<&'a [f32]> {
        let w = values(w_storage, w_layout)?;
        if w_layout.dims() != [width] {
            return Err(error("rms norm: one scale per column"));
        }
        Ok(w)
    }
}

/// One row of [`ScaledRmsNormOp`]: `y = x / sqrt(mean(x²) + eps) · w`.
pub(crate) fn scaled_rms_norm_row(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let scale = rms(x, eps);
    for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
        // The unscaled norm's division, then the product, as the composed form.
        *y = (x / scale) * w;
    }
}

impl CustomOp2 for ScaledRmsNormOp {
    fn name(&self) -> &'static str {
        "fused-scaled-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x_storage: &CpuStorage,
        x_layout: &Layout,
        w_storage: &CpuStorage,
        w_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = Rows::new(x_storage, x_layout)?;
        let w = Self::scale(w_storage, w_layout, x.width)?;
        let out = fill_rows(x.count, x.width, |i, y| {
            scaled_rms_norm_row(x.row(i), w, self.eps, y);
        });
        Ok((CpuStorage::F32(out), x_layout.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let (x_guard, x_layout) = x.storage_and_layout();
        let (w_guard, w_layout) = w.storage_and_layout();
        let (g_guard, g_layout) = grad.storage_and_layout();
        let xs = Rows::new(cpu_storage(&x_guard)?, x_layout)?;
        let gs = Rows::new(cpu_storage(&g_guard)?, g_layout)?;
        same_shape(x_layout, g_layout)?;
        let scale = Self::scale(cpu_storage(&w_guard)?, w_layout, xs.width)?;
        let width = xs.width;
        // One pass over blocks of rows: each row's `dx` is the unscaled norm's with `g · w` for
        // its output gradient, and the block's partial sum of `g · y` for the scale.
        let mut d_x = vec![0f32; xs.count * width];
        let partials: Vec<OnceLock<Vec<f32>>> = (0..xs.count.div_ceil(SCALE_GRAD_ROWS))
            .map(|_| OnceLock::new())
            .collect();
        crate::team::chunks_in_parallel(&mut d_x, SCALE_GRAD_ROWS * width, |block, d_x| {
            let mut sums = vec![0f32; width];
            for (j, dx) in d_x.chunks_exact_mut(width).enumerate() {
                let i = block * SCALE_GRAD_ROWS + j;
                let (x, g) = (xs.row(i), gs.row(i));
                for ((dx, &g), &w) in dx.iter_mut().zip(g).zip(scale) {
                    *dx = g * w;
                }
                let norm = rms_norm_grad_in_place(x, self.eps, dx);
                for ((sum, &x), &g) in sums.iter_mut().zip(x).zip(g) {
                    *sum += g * (x / norm);
                }
            }
            // Each block is filled once, by the one thread that holds it.
            let _ = partials[block].set(sums);
        });
        let mut d_w = vec![0f32; width];
        for partial in partials {
            let partial = partial.into_inner().expect("every block was filled");
            for (d_w, p) in d_w.iter_mut().zip(partial) {
                *d_w += p;
            }
        }
        let d_x = Tensor::from_vec(d_x, x.shape(), x.device())?;
        let d_w = Tensor::from_vec(d_w, width, w.device())?;
        Ok((Some(d_x), Some(d_w)))
    }
}

/// Softmax over the last dimension, with its backward pass.
pub struct SoftmaxOp;

impl CustomOp1 for SoftmaxOp {
    fn name(&self) -> &'static str {
        "fused-softmax"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        map_rows(storage, layout, softmax_row)
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        y.apply_op2_no_bwd(&grad, &SoftmaxGrad).map(Some)
    }
}

/// `1 / (1 + exp(-x))` element-wise: on the CPU in f32 with the vectorised `exp` (inference: no
/// backward pass, so only for untracked tensors), elsewhere candle's.
pub(crate) fn sigmoid(x: &Tensor) -> candle_core::Result<Tensor> {
    if !x.track_op() && x.device().is_cpu() && x.dtype() == candle_core::DType::F32 {
        row_readable(x)?.apply_op1_no_bwd(&SigmoidOp)
    } else {
        candle_nn::ops::sigmoid(x)
    }
}

/// [`sigmoid`] on the CPU in f32: `exp.rs`'s sigmoid of each row.
struct SigmoidOp;

impl CustomOp1 for SigmoidOp {
    fn name(&self) -> &'static str {
        "fused-sigmoid"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        map_rows(storage, layout, |y, x| {
            y.copy_from_slice(x);
            exp::sigmoid_in_place(y);
        })
    }
}

/// `y = softmax(x)` of one row.
fn softmax_row(y: &mut [f32], x: &[f32]) {
    y.copy_from_slice(x);
    softmax_in_place(y);
}

/// `x ← softmax(x)` of one row: every softmax of the CPU paths (training, prefill) computes this
/// way, and decode attention its first half ([`exp_from_max`]) over each part of a cache.
pub(crate) fn softmax_in_place(x: &mut [f32]) {
    let (_, total) = exp_from_max(x);
    // One division per row and a multiply per value: a division per value was a third of the
    // row's time (batch-8 prefill, Intel Xeon with AVX-512).
    let inverse = total.recip();
    for x in x.iter_mut() {
        *x *= inverse;
    }
}

/// `x ← exp(x − max(x))`, the softmax before its division. Returns the input's maximum and the
/// sum of the exponentials, so that a row softmaxed in parts can be merged.
pub(crate) fn exp_from_max(x: &mut [f32]) -> (f32, f32) {
    let max = exp::max(x);
    (max, exp::exp_shifted(x, max))
}

/// `dx = y (g - sum(g y))`: the input gradient of one softmax row from its output `y` and the
/// output's gradient `g`.
fn softmax_grad_row(dx: &mut [f32], y: &[f32], g: &[f32]) {
    let gy = y.iter().zip(g).map(|(&y, &g)| g * y).sum::<f32>();
    for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(g) {
        *dx = y * (g - gy);
    }
}

/// The input gradient of [`SoftmaxOp`], from its output and the output's gradient.
struct SoftmaxGrad;

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "fused-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        y_storage: &CpuStorage,
        y_layout: &Layout,
        g_storage: &CpuStorage,
        g_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        map_row_pairs(
            (y_storage, y_layout),
            (g_storage, g_layout),
            softmax_grad_row,
        )
    }
}

/// `silu(gate) · up` (SwiGLU's gating) over `[.., 2 · width]` rows holding `[gate | up]`, as
/// one projection produces them, with its backward pass, which writes both halves' gradients in
/// the same layout.
pub struct SwiGluOp;

/// The rows of a `[gate | up]` operand, and their shape with the last dimension halved.
fn halves<'a>(storage: &'a CpuStorage, layout: &Layout) -> candle_core::Result<(Rows<'a>, Shape)> {
    let rows = Rows::new(storage, layout)?;
    if rows.width % 2 != 0 {
        return Err(error("swiglu needs rows of [gate | up]"));
    }
    let mut dims = layout.dims().to_vec();
    *dims.last_mut().expect("rows have a last dimension") /= 2;
    Ok((rows, Shape::from(dims)))
}

impl CustomOp1 for SwiGluOp {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (both, shape) = halves(storage, layout)?;
        Ok((CpuStorage::F32(swiglu_rows(&both)), shape))
    }

    fn bwd(
        &self,
        both: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let grad = row_readable(grad)?;
        row_readable(both)?
            .apply_op2_no_bwd(&grad, &SwiGluGrad)
            .map(Some)
    }
}

/// `silu(gate) · up` of each `[gate | up]` row of `both`: `both.count` rows of half its width.
fn swiglu_rows(both: &Rows) -> Vec<f32> {
    let width = both.width / 2;
    fill_rows(both.count, width, |i, out| {
        let (gate, up) = both.row(i).split_at(width);
        swiglu_row(gate, up, out);
    })
}

/// `silu(gate) · up` of one row, into `out`.
pub(crate) fn swiglu_row(gate: &[f32], up: &[f32], out: &mut [f32]) {
    exp::swiglu(gate, up, out);
}

/// The gradient of [`swiglu_rows`] at `both` from the output's gradient `grad`, in `both`'s
/// `[gate | up]` layout (contiguous).
fn swiglu_grad_rows(both: &Rows, grad: &Rows) -> Vec<f32> {
    let width = both.width / 2;
    fill_rows(both.count, both.width, |i, out| {
        let (gate, up) = both.row(i).split_at(width);
        exp::swiglu_grad(gate, up, grad.row(i), out.split_at_mut(width));
    })
}

/// `silu(gate) · up` of `[.., 2 · width]` rows holding `[gate | up]`: on the CPU in f32 the
/// fused kernel (gradients included), elsewhere composed.
pub fn swiglu(both: &Tensor) -> candle_core::Result<Tensor> {
    if both.device().is_cpu() && both.dtype() == candle_core::DType::F32 {
        row_readable(both)?.apply_op1(SwiGluOp)
    } else {
        let width = both.dim(candle_core::D::Minus1)? / 2;
        let gate = both.narrow(candle_core::D::Minus1, 0, width)?;
        gate.silu()? * both.narrow(candle_core::D::Minus1, width, width)?
    }
}

/// The gradient of [`SwiGluOp`] from its input and the output's gradient `g`: for the gate
/// half `g · up · sigmoid(gate) · (1 + gate · (1 - sigmoid(gate)))`, for the up half
/// `g · silu(gate)`.
struct SwiGluGrad;

impl CustomOp2 for SwiGluGrad {
    fn name(&self) -> &'static str {
        "fused-swiglu-grad"
    }

    fn cpu_fwd(
        &self,
        both_storage: &CpuStorage,
        both_layout: &Layout,
        grad_storage: &CpuStorage,
        grad_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (both, shape) = halves(both_storage, both_layout)?;
        if grad_layout.dims() != shape.dims() {
            return Err(error("swiglu gradient of the wrong shape"));
        }
        let grad = Rows::new(grad_storage, grad_layout)?;
        let out = swiglu_grad_rows(&both, &grad);
        Ok((CpuStorage::F32(out), both_layout.shape().clone()))
    }
}

/// The rotary embedding of `x: [batch, heads, seq, head_dim]` by the angles `cos`, `sin` of shape
/// `[batch, seq, head_dim / 2]` (its second and third operands, which take no gradient); its
/// backward pass rotates the gradient back.
pub struct RopeOp {
    pub layout: RopeLayout,
}

impl CustomOp3 for RopeOp {
    fn name(&self) -> &'static str {
        "fused-rope"
    }

    fn cpu_fwd(
        &self,
        x_storage: &CpuStorage,
        x_layout: &Layout,
        cos_storage: &CpuStorage,
        cos_layout: &Layout,
        sin_storage: &CpuStorage,
        sin_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, h, s, d) = x_layout.shape().dims4()?;
        let half = d / 2;
        if d % 2 != 0 || cos_layout.dims() != [b, s, half] || sin_layout.dims() != [b, s, half] {
            return Err(error("rope needs [b, h, s, d] with angles [b, s, d / 2]"));
        }
        let x = values(x_storage, x_layout)?;
        let (cos, sin) = (
            values(cos_storage, cos_layout)?,
            values(sin_storage, sin_layout)?,
        );
        // One row per (batch, head, position); its angles are those of (batch, position).
        let out = fill_rows(b * h * s, d, |row, out| {
            let (batch, position) = (row / (h * s), row % s);
            let at = (batch * s + position) * half;
            let (cos, sin) = (&cos[at..at + half], &sin[at..at + half]);
            rotate(self.layout, &x[row * d..(row + 1) * d], cos, sin, out);
        });
        Ok((CpuStorage::F32(out), x_layout.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = grad
            .contiguous()?
            .apply_op3_no_bwd(cos, &sin.neg()?, self)?;
        Ok((Some(back), None, None))
    }
}

/// `f` on the contiguous f32 values of a CPU tensor.
pub(crate) fn read<R>(
    t: &Tensor,
    f: impl FnOnce(&[f32]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    f(values(cpu_storage(&storage)?, layout)?)
}

/// Asks for every line of `block`.
pub(crate) fn prefetch(block: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in block.chunks(16) {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: SSE is in every x86_64 CPU, and a prefetch is a hint that never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = block;
}

/// Rows ahead of the one being read that [`prefetch_head_ahead`] asks for: a row's rotation is a
/// few dozen instructions, and a load from L3 takes far longer (an estimate, not measured here).
/// Other distances were not tried.
const HEAD_AHEAD: usize = 8;

/// Asks for one head's `len` values at `at` of row `t + HEAD_AHEAD` of `rows` (`width` values
/// a row), if that row exists.
///
/// A prompt's rotation and cache writes read one head of each position's projection row: four
/// lines, then the next row's a whole row further on (4 KB for `models/sample`), a stride the
/// hardware prefetcher does not follow, so once the projection has left L2 (a batch-8 prompt's
/// does) each row's load waited for L3 (docs/performance.md, "An Intel Xeon without AMX").
pub(crate) fn prefetch_head_ahead(rows: &[f32], width: usize, t: usize, at: usize, len: usize) {
    let start = (t + HEAD_AHEAD) * width + at;
    if let Some(head) = rows.get(start..start + len) {
        prefetch(head);
    }
}

/// One head's row `x` rotated by the angles `cos`, `sin` (`head_dim / 2` each) into `out`; with
/// `sin` negated, the rotation back.
///
/// Each layout's loop runs over zipped slices, with no index to check, so that the compiler turns
/// the halves' loop into vector code; what is left of its time is loading the projection's rows.
pub(crate) fn rotate(layout: RopeLayout, x: &[f32], cos: &[f32], sin: &[f32], out: &mut [f32]) {
    let turn = |(a, b): (f32, f32), (&c, &s): (&f32, &f32)| (a * c - b * s, a * s + b * c);
    let angles = cos.iter().zip(sin);
    match layout {
        RopeLayout::Halves => {
            let half = x.len() / 2;
            let (x1, x2) = x.split_at(half);
            let (out1, out2) = out.split_at_mut(half);
            let pairs = x1.iter().zip(x2).map(|(&a, &b)| (a, b));
            for (((o1, o2), pair), angle) in out1.iter_mut().zip(out2).zip(pairs).zip(angles) {
                (*o1, *o2) = turn(pair, angle);
            }
        }
        RopeLayout::Interleaved => {
            let pairs = x.as_chunks::<2>().0.iter().map(|&[a, b]| (a, b));
            for ((o, pair), angle) in out.as_chunks_mut::<2>().0.iter_mut().zip(pairs).zip(angles) {
                let (a, b) = turn(pair, angle);
                *o = [a, b];
            }
        }
    }
}

/// `scale · a · b` for `a: [.., m, k]`, `b: [.., k, n]` with the same leading (batch) dimensions.
/// On the CPU in f32 the batched kernel with its backward pass; elsewhere candle's matmul.
pub fn batched_matmul(a: &Tensor, b: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    let cpu_f32 = a.device().is_cpu() && a.dtype() == candle_core::DType::F32;
    if cpu_f32 && batch_stride(a.layout()).is_some() && batch_stride(b.layout()).is_some() {
        a.apply_op2(
            b,
            BatchedMatMul {
                scale: scale as f32,
            },
        )
    } else if scale == 1.0 {
        a.matmul(b)
    } else {
        a.matmul(b)? * scale
    }
}

/// The distance between consecutive matrices of `[.., rows, cols]` if the leading dimensions
/// nest without gaps (0 for a single matrix).
fn batch_stride(layout: &Layout) -> Option<usize> {
    let leading = layout.dims().len().checked_sub(2)?;
    nested_step(&layout.dims()[..leading], layout.stride()).map(|step| step.unwrap_or(0))
}

/// Multiply-adds below which a batch of products runs on the calling thread.
const SEQUENTIAL_MATMUL_LIMIT: usize = 1 << 20;

/// `scale · A · B` over a batch of matrices, with its backward pass.
struct BatchedMatMul {
    scale: f32,
}

impl CustomOp2 for BatchedMatMul {
    fn name(&self) -> &'static str {
        "fused-batched-matmul"
    }

    fn cpu_fwd(
        &self,
        a_storage: &CpuStorage,
        a_layout: &Layout,
        b_storage: &CpuStorage,
        b_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (a_dims, b_dims) = (a_layout.dims(), b_layout.dims());
        let rank = a_dims.len();
        if rank < 2 || b_dims.len() != rank || a_dims[..rank - 2] != b_dims[..rank - 2] {
            return Err(error("batched matmul needs [.., m, k] and [.., k, n]"));
        }
        let (m, k, n) = (a_dims[rank - 2], a_dims[rank - 1], b_dims[rank - 1]);
        if b_dims[rank - 2] != k {
            return Err(error("batched matmul: inner dimensions differ"));
        }
        let count: usize = a_dims[..rank - 2].iter().product();
        let strides = |layout: &Layout| -> candle_core::Result<(usize, (usize, usize))> {
            let s = layout.stride();
            let step = batch_stride(layout).ok_or_else(|| error("batch dimensions with gaps"))?;
            Ok((step, (s[rank - 2], s[rank - 1])))
        };
        let ((a_step, a_strides), (b_step, b_strides)) = (strides(a_layout)?, strides(b_layout)?);
        let a = &a_storage.as_slice::<f32>()?[a_layout.start_offset()..];
        let b = &b_storage.as_slice::<f32>()?[b_layout.start_offset()..];
        let operands = (0..count)
            .map(|i| {
                Ok((
                    Strided::matrix(a, i, a_step, (m, k), a_strides)?,
                    Strided::matrix(b, i, b_step, (k, n), b_strides)?,
                ))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut out = vec![0.0f32; count * m * n];
        let product = |i: usize, out: &mut [f32]| {
            let (a, b) = &operands[i];
            gemm_into(out, a, b, (m, k, n), self.scale, Split::Serial);
        };
        // A decode step's few one-row products take less time than handing them to the team.
        if m * n > 0 {
            if count * m * n * k < SEQUENTIAL_MATMUL_LIMIT {
                for (i, out) in out.chunks_mut(m * n).enumerate() {
                    product(i, out);
                }
            } else {
                crate::team::chunks_in_parallel(&mut out, m * n, product);
            }
        }
        let mut shape = a_dims.to_vec();
        shape[rank - 1] = n;
        Ok((CpuStorage::F32(out), Shape::from(shape)))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let op = BatchedMatMul { scale: self.scale };
        let d_a = grad.apply_op2_no_bwd(&b.t()?, &op)?;
        let d_b = a.t()?.apply_op2_no_bwd(&grad, &op)?;
        Ok((Some(d_a), Some(d_b)))
    }
}

/// `x[rows of group e] · w[e]ᵀ` for `x: [rows, k]` and `w: [groups, n, k]` (each group's weight
/// stored `[out, in]`, as a linear layer's), where the rows come sorted by group,
/// `group_sizes[e]` of them for group `e`: the experts of a mixture-of-experts block, each
/// applied to the rows routed to it, in one op instead of a slice, a product and a concatenation
/// per expert. On the CPU in f32 the grouped kernel with its backward pass, which writes each
/// expert's weight gradient into its own block of one `[groups, n, k]` tensor (instead of padding
/// one full-size gradient per expert), in the weight's own layout: a transposed view of the
/// weight would be a graph node of its own, whose gradient candle zeroes and then adds strided
/// into the weight's. Elsewhere the composed form.
pub fn grouped_linear(
    x: &Tensor,
    w: &Tensor,
    group_sizes: &[usize],
) -> candle_core::Result<Tensor> {
    let (rows, k) = x.dims2()?;
    let (groups, _, w_k) = w.dims3()?;
    if w_k != k {
        return Err(error("grouped matmul: inner dimensions differ"));
    }
    check_group_sizes(group_sizes, groups, rows)?;
    if x.device().is_cpu() && x.dtype() == candle_core::DType::F32 {
        return x.apply_op2(
            w,
            GroupedMatMul {
                sizes: group_sizes.into(),
                pass: GroupedPass::Linear,
            },
        );
    }
    grouped_linear_composed(x, w, group_sizes)
}

/// [`grouped_linear`] as one candle product per group: the path off the CPU, and the tests'
/// reference.
pub(crate) fn grouped_linear_composed(
    x: &Tensor,
    w: &Tensor,
    group_sizes: &[usize],
) -> candle_core::Result<Tensor> {
    let mut parts = Vec::new();
    let mut start = 0;
    for (e, &size) in group_sizes.iter().enumerate() {
        if size > 0 {
            parts.push(x.narrow(0, start, size)?.matmul(&w.get(e)?.t()?)?);
        }
        start += size;
    }
    if parts.is_empty() {
        Tensor::zeros((0, w.dim(1)?), x.dtype(), x.device())
    } else {
        Tensor::cat(&parts, 0)
    }
}

/// One size per group, summing to the rows.
fn check_group_sizes(sizes: &[usize], groups: usize, rows: usize) -> candle_core::Result<()> {
    if sizes.len() == groups && sizes.iter().sum::<usize>() == rows {
        Ok(())
    } else {
        Err(error(
            "grouped matmul: one size per group, summing to the rows",
        ))
    }
}

/// The products of a grouped product's weight gradient, `gₑᵀ · xₑ` for each group's rows of the
/// output's gradient `g: [rows, n]` and the input `x: [rows, k]`, and their `[groups, n, k]`
/// (a group that received no rows has an empty sum, zeros).
fn grouped_weight_grad_products<'a>(
    sizes: &[usize],
    (g_storage, g_layout): (&'a CpuStorage, &Layout),
    (x_storage, x_layout): (&'a CpuStorage, &Layout),
) -> candle_core::Result<(Vec<Product<'a>>, Shape)> {
    let (rows, n) = g_layout.shape().dims2()?;
    let (x_rows, k) = x_layout.shape().dims2()?;
    if x_rows != rows {
        return Err(error("grouped matmul: one gradient row per input row"));
    }
    check_group_sizes(sizes, sizes.len(), rows)?;
    let (g, g_strides) = strided_2d(g_storage, g_layout)?;
    let (x, x_strides) = strided_2d(x_storage, x_layout)?;
    let mut start = 0;
    let products = sizes
        .iter()
        .map(|&m| {
            let a = Strided::matrix(g, start, g_strides.0, (m, n), g_strides)?.t();
            let b = Strided::matrix(x, start, x_strides.0, (m, k), x_strides)?;
            start += m;
            Ok((a, b, (n, m, k)))
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok((products, Shape::from((sizes.len(), n, k))))
}

/// One matrix of a strided CPU operand: its values from the matrix's first element on, and
/// its row and column strides.
#[derive(Clone, Copy)]
struct Strided<'a> {
    values: &'a [f32],
    rs: isize,
    cs: isize,
}

impl<'a> Strided<'a> {
    /// Matrix `index` (of `step` elements apart) of `values`, `rows × cols` at strides
    /// `(rs, cs)`, checked to lie inside `values`.
    fn matrix(
        values: &'a [f32],
        index: usize,
        step: usize,
        (rows, cols): (usize, usize),
        (rs, cs): (usize, usize),
    ) -> candle_core::Result<Self> {
        let start = index * step;
        if rows * cols > 0 && start + (rows - 1) * rs + (cols - 1) * cs >= values.len() {
            return Err(error("layout outside its storage"));
        }
        Ok(Self {
            values: values.get(start..).unwrap_or(&[]),
            rs: rs as isize,
            cs: cs as isize,
        })
    }

    /// The rows from `start` on.
    fn rows_from(self, start: usize) -> Self {
        self.skip(start * self.rs as usize)
    }

    /// The columns from `start` on.
    fn columns_from(self, start: usize) -> Self {
        self.skip(start * self.cs as usize)
    }

    /// The same strides over the values from element `offset` on.
    fn skip(self, offset: usize) -> Self {
        Self {
            values: self.values.get(offset..).unwrap_or(&[]),
            ..self
        }
    }

    /// The transposed view of the same matrix.
    fn t(self) -> Self {
        Self {
            values: self.values,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

/// How a product is spread over the cores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    /// On the calling thread.
    Serial,
    /// In one contiguous block of the output per thread of candle's team, each block a
    /// single-threaded GEMM.
    Team,
}

/// `out = scale · a · b` for `a: m × k`, `b: k × n` into a row-major `out` of `m × n`.
fn gemm_into(
    out: &mut [f32],
    a: &Strided,
    b: &Strided,
    dims: (usize, usize, usize),
    scale: f32,
    split: Split,
) {
    gemm_update(out, a, b, dims, scale, false, split);
}

/// `out = scale · a · b`, or with `accumulate`, `out += scale · a · b`, for `a: m × k`,
/// `b: k × n` and a row-major `out` of `m × n`.
fn gemm_update(
    out: &mut [f32],
    a: &Strided,
    b: &Strided,
    (m, k, n): (usize, usize, usize),
    scale: f32,
    accumulate: bool,
    split: Split,
) {
    assert!(out.len() >= m * n, "gemm: output too short");
    // SAFETY: `out` holds the m × n values, and the borrow keeps everything else off them.
    unsafe { gemm_at(out.as_mut_ptr(), a, b, (m, k, n), scale, accumulate, split) };
}

/// A new row-major `m × n` buffer holding `scale · a · b`. gemm writes it without its being
/// zeroed first: zeroing the outputs of training's products was 1–2% of a step, all of it on
/// the calling thread.
fn gemm_new(
    a: &Strided,
    b: &Strided,
    (m, k, n): (usize, usize, usize),
    scale: f32,
    split: Split,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(m * n);
    // SAFETY: `out` has room for the m × n values; gemm without `accumulate` writes every one of
    // them (zeros when `k` is 0) and reads none it has not written, so all are initialised.
    unsafe {
        gemm_at(out.as_mut_ptr(), a, b, (m, k, n), scale, false, split);
        out.set_len(m * n);
    }
    out
}

/// Each `a · b` of `products` (`a: m × k`, `b: k × n`), their `m × n` results one after
/// another in one vector.
///
/// The products large enough for the team are cut as [`gemm_at`] cuts one, and all their
/// blocks go to the team in one call, first blocks first: one hand-off and one wait for the
/// whole stack instead of one per product (a mixture-of-experts block has one per expert),
/// and a thread that finishes its block early takes the next product's instead of waiting for
/// the other thread's.
fn gemm_stacked(products: &[Product]) -> Vec<f32> {
    let len = products.iter().map(|&(_, _, (m, _, n))| m * n).sum();
    let mut out = Vec::with_capacity(len);
    // SAFETY: `out` has room for the products' values; gemm without `accumulate` writes each
    // block in full (zeros when `k` is 0, an empty sum) and reads none of it before.
    unsafe {
        gemm_stacked_at(out.as_mut_ptr(), products, false);
        out.set_len(len);
    }
    out
}

/// [`gemm_stacked`], each product's `a · b` added to the values in `sums` (one after another,
/// as [`gemm_stacked`] lays them out).
fn gemm_stacked_update(sums: &mut [f32], products: &[Product]) {
    let len: usize = products.iter().map(|&(_, _, (m, _, n))| m * n).sum();
    assert_eq!(sums.len(), len, "gemm: sums of another size");
    // SAFETY: `sums` holds the products' initialised values, and the borrow keeps everything
    // else off them.
    unsafe { gemm_stacked_at(sums.as_mut_ptr(), products, true) };
}

/// One product of a stack: `a`, `b` and its `(m, k, n)`.
type Product<'a> = (Strided<'a>, Strided<'a>, (usize, usize, usize));

/// The products' `a · b` (added to what is there, with `accumulate`) into their `m × n` values
/// laid one after another from `dst`.
///
/// # Safety
/// `dst` must be valid for writes of the products' values, which nothing else reads or writes
/// meanwhile; with `accumulate`, they must be initialised.
unsafe fn gemm_stacked_at(dst: *mut f32, products: &[Product], accumulate: bool) {
    let parts = crate::team::threads();
    let mut cuts = Vec::with_capacity(products.len());
    let mut at = 0;
    for &(_, b, dims) in products {
        let (m, k, n) = dims;
        cuts.push((
            at,
            Cut::new(&b, dims, accumulate, split_for(m * k * n), parts),
        ));
        at += m * n;
    }
    let blocks: Vec<(usize, usize)> = (0..parts)
        .flat_map(|block| {
            cuts.iter()
                .enumerate()
                .filter(move |(_, (_, cut))| block < cut.blocks())
                .map(move |(product, _)| (product, block))
        })
        .collect();
    let dst = SharedOut(dst);
    // SAFETY: the products' `m × n` values tile the caller's values one after another, and each
    // product's blocks tile its values.
    unsafe {
        let run = |(product, block): (usize, usize)| {
            let (a, b, _) = &products[product];
            let (offset, cut) = &cuts[product];
            cut.run(block, dst.ptr().add(*offset), a, b, 1.0);
        };
        if blocks.len() <= 1 {
            blocks.into_iter().for_each(run);
        } else {
            crate::team::share_out(blocks.len(), |range| range.for_each(|i| run(blocks[i])));
        }
    }
}

/// How a product's `m × n` output is cut into blocks, one per thread of candle's team (see
/// [`gemm_at`]).
#[derive(Clone, Copy)]
struct Cut {
    /// The product's `(m, k, n)`.
    dims: (usize, usize, usize),
    /// Whether the product adds to the values already in its output.
    accumulate: bool,
    /// Rows (else columns) of the output per block.
    by_rows: bool,
    /// Each block written column-major and moved into place ([`packs_fewer_as_columns`]).
    as_columns: bool,
    /// Rows or columns per block; the whole product when it is not cut.
    block: usize,
    /// The side that is cut; 0 when the product is one block on one thread.
    side: usize,
}

impl Cut {
    fn new(
        b: &Strided,
        (m, k, n): (usize, usize, usize),
        accumulate: bool,
        split: Split,
        parts: usize,
    ) -> Self {
        let whole = |side| Self {
            dims: (m, k, n),
            accumulate,
            by_rows: true,
            as_columns: false,
            block: side,
            side,
        };
        if m * n == 0 {
            return whole(0);
        }
        if split == Split::Serial || parts == 1 || k == 0 {
            return whole(m);
        }
        let as_columns = !accumulate && packs_fewer_as_columns(b, (m, k, n));
        let by_rows = as_columns || m > n;
        let side = if by_rows { m } else { n };
        Self {
            dims: (m, k, n),
            accumulate,
            by_rows,
            as_columns,
            block: side.div_ceil(parts).next_multiple_of(16),
            side,
        }
    }

    fn blocks(&self) -> usize {
        if self.side == 0 {
            0
        } else {
            self.side.div_ceil(self.block)
        }
    }

    /// Block `index` of `scale · a · b` (or, with `accumulate`, its sum with the values there)
    /// into the product's `m × n` values at `dst`, rows `n` apart.
    ///
    /// # Safety
    /// As for [`gemm_at`], for the block's rows or columns of `dst`.
    unsafe fn run(&self, index: usize, dst: *mut f32, a: &Strided, b: &Strided, scale: f32) {
        let ((m, k, n), accumulate) = (self.dims, self.accumulate);
        let start = index * self.block;
        let len = self.block.min(self.side - start);
        // SAFETY: block `start..start + len` of rows (or columns) lies inside the m × n output,
        // and no other block writes to it; `a`'s rows and `b`'s columns from `start` exist
        // because `Strided::matrix` checked the whole operands.
        unsafe {
            if self.by_rows {
                let (a, dst) = (a.rows_from(start), dst.add(start * n));
                if self.as_columns {
                    gemm_block_as_columns(dst, n, &a, b, (len, k, n), scale);
                } else {
                    gemm_block(dst, (n, 1), &a, b, (len, k, n), scale, accumulate);
                }
            } else {
                let b = b.columns_from(start);
                gemm_block(
                    dst.add(start),
                    (n, 1),
                    a,
                    &b,
                    (m, k, len),
                    scale,
                    accumulate,
                );
            }
        }
    }
}

/// [`gemm_update`] into `m × n` values at `dst`, rows `n` apart.
///
/// [`Split::Team`] cuts the larger of the output's two sides into one block per thread of
/// candle's team, rounded to 16 rows or columns; a narrow output (see
/// [`packs_fewer_as_columns`]) is cut by rows, each block written column-major and moved into
/// place. gemm's own parallel mode (rayon) measured
/// slower on every shape we run: on an Intel Xeon (family 6 model 207, 2 threads) 101 against
/// 142 GFLOP/s for a 128-token prefill's `128 × 256 × 1024`, 192 against 221 for training's
/// `1016 × 256 × 1024`. Each output value's sum runs over `k` in the same order however the
/// output is cut, so the split changes no bits.
///
/// # Safety
/// `dst` must be valid for writes of `m × n` values, which nothing else reads or writes
/// meanwhile; with `accumulate`, they must be initialised.
unsafe fn gemm_at(
    dst: *mut f32,
    a: &Strided,
    b: &Strided,
    dims: (usize, usize, usize),
    scale: f32,
    accumulate: bool,
    split: Split,
) {
    let cut = Cut::new(b, dims, accumulate, split, crate::team::threads());
    let dst = SharedOut(dst);
    // SAFETY: the caller vouches for `dst`; the blocks tile it.
    unsafe {
        match cut.blocks() {
            0 => {}
            1 => cut.run(0, dst.ptr(), a, b, scale),
            blocks => crate::team::share_out(blocks, |range| {
                for index in range {
                    cut.run(index, dst.ptr(), a, b, scale);
                }
            }),
        }
    }
}

/// The output pointer, shared by the team's threads, each writing its own block.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: the threads that share it write disjoint blocks (see `gemm_at`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The pointer, through a method so that closures capture the whole `Sync` wrapper.
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// One single-threaded GEMM into `m × n` values at `dst`, element `(i, j)` at
/// `i * dst_rs + j * dst_cs`.
///
/// # Safety
/// `dst` must be valid for writes of every element `i * dst_rs + j * dst_cs` (`i < m`,
/// `j < n`), which nothing else reads or writes meanwhile; with `accumulate`, they must be
/// initialised.
unsafe fn gemm_block(
    dst: *mut f32,
    (dst_rs, dst_cs): (usize, usize),
    a: &Strided,
    b: &Strided,
    (m, k, n): (usize, usize, usize),
    scale: f32,
    accumulate: bool,
) {
    // SAFETY: `Strided::matrix` checked that every element the strides reach lies inside each
    // operand's values; the caller vouches for `dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_cs as isize,
            dst_rs as isize,
            accumulate,
            a.values.as_ptr(),
            a.cs,
            a.rs,
            b.values.as_ptr(),
            b.cs,
            b.rs,
            if accumulate { 1.0 } else { 0.0 },
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Whether a block `a · b` of `m` rows and `n` columns is cheaper written column-major and then
/// moved into place.
///
/// gemm turns a product with a row-major output around (`outᵀ = bᵀ · aᵀ`), because its
/// microkernel writes columns; `bᵀ` then becomes its left operand, which it copies into
/// panels on every call. For `x · wᵀ` that is the weight, `n × k`, and the copy is one scalar
/// load per value when the weight is row-major (`b`'s row stride 1): on an Intel Xeon (family
/// 6 model 207) 17% of a batch-1, 128-token prefill's samples went to it. Written column-major,
/// the output leaves the product the right way round, so gemm copies `a`, `m × k`, instead;
/// moving the block into place costs `m × n` more. Every value is the same sum over `k` in the
/// same order either way. Only the team's split takes this path: the serial products
/// (attention's) were not measured with it.
fn packs_fewer_as_columns(b: &Strided, (m, k, n): (usize, usize, usize)) -> bool {
    b.rs == 1 && b.cs != 1 && m * (k + n) < n * k
}

/// [`gemm_block`] (without accumulating) through a column-major `m × n` block, moved into rows
/// `dst_rs` apart at `dst` (see [`packs_fewer_as_columns`]).
///
/// # Safety
/// `dst` must be valid for writes of row `i`'s `n` values at `dst + i * dst_rs` (`i < m`),
/// which nothing else reads or writes meanwhile.
unsafe fn gemm_block_as_columns(
    dst: *mut f32,
    dst_rs: usize,
    a: &Strided,
    b: &Strided,
    (m, k, n): (usize, usize, usize),
    scale: f32,
) {
    let mut block = Vec::with_capacity(m * n);
    // SAFETY: `block` has room for the `m × n` values, column `j` at `j * m`, which gemm without
    // accumulating writes in full; the caller vouches for `dst`.
    unsafe {
        gemm_block(block.as_mut_ptr(), (1, m), a, b, (m, k, n), scale, false);
        block.set_len(m * n);
        transpose::columns_into_rows(&block, (m, n), dst, dst_rs);
    }
}

/// A product of `macs` multiply-adds split over the team when it is large enough to repay the
/// hand-off.
fn split_for(macs: usize) -> Split {
    if macs >= SEQUENTIAL_MATMUL_LIMIT {
        Split::Team
    } else {
        Split::Serial
    }
}

/// The `[rows, k]` operand of a grouped product as (values from its start, row and column
/// strides).
fn strided_2d<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
) -> candle_core::Result<(&'a [f32], (usize, usize))> {
    let &[rs, cs] = layout.stride() else {
        return Err(error("grouped matmul: a 2-d operand"));
    };
    Ok((
        &storage.as_slice::<f32>()?[layout.start_offset()..],
        (rs, cs),
    ))
}

/// The kernels of [`grouped_linear`]: its product, and (for the backward pass) its input and
/// weight gradients. The first operand's rows are the grouped ones in every pass.
struct GroupedMatMul {
    sizes: Arc<[usize]>,
    pass: GroupedPass,
}

enum GroupedPass {
    /// `x: [rows, k]`, `w: [groups, n, k]` → `xₑ · w[e]ᵀ` per group, `[rows, n]`.
    Linear,
    /// The output's gradient `g: [rows, n]`, `w: [groups, n, k]` → `gₑ · w[e]` per group,
    /// `[rows, k]`.
    InputGrad,
    /// The output's gradient `g: [rows, n]`, `x: [rows, k]` → `gₑᵀ · xₑ` per group,
    /// `[groups, n, k]` (zeros for a group that received no rows).
    WeightGrad,
}

impl CustomOp2 for GroupedMatMul {
    fn name(&self) -> &'static str {
        match self.pass {
            GroupedPass::Linear => "fused-grouped-linear",
            GroupedPass::InputGrad => "fused-grouped-linear-input-grad",
            GroupedPass::WeightGrad => "fused-grouped-linear-weight-grad",
        }
    }

    fn cpu_fwd(
        &self,
        lhs_storage: &CpuStorage,
        lhs_layout: &Layout,
        other_storage: &CpuStorage,
        other_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, lhs_cols) = lhs_layout.shape().dims2()?;
        let (lhs, lhs_strides) = strided_2d(lhs_storage, lhs_layout)?;
        let group_rows = |start: usize, m: usize| {
            Strided::matrix(lhs, start, lhs_strides.0, (m, lhs_cols), lhs_strides)
        };
        let mut start = 0;
        match self.pass {
            GroupedPass::Linear | GroupedPass::InputGrad => {
                let (groups, n, k) = other_layout.shape().dims3()?;
                let linear = matches!(self.pass, GroupedPass::Linear);
                let (inner, out_cols) = if linear { (k, n) } else { (n, k) };
                if lhs_cols != inner {
                    return Err(error("grouped matmul: inner dimensions differ"));
                }
                check_group_sizes(&self.sizes, groups, rows)?;
                let w = &other_storage.as_slice::<f32>()?[other_layout.start_offset()..];
                let &[w_step, w_rs, w_cs] = other_layout.stride() else {
                    return Err(error("grouped matmul: a 3-d weight"));
                };
                let products = self
                    .sizes
                    .iter()
                    .enumerate()
                    .map(|(e, &m)| {
                        let a = group_rows(start, m)?;
                        start += m;
                        let w_e = Strided::matrix(w, e, w_step, (n, k), (w_rs, w_cs))?;
                        let b = if linear { w_e.t() } else { w_e };
                        Ok((a, b, (m, inner, out_cols)))
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Ok((
                    CpuStorage::F32(gemm_stacked(&products)),
                    Shape::from((rows, out_cols)),
                ))
            }
            GroupedPass::WeightGrad => {
                let (products, shape) = grouped_weight_grad_products(
                    &self.sizes,
                    (lhs_storage, lhs_layout),
                    (other_storage, other_layout),
                )?;
                Ok((CpuStorage::F32(gemm_stacked(&products)), shape))
            }
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let pass = |pass| GroupedMatMul {
            sizes: self.sizes.clone(),
            pass,
        };
        let d_x = grad.apply_op2_no_bwd(w, &pass(GroupedPass::InputGrad))?;
        let d_w = grad.apply_op2_no_bwd(x, &pass(GroupedPass::WeightGrad))?;
        Ok((Some(d_x), Some(d_w)))
    }
}

/// Mean cross-entropy of `logits` (`[rows, vocab]`) against `labels` (one per row). On the CPU
/// in f32 the fused kernel with its backward pass; elsewhere candle's composed form.
pub fn cross_entropy(logits: &Tensor, labels: &[u32]) -> crate::Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    check_labels(rows, vocab, labels)?;
    if logits.device().is_cpu() && logits.dtype() == candle_core::DType::F32 {
        let op = CrossEntropyOp {
            labels: labels.into(),
        };
        Ok(row_readable(logits)?.apply_op1(op)?.mean_all()?)
    } else {
        let labels = Tensor::from_slice(labels, rows, logits.device())?;
        Ok(candle_nn::loss::cross_entropy(logits, &labels)?)
    }
}

/// One label per row, each inside the vocabulary.
fn check_labels(rows: usize, vocab: usize, labels: &[u32]) -> crate::Result<()> {
    if labels.len() != rows {
        return Err(crate::Error::InvalidInput(format!(
            "{} labels for {rows} rows of logits",
            labels.len()
        )));
    }
    if let Some(bad) = labels.iter().find(|&&l| l as usize >= vocab) {
        return Err(crate::Error::InvalidInput(format!(
            "label {bad} outside the vocabulary of {vocab}"
        )));
    }
    Ok(())
}

/// Per-row cross-entropy `logsumexp(x) - x[label]` of `[rows, vocab]` logits, with its backward
/// pass. Labels are checked against the vocabulary by [`cross_entropy`].
struct CrossEntropyOp {
    labels: Arc<[u32]>,
}

/// `(max, log(sum(exp(x - max))))` of one row: `logsumexp(x) = max + log_total`.
fn log_sum_exp_parts(row: &[f32]) -> (f32, f32) {
    let (max, total) = exp_from_max(&mut row.to_vec());
    (max, total.ln())
}

impl CustomOp1 for CrossEntropyOp {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = Rows::new(storage, layout)?;
        let losses = fill_rows_reading(x.count, 1, x.width, |i, out| {
            let row = x.row(i);
            let (max, log_total) = log_sum_exp_parts(row);
            // log_softmax(x)[label] = (x[label] - max) - log_total, as candle's composed form.
            out[0] = -((row[self.labels[i] as usize] - max) - log_total);
        });
        Ok((CpuStorage::F32(losses), Shape::from(x.count)))
    }

    fn bwd(&self, x: &Tensor, y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let op = CrossEntropyGrad {
            labels: self.labels.clone(),
        };
        x.apply_op3_no_bwd(y, &grad.contiguous()?, &op).map(Some)
    }
}

/// The logits' gradient of [`CrossEntropyOp`] from the logits, the forward pass's per-row losses
/// and their gradient: `(softmax(x) - onehot(label)) · g` per row.
struct CrossEntropyGrad {
    labels: Arc<[u32]>,
}

impl CustomOp3 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "fused-cross-entropy-grad"
    }

    fn cpu_fwd(
        &self,
        x_storage: &CpuStorage,
        x_layout: &Layout,
        loss_storage: &CpuStorage,
        loss_layout: &Layout,
        g_storage: &CpuStorage,
        g_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = Rows::new(x_storage, x_layout)?;
        let (loss, g) = (
            values(loss_storage, loss_layout)?,
            values(g_storage, g_layout)?,
        );
        if loss.len() != x.count || g.len() != x.count {
            return Err(error("one loss and one gradient per row"));
        }
        let out = fill_rows(x.count, x.width, |i, out| {
            let row = x.row(i);
            let label = self.labels[i] as usize;
            // The forward pass's loss is logsumexp(x) - x[label]: no second reduction per row.
            let log_sum_exp = loss[i] + row[label];
            for (out, &x) in out.iter_mut().zip(row) {
                *out = x - log_sum_exp;
            }
            exp::exp_in_place(out);
            out.iter_mut().for_each(|p| *p *= g[i]);
            out[label] -= g[i];
        });
        Ok((CpuStorage::F32(out), x_layout.shape().clone()))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::layers::rope_composed;
    use candle_core::{D, DType, Device, Var};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const EPS: f64 = 1e-6;

    /// `count` values drawn uniformly from `range`.
    fn uniform(rng: &mut StdRng, count: usize, range: std::ops::Range<f32>) -> Vec<f32> {
        (0..count)
            .map(|_| rng.random_range(range.clone()))
            .collect()
    }

    /// A row kernel's row arrives zeroed, on the calling thread (few rows) and on the team
    /// (many), even where the allocator hands back a block that held other values, and every
    /// row lands in its place: each kernel writes only its row's even columns.
    #[test]
    fn filled_rows_start_zeroed_and_land_in_place() {
        let width = 5;
        for count in [3, PARALLEL_MIN_VALUES] {
            drop(std::hint::black_box(vec![1.0f32; count * width]));
            let out = fill_rows(count, width, |i, row| {
                assert!(row.iter().all(|&v| v == 0.0), "row {i} was not zeroed");
                row.iter_mut().step_by(2).for_each(|v| *v = i as f32);
            });
            assert_eq!(out.len(), count * width);
            for (i, row) in out.chunks(width).enumerate() {
                let i = i as f32;
                assert_eq!(row, [i, 0.0, i, 0.0, i], "row {i}");
            }
        }
    }

    /// Cutting a product over the team, by rows (tall outputs, and narrow ones written
    /// column-major) or by columns (wide ones, including an accumulating product), gives the
    /// serial product's bits, and so does a block written column-major and moved into place.
    /// (On a one-core machine the team has no workers, and the split takes the serial path.)
    #[test]
    fn split_products_are_the_serial_ones() {
        let mut rng = StdRng::seed_from_u64(31);
        for (m, k, n, accumulate) in [
            (300, 64, 70, false),
            (40, 96, 530, false),
            (57, 200, 777, false),
            (17, 128, 1000, true),
        ] {
            let a = uniform(&mut rng, m * k, -1.0..1.0);
            // `b` stored as `n × k` and read transposed, as a projection's weight is.
            let b = uniform(&mut rng, n * k, -1.0..1.0);
            let start = uniform(&mut rng, m * n, -1.0..1.0);
            let a = Strided::matrix(&a, 0, 0, (m, k), (k, 1)).unwrap();
            let b = Strided::matrix(&b, 0, 0, (n, k), (k, 1)).unwrap().t();
            let product = |split| {
                let mut out = start.clone();
                gemm_update(&mut out, &a, &b, (m, k, n), 0.5, accumulate, split);
                out
            };
            let serial = product(Split::Serial);
            assert_eq!(product(Split::Team), serial, "{m} × {k} × {n}");
            assert_ne!(serial, start);
            if !accumulate {
                assert_eq!(
                    packs_fewer_as_columns(&b, (m, k, n)),
                    m < 100,
                    "{m} × {k} × {n}"
                );
                let mut out = start.clone();
                // SAFETY: `out` holds the m × n values.
                unsafe { gemm_block_as_columns(out.as_mut_ptr(), n, &a, &b, (m, k, n), 0.5) };
                assert_eq!(out, serial, "{m} × {k} × {n}, column-major");
            }
        }
    }

    /// A CPU tensor of `shape` drawn uniformly from `range`.
    pub(super) fn random(
        rng: &mut StdRng,
        shape: impl Into<Shape>,
        range: std::ops::Range<f32>,
    ) -> Tensor {
        let shape = shape.into();
        Tensor::from_vec(uniform(rng, shape.elem_count(), range), shape, &Device::Cpu).unwrap()
    }

    /// [`random`], as a variable to differentiate.
    pub(super) fn random_var(
        rng: &mut StdRng,
        shape: impl Into<Shape>,
        range: std::ops::Range<f32>,
    ) -> Var {
        Var::from_tensor(&random(rng, shape, range)).unwrap()
    }

    fn composed(x: &Tensor) -> Tensor {
        let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        x.broadcast_div(&(ms + EPS).unwrap().sqrt().unwrap())
            .unwrap()
    }

    pub(super) fn close(a: &Tensor, b: &Tensor, tolerance: f32) {
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            assert!(
                (a - b).abs() <= tolerance * (1.0 + b.abs()),
                "element {i}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn rms_norm_values_and_gradient_are_the_composed_ones() {
        let mut rng = StdRng::seed_from_u64(3);
        let (rows, width) = (37, 96);
        let x = random_var(&mut rng, (rows, width), -3.0..3.0);
        let weights = random(&mut rng, (rows, width), -1.0..1.0);
        let fused = x
            .as_tensor()
            .apply_op1(RmsNormOp { eps: EPS as f32 })
            .unwrap();
        let reference = composed(x.as_tensor());
        close(&fused, &reference, 1e-6);
        let grad = |y: &Tensor| grads_of(y, &weights, &[&x]).remove(0);
        close(&grad(&fused), &grad(&reference), 1e-5);
        assert_eq!(grad(&fused).dtype(), DType::F32);
        // candle's fused kernel (inference off the CPU), which sums the squares in one running
        // sum, on the rows it runs itself and on those it hands to rayon (above 32); widths
        // with and without a partial line of squares.
        for (rows, width) in [(5, 96), (70, 96), (3, 45), (2, 7)] {
            let unit = Tensor::ones(width, DType::F32, &Device::Cpu).unwrap();
            let x = random(&mut rng, (rows, width), -3.0..3.0);
            let ours = x.apply_op1(RmsNormOp { eps: EPS as f32 }).unwrap();
            let candles = candle_nn::ops::rms_norm(&x, &unit, EPS as f32).unwrap();
            close(&ours, &candles, 1e-6);
        }
    }

    /// Values bit for bit against the unscaled norm times a broadcast scale, and both gradients
    /// against candle's composed norm times the scale, over more rows than one partial sum of
    /// the scale's gradient holds.
    #[test]
    fn scaled_rms_norm_values_and_gradients_are_the_composed_ones() {
        let mut rng = StdRng::seed_from_u64(4);
        let (rows, width) = (2 * SCALE_GRAD_ROWS + 9, 48);
        let x = random_var(&mut rng, (rows, width), -3.0..3.0);
        let w = random_var(&mut rng, width, -2.0..2.0);
        let weights = random(&mut rng, (rows, width), -1.0..1.0);
        let fused = x
            .as_tensor()
            .apply_op2(w.as_tensor(), ScaledRmsNormOp { eps: EPS as f32 })
            .unwrap();
        let reference = x
            .as_tensor()
            .apply_op1(RmsNormOp { eps: EPS as f32 })
            .unwrap()
            .broadcast_mul(w.as_tensor())
            .unwrap();
        assert_eq!(
            fused.to_vec2::<f32>().unwrap(),
            reference.to_vec2::<f32>().unwrap()
        );
        // The gradients against candle's own ops throughout, which share no kernel with ours.
        let candles = composed(x.as_tensor())
            .broadcast_mul(w.as_tensor())
            .unwrap();
        let ours = grads_of(&fused, &weights, &[&x, &w]);
        let theirs = grads_of(&candles, &weights, &[&x, &w]);
        close(&ours[0], &theirs[0], 1e-5);
        close(&ours[1], &theirs[1], 1e-4);
        let wrong = random(&mut rng, width + 1, -1.0..1.0);
        assert!(
            x.as_tensor()
                .apply_op2(&wrong, ScaledRmsNormOp { eps: 1e-6 })
                .is_err()
        );
    }

    /// The inference gate: a narrowed (strided) input, against candle's sigmoid; a tracked input
    /// keeps candle's op and its gradient.
    #[test]
    fn sigmoid_values_are_candles() {
        let mut rng = StdRng::seed_from_u64(8);
        let both = random(&mut rng, (5, 3, 48), -30.0..30.0);
        let gate = both.narrow(D::Minus1, 16, 24).unwrap();
        let ours = sigmoid(&gate).unwrap();
        assert_eq!(ours.dims(), gate.dims());
        close(&ours, &candle_nn::ops::sigmoid(&gate).unwrap(), 1e-6);
        let x = random_var(&mut rng, (4, 9), -5.0..5.0);
        let y = sigmoid(x.as_tensor()).unwrap();
        let grad = y.sum_all().unwrap().backward().unwrap();
        assert!(grad.get(x.as_tensor()).is_some());
    }

    #[test]
    fn softmax_values_and_gradient_are_the_composed_ones() {
        let mut rng = StdRng::seed_from_u64(4);
        let (rows, width) = (29, 77);
        // Attention scores: large spreads, and masked positions at f32::MIN.
        let values: Vec<f32> = (0..rows * width)
            .map(|i| {
                if i % 11 == 0 {
                    f32::MIN
                } else {
                    rng.random_range(-20.0..20.0)
                }
            })
            .collect();
        let weights = random(&mut rng, (rows, width), -1.0..1.0);
        let x = Var::from_vec(values, (rows, width), &Device::Cpu).unwrap();
        let fused = x.as_tensor().apply_op1(SoftmaxOp).unwrap();
        let reference = candle_nn::ops::softmax(x.as_tensor(), D::Minus1).unwrap();
        close(&fused, &reference, 1e-6);
        let grad = |y: &Tensor| grads_of(y, &weights, &[&x]).remove(0);
        close(&grad(&fused), &grad(&reference), 1e-5);
    }

    /// The gradients of `sum(y · weights)` with respect to `inputs`: a loss that weighs every
    /// output differently, so every term of a gradient counts.
    pub(super) fn grads_of(y: &Tensor, weights: &Tensor, inputs: &[&Var]) -> Vec<Tensor> {
        let loss = (y * weights).unwrap().sum_all().unwrap();
        let store = loss.backward().unwrap();
        inputs
            .iter()
            .map(|v| store.get(v.as_tensor()).unwrap().clone())
            .collect()
    }

    #[test]
    fn swiglu_values_and_gradients_are_the_composed_ones() {
        let mut rng = StdRng::seed_from_u64(5);
        let (rows, width) = (23, 40);
        // Gate and up as halves of one projection, as the fused checkpoints store them.
        let both = random_var(&mut rng, (rows, 2 * width), -8.0..8.0);
        let gate = both.as_tensor().narrow(D::Minus1, 0, width).unwrap();
        let up = both.as_tensor().narrow(D::Minus1, width, width).unwrap();
        let weights = random(&mut rng, (rows, width), -1.0..1.0);
        let fused = swiglu(both.as_tensor()).unwrap();
        let reference = (gate.silu().unwrap() * &up).unwrap();
        close(&fused, &reference, 1e-6);
        close(
            &grads_of(&fused, &weights, &[&both])[0],
            &grads_of(&reference, &weights, &[&both])[0],
            1e-5,
        );
        // Rows read in place from a wider tensor (a narrow of the last dimension).
        let wider = random(&mut rng, (rows, 2 * width + 6), -8.0..8.0);
        let inner = wider.narrow(D::Minus1, 3, 2 * width).unwrap();
        assert!(!inner.is_contiguous());
        close(
            &swiglu(&inner).unwrap(),
            &swiglu(&inner.contiguous().unwrap()).unwrap(),
            0.0,
        );
        assert!(
            swiglu(&random(&mut rng, (2, 5), -1.0..1.0)).is_err(),
            "odd width"
        );
    }

    #[test]
    fn rope_values_and_gradient_are_the_composed_ones_in_both_layouts() {
        let mut rng = StdRng::seed_from_u64(6);
        let (b, h, s, d) = (2, 3, 5, 8);
        let angles: Vec<f32> = uniform(&mut rng, b * s * d / 2, -40.0..40.0);
        let cos = Tensor::from_vec(
            angles.iter().map(|a| a.cos()).collect(),
            (b, s, d / 2),
            &Device::Cpu,
        )
        .unwrap();
        let sin = Tensor::from_vec(
            angles.iter().map(|a| a.sin()).collect(),
            (b, s, d / 2),
            &Device::Cpu,
        )
        .unwrap();
        let weights = random(&mut rng, (b, h, s, d), -1.0..1.0);
        for layout in [RopeLayout::Halves, RopeLayout::Interleaved] {
            let x = random_var(&mut rng, (b, h, s, d), -3.0..3.0);
            let fused = x
                .as_tensor()
                .apply_op3(&cos, &sin, RopeOp { layout })
                .unwrap();
            let reference = rope_composed(x.as_tensor(), &cos, &sin, layout).unwrap();
            close(&fused, &reference, 1e-6);
            close(
                &grads_of(&fused, &weights, &[&x])[0],
                &grads_of(&reference, &weights, &[&x])[0],
                1e-5,
            );
            // candle's kernel (inference off the CPU) computes the same bits: the rotation's
            // arithmetic is the same two products and one sum, in the same order.
            let candle = match layout {
                RopeLayout::Halves => candle_nn::rotary_emb::rope(x.as_tensor(), &cos, &sin),
                RopeLayout::Interleaved => candle_nn::rotary_emb::rope_i(x.as_tensor(), &cos, &sin),
            };
            assert_eq!(
                fused.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                candle
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            );
        }
    }

    #[test]
    fn batched_matmul_values_and_gradients_are_candles() {
        let mut rng = StdRng::seed_from_u64(8);
        // Attention's shapes: scores = q · kᵀ (a transposed view) scaled, large enough for the
        // pool (2 × 4 × 64 × 64 × 32 multiply-adds); then one row, small enough for one thread.
        let (b, h, m, k) = (2, 4, 64, 32);
        assert!(b * h * m * m * k >= SEQUENTIAL_MATMUL_LIMIT);
        let q = random_var(&mut rng, (b, h, m, k), -2.0..2.0);
        let keys = random_var(&mut rng, (b, h, m, k), -2.0..2.0);
        let weights = random(&mut rng, (b, h, m, m), -1.0..1.0);
        let kt = keys.as_tensor().t().unwrap();
        assert!(!kt.is_contiguous());
        let fused = batched_matmul(q.as_tensor(), &kt, 0.125).unwrap();
        let reference = (q.as_tensor().matmul(&kt).unwrap() * 0.125).unwrap();
        assert_eq!(fused.dims(), &[b, h, m, m]);
        close(&fused, &reference, 1e-6);
        let ours = grads_of(&fused, &weights, &[&q, &keys]);
        let theirs = grads_of(&reference, &weights, &[&q, &keys]);
        close(&ours[0], &theirs[0], 1e-5);
        close(&ours[1], &theirs[1], 1e-5);

        // One matrix (no batch dimensions) and a single row, as a decode step has.
        let a = random(&mut rng, (1, k), -1.0..1.0);
        let c = random(&mut rng, (k, m), -1.0..1.0);
        close(
            &batched_matmul(&a, &c, 1.0).unwrap(),
            &a.matmul(&c).unwrap(),
            1e-6,
        );
    }

    #[test]
    fn batched_matmul_refuses_mismatched_shapes() {
        let a = Tensor::zeros((2, 3, 4), DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros((2, 5, 6), DType::F32, &Device::Cpu).unwrap();
        let err = batched_matmul(&a, &b, 1.0).unwrap_err().to_string();
        assert!(err.contains("inner dimensions differ"), "{err}");
        let b = Tensor::zeros((3, 4, 6), DType::F32, &Device::Cpu).unwrap();
        let err = batched_matmul(&a, &b, 1.0).unwrap_err().to_string();
        assert!(err.contains("[.., m, k] and [.., k, n]"), "{err}");
    }

    #[test]
    fn grouped_linear_values_and_gradients_are_one_product_per_group() {
        let mut rng = StdRng::seed_from_u64(9);
        // An expert with no rows, and groups large enough for the pool's GEMM.
        for (sizes, k, n) in [(vec![5, 0, 9, 3], 16, 12), (vec![300, 220], 64, 64)] {
            let rows: usize = sizes.iter().sum();
            // The weights as the checkpoints store them, [groups, n, k].
            let w = random_var(&mut rng, (sizes.len(), n, k), -1.0..1.0);
            let x = random_var(&mut rng, (rows, k), -2.0..2.0);
            let weights = random(&mut rng, (rows, n), -1.0..1.0);
            let fused = grouped_linear(x.as_tensor(), w.as_tensor(), &sizes).unwrap();
            let reference = grouped_linear_composed(x.as_tensor(), w.as_tensor(), &sizes).unwrap();
            assert_eq!(fused.dims(), &[rows, n]);
            close(&fused, &reference, 1e-5);
            let ours = grads_of(&fused, &weights, &[&x, &w]);
            let theirs = grads_of(&reference, &weights, &[&x, &w]);
            close(&ours[0], &theirs[0], 1e-5);
            close(&ours[1], &theirs[1], 1e-5);
        }
        const { assert!(300 * 64 * 64 >= SEQUENTIAL_MATMUL_LIMIT) };
    }

    #[test]
    fn grouped_linear_refuses_sizes_that_do_not_cover_the_rows() {
        let x = Tensor::zeros((6, 4), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::zeros((2, 3, 4), DType::F32, &Device::Cpu).unwrap();
        for sizes in [vec![2, 3], vec![6], vec![2, 2, 2]] {
            let err = grouped_linear(&x, &w, &sizes).unwrap_err().to_string();
            assert!(
                err.contains("one size per group, summing to the rows"),
                "{err}"
            );
        }
        let w = Tensor::zeros((2, 3, 5), DType::F32, &Device::Cpu).unwrap();
        let err = grouped_linear(&x, &w, &[3, 3]).unwrap_err().to_string();
        assert!(err.contains("inner dimensions differ"), "{err}");
    }

    #[test]
    fn cross_entropy_and_its_gradient_are_candles() {
        let mut rng = StdRng::seed_from_u64(7);
        let (rows, vocab) = (31, 301);
        let x = random_var(&mut rng, (rows, vocab), -30.0..30.0);
        let labels: Vec<u32> = (0..rows)
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        let fused = cross_entropy(x.as_tensor(), &labels).unwrap();
        let label_tensor = Tensor::from_slice(&labels, rows, &Device::Cpu).unwrap();
        let reference = candle_nn::loss::cross_entropy(x.as_tensor(), &label_tensor).unwrap();
        assert_eq!(fused.dims(), reference.dims());
        close(&fused, &reference, 1e-6);
        let grad = |loss: &Tensor| loss.backward().unwrap().get(x.as_tensor()).unwrap().clone();
        close(&grad(&fused), &grad(&reference), 1e-6);
    }

    #[test]
    fn cross_entropy_refuses_labels_outside_the_vocabulary() {
        let x = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
        let err = cross_entropy(&x, &[1, 5]).unwrap_err().to_string();
        assert!(err.contains("label 5 outside the vocabulary of 5"), "{err}");
        let err = cross_entropy(&x, &[1]).unwrap_err().to_string();
        assert!(err.contains("1 labels for 2 rows"), "{err}");
    }

    #[test]
    fn rows_are_read_in_place_only_where_they_lie_at_one_stride() {
        let x = Tensor::zeros((2, 3, 8), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(row_stride(x.layout()), Some(8));
        assert_eq!(row_stride(x.narrow(2, 4, 4).unwrap().layout()), Some(8));
        assert_eq!(row_stride(x.unsqueeze(1).unwrap().layout()), Some(8));
        // A transpose steps through rows, and a narrow of a middle dimension leaves gaps.
        assert_eq!(row_stride(x.transpose(1, 2).unwrap().layout()), None);
        assert_eq!(row_stride(x.narrow(1, 0, 2).unwrap().layout()), None);
        assert_eq!(row_stride(x.narrow(1, 0, 1).unwrap().layout()), Some(24));
    }
}
