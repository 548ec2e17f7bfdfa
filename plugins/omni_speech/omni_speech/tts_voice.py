"""A voice's text front end (no torch, no model): what a VitsModel directory says about turning text into ids,
and the split of a text into the chunks the engine synthesizes one step at a time.

A directory converted from a Piper voice holds omni's voice file (piper_onnx.VOICE_FILE: its name, espeak-ng voice,
phoneme ids and noise defaults): its text goes through espeak-ng as Piper's does (phonemes.py). Any other VitsModel
directory (e.g. an MMS-TTS checkpoint) holds its own `VitsTokenizer`, whose ids it takes as they come; its voice is
named after the directory and its defaults are its config's.
"""

from __future__ import annotations

import json
import logging
import re
from functools import cached_property
from pathlib import Path

import attrs

from omni_kernel.core.errors import InputError, ModelError

from . import phonemes
from .phonemes import Clause
from .piper_onnx import VOICE_FILE

log = logging.getLogger("omni")

# The chunking rule (`Voice.chunks`), in phonemes (IPA code points; about 12-15 a second of speech):
FIRST_CHUNK_SPLIT = 100  # a first sentence longer than this is split at its first clause boundary past...
FIRST_CHUNK_MIN = 20  # ...this many phonemes, so the first audio comes early
MAX_CHUNK = 400  # a longer sentence is split at clause boundaries, into parts of at most this where it can be
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@attrs.frozen
class Chunk:
    """One step's worth of a request's speech: its text (what the AudioDelta says it speaks) and its ids."""

    text: str
    ids: tuple[int, ...] = attrs.field(converter=tuple)


@attrs.frozen
class Voice:
    """A VitsModel directory's voice: its names, sample rate and defaults, and its text front end."""

    path: Path
    name: str
    sample_rate: int
    noise_scale: float
    noise_w: float
    length_scale: float
    espeak_voice: str | None = None  # None: the directory's VitsTokenizer makes the ids
    phoneme_id_map: dict = attrs.field(factory=dict, repr=False)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,)

    @classmethod
    def read(cls, path: str | Path) -> Voice:
        path = Path(path)
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"{path} is not a VitsModel directory (config.json: {exc})") from None
        voice_file = path / VOICE_FILE
        if not voice_file.is_file():
            return cls(path, path.name, int(config.get("sampling_rate", 16000)),
                       float(config.get("noise_scale", 0.667)), float(config.get("noise_scale_duration", 0.8)),
                       1.0 / float(config.get("speaking_rate", 1.0)))
        try:
            voice = json.loads(voice_file.read_text())
            return cls(path, str(voice["name"]), int(voice["sample_rate"]), float(voice["noise_scale"]),
                       float(voice["noise_w"]), float(voice["length_scale"]), str(voice["espeak_voice"]),
                       dict(voice["phoneme_id_map"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelError(f"{voice_file} is not omni's voice file ({type(exc).__name__}: {exc})") from None

    def chunks(self, text: str, first: bool = True) -> list[Chunk]:
        """The text's chunks, in order. Each is one sentence as Piper splits them (espeak-ng's sentence ends), with
        two exceptions: a first sentence of more than FIRST_CHUNK_SPLIT phonemes is cut after its first clause
        (comma, colon, semicolon) that ends past FIRST_CHUNK_MIN phonemes, so the first audio comes after a short
        synthesis (`first`: the text is the start of what a request says; a streamed input's later pieces are
        not); a sentence of more than MAX_CHUNK phonemes is cut at clause boundaries into parts of at most
        MAX_CHUNK (one forward's memory grows with its longest row); a clause longer than that (espeak-ng's own cut
        of a text with no punctuation is about 800 characters) is cut between words first. Sentences with no
        phoneme the voice knows are skipped. A directory without a voice file (its own tokenizer) splits after
        . ! or ? followed by a space."""
        if self.espeak_voice is None:
            return self._tokenizer_chunks(text)
        clauses = [part for clause in phonemes.Espeak.shared().clauses(text, self.espeak_voice)
                   for part in _cut_clause(clause, MAX_CHUNK)]
        groups: list[list[int]] = []
        for sentence in _sentence_indices(clauses):
            for part in _split(sentence, clauses, MAX_CHUNK):
                groups.append(part)
        if groups and first:
            groups[:1] = _split_first(groups[0], clauses)
        out = []
        for group in groups:
            listed = phonemes.phoneme_list([clauses[i] for i in group])
            missing = phonemes.missing_phonemes(listed, self.phoneme_id_map)
            if missing:
                log.debug("voice %s has no id for %s: left out, as Piper does", self.name, missing)
            if len(listed) > len(missing) and any(p in self.phoneme_id_map for p in listed):
                words = " ".join("".join(clauses[i].text for i in group).split())
                out.append(Chunk(words, phonemes.phoneme_ids(listed, self.phoneme_id_map)))
        return out

    def _tokenizer_chunks(self, text: str) -> list[Chunk]:
        out = []
        for sentence in _SENTENCE_END.split(text.strip()):
            if sentence.strip():
                ids = self.tokenizer(sentence).input_ids
                if ids:
                    out.append(Chunk(sentence, ids))
        return out

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError) as exc:
            raise ModelError(f"{self.path} has neither omni's voice file ({VOICE_FILE}) nor a tokenizer: {exc}") \
                from None


def nothing_to_say() -> InputError:
    return InputError("the text has nothing the voice can speak (no letters or digits it knows)")


def _cut_clause(clause: Clause, limit: int) -> list[Clause]:
    """A clause of more than `limit` phonemes as consecutive parts between words; the last keeps the terminator
    and the sentence end, the first the text."""
    if len(clause.piper_text()) <= limit:
        return [clause]
    parts: list[list[str]] = [[]]
    for word in clause.phonemes.split(" "):
        if parts[-1] and len(" ".join(parts[-1] + [word])) > limit:
            parts.append([])
        parts[-1].append(word)
    last = len(parts) - 1
    return [Clause(" ".join(words), clause.terminator if i == last else "", clause.sentence_end and i == last,
                   clause.text if i == 0 else "") for i, words in enumerate(parts)]


def _sentence_indices(clauses: list[Clause]) -> list[list[int]]:
    out: list[list[int]] = []
    current: list[int] = []
    for i, clause in enumerate(clauses):
        current.append(i)
        if clause.sentence_end:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def _size(indices: list[int], clauses: list[Clause]) -> int:
    return sum(len(clauses[i].piper_text()) for i in indices)


def _split(sentence: list[int], clauses: list[Clause], limit: int) -> list[list[int]]:
    """A sentence's clauses in consecutive parts of at most `limit` phonemes (a longer clause stays whole)."""
    parts: list[list[int]] = [[]]
    for i in sentence:
        if parts[-1] and _size(parts[-1] + [i], clauses) > limit:
            parts.append([])
        parts[-1].append(i)
    return parts


def _split_first(group: list[int], clauses: list[Clause]) -> list[list[int]]:
    if _size(group, clauses) <= FIRST_CHUNK_SPLIT:
        return [group]
    for cut in range(1, len(group)):
        if _size(group[:cut], clauses) >= FIRST_CHUNK_MIN:
            return [group[:cut], group[cut:]]
    return [group]

