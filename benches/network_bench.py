#!/usr/bin/env python3
"""The benchmark figures of the training network, measured on this machine.

    python3 benches/network_bench.py --hrm target/release/hrm [--batches 48] [--only parity]

Every run starts a fresh `hrm hub serve` (embedded defaults, in a temporary directory) on the
same slice of the bundled corpus, initialised with `hrm hub init --model-config ... --seed 0`, which
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
  * adversarial  honest workers beside a bloc of hostile identities (20% and 30% of them), one
                 attack at a time, on the hub's default defences: scaled updates (x-10, 1e30),
                 sign flip, random noise, "a little is enough", colluding copies, a Sybil flood of
                 50 identities, free riders and lease hoarders; each row gives the final
                 validation loss against the clean run, the hostile updates applied, the honest
                 workers penalised or banned and the hub's peak RSS
Losses are scored alike by `hrm bench perplexity` on the same evenly spaced validation windows.
Uses only the Python standard library; it is a benchmark, not a test, and is not run in CI.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request

from common import free_port

ADMIN_KEY = "network-bench-admin-key-0123456789abcdef01"


def get_json(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def run(cmd, **kw):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)
    return out.stdout


class Network:
    """A hub and its workers in one temporary directory."""

    def __init__(self, args, work, hub_flags, eval_windows=0):
        self.args, self.work = args, work
        self.data = os.path.join(work, "hub")
        run([args.hrm, "hub", "init", "--model-config", args.config, "--seed", "0", "--data-dir", self.data])
        run([args.hrm, "hub", "ingest", "--corpus", args.train_slice, "--valid", args.valid,
             "--tokenizer", args.tokenizer, "--batch-size", str(args.batch_size), "--custom-size",
             "--seq-len", str(args.seq_len), "--data-dir", self.data])
        self.url = f"http://127.0.0.1:{free_port()}"
        self.hub = subprocess.Popen(
            [args.hrm, "hub", "serve", "--addr", self.url[7:], "--data-dir", self.data,
             "--eval-windows", str(eval_windows),
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

    def add_hostile(self, mode="scale", factor=-10.0, identities=1):
        log = os.path.join(self.work, "hostile.log")
        proc = subprocess.Popen([self.args.hrm, "bench", "hostile-worker", "--url", self.url,
                                 "--mode", mode, "--factor", str(factor), "--identities", str(identities)],
                                stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                env={**os.environ, "RAYON_NUM_THREADS": str(self.args.threads)})
        self.hostile = proc
        self.workers.append((proc, log))

    def wait_done(self):
        """Until every batch is completed and every update aggregated or rejected. Once no batch
        is left to lease, the attacker is stopped, so that batches it holds come back."""
        while True:
            stats = get_json(self.url + "/api/v1/stats/global")
            b = stats["batches"]
            if b["pending"] == 0 and getattr(self, "hostile", None) and self.hostile.poll() is None:
                self.hostile.send_signal(signal.SIGTERM)
            if b["pending"] == 0 and b["assigned"] == 0 and stats["updates_pending"] == 0:
                return stats
            time.sleep(1)

    def peak_rss_mib(self):
        """The hub's peak resident memory so far (VmHWM)."""
        for line in open(f"/proc/{self.hub.pid}/status"):
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
        return None

    def trust_report(self):
        """What the attack achieved, read from the hub's database: hostile updates applied,
        honest workers penalised (an update rejected, or a re-verification that disagreed) or
        banned (reputation below the floor)."""
        import sqlite3
        db = sqlite3.connect(os.path.join(self.data, "hub.db"))
        q = lambda sql: db.execute(sql).fetchall()
        hostile = "w.username LIKE 'hostile%'"
        report = {
            "hostile_identities": q(f"SELECT COUNT(*) FROM workers w WHERE {hostile}")[0][0],
            "hostile_updates_accepted": q(f"SELECT COUNT(*) FROM gradient_updates u JOIN workers w ON u.worker_id = w.id WHERE {hostile}")[0][0],
            "hostile_updates_applied": q(f"SELECT COUNT(*) FROM gradient_updates u JOIN workers w ON u.worker_id = w.id WHERE {hostile} AND u.status = 'aggregated'")[0][0],
            "honest_penalised": q(f"SELECT COUNT(DISTINCT w.id) FROM gradient_updates u JOIN workers w ON u.worker_id = w.id WHERE NOT {hostile} AND (u.status = 'rejected' OR u.verification = 'disagreed')")[0][0],
            "honest_banned": q(f"SELECT COUNT(*) FROM workers w WHERE NOT {hostile} AND w.reputation_score < 0.3")[0][0],
            "updates_held": q("SELECT COUNT(*) FROM gradient_updates WHERE status = 'held'")[0][0],
            "reverified": q("SELECT COUNT(*) FROM gradient_updates WHERE verification IN ('agreed', 'disagreed')")[0][0],
        }
        db.close()
        return report

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


