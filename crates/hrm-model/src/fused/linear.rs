//! A bias-free linear projection `x · wᵀ` for training on the CPU, as one op with its backward
//! pass.
//!
//! `candle_nn::Linear` composes it from a reshape of `x`, a transpose of `w`, the product and a
//! reshape back: four graph nodes, three of them holding an activation-sized gradient that the
//! backward pass zeroes and adds into, and the weight's gradient arrives transposed, so that
//! adding it up takes a strided pass. [`LinearOp`] is one node: its backward pass computes
//! `dx = dy · w` and `dw = dyᵀ · x` with the GEMM, each in its operand's own layout.

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use super::weight_grads::into_sink_or_tensor;
use super::{
    Rows, Strided, cpu_storage, error, gemm_new, gemm_update, row_readable, split_for, values,
};

/// `y = x · wᵀ` for `x: [.., k]` (rows at one stride) and a contiguous `w: [n, k]`.
pub struct LinearOp;

/// `x` as `rows × k` (values from its first row, row stride) and `w`'s `(n, k)`, checked.
pub(super) fn operands<'a>(
    x_storage: &'a CpuStorage,
    x_layout: &Layout,
    w_layout: &Layout,
) -> candle_core::Result<(Rows<'a>, (usize, usize))> {
    let x = Rows::new(x_storage, x_layout)?;
    let (n, k) = w_layout.shape().dims2()?;
    if x.width != k {
        return Err(error("linear: input width differs from the weight's"));
    }
    Ok((x, (n, k)))
}

/// `x · wᵀ` of checked [`operands`], `x.count × n` values.
pub(super) fn product(
    x: &Rows,
    w: &[f32],
    (n, k): (usize, usize),
) -> candle_core::Result<Vec<f32>> {
    let xs = Strided::matrix(x.values, 0, 0, (x.count, k), (x.stride, 1))?;
    let wt = Strided::matrix(w, 0, 0, (n, k), (k, 1))?.t();
    Ok(gemm_new(
        &xs,
        &wt,
        (x.count, k, n),
        1.0,
        split_for(x.count * k * n),
    ))
}

/// `scale · g · w`, the gradient of `x · wᵀ` for `x`, from the output's gradient `g`
/// (`rows × n`).
pub(super) fn input_grad(
    g: &Strided,
    rows: usize,
    w: &[f32],
    (n, k): (usize, usize),
    scale: f32,
) -> candle_core::Result<Vec<f32>> {
    let ws = Strided::matrix(w, 0, 0, (n, k), (k, 1))?;
    Ok(gemm_new(
        g,
        &ws,
        (rows, n, k),
        scale,
        split_for(rows * n * k),
    ))
}

/// `scale · gᵀ · x`, the gradient of `x · wᵀ` for `w`: added into the installed
/// [`weight_grads`](super::weight_grads) sink when `w` is a variable (then `None`, no gradient
/// for candle to add), else a new tensor of `w`'s shape.
pub(super) fn weight_grad(
    g: &Strided,
    x: &Rows,
    w: &Tensor,
    (n, k): (usize, usize),
    scale: f32,
) -> candle_core::Result<Option<Tensor>> {
    let rows = x.count;
    let xs = Strided::matrix(x.values, 0, 0, (rows, k), (x.stride, 1))?;
    let (gt, dims, split) = (g.t(), (n, rows, k), split_for(rows * n * k));
    into_sink_or_tensor(
        w,
        || gemm_new(&gt, &xs, dims, scale, split),
        |sum| gemm_update(sum, &gt, &xs, dims, scale, true, split),
    )
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "fused-linear"
    }

    fn cpu_fwd(
        &self,
        x_storage: &CpuStorage,
        x_layout: &Layout,
        w_storage: &CpuStorage,
        w_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, (n, k)) = operands(x_storage, x_layout, w_layout)?;
        let out = product(&x, values(w_storage, w_layout)?, (n, k))?;
        let mut dims = x_layout.dims().to_vec();
        *dims.last_mut().expect("rows have a last dimension") = n;
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = row_readable(grad)?;
        let (x_guard, x_layout) = x.storage_and_layout();
        let (w_guard, w_layout) = w.storage_and_layout();
        let (g_guard, g_layout) = grad.storage_and_layout();
        let (x_rows, (n, k)) = operands(cpu_storage(&x_guard)?, x_layout, w_layout)?;
        let w_values = values(cpu_storage(&w_guard)?, w_layout)?;
        let g = Rows::new(cpu_storage(&g_guard)?, g_layout)?;
        if g.width != n || g.count != x_rows.count {
            return Err(error("linear: gradient of the wrong shape"));
        }
        let gs = Strided::matrix(g.values, 0, 0, (g.count, n), (g.stride, 1))?;
        let d_x = input_grad(&gs, x_rows.count, w_values, (n, k), 1.0)?;
        let d_x = Tensor::from_vec(d_x, x.shape(), x.device())?;
        Ok((Some(d_x), weight_grad(&gs, &x_rows, w, (n, k), 1.0)?))
    }
}

/// `x · wᵀ` with a gradient for both: on the CPU in f32 `LinearOp`, elsewhere candle's
/// `Linear`.
pub fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == candle_core::DType::F32 && w.dtype() == x.dtype() {
        row_readable(x)?.apply_op2(&w.contiguous()?, LinearOp)
    } else {
        use candle_core::Module;
        candle_nn::Linear::new(w.clone(), None).forward(x)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::D;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::super::tests::{close, grads_of, random, random_var};
    use super::*;

    /// Values and both gradients against `candle_nn::Linear`, for an input read in place from a
    /// wider tensor and for one large enough to run on the pool.
    #[test]
    fn values_and_gradients_are_candles() {
        let mut rng = StdRng::seed_from_u64(21);
        for (rows, k, n, pad) in [(2 * 7, 24, 40, 3), (300, 128, 96, 0)] {
            let wide = random_var(&mut rng, (2, rows / 2, k + pad), -2.0..2.0);
            let x = wide.as_tensor().narrow(D::Minus1, pad, k).unwrap();
            let w = random_var(&mut rng, (n, k), -1.0..1.0);
            use candle_core::Module;
            let reference = candle_nn::Linear::new(w.as_tensor().clone(), None)
                .forward(&x)
                .unwrap();
            let fused = linear(&x, w.as_tensor()).unwrap();
            assert_eq!(fused.dims(), &[2, rows / 2, n]);
            close(&fused, &reference, 1e-5);
            let weights = random(&mut rng, (2, rows / 2, n), -1.0..1.0);
            let ours = grads_of(&fused, &weights, &[&wide, &w]);
            let theirs = grads_of(&reference, &weights, &[&wide, &w]);
            for (a, b) in ours.iter().zip(&theirs) {
                close(a, b, 1e-4);
            }
        }
        let x = random(&mut rng, (3, 5), -1.0..1.0);
        let w = random(&mut rng, (4, 6), -1.0..1.0);
        assert!(linear(&x, &w).is_err(), "widths differ");
    }
}
