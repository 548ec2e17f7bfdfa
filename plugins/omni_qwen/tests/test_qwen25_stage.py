"""The whole ar.text_generation stage over the real Qwen2.5 tokenizer: a tiny random Qwen2ForCausalLM with the
real 151936-token vocabulary, whose greedy output wanders over the whole vocabulary (byte pieces included)."""

from __future__ import annotations

import pytest

from omni_kernel import TokenDelta

pytestmark = [pytest.mark.real_model]

PROMPT = "生成1000字的文本，描述一所学校"


@pytest.fixture(scope="module")
def real_vocab_ckpt(tmp_path_factory, qwen25_tokenizer):
    from omni_qwen.demo import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2-tiny-qwen25-vocab", vocab_size=151936,
                            tokenizer=qwen25_tokenizer, initializer_range=0.5, context_window=512)


@pytest.fixture(scope="module")
def streamed(real_vocab_ckpt, run_plan):
    events = []
    result = run_plan("ar.text_generation", PROMPT, {"ar_model": str(real_vocab_ckpt)}, events=events,
                      max_tokens=96, stream=True)
    return result, [e.text for e in events if isinstance(e, TokenDelta)]


def test_streamed_deltas_add_up_to_the_decode(streamed, qwen25_tokenizer):
    result, deltas = streamed
    ids = result.output.data["token_ids"]
    whole = qwen25_tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 32 and len(set(ids)) > 16  # varied output, not one repeated token
    assert "".join(deltas) == result.text == whole
    assert all(deltas) and all("\ufffd" not in d for d in deltas if "\ufffd" not in whole)
    assert result.output.data["prompt_token_ids"] == qwen25_tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False)


def test_a_stop_string_spanning_generated_tokens(streamed, real_vocab_ckpt, run_plan, qwen25_tokenizer):
    result, _ = streamed
    ids = result.output.data["token_ids"]
    pieces = [qwen25_tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    # a stop string from the middle of the output that starts inside one token's text and ends in a later one
    k = next(k for k in range(len(ids) // 2, len(ids) - 2)
             if len(pieces[k]) > len(pieces[k - 1]) + 1 and "\ufffd" not in pieces[k + 2])
    stop = pieces[k + 2][len(pieces[k]) - 1:]
    assert all(stop not in qwen25_tokenizer.decode([i]) for i in ids)
    whole = pieces[-1]
    again = run_plan("ar.text_generation", PROMPT, {"ar_model": str(real_vocab_ckpt)}, max_tokens=96, stop=[stop])
    assert again.output.stop_reason == "stop"
    assert again.text == whole[:whole.index(stop)]