def network_run(args, name, hub_flags, workers=3, compress=False, hostile=None, eval_windows=0):
    """One network run; `hostile` is the attacker's `hrm bench hostile-worker` settings."""
    work = tempfile.mkdtemp(prefix=f"hrm-net-{name}-")
    net = Network(args, work, hub_flags, eval_windows)
    started = time.time()
    for i in range(workers):
        net.add_worker(f"w{i}", ["--compress-gradients", "true", "--compression-ratio", str(args.topk_ratio)]
                       if compress else [])
    if hostile:
        net.add_hostile(**hostile)
    stats = net.wait_done()
    seconds = time.time() - started
    model, version = net.final_model()
    peak_rss = net.peak_rss_mib()
    trust = net.trust_report()
    upload = []
    for i in range(workers):
        upload += [int(m) for m in re.findall(r"uploaded batch \S+ \((\d+) KiB", open(os.path.join(work, f"w{i}.log")).read())]
    net.stop()
    result = {"valid_loss": perplexity(args, model), "version": version, "seconds": round(seconds, 1),
              "updates_aggregated": stats["updates_aggregated"], "updates_rejected": stats["updates_rejected"],
              "upload_kib_per_batch": round(sum(upload) / max(len(upload), 1), 1),
              "hub_peak_rss_mib": peak_rss, **trust, "dir": work}
    if hostile:
        result["hostile"] = open(os.path.join(work, "hostile.log")).read().strip().splitlines()[-1:]
        result["attack"] = hostile
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
    p.add_argument("--only", default="throughput,parity,hostile,adversarial")
    p.add_argument("--attacks", default="", help="comma-separated subset of the adversarial attacks (default: all)")
    p.add_argument("--fractions", default="0.2,0.3", help="hostile shares of the identities in the adversarial runs")
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
        scaled = {"mode": "scale", "factor": -10}
        runs = {
            "honest_reference": ("h-none", [], None),
            "fedavg_no_screen": ("h-mean-noscreen", ["--outlier-sigmas", "1e9"], scaled),
            "fedavg_screen": ("h-mean", [], scaled),
            "krum": ("h-krum", ["--rule", "krum"], scaled),
            "median": ("h-median", ["--rule", "median"], scaled),
        }
        wanted = args.hostile_runs.split(",") if args.hostile_runs else list(runs)
        report["hostile"] = {key: network_run(args, name, rounds + flags, hostile=hostile)
                             for key, (name, flags, hostile) in runs.items() if key in wanted}

    if "adversarial" in only:
        # Honest workers train the MoE beside a bloc of hostile identities, on the hub's default
        # defences (probation, norm screen, validation-loss gate on 16 windows, proof of work),
        # in rounds of 3 updates. All processes share 127.0.0.1, so the per-address
        # registration burst is raised by the honest workers' count: the attacker still meets
        # the default 5.
        attacks = {
            "scale_x-10": {"mode": "scale", "factor": -10},
            "scale_1e30": {"mode": "scale", "factor": 1e30},
            "sign_flip": {"mode": "sign-flip"},
            "random_noise": {"mode": "random", "factor": 1},
            "little_is_enough": {"mode": "little", "factor": 1},
            "colluding_copies": {"mode": "collude"},
            "sybil_flood_50": {"mode": "collude", "identities": 50},
            "free_riders": {"mode": "zero"},
            "lease_hoarders": {"mode": "hoard"},
        }
        wanted = args.attacks.split(",") if args.attacks else list(attacks)
        report["adversarial"] = {}
        for fraction in [float(f) for f in args.fractions.split(",")]:
            # 20%: 4 honest workers and 1 hostile identity; 30%: 7 and 3.
            honest, hostile_ids = {0.2: (4, 1), 0.3: (7, 3)}[fraction]
            rounds = ["--min-gradients-for-update", "3", "--aggregation-interval", "20",
                      "--outer-schedule", "cosine", "--lease-seconds", "60",
                      "--register-burst", str(honest + 5)]
            rows = {"clean": network_run(args, f"adv-{honest}-clean", rounds, workers=honest, eval_windows=16)}
            for key in wanted:
                attack = {"identities": hostile_ids, **attacks[key]}
                rows[key] = network_run(args, f"adv-{honest}-{key}", rounds, workers=honest,
                                        hostile=attack, eval_windows=16)
                rows[key]["loss_vs_clean"] = round(rows[key]["valid_loss"] / rows["clean"]["valid_loss"] - 1, 4)
            report["adversarial"][f"{int(fraction * 100)}%"] = rows
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
