//! A SwiGLU MLP `down(silu(x · W_gᵀ) · (x · W_uᵀ))` for training on the CPU, as one op with its
//! backward pass: dense, or a mixture-of-experts block's experts over the rows routed to each.
//!
//! Composed of a product, [`super::swiglu`] and a product again, the block is three graph nodes,
//! and candle's backward pass gives each node's input a zeroed gradient buffer and adds the
//! node's contribution into it: a `[rows, 2 · intermediate]` and a `[rows, intermediate]` buffer
//! zeroed and added per block, the widest activations of a layer (zeroing and adding such
//! buffers was 7–8% of a `sample` training step's samples on an Intel Xeon with AVX-512).
//! [`SwiGluMlpOp`] is one node: its backward pass runs the same kernels in the same order
//! (`dW_d = gᵀ · s`, `ds = g · W_d`, the SwiGLU gradient, `dW_gu = dguᵀ · x`, `dx = dgu · W_gu`),
//! from the gate/up projection and the gated activations its forward pass keeps, as the graph
//! kept them before. The MoE block runs the grouped form in inference too: the same kernels as
//! the three ops, and an untracked op (with what it keeps) is dropped as soon as its output
//! exists.
//!
//! Invariant: an op's kept activations belong to its one forward pass; its backward pass takes
//! them, and a second backward pass without a new forward pass is an error.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};

use super::linear::{input_grad, operands, product, weight_grad};
use super::weight_grads::into_sink_or_tensor;
use super::{
    GroupedMatMul, GroupedPass, Rows, Strided, cpu_storage, error, gemm_stacked,
    gemm_stacked_update, grouped_weight_grad_products, row_readable, swiglu_grad_rows, swiglu_rows,
    values,
};

/// How the block's two products are taken.
#[derive(Clone)]
enum Products {
    /// One weight `[n, k]` for every row ([`super::linear`]'s kernels).
    Dense,
    /// One weight per expert, `[experts, n, k]`, over the rows grouped by expert, this many
    /// rows each ([`super::grouped_linear`]'s kernels).
    Grouped(Arc<[usize]>),
}

/// A buffer of `rows × width` values as an operand.
fn operand(values: Vec<f32>, width: usize) -> (CpuStorage, Layout) {
    let rows = values.len().checked_div(width).unwrap_or(0);
    (CpuStorage::F32(values), Layout::contiguous((rows, width)))
}

fn into_values(storage: CpuStorage) -> candle_core::Result<Vec<f32>> {
    match storage {
        CpuStorage::F32(values) => Ok(values),
        _ => Err(error("f32 only")),
    }
}

impl Products {
    /// `x · wᵀ` (per expert when grouped), `rows × n` values.
    fn forward(
        &self,
        (x, x_layout): (&CpuStorage, &Layout),
        (w, w_layout): (&CpuStorage, &Layout),
    ) -> candle_core::Result<Vec<f32>> {
        match self {
            Self::Dense => {
                let (x, dims) = operands(x, x_layout, w_layout)?;
                product(&x, values(w, w_layout)?, dims)
            }
            Self::Grouped(sizes) => {
                let op = GroupedMatMul {
                    sizes: sizes.clone(),
                    pass: GroupedPass::Linear,
                };
                into_values(op.cpu_fwd(x, x_layout, w, w_layout)?.0)
            }
        }
    }

