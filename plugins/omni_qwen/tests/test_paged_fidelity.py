"""Both KV backends against HF `generate`, through the real ar_text stage (Omni -> StageScheduler -> Stage ->
Engine(ARScheduler) -> ARModelRunner -> backend): each request's greedy output, served concurrently, equals
`generate` for that request alone, token for token (fp32); also with preemption, late arrivals and aborts."""

import itertools
import random

import pytest
import torch

from omni_kernel import Omni, RequestFailed, RequestFinished, StageFailed, testing
from omni_kernel.core.ar_scheduler import ARPrompt
from omni_kernel.core.errors import InputError, InvalidParameter
from omni_kernel.core.request import StageInput
from omni_qwen.config import QwenParams

transformers = pytest.importorskip("transformers")

BACKENDS = ["paged", "dynamic_cache"]
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # layers x K/V x kv heads x head dim x fp32 x block size


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, qwen_tokenizer):
    """The demo architecture with a 1024-token context and weights large enough that greedy output is varied."""
    from omni_qwen.demo import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("fidelity") / "qwen2", context_window=1024,
                            initializer_range=0.3, tokenizer=qwen_tokenizer)


@pytest.fixture(scope="module")
def reference(ckpt):
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
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


@pytest.fixture
def make_omni(host, ckpt):
    def make(backend, blocks=512, budget=128, **config):
        return Omni("ar_text", host=host, ar_model=str(ckpt), ar_device="cpu", ar_kv_backend=backend,
                    ar_kv_memory=blocks * BLOCK_BYTES, ar_max_num_batched_tokens=budget, **config)

    return make


def requests(n=18, seed=0):
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 33, 64, 100, 150, 257, 301, 320]
    lengths += [rng.randint(1, 320) for _ in range(n - len(lengths))]
    return [(f"r{i}", [rng.randrange(1024) for _ in range(length)], rng.randint(1, 24))
            for i, length in enumerate(lengths)]


def submit(omni, rid, prompt, max_tokens, **params):
    omni.submit(omni.request("", request_id=rid, max_tokens=max_tokens, prompt_token_ids=prompt, ignore_eos=True,
                             **params))


def parts(omni):
    stage = omni.graph.stages["generate"]
    return stage, stage.engine.scheduler, stage.engine.runner


def drain(omni, arrivals=(), every=1):
    """Step until done, submitting one queued request every `every` steps; return {request_id: StageOutput}."""
    arrivals, steps = list(arrivals), itertools.count()

    def arrive(_=()):
        if arrivals and next(steps) % every == 0:
            submit(omni, *arrivals.pop(0))

    arrive()
    finished = {}
    for event in testing.drain(omni, limit=5000, on_step=arrive,
                               until=lambda: not arrivals and not omni.has_unfinished()):
        assert not isinstance(event, RequestFailed) or event.error == "aborted", event
        if isinstance(event, RequestFinished):
            finished[event.request_id] = event.result.output
    return finished


def assert_all_freed(omni):
    """No blocks and no records left (a DynamicCache lives in its request's record, so it went with it)."""
    _, scheduler, _ = parts(omni)
    assert scheduler.blocks.num_used == 0 and not scheduler.blocks.tables and not scheduler.sequences


