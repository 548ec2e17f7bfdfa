"""presence_penalty, frequency_penalty, repetition_penalty and min_p, per row of a batch: each row's next-token
distribution equals HF's own logits processor on the same logits for that row alone (RepetitionPenaltyLogitsProcessor,
MinPLogitsWarper; presence and frequency, which HF lacks, by OpenAI's definition written out here), the sampler's
greedy and seeded tokens of a mixed batch are those of that distribution, and greedy text under a penalty on the
real SmolLM2 weights equals HF `generate` with the same processor, token for token (fp32)."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

from omni_kernel import ARParams, RequestFailed, RequestFinished
from omni_kernel.core.errors import InvalidParameter
from omni_qwen.sampling import Sampler, Sampling, TokenCounts, penalize, probabilities

VOCAB = 1000


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties from their definition: over the tokens generated so far (after
    `num_prompt`), logit -= frequency_penalty * count + presence_penalty * (count > 0)."""

    def __init__(self, num_prompt: int, presence: float, frequency: float):
        self.num_prompt, self.presence, self.frequency = num_prompt, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.stack([torch.bincount(row[self.num_prompt:], minlength=scores.shape[-1]) for row in input_ids])
        return scores - self.frequency * counts - self.presence * (counts > 0)


def hf_processors(params: ARParams, num_prompt: int) -> list[LogitsProcessor]:
    """HF's processors of params, in vLLM's order: penalties on the logits, then (sampled) temperature, min-p."""
    processors = []
    if params.repetition_penalty != 1:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(OpenAIPenalties(num_prompt, params.presence_penalty, params.frequency_penalty))
    if not params.greedy:
        processors.append(TemperatureLogitsWarper(params.temperature))
        if params.min_p:
            processors.append(MinPLogitsWarper(params.min_p))
    return processors


def hf_distribution(logits: torch.Tensor, tokens: list[int], num_prompt: int, params: ARParams) -> torch.Tensor:
    """One row alone through HF's processors, as a distribution (sampled rows) or the argmax's one-hot (greedy)."""
    scores = logits[None].clone()
    for processor in hf_processors(params, num_prompt):
        scores = processor(torch.tensor([tokens]), scores)
    if params.greedy:
        return torch.nn.functional.one_hot(scores[0].argmax(), logits.shape[-1]).float()
    return scores[0].softmax(dim=-1)


# (params, prompt tokens, output tokens) of each row of the mixed batch: each penalty alone, together, min-p alone,
# and neighbours with none. A token is given by its rank in its row's logits (0: the most likely), so that the
# penalties fall on tokens that carry probability; they repeat within and across prompt and output.
RANKS = [
    (ARParams(temperature=0.8, seed=1, repetition_penalty=1.3), [0, 3, 3, 40], [1, 0, 300]),
    (ARParams(temperature=1.0, seed=2), [1, 2, 3], [4]),
    (ARParams(temperature=0.9, seed=3, presence_penalty=1.5), [0, 1], [1, 1, 2, 999]),
    (ARParams(temperature=1.1, seed=4, frequency_penalty=-0.7), [0], [1, 1, 1, 2, 0]),
    (ARParams(temperature=0.7, seed=5, min_p=0.05), [3, 4], [8]),
    (ARParams(temperature=1.0, seed=6, repetition_penalty=0.6, presence_penalty=-1.0, frequency_penalty=2.0,
              min_p=0.2, top_k=50), [2, 3, 2, 990], [3, 5, 5, 0, 999]),
    (ARParams(), [1], [2, 3]),
    (ARParams(repetition_penalty=2.0, frequency_penalty=1.0), [0, 1], [1, 2, 2]),
]


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    """Logits with a model's spread (a few large, many small, both signs), fp32."""
    return torch.randn(len(RANKS), VOCAB, generator=torch.Generator().manual_seed(7)) * 2


@pytest.fixture(scope="module")
def batch(logits) -> list[tuple[ARParams, list[int], list[int]]]:
    """RANKS as token ids: (params, prompt, output) of each row."""
    order = logits.argsort(dim=-1, descending=True).tolist()
    return [(params, [order[i][r] for r in prompt], [order[i][r] for r in output])
            for i, (params, prompt, output) in enumerate(RANKS)]


