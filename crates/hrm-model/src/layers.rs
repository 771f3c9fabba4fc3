//! Building blocks shared by every architecture: projections (dense or quantised), RMSNorm,
//! rotary embeddings, attention over the batch's KV caches, the SwiGLU MLP and the pre-norm
//! decoder block.
//!
//! Where candle has a fused kernel without a backward pass (RMSNorm, RoPE, softmax), the op
//! picks it for inference; when gradients are tracked it picks our fused kernel with its
//! backward pass ([`crate::fused`]) on the CPU in f32 and the composed form elsewhere, so
//! training and inference share the same model code.

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{D, DType, Module, Result, Tensor};
use candle_nn::VarBuilder;

use crate::cache::{ForwardBatch, softmax_last_dim};
use crate::moe::MoeMlp;
use crate::quant_matmul::QuantMatrix;

/// A bias-free linear projection, dense or GGUF-quantised. Q4_1 and Q8_0 projections on the CPU
/// are repacked at load for the kernel in `quant_matmul.rs`, which serves every pass; dense f32
/// ones on the CPU use the kernel in `decode_matmul.rs` for one position per sequence (decode
/// steps, and a generation pass's final block after [`Outputs::Last`]) and
/// [`crate::fused::linear`] (gemm, cut over the thread team) for every other pass; everything
/// else uses candle's.
#[derive(Clone, Debug)]
pub enum Linear {
    Dense(candle_nn::Linear),
    Quantized(QMatMul),
    Repacked(std::sync::Arc<QuantMatrix>),
}

impl Linear {
    pub fn load(vb: VarBuilder, in_dim: usize, out_dim: usize) -> Result<Self> {
        Ok(Self::Dense(candle_nn::linear_no_bias(in_dim, out_dim, vb)?))
    }

    /// A GGUF weight `[out, in]`: repacked for our kernel where it has one, else candle's.
    pub fn quantized(weight: QTensor) -> Result<Self> {
        if crate::quant_matmul::repacks(&weight) {
            Ok(Self::Repacked(std::sync::Arc::new(
                QuantMatrix::from_qtensor(&weight)?,
            )))
        } else {
            Ok(Self::Quantized(QMatMul::from_qtensor(weight)?))
        }
    }

    /// The weight `[out, in]` of a dense projection.
    pub fn dense_weight(&self) -> Option<&Tensor> {
        match self {
            Self::Dense(l) => Some(l.weight()),
            Self::Quantized(_) | Self::Repacked(_) => None,
        }
    }

    /// Bytes of weights read by one application.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Self::Dense(l) => l.weight().elem_count() * l.weight().dtype().size_in_bytes(),
            Self::Quantized(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            Self::Repacked(q) => q.storage_bytes(),
            Self::Quantized(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        }
    }
}

/// candle's quantised CPU matmul computes one dot product per (row, column) pair, so a prefill or
/// scoring pass would cost as much per token as a decode step. For the formats without our own
/// kernel, passes over more than one position therefore dequantise each matrix for the call and
/// use the f32 GEMM; decode steps (one position per sequence) keep the quantised kernel, which
/// reads 4-8x fewer weight bytes. The choice depends only on the pass's shape, never on what else
/// is batched, so a sequence's scores and tokens do not depend on its batch.
///
/// Q4_1 and Q8_0 are the exception: `quant_matmul.rs` unpacks each weight block once for several
/// rows, so it serves prefill and scoring too. Dequantising a whole model per call cost a short
/// prompt more than its prefill (time to first token ~90 ms for 8 tokens of SmolLM2, against
/// ~20 ms), and one kernel for every pass means a token scores the same at prefill, decode and
/// scoring.
fn dequantize_for(x: &Tensor) -> Result<bool> {
    Ok(x.rank() == 3 && x.dim(1)? > 1)
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(l) if crate::decode_matmul::applies(l.weight(), x) => {
                crate::decode_matmul::forward(l.weight(), x)
            }
            Self::Dense(l) => crate::fused::linear(x, l.weight()),
            Self::Repacked(q) => q.forward(x),
            Self::Quantized(QMatMul::QTensor(q)) if dequantize_for(x)? => {
                let w = q.dequantize(x.device())?;
                candle_nn::Linear::new(w, None)
                    .forward(&x.to_dtype(DType::F32)?)?
                    .to_dtype(x.dtype())
            }
            Self::Quantized(q) => q.forward(x),
        }
    }
}

