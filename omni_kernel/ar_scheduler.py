"""A token-level scheduler for AR engines over a paged KV cache (no torch).

Every step it hands out at most `max_num_batched_tokens` tokens to at most `max_num_seqs` sequences:
running decodes first, then running prompts continue in chunks, then waiting prompts are admitted while
blocks and budget last. When a decode needs a block and none is free, the most recently admitted sequence is
preempted by recompute: its blocks are freed and it waits again with prompt + generated tokens as its new
prompt, so it later yields exactly the tokens it would have (its computed full blocks usually come back as
prefix-cache hits). The executor learns what to compute from `ScheduledChunk`s and reports the sampled token
of each chunk that `samples` through `update(done, results)` (the Engine passes the executor's results).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from .kv_blocks import BlockManager
from .request import StageInput
from .scheduler import SchedulerOutput


@attrs.frozen
class ScheduledChunk:
    """Tokens of one sequence to compute this step: `token_ids` sit at positions `start`..; their K/V go to
    the slots that `block_table` maps them to. When `samples` is set the last token's logits are sampled."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    samples: bool
    cached_tokens: int = 0  # prefix-cache hit of this admission (0 after the first step)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


@attrs.frozen
class ARSchedulerOutput(SchedulerOutput):
    chunks: tuple[ScheduledChunk, ...] = attrs.field(default=(), converter=tuple)
    block_size: int = 16
    preempted: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    blocks_used: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@attrs.define(eq=False)
class ARSequence:
    item: StageInput
    token_ids: list[int]  # prompt + generated so far
    num_prompt: int
    num_computed: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    fresh: bool = True  # admitted this step: report its prefix hit once

    @property
    def request_id(self) -> str:
        return self.item.request_id

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed


def _prompt_ids_of(item: StageInput) -> Sequence[int]:
    ids = getattr(item.params, "prompt_token_ids", None) or item.options.get("prompt_token_ids")
    if ids is None:
        raise ValueError("ARScheduler needs prompt token ids: pass prompt_ids= or options['prompt_token_ids']")
    return ids


class ARScheduler:
    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 prompt_ids: Callable[[StageInput], Sequence[int]] = _prompt_ids_of):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.prompt_ids = prompt_ids
        self.waiting: deque[ARSequence] = deque()
        self.running: list[ARSequence] = []
        self.sequences: dict[str, ARSequence] = {}
        self.scheduled: tuple[tuple[ARSequence, ScheduledChunk], ...] = ()
        self.num_preemptions = 0

    # Engine contract.

    def add(self, item: StageInput) -> None:
        ids = list(self.prompt_ids(item))
        if not ids:
            raise ValueError("an AR request needs at least one prompt token")
        seq = ARSequence(item, ids, len(ids))
        self.sequences[item.request_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> ARSchedulerOutput:
        budget = self.max_num_batched_tokens
        picked: list[tuple[ARSequence, int]] = []
        preempted: list[str] = []
        decodes = [s for s in self.running if s.num_pending == 1]
        prefills = [s for s in self.running if s.num_pending > 1]
        for seq in decodes:
            if budget == 0:
                break
            if seq not in self.running:
                continue  # preempted for an earlier sequence in this loop
            while not self.blocks.can_append(seq.request_id, seq.num_computed + 1):
                victim = self._victim(seq, picked)
                if victim is seq and len(self.running) == 1:
                    raise RuntimeError("the KV pool cannot hold a single sequence; check prompt + max_tokens "
                                       "against capacity_tokens before adding")
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                self.blocks.append_slots(seq.request_id, seq.num_computed + 1)
                picked.append((seq, 1))
                budget -= 1
        for seq in prefills:
            if budget == 0 or seq not in self.running:
                continue
            while self._room(seq) <= 0 and (victim := self._victim(seq, picked)) is not seq:
                self._preempt(victim)
                preempted.append(victim.request_id)
            n = min(seq.num_pending, budget, self._room(seq))
            if n > 0:
                self.blocks.append_slots(seq.request_id, seq.num_computed + n)
                picked.append((seq, n))
                budget -= n
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = len(self.blocks.match_prefix(seq.token_ids)) * self.blocks.block_size
            n = min(len(seq.token_ids) - hits, budget)
            if not self.blocks.can_allocate(seq.token_ids, hits + n):
                if self.running:
                    break
                n = min(n, self.blocks.num_free * self.blocks.block_size - hits)  # alone: start with what fits
                if n <= 0 or not self.blocks.can_allocate(seq.token_ids, hits + n):
                    break
            self.waiting.popleft()
            seq.cached_tokens = seq.num_computed = self.blocks.allocate(seq.request_id, seq.token_ids, hits + n)
            seq.fresh = True
            self.running.append(seq)
            picked.append((seq, n))
            budget -= n
        return self._output(picked, preempted)

    def update(self, done: Iterable[str], results: Mapping[str, Any] | None = None) -> None:
        """Advance what ran last step. `results[request_id]` is the token id sampled for a chunk that
        `samples` (an int, or a sequence whose first item is used)."""
        done, results = set(done), results or {}
        for seq, chunk in self.scheduled:
            if self.sequences.get(seq.request_id) is not seq:
                continue  # aborted since
            if seq.request_id in done and seq.request_id not in results:
                continue  # failed: its K/V may be unwritten, so none of it may enter the prefix cache
            seq.num_computed += chunk.num_tokens
            seq.fresh = False
            if chunk.samples and seq.request_id in results:
                token = results[seq.request_id]
                seq.token_ids.append(int(token if isinstance(token, int) else token[0]))
            self.blocks.commit(seq.request_id, seq.token_ids, seq.num_computed)
        self.scheduled = ()
        for request_id in done:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting = deque(s for s in self.waiting if s is not seq)
        self.blocks.free(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    def stats(self, request_id: str) -> dict[str, int]:
        seq = self.sequences.get(request_id)
        return {} if seq is None else {"prefix_hit_tokens": seq.cached_tokens, "preemptions": seq.preemptions}

    # Helpers.

    def _room(self, seq: ARSequence) -> int:
        """Tokens the sequence can add with its own partly filled block and the free blocks."""
        capacity = (len(self.blocks.table(seq.request_id)) + self.blocks.num_free) * self.blocks.block_size
        return capacity - seq.num_computed

    def _victim(self, seq: ARSequence, picked: list) -> ARSequence:
        taken = {id(s) for s, _ in picked}
        for candidate in reversed(self.running):
            if candidate is seq or id(candidate) not in taken:
                return candidate
        return seq

    def _preempt(self, seq: ARSequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.num_computed = 0
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _output(self, picked: list[tuple[ARSequence, int]], preempted: list[str]) -> ARSchedulerOutput:
        chunks, scheduled = [], []
        for seq, n in picked:
            start = seq.num_computed
            chunk = ScheduledChunk(seq.request_id, tuple(seq.token_ids[start:start + n]), start,
                                   tuple(self.blocks.table(seq.request_id)), start + n == len(seq.token_ids),
                                   seq.cached_tokens if seq.fresh else 0)
            chunks.append(chunk)
            scheduled.append((seq, chunk))
        self.scheduled = tuple(scheduled)
        return ARSchedulerOutput([c.request_id for c in chunks], [s.item for s, _ in scheduled], chunks=chunks,
                                 block_size=self.blocks.block_size, preempted=preempted,
                                 blocks_used=self.blocks.num_used)
