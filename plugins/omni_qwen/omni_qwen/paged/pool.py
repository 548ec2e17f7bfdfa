"""KVPool: the runtime-owned K/V tensor, preallocated once and sized from a memory budget."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("omni")


class KVPool:
    """K/V of every layer in blocks: `kv[layer, 0|1]` is (num_blocks, block_size, kv_heads, head_dim), so a
    block table gathers whole blocks along dim 0 and a token's slot is block * block_size + offset."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype):
        self.num_blocks, self.block_size = num_blocks, block_size
        # Zeros, not empty: masked-out padding slots are still multiplied by a zero weight, and NaN * 0 = NaN.
        self.kv = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def for_model(cls, config, dtype: torch.dtype, memory_bytes: int, block_size: int = 16,
                  max_model_len: int | None = None) -> KVPool:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_block = cls.bytes_per_block(config.num_hidden_layers, config.num_key_value_heads, head_dim,
                                        block_size, dtype)
        num_blocks = int(memory_bytes // per_block)
        if num_blocks < 1:
            raise ValueError(f"a KV memory budget of {memory_bytes} bytes holds no block of {per_block} bytes")
        pool = cls(config.num_hidden_layers, config.num_key_value_heads, head_dim, num_blocks, block_size, dtype)
        max_len = max_model_len or config.max_position_embeddings
        log.info("paged KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); max concurrency %.1f "
                 "requests at %d tokens each", num_blocks, block_size, pool.capacity_tokens,
                 num_blocks * per_block / 2**20, str(dtype).removeprefix("torch."),
                 pool.capacity_tokens / max_len, max_len)
        return pool

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[index, 0], self.kv[index, 1]
