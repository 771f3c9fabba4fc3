//! The mixture-of-experts feed-forward block of `hrm_text_moe`.
//!
//! A router (kept in f32) scores every token against `num_experts` SwiGLU experts; each token
//! goes to its `num_experts_per_tok` best experts, weighted by their softmax probabilities
//! renormalised over the kept experts. Routing is dropless (no capacity limit), so a token's
//! output never depends on the other tokens in the batch.
//!
//! Tensors, per block (`{stack}` is `H_module` or `L_module`):
//! - `model.{stack}.layers.{i}.mlp.router.weight`: `[num_experts, hidden]`
//! - `model.{stack}.layers.{i}.mlp.experts.gate_up_proj`: `[num_experts, 2 * intermediate, hidden]`
//! - `model.{stack}.layers.{i}.mlp.experts.down_proj`: `[num_experts, hidden, intermediate]`

use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;
use candle_nn::init::DEFAULT_KAIMING_NORMAL;

use crate::cache::softmax_last_dim;
use crate::fused;

#[derive(Clone, Debug)]
pub struct MoeMlp {
    router: Tensor,
    gate_up: Tensor,
    down: Tensor,
    num_experts: usize,
    top_k: usize,
}

impl MoeMlp {
    pub fn load(
        vb: VarBuilder,
        hidden: usize,
        intermediate: usize,
        num_experts: usize,
        top_k: usize,
    ) -> Result<Self> {
        if top_k == 0 || top_k > num_experts {
            candle_core::bail!(
                "num_experts_per_tok ({top_k}) must be between 1 and num_experts ({num_experts})"
            )
        }
        // The router runs in at least f32 whatever the model dtype: routing decisions made in
        // half precision flip on ties and rounding.
        let router_dtype = if vb.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let router = vb.pp("router").get_with_hints_dtype(
            (num_experts, hidden),
            "weight",
            DEFAULT_KAIMING_NORMAL,
            router_dtype,
        )?;
        let experts = vb.pp("experts");
        let gate_up = experts.get_with_hints(
            (num_experts, 2 * intermediate, hidden),
            "gate_up_proj",
            DEFAULT_KAIMING_NORMAL,
        )?;
        let down = experts.get_with_hints(
            (num_experts, hidden, intermediate),
            "down_proj",
            DEFAULT_KAIMING_NORMAL,
        )?;
        Ok(Self {
            router,
            gate_up,
            down,
            num_experts,
            top_k,
        })
    }

    /// Returns the block output and its Switch-Transformer load-balancing loss
    /// `num_experts * sum_e(f_e * P_e)`, where `f_e` is the share of routing slots sent to expert
    /// `e` and `P_e` its mean router probability. The loss is 1 for perfectly even routing.
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, s, _) = x.dims3()?;
        let n = b * s;
        // The router, the gather and the combine all read and write the tokens in `x`'s own
        // `[b, s, hidden]` shape: a reshape would be one more graph node, each with a zeroed
        // gradient buffer the size of the activations in candle's backward pass.
        let logits = fused::linear(&x.to_dtype(self.router.dtype())?, &self.router)?;
        let probs = softmax_last_dim(&logits)?.reshape((n, self.num_experts))?;

        // Top-k selection is discrete, so it is decided on the host; the kept probabilities are
        // then gathered from `probs`, which keeps them differentiable.
        let host: Vec<Vec<f32>> = probs.to_dtype(DType::F32)?.to_vec2()?;
        let mut chosen = Vec::with_capacity(n * self.top_k);
        let mut counts = vec![0usize; self.num_experts];
        for row in &host {
            let mut order: Vec<usize> = (0..self.num_experts).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for &e in &order[..self.top_k] {
                chosen.push(e as u32);
                counts[e] += 1;
            }
        }
        let chosen_t = Tensor::from_vec(chosen.clone(), (n, self.top_k), x.device())?;
        let kept = probs.gather(&chosen_t, 1)?;
        let kept = kept.broadcast_div(&kept.sum_keepdim(1)?)?; // [n, k]
        let kept = kept.to_dtype(x.dtype())?.flatten_all()?;

        // Routing slots (token-major) grouped by expert, in token order within each expert.
        let mut by_expert: Vec<u32> = (0..(n * self.top_k) as u32).collect();
        by_expert.sort_by_key(|&slot| chosen[slot as usize]);
        let rows: Vec<u32> = by_expert
            .iter()
            .map(|&slot| slot / self.top_k as u32)
            .collect();
        let routing = fused::Routing::new(rows, n)?;
        let by_expert = Tensor::from_vec(by_expert, n * self.top_k, x.device())?;

        let expert_in = fused::gather_rows(x, &routing)?;
        let expert_out = fused::grouped_swiglu_mlp(&expert_in, &self.gate_up, &self.down, &counts)?;
        let weights = kept.index_select(&by_expert, 0)?;
        let out = fused::combine_rows(&expert_out, &weights, &routing, x.shape())?;

        let share: Vec<f32> = counts
            .iter()
            .map(|&c| c as f32 / (n * self.top_k) as f32)
            .collect();
        let share =
            Tensor::from_vec(share, self.num_experts, x.device())?.to_dtype(probs.dtype())?;
        let mean_prob = probs.mean(0)?;
        let aux = ((mean_prob * share)?.sum_all()? * self.num_experts as f64)?;
        Ok((out, aux))
    }

    /// Bytes of expert and router weights one token reads (its `top_k` experts).
    pub fn active_weight_bytes(&self) -> usize {
        let per_expert = (self.gate_up.elem_count() + self.down.elem_count()) / self.num_experts
            * self.gate_up.dtype().size_in_bytes();
        per_expert * self.top_k + self.router.elem_count() * self.router.dtype().size_in_bytes()
    }
}
