#!/usr/bin/env python3
"""lm-evaluation-harness's `local-chat-completions` model against `hrm serve`'s chat route.

    python tests/lm_eval/check_chat.py http://127.0.0.1:PORT [MODEL.gguf]

Runs lm-eval 0.4.13 (`tests/lm_eval/requirements.txt`) with `--apply_chat_template` on a small
generation task made here (`capitals.jsonl`: eight "What is the capital of ...?" questions, exact
match against the capital), then asks `/v1/chat/completions` the same questions directly and
fails unless every answer lm-eval recorded is the server's own. Prints what it saw as JSON. Run
by crates/hrm-cli/tests/openai_client.rs against the SmolLM2 GGUF.
"""

import glob
import json
import os
import subprocess
import sys
import tempfile
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
TASK = "hrm_chat_capitals"


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def main():
    base = sys.argv[1]
    lm_eval = os.path.join(os.path.dirname(sys.executable), "lm_eval")
    work = tempfile.mkdtemp(prefix="hrm-lm-eval-chat-")
    with open(os.path.join(work, f"{TASK}.yaml"), "w") as f:
        f.write(
            f"task: {TASK}\n"
            "dataset_path: json\n"
            f"dataset_kwargs: {{data_files: {{test: {os.path.join(HERE, 'capitals.jsonl')}}}}}\n"
            "output_type: generate_until\n"
            "test_split: test\n"
            'doc_to_text: "{{question}}"\n'
            'doc_to_target: "{{answer}}"\n'
            "generation_kwargs: {until: [\"\\n\\n\"], max_gen_toks: 16, do_sample: false, temperature: 0}\n"
            "metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true, ignore_punctuation: true}]\n"
        )
    model = json.load(urllib.request.urlopen(f"{base}/v1/models"))["data"][0]["id"]
    out_dir = os.path.join(work, "out")
    cmd = [
        lm_eval, "--model", "local-chat-completions",
        "--model_args", f"model={model},base_url={base}/v1/chat/completions,num_concurrent=1,max_retries=1",
        "--apply_chat_template", "--tasks", TASK, "--include_path", work,
        "--log_samples", "--output_path", out_dir,
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OPENAI_API_KEY="not-needed")
    subprocess.run(cmd, check=True, env=env)

    samples = glob.glob(os.path.join(out_dir, "**", f"samples_{TASK}_*.jsonl"), recursive=True)
    results = glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)
    assert samples and results, f"lm-eval wrote no samples or results under {out_dir}"
    recorded = [json.loads(line) for line in open(samples[0])]
    assert len(recorded) == 8, f"{len(recorded)} samples, not 8"
    score = json.load(open(results[0]))["results"][TASK]
    mismatches = []
    for sample in recorded:
        question = sample["doc"]["question"]
        theirs = sample["resps"][0][0]
        ours = post(f"{base}/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": 16, "temperature": 0, "stop": ["\n\n"],
        })["choices"][0]["message"]["content"]
        if theirs != ours:
            mismatches.append({"question": question, "lm_eval": theirs, "server": ours})
    print(json.dumps({
        "model": model,
        "samples": len(recorded),
        "exact_match": score.get("exact_match,none"),
        "answers": [s["resps"][0][0] for s in recorded],
        "mismatches": mismatches,
    }, indent=2))
    if mismatches:
        sys.exit(f"{len(mismatches)} of lm-eval's recorded answers differ from the server's")


if __name__ == "__main__":
    main()
