"""ARModelRunner: one engine step of a causal LM = the KV backend's forward over every scheduled chunk, then one
batched sampling call. What it keeps of a request is in the request's record (`ARSequence.state`, an
ARRunnerState): the sampler's settings and generator, its grammar state (structured output), the logprobs its steps
computed, and the fallback backend's KV cache. Prompts, stops and text belong to the stage's input and output
processors. The runner also holds what its stages report of the engine's KV cache (`kv`, a KVCacheSpec).
"""

from __future__ import annotations

from typing import Any

import attrs

from omni_kernel.core.ar_scheduler import ARSchedulerOutput, ARSequence
from omni_kernel.core.params import ARParams

from . import logprobs
from .backends import ARBackend
from .grammar import Constrained, Grammars
from .logprobs import StepLogprobs
from .sampling import Sampler, Sampling


@attrs.define(eq=False)
class ARRunnerState:
    """What the runner keeps of one request, in its record (`ARSequence.state`)."""

    sampling: Sampling
    constrained: Constrained | None = None  # its grammar, when its output is constrained (grammar.py)
    logprobs: StepLogprobs | None = None  # when it asked for logprobs or prompt logprobs (logprobs.py)
    kv_cache: Any = None  # the DynamicCacheBackend's cache of it (backends.py); the paged backend keeps none here


@attrs.frozen
class KVCacheSpec:
    """An engine's KV cache as its stages report it: the backend's name and ar.kv_* trace fields, the blocks, the
    K/V bytes of one token and whether shared prompt prefixes are cached."""

    backend: str
    trace: dict = attrs.field(eq=False)
    num_blocks: int
    block_size: int
    bytes_per_token: int
    prefix_caching: bool

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size


class ARModelRunner:
    def __init__(self, backend: ARBackend, kv: KVCacheSpec, grammars: Grammars | None = None):
        self.backend = backend
        self.kv = kv
        self.grammars = grammars  # structured output: masks constrained rows before sampling (grammar.py)
        self.sampler = Sampler()

    def add_request(self, seq: ARSequence) -> None:
        params = seq.item.params if seq.item.params is not None else ARParams()
        constrained = self.grammars.constrain(seq.item) if self.grammars is not None else None
        seq.state = ARRunnerState(Sampling.of(params, seq.token_ids, seq.num_prompt), constrained,
                                   logprobs.wanted(params))

    def run(self, batch: ARSchedulerOutput) -> dict[str, int | Exception]:
        for seq in batch.preempted:  # they recompute from their first token later
            self.backend.free(seq)
        every_row = logprobs.every_row(batch)
        if every_row:
            request_ids, logits, every = self.backend.forward_rows(batch, every_row)
        else:
            (request_ids, logits), every = self.backend.forward(batch), {}
        records = {seq.request_id: seq for seq in batch.records}
        rows = [records[rid] for rid in request_ids]  # the request of each logits row
        raw = logprobs.raw(logits, rows)
        constrained = [seq.state.constrained for seq in rows]
        constraining = any(c is not None for c in constrained)
        failed = {}
        if constraining:
            logits, failed = self.grammars.mask(constrained, logits)
        tokens = self.sampler.sample(logits, [seq.state.sampling for seq in rows])
        if constraining:
            tokens = self.grammars.accept(constrained, tokens)
        tokens = [failed.get(i, token) for i, token in enumerate(tokens)]
        logprobs.write(batch, rows, raw, tokens, every)
        return dict(zip(request_ids, tokens))

    def free(self, seq: ARSequence) -> None:
        self.backend.free(seq)