/// Root-mean-square norm computed in f32, with an optional learned scale (HRM-Text's is
/// weightless, Llama's is not).
#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Option<Tensor>,
    /// All-ones scale for candle's kernel (off the CPU) when the norm is weightless.
    unit: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(
        weight: Option<Tensor>,
        hidden: usize,
        eps: f64,
        device: &candle_core::Device,
    ) -> Result<Self> {
        Ok(Self {
            weight,
            unit: Tensor::ones(hidden, DType::F32, device)?,
            eps,
        })
    }

    /// The learned scale, if any, and epsilon.
    pub(crate) fn parts(&self) -> (Option<&Tensor>, f32) {
        (self.weight.as_ref(), self.eps as f32)
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        // On the CPU in f32 our kernels serve inference as well as training: candle's `rms_norm`
        // and the product by the scale (within f32 rounding: the squares are summed in another
        // order), in one op on the team, where candle's hands a prefill's rows to rayon's pool.
        if let Some(w) = &self.weight
            && x.device().is_cpu()
            && dtype == DType::F32
            && w.dtype() == DType::F32
        {
            let op = crate::fused::ScaledRmsNormOp {
                eps: self.eps as f32,
            };
            return x.contiguous()?.apply_op2(&w.contiguous()?, op);
        }
        let xf = x.to_dtype(DType::F32)?;
        let normed = if xf.device().is_cpu() {
            xf.contiguous()?.apply_op1(crate::fused::RmsNormOp {
                eps: self.eps as f32,
            })?
        } else if xf.track_op() || self.weight.as_ref().is_some_and(|w| w.track_op()) {
            let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
            xf.broadcast_div(&(ms + self.eps)?.sqrt()?)?
        } else {
            candle_nn::ops::rms_norm(&xf.contiguous()?, &self.unit, self.eps as f32)?
        };
        // transformers casts back before applying the weight (`weight * x.to(dtype)`).
        let normed = normed.to_dtype(dtype)?;
        match &self.weight {
            Some(w) => normed.broadcast_mul(w),
            None => Ok(normed),
        }
    }
}

/// How a checkpoint lays out the rotary pairs of each head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Hugging Face: the first and second halves of a head are the pairs (`rotate_half`).
    Halves,
    /// GGUF / llama.cpp: adjacent elements are the pairs.
    Interleaved,
}

/// Rotary position embeddings, computed for the batch's positions on each pass (so there is
/// no table to outgrow), exactly as transformers does: `inv_freq` and the angles in f32.
#[derive(Clone, Debug)]
pub struct Rotary {
    inv_freq: Tensor,
    layout: RopeLayout,
}

impl Rotary {
    pub fn new(
        head_dim: usize,
        theta: f64,
        layout: RopeLayout,
        device: &candle_core::Device,
    ) -> Result<Self> {
        let base = theta as f32;
        let inv_freq: Vec<f32> = (0..head_dim)
            .step_by(2)
            .map(|i| 1.0 / base.powf(i as f32 / head_dim as f32))
            .collect();
        let len = inv_freq.len();
        Ok(Self {
            inv_freq: Tensor::from_vec(inv_freq, (1, len), device)?,
            layout,
        })
    }

    pub(crate) fn layout(&self) -> RopeLayout {
        self.layout
    }

    /// `(cos, sin)` of shape `[batch, seq_len, head_dim / 2]` for the batch's positions.
    pub fn angles(&self, batch: &ForwardBatch<'_>, dtype: DType) -> Result<(Tensor, Tensor)> {
        let (b, s) = (batch.batch_size(), batch.seq_len());
        let pos = batch.positions.to_dtype(DType::F32)?.unsqueeze(1)?;
        let freqs = pos.broadcast_mul(&self.inv_freq)?.reshape((b, s, ()))?;
        Ok((freqs.cos()?.to_dtype(dtype)?, freqs.sin()?.to_dtype(dtype)?))
    }

