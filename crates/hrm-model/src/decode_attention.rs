//! Attention of a decode step on the CPU, read in place from each sequence's KV cache.
//!
//! The general path (`layers::Attention`) stacks every sequence's cached keys and values into
//! one left-padded batch tensor per attention slot, repeats them for grouped-query heads, and
//! runs two batched products and a masked softmax: each decode step copies every sequence's
//! whole cache, once per query head sharing a KV head. In a decode step each sequence has one
//! new token, which sees every cached token of its own sequence and nothing else, so no mask is
//! needed: here each (sequence, head) pair reads its cache buffers where they lie.
//!
//! Invariants:
//! - Only decode steps (one new position per sequence, with caches) in f32 on the CPU with no
//!   gradient come here ([`crate::cache::ForwardBatch::decode_attention`] decides).
//! - Each (sequence, head) pair is computed on its own in a fixed order, so a sequence's output
//!   does not depend on the batch around it.
//! - Scores and the probability-weighted sum of values use the decode products' vector kernels
//!   ([`crate::decode_matmul::Kernel`]), and the softmax is the prefill's
//!   ([`crate::fused::softmax_in_place`]); the result agrees with the general path within f32
//!   rounding, not bit for bit (tests).

use crate::decode_matmul::{Kernel, Read};

/// One sequence's cached keys and values for one attention slot: `[kv_heads, capacity,
/// head_dim]` buffers, of which the first `len` positions of each head are filled.
pub(crate) struct CacheView<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub capacity: usize,
    pub len: usize,
}

/// The shape of one decode step's attention.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// `softmax(q · kᵀ · scale) · v` for each sequence and head. `q` is `[sequences, heads,
/// head_dim]`; the result has the same layout.
pub(crate) fn attend(q: &[f32], caches: &[CacheView<'_>], shape: Heads, scale: f32) -> Vec<f32> {
    let Heads {
        heads,
        kv_heads,
        head_dim: d,
    } = shape;
    assert!(
        kv_heads > 0 && heads % kv_heads == 0,
        "heads {heads} over kv heads {kv_heads}"
    );
    assert_eq!(
        q.len(),
        caches.len() * heads * d,
        "decode attention: query length"
    );
    for cache in caches {
        assert!(
            cache.len > 0 && cache.len <= cache.capacity,
            "decode attention: cache length"
        );
        assert_eq!(cache.keys.len(), kv_heads * cache.capacity * d);
        assert_eq!(cache.values.len(), kv_heads * cache.capacity * d);
    }
    let kernel = Kernel::detect();
    let mut out = vec![0f32; caches.len() * heads * d];
    crate::team::chunks_in_parallel(&mut out, d, |item, out| {
        let (sequence, head) = (item / heads, item % heads);
        let cache = &caches[sequence];
        let kv_head = head / (heads / kv_heads);
        let span = kv_head * cache.capacity * d..(kv_head * cache.capacity + cache.len) * d;
        let q = &q[item * d..(item + 1) * d];
        attend_one(
            kernel,
            q,
            &cache.keys[span.clone()],
            &cache.values[span],
            scale,
            out,
        );
    });
    out
}

/// One query against `keys` and `values` of `len × d`, into `out` (`d`).
fn attend_one(
    kernel: Kernel,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    scale: f32,
    out: &mut [f32],
) {
    let d = q.len();
    let mut scores = vec![0f32; keys.len() / d.max(1)];
    let rows: Vec<&[f32]> = keys.chunks_exact(d).collect();
    let tile = kernel.row_tile();
    for (rows, scores) in rows.chunks(tile).zip(scores.chunks_mut(tile)) {
        kernel.dots(q, Read::Cached, rows, scores);
    }
    scores.iter_mut().for_each(|s| *s *= scale);
    crate::fused::softmax_in_place(&mut scores);
    kernel.weighted_rows(&scores, values, out);
}

#[cfg(test)]
mod tests {
    use candle_core::{D, Device, Tensor};

    use super::*;

    fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 23) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    /// Against candle's composed attention (repeated KV heads, matmul, softmax, matmul) over
    /// each sequence's filled positions only, with buffers larger than their contents.
    #[test]
    fn agrees_with_the_composed_form() {
        let shape = Heads {
            heads: 6,
            kv_heads: 2,
            head_dim: 40,
        };
        let (h, g, d) = (shape.heads, shape.kv_heads, shape.head_dim);
        let lens = [1usize, 7, 64, 130];
        let capacity = 160;
        let buffers: Vec<(Vec<f32>, Vec<f32>)> = (0..lens.len())
            .map(|i| {
                (
                    random(g * capacity * d, 2 * i as u64 + 1),
                    random(g * capacity * d, 2 * i as u64 + 2),
                )
            })
            .collect();
        let caches: Vec<CacheView> = buffers
            .iter()
            .zip(lens)
            .map(|((keys, values), len)| CacheView {
                keys,
                values,
                capacity,
                len,
            })
            .collect();
        let q = random(lens.len() * h * d, 99);
        let scale = 1.0 / (d as f32).sqrt();
        let ours = attend(&q, &caches, shape, scale);
        for (i, cache) in caches.iter().enumerate() {
            let filled = |buffer: &[f32]| {
                Tensor::from_vec(buffer.to_vec(), (g, capacity, d), &Device::Cpu)
                    .unwrap()
                    .narrow(1, 0, cache.len)
                    .unwrap()
                    .unsqueeze(1)
                    .unwrap()
                    .broadcast_as((g, h / g, cache.len, d))
                    .unwrap()
                    .reshape((h, cache.len, d))
                    .unwrap()
            };
            let (k, v) = (filled(cache.keys), filled(cache.values));
            let qi = Tensor::from_vec(
                q[i * h * d..(i + 1) * h * d].to_vec(),
                (h, 1, d),
                &Device::Cpu,
            )
            .unwrap();
            let scores = (qi.matmul(&k.t().unwrap()).unwrap() * f64::from(scale)).unwrap();
            let probs = candle_nn::ops::softmax(&scores, D::Minus1).unwrap();
            let expected: Vec<f32> = probs
                .matmul(&v)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            for (e, (a, b)) in ours[i * h * d..(i + 1) * h * d]
                .iter()
                .zip(&expected)
                .enumerate()
            {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "sequence {i} (len {}) element {e}: {a} vs {b}",
                    cache.len
                );
            }
        }
        // Alone, a sequence gets the same bits as in the batch.
        let alone = attend(&q[3 * h * d..], &caches[3..], shape, scale);
        assert_eq!(alone, ours[3 * h * d..]);
    }
}
