"""Generic schedulers: which requests of one engine run this step.

RequestScheduler admits requests FIFO up to `max_num_seqs` and runs every admitted request each step (an AR
engine decodes all of them). StepScheduler runs step-wise work (denoise steps): each step it takes up to
`max_batch` requests from the front of the queue that share a batch key, so batching is a policy value.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import attrs

from .request import StageInput


@attrs.frozen
class SchedulerOutput:
    """The requests to run in one engine step, in order."""

    request_ids: tuple[str, ...] = attrs.field(converter=tuple)
    items: tuple[StageInput, ...] = attrs.field(converter=tuple)

    def __bool__(self) -> bool:
        return bool(self.request_ids)


@attrs.define
class RequestScheduler:
    max_num_seqs: int = 16
    waiting: deque[StageInput] = attrs.Factory(deque)
    running: list[StageInput] = attrs.Factory(list)

    def add(self, item: StageInput) -> None:
        self.waiting.append(item)

    def schedule(self) -> SchedulerOutput:
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.popleft())
        return SchedulerOutput([i.request_id for i in self.running], self.running)

    def update(self, done: Iterable[str], results=None) -> None:
        done = set(done)
        self.running = [i for i in self.running if i.request_id not in done]

    def abort(self, request_id: str) -> None:
        self.waiting = deque(i for i in self.waiting if i.request_id != request_id)
        self.update([request_id])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)


@attrs.define
class StepScheduler:
    max_batch: int = 1
    batch_key: Callable[[StageInput], object] = lambda item: None
    queue: deque[StageInput] = attrs.Factory(deque)

    def add(self, item: StageInput) -> None:
        self.queue.append(item)

    def schedule(self) -> SchedulerOutput:
        if not self.queue:
            return SchedulerOutput((), ())
        key = self.batch_key(self.queue[0])
        batch = [i for i in self.queue if self.batch_key(i) == key][: self.max_batch]
        return SchedulerOutput([i.request_id for i in batch], batch)

    def update(self, done: Iterable[str], results=None) -> None:
        done = set(done)
        self.queue = deque(i for i in self.queue if i.request_id not in done)

    def abort(self, request_id: str) -> None:
        self.update([request_id])

    def has_unfinished(self) -> bool:
        return bool(self.queue)
