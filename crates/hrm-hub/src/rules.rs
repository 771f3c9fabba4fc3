//! Aggregation math of the hub: combining worker pseudo-gradients into one model step
//! (weighted mean, Krum / Multi-Krum, coordinate-wise trimmed mean and median), the robust
//! outlier screen run before every rule, and the outer optimisers that apply the step.
//! Inputs are up to ~100 updates of ~10M floats, so every pass reads each input once, walking
//! coordinates in cache-sized chunks (all n slices of a Krum chunk stay in L2; coordinate-wise
//! rules transpose one cache line per update at a time) across rayon's pool over coordinate
//! ranges. No allocation per coordinate.

use rayon::prelude::*;
use std::fmt;
use std::ops::Range;

/// One worker's contribution: a flat pseudo-gradient (all parameters concatenated) and the
/// number of samples it was trained on. Values must be finite; the hub validates uploads
/// before they reach this module.
#[derive(Debug, Clone, Copy)]
pub struct Update<'a> {
    pub values: &'a [f32],
    pub num_samples: u64,
}

/// How updates are combined into one step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    /// Weighted FedAvg: weight num_samples / total_samples.
    Mean,
    /// Krum (Blanchard et al. 2017) tolerating `byzantine` bad updates: picks the single update
    /// with the lowest score (sum of squared distances to its n - f - 2 nearest neighbours).
    Krum { byzantine: usize },
    /// Multi-Krum: the `select` lowest-scoring updates (0: n - f), combined with the weighted
    /// mean.
    MultiKrum { byzantine: usize, select: usize },
    /// Coordinate-wise trimmed mean: per coordinate drop floor(trim_fraction * n) smallest and
    /// largest, unweighted mean of the rest. `trim_fraction` must lie in [0, 0.5).
    TrimmedMean { trim_fraction: f32 },
    /// Coordinate-wise median (mean of the two middle values when n is even).
    Median,
}

/// Why updates could not be combined or a step not applied.
#[derive(Debug, Clone, PartialEq)]
pub enum RuleError {
    NoUpdates,
    /// Input `index` has `found` values where `expected` were required.
    LengthMismatch {
        expected: usize,
        found: usize,
        index: usize,
    },
    /// Some update reports zero samples, which would give it no weight (a worker bug).
    ZeroSamples,
    /// Krum needs n > 2f + 2 updates to tolerate f byzantine ones.
    TooFewForKrum {
        updates: usize,
        byzantine: usize,
    },
    BadParameter(String),
}

impl fmt::Display for RuleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoUpdates => write!(f, "no updates to combine"),
            Self::LengthMismatch {
                expected,
                found,
                index,
            } => write!(f, "input {index} has {found} values, expected {expected}"),
            Self::ZeroSamples => write!(
                f,
                "an update reports zero samples; every update must carry at least one"
            ),
            Self::TooFewForKrum { updates, byzantine } => write!(
                f,
                "Krum tolerating {byzantine} byzantine updates needs more than {} updates, got {updates}",
                byzantine.saturating_mul(2).saturating_add(2)
            ),
            Self::BadParameter(what) => write!(f, "invalid parameter: {what}"),
        }
    }
}

impl std::error::Error for RuleError {}

/// The combined update and which input indices contributed to it: the chosen ones (ascending)
/// for Krum and Multi-Krum, all indices for the other rules.
#[derive(Debug, Clone, PartialEq)]
pub struct Combined {
    pub values: Vec<f32>,
    pub selected: Vec<usize>,
}

/// Accumulator width of the vectorised kernels: fixed-size lane arrays let the compiler keep
/// independent partial sums in SIMD registers (floating-point reductions are never reordered
/// otherwise), and the result does not depend on the instruction set the build targets.
const LANES: usize = 16;

/// Budget for one Krum chunk of all n updates together: half of a typical per-core L2, so the
/// O(n^2) sweep over pairs hits cache instead of memory.
const CHUNK_BYTES: usize = 512 * 1024;
const MIN_CHUNK: usize = 256;
const MAX_CHUNK: usize = 8192;

/// The weighted mean keeps an f64 accumulator per coordinate; 4096 of them (32 KiB) stay in
/// L1/L2 while every update streams through once.
const MEAN_CHUNK: usize = 4096;

/// Below this many values (coordinates x inputs) per thread, spawning costs more than it saves.
const MIN_VALUES_PER_THREAD: usize = 1 << 18;

fn chunk_len(updates: usize) -> usize {
    let fit = CHUNK_BYTES / (updates.max(1) * size_of::<f32>());
    fit.clamp(MIN_CHUNK, MAX_CHUNK) / LANES * LANES
}

fn thread_count(len: usize, inputs: usize) -> usize {
    let hardware = rayon::current_num_threads();
    let useful = len.saturating_mul(inputs.max(1)) / MIN_VALUES_PER_THREAD;
    hardware.min(useful).max(1)
}

/// Length of each thread's coordinate range; a multiple of `LANES` so only the very last range
/// has a ragged tail.
fn per_thread(len: usize, threads: usize) -> usize {
    len.div_ceil(threads.max(1))
        .next_multiple_of(LANES)
        .max(LANES)
}

fn ranges(len: usize, per: usize) -> Vec<Range<usize>> {
    (0..len)
        .step_by(per)
        .map(|start| start..(start + per).min(len))
        .collect()
}

