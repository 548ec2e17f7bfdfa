"""The prepare-stage cache: text embeddings and image conditioning, reused across requests in one process.

Keys name the model (directory and placement) and what the tensor depends on: the prompt, negative prompt
and whether guidance is on for text; the image's content hash and the target size for the image latent.
Entries are read-only tensors, evicted least-recently-used.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

MAX_ENTRIES = 32


class PrepareCache:
    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_compute(self, key: Hashable, compute: Callable[[], Any]) -> tuple[Any, bool]:
        """Return (value, hit)."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key], True
        value = compute()
        with self._lock:
            self._entries[key] = value
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return value, False

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def text_key(model_key: Hashable, prompt: str, negative_prompt: str, guidance: bool) -> tuple:
    return ("text", model_key, prompt, negative_prompt, guidance)


def image_key(model_key: Hashable, digest: str, height: int, width: int) -> tuple:
    return ("image", model_key, digest, height, width)

