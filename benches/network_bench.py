#!/usr/bin/env python3
"""The benchmark figures of the training network (issue #6), measured on this machine.

    python3 benches/network_bench.py --hrm target/release/hrm [--batches 48] [--only parity]

Every run starts a fresh `hrm hub serve` (embedded defaults, in a temporary directory) on the
same slice of the bundled corpus, initialised with `hrm hub init --config ... --seed 0`, which
is the same initialisation as `hrm train --seed 0`. It reports, as one JSON object:
  * throughput   tokens/s of one `hrm worker` (its "trained batch" lines) next to `hrm train`
                 on the same model and step shape (rows per optimiser step, sequence length)
  * parity       validation loss after the same token budget: centralised `hrm train`, and the
                 network with 3 workers (aggregation when 3 updates are pending or every
                 2 s, weighted mean, plain outer step decayed by `--outer-schedule cosine`;
                 inner AdamW at 2e-3 with 3 warmup steps of 8), top-k compression off and
                 on; upload bytes
  * hostile      3 honest workers and 1 hostile one (`hrm bench hostile-worker`, updates
                 scaled by -10) in rounds of 3 updates (the 20 s interval only flushes the
                 last ones), the same inner plan and outer schedule, under plain FedAvg without the outlier screen, FedAvg with it,
                 Krum and the coordinate-wise median, next to the honest workers alone in
                 the same rounds
Losses are scored alike by `hrm bench perplexity` on the same evenly spaced validation windows.
Uses only the Python standard library; it is a benchmark, not a test, and is not run in CI.
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

ADMIN_KEY = "network-bench-admin-key-0123456789abcdef01"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def run(cmd, **kw):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)
    return out.stdout


class Network:
    """A hub and its workers in one temporary directory."""

    def __init__(self, args, work, hub_flags):
        self.args, self.work = args, work
        self.data = os.path.join(work, "hub")
        run([args.hrm, "hub", "init", "--config", args.config, "--seed", "0", "--data-dir", self.data])
        run([args.hrm, "hub", "ingest", "--corpus", args.train_slice, "--valid", args.valid,
             "--tokenizer", args.tokenizer, "--batch-size", str(args.batch_size), "--custom-size",
             "--seq-len", str(args.seq_len), "--data-dir", self.data])
        self.url = f"http://127.0.0.1:{free_port()}"
        self.hub = subprocess.Popen(
            [args.hrm, "hub", "serve", "--addr", self.url[7:], "--data-dir", self.data,
             "--eval-windows", "0",
             "--inner-steps", str(args.inner_steps), "--inner-lr", str(args.inner_lr),
             "--inner-warmup-steps", str(args.inner_warmup)]
            # Re-verification recomputes updates on the hub's CPU, which the workers share.
            + ([] if "--verify-fraction" in hub_flags else ["--verify-fraction", "0"])
            # Unless the run says otherwise, every update is applied as it arrives.
            + ([] if "--min-gradients-for-update" in hub_flags else ["--min-gradients-for-update", "1"])
            + ([] if "--aggregation-interval" in hub_flags else ["--aggregation-interval", "2"])
            + hub_flags,
            stderr=open(os.path.join(work, "hub.log"), "w"), env={**os.environ, "HRM_HUB_ADMIN_KEY": ADMIN_KEY})
        for _ in range(600):
            try:
                get_json(self.url + "/api/v1/stats/global")
                break
            except Exception:
                time.sleep(0.1)
        self.workers = []

    def add_worker(self, name, extra=(), max_batches=100000):
        log = os.path.join(self.work, f"{name}.log")
        proc = subprocess.Popen(
            [self.args.hrm, "worker", "--headless", "--server-url", self.url,
             "--config", os.path.join(self.work, name, "worker.yaml"),
             "--cache-dir", os.path.join(self.work, name, "cache"), "--username", name,
             "--batch-size", str(self.args.micro_batch), "--retry-delay", "1",
             "--max-batches-per-session", str(max_batches), "--threads", str(self.args.threads), *extra],
            stderr=open(log, "w"))
        self.workers.append((proc, log))

    def add_hostile(self):
        log = os.path.join(self.work, "hostile.log")
        proc = subprocess.Popen([self.args.hrm, "bench", "hostile-worker", "--url", self.url,
                                 "--mode", "scale", "--factor", "-10"],
                                stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                env={**os.environ, "RAYON_NUM_THREADS": str(self.args.threads)})
        self.workers.append((proc, log))

    def wait_done(self):
        """Until every batch is completed and every update aggregated or rejected."""
        while True:
            stats = get_json(self.url + "/api/v1/stats/global")
            b = stats["batches"]
            if b["pending"] == 0 and b["assigned"] == 0 and stats["updates_pending"] == 0:
                return stats
            time.sleep(1)

    def stop(self):
        for proc, _ in self.workers:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in self.workers:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.hub.send_signal(signal.SIGTERM)
        self.hub.wait(timeout=60)

    def final_model(self):
        """The current version, written as a checkpoint directory for `hrm bench perplexity`."""
        info = get_json(self.url + "/api/v1/model/current")
        out = os.path.join(self.work, "final")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(info["config"], f)
        # Downloads need a worker's key: the first worker's, from its configuration file.
        config = open(os.path.join(self.work, "w0", "worker.yaml")).read()
        key = re.search(r"api_key:\s*(\S+)", config).group(1)
        req = urllib.request.Request(self.url + info["checkpoint_url"],
                                     headers={"Authorization": "Bearer " + key})
        with urllib.request.urlopen(req) as r, open(os.path.join(out, "model.safetensors"), "wb") as f:
            f.write(r.read())
        return out, info["version"]


def perplexity(args, model):
    out = run([args.hrm, "bench", "perplexity", "--model", model, "--valid", args.valid,
               "--tokenizer", args.tokenizer, "--seq-len", str(args.seq_len), "--windows", str(args.eval_windows)])
    return json.loads(out)["valid_loss"]


def worker_rates(log):
    rates = [float(m) for m in re.findall(r"\(([0-9.]+) tokens/s\)", open(log).read())]
    return rates


def network_run(args, name, hub_flags, workers=3, compress=False, hostile=False):
    work = tempfile.mkdtemp(prefix=f"hrm-net-{name}-")
    net = Network(args, work, hub_flags)
    started = time.time()
    for i in range(workers):
        net.add_worker(f"w{i}", ["--compress-gradients", "true", "--compression-ratio", str(args.topk_ratio)]
                       if compress else [])
    if hostile:
        net.add_hostile()
    stats = net.wait_done()
    seconds = time.time() - started
    model, version = net.final_model()
    upload = []
    for i in range(workers):
        upload += [int(m) for m in re.findall(r"uploaded batch \S+ \((\d+) KiB", open(os.path.join(work, f"w{i}.log")).read())]
    net.stop()
    result = {"valid_loss": perplexity(args, model), "version": version, "seconds": round(seconds, 1),
              "updates_aggregated": stats["updates_aggregated"], "updates_rejected": stats["updates_rejected"],
              "upload_kib_per_batch": round(sum(upload) / max(len(upload), 1), 1), "dir": work}
    if hostile:
        result["hostile"] = open(os.path.join(work, "hostile.log")).read().strip().splitlines()[-1:]
    print(name, json.dumps(result), flush=True)
    return result


def central_run(args, steps):
    work = tempfile.mkdtemp(prefix="hrm-central-")
    run([args.hrm, "train", "--config", args.config, "--train", args.train_slice, "--valid", args.valid,
         "--tokenizer", args.tokenizer, "--out", work, "--steps", str(steps),
         "--batch-size", str(args.rows_per_step), "--micro-batch", str(args.micro_batch),
         "--seq-len", str(args.seq_len), "--lr", str(args.central_lr), "--warmup", str(max(steps // 20, 1)),
         "--eval-every", str(steps), "--seed", "0", "--headless"],
        env={**os.environ, "RAYON_NUM_THREADS": str(args.threads)})
    lines = [json.loads(l) for l in open(os.path.join(work, "train-log.jsonl"))]
    rates = [l["tokens_per_s"] for l in lines if "tokens_per_s" in l]
    return {"valid_loss": perplexity(args, work), "tokens_per_s": rates[-1] if rates else None, "dir": work}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hrm", required=True)
    p.add_argument("--config", default="models/configs/network-moe.json")
    p.add_argument("--corpus", default="data/corpus/train.txt")
    p.add_argument("--valid", default="data/corpus/valid.txt")
    p.add_argument("--tokenizer", default="models/tokenizer.json")
    p.add_argument("--batches", type=int, default=48, help="token budget, in batches")
    p.add_argument("--batch-size", type=int, default=64, help="samples per batch")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--inner-steps", type=int, default=8)
    p.add_argument("--inner-lr", type=float, default=2e-3)
    p.add_argument("--inner-warmup", type=int, default=3, help="inner steps of lr warmup per batch")
    p.add_argument("--central-lr", type=float, default=3e-3)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--only", default="throughput,parity,hostile")
    p.add_argument("--hub-flags", default="--min-gradients-for-update 3 --outer-schedule cosine", help="extra `hrm hub serve` flags for the parity runs")
    p.add_argument("--hostile-runs", default="", help="comma-separated subset of honest_reference,"
                   "fedavg_no_screen,fedavg_screen,krum,median (default: all)")
    p.add_argument("--topk-ratio", type=float, default=0.1, help="the workers' compression ratio in the top-k run")
    p.add_argument("--skip", default="", help="central,dense,topk: leave those parity runs out")
    args = p.parse_args()
    args.rows_per_step = args.batch_size // args.inner_steps

    # The budget: a slice of the corpus that ingests into about --batches batches.
    work = tempfile.mkdtemp(prefix="hrm-net-bench-")
    args.train_slice = os.path.join(work, "train.txt")
    tokens_per_batch = args.batch_size * (args.seq_len + 1)
    with open(args.corpus, "rb") as src, open(args.train_slice, "wb") as dst:
        dst.write(src.read(int(args.batches * tokens_per_batch * 4.2)))  # ~4.2 bytes per token
    only = set(args.only.split(","))
    report = {"config": args.config, "batches": args.batches, "batch_size": args.batch_size,
              "seq_len": args.seq_len, "inner_steps": args.inner_steps}

    if "throughput" in only:
        net = Network(args, tempfile.mkdtemp(prefix="hrm-net-tput-"), [])
        net.add_worker("w0", max_batches=6)
        net.workers[0][0].wait()
        rates = worker_rates(net.workers[0][1])[1:]  # the first batch includes warm-up
        net.stop()
        central = central_run(args, 30)
        worker = sum(rates) / len(rates)
        report["throughput"] = {"worker_tokens_per_s": round(worker), "train_tokens_per_s": round(central["tokens_per_s"]),
                                "ratio": round(worker / central["tokens_per_s"], 3)}
        print("throughput", json.dumps(report["throughput"]), flush=True)

    if "parity" in only:
        # The network sees each token once; so does the centralised run.
        probe = Network(args, tempfile.mkdtemp(prefix="hrm-net-probe-"), [])
        batches = get_json(probe.url + "/api/v1/stats/global")["batches"]["pending"]
        probe.stop()
        steps = batches * args.batch_size // args.rows_per_step
        report["budget_tokens"] = batches * args.batch_size * args.seq_len
        report["parity"] = {
            "central": central_run(args, steps) if "central" not in args.skip else None,
            "network_dense": network_run(args, "dense", args.hub_flags.split()) if "dense" not in args.skip else None,
            "network_topk": network_run(args, "topk", args.hub_flags.split(), compress=True) if "topk" not in args.skip else None,
        }
        print("central", json.dumps(report["parity"]["central"]), flush=True)

    if "hostile" in only:
        # Rounds of at least 3 updates, so that the screen and the robust rules have something
        # to compare; the honest run with the same rounds is the reference.
        # The interval only flushes what is left at the end; rounds are triggered by the count.
        # Short leases: a hostile worker the hub refuses walks away with a batch leased, and the
        # run ends only when that lease expires and an honest worker takes the batch over.
        rounds = ["--min-gradients-for-update", "3", "--aggregation-interval", "20", "--outer-schedule", "cosine",
                  "--lease-seconds", "60"]
        runs = {
            "honest_reference": ("h-none", [], False),
            "fedavg_no_screen": ("h-mean-noscreen", ["--outlier-sigmas", "1e9"], True),
            "fedavg_screen": ("h-mean", [], True),
            "krum": ("h-krum", ["--rule", "krum"], True),
            "median": ("h-median", ["--rule", "median"], True),
        }
        wanted = args.hostile_runs.split(",") if args.hostile_runs else list(runs)
        report["hostile"] = {key: network_run(args, name, rounds + flags, hostile=hostile)
                             for key, (name, flags, hostile) in runs.items() if key in wanted}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
