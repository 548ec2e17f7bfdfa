"""ARModelRunner: one engine step of a causal LM = the KV backend's forward over every scheduled chunk, then one
batched sampling call. It keeps per request only what the model side needs (the sampler's generator; the
backend's cache); prompts, stops and text belong to the stage's input and output processors.
"""

from __future__ import annotations

import time
from collections import deque

from omni_kernel.ar_scheduler import ARPrompt, ARSchedulerOutput
from omni_kernel.params import ARParams
from omni_kernel.request import StageInput

from .backends import ARBackend
from .inputs import check_fits
from .sampling import Sampler, Sampling

STEP_LOG_SIZE = 10_000


class ARModelRunner:
    def __init__(self, backend: ARBackend, context_window: int, capacity_tokens: int | None = None):
        self.backend = backend
        self.context_window = context_window
        self.capacity_tokens = capacity_tokens
        self.sampler = Sampler()
        self.requests: dict[str, Sampling] = {}
        # (sequences, tokens, ms) of recent steps, for benchmarks; bounded so a long-lived server does not grow
        self.step_log: deque[tuple[int, int, float]] = deque(maxlen=STEP_LOG_SIZE)

    def add_request(self, item: StageInput) -> None:
        # Input processing refused this already; an item that skipped it must not stall the whole engine.
        if isinstance(item.processed, ARPrompt):
            check_fits(item.processed, self.context_window, self.capacity_tokens)
        self.requests[item.request_id] = Sampling.of(item.params if item.params is not None else ARParams())

    def run(self, batch: ARSchedulerOutput) -> dict[str, int | Exception]:
        for request_id in batch.preempted:  # they recompute from their first token later
            self.backend.free(request_id)
        start = time.perf_counter()
        request_ids, logits = self.backend.forward(batch)
        tokens = self.sampler.sample(logits, [self.requests[rid] for rid in request_ids])
        self.step_log.append((len(batch.chunks), batch.num_tokens, (time.perf_counter() - start) * 1000))
        return dict(zip(request_ids, tokens))

    def free(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.backend.free(request_id)
