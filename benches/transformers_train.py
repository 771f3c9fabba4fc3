#!/usr/bin/env python3
"""The PyTorch side of `hrm bench train` (see crates/hrm-cli/src/bench/train.rs).

    transformers_train.py --config CONFIG.json --batch-size B --micro-batch M --seq-len S --steps N --threads T

Builds the model from the config with transformers (random weights), then runs one warm-up and N
timed steps of: micro-batched forward/backward with transformers' causal-LM loss, gradient
clipping to 1.0, torch.optim.AdamW. Prints one JSON line with tokens_per_s and a note.

transformers has no hrm_text_moe. For one, `--moe-reference mixtral` (the default) builds
transformers' hrm_text with each layer's MLP replaced by transformers' own
`MixtralSparseMoeBlock` (the same routing and fused expert layout as hrm_text_moe's block, the one
tests/reference checks our block against), experts of the config's width, plus the same
load-balancing loss (Switch's, per block, averaged over the blocks, times the config's
coefficient): the same model. `--moe-reference dense` measures the dense hrm_text of the same
active size instead (each expert's width times experts per token): half the expert weights and
no routing, a cheaper model than the one our side trains.
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
    p.add_argument("--moe-reference", choices=["mixtral", "dense"], default="mixtral")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from transformers import AutoConfig, AutoModelForCausalLM

    with open(args.config) as f:
        raw = json.load(f)
    note = None
    moe = None
    if raw.get("model_type") == "hrm_text_moe":
        experts, top_k = raw.pop("num_experts"), raw.pop("num_experts_per_tok", 1)
        coef = raw.pop("router_aux_loss_coef", 0.0)
        raw["model_type"] = "hrm_text"
        if args.moe_reference == "dense":
            raw["intermediate_size"] *= top_k
            note = (f"transformers has no hrm_text_moe: dense hrm_text with intermediate_size "
                    f"{raw['intermediate_size']} (same active size)")
        else:
            moe = {"experts": experts, "top_k": top_k, "aux_coef": coef}
            note = (f"transformers has no hrm_text_moe: hrm_text with transformers' MixtralSparseMoeBlock "
                    f"as each MLP ({experts} experts of {raw['intermediate_size']}, top {top_k})")
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **raw)
    model = AutoModelForCausalLM.from_config(config)
    routed = install_experts(model, config, moe["experts"], moe["top_k"]) if moe else None
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.tensor(bench_ids(args.batch_size, args.seq_len + 1, config.vocab_size))
    micro = ids.split(args.micro_batch)

    def step():
        opt.zero_grad(set_to_none=True)
        for mb in micro:
            loss = model(input_ids=mb, labels=mb, use_cache=False).loss
            if routed is not None:
                loss = loss + moe["aux_coef"] * balancing_loss(routed, moe["experts"])
            (loss / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    tokens = args.steps * args.batch_size * args.seq_len
    print(json.dumps({"tokens_per_s": tokens / elapsed, "note": note}))


def install_experts(model, config, experts, top_k):
    """Replaces every decoder layer's MLP with transformers' `MixtralSparseMoeBlock` (experts of
    the config's intermediate size, initialised as the model's own weights are), and returns the
    list that collects each block's router logits and chosen experts on every forward pass."""
    from transformers import MixtralConfig
    from transformers.models.hrm_text.modeling_hrm_text import HrmTextDecoderLayer
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    # `grouped_mm`: what a Mixtral model that transformers loads runs by default.
    block_config = MixtralConfig(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                                 num_local_experts=experts, num_experts_per_tok=top_k, router_jitter_noise=0.0,
                                 hidden_act="silu", experts_implementation="grouped_mm")
    routed = []
    for layer in [m for m in model.modules() if isinstance(m, HrmTextDecoderLayer)]:
        block = MixtralSparseMoeBlock(block_config)
        for weight in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
            torch.nn.init.normal_(weight, std=config.initializer_range)
        block.gate.register_forward_hook(lambda _m, _i, out: routed.append((out[0], out[2])))
        layer.mlp = block
    return routed


def balancing_loss(routed, experts):
    """hrm_text_moe's load-balancing loss over the blocks run since the last call: per block
    `experts * sum_e(f_e * P_e)` (f_e the share of routing slots sent to expert e, P_e its mean
    router probability), averaged over the blocks."""
    losses = []
    for logits, chosen in routed:
        probs = torch.softmax(logits.float(), dim=-1)
        share = torch.bincount(chosen.flatten(), minlength=experts).float() / chosen.numel()
        losses.append(experts * (share * probs.mean(0)).sum())
    routed.clear()
    return torch.stack(losses).mean()


if __name__ == "__main__":
    main()
