//! Work split over candle's persistent thread team (`candle_core::utils::barrier_pool`), for
//! our CPU kernels: decode steps, the fused training ops, and the blocks of a large product.
//!
//! candle's own CPU kernels hand their work to this team, whose workers spin briefly between
//! calls and then park. Our kernels use the same team rather than a second pool (rayon's, or
//! gemm's parallel mode, which is rayon's), so that no two pools compete for the cores between
//! one op and the next. Each of our calls is a call of candle's team: holding the other threads
//! inside one such call for a whole decode step, and handing each call over through one line
//! they watched, made a GGUF's batch-1 decode 1.008× as fast on an Intel Xeon (family 6 model
//! 167; docs/performance.md), within the runs' spread. By our reading, a call's cost is mostly
//! the lines that its work and its claims pass between the cores, not candle's bookkeeping.
//!
//! A product's columns go out in grains ([`grains_in_parallel`]): each thread works a run of
//! consecutive grains in order, so its weights stream, and then helps from the back of another
//! thread's run; a compare-and-swap on the run's bounds gives every grain to exactly one thread.
//!
//! Workers finish their parts in any order. They write disjoint elements of one output through
//! relaxed atomics (a plain store on x86), disjoint runs of chunks each behind its own
//! uncontended lock, or set-once slots. A single row's grains, the hot path of a batch-1
//! decode step, are written through a shared pointer instead, which is sound because every
//! grain goes to exactly one thread ([`Run`]).

