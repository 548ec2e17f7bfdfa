"""The runtime against transformers' own generate, streaming, stop reasons and seeds, through the StageScheduler."""

from __future__ import annotations

import pytest

from omni_kernel import Omni, RequestFailed, RequestFinished, StageFinished, TokenDelta, testing
from omni_kernel.core.errors import InputError, InvalidParameter

PROMPTS = ["Tell me about the school by the river.", "生成一段文字，描述一所学校的春天", "emoji 🦊🎉 and café ñ",
           "x"]
AR_FIELDS = ("input_tokens", "prefill_tokens", "output_tokens", "generated_tokens", "prefill_ms", "decode_ms",
             "ttft_ms", "scheduler_steps", "prefill_steps", "decode_model_calls", "decode_scheduler_steps",
             "decode_step_mean_ms", "stop_reason", "streaming", "kv_cache", "kv_cache_type", "kv_cache_backend",
             "kv_cache_source", "runtime_kv_manager", "prompt_mode")


KV_TRACE = {"paged": (True, "PagedKVPool", "paged", "runtime", True),
            "dynamic_cache": (True, "DynamicCache", "dynamic_cache", "transformers", False)}


def make_omni(host, ckpt, backend="paged", **config):
    return Omni("ar_text", host=host, ar_model=str(ckpt), ar_device="cpu", ar_kv_backend=backend, **config)


@pytest.fixture(scope="module", params=list(KV_TRACE))
def omni(tiny_ckpt, host, request):
    """Both KV backends: for tests whose outcome depends on the model calls."""
    return make_omni(host, tiny_ckpt, request.param)


@pytest.fixture(scope="module")
def paged(tiny_ckpt, host):
    """One backend: for tests of input and output processing, which no backend touches."""
    return make_omni(host, tiny_ckpt)


def tokenizer_of(omni):
    return omni.graph.stages["generate"].inputs.tokenizer


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_transformers_generate(omni, tiny_ckpt, hf_greedy, prompt):
    result = omni.generate(prompt, max_tokens=40)
    out = result.output
    expected = hf_greedy(tiny_ckpt, out.data["prompt_token_ids"], 40)
    assert out.data["token_ids"] == expected
    assert len(set(expected)) > 10, "greedy output should not be a trivial repetition"
    tokenizer = tokenizer_of(omni)
    assert out.text == tokenizer.decode(expected, skip_special_tokens=True)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_dict=False)
    assert out.data["prompt_token_ids"] == list(chat)


