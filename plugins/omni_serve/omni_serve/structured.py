"""Structured output on chat and completions: OpenAI's `response_format` and vLLM's `structured_outputs`, as the
AR node types' request parameters (`json_schema`, `json_object`, `regex`, `choice`; omni_qwen docs/qwen.md).

Only the shape is read here; whether xgrammar takes the schema or regex is checked by the stage at submit, before
any work, and refused as a 400 naming the parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .protocol import APIError

STRUCTURED_FIELDS = ("response_format", "structured_outputs")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# vLLM's structured_outputs keys omni takes, and the request parameter each becomes.
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "json_object": "json_object"}


def structured_params(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The request parameters that a body's `response_format` or `structured_outputs` asks for."""
    given = [f for f in STRUCTURED_FIELDS if extra.get(f) is not None]
    if len(given) > 1:
        raise APIError(400, "invalid structured_outputs: give response_format or structured_outputs, not both",
                       "structured_outputs")
    if not given:
        return {}
    if given[0] == "response_format":
        return _response_format(extra["response_format"])
    return _structured_outputs(extra["structured_outputs"])


def _response_format(value: Any) -> dict[str, Any]:
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind not in RESPONSE_FORMATS:
        raise APIError(400, f"invalid response_format: type {kind!r} is not one of {', '.join(RESPONSE_FORMATS)}",
                       "response_format.type", "invalid_value")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise APIError(400, "invalid response_format: json_schema must be an object with a name and a schema",
                       "response_format.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise APIError(400, "invalid response_format: json_schema.schema must be a JSON schema object",
                       "response_format.json_schema.schema")
    return {"json_schema": schema}  # `strict` or not, the output follows the schema exactly


def _structured_outputs(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise APIError(400, "invalid structured_outputs: must be an object", "structured_outputs")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(STRUCTURED_OUTPUTS))
    if unknown:
        raise APIError(400, f"invalid structured_outputs: {unknown[0]!r} is not supported; supported: "
                            f"{', '.join(sorted(STRUCTURED_OUTPUTS))}", f"structured_outputs.{unknown[0]}")
    if len(given) != 1:
        raise APIError(400, f"invalid structured_outputs: give exactly one of {', '.join(sorted(STRUCTURED_OUTPUTS))}",
                       "structured_outputs")
    (key, item), = given.items()
    return {STRUCTURED_OUTPUTS[key]: item}
