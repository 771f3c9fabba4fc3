#!/usr/bin/env python3
"""The acceptance figures of `hrm serve` (shared/spec/inference-service.md), measured on this machine.

    python3 benches/serve_bench.py --hrm target/release/hrm [--model models/sample] [--seconds 20]

Starts `hrm serve` itself (CPU, --max-batch-size 8) and reports, as one JSON object:
  * ready_seconds           process start to the first 200 from /readyz (spec target: under 60 s)
  * two_prompts_seconds     one /generate with two prompts, max_tokens 32 (target: under 2 s)
  * batch16_rss_mb          resident memory after each of 5 consecutive 16-prompt requests
                            (target: no out-of-memory, stable RSS)
  * requests_per_second     sustained /generate rate with 8 concurrent clients, one prompt and
                            16 tokens each, for --seconds (target: 10 req/s at batch size 8)
  * drain                   SIGTERM under that load: requests that were in flight must all finish
                            with 200, and the process must exit 0
Uses only the Python standard library; it is a benchmark, not a test, and is not run in CI.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request

from common import free_port, post, rss_mb

PROMPTS = [
    "It was a dark and stormy night",
    "In the beginning God created",
    "The quick brown fox",
    "Call me Ishmael.",
    "To be, or not to be,",
    "It is a truth universally acknowledged",
    "Once upon a time",
    "The king said unto",
]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hrm", default="target/release/hrm")
    p.add_argument("--model", default="models/sample")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    server = subprocess.Popen(
        [args.hrm, "serve", "--host", "127.0.0.1", "--port", str(port), "--model-path", args.model,
         "--device", "cpu", "--max-batch-size", "8", "--log-level", "warn"],
    )
    report = {"model": args.model}
    try:
        while True:
            try:
                with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.perf_counter() - started > 120:
                raise SystemExit("not ready after 120 s")
            time.sleep(0.05)
        report["ready_seconds"] = round(time.perf_counter() - started, 3)

        t = time.perf_counter()
        status, body = post(base, "/generate", {"prompts": PROMPTS[:2], "max_tokens": 32, "temperature": 0})
        report["two_prompts_seconds"] = round(time.perf_counter() - t, 3)
        report["two_prompts_completion_tokens"] = body["usage"]["completion_tokens"]

        rss = []
        for _ in range(5):
            status, body = post(base, "/generate", {"prompts": (PROMPTS * 2)[:16], "max_tokens": 64, "temperature": 0.7, "seed": 1})
            assert status == 200 and len(body["completions"]) == 16
            rss.append(round(rss_mb(server.pid), 1))
        report["batch16_rss_mb"] = rss

        latencies, failures, done = [], [], threading.Event()
        lock = threading.Lock()

        def client(i):
            n = 0
            while not done.is_set():
                t0 = time.perf_counter()
                try:
                    status, _ = post(base, "/generate", {"prompts": [PROMPTS[(i + n) % len(PROMPTS)]], "max_tokens": 16, "temperature": 0})
                    with lock:
                        latencies.append(time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 - every failure counts
                    with lock:
                        failures.append(repr(e))
                n += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.concurrency)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        time.sleep(args.seconds)
        done.set()
        for th in threads:
            th.join()
        elapsed = time.perf_counter() - t
        latencies.sort()
        report["requests_per_second"] = round(len(latencies) / elapsed, 2)
        report["latency_p50_s"] = round(statistics.median(latencies), 3)
        report["latency_p99_s"] = round(latencies[int(0.99 * (len(latencies) - 1))], 3)
        report["load_failures"] = len(failures)

        # Drain: start a round of requests, SIGTERM while they are in flight.
        results = []

        def one(i):
            try:
                status, body = post(base, "/generate", {"prompts": PROMPTS, "max_tokens": 48, "temperature": 0})
                results.append(status)
            except Exception as e:  # noqa: BLE001
                results.append(repr(e))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.concurrency)]
        for th in threads:
            th.start()
        time.sleep(0.3)
        server.send_signal(signal.SIGTERM)
        for th in threads:
            th.join()
        code = server.wait(timeout=120)
        report["drain"] = {
            "in_flight": len(results),
            "ok": sum(1 for r in results if r == 200),
            "failed": [r for r in results if r != 200],
            "exit_code": code,
        }
    finally:
        if server.poll() is None:
            server.kill()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
