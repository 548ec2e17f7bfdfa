"""Step schedulers: which requests of one engine run this step, and when each one is finished.

Each scheduler keeps one record per request (StepJob here, ARSequence in ar_scheduler.py): the request's input,
its progress, and a slot each for what the model runner (`state`) and the output processor (`output`) keep of it,
so freeing a request is one removal.

- StepScheduler: every request needs a known number of steps (`num_steps(item)`, fixed when it is added). A step
  runs up to `max_batch` requests from the front of the queue that share a batch key, and whose `cost(item)` sums
  to at most `max_cost` (the first always runs).
- PhaseScheduler: a StepScheduler whose steps have names, given by the plugin: `phases(item)` is a request's
  phase names, one per step (its length is the request's step count). Only requests in the same phase (and batch
  key) share a step, and with `phase_order` a step runs the first listed phase any ready request is in.

A step's result for a request may be a `concurrent.futures.Future` (work the runner finishes in the background,
e.g. writing a file): the request is held, not scheduled again, until the Future is done (`collect`); then it
goes on with its next step, or, after its last step, finishes. The ARScheduler (ar_scheduler.py) is the
token-level one.

A request whose input streams in (`StageInput.stream`, a streaming edge's target) is `open`: `extend` gives it each
chunk's input as it comes and counts its steps again; it waits, unscheduled, with every step so far done, until
the next chunk, and finishes after its last chunk's steps (at once, in `collect`, when the last adds none).
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from collections.abc import Callable, Mapping, Sequence
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
    budget, what the runner and the output processor keep of it, the future of work running beside the steps, and
    (in a PhaseScheduler) the name of each of its steps."""

    item: StageInput
    total: int
    step: int = 0
    cost: int = 1
    state: Any = None
    output: Any = None
    pending: Future | None = None
    phases: tuple[str, ...] = ()
    open: bool = False  # its input streams in: more steps may come (StepScheduler.extend)

    @property
    def request_id(self) -> str:
        return self.item.request_id

    @property
    def phase(self) -> str | None:
        """The name of the step it is at (None: a StepScheduler's steps have none, or every step is done)."""
        if self.step < len(self.phases):
            return self.phases[self.step]
        return None


