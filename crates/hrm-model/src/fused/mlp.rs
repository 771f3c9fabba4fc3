//! A SwiGLU MLP `down(silu(x · W_gᵀ) · (x · W_uᵀ))` for training on the CPU, as one op with its
//! backward pass.
//!
//! Composed of [`super::linear`], [`super::swiglu`] and `linear` again, the block is three graph
//! nodes, and candle's backward pass gives each node's input a zeroed gradient buffer and adds
//! the node's contribution into it: a `[rows, 2 · intermediate]` and a `[rows, intermediate]`
//! buffer zeroed and added per block, the widest activations of a layer (zeroing and adding
//! such buffers was 7–8% of a training step's samples). [`SwiGluMlpOp`] is one node: its
//! backward pass runs the same kernels in the same order (`dW_d = gᵀ · s`, `ds = g · W_d`, the
//! SwiGLU gradient, `dW_gu = dguᵀ · x`, `dx = dgu · W_gu`), from the gate/up projection and the
//! gated activations its forward pass keeps, as the graph kept them before.
//!
//! Invariant: an op's kept activations belong to its one forward pass; its backward pass takes
//! them, and a second backward pass without a new forward pass is an error.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use super::linear::{operands, product, product_grads};
use super::{
    Rows, Strided, cpu_storage, error, row_readable, swiglu_grad_rows, swiglu_rows, values,
};

/// The activations the backward pass reads: the gate/up projection (`rows × 2 · inter`) and
/// the gated product (`rows × inter`).
struct Kept {
    gate_up: Vec<f32>,
    gated: Vec<f32>,
}

/// `down(swiglu(x · w_gate_upᵀ))` for `x: [.., hidden]` (rows at one stride), a contiguous
/// `w_gate_up: [2 · inter, hidden]` holding `[gate; up]` and `w_down: [hidden_out, inter]`.
#[derive(Default)]
pub struct SwiGluMlpOp {
    kept: Mutex<Option<Kept>>,
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
        let (x, (both, hidden)) = operands(x_storage, x_layout, gate_up_layout)?;
        let (out, inter) = down_layout.shape().dims2()?;
        if both != 2 * inter {
            return Err(error(
                "swiglu mlp: gate/up rows are not twice the down columns",
            ));
        }
        let gate_up = product(&x, values(gate_up_storage, gate_up_layout)?, (both, hidden))?;
        let gated = swiglu_rows(&Rows::dense(&gate_up, both));
        let y = product(
            &Rows::dense(&gated, inter),
            values(down_storage, down_layout)?,
            (out, inter),
        )?;
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
        let (x_rows, (both, hidden)) = operands(cpu_storage(&x_guard)?, x_layout, gu_layout)?;
        let (out, inter) = down_layout.shape().dims2()?;
        let g = Rows::new(cpu_storage(&g_guard)?, g_layout)?;
        if g.width != out || g.count != x_rows.count || gated.len() != g.count * inter {
            return Err(error("swiglu mlp: gradient of the wrong shape"));
        }
        let gs = Strided::matrix(g.values, 0, 0, (g.count, out), (g.stride, 1))?;
        let down_values = values(cpu_storage(&down_guard)?, down_layout)?;
        let (d_gated, d_down) = product_grads(
            &gs,
            &Rows::dense(&gated, inter),
            down_values,
            (out, inter),
            1.0,
        )?;
        let d_gate_up =
            swiglu_grad_rows(&Rows::dense(&gate_up, both), &Rows::dense(&d_gated, inter));
        let dgs = Strided::matrix(&d_gate_up, 0, 0, (g.count, both), (both, 1))?;
        let gu_values = values(cpu_storage(&gu_guard)?, gu_layout)?;
        let (d_x, d_gate_up_w) = product_grads(&dgs, &x_rows, gu_values, (both, hidden), 1.0)?;
        Ok((
            Some(Tensor::from_vec(d_x, x.shape(), x.device())?),
            Some(Tensor::from_vec(d_gate_up_w, (both, hidden), x.device())?),
            Some(Tensor::from_vec(d_down, (out, inter), x.device())?),
        ))
    }
}

/// `down(silu(gate) · up)` of `x`, where `x · w_gate_upᵀ` gives `[gate | up]`: one op with its
/// backward pass on the CPU in f32, composed elsewhere.
pub fn swiglu_mlp(x: &Tensor, w_gate_up: &Tensor, w_down: &Tensor) -> candle_core::Result<Tensor> {
    let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == candle_core::DType::F32;
    if f32_cpu(x) && f32_cpu(w_gate_up) && f32_cpu(w_down) {
        row_readable(x)?.apply_op3(
            &w_gate_up.contiguous()?,
            &w_down.contiguous()?,
            SwiGluMlpOp::default(),
        )
    } else {
        let gated = super::swiglu(&super::linear(x, w_gate_up)?)?;
        super::linear(&gated, w_down)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::D;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::super::tests::{close, grads_of, random, random_var};
    use super::*;

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
            close(&fused, &composed, 1e-5);
            let weights = random(&mut rng, (2, rows / 2, hidden), -1.0..1.0);
            let ours = grads_of(&fused, &weights, &[&wide, &gate_up, &down]);
            let theirs = grads_of(&composed, &weights, &[&wide, &gate_up, &down]);
            for (a, b) in ours.iter().zip(&theirs) {
                close(a, b, 1e-4);
            }
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
