//! The language-model head and the mean next-token cross-entropy as one training op.
//!
//! Composed, the head's product writes a `[rows, vocab]` logits tensor (33 MB for a micro-batch
//! of 1,016 tokens over 8,192 words), the cross-entropy reads it forward and again backward,
//! and the backward pass zeroes a gradient of that size and adds into it at each graph edge
//! between the loss and the head's product. [`HeadCrossEntropyOp`] keeps the logits inside one
//! node: its forward pass turns them in place into `softmax(logits) - onehot(label)`, row by
//! row while each row is in cache, and leaves that for the backward pass, which multiplies it
//! by the weight and by the input with the loss's gradient folded into the GEMM's scale.
//!
//! Invariant: the matrix left for the backward pass is of the weights the forward pass read;
//! an optimiser step between the two would make the gradient stale, and none happens (the
//! trainer steps after its backward passes).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use super::linear::{input_grad, operands, product, weight_grad};
use super::{Rows, Strided, check_labels, cpu_storage, exp_from_max, row_readable, values};

/// Mean cross-entropy of `hidden · weightᵀ` (the logits of `hidden: [.., k]` under a head
/// `weight: [vocab, k]`) against `labels`, one per row of `hidden`. On the CPU in f32 the fused
/// op; elsewhere the head's product and [`super::cross_entropy`].
pub fn head_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &[u32],
) -> crate::Result<Tensor> {
    let (vocab, _) = weight.dims2()?;
    let rows = hidden.dims().iter().rev().skip(1).product();
    check_labels(rows, vocab, labels)?;
    if hidden.device().is_cpu()
        && hidden.dtype() == candle_core::DType::F32
        && weight.dtype() == hidden.dtype()
    {
        let op = HeadCrossEntropyOp {
            labels: labels.into(),
            left_for_backward: Mutex::new(None),
        };
        Ok(row_readable(hidden)?.apply_op2(&weight.contiguous()?, op)?)
    } else {
        let logits = super::linear(hidden, weight)?;
        super::cross_entropy(&logits.flatten_to(logits.rank().saturating_sub(2))?, labels)
    }
}

/// See the module doc. The output is the mean loss, a scalar.
struct HeadCrossEntropyOp {
    labels: Arc<[u32]>,
    /// `softmax(logits) - onehot(label)`, `[rows, vocab]`, from the forward pass; the backward
    /// pass takes it (and recomputes it if asked twice).
    left_for_backward: Mutex<Option<Vec<f32>>>,
}

impl HeadCrossEntropyOp {
    /// `softmax(x · wᵀ) - onehot(label)` per row, and the mean of the rows' losses
    /// `logsumexp(row) - row[label]`.
    fn softmax_minus_labels(
        &self,
        x: &Rows,
        w: &[f32],
        (vocab, k): (usize, usize),
    ) -> candle_core::Result<(Vec<f32>, f32)> {
        let rows = x.count;
        let mut probs = product(x, w, (vocab, k))?;
        let losses: Vec<AtomicU32> = (0..rows).map(|_| AtomicU32::new(0)).collect();
        crate::team::chunks_in_parallel(&mut probs, vocab.max(1), |i, row| {
            let label = self.labels[i] as usize;
            let picked = row[label];
            let (max, total) = exp_from_max(row);
            let scale = total.recip();
            row.iter_mut().for_each(|p| *p *= scale);
            row[label] -= 1.0;
            let loss = total.ln() - (picked - max);
            losses[i].store(loss.to_bits(), Ordering::Relaxed);
        });
        // Summed in row order, so the mean does not depend on how the rows were shared out.
        let sum: f64 = losses
            .iter()
            .map(|l| f64::from(f32::from_bits(l.load(Ordering::Relaxed))))
            .sum();
        Ok((probs, (sum / rows.max(1) as f64) as f32))
    }
}

