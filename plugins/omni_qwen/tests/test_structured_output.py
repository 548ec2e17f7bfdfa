"""Structured output on the tiny random-weight model: whatever a random model prefers, every constrained output
is complete JSON valid under its schema (alone, and batched with unconstrained requests, greedy or seeded), and
the unconstrained rows of a mixed batch are token for token their solo runs. Plus regex, choice, json_object,
the grammar cache, and the refusals at submit."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_kernel import InvalidParameter, Omni, RequestFailed, RequestFinished

BUDGET = 160  # tokens: more than any bounded schema below needs (a byte-level token may be 1/4 of a character)
FREE = [("Describe a school", {"max_tokens": 12}),
        ("学校 and a river", {"max_tokens": 9, "temperature": 0.9, "seed": 7})]

names = st.sampled_from(["a", "b", "name", "n", "tags", "ok"])
small_int = st.integers(-50, 50)
leaves = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span}, small_int, st.integers(0, 99)),
    st.builds(lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span}, small_int, st.integers(1, 9)),
    st.just({"type": "boolean"}),
    st.lists(st.one_of(st.text("abcxyz", min_size=1, max_size=4), small_int), min_size=1, max_size=4,
             unique=True).map(lambda values: {"enum": values}),
)


def _object(props: dict, data) -> dict:
    return {"type": "object", "properties": props, "required": sorted(k for k in props if data(k)),
            "additionalProperties": False}


schemas = st.recursive(leaves, lambda inner: st.one_of(
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 3)),
    st.builds(lambda props, keep: _object(props, lambda k: keep % (len(k) + 1) != 0),
              st.dictionaries(names, inner, min_size=1, max_size=3), st.integers(0, 5))), max_leaves=4)


@pytest.fixture(scope="module")
def omni(tiny_ckpt, host):
    return Omni("ar_text", host=host, ar_model=str(tiny_ckpt), ar_device="cpu")


@pytest.fixture(scope="module")
def solo(omni):
    return [omni.generate(prompt, **params).output.data["token_ids"] for prompt, params in FREE]


def run_together(omni, requests):
    reqs = [omni.request(prompt, **params) for prompt, params in requests]
    for r in reqs:
        omni.submit(r)
    results = {}
    while omni.has_unfinished():
        for event in omni.step():
            assert not isinstance(event, RequestFailed), event
            if isinstance(event, RequestFinished):
                results[event.request_id] = event.result
    return [results[r.request_id] for r in reqs]


def assert_valid(result, schema) -> None:
    assert result.trace["ar.stop_reason"] in ("stop", "eos"), (schema, result.text)
    assert result.trace["ar.structured_output"] == "json_schema"
    jsonschema.validate(json.loads(result.text), schema)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, prompt=st.sampled_from(["Describe a school", "x", "图书馆 café"]))
def test_every_constrained_output_validates_alone_and_in_a_mixed_batch(omni, solo, schema, prompt):
    constrained = {"json_schema": schema, "max_tokens": BUDGET}
    assert_valid(omni.generate(prompt, **constrained), schema)
    batch = [(prompt, constrained), *FREE, (prompt, {**constrained, "temperature": 1.0, "seed": 11})]
    results = run_together(omni, batch)
    assert_valid(results[0], schema)
    assert_valid(results[3], schema)
    assert [r.output.data["token_ids"] for r in results[1:3]] == solo
    assert results[1].trace["ar.structured_output"] is None


def test_regex_choice_and_json_object(omni):
    out = omni.generate("x", regex=r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)", max_tokens=BUDGET)
    assert out.trace["ar.stop_reason"] == "stop" and out.trace["ar.structured_output"] == "regex"
    assert re.fullmatch(r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)", out.text)
    out = omni.generate("x", choice=["yes", "no", "a.b (c)"], temperature=1.0, seed=3)
    assert out.text in ("yes", "no", "a.b (c)") and out.trace["ar.stop_reason"] == "stop"
    # Any JSON object has unbounded strings, which a random model may never close: those end at max_tokens.
    outs = [omni.generate(p, json_object=True, max_tokens=48, temperature=1.0, seed=s)
            for s, p in enumerate(["x", "Describe a school", "y", "z"])]
    whole = [o for o in outs if o.trace["ar.stop_reason"] != "max_tokens"]
    assert whole and all(isinstance(json.loads(o.text), dict) for o in whole)
    assert all(o.text.startswith("{") for o in outs)


def test_one_compile_per_distinct_schema(omni):
    schema = {"type": "object", "properties": {"only_here": {"type": "boolean"}}, "required": ["only_here"]}
    first, second = run_together(omni, [("a", {"json_schema": schema}), ("b", {"json_schema": json.dumps(schema)})])
    assert first.trace["ar.grammar_compile_ms"] > 0 and second.trace["ar.grammar_compile_ms"] is None
    assert omni.generate("c", json_schema=schema).trace["ar.grammar_compile_ms"] is None


@pytest.mark.parametrize("params, message", [
    ({"json_schema": {"type": "frobnicate"}}, 'invalid json_schema: is not supported: Unsupported type "frobnicate"'),
    ({"json_schema": "{not json"}, "invalid json_schema: is not valid JSON"),
    ({"json_schema": [1, 2]}, "invalid json_schema: must be a JSON object (a schema), not list"),
    ({"json_schema": {"type": "string", "minLength": 5, "maxLength": 2}}, "minLength 5 is greater than maxLength 2"),
    ({"regex": "(unclosed"}, "invalid regex: is not supported: Regex parsing error"),
    ({"choice": []}, "invalid choice: [] is not a non-empty list"),
    ({"regex": "a", "choice": ["b"]}, "give one of json_schema, json_object, regex, choice, not regex and choice"),
])
def test_a_bad_structure_is_refused_at_submit(omni, params, message):
    with pytest.raises(InvalidParameter) as caught:
        omni.submit(omni.request("x", **params))
    assert message in str(caught.value)
    assert not omni.has_unfinished()


def cli(*args):
    from click.testing import CliRunner

    from omni_kernel.cli import main

    return CliRunner().invoke(main, ["run", "--pipeline", "ar_text", "-c", "ar_device=cpu", *args])


def test_cli_takes_the_same_parameters(tiny_ckpt, tmp_path):
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    result = cli("--ar-model", str(tiny_ckpt), "--prompt", "x", "-o", f"json_schema={schema}", "--trace-json",
                 str(tmp_path / "t.json"))
    assert result.exit_code == 0, result.output
    assert isinstance(json.loads(result.stdout)["ok"], bool)
    trace = json.loads((tmp_path / "t.json").read_text())
    assert trace["ar.stop_reason"] == "stop" and trace["ar.structured_output"] == "json_schema"
    result = cli("--ar-model", str(tiny_ckpt), "--prompt", "x", "-o", "choice=red", "-o", "choice=green")
    assert result.exit_code == 0 and result.stdout.strip() in ("red", "green"), result.output


@pytest.mark.parametrize("option, message", [
    ('json_schema={"type": "nope"}', 'invalid json_schema: is not supported: Unsupported type "nope"'),
    ("regex=[a-", "invalid regex: is not supported"),
    ("json_object=maybe", "invalid json_object"),
])
def test_cli_bad_structure_is_exit_2_in_one_line(tiny_ckpt, option, message):
    result = cli("--ar-model", str(tiny_ckpt), "--prompt", "x", "-o", option)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_a_compiling_grammar_holds_back_only_its_own_request(omni):
    """While a grammar compiles, its request waits unscheduled and the others decode to the end; then it runs."""
    import threading

    engine = omni.graph.stages["generate"].engine
    grammars, release = engine.scheduler.grammars, threading.Event()
    compile_ = grammars._compile

    def slow(structure, entry):
        assert release.wait(60)
        return compile_(structure, entry)

    grammars._compile = slow
    try:
        schema = {"type": "object", "properties": {"held_back": {"enum": [1, 2]}}, "required": ["held_back"]}
        held, free = omni.request("x", json_schema=schema), omni.request("Describe a school", max_tokens=5)
        omni.submit(held)
        omni.submit(free)
        finished = set()
        while free.request_id not in finished:
            finished |= {e.request_id for e in omni.step() if isinstance(e, RequestFinished)}
        assert held.request_id not in finished
        assert [s.request_id for s in engine.scheduler.waiting] == [held.request_id] and not engine.scheduler.running
        assert engine.scheduler.wait(0.05)  # blocks on the compile (timing out here), never spins
    finally:
        release.set()
        grammars._compile = compile_
    results = {}
    while omni.has_unfinished():
        results |= {e.request_id: e.result for e in omni.step() if isinstance(e, RequestFinished)}
    assert json.loads(results[held.request_id].text)["held_back"] in (1, 2)


def test_ids_past_the_tokenizer_are_never_allowed(qwen_tokenizer):
    """The logits may be wider than the tokenizer (the demo model: 1024 logits, 1003 tokens): xgrammar's
    vocabulary is the logits' width and the ids no token stands for stay masked."""
    import torch

    from omni_kernel import Request, StageInput
    from omni_kernel.core.ar_scheduler import ARPrompt
    from omni_qwen.config import QwenParams
    from omni_qwen.grammar import Grammars

    width = len(qwen_tokenizer) + 21
    grammars = Grammars.for_tokenizer(qwen_tokenizer, width, [qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")])
    item = StageInput(Request("p", "x").request_id, "x", params=QwenParams(json_object=True),
                      processed=ARPrompt([1]))
    constrained = grammars.constrain(item)
    constrained.compile.future.result(60)
    logits, failed = grammars.mask([constrained, None], torch.zeros(2, width))
    assert not failed and torch.isinf(logits[0, len(qwen_tokenizer):]).all()
    assert torch.isfinite(logits[0]).sum() >= 1 and (logits[1] == 0).all()  # the unconstrained row untouched
    assert constrained.matcher is not None and grammars.constrain(StageInput("free", "x")) is None


@pytest.mark.parametrize(("schema", "real"), [({"type": "string", "maxLength": 4}, '"é上😀"'),
                                             ({"type": "string"}, '"é上😀"'),
                                             ({"type": "string", "maxLength": 1}, '"上"')])
def test_strings_hold_only_utf8_and_no_control_characters(schema, real):
    """xgrammar alone accepts the UTF-8 encoding of a surrogate (ED AD A9: not UTF-8; it decodes to three U+FFFD,
    so a maxLength string came out too long: a hypothesis example above found it) and, in a bounded string, raw
    control characters (maxLength 1, where xgrammar inlines the character class into the property's rule, was
    another hypothesis example); omni's grammars refuse both, bounded or not, and keep every real character."""
    import xgrammar as xgr

    from omni_qwen.grammar import grammar_of
    from omni_qwen.structured import Structure

    grammar = grammar_of(Structure("json_schema", json.dumps(schema)))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar)

    def accepts(text: bytes) -> bool:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return matcher.accept_string(text) and matcher.is_terminated()

    assert accepts(real.encode())
    assert not accepts(b'"\xed\xad\xa9"')
    assert not accepts(b'"\x01"')


def test_real_weights_write_valid_json(smollm2_dir, host):
    """SmolLM2-135M-Instruct asked for a record, constrained to its schema, greedy and seeded."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "population": {"type": "integer", "minimum": 0},
                                               "country": {"type": "string", "maxLength": 40}},
              "required": ["city", "population", "country"], "additionalProperties": False}
    omni = Omni("ar_text", host=host, ar_model=str(smollm2_dir), ar_device="cpu", ar_dtype="fp32")
    for params in ({}, {"temperature": 0.8, "seed": 5}):
        out = omni.generate("Give me a JSON record of the largest city in France.", json_schema=schema,
                            max_tokens=96, **params)
        assert out.trace["ar.stop_reason"] == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
