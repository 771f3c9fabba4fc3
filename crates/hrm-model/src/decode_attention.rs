//! Attention of a decode step on the CPU, read in place from each sequence's KV cache.
//!
//! The general path (`layers::Attention`) stacks every sequence's cached keys and values into
//! one left-padded batch tensor per attention slot, repeats them for grouped-query heads, and
//! runs two batched products and a masked softmax: each decode step copies every sequence's
//! whole cache, once per query head sharing a KV head. In a decode step each sequence has one
//! new token, which sees every cached token of its own sequence and nothing else, so no mask is
//! needed: here every sequence's cache buffers are read where they lie.
//!
//! Invariants:
//! - Only decode steps (one new position per sequence, with caches) in f32 on the CPU with no
//!   gradient come here ([`crate::cache::ForwardBatch::decode_attention`] decides).
//! - A unit of work is one sequence's KV head over one part of its cached positions (parts of
//!   [`PART`] positions from the first): all the query heads that share the KV head read each
//!   key and value row of the part while it is in cache, and the parts of a long cache spread
//!   over the threads even at batch 1. Each part keeps its softmax unnormalised with its own
//!   maximum; the parts are merged after. Where the parts fall depends on the sequence's own
//!   length only, so its output does not depend on the batch around it or on the thread count.
//! - Scores are summed a tile of keys at a time, one key per vector lane ([`key_scores`]), on
//!   the instruction set the decode products chose ([`crate::decode_matmul::Kernel`]), whose
//!   kernels take the keys after the last whole tile and the probability-weighted sum of
//!   values; the exponentials are the prefill softmax's ([`crate::fused::exp_from_max`]). The
//!   result agrees with the general path within f32 rounding, not bit for bit, and a sequence's
//!   scores still depend only on its own length (tests).
//! - An f16 cache (a GGUF model's) is read as it lies and widened to f32 one part at a time,
//!   exactly (every f16 is an f32), into the thread's own buffer ([`widen`]): the kernels above
//!   then run on the same values as over an f32 cache holding the rounded keys and values, bit
//!   for bit (test), having read half the bytes.

use std::cell::RefCell;
use std::ops::Range;

use half::f16;

use crate::decode_matmul::{Kernel, ROW_TILE, Read};
use crate::fused::prefetch;

/// Cached positions per unit of work. A part's keys, or its values, at a head size of 64 fill
/// 16 KiB, half of a core's level-1 data cache, where they stay for every query head of the
/// group.
const PART: usize = 64;

/// One sequence's cached keys and values for one attention slot: `[kv_heads, capacity,
/// head_dim]` buffers, of which the first `len` positions of each head are filled.
pub(crate) struct CacheView<'a> {
    pub buffers: Buffers<'a>,
    pub capacity: usize,
    pub len: usize,
}

/// A slot's key and value buffers, in the dtype the cache stores.
#[derive(Clone, Copy)]
pub(crate) enum Buffers<'a> {
    F32 { keys: &'a [f32], values: &'a [f32] },
    F16 { keys: &'a [f16], values: &'a [f16] },
}

impl Buffers<'_> {
    fn len(&self) -> (usize, usize) {
        match self {
            Self::F32 { keys, values } => (keys.len(), values.len()),
            Self::F16 { keys, values } => (keys.len(), values.len()),
        }
    }
}