    /// The gradients of [`Self::forward`] for `x` and for `w` (the tensor `weight`, whose
    /// storage is `w`) from the output's gradient `g`; `w`'s is `None` when it was added into
    /// the installed [`weight_grads`](super::weight_grads) sink.
    fn grads(
        &self,
        (g, g_layout): (&CpuStorage, &Layout),
        (x, x_layout): (&CpuStorage, &Layout),
        (w, w_layout): (&CpuStorage, &Layout),
        weight: &Tensor,
    ) -> candle_core::Result<(Vec<f32>, Option<Tensor>)> {
        match self {
            Self::Dense => {
                let (x, (n, k)) = operands(x, x_layout, w_layout)?;
                let g = Rows::new(g, g_layout)?;
                if g.width != n || g.count != x.count {
                    return Err(error("swiglu mlp: gradient of the wrong shape"));
                }
                let gs = Strided::matrix(g.values, 0, 0, (g.count, n), (g.stride, 1))?;
                let d_x = input_grad(&gs, x.count, values(w, w_layout)?, (n, k), 1.0)?;
                Ok((d_x, weight_grad(&gs, &x, weight, (n, k), 1.0)?))
            }
            Self::Grouped(sizes) => {
                let pass = |pass| GroupedMatMul {
                    sizes: sizes.clone(),
                    pass,
                };
                let input = pass(GroupedPass::InputGrad).cpu_fwd(g, g_layout, w, w_layout)?;
                let (products, _) =
                    grouped_weight_grad_products(sizes, (g, g_layout), (x, x_layout))?;
                let d_w = into_sink_or_tensor(
                    weight,
                    || gemm_stacked(&products),
                    |sum| gemm_stacked_update(sum, &products),
                )?;
                Ok((into_values(input.0)?, d_w))
            }
        }
    }
}

/// The activations the backward pass reads: the gate/up projection (`rows × 2 · inter`) and
/// the gated product (`rows × inter`).
struct Kept {
    gate_up: Vec<f32>,
    gated: Vec<f32>,
}

/// `down(swiglu(x · w_gate_upᵀ))` for `x: [.., hidden]` (rows at one stride; 2-d when grouped),
/// a contiguous `w_gate_up` holding `[gate; up]` (`[2 · inter, hidden]`, or one such per expert)
/// and `w_down` (`[hidden_out, inter]`, or one per expert).
pub struct SwiGluMlpOp {
    products: Products,
    kept: Mutex<Option<Kept>>,
}

/// The `(2 · inter, inter, out)` of the two weights' last two dimensions, checked.
fn widths(gate_up: &Layout, down: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    let last_two = |l: &Layout| match l.dims() {
        [.., a, b] => Ok((*a, *b)),
        _ => Err(error("swiglu mlp: weights of at least two dimensions")),
    };
    let ((both, _), (out, inter)) = (last_two(gate_up)?, last_two(down)?);
    if both != 2 * inter {
        return Err(error(
            "swiglu mlp: gate/up rows are not twice the down columns",
        ));
    }
    Ok((both, inter, out))
}