def test_each_row_of_a_mixed_batch_has_hf_s_distribution(logits, batch):
    rows = [Sampling.of(params, prompt + output, len(prompt)) for params, prompt, output in batch]
    penalized = [i for i, row in enumerate(rows) if row.counts is not None]
    assert penalized == [i for i, (params, _, _) in enumerate(batch) if params.penalized] == [0, 2, 3, 5, 7]
    scores = logits.clone()
    scores[penalized] = penalize(logits, penalized, [rows[i] for i in penalized])
    probs = probabilities(scores, [params for params, _, _ in batch])
    for i, (params, prompt, output) in enumerate(batch):
        expected = hf_distribution(logits[i], prompt + output, len(prompt), params)
        if params.greedy:
            assert scores[i].argmax() == expected.argmax(), i
            continue
        assert torch.allclose(probs[i], expected, atol=1e-5, rtol=0), (i, (probs[i] - expected).abs().max())
        plain = hf_distribution(logits[i], [], 0, ARParams(temperature=params.temperature))
        assert (expected - plain).abs().max() > 1e-2 or params == ARParams(temperature=1.0, seed=2), i  # it acts
    assert scores[7].argmax() != logits[7].argmax()  # the greedy row's penalties changed its token
    assert (probs[4] == 0).sum() > VOCAB // 2  # min_p really dropped tokens


def test_the_sampler_draws_each_row_from_its_hf_distribution(logits, batch):
    """Greedy rows take the argmax of HF's penalized logits, seeded rows draw what torch.multinomial draws from
    HF's distribution with the same seed; over several steps, with each row's drawn token appended."""
    tokens = [prompt + output for _, prompt, output in batch]  # the lists the rows' counts read, as they grow
    rows = [Sampling.of(params, tokens[i], len(prompt)) for i, (params, prompt, _) in enumerate(batch)]
    generators = [None if params.greedy else torch.Generator().manual_seed(params.seed) for params, _, _ in batch]
    sampler = Sampler()
    for step in range(4):
        step_logits = logits.roll(step, dims=-1)
        got = sampler.sample(step_logits, rows)
        for i, (params, prompt, _) in enumerate(batch):
            expected = hf_distribution(step_logits[i], tokens[i], len(prompt), params)
            want = int(expected.argmax()) if params.greedy else int(torch.multinomial(expected, 1,
                                                                                      generator=generators[i])[0])
            assert got[i] == want, (step, i)
            tokens[i].append(got[i])


@settings(max_examples=100, deadline=None)
@given(prompt=st.lists(st.integers(0, 30), min_size=1, max_size=20),
       steps=st.lists(st.lists(st.integers(0, 30), max_size=5), max_size=8))
def test_token_counts_follow_the_growing_list(prompt, steps):
    """Counted step by step as the list grows (a step may append several tokens, as a recompute does), the counts
    are those of the whole list counted at once."""
    tokens = list(prompt)
    counts = TokenCounts(tokens, len(prompt))
    for appended in steps:
        tokens.extend(appended)
        counts.update()
        assert sorted(counts.seen_ids.tolist()) == sorted(set(tokens))
        output = collections.Counter(tokens[len(prompt):])
        assert dict(zip(counts.output_ids.tolist(), counts.output_counts.tolist())) == output


def test_a_neutral_value_changes_nothing_and_costs_no_counts(logits):
    neutral = ARParams(temperature=0.9, seed=3, presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1.0,
                       min_p=0.0)
    assert not neutral.penalized and Sampling.of(neutral, [1, 2, 3]).counts is None
    plain = ARParams(temperature=0.9, seed=3)
    assert torch.equal(probabilities(logits[:1], [neutral]), probabilities(logits[:1], [plain]))


