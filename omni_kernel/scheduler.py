"""Step schedulers: which requests of one engine run this step, and when each one is finished.

Every request needs a known number of steps (`num_steps(item)`, fixed when it is added). StepScheduler runs
up to `max_batch` requests from the front of its queue that share a batch key, and whose `cost(item)` sums to at
most `max_cost` (the first always runs); DiffusionScheduler names the steps as phases (prepare, denoise 0..n-1,
decode, export), only batches requests in the same phase, and with `phase_order` runs the first listed phase
any request is in (prepare before denoise: newcomers join the denoise batch at the next step). The
ARScheduler (ar_scheduler.py) is the token-level one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from .request import StageInput


@attrs.frozen
class SchedulerOutput:
    """The requests to run in one engine step, in order, with the step index each one is at."""

    request_ids: tuple[str, ...] = attrs.field(converter=tuple)
    steps: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def __bool__(self) -> bool:
        return bool(self.request_ids)


@attrs.frozen
class RequestOutput:
    """What one request got from one engine step: the model's result for it, and `finished` (the reason)
    when the scheduler decided it is done, or `error` when it failed. `item` is the request's (processed)
    input, so output processing needs no bookkeeping of its own."""

    request_id: str
    result: Any = None
    finished: str | None = None
    error: BaseException | None = None
    stats: Mapping[str, Any] | None = None
    item: StageInput | None = None


@attrs.define(eq=False)
class Job:
    item: StageInput
    total: int
    step: int = 0
    cost: int = 1


@attrs.define
class StepScheduler:
    max_batch: int = 1
    batch_key: Callable[[StageInput], object] = lambda item: None
    num_steps: Callable[[StageInput], int] = lambda item: 1
    queue: deque[Job] = attrs.Factory(deque)
    cost: Callable[[StageInput], int] = lambda item: 1  # a request's share of the per-step budget
    max_cost: int | None = None  # None: no budget, only max_batch

    def add(self, item: StageInput) -> None:
        self.queue.append(Job(item, self._total(item), cost=self.cost(item)))

    def _total(self, item: StageInput) -> int:
        total = self.num_steps(item)
        if not isinstance(total, int) or total < 1:
            raise ValueError(f"a request needs at least one step, not {total!r}")
        return total

    def schedule(self) -> SchedulerOutput:
        if not self.queue:
            return SchedulerOutput(())
        key, batch, spent = self._key(self._front()), [], 0
        for job in (j for j in self.queue if self._key(j) == key):
            if len(batch) == self.max_batch or (batch and self.max_cost is not None
                                                 and spent + job.cost > self.max_cost):
                break  # first come, first served: a later request never overtakes one that did not fit
            batch.append(job)
            spent += job.cost
        return self._output(batch)

    def update(self, batch: SchedulerOutput, results: Mapping[str, Any], step_ms: float = 0.0) -> list[RequestOutput]:
        """Advance every request that got a result; a request is finished after its last step."""
        jobs = {j.item.request_id: j for j in self.queue}
        outputs = []
        for rid in batch.request_ids:
            job = jobs.get(rid)
            if job is None or rid not in results:
                continue  # aborted or failed since
            job.step += 1
            done = job.step >= job.total
            if done:
                self.queue.remove(job)
            outputs.append(RequestOutput(rid, results[rid], "done" if done else None, item=job.item))
        return outputs

    def abort(self, request_id: str) -> None:
        self.queue = deque(j for j in self.queue if j.item.request_id != request_id)

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def request_ids(self) -> set[str]:
        return {j.item.request_id for j in self.queue}

    def _key(self, job: Job) -> object:
        return self.batch_key(job.item)

    def _front(self) -> Job:
        return self.queue[0]

    def _output(self, batch: list[Job]) -> SchedulerOutput:
        return SchedulerOutput([j.item.request_id for j in batch], [j.step for j in batch])


@attrs.frozen
class DiffusionSchedulerOutput(SchedulerOutput):
    phase: str = "prepare"


def phase_of(step: int, total: int) -> str:
    """prepare, denoise (steps 1..total-3), decode, export."""
    if step == 0:
        return "prepare"
    return "denoise" if step < total - 2 else "decode" if step == total - 2 else "export"


@attrs.define
class DiffusionScheduler(StepScheduler):
    """`num_steps(item)` is the request's denoise steps; the scheduler adds prepare, decode and export. The
    step index of a denoise phase is `step - 1`. `phase_order` () runs the front request's phase."""

    phase_order: tuple[str, ...] = ()

    def _total(self, item: StageInput) -> int:
        denoise = self.num_steps(item)
        if not isinstance(denoise, int) or denoise < 0:
            raise ValueError(f"a diffusion request needs >= 0 denoise steps, not {denoise!r}")
        return denoise + 3

    def _key(self, job: Job) -> object:
        return phase_of(job.step, job.total), self.batch_key(job.item)

    def _front(self) -> Job:
        order = {p: i for i, p in enumerate(self.phase_order)}
        phases = [phase_of(j.step, j.total) for j in self.queue]
        first = min(phases, key=lambda p: order.get(p, len(order)))
        return self.queue[phases.index(first)]

    def _output(self, batch: list[Job]) -> DiffusionSchedulerOutput:
        return DiffusionSchedulerOutput([j.item.request_id for j in batch], [j.step for j in batch],
                                        phase=phase_of(batch[0].step, batch[0].total))
