"""The `text_to_speech` connector: an AR stage's answer into the voice, whole (`convert`) or, on a streaming edge,
piece by piece while it is written (`splitter`), so the voice speaks the first sentence while the rest is generated.

Where a piece ends (SentenceSplitter; docs/spoken-answers.md):

- after a sentence's end: `.`, `!`, `?` or `…` (with any closing quotes or brackets) followed by white space, or
  after a line break;
- the first piece sooner: after its first clause end (`,`, `;` or `:` followed by white space) once it holds
  FIRST_MIN_CHARS characters, so the first audio comes after a short synthesis;
- a piece with neither is cut after its last space once it holds MAX_CHARS characters (a long run-on sentence
  still streams);
- what is left when the AR stage finishes is the last piece.

A cut waits for the white space after the mark, so "3.5" is never cut; a piece is never blank (white space goes
with the piece after it); the pieces joined are the answer's text. Each piece's text goes to the voice, which
splits it into its own chunks (tts_voice.Voice.chunks).
"""

from __future__ import annotations

import re

import attrs

from omni_kernel.core.events import TokenDelta
from omni_kernel.core.request import Piece, Request, StageInput, StageOutput

_CLOSERS = "\"'\u201d\u2019)\\]"
SENTENCE_END = re.compile(rf"[.!?\u2026]+[{_CLOSERS}]*(?=\s)|\n")
CLAUSE_END = re.compile(rf"[,;:]+[{_CLOSERS}]*(?=\s)")
FIRST_MIN_CHARS = 20
MAX_CHARS = 300


class SentenceSplitter:
    """One request's pieces of an answer, cut as the module says."""

    def __init__(self):
        self.buffer = ""
        self.first = True

    def feed(self, event) -> list[Piece]:
        if not isinstance(event, TokenDelta):
            return []
        self.buffer += event.text
        pieces = []
        cut = self._cut()
        while cut is not None:
            pieces.append(Piece(self.buffer[:cut]))
            self.buffer = self.buffer[cut:]
            self.first = False
            cut = self._cut()
        return pieces

    def end(self, output: StageOutput) -> list[Piece]:
        rest, self.buffer = self.buffer, ""
        return [Piece(rest)] if rest.strip() else []

    def _cut(self) -> int | None:
        """Where the next piece ends in the buffer, or None while it has not ended."""
        ends = [m.end() for m in SENTENCE_END.finditer(self.buffer)]
        if self.first:
            ends += [m.end() for m in CLAUSE_END.finditer(self.buffer) if m.end() >= FIRST_MIN_CHARS]
        if len(self.buffer) >= MAX_CHARS:
            space = self.buffer.rfind(" ", 0, MAX_CHARS)
            if space > 0:
                ends.append(space + 1)
        return min((end for end in ends if self.buffer[:end].strip()), default=None)


@attrs.frozen
class TextToSpeech:
    """An AR stage's answer into a `tts` stage: its text, whole or streamed."""

    name: str = "text_to_speech"
    source_kind: str = "ar"
    target_kind: str = "tts"

    def convert(self, output: StageOutput, request: Request) -> StageInput:
        return StageInput(request.request_id, output.text or "")

    def splitter(self, request: Request) -> SentenceSplitter:
        return SentenceSplitter()


TEXT_TO_SPEECH = TextToSpeech()