def test_a_penalty_applies_to_a_greedy_row():
    logits = torch.tensor([[0.0, 3.0, 2.5, -1.0]])
    assert Sampler().sample(logits, [Sampling.of(ARParams(), [1], 1)]) == [1]
    assert Sampler().sample(logits, [Sampling.of(ARParams(repetition_penalty=1.5), [1], 1)]) == [2]
    assert Sampler().sample(logits, [Sampling.of(ARParams(frequency_penalty=0.6), [0, 1], 2)]) == [1]  # prompt
    assert Sampler().sample(logits, [Sampling.of(ARParams(frequency_penalty=0.6), [0, 1], 0)]) == [2]  # output
    negative = torch.tensor([[-1.0, -1.2, -3.0]])  # a negative logit is multiplied by the repetition penalty
    assert Sampler().sample(negative, [Sampling.of(ARParams(repetition_penalty=1.5), [0], 1)]) == [1]


def test_extreme_values_stay_finite():
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3)) * 30
    for penalty in (1e-300, 1e300):
        rows = [Sampling.of(ARParams(temperature=1.0, seed=1, repetition_penalty=penalty, presence_penalty=2,
                                     frequency_penalty=-2, min_p=1.0), list(range(64)), 32),
                Sampling.of(ARParams(repetition_penalty=penalty), list(range(0, 64, 2)), 0)]
        tokens = Sampler().sample(logits, rows)
        assert all(isinstance(t, int) for t in tokens), tokens
        assert torch.isfinite(penalize(logits, [0, 1], rows)).all()


@pytest.mark.parametrize("field, value, says", [
    ("presence_penalty", 2.5, ">= -2 <= 2"), ("presence_penalty", float("nan"), ">= -2 <= 2"),
    ("frequency_penalty", -3, ">= -2 <= 2"), ("frequency_penalty", "1", ">= -2 <= 2"),
    ("repetition_penalty", 0, "> 0"), ("repetition_penalty", -1.0, "> 0"), ("repetition_penalty", True, "> 0"),
    ("min_p", 1.01, ">= 0 <= 1"), ("min_p", -0.1, ">= 0 <= 1")])
def test_out_of_range_values_are_refused_naming_the_field(field, value, says):
    with pytest.raises(InvalidParameter) as info:
        ARParams(**{field: value})
    assert info.value.field == field
    assert str(info.value) == f"invalid {field}: {value!r} is not a finite number {says}"


# On the real SmolLM2-135M-Instruct (fp32), several prompts at once, each with its own penalties and none.
PROMPTS = (("Write a poem about the sea, the sea, the sea.", {"repetition_penalty": 1.3}),
           ("List ten fruits.", {"presence_penalty": 1.2, "frequency_penalty": 0.8}),
           ("Count from 1 to 12, separated by commas.", {"frequency_penalty": 1.5}),
           ("Describe a school.", {}),
           ("What is the capital of Australia?", {"repetition_penalty": 0.8, "presence_penalty": -0.5}))
MAX_TOKENS = 24


@pytest.mark.real_model
def test_greedy_text_under_penalties_equals_generate(host, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omni_kernel import Omni

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    # The penalties act in the sampler, after the decode step, whichever step runs; the eager one loads at once.
    omni = Omni("ar_text", host=host, ar_model=str(smollm2_dir), ar_device="cpu", ar_dtype="fp32", ar_compile=False)
    for i, (prompt, penalties) in enumerate(PROMPTS):
        omni.submit(omni.request("", request_id=f"r{i}", messages=[{"role": "user", "content": prompt}],
                                 max_tokens=MAX_TOKENS, ignore_eos=True, **penalties))
    finished = {}
    while omni.has_unfinished():
        for event in omni.step():
            assert not isinstance(event, RequestFailed), event
            if isinstance(event, RequestFinished):
                finished[event.request_id] = event.result.output
    assert max(out.trace["ar.batch_size_max"] for out in finished.values()) == len(PROMPTS)
    for i, (prompt, penalties) in enumerate(PROMPTS):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
        processors = hf_processors(ARParams(**penalties), ids.shape[1])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
                             logits_processor=LogitsProcessorList(processors))
        expected = out[0, ids.shape[1]:].tolist()
        assert finished[f"r{i}"].data["token_ids"] == expected, (prompt, penalties)
        if penalties:
            plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                   do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
            assert plain[0, ids.shape[1]:].tolist() != expected, (prompt, penalties)  # the penalty mattered
