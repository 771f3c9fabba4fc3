//! A pre-norm block's decode step on the CPU, on raw buffers from its input norm to its second
//! residual add.
//!
//! At one new position per sequence, each of a block's four products takes a few microseconds,
//! and the general path ([`DecoderLayer::forward_by_tensor_ops`]) runs some twenty tensor ops
//! between them: norms, narrows, copies for reshapes, RoPE, the cache's appends, the attention
//! gate, the residual adds. Each one allocates its output and goes through candle's bookkeeping
//! on the calling thread, while the team's other thread waits for the next product. Here the
//! same arithmetic runs as loops over the block's own buffers, and only the products and
//! attention go to the team.
//!
//! Invariants:
//! - Only decode steps come here: one new position per row, rows with caches, at least one row
//!   with something cached (a step where every row is new takes the prompt's attention op), f32
//!   on the CPU, no gradient. The block must be a dense SwiGLU block (a GGUF's, HRM-Text's, a
//!   Llama checkpoint's), its input and gate/up products stacked or separate, each product
//!   either GGUF weights repacked for `quant_matmul.rs` or dense f32 weights for
//!   `decode_matmul.rs`. Any other pass or block (mixture-of-experts, candle's own quantised
//!   formats, other dtypes) takes the general path.
//! - The same kernels run in the same order as on the general path, so the results are the
//!   same bits: the norms' rows ([`crate::fused::rms_norm_row`],
//!   [`crate::fused::scaled_rms_norm_row`]), the products, the rotation
//!   ([`crate::fused::rotate`]), the cache's rounding, decode attention
//!   ([`ForwardBatch::attend_cached`]), the output gate ([`crate::fused::gate_in_place`], the
//!   sigmoid and product of the general path's `fused::sigmoid` and `mul`) and SwiGLU
//!   ([`crate::fused::swiglu_row`]). The tests compare hidden states bit for bit,
//!   step after step.

use candle_core::{DType, Result, Tensor};

use crate::cache::ForwardBatch;
use crate::decode_attention::Heads;
use crate::fused::read;
use crate::layers::{
    AttnContext, AttnInput, DecoderLayer, FeedForward, GateUp, Linear, RmsNorm, SwiGlu,
};
use crate::quant_matmul::QuantMatrix;

/// One of the block's products.
enum Product<'a> {
    Repacked(&'a QuantMatrix),
    /// Dense f32 weights `[out, in]`, contiguous on the CPU.
    Dense(&'a Tensor),
}

impl<'a> Product<'a> {
    fn of(linear: &'a Linear) -> Option<Self> {
        match linear {
            Linear::Repacked(q) => Some(Self::Repacked(q)),
            // The weights `Linear::forward` hands to `decode_matmul.rs` at a decode step, and
            // no others: any other dense weight goes through the GEMM there.
            Linear::Dense(l) => {
                crate::decode_matmul::holds(l.weight()).then_some(Self::Dense(l.weight()))
            }
            Linear::Quantized(_) => None,
        }
    }

    /// `x · wᵀ` for `rows` rows of `x`, as `Linear::forward` computes it for one position per
    /// sequence.
    fn apply(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        let (out, k) = match self {
            Self::Repacked(q) => q.shape(),
            Self::Dense(w) => w.dims2()?,
        };
        if x.len() != rows * k {
            candle_core::bail!(
                "decode step: {} inputs for {rows} rows against weights ({out}, {k})",
                x.len()
            );
        }
        match self {
            Self::Repacked(q) => Ok(q.matmul(x, rows)),
            Self::Dense(w) => read(w, |w| {
                Ok(crate::decode_matmul::matmul(w, x, (rows, k, out)))
            }),
        }
    }
}

/// A norm of the block: RMSNorm with or without a learned scale.
struct Norm<'a> {
    scale: Option<&'a Tensor>,
    eps: f32,
}

impl<'a> Norm<'a> {
    fn of(norm: &'a RmsNorm) -> Option<Self> {
        let (scale, eps) = norm.parts();
        let on_cpu = |w: &Tensor| w.dtype() == DType::F32 && w.device().is_cpu();
        scale.is_none_or(on_cpu).then_some(Self { scale, eps })
    }

