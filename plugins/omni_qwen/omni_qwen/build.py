"""build_engine: an AR engine, Engine(GrammarScheduler(BlockManager), ARModelRunner(backend, KVCacheSpec, Grammars)),
which the kernel shares among every AR node of the plugin host with the same model and engine settings, whichever
pipeline it is in; build_stage: an AR node's Stage(ARInputProcessor, that engine, AROutputProcessor). The engine's
Grammars (the structured-output compile cache) are shared by its stages.

Both KV backends run under the same scheduler and runner. The pool is sized from the memory budget
(QwenConfig.kv_memory_for) and the model's K/V bytes per token.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch

from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import InvalidParameter, ModelError
from omni_kernel.core.graph import NodeSpec
from omni_kernel.core.kv_blocks import BlockManager
from omni_kernel.core.stage import Stage

from .backends import DynamicCacheBackend, PagedBackend
from .config import BLOCK_SIZE, ARNodeSettings, QwenConfig
from .grammar import Grammars
from .grammar_scheduler import GrammarScheduler
from .inputs import ARInputProcessor
from .logprobs import LogprobsOutput, TokenTexts
from .model import CausalLM
from .outputs import AROutputProcessor
from .paged.decoder import PagedDecoder
from .paged.graph import DecodeGraph
from .paged.kernel import KernelBuildError
from .paged.pool import KVPool
from .runner import ARModelRunner, KVCacheSpec

log = logging.getLogger("omni")


def choose_backend(config: QwenConfig, model) -> str:
    reason = PagedDecoder.supports(model.config)
    if config.ar_kv_backend == "paged" and reason:
        raise ModelError(f"ar_kv_backend='paged' cannot serve this model: {reason}; "
                         "use ar_kv_backend='dynamic_cache'")
    if config.ar_kv_backend is None and reason:
        log.info("paged KV backend unavailable (%s): using dynamic_cache", reason)
        return "dynamic_cache"
    return config.ar_kv_backend or "paged"


def kv_bytes_per_token(config, element_size: int) -> int:
    """K and V of one token across all layers of a transformers decoder config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return text.num_hidden_layers * 2 * kv_heads * head_dim * element_size


def compile_decode(paged: PagedDecoder, pool: KVPool, required: bool) -> DecodeGraph | None:
    """The decode step compiled now, through omni's compile cache (compile_cache.py). Where it cannot be: with
    `ar_compile=true` (required) a one-line ModelError saying why; by default one log line saying why, and None
    (the eager step)."""
    try:
        return _compiled(paged, pool)
    except ModelError as exc:
        if required:
            raise ModelError(f"ar_compile: {exc}; run without ar_compile") from exc
        log.info("decode steps eager: the compiled step cannot run here: %s (-c ar_compile=false skips the "
                 "attempt)", exc)
        return None


