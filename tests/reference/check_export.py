#!/usr/bin/env python3
"""Proves that a checkpoint written by `hrm train` loads in transformers and computes what we do.

    python tests/reference/check_export.py MODEL_DIR --hrm target/release/hrm

It loads MODEL_DIR with transformers' AutoModelForCausalLM (HrmTextForCausalLM for a dense
hrm_text export, LlamaForCausalLM for llama), checks that every tensor was used (no missing or
unexpected keys), scores a few continuations with transformers, scores the same pairs with
`hrm score`, and fails if any log-likelihood differs by more than --tolerance. It needs the
reference environment of tests/reference/README.md, so it is run by hand, not in CI.
"""

import argparse
import json
import subprocess
import sys

import torch

PAIRS = [
    ("It was a dark and stormy night", " and the rain fell"),
    ("In the beginning God created", " the heaven and the earth."),
    ("To be, or not to be,", " that is the question"),
]


def transformers_scores(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        sys.exit(f"transformers did not load every tensor: {problems}")
    model.eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prefix_lm = getattr(model.config, "prefix_lm", False)
    scores = []
    for context, continuation in PAIRS:
        ctx = tok(context, add_special_tokens=False).input_ids
        whole = tok(context + continuation, add_special_tokens=False).input_ids
        ids = torch.tensor([whole])
        kwargs = {}
        if prefix_lm:
            types = torch.zeros_like(ids)
            types[:, : len(ctx)] = 1
            kwargs["token_type_ids"] = types
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids, **kwargs).logits[0].float(), dim=-1)
        scores.append(sum(logprobs[p - 1, whole[p]].item() for p in range(len(ctx), len(whole))))
    return type(model).__name__, scores


def hrm_scores(hrm, model_dir):
    scores = []
    for context, continuation in PAIRS:
        out = subprocess.run(
            [hrm, "score", "--model-path", model_dir, "--context", context, "--continuation", continuation],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        scores.append(json.loads(out.strip().splitlines()[-1])["logprob"])
    return scores


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--hrm", default="target/release/hrm")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    cls, theirs = transformers_scores(args.model_dir)
    ours = hrm_scores(args.hrm, args.model_dir)
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    for (context, continuation), a, b in zip(PAIRS, ours, theirs):
        print(f"{context!r} + {continuation!r}: hrm {a:.5f}  transformers {b:.5f}")
    print(f"loaded as {cls}; largest difference {worst:.2e}")
    if worst > args.tolerance:
        sys.exit(f"log-likelihoods differ by {worst} > {args.tolerance}")


if __name__ == "__main__":
    main()
