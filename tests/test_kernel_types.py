"""Params validation, Request / StageInput / StageOutput / RequestResult, trace helpers, errors."""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_kernel.core.errors import GraphError, InvalidParameter, UserError, classify, rebuild
from omni_kernel.core.params import MAX_SEED, ARParams, option, options_of, parse, split
from omni_kernel.core.request import Request, RequestResult, StageOutput
from omni_kernel.core.trace import format_trace, jsonable, prefixed

AR_BAD = [("temperature", -0.1, "finite number >= 0"), ("temperature", "hot", "finite number >= 0"),
          ("temperature", float("nan"), "finite number"), ("temperature", float("inf"), "finite number"),
          ("top_p", 0, "> 0 <= 1"), ("top_p", 1.5, "> 0 <= 1"), ("top_p", -1, "> 0 <= 1"),
          ("top_k", 0, "use -1 for off"), ("top_k", -2, "integer >= -1"), ("top_k", 2.5, "integer >= -1"),
          ("seed", -1, f"between 0 and {MAX_SEED}"), ("seed", 2**70, f"between 0 and {MAX_SEED}"),
          ("seed", 1.5, "an integer"), ("seed", True, "an integer"),
          ("max_tokens", 0, "an integer >= 1"), ("max_tokens", "10", "an integer >= 1"),
          ("stop", ("",), "non-empty strings"), ("stop", (3,), "non-empty strings"),
          ("stream", "yes", "True or False"), ("ignore_eos", 1, "True or False")]


@pytest.mark.parametrize("field, value, allowed", AR_BAD)
def test_ar_params_refuse_each_bad_field_naming_it_and_its_range(field, value, allowed):
    with pytest.raises(InvalidParameter) as info:
        ARParams(**{field: value})
    assert info.value.field == field
    assert str(info.value).startswith(f"invalid {field}: ") and allowed in str(info.value)
    assert isinstance(info.value, UserError)


def test_defaults_and_good_values():
    ar = ARParams()
    assert ar.greedy and (ar.top_p, ar.top_k, ar.seed, ar.stop, ar.max_tokens) == (1.0, -1, None, (), None)
    sampled = ARParams(temperature=0.7, top_p=0.9, top_k=40, seed=MAX_SEED, stop=["\n\n"], max_tokens=1)
    assert not sampled.greedy and sampled.stop == ("\n\n",) and ARParams(stop="x").stop == ("x",)


@attrs.frozen
class Knobs:
    size: int = option(1, help="a size", type=int)
    name: str = option("a", help="a name")


@attrs.frozen
class Other:
    size: int = option(2, help="the same key elsewhere", type=int)
    loud: bool = option(False, help="a flag", type=bool)


def test_split_routes_each_key_to_every_node_that_declares_it_and_refuses_the_rest():
    got = split("p", "request parameter", {"a": Knobs, "b": Other, "c": None}, {"size": 5, "loud": True,
                                                                              "name": None})
    assert got == {"a": Knobs(size=5), "b": Other(size=5, loud=True), "c": None}
    with pytest.raises(InvalidParameter) as info:
        split("p", "request parameter", {"a": Knobs, "b": Other}, {"sise": 5})
    assert info.value.field == "sise"
    assert str(info.value) == ("invalid sise: pipeline 'p' has no request parameter 'sise'; valid request "
                               "parameters: loud, name, size")


def test_text_values_parse_to_the_declared_type():
    size, loud = attrs.fields_dict(Knobs)["size"].metadata["omni"], attrs.fields_dict(Other)["loud"].metadata["omni"]
    assert parse("size", size, "12") == 12 and parse("loud", loud, "Yes") is True and parse("loud", loud, "0") is False
    for info, text in ((size, "1.5"), (loud, "maybe")):
        with pytest.raises(InvalidParameter, match="is not a valid"):
            parse("x", info, text)


def test_an_option_records_the_range_its_validator_allows():
    info = options_of(ARParams)
    assert (info["top_k"].minimum, info["top_k"].maximum) == (-1, None)
    assert (info["seed"].minimum, info["seed"].maximum) == (0, MAX_SEED)
    assert (info["top_p"].minimum, info["top_p"].maximum, info["top_p"].above) == (None, 1, 0)
    assert (info["stop"].minimum, info["stop"].maximum, info["stop"].above) == (None, None, None)


def test_failures_keep_their_type_across_the_event_boundary():
    for exc in (InvalidParameter("steps", "too many"), GraphError("cycle", ["a"], "loop"), RuntimeError("x y")):
        kind, message, field = classify(exc)
        back = rebuild(kind, message, field)
        assert isinstance(back, UserError) == isinstance(exc, UserError) and str(back) == message
    assert rebuild(*classify(InvalidParameter("steps", "too many"))).field == "steps"
    assert rebuild(*classify(InvalidParameter("image", "needs one"))).named("--image") == "invalid --image: needs one"
    assert classify(RuntimeError("x\n y")) == ("runtime", "RuntimeError: x y", None)


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
    a, b = Request("echo", "hi"), Request("echo", "hi", params={"max_tokens": 2})
    assert a.request_id != b.request_id and len(a.request_id) == 16 and a.arrival_time > 0
    assert (a.image, dict(a.params), dict(b.params)) == (None, {}, {"max_tokens": 2})
    with pytest.raises(InvalidParameter, match="prompt"):
        Request("echo", None)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="prompt"):
        Request("echo", b"bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="not valid UTF-8"):
        Request("echo", "bad \udcff byte")


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


def test_typed_fields_a_stage_output_and_a_token_delta_carry():
    """What plugins hand each other through the kernel (usage, a constraint, a video's shape, logprobs) are typed
    fields of its values, not trace keys: each is absent (None) unless a stage fills it."""
    from omni_kernel.core.events import TokenDelta
    from omni_kernel.core.request import VIDEO, Structured, Usage, VideoInfo

    bare = StageOutput("r", "n", text="x")
    assert (bare.usage, bare.structured) == (None, None)
    out = StageOutput("r", "n", text="x", usage=Usage(input_tokens=3, output_tokens=2, cached_tokens=1),
                      structured=Structured("json_schema", 1.5),
                      data={VIDEO: VideoInfo(width=96, height=64, num_frames=9, fps=24)})
    assert (out.usage.input_tokens, out.usage.output_tokens, out.usage.cached_tokens) == (3, 2, 1)
    assert out.usage.audio_seconds is None and out.structured.kind == "json_schema"
    assert out.data[VIDEO].seconds == 9 / 24
    assert (TokenDelta("r", "n", "a").logprobs, TokenDelta("r", "n", "a").prompt_logprobs) == (None, None)
    entry = {"token_id": 5, "token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    assert TokenDelta("r", "n", "a", logprobs=(entry,)).logprobs == (entry,)


def test_the_echo_stage_reports_its_usage():
    from omni_kernel import Omni

    result = Omni("echo").generate("one two three", max_tokens=2)
    assert (result.output.usage.input_tokens, result.output.usage.output_tokens) == (3, 2)
    assert (result.trace["ar.input_tokens"], result.trace["ar.output_tokens"]) == (3, 2)  # the trace is unchanged