impl CustomOp2 for HeadCrossEntropyOp {
    fn name(&self) -> &'static str {
        "fused-head-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        x_storage: &CpuStorage,
        x_layout: &Layout,
        w_storage: &CpuStorage,
        w_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, dims) = operands(x_storage, x_layout, w_layout)?;
        let (probs, mean) = self.softmax_minus_labels(&x, values(w_storage, w_layout)?, dims)?;
        *self
            .left_for_backward
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(probs);
        Ok((CpuStorage::F32(vec![mean]), Shape::from(())))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _loss: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
        let (x_guard, x_layout) = x.storage_and_layout();
        let (w_guard, w_layout) = w.storage_and_layout();
        let (x_rows, (vocab, k)) = operands(cpu_storage(&x_guard)?, x_layout, w_layout)?;
        let w_values = values(cpu_storage(&w_guard)?, w_layout)?;
        let left = self
            .left_for_backward
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let probs = match left {
            Some(probs) => probs,
            None => self.softmax_minus_labels(&x_rows, w_values, (vocab, k))?.0,
        };
        let rows = x_rows.count;
        // d(mean loss)/d(logits) = (softmax - onehot) / rows, times the loss's own gradient.
        let scale = grad / rows.max(1) as f32;
        let ps = Strided::matrix(&probs, 0, 0, (rows, vocab), (vocab, 1))?;
        let d_x = input_grad(&ps, rows, w_values, (vocab, k), scale)?;
        let d_x = Tensor::from_vec(d_x, x.shape(), x.device())?;
        Ok((Some(d_x), weight_grad(&ps, &x_rows, w, (vocab, k), scale)?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{D, Device};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::super::tests::{close, random_var};
    use super::*;

    /// The loss and both gradients against the head's product followed by candle's
    /// cross-entropy, for an input read in place from a wider tensor, with the loss scaled
    /// before the backward pass (as the trainer divides by its micro-batches), small and large
    /// enough for the team; a second backward pass over the same graph recomputes what the
    /// first took and gets the same gradients.
    #[test]
    fn loss_and_gradients_are_the_composed_ones() {
        let mut rng = StdRng::seed_from_u64(41);
        for (batch, len, k, vocab, pad) in [(2, 7, 24, 61, 3), (3, 100, 64, 500, 0)] {
            let wide = random_var(&mut rng, (batch, len, k + pad), -2.0..2.0);
            let x = wide.as_tensor().narrow(D::Minus1, pad, k).unwrap();
            let w = random_var(&mut rng, (vocab, k), -1.0..1.0);
            let labels: Vec<u32> = (0..batch * len)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect();
            let fused = head_cross_entropy(&x, w.as_tensor(), &labels).unwrap();
            let logits = x.broadcast_matmul(&w.as_tensor().t().unwrap()).unwrap();
            let label_tensor = Tensor::from_slice(&labels, batch * len, &Device::Cpu).unwrap();
            let reference =
                candle_nn::loss::cross_entropy(&logits.flatten_to(1).unwrap(), &label_tensor)
                    .unwrap();
            assert_eq!(fused.dims(), reference.dims());
            close(&fused, &reference, 1e-5);
            let grads = |loss: &Tensor| {
                let store = (loss * 0.37).unwrap().backward().unwrap();
                [&wide, &w].map(|v| store.get(v.as_tensor()).unwrap().clone())
            };
            let theirs = grads(&reference);
            let first = grads(&fused);
            let again = grads(&fused);
            for ((ours, again), theirs) in first.iter().zip(&again).zip(&theirs) {
                close(ours, theirs, 1e-5);
                close(again, ours, 0.0);
            }
        }
    }

    #[test]
    fn refuses_labels_outside_the_vocabulary() {
        let x = Tensor::zeros((2, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::zeros((5, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = head_cross_entropy(&x, &w, &[1, 5]).unwrap_err().to_string();
        assert!(err.contains("label 5 outside the vocabulary of 5"), "{err}");
        let err = head_cross_entropy(&x, &w, &[1]).unwrap_err().to_string();
        assert!(err.contains("1 labels for 2 rows"), "{err}");
    }
}
