//! Work split over candle's persistent thread team (`candle_core::utils::barrier_pool`), for
//! our CPU kernels: decode steps, the fused training ops, and the blocks of a large product.
//!
//! candle's own CPU kernels hand their work to this team, whose workers spin briefly between
//! calls and then park. Our kernels use the same team rather than a second pool (rayon's, or
//! gemm's parallel mode, which is rayon's), so that no two pools compete for the cores between
//! one op and the next.
//!
//! Workers finish their parts in any order. They write disjoint elements of one output through
//! relaxed atomics (a plain store on x86), disjoint runs of chunks each behind its own
//! uncontended lock, or set-once slots; none of it needs `unsafe`.

use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

/// Columns that [`columns_in_parallel`] moves into the output together: a 64-byte line of
/// each row.
const SCATTER_COLUMNS: usize = 16;

/// A `rows × n` row-major output whose columns are computed in parallel: `fill(columns, block)`
/// fills `block[(j - columns.start) * rows + i]` with element `(i, j)` for every `j` in
/// `columns`.
pub(crate) fn columns_in_parallel(
    rows: usize,
    n: usize,
    fill: impl Fn(Range<usize>, &mut [f32]) + Sync,
) -> Vec<f32> {
    if rows == 1 {
        // A single row's block is its own slice of the output (a batch-1 decode step's
        // product): each thread fills that slice in place, with nothing to copy or scatter.
        let mut out = vec![0f32; n];
        let len = n.div_ceil(candle_core::utils::barrier_pool().n_workers() + 1);
        chunks_in_parallel(&mut out, len, |c, chunk| {
            fill(c * len..c * len + chunk.len(), chunk)
        });
        return out;
    }
    let dst = zeroed(rows * n);
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        let mut block = vec![0f32; range.len() * rows];
        fill(range.clone(), &mut block);
        // Transposed a few columns at a time, row by row: output rows lie `n` values apart, so
        // a column at a time would touch a new line (and, over a prefill's rows, a new page)
        // per value (docs/performance.md measures the difference).
        for (b, columns) in block.chunks(SCATTER_COLUMNS * rows.max(1)).enumerate() {
            let start = range.start + b * SCATTER_COLUMNS;
            for i in 0..rows {
                let row = &dst[i * n + start..];
                for (out, column) in row.iter().zip(columns.chunks_exact(rows)) {
                    out.store(column[i].to_bits(), Ordering::Relaxed);
                }
            }
        }
    });
    into_values(dst)
}

/// `fill(i, chunk)` over the `len`-value chunks of `out` (the last may be shorter), in
/// parallel. The chunks go out in runs of several, each run behind its own lock, which only
/// the thread that takes the run locks: about eight runs per thread, as candle's team hands
/// out its ranges, so short rows cost few locks.
pub(crate) fn chunks_in_parallel(
    out: &mut [f32],
    len: usize,
    fill: impl Fn(usize, &mut [f32]) + Sync,
) {
    let len = len.max(1);
    if out.is_empty() {
        return;
    }
    if out.len() <= len {
        // One chunk (a small parameter's AdamW step): nothing to share.
        fill(0, out);
        return;
    }
    let team = candle_core::utils::barrier_pool();
    let per_run = out
        .len()
        .div_ceil(len)
        .div_ceil((team.n_workers() + 1) * 8)
        .max(1);
    let runs: Vec<Mutex<&mut [f32]>> = out.chunks_mut(len * per_run).map(Mutex::new).collect();
    team.execute_chunked(runs.len(), |range| {
        for r in range {
            let mut run = runs[r].lock().unwrap_or_else(PoisonError::into_inner);
            for (j, chunk) in run.chunks_mut(len).enumerate() {
                fill(r * per_run + j, chunk);
            }
        }
    });
}

/// `make(i)` for every `i` in `0..n`, in parallel, in order.
pub(crate) fn map_in_parallel<T: Send + Sync>(
    n: usize,
    make: impl Fn(usize) -> T + Sync,
) -> Vec<T> {
    let slots: Vec<OnceLock<T>> = (0..n).map(|_| OnceLock::new()).collect();
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        for i in range {
            // Each index is in exactly one range, so its slot is empty here.
            let _ = slots[i].set(make(i));
        }
    });
    slots
        .into_iter()
        .map(|slot| slot.into_inner().expect("every index was made"))
        .collect()
}

fn zeroed(len: usize) -> Vec<AtomicU32> {
    (0..len).map(|_| AtomicU32::new(0)).collect()
}

fn into_values(dst: Vec<AtomicU32>) -> Vec<f32> {
    dst.into_iter()
        .map(|v| f32::from_bits(v.into_inner()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_column_chunk_and_slot_lands_in_its_place() {
        // One row takes the in-place path, several rows the scatter.
        for (rows, n) in [(3, 1000), (1, 1001), (1, 1)] {
            let out = columns_in_parallel(rows, n, |columns, block| {
                assert_eq!(block.len(), columns.len() * rows);
                for (c, j) in columns.enumerate() {
                    for i in 0..rows {
                        block[c * rows + i] = (i * n + j) as f32;
                    }
                }
            });
            assert_eq!(out.len(), rows * n);
            assert!(out.iter().enumerate().all(|(e, v)| *v == e as f32));
        }
        chunks_in_parallel(&mut [], 7, |_, _| unreachable!());
        let mut one = [0f32; 5];
        chunks_in_parallel(&mut one, 7, |i, chunk| chunk.fill(i as f32 + 1.0));
        assert_eq!(one, [1.0; 5]);
        let mut out = vec![0f32; 1003];
        chunks_in_parallel(&mut out, 10, |chunk, values| {
            for (k, v) in values.iter_mut().enumerate() {
                *v = (chunk * 10 + k) as f32;
            }
        });
        assert!(out.iter().enumerate().all(|(e, v)| *v == e as f32));
        let made = map_in_parallel(1000, |i| i * 3);
        assert!(made.iter().enumerate().all(|(i, v)| *v == i * 3));
    }
}
