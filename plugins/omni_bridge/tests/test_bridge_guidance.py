"""Unit tests of the connector's parse / merge / fallback rules (docs/bridge.md)."""

import json

import pytest

from omni_bridge import FALLBACK_REASONS, ARToDiffusionConnector, merge_prompt, parse_guidance
from omni_kernel import Request, StageOutput, Structured

PROMPT = "A red fox runs through fresh snow"
TRACE_KEYS = {"diffusion.bridge", "diffusion.source_node", "diffusion.source_request_id", "diffusion.bridge_strategy",
              "diffusion.bridge_parse_success", "diffusion.bridge_fallback", "diffusion.bridge_fallback_reason",
              "diffusion.ar_guidance_prompt", "diffusion.prompt", "diffusion.bridge_constrained"}


def convert(text, stop_reason="eos", contract="supplemental_guidance", connector=None, **request_kwargs):
    request = Request("qwen_to_wan_i2v", request_kwargs.pop("prompt", PROMPT), **request_kwargs)
    output = StageOutput(request.request_id, "bridge", text=text, stop_reason=stop_reason, contract=contract,
                         trace={"ar.stop_reason": stop_reason})
    return (connector or ARToDiffusionConnector()).convert(output, request), request


def test_good_json_merges_after_the_users_prompt():
    item, request = convert('{"guidance": "slow dolly-in, soft morning light"}', image="fox.png",
                            params={"preset": "smoke", "seed": 3, "output": "fox.mp4"})
    assert item.prompt == f"{PROMPT}\n\nSupplemental guidance: slow dolly-in, soft morning light"
    assert item.request_id == request.request_id
    assert item.image == "fox.png"
    assert item.params is None  # the StageScheduler gives the diffusion node its own params
    assert set(item.trace) == TRACE_KEYS
    assert item.trace == {
        "diffusion.bridge": "ar_to_diffusion", "diffusion.source_node": "bridge",
        "diffusion.source_request_id": request.request_id, "diffusion.bridge_strategy": "append",
        "diffusion.bridge_constrained": False, "diffusion.bridge_parse_success": True,
        "diffusion.bridge_fallback": False,
        "diffusion.bridge_fallback_reason": None, "diffusion.ar_guidance_prompt": "slow dolly-in, soft morning light",
        "diffusion.prompt": item.prompt}


@pytest.mark.parametrize("text", [
    '```json\n{"guidance": "pan left"}\n```',
    'Sure! Here is the guidance:\n{"guidance": "pan left"}\nEnjoy.',
    '{"notes": "x"} then {"guidance": "pan left"}',
    '[{"guidance": "pan left"}]',
    '  {"guidance": "  pan\n\tleft  ", "camera": 3}  ',
    '{"guidance": "pan left", "negative_prompt": "blur"}',
])
def test_json_in_a_fence_or_prose_still_parses(text):
    item, _ = convert(text)
    assert item.trace["diffusion.bridge_parse_success"] is True
    assert item.trace["diffusion.ar_guidance_prompt"] == "pan left"


@pytest.mark.parametrize("stop", ["max_tokens", "context_window"])
def test_a_text_cut_by_the_budget_falls_back_as_truncated(stop):
    item, request = convert('{"guidance": "slow dolly-in, soft mor', stop_reason=stop)
    assert item.prompt == request.prompt
    assert item.trace["diffusion.bridge_fallback"] is True
    assert item.trace["diffusion.bridge_parse_success"] is False
    assert item.trace["diffusion.bridge_fallback_reason"] == "truncated"
    assert item.trace["diffusion.ar_guidance_prompt"] is None


def test_a_complete_object_cut_afterwards_is_still_truncated():
    item, _ = convert('{"guidance": "pan left"} and then the model kept', stop_reason="max_tokens")
    assert item.trace["diffusion.bridge_fallback_reason"] == "truncated"


