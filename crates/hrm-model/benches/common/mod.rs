//! What the one-line-per-shape benches (`matmul`, `quantized`) share: their `--reps` argument
//! and the median time of one call.

use std::time::Instant;

/// The `--reps N` argument, or `default`.
pub fn reps(default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1))
        .map_or(default, |r| r.parse().expect("--reps takes a number"))
}

/// The median wall time of `reps` calls of `call`, in seconds, after one call to warm up.
pub fn median_seconds(reps: usize, mut call: impl FnMut()) -> f64 {
    call();
    let mut times: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let started = Instant::now();
            call();
            started.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}
