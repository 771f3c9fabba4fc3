#!/usr/bin/env python3
"""The PyTorch side of `hrm bench train` (see crates/hrm-cli/src/bench/train.rs).

    transformers_train.py --config CONFIG.json --batch-size B --micro-batch M --seq-len S --steps N --threads T

Builds the model from the config with transformers (random weights), then runs one warm-up and N
timed steps of: micro-batched forward/backward with transformers' causal-LM loss, gradient
clipping to 1.0, torch.optim.AdamW. Prints one JSON line with tokens_per_s. transformers has no
hrm_text_moe; for one, the dense hrm_text of the same active size is measured instead (each
expert's width times experts per token), and the note says so.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ids  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from transformers import AutoConfig, AutoModelForCausalLM

    with open(args.config) as f:
        raw = json.load(f)
    note = None
    if raw.get("model_type") == "hrm_text_moe":
        active = raw["intermediate_size"] * raw.get("num_experts_per_tok", 1)
        note = f"transformers has no hrm_text_moe: dense hrm_text with intermediate_size {active} (same active size)"
        raw = {k: v for k, v in raw.items() if k not in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")}
        raw["model_type"] = "hrm_text"
        raw["intermediate_size"] = active
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **raw)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.tensor(bench_ids(args.batch_size, args.seq_len + 1, config.vocab_size))
    micro = ids.split(args.micro_batch)

    def step():
        opt.zero_grad(set_to_none=True)
        for mb in micro:
            loss = model(input_ids=mb, labels=mb, use_cache=False).loss / len(micro)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    tokens = args.steps * args.batch_size * args.seq_len
    print(json.dumps({"tokens_per_s": tokens / elapsed, "note": note}))


if __name__ == "__main__":
    main()
