"""Structured output through a real `omni serve` (ar_text on the tiny demo model): OpenAI's response_format
(json_object, json_schema) on chat and completions, vLLM's structured_outputs (json, regex, choice), streamed
or not, the 400 on a bad schema before any work, and the metrics."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from serving import ServerProcess

pytestmark = [pytest.mark.server]

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                    "maxItems": 2}},
          "required": ["colour", "count", "tags"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
CHAT = [{"role": "user", "content": "Pick a colour."}]


@pytest.fixture(scope="module")
def server(omni_cache, tmp_path_factory):
    proc = ServerProcess(["--pipeline", "ar_text", "--shutdown-timeout", "5"],
                         tmp_path_factory.mktemp("serve") / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        assert proc.stop() == 0, proc.output()


def test_chat_json_schema_with_the_openai_client(client):
    out = client.chat.completions.create(model="ar_text", messages=CHAT, max_tokens=200,
                                         response_format=RESPONSE_FORMAT)
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    assert out.choices[0].finish_reason == "stop"


def test_chat_stream_is_the_same_text(client):
    out = client.chat.completions.create(model="ar_text", messages=CHAT, max_tokens=200,
                                         response_format=RESPONSE_FORMAT)
    chunks = client.chat.completions.create(model="ar_text", messages=CHAT, max_tokens=200, stream=True,
                                            response_format=RESPONSE_FORMAT)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content


def test_completions_take_response_format_and_structured_outputs(http):
    body = {"model": "ar_text", "prompt": ["a", "b"], "max_tokens": 200, "response_format": RESPONSE_FORMAT}
    answer = http.post("/v1/completions", json=body).json()
    for choice in answer["choices"]:
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)
    body = {"model": "ar_text", "prompt": "x", "structured_outputs": {"regex": "[a-z]{2,4}-[0-9]{2}"}}
    assert re.fullmatch("[a-z]{2,4}-[0-9]{2}", http.post("/v1/completions", json=body).json()["choices"][0]["text"])
    body = {"model": "ar_text", "messages": CHAT, "structured_outputs": {"choice": ["yes", "no"]}}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["content"] in ("yes", "no") and choice["finish_reason"] == "stop"
    body = {"model": "ar_text", "messages": CHAT, "max_tokens": 200, "structured_outputs": {"json": SCHEMA}}
    content = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), SCHEMA)


def test_json_object(http):
    body = {"model": "ar_text", "messages": CHAT, "max_tokens": 32, "response_format": {"type": "json_object"},
            "temperature": 1.0, "seed": 1}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["content"].startswith("{")
    if choice["finish_reason"] == "stop":  # a random model may not close a string within 32 tokens
        assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("extra, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "json_schema", 'Unsupported type "nope"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                        "pattern": "(a"}}}},
     "json_schema", "Regex parsing error"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "is not one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "json_schema.schema must be a JSON schema object"),
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar",
     "'grammar' is not supported; supported: choice, json, json_object, regex"),
    ({"structured_outputs": {"regex": "(", "choice": ["a"]}}, "structured_outputs", "give exactly one of"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "regex", "Regex parsing error"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_bad_structure_is_400_naming_it(http, route, extra, param, message):
    body = {"model": "ar_text", **({"messages": CHAT} if "chat" in route else {"prompt": "x"}), **extra}
    answer = http.post(route, json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_metrics_count_constrained_requests_and_compiles(http):
    body = {"model": "ar_text", "messages": CHAT, "structured_outputs": {"choice": ["metrics-only"]}}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    text = http.get("/metrics").text
    assert re.search(r'omni_structured_requests_total\{kind="choice",model="ar_text"\} [1-9]', text), text
    assert re.search(r'omni_grammar_compile_seconds_count\{model="ar_text"\} [1-9]', text)
