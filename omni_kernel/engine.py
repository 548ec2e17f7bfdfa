"""Engine: a Scheduler plus a ModelRunner. step() = schedule -> run -> update."""

from __future__ import annotations

from .request import StageInput
from .runner import ModelRunner, is_done


class Engine:
    def __init__(self, scheduler, runner: ModelRunner):
        self.scheduler = scheduler
        self.runner = runner
        self.pending: list = []  # failures found at add time, reported on the next step

    def add_request(self, item: StageInput) -> None:
        failures = self.runner.add_request(item)
        if failures:
            self.pending.extend(failures)
        else:
            self.scheduler.add(item)

    def step(self) -> list:
        events, self.pending = self.pending, []
        batch = self.scheduler.schedule()
        results = None
        if batch:
            output = self.runner.execute(batch)
            events += output.events
            results = output.results
        done = [e.request_id for e in events if is_done(e)]
        self.scheduler.update(done, results)
        return events

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.pending = [e for e in self.pending if e.request_id != request_id]
        self.runner.free(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.pending) or self.scheduler.has_unfinished()
