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
//! While another process keeps the team's other threads from their cores, each call would wait
//! for them; calls then run on the calling thread alone for a while ([`HeldUp`]).
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
use std::time::Instant;

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
    // late) works both; nested calls, and calls while the team is held up, run every item on
    // the calling thread.
    share_out(threads, |items| {
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

/// `work` over the items `0..items` in ranges, on candle's team (its `execute_chunked`, which
/// hands the ranges out from a shared cursor), or all of them on the calling thread while the
/// team is held up ([`HeldUp`]).
pub(crate) fn share_out(items: usize, work: impl Fn(Range<usize>) + Sync) {
    if items == 0 {
        return;
    }
    if HELD_UP.solo(|| HELD_UP.now()) {
        work(0..items);
        return;
    }
    let team = candle_core::utils::barrier_pool();
    let calls = CALLS.get().wrapping_add(1);
    CALLS.set(calls);
    if !calls.is_multiple_of(HeldUp::TIME_EVERY) {
        team.execute_chunked(items, work);
        return;
    }
    let start = HELD_UP.now();
    let own_end = AtomicU64::new(start);
    let was_calling = CALLING.replace(true);
    team.execute_chunked(items, |range| {
        work(range);
        if CALLING.get() {
            own_end.store(HELD_UP.now(), Ordering::Relaxed);
        }
    });
    CALLING.set(was_calling);
    HELD_UP.record(start, own_end.load(Ordering::Relaxed), HELD_UP.now());
}

thread_local! {
    /// Whether this thread is the one that called [`share_out`] (its own ranges are timed).
    static CALLING: Cell<bool> = const { Cell::new(false) };
    /// This thread's calls of [`share_out`] on the team, of which every
    /// [`HeldUp::TIME_EVERY`]th is timed.
    static CALLS: Cell<u32> = const { Cell::new(0) };
}

/// Whether the team's other threads are held up by other work on the machine, judged by how long
/// the calling thread waits for them after its own part of a call.
///
/// A call of candle's team returns only once every thread of the team has taken part. Where
/// another process keeps a core busy, the kernel runs one of the team's threads only now and
/// then, and every call waits for it: beside one busy process on a 2-core Intel Xeon (family 6
/// model 167), a GGUF's batch-1 decode ran at 65–67 tok/s on two threads against 145 on one
/// (docs/performance.md).
/// So a call whose calling thread waited long, both against its own part and in time, sends
/// the calls after it to the calling thread alone for a window. After the window, calls go to
/// the team again; another long wait doubles the window, and a short one closes it.
///
/// On an idle machine the calling thread waits about a grain of the other thread's at most (an
/// eighth of its own part), so no window opens but for a VM's rare longer pause of a core.
///
/// Its fields share a line pair of their own, read at every call and written only when a window
/// opens or closes, so that no other value written often sits on their line.
#[repr(align(128))]
struct HeldUp {
    /// The end of the window, in [`Self::now`]; 0 when none is open.
    until: AtomicU64,
    /// The last window's length, in ns; 0 after a call that did not wait long.
    window: AtomicU64,
    /// What [`Self::now`] counts from.
    start: OnceLock<Instant>,
}

static HELD_UP: HeldUp = HeldUp::new();

impl HeldUp {
    /// A wait after the calling thread's own part that opens a window. On an idle 2-core VM
    /// (an Intel Xeon, family 6 model 167) waits of 0.2–0.4 ms came a few times a second, and
    /// of 1–4 ms two or three times in a GGUF's run of a few seconds; beside a busy process,
    /// the first long wait was 2.2 ms.
    const LONG_WAIT_NS: u64 = 1_000_000;
    /// A wait that opens a window where the calling thread did none of the call's work: beside
    /// a busy process, every first call after a window ran so and waited 0.35–0.6 ms.
    const MISSED_NS: u64 = 100_000;
    /// One call in this many is timed: timing every call made a GGUF's batch-1 decode
    /// 0.979–0.992× as fast on the idle VM above, and where the team is held up, most calls
    /// wait long.
    const TIME_EVERY: u32 = 8;
    const FIRST_WINDOW_NS: u64 = 2_000_000;
    const LONGEST_WINDOW_NS: u64 = 256_000_000;

    const fn new() -> Self {
        Self {
            until: AtomicU64::new(0),
            window: AtomicU64::new(0),
            start: OnceLock::new(),
        }
    }

    /// Nanoseconds since the first time this was asked.
    fn now(&self) -> u64 {
        self.start.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }

    /// Whether calls run on the calling thread alone now; reads the clock only inside a window.
    fn solo(&self, now: impl Fn() -> u64) -> bool {
        let until = self.until.load(Ordering::Relaxed);
        until != 0 && now() < until
    }

    /// A team call that started at `start`, whose calling thread finished its own part at
    /// `own_end`, and that returned at `end`.
    fn record(&self, start: u64, own_end: u64, end: u64) {
        let (own, wait) = (own_end.saturating_sub(start), end.saturating_sub(own_end));
        let held_up = if own == 0 {
            // The calling thread did none of the call's work: by our reading, the kernel ran
            // the thread it woke (after a window, the other thread sleeps) in its place.
            wait > Self::MISSED_NS
        } else {
            wait > Self::LONG_WAIT_NS && wait > own / 4
        };
        if held_up {
            let last = self.window.load(Ordering::Relaxed);
            let window = (2 * last).clamp(Self::FIRST_WINDOW_NS, Self::LONGEST_WINDOW_NS);
            self.window.store(window, Ordering::Relaxed);
            self.until.store(end + window, Ordering::Relaxed);
        } else if self.window.load(Ordering::Relaxed) != 0 {
            self.window.store(0, Ordering::Relaxed);
            self.until.store(0, Ordering::Relaxed);
        }
    }
}

/// The team's threads, the calling thread included.
pub(crate) fn threads() -> usize {
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
    let per_run = out.len().div_ceil(len).div_ceil(threads() * 8).max(1);
    let runs: Vec<Mutex<&mut [T]>> = out.chunks_mut(len * per_run).map(Mutex::new).collect();
    share_out(runs.len(), |range| {
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
    share_out(n, |range| {
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

    /// Every kind of call once, each output a function of its place.
    fn each_kind_of_call() -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<usize>) {
        let place = |columns: Range<usize>, block: &mut [f32]| {
            let rows = block.len() / columns.len();
            for (c, j) in columns.enumerate() {
                for i in 0..rows {
                    block[c * rows + i] = (i * 7919 + j) as f32;
                }
            }
        };
        let mut chunks = vec![0f32; 1003];
        chunks_in_parallel(&mut chunks, 10, |chunk, values| {
            for (k, v) in values.iter_mut().enumerate() {
                *v = (chunk * 10 + k) as f32;
            }
        });
        (
            row_in_parallel(49_152, place),
            columns_in_parallel(3, 1000, place),
            chunks,
            map_in_parallel(1000, |i| i * 3),
        )
    }

    #[test]
    fn calls_give_the_same_on_the_calling_thread_alone() {
        let on_the_team = each_kind_of_call();
        // A window that no short wait closes. A long wait in a test running beside this one
        // would replace it with a short one, after which some calls would go to the team; only
        // a pass that the window held from start to end counts.
        let alone = (0..100)
            .find_map(|_| {
                HELD_UP.window.store(0, Ordering::Relaxed);
                HELD_UP.until.store(u64::MAX, Ordering::Relaxed);
                let alone = each_kind_of_call();
                (HELD_UP.until.load(Ordering::Relaxed) == u64::MAX).then_some(alone)
            })
            .expect("a pass with the window held throughout");
        HELD_UP.until.store(0, Ordering::Relaxed);
        assert_eq!(alone, on_the_team);
    }

    #[test]
    fn a_long_wait_sends_calls_to_the_calling_thread_for_a_doubling_window() {
        const MS: u64 = 1_000_000;
        let held = HeldUp::new();
        assert!(!held.solo(|| unreachable!("no window open, so no clock read")));
        // No window for: a wait over 1 ms but under a quarter of the calling thread's own part
        // (a grain of the other thread's, on an idle machine); a wait under 1 ms after a short
        // part; a call that ran all elsewhere but waited under 100 µs.
        held.record(0, 8 * MS, 9 * MS + 500_000);
        held.record(10 * MS, 10 * MS + 1_000, 10 * MS + 900_000);
        held.record(11 * MS, 11 * MS, 11 * MS + 50_000);
        assert!(!held.solo(|| unreachable!()));
        // A short part and a long wait: the first window.
        held.record(10 * MS, 10 * MS + 20_000, 13 * MS);
        assert!(held.solo(|| 14 * MS));
        assert!(!held.solo(|| 15 * MS));
        // The call after it waits long again: twice the window.
        held.record(15 * MS, 15 * MS + 20_000, 18 * MS);
        assert!(held.solo(|| 21 * MS));
        assert!(!held.solo(|| 22 * MS));
        // Doubling stops at the longest window.
        let mut at = 22 * MS;
        for _ in 0..20 {
            held.record(at, at + 20_000, at + 3 * MS);
            at += 3 * MS + HeldUp::LONGEST_WINDOW_NS;
        }
        assert_eq!(
            held.window.load(Ordering::Relaxed),
            HeldUp::LONGEST_WINDOW_NS
        );
        // A call that did not wait long closes the window.
        held.record(at, at + 20_000, at + 30_000);
        assert!(!held.solo(|| unreachable!()));
        held.record(at, at + 20_000, at + 3 * MS);
        assert_eq!(held.window.load(Ordering::Relaxed), HeldUp::FIRST_WINDOW_NS);
        // A call whose calling thread did none of the work and then waited opens one too.
        held.record(at, at + 20_000, at + 30_000);
        held.record(at, at, at + 400_000);
        assert!(held.solo(|| at + 400_000 + MS));
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