thread_local! {
    /// One part's keys and values widened from an f16 cache, reused by every part this thread
    /// takes.
    static WIDENED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
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
        d > 0 && kv_heads > 0 && heads % kv_heads == 0,
        "heads {heads} of size {d} over kv heads {kv_heads}"
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
        let filled = kv_heads * cache.capacity * d;
        assert_eq!(
            cache.buffers.len(),
            (filled, filled),
            "decode attention: buffers"
        );
    }
    let group = heads / kv_heads;
    // (sequence, KV head, positions), in that order, so a group's parts are neighbours.
    let units: Vec<(usize, usize, Range<usize>)> = caches
        .iter()
        .enumerate()
        .flat_map(|(sequence, cache)| {
            (0..kv_heads).flat_map(move |kv_head| {
                (0..cache.len)
                    .step_by(PART)
                    .map(move |start| (sequence, kv_head, start..(start + PART).min(cache.len)))
            })
        })
        .collect();
    // Per unit and query head of its group: the part's maximum score, the sum of its
    // exponentials, and their weighted sum of values.
    let stride = d + 2;
    let mut partials = vec![0f32; units.len() * group * stride];
    let kernel = Kernel::detect();
    crate::team::chunks_in_parallel(&mut partials, group * stride, |unit, partial| {
        let (sequence, kv_head, ref positions) = units[unit];
        let cache = &caches[sequence];
        let first = kv_head * cache.capacity;
        let rows = (first + positions.start) * d..(first + positions.end) * d;
        let queries = &q[(sequence * heads + kv_head * group) * d..][..group * d];
        match cache.buffers {
            Buffers::F32 { keys, values } => attend_part(
                kernel,
                d,
                queries,
                (&keys[rows.clone()], &values[rows]),
                Values::InMemory,
                scale,
                partial,
            ),
            Buffers::F16 { keys, values } => WIDENED.with_borrow_mut(|widened| {
                let n = rows.len();
                widened.resize(2 * n, 0.0);
                let (wide_keys, wide_values) = widened.split_at_mut(n);
                widen(kernel, &keys[rows.clone()], wide_keys);
                widen(kernel, &values[rows], wide_values);
                attend_part(
                    kernel,
                    d,
                    queries,
                    (wide_keys, wide_values),
                    Values::Cached,
                    scale,
                    partial,
                );
            }),
        }
    });
    let mut out = vec![0f32; caches.len() * heads * d];
    // A group's parts are neighbours in `partials`, in the order `units` lists them.
    let mut rest = partials.as_slice();
    for (cache, out) in caches.iter().zip(out.chunks_exact_mut(heads * d)) {
        let parts = cache.len.div_ceil(PART);
        for out in out.chunks_exact_mut(group * d) {
            let (group_partials, tail) = rest.split_at(parts * group * stride);
            rest = tail;
            for (head, out) in out.chunks_exact_mut(d).enumerate() {
                let head_partials = group_partials
                    .chunks_exact(group * stride)
                    .map(|p| &p[head * stride..(head + 1) * stride]);
                merge(head_partials, out);
            }
        }
    }
    out
}

/// Where a part's values lie when [`attend_part`] starts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Values {
    /// In the cache's own buffer, likely still in memory: asked for while the keys are scored.
    InMemory,
    /// Just widened into the thread's buffer, so already in the core's cache.
    Cached,
}

/// For each query of `queries` (`group × d`, `d > 0`) against one part's `keys` and `values`
/// (`n × d`, `n ≤ PART`): `[max score, Σ exp(score − max), Σ exp(score − max) · value]`, into
/// `partial` (`group × (d + 2)`).
fn attend_part(
    kernel: Kernel,
    d: usize,
    queries: &[f32],
    (keys, values): (&[f32], &[f32]),
    lying: Values,
    scale: f32,
    partial: &mut [f32],
) {
    let n = keys.len() / d;
    let mut score_store = [0f32; PART];
    let scores = &mut score_store[..n];
    for (head, (q, partial)) in queries
        .chunks_exact(d)
        .zip(partial.chunks_exact_mut(d + 2))
        .enumerate()
    {
        let chunks = keys
            .chunks(KEY_TILE_AVX512 * d)
            .zip(scores.chunks_mut(KEY_TILE_AVX512));
        for (c, (keys, scores)) in chunks.enumerate() {
            if head == 0 && lying == Values::InMemory {
                // The values these keys' scores will weight, asked for while the first query
                // scores them: their misses overlap the keys' instead of following them (asking
                // for the whole part's at once stalled on the misses it had asked for).
                prefetch(&values[c * KEY_TILE_AVX512 * d..][..scores.len() * d]);
            }
            key_scores(kernel, q, keys, scores);
        }
        scores.iter_mut().for_each(|s| *s *= scale);
        let (max, total) = crate::fused::exp_from_max(scores);
        let (stats, acc) = partial.split_at_mut(2);
        stats.copy_from_slice(&[max, total]);
        kernel.weighted_rows(scores, values, acc);
    }
}

