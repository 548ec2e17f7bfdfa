"""bf16 on real weights: how many greedy outputs of the paged engine agree with HF `generate`, and where they part.

In fp32 the paged engine equals `generate` token for token (plugins/omni_qwen/tests/test_smollm2_fidelity.py,
same prompts). In bf16 the two compute the same model with different kernels and reduction orders (one
flattened batch of every request against one request alone), so rounding differs and a near-tie between two
tokens can flip; after a flip the texts go separate ways. This runs the prompts through omni in bf16, all in
one batch, and through HF `generate` in bf16 one at a time (and, with --fp32, HF in fp32 as well), greedy,
EOS ignored, and reports per prompt the first position where the tokens differ. The last line is one JSON
object.

    .venv/bin/python benchmarks/bf16_agreement.py                # SmolLM2-135M-Instruct from omni's cache
    .venv/bin/python benchmarks/bf16_agreement.py --fp32 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from omni_kernel import Omni, RequestFinished  # noqa: E402

PROMPTS = (  # the fidelity test's prompts
    "Describe a school.", "What is 17 * 23?", "Write a haiku about rain.",
    "Give me three tips for learning to play the guitar.", "Translate 'good morning' into French and Spanish.",
    "Explain what a black hole is to a ten-year-old.", "Write a Python function that reverses a string.",
    "List the planets of the solar system in order.", "What is the capital of Australia?",
    "Summarize the plot of Romeo and Juliet in two sentences.", "How do I make a cup of green tea?",
    "Write a short, polite email declining a meeting invitation.", "What are the benefits of regular exercise?",
    "Count from 1 to 12, separated by commas.",
    'Return a JSON object with keys "name" and "age" for a fictional person.', "Why is the sky blue?",
    "Suggest a name for a small bakery by the sea.", "What happened in 1969 that changed space exploration?",
    "Describe the smell of a forest after a storm.", "Write a limerick about a cat who loves to code.",
    "  Tabs\tand  spaces   before 42 and 3.14159 digits?",
    "What is the difference between a virus and a bacterium?",
)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def hf_outputs(model_dir, tokenizer, prompts, dtype, tokens) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
        outs.append(out[0, len(ids):].tolist())
    return outs


def omni_outputs(model_dir, prompts, dtype, tokens, compile: bool = False) -> list[list[int]]:
    omni = Omni("ar_text", ar_model=str(model_dir), ar_device="cpu", ar_dtype=dtype, ar_kv_memory="256MiB",
                ar_compile=compile)
    for i, ids in enumerate(prompts):
        omni.submit(omni.request("", request_id=f"r{i}", prompt_token_ids=ids, max_tokens=tokens, ignore_eos=True))
    done = {}
    while omni.has_unfinished():
        for event in omni.step():
            if isinstance(event, RequestFinished):
                done[event.request_id] = event.result.output.data["token_ids"]
    return [done[f"r{i}"] for i in range(len(prompts))]


def summary(name, ours, theirs, tokens, tokenizer, prompts_text) -> dict:
    firsts = [first_difference(a, b) for a, b in zip(ours, theirs)]
    for text, first, a, b in zip(prompts_text, firsts, ours, theirs):
        where = "agree" if first is None else (f"differ at token {first}: {tokenizer.decode(a[first:first + 4])!r} "
                                               f"vs {tokenizer.decode(b[first:first + 4])!r}")
        print(f"{name}: {text[:48]!r:52} {where}", file=sys.stderr)
    diverged = sorted(f for f in firsts if f is not None)
    return {"agree": firsts.count(None), "of": len(firsts), "tokens": tokens, "first_difference": diverged}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ar-model", default=None, help="a local causal-LM directory (default: SmolLM2 from the "
                                                         "cache)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--fp32", action="store_true", help="also compare with HF generate in fp32")
    parser.add_argument("--compile", action="store_true", help="omni with ar_compile (its decode step compiled)")
    args = parser.parse_args()
    model_dir = args.ar_model
    if model_dir is None:
        from omni_qwen.registry_model import FETCH_COMMAND, cached

        model_dir = cached()
        if model_dir is None:
            raise SystemExit(f"SmolLM2-135M-Instruct is not in omni's cache: `{FETCH_COMMAND}` fetches it")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in PROMPTS]
    start = time.perf_counter()
    ours = omni_outputs(model_dir, prompts, "bf16", args.tokens, args.compile)
    result = {"benchmark": "bf16_agreement", "model": str(model_dir), "omni_compile": args.compile,
              "omni_bf16_vs_hf_bf16": summary("vs HF bf16", ours, hf_outputs(model_dir, tokenizer, prompts,
                                                                              torch.bfloat16, args.tokens),
                                              args.tokens, tokenizer, PROMPTS)}
    if args.fp32:
        fp32 = hf_outputs(model_dir, tokenizer, prompts, torch.float32, args.tokens)
        result["omni_bf16_vs_hf_fp32"] = summary("vs HF fp32", ours, fp32, args.tokens, tokenizer, PROMPTS)
    result["elapsed_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