    /// Each `hidden`-wide row of `x` normalised (and scaled), as `RmsNorm::forward` computes it.
    fn apply(&self, x: &[f32], hidden: usize) -> Result<Vec<f32>> {
        let mut out = vec![0f32; x.len()];
        let rows = x.chunks_exact(hidden).zip(out.chunks_exact_mut(hidden));
        match self.scale {
            None => rows.for_each(|(x, y)| crate::fused::rms_norm_row(x, self.eps, y)),
            Some(scale) => read(scale, |w| {
                if w.len() != hidden {
                    candle_core::bail!("decode step: {} scales for {hidden} values", w.len());
                }
                rows.for_each(|(x, y)| crate::fused::scaled_rms_norm_row(x, w, self.eps, y));
                Ok(())
            })?,
        }
        Ok(out)
    }
}

/// Products of the same input whose outputs lie side by side in each row: one stacked matrix,
/// or a checkpoint's separate ones (Llama safetensors' q, k and v; gate and up).
struct SideBySide<'a>(Vec<Product<'a>>);

impl<'a> SideBySide<'a> {
    fn of(parts: &[&'a Linear]) -> Option<Self> {
        parts
            .iter()
            .map(|p| Product::of(p))
            .collect::<Option<_>>()
            .map(Self)
    }

    /// Each row of `x` through every product, the outputs of a row concatenated in order, as
    /// the general path's `cat` of the separate products' outputs.
    fn apply(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        if let [only] = &self.0[..] {
            return only.apply(x, rows);
        }
        let outputs = self
            .0
            .iter()
            .map(|p| p.apply(x, rows))
            .collect::<Result<Vec<_>>>()?;
        let widths: Vec<usize> = outputs.iter().map(|o| o.len() / rows).collect();
        let mut joined = Vec::with_capacity(widths.iter().sum::<usize>() * rows);
        for i in 0..rows {
            for (out, &width) in outputs.iter().zip(&widths) {
                joined.extend_from_slice(&out[i * width..(i + 1) * width]);
            }
        }
        Ok(joined)
    }
}

/// The parts of a block this path runs.
struct Block<'a> {
    input_norm: Norm<'a>,
    /// `[gate | q | k | v]` when `gated`, else `[q | k | v]`.
    input: SideBySide<'a>,
    gated: bool,
    o: Product<'a>,
    post_attention_norm: Norm<'a>,
    /// `[gate | up]`.
    gate_up: SideBySide<'a>,
    down: Product<'a>,
    heads: Heads,
}

impl<'a> Block<'a> {
    fn of(layer: &'a DecoderLayer) -> Option<Self> {
        let attn = &layer.attn;
        let (input, gated) = match &attn.input {
            AttnInput::FusedQkv(input) => (SideBySide::of(&[input])?, false),
            // The gate and q, k, v are one head count wide each (`Attention`'s general path).
            AttnInput::FusedGqkv(input) if attn.num_kv_heads == attn.num_heads => {
                (SideBySide::of(&[input])?, true)
            }
            AttnInput::FusedGqkv(_) => return None,
            AttnInput::Split { q, k, v } => (SideBySide::of(&[q, k, v])?, false),
        };
        let FeedForward::Dense(SwiGlu { gate_up, down }) = &layer.mlp else {
            return None;
        };
        let gate_up = match gate_up {
            GateUp::Fused(both) => SideBySide::of(&[both])?,
            GateUp::Split { gate, up } => SideBySide::of(&[gate, up])?,
        };
        Some(Self {
            input_norm: Norm::of(&layer.input_norm)?,
            input,
            gated,
            o: Product::of(&attn.o_proj)?,
            post_attention_norm: Norm::of(&layer.post_attention_norm)?,
            gate_up,
            down: Product::of(down)?,
            heads: Heads {
                heads: attn.num_heads,
                kv_heads: attn.num_kv_heads,
                head_dim: attn.head_dim,
            },
        })
    }
}