/// `scores[j] = q · keys[j]` for the `scores.len()` rows of `keys` (at most a part's), each as
/// long as `q`.
///
/// A head's query is short (64 values in our models), so summing each key's products across a
/// vector's lanes one key at a time cost as much as the products. The vector kernels instead
/// sum a tile of keys together, one key per lane of the result ([`KEY_TILE_AVX512`] keys on
/// AVX-512, [`KEY_TILE_AVX2`] on AVX2), when `q` fills whole vectors; the keys after the last
/// whole tile, and other widths, take the decode products' [`Kernel::dots`]. Each kernel sums
/// in its own order, so scores agree across kernels within f32 rounding (tests).
fn key_scores(kernel: Kernel, q: &[f32], keys: &[f32], scores: &mut [f32]) {
    let d = q.len();
    assert_eq!(keys.len(), scores.len() * d, "key scores: lengths");
    assert!(scores.len() <= PART, "key scores: more keys than a part");
    let tiled = match tile_kernel(kernel, d) {
        Some((tile, score_tile)) => {
            for (t, out) in scores.chunks_exact_mut(tile).enumerate() {
                // SAFETY: `tile_kernel` names a kernel whose features `detect` found, for a `q`
                // that fills whole vectors; each call gets a whole tile of keys as long as `q`.
                unsafe { score_tile(q, &keys[t * tile * d..][..tile * d], out) };
            }
            scores.len() / tile * tile
        }
        None => 0,
    };
    // The rows of one call at a time: a part's worth of empty rows, set up for every query
    // head whether or not any key was left over, took two thirds of the own samples of
    // `attend_part` (where this function is inlined) in a GGUF decode on a Zen 4 AMD EPYC.
    for (t, out) in scores[tiled..].chunks_mut(kernel.row_tile()).enumerate() {
        let first = tiled + t * kernel.row_tile();
        let mut rows: [&[f32]; ROW_TILE] = [&[]; ROW_TILE];
        for (i, row) in rows[..out.len()].iter_mut().enumerate() {
            *row = &keys[(first + i) * d..][..d];
        }
        kernel.dots(q, Read::Cached, &rows[..out.len()], out);
    }
}

/// One tile's scores: `(q, keys, out)` as [`wide::key_tile`] and [`narrow::key_tile`] take them.
type TileScores = unsafe fn(&[f32], &[f32], &mut [f32]);

/// The keys per tile and the tile kernel of `kernel` for queries of `d` values, where one
/// applies (`q` must fill whole vectors).
fn tile_kernel(kernel: Kernel, d: usize) -> Option<(usize, TileScores)> {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 if d.is_multiple_of(16) => Some((KEY_TILE_AVX512, wide::key_tile)),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 if d.is_multiple_of(8) => Some((KEY_TILE_AVX2, narrow::key_tile)),
        _ => None,
    }
}

/// Keys scored together by the AVX-512 kernel: one per lane.
const KEY_TILE_AVX512: usize = 16;
/// Keys scored together by the AVX2 kernel: one per lane.
const KEY_TILE_AVX2: usize = 8;

/// [`key_scores`] for one tile of sixteen keys in AVX-512.
#[cfg(target_arch = "x86_64")]
mod wide {
    use std::arch::x86_64::*;

    use super::KEY_TILE_AVX512 as TILE;

