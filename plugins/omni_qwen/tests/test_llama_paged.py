"""Llama-family checkpoints on the paged engine (tiny random weights of the real classes, so these always run):
greedy output under continuous batching, chunked prefill, preemption and the prefix cache equals HF
`generate` alone, with and without biases and tied embeddings. A family the paged forward does not implement
(Qwen3's q/k norms) runs on the dynamic_cache backend, and the load line says which backend and why."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from omni_kernel import Omni, RequestFinished
from omni_kernel.core.errors import ModelError

VOCAB = 1024


def save(model, tokenizer, path):
    from omni_qwen.model import quiet_progress

    path.mkdir(parents=True)
    with quiet_progress():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def llama(tmp_path_factory, tokenizer, **overrides):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e5}, tie_word_embeddings=True,
                    initializer_range=0.3, bos_token_id=None, eos_token_id=eos, pad_token_id=eos)
    settings.update(overrides)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
        for name, param in model.named_parameters():  # HF zero-initialises biases: make them matter
            if name.endswith("bias"):
                param.data.normal_(0, 0.3)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, bos_token_id=None)
    return save(model, tokenizer, tmp_path_factory.mktemp("llama") / "llama-tiny")


@pytest.fixture(scope="module", params=["tied", "biased-untied"])
def llama_dir(request, tmp_path_factory, qwen_tokenizer):
    if request.param == "tied":
        return llama(tmp_path_factory, qwen_tokenizer)
    return llama(tmp_path_factory, qwen_tokenizer, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)


def reference(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(prompt, max_tokens):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    return generate


def run(omni, reqs, every=1):
    arrivals, finished, step = list(reqs), {}, 0
    while arrivals or omni.has_unfinished():
        if arrivals and step % every == 0:
            rid, prompt, m = arrivals.pop(0)
            omni.submit(omni.request("", request_id=rid, prompt_token_ids=prompt, max_tokens=m, ignore_eos=True))
        for event in omni.step():
            if isinstance(event, RequestFinished):
                finished[event.request_id] = event.result.output
        step += 1
    return finished


def requests(n, seed, shared=()):
    rng = random.Random(seed)
    return [(f"r{i}", list(shared) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 120))], rng.randint(1, 16))
            for i in range(n)]


def test_llama_is_served_by_the_paged_forward(host, llama_dir):
    from omni_qwen.paged.decoder import PagedDecoder

    generate = reference(llama_dir)
    block_bytes = 2 * 2 * 2 * 16 * 4 * 16  # layers x K/V x kv heads x head dim x fp32 x block size
    for blocks, every in ((256, 2), (12, 1)):  # roomy with staggered arrivals; a pool so small it preempts
        omni = Omni("ar_text", host=host, ar_model=str(llama_dir), ar_device="cpu", ar_kv_memory=blocks * block_bytes,
                    ar_max_num_batched_tokens=48)
        stage = omni.graph.stages["generate"]
        assert isinstance(stage.engine.runner.backend.model, PagedDecoder)
        reqs = requests(12, seed=blocks)
        finished = run(omni, reqs, every)
        for rid, prompt, m in reqs:
            assert finished[rid].data["token_ids"] == generate(prompt, m), rid
            assert finished[rid].trace["ar.kv_cache_backend"] == "paged"
        assert max(finished[rid].trace["ar.prefill_steps"] for rid, _, _ in reqs) > 1  # chunked prefill
        assert (stage.engine.scheduler.num_preemptions > 0) is (blocks == 12)


def test_llama_prefix_cache_hits_keep_the_output(host, llama_dir):
    generate = reference(llama_dir)
    omni = Omni("ar_text", host=host, ar_model=str(llama_dir), ar_device="cpu")
    system = [random.Random(9).randrange(VOCAB) for _ in range(70)]
    outs = [run(omni, [req])[req[0]] for req in requests(3, seed=3, shared=system)]
    for (_, prompt, m), out in zip(requests(3, seed=3, shared=system), outs):
        assert out.data["token_ids"] == generate(prompt, m)
    assert [o.trace["ar.prefix_cache_hit_tokens"] for o in outs] == [0, 64, 64]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, qwen_tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eos = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         eos_token_id=eos, pad_token_id=eos, bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).eval()
    return save(model, qwen_tokenizer, tmp_path_factory.mktemp("qwen3") / "qwen3-tiny")


def test_a_family_without_a_fast_path_runs_on_dynamic_cache(host, qwen3_dir, caplog):
    with caplog.at_level(logging.INFO, logger="omni"):
        omni = Omni("ar_text", host=host, ar_model=str(qwen3_dir), ar_device="cpu")
        out = run(omni, [("q", list(range(5, 40)), 6)])["q"]
    assert out.data["token_ids"] == reference(qwen3_dir)(list(range(5, 40)), 6)
    assert out.trace["ar.kv_cache_backend"] == "dynamic_cache"
    messages = [r.getMessage() for r in caplog.records]
    assert any("paged KV backend unavailable (it implements the qwen2 and llama architectures, not 'qwen3')" in m
               for m in messages)
    assert any(m.startswith("generate: dynamic_cache KV backend") for m in messages)
    with pytest.raises(ModelError, match="ar_kv_backend='paged' cannot serve this model: .*'qwen3'"):
        Omni("ar_text", host=host, ar_model=str(qwen3_dir), ar_device="cpu", ar_kv_backend="paged")
