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

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

/// Root-mean-square normalisation without a scale, with its backward pass.
pub struct RmsNormOp {
    pub eps: f32,
}

/// The contiguous f32 values of a CPU storage, and the length of its last dimension.
fn rows<'a>(storage: &'a CpuStorage, layout: &Layout) -> candle_core::Result<(&'a [f32], usize)> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fused kernels need contiguous tensors".into()))?;
    let width = layout.dims().last().copied().unwrap_or(1).max(1);
    Ok((&storage.as_slice::<f32>()?[start..end], width))
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
        let (x, width) = rows(storage, layout)?;
        let mut y = vec![0.0f32; x.len()];
        y.par_chunks_mut(width)
            .zip(x.par_chunks(width))
            .for_each(|(y, x)| {
                // A division, as the composed form divides.
                let scale = rms(x, self.eps);
                for (y, &x) in y.iter_mut().zip(x) {
                    *y = x / scale;
                }
            });
        Ok((CpuStorage::F32(y), layout.shape().clone()))
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
        let (x, width) = rows(x_storage, x_layout)?;
        let (g, _) = rows(g_storage, g_layout)?;
        let mut dx = vec![0.0f32; x.len()];
        dx.par_chunks_mut(width)
            .zip(x.par_chunks(width).zip(g.par_chunks(width)))
            .for_each(|(dx, (x, g))| {
                let r = 1.0 / rms(x, self.eps);
                let mean_gy = x.iter().zip(g).map(|(&x, &g)| g * x * r).sum::<f32>() / width as f32;
                for ((dx, &x), &g) in dx.iter_mut().zip(x).zip(g) {
                    *dx = r * (g - x * r * mean_gy);
                }
            });
        Ok((CpuStorage::F32(dx), x_layout.shape().clone()))
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
        let (x, width) = rows(storage, layout)?;
        let mut y = vec![0.0f32; x.len()];
        y.par_chunks_mut(width)
            .zip(x.par_chunks(width))
            .for_each(|(y, x)| {
                let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut total = 0.0f32;
                for (y, &x) in y.iter_mut().zip(x) {
                    *y = (x - max).exp();
                    total += *y;
                }
                for y in y.iter_mut() {
                    *y /= total;
                }
            });
        Ok((CpuStorage::F32(y), layout.shape().clone()))
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
        let (y, width) = rows(y_storage, y_layout)?;
        let (g, _) = rows(g_storage, g_layout)?;
        let mut dx = vec![0.0f32; y.len()];
        dx.par_chunks_mut(width)
            .zip(y.par_chunks(width).zip(g.par_chunks(width)))
            .for_each(|(dx, (y, g))| {
                let gy = y.iter().zip(g).map(|(&y, &g)| g * y).sum::<f32>();
                for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(g) {
                    *dx = y * (g - gy);
                }
            });
        Ok((CpuStorage::F32(dx), y_layout.shape().clone()))
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
