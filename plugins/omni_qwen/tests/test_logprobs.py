"""Logprobs through the real ar_text stage equal torch.log_softmax of HF's own forward (fp32) on the same ids,
within 1e-4, for the chosen and the top tokens, with several requests of different lengths in one batch,
chunked prefill, prefix-cache hits that a prompt_logprobs request must not take, and sampled requests (the raw
logits, not the temperature's)."""

import random

import pytest
import torch

from omni_kernel import Omni, RequestFinished, TokenDelta, testing
from omni_kernel.core.errors import InvalidParameter
from omni_qwen.logprobs import TokenTexts

transformers = pytest.importorskip("transformers")

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # layers x K/V x kv heads x head dim x fp32 x block size
TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, qwen_tokenizer):
    from omni_qwen.demo import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("logprobs") / "qwen2", context_window=1024,
                            initializer_range=0.3, tokenizer=qwen_tokenizer)


def hf_logprobs(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_entry(entry, row, token, n):
    assert entry["token_id"] == token
    assert abs(entry["logprob"] - row[token].item()) < TOL
    values, ids = row.topk(n)
    assert [t["token_id"] for t in entry["top_logprobs"]] == ids.tolist()
    for top, value in zip(entry["top_logprobs"], values.tolist()):
        assert abs(top["logprob"] - value) < TOL


def check_output(model, out, prompt, top, prompt_top):
    tokens = out.data["token_ids"]
    ref = hf_logprobs(model, prompt + tokens)
    entries = out.data["logprobs"]
    if top is not None:
        assert len(entries) == len(tokens)
        for i, (entry, token) in enumerate(zip(entries, tokens)):
            check_entry(entry, ref[len(prompt) + i - 1], token, top)
    if prompt_top is not None:
        given = out.data["prompt_logprobs"]
        assert len(given) == len(prompt) and given[0]["logprob"] is None and given[0]["token_id"] == prompt[0]
        for p in range(1, len(prompt)):
            check_entry(given[p], ref[p - 1], prompt[p], prompt_top)
    else:
        assert out.data.get("prompt_logprobs") is None


def run(omni, reqs):
    for rid, prompt, params in reqs:
        omni.submit(omni.request("", request_id=rid, prompt_token_ids=prompt, ignore_eos=True, **params))
    finished, deltas = {}, {}
    for event in testing.drain(omni, limit=5000):
        if isinstance(event, RequestFinished):
            finished[event.request_id] = event.result.output
        elif isinstance(event, TokenDelta) and event.logprobs is not None:  # a request that asked
            deltas.setdefault(event.request_id, []).append(event)
    return finished, deltas


@pytest.mark.parametrize("backend", ["paged", "dynamic_cache"])
def test_logprobs_equal_hf_log_softmax_under_batching(host, ckpt, backend):
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    omni = Omni("ar_text", host=host, ar_model=str(ckpt), ar_device="cpu", ar_kv_backend=backend,
                ar_kv_memory=512 * BLOCK_BYTES, ar_max_num_batched_tokens=64)
    rng = random.Random(0)
    shared = [rng.randrange(1024) for _ in range(40)]  # 2 full blocks: prefix-cache hits for later requests
    kinds = [dict(logprobs=5), dict(logprobs=0), dict(), dict(logprobs=20, prompt_logprobs=3),
             dict(prompt_logprobs=0), dict(logprobs=2, temperature=0.8, seed=7), dict(logprobs=1, prompt_logprobs=1)]
    reqs = []
    for i, params in enumerate(kinds):
        prompt = shared + [rng.randrange(1024) for _ in range(rng.choice([1, 5, 30, 90]))] if i % 2 else \
            [rng.randrange(1024) for _ in range(rng.choice([2, 17, 70]))]
        reqs.append((f"r{i}", prompt, {"max_tokens": rng.randint(1, 12), **params}))
    run(omni, [("warm", shared + [1, 2], {"max_tokens": 1})])  # puts `shared` in the prefix cache
    finished, deltas = run(omni, reqs)
    for rid, prompt, params in reqs:
        out = finished[rid]
        if "logprobs" not in params and "prompt_logprobs" not in params:
            assert "logprobs" not in out.data and rid not in deltas  # others pay nothing
            continue
        check_output(model, out, prompt, params.get("logprobs"), params.get("prompt_logprobs"))
        streamed = [e for d in deltas.get(rid, []) for e in d.logprobs]
        assert streamed == out.data["logprobs"][:len(streamed)]
        if "prompt_logprobs" in params:
            assert out.trace["ar.prefix_cache_hit_tokens"] == 0
    if backend == "paged":
        assert finished["r1"].trace["ar.prefix_cache_hit_tokens"] == 32  # the others still take the cache


def test_prompt_logprobs_survive_preemption(host, ckpt):
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    omni = Omni("ar_text", host=host, ar_model=str(ckpt), ar_device="cpu", ar_kv_memory=12 * BLOCK_BYTES,
                ar_max_num_batched_tokens=32)
    rng = random.Random(1)
    reqs = [(f"p{i}", [rng.randrange(1024) for _ in range(60)], {"max_tokens": 40, "logprobs": 3,
                                                                  "prompt_logprobs": 2}) for i in range(3)]
    finished, _ = run(omni, reqs)
    assert sum(out.trace["ar.preemptions"] for out in finished.values()) > 0
    for rid, prompt, _ in reqs:
        check_output(model, finished[rid], prompt, 3, 2)


def test_token_texts_are_exact_bytes(qwen_tokenizer):
    texts = TokenTexts(qwen_tokenizer)
    ids = qwen_tokenizer.encode("héllo 世界 <|im_end|>")
    joined = b"".join(bytes(texts(i)[1]) for i in ids)
    assert joined.decode("utf-8") == qwen_tokenizer.decode(ids)


@pytest.mark.parametrize("field, value", [("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21),
                                          ("logprobs", "5")])
def test_bad_logprobs_are_refused_naming_the_field(field, value):
    from omni_qwen.config import QwenParams

    with pytest.raises(InvalidParameter) as err:
        QwenParams(**{field: value})
    assert err.value.field == field


def test_smollm2_logprobs_equal_hf(host, smollm2_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    omni = Omni("ar_text", host=host, ar_model=str(smollm2_dir), ar_device="cpu", ar_dtype="fp32")
    texts = ["The capital of France is", "2 + 2 =", "Once upon a time, in a land far away, there lived a"]
    reqs = [(f"s{i}", tok.encode(t), {"max_tokens": 6, "logprobs": 5, "prompt_logprobs": 5})
            for i, t in enumerate(texts)]
    finished, _ = run(omni, reqs)
    for rid, prompt, _ in reqs:
        check_output(model, finished[rid], prompt, 5, 5)


def test_two_pipelines_sharing_one_engine_each_get_their_own_logprobs(host, ckpt):
    """One engine step serves both pipelines' requests: each request's entries reach its own output processor
    (they are in its record), one per token."""
    from omni_kernel import NodeSpec, PipelinePlan

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    plan = PipelinePlan("text_again", [NodeSpec("g", "ar.text_generation", final=True)])
    config = {"ar_model": str(ckpt), "ar_device": "cpu", "ar_kv_memory": 512 * BLOCK_BYTES}
    a, b = Omni("ar_text", host=host, **config), Omni(plan, host=host, **config)
    assert a.graph.stages["generate"].engine is b.graph.stages["g"].engine
    reqs = {a: ("x", [5, 6, 7, 8, 9] * 5, {"max_tokens": 7, "logprobs": 4, "prompt_logprobs": 2}),
            b: ("y", list(range(100, 140)), {"max_tokens": 9, "logprobs": 1})}
    for omni, (rid, prompt, params) in reqs.items():
        omni.submit(omni.request("", request_id=rid, prompt_token_ids=prompt, ignore_eos=True, **params))
    finished = {}
    while a.has_unfinished() or b.has_unfinished():
        for omni in (a, b):
            if omni.has_unfinished():
                finished.update((e.request_id, e.result.outputs) for e in omni.step() if isinstance(e, RequestFinished))
    check_output(model, finished["x"]["generate"], reqs[a][1], 4, 2)
    check_output(model, finished["y"]["g"], reqs[b][1], 1, None)
