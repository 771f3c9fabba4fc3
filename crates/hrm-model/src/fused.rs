//! Fused CPU kernels with their backward passes, for training: candle's own fused kernels have
//! no backward pass, so without these a tracked forward composes many element-wise tensor ops,
//! each a pass over memory and an allocation.
//!
//! - [`RmsNormOp`]: `x / sqrt(mean(x²) + eps)` over the last dimension, one pass forward and
//!   one pass backward (`dx = r (g - y · mean(g y))`, `r = 1 / sqrt(mean(x²) + eps)`).
//! - [`SoftmaxOp`]: softmax over the last dimension (attention's), one pass forward and one pass
//!   backward from the output (`dx = y (g - sum(g y))`).
//!
//! Each runs on contiguous f32 CPU tensors only; callers use the composed form elsewhere. Rows
//! are spread over rayon's pool. Tests hold each to the composed form's values and gradients.
//! The slice helpers here also serve the fused AdamW step (`train::optim`).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

/// Root-mean-square normalisation without a scale, with its backward pass.
pub struct RmsNormOp {
    pub eps: f32,
}

/// The contiguous f32 values of a CPU storage.
pub(crate) fn values<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a [f32]> {
    let (start, end) = contiguous(layout)?;
    Ok(&storage.as_slice::<f32>()?[start..end])
}

pub(crate) fn values_mut<'a>(
    storage: &'a mut CpuStorage,
    layout: &Layout,
) -> candle_core::Result<&'a mut [f32]> {
    let (start, end) = contiguous(layout)?;
    match storage {
        CpuStorage::F32(values) => Ok(&mut values[start..end]),
        _ => Err(candle_core::Error::Msg("fused kernels need f32".into())),
    }
}

fn contiguous(layout: &Layout) -> candle_core::Result<(usize, usize)> {
    layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fused kernels need contiguous tensors".into()))
}

/// `row(out, x)` over every row (last dimension) of `x`, spread over rayon's pool: a new tensor
/// of `x`'s shape.
fn map_rows(
    storage: &CpuStorage,
    layout: &Layout,
    row: impl Fn(&mut [f32], &[f32]) + Sync,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let x = values(storage, layout)?;
    let width = layout.dims().last().copied().unwrap_or(1).max(1);
    let mut out = vec![0.0f32; x.len()];
    out.par_chunks_mut(width)
        .zip(x.par_chunks(width))
        .for_each(|(out, x)| row(out, x));
    Ok((CpuStorage::F32(out), layout.shape().clone()))
}

/// `row(out, a, b)` over matching rows of `a` and `b` (of one shape), like [`map_rows`].
fn map_row_pairs(
    (a_storage, a_layout): (&CpuStorage, &Layout),
    (b_storage, b_layout): (&CpuStorage, &Layout),
    row: impl Fn(&mut [f32], &[f32], &[f32]) + Sync,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let (a, b) = (values(a_storage, a_layout)?, values(b_storage, b_layout)?);
    let width = a_layout.dims().last().copied().unwrap_or(1).max(1);
    let mut out = vec![0.0f32; a.len()];
    out.par_chunks_mut(width)
        .zip(a.par_chunks(width).zip(b.par_chunks(width)))
        .for_each(|(out, (a, b))| row(out, a, b));
    Ok((CpuStorage::F32(out), a_layout.shape().clone()))
}

/// `sqrt(mean(x²) + eps)` of one row.
fn rms(row: &[f32], eps: f32) -> f32 {
    (row.iter().map(|&x| x * x).sum::<f32>() / row.len() as f32 + eps).sqrt()
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
        map_rows(storage, layout, |y, x| {
            // A division, as the composed form divides.
            let scale = rms(x, self.eps);
            for (y, &x) in y.iter_mut().zip(x) {
                *y = x / scale;
            }
        })
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
            let r = 1.0 / rms(x, self.eps);
            let mean_gy = x.iter().zip(g).map(|(&x, &g)| g * x * r).sum::<f32>() / x.len() as f32;
            for ((dx, &x), &g) in dx.iter_mut().zip(x).zip(g) {
                *dx = r * (g - x * r * mean_gy);
            }
        })
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
        map_rows(storage, layout, |y, x| {
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0.0f32;
            for (y, &x) in y.iter_mut().zip(x) {
                *y = (x - max).exp();
                total += *y;
            }
            for y in y.iter_mut() {
                *y /= total;
            }
        })
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        y.apply_op2_no_bwd(&grad, &SoftmaxGrad).map(Some)
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
        map_row_pairs((y_storage, y_layout), (g_storage, g_layout), |dx, y, g| {
            let gy = y.iter().zip(g).map(|(&y, &g)| g * y).sum::<f32>();
            for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(g) {
                *dx = y * (g - gy);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{D, DType, Device, Var};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const EPS: f64 = 1e-6;

    fn composed(x: &Tensor) -> Tensor {
        let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        x.broadcast_div(&(ms + EPS).unwrap().sqrt().unwrap())
            .unwrap()
    }

    fn close(a: &Tensor, b: &Tensor, tolerance: f32) {
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
        let values: Vec<f32> = (0..rows * width)
            .map(|_| rng.random_range(-3.0..3.0))
            .collect();
        let weights: Vec<f32> = (0..rows * width)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let weights = Tensor::from_vec(weights, (rows, width), &Device::Cpu).unwrap();
        let x = Var::from_vec(values, (rows, width), &Device::Cpu).unwrap();
        let fused = x
            .as_tensor()
            .apply_op1(RmsNormOp { eps: EPS as f32 })
            .unwrap();
        let reference = composed(x.as_tensor());
        close(&fused, &reference, 1e-6);
        // A loss that weighs every output differently, so every term of the gradient counts.
        let grad = |y: &Tensor| {
            let loss = (y * &weights).unwrap().sum_all().unwrap();
            loss.backward().unwrap().get(x.as_tensor()).unwrap().clone()
        };
        close(&grad(&fused), &grad(&reference), 1e-5);
        assert_eq!(grad(&fused).dtype(), DType::F32);
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
        let weights: Vec<f32> = (0..rows * width)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let weights = Tensor::from_vec(weights, (rows, width), &Device::Cpu).unwrap();
        let x = Var::from_vec(values, (rows, width), &Device::Cpu).unwrap();
        let fused = x.as_tensor().apply_op1(SoftmaxOp).unwrap();
        let reference = candle_nn::ops::softmax(x.as_tensor(), D::Minus1).unwrap();
        close(&fused, &reference, 1e-6);
        let grad = |y: &Tensor| {
            let loss = (y * &weights).unwrap().sum_all().unwrap();
            loss.backward().unwrap().get(x.as_tensor()).unwrap().clone()
        };
        close(&grad(&fused), &grad(&reference), 1e-5);
    }
}
