"""The chat `messages` request parameter of omni_qwen (what /v1/chat/completions sends), no model needed."""

import pytest

from omni_kernel.core.errors import InvalidParameter

config = pytest.importorskip("omni_qwen.config")


def test_messages_from_pairs_dicts_parts_and_text():
    QwenParams = config.QwenParams
    want = (("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "again?"))
    assert QwenParams(messages=want).messages == want
    dicts = [{"role": r, "content": c} for r, c in want[:3]] + [
        {"role": "user", "content": [{"type": "text", "text": "again"}, {"type": "text", "text": "?"}]}]
    assert QwenParams(messages=dicts).messages == want
    assert QwenParams(messages=["system: be brief", "user: hi", "assistant: hello", "user: again?"]).messages == want


@pytest.mark.parametrize("bad, field", [
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    (["no colon"], "messages[0]"),
    ([], "messages"),
    (5, "messages"),
])
def test_bad_messages_name_the_field(bad, field):
    with pytest.raises(InvalidParameter) as info:
        config.QwenParams(messages=bad)
    assert info.value.field == field
