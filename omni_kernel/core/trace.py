"""Trace: a flat dict of `stage.field` keys carried by every finished request."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def prefixed(prefix: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """Turn {"ttft_ms": 3} into {"ar.ttft_ms": 3}."""
    return {f"{prefix}.{key}": value for key, value in fields.items()}


def jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return str(value)


def format_trace(trace: Mapping[str, Any]) -> str:
    width = max((len(k) for k in trace), default=0)
    return "\n".join(f"{key.ljust(width)}  {json.dumps(jsonable(value), ensure_ascii=False)}"
                     for key, value in sorted(trace.items()))
