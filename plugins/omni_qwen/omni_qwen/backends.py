"""The two KV backends behind ARModelRunner. Both consume the ARScheduler's chunks (prefill chunks and decodes
of many requests) and return the logits of the chunks that sample; the runner never sees which one runs.

- PagedBackend: the runtime owns K/V in a preallocated KVPool of blocks; ONE PagedDecoder forward per engine
  step covers every scheduled chunk. The scheduler's BlockManager is the pool's real allocator.
- DynamicCacheBackend: one transformers DynamicCache per request, in the request's record
  (ARRunnerState.kv_cache), and one model call per chunk (any causal LM). The BlockManager is then pure
  bookkeeping that keeps the caches within the same memory budget.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from transformers import DynamicCache

from omni_kernel.core.ar_scheduler import ARSchedulerOutput, ARSequence

from .paged.batch import build_step
from .paged.decoder import PagedDecoder
from .paged.graph import DecodeGraph
from .paged.pool import KVPool


class ARBackend(Protocol):
    """Model calls over some KV cache. `kv_trace` holds the ar.kv_* trace fields that describe it."""

    kv_trace: dict[str, Any]

    def forward(self, batch: ARSchedulerOutput) -> tuple[tuple[str, ...], torch.Tensor]:
        """Compute every chunk of the step; return the request ids of the sampling chunks and their
        next-token logits, one row each."""

    def forward_rows(self, batch: ARSchedulerOutput, every_row: frozenset[str]
                     ) -> tuple[tuple[str, ...], torch.Tensor, dict[str, torch.Tensor]]:
        """forward, plus the logits of every row of the chunks of `every_row`'s requests (prompt logprobs)."""

    def free(self, seq: ARSequence) -> None:
        """Drop everything the backend holds for the request (a finished one, or one preempted to recompute)."""


class DynamicCacheBackend:
    kv_trace = {"kv_cache": True, "kv_cache_type": "DynamicCache", "kv_cache_backend": "dynamic_cache",
                "kv_cache_source": "transformers", "runtime_kv_manager": False}

    def __init__(self, lm):
        self.model = lm.model
        self.device = lm.device

    def forward(self, batch: ARSchedulerOutput) -> tuple[tuple[str, ...], torch.Tensor]:
        return self.forward_rows(batch, frozenset())[:2]

    @torch.inference_mode()
    def forward_rows(self, batch: ARSchedulerOutput, every_row: frozenset[str]
                     ) -> tuple[tuple[str, ...], torch.Tensor, dict[str, torch.Tensor]]:
        ids, rows, every = [], [], {}
        for chunk, seq in zip(batch.chunks, batch.records):
            cache = seq.state.kv_cache
            if cache is None or chunk.start == 0:  # new, or recomputed after preemption
                cache = DynamicCache(config=self.model.config)
            if cache.get_seq_length() != chunk.start:
                raise RuntimeError(f"request {chunk.request_id}: cache holds {cache.get_seq_length()} tokens, "
                                   f"the chunk starts at {chunk.start}")
            tokens = torch.tensor([chunk.token_ids], dtype=torch.long, device=self.device)
            wide = chunk.request_id in every_row
            out = self.model(input_ids=tokens, cache=cache, use_cache=True, logits_to_keep=0 if wide else 1)
            if wide:
                every[chunk.request_id] = out.logits[0]
            seq.state.kv_cache = out.cache if out.cache is not None else cache
            if chunk.samples:
                ids.append(chunk.request_id)
                rows.append(out.logits[0, -1])
        return tuple(ids), torch.stack(rows) if rows else torch.empty(0), every

    def free(self, seq: ARSequence) -> None:
        seq.state.kv_cache = None


class PagedBackend:
    def __init__(self, model: PagedDecoder, pool: KVPool, graph: DecodeGraph | None = None):
        """graph: the compiled decode step (ar_compile), which runs the steps it can (paged/graph.py)."""
        self.model = model
        self.pool = pool
        self.graph = graph

    @property
    def kv_trace(self) -> dict:
        return {"kv_cache": True, "kv_cache_type": "PagedKVPool", "kv_cache_backend": "paged",
                "kv_cache_source": "runtime", "runtime_kv_manager": True, "decode_compiled": self.graph is not None}

    def forward(self, batch: ARSchedulerOutput) -> tuple[tuple[str, ...], torch.Tensor]:
        step = build_step(batch.chunks, batch.block_size, self.model.dtype, self.pool.device)
        if self.graph is not None and self.graph.runs(step):
            return step.sample_ids, self.graph.forward(step, self.pool)
        return step.sample_ids, self.model.forward(step, self.pool)

    def forward_rows(self, batch: ARSchedulerOutput, every_row: frozenset[str]
                     ) -> tuple[tuple[str, ...], torch.Tensor, dict[str, torch.Tensor]]:
        step = build_step(batch.chunks, batch.block_size, self.model.dtype, self.pool.device, every_row)
        logits = self.model.forward(step, self.pool)
        every, row = {}, len(step.sample_ids)
        for request_id, n in step.every_rows:
            every[request_id] = logits[row:row + n]
            row += n
        return step.sample_ids, logits[:len(step.sample_ids)], every

    def free(self, seq: ARSequence) -> None:
        """Nothing: the request's blocks belong to the scheduler's BlockManager, which frees them."""
