"""Real trained weights (SmolLM2-135M-Instruct, a LlamaForCausalLM) on the paged engine: greedy output through
the ar_text stage equals transformers' `generate` for the same prompt alone, token for token (fp32), whether
each request runs alone, 16 arrive staggered while others decode, a small KV pool forces preemption, or a
shared system prompt is served from the prefix cache. Every engine here runs the default path, the compiled decode
step (`compiled_default`: the session's OMNI_AR_COMPILE=false removed): the suite's compiled runs of real weights
(the wheels tier runs the installed model once, eager, and builds the kernel without compiling a model). The
first engine compiles into the session's compile cache; the others (other pool sizes and token budgets) find it.
Skipped, with the command that fetches the model, when the model is not in omni's cache (`make test` fetches it)."""

from __future__ import annotations

import pytest
import torch

from omni_kernel import Omni, RequestFailed, RequestFinished

pytestmark = [pytest.mark.real_model]

PROMPTS = (
    "Describe a school.",
    "What is 17 * 23?",
    "Write a haiku about rain.",
    "Give me three tips for learning to play the guitar.",
    "Translate 'good morning' into French and Spanish.",
    "Explain what a black hole is to a ten-year-old.",
    "Write a Python function that reverses a string.",
    "List the planets of the solar system in order.",
    "What is the capital of Australia?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I make a cup of green tea?",
    "Write a short, polite email declining a meeting invitation.",
    "What are the benefits of regular exercise?",
    "Count from 1 to 12, separated by commas.",
    'Return a JSON object with keys "name" and "age" for a fictional person.',
    "Why is the sky blue?",
    "Suggest a name for a small bakery by the sea.",
    "What happened in 1969 that changed space exploration?",
    "Describe the smell of a forest after a storm.",
    "Write a limerick about a cat who loves to code.",
    "  Tabs\tand  spaces   before 42 and 3.14159 digits?",
    "What is the difference between a virus and a bacterium?",
)
MAX_TOKENS = 24
# K and V of one token across SmolLM2's 30 layers (3 KV heads x 64, fp32), times a 16-token block.
BLOCK_BYTES = 30 * 2 * 3 * 64 * 4 * 16
SYSTEM = ("You are a careful assistant for a museum of natural history. Visitors ask about fossils, minerals, "
          "animals and the history of the Earth. Answer briefly, in plain words, and say so when you are unsure. "
          "Never invent exhibit names or opening hours.")


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def reference(smollm2_dir, tokenizer):
    """HF `generate` greedy (fp32), one request at a time, never stopping early; keyed by the chat messages."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    cache: dict[tuple, list[int]] = {}

    def generate(messages: tuple[tuple[str, str], ...]) -> list[int]:
        if messages not in cache:
            ids = torch.tensor([chat_ids(tokenizer, messages)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
            cache[messages] = out[0, ids.shape[1]:].tolist()
        return cache[messages]

    return generate


def chat_ids(tokenizer, messages) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                             add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(rendered["input_ids"])


@pytest.fixture(scope="module")
def make_omni(host, smollm2_dir, compiled_default):
    def make(blocks=512, budget=256):
        return Omni("ar_text", host=host, ar_model=str(smollm2_dir), ar_device="cpu", ar_dtype="fp32",
                    ar_kv_memory=blocks * BLOCK_BYTES, ar_max_num_batched_tokens=budget)

    return make


def user(prompt: str) -> tuple[tuple[str, str], ...]:
    return (("user", prompt),)


def drain(omni, arrivals, every=0):
    """Submit (request id, messages) pairs, all at once (every=0) or one per `every` engine steps; step until
    done; return {request id: StageOutput}."""
    arrivals, finished, step = list(arrivals), {}, 0
    while arrivals or omni.has_unfinished():
        while arrivals and (step % every == 0 if every else True):
            rid, messages = arrivals.pop(0)
            omni.submit(omni.request("", request_id=rid, messages=[{"role": r, "content": c} for r, c in messages],
                                     max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0))
            if every:
                break
        for event in omni.step():
            assert not isinstance(event, RequestFailed), event
            if isinstance(event, RequestFinished):
                finished[event.request_id] = event.result.output
        step += 1
        assert step < 5000
    return finished


def test_each_prompt_alone_equals_generate(make_omni, reference, tokenizer):
    """Over 30 s (85 s in a full run on 2 cores): the first test of the module pays for HF `generate` in fp32 on
    all 22 prompts, the references the later tests reuse, besides the 22 runs of the stage. The prompts are the
    coverage (arithmetic, code, JSON, digits and odd whitespace), so it is not made cheaper; it is in the
    real_model tier, outside `make test-fast`."""
    omni = make_omni()
    scheduler = omni.graph.stages["generate"].engine.scheduler
    for i, prompt in enumerate(PROMPTS):
        out = drain(omni, [(f"a{i}", user(prompt))])[f"a{i}"]
        assert out.data["token_ids"] == reference(user(prompt)), prompt
        assert out.trace["ar.kv_cache_backend"] == "paged" and out.trace["ar.dtype"] == "fp32"
        assert out.trace["ar.decode_compiled"] is True  # the default (a lone fp32 decode runs eager: graph.py)
        assert out.trace["ar.input_tokens"] == len(chat_ids(tokenizer, user(prompt)))
        assert scheduler.blocks.num_used == 0 or scheduler.blocks.caching  # only cached blocks stay


def test_sixteen_staggered_arrivals_equal_generate(make_omni, reference):
    omni = make_omni(budget=32)  # every prompt (33 tokens or more) prefills in chunks beside the decodes
    arrivals = [(f"s{i}", user(p)) for i, p in enumerate(PROMPTS[:16])]
    finished = drain(omni, arrivals, every=2)
    assert max(out.trace["ar.batch_size_max"] for out in finished.values()) >= 8  # really batched
    for rid, messages in arrivals:
        assert finished[rid].data["token_ids"] == reference(messages), messages
    assert any(finished[rid].trace["ar.prefill_steps"] > 1 for rid, _ in arrivals)  # chunked prefill happened


def test_small_pool_preempts_and_still_equals_generate(make_omni, reference):
    omni = make_omni(blocks=24)  # 384 tokens for 16 requests of about 60 + 24
    arrivals = [(f"p{i}", user(p)) for i, p in enumerate(PROMPTS[-16:])]
    finished = drain(omni, arrivals)
    assert omni.graph.stages["generate"].engine.scheduler.num_preemptions > 0
    assert any(out.trace["ar.preemptions"] for out in finished.values())
    for rid, messages in arrivals:
        assert finished[rid].data["token_ids"] == reference(messages), messages


def test_shared_system_prompt_hits_the_prefix_cache(make_omni, reference, tokenizer):
    omni = make_omni()
    questions = ("What is a trilobite?", "How old is the Earth?", "What is quartz made of?",
                 "Did dinosaurs have feathers?")
    shared = len(chat_ids(tokenizer, (("system", SYSTEM),)))
    outputs = []
    for i, question in enumerate(questions):
        messages = (("system", SYSTEM), ("user", question))
        out = drain(omni, [(f"h{i}", messages)])[f"h{i}"]
        assert out.data["token_ids"] == reference(messages), question
        outputs.append(out)
    assert outputs[0].trace["ar.prefix_cache_hit_tokens"] == 0
    for out in outputs[1:]:
        hits = out.trace["ar.prefix_cache_hit_tokens"]
        assert hits >= 16 * (shared // 16) and hits % 16 == 0
        assert out.trace["ar.prefill_tokens"] == out.trace["ar.input_tokens"] - hits


def test_compiled_decode_steps_equal_generate(make_omni, reference):
    """The default: the decode-only steps run the torch.compile'd graph (paged/graph.py), the steps with prefill
    chunks run eager, and greedy output still equals `generate` token for token (fp32), with staggered arrivals so
    both kinds of step and batches of changing size and context run (the engine of the staggered test)."""
    omni = make_omni(budget=32)
    backend = omni.graph.stages["generate"].engine.runner.backend
    compiled = backend.graph.forward
    calls = []

    def counted(step, pool):
        calls.append(step.num_decodes)
        return compiled(step, pool)

    backend.graph.forward = counted
    arrivals = [(f"c{i}", user(p)) for i, p in enumerate(PROMPTS[:8])]
    finished = drain(omni, arrivals, every=3)
    for rid, messages in arrivals:
        assert finished[rid].data["token_ids"] == reference(messages), messages
        assert finished[rid].trace["ar.decode_compiled"] is True
    assert len(calls) >= MAX_TOKENS and len(set(calls)) >= 3, calls  # compiled steps of several batch sizes