impl CustomOp3 for SwiGluMlpOp {
    fn name(&self) -> &'static str {
        "fused-swiglu-mlp"
    }

    fn cpu_fwd(
        &self,
        x_storage: &CpuStorage,
        x_layout: &Layout,
        gate_up_storage: &CpuStorage,
        gate_up_layout: &Layout,
        down_storage: &CpuStorage,
        down_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (both, inter, out) = widths(gate_up_layout, down_layout)?;
        let gate_up = self
            .products
            .forward((x_storage, x_layout), (gate_up_storage, gate_up_layout))?;
        let gated = swiglu_rows(&Rows::dense(&gate_up, both));
        let (gated_storage, gated_layout) = operand(gated, inter);
        let y = self
            .products
            .forward((&gated_storage, &gated_layout), (down_storage, down_layout))?;
        let gated = into_values(gated_storage)?;
        *self.kept.lock().expect("mlp state") = Some(Kept { gate_up, gated });
        let mut dims = x_layout.dims().to_vec();
        *dims.last_mut().expect("rows have a last dimension") = out;
        Ok((CpuStorage::F32(y), Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gate_up_w: &Tensor,
        down_w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Kept { gate_up, gated } = self
            .kept
            .lock()
            .expect("mlp state")
            .take()
            .ok_or_else(|| error("swiglu mlp: a backward pass without its forward pass"))?;
        let grad = row_readable(grad)?;
        let (x_guard, x_layout) = x.storage_and_layout();
        let (gu_guard, gu_layout) = gate_up_w.storage_and_layout();
        let (down_guard, down_layout) = down_w.storage_and_layout();
        let (g_guard, g_layout) = grad.storage_and_layout();
        let (both, inter, _) = widths(gu_layout, down_layout)?;
        let down = (cpu_storage(&down_guard)?, down_layout);
        let (gated, gated_layout) = operand(gated, inter);
        let g = (cpu_storage(&g_guard)?, g_layout);
        let (d_gated, d_down) = self
            .products
            .grads(g, (&gated, &gated_layout), down, down_w)?;
        if d_gated.len() * 2 != gate_up.len() {
            return Err(error("swiglu mlp: gradient of the wrong shape"));
        }
        let d_gate_up =
            swiglu_grad_rows(&Rows::dense(&gate_up, both), &Rows::dense(&d_gated, inter));
        let (d_gate_up, d_layout) = operand(d_gate_up, both);
        let x_operand = (cpu_storage(&x_guard)?, x_layout);
        let gate_up = (cpu_storage(&gu_guard)?, gu_layout);
        let (d_x, d_gate_up_w) =
            self.products
                .grads((&d_gate_up, &d_layout), x_operand, gate_up, gate_up_w)?;
        Ok((
            Some(Tensor::from_vec(d_x, x.shape(), x.device())?),
            d_gate_up_w,
            d_down,
        ))
    }
}

fn is_cpu_f32(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == candle_core::DType::F32
}

fn apply(
    x: &Tensor,
    w_gate_up: &Tensor,
    w_down: &Tensor,
    products: Products,
) -> candle_core::Result<Tensor> {
    let op = SwiGluMlpOp {
        products,
        kept: Mutex::new(None),
    };
    x.apply_op3(&w_gate_up.contiguous()?, &w_down.contiguous()?, op)
}

/// `down(silu(gate) · up)` of `x`, where `x · w_gate_upᵀ` gives `[gate | up]`: one op with its
/// backward pass on the CPU in f32, composed elsewhere.
pub fn swiglu_mlp(x: &Tensor, w_gate_up: &Tensor, w_down: &Tensor) -> candle_core::Result<Tensor> {
    if [x, w_gate_up, w_down].into_iter().all(is_cpu_f32) {
        apply(&row_readable(x)?, w_gate_up, w_down, Products::Dense)
    } else {
        let gated = super::swiglu(&super::linear(x, w_gate_up)?)?;
        super::linear(&gated, w_down)
    }
}

/// [`swiglu_mlp`] per expert: `x: [rows, hidden]` holds the rows routed to each expert, grouped
/// by expert (`group_sizes` of them each), `w_gate_up: [experts, 2 · inter, hidden]` and
/// `w_down: [experts, out, inter]`.
pub fn grouped_swiglu_mlp(
    x: &Tensor,
    w_gate_up: &Tensor,
    w_down: &Tensor,
    group_sizes: &[usize],
) -> candle_core::Result<Tensor> {
    if [x, w_gate_up, w_down].into_iter().all(is_cpu_f32) {
        apply(x, w_gate_up, w_down, Products::Grouped(group_sizes.into()))
    } else {
        let gate_up = super::grouped_linear(x, w_gate_up, group_sizes)?;
        super::grouped_linear(&super::swiglu(&gate_up)?, w_down, group_sizes)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::D;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use candle_core::Var;

    use super::super::tests::{close, grads_of, random, random_var};
    use super::*;

    /// The fused block's values within 1e-5 of the composed block's, and the gradients of a
    /// random weighting of them for `inputs` within 1e-4.
    fn agrees_with(fused: &Tensor, composed: &Tensor, inputs: &[&Var], rng: &mut StdRng) {
        close(fused, composed, 1e-5);
        let weights = random(rng, fused.shape(), -1.0..1.0);
        let ours = grads_of(fused, &weights, inputs);
        let theirs = grads_of(composed, &weights, inputs);
        for (a, b) in ours.iter().zip(&theirs) {
            close(a, b, 1e-4);
        }
    }

    /// Values and all three gradients against the composed linear, SwiGLU and linear, for an
    /// input read in place from a wider tensor and for one large enough for the thread team.
    #[test]
    fn values_and_gradients_are_the_composed_blocks() {
        let mut rng = StdRng::seed_from_u64(31);
        for (rows, hidden, inter, pad) in [(2 * 7, 24, 20, 3), (2 * 150, 128, 96, 0)] {
            let wide = random_var(&mut rng, (2, rows / 2, hidden + pad), -2.0..2.0);
            let x = wide.as_tensor().narrow(D::Minus1, pad, hidden).unwrap();
            let gate_up = random_var(&mut rng, (2 * inter, hidden), -0.5..0.5);
            let down = random_var(&mut rng, (hidden, inter), -0.5..0.5);
            let (gu, dw) = (gate_up.as_tensor(), down.as_tensor());
            let composed = super::super::linear(
                &super::super::swiglu(&super::super::linear(&x, gu).unwrap()).unwrap(),
                dw,
            )
            .unwrap();
            let fused = swiglu_mlp(&x, gu, dw).unwrap();
            assert_eq!(fused.dims(), &[2, rows / 2, hidden]);
            agrees_with(&fused, &composed, &[&wide, &gate_up, &down], &mut rng);
        }
    }

    /// Per expert, against the composed per-expert products and SwiGLU (one product per
    /// expert): values and the three gradients, with an expert that receives no rows.
    #[test]
    fn grouped_values_and_gradients_are_the_composed_experts() {
        let mut rng = StdRng::seed_from_u64(33);
        for (sizes, hidden, inter) in [(vec![5, 0, 9, 2], 24, 20), (vec![120, 200], 96, 64)] {
            let rows: usize = sizes.iter().sum();
            let x = random_var(&mut rng, (rows, hidden), -2.0..2.0);
            let gate_up = random_var(&mut rng, (sizes.len(), 2 * inter, hidden), -0.5..0.5);
            let down = random_var(&mut rng, (sizes.len(), hidden, inter), -0.5..0.5);
            let (xt, gu, dw) = (x.as_tensor(), gate_up.as_tensor(), down.as_tensor());
            let composed = super::super::grouped_linear_composed(
                &super::super::swiglu(
                    &super::super::grouped_linear_composed(xt, gu, &sizes).unwrap(),
                )
                .unwrap(),
                dw,
                &sizes,
            )
            .unwrap();
            let fused = grouped_swiglu_mlp(xt, gu, dw, &sizes).unwrap();
            assert_eq!(fused.dims(), &[rows, hidden]);
            agrees_with(&fused, &composed, &[&x, &gate_up, &down], &mut rng);
        }
    }

    /// Mismatched weights are refused, and a second backward pass over one forward pass's
    /// state finds none left.
    #[test]
    fn wrong_shapes_and_a_second_backward_pass_are_errors() {
        let mut rng = StdRng::seed_from_u64(32);
        let x = random(&mut rng, (3, 8), -1.0..1.0);
        let down = random(&mut rng, (8, 5), -1.0..1.0);
        assert!(swiglu_mlp(&x, &random(&mut rng, (12, 8), -1.0..1.0), &down).is_err());
        assert!(swiglu_mlp(&x, &random(&mut rng, (10, 7), -1.0..1.0), &down).is_err());
        let gate_up = random_var(&mut rng, (10, 8), -1.0..1.0);
        let y = swiglu_mlp(&x, gate_up.as_tensor(), &down).unwrap();
        let loss = y.sum_all().unwrap();
        assert!(loss.backward().is_ok());
        assert!(loss.backward().is_err(), "the kept activations were taken");
    }
}
