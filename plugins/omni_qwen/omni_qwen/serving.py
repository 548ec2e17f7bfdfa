"""Serving settings of an AR stage's engine, read from the run's config keys (docs/qwen.md, "Serving engine").

    ar_kv_backend               "paged" (default) | "dynamic_cache"
    ar_kv_memory                KV budget in bytes (int) or text like "256MiB", "2GB"; default: room for
                                max(context window, DEFAULT_KV_TOKENS) tokens
    ar_max_num_seqs             sequences in one engine step (default: node policy max_num_seqs, else 64)
    ar_max_num_batched_tokens   tokens in one engine step (default 512); longer prompts are prefilled in chunks
    ar_prefix_caching           reuse the K/V of shared prompt prefixes (default True; paged backend only)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

from omni_kernel.errors import InvalidParameter

KV_BACKENDS = ("paged", "dynamic_cache")
DEFAULT_KV_TOKENS = 32768
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
BLOCK_SIZE = 16
UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
         "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_bytes(value: Any, field: str = "ar_kv_memory") -> int:
    """An int of bytes, or text: a number and an optional unit (B, KB, KiB, MB, MiB, GB, GiB; case-insensitive)."""
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        if match and match.group(2).lower() in UNITS:
            number = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if number is None or number < 1:
        raise InvalidParameter(field, f"{value!r} is not a positive size in bytes (e.g. 268435456 or \"256MiB\")")
    return number


def _positive_int(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidParameter(key, f"{value!r} is not an integer >= 1")
    return value


@attrs.frozen
class ServingConfig:
    kv_backend: str | None = None  # None: paged when the model supports it, else dynamic_cache
    kv_memory: int | None = None  # bytes; None: room for max(context window, DEFAULT_KV_TOKENS) tokens
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    prefix_caching: bool = True
    block_size: int = BLOCK_SIZE

    @classmethod
    def from_config(cls, config: Mapping[str, Any], policy_max_num_seqs: int | None = None) -> ServingConfig:
        backend = config.get("ar_kv_backend")
        if backend is not None and backend not in KV_BACKENDS:
            raise InvalidParameter("ar_kv_backend", f"{backend!r} is not one of {', '.join(KV_BACKENDS)}")
        memory = config.get("ar_kv_memory")
        caching = config.get("ar_prefix_caching", True)
        if not isinstance(caching, bool):
            raise InvalidParameter("ar_prefix_caching", f"{caching!r} is not True or False")
        return cls(kv_backend=backend, kv_memory=None if memory is None else parse_bytes(memory),
                   max_num_seqs=_positive_int(config, "ar_max_num_seqs", policy_max_num_seqs or DEFAULT_MAX_NUM_SEQS),
                   max_num_batched_tokens=_positive_int(config, "ar_max_num_batched_tokens",
                                                        DEFAULT_MAX_NUM_BATCHED_TOKENS),
                   prefix_caching=caching)

    def memory_for(self, bytes_per_token: int, context_window: int) -> int:
        return self.kv_memory or bytes_per_token * max(context_window, DEFAULT_KV_TOKENS)


def kv_bytes_per_token(config, element_size: int) -> int:
    """K and V of one token across all layers of a transformers decoder config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return text.num_hidden_layers * 2 * kv_heads * head_dim * element_size
