"""The prepare-stage cache: text embeddings and image conditioning, reused across requests in one process.

Keys name the model (directory and device) and what the value depends on: the text for an encoded prompt or
negative prompt (so every request with Wan's default negative prompt shares one), the image's content hash and
the target size for the image latent. Entries are read-only, evicted least-recently-used beyond `max_entries`
or `max_bytes` (an encoded text holds every block's cross-attention keys and values: ~190 MB for the 5B model).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

MAX_ENTRIES = 32
MAX_BYTES = 2 << 30


def nbytes(value: Any) -> int:
    return getattr(value, "nbytes", 0)  # tensors, arrays and omni_wan.model.Text have it


class PrepareCache:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get_or_compute(self, key: Hashable, compute: Callable[[], Any]) -> tuple[Any, bool]:
        """Return (value, hit)."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key], True
        value = compute()
        self.put(key, value)
        return value, False

    def contains(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            if key not in self._entries:
                self._entries[key] = value
                self._bytes += nbytes(value)
            while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
                self._bytes -= nbytes(self._entries.popitem(last=False)[1])

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


def text_key(model_key: Hashable, text: str) -> tuple:
    return ("text", model_key, text)


def image_key(model_key: Hashable, digest: str, height: int, width: int) -> tuple:
    return ("image", model_key, digest, height, width)