/// `layer`'s output for a decode step, or `None` where the general path must run (module doc).
pub(crate) fn forward(
    layer: &DecoderLayer,
    x: &Tensor,
    batch: &mut ForwardBatch<'_>,
    ctx: &AttnContext<'_>,
    slot: usize,
) -> Result<Option<Tensor>> {
    let applies = x.device().is_cpu()
        && x.dtype() == DType::F32
        && !x.track_op()
        && batch.is_decode_step()
        && !batch.sees_only_its_own_tokens();
    let block = match Block::of(layer) {
        Some(block) if applies => block,
        _ => return Ok(None),
    };
    let (rows, _, hidden) = x.dims3()?;
    let Heads {
        heads,
        kv_heads,
        head_dim: d,
    } = block.heads;
    let gate_width = if block.gated { heads * d } else { 0 };
    let width = gate_width + (heads + 2 * kv_heads) * d;
    let half = d / 2;
    if hidden == 0 || d == 0 || d % 2 != 0 {
        candle_core::bail!("decode step: hidden size {hidden}, head size {d}");
    }

    let mut residual = read(x, |x| Ok(x.to_vec()))?;
    let normed = block.input_norm.apply(&residual, hidden)?;
    let mut projected = block.input.apply(&normed, rows)?;
    if projected.len() != rows * width {
        candle_core::bail!("decode step: the input product does not match the heads");
    }
    read(ctx.cos, |cos| {
        read(ctx.sin, |sin| {
            if cos.len() != rows * half || sin.len() != rows * half {
                candle_core::bail!("decode step: one angle per pair and row expected");
            }
            let mut head = vec![0f32; d];
            for ((row, cos), sin) in projected
                .chunks_exact_mut(width)
                .zip(cos.chunks_exact(half))
                .zip(sin.chunks_exact(half))
            {
                let q_and_k = &mut row[gate_width..gate_width + (heads + kv_heads) * d];
                for rotated in q_and_k.chunks_exact_mut(d) {
                    head.copy_from_slice(rotated);
                    crate::fused::rotate(ctx.rotary.layout(), &head, cos, sin, rotated);
                }
            }
            Ok(())
        })
    })?;
    let mut queries = Vec::with_capacity(rows * heads * d);
    for (i, row) in projected.chunks_exact(width).enumerate() {
        let (q, kv) = row[gate_width..].split_at(heads * d);
        queries.extend_from_slice(q);
        batch.append_position(slot, i, kv.split_at(kv_heads * d), kv_heads)?;
    }
    let scale = (1.0 / (d as f64).sqrt()) as f32;
    let mut attended = batch.attend_cached(slot, &queries, block.heads, scale)?;
    if block.gated {
        // Every path of the gate gives the same bits (`fused/exp.rs`), so a row's gates go at
        // once where the general path takes them head by head.
        for (row, out) in projected
            .chunks_exact(width)
            .zip(attended.chunks_exact_mut(gate_width))
        {
            crate::fused::gate_in_place(&row[..gate_width], out);
        }
    }
    add_to(&mut residual, &block.o.apply(&attended, rows)?)?;

    let normed = block.post_attention_norm.apply(&residual, hidden)?;
    let gate_up = block.gate_up.apply(&normed, rows)?;
    let inner = gate_up.len() / rows / 2;
    if gate_up.len() != rows * 2 * inner {
        candle_core::bail!("decode step: the gate/up product is not two halves per row");
    }
    let mut gated = vec![0f32; rows * inner];
    for (both, out) in gate_up
        .chunks_exact(2 * inner)
        .zip(gated.chunks_exact_mut(inner))
    {
        let (gate, up) = both.split_at(inner);
        crate::fused::swiglu_row(gate, up, out);
    }
    add_to(&mut residual, &block.down.apply(&gated, rows)?)?;
    Tensor::from_vec(residual, (rows, 1, hidden), x.device()).map(Some)
}