    /// Rotates `x` of shape `[batch, heads, seq_len, head_dim]`.
    pub fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        // On the CPU in f32 our kernel serves inference too: candle's runs on rayon's pool,
        // which would wake a second set of threads beside the team for every layer.
        if x.device().is_cpu() && x.dtype() == DType::F32 {
            let op = crate::fused::RopeOp {
                layout: self.layout,
            };
            return x.apply_op3(cos, sin, op);
        }
        if !x.track_op() {
            return match self.layout {
                RopeLayout::Halves => candle_nn::rotary_emb::rope(&x, cos, sin),
                RopeLayout::Interleaved => candle_nn::rotary_emb::rope_i(&x, cos, sin),
            };
        }
        rope_composed(&x, cos, sin, self.layout)
    }
}

/// The rotary embedding as element-wise tensor ops, differentiable on every device: the form
/// training uses off the CPU, and the reference the fused kernel is held to.
pub fn rope_composed(x: &Tensor, cos: &Tensor, sin: &Tensor, layout: RopeLayout) -> Result<Tensor> {
    let (b, h, s, d) = x.dims4()?;
    let cos = cos.unsqueeze(1)?;
    let sin = sin.unsqueeze(1)?;
    let rotate = |x1: &Tensor, x2: &Tensor| -> Result<(Tensor, Tensor)> {
        let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
        let r2 = (x1.broadcast_mul(&sin)? + x2.broadcast_mul(&cos)?)?;
        Ok((r1, r2))
    };
    match layout {
        RopeLayout::Halves => {
            let (r1, r2) = rotate(
                &x.narrow(D::Minus1, 0, d / 2)?,
                &x.narrow(D::Minus1, d / 2, d / 2)?,
            )?;
            Tensor::cat(&[r1, r2], D::Minus1)
        }
        RopeLayout::Interleaved => {
            let pairs = x.reshape((b, h, s, d / 2, 2))?;
            let x1 = pairs.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?;
            let x2 = pairs.narrow(D::Minus1, 1, 1)?.squeeze(D::Minus1)?;
            let (r1, r2) = rotate(&x1, &x2)?;
            Tensor::stack(&[r1, r2], D::Minus1)?.reshape((b, h, s, d))
        }
    }
}

/// The attention input projections, as the checkpoint stores them.
#[derive(Clone, Debug)]
pub enum AttnInput {
    /// One matrix producing `[gate, q, k, v]` (HRM-Text's `attn.gqkv_proj`).
    FusedGqkv(Linear),
    /// One matrix producing `[q, k, v]` (a GGUF's separate matrices stacked at load).
    FusedQkv(Linear),
    /// Separate q, k and v (Llama).
    Split { q: Linear, k: Linear, v: Linear },
}

/// Multi-head attention with grouped-query heads and an optional sigmoid output gate.
#[derive(Clone, Debug)]
pub struct Attention {
    pub input: AttnInput,
    pub o_proj: Linear,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// What attention needs from the enclosing pass besides the hidden states.
pub struct AttnContext<'a> {
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub rotary: &'a Rotary,
}

/// Which positions of a block's output the rest of the pass reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outputs {
    All,
    /// The last position of each row: a generation pass's final block, whose other positions
    /// only had to give their keys and values to the cache. The block's output projection and
    /// feed-forward half then run on one row per sequence.
    Last,
}

impl Outputs {
    /// What a pass's final block gives for the logits the pass was asked for.
    pub fn for_logits(logits: crate::Logits) -> Self {
        match logits {
            crate::Logits::Last => Self::Last,
            crate::Logits::All | crate::Logits::Hidden => Self::All,
        }
    }

    /// What block `index` of `count` run in order gives: these outputs for the last, every
    /// position for the others (each of whose positions feeds the next block's keys and values).
    pub fn for_block(self, index: usize, count: usize) -> Self {
        if index + 1 == count { self } else { Self::All }
    }

    /// The positions of `t` (`[b, s, ...]`) that these outputs name.
    pub fn of(self, t: Tensor) -> Result<Tensor> {
        let s = t.dim(1)?;
        match self {
            Self::Last if s > 1 => t.narrow(1, s - 1, 1),
            _ => Ok(t),
        }
    }
}

