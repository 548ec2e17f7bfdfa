"""build_ar_engine: an AR stage's Engine = ARScheduler(BlockManager) + ModelRunner(ARExecutor(backend)).

Both KV backends run under the same scheduler and executor. The pool is sized from the memory budget
(ServingConfig.memory_for) and the model's K/V bytes per token; capacity in tokens and the maximum number of
full-context requests it holds are logged once per stage, when its first request arrives.
"""

from __future__ import annotations

import logging

import torch

from omni_kernel.ar_scheduler import ARScheduler
from omni_kernel.engine import Engine
from omni_kernel.errors import InvalidParameter, ModelError
from omni_kernel.kv_blocks import BlockManager
from omni_kernel.runner import ModelRunner

from .backends import DynamicCacheBackend, PagedBackend, paged_model
from .executor import ARExecutor
from .paged.pool import KVPool
from .paged.qwen2 import PagedQwen2
from .sequence import ARNodeSettings
from .serving import ServingConfig, kv_bytes_per_token

log = logging.getLogger("omni")


def choose_backend(serving: ServingConfig, model) -> str:
    reason = PagedQwen2.supports(model.config)
    if serving.kv_backend == "paged" and reason:
        raise ModelError(f"ar_kv_backend='paged' cannot serve this model: {reason}; "
                         "use ar_kv_backend='dynamic_cache'")
    if serving.kv_backend is None and reason:
        log.info("paged KV backend unavailable (%s): using dynamic_cache", reason)
        return "dynamic_cache"
    return serving.kv_backend or "paged"


def build_ar_engine(node_id: str, pipeline, settings: ARNodeSettings,
                    serving: ServingConfig) -> tuple[Engine, ARExecutor]:
    model = pipeline.model
    backend_name = choose_backend(serving, model)
    element_size = torch.empty((), dtype=model.dtype).element_size()
    per_token = kv_bytes_per_token(model.config, element_size)
    memory = serving.memory_for(per_token, pipeline.context_window)
    size = serving.block_size
    num_blocks = memory // (per_token * size)
    if num_blocks < 1:
        raise InvalidParameter("ar_kv_memory", f"{memory} bytes hold no block of {size} tokens "
                                               f"({per_token * size} bytes for this model)")
    if backend_name == "paged":
        paged = paged_model(model)
        backend = PagedBackend(paged, KVPool.for_model(paged, num_blocks, size))
    else:
        backend = DynamicCacheBackend(pipeline)
    caching = serving.prefix_caching and backend_name == "paged"  # a DynamicCache cannot share blocks
    executor = ARExecutor(node_id, pipeline, backend, settings, capacity_tokens=num_blocks * size)
    scheduler = ARScheduler(BlockManager(num_blocks, size, caching), serving.max_num_batched_tokens,
                            serving.max_num_seqs, prompt_ids=executor.prompt_ids)
    capacity = num_blocks * size
    # Logged by the stage when its first request arrives, so a refused request still reads as one line.
    executor.summary = (
        f"{node_id}: {backend_name} KV backend, {num_blocks} blocks x {size} tokens = {capacity} tokens "
        f"({capacity * per_token / 2**20:.1f} MiB {str(model.dtype).removeprefix('torch.')}); max concurrency "
        f"{capacity / pipeline.context_window:.1f} requests at the full {pipeline.context_window}-token context; "
        f"up to {serving.max_num_seqs} sequences and {serving.max_num_batched_tokens} tokens per step; "
        f"prefix caching {'on' if caching else 'off'}")
    return Engine(scheduler, ModelRunner(executor, node_id)), executor
