"""The paged backend against HF `generate`: each request's greedy output, served concurrently through the kernel
Engine + ARScheduler + PagedQwen2, equals `generate` for that request alone, token for token (fp32)."""

import random

import pytest
import torch

from omni_kernel.events import StageFinished
from omni_kernel.params import ARParams
from omni_kernel.request import StageInput

transformers = pytest.importorskip("transformers")

from omni_qwen.paged.engine import build_paged_engine  # noqa: E402
from omni_qwen.paged.pool import KVPool  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A random Qwen2 with weights large enough that greedy output is not a repeated token, saved and loaded
    back through the path a real checkpoint takes."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False, initializer_range=0.3, max_position_embeddings=1024)
    path = tmp_path_factory.mktemp("paged_qwen2")
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(model):
    cache = {}

    def generate(prompt, max_tokens):
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return generate


def requests(n=18, seed=0):
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 33, 64, 100, 150, 257, 301, 320]
    lengths += [rng.randint(1, 320) for _ in range(n - len(lengths))]
    return [(f"r{i}", [rng.randrange(1024) for _ in range(length)], rng.randint(1, 24))
            for i, length in enumerate(lengths)]


def item(rid, prompt, max_tokens, **params):
    return StageInput(rid, "", params=ARParams(max_tokens=max_tokens, **params),
                      options={"prompt_token_ids": prompt})


def blocks_bytes(model, blocks):
    cfg = model.config
    return blocks * KVPool.bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                           cfg.hidden_size // cfg.num_attention_heads, BLOCK, torch.float32)


def engine_for(model, blocks=512, **kwargs):
    kwargs.setdefault("max_num_batched_tokens", 128)
    return build_paged_engine(model, kv_memory_bytes=blocks_bytes(model, blocks), block_size=BLOCK, **kwargs)


def drain(engine, arrivals=(), every=1):
    """Step until done, adding one queued item every `every` steps; return {request_id: StageOutput}."""
    arrivals, finished, step = list(arrivals), {}, 0
    while arrivals or engine.has_unfinished():
        if arrivals and step % every == 0:
            engine.add_request(arrivals.pop(0))
        for event in engine.step():
            if isinstance(event, StageFinished):
                finished[event.request_id] = event.output
        step += 1
        assert step < 5000
    return finished


def test_concurrent_requests_equal_generate_alone(model, reference):
    reqs = requests()
    engine, executor, scheduler = engine_for(model)
    for rid, prompt, m in reqs:
        engine.add_request(item(rid, prompt, m))
    finished = drain(engine)
    for rid, prompt, m in reqs:
        assert finished[rid].data == reference(prompt, m), rid
        assert finished[rid].trace["ar.kv_cache_backend"] == "paged"
        assert finished[rid].trace["ar.runtime_kv_manager"] is True
    assert max(n for n, _ in executor.step_log) > 8  # really batched
    assert max(t for _, t in executor.step_log) <= 128
    assert scheduler.blocks.num_used == 0


def test_tiny_pool_preempts_and_still_matches(model, reference):
    reqs = requests(16, seed=1)
    engine, _, scheduler = engine_for(model, blocks=28)
    for rid, prompt, m in reqs:
        engine.add_request(item(rid, prompt, m))
    finished = drain(engine)
    assert scheduler.num_preemptions > 0
    assert any(out.trace["ar.preemptions"] for out in finished.values())
    for rid, prompt, m in reqs:
        assert finished[rid].data == reference(prompt, m), rid
    assert scheduler.blocks.num_used == 0


def test_requests_arriving_while_others_decode(model, reference):
    reqs = requests(16, seed=2)
    engine, _, scheduler = engine_for(model, max_num_batched_tokens=64)
    finished = drain(engine, [item(rid, p, m) for rid, p, m in reqs], every=3)
    for rid, prompt, m in reqs:
        assert finished[rid].data == reference(prompt, m), rid
    assert scheduler.blocks.num_used == 0


def test_aborted_requests_free_blocks_and_spare_the_others(model, reference):
    reqs = requests(16, seed=3)
    engine, executor, scheduler = engine_for(model, blocks=64)
    for rid, prompt, m in reqs:
        engine.add_request(item(rid, prompt, m + 8))
    for _ in range(5):
        engine.step()
    running = [s.request_id for s in scheduler.running]
    waiting = [s.request_id for s in scheduler.waiting]
    doomed = running[:2] + waiting[:1]
    for rid in doomed:
        engine.abort(rid)
        assert rid not in scheduler.blocks.tables and rid not in executor.requests
    finished = drain(engine)
    assert not set(doomed) & set(finished)
    for rid, prompt, m in reqs:
        if rid not in doomed:
            assert finished[rid].data == reference(prompt, m + 8), rid
    assert scheduler.blocks.num_used == 0 and not scheduler.sequences


def test_shared_prefix_reuses_blocks_with_identical_output(model, reference):
    rng = random.Random(4)
    system = [rng.randrange(1024) for _ in range(200)]
    engine, _, scheduler = engine_for(model)
    outputs = []
    for i in range(5):
        prompt = system + [rng.randrange(1024) for _ in range(rng.randint(1, 30))]
        out = drain(engine, [item(f"p{i}", prompt, 12)])[f"p{i}"]
        assert out.data == reference(prompt, 12)
        outputs.append(out)
    assert outputs[0].trace["ar.prefix_cache_hit_tokens"] == 0
    assert all(o.trace["ar.prefix_cache_hit_tokens"] == 192 for o in outputs[1:])
    assert scheduler.blocks.hit_tokens == 4 * 192


def test_seeded_sampling_survives_preemption(model):
    reqs = requests(12, seed=5)

    def run(blocks):
        engine, _, scheduler = engine_for(model, blocks=blocks)
        for rid, prompt, m in reqs:
            engine.add_request(item(rid, prompt, m, temperature=0.8, top_p=0.9, top_k=50, seed=7))
        return {rid: out.data for rid, out in drain(engine).items()}, scheduler.num_preemptions

    roomy, _ = run(512)
    tight, preemptions = run(23)
    assert preemptions > 0 and roomy == tight


def test_bf16_logits_follow_hf(model):
    bf16 = transformers.Qwen2ForCausalLM(model.config).to(torch.bfloat16).eval()
    bf16.load_state_dict(model.state_dict())
    prompt = list(range(3, 90))
    with torch.inference_mode():
        ref = bf16(torch.tensor([prompt])).logits[0, -1].float()
    engine, executor, _ = build_paged_engine(bf16, kv_memory_bytes=1 << 20, block_size=BLOCK)
    captured = {}
    forward = executor.model.forward
    executor.model.forward = lambda step, pool: captured.setdefault("logits", forward(step, pool))
    drain(engine, [item("b", prompt, 1)])
    assert executor.pool.kv.dtype == torch.bfloat16
    logits = captured["logits"][0].float()
    assert torch.allclose(logits, ref, atol=0.1, rtol=0.05)
    assert int(logits.argmax()) == int(ref.argmax())


def test_too_long_request_is_refused(model):
    engine, _, _ = engine_for(model, blocks=4)
    events = []
    engine.add_request(item("x", list(range(60)), 10))
    events += engine.step()
    assert events and events[0].user_error
