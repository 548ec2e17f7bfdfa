"""KV block bookkeeping (no torch): fixed-size blocks, a block table per sequence, reference counts, and a
prefix cache of hash-chained full blocks.

A block is *used* while some table references it and *free* otherwise. A free block that still holds the K/V
of a full, hashed block is also *cached*: a later sequence whose tokens hash to it takes it back without
recomputing, and it is evicted (least recently freed first) only when a fresh block is needed.
A block's hash is registered only once its K/V are computed (`commit`), so a hit never reads unwritten slots.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import attrs


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


@attrs.define
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()  # kept to rule out hash collisions on a hit


@attrs.define
class Table:
    blocks: list[int] = attrs.Factory(list)
    hashes: list[int] = attrs.Factory(list)  # chain hashes of the leading blocks already committed


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty: deque[int] = deque(range(num_blocks))  # free, holding nothing reusable
        self.cached: OrderedDict[int, None] = OrderedDict()  # free but hashed, least recently freed first
        self.by_hash: dict[int, int] = {}
        self.tables: dict[str, Table] = {}
        self.hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.empty) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: str) -> list[int]:
        return self.tables[seq_id].blocks

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids holding the longest cached run of full leading blocks. At least one token is left out so
        the caller always computes the last one (its logits are needed)."""
        if not self.enable_prefix_caching:
            return []
        found, parent, size = [], None, self.block_size
        for start in range(0, len(token_ids) - 1 - size + 1, size):
            tokens = tuple(token_ids[start:start + size])
            parent = chain_hash(parent, tokens)
            block_id = self.by_hash.get(parent)
            if block_id is None or self.blocks[block_id].tokens != tokens:
                break
            found.append(block_id)
        return found

    def can_allocate(self, token_ids: Sequence[int], num_tokens: int, hits: list[int] | None = None) -> bool:
        """Whether a new sequence can get blocks for its first `num_tokens` tokens (prefix hits included);
        `hits` is `match_prefix(token_ids)` when the caller already has it."""
        hits = (self.match_prefix(token_ids) if hits is None else hits)[: self.blocks_for(num_tokens)]
        taken_from_free = sum(self.blocks[b].ref_count == 0 for b in hits)
        return self.blocks_for(num_tokens) - len(hits) + taken_from_free <= self.num_free

    def allocate(self, seq_id: str, token_ids: Sequence[int], num_tokens: int, hits: list[int] | None = None) -> int:
        """Give a new sequence a table covering `num_tokens` tokens; return how many leading tokens are
        already computed (prefix-cache hits)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        hits = (self.match_prefix(token_ids) if hits is None else hits)[: self.blocks_for(num_tokens)]
        if not self.can_allocate(token_ids, num_tokens, hits):
            raise MemoryError("not enough free KV blocks")
        table = Table()
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.cached[block_id]
            block.ref_count += 1
            table.blocks.append(block_id)
            table.hashes.append(block.hash)
        self.tables[seq_id] = table
        self._grow(table, num_tokens)
        cached_tokens = len(hits) * self.block_size
        self.hit_tokens += cached_tokens
        return cached_tokens

    def can_append(self, seq_id: str, num_tokens: int) -> bool:
        """Whether the sequence's table can grow to cover `num_tokens` tokens in all."""
        return self.blocks_for(num_tokens) - len(self.tables[seq_id].blocks) <= self.num_free

    def append_slots(self, seq_id: str, num_tokens: int) -> None:
        """Grow the sequence's table to cover `num_tokens` tokens in all."""
        if not self.can_append(seq_id, num_tokens):
            raise MemoryError("not enough free KV blocks")
        self._grow(self.tables[seq_id], num_tokens)

    def _grow(self, table: Table, num_tokens: int) -> None:
        while len(table.blocks) < self.blocks_for(num_tokens):
            table.blocks.append(self._take_fresh())

    def _take_fresh(self) -> int:
        if self.empty:
            block_id = self.empty.popleft()
        else:
            block_id, _ = self.cached.popitem(last=False)  # evict the least recently freed
            self._forget(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self.by_hash.get(block.hash) == block.block_id:
            del self.by_hash[block.hash]
        block.hash, block.tokens = None, ()

    # Prefix-cache registration.

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the hashes of the sequence's full blocks whose K/V are now computed."""
        if not self.enable_prefix_caching:
            return
        table, size = self.tables[seq_id], self.block_size
        full = min(num_computed // size, len(table.blocks))
        parent = table.hashes[-1] if table.hashes else None
        for index in range(len(table.hashes), full):
            tokens = tuple(token_ids[index * size:(index + 1) * size])
            parent = chain_hash(parent, tokens)
            table.hashes.append(parent)
            block = self.blocks[table.blocks[index]]
            if block.hash is None and parent not in self.by_hash:
                block.hash, block.tokens = parent, tokens
                self.by_hash[parent] = block.block_id

    def free(self, seq_id: str) -> None:
        """Drop the sequence's references at once. Tail blocks are freed first so they are evicted first."""
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        for block_id in reversed(table.blocks):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self.empty.append(block_id)
                else:
                    self.cached[block_id] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached free block (e.g. so benchmark phases start cold)."""
        while self.cached:
            block_id, _ = self.cached.popitem(last=False)
            self._forget(self.blocks[block_id])
            self.empty.append(block_id)
