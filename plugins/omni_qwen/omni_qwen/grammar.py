"""Grammar-constrained decoding with xgrammar: one `Grammars` per AR engine (its compile cache, shared by its
requests), and one `Constrained` per constrained request, in the request's record (ARRunnerState.constrained).

- At submit, `check` converts the request's Structure into an xgrammar Grammar (no tokenizer needed, about a
  millisecond), so an invalid or unsupported schema or regex is refused before any work, and starts compiling it.
- Compiling (against the model's vocabulary) runs on one background thread; compiled grammars are kept in an
  LRU keyed by the canonical Structure, so each distinct schema compiles once. A request whose grammar is not
  compiled yet waits unscheduled (`Constrained.ready`), so compiling never stalls other requests' steps.
- Each step, `mask` applies every constrained row's token bitmask to its own row of the logits (the others are
  untouched) before sampling; `accept` advances each constrained request's matcher by its sampled token and
  fills its next bitmask, so its `done` says when only a stop token could follow: the grammar is complete.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import attrs
import torch
import xgrammar as xgr

from omni_kernel.core.errors import InvalidParameter

from .structured import Structure

CACHE_SIZE = 64  # distinct compiled grammars kept per engine
# Compact JSON (no free whitespace between tokens): a small model may otherwise spend its budget on newlines.
JSON_OPTIONS = {"any_whitespace": False, "strict_mode": True}


def _xgrammar_error(exc: Exception) -> str:
    """xgrammar's message without its C++ source location: `[time] file.cc:123: Unsupported type "foo"`."""
    text = " ".join(str(exc).split())
    head, sep, tail = text.partition(": ")
    return tail if sep and ".cc:" in head else text


def grammar_of(structure: Structure) -> xgr.Grammar:
    """The structure as an xgrammar Grammar; InvalidParameter naming the field when xgrammar refuses it."""
    try:
        if structure.kind in ("json_schema", "json_object"):
            source = structure.source if structure.kind == "json_schema" else '{"type": "object"}'
            return _strict_strings(xgr.Grammar.from_json_schema(source, **JSON_OPTIONS))
        if structure.kind == "regex":
            return xgr.Grammar.from_regex(structure.source)
        return xgr.Grammar.from_regex("|".join(_escape(c) for c in json.loads(structure.source)))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidParameter(structure.kind, f"is not supported: {_xgrammar_error(exc)}") from None


# xgrammar 0.2.9 lets a string with minLength/maxLength hold raw control characters (U+0000..U+001F but \r and
# \n), which JSON forbids (json.loads refuses them), and every string hold UTF-8-encoded surrogates
# (U+D800..U+DFFF: bytes ED A0..BF xx), which are not UTF-8 at all (they decode to U+FFFD, three per surrogate,
# so a maxLength string comes out too long): string characters are narrowed to printable ones, surrogates out.
# A length-bounded string's character class is replaced wherever xgrammar writes it: in a `_characters` rule, or
# inlined into the property's own rule (maxLength 1: `root_prop_1 ::= ("" | ([^\"\\\r\n]))`).
_LOOSE_CHARACTER = r'[^\"\\\r\n]'
_STRICT_CHARACTER = r'[^\0-\x1f\"\\\uD800-\uDFFF]'
_LOOSE_STRING = r'[^\0-\x1f\"\\\r\n]'
_STRICT_STRING = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'


def _strict_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    text = str(grammar)
    strict = text.replace(_LOOSE_CHARACTER, _STRICT_CHARACTER).replace(_LOOSE_STRING, _STRICT_STRING)
    if strict == text:
        return grammar
    return xgr.Grammar.from_ebnf(strict)


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in r"\^$.|?*+()[]{}/" else ch for ch in text)


@attrs.define(eq=False)
class Compile:
    """One structure's compile: the request that started it, its future and, when done, its time."""

    owner: str
    future: Future | None = None
    ms: float | None = None


@attrs.define(eq=False)
class Constrained:
    """One constrained request's grammar (ARRunnerState.constrained): its structure and compile, the answer prefix
    its matcher accepts first (its PrefixedPrompt's), and, once it decodes, its matcher and the bitmask of the tokens
    it may take next; `done` when only a stop token could follow."""

    structure: Structure
    compile: Compile
    prefix: str = ""
    matcher: xgr.GrammarMatcher | None = None
    bitmask: torch.Tensor | None = None
    done: bool = False

    @property
    def ready(self) -> bool:
        """Whether it can be scheduled: its grammar is compiled (or failed: then its first step fails it)."""
        return self.matcher is not None or self.compile.future.done()

    def trace(self, request_id: str) -> dict:
        """The ar.* trace fields of structured output: the constraint's kind and, for the request that compiled its
        grammar, the compile time (None: compiled before)."""
        ms = self.compile.ms if self.compile.owner == request_id else None
        return {"structured_output": self.structure.kind, "grammar_compile_ms": ms}


