//! A mixture-of-experts block's gather and scatter on the CPU, each one op with its backward
//! pass.
//!
//! The block sends each token to its `top_k` experts: routing slot `s` carries token
//! `token[s]` (slots sorted by expert). The composed form gathers with `index_select` and
//! combines with `broadcast_mul` into `index_add` on a zeroed tensor: three graph nodes, a
//! `[slots, hidden]` temporary and, in the backward pass, a zeroed `[tokens, hidden]` buffer per
//! node to add into. Here:
//! - [`gather_rows`]: `x[token[s]]` for every slot; its backward pass sums each token's slots'
//!   gradients into the token's row.
//! - [`combine_rows`]: `out[t] = Σ w[s] · y[s]` over the slots of token `t`; its backward pass
//!   writes `dy[s] = w[s] · g[token[s]]` and `dw[s] = y[s] · g[token[s]]`.
//!
//! Invariant: a token's slots are always summed in ascending slot order, from zero, as
//! `index_add` adds them, so the combine is the composed form's arithmetic.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

use super::{Rows, cpu_storage, error, fill_rows, row_readable, values};

/// Which token each routing slot carries, and each token's slots in ascending order.
#[derive(Clone, Debug)]
pub struct Routing {
    token: Arc<[u32]>,
    slots: Arc<[Vec<usize>]>,
}

impl Routing {
    /// `token[s]` for every slot, over `tokens` tokens.
    pub fn new(token: Vec<u32>, tokens: usize) -> candle_core::Result<Self> {
        let mut slots = vec![Vec::new(); tokens];
        for (s, &t) in token.iter().enumerate() {
            slots
                .get_mut(t as usize)
                .ok_or_else(|| error("routing: a slot names a token outside the batch"))?
                .push(s);
        }
        Ok(Self {
            token: token.into(),
            slots: slots.into(),
        })
    }
}

/// `x[token[s]]` for every slot of `routing`: `[slots, hidden]` from `x`, whose rows (every
/// dimension but the last, `[tokens, hidden]` or `[batch, seq, hidden]`) are the tokens.
pub fn gather_rows(x: &Tensor, routing: &Routing) -> candle_core::Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == candle_core::DType::F32 {
        return row_readable(x)?.apply_op1(GatherRows(routing.clone()));
    }
    let index = Tensor::from_slice(&routing.token, routing.token.len(), x.device())?;
    x.flatten_to(x.rank().saturating_sub(2))?
        .index_select(&index, 0)
}

/// `out[t] = Σ w[s] · y[s]` over the slots of token `t`, from `y: [slots, hidden]` and `w:
/// [slots]`, shaped `shape` (the tokens' shape, `[.., hidden]`). Giving the tokens' own shape
/// here, rather than reshaping a `[tokens, hidden]` result, keeps a reshape (and the zeroed
/// gradient buffer candle's backward pass gives each node) out of the graph.
pub fn combine_rows(
    y: &Tensor,
    w: &Tensor,
    routing: &Routing,
    shape: &Shape,
) -> candle_core::Result<Tensor> {
    if y.device().is_cpu() && y.dtype() == candle_core::DType::F32 && w.dtype() == y.dtype() {
        let op = CombineRows {
            routing: routing.clone(),
            shape: shape.clone(),
        };
        return row_readable(y)?.apply_op2(&w.contiguous()?, op);
    }
    let index = Tensor::from_slice(&routing.token, routing.token.len(), y.device())?;
    let hidden = y.dim(1)?;
    Tensor::zeros((routing.slots.len(), hidden), y.dtype(), y.device())?
        .index_add(&index, &y.broadcast_mul(&w.unsqueeze(1)?)?, 0)?
        .reshape(shape)
}

struct GatherRows(Routing);

impl CustomOp1 for GatherRows {
    fn name(&self) -> &'static str {
        "fused-gather-rows"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = Rows::new(storage, layout)?;
        if x.count != self.0.slots.len() {
            return Err(error("gather: x must hold one row per routing token"));
        }
        let token = &self.0.token;
        let out = fill_rows(token.len(), x.width, |s, out| {
            out.copy_from_slice(x.row(token[s] as usize))
        });
        Ok((CpuStorage::F32(out), Shape::from((token.len(), x.width))))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = row_readable(grad)?;
        let (guard, layout) = grad.storage_and_layout();
        let g = Rows::new(cpu_storage(&guard)?, layout)?;
        if g.count != self.0.token.len() {
            return Err(error("gather: gradient of the wrong shape"));
        }
        let slots = &self.0.slots;
        let d_x = fill_rows(slots.len(), g.width, |t, out| {
            for &s in &slots[t] {
                for (o, v) in out.iter_mut().zip(g.row(s)) {
                    *o += v;
                }
            }
        });
        Tensor::from_vec(d_x, x.shape(), x.device()).map(Some)
    }
}

struct CombineRows {
    routing: Routing,
    /// The output's shape: the tokens' rows of `hidden`.
    shape: Shape,
}