@attrs.define
class StepScheduler:
    max_batch: int = 1
    batch_key: Callable[[StageInput], object] = lambda item: None
    num_steps: Callable[[StageInput], int] = lambda item: 1
    queue: deque[StepJob] = attrs.Factory(deque)
    cost: Callable[[StageInput], int] = lambda item: 1  # a request's share of the per-step budget
    max_cost: int | None = None  # None: no budget, only max_batch
    # the counters the model runner keeps (e.g. step-cache hits): StageStats.model, in stats()
    model_stats: Callable[[], Mapping[str, int | float]] = lambda: {}

    def add(self, item: StageInput) -> StepJob:
        job = self._new_job(item)
        job.open = item.stream
        self.queue.append(job)
        return job

    def _new_job(self, item: StageInput) -> StepJob:
        return StepJob(item, self._count(item), cost=self.cost(item))

    def _count(self, item: StageInput) -> int:
        total = self.num_steps(item)
        if not isinstance(total, int) or total < (0 if item.stream else 1):
            raise ValueError(f"a request needs at least one step, not {total!r}")
        return total

    def extend(self, request_id: str, extend: Callable[[StageInput], StageInput], last: bool) -> StepJob | None:
        """Give an open request its input with the next chunk (`extend(item)`) and count its steps again; after the
        `last` chunk it finishes once those are done. None: no such request (aborted or failed since)."""
        job = next((j for j in self.queue if j.request_id == request_id), None)
        if job is None:
            return None
        if not job.open:
            raise ValueError(f"request {request_id!r} takes no more input")
        item = extend(job.item)
        total = self._count(item)
        if total < job.total:
            raise ValueError(f"request {request_id!r}: a chunk took back steps ({job.total} -> {total})")
        job.item, job.total, job.open = item, total, not last
        if last and job.step >= job.total and job.pending is None:
            job.pending = Future()  # nothing left to run: it finishes at the next collect
            job.pending.set_result(None)
        return job

    def _ready(self) -> list[StepJob]:
        """The requests a step may run: not held by background work, nor waiting for their input's next chunk."""
        return [j for j in self.queue if j.pending is None and j.step < j.total]

    def schedule(self) -> SchedulerOutput:
        ready = self._ready()
        if not ready:
            return SchedulerOutput(())
        key = self._key(self._front(ready))
        batch: list[StepJob] = []
        spent = 0
        for job in ready:
            if self._key(job) != key:
                continue
            if len(batch) == self.max_batch or (batch and not self._fits(spent + job.cost)):
                break  # first come, first served: a later request never overtakes one that did not fit
            batch.append(job)
            spent += job.cost
        return self._output(batch)

    def _fits(self, cost: int) -> bool:
        return self.max_cost is None or cost <= self.max_cost

    def update(self, batch: SchedulerOutput, results: Mapping[str, Any], step_ms: float = 0.0) -> list[RequestOutput]:
        """Advance every request that got a result; a request is finished after its last step. A Future as the
        result holds the request until it is done (`collect`)."""
        outputs = []
        for job in batch.records:
            rid = job.request_id
            if job not in self.queue or rid not in results:
                continue  # aborted or failed since
            job.step += 1
            result = results[rid]
            if isinstance(result, Future):
                job.pending = result
            elif job.step >= job.total and not job.open:
                self.queue.remove(job)
                outputs.append(RequestOutput(rid, result, "done", record=job))
            else:
                outputs.append(RequestOutput(rid, result, record=job))
        return outputs

    def collect(self) -> list[RequestOutput]:
        """The requests whose background work ended since the last call, with what it made as their step's
        result: finished after their last step, going on with the next one otherwise, or failed with its error."""
        outputs = []
        for job in [j for j in self.queue if j.pending is not None and j.pending.done()]:
            outputs.append(self._collect(job))
        return outputs

    def _collect(self, job: StepJob) -> RequestOutput:
        pending, job.pending = job.pending, None  # delivered: freeing the request now leaves what it made
        error = RuntimeError("cancelled") if pending.cancelled() else pending.exception()
        if error is not None:
            self.queue.remove(job)
            return RequestOutput(job.request_id, error=error, record=job)
        if job.step >= job.total and not job.open:
            self.queue.remove(job)
            return RequestOutput(job.request_id, pending.result(), "done", record=job)
        return RequestOutput(job.request_id, pending.result(), record=job)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a step would make progress: at once with work to schedule, else until background work ends."""
        if self._ready():
            return True
        pending = [j.pending for j in self.queue if j.pending is not None]
        if not pending:
            return False  # empty, or open requests waiting for their next chunk
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
        ready = len(self._ready())
        running = min(ready, self.max_batch) + len(self.queue) - ready
        return StageStats(running=running, waiting=len(self.queue) - running, model=self.model_stats())

    def _key(self, job: StepJob) -> object:
        return self.batch_key(job.item)

    def _front(self, ready: list[StepJob]) -> StepJob:
        return ready[0]

    def _output(self, batch: list[StepJob]) -> SchedulerOutput:
        return SchedulerOutput([j.request_id for j in batch], [j.step for j in batch], records=batch)


@attrs.frozen
class PhaseSchedulerOutput(SchedulerOutput):
    """A PhaseScheduler's step: every request in it is at the step named `phase`."""

    phase: str = ""


def _no_num_steps(item: StageInput) -> int:
    raise TypeError("a PhaseScheduler counts a request's steps by its phases(item)")


@attrs.define
class PhaseScheduler(StepScheduler):
    """`phases(item)` names a request's steps, one name per step (fixed when it is added; its length is the
    request's step count, so `num_steps` is not a setting here). A step runs requests of one phase and batch key;
    `phase_order` (phase names) picks the phase: the first listed one any ready request is in (a phase not listed
    comes after those listed), else the front request's."""

    phases: Callable[[StageInput], Sequence[str]] = lambda item: ("step",)
    phase_order: tuple[str, ...] = ()
    num_steps: Callable[[StageInput], int] = attrs.field(default=_no_num_steps, init=False, repr=False)

    def _new_job(self, item: StageInput) -> StepJob:
        phases = tuple(self.phases(item))
        if not phases or not all(isinstance(p, str) for p in phases):
            raise ValueError(f"a request needs at least one step, named by a phase, not {phases!r}")
        return StepJob(item, len(phases), cost=self.cost(item), phases=phases)

    def _key(self, job: StepJob) -> object:
        return job.phase, self.batch_key(job.item)

    def _front(self, ready: list[StepJob]) -> StepJob:
        order = {phase: i for i, phase in enumerate(self.phase_order)}
        return min(ready, key=lambda job: order.get(job.phase, len(order)))

    def _output(self, batch: list[StepJob]) -> PhaseSchedulerOutput:
        return PhaseSchedulerOutput([j.request_id for j in batch], [j.step for j in batch], records=batch,
                                    phase=batch[0].phase)