def test_the_connector_reads_the_outputs_typed_fields_not_the_ar_trace():
    request = Request("qwen_to_wan_i2v", PROMPT)
    cut = StageOutput(request.request_id, "bridge", text='{"guidance": "x"}', stop_reason="max_tokens",
                      structured=Structured("json_schema"))
    item = ARToDiffusionConnector().convert(cut, request)
    assert item.trace["diffusion.bridge_fallback_reason"] == "truncated"
    assert item.trace["diffusion.bridge_constrained"] is True
    traced = StageOutput(request.request_id, "bridge", text='{"guidance": "x"}',
                         trace={"ar.stop_reason": "max_tokens", "ar.structured_output": "json_schema"})
    item = ARToDiffusionConnector().convert(traced, request)
    assert item.trace["diffusion.bridge_parse_success"] is True and item.trace["diffusion.bridge_constrained"] is False


@pytest.mark.parametrize("text", ['{"guidance": "pan left"', "pan left, slowly", "{guidance: pan}", "```json\n```",
                                  "{" * 5000, "[" * 100_000, '{"guidance": ' + "9" * 5000 + "}"])
def test_bad_json_falls_back_as_invalid_json(text):
    item, request = convert(text)
    assert item.prompt == request.prompt
    assert item.trace["diffusion.bridge_fallback_reason"] == "invalid_json"


@pytest.mark.parametrize("text", ['{"camera": "pan left"}', '{"guidance": ""}', '{"guidance": " \\n\\t "}',
                                  '{"guidance": 42}', '{"guidance": ["a"]}', '["guidance", "pan"]', '"pan left"',
                                  "42", "null", '{"a": {"guidance": "nested does not count"}}'])
def test_json_without_the_contracts_fields_falls_back_as_missing_fields(text):
    item, request = convert(text)
    assert item.prompt == request.prompt
    assert item.trace["diffusion.bridge_fallback_reason"] == "missing_fields"


@pytest.mark.parametrize("text", ["", "   \n\t ", None])
def test_empty_output_falls_back_as_empty(text):
    item, request = convert(text, stop_reason="max_tokens")
    assert item.prompt == request.prompt
    assert item.trace["diffusion.bridge_fallback_reason"] == "empty"


def test_an_output_of_another_contract_falls_back_as_contract_mismatch():
    item, _ = convert('{"guidance": "pan left"}', contract="text")
    assert item.trace["diffusion.bridge_fallback_reason"] == "contract_mismatch"


def test_an_output_without_a_contract_is_read_as_guidance():
    item, _ = convert('{"guidance": "pan left"}', contract=None)
    assert item.trace["diffusion.bridge_parse_success"] is True


def test_control_characters_and_lone_surrogates_never_reach_the_prompt():
    item, _ = convert(json.dumps({"guidance": "pan\x00 left\ud800\u2028now"}))
    assert item.trace["diffusion.ar_guidance_prompt"] == "pan left now"
    item.prompt.encode("utf-8")


def test_extra_fields_are_appended_when_the_connector_names_them():
    connector = ARToDiffusionConnector(extra_fields=("camera", "style"))
    item, _ = convert('{"guidance": "a fox", "camera": "pan left", "style": 7, "mood": "calm"}', connector=connector)
    assert item.trace["diffusion.ar_guidance_prompt"] == "a fox; camera: pan left"


def test_the_users_prompt_is_never_changed():
    prompt = "  Ein Fuchs 🦊 im Schnee\n"
    item, _ = convert('{"guidance": "pan"}', prompt=prompt)
    assert item.prompt.startswith(prompt)
    assert item.prompt == merge_prompt(prompt, "pan")
    assert merge_prompt(prompt, None) == prompt


def test_every_reason_is_in_the_documented_set():
    reasons = {parse_guidance(t, s, c).reason for t, s, c in [
        ("", None, None), ("x", "max_tokens", None), ("x", None, None), ("1", None, None), ("x", None, "text")]}
    assert reasons == set(FALLBACK_REASONS)