impl CustomOp2 for CombineRows {
    fn name(&self) -> &'static str {
        "fused-combine-rows"
    }

    fn cpu_fwd(
        &self,
        y_storage: &CpuStorage,
        y_layout: &Layout,
        w_storage: &CpuStorage,
        w_layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = Rows::new(y_storage, y_layout)?;
        let w = values(w_storage, w_layout)?;
        let slots = &self.routing.slots;
        if y_layout.dims().len() != 2 || y.count != self.routing.token.len() || w.len() != y.count {
            return Err(error("combine: y must be [slots, hidden] and w [slots]"));
        }
        if self.shape.elem_count() != slots.len() * y.width
            || self.shape.dims().last() != Some(&y.width)
        {
            return Err(error(
                "combine: the output shape is not the tokens' rows of y's width",
            ));
        }
        let out = fill_rows(slots.len(), y.width, |t, out| {
            for &s in &slots[t] {
                for (o, v) in out.iter_mut().zip(y.row(s)) {
                    *o += w[s] * v;
                }
            }
        });
        Ok((CpuStorage::F32(out), self.shape.clone()))
    }

    fn bwd(
        &self,
        y: &Tensor,
        w: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = row_readable(grad)?;
        let (g_guard, g_layout) = grad.storage_and_layout();
        let (y_guard, y_layout) = y.storage_and_layout();
        let (w_guard, w_layout) = w.storage_and_layout();
        let g = Rows::new(cpu_storage(&g_guard)?, g_layout)?;
        let ys = Rows::new(cpu_storage(&y_guard)?, y_layout)?;
        let w_values = values(cpu_storage(&w_guard)?, w_layout)?;
        if g.count != self.routing.slots.len() || g.width != ys.width {
            return Err(error("combine: gradient of the wrong shape"));
        }
        let token = &self.routing.token;
        let d_y = fill_rows(token.len(), ys.width, |s, out| {
            for (o, v) in out.iter_mut().zip(g.row(token[s] as usize)) {
                *o = w_values[s] * v;
            }
        });
        // One dot product per slot, too few values to hand to the team: decode's vector kernel
        // on the calling thread. A plain running sum (one chain of dependent adds) cost about
        // 0.4 ms more of a 21.5 ms forward and backward pass of the block on a Zen 4 AMD EPYC.
        let kernel = crate::decode_matmul::Kernel::detect();
        let d_w = fill_rows(token.len(), 1, |s, out| {
            let g = g.row(token[s] as usize);
            kernel.dots(ys.row(s), crate::decode_matmul::Read::Cached, &[g], out);
        });
        Ok((
            Some(Tensor::from_vec(d_y, y.shape(), y.device())?),
            Some(Tensor::from_vec(d_w, w.shape(), w.device())?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::super::tests::{close, grads_of, random, random_var};
    use super::*;

    /// Values and gradients against `index_select`, `broadcast_mul` and `index_add`, with the
    /// slots sorted by expert (tokens out of order) and a token no slot carries.
    #[test]
    fn gather_and_combine_are_the_composed_ops() {
        let mut rng = StdRng::seed_from_u64(31);
        let (tokens, hidden) = (6, 10);
        let token: Vec<u32> = vec![0, 3, 4, 1, 0, 2, 3, 1, 4, 2];
        let routing = Routing::new(token.clone(), tokens).unwrap();
        let index =
            Tensor::from_vec(token.clone(), token.len(), &candle_core::Device::Cpu).unwrap();
        let x = random_var(&mut rng, (tokens, hidden), -2.0..2.0);
        let w = random_var(&mut rng, token.len(), 0.0..1.0);

        let gathered = gather_rows(x.as_tensor(), &routing).unwrap();
        let reference = x.as_tensor().index_select(&index, 0).unwrap();
        close(&gathered, &reference, 0.0);
        let weights = random(&mut rng, (token.len(), hidden), -1.0..1.0);
        close(
            &grads_of(&gathered, &weights, &[&x])[0],
            &grads_of(&reference, &weights, &[&x])[0],
            1e-6,
        );

        // The combine of the gathered rows, as the block runs it.
        let y = (&gathered * 1.5).unwrap();
        let combined =
            combine_rows(&y, w.as_tensor(), &routing, &Shape::from((tokens, hidden))).unwrap();
        let composed = Tensor::zeros(
            (tokens, hidden),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap()
        .index_add(
            &index,
            &y.broadcast_mul(&w.as_tensor().unsqueeze(1).unwrap())
                .unwrap(),
            0,
        )
        .unwrap();
        close(&combined, &composed, 0.0);
        assert_eq!(
            combined
                .get(5)
                .unwrap()
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
            0.0,
            "token 5 has no slot"
        );
        let weights = random(&mut rng, (tokens, hidden), -1.0..1.0);
        let ours = grads_of(&combined, &weights, &[&x, &w]);
        let theirs = grads_of(&composed, &weights, &[&x, &w]);
        for (a, b) in ours.iter().zip(&theirs) {
            close(a, b, 1e-5);
        }
        assert!(
            Routing::new(vec![0, 7], 3).is_err(),
            "a slot outside the batch"
        );

        // The same tokens as `[2, 3, hidden]`: gathered from and combined into that shape, the
        // same values and gradients as the flat rows give.
        let x3 = x.as_tensor().reshape((2, 3, hidden)).unwrap();
        let gathered3 = gather_rows(&x3, &routing).unwrap();
        close(&gathered3, &gathered, 0.0);
        let y3 = (&gathered3 * 1.5).unwrap();
        let combined3 =
            combine_rows(&y3, w.as_tensor(), &routing, &Shape::from((2, 3, hidden))).unwrap();
        assert_eq!(combined3.dims(), &[2, 3, hidden]);
        close(
            &combined3.reshape((tokens, hidden)).unwrap(),
            &combined,
            0.0,
        );
        let weights3 = weights.reshape((2, 3, hidden)).unwrap();
        for (a, b) in grads_of(&combined3, &weights3, &[&x, &w]).iter().zip(&ours) {
            close(a, b, 0.0);
        }
        assert!(
            combine_rows(&y3, w.as_tensor(), &routing, &Shape::from((2, 4, hidden))).is_err(),
            "an output shape with more tokens than the routing"
        );
    }
}
