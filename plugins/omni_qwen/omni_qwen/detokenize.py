"""Incremental detokenization that only ever emits whole characters.

A byte-level BPE can split one character across tokens; decoding such a prefix ends in U+FFFD. New text is
released only when the decoded window ends cleanly, and is measured against a window that starts one emission
back, so tokenizers that drop a leading space at the start of a decode (SentencePiece) still diff correctly.
The released pieces concatenate to exactly `decode(all ids)`.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # start of the decode window
        self.read = 0  # ids up to here have been released as text

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text ("" while a character is still partial)."""
        self.ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """Release whatever is held back (a trailing partial character decodes as U+FFFD)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if not final and (len(after) <= len(before) or after.endswith(REPLACEMENT)):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]