    /// # Safety
    /// The CPU has AVX-512F; `keys` holds sixteen rows as long as `q`, a multiple of 16.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn key_tile(q: &[f32], keys: &[f32], out: &mut [f32]) {
        let d = q.len();
        debug_assert!(d.is_multiple_of(16) && keys.len() == TILE * d && out.len() == TILE);
        let mut acc = [_mm512_setzero_ps(); TILE];
        for c in (0..d).step_by(16) {
            // SAFETY: c + 16 <= d, the length of `q` and of every key row.
            let qv = unsafe { _mm512_loadu_ps(q.as_ptr().add(c)) };
            for (j, acc) in acc.iter_mut().enumerate() {
                let k = unsafe { _mm512_loadu_ps(keys.as_ptr().add(j * d + c)) };
                *acc = _mm512_fmadd_ps(qv, k, *acc);
            }
        }
        // Sixteen registers to one, halving the lanes each key spreads over at every step:
        // neighbours' 32-bit lanes, then 64-bit pairs, then 128-bit quarters twice; the
        // result holds key j's sum in lane j.
        let pairs: [__m512; 8] = std::array::from_fn(|i| {
            let (a, b) = (acc[2 * i], acc[2 * i + 1]);
            _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
        });
        let quads: [__m512; 4] = std::array::from_fn(|i| {
            let (a, b) = (
                _mm512_castps_pd(pairs[2 * i]),
                _mm512_castps_pd(pairs[2 * i + 1]),
            );
            _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
            )
        });
        let fold = |a: __m512, b: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            )
        };
        let sums = fold(fold(quads[0], quads[1]), fold(quads[2], quads[3]));
        // SAFETY: `out` holds sixteen values.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), sums) };
    }
}

/// [`key_scores`] for one tile of eight keys in AVX2.
#[cfg(target_arch = "x86_64")]
mod narrow {
    use std::arch::x86_64::*;

    use super::KEY_TILE_AVX2 as TILE;

    /// # Safety
    /// The CPU has AVX2 and FMA; `keys` holds eight rows as long as `q`, a multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn key_tile(q: &[f32], keys: &[f32], out: &mut [f32]) {
        let d = q.len();
        debug_assert!(d.is_multiple_of(8) && keys.len() == TILE * d && out.len() == TILE);
        let mut acc = [_mm256_setzero_ps(); TILE];
        for c in (0..d).step_by(8) {
            // SAFETY: c + 8 <= d, the length of `q` and of every key row.
            let qv = unsafe { _mm256_loadu_ps(q.as_ptr().add(c)) };
            for (j, acc) in acc.iter_mut().enumerate() {
                let k = unsafe { _mm256_loadu_ps(keys.as_ptr().add(j * d + c)) };
                *acc = _mm256_fmadd_ps(qv, k, *acc);
            }
        }
        // Pairwise horizontal adds, twice, leave keys 0-3 in `low` (in lane j of each 128-bit
        // half, key j's sum over that half's lanes) and keys 4-7 in `high`; adding the halves
        // ends it.
        let h = |a, b| _mm256_hadd_ps(a, b);
        let low = h(h(acc[0], acc[1]), h(acc[2], acc[3]));
        let high = h(h(acc[4], acc[5]), h(acc[6], acc[7]));
        let sums = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(low, high),
            _mm256_permute2f128_ps::<0x31>(low, high),
        );
        // SAFETY: `out` holds eight values.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sums) };
    }
}

/// `dst[i] = src[i]` in f32 (exact), asking for the source
/// [`crate::decode_matmul::PREFETCH_AHEAD`] bytes ahead as it goes. A part's keys, and its values,
/// lie just before the next part's of the same head, which the same thread usually widens next.
/// Left to the hardware prefetcher, widening took about four times as long per byte as the
/// weights' kernel takes to stream its own, and a long decode gained nothing from the halved
/// bytes (a profile on a Zen 4 AMD EPYC).
fn widen(kernel: Kernel, src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen: lengths");
    let done = match kernel {
        // SAFETY: `detect` found AVX-512F for this kernel; F16C is checked here.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { halves::widen_avx512(src, dst) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 if is_x86_feature_detected!("f16c") => unsafe { halves::widen_f16c(src, dst) },
        _ => 0,
    };
    for (d, s) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = s.to_f32();
    }
}

