"""Detokenizer, sampler, config and policy units."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_kernel import ARParams, NodeSpec
from omni_kernel.core.errors import InvalidParameter
from omni_qwen.config import QwenConfig
from omni_qwen.detokenize import IncrementalDetokenizer
from omni_qwen.sampling import Sampler, Sampling, probabilities


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
        assert not delta.endswith("\ufffd"), "a partial character was released before the end"


def sample(params: ARParams, logits: torch.Tensor) -> int:
    return Sampler().sample(logits[None], [Sampling.of(params)])[0]


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample(ARParams(), logits) == 1
    assert sample(ARParams(temperature=1.0, top_k=1, seed=3), logits) == 1
    assert sample(ARParams(temperature=1.0, top_p=0.01, seed=3), logits) == 1
    assert sample(ARParams(), logits.to(torch.bfloat16)) == 1


def test_top_k_and_top_p_restrict_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = probabilities(logits, [ARParams(temperature=1.0, top_k=2)])[0]
    assert probs[2] == probs[3] == 0 and probs[:2].sum() == pytest.approx(1)
    probs = probabilities(logits, [ARParams(temperature=1.0, top_p=0.8)])[0]
    assert probs[2] == probs[3] == 0 and probs[0] == pytest.approx(0.5 / 0.8)
    probs = probabilities(logits, [ARParams(temperature=1.0, top_p=0.81)])[0]
    assert probs[2] > 0 and probs[3] == 0


def test_rows_of_one_batch_keep_their_own_parameters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(3, 1)
    params = [ARParams(temperature=1.0, top_k=2), ARParams(temperature=1.0), ARParams(temperature=1.0, top_p=0.8)]
    batched = probabilities(logits, params)
    for row, p in enumerate(params):
        assert torch.equal(batched[row], probabilities(logits[:1], [p])[0])
    assert batched[1][3] > 0 and batched[0][3] == 0


def test_seeded_sampler_reproduces_whatever_runs_beside_it():
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(1))

    def draws(seed, neighbour=None):
        rows = [Sampling.of(ARParams(temperature=1.5, seed=seed))]
        if neighbour is not None:
            rows.append(Sampling.of(neighbour))
        return [Sampler().sample(logits[:len(rows)], rows)[0] for _ in range(30)]

    assert draws(5) == draws(5) == draws(5, ARParams()) == draws(5, ARParams(temperature=0.7, seed=9))
    assert draws(5) != draws(6)
    assert Sampling.of(ARParams(temperature=1.0)).generator is not None
    assert Sampling.of(ARParams(seed=4)).generator is None  # greedy ignores the seed


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    logits[2, 7] = float("nan")
    rows = [Sampling.of(ARParams(temperature=1e-300, seed=1)), Sampling.of(ARParams()),
            Sampling.of(ARParams(temperature=1.0, seed=1))]
    tokens = Sampler().sample(logits, rows)
    assert tokens[0] == int(logits[0].argmax())  # a tiny temperature is clamped to 1e-5: the argmax, not NaN
    assert tokens[1] == int(logits[1].argmax())
    assert isinstance(tokens[2], RuntimeError) and "logits hold NaN" in str(tokens[2])


def test_node_policy_is_checked():
    from omni_kernel.core.errors import GraphError
    from omni_kernel.core.planner import node_policy
    from omni_qwen.plugin import QwenPlugin

    registered = []
    QwenPlugin().omni_register_node_types(registered.append)
    bridge = next(t for t in registered if t.name == "ar.prompt_bridge")
    policy = node_policy(NodeSpec("b", "ar.prompt_bridge"), bridge)
    assert (policy.max_tokens, policy.chat, policy.max_num_seqs, policy.json_schema) == (128, True, None, None)
    text = node_policy(NodeSpec("t", "ar.text_generation"), next(t for t in registered if t is not bridge))
    assert (text.max_tokens, text.chat, text.max_num_seqs) == (None, True, None)
    with pytest.raises(GraphError, match="no policy key 'budget'"):
        node_policy(NodeSpec("b", "ar.prompt_bridge", policy={"budget": 3}), bridge)
    with pytest.raises(GraphError, match="max_tokens: 0 is not an integer >= 1"):
        node_policy(NodeSpec("b", "ar.prompt_bridge", policy={"max_tokens": 0}), bridge)
    with pytest.raises(GraphError, match="chat: 'no' is not True or False"):
        node_policy(NodeSpec("b", "ar.prompt_bridge", policy={"chat": "no"}), bridge)
    with pytest.raises(GraphError, match='json_schema: is not supported: .*Unsupported type "nope"'):
        node_policy(NodeSpec("b", "ar.prompt_bridge", policy={"json_schema": {"type": "nope"}}), bridge)
    schema = node_policy(NodeSpec("b", "ar.prompt_bridge", policy={"json_schema": '{"type": "object"}'}), bridge)
    assert schema.json_schema == '{"type":"object"}'  # canonical JSON


def test_config_reads_sizes_and_defaults():
    from omni_hf import torch_dtype

    from omni_qwen.config import DEFAULT_KV_TOKENS, DTYPE_NAMES, parse_bytes

    assert DTYPE_NAMES and all(torch_dtype(name) in (None, torch.float32, torch.bfloat16, torch.float16)
                               for name in DTYPE_NAMES)  # the torch-free config offers what the loader maps

    assert parse_bytes(1234) == 1234 and parse_bytes("256MiB") == 256 * 2**20 and parse_bytes("2 GB") == 2 * 10**9
    assert parse_bytes("1.5kib") == 1536
    for bad in ("", "12 parsecs", "-1", True, 0, 2.5):
        with pytest.raises(InvalidParameter, match="ar_kv_memory"):
            parse_bytes(bad)
    config = QwenConfig()
    assert (config.ar_kv_backend, config.ar_max_num_batched_tokens, config.ar_prefix_caching) == (None, 512, True)
    assert config.max_num_seqs_for(None) == 64
    assert config.kv_memory_for(100, 512) == 100 * DEFAULT_KV_TOKENS and config.kv_memory_for(100, 10**6) == 10**8
    assert QwenConfig(ar_kv_memory="1KiB").ar_kv_memory == 1024
    assert config.max_num_seqs_for(4) == 4
    assert QwenConfig(ar_max_num_seqs=8).max_num_seqs_for(4) == 8


def test_request_params_declare_prompt_token_ids():
    from omni_qwen.config import QwenParams

    assert QwenParams(prompt_token_ids=[3, 4]).prompt_token_ids == (3, 4)
    for bad in ([], "12", [1.5], [True], 7):
        with pytest.raises(InvalidParameter, match="prompt_token_ids"):
            QwenParams(prompt_token_ids=bad)


def test_backend_choice_falls_back_for_models_the_paged_forward_lacks():
    from types import SimpleNamespace

    from omni_kernel.core.errors import ModelError
    from omni_qwen.build import choose_backend

    def model(**config):
        return SimpleNamespace(config=SimpleNamespace(**config))

    qwen2, llama, qwen3 = model(model_type="qwen2"), model(model_type="llama"), model(model_type="qwen3")
    assert choose_backend(QwenConfig(), qwen2) == choose_backend(QwenConfig(), llama) == "paged"
    assert choose_backend(QwenConfig(ar_kv_backend="dynamic_cache"), qwen2) == "dynamic_cache"
    assert choose_backend(QwenConfig(), qwen3) == "dynamic_cache"
    assert choose_backend(QwenConfig(), model(model_type="qwen2", layer_types=["sliding_attention"])) == \
        "dynamic_cache"
    assert choose_backend(QwenConfig(), model(model_type="llama", hidden_act="gelu")) == "dynamic_cache"
    assert choose_backend(QwenConfig(), model(model_type="llama", pretraining_tp=2)) == "dynamic_cache"
    with pytest.raises(ModelError, match="dynamic_cache"):
        choose_backend(QwenConfig(ar_kv_backend="paged"), qwen3)
