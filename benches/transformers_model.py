#!/usr/bin/env python3
"""The transformers side of `hrm bench model` (see crates/hrm-cli/src/bench/model.rs).

    transformers_model.py run --model PATH --batch B --prompt-tokens P --decode-tokens N --threads T [--passes K]
        prints one JSON line: prefill_tokens_per_s, decode_tokens_per_s, peak_rss_mb (the medians
        of K timed passes after one warm-up)
    transformers_model.py make-hrm OUT_DIR
        writes a random HRM-Text (hidden 256, 2 layers per stack, H_cycles 2, L_cycles 2,
        vocab 8192, 7.9M parameters) for benchmarking

The token ids and the loop mirror the Rust side exactly: same pseudo-random ids, one prefill of
the whole batch, then greedy decode with the KV cache for N steps, each pass from a fresh cache.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ids  # noqa: E402


def load(path):
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        directory, name = os.path.split(path)
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def tokenizer_vocab(path):
    if path.endswith(".gguf"):
        return None
    tok = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tok).get_vocab_size(with_added_tokens=True)


def run(args):
    torch.set_num_threads(args.threads)
    model = load(args.model).eval()
    vocab = model.config.vocab_size
    tok_vocab = tokenizer_vocab(args.model)
    if tok_vocab:
        vocab = min(vocab, tok_vocab)
    ids = torch.tensor(bench_ids(args.batch, args.prompt_tokens, vocab))
    extra = {}
    if getattr(model.config, "prefix_lm", False):
        extra["token_type_ids"] = torch.ones_like(ids)

    def decode(steps):
        with torch.no_grad():
            start = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **extra)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            prefill = time.perf_counter() - start
            cache = out.past_key_values
            start = time.perf_counter()
            for _ in range(steps):
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            return prefill, time.perf_counter() - start

    decode(2)
    passes = [decode(args.decode_tokens) for _ in range(args.passes)]
    prefill_s = statistics.median(p[0] for p in passes)
    decode_s = statistics.median(p[1] for p in passes)
    print(
        json.dumps(
            {
                "prefill_tokens_per_s": args.batch * args.prompt_tokens / prefill_s,
                "decode_tokens_per_s": args.batch * args.decode_tokens / decode_s,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            }
        )
    )


def make_hrm(args):
    from transformers import HrmTextConfig, HrmTextForCausalLM

    torch.manual_seed(0)
    config = HrmTextConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        H_cycles=2,
        L_cycles=2,
        prefix_lm=True,
        eos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = HrmTextForCausalLM(config)
    model.save_pretrained(args.out_dir)
    # The benchmark feeds token ids directly; any tokenizer with a small vocabulary will do.
    here = os.path.dirname(os.path.abspath(__file__))
    shutil.copy(os.path.join(here, "..", "tests", "fixtures", "hrm-text", "tokenizer.json"), args.out_dir)
    print(f"wrote {args.out_dir}: {sum(p.numel() for p in model.parameters())} parameters", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--batch", type=int, required=True)
    r.add_argument("--prompt-tokens", type=int, required=True)
    r.add_argument("--decode-tokens", type=int, required=True)
    r.add_argument("--passes", type=int, default=1, help="timed passes after the warm-up; the medians are reported")
    r.add_argument("--threads", type=int, default=2)
    m = sub.add_parser("make-hrm")
    m.add_argument("out_dir")
    args = parser.parse_args()
    run(args) if args.command == "run" else make_hrm(args)


if __name__ == "__main__":
    main()
