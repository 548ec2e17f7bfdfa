"""build_paged_engine: PagedQwen2 + KVPool + BlockManager + ARScheduler + PagedARExecutor in a kernel Engine."""

from __future__ import annotations

from omni_kernel.ar_scheduler import ARScheduler
from omni_kernel.engine import Engine
from omni_kernel.kv_blocks import BlockManager
from omni_kernel.runner import ModelRunner

from .executor import PagedARExecutor
from .pool import KVPool
from .qwen2 import PagedQwen2


def build_paged_engine(model, node_id: str = "ar", kv_memory_bytes: int = 1 << 30, block_size: int = 16,
                       max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                       enable_prefix_caching: bool = True, tokenizer=None, eos_token_ids=(),
                       default_max_tokens: int = 256, max_model_len: int | None = None
                       ) -> tuple[Engine, PagedARExecutor, ARScheduler]:
    paged = model if isinstance(model, PagedQwen2) else PagedQwen2(model)
    pool = KVPool.for_model(model.config, paged.dtype, kv_memory_bytes, block_size, max_model_len)
    blocks = BlockManager(pool.num_blocks, block_size, enable_prefix_caching)
    executor = PagedARExecutor(node_id, paged, pool, tokenizer, tuple(eos_token_ids), default_max_tokens)
    scheduler = ARScheduler(blocks, max_num_batched_tokens, max_num_seqs, prompt_ids=executor.prompt_ids)
    return Engine(scheduler, ModelRunner(executor, node_id)), executor, scheduler
