"""KVPool: the runtime-owned K/V tensor, preallocated once from a memory budget (build.build_stage sizes it).

The BlockManager of the stage's ARScheduler decides which block holds what; the pool only stores.
"""

from __future__ import annotations

import torch


class KVPool:
    """K/V of every layer in blocks: `kv[layer, 0|1]` is (num_blocks, block_size, kv_heads, head_dim), so a
    block table gathers whole blocks along dim 0 and a token's slot is block * block_size + offset."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.num_blocks, self.block_size = num_blocks, block_size
        # Zeros, not empty: masked-out padding slots are still multiplied by a zero weight, and NaN * 0 = NaN.
        self.kv = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                              device=device)

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int) -> KVPool:
        """A pool shaped for a PagedDecoder, on its device and in its dtype."""
        return cls(len(model.layers), model.num_kv_heads, model.head_dim, num_blocks, block_size, model.dtype,
                   model.device)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[index, 0], self.kv[index, 1]