use std::cell::Cell;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
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
        return row_in_parallel(n, fill);
    }
    let dst = zeroed(rows * n);
    let grain = n.div_ceil(threads() * GRAINS_PER_THREAD).max(1);
    grains_in_parallel(n.div_ceil(grain), |g| {
        let range = g * grain..n.min((g + 1) * grain);
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

/// One row of `n` outputs (a batch-1 decode step's product), each thread filling its grains'
/// slices of the output in place, with nothing to copy or scatter.
fn row_in_parallel(n: usize, fill: impl Fn(Range<usize>, &mut [f32]) + Sync) -> Vec<f32> {
    let mut out = vec![0f32; n];
    let grain = n.div_ceil(threads() * GRAINS_PER_THREAD).max(1);
    let row = SharedRow(out.as_mut_ptr());
    grains_in_parallel(n.div_ceil(grain), |g| {
        let columns = g * grain..n.min((g + 1) * grain);
        // SAFETY: `columns` lies within `out`, which outlives the call and is not otherwise
        // touched during it; `grains_in_parallel` gives each grain to exactly one call, so no
        // two live slices overlap.
        let slice = unsafe { std::slice::from_raw_parts_mut(row.at(columns.start), columns.len()) };
        fill(columns, slice);
    });
    out
}

/// The start of a row that the team's threads write in disjoint grains. A lock per grain
/// (uncontended, but two locked instructions per grain, on lines the calling thread had just
/// written) took about two fifths of the grain loop's own time in a batch-1 GGUF step
/// (docs/performance.md).
struct SharedRow(*mut f32);

// SAFETY: the threads only write through the pointer in `row_in_parallel`, each to the grains
// it alone claimed.
unsafe impl Sync for SharedRow {}

impl SharedRow {
    /// The pointer `offset` values in. A method, so that closures capture the whole `Sync`
    /// struct rather than its raw pointer.
    fn at(&self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// `work(g)` once for every grain `g` in `0..count`, in parallel: each thread owns an equal run
/// of consecutive grains and works it front to back, so a product's weights stream in order on
/// every thread; a thread done with its own run takes grains from the back of another's. Static
/// halves left one thread waiting for the other at every product, in either direction, as the
/// two cores' speeds wandered, and handing grains out from one shared cursor (candle's way)
/// cut each thread's stream into pieces (docs/performance.md measures both).
fn grains_in_parallel(count: usize, work: impl Fn(usize) + Sync) {
    let threads = threads();
    let mut runs = SPARE_RUNS.take();
    runs.clear();
    runs.extend((0..threads).map(|t| Run::new(t * count / threads, (t + 1) * count / threads)));
    // One item per run: whichever thread takes an item works that run from the front, then
    // helps the others from their backs. A thread that takes two items (its partner started
    // late) works both, and nested calls run every item on the calling thread.
    candle_core::utils::barrier_pool().execute_chunked(threads, |items| {
        for own in items {
            while let Some(g) = runs[own].take_front() {
                work(g);
            }
            for other in (1..threads).map(|o| (own + o) % threads) {
                while let Some(g) = runs[other].take_back() {
                    work(g);
                }
            }
        }
    });
    SPARE_RUNS.set(runs);
}

/// The team's threads, the calling thread included.
fn threads() -> usize {
    candle_core::utils::barrier_pool().n_workers() + 1
}

thread_local! {
    /// The runs of this thread's last [`grains_in_parallel`], kept for its next: runs aligned
    /// to 128 bytes go through glibc's aligned allocation, a slow path, at every product.
    static SPARE_RUNS: Cell<Vec<Run>> = const { Cell::new(Vec::new()) };
}

/// Grains per thread in [`grains_in_parallel`]: enough that the last one taken is a small part
/// of a thread's share, few enough that the claims cost nothing next to the products. The output
/// head's grains are long (3,072 rows on two threads at batch 1), yet cut to 1,024 or 512 rows
/// they made a GGUF's decode step 1.005× and 0.983× as fast on an Intel Xeon (family 6 model
/// 167; docs/performance.md).
const GRAINS_PER_THREAD: usize = 8;

/// The unclaimed grains `lo..hi` of one thread's run, packed in one atomic so that its owner
/// (from the front) and a helper (from the back) never both claim the last one. Each run has a
/// line pair of its own: two owners claiming their grains side by side in one line would pass
/// it from core to core at every claim.
#[repr(align(128))]
struct Run(AtomicU64);

impl Run {
    fn new(lo: usize, hi: usize) -> Self {
        Self(AtomicU64::new(((lo as u64) << 32) | hi as u64))
    }

    fn take_front(&self) -> Option<usize> {
        self.take(|lo, hi| (lo, (lo + 1, hi)))
    }

    fn take_back(&self) -> Option<usize> {
        self.take(|lo, hi| (hi - 1, (lo, hi - 1)))
    }

    /// Claims the grain that `pick(lo, hi)` names, leaving the range it returns.
    fn take(&self, pick: impl Fn(u64, u64) -> (u64, (u64, u64))) -> Option<usize> {
        let mut current = self.0.load(Ordering::Acquire);
        loop {
            let (lo, hi) = (current >> 32, current & u64::from(u32::MAX));
            if lo >= hi {
                return None;
            }
            let (grain, (lo, hi)) = pick(lo, hi);
            match self.0.compare_exchange_weak(
                current,
                (lo << 32) | hi,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(grain as usize),
                Err(seen) => current = seen,
            }
        }
    }
}

/// `fill(i, chunk)` over the `len`-value chunks of `out` (the last may be shorter), in
/// parallel. The chunks go out in runs of several, each run behind its own lock, which only
/// the thread that takes the run locks: about eight runs per thread, as candle's team hands
/// out its ranges, so short rows cost few locks.
pub(crate) fn chunks_in_parallel<T: Send>(
    out: &mut [T],
    len: usize,
    fill: impl Fn(usize, &mut [T]) + Sync,
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
    let runs: Vec<Mutex<&mut [T]>> = out.chunks_mut(len * per_run).map(Mutex::new).collect();
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
        chunks_in_parallel::<f32>(&mut [], 7, |_, _| unreachable!());
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

    #[test]
    fn a_rows_grains_are_each_filled_once() {
        for n in [1, 7, 16, 1000, 49_152] {
            let calls: Vec<AtomicU32> = zeroed(n);
            let out = row_in_parallel(n, |columns, slice| {
                assert_eq!(slice.len(), columns.len());
                for (j, v) in columns.zip(slice.iter_mut()) {
                    calls[j].fetch_add(1, Ordering::Relaxed);
                    *v = j as f32;
                }
            });
            assert!(out.iter().enumerate().all(|(j, v)| *v == j as f32), "{n}");
            assert!(calls.iter().all(|c| c.load(Ordering::Relaxed) == 1), "{n}");
        }
    }

    #[test]
    fn a_run_gives_each_grain_to_one_claimant() {
        let run = Run::new(3, 11);
        let mut claimed = Vec::new();
        while let (Some(front), back) = (run.take_front(), run.take_back()) {
            claimed.push(front);
            claimed.extend(back);
        }
        assert_eq!(run.take_back(), None);
        claimed.sort_unstable();
        assert_eq!(claimed, (3..11).collect::<Vec<_>>());
        // Two threads draining one run from both ends share it out exactly.
        let run = Run::new(0, 100_000);
        let (front, back) = std::thread::scope(|s| {
            let front = s.spawn(|| std::iter::from_fn(|| run.take_front()).collect::<Vec<_>>());
            let back = std::iter::from_fn(|| run.take_back()).collect::<Vec<_>>();
            (front.join().unwrap(), back)
        });
        let mut all: Vec<usize> = front.into_iter().chain(back).collect();
        all.sort_unstable();
        assert_eq!(all, (0..100_000).collect::<Vec<_>>());
    }
}
