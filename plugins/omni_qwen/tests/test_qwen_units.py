"""Detokenizer, sampler and policy units."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_kernel import ARParams
from omni_kernel.errors import InvalidParameter
from omni_qwen.detokenize import IncrementalDetokenizer
from omni_qwen.sampling import Sampler


@pytest.fixture(scope="module")
def decode(qwen_tokenizer):
    return lambda ids: qwen_tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 1002), max_size=40))
def test_any_token_sequence_streams_whole_characters(decode, ids):
    detok = IncrementalDetokenizer(decode)
    deltas = [detok.add(i) for i in ids]
    tail = detok.flush()
    assert "".join(deltas) + tail == decode(ids)
    for delta in deltas:
        delta.encode("utf-8")
        assert not delta.endswith("\ufffd"), "a partial character was released before the end"


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert Sampler(ARParams()).sample(logits) == 1
    assert Sampler(ARParams(temperature=1.0, top_k=1, seed=3)).sample(logits) == 1
    assert Sampler(ARParams(temperature=1.0, top_p=0.01, seed=3)).sample(logits) == 1


def test_top_k_and_top_p_restrict_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = Sampler(ARParams(temperature=1.0, top_k=2, seed=0)).probabilities(logits)
    assert probs[2] == probs[3] == 0 and probs[:2].sum() == pytest.approx(1)
    probs = Sampler(ARParams(temperature=1.0, top_p=0.8, seed=0)).probabilities(logits)
    assert probs[2] == probs[3] == 0 and probs[0] == pytest.approx(0.5 / 0.8)
    probs = Sampler(ARParams(temperature=1.0, top_p=0.81, seed=0)).probabilities(logits)
    assert probs[2] > 0 and probs[3] == 0


def test_seeded_sampler_reproduces():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1))

    def draws(seed):
        sampler = Sampler(ARParams(temperature=1.5, seed=seed))
        return [sampler.sample(logits) for _ in range(30)]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)
    assert Sampler(ARParams(temperature=1.0)).seed is not None


def test_node_policy_is_checked():
    from omni_kernel import NodeSpec
    from omni_qwen.stage import PROMPT_BRIDGE_POLICY, node_policy

    assert node_policy(NodeSpec("b", "ar.prompt_bridge"), PROMPT_BRIDGE_POLICY)["max_tokens"] == 128
    with pytest.raises(InvalidParameter, match="unknown key"):
        node_policy(NodeSpec("b", "ar.prompt_bridge", policy={"budget": 3}), PROMPT_BRIDGE_POLICY)
    with pytest.raises(InvalidParameter, match="max_tokens"):
        node_policy(NodeSpec("b", "ar.prompt_bridge", policy={"max_tokens": 0}), PROMPT_BRIDGE_POLICY)


def test_serving_config_reads_sizes_and_defaults():
    from omni_qwen.serving import DEFAULT_KV_TOKENS, ServingConfig, parse_bytes

    assert parse_bytes(1234) == 1234 and parse_bytes("256MiB") == 256 * 2**20 and parse_bytes("2 GB") == 2 * 10**9
    assert parse_bytes("1.5kib") == 1536
    for bad in ("", "12 parsecs", "-1", True, 0, 2.5):
        with pytest.raises(InvalidParameter, match="ar_kv_memory"):
            parse_bytes(bad)
    config = ServingConfig.from_config({}, policy_max_num_seqs=None)
    assert (config.kv_backend, config.max_num_seqs, config.max_num_batched_tokens, config.prefix_caching) == (
        None, 64, 512, True)
    assert config.memory_for(100, 512) == 100 * DEFAULT_KV_TOKENS and config.memory_for(100, 10**6) == 10**8
    assert ServingConfig.from_config({}, policy_max_num_seqs=4).max_num_seqs == 4
    assert ServingConfig.from_config({"ar_max_num_seqs": 8}, policy_max_num_seqs=4).max_num_seqs == 8


def test_backend_choice_falls_back_for_models_the_paged_forward_lacks():
    from types import SimpleNamespace

    from omni_kernel.errors import ModelError
    from omni_qwen.engine import choose_backend
    from omni_qwen.serving import ServingConfig

    def model(**config):
        return SimpleNamespace(config=SimpleNamespace(**config))

    qwen2, llama = model(model_type="qwen2"), model(model_type="llama")
    assert choose_backend(ServingConfig(), qwen2) == "paged"
    assert choose_backend(ServingConfig(kv_backend="dynamic_cache"), qwen2) == "dynamic_cache"
    assert choose_backend(ServingConfig(), llama) == "dynamic_cache"
    assert choose_backend(ServingConfig(), model(model_type="qwen2", layer_types=["sliding_attention"])) == \
        "dynamic_cache"
    with pytest.raises(ModelError, match="dynamic_cache"):
        choose_backend(ServingConfig(kv_backend="paged"), llama)
