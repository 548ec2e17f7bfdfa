"""Step schedulers: which requests of one engine run this step, and when each one is finished.

Each scheduler keeps one record per request (StepJob here, ARSequence in ar_scheduler.py): the request's input,
its progress, and a slot each for what the model runner (`state`) and the output processor (`output`) keep of it,
so freeing a request is one removal. Every request needs a known number of steps (`num_steps(item)`, fixed when
it is added). StepScheduler runs
up to `max_batch` requests from the front of its queue that share a batch key, and whose `cost(item)` sums to at
most `max_cost` (the first always runs); DiffusionScheduler names the steps as phases (prepare, denoise 0..n-1,
decode, export), only batches requests in the same phase, and with `phase_order` runs the first listed phase
any request is in (prepare before denoise: newcomers join the denoise batch at the next step). The result of a
request's last step may be a `concurrent.futures.Future` (work the runner finishes in the background, e.g. an MP4
export): the request stays held, is not scheduled again, and finishes (`collect`) when it is done. The ARScheduler
(ar_scheduler.py) is the token-level one.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import attrs

from omni_kernel.core.request import StageInput, StageStats


@attrs.frozen
class SchedulerOutput:
    """The requests to run in one engine step, in order, with the step index each one is at and their records."""

    request_ids: tuple[str, ...] = attrs.field(converter=tuple)
    steps: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    records: tuple[Any, ...] = attrs.field(default=(), converter=tuple, eq=False, repr=False)

    def __bool__(self) -> bool:
        return bool(self.request_ids)


@attrs.frozen
class RequestOutput:
    """What one request got from one engine step: the model's result for it, and `finished` (the reason)
    when the scheduler decided it is done, or `error` when it failed. `record` is the scheduler's record of the
    request (None for one that failed before it had one), so output processing needs no bookkeeping of its own."""

    request_id: str
    result: Any = None
    finished: str | None = None
    error: BaseException | None = None
    record: Any = attrs.field(default=None, eq=False, repr=False)

    @property
    def item(self) -> StageInput | None:
        return None if self.record is None else self.record.item


@attrs.define(eq=False)
class StepJob:
    """One request's record in a StepScheduler: its input, `step` of `total` steps done, its share of a step's
    budget, what the runner and the output processor keep of it, and the future of work running beside the steps."""

    item: StageInput
    total: int
    step: int = 0
    cost: int = 1
    state: Any = None
    output: Any = None
    pending: Future | None = None

    @property
    def request_id(self) -> str:
        return self.item.request_id


@attrs.define
class StepScheduler:
    max_batch: int = 1
    batch_key: Callable[[StageInput], object] = lambda item: None
    num_steps: Callable[[StageInput], int] = lambda item: 1
    queue: deque[StepJob] = attrs.Factory(deque)
    cost: Callable[[StageInput], int] = lambda item: 1  # a request's share of the per-step budget
    max_cost: int | None = None  # None: no budget, only max_batch

    def add(self, item: StageInput) -> StepJob:
        job = StepJob(item, self._total(item), cost=self.cost(item))
        self.queue.append(job)
        return job

    def _total(self, item: StageInput) -> int:
        total = self.num_steps(item)
        if not isinstance(total, int) or total < 1:
            raise ValueError(f"a request needs at least one step, not {total!r}")
        return total

    def schedule(self) -> SchedulerOutput:
        ready = [j for j in self.queue if j.pending is None]
        if not ready:
            return SchedulerOutput(())
        key, batch, spent = self._key(self._front(ready)), [], 0
        for job in (j for j in ready if self._key(j) == key):
            if len(batch) == self.max_batch or (batch and self.max_cost is not None
                                                 and spent + job.cost > self.max_cost):
                break  # first come, first served: a later request never overtakes one that did not fit
            batch.append(job)
            spent += job.cost
        return self._output(batch)

    def update(self, batch: SchedulerOutput, results: Mapping[str, Any], step_ms: float = 0.0) -> list[RequestOutput]:
        """Advance every request that got a result; a request is finished after its last step (and, if that step
        left work running beside the steps, once it has ended: `collect`)."""
        outputs = []
        for job in batch.records:
            rid = job.request_id
            if job not in self.queue or rid not in results:
                continue  # aborted or failed since
            job.step += 1
            result = results[rid]
            if isinstance(result, Future) and job.step >= job.total:
                job.pending = result
            elif job.step >= job.total:
                self.queue.remove(job)
                outputs.append(RequestOutput(rid, result, "done", record=job))
            else:
                outputs.append(RequestOutput(rid, result, record=job))
        return outputs

    def collect(self) -> list[RequestOutput]:
        """The requests whose background work ended since the last call: finished, or failed with its error."""
        outputs = []
        for job in [j for j in self.queue if j.pending is not None and j.pending.done()]:
            self.queue.remove(job)
            error = job.pending.exception() if not job.pending.cancelled() else RuntimeError("cancelled")
            result = None if error is not None else job.pending.result()
            job.pending = None  # delivered: freeing the request now leaves what it made
            outputs.append(RequestOutput(job.request_id, result, None if error else "done", error, record=job))
        return outputs

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a step would make progress: at once with work to schedule, else until background work ends."""
        pending = [j.pending for j in self.queue if j.pending is not None]
        if len(pending) < len(self.queue) or not pending:
            return bool(self.queue)
        done, _ = concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        return bool(done)

    def abort(self, request_id: str) -> StepJob | None:
        job = next((j for j in self.queue if j.request_id == request_id), None)
        if job is not None:
            self.queue.remove(job)
        return job

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def request_ids(self) -> set[str]:
        return {j.request_id for j in self.queue}

    def stats(self) -> StageStats:
        ready = sum(j.pending is None for j in self.queue)
        running = min(ready, self.max_batch) + len(self.queue) - ready
        return StageStats(running=running, waiting=len(self.queue) - running)

    def _key(self, job: StepJob) -> object:
        return self.batch_key(job.item)

    def _front(self, ready: list[StepJob]) -> StepJob:
        return ready[0]

    def _output(self, batch: list[StepJob]) -> SchedulerOutput:
        return SchedulerOutput([j.request_id for j in batch], [j.step for j in batch], records=batch)


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

    def _key(self, job: StepJob) -> object:
        return phase_of(job.step, job.total), self.batch_key(job.item)

    def _front(self, ready: list[StepJob]) -> StepJob:
        order = {p: i for i, p in enumerate(self.phase_order)}
        phases = [phase_of(j.step, j.total) for j in ready]
        first = min(phases, key=lambda p: order.get(p, len(order)))
        return ready[phases.index(first)]

    def _output(self, batch: list[StepJob]) -> DiffusionSchedulerOutput:
        return DiffusionSchedulerOutput([j.request_id for j in batch], [j.step for j in batch], records=batch,
                                        phase=phase_of(batch[0].step, batch[0].total))
