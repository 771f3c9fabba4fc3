#!/usr/bin/env python3
"""OpenAI's official Python client against `hrm serve`, as a user would point it at the server.

    python tests/openai/check_client.py http://127.0.0.1:PORT MODEL.gguf

Completions, completions streamed, chat, chat streamed, `n` samples, chat log-probabilities, and
an unsupported field refused by name. The chat answer must be the completion of the prompt that
Jinja2 renders from the GGUF's own chat template, the way transformers' `apply_chat_template`
renders it (a sandboxed environment with trimmed blocks): the reference for the server's
minijinja rendering. Exits non-zero with the failed check; prints what it saw as JSON. Run by
crates/hrm-cli/tests/openai_client.rs against the SmolLM2 GGUF, whose chat template is real.
"""

import json
import sys

import openai
from gguf import GGUFReader
from jinja2.sandbox import ImmutableSandboxedEnvironment
from openai import OpenAI


def rendered_by_jinja2(gguf_path, messages):
    field = GGUFReader(gguf_path).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def main():
    base, gguf_path = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base + "/v1", api_key="not-needed", max_retries=0)
    model = client.models.list().data[0].id
    seen = {"model": model}

    prompt = "The capital of France is"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    text = plain.choices[0].text
    assert text.strip(), f"an empty completion: {plain}"
    seen["completion"] = text

    pieces, usage = [], None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        pieces.extend(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(pieces) == text, f"streamed {''.join(pieces)!r}, plain {text!r}"
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens, usage
    seen["completion_streamed_chunks"] = len(pieces)

    many = client.completions.create(model=model, prompt=["Once upon a time", "In the beginning"],
                                      n=3, max_tokens=6, temperature=1, seed=11)
    assert sorted(c.index for c in many.choices) == list(range(6)), many
    seen["n_texts"] = [c.text for c in sorted(many.choices, key=lambda c: c.index)]

    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=question, max_tokens=12, temperature=0,
                                          logprobs=True, top_logprobs=2)
    answer = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant"
    reference = client.completions.create(model=model, prompt=rendered_by_jinja2(gguf_path, question),
                                          max_tokens=12, temperature=0).choices[0].text
    assert answer == reference, f"chat answered {answer!r}, the Jinja2-rendered prompt {reference!r}"
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens, (len(content), chat.usage)
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    seen["chat"] = answer

    deltas, finish = [], None
    for chunk in client.chat.completions.create(model=model, messages=question, max_tokens=12,
                                                temperature=0, stream=True):
        for c in chunk.choices:
            deltas.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(deltas) == answer, f"streamed {''.join(deltas)!r}, plain {answer!r}"
    assert finish == chat.choices[0].finish_reason, finish
    seen["chat_streamed_chunks"] = len(deltas)

    several = client.chat.completions.create(model=model, messages=question, n=2, max_tokens=8,
                                             temperature=1, seed=5)
    assert [c.index for c in several.choices] == [0, 1], several
    seen["chat_n"] = [c.message.content for c in several.choices]

    try:
        client.completions.create(model=model, prompt=prompt, max_tokens=4, best_of=3)
        raise AssertionError("best_of=3 was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "best_of" and e.body["code"] == "unsupported_field", e.body
        seen["best_of"] = e.body["message"]

    print(json.dumps(seen, indent=2))


if __name__ == "__main__":
    main()
