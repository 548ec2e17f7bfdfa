"""Many concurrent text requests through Omni("ar_text") (default: the paged engine), each streamed separately:
greedy outputs equal `model.generate` alone, each request's deltas concatenate to its final text, and a seeded
sampled request reproduces its output whatever batch it ran in."""

from __future__ import annotations

import pytest
import torch

from omni_kernel import ARParams, Omni, RequestFailed, RequestFinished, TokenDelta

WORDS = ["school", "学校", "🦊", "river", "café", "图书馆", "the quick brown fox", "x"]


def workload():
    """(prompt, ARParams) of 18 requests with prompts of 1 to ~150 tokens and budgets of 1 to 40 tokens."""
    reqs = []
    for i in range(18):
        prompt = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + (i * 7) % 40))
        sampled = i % 6 == 5
        params = ARParams(max_tokens=1 + (i * 13) % 40, temperature=0.9 if sampled else 0.0,
                          top_p=0.9 if sampled else 1.0, top_k=40 if sampled else -1, seed=100 + i if sampled else None)
        reqs.append((prompt, params))
    return reqs


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()


def generate_alone(model, prompt_ids, max_tokens):
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_tokens,
                         repetition_penalty=1.0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt_ids):].tolist()


def test_sixteen_plus_concurrent_streams(tiny_ckpt, host, hf_model):
    omni = Omni("ar_text", host=host, ar_model=str(tiny_ckpt), ar_max_num_batched_tokens=96)
    reqs = [omni.request(prompt, ar=params, stream=True) for prompt, params in workload()]
    deltas: dict[str, list[str]] = {r.request_id: [] for r in reqs}
    results = {}
    for r in reqs:
        omni.submit(r)
    while omni.has_unfinished():
        for event in omni.step():
            assert not isinstance(event, RequestFailed), event
            if isinstance(event, TokenDelta):
                deltas[event.request_id].append(event.text)
            elif isinstance(event, RequestFinished):
                results[event.request_id] = event.result
    stage = omni.graph.stages["generate"]
    assert max(n for n, _, _ in stage.executor.step_log) >= 16  # they really ran together
    assert stage.engine.scheduler.blocks.num_used == 0 and not stage.executor.sequences
    lengths = {len(results[r.request_id].output.data["prompt_token_ids"]) for r in reqs}
    assert min(lengths) < 20 and max(lengths) > 100
    for request, (prompt, params) in zip(reqs, workload()):
        result = results[request.request_id]
        assert "".join(deltas[request.request_id]) == result.text
        assert result.trace["ar.kv_cache_backend"] == "paged"
        ids = result.output.data["token_ids"]
        if params.greedy:
            assert ids == generate_alone(hf_model, result.output.data["prompt_token_ids"], params.max_tokens)
        else:
            alone = omni.generate(prompt, ar=params)
            assert alone.output.data["token_ids"] == ids and alone.trace["ar.batch_size_max"] == 1
