#!/usr/bin/env python3
"""End-to-end proof that lm-evaluation-harness can drive `hrm serve`.

    python tests/lm_eval/run_lm_eval.py --hrm target/release/hrm --model MODEL [--limit N]

1. Takes a multiple-choice task from a PyPI package: BIG-bench's `general_knowledge`
   (`pip download --no-binary :all: --no-deps bigbench==1.0.0`, 358 MB; only its task.json is read).
2. Starts `hrm serve` on MODEL on a free local port.
3. Runs lm-eval 0.4.13 `--model local-completions` with `tokenizer_backend=remote`: no local
   tokenizer; lm-eval tokenises through /tokenize, /detokenize and /tokenizer_info and scores
   through /v1/completions with echo and logprobs.
4. Sends every (context, continuation) pair lm-eval scored to our own /loglikelihood and, for a
   causal model, fails unless each log-likelihood agrees within --tolerance. A prefix-LM model
   (`prefix_lm` in /v1/models: hrm_text by default) scores echoed text causally and
   /loglikelihood's continuation after a bidirectional context block, so there the difference is
   reported, not checked (docs/api.md, `echo`).

Needs `pip install "lm-eval[api]==0.4.13"`; not part of CI (large downloads).
"""

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request

TASK_MEMBER = "bigbench/benchmark_tasks/general_knowledge/task.json"


def bigbench_items(cache):
    os.makedirs(cache, exist_ok=True)
    sdists = glob.glob(os.path.join(cache, "bigbench-1.0.0.tar.gz"))
    if not sdists:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
             "-d", cache, "bigbench==1.0.0"],
            check=True,
        )
        sdists = glob.glob(os.path.join(cache, "bigbench-1.0.0.tar.gz"))
    with tarfile.open(sdists[0]) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(TASK_MEMBER))
        task = json.load(tar.extractfile(member))
    items = []
    for ex in task["examples"]:
        choices = list(ex["target_scores"])
        label = max(range(len(choices)), key=lambda i: ex["target_scores"][choices[i]])
        items.append({"question": ex["input"], "choices": choices, "label": label})
    return items


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hrm", default="target/release/hrm")
    parser.add_argument("--model", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "hrm-lm-eval-cache"))
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="hrm-lm-eval-")
    items = bigbench_items(args.cache)
    with open(os.path.join(work, "items.jsonl"), "w") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
    with open(os.path.join(work, "general_knowledge.yaml"), "w") as f:
        f.write(
            "task: bigbench_general_knowledge_mc\n"
            "dataset_path: json\n"
            f"dataset_kwargs: {{data_files: {{test: {os.path.join(work, 'items.jsonl')}}}}}\n"
            "output_type: multiple_choice\n"
            "test_split: test\n"
            'doc_to_text: "Q: {{question}} A:"\n'
            "doc_to_target: label\n"
            'doc_to_choice: "{{choices}}"\n'
            "metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]\n"
        )

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [args.hrm, "serve", "--host", "127.0.0.1", "--port", str(port), "--model-path", args.model],
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(work, "serve.log"), "w"),
    )
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{base}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.5)
        else:
            sys.exit("hrm serve never became ready")
        served = json.load(urllib.request.urlopen(f"{base}/v1/models"))["data"][0]
        name = served["id"]

        out_dir = os.path.join(work, "out")
        cmd = [
            "lm_eval", "--model", "local-completions",
            "--model_args",
            f"model={name},base_url={base}/v1/completions,tokenizer_backend=remote,"
            "max_length=512,num_concurrent=1,max_retries=1",
            "--batch_size", "1", "--tasks", "bigbench_general_knowledge_mc", "--include_path", work,
            "--log_samples", "--output_path", out_dir,
        ]
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OPENAI_API_KEY="")
        started = time.time()
        subprocess.run(cmd, check=True, env=env)
        elapsed = time.time() - started

        samples_file = glob.glob(os.path.join(out_dir, "**", "samples_*.jsonl"), recursive=True)[0]
        results_file = glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)[0]
        accuracy = json.load(open(results_file))["results"]["bigbench_general_knowledge_mc"]["acc,none"]
        pairs, theirs = [], []
        for line in open(samples_file):
            sample = json.loads(line)
            arguments = sample["arguments"]
            if isinstance(arguments, dict):  # lm-eval 0.4.13: {"gen_args_0": {"arg_0", "arg_1"}, ...}
                arguments = [arguments[f"gen_args_{i}"] for i in range(len(arguments))]
            for args_i, response in zip(arguments, sample["resps"]):
                if isinstance(args_i, dict):
                    context, continuation = args_i["arg_0"], args_i["arg_1"]
                else:
                    context, continuation = args_i
                pairs.append((context, continuation))
                theirs.append(float(response[0][0]))
        ours = []
        for i in range(0, len(pairs), 32):
            chunk = pairs[i : i + 32]
            body = {"prompts": [c for c, _ in chunk], "continuations": [x for _, x in chunk]}
            ours.extend(post(f"{base}/loglikelihood", body)["ll"])
        worst = max(abs(a - b) for a, b in zip(ours, theirs))
        print(
            json.dumps(
                {
                    "model": name,
                    "task": "bigbench general_knowledge (PyPI bigbench==1.0.0)",
                    "documents": len({c for c, _ in pairs}),
                    "scored_pairs": len(pairs),
                    "accuracy": accuracy,
                    "lm_eval_seconds": round(elapsed, 1),
                    "max_abs_ll_difference_vs_loglikelihood": worst,
                    "prefix_lm": served["prefix_lm"],
                },
                indent=2,
            )
        )
        if not served["prefix_lm"] and worst > args.tolerance:
            sys.exit(f"lm-eval's log-likelihoods differ from /loglikelihood by {worst} > {args.tolerance}")
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
