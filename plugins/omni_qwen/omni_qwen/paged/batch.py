"""StepBatch: one engine step's chunks flattened into the index tensors every layer reuses.

Rows are ordered one-token chunks first (decodes, batched into one attention call per layer), then the longer
prefill chunks (one attention call each). Nothing is padded except the decode gather, to the longest context.
"""

from __future__ import annotations

import attrs
import torch

from omni_kernel.core.ar_scheduler import ScheduledChunk


@attrs.frozen
class PrefillSpan:
    row: int  # first row of the chunk in the flattened batch
    num_tokens: int
    start: int  # position of the chunk's first token
    blocks: torch.Tensor  # block ids covering start + num_tokens
    mask: torch.Tensor | None  # (num_tokens, context) bool; None when the chunk starts at 0 (plain causal)

    @property
    def context_len(self) -> int:
        return self.start + self.num_tokens


@attrs.frozen
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    num_decodes: int
    decode_blocks: torch.Tensor  # (num_decodes * max_blocks,) padded with block 0
    decode_bias: torch.Tensor  # (num_decodes, 1, 1, max_blocks * block_size): 0 or -inf
    prefills: tuple[PrefillSpan, ...]
    sample_rows: torch.Tensor  # the rows whose logits are computed: one per sampling chunk, then `every_rows`'
    sample_ids: tuple[str, ...]
    every_rows: tuple[tuple[str, int], ...] = ()  # (request id, tokens) of chunks whose every row is computed too

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _slots(table, start: int, n: int, size: int) -> list[int]:
    return [table[p // size] * size + p % size for p in range(start, start + n)]


def build_step(chunks: tuple[ScheduledChunk, ...], block_size: int, dtype: torch.dtype,
               device: str | torch.device = "cpu", every_row: frozenset[str] = frozenset()) -> StepBatch:
    """`every_row`: request ids whose chunk's every row gets logits (prompt logprobs), after the sampled rows."""
    decodes = [c for c in chunks if c.num_tokens == 1]
    longer = [c for c in chunks if c.num_tokens > 1]
    ids, positions, slots, sample_rows, sample_ids, extra, every = [], [], [], [], [], [], []
    for chunk in decodes + longer:
        if chunk.samples:
            sample_rows.append(len(ids) + chunk.num_tokens - 1)
            sample_ids.append(chunk.request_id)
        if chunk.request_id in every_row:
            extra.extend(range(len(ids), len(ids) + chunk.num_tokens))
            every.append((chunk.request_id, chunk.num_tokens))
        ids.extend(chunk.token_ids)
        positions.extend(range(chunk.start, chunk.context_len))
        slots.extend(_slots(chunk.block_table, chunk.start, chunk.num_tokens, block_size))
    max_blocks = max((-(-c.context_len // block_size) for c in decodes), default=0)
    gather = []
    for chunk in decodes:
        used = -(-chunk.context_len // block_size)
        gather.extend(chunk.block_table[:used])
        gather.extend([0] * (max_blocks - used))
    lengths = torch.tensor([c.context_len for c in decodes], dtype=torch.long)
    beyond = torch.arange(max_blocks * block_size) >= lengths[:, None, None, None]  # a decode's padding
    bias = torch.zeros(beyond.shape, dtype=dtype).masked_fill_(beyond, float("-inf"))
    prefills, row = [], len(decodes)
    for chunk in longer:
        used = -(-chunk.context_len // block_size)
        mask = None
        if chunk.start:
            mask = torch.ones(chunk.num_tokens, chunk.context_len, dtype=torch.bool).tril(chunk.start)
        prefills.append(PrefillSpan(row, chunk.num_tokens, chunk.start,
                                    torch.tensor(chunk.block_table[:used], dtype=torch.long), mask))
        row += chunk.num_tokens

    def as_tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    if torch.device(device).type != "cpu":
        bias = bias.to(device)
        prefills = [attrs.evolve(p, blocks=p.blocks.to(device), mask=None if p.mask is None else p.mask.to(device))
                    for p in prefills]
    return StepBatch(as_tensor(ids), as_tensor(positions), as_tensor(slots), len(decodes), as_tensor(gather), bias,
                     tuple(prefills), as_tensor(sample_rows + extra), tuple(sample_ids), tuple(every))