/// `residual += update`, the residual add of the general path.
fn add_to(residual: &mut [f32], update: &[f32]) -> Result<()> {
    if residual.len() != update.len() {
        candle_core::bail!(
            "decode step: {} outputs to add to {} hidden values",
            update.len(),
            residual.len()
        );
    }
    for (r, &u) in residual.iter_mut().zip(update) {
        *r += u;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::cache::SeqCache;
    use crate::layers::{Attention, Outputs, RopeLayout, Rotary};

    const HIDDEN: usize = 64;
    const INNER: usize = 96;

    fn quantized(rows: usize, k: usize, format: GgmlDType) -> Linear {
        let w = Tensor::randn(0f32, 0.2, (rows, k), &Device::Cpu).unwrap();
        Linear::quantized(QTensor::quantize(&w, format).unwrap()).unwrap()
    }

    fn dense(rows: usize, k: usize) -> Linear {
        let w = Tensor::randn(0f32, 0.2, (rows, k), &Device::Cpu).unwrap();
        Linear::Dense(candle_nn::Linear::new(w, None))
    }

    fn scaled_norm() -> RmsNorm {
        let w = Tensor::rand(0.5f32, 1.5, HIDDEN, &Device::Cpu).unwrap();
        RmsNorm::new(Some(w), HIDDEN, 1e-5, &Device::Cpu).unwrap()
    }

    /// A dense SwiGLU block from its parts, as the loaders put them together, with
    /// `(heads, kv_heads, head_dim)` as its second argument.
    fn swiglu_block(
        norm: fn() -> RmsNorm,
        (num_heads, num_kv_heads, head_dim): (usize, usize, usize),
        input: AttnInput,
        o_proj: Linear,
        gate_up: GateUp,
        down: Linear,
    ) -> DecoderLayer {
        DecoderLayer {
            input_norm: norm(),
            attn: Attention {
                input,
                o_proj,
                num_heads,
                num_kv_heads,
                head_dim,
            },
            post_attention_norm: norm(),
            mlp: FeedForward::Dense(SwiGlu { gate_up, down }),
        }
    }

    fn unscaled_norm() -> RmsNorm {
        RmsNorm::new(None, HIDDEN, 1e-5, &Device::Cpu).unwrap()
    }

    /// A block as a GGUF's load builds it (grouped KV heads, both formats our kernel holds,
    /// stacked products, scaled norms), with its RoPE layout.
    fn gguf_block() -> (DecoderLayer, RopeLayout) {
        let (heads, kv_heads, d) = (4, 2, 32);
        let block = swiglu_block(
            scaled_norm,
            (heads, kv_heads, d),
            AttnInput::FusedQkv(quantized(
                (heads + 2 * kv_heads) * d,
                HIDDEN,
                GgmlDType::Q4_1,
            )),
            quantized(HIDDEN, heads * d, GgmlDType::Q8_0),
            GateUp::Fused(quantized(2 * INNER, HIDDEN, GgmlDType::Q4_1)),
            quantized(HIDDEN, INNER, GgmlDType::Q4_1),
        );
        (block, RopeLayout::Interleaved)
    }

    /// A block as HRM-Text's load builds it: dense f32 weights, the gated `[gate | q | k | v]`
    /// product, one KV head per query head, norms without a scale.
    fn hrm_text_block() -> (DecoderLayer, RopeLayout) {
        let (heads, d) = (3, 24);
        let block = swiglu_block(
            unscaled_norm,
            (heads, heads, d),
            AttnInput::FusedGqkv(dense(4 * heads * d, HIDDEN)),
            dense(HIDDEN, heads * d),
            GateUp::Fused(dense(2 * INNER, HIDDEN)),
            dense(HIDDEN, INNER),
        );
        (block, RopeLayout::Halves)
    }

    /// A block as a Llama safetensors checkpoint loads: dense f32 weights, separate q, k, v and
    /// separate gate and up products, grouped KV heads, scaled norms.
    fn llama_block() -> (DecoderLayer, RopeLayout) {
        let (heads, kv_heads, d) = (4, 2, 16);
        let block = swiglu_block(
            scaled_norm,
            (heads, kv_heads, d),
            AttnInput::Split {
                q: dense(heads * d, HIDDEN),
                k: dense(kv_heads * d, HIDDEN),
                v: dense(kv_heads * d, HIDDEN),
            },
            dense(HIDDEN, heads * d),
            GateUp::Split {
                gate: dense(INNER, HIDDEN),
                up: dense(INNER, HIDDEN),
            },
            dense(HIDDEN, INNER),
        );
        (block, RopeLayout::Halves)
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        let values: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        values.into_iter().map(f32::to_bits).collect()
    }

    /// `run` on a pass of `tokens` new tokens per row over `caches`, with the pass's angles;
    /// the pass is not committed.
    fn in_pass<R>(
        rotary: &Rotary,
        caches: &mut [SeqCache],
        tokens: &[usize],
        run: impl FnOnce(&mut ForwardBatch<'_>, &AttnContext<'_>) -> R,
    ) -> R {
        let ids: Vec<Vec<u32>> = tokens.iter().map(|&n| vec![1; n]).collect();
        let blocks = vec![0; ids.len()];
        let mut batch = ForwardBatch::new(
            &ids,
            &blocks,
            caches.iter_mut().collect(),
            crate::Logits::All,
            &Device::Cpu,
            DType::F32,
        )
        .unwrap();
        let (cos, sin) = rotary.angles(&batch, DType::F32).unwrap();
        let ctx = AttnContext {
            cos: &cos,
            sin: &sin,
            rotary,
        };
        run(&mut batch, &ctx)
    }

    /// Runs `tokens` (new tokens per row) through `layer` on `caches`, by this module's path
    /// where it applies (`fast`) or by the general one; the output, and whether this module's
    /// path took the pass. The inputs are a fixed pattern of `seed`.
    fn pass(
        layer: &DecoderLayer,
        rotary: &Rotary,
        caches: &mut [SeqCache],
        tokens: &[usize],
        fast: bool,
        seed: f64,
    ) -> (Tensor, bool) {
        in_pass(rotary, caches, tokens, |batch, ctx| {
            let (rows, s) = (batch.batch_size(), batch.seq_len());
            let values: Vec<f32> = (0..rows * s * HIDDEN)
                .map(|i| 2.0 * ((i as f64 * 0.37 + seed).sin() as f32))
                .collect();
            let x = Tensor::from_vec(values, (rows, s, HIDDEN), &Device::Cpu).unwrap();
            let raw = if fast {
                forward(layer, &x, batch, ctx, 0).unwrap()
            } else {
                None
            };
            let took = raw.is_some();
            let out = match raw {
                Some(out) => out,
                None => {
                    layer
                        .forward_by_tensor_ops(&x, batch, ctx, 0, Outputs::All)
                        .unwrap()
                        .0
                }
            };
            batch.commit();
            (out, took)
        })
    }

    /// Decode steps on raw buffers give the general path's hidden states bit for bit, step after
    /// step, so the keys and values they appended (which every later step reads) are its bits
    /// too: for a GGUF's block, HRM-Text's and a Llama checkpoint's, on f16 and f32 caches, for
    /// one row and for several of different lengths, and for a row joining with an empty cache
    /// beside rows that have one.
    #[test]
    fn decode_steps_match_the_general_path_bit_for_bit() {
        let blocks = [
            ("gguf", gguf_block()),
            ("hrm_text", hrm_text_block()),
            ("llama", llama_block()),
        ];
        for (name, (layer, layout)) in blocks {
            let rotary = Rotary::new(layer.attn.head_dim, 10_000.0, layout, &Device::Cpu).unwrap();
            for cache_dtype in [DType::F16, DType::F32] {
                let new_caches =
                    || -> Vec<SeqCache> { (0..3).map(|_| SeqCache::new(1, cache_dtype)).collect() };
                let (mut fast, mut general) = (new_caches(), new_caches());
                // Prompts of 3 and 70 tokens (more than one part of decode attention's cache).
                for caches in [&mut fast, &mut general] {
                    let (_, took) = pass(&layer, &rotary, &mut caches[..2], &[3, 70], true, 0.0);
                    assert!(!took, "a prompt's pass is not a decode step");
                }
                // One row first (the step of a lone request, which the general path runs
                // without a mask), then two; from the third step on, a third row joins with
                // nothing cached.
                for (step, rows) in [1, 2, 3, 3].into_iter().enumerate() {
                    let seed = 1.0 + step as f64;
                    let tokens = vec![1; rows];
                    let (want, _) =
                        pass(&layer, &rotary, &mut general[..rows], &tokens, false, seed);
                    let (got, took) = pass(&layer, &rotary, &mut fast[..rows], &tokens, true, seed);
                    assert!(took, "{name}: step {step} took the general path");
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{name}, {cache_dtype:?} cache, step {step}"
                    );
                }
            }
        }
    }

    /// A block whose weights do not fit the hidden states fails with an error, not a panic.
    #[test]
    fn mismatched_weights_are_an_error() {
        let (mut layer, layout) = hrm_text_block();
        let rotary = Rotary::new(layer.attn.head_dim, 10_000.0, layout, &Device::Cpu).unwrap();
        let mut caches: Vec<SeqCache> = (0..1).map(|_| SeqCache::new(1, DType::F32)).collect();
        pass(&layer, &rotary, &mut caches, &[3], true, 0.0);
        layer.mlp = FeedForward::Dense(SwiGlu {
            gate_up: GateUp::Fused(dense(2 * INNER, HIDDEN / 2)),
            down: dense(HIDDEN, INNER),
        });
        let x = Tensor::ones((1, 1, HIDDEN), DType::F32, &Device::Cpu).unwrap();
        let error = in_pass(&rotary, &mut caches, &[1], |batch, ctx| {
            forward(&layer, &x, batch, ctx, 0).unwrap_err()
        });
        assert!(error.to_string().contains("against weights"), "{error}");

        // A down projection one value short of the hidden size.
        layer.mlp = FeedForward::Dense(SwiGlu {
            gate_up: GateUp::Fused(dense(2 * INNER, HIDDEN)),
            down: dense(HIDDEN - 1, INNER),
        });
        let error = in_pass(&rotary, &mut caches, &[1], |batch, ctx| {
            forward(&layer, &x, batch, ctx, 0).unwrap_err()
        });
        assert!(error.to_string().contains("hidden values"), "{error}");
    }

    /// Blocks this path does not hold, and passes that are not decode steps, go the general way.
    #[test]
    fn other_blocks_and_passes_take_the_general_path() {
        let (mut candle_quantized, layout) = gguf_block();
        let rotary = Rotary::new(32, 10_000.0, layout, &Device::Cpu).unwrap();
        // Q4_0 stays with candle's own quantised matmul.
        if let FeedForward::Dense(mlp) = &mut candle_quantized.mlp {
            mlp.down = quantized(HIDDEN, INNER, GgmlDType::Q4_0);
        }
        let mut caches: Vec<SeqCache> = (0..2).map(|_| SeqCache::new(1, DType::F16)).collect();
        pass(&candle_quantized, &rotary, &mut caches, &[4, 4], true, 0.0);
        let (_, took) = pass(&candle_quantized, &rotary, &mut caches, &[1, 1], true, 0.0);
        assert!(!took, "a down projection in candle's Q4_0");

        let (layer, _) = gguf_block();
        let mut caches: Vec<SeqCache> = (0..2).map(|_| SeqCache::new(1, DType::F16)).collect();
        let (_, took) = pass(&layer, &rotary, &mut caches, &[1, 1], true, 0.0);
        assert!(!took, "one-token prompts, nothing cached");
        let (_, took) = pass(&layer, &rotary, &mut caches, &[2, 2], true, 0.0);
        assert!(!took, "two new tokens per row");
        let (_, took) = pass(&layer, &rotary, &mut caches, &[1, 1], true, 0.0);
        assert!(took, "a decode step");
    }
}