/// Checks that there are updates, that they all have the first one's length and that each
/// carries samples; returns that length.
fn validate(updates: &[Update<'_>]) -> Result<usize, RuleError> {
    let first = updates.first().ok_or(RuleError::NoUpdates)?;
    let expected = first.values.len();
    for (index, update) in updates.iter().enumerate() {
        if update.values.len() != expected {
            return Err(RuleError::LengthMismatch {
                expected,
                found: update.values.len(),
                index,
            });
        }
    }
    if updates.iter().any(|u| u.num_samples == 0) {
        return Err(RuleError::ZeroSamples);
    }
    Ok(expected)
}

fn check_krum(updates: usize, byzantine: usize) -> Result<(), RuleError> {
    // Blanchard et al.'s guarantee needs n > 2f + 2: each score then sums n - f - 2 >= f + 1
    // neighbour distances, at least one of them honest even if all f byzantine updates are
    // among the nearest.
    if updates <= byzantine.saturating_mul(2).saturating_add(2) {
        return Err(RuleError::TooFewForKrum { updates, byzantine });
    }
    Ok(())
}

/// Number of values trimmed from each end. The small epsilon absorbs f32 rounding of decimal
/// fractions (0.45f32 * 20 is 8.99999976 in f64, but the user means 9).
fn trim_count(trim_fraction: f32, n: usize) -> Result<usize, RuleError> {
    if !(0.0..0.5).contains(&trim_fraction) {
        return Err(RuleError::BadParameter(format!(
            "trim_fraction must lie in [0, 0.5), got {trim_fraction}"
        )));
    }
    let trim = (f64::from(trim_fraction) * n as f64 + 1e-4).floor() as usize;
    // A fraction below one half always leaves at least one value per coordinate.
    Ok(trim.min((n - 1) / 2))
}

/// Combines `updates` with `rule`. All updates must have the same length and at least one
/// sample; values must be finite.
pub fn combine(rule: Rule, updates: &[Update<'_>]) -> Result<Combined, RuleError> {
    let len = updates.first().map_or(0, |u| u.values.len());
    combine_in(rule, updates, thread_count(len, updates.len()))
}

fn combine_in(rule: Rule, updates: &[Update<'_>], threads: usize) -> Result<Combined, RuleError> {
    let len = validate(updates)?;
    let n = updates.len();
    let all = || (0..n).collect::<Vec<_>>();
    match rule {
        Rule::Mean => Ok(Combined {
            values: weighted_mean(updates, len, threads),
            selected: all(),
        }),
        Rule::Krum { byzantine } => {
            let selected = krum_select(updates, byzantine, 1, threads)?;
            Ok(Combined {
                values: updates[selected[0]].values.to_vec(),
                selected,
            })
        }
        Rule::MultiKrum { byzantine, select } => {
            let select = if select == 0 {
                n.saturating_sub(byzantine)
            } else {
                select
            };
            if select == 0 || select > n {
                return Err(RuleError::BadParameter(format!(
                    "Multi-Krum select must lie in 1..={n}, got {select}"
                )));
            }
            let selected = krum_select(updates, byzantine, select, threads)?;
            let chosen: Vec<Update<'_>> = selected.iter().map(|&i| updates[i]).collect();
            Ok(Combined {
                values: weighted_mean(&chosen, len, threads),
                selected,
            })
        }
        Rule::TrimmedMean { trim_fraction } => {
            let trim = trim_count(trim_fraction, n)?;
            Ok(Combined {
                values: coordinatewise(updates, len, threads, |values| {
                    trimmed_mean_of(values, trim)
                }),
                selected: all(),
            })
        }
        Rule::Median => Ok(Combined {
            values: coordinatewise(updates, len, threads, median_of),
            selected: all(),
        }),
    }
}

fn weighted_mean(updates: &[Update<'_>], len: usize, threads: usize) -> Vec<f32> {
    let total: u128 = updates.iter().map(|u| u128::from(u.num_samples)).sum();
    let weights: Vec<f64> = updates
        .iter()
        .map(|u| u.num_samples as f64 / total as f64)
        .collect();
    let mut out = vec![0.0f32; len];
    let per = per_thread(len, threads);
    let parts: Vec<_> = out.chunks_mut(per).enumerate().collect();
    parts.into_par_iter().for_each(|(part, out)| {
        weighted_mean_range(updates, &weights, part * per, out);
    });
    out
}

/// Single pass over every input: per chunk, updates are folded into an f64 accumulator four
/// at a time, which quarters the accumulator's load/store traffic.
fn weighted_mean_range(updates: &[Update<'_>], weights: &[f64], start: usize, out: &mut [f32]) {
    let mut acc = vec![0.0f64; MEAN_CHUNK.min(out.len())];
    for (c, out) in out.chunks_mut(MEAN_CHUNK).enumerate() {
        let lo = start + c * MEAN_CHUNK;
        let hi = lo + out.len();
        let acc = &mut acc[..out.len()];
        acc.fill(0.0);
        let mut quads = updates.chunks_exact(4);
        let mut quad_weights = weights.chunks_exact(4);
        for (u, w) in (&mut quads).zip(&mut quad_weights) {
            let (x0, x1, x2, x3) = (
                &u[0].values[lo..hi],
                &u[1].values[lo..hi],
                &u[2].values[lo..hi],
                &u[3].values[lo..hi],
            );
            for ((((a, &v0), &v1), &v2), &v3) in acc.iter_mut().zip(x0).zip(x1).zip(x2).zip(x3) {
                *a += w[0] * f64::from(v0)
                    + w[1] * f64::from(v1)
                    + w[2] * f64::from(v2)
                    + w[3] * f64::from(v3);
            }
        }
        for (u, &w) in quads.remainder().iter().zip(quad_weights.remainder()) {
            for (a, &v) in acc.iter_mut().zip(&u.values[lo..hi]) {
                *a += w * f64::from(v);
            }
        }
        for (o, &a) in out.iter_mut().zip(acc.iter()) {
            *o = a as f32;
        }
    }
}

/// Applies `stat` to each coordinate's n values, handed over as order keys in a reusable
/// buffer (which `stat` may reorder).
fn coordinatewise(
    updates: &[Update<'_>],
    len: usize,
    threads: usize,
    stat: impl Fn(&mut [i32]) -> f32 + Sync,
) -> Vec<f32> {
    let n = updates.len();
    let mut out = vec![0.0f32; len];
    let per = per_thread(len, threads);
    let parts: Vec<_> = out.chunks_mut(per).enumerate().collect();
    parts.into_par_iter().for_each(|(part, out)| {
        let mut tile = vec![0.0f32; TILE * n];
        let mut keys = Vec::with_capacity(n);
        for (t, out) in out.chunks_mut(TILE).enumerate() {
            transpose_tile(updates, part * per + t * TILE, out.len(), &mut tile);
            for (o, row) in out.iter_mut().zip(tile.chunks_exact(n)) {
                keys.clear();
                keys.extend(row.iter().map(|&v| order_key(v)));
                *o = stat(&mut keys);
            }
        }
    });
    out
}

/// Coordinates gathered per step by the coordinate-wise rules: one 64-byte line per update.
const TILE: usize = 16;

/// Copies coordinates start..start + width of every update into `tile`, row k holding the n
/// values of coordinate start + k. Each update's line is read once and whole; gathering one
/// coordinate at a time instead would touch n lines per coordinate, and large allocations
/// usually share their offset modulo the page size, so those lines would all compete for the
/// same few cache sets.
fn transpose_tile(updates: &[Update<'_>], start: usize, width: usize, tile: &mut [f32]) {
    let n = updates.len();
    for (i, u) in updates.iter().enumerate() {
        for (k, &v) in u.values[start..start + width].iter().enumerate() {
            tile[k * n + i] = v;
        }
    }
}

/// Maps a float to an integer whose order is `f32::total_cmp`'s. Selecting on these keys is
/// about 30% faster than selecting floats by `total_cmp`, which redoes this transform on every
/// comparison. The map is its own inverse.
fn order_key(value: f32) -> i32 {
    flip_negative(value.to_bits() as i32)
}

fn from_order_key(key: i32) -> f32 {
    f32::from_bits(flip_negative(key) as u32)
}

/// Sign-magnitude negatives order backwards as integers; flipping their magnitude bits turns
/// them into two's-complement order. The sign bit is kept, so applying it twice is identity.
fn flip_negative(bits: i32) -> i32 {
    bits ^ ((bits >> 31) as u32 >> 1) as i32
}

/// Median of a non-empty buffer of order keys (reordered); for even n the mean of the two
/// middle values.
fn median_of(keys: &mut [i32]) -> f32 {
    let n = keys.len();
    let (lower, &mut upper, _) = keys.select_nth_unstable(n / 2);
    let upper = from_order_key(upper);
    if n % 2 == 1 {
        return upper;
    }
    // Even n: the lower middle is the largest of the partition below the upper middle.
    let below = lower.iter().copied().max().map_or(upper, from_order_key);
    ((f64::from(below) + f64::from(upper)) / 2.0) as f32
}

/// Unweighted mean of order keys after dropping the `trim` smallest and `trim` largest
/// (reordered); requires keys.len() > 2 * trim. Two selections instead of a sort: O(n).
fn trimmed_mean_of(keys: &mut [i32], trim: usize) -> f32 {
    let kept: &[i32] = if trim == 0 {
        keys
    } else {
        let (_, _, above_low) = keys.select_nth_unstable(trim - 1);
        let keep = above_low.len() - trim;
        let (middle, _, _) = above_low.select_nth_unstable(keep);
        middle
    };
    let sum: f64 = kept.iter().map(|&k| f64::from(from_order_key(k))).sum();
    (sum / kept.len() as f64) as f32
}

/// Krum scores of all updates (lower is more central): the sum of squared L2 distances from
/// each update to its n - f - 2 nearest other updates.
pub fn krum_scores(updates: &[Update<'_>], byzantine: usize) -> Result<Vec<f64>, RuleError> {
    let len = updates.first().map_or(0, |u| u.values.len());
    krum_scores_in(updates, byzantine, thread_count(len, updates.len()))
}

fn krum_scores_in(
    updates: &[Update<'_>],
    byzantine: usize,
    threads: usize,
) -> Result<Vec<f64>, RuleError> {
    let len = validate(updates)?;
    let n = updates.len();
    check_krum(n, byzantine)?;
    let dist = pairwise_sq_dists(updates, len, threads);
    let neighbours = n - byzantine - 2;
    let mut row = Vec::with_capacity(n - 1);
    Ok((0..n)
        .map(|i| {
            row.clear();
            row.extend((0..n).filter(|&j| j != i).map(|j| dist[i * n + j]));
            row.select_nth_unstable_by(neighbours - 1, f64::total_cmp);
            row[..neighbours].iter().sum()
        })
        .collect())
}

/// Updates that lie much closer to another update than updates usually lie to each other
/// (squared distance below `NEAR_DUPLICATE` of the median pairwise one): copies, or one
/// direction sent by several identities. Two honest updates of different batches are never
/// that close; colluders that send one vector are, and they are what captures Krum (n - f - 1
/// identical updates score 0). Fewer than 3 updates have no typical distance: none is flagged.
pub fn near_duplicates(updates: &[Update<'_>]) -> Vec<bool> {
    let n = updates.len();
    let len = updates.first().map_or(0, |u| u.values.len());
    if n < 3 || validate(updates).is_err() {
        return vec![false; n];
    }
    let dist = pairwise_sq_dists(updates, len, thread_count(len, n));
    let mut pairs: Vec<f64> = (0..n)
        .flat_map(|i| (i + 1..n).map(move |j| (i, j)))
        .map(|(i, j)| dist[i * n + j])
        .collect();
    let typical = median_f64(&mut pairs);
    (0..n)
        .map(|i| (0..n).any(|j| j != i && dist[i * n + j] <= NEAR_DUPLICATE * typical))
        .collect()
}

/// See [`near_duplicates`]: a tenth of the typical distance.
const NEAR_DUPLICATE: f64 = 0.01;

/// Indices (ascending) of the `select` lowest Krum scores, ties broken by lower index.
fn krum_select(
    updates: &[Update<'_>],
    byzantine: usize,
    select: usize,
    threads: usize,
) -> Result<Vec<usize>, RuleError> {
    let scores = krum_scores_in(updates, byzantine, threads)?;
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
    order.truncate(select);
    order.sort_unstable();
    Ok(order)
}

/// Full symmetric n x n matrix of squared distances. Each thread accumulates its coordinate
/// range into its own f64 matrix, chunk by chunk so all n slices of a chunk sit in L2 while
/// the n(n-1)/2 pairs are swept; the per-thread matrices are then summed.
fn pairwise_sq_dists(updates: &[Update<'_>], len: usize, threads: usize) -> Vec<f64> {
    let n = updates.len();
    let chunk = chunk_len(n);
    let parts = ranges(len, per_thread(len, threads));
    // Padding keeps the row stride off powers of two, so rows do not share cache sets.
    let stride = chunk + LANES;
    let partials = parts
        .into_par_iter()
        .map(|range| {
            let mut acc = vec![0.0f64; n * n];
            let mut scratch = vec![0.0f32; n * stride];
            for lo in range.clone().step_by(chunk) {
                let width = chunk.min(range.end - lo);
                // A contiguous copy of the chunk: the inputs are separate allocations that usually
                // share their offset modulo the page size, so their slices would evict each other
                // from L2 before the O(n^2) sweep is done with them.
                for (row, u) in scratch.chunks_exact_mut(stride).zip(updates) {
                    row[..width].copy_from_slice(&u.values[lo..lo + width]);
                }
                for (i, a) in scratch.chunks_exact(stride).enumerate() {
                    let a = &a[..width];
                    let row = &mut acc[i * n + i + 1..(i + 1) * n];
                    let later = scratch[(i + 1) * stride..].chunks_exact(stride);
                    // One partner per call: pairing `a` with several partners at once would save
                    // loads, but LLVM then vectorises across partners with shuffles and spills
                    // (measured ~1.5x slower), while this loop compiles to clean SIMD.
                    for (r, b) in row.iter_mut().zip(later) {
                        *r += sq_dist(a, &b[..width]);
                    }
                }
            }
            acc
        })
        .collect::<Vec<_>>();
    let mut dist = vec![0.0f64; n * n];
    for partial in &partials {
        for (d, p) in dist.iter_mut().zip(partial) {
            *d += p;
        }
    }
    for i in 0..n {
        for j in 0..i {
            dist[i * n + j] = dist[j * n + i];
        }
    }
    dist
}

fn lanes_sum(acc: &[f32; LANES]) -> f64 {
    acc.iter().map(|&v| f64::from(v)).sum()
}

/// Squared L2 distance of two equally long chunks; f32 lanes within a chunk (at most 512
/// terms each), f64 across chunks.
fn sq_dist(a: &[f32], b: &[f32]) -> f64 {
    let (ac, at) = a.as_chunks::<LANES>();
    let (bc, bt) = b.as_chunks::<LANES>();
    let mut acc = [0.0f32; LANES];
    for (x, y) in ac.iter().zip(bc) {
        for ((s, &p), &q) in acc.iter_mut().zip(x).zip(y) {
            let d = p - q;
            *s += d * d;
        }
    }
    lanes_sum(&acc) + tail_sq_dist(at, bt)
}

fn tail_sq_dist(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&p, &q)| f64::from(p - q) * f64::from(p - q))
        .sum()
}

/// The smallest robust sigma of the outlier screen, as a fraction of the median distance, in
/// rounds of at least [`SMALL_ROUND`] updates.
pub const SIGMA_FLOOR: f64 = 0.1;

/// Below this many updates the sigma floor grows as `SIGMA_FLOOR * SMALL_ROUND / n`.
pub const SMALL_ROUND: usize = 10;

/// Outlier screen run before every rule: d_i is the L2 distance of update i to the
/// coordinate-wise median of all updates, and z_i = (d_i - median(d)) / sigma with the robust
/// sigma = 1.4826 * MAD(d), floored at [`sigma_floor`]`(n)` * median(d) + 1e-12. Returns true for
/// updates with z_i > `z_threshold` (the spec's 3 standard deviations); with fewer than 3 updates
/// nothing is rejected.
///
/// The floor matters: distances of honest high-dimensional updates concentrate tightly, so their
/// MAD alone is tiny and would flag an honest update in about one round in eight. In rounds of 10
/// or more, nothing within 3 * 10% = 30% of the typical distance is rejected. Fewer updates say
/// less about the spread (out of 3, the MAD is just the smaller gap between two distances), and
/// honest updates of a small round, computed on different base versions from batches of different
/// difficulty, legitimately differ by more than 30%; so the floor grows as the round shrinks: out
/// of 3, anything within twice the typical distance is kept. A poisoned update (scaled, noise) lies
/// many times further at any size.
///
/// Robust statistics because with the classical mean and standard deviation a single outlier
/// among n updates can never lie more than (n - 1) / sqrt(n) standard deviations from the
/// mean, i.e. never 3 sigma for n <= 10, however large it is; the median and MAD are not
/// dragged along by the outlier itself.
///
/// # Panics
/// If the updates differ in length (shapes are validated when uploads are accepted).
pub fn outliers(updates: &[Update<'_>], z_threshold: f64) -> Vec<bool> {
    let len = updates.first().map_or(0, |u| u.values.len());
    outliers_in(updates, z_threshold, thread_count(len, updates.len()))
}

fn outliers_in(updates: &[Update<'_>], z_threshold: f64, threads: usize) -> Vec<bool> {
    let n = updates.len();
    let len = updates.first().map_or(0, |u| u.values.len());
    for (index, u) in updates.iter().enumerate() {
        assert_eq!(u.values.len(), len, "update {index} differs in length");
    }
    if n < 3 {
        return vec![false; n];
    }
    above_robust_spread(&distances_to_median(updates, len, threads), z_threshold)
}

/// True for each value more than `z_threshold` robust sigmas above the median of `values`
/// (sigma = 1.4826 * MAD, floored at [`sigma_floor`] * median).
fn above_robust_spread(values: &[f64], z_threshold: f64) -> Vec<bool> {
    let mut sorted = values.to_vec();
    let center = median_f64(&mut sorted);
    let mut deviations: Vec<f64> = values.iter().map(|d| (d - center).abs()).collect();
    let mad = median_f64(&mut deviations);
    let sigma = (1.4826 * mad).max(sigma_floor(values.len()) * center + 1e-12);
    values
        .iter()
        .map(|d| (d - center) / sigma > z_threshold)
        .collect()
}

/// [`outliers`] for a pool that mixes updates computed on different model versions: `versions[i]`
/// names update i's base version. Consecutive versions (early in training above all) pull in
/// different directions, so against a mixed pool's median an honest update of one version looks
/// like an outlier beside the others. Updates whose version has at least 3 updates in the pool
/// are therefore screened among those only; an update with fewer peers is screened on its L2
/// norm against the norms of the whole pool (AdamW's steps keep the size of honest updates
/// steady from version to version, while a scaled or noise update is many times larger), so a
/// poisoned update cannot hide by being alone on its version.
///
/// # Panics
/// If `versions` and `updates` differ in length, or as [`outliers`] does.
pub fn outliers_by_version(
    updates: &[Update<'_>],
    versions: &[&str],
    z_threshold: f64,
) -> Vec<bool> {
    assert_eq!(updates.len(), versions.len(), "one version per update");
    let mut groups: std::collections::BTreeMap<&str, Vec<usize>> = Default::default();
    for (i, version) in versions.iter().enumerate() {
        groups.entry(version).or_default().push(i);
    }
    // The norm screen is for updates without 2 peers on their version; when every update has
    // them, its pass over the whole pool is skipped.
    let mut flags = if updates.len() < 3 || groups.values().all(|m| m.len() >= 3) {
        vec![false; updates.len()]
    } else {
        let norms: Vec<f64> = updates.iter().map(|u| l2_norm(u.values)).collect();
        above_robust_spread(&norms, z_threshold)
    };
    for members in groups.values().filter(|m| m.len() >= 3) {
        let group: Vec<Update<'_>> = members.iter().map(|&i| updates[i]).collect();
        for (&i, flag) in members.iter().zip(outliers(&group, z_threshold)) {
            flags[i] = flag;
        }
    }
    flags
}

/// The L2 norm, accumulated in f64 (an f32 sum of squares would overflow long before the
/// values do).
pub fn l2_norm(values: &[f32]) -> f64 {
    values
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt()
}

/// The outlier screen's smallest sigma for a round of `n` updates, as a fraction of the median
/// distance.
pub fn sigma_floor(n: usize) -> f64 {
    SIGMA_FLOOR * (SMALL_ROUND as f64 / n as f64).max(1.0)
}

/// L2 distance of every update to the coordinate-wise median, in one pass: each coordinate's
/// median is compared against the same transposed tile it was selected from.
fn distances_to_median(updates: &[Update<'_>], len: usize, threads: usize) -> Vec<f64> {
    let n = updates.len();
    let parts = ranges(len, per_thread(len, threads));
    let partials = parts
        .into_par_iter()
        .map(|range| {
            let mut sq = vec![0.0f64; n];
            let mut tile = vec![0.0f32; TILE * n];
            let mut keys = Vec::with_capacity(n);
            for start in range.clone().step_by(TILE) {
                let width = TILE.min(range.end - start);
                transpose_tile(updates, start, width, &mut tile);
                for row in tile.chunks_exact(n).take(width) {
                    keys.clear();
                    keys.extend(row.iter().map(|&v| order_key(v)));
                    let median = f64::from(median_of(&mut keys));
                    for (s, &v) in sq.iter_mut().zip(row) {
                        let d = f64::from(v) - median;
                        *s += d * d;
                    }
                }
            }
            sq
        })
        .collect::<Vec<_>>();
    let mut sq = vec![0.0f64; n];
    for partial in &partials {
        for (s, p) in sq.iter_mut().zip(partial) {
            *s += p;
        }
    }
    sq.into_iter().map(f64::sqrt).collect()
}

fn median_f64(values: &mut [f64]) -> f64 {
    values.sort_unstable_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// Cosine similarity of two equally long vectors; 0.0 if either is all zeros.
///
/// # Panics
/// If the lengths differ.
pub fn cosine_similarity(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "cosine_similarity of different lengths");
    let per = per_thread(a.len(), thread_count(a.len(), 2));
    let parts: Vec<_> = a.chunks(per).zip(b.chunks(per)).collect();
    let sums = parts
        .into_par_iter()
        .map(|(a, b)| {
            let mut total = [0.0f64; 3];
            for (a, b) in a.chunks(MAX_CHUNK).zip(b.chunks(MAX_CHUNK)) {
                let [dot, aa, bb] = dot3(a, b);
                total[0] += dot;
                total[1] += aa;
                total[2] += bb;
            }
            total
        })
        .collect::<Vec<_>>();
    let [dot, aa, bb] = sums
        .iter()
        .fold([0.0f64; 3], |t, s| [t[0] + s[0], t[1] + s[1], t[2] + s[2]]);
    if aa == 0.0 || bb == 0.0 {
        return 0.0;
    }
    (dot / (aa.sqrt() * bb.sqrt())).clamp(-1.0, 1.0)
}

/// a.b, a.a and b.b of one chunk, in f32 lanes flushed to f64 (see `sq_dist`).
fn dot3(a: &[f32], b: &[f32]) -> [f64; 3] {
    let (ac, at) = a.as_chunks::<LANES>();
    let (bc, bt) = b.as_chunks::<LANES>();
    let mut acc = [[0.0f32; LANES]; 3];
    for (x, y) in ac.iter().zip(bc) {
        let [ab, aa, bb] = &mut acc;
        for ((((ab, aa), bb), &p), &q) in ab.iter_mut().zip(aa).zip(bb).zip(x).zip(y) {
            *ab += p * q;
            *aa += p * p;
            *bb += q * q;
        }
    }
    let mut out = acc.map(|lanes| lanes_sum(&lanes));
    for (&p, &q) in at.iter().zip(bt) {
        let (p, q) = (f64::from(p), f64::from(q));
        out[0] += p * q;
        out[1] += p * p;
        out[2] += q * q;
    }
    out
}

/// Applies the combined pseudo-gradient to the model ("outer" step, as opposed to the
/// workers' inner steps).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OuterOptimizer {
    /// theta -= lr * delta  (lr = 1 is plain FedAvg of the local models).
    Plain { lr: f32 },
    /// FedAdam (Reddi et al. 2021, "Adaptive Federated Optimization"): m = b1 m + (1-b1) d;
    /// v = b2 v + (1-b2) d^2; theta -= lr * m / (sqrt(v) + tau). No bias correction, as in
    /// the paper.
    FedAdam {
        lr: f32,
        beta1: f32,
        beta2: f32,
        tau: f32,
    },
    /// DiLoCo-style Nesterov momentum (Douillard et al. 2023): m = mu m + d;
    /// theta -= lr * (d + mu m).
    Nesterov { lr: f32, momentum: f32 },
}

/// How the outer learning rate changes over a pass through the ingested batches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OuterSchedule {
    Constant,
    /// Cosine decay from the full rate to `min_ratio` of it, over the fraction of batches
    /// completed: the network's counterpart of `hrm train`'s cosine schedule. Late updates move
    /// the model less, so the published model settles instead of carrying the last rounds' noise.
    Cosine {
        min_ratio: f32,
    },
}

impl OuterSchedule {
    /// The factor on the outer learning rate with `progress` (0 to 1) of the batches completed.
    pub fn factor(&self, progress: f64) -> f32 {
        match *self {
            Self::Constant => 1.0,
            Self::Cosine { min_ratio } => {
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress.clamp(0.0, 1.0)).cos());
                min_ratio + (1.0 - min_ratio) * cosine as f32
            }
        }
    }
}

/// Outer-optimizer state carried between versions. Empty vectors mean "zeros" (lazily sized on
/// first use). The state belongs to one optimizer kind: FedAdam's `momentum` is an average,
/// Nesterov's a sum.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OuterState {
    pub momentum: Vec<f32>,
    pub second_moment: Vec<f32>,
    pub steps: u64,
}

impl OuterOptimizer {
    /// Short stable identifier, for logs and the status feed.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Plain { .. } => "plain",
            Self::FedAdam { .. } => "fedadam",
            Self::Nesterov { .. } => "nesterov",
        }
    }

    /// The same optimiser with its learning rate multiplied by `factor` (an outer schedule's
    /// value for this step).
    pub fn scaled(&self, factor: f32) -> Self {
        let mut scaled = *self;
        match &mut scaled {
            Self::Plain { lr } | Self::FedAdam { lr, .. } | Self::Nesterov { lr, .. } => {
                *lr *= factor;
            }
        }
        scaled
    }

    fn validate(&self) -> Result<(), RuleError> {
        let positive = |name: &str, v: f32| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(RuleError::BadParameter(format!(
                    "{} {name} must be positive and finite, got {v}",
                    self.name()
                )))
            }
        };
        let decay = |name: &str, v: f32| {
            if (0.0..1.0).contains(&v) {
                Ok(())
            } else {
                Err(RuleError::BadParameter(format!(
                    "{} {name} must lie in [0, 1), got {v}",
                    self.name()
                )))
            }
        };
        match *self {
            Self::Plain { lr } => positive("lr", lr),
            Self::FedAdam {
                lr,
                beta1,
                beta2,
                tau,
            } => {
                positive("lr", lr)?;
                decay("beta1", beta1)?;
                decay("beta2", beta2)?;
                positive("tau", tau)
            }
            Self::Nesterov { lr, momentum } => {
                positive("lr", lr)?;
                decay("momentum", momentum)
            }
        }
    }

    /// Applies one outer step of `delta` (a pseudo-gradient: start weights minus trained
    /// weights, pointing uphill) to `params`, updating `state`. Nothing is modified on error.
    pub fn apply(
        &self,
        params: &mut [f32],
        delta: &[f32],
        state: &mut OuterState,
    ) -> Result<(), RuleError> {
        self.validate()?;
        let len = params.len();
        if delta.len() != len {
            return Err(RuleError::LengthMismatch {
                expected: len,
                found: delta.len(),
                index: 0,
            });
        }
        let uses_second_moment = matches!(self, Self::FedAdam { .. });
        check_state(&state.momentum, len, "momentum")?;
        if uses_second_moment {
            check_state(&state.second_moment, len, "second_moment")?;
        }
        let per = per_thread(len, thread_count(len, 4));
        match *self {
            Self::Plain { lr } => {
                let parts: Vec<_> = params.chunks_mut(per).zip(delta.chunks(per)).collect();
                parts.into_par_iter().for_each(|(p, d)| {
                    for (p, &d) in p.iter_mut().zip(d) {
                        *p -= lr * d;
                    }
                });
            }
            Self::FedAdam {
                lr,
                beta1,
                beta2,
                tau,
            } => {
                sized(&mut state.momentum, len);
                sized(&mut state.second_moment, len);
                let parts: Vec<_> = params
                    .chunks_mut(per)
                    .zip(delta.chunks(per))
                    .zip(state.momentum.chunks_mut(per))
                    .zip(state.second_moment.chunks_mut(per))
                    .collect();
                parts.into_par_iter().for_each(|(((p, d), m), v)| {
                    for (((p, &d), m), v) in p.iter_mut().zip(d).zip(m).zip(v) {
                        *m = beta1 * *m + (1.0 - beta1) * d;
                        *v = beta2 * *v + (1.0 - beta2) * d * d;
                        *p -= lr * *m / (v.sqrt() + tau);
                    }
                });
            }
            Self::Nesterov { lr, momentum } => {
                sized(&mut state.momentum, len);
                let parts: Vec<_> = params
                    .chunks_mut(per)
                    .zip(delta.chunks(per))
                    .zip(state.momentum.chunks_mut(per))
                    .collect();
                parts.into_par_iter().for_each(|((p, d), m)| {
                    for ((p, &d), m) in p.iter_mut().zip(d).zip(m) {
                        *m = momentum * *m + d;
                        *p -= lr * (d + momentum * *m);
                    }
                });
            }
        }
        state.steps += 1;
        Ok(())
    }
}

/// A state vector must be empty (zeros) or match the parameters.
fn check_state(values: &[f32], len: usize, what: &str) -> Result<(), RuleError> {
    if values.is_empty() || values.len() == len {
        Ok(())
    } else {
        Err(RuleError::BadParameter(format!(
            "outer optimizer {what} has {} values, parameters {len}",
            values.len()
        )))
    }
}

fn sized(values: &mut Vec<f32>, len: usize) {
    if values.is_empty() {
        values.resize(len, 0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// splitmix64: tiny, deterministic, good enough for test data.
    struct Rng(u64);

    impl Rng {
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        /// Uniform in [-1, 1).
        fn uniform(&mut self) -> f32 {
            (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }

        fn normal(&mut self) -> f32 {
            let u1 = ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next_u64() % n
        }

        fn vec(&mut self, len: usize) -> Vec<f32> {
            (0..len).map(|_| self.uniform()).collect()
        }
    }

    fn updates<'a>(values: &'a [Vec<f32>], samples: &[u64]) -> Vec<Update<'a>> {
        values
            .iter()
            .zip(samples)
            .map(|(v, &num_samples)| Update {
                values: v,
                num_samples,
            })
            .collect()
    }

    fn column(values: &[Vec<f32>], k: usize) -> Vec<f64> {
        values.iter().map(|v| f64::from(v[k])).collect()
    }

    fn naive_weighted_mean(values: &[Vec<f32>], samples: &[u64]) -> Vec<f64> {
        let total: f64 = samples.iter().map(|&s| s as f64).sum();
        (0..values[0].len())
            .map(|k| {
                let col = column(values, k);
                col.iter()
                    .zip(samples)
                    .map(|(x, &s)| x * s as f64)
                    .sum::<f64>()
                    / total
            })
            .collect()
    }

    fn naive_sorted_column(values: &[Vec<f32>], k: usize) -> Vec<f64> {
        let mut col = column(values, k);
        col.sort_by(f64::total_cmp);
        col
    }

    fn naive_median(values: &[Vec<f32>]) -> Vec<f64> {
        (0..values[0].len())
            .map(|k| {
                let col = naive_sorted_column(values, k);
                let n = col.len();
                if n % 2 == 1 {
                    col[n / 2]
                } else {
                    (col[n / 2 - 1] + col[n / 2]) / 2.0
                }
            })
            .collect()
    }

    fn naive_trimmed_mean(values: &[Vec<f32>], trim: usize) -> Vec<f64> {
        (0..values[0].len())
            .map(|k| {
                let col = naive_sorted_column(values, k);
                let kept = &col[trim..col.len() - trim];
                kept.iter().sum::<f64>() / kept.len() as f64
            })
            .collect()
    }

    fn naive_sq_dist(a: &[f32], b: &[f32]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
            .sum()
    }

    fn naive_krum_scores(values: &[Vec<f32>], byzantine: usize) -> Vec<f64> {
        let n = values.len();
        (0..n)
            .map(|i| {
                let mut d: Vec<f64> = (0..n)
                    .filter(|&j| j != i)
                    .map(|j| naive_sq_dist(&values[i], &values[j]))
                    .collect();
                d.sort_by(f64::total_cmp);
                d[..n - byzantine - 2].iter().sum()
            })
            .collect()
    }

    fn assert_close(got: &[f32], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len());
        for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
            let err = (f64::from(g) - w).abs();
            assert!(err <= tol * (1.0 + w.abs()), "coordinate {k}: {g} vs {w}");
        }
    }

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-30)
    }

    /// Odd lengths around the lane width and chunk sizes, and threads that split them.
    const LENGTHS: [usize; 7] = [1, 15, 16, 17, 4095, 4097, 20_011];

    #[test]
    fn order_keys_sort_like_total_cmp_and_round_trip() {
        let mut rng = Rng(14);
        let mut values = vec![
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
        ];
        values.extend((0..200).map(|_| rng.normal() * 10f32.powi(rng.below(20) as i32 - 10)));
        for &a in &values {
            assert_eq!(from_order_key(order_key(a)).to_bits(), a.to_bits());
            for &b in &values {
                assert_eq!(
                    order_key(a).cmp(&order_key(b)),
                    a.total_cmp(&b),
                    "{a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn mean_matches_naive_weighted_mean() {
        let mut rng = Rng(1);
        for n in [1, 2, 3, 5, 8, 9, 40] {
            for len in LENGTHS {
                let values: Vec<Vec<f32>> = (0..n).map(|_| rng.vec(len)).collect();
                let samples: Vec<u64> = (0..n).map(|_| 1 + rng.below(1000)).collect();
                let ups = updates(&values, &samples);
                let want = naive_weighted_mean(&values, &samples);
                for threads in [1, 3] {
                    let got = combine_in(Rule::Mean, &ups, threads).unwrap();
                    assert_close(&got.values, &want, 1e-6);
                    assert_eq!(got.selected, (0..n).collect::<Vec<_>>());
                }
                assert_close(&combine(Rule::Mean, &ups).unwrap().values, &want, 1e-6);
            }
        }
    }

    #[test]
    fn huge_sample_counts_do_not_overflow() {
        let values = vec![vec![1.0f32; 5], vec![3.0f32; 5]];
        let got = combine(Rule::Mean, &updates(&values, &[u64::MAX, u64::MAX])).unwrap();
        assert_eq!(got.values, vec![2.0; 5]);
    }

    #[test]
    fn input_errors() {
        assert_eq!(combine(Rule::Mean, &[]), Err(RuleError::NoUpdates));
        assert_eq!(combine(Rule::Median, &[]), Err(RuleError::NoUpdates));
        let values = vec![vec![0.0; 10], vec![0.0; 10], vec![0.0; 9]];
        assert_eq!(
            combine(Rule::Mean, &updates(&values, &[1, 1, 1])),
            Err(RuleError::LengthMismatch {
                expected: 10,
                found: 9,
                index: 2
            })
        );
        let values = vec![vec![0.0; 10]; 3];
        for rule in [Rule::Mean, Rule::Median, Rule::Krum { byzantine: 0 }] {
            assert_eq!(
                combine(rule, &updates(&values, &[3, 0, 1])),
                Err(RuleError::ZeroSamples)
            );
        }
        let ups = updates(&values, &[1, 1, 1]);
        for trim_fraction in [0.5, -0.1, f32::NAN, 1.0] {
            assert!(matches!(
                combine(Rule::TrimmedMean { trim_fraction }, &ups),
                Err(RuleError::BadParameter(_))
            ));
        }
        // 0 means n - f; beyond n is refused.
        for (byzantine, select) in [(0, 4), (3, 0)] {
            assert!(matches!(
                combine(Rule::MultiKrum { byzantine, select }, &ups),
                Err(RuleError::BadParameter(_))
            ));
        }
        // Messages name the offending numbers.
        let message = RuleError::LengthMismatch {
            expected: 10,
            found: 9,
            index: 2,
        }
        .to_string();
        assert!(message.contains("10") && message.contains('9') && message.contains('2'));
    }

    #[test]
    fn median_matches_naive_sort() {
        let mut rng = Rng(2);
        for n in [1, 2, 3, 4, 5, 6, 9, 10, 40] {
            for len in LENGTHS {
                let mut values: Vec<Vec<f32>> = (0..n).map(|_| rng.vec(len)).collect();
                // Ties are common in real updates (e.g. zero gradients of unused embeddings).
                for v in values.iter_mut().take(n / 2) {
                    v[0] = 0.5;
                }
                let ups = updates(&values, &vec![1; n]);
                let want: Vec<f32> = naive_median(&values).iter().map(|&m| m as f32).collect();
                for threads in [1, 3] {
                    assert_eq!(
                        combine_in(Rule::Median, &ups, threads).unwrap().values,
                        want
                    );
                }
            }
        }
    }

    #[test]
    fn trimmed_mean_matches_naive_sort() {
        let mut rng = Rng(3);
        for n in [1, 2, 5, 6, 10, 11, 20, 40] {
            for percent in [0usize, 10, 20, 25, 33, 45, 49] {
                let trim = n * percent / 100;
                let rule = Rule::TrimmedMean {
                    trim_fraction: percent as f32 / 100.0,
                };
                for len in [17, 4097, 20_011] {
                    let values: Vec<Vec<f32>> = (0..n).map(|_| rng.vec(len)).collect();
                    let ups = updates(&values, &vec![1; n]);
                    let want = naive_trimmed_mean(&values, trim);
                    for threads in [1, 3] {
                        assert_close(
                            &combine_in(rule, &ups, threads).unwrap().values,
                            &want,
                            1e-6,
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn untrimmed_mean_is_the_unweighted_mean() {
        let mut rng = Rng(4);
        let values: Vec<Vec<f32>> = (0..7).map(|_| rng.vec(5001)).collect();
        let samples: Vec<u64> = (0..7).map(|_| 1 + rng.below(100)).collect();
        let got = combine(
            Rule::TrimmedMean { trim_fraction: 0.0 },
            &updates(&values, &samples),
        )
        .unwrap();
        assert_close(&got.values, &naive_weighted_mean(&values, &[1; 7]), 1e-6);
    }

    /// 7 honest updates scattered around a common point and 2 colluding byzantine ones far
    /// away but close to each other, at indices 2 and 6.
    fn krum_scenario(rng: &mut Rng, len: usize) -> (Vec<Vec<f32>>, Vec<u64>) {
        let center = rng.vec(len);
        let attack: Vec<f32> = center.iter().map(|c| c + 10.0 * rng.normal()).collect();
        let values = (0..9)
            .map(|i| {
                let (base, spread) = if i == 2 || i == 6 {
                    (&attack, 0.01)
                } else {
                    (&center, 0.3)
                };
                base.iter().map(|b| b + spread * rng.normal()).collect()
            })
            .collect();
        let samples = (0..9).map(|_| 1 + rng.below(500)).collect();
        (values, samples)
    }

    #[test]
    fn krum_never_selects_byzantine_and_scores_match_naive() {
        let mut rng = Rng(5);
        for trial in 0..12 {
            let len = [1000, 4097, 9001][trial % 3];
            let (values, samples) = krum_scenario(&mut rng, len);
            let ups = updates(&values, &samples);
            let want = naive_krum_scores(&values, 2);
            for threads in [1, 3] {
                let scores = krum_scores_in(&ups, 2, threads).unwrap();
                for (s, w) in scores.iter().zip(&want) {
                    assert!(close(*s, *w, 1e-5), "score {s} vs naive {w}");
                }
                let got = combine_in(Rule::Krum { byzantine: 2 }, &ups, threads).unwrap();
                assert_eq!(got.selected.len(), 1);
                let chosen = got.selected[0];
                assert!(chosen != 2 && chosen != 6, "Krum chose byzantine {chosen}");
                let best = want.iter().copied().fold(f64::INFINITY, f64::min);
                assert!(close(want[chosen], best, 1e-5));
                assert_eq!(got.values, values[chosen]);
            }
        }
    }

    #[test]
    fn multi_krum_selects_honest_updates_and_averages_them() {
        let mut rng = Rng(6);
        for trial in 0..6 {
            let (values, samples) = krum_scenario(&mut rng, 2000 + trial);
            let ups = updates(&values, &samples);
            let rule = Rule::MultiKrum {
                byzantine: 2,
                select: 4,
            };
            let got = combine(rule, &ups).unwrap();
            assert_eq!(got.selected.len(), 4);
            assert!(got.selected.windows(2).all(|w| w[0] < w[1]));
            assert!(got.selected.iter().all(|&i| i != 2 && i != 6));
            // The chosen ones are the four lowest naive scores.
            let naive = naive_krum_scores(&values, 2);
            let worst_chosen = got.selected.iter().map(|&i| naive[i]).fold(0.0, f64::max);
            for i in (0..9).filter(|i| !got.selected.contains(i)) {
                assert!(naive[i] >= worst_chosen * (1.0 - 1e-5));
            }
            let chosen: Vec<Vec<f32>> = got.selected.iter().map(|&i| values[i].clone()).collect();
            let chosen_samples: Vec<u64> = got.selected.iter().map(|&i| samples[i]).collect();
            assert_close(
                &got.values,
                &naive_weighted_mean(&chosen, &chosen_samples),
                1e-6,
            );
        }
    }

    #[test]
    fn colluders_sending_one_vector_are_near_duplicates_and_honest_updates_are_not() {
        let mut rng = Rng(9);
        let honest: Vec<Vec<f32>> = (0..7).map(|_| rng.vec(4096)).collect();
        let fake = rng.vec(4096);
        let mut values = honest.clone();
        values.extend([fake.clone(), fake.clone(), fake]);
        let flags = near_duplicates(&updates(&values, &vec![1; values.len()]));
        assert_eq!(flags, [vec![false; 7], vec![true; 3]].concat());
        let flags = near_duplicates(&updates(&honest, &vec![1; honest.len()]));
        assert!(flags.iter().all(|f| !f));
    }

    #[test]
    fn multi_krum_selects_n_minus_f_by_default() {
        let mut rng = Rng(8);
        let (values, samples) = krum_scenario(&mut rng, 3000);
        let ups = updates(&values, &samples);
        let default = combine(
            Rule::MultiKrum {
                byzantine: 2,
                select: 0,
            },
            &ups,
        )
        .unwrap();
        let explicit = combine(
            Rule::MultiKrum {
                byzantine: 2,
                select: values.len() - 2,
            },
            &ups,
        )
        .unwrap();
        assert_eq!(default.selected.len(), values.len() - 2);
        assert_eq!(default, explicit);
    }

    #[test]
    fn many_updates_match_naive_across_chunks() {
        // 40 updates make the chunk smaller than each thread's range, so ranges hold several.
        let mut rng = Rng(7);
        let n = 40;
        let values: Vec<Vec<f32>> = (0..n).map(|_| rng.vec(10_007)).collect();
        let ups = updates(&values, &vec![1; n]);
        let want = naive_krum_scores(&values, 5);
        let got = krum_scores_in(&ups, 5, 2).unwrap();
        for (s, w) in got.iter().zip(&want) {
            assert!(close(*s, *w, 1e-5), "score {s} vs naive {w}");
        }
        let median: Vec<f32> = naive_median(&values).iter().map(|&m| m as f32).collect();
        assert_eq!(combine_in(Rule::Median, &ups, 2).unwrap().values, median);
    }

    #[test]
    fn krum_needs_more_than_2f_plus_2_updates() {
        let values = vec![vec![1.0f32; 8]; 7];
        let samples = [1; 7];
        assert_eq!(
            combine(
                Rule::Krum { byzantine: 2 },
                &updates(&values[..6], &samples)
            ),
            Err(RuleError::TooFewForKrum {
                updates: 6,
                byzantine: 2
            })
        );
        let multi = Rule::MultiKrum {
            byzantine: 2,
            select: 2,
        };
        assert!(matches!(
            combine(multi, &updates(&values[..5], &samples)),
            Err(RuleError::TooFewForKrum { .. })
        ));
        assert!(combine(Rule::Krum { byzantine: 2 }, &updates(&values, &samples)).is_ok());
        assert!(
            combine(
                Rule::Krum { byzantine: 0 },
                &updates(&values[..2], &samples)
            )
            .is_err()
        );
        assert!(
            combine(
                Rule::Krum { byzantine: 0 },
                &updates(&values[..3], &samples)
            )
            .is_ok()
        );
        assert!(matches!(
            combine(
                Rule::Krum {
                    byzantine: usize::MAX
                },
                &updates(&values, &samples)
            ),
            Err(RuleError::TooFewForKrum { .. })
        ));
    }

    #[test]
    fn outliers_flag_a_scaled_update() {
        let mut rng = Rng(8);
        let base = rng.vec(3001);
        let mut values: Vec<Vec<f32>> = (0..10)
            .map(|_| base.iter().map(|b| b + 0.1 * rng.normal()).collect())
            .collect();
        for v in &mut values[4] {
            *v *= 50.0;
        }
        let ups = updates(&values, &[1; 10]);
        let want: Vec<bool> = (0..10).map(|i| i == 4).collect();
        assert_eq!(outliers(&ups, 3.0), want);
        for threads in [1, 3] {
            assert_eq!(outliers_in(&ups, 3.0, threads), want);
        }
    }

    #[test]
    fn outliers_spare_identical_and_iid_updates() {
        let mut rng = Rng(9);
        let same = vec![rng.vec(2049); 10];
        assert_eq!(outliers(&updates(&same, &[1; 10]), 3.0), vec![false; 10]);
        let zeros = vec![vec![0.0f32; 100]; 5];
        assert_eq!(outliers(&updates(&zeros, &[1; 5]), 3.0), vec![false; 5]);
        let iid: Vec<Vec<f32>> = (0..10).map(|_| rng.vec(4000)).collect();
        assert_eq!(outliers(&updates(&iid, &[1; 10]), 3.0), vec![false; 10]);
        // Without SIGMA_FLOOR about 1 round in 8 flags an honest update (a MAD of 10
        // concentrated distances is tiny and noisy); with it, none may.
        let rounds = 200;
        let flagged: usize = (0..rounds)
            .map(|_| {
                let iid: Vec<Vec<f32>> = (0..10).map(|_| rng.vec(1000)).collect();
                let flags = outliers(&updates(&iid, &[1; 10]), 3.0);
                flags.iter().filter(|&&f| f).count()
            })
            .sum();
        assert_eq!(flagged, 0, "honest updates flagged in {rounds} rounds");
        // Small rounds of honest updates whose sizes differ (batches of different difficulty,
        // computed on different versions) keep every update; the -10 scaled one is still out.
        let direction = rng.vec(4000);
        let mut round: Vec<Vec<f32>> = [1.0f32, 1.6, 0.7]
            .iter()
            .map(|scale| {
                direction
                    .iter()
                    .map(|d| scale * d + 0.3 * rng.normal())
                    .collect()
            })
            .collect();
        assert_eq!(outliers(&updates(&round, &[1; 3]), 3.0), vec![false; 3]);
        round.push(direction.iter().map(|d| -10.0 * d).collect());
        assert_eq!(
            outliers(&updates(&round, &[1; 4]), 3.0),
            [false, false, false, true]
        );
        // Rounds of 3 honest updates whose noise differs by up to 30% either way (batches of
        // different difficulty): the 0.1 floor alone flagged some of them; none may be flagged.
        let flagged: usize = (0..rounds)
            .map(|_| {
                let round: Vec<Vec<f32>> = (0..3)
                    .map(|_| {
                        let spread = 1.0 + 0.6 * rng.uniform() / 2.0;
                        direction
                            .iter()
                            .map(|d| d + spread * rng.normal())
                            .collect()
                    })
                    .collect();
                let flags = outliers(&updates(&round, &[1; 3]), 3.0);
                flags.iter().filter(|&&f| f).count()
            })
            .sum();
        assert_eq!(flagged, 0, "honest updates flagged in {rounds} rounds of 3");
        // Too few to tell who is odd.
        let two = vec![vec![0.0f32; 10], vec![1e6f32; 10]];
        assert_eq!(outliers(&updates(&two, &[1; 2]), 3.0), vec![false; 2]);
        assert!(outliers(&[], 3.0).is_empty());
    }

    #[test]
    fn outliers_are_judged_among_updates_of_the_same_version() {
        let mut rng = Rng(12);
        let (early, late) = (rng.vec(3000), rng.vec(3000));
        let near = |rng: &mut Rng, direction: &[f32], scale: f32| -> Vec<f32> {
            direction
                .iter()
                .map(|d| scale * d + 0.1 * rng.normal())
                .collect()
        };
        // Three honest updates on v1 and four on v2, whose direction has moved on.
        let mut pool: Vec<Vec<f32>> = (0..3).map(|_| near(&mut rng, &early, 1.0)).collect();
        pool.extend((0..4).map(|_| near(&mut rng, &late, 1.0)));
        let mut versions = vec!["v1"; 3];
        versions.extend(["v2"; 4]);
        let ups = updates(&pool, &[1; 7]);
        assert!(
            outliers(&ups, 3.0).iter().any(|&f| f),
            "the mixed pool's median must make honest updates look odd"
        );
        assert_eq!(outliers_by_version(&ups, &versions, 3.0), vec![false; 7]);
        // A fresh honest update alone on v2 beside four on v1 (a Krum round waiting for more).
        let fresh: Vec<Vec<f32>> = pool[..3]
            .iter()
            .cloned()
            .chain([near(&mut rng, &early, 1.0), near(&mut rng, &late, 1.0)])
            .collect();
        let ups = updates(&fresh, &[1; 5]);
        assert!(outliers(&ups, 3.0)[4], "the mixed pool's median");
        assert_eq!(
            outliers_by_version(&ups, &["v1", "v1", "v1", "v1", "v2"], 3.0),
            vec![false; 5]
        );
        // A poisoned update is caught inside its version, and alone on a version of its own.
        pool.push(near(&mut rng, &late, -10.0));
        versions.push("v2");
        pool.push(near(&mut rng, &early, -10.0));
        versions.push("v0");
        let ups = updates(&pool, &[1; 9]);
        let mut want = vec![false; 7];
        want.extend([true, true]);
        assert_eq!(outliers_by_version(&ups, &versions, 3.0), want);
    }

    #[test]
    fn cosine_outer_schedule_decays_to_its_floor() {
        let cosine = OuterSchedule::Cosine { min_ratio: 0.1 };
        assert_eq!(cosine.factor(0.0), 1.0);
        assert!((cosine.factor(0.5) - 0.55).abs() < 1e-6);
        assert!((cosine.factor(1.0) - 0.1).abs() < 1e-6);
        assert!(
            (cosine.factor(7.0) - 0.1).abs() < 1e-6,
            "progress is clamped"
        );
        assert!(cosine.factor(0.3) > cosine.factor(0.6));
        assert_eq!(OuterSchedule::Constant.factor(0.9), 1.0);
        // A scaled optimiser steps by the scaled rate and keeps its other settings.
        let nesterov = OuterOptimizer::Nesterov {
            lr: 0.7,
            momentum: 0.9,
        };
        assert_eq!(
            nesterov.scaled(0.5),
            OuterOptimizer::Nesterov {
                lr: 0.35,
                momentum: 0.9
            }
        );
        let mut params = vec![1.0f32; 8];
        OuterOptimizer::Plain { lr: 1.0 }
            .scaled(0.25)
            .apply(&mut params, &[2.0; 8], &mut OuterState::default())
            .unwrap();
        assert_eq!(params, vec![0.5; 8]);
    }

    #[test]
    fn plain_outer_step_subtracts_delta() {
        let mut rng = Rng(10);
        let start = rng.vec(100_003);
        let delta = rng.vec(100_003);
        let mut params = start.clone();
        let mut state = OuterState::default();
        OuterOptimizer::Plain { lr: 1.0 }
            .apply(&mut params, &delta, &mut state)
            .unwrap();
        let want: Vec<f32> = start.iter().zip(&delta).map(|(p, d)| p - d).collect();
        assert_eq!(params, want);
        assert_eq!(state.steps, 1);
        assert!(state.momentum.is_empty() && state.second_moment.is_empty());
    }

    fn assert_close_f32(got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len());
        for (k, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                "coordinate {k}: {g} vs {w}"
            );
        }
    }

    #[test]
    fn fed_adam_matches_scalar_loop_over_two_steps() {
        let (lr, beta1, beta2, tau) = (0.05f32, 0.9f32, 0.99f32, 1e-3f32);
        let opt = OuterOptimizer::FedAdam {
            lr,
            beta1,
            beta2,
            tau,
        };
        let mut rng = Rng(11);
        let len = 100_003;
        let mut params = rng.vec(len);
        let (mut p, mut m, mut v) = (params.clone(), vec![0.0f32; len], vec![0.0f32; len]);
        let mut state = OuterState::default();
        for step in 1..=2 {
            let delta = rng.vec(len);
            opt.apply(&mut params, &delta, &mut state).unwrap();
            for i in 0..len {
                m[i] = beta1 * m[i] + (1.0 - beta1) * delta[i];
                v[i] = beta2 * v[i] + (1.0 - beta2) * delta[i] * delta[i];
                p[i] -= lr * m[i] / (v[i].sqrt() + tau);
            }
            assert_close_f32(&params, &p);
            assert_close_f32(&state.momentum, &m);
            assert_close_f32(&state.second_moment, &v);
            assert_eq!(state.steps, step);
        }
        assert_eq!(opt.name(), "fedadam");
    }

    #[test]
    fn nesterov_matches_scalar_loop_over_two_steps() {
        let (lr, mu) = (0.7f32, 0.9f32);
        let opt = OuterOptimizer::Nesterov { lr, momentum: mu };
        let mut rng = Rng(12);
        let len = 100_003;
        let mut params = rng.vec(len);
        let (mut p, mut m) = (params.clone(), vec![0.0f32; len]);
        let mut state = OuterState::default();
        for step in 1..=2 {
            let delta = rng.vec(len);
            opt.apply(&mut params, &delta, &mut state).unwrap();
            for i in 0..len {
                m[i] = mu * m[i] + delta[i];
                p[i] -= lr * (delta[i] + mu * m[i]);
            }
            assert_close_f32(&params, &p);
            assert_close_f32(&state.momentum, &m);
            assert!(state.second_moment.is_empty());
            assert_eq!(state.steps, step);
        }
        assert_eq!(opt.name(), "nesterov");
    }

    #[test]
    fn outer_step_rejects_bad_input_without_touching_anything() {
        let mut params = vec![1.0f32; 8];
        let mut state = OuterState::default();
        let nesterov = OuterOptimizer::Nesterov {
            lr: 0.7,
            momentum: 0.9,
        };
        assert_eq!(
            nesterov.apply(&mut params, &[0.0; 7], &mut state),
            Err(RuleError::LengthMismatch {
                expected: 8,
                found: 7,
                index: 0
            })
        );
        let bad = [
            OuterOptimizer::Plain { lr: f32::NAN },
            OuterOptimizer::Plain { lr: 0.0 },
            OuterOptimizer::Nesterov {
                lr: 1.0,
                momentum: 1.0,
            },
            OuterOptimizer::FedAdam {
                lr: 1.0,
                beta1: 0.9,
                beta2: 1.0,
                tau: 1e-3,
            },
            OuterOptimizer::FedAdam {
                lr: 1.0,
                beta1: 0.9,
                beta2: 0.99,
                tau: 0.0,
            },
        ];
        for opt in bad {
            assert!(matches!(
                opt.apply(&mut params, &[1.0; 8], &mut state),
                Err(RuleError::BadParameter(_))
            ));
        }
        let mut wrong = OuterState {
            momentum: vec![0.0; 3],
            ..OuterState::default()
        };
        assert!(matches!(
            nesterov.apply(&mut params, &[1.0; 8], &mut wrong),
            Err(RuleError::BadParameter(_))
        ));
        assert_eq!(params, vec![1.0; 8]);
        assert_eq!(state, OuterState::default());
        assert_eq!(wrong.momentum.len(), 3);
    }

    #[test]
    fn cosine_similarity_of_parallel_opposite_and_orthogonal_vectors() {
        let mut rng = Rng(13);
        let a = rng.vec(100_003);
        let scaled: Vec<f32> = a.iter().map(|x| 3.0 * x).collect();
        let opposite: Vec<f32> = a.iter().map(|x| -0.5 * x).collect();
        assert!((cosine_similarity(&a, &scaled) - 1.0).abs() < 1e-6);
        assert!((cosine_similarity(&a, &opposite) + 1.0).abs() < 1e-6);
        let even: Vec<f32> = (0..1001).map(|i| (i % 2) as f32).collect();
        let odd: Vec<f32> = (0..1001).map(|i| ((i + 1) % 2) as f32 * 2.0).collect();
        assert_eq!(cosine_similarity(&even, &odd), 0.0);
        assert_eq!(cosine_similarity(&a, &vec![0.0; a.len()]), 0.0);
        assert_eq!(cosine_similarity(&[], &[]), 0.0);
        let b = rng.vec(a.len());
        let dot: f64 = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| f64::from(x) * f64::from(y))
            .sum();
        let norm = |v: &[f32]| v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
        let naive = dot / (norm(&a) * norm(&b));
        assert!((cosine_similarity(&a, &b) - naive).abs() < 1e-6);
    }
}
