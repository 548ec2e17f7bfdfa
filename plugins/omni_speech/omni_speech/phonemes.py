"""Text to phoneme ids as Piper makes them: espeak-ng 1.52 (the `espeakng-loader` wheel's library and data, loaded
with ctypes) in IPA mode, clause by clause, with each clause's terminator kept, NFD, then ids from the voice's
`phoneme_id_map` with `^`, `$` and `_` as piper-phonemize places them.

Piper reads each clause's terminator with `espeak_TextToPhonemesWithTerminator`, which espeak-ng 1.52 builds but
does not export (only its `TranslateClauseWithTerminator`, which that function wraps, is in the library, unexported).
The wheel's library keeps its symbol table, so `Espeak` finds that function (and the two globals it needs) there
and makes the same calls the exported function makes: same clauses, same phonemes, same terminators.
"""

from __future__ import annotations

import ctypes
import re
import struct
import threading
import unicodedata
from collections.abc import Mapping, Sequence

import attrs

from omni_kernel.core.errors import ModelError

INSTALL = "pip install espeakng-loader==0.2.4 (or `make setup`)"
BOS, EOS, PAD = "^", "$", "_"

AUDIO_OUTPUT_SYNCHRONOUS = 0x02
CHARS_AUTO = 0
PHONEMES_IPA = 0x02
ENCODING_UTF_8 = 19  # espeak_ng_ENCODING: the fallback for bytes that are not UTF-8 (a Python str never has any)
# Clause terminators as espeak-ng's ReadClause returns them (pause | intonation | type, readclause.h), masked with
# TERMINATOR_MASK as Piper masks them, and what Piper writes for each; any other value (the end of the text, a
# paragraph, a clause cut for length, an ellipsis) writes nothing.
TERMINATOR_MASK = 0x000FFFFF
INTONATION_FULL_STOP, INTONATION_COMMA, INTONATION_QUESTION, INTONATION_EXCLAMATION = 0x0000, 0x1000, 0x2000, 0x3000
CLAUSE_TYPE_CLAUSE, CLAUSE_TYPE_SENTENCE = 0x00040000, 0x00080000
TERMINATORS = {40 | INTONATION_FULL_STOP | CLAUSE_TYPE_SENTENCE: ".",
               40 | INTONATION_QUESTION | CLAUSE_TYPE_SENTENCE: "?",
               45 | INTONATION_EXCLAMATION | CLAUSE_TYPE_SENTENCE: "!",
               20 | INTONATION_COMMA | CLAUSE_TYPE_CLAUSE: ",",
               30 | INTONATION_FULL_STOP | CLAUSE_TYPE_CLAUSE: ":",
               30 | INTONATION_COMMA | CLAUSE_TYPE_CLAUSE: ";"}
NOT_A_BOUNDARY = (",", ":", ";")  # Piper adds a space after these: the sentence goes on
_LANGUAGE_SWITCH = re.compile(r"\([^)]+\)")  # "(fr)" around words espeak read in another language


class PhonemizerMissing(ModelError):
    """espeak-ng cannot be loaded."""


@attrs.frozen
class Clause:
    """One clause as espeak-ng read it: its IPA phonemes, the terminator Piper keeps ("" for none), whether it
    ends a sentence, and its source text."""

    phonemes: str
    terminator: str
    sentence_end: bool
    text: str = ""

    def piper_text(self) -> str:
        """The clause as Piper phonemizes it: language switches removed, the terminator kept (and a space after a
        comma, colon or semicolon, where the sentence goes on)."""
        text = _LANGUAGE_SWITCH.sub("", self.phonemes) + self.terminator
        return text + " " if self.terminator in NOT_A_BOUNDARY else text


def sentences(clauses: Sequence[Clause]) -> list[list[Clause]]:
    """Clauses grouped into sentences as Piper groups them (a sentence ends where espeak-ng says one ends)."""
    out: list[list[Clause]] = []
    current: list[Clause] = []
    for clause in clauses:
        current.append(clause)
        if clause.sentence_end:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def phoneme_list(clauses: Sequence[Clause], vowel_clusters: frozenset[tuple[str, ...]] = frozenset()) -> list[str]:
    """The phonemes of clauses as Piper lists them: every code point of the NFD text, known vowel clusters merged."""
    phonemes = list(unicodedata.normalize("NFD", "".join(c.piper_text() for c in clauses)))
    return merge_vowel_clusters(phonemes, vowel_clusters) if vowel_clusters else phonemes


def merge_vowel_clusters(phonemes: Sequence[str], clusters: frozenset[tuple[str, ...]]) -> list[str]:
    """Adjacent phonemes that form a cluster the voice knows become one phoneme, the longest first."""
    longest = max(len(c) for c in clusters)
    out: list[str] = []
    i = 0
    while i < len(phonemes):
        size = next((n for n in range(min(longest, len(phonemes) - i), 1, -1)
                     if tuple(phonemes[i:i + n]) in clusters), 1)
        out.append("".join(phonemes[i:i + size]))
        i += size
    return out


def phoneme_ids(phonemes: Sequence[str], id_map: Mapping[str, Sequence[int]]) -> list[int]:
    """piper-phonemize's ids: BOS, PAD, then each phoneme's ids followed by PAD, then EOS. A phoneme the map lacks
    is left out (Piper warns and skips it)."""
    ids = [*id_map[BOS], *id_map[PAD]]
    for phoneme in phonemes:
        if phoneme in id_map:
            ids += [*id_map[phoneme], *id_map[PAD]]
    ids += id_map[EOS]
    return ids


def missing_phonemes(phonemes: Sequence[str], id_map: Mapping[str, Sequence[int]]) -> list[str]:
    return sorted({p for p in phonemes if p not in id_map})