impl Attention {
    /// Every position's keys and values reach the cache; the output `[b, s or 1, hidden]` has
    /// the positions `outputs` names.
    pub fn forward(
        &self,
        x: &Tensor,
        batch: &mut ForwardBatch<'_>,
        ctx: &AttnContext<'_>,
        slot: usize,
        outputs: Outputs,
    ) -> Result<Tensor> {
        let out = match self.whole_pass_forward(x, batch, ctx, slot)? {
            Some(out) => out,
            None => self.cached_pass_forward(x, batch, ctx, slot)?,
        };
        self.o_proj.forward(&outputs.of(out)?)
    }

    /// Attention through the cache's general path: `[b, s, h · d]` before the output projection.
    fn cached_pass_forward(
        &self,
        x: &Tensor,
        batch: &mut ForwardBatch<'_>,
        ctx: &AttnContext<'_>,
        slot: usize,
    ) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let (h, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let (gate, q, k, v) = match &self.input {
            AttnInput::FusedGqkv(proj) => {
                let all = proj.forward(x)?;
                let part = |i: usize| all.narrow(D::Minus1, i * h * d, h * d);
                (Some(part(0)?), part(1)?, part(2)?, part(3)?)
            }
            AttnInput::FusedQkv(proj) => {
                let all = proj.forward(x)?;
                (
                    None,
                    all.narrow(D::Minus1, 0, h * d)?,
                    all.narrow(D::Minus1, h * d, kvh * d)?,
                    all.narrow(D::Minus1, (h + kvh) * d, kvh * d)?,
                )
            }
            AttnInput::Split { q, k, v } => (None, q.forward(x)?, k.forward(x)?, v.forward(x)?),
        };
        let q = q.reshape((b, s, h, d))?.transpose(1, 2)?;
        let k = k.reshape((b, s, kvh, d))?.transpose(1, 2)?;
        let v = v.reshape((b, s, kvh, d))?.transpose(1, 2)?.contiguous()?;
        let q = ctx.rotary.apply(&q, ctx.cos, ctx.sin)?;
        let k = ctx.rotary.apply(&k, ctx.cos, ctx.sin)?;

        let scale = 1.0 / (d as f64).sqrt();
        let out = match batch.decode_attention(slot, &q, &k, &v, scale)? {
            Some(out) => out, // [b, 1, h, d]
            None => {
                let (k, v) = batch.attend_to(slot, &k, &v)?;
                let k = repeat_kv(k, h / kvh)?;
                let v = repeat_kv(v, h / kvh)?;
                let scores = crate::fused::batched_matmul(&q.contiguous()?, &k.t()?, scale)?;
                let scores = match &batch.mask {
                    Some(mask) => scores.broadcast_add(mask)?,
                    None => scores,
                };
                let probs = softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(q.dtype())?;
                crate::fused::batched_matmul(&probs, &v, 1.0)?.transpose(1, 2)? // [b, s, h, d]
            }
        };
        let out = match gate {
            Some(gate) => crate::fused::sigmoid(&gate.reshape((b, s, h, d))?)?.mul(&out)?,
            None => out,
        };
        out.reshape((b, s, h * d))
    }

