"""Many concurrent text requests through Omni("ar_text") (default: the paged engine), each streamed separately:
greedy outputs equal `model.generate` alone, each request's deltas concatenate to its final text, and a seeded
sampled request reproduces its output whatever batch it ran in."""

from __future__ import annotations

from omni_kernel import Omni, RequestFailed, RequestFinished, TokenDelta

WORDS = ["school", "学校", "🦊", "river", "café", "图书馆", "the quick brown fox", "x"]


def workload():
    """(prompt, params) of 18 requests with prompts of 1 to ~150 tokens and budgets of 1 to 40 tokens."""
    reqs = []
    for i in range(18):
        prompt = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + (i * 7) % 40))
        sampled = i % 6 == 5
        params = {"max_tokens": 1 + (i * 13) % 40}
        if sampled:
            params.update(temperature=0.9, top_p=0.9, top_k=40, seed=100 + i)
        reqs.append((prompt, params))
    return reqs


def test_sixteen_plus_concurrent_streams(tiny_ckpt, host, hf_greedy):
    omni = Omni("ar_text", host=host, ar_model=str(tiny_ckpt), ar_device="cpu", ar_max_num_batched_tokens=96)
    reqs = [omni.request(prompt, stream=True, **params) for prompt, params in workload()]
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
    assert max(r.output.trace["ar.batch_size_max"] for r in results.values()) >= 16  # they really ran together
    assert stage.engine.scheduler.blocks.num_used == 0 and not stage.engine.scheduler.sequences
    lengths = {len(results[r.request_id].output.data["prompt_token_ids"]) for r in reqs}
    assert min(lengths) < 20 and max(lengths) > 100
    for request, (prompt, params) in zip(reqs, workload()):
        result = results[request.request_id]
        assert "".join(deltas[request.request_id]) == result.text
        assert result.trace["ar.kv_cache_backend"] == "paged"
        ids = result.output.data["token_ids"]
        if "seed" not in params:
            assert ids == hf_greedy(tiny_ckpt, result.output.data["prompt_token_ids"], params["max_tokens"])
        else:
            alone = omni.generate(prompt, **params)
            assert alone.output.data["token_ids"] == ids and alone.trace["ar.batch_size_max"] == 1