class Espeak:
    """espeak-ng 1.52 from the espeakng-loader wheel. espeak-ng keeps global state: one instance per process
    (`Espeak.shared()`), every call under its lock."""

    _shared: Espeak | None = None
    _shared_lock = threading.Lock()

    def __init__(self):
        try:
            import espeakng_loader
        except ImportError:
            raise PhonemizerMissing(f"espeak-ng is not installed: {INSTALL}") from None
        path = espeakng_loader.get_library_path()
        try:
            self.lib = ctypes.CDLL(path)
            data = espeakng_loader.get_data_path()
        except (OSError, RuntimeError) as exc:
            raise PhonemizerMissing(f"espeak-ng cannot be loaded ({exc}): {INSTALL}") from None
        self.lock = threading.Lock()
        self.voice: str | None = None
        self._bind(path)
        self.lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        if self.lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, data.encode(), 0) < 0:
            raise PhonemizerMissing(f"espeak-ng did not start with its data in {data}: {INSTALL}")
        if not self.decoder.value:
            self.decoder.value = self.lib.create_text_decoder()

    @classmethod
    def shared(cls) -> Espeak:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def _bind(self, path: str) -> None:
        """The unexported function and globals espeak_TextToPhonemesWithTerminator uses, from the symbol table."""
        symbols = elf_symbols(path, ("espeak_TextToPhonemes", "TranslateClauseWithTerminator",
                                     "GetTranslatedPhonemeString", "translator", "p_decoder"))
        missing = sorted({"espeak_TextToPhonemes", "TranslateClauseWithTerminator", "GetTranslatedPhonemeString",
                          "translator", "p_decoder"} - set(symbols))
        if missing:
            raise PhonemizerMissing(f"{path} is not the espeak-ng 1.52 build omni expects (no {', '.join(missing)}): "
                                    f"{INSTALL}")
        base = ctypes.cast(self.lib.espeak_TextToPhonemes, ctypes.c_void_p).value - symbols["espeak_TextToPhonemes"]
        self.translate = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.POINTER(ctypes.c_int))(base + symbols["TranslateClauseWithTerminator"])
        self.phoneme_string = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_int)(
            base + symbols["GetTranslatedPhonemeString"])
        self.translator = ctypes.c_void_p.from_address(base + symbols["translator"])
        self.decoder = ctypes.c_void_p.from_address(base + symbols["p_decoder"])
        lib = self.lib
        lib.create_text_decoder.restype = ctypes.c_void_p
        lib.text_decoder_decode_string_multibyte.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                                             ctypes.c_int]
        lib.text_decoder_get_buffer.argtypes = [ctypes.c_void_p]
        lib.text_decoder_get_buffer.restype = ctypes.c_void_p
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]

    def clauses(self, text: str, voice: str) -> list[Clause]:
        """The clauses of `text` read with espeak voice `voice` (e.g. "en-us"), as Piper's espeakbridge reads them."""
        with self.lock:
            self._set_voice(voice)
            encoded = text.encode("utf-8")
            buffer = ctypes.create_string_buffer(encoded)
            base = ctypes.cast(buffer, ctypes.c_void_p).value
            pointer, start = base, 0
            out = []
            while pointer:
                phonemes, kind, pointer = self._clause(pointer)
                # espeak-ng reads one character past a clause's end and hands it to the next clause: where it
                # goes on, this clause's text ends one character before
                end = len(encoded) if not pointer else _char_start(encoded, pointer - base)
                out.append(Clause(phonemes, TERMINATORS.get(kind, ""), bool(kind & CLAUSE_TYPE_SENTENCE),
                                  encoded[start:end].decode("utf-8", "replace")))
                start = end
            return out

    def _clause(self, pointer: int) -> tuple[str, int, int | None]:
        """espeak_TextToPhonemesWithTerminator: one clause from `pointer`: its phonemes, its terminator (masked as
        Piper masks it) and where espeak-ng goes on (None at the end)."""
        if self.lib.text_decoder_decode_string_multibyte(self.decoder.value, pointer, ENCODING_UTF_8, CHARS_AUTO):
            raise ModelError("espeak-ng could not read the text")
        terminator = ctypes.c_int(0)
        self.translate(self.translator.value, None, None, ctypes.byref(terminator))
        following = self.lib.text_decoder_get_buffer(self.decoder.value)
        phonemes = (self.phoneme_string(PHONEMES_IPA) or b"").decode("utf-8")
        return phonemes, terminator.value & TERMINATOR_MASK, following

    def _set_voice(self, voice: str) -> None:
        if voice == self.voice:
            return
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ModelError(f"espeak-ng has no voice {voice!r}")
        self.voice = voice


def _char_start(encoded: bytes, offset: int) -> int:
    """The offset of the UTF-8 character that ends just before `offset`."""
    offset = min(offset, len(encoded)) - 1
    while offset > 0 and encoded[offset] & 0xC0 == 0x80:
        offset -= 1
    return max(offset, 0)


def elf_symbols(path: str, names: Sequence[str]) -> dict[str, int]:
    """The addresses (relative to the library's load address) of `names` in an ELF64 file's symbol table."""
    wanted = set(names)
    with open(path, "rb") as f:
        data = f.read()
    if data[:5] != b"\x7fELF\x02":
        return {}
    (section_offset,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(count)]
    found: dict[str, int] = {}
    for _, kind, _, _, offset, size, link, _, _, symbol_size in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strings = sections[link][4]
        for j in range(size // symbol_size):
            name_at, _, _, _, value, _ = struct.unpack_from("<IBBHQQ", data, offset + j * symbol_size)
            end = data.index(b"\0", strings + name_at)
            name = data[strings + name_at:end].decode("ascii", "replace")
            if name in wanted and value:
                found[name] = value
    return found