    /// Attention over a pass whose rows see only their own tokens (training, scoring, a
    /// prompt's first pass) on the CPU in f32: the output `[b, s, h · d]` of one
    /// [`crate::fused::AttentionOp`], which takes the whole input projection and runs every
    /// (sequence, KV head) on the thread team, with its backward pass where gradients are
    /// tracked. A first pass also writes its rotated keys and its values to the cache, from the
    /// projection on the team ([`ForwardBatch::append_projected`]). `None` for every other
    /// pass, and for separate q, k and v weights outside training.
    fn whole_pass_forward(
        &self,
        x: &Tensor,
        batch: &mut ForwardBatch<'_>,
        ctx: &AttnContext<'_>,
        slot: usize,
    ) -> Result<Option<Tensor>> {
        if !x.device().is_cpu() || x.dtype() != DType::F32 || !batch.sees_only_its_own_tokens() {
            return Ok(None);
        }
        let tracked = x.track_op()
            || match &self.input {
                AttnInput::FusedGqkv(Linear::Dense(l)) | AttnInput::FusedQkv(Linear::Dense(l)) => {
                    l.weight().track_op()
                }
                AttnInput::Split { q, .. } => {
                    matches!(q, Linear::Dense(l) if l.weight().track_op())
                }
                _ => false,
            };
        if tracked && !batch.is_full_pass() {
            return Ok(None);
        }
        let (proj, gated) = match &self.input {
            AttnInput::FusedGqkv(proj) => (proj.forward(x)?, true),
            AttnInput::FusedQkv(proj) => (proj.forward(x)?, false),
            AttnInput::Split { q, k, v } if tracked => match stacked_for_training(&[q, k, v])? {
                Some(w) => (crate::fused::linear(x, &w)?, false),
                None => return Ok(None),
            },
            AttnInput::Split { .. } => return Ok(None),
        };
        let proj = proj.contiguous()?;
        let (h, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        if !batch.is_full_pass() {
            let (b, s, width) = proj.dims3()?;
            let k_head = if gated { 2 * h } else { h };
            let columns = crate::cache::ProjectionColumns {
                width,
                keys_at: k_head * d,
                values_at: (k_head + kvh) * d,
                kv_heads: kvh,
                head_dim: d,
                layout: ctx.rotary.layout,
            };
            let written = crate::fused::read(&proj, |values| {
                crate::fused::read(ctx.cos, |cos| {
                    crate::fused::read(ctx.sin, |sin| {
                        batch.append_projected(slot, (values, cos, sin), columns)
                    })
                })
            })?;
            if !written {
                // Views of the projection as `[b, s, heads, d]`: the cache copies each row once.
                let by_head = proj.reshape((b, s, width / d, d))?;
                let heads = |first: usize| by_head.narrow(2, first, kvh)?.transpose(1, 2);
                let k = ctx.rotary.apply(&heads(k_head)?, ctx.cos, ctx.sin)?;
                batch.append(slot, &k, &heads(k_head + kvh)?)?;
            }
        }
        let op = crate::fused::AttentionOp::new(
            (h, kvh, d),
            gated,
            ctx.rotary.layout,
            batch.mask_values()?,
        )?;
        // Without a graph candle never runs the op's backward pass.
        let op = if proj.track_op() {
            op
        } else {
            op.forward_only()
        };
        proj.apply_op3(ctx.cos, ctx.sin, op).map(Some)
    }

    pub fn weight_bytes(&self) -> usize {
        let input = match &self.input {
            AttnInput::FusedGqkv(p) | AttnInput::FusedQkv(p) => p.weight_bytes(),
            AttnInput::Split { q, k, v } => q.weight_bytes() + k.weight_bytes() + v.weight_bytes(),
        };
        input + self.o_proj.weight_bytes()
    }
}

fn repeat_kv(x: Tensor, groups: usize) -> Result<Tensor> {
    if groups == 1 {
        return Ok(x);
    }
    let (b, kvh, s, d) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, kvh, groups, s, d))?
        .reshape((b, kvh * groups, s, d))
}

/// For training (tracked dense weights), one projection whose weight rows are `parts`' stacked:
/// one product instead of several, and one gradient for the fused kernel downstream to write,
/// while the stacking's own backward pass only splits a weight-sized gradient.
fn stacked_for_training(parts: &[&Linear]) -> Result<Option<Tensor>> {
    let weights: Option<Vec<&Tensor>> = parts
        .iter()
        .map(|p| match p {
            Linear::Dense(l) if l.weight().track_op() => Some(l.weight()),
            _ => None,
        })
        .collect();
    weights.map(|w| Tensor::cat(&w, 0)).transpose()
}

/// The gate and up projections of a SwiGLU MLP, as the checkpoint stores them.
#[derive(Clone, Debug)]
pub enum GateUp {
    /// One matrix producing `[gate, up]` (HRM-Text's `mlp.gate_up_proj`).
    Fused(Linear),
    Split {
        gate: Linear,
        up: Linear,
    },
}

