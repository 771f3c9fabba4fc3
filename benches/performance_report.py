#!/usr/bin/env python3
"""The comparisons with the peers, measured side by side in one run, and the figures section of
docs/performance.md regenerated from them.

    python3 benches/performance_report.py --hrm target/release/hrm \\
        --llama-python /tmp/llama/bin/python --llama-server /tmp/llama-src/build/bin/llama-server \\
        --ref-python /tmp/ref/bin/python --hrm-before /tmp/before/target/release/hrm

Parts (all by default; `--only gguf,transformers` runs some and keeps the others' last figures
from --out):
  gguf          `hrm serve` against llama.cpp's servers (llama-cpp-python; llama-server with
                --llama-server) on the same GGUF
                (SmolLM2-135M-Instruct Q4_1), `hrm bench ab` at concurrency 1 and 8, 16 greedy
                prompts x 32 tokens: output tokens/s, time to first token, latency p50/p99.
  transformers  `hrm bench model` next to transformers on CPU on models/sample (batch 1 and 8):
                prefill and decode tokens/s.
  bandwidth     batch-1 decode tokens/s as a fraction of the memory-bandwidth bound: bytes per
                token from `hrm serve --dry-run`; read bandwidth the highest of `hrm bench
                aggregate`'s single-threaded "read once" pass, a numpy sum and a torch sum on
                --threads threads, so that the bound stays a bound; --bandwidth-rounds rounds
                of the bound and the decode runs back to back, each round's fraction against
                its own bound; where a C compiler is found, each round's decode is bracketed
                by a cache line's round trip between cores 0 and 1 (benches/core_probe.c), which
                tells a round whose cores sat close together from one whose cores sat far apart.
  rps           requests/s of `hrm serve` on models/sample at batch 8 (8 clients, 16 tokens each,
                --rps-seconds) against the specification's target of 10.
  quality       models/sample (hrm_text), models/sample-moe (hrm_text_moe) and
                models/sample-llama (llama): validation perplexity (`hrm bench perplexity`),
                BIG-bench general_knowledge accuracy through lm-eval
                (tests/lm_eval/run_lm_eval.py), decode tokens/s at batch 1 and 8.
  gap           the gap fix, before and after: `hrm bench model` on the GGUF with --hrm-before
                (a build of the commit before the fix) and --hrm, alternately, twice each.

Writes every figure to --out (JSON) and replaces the block between
`<!-- performance-report:begin -->` and `<!-- performance-report:end -->` in docs/performance.md
(which must exist); ab's charts are copied to docs/perf/ (with --no-doc, beside --out).
Servers run in their own process groups on free ports and are killed on exit.

Installing the peers (large; not part of CI): llama-cpp-python's server and llama.cpp's
llama-server built from source, transformers and lm-eval, and the build before the gap fix; the
steps are in docs/performance.md, "Against the peers". TGI cannot run here; `hrm bench ab`'s TGI
adapter is tested against a stub (crates/hrm-cli/tests/ab.rs).
"""

import argparse
import contextlib
import datetime
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request

from common import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ["gguf", "transformers", "bandwidth", "rps", "quality", "gap"]
BEGIN, END = "<!-- performance-report:begin -->", "<!-- performance-report:end -->"
SAMPLES = ["models/sample", "models/sample-moe", "models/sample-llama"]

# Greedy prompts for the server comparisons: varied English, short enough that decode dominates.
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain why the sky is blue in one sentence.",
    "Once upon a time, in a small village,",
    "List three uses of a paperclip:",
    "The best way to learn a new language is",
    "What is the difference between weather and climate?",
    "It was a dark and stormy night",
    "Give me a recipe for a simple tomato soup.",
    "The three primary colours are",
    "Describe a cat to someone who has never seen one.",
    "In 1969, the first humans",
    "Why do leaves change colour in autumn?",
    "A good night's sleep helps you",
    "Translate 'thank you' into Spanish, French and German.",
    "The most important invention of the last century was",
]



# ---------------------------------------------------------------------------------------------
# Helpers


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def http_json(url, body=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


class Context:
    """What every part needs: paths, the log directory, and the servers to clean up."""

    def __init__(self, args):
        self.args = args
        self.threads = args.threads
        self.work = tempfile.mkdtemp(prefix="hrm-perf-")
        # A copy of the binary, so that a rebuild during the run cannot mix two versions.
        self.hrm = os.path.join(self.work, "hrm")
        shutil.copy2(args.hrm, self.hrm)
        self.logs = os.path.join(os.path.dirname(os.path.abspath(args.out)), "logs")
        self.ab_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), "ab")
        os.makedirs(self.logs, exist_ok=True)
        self.env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))

    def run(self, cmd, name, env=None, check=True, timeout=None, shown=None):
        """Runs a command to completion; its output goes to logs/NAME.log; returns stdout."""
        log(f"  $ {shown or ' '.join(cmd)}")
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env or self.env, capture_output=True, text=True, timeout=timeout)
        with open(os.path.join(self.logs, f"{name}.log"), "w") as f:
            f.write(f"$ {' '.join(cmd)}\n# exit {proc.returncode} after {time.perf_counter() - started:.1f} s\n")
            f.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{name}: exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        return proc.stdout