class Grammars:
    """The compile cache of an AR engine's grammars, shared by its requests (each request's own grammar state is
    its Constrained). `tokenizer_info()` builds xgrammar's view of the vocabulary (`vocab_size` = the logits'
    width, which may exceed the tokenizer's) on the compile thread, on first use."""

    def __init__(self, tokenizer_info: Callable[[], xgr.TokenizerInfo], cache_size: int = CACHE_SIZE):
        self._tokenizer_info = tokenizer_info
        self._compiler: xgr.GrammarCompiler | None = None
        self._stop_only: torch.Tensor | None = None
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Compile] = OrderedDict()
        self._lock = threading.Lock()  # submit (input processing) and steps may run on different threads
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="omni-grammar")

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> Grammars:
        stops = sorted(stop_token_ids)
        return cls(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                              stop_token_ids=stops or None))

    def check(self, request_id: str, structure: Structure | None) -> None:
        """At submit: refuse a structure xgrammar cannot take (InvalidParameter) and start compiling it."""
        if structure is not None:
            with self._lock:
                cached = structure.key in self._cache
            if not cached:
                grammar_of(structure)
            self.entry(structure, request_id)

    def entry(self, structure: Structure, request_id: str) -> Compile:
        """The compile of `structure`: started in the background by the first request that needs it (its
        `owner`), then kept (LRU) for every later one."""
        with self._lock:
            entry = self._cache.get(structure.key)
            if entry is None:  # a failed compile stays: the same structure would fail again
                entry = Compile(request_id)
                entry.future = self._executor.submit(self._compile, structure, entry)
                self._cache[structure.key] = entry
            self._cache.move_to_end(structure.key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return entry

    def constrain(self, item) -> Constrained | None:
        """The grammar state of a request the engine took (a StageInput with its ARPrompt), None when unconstrained;
        where its text begins with its node's answer prefix (a PrefixedPrompt), the grammar covers the prefix too
        (its matcher starts by accepting it)."""
        structure = Structure.of(item.params)
        if structure is None:
            return None
        prefix = getattr(item.processed, "answer_prefix", "")  # a structured.PrefixedPrompt's
        return Constrained(structure, self.entry(structure, item.request_id), prefix)

    def _compile(self, structure: Structure, entry: Compile) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        if self._compiler is None:
            info = self._tokenizer_info()
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            stop_only = xgr.allocate_token_bitmask(1, info.vocab_size)
            stop_only.zero_()
            for token in info.stop_token_ids:
                stop_only[0, token // 32] |= 1 << (token % 32)
            self._stop_only = stop_only[0]
        compiled = self._compiler.compile_grammar(grammar_of(structure))
        entry.ms = round((time.perf_counter() - start) * 1000, 3)
        return compiled

    def pending(self) -> list[Future]:
        with self._lock:
            return [e.future for e in self._cache.values() if not e.future.done()]

    def mask(self, rows: Sequence[Constrained | None], logits: torch.Tensor
             ) -> tuple[torch.Tensor, dict[int, Exception]]:
        """`logits` (row i: the request of `rows[i]`, None for an unconstrained one) with each constrained row's
        disallowed tokens at -inf; the rows whose grammar failed to compile, with the error."""
        indices, masks, failed = [], [], {}
        for i, constrained in enumerate(rows):
            if constrained is None:
                continue
            if constrained.matcher is None:
                try:
                    self._start(constrained)
                except Exception as exc:  # noqa: BLE001 - a grammar that failed to compile fails its request alone
                    failed[i] = InvalidParameter(constrained.structure.kind,
                                                 f"cannot be compiled: {_xgrammar_error(exc)}")
                    continue
            indices.append(i)
            masks.append(constrained.bitmask)
        if indices:
            logits = logits.float()
            # xgrammar indexes the bitmask and the logits alike: one row per logits row, all-allowed (-1) rows
            # for the unconstrained ones, which `indices` leaves untouched.
            bitmask = torch.full((logits.shape[0], masks[0].shape[-1]), -1, dtype=masks[0].dtype)
            bitmask[indices] = torch.stack(masks)
            width = min(logits.shape[-1], bitmask.shape[-1] * 32)
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=width, indices=indices)
        return logits, failed

    def _start(self, constrained: Constrained) -> None:
        compiled = constrained.compile.future.result()
        matcher = xgr.GrammarMatcher(compiled)
        prefix = constrained.prefix
        if prefix and not matcher.accept_string(prefix):
            raise ValueError(f"the node's answer prefix {prefix!r} does not start any text the grammar allows")
        bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)[0]
        matcher.fill_next_token_bitmask(bitmask.unsqueeze(0))
        constrained.matcher, constrained.bitmask = matcher, bitmask

    def accept(self, rows: Sequence[Constrained | None], tokens: list) -> list:
        """`tokens` with each constrained row's token accepted by its matcher (an exception in its place when the
        grammar refuses it); afterwards its Constrained's `done` says whether its grammar is complete."""
        out = list(tokens)
        for i, constrained in enumerate(rows):
            if constrained is None or constrained.matcher is None or isinstance(tokens[i], Exception):
                continue
            if not constrained.matcher.accept_token(int(tokens[i])):
                out[i] = RuntimeError(f"the grammar refused sampled token {tokens[i]}")
                continue
            if constrained.matcher.is_terminated():
                constrained.done = True
                continue
            constrained.matcher.fill_next_token_bitmask(constrained.bitmask.unsqueeze(0))
            constrained.done = bool(torch.equal(constrained.bitmask, self._stop_only))
        return out
