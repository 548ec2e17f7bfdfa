"""The generic ModelRunner: SchedulerOutput -> executor call -> events, with failures kept per request."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs

from .errors import UserError
from .events import StageFailed, StageFinished
from .protocols import Executor
from .request import StageInput
from .scheduler import SchedulerOutput

log = logging.getLogger("omni")


@attrs.frozen
class RunnerOutput:
    """One step's events plus per-request model results (e.g. sampled token ids) for the scheduler's update.
    An executor may return one instead of a bare list of events."""

    events: list = attrs.field(factory=list, converter=list)
    results: Mapping[str, Any] = attrs.field(factory=dict)


def is_done(event) -> bool:
    return isinstance(event, (StageFinished, StageFailed))


class ModelRunner:
    def __init__(self, executor: Executor, node_id: str):
        self.executor = executor
        self.node_id = node_id

    def add_request(self, item: StageInput) -> list:
        try:
            self.executor.add_request(item)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            self.free(item.request_id)
            return [self._failure(item.request_id, exc)]
        return []

    def run(self, batch: SchedulerOutput) -> list:
        return self.execute(batch).events

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        try:
            output = self.executor.execute(batch)
            if not isinstance(output, RunnerOutput):
                output = RunnerOutput(output)
        except Exception as exc:  # noqa: BLE001 - the step failed: fail its requests, keep the engine
            output = RunnerOutput([self._failure(rid, exc) for rid in batch.request_ids])
        for event in output.events:
            if is_done(event):
                self.free(event.request_id)
        return output

    def free(self, request_id: str) -> None:
        try:
            self.executor.free(request_id)
        except Exception:  # noqa: BLE001
            log.exception("freeing request %s failed", request_id)

    def _failure(self, request_id: str, exc: Exception) -> StageFailed:
        user = isinstance(exc, UserError)
        if not user:
            log.debug("request %s failed in %s", request_id, self.node_id, exc_info=exc)
        message = str(exc) if user else f"{type(exc).__name__}: {exc}"
        return StageFailed(request_id, self.node_id, message, user_error=user)