@contextlib.contextmanager
def server(ctx, name, cmd, ready_path, env=None):
    """Starts a server in its own process group, waits for ready_path to answer 200, yields its
    base URL, and kills the whole group on the way out."""
    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    base = f"http://127.0.0.1:{port}"
    log(f"  starting {name}: {' '.join(cmd)}")
    logfile = open(os.path.join(ctx.logs, f"server-{name}.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or ctx.env, stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {logfile.name}")
            try:
                with urllib.request.urlopen(base + ready_path, timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.time() > deadline:
                raise RuntimeError(f"{name} not ready after 300 s")
            time.sleep(0.2)
        yield base
    finally:
        stop_group(proc)
        logfile.close()


def stop_group(proc):
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def hrm_server(ctx, name, model):
    cmd = [ctx.hrm, "serve", "--host", "127.0.0.1", "--port", "{port}", "--model-path", model,
           "--device", "cpu", "--max-batch-size", "8", "--log-level", "warn"]
    return server(ctx, name, cmd, "/readyz")


def write_prompts(ctx, name, max_tokens=None):
    path = os.path.join(ctx.work, name)
    with open(path, "w") as f:
        for p in PROMPTS:
            line = {"prompt": p, "temperature": 0, "top_p": 1}
            if max_tokens:
                line["max_tokens"] = max_tokens
            f.write(json.dumps(line) + "\n")
    return path


def bench_ab(ctx, name, targets, prompts, concurrency, max_tokens, requests=None, duration=None):
    out = os.path.join(ctx.ab_dir, name)
    cmd = [ctx.hrm, "bench", "ab"]
    for t in targets:
        cmd += ["--target", t]
    cmd += ["--prompts", prompts, "--concurrency", str(concurrency), "--max-tokens", str(max_tokens), "--out", out]
    cmd += ["--requests", str(requests)] if requests else ["--duration", str(duration)]
    ctx.run(cmd, name)
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    shown = " ".join(cmd[3:]).replace(ctx.work + "/", "").replace(ctx.ab_dir, os.path.relpath(ctx.ab_dir, ROOT))
    results["command"] = "hrm bench ab " + re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", shown)
    results["out"] = out
    return results


def copy_charts(ctx, ab, prefix):
    """Copies ab's latency.png and throughput.png to CHARTS/PREFIX-*.png (`--charts`); returns
    their paths relative to the page's folder."""
    os.makedirs(ctx.args.charts, exist_ok=True)
    copied = {}
    for chart in ("latency", "throughput"):
        dest = os.path.join(ctx.args.charts, f"{prefix}-{chart}.png")
        shutil.copyfile(os.path.join(ab["out"], f"{chart}.png"), dest)
        copied[chart] = os.path.relpath(dest, os.path.dirname(os.path.abspath(ctx.args.doc)))
    return copied


def parse_md_table(text):
    """The rows of the first Markdown table in text, as lists of cell strings (header excluded)."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def number(cell):
    cell = cell.replace("×", "").strip()
    try:
        return float(cell)
    except ValueError:
        return None


def bench_model(ctx, name, models, batch_sizes, python=None, rounds=None):
    """`hrm bench model`; returns {(model name, batch): {...}} from its Markdown table."""
    table = os.path.join(ctx.work, f"{name}.md")
    cmd = [ctx.hrm, "bench", "model"]
    for m in models:
        cmd += ["--model", m]
    cmd += ["--batch-sizes", ",".join(map(str, batch_sizes)), "--threads", str(ctx.threads), "--out", table]
    if python:
        cmd += ["--python", python]
    if rounds:
        cmd += ["--rounds", str(rounds)]
    ctx.run(cmd, name)
    rows = []
    with open(table) as f:
        for cells in parse_md_table(f.read()):
            rows.append({
                "model": cells[0], "batch": int(cells[1]),
                "prefill_hrm": number(cells[2]), "prefill_transformers": number(cells[3]),
                "decode_hrm": number(cells[5]), "decode_transformers": number(cells[6]),
                "peak_rss_mb_hrm": number(cells[8]), "peak_rss_mb_transformers": number(cells[9]),
            })
    return {"command": "hrm bench model " + " ".join(cmd[3:]).replace(ctx.work + "/", ""), "rows": rows}


def dry_run(ctx, model):
    out = ctx.run([ctx.hrm, "serve", "--dry-run", "--model-path", model, "--device", "cpu", "--log-level", "warn"],
                  "dry-run-" + os.path.basename(model))
    return json.loads(out.strip().splitlines()[-1])


def warm_up(base, kind, model=None):
    if kind == "hrm":
        http_json(base + "/generate", {"prompts": ["Hello"], "max_tokens": 4, "temperature": 0})
    else:
        http_json(base + "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})


def ratio(a, b):
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------------------------
# The comparisons, one function each


def compare_gguf(ctx):
    """Ours against llama.cpp's servers on the same GGUF, at concurrency 1 and 8: llama-cpp-python's
    Python server (the peer the issue names) and, with --llama-server, llama.cpp's own C++
    `llama-server` with continuous batching (the stronger peer)."""
    gguf = ctx.args.gguf
    prompts = write_prompts(ctx, "gguf-prompts.jsonl")
    version = subprocess.run([ctx.args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    peers = [("llama.cpp", [ctx.args.llama_python, "-m", "llama_cpp.server", "--model", gguf,
                            "--n_threads", str(ctx.threads), "--host", "127.0.0.1", "--port", "{port}",
                            "--model_alias", "smollm2",
                            # By default a new request cuts off the stream in progress (it ends with
                            # [DONE] and no error); requests must queue instead.
                            "--interrupt_requests", "false"], "/v1/models")]
    if ctx.args.llama_server:
        # 8 slots of 512 tokens each: every request of a concurrency-8 run decodes in one batch.
        peers.append(("llama-server", [ctx.args.llama_server, "-m", gguf, "-t", str(ctx.threads), "--host", "127.0.0.1",
                                       "--port", "{port}", "--alias", "smollm2", "--parallel", "8", "-c", "4096"],
                      "/health"))
    result = {"gguf": os.path.basename(gguf), "llama_cpp_python": version, "prompts": len(PROMPTS),
              "max_tokens": 32, "runs": {}, "peers": [name for name, _, _ in peers], "tokens_per_prompt": {}}
    # Every server is up, idle while another is measured; `hrm bench ab` measures them one
    # after the other.
    with contextlib.ExitStack() as stack:
        ours = stack.enter_context(hrm_server(ctx, "hrm-gguf", gguf))
        warm_up(ours, "hrm")
        targets = [f"hrm={ours}"]
        bases = {}
        for name, cmd, ready in peers:
            bases[name] = stack.enter_context(server(ctx, name, cmd, ready))
            warm_up(bases[name], "openai", "smollm2")
            targets.append(f"openai={bases[name]},model=smollm2,name={name}")
        for concurrency, requests in ((1, len(PROMPTS)), (8, 2 * len(PROMPTS))):
            log(f"  concurrency {concurrency}, {requests} requests per server")
            ab = bench_ab(ctx, f"gguf-c{concurrency}", targets, prompts, concurrency, 32, requests=requests)
            ab["charts"] = copy_charts(ctx, ab, f"gguf-c{concurrency}")
            result["runs"][str(concurrency)] = ab
        # The OpenAI-style streams carry no usage and may end with an empty-text chunk carrying
        # finish_reason, which `hrm bench ab`'s OpenAI adapter counts as one more token. Their
        # non-streamed answers carry usage: the true greedy token count of each prompt.
        for name, base in bases.items():
            result["tokens_per_prompt"][name] = [
                http_json(base + "/v1/completions", {"model": "smollm2", "prompt": p, "max_tokens": 32,
                                                     "temperature": 0})["usage"]["completion_tokens"]
                for p in PROMPTS]
    for ab in result["runs"].values():
        for t in ab["targets"]:
            counts = result["tokens_per_prompt"].get(t["target"])
            if counts and t["errors"] == 0 and t["requests_per_s"]:
                # ab sends request i with prompt i mod 16; wall = requests / (requests/s).
                tokens = sum(counts[i % len(PROMPTS)] for i in range(t["requests"]))
                t["output_tokens_per_s_as_counted_by_ab"] = t["output_tokens_per_s"]
                t["output_tokens_per_s"] = tokens * t["requests_per_s"] / t["requests"]
    return result


def compare_transformers(ctx):
    """`hrm bench model` next to transformers on CPU, on models/sample's weights."""
    if not ctx.args.ref_python:
        return {"skipped": "no --ref-python"}
    return bench_model(ctx, "transformers", ["models/sample"], [1, 8], python=ctx.args.ref_python)


READ_BANDWIDTH = """
import sys, time, numpy as np, torch
def best(f, nbytes):
    f(); t = 1e9
    for _ in range(5):
        s = time.perf_counter(); f(); t = min(t, time.perf_counter() - s)
    return nbytes / t / 1e9
a = np.ones(1 << 28, np.float32)
torch.set_num_threads(int(sys.argv[1])); b = torch.from_numpy(a)
print(best(a.sum, a.nbytes), best(b.sum, a.nbytes))
"""


def measure_bandwidth(ctx, round_):
    """Read bandwidth, three ways in the same run: `hrm bench aggregate`'s "read once" pass (one
    thread, Rust), numpy summing a 1 GiB float32 array (one thread) and torch summing it with
    --threads threads (best of 5 each). The bound uses the highest, so that it stays a bound."""
    command = "hrm bench aggregate --params 10000000 --updates 20"
    out = ctx.run([ctx.hrm] + command.split()[1:], f"aggregate-{round_}")
    line = next(l for l in out.splitlines() if l.startswith("read once"))
    result = {"aggregate_read_gb_s": float(line.split()[3]), "aggregate_command": command}
    if ctx.args.ref_python:
        out = ctx.run([ctx.args.ref_python, "-c", READ_BANDWIDTH, str(ctx.threads)], f"read-bandwidth-{round_}",
                      shown=f"{ctx.args.ref_python} -c READ_BANDWIDTH {ctx.threads}  # numpy and torch sums of 1 GiB")
        result["numpy_sum_gb_s"], result["torch_sum_gb_s"] = map(float, out.split())
    rates = {"`hrm bench aggregate`'s read once (1 thread)": result["aggregate_read_gb_s"]}
    if "numpy_sum_gb_s" in result:
        rates["numpy sum (1 thread)"] = result["numpy_sum_gb_s"]
        rates[f"torch sum ({ctx.threads} threads)"] = result["torch_sum_gb_s"]
    result["bound_source"], result["bound_gb_s"] = max(rates.items(), key=lambda kv: kv[1])
    return result


def build_core_probe(ctx):
    """benches/core_probe.c built into the work directory, or None where it cannot be (no C
    compiler, not x86_64, fewer than two CPUs to pin)."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if not compiler or os.uname().machine != "x86_64" or (os.cpu_count() or 1) < 2:
        return None
    probe = os.path.join(ctx.work, "core_probe")
    try:
        ctx.run([compiler, "-O2", "-pthread", "benches/core_probe.c", "-o", probe], "core-probe-build")
    except RuntimeError as e:
        log(f"  core_probe not built: {e}")
        return None
    return probe


def core_distance(ctx, probe, name):
    """One round of `core_probe pair 1`: a cache line's round trip between cores 0 and 1 (ns)
    and what both cores read together (GB/s) in the same second; None where the probe failed
    (cores 0 and 1 not both ours, say), which leaves the round's bound and decode as they are."""
    try:
        out = ctx.run([probe, "pair", "1"], name)
    except RuntimeError as e:
        log(f"  core_probe: {e}")
        return None
    match = re.search(r"round trip (\d+) ns, both cores read ([\d.]+) GB/s", out)
    if not match:
        log(f"  core_probe printed no round trip: {out.strip()[:200]}")
        return None
    return {"round_trip_ns": int(match.group(1)), "read_gb_s": float(match.group(2))}


def bandwidth_fraction(ctx, gguf_result):
    """Batch-1 decode tokens/s against bandwidth / bytes per token, for models/sample and the GGUF.

    The machine's bandwidth moves with the host's load, so the bound and the decode rate are
    measured back to back, --bandwidth-rounds times: each round's fraction is its decode rate
    over its own bound, and the table gives the median fraction and its range."""
    models = ["models/sample", ctx.args.gguf]
    infos = {model: dry_run(ctx, model) for model in models}
    probe = build_core_probe(ctx)
    rounds = []
    for i in range(ctx.args.bandwidth_rounds):
        bandwidth = measure_bandwidth(ctx, i)
        if probe:
            bandwidth["cores_before_decode"] = core_distance(ctx, probe, f"core-probe-{i}-before")
        speed = bench_model(ctx, f"bandwidth-decode-{i}", models, [1], rounds=1)
        if probe:
            bandwidth["cores_after_decode"] = core_distance(ctx, probe, f"core-probe-{i}-after")
        rounds.append({"bandwidth": bandwidth, "command": speed["command"],
                       "decode": {row["model"]: row["decode_hrm"] for row in speed["rows"]}})
    bound_gb_s = median_bound(r["bandwidth"] for r in rounds)
    rows = []
    for model in models:
        info = infos[model]
        bytes_per_token = info["weight_bytes_per_token"]
        bound = bound_gb_s * 1e9 / bytes_per_token
        decodes = [r["decode"][os.path.basename(model)] for r in rounds]
        fractions = [d / (r["bandwidth"]["bound_gb_s"] * 1e9 / bytes_per_token) for d, r in zip(decodes, rounds)]
        rows.append({"model": info["model"], "format": info["format"], "side": "hrm engine (hrm bench model)",
                     "weight_bytes_per_token": bytes_per_token, "bound_tok_s": bound,
                     "decode_tok_s": statistics.median(decodes), "fraction": statistics.median(fractions),
                     "fraction_range": [min(fractions), max(fractions)]})
        if model == ctx.args.gguf and gguf_result and "runs" in gguf_result:
            for t in gguf_result["runs"]["1"]["targets"]:
                # ab's output tokens/s at concurrency 1 includes prefill and HTTP: a lower bound
                # on the server's decode rate. It was measured earlier in the run, so it is set
                # against the rounds' median bound.
                rows.append({"model": info["model"], "format": info["format"],
                             "side": f"{t['target']} (ab, concurrency 1)",
                             "weight_bytes_per_token": bytes_per_token, "bound_tok_s": bound,
                             "decode_tok_s": t["output_tokens_per_s"], "fraction": t["output_tokens_per_s"] / bound})
    return {"rounds": [r["bandwidth"] for r in rounds], "decode_command": rounds[0]["command"], "rows": rows}


def median_bound(rounds):
    """The median of the rounds' bounds, in GB/s."""
    return statistics.median(b["bound_gb_s"] for b in rounds)


def requests_per_second(ctx):
    """`hrm serve` on models/sample at batch 8: 8 clients, 16 tokens each, against 10 req/s."""
    prompts = write_prompts(ctx, "rps-prompts.jsonl")
    with hrm_server(ctx, "hrm-sample", "models/sample") as ours:
        warm_up(ours, "hrm")
        ab = bench_ab(ctx, "rps-c8", [f"hrm={ours}"], prompts, 8, 16, duration=ctx.args.rps_seconds)
    ab["charts"] = copy_charts(ctx, ab, "sample-c8")
    ab["target_requests_per_s"] = 10
    return ab


def lm_eval(ctx, model):
    """run_lm_eval.py on one model; returns its JSON summary (or the failure)."""
    cmd = [ctx.args.ref_python, "tests/lm_eval/run_lm_eval.py", "--hrm", ctx.hrm, "--model", model]
    if ctx.args.lm_eval_limit:
        cmd += ["--limit", str(ctx.args.lm_eval_limit)]
    env = dict(ctx.env, PATH=os.path.dirname(ctx.args.ref_python) + os.pathsep + ctx.env.get("PATH", ""))
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    with open(os.path.join(ctx.logs, f"lm-eval-{os.path.basename(model)}.log"), "w") as f:
        f.write(f"$ {' '.join(cmd)}\n# exit {proc.returncode}\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    # The summary is the last top-level JSON object on stdout; the script exits non-zero after
    # printing it when lm-eval's log-likelihoods disagree with /loglikelihood.
    stdout = "\n" + proc.stdout
    start = stdout.rfind("\n{\n")
    if start < 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"}
    summary = json.loads(stdout[start:])
    summary["wall_seconds"] = round(time.perf_counter() - started, 1)
    summary["exit_code"] = proc.returncode
    found = re.search(r"Saving per-task samples to (\S+)/\*\.jsonl", proc.stderr)
    if found:
        summary.update(accuracy_by_loglikelihood(ctx, model, glob.glob(os.path.join(found.group(1), "samples_*.jsonl"))[0]))
    return summary


def accuracy_by_loglikelihood(ctx, model, samples_file):
    """The same multiple-choice requests as lm-eval's, scored by our /loglikelihood (which splits
    context and continuation, as a prefix LM needs) instead of /v1/completions' echo; lm-eval's
    rule: the choice with the highest summed log-likelihood."""
    with open(samples_file) as f:
        samples = [json.loads(line) for line in f]
    correct, chance = 0, 0.0
    with hrm_server(ctx, f"hrm-{os.path.basename(model)}-loglikelihood", model) as base:
        for sample in samples:
            pairs = [sample["arguments"][f"gen_args_{i}"] for i in range(len(sample["arguments"]))]
            ll = http_json(base + "/loglikelihood", {"prompts": [p["arg_0"] for p in pairs],
                                                     "continuations": [p["arg_1"] for p in pairs]})["ll"]
            correct += max(range(len(ll)), key=ll.__getitem__) == int(sample["target"])
            chance += 1 / len(pairs)
    return {"accuracy_by_loglikelihood": correct / len(samples), "chance_accuracy": chance / len(samples)}


def compare_quality(ctx):
    """HRM dense and MoE samples against the same-size Llama: perplexity, lm-eval, speed."""
    models = []
    for model in SAMPLES:
        log(f"  {model}")
        info = dry_run(ctx, model)
        ppl = json.loads(ctx.run([ctx.hrm, "bench", "perplexity", "--model", model, "--valid", "data/corpus/valid.txt"],
                                 "perplexity-" + os.path.basename(model)).strip().splitlines()[-1])
        entry = {"path": model, "family": info["family"], "parameters": info["parameters"],
                 "valid_loss": ppl["valid_loss"], "valid_perplexity": ppl["valid_perplexity"], "windows": ppl["windows"]}
        if ctx.args.ref_python:
            log(f"  lm-eval on {model} (tests/lm_eval/run_lm_eval.py)")
            entry["lm_eval"] = lm_eval(ctx, model)
        else:
            entry["lm_eval"] = {"error": "no --ref-python"}
        models.append(entry)
    speed = bench_model(ctx, "quality-speed", SAMPLES, [1, 8])
    for entry in models:
        for row in speed["rows"]:
            if row["model"] == os.path.basename(entry["path"]):
                entry[f"decode_b{row['batch']}"] = row["decode_hrm"]
                entry[f"prefill_b{row['batch']}"] = row["prefill_hrm"]
    return {"models": models, "speed_command": speed["command"], "lm_eval_limit": ctx.args.lm_eval_limit,
            "perplexity_command": "hrm bench perplexity --model MODEL --valid data/corpus/valid.txt"}


def compare_gap_fix(ctx):
    """The Q4_1 decode kernel, before and after: `hrm bench model` on the GGUF with the build
    before the fix and with --hrm, alternated (before, after, before, after) so that drift in the
    machine's speed falls on both; the better of each pair of runs is kept."""
    if not ctx.args.hrm_before:
        return {"skipped": "no --hrm-before"}
    before = os.path.join(ctx.work, "hrm-before")
    shutil.copy2(ctx.args.hrm_before, before)
    rows = []
    # Short prompts show the time to first token; 128 tokens is `hrm bench model`'s default.
    for prompt_tokens in (8, 128):
        runs = {"before": [], "after": []}
        for attempt in range(2):
            for side, binary in (("before", before), ("after", ctx.hrm)):
                name = f"gap-p{prompt_tokens}-{side}-{attempt}"
                table = os.path.join(ctx.work, f"{name}.md")
                cmd = [binary, "bench", "model", "--model", ctx.args.gguf, "--batch-sizes", "1,8",
                       "--prompt-tokens", str(prompt_tokens), "--threads", str(ctx.threads), "--out", table]
                ctx.run(cmd, name)
                with open(table) as f:
                    runs[side].append({int(c[1]): {"prefill": number(c[2]), "decode": number(c[5])}
                                       for c in parse_md_table(f.read())})
        for batch in sorted(runs["after"][0]):
            best = {side: {k: max(r[batch][k] for r in runs[side]) for k in ("prefill", "decode")} for side in runs}
            rows.append({"prompt_tokens": prompt_tokens, "batch": batch,
                         **{f"{k}_{side}": best[side][k] for side in best for k in best[side]}})
    return {"before": ctx.args.before_label, "gguf": os.path.basename(ctx.args.gguf), "rows": rows,
            "command": f"hrm bench model --model {os.path.basename(ctx.args.gguf)} --batch-sizes 1,8 "
                       f"--prompt-tokens {{8,128}} --threads {ctx.threads}"}


# ---------------------------------------------------------------------------------------------
# The Markdown


def fmt(v, digits=1, suffix=""):
    return "n/a" if v is None else f"{v:.{digits}f}{suffix}"


def speed_cells(row, first, second, over):
    """Six table cells: prefill, then decode, of the two sides and the ratio of side `over` to the
    other (decode's in bold)."""
    under = first if over == second else second
    cells = []
    for phase in ("prefill", "decode"):
        r = fmt(ratio(row[f"{phase}_{over}"], row[f"{phase}_{under}"]), 2, "×")
        cells.append(f"{fmt(row[f'{phase}_{first}'])} | {fmt(row[f'{phase}_{second}'])} | "
                     f"{f'**{r}**' if phase == 'decode' else r}")
    return " | ".join(cells)


def para(text):
    """One prose paragraph, wrapped at 100 columns as the rest of docs/performance.md is."""
    return textwrap.fill(text, 100, break_long_words=False, break_on_hyphens=False) + "\n"


def header(result, command):
    load = result.get("load_average")
    load = f" (1-minute load average {load[0]:.1f} before, {load[1]:.1f} after)" if load else ""
    return para(f"Measured {result['date']} on {result['machine']}{load}, by `benches/performance_report.py`:") + \
        f"\n```sh\n{command}\n```\n"


def not_measured(r):
    return para(f"Not measured: {r.get('error') or r.get('skipped')}")


def md_gguf(r):
    if "runs" not in r:
        return not_measured(r)
    peers = r.get("peers", ["llama.cpp"])
    command = (r["runs"]["1"]["command"].replace("--concurrency 1", "--concurrency {1,8}")
               .replace(f"--requests {r['prompts']}", "--requests {16,32}"))
    threads = r.get("threads", 2)
    server_text = (f"llama-cpp-python {r['llama_cpp_python']}'s `python -m llama_cpp.server --n_threads {threads}` "
                   "(`llama.cpp` below; no batching: concurrent requests queue)")
    if "llama-server" in peers:
        server_text += (f" and llama.cpp's own C++ server from the same release (`llama-server -t {threads} "
                        "--parallel 8 -c 4096`: continuous batching over 8 slots)")
    lines = [header(r, command),
             para(f"Same GGUF (`{r['gguf']}`), {r['prompts']} greedy English prompts, {r['max_tokens']} new tokens "
                  f"each; `hrm serve --max-batch-size 8` (RAYON_NUM_THREADS={threads}) against {server_text}. All "
                  "servers up and warmed, measured one after the other. Output tok/s is completion tokens over the "
                  "wall time of all requests (prefill and HTTP included); the peers' are recounted from their "
                  "non-streamed `usage` (ab's OpenAI adapter counts a final empty chunk as a token). Ratios are "
                  "ours over the peer's: above 1 is better for tok/s, below 1 is better for times."),
             "| concurrency | server | requests | errors | output tok/s | TTFT p50 ms | latency p50 ms | latency p99 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for c, ab in r["runs"].items():
        by = {t["target"]: t for t in ab["targets"]}
        for t in ab["targets"]:
            lines.append(f"| {c} | {t['target']} | {t['requests']} | {t['errors']} | {fmt(t['output_tokens_per_s'])} | "
                         f"{fmt(t['ttft_ms']['p50'])} | {fmt(t['latency_ms']['p50'])} | {fmt(t['latency_ms']['p99'])} |")
        ours = by.get("hrm")
        for peer in peers:
            theirs = by.get(peer)
            if ours and theirs:
                q = lambda f: fmt(ratio(f(ours), f(theirs)), 2, "×")  # noqa: E731
                lines.append(f"| {c} | **hrm / {peer}** | | | **{q(lambda t: t['output_tokens_per_s'])}** | "
                             f"{q(lambda t: t['ttft_ms']['p50'])} | {q(lambda t: t['latency_ms']['p50'])} | "
                             f"{q(lambda t: t['latency_ms']['p99'])} |")
    lines.append("")
    agree = [f"{p['greedy_identical']} of {p['greedy_prompts']} between {p.get('a', '?')} and {p.get('b', '?')} "
             f"at concurrency {c}" for c, ab in r["runs"].items() for p in ab.get("agreement", [])]
    charts = [f"[{kind}, concurrency {c}]({path})" for c, ab in r["runs"].items() for kind, path in ab["charts"].items()]
    text = f"Greedy outputs identical: {'; '.join(agree)}. " if agree else ""
    lines.append(para(text + "Charts: " + ", ".join(charts) + "."))
    return "\n".join(lines)


def speed_table(r, command, text, keys, first, second, over):
    """A section of prefill and decode tok/s of two sides: the command, the prose, then one row
    per entry of r["rows"], led by its `keys` columns."""
    lead = " | ".join(k.replace("_", " ") for k in keys)
    lines = [header(r, command), para(text),
             f"| {lead} | prefill tok/s {first} | {second} | ratio | decode tok/s {first} | {second} | ratio |",
             "|---" * (len(keys) + 6) + "|"]
    for row in r["rows"]:
        lead = " | ".join(str(row[k]) for k in keys)
        lines.append(f"| {lead} | {speed_cells(row, first, second, over)} |")
    return "\n".join(lines) + "\n"


def md_transformers(r):
    if "rows" not in r:
        return not_measured(r)
    return speed_table(
        r, r["command"],
        f"Same weights (`models/sample`, HRM-Text 7.9M, f32 activations), transformers "
        f"{r.get('transformers', '?')} / torch {r.get('torch', '?')} on CPU; 128 prompt tokens per "
        "sequence, 32 greedy decode steps with the KV cache, each cell a fresh process; ratio = hrm / "
        "transformers.",
        ["batch"], "hrm", "transformers", over="hrm")


def md_bandwidth(r):
    if "rows" not in r:
        return not_measured(r)
    # A results file from before the rounds holds one measurement under "bandwidth".
    rounds = r.get("rounds") or [r["bandwidth"]]
    first = rounds[0]

    def spread(key):
        values = [b[key] for b in rounds if b.get(key)]
        return f"{min(values):.1f}–{max(values):.1f} GB/s" if values else None

    measured = [f"`{first['aggregate_command']}`'s single-threaded \"read once\" pass {spread('aggregate_read_gb_s')}"]
    if spread("numpy_sum_gb_s"):
        measured += [f"numpy summing a 1 GiB float32 array {spread('numpy_sum_gb_s')}",
                     f"torch summing it with {r.get('threads', 2)} threads {spread('torch_sum_gb_s')}"]
    sources = sorted({b["bound_source"] for b in rounds})
    lines = [header(r, f"{first['aggregate_command']}  # each round\n{r['decode_command']}  # each round\n"
                        "hrm serve --dry-run --model-path MODEL"),
             para(f"{len(rounds)} round{'s' if len(rounds) != 1 else ''}, each measuring the read bandwidth and then both models' batch-1 decode "
                  f"back to back. Read bandwidth over the rounds: {', '.join(measured)}. Each round's bound uses its "
                  f"highest ({', '.join(sources)}): {spread('bound_gb_s')}, median **{median_bound(rounds):.2f} GB/s**. "
                  "Bytes per token: `weight_bytes_per_token` of `hrm serve --dry-run` (every weight one decode step "
                  "reads; HRM-Text's recurrent cycles re-read their layers and count each time). Bound = bandwidth / "
                  "bytes per token (the table's bound uses the median bandwidth); a round's fraction = its batch-1 "
                  "decode tok/s / its own bound, and the table gives the median of the rounds' fractions, their "
                  "range in brackets, beside the median decode rate. The server rows are ab's output tok/s at "
                  "concurrency 1 from earlier in the run (prefill and HTTP included), against the median bound, so "
                  "they understate decode."),
             *cores_sentence(rounds),
             "| model | format | measured | MB per token | bound tok/s | decode tok/s | fraction of bound |",
             "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        fraction = f"**{row['fraction'] * 100:.0f}%**"
        if "fraction_range" in row:
            low, high = row["fraction_range"]
            fraction += f" ({low * 100:.0f}–{high * 100:.0f}%)"
        lines.append(f"| {row['model']} | {row['format']} | {row['side']} | {row['weight_bytes_per_token'] / 1e6:.1f} | "
                     f"{row['bound_tok_s']:.0f} | {fmt(row['decode_tok_s'])} | {fraction} |")
    return "\n".join(lines) + "\n"


def cores_sentence(rounds):
    """The rounds' core round trips as a paragraph, where the run measured them."""
    pairs = [(b.get("cores_before_decode"), b.get("cores_after_decode")) for b in rounds]
    if not all(before and after for before, after in pairs):
        return []
    each = ", ".join(f"{before['round_trip_ns']}/{after['round_trip_ns']}" for before, after in pairs)
    return [para("A cache line's round trip between cores 0 and 1 (`benches/core_probe.c pair 1`), just before and "
                 f"just after each round's decode, in ns: {each}. On the 2-core Zen 4 VM of docs/performance.md "
                 "(\"The Zen 4 on 2026-12-05\") every round fell into one of two kinds, 51–70 ns (the cores close) "
                 "and 314–386 ns (far apart, most likely in two core complexes), and in the far kind two threads "
                 "read memory faster together and hand work to each other more slowly, so a round's fraction of "
                 "the bound falls; on an Intel Xeon of family 6 model 207, every round of 2026-12-05 read "
                 "99–199 ns.")]


def md_rps(r):
    if "targets" not in r:
        return not_measured(r)
    t = r["targets"][0]
    lines = [header(r, r["command"]),
             para("`hrm serve --model-path models/sample --max-batch-size 8`, 8 clients each sending one greedy "
                  "prompt for 16 new tokens, back to back; the specification's target is 10 requests/s at batch 8."),
             "| requests | errors | requests/s | target | output tok/s | latency p50 ms | p99 ms |",
             "|---|---|---|---|---|---|---|",
             f"| {t['requests']} | {t['errors']} | **{t['requests_per_s']:.1f}** | {r['target_requests_per_s']} | "
             f"{t['output_tokens_per_s']:.1f} | {fmt(t['latency_ms']['p50'])} | {fmt(t['latency_ms']['p99'])} |",
             "",
             para("Charts: " + ", ".join(f"[{k}]({p})" for k, p in r["charts"].items()) + ".")]
    return "\n".join(lines)


def md_quality(r):
    if "models" not in r:
        return not_measured(r)
    limit = r.get("lm_eval_limit")
    lines = [header(r, f"{r['perplexity_command']}\npython tests/lm_eval/run_lm_eval.py --hrm target/release/hrm "
                       f"--model MODEL{f' --limit {limit}' if limit else ''}\n{r['speed_command']}"),
             para("Validation perplexity: `hrm bench perplexity` on 64 evenly spaced windows of 129 tokens of "
                  "`data/corpus/valid.txt`, as `hrm train` scores. Accuracy: BIG-bench `general_knowledge` (PyPI "
                  "`bigbench==1.0.0`) as a multiple-choice task through lm-eval 0.4.13 `local-completions` "
                  f"against `hrm serve`, {f'the first {limit} documents' if limit else 'all documents'}; lm-eval "
                  "scores each choice with `/v1/completions` echo logprobs, which score the text causally. "
                  "The next column scores the same requests with our `/loglikelihood`, which keeps context "
                  "and continuation apart: on the prefix-LM HRM models the context is a bidirectional block, "
                  "so the two differ by design; on the causal Llama they must agree. `max |Δ|` is the "
                  "largest difference between the two log-likelihoods (run_lm_eval.py checks it against "
                  "1e-3 for causal models). Chance is the mean of 1 / choices. Decode tok/s from `hrm bench "
                  "model` (128 prompt tokens, 32 decode steps, 2 threads)."),
             "| model | family | parameters | valid perplexity | acc (lm-eval) | acc (/loglikelihood) | chance | max \\|Δ\\| | decode tok/s b1 | decode tok/s b8 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in r["models"]:
        ev = m.get("lm_eval", {})
        acc = "n/a ({})".format(ev["error"][:80]) if "error" in ev else f"{ev['accuracy']:.3f}"
        delta = f"{ev['max_abs_ll_difference_vs_loglikelihood']:.1e}" if "max_abs_ll_difference_vs_loglikelihood" in ev else "–"
        lines.append(f"| `{m['path']}` | `{m['family']}` | {m['parameters'] / 1e6:.2f}M | {m['valid_perplexity']:.1f} | "
                     f"{acc} | {fmt(ev.get('accuracy_by_loglikelihood'), 3)} | {fmt(ev.get('chance_accuracy'), 3)} | "
                     f"{delta} | {fmt(m.get('decode_b1'))} | {fmt(m.get('decode_b8'))} |")
    docs = {m["lm_eval"].get("documents") for m in r["models"] if "documents" in m.get("lm_eval", {})}
    lines.append("")
    lines.append(para(f"{', '.join(map(str, docs)) or 'No'} documents per model."))
    return "\n".join(lines)


def md_gap(r):
    if "rows" not in r:
        return not_measured(r)
    return speed_table(
        r, f"{r['command']}  # with the build before the fix, then with target/release/hrm, twice",
        f"Where our server trailed llama.cpp on `{r['gguf']}` (batch-1 decode, and the time to first "
        "token), a profile put the time in candle 0.11's Q4_1 × Q8_1 dot product, which is scalar code, "
        "and, for prefill, in dequantising every matrix to f32 on each call. The fix is our own "
        "quantised matmul (`crates/hrm-model/src/quant_matmul.rs`, Q4_1 and Q8_0, AVX2 with a scalar "
        "fallback that gives the same bits): it repacks the weights once at load, multiplies 8-bit "
        "activation blocks in exact integer arithmetic and unpacks each pair of weight blocks once for "
        f"several rows, so it serves prefill too. Before: {r['before']}. Each binary ran twice, alternately; "
        "the better run of each is shown.",
        ["prompt_tokens", "batch"], "before", "after", over="after")


def render(results):
    meta = results["meta"]
    parts = results["parts"]
    out = [BEGIN, "",
           "```sh",
           "python3 benches/performance_report.py --hrm target/release/hrm \\",
           "    --llama-python /tmp/llama/bin/python --llama-server /tmp/llama-src/build/bin/llama-server \\",
           "    --ref-python /tmp/ref/bin/python --hrm-before /tmp/before/target/release/hrm",
           "```", "",
           para("`--hrm-before` is the build before the gap fix below: `git worktree add /tmp/before 70e31c2 && "
                "(cd /tmp/before && cargo build --release --locked -p hrm-cli)`."),
           para(f"Last full run: {meta.get('date')}, {meta.get('wall_seconds', 0) / 60:.0f} minutes of wall time; "
                f"binary `{meta.get('hrm_binary')}` built {meta.get('hrm_binary_mtime')}; every figure is in "
                f"`{meta.get('out')}`, each command's output in `logs/` beside it.")]
    sections = [
        ("gguf", "### Ours against llama.cpp's servers, same GGUF", md_gguf),
        ("transformers", "### Ours against transformers on CPU, same HRM-Text weights", md_transformers),
        ("bandwidth", "### Batch-1 decode against the memory-bandwidth bound", md_bandwidth),
        ("rps", "### Requests/s at batch 8 against the target of 10", md_rps),
        ("quality", "### HRM-Text, HRM-MoE and the same-size Llama", md_quality),
        ("gap", "### The gap fixed: Q4_1 decode before and after", md_gap),
    ]
    for key, title, fn in sections:
        out.append(title + "\n")
        out.append(fn(parts[key]) if key in parts else "Not measured in this run.\n")
    out.append(END)
    return "\n".join(out)


def update_doc(path, block):
    with open(path) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        sys.exit(f"{path} has no {BEGIN} ... {END} block to replace")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc = head + block + tail
    with open(path, "w") as f:
        f.write(doc)


# ---------------------------------------------------------------------------------------------


# The instruction sets that pick our kernels, gemm's and the peers': a figure means little
# without them (the same model name covers AVX2-only and AVX-512 parts).
VECTOR_FLAGS = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                "avx512_bf16", "amx_tile"]


def machine():
    cpu = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break
            key, _, value = line.partition(":")
            cpu[key.strip()] = value.strip()
    flags = set(cpu.get("flags", "").split())
    vector = " ".join(f for f in VECTOR_FLAGS if f in flags) or "no AVX2"
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / 1024 / 1024
    return (f"this machine ({cpu.get('model name', 'unknown CPU')}, family {cpu.get('cpu family', '?')} "
            f"model {cpu.get('model', '?')}, flags {vector}; {os.cpu_count()} cores, {mem:.0f} GiB; "
            f"transparent huge pages {huge_pages_setting()})")


def huge_pages_setting():
    """The system's transparent huge pages setting (`always`, `madvise` or `never`): with `never`,
    a quantised model's weights lie on small pages and its decode runs slower."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            setting = f.read()
    except OSError:
        return "unknown"
    chosen = [word[1:-1] for word in setting.split() if word.startswith("[")]
    return chosen[0] if chosen else "unknown"


def package_versions(python, names):
    code = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    try:
        return json.loads(subprocess.run([python, "-c", code, *names], capture_output=True, text=True, check=True).stdout)
    except (subprocess.CalledProcessError, OSError, json.JSONDecodeError):
        return {}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hrm", default="target/release/hrm")
    p.add_argument("--llama-python", help="the Python of the venv with llama-cpp-python[server]")
    p.add_argument("--llama-server", help="llama.cpp's C++ llama-server, built from the sources vendored in "
                                          "the llama-cpp-python sdist (optional third target)")
    p.add_argument("--ref-python", help="the Python with torch, transformers and lm-eval[api]")
    p.add_argument("--gguf", help="the GGUF (default: scripts/smollm2-gguf)")
    p.add_argument("--hrm-before", help="for the gap part: a build of the commit before the Q4_1 kernel")
    p.add_argument("--before-label", default="commit 70e31c2 (candle's Q4_1 matmul; prefill dequantised to f32)",
                   help="how the report names --hrm-before")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rps-seconds", type=float, default=20.0)
    p.add_argument("--bandwidth-rounds", type=int, default=5,
                   help="rounds of the bandwidth part, each a bandwidth measurement and then the decode runs")
    p.add_argument("--lm-eval-limit", type=int, help="documents per model for lm-eval (default: all)")
    p.add_argument("--only", help=f"comma-separated parts: {','.join(PARTS)}")
    p.add_argument("--out", default="bench-out/perf/results.json")
    p.add_argument("--doc", default="docs/performance.md")
    p.add_argument("--charts", help="where ab's charts go (default: docs/perf, or with --no-doc a "
                                    "charts/ folder beside --out)")
    p.add_argument("--no-doc", action="store_true",
                   help="write the JSON (and the charts beside it) only: docs/ stays as it is")
    args = p.parse_args()
    if args.charts is None:
        # Charts copied into docs/perf would replace those of the report the page shows.
        args.charts = os.path.join(os.path.dirname(args.out) or ".", "charts") if args.no_doc else "docs/perf"
    os.chdir(ROOT)
    # SIGTERM unwinds like Ctrl-C, so that the servers' process groups are killed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.gguf:
        args.gguf = subprocess.run(["scripts/smollm2-gguf"], capture_output=True, text=True, check=True).stdout.strip()
    parts = args.only.split(",") if args.only else PARTS
    for part in parts:
        if part not in PARTS:
            p.error(f"unknown part {part!r}")
    if "quality" in parts and not os.path.exists("data/corpus/valid.txt"):
        log("building data/corpus (python3 data/build_corpus.py)")
        subprocess.run([sys.executable, "data/build_corpus.py"], check=True)

    ctx = Context(args)
    results = {"meta": {}, "parts": {}}
    if args.only and os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    stat = os.stat(args.hrm)
    results["meta"].update({
        "hrm_binary": args.hrm,
        "hrm_binary_mtime": datetime.datetime.fromtimestamp(stat.st_mtime, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "git_head": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "out": args.out,
    })
    if not args.only:
        results["meta"]["date"] = time.strftime("%Y-%m-%d")
    base = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "threads": args.threads,
            "hrm_binary_mtime": results["meta"]["hrm_binary_mtime"]}
    ref_versions = package_versions(args.ref_python, ["torch", "transformers", "lm_eval"]) if args.ref_python else {}

    def gguf():
        if not args.llama_python:
            return {"error": "no --llama-python given"}
        return compare_gguf(ctx)

    steps = {
        "gguf": gguf,
        "transformers": lambda: dict(compare_transformers(ctx), **ref_versions),
        "bandwidth": lambda: bandwidth_fraction(ctx, results["parts"].get("gguf")),
        "rps": lambda: requests_per_second(ctx),
        "quality": lambda: compare_quality(ctx),
        "gap": lambda: compare_gap_fix(ctx),
    }
    started = time.perf_counter()
    try:
        for part in PARTS:
            if part not in parts:
                continue
            log(f"== {part}")
            t = time.perf_counter()
            load_before = os.getloadavg()[0]
            try:
                results["parts"][part] = dict(steps[part](), **base)
            except Exception as e:  # noqa: BLE001 - a part that fails is reported, not fatal
                log(f"{part} FAILED: {e}")
                results["parts"][part] = dict(base, error=f"{type(e).__name__}: {e}")
            results["parts"][part]["seconds"] = round(time.perf_counter() - t, 1)
            # Other work on the machine shows here: a load above the core count means shared cores.
            results["parts"][part]["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            log(f"{part}: done in {results['parts'][part]['seconds']} s")
    finally:
        wall = time.perf_counter() - started
        if not args.only:
            results["meta"]["wall_seconds"] = round(wall, 1)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        log(f"wrote {args.out} (logs in {ctx.logs}); {wall / 60:.1f} minutes")
        shutil.rmtree(ctx.work, ignore_errors=True)
    if not args.no_doc:
        update_doc(args.doc, render(results))
        log(f"updated {args.doc}")


if __name__ == "__main__":
    main()