/// [`widen`]'s vector paths: each widens whole vectors and returns how many values it did.
#[cfg(target_arch = "x86_64")]
mod halves {
    use std::arch::x86_64::*;

    use half::f16;

    use crate::decode_matmul::PREFETCH_AHEAD;

    /// Values per cache line of f16.
    const LINE: usize = 32;

    /// # Safety
    /// The CPU has AVX-512F; `dst` is as long as `src`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_avx512(src: &[f16], dst: &mut [f32]) -> usize {
        let whole = src.len() / 16 * 16;
        for i in (0..whole).step_by(16) {
            let from = src.as_ptr().wrapping_add(i);
            if i.is_multiple_of(LINE) {
                // A hint that never faults; `wrapping_add` keeps the address arithmetic defined.
                _mm_prefetch::<_MM_HINT_T0>(from.cast::<i8>().wrapping_add(PREFETCH_AHEAD));
            }
            // SAFETY: i + 16 <= src.len() == dst.len().
            unsafe {
                let halves = _mm256_loadu_si256(from.cast());
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(halves));
            }
        }
        whole
    }

    /// # Safety
    /// The CPU has AVX2 and F16C; `dst` is as long as `src`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn widen_f16c(src: &[f16], dst: &mut [f32]) -> usize {
        let whole = src.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            let from = src.as_ptr().wrapping_add(i);
            if i.is_multiple_of(LINE) {
                _mm_prefetch::<_MM_HINT_T0>(from.cast::<i8>().wrapping_add(PREFETCH_AHEAD));
            }
            // SAFETY: i + 8 <= src.len() == dst.len().
            unsafe {
                let halves = _mm_loadu_si128(from.cast());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(halves));
            }
        }
        whole
    }
}

