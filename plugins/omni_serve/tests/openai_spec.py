"""OpenAI's published API description (the vendored subset, openapi/), checked and made ready for validation.

`load()` reads `openapi/openai-subset.json`, checks its sha256 against `openapi/SHA256SUMS` and the pinned source
it names, and returns the document with the few narrow patches below (each says why). `validate(name, value)`
checks one response body against `#/components/schemas/NAME` with jsonschema (draft 2020-12, `$ref`s resolved
inside the document)."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from pathlib import Path

import jsonschema

HERE = Path(__file__).resolve().parent / "openapi"
SUBSET = HERE / "openai-subset.json"
SOURCE_COMMIT = "f85dbe223d40e1a31cba812ab2d755c7e98a92a3"
SOURCE_SHA256 = "bbfd19abcde0e7412da99378deb2a959ccdd3a812f97c9e35901921e8e973f9a"
# The schema of one streamed /v1/completions chunk: the document describes only the whole response (below).
COMPLETION_CHUNK = "OmniCompletionStreamChunk"


def _sums() -> dict[str, str]:
    return {line.split()[1]: line.split()[0] for line in (HERE / "SHA256SUMS").read_text().splitlines() if line}


def raw() -> dict:
    """The vendored subset, unchanged, after checking it is what extract.py made of the pinned document."""
    data = SUBSET.read_bytes()
    sums = _sums()
    assert sums["openapi.json"] == SOURCE_SHA256, "SHA256SUMS names another source document"
    assert hashlib.sha256(data).hexdigest() == sums["openai-subset.json"], \
        "openai-subset.json was edited: regenerate it with plugins/omni_serve/tests/openapi/extract.py"
    doc = json.loads(data)
    source = doc["x-omni-source"]
    assert (source["commit"], source["sha256"]) == (SOURCE_COMMIT, SOURCE_SHA256), source
    return doc


def _nullable(node):
    """The document is OpenAPI 3.1 but still marks some schemas with 3.0's `nullable: true`, which JSON Schema
    ignores (the OpenAI SDKs read it as "or null"): turn each into `anyOf [schema, null]`."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


@functools.cache
def load() -> dict:
    doc = _nullable(raw())
    schemas = doc["components"]["schemas"]
    # Inherent differences (docs/serving.md, "Where omni differs from the OpenAI API"), excluded narrowly:
    # video sizes are Sora's four resolutions and durations Sora's 4/8/12 s; omni renders any WxH its model
    # takes and any length, so both are a WxH string / a string here.
    schemas["VideoSize"] = {"type": "string", "pattern": r"^[0-9]+x[0-9]+$"}
    schemas["VideoSeconds"] = {"type": "string"}
    # A streamed completion is a sequence of CreateCompletionResponse objects (the document's own words), but
    # every chunk before the last has `finish_reason: null`, as OpenAI's API sends it; the schema of the
    # whole response does not allow null there.
    # With `echo`, the prompt's first token has no logprob: OpenAI's API (and vLLM) send null for it in
    # `token_logprobs` and `top_logprobs`, which the document's item schemas leave out.
    logprobs = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]["logprobs"]
    for key in ("token_logprobs", "top_logprobs"):
        field = logprobs["anyOf"][0]["properties"][key]
        field["items"] = {"anyOf": [field["items"], {"type": "null"}]}
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    finish = chunk["properties"]["choices"]["items"]["properties"]
    finish["finish_reason"] = {"anyOf": [finish["finish_reason"], {"type": "null"}]}
    schemas[COMPLETION_CHUNK] = chunk
    return doc


@functools.cache
def validator(name: str) -> jsonschema.protocols.Validator:
    doc = load()
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$ref": f"#/components/schemas/{name}",
              "components": doc["components"]}
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def validate(name: str, value) -> None:
    """AssertionError naming every place `value` breaks `#/components/schemas/NAME`."""
    errors = sorted(validator(name).iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}" for e in errors[:10]]
        raise AssertionError(f"not a valid {name}:\n  " + "\n  ".join(lines) + f"\n{json.dumps(value)[:2000]}")


def response_schema(path: str, method: str, status: int = 200) -> str | None:
    """The component name of an operation's JSON answer (e.g. ("/models/{model}", "get") -> "Model")."""
    op = load()["paths"][path][method]
    content = op["responses"].get(str(status), {}).get("content", {}).get("application/json", {})
    ref = content.get("schema", {}).get("$ref", "")
    return ref.rsplit("/", 1)[1] if ref else None
