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
matmul` (its shapes are defined there), built first. Prints one Markdown row per shape: GFLOP/s
of each side (median over the rounds) and ours as a share of the faster BLAS.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run by --python: times numpy's and torch's matmul on the shapes ours printed.
REFERENCE = r"""
import json, sys, time
import numpy as np
import torch
threads, reps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
for line in sys.stdin:
    s = json.loads(line)
    a = np.random.standard_normal((s["batch"], s["m"], s["k"])).astype(np.float32)
    b = np.random.standard_normal((s["batch"], s["k"], s["n"])).astype(np.float32)
    out = {"shape": s["shape"]}
    for side, (x, y, mm) in {"numpy": (a, b, np.matmul),
                             "torch": (torch.from_numpy(a), torch.from_numpy(b), torch.matmul)}.items():
        mm(x, y)
        times = []
        for _ in range(reps):
            t = time.perf_counter(); mm(x, y); times.append(time.perf_counter() - t)
        out[side] = sorted(times)[len(times) // 2]
    print(json.dumps(out), flush=True)
"""


def ours(reps, features, threads):
    cmd = ["cargo", "bench", "-q", "-p", "hrm-model", "--bench", "matmul", "--features", features,
           "--", "--reps", str(reps)]
    # candle sizes its matmul's thread pool from rayon's variable.
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def reference(python, shapes, threads, reps):
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    stdin = "".join(json.dumps(s) + "\n" for s in shapes)
    out = subprocess.run([python, "-c", REFERENCE, str(threads), str(reps)], input=stdin, env=env,
                         check=True, capture_output=True, text=True).stdout
    return {r["shape"]: r for r in map(json.loads, out.splitlines())}


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