/// One head's output from its parts' `[max, total, weighted sum]`: each part rescaled to the
/// largest maximum, the weighted sums added and divided by the totals' sum.
fn merge<'a>(parts: impl Iterator<Item = &'a [f32]> + Clone, out: &mut [f32]) {
    let max = parts
        .clone()
        .map(|p| p[0])
        .fold(f32::NEG_INFINITY, f32::max);
    out.fill(0.0);
    let mut total = 0f32;
    for part in parts {
        let weight = (part[0] - max).exp();
        total += weight * part[1];
        for (o, v) in out.iter_mut().zip(&part[2..]) {
            *o += weight * v;
        }
    }
    for o in out.iter_mut() {
        *o /= total;
    }
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

    /// Every kernel this CPU has scores keys as the exact dot products do, within f32
    /// rounding: whole tiles and the keys after them, and widths that fill whole vectors of
    /// either kind or neither.
    #[test]
    fn key_scores_are_the_dot_products_on_every_kernel() {
        for kernel in Kernel::supported() {
            for d in [8usize, 16, 24, 40, 64, 128] {
                for n in [1usize, 7, 8, 9, 15, 16, 17, 33, 64] {
                    let q = random(d, d as u64);
                    let keys = random(n * d, (n * 1000 + d) as u64);
                    let mut scores = vec![f32::NAN; n];
                    key_scores(kernel, &q, &keys, &mut scores);
                    for (j, (score, key)) in scores.iter().zip(keys.chunks_exact(d)).enumerate() {
                        let exact: f64 = q
                            .iter()
                            .zip(key)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum();
                        let bound: f64 = q
                            .iter()
                            .zip(key)
                            .map(|(a, b)| f64::from((a * b).abs()))
                            .sum();
                        assert!(
                            (f64::from(*score) - exact).abs() <= 1e-6 * bound,
                            "{kernel:?}, d {d}, {n} keys, key {j}: {score} against {exact}"
                        );
                    }
                }
            }
        }
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
        // Within one part, at its end, one past it, and over three.
        let lens = [1usize, 7, 64, 65, 130];
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
                buffers: Buffers::F32 { keys, values },
                capacity,
                len,
            })
            .collect();
        let q = random(lens.len() * h * d, 99);
        // A sharp softmax too, where the parts' maxima lie far apart and most of their
        // rescaling weights underflow.
        for sharpness in [1.0f32, 16.0] {
            let scale = sharpness / (d as f32).sqrt();
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
                let Buffers::F32 { keys, values } = cache.buffers else {
                    unreachable!("f32 buffers above")
                };
                let (k, v) = (filled(keys), filled(values));
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
                        "sharpness {sharpness}, sequence {i} (len {}) element {e}: {a} vs {b}",
                        cache.len
                    );
                }
            }
            // Alone, a sequence gets the same bits as in the batch.
            let alone = attend(&q[3 * h * d..], &caches[3..], shape, scale);
            assert_eq!(alone, ours[3 * h * d..]);
        }
    }

    /// An f16 cache gives the bits of an f32 cache holding the same rounded keys and values, at
    /// every length around a part's edges and with buffers larger than their contents.
    #[test]
    fn an_f16_cache_reads_as_its_values_widened() {
        let shape = Heads {
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
        };
        let (h, g, d) = (shape.heads, shape.kv_heads, shape.head_dim);
        let capacity = 200;
        let narrow = |seed| -> Vec<f16> {
            random(g * capacity * d, seed)
                .into_iter()
                .map(f16::from_f32)
                .collect()
        };
        let (keys16, values16) = (narrow(7), narrow(8));
        let (keys32, values32): (Vec<f32>, Vec<f32>) = (
            keys16.iter().map(|v| v.to_f32()).collect(),
            values16.iter().map(|v| v.to_f32()).collect(),
        );
        for len in [1usize, 15, 16, 17, 64, 65, 200] {
            let q = random(h * d, len as u64);
            let view = |buffers| CacheView {
                buffers,
                capacity,
                len,
            };
            let wide = attend(
                &q,
                &[view(Buffers::F32 {
                    keys: &keys32,
                    values: &values32,
                })],
                shape,
                0.125,
            );
            let half = attend(
                &q,
                &[view(Buffers::F16 {
                    keys: &keys16,
                    values: &values16,
                })],
                shape,
                0.125,
            );
            assert_eq!(
                half.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                wide.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{len} positions"
            );
        }
    }

    /// The value of an f16's bits, decoded from IEEE 754's binary16 layout (1 sign bit, 5
    /// exponent bits biased by 15, 10 fraction bits): the reference the widening is held to,
    /// written apart from `half` and from the instructions.
    fn decoded(bits: u16) -> f64 {
        let sign = if bits >> 15 == 1 { -1.0 } else { 1.0 };
        let exponent = i32::from((bits >> 10) & 0x1f);
        let fraction = f64::from(bits & 0x3ff) / 1024.0;
        sign * match exponent {
            0 => fraction * 2f64.powi(-14),
            31 if fraction == 0.0 => f64::INFINITY,
            31 => f64::NAN,
            _ => (1.0 + fraction) * 2f64.powi(exponent - 15),
        }
    }

    /// Every path widens every f16 (normal, subnormal, signed zero, infinite, NaN) to the f32 of
    /// the same value, at every length around the vectors' widths.
    #[test]
    fn widening_is_exact_on_every_kernel() {
        let every: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        for kernel in Kernel::supported() {
            for len in (0..40).chain([every.len()]) {
                let src = &every[every.len() - len..];
                let mut dst = vec![0f32; len];
                widen(kernel, src, &mut dst);
                for (s, d) in src.iter().zip(&dst) {
                    let expected = decoded(s.to_bits());
                    assert!(
                        (f64::from(*d).to_bits() == expected.to_bits())
                            || (d.is_nan() && expected.is_nan()),
                        "{kernel:?}, {len} values: {:#06x} widened to {d}, not {expected}",
                        s.to_bits()
                    );
                }
            }
        }
    }
}
