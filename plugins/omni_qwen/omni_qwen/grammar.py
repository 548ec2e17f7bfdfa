"""Grammar-constrained decoding with xgrammar: one `Grammars` per AR engine (shared, like it, by its stages).

- At submit, `check` converts the request's Structure into an xgrammar Grammar (no tokenizer needed, about a
  millisecond), so an invalid or unsupported schema or regex is refused before any work, and starts compiling it.
- Compiling (against the model's vocabulary) runs on one background thread; compiled grammars are kept in an
  LRU keyed by the canonical Structure, so each distinct schema compiles once. A request whose grammar is not
  compiled yet waits unscheduled (`ready`), so compiling never stalls other requests' steps.
- Each step, `mask` applies every constrained row's token bitmask to its own row of the logits (the others are
  untouched) before sampling; `accept` advances each constrained request's matcher by its sampled token and
  fills its next bitmask, so `complete` knows when only a stop token could follow: the grammar is done.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
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
# \n), which JSON forbids (json.loads refuses them): its characters are narrowed to printable ones.
_LOOSE_CHARACTERS = r'_characters ::= (([^\"\\\r\n]))'
_STRICT_CHARACTERS = r'_characters ::= (([^\0-\x1f\"\\]))'


def _strict_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    text = str(grammar)
    if _LOOSE_CHARACTERS not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARACTERS, _STRICT_CHARACTERS))


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
    """One constrained request: its matcher and the bitmask of the tokens it may take next."""

    matcher: xgr.GrammarMatcher
    bitmask: torch.Tensor
    done: bool = False


class Grammars:
    """`tokenizer_info()` builds xgrammar's view of the vocabulary (`vocab_size` = the logits' width, which may
    exceed the tokenizer's) on the compile thread, on first use."""

    def __init__(self, tokenizer_info: Callable[[], xgr.TokenizerInfo], cache_size: int = CACHE_SIZE):
        self._tokenizer_info = tokenizer_info
        self._compiler: xgr.GrammarCompiler | None = None
        self._stop_only: torch.Tensor | None = None
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Compile] = OrderedDict()
        self._lock = threading.Lock()  # submit (input processing) and steps may run on different threads
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="omni-grammar")
        self.structures: dict[str, Structure] = {}  # the constrained requests the engine holds
        self.prefixes: dict[str, str] = {}
        self.active: dict[str, Constrained] = {}  # those that have started decoding

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

    def add(self, item) -> None:
        """A request the engine took (a StageInput with its ARPrompt); where its text begins with its node's answer
        prefix (a PrefixedPrompt), the grammar covers the prefix too (its matcher starts by accepting it)."""
        structure = Structure.of(item.params)
        if structure is not None:
            self.structures[item.request_id] = structure
            prefix = getattr(item.processed, "answer_prefix", "")  # a structured.PrefixedPrompt's
            if prefix:
                self.prefixes[item.request_id] = prefix
            self.entry(structure, item.request_id)

    def compile_ms(self, request_id: str, structure: Structure) -> float | None:
        """The compile time of the request's grammar when this request compiled it (None: it was cached)."""
        with self._lock:
            entry = self._cache.get(structure.key)
        return entry.ms if entry is not None and entry.owner == request_id else None

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

    def ready(self, request_id: str) -> bool:
        """Whether the request can be scheduled: unconstrained, or its grammar is compiled (or failed: then its
        first step fails it)."""
        structure = self.structures.get(request_id)
        return structure is None or request_id in self.active or self.entry(structure, request_id).future.done()

    def pending(self) -> list[Future]:
        with self._lock:
            return [e.future for e in self._cache.values() if not e.future.done()]

    def mask(self, request_ids: list[str], logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Exception]]:
        """`logits` (one row per request id) with each constrained row's disallowed tokens at -inf; the
        requests whose grammar failed to compile, with the error."""
        indices, masks, failed = [], [], {}
        for i, rid in enumerate(request_ids):
            structure = self.structures.get(rid)
            if structure is None:
                continue
            state = self.active.get(rid)
            if state is None:
                try:
                    state = self._start(rid, structure)
                except Exception as exc:  # noqa: BLE001 - a grammar that failed to compile fails its request alone
                    failed[rid] = InvalidParameter(structure.kind, f"cannot be compiled: {_xgrammar_error(exc)}")
                    continue
            indices.append(i)
            masks.append(state.bitmask)
        if indices:
            logits = logits.float()
            # xgrammar indexes the bitmask and the logits alike: one row per logits row, all-allowed (-1) rows
            # for the unconstrained ones, which `indices` leaves untouched.
            bitmask = torch.full((logits.shape[0], masks[0].shape[-1]), -1, dtype=masks[0].dtype)
            bitmask[indices] = torch.stack(masks)
            width = min(logits.shape[-1], bitmask.shape[-1] * 32)
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=width, indices=indices)
        return logits, failed

    def _start(self, request_id: str, structure: Structure) -> Constrained:
        compiled = self.entry(structure, request_id).future.result()
        matcher = xgr.GrammarMatcher(compiled)
        prefix = self.prefixes.get(request_id, "")
        if prefix and not matcher.accept_string(prefix):
            raise ValueError(f"the node's answer prefix {prefix!r} does not start any text the grammar allows")
        bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)[0]
        matcher.fill_next_token_bitmask(bitmask.unsqueeze(0))
        state = self.active[request_id] = Constrained(matcher, bitmask)
        return state

    def accept(self, request_ids: list[str], tokens: list) -> list:
        """`tokens` with each constrained request's token accepted by its matcher (an exception in its place
        when the grammar refuses it); afterwards `complete(request_id)` says whether its grammar is done."""
        out = list(tokens)
        for i, rid in enumerate(request_ids):
            state = self.active.get(rid)
            if state is None or isinstance(tokens[i], Exception):
                continue
            if not state.matcher.accept_token(int(tokens[i])):
                out[i] = RuntimeError(f"the grammar refused sampled token {tokens[i]}")
                continue
            if state.matcher.is_terminated():
                state.done = True
                continue
            state.matcher.fill_next_token_bitmask(state.bitmask.unsqueeze(0))
            state.done = bool(torch.equal(state.bitmask, self._stop_only))
        return out

    def complete(self, request_id: str) -> bool:
        state = self.active.get(request_id)
        return state is not None and state.done

    def trace(self, seq) -> dict:
        """The ar.* trace fields of structured output: the constraint's kind (None: unconstrained) and, for the
        request that compiled its grammar, the compile time (None: compiled before, or unconstrained)."""
        structure = Structure.of(seq.item.params)
        ms = self.compile_ms(seq.request_id, structure) if structure is not None else None
        return {"structured_output": structure.kind if structure else None, "grammar_compile_ms": ms}

    def free(self, request_id: str) -> None:
        self.structures.pop(request_id, None)
        self.prefixes.pop(request_id, None)
        self.active.pop(request_id, None)
