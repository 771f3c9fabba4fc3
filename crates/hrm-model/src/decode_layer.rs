//! A Llama-family block's decode step on the CPU, on raw buffers from its input norm to its
//! second residual add.
//!
//! At one new position per sequence, each of a block's four products takes a few microseconds,
//! and the general path ([`DecoderLayer::forward`]) runs some twenty tensor ops between them:
//! norms, narrows, copies for reshapes, RoPE, the cache's appends, the residual adds. Each one
//! allocates its output and goes through candle's bookkeeping on the calling thread, while the
//! team's other thread waits for the next product. Here the same arithmetic runs as loops over
//! the block's own buffers, and only the products and attention go to the team.
//!
//! Invariants:
//! - Only decode steps come here: one new position per row, rows with caches, at least one row
//!   with something cached (a step where every row is new takes the prompt's attention op), f32
//!   on the CPU, no gradient. The block must hold what a GGUF's blocks hold on the CPU: weights
//!   repacked for `quant_matmul.rs`, one stacked q/k/v product and one stacked gate/up product,
//!   scaled norms and a dense MLP. Any other pass or block takes the general path.
//! - The same kernels run in the same order as on the general path, so the results are the
//!   same bits: the norm's row ([`crate::fused::scaled_rms_norm_row`]), the products
//!   ([`QuantMatrix::matmul`]), the rotation ([`crate::fused::rotate`]), the cache's rounding,
//!   decode attention ([`ForwardBatch::attend_cached`]) and the gating
//!   ([`crate::fused::swiglu_row`]). The tests compare hidden states and caches bit for bit.

use candle_core::{DType, Result, Tensor};

use crate::cache::ForwardBatch;
use crate::decode_attention::Heads;
use crate::layers::{
    AttnContext, AttnInput, DecoderLayer, FeedForward, GateUp, Linear, RmsNorm, SwiGlu,
};
use crate::quant_matmul::QuantMatrix;