def test_trace_fields_are_true(omni):
    result = omni.generate("Describe the library.", max_tokens=12, stream=True)
    trace = result.trace
    missing = [f for f in AR_FIELDS if f"ar.{f}" not in trace]
    assert not missing
    assert trace["ar.input_tokens"] == trace["ar.prefill_tokens"] == len(result.output.data["prompt_token_ids"])
    assert trace["ar.generated_tokens"] == len(result.output.data["token_ids"])
    assert trace["ar.scheduler_steps"] == trace["ar.generated_tokens"]
    assert trace["ar.prefill_steps"] == 1
    assert trace["ar.decode_model_calls"] == trace["ar.decode_scheduler_steps"] == trace["ar.generated_tokens"] - 1
    assert trace["ar.prefill_ms"] > 0 and trace["ar.decode_ms"] > 0 and trace["ar.ttft_ms"] >= trace["ar.prefill_ms"]
    assert trace["ar.decode_step_mean_ms"] == pytest.approx(trace["ar.decode_ms"] / trace["ar.decode_model_calls"],
                                                            abs=1e-2)
    assert trace["ar.streaming"] is True
    backend = omni.graph.stages["generate"].engine.runner.backend.kv_trace["kv_cache_backend"]
    assert (trace["ar.kv_cache"], trace["ar.kv_cache_type"], trace["ar.kv_cache_backend"],
            trace["ar.kv_cache_source"], trace["ar.runtime_kv_manager"]) == KV_TRACE[backend]
    assert trace["ar.kv_blocks_used"] == -(-(trace["ar.input_tokens"] + 11) // 16)
    assert trace["ar.preemptions"] == 0 and trace["ar.batch_size_max"] == 1
    assert trace["ar.prompt_mode"] == "chat_template"
    assert trace["ar.stop_reason"] == "max_tokens" and trace["ar.output_tokens"] == 12


@pytest.mark.parametrize("prompt", PROMPTS[1:3])
def test_stream_deltas_are_whole_characters_and_concatenate(paged, prompt):
    omni = paged
    deltas, result = [], None
    for event in omni.generate_stream(prompt, max_tokens=200, stream=True):
        if isinstance(event, TokenDelta):
            deltas.append(event.text)
        elif isinstance(event, RequestFinished):
            result = event.result
    assert "".join(deltas) == result.text
    tokenizer = tokenizer_of(omni)
    ids = result.output.data["token_ids"]
    assert result.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert all(deltas)
    # Only the final flush may end in a partial character (output cut off by the budget mid-character).
    assert not any(delta.endswith("\ufffd") for delta in deltas[:-1])
    # Some character of this output took more than one token: its first tokens released nothing.
    from omni_qwen.detokenize import IncrementalDetokenizer

    detok, held = IncrementalDetokenizer(omni.graph.stages["generate"].outputs.decode), False
    assembled = []
    for token in ids:
        piece = detok.add(token)
        if held and piece:
            assembled += [c for c in piece if len(c.encode()) > 1 and c != "\ufffd"]
        held = not piece
    assert assembled, "expected a multi-byte character split across tokens in the output"


def test_split_characters_are_held_back(paged):
    """Feed the detokenizer the tokens of text whose characters this tokenizer splits into bytes."""
    from omni_qwen.detokenize import IncrementalDetokenizer

    decode = paged.graph.stages["generate"].outputs.decode
    text = "fox 🦊 学校 ünï 𝄞!"
    ids = tokenizer_of(paged).encode(text)
    assert any("\ufffd" in decode([i]) for i in ids), "expected a character split across tokens"
    detok = IncrementalDetokenizer(decode)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "" in deltas[:-1]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_stop_eos(tiny_ckpt, tmp_path, host, copy_with_eos, run_plan):
    first = run_plan("ar.text_generation", "x", {"ar_model": str(tiny_ckpt)}, max_tokens=6)
    ids = first.output.data["token_ids"]
    target = ids[3]
    eos_dir = copy_with_eos(tiny_ckpt, tmp_path / "eos", [target])
    result = run_plan("ar.text_generation", "x", {"ar_model": str(eos_dir)})
    cut = ids.index(target)
    assert result.output.stop_reason == "eos"
    assert result.output.data["token_ids"] == ids[:cut + 1]
    assert result.trace["ar.generated_tokens"] == cut + 1 and result.trace["ar.output_tokens"] == cut


def test_stop_context_window(tiny_ckpt, hf_greedy, run_plan):
    result = run_plan("ar.text_generation", "The red gate.", {"ar_model": str(tiny_ckpt)})
    out = result.output
    assert out.stop_reason == "context_window"
    assert len(out.data["prompt_token_ids"]) + len(out.data["token_ids"]) == 256
    assert out.data["token_ids"] == hf_greedy(tiny_ckpt, out.data["prompt_token_ids"], 256)[:len(out.data["token_ids"])]


def test_stop_strings(paged):
    omni = paged
    full = omni.generate("x", max_tokens=30).text
    stop = full[8:11]
    cut = full.index(stop)
    deltas, result = [], None
    for event in omni.generate_stream("x", max_tokens=30, stop=[stop]):
        if isinstance(event, TokenDelta):
            deltas.append(event.text)
        elif isinstance(event, RequestFinished):
            result = event.result
    assert result.output.stop_reason == "stop" and result.trace["ar.stop_reason"] == "stop"
    assert result.text == full[:cut] == "".join(deltas)
    generated = result.trace["ar.generated_tokens"]
    assert result.trace["ar.output_tokens"] == generated == len(result.output.data["token_ids"]) < 30
    assert_freed(omni)


# The answer format omni_bridge's pipelines give the node (omni_bridge/guidance.py owns it).
GUIDANCE_FORMAT = {"answer_prefix": '{"guidance": "', "output_contract": "supplemental_guidance"}


def test_bridge_token_budget(run_plan):
    from omni_qwen.demo import ensure_demo_checkpoint

    demo = ensure_demo_checkpoint()  # its 512-token context holds the bridge's worked examples (tiny_ckpt's 256 not)
    events = []
    result = run_plan("ar.prompt_bridge", "a fox runs through snow", {"ar_model": str(demo)},
                      policy={"max_tokens": 9, **GUIDANCE_FORMAT}, stream=True, events=events)
    out = result.output
    assert out.stop_reason == "max_tokens" and out.contract == "supplemental_guidance"  # the policy's
    assert result.trace["ar.output_tokens"] == 9 and result.trace["ar.token_budget"] == 9
    assert result.trace["ar.prompt_mode"] == "bridge_chat_template"
    assert "".join(e.text for e in events if isinstance(e, TokenDelta)) == out.text
    assert any(isinstance(e, StageFinished) for e in events)
    from omni_qwen.bridge_prompt import EXAMPLES, answer, instruction

    prefix = GUIDANCE_FORMAT["answer_prefix"]
    pipeline_tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(demo)
    prompt_text = pipeline_tokenizer.decode(out.data["prompt_token_ids"])
    assert instruction(prefix) in prompt_text and "a fox runs through snow" in prompt_text
    assert instruction(prefix).endswith('nothing else: {"guidance": "..."}')  # the format the prefix opens
    assert all(answer(guidance, prefix) in prompt_text for _, guidance in EXAMPLES)  # the worked turns
    assert prompt_text.endswith("<|im_start|>assistant\n" + prefix)  # the answer is started for the model
    assert out.text.startswith(prefix)  # and the output text is the whole answer


def test_the_bridge_answers_in_the_format_its_policy_gives(run_plan):
    """Without an answer prefix (no consumer's format), the worked answers are the guidance alone and no contract
    is claimed."""
    from omni_qwen.bridge_prompt import EXAMPLES, instruction
    from omni_qwen.demo import ensure_demo_checkpoint

    demo = ensure_demo_checkpoint()
    out = run_plan("ar.prompt_bridge", "a fox runs through snow", {"ar_model": str(demo)},
                   policy={"max_tokens": 4}).output
    prompt_text = __import__("transformers").AutoTokenizer.from_pretrained(demo).decode(out.data["prompt_token_ids"])
    assert instruction(None) in prompt_text and "JSON" not in prompt_text and "{" not in prompt_text
    assert all(guidance in prompt_text for _, guidance in EXAMPLES)
    assert prompt_text.endswith("<|im_start|>assistant\n") and out.contract is None


def test_seed_reproduces_and_seeds_differ(omni):
    def sample(seed):
        return omni.generate("Describe the school.", temperature=1.0, top_p=0.95, top_k=50, seed=seed, max_tokens=24)

    a, b, c = sample(7), sample(7), sample(8)
    assert a.output.data["token_ids"] == b.output.data["token_ids"]
    assert a.output.data["token_ids"] != c.output.data["token_ids"]
    assert a.trace["ar.sampling"] == "sample" and a.trace["ar.seed"] == 7
    greedy = omni.generate("Describe the school.", max_tokens=24)
    assert greedy.output.data["token_ids"] != a.output.data["token_ids"]


def test_concurrent_requests_match_alone(omni):
    prompts = ["one", "学校", "🦊 three"]
    alone = [omni.generate(p, max_tokens=10 + i).output.data["token_ids"] for i, p in enumerate(prompts)]
    requests = [omni.request(p, max_tokens=10 + i) for i, p in enumerate(prompts)]
    for request in requests:
        omni.submit(request)
    finished = {}
    for event in testing.drain(omni):
        if isinstance(event, RequestFinished):
            finished[event.request_id] = event.result.output.data["token_ids"]
    assert [finished[r.request_id] for r in requests] == alone
    assert_freed(omni)


def assert_freed(omni):
    stage = omni.graph.stages["generate"]
    scheduler = stage.engine.scheduler  # a DynamicCache lives in its request's record: no record, no cache
    assert scheduler.blocks.num_used == 0 and not scheduler.blocks.tables and not scheduler.sequences


def test_prompt_errors(paged):
    omni = paged
    with pytest.raises(InputError, match="empty"):
        omni.generate("   ")
    with pytest.raises(InputError, match="context window is 256"):
        omni.generate("school " * 400)


class CountingTokenizer:
    """The stage's tokenizer, counting the calls that turn text into ids."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        attr = getattr(self.tokenizer, name)
        if name not in ("encode", "apply_chat_template", "encode_plus", "batch_encode_plus"):
            return attr

        def counted(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def test_each_request_is_tokenized_exactly_once(paged, monkeypatch):
    inputs = paged.graph.stages["generate"].inputs
    counter = CountingTokenizer(inputs.tokenizer)
    monkeypatch.setattr(inputs, "tokenizer", counter)
    paged.generate("one", max_tokens=3)
    assert counter.calls == 1
    paged.generate("two", max_tokens=4, stream=True, stop=["zz"], temperature=0.5, seed=2)
    list(paged.generate_stream("three", max_tokens=2))
    assert counter.calls == 3


def test_a_tiny_temperature_never_breaks_its_batch(paged):
    """A temperature of 1e-300 once turned the logits into inf / NaN and failed every request of the step: it
    is clamped to 1e-5 now, so it samples the argmax, and its batch neighbours (greedy and sampled) yield
    exactly what they yield alone. (A row whose logits hold NaN fails alone: test_qwen_units.)"""
    good = [paged.request("one", max_tokens=6), paged.request("two", max_tokens=6, temperature=0.8, seed=3)]
    alone = [paged.generate(r.prompt, **r.params).output.data["token_ids"] for r in good]
    tiny = paged.request("three", max_tokens=6, temperature=1e-300, seed=1)
    for request in (good[0], tiny, good[1]):
        paged.submit(request)
    events = testing.drain(paged)
    assert not [e for e in events if isinstance(e, RequestFailed)]
    finished = {e.request_id: e.result.output.data["token_ids"] for e in events if isinstance(e, RequestFinished)}
    assert [finished[r.request_id] for r in good] == alone
    assert finished[tiny.request_id] == paged.generate("three", max_tokens=6).output.data["token_ids"]
    assert_freed(paged)


def test_misspelled_request_parameter_is_refused(paged):
    with pytest.raises(InvalidParameter, match="strem") as info:
        paged.generate("hi", strem=True)
    assert "stream" in str(info.value) and "prompt_token_ids" in str(info.value)
    with pytest.raises(InvalidParameter, match="prompt_token_ids"):
        paged.generate("", prompt_token_ids=[1, 10**9])
    with pytest.raises(InvalidParameter, match="prompt_token_ids"):
        paged.generate("", prompt_token_ids="abc")
