"""Reading the AR stage's supplemental guidance: JSON in, one guidance string or a fallback reason out.

Whatever the model wrote, `parse_guidance` returns; it never raises. The rules are in docs/bridge.md.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterator
from typing import Any

import attrs

from omni_kernel import TRUNCATED_STOP_REASONS

# The guidance contract is this plugin's alone: its name, its field, its schema and the answer prefix. The pipelines
# hand the AR node what it needs of it through the node policy (pipeline.py), so a renamed field changes them all.
CONTRACT = "supplemental_guidance"  # the AR node's output contract (its policy's output_contract)
GUIDANCE_FIELD = "guidance"
# The start of the AR node's answer, written for the model: the object opened at the guidance string, so the model
# writes the guidance and closes the object (`{"guidance": "`).
ANSWER_PREFIX = "{" + json.dumps(GUIDANCE_FIELD) + ': "'

# The contract as a JSON schema: the pipelines' bridge node is constrained to it (grammar-constrained decoding,
# docs/bridge.md). maxLength keeps the guidance inside the node's token budget (GUIDANCE_MAX_TOKENS): a token of
# ASCII text is at least one character, so 180 characters and the closing `"}` always fit and the object is never
# cut; two short sentences are 100-180 characters (at 120, a third of SmolLM2's answers were cut mid-word).
GUIDANCE_MAX_CHARS = 180
GUIDANCE_MAX_TOKENS = 192
GUIDANCE_SCHEMA = {"type": "object", "properties": {GUIDANCE_FIELD: {"type": "string", "minLength": 1,
                                                                      "maxLength": GUIDANCE_MAX_CHARS}},
                   "required": [GUIDANCE_FIELD], "additionalProperties": False}

# The narrated pipelines extend the contract with a second required field, the narration the voice speaks: the same
# answer prefix opens the guidance, the model then writes `", "narration": "` and the narration (grammar-constrained
# to this schema). Bounded as the guidance is, so the budget always fits both: one token per character at least,
# plus the separator between them.
NARRATION_FIELD = "narration"
NARRATION_MAX_CHARS = 200  # two or three short spoken sentences: about ten to fifteen seconds of speech
_SEPARATOR_CHARS = len('", ' + json.dumps(NARRATION_FIELD) + ': "')
NARRATED_MAX_TOKENS = GUIDANCE_MAX_TOKENS + _SEPARATOR_CHARS + NARRATION_MAX_CHARS
NARRATED_SCHEMA = {"type": "object",
                   "properties": {GUIDANCE_FIELD: GUIDANCE_SCHEMA["properties"][GUIDANCE_FIELD],
                                  NARRATION_FIELD: {"type": "string", "minLength": 1,
                                                    "maxLength": NARRATION_MAX_CHARS}},
                   "required": [GUIDANCE_FIELD, NARRATION_FIELD], "additionalProperties": False}

# The closed set of reasons a bridge falls back to the user's prompt alone, in the order they are checked.
FALLBACK_REASONS = ("contract_mismatch", "empty", "truncated", "invalid_json", "missing_fields")

# A model can write many braces; each start is one raw_decode, so the scan stays linear-ish on junk.
_MAX_OBJECT_STARTS = 64
# strict=False: models put raw newlines and tabs inside JSON strings.
_decoder = json.JSONDecoder(strict=False)


@attrs.frozen
class Guidance:
    """The outcome of reading one AR output: `text` on success, `reason` (one of FALLBACK_REASONS) otherwise."""

    text: str | None = None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None


def parse_guidance(text: Any, stop_reason: Any = None, contract: Any = None,
                   field: str = GUIDANCE_FIELD, extra_fields: tuple[str, ...] = ()) -> Guidance:
    """Find one JSON object with a non-empty string `field` in the AR text, tolerating fences and prose."""
    if contract is not None and contract != CONTRACT:
        return Guidance(reason="contract_mismatch")
    if not isinstance(text, str) or not text.strip():
        return Guidance(reason="empty")
    if isinstance(stop_reason, str) and stop_reason in TRUNCATED_STOP_REASONS:  # cut off: its text is never trusted
        return Guidance(reason="truncated")
    found_json = False
    for value in _json_values(text):
        found_json = True
        guidance = _read_object(value, field, extra_fields) if isinstance(value, dict) else None
        if guidance:
            return Guidance(text=guidance)
    return Guidance(reason="missing_fields" if found_json else "invalid_json")


def clean(value: str) -> str:
    """One line of printable text: control characters and lone surrogates out, whitespace collapsed."""
    kept = "".join(" " if unicodedata.category(c) in ("Cc", "Cs") else c for c in value)
    return " ".join(kept.split())


def _read_object(obj: dict, field: str, extra_fields: tuple[str, ...]) -> str | None:
    main = obj.get(field)
    if not isinstance(main, str) or not clean(main):
        return None
    parts = [clean(main)]
    for name in extra_fields:
        value = obj.get(name)
        if isinstance(value, str) and clean(value):
            parts.append(f"{name}: {clean(value)}")
    return "; ".join(parts)


def _json_values(text: str) -> Iterator[Any]:
    """The whole text as JSON if it is JSON; then every outermost object found in it, first to last."""
    try:
        yield _decoder.decode(text)
    except (ValueError, RecursionError):
        pass
    start, tries = text.find("{"), 0
    while start != -1 and tries < _MAX_OBJECT_STARTS:
        tries += 1
        try:
            value, end = _decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            start = text.find("{", start + 1)
            continue
        yield value
        start = text.find("{", end)
