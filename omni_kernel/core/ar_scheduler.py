"""A token-level scheduler for AR engines over a paged KV cache (no torch).

Every step it hands out at most `max_num_batched_tokens` tokens to at most `max_num_seqs` sequences:
running decodes first, then running prompts continue in chunks, then waiting prompts are admitted while
blocks and budget last. When a decode needs a block and none is free, the most recently admitted sequence is
preempted by recompute: its blocks are freed and it waits again with prompt + generated tokens as its new
prompt, so it later yields exactly the tokens it would have (its computed full blocks usually come back as
prefix-cache hits). The model runner learns what to compute from `ScheduledChunk`s and returns the sampled
token of each chunk that `samples`; `update` appends it and decides whether the sequence is finished.
The ARSequence is the request's one record: its tokens (prompt + generated, stored once), its KV progress, the
counters of its steps (which a plugin's output processor turns into its trace), and a slot each for the model
runner (`state`) and the output processor (`output`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from omni_kernel.core.errors import InputError
from omni_kernel.core.kv_blocks import BlockManager
from omni_kernel.core.request import StageInput, StageStats
from omni_kernel.core.scheduler import RequestOutput, SchedulerOutput


@attrs.frozen
class ScheduledChunk:
    """Tokens of one sequence to compute this step: `token_ids` sit at positions `start`..; their K/V go to
    the slots that `block_table` maps them to. When `samples` is set the last token's logits are sampled."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    samples: bool

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
    # the records of the sequences preempted this step (they recompute from their first token later)
    preempted: tuple[ARSequence, ...] = attrs.field(default=(), converter=tuple, eq=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@attrs.frozen
class ARPrompt:
    """What an AR stage's input processing makes of a request (StageInput.processed): the prompt's token ids,
    the token budget (None: EOS or the context window) and how the ids were built."""

    token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    max_tokens: int | None = None
    ignore_eos: bool = False
    mode: str = "raw"
    prefix_cache: bool = True  # False: every prompt token is computed (a request that wants their logits)

    def kv_slots(self, context_window: int) -> int:
        """KV slots the request may need: its prompt and its token budget, within the context window."""
        num_prompt = len(self.token_ids)
        return num_prompt + min(self.max_tokens or context_window, context_window - num_prompt)


@attrs.define(eq=False)
class ARSequence:
    """One request's record, owned by the scheduler: its tokens, KV progress and the counters of its steps."""

    item: StageInput
    token_ids: list[int]  # prompt + generated so far
    num_prompt: int
    max_tokens: int | None
    ignore_eos: bool
    state: Any = None  # the model runner's
    output: Any = None  # the output processor's
    num_computed: int = 0
    prefix_hit_tokens: int = -1  # of the first admission (re-admissions after preemption are not hits); -1: not yet
    num_preemptions: int = 0
    num_steps: int = 0
    num_prefill_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_steps: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    batch_seqs: int = 0
    batch_seqs_max: int = 0
    batch_tokens: int = 0
    num_blocks_max: int = 0

    @property
    def request_id(self) -> str:
        return self.item.request_id

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    def count_step(self, chunk: ScheduledChunk, step_ms: float, step_seqs: int, step_tokens: int) -> None:
        """Count one step that computed `chunk` of this sequence (`step_seqs` sequences, `step_tokens` tokens)."""
        if chunk.num_tokens == 1 and self.num_output and chunk.start == len(self.token_ids) - 1:
            self.num_decode_steps += 1
            self.decode_ms += step_ms
        else:  # a prompt chunk, or recompute after preemption
            self.num_prefill_steps += 1
            self.num_prefill_tokens += chunk.num_tokens
            self.prefill_ms += step_ms
        self.num_steps += 1
        self.batch_seqs += step_seqs
        self.batch_seqs_max = max(self.batch_seqs_max, step_seqs)
        self.batch_tokens += step_tokens
        self.num_blocks_max = max(self.num_blocks_max, len(chunk.block_table))


class ARScheduler:
    """Stops a request at EOS (unless it ignores EOS), at its token budget, or at the context window, in that
    order of precedence; the stage's output processor adds stop strings by aborting the request."""

    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 eos_token_ids: Iterable[int] = (), context_window: int | None = None):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_window = context_window
        self.waiting: deque[ARSequence] = deque()
        self.running: list[ARSequence] = []
        self.sequences: dict[str, ARSequence] = {}
        self.scheduled: tuple[tuple[ARSequence, ScheduledChunk], ...] = ()
        self.num_preemptions = 0

    def add(self, item: StageInput) -> ARSequence:
        prompt = item.processed
        if not isinstance(prompt, ARPrompt):
            raise TypeError("an AR request needs its input processed into an ARPrompt (StageInput.processed)")
        if not prompt.token_ids:
            raise ValueError("an AR request needs at least one prompt token")
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if self.context_window is not None and prompt.kv_slots(self.context_window) > capacity:
            # Input processing refuses this with advice; one that skipped it must not stall the whole engine.
            raise InputError(f"the prompt ({len(prompt.token_ids)} tokens) and its token budget need "
                             f"{prompt.kv_slots(self.context_window)} KV slots but this stage's KV pool holds "
                             f"{capacity} tokens")
        seq = ARSequence(item, list(prompt.token_ids), len(prompt.token_ids), prompt.max_tokens, prompt.ignore_eos)
        self.sequences[item.request_id] = seq
        self.waiting.append(seq)
        return seq

    def schedule(self) -> ARSchedulerOutput:
        """Decodes first, then running prompts in chunks, then new prompts while blocks and budget last."""
        picked: list[tuple[ARSequence, int]] = []
        preempted: list[ARSequence] = []
        budget = self._schedule_decodes(self.max_num_batched_tokens, picked, preempted)
        budget = self._schedule_prefills(budget, picked, preempted)
        if not preempted:  # admitting while others were just preempted would only preempt them again
            self._admit(budget, picked)
        return self._output(picked, preempted)

    def _schedule_decodes(self, budget: int, picked: list, preempted: list[ARSequence]) -> int:
        for seq in [s for s in self.running if s.num_pending == 1]:
            if budget == 0:
                break
            if seq in preempted:
                continue  # preempted for an earlier sequence in this loop
            while not self.blocks.can_append(seq.request_id, seq.num_computed + 1):
                victim = self._victim(seq, picked)
                if victim is seq and len(self.running) == 1:
                    raise RuntimeError("the KV pool cannot hold a single sequence; check prompt + max_tokens "
                                       "against the pool's capacity before adding")
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append_slots(seq.request_id, seq.num_computed + 1)
                picked.append((seq, 1))
                budget -= 1
        return budget

    def _schedule_prefills(self, budget: int, picked: list, preempted: list[ARSequence]) -> int:
        for seq in [s for s in self.running if s.num_pending > 1]:
            if budget == 0 or seq in preempted:
                continue
            while self._room(seq) <= 0 and (victim := self._victim(seq, picked)) is not seq:
                self._preempt(victim)
                preempted.append(victim)
            n = min(seq.num_pending, budget, self._room(seq))
            if n > 0:
                self.blocks.append_slots(seq.request_id, seq.num_computed + n)
                picked.append((seq, n))
                budget -= n
        return budget

    def admissible(self, seq: ARSequence) -> bool:
        """Whether a waiting sequence may start now (a subclass keeps one waiting, in its place, until it can)."""
        return True

    def _next_admissible(self) -> ARSequence | None:
        return next((seq for seq in self.waiting if self.admissible(seq)), None)

    def _admit(self, budget: int, picked: list) -> None:
        while budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._next_admissible()
            if seq is None:
                return
            blocks = self.blocks.match_prefix(seq.token_ids) if seq.item.processed.prefix_cache else []
            hits = len(blocks) * self.blocks.block_size
            n = min(len(seq.token_ids) - hits, budget)
            if not self.blocks.can_allocate(seq.token_ids, hits + n, blocks):
                if self.running:
                    return
                n = min(n, self.blocks.num_free * self.blocks.block_size - hits)  # alone: start with what fits
                if n <= 0 or not self.blocks.can_allocate(seq.token_ids, hits + n, blocks):
                    return
            self.waiting.remove(seq)
            seq.num_computed = self.blocks.allocate(seq.request_id, seq.token_ids, hits + n, blocks)
            if seq.prefix_hit_tokens < 0:
                seq.prefix_hit_tokens = seq.num_computed
            self.running.append(seq)
            picked.append((seq, n))
            budget -= n

    def update(self, batch: ARSchedulerOutput, results: Mapping[str, Any],
               step_ms: float = 0.0) -> list[RequestOutput]:
        """Advance what ran. `results[request_id]` is the token id sampled for a chunk that `samples`; a
        sequence that reaches a stop is freed and reported with `finished` set to the reason."""
        outputs = []
        num_seqs, num_tokens = len(self.scheduled), sum(c.num_tokens for _, c in self.scheduled)
        for seq, chunk in self.scheduled:
            if self.sequences.get(seq.request_id) is not seq:
                continue  # aborted or failed since: its K/V may be unwritten, so none of it enters the prefix cache
            seq.count_step(chunk, step_ms, num_seqs, num_tokens)
            seq.num_computed += chunk.num_tokens
            sampled = chunk.samples and seq.request_id in results
            if sampled:
                seq.token_ids.append(int(results[seq.request_id]))
            self.blocks.commit(seq.request_id, seq.token_ids, seq.num_computed)
            if sampled:
                reason = self._stop_reason(seq, seq.token_ids[-1])
                outputs.append(RequestOutput(seq.request_id, seq.token_ids[-1], reason, record=seq))
                if reason is not None:
                    self.abort(seq.request_id)
        self.scheduled = ()
        return outputs

    def _stop_reason(self, seq: ARSequence, token: int) -> str | None:
        if token in self.eos_token_ids and not seq.ignore_eos:
            return "eos"
        if seq.max_tokens is not None and seq.num_output >= seq.max_tokens:
            return "max_tokens"
        if self.context_window is not None and len(seq.token_ids) >= self.context_window:
            return "context_window"
        return None

    def abort(self, request_id: str) -> ARSequence | None:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting = deque(s for s in self.waiting if s is not seq)
        self.blocks.free(request_id)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def request_ids(self) -> set[str]:
        return set(self.sequences)

    def collect(self) -> list[RequestOutput]:
        return []  # nothing runs beside the steps

    def wait(self, timeout: float | None = None) -> bool:
        return self.has_unfinished()

    def stats(self) -> StageStats:
        return StageStats(running=len(self.running), waiting=len(self.waiting), kv_blocks_total=self.blocks.num_blocks,
                          kv_blocks_used=self.blocks.num_used, prefix_hit_tokens=self.blocks.hit_tokens)

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
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _output(self, picked: list[tuple[ARSequence, int]], preempted: list[ARSequence]) -> ARSchedulerOutput:
        chunks, scheduled = [], []
        for seq, n in picked:
            start = seq.num_computed
            chunk = ScheduledChunk(seq.request_id, tuple(seq.token_ids[start:start + n]), start,
                                   tuple(self.blocks.table(seq.request_id)), start + n == len(seq.token_ids))
            chunks.append(chunk)
            scheduled.append((seq, chunk))
        self.scheduled = tuple(scheduled)
        return ARSchedulerOutput([c.request_id for c in chunks], records=[seq for seq, _ in scheduled], chunks=chunks,
                                 block_size=self.blocks.block_size, preempted=preempted)
