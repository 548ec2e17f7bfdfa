"""ARModelRunner: one engine step of a causal LM = the KV backend's forward over every scheduled chunk, then one
batched sampling call. It keeps per request only what the model side needs: the sampler's settings and generator
in the scheduler's record (`ARSequence.state`), and the backend's cache; prompts, stops and text belong to the
stage's input and output processors.
"""

from __future__ import annotations

import time
from collections import deque

from omni_kernel.core.ar_scheduler import ARSchedulerOutput, ARSequence
from omni_kernel.core.params import ARParams

from .backends import ARBackend
from .grammar import Grammars
from .logprobs import LogprobsBook
from .sampling import Sampler, Sampling

STEP_LOG_SIZE = 10_000


class ARModelRunner:
    def __init__(self, backend: ARBackend, grammars: Grammars | None = None, logprobs: LogprobsBook | None = None):
        self.backend = backend
        self.grammars = grammars  # structured output: masks constrained rows before sampling (grammar.py)
        self.logprobs = logprobs or LogprobsBook()  # the output processors take from it
        self.sampler = Sampler()
        # (sequences, tokens, ms) of recent steps, for benchmarks; bounded so a long-lived server does not grow
        self.step_log: deque[tuple[int, int, float]] = deque(maxlen=STEP_LOG_SIZE)

    def add_request(self, seq: ARSequence) -> None:
        seq.state = Sampling.of(seq.item.params if seq.item.params is not None else ARParams())

    def run(self, batch: ARSchedulerOutput) -> dict[str, int | Exception]:
        for request_id in batch.preempted:  # they recompute from their first token later
            self.backend.free(request_id)
        start = time.perf_counter()
        every_row = self.logprobs.every_row(batch)
        if every_row:
            request_ids, logits, every = self.backend.forward_rows(batch, every_row)
        else:
            (request_ids, logits), every = self.backend.forward(batch), {}
        raw = self.logprobs.raw(logits, request_ids, batch)
        sampling = {seq.request_id: seq.state for seq in batch.records}
        failed = {}
        if self.grammars is not None and self.grammars.structures:
            logits, failed = self.grammars.mask(request_ids, logits)
        tokens = self.sampler.sample(logits, [sampling[rid] for rid in request_ids])
        if self.grammars is not None and self.grammars.active:
            tokens = self.grammars.accept(request_ids, tokens)
        tokens = [failed.get(rid, token) for rid, token in zip(request_ids, tokens)]
        self.logprobs.record(batch, request_ids, raw, tokens, every)
        self.step_log.append((len(batch.chunks), batch.num_tokens, (time.perf_counter() - start) * 1000))
        return dict(zip(request_ids, tokens))

    def free(self, seq: ARSequence) -> None:
        self.backend.free(seq.request_id)
