"""Engine: a Scheduler plus a model runner. step() = schedule -> run -> update.

The scheduler owns every request's progress and decides when it is finished; the model runner returns one
result per request (a sampled token, denoised latents) or an exception for a request that failed alone. An
exception from the runner fails that step's batch; one from the scheduler leaves it inconsistent, so the
engine is marked dead and fails everything it holds.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .errors import EngineDead
from .protocols import ModelRunner, Scheduler
from .request import StageInput
from .scheduler import RequestOutput

log = logging.getLogger("omni")


class Engine:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner):
        self.scheduler = scheduler
        self.runner = runner
        self.failed: list[RequestOutput] = []  # add-time failures, reported by the next step
        self.dead: EngineDead | None = None

    def add_request(self, item: StageInput) -> None:
        if self.dead is not None:
            self.failed.append(RequestOutput(item.request_id, error=self.dead))
            return
        try:
            self.runner.add_request(item)
            self.scheduler.add(item)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            self._free(item.request_id)
            self.failed.append(RequestOutput(item.request_id, error=exc))

    def step(self) -> list[RequestOutput]:
        outputs, self.failed = self.failed, []
        if self.dead is not None:
            return outputs
        try:
            batch = self.scheduler.schedule()
            if not batch:
                return outputs
            results, step_ms = self._run(batch)
            errors = {rid: r for rid, r in results.items() if isinstance(r, BaseException)}
            for rid in errors:
                self.scheduler.abort(rid)
            done = self.scheduler.update(batch, {k: v for k, v in results.items() if k not in errors},
                                         step_ms)
        except Exception as exc:  # noqa: BLE001 - the scheduler's state can no longer be trusted
            return outputs + self._die(exc)
        for rid, exc in errors.items():
            self._free(rid)
            outputs.append(RequestOutput(rid, error=exc))
        for out in done:
            if out.finished is not None:
                self._free(out.request_id)
        return outputs + done

    def abort(self, request_id: str) -> None:
        held = request_id in self.scheduler.request_ids()
        self.scheduler.abort(request_id)
        self.failed = [o for o in self.failed if o.request_id != request_id]
        if held:
            self._free(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.failed) or (self.dead is None and self.scheduler.has_unfinished())

    def request_ids(self) -> set[str]:
        held = set() if self.dead is not None else self.scheduler.request_ids()
        return held | {o.request_id for o in self.failed}

    def _run(self, batch) -> tuple[dict[str, Any], float]:
        start = time.perf_counter()
        try:
            results = dict(self.runner.run(batch))
        except Exception as exc:  # noqa: BLE001 - the step failed: fail its requests, keep the engine
            log.debug("engine step failed", exc_info=exc)
            results = {rid: exc for rid in batch.request_ids}
        return results, (time.perf_counter() - start) * 1000

    def _die(self, exc: Exception) -> list[RequestOutput]:
        log.error("engine failed and was stopped: %s: %s", type(exc).__name__, exc, exc_info=exc)
        self.dead = EngineDead(f"the stage's engine failed and takes no more requests "
                               f"({type(exc).__name__}: {' '.join(str(exc).split())})")
        held = self.scheduler.request_ids()
        for rid in held:
            self._free(rid)
        return [RequestOutput(rid, error=self.dead) for rid in sorted(held)]

    def _free(self, request_id: str) -> None:
        try:
            self.runner.free(request_id)
        except Exception:  # noqa: BLE001 - freeing must not fail the step
            log.exception("freeing request %s failed", request_id)