def steps_of(runner, steps: list):
    """Wrap `runner.run` so each step's (sequences, tokens) goes into `steps`; `del runner.run` unwraps it."""
    real = runner.run

    def run(batch):
        steps.append((len(batch.chunks), batch.num_tokens))
        return real(batch)

    runner.run = run


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_requests_equal_generate_alone(make_omni, reference, backend):
    reqs = requests()
    omni = make_omni(backend)
    _, _, runner = parts(omni)
    steps = []
    steps_of(runner, steps)
    try:
        for rid, prompt, m in reqs:
            submit(omni, rid, prompt, m)
        finished = drain(omni)
    finally:
        del runner.run
    for rid, prompt, m in reqs:
        assert finished[rid].data["token_ids"] == reference(prompt, m), rid
        trace = finished[rid].trace
        assert trace["ar.kv_cache_backend"] == backend and trace["ar.runtime_kv_manager"] is (backend == "paged")
        assert trace["ar.prompt_mode"] == "token_ids" and trace["ar.input_tokens"] == len(prompt)
        assert trace["ar.prefill_steps"] >= -(-len(prompt) // 128)  # chunks of at most the step budget
        assert trace["ar.prefill_tokens"] == len(prompt)
    assert max(n for n, _ in steps) > 8  # really batched
    assert max(t for _, t in steps) <= 128
    assert_all_freed(omni)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_pool_preempts_and_still_matches(make_omni, reference, backend):
    reqs = requests(16, seed=1)
    omni = make_omni(backend, blocks=28)
    for rid, prompt, m in reqs:
        submit(omni, rid, prompt, m)
    finished = drain(omni)
    assert parts(omni)[1].num_preemptions > 0
    assert any(out.trace["ar.preemptions"] for out in finished.values())
    for rid, prompt, m in reqs:
        assert finished[rid].data["token_ids"] == reference(prompt, m), rid
    assert_all_freed(omni)


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_arriving_while_others_decode(make_omni, reference, backend):
    reqs = requests(16, seed=2)
    omni = make_omni(backend, budget=64)
    finished = drain(omni, reqs, every=3)
    for rid, prompt, m in reqs:
        assert finished[rid].data["token_ids"] == reference(prompt, m), rid
    assert_all_freed(omni)


@pytest.mark.parametrize("backend", BACKENDS)
def test_aborted_requests_free_blocks_and_spare_the_others(make_omni, reference, backend):
    reqs = requests(16, seed=3)
    omni = make_omni(backend, blocks=64)
    stage, scheduler, runner = parts(omni)
    for rid, prompt, m in reqs:
        submit(omni, rid, prompt, m + 8)
    for _ in range(5):
        omni.step()
    doomed = [s.request_id for s in scheduler.running][:2] + [s.request_id for s in scheduler.waiting][:1]
    pool = scheduler.blocks  # the paged backend's KV lives in these blocks; a DynamicCache keeps its own
    held = {rid: list(pool.table(rid)) if rid in pool.tables else [] for rid in doomed}
    assert held[doomed[0]], "a running request holds blocks"
    records = {rid: scheduler.sequences[rid] for rid in doomed}
    for rid in doomed:
        omni.abort(rid)
        assert rid not in pool.tables and rid not in scheduler.sequences
        live = [b for table in pool.tables.values() for b in table.blocks]
        assert all(pool.blocks[b].ref_count == live.count(b) for b in held[rid])  # its references are dropped
        assert records[rid].state.kv_cache is None  # the DynamicCache is dropped (the paged backend keeps none)
    finished = drain(omni)
    assert not set(doomed) & set(finished)
    for rid, prompt, m in reqs:
        if rid not in doomed:
            assert finished[rid].data["token_ids"] == reference(prompt, m + 8), rid
    assert_all_freed(omni)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_prefix_reuses_blocks_with_identical_output(make_omni, reference, backend):
    rng = random.Random(4)
    system = [rng.randrange(1024) for _ in range(200)]
    omni = make_omni(backend)
    outputs = []
    for i in range(5):
        prompt = system + [rng.randrange(1024) for _ in range(rng.randint(1, 30))]
        out = drain(omni, [(f"p{i}", prompt, 12)])[f"p{i}"]
        assert out.data["token_ids"] == reference(prompt, 12)
        outputs.append(out)
    hits = 192 if backend == "paged" else 0  # a DynamicCache cannot share blocks
    assert outputs[0].trace["ar.prefix_cache_hit_tokens"] == 0
    assert all(o.trace["ar.prefix_cache_hit_tokens"] == hits for o in outputs[1:])
    assert all(o.trace["ar.prefill_tokens"] == o.trace["ar.input_tokens"] - hits for o in outputs[1:])
    assert parts(omni)[1].blocks.hit_tokens == 4 * hits


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_sampling_survives_preemption(make_omni, backend):
    reqs = requests(12, seed=5)

    def run(blocks):
        omni = make_omni(backend, blocks=blocks)
        for rid, prompt, m in reqs:
            submit(omni, rid, prompt, m, temperature=0.8, top_p=0.9, top_k=50, seed=7)
        return {rid: out.data["token_ids"] for rid, out in drain(omni).items()}, parts(omni)[1].num_preemptions

    roomy, _ = run(512)
    tight, preemptions = run(23)
    assert preemptions > 0 and roomy == tight


def test_bf16_logits_follow_hf(make_omni, ckpt):
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    prompt = list(range(3, 90))
    with torch.inference_mode():
        ref = bf16(torch.tensor([prompt])).logits[0, -1].float()
    omni = make_omni("paged", ar_dtype="bf16")
    backend = parts(omni)[2].backend
    captured = {}
    forward = backend.forward
    backend.forward = lambda batch: captured.setdefault("out", forward(batch))
    drain(omni, [("b", prompt, 1)])
    assert backend.pool.kv.dtype == torch.bfloat16
    logits = captured["out"][1][0].float()
    assert torch.allclose(logits, ref, atol=0.1, rtol=0.05)
    assert int(logits.argmax()) == int(ref.argmax())


def test_request_that_never_fits_fails_alone(make_omni, reference):
    omni = make_omni("paged", blocks=4)  # 64 tokens
    with pytest.raises(InputError, match="KV pool holds 64 tokens"):
        submit(omni, "big", list(range(60)), 10)
    stage = parts(omni)[0]
    # An input that skipped `process` is still refused by the scheduler: alone, and without stalling the engine.
    params = QwenParams(max_tokens=10)
    stage.add_request(StageInput("big2", "", params=params, processed=ARPrompt(range(60), 10)))
    assert any(isinstance(e, StageFailed) and e.user_error and "KV pool holds 64 tokens" in e.error
               for e in stage.events_for(stage.engine.step()))
    finished = drain(omni, [("ok", list(range(40)), 8)])
    assert finished["ok"].data["token_ids"] == reference(list(range(40)), 8)
    assert_all_freed(omni)


@pytest.mark.parametrize("config, field", [
    ({"ar_kv_backend": "vllm"}, "ar_kv_backend"), ({"ar_kv_memory": "lots"}, "ar_kv_memory"),
    ({"ar_kv_memory": 0}, "ar_kv_memory"), ({"ar_kv_memory": 100}, "ar_kv_memory"),
    ({"ar_max_num_seqs": 0}, "ar_max_num_seqs"), ({"ar_max_num_batched_tokens": "8"}, "ar_max_num_batched_tokens"),
    ({"ar_prefix_caching": "yes"}, "ar_prefix_caching"), ({"ar_device": "tpu-9"}, "ar_device"),
    ({"ar_trust_remote_code": "no"}, "ar_trust_remote_code"), ({"ar_model": 3}, "ar_model"),
])
def test_bad_serving_config_is_refused(host, ckpt, config, field):
    with pytest.raises(InvalidParameter, match=field):
        Omni("ar_text", host=host, **{"ar_model": str(ckpt), **config})


def test_misspelled_config_key_is_refused_naming_the_valid_ones(host, ckpt):
    with pytest.raises(InvalidParameter, match="ar_kv_memroy") as info:
        Omni("ar_text", host=host, ar_model=str(ckpt), ar_kv_memroy="1MiB")
    assert "ar_kv_memory" in str(info.value) and "ar_trust_remote_code" in str(info.value)
    assert info.value.field == "ar_kv_memroy"


def test_device_and_remote_code_keys_are_accepted(make_omni):
    omni = make_omni("paged", ar_trust_remote_code=True)
    assert omni.graph.stages["generate"].engine.runner.backend.pool.device.type == "cpu"
    out = drain(omni, [("r", [5, 6, 7], 3)])["r"]
    assert len(out.data["token_ids"]) == 3