/// `down(silu(gate(x)) * up(x))`.
#[derive(Clone, Debug)]
pub struct SwiGlu {
    pub gate_up: GateUp,
    pub down: Linear,
}

impl SwiGlu {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some((gate_up, down)) = self.tracked_weights()? {
            return crate::fused::swiglu_mlp(x, &gate_up, &down);
        }
        let both = match &self.gate_up {
            GateUp::Fused(proj) => proj.forward(x)?,
            GateUp::Split { gate, up } => match stacked_for_training(&[gate, up])? {
                Some(w) => crate::fused::linear(x, &w)?,
                None => Tensor::cat(&[gate.forward(x)?, up.forward(x)?], D::Minus1)?,
            },
        };
        self.down.forward(&crate::fused::swiglu(&both)?)
    }

    /// For training (tracked dense weights), the `[gate; up]` and down weights, so that the
    /// whole block runs as one op ([`crate::fused::swiglu_mlp`]).
    fn tracked_weights(&self) -> Result<Option<(Tensor, Tensor)>> {
        let down = match &self.down {
            Linear::Dense(l) if l.weight().track_op() => l.weight(),
            _ => return Ok(None),
        };
        let gate_up = match &self.gate_up {
            GateUp::Fused(Linear::Dense(l)) if l.weight().track_op() => Some(l.weight().clone()),
            GateUp::Fused(_) => None,
            GateUp::Split { gate, up } => stacked_for_training(&[gate, up])?,
        };
        Ok(gate_up.map(|gate_up| (gate_up, down.clone())))
    }

    pub fn weight_bytes(&self) -> usize {
        let gate_up = match &self.gate_up {
            GateUp::Fused(p) => p.weight_bytes(),
            GateUp::Split { gate, up } => gate.weight_bytes() + up.weight_bytes(),
        };
        gate_up + self.down.weight_bytes()
    }
}

/// The feed-forward half of a block: one SwiGLU, or a mixture of SwiGLU experts.
#[derive(Clone, Debug)]
pub enum FeedForward {
    Dense(SwiGlu),
    Experts(MoeMlp),
}

/// A pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.
#[derive(Clone, Debug)]
pub struct DecoderLayer {
    pub input_norm: RmsNorm,
    pub attn: Attention,
    pub post_attention_norm: RmsNorm,
    pub mlp: FeedForward,
}

impl DecoderLayer {
    /// Returns the new hidden states at the positions `outputs` names and, for a
    /// mixture-of-experts block, its load-balancing loss.
    pub fn forward(
        &self,
        x: &Tensor,
        batch: &mut ForwardBatch<'_>,
        ctx: &AttnContext<'_>,
        slot: usize,
        outputs: Outputs,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if let Some(out) = crate::decode_layer::forward(self, x, batch, ctx, slot)? {
            return Ok((out, None));
        }
        self.forward_by_tensor_ops(x, batch, ctx, slot, outputs)
    }

    /// [`Self::forward`] op by op: every pass and block that `decode_layer.rs` does not take.
    pub(crate) fn forward_by_tensor_ops(
        &self,
        x: &Tensor,
        batch: &mut ForwardBatch<'_>,
        ctx: &AttnContext<'_>,
        slot: usize,
        outputs: Outputs,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let attn = self
            .attn
            .forward(&self.input_norm.forward(x)?, batch, ctx, slot, outputs)?;
        let x = (outputs.of(x.clone())? + attn)?;
        let normed = self.post_attention_norm.forward(&x)?;
        let (mlp, aux) = match &self.mlp {
            FeedForward::Dense(mlp) => (mlp.forward(&normed)?, None),
            FeedForward::Experts(moe) => {
                let (out, aux) = moe.forward(&normed)?;
                (out, Some(aux))
            }
        };
        Ok(((x + mlp)?, aux))
    }

    /// Bytes of weights one token reads through this block (for MoE, the active experts only).
    pub fn weight_bytes_per_token(&self) -> usize {
        let mlp = match &self.mlp {
            FeedForward::Dense(m) => m.weight_bytes(),
            FeedForward::Experts(m) => m.active_weight_bytes(),
        };
        self.attn.weight_bytes() + mlp
    }
}
