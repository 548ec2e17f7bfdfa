"""Params validation, Request / StageInput / StageOutput / RequestResult, trace helpers, errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_kernel.errors import GraphError, InvalidParameter, UserError
from omni_kernel.params import ARParams, DiffusionParams
from omni_kernel.request import Request, RequestResult, StageInput, StageOutput
from omni_kernel.trace import format_trace, jsonable, prefixed

AR_BAD = [("temperature", -0.1, "temperature >= 0"), ("temperature", "hot", "temperature >= 0"),
          ("temperature", float("nan"), "temperature >= 0"),
          ("top_p", 0, "0 < top_p <= 1"), ("top_p", 1.5, "0 < top_p <= 1"), ("top_p", -1, "0 < top_p <= 1"),
          ("top_k", 0, "top_k = -1 (off) or top_k > 0"), ("top_k", -2, "top_k = -1 (off) or top_k > 0"),
          ("top_k", 2.5, "top_k = -1 (off) or top_k > 0"),
          ("seed", -1, "an integer >= 0"), ("seed", 1.5, "an integer >= 0"), ("seed", True, "an integer >= 0"),
          ("max_tokens", 0, "an integer >= 1"), ("max_tokens", "10", "an integer >= 1"),
          ("stop", ("",), "non-empty strings"), ("stop", (3,), "non-empty strings")]

DIFFUSION_BAD = [(name, value, "an integer >= 1") for name in ("height", "width", "num_frames", "num_inference_steps")
                 for value in (0, -8, 2.5, False)] + [
    ("seed", -3, "an integer >= 0"), ("guidance_scale", -0.5, "guidance_scale >= 0"),
    ("guidance_scale", "big", "guidance_scale >= 0")]


@pytest.mark.parametrize("field, value, allowed", AR_BAD)
def test_ar_params_refuse_each_bad_field_naming_it_and_its_range(field, value, allowed):
    with pytest.raises(InvalidParameter) as info:
        ARParams(**{field: value})
    assert info.value.field == field
    assert str(info.value).startswith(f"invalid {field}: ") and allowed in str(info.value)
    assert isinstance(info.value, UserError) and info.value.exit_code == 2


@pytest.mark.parametrize("field, value, allowed", DIFFUSION_BAD)
def test_diffusion_params_refuse_each_bad_field_naming_it_and_its_range(field, value, allowed):
    with pytest.raises(InvalidParameter) as info:
        DiffusionParams(**{field: value})
    assert info.value.field == field and allowed in str(info.value) and field in str(info.value)


def test_defaults_and_good_values():
    ar = ARParams()
    assert ar.greedy and (ar.top_p, ar.top_k, ar.seed, ar.stop, ar.max_tokens) == (1.0, -1, None, (), None)
    sampled = ARParams(temperature=0.7, top_p=0.9, top_k=40, seed=0, stop=["\n\n"], max_tokens=1)
    assert not sampled.greedy and sampled.stop == ("\n\n",)
    assert DiffusionParams() == DiffusionParams(None, None, None, None, None, None, None, None)
    DiffusionParams(preset="fast", height=32, width=32, num_frames=1, num_inference_steps=1, guidance_scale=0,
                    seed=7, negative_prompt="blur")


@settings(max_examples=60, deadline=None)
@given(st.integers(-5, 5))
def test_top_k_accepted_exactly_when_off_or_positive(k):
    try:
        ARParams(top_k=k)
        accepted = True
    except InvalidParameter:
        accepted = False
    assert accepted == (k == -1 or k > 0)


@settings(max_examples=60, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=False, width=32))
def test_top_p_accepted_exactly_in_its_range(p):
    try:
        ARParams(top_p=p)
        accepted = True
    except InvalidParameter:
        accepted = False
    assert accepted == (0 < p <= 1)


def test_request_values():
    a, b = Request("echo", "hi"), Request("echo", "hi")
    assert a.request_id != b.request_id and len(a.request_id) == 16 and a.arrival_time > 0
    assert (a.image, dict(a.params), dict(a.options)) == (None, {}, {})
    with pytest.raises(InvalidParameter, match="prompt"):
        Request("echo", None)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="prompt"):
        Request("echo", b"bytes")  # type: ignore[arg-type]


def test_stage_input_from_request_takes_the_kinds_params():
    ar, diffusion = ARParams(seed=1), DiffusionParams(num_inference_steps=2)
    request = Request("p", "prompt", image="in.png", params={"ar": ar, "diffusion": diffusion},
                      options={"stream": True}, request_id="rid")
    item = StageInput.from_request(request, "ar")
    assert (item.request_id, item.prompt, item.image, item.params, dict(item.options), dict(item.trace)) == (
        "rid", "prompt", "in.png", ar, {"stream": True}, {})
    assert StageInput.from_request(request, "diffusion").params is diffusion
    assert StageInput.from_request(request, "text").params is None


def test_request_result_json_for_text_and_path():
    text = StageOutput("r", "n", text="héllo", stop_reason="eos", trace={"ar.ttft_ms": 1.5})
    result = RequestResult("r", "echo", text, {"n": text}, {"ar.ttft_ms": 1.5, "x.obj": object()})
    body = result.to_json()
    assert body["output"] == {"text": "héllo"} and body["stop_reason"] == "eos" and body["pipeline"] == "echo"
    json.dumps(body)
    video = StageOutput("r", "n", path="/tmp/out.mp4")
    body = RequestResult("r", "v", video, {"n": video}, {}).to_json()
    assert body["output"] == {"path": "/tmp/out.mp4"} and "stop_reason" not in body
    assert RequestResult("r", "v", video, {}, {}).path == "/tmp/out.mp4"


def test_trace_helpers():
    assert prefixed("ar", {"ttft_ms": 3}) == {"ar.ttft_ms": 3}
    assert jsonable({"a": (1, 2), "b": {3: None}, "c": object}) == {"a": [1, 2], "b": {"3": None}, "c": str(object)}
    lines = format_trace({"b.x": "é", "a.y": 1}).splitlines()
    assert lines == ['a.y  1', 'b.x  "é"']
    assert format_trace({}) == ""


def test_graph_error_names_the_rule_and_its_nodes():
    error = GraphError("cycle", ["a", "b"], "the graph has a cycle through a, b")
    assert error.nodes == ("a", "b") and "cycle" in str(error)
