"""Streamed text on the real Qwen2.5 byte-level BPE, fed one token at a time through the code the AR stage uses
(IncrementalDetokenizer, AROutputProcessor, CausalLM.decode): the deltas concatenate to exactly the whole decode,
none holds a U+FFFD the whole decode has not, and a stop string spanning tokens cuts the text just before it."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_kernel.core.ar_scheduler import ARScheduler
from omni_kernel.core.kv_blocks import BlockManager
from omni_kernel.core.request import StageInput
from omni_qwen.config import ARNodeSettings, QwenParams
from omni_qwen.detokenize import REPLACEMENT, IncrementalDetokenizer
from omni_qwen.inputs import ARInputProcessor
from omni_qwen.model import CausalLM
from omni_qwen.outputs import AROutputProcessor
from omni_qwen.runner import ARRunnerState
from omni_qwen.sampling import Sampling

pytestmark = [pytest.mark.real_model]

TEXTS = {
    "chinese": "生成1000字的文本，描述一所学校",
    "zwj_emoji": "👩‍👩‍👧‍👦 family 🏳️‍🌈 flag 👨‍💻 coder 🧑🏿‍🤝‍🧑🏻",
    "skin_tones": "👍🏻👍🏼👍🏽👍🏾👍🏿 👩🏽‍🚀 astronaut",
    "accents": "café naïve résumé Ångström œuvre São Paulo ñandú Ærø Łódź",
    "mixed_scripts": "Привет мир! مرحبا بالعالم שלום 안녕하세요 こんにちは नमस्ते สวัสดี Γειά σου",
    "astral": "𠜎𠜱𠝹𠱓 𝕳𝖊𝖑𝖑𝖔 🀄🃏 𓀀𓁐",
    "combining": "e\u0301 a\u0308 n\u0303 \u1e9b\u0323 Z\u0335\u0321a\u0336\u0327l\u0337g\u0338o",
    "code_and_digits": "def f(x):\n\treturn x ** 2  # 12345678901234567890\r\n",
}


@pytest.fixture(scope="module")
def decode(qwen25_tokenizer):
    """omni's own decode (the AR stage's), over the real tokenizer; it needs no model."""
    return CausalLM(None, qwen25_tokenizer, None, "cpu").decode


def stream(decode, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(decode)
    return [detok.add(i) for i in ids] + [detok.flush()]


def check_deltas(deltas: list[str], whole: str, text: str | None = None) -> None:
    """The deltas add up to `text` (default: the whole decode), each valid UTF-8 with no U+FFFD of its own."""
    assert "".join(deltas) == (whole if text is None else text)
    for delta in deltas:
        delta.encode("utf-8")  # strict: no lone surrogate either
        assert REPLACEMENT not in delta or REPLACEMENT in whole


@pytest.mark.parametrize("name", TEXTS)
def test_deltas_are_whole_characters_adding_up_to_the_decode(qwen25_tokenizer, decode, name):
    ids = qwen25_tokenizer.encode(TEXTS[name])
    whole = decode(ids)
    assert whole == unicodedata.normalize("NFC", TEXTS[name])  # the tokenizer's NFC normalizer, then a round trip
    deltas = stream(decode, ids)
    check_deltas(deltas, whole)
    assert REPLACEMENT not in whole


@pytest.mark.parametrize("name", ["zwj_emoji", "skin_tones", "astral", "mixed_scripts"])
def test_these_texts_split_characters_across_tokens(qwen25_tokenizer, decode, name):
    """The cases above do reach the held-back path: some tokens alone are part of a character."""
    ids = qwen25_tokenizer.encode(TEXTS[name])
    assert any(decode([i]).endswith(REPLACEMENT) for i in ids)
    assert "" in stream(decode, ids)[:-1]


def run_output(tokenizer, decode, ids: list[int], stop: tuple[str, ...] = ()):
    """Feed `ids` to AROutputProcessor as a scheduler would (the last one with a token budget reached); stop at
    the first reason. Returns (streamed deltas, reason, tokens consumed, final StageOutput)."""
    settings_ = ARNodeSettings(chat=False)
    item = ARInputProcessor(tokenizer, settings_, 32768, 151936).process(
        StageInput("r", "x", params=QwenParams(stop=stop)))
    outputs = AROutputProcessor("n", decode, settings_, {})
    seq = ARScheduler(BlockManager(64, 16)).add(item)  # the request's record, as the engine's scheduler keeps it
    seq.state = ARRunnerState(Sampling.of(item.params))  # and the runner's state of it (unconstrained)
    outputs.add(seq)
    deltas, reason = [], None
    for n, token in enumerate(ids, 1):
        seq.token_ids.append(token)
        delta, reason = outputs.add_token(seq, token, "max_tokens" if n == len(ids) else None)
        deltas.append(delta.text if delta is not None else "")
        if reason:
            break
    return deltas, reason, n, outputs.finish(seq, reason)


@pytest.mark.parametrize("name", TEXTS)
def test_the_output_processor_streams_the_whole_decode(qwen25_tokenizer, decode, name):
    ids = qwen25_tokenizer.encode(TEXTS[name])
    deltas, reason, n, out = run_output(qwen25_tokenizer, decode, ids)
    assert (reason, n, out.data["token_ids"]) == ("max_tokens", len(ids), ids)
    check_deltas(deltas, decode(ids))
    assert out.text == decode(ids)


STOP_TEXT = "生成1000字的文本，描述一所学校。Then 👩🏽‍🚀 waves: «¡Olé!» and more text after it."


@pytest.mark.parametrize("stop", ["描述一所", "👩🏽‍🚀", "1000字", "Olé!»", "n 👩"])
def test_a_stop_string_spanning_tokens_cuts_just_before_it(qwen25_tokenizer, decode, stop):
    ids = qwen25_tokenizer.encode(STOP_TEXT)
    whole = decode(ids)
    assert all(stop not in decode([i]) for i in ids)  # it spans tokens
    first = next(k for k in range(1, len(ids) + 1) if stop in decode(ids[:k]))
    deltas, reason, n, out = run_output(qwen25_tokenizer, decode, ids, stop=(stop, "never there"))
    assert reason == "stop" and out.stop_reason == "stop"
    assert n == first  # found on the token that completes it
    assert out.text == whole[:whole.index(stop)]
    check_deltas(deltas, whole, out.text)


def test_the_earliest_of_several_stop_strings_wins(qwen25_tokenizer, decode):
    ids = qwen25_tokenizer.encode(STOP_TEXT)
    deltas, _, _, out = run_output(qwen25_tokenizer, decode, ids, stop=("waves", "学校。Then"))
    assert out.text == "".join(deltas) == "生成1000字的文本，描述一所"


CHARS = st.one_of(
    st.characters(exclude_categories=("Cs",)),
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
    st.characters(min_codepoint=0x0300, max_codepoint=0x036F),  # combining marks
    st.sampled_from(["\u200d", "\ufe0f", "\U0001f3fb", "\U0001f3ff", " ", "\n", "é", "1"]),
)


@settings(max_examples=80, deadline=None)
@given(text=st.text(CHARS, min_size=1, max_size=40))
def test_random_text_streams_to_its_decode(qwen25_tokenizer, decode, text):
    ids = qwen25_tokenizer.encode(text)
    check_deltas(stream(decode, ids), decode(ids))
    deltas, _, _, out = run_output(qwen25_tokenizer, decode, ids)
    check_deltas(deltas, decode(ids))
    assert out.text == decode(ids)


@settings(max_examples=80, deadline=None)
@given(text=st.text(CHARS, min_size=2, max_size=40), data=st.data())
def test_random_stop_strings_cut_at_their_first_occurrence(qwen25_tokenizer, decode, text, data):
    ids = qwen25_tokenizer.encode(text)
    whole = decode(ids)
    if len(whole) < 2:
        return
    start = data.draw(st.integers(0, len(whole) - 1))
    stop = whole[start:data.draw(st.integers(start + 1, min(len(whole), start + 6)))]
    deltas, reason, _, out = run_output(qwen25_tokenizer, decode, ids, stop=(stop,))
    assert reason == "stop"
    assert out.text == whole[:whole.index(stop)]
    check_deltas(deltas, whole, out.text)


def test_a_stop_string_in_the_held_back_tail_of_the_last_token_still_stops(qwen25_tokenizer, decode):
    """The budget ends mid-emoji: the last token's text (" " and part of 👩) is only released by the final flush,
    and the stop string in it must still be found."""
    ids = qwen25_tokenizer.encode("ab 👩")
    assert ids == [370, 61804, 102] and decode(ids[:2]) == "ab \ufffd"
    deltas, reason, _, out = run_output(qwen25_tokenizer, decode, ids[:2], stop=(" ",))
    assert (reason, out.text, "".join(deltas)) == ("stop", "ab", "ab")
    deltas, reason, _, out = run_output(qwen25_tokenizer, decode, ids[:2], stop=("b \ufffd",))
    assert (reason, out.text) == ("stop", "a")
    deltas, reason, _, out = run_output(qwen25_tokenizer, decode, ids[:2], stop=("zz",))
    assert (reason, out.text, "".join(deltas)) == ("max_tokens", "ab \ufffd", "ab \ufffd")