/// The parts of a block this path runs.
struct Block<'a> {
    input_norm: (&'a Tensor, f32),
    qkv: &'a QuantMatrix,
    o: &'a QuantMatrix,
    post_attention_norm: (&'a Tensor, f32),
    gate_up: &'a QuantMatrix,
    down: &'a QuantMatrix,
    heads: Heads,
}

impl<'a> Block<'a> {
    fn of(layer: &'a DecoderLayer) -> Option<Self> {
        let repacked = |linear: &'a Linear| match linear {
            Linear::Repacked(q) => Some(&**q),
            _ => None,
        };
        let scaled = |norm: &'a RmsNorm| {
            norm.scale_and_eps()
                .filter(|(w, _)| w.dtype() == DType::F32 && w.device().is_cpu())
        };
        let AttnInput::FusedQkv(qkv) = &layer.attn.input else {
            return None;
        };
        let FeedForward::Dense(SwiGlu {
            gate_up: GateUp::Fused(gate_up),
            down,
        }) = &layer.mlp
        else {
            return None;
        };
        Some(Self {
            input_norm: scaled(&layer.input_norm)?,
            qkv: repacked(qkv)?,
            o: repacked(&layer.attn.o_proj)?,
            post_attention_norm: scaled(&layer.post_attention_norm)?,
            gate_up: repacked(gate_up)?,
            down: repacked(down)?,
            heads: Heads {
                heads: layer.attn.num_heads,
                kv_heads: layer.attn.num_kv_heads,
                head_dim: layer.attn.head_dim,
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
    let width = (heads + 2 * kv_heads) * d;
    let half = d / 2;

    let mut residual = read(x, |x| Ok(x.to_vec()))?;
    let normed = norm_rows(&residual, hidden, block.input_norm)?;
    let mut qkv = block.qkv.matmul(&normed, rows);
    if qkv.len() != rows * width || d % 2 != 0 {
        candle_core::bail!("decode step: the q/k/v product does not match the heads");
    }
    read(ctx.cos, |cos| {
        read(ctx.sin, |sin| {
            if cos.len() != rows * half || sin.len() != rows * half {
                candle_core::bail!("decode step: one angle per pair and row expected");
            }
            let mut head = vec![0f32; d];
            for ((row, cos), sin) in qkv
                .chunks_exact_mut(width)
                .zip(cos.chunks_exact(half))
                .zip(sin.chunks_exact(half))
            {
                for rotated in row[..(heads + kv_heads) * d].chunks_exact_mut(d) {
                    head.copy_from_slice(rotated);
                    crate::fused::rotate(ctx.rotary.layout(), &head, cos, sin, rotated);
                }
            }
            Ok(())
        })
    })?;
    let mut queries = Vec::with_capacity(rows * heads * d);
    for (i, row) in qkv.chunks_exact(width).enumerate() {
        let (q, kv) = row.split_at(heads * d);
        queries.extend_from_slice(q);
        batch.append_position(slot, i, kv.split_at(kv_heads * d), kv_heads)?;
    }
    let scale = (1.0 / (d as f64).sqrt()) as f32;
    let attended = batch.attend_cached(slot, &queries, block.heads, scale)?;
    add_to(&mut residual, &block.o.matmul(&attended, rows));

    let normed = norm_rows(&residual, hidden, block.post_attention_norm)?;
    let gate_up = block.gate_up.matmul(&normed, rows);
    let inner = gate_up.len() / rows / 2;
    let mut gated = vec![0f32; rows * inner];
    for (both, out) in gate_up
        .chunks_exact(2 * inner)
        .zip(gated.chunks_exact_mut(inner))
    {
        let (gate, up) = both.split_at(inner);
        crate::fused::swiglu_row(gate, up, out);
    }
    add_to(&mut residual, &block.down.matmul(&gated, rows));
    Tensor::from_vec(residual, (rows, 1, hidden), x.device()).map(Some)
}

/// `f` on the contiguous f32 values of a CPU tensor.
fn read<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    f(crate::fused::values(
        crate::fused::cpu_storage(&storage)?,
        layout,
    )?)
}

/// Each `hidden`-wide row of `x` normalised and scaled (`ScaledRmsNormOp`'s arithmetic).
fn norm_rows(x: &[f32], hidden: usize, (scale, eps): (&Tensor, f32)) -> Result<Vec<f32>> {
    read(scale, |w| {
        if w.len() != hidden {
            candle_core::bail!(
                "decode step: a norm of {} scales for {hidden} values",
                w.len()
            );
        }
        let mut out = vec![0f32; x.len()];
        for (x, y) in x.chunks_exact(hidden).zip(out.chunks_exact_mut(hidden)) {
            crate::fused::scaled_rms_norm_row(x, w, eps, y);
        }
        Ok(out)
    })
}

/// `residual += update`, the residual add of the general path.
fn add_to(residual: &mut [f32], update: &[f32]) {
    for (r, &u) in residual.iter_mut().zip(update) {
        *r += u;
    }
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
    const HEADS: usize = 4;
    const KV_HEADS: usize = 2;
    const HEAD_DIM: usize = 32;

    fn quantized(rows: usize, k: usize, format: GgmlDType) -> Linear {
        let w = Tensor::randn(0f32, 0.2, (rows, k), &Device::Cpu).unwrap();
        Linear::quantized(QTensor::quantize(&w, format).unwrap()).unwrap()
    }

    fn norm() -> RmsNorm {
        let w = Tensor::rand(0.5f32, 1.5, HIDDEN, &Device::Cpu).unwrap();
        RmsNorm::new(Some(w), HIDDEN, 1e-5, &Device::Cpu).unwrap()
    }

    /// A block as a GGUF's load builds it: both formats our kernels hold, stacked products.
    fn gguf_block() -> DecoderLayer {
        DecoderLayer {
            input_norm: norm(),
            attn: Attention {
                input: AttnInput::FusedQkv(quantized(
                    (HEADS + 2 * KV_HEADS) * HEAD_DIM,
                    HIDDEN,
                    GgmlDType::Q4_1,
                )),
                o_proj: quantized(HIDDEN, HEADS * HEAD_DIM, GgmlDType::Q8_0),
                num_heads: HEADS,
                num_kv_heads: KV_HEADS,
                head_dim: HEAD_DIM,
            },
            post_attention_norm: norm(),
            mlp: FeedForward::Dense(SwiGlu {
                gate_up: GateUp::Fused(quantized(2 * INNER, HIDDEN, GgmlDType::Q4_1)),
                down: quantized(HIDDEN, INNER, GgmlDType::Q4_1),
            }),
        }
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        let values: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        values.into_iter().map(f32::to_bits).collect()
    }

    /// Runs `tokens` (new tokens per row) through `layer` on `caches`, by this module's path
    /// (`fast`) or the general one; the output, and whether this module's path took the pass.
    fn pass(
        layer: &DecoderLayer,
        rotary: &Rotary,
        caches: &mut [SeqCache],
        tokens: &[usize],
        fast: bool,
        seed: f64,
    ) -> (Tensor, bool) {
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
        let s = batch.seq_len();
        // The same inputs for both paths: a fixed pattern of the seed.
        let values: Vec<f32> = (0..ids.len() * s * HIDDEN)
            .map(|i| 2.0 * ((i as f64 * 0.37 + seed).sin() as f32))
            .collect();
        let x = Tensor::from_vec(values, (ids.len(), s, HIDDEN), &Device::Cpu).unwrap();
        let (out, took) = if fast {
            match forward(layer, &x, &mut batch, &ctx, 0).unwrap() {
                Some(out) => (out, true),
                None => (
                    layer
                        .forward_by_tensor_ops(&x, &mut batch, &ctx, 0, Outputs::All)
                        .unwrap()
                        .0,
                    false,
                ),
            }
        } else {
            let out = layer
                .forward_by_tensor_ops(&x, &mut batch, &ctx, 0, Outputs::All)
                .unwrap()
                .0;
            (out, false)
        };
        batch.commit();
        (out, took)
    }

    /// Decode steps on raw buffers give the general path's hidden states bit for bit, step after
    /// step, so the keys and values they appended (which every later step reads) are its bits
    /// too: on f16 and f32 caches, for rows of different lengths, and for a row joining with an
    /// empty cache beside rows that have one.
    #[test]
    fn decode_steps_match_the_general_path_bit_for_bit() {
        let layer = gguf_block();
        for cache_dtype in [DType::F16, DType::F32] {
            for layout in [RopeLayout::Interleaved, RopeLayout::Halves] {
                let rotary = Rotary::new(HEAD_DIM, 10_000.0, layout, &Device::Cpu).unwrap();
                let new_caches =
                    || -> Vec<SeqCache> { (0..3).map(|_| SeqCache::new(1, cache_dtype)).collect() };
                let (mut fast, mut general) = (new_caches(), new_caches());
                // Prompts of 3 and 70 tokens (more than one part of decode attention's cache).
                for caches in [&mut fast, &mut general] {
                    let (_, took) = pass(&layer, &rotary, &mut caches[..2], &[3, 70], true, 0.0);
                    assert!(!took, "a prompt's pass is not a decode step");
                }
                for step in 0..4 {
                    let seed = 1.0 + step as f64;
                    // From the third step on, a third row joins with nothing cached.
                    let rows = if step < 2 { 2 } else { 3 };
                    let tokens = vec![1; rows];
                    let (want, _) =
                        pass(&layer, &rotary, &mut general[..rows], &tokens, false, seed);
                    let (got, took) = pass(&layer, &rotary, &mut fast[..rows], &tokens, true, seed);
                    assert!(took, "step {step} took the general path");
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{cache_dtype:?} cache, {layout:?}, step {step}"
                    );
                }
            }
        }
    }

    /// Blocks this path does not hold, and passes that are not decode steps, go the general way.
    #[test]
    fn other_blocks_and_passes_take_the_general_path() {
        let rotary =
            Rotary::new(HEAD_DIM, 10_000.0, RopeLayout::Interleaved, &Device::Cpu).unwrap();
        let mut dense = gguf_block();
        let w = Tensor::randn(0f32, 0.2, (HIDDEN, INNER), &Device::Cpu).unwrap();
        if let FeedForward::Dense(mlp) = &mut dense.mlp {
            mlp.down = Linear::Dense(candle_nn::Linear::new(w, None));
        }
        let mut caches: Vec<SeqCache> = (0..2).map(|_| SeqCache::new(1, DType::F16)).collect();
        pass(&dense, &rotary, &mut caches, &[4, 4], true, 0.0);
        let (_, took) = pass(&dense, &rotary, &mut caches, &[1, 1], true, 0.0);
        assert!(!took, "a dense down projection");

        let layer = gguf_block();
        let mut caches: Vec<SeqCache> = (0..2).map(|_| SeqCache::new(1, DType::F16)).collect();
        let (_, took) = pass(&layer, &rotary, &mut caches, &[1, 1], true, 0.0);
        assert!(!took, "one-token prompts, nothing cached");
        let (_, took) = pass(&layer, &rotary, &mut caches, &[2, 2], true, 0.0);
        assert!(!took, "two new tokens per row");
        let (_, took) = pass(&layer, &rotary, &mut caches, &[1, 1], true, 0.0);
        assert!(took, "a decode step");
    }
}
