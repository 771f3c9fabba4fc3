#!/usr/bin/env python3
"""candle's f32 matrix multiply (ours) beside a tuned BLAS on the shapes our models run, measured
alternately in one run: OpenBLAS through numpy and PyTorch's CPU matmul, all on
the same number of threads.

    python3 benches/gemm_compare.py --python /tmp/ref/bin/python --rounds 3
    python3 benches/gemm_compare.py --python /tmp/ref/bin/python --features avx512-gemm
    python3 benches/gemm_compare.py --python /tmp/ref/bin/python --threads 1   # one core each

`--threads 1` asks what one core of each does: the question for our products, which cut each
large product into one single-threaded block per thread. `--python` is a Python with numpy and
torch (the reference environment of tests/reference); ours is `cargo bench -p hrm-model --bench
matmul` (its shapes are defined there), built first. Each side runs in a process of its own.
Prints one Markdown row per shape: GFLOP/s of each side (median over the rounds) and ours as a
share of the faster BLAS.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run by --python, once per side: times numpy's or torch's matmul on the shapes ours printed. Each
# side has a process of its own, so that one library's threads, which spin for a while after each
# call, never take a core from the other's calls (on 2 cores, PyTorch's first two shapes measured
# at a quarter and two fifths of their pace behind numpy's).
REFERENCE = r"""
import json, sys, time
import numpy as np
threads, reps, side = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if side == "torch":
    import torch
    torch.set_num_threads(threads)
    convert, mm = torch.from_numpy, torch.matmul
else:
    convert, mm = (lambda x: x), np.matmul
for line in sys.stdin:
    s = json.loads(line)
    x = convert(np.random.standard_normal((s["batch"], s["m"], s["k"])).astype(np.float32))
    y = convert(np.random.standard_normal((s["batch"], s["k"], s["n"])).astype(np.float32))
    mm(x, y)
    times = []
    for _ in range(reps):
        t = time.perf_counter(); mm(x, y); times.append(time.perf_counter() - t)
    print(json.dumps({"shape": s["shape"], "seconds": sorted(times)[len(times) // 2]}), flush=True)
"""


def ours(reps, features, threads):
    cmd = ["cargo", "bench", "-q", "-p", "hrm-model", "--bench", "matmul", "--features", features,
           "--", "--reps", str(reps)]
    # candle sizes its matmul's thread pool from rayon's variable.
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def reference(python, shapes, threads, reps):
    """{shape: {side: seconds}} for numpy and torch, each side in a process of its own."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    stdin = "".join(json.dumps(s) + "\n" for s in shapes)
    results = {}
    for side in ("numpy", "torch"):
        out = subprocess.run([python, "-c", REFERENCE, str(threads), str(reps), side], input=stdin,
                             env=env, check=True, capture_output=True, text=True).stdout
        for r in map(json.loads, out.splitlines()):
            results.setdefault(r["shape"], {})[side] = r["seconds"]
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="a Python with numpy and torch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--features", default="", help="hrm-model features for ours, e.g. avx512-gemm")
    args = parser.parse_args()

    seconds = {}  # (shape, side) -> [seconds per round]
    shapes = None
    for round_ in range(args.rounds):
        print(f"round {round_ + 1} of {args.rounds}", file=sys.stderr)
        candle = ours(args.reps, args.features, args.threads)
        shapes = shapes or candle
        for s in candle:
            seconds.setdefault((s["shape"], "candle"), []).append(s["seconds"])
        for name, r in reference(args.python, candle, args.threads, args.reps).items():
            for side in ("numpy", "torch"):
                seconds.setdefault((name, side), []).append(r[side])

    print("| shape | batch × m × k × n | candle GFLOP/s | OpenBLAS (numpy) | PyTorch | candle ÷ faster |")
    print("|---|---|---|---|---|---|")
    for s in shapes:
        flops = 2 * s["batch"] * s["m"] * s["k"] * s["n"]
        rate = {side: flops / statistics.median(seconds[(s["shape"], side)]) / 1e9
                for side in ("candle", "numpy", "torch")}
        best = max(rate["numpy"], rate["torch"])
        print(f"| {s['shape']} | {s['batch']} × {s['m']} × {s['k']} × {s['n']} | {rate['candle']:.1f} "
              f"| {rate['numpy']:.1f} | {rate['torch']:.1f} | {rate['candle'] / best:.2f}× |")


if __name__ == "__main__":
    main()
