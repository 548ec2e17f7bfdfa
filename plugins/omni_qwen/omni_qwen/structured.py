"""Structured output as request parameters (no torch, no xgrammar): a JSON schema, any JSON object, a regex or
a list of choices. At most one per request; `Structure.of(params)` is the one constraint a request carries, with
the canonical key its compiled grammar is cached under (docs/qwen.md, "Structured output").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from omni_kernel.core.ar_scheduler import ARPrompt
from omni_kernel.core.errors import InvalidParameter

STRUCTURE_FIELDS = ("json_schema", "json_object", "regex", "choice")
MAX_SOURCE_CHARS = 100_000  # a schema or regex longer than this is refused: compiling it could take minutes


def json_schema(value: Any) -> str | None:
    """A JSON schema (a mapping, True, or its JSON text) as canonical JSON text, without spaces, so that equal
    schemas share one compiled grammar. Keys keep their order: the order of `properties` is the output's."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidParameter("json_schema", f"is not valid JSON ({exc})") from None
    if not isinstance(value, (Mapping, bool)):
        raise InvalidParameter("json_schema", f"must be a JSON object (a schema), not {type(value).__name__}")
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidParameter("json_schema", f"is not JSON ({exc})") from None
    return _bounded("json_schema", text)


def regex(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidParameter("regex", f"{value!r} is not a non-empty regular expression")
    return _bounded("regex", value)


def choice(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
    if not items or not all(isinstance(c, str) and c for c in items):
        raise InvalidParameter("choice", f"{value!r} is not a non-empty list of non-empty strings")
    _bounded("choice", "".join(items))
    return items


def _bounded(field: str, text: str) -> str:
    if len(text) > MAX_SOURCE_CHARS:
        raise InvalidParameter(field, f"is {len(text)} characters, more than the {MAX_SOURCE_CHARS} allowed")
    return text


@attrs.frozen
class Structure:
    """One request's output constraint: `kind` is a STRUCTURE_FIELDS name, `source` its canonical text (the
    schema's JSON, the regex, the choices as a JSON list; "" for json_object)."""

    kind: str
    source: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.source)

    @classmethod
    def of(cls, params: Any) -> Structure | None:
        """The constraint `params` asks for, None for none; InvalidParameter when it asks for more than one."""
        given = [f for f in STRUCTURE_FIELDS if getattr(params, f, None) not in (None, False)]
        if len(given) > 1:
            raise InvalidParameter(given[1], f"give one of {', '.join(STRUCTURE_FIELDS)}, not {' and '.join(given)}")
        if not given:
            return None
        kind, value = given[0], getattr(params, given[0])
        source = json.dumps(list(value)) if kind == "choice" else "" if kind == "json_object" else value
        return cls(kind, source)


@attrs.frozen
class PrefixedPrompt(ARPrompt):
    """The ARPrompt of a constrained request whose output text begins with its node's answer prefix (written for
    the model): its grammar covers the prefix too. Per request, since nodes with different prefixes may share an
    engine."""

    answer_prefix: str = ""