def _compiled(paged: PagedDecoder, pool: KVPool) -> DecodeGraph:
    from . import compile_cache

    where = compile_cache.use()
    hits, misses = compile_cache.graph_counts()
    try:
        graph = DecodeGraph(paged)
        seconds = graph.warm_up(pool)
    except KernelBuildError as exc:
        raise ModelError(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - inductor's failures (no C++ compiler, ...) have no common type
        cause = getattr(exc, "inner_exception", None) or exc  # dynamo wraps the backend's error
        text = str(cause).strip()
        first = f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__
        raise ModelError(f"torch.compile could not compile the decode step ({first})") from exc
    hit, missed = (now - before for now, before in zip(compile_cache.graph_counts(), (hits, misses)))
    cached = (f"compile cache hit ({_graphs(hit)} from {where})" if hit and not missed else
              f"compile cache miss: {_graphs(missed)} stored in {where} for the next load")
    log.info("decode steps compiled with torch.compile (inductor) in %.1fs; %s", seconds, cached)
    return graph


def _graphs(count: int) -> str:
    return f"{count} graph" if count == 1 else f"{count} graphs"


def build_engine(lm: CausalLM, config: QwenConfig, max_num_seqs: int, paged_model: Callable[[], PagedDecoder],
                 tokenizer=None) -> Engine:
    """The Engine of every AR stage with this model and these engine settings (the kernel shares it: one batch, one
    KV pool). `paged_model()` gives the (shared) PagedDecoder over `lm`'s weights, built on first use; `tokenizer`
    is the model's tokenizer copy for work beside the steps (own_tokenizer; None: it cannot be copied)."""
    model, context_window = lm.model, lm.context_window
    backend_name = choose_backend(config, model)
    per_token = kv_bytes_per_token(model.config, torch.empty((), dtype=model.dtype).element_size())
    memory = config.kv_memory_for(per_token, context_window)
    num_blocks = memory // (per_token * BLOCK_SIZE)
    if num_blocks < 1:
        raise InvalidParameter("ar_kv_memory", f"{memory} bytes hold no block of {BLOCK_SIZE} tokens "
                                               f"({per_token * BLOCK_SIZE} bytes for this model)")
    if config.compile_mode() and backend_name != "paged":
        raise InvalidParameter("ar_compile", f"compiles the paged backend's decode step; this engine runs "
                                             f"{backend_name}")
    if backend_name == "paged":
        paged = paged_model()
        pool = KVPool.for_model(paged, num_blocks, BLOCK_SIZE)
        mode = config.compile_mode()
        backend = PagedBackend(paged, pool, None if mode is False else compile_decode(paged, pool, mode is True))
    else:
        backend = DynamicCacheBackend(lm)
    caching = config.ar_prefix_caching and backend_name == "paged"  # a DynamicCache cannot share blocks
    kv = KVCacheSpec(backend_name, backend.kv_trace, num_blocks, BLOCK_SIZE, per_token, caching)
    # Structured output: xgrammar's vocabulary is the logits' width (lm.vocab_size), built on first use (on the
    # compile thread, hence the copy).
    grammars = Grammars.for_tokenizer(tokenizer or lm.tokenizer, lm.vocab_size, lm.eos_token_ids)
    scheduler = GrammarScheduler(BlockManager(num_blocks, BLOCK_SIZE, caching), config.ar_max_num_batched_tokens,
                                 max_num_seqs, eos_token_ids=lm.eos_token_ids, context_window=context_window,
                                 grammars=grammars)
    return Engine(scheduler, ARModelRunner(backend, kv, grammars))


def build_stage(node: NodeSpec, lm: CausalLM, settings: ARNodeSettings, max_num_seqs: int,
                max_num_batched_tokens: int, engine: Engine, tokenizer=None) -> Stage:
    """An AR node's stage over `engine` (build_engine's, for `lm` and the engine limits given), which other nodes'
    stages (of other pipelines) may share; its KV pool and compile cache are the engine's runner's.
    `tokenizer`: as for build_engine; with it, input processing may run beside a step."""
    context_window, runner = lm.context_window, engine.runner
    kv = runner.kv
    inputs = ARInputProcessor(tokenizer or lm.tokenizer, settings, context_window, lm.vocab_size, kv.capacity,
                              grammars=runner.grammars, concurrent=tokenizer is not None)
    model_trace = {**kv.trace, "model": str(lm.path), "dtype": lm.dtype, "precision_reason": lm.precision_reason,
                   "load_ms": round(lm.load_ms, 3), "context_window": context_window}
    outputs = AROutputProcessor(node.id, lm.decode, settings, model_trace, LogprobsOutput(TokenTexts(lm.tokenizer)))
    compiled = "compiled (ar_compile)" if kv.trace.get("decode_compiled") else "eager"
    summary = (
        f"{node.id}: {kv.backend} KV backend, {kv.num_blocks} blocks x {kv.block_size} tokens = {kv.capacity} tokens "
        f"({kv.capacity * kv.bytes_per_token / 2**20:.1f} MiB {lm.dtype}); max concurrency "
        f"{kv.capacity / context_window:.1f} requests at the full {context_window}-token context; up to "
        f"{max_num_seqs} sequences and {max_num_batched_tokens} tokens per step; prefix caching "
        f"{'on' if kv.prefix_caching else 'off'}; decode steps {compiled}")
    return Stage(node, "ar", inputs, engine, outputs, summary)


def own_tokenizer(lm: CausalLM):
    """A copy of the model's tokenizer for the work beside the steps (input processing, the grammar compile
    thread), so a stage worker may tokenize a new request beside a step that decodes with the model's (a Hugging
    Face fast tokenizer used from two threads at once can fail with "Already borrowed"); None if it cannot be
    copied: then processing waits for the steps."""
    try:
        return copy.deepcopy(lm.tokenizer)
    except Exception:  # noqa: BLE001 - a custom (trust_remote_code) tokenizer may not copy
        log.debug("the tokenizer of %s cannot be copied: input processing waits for the steps", lm.path,
                  exc_info=True)
        return None
